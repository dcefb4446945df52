"""Threshold sparsifiers: Threshold-v (Dutta et al. 2020) and DGC's sampled threshold (Lin et al. 2018).

Both send a variable number of entries in a fixed-capacity buffer plus a
count (:class:`~._sparse.CountSparsePayload`), so shapes stay static under ``jit``.
"""

from __future__ import annotations

import math
from typing import NamedTuple

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax

from .._validate import check_finite_scalar, check_int, check_ratio
from ._base import Compressor, register
from ._bounds import absolute
from ._kernels.bitpack import pack_bits, popcount
from ._kernels.compact import SMALL, compact, compact_words
from ._kernels.random_bits import uniform_indices
from ._kernels.select import top_indices
from ._primitives import flat32
from ._sparse import CountSparsePayload, _sparse_payload, count_sparse_hooks, sparse_compressor

Array = jax.Array


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
      v: threshold, finite and ``>= 0`` (``v = 0`` sends everything); may be traced
        (``optax.inject_hyperparams``), then computed in float32 and unchecked.
      max_ratio: buffer capacity as a fraction of ``d``, in (0, 1].
    """
    v = check_finite_scalar(v, "v", nonnegative=True, traceable=True)
    max_ratio = check_ratio(max_ratio, "max_ratio", "it fixes the buffer capacity, an array shape")

    def compress(x, key, state):
        del key
        d = int(np.size(x))
        cap = _capacity(max_ratio, d)
        xf = flat32(x)
        mask = (jnp.abs(xf) >= v) | jnp.isnan(xf)
        pos, total = compact(mask, cap)
        count = jnp.minimum(total, cap)
        vals, idx = _sparse_payload(x, pos, count)
        return CountSparsePayload(values=vals, indices=idx, count=count, shape=tuple(np.shape(x)), dtype=x.dtype), state

    why = "entries with |x_i| ≥ v are sent exactly, the others dropped: non-expansive, δ = 0"
    if isinstance(v, jax.core.Tracer) or max_ratio < 1.0:
        bound = dict(bound=why + " (no absolute bound: a traced v, or a buffer that can drop entries ≥ v)")
    else:
        bound = dict(
            bound=why + "; with every qualifying entry sent (max_ratio = 1), |x_i − Q(x)_i| ≤ min(|x_i|, v), so "
            "δ(x) = 1 − Σ min(x_i², v²)/‖x‖²",
            local_contraction=absolute(float(v)),
        )
    return _count_sparse("threshold", compress, seed, dict(v=v, max_ratio=max_ratio), stochastic=False, **bound)


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
    xf = flat32(x)
    return jnp.where(jnp.isnan(xf), jnp.inf, jnp.abs(xf))


_LOOP_CONSTANT = "it is a constant of DGC's compiled adaptation loop"


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

    Long because a compressor factory's closures share the validated hyper-parameters; each inner function is
    short. ``compress`` follows the authors' code step by step.

    With ``k = ceil(d * ratio)`` (``num_selects``): sample ``num_samples``
    magnitudes uniformly (:func:`dgc_plan`), take the threshold ``thr`` = the
    smallest of the sample's ``ceil(num_samples * ratio)`` largest, select
    ``|x| >= thr``; then (only when the tensor was sampled, ``d > num_samples``)
    adapt for at most ``max_adaptation_iters`` rounds: if more than
    ``upper_bound * k`` are selected, *resample*: take the exact top-k among the
    selected (which is the exact top-k of ``x``) and stop; if between ``k`` and
    ``upper_bound * k``, stop; if fewer than ``lower_bound * k``, lower the
    threshold ``thr <- lower_bound * thr`` and select again. Finally keep the
    first ``k`` selected in index order (``indices[:num_selects]``). Where
    ``k = d`` (``ratio = 1``, or a tensor so small that ``ceil(d * ratio) = d``)
    every entry is sent, without sampling: the sampled threshold could only drop
    entries the buffer has room for, so ``dgc(ratio=1)`` is exact.

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
    ratio = check_ratio(ratio, "ratio", "it fixes the buffer capacity k, an array shape")
    sample_ratio = check_ratio(sample_ratio, "sample_ratio", "it fixes the number of samples, an array shape")
    upper_bound = check_finite_scalar(upper_bound, "upper_bound", why=_LOOP_CONSTANT)
    if upper_bound <= 1.0:
        raise ValueError(f"upper_bound must be > 1; got {upper_bound}")
    lower_bound = check_finite_scalar(lower_bound, "lower_bound", why=_LOOP_CONSTANT)
    if not 0.0 < lower_bound < 1.0:
        raise ValueError(f"lower_bound must be in (0, 1); got {lower_bound}")
    max_adaptation_iters = check_int(
        max_adaptation_iters, "max_adaptation_iters", minimum=0, why="it bounds the adaptation loop, a Python branch"
    )

    def compress(x, key, state):
        d = int(np.size(x))
        shape = tuple(np.shape(x))
        plan = dgc_plan(d, ratio, sample_ratio)
        k = plan.num_selects
        if d == 0:
            z = jnp.zeros((0,), x.dtype)
            return CountSparsePayload(z, z.astype(jnp.uint8), jnp.int32(0), shape, x.dtype), state
        if k >= d:  # the buffer holds every entry: a sampled threshold could only drop some
            vals, idx = _sparse_payload(x, jnp.arange(d, dtype=jnp.int32))
            return CountSparsePayload(values=vals, indices=idx, count=jnp.int32(d), shape=shape, dtype=x.dtype), state
        # The importance |x| (NaN -> +Inf) is elementwise: it is recomputed from x inside each
        # pass that reads it (sample gather, selection, exact top-k) rather than stored as a
        # d-entry array that the adaptation loop and the top-k branch would carry.
        flat = jnp.ravel(x)
        sample = _dgc_importance(flat[dgc_sample_indices(key, d, plan.num_samples)])
        # min over all top-k values (not [-1]): a one-element slice makes XLA rewrite top_k into a full sort.
        thr = jnp.min(lax.top_k(sample, plan.top_k_samples)[0])
        # The selection mask lives bit-packed: its popcount is the count, its compaction the indices
        # (small tensors keep the plain mask, compacted by a sort).
        packed = d > SMALL

        def select(t):
            m = _dgc_importance(flat) >= t
            if packed:
                w = pack_bits(m, 1, jnp.uint32)
                return w, jnp.sum(popcount(w), dtype=jnp.int32)  # int32 with x64 too
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
            idx, _ = top_indices(
                flat,
                k,
                jax.random.fold_in(key, 1),
                keys_of=lambda v: lax.bitcast_convert_type(_dgc_importance(v), jnp.int32),
            )
            return idx, jnp.int32(k) + jnp.zeros_like(count)

        def first_k():
            pos, total = compact_words(words, k) if packed else compact(words, k)
            return pos, jnp.minimum(total, k)

        if adapt:
            idx, n = lax.cond(resample, exact_topk, first_k)
        else:  # the whole tensor was "sampled": no adaptation, hence no resampling
            idx, n = first_k()
        vals, idx = _sparse_payload(x, idx, n)
        return CountSparsePayload(values=vals, indices=idx, count=n, shape=shape, dtype=x.dtype), state

    return _count_sparse(
        "dgc",
        compress,
        seed,
        dict(
            ratio=ratio,
            sample_ratio=sample_ratio,
            upper_bound=upper_bound,
            lower_bound=lower_bound,
            max_adaptation_iters=max_adaptation_iters,
        ),
        stochastic=True,
        bound="sends entries x_i exactly at or above a sampled threshold (a mask: non-expansive, δ = 0), the first "
        "k of them in index order when between k and upper_bound·k qualify, so the largest entry can be missed "
        "(no uniform δ > 0)",
    )


def _count_sparse(name: str, compress, seed: int, params: dict, **facts) -> Compressor:
    """A biased all-gather compressor whose payload is a :class:`CountSparsePayload` (a fixed-capacity
    buffer and its count), with that payload's decoder, gathered sum and in-place error. It sends
    entries exactly or drops them, so it is non-expansive (``contraction=0``); ``facts``: the rest of
    its declared bound (``bound=``, the source; ``local_contraction=``) and its randomness."""
    return sparse_compressor(name, compress, count_sparse_hooks(), seed=seed, params=params, contraction=0.0, **facts)
