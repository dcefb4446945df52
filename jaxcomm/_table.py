"""Markdown tables for the command line's summaries (shared by :mod:`jaxcomm.cli` and :mod:`jaxcomm.demo`)."""

from __future__ import annotations

__all__ = ["format_table"]


def format_table(rows: list[dict], columns: list[str] | None = None) -> str:
    """Render a list of dicts as a Markdown table (floats to 4 significant digits).

    ``columns`` defaults to every key, in order of first appearance; a missing
    cell is empty. An empty ``rows`` gives ``"(no rows)"``.
    """
    if not rows:
        return "(no rows)"
    columns = columns or list(dict.fromkeys(k for r in rows for k in r))

    def fmt(v):
        if isinstance(v, float):
            return f"{v:.4g}"
        return str(v)

    cells = [[fmt(r.get(c, "")) for c in columns] for r in rows]
    widths = [max(len(c), *(len(row[i]) for row in cells)) for i, c in enumerate(columns)]
    line = lambda vals: "| " + " | ".join(v.ljust(w) for v, w in zip(vals, widths)) + " |"
    out = [line(columns), "|" + "|".join("-" * (w + 2) for w in widths) + "|"]
    out += [line(r) for r in cells]
    return "\n".join(out)
