"""Configuration of ``jaxcomm run eventgrad``."""

from __future__ import annotations

import dataclasses

from .._config import StudyConfig

__all__ = ["ALGORITHMS", "TASKS", "EventGradConfig"]

TASKS = {
    "mnist_cnn": {"dataset": "mnist", "model": "eventgrad_cnn", "prefix": ""},
    "digits_cnn": {"dataset": "digits", "model": "eventgrad_cnn", "prefix": ""},
    "fmnist_resnet20": {"dataset": "fashion_mnist", "model": "resnet20", "prefix": "resnet_"},
}
"""Task -> dataset, model and the prefix of its own config keys (``resnet_*`` for the ResNet-20 task)."""

ALGORITHMS = ("dpsgd", "eventgrad", "eventgrad_topk")
"""D-PSGD, EventGraD with whole tensors (Table 1), EventGraD with top-K entries (Table 2)."""


@dataclasses.dataclass(frozen=True)
class EventGradConfig(StudyConfig):
    """D-PSGD vs EventGraD on a ring, every (task, workers, algorithm); workers simulated with ``jax.vmap``.

    Keys with the ``resnet_`` prefix replace their unprefixed namesakes for the
    ``fmnist_resnet20`` task.

    Attributes:
      tasks: names from :data:`TASKS`.
      algorithms: names from :data:`ALGORITHMS`.
      topology: a :func:`jaxcomm.topology.make` name.
      workers, resnet_workers: worker counts to run.
      iterations, resnet_iterations: optimizer steps per run; <= 0: ``epochs`` epochs.
      epochs: run length in epochs when ``iterations <= 0``.
      batch_per_worker, resnet_batch_per_worker: examples per worker and step.
      lr, resnet_lr, momentum, resnet_momentum: of ``optax.sgd`` (momentum 0: none).
      test_examples, resnet_test_examples: keep only this many test examples (0: all).
      train_examples: keep only this many training examples (0: all).
      horizon: EventGraD's threshold horizon (Eq. 5).
      history: norms kept for the threshold's slope (Eq. 5).
      forced_iterations: first iterations in which every tensor is sent.
      threshold_rule: :func:`jaxcomm.algorithms.eventgrad`'s ``threshold_rule``.
      topk: kept fraction of the changed entries (``eventgrad_topk``).
      trace_tensors: tensors whose norms, thresholds and events are plotted (0: none).
      seed: initialisation, data split and batching.
    """

    tasks: tuple[str, ...] = ("mnist_cnn", "fmnist_resnet20")
    algorithms: tuple[str, ...] = ALGORITHMS
    topology: str = "ring"
    workers: tuple[int, ...] = (4, 8, 16, 32)
    iterations: int = 100
    epochs: float = 10.0
    batch_per_worker: int = 16
    lr: float = 0.05
    momentum: float = 0.0
    test_examples: int = 2000
    resnet_workers: tuple[int, ...] = (4,)
    resnet_iterations: int = 120
    resnet_batch_per_worker: int = 8
    resnet_lr: float = 0.02
    resnet_momentum: float = 0.9
    resnet_test_examples: int = 1000
    train_examples: int = 0
    horizon: float = 1.0
    history: int = 2
    forced_iterations: int = 10
    threshold_rule: str = "paper"
    topk: float = 0.1
    trace_tensors: int = 4
    seed: int = 0

    def __post_init__(self) -> None:
        """Also ``ValueError`` for a task not in :data:`TASKS` or an algorithm not in :data:`ALGORITHMS`."""
        super().__post_init__()
        for task in self.tasks:
            if task not in TASKS:
                raise ValueError(f"EventGradConfig.tasks: unknown task {task!r}; valid: {sorted(TASKS)}")
        for a in self.algorithms:
            if a not in ALGORITHMS:
                raise ValueError(f"EventGradConfig.algorithms: unknown algorithm {a!r}; valid: {list(ALGORITHMS)}")

    @classmethod
    def default(cls) -> EventGradConfig:
        """The full study: MNIST CNN on 4-32 workers and the ResNet-20 task on 4 workers."""
        return cls()

    @classmethod
    def smoke(cls) -> EventGradConfig:
        """12 iterations of the digits CNN on 4 workers."""
        return dataclasses.replace(
            cls.default(),
            tasks=("digits_cnn",),
            workers=(4,),
            iterations=12,
            batch_per_worker=8,
            forced_iterations=3,
            test_examples=300,
        )
