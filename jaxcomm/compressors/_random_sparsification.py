"""Random sparsification (DoubleSqueeze, Tang et al. 2019; Wangni et al. 2018): keep ``x_i / p`` w.p. ``p``."""

from __future__ import annotations

import math

import jax.numpy as jnp
import numpy as np

from .._validate import check_ratio
from ._base import Compressor, register
from ._kernels.bitpack import pack
from ._kernels.compact import compact
from ._kernels.random_bits import uniform_bits
from ._primitives import bits_of, index_dtype, packed_size
from ._sparse import CountSparsePayload, MaskSparsePayload, _decompress_count, _decompress_mask, _sparse_payload


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
    vb = bits_of(dtype)
    ib = bits_of(index_dtype(d))
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
    ordinary values (NaN/p = NaN); a finite ``x_i / p`` beyond the dtype's range
    saturates at its largest finite value. ``p = 1`` is exact for subnormals
    too; with ``p < 1`` the multiplication by ``1/p`` flushes subnormal values
    to 0 on XLA:CPU. Strategy ``"allgather"``.

    Args:
      p: keep probability in (0, 1].
    """
    p = check_ratio(p, "p", "it fixes the buffer capacity, an array shape")
    t, p_exact = _keep_threshold(p)
    scale = 1.0 / p_exact if p < 1.0 else 1.0

    def compress(x, key, state):
        d = int(np.size(x))
        shape = tuple(np.shape(x))
        encoding, cap = random_sparsification_plan(p, d, x.dtype)
        if p < 1.0:
            keep = uniform_bits(key, d, "murmur3") < jnp.uint32(t)
        else:
            keep = jnp.ones((d,), bool)
        pos, total = compact(keep, cap)
        count = jnp.minimum(total, cap)
        vals, idx = _sparse_payload(x, pos, count)
        if encoding == "mask":
            mask = pack(keep, 1)
            return MaskSparsePayload(
                mask=mask, values=vals, count=count, shape=shape, dtype=x.dtype, scale=scale
            ), state
        return CountSparsePayload(values=vals, indices=idx, count=count, shape=shape, dtype=x.dtype, scale=scale), state

    def decompress(payload):
        if isinstance(payload, MaskSparsePayload):
            return _decompress_mask(payload)
        return _decompress_count(payload)

    return Compressor(
        name="random_sparsification",
        compress_fn=compress,
        decompress_fn=decompress,
        unbiased=True,
        strategy="allgather",
        seed=seed,
        params=dict(p=p),
        stochastic=True,
        variance_factor=1.0 / _keep_threshold(p)[1] - 1.0,
        bound="Wangni et al. 2018: keep x_i/p with probability p gives E‖Q(x) − x‖² = (1/p − 1) ‖x‖², ω = 1/p − 1 "
        "(p the exact keep probability)",
    )
