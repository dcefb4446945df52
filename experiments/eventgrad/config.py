"""Configuration of ``jaxcomm run eventgrad``."""

from __future__ import annotations

import dataclasses

from .._config import StudyConfig

__all__ = ["ALGORITHMS", "RING_METHODS", "TASKS", "EventGradConfig", "EventGradRingConfig"]

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


RING_METHODS = ("dpsgd", "eventgrad", "eventgrad_topk", "dpsgd_sendrecv")
"""The runs of ``eventgrad-ring``: D-PSGD as the paper runs it (every tensor put into both
neighbours' windows every iteration), EventGraD (whole tensors on events), EventGraD with top-K,
and the control D-PSGD with two-sided ``MPI_Sendrecv`` inside the jitted step (synchronous)."""


@dataclasses.dataclass(frozen=True)
class EventGradRingConfig(StudyConfig):
    """D-PSGD against EventGraD (and + top-K) on ``num_procs`` MPI processes on a ring, over one-sided
    windows on an emulated link, trained until the test accuracy plateaus, once per seed.

    Every method of a seed trains in one job (:func:`jaxcomm.netem.launch`) from the same
    initialisation on the same batches (the batches of ``jaxcomm run eventgrad``'s simulation:
    ``split_iid`` shards, ``WorkerBatches``), the asynchronous one-sided exchange of
    :class:`jaxcomm.algorithms.OneSidedEventGrad` (``dpsgd_sendrecv``: :func:`jaxcomm.algorithms.dpsgd`
    over :class:`jaxcomm.comm.MPIComm`).

    Attributes:
      task: a name of :data:`TASKS` (its dataset and model).
      methods: names from :data:`RING_METHODS`; ``"dpsgd"`` is required (the baseline of the
        percentages and of the accuracy target).
      seeds: one job per seed: initialisation, data split, batches and dropout.
      num_procs: MPI processes (workers on the ring).
      iterations: optimizer steps per run.
      eval_every: steps between the parameter snapshots evaluated afterwards (a divisor of
        ``iterations``; the evaluation is not timed and sends nothing).
      batch_per_worker: examples per worker and step.
      lr, momentum: of ``optax.sgd`` (momentum 0: none).
      horizon, history, forced_iterations, threshold_rule, topk: EventGraD's (:func:`jaxcomm.algorithms.eventgrad`).
      train_examples, test_examples: keep only this many examples (0: all).
      plateau_evals: ``K``: a run has plateaued if its last ``K`` evaluations lie within
        ``plateau_points`` accuracy points of each other; its plateau accuracy is their mean.
      plateau_points: that spread (percentage points).
      target_points: a seed's accuracy target is D-PSGD's plateau accuracy minus this (points);
        time to target is the first snapshot at or above it.
      same_accuracy_points: "the same accuracy" holds for a seed when its plateau accuracy is
        within this many points of D-PSGD's (the paper's Table 1 differences are at most 0.7).
      bandwidth: the emulated link's rate (tc syntax; one shared link for all processes).
      timeout_s: a barrier of the one-sided exchange waits at most this long (s).
      launch_timeout_s: limit of each seed's job (s).
    """

    task: str = "mnist_cnn"
    methods: tuple[str, ...] = RING_METHODS
    seeds: tuple[int, ...] = (0, 1, 2)
    num_procs: int = 4
    iterations: int = 1500
    eval_every: int = 100
    batch_per_worker: int = 16
    lr: float = 0.05
    momentum: float = 0.0
    horizon: float = 1.0
    history: int = 2
    forced_iterations: int = 30
    threshold_rule: str = "paper"
    topk: float = 0.1
    train_examples: int = 0
    test_examples: int = 5000
    plateau_evals: int = 5
    plateau_points: float = 1.0
    target_points: float = 1.0
    same_accuracy_points: float = 1.0
    bandwidth: str = "200mbit"
    timeout_s: float = 120.0
    launch_timeout_s: float = 1200.0

    def __post_init__(self) -> None:
        """Also ``ValueError`` naming the field (``EventGradRingConfig.FIELD: ...``): ``task`` not in
        :data:`TASKS`; ``methods`` outside :data:`RING_METHODS`, repeated or without ``"dpsgd"``;
        ``seeds`` empty or repeated; ``eval_every`` not dividing ``iterations``; fewer than
        ``plateau_evals`` evaluations; ``bandwidth`` not a rate tc accepts. An unknown
        ``threshold_rule`` is refused by :func:`experiments.eventgrad.ring.run` before any job starts
        (its rules live with the algorithm, which imports JAX; making a config does not)."""
        super().__post_init__()
        from jaxcomm import netem

        def bad(field: str, why: str):
            raise ValueError(f"EventGradRingConfig.{field}: {why}")

        if self.task not in TASKS:
            bad("task", f"one of {sorted(TASKS)}; got {self.task!r}")
        methods = list(self.methods)
        if not set(methods) <= set(RING_METHODS) or len(set(methods)) != len(methods) or "dpsgd" not in methods:
            bad("methods", f"distinct names from {RING_METHODS}, 'dpsgd' included (the baseline); got {methods}")
        if not self.seeds or len(set(self.seeds)) != len(self.seeds):
            bad("seeds", f"give distinct seeds, at least one; got {list(self.seeds)}")
        if self.iterations % self.eval_every:
            bad("eval_every", f"must divide iterations ({self.iterations}); got {self.eval_every}")
        if self.iterations // self.eval_every < self.plateau_evals:
            bad(
                "plateau_evals",
                f"the run has {self.iterations // self.eval_every} evaluations (iterations / eval_every), "
                f"fewer than {self.plateau_evals}",
            )
        try:
            netem.parse_rate(self.bandwidth, "bandwidth")
        except netem.NetemError as e:
            bad("bandwidth", str(e).removeprefix("bandwidth: "))

    @classmethod
    def default(cls) -> EventGradRingConfig:
        """MNIST and the reference code's CNN on 4 processes, 1,500 steps of 16 examples per worker,
        3 seeds, a 200 Mbit/s link, the first 5,000 test images."""
        return cls()

    @classmethod
    def smoke(cls) -> EventGradRingConfig:
        """The digits CNN, 20 steps of 8 examples, evaluated every 10 steps, 1 seed, 2 methods."""
        return dataclasses.replace(
            cls.default(),
            task="digits_cnn",
            methods=("dpsgd", "eventgrad"),
            seeds=(0,),
            iterations=20,
            eval_every=10,
            batch_per_worker=8,
            forced_iterations=3,
            plateau_evals=2,
            plateau_points=100.0,
            test_examples=300,
            timeout_s=30.0,
            launch_timeout_s=300.0,
        )
