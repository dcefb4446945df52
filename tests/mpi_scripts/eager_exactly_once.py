"""Exactly-once delivery of the real partial allreduce (run: mpirun -n P python eager_exactly_once.py OUT STEPS SEED).

Every rank sends a one-hot gradient per step, coded by (rank, step), after a
random sleep drawn from a stream shared by all ranks. For each configuration
(mode, sync_every) every rank saves what it received; the test checks the
properties with NumPy.
"""

from __future__ import annotations

import sys
import threading
import time
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parent))
from eager_common import load_partial_mpi

pm = load_partial_mpi()
from mpi4py import MPI  # noqa: E402

CONFIGS = [("solo", 0), ("majority", 0), ("sync", 0), ("solo", 4)]


def main(out: Path, steps: int, seed: int) -> None:
    comm = MPI.COMM_WORLD
    rank, size = comm.Get_rank(), comm.Get_size()
    rng = np.random.default_rng(seed)  # same stream on every rank
    levels_ms = np.array([0.0, 1.0, 4.0, 15.0, 40.0])
    for ci, (mode, sync_every) in enumerate(CONFIGS):
        delays = levels_ms[rng.integers(0, len(levels_ms), size=(steps, size))]
        n = size * steps
        data = np.zeros((steps, n), np.float32)
        mask = np.zeros((steps, size), bool)
        included = np.zeros(steps, bool)
        nap = np.zeros(steps, np.int64)
        rounds = np.zeros(steps, np.int64)
        comm.Barrier()
        pa = pm.PartialAllreduce(n, np.float32, mode=mode, seed=seed + ci, timeout=30.0, sync_every=sync_every)
        for t in range(steps):
            time.sleep(delays[t, rank] / 1000.0)
            g = np.zeros(n, np.float32)
            g[rank * steps + t] = 1.0
            res = pa(g)
            data[t], mask[t], included[t], nap[t], rounds[t] = (
                res.data,
                res.contributors,
                res.included,
                res.nap,
                res.round,
            )
        pa.close()
        leftover = pa.leftover()
        np.savez(
            out / f"cfg{ci}_rank{rank}.npz",
            mode=mode,
            sync_every=sync_every,
            data=data,
            mask=mask,
            included=included,
            nap=nap,
            rounds=rounds,
            leftover=leftover,
            threads=threading.active_count(),
            pending=pa.pending_requests(),
            initiators=np.array([pa.initiator(t) for t in range(steps)]),
        )


if __name__ == "__main__":
    main(Path(sys.argv[1]), int(sys.argv[2]), int(sys.argv[3]))
