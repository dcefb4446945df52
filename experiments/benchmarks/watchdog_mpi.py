"""Cost of the MPI watchdog (``MPIComm.watchdog``) per jitted step, on real processes.

Launches ``mpirun -n P`` on this script (one CPU device per process, mpi4jax
collectives inside the jitted step) and times the step of ``fusion_mpi.py``

    g = a_r * x;  ḡ = compressed_mean(c, comm=MPIComm(), memory=...)(g);  x ← x − 0.01 ḡ

in three variants, in interleaved rounds of ``--steps`` steps (A, B, C, C, B, A, ...),
median over ``--repeats`` rounds of the time per step:

* ``async``: the plain loop, outputs awaited once at the end of the round
  (jax's asynchronous dispatch may overlap a step's dispatch with the previous
  step's execution);
* ``sync``: the plain loop, ``jax.block_until_ready`` after every step;
* ``watched``: a watchdog constructed before the round (not timed) and closed
  after it (not timed), the step wrapped by ``watch`` (counters around the call,
  ``block_until_ready`` after it) and the heartbeat thread running meanwhile.

``watched / sync`` is the watchdog's own cost (counters and the thread);
``watched / async`` adds the per-step synchronisation that ``watch`` imposes.
Rank 0 writes the JSON.

usage: python experiments/benchmarks/watchdog_mpi.py [--procs 3] [--trees tiny,resnet20]
       [--compressor topk] [--steps 10] [--repeats 15] [--timeout 60]
       [--out experiments/benchmarks/results/watchdog_mpi.json]
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import sys
import time
from pathlib import Path

HERE = Path(__file__).resolve().parent
ROOT = HERE.parents[1]


def launch(args) -> int:
    """Parent: run this script under mpirun with ``--worker`` (fusion_mpi's launcher)."""
    sys.path.insert(0, str(HERE))
    from fusion_mpi import run_worker

    argv = list(args.argv)
    if "--out" not in argv:
        argv += ["--out", str(Path(args.out).resolve())]
    return run_worker(Path(__file__), args.procs, argv)


def worker(args) -> None:
    """One MPI process: time the three variants; rank 0 saves the results."""
    os.environ.setdefault("XLA_FLAGS", "")  # one CPU device per process (see fusion_mpi.py)
    import jax
    import numpy as np

    sys.path.insert(0, str(HERE))
    from step_overhead import TREES, make_compressor, memory_for

    from jaxcomm.comm import MPIComm
    from jaxcomm.transforms import compressed_mean

    comm = MPIComm()
    rank, size = comm.rank, comm.size
    c = make_compressor(args.compressor)

    def make_step(shapes):
        tx = compressed_mean(c, comm=comm, memory=memory_for(c.name, "grace"))
        rng = np.random.default_rng(0)
        x = {k: (rng.standard_normal(s) * 0.05).astype(np.float32) for k, s in shapes.items()}
        a = {
            k: (np.random.default_rng(1 + rank).standard_normal(s) / 0.05).astype(np.float32) for k, s in shapes.items()
        }

        @jax.jit
        def step(a, x, state):
            g = jax.tree.map(lambda p, s: p * s, x, a)
            u, state = tx.update(g, state, x)
            return jax.tree.map(lambda p, d: p - 0.01 * d, x, u), state

        return step, a, {"x": jax.device_put(x), "s": tx.init(x)}

    def round_(variant, step, a, buf):
        """Seconds per step over ``args.steps`` steps of ``variant``."""
        wd = comm.watchdog(args.timeout) if variant == "watched" else None
        fn = wd.watch(step) if wd is not None else step
        comm.comm.Barrier()
        t0 = time.perf_counter()
        for _ in range(args.steps):
            buf["x"], buf["s"] = fn(a, buf["x"], buf["s"])
            if variant == "sync":
                jax.block_until_ready(buf["x"])
        jax.block_until_ready((buf["x"], buf["s"]))
        dt = (time.perf_counter() - t0) / args.steps
        if wd is not None:
            wd.close()
        return dt

    out = {
        "meta": {
            "benchmark": "watchdog_mpi",
            "processes": size,
            "compressor": args.compressor,
            "steps_per_round": args.steps,
            "repeats": args.repeats,
            "timeout_s": args.timeout,
            "host_cpus": os.cpu_count(),
            "platform": platform.platform(),
            "jax": jax.__version__,
            "load_average_at_start": list(os.getloadavg()),
            "command": "python experiments/benchmarks/watchdog_mpi.py " + " ".join(args.argv),
        },
        "trees": {},
    }
    variants = ["async", "sync", "watched"]
    for tree in [t for t in args.trees.split(",") if t]:
        step, a, buf = make_step(TREES[tree]())
        for v in variants:  # compile and warm up
            round_(v, step, a, buf)
        times = {v: [] for v in variants}
        for i in range(args.repeats):
            for v in variants if i % 2 == 0 else variants[::-1]:
                times[v].append(round_(v, step, a, buf))
        med = {v: float(np.median(t)) * 1e3 for v, t in times.items()}
        res = {
            **{f"{v}_ms": med[v] for v in variants},
            "watched_over_sync_paired": float(np.median(np.asarray(times["watched"]) / np.asarray(times["sync"]))),
            "watched_over_async_paired": float(np.median(np.asarray(times["watched"]) / np.asarray(times["async"]))),
            "sync_over_async_paired": float(np.median(np.asarray(times["sync"]) / np.asarray(times["async"]))),
            "step_ms": {v: [1e3 * t for t in ts] for v, ts in times.items()},
        }
        out["trees"][tree] = res
        if rank == 0:
            print(
                f"{tree:9s} async {med['async']:8.2f} ms  sync {med['sync']:8.2f} ms  watched {med['watched']:8.2f} ms"
                f"  watched/sync {res['watched_over_sync_paired']:.3f}  watched/async "
                f"{res['watched_over_async_paired']:.3f}",
                flush=True,
            )
    if rank == 0:
        out["meta"]["load_average_at_end"] = list(os.getloadavg())
        Path(args.out).parent.mkdir(parents=True, exist_ok=True)
        Path(args.out).write_text(json.dumps(out, indent=2) + "\n")
        print(f"wrote {args.out}")


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--procs", type=int, default=3)
    ap.add_argument("--trees", default="tiny,resnet20")
    ap.add_argument("--compressor", default="topk")
    ap.add_argument("--steps", type=int, default=10)
    ap.add_argument("--repeats", type=int, default=15)
    ap.add_argument("--timeout", type=float, default=60.0)
    ap.add_argument("--out", default="experiments/benchmarks/results/watchdog_mpi.json")
    ap.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    args = ap.parse_args(argv)
    args.argv = [a for a in (sys.argv[1:] if argv is None else argv) if a != "--worker"]
    if args.procs < 2:
        ap.error(f"--procs must be >= 2; got {args.procs}")
    if args.worker:
        worker(args)
        return 0
    return launch(args)


if __name__ == "__main__":
    sys.exit(main())
