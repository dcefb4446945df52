"""Communicators: one protocol, a mesh-axis backend and an MPI backend."""

from ._protocol import Communicator, current, is_communicator, resolve, use
from ._mesh import MeshAxis
from ._mpi import MPIComm
from ._launch import mpirun_env, mpirun_path
from ._packing import all_gather_packed
from ._rma import OneSidedEventGrad, RMAExchange
from ._partial_mpi import (
    PartialAllreduce,
    PartialCollectiveError,
    PartialCollectiveTimeout,
    PartialResult,
    majority_initiator,
)

__all__ = [
    "all_gather_packed",
    "Communicator",
    "MeshAxis",
    "MPIComm",
    "OneSidedEventGrad",
    "RMAExchange",
    "PartialAllreduce",
    "PartialCollectiveError",
    "PartialCollectiveTimeout",
    "PartialResult",
    "current",
    "is_communicator",
    "majority_initiator",
    "mpirun_env",
    "mpirun_path",
    "resolve",
    "use",
]
