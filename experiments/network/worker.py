"""MPI worker of ``jaxcomm run time-to-accuracy``: one process per rank, on the emulated link.

``python -m experiments.network.worker DIR`` (started by
:func:`experiments.network.run.run` through :func:`jaxcomm.netem.launch`) reads
``DIR/config.json`` (the :class:`~.config.TimeToAccuracyConfig` fields, ``bandwidth`` and,
on the decomposed route, ``time_links``) and rank 0 writes ``DIR/results.json`` (again after
every run, ``"complete"`` once all are done). Every job first measures its link:

* ``link``: the latency ``α`` (s) and throughput (bit/s) of the link as Open MPI sees it:
  ``α`` = the median time of an 8-byte ``MPI_Allreduce`` over its ``2 (n − 1)`` ring steps;
  the throughput = ``8 · 2 (n − 1) P`` over the median time of a ``P``-byte ring all-reduce,
  less its latency (``P`` = 4 MiB unshaped, else about half a second of the link's rate, at
  least 256 KiB).

Every job (the decomposed route's unshaped one, and every job of the end-to-end route)
trains each method and seed until the test accuracy reaches ``target_accuracy`` or
``max_steps``; every rank makes the same decision (the accuracy is all-reduced). ``runs``: per
method and seed,

* ``compute_s``: step time of the same optimizer with a one-worker communicator
  (:class:`jaxcomm.comm.Local`: forward, backward, compression and decoding, no communication),
  timed on every rank at once so the processes share the CPU as in training: the median over
  whole communication periods of a period's mean step (s), measured once per method and
  learning rate (with the first seed run) and recorded with every seed;
* ``curve``: after every ``eval_every`` steps: ``step``, ``time_s`` (the training steps'
  wall-clock seconds so far on rank 0: evaluation, data loading and compilation are not
  counted), ``accuracy`` (test accuracy over ``eval_examples``, evaluated in parallel),
  ``link_bytes`` (bytes the kernel's qdisc passed during those steps, all ranks) and
  ``wire_bits`` (the pipeline's count for one worker, :func:`~experiments._common.per_worker`
  of the trainer's ``wire_bits_total``: an ``int`` when every worker sent alike);
* ``step_s`` (s; the median over whole periods of a period's mean step), ``wire_bits_per_step``
  (one worker's, mean over whole periods) and ``messages_per_step`` (the collectives' arrays
  of all workers together, the trainer's ``messages`` metric, mean over whole periods), and
  the method's ``compressor``, ``strategy``, ``sync_every`` and ``learning_rate``.

With ``gather_metrics`` false the trainer keeps each process's own metrics, and the bits and
messages above are their exact sums over the processes, taken once per evaluation window (and
once per timed window) by :func:`_workers_counts`.

With ``lr_sweep``, ``sweep`` first holds one such run per method and learning rate (first
seed); ``learning_rates`` then holds each method's rate chosen from it
(:func:`choose_learning_rates`), which every seed's run trains with (the first seed's run is the
sweep's run at that rate, not trained twice). With ``time_links`` (the decomposed route), the
job then gives its link each of those rates in turn and, on each, trains each method for its
``warmup_steps`` (capped by the steps its training needed) and then at least ``timing_steps``
steps in whole communication periods, recording every step's time (``timing_jobs``, see
:func:`_time_links`). Rank 0 prints one line per evaluation and one per run.
"""

from __future__ import annotations

import json
import math
import sys
import time
from pathlib import Path

import numpy as np

__all__ = [
    "compute_step_time",
    "link_payload",
    "load_step",
    "main",
    "measure_link",
    "period_mean",
    "timed_steps",
    "timed_steps_alone",
    "train_to_target",
    "write_job_results",
]


def measure_link(world, repeats: int = 20, payload_bytes: int = 4 << 20) -> dict:
    """Latency ``α`` (s) and throughput (bit/s) of ring all-reduces between the ranks of ``world``.

    ``α = t_8 / (2 (n − 1))`` with ``t_8`` the median time of an 8-byte all-reduce;
    throughput ``= 8 · 2 (n − 1) P / (t_P − 2 (n − 1) α)`` with ``t_P`` the median time of
    a ``P``-byte one (``repeats // 4`` of them). Every rank returns the same values (rank 0's).
    """
    from mpi4py import MPI

    n = world.Get_size()
    steps = 2 * (n - 1)

    def median_time(buf, times):
        out = np.empty_like(buf)
        world.Allreduce(buf, out, op=MPI.SUM)  # warm: connections, buffers
        ts = []
        for _ in range(times):
            world.Barrier()
            t0 = time.perf_counter()
            world.Allreduce(buf, out, op=MPI.SUM)
            ts.append(time.perf_counter() - t0)
        return float(np.median(ts))

    t_small = median_time(np.zeros(1, np.float64), repeats)
    t_big = median_time(np.zeros(payload_bytes // 4, np.float32), max(3, repeats // 4))
    alpha = t_small / steps
    throughput = 8 * steps * payload_bytes / max(t_big - steps * alpha, 1e-9)
    return world.bcast({"latency_s": alpha, "throughput_bps": throughput}, root=0)


def _compile(trainer, state, batches, world, rank: int) -> None:
    """Compile ``trainer``'s step on rank 0, then on the others from the persistent cache.

    Every rank traces together (``MPIComm`` agrees on each collective's shapes with the other
    ranks while it is traced); compilation runs no collective, so rank 0 compiles alone and,
    with ``JAX_COMPILATION_CACHE_DIR`` set (the launcher sets it), the later ranks and the
    first call load the executable instead of compiling it again on the shared cores.
    """
    batch = trainer.worker_batch(batches.batch_at(batches.position))
    lowered = trainer.step_fn.lower(state, batch)
    if rank == 0:
        lowered.compile()
    _idle_barrier(world)
    if rank != 0:
        lowered.compile()
    _idle_barrier(world)


def _idle_barrier(world, poll_s: float = 0.02) -> None:
    """``MPI_Barrier`` that sleeps while it waits, leaving the shared cores to the ranks at work
    (Open MPI's blocking barrier polls). No-op without ``world``."""
    if world is None:
        return
    request = world.Ibarrier()
    while not request.Test():
        time.sleep(poll_s)


def period_mean(values, sync_every: int, reduce=np.median) -> float:
    """``reduce`` over whole communication periods of a period's mean value.

    ``values`` (one per step) are cut to whole periods of ``sync_every`` steps; each period's
    mean is one sample. With fewer steps than one period, the mean of all of them.
    """
    a = np.asarray(values, np.float64)
    h = max(int(sync_every), 1)
    whole = (len(a) // h) * h
    if whole == 0:
        return float(a.mean()) if len(a) else math.nan
    return float(reduce(a[:whole].reshape(-1, h).mean(axis=1)))


def timed_steps(least: int, sync_every: int) -> int:
    """Steps a timing window covers: at least ``least`` and two periods, in whole periods of ``sync_every``."""
    h = max(int(sync_every), 1)
    return h * max(2, math.ceil(int(least) / h))


def _learning_rate(cfg: dict, method: str) -> float:
    return float((cfg.get("learning_rates") or {}).get(method, cfg["learning_rate"]))


def _last_accuracy(run: dict) -> float:
    return float(run["curve"][-1]["accuracy"]) if run["curve"] else -1.0


def choose_learning_rates(sweep: list[dict]) -> dict[str, float]:
    """Method label -> the learning rate its runs train with, from the sweep's runs (first seed):
    the swept rate that reached the target in the fewest steps (a tie: the smaller rate); where
    none reached it, the one with the highest last test accuracy. It replaces the method's rate
    in ``learning_rates``."""
    chosen: dict[str, float] = {}
    for method in dict.fromkeys(r["method"] for r in sweep):
        runs = [r for r in sweep if r["method"] == method]
        reached = [r for r in runs if r["reached"] is not None]
        if reached:
            best = min(reached, key=lambda r: (int(r["reached"]["step"]), float(r["learning_rate"])))
        else:
            best = max(runs, key=lambda r: (_last_accuracy(r), -float(r["learning_rate"])))
        chosen[method] = float(best["learning_rate"])
    return chosen


def compute_step_time(
    *,
    model: str = "resnet20",
    dataset: str = "fashion_mnist",
    batch_size: int = 8,
    method: str = "none",
    learning_rate: float = 0.02,
    momentum: float = 0.9,
    steps: int = 20,
    seed: int = 0,
    options: dict | None = None,
    train=None,
    world=None,
    gather_metrics: bool = True,
) -> float:
    """Seconds of one training step of ``method`` on this process's default device, without
    communication: the same optimizer with a one-worker communicator
    (:class:`jaxcomm.comm.Local`), i.e. forward, backward, compression and decoding.

    This is the compute side of the balance that ``jaxcomm run time-to-accuracy`` measures:
    run it on a GPU and on this CPU, and ``N = T_cpu / T_gpu`` maps a link of ``X`` bit/s
    here to one of ``N X`` bit/s beside that GPU (see docs/network.md).

    Args:
      model, dataset: as :class:`~experiments.network.config.TimeToAccuracyConfig`.
      batch_size: examples per step (one worker's batch).
      method: a label of :data:`~experiments.network.config.METHODS`.
      learning_rate, momentum: of the method's ``optax.sgd``.
      steps: steps timed after two untimed ones (compilation) and the method's warm-up
        (``MethodInfo.warmup_steps``: DGC's denser sparsity stages), ``>= 1``; rounded up to
        whole communication periods of the method.
      seed: initialisation and data order.
      options: the configuration fields a method reads (``dgc_steps_per_stage``).
      train: the training :class:`~jaxcomm.data.Dataset` (default: loaded from ``dataset``).
      world: an mpi4py communicator: every rank times its own steps at once (after a
        barrier), so that processes sharing the cores share them as in training.
      gather_metrics: the :class:`~jaxcomm.train.Trainer`'s, as in the training it stands for:
        with ``False`` a step that sends nothing (DiLoCo's inner steps) runs as its own program,
        as it does over MPI.
    Returns:
      the mean step time over whole communication periods, in seconds (compilation excluded):
      the statistic of a link's timed window (:func:`_time`'s ``step_s``), so that their ratio,
      the utilization, compares like with like.
    """
    import jax

    from jaxcomm import data
    from jaxcomm.comm import Local
    from jaxcomm.train import Trainer

    from .._common import build_model, load_image_task
    from .config import build_method

    if int(steps) < 1:
        raise ValueError(f"steps: must be >= 1; got {steps}")
    if train is None:
        train, _ = load_image_task(dataset, 0, 1)
    # one_worker: a method that overlaps its exchange with an MPI thread builds without it here
    tx, info = build_method(method, learning_rate, momentum, {**(options or {}), "one_worker": True})
    h = max(int(info.sync_every), 1)
    steps = h * math.ceil(int(steps) / h)
    trainer = Trainer(build_model(model, train, seed), tx, comm=Local(), seed=seed, gather_metrics=gather_metrics)
    batches = data.WorkerBatches([train], int(batch_size), jax.random.PRNGKey(seed + 7))
    return timed_steps_alone(trainer, batches, steps, h, world, skip=int(info.warmup_steps), reduce=np.mean)


def timed_steps_alone(
    trainer, batches, steps: int, sync_every: int, world=None, skip: int = 0, reduce=np.median
) -> float:
    """Seconds of one step of ``trainer`` (built on :class:`jaxcomm.comm.Local`, so its steps send
    nothing): compiled (:func:`_compile`), two untimed steps and ``skip`` more (a method's warm-up,
    e.g. DGC's denser sparsity stages, so that the steps timed are the steps after it), then
    ``steps`` timed ones started on every rank of ``world`` at once, so that processes sharing the
    cores share them as in training.

    Returns ``reduce`` (default the median) over whole communication periods of ``sync_every``
    steps of a period's mean step time (:func:`period_mean`), in seconds.
    """
    state = trainer.init_state()
    rank = 0 if world is None else world.Get_rank()
    _compile(trainer, state, batches, world, rank)
    state, _ = trainer.fit(state, batches, 2 + int(skip), progress=False)
    if world is not None:
        world.Barrier()
    state, hist = trainer.fit(state, batches, 2 + int(skip) + int(steps), progress=False)
    return period_mean([row["step_time"] for row in hist], sync_every, reduce)


_COMPILED: dict = {}
"""(method, learning rate, model) -> (tx, info) of this process: the optimizer whose step
:data:`_STEPS` holds under the same key."""

_STEPS: dict = {}
"""A study's key of a run's program -> the jitted MPI step compiled for it in this process: an MPI
step's program holds its communicator's handle, so the persistent compilation cache cannot serve
it to a new trainer; later seeds reuse the step compiled for the first (their state is a new
argument)."""


def load_step(trainer, key, batches, world, rank: int) -> None:
    """Give ``trainer`` the step this process compiled under ``key`` (an earlier seed's run of the
    same program), else compile it (:func:`_compile`) and keep it under ``key``; then two steps
    from a fresh state load the executable and connect the ranks."""
    if key in _STEPS:
        trainer.step_fn = _STEPS[key]
    else:
        _compile(trainer, trainer.init_state(), batches, world, rank)
        _STEPS[key] = trainer.step_fn
    trainer.fit(trainer.init_state(), batches, 2, progress=False)


def _mpi_trainer(method: str, seed: int, lr: float, cfg: dict, train, world, rank: int):
    """A trainer of ``method`` over MPI with its step compiled and loaded, and its batches."""
    import jax

    from jaxcomm import data
    from jaxcomm.comm import MPIComm
    from jaxcomm.train import Trainer

    from .._common import build_model
    from .config import build_method

    n = world.Get_size()
    program = (method, lr, cfg["model"])  # a seed changes values only, not the program
    if program not in _COMPILED:
        _COMPILED[program] = build_method(method, lr, float(cfg["momentum"]), cfg)
    tx, info = _COMPILED[program]
    trainer = Trainer(
        build_model(cfg["model"], train, seed),
        tx,
        comm=MPIComm(),
        seed=seed,
        gather_metrics=bool(cfg.get("gather_metrics", True)),
    )
    key = jax.random.PRNGKey(seed)
    shards = data.split_iid(train, n, key)
    global_batch = n * int(cfg["batch_size"])  # WorkerBatches takes the global batch
    load_step(trainer, program, data.WorkerBatches(shards, global_batch, jax.random.fold_in(key, 2)), world, rank)
    batches = data.WorkerBatches(shards, global_batch, jax.random.fold_in(key, 1))
    return trainer, batches, info


def _compute_s(method: str, seed: int, lr: float, cfg: dict, train, world, cache: dict, steps: int = 0) -> float:
    """The compute-only step (s) of ``method`` at ``lr``, over ``steps`` steps (at least
    ``compute_steps``), with the training's ``gather_metrics``: measured once (first seed), then reused."""
    if (method, lr) not in cache:
        world.Barrier()
        compute_s = compute_step_time(
            model=cfg["model"],
            batch_size=int(cfg["batch_size"]),
            method=method,
            learning_rate=lr,
            momentum=float(cfg["momentum"]),
            steps=max(int(cfg["compute_steps"]), int(steps)),
            seed=seed,
            options=cfg,
            train=train,
            world=world,
            gather_metrics=bool(cfg.get("gather_metrics", True)),
        )
        cache[(method, lr)] = float(np.max(world.allgather(compute_s)))  # the slowest rank paces the step
    return cache[(method, lr)]


def _train(method: str, seed: int, lr: float, cfg: dict, train, test_shard, world, rank: int, cache: dict) -> dict:
    n = world.Get_size()
    compute_s = _compute_s(method, seed, lr, cfg, train, world, cache)

    trainer, batches, info = _mpi_trainer(method, seed, lr, cfg, train, world, rank)
    target = float(cfg["target_accuracy"])

    def evaluate(state) -> dict:
        local = trainer.evaluate(state, test_shard.images, test_shard.labels)
        return {k: float(world.allreduce(local[k])) / n for k in ("accuracy", "loss")}

    desc = f"{cfg['bandwidth']} {method} lr {lr:g} seed {seed}"
    run = train_to_target(
        trainer,
        trainer.init_state(),
        batches,
        world,
        every=int(cfg["eval_every"]),
        max_steps=int(cfg["max_steps"]),
        evaluate=evaluate,
        reached=lambda m: m["accuracy"] >= target,
        shown=("accuracy", "test accuracy"),
        desc=desc,
    )
    step, elapsed = run["steps"], run["time_s"]
    if rank == 0:
        outcome = (
            f"reached {target:g} at step {step} in {elapsed:.1f} s"
            if run["reached"]
            else f"did not reach {target:g} in {step} steps ({elapsed:.1f} s)"
        )
        print(f"[run] {desc}: {outcome}; compute-only step {compute_s * 1e3:.1f} ms", flush=True)
    h = info.sync_every
    return {
        **_described(method, seed, lr, info),
        "warmup_steps": info.warmup_steps,
        "compute_s": compute_s,
        "step_s": period_mean(run["step_times"], h),
        "wire_bits_per_step": period_mean([b / n for b in run["bits"]], h, np.mean),
        "messages_per_step": period_mean(run["messages"], h, np.mean),
        "link_bytes_per_step": run["link_bytes"] / max(step, 1),
        "steps": step,
        "reached": run["reached"],
        "curve": run["curve"],
    }


def train_to_target(
    trainer, state, batches, world, *, every: int, max_steps: int, evaluate, reached, shown: tuple[str, str], desc: str
) -> dict:
    """Train over MPI on the emulated link until ``reached`` or ``max_steps``: the studies' one loop.

    ``trainer.fit`` runs ``every`` steps at a time inside the link's measurement window
    (:func:`jaxcomm.netem.measure_window`; it fences the counter read with barriers on both sides:
    a rank that started its first step before rank 0 had read the counter would send its first
    eager, < 64 KiB, messages uncounted, docs/network.md, "What the counters mean"); then
    ``evaluate(state)`` (the same dict of numbers on every rank, e.g. averaged over the ranks) is
    added to the curve and ``reached(metrics)`` (decided alike on every rank) may end the run.
    Evaluation, data loading and compilation are not timed. Rank 0 shows ``metrics[shown[0]]``
    (named ``shown[1]``) on a progress bar, or, under ``mpirun`` (a pipe, which holds a bar's
    carriage-return updates back), on one line per evaluation.

    Returns a dict: ``state`` (the last), ``curve`` (per evaluation: ``step``, ``time_s`` (the
    training steps' wall-clock seconds so far, rank 0's ``step_time`` summed), the metrics,
    ``link_bytes`` (the qdisc's bytes during those steps, all ranks, counted on rank 0; 0
    elsewhere) and ``wire_bits`` (one worker's share of the pipeline's count,
    :func:`~experiments._common.per_worker`)), ``step_times`` (s, every step), ``bits`` and
    ``messages`` (every step's, all workers: :func:`_workers_counts`), ``link_bytes`` (the run's),
    ``steps``, ``time_s`` and ``reached`` (``{"step", "time_s"}`` of the first evaluation that
    reached, else ``None``).
    """
    from experiments._common import per_worker
    from jaxcomm._progress import progress_bar
    from jaxcomm.netem import measure_window

    n, rank = world.Get_size(), world.Get_rank()
    key, name = shown
    curve: list[dict] = []
    step_times: list[float] = []
    bits: list[int] = []
    messages: list[int] = []
    elapsed, total_bytes, step = 0.0, 0, int(state.step)
    lines = rank == 0 and not sys.stderr.isatty()
    bar = progress_bar(total=max_steps, desc=desc, disable=rank != 0 or lines, leave=True)
    hit = None

    def fit_counted(state, until: int):
        """``trainer.fit`` to step ``until``, and the link's bytes meanwhile (rank 0; 0 elsewhere)."""
        fitted: list = []
        win = measure_window(lambda: fitted.extend(trainer.fit(state, batches, until, progress=False)), world)
        return (*fitted, win.bytes if win is not None else 0)

    while step < max_steps:
        state, hist, sent = fit_counted(state, min(step + every, max_steps))
        total_bytes += sent
        step = hist[-1]["step"]
        step_times += [row["step_time"] for row in hist]
        chunk_bits, chunk_messages = _workers_counts(hist, trainer, world)
        bits += chunk_bits  # all workers
        messages += chunk_messages
        elapsed += sum(row["step_time"] for row in hist)
        metrics = evaluate(state)
        curve.append(
            {
                "step": step,
                "time_s": elapsed,
                **metrics,
                "link_bytes": total_bytes,
                "wire_bits": per_worker(sum(bits), n),
            }
        )
        bar.update(len(hist))
        bar.set_postfix({key: f"{metrics[key]:.3f}", "s": f"{elapsed:.0f}"})
        if lines:
            print(f"{desc}: step {step}/{max_steps}, {name} {metrics[key]:.3f}, {elapsed:.1f} s", flush=True)
        if reached(metrics):
            hit = {"step": step, "time_s": elapsed}
            break
    bar.close()
    return {
        "state": state,
        "curve": curve,
        "step_times": step_times,
        "bits": bits,
        "messages": messages,
        "link_bytes": total_bytes,
        "steps": step,
        "time_s": elapsed,
        "reached": hit,
    }


def _workers_counts(hist: list[dict], trainer, world) -> tuple[list[int], list[int]]:
    """Per step of ``hist``, the bits and messages of all workers: as the trainer gathered them, or,
    where each process kept its own (``gather_metrics=False``), their exact sums over the processes
    (one collective for the whole history)."""
    bits = [int(row["wire_bits_total"]) for row in hist]
    messages = [int(row["messages"]) for row in hist]
    if trainer.gather_metrics:
        return bits, messages
    summed = world.allreduce(np.array([bits, messages], np.int64).reshape(2, -1))  # element-wise sum
    return [int(b) for b in summed[0]], [int(m) for m in summed[1]]


def _described(method: str, seed: int, lr: float, info) -> dict:
    """The fields that say which run a record is: method, seed, learning rate, what is sent and how."""
    return {
        "method": method,
        "seed": seed,
        "learning_rate": lr,
        "compressor": info.compressor,
        "strategy": info.strategy,
        "sync_every": info.sync_every,
    }


def _window_least(cfg: dict, method: str) -> int:
    """The least number of steps ``method``'s timed window covers on a link (:func:`timed_steps`
    rounds it to whole periods): its ``method_timing_steps``, else ``timing_steps``, or more for
    the token bucket (``timing_least``)."""
    own = (cfg.get("method_timing_steps") or {}).get(method, cfg["timing_steps"])
    return max(int(own), int((cfg.get("timing_least") or {}).get(method, 0)))


def _time(method: str, seed: int, lr: float, cfg: dict, train, world, rank: int) -> dict:
    """Every step's time of ``method`` on this link: its warm-up (capped by ``timing_warmup``),
    then :func:`timed_steps` steps whose kernel byte count is read (rank 0).

    ``step_s`` is the mean of the timed steps' ``step_time`` (s, as the training job's clock
    counts them); ``window_s`` the wall-clock of the timed window on rank 0, between barriers
    (s). The window starts with the link's token bucket full: at most ``burst / rate`` seconds
    of transfer (256 KiB: 0.2 s at 10 Mbit/s, 2 ms at 1 Gbit/s) pass without waiting.
    """
    from jaxcomm.netem import link_counters

    trainer, batches, info = _mpi_trainer(method, seed, lr, cfg, train, world, rank)
    n = world.Get_size()
    h = info.sync_every
    warmup = min(int(info.warmup_steps), int((cfg.get("timing_warmup") or {}).get(method, info.warmup_steps)))
    steady = timed_steps(_window_least(cfg, method), h)
    state = trainer.init_state()
    hist_warm = []
    if warmup:
        state, hist_warm = trainer.fit(state, batches, warmup, progress=False)
    world.Barrier()
    before = link_counters() if rank == 0 else None
    world.Barrier()  # every rank starts the window together, after rank 0 has read the counter
    t0 = time.perf_counter()
    state, hist = trainer.fit(state, batches, warmup + steady, progress=False)
    world.Barrier()
    window_s = time.perf_counter() - t0
    window = link_counters() - before if before is not None else None
    times = [row["step_time"] for row in hist]
    window_bits, window_messages = _workers_counts(hist, trainer, world)
    out = {
        **_described(method, seed, lr, info),
        "warmup_steps": warmup,
        "warmup_step_times": [row["step_time"] for row in hist_warm],
        "step_times": times,
        "step_s": float(np.mean(times)),
        "wire_bits_per_step": float(np.mean(window_bits)) / n,
        "messages_per_step": float(np.mean(window_messages)),
        "link_bytes_per_step": (window.bytes if window else 0) / steady,
        "window_drops": window.drops if window else 0,
        # the most of the window's bytes the token bucket, full at its start, can have passed unshaped
        "bucket_share": cfg["burst_bytes"] / window.bytes
        if window and window.bytes and cfg.get("burst_bytes")
        else None,
        "qdisc": window.kind if window else None,
        "window_s": window_s,
    }
    if rank == 0:
        print(
            f"[time] {cfg['bandwidth']} {method}: {steady} steps ({steady // h} periods) after {warmup}, "
            f"mean step {out['step_s'] * 1e3:.1f} ms, {out['link_bytes_per_step'] / 1e6:.3f} MB/step on the link",
            flush=True,
        )
    return out


BUCKET_SHARE = 0.1
"""The most of a timed window's bytes the link's token bucket may carry: a window starts with the
bucket full (``burst`` bytes pass at line speed), so a method that sends little per step is timed
over enough steps that its window's bytes are at least ``burst / BUCKET_SHARE``."""

TIMING_STEPS_MAX = 2000
"""The most steps a window is lengthened to for :data:`BUCKET_SHARE`."""


def bucket_steps(runs: list[dict], warmup: int, burst_bytes: int, share: float = BUCKET_SHARE) -> int:
    """Steps after the warm-up whose link bytes reach ``burst_bytes / share``, at the smallest rate
    of bytes per step any of ``runs`` (one method's training runs) had on the unshaped link from
    its last evaluation at or before ``warmup`` (the run's start, with 0 bytes, counts as one) to
    its last evaluation; at most :data:`TIMING_STEPS_MAX` (also where no run sent anything then)."""
    rates = []
    for run in runs:
        points = [{"step": 0, "link_bytes": 0}, *run["curve"]]
        first = [p for p in points if p["step"] <= warmup][-1]
        last = points[-1]
        if last["step"] > first["step"]:
            rates.append((last["link_bytes"] - first["link_bytes"]) / (last["step"] - first["step"]))
    rate = min(rates) if rates else 0.0
    if rate <= 0:
        return TIMING_STEPS_MAX
    return int(min(TIMING_STEPS_MAX, math.ceil(burst_bytes / (share * rate))))


def link_payload(bandwidth: str, n: int) -> int:
    """Bytes of the all-reduce that measures the throughput: 4 MiB unshaped, else about half a
    second of the link's rate for the whole ring, at least 256 KiB."""
    from jaxcomm.netem import parse_rate

    rate = parse_rate(str(bandwidth), "bandwidth")
    if rate is None:
        return 4 << 20
    return int(min(4 << 20, max(256 << 10, rate / 8 * 0.5 / (2 * (n - 1)))))


def main(argv: list[str] | None = None) -> None:
    """Run the job of ``DIR/config.json``; rank 0 writes ``DIR/results.json``."""
    argv = sys.argv[1:] if argv is None else argv
    if len(argv) != 1:
        raise SystemExit("usage: python -m experiments.network.worker DIR")
    out = Path(argv[0])
    cfg = json.loads((out / "config.json").read_text())
    from mpi4py import MPI

    from .._common import load_image_task

    world = MPI.COMM_WORLD
    rank, n = world.Get_rank(), world.Get_size()
    train, test = load_image_task(cfg["dataset"], int(cfg["train_examples"]), 0)
    per = int(cfg["eval_examples"]) // n
    test_shard = test.take(np.arange(rank * per, (rank + 1) * per))
    start = None
    if rank == 0 and cfg.get("time_links"):
        from jaxcomm.netem import link_counters

        start = link_counters()
    link = measure_link(world, payload_bytes=link_payload(cfg["bandwidth"], n))
    t0 = time.perf_counter()
    result: dict = {"bandwidth": cfg["bandwidth"], "procs": n, "mode": "train", "link": link}
    seeds, methods = [int(s) for s in cfg["seeds"]], list(cfg["methods"])
    sweep = [float(lr) for lr in cfg.get("lr_sweep") or ()]
    # (stage, [(method, seed, swept rate or None: the method's chosen or configured rate)])
    stages: list[tuple[str, list[tuple[str, int, float | None]]]] = []
    if sweep:
        stages.append(("sweep", [(m, seeds[0], lr) for lr in sweep for m in methods]))
    stages.append(("runs", [(m, s, None) for s in seeds for m in methods]))
    total = sum(len(plan) for _, plan in stages)
    done = 0
    compute_cache: dict = {}
    for key, plan in stages:
        result[key] = []
        if key == "runs" and sweep:
            # rank 0's choice, so that every rank trains with the same rates
            result["learning_rates"] = world.bcast(choose_learning_rates(result["sweep"]) if rank == 0 else None)
        rates = result.get("learning_rates") or {}
        for method, seed, swept in plan:
            lr = swept if swept is not None else float(rates.get(method, _learning_rate(cfg, method)))
            same = (method, seed, lr)
            sweep_runs = result.get("sweep", []) if key == "runs" else []
            swept_run = [r for r in sweep_runs if (r["method"], r["seed"], r["learning_rate"]) == same]
            if swept_run:  # the sweep trained this very run (same method, seed and rate)
                result[key].append(swept_run[0])
            else:
                result[key].append(_train(method, seed, lr, cfg, train, test_shard, world, rank, compute_cache))
            done += 1
            if rank == 0:  # after every run, so that an interrupted job keeps what it measured
                write_job_results(result, out, t0, complete=done == total and not cfg.get("time_links"))
    if cfg.get("time_links"):
        _time_links(cfg, result, train, world, rank, out, t0, start)


def _warmup_of(method: str, needed: int) -> int:
    """``method``'s warm-up steps (its :class:`~experiments.network.config.MethodInfo`, built for its
    training in this process), at most ``needed``."""
    infos = [info for (m, _, _), (_, info) in _COMPILED.items() if m == method]
    return min(max((int(i.warmup_steps) for i in infos), default=0), int(needed))


def write_job_results(result: dict, out: Path, t0: float, complete: bool) -> None:
    """Write ``result`` (with ``job_s``, the seconds since ``t0``, and ``complete``) to
    ``out/results.json`` through a rename, so that a reader never sees half a file."""
    result["job_s"] = time.perf_counter() - t0
    result["complete"] = complete
    partial = out / "results.json.partial"
    partial.write_text(json.dumps(result, indent=1))
    partial.replace(out / "results.json")


def _time_links(cfg: dict, result: dict, train, world, rank: int, out: Path, t0: float, start) -> None:
    """After training: time every method on each link of ``cfg["time_links"]`` in this job.

    Rank 0 gives the namespace's link each rate in turn (:func:`jaxcomm.netem.reshape`), so the
    steps compiled for training are timed on every link without compiling them again (an MPI
    step's program holds its communicator, so a new job compiles anew). Each method is timed as
    in :func:`_time`, its warm-up capped at the steps its slowest seed trained. Adds
    ``link_counters`` (the training's bytes, packets and drops on the unshaped link, from
    ``start``, rank 0's :class:`~jaxcomm.netem.LinkCounters` at the job's start) and
    ``timing_jobs``: per link ``bandwidth``, ``procs``, ``mode`` (``"time"``), ``shape`` (the
    qdisc's settings, :meth:`~jaxcomm.netem.LinkSettings.describe`), ``link`` (the measured rate)
    and ``timings`` (each with ``qdisc``, the kind of qdisc that counted its window).
    """
    from jaxcomm.netem import link_counters
    from jaxcomm.netem._link import link_settings, reshape

    n = world.Get_size()
    runs = result["runs"]
    needed = {
        m: max(int(r["reached"]["step"]) if r["reached"] else int(r["steps"]) for r in runs if r["method"] == m)
        for m in dict.fromkeys(r["method"] for r in runs)
    }
    rates = result.get("learning_rates") or {}
    seed = int(cfg["seeds"][0])
    world.Barrier()
    if rank == 0:
        counters = link_counters() - start
        result["link_counters"] = {"bytes": counters.bytes, "packets": counters.packets, "drops": counters.drops}
    result["timing_jobs"] = []
    for bandwidth in cfg["time_links"]:
        shape, error = None, None
        if rank == 0:
            try:
                shape = reshape(bandwidth, burst=cfg["burst"]).describe()
            except (OSError, ValueError, RuntimeError) as e:  # NetemError, NetemUnavailable, a missing tc
                error = f"{type(e).__name__}: {e}"
        error = world.bcast(error)  # every rank ends with the reason, none waits for rank 0 forever
        if error is not None:
            raise RuntimeError(f"could not give the link the rate {bandwidth}: {error}")
        burst_bytes = link_settings(bandwidth, "0", cfg["burst"], cfg["mtu"]).burst_bytes
        # rank 0 counted the link's bytes (the others' curves hold 0): its window lengths, for every rank
        runs_of = {m: [r for r in runs if r["method"] == m] for m in needed}
        least = world.bcast(
            {m: bucket_steps(runs_of[m], _warmup_of(m, needed[m]), burst_bytes) for m in needed} if rank == 0 else None
        )
        job_cfg = {
            **cfg,
            "bandwidth": bandwidth,
            "timing_warmup": needed,
            "timing_least": least,
            "burst_bytes": burst_bytes,
        }
        tj = {
            "bandwidth": bandwidth,
            "procs": n,
            "mode": "time",
            "shape": shape,
            "link": measure_link(world, payload_bytes=link_payload(bandwidth, n)),
            "timings": [],
        }
        result["timing_jobs"].append(tj)
        for method in needed:
            lr = float(rates.get(method, _learning_rate(cfg, method)))
            # the compute-only step again, just before the window: under the load its steps meet,
            # over as many steps as the window (a short one is at the mercy of the scheduler)
            compute_s = _compute_s(method, seed, lr, job_cfg, train, world, {}, _window_least(job_cfg, method))
            tj["timings"].append({**_time(method, seed, lr, job_cfg, train, world, rank), "compute_s": compute_s})
            if rank == 0:
                write_job_results(result, out, t0, complete=False)
    if rank == 0:
        write_job_results(result, out, t0, complete=True)


if __name__ == "__main__":
    main()
