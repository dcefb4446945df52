"""Unbiased stochastic quantizers: QSGD, natural compression, TernGrad, DoubleSqueeze's stochastic rounding.

Each rounds ``x_i`` up or down at random with the probability that makes the
expectation exact, drawing its uniforms from
:func:`~._kernels.random_bits.uniform_floats` / ``uniform_bits`` (scheme
``"lowbias32"``); wire formats and non-finite policy: :mod:`._quantize`.
"""

from __future__ import annotations

import math
from typing import Any

import jax
import jax.numpy as jnp

from .._validate import check_int
from ._base import Compressor, Payload, payload_dataclass, register, static_field
from ._kernels.bitpack import code_width, pack, pack_codes, packed_code_bits, unpack, unpack_codes
from ._kernels.random_bits import uniform_bits, uniform_floats
from ._primitives import flat32, packed_size, restore, size_of
from ._quantize import _ScaledCodesPayload, big_scale_factor, jitted_compressor, l2_norm, max_abs, nan_unless_finite

Array = jax.Array


_MAX_LEVELS = 1 << 16


@payload_dataclass
class QSGDPayload(Payload):
    """QSGD codes and norm.

    Attributes:
      codes: fields of :func:`pack_codes` holding ``c_i = s + sign_i * l_i`` in
        ``[0, 2s]`` (``l_i`` the level, ``sign_i = -1`` for negative entries), width
        ``ceil(log2(2s+1))`` bits.
      norm: float32 scalar ``||x||_2``.
      levels: s (static); shape, dtype: static.
    """

    codes: tuple
    norm: Array
    levels: int = static_field()
    shape: tuple = static_field()
    dtype: Any = static_field()

    def wire_bits(self) -> int:
        """``pw(d, ceil(log2(2s+1))) + 32``."""
        return packed_code_bits(size_of(self.shape), code_width(2 * self.levels + 1)) + 32


def _unbiased_quantizer(name: str, compress, decompress, seed: int, params: dict, **bound) -> Compressor:
    """A random, unbiased quantizer (``bound``: its declared variance factor and the source)."""
    return jitted_compressor(
        name, compress, decompress, unbiased=True, seed=seed, params=params, stochastic=True, **bound
    )


@register("qsgd")
def qsgd(*, levels: int = 64, seed: int = 0) -> Compressor:
    """QSGD stochastic quantization with ``s = levels`` levels (Alistarh et al. 2017; GRACE Sec. III-A).

    ``Q(x)_i = ||x||_2 sign(x_i) xi_i / s`` with ``xi_i = l + Bernoulli(s|x_i|/||x|| - l)``,
    ``l = floor(s|x_i|/||x||)``: unbiased, and (Lemma 3.1)
    ``E||Q(x) - x||^2 <= min(d/s^2, sqrt(d)/s) ||x||^2``.

    Encoding (exact): sign and level share one code ``c = s + sign * level`` in
    ``[0, 2s]``, ``ceil(log2(2s+1))`` bits per entry (never more than the
    ``1 + ceil(log2(s+1))`` of a separate sign bit; for s = 64, 8 bits instead of
    9), bit-packed by :func:`pack_codes`, plus the 32-bit norm. Decoding computes
    :func:`~jaxcomm.compressors.dequantize`'s numbers as ``(c - s) * (norm / s)``. The level arithmetic is that of
    :func:`~jaxcomm.compressors.quantize` with hash uniforms (see module doc).

    Args:
      levels: s, an integer in ``[1, 65536]``.
    Wire bits: ``pw(d, ceil(log2(2s+1))) + 32``. Non-finite input, or a norm
    beyond the float32 range (``~3.4e38``): all NaN. The norm is computed without
    overflow or underflow (:func:`~._quantize.l2_norm`), so huge finite entries
    (``~1e20``) quantize as well as unit ones; decoded values beyond a float16
    tensor's range saturate at 65504.
    """
    levels = check_int(levels, "levels", why="it fixes the number of quantization levels and the code width")
    if levels > _MAX_LEVELS:
        raise ValueError(f"levels must be <= {_MAX_LEVELS}; got {levels}")
    width = code_width(2 * levels + 1)

    def compress(x, key, state):
        xf = flat32(x)
        norm = l2_norm(xf)  # no overflow of the squares for huge entries, nor underflow for tiny ones
        safe = jnp.where(norm > 0, norm, 1.0)
        scaled = jnp.clip(jnp.abs(xf) * (levels / safe), 0.0, float(levels))
        scaled = jnp.where(jnp.isfinite(scaled), scaled, 0.0)
        low = jnp.floor(scaled)
        level = low + (uniform_floats(key, xf.size) < scaled - low).astype(low.dtype)
        code = jnp.where(xf < 0, levels - level, levels + level).astype(jnp.int32)
        payload = QSGDPayload(codes=pack_codes(code, width), norm=norm, levels=levels, shape=x.shape, dtype=x.dtype)
        return payload, state

    def decompress(p: QSGDPayload):
        # sign * level * (norm / s) as one signed convert and one multiply per entry: the same
        # numbers as dequantize(|c|, c < 0, ...) (negation is exact; 0 * scale keeps its sign), and
        # a non-finite norm turns the scale, hence every entry, into NaN (the documented policy).
        # Decoding runs n times per step under allgather, so its per-entry work matters.
        code = unpack_codes(p.codes, width, size_of(p.shape)) - p.levels
        scale = jnp.where(jnp.isfinite(p.norm), p.norm / p.levels, jnp.nan)
        return restore(code.astype(jnp.float32) * scale, p.shape, p.dtype)

    return _unbiased_quantizer(
        "qsgd",
        compress,
        decompress,
        seed,
        dict(levels=levels),
        variance_factor=lambda d: min(d / levels**2, math.sqrt(d) / levels),
        bound="Alistarh et al. 2017, Lemma 3.1: ω = min(d/s², √d/s) with s levels",
    )


@payload_dataclass
class NaturalPayload(Payload):
    """Sign bits and float32 exponent fields.

    Attributes:
      signs: uint8 ``(ceil(d/8),)``, packed IEEE sign bits.
      exponents: uint8 ``(d,)``, biased float32 exponent of the rounded power of two.
      shape, dtype: static.
    """

    signs: Array
    exponents: Array
    shape: tuple = static_field()
    dtype: Any = static_field()

    def wire_bits(self) -> int:
        """``8 ceil(d/8) + 8 d`` (9 bits per entry plus the sign padding)."""
        d = size_of(self.shape)
        return 8 * packed_size(d, 1) + 8 * d


@register("natural")
def natural(*, seed: int = 0) -> Compressor:
    """Natural compression: unbiased stochastic rounding to a power of two (Horvath et al. 2019; GRACE Sec. III-A).

    For ``t != 0`` with ``2^a <= |t| < 2^(a+1)``: ``C(t) = sign(t) 2^a`` with
    probability ``(2^(a+1) - |t|)/2^a`` and ``sign(t) 2^(a+1)`` otherwise, so
    ``E C(t) = t``. On the float32 bits this is: keep sign and exponent, drop
    the 23 mantissa bits ``M``, add one to the exponent with probability
    ``M / 2^23`` (exact: a 23-bit uniform integer ``r < M``). The same rule maps
    subnormals unbiasedly to ``0`` or ``2^-126``, and zero to zero.

    Wire: the sign bit (packed) and the 8-bit exponent field: ``8 ceil(d/8) +
    8 d`` bits. Non-finite input: the exponent field 255 decodes to +-Inf, so Inf
    is exact and NaN decodes to +-Inf (its sign bit); finite values of at least
    ``2^127`` may round up to Inf (``2^128``); for a float16 or bfloat16 tensor a
    round-up past its range saturates at its largest finite value.
    """

    def compress(x, key, state):
        xf = flat32(x)
        u = jax.lax.bitcast_convert_type(xf, jnp.uint32)
        exponent = (u >> 23) & jnp.uint32(0xFF)
        mantissa = u & jnp.uint32(0x7FFFFF)
        r = uniform_bits(key, xf.size, "lowbias32") >> 9
        up = (r < mantissa) & (exponent < 255)
        payload = NaturalPayload(
            signs=pack(u >> 31, 1),
            exponents=(exponent + up.astype(exponent.dtype)).astype(jnp.uint8),
            shape=x.shape,
            dtype=x.dtype,
        )
        return payload, state

    def decompress(p: NaturalPayload):
        sign = unpack(p.signs, 1, size_of(p.shape)).astype(jnp.uint32)
        bits = (sign << 31) | (p.exponents.astype(jnp.uint32) << 23)
        return restore(jax.lax.bitcast_convert_type(bits, jnp.float32), p.shape, p.dtype)

    return _unbiased_quantizer(
        "natural",
        compress,
        decompress,
        seed,
        {},
        variance_factor=1.0 / 8.0,
        bound="Horváth et al. 2019 (natural compression), Theorem 1: ω = 1/8",
    )


@payload_dataclass
class TernaryPayload(_ScaledCodesPayload):
    """2-bit ternary codes and the max-abs scale; wire bits ``8 ceil(d/4) + 32``.

    Attributes:
      codes: uint8 ``(ceil(d/4),)``, packed 2-bit codes (0: 0, 1: +1, 2: -1).
      scale: float32 scalar ``s = max_i |x_i|``.
      shape, dtype: static.
    """

    code_bits = 2


@register("terngrad")
def terngrad(*, seed: int = 0) -> Compressor:
    """TernGrad: unbiased ternary quantization (Wen et al. 2017; GRACE Sec. III-A).

    ``s = max|x|``, ``b_i ~ Bernoulli(|x_i| / s)``, ``Q(x)_i = s sign(x_i) b_i`` in
    ``{-s, 0, s}``; ``E Q(x) = x``. (Wen et al.'s optional gradient clipping
    and per-layer scalar sharing are not part of the operator.)

    Wire bits: ``8 ceil(d/4) + 32``. Non-finite input (a NaN or Inf entry): all NaN.
    """

    def compress(x, key, state):
        xf = flat32(x)
        a = jnp.abs(xf)
        scale = max_abs(xf)
        # b_i = [u_i < |x_i| / s], evaluated as u_i s < |x_i| (no division);
        # false for NaN, and for s = 0.
        keep = uniform_floats(key, xf.size) * scale < a
        code = keep.astype(jnp.uint8) << jnp.signbit(xf).astype(jnp.uint8)  # 1 -> +1, 2 -> -1
        return TernaryPayload(codes=pack(code, 2), scale=scale, shape=x.shape, dtype=x.dtype), state

    def decompress(p: TernaryPayload):
        code = unpack(p.codes, 2, size_of(p.shape)).astype(jnp.int32)
        t = ((code & 1) - (code >> 1)).astype(jnp.float32)  # 0 -> 0, 1 -> +1, 2 -> -1
        return restore(t * nan_unless_finite(p.scale, p.scale), p.shape, p.dtype)

    return _unbiased_quantizer(
        "terngrad",
        compress,
        decompress,
        seed,
        {},
        variance_factor=lambda d: math.sqrt(d) - 1.0,
        bound="Wen et al. 2017: E‖Q(x) − x‖² = ‖x‖₁‖x‖∞ − ‖x‖² ≤ (√d − 1) ‖x‖², ω = √d − 1",
    )


@payload_dataclass
class GridPayload(Payload):
    """Indices on a uniform grid over ``[-scale, scale]``.

    Attributes:
      codes: fields of :func:`pack_codes`, grid index ``k`` in ``[0, 2^bits)``.
      scale: float32 scalar ``M = max_i |x_i|``.
      bits: static; shape, dtype: static.
    """

    codes: tuple
    scale: Array
    bits: int = static_field()
    shape: tuple = static_field()
    dtype: Any = static_field()

    def wire_bits(self) -> int:
        """``pw(d, bits) + 32``."""
        return packed_code_bits(size_of(self.shape), self.bits) + 32


@register("stochastic_rounding")
def stochastic_rounding(*, bits: int = 4, seed: int = 0) -> Compressor:
    """DoubleSqueeze's stochastic quantization to a uniform ``bits``-bit grid.

    Grid: ``g_k = -M + k D``, ``k = 0..L-1``, ``L = 2^bits``, ``D = 2M/(L-1)``,
    ``M = max|x|``. Following the DoubleSqueeze notes (compressor choices): ``z`` in
    ``[a, b] = [g_k, g_(k+1)]`` goes to ``a`` with probability ``(b - z)/(b - a)``
    and to ``b`` with probability ``(z - a)/(b - a)``, so ``E Q(z) = z``
    (unbiased up to float32 rounding and the ``2^-23`` resolution of the
    uniforms). The grid's ends are ``+-M``, so ``|Q(x)_i| <= M``.

    Args:
      bits: grid index width, an integer in ``[1, 16]``.
    Wire bits: ``pw(d, bits) + 32``. Non-finite input (a NaN or Inf entry): all
    NaN. Scales up to the float32 maximum are exact (``x + M`` is formed at
    ``2^-8`` scale there, :func:`~._quantize.big_scale_factor`).
    """
    bits = check_int(bits, "bits", why="it fixes the number of levels and the code width")
    if bits > 16:
        raise ValueError(f"bits must be in [1, 16]; got {bits}")
    top = float((1 << bits) - 1)  # L - 1

    def compress(x, key, state):
        xf = flat32(x)
        scale = max_abs(xf)
        # y = (x + M) (L - 1) / (2M); for M near the float32 maximum both x and M are first
        # scaled by 2^-8 (exact), so x + M cannot overflow (the same y otherwise).
        pre = big_scale_factor(scale)
        y = (xf * pre + scale * pre) * (top / (2.0 * jnp.where(scale > 0, scale * pre, 1.0)))
        y = jnp.clip(jnp.where(jnp.isfinite(y), y, 0.0), 0.0, top)
        low = jnp.floor(y)
        k = jnp.minimum(low + (uniform_floats(key, xf.size) < y - low).astype(low.dtype), top).astype(jnp.int32)
        return GridPayload(codes=pack_codes(k, bits), scale=scale, bits=bits, shape=x.shape, dtype=x.dtype), state

    def decompress(p: GridPayload):
        k = unpack_codes(p.codes, bits, size_of(p.shape)).astype(jnp.float32)
        y = p.scale * (k * (2.0 / top) - 1.0)
        return restore(nan_unless_finite(y, p.scale), p.shape, p.dtype)

    return _unbiased_quantizer(
        "stochastic_rounding",
        compress,
        decompress,
        seed,
        dict(bits=bits),
        variance_factor=lambda d: d / ((1 << bits) - 1) ** 2,
        bound=(
            "unbiased rounding to a grid of spacing D = 2M/(2^bits − 1), M = max|x|: per entry variance ≤ D²/4, "
            "so E‖Q(x) − x‖² ≤ d M²/(2^bits − 1)² ≤ d/(2^bits − 1)² ‖x‖², ω = d/(2^bits − 1)²"
        ),
    )
