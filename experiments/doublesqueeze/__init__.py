"""``jaxcomm run doublesqueeze``: DoubleSqueeze (Tang et al. 2019, Figs. 1-2) and its baselines.

Registration only (no JAX import); the runner is :mod:`experiments.doublesqueeze.run`
and the paper's baselines (MEM-SGD, QSGD and top-k without feedback) are in
:mod:`experiments.doublesqueeze.baselines`.
"""

from jaxcomm.studies import Experiment, register_experiment

from .config import DoubleSqueezeConfig

__all__ = ["EXPERIMENT", "DoubleSqueezeConfig"]

EXPERIMENT = register_experiment(
    Experiment(
        name="doublesqueeze",
        description="DoubleSqueeze (1-bit, top-k) vs MEM-SGD vs QSGD vs top-k without feedback vs SGD",
        config_type=DoubleSqueezeConfig,
        runner=f"{__name__}.run:run",
    )
)
"""The registered experiment."""
