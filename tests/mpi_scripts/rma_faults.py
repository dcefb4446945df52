"""One-sided EventGraD (OneSidedEventGrad) under faults, in the documented ``with`` usage.

Run: ``mpirun -n 3 python rma_faults.py SCENARIO LOCKSTEP TIMEOUT`` (LOCKSTEP 0/1).
The last rank is the culprit. Scenarios: ``ok``; ``slow`` (the culprit sleeps
``TIMEOUT / 3`` s before its fourth step: it must only slow the job); ``hang``
(the culprit's application sleeps forever before its fourth step: the job must
end with an error naming it, at the next lockstep barrier or at ``free``);
``shape`` (the culprit's parameters have another shape: ``ValueError`` naming
it at construction). Nothing is caught: a fault leaving the ``with`` block
aborts the job; ``ok``/``slow`` print ``rank r done``.
"""

from __future__ import annotations

import sys
import time
from pathlib import Path

import jax.numpy as jnp
from mpi4py import MPI

sys.path.insert(0, str(Path(__file__).resolve().parent))
from eventgrad_rma import grad, init_params, problem

from jaxcomm import topology as T
from jaxcomm.algorithms import OneSidedEventGrad, eventgrad

STEPS = 8
FAULT_STEP = 3


def main(scenario: str, lockstep: bool, timeout: float) -> None:
    rank, size = MPI.COMM_WORLD.Get_rank(), MPI.COMM_WORLD.Get_size()
    bad = size - 1
    alg = eventgrad(T.ring(size), 0.2, axis_name="w")
    x, y = problem(rank)
    params = init_params()
    if scenario == "shape" and rank == bad:
        params = dict(params, b2=jnp.zeros(4, jnp.float32))
    with OneSidedEventGrad(alg, params, lockstep=lockstep, timeout=timeout) as ose:
        state = ose.init(params)
        for t in range(STEPS):
            if rank == bad and t == FAULT_STEP:
                if scenario == "hang":
                    time.sleep(3600)
                elif scenario == "slow":
                    time.sleep(timeout / 3)
            params, state = ose.step(params, grad(params, x, y), state)
    print(f"rank {rank} done", flush=True)


if __name__ == "__main__":
    main(sys.argv[1], sys.argv[2] == "1", float(sys.argv[3]))
