"""INCEPTIONN's error-bounded lossy compression of floats (Li et al. 2018; GRACE Sec. III-A)."""

from __future__ import annotations

import math
from typing import Any, ClassVar

import jax
import jax.numpy as jnp

from .._bitcount import BitCount
from .._validate import check_finite_scalar
from ._base import Compressor, Payload, payload_dataclass, register, static_field
from ._bounds import absolute
from ._kernels.bitpack import pack, unpack
from ._kernels.compact import class_ranks
from ._primitives import flat32, packed_size, restore, size_of
from ._quantize import jitted_compressor

Array = jax.Array


@payload_dataclass
class InceptionnPayload(Payload):
    """Per-entry 2-bit class tags and one fixed-capacity buffer per class.

    Entry ``i`` of class ``c`` is the ``r``-th entry of that class in flat
    order; its value sits at position ``r`` of the class buffer. Only the first
    ``n_c`` slots of each buffer are meaningful (the rest are 0): the buffers
    are counted fields, and the pipeline's all-gather sends those slots and the
    three counts (which a receiver could also recover from the tags).

    Attributes:
      tags: uint8 ``(ceil(d/4),)``, packed 2-bit class per entry (0: dropped,
        1: 8-bit, 2: 16-bit, 3: raw 32-bit).
      q8: uint8 ``(d,)`` buffer, ``sign << 7 | q`` with ``1 <= q < 2^7``.
      q16: uint16 ``(d,)`` buffer, ``sign << 15 | q`` with ``2^7 <= q < 2^15``.
      raw: float32 ``(d,)`` buffer of entries sent as they are.
      n8, n16, n32: int32 scalars, the entries of class 1, 2 and 3 (the valid
        slots of ``q8``, ``q16`` and ``raw``).
      quantum: delta, the fixed-point step (static, a power of two).
      shape, dtype: static.
    """

    tags: Array
    q8: Array
    q16: Array
    raw: Array
    n8: Array
    n16: Array
    n32: Array
    quantum: float = static_field()
    shape: tuple = static_field()
    dtype: Any = static_field()
    counted: ClassVar[tuple[tuple[str, str], ...]] = (("q8", "n8"), ("q16", "n16"), ("raw", "n32"))
    inferred: ClassVar[tuple[str, ...]] = ("n8", "n16", "n32")  # the number of tags of each class

    def class_counts(self) -> Array:
        """``(n8, n16, n32)`` as int32 ``(3,)``."""
        return jnp.stack([self.n8, self.n16, self.n32]).astype(jnp.int32)

    def wire_bits(self) -> BitCount:
        """``8 ceil(d/4) + 8 n8 + 16 n16 + 32 n32`` (a traced :class:`~jaxcomm.BitCount`; the counts are
        implied by the tags)."""
        n = self.class_counts()
        tags = 8 * packed_size(size_of(self.shape), 2)
        return BitCount.product(n[0], 8) + BitCount.product(n[1], 16) + BitCount.product(n[2], 32) + tags


@register("inceptionn")
def inceptionn(*, error_bound: float = 2.0**-10, seed: int = 0) -> Compressor:
    """INCEPTIONN error-bounded lossy compression of floats (Li et al. 2018; GRACE Sec. III-A).

    Long because a compressor factory's closures share the validated hyper-parameters; each inner function is short.

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
    error_bound = check_finite_scalar(
        error_bound, "error_bound", positive=True, why="it fixes the fixed-point quantum and classes in Python"
    )
    if not 2.0**-126 <= error_bound <= 2.0**100:
        raise ValueError(f"error_bound must be in [2**-126, 2**100] (float32 fixed point); got {error_bound}")
    _, exp = math.frexp(error_bound)  # error_bound = f * 2^exp with 0.5 <= f < 1
    quantum = math.ldexp(1.0, exp - 1)  # 2^floor(log2 error_bound)
    inv_quantum = 1.0 / quantum

    def compress(x, key, state):
        del key
        xf = flat32(x)
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
        slot = jnp.where(tag == 0, 3 * d, (tag.astype(jnp.int32) - 1) * d + class_ranks(tag))
        buf = jnp.zeros((3 * d,), jnp.uint32).at[slot].set(word, mode="drop", unique_indices=True)
        payload = InceptionnPayload(
            tags=pack(tag, 2),
            q8=buf[:d].astype(jnp.uint8),
            q16=buf[d : 2 * d].astype(jnp.uint16),
            raw=jax.lax.bitcast_convert_type(buf[2 * d :], jnp.float32),
            n8=jnp.sum(tag == 1, dtype=jnp.int32),
            n16=jnp.sum(tag == 2, dtype=jnp.int32),
            n32=jnp.sum(tag == 3, dtype=jnp.int32),
            quantum=quantum,
            shape=x.shape,
            dtype=x.dtype,
        )
        return payload, state

    def decompress(p: InceptionnPayload):
        d = size_of(p.shape)
        tag = unpack(p.tags, 2, d)
        rank = class_ranks(tag)
        c8 = p.q8[rank].astype(jnp.uint32)
        c16 = p.q16[rank].astype(jnp.uint32)
        v8 = (c8 & 0x7F).astype(jnp.float32) * p.quantum
        v8 = jnp.where(c8 >> 7 == 1, -v8, v8)
        v16 = (c16 & 0x7FFF).astype(jnp.float32) * p.quantum
        v16 = jnp.where(c16 >> 15 == 1, -v16, v16)
        v32 = p.raw[rank]
        y = jnp.where(tag == 1, v8, jnp.where(tag == 2, v16, jnp.where(tag == 3, v32, 0.0)))
        return restore(y, p.shape, p.dtype)

    return jitted_compressor(
        "inceptionn",
        compress,
        decompress,
        unbiased=False,
        seed=seed,
        params=dict(error_bound=error_bound),
        stochastic=False,
        contraction=0.0,
        local_contraction=absolute(quantum),
        bound=(
            "fixed-point truncation toward zero with step Δ = 2^floor(log2 error_bound) (entries below Δ dropped, "
            "large ones sent raw): |x_i − Q(x)_i| ≤ min(|x_i|, Δ), so non-expansive (δ = 0) and "
            "δ(x) = 1 − Σ min(x_i², Δ²)/‖x‖²"
        ),
    )
