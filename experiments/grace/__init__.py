"""``jaxcomm run grace``: GRACE Figs. 6/7, quality vs data volume and vs estimated time, whole catalogue.

Registration only (no JAX import); the runner is :mod:`experiments.grace.run`.
"""

from jaxcomm.studies import Experiment, register_experiment

from .config import GraceConfig

__all__ = ["EXPERIMENT", "GraceConfig"]

EXPERIMENT = register_experiment(
    Experiment(
        name="grace",
        description="GRACE Fig. 6/7: accuracy vs wire bits and estimated time, whole catalogue, with/without EF",
        config_type=GraceConfig,
        runner=f"{__name__}.run:run",
    )
)
"""The registered experiment."""
