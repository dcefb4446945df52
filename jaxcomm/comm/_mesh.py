"""Mesh-axis backend: ``jax.lax`` collectives over a named axis."""

from __future__ import annotations

from collections.abc import Sequence

import jax
import jax.numpy as jnp
import numpy as np

from ._protocol import CAPABILITIES, _check_perm, _host_int

__all__ = ["MeshAxis"]


def _is_16bit_float(dtype) -> bool:
    return jnp.issubdtype(dtype, jnp.floating) and jnp.dtype(dtype).itemsize == 2


def _unwrap_key(x):
    """(array to communicate, function restoring ``x``'s dtype): typed PRNG keys travel as key data."""
    if jax.dtypes.issubdtype(x.dtype, jax.dtypes.prng_key):
        impl = jax.random.key_impl(x)
        return jax.random.key_data(x), lambda y: jax.random.wrap_key_data(y, impl=impl)
    return x, lambda y: y


def _leading(x, n: int, what: str):
    """``x`` as an array whose leading axis has length ``n`` (``ValueError`` otherwise)."""
    x = jnp.asarray(x)
    if x.ndim == 0 or x.shape[0] != n:
        raise ValueError(
            f"{what}: every leaf must have a leading axis of length {n} (one row per worker); "
            f"got shape {tuple(x.shape)}"
        )
    return x


class MeshAxis:
    """Collectives over the named axis ``axis_name`` (see :class:`Communicator`).

    Valid inside ``jax.shard_map(..., mesh=...)`` whose mesh has the axis, and
    inside ``jax.vmap(..., axis_name=axis_name)``. Outside both, every method
    raises ``ValueError`` naming the axis. Serves every capability:

    * ``sum``/``mean`` -- ``psum``; ``all_gather`` -- ``all_gather``.
    * ``reduce_scatter`` -- ``psum_scatter`` of ``(n, *s)`` leaves (16-bit
      floats: ``all_to_all`` and a float32 sum); ``all_to_all`` -- ``all_to_all``.
    * ``broadcast`` -- a binomial tree of ``ppermute``: ``ceil(log2 n)`` rounds.
    * ``permute`` -- ``ppermute`` (partial permutations also under ``vmap``).

    >>> import jax, jax.numpy as jnp
    >>> from jaxcomm.comm import MeshAxis
    >>> c = MeshAxis("i")
    >>> jax.vmap(lambda x: c.mean(x), axis_name="i")(jnp.arange(4.0)).tolist()
    [1.5, 1.5, 1.5, 1.5]
    """

    capabilities = CAPABILITIES
    """Every collective of the vocabulary."""

    watchdog = None
    """No watchdog: the mesh's workers are driven by one program per process, no MPI step to guard."""

    def __init__(self, axis_name: str):
        if not isinstance(axis_name, str) or not axis_name:
            raise TypeError(f"axis_name must be a non-empty string; got {axis_name!r}")
        self.axis_name = axis_name

    def __repr__(self):
        return f"{type(self).__name__}({self.axis_name!r})"

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
        """The axis size ``n`` (a Python ``int``)."""
        return self._check_bound()

    @property
    def rank(self) -> int:
        """This host program's rank, ``jax.process_index()`` (``0`` on one process; host side)."""
        return int(jax.process_index())

    def agree_min(self, value: int) -> int:
        """The smallest ``value`` over the host programs (``jax.process_count()`` of them; host side)."""
        value = _host_int(value)
        if jax.process_count() == 1:
            return value
        from jax.experimental import multihost_utils

        return int(np.min(multihost_utils.process_allgather(np.int64(value))))

    def index(self):
        """This worker's position on the axis, an int32 scalar in ``[0, n)``."""
        self._check_bound()
        return jax.lax.axis_index(self.axis_name)

    def sum(self, tree):
        self._check_bound()
        return jax.lax.psum(tree, self.axis_name)

    def mean(self, tree):
        n = self._check_bound()
        return jax.tree.map(lambda s: (s / n).astype(s.dtype), jax.lax.psum(tree, self.axis_name))

    def all_gather(self, tree):
        """Every worker's ``tree`` stacked on a new leading axis (row ``i`` from worker ``i``).

        Inside ``jax.shard_map`` the result is typed device-*invariant* over the
        axis (``jax.lax.all_gather(..., to="invarying")``): every worker holds the
        same stacked array, so a value decoded from it alone (a compressed mean)
        can leave the ``shard_map`` with ``out_specs=P()``. Under ``jax.vmap``
        nothing is typed and it is the plain ``all_gather``.
        """
        self._check_bound()
        if self._is_mesh_axis():
            return jax.lax.all_gather(tree, self.axis_name, to="invarying")
        return jax.lax.all_gather(tree, self.axis_name)

    def reduce_scatter(self, tree):
        """Sum over workers of ``(n, *s)`` chunks; worker ``j`` keeps chunk ``j``, shape ``(*s)``.

        ``jax.lax.psum_scatter(x, axis, scatter_dimension=0, tiled=False)``.
        float16/bfloat16 leaves are exchanged with :meth:`all_to_all` (16 bits
        per entry on the wire) and summed locally in float32, then cast back;
        ``bool`` leaves are summed as int32 and cast back (a logical or).
        """
        n = self._check_bound()

        def one(x):
            x = _leading(x, n, "reduce_scatter")
            if _is_16bit_float(x.dtype):
                return jnp.sum(self._all_to_all_leaf(x).astype(jnp.float32), axis=0).astype(x.dtype)
            if x.dtype == jnp.bool_:
                return jax.lax.psum_scatter(x.astype(jnp.int32), self.axis_name, tiled=False).astype(jnp.bool_)
            return jax.lax.psum_scatter(x, self.axis_name, scatter_dimension=0, tiled=False)

        return jax.tree.map(one, tree)

    def all_to_all(self, tree):
        """Row ``j`` of every ``(n, *s)`` leaf goes to worker ``j``; row ``i`` of the result came from worker ``i``.

        ``jax.lax.all_to_all(x, axis, split_axis=0, concat_axis=0, tiled=False)``;
        typed PRNG keys travel as their key data.
        """
        n = self._check_bound()
        return jax.tree.map(lambda x: self._all_to_all_leaf(_leading(x, n, "all_to_all")), tree)

    def _all_to_all_leaf(self, x):
        wire, back = _unwrap_key(x)
        return back(jax.lax.all_to_all(wire, self.axis_name, 0, 0, tiled=False))

    def broadcast(self, tree, root: int = 0):
        """``root``'s value on every worker, by a binomial tree of ``ppermute``s.

        With relative ranks ``r = (index - root) mod n``, round ``k`` (``k = 0 ..
        ceil(log2 n) - 1``) sends from every ``r < 2**k`` to ``r + 2**k`` (when
        ``< n``): ``ceil(log2 n)`` rounds, ``n - 1`` transfers of the value in
        all, each receiving worker receives it once. Any ``n``, any ``root``,
        every dtype including ``bool``, integers and typed PRNG keys.
        Under ``shard_map`` the result is typed device-varying (it came from a
        ``ppermute``), though equal on every worker.
        """
        n = self._check_bound()
        root = int(root)
        if not 0 <= root < n:
            raise ValueError(f"root must be in [0, {n}); got {root}")
        if n == 1:
            return tree
        me = jax.lax.axis_index(self.axis_name)
        rel = (me - root) % n

        def one(x):
            wire, back = _unwrap_key(jnp.asarray(x))
            step = 1
            while step < n:
                pairs = [((root + r) % n, (root + r + step) % n) for r in range(step) if r + step < n]
                got = self._ppermute(wire, pairs, n, zero_unnamed=False)
                receives = (rel >= step) & (rel < 2 * step)
                wire = jnp.where(receives, got, wire)
                step *= 2
            return back(wire)

        return jax.tree.map(one, tree)

    def permute(self, tree, perm: Sequence[tuple[int, int]]):
        """Send along ``(source, destination)`` pairs; workers no pair names receive zeros.

        ``jax.lax.ppermute``. Under ``jax.vmap`` (whose ``ppermute`` accepts only
        full permutations) a partial ``perm`` is completed with the unused
        pairs and their receivers are zeroed.
        """
        n = self._check_bound()
        perm = _check_perm(perm, n)
        return jax.tree.map(lambda x: self._ppermute_keyed(x, perm, n), tree)

    def _ppermute_keyed(self, x, perm, n):
        wire, back = _unwrap_key(jnp.asarray(x))
        return back(self._ppermute(wire, perm, n))

    def _ppermute(self, x, perm, n, zero_unnamed: bool = True):
        """``ppermute`` of one array along a partial ``perm`` (zeros where no pair arrives).

        With ``zero_unnamed=False`` the workers no pair names hold unspecified
        values (for callers that discard them).
        """
        if len(perm) == n or self._is_mesh_axis():
            return jax.lax.ppermute(x, self.axis_name, perm)
        # vmap: complete to a full permutation, zero the extra receivers.
        srcs = {s for s, _ in perm}
        dsts = {d for _, d in perm}
        extra = list(zip(sorted(set(range(n)) - srcs), sorted(set(range(n)) - dsts)))
        got = jax.lax.ppermute(x, self.axis_name, perm + extra)
        if not zero_unnamed:
            return got
        me = jax.lax.axis_index(self.axis_name)
        unnamed = jnp.isin(me, jnp.asarray([d for _, d in extra], jnp.int32))
        return jnp.where(unnamed, jnp.zeros_like(got), got)

    def _is_mesh_axis(self) -> bool:
        """Whether the axis is a manual axis of the enclosing ``shard_map`` (not a ``vmap`` axis)."""
        mesh = jax.sharding.get_abstract_mesh()
        return not mesh.empty and self.axis_name in getattr(mesh, "manual_axes", ())

    def varying(self, tree):
        self._check_bound()
        try:
            return jax.tree.map(lambda x: jax.lax.pcast(x, self.axis_name, to="varying"), tree)
        except (ValueError, AssertionError):
            # Already varying over the axis, or under vmap where it does not apply
            # (jax raises AssertionError there).
            return tree
