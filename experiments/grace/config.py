"""Configuration of ``jaxcomm run grace``."""

from __future__ import annotations

import dataclasses

from .._config import DataParallelConfig

__all__ = ["GraceConfig"]


@dataclasses.dataclass(frozen=True)
class GraceConfig(DataParallelConfig):
    """GRACE Figs. 6/7: every (compressor, error feedback) pair on ``devices`` mesh workers.

    Attributes:
      compressors: registry names to run; empty: every registered compressor.
      error_feedback: the settings to run per compressor (residual memory or none).
    """

    compressors: tuple[str, ...] = ()
    error_feedback: tuple[bool, ...] = (False, True)

    @classmethod
    def default(cls) -> GraceConfig:
        """The full study: Fashion-MNIST, ResNet-20-style network, 8 workers, every compressor."""
        return cls()

    @classmethod
    def smoke(cls) -> GraceConfig:
        """4 steps of an MLP on 4 workers for none, top-k and QSGD."""
        return cls.small(compressors=("none", "topk", "qsgd"))
