"""eager-SGD (Li et al., PPoPP 2020): partial allreduce under load imbalance.

* ``jaxcomm run eager-microbench`` (Sec. 7.1, Figs. 8-9): latency and number of
  active processes of ``MPI_Allreduce`` vs solo and majority allreduce.
* ``jaxcomm run eager-hyperplane`` (Sec. 7.2.1, Fig. 10; Sec. 7.2.3, Fig. 12):
  hyperplane regression over MPI, then the severe skew in the mesh simulation.
* ``jaxcomm run eager-time-to-quality`` (Sec. 7.2.1, Fig. 10b): the hyperplane regression's time
  to the equal-loss target over MPI on an emulated link, several seeds, with verdicts.

Registration only (no JAX import): the launcher is :mod:`experiments.eager.run`,
the per-rank MPI worker :mod:`experiments.eager.worker`, the time-to-quality study
:mod:`experiments.eager.quality`.
"""

from jaxcomm.studies import Experiment, register_experiment

from .config import HyperplaneConfig, MicrobenchConfig, TimeToQualityConfig

__all__ = ["MICROBENCH", "HYPERPLANE", "TIME_TO_QUALITY", "MicrobenchConfig", "HyperplaneConfig", "TimeToQualityConfig"]

MICROBENCH = register_experiment(
    Experiment(
        name="eager-microbench",
        description="eager-SGD Fig. 8-9: MPI_Allreduce vs solo/majority allreduce latency and NAP, linear skew",
        config_type=MicrobenchConfig,
        runner=f"{__name__}.run:run_microbench",
    )
)
"""The registered ``eager-microbench`` experiment."""

HYPERPLANE = register_experiment(
    Experiment(
        name="eager-hyperplane",
        description="eager-SGD Sec. 7.2.1/7.2.3: hyperplane regression over MPI + severe skew ResNet-20 (simulation)",
        config_type=HyperplaneConfig,
        runner=f"{__name__}.run:run_hyperplane",
    )
)
"""The registered ``eager-hyperplane`` experiment."""

TIME_TO_QUALITY = register_experiment(
    Experiment(
        name="eager-time-to-quality",
        description="eager-SGD Sec. 7.2.1: time to equal loss, sync vs solo/majority, MPI on an emulated link, seeds",
        config_type=TimeToQualityConfig,
        runner=f"{__name__}.quality:run",
    )
)
"""The registered ``eager-time-to-quality`` experiment."""
