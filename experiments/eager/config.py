"""Configurations of ``jaxcomm run eager-microbench`` and ``jaxcomm run eager-hyperplane``."""

from __future__ import annotations

import dataclasses

from .._config import StudyConfig

__all__ = ["MicrobenchConfig", "HyperplaneConfig"]


@dataclasses.dataclass(frozen=True)
class MicrobenchConfig(StudyConfig):
    """eager-SGD Sec. 7.1 (Figs. 8-9): collectives under linear skew, ``(rank + 1) * skew_unit_ms`` before each call.

    Attributes:
      num_procs: MPI processes P.
      iterations: timed calls per collective; warmup: untimed calls before them.
      skew_unit_ms: skew unit (ms).
      count: float32 entries reduced per call.
      seed: the partial collectives' initiator stream.
      timeout_s: a partial collective's timeout (s); poll_s: its polling interval (s).
      launch_timeout_s: limit of the whole ``mpirun`` job (s).
    """

    num_procs: int = 32
    iterations: int = 64
    warmup: int = 4
    skew_unit_ms: float = 1.0
    count: int = 256
    seed: int = 0
    timeout_s: float = 120.0
    poll_s: float = 0.001
    launch_timeout_s: float = 1800.0

    @classmethod
    def default(cls) -> MicrobenchConfig:
        """The paper's 32 processes, 64 timed iterations."""
        return cls()

    @classmethod
    def smoke(cls) -> MicrobenchConfig:
        """4 processes, 6 timed iterations."""
        return dataclasses.replace(
            cls.default(), num_procs=4, iterations=6, warmup=1, timeout_s=30.0, launch_timeout_s=120.0
        )


@dataclasses.dataclass(frozen=True)
class HyperplaneConfig(StudyConfig):
    """eager-SGD Sec. 7.2.1 (hyperplane regression over MPI) and Sec. 7.2.3 (severe skew, mesh simulation).

    Hyperplane study (``mpi``), ``y = x . w* + noise`` with a linear model:

    Attributes:
      mpi: run the hyperplane study on real MPI processes.
      num_procs: MPI processes P.
      features: input dimension d (the model has d + 1 parameters).
      train_points, val_points: training rows (split over the processes) and validation rows.
      batch_total: global batch (B/P rows per process and step).
      epochs: passes over each process's shard.
      lr: SGD learning rate.
      noise_std: standard deviation of the label noise.
      delays_ms: injected delays (ms) of the one random process delayed per step, one study each.
      modes: ``"sync"``, ``"solo"``, ``"majority"``.
      equal_loss_rtol: "equal loss" is within this relative tolerance of synch-SGD's final validation MSE.
      base_compute_ms: emulated accelerator time per step and process (ms); 195 ms matches the
        paper's P100 at 0.64 steps/s for batch 2048 (1562 ms / 2048 * 256).
      seed: data, the delay table and the partial collectives' initiators.
      timeout_s, poll_s: a partial collective's timeout and polling interval (s).
      launch_timeout_s: limit of each ``mpirun`` job (s).
      severe: run the severe-skew study (:func:`jaxcomm.algorithms.simulate_training`).
      severe_dataset, severe_model: as in :func:`experiments._common.load_image_task` and ``build_model``.
      severe_workers: simulated workers.
      severe_train_examples, severe_test_examples: keep only this many examples (0: all).
      severe_downsample: f > 1 average-pools the images f x f (f^2 fewer FLOPs per example).
      severe_batch_per_worker: examples per worker and round.
      severe_epochs: passes over the training set.
      severe_lr: SGD learning rate (the peak, with a schedule).
      severe_lr_schedule: ``"constant"``, or ``"cosine"`` decay from ``severe_lr`` to 0 over all rounds.
      severe_warmup_epochs: > 0: linear warm-up from 0 to ``severe_lr`` over this many epochs first.
      severe_momentum: SGD momentum.
      severe_min_ms, severe_max_ms: range of the rotating skew (ms).
      severe_clock: :func:`jaxcomm.algorithms.simulate_training`'s ``clock``.
      severe_modes: ``"sync"``, ``"solo"``, ``"majority"``.
    """

    mpi: bool = True
    num_procs: int = 8
    features: int = 8192
    train_points: int = 32768
    val_points: int = 4096
    batch_total: int = 2048
    epochs: int = 48
    lr: float = 0.02
    noise_std: float = 2.0
    delays_ms: tuple[float, ...] = (200.0, 300.0, 400.0)
    modes: tuple[str, ...] = ("sync", "solo", "majority")
    equal_loss_rtol: float = 0.05
    base_compute_ms: float = 195.0
    seed: int = 0
    timeout_s: float = 120.0
    poll_s: float = 0.001
    launch_timeout_s: float = 3600.0
    severe: bool = True
    severe_dataset: str = "fashion_mnist"
    severe_model: str = "resnet20"
    severe_workers: int = 8
    severe_train_examples: int = 2048
    severe_test_examples: int = 1000
    severe_downsample: int = 1
    severe_batch_per_worker: int = 16
    severe_epochs: int = 8
    severe_lr: float = 0.05
    severe_lr_schedule: str = "constant"
    severe_warmup_epochs: float = 0.0
    severe_momentum: float = 0.9
    severe_min_ms: float = 50.0
    severe_max_ms: float = 400.0
    severe_clock: str = "carry"
    severe_modes: tuple[str, ...] = ("sync", "solo", "majority")

    @classmethod
    def default(cls) -> HyperplaneConfig:
        """The paper's hyperplane study on 8 processes and the severe skew on a ResNet-20, 8 workers."""
        return cls()

    @classmethod
    def smoke(cls) -> HyperplaneConfig:
        """4 processes, 256 features, 2 epochs, one 30 ms delay; severe skew on digits with an MLP."""
        return dataclasses.replace(
            cls.default(),
            num_procs=4,
            features=256,
            train_points=2048,
            val_points=512,
            batch_total=256,
            epochs=2,
            delays_ms=(30.0,),
            base_compute_ms=5.0,
            timeout_s=30.0,
            launch_timeout_s=180.0,
            severe_dataset="digits",
            severe_model="mlp",
            severe_workers=4,
            severe_train_examples=0,
            severe_test_examples=0,
            severe_batch_per_worker=16,
            severe_epochs=2,
            severe_lr=0.1,
            lr=0.1,
        )
