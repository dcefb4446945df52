"""NumPy: the bytes the variable-length all-gather sends for payloads with counted fields.

From each worker's payloads (``Payload.counted``: pairs ``(field, count_field)``, the valid rows
of ``field`` being ``sum(count_field)``): a payload's valid bytes ``v`` (fixed arrays whole,
counted fields' valid rows), capacity ``s`` and count entries ``e``; the bucket ``B``, the
smallest of ``bucket_sizes(S)`` at least the longest worker's valid bytes; and what each worker
sent per payload, ``v + 4 e``, the first payload also carrying the padding ``B − Σ v``.
"""

from __future__ import annotations

import dataclasses

import numpy as np

from jaxcomm.comm._packing import bucket_sizes

__all__ = ["expected_sent", "layout"]


def layout(p) -> tuple[int, int, int]:
    """``(valid bytes, capacity bytes, count entries)`` of one payload (count fields not in the first
    two); a plain array is sent whole."""
    if not dataclasses.is_dataclass(p):
        return np.asarray(p).nbytes, np.asarray(p).nbytes, 0
    counted = dict(type(p).counted)
    counts = set(counted.values())
    valid = capacity = entries = 0
    for f in dataclasses.fields(p):
        if f.metadata.get("static", False):
            continue
        a = np.asarray(getattr(p, f.name))
        if f.name in counts:
            entries += a.size
        elif f.name in counted:
            rows = int(np.asarray(getattr(p, counted[f.name])).sum())
            valid += rows * (a.nbytes // a.shape[0] if a.shape[0] else 0)
            capacity += a.nbytes
        else:
            valid += a.nbytes
            capacity += a.nbytes
    return valid, capacity, entries


def expected_sent(payloads, minimum: int = 1024) -> tuple[int, list[list[int]]]:
    """``(B, sent)`` for ``payloads[w][i]``, worker ``w``'s payload ``i`` (one variable-length gather):
    ``sent[w][i]`` bytes, ``Σ_i sent[w][i] = 4 m + B``."""
    per = [[layout(p) for p in row] for row in payloads]
    longest = max(sum(v for v, _, _ in row) for row in per)
    bucket = min(b for b in bucket_sizes(sum(s for _, s, _ in per[0]), minimum) if b >= longest)
    sent = []
    for row in per:
        out = [v + 4 * e for v, _, e in row]
        out[0] += bucket - sum(v for v, _, _ in row)
        sent.append(out)
    return bucket, sent
