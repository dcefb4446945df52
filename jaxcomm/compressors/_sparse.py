"""Sparse payloads and the sparsifiers' overview: random-k, top-k, Threshold-v, DGC, random sparsification.

GRACE Sec. III-B (Table I, "Sparsification"): a sparsifier selects a subset of
the ``d`` entries of a gradient ``g`` (a bitmask ``b``) and sends the selected
values and their positions; the receiver scatters them into zeros.

* ``randomk``: ``k`` uniformly random positions (Stich et al. 2018); with a key
  shared by every worker the positions agree, so only the values are sent and
  the payloads can be summed (strategy ``allreduce``).
* ``topk``: the ``k`` largest magnitudes (Aji & Heafield 2017), exact, with a
  sampling-based selection that is a small multiple of a memory pass on CPU.
* ``threshold``: Threshold-v, every ``|g_i| >= v`` (Dutta et al. 2020).
* ``dgc``: Deep Gradient Compression's sampled threshold (Lin et al. 2018),
  transcribed from the authors' code (``dgc/compression.py``).
* ``random_sparsification``: keep ``g_i / p`` with probability ``p``
  (DoubleSqueeze, Tang et al. 2019; Wangni et al. 2018 with uniform ``p``).

Decoding writes the sent values into zeros (a scatter-set of distinct
positions), so lossless settings (``topk(ratio=1)``, ``threshold(v=0)``,
``randomk(ratio=1)``, ``random_sparsification(p=1)``) are bit-exact, subnormal
values included; summing several payloads (``decompress_sum``) adds, and
XLA:CPU flushes subnormal sums to 0.

Count-based methods (threshold, dgc, random sparsification) return a
fixed-capacity buffer plus a count, so shapes stay static under ``jit``; their
``wire_bits`` is a traced :class:`~jaxcomm.BitCount` computed from the count.

Modules: :mod:`._topk`, :mod:`._randomk`, :mod:`._threshold` (Threshold-v and
DGC) and :mod:`._random_sparsification`; the selection and compaction they
share are :mod:`._kernels.select` and :mod:`._kernels.compact`, the decoding :mod:`._kernels.scatter`.
This module holds the sparse payload formats and their codecs.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from typing import Any, ClassVar

import jax
import jax.numpy as jnp
import numpy as np

from .._bitcount import BitCount
from ._base import Compressor, Payload, payload_dataclass, static_field
from ._kernels.bitpack import bytes_to_words, unpack
from ._kernels.compact import SMALL, compact, compact_words
from ._kernels.scatter import scatter, scatter_count, scatters_whole_buffer, subtract_sparse, sum_scatter
from ._primitives import bits_of, index_dtype

Array = jax.Array


def num_selected(ratio: float, d: int) -> int:
    """``k = max(1, round(ratio * d))`` rounded half up, capped at ``d`` (0 if ``d == 0``)."""
    if d == 0:
        return 0
    return int(min(d, max(1, math.floor(ratio * d + 0.5))))


@payload_dataclass
class SparsePayload(Payload):
    """Fixed-size sparse payload: ``k`` values and their flat indices (top-k).

    Attributes:
      values: ``(k,)`` the selected entries in the input dtype (lossless).
      indices: ``(k,)`` flat positions, :func:`index_dtype` of ``d`` (uint8/uint16/int32).
      shape, dtype: the original tensor's shape and dtype (static, not sent).

    Wire bits: ``k * (bits(dtype) + bits(index dtype))``.
    """

    values: Array
    indices: Array
    shape: tuple = static_field()
    dtype: Any = static_field()


@payload_dataclass
class CountSparsePayload(Payload):
    """Variable-size sparse payload in a fixed-capacity buffer (threshold, DGC, ...).

    Attributes:
      values: ``(cap,)`` selected entries (input dtype); slots ``>= count`` are 0.
      indices: ``(cap,)`` flat positions (:func:`index_dtype`); slots ``>= count`` are 0.
      count: int32 scalar, number of valid slots (``<= cap``).
      shape, dtype: original shape and dtype (static).
      scale: multiplier applied on decompression (static; ``1/p`` for random sparsification).

    Wire bits: ``count * (bits(dtype) + bits(index dtype)) + 32`` (the count
    itself is sent); a traced int32. ``values`` and ``indices`` are counted
    fields: the pipeline's all-gather sends only their first ``count`` slots.
    """

    values: Array
    indices: Array
    count: Array
    shape: tuple = static_field()
    dtype: Any = static_field()
    scale: float = static_field(default=1.0)
    counted: ClassVar[tuple[tuple[str, str], ...]] = (("values", "count"), ("indices", "count"))

    def wire_bits(self):
        per = bits_of(self.values.dtype) + bits_of(self.indices.dtype)
        return BitCount.product(self.count, per) + 32


@payload_dataclass
class MaskSparsePayload(Payload):
    """Variable-size sparse payload with a bitmask of positions (random sparsification, dense p).

    Attributes:
      mask: uint8 ``(ceil(d/8),)``, bit ``i % 8`` of byte ``i // 8`` set iff entry
        ``i`` is sent (the :func:`pack` layout).
      values: ``(cap,)`` the sent entries in index order (input dtype); slots
        ``>= count`` are 0.
      count: int32 scalar, ``min(popcount(mask), cap)``, the valid slots of ``values``.
      shape, dtype, scale: as :class:`CountSparsePayload`.

    Wire bits: ``8 * ceil(d/8) + count * bits(dtype)`` (the count is implied by
    the mask, so the format leaves it out); a traced int32. ``values`` is a
    counted field: the pipeline's all-gather sends its first ``count`` slots
    and the count in its count gather (32 bits more on the wire).
    """

    mask: Array
    values: Array
    count: Array
    shape: tuple = static_field()
    dtype: Any = static_field()
    scale: float = static_field(default=1.0)
    counted: ClassVar[tuple[tuple[str, str], ...]] = (("values", "count"),)
    inferred: ClassVar[tuple[str, ...]] = ("count",)  # min(popcount(mask), cap): implied by the mask

    def wire_bits(self):
        return BitCount.product(self.count, bits_of(self.values.dtype)) + self.mask.shape[0] * 8


def sparse_hooks(values: Callable | None = None) -> dict:
    """The decoding hooks of a payload of ``k`` values at distinct flat ``indices`` (:class:`SparsePayload`'s
    layout: ``indices`` ``(k,)``, static ``shape`` and ``dtype``), as :class:`Compressor` keywords:

    * ``decompress_fn``: ``p -> x_hat``, the ``k`` values scattered into zeros of ``shape`` (a scatter-set);
    * ``decompress_sum``: ``(g, dtype) -> Σ_i decompress(g[i])`` over ``n`` payloads stacked on a leading
      axis, one scatter-add of all ``n k`` entries;
    * ``compression_error``: ``(x, p) -> x − decompress(p)``, the sent entries of ``x`` zeroed in place.

    Args:
      values: ``p -> (k,)`` the values a payload decodes to (a quantized format's dequantizer, float32);
        ``None``: the payload's ``values`` field as it is.
    """

    def decoded(p):
        return p.values if values is None else values(p)

    def decompress(p):
        return scatter(decoded(p), p.indices, p.shape, p.dtype, unique=True)

    def decompress_sum(g, dtype):
        stacked = g.values if values is None else jax.vmap(values)(g)
        return sum_scatter(stacked, g.indices, g.shape, dtype, value_dtype=g.dtype)

    def compression_error(x, p):
        return subtract_sparse(x, decoded(p), p.indices)

    return dict(decompress_fn=decompress, decompress_sum=decompress_sum, compression_error=compression_error)


def sparse_compressor(name: str, compress, hooks: dict, *, seed: int, params: dict, **facts) -> Compressor:
    """A sparsifier's :class:`Compressor`: biased, its payloads gathered (strategy ``"allgather"``).

    ``hooks``: its format's decoding hooks (``decompress_fn``, and ``decompress_sum`` and
    ``compression_error`` where the format has them: :func:`sparse_hooks`, :func:`count_sparse_hooks`);
    ``facts``: its declared bound and randomness (``contraction=``, ``bound=``, ``stochastic=``, ...) and
    its state (``init_state=``), passed on.
    """
    return Compressor(
        name=name,
        compress_fn=compress,
        unbiased=False,
        strategy="allgather",
        seed=seed,
        params=params,
        **hooks,
        **facts,
    )


def _decompress_count(p: CountSparsePayload):
    return scatter_count(p.values, p.indices, p.count, p.shape, p.dtype, p.scale, unique=True)


def _decompress_sum_count(g: CountSparsePayload, dtype):
    """``decompress_sum`` of stacked :class:`CountSparsePayload`.

    One scatter of all ``n cap`` slots (unused slots hold 0 at index 0) when
    the buffers are small (``cap <= d / 16``); for large buffers each payload
    is decompressed on its own, so that :func:`scatter_count` can skip the
    unused tail of each.
    """
    n, cap = g.values.shape
    if scatters_whole_buffer(cap, int(np.prod(g.shape, dtype=np.int64))):
        return sum_scatter(g.values, g.indices, g.shape, dtype, g.scale, value_dtype=g.dtype)
    total = jnp.zeros(g.shape, dtype)
    for i in range(n):
        total = total + _decompress_count(jax.tree.map(lambda a, i=i: a[i], g)).astype(dtype)
    return total


def _error_count(x, p: CountSparsePayload):
    """``compression_error`` of :class:`CountSparsePayload`: one scatter into ``x`` when the
    buffer is small (``cap <= d / 16``), else ``x − decompress(p)`` (which skips unused slots)."""
    if scatters_whole_buffer(p.values.shape[0], int(np.size(x))):
        return subtract_sparse(x, p.values, p.indices, p.scale)
    return x - _decompress_count(p).astype(x.dtype)


def count_sparse_hooks() -> dict:
    """The decoding hooks of a :class:`CountSparsePayload` (a fixed-capacity buffer and its count), as
    :class:`Compressor` keywords (``decompress_fn``, ``decompress_sum``, ``compression_error``)."""
    return dict(decompress_fn=_decompress_count, decompress_sum=_decompress_sum_count, compression_error=_error_count)


def _decompress_mask(p: MaskSparsePayload):
    d = int(np.prod(p.shape, dtype=np.int64))
    cap = p.values.shape[0]
    if d == 0 or cap == 0:
        return jnp.zeros(p.shape, p.dtype)
    if d <= SMALL:
        pos, _ = compact(unpack(p.mask, 1, d).astype(bool), cap)
    else:
        pos, _ = compact_words(bytes_to_words(p.mask), cap)
    # the first min(set bits, cap) == p.count slots of p.values are the sent entries
    return scatter_count(p.values, pos, p.count, p.shape, p.dtype, p.scale, unique=True)


def _sparse_payload(x, idx, k_valid=None):
    """Gather ``x.ravel()[idx]`` into a :class:`SparsePayload` / :class:`CountSparsePayload`."""
    d = int(np.size(x))
    flat = jnp.ravel(x)
    vals = flat[idx]
    if k_valid is not None:
        valid = jnp.arange(idx.shape[0]) < k_valid
        vals = jnp.where(valid, vals, jnp.zeros_like(vals))
        idx = jnp.where(valid, idx, 0)
    return vals, idx.astype(index_dtype(max(d, 1)))
