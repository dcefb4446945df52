"""The jit-compiled training step: per-worker gradient -> transform chain -> update.

The step is the same function on every backend. On a device mesh it runs inside
``jax.shard_map`` with every leaf of the :class:`TrainState` carrying a leading
worker axis split over the mesh axis; over MPI (one device per process) it is a
plain ``jax.jit`` of the per-worker function. Either way the optimizer's
communicating transforms (``compressed_mean``, ``doublesqueeze``, ...) talk
through the ambient communicator that the step installs with
:func:`jaxcomm.comm.use`, so users change the launcher, not their optimizer.
"""

from __future__ import annotations

import functools
import weakref
from collections.abc import Callable
from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
import optax
from jax.sharding import Mesh
from jax.sharding import PartitionSpec as P

from .._bitcount import BitCount
from .._validate import check_bool
from ..comm import MeshAxis, all_gather_packed, use
from ..comm._packing import sum_packed
from ..transforms._accumulate import warn_multisteps
from ..transforms._layout import map_per_worker
from ..transforms._schedule import tracing_schedule

__all__ = ["TrainState", "ScheduledStep", "make_train_step", "collect_counter", "init_train_state"]


class TrainState(NamedTuple):
    """Everything a step reads and writes (per worker).

    Attributes:
      step: int32 scalar, steps taken.
      params: the model parameters (pytree).
      model_state: non-parameter model variables updated by the forward pass
        (e.g. normalisation statistics); may be an empty pytree.
      opt_state: the optax state, including every error-feedback memory and
        server error of the communicating transforms.
      key: raw ``uint32[2]`` PRNG key of this worker (dropout, stochastic compressors).
    """

    # Typed Any: a TrainState of PartitionSpecs (state_specs) has the same fields.
    step: Any
    params: Any
    model_state: Any
    opt_state: Any
    key: Any


LossFn = Callable[[Any, Any, Any, jax.Array], tuple[jax.Array, tuple[Any, dict]]]


def init_train_state(params, model_state, tx: optax.GradientTransformation, key) -> TrainState:
    """A worker's initial :class:`TrainState` (``tx.init(params)`` and step 0)."""
    return TrainState(
        step=jnp.zeros((), jnp.int32),
        params=params,
        model_state=model_state,
        opt_state=tx.init(params),
        key=jnp.asarray(key, jnp.uint32),
    )


def collect_counter(opt_state, field: str = "wire_bits") -> jax.Array | BitCount:
    """Every ``field`` attribute of NamedTuple states inside ``opt_state``, as one vector.

    Communicating transforms record what they sent in the step in a state field
    named ``wire_bits`` (bits sent by this worker per tensor, a
    :class:`~jaxcomm.BitCount`) and ``messages`` (int32). The counts are
    concatenated, not summed, and the host reads them exactly
    (``np.asarray(counts)``, int64; the trainer does). ``wire_bits`` comes back as a
    ``BitCount`` (also when a user's transform records plain integer counts), any
    other field as an int32 vector. Empty (shape ``(0,)``) when no transform records ``field``.
    """

    def has(n):
        return hasattr(n, "_fields") and field in n._fields

    values = [getattr(node, field) for node in jax.tree.leaves(opt_state, is_leaf=has) if has(node)]
    if field == "wire_bits" or any(isinstance(v, BitCount) for v in values):
        return BitCount.concatenate([BitCount.of(v).reshape(-1) for v in values]) if values else BitCount.zeros((0,))
    parts = [jnp.ravel(jnp.asarray(v)).astype(jnp.int32) for v in values]
    return jnp.concatenate(parts) if parts else jnp.zeros((0,), jnp.int32)


def _worker_step(loss_fn: LossFn, tx: optax.GradientTransformation):
    grad_fn = jax.value_and_grad(loss_fn, has_aux=True)

    def step(state: TrainState, batch) -> tuple[TrainState, dict]:
        warn_multisteps(state.opt_state, refuse=True)  # at trace time: MultiSteps would communicate every micro-step
        key, sub = jax.random.split(state.key)
        (loss, (model_state, metrics)), grads = grad_fn(state.params, state.model_state, batch, sub)
        updates, opt_state = tx.update(grads, state.opt_state, state.params)
        params = optax.apply_updates(state.params, updates)
        metrics = dict(metrics)
        metrics["loss"] = loss
        metrics["wire_bits"] = collect_counter(opt_state, "wire_bits")  # per tensor: summed on the host
        metrics["messages"] = collect_counter(opt_state, "messages").sum()
        new = TrainState(state.step + 1, params, model_state, opt_state, key)
        return new, metrics

    return step


def make_train_step(
    loss_fn: LossFn,
    tx: optax.GradientTransformation,
    *,
    mesh: Mesh | None = None,
    comm=None,
    donate: bool = True,
    state_specs=None,
    gather_metrics: bool = True,
):
    """Build the jitted step ``(state, batch) -> (state, metrics)``.

    Long because the step's specs, its donated state and its jitted body come from the same checked arguments;
    each inner function is short.

    Args:
      loss_fn: ``(params, model_state, batch, key) -> (loss, (model_state, metrics))``
        for ONE worker's batch; ``metrics`` is a dict of scalars.
      tx: any optax transformation; communicating transforms built without an
        explicit axis or communicator use the step's.
      mesh: a 1-D device mesh (see :func:`make_mesh`). The state and batch carry
        a leading worker axis of the mesh's size, split over its axis.
      comm: instead of ``mesh``, a communicator (e.g. ``jaxcomm.comm.MPIComm()``)
        for one worker per process; state and batch have no worker axis.
      donate: donate the input state's buffers (the step updates in place).
      state_specs: on a mesh, where each part of the state lives: a
        :class:`TrainState` of ``PartitionSpec`` (a pytree prefix of the state;
        default every field ``P(axis)``). ``P(axis)``: the leaves carry the leading
        worker axis, one slice per worker (device-varying in the step). ``P()``:
        one replicated copy without a worker axis (device-invariant in the step),
        which must come out identical on every worker. The step runs with
        ``check_vma=True``, so jax checks these types at trace time. Replicated
        (``P()``) parameters go to ``jax.grad`` as they are, so their gradient
        comes back summed over the axis; the communicating transforms refuse such
        a gradient (``ValueError``, "is not device-varying"), plain optax
        optimizers apply it (``sum``, not mean, of the workers' gradients).
      gather_metrics: with ``comm``, report every worker's metrics at every step: two
        small collectives (an all-gather of the bit counts, an all-reduce of the rest)
        that also make every process wait for the slowest at every step. ``False``:
        each process reports its own worker's metrics, and a step whose optimizer
        sends nothing (local SGD's and DiLoCo's inner steps) runs no collective at
        all: the step is then a :class:`ScheduledStep`, whose quiet program (no
        branch of a scheduled transform that communicates, so over MPI no ordered
        effect and JAX's fast dispatch) runs those steps. On a mesh the metrics
        come back per worker without a collective either way.

    Returns:
      The jitted step (with ``comm`` and ``gather_metrics=False``, a
      :class:`ScheduledStep` called the same way). Metrics come back per worker (leading axis on a mesh):
      ``loss``, ``wire_bits`` (per-tensor :class:`~jaxcomm.BitCount` counts, :func:`collect_counter`;
      with ``comm``, every worker's, gathered: ``[workers, tensors]``; with
      ``gather_metrics=False``, this worker's: ``[1, tensors]``), ``messages`` (with
      ``comm``, the workers' total; with ``gather_metrics=False``, this worker's) and
      the loss function's own (with ``comm``, the workers' mean; else this worker's).
    """
    if (mesh is None) == (comm is None):
        raise ValueError("pass exactly one of mesh=... (shard_map over devices) or comm=... (one worker per process)")
    gather_metrics = check_bool(gather_metrics, "gather_metrics")
    step = _worker_step(loss_fn, tx)
    donate_argnums = (0,) if donate else ()
    if comm is not None and not gather_metrics:  # this worker's own metrics: no collective beyond the optimizer's

        def own(state, batch, quiet: bool):
            with use(comm), tracing_schedule(quiet) as schedule:
                new, metrics = step(state, batch)
            metrics["wire_bits"] = BitCount.stack([metrics["wire_bits"]])
            return new, metrics, schedule.quiet_next()

        return ScheduledStep(own, donate_argnums)
    if comm is not None:

        def body(state, batch):
            with use(comm):
                new, metrics = step(state, batch)
                # One small allreduce so every process reports the workers' mean
                # (and the total of ``messages``), as the mesh backend's host side does.
                # Two collectives whatever the metrics: one packed all-gather, one all-reduce.
                size = comm.size
                bits = all_gather_packed(comm, metrics.pop("wire_bits"))  # BitCount [workers, tensors], exact
                (totals,), _ = sum_packed(comm, [{k: jnp.asarray(v, jnp.float32) for k, v in metrics.items()}])
                metrics = {k: (v if k == "messages" else v / size) for k, v in totals.items()}
                metrics["wire_bits"] = bits
            return new, metrics

        return jax.jit(body, donate_argnums=donate_argnums)

    assert mesh is not None  # exactly one of mesh and comm, checked above
    if len(mesh.axis_names) != 1:
        raise ValueError(f"mesh must have exactly one axis; got {mesh.axis_names}")
    axis = mesh.axis_names[0]
    communicator = MeshAxis(axis)

    specs = _state_specs(state_specs, axis)

    def squeeze(tree, add: bool):
        return map_per_worker((lambda x: x[None]) if add else (lambda x: x[0]), specs, tree, axis)

    def sharded(state, batch):
        state, batch = squeeze(state, add=False), jax.tree.map(lambda x: x[0], batch)
        with use(communicator):
            new, metrics = step(state, batch)
        return squeeze(new, add=True), jax.tree.map(lambda x: x[None], metrics)

    # check_vma=True: jax tracks which values vary over the axis, so a replicated (P())
    # leaf that came out different on some worker is a trace-time error, and
    # compressed_mean's guard sees a gradient jax.grad already summed over the axis.
    f = jax.shard_map(sharded, mesh=mesh, in_specs=(specs, P(axis)), out_specs=(specs, P(axis)), check_vma=True)
    return jax.jit(f, donate_argnums=donate_argnums)


class ScheduledStep:
    """The step over a communicator with per-worker metrics, as two compiled programs.

    ``full`` takes every branch of the transforms' schedules (DiLoCo's ``lax.switch`` between its
    inner step and its sync); ``quiet`` is the same step traced with every scheduled transform on
    its no-communication branch (:mod:`jaxcomm.transforms._schedule`), so it holds none of their
    collectives. Over MPI this matters beyond the branch: a program holding an mpi4jax collective
    carries an ordered JAX effect, and JAX dispatches such a program through its Python path
    (thousands of Python calls and a runtime token per call) where an effect-free one takes its C++
    fast path.

    Each program also returns whether no scheduled transform communicates at the next step. A call
    runs ``quiet`` only when its ``state`` holds, leaf for leaf, the very optimizer state the previous
    call returned, that call's report said so, and the report is already computed (it never waits for
    the device); otherwise ``full``, which is right at every step. Where the two may run, they
    compute the same numbers. Without a scheduled transform in the chain only ``full`` runs. The
    reports depend on the optimizer state only, so the check is on ``state.opt_state``'s leaves: a
    state with other parameters (a callback's averaging) keeps the schedule, one with another
    optimizer state (a restored checkpoint, a new ``init``) runs ``full``.

    Call it as the jitted step, ``(state, batch) -> (state, metrics)``. ``calls`` counts the calls
    of each program (``{"full": n, "quiet": m}``); ``lower(state, batch)`` lowers ``full``.
    """

    def __init__(self, body: Callable, donate_argnums: tuple[int, ...]):
        self.full = jax.jit(functools.partial(body, quiet=False), donate_argnums=donate_argnums)
        self.quiet = jax.jit(functools.partial(body, quiet=True), donate_argnums=donate_argnums)
        self.calls = {"full": 0, "quiet": 0}
        self._last: tuple[list, Any] | None = None  # (weak refs to the returned state's leaves, its report)

    def __call__(self, state, batch):
        quiet = self._quiet_for(state)
        new, metrics, quiet_next = (self.quiet if quiet else self.full)(state, batch)
        self.calls["quiet" if quiet else "full"] += 1
        refs = [weakref.ref(x) for x in jax.tree.leaves(new.opt_state)]
        self._last = None if quiet_next is None else (refs, quiet_next)
        return new, metrics

    def _quiet_for(self, state) -> bool:
        """Whether ``state``'s optimizer state is the last call's output (the reports depend on it only)
        and that call reported a quiet next step."""
        if self._last is None:
            return False
        refs, quiet_next = self._last
        leaves = jax.tree.leaves(state.opt_state)
        same = len(leaves) == len(refs) and all(r() is x for r, x in zip(refs, leaves))
        return same and quiet_next.is_ready() and bool(quiet_next)

    def lower(self, state, batch):
        """``full.lower(state, batch)``: the program that is right at every step (ahead-of-time
        compilation, inspection)."""
        return self.full.lower(state, batch)


def _state_specs(state_specs, axis: str) -> TrainState:
    """The step's :class:`TrainState` of specs (default all ``P(axis)``), each field ``P(axis)`` or ``P()``."""
    if state_specs is None:
        return TrainState(*(P(axis),) * len(TrainState._fields))
    if not isinstance(state_specs, TrainState):
        raise TypeError(f"state_specs must be a TrainState of PartitionSpecs; got {type(state_specs).__name__}")
    for name, spec in zip(TrainState._fields, state_specs):
        for leaf in jax.tree.leaves(spec, is_leaf=lambda x: isinstance(x, P)):
            if leaf not in (P(axis), P()):
                raise ValueError(f"state_specs.{name}: every spec must be P({axis!r}) or P(); got {leaf!r}")
    return state_specs
