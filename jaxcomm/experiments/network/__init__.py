"""The library's own result: compressed data-parallel training on a real, throttled network.

* ``jaxcomm run time-to-accuracy``: MPI processes in a private network namespace whose
  loopback is shaped to each bandwidth of the configuration (:mod:`jaxcomm.netem`); dense
  against compressed methods, measured wall-clock time to a test accuracy, bytes counted by
  the kernel, and :mod:`jaxcomm.cost_model`'s prediction beside each.

Registration only (no JAX import): the launcher is :mod:`jaxcomm.experiments.network.run`,
the per-rank MPI worker :mod:`jaxcomm.experiments.network.worker`.
"""

from .._registry import Experiment, register_experiment
from .config import METHODS, TimeToAccuracyConfig

__all__ = ["EXPERIMENT", "METHODS", "TimeToAccuracyConfig"]

EXPERIMENT = register_experiment(
    Experiment(
        name="time-to-accuracy",
        description="ResNet-20 on Fashion-MNIST, 4 MPI processes on an emulated 100 Mbit/s, 1 Gbit/s and unshaped link",
        config_type=TimeToAccuracyConfig,
        runner="jaxcomm.experiments.network.run:run",
    )
)
"""The registered experiment."""
