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
:func:`~._kernels.bitpack.pack_codes`: the width is split into its binary digits (e.g.
``17 = 16 + 1``) and each digit's group of bits is packed densely (1, 2, 4
bits: ``8 / 2^j`` codes per byte) or stored as uint8/uint16/uint32,
so ``pw(d, w) = sum_{2^j in w} 8 ceil(d 2^j / 8)``; that is ``d w`` bits plus
at most 7 padding bits per bit plane group. No varint or entropy coding.

Speed. All are single passes over the tensor except ``sketchml`` (histogram
scatter) and ``inceptionn`` (prefix sums to compact each class). The stochastic
ones draw their uniforms from the counter-based hash of
:mod:`._kernels.random_bits` (scheme ``"lowbias32"``) instead of threefry
(their relative cost is in ``docs/benchmarks.md``). ``compress``/``decompress`` are wrapped in
``jax.jit`` (one XLA program per shape and dtype when called eagerly; inlined
under an outer ``jit``).

Non-finite input. Methods with a tensor-wide scale (``eightbit``, ``qsgd``,
``terngrad``, ``stochastic_rounding``, ``sketchml``) decode the *whole* tensor
to NaN when the scale (or a bucket mean) is not finite: any NaN or Inf entry
(:func:`max_abs` sees a NaN in a tensor of any size), or a QSGD norm beyond
the float32 range. Elementwise codes follow IEEE: see each factory's
docstring (``natural``: NaN and Inf decode to +-Inf; ``clipping``: Inf exact,
NaN kept NaN when its top kept mantissa bits are non-zero; ``inceptionn``:
non-finite entries are sent raw, exactly).

Huge, tiny and half-precision input. Scales are computed without overflow:
norms by :func:`l2_norm` (rescaled by a power of two when the squares overflow
or underflow), means by :func:`mean_of`, and max-abs grids pre-scaled by
``2^-8`` near the float32 maximum (:func:`big_scale_factor`), so finite input
gives finite output wherever the payload's float32 scale can hold it, and the
result of ``2^s x`` is exactly ``2^s`` times that of ``x``. A decoded value
beyond a float16/bfloat16 tensor's range saturates at its largest finite value
(:func:`~._primitives.saturate`). Subnormal float32 inputs quantize to zero:
XLA:CPU reads subnormal operands of arithmetic as zero and flushes subnormal
results. The table of every compressor's behaviour is in
``docs/guide/compressors.md`` (Numerics).

Modules: :mod:`._eightbit`, :mod:`._stochastic` (QSGD, natural compression,
TernGrad, stochastic rounding), :mod:`._inceptionn`, :mod:`._sketchml` and
:mod:`._clipping`; this module holds what they share.
"""

from __future__ import annotations

import math
from typing import Any, ClassVar

import jax
import jax.numpy as jnp
from jax import Array

from ._base import Compressor, Payload, payload_dataclass, static_field
from ._kernels.bitpack import packed_size


def max_abs(xf):
    """``max_i |x_i|`` (float32 scalar; ``+Inf`` if any entry is NaN or infinite; 0 when empty).

    NaN is mapped to ``+Inf`` before the reduction: XLA:CPU's vectorised ``max``
    reduction does not propagate NaN, so a NaN entry could otherwise be dropped
    and the scale stay finite.
    """
    if not xf.size:
        return jnp.float32(0)
    a = jnp.abs(xf)
    return jnp.max(jnp.where(jnp.isnan(a), jnp.inf, a))


def big_scale_factor(scale):
    """``2^-8`` where the float32 scale exceeds ``2^120``, else 1 (float32 scalar).

    Multiplying a tensor and its max-abs scale ``M`` by it is exact, except for
    entries below ``2^-118``, which become subnormal (read as 0 by XLA:CPU): they
    are ``2^-238`` of ``M`` or less, so their codes do not change. It keeps
    ``x + M`` and ``1 / M`` in range for scales near the float32 maximum.
    """
    return jnp.where(scale > jnp.float32(2.0**120), jnp.float32(2.0**-8), jnp.float32(1.0))


_TINY_SUMSQ = 2.0**-100
"""Below this ``sum x_i^2`` the squares may have lost precision (underflow): :func:`l2_norm` rescales."""


def l2_norm(xf):
    """``||x||_2`` of a float32 vector, without overflow or underflow of the squares.

    ``sqrt(sum_i x_i^2)`` when that sum is finite and at least ``2^-100`` (the
    common case: one pass); otherwise ``m sqrt(sum_i (x_i/m)^2)`` with ``m`` a
    power of two next to ``max|x|``, so dividing by ``m`` and multiplying back
    are exact. The result is finite whenever the norm itself is below the
    float32 maximum (``~3.4e38``); NaN when an entry is NaN, ``+Inf`` when one
    is infinite or the norm exceeds that range, and 0 for a zero vector (or one
    of subnormals only, which XLA:CPU treats as zeros).
    """
    ss = jnp.sum(xf * xf)
    return jax.lax.cond(jnp.isfinite(ss) & (ss >= _TINY_SUMSQ), lambda: jnp.sqrt(ss), lambda: scaled_l2_norm(xf))


def scaled_l2_norm(xf):
    """:func:`l2_norm`'s rescaled form, always (no ``lax.cond``; two reductions): ``m sqrt(sum (x/m)^2)``."""
    _, e = jnp.frexp(max_abs(xf))
    m = jnp.ldexp(jnp.float32(1.0), jnp.clip(e - 1, -126, 127).astype(jnp.int32))
    y = xf / m
    return m * jnp.sqrt(jnp.sum(y * y))


def mean_of(v, n):
    """``sum(v) / n`` in float32 without overflow of the sum (finite whenever the mean is).

    One reduction; only when the sum overflows is it redone on ``v * 2^-64``
    (exact scaling; entries small enough to lose bits there are far below the
    sum's resolution) and scaled back after the division.
    """
    s = jnp.sum(v)
    return jax.lax.cond(
        jnp.isfinite(s), lambda: s / n, lambda: (jnp.sum(v * jnp.float32(2.0**-64)) / n) * jnp.float32(2.0**64)
    )


def nan_unless_finite(y, scale):
    """``y`` where the scale is finite, NaN everywhere otherwise (documented policy)."""
    return jnp.where(jnp.isfinite(scale), y, jnp.nan)


def jitted_compressor(
    name: str, compress, decompress, *, unbiased: bool, seed: int, params: dict, init_state=None, **facts
) -> Compressor:
    """A quantizer's :class:`Compressor`: ``compress``/``decompress`` jitted, strategy ``"allgather"``;
    ``facts``: its declared bound and randomness (``bound=``, ``stochastic=``, ...), passed on.

    ``jax.jit`` compiles one XLA program per input shape and dtype when called
    eagerly, and is inlined under an outer ``jit``.
    """
    return Compressor(
        name=name,
        compress_fn=jax.jit(compress),
        decompress_fn=jax.jit(decompress),
        unbiased=unbiased,
        strategy="allgather",
        init_state=init_state,
        seed=seed,
        params=params,
        **facts,
    )


@payload_dataclass
class _ScaledCodesPayload(Payload):
    """The format of a quantizer with one tensor-wide scale: a ``code_bits``-bit code per entry
    (packed, ``8 / code_bits`` codes a byte) and the float32 scale ``max_i |x_i|``.

    Wire bits: ``8 ceil(d code_bits / 8) + 32``.
    """

    codes: Array
    scale: Array
    shape: tuple = static_field()
    dtype: Any = static_field()
    code_bits: ClassVar[int] = 8

    def wire_bits(self) -> int:
        return 8 * packed_size(math.prod(self.shape), self.code_bits) + 32
