"""Hybrid compressors: sparsification combined with quantisation (GRACE Sec. III-C).

* ``adaptive``: Dryden et al. 2016's adaptive-threshold ternary code (GRACE's
  "Adaptive"): the largest positive and the largest negative entries, each set
  reconstructed as its mean.
* ``qsparse``: Qsparse-local-SGD's compressor (Basu et al. 2019): top-k, then
  QSGD on the kept values.
"""

from __future__ import annotations

import math
from typing import Any, ClassVar

import jax
import jax.numpy as jnp
import numpy as np

from .._bitcount import BitCount
from .._validate import check_int, check_ratio
from ._base import Compressor, Payload, payload_dataclass, register, static_field
from ._bounds import ratio_of
from ._kernels.bitpack import pack, unpack
from ._kernels.scatter import scatter_count
from ._kernels.select import magnitude_keys, top_indices
from ._primitives import dequantize, index_dtype, quantize
from ._quantize import mean_of
from ._sparse import num_selected, sparse_compressor, sparse_hooks
from ._topk import topk_indices

Array = jax.Array

__all__ = ["adaptive", "qsparse", "AdaptivePayload", "QSparsePayload", "adaptive_counts"]


# --------------------------------------------------------------------------- #
# Adaptive threshold (Dryden et al. 2016)
# --------------------------------------------------------------------------- #
@payload_dataclass
class AdaptivePayload(Payload):
    """Ternary sparse payload: positions of kept positives then negatives, one mean per sign.

    Attributes:
      indices: ``(cap,)`` flat positions (:func:`index_dtype`): slots
        ``[0, counts[0])`` are positive entries, ``[counts[0], counts[0] +
        counts[1])`` negative ones, the rest 0.
      counts: int32 ``(2,)``: number of positive and negative positions sent.
      means: float32 ``(2,)``: mean of the kept positive values (>= 0) and of
        the kept negative values (<= 0); 0 for an empty side.
      shape, dtype: original shape and dtype (static, not sent).

    Wire bits: ``(counts[0] + counts[1]) * bits(index dtype) + 2*32 + 2*32`` (a traced :class:`~jaxcomm.BitCount`).
    ``indices`` is a counted field (its valid slots: ``counts[0] + counts[1]``):
    the pipeline's all-gather sends only those.
    """

    indices: Array
    counts: Array
    means: Array
    shape: tuple = static_field()
    dtype: Any = static_field()
    counted: ClassVar[tuple[tuple[str, str], ...]] = (("indices", "counts"),)

    def wire_bits(self):
        ib = jnp.dtype(self.indices.dtype).itemsize * 8
        return BitCount.product(self.counts[0] + self.counts[1], ib) + 128


def adaptive_counts(x, ratio: float):
    """``(k_pos, k_neg)``: how many positive / negative entries :func:`adaptive` keeps.

    ``k_s = clip(floor(ratio * n_s + 1/2), 1, n_s)`` (0 if ``n_s = 0``), with
    ``n_s`` the number of entries of sign ``s`` (NaN and zeros have no sign),
    computed in float32. Traced int32 scalars.
    """
    xf = jnp.ravel(x).astype(jnp.float32)
    out = []
    for m in (xf > 0, xf < 0):
        n = jnp.sum(m, dtype=jnp.int32)
        k = jnp.floor(jnp.float32(ratio) * n.astype(jnp.float32) + jnp.float32(0.5)).astype(jnp.int32)
        out.append(jnp.where(n > 0, jnp.clip(k, 1, n), 0))
    return out[0], out[1]


@register("adaptive")
def adaptive(*, ratio: float, seed: int = 0) -> Compressor:
    """Adaptive-threshold ternary sparsification (Dryden et al. 2016; GRACE Table I "Adaptive threshold").

    Long because a compressor factory's closures share the validated hyper-parameters; each inner function is short.

    The gradient is split into its positive and negative parts; for each part
    the threshold ``tau_+`` (``tau_-``) is chosen so that a fraction ``ratio``
    of that part's entries is kept: the ``k_+ = round(ratio * n_+)`` largest
    positive and the ``k_- = round(ratio * n_-)`` most negative entries
    (:func:`adaptive_counts`; ties at a threshold go to the lowest index), so
    about ``ratio * d`` entries in all. Kept entries are reconstructed as the
    mean of their part (GRACE Sec. IV-C: "we only send the mean and the selected
    indices of each part"):

        Q(x)_i = mean_+  if i kept positive,   mean_-  if i kept negative,   0 otherwise.

    Dryden et al. estimate the thresholds from a sample and GRACE iterates to
    match the ratio; here they are exact (the same selection as :func:`topk`,
    run on each sign), which is the estimator those approximate.

    NaN entries have no sign: never kept (they decode to 0); ``+-Inf`` are the
    largest of their sign, so a kept ``+Inf`` makes ``mean_+ = +Inf``. The means
    are computed without overflow (:func:`~._quantize.mean_of`).

    Payload :class:`AdaptivePayload` (capacity ``min(d, k + 2)`` positions,
    ``k = max(1, round(ratio d))``); wire bits ``(k_+ + k_-) bits(index) + 128``.
    Biased, deterministic; strategy ``"allgather"``.

    Args:
      ratio: fraction of each sign's entries kept, in (0, 1].
    """
    ratio = check_ratio(ratio, "ratio")

    def compress(x, key, state):
        d = int(np.size(x))
        shape = tuple(np.shape(x))
        kcap = num_selected(ratio, d)
        cap = min(d, kcap + 2)
        idt = index_dtype(max(d, 1))
        if d == 0:
            return AdaptivePayload(
                jnp.zeros((0,), idt), jnp.zeros((2,), jnp.int32), jnp.zeros((2,), jnp.float32), shape, x.dtype
            ), state
        xf = jnp.ravel(x).astype(jnp.float32)
        k_pos, k_neg = adaptive_counts(xf, ratio)
        slots = jnp.arange(kcap, dtype=jnp.int32)
        sides = []
        for i, (sign, k) in enumerate(((1.0, k_pos), (-1.0, k_neg))):

            def keys_of(v, sign=sign):  # magnitude keys of this sign's entries, -1 elsewhere
                return jnp.where(sign * v > 0, magnitude_keys(v), -1)

            idx, _ = top_indices(xf, kcap, jax.random.fold_in(key, i), k=k, keys_of=keys_of)
            vals = jnp.where(slots < k, xf[idx], 0.0)
            mean = jnp.where(k > 0, mean_of(vals, jnp.maximum(k, 1).astype(jnp.float32)), 0.0)  # no overflow
            sides.append((idx, mean))
        (idx_pos, mean_pos), (idx_neg, mean_neg) = sides
        j = jnp.arange(cap, dtype=jnp.int32)
        from_pos = idx_pos[jnp.clip(j, 0, kcap - 1)]
        from_neg = idx_neg[jnp.clip(j - k_pos, 0, kcap - 1)]
        merged = jnp.where(j < k_pos, from_pos, jnp.where(j < k_pos + k_neg, from_neg, 0))
        payload = AdaptivePayload(
            indices=merged.astype(idt),
            counts=jnp.stack([k_pos, k_neg]),
            means=jnp.stack([mean_pos, mean_neg]).astype(jnp.float32),
            shape=shape,
            dtype=x.dtype,
        )
        return payload, state

    def decompress(p: AdaptivePayload):
        cap = p.indices.shape[0]
        j = jnp.arange(cap, dtype=jnp.int32)
        c0, c1 = p.counts[0], p.counts[1]
        vals = jnp.where(j < c0, p.means[0], jnp.where(j < c0 + c1, p.means[1], 0.0))
        return scatter_count(vals, p.indices, c0 + c1, p.shape, p.dtype, unique=True)

    return sparse_compressor(
        "adaptive",
        compress,
        dict(decompress_fn=decompress),
        seed=seed,
        params=dict(ratio=ratio),
        stochastic=False,
        contraction=lambda d: 1.0 / (d * num_selected(ratio, d)),
        bound=(
            "each sign's k_s kept entries decode to their mean (a projection), removing (Σ kept)²/k_s ≥ "
            "max² / k_s of ‖x‖² where max is that sign's largest magnitude; the larger of the two is ≥ ‖x‖²/d "
            "and k_s ≤ k = round(ratio d), so δ = 1/(d k) (weak: the worst case is one large entry among small "
            "ones of the same sign)"
        ),
    )


# --------------------------------------------------------------------------- #
# Qsparse (top-k + QSGD)
# --------------------------------------------------------------------------- #
def _level_width(levels: int) -> int:
    """Packed bits per QSGD level in ``[0, levels]``: 1, 2, 4 or 8; 0 means unpacked (levels >= 256)."""
    for w in (1, 2, 4, 8):
        if levels < (1 << w):
            return w
    return 0


@payload_dataclass
class QSparsePayload(Payload):
    """Top-k positions with QSGD-quantised values.

    Attributes:
      indices: ``(k,)`` flat positions (:func:`index_dtype` of ``d``).
      levels: the QSGD levels ``xi_i`` in ``[0, s]``: packed ``level_bits`` bits
        each into uint8 (``ceil(k * level_bits / 8)`` bytes), or unpacked
        (uint16/int32) when ``s >= 256``.
      signs: uint8, ``ceil(k/8)`` bytes of packed sign bits (1 = negative).
      norm: float32 scalar, ``||v||_2`` of the kept values ``v``.
      shape, dtype: original shape and dtype; num_levels ``s``; level_bits (static).

    Wire bits: every array at its width: ``k bits(index) + 8 ceil(k w / 8) + 8 ceil(k/8) + 32``.
    """

    indices: Array
    levels: Array
    signs: Array
    norm: Array
    shape: tuple = static_field()
    dtype: Any = static_field()
    num_levels: int = static_field()
    level_bits: int = static_field()


@register("qsparse")
def qsparse(*, ratio: float, levels: int, seed: int = 0) -> Compressor:
    """Qsparse-local-SGD's compressor (Basu et al. 2019; GRACE Table I): top-k, then QSGD on the kept values.

    ``Q(x) = QSGD_s(top_k(x))``: the ``k = max(1, round(ratio d))`` largest
    magnitudes (:func:`topk`'s exact selection) are quantised with QSGD's
    stochastic rounding (Alistarh et al. 2017, Eq. (1); :func:`quantize`):
    ``Q(v)_i = ||v||_2 sign(v_i) xi_i / s`` with ``E[xi_i] = s |v_i| / ||v||_2``.
    Hence ``E[Q(x)] = top_k(x)``: biased (top-k), unbiased given the support.

    NaN counts as the largest magnitude (as in :func:`topk`); a kept NaN or Inf
    makes ``||v||`` non-finite and every kept entry decodes to NaN. The norm is
    computed without overflow (:func:`~._quantize.l2_norm`): finite values
    decode to finite ones while ``||v||`` is below the float32 maximum, and
    beyond a float16 tensor's range they saturate at 65504. Payload
    :class:`QSparsePayload`; wire bits ``k (bits(index) + w + 1) + 32`` up to
    byte padding, ``w`` the packed level width. Strategy ``"allgather"``.

    Args:
      ratio: fraction of entries kept, in (0, 1].
      levels: QSGD's ``s >= 1`` (number of positive levels).
    """
    ratio = check_ratio(ratio, "ratio")
    levels = check_int(levels, "levels", minimum=1, why="it fixes the number of quantization levels")
    width = _level_width(levels)

    def compress(x, key, state):
        d = int(np.size(x))
        k = num_selected(ratio, d)
        idx = topk_indices(x, k, key)
        vals = jnp.ravel(x)[idx].astype(jnp.float32)
        level, sign, norm = quantize(vals, levels, jax.random.fold_in(key, 1))
        packed_levels = pack(level, width) if width else level
        payload = QSparsePayload(
            indices=idx.astype(index_dtype(max(d, 1))),
            levels=packed_levels,
            signs=pack(sign, 1),
            norm=norm.astype(jnp.float32),
            shape=tuple(np.shape(x)),
            dtype=x.dtype,
            num_levels=levels,
            level_bits=width,
        )
        return payload, state

    def values(p: QSparsePayload):
        """The ``k`` dequantized float32 values of one payload."""
        k = p.indices.shape[-1]
        level = unpack(p.levels, p.level_bits, k) if p.level_bits else p.levels
        sign = unpack(p.signs, 1, k).astype(bool)
        return dequantize(level, sign, p.norm, p.num_levels, jnp.float32)

    return sparse_compressor(
        "qsparse",
        compress,
        sparse_hooks(values),
        seed=seed,
        params=dict(ratio=ratio, levels=levels),
        stochastic=True,
        **_qsparse_bound(ratio, levels),
    )


def _qsparse_bound(ratio: float, s: int) -> dict:
    """Qsparse's declared bound: a contraction ``δ(d)`` and a data-dependent ``δ(x)``, and their source."""

    def omega_k(d):
        k = num_selected(ratio, d)
        return min(k / s**2, math.sqrt(k) / s)

    def delta(d):
        return (1.0 - omega_k(d)) * num_selected(ratio, d) / d if omega_k(d) < 1.0 else float("nan")

    def local(x):
        d = x.size
        top = jnp.sort(jnp.square(jnp.ravel(x).astype(jnp.float32)))[d - num_selected(ratio, d) :]
        return (1.0 - omega_k(d)) * ratio_of(x, jnp.sum(top))

    return dict(
        contraction=delta,
        local_contraction=local,
        bound=(
            "QSGD_s on top_k (Basu et al. 2019): E‖Q(x) − x‖² ≤ ‖x‖² − (1 − ω_k) ‖top_k(x)‖² with "
            "ω_k = min(k/s², √k/s) (Alistarh et al. 2017, Lemma 3.1), so δ(x) = (1 − ω_k) ‖top_k(x)‖²/‖x‖² "
            "(negative where ω_k > 1: QSGD's variance may then expand x); with ‖top_k(x)‖² ≥ (k/d) ‖x‖², "
            "δ = (1 − ω_k) k/d where ω_k < 1"
        ),
    )
