"""Communicators: one protocol, a mesh-axis backend and an MPI backend."""

from ._protocol import Communicator, current, is_communicator, resolve, use
from ._mesh import MeshAxis
from ._mpi import MPIComm

__all__ = ["Communicator", "MeshAxis", "MPIComm", "current", "is_communicator", "resolve", "use"]
