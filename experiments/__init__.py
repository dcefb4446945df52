"""The papers' studies as runnable experiments (``jaxcomm run NAME``).

One package per paper, ``jaxcomm/experiments/<paper>/``: its ``__init__``
registers the experiments (importing neither JAX nor Flax), ``config.py`` holds
their typed configurations (frozen dataclasses with ``default()`` and
``smoke()``) and ``run.py`` the runner, imported on the first run. Shared code:
``_registry.py`` (this module's names) and ``_common.py`` (data, models,
data-parallel training, plots).

>>> from jaxcomm.experiments import get_experiment
>>> get_experiment("grace").config(smoke=True, overrides={"steps": "7"})["steps"]
7
"""

from ._registry import (
    Experiment,
    apply_overrides,
    experiment_names,
    get_experiment,
    register_experiment,
    write_results,
)

__all__ = [
    "Experiment",
    "apply_overrides",
    "experiment_names",
    "get_experiment",
    "register_experiment",
    "write_results",
]
