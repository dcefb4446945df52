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

from typing import Any, Callable, NamedTuple

import jax
import jax.numpy as jnp
import optax
from jax.sharding import Mesh, PartitionSpec as P

from ..comm import MeshAxis, use

__all__ = ["TrainState", "make_train_step", "collect_counter", "init_train_state"]


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

    step: jax.Array
    params: Any
    model_state: Any
    opt_state: Any
    key: jax.Array


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


def collect_counter(opt_state, field: str = "wire_bits") -> jax.Array:
    """Sum of every ``field`` attribute of NamedTuple states inside ``opt_state``.

    Communicating transforms record what they sent in the step in a state field
    named ``wire_bits`` (bits sent by this worker) and ``messages``; the trainer
    reports the sum. Returns float32 0 when no transform records ``field``.
    """

    def has(n):
        return hasattr(n, "_fields") and field in n._fields

    total = jnp.zeros((), jnp.float32)
    for node in jax.tree.leaves(opt_state, is_leaf=has):
        if has(node):
            total = total + jnp.asarray(getattr(node, field), jnp.float32).sum()
    return total


def _worker_step(loss_fn: LossFn, tx: optax.GradientTransformation):
    grad_fn = jax.value_and_grad(loss_fn, has_aux=True)

    def step(state: TrainState, batch) -> tuple[TrainState, dict]:
        key, sub = jax.random.split(state.key)
        (loss, (model_state, metrics)), grads = grad_fn(state.params, state.model_state, batch, sub)
        updates, opt_state = tx.update(grads, state.opt_state, state.params)
        params = optax.apply_updates(state.params, updates)
        metrics = dict(metrics)
        metrics["loss"] = loss
        metrics["wire_bits"] = collect_counter(opt_state, "wire_bits")
        metrics["messages"] = collect_counter(opt_state, "messages")
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
):
    """Build the jitted step ``(state, batch) -> (state, metrics)``.

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

    Returns:
      The jitted step. Metrics come back per worker (leading axis on a mesh):
      ``loss``, ``wire_bits``, ``messages`` and the loss function's own.
    """
    if (mesh is None) == (comm is None):
        raise ValueError("pass exactly one of mesh=... (shard_map over devices) or comm=... (one worker per process)")
    step = _worker_step(loss_fn, tx)
    donate_argnums = (0,) if donate else ()
    if comm is not None:

        def body(state, batch):
            with use(comm):
                new, metrics = step(state, batch)
                # One small allreduce so every process reports the workers' mean
                # (and the total of ``messages``), as the mesh backend's host side does.
                size = comm.size
                totals = comm.sum({k: jnp.asarray(v, jnp.float32) for k, v in metrics.items()})
                metrics = {k: (v if k == "messages" else v / size) for k, v in totals.items()}
            return new, metrics

        return jax.jit(body, donate_argnums=donate_argnums)

    if len(mesh.axis_names) != 1:
        raise ValueError(f"mesh must have exactly one axis; got {mesh.axis_names}")
    axis = mesh.axis_names[0]
    communicator = MeshAxis(axis)

    def sharded(state, batch):
        state, batch = jax.tree.map(lambda x: x[0], (state, batch))
        with use(communicator):
            new, metrics = step(state, batch)
        return jax.tree.map(lambda x: x[None], (new, metrics))

    # check_vma=False: every leaf of the state carries the worker axis, so no value is
    # replicated and the vma type system has nothing to protect here; turning it off lets
    # compressors use lax.cond/scan with constant branches without pcast boilerplate.
    f = jax.shard_map(sharded, mesh=mesh, in_specs=(P(axis), P(axis)), out_specs=(P(axis), P(axis)),
                      check_vma=True)
    return jax.jit(f, donate_argnums=donate_argnums)
