"""Size of every registered compressor's program lowered for GPU and TPU, from a CPU host.

For each compressor in ``jaxcomm.compressors.names()`` (GRACE Fig. 8's
settings, ``compressors.py``'s ``KWARGS``: 1 % density for the sparsifiers) and
each size, this lowers one jitted ``decompress(compress(x, key))`` of a float32
tensor of that many entries (the near-square matrix of ``grace_compare.py``:
1024 x 1024 for 1,048,576 entries, 5120 x 5120 for 26,214,400, so that
PowerSGD compresses it too) for each platform with

    jax.jit(f).trace(x, key).lower(lowering_platforms=(platform,)).as_text()

and records the StableHLO text's length in characters, its number of
operations (every ``stablehlo.``/``chlo.``/``mhlo.``/``func.`` op) and a count
per op name. Nothing is compiled or run: ``x`` is a ``jax.ShapeDtypeStruct``,
so any size costs the same, and no GPU or TPU is needed (the installed
jaxlib lowers for ``cuda``, ``rocm``, ``tpu`` and ``cpu``). The module's size
is a proxy for its compile cost on that platform: loops, conditionals and
scans are what a GPU compiler spends its time on.

The sparsifiers (``LARGE``) are lowered at 26,214,400 entries too, the size at
which a top-k once did not compile within 100 s on an H100.

usage: python experiments/benchmarks/lowering.py [--sizes 1048576] [--large-sizes 26214400]
       [--platforms cuda,tpu] [--only topk,dgc] [--out experiments/benchmarks/results/lowering.json]
       | --markdown JSON [--before JSON]
"""

from __future__ import annotations

import argparse
import collections
import importlib.util
import json
import os
import re
import sys
import time
from pathlib import Path

os.environ.setdefault("JAX_PLATFORMS", "cpu")

import jax
import jax.numpy as jnp

import jaxcomm as jc

DEFAULT_SIZES = (1_048_576,)
DEFAULT_LARGE_SIZES = (26_214_400,)
DEFAULT_PLATFORMS = ("cuda", "tpu")
DEFAULT_OUT = Path(__file__).resolve().parent / "results" / "lowering.json"
LARGE = ("topk", "dgc", "randomk", "adaptive", "qsparse", "threshold", "random_sparsification")
"""The selection-based compressors, also lowered at ``--large-sizes``."""
_OP = re.compile(r"\b(?:stablehlo|chlo|mhlo|func)\.[a-z_]+")


def _load_grace_compare():
    """``grace_compare.py`` beside this file (its ``matrix_shape`` and its ``compressors.py`` as ``bench``)."""
    path = Path(__file__).with_name("grace_compare.py")
    spec = importlib.util.spec_from_file_location("_lowering_grace_compare", path)
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


grace_compare = _load_grace_compare()
bench = grace_compare.bench


def lowered_texts(c, shape, platforms) -> dict[str, str]:
    """StableHLO text of the jitted ``decompress(compress(x, key))`` of ``c`` on a float32 ``shape``,
    lowered for each of ``platforms`` from one trace (nothing compiled or run)."""
    x = jax.ShapeDtypeStruct(tuple(shape), jnp.float32)
    key = jax.ShapeDtypeStruct((2,), jnp.uint32)
    traced = bench.roundtrip_fn(c).trace(x, key)
    return {p: traced.lower(lowering_platforms=(p,)).as_text() for p in platforms}


def op_counts(text: str) -> dict[str, int]:
    """Number of each operation (``stablehlo.add``, ``chlo.top_k``, ...) in a StableHLO text."""
    return dict(sorted(collections.Counter(_OP.findall(text)).items()))


def measure(name: str, d: int, platforms) -> list[dict]:
    """One row per platform: characters, operations and per-op counts of ``name`` lowered at ``d`` entries
    (``lower_s``: trace and lowering seconds, per platform)."""
    kwargs = bench.KWARGS.get(name, {})
    shape = grace_compare.matrix_shape(d)
    rows = []
    t0 = time.perf_counter()
    try:
        texts = lowered_texts(jc.compressors.make(name, **kwargs), shape, platforms)
        error = None
    except Exception as e:  # record and go on: one compressor's failure must not end the sweep
        texts, error = {}, f"{type(e).__name__}: {e}"
    lower_s = (time.perf_counter() - t0) / len(platforms)
    for platform in platforms:
        row = dict(name=name, kwargs=kwargs, size=d, shape=list(shape), platform=platform)
        if error is None:
            ops = op_counts(texts[platform])
            row.update(chars=len(texts[platform]), ops=sum(ops.values()), lower_s=lower_s, op_counts=ops)
        else:
            row["error"] = error
        rows.append(row)
    return rows


def _key(r) -> tuple:
    return (r["name"], r["size"], r["platform"])


def markdown_table(res: dict, before: dict | None = None) -> str:
    """Rows: (compressor, size); per platform the characters and ops (``before -> after`` with ``before``)."""
    platforms = res["platforms"]
    old = {_key(r): r for r in before["results"]} if before else {}

    def cell(r, field):
        if "error" in r:
            return "error"
        o = old.get(_key(r))
        if o is None or field not in o:
            return f"{r[field]:,}"
        return f"{o[field]:,} -> {r[field]:,}"

    head = "| compressor | entries | " + " | ".join(f"{p} chars | {p} ops" for p in platforms) + " |"
    lines = [head, "|---|---:|" + "---:|---:|" * len(platforms)]
    by = collections.defaultdict(dict)
    for r in res["results"]:
        by[(r["name"], r["size"])][r["platform"]] = r
    for (name, size), per in sorted(by.items(), key=lambda kv: (kv[0][1], kv[0][0])):
        cells = " | ".join(f"{cell(per[p], 'chars')} | {cell(per[p], 'ops')}" for p in platforms if p in per)
        lines.append(f"| {name} | {size:,} | {cells} |")
    return "\n".join(lines)


def main(argv=None) -> dict:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--sizes", default=",".join(map(str, DEFAULT_SIZES)), help="entry counts, every compressor")
    ap.add_argument(
        "--large-sizes",
        default=",".join(map(str, DEFAULT_LARGE_SIZES)),
        help=f"entry counts for the selection compressors only ({','.join(LARGE)}); empty: none",
    )
    ap.add_argument("--platforms", default=",".join(DEFAULT_PLATFORMS), help="lowering platforms: cuda, rocm, tpu, cpu")
    ap.add_argument("--only", default="", help="comma-separated compressor names (default: all registered)")
    ap.add_argument("--out", default=str(DEFAULT_OUT), help="JSON output path")
    ap.add_argument("--markdown", metavar="JSON", help="print the table of a results file and exit")
    ap.add_argument("--before", metavar="JSON", help="with --markdown: an earlier results file (before -> after)")
    args = ap.parse_args(argv)
    if args.markdown:
        res = json.loads(Path(args.markdown).read_text())
        before = json.loads(Path(args.before).read_text()) if args.before else None
        print(markdown_table(res, before))
        return res
    try:
        sizes = [int(s) for s in args.sizes.split(",") if s.strip()]
        large = [int(s) for s in args.large_sizes.split(",") if s.strip()]
    except ValueError:
        ap.error(f"--sizes and --large-sizes take comma-separated integers; got {args.sizes!r}, {args.large_sizes!r}")
    if not sizes or min(sizes + large) < 1:
        ap.error("--sizes needs at least one entry count, and every count must be >= 1")
    platforms = [p.strip() for p in args.platforms.split(",") if p.strip()]
    bad = [p for p in platforms if p not in ("cuda", "rocm", "tpu", "cpu")]
    if bad or not platforms:
        ap.error(f"--platforms takes cuda, rocm, tpu or cpu; got {args.platforms!r}")
    names = jc.compressors.names()
    if args.only:
        wanted = [n.strip() for n in args.only.split(",") if n.strip()]
        unknown = [n for n in wanted if n not in names]
        if unknown:
            ap.error(f"unknown compressor(s) {unknown}; registered: {names}")
        names = wanted
    rows = []
    for name in names:
        for d in sizes + (large if name in LARGE else []):
            rows.extend(measure(name, d, platforms))
    result = dict(
        benchmark="lowering",
        method="len(jax.jit(decompress(compress(x, key))).trace(x, key).lower(lowering_platforms=(p,)).as_text()) "
        "and its operation count, x a float32 near-square matrix; nothing compiled",
        command=" ".join(["python", "experiments/benchmarks/lowering.py", *(sys.argv[1:] if argv is None else argv)]),
        jax=jax.__version__,
        platforms=platforms,
        sizes=sizes,
        large_sizes=large,
        kwargs=bench.KWARGS,
        results=rows,
    )
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(result, indent=1))
    print(markdown_table(result))
    for r in rows:
        if "error" in r:
            print(f"error {r['name']}@{r['size']} {r['platform']}: {r['error']}")
    print(f"wrote {out}")
    return result


if __name__ == "__main__":
    main()
