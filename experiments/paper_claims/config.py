"""Configuration of ``jaxcomm run paper-claims``."""

from __future__ import annotations

import dataclasses

from .._config import StudyConfig

__all__ = ["CLAIMS", "PaperClaimsConfig"]

CLAIMS = ("topk-ef", "doublesqueeze-topk", "qsgd-ef", "gradient-dropping", "sign-ef", "doublesqueeze-bytes")
"""The studies of the claims, each re-run with every seed (see :mod:`.run`)."""


@dataclasses.dataclass(frozen=True)
class PaperClaimsConfig(StudyConfig):
    """Paper claims under repetition: every study of :data:`CLAIMS` named in ``studies``, every seed.

    Attributes:
      studies: names from :data:`CLAIMS`, run in this order.
      seeds: the seeds every variant is trained with (the summary pairs the runs by seed).
      steps: steps per run; ``None``: each study's own.
      small: a few steps of small models, two variants per study (checks the pipeline).
    """

    studies: tuple[str, ...] = CLAIMS
    seeds: tuple[int, ...] = (0, 1, 2)
    steps: int | None = None
    small: bool = False

    def __post_init__(self) -> None:
        """Also ``ValueError`` for a study not in :data:`CLAIMS`, or seeds that repeat."""
        super().__post_init__()
        unknown = [s for s in self.studies if s not in CLAIMS]
        if unknown:
            raise ValueError(f"PaperClaimsConfig.studies must be names from {list(CLAIMS)}; unknown: {unknown}")
        if len(set(self.seeds)) != len(self.seeds):
            raise ValueError(f"PaperClaimsConfig.seeds: each seed once; got {list(self.seeds)}")

    @classmethod
    def smoke(cls) -> PaperClaimsConfig:
        """Every study, small, with two seeds."""
        return cls(seeds=(0, 1), small=True)
