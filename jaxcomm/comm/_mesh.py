"""Mesh-axis backend: ``jax.lax`` collectives over a named axis."""

from __future__ import annotations

from typing import Sequence

import jax
import jax.numpy as jnp

__all__ = ["MeshAxis"]


class MeshAxis:
    """Collectives over the named axis ``axis_name`` (see :class:`Communicator`).

    Valid inside ``jax.shard_map(..., mesh=...)`` whose mesh has the axis, and
    inside ``jax.vmap(..., axis_name=axis_name)``. Outside both, every method
    raises ``ValueError`` naming the axis.

    >>> import jax, jax.numpy as jnp
    >>> from jaxcomm.comm import MeshAxis
    >>> c = MeshAxis("i")
    >>> jax.vmap(lambda x: c.mean(x), axis_name="i")(jnp.arange(4.0)).tolist()
    [1.5, 1.5, 1.5, 1.5]
    """

    def __init__(self, axis_name: str):
        if not isinstance(axis_name, str) or not axis_name:
            raise TypeError(f"axis_name must be a non-empty string; got {axis_name!r}")
        self.axis_name = axis_name

    def __repr__(self):
        return f"MeshAxis({self.axis_name!r})"

    def _check_bound(self) -> int:
        try:
            return int(jax.lax.axis_size(self.axis_name))
        except (NameError, KeyError, ValueError) as e:
            raise ValueError(
                f"axis name {self.axis_name!r} is not bound here: call inside jax.shard_map over a mesh "
                f"with an axis {self.axis_name!r}, or inside jax.vmap(..., axis_name={self.axis_name!r})"
            ) from e

    @property
    def size(self) -> int:
        return self._check_bound()

    def index(self):
        self._check_bound()
        return jax.lax.axis_index(self.axis_name)

    def sum(self, tree):
        self._check_bound()
        return jax.lax.psum(tree, self.axis_name)

    def mean(self, tree):
        n = self._check_bound()
        return jax.tree.map(lambda s: (s / n).astype(s.dtype), jax.lax.psum(tree, self.axis_name))

    def all_gather(self, tree):
        self._check_bound()
        return jax.lax.all_gather(tree, self.axis_name)

    def broadcast(self, tree, root: int = 0):
        n = self._check_bound()
        if not 0 <= root < n:
            raise ValueError(f"root must be in [0, {n}); got {root}")
        me = jax.lax.axis_index(self.axis_name)

        def one(x):
            # Only root contributes; the sum of one non-zero term is exact.
            x = jnp.asarray(x)
            keep = jnp.where(me == root, x, jnp.zeros_like(x))
            if jnp.issubdtype(x.dtype, jnp.bool_):
                return jax.lax.psum(keep.astype(jnp.int32), self.axis_name).astype(jnp.bool_)
            return jax.lax.psum(keep, self.axis_name)

        return jax.tree.map(one, tree)

    def permute(self, tree, perm: Sequence[tuple[int, int]]):
        n = self._check_bound()
        perm = [(int(s), int(d)) for s, d in perm]
        for s, d in perm:
            if not (0 <= s < n and 0 <= d < n):
                raise ValueError(f"permutation pair {(s, d)} is out of range for {n} workers")
        return jax.lax.ppermute(tree, self.axis_name, perm)

    def varying(self, tree):
        self._check_bound()
        try:
            return jax.tree.map(lambda x: jax.lax.pcast(x, self.axis_name, to="varying"), tree)
        except (ValueError, AssertionError):
            # Already varying over the axis, or under vmap where it does not apply
            # (jax raises AssertionError there).
            return tree
