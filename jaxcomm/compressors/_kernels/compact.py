"""Compaction kernels: the positions of the set bits of a mask, and per-class ranks.

``compact(mask, cap)`` is ``(jnp.nonzero(mask, size=cap, fill_value=0)[0], mask.sum())``.
Lowered for CPU, masks are bit-packed into 32-bit words (:func:`~.bitpack.pack_bits`) so that
compaction ("the positions of the first ``cap`` true entries, in index order") costs one pass
over the array plus work proportional to ``d / 32`` and ``cap``, instead of a prefix sum over
``d`` (which XLA:CPU lowers to an associative scan); vectors of at most ``SMALL = 2048`` entries
use a stable sort instead (cheaper to compile). Lowered for an accelerator, :func:`compact` and
:func:`compact_words` run ``jnp.nonzero`` (:func:`compact_by_primitive`); the choice is made at
lowering time (:mod:`.select` explains it). :func:`class_ranks` compacts several classes at once
(INCEPTIONN); :func:`materialize` keeps a prefix-sum table from being recomputed per lookup.
The top-k selection (:mod:`.select`) compacts its candidates with these kernels.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax

from ..._vma import typed_platform_dependent
from .bitpack import pack_bits, popcount

Array = jax.Array


_SHIFTS = np.arange(32, dtype=np.uint32)


SMALL = 2048
"""Vectors up to this length use a stable sort for selection and compaction (cheap to compile)."""


def _select_bit(words, r) -> Array:
    """Position (0..31) of the ``r``-th (0-based) set bit of each word (5-step binary search)."""
    b = jnp.zeros(jnp.shape(r), jnp.int32)
    for width in (16, 8, 4, 2, 1):
        low = popcount((words >> b.astype(jnp.uint32)) & jnp.uint32((1 << width) - 1))
        go = r >= low
        b = jnp.where(go, b + width, b)
        r = jnp.where(go, r - low, r)
    return b


def _cumsum_i32(a) -> Array:
    """Inclusive prefix sum of an int32 vector, as a sequential ``lax.scan``.

    XLA:CPU lowers ``jnp.cumsum`` to an associative scan (log-depth strided
    passes and a large program); a scalar scan compiles to one tight loop, which
    runs and compiles faster (measurements: ``docs/benchmarks.md``).
    """
    a = a.astype(jnp.int32)
    # The carry starts as a zero of a's own type, so inside shard_map it is device-varying
    # like the body's output (lax.scan requires equal carry types).
    init = jnp.zeros_like(a[0]) if a.shape[0] else jnp.int32(0)
    return lax.scan(lambda c, v: (c + v, c + v), init, a)[1]


def _compact_by_slot(words, incl, pc, cap: int):
    """Slot ``j`` finds its word (histogram of the word prefix counts, prefix-summed over ``cap``) and bit."""
    nwords = words.shape[0]
    j = jnp.arange(cap, dtype=jnp.int32)
    hist = jnp.zeros((cap,), jnp.int32).at[incl].add(1, mode="drop")
    w = jnp.minimum(_cumsum_i32(hist), nwords - 1)
    r = j - (incl[w] - pc[w])
    return w * 32 + _select_bit(words[w], r)


def _compact_by_bit(words, incl, pc, cap: int):
    """Every set bit computes its slot (word prefix + popcount of the lower bits) and is scattered there."""
    nwords = words.shape[0]
    excl = incl - pc
    shifts = jnp.asarray(_SHIFTS)
    below = words[:, None] & ((jnp.uint32(1) << shifts) - jnp.uint32(1))[None, :]
    slot = excl[:, None] + popcount(below)
    is_set = ((words[:, None] >> shifts[None, :]) & jnp.uint32(1)) == 1
    slot = jnp.where(is_set, slot, cap).reshape(-1)
    src = jnp.arange(nwords * 32, dtype=jnp.int32)
    return jnp.zeros((cap,), jnp.int32).at[slot].set(src, mode="drop")


def compact_words(words, cap: int):
    """Positions of the first ``cap`` set bits of ``words``, in increasing order.

    ``words``: uint32 ``(nwords,)``, bit ``b`` of word ``w`` standing for entry
    ``32 w + b`` (:func:`~.bitpack.pack_bits` with 1 bit). Returns ``(pos,
    total)``: ``pos`` int32 ``(cap,)`` (slots past the number of set bits hold 0)
    and ``total`` the number of set bits (int32 scalar, may exceed ``cap``).

    Lowered for CPU: one pass over the words plus, for ``cap <= nbits / 16``,
    work proportional to ``cap`` (each output slot finds its word and bit); a
    larger ``cap`` uses the same slot-wise method into a ``nbits / 16`` buffer
    when the set bits fit there (``lax.cond``), else scatters every set bit to
    its slot (work proportional to ``nbits``). Lowered for an accelerator: the
    bits unpacked and :func:`compact_by_primitive`.
    """
    return typed_platform_dependent(
        cpu=lambda: _compact_words_cpu(words, cap),
        accelerator=lambda: compact_by_primitive(_unpack_words(words), cap),
        like=words,
    )


def _unpack_words(words) -> Array:
    """The bool ``(32 nwords,)`` mask that :func:`~.bitpack.pack_bits` packed into ``words`` (bit ``b`` of
    word ``w`` is entry ``32 w + b``)."""
    shifts = jnp.asarray(_SHIFTS)
    return (((words[:, None] >> shifts[None, :]) & jnp.uint32(1)) == 1).reshape(-1)


def compact_by_primitive(mask, cap: int):
    """:func:`compact`'s accelerator body: ``jnp.nonzero(mask, size=cap, fill_value=0)`` and ``mask.sum()``.

    A prefix sum and a scatter over the ``(n,)`` bool ``mask``, which XLA lowers to a
    ``reduce_window`` and a scatter on GPU and TPU (on XLA:CPU the same prefix sum is an
    associative scan, hence the packed path there). Returns ``(pos, total)`` as :func:`compact`.
    """
    total = jnp.sum(mask, dtype=jnp.int32)
    pos = jnp.nonzero(mask, size=cap, fill_value=0)[0].astype(jnp.int32)
    return pos, total


def _compact_words_cpu(words, cap: int):
    """:func:`compact_words` lowered for CPU (see there)."""
    nbits = words.shape[0] * 32
    pc = popcount(words)
    incl = _cumsum_i32(pc)
    total = incl[-1]
    small = nbits // 16
    if cap <= small:
        pos = _compact_by_slot(words, incl, pc, cap)
    elif small < 1024:
        pos = _compact_by_bit(words, incl, pc, cap)
    else:
        pos = lax.cond(
            total <= small,
            lambda: jnp.pad(_compact_by_slot(words, incl, pc, small), (0, cap - small)),
            lambda: _compact_by_bit(words, incl, pc, cap),
        )
    pos = jnp.where(jnp.arange(cap, dtype=jnp.int32) < total, pos, 0)
    return pos, total


def compact(mask, cap: int):
    """``(positions of the first cap true entries of a bool vector, number of true entries)``.

    Equivalent to ``(jnp.nonzero(mask, size=cap, fill_value=0)[0], mask.sum())``:
    ``mask`` bool ``(n,)``, positions int32 ``(cap,)`` in increasing order (slots past
    the count hold 0), the count an int32 scalar (may exceed ``cap``). Lowered for
    CPU, a few memory passes over the bit-packed mask instead of two prefix sums
    over ``mask``; lowered for an accelerator, exactly that ``jnp.nonzero``
    (:func:`compact_by_primitive`). Up to ``SMALL`` entries, one stable sort everywhere.
    """
    n = mask.shape[0]
    if cap == 0 or n == 0 or n <= SMALL:
        return _compact_cpu(mask, cap)
    return typed_platform_dependent(
        cpu=lambda: _compact_cpu(mask, cap), accelerator=lambda: compact_by_primitive(mask, cap), like=mask
    )


def _compact_cpu(mask, cap: int):
    """:func:`compact` lowered for CPU, and for every platform up to ``SMALL`` entries."""
    n = mask.shape[0]
    if cap == 0 or n == 0:
        return jnp.zeros((cap,), jnp.int32), jnp.sum(mask, dtype=jnp.int32)
    if n <= SMALL:  # small vectors: one stable sort (cheaper to compile than the packed machinery)
        total = jnp.sum(mask, dtype=jnp.int32)
        order = lax.sort((~mask, jnp.arange(n, dtype=jnp.int32)), num_keys=1, is_stable=True)[1]
        pos = order[:cap] if cap <= n else jnp.pad(order, (0, cap - n))
        return jnp.where(jnp.arange(cap, dtype=jnp.int32) < total, pos, 0), total
    return _compact_words_cpu(pack_bits(mask, 1, jnp.uint32), cap)


def _nth_set(words, n) -> Array:
    """Position of the ``n``-th (0-based, traced scalar) set bit; -1 when ``n < 0``."""
    pc = popcount(words)
    incl = _cumsum_i32(pc)
    w = jnp.minimum(jnp.searchsorted(incl, n, side="right"), words.shape[0] - 1).astype(jnp.int32)
    r = n - (incl[w] - pc[w])
    return jnp.where(n >= 0, w * 32 + _select_bit(words[w], r), -1)


def materialize(a):
    """``a`` itself, computed once into a buffer before its consumers run.

    XLA:CPU lowers a prefix sum to a tree of small reduce-windows and fuses the
    final combine into every consumer, so a table built from a prefix sum and
    then looked up per entry is re-combined (several lookups) per entry. An
    identity scatter is never fused into its consumers; ``optimization_barrier``
    is stripped before fusion and does not help.
    """
    flat = jnp.ravel(a)
    idx = jnp.arange(flat.shape[0])
    out = jnp.zeros_like(flat).at[idx].set(flat, unique_indices=True, indices_are_sorted=True)
    return out.reshape(a.shape)


_RANK_BLOCK = 512  # < 2^10, so three in-block counters fit in one int32


def class_ranks(tags):
    """Rank of each entry among the earlier entries of its own class (tags 1, 2, 3).

    ``rank_i = #{j < i : tag_j = tag_i}`` (int32, shape of ``tags``); 0 for
    entries of tag 0. One prefix sum serves the three
    classes: within blocks of 512 entries the three counters are packed into
    10-bit fields of one int32 (one prefix sum instead of three; an XLA:CPU
    prefix sum costs several elementwise passes, ``docs/benchmarks.md``); block
    offsets are prefix sums over the ``d / 512`` block totals.
    """
    d = tags.shape[0]
    block = min(_RANK_BLOCK, max(d, 1))
    rows = -(-d // block)
    t = jnp.pad(tags.astype(jnp.int32), (0, rows * block - d)).reshape(rows, block)
    shift = 10 * jnp.maximum(t - 1, 0)
    unit = jnp.where(t == 0, 0, jnp.left_shift(1, shift))
    inclusive = jnp.cumsum(unit, axis=1)
    within = jnp.right_shift(inclusive - unit, shift) & 1023
    totals = inclusive[:, -1]
    offsets = []
    for c in range(3):
        row_total = (totals >> (10 * c)) & 1023
        offsets.append(materialize(jnp.cumsum(row_total) - row_total)[:, None])  # else redone per entry
    offset = jnp.where(t == 1, offsets[0], jnp.where(t == 2, offsets[1], offsets[2]))
    return jnp.where(t == 0, 0, within + offset).reshape(-1)[:d]
