"""MPI worker of ``jaxcomm run eventgrad-ring``: one process per worker of the ring, on the emulated link.

``python -m experiments.eventgrad.worker DIR`` (started by :mod:`experiments.eventgrad.ring`
through :func:`jaxcomm.netem.launch`) reads ``DIR/config.json`` (the
:class:`~experiments.eventgrad.config.EventGradRingConfig` fields and ``seed``) and trains every
method of ``methods`` in turn, each from the same initialisation on the same batches, in one
training loop (:func:`train`). Rank ``r`` writes ``DIR/{method}_rank{r}.npz``:

* ``snaps`` ``[E, D]``: this worker's parameters (flattened, ``jax.tree.leaves`` order) after
  every ``eval_every`` steps; ``snap_steps`` ``[E]``; ``times`` ``[E]``: seconds since the start
  barrier (the step is compiled before it; the snapshots' host copies are inside, the
  evaluation is not: the launcher evaluates the average model afterwards);
* ``fired`` ``bool [T, L]``: which of the ``L`` tensors this worker sent at each step (all of them
  for the two D-PSGD runs);
* ``messages``: tensors sent to a neighbour (``MPI_Put`` calls, or one ``MPI_Sendrecv`` per tensor
  and neighbour); ``payload_bytes``: their bytes (values, and int32 indices with top-K);
  ``exchange_s``: seconds in the one-sided exchange; ``train_s``: the whole loop's seconds,
  ``first_step_s``: the first step's;
* rank 0 only: ``link_bytes``, ``link_packets``, ``link_drops``, ``link_retransmitted``: the
  link's counters around the training (:func:`jaxcomm.netem.measure_window`).

The four methods are one algorithm and one exchange (:class:`jaxcomm.algorithms.OneSidedEventGrad`,
asynchronous: a worker mixes with whatever its window holds) with different thresholds:
``dpsgd`` is EventGraD with horizon 0 and no forced steps (every tensor fires every step: D-PSGD's
Eq. 2, as the paper's regular algorithm runs on its windows), ``eventgrad`` and ``eventgrad_topk``
the configured ones; the control ``dpsgd_sendrecv`` is :func:`jaxcomm.algorithms.dpsgd` over
:class:`jaxcomm.comm.MPIComm` (two-sided, inside jit: every worker waits for its neighbours).
"""

from __future__ import annotations

import json
import sys
import time
from pathlib import Path

import numpy as np

__all__ = ["main", "train"]


def _setup(cfg: dict, rank: int):
    """``(loss, grad, params0, batches)``: this seed's model (the study's :func:`~.run._model`), its
    cross-entropy loss and its jitted gradient (one compilation for every method), and this
    worker's ``(images, labels, dropout key)`` of every step ``t``: row
    ``rank`` of the global batches of ``jaxcomm run eventgrad``'s simulation and the key
    ``split(fold_in(key, 100 + t), P)[rank]`` (those of :func:`jaxcomm.algorithms.simulate_decentralized`)."""
    import jax
    import jax.numpy as jnp
    import optax

    from jaxcomm import data

    from .config import TASKS
    from .run import _load, _model

    spec, n, seed = TASKS[cfg["task"]], int(cfg["num_procs"]), int(cfg["seed"])
    train_set, _ = _load(spec["dataset"], int(cfg["train_examples"]), 1, seed)
    pure = _model(spec["model"], seed)
    key = jax.random.key(seed)
    it = data.WorkerBatches(
        data.split_iid(train_set, n, jax.random.fold_in(key, 1)),
        n * int(cfg["batch_per_worker"]),
        jax.random.fold_in(key, 2),
    )
    steps = jnp.arange(int(cfg["iterations"]))
    keys = jax.vmap(lambda t: jax.random.split(jax.random.fold_in(key, 100 + t), n)[rank])(steps)
    batches = []
    for t in range(int(cfg["iterations"])):
        b = next(it)
        batches.append((np.asarray(b.images[rank]), np.asarray(b.labels[rank]), keys[t]))

    def loss(params, images, labels, k):
        logits, _ = pure.apply(params, pure.model_state, images, train=True, rngs=k)
        return optax.softmax_cross_entropy_with_integer_labels(logits, labels).mean()

    return loss, jax.jit(jax.grad(loss)), pure.params, batches


def _stepper(method: str, cfg: dict, setup: tuple, world):
    """``(step, init, counts, close)`` of ``method``, its step compiled: ``step(params, state, images,
    labels, k)`` -> ``(params, state, fired)``; ``counts()`` -> ``(messages, payload_bytes,
    exchange_s)`` so far; ``close()`` frees the windows (collective)."""
    import jax
    import optax

    from jaxcomm import topology
    from jaxcomm.algorithms import OneSidedEventGrad, dpsgd, eventgrad
    from jaxcomm.comm import MPIComm

    loss, grad, params0, batches = setup
    n = world.Get_size()
    topo = topology.ring(n)
    tx = optax.sgd(float(cfg["lr"]), momentum=float(cfg["momentum"]) or None)
    leaves = jax.tree.leaves(params0)
    deg = int(topo.degrees[world.Get_rank()])
    if method == "dpsgd_sendrecv":
        two_sided = dpsgd(topo, tx, comm=MPIComm(world))
        step = jax.jit(lambda p, s, x, y, k: two_sided.step(p, jax.grad(loss)(p, x, y, k), s))
        done = [0]
        all_fired = np.ones(len(leaves), bool)
        nbytes = sum(int(x.size) * x.dtype.itemsize for x in leaves)

        def step_two_sided(p, s, x, y, k):
            done[0] += 1
            return (*step(p, s, x, y, k), all_fired)

        # Compiled before the clock: one throw-away step (every worker takes it: it exchanges).
        x0, y0 = np.zeros_like(batches[0][0]), np.zeros_like(batches[0][1])
        jax.block_until_ready(step(params0, two_sided.init(params0), x0, y0, jax.random.key(0)))
        counts = lambda: (done[0] * len(leaves) * deg, done[0] * nbytes * deg, 0.0)
        return step_two_sided, two_sided.init, counts, lambda: None
    every = method == "dpsgd"  # D-PSGD: every tensor fires every step
    alg = eventgrad(
        topo,
        tx,
        horizon=0.0 if every else float(cfg["horizon"]),
        history=int(cfg["history"]),
        forced_iterations=0 if every else int(cfg["forced_iterations"]),
        threshold_rule=str(cfg["threshold_rule"]),
        topk=float(cfg["topk"]) if method == "eventgrad_topk" else None,
    )
    # Windows outside shared memory: every put crosses the emulated link.
    ose = OneSidedEventGrad(alg, params0, comm=world, timeout=float(cfg["timeout_s"]), shared_memory=False)
    # Compiled before the clock: the two local halves of the step on the initial point (jit's cache
    # is keyed by the function, so ``ose.step`` finds them compiled); nothing is exchanged.
    state0 = alg.init(params0)
    _, _, mid = jax.jit(alg.prepare)(params0, state0)
    x0, y0 = np.zeros_like(batches[0][0]), np.zeros_like(batches[0][1])
    g0 = grad(params0, x0, y0, jax.random.key(0))
    jax.block_until_ready(jax.jit(alg.finish, static_argnames="index")(params0, g0, mid, index=world.Get_rank()))

    def step_one_sided(p, s, x, y, k):
        p, s = ose.step(p, grad(p, x, y, k), s)
        return p, s, np.array([bool(f) for f in jax.tree.leaves(s.fired)])

    ex = ose.exchange
    return step_one_sided, ose.init, lambda: (ex.puts, ex.bytes_put, ex.exchange_seconds), ose.free


def train(method: str, cfg: dict, setup: tuple, out: Path) -> None:
    """Train ``method`` for ``cfg["iterations"]`` steps on this worker and write ``out/{method}_rank{r}.npz``.

    ``setup`` is :func:`_setup`'s: step ``t`` takes this worker's batch and dropout key ``t``.
    The step is compiled before the clock starts at the start barrier (``first_step_s`` says how
    long the first step took).
    """
    import jax
    from mpi4py import MPI

    from jaxcomm.netem import measure_window

    world = MPI.COMM_WORLD
    rank = world.Get_rank()
    _, _, params0, batches = setup
    step, init, counts, close = _stepper(method, cfg, setup, world)
    every = int(cfg["eval_every"])
    snaps, snap_steps, times, fired = [], [], [], []
    clock = {"train_s": 0.0, "first_step_s": 0.0}

    def run() -> None:
        params, state = params0, init(params0)
        t_start = time.perf_counter()
        for t, (x, y, k) in enumerate(batches):
            params, state, f = step(params, state, x, y, k)
            fired.append(f)
            if t == 0:
                clock["first_step_s"] = time.perf_counter() - t_start
            if (t + 1) % every == 0:
                flat = np.concatenate([np.asarray(a).reshape(-1) for a in jax.tree.leaves(params)])
                times.append(time.perf_counter() - t_start)
                snaps.append(flat)
                snap_steps.append(t + 1)
        clock["train_s"] = time.perf_counter() - t_start

    window = measure_window(run, world)
    link = {}
    if window is not None:
        link = {f"link_{k}": getattr(window, k) for k in ("bytes", "packets", "drops", "retransmitted")}
    messages, payload_bytes, exchange_s = counts()
    close()
    np.savez(
        out / f"{method}_rank{rank}.npz",
        snaps=np.array(snaps),
        snap_steps=np.array(snap_steps),
        times=np.array(times),
        fired=np.array(fired, bool),
        messages=messages,
        payload_bytes=payload_bytes,
        exchange_s=exchange_s,
        train_s=clock["train_s"],
        first_step_s=clock["first_step_s"],
        **link,
    )


def main(argv: list[str]) -> None:
    """``argv = [DIR]``: train every method of ``DIR/config.json`` in turn."""
    if len(argv) != 1:
        raise SystemExit(
            f"usage: python -m experiments.eventgrad.worker DIR (launched by jaxcomm run eventgrad-ring); got {argv}"
        )
    out = Path(argv[0])
    cfg = json.loads((out / "config.json").read_text())
    from mpi4py import MPI

    setup = _setup(cfg, MPI.COMM_WORLD.Get_rank())
    for method in cfg["methods"]:
        train(method, cfg, setup, out)


if __name__ == "__main__":
    main(sys.argv[1:])
