"""MPI worker of ``jaxcomm run time-to-accuracy``: one process per rank, on the emulated link.

``python -m jaxcomm.experiments.network.worker DIR`` (started by
:func:`jaxcomm.experiments.network.run.run` through :func:`jaxcomm.netem.launch`) reads
``DIR/config.json`` (the :class:`~.config.TimeToAccuracyConfig` fields and ``bandwidth``) and
rank 0 writes ``DIR/results.json`` (again after every run, ``"complete"`` once all are done):

* ``link``: the latency ``α`` (s) and throughput (bit/s) of the link as Open MPI sees it,
  measured first: ``α`` = the median time of an 8-byte ``MPI_Allreduce`` over its ``2 (n − 1)``
  ring steps; the throughput = ``8 · 2 (n − 1) P`` over the median time of a ``P = 4 MiB``
  ring all-reduce, less its latency.
* ``runs``: per method and seed, the training curve and its measurements:

  - ``compute_s``: median step time of the same optimizer with a one-worker communicator
    (:class:`jaxcomm.comm.Local`: forward, backward, compression and decoding, no
    communication), timed on every rank at once so the processes share the CPU as in training;
  - ``curve``: after every ``eval_every`` steps: ``step``, ``time_s`` (the training steps'
    wall-clock seconds so far on rank 0: evaluation, data loading and compilation are not
    counted), ``accuracy`` (test accuracy over ``eval_examples``, evaluated in parallel),
    ``link_bytes`` (bytes the kernel's qdisc passed during those steps, all ranks) and
    ``wire_bits`` (the pipeline's count for one worker);
  - ``step_s``: median step time; ``wire_bits_per_step`` (one worker's, from the optimizer
    state) and ``messages_per_step`` (the collectives' arrays of all workers together, the
    trainer's ``messages`` metric).

The job trains until the test accuracy reaches ``target_accuracy`` or ``max_steps``; every rank
makes the same decision (the accuracy is all-reduced). Rank 0 shows one progress bar per run
(one line per evaluation when its output is not a terminal, as under ``mpirun``).
"""

from __future__ import annotations

import json
import sys
import time
from pathlib import Path

import numpy as np

__all__ = ["compute_step_time", "main", "measure_link"]


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
    train=None,
    world=None,
) -> float:
    """Median seconds of one training step of ``method`` on this process's default device,
    without communication: the same optimizer with a one-worker communicator
    (:class:`jaxcomm.comm.Local`), i.e. forward, backward, compression and decoding.

    This is the compute side of the balance that ``jaxcomm run time-to-accuracy`` measures:
    run it on a GPU and on this CPU, and ``N = T_cpu / T_gpu`` maps a link of ``X`` bit/s
    here to one of ``N X`` bit/s beside that GPU (see docs/network.md).

    Args:
      model, dataset: as :class:`~jaxcomm.experiments.network.config.TimeToAccuracyConfig`.
      batch_size: examples per step (one worker's batch).
      method: a label of :data:`~jaxcomm.experiments.network.config.METHODS`.
      learning_rate, momentum: of ``optax.sgd``.
      steps: steps timed after two untimed ones (compilation), ``>= 1``.
      seed: initialisation and data order.
      train: the training :class:`~jaxcomm.data.Dataset` (default: loaded from ``dataset``).
      world: an mpi4py communicator: every rank times its own steps at once (after a
        barrier), so that processes sharing the cores share them as in training.
    Returns:
      the median step time in seconds (compilation excluded).
    """
    import jax

    from jaxcomm import data
    from jaxcomm.comm import Local
    from jaxcomm.train import Trainer

    from .._common import build_model, load_image_task, method_transform
    from .config import METHODS

    if int(steps) < 1:
        raise ValueError(f"steps: must be >= 1; got {steps}")
    if train is None:
        train, _ = load_image_task(dataset, 0, 1)
    tx, _ = method_transform(METHODS, method, learning_rate, momentum)
    trainer = Trainer(build_model(model, train, seed), tx, comm=Local(), seed=seed)
    batches = data.WorkerBatches([train], int(batch_size), jax.random.PRNGKey(seed + 7))
    state = trainer.init_state()
    rank = 0 if world is None else world.Get_rank()
    _compile(trainer, state, batches, world, rank)
    state, _ = trainer.fit(state, batches, 2, progress=False)
    if world is not None:
        world.Barrier()
    state, hist = trainer.fit(state, batches, 2 + int(steps), progress=False)
    return float(np.median([row["step_time"] for row in hist]))


def _train(method: str, seed: int, cfg: dict, train, test_shard, world, rank: int) -> dict:
    import jax
    from tqdm.auto import tqdm

    from jaxcomm import data
    from jaxcomm.comm import MPIComm
    from jaxcomm.netem import link_counters
    from jaxcomm.train import Trainer

    from .._common import build_model, method_transform
    from .config import METHODS

    n = world.Get_size()
    lr, momentum = float(cfg["learning_rate"]), float(cfg["momentum"])
    tx, compressor = method_transform(METHODS, method, lr, momentum)
    world.Barrier()
    compute_s = compute_step_time(
        model=cfg["model"],
        batch_size=int(cfg["batch_size"]),
        method=method,
        learning_rate=lr,
        momentum=momentum,
        steps=int(cfg["compute_steps"]),
        seed=seed,
        train=train,
        world=world,
    )
    compute_s = float(np.max(world.allgather(compute_s)))  # the slowest rank paces the step

    trainer = Trainer(build_model(cfg["model"], train, seed), tx, comm=MPIComm(), seed=seed)
    key = jax.random.PRNGKey(seed)
    shards = data.split_iid(train, n, key)
    global_batch = n * int(cfg["batch_size"])  # WorkerBatches takes the global batch
    warm = data.WorkerBatches(shards, global_batch, jax.random.fold_in(key, 2))
    _compile(trainer, trainer.init_state(), warm, world, rank)
    trainer.fit(trainer.init_state(), warm, 2, progress=False)  # load the executable, connect
    batches = data.WorkerBatches(shards, global_batch, jax.random.fold_in(key, 1))
    state = trainer.init_state()

    target, max_steps, every = float(cfg["target_accuracy"]), int(cfg["max_steps"]), int(cfg["eval_every"])
    curve, step_times, bits, messages = [], [], [], []
    elapsed, total_bytes, step = 0.0, 0, 0
    desc = f"{cfg['bandwidth']} {method} seed {seed}"
    # Under mpirun the output is a pipe, which holds a bar's carriage-return updates back:
    # then one line per evaluation instead.
    lines = rank == 0 and not sys.stderr.isatty()
    bar = tqdm(total=max_steps, desc=desc, disable=rank != 0 or lines, leave=True)
    reached = None
    while step < max_steps:
        world.Barrier()
        before = link_counters() if rank == 0 else None
        state, hist = trainer.fit(state, batches, min(step + every, max_steps), progress=False)
        world.Barrier()
        if before is not None:  # rank 0
            total_bytes += (link_counters() - before).bytes
        step = hist[-1]["step"]
        step_times += [row["step_time"] for row in hist]
        bits += [row["wire_bits"] for row in hist]
        messages += [row["messages"] for row in hist]
        elapsed += sum(row["step_time"] for row in hist)
        local = trainer.evaluate(state, test_shard.images, test_shard.labels)
        accuracy = float(world.allreduce(local["accuracy"])) / n
        curve.append(
            {
                "step": step,
                "time_s": elapsed,
                "accuracy": accuracy,
                "loss": float(world.allreduce(local["loss"])) / n,
                "link_bytes": total_bytes,
                "wire_bits": float(sum(bits)),
            }
        )
        bar.update(len(hist))
        bar.set_postfix(acc=f"{accuracy:.3f}", s=f"{elapsed:.0f}")
        if lines:
            print(f"{desc}: step {step}/{max_steps}, test accuracy {accuracy:.3f}, {elapsed:.1f} s", flush=True)
        if accuracy >= target:
            reached = {"step": step, "time_s": elapsed}
            break
    bar.close()
    return {
        "method": method,
        "seed": seed,
        "compressor": compressor.name,
        "strategy": "rounds" if compressor.rounds is not None else compressor.strategy,
        "compute_s": compute_s,
        "step_s": float(np.median(step_times)),
        "wire_bits_per_step": float(np.median(bits)),
        "messages_per_step": float(np.median(messages)),
        "link_bytes_per_step": total_bytes / max(step, 1),
        "steps": step,
        "reached": reached,
        "curve": curve,
    }


def main(argv: list[str] | None = None) -> None:
    """Run every method and seed of ``DIR/config.json``; rank 0 writes ``DIR/results.json``."""
    argv = sys.argv[1:] if argv is None else argv
    if len(argv) != 1:
        raise SystemExit("usage: python -m jaxcomm.experiments.network.worker DIR")
    out = Path(argv[0])
    cfg = json.loads((out / "config.json").read_text())
    from mpi4py import MPI

    from .._common import load_image_task

    world = MPI.COMM_WORLD
    rank, n = world.Get_rank(), world.Get_size()
    train, test = load_image_task(cfg["dataset"], int(cfg["train_examples"]), 0)
    per = int(cfg["eval_examples"]) // n
    test_shard = test.take(np.arange(rank * per, (rank + 1) * per))
    link = measure_link(world)
    runs: list[dict] = []
    t0 = time.perf_counter()
    for seed in cfg["seeds"]:
        for method in cfg["methods"]:
            runs.append(_train(method, int(seed), cfg, train, test_shard, world, rank))
            if rank == 0:  # after every run, so that an interrupted job keeps what it measured
                result = {
                    "bandwidth": cfg["bandwidth"],
                    "procs": n,
                    "link": link,
                    "runs": runs,
                    "job_s": time.perf_counter() - t0,
                    "complete": len(runs) == len(cfg["seeds"]) * len(cfg["methods"]),
                }
                partial = out / "results.json.partial"
                partial.write_text(json.dumps(result, indent=1))
                partial.replace(out / "results.json")


if __name__ == "__main__":
    main()
