"""``jaxcomm run paper-claims``: the paper studies' contradicted or unexplained claims, re-run over
seeds with the variants that test a proposed cause.

Registration only (no JAX import); the runner is :mod:`experiments.paper_claims.run`, which is
also a script (``python -m experiments.paper_claims.run --help``).
"""

from jaxcomm.studies import Experiment, register_experiment

from .config import PaperClaimsConfig

__all__ = ["EXPERIMENT", "PaperClaimsConfig"]

EXPERIMENT = register_experiment(
    Experiment(
        name="paper-claims",
        description="claims of the paper studies under repetition: seeds, longer runs, seed-paired differences",
        config_type=PaperClaimsConfig,
        runner=f"{__name__}.run:run",
    )
)
"""The registered experiment."""
