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

from .._primitives import desparsify, saturate


def _wide(dtype):
    """The dtype values are scaled and scattered in: float32, or the values' own when wider (float64)."""
    return jnp.promote_types(dtype, jnp.float32)


def _scaled(values, scale):
    """``values * scale`` in :func:`_wide`; a finite value the scale takes past the dtype's range saturates."""
    v = values.astype(_wide(values.dtype))
    if scale == 1.0:
        return v
    top = float(jnp.finfo(v.dtype).max)
    return jnp.where(jnp.isfinite(v), jnp.clip(v * jnp.asarray(scale, v.dtype), -top, top), v)


def scatter(values, indices, shape, dtype, scale=1.0, unique=False, repeats=False):
    """Scatter-add float32 ``values * scale`` at flat ``indices`` into zeros of ``shape``; cast to ``dtype``.

    ``unique``: the indices are distinct, or out of range (``>= size``, dropped):
    the values are then *written* (a scatter-set), not added to zeros, so a
    subnormal value survives (XLA:CPU flushes subnormal results of arithmetic,
    ``0 + x`` included). ``repeats``: an index may repeat, always with the same
    value (positions drawn with replacement): written too, once per position.
    float64 values are scattered in float64; finite values beyond ``dtype``'s
    range saturate (:func:`saturate`).
    """
    v = _scaled(values, scale)
    if unique or repeats:
        size = int(np.prod(shape, dtype=np.int64))
        at = jnp.zeros((size,), v.dtype).at[indices.astype(jnp.int32)]
        out = at.set(v, mode="drop", unique_indices=not repeats).reshape(shape)
    else:
        out = desparsify(v, indices, shape, v.dtype)
    return saturate(out, dtype).astype(dtype)


def scatters_whole_buffer(cap: int, d: int) -> bool:
    """Whether a count payload's ``cap``-slot buffer is scattered whole (small: ``cap <= d / 16``,
    or a small tensor), rather than skipping its unused tail with a ``lax.cond``."""
    return cap <= d // 16 or d // 16 < 1024


def scatter_count(values, indices, count, shape, dtype, scale=1.0, unique=False):
    """:func:`scatter` of the first ``count`` slots of a fixed-capacity buffer.

    Slots ``>= count`` are not part of the payload: their values are read as 0
    whatever the buffer holds (so a decoder never depends on how the sender
    filled its unused capacity). A scatter costs per slot, valid or not; when
    the buffer is large (``cap > d / 16``) and the count small, only the first
    ``d / 16`` slots are scattered (``lax.cond``). ``unique`` (the valid slots'
    indices are distinct): the slots are written, not added (:func:`scatter`), and
    the unused ones are dropped (their index is set past the end).
    """
    d = int(np.prod(shape, dtype=np.int64))
    cap = values.shape[0]
    small = d // 16
    valid = jnp.arange(cap) < count
    if unique:
        indices = jnp.where(valid, indices.astype(jnp.int32), jnp.int32(d))
    else:
        values = jnp.where(valid, values, jnp.zeros((), values.dtype))
    if scatters_whole_buffer(cap, d):
        return scatter(values, indices, shape, dtype, scale, unique)
    return lax.cond(
        count <= small,
        lambda: scatter(values[:small], indices[:small], shape, dtype, scale, unique),
        lambda: scatter(values, indices, shape, dtype, scale, unique),
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
    v = _scaled(jnp.ravel(values), scale)
    if value_dtype is not None:
        v = saturate(v, value_dtype).astype(value_dtype)
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
    v = _scaled(values, scale)
    flat = jnp.ravel(x)
    return flat.at[indices.astype(jnp.int32)].add(-saturate(v, flat.dtype).astype(flat.dtype)).reshape(jnp.shape(x))
