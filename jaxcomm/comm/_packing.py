"""One collective for a whole tree: pack every leaf's bytes into one buffer.

Horovod's *tensor fusion* (and PyTorch DDP's gradient buckets) exist because a
collective has a fixed cost -- a rendezvous of every worker, a launch, a
latency -- on top of its bytes. A compressed step sends one small payload per
tensor, so that fixed cost is paid once per tensor and payload field: 60
all-gathers per step for top-k on a 30-tensor model. :func:`all_gather_packed`
pays it once.

Count-based compressors (threshold, DGC, ...) keep a variable number of entries
in a fixed-capacity buffer so that shapes stay static under ``jit``; gathering the
buffer whole would put its unused capacity on the wire.
:func:`all_gather_counted` first gathers the counts, then only the valid rows,
padded to the smallest of a few static sizes (:func:`bucket_sizes`).
"""

from __future__ import annotations

import dataclasses
import functools
import math
from collections.abc import Sequence
from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax

__all__ = [
    "fits_counted_gather",
    "BUCKET_GROWTH",
    "MIN_BUCKET_BYTES",
    "CountedGather",
    "all_gather_counted",
    "all_gather_packed",
    "bucket_sizes",
    "has_counted_fields",
    "sum_packed",
]


def _packable(a) -> bool:
    dt = jnp.result_type(a)
    return not jax.dtypes.issubdtype(dt, jax.dtypes.prng_key) and not jnp.issubdtype(dt, jnp.complexfloating)


def _to_bytes(a) -> jax.Array:
    """``a``'s bytes as a flat uint8 vector (bool: one byte per entry, 0 or 1)."""
    a = jnp.asarray(a)
    if a.dtype == jnp.bool_:
        a = a.astype(jnp.uint8)
    if a.dtype != jnp.uint8:
        a = lax.bitcast_convert_type(a, jnp.uint8)  # itemsize > 1 adds a trailing axis of that length
    return a.reshape(-1)


def _from_bytes(seg, dtype, shape) -> jax.Array:
    """Inverse of :func:`_to_bytes` for ``n`` stacked rows: ``(n, nbytes)`` uint8 -> ``(n, *shape)`` dtype."""
    n = seg.shape[0]
    wire = jnp.dtype(jnp.uint8 if dtype == jnp.bool_ else dtype)
    if wire.itemsize > 1:
        seg = lax.bitcast_convert_type(seg.reshape(n, -1, wire.itemsize), wire)
    elif wire != jnp.uint8:
        seg = lax.bitcast_convert_type(seg, wire)
    seg = seg.reshape((n, *shape))
    return seg.astype(jnp.bool_) if dtype == jnp.bool_ else seg


def all_gather_packed(comm, tree: Any) -> Any:
    """``comm.all_gather(tree)`` with one collective: the leaves' bytes are concatenated.

    Every leaf is bit-cast to bytes (``bool`` as one byte per entry), the bytes
    of all leaves are concatenated into one ``uint8`` vector, that vector is
    all-gathered once (``comm.all_gather``), and each worker's row is cut and
    bit-cast back. The result equals ``comm.all_gather(tree)`` bit for bit:
    every leaf of shape ``s`` becomes ``(n, *s)``, worker ``i``'s value in row
    ``i``. The bytes on the wire are exactly the leaves' bytes (no padding).
    Leaves that cannot be bit-cast (typed PRNG keys, complex) are gathered on
    their own.

    Args:
      comm: a :class:`~jaxcomm.comm.Communicator` (mesh axis or MPI).
      tree: a pytree of arrays, e.g. a list of compressor payloads.
    Returns:
      the tree with every leaf stacked over the ``n`` workers.
    """
    leaves, treedef = jax.tree_util.tree_flatten(tree)
    packed = [i for i, a in enumerate(leaves) if _packable(a)]
    out = [a if i in packed else comm.all_gather(a) for i, a in enumerate(leaves)]
    if packed:
        parts = [_to_bytes(leaves[i]) for i in packed]
        gathered = comm.all_gather(parts[0] if len(parts) == 1 else jnp.concatenate(parts))
        offsets = np.cumsum([0] + [p.shape[0] for p in parts])
        for j, i in enumerate(packed):
            a = leaves[i]
            seg = gathered[:, int(offsets[j]) : int(offsets[j + 1])]
            out[i] = _from_bytes(seg, jnp.result_type(a), tuple(jnp.shape(a)))
    return jax.tree_util.tree_unflatten(treedef, out)


def sum_packed(comm, trees: Sequence, max_bytes: int | None = None) -> tuple[list, int]:
    """``[comm.sum(t) for t in trees]`` with one collective per dtype for the small leaves.

    The leaves of at most ``max_bytes`` bytes (every leaf when ``None``; none when 0)
    are grouped by dtype; each group's leaves are flattened and concatenated into one
    vector, summed over the workers once (``comm.sum``), and cut back into their shapes.
    Every other leaf is summed on its own. Element ``i`` of a packed leaf is summed
    exactly as it would be alone (the same values, in the same dtype), and the bytes on
    the wire are the leaves' bytes.

    Args:
      comm: a :class:`~jaxcomm.comm.Communicator`.
      trees: a sequence of pytrees of arrays (e.g. each tensor's summable payload fields).
      max_bytes: the largest leaf packed, in bytes.
    Returns:
      ``(sums, collectives)``: the summed trees, and the number of collectives run.
    """
    flat = [jax.tree_util.tree_flatten(t) for t in trees]
    leaves = [(i, j, jnp.asarray(a)) for i, (ls, _) in enumerate(flat) for j, a in enumerate(ls)]
    out = [list(ls) for ls, _ in flat]
    groups: dict = {}
    alone = []
    for i, j, a in leaves:
        small = max_bytes is None or a.size * a.dtype.itemsize <= max_bytes
        if small and _packable(a) and a.size:
            groups.setdefault(a.dtype, []).append((i, j, a))
        else:
            alone.append((i, j, a))
    if alone:
        for (i, j, _), total in zip(alone, comm.sum([a for *_, a in alone])):
            out[i][j] = total
    for members in groups.values():
        if len(members) == 1:
            i, j, a = members[0]
            out[i][j] = comm.sum(a)
            continue
        total = comm.sum(jnp.concatenate([a.reshape(-1) for *_, a in members]))
        offsets = np.cumsum([0] + [a.size for *_, a in members])
        for (i, j, a), lo, hi in zip(members, offsets[:-1], offsets[1:]):
            out[i][j] = total[int(lo) : int(hi)].reshape(a.shape)
    sums = [jax.tree_util.tree_unflatten(td, o) for (_, td), o in zip(flat, out)]
    return sums, len(alone) + len(groups)


# --------------------------------------------------------------------------- #
# Variable-length all-gather: count-prefixed fields send only their valid rows
# --------------------------------------------------------------------------- #
MIN_BUCKET_BYTES = 1024
"""The smallest data all-gather :func:`all_gather_counted` sends (bytes per worker), unless the
whole buffer is smaller."""

BUCKET_GROWTH = 2.0**0.25
"""Ratio of consecutive bucket sizes of :func:`bucket_sizes`: a buffer is padded by less than this
factor (about 1.19) above :data:`MIN_BUCKET_BYTES`."""

_MAX_BUFFER_BYTES = int(np.iinfo(np.int32).max)


def fits_counted_gather(bits) -> bool:
    """Whether a payload of ``bits`` bits (per worker) can go through :func:`all_gather_counted`.

    The gather's packed buffer is addressed by int32 byte offsets, so it holds at most
    ``2**31 - 1`` bytes; a larger payload is gathered whole, leaf by leaf.
    """
    return bits <= 8 * _MAX_BUFFER_BYTES


def bucket_sizes(capacity: int, minimum: int = MIN_BUCKET_BYTES, growth: float = BUCKET_GROWTH) -> tuple[int, ...]:
    """The static sizes, in bytes per worker, that a variable-length all-gather of a ``capacity``-byte
    buffer may send.

    ``b_0 = minimum``, ``b_{i+1} = min(capacity, max(b_i + 1, ceil(growth · b_i)))``, up to ``capacity``
    exactly; a buffer of at most ``minimum`` bytes has the single size ``capacity``. The smallest
    size ``>= L`` is below ``growth · L + 1`` for every ``L > minimum``, and there are about
    ``1 + log(capacity / minimum) / log(growth)`` sizes (61 for 32 MiB with the defaults).

    >>> bucket_sizes(3000)
    (1024, 1218, 1449, 1724, 2051, 2440, 2902, 3000)
    >>> bucket_sizes(700)
    (700,)
    """
    capacity, minimum = int(capacity), int(minimum)
    if capacity < 0 or minimum < 1 or not growth > 1.0:
        raise ValueError(f"need capacity >= 0, minimum >= 1 and growth > 1; got {capacity}, {minimum}, {growth}")
    if capacity <= minimum:
        return (capacity,)
    sizes = [minimum]
    while sizes[-1] < capacity:
        sizes.append(min(capacity, max(sizes[-1] + 1, math.ceil(sizes[-1] * growth))))
    return tuple(sizes)


class _Role(NamedTuple):
    """What one leaf of a tree is to the variable-length gather.

    kind: ``"fixed"`` (packed whole), ``"count"`` (sent in the count gather), ``"counted"`` (its
    first ``count`` rows packed), ``"apart"`` (not packable: gathered on its own).
    nbytes: the leaf's bytes (``"counted"``: at full capacity). row: bytes per row (``"counted"``).
    rows: capacity in rows (``"counted"``). slots: ``(start, size)`` of its count in the count
    vector (``"count"`` and ``"counted"``).
    """

    kind: str
    nbytes: int
    row: int = 0
    rows: int = 0
    slots: tuple[int, int] = (0, 0)


def _declares_counts(node) -> bool:
    return dataclasses.is_dataclass(node) and not isinstance(node, type) and bool(getattr(type(node), "counted", ()))


def has_counted_fields(tree) -> bool:
    """Whether ``tree`` holds a payload whose class declares count-prefixed fields (``counted``)."""
    return any(_declares_counts(n) for n in jax.tree_util.tree_leaves(tree, is_leaf=_declares_counts))


def _nbytes(a) -> int:
    dt = jnp.result_type(a)
    if jax.dtypes.issubdtype(dt, jax.dtypes.prng_key):
        return int(jax.random.key_data(a).nbytes)
    return int(np.prod(np.shape(a), dtype=np.int64)) * jnp.dtype(dt).itemsize


def _plain(a) -> _Role:
    return _Role("fixed" if _packable(a) else "apart", _nbytes(a))


def _roles(tree, start: int) -> tuple[list[_Role], int]:
    """The roles of ``tree``'s leaves (``jax.tree.leaves`` order) and the next free count slot."""
    roles: list[_Role] = []
    for node in jax.tree_util.tree_leaves(tree, is_leaf=_declares_counts):
        if not _declares_counts(node):
            roles.append(_plain(node))
            continue
        what = type(node).__name__
        spec = tuple(type(node).counted)
        by_field: dict[str | None, list] = {}
        leaves = []
        for path, leaf in jax.tree_util.tree_flatten_with_path(node)[0]:
            name = getattr(path[0], "name", None)
            by_field.setdefault(name, []).append(leaf)
            leaves.append((name, leaf))
        slots: dict[str, tuple[int, int]] = {}
        for field, count in spec:
            for name in (field, count):
                if len(by_field.get(name, ())) != 1:
                    raise ValueError(f"{what}.counted names {name!r}, which is not one array field of {what}")
            c = by_field[count][0]
            if not jnp.issubdtype(jnp.result_type(c), jnp.integer):
                raise TypeError(f"{what}.{count} counts rows of {what}.{field}: it must be an integer array")
            if count not in slots:
                slots[count] = (start, int(np.size(c)))
                start += int(np.size(c))
            f = by_field[field][0]
            if np.ndim(f) < 1 or not _packable(f):
                raise TypeError(
                    f"{what}.{field} is counted: it must be an array of rows (ndim >= 1) of a packable dtype"
                )
        counted = dict(spec)
        for name, leaf in leaves:
            if name in slots:
                roles.append(_Role("count", _nbytes(leaf), slots=slots[name]))
            elif name in counted:
                rows = int(np.shape(leaf)[0])
                row = _nbytes(leaf) // rows if rows else 0
                roles.append(_Role("counted", _nbytes(leaf), row, rows, slots[counted[name]]))
            else:
                roles.append(_plain(leaf))
    return roles, start


def _rows(counts, role: _Role):
    """Valid rows of a counted leaf from a count vector (last axis): the sum of its slots, clipped to its capacity."""
    s, k = role.slots
    return jnp.clip(jnp.sum(counts[..., s : s + k], axis=-1), 0, role.rows)


def _gather_prefix(comm, size: int, capacity: int, buf):
    """``comm.all_gather(buf[:size])`` padded with zeros back to ``(n, capacity)``."""
    g = comm.all_gather(buf[:size])
    return g if size == capacity else jnp.pad(g, ((0, 0), (0, capacity - size)))


class CountedGather(NamedTuple):
    """What :func:`all_gather_counted` returns.

    Attributes:
      items: the gathered items: every leaf of item ``i`` stacked over the ``n`` workers, as
        ``comm.all_gather(items[i])`` (rows past a counted field's count are zero).
      sent_bytes: per item, an int32 scalar: the bytes this worker put on the wire for it (its
        fixed leaves, its counted fields' valid rows, its counts, its unpackable leaves), item 0
        also carrying the bucket padding. ``sum(sent_bytes)`` is exactly the bytes this worker
        handed to the collectives.
      bucket_bytes: int32 scalar, the size of the data all-gather per worker (the same on every worker).
      messages: the number of collectives (Python int): the count gather, the data gather, and
        one per unpackable leaf.
    """

    items: list
    sent_bytes: list
    bucket_bytes: jax.Array
    messages: int


def all_gather_counted(
    comm, items: Sequence, *, minimum: int = MIN_BUCKET_BYTES, growth: float = BUCKET_GROWTH
) -> CountedGather:
    """``[comm.all_gather(item) for item in items]`` sending only the valid rows of count-prefixed fields.

    Long because steps (a)-(d) share the offsets and bucket sizes computed once; apart, each step would take
    them all as arguments.

    A payload class declares its count-prefixed fields in ``counted``, pairs
    ``(field, count_field)``: only the first ``c = sum(count_field)`` rows (axis 0) of ``field`` are
    meaningful and the rest are zero (:class:`~jaxcomm.compressors._sparse.CountSparsePayload`:
    ``(("values", "count"), ("indices", "count"))``). With ``F`` the bytes of the fixed leaves
    (every other packable leaf, whole), ``r_j`` the bytes of one row and ``cap_j`` the rows of
    counted field ``j``, one worker's valid length and the static capacity are

        L = F + Σ_j c_j r_j  ≤  S = F + Σ_j cap_j r_j.

    Steps: (a) one all-gather of every worker's counts (an int32 vector of all count fields'
    entries): every worker learns every ``L_w``; (b) each worker packs its fixed leaves whole and
    then its counted fields' first ``c_j`` rows contiguously into one ``S``-byte uint8 buffer
    (byte packing of :func:`all_gather_packed`; each counted field is written whole at its dynamic
    offset and the next write overwrites the unused tail); (c) the data all-gather sends the first
    ``B`` bytes, ``B`` the smallest of :func:`bucket_sizes` ``(S)`` with ``B ≥ max_w L_w``, chosen by
    a ``lax.switch`` whose branches are the static sizes (every worker takes the same branch); (d)
    every worker cuts every worker's row at the offsets its counts give, and zeroes the rows past
    each count. The result equals ``comm.all_gather(item)`` bit for bit when the senders' unused
    rows are zero. Counts larger than a field's capacity are clipped to it.

    Each worker sends ``4 m + B`` bytes, ``m`` the count entries, with
    ``B < growth · max_w L_w + 1`` whenever ``max_w L_w > minimum`` (``B <= minimum`` otherwise):
    a buffer of at most ``minimum`` bytes is gathered whole, without a switch. Leaves
    that cannot be bit-cast (typed PRNG keys, complex) are gathered on their own; a tree without
    counted fields is one packed all-gather of ``S`` bytes.

    Args:
      comm: a :class:`~jaxcomm.comm.Communicator` (mesh axis, ``vmap`` axis or MPI).
      items: a sequence of pytrees (typically payloads); the data of all of them shares one buffer.
      minimum, growth: the buckets (:func:`bucket_sizes`).
    Returns:
      a :class:`CountedGather`.
    """
    items = list(items)
    flat = [jax.tree_util.tree_flatten(item) for item in items]
    roles, m = [], 0
    for item in items:
        r, m = _roles(item, m)
        roles.append(r)
    # (item, leaf position, leaf, role) for every leaf of every item
    entries = [(i, j, a, roles[i][j]) for i, (leaves, _) in enumerate(flat) for j, a in enumerate(leaves)]
    fixed = [e for e in entries if e[3].kind == "fixed"]
    counted = [e for e in entries if e[3].kind == "counted"]
    F = sum(ro.nbytes for *_, ro in fixed)
    S = F + sum(ro.nbytes for *_, ro in counted)
    if S > _MAX_BUFFER_BYTES:
        raise ValueError(f"all_gather_counted: a buffer of {S} bytes is beyond the int32 offsets; gather in parts")
    n = int(comm.size)

    # (a) the counts
    own = [jnp.ravel(a).astype(jnp.int32) for _, _, a, ro in entries if ro.kind == "count"]
    if m:
        mine = own[0] if len(own) == 1 else jnp.concatenate(own)
        every = comm.all_gather(mine)  # (n, m)
    else:
        mine, every = jnp.zeros((0,), jnp.int32), jnp.zeros((n, 0), jnp.int32)
    my_rows = [_rows(mine, ro) for *_, ro in counted]  # int32 scalars
    all_rows = [_rows(every, ro) for *_, ro in counted]  # int32 (n,)
    my_bytes = [r * ro.row for r, (*_, ro) in zip(my_rows, counted)]
    valid = sum(my_bytes, jnp.int32(F))
    longest = jnp.max(sum((r * ro.row for r, (*_, ro) in zip(all_rows, counted)), jnp.full((n,), F, jnp.int32)))

    # (b) this worker's buffer: fixed leaves at static offsets, then the counted rows back to back
    parts = [_to_bytes(a) for _, _, a, _ in fixed]
    if S > F:
        parts.append(jnp.zeros((S - F,), jnp.uint8))
    buf = jnp.concatenate(parts) if len(parts) > 1 else (parts[0] if parts else jnp.zeros((0,), jnp.uint8))
    offset = jnp.int32(F)
    for b, (_, _, a, _) in zip(my_bytes, counted):  # offset + capacity <= S: dynamic_update_slice never clamps
        buf = lax.dynamic_update_slice(buf, _to_bytes(a), (offset,))
        offset = offset + b

    # (c) the data: the smallest bucket that holds every worker's valid bytes
    sizes = bucket_sizes(S, minimum, growth) if counted else (S,)
    messages = (1 if m else 0) + sum(1 for *_, ro in entries if ro.kind == "apart")
    if S == 0:
        gathered, bucket = jnp.zeros((n, 0), jnp.uint8), jnp.int32(0)
    elif len(sizes) == 1:
        gathered, bucket = comm.all_gather(buf), jnp.int32(S)
        messages += 1
    else:
        index = jnp.sum(jnp.asarray(sizes[:-1], jnp.int32) < longest, dtype=jnp.int32)
        branches = [functools.partial(_gather_prefix, comm, b, S) for b in sizes]
        gathered, bucket = lax.switch(index, branches, buf), jnp.asarray(sizes, jnp.int32)[index]
        messages += 1

    # (d) every worker's leaves
    out = [list(f[0]) for f in flat]
    start = 0
    for i, j, a, ro in fixed:
        out[i][j] = _from_bytes(gathered[:, start : start + ro.nbytes], jnp.result_type(a), tuple(jnp.shape(a)))
        start += ro.nbytes
    offsets = jnp.full((n,), F, jnp.int32)
    for r, (i, j, a, ro) in zip(all_rows, counted):
        seg = jax.vmap(lambda row, o, nb=ro.nbytes: lax.dynamic_slice(row, (o,), (nb,)))(gathered, offsets)
        x = _from_bytes(seg, jnp.result_type(a), tuple(jnp.shape(a)))
        keep = (jnp.arange(ro.rows, dtype=jnp.int32)[None, :] < r[:, None]).reshape((n, ro.rows) + (1,) * (x.ndim - 2))
        out[i][j] = jnp.where(keep, x, jnp.zeros((), x.dtype))
        offsets = offsets + r * ro.row
    for i, j, a, ro in entries:
        if ro.kind == "count":
            s, k = ro.slots
            out[i][j] = every[:, s : s + k].reshape((n, *jnp.shape(a))).astype(jnp.result_type(a))
        elif ro.kind == "apart":
            out[i][j] = comm.all_gather(a)

    # what this worker sent, per item
    sent = []
    for i in range(len(items)):
        static = sum(ro.nbytes for ro in roles[i] if ro.kind in ("fixed", "apart"))
        static += 4 * sum(ro.slots[1] for ro in roles[i] if ro.kind == "count")
        sent.append(sum((b for b, e in zip(my_bytes, counted) if e[0] == i), jnp.int32(static)))
    if sent:
        sent[0] = sent[0] + (bucket - valid)
    gathered_items = [jax.tree_util.tree_unflatten(f[1], o) for f, o in zip(flat, out)]
    return CountedGather(gathered_items, sent, bucket, messages)
