"""DoubleSqueeze's "clipping" (Tang et al. 2019): the top mantissa bits of each float32."""

from __future__ import annotations

from typing import Any

import jax
import jax.numpy as jnp

from .._validate import check_int
from ._base import Compressor, Payload, payload_dataclass, register, static_field
from ._kernels.bitpack import pack_codes, packed_code_bits, unpack_codes
from ._primitives import flat32, restore, size_of
from ._quantize import jitted_compressor

Array = jax.Array


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
        return packed_code_bits(size_of(self.shape), 9 + self.bits)


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
    bits = check_int(bits, "bits", minimum=0, why="it fixes the code width, an array shape")
    if bits > 23:
        raise ValueError(f"bits must be in [0, 23] (float32 has 23 mantissa bits); got {bits}")
    width, drop = 9 + bits, 23 - bits

    def compress(x, key, state):
        del key
        u = jax.lax.bitcast_convert_type(flat32(x), jnp.uint32)
        return ClippedPayload(codes=pack_codes(u >> drop, width), bits=bits, shape=x.shape, dtype=x.dtype), state

    def decompress(p: ClippedPayload):
        u = unpack_codes(p.codes, width, size_of(p.shape)).astype(jnp.uint32) << drop
        return restore(jax.lax.bitcast_convert_type(u, jnp.float32), p.shape, p.dtype)

    return jitted_compressor(
        "clipping",
        compress,
        decompress,
        unbiased=False,
        seed=seed,
        params=dict(bits=bits),
        stochastic=False,
        contraction=1.0 - (2.0**bits + 1.0) ** -2,
        bound=(
            "truncation of the mantissa to `bits` bits: for a normal 2^e <= |x_i| < 2^(e+1) the error "
            "r = |x_i − Q(x)_i| < 2^(e − bits) and |Q(x)_i| >= 2^e, so r/|x_i| <= r/(2^e + r) < 1/(2^bits + 1), "
            "δ = 1 − (2^bits + 1)^-2 (bits = 0, sign and exponent only: δ = 3/4)"
        ),
    )
