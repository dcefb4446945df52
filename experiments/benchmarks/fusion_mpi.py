"""Tensor fusion over MPI: compressed_mean(fuse=True) against fuse=False, on real processes.

Launches ``mpirun -n P`` on this script (one CPU device per process, mpi4jax
collectives inside the jitted step) and times, per compressor, the step

    g = a_r * x            (a per-rank elementwise stand-in for back-propagation)
    ḡ = compressed_mean(c, comm=MPIComm(), memory=..., fuse=F)(g)
    x ← x − 0.01 ḡ

with ``fuse=True`` (every tensor's payload in one packed ``MPI_Allgather``) and
``fuse=False`` (one ``MPI_Allgather`` per tensor and payload field), interleaved
in one process (A, B, B, A, ...) with the uncompressed ``none()`` step, median
of ``--repeats`` steps after warm-up. Every MPI collective is a real message
exchange between processes, with a per-call latency the simulated devices of
``step_overhead.py`` do not have. The memory follows GRACE (``--memory grace``
of step_overhead.py: none for QSGD and the sign methods, residual for top-k).
Rank 0 writes the JSON.

usage: python experiments/benchmarks/fusion_mpi.py [--procs 4] [--trees resnet20,vgg16]
       [--compressors topk,qsgd] [--repeats 15] [--out experiments/benchmarks/results/fusion_mpi.json]
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import subprocess
import sys
import time
from pathlib import Path

HERE = Path(__file__).resolve().parent
ROOT = HERE.parents[1]


def launch(args) -> int:
    """Parent: run this script under mpirun with ``--worker``."""
    from jaxcomm.comm import mpirun_env, mpirun_path

    mpirun = mpirun_path()
    if mpirun is None:
        raise SystemExit("mpirun not found: install the project's 'mpi' extra (pip install -e .[mpi])")
    env = mpirun_env()
    env["PYTHONPATH"] = os.pathsep.join([str(ROOT), env.get("PYTHONPATH", "")])
    cmd = [
        mpirun,
        "-n",
        str(args.procs),
        "--oversubscribe",
        sys.executable,
        str(Path(__file__).resolve()),
        "--worker",
        "--trees",
        args.trees,
        "--compressors",
        args.compressors,
        "--repeats",
        str(args.repeats),
        "--out",
        str(Path(args.out).resolve()),
    ]
    return subprocess.run(cmd, env=env, cwd=ROOT).returncode


def worker(args) -> None:
    """One MPI process: build and time the steps; rank 0 saves the results."""
    # One CPU device per process (mpirun_env removed XLA_FLAGS): keep step_overhead's
    # import from asking for 8 simulated devices.
    os.environ.setdefault("XLA_FLAGS", "")
    import jax
    import numpy as np

    sys.path.insert(0, str(HERE))
    from step_overhead import TREES, make_compressor, memory_for

    import jaxcomm as jc
    from jaxcomm.comm import MPIComm
    from jaxcomm.transforms import compressed_mean

    comm = MPIComm()
    rank, size = comm.rank, comm.size

    def runner(c, shapes, fuse):
        tx = compressed_mean(c, comm=comm, memory=memory_for(c.name, "grace"), fuse=fuse)
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

        buf = {"x": jax.device_put(x), "s": tx.init(x)}

        def call():
            t0 = time.perf_counter()
            buf["x"], buf["s"] = step(a, buf["x"], buf["s"])
            jax.block_until_ready(buf["x"])
            return time.perf_counter() - t0

        return call

    out = {
        "meta": {
            "benchmark": "fusion_mpi",
            "processes": size,
            "devices_per_process": jax.local_device_count(),
            "host_cpus": os.cpu_count(),
            "platform": platform.platform(),
            "jax": jax.__version__,
            "repeats": args.repeats,
            "load_average_at_start": list(os.getloadavg()),
            "command": "python experiments/benchmarks/fusion_mpi.py " + " ".join(args.argv),
            "memory": "GRACE Table I (none for qsgd/sign methods, residual otherwise)",
        },
        "trees": {},
    }
    for tree in [t for t in args.trees.split(",") if t]:
        shapes = TREES[tree]()
        res = {}
        for name in [c for c in args.compressors.split(",") if c]:
            c = make_compressor(name)
            calls = {
                "none": runner(jc.compressors.none(), shapes, True),
                "fused": runner(c, shapes, True),
                "unfused": runner(c, shapes, False),
            }
            for f in calls.values():  # compile and warm up
                f(), f()
            times = {k: [] for k in calls}
            order = list(calls)
            for i in range(args.repeats):
                for k in order if i % 2 == 0 else order[::-1]:
                    times[k].append(calls[k]())
            # every rank's step ends at the same collective; take rank 0's clock
            med = {k: float(np.median(v)) * 1e3 for k, v in times.items()}
            res[name] = {
                "none_ms": med["none"],
                "fused_ms": med["fused"],
                "unfused_ms": med["unfused"],
                "fused_ratio": med["fused"] / med["none"],
                "unfused_ratio": med["unfused"] / med["none"],
                "fused_over_unfused_paired": float(
                    np.median(np.asarray(times["fused"]) / np.asarray(times["unfused"]))
                ),
                "steps_ms": {k: [1e3 * t for t in v] for k, v in times.items()},
            }
            if rank == 0:
                r = res[name]
                print(
                    f"{tree:9s} {name:8s} none {r['none_ms']:8.1f} ms  fused {r['fused_ms']:8.1f} ms "
                    f"({r['fused_ratio']:.2f}x)  unfused {r['unfused_ms']:8.1f} ms ({r['unfused_ratio']:.2f}x)  "
                    f"fused/unfused {r['fused_over_unfused_paired']:.3f}",
                    flush=True,
                )
        out["trees"][tree] = {"num_tensors": len(shapes), "results": res}
    if rank == 0:
        out["meta"]["load_average_at_end"] = list(os.getloadavg())
        Path(args.out).parent.mkdir(parents=True, exist_ok=True)
        Path(args.out).write_text(json.dumps(out, indent=2) + "\n")
        print(f"wrote {args.out}")


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--procs", type=int, default=4)
    ap.add_argument("--trees", default="resnet20,vgg16")
    ap.add_argument("--compressors", default="topk,qsgd")
    ap.add_argument("--repeats", type=int, default=15)
    ap.add_argument("--out", default="experiments/benchmarks/results/fusion_mpi.json")
    ap.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    args = ap.parse_args(argv)
    args.argv = list(sys.argv[1:] if argv is None else argv)
    if args.procs < 2:
        ap.error(f"--procs must be >= 2; got {args.procs}")
    if args.worker:
        worker(args)
        return 0
    return launch(args)


if __name__ == "__main__":
    sys.exit(main())
