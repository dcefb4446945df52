"""Dettmers' 8-bit dynamic tree quantization (Dettmers 2015; GRACE Sec. III-A)."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np

from ._base import Compressor, payload_dataclass, register
from ._primitives import flat32, restore
from ._quantize import _ScaledCodesPayload, big_scale_factor, jitted_compressor, max_abs, nan_unless_finite

Array = jax.Array


def _eightbit_magnitudes() -> np.ndarray:
    """The 128 magnitudes of the dynamic tree type, float64, strictly increasing.

    Magnitude code ``m`` (7 bits): ``m = 0`` is 0; otherwise let ``k =
    floor(log2 m)`` (the bits after the leading one: the linear fraction width)
    and ``e = 6 - k`` (the number of leading zeros: the base-10 exponent), ``F =
    m - 2^k``. Then ``|v| = 10^-e (0.1 + 0.9 (F + 1/2) / 2^k)``: the midpoints of
    ``2^k`` equal cells of ``[0.1, 1] 10^-e`` (bitsandbytes' ``create_dynamic_map``).
    """
    mags = np.zeros(128, np.float64)
    for m in range(1, 128):
        k = m.bit_length() - 1
        e = 6 - k
        frac = m - (1 << k)
        mags[m] = 10.0 ** (-e) * (0.1 + 0.9 * (frac + 0.5) / (1 << k))
    return mags


def eightbit_codebook() -> np.ndarray:
    """The 256-entry codebook of :func:`eightbit` (float32, indexed by the code byte).

    Byte ``b = sign << 7 | m`` decodes to ``(-1)^sign * magnitude[m]`` (times the
    tensor's max-abs scale); see :func:`_eightbit_magnitudes`. Values lie in
    ``[-0.99297, 0.99297]``; ``0x80`` is a second zero.
    """
    mags = _eightbit_magnitudes()
    return np.concatenate([mags, -mags]).astype(np.float32)


@payload_dataclass
class EightBitPayload(_ScaledCodesPayload):
    """8-bit codes and the max-abs scale; wire bits ``8 d + 32``.

    Attributes:
      codes: uint8 ``(d,)``, byte ``sign << 7 | m`` (see :func:`eightbit_codebook`).
      scale: float32 scalar, ``max_i |x_i|``.
      shape, dtype: static.
    """

    code_bits = 8


@register("eightbit")
def eightbit(*, seed: int = 0) -> Compressor:
    """Dettmers' 8-bit dynamic tree quantization (GRACE Sec. III-A "8-bit quantization"; Dettmers 2015).

    ``y = x / max|x|`` is rounded to the nearest of the 256 codes of
    :func:`eightbit_codebook` (1 sign bit, a base-10 exponent given by the run of
    leading zeros, a linear fraction in the remaining bits); the receiver
    decodes ``codebook[code] * max|x|``. Deterministic and biased. Error:
    ``|x - x_hat| <= (g/2) max|x|`` with ``g`` the gap between the two codes
    around ``y`` (at most ``0.9/64 / 2 = 0.0070`` of the scale); values below
    ``2.75e-7`` of the scale round to 0.

    The nearest code is computed arithmetically (6 threshold comparisons for the
    exponent, then the fraction cell), not by a search over the table: one pass.

    Wire bits: ``8 d + 32``. Non-finite input (a NaN or Inf entry): the whole
    tensor decodes to NaN. Scales up to the float32 maximum are exact (``1/M``
    is formed at ``2^-8`` scale there, :func:`~._quantize.big_scale_factor`).
    """
    mags = _eightbit_magnitudes()
    # Thresholds between the exponent groups: the midpoint between the lowest
    # code of group e (m = 2^(6-e)) and the highest of group e+1 (m = 2^(6-e) - 1).
    group_thresholds = [float(np.float32((mags[(1 << (6 - e)) - 1] + mags[1 << (6 - e)]) / 2)) for e in range(6)]
    zero_threshold = float(np.float32(mags[1] / 2))
    # Group e's codes are the midpoints of 2^k equal cells (k = 6 - e) of
    # [0.1, 1] 10^-e; the cell of y is floor(y * slope_e - offset_e), offset by
    # first_e = 2^k (the group's first code) and clipped to [2^k, 2^(k+1) - 1].
    first = [float(1 << (6 - e)) for e in range(7)]
    slope = [float(np.float32((1 << (6 - e)) / (0.9 * 10.0 ** (-e)))) for e in range(7)]
    offset = [float(np.float32(0.1 * (1 << (6 - e)) / 0.9 - (1 << (6 - e)))) for e in range(7)]
    codebook = eightbit_codebook()

    def compress(x, key, state):
        del key
        xf = flat32(x)
        scale = max_abs(xf)
        # With a non-finite scale y may be NaN; its code is then whatever XLA's
        # float -> uint8 conversion gives (0 on CPU), and it decodes to NaN anyway.
        # 1 / M is subnormal (read as 0 by XLA:CPU) for M > 2^126: scale both by 2^-8 there (exact).
        pre = big_scale_factor(scale)
        y = (jnp.abs(xf) * pre) * (1.0 / jnp.where(scale > 0, scale * pre, 1.0))
        sl, off, lo = jnp.float32(slope[0]), jnp.float32(offset[0]), jnp.float32(first[0])
        for e, t in enumerate(group_thresholds, start=1):
            below = y < t
            sl = jnp.where(below, slope[e], sl)
            off = jnp.where(below, offset[e], off)
            lo = jnp.where(below, first[e], lo)
        m = jnp.clip(jnp.floor(y * sl - off), lo, 2.0 * lo - 1.0)
        m = jnp.where(y < zero_threshold, 0.0, m).astype(jnp.uint8)
        codes = m | (jnp.signbit(xf).astype(jnp.uint8) << 7)
        return EightBitPayload(codes=codes, scale=scale, shape=x.shape, dtype=x.dtype), state

    def decompress(p: EightBitPayload):
        y = jnp.asarray(codebook)[p.codes] * p.scale
        return restore(nan_unless_finite(y, p.scale), p.shape, p.dtype)

    # Nearest of 256 codes times max|x|: |x_i − Q(x)_i| ≤ min(|x_i|, g/2 · max|x|), g/2 ≤ 0.9/128.
    # Relative form: exponent group e (y = |x_i|/max|x| in [0.1, 1]·10^-e) has 2^(6-e) cells, half gap
    # 0.9·10^-e/2^(7-e), at most 0.5625 y for e <= 3 (y >= 1e-4); below 1e-4 the error is <= 1.125e-5 max|x|.
    c2, rel2, small2 = (0.9 / 128.0) ** 2, 0.5625**2, 1.125e-5**2
    return jitted_compressor(
        "eightbit",
        compress,
        decompress,
        unbiased=False,
        seed=seed,
        params={},
        stochastic=False,
        contraction=lambda d: max(1.0 - min(c2 * d, rel2 + small2 * d), 0.0) or float("nan"),
        bound=(
            "Dettmers 2015's codebook: |x_i − Q(x)_i| ≤ (0.9/128) max|x| per entry, and ≤ 0.5625 |x_i| where "
            "|x_i| >= 1e-4 max|x| (≤ 1.125e-5 max|x| below), so ‖Q(x) − x‖² ≤ min(d (0.9/128)², 0.5625² + "
            "d (1.125e-5)²) ‖x‖² and δ = 1 − that minimum (positive for d < 5.4e9)"
        ),
    )
