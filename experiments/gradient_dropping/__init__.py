"""``jaxcomm run gradient-dropping``: gradient dropping with local gradients (Algorithm 2), perplexity per step.

Registration only (no JAX import); the runner is :mod:`experiments.gradient_dropping.run`.
"""

from jaxcomm.studies import Experiment, register_experiment

from .config import GradientDroppingConfig

__all__ = ["EXPERIMENT", "GradientDroppingConfig"]

EXPERIMENT = register_experiment(
    Experiment(
        name="gradient-dropping",
        description="Char-LSTM on Shakespeare: baseline, drop 99%, +SUM/+PARTIAL/+ERROR, with/without sync",
        config_type=GradientDroppingConfig,
        runner=f"{__name__}.run:run",
    )
)
"""The registered experiment."""
