"""The bytes one device hands to the collectives of an HLO module (lowered or compiled text).

A collective's bytes per worker are its operand's: an all-gather's result divided by the
number of workers ``n``, a reduce-scatter's result times ``n``, the result itself for an
all-reduce, a collective-permute and an all-to-all (tuple results: every element). A
collective inside a ``conditional``'s branch runs only when that branch is taken, so such
conditionals are reported apart, one list of per-branch bytes each.
"""

from __future__ import annotations

import re
from typing import NamedTuple

import numpy as np

__all__ = ["HLO_BYTES", "Collectives", "collectives", "type_bytes"]

HLO_BYTES = {
    "pred": 1,
    "s8": 1,
    "u8": 1,
    "s16": 2,
    "u16": 2,
    "f16": 2,
    "bf16": 2,
    "s32": 4,
    "u32": 4,
    "f32": 4,
    "s64": 8,
    "u64": 8,
    "f64": 8,
}
_OPS = ("all-gather", "all-reduce", "collective-permute", "all-to-all", "reduce-scatter")
_HEADER = re.compile(r"^(?:ENTRY\s+)?%?([\w.\-]+)\s*(?:\(.*\))?.*\{\s*$")
_INSTR = re.compile(r"^\s*(?:ROOT\s+)?%?[\w.\-]+\s*=\s*(.*?)\s+([a-z][\w\-]*)\((.*)$")
_CALLEES = re.compile(r"(?:to_apply|calls|body|condition|true_computation|false_computation)=%?([\w.\-]+)")


def type_bytes(text: str) -> int:
    """Bytes of every array type in ``text`` (e.g. ``(u8[4,1024]{1,0}, s32[2])``)."""
    total = 0
    for dtype, dims in re.findall(r"\b([a-z]+\d*)\[([\d,]*)\]", text):
        if dtype not in HLO_BYTES:
            raise ValueError(f"unknown HLO element type {dtype!r} in {text!r}")
        total += HLO_BYTES[dtype] * int(np.prod([int(d) for d in dims.split(",") if d], dtype=np.int64))
    return total


class Collectives(NamedTuple):
    """Collectives reachable from the entry computation.

    Attributes:
      fixed: ``(op, bytes per worker)`` of every collective that always runs.
      switches: one list per ``conditional`` with collectives in its branches: per branch
        (in branch order), the bytes per worker of its collectives.
    """

    fixed: list
    switches: list


def _computations(hlo: str) -> tuple[dict, str]:
    comps, entry, name = {}, None, None
    for line in hlo.splitlines():
        if name is None:
            head = _HEADER.match(line)
            if head and not line.startswith(" "):
                name = head.group(1)
                comps[name] = []
                if line.startswith("ENTRY"):
                    entry = name
            continue
        if line.startswith("}"):
            name = None
            continue
        comps[name].append(line)
    if entry is None:
        raise ValueError("no ENTRY computation in the HLO text")
    return comps, entry


def collectives(hlo: str, n: int) -> Collectives:
    """The collectives of ``hlo`` (see the module docstring); ``n`` workers."""
    comps, entry = _computations(hlo)
    if any(f"{op}-start(" in hlo for op in _OPS):
        raise ValueError("asynchronous collectives (*-start/*-done) are not parsed")

    def walk(name: str, fixed: list, switches: list, in_loop: bool) -> None:
        for line in comps[name]:
            mo = _INSTR.match(line)
            if not mo:
                continue
            rtype, op, rest = mo.groups()
            if op in _OPS:
                if in_loop:
                    raise ValueError(
                        f"a collective inside a while loop ({line.strip()[:120]}) runs an unknown number of times"
                    )
                b = type_bytes(rtype)
                b = b // n if op == "all-gather" else b * n if op == "reduce-scatter" else b
                fixed.append((op, b))
            elif op == "conditional":
                branches = re.search(r"branch_computations=\{([^}]*)\}", rest)
                names = (
                    [s.strip().lstrip("%") for s in branches.group(1).split(",")]
                    if branches
                    else list(_CALLEES.findall(rest))
                )
                per_branch = []
                for b in names:
                    f: list = []
                    s: list = []
                    walk(b, f, s, in_loop)
                    if s:
                        raise ValueError("nested conditionals with collectives are not parsed")
                    per_branch.append(sum(x for _, x in f))
                if any(per_branch):
                    switches.append(per_branch)
            else:
                for callee in _CALLEES.findall(rest):
                    if callee in comps:
                        walk(callee, fixed, switches, in_loop or op == "while")

    fixed: list = []
    switches: list = []
    walk(entry, fixed, switches, False)
    return Collectives(fixed, switches)
