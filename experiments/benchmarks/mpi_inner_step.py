"""A DiLoCo inner step over MPI against the same step over a one-worker communicator.

Run under ``mpirun -n P``: every process builds the time-to-accuracy study's MLP (batch 64 per
worker) with one DiLoCo optimizer twice, once over :class:`jaxcomm.comm.Local` (the study's
compute-only step) and once over :class:`jaxcomm.comm.MPIComm`, both with
``gather_metrics=False``, and times them interleaved: ``--repeats`` rounds, each two periods of
``--every`` steps of one trainer then of the other (the order alternating), every process
starting each block together (a barrier). ``--every 0`` gives the optimizer a period of 1,000
steps, so the timed steps never sync: an inner step of each kind, and nothing else.

Prints, per rank, the median and mean of the inner steps (ms), the mean of each period's last
step (the sync), the mean step, and how often each of the step's two programs ran with the JAX
effects each carries (:class:`jaxcomm.train._step.ScheduledStep`: the inner steps run the quiet
program, which holds no collective); rank 0 writes the same as JSON to ``--out``.

usage: mpirun -n 4 --oversubscribe python experiments/benchmarks/mpi_inner_step.py [--every 40]
       [--repeats 6] [--out PATH]
"""

from __future__ import annotations

import argparse
import json
import os
import sys
from pathlib import Path

os.environ.setdefault("JAX_PLATFORMS", "cpu")
sys.path.insert(0, str(Path(__file__).resolve().parents[2]))  # the repository: `experiments` and `jaxcomm`

import jax
import numpy as np
from mpi4py import MPI

from experiments._common import build_model, load_image_task
from experiments.network import config as study
from jaxcomm import data
from jaxcomm.comm import Local, MPIComm
from jaxcomm.train import Trainer


def trainer(comm, every: int, train) -> Trainer:
    """SparseLoCo 1 % bfloat16 (the study's method) with period ``every`` (0: 1,000)."""
    build = study._diloco(
        every or 1000, compressor=study._topk1_bf16, memory=study._residual09, outer=study._outer_sgd1
    )
    tx, _ = build(0.1, 0.9, {"one_worker": isinstance(comm, Local)})
    return Trainer(build_model("mlp", train, 0), tx, comm=comm, seed=0, gather_metrics=False)


def summary(times_s: list[float], period: int) -> dict:
    """Inner steps' median and mean, each period's last step's mean, and the mean step (ms)."""
    st = np.asarray(times_s) * 1e3
    last = np.arange(len(st)) % period == period - 1
    return {
        "inner_median_ms": float(np.median(st[~last])),
        "inner_mean_ms": float(st[~last].mean()),
        "last_step_mean_ms": float(st[last].mean()),
        "mean_ms": float(st.mean()),
    }


def programs(t: Trainer, state, batches) -> dict:
    """How often each of the step's two programs ran (``calls``) and the JAX effects each carries
    (``effects``): the quiet one, run at the steps that send nothing, holds no collective."""
    batch = t.worker_batch(batches.batch_at(batches.position))
    step = t.step_fn
    return {
        "calls": dict(step.calls),
        "effects": {
            name: sorted(type(e).__name__ for e in getattr(step, name).trace(state, batch).jaxpr.effects)
            for name in step.calls
        },
    }


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(description=(__doc__ or "").splitlines()[0])
    p.add_argument("--every", type=int, default=40, help="DiLoCo period; 0: no sync in the timed steps")
    p.add_argument("--repeats", type=int, default=6)
    p.add_argument("--out", type=Path, default=None)
    args = p.parse_args(argv)
    if args.every < 0 or args.repeats < 1:
        p.error("--every must be >= 0 and --repeats >= 1")
    world = MPI.COMM_WORLD
    rank, n = world.Get_rank(), world.Get_size()
    period = args.every or 40
    train, _ = load_image_task("fashion_mnist", 0, 1)
    shards = data.split_iid(train, n, jax.random.PRNGKey(0))
    runs: dict = {}
    for name, comm, batches in (
        ("local", Local(), data.WorkerBatches([train], 64, jax.random.PRNGKey(1))),
        ("mpi", MPIComm(), data.WorkerBatches(shards, n * 64, jax.random.PRNGKey(2))),
    ):
        t = trainer(comm, args.every, train)
        state, _ = t.fit(t.init_state(), batches, period, progress=False)  # compile, connect
        runs[name] = [t, batches, state, []]
    for rep in range(args.repeats):
        for name in ("local", "mpi") if rep % 2 == 0 else ("mpi", "local"):
            t, batches, state, times = runs[name]
            world.Barrier()
            state, hist = t.fit(state, batches, int(state.step) + 2 * period, progress=False)
            runs[name][2] = state
            times += [row["step_time"] for row in hist]
    mine = {name: {**summary(r[3], period), **programs(r[0], r[2], r[1])} for name, r in runs.items()}
    every_rank = world.gather(mine)
    if rank == 0:
        for r, row in enumerate(every_rank):
            rounded = {k: {m: round(v, 2) if isinstance(v, float) else v for m, v in d.items()} for k, d in row.items()}
            print(r, json.dumps(rounded))
        if args.out is not None:
            result = {"procs": n, "every": args.every, "repeats": args.repeats, "ranks": every_rank}
            args.out.write_text(json.dumps(result, indent=1))


if __name__ == "__main__":
    main()
