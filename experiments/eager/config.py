"""Configurations of ``jaxcomm run eager-microbench``, ``eager-hyperplane`` and ``eager-time-to-quality``."""

from __future__ import annotations

import dataclasses

from .._config import StudyConfig

__all__ = ["MODES", "MicrobenchConfig", "HyperplaneConfig", "TimeToQualityConfig"]

MODES = ("sync", "solo", "majority")
"""The modes of :class:`jaxcomm.comm.PartialAllreduce` the hyperplane studies compare (``sync``: synch-SGD)."""


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


@dataclasses.dataclass(frozen=True)
class TimeToQualityConfig(StudyConfig):
    """eager-SGD's time to quality under load imbalance (Sec. 7.2.1, Fig. 10b), over MPI on an emulated link.

    The hyperplane study of :class:`HyperplaneConfig` (``y = x . w* + noise``, a linear model,
    one random process delayed by ``delay_ms`` per step), run by ``num_procs`` MPI processes inside
    a private network namespace whose loopback is shaped to ``bandwidth``
    (:func:`jaxcomm.netem.launch`), once per seed; every mode of a seed trains in one job.

    Attributes:
      num_procs: MPI processes P.
      features, train_points, val_points, batch_total, epochs, lr, noise_std, base_compute_ms:
        as in :class:`HyperplaneConfig`.
      delay_ms: the injected delay (ms) of the one random process delayed per step.
      modes: ``"sync"`` (the baseline, required: it sets the target), ``"solo"``, ``"majority"``.
      seeds: one run of every mode per seed: the data, the shuffling, the delay table and the
        majority initiators' stream.
      equal_loss_rtol: the quality target of a seed is synch-SGD's final validation MSE times
        ``1 + equal_loss_rtol`` (the paper's "equivalent loss value").
      snapshots_per_epoch: validation points per epoch (a divisor of the steps per epoch).
      bandwidth: the emulated link's rate (tc syntax, e.g. ``"1gbit"``; a shared link).
      simulate_rounds: also replay the same imbalance in the mesh simulation with a collective that
        costs nothing (the ideal of each throughput claim; a few seconds of compilation per mode
        and seed).
      timeout_s, poll_s: a partial collective's timeout and polling interval (s).
      launch_timeout_s: limit of each seed's job (s).
    """

    num_procs: int = 4
    features: int = 8192
    train_points: int = 32768
    val_points: int = 4096
    batch_total: int = 2048
    epochs: int = 16
    lr: float = 0.06
    noise_std: float = 2.0
    base_compute_ms: float = 195.0
    delay_ms: float = 200.0
    modes: tuple[str, ...] = MODES
    seeds: tuple[int, ...] = (0, 1, 2)
    equal_loss_rtol: float = 0.05
    snapshots_per_epoch: int = 4
    bandwidth: str = "1gbit"
    simulate_rounds: bool = True
    timeout_s: float = 120.0
    poll_s: float = 0.001
    launch_timeout_s: float = 1200.0

    def __post_init__(self) -> None:
        """Also ``ValueError`` naming the field (``TimeToQualityConfig.FIELD: ...``): ``modes``
        outside :data:`MODES`, repeated, or without ``"sync"`` (it sets the target); ``seeds``
        empty or repeated; ``num_procs`` < 2 or not dividing ``batch_total`` and ``train_points``;
        ``snapshots_per_epoch`` not dividing the steps per epoch (``train_points // batch_total``);
        ``bandwidth`` not a rate tc accepts."""
        super().__post_init__()
        from jaxcomm import netem

        def bad(field: str, why: str):
            raise ValueError(f"TimeToQualityConfig.{field}: {why}")

        modes = list(self.modes)
        if not set(modes) <= set(MODES) or len(set(modes)) != len(modes) or "sync" not in modes:
            bad("modes", f"distinct names from {MODES}, 'sync' included (it sets the target); got {modes}")
        if not self.seeds or len(set(self.seeds)) != len(self.seeds):
            bad("seeds", f"give distinct seeds, at least one; got {list(self.seeds)}")
        p = self.num_procs
        if p < 2 or self.batch_total % p or self.train_points % p:
            bad(
                "num_procs",
                f"at least 2, dividing batch_total ({self.batch_total}) and train_points "
                f"({self.train_points}); got {p}",
            )
        steps_per_epoch = self.train_points // self.batch_total
        if steps_per_epoch < 1 or steps_per_epoch % self.snapshots_per_epoch:
            bad(
                "snapshots_per_epoch",
                f"must divide the {steps_per_epoch} steps per epoch (train_points // batch_total); "
                f"got {self.snapshots_per_epoch}",
            )
        try:
            netem.parse_rate(self.bandwidth, "bandwidth")
        except netem.NetemError as e:
            bad("bandwidth", str(e).removeprefix("bandwidth: "))

    @classmethod
    def default(cls) -> TimeToQualityConfig:
        """4 processes, the paper's model and data, 200 ms, 16 epochs at ``lr=0.06``, 3 seeds, a 1 Gbit/s link."""
        return cls()

    @classmethod
    def smoke(cls) -> TimeToQualityConfig:
        """256 features, 2 epochs of 8 steps, a 30 ms delay on 5 ms steps, 2 seeds, no simulated rounds."""
        return dataclasses.replace(
            cls.default(),
            features=256,
            train_points=2048,
            val_points=512,
            batch_total=256,
            epochs=2,
            lr=0.1,
            base_compute_ms=5.0,
            delay_ms=30.0,
            seeds=(0, 1),
            snapshots_per_epoch=2,
            simulate_rounds=False,
            timeout_s=30.0,
            launch_timeout_s=120.0,
        )
