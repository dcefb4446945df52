"""Lossless-at-the-limit compressors: ``none``, ``fp16``, ``bf16``.

They send a dense (possibly narrowed) copy of the tensor; payloads can be
summed as they are, so their strategy is ``allreduce`` (GRACE Table I,
"8-bit/16-bit" family; fp16 is the usual mixed-precision baseline).
"""

from __future__ import annotations

import jax.numpy as jnp

from ._base import Compressor, DensePayload, register
from ._primitives import saturate

__all__ = ["none", "fp16", "bf16"]


def _cast_compressor(name: str, wire_dtype, seed: int) -> Compressor:
    """A dense compressor that sends ``x`` cast to ``wire_dtype`` (``None``: as it is, exact)."""

    def compress(x, key, state):
        del key
        # NaN/Inf are carried through as they are (IEEE casts preserve them).
        data = x if wire_dtype is None else x.astype(wire_dtype)
        return DensePayload(data=data, dtype=x.dtype), state

    def decompress(p: DensePayload):
        return saturate(p.data, p.dtype).astype(p.dtype)  # e.g. bf16's 65536 back to float16: 65504, not Inf

    return Compressor(
        name=name,
        compress_fn=compress,
        decompress_fn=decompress,
        unbiased=wire_dtype is None,
        strategy="allreduce",
        seed=seed,
        params={},
        stochastic=False,
        **(dict(variance_factor=0.0, bound="exact: Q(x) = x") if wire_dtype is None else _rounding_bound(wire_dtype)),
    )


def _rounding_bound(wire_dtype) -> dict:
    """The contraction of round-to-nearest in ``wire_dtype``: unit roundoff ``u = 2^-(p+1)`` for ``p`` stored
    mantissa bits, ``|Q(x)_i − x_i| ≤ u |x_i|`` for entries in the normal range, so ``δ = 1 − u²``."""
    info = jnp.finfo(wire_dtype)
    p = int(info.nmant) + 1
    return dict(
        contraction=1.0 - 2.0 ** (-2 * p),
        bound=(
            f"round to nearest {jnp.dtype(wire_dtype).name} (unit roundoff u = 2^-{p}): |Q(x)_i − x_i| ≤ u |x_i| for "
            f"entries in the normal range [{float(info.smallest_normal):.2g}, {float(info.max):.5g}], so δ = 1 − u²; "
            "subnormal and overflowing entries are outside the bound"
        ),
    )


@register("none")
def none(*, seed: int = 0) -> Compressor:
    """Identity: sends ``x`` as it is (32 bits per float32 entry). Exact.

    Wire bits: ``d * bits(dtype)`` for a ``d``-element tensor. NaN/Inf pass through.
    """
    return _cast_compressor("none", None, seed)


@register("fp16")
def fp16(*, seed: int = 0) -> Compressor:
    """Cast to IEEE float16 for the wire (16 bits per entry), back on receipt.

    Exact on values representable in float16; otherwise round-to-nearest
    (deterministic, hence ``unbiased=False`` in general; we report it as GRACE
    does, as an allreduce-able lossless-in-practice baseline). Values beyond
    65504 overflow to +-Inf; NaN/Inf pass through. Wire bits: ``16 d``.
    """
    return _cast_compressor("fp16", jnp.float16, seed)


@register("bf16")
def bf16(*, seed: int = 0) -> Compressor:
    """Cast to bfloat16 for the wire (16 bits: float32's exponent, 8-bit mantissa).

    Round-to-nearest-even, so deterministic and biased; same range as float32.
    NaN/Inf pass through. Wire bits: ``16 d``.
    """
    return _cast_compressor("bf16", jnp.bfloat16, seed)
