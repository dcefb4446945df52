"""Communicators: one protocol, a mesh-axis backend and an MPI backend."""

from ._protocol import Communicator, resolve
from ._mesh import MeshAxis

__all__ = ["Communicator", "MeshAxis", "resolve"]
