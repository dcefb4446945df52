"""Counts in the committed results files are integers: check them, or rewrite the old float ones.

    python scripts/results_counts.py           # list every count held as a float; exit 1 if any
    python scripts/results_counts.py --write   # rewrite those counts as ints, in place

Results written before the library wrote its counts as ints hold them as floats
(``"wire_bits": 879360.0``, ``"messages": 12.0``). The fields are read by name, wherever
they occur in a file (``*.json`` under ``experiments/*/results/`` and ``docs/``):

- exact counts (:data:`COUNTS`): every value must be an ``int``; ``--write`` converts a
  float only if it is a whole number >= 0 and refuses the file otherwise;
- per-worker shares (:data:`SHARES`, a count summed over workers divided by their number):
  an ``int`` when the division is exact, a ``float`` only when it is not (a mean of
  count-prefixed payloads that differ between workers); ``--write`` converts whole floats
  and keeps fractional ones. Old Trainer histories hold ``wire_bits`` (one step's mean over
  workers) where new ones hold ``wire_bits_total`` (the exact sum): the name is kept, no total
  is made up;
- event flags (:data:`FLAGS`): ``true``/``false``; ``--write`` converts ``0.0``/``1.0``.

``--write`` keeps each file's layout (indent, key order, ASCII escaping, final newline), so
the diff holds the changed numbers only. It is safe to re-run: a file that holds no float
count is not touched.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from jaxcomm._validate import as_count  # noqa: E402  (NumPy only: no JAX import)

COUNTS = ("wire_bits_total", "messages", "dense_bits_per_worker", "undelivered", "counts")
"""Exact counts: bits summed over workers, messages, dense bits, undelivered gradients,
gradients delivered per staleness."""
SHARES = ("wire_bits", "wire_bits_per_worker")
"""One worker's share of a count (``per_worker``: an int when it divides exactly)."""
FLAGS = ("fired",)
"""Per-step event flags (EventGraD's trigger trace)."""


def results_files(root: Path = ROOT) -> list[Path]:
    """Every committed results file: ``experiments/*/results/**/*.json`` and ``docs/**/*.json``."""
    return sorted({*root.glob("experiments/*/results/**/*.json"), *root.glob("docs/**/*.json")})


def _fix(value, key: str, where: str, problems: list[str]):
    """``value`` of field ``key`` in its right type; each float count found is added to ``problems``."""
    if isinstance(value, list):
        return [_fix(v, key, where, problems) for v in value]
    if not isinstance(value, float):
        return value
    if key in FLAGS:
        if value not in (0.0, 1.0):
            raise ValueError(f"{where}: {key} = {value!r} is not a flag (0 or 1)")
        problems.append(f"{where}: {key} = {value!r} (a flag held as a float)")
        return value == 1.0
    if key in SHARES and not value.is_integer():
        return value  # a fractional mean over workers: a float is right
    problems.append(f"{where}: {key} = {value!r} (a count held as a float)")
    return as_count(value, f"{where}: {key}")  # ValueError unless a whole number >= 0


def _walk(node, where: str, problems: list[str]):
    if isinstance(node, dict):
        return {
            k: _fix(v, k, where, problems) if k in (*COUNTS, *SHARES, *FLAGS) else _walk(v, where, problems)
            for k, v in node.items()
        }
    if isinstance(node, list):
        return [_walk(v, where, problems) for v in node]
    return node


def _layout(text: str, data) -> dict:
    """The ``json.dumps`` arguments (and final newline) that reproduce ``text`` from ``data``."""
    for indent in (2, 1, 4, None):
        for ensure_ascii in (True, False):
            dumped = json.dumps(data, indent=indent, ensure_ascii=ensure_ascii)
            for newline in ("", "\n"):
                if dumped + newline == text:
                    return {"indent": indent, "ensure_ascii": ensure_ascii, "newline": newline}
    raise ValueError("its layout is not one json.dumps writes (indent 1, 2, 4 or none); not rewritten")


def _shown(path: Path) -> str:
    path = path.resolve()
    return str(path.relative_to(ROOT) if path.is_relative_to(ROOT) else path)


def float_counts(path: Path, write: bool = False) -> list[str]:
    """The count fields of ``path`` held as floats; with ``write``, the file rewritten with them as ints."""
    text = path.read_text()
    data = json.loads(text)
    problems: list[str] = []
    fixed = _walk(data, _shown(path), problems)
    if write and problems:
        layout = _layout(text, data)
        newline = layout.pop("newline")
        path.write_text(json.dumps(fixed, **layout) + newline)
    return problems


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--write", action="store_true", help="rewrite the float counts as ints, in place")
    parser.add_argument("paths", nargs="*", type=Path, help="results files (default: every committed one)")
    args = parser.parse_args(argv)
    found = 0
    for path in args.paths or results_files():
        try:
            problems = float_counts(path, write=args.write)
        except ValueError as e:
            print(f"error: {_shown(path)}: {e}", file=sys.stderr)
            return 2
        found += len(problems)
        if problems:
            print(f"{_shown(path)}: {len(problems)} float counts" + (" rewritten as ints" if args.write else ""))
    if not args.write and found:
        print(f"{found} counts held as floats; `python scripts/results_counts.py --write` rewrites them")
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
