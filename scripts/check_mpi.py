"""Set-up check of the MPI stack: mpi4jax's allreduce inside ``jax.jit`` sums across processes.

Run by scripts/setup.sh after building mpi4jax, as ``mpirun -n N python scripts/check_mpi.py``.
Rank r contributes ``arange(3) + r``; the sum over N ranks is ``N * arange(3) + N(N-1)/2``,
compared exactly (small integers in float32). Exits non-zero with the values on mismatch.
"""

import sys

import jax
import jax.numpy as jnp
import mpi4jax
import numpy as np
from mpi4py import MPI


def main() -> int:
    comm = MPI.COMM_WORLD
    rank, size = comm.Get_rank(), comm.Get_size()
    x = jnp.arange(3, dtype=jnp.float32) + rank
    total = jax.jit(lambda v: mpi4jax.allreduce(v, op=MPI.SUM, comm=comm))(x)
    expected = size * np.arange(3, dtype=np.float32) + size * (size - 1) / 2
    if not np.array_equal(np.asarray(total), expected):
        print(f"rank {rank}/{size}: allreduce gave {np.asarray(total)}, expected {expected}", file=sys.stderr)
        return 1
    if rank == 0:
        print(f"[setup] mpi4jax {mpi4jax.__version__}: jit allreduce over {size} processes is exact")
    return 0


if __name__ == "__main__":
    sys.exit(main())
