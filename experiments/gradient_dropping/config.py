"""Configuration of ``jaxcomm run gradient-dropping``."""

from __future__ import annotations

import dataclasses

from .._config import StudyConfig

__all__ = ["METHODS", "GradientDroppingConfig", "GradientDroppingTimeConfig", "time_method_parts"]

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


def time_method_parts(label: str) -> tuple[str, bool]:
    """``(method, sync)`` of a label of the timed study: a name of :data:`METHODS`, ``+sync`` for
    parameter averaging every ``sync_every`` steps (``"partial+sync"`` -> ``("partial", True)``)."""
    method = label.removesuffix("+sync")
    return method, method != label


@dataclasses.dataclass(frozen=True)
class GradientDroppingTimeConfig(StudyConfig):
    """Time to a validation perplexity of the char-LSTM, ``num_procs`` MPI processes on an emulated link.

    Every run of a seed trains the same model from the same initialisation on the same batches
    for ``steps`` steps (the paper's protocol: whole runs, the time to a quality read off the
    curve); every seed's runs are in one ``mpirun`` job inside a private network namespace whose
    loopback is shaped to ``bandwidth`` (:func:`jaxcomm.netem.launch`).

    Attributes:
      num_procs: MPI processes (workers), >= 2.
      methods: labels ``METHOD`` or ``METHOD+sync`` (METHOD from :data:`METHODS`), trained in this
        order for every seed; ``"baseline"`` is required (it sets the target).
      seeds: initialisation, batching and the workers' keys; one run of every method per seed.
      steps: optimizer steps of every run.
      eval_every: steps between validation evaluations (not timed).
      eval_windows: validation windows evaluated, split over the processes (a multiple of
        ``num_procs``).
      target_rtol: the quality target of a seed is its baseline's final validation perplexity
        times ``1 + target_rtol``.
      seq_len, batch_size, embed, hidden: as in :class:`GradientDroppingConfig` (``batch_size``:
        windows per worker and step).
      learning_rate, drop_ratio, warmup_steps, sync_every, corpus_chars: as in
        :class:`GradientDroppingConfig`.
      compute_steps: steps timed per method with a one-worker communicator (the step without its
        communication), all processes at once; their median is the compute-only step (0: not
        measured).
      bandwidth: the emulated link's rate (tc syntax, e.g. ``"100mbit"``; one link shared by all
        processes).
      launch_timeout_s: limit of the whole ``mpirun`` job (s).
    """

    num_procs: int = 4
    methods: tuple[str, ...] = ("baseline", "drop99", "partial+sync")
    seeds: tuple[int, ...] = (0, 1, 2)
    steps: int = 400
    eval_every: int = 20
    eval_windows: int = 256
    target_rtol: float = 0.05
    seq_len: int = 64
    batch_size: int = 32
    embed: int = 32
    hidden: int = 128
    learning_rate: float = 0.002
    drop_ratio: float = 0.99
    warmup_steps: int = 60
    sync_every: int = 100
    corpus_chars: int = 0
    compute_steps: int = 100
    bandwidth: str = "200mbit"
    launch_timeout_s: float = 1500.0

    def __post_init__(self) -> None:
        """Also ``ValueError`` naming the field (``GradientDroppingTimeConfig.FIELD: ...``):
        ``methods`` not labels of :data:`METHODS` (``+sync`` allowed), repeated, or without
        ``"baseline"``; ``seeds`` empty or repeated; ``num_procs`` < 2; ``eval_windows`` not a
        multiple of ``num_procs``; ``bandwidth`` not a rate tc accepts."""
        super().__post_init__()
        from jaxcomm import netem

        def bad(field: str, why: str):
            raise ValueError(f"GradientDroppingTimeConfig.{field}: {why}")

        labels = list(self.methods)
        known = all(time_method_parts(m)[0] in METHODS for m in labels)
        if not known or len(set(labels)) != len(labels) or "baseline" not in labels:
            bad("methods", f"distinct names from {list(METHODS)}, each with or without '+sync', 'baseline' included "
                f"(it sets the target); got {labels}")  # fmt: skip
        if not self.seeds or len(set(self.seeds)) != len(self.seeds):
            bad("seeds", f"give distinct seeds, at least one; got {list(self.seeds)}")
        if self.num_procs < 2:
            bad("num_procs", f"need at least 2 processes; got {self.num_procs}")
        if self.eval_windows % self.num_procs:
            bad("eval_windows", f"a multiple of num_procs ({self.num_procs}), split over them; got {self.eval_windows}")
        try:
            netem.parse_rate(self.bandwidth, "bandwidth")
        except netem.NetemError as e:
            bad("bandwidth", str(e).removeprefix("bandwidth: "))

    @classmethod
    def default(cls) -> GradientDroppingTimeConfig:
        """4 processes on a 200 Mbit/s link, 400 steps, baseline, vanilla dropping and PARTIAL + sync, 3 seeds."""
        return cls()

    @classmethod
    def smoke(cls) -> GradientDroppingTimeConfig:
        """2 processes, 8 steps of a small LSTM on 20,000 characters, baseline and PARTIAL + sync, 2 seeds;
        no compute-only step."""
        return dataclasses.replace(
            cls.default(),
            num_procs=2,
            methods=("baseline", "partial+sync"),
            seeds=(0, 1),
            steps=8,
            eval_every=4,
            eval_windows=16,
            seq_len=16,
            batch_size=8,
            embed=8,
            hidden=16,
            warmup_steps=2,
            sync_every=4,
            corpus_chars=20000,
            compute_steps=0,
            bandwidth="1gbit",
            launch_timeout_s=240.0,
        )
