"""Scatter kernels: sparse entries back into dense tensors (decode, sum of payloads, error).

The inverse of :mod:`.select`'s compaction: ``scatter`` adds ``k`` values at
flat positions into zeros; ``scatter_count`` does so for the first ``count``
slots of a fixed-capacity buffer; ``sum_scatter`` sums ``n`` stacked payloads
in one scatter; ``subtract_sparse`` is ``x - scatter(...)`` in place.
Repeated positions add up, so the unused slots of a buffer (0 at index 0) are
harmless.
"""

from __future__ import annotations

import jax.numpy as jnp
import numpy as np
from jax import lax

from .._primitives import desparsify


def scatter(values, indices, shape, dtype, scale=1.0):
    """Scatter-add float32 ``values * scale`` at flat ``indices`` into zeros of ``shape``; cast to ``dtype``."""
    v = values.astype(jnp.float32)
    if scale != 1.0:
        v = v * jnp.float32(scale)
    return desparsify(v, indices, shape, jnp.float32).astype(dtype)


def scatters_whole_buffer(cap: int, d: int) -> bool:
    """Whether a count payload's ``cap``-slot buffer is scattered whole (small: ``cap <= d / 16``,
    or a small tensor), rather than skipping its unused tail with a ``lax.cond``."""
    return cap <= d // 16 or d // 16 < 1024


def scatter_count(values, indices, count, shape, dtype, scale=1.0):
    """:func:`scatter` of the first ``count`` slots of a fixed-capacity buffer.

    Slots ``>= count`` are not part of the payload: their values are read as 0
    whatever the buffer holds (so a decoder never depends on how the sender
    filled its unused capacity). A scatter costs per slot, valid or not; when
    the buffer is large (``cap > d / 16``) and the count small, only the first
    ``d / 16`` slots are scattered (``lax.cond``).
    """
    d = int(np.prod(shape, dtype=np.int64))
    cap = values.shape[0]
    small = d // 16
    values = jnp.where(jnp.arange(cap) < count, values, jnp.zeros((), values.dtype))
    if scatters_whole_buffer(cap, d):
        return scatter(values, indices, shape, dtype, scale)
    return lax.cond(
        count <= small,
        lambda: scatter(values[:small], indices[:small], shape, dtype, scale),
        lambda: scatter(values, indices, shape, dtype, scale),
    )


def sum_scatter(values, indices, shape, dtype, scale=1.0, value_dtype=None):
    """Scatter-add the entries of ``n`` sparse payloads into one dense tensor.

    ``sum_i scatter(values[i], indices[i])``: one zero-filled buffer and one
    scatter-add of all ``n k`` entries (repeated positions add up), instead of
    ``n`` dense tensors added together, so the cost is one pass over the tensor
    plus ``n k`` scattered adds.

    Args:
      values: ``(n, k)`` entries (any float dtype).
      indices: ``(n, k)`` flat positions into a tensor of ``shape``.
      shape: the dense tensor's shape.
      dtype: the result's dtype (the accumulation dtype).
      scale: multiplier applied to every value in float32 (static).
      value_dtype: if given, each scaled value is first rounded to it (the
        tensor's dtype: what a single payload's ``decompress`` returns), so the
        sum matches decompress-then-add up to summation order.
    Returns:
      ``(shape)`` array of ``dtype``.
    """
    v = jnp.ravel(values).astype(jnp.float32)
    if scale != 1.0:
        v = v * jnp.float32(scale)
    if value_dtype is not None:
        v = v.astype(value_dtype)
    return desparsify(v.astype(dtype), jnp.ravel(indices), shape, dtype)


def subtract_sparse(x, values, indices, scale=1.0):
    """``x − scatter(values · scale at indices)`` as one in-place scatter-add into ``x``.

    The compression error of a sparse payload compressed from ``x``:
    ``x − decompress(payload)`` without a dense reconstruction. Each value is
    scaled in float32 and rounded to ``x``'s dtype first, as ``decompress``
    does, so the result is identical (a sent entry of ``x`` becomes exactly 0;
    NaN and Inf entries become NaN, as ``x − x`` does).

    Args:
      x: the tensor the payload was compressed from, any shape.
      values: ``(k,)`` sent entries; indices: ``(k,)`` their flat positions.
      scale: multiplier of the values (static).
    Returns:
      array of ``x``'s shape and dtype.
    """
    v = values.astype(jnp.float32)
    if scale != 1.0:
        v = v * jnp.float32(scale)
    flat = jnp.ravel(x)
    return flat.at[indices.astype(jnp.int32)].add(-v.astype(flat.dtype)).reshape(jnp.shape(x))
