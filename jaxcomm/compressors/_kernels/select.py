"""Sparsifiers: random-k, top-k, Threshold-v, DGC, random sparsification.

GRACE Sec. III-B (Table I, "Sparsification"): a sparsifier selects a subset of
the ``d`` entries of a gradient ``g`` (a bitmask ``b``) and sends the selected
values and their positions; the receiver scatters them into zeros.

* ``randomk``: ``k`` uniformly random positions (Stich et al. 2018); with a key
  shared by every worker the positions agree, so only the values are sent and
  the payloads can be summed (strategy ``allreduce``).
* ``topk``: the ``k`` largest magnitudes (Aji & Heafield 2017), exact, with a
  sampling-based selection that is a small multiple of a memory pass on CPU.
* ``threshold``: Threshold-v, every ``|g_i| >= v`` (Dutta et al. 2020).
* ``dgc``: Deep Gradient Compression's sampled threshold (Lin et al. 2018),
  transcribed from the authors' code (``dgc/compression.py``).
* ``random_sparsification``: keep ``g_i / p`` with probability ``p``
  (DoubleSqueeze, Tang et al. 2019; Wangni et al. 2018 with uniform ``p``).

Count-based methods (threshold, dgc, random sparsification) return a
fixed-capacity buffer plus a count, so shapes stay static under ``jit``; their
``wire_bits`` is a traced ``int32`` computed from the count.

Selection machinery (private, shared with :mod:`._hybrid`): every selection is
done on *int32 order keys*; for magnitudes the key is the float32 bit pattern of
``|x|`` (sign bit cleared), whose integer order is the float order on
``[0, +Inf]`` and puts NaN above +Inf. Masks are bit-packed into 32-bit words so
that compaction ("the positions of the first ``cap`` true entries, in index
order") costs one pass over the array plus work proportional to ``d / 32`` and
``cap``, instead of a prefix sum over ``d`` (which XLA:CPU lowers to a slow
associative scan); vectors of at most 2048 entries use a stable sort instead
(cheaper to compile). Randomness for sampling comes from a counter-based hash
keyed by the PRNG key (:func:`_hash_uniform_bits`), ~50x cheaper than
threefry over a large tensor on CPU.
"""

from __future__ import annotations

import math
from typing import Any, ClassVar, NamedTuple

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax

from ..._vma import vary_like
from .._base import (
    Compressor,
    Payload,
    check_finite_scalar,
    check_positive_int,
    check_ratio,
    payload_dataclass,
    register,
    static_field,
)
from .._primitives import desparsify, index_dtype, pack, packed_size, unpack

Array = jax.Array

__all__ = [
    "randomk",
    "topk",
    "threshold",
    "dgc",
    "random_sparsification",
    "SparsePayload",
    "RandomKPayload",
    "CountSparsePayload",
    "MaskSparsePayload",
    "num_selected",
]


# --------------------------------------------------------------------------- #
# Small helpers
# --------------------------------------------------------------------------- #
def num_selected(ratio: float, d: int) -> int:
    """``k = max(1, round(ratio * d))`` rounded half up, capped at ``d`` (0 if ``d == 0``)."""
    if d == 0:
        return 0
    return int(min(d, max(1, math.floor(ratio * d + 0.5))))


def _bits_of(dtype) -> int:
    return jnp.dtype(dtype).itemsize * 8


def _flat_f32(x):
    return jnp.ravel(x).astype(jnp.float32)


_NAN_KEY = 0x7FC00000


def _magnitude_keys(x) -> Array:
    """int32 order keys of ``|x|`` (elementwise, compared in float32; same shape as ``x``).

    ``key_i = bitcast_int32(float32(x_i)) & 0x7fffffff``: non-negative, and for
    non-negative floats the integer order is the float order, so ``key_i >=
    key_j`` iff ``|x_i| >= |x_j|``. Every NaN maps to one key above +Inf
    (``0x7fc00000``), so NaN entries count as the largest magnitudes and tie
    with each other. ``-0.0`` and ``+0.0`` are equal.
    """
    xf = jnp.asarray(x).astype(jnp.float32)
    bits = lax.bitcast_convert_type(xf, jnp.int32) & jnp.int32(0x7FFFFFFF)
    return jnp.where(jnp.isnan(xf), jnp.int32(_NAN_KEY), bits)


def _fmix32(h):
    """MurmurHash3's 32-bit finalizer: a bijection of uint32 with full avalanche."""
    h = h ^ (h >> 16)
    h = h * jnp.uint32(0x85EBCA6B)
    h = h ^ (h >> 13)
    h = h * jnp.uint32(0xC2B2AE35)
    return h ^ (h >> 16)


def _hash_seeds(key) -> Array:
    """Two uint32 seeds drawn from a PRNG key (threefry, two words only)."""
    if jnp.issubdtype(jnp.result_type(key), jax.dtypes.prng_key):
        return jax.random.bits(key, (2,), jnp.uint32)
    return jax.random.bits(jnp.asarray(key, jnp.uint32), (2,), jnp.uint32)


def _hash_uniform_bits(seeds, n: int) -> Array:
    """``n`` pseudo-random uint32 words ``h(i) = F(i; seeds)``, ``i = 0..n-1``.

    ``F`` is three rounds of MurmurHash3's finalizer keyed by the two seeds; for
    fixed seeds it is a *bijection* of the 32-bit words, so the ``n`` outputs are
    distinct. It is a counter-based generator of statistical (not cryptographic)
    quality, ~50x cheaper than threefry on CPU; sampling with it is what makes
    random-k and random sparsification a few memory passes instead of tens.
    """
    i = jnp.arange(n, dtype=jnp.uint32)
    return _fmix32(_fmix32(_fmix32(i ^ seeds[0]) + seeds[1]) ^ seeds[0])


def uniform_indices(key, n: int, d: int) -> Array:
    """``n`` indices in ``[0, d)``, uniform with replacement up to the hash, int32.

    ``h(i) mod d``: the modulo bias is below ``d / 2^32`` relative.
    """
    h = _hash_uniform_bits(_hash_seeds(key), n)
    return (h % jnp.uint32(d)).astype(jnp.int32)


# --------------------------------------------------------------------------- #
# Bit-packed compaction
# --------------------------------------------------------------------------- #
_SHIFTS = np.arange(32, dtype=np.uint32)
_SMALL = 2048
"""Vectors up to this length use a stable sort for selection and compaction (cheap to compile)."""


def _pack_words(mask) -> Array:
    """Pack a bool vector into uint32 words: bit ``i % 32`` of word ``i // 32``."""
    n = mask.shape[0]
    pad = (-n) % 32
    m = jnp.pad(mask, (0, pad)) if pad else mask
    m = m.reshape(-1, 32).astype(jnp.uint32)
    return jnp.sum(m << jnp.asarray(_SHIFTS), axis=1, dtype=jnp.uint32)


def _popcount(words) -> Array:
    return lax.population_count(words).astype(jnp.int32)


def _select_bit(words, r) -> Array:
    """Position (0..31) of the ``r``-th (0-based) set bit of each word (5-step binary search)."""
    b = jnp.zeros(jnp.shape(r), jnp.int32)
    for width in (16, 8, 4, 2, 1):
        low = _popcount((words >> b.astype(jnp.uint32)) & jnp.uint32((1 << width) - 1))
        go = r >= low
        b = jnp.where(go, b + width, b)
        r = jnp.where(go, r - low, r)
    return b


def _cumsum_i32(a) -> Array:
    """Inclusive prefix sum of an int32 vector, as a sequential ``lax.scan``.

    XLA:CPU lowers ``jnp.cumsum`` to an associative scan (log-depth strided
    passes, ~15-20 ns per element and a large program); a scalar scan compiles
    to one tight loop (~4-6 ns per element on this CPU) and compiles in a
    fraction of the time.
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
    slot = excl[:, None] + _popcount(below)
    is_set = ((words[:, None] >> shifts[None, :]) & jnp.uint32(1)) == 1
    slot = jnp.where(is_set, slot, cap).reshape(-1)
    src = jnp.arange(nwords * 32, dtype=jnp.int32)
    return jnp.zeros((cap,), jnp.int32).at[slot].set(src, mode="drop")


def _compact_words(words, cap: int):
    """Positions of the first ``cap`` set bits of ``words``, in increasing order.

    Returns ``(pos, total)``: ``pos`` int32 ``(cap,)`` (slots past the number of
    set bits hold 0) and ``total`` the number of set bits (int32 scalar, may
    exceed ``cap``). Work is one pass over the words plus, for
    ``cap <= nbits / 16``, work proportional to ``cap`` (each output slot finds
    its word and bit); a larger ``cap`` uses the same slot-wise method into a
    ``nbits / 16`` buffer when the set bits fit there (``lax.cond``), else
    scatters every set bit to its slot (work proportional to ``nbits``).
    """
    nbits = words.shape[0] * 32
    pc = _popcount(words)
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

    Equivalent to ``(jnp.nonzero(mask, size=cap, fill_value=0)[0], mask.sum())``
    but a few memory passes instead of two prefix sums over ``mask``.
    """
    n = mask.shape[0]
    if cap == 0 or n == 0:
        return jnp.zeros((cap,), jnp.int32), jnp.sum(mask, dtype=jnp.int32)
    if n <= _SMALL:  # small vectors: one stable sort (cheaper to compile than the packed machinery)
        total = jnp.sum(mask, dtype=jnp.int32)
        order = lax.sort((~mask, jnp.arange(n, dtype=jnp.int32)), num_keys=1, is_stable=True)[1]
        pos = order[:cap] if cap <= n else jnp.pad(order, (0, cap - n))
        return jnp.where(jnp.arange(cap, dtype=jnp.int32) < total, pos, 0), total
    return _compact_words(_pack_words(mask), cap)


def _nth_set(words, n) -> Array:
    """Position of the ``n``-th (0-based, traced scalar) set bit; -1 when ``n < 0``."""
    pc = _popcount(words)
    incl = _cumsum_i32(pc)
    w = jnp.minimum(jnp.searchsorted(incl, n, side="right"), words.shape[0] - 1).astype(jnp.int32)
    r = n - (incl[w] - pc[w])
    return jnp.where(n >= 0, w * 32 + _select_bit(words[w], r), -1)


# --------------------------------------------------------------------------- #
# Exact top-k selection on int32 keys
# --------------------------------------------------------------------------- #
_SAMPLE_MAX = 65536
_MARGIN = 5.0
PATH_SAMPLED, PATH_TIES, PATH_FULL = 0, 1, 2
"""Which branch :func:`top_indices` took (returned for tests and diagnostics)."""


def _radix_kth(keys, k) -> Array:
    """Largest ``t >= 0`` with ``#(keys >= t) >= k`` (the k-th largest key), bit by bit from bit 30.

    31 counting passes over ``keys`` in a ``fori_loop`` (one compiled body).
    """

    def body(i, t):
        trial = t | jnp.left_shift(jnp.int32(1), 30 - i)
        return jnp.where(jnp.sum(keys >= trial, dtype=jnp.int32) >= k, trial, t)

    # Inside shard_map the carry must be device-varying over the axes of keys and k, like the body's output.
    return lax.fori_loop(0, 31, body, vary_like(jnp.int32(0), keys, k))


def _exact_top(ck, cand_idx, k, kmax: int) -> Array:
    """Exact top-``k`` of a candidate buffer: returns ``cand_idx`` of the winners, ``(kmax,)``.

    ``ck`` are the candidates' keys (``-1`` = empty slot), at least ``k`` of them
    non-negative. Selected: every key above the k-th largest ``t``, then the
    first ``k - #(> t)`` keys equal to ``t`` in buffer order (lowest index first).
    Slots ``>= k`` hold index 0.
    """
    m = ck.shape[0]
    t = _radix_kth(ck, k)
    gt = ck > t
    need = k - jnp.sum(gt, dtype=jnp.int32)
    tie = ck == t
    last = _nth_set(_pack_words(tie), need - 1)
    sel = gt | (tie & (jnp.arange(m, dtype=jnp.int32) <= last))
    pos, _ = compact(sel, kmax)
    out = cand_idx[pos]
    return jnp.where(jnp.arange(kmax, dtype=jnp.int32) < k, out, 0)


def _upper_excess(mean, var, z):
    """Bernstein deviation ``t`` with ``P(X - E X >= t) <= exp(-z^2 / 2)`` for a Binomial ``X`` (``z >= 0``).

    Bernstein: ``P(X - mean >= t) <= exp(-t^2 / (2 (var + t/3)))``; solving
    ``t^2 = z^2 (var + t/3)`` gives ``t = (z^2/3 + sqrt(z^4/9 + 4 z^2 var)) / 2``.
    A negative ``z`` (tests forcing the fallback) gives ``z sqrt(var)``. Works on
    Python floats and traced arrays.
    """
    if isinstance(z, (int, float)) and z < 0:
        return z * (var ** 0.5)
    return (z * z / 3.0 + (z ** 4 / 9.0 + 4.0 * z * z * var) ** 0.5) / 2.0


def _sample_plan(d: int, kmax: int, margin: float):
    """Static sampling plan: sample size ``s``, largest sample rank ``jmax``, capacity ``C``.

    With ``s`` uniform samples (with replacement), the threshold ``lo`` is the
    ``j``-th largest sampled key, ``j = s q + t + 1`` with ``q = k / d`` and
    ``t`` Bernstein's deviation for ``z = margin`` (:func:`_upper_excess`). Then
    ``lo`` exceeds the k-th largest key only if at least ``j`` samples land among
    the ``k - 1`` largest keys: probability ``<= exp(-z^2/2)`` (``z = 5``:
    ``3.7e-6``) for every input. Conversely ``#(keys >= lo) > C`` needs fewer than
    ``j`` samples among the ``C`` largest, which for ``mu = s C / d`` with
    ``mu - z sqrt(mu) = j`` has probability ``<= exp(-z^2/2)`` (Chernoff's lower
    tail), ties at ``lo`` aside (the tie branch handles them). Either miss only
    costs time: the exact fallback runs.
    """
    # Sample size: the sample costs ~s, the candidates beyond k ~ z sqrt(k d / s);
    # d / 160 (at most 65536) balances the two on CPU.
    s = min(_SAMPLE_MAX, max(1024, d // 160), d // 16)
    if s < 64:
        return None
    q = kmax / d
    j = int(math.ceil(s * q + _upper_excess(s * q, s * q * (1.0 - q), margin))) + 1
    j = max(1, min(s, j))
    z = _MARGIN  # the capacity always uses the default margin (a test's margin only moves the bracket)
    mu = ((z + math.sqrt(z * z + 4.0 * j)) / 2.0) ** 2
    cap = int(math.ceil(d * mu / s)) + 1
    if 2 * cap >= d:
        return None
    return s, j, max(cap, kmax)


def _sorted_top(keys, kk, kmax: int) -> Array:
    """Small arrays: a stable sort of ``-keys`` (ties keep index order), first ``kmax`` positions."""
    d = keys.shape[0]
    order = lax.sort((-keys, jnp.arange(d, dtype=jnp.int32)), num_keys=1, is_stable=True)[1]
    out = order[:kmax] if kmax <= d else jnp.pad(order, (0, kmax - d))
    return jnp.where(jnp.arange(kmax, dtype=jnp.int32) < kk, out, 0)


_SMALL = 2048


def _identity(v):
    return v


def top_indices(values, kmax: int, key, k=None, *, keys_of=_identity, margin: float = _MARGIN):
    """Exact positions of the ``k`` largest keys ``keys_of(values)`` (ties: lowest index first).

    Args:
      values: ``(d,)`` array; ``keys_of(values)`` are the int32 order keys.
      kmax: static capacity of the result (``k`` if ``k`` is static).
      key: PRNG key for the threshold sample (the result does not depend on it).
      k: traced int32 count ``<= kmax`` (default ``kmax``).
      keys_of: *elementwise* map from values to int32 keys (identity for int32
        keys; :func:`_magnitude_keys` for top-k by magnitude). Keys ``< 0`` are
        never selected (requires ``k <= #(keys >= 0)``). Being elementwise, it is
        fused into the passes that read it instead of materialising the keys.
      margin: the ``z`` of :func:`_sample_plan` (tests pass a negative value to
        force the exact fallback).
    Returns:
      ``(indices, path)``: int32 ``(kmax,)`` (slots ``>= k`` hold 0) and the
      branch taken (``PATH_SAMPLED``, ``PATH_TIES`` or ``PATH_FULL``).

    Algorithm (``d > 2048``): the threshold ``lo`` comes from a uniform sample
    (:func:`_sample_plan`); if the candidates ``key >= lo`` number between ``k``
    and the capacity ``C`` they are compacted and the exact top-``k`` is found
    among them (radix select of the k-th largest key, then compaction of the
    winners); if there are too many because of ties at ``lo`` (e.g. a gradient
    that is mostly exact zeros), the strict candidates ``> lo`` plus the first
    ``C`` ties are used; otherwise the same exact routine runs on the whole
    array. The sample, the candidate pass and the compaction of the first
    ``C`` candidates always run; the selection among them and the two
    fallbacks are ``lax.cond`` branches, so only one runs (outside ``vmap``,
    which turns them into selects). Small arrays use a stable sort. Every
    branch returns the same set.
    """
    d = values.shape[0]
    kk = jnp.int32(kmax) if k is None else jnp.asarray(k, jnp.int32)
    if kmax == 0 or d == 0:
        return jnp.zeros((kmax,), jnp.int32), jnp.int32(PATH_FULL)
    if k is None and kmax >= d:
        return jnp.arange(d, dtype=jnp.int32), jnp.int32(PATH_FULL)
    if d <= _SMALL:
        return _sorted_top(keys_of(values), kk, kmax), jnp.int32(PATH_FULL)

    def full():
        return _exact_top(keys_of(values), jnp.arange(d, dtype=jnp.int32), kk, kmax)

    plan = _sample_plan(d, kmax, margin)
    if plan is None:
        return full(), jnp.int32(PATH_FULL)
    s, jmax, cap = plan
    sample = keys_of(values[uniform_indices(key, s, d)])
    # Order-preserving map of the sampled keys to exactly representable floats
    # (drop 8 low bits), so that lax.top_k's float path (a partial sort on CPU)
    # applies. The j-th largest is taken as a masked min over *all* jmax values:
    # slicing one element out of top_k makes XLA rewrite it into a full sort of
    # the sample (~30x slower), and an optimization_barrier around top_k crashes
    # XLA's TopkDecomposer inside shard_map.
    vals = lax.top_k((sample >> 8).astype(jnp.float32), jmax)[0]
    if k is None:
        j = jmax
    else:
        q = kk.astype(jnp.float32) / d
        jt = jnp.ceil(s * q + _upper_excess(s * q, s * q * (1.0 - q), margin)).astype(jnp.int32) + 1
        j = jnp.clip(jt, 1, jmax)
    jth = jnp.min(jnp.where(jnp.arange(jmax) < j, vals, jnp.inf))
    lo = jnp.maximum(jth.astype(jnp.int32) << 8, 0)
    words = _pack_words(keys_of(values) >= lo)
    count = jnp.sum(_popcount(words))
    # The common case runs outside any lax.cond: compacting the first C candidates and the
    # exact selection among them cost a few small passes, while the same work inside a
    # conditional branch measured twice as slow on XLA:CPU (11.4 ms against 5.1 ms for a
    # 2.4 M-entry tensor). Only the rare fallbacks are branches.
    slots = jnp.arange(cap, dtype=jnp.int32)
    pos, _ = _compact_words(words, cap)
    ck = jnp.where(slots < count, keys_of(values[pos]), -1)
    # A zero of the input's own type: constants built from it are device-varying inside
    # shard_map like the branches computed from ``values``, so the lax.cond branches agree.
    zero = jnp.zeros_like(count)

    def sampled():
        return _exact_top(ck, pos, kk, kmax), jnp.int32(PATH_SAMPLED) + zero

    def ties():
        # One compaction of [keys > lo, keys == lo]: all n_gt <= C strict candidates, then the
        # first 2C - n_gt ties (>= C >= k), both in index order.
        allkeys = keys_of(values)
        tpos, _ = compact(jnp.concatenate([allkeys > lo, allkeys == lo]), 2 * cap)
        tpos = jnp.where(tpos >= d, tpos - d, tpos)
        valid = jnp.arange(2 * cap, dtype=jnp.int32) < count
        tk = jnp.where(valid, keys_of(values[tpos]), -1)
        return _exact_top(tk, tpos, kk, kmax), jnp.int32(PATH_TIES) + zero

    def exact():
        return full() + zero, jnp.int32(PATH_FULL) + zero

    def not_sampled():
        n_gt = jnp.sum(keys_of(values) > lo, dtype=jnp.int32)
        return lax.cond((count >= kk) & (n_gt <= cap), ties, exact)

    idx, path = lax.cond((count >= kk) & (count <= cap), sampled, not_sampled)
    return idx, path


# --------------------------------------------------------------------------- #
# Payloads
# --------------------------------------------------------------------------- #
@payload_dataclass
class SparsePayload(Payload):
    """Fixed-size sparse payload: ``k`` values and their flat indices (top-k).

    Attributes:
      values: ``(k,)`` the selected entries in the input dtype (lossless).
      indices: ``(k,)`` flat positions, :func:`index_dtype` of ``d`` (uint8/uint16/int32).
      shape, dtype: the original tensor's shape and dtype (static, not sent).

    Wire bits: ``k * (bits(dtype) + bits(index dtype))``.
    """

    values: Array
    indices: Array
    shape: tuple = static_field()
    dtype: Any = static_field()


@payload_dataclass
class RandomKPayload(Payload):
    """Random-k payload: ``k`` values; positions are regenerated from ``key``.

    Attributes:
      values: ``(k,)`` the entries at the sampled positions, input dtype.
      key: the raw ``uint32[2]`` PRNG key that drew the positions.
      shape, dtype: original shape and dtype (static).
      scale: ``d / k`` if unbiased else ``1`` (static), applied on decompression.

    ``summable = ("values",)``: with a key shared by every worker the positions
    agree and the values add up. Wire bits (``Payload.wire_bits``): ``k *
    bits(dtype) + 64``; the 64 bits of the key are an upper bound: when the key
    is shared (``compressed_mean``'s allreduce) nobody sends it, and the
    transforms count only the summed ``values``.
    """

    values: Array
    key: Array
    shape: tuple = static_field()
    dtype: Any = static_field()
    scale: float = static_field()
    summable: ClassVar[tuple[str, ...]] = ("values",)


@payload_dataclass
class CountSparsePayload(Payload):
    """Variable-size sparse payload in a fixed-capacity buffer (threshold, DGC, ...).

    Attributes:
      values: ``(cap,)`` selected entries (input dtype); slots ``>= count`` are 0.
      indices: ``(cap,)`` flat positions (:func:`index_dtype`); slots ``>= count`` are 0.
      count: int32 scalar, number of valid slots (``<= cap``).
      shape, dtype: original shape and dtype (static).
      scale: multiplier applied on decompression (static; ``1/p`` for random sparsification).

    Wire bits: ``count * (bits(dtype) + bits(index dtype)) + 32`` (the count
    itself is sent); a traced int32.
    """

    values: Array
    indices: Array
    count: Array
    shape: tuple = static_field()
    dtype: Any = static_field()
    scale: float = static_field(default=1.0)

    def wire_bits(self):
        per = _bits_of(self.values.dtype) + _bits_of(self.indices.dtype)
        return self.count.astype(jnp.int32) * per + 32


@payload_dataclass
class MaskSparsePayload(Payload):
    """Variable-size sparse payload with a bitmask of positions (random sparsification, dense p).

    Attributes:
      mask: uint8 ``(ceil(d/8),)``, bit ``i % 8`` of byte ``i // 8`` set iff entry
        ``i`` is sent (the :func:`pack` layout).
      values: ``(cap,)`` the sent entries in index order (input dtype); slots
        past the number of set bits are 0.
      shape, dtype, scale: as :class:`CountSparsePayload`.

    Wire bits: ``8 * ceil(d/8) + min(popcount(mask), cap) * bits(dtype)`` (the
    count is implied by the mask and not sent); a traced int32.
    """

    mask: Array
    values: Array
    shape: tuple = static_field()
    dtype: Any = static_field()
    scale: float = static_field(default=1.0)

    def wire_bits(self):
        count = jnp.minimum(jnp.sum(_popcount(self.mask.astype(jnp.uint32))), self.values.shape[0])
        return self.mask.shape[0] * 8 + count * _bits_of(self.values.dtype)


def _scatter(values, indices, shape, dtype, scale=1.0):
    """Scatter-add float32 ``values * scale`` at flat ``indices`` into zeros of ``shape``; cast to ``dtype``."""
    v = values.astype(jnp.float32)
    if scale != 1.0:
        v = v * jnp.float32(scale)
    return desparsify(v, indices, shape, jnp.float32).astype(dtype)


def _decompress_sparse(p: SparsePayload):
    return _scatter(p.values, p.indices, p.shape, p.dtype)


def _scatters_whole_buffer(cap: int, d: int) -> bool:
    """Whether a count payload's ``cap``-slot buffer is scattered whole (small: ``cap <= d / 16``,
    or a small tensor), rather than skipping its unused tail with a ``lax.cond``."""
    return cap <= d // 16 or d // 16 < 1024


def _scatter_count(values, indices, count, shape, dtype, scale=1.0):
    """:func:`_scatter` of the first ``count`` slots of a fixed-capacity buffer.

    A scatter costs per slot, valid or not; when the buffer is large
    (``cap > d / 16``) and the count small, only the first ``d / 16`` slots
    are scattered (``lax.cond``).
    """
    d = int(np.prod(shape, dtype=np.int64))
    cap = values.shape[0]
    small = d // 16
    if _scatters_whole_buffer(cap, d):
        return _scatter(values, indices, shape, dtype, scale)
    return lax.cond(
        count <= small,
        lambda: _scatter(values[:small], indices[:small], shape, dtype, scale),
        lambda: _scatter(values, indices, shape, dtype, scale),
    )


def _decompress_count(p: CountSparsePayload):
    return _scatter_count(p.values, p.indices, p.count, p.shape, p.dtype, p.scale)


def sum_scatter(values, indices, shape, dtype, scale=1.0, value_dtype=None):
    """Scatter-add the entries of ``n`` sparse payloads into one dense tensor.

    ``sum_i scatter(values[i], indices[i])``: one zero-filled buffer and one
    scatter-add of all ``n k`` entries (repeated positions add up), instead of
    ``n`` dense tensors added together, so the cost is one pass over the tensor
    plus ``n k`` scattered adds.

    Args:
      values: ``(n, k)`` entries (any float dtype).
      indices: ``(n, k)`` flat positions into a tensor of ``shape``.
      shape: the dense tensor's shape.
      dtype: the result's dtype (the accumulation dtype).
      scale: multiplier applied to every value in float32 (static).
      value_dtype: if given, each scaled value is first rounded to it (the
        tensor's dtype: what a single payload's ``decompress`` returns), so the
        sum matches decompress-then-add up to summation order.
    Returns:
      ``(shape)`` array of ``dtype``.
    """
    v = jnp.ravel(values).astype(jnp.float32)
    if scale != 1.0:
        v = v * jnp.float32(scale)
    if value_dtype is not None:
        v = v.astype(value_dtype)
    return desparsify(v.astype(dtype), jnp.ravel(indices), shape, dtype)


def _decompress_sum_sparse(g: SparsePayload, dtype):
    """``decompress_sum`` of stacked :class:`SparsePayload` (top-k): one scatter."""
    return sum_scatter(g.values, g.indices, g.shape, dtype, value_dtype=g.dtype)


def _decompress_sum_count(g: CountSparsePayload, dtype):
    """``decompress_sum`` of stacked :class:`CountSparsePayload`.

    One scatter of all ``n cap`` slots (unused slots hold 0 at index 0) when
    the buffers are small (``cap <= d / 16``); for large buffers each payload
    is decompressed on its own, so that :func:`_scatter_count` can skip the
    unused tail of each.
    """
    n, cap = g.values.shape
    if _scatters_whole_buffer(cap, int(np.prod(g.shape, dtype=np.int64))):
        return sum_scatter(g.values, g.indices, g.shape, dtype, g.scale, value_dtype=g.dtype)
    total = jnp.zeros(g.shape, dtype)
    for i in range(n):
        total = total + _decompress_count(jax.tree.map(lambda a: a[i], g)).astype(dtype)
    return total


def subtract_sparse(x, values, indices, scale=1.0):
    """``x − scatter(values · scale at indices)`` as one in-place scatter-add into ``x``.

    The compression error of a sparse payload compressed from ``x``:
    ``x − decompress(payload)`` without a dense reconstruction. Each value is
    scaled in float32 and rounded to ``x``'s dtype first, as ``decompress``
    does, so the result is identical (a sent entry of ``x`` becomes exactly 0;
    NaN and Inf entries become NaN, as ``x − x`` does).

    Args:
      x: the tensor the payload was compressed from, any shape.
      values: ``(k,)`` sent entries; indices: ``(k,)`` their flat positions.
      scale: multiplier of the values (static).
    Returns:
      array of ``x``'s shape and dtype.
    """
    v = values.astype(jnp.float32)
    if scale != 1.0:
        v = v * jnp.float32(scale)
    flat = jnp.ravel(x)
    return flat.at[indices.astype(jnp.int32)].add(-v.astype(flat.dtype)).reshape(jnp.shape(x))


def _error_sparse(x, p: SparsePayload):
    """``compression_error`` of :class:`SparsePayload` (top-k): one scatter into ``x``."""
    return subtract_sparse(x, p.values, p.indices)


def _error_count(x, p: CountSparsePayload):
    """``compression_error`` of :class:`CountSparsePayload`: one scatter into ``x`` when the
    buffer is small (``cap <= d / 16``), else ``x − decompress(p)`` (which skips unused slots)."""
    if _scatters_whole_buffer(p.values.shape[0], int(np.size(x))):
        return subtract_sparse(x, p.values, p.indices, p.scale)
    return x - _decompress_count(p).astype(x.dtype)


def _decompress_mask(p: MaskSparsePayload):
    d = int(np.prod(p.shape, dtype=np.int64))
    cap = p.values.shape[0]
    if d == 0 or cap == 0:
        return jnp.zeros(p.shape, p.dtype)
    if d <= _SMALL:
        pos, total = compact(unpack(p.mask, 1, d).astype(bool), cap)
    else:
        b = p.mask.astype(jnp.uint32)
        b = jnp.pad(b, (0, (-b.shape[0]) % 4)).reshape(-1, 4)
        words = b[:, 0] | (b[:, 1] << 8) | (b[:, 2] << 16) | (b[:, 3] << 24)
        pos, total = _compact_words(words, cap)
    vals = jnp.where(jnp.arange(cap) < total, p.values.astype(jnp.float32), 0.0)
    return _scatter_count(vals, pos, total, p.shape, p.dtype, p.scale)


def _sparse_payload(x, idx, k_valid=None):
    """Gather ``x.ravel()[idx]`` into a :class:`SparsePayload` / :class:`CountSparsePayload`."""
    d = int(np.size(x))
    flat = jnp.ravel(x)
    vals = flat[idx]
    if k_valid is not None:
        valid = jnp.arange(idx.shape[0]) < k_valid
        vals = jnp.where(valid, vals, jnp.zeros_like(vals))
        idx = jnp.where(valid, idx, 0)
    return vals, idx.astype(index_dtype(max(d, 1)))


# --------------------------------------------------------------------------- #
# random-k
# --------------------------------------------------------------------------- #
def _raw_key(key):
    if jnp.issubdtype(jnp.result_type(key), jax.dtypes.prng_key):
        return jax.random.key_data(key)
    return jnp.asarray(key, jnp.uint32)


def randomk_indices(key, d: int, k: int) -> Array:
    """The ``k`` positions random-k draws from ``key`` for a ``d``-element tensor (int32, index order).

    A uniformly random ``k``-subset, drawn as the positions of the ``k`` largest
    of ``d`` distinct pseudo-random words ``h(i)`` (:func:`_hash_uniform_bits`,
    31 high bits compared; ties, of probability ``~d / 2**31`` per draw, go to
    the lower index). Deterministic in ``key``: every worker holding the same
    key draws the same positions.
    """
    if k >= d:
        return jnp.arange(d, dtype=jnp.int32)
    seeds = _hash_seeds(key)
    idx, _ = top_indices(_hash_uniform_bits(seeds, d), k, jax.random.fold_in(_raw_key(key), 1),
                         keys_of=lambda h: (h >> 1).astype(jnp.int32))
    return idx


@register("randomk")
def randomk(*, ratio: float, unbiased: bool = False, seed: int = 0) -> Compressor:
    """Random-k sparsification (GRACE Table I; Stich et al. 2018).

    Sends ``k = max(1, round(ratio * d))`` entries at uniformly random positions
    without replacement (rounded half up). ``Q(x) = s * x (.) b`` with ``b`` the
    random mask and ``s = d / k`` if ``unbiased`` (then ``E[Q(x)] = x``, since
    each position is drawn with probability ``k / d``) else ``s = 1`` (biased,
    the form used with error feedback).

    Positions come from the key (:func:`randomk_indices`) and are *not* sent:
    the payload is the ``k`` values plus the key, and the receiver regenerates
    the positions. With a key shared by all workers (``compressed_mean`` passes
    the shared key to allreduce compressors) the payloads sum: strategy
    ``"allreduce"``, summable field ``values``.

    Wire bits: ``k * bits(dtype) + 64`` (the key counted although a shared key
    is never sent; the transforms count only the values). NaN/Inf are ordinary
    values: sent as they are when drawn.

    Args:
      ratio: fraction of entries sent, in (0, 1].
      unbiased: scale by ``d / k`` so that ``E[Q(x)] = x``.
      seed: seed of the optax transformation's key.
    Raises:
      ValueError/TypeError: ``ratio`` outside (0, 1], ``unbiased`` not a bool.
    """
    ratio = check_ratio(ratio, "ratio")
    if not isinstance(unbiased, (bool, np.bool_)):
        raise TypeError(f"unbiased must be a bool; got {unbiased!r}")
    unbiased = bool(unbiased)

    def compress(x, key, state):
        d = int(np.size(x))
        k = num_selected(ratio, d)
        raw = _raw_key(key)
        idx = randomk_indices(raw, d, k)
        vals = jnp.ravel(x)[idx]
        scale = (d / k) if (unbiased and k > 0) else 1.0
        return RandomKPayload(values=vals, key=raw, shape=tuple(np.shape(x)), dtype=x.dtype, scale=scale), state

    def decompress(p: RandomKPayload):
        d = int(np.prod(p.shape, dtype=np.int64))
        idx = randomk_indices(p.key, d, p.values.shape[0])
        return _scatter(p.values, idx, p.shape, p.dtype, p.scale)

    return Compressor.create(
        name="randomk", compress=compress, decompress=decompress, unbiased=unbiased,
        strategy="allreduce", seed=seed, params=dict(ratio=ratio, unbiased=unbiased),
    )


# --------------------------------------------------------------------------- #
# top-k
# --------------------------------------------------------------------------- #
def topk_indices(x, k: int, key=None):
    """Flat positions of the ``k`` largest ``|x|`` (exact; ties to the lowest index), int32 ``(k,)``.

    NaN counts as larger than +Inf (so NaN entries are always selected).
    Order of the result: increasing index on the common path; unspecified in
    general (the *set* is exact). See :func:`top_indices` for the algorithm.
    """
    key = jax.random.PRNGKey(0) if key is None else key
    idx, _ = top_indices(jnp.ravel(x), k, key, keys_of=_magnitude_keys)
    return idx


@register("topk")
def topk(*, ratio: float, seed: int = 0) -> Compressor:
    """Top-k sparsification (GRACE Table I; Aji & Heafield 2017, Stich et al. 2018).

    Sends the ``k = max(1, round(ratio * d))`` entries of largest magnitude
    (``b_i = 1`` iff ``|x_i|`` is among the ``k`` largest, GRACE Sec. III-B),
    exactly: the selected set equals ``np.argpartition(-|x|, k-1)[:k]`` up to
    ties, and ties at the k-th magnitude go to the lowest indices, so the
    result is deterministic. Contraction: ``||x - Q(x)||^2 <= (1 - k/d) ||x||^2``.

    The selection is a sampled-threshold filter followed by an exact selection
    among the candidates, with an exact fallback (:func:`top_indices`): a few
    memory passes on CPU, where ``jax.lax.top_k`` with a large ``k`` is tens of
    passes. NaN counts as the largest magnitude (above +Inf): NaN entries are
    always sent and propagate, as they would in the dense gradient.

    Payload :class:`SparsePayload`: values in the input dtype (lossless) and
    indices in :func:`index_dtype` of ``d``. Wire bits ``k * (bits(dtype) +
    bits(index dtype))``. Biased, deterministic; strategy ``"allgather"``.

    Args:
      ratio: fraction of entries sent, in (0, 1]; ``ratio = 1`` is lossless.
      seed: seed of the optax transformation's key (used only to sample the threshold).
    """
    ratio = check_ratio(ratio, "ratio")

    def compress(x, key, state):
        d = int(np.size(x))
        k = num_selected(ratio, d)
        idx = topk_indices(x, k, key)
        vals, idx = _sparse_payload(x, idx)
        return SparsePayload(values=vals, indices=idx, shape=tuple(np.shape(x)), dtype=x.dtype), state

    return Compressor.create(
        name="topk", compress=compress, decompress=_decompress_sparse, decompress_sum=_decompress_sum_sparse,
        compression_error=_error_sparse, unbiased=False,
        strategy="allgather", seed=seed, params=dict(ratio=ratio),
    )


# --------------------------------------------------------------------------- #
# Threshold-v
# --------------------------------------------------------------------------- #
def _capacity(max_ratio: float, d: int) -> int:
    return int(min(d, max(1, math.ceil(max_ratio * d)))) if d else 0


@register("threshold")
def threshold(*, v: float, max_ratio: float = 1.0, seed: int = 0) -> Compressor:
    """Threshold-v sparsification (GRACE Table I; Dutta et al. 2020): send every ``|x_i| >= v``.

    ``b_i = 1`` iff ``|x_i| >= v`` (GRACE Sec. III-B). The number sent varies, so
    the payload is a fixed-capacity buffer of ``cap = max(1, ceil(max_ratio * d))``
    slots plus a count (:class:`CountSparsePayload`); with the default
    ``max_ratio = 1`` nothing is ever dropped. If more than ``cap`` entries
    qualify, the first ``cap`` in index order are sent (error feedback keeps
    the rest). NaN entries are always selected (NaN counts as an infinite
    magnitude, as in :func:`topk`); ``+-Inf`` qualify for every finite ``v``.

    Wire bits: ``count * (bits(dtype) + bits(index dtype)) + 32``. Biased,
    deterministic; strategy ``"allgather"``.

    Args:
      v: threshold, finite and ``>= 0`` (``v = 0`` sends everything).
      max_ratio: buffer capacity as a fraction of ``d``, in (0, 1].
    """
    v = check_finite_scalar(v, "v", nonnegative=True)
    max_ratio = check_ratio(max_ratio, "max_ratio")

    def compress(x, key, state):
        del key
        d = int(np.size(x))
        cap = _capacity(max_ratio, d)
        xf = _flat_f32(x)
        mask = (jnp.abs(xf) >= v) | jnp.isnan(xf)
        pos, total = compact(mask, cap)
        count = jnp.minimum(total, cap)
        vals, idx = _sparse_payload(x, pos, count)
        return CountSparsePayload(values=vals, indices=idx, count=count, shape=tuple(np.shape(x)), dtype=x.dtype), state

    return Compressor.create(
        name="threshold", compress=compress, decompress=_decompress_count, decompress_sum=_decompress_sum_count,
        compression_error=_error_count, unbiased=False,
        strategy="allgather", seed=seed, params=dict(v=v, max_ratio=max_ratio),
    )


# --------------------------------------------------------------------------- #
# DGC
# --------------------------------------------------------------------------- #
class DGCPlan(NamedTuple):
    """Static sizes of DGC's selection for a ``d``-element tensor (``dgc/compression.py``).

    Attributes:
      num_selects: ``k = ceil(d * ratio)``, the buffer capacity.
      num_samples: ``d`` if ``d <= ceil(2 / ratio)``, else ``max(ceil(d * sample_ratio), ceil(2 / ratio))``.
      top_k_samples: ``ceil(num_samples * ratio)``.
    """

    num_selects: int
    num_samples: int
    top_k_samples: int


def dgc_plan(d: int, ratio: float, sample_ratio: float) -> DGCPlan:
    """The static sizes DGC uses for a tensor of ``d`` entries (see :class:`DGCPlan`)."""
    num_selects = min(d, int(math.ceil(d * ratio)))
    pct = int(math.ceil(d * sample_ratio))
    cpr = int(math.ceil(2.0 / ratio))
    num_samples = d if (d <= cpr or sample_ratio >= 1.0) else min(d, max(pct, cpr))
    top_k_samples = max(1, min(num_samples, int(math.ceil(num_samples * ratio))))
    return DGCPlan(num_selects, num_samples, top_k_samples)


def dgc_sample_indices(key, d: int, num_samples: int) -> Array:
    """The positions DGC samples to estimate its threshold (uniform with replacement; all if ``num_samples == d``)."""
    if num_samples >= d:
        return jnp.arange(d, dtype=jnp.int32)
    return uniform_indices(key, num_samples, d)


def _dgc_importance(x):
    """``|x|`` in float32 with NaN mapped to +Inf (NaN counts as an infinite magnitude)."""
    xf = _flat_f32(x)
    return jnp.where(jnp.isnan(xf), jnp.inf, jnp.abs(xf))


@register("dgc")
def dgc(
    *,
    ratio: float,
    sample_ratio: float = 0.01,
    upper_bound: float = 1.3,
    lower_bound: float = 0.8,
    max_adaptation_iters: int = 10,
    seed: int = 0,
) -> Compressor:
    """Deep Gradient Compression's sparsifier (Lin et al. 2018; GRACE Table I), from the authors' code.

    With ``k = ceil(d * ratio)`` (``num_selects``): sample ``num_samples``
    magnitudes uniformly (:func:`dgc_plan`), take the threshold ``thr`` = the
    smallest of the sample's ``ceil(num_samples * ratio)`` largest, select
    ``|x| >= thr``; then (only when the tensor was sampled, ``d > num_samples``)
    adapt for at most ``max_adaptation_iters`` rounds: if more than
    ``upper_bound * k`` are selected, *resample*: take the exact top-k among the
    selected (which is the exact top-k of ``x``) and stop; if between ``k`` and
    ``upper_bound * k``, stop; if fewer than ``lower_bound * k``, lower the
    threshold ``thr <- lower_bound * thr`` and select again. Finally keep the
    first ``k`` selected in index order (``indices[:num_selects]``).

    DGC's momentum correction and factor masking are memory functions (see
    :mod:`jaxcomm.memory`), not part of the compressor (GRACE Sec. IV-C).
    NaN counts as an infinite magnitude (NaN entries are selected first).

    Payload :class:`CountSparsePayload` of capacity ``k`` (count ``<= k``); wire
    bits ``count * (bits(dtype) + bits(index dtype)) + 32``. Biased; strategy
    ``"allgather"``.

    Args:
      ratio: target fraction of entries sent, in (0, 1].
      sample_ratio: fraction of entries sampled for the threshold, in (0, 1].
      upper_bound: > 1; above ``upper_bound * k`` selected, re-select the exact top-k.
      lower_bound: in (0, 1); below ``lower_bound * k`` selected, lower the threshold.
      max_adaptation_iters: >= 0 rounds of threshold adaptation.
    """
    ratio = check_ratio(ratio, "ratio")
    sample_ratio = check_ratio(sample_ratio, "sample_ratio")
    upper_bound = check_finite_scalar(upper_bound, "upper_bound")
    if upper_bound <= 1.0:
        raise ValueError(f"upper_bound must be > 1; got {upper_bound}")
    lower_bound = check_finite_scalar(lower_bound, "lower_bound")
    if not 0.0 < lower_bound < 1.0:
        raise ValueError(f"lower_bound must be in (0, 1); got {lower_bound}")
    max_adaptation_iters = check_positive_int(max_adaptation_iters, "max_adaptation_iters", minimum=0)

    def compress(x, key, state):
        d = int(np.size(x))
        shape = tuple(np.shape(x))
        plan = dgc_plan(d, ratio, sample_ratio)
        k = plan.num_selects
        if d == 0:
            z = jnp.zeros((0,), x.dtype)
            return CountSparsePayload(z, z.astype(jnp.uint8), jnp.int32(0), shape, x.dtype), state
        imp = _dgc_importance(x)
        sample = imp[dgc_sample_indices(key, d, plan.num_samples)]
        # min over all top-k values (not [-1]): a one-element slice makes XLA rewrite top_k into a full sort.
        thr = jnp.min(lax.top_k(sample, plan.top_k_samples)[0])
        # The selection mask lives bit-packed: its popcount is the count, its compaction the indices
        # (small tensors keep the plain mask, compacted by a sort).
        packed = d > _SMALL

        def select(t):
            m = imp >= t
            if packed:
                w = _pack_words(m)
                return w, jnp.sum(_popcount(w))
            return m, jnp.sum(m, dtype=jnp.int32)

        words, count = select(thr)
        adapt = d > plan.num_samples and max_adaptation_iters > 0
        resample = jnp.bool_(False)
        if adapt:
            kf = float(k)

            def cond(c):
                it, done = c[3], c[4]
                return (~done) & (it < max_adaptation_iters)

            def body(c):
                thr, words, count, it, _, resample = c
                cf = count.astype(jnp.float32)
                too_many = cf > kf
                resample_now = too_many & (cf > upper_bound * kf)
                too_few = (~too_many) & (cf < lower_bound * kf)

                def lower():  # a pass over the tensor only when the threshold is lowered
                    t = thr * lower_bound
                    return (t, *select(t))

                thr, words, count = lax.cond(too_few, lower, lambda: (thr, words, count))
                return thr, words, count, it + 1, ~too_few, resample | resample_now

            zero = jnp.zeros_like(count)
            thr, words, count, _, _, resample = lax.while_loop(
                cond, body, (thr, words, count, zero, zero < 0, zero < 0)
            )

        def exact_topk():
            idx, _ = top_indices(imp, k, jax.random.fold_in(key, 1),
                                 keys_of=lambda v: lax.bitcast_convert_type(v, jnp.int32))
            return idx, jnp.int32(k) + jnp.zeros_like(count)

        def first_k():
            pos, total = _compact_words(words, k) if packed else compact(words, k)
            return pos, jnp.minimum(total, k)

        if adapt:
            idx, n = lax.cond(resample, exact_topk, first_k)
        else:  # the whole tensor was "sampled": no adaptation, hence no resampling
            idx, n = first_k()
        vals, idx = _sparse_payload(x, idx, n)
        return CountSparsePayload(values=vals, indices=idx, count=n, shape=shape, dtype=x.dtype), state

    return Compressor.create(
        name="dgc", compress=compress, decompress=_decompress_count, decompress_sum=_decompress_sum_count,
        compression_error=_error_count, unbiased=False, strategy="allgather",
        seed=seed, params=dict(ratio=ratio, sample_ratio=sample_ratio, upper_bound=upper_bound,
                               lower_bound=lower_bound, max_adaptation_iters=max_adaptation_iters),
    )


# --------------------------------------------------------------------------- #
# Random sparsification (DoubleSqueeze)
# --------------------------------------------------------------------------- #
def random_sparsification_plan(p: float, d: int, dtype) -> tuple[str, int]:
    """``(encoding, capacity)`` random sparsification uses for ``d`` entries of ``dtype``.

    Capacity ``min(d, ceil(p d + 8 sigma + 24))``, ``sigma = sqrt(d p (1-p))``: by
    Bernstein's inequality more than ``cap`` draws has probability
    ``< exp(-36) ~ 2e-16`` for every ``d`` and ``p``. Encoding: the bitmask
    (``d`` bits + values) when its expected size is below the index list's
    (``p d (bits(index) + bits(dtype)) + 32``), i.e. when ``p * bits(index) + ...
    > 1``; otherwise a count + index list.
    """
    if d == 0:
        return "indices", 0
    sigma = math.sqrt(d * p * (1.0 - p))
    cap = int(min(d, math.ceil(p * d + 8.0 * sigma + 24.0)))
    vb = _bits_of(dtype)
    ib = _bits_of(index_dtype(d))
    mask_bits = 8 * packed_size(d, 1) + p * d * vb
    index_bits = p * d * (vb + ib) + 32
    return ("mask" if mask_bits < index_bits else "indices"), cap


def _keep_threshold(p: float) -> tuple[int, float]:
    """uint32 threshold ``T = round(p 2^32)`` and the exact keep probability ``T / 2^32``."""
    t = int(min(2**32 - 1, max(1, round(p * 2.0**32))))
    return t, t / 2.0**32


@register("random_sparsification")
def random_sparsification(*, p: float, seed: int = 0) -> Compressor:
    """Random sparsification (DoubleSqueeze, Tang et al. 2019; Wangni et al. 2018): keep ``x_i / p`` w.p. ``p``.

    Each entry is kept independently with probability ``p`` and rescaled by
    ``1/p`` on receipt, so ``E[Q(x)] = x`` (unbiased). The draw compares a
    32-bit counter-based hash of the position (keyed by the PRNG key) with
    ``T = round(p 2^32)``; the keep probability is exactly ``p' = T / 2^32`` and
    the scale is ``1/p'`` (``|p' - p| <= 2^-33``), so unbiasedness is exact.
    ``p = 1`` is lossless.

    Encoding (static, :func:`random_sparsification_plan`): a packed bitmask plus
    the kept values (:class:`MaskSparsePayload`) when that is cheaper in
    expectation, else a count plus index list (:class:`CountSparsePayload`),
    both in a buffer of capacity ``p d + 8 sigma + 24`` (overflow probability
    ``< 2e-16``, the excess, highest indices, would be dropped). NaN/Inf are
    ordinary values (NaN/p = NaN). Strategy ``"allgather"``.

    Args:
      p: keep probability in (0, 1].
    """
    p = check_ratio(p, "p")
    t, p_exact = _keep_threshold(p)
    scale = 1.0 / p_exact if p < 1.0 else 1.0

    def compress(x, key, state):
        d = int(np.size(x))
        shape = tuple(np.shape(x))
        encoding, cap = random_sparsification_plan(p, d, x.dtype)
        if p < 1.0:
            keep = _hash_uniform_bits(_hash_seeds(key), d) < jnp.uint32(t)
        else:
            keep = jnp.ones((d,), bool)
        pos, total = compact(keep, cap)
        count = jnp.minimum(total, cap)
        vals, idx = _sparse_payload(x, pos, count)
        if encoding == "mask":
            mask = pack(keep, 1)
            return MaskSparsePayload(mask=mask, values=vals, shape=shape, dtype=x.dtype, scale=scale), state
        return CountSparsePayload(values=vals, indices=idx, count=count, shape=shape, dtype=x.dtype, scale=scale), state

    def decompress(payload):
        if isinstance(payload, MaskSparsePayload):
            return _decompress_mask(payload)
        return _decompress_count(payload)

    return Compressor.create(
        name="random_sparsification", compress=compress, decompress=decompress, unbiased=True,
        strategy="allgather", seed=seed, params=dict(p=p),
    )

