"""MPI worker: check MPIComm's protocol, run every case of CASES with MPIComm; rank 0 saves the results.

Usage: ``mpirun -n 4 python tests/mpi_scripts/compressed_mean_mpi.py OUT.npz``.
The npz holds ``{case}/{leaf}`` arrays of shape ``(n, *leaf_shape)``: every
rank's final parameters, gathered with mpi4py, and ``protocol_ok`` (1 when
:func:`check_protocol` passed on every rank; a failed assertion exits non-zero).
"""

from __future__ import annotations

import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

import numpy as np
from compressed_mean_common import CASES, check_protocol, run_mpi
from mpi4py import MPI

from jaxcomm.comm import MPIComm


def main(out: str) -> None:
    comm = MPIComm()
    assert comm.size >= 2, "run under mpirun -n N with N >= 2"
    check_protocol(comm)
    ok = MPI.COMM_WORLD.allreduce(1, op=MPI.SUM) == comm.size
    results = {"protocol_ok": np.int32(ok)}
    for case in CASES:
        x = run_mpi(case, comm)
        for leaf, v in x.items():
            gathered = MPI.COMM_WORLD.gather(v, root=0)
            if comm.rank == 0:
                results[f"{case}/{leaf}"] = np.stack(gathered)
    if comm.rank == 0:
        np.savez(out, **results)
        print("cases:", ", ".join(CASES))


if __name__ == "__main__":
    main(sys.argv[1])
