"""A process that hangs, or never arrives, makes the others fail with a clear timeout.

Run: ``mpirun -n P python eager_failure.py OUT SCENARIO TIMEOUT``. Scenarios:

* ``hang``: solo allreduce; the last rank freezes itself (SIGSTOP, so its
  progress thread stops too) before its fourth call.
* ``initiator``: majority allreduce; the designated initiator of round 3 sleeps
  forever before calling (its progress thread stays alive).
* ``absent``: the last rank never constructs the collective.

Each surviving rank writes ``OUT/rank{r}.json`` with the exception it got,
waits until every survivor has written (a file barrier, since MPI is stuck),
then exits with status 3 without finalizing; mpirun then kills the job.
"""

from __future__ import annotations

import json
import os
import signal
import sys
import time
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parent))
from eager_common import load_partial_mpi

pm = load_partial_mpi()
from mpi4py import MPI  # noqa: E402

SEED = 7
FAIL_ROUND = 3


def culprit(scenario: str, size: int) -> int:
    if scenario == "initiator":
        return pm.majority_initiator(SEED, FAIL_ROUND, size)
    return size - 1


def main(out: Path, scenario: str, timeout: float) -> None:
    comm = MPI.COMM_WORLD
    rank, size = comm.Get_rank(), comm.Get_size()
    bad = culprit(scenario, size)
    comm.Barrier()  # align the starts, so only the culprit can be late
    if scenario == "absent" and rank == bad:
        time.sleep(3600)
    mode = "majority" if scenario == "initiator" else "solo"
    t0 = time.monotonic()
    try:
        pa = pm.PartialAllreduce(4, np.float32, mode=mode, seed=SEED, timeout=timeout)
        for t in range(FAIL_ROUND + 50):
            if rank == bad and t == FAIL_ROUND:
                if scenario == "hang":
                    os.kill(os.getpid(), signal.SIGSTOP)
                else:
                    time.sleep(3600)
            time.sleep(0.002 * (rank + 1))
            pa(np.full(4, rank, np.float32))
        pa.close()
        report = {"error": None}
    except Exception as e:
        report = {
            "error": type(e).__name__,
            "is_timeout": isinstance(e, TimeoutError),
            "missing": list(getattr(e, "missing_ranks", [])),
            "round": getattr(e, "round", None),
            "message": str(e),
        }
    report["seconds"] = time.monotonic() - t0
    report["culprit"] = bad
    (out / f"rank{rank}.json").write_text(json.dumps(report))
    survivors = [r for r in range(size) if r != bad]
    deadline = time.monotonic() + 4 * timeout + 10
    while time.monotonic() < deadline and not all((out / f"rank{r}.json").exists() for r in survivors):
        time.sleep(0.05)
    sys.stdout.flush()
    os._exit(3)


if __name__ == "__main__":
    main(Path(sys.argv[1]), sys.argv[2], float(sys.argv[3]))
