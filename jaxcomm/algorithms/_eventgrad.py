"""EventGraD: event-triggered neighbour exchange for decentralized SGD (Ghosh et al.).

EventGraD Eq. 3-6, Algorithm B. Every worker ``i`` keeps, for every parameter
tensor ``l``, the norm it last sent ``||x^l||_{last}`` and the iteration of that
event, a threshold ``delta^l`` and a history of the slopes at past events. At
iteration ``k`` (pass number ``p = k + 1``):

    fire  <=>  | ||x_{k,i}^l|| - ||x^l||_last |  >=  delta^l      or  k < forced_iterations   (Eq. 4-5)

On an event the tensor is sent to every neighbour (one message each), the slope
``| ||x|| - ||x||_last | / (p - p_last)`` is pushed into the history (length
``history``, initialised with zeros and averaged over its full length, as the
reference code does) and the threshold becomes

    paper rule (Eq. 6, default):  delta <- horizon * mean(slopes), kept until the next event;
    code rule (reference C++):    delta <- mean(slopes), and delta <- delta * horizon at *every*
                                  iteration before the check (compounding on non-event iterations).

Receivers keep the last received copy ``x_hat_j`` of every neighbour tensor and
average with it (Eq. 5), then take the local step with the gradient evaluated at
their own un-mixed parameters:

    x_{k+1,i} = W_ii x_{k,i} + sum_{j != i} W_ij x_hat_{k,j} - alpha g_i(x_{k,i})            (Eq. 5)

With ``horizon = 0`` every check compares against 0, every tensor fires every
iteration, and the algorithm is D-PSGD (Eq. 2) exactly.

Optional top-K (EventGraD Sec. 7, Table 2): on an event only the ``ceil(K n_l)``
entries that changed most since the last send are sent (values + int32 indices,
``2K`` of the tensor); receivers scatter them into their copy, and the sender
mirrors the scatter in ``sent_copy`` so it knows what its neighbours hold.

Backends. :meth:`EventGrad.step` exchanges on a
:class:`~jaxcomm.comm.Communicator`: a fixed-shape ``permute`` of (payload,
fire flag) per neighbour permutation, gated by the flag at the receiver, so it
is jit-able on a mesh axis and over mpi4jax; the message counts are what an
event-driven run sends. :class:`OneSidedEventGrad` runs the same
:meth:`EventGrad.prepare` / :meth:`EventGrad.finish` halves around real
one-sided MPI puts issued only when an event fires.

Initialisation: every worker's copies of its neighbours start as its *own*
initial parameters; like the reference (``torch::manual_seed(0)`` on every
rank) EventGraD assumes all workers start from the same initialisation. The
first iteration always fires (the initial threshold is 0), so without top-K the
initial copies are never used.
"""

from __future__ import annotations

import math
from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
import numpy as np
import optax

from .._validate import check_choice, check_finite_scalar, check_int, check_ratio
from ..comm import resolve
from ..comm._rma import RMAExchange
from ..topology import Topology, as_topology
from ._dpsgd import _as_optimizer, combine

__all__ = [
    "TriggerState",
    "init_trigger",
    "trigger",
    "EventGradState",
    "EventGrad",
    "eventgrad",
    "topk_count",
    "communication_stats",
    "THRESHOLD_RULES",
    "OneSidedEventGrad",
]

PyTree = Any
THRESHOLD_RULES = ("paper", "code")


# --------------------------------------------------------------------------- #
# the event trigger of one tensor (Eq. 3-6)
# --------------------------------------------------------------------------- #
class TriggerState(NamedTuple):
    """Sender-side event state of one tensor (or, field-wise, of a pytree of tensors).

    Attributes:
      last_sent_norm: ``float32 []``, ``||x||`` at the last event (Eq. 3-4; 0 before any).
      last_sent_iter: ``int32 []``, pass number (1-based iteration) of the last event (0 before any).
      threshold: ``float32 []``, ``delta`` (Eq. 6); its meaning depends on the rule (see :func:`trigger`).
      slopes: ``float32 [history]``, slopes at the last ``history`` events, oldest first (zeros before).
    """

    last_sent_norm: jax.Array
    last_sent_iter: jax.Array
    threshold: jax.Array
    slopes: jax.Array


def init_trigger(history: int = 2) -> TriggerState:
    """The trigger state before any event (all zeros; ``slopes`` has length ``history``)."""
    check_int(history, "history", 1)
    return TriggerState(
        last_sent_norm=jnp.zeros((), jnp.float32),
        last_sent_iter=jnp.zeros((), jnp.int32),
        threshold=jnp.zeros((), jnp.float32),
        slopes=jnp.zeros((history,), jnp.float32),
    )


def trigger(
    norm, state: TriggerState, step, *, horizon: float, forced_iterations: int = 30, threshold_rule: str = "paper"
) -> tuple:
    """One event check of one tensor (EventGraD Eq. 4-6, Algorithm B lines "if event").

    Args:
      norm: ``float32 []``, ``||x_k||_2`` of the tensor now.
      state: its :class:`TriggerState`.
      step: ``int32 []``, ``k``, iterations done before this one (pass number ``p = k + 1``).
      horizon: ``h >= 0``, look-ahead multiplying the mean slope.
      forced_iterations: iterations ``k < forced_iterations`` always fire (reference: 30).
      threshold_rule: ``"paper"``: ``delta`` is compared as stored, and set to ``h * mean(slopes)``
        on events (Eq. 6). ``"code"``: the reference C++ first multiplies the stored ``delta``
        by ``h`` on every iteration, compares against that, and stores ``mean(slopes)`` on events
        (so after ``m`` quiet iterations the threshold is ``mean * h**m``).

    Returns:
      ``(fire, check_threshold, new_state)``: ``bool []`` whether the tensor is sent,
      ``float32 []`` the threshold it was compared against, the updated state.
    """
    check_choice(threshold_rule, "threshold_rule", THRESHOLD_RULES)
    norm = jnp.asarray(norm, jnp.float32)
    step = jnp.asarray(step, jnp.int32)
    h = jnp.float32(horizon)
    if threshold_rule == "code":
        check = state.threshold * h
    else:
        check = state.threshold
    diff = jnp.abs(norm - state.last_sent_norm)
    fire = (diff >= check) | (step < forced_iterations)
    passes = step + 1
    slope = diff / (passes - state.last_sent_iter).astype(jnp.float32)
    slopes = jnp.where(fire, jnp.concatenate([state.slopes[1:], slope[None]]), state.slopes)
    mean_slope = jnp.mean(slopes)
    if threshold_rule == "code":
        new_thr = jnp.where(fire, mean_slope, check)
    else:
        new_thr = jnp.where(fire, h * mean_slope, state.threshold)
    new_state = TriggerState(
        last_sent_norm=jnp.where(fire, norm, state.last_sent_norm),
        last_sent_iter=jnp.where(fire, passes, state.last_sent_iter),
        threshold=new_thr.astype(jnp.float32),
        slopes=slopes,
    )
    return fire, check, new_state


# --------------------------------------------------------------------------- #
# the algorithm
# --------------------------------------------------------------------------- #
class EventGradState(NamedTuple):
    """Per-worker EventGraD state (every pytree below is shaped like ``params``, leaf by leaf).

    Attributes:
      step: ``int32 []``, iterations done.
      opt_state: the local optimizer's state.
      trigger: :class:`TriggerState` whose fields are pytrees (``[]`` / ``[history]`` leaves).
      norm: ``float32 []`` per tensor: ``||x||`` at the last check (Fig. 1/4).
      check_threshold: ``float32 []`` per tensor: the threshold of the last check (Fig. 5).
      fired: ``bool []`` per tensor: whether it was sent at the last iteration.
      events: ``int32 []`` per tensor: events so far (messages = events x neighbours).
      replicas: ``[K, *shape]`` per tensor: the last received copy from the source of each of
        the topology's ``K`` permutations (padding slots keep their initial value, weight 0).
      sent_copy: with top-K, what the neighbours hold of this worker's tensor; else ``None``.
    """

    step: jax.Array
    opt_state: optax.OptState
    trigger: TriggerState
    norm: PyTree
    check_threshold: PyTree
    fired: PyTree
    events: PyTree
    replicas: PyTree
    sent_copy: PyTree | None


def topk_count(size: int, ratio: float) -> int:
    """Entries sent by top-K of a tensor of ``size`` entries: ``ceil(ratio * size)`` (at least 1).

    Raises:
      ValueError: ``size < 0`` or ``ratio`` outside ``(0, 1]``.
    """
    size = check_int(size, "size", 0)
    ratio = check_ratio(ratio, "ratio")
    return max(1, int(math.ceil(ratio * size - 1e-9)))


class EventGrad(NamedTuple):
    """EventGraD as pure per-worker functions (build with :func:`eventgrad`).

    Attributes:
      init: ``params -> EventGradState``.
      step: ``(params, grads, state) -> (params, state)``: :attr:`prepare`, the gated
        exchange on the communicator, then :attr:`finish` (jit-able; mesh or mpi4jax).
      prepare: ``(params, state) -> (fire, payload, state)``, local: the event checks
        (Eq. 4-6) and what each tensor would send. ``fire`` is a list of ``bool []``
        (one per leaf of ``params``, in ``jax.tree.leaves`` order); ``payload`` a list of
        the leaf itself or, with top-K, ``(values [k], indices int32 [k])``.
      receive: ``(replicas_leaves, fire, payload, valid) -> replicas_leaves``: apply one
        neighbour's message (gated by ``fire & valid``) to the copies of one slot.
      finish: ``(params, grads, state, index=None) -> (params, state)``, local: Eq. 5 mixing
        with ``state.replicas`` and the optimizer step; ``index`` is this worker's index
        (default: the communicator's ``index()``; the MPI RMA backend passes its rank).
      topology, horizon, history, forced_iterations, threshold_rule, topk: the configuration.
    """

    init: Any
    step: Any
    prepare: Any
    receive: Any
    finish: Any
    topology: Topology
    horizon: float
    history: int
    forced_iterations: int
    threshold_rule: str
    topk: float | None

    def stats(self, state: EventGradState, worker: int | None = None) -> dict:
        """:func:`communication_stats` of ``state`` (stacked, or one ``worker``'s) under this configuration."""
        return communication_stats(state, self.topology, topk=self.topk, worker=worker)


def _apply_message(replica, message, fire, topk):
    """New copy of one neighbour tensor: the message if it fired (top-K: scattered), else unchanged."""
    if topk is None:
        return jnp.where(fire, message.astype(replica.dtype), replica)
    values, indices = message
    scattered = replica.reshape(-1).at[indices].set(values.astype(replica.dtype)).reshape(replica.shape)
    return jnp.where(fire, scattered, replica)


def eventgrad(
    topology: Topology | str,
    optimizer: optax.GradientTransformation | float,
    *,
    horizon: float = 1.0,
    history: int = 2,
    forced_iterations: int = 30,
    threshold_rule: str = "paper",
    topk: float | None = None,
    num_workers: int | None = None,
    axis_name: str | None = None,
    comm=None,
) -> EventGrad:
    """EventGraD (EventGraD Eq. 3-6, Algorithm B), optionally with top-K on events.

    Long because an optax factory's closures share the validated hyper-parameters; each inner function is short.

    Args:
      topology: a :class:`~jaxcomm.topology.Topology` (or a name with ``num_workers``).
      optimizer: local optimizer, or a learning rate for plain SGD (reference: 0.05).
      horizon: ``h >= 0`` in Eq. 6 (reference: 1). ``0`` reproduces D-PSGD.
      history: length of the slope history (reference: 2).
      forced_iterations: the first iterations always exchange (reference: 30; its C++ loop,
        with ``pass_num`` from 1 and ``pass_num < 30``, forces 29).
      threshold_rule: ``"paper"`` (default, Eq. 6) or ``"code"`` (the C++ compounding rule),
        see :func:`trigger`.
      topk: ``None`` (send whole tensors) or the fraction ``K`` in ``(0, 1]`` of entries sent
        on an event (the paper's Table 2 uses 0.1).
      num_workers: needed only when ``topology`` is a name.
      axis_name / comm: the communicator for :attr:`EventGrad.step` (at most one).

    Raises:
      ValueError / TypeError: a bad hyper-parameter (named); at trace time, a topology that
        does not match the number of workers.
    """
    topo = as_topology(topology, num_workers)
    tx = _as_optimizer(optimizer)
    horizon = check_finite_scalar(horizon, "horizon", nonnegative=True)
    history = check_int(history, "history", 1)
    forced_iterations = check_int(forced_iterations, "forced_iterations", 0)
    check_choice(threshold_rule, "threshold_rule", THRESHOLD_RULES)
    if topk is not None:  # None: send whole tensors
        topk = check_ratio(topk, "topk")
    communicator = resolve(axis_name, comm)
    num_slots = topo.num_permutations

    def init(params) -> EventGradState:
        leaves = jax.tree.leaves(params)
        for x in leaves:
            if not jnp.issubdtype(jnp.asarray(x).dtype, jnp.floating):
                raise TypeError(f"params must be floating point; got a leaf of dtype {jnp.asarray(x).dtype}")
        t0 = init_trigger(history)
        per_leaf = lambda v: jax.tree.map(lambda _: v, params)
        return EventGradState(
            step=jnp.zeros((), jnp.int32),
            opt_state=tx.init(params),
            trigger=TriggerState(*(per_leaf(f) for f in t0)),
            norm=per_leaf(jnp.zeros((), jnp.float32)),
            check_threshold=per_leaf(jnp.zeros((), jnp.float32)),
            fired=per_leaf(jnp.zeros((), jnp.bool_)),
            events=per_leaf(jnp.zeros((), jnp.int32)),
            replicas=jax.tree.map(lambda x: jnp.broadcast_to(x, (num_slots,) + jnp.shape(x)), params),
            sent_copy=jax.tree.map(jnp.asarray, params) if topk is not None else None,
        )

    def prepare(params, state: EventGradState):
        leaves, treedef = jax.tree.flatten(params)
        trig_leaves = [treedef.flatten_up_to(f) for f in state.trigger]
        sent_leaves: list[Any] = treedef.flatten_up_to(state.sent_copy) if topk is not None else [None] * len(leaves)
        fires, checks, norms, new_trig, payload = [], [], [], [], []
        new_sent: list[Any] = []  # the last sent copy per leaf (None without top-K)
        for i, x in enumerate(leaves):
            norm = jnp.linalg.norm(x.reshape(-1).astype(jnp.float32))
            ts = TriggerState(*(t[i] for t in trig_leaves))
            fire, check, ts = trigger(
                norm,
                ts,
                state.step,
                horizon=horizon,
                forced_iterations=forced_iterations,
                threshold_rule=threshold_rule,
            )
            fires.append(fire)
            checks.append(check)
            norms.append(norm)
            new_trig.append(ts)
            if topk is None:
                payload.append(x)
                new_sent.append(None)
            else:
                k = topk_count(x.size, topk)
                flat = x.reshape(-1)
                sent = sent_leaves[i].reshape(-1)
                _, idx = jax.lax.top_k(jnp.abs(flat - sent).astype(jnp.float32), k)
                idx = idx.astype(jnp.int32)
                values = flat[idx]
                payload.append((values, idx))
                new_sent.append(jnp.where(fire, sent.at[idx].set(values), sent).reshape(x.shape))
        unflat = lambda xs: jax.tree.unflatten(treedef, xs)
        state = state._replace(
            trigger=TriggerState(*(unflat([t[f] for t in new_trig]) for f in range(4))),
            norm=unflat(norms),
            check_threshold=unflat(checks),
            fired=unflat(fires),
            events=jax.tree.map(lambda e, f: e + f.astype(jnp.int32), state.events, unflat(fires)),
            sent_copy=unflat(new_sent) if topk is not None else None,
        )
        return fires, payload, state

    def receive(replica_leaves, fire, payload, valid):
        """Apply one slot's incoming message to its copies (lists over leaves)."""
        return [_apply_message(r, m, f & valid, topk) for r, m, f in zip(replica_leaves, payload, fire)]

    def finish(params, grads, state: EventGradState, index=None):
        treedef = jax.tree.structure(params)
        rep_leaves = treedef.flatten_up_to(state.replicas)
        received = [jax.tree.unflatten(treedef, [r[k] for r in rep_leaves]) for k in range(num_slots)]
        if index is None:
            index = communicator.index() if num_slots else 0
        mixed = combine(params, received, topo, index)
        updates, opt_state = tx.update(grads, state.opt_state, params)
        return optax.apply_updates(mixed, updates), state._replace(step=state.step + 1, opt_state=opt_state)

    def step(params, grads, state: EventGradState):
        topo.check_workers(communicator.size)
        fire, payload, state = prepare(params, state)
        treedef = jax.tree.structure(params)
        rep_leaves = treedef.flatten_up_to(state.replicas)
        index = communicator.index()
        mask = jnp.asarray(topo.receive_mask) if num_slots else jnp.zeros((0, 0), bool)
        new_slots = []
        for k, perm in enumerate(topo.permutations):
            got_fire, got_payload = communicator.permute((fire, payload), [tuple(p) for p in perm])
            slot = [r[k] for r in rep_leaves]
            new_slots.append(receive(slot, got_fire, got_payload, mask[k, index]))
        if num_slots:
            new_rep = [jnp.stack([new_slots[k][i] for k in range(num_slots)]) for i in range(len(rep_leaves))]
            state = state._replace(replicas=jax.tree.unflatten(treedef, new_rep))
        return finish(params, grads, state)

    return EventGrad(
        init, step, prepare, receive, finish, topo, horizon, history, forced_iterations, threshold_rule, topk
    )


# --------------------------------------------------------------------------- #
# message accounting
# --------------------------------------------------------------------------- #
def communication_stats(
    state: EventGradState, topology: Topology, *, topk: float | None = None, worker: int | None = None
) -> dict:
    """Messages and volume sent, against the regular algorithm (D-PSGD), as EventGraD counts them.

    Every event of a tensor sends one message to each of the worker's neighbours
    (``+2`` per event on a ring, as the reference code's ``num_events += 2``); the
    regular algorithm sends every tensor to every neighbour every iteration. With
    top-K an event sends ``2 * ceil(K n_l)`` numbers (values + indices) instead of
    ``n_l`` (Table 2's "percentage of communication").

    Args:
      state: one worker's :class:`EventGradState`, or stacked states (leading worker axis).
      topology: the topology (for the neighbour counts).
      topk: the top-K fraction used, or ``None``.
      worker: for a single (un-stacked) state, the worker it belongs to (its rank).

    Returns:
      dict of Python numbers: ``iterations``, ``tensors``, ``events``, ``messages``,
      ``regular_messages``, ``percent_messages``, ``elements_sent``, ``regular_elements``,
      ``percent_communication``, ``bytes_sent``, ``regular_bytes`` (4-byte floats and int32
      indices; per worker ``..._per_worker`` lists).
    """
    slopes = jax.tree.leaves(state.trigger.slopes)
    stacked = slopes[0].ndim == 2
    events = [np.asarray(e, np.int64) for e in jax.tree.leaves(state.events)]
    reps = jax.tree.leaves(state.replicas)
    shapes = [r.shape[2:] if stacked else r.shape[1:] for r in reps]
    itemsizes = [np.dtype(r.dtype).itemsize for r in reps]
    steps = np.asarray(state.step, np.int64).reshape(-1)
    n = steps.shape[0]
    deg = topology.degrees.astype(np.int64)
    if stacked:
        if n != topology.num_workers:
            raise ValueError(f"state holds {n} workers but the topology has {topology.num_workers}")
    else:
        if worker is None or not 0 <= int(worker) < topology.num_workers:
            raise ValueError(
                f"a single worker's state needs worker=<its index in [0, {topology.num_workers})>; got {worker!r}"
            )
        deg = deg[int(worker) : int(worker) + 1]
    events = [e.reshape(-1) for e in events]
    sizes = [int(np.prod(s, dtype=np.int64)) for s in shapes]
    cost = [2 * topk_count(s, topk) if topk is not None else s for s in sizes]
    ev_per_worker = np.sum(events, axis=0)  # [n]
    msgs = deg * ev_per_worker
    reg_msgs = deg * steps * len(sizes)
    elems = deg * np.sum([e * c for e, c in zip(events, cost)], axis=0)
    reg_elems = deg * steps * int(sum(sizes))
    byte = deg * np.sum([e * c * b for e, c, b in zip(events, cost, itemsizes)], axis=0)
    reg_byte = deg * steps * int(sum(s * b for s, b in zip(sizes, itemsizes)))
    pct = lambda a, b: float(100.0 * a / b) if b else 0.0
    return {
        "iterations": int(steps.max()),
        "tensors": len(sizes),
        "events": int(ev_per_worker.sum()),
        "messages": int(msgs.sum()),
        "regular_messages": int(reg_msgs.sum()),
        "percent_messages": pct(msgs.sum(), reg_msgs.sum()),
        "elements_sent": int(elems.sum()),
        "regular_elements": int(reg_elems.sum()),
        "percent_communication": pct(elems.sum(), reg_elems.sum()),
        "bytes_sent": int(byte.sum()),
        "regular_bytes": int(reg_byte.sum()),
        "messages_per_worker": msgs.tolist(),
        "bytes_per_worker": byte.tolist(),
    }


class OneSidedEventGrad:
    """EventGraD over MPI with one-sided puts: ``prepare`` (jit) -> RMA -> ``finish`` (jit).

    One process per worker; the state has no worker axis. The same
    :class:`EventGrad` configuration runs on a mesh through
    :meth:`EventGrad.step`.

    Args:
      algorithm: the :class:`EventGrad`.
      params: this worker's initial parameters.
      **exchange_options: ``comm``, ``lockstep``, ``timeout``, ``abort_on_fault``, ``shared_memory``
        (``False`` on an emulated link, so that the puts cross it): passed on to
        ``RMAExchange`` (the MPI windows this object exchanges through; ``jaxcomm.comm._rma``), with
        its defaults.

    >>> # under mpirun -n 4:  eg = eventgrad(ring(4), 0.05)
    >>> # ose = OneSidedEventGrad(eg, params); state = ose.init(params)
    >>> # params, state = ose.step(params, grads, state); ...; ose.free()
    """

    def __init__(self, algorithm, params, **exchange_options):
        self.algorithm = algorithm
        self.exchange = RMAExchange(algorithm, params, **exchange_options)
        # jit of the algorithm's own functions: compilations are shared by every instance.
        self._prepare = jax.jit(algorithm.prepare)
        self._finish = jax.jit(algorithm.finish, static_argnames="index")

    @property
    def rank(self) -> int:
        """This worker's index (its MPI rank)."""
        return self.exchange.rank

    def init(self, params) -> Any:
        """``algorithm.init(params)``."""
        return self.algorithm.init(params)

    def step(self, params, grads, state):
        """One EventGraD iteration (Eq. 5) with one-sided puts of the fired tensors.

        Args:
          params: this worker's parameters ``x_{k,i}``; grads: the stochastic gradient at them.
          state: its :class:`EventGradState`.

        Returns:
          ``(x_{k+1,i}, new_state)``.
        """
        fire, payload, state = self._prepare(params, state)
        fire = jax.device_get(fire)
        payload = jax.device_get(payload)
        replicas = self.exchange.exchange(fire, payload)
        treedef = jax.tree.structure(params)
        state = state._replace(replicas=jax.tree.unflatten(treedef, replicas))
        return self._finish(params, grads, state, index=self.rank)

    def stats(self, state) -> dict:
        """:func:`communication_stats` of this worker, plus measured puts and bytes."""
        out = self.algorithm.stats(state, worker=self.rank)
        out.update(
            puts=self.exchange.puts, bytes_put=self.exchange.bytes_put, exchange_seconds=self.exchange.exchange_seconds
        )
        return out

    def free(self) -> None:
        """Free the RMA window (collective)."""
        self.exchange.free()

    def __enter__(self):
        return self

    def __exit__(self, exc_type, exc, tb):
        return self.exchange.__exit__(exc_type, exc, tb)
