"""Communicators: one protocol, a mesh-axis backend and an MPI backend.

Every communicator declares the collectives it serves in ``capabilities``, a
``frozenset`` of names drawn from :data:`CAPABILITIES` (``"sum"``, ``"all_gather"``,
``"reduce_scatter"``, ``"all_to_all"``, ``"broadcast"``, ``"permute"``); :func:`require` checks
them, :func:`is_communicator` checks the declaration itself, and :func:`resolve` picks the
communicator a transform uses (the one :func:`use` set while tracing a step: :func:`current`).
:func:`all_gather_packed` and :func:`all_gather_counted` gather many tensors, or variable-length
payloads, with one collective. :class:`AsyncMean`, :class:`PartialAllreduce` and
:class:`MPIWatchdog` run on the host beside jitted MPI steps.
"""

from ._local import Local
from ._mesh import MeshAxis
from ._mpi import MPIComm
from ._overlap import AsyncMean
from ._packing import all_gather_counted, all_gather_packed
from ._partial_mpi import PartialAllreduce
from ._partial_protocol import PartialCollectiveError, PartialCollectiveTimeout
from ._protocol import CAPABILITIES, Communicator, current, is_communicator, require, resolve, use
from ._watchdog import MPIWatchdog, MPIWatchdogError

__all__ = [
    # the protocol and its backends
    "Communicator",
    "CAPABILITIES",
    "MeshAxis",
    "MPIComm",
    "Local",
    # choosing and checking a communicator
    "use",
    "current",
    "resolve",
    "require",
    "is_communicator",
    # one collective for many tensors
    "all_gather_packed",
    "all_gather_counted",
    # host-side MPI: overlapped means, eager-SGD's partial allreduce, the hang watchdog
    "AsyncMean",
    "PartialAllreduce",
    "PartialCollectiveError",
    "PartialCollectiveTimeout",
    "MPIWatchdog",
    "MPIWatchdogError",
]
