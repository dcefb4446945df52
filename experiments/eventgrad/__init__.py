"""EventGraD (Ghosh et al.): D-PSGD against event-triggered exchange on a ring.

* ``jaxcomm run eventgrad`` (Tables 1-2, Figs. 1/4/5): workers simulated with ``jax.vmap``.
* ``jaxcomm run eventgrad-ring``: 4 MPI processes on one-sided windows on an emulated link, trained
  to a plateau, several seeds, with verdicts.

Registration only (no JAX import); the runners are :mod:`experiments.eventgrad.run` and
:mod:`experiments.eventgrad.ring`, the per-rank MPI worker :mod:`experiments.eventgrad.worker`.
"""

from jaxcomm.studies import Experiment, register_experiment

from .config import EventGradConfig, EventGradRingConfig

__all__ = ["EXPERIMENT", "RING", "EventGradConfig", "EventGradRingConfig"]

EXPERIMENT = register_experiment(
    Experiment(
        name="eventgrad",
        description="EventGraD Tables 1-2, Figs. 1/4/5: D-PSGD vs event-triggered (and top-K) exchange on a ring",
        config_type=EventGradConfig,
        runner=f"{__name__}.run:run",
    )
)
"""The registered experiment."""

RING = register_experiment(
    Experiment(
        name="eventgrad-ring",
        description="EventGraD vs D-PSGD (+ top-K), MPI one-sided windows on a ring, emulated link, to plateau, seeds",
        config_type=EventGradRingConfig,
        runner=f"{__name__}.ring:run",
    )
)
"""The registered ``eventgrad-ring`` experiment."""
