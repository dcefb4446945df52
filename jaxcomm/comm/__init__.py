"""Communicators: one protocol, a mesh-axis backend and an MPI backend.

Every communicator declares the collectives it serves in ``capabilities``, a
``frozenset`` drawn from :data:`CAPABILITIES` (:data:`SUM`, :data:`ALL_GATHER`,
:data:`REDUCE_SCATTER`, :data:`ALL_TO_ALL`, :data:`BROADCAST`, :data:`PERMUTE`);
:func:`require` checks them and :func:`resolve` picks the communicator a
transform uses.
"""

from ._launch import mpirun_env, mpirun_path
from ._local import Local
from ._mesh import MeshAxis
from ._mpi import MPIComm
from ._overlap import AsyncMean
from ._packing import (
    BUCKET_GROWTH,
    MIN_BUCKET_BYTES,
    CountedGather,
    all_gather_counted,
    all_gather_packed,
    bucket_sizes,
    fits_counted_gather,
    has_counted_fields,
    sum_packed,
)
from ._partial_mpi import (
    PARTIAL_MODES,
    PartialAllreduce,
    PartialCollectiveError,
    PartialCollectiveTimeout,
    PartialResult,
    majority_initiator,
)
from ._protocol import (
    ALL_GATHER,
    ALL_TO_ALL,
    BROADCAST,
    CAPABILITIES,
    HOST_MEMBERS,
    PERMUTE,
    REDUCE_SCATTER,
    SUM,
    Communicator,
    capabilities_of,
    current,
    is_communicator,
    require,
    require_host,
    resolve,
    serves,
    use,
)
from ._rma import OneSidedEventGrad, RMAExchange, RMAExchangeTimeout
from ._watchdog import WATCHDOG_ABORT_CODE, MPIWatchdog, MPIWatchdogError

__all__ = [
    "ALL_GATHER",
    "ALL_TO_ALL",
    "BROADCAST",
    "CAPABILITIES",
    "PERMUTE",
    "REDUCE_SCATTER",
    "SUM",
    "all_gather_counted",
    "all_gather_packed",
    "bucket_sizes",
    "fits_counted_gather",
    "BUCKET_GROWTH",
    "CountedGather",
    "has_counted_fields",
    "sum_packed",
    "MIN_BUCKET_BYTES",
    "AsyncMean",
    "Communicator",
    "HOST_MEMBERS",
    "Local",
    "MeshAxis",
    "MPIComm",
    "MPIWatchdog",
    "MPIWatchdogError",
    "WATCHDOG_ABORT_CODE",
    "OneSidedEventGrad",
    "RMAExchange",
    "RMAExchangeTimeout",
    "PARTIAL_MODES",
    "PartialAllreduce",
    "PartialCollectiveError",
    "PartialCollectiveTimeout",
    "PartialResult",
    "capabilities_of",
    "current",
    "is_communicator",
    "majority_initiator",
    "mpirun_env",
    "mpirun_path",
    "require",
    "require_host",
    "resolve",
    "serves",
    "use",
]
