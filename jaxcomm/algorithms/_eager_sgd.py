"""eager-SGD: solo and majority partial allreduce, simulated on a mesh axis (Li et al., PPoPP 2020).

This is the *semantics* of the partial collectives inside one jit-compiled step,
for convergence studies: the workers run in lockstep on a mesh axis (inside
``jax.shard_map`` or ``jax.vmap(axis_name=...)``), and which of them made it into
each allreduce is decided by a load-imbalance model
(:mod:`jaxcomm.imbalance`) and a key shared by all workers. The asynchronous
implementation over real processes is :class:`jaxcomm.comm.PartialAllreduce`
(MPI, a progress thread per process); both have the same delivery rules.

Round ``t`` (Algorithm 2, Sec. 4-5 of the paper):

* every worker ``i`` computes ``G_t^i`` and *arrives* at the collective after its
  compute time ``c_i(t)`` (from the imbalance model);
* the round is triggered by an initiator: the first arrival (**solo**), a worker
  drawn uniformly from the shared key (**majority**), or the last arrival
  (**sync**, the ordinary allreduce). Workers that arrived no later than the
  trigger are *active*;
* every worker contributes its send buffer; an active worker adds its fresh
  gradient and empties the buffer, an inactive worker keeps its fresh gradient
  in the buffer for a later round (it becomes a stale gradient);
* the result, identical on every worker, is ``(1/P) * sum of contributions``
  (Algorithm 2 line 6 divides by ``P``, as the reference code does, not by the
  number of contributors); NAP, the number of active processes, is the number of
  fresh gradients in it (Sec. 7.1).

Every gradient is delivered exactly once: after ``T`` rounds,
``sum_t P * result_t + sum_i buffer_i == sum_{t,i} G_t^i``
(:func:`undelivered` gives the buffers).

Two simulated clocks (``clock=``):

* ``"reset"`` (default): every round starts together; the round takes
  ``max`` (sync), ``min`` (solo) or the initiator's (majority) compute time, plus
  ``comm_ms``. A late worker's gradient is exactly one round stale.
* ``"carry"``: each worker keeps its own clock, as real processes do. A worker
  starts step ``t + 1`` when it has both finished ``t`` and, if it was active,
  received round ``t``'s result: ``ready_i(t+1) = max(arrive_i(t), R_t + comm_ms)``
  where ``arrive_i(t) = ready_i(t) + c_i(t)`` and ``R_t`` is the trigger. A
  gradient is delivered in the first round triggered at or after its arrival, so
  a worker that lags by several rounds contributes gradients several rounds
  stale (Sec. 5, "some slower processes may lag behind by more than one step").
  Pending gradients live in a FIFO of ``max_lag`` slots per worker; if a worker
  lags further, its oldest pending gradient is merged into the newest (delivered
  later, never lost) and ``overflows`` counts it.

``sync_every = N > 0`` makes every ``N``-th round synchronous (the reference's
"solo limiter" and the paper's periodic model synchronisation, Sec. 5): all
buffers are flushed and the clocks realigned, so no gradient is more than ``N``
rounds stale (Lemma 6.1's staleness bound). Because every worker applies the
same result every round, the workers' models never diverge here (the paper's
divergence comes from fflib2 keeping only the latest receive buffer, Sec. 5).
"""

from __future__ import annotations

from typing import NamedTuple

import jax
import jax.numpy as jnp
import numpy as np
import optax

from .._validate import as_count, check_int
from ..comm import resolve
from ..imbalance import ImbalanceModel
from ._eager_round import (
    CLOCKS,
    EagerSGDConfig,
    EagerSGDState,
    _as_key,
    flush,
    init_eager_state,
    partial_allreduce,
    round_draws,
    round_trigger,
    undelivered,
)

__all__ = [
    "CLOCKS",
    "EagerSGDConfig",
    "EagerSGDState",
    "eager_sgd",
    "init_eager_state",
    "partial_allreduce",
    "flush",
    "undelivered",
    "round_trigger",
    "round_draws",
    "simulate_training",
    "StalenessProfile",
    "staleness_profile",
]


class StalenessProfile(NamedTuple):
    """Who delivered what, and how late, over ``T`` rounds of one configuration.

    A gradient computed for round ``t`` (on the parameters after round ``t - 1``)
    and delivered in round ``s >= t`` is ``s - t`` rounds stale. Fresh gradients
    (staleness 0) are the active workers', so ``counts[0] == sum(nap)``.

    Attributes:
      counts: ``float32[T]``; ``counts[s]`` = number of gradients delivered ``s``
        rounds stale (whole numbers). ``sum(counts) + undelivered == P * T``.
      nap: ``int32[T]`` active processes (fresh gradients) per round.
      delivered: ``float32[T]`` gradients delivered per round, fresh and stale;
        the round's result is their sum divided by ``P``.
      clock_ms: ``float32[T]`` simulated time at the end of each round, ms.
      undelivered: ``float32[]`` gradients still in the send buffers after round ``T``.
    """

    counts: jax.Array
    nap: jax.Array
    delivered: jax.Array
    clock_ms: jax.Array
    undelivered: jax.Array

    def summary(self) -> dict:
        """Python numbers: ``fresh_fraction`` (of the delivered gradients),
        ``mean_staleness`` and ``max_staleness`` (rounds, over the delivered
        gradients), ``nap_mean``, ``delivered_std`` (standard deviation over rounds
        of the gradients delivered per round, whose mean is ``P`` in steady state:
        since the result is divided by ``P``, the step's scale varies with it),
        ``round_ms`` (mean round length, ms) and ``undelivered`` (an ``int``, like
        ``max_staleness``)."""
        counts = np.asarray(self.counts, np.float64)
        total = counts.sum()
        lags = np.arange(counts.shape[0])
        clock = np.asarray(self.clock_ms, np.float64)
        return {
            "fresh_fraction": float(counts[0] / total),
            "mean_staleness": float((lags * counts).sum() / total),
            "max_staleness": int(lags[counts > 0].max()),
            "nap_mean": float(np.mean(np.asarray(self.nap))),
            "delivered_std": float(np.std(np.asarray(self.delivered, np.float64))),
            "round_ms": float(clock[-1] / clock.shape[0]),
            "undelivered": as_count(self.undelivered, "undelivered"),
        }


def staleness_profile(config: EagerSGDConfig, rounds: int, key) -> StalenessProfile:
    """Measure the staleness of every delivered gradient by running the protocol on coded gradients.

    Worker ``i``'s gradient for round ``t`` is the unit vector ``e_t`` (length
    ``T``); :func:`partial_allreduce` moves these codes exactly as it moves real
    gradients, so ``P * result_s`` counts, per round of origin ``t``, the gradients
    delivered in round ``s``: ``counts[s - t]`` gets them. No training is done,
    and the delivery rules depend only on the imbalance model and the key, so
    this is the staleness of a training run with the same ``config`` and key
    (:func:`simulate_training` uses ``jax.random.split(key)[0]``).

    Time and memory: ``O(P * max_lag * T^2)`` and ``O(P * max_lag * T)`` (the
    carry clock's FIFO holds ``max_lag`` coded vectors per worker): a few seconds
    for ``T`` in the low thousands.

    Args:
      config: :class:`EagerSGDConfig`.
      rounds: ``T >= 1``.
      key: the shared PRNG key or int seed (imbalance draws, majority initiators).
    Returns:
      :class:`StalenessProfile`.
    """
    from ..comm import MeshAxis

    t_rounds, p = check_int(rounds, "rounds"), config.num_workers
    key = _as_key(key)
    comm = MeshAxis("staleness_profile")
    origin = jnp.arange(t_rounds)

    def worker(_):
        state = init_eager_state(jnp.zeros(t_rounds, jnp.float32), config, key)

        def body(carry, s):
            state, counts = carry
            code = (origin == s).astype(jnp.float32)
            mean, state = partial_allreduce(code, state, config, comm)
            per_origin = mean * p  # gradients from each round of origin delivered now
            lag = jnp.where(origin <= s, s - origin, t_rounds)  # t_rounds: dropped (nothing from the future)
            counts = counts.at[lag].add(per_origin, mode="drop")
            return (state, counts), (state.nap, jnp.sum(per_origin), state.clock_ms)

        (state, counts), (nap, delivered, clock) = jax.lax.scan(
            body, (state, jnp.zeros(t_rounds, jnp.float32)), jnp.arange(t_rounds)
        )
        return counts, nap, delivered, clock, jnp.sum(undelivered(state))

    run = jax.jit(jax.vmap(worker, axis_name="staleness_profile"))
    counts, nap, delivered, clock, rest = run(jnp.arange(p))
    # Every worker holds the same result; the undelivered codes are per worker.
    return StalenessProfile(
        counts=jnp.round(counts[0]),
        nap=nap[0],
        delivered=jnp.round(delivered[0]),
        clock_ms=clock[0],
        undelivered=jnp.round(jnp.sum(rest)),
    )


def eager_sgd(
    mode: str,
    imbalance: ImbalanceModel,
    *,
    key=0,
    axis_name: str | None = None,
    comm=None,
    clock: str = "reset",
    comm_ms: float = 0.0,
    sync_every: int = 0,
    max_lag: int = 8,
) -> optax.GradientTransformation:
    """eager-SGD's gradient accumulation as an optax transformation (Algorithm 2, lines 5-6).

    ``update(grads, state)`` returns ``(1/P) * partial_allreduce(grads)``; chain it
    with any optimizer: ``optax.chain(eager_sgd("majority", model, axis_name="data"),
    optax.sgd(0.1))``. Per-worker state: call ``init`` and ``update`` inside
    ``shard_map``/``vmap`` over the axis, like every per-worker transform.

    Args:
      mode: ``"solo"``, ``"majority"`` or ``"sync"``.
      imbalance: load-imbalance model with ``num_workers`` equal to the axis size.
      key: PRNG key, or an int seed in ``[0, 2**32)`` (others are refused: they would alias), shared by all workers.
      axis_name / comm: the communicator (at most one; neither: the ambient one).
      clock, comm_ms, sync_every, max_lag: see :class:`EagerSGDConfig`.
    """
    config = EagerSGDConfig(mode, imbalance, clock, comm_ms, sync_every, max_lag)
    communicator = resolve(axis_name, comm)
    key = _as_key(key)

    def init_fn(params):
        state = init_eager_state(params, config, key)
        try:  # per-worker fields vary over the axis (needed for scan carries in shard_map)
            return state._replace(
                **dict(
                    zip(
                        ("buffer", "pending_ms", "active", "overflows"),
                        communicator.varying((state.buffer, state.pending_ms, state.active, state.overflows)),
                    )
                )
            )
        except ValueError:  # initialised outside the mapped context
            return state

    def update_fn(updates, state, params=None):
        del params
        return partial_allreduce(updates, state, config, communicator)

    return optax.GradientTransformation(init_fn, update_fn)


def simulate_training(
    model,
    loss_fn,
    x,
    y,
    *,
    mode: str,
    imbalance: ImbalanceModel,
    batch_per_worker: int,
    epochs: int,
    optimizer: optax.GradientTransformation,
    key=0,
    clock: str = "reset",
    comm_ms: float = 0.0,
    sync_every: int = 0,
    max_lag: int = 8,
    eval_fn=None,
    eval_every: int = 1,
    axis_name: str = "workers",
    progress: bool = False,
    on_eval=None,
) -> dict:
    """Train a Flax NNX model with ``P`` simulated eager-SGD workers (``jax.vmap`` over a named axis).

    Long because the checks, the data split and the history share one scope with the round that ``simulate``
    compiles; each inner function is short.

    Each worker holds the shard ``x[w::P]`` and draws ``batch_per_worker`` examples
    per step (a fresh permutation of its shard every epoch); its gradient goes
    through :func:`partial_allreduce` and then ``optimizer`` (Algorithm 2). One jit
    compilation runs a whole epoch (``lax.scan``). Variables other than
    ``nnx.Param`` (e.g. BatchNorm statistics) are held fixed: use GroupNorm models.

    Args:
      model: an ``nnx.Module`` (its parameters are the initial point of every worker).
      loss_fn: ``(model, x_batch, y_batch) -> scalar`` mean loss.
      x, y: training arrays with a common leading axis ``N`` (``N >= P * batch_per_worker``).
      mode, imbalance, clock, comm_ms, sync_every, max_lag: see :class:`EagerSGDConfig`.
      batch_per_worker: local batch ``b`` (the global batch is ``P * b``).
      epochs: passes over the shards.
      optimizer: optax transformation applied to the partial-allreduce mean.
      key: PRNG key or int seed (imbalance, initiators, data order). The
        collective uses ``jax.random.split(key)[0]``: pass that to
        :func:`staleness_profile` to see this run's staleness.
      eval_fn: optional ``model -> dict of floats``, run on worker 0's model after
        every ``eval_every`` epochs (all workers hold the same model).
      progress: show a progress bar over epochs (tqdm, with the last evaluation).
      on_eval: optional ``entry -> None``, called with every history entry as soon
        as it is made (e.g. to save partial results of a long run).
    Returns:
      dict with ``history`` (one entry per evaluation: ``epoch``, ``step``,
      ``sim_time_s``, ``train_loss``, ``nap_mean``, plus ``eval_fn``'s keys),
      per-step ``nap`` and ``clock_ms`` lists, ``overflows``, and ``model``
      (worker 0's trained module).
    """
    from ..comm import MeshAxis
    from ..train import simulate, split_model

    config = EagerSGDConfig(mode, imbalance, clock, comm_ms, sync_every, max_lag)
    p = config.num_workers
    x = jnp.asarray(x)
    y = jnp.asarray(y)
    if x.shape[0] != y.shape[0]:
        raise ValueError(f"x and y must have the same leading size; got {x.shape[0]} and {y.shape[0]}")
    batch_per_worker = check_int(batch_per_worker, "batch_per_worker")
    epochs = check_int(epochs, "epochs")
    shard = x.shape[0] // p
    steps_per_epoch = shard // batch_per_worker
    if steps_per_epoch < 1:
        raise ValueError(
            f"{x.shape[0]} examples give {shard} per worker, fewer than batch_per_worker={batch_per_worker}"
        )
    key = _as_key(key)
    k_eager, k_data = jax.random.split(key)
    pure = split_model(model)
    comm = MeshAxis(axis_name)

    def pure_loss(prm, xb, yb):
        return loss_fn(pure.module(prm), xb, yb)

    # Every worker applies the same result every round, so the workers' models are
    # identical: keep one copy and vmap only the gradients and the collective.
    params = pure.params
    w_eager = jax.vmap(lambda _: init_eager_state(params, config, k_eager))(jnp.arange(p))
    collective = jax.vmap(lambda g, st: partial_allreduce(g, st, config, comm), axis_name=axis_name)
    worker_grads = jax.vmap(jax.value_and_grad(pure_loss), in_axes=(None, 0, 0))

    def round_fn(carry, t):
        """Round ``t`` (epoch ``t // S``, step ``t % S`` of it): worker ``w`` reads its shard ``x[w::P]``
        in the order of a permutation drawn from ``fold_in(k_data, epoch * P + w)``."""
        prm, opt_state, eager_states = carry
        epoch, s = t // steps_per_epoch, t % steps_per_epoch
        perms = jax.vmap(lambda w: jax.random.permutation(jax.random.fold_in(k_data, epoch * p + w), shard))(
            jnp.arange(p)
        )
        local = jax.lax.dynamic_slice_in_dim(perms, s * batch_per_worker, batch_per_worker, axis=1)
        idx = jnp.arange(p)[:, None] + p * local
        losses, grads = worker_grads(prm, x[idx], y[idx])
        means, eager_states = collective(grads, eager_states)
        updates, opt_state = optimizer.update(jax.tree.map(lambda a: a[0], means), opt_state, prm)
        prm = optax.apply_updates(prm, updates)
        return (prm, opt_state, eager_states), (jnp.mean(losses), eager_states.nap[0], eager_states.clock_ms[0])

    def summary(epoch, out):
        loss, nap, clk = (np.asarray(v) for v in out)
        return {
            "epoch": epoch,
            "step": epoch * steps_per_epoch,
            "sim_time_s": float(clk[-1]) / 1000.0,
            "train_loss": float(np.mean(loss)),
            "nap_mean": float(np.mean(nap)),
        }

    evaluate = None if eval_fn is None else (lambda carry: eval_fn(pure.module(carry[0])))
    (params, _, w_eager), result = simulate(
        round_fn,
        (params, optimizer.init(params), w_eager),
        epochs * steps_per_epoch,
        rounds_per_call=steps_per_epoch,
        summary=summary,
        eval_fn=evaluate,
        eval_every=eval_every,
        on_eval=on_eval,
        progress=progress,
        desc=f"eager-SGD {mode}",
        unit="epoch",
    )
    losses, naps, clocks = result.outputs
    return {
        "history": result.history,
        "nap": naps.tolist(),
        "clock_ms": clocks.tolist(),
        "loss": losses.tolist(),
        "overflows": int(np.asarray(w_eager.overflows).max()),
        "steps_per_epoch": steps_per_epoch,
        "model": pure.module(params),
    }
