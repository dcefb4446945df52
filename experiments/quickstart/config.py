"""Configuration of ``jaxcomm run quickstart``."""

from __future__ import annotations

import dataclasses
from typing import Any

from .._registry import check_global_batch

__all__ = ["METHODS", "QuickstartConfig"]

METHODS: dict[str, tuple[str, dict[str, Any]]] = {
    "none": ("none", {}),
    "topk-1%+EF": ("topk", {"ratio": 0.01}),
    "qsgd-16": ("qsgd", {"levels": 16}),
    "efsignsgd+EF": ("efsignsgd", {}),
    "powersgd-r2+EF": ("powersgd", {"matrix_approximation_rank": 2}),
}
"""Method label -> ``(compressor name, its keyword arguments)``; a ``+EF`` label adds residual memory."""


@dataclasses.dataclass(frozen=True)
class QuickstartConfig:
    """The README's study: compressed data-parallel SGD with momentum on ``devices`` mesh workers.

    Attributes:
      dataset: ``"mnist"``, ``"fashion_mnist"``, ``"mnist5k"`` or ``"digits"``.
      model: ``"mlp"``, ``"eventgrad_cnn"`` or ``"resnet20"``.
      devices: data-parallel workers (simulated CPU devices).
      batch_size: examples per step over all workers (the global batch; each worker gets
        ``batch_size / devices``).
      steps: optimizer steps per method.
      eval_every: steps between test evaluations.
      learning_rate, momentum: of ``optax.sgd``.
      methods: labels from :data:`METHODS` or method specs
        ``COMPRESSOR(k=v)+MEMORY@STRATEGY`` (e.g. ``topk(ratio=0.01)+residual``), trained in this order.
      train_examples, test_examples: keep only this many examples (0: all).
      seed: initialisation, data split and compressor randomness.
    """

    dataset: str = "mnist"
    model: str = "eventgrad_cnn"
    devices: int = 8
    batch_size: int = 256
    steps: int = 300
    eval_every: int = 100
    learning_rate: float = 0.05
    momentum: float = 0.9
    methods: tuple[str, ...] = tuple(METHODS)
    train_examples: int = 0
    test_examples: int = 0
    seed: int = 0

    def __post_init__(self) -> None:
        """``ValueError`` for a global batch that the workers cannot share, or a method that is
        neither a label of :data:`METHODS` nor a valid spec."""
        check_global_batch(self)
        specs = [m for m in self.methods if m not in METHODS]
        if specs:  # every spec is parsed without JAX; then building them (checking values) imports it
            from .._spec import check_methods

            try:
                check_methods(specs)
            except ValueError as e:
                raise ValueError(f"QuickstartConfig.methods: {e}; or a label of {list(METHODS)}") from None

    @classmethod
    def default(cls) -> QuickstartConfig:
        """The full study: MNIST, EventGraD CNN, 8 workers, 300 steps, every method."""
        return cls()

    @classmethod
    def smoke(cls) -> QuickstartConfig:
        """20 steps on 4096 training examples, no compression vs top-k 1 % with EF."""
        return dataclasses.replace(
            cls.default(),
            steps=20,
            eval_every=10,
            train_examples=4096,
            test_examples=1000,
            methods=("none", "topk-1%+EF"),
        )
