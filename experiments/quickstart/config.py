"""Configuration of ``jaxcomm run quickstart``."""

from __future__ import annotations

import dataclasses
from typing import Any

from .._config import DataParallelConfig

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
class QuickstartConfig(DataParallelConfig):
    """The README's study: compressed data-parallel SGD with momentum on ``devices`` mesh workers.

    Attributes:
      methods: labels from :data:`METHODS` or method specs
        ``COMPRESSOR(k=v)+MEMORY@STRATEGY`` (e.g. ``topk(ratio=0.01)+residual``), trained in this order.
    """

    dataset: str = "mnist"
    model: str = "eventgrad_cnn"
    steps: int = 300
    eval_every: int = 100
    learning_rate: float = 0.05
    test_examples: int = 0
    methods: tuple[str, ...] = tuple(METHODS)

    def __post_init__(self) -> None:
        """Also ``ValueError`` for a method that is neither a label of :data:`METHODS` nor a valid spec."""
        super().__post_init__()
        specs = [m for m in self.methods if m not in METHODS]
        if specs:  # every spec is parsed without JAX; then building them (checking values) imports it
            from jaxcomm._spec import check_methods

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
