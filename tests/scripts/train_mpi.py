"""One MPI process of a data-parallel run with the MPI communicator (one worker per process).

usage: mpirun -n P python train_mpi.py OUT [CKPT RESUMED]     (rank 0 writes the .npz files)

The uninterrupted 8-step run writes OUT; the same run with the trainer's ``gather_metrics=False``
writes every rank's own losses and bits to ``OUT`` with ``.npz`` replaced by ``_local{rank}.npz``.
With CKPT and RESUMED, the same launch then runs the job again, interrupted after 4 of its 8 steps
and resumed from its checkpoints (one folder per rank under CKPT), as a restarted job would be, and
writes the resumed run's result to RESUMED. One launch for all runs: each ``mpirun`` pays process
start, the jax import and compilation.
"""

import os
import sys

os.environ["JAX_PLATFORMS"] = "cpu"
sys.path.insert(0, os.path.dirname(__file__))

import digits_job

from jaxcomm.comm import MPIComm

if len(sys.argv) not in (2, 4):
    sys.exit(f"usage: {sys.argv[0]} OUT [CKPT RESUMED]")
comm = MPIComm()
result = digits_job.run(comm.size, comm=comm)
if comm.rank == 0:
    digits_job.save(sys.argv[1], *result)
local = digits_job.run(comm.size, comm=comm, gather_metrics=False)
digits_job.save(sys.argv[1].removesuffix(".npz") + f"_local{comm.rank}.npz", *local)
if len(sys.argv) == 4:
    digits_job.run(comm.size, comm=comm, checkpoint_dir=sys.argv[2], stop=4)  # "killed" after step 4
    result = digits_job.run(comm.size, comm=comm, checkpoint_dir=sys.argv[2])  # the restarted job
    if comm.rank == 0:
        digits_job.save(sys.argv[3], *result)
