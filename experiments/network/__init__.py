"""The library's own result: compressed data-parallel training on a real, throttled network.

* ``jaxcomm run time-to-accuracy``: MPI processes in a private network namespace whose
  loopback is shaped to each bandwidth of the configuration (:mod:`jaxcomm.netem`); dense
  against compressed and local-update methods, measured wall-clock time to a test accuracy,
  bytes counted by the kernel, and :mod:`jaxcomm.cost_model`'s prediction beside each. The
  command prints the headline table (:func:`~experiments.network.run.headline`).

Registration only (no JAX import): the launcher is :mod:`experiments.network.run`,
the per-rank MPI worker :mod:`experiments.network.worker`.
"""

from jaxcomm.studies import Experiment, register_experiment

from .config import METHODS, TimeToAccuracyConfig

__all__ = ["EXPERIMENT", "METHODS", "TimeToAccuracyConfig"]


def _headline(results: dict) -> list[dict]:
    """The headline table of a study's results (imports the runner's module on first use)."""
    from .run import headline

    return headline(results)


EXPERIMENT = register_experiment(
    Experiment(
        name="time-to-accuracy",
        description="an MLP on Fashion-MNIST, 4 MPI processes, 12 methods on emulated 10 Mbit/s-1 Gbit/s links",
        config_type=TimeToAccuracyConfig,
        runner=f"{__name__}.run:run",
        summary=_headline,
    )
)
"""The registered experiment."""
