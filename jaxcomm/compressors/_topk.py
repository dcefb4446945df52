"""Top-k sparsification (Aji & Heafield 2017): the ``k`` largest magnitudes, exactly."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np

from .._validate import check_bool, check_int, check_ratio
from ._base import Compressor, no_state, register
from ._kernels.select import magnitude_keys, reuse_state, top_indices, top_indices_reusing
from ._sparse import SparsePayload, _sparse_payload, num_selected, sparse_compressor, sparse_hooks


def topk_indices(x, k: int, key=None):
    """Flat positions of the ``k`` largest ``|x|`` (exact; ties to the lowest index), int32 ``(k,)``.

    NaN counts as larger than +Inf (so NaN entries are always selected).
    Order of the result: increasing index for more than 2048 entries (every
    path), decreasing magnitude (ties by index) for fewer. See
    :func:`top_indices` for the algorithm.
    """
    key = jax.random.PRNGKey(0) if key is None else key
    idx, _ = top_indices(jnp.ravel(x), k, key, keys_of=magnitude_keys)
    return idx


@register("topk")
def topk(*, ratio: float, seed: int = 0, reuse_threshold: bool = False, dense_below: int = 0) -> Compressor:
    """Top-k sparsification (GRACE Table I; Aji & Heafield 2017, Stich et al. 2018).

    Long because a compressor factory's closures share the validated hyper-parameters; each inner function is short.

    Sends the ``k = max(1, round(ratio * d))`` entries of largest magnitude (all ``d`` of a
    tensor of at most ``dense_below`` entries)
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

    With ``reuse_threshold=True`` the compressor keeps, per tensor, the threshold
    of the last selection (an int32 order key, never sent) and tries it first at
    the next step (:func:`~jaxcomm.compressors._kernels.select.top_indices_reusing`):
    when the entries above it number between ``k`` and a capacity of about
    ``1.5 k`` the exact selection runs among them and the sample is skipped;
    otherwise the sampled selection runs. The payload is identical either way
    (the same indices in the same order); only the time differs. Inside
    ``jax.vmap`` both branches run, so there it costs more than it saves. The state
    makes the compressor stateful, so ``strategy="reduce_scatter"`` (chunks whose
    shapes change with the number of workers) refuses it.

    Args:
      ratio: fraction of entries sent, in (0, 1]; ``ratio = 1`` is lossless.
      seed: seed of the optax transformation's key (used only to sample the threshold).
      reuse_threshold: carry the selection threshold between steps (state per tensor:
        int32 ``(2,)``, the threshold to try, ``-1`` before the first step, and the
        number of candidates it aims at).
      dense_below: tensors of at most this many entries are sent whole (``k = d``): the
        usual practice of Deep Gradient Compression's implementations for biases and
        normalisation scales, where one selected entry of 16 would starve the layer. ``0``
        (default): every tensor is sparsified.
    """
    ratio = check_ratio(ratio, "ratio", "it fixes the number of entries sent k, an array shape")
    dense_below = check_int(dense_below, "dense_below", minimum=0)
    reuse_threshold = check_bool(reuse_threshold, "reuse_threshold")

    def payload(x, idx):
        vals, idx = _sparse_payload(x, idx)
        return SparsePayload(values=vals, indices=idx, shape=tuple(np.shape(x)), dtype=x.dtype)

    def compress(x, key, state):
        d = int(np.size(x))
        k = selected(ratio, dense_below, d)
        if d <= dense_below:  # sent whole: every index in order, no selection to compile or run
            return payload(x, jnp.arange(d, dtype=jnp.int32)), state
        if not reuse_threshold:
            return payload(x, topk_indices(x, k, key)), state
        idx, _, guess = top_indices_reusing(jnp.ravel(x), k, key, state, keys_of=magnitude_keys)
        return payload(x, idx), guess

    def init_state(x):
        d = int(np.size(x))
        return reuse_state(selected(ratio, dense_below, d), d)

    return sparse_compressor(
        "topk",
        compress,
        sparse_hooks(),
        init_state=init_state if reuse_threshold else no_state,
        seed=seed,
        stochastic=False,
        contraction=lambda d: selected(ratio, dense_below, d) / d,
        bound="Stich, Cordonnier & Jaggi 2018, Lemma A.1: ‖x − top_k(x)‖² ≤ (1 − k/d) ‖x‖², δ = k/d",
        params={
            "ratio": ratio,
            **({"reuse_threshold": True} if reuse_threshold else {}),
            **({"dense_below": dense_below} if dense_below else {}),
        },
    )


def selected(ratio: float, dense_below: int, d: int) -> int:
    """Entries top-k sends of a ``d``-entry tensor: ``d`` when ``d <= dense_below``, else
    :func:`~jaxcomm.compressors._sparse.num_selected` ``(ratio, d)``."""
    return d if d <= dense_below else num_selected(ratio, d)
