"""The papers' studies as runnable experiments (``jaxcomm run NAME``)."""

from ._registry import (
    Experiment,
    apply_overrides,
    experiment_names,
    get_experiment,
    register_experiment,
    write_results,
)

__all__ = ["Experiment", "apply_overrides", "experiment_names", "get_experiment", "register_experiment",
           "write_results"]
