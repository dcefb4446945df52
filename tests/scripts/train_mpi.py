"""One MPI process of a data-parallel run with the MPI communicator (one worker per process).

usage: mpirun -n P python train_mpi.py OUT      (rank 0 writes OUT, .npz)
"""

import os
import sys

os.environ["JAX_PLATFORMS"] = "cpu"
sys.path.insert(0, os.path.dirname(__file__))

import digits_job

from jaxcomm.comm import MPIComm

comm = MPIComm()
result = digits_job.run(comm.size, comm=comm)
if comm.rank == 0:
    digits_job.save(sys.argv[1], *result)
