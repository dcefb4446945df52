"""Configuration of ``jaxcomm run gradient-dropping``."""

from __future__ import annotations

import dataclasses

from .._config import StudyConfig

__all__ = ["METHODS", "GradientDroppingConfig"]

METHODS = ("baseline", "drop99", "sum", "partial", "error")
"""Uncompressed, gradient dropping (Algorithm 1), and its three local-gradient modes (Algorithm 2)."""


@dataclasses.dataclass(frozen=True)
class GradientDroppingConfig(StudyConfig):
    """Char-LSTM on Shakespeare with gradient dropping and local gradients, Adam, ``devices`` workers.

    Attributes:
      devices: data-parallel workers (simulated CPU devices).
      seq_len: characters per training window.
      batch_size: windows per worker and step.
      steps: optimizer steps per run.
      eval_every: steps between validation evaluations.
      eval_windows: validation windows evaluated.
      learning_rate: of ``optax.adam``.
      drop_ratio: dropped fraction R after the warm-up.
      warmup_steps: T of the warm-up ``R_t = R^max(1, T/t)``.
      sync_every: steps between parameter averages (runs with sync).
      sync: the settings to run per method (periodic parameter averaging or not).
      embed, hidden: LSTM embedding and hidden sizes.
      methods: names from :data:`METHODS`, trained in this order.
      corpus_chars: keep only this many characters of the corpus (0: all).
      seed: initialisation and batching.
    """

    devices: int = 4
    seq_len: int = 64
    batch_size: int = 64
    steps: int = 1000
    eval_every: int = 100
    eval_windows: int = 512
    learning_rate: float = 0.002
    drop_ratio: float = 0.99
    warmup_steps: int = 100
    sync_every: int = 500
    sync: tuple[bool, ...] = (False, True)
    embed: int = 64
    hidden: int = 256
    methods: tuple[str, ...] = METHODS
    corpus_chars: int = 0
    seed: int = 0

    def __post_init__(self) -> None:
        """``ValueError`` for a method that is not a name of :data:`METHODS` (or no method at all)."""
        super().__post_init__()
        unknown = [m for m in self.methods if m not in METHODS]
        if unknown or not self.methods:
            raise ValueError(f"GradientDroppingConfig.methods must be names from {list(METHODS)}; unknown: {unknown}")

    @classmethod
    def default(cls) -> GradientDroppingConfig:
        """The full study: 1000 steps, every method with and without sync."""
        return cls()

    @classmethod
    def smoke(cls) -> GradientDroppingConfig:
        """6 steps of a small LSTM on 20,000 characters: baseline and PARTIAL."""
        return dataclasses.replace(
            cls.default(),
            steps=6,
            eval_every=3,
            sync_every=3,
            warmup_steps=3,
            hidden=32,
            embed=16,
            seq_len=16,
            batch_size=16,
            eval_windows=32,
            corpus_chars=20000,
            methods=("baseline", "partial"),
        )
