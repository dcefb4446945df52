"""``jaxcomm run quickstart``: the README's study, compression vs none on MNIST with 8 simulated devices.

Registration only (no JAX import); the runner is :mod:`experiments.quickstart.run`.
"""

from jaxcomm.studies import Experiment, register_experiment

from .config import QuickstartConfig

__all__ = ["EXPERIMENT", "QuickstartConfig"]

EXPERIMENT = register_experiment(
    Experiment(
        name="quickstart",
        description=(
            "MNIST on 8 simulated devices: no compression vs top-k/EF-signSGD/PowerSGD with error feedback, QSGD"
        ),
        config_type=QuickstartConfig,
        runner=f"{__name__}.run:run",
    )
)
"""The registered experiment."""
