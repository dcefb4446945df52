"""Faults under the documented ``with PartialAllreduce(...)`` usage end the job, naming the culprit.

Run: ``mpirun -n P python eager_faults.py SCENARIO MODE TIMEOUT``. The last rank
is the culprit. Scenarios:

* ``ok``: no fault; the job must exit 0 (no ``MPI_Finalize`` hang).
* ``slow``: the culprit sleeps ``TIMEOUT / 3`` s before its fourth call; a slow
  process only slows the job, so it must exit 0.
* ``hang``: the culprit's application sleeps forever before its fourth call (its
  progress thread stays alive); the job must end with an error naming it.
* ``fewer``: the culprit makes one call fewer than the others.
* ``shape`` / ``dtype``: the culprit constructs the collective with 5 elements /
  float64; every rank must raise a ``ValueError`` naming it before any round.

Nothing is caught: a fault leaves the ``with`` block, which prints it on stderr
and aborts the job (``abort_on_fault``).
"""

from __future__ import annotations

import sys
import time
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parent))
from eager_common import load_partial_mpi

pm = load_partial_mpi()
from mpi4py import MPI  # noqa: E402

STEPS = 12
FAULT_STEP = 3


def main(scenario: str, mode: str, timeout: float) -> None:
    comm = MPI.COMM_WORLD
    rank, size = comm.Get_rank(), comm.Get_size()
    bad = size - 1
    steps = STEPS - 1 if (scenario == "fewer" and rank == bad) else STEPS
    n = 5 if (scenario == "shape" and rank == bad) else 4
    dtype = np.float64 if (scenario == "dtype" and rank == bad) else np.float32
    params = np.zeros(n, dtype)
    with pm.PartialAllreduce(params.shape, dtype, mode=mode, seed=5, timeout=timeout) as pa:
        for step in range(steps):
            if rank == bad and step == FAULT_STEP:
                if scenario == "hang":
                    time.sleep(3600)
                elif scenario == "slow":
                    time.sleep(timeout / 3)
            res = pa(np.full(n, rank + 1, dtype))
            params = params - 0.1 * res.data / pa.size
    print(f"rank {rank} done {params.tolist()}", flush=True)


if __name__ == "__main__":
    main(sys.argv[1], sys.argv[2], float(sys.argv[3]))
