"""One MPI process of a data-parallel run with the MPI communicator (one worker per process).

usage: mpirun -n P python train_mpi.py OUT [CKPT]     (rank 0 writes OUT, .npz)

With CKPT the run is interrupted after 4 of its 8 steps and resumed from its checkpoints
(one folder per rank), as a restarted job would be.
"""

import os
import sys

os.environ["JAX_PLATFORMS"] = "cpu"
sys.path.insert(0, os.path.dirname(__file__))

import digits_job

from jaxcomm.comm import MPIComm

comm = MPIComm()
if len(sys.argv) > 2:
    digits_job.run(comm.size, comm=comm, checkpoint_dir=sys.argv[2], stop=4)  # "killed" after step 4
    result = digits_job.run(comm.size, comm=comm, checkpoint_dir=sys.argv[2])  # the restarted job
else:
    result = digits_job.run(comm.size, comm=comm)
if comm.rank == 0:
    digits_job.save(sys.argv[1], *result)
