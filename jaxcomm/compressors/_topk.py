"""Top-k sparsification (Aji & Heafield 2017): the ``k`` largest magnitudes, exactly."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np

from ._base import Compressor, check_ratio, register
from ._kernels.select import magnitude_keys, top_indices
from ._sparse import (
    SparsePayload,
    _decompress_sparse,
    _decompress_sum_sparse,
    _error_sparse,
    _sparse_payload,
    num_selected,
)


def topk_indices(x, k: int, key=None):
    """Flat positions of the ``k`` largest ``|x|`` (exact; ties to the lowest index), int32 ``(k,)``.

    NaN counts as larger than +Inf (so NaN entries are always selected).
    Order of the result: increasing index on the common path; unspecified in
    general (the *set* is exact). See :func:`top_indices` for the algorithm.
    """
    key = jax.random.PRNGKey(0) if key is None else key
    idx, _ = top_indices(jnp.ravel(x), k, key, keys_of=magnitude_keys)
    return idx


@register("topk")
def topk(*, ratio: float, seed: int = 0) -> Compressor:
    """Top-k sparsification (GRACE Table I; Aji & Heafield 2017, Stich et al. 2018).

    Sends the ``k = max(1, round(ratio * d))`` entries of largest magnitude
    (``b_i = 1`` iff ``|x_i|`` is among the ``k`` largest, GRACE Sec. III-B),
    exactly: the selected set equals ``np.argpartition(-|x|, k-1)[:k]`` up to
    ties, and ties at the k-th magnitude go to the lowest indices, so the
    result is deterministic. Contraction: ``||x - Q(x)||^2 <= (1 - k/d) ||x||^2``.

    The selection is a sampled-threshold filter followed by an exact selection
    among the candidates, with an exact fallback (:func:`top_indices`): a few
    memory passes on CPU, where ``jax.lax.top_k`` with a large ``k`` is tens of
    passes. NaN counts as the largest magnitude (above +Inf): NaN entries are
    always sent and propagate, as they would in the dense gradient.

    Payload :class:`SparsePayload`: values in the input dtype (lossless) and
    indices in :func:`index_dtype` of ``d``. Wire bits ``k * (bits(dtype) +
    bits(index dtype))``. Biased, deterministic; strategy ``"allgather"``.

    Args:
      ratio: fraction of entries sent, in (0, 1]; ``ratio = 1`` is lossless.
      seed: seed of the optax transformation's key (used only to sample the threshold).
    """
    ratio = check_ratio(ratio, "ratio", "it fixes the number of entries sent k, an array shape")

    def compress(x, key, state):
        d = int(np.size(x))
        k = num_selected(ratio, d)
        idx = topk_indices(x, k, key)
        vals, idx = _sparse_payload(x, idx)
        return SparsePayload(values=vals, indices=idx, shape=tuple(np.shape(x)), dtype=x.dtype), state

    return Compressor.create(
        name="topk",
        compress=compress,
        decompress=_decompress_sparse,
        decompress_sum=_decompress_sum_sparse,
        compression_error=_error_sparse,
        unbiased=False,
        strategy="allgather",
        seed=seed,
        params=dict(ratio=ratio),
    )
