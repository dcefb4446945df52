"""Selection kernels: exact top-k on int32 order keys.

Every selection is done on *int32 order keys*; for magnitudes the key is the
float32 bit pattern of ``|x|`` (sign bit cleared, :func:`magnitude_keys`),
whose integer order is the float order on ``[0, +Inf]`` and puts NaN above
+Inf. The candidates above a sampled threshold are compacted with the
bit-packed kernels of :mod:`.compact` (:func:`~.compact.compact`: the positions
of the first ``cap`` true entries, in index order); vectors of at most
``SMALL = 2048`` entries use a stable sort instead (cheaper to compile), and on
CPU vectors of at most ``CPU_PRIMITIVE_MAX = 65536`` entries, of which at most
``CPU_PRIMITIVE_K_MAX = 400`` are selected, one ``lax.top_k`` of the keys viewed as
float32 (:func:`top_by_float_view`), whose cost there is below the sampled path's
fixed cost.
:func:`top_indices` is the exact top-k used by top-k, DGC, random-k and the
adaptive threshold.

**The platform decides the kernel, at lowering time.** The bit-packed
compaction, the sampled threshold, the radix select and their ``lax.cond``
fallbacks are tuned for XLA:CPU; lowered for a GPU or a TPU they are a large
program (sequential scans, nested conditionals) that compiles slowly there.
:func:`top_indices`, :func:`top_indices_reusing`, :func:`~.compact.compact` and
:func:`~.compact.compact_words` therefore choose their body with
``jax.lax.platform_dependent`` (:func:`~jaxcomm._vma.typed_platform_dependent`):
lowered for ``cpu`` they run the tuned path above; lowered for ``cuda``,
``rocm`` or ``tpu`` they run the primitives XLA compiles well there --
``jnp.nonzero`` (a prefix sum and a scatter) for compaction
(:func:`~.compact.compact_by_primitive`), and for selection the exact
``lax.top_k`` (stable: ties to the lowest index; :func:`top_by_primitive`) over
all keys below ``ACCELERATOR_SAMPLED_MIN`` keys, from there on over the
candidates above a sampled threshold only, compacted by ``jnp.nonzero``, with
``lax.top_k`` over all keys as the ``lax.cond`` fallback
(:func:`top_by_threshold`: memory passes over the keys instead of a sort of
them, which is what ``lax.top_k`` of a large ``k`` is on a GPU). All paths return
the same indices in the same order for every input (``tests/test_sparsifiers.py``
runs the accelerator bodies on the CPU against the tuned path and NumPy). The choice
follows the platform the computation is *lowered* for, not
``jax.default_backend()``: ``jax.jit(f).trace(x).lower(lowering_platforms=
("cuda",))`` on a CPU host lowers the accelerator body.
"""

from __future__ import annotations

import math

import jax
import jax.numpy as jnp
from jax import lax

from ..._vma import typed_platform_dependent, vary_like
from .bitpack import pack_bits, popcount
from .compact import SMALL, _compact_cpu, _compact_words_cpu, _nth_set, compact_by_primitive
from .random_bits import uniform_indices

Array = jax.Array


_NAN_KEY = 0x7FC00000


def magnitude_keys(x) -> Array:
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


_SAMPLE_MAX = 65536


_MARGIN = 5.0


PATH_SAMPLED, PATH_TIES, PATH_FULL, PATH_REUSED, PATH_PRIMITIVE = 0, 1, 2, 3, 4
"""Which branch :func:`top_indices` (or :func:`top_indices_reusing`) took (returned for tests and diagnostics);
``PATH_PRIMITIVE``: ``lax.top_k`` over all keys (:func:`top_by_primitive`; on CPU, of at most
``CPU_PRIMITIVE_MAX`` keys, :func:`top_by_float_view`); lowered for an accelerator, ``PATH_SAMPLED`` is
:func:`top_by_threshold`'s top-k among the sampled candidates."""

CPU_PRIMITIVE_MAX = 1 << 16
"""Up to this many keys (and above ``SMALL``), and for at most ``CPU_PRIMITIVE_K_MAX`` selected, the CPU
selection is one ``lax.top_k`` of the keys viewed as float32 (:func:`top_by_float_view`) instead of the
sampled threshold, whose fixed cost (the sample, a count, a compaction and the selection among the
candidates) dominates at these sizes. Measured on this machine's CPU, sampled threshold / float view
(``experiments/benchmarks/kernels.py --comparisons top_k``, ``results/kernels_top_k_cpu.json``): 2.9x at
9,216 and 36,864 keys for 0.1 %, 1.2x at 65,536; for 1 %, 2.8x at 9,216, 1.0x at 36,864 (``k`` = 369) and
0.7x at 65,536 (``k`` = 655); at 147,456 keys and above the sampled threshold is faster (0.8x and 0.5x)."""

CPU_PRIMITIVE_K_MAX = 400
"""The largest ``kmax`` :func:`top_by_float_view` serves on CPU (see ``CPU_PRIMITIVE_MAX``)."""


def _radix_kth(keys, k) -> Array:
    """Largest ``t >= 0`` with ``#(keys >= t) >= k`` (the k-th largest key), bit by bit from bit 30.

    31 counting passes over ``keys`` in a ``fori_loop`` (one compiled body).
    """

    def body(i, t):
        trial = t | jnp.left_shift(jnp.int32(1), 30 - i)
        return jnp.where(jnp.sum(keys >= trial, dtype=jnp.int32) >= k, trial, t)

    # Inside shard_map the carry must be device-varying over the axes of keys and k, like the body's output.
    return lax.fori_loop(0, 31, body, vary_like(jnp.int32(0), keys, k))


def _exact_top(ck, cand_idx, k, kmax: int) -> tuple[Array, Array]:
    """Exact top-``k`` of a candidate buffer: ``(cand_idx of the winners (kmax,), t)``.

    ``ck`` are the candidates' keys (``-1`` = empty slot), at least ``k`` of them
    non-negative. Selected: every key above the k-th largest ``t``, then the
    first ``k - #(> t)`` keys equal to ``t`` in buffer order (lowest index first).
    Slots ``>= k`` hold index 0. ``t`` (int32 scalar) is returned too.
    """
    m = ck.shape[0]
    t = _radix_kth(ck, k)
    gt = ck > t
    need = k - jnp.sum(gt, dtype=jnp.int32)
    tie = ck == t
    last = _nth_set(pack_bits(tie, 1, jnp.uint32), need - 1)
    sel = gt | (tie & (jnp.arange(m, dtype=jnp.int32) <= last))
    pos, _ = _compact_cpu(sel, kmax)
    out = cand_idx[pos]
    return jnp.where(jnp.arange(kmax, dtype=jnp.int32) < k, out, 0), t


def _upper_excess(mean, var, z):
    """Bernstein deviation ``t`` with ``P(X - E X >= t) <= exp(-z^2 / 2)`` for a Binomial ``X`` (``z >= 0``).

    Bernstein: ``P(X - mean >= t) <= exp(-t^2 / (2 (var + t/3)))``; solving
    ``t^2 = z^2 (var + t/3)`` gives ``t = (z^2/3 + sqrt(z^4/9 + 4 z^2 var)) / 2``.
    A negative ``z`` (tests forcing the fallback) gives ``z sqrt(var)``. Works on
    Python floats and traced arrays.
    """
    if isinstance(z, (int, float)) and z < 0:
        return z * (var**0.5)
    return (z * z / 3.0 + (z**4 / 9.0 + 4.0 * z * z * var) ** 0.5) / 2.0


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


def top_by_primitive(keys, k, kmax: int, positions=None) -> Array:
    """:func:`top_indices`' accelerator body below ``ACCELERATOR_SAMPLED_MIN`` keys: the exact top-``k`` of
    int32 ``keys`` by ``lax.top_k``.

    ``lax.top_k`` returns the ``kmax`` largest keys' positions, ties to the lowest
    index (it is stable), so its first ``k`` are the set the CPU path selects; they
    are then sorted into increasing index order, the CPU path's order for more than
    ``SMALL`` entries. ``keys``: ``(d,)`` int32; ``k``: traced int32 ``<= kmax``
    (``<= #(keys >= 0)``). Returns int32 ``(kmax,)``, slots ``>= k`` holding 0. On
    GPU and TPU a large ``k`` is one sort of the keys and their positions.
    ``positions``: int32 ``(d,)``, increasing, the index each key stands for (the
    candidates of :func:`top_by_threshold`); the winners are mapped through it
    before the sort (default: the identity).
    """
    d = keys.shape[0]
    m = min(kmax, d)
    idx = lax.top_k(keys, m)[1]
    if positions is not None:
        idx = positions[idx]
    if m < kmax:
        idx = jnp.pad(idx, (0, kmax - m))
    first = jnp.arange(kmax, dtype=jnp.int32) < k
    idx = jnp.sort(jnp.where(first, idx, jnp.iinfo(jnp.int32).max))
    return jnp.where(first, idx, 0)


def top_by_float_view(keys, k, kmax: int) -> Array:
    """:func:`top_by_primitive` of int32 ``keys`` bitcast to float32: XLA:CPU's ``lax.top_k`` of the keys'
    order, one partial sort, where ``lax.top_k`` of int32 keys is a full sort of them.

    Exact because XLA:CPU's float32 top-k compares the values' bit patterns as sign-magnitude integers (a
    total order: ``-0.0 < +0.0``, NaN patterns by their bits) and breaks ties to the lowest index, so the
    non-negative keys keep their integer order and every negative key ranks below them.
    ``tests/test_sparsifiers.py`` checks this against NumPy on ties, NaN, infinities, subnormals and
    arbitrary int32 keys, under ``jit``, ``vmap`` and ``shard_map``. ``keys``: ``(d,)`` int32; ``k``, ``kmax``
    and the result as :func:`top_by_primitive`.
    """
    return top_by_primitive(lax.bitcast_convert_type(keys, jnp.float32), k, kmax)


def _float_view_serves(d: int, kmax: int, primitive_max: int | None) -> bool:
    """Whether the CPU selects ``kmax`` of ``d > SMALL`` keys by :func:`top_by_float_view` (``None``: the constant)."""
    return d <= (CPU_PRIMITIVE_MAX if primitive_max is None else primitive_max) and kmax <= CPU_PRIMITIVE_K_MAX


def _identity(v):
    return v


ACCELERATOR_SAMPLED_MIN = 1 << 20
"""From this many keys up, the accelerator selection is :func:`top_by_threshold` (O(d) memory passes);
below it, :func:`top_by_primitive` (one ``lax.top_k``: a sort of ``d`` keys, cheap at that size). A
chosen value, not yet a measured crossover: ``experiments/benchmarks/gpu_select.py`` times both bodies
at sizes around it (``--crossover-sizes``)."""


def _readers(values):
    """``(d, all_values, gather)`` for :func:`top_indices`' ``values``: a ``(d,)`` array, or a Python int
    ``d`` standing for the counters ``0..d-1`` (uint32), rebuilt where read and never a stored operand."""
    if isinstance(values, int):
        d = values

        def all_counters():
            return jnp.arange(d, dtype=jnp.uint32)

        def counters_at(i):
            return i.astype(jnp.uint32)

        return d, all_counters, counters_at
    return values.shape[0], (lambda: values), (lambda i: values[i])


def _sampled_threshold(gather, d: int, s: int, jmax: int, key, k, kk, keys_of, margin: float) -> Array:
    """The sampled threshold ``lo >= 0`` of :func:`_sample_plan`: the ``j``-th largest of ``s`` keys drawn
    uniformly (with replacement) by :func:`~.random_bits.uniform_indices`, low 8 bits cleared; int32 scalar.

    ``j = jmax`` for a static ``k``; for a traced ``kk`` the plan's rank for ``q = kk / d``, at most ``jmax``.
    """
    sample = keys_of(gather(uniform_indices(key, s, d)))
    # Order-preserving map of the sampled keys to exactly representable floats
    # (drop 8 low bits), so that lax.top_k's float path (a partial sort on CPU)
    # applies. The j-th largest is taken as a masked min over *all* jmax values:
    # slicing one element out of top_k makes XLA rewrite it into a full sort of
    # the sample (~30x slower), and an optimization_barrier around top_k crashes
    # XLA's TopkDecomposer inside shard_map.
    vals = lax.top_k((sample >> 8).astype(jnp.float32), jmax)[0]
    if k is None:
        j: int | Array = jmax
    else:
        q = kk.astype(jnp.float32) / d
        jt = jnp.ceil(s * q + _upper_excess(s * q, s * q * (1.0 - q), margin)).astype(jnp.int32) + 1
        j = jnp.clip(jt, 1, jmax)
    jth = jnp.min(jnp.where(jnp.arange(jmax) < j, vals, jnp.inf))
    return jnp.maximum(jth.astype(jnp.int32) << 8, 0)


def top_by_threshold(values, kmax: int, key, k=None, *, keys_of=_identity, margin: float = _MARGIN):
    """:func:`top_indices`' accelerator body for large ``d``: a sampled threshold, then ``lax.top_k`` over
    the compacted candidates only; the indices of :func:`top_by_primitive` for every input.

    With ``(s, jmax, C)`` from :func:`_sample_plan`: the threshold ``lo`` is the ``j``-th largest
    of ``s`` sampled keys (:func:`_sampled_threshold`), one pass counts ``c = #(keys >= lo)``, and
    if ``k <= c <= C`` (``lax.cond``) the candidates' positions are compacted in index order
    (:func:`~.compact.compact_by_primitive`, ``jnp.nonzero(size=C)``), their keys gathered (empty
    slots ``-1``), and the exact stable ``lax.top_k`` of the ``C`` candidate keys mapped back to
    positions and sorted. Every key of the top-``k`` set (keys above the ``k``-th largest ``t``,
    then the lowest-indexed ties at ``t``) is ``>= t >= lo``, hence a candidate, and the
    candidates are in index order, so top_k's stability picks the same ties as over all keys.
    Otherwise (a sample miss, probability ``<= 2 exp(-margin^2 / 2)`` each way, or ties at
    ``lo`` pushing ``c`` above ``C``) the branch is :func:`top_by_primitive` on all keys. Cost
    of the common branch: the keys read about three times (count, prefix sum, scatter) and a
    top-k of ``C ~ k + O(sqrt(k d / s))`` keys, instead of a sort of ``d`` keys.

    Args and returns as :func:`top_indices` (``values`` a ``(d,)`` array or the int ``d``; ``k``
    traced ``<= kmax``, default ``kmax``); the path is ``PATH_SAMPLED`` for the candidates'
    branch, ``PATH_PRIMITIVE`` for ``lax.top_k`` over all keys. Without a
    sampling plan (``d <= SMALL``, ``kmax >= d``, or a capacity near ``d``) it is
    :func:`top_by_primitive` alone.
    """
    d, all_values, gather = _readers(values)
    kk = jnp.int32(kmax) if k is None else jnp.asarray(k, jnp.int32)
    plan = _sample_plan(d, kmax, margin) if d > SMALL and 0 < kmax < d else None
    if plan is None:
        return top_by_primitive(keys_of(all_values()), kk, kmax), jnp.int32(PATH_PRIMITIVE)
    s, jmax, cap = plan
    lo = _sampled_threshold(gather, d, s, jmax, key, k, kk, keys_of, margin)
    count = jnp.sum(keys_of(all_values()) >= lo, dtype=jnp.int32)
    zero = jnp.zeros_like(count)  # device-varying like the branches inside shard_map (lax.cond types agree)

    def candidates():
        pos = compact_by_primitive(keys_of(all_values()) >= lo, cap)[0]
        ck = jnp.where(jnp.arange(cap, dtype=jnp.int32) < count, keys_of(gather(pos)), -1)
        return top_by_primitive(ck, kk, kmax, positions=pos) + zero, jnp.int32(PATH_SAMPLED) + zero

    def everything():
        return top_by_primitive(keys_of(all_values()), kk, kmax) + zero, jnp.int32(PATH_PRIMITIVE) + zero

    return lax.cond((count >= kk) & (count <= cap), candidates, everything)


def top_indices(
    values, kmax: int, key, k=None, *, keys_of=_identity, margin: float = _MARGIN, primitive_max: int | None = None
):
    """Exact positions of the ``k`` largest keys ``keys_of(values)`` (ties: lowest index first).

    Args:
      values: ``(d,)`` array; ``keys_of(values)`` are the int32 order keys. A
        Python int ``d`` stands for the counters ``0..d-1`` (uint32), which are
        then generated inside each pass that reads them instead of stored (a
        selection by a hash of the position: random-k).
      kmax: static capacity of the result (``k`` if ``k`` is static).
      key: PRNG key for the threshold sample (the result does not depend on it).
      k: traced int32 count ``<= kmax`` (default ``kmax``).
      keys_of: *elementwise* map from values to int32 keys (identity for int32
        keys; :func:`magnitude_keys` for top-k by magnitude). Keys ``< 0`` are
        never selected (requires ``k <= #(keys >= 0)``). Being elementwise, it is
        fused into the passes that read it instead of materialising the keys.
      margin: the ``z`` of :func:`_sample_plan` (tests pass a negative value to
        force the exact fallback).
      primitive_max: lowered for CPU, vectors of ``SMALL < d <= primitive_max`` entries, of which at most
        ``CPU_PRIMITIVE_K_MAX`` are selected (``kmax``), are selected by :func:`top_by_float_view`
        (``PATH_PRIMITIVE``) instead of the sampled threshold; ``None``:
        ``CPU_PRIMITIVE_MAX`` (read when traced); tests pass 0 to run the sampled path at small sizes.
    Returns:
      ``(indices, path)``: int32 ``(kmax,)`` (slots ``>= k`` hold 0) and the
      branch taken (``PATH_SAMPLED``, ``PATH_TIES`` or ``PATH_FULL``). For
      ``d > 2048`` the first ``k`` indices are in increasing order on every
      path; a smaller vector's are in decreasing key order (a stable sort).

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
    branch returns the same indices in the same order. That is the body
    lowered for CPU; lowered for ``cuda``, ``rocm`` or ``tpu`` the selection
    is :func:`top_by_primitive` (``PATH_PRIMITIVE``) below
    ``ACCELERATOR_SAMPLED_MIN`` keys and :func:`top_by_threshold` (the same
    sample, ``lax.top_k`` among the candidates: ``PATH_SAMPLED``, else over all
    keys: ``PATH_PRIMITIVE``) from there on, the same indices in the same order.
    """
    idx, path, _ = _top_indices(values, kmax, key, k, keys_of, margin, None, primitive_max=primitive_max)
    return idx, path


def reuse_capacity(kmax: int, d: int, margin: float = _MARGIN) -> int:
    """Static candidate capacity ``C_r`` of :func:`top_indices_reusing` for ``kmax`` of ``d`` keys.

    ``C_r = min(C, kmax + max(64, ceil(REUSE_SLACK · kmax)))`` with ``C`` the sampled
    path's capacity (:func:`_sample_plan`); 0 where :func:`top_indices` does not
    sample (``d <= 2048``, ``kmax >= d`` or no plan), i.e. where nothing is carried.
    """
    if kmax == 0 or d <= SMALL or kmax >= d:
        return 0
    plan = _sample_plan(d, kmax, margin)
    if plan is None:
        return 0
    return int(min(plan[2], kmax + max(64, math.ceil(REUSE_SLACK * kmax))))


REUSE_SLACK = 0.5
"""Candidates beyond ``k`` the carried threshold may admit, as a fraction of ``k`` (:func:`reuse_capacity`)."""


NO_GUESS = -1
"""The carried threshold of :func:`top_indices_reusing` before the first step (or after a tie-bound one)."""


def reuse_state(kmax: int, d: int) -> Array:
    """The initial carried state of :func:`top_indices_reusing`: int32 ``[NO_GUESS, r*]`` with
    ``r* = (k + C_r) / 2`` the count aimed at (:func:`reuse_capacity`)."""
    return jnp.asarray([NO_GUESS, (kmax + reuse_capacity(kmax, d)) // 2], jnp.int32)


def top_indices_reusing(
    values, kmax: int, key, state, *, keys_of=_identity, margin: float = _MARGIN, primitive_max: int | None = None
):
    """:func:`top_indices` (static ``k = kmax``) with a threshold carried from the previous call.

    The candidates ``key >= guess`` are counted in one pass; if they number
    between ``k`` and the capacity ``C_r`` (:func:`reuse_capacity`) the exact
    top-``k`` is taken among them, which is exact for *any* such ``guess``: the
    ``k``-th largest key ``t`` is ``>= guess``, so every key ``> t`` and every
    tie at ``t`` is a candidate, compacted in index order, and the winners are
    chosen as :func:`top_indices` chooses them. Otherwise (no guess, or the
    count outside ``[k, C_r]``) :func:`top_indices`' sampled selection runs
    instead (``lax.cond``). The result -- indices and their order -- is
    identical to :func:`top_indices`'s for every input and every state.

    The next guess: with ``c`` keys ``>= lo`` (the threshold used this call) and
    the ``k``-th largest key ``t``, the key expected to admit ``a`` keys of this
    input is ``t − (t − lo) · ln(a/k) / ln(c/k)`` (rank exponential in the key,
    i.e. in the log-magnitude for :func:`magnitude_keys`; :data:`NO_GUESS` when
    ``c <= k``, after the tie branch or the whole-array fallback). The aim ``a``
    corrects for the drift between calls (an error-feedback memory grows the
    entries not sent): it starts at ``r* = (k + C_r) / 2`` and is multiplied by
    ``r* / c'`` whenever the carried guess admitted ``c'`` keys, within
    ``[k / 16, C_r]``.

    Lowered for ``cuda``, ``rocm`` or ``tpu`` nothing is reused: the selection is
    :func:`top_indices`' accelerator body (its path is returned) and the state is
    returned unchanged; likewise on CPU where :func:`top_by_float_view` serves (``d <= primitive_max``,
    ``kmax <= CPU_PRIMITIVE_K_MAX``).

    Args:
      values, kmax, key, keys_of, margin, primitive_max: as :func:`top_indices`.
      state: int32 ``(2,)``: the previous call's guess and aim (:func:`reuse_state` at first).
    Returns:
      ``(indices, path, new_state)``: int32 ``(kmax,)``; ``PATH_REUSED`` or the
      branch :func:`top_indices` took; the state for the next call.
    """
    d = values.shape[0]
    state = jnp.asarray(state, jnp.int32)
    cap_r = reuse_capacity(kmax, d, margin)
    if cap_r == 0 or _float_view_serves(d, kmax, primitive_max):  # no sampled path on CPU: nothing to carry
        idx, path = top_indices(values, kmax, key, keys_of=keys_of, margin=margin, primitive_max=primitive_max)
        return idx, path, state

    def accelerator():
        return *_top_accelerator(values, kmax, key, None, keys_of, margin), state

    return typed_platform_dependent(
        cpu=lambda: _top_reusing_cpu(values, kmax, key, state, keys_of, margin, cap_r, primitive_max),
        accelerator=accelerator,
        like=(values, key, state, keys_of(values[:1])),  # the last: what keys_of closes over
    )


def _top_reusing_cpu(values, kmax: int, key, state, keys_of, margin: float, cap_r: int, primitive_max: int | None):
    """:func:`top_indices_reusing` lowered for CPU (see there)."""
    guess, aim = state[0], state[1]
    kk = jnp.int32(kmax)
    words = pack_bits(keys_of(values) >= guess, 1, jnp.uint32)
    count = jnp.sum(popcount(words), dtype=jnp.int32)  # int32 with x64 too (cond branches agree)
    star = (kmax + cap_r) // 2
    corrected = jnp.round(aim.astype(jnp.float32) * star / jnp.maximum(count, 1).astype(jnp.float32))
    aim = jnp.where(guess >= 0, jnp.clip(corrected, max(1, kmax // 16), cap_r).astype(jnp.int32), aim)
    # As on the sampled path, the compaction runs outside the lax.cond (a branch runs it slower on XLA:CPU).
    slots = jnp.arange(cap_r, dtype=jnp.int32)
    pos, _ = _compact_words_cpu(words, cap_r)
    ck = jnp.where(slots < count, keys_of(values[pos]), -1)
    zero = jnp.zeros_like(count)

    def reused():
        idx, t = _exact_top(ck, pos, kk, kmax)
        return idx, jnp.int32(PATH_REUSED) + zero, _next_guess(guess, t, count, kmax, aim) + zero

    def sampled():
        idx, path, nxt = _top_indices(
            values, kmax, key, None, keys_of, margin, aim, by_platform=False, primitive_max=primitive_max
        )
        return idx + zero, path + zero, nxt + zero

    ok = (guess >= 0) & (count >= kk) & (count <= cap_r)
    idx, path, nxt = lax.cond(ok, reused, sampled)
    return idx, path, jnp.stack([nxt, aim + zero])


def _next_guess(lo, t, count, k: int, aim) -> Array:
    """The key expected to admit ``aim`` keys (see :func:`top_indices_reusing`); int32 scalar."""
    span = (t - lo).astype(jnp.float32)
    have = jnp.log(jnp.maximum(count, 1).astype(jnp.float32) / k)
    want = jnp.log(jnp.maximum(aim, 1).astype(jnp.float32) / k)
    step = span * want / jnp.where(have > 0, have, 1.0)
    room = jnp.float32(_NAN_KEY) - t.astype(jnp.float32)  # how far above t a guess may go
    g = t - jnp.clip(step, -room, t.astype(jnp.float32)).astype(jnp.int32)
    return jnp.where((count > k) & (lo >= 0), jnp.clip(g, 0, _NAN_KEY), jnp.int32(NO_GUESS))


def _top_accelerator(values, kmax: int, key, k, keys_of, margin: float):
    """:func:`top_indices` lowered for ``cuda``, ``rocm`` or ``tpu``: :func:`top_by_threshold` from
    ``ACCELERATOR_SAMPLED_MIN`` keys up, else :func:`top_by_primitive`; ``(indices, path)``."""
    d, all_values, _ = _readers(values)
    if d >= ACCELERATOR_SAMPLED_MIN:
        return top_by_threshold(values, kmax, key, k, keys_of=keys_of, margin=margin)
    kk = jnp.int32(kmax) if k is None else jnp.asarray(k, jnp.int32)
    return top_by_primitive(keys_of(all_values()), kk, kmax), jnp.int32(PATH_PRIMITIVE)


def _top_indices(
    values,
    kmax: int,
    key,
    k,
    keys_of,
    margin: float,
    target,
    by_platform: bool = True,
    primitive_max: int | None = None,
):
    """:func:`top_indices`, plus the next guess of :func:`top_indices_reusing` when ``target`` is given
    (:data:`NO_GUESS` otherwise); ``by_platform=False``: the CPU body whatever the platform (for a
    caller that already chose it)."""
    d, all_values, gather = _readers(values)
    kk = jnp.int32(kmax) if k is None else jnp.asarray(k, jnp.int32)
    no_guess = jnp.int32(NO_GUESS)
    if kmax == 0 or d == 0:
        return jnp.zeros((kmax,), jnp.int32), jnp.int32(PATH_FULL), no_guess
    if k is None and kmax >= d:
        return jnp.arange(d, dtype=jnp.int32), jnp.int32(PATH_FULL), no_guess
    if d <= SMALL:
        return _sorted_top(keys_of(all_values()), kk, kmax), jnp.int32(PATH_FULL), no_guess

    def accelerator():
        return *_top_accelerator(values, kmax, key, k, keys_of, margin), no_guess

    def cpu():
        if _float_view_serves(d, kmax, primitive_max):
            return top_by_float_view(keys_of(all_values()), kk, kmax), jnp.int32(PATH_PRIMITIVE), no_guess
        return _top_sampled(all_values, gather, d, kmax, key, k, kk, keys_of, margin, target)

    if not by_platform:
        return cpu()
    # The last entry of like: one key, which varies over whatever keys_of closes over (random-k's hash words).
    like = (key, kk, keys_of(gather(jnp.zeros((1,), jnp.int32))))
    return typed_platform_dependent(cpu=cpu, accelerator=accelerator, like=like)


def _top_sampled(all_values, gather, d: int, kmax: int, key, k, kk, keys_of, margin: float, target):
    """:func:`_top_indices` lowered for CPU: the sampled threshold and its fallbacks (see :func:`top_indices`)."""
    no_guess = jnp.int32(NO_GUESS)

    def full():
        return _exact_top(keys_of(all_values()), jnp.arange(d, dtype=jnp.int32), kk, kmax)[0]

    plan = _sample_plan(d, kmax, margin)
    if plan is None:
        return full(), jnp.int32(PATH_FULL), no_guess
    s, jmax, cap = plan
    lo = _sampled_threshold(gather, d, s, jmax, key, k, kk, keys_of, margin)
    words = pack_bits(keys_of(all_values()) >= lo, 1, jnp.uint32)
    count = jnp.sum(popcount(words), dtype=jnp.int32)  # int32 with x64 too (cond branches agree)
    # The common case runs outside any lax.cond: compacting the first C candidates and the
    # exact selection among them cost a few small passes, while the same work inside a
    # conditional branch measured twice as slow on XLA:CPU (11.4 ms against 5.1 ms for a
    # 2.4 M-entry tensor). Only the rare fallbacks are branches.
    slots = jnp.arange(cap, dtype=jnp.int32)
    pos, _ = _compact_words_cpu(words, cap)
    ck = jnp.where(slots < count, keys_of(gather(pos)), -1)
    # A zero of the input's own type: constants built from it are device-varying inside
    # shard_map like the branches computed from ``values``, so the lax.cond branches agree.
    zero = jnp.zeros_like(count)
    none = no_guess + zero

    def sampled():
        idx, t = _exact_top(ck, pos, kk, kmax)
        nxt = none if target is None else _next_guess(lo, t, count, kmax, target) + zero
        return idx, jnp.int32(PATH_SAMPLED) + zero, nxt

    def ties():
        # One compaction of [keys > lo, keys == lo]: all n_gt <= C strict candidates, then the
        # first 2C - n_gt ties (>= C >= k), both in index order.
        allkeys = keys_of(all_values())
        tpos, _ = _compact_cpu(jnp.concatenate([allkeys > lo, allkeys == lo]), 2 * cap)
        tpos = jnp.where(tpos >= d, tpos - d, tpos)
        valid = jnp.arange(2 * cap, dtype=jnp.int32) < count
        tk = jnp.where(valid, keys_of(gather(tpos)), -1)
        idx = _exact_top(tk, tpos, kk, kmax)[0]
        # The winners come strict ones first, then ties: sort them into index order, as the other paths give.
        first = jnp.arange(kmax, dtype=jnp.int32) < kk
        idx = jnp.sort(jnp.where(first, idx, jnp.iinfo(jnp.int32).max))
        return jnp.where(first, idx, 0), jnp.int32(PATH_TIES) + zero, none

    def exact():
        return full() + zero, jnp.int32(PATH_FULL) + zero, none

    def not_sampled():
        n_gt = jnp.sum(keys_of(all_values()) > lo, dtype=jnp.int32)
        return lax.cond((count >= kk) & (n_gt <= cap), ties, exact)

    return lax.cond((count >= kk) & (count <= cap), sampled, not_sampled)
