"""optax transformations that communicate, all built on one per-tensor pipeline.

compensate → compress → communicate → decompress → memory update is written once
(:mod:`jaxcomm.transforms._pipeline`); :func:`error_feedback` runs it over one
worker, :func:`compressed_mean` over the workers' communicator (with ``axis_name=(slow, fast)``:
on each worker's shard over the slow axis, between a dense reduce-scatter and an all-gather over
the fast one), :func:`doublesqueeze` twice (workers, then the server), and
:func:`gradient_dropping` adds Algorithm 2's local-gradient combination;
:func:`deep_gradient_compression` chains :func:`local_clip` with a top-k
``compressed_mean`` around DGC's memory and its :func:`topk_warmup` stages;
:func:`accumulate` communicates once every ``k`` micro-steps; :func:`diloco` takes ``H`` local
steps, then an outer step on the workers' compressed pseudo-gradient. :func:`state_layout` gives
each leaf of a chain's state its ``PartitionSpec`` for a ``jax.shard_map`` step whose parameters
are one replicated copy.
"""

from ._accumulate import accumulate
from ._compressed_mean import compressed_mean
from ._dgc import deep_gradient_compression, topk_warmup
from ._diloco import diloco
from ._doublesqueeze import doublesqueeze
from ._error_feedback import error_feedback
from ._gradient_dropping import average_params, dgc_warmup, drop_ratio_warmup, gradient_dropping, periodic_average
from ._layout import state_layout
from ._local_clip import local_clip
from ._state import CompressionState

__all__ = [
    "compressed_mean",
    "error_feedback",
    "doublesqueeze",
    "gradient_dropping",
    "deep_gradient_compression",
    "local_clip",
    "topk_warmup",
    "dgc_warmup",
    "drop_ratio_warmup",
    "periodic_average",
    "average_params",
    "diloco",
    "accumulate",
    "state_layout",
    "CompressionState",
]
