"""Gradient dropping with local gradients (Algorithm 2) on a char-LSTM.

* ``jaxcomm run gradient-dropping``: perplexity per step, every mode with and without
  parameter averaging, workers on a device mesh.
* ``jaxcomm run gradient-dropping-time`` (Sec. 5.3, Table 2): time to a perplexity target over
  MPI on an emulated link, several seeds, with verdicts of the paper's speed claims.

Registration only (no JAX import); the runners are :mod:`experiments.gradient_dropping.run` and
:mod:`experiments.gradient_dropping.timed`, the per-rank MPI worker
:mod:`experiments.gradient_dropping.worker`.
"""

from jaxcomm.studies import Experiment, register_experiment

from .config import GradientDroppingConfig, GradientDroppingTimeConfig

__all__ = ["EXPERIMENT", "TIME", "GradientDroppingConfig", "GradientDroppingTimeConfig"]

EXPERIMENT = register_experiment(
    Experiment(
        name="gradient-dropping",
        description="Char-LSTM on Shakespeare: baseline, drop 99%, +SUM/+PARTIAL/+ERROR, with/without sync",
        config_type=GradientDroppingConfig,
        runner=f"{__name__}.run:run",
    )
)
"""The registered experiment."""


def _headline(results: dict) -> list[dict]:
    """The printed table of ``gradient-dropping-time`` (imports its runner's module on first use)."""
    from .timed import headline

    return headline(results)


TIME = register_experiment(
    Experiment(
        name="gradient-dropping-time",
        description="Sec. 5.3: time to perplexity, baseline / drop 99% / PARTIAL+sync, MPI on an emulated link, seeds",
        config_type=GradientDroppingTimeConfig,
        runner=f"{__name__}.timed:run",
        summary=_headline,
    )
)
"""The registered ``gradient-dropping-time`` experiment."""
