"""Compressed data-parallel gradient mean: GRACE Algorithm 1 on a communicator.

The pipeline (:mod:`._pipeline`) with the workers' communicator: every worker
compensates, compresses and sends its payload, and receives the mean of the
decompressed payloads, identical on every worker.
"""

from __future__ import annotations

import itertools
from collections.abc import Sequence

import jax
import jax.numpy as jnp
import numpy as np
import optax

from .. import compressors as compressors_lib
from .. import memory as memory_lib
from .._validate import check_bool, check_int
from .._vma import typed_switch
from ..comm import Communicator, resolve
from ..compressors import Compressor
from ._checks import (
    check_compressor,
    check_feedback,
    check_memory,
    check_served,
    check_skip_nonfinite,
    choose_strategy,
    sums_in_16_bits,
)
from ._collectives import FUSE_MAX_BYTES
from ._hierarchical import Grid, HierarchicalState, Hierarchy, Outer, check_axes, check_outer
from ._pipeline import compress_step, if_finite
from ._state import CompressionState, init_state
from ._strategies import STRATEGIES, Owner

__all__ = ["FUSE_MAX_BYTES", "STRATEGIES", "compressed_mean"]


def compressed_mean(
    compressor: Compressor,
    axis_name: str | tuple[str, str] | None = None,
    *,
    comm=None,
    memory: memory_lib.Memory | None = None,
    strategy: str = "auto",
    fuse: bool = True,
    warmup: Sequence[tuple[int, Compressor]] = (),
    skip_nonfinite: bool = False,
    fast: Compressor | None = None,
) -> optax.GradientTransformationExtraArgs:
    """Mean of the workers' gradients, communicated compressed (GRACE Algorithm 1).

    Long because an optax factory's closures share the validated hyper-parameters; each inner function is short.

    An optax transformation whose ``update`` runs on every worker (inside
    ``jax.shard_map`` over ``axis_name``, inside ``jax.vmap(axis_name=...)``,
    or in every MPI process with ``comm=MPIComm()``) and returns, per leaf,

        ḡ = output_scale · (1/n) Σ_i Q⁻¹(Q(φ(m_i, g_i)))

    identical on every worker; chain an optimizer after it (its state is then
    replicated). Per tensor: compensate → compress → communicate → decompress →
    average → memory update ``m_i ← ψ(m_i, g_i, Q(φ_i))`` with this worker's
    own reconstruction (for PowerSGD's rounds, the aggregated one: GRACE's and
    PyTorch's convention).

    Strategies (GRACE Sec. IV-B; :mod:`jaxcomm.transforms` has the details):
      * ``"allreduce"``: the payloads' ``summable`` fields are summed with one
        all-reduce and decompressed once, ``Q⁻¹(Σ_i g̃_i)/n`` (none, fp16,
        random-k with a shared key: fields not summed must agree, so such
        compressors draw with the *shared* key). A compressor with ``rounds``
        (PowerSGD) runs them, every tensor's round ``r`` at once. With ``fuse``
        (default), the fields and round messages of at most :data:`FUSE_MAX_BYTES`
        share one all-reduce per dtype (:func:`~jaxcomm.comm._packing.sum_packed`): PowerSGD
        sends two messages per step instead of two per matrix.
      * ``"allgather"``: every worker's payload is gathered and decompressed.
        With ``fuse`` (default), payloads of at most :data:`FUSE_MAX_BYTES`
        share one collective (Horovod's tensor fusion); the numbers and bytes
        are identical either way, only the count of collectives changes.
      * ``"broadcast"``: each worker's payload is broadcast in turn.
      * ``"reduce_scatter"``: chunks travel compressed to their owners, who
        average in float32 and compress again; the compressed chunks are
        all-gathered (stateless single-round compressors).
      * ``"auto"``: the compressor's own ``strategy``; except that a 16-bit
        ``"allreduce"`` payload (fp16, bf16) with a memory that keeps the compression
        error (``residual``, ``efsignsgd``) takes ``"reduce_scatter"``, the same bytes
        as a ring all-reduce, so that the sum is taken in float32 and the owners'
        rounding of the average is fed back too (error feedback then conserves the
        gradient exactly, up to float32 sums).

    Under ``"reduce_scatter"`` with such a memory, the owner of each chunk adds
    ``n (mean − Q(mean))`` (its re-compression's rounding) to its own memory on that
    chunk, so ``Σ_i m_i + n ḡ = Σ_i φ_i`` holds after every step.

    Randomness: ``state.key`` starts at ``PRNGKey(compressor.seed)`` on every
    worker; each step ``key, step_key = split(key)`` and leaf ``i`` gets
    ``k_i = split(step_key, num_leaves)[i]``; a worker compresses with
    ``fold_in(k_i, comm.index())`` (with one worker: ``k_i``), or with ``k_i``
    itself where workers must agree (shared payload fields, rounds). Under
    ``"reduce_scatter"`` chunk ``c`` is compressed with ``split(k, n)[c]``, and
    the owners draw from ``fold_in(fold_in(k_i, n), owner)``.

    Wire volume: ``state.wire_bits[i]`` is the exact bits this worker sent for
    leaf ``i`` at the last step (its payload; under ``"allreduce"`` only the
    summed fields; for rounds, every message).

    Warm-up stages (``warmup``): ``((s_0, Q_0), (s_1, Q_1), ...)`` runs ``Q_0`` for the
    first ``s_0`` steps, ``Q_1`` for the next ``s_1``, and so on, then ``compressor``:
    at step ``t = state.count``, stage ``j`` is the one with ``S_j <= t < S_{j+1}``
    (``S_0 = 0``, ``S_{j+1} = S_j + s_j``). Deep Gradient Compression's exponential
    sparsity warm-up is ``warmup=topk_warmup(...)`` (top-k at densities 25 %, 6.25 %, ...).
    Every phase is its own compiled branch of the pipeline, and one ``lax.switch`` on
    the step count (the same on every worker) picks the branch; all phases share the
    one state, so the memory (DGC's ``u`` and ``v``) carries across the stage
    boundaries. A compressor with a dense warm-up (``dense_warmup``) runs it first, as a
    branch of the same switch, then the stages. Why stages and not one top-k with a
    traced ``k``: ``jax.lax.top_k`` and a payload's shape need a static ``k``; each stage
    sends exactly its own ``k`` values and indices and ``state.wire_bits`` counts exactly
    those, for the price of a handful of compiled branches. A single fixed-capacity
    buffer with a traced threshold would send the capacity's bytes during the early,
    denser stages whatever their ``k`` (a capacity sized for the first stage), or need
    the counted all-gather of variable-length payloads.

    Non-finite gradients (``skip_nonfinite``): with ``True``, every worker flags whether its
    gradient has a NaN or Inf, the flags are summed (one extra all-reduce of an int32 per
    step: 32 bits in ``state.wire_bits[0]``, one more in ``state.messages``), and if any
    worker's is not finite, *all* workers skip the step together: the output is zeros on
    every worker (so the parameters stay identical and unchanged), nothing else is sent, and
    the state (count, key, memories, compressor states) stays as it was, so the following
    steps are those of the run without that step; ``state.notfinite_count`` counts the
    skipped steps. With ``False`` (default; no extra collective) a non-finite gradient is
    compressed and sent as it is: the mean is not finite at that step and, with a memory
    that keeps the error, at later steps too (the memory keeps the non-finite entries);
    ``state.notfinite_count`` counts the steps at which this worker's gradient was not finite.

    Two networks (``axis_name=(slow, fast)``, JAX's tuple of mesh axes, the slow axis first, e.g.
    ``("node", "local")`` on a 2-D mesh of ``N`` nodes × ``L`` devices): every leaf of ``d``
    entries (``d`` divisible by ``L``) is reduce-scattered densely over the fast axis, so worker
    ``(a, b)`` holds the local mean of shard ``b``, ``x_{a,b} = (1/L) Σ_{b'} g_{a,b'}[b·d/L : (b+1)·d/L]``;
    the pipeline above (the compressor, ``memory``, ``strategy``, ``warmup``) runs on the shards over
    the slow axis only, ``y_b = (1/N) Σ_a Q⁻¹(Q(φ(m_{a,b}, x_{a,b})))``; and the ``L`` shards
    ``y_b`` are all-gathered over the fast axis. The result is the flat route's on the shards: with
    an exact compressor, the plain mean over all ``N·L`` workers. Each worker's memory holds its
    shard's residual (``d/L`` entries), and the slow axis carries ``1/L`` of the flat route's bytes
    per worker. With ``memory=residual()``, ``N·L Σ_t ḡ_t + L Σ_{a,b} m_{a,b} = Σ_t Σ_{a,b} g_{a,b,t}``
    (the memories placed on their shards; exact up to float32 sums where the slow route feeds every
    rounding back). ``fast`` is the fast axis' format: ``none()`` (float32, the default), or
    ``fp16()``, ``bf16()``, ``half(none())`` to send the rows and the gathered shards in 16 bits
    (rows summed in float32 at the shard's owner and rounded once; these roundings are not fed
    back). The state is a :class:`~jaxcomm.transforms._hierarchical.HierarchicalState`: ``state.slow`` (the
    shards' :class:`~jaxcomm.transforms.CompressionState`, ``wire_bits`` on the slow axis) and
    ``state.fast`` (``wire_bits`` on the fast axis). ``init`` needs the fast axis' size: call it
    under ``with jax.set_mesh(mesh):`` (or inside the ``shard_map``).

    MPI outside, a mesh axis inside (``comm=MPIComm()`` with ``axis_name="local"``, one process per
    node): the same three steps, the slow axis being ``comm`` (its rank ``a``) and the fast one the axis
    over the process's ``L = jax.local_device_count()`` devices; process ``a``'s device ``b`` gets what
    worker ``(a, b)`` of the 2-D form gets. ``init(params)`` returns every device's state stacked on a
    leading axis of ``L``; ``update(updates, state)`` takes every leaf as ``(L, *shape)`` (row ``b``:
    device ``b``'s gradient) and returns the means in that layout. ``update`` runs from the host, not
    under ``jax.jit``: mpi4jax's collectives carry an ordered effect, which JAX compiles for one device
    per program only, so a step is three programs (a ``shard_map`` reduce-scatter, the pipeline of the
    ``L`` shards over ``comm`` on the first local device, in the same order in every process, a
    ``shard_map`` all-gather). Not with ``skip_nonfinite=True``.

    Pitfall: inside ``jax.shard_map``, ``jax.grad`` of replicated parameters
    silently sums the gradient over the axis; cast the parameters first with
    ``jax.lax.pcast(params, axis, to="varying")``. Where jax tracks it
    (``shard_map`` with ``check_vma=True``) an already-summed gradient raises
    ``ValueError`` here instead of being compressed after the fact.

    Args:
      compressor: a :class:`~jaxcomm.compressors.Compressor`.
      axis_name: the mesh axis to average over (e.g. ``"data"``), or two, ``(slow, fast)``, for the
        hierarchical mean (above).
      comm: a :class:`~jaxcomm.comm.Communicator` instead (e.g.
        ``jaxcomm.comm.MPIComm()``); with ``axis_name`` (one name), the communicator across processes
        outside that mesh axis (above). With neither, the ambient communicator of
        ``jaxcomm.comm.use(...)`` is used when the step is traced.
      memory: a :class:`~jaxcomm.memory.Memory`; default
        :func:`~jaxcomm.memory.none` (pass ``residual()`` for error feedback).
      strategy: ``"auto"`` or one of :data:`STRATEGIES`.
      fuse: all-gather the payloads up to :data:`FUSE_MAX_BYTES` with one
        collective, and all-reduce the summed arrays up to that size with one per
        dtype (default); or every payload (array) with its own.
      warmup: ``(steps, Compressor)`` pairs run, in order, before ``compressor``
        (default: none). Every stage's compressor must keep the same per-tensor
        state as ``compressor`` (stateless top-k stages around a stateless top-k),
        take no dense warm-up of its own, and have a strategy the communicator
        serves (``strategy="auto"`` resolves per stage); ``steps`` an integer ``>= 1``.
      skip_nonfinite: skip a step, on every worker, when some worker's gradient is not
        finite (above); default ``False``. With ``axis_name=(slow, fast)`` the flags are summed
        over both axes (one all-reduce, counted in ``state.slow.wire_bits[0]``).
      fast: with ``axis_name=(slow, fast)`` or ``comm`` outside ``axis_name`` only: the fast axis' format, a
        dense compressor summed
        entry by entry (``none()``, the default; ``fp16()``, ``bf16()``, ``half(none())``).
    Returns:
      ``GradientTransformationExtraArgs`` with per-worker state
      :class:`~jaxcomm.transforms.CompressionState` (with ``axis_name=(slow, fast)``:
      :class:`~jaxcomm.transforms._hierarchical.HierarchicalState`).
    Raises:
      ValueError: at ``init``, a memory that needs a contraction (``Memory.needs_contraction``)
        around an unbiased compressor whose variance factor is ``ω ≥ 1`` at a tensor's size (it
        would diverge; :func:`jaxcomm.compressors.contractive` scales it into a contraction),
        or around one that declares ``no_contraction`` (signsgd, signum).
      ValueError: unknown ``strategy``; ``"allreduce"`` for a compressor whose
        payloads cannot be summed; a communicator that cannot serve the
        strategy; both ``axis_name`` and ``comm``; (at trace time) the axis is
        not bound, the tree differs from ``init``'s, or the gradient was
        already summed over the axis.
      ValueError: a ``warmup`` stage whose compressor keeps another state than
        ``compressor`` (at build time on a probe tensor, at ``init`` per tensor), whose
        strategy cannot be served, or with ``steps < 1``; the message names ``warmup[j]``.
      TypeError: wrong types for ``compressor``, ``memory``, ``comm``, ``fuse``,
        ``skip_nonfinite`` or ``warmup`` (not a sequence of ``(int, Compressor)`` pairs).
      ValueError: ``axis_name=(slow, fast)`` not two different non-empty names (``TypeError`` for
        names that are not strings), given with ``comm``; ``fast`` not a dense summed format, or
        given with one axis and no ``comm``; ``comm`` a mesh axis with ``axis_name`` (write the tuple),
        or without a host-side ``rank``, or with ``skip_nonfinite=True``; ``update`` of that form
        traced, or a leaf without the leading axis of ``L``; at ``init``, the fast
        axis' size unknown (no ``jax.set_mesh`` and not bound) or a leaf not divisible by it; at
        trace time, an axis not bound, or a state made for another fast axis size.
    """
    compressor = check_compressor(compressor, dense_warmup=True)
    memory = memory_lib.none() if memory is None else check_memory(memory)
    hierarchy = None
    outer = axis_name is not None and comm is not None and not isinstance(axis_name, tuple)
    comm_obj: Communicator
    skip = check_skip_nonfinite(skip_nonfinite)
    if isinstance(axis_name, tuple) or outer:
        slow_comm, fast_axis = check_outer(comm, axis_name, skip) if outer else check_axes(axis_name, comm)
        hierarchy = Hierarchy(slow_comm, fast_axis, fast)
        comm_obj = hierarchy.slow
    else:
        if fast is not None:
            raise ValueError(
                f"fast= is the fast axis' format of the hierarchical mean, axis_name=(slow, fast) or a communicator "
                f"outside (comm=) with a mesh axis inside (axis_name=); got axis_name={axis_name!r}"
            )
        comm_obj = resolve(axis_name, comm)
    fuse = check_bool(fuse, "fuse")
    stages = check_warmup(warmup, compressor)
    main = _Phase(compressor, strategy, memory, None)
    phases = [_Phase(c, strategy, memory, f"warmup[{j}]") for j, (c, _) in enumerate(stages)] + [main]
    if axis_name is not None or comm is not None:
        for phase in phases:
            phase.check_served(comm_obj)
    # The steps at which the next phase begins: after the compressor's dense warm-up (if any), then after
    # each stage in turn (cumulative counts of steps).
    dense_steps = compressor.dense_warmup
    ends = list(itertools.accumulate([dense_steps] + [steps for _, steps in stages]))
    bounds = ends if dense_steps else ends[1:]
    dense = compressors_lib.none()
    no_memory = memory_lib.none()

    def init_fn(params):
        if hierarchy is not None:  # the slow axis' state holds the shards' memories; the fast axis' the bits
            return HierarchicalState(flat_init(hierarchy.shards(params)), hierarchy.init_fast(params))
        return flat_init(params)

    def flat_init(params):
        state = init_state(params, compressor, memory)
        leaves = jax.tree.leaves(params)
        for j, (c, _) in enumerate(stages):
            check_feedback(c, memory, [int(np.size(x)) for x in leaves])
            for x in leaves:
                want = jax.eval_shape(compressor.init_state, jax.ShapeDtypeStruct(jnp.shape(x), jnp.result_type(x)))
                got = jax.eval_shape(c.init_state, jax.ShapeDtypeStruct(jnp.shape(x), jnp.result_type(x)))
                if jax.tree.structure(got) != jax.tree.structure(want) or jax.tree.leaves(got) != jax.tree.leaves(want):
                    raise ValueError(
                        f"warmup[{j}]: compressor {c!r} keeps a per-tensor state {got} for a tensor of shape "
                        f"{tuple(jnp.shape(x))}, but the main compressor {compressor!r} keeps {want}; the stages "
                        "share the state, so every stage's compressor must keep the same state structure"
                    )
        return state

    def step(updates, state: CompressionState):
        n = int(comm_obj.size)

        def branch(phase: _Phase):
            return lambda _: phase.step(comm_obj, updates, state, n, fuse)

        branches = [branch(phase) for phase in phases]
        if dense_steps:

            def dense_step(_):
                # The uncompressed mean (with fuse, the small tensors share one all-reduce); memory and
                # compressor states untouched.
                plain = state._replace(compressor_states=tuple(() for _ in state.compressor_states))
                done = compress_step(
                    comm_obj, updates, plain, compressor=dense, memory=no_memory, strategy="allreduce", fuse=fuse
                )
                kept = done.state._replace(memory=state.memory, compressor_states=state.compressor_states)
                return done.output(), kept

            branches = [dense_step, *branches]
        # The phase of this step: how many boundaries the count has passed (the same on every worker, so
        # every worker takes the same branch and runs the same collectives).
        index = sum((state.count >= b).astype(jnp.int32) for b in bounds) if bounds else jnp.zeros((), jnp.int32)
        return typed_switch(index, branches)

    def update_fn(updates, state: CompressionState, params=None, **extra_args):
        del params, extra_args
        _ = int(comm_obj.size)  # raises ValueError naming the axis where it is not bound
        for phase in phases:
            phase.check_served(comm_obj)
        if hierarchy is None:
            return if_finite(comm_obj, updates, state, step, skip=skip)
        _ = hierarchy.fast.size  # raises ValueError naming the fast axis where it is not bound
        hierarchy.check_state(state, jax.eval_shape(lambda: flat_init(hierarchy.shards(updates, "update"))))
        return if_finite(Grid(hierarchy), updates, state, lambda u, s: hierarchy.step(u, s, step), skip=skip)

    if outer:  # MPI outside, the mesh axis inside: three programs per step, run from the host
        assert hierarchy is not None
        program = Outer(hierarchy, step, flat_init)
        return optax.GradientTransformationExtraArgs(program.init, program.update)
    return optax.GradientTransformationExtraArgs(init_fn, update_fn)


def check_warmup(warmup, compressor: Compressor) -> list[tuple[Compressor, int]]:
    """``warmup`` as ``[(compressor, steps)]``; ``TypeError``/``ValueError`` naming ``warmup`` otherwise.

    Every stage: ``(steps, Compressor)`` with ``steps`` an integer ``>= 1``, a compressor without a dense
    warm-up of its own, and (probed on a small float32 tensor) the main compressor's state structure.
    """
    if isinstance(warmup, (str, bytes)) or not isinstance(warmup, Sequence):
        raise TypeError(
            f"warmup must be a sequence of (steps, Compressor) pairs, e.g. jaxcomm.transforms.topk_warmup(...); "
            f"got {type(warmup).__name__}"
        )
    stages: list[tuple[Compressor, int]] = []
    probe = jax.ShapeDtypeStruct((64,), jnp.float32)
    want = jax.eval_shape(compressor.init_state, probe) if len(warmup) else None
    for j, stage in enumerate(warmup):
        if not isinstance(stage, tuple) or len(stage) != 2:
            raise TypeError(f"warmup[{j}] must be a (steps, Compressor) pair; got {stage!r}")
        steps, c = stage
        steps = check_int(steps, f"warmup[{j}] steps", minimum=1, why="it is a phase boundary of the step")
        c = check_compressor(c, f"warmup[{j}] compressor")
        got = jax.eval_shape(c.init_state, probe)
        if jax.tree.structure(got) != jax.tree.structure(want) or jax.tree.leaves(got) != jax.tree.leaves(want):
            raise ValueError(
                f"warmup[{j}]: compressor {c!r} keeps a per-tensor state {got} (for a tensor of 64 entries), but "
                f"the main compressor {compressor!r} keeps {want}; the stages share the state, so every stage's "
                "compressor must keep the same state structure (stateless sparsifiers such as top-k do)"
            )
        stages.append((c, steps))
    return stages


class _Phase:
    """One compiled branch of :func:`compressed_mean`: the pipeline with one compressor.

    Holds the compressor's strategy (``"auto"`` resolved for it), whether the owners' rounding is fed
    back (``"reduce_scatter"`` with a memory that keeps the error) and the memory's output scale.
    """

    def __init__(self, compressor: Compressor, strategy: str, memory: memory_lib.Memory, where: str | None):
        self.where = where  # "warmup[j]" for a stage: prefixed to its errors
        try:
            chosen = choose_strategy(compressor, strategy)
        except ValueError as e:
            raise self._named(e) from None
        feeds_back = memory.from_error is not None  # the memory is the compression error itself
        if strategy == "auto" and feeds_back and sums_in_16_bits(compressor):
            # A 16-bit all-reduce rounds the sum where no memory sees it; the reduce-scatter route (the same
            # bytes as a ring all-reduce) sums in float32 at the chunks' owners, who feed the rounding back.
            chosen = "reduce_scatter"
        self.compressor = compressor
        self.memory = memory
        self.chosen = chosen
        self.fold = chosen == "reduce_scatter" and feeds_back
        self.scale = float(memory.output_scale)

    def _named(self, error: ValueError) -> ValueError:
        return error if self.where is None else ValueError(f"{self.where}: {error}")

    def check_served(self, comm) -> None:
        """``ValueError`` (naming the stage) if ``comm`` cannot run this phase's strategy."""
        try:
            check_served(comm, self.chosen, self.compressor)
        except ValueError as e:
            raise self._named(e) from None

    def step(self, comm, updates, state: CompressionState, n: int, fuse: bool):
        compressor, no_memory = self.compressor, memory_lib.none()

        def owner_step(keys):
            return Owner(compressor, no_memory, [()] * len(keys), [jax.random.fold_in(k, n) for k in keys], self.fold)

        done = compress_step(
            comm,
            updates,
            state,
            compressor=compressor,
            memory=self.memory,
            strategy=self.chosen,
            fuse=fuse,
            owner_step=owner_step if self.chosen == "reduce_scatter" else None,
        )
        new_state = done.state
        if done.owner is not None:  # "reduce_scatter"
            if self.fold:  # this worker owns a chunk of each tensor: n (mean − Q(mean)) joins its memory there
                new_state = new_state._replace(
                    memory=jax.tree.map(jnp.add, new_state.memory, done.treedef.unflatten(done.owner.memory))
                )
            if done.owner.bits:  # the chunks sent, then the averaged chunk
                new_state = new_state._replace(wire_bits=new_state.wire_bits + done.owner.wire_bits())
        return done.output(self.scale), new_state
