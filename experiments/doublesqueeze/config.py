"""Configuration of ``jaxcomm run doublesqueeze``."""

from __future__ import annotations

import dataclasses

from .._config import DataParallelConfig

__all__ = ["METHODS", "DoubleSqueezeConfig"]

METHODS = ("sgd", "doublesqueeze-1bit", "doublesqueeze-topk", "memsgd-1bit", "qsgd", "topk")
"""The compared methods (Tang et al. 2019, Figs. 1-2)."""


@dataclasses.dataclass(frozen=True)
class DoubleSqueezeConfig(DataParallelConfig):
    """DoubleSqueeze vs its baselines on ``devices`` mesh workers, each followed by SGD with momentum.

    Attributes:
      topk_ratio: kept fraction of the top-k compressors.
      methods: names from :data:`METHODS`, trained in this order.
    """

    steps: int = 200
    learning_rate: float = 0.05
    topk_ratio: float = 0.01
    methods: tuple[str, ...] = METHODS

    def __post_init__(self) -> None:
        """Also ``ValueError`` for a method that is not a name of :data:`METHODS` (or no method at all)."""
        super().__post_init__()
        unknown = [m for m in self.methods if m not in METHODS]
        if unknown or not self.methods:
            raise ValueError(f"DoubleSqueezeConfig.methods must be names from {list(METHODS)}; unknown: {unknown}")

    @classmethod
    def default(cls) -> DoubleSqueezeConfig:
        """The full study: Fashion-MNIST, ResNet-20-style network, 8 workers, every method."""
        return cls()

    @classmethod
    def smoke(cls) -> DoubleSqueezeConfig:
        """4 steps of an MLP on 4 workers: SGD and DoubleSqueeze 1-bit."""
        return cls.small(methods=("sgd", "doublesqueeze-1bit"))
