"""Quantizers: fewer bits per entry, every entry sent (GRACE Sec. III-A, Table I).

Multi-bit and stochastic quantizers live here; the 1-bit family (1-bit SGD,
signSGD, SIGNUM, EF-signSGD) is in :mod:`._sign`. Every factory returns a
:class:`~jaxcomm.compressors.Compressor` whose payload is the exact wire format:

=======================  ==============================================  ==========================================
name                     payload (what is sent)                          wire bits for a d-entry tensor
=======================  ==============================================  ==========================================
``eightbit``             uint8 code per entry + max-abs scale            ``8 d + 32``
``qsgd(levels=s)``       signed level code, bit-exact width w + norm     ``pw(d, w) + 32``, ``w = ceil(log2(2s+1))``
``natural``              packed sign bits + uint8 exponent per entry     ``8 ceil(d/8) + 8 d``
``terngrad``             2-bit ternary codes + max-abs scale             ``8 ceil(d/4) + 32``
``inceptionn(eps)``      2-bit tags + 8/16/32-bit values by class        ``8 ceil(d/4) + 8 n8 + 16 n16 + 32 n32``
``sketchml(buckets=B)``  bucket index, width ceil(log2 B) + B means      ``pw(d, ceil(log2 B)) + 32 B``
``clipping(bits=b)``     sign, exponent and top b mantissa bits          ``pw(d, 9 + b)``
``stochastic_rounding``  grid index, width b + max-abs scale             ``pw(d, b) + 32``
=======================  ==============================================  ==========================================

``pw(d, w)`` is the size of ``d`` codes of ``w`` bits packed by
:func:`pack_codes`: the width is split into its binary digits (e.g.
``17 = 16 + 1``) and each digit's group of bits is packed densely (1, 2, 4
bits: ``8 / 2^j`` codes per byte) or stored as uint8/uint16/uint32,
so ``pw(d, w) = sum_{2^j in w} 8 ceil(d 2^j / 8)``; that is ``d w`` bits plus
at most 7 padding bits per bit plane group. No varint or entropy coding.

Speed. All are single passes over the tensor except ``sketchml`` (histogram
scatter) and ``inceptionn`` (prefix sums to compact each class). The stochastic
ones draw their uniforms from a counter-based integer hash keyed by the JAX key
(:func:`hash_uniform_bits`), because ``jax.random.uniform`` (threefry) costs
about 25 elementwise passes on CPU. ``compress``/``decompress`` are wrapped in
``jax.jit`` (one XLA program per shape and dtype when called eagerly; inlined
under an outer ``jit``).

Non-finite input. Methods with a tensor-wide scale (``eightbit``, ``qsgd``,
``terngrad``, ``stochastic_rounding``, ``sketchml``) decode the *whole* tensor
to NaN when the scale (or a bucket mean) is not finite: any NaN or Inf entry,
or a norm that overflows float32. Elementwise codes follow IEEE: see each
factory's docstring (``natural``: NaN and Inf decode to +-Inf; ``clipping``: Inf
exact, NaN kept NaN when its top kept mantissa bits are non-zero;
``inceptionn``: non-finite entries are sent raw, exactly).
"""

from __future__ import annotations

import math
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

from ._base import (
    Compressor,
    Payload,
    check_finite_scalar,
    check_positive_int,
    payload_dataclass,
    register,
    static_field,
)
from ._primitives import dequantize, pack, packed_size, unpack

__all__ = [
    "eightbit",
    "qsgd",
    "natural",
    "terngrad",
    "inceptionn",
    "sketchml",
    "clipping",
    "stochastic_rounding",
    "EightBitPayload",
    "QSGDPayload",
    "NaturalPayload",
    "TernaryPayload",
    "InceptionnPayload",
    "SketchPayload",
    "ClippedPayload",
    "GridPayload",
    "pack_codes",
    "unpack_codes",
    "packed_code_bits",
    "hash_uniform_bits",
    "eightbit_codebook",
    "sketch_buckets",
]

Array = jax.Array


# --------------------------------------------------------------------------- #
# Shared helpers
# --------------------------------------------------------------------------- #
def _flat32(x):
    """``x`` as a float32 vector (the compute dtype of every quantizer)."""
    return jnp.ravel(x).astype(jnp.float32)


def _restore(flat, shape, dtype):
    return flat.reshape(shape).astype(dtype)


def _size(shape) -> int:
    return int(np.prod(shape, dtype=np.int64))


def _max_abs(xf):
    """``max_i |x_i|`` (float32 scalar; NaN if any entry is NaN; 0 when empty)."""
    return jnp.max(jnp.abs(xf)) if xf.size else jnp.float32(0)


def _nan_unless_finite(y, scale):
    """``y`` where the scale is finite, NaN everywhere otherwise (documented policy)."""
    return jnp.where(jnp.isfinite(scale), y, jnp.nan)


def _materialize(a):
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


def _lowbias32(h):
    # Chris Wellons' "lowbias32" integer hash (a bijection of uint32 with
    # near-ideal avalanche): xorshift-multiply rounds.
    h = h ^ (h >> 16)
    h = h * jnp.uint32(0x7FEB352D)
    h = h ^ (h >> 15)
    h = h * jnp.uint32(0x846CA68B)
    return h ^ (h >> 16)


def hash_uniform_bits(key, n: int) -> Array:
    """``n`` pseudo-random uint32 words from a counter-based hash keyed by ``key``.

    Two seed words ``s0, s1`` are drawn with ``jax.random.bits(key, (2,))`` (so
    every JAX key, raw ``uint32[2]`` or typed, gives its own stream), and word
    ``i`` is ``lowbias32((i * 0x9E3779B9 + s0) XOR s1)``. The hash is a bijection,
    so the ``n`` inputs of one key are distinct; across keys the inputs are
    independent random words. This is a statistical generator for stochastic
    rounding, about 30x cheaper than threefry on CPU; it is not for
    cryptography. Works under ``jit``/``vmap``.

    Args:
      key: a JAX PRNG key.
      n: number of words (static).
    Returns:
      uint32 array of shape ``(n,)``.
    """
    seeds = jax.random.bits(key, (2,), jnp.uint32)
    counter = jnp.arange(n, dtype=jnp.uint32) * jnp.uint32(0x9E3779B9)
    return _lowbias32((counter + seeds[0]) ^ seeds[1])


def _uniform(key, n: int) -> Array:
    """Uniforms on the grid ``k 2^-23``, ``k = 0..2^23-1`` (float32, exact), shape ``(n,)``.

    Built like ``jax.random.uniform``: the top 23 hash bits become the mantissa
    of a float in ``[1, 2)``, minus 1 (no int-to-float conversion). ``P(u < f)
    = ceil(f 2^23) / 2^23``, so stochastic rounding with these is unbiased up to
    ``2^-23`` of one quantization step, as with ``jax.random.uniform``.
    """
    bits = (hash_uniform_bits(key, n) >> 9) | jnp.uint32(0x3F800000)
    return jax.lax.bitcast_convert_type(bits, jnp.float32) - 1.0


def _width_fields(width: int) -> tuple[int, ...]:
    """Binary digits of ``width`` (1 <= width <= 32) as field widths, low bits first."""
    return tuple(w for w in (1, 2, 4, 8, 16, 32) if width & w)


_RAW = {8: jnp.uint8, 16: jnp.uint16, 32: jnp.uint32}


def _planar_pack(codes, w: int):
    """Pack uint8 codes of ``w`` in {1, 2, 4} bits, plane-major: with ``m = 8 // w``
    and ``B = ceil(n / m)`` bytes, code ``i`` sits in byte ``i mod B`` at bit
    ``w (i div B)``. Same size as :func:`~jaxcomm.compressors.pack`; the
    contiguous planes make packing and unpacking vectorize (``unpack``'s
    interleaved 4-bit layout costs ~2x more to decode on CPU)."""
    m = 8 // w
    n = codes.shape[0]
    planes = -(-n // m)
    if planes * m != n:
        codes = jnp.pad(codes, (0, planes * m - n))
    out = codes[:planes]
    for j in range(1, m):
        out = out | (codes[j * planes:(j + 1) * planes] << (j * w))
    return out


def _planar_unpack(packed, w: int, n: int):
    """Inverse of :func:`_planar_pack`: ``n`` uint8 codes."""
    m, mask = 8 // w, (1 << w) - 1
    return jnp.concatenate([(packed >> (j * w)) & mask for j in range(m)])[:n]


def pack_codes(codes: Array, width: int) -> tuple[Array, ...]:
    """Pack unsigned codes of ``width`` bits (1..32) bit-exactly into byte-aligned fields.

    ``width`` is split into its binary digits ``2^j`` (low bits first, e.g.
    ``17 -> (1, 16)``); field ``j`` holds bits ``[o_j, o_j + 2^j)`` of every
    code: for 1, 2 and 4 bits packed densely into ``ceil(n 2^j / 8)`` bytes
    (plane-major: code ``i`` in byte ``i mod B`` at bit ``2^j (i div B)``, ``B``
    the field's byte count), for 8, 16 and 32 bits stored as uint8/uint16/uint32.

    Args:
      codes: integer array, values in ``[0, 2**width)``; flattened.
      width: bits per code (static).
    Returns:
      tuple of 1-D unsigned arrays; their total size is
      :func:`packed_code_bits` ``(codes.size, width)`` bits.
    """
    if not 1 <= width <= 32:
        raise ValueError(f"width must be in [1, 32]; got {width}")
    codes = jnp.ravel(codes)
    # Narrow integer types keep the conversions cheap (XLA:CPU converts
    # float <-> uint32 slowly); int32 -> uint32 is a reinterpretation.
    work = jnp.uint8 if width <= 8 else jnp.uint32
    if codes.dtype != work:
        codes = codes.astype(work)
    fields, offset = [], 0
    for w in _width_fields(width):
        part = codes >> offset if offset else codes
        if w in _RAW:
            fields.append(part if part.dtype == _RAW[w] else part.astype(_RAW[w]))  # keeps the low w bits
        else:
            fields.append(_planar_pack(jnp.bitwise_and(part, (1 << w) - 1).astype(jnp.uint8), w))
        offset += w
    return tuple(fields)


def unpack_codes(fields, width: int, n: int) -> Array:
    """Inverse of :func:`pack_codes`: the ``n`` codes, shape ``(n,)``.

    dtype: int32 for ``width <= 31`` (cheap to convert to float), uint32 for 32.
    """
    out_dtype = jnp.int32 if width <= 31 else jnp.uint32
    out, offset = None, 0
    for f, w in zip(fields, _width_fields(width)):
        part = (f if w in _RAW else _planar_unpack(f, w, n)).astype(out_dtype)
        part = part << offset if offset else part
        out = part if out is None else out | part
        offset += w
    return out


def packed_code_bits(n: int, width: int) -> int:
    """Exact bits of :func:`pack_codes` output for ``n`` codes: ``sum_j 8 ceil(n 2^j / 8)``."""
    return sum(8 * packed_size(n, w) for w in _width_fields(width))


def _code_width(num_values: int) -> int:
    """Bits needed for ``num_values`` distinct codes: ``ceil(log2(num_values))`` (>= 1)."""
    return max(1, (num_values - 1).bit_length())


# --------------------------------------------------------------------------- #
# 8-bit dynamic tree quantization (Dettmers 2015)
# --------------------------------------------------------------------------- #
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
class EightBitPayload(Payload):
    """8-bit codes and the max-abs scale.

    Attributes:
      codes: uint8 ``(d,)``, byte ``sign << 7 | m`` (see :func:`eightbit_codebook`).
      scale: float32 scalar, ``max_i |x_i|``.
      shape, dtype: static.
    """

    codes: Array
    scale: Array
    shape: tuple = static_field()
    dtype: Any = static_field()

    def wire_bits(self) -> int:
        """``8 d + 32``."""
        return 8 * _size(self.shape) + 32


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

    Wire bits: ``8 d + 32``. Non-finite input: the whole tensor decodes to NaN.
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
        xf = _flat32(x)
        scale = _max_abs(xf)
        # With a non-finite scale y may be NaN; its code is then whatever XLA's
        # float -> uint8 conversion gives (0 on CPU), and it decodes to NaN anyway.
        y = jnp.abs(xf) * (1.0 / jnp.where(scale > 0, scale, 1.0))
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
        return _restore(_nan_unless_finite(y, p.scale), p.shape, p.dtype)

    return Compressor.create(
        name="eightbit", compress=jax.jit(compress), decompress=jax.jit(decompress), unbiased=False,
        strategy="allgather", seed=seed, params={},
    )


# --------------------------------------------------------------------------- #
# QSGD (Alistarh et al. 2017)
# --------------------------------------------------------------------------- #
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
        return packed_code_bits(_size(self.shape), _code_width(2 * self.levels + 1)) + 32


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
    Wire bits: ``pw(d, ceil(log2(2s+1))) + 32``. Non-finite input: all NaN.
    """
    levels = check_positive_int(levels, "levels")
    if levels > _MAX_LEVELS:
        raise ValueError(f"levels must be <= {_MAX_LEVELS}; got {levels}")
    width = _code_width(2 * levels + 1)

    def compress(x, key, state):
        xf = _flat32(x)
        norm = jnp.sqrt(jnp.sum(xf * xf))
        safe = jnp.where(norm > 0, norm, 1.0)
        scaled = jnp.clip(jnp.abs(xf) * (levels / safe), 0.0, float(levels))
        scaled = jnp.where(jnp.isfinite(scaled), scaled, 0.0)
        low = jnp.floor(scaled)
        level = low + (_uniform(key, xf.size) < scaled - low)
        code = jnp.where(xf < 0, levels - level, levels + level).astype(jnp.int32)
        payload = QSGDPayload(codes=pack_codes(code, width), norm=norm, levels=levels, shape=x.shape, dtype=x.dtype)
        return payload, state

    def decompress(p: QSGDPayload):
        # sign * level * (norm / s) as one signed convert and one multiply per entry: the same
        # numbers as dequantize(|c|, c < 0, ...) (negation is exact; 0 * scale keeps its sign), and
        # a non-finite norm turns the scale, hence every entry, into NaN (the documented policy).
        # Decoding runs n times per step under allgather, so its per-entry work matters.
        code = unpack_codes(p.codes, width, _size(p.shape)) - p.levels
        scale = jnp.where(jnp.isfinite(p.norm), p.norm / p.levels, jnp.nan)
        return _restore(code.astype(jnp.float32) * scale, p.shape, p.dtype)

    return Compressor.create(
        name="qsgd", compress=jax.jit(compress), decompress=jax.jit(decompress), unbiased=True,
        strategy="allgather", seed=seed, params=dict(levels=levels),
    )


# --------------------------------------------------------------------------- #
# Natural compression (Horvath et al. 2019)
# --------------------------------------------------------------------------- #
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
        d = _size(self.shape)
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
    ``2^127`` may round up to Inf.
    """

    def compress(x, key, state):
        xf = _flat32(x)
        u = jax.lax.bitcast_convert_type(xf, jnp.uint32)
        exponent = (u >> 23) & jnp.uint32(0xFF)
        mantissa = u & jnp.uint32(0x7FFFFF)
        r = hash_uniform_bits(key, xf.size) >> 9
        up = (r < mantissa) & (exponent < 255)
        payload = NaturalPayload(
            signs=pack(u >> 31, 1), exponents=(exponent + up).astype(jnp.uint8), shape=x.shape, dtype=x.dtype
        )
        return payload, state

    def decompress(p: NaturalPayload):
        sign = unpack(p.signs, 1, _size(p.shape)).astype(jnp.uint32)
        bits = (sign << 31) | (p.exponents.astype(jnp.uint32) << 23)
        return _restore(jax.lax.bitcast_convert_type(bits, jnp.float32), p.shape, p.dtype)

    return Compressor.create(
        name="natural", compress=jax.jit(compress), decompress=jax.jit(decompress), unbiased=True,
        strategy="allgather", seed=seed, params={},
    )


# --------------------------------------------------------------------------- #
# TernGrad (Wen et al. 2017)
# --------------------------------------------------------------------------- #
@payload_dataclass
class TernaryPayload(Payload):
    """2-bit ternary codes and the max-abs scale.

    Attributes:
      codes: uint8 ``(ceil(d/4),)``, packed 2-bit codes (0: 0, 1: +1, 2: -1).
      scale: float32 scalar ``s = max_i |x_i|``.
      shape, dtype: static.
    """

    codes: Array
    scale: Array
    shape: tuple = static_field()
    dtype: Any = static_field()

    def wire_bits(self) -> int:
        """``8 ceil(d/4) + 32``."""
        return 8 * packed_size(_size(self.shape), 2) + 32


@register("terngrad")
def terngrad(*, seed: int = 0) -> Compressor:
    """TernGrad: unbiased ternary quantization (Wen et al. 2017; GRACE Sec. III-A).

    ``s = max|x|``, ``b_i ~ Bernoulli(|x_i| / s)``, ``Q(x)_i = s sign(x_i) b_i`` in
    ``{-s, 0, s}``; ``E Q(x) = x``. (Wen et al.'s optional gradient clipping
    and per-layer scalar sharing are not part of the operator.)

    Wire bits: ``8 ceil(d/4) + 32``. Non-finite input: all NaN.
    """

    def compress(x, key, state):
        xf = _flat32(x)
        a = jnp.abs(xf)
        scale = _max_abs(xf)
        # b_i = [u_i < |x_i| / s], evaluated as u_i s < |x_i| (no division);
        # false for NaN, and for s = 0.
        keep = _uniform(key, xf.size) * scale < a
        code = keep.astype(jnp.uint8) << jnp.signbit(xf).astype(jnp.uint8)  # 1 -> +1, 2 -> -1
        return TernaryPayload(codes=pack(code, 2), scale=scale, shape=x.shape, dtype=x.dtype), state

    def decompress(p: TernaryPayload):
        code = unpack(p.codes, 2, _size(p.shape)).astype(jnp.int32)
        t = ((code & 1) - (code >> 1)).astype(jnp.float32)  # 0 -> 0, 1 -> +1, 2 -> -1
        return _restore(t * _nan_unless_finite(p.scale, p.scale), p.shape, p.dtype)

    return Compressor.create(
        name="terngrad", compress=jax.jit(compress), decompress=jax.jit(decompress), unbiased=True,
        strategy="allgather", seed=seed, params={},
    )


# --------------------------------------------------------------------------- #
# INCEPTIONN (Li et al. 2018)
# --------------------------------------------------------------------------- #
@payload_dataclass
class InceptionnPayload(Payload):
    """Per-entry 2-bit class tags and one fixed-capacity buffer per class.

    Entry ``i`` of class ``c`` is the ``r``-th entry of that class in flat
    order; its value sits at position ``r`` of the class buffer. Only the first
    ``n_c`` slots of each buffer are sent; the receiver recovers the counts
    ``n_c`` from the tags.

    Attributes:
      tags: uint8 ``(ceil(d/4),)``, packed 2-bit class per entry (0: dropped,
        1: 8-bit, 2: 16-bit, 3: raw 32-bit).
      q8: uint8 ``(d,)`` buffer, ``sign << 7 | q`` with ``1 <= q < 2^7``.
      q16: uint16 ``(d,)`` buffer, ``sign << 15 | q`` with ``2^7 <= q < 2^15``.
      raw: float32 ``(d,)`` buffer of entries sent as they are.
      quantum: delta, the fixed-point step (static, a power of two).
      shape, dtype: static.
    """

    tags: Array
    q8: Array
    q16: Array
    raw: Array
    quantum: float = static_field()
    shape: tuple = static_field()
    dtype: Any = static_field()

    def class_counts(self) -> Array:
        """``(n8, n16, n32)`` as int32 ``(3,)``, computed from the tags."""
        tags = unpack(self.tags, 2, _size(self.shape))
        return jnp.stack([jnp.sum(tags == c, dtype=jnp.int32) for c in (1, 2, 3)])

    def wire_bits(self) -> Array:
        """``8 ceil(d/4) + 8 n8 + 16 n16 + 32 n32`` (traced int32)."""
        n = self.class_counts()
        return jnp.int32(8 * packed_size(_size(self.shape), 2)) + 8 * n[0] + 16 * n[1] + 32 * n[2]


_RANK_BLOCK = 512  # < 2^10, so three in-block counters fit in one int32


def _class_ranks(tags):
    """Rank of each entry among the earlier entries of its own class (tags 1, 2, 3).

    ``rank_i = #{j < i : tag_j = tag_i}`` (int32, shape of ``tags``); 0 for
    entries of tag 0. One prefix sum serves the three
    classes: within blocks of 512 entries the three counters are packed into
    10-bit fields of one int32 (an XLA:CPU prefix sum costs ~10-20 elementwise
    passes, so this is 3x cheaper than three of them); block offsets are prefix
    sums over the ``d / 512`` block totals.
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
        offsets.append(_materialize(jnp.cumsum(row_total) - row_total)[:, None])  # else redone per entry
    offset = jnp.where(t == 1, offsets[0], jnp.where(t == 2, offsets[1], offsets[2]))
    return jnp.where(t == 0, 0, within + offset).reshape(-1)[:d]


@register("inceptionn")
def inceptionn(*, error_bound: float = 2.0**-10, seed: int = 0) -> Compressor:
    """INCEPTIONN error-bounded lossy compression of floats (Li et al. 2018; GRACE Sec. III-A).

    Each entry is put into one of four classes by its magnitude and sent with
    0, 8, 16 or 32 bits plus a 2-bit class tag. With ``delta = 2^floor(log2
    error_bound)`` (the largest power of two not above ``error_bound``) and
    ``q = floor(|x| / delta)`` (fixed-point truncation toward zero):

    * ``q = 0`` (``|x| < delta``): tag 0, nothing sent, decoded 0;
    * ``1 <= q < 2^7``: tag 1, one byte ``sign << 7 | q``;
    * ``2^7 <= q < 2^15``: tag 2, two bytes ``sign << 15 | q``;
    * larger, Inf or NaN: tag 3, the float32 as it is.

    Decoding is ``sign * q * delta`` (exact in float32), hence for every finite
    ``x``: ``|x - x_hat| < delta <= error_bound``, and ``|x_hat| <= |x|`` with
    the sign kept; tag-3 entries (and non-finite ones) are exact. This is the
    paper's value-range-based truncation (small values need few fixed-point
    bits under an absolute error bound). GRACE's implementation picks classes
    from the float exponent with ``log10`` where ``log2`` is meant, and its
    8-bit class keeps 6 fraction bits whatever the bound; we derive every class
    from ``delta`` so that the bound holds exactly.

    Entries of each class are compacted (prefix sums) into fixed-capacity
    buffers; :meth:`InceptionnPayload.wire_bits` counts only what is used:
    ``8 ceil(d/4) + 8 n8 + 16 n16 + 32 n32``.

    Args:
      error_bound: absolute error bound, finite, in ``[2^-126, 2^100]``.
    """
    error_bound = check_finite_scalar(error_bound, "error_bound", positive=True)
    if not 2.0**-126 <= error_bound <= 2.0**100:
        raise ValueError(f"error_bound must be in [2**-126, 2**100] (float32 fixed point); got {error_bound}")
    _, exp = math.frexp(error_bound)  # error_bound = f * 2^exp with 0.5 <= f < 1
    quantum = math.ldexp(1.0, exp - 1)  # 2^floor(log2 error_bound)
    inv_quantum = 1.0 / quantum

    def compress(x, key, state):
        del key
        xf = _flat32(x)
        d = xf.size
        q = jnp.floor(jnp.abs(xf) * inv_quantum)  # exact scaling by a power of two
        tag = jnp.where(q < 1, 0, jnp.where(q < 2.0**7, 1, jnp.where(q < 2.0**15, 2, 3)))
        tag = jnp.where(jnp.isfinite(xf), tag, 3).astype(jnp.uint8)
        qi = jnp.where(tag == 3, 0.0, q).astype(jnp.uint32)
        sign = jnp.signbit(xf).astype(jnp.uint32)
        # One scatter compacts all three classes into a 3d-word buffer: class c
        # (1..3) fills words [(c-1) d, c d) in order; tag 0 is dropped.
        word = jnp.where(
            tag == 3,
            jax.lax.bitcast_convert_type(xf, jnp.uint32),
            jnp.where(tag == 1, (sign << 7) | qi, (sign << 15) | qi),
        )
        slot = jnp.where(tag == 0, 3 * d, (tag.astype(jnp.int32) - 1) * d + _class_ranks(tag))
        buf = jnp.zeros((3 * d,), jnp.uint32).at[slot].set(word, mode="drop", unique_indices=True)
        payload = InceptionnPayload(
            tags=pack(tag, 2),
            q8=buf[:d].astype(jnp.uint8),
            q16=buf[d : 2 * d].astype(jnp.uint16),
            raw=jax.lax.bitcast_convert_type(buf[2 * d :], jnp.float32),
            quantum=quantum,
            shape=x.shape,
            dtype=x.dtype,
        )
        return payload, state

    def decompress(p: InceptionnPayload):
        d = _size(p.shape)
        tag = unpack(p.tags, 2, d)
        rank = _class_ranks(tag)
        c8 = p.q8[rank].astype(jnp.uint32)
        c16 = p.q16[rank].astype(jnp.uint32)
        v8 = (c8 & 0x7F).astype(jnp.float32) * p.quantum
        v8 = jnp.where(c8 >> 7 == 1, -v8, v8)
        v16 = (c16 & 0x7FFF).astype(jnp.float32) * p.quantum
        v16 = jnp.where(c16 >> 15 == 1, -v16, v16)
        v32 = p.raw[rank]
        y = jnp.where(tag == 1, v8, jnp.where(tag == 2, v16, jnp.where(tag == 3, v32, 0.0)))
        return _restore(y, p.shape, p.dtype)

    return Compressor.create(
        name="inceptionn", compress=jax.jit(compress), decompress=jax.jit(decompress), unbiased=False,
        strategy="allgather", seed=seed, params=dict(error_bound=error_bound),
    )


# --------------------------------------------------------------------------- #
# SketchML (Jiang et al. 2018), dense form as in GRACE
# --------------------------------------------------------------------------- #
_CELLS = 1 << 16  # histogram cells: the top 16 bits of the order-preserving float key


@payload_dataclass
class SketchPayload(Payload):
    """Bucket indices and bucket means.

    Attributes:
      codes: fields of :func:`pack_codes`, bucket index per entry,
        ``ceil(log2 B)`` bits.
      means: float32 ``(B,)``, mean of the entries in each bucket (0 if empty).
      shape, dtype: static.
    """

    codes: tuple
    means: Array
    shape: tuple = static_field()
    dtype: Any = static_field()

    def wire_bits(self) -> int:
        """``pw(d, ceil(log2 B)) + 32 B``."""
        buckets = self.means.shape[0]
        return packed_code_bits(_size(self.shape), _code_width(buckets)) + 32 * buckets


def _order_key(xf):
    """Order-preserving map float32 -> uint32 (negatives reversed below positives)."""
    u = jax.lax.bitcast_convert_type(xf, jnp.uint32)
    return jnp.where(u >> 31 == 1, ~u, u | jnp.uint32(0x80000000))


def sketch_buckets(xf, buckets: int):
    """SketchML's quantile buckets from a fixed-resolution histogram sketch.

    The sketch is a histogram over the ``2^16`` cells given by the top 16 bits
    of the order-preserving key of each float32 (sign, exponent and 7 mantissa
    bits: bfloat16 resolution, log-spaced, so heavy tails are resolved). A cell
    whose exclusive cumulative count is ``C`` goes to bucket
    ``min(floor(C B / d), B - 1)`` (float32 arithmetic): buckets are
    consecutive quantile ranges of ~``d/B`` entries, with boundaries on cell
    edges (a single cell is never split).

    Args:
      xf: float32 vector ``(d,)``.
      buckets: B (static).
    Returns:
      (bucket per entry int32 ``(d,)``, bucket per cell int32 ``(2^16,)``,
      entries per cell int32 ``(2^16,)``).
    """
    cell = (_order_key(xf) >> 16).astype(jnp.int32)
    counts = jax.ops.segment_sum(jnp.ones_like(cell), cell, _CELLS)
    before = jnp.cumsum(counts) - counts
    cell_bucket = jnp.floor(before.astype(jnp.float32) * (buckets / max(xf.size, 1)))
    cell_bucket = jnp.minimum(cell_bucket, buckets - 1).astype(jnp.int32)
    cell_bucket = _materialize(cell_bucket)  # else the prefix sum is redone per entry (3x slower)
    return cell_bucket[cell], cell_bucket, counts


@register("sketchml")
def sketchml(*, buckets: int = 64, seed: int = 0) -> Compressor:
    """SketchML quantile-bucket quantization, dense as in GRACE (Jiang et al. 2018; GRACE Sec. III-C).

    The entries are split into ``B = buckets`` quantile buckets by a histogram
    quantile sketch (:func:`sketch_buckets`); each entry sends its bucket index
    (``ceil(log2 B)`` bits, bit-packed) and the receiver decodes the mean of the
    entries of that bucket (``B`` float32 means sent once), which is the
    least-squares representative for the partition (GRACE decodes to the bucket
    mean too). Deterministic; biased. SketchML's separate sketches for positive
    and negative values, and its MinMaxSketch of the keys of sparse gradients,
    do not apply to the dense form GRACE benchmarks.

    Args:
      buckets: B, an integer in ``[2, 65536]``.
    Wire bits: ``pw(d, ceil(log2 B)) + 32 B``. Non-finite input (a non-finite
    bucket mean): all NaN.
    """
    buckets = check_positive_int(buckets, "buckets", minimum=2)
    if buckets > _CELLS:
        raise ValueError(f"buckets must be <= {_CELLS}; got {buckets}")
    width = _code_width(buckets)

    def compress(x, key, state):
        del key
        xf = _flat32(x)
        bucket, cell_bucket, cell_counts = sketch_buckets(xf, buckets)
        sums = jax.ops.segment_sum(xf, bucket, buckets)
        counts = jax.ops.segment_sum(cell_counts, cell_bucket, buckets)  # from the sketch: 2^16 adds
        means = sums / jnp.maximum(counts, 1).astype(jnp.float32)
        return SketchPayload(codes=pack_codes(bucket, width), means=means, shape=x.shape, dtype=x.dtype), state

    def decompress(p: SketchPayload):
        code = unpack_codes(p.codes, width, _size(p.shape))
        y = jnp.where(jnp.all(jnp.isfinite(p.means)), p.means[code], jnp.nan)
        return _restore(y, p.shape, p.dtype)

    return Compressor.create(
        name="sketchml", compress=jax.jit(compress), decompress=jax.jit(decompress), unbiased=False,
        strategy="allgather", seed=seed, params=dict(buckets=buckets),
    )


# --------------------------------------------------------------------------- #
# DoubleSqueeze's clipping and stochastic rounding (Tang et al. 2019)
# --------------------------------------------------------------------------- #
@payload_dataclass
class ClippedPayload(Payload):
    """Truncated float32 bit patterns.

    Attributes:
      codes: fields of :func:`pack_codes`: the top ``9 + bits`` bits of each
        float32 (sign, 8 exponent bits, ``bits`` mantissa bits).
      bits: mantissa bits kept (static); shape, dtype: static.
    """

    codes: tuple
    bits: int = static_field()
    shape: tuple = static_field()
    dtype: Any = static_field()

    def wire_bits(self) -> int:
        """``pw(d, 9 + bits)``."""
        return packed_code_bits(_size(self.shape), 9 + self.bits)


@register("clipping")
def clipping(*, bits: int = 7, seed: int = 0) -> Compressor:
    """DoubleSqueeze's "clipping": zero the low mantissa bits of each float32.

    Keeps the sign, the 8 exponent bits and the top ``bits`` of the 23 mantissa
    bits (truncation toward zero: ``x_hat = bitcast(bitcast(x) & ~(2^(23-bits) -
    1))``; ``|x - x_hat| < 2^(e - bits)`` for ``2^e <= |x|``). Deterministic,
    biased (DoubleSqueeze compensates it by error feedback on both sides; its
    notes: "set the bits below k to 0"). ``bits = 23`` is lossless for float32 (and ``bits >= 7`` for
    bfloat16 input); ``bits = 7`` is bfloat16 truncation.

    Wire: the top ``9 + bits`` bits per entry, bit-exact: ``pw(d, 9 + bits)``.
    Non-finite input: Inf is exact; NaN stays NaN when its kept mantissa bits
    are non-zero (the canonical quiet NaN for ``bits >= 1``), otherwise it
    becomes +-Inf.

    Args:
      bits: mantissa bits kept, an integer in ``[0, 23]``.
    """
    bits = check_positive_int(bits, "bits", minimum=0)
    if bits > 23:
        raise ValueError(f"bits must be in [0, 23] (float32 has 23 mantissa bits); got {bits}")
    width, drop = 9 + bits, 23 - bits

    def compress(x, key, state):
        del key
        u = jax.lax.bitcast_convert_type(_flat32(x), jnp.uint32)
        return ClippedPayload(codes=pack_codes(u >> drop, width), bits=bits, shape=x.shape, dtype=x.dtype), state

    def decompress(p: ClippedPayload):
        u = unpack_codes(p.codes, width, _size(p.shape)).astype(jnp.uint32) << drop
        return _restore(jax.lax.bitcast_convert_type(u, jnp.float32), p.shape, p.dtype)

    return Compressor.create(
        name="clipping", compress=jax.jit(compress), decompress=jax.jit(decompress), unbiased=False,
        strategy="allgather", seed=seed, params=dict(bits=bits),
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
        return packed_code_bits(_size(self.shape), self.bits) + 32


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
    Wire bits: ``pw(d, bits) + 32``. Non-finite input: all NaN.
    """
    bits = check_positive_int(bits, "bits")
    if bits > 16:
        raise ValueError(f"bits must be in [1, 16]; got {bits}")
    top = float((1 << bits) - 1)  # L - 1

    def compress(x, key, state):
        xf = _flat32(x)
        scale = _max_abs(xf)
        y = (xf + scale) * (top / (2.0 * jnp.where(scale > 0, scale, 1.0)))
        y = jnp.clip(jnp.where(jnp.isfinite(y), y, 0.0), 0.0, top)
        low = jnp.floor(y)
        k = jnp.minimum(low + (_uniform(key, xf.size) < y - low), top).astype(jnp.int32)
        return GridPayload(codes=pack_codes(k, bits), scale=scale, bits=bits, shape=x.shape, dtype=x.dtype), state

    def decompress(p: GridPayload):
        k = unpack_codes(p.codes, bits, _size(p.shape)).astype(jnp.float32)
        y = p.scale * (k * (2.0 / top) - 1.0)
        return _restore(_nan_unless_finite(y, p.scale), p.shape, p.dtype)

    return Compressor.create(
        name="stochastic_rounding", compress=jax.jit(compress), decompress=jax.jit(decompress), unbiased=True,
        strategy="allgather", seed=seed, params=dict(bits=bits),
    )
