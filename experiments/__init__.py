"""The studies of this repository, run by ``jaxcomm run NAME`` (the library itself holds none).

One folder per study, ``experiments/<study>/``, in the layout of the Flax examples: its
``__init__`` registers the study's experiments with :func:`jaxcomm.studies.register_experiment`
(importing neither JAX nor Flax), ``config.py`` holds their typed configurations (frozen
dataclasses with ``default()`` and ``smoke()``, derived from :class:`._config.StudyConfig`) and
``run.py`` the runner ``run(config, out_dir)``, imported on the first run. Shared by every study:
``_config.py`` (the configurations' base classes, field ranges and choices) and ``_common.py``
(data, models, data-parallel training and evaluation, plots). ``benchmarks/`` holds the speed
benchmarks, scripts run on their own.

``jaxcomm`` finds this folder from the current directory upwards (or through
``JAXCOMM_EXPERIMENTS``; :mod:`jaxcomm.studies`) and imports each package of :data:`STUDIES`.

>>> from jaxcomm.studies import get_experiment
>>> get_experiment("grace").config(smoke=True, overrides={"steps": "7"}).steps
7
"""

from pathlib import Path

PACKAGE_PARENT = Path(__file__).resolve().parent.parent
"""The folder holding this package: the working directory of the studies' MPI workers, which
import the same studies (and, through ``jaxcomm.studies.worker_pythonpath``, the same jaxcomm)
as the process that launches them."""

STUDIES = (
    "quickstart",
    "network",
    "grace",
    "doublesqueeze",
    "gradient_dropping",
    "eventgrad",
    "eager",
    "paper_claims",
)
"""The study packages, imported in this order by ``jaxcomm list`` and ``jaxcomm run``."""
