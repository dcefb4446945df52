"""optax transformations that communicate: compressed mean, error feedback, DoubleSqueeze, gradient dropping."""

from ._compressed_mean import FUSE_MAX_BYTES, STRATEGIES, CompressedMeanState, compressed_mean
from ._error_feedback import ErrorFeedbackState, error_feedback

from ._doublesqueeze import (
    DoubleSqueezeState,
    doublesqueeze,
    memsgd,
    qsgd_no_feedback,
    topk_no_feedback,
)
from ._local_gradients import (
    GradientDroppingState,
    PeriodicAverageState,
    average_params,
    dgc_warmup,
    drop_ratio_warmup,
    gradient_dropping,
    num_kept,
    periodic_average,
)

__all__ = [
    "DoubleSqueezeState",
    "doublesqueeze",
    "memsgd",
    "qsgd_no_feedback",
    "topk_no_feedback",
    "FUSE_MAX_BYTES",
    "STRATEGIES",
    "CompressedMeanState",
    "compressed_mean",
    "ErrorFeedbackState",
    "error_feedback",
    "GradientDroppingState",
    "PeriodicAverageState",
    "average_params",
    "dgc_warmup",
    "drop_ratio_warmup",
    "gradient_dropping",
    "num_kept",
    "periodic_average",
]
