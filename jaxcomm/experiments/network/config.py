"""Configuration of ``jaxcomm run time-to-accuracy``."""

from __future__ import annotations

import dataclasses

from ..quickstart.config import METHODS as _QUICKSTART_METHODS

__all__ = ["METHODS", "TimeToAccuracyConfig"]

METHODS: dict[str, tuple[str, dict]] = {
    **_QUICKSTART_METHODS,
    "fp16": ("fp16", {}),
}
"""Method label -> ``(compressor name, its keyword arguments)``; a ``+EF`` label adds residual
memory. The quickstart's methods and float16 (over MPI a 16-bit reduce-scatter + all-gather,
summed in float32)."""


@dataclasses.dataclass(frozen=True)
class TimeToAccuracyConfig:
    """Wall-clock time to a test accuracy, MPI processes on an emulated network.

    Every bandwidth is one ``mpirun`` job inside a private network namespace
    (:func:`jaxcomm.netem.launch`): ``procs`` processes, one worker each, whose every byte
    crosses one shaped loopback link. Each job trains every method and seed in turn.

    Attributes:
      procs: MPI processes (workers), >= 2.
      bandwidths: link rates (``"100mbit"``, ``"1gbit"``; ``"unlimited"`` for no shaping).
      methods: labels from :data:`METHODS`, trained in this order.
      dataset: ``"fashion_mnist"``, ``"mnist"``, ``"mnist5k"`` or ``"digits"``.
      model: ``"resnet20"``, ``"eventgrad_cnn"`` or ``"mlp"``.
      batch_size: examples per worker and step.
      learning_rate, momentum: of ``optax.sgd``.
      target_accuracy: the test accuracy timed, in (0, 1].
      max_steps: a method that has not reached the target by then is recorded as not reaching it.
      eval_every: steps between evaluations (evaluation is not timed).
      eval_examples: test examples evaluated (split over the workers; rounded down to a multiple
        of ``procs``).
      train_examples: keep only this many training examples (0: all).
      compute_steps: steps timed with a one-worker communicator (the step without its
        communication), per method and job.
      seeds: initialisation, data order and compressor randomness; one run per seed.
      timeout_s: seconds one job (one bandwidth) may take before it is ended.
    """

    procs: int = 4
    bandwidths: tuple[str, ...] = ("100mbit", "1gbit", "unlimited")
    methods: tuple[str, ...] = ("none", "topk-1%+EF", "efsignsgd+EF", "qsgd-16", "powersgd-r2+EF", "fp16")
    dataset: str = "fashion_mnist"
    model: str = "resnet20"
    batch_size: int = 8
    learning_rate: float = 0.02
    momentum: float = 0.9
    target_accuracy: float = 0.75
    max_steps: int = 1000
    eval_every: int = 25
    eval_examples: int = 1000
    train_examples: int = 0
    compute_steps: int = 20
    seeds: tuple[int, ...] = (0,)
    timeout_s: float = 7200.0

    def __post_init__(self) -> None:
        """``ValueError`` for a method that is not a name of :data:`METHODS` (or no method at all)."""
        unknown = [m for m in self.methods if m not in METHODS]
        if unknown or not self.methods:
            raise ValueError(f"TimeToAccuracyConfig.methods must be names from {list(METHODS)}; unknown: {unknown}")

    @classmethod
    def default(cls) -> TimeToAccuracyConfig:
        """The full study: ResNet-20 on Fashion-MNIST, 4 processes, 100 Mbit/s, 1 Gbit/s, unshaped."""
        return cls()

    @classmethod
    def smoke(cls) -> TimeToAccuracyConfig:
        """Two processes on a 200 Mbit/s link, an MLP on the digits set, dense vs top-k 1 % with EF."""
        return dataclasses.replace(
            cls.default(),
            procs=2,
            bandwidths=("200mbit",),
            methods=("none", "topk-1%+EF"),
            dataset="digits",
            model="mlp",
            batch_size=16,
            learning_rate=0.1,
            target_accuracy=0.5,
            max_steps=60,
            eval_every=10,
            eval_examples=200,
            compute_steps=5,
            timeout_s=300.0,
        )
