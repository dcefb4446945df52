"""Configuration of ``jaxcomm run doublesqueeze``."""

from __future__ import annotations

import dataclasses

from .._registry import check_global_batch

__all__ = ["METHODS", "DoubleSqueezeConfig"]

METHODS = ("sgd", "doublesqueeze-1bit", "doublesqueeze-topk", "memsgd-1bit", "qsgd", "topk")
"""The compared methods (Tang et al. 2019, Figs. 1-2)."""


@dataclasses.dataclass(frozen=True)
class DoubleSqueezeConfig:
    """DoubleSqueeze vs its baselines on ``devices`` mesh workers, each followed by SGD with momentum.

    Attributes:
      dataset: ``"mnist"``, ``"fashion_mnist"``, ``"mnist5k"`` or ``"digits"``.
      model: ``"mlp"``, ``"eventgrad_cnn"`` or ``"resnet20"``.
      devices: data-parallel workers (simulated CPU devices).
      batch_size: examples per step over all workers (the global batch; each worker gets
        ``batch_size / devices``).
      steps: optimizer steps per method.
      eval_every: steps between test evaluations.
      learning_rate, momentum: of ``optax.sgd``.
      topk_ratio: kept fraction of the top-k compressors.
      methods: names from :data:`METHODS`, trained in this order.
      train_examples, test_examples: keep only this many examples (0: all).
      seed: initialisation, data split and compressor randomness.
    """

    dataset: str = "fashion_mnist"
    model: str = "resnet20"
    devices: int = 8
    batch_size: int = 256
    steps: int = 200
    eval_every: int = 50
    learning_rate: float = 0.05
    momentum: float = 0.9
    topk_ratio: float = 0.01
    methods: tuple[str, ...] = METHODS
    train_examples: int = 0
    test_examples: int = 2000
    seed: int = 0

    def __post_init__(self) -> None:
        """``ValueError`` for a global batch that the workers cannot share, or a method that is not a
        name of :data:`METHODS` (or no method at all)."""
        check_global_batch(self)
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
        return dataclasses.replace(
            cls.default(),
            model="mlp",
            devices=4,
            batch_size=64,
            steps=4,
            eval_every=4,
            methods=("sgd", "doublesqueeze-1bit"),
            train_examples=1024,
            test_examples=256,
        )
