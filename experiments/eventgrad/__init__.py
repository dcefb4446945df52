"""``jaxcomm run eventgrad``: EventGraD Tables 1-2 and Figs. 1/4/5, D-PSGD vs event-triggered exchange.

Registration only (no JAX import); the runner is :mod:`experiments.eventgrad.run`.
"""

from jaxcomm.studies import Experiment, register_experiment

from .config import EventGradConfig

__all__ = ["EXPERIMENT", "EventGradConfig"]

EXPERIMENT = register_experiment(
    Experiment(
        name="eventgrad",
        description="EventGraD Tables 1-2, Figs. 1/4/5: D-PSGD vs event-triggered (and top-K) exchange on a ring",
        config_type=EventGradConfig,
        runner=f"{__name__}.run:run",
    )
)
"""The registered experiment."""
