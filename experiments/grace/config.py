"""Configuration of ``jaxcomm run grace``."""

from __future__ import annotations

import dataclasses

from .._registry import check_global_batch

__all__ = ["GraceConfig"]


@dataclasses.dataclass(frozen=True)
class GraceConfig:
    """GRACE Figs. 6/7: every (compressor, error feedback) pair on ``devices`` mesh workers.

    Attributes:
      dataset: ``"mnist"``, ``"fashion_mnist"``, ``"mnist5k"`` or ``"digits"``.
      model: ``"mlp"``, ``"eventgrad_cnn"`` or ``"resnet20"``.
      devices: data-parallel workers (simulated CPU devices).
      batch_size: examples per step over all workers (the global batch; each worker gets
        ``batch_size / devices``).
      steps: optimizer steps per run.
      eval_every: steps between test evaluations.
      learning_rate, momentum: of ``optax.sgd``.
      compressors: registry names to run; empty: every registered compressor.
      error_feedback: the settings to run per compressor (residual memory or none).
      train_examples, test_examples: keep only this many examples (0: all).
      seed: initialisation, data split and compressor randomness.
    """

    dataset: str = "fashion_mnist"
    model: str = "resnet20"
    devices: int = 8
    batch_size: int = 256
    steps: int = 100
    eval_every: int = 50
    learning_rate: float = 0.1
    momentum: float = 0.9
    compressors: tuple[str, ...] = ()
    error_feedback: tuple[bool, ...] = (False, True)
    train_examples: int = 0
    test_examples: int = 2000
    seed: int = 0

    def __post_init__(self) -> None:
        """``ValueError`` for a global batch that the workers cannot share."""
        check_global_batch(self)

    @classmethod
    def default(cls) -> GraceConfig:
        """The full study: Fashion-MNIST, ResNet-20-style network, 8 workers, every compressor."""
        return cls()

    @classmethod
    def smoke(cls) -> GraceConfig:
        """4 steps of an MLP on 4 workers for none, top-k and QSGD."""
        return dataclasses.replace(
            cls.default(),
            model="mlp",
            devices=4,
            batch_size=64,
            steps=4,
            eval_every=4,
            compressors=("none", "topk", "qsgd"),
            train_examples=1024,
            test_examples=256,
        )
