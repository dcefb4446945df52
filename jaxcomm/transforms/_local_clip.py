"""Deep Gradient Compression's local gradient clipping (Lin et al. 2018, Sec. 3.3).

Clipping the *summed* gradient of ``N`` workers to norm ``thr`` cannot be done
before the sum is known, and with sparse communication it never is. DGC clips
every worker's own gradient before it is accumulated instead, with the
threshold scaled by ``N^{-1/2}``: the sum of ``N`` independent gradients of
norm ``thr / sqrt(N)`` has a norm of about ``thr``. :func:`clip_leaves` is the
arithmetic (shared with :func:`~jaxcomm.transforms.gradient_dropping`'s
``clip_norm``), :func:`local_clip` the optax transformation.
"""

from __future__ import annotations

import math

import jax
import jax.numpy as jnp
import optax

from .._validate import check_finite_scalar
from ..comm import resolve

__all__ = ["local_clip", "clip_leaves"]


def clip_leaves(leaves: list, max_norm: float, n: int) -> list:
    """``leaves`` rescaled to global L2 norm at most ``max_norm / sqrt(n)``.

    With ``‖g‖ = sqrt(Σ_leaves Σ_entries g²)`` (one norm over every leaf, accumulated
    in float32 or wider) and ``τ = max_norm / sqrt(n)``:

        g ← g                  if ‖g‖ < τ
        g ← g · τ / ‖g‖        otherwise

    Args:
      leaves: this worker's gradient leaves (floating arrays, any shapes).
      max_norm: the clipping threshold of the summed gradient, ``thr`` (> 0).
      n: the number of workers ``N`` (a Python int).
    Returns:
      The clipped leaves, each with its own shape and dtype.
    """
    threshold = max_norm / math.sqrt(n)
    norm = optax.tree.norm(leaves)
    return [jnp.where(norm < threshold, g, (g / norm.astype(g.dtype)) * threshold).astype(g.dtype) for g in leaves]


def local_clip(max_norm: float, *, axis_name: str | None = None, comm=None) -> optax.GradientTransformationExtraArgs:
    """DGC's local gradient clipping: each worker's gradient to global norm at most ``max_norm / sqrt(N)``.

    Per worker, over the whole gradient tree ``g`` (all leaves together),

        g ← g · min(1, (max_norm / sqrt(N)) / ‖g‖₂)

    where ``N`` is the size of the communicator (``axis_name``, ``comm``, or the
    ambient one of :func:`jaxcomm.comm.use`), read when the step is traced. Nothing
    is communicated. Put it first in the chain, before the accumulation
    (:func:`~jaxcomm.transforms.deep_gradient_compression` does).

    Args:
      max_norm: ``thr``, the norm the summed gradient of the ``N`` workers is meant to
        stay under; a finite number > 0.
      axis_name: the mesh axis the workers are on (inside ``jax.shard_map`` or
        ``jax.vmap(axis_name=...)``).
      comm: a :class:`~jaxcomm.comm.Communicator` instead (e.g. MPI).
    Returns:
      An optax transformation with ``optax.EmptyState``; ``update`` maps a tree to a
      tree of the same shapes and dtypes.
    Raises:
      ValueError: ``max_norm`` not finite or ``<= 0``; both ``axis_name`` and ``comm``.
      TypeError: ``max_norm`` not a real number; ``comm`` not a communicator.
    """
    max_norm = check_finite_scalar(max_norm, "max_norm", positive=True)
    communicator = resolve(axis_name, comm)

    def init(params):
        del params
        return optax.EmptyState()

    def update(updates, state, params=None, **extra_args):
        del params, extra_args
        leaves, treedef = jax.tree.flatten(updates)
        n = int(communicator.size)  # raises ValueError naming the axis where it is not bound
        return treedef.unflatten(clip_leaves(leaves, max_norm, n)), state

    return optax.GradientTransformationExtraArgs(init, update)
