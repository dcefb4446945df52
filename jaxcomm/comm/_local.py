"""The one-worker communicator: every collective is the identity."""

from __future__ import annotations

import jax
import jax.numpy as jnp

from ._protocol import CAPABILITIES, _host_int

__all__ = ["Local"]


class Local:
    """A group of one worker (``size == 1``, ``index() == 0``): nothing is sent.

    ``sum``/``mean``/``broadcast`` return their input, ``all_gather`` stacks it
    on a new leading axis of length 1, ``reduce_scatter``/``all_to_all`` take
    the usual ``(1, *s)`` input. :func:`jaxcomm.error_feedback` and
    DoubleSqueeze's replicated server step run the transforms' pipeline on it,
    so the sum over workers is the worker's own reconstruction.
    """

    capabilities = CAPABILITIES

    rank = 0
    """The one process's rank (host side)."""

    watchdog = None
    """No watchdog: there is no other process to wait for."""

    def __repr__(self):
        return "Local()"

    def agree_min(self, value: int) -> int:
        """``value``: the only process agrees with itself."""
        return _host_int(value)

    @property
    def size(self) -> int:
        return 1

    def index(self):
        return jnp.zeros((), jnp.int32)

    def sum(self, tree):
        return tree

    def mean(self, tree):
        return tree

    def all_gather(self, tree):
        return jax.tree.map(lambda a: jnp.asarray(a)[None], tree)

    def reduce_scatter(self, tree):
        return jax.tree.map(lambda a: _one_row(a, "reduce_scatter")[0], tree)

    def all_to_all(self, tree):
        return jax.tree.map(lambda a: _one_row(a, "all_to_all"), tree)

    def broadcast(self, tree, root: int = 0):
        if root != 0:
            raise ValueError(f"root must be 0 for a one-worker communicator; got {root}")
        return tree

    def permute(self, tree, perm):
        perm = [(int(s), int(d)) for s, d in perm]
        if any(p != (0, 0) for p in perm):
            raise ValueError(f"permutation pairs must be (0, 0) for a one-worker communicator; got {perm}")
        return tree if perm else jax.tree.map(jnp.zeros_like, tree)

    def varying(self, tree):
        return tree


def _one_row(a, what: str):
    a = jnp.asarray(a)
    if a.ndim == 0 or a.shape[0] != 1:
        raise ValueError(f"{what} needs a leading axis of length 1 (the number of workers); got shape {a.shape}")
    return a
