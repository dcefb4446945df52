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
to NaN when the scale (or a bucket mean) is not finite: any NaN or Inf entry,
or a norm that overflows float32. Elementwise codes follow IEEE: see each
factory's docstring (``natural``: NaN and Inf decode to +-Inf; ``clipping``: Inf
exact, NaN kept NaN when its top kept mantissa bits are non-zero;
``inceptionn``: non-finite entries are sent raw, exactly).

Modules: :mod:`._eightbit`, :mod:`._stochastic` (QSGD, natural compression,
TernGrad, stochastic rounding), :mod:`._inceptionn`, :mod:`._sketchml` and
:mod:`._clipping`; this module holds what they share.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

from ._base import Compressor


def max_abs(xf):
    """``max_i |x_i|`` (float32 scalar; NaN if any entry is NaN; 0 when empty)."""
    return jnp.max(jnp.abs(xf)) if xf.size else jnp.float32(0)


def nan_unless_finite(y, scale):
    """``y`` where the scale is finite, NaN everywhere otherwise (documented policy)."""
    return jnp.where(jnp.isfinite(scale), y, jnp.nan)


def jitted_compressor(
    name: str, compress, decompress, *, unbiased: bool, seed: int, params: dict, init_state=None
) -> Compressor:
    """:meth:`Compressor.create` of a quantizer: ``compress``/``decompress`` jitted, strategy ``"allgather"``.

    ``jax.jit`` compiles one XLA program per input shape and dtype when called
    eagerly, and is inlined under an outer ``jit``.
    """
    return Compressor.create(
        name=name,
        compress=jax.jit(compress),
        decompress=jax.jit(decompress),
        unbiased=unbiased,
        strategy="allgather",
        init_state=init_state,
        seed=seed,
        params=params,
    )
