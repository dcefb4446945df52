"""eager-SGD's round on a mesh axis: the configuration, the state and the partial allreduce.

One step of the simulated partial collective: who arrives when (:func:`round_draws`), which
arrival triggers the round (:func:`round_trigger`), and what every worker contributes and
keeps (:func:`partial_allreduce`, :func:`flush`, :func:`undelivered`).
:mod:`jaxcomm.algorithms._eager_sgd` describes the delivery rules and the two clocks, and
re-exports every public name here.
"""

from __future__ import annotations

import dataclasses
from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
import numpy as np

from .._validate import check_choice, check_int, check_seed
from ..comm._partial_mpi import PARTIAL_MODES
from ..imbalance import ImbalanceModel

PyTree = Any
CLOCKS = ("reset", "carry")


@dataclasses.dataclass(frozen=True)
class EagerSGDConfig:
    """Static configuration of the simulated partial allreduce (hashable).

    Attributes:
      mode: ``"solo"``, ``"majority"`` or ``"sync"``.
      imbalance: an :class:`~jaxcomm.imbalance.ImbalanceModel` with ``num_workers == P``.
      clock: ``"reset"`` or ``"carry"`` (see the module docstring).
      comm_ms: simulated duration of the allreduce itself, ms >= 0.
      sync_every: every ``sync_every``-th round is synchronous (0: never).
      max_lag: FIFO slots per worker for the ``"carry"`` clock (>= 1).
    """

    mode: str
    imbalance: ImbalanceModel
    clock: str = "reset"
    comm_ms: float = 0.0
    sync_every: int = 0
    max_lag: int = 8

    def __post_init__(self):
        check_choice(self.mode, "mode", PARTIAL_MODES)
        if not isinstance(self.imbalance, ImbalanceModel):
            raise TypeError(
                f"imbalance must implement jaxcomm.imbalance.ImbalanceModel; got {type(self.imbalance).__name__}"
            )
        check_choice(self.clock, "clock", CLOCKS)
        c = float(self.comm_ms)
        if not np.isfinite(c) or c < 0:
            raise ValueError(f"comm_ms must be finite and >= 0; got {self.comm_ms!r}")
        object.__setattr__(self, "comm_ms", c)
        for name, lo in (("sync_every", 0), ("max_lag", 1)):
            object.__setattr__(self, name, check_int(getattr(self, name), name, lo))

    @property
    def num_workers(self) -> int:
        """``P``, the number of workers (that of the imbalance model)."""
        return self.imbalance.num_workers


class EagerSGDState(NamedTuple):
    """One worker's state of the simulated partial allreduce.

    Attributes:
      buffer: the send buffer. ``"reset"`` clock: a pytree like the gradients
        (stale gradient mass not yet delivered). ``"carry"`` clock: a FIFO, every
        leaf with a leading axis of ``max_lag`` slots.
      pending_ms: ``float32[max_lag]`` arrival time of each FIFO slot (``inf`` =
        empty); ``float32[0]`` for the ``"reset"`` clock.
      ready_ms: ``float32[P]`` time each worker starts its next compute
        (identical on every worker; all zeros for ``"reset"``).
      clock_ms: ``float32[]`` simulated wall clock: end of the last round, ms.
      step: ``int32[]`` rounds done.
      nap: ``int32[]`` number of active processes in the last round.
      active: ``bool[]`` whether this worker's fresh gradient made the last round.
      overflows: ``int32[]`` FIFO merges on this worker (``"carry"``).
      key: the PRNG key shared by all workers (imbalance draws, majority initiator).
    """

    buffer: PyTree
    pending_ms: jax.Array
    ready_ms: jax.Array
    clock_ms: jax.Array
    step: jax.Array
    nap: jax.Array
    active: jax.Array
    overflows: jax.Array
    key: jax.Array


def _as_key(key) -> jax.Array:
    if isinstance(key, (int, np.integer)) and not isinstance(key, bool):
        try:
            return jax.random.key(int(check_seed(key)))
        except (TypeError, ValueError) as e:  # the seed's message, about this argument
            raise type(e)(f"key: an int key is a seed; {e}") from None
    if isinstance(key, jax.Array) and jnp.issubdtype(key.dtype, jax.dtypes.prng_key):
        return key
    if isinstance(key, jax.Array) and key.dtype == jnp.uint32 and key.shape[-1:] == (2,):
        return jax.random.wrap_key_data(key)
    raise TypeError(f"key must be a jax PRNG key or an int seed; got {type(key).__name__}")


def init_eager_state(params: PyTree, config: EagerSGDConfig, key, comm=None) -> EagerSGDState:
    """Fresh state for one worker: empty buffer, clocks at 0.

    Args:
      params: pytree with the gradients' structure (shapes/dtypes only are used).
      config: :class:`EagerSGDConfig`.
      key: PRNG key or int seed, **the same on every worker**.
      comm: optional communicator; inside ``jax.shard_map`` pass it so the
        per-worker fields are marked device-varying (``comm.varying``), which a
        ``lax.scan`` carry over rounds requires.
    """
    p = config.num_workers
    if config.clock == "reset":
        buffer = jax.tree.map(jnp.zeros_like, params)
        pending = jnp.zeros((0,), jnp.float32)
    else:
        k = config.max_lag
        buffer = jax.tree.map(lambda x: jnp.zeros((k,) + jnp.shape(x), jnp.result_type(x)), params)
        pending = jnp.full((k,), jnp.inf, jnp.float32)
    active = jnp.zeros((), bool)
    overflows = jnp.zeros((), jnp.int32)
    if comm is not None:
        buffer, pending, active, overflows = comm.varying((buffer, pending, active, overflows))
    return EagerSGDState(
        buffer=buffer,
        pending_ms=pending,
        ready_ms=jnp.zeros((p,), jnp.float32),
        clock_ms=jnp.zeros((), jnp.float32),
        step=jnp.zeros((), jnp.int32),
        nap=jnp.zeros((), jnp.int32),
        active=active,
        overflows=overflows,
        key=_as_key(key),
    )


def round_trigger(arrive_ms: jax.Array, mode: str, initiator) -> jax.Array:
    """Time at which a round is triggered, given every worker's arrival (ms).

    ``sync``: ``max(arrive)``; ``solo``: ``min(arrive)`` (the first arrival is the
    initiator, Sec. 4.1); ``majority``: ``arrive[initiator]`` (Sec. 4.2). Workers
    with ``arrive <= trigger`` are the active processes.

    Args:
      arrive_ms: ``float[P]``.
      mode: one of :data:`jaxcomm.comm._partial_protocol.PARTIAL_MODES`.
      initiator: int32 scalar, the majority initiator (ignored otherwise).
    """
    if mode == "sync":
        return jnp.max(arrive_ms)
    if mode == "solo":
        return jnp.min(arrive_ms)
    if mode == "majority":
        return arrive_ms[initiator]
    raise ValueError(f"mode must be one of {PARTIAL_MODES}; got {mode!r}")


def round_draws(config: EagerSGDConfig, key, step) -> tuple:
    """Compute times ``float32[P]`` (ms) and majority initiator ``int32[]`` of round ``step``.

    A pure function of the shared key and the round: identical on every worker
    (the paper's shared seed, Sec. 4.2).
    """
    step = jnp.asarray(step, jnp.int32)
    k_times, k_init = jax.random.split(jax.random.fold_in(_as_key(key), step.astype(jnp.uint32)))
    times = config.imbalance.sample(k_times, step).astype(jnp.float32)
    initiator = jax.random.randint(k_init, (), 0, config.num_workers)
    return times, initiator


def partial_allreduce(grads: PyTree, state: EagerSGDState, config: EagerSGDConfig, comm) -> tuple:
    """One round of the simulated partial allreduce; returns ``(mean, new_state)``.

    ``mean = (1/P) * sum_i contribution_i`` (Algorithm 2 line 6), identical on every
    worker; see the module docstring for the contributions. Must run where
    ``comm`` is bound (inside ``shard_map``/``vmap`` over its axis); ``comm.size``
    must equal ``config.num_workers``.

    Args:
      grads: this worker's fresh gradient ``G_t^i`` (pytree).
      state: this worker's :class:`EagerSGDState`.
      config: :class:`EagerSGDConfig` (static).
      comm: a :class:`~jaxcomm.comm.Communicator` (uses ``size``, ``index``, ``sum``).
    """
    p = config.num_workers
    if comm.size != p:
        raise ValueError(f"the communicator has {comm.size} workers but the imbalance model has num_workers={p}")
    me = comm.index()
    times, initiator = round_draws(config, state.key, state.step)
    is_sync: Any = config.mode == "sync"  # a Python bool, or a traced one with sync_every
    if config.sync_every:
        is_sync = jnp.logical_or(is_sync, (state.step + 1) % config.sync_every == 0)

    if config.clock == "reset":
        arrive = times
    else:
        arrive = state.ready_ms + times
    trigger = round_trigger(arrive, config.mode, initiator)
    if config.sync_every:
        trigger = jnp.where(is_sync, jnp.max(arrive), trigger)
    active_all = arrive <= trigger
    active = active_all[me]

    if config.clock == "reset":
        contrib = jax.tree.map(lambda b, g: b + jnp.where(active, g, jnp.zeros_like(g)), state.buffer, grads)
        new_buffer = jax.tree.map(lambda g: jnp.where(active, jnp.zeros_like(g), g), grads)
        new_pending = state.pending_ms
        overflow = jnp.zeros((), bool)
        ready = state.ready_ms
        done = state.clock_ms + trigger + config.comm_ms
    else:
        slot = state.step % config.max_lag
        overflow = jnp.isfinite(state.pending_ms[slot])
        mine = arrive[me]

        def insert(fifo, g):
            old = fifo[slot]
            return fifo.at[slot].set(g + jnp.where(overflow, old, jnp.zeros_like(old)))

        fifo = jax.tree.map(insert, state.buffer, grads)
        pending = state.pending_ms.at[slot].set(mine)
        deliver = pending <= trigger

        def split(f):
            mask = deliver.reshape((-1,) + (1,) * (f.ndim - 1))
            return jnp.sum(jnp.where(mask, f, jnp.zeros_like(f)), axis=0), jnp.where(mask, jnp.zeros_like(f), f)

        pairs = jax.tree.map(split, fifo)
        contrib = jax.tree.map(lambda f, pr: pr[0], fifo, pairs)
        new_buffer = jax.tree.map(lambda f, pr: pr[1], fifo, pairs)
        new_pending = jnp.where(deliver, jnp.inf, pending)
        done = trigger + config.comm_ms
        ready = jnp.maximum(arrive, done)

    total, nap = comm.sum((contrib, active.astype(jnp.int32)))
    mean = jax.tree.map(lambda s, g: (s / p).astype(jnp.result_type(g)), total, grads)
    new_state = EagerSGDState(
        buffer=new_buffer,
        pending_ms=new_pending,
        ready_ms=ready.astype(jnp.float32),
        clock_ms=jnp.asarray(done, jnp.float32),
        step=state.step + 1,
        nap=nap.astype(jnp.int32),
        active=active,
        overflows=state.overflows + overflow.astype(jnp.int32),
        key=state.key,
    )
    return mean, new_state


def undelivered(state: EagerSGDState) -> PyTree:
    """This worker's gradient mass not yet delivered (the send buffer, or the FIFO's sum)."""
    if state.pending_ms.shape[0] == 0:
        return state.buffer
    return jax.tree.map(lambda f: jnp.sum(f, axis=0), state.buffer)


def flush(state: EagerSGDState, comm) -> tuple:
    """Deliver every worker's undelivered gradients in one synchronous round.

    Returns ``(mean, new_state)`` with ``mean = (1/P) sum_i undelivered_i`` and
    empty buffers (use at the end of training so no gradient is lost). The
    clock is not advanced.
    """
    rest = undelivered(state)
    total = comm.sum(rest)
    p = comm.size
    mean = jax.tree.map(lambda s, g: (s / p).astype(jnp.result_type(g)), total, rest)
    empty = jax.tree.map(jnp.zeros_like, state.buffer)
    pending = jnp.full_like(state.pending_ms, jnp.inf)
    return mean, state._replace(buffer=empty, pending_ms=pending)
