"""GRACE's helper operators as pure, jit-able functions.

pack/unpack (bit packing of small integer codes), sparsify/desparsify (gather
and scatter of selected entries), quantize/dequantize (QSGD-style stochastic
uniform quantisation of magnitudes, GRACE Sec. III-A and Alistarh et al. 2017,
Eq. (1) of QSGD), and the index encoding used by sparsifiers; plus the small array helpers every
compressor shares (:func:`flat32`, :func:`restore`, :func:`size_of`, :func:`bits_of`).
:func:`pack`/:func:`unpack` are defined in :mod:`._kernels.bitpack`.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np

from ._kernels.bitpack import pack, packed_size, unpack  # noqa: F401  (GRACE's pack/unpack live with the other packers)
from ._quantize import l2_norm


def flat32(x):
    """``x`` as a float32 vector ``(x.size,)`` (the compute dtype of every compressor)."""
    return jnp.ravel(x).astype(jnp.float32)


def restore(flat, shape, dtype):
    """A flat vector back to ``shape`` and ``dtype`` (finite values saturate: :func:`saturate`)."""
    return saturate(flat, dtype).reshape(shape).astype(dtype)


def saturate(v, dtype):
    """``v`` with its finite entries clipped to the finite range of ``dtype``, ready to cast to it.

    For a ``dtype`` narrower in range than ``v``'s (float16 ``65504``, bfloat16
    ``~3.39e38`` from float32), a finite decoded value beyond that range becomes
    the largest finite value instead of ``Inf``; ``+-Inf`` and NaN are kept.
    Clipping towards a representable input can only reduce ``|Q(x)_i - x_i|``.
    Other dtypes: ``v`` unchanged.
    """
    dtype = jnp.dtype(dtype)
    if not jnp.issubdtype(dtype, jnp.floating) or not jnp.issubdtype(v.dtype, jnp.floating):
        return v
    top = float(jnp.finfo(dtype).max)
    if top >= float(jnp.finfo(v.dtype).max):
        return v
    v = v.astype(jnp.promote_types(v.dtype, jnp.float32))  # the bound itself may round up in v's dtype (bf16)
    return jnp.where(jnp.isinf(v), v, jnp.clip(v, -top, top))


def size_of(shape) -> int:
    """Number of entries of a tensor of ``shape`` (int64 product)."""
    return int(np.prod(shape, dtype=np.int64))


def bits_of(dtype) -> int:
    """Width of ``dtype`` in bits."""
    return jnp.dtype(dtype).itemsize * 8


def index_dtype(size: int):
    """Narrowest unsigned dtype that encodes every flat index of a ``size``-element tensor.

    uint8 up to 256 elements, uint16 up to 65536, else int32 (the wire format
    GRACE would use with int64 is twice as wide).
    """
    if size <= 1 << 8:
        return jnp.uint8
    if size <= 1 << 16:
        return jnp.uint16
    if size <= np.iinfo(np.int32).max:
        return jnp.int32
    raise ValueError(f"tensor of {size} elements is too large for 32-bit indices")


def sparsify(x: jax.Array, indices: jax.Array) -> jax.Array:
    """Gather ``x.ravel()[indices]``: values of shape ``indices.shape``."""
    return jnp.ravel(x)[indices.astype(jnp.int32)]


def desparsify(values: jax.Array, indices: jax.Array, shape, dtype=None) -> jax.Array:
    """Scatter-add ``values`` at flat ``indices`` into zeros of ``shape``.

    Repeated indices add up (so the padded slots of a fixed-capacity buffer may
    hold zeros at index 0 harmlessly).
    """
    dtype = dtype or values.dtype
    size = int(np.prod(shape, dtype=np.int64))
    out = jnp.zeros((size,), dtype).at[indices.astype(jnp.int32)].add(values.astype(dtype))
    return out.reshape(shape)


def quantize(x: jax.Array, levels: int, key: jax.Array, norm: jax.Array | None = None):
    """Stochastic uniform quantisation of |x|/norm to ``levels`` levels (QSGD Eq. 1).

    ``xi_i = floor(l_i) + Bernoulli(l_i - floor(l_i))`` with ``l_i = s|x_i|/norm``,
    so ``E[xi_i] = l_i`` (unbiased). NaN entries get level 0.

    Args:
      x: float array, any shape.
      levels: s >= 1 (static).
      key: PRNG key.
      norm: scalar scale (default ``||x||_2``, computed without overflow: :func:`~._quantize.l2_norm`).
    Returns:
      (level, sign, norm): ``level`` uint8/uint16/int32 in ``[0, s]`` with x's
      shape, ``sign`` bool (x < 0), ``norm`` float32 scalar.
    """
    xf = jnp.asarray(x, jnp.float32)
    if norm is None:
        norm = l2_norm(xf.ravel())
    norm = jnp.asarray(norm, jnp.float32)
    safe = jnp.where(norm > 0, norm, 1.0)
    scaled = jnp.clip(jnp.abs(xf) / safe * levels, 0.0, float(levels))
    scaled = jnp.where(jnp.isfinite(scaled), scaled, 0.0)
    low = jnp.floor(scaled)
    up = jax.random.uniform(key, xf.shape, jnp.float32) < (scaled - low)  # float32 draws with x64 too
    level = (low + up.astype(low.dtype)).astype(index_dtype(levels + 1))
    return level, xf < 0, norm


def dequantize(level: jax.Array, sign: jax.Array, norm: jax.Array, levels: int, dtype=jnp.float32):
    """Inverse of :func:`quantize`: ``norm * sign * level / s`` in ``dtype``."""
    mag = level.astype(jnp.float32) * (norm / levels)
    return jnp.where(sign, -mag, mag).astype(dtype)
