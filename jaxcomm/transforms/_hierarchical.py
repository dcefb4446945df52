"""The hierarchical compressed mean: dense inside a node, compressed between nodes.

:func:`~jaxcomm.compressed_mean` with ``axis_name=(slow, fast)`` (JAX's tuple of mesh axes, the
slow axis first) runs, for every gradient leaf ``g`` of ``d`` entries on worker ``(a, b)`` (node
``a`` of ``N`` on the slow axis, device ``b`` of ``L`` on the fast one), with ``c = d / L``:

1. a dense reduce-scatter over the fast axis: worker ``(a, b)`` receives its shard
   ``x_{a,b} = (1/L) Σ_{b'} g_{a,b'}[b c : (b + 1) c]`` (float32 sums; the rows may travel in 16
   bits with ``fast=compressors.fp16()`` and the like, summed in float32 at the shard's owner);
2. the flat compressed mean (the pipeline, with the compressor, its memory and any strategy) of
   the shards over the slow axis only: ``y_b = (1/N) Σ_a Q⁻¹(Q(φ(m_{a,b}, x_{a,b})))``, the
   memory ``m_{a,b}`` (``c`` entries per leaf) holding this worker's shard's residual;
3. an all-gather of the ``L`` shards ``y_b`` over the fast axis (in the same format as step 1).

Only step 2 crosses the slow network, with ``1/L`` of each tensor: the slow axis carries ``L``
times fewer bytes per worker than the flat compressed mean over all ``N·L`` workers.

With ``comm=`` across processes (MPI) outside and one mesh axis inside (:class:`Outer`), the same
steps run as three compiled programs launched from the host, step 2 on one device per process.
"""

from __future__ import annotations

import dataclasses
from typing import NamedTuple

import jax
import jax.numpy as jnp
import numpy as np

from .. import compressors as compressors_lib
from .._bitcount import BitCount
from .._keys import step_keys
from .._validate import check_float_input
from ..comm import MeshAxis, is_communicator
from ..compressors import Compressor
from ._pipeline import CompressionState, check_compressor, check_per_worker, check_stateless

__all__ = ["HierarchicalState", "Hierarchy", "Outer", "check_axes", "check_outer"]


class HierarchicalState(NamedTuple):
    """Per-worker state of the hierarchical compressed mean (``axis_name=(slow, fast)``).

    Attributes:
      slow: the compressed mean's :class:`~jaxcomm.transforms.CompressionState` over the slow axis,
        for the tree of shards: every memory and compressor state leaf is a shard's, ``(d / L,)``
        for a parameter of ``d`` entries (``L`` the fast axis' size). ``slow.wire_bits[i]`` is the
        bits this worker sent over the slow axis for leaf ``i`` at the last step (the flat pipeline's
        count, see :class:`~jaxcomm.transforms.CompressionState`), plus, with
        ``skip_nonfinite=True``, the non-finite flag's 32 bits on leaf 0 (one all-reduce over both axes).
      fast: the fast axis' :class:`~jaxcomm.transforms.CompressionState`: ``fast.wire_bits[i]`` is
        the bits this worker handed to the fast axis' collectives for leaf ``i`` (the reduce-scatter's
        ``(L, d / L)`` rows and the all-gather's ``d / L`` shard, in the ``fast`` compressor's
        format), ``fast.messages`` their count; ``fast.key`` draws the ``fast`` compressor's
        randomness (stochastic rounding of :func:`~jaxcomm.compressors.half`); its memory is empty.
    """

    slow: CompressionState
    fast: CompressionState


def check_axes(axis_name, comm) -> tuple[MeshAxis, MeshAxis]:
    """``(slow, fast)`` mesh axes from ``axis_name=(slow, fast)``; ``TypeError``/``ValueError`` naming it."""
    if comm is not None:
        raise ValueError(
            f"axis_name={axis_name!r} names the two mesh axes of the hierarchical mean; pass no comm= with it"
        )
    if len(axis_name) != 2:
        raise ValueError(
            f"axis_name must be one mesh axis name or a pair (slow, fast), e.g. ('node', 'local'); "
            f"got a tuple of {len(axis_name)}: {axis_name!r}"
        )
    for name in axis_name:
        if not isinstance(name, str) or not name:
            raise TypeError(f"axis_name=(slow, fast) must hold two non-empty strings; got {axis_name!r}")
    if axis_name[0] == axis_name[1]:
        raise ValueError(f"axis_name=(slow, fast) must name two different mesh axes; got {axis_name!r}")
    return MeshAxis(axis_name[0]), MeshAxis(axis_name[1])


def check_outer(comm, axis_name, skip_nonfinite: bool):
    """``(slow, fast)`` for ``comm=`` across processes outside and the mesh axis ``axis_name`` inside.

    Raises:
      ValueError: ``comm`` is a mesh axis (the same one: pass one; another: the tuple form), has no
        host-side ``rank`` (a communicator across processes has one), or ``skip_nonfinite=True`` (not
        served by this form).
      TypeError: ``axis_name`` is not a non-empty string; ``comm`` is not a communicator.
    """
    if not isinstance(axis_name, str) or not axis_name:
        raise TypeError(
            f"axis_name must be a mesh axis name (a non-empty string) or a pair (slow, fast); got {axis_name!r}"
        )
    if isinstance(comm, MeshAxis) and comm.axis_name == axis_name:
        raise ValueError(
            f"pass at most one of axis_name=... or comm=...: comm={comm!r} and axis_name={axis_name!r} name the "
            "same mesh axis"
        )
    if isinstance(comm, MeshAxis):
        raise ValueError(
            f"comm={comm!r} with axis_name={axis_name!r}: two mesh axes are written axis_name=(slow, fast), "
            f"e.g. axis_name=({comm.axis_name!r}, {axis_name!r}), the slow axis first"
        )
    if not is_communicator(comm):
        raise TypeError(
            f"comm must implement jaxcomm.comm.Communicator (e.g. jaxcomm.comm.MPIComm()); got {type(comm).__name__}"
        )
    if not isinstance(getattr(comm, "rank", None), int):
        raise ValueError(
            f"comm={comm!r} with axis_name={axis_name!r} is the hierarchical mean with a communicator across "
            "processes outside and a mesh axis inside (one process per node): comm must be one, with a host-side "
            "rank (e.g. jaxcomm.comm.MPIComm())"
        )
    if skip_nonfinite:
        raise ValueError(
            f"skip_nonfinite=True is not served with comm={comm!r} outside and the mesh axis {axis_name!r} inside; "
            "pass skip_nonfinite=False, or axis_name=(slow, fast) on one mesh"
        )
    return comm, MeshAxis(axis_name)


class Outer:
    """The hierarchical mean with a communicator across processes outside (MPI) and a mesh axis inside.

    ``update`` runs on the host, not under ``jax.jit``: it launches three compiled programs per step,

    1. a ``jax.shard_map`` over the process's devices (the mesh axis): the keys and the dense reduce-scatter
       (:meth:`Hierarchy.keys`, :meth:`Hierarchy.scatter`);
    2. one program on the process's first device: the slow step (the flat pipeline over ``comm``) of each of
       the ``L`` shards in turn, ``b = 0 .. L − 1`` (the same order in every process, so the communicator's
       collectives match);
    3. a ``jax.shard_map`` again: the all-gather and the fast state (:meth:`Hierarchy.finish`).

    MPI collectives (mpi4jax) carry an ordered effect, which JAX compiles for one device per program only:
    hence step 2 on one device, apart from the mesh's collectives.

    Args:
      hierarchy: the :class:`Hierarchy` with ``slow = comm`` and ``fast`` the mesh axis.
      slow_step: ``(shard_tree, slow_state) -> (mean_tree, slow_state)``, the pipeline over ``comm``.
      flat_init: ``params -> CompressionState`` for the shard tree.
    """

    def __init__(self, hierarchy: Hierarchy, slow_step, flat_init):
        self.hierarchy, self.slow_step, self.flat_init = hierarchy, slow_step, flat_init
        self.axis = hierarchy.fast.axis_name
        self._programs: dict = {}

    def mesh(self) -> jax.sharding.Mesh:
        """The process's devices (``jax.local_devices()``) as a 1-D mesh over the fast axis."""
        return jax.sharding.Mesh(np.array(jax.local_devices()), (self.axis,))

    def init(self, params) -> HierarchicalState:
        """Every device's state, stacked: each leaf ``(L, ...)``, row ``b`` device ``b``'s (``params``: one copy)."""
        mesh = self.mesh()
        with jax.set_mesh(mesh):
            state = HierarchicalState(self.flat_init(self.hierarchy.shards(params)), self.hierarchy.init_fast(params))
        n = mesh.devices.size
        return jax.tree.map(lambda v: jnp.broadcast_to(v, (n, *jnp.shape(v))), state)

    def _check(self, updates, state, mesh):
        n = mesh.devices.size
        for path, g in jax.tree_util.tree_flatten_with_path(updates)[0]:
            if isinstance(g, jax.core.Tracer):
                raise ValueError(
                    f"updates{jax.tree_util.keystr(path)} is traced: with comm= across processes and the mesh axis "
                    f"{self.axis!r} inside, update launches three compiled programs (the MPI collectives run on one "
                    "device apart from the mesh's): call it outside jax.jit and jax.shard_map, on the per-device "
                    "gradients stacked on a leading axis"
                )
            if jnp.ndim(g) == 0 or jnp.shape(g)[0] != n:
                raise ValueError(
                    f"updates{jax.tree_util.keystr(path)} has shape {tuple(jnp.shape(g))}: with the mesh axis "
                    f"{self.axis!r} inside, every leaf holds the gradients of the process's {n} devices stacked on "
                    f"a leading axis of length {n}"
                )
        if not isinstance(state, HierarchicalState):
            raise TypeError(
                f"state must be the HierarchicalState of this transformation's init; got {type(state).__name__}"
            )
        rows = jax.tree.map(lambda g: jax.ShapeDtypeStruct(jnp.shape(g)[1:], jnp.result_type(g)), updates)
        with jax.set_mesh(mesh):
            want = jax.eval_shape(lambda: self.flat_init(self.hierarchy.shards(rows, "update")))
            self.hierarchy.check_state(jax.tree.map(lambda v: v[0], state), want)

    def update(self, updates, state: HierarchicalState, params=None, **extra_args):
        """``(means, new_state)``: ``updates`` and ``means`` hold one row per device of this process (leaves
        ``(L, *shape)``, every row of ``means`` the same mean), the state as :meth:`init` stacks it."""
        del params, extra_args
        mesh = self.mesh()
        self._check(updates, state, mesh)
        scatter, slow, finish = self._compiled(mesh)
        sharded = jax.sharding.NamedSharding(mesh, jax.sharding.PartitionSpec(self.axis))
        updates, fast = jax.device_put((updates, state.fast), sharded)
        shards = scatter(updates, fast)
        first = jax.local_devices()[0]
        means, slow_state = slow(*jax.device_put((shards, state.slow), first))
        return finish(jax.device_put(means, sharded), updates, fast, jax.device_put(slow_state, sharded))

    def _compiled(self, mesh):
        if "programs" in self._programs:
            return self._programs["programs"]
        h, axis, n = self.hierarchy, self.axis, mesh.devices.size
        spec = jax.sharding.PartitionSpec(axis)

        def per_device(fn):
            def body(*args):
                out = fn(*jax.tree.map(lambda v: v[0], args))
                return jax.tree.map(lambda v: v[None], out)

            return jax.jit(jax.shard_map(body, mesh=mesh, in_specs=spec, out_specs=spec, check_vma=True))

        def scatter(updates, fast):
            leaves = jax.tree.leaves(updates)
            _, keys = h.keys(leaves, fast)
            return jax.tree.unflatten(jax.tree.structure(updates), h.scatter(leaves, keys)[0])

        def finish(means, updates, fast, slow):
            from ._pipeline import if_finite

            def step(u, state):
                leaves = jax.tree.leaves(u)
                key, keys = h.keys(leaves, state.fast)
                return h.finish(u, state, key, keys, h.row_bits(leaves), means, state.slow)

            return if_finite(h.fast, updates, HierarchicalState(slow, fast), step, skip=False)

        @jax.jit
        def slow(shards, states):
            outs = [self.slow_step(*jax.tree.map(lambda v, b=b: v[b], (shards, states))) for b in range(n)]
            return jax.tree.map(lambda *rows: jnp.stack(rows), *outs)

        self._programs["programs"] = (per_device(scatter), slow, per_device(finish))
        return self._programs["programs"]


def _fast_format(fast) -> Compressor:
    """``fast`` checked: a dense, stateless, single-round compressor whose payload is summed whole."""
    fast = compressors_lib.none() if fast is None else check_compressor(fast, "fast")
    check_stateless(fast, "fast", "the fast axis' reduce-scatter")
    probe = jax.ShapeDtypeStruct((8,), jnp.float32)
    payload, _ = jax.eval_shape(lambda x: fast.compress(x, jax.random.PRNGKey(0), ()), probe)
    summable = tuple(getattr(type(payload), "summable", ()))
    dense = (
        fast.strategy == "allreduce"
        and len(summable) == 1
        and getattr(payload, summable[0]).shape == probe.shape
        and jnp.issubdtype(getattr(payload, summable[0]).dtype, jnp.floating)
    )
    if not dense:
        raise ValueError(
            f"fast must be a dense format summed entry by entry (jaxcomm.compressors.none(), fp16(), bf16() or "
            f"half(none())); got {fast!r}"
        )
    return fast


class Hierarchy:
    """The fast axis' part of the hierarchical mean: shards in (reduce-scatter), means out (all-gather).

    Args:
      slow, fast: the two mesh axes (:func:`check_axes`).
      fast_format: the fast axis' wire format, a dense summable compressor (default ``none()``: float32).
    """

    def __init__(self, slow: MeshAxis, fast: MeshAxis, fast_format=None):
        self.slow, self.fast = slow, fast
        self.format = _fast_format(fast_format)
        probe = jax.ShapeDtypeStruct((1,), jnp.float32)
        self.field = type(
            jax.eval_shape(lambda x: self.format.compress(x, jax.random.PRNGKey(0), ()), probe)[0]
        ).summable[0]

    def __repr__(self):
        slow = getattr(self.slow, "axis_name", self.slow)
        return f"Hierarchy(slow={slow!r}, fast={self.fast.axis_name!r}, format={self.format!r})"

    def fast_size(self, where: str) -> int:
        """``L``, the fast axis' size: where the axis is bound, else from the mesh of ``jax.set_mesh``.

        Raises:
          ValueError: neither (naming the axis and ``where``).
        """
        name = self.fast.axis_name
        try:
            return int(jax.lax.axis_size(name))
        except (NameError, KeyError, ValueError):
            pass
        mesh = jax.sharding.get_abstract_mesh()
        if not mesh.empty and name in mesh.axis_names:
            return int(dict(mesh.shape)[name])
        raise ValueError(
            f"{where} needs the size of the fast axis {name!r} (each worker keeps 1/size of every tensor): call it "
            f"inside the jax.shard_map over the mesh, or under `with jax.set_mesh(mesh):` for a mesh with an axis "
            f"{name!r}"
        )

    def shards(self, params, where: str = "init"):
        """``params`` with every leaf replaced by its shard's shape: zeros ``(d / L,)`` in the leaf's dtype.

        Raises:
          ValueError: a leaf's size is not divisible by ``L`` (naming the leaf and the axis).
        """
        n = self.fast_size(where)
        leaves, treedef = jax.tree_util.tree_flatten_with_path(params)
        out = []
        for path, x in leaves:
            check_float_input(x, "params", nonempty=True)
            d = int(np.size(x))
            if d % n:
                raise ValueError(
                    f"params{jax.tree_util.keystr(path)} has {d} entries (shape {tuple(jnp.shape(x))}), not divisible "
                    f"by the size {n} of the fast axis {self.fast.axis_name!r}: the hierarchical mean splits every "
                    f"tensor into {n} equal shards"
                )
            out.append(jnp.zeros((d // n,), jnp.result_type(x)))
        return jax.tree_util.tree_unflatten(treedef, out)

    def init_fast(self, params) -> CompressionState:
        """The fast axis' state: a key, the bit counts per leaf; no memory."""
        leaves, treedef = jax.tree.flatten(params)
        return CompressionState(
            count=jnp.zeros((), jnp.int32),
            key=jax.random.PRNGKey(self.format.seed),
            memory=treedef.unflatten([() for _ in leaves]),
            compressor_states=tuple(() for _ in leaves),
            wire_bits=BitCount.zeros((len(leaves),)),
            messages=jnp.zeros((), jnp.int32),
            notfinite_count=jnp.zeros((), jnp.int32),
        )

    def scatter(self, leaves, keys):
        """Step 1: ``(shards, bits, messages)``; shard ``b`` of each leaf is ``(1/L) Σ_{b'} g_{b'}`` there.

        Each leaf's ``(L, d / L)`` rows go through the ``fast`` format (row ``r`` with ``keys[i][r]``)
        and the payload's summed field is reduce-scattered (:meth:`~jaxcomm.comm.MeshAxis.reduce_scatter`:
        float32 sums; 16-bit rows are summed in float32 at the owner and rounded once); the shard is the
        decoded sum divided by ``L``, in the leaf's dtype. The bits are the rows' (``L · d / L`` entries).
        """
        n = self.fast.size
        if n > 1:
            check_per_worker(self.fast, leaves)
        shards = []
        for g, k in zip(leaves, keys):
            rows = jnp.reshape(g, (n, -1))
            payload = jax.vmap(lambda r, kr: self.format.compress(r, kr, ())[0])(rows, k[:n])
            field = getattr(payload, self.field)
            summed = self.fast.reduce_scatter(field)
            first = jax.tree.map(lambda a: a[0], payload)
            total = self.format.decompress(dataclasses.replace(first, **{self.field: summed}))
            shards.append((total.astype(jnp.float32) / n).astype(jnp.result_type(g)))
        return shards, self.row_bits(leaves), len(leaves)

    def row_bits(self, leaves) -> list:
        """The bits :meth:`scatter` hands the fast axis for each leaf (its ``(L, d / L)`` rows in the ``fast``
        format), from the shapes alone."""
        n = self.fast_size("update")
        key = jax.random.PRNGKey(0)
        out = []
        for g in leaves:
            rows = jax.ShapeDtypeStruct((n, int(np.size(g)) // n), jnp.result_type(g))
            payload = jax.eval_shape(jax.vmap(lambda r: self.format.compress(r, key, ())[0]), rows)
            out.append(_bits([getattr(payload, self.field)]))
        return out

    def gather(self, shards, leaves, keys):
        """Step 3: ``(means, bits, messages)``: every worker's shard in the ``fast`` format (drawn with
        ``keys[i][L]``), all-gathered and decoded, in the leaf's shape and dtype."""
        n = self.fast.size
        outs, bits, messages = [], [], 0
        for y, g, k in zip(shards, leaves, keys):
            payload, _ = self.format.compress(y, k[n], ())
            rows = jax.vmap(self.format.decompress)(self.fast.all_gather(payload))
            outs.append(jnp.reshape(rows, jnp.shape(g)).astype(jnp.result_type(g)))
            bits.append(_bits(jax.tree.leaves(payload)))
            messages += len(jax.tree.leaves(payload))
        return outs, bits, messages

    def check_state(self, state, want) -> None:
        """``TypeError``/``ValueError`` unless ``state`` is a :class:`HierarchicalState` whose slow part has
        the shapes of ``want`` (the slow state for this step's shards, from ``jax.eval_shape``)."""
        if not isinstance(state, HierarchicalState):
            raise TypeError(
                f"state must be the HierarchicalState of this transformation's init; got {type(state).__name__}"
            )
        got = [tuple(jnp.shape(a)) for a in jax.tree.leaves((state.slow.memory, state.slow.compressor_states))]
        expect = [tuple(a.shape) for a in jax.tree.leaves((want.memory, want.compressor_states))]
        if got != expect:
            raise ValueError(
                f"state: the memories and compressor states have shapes {got}, but shards of the fast axis "
                f"{self.fast.axis_name!r} (size {self.fast_size('update')}) need {expect}: init and update must see "
                "the same tree and the same fast axis size"
            )

    def keys(self, leaves, fast: CompressionState):
        """``(next_key, keys)``: ``next_key, step_key = split(fast.key)`` (``fast``: the fast axis' state);
        leaf ``i`` draws its rows and its gathered shard from
        ``keys[i] = split(fold_in(split(step_key, num_leaves)[i], a·L + b), L + 1)`` (worker ``(a, b)``:
        ``a = slow.index()``, ``b = fast.index()``)."""
        n, me = self.fast.size, self.slow.index() * self.fast.size + self.fast.index()
        key, leaf_keys = step_keys(fast.key, len(leaves))
        return key, [jax.random.split(jax.random.fold_in(k, me), n + 1) for k in leaf_keys[: len(leaves)]]

    def step(self, updates, state: HierarchicalState, slow_step):
        """One hierarchical step: ``(means, new_state)``; ``slow_step(shard_tree, slow_state)`` is step 2
        (keys: :meth:`keys`)."""
        leaves, treedef = jax.tree.flatten(updates)
        key, keys = self.keys(leaves, state.fast)
        shards, rs_bits, _ = self.scatter(leaves, keys)
        means, slow = slow_step(treedef.unflatten(shards), state.slow)
        return self.finish(updates, state, key, keys, rs_bits, means, slow)

    def finish(self, updates, state: HierarchicalState, key, keys, rs_bits, means, slow):
        """Step 3 and the new state: ``(means in the leaves' shapes, HierarchicalState(slow, fast))`` from the slow
        step's ``means`` (the shard tree) and state ``slow``; ``rs_bits`` the bits of step 1 (:meth:`scatter`)."""
        leaves, treedef = jax.tree.flatten(updates)
        outs, ag_bits, ag_messages = self.gather(jax.tree.leaves(means), leaves, keys)
        fast = state.fast._replace(
            count=state.fast.count + 1,
            key=key,
            wire_bits=BitCount.stack([a + b for a, b in zip(rs_bits, ag_bits)]) if leaves else BitCount.zeros((0,)),
            messages=jnp.asarray(len(leaves) + ag_messages, jnp.int32),
        )
        return treedef.unflatten(outs), HierarchicalState(slow, fast)


def _bits(arrays) -> BitCount:
    return BitCount.of(sum(int(np.size(a)) * jnp.dtype(a.dtype).itemsize * 8 for a in arrays))


class Grid:
    """Both axes as one group, for the step's non-finite flag: ``size = N·L``, ``sum`` one all-reduce."""

    def __init__(self, hierarchy: Hierarchy):
        self.axes = (hierarchy.slow.axis_name, hierarchy.fast.axis_name)
        self.parts = (hierarchy.slow, hierarchy.fast)

    @property
    def size(self) -> int:
        return self.parts[0].size * self.parts[1].size

    def sum(self, tree):
        return jax.lax.psum(tree, self.axes)
