"""The studies' configurations: a base for every study's dataclass, and the data-parallel image studies' fields.

Importing this module imports neither JAX nor Flax. Every study's configuration is a frozen
dataclass derived from :class:`StudyConfig`, whose ``__post_init__`` checks each numeric field
against its range in :data:`RANGES` and each ``dataset``/``model`` against :data:`CHOICES`; it
runs whenever an instance is made: by the study's ``default()``/``smoke()``, by
``dataclasses.replace`` (``--set key=value``) and by ``jaxcomm.studies.config_from_dict`` (JSON).
"""

from __future__ import annotations

import dataclasses

from jaxcomm.studies import MAX_DEVICES, check_range

__all__ = ["CHOICES", "IMAGE_DATASETS", "IMAGE_MODELS", "RANGES", "DataParallelConfig", "StudyConfig"]

_INF = float("inf")
_COUNT = (1, _INF, True, True)  # a count of at least one
_SIZE = (0, _INF, True, True)  # a count or a time that may be zero (0: all, or none)
_POSITIVE = (0.0, _INF, False, True)  # a rate, a time or a tolerance
_MOMENTUM = (0.0, 1.0, True, False)
_FRACTION = (0.0, 1.0, False, True)  # a kept fraction
_SEED = (0, 2**32, True, False)  # PRNGKey keeps 32 bits: a larger seed would alias a smaller one

RANGES: dict[str, tuple[float, float, bool, bool]] = {
    **dict.fromkeys(
        ("steps", "batch_size", "eval_every", "eval_windows", "seq_len", "embed", "hidden", "sync_every"), _COUNT
    ),
    **dict.fromkeys(("batch_per_worker", "resnet_batch_per_worker", "severe_batch_per_worker"), _COUNT),
    **dict.fromkeys(("workers", "resnet_workers", "severe_workers", "history", "count", "features"), _COUNT),
    **dict.fromkeys(("train_points", "val_points", "batch_total", "severe_downsample", "severe_epochs"), _COUNT),
    "MicrobenchConfig.iterations": _COUNT,  # EventGradConfig.iterations <= 0 means "run epochs"
    "num_procs": (1, 256, True, True),
    "devices": (1, MAX_DEVICES, True, True),
    **dict.fromkeys(("train_examples", "test_examples", "resnet_test_examples", "corpus_chars"), _SIZE),
    **dict.fromkeys(("severe_train_examples", "severe_test_examples", "warmup", "warmup_steps"), _SIZE),
    **dict.fromkeys(("forced_iterations", "trace_tensors", "severe_warmup_epochs", "noise_std", "horizon"), _SIZE),
    **dict.fromkeys(("skew_unit_ms", "base_compute_ms", "delays_ms", "severe_min_ms", "severe_max_ms"), _SIZE),
    "delay_ms": _SIZE,
    **dict.fromkeys(("learning_rate", "lr", "resnet_lr", "severe_lr", "epochs"), _POSITIVE),
    **dict.fromkeys(("timeout_s", "poll_s", "launch_timeout_s", "equal_loss_rtol"), _POSITIVE),
    **dict.fromkeys(("momentum", "resnet_momentum", "severe_momentum"), _MOMENTUM),
    **dict.fromkeys(("topk_ratio", "topk"), _FRACTION),
    "drop_ratio": (0.0, 1.0, True, False),  # the dropped fraction: 1 would send nothing
    "seed": _SEED,
    **dict.fromkeys(
        ("PaperClaimsConfig.seeds", "TimeToQualityConfig.seeds", "GradientDroppingTimeConfig.seeds"), _SEED
    ),
    "GradientDroppingTimeConfig.compute_steps": _SIZE,
    "target_rtol": _POSITIVE,
    "snapshots_per_epoch": _COUNT,
    **dict.fromkeys(("EventGradRingConfig.iterations", "plateau_evals"), _COUNT),
    **dict.fromkeys(("plateau_points", "target_points", "same_accuracy_points"), _POSITIVE),
    "EventGradRingConfig.seeds": _SEED,
}
"""Ranges of the studies' numeric fields, by field name, or ``"ConfigClass.field"`` where one study
gives a name another meaning: ``(low, high, low inclusive, high inclusive)``. A tuple field's range
applies to each item. Every float must also be finite, every int within 64 bits (checked by
``jaxcomm.studies`` with the field's type)."""

IMAGE_DATASETS = ("mnist", "fashion_mnist", "mnist5k", "digits")
"""The image datasets of the studies (``_common.load_image_task``)."""
IMAGE_MODELS = ("mlp", "eventgrad_cnn", "resnet20")
"""The image models of the studies (``_common.build_model``)."""
CHOICES: dict[str, tuple[str, ...]] = {"dataset": IMAGE_DATASETS, "model": IMAGE_MODELS}
"""Field name -> the names it may hold."""


@dataclasses.dataclass(frozen=True)
class StudyConfig:
    """The base of every study's configuration (no fields of its own).

    A subclass that defines ``__post_init__`` calls ``super().__post_init__()`` first.
    """

    def __post_init__(self) -> None:
        """``ValueError`` naming ``Class.field`` (``[i]`` for a tuple's item) for a number outside its
        :data:`RANGES` entry, or a name outside its :data:`CHOICES`."""
        cls_name = type(self).__name__
        for f in dataclasses.fields(self):
            value = getattr(self, f.name)
            key = f"{cls_name}.{f.name}" if f"{cls_name}.{f.name}" in RANGES else f.name
            if key in RANGES:
                for i, item in enumerate(value) if isinstance(value, tuple) else [(None, value)]:
                    check_range(f"{cls_name}.{f.name}" + ("" if i is None else f"[{i}]"), item, RANGES[key])
            if f.name in CHOICES and value not in CHOICES[f.name]:
                raise ValueError(f"{cls_name}.{f.name} must be one of {', '.join(CHOICES[f.name])}; got {value!r}")

    @classmethod
    def default(cls):
        """The full study: every field at its default."""
        return cls()


@dataclasses.dataclass(frozen=True)
class DataParallelConfig(StudyConfig):
    """The fields of a data-parallel image study on ``devices`` mesh workers (simulated CPU devices).

    A study's configuration derives from it, adds its own fields and restates a default where its
    study differs.

    Attributes:
      dataset: ``"mnist"``, ``"fashion_mnist"``, ``"mnist5k"`` or ``"digits"``.
      model: ``"mlp"``, ``"eventgrad_cnn"`` or ``"resnet20"``.
      devices: data-parallel workers (simulated CPU devices).
      batch_size: examples per step over all workers (the global batch; each worker gets
        ``batch_size / devices``).
      steps: optimizer steps per run.
      eval_every: steps between test evaluations.
      learning_rate, momentum: of ``optax.sgd``.
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
    train_examples: int = 0
    test_examples: int = 2000
    seed: int = 0

    def __post_init__(self) -> None:
        """Also ``ValueError`` for a global batch that the workers cannot share."""
        super().__post_init__()
        name = type(self).__name__
        if self.devices >= 1 and self.batch_size % self.devices:
            raise ValueError(
                f"{name}.batch_size must be a multiple of {name}.devices (each worker takes batch_size / devices "
                f"examples); got batch_size={self.batch_size}, devices={self.devices}"
            )

    @classmethod
    def small(cls, **changes):
        """The default with the small run the smoke configurations share: 4 steps of an MLP on 4
        workers, a global batch of 64, 1,024 training and 256 test examples; then ``changes``."""
        return dataclasses.replace(
            cls.default(),
            **{
                "model": "mlp",
                "devices": 4,
                "batch_size": 64,
                "steps": 4,
                "eval_every": 4,
                "train_examples": 1024,
                "test_examples": 256,
                **changes,
            },
        )
