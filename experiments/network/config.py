"""Configuration of ``jaxcomm run time-to-accuracy``: the methods (as builders) and the study's fields.

Importing this module imports neither JAX nor optax: each builder imports what it needs when
it is called.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Mapping
from typing import Any

from .._config import StudyConfig
from ..quickstart.config import METHODS as _QUICKSTART_METHODS

__all__ = ["METHODS", "ROUTES", "SWEPT_LEARNING_RATES", "MethodInfo", "TimeToAccuracyConfig", "build_method"]


@dataclasses.dataclass(frozen=True)
class MethodInfo:
    """What the worker records about a method besides its measurements.

    Attributes:
      compressor: name of the compressor of what is sent (``"none"``: float32).
      strategy: the collective that carries it: ``"allreduce"``, ``"allgather"`` or ``"rounds"``
        (several all-reduces per communication, PowerSGD's).
      sync_every: optimizer steps per communication period (1: every step communicates; DiLoCo's
        ``H``; streaming DiLoCo's ``H / fragments``, one fragment per period).
      warmup_steps: steps, from the start of training, over which the method's communication per
        step is not yet steady (DGC's sparsity warm-up); 0 for the others.
    """

    compressor: str
    strategy: str
    sync_every: int = 1
    warmup_steps: int = 0


Builder = Callable[..., "tuple[Any, MethodInfo]"]
"""``builder(learning_rate, momentum, options) -> (tx, MethodInfo)``; ``options`` holds the
configuration's fields (a method reads those it needs, e.g. ``dgc_steps_per_stage``), and
``one_worker: True`` where the optimizer runs over one worker (the compute-only step)."""


def _strategy(c) -> str:
    return "rounds" if c.rounds is not None else c.strategy


def _compressed(label: str, name: str, kwargs: dict) -> Builder:
    """``chain(compressed_mean(c, memory), sgd(lr, momentum))``; ``+EF`` in ``label``: residual memory."""

    def build(learning_rate: float, momentum: float, options: Mapping | None = None):
        from .._common import method_transform

        tx, c = method_transform({label: (name, kwargs)}, label, learning_rate, momentum)
        return tx, MethodInfo(c.name, _strategy(c))

    return build


def _dgc(ratio: float = 0.001, warmup: bool = True) -> Builder:
    """Deep gradient compression (``ratio`` of the entries, its own momentum), then plain SGD.

    Tensors of at most 1,024 entries (normalisation scales and biases, ResNet-20's classifier) are
    sent whole, as DGC's implementations do; every larger tensor keeps ``ratio`` after the warm-up
    (``warmup=False``: from the first step)."""

    def build(learning_rate: float, momentum: float, options: Mapping | None = None):
        import optax

        import jaxcomm

        steps_per_stage = int((options or {}).get("dgc_steps_per_stage", 10)) if warmup else 0
        tx = optax.chain(
            jaxcomm.transforms.deep_gradient_compression(
                ratio=ratio, momentum=momentum, clip_norm=None, steps_per_stage=steps_per_stage, dense_below=1024
            ),
            optax.sgd(learning_rate),
        )
        # DGC's warm-up raises the sparsity stage by stage (75 %, 93.75 %, 98.4 %, 99.6 %, then the
        # final ratio): four stages of ``steps_per_stage`` steps before the bytes per step settle.
        return tx, MethodInfo("dgc", "allgather", sync_every=1, warmup_steps=4 * steps_per_stage)

    return build


def _diloco(every: int = 20, **kwargs) -> Builder:
    """``diloco(sgd(lr, momentum), every=every, **kwargs)``; ``kwargs`` values that are callables
    ``() -> object`` are made when the builder is called (compressors, memories, outer optimizers)."""

    def build(learning_rate: float, momentum: float, options: Mapping | None = None):
        import optax

        import jaxcomm

        made = {k: (v() if callable(v) else v) for k, v in kwargs.items()}
        if made.get("overlap") and (options or {}).get("one_worker"):
            made["overlap"] = False  # the compute-only step: one worker, no MPI thread (the same arithmetic)
        c = made.get("compressor") or jaxcomm.compressors.none()
        fragments = int(made.get("fragments", 1))
        tx = jaxcomm.transforms.diloco(optax.sgd(learning_rate, momentum=momentum), every=every, **made)
        return tx, MethodInfo(c.name, _strategy(c), sync_every=every // fragments)

    return build


def _topk2():
    import jaxcomm

    return jaxcomm.compressors.topk(ratio=0.02, dense_below=256)


def _topk1_bf16():
    import jaxcomm

    return jaxcomm.compressors.half(jaxcomm.compressors.topk(ratio=0.01, dense_below=256), "bfloat16")


def _residual09():
    import jaxcomm

    return jaxcomm.memory.residual(beta=0.9)


def _outer_sgd1():
    import optax

    return optax.sgd(1.0)


def _eightbit():
    import jaxcomm

    return jaxcomm.compressors.eightbit()


def _bf16():
    import jaxcomm

    return jaxcomm.compressors.bf16()


METHODS: dict[str, Builder] = {
    **{label: _compressed(label, name, kwargs) for label, (name, kwargs) in _QUICKSTART_METHODS.items()},
    "fp16": _compressed("fp16", "fp16", {}),
    "bf16": _compressed("bf16", "bf16", {}),
    "dgc-0.1%": _dgc(),
    "dgc-1%": _dgc(0.01),
    "dgc-0.1%-no-warmup": _dgc(warmup=False),
    "diloco-H20": _diloco(),
    "diloco-H20-int8": _diloco(compressor=_eightbit),
    "sparseloco-H20": _diloco(compressor=_topk2, memory=_residual09, outer=_outer_sgd1),
    "streaming-diloco-H20": _diloco(fragments=4, delay=2, blend=0.5, compressor=_bf16, overlap=True),
    # SparseLoCo with fewer bytes (1 %, values in bfloat16), and with its exchange overlapped
    "sparseloco-H20-1%-bf16": _diloco(compressor=_topk1_bf16, memory=_residual09, outer=_outer_sgd1),
    "sparseloco-H40-1%-bf16": _diloco(40, compressor=_topk1_bf16, memory=_residual09, outer=_outer_sgd1),
    "sparseloco-H20-1%-bf16-overlap5": _diloco(
        compressor=_topk1_bf16, memory=_residual09, outer=_outer_sgd1, delay=5, blend=0.5, overlap=True
    ),
    "sparseloco-H20-1%-bf16-overlap10": _diloco(
        compressor=_topk1_bf16, memory=_residual09, outer=_outer_sgd1, delay=10, blend=0.5, overlap=True
    ),
    "sparseloco-H40-1%-bf16-overlap30": _diloco(
        40, compressor=_topk1_bf16, memory=_residual09, outer=_outer_sgd1, delay=30, blend=0.5, overlap=True
    ),
    "sparseloco-H20-1%-bf16-overlap10-carry": _diloco(
        compressor=_topk1_bf16, memory=_residual09, outer=_outer_sgd1, delay=10, carry_local=True, overlap=True
    ),
    "sparseloco-H20-1%-bf16-overlap19-carry": _diloco(
        compressor=_topk1_bf16, memory=_residual09, outer=_outer_sgd1, delay=19, carry_local=True, overlap=True
    ),
    # shorter periods, for the study of H against the steps to target
    "diloco-H10-int8": _diloco(10, compressor=_eightbit),
    "sparseloco-H10": _diloco(10, compressor=_topk2, memory=_residual09, outer=_outer_sgd1),
    "sparseloco-H5": _diloco(5, compressor=_topk2, memory=_residual09, outer=_outer_sgd1),
}
"""Method label -> builder ``(learning_rate, momentum, options) -> (tx, MethodInfo)``.

* the quickstart's methods, ``fp16`` and ``bf16``:
  ``chain(compressed_mean(c, memory), sgd(learning_rate, momentum))`` (a ``+EF`` label adds
  residual memory; 16-bit all-reduces sum in float32);
* ``dgc-0.1%``: ``chain(deep_gradient_compression(ratio=0.001, momentum, steps_per_stage=
  dgc_steps_per_stage), sgd(learning_rate))`` (the momentum is inside DGC); ``dgc-1%`` the same
  with ``ratio=0.01``; ``dgc-0.1%-no-warmup`` without the sparsity warm-up (0.1 % from the first
  step);
* ``diloco-H20``: ``diloco(sgd(learning_rate, momentum), every=20)`` (inner steps, then every 20
  steps the outer Nesterov step on the averaged parameter change), with ``-int8`` 8-bit
  quantization of what is averaged; ``sparseloco-H20``: top-k 2 % (tensors of at most 256
  entries whole) with residual memory (β = 0.9) and an outer ``sgd(1.0)``;
  ``streaming-diloco-H20``: 4 fragments, one every 5 steps, sent in bfloat16 by an MPI
  communication thread that overlaps the next 2 inner steps, then applied and blended
  half-half (``overlap=True``; the compute-only step is timed without the thread, on one
  worker);
* ``sparseloco-H20-1%-bf16``: SparseLoCo with top-k 1 % whose values cross in bfloat16
  (``half(topk(0.01), "bfloat16")``), ``sparseloco-H40-1%-bf16`` the same every 40 steps;
  ``-overlap5`` / ``-overlap10``: the same with its exchange gathered by an MPI communication
  thread during the next 5 or 10 inner steps, then blended half-half (``overlap=True, delay=5 or
  10, blend=0.5``); ``-overlap10-carry`` / ``-overlap19-carry``: overlapped during 10 or 19
  inner steps, each worker keeping its progress since the sync (``carry_local=True``);
  ``sparseloco-H40-1%-bf16-overlap30``: every 40 steps, gathered during the next 30 inner
  steps, then blended half-half (a period long enough to hide a sync on a slow link);
* ``diloco-H10-int8``, ``sparseloco-H10``, ``sparseloco-H5``: the same with ``every`` = 10 or 5."""

SWEPT_LEARNING_RATES: dict[str, float] = {
    "none": 0.05,
    "fp16": 0.05,
    "bf16": 0.05,
    "topk-1%+EF": 0.01,
    "efsignsgd+EF": 0.01,
    "qsgd-16": 0.05,
    "powersgd-r2+EF": 0.01,
    "dgc-0.1%": 0.01,
    "diloco-H20": 0.01,
    "diloco-H20-int8": 0.02,
    "sparseloco-H20": 0.01,
    "streaming-diloco-H20": 0.01,
    "sparseloco-H20-1%-bf16": 0.02,
    "dgc-1%": 0.01,
}
"""The main job's learning rate per method, chosen by its sweep on the unshaped link (seed 0,
rates 0.01, 0.02 and 0.05: the fewest steps to 75 %, a tie to the smaller rate), measured with
``jaxcomm run time-to-accuracy --set lr_sweep=0.01,0.02,0.05 --set seeds=0 --set
bandwidths=unlimited`` (``experiments/benchmarks/results/time_to_accuracy_main_lr_sweep.json``);
``sparseloco-H20-1%-bf16`` and ``dgc-1%`` (10-step warm-up stages) from the rates 0.01 and 0.02
(``time_to_accuracy_main_sparseloco_dgc_variants.json``)."""

ROUTES = ("decomposed", "end_to_end", "compare")
"""How the time to target is measured (see :class:`TimeToAccuracyConfig`)."""


def build_method(label: str, learning_rate: float, momentum: float, options: Mapping | None = None):
    """``(tx, MethodInfo)`` of the method ``label`` of :data:`METHODS`."""
    if label not in METHODS:
        raise ValueError(f"unknown method {label!r}; valid: {list(METHODS)}")
    return METHODS[label](learning_rate, momentum, options or {})


@dataclasses.dataclass(frozen=True)
class TimeToAccuracyConfig(StudyConfig):
    """Wall-clock time to a test accuracy, MPI processes on an emulated network.

    Every job is one ``mpirun`` of ``procs`` processes inside a private network namespace
    (:func:`jaxcomm.netem.launch`) whose every byte crosses one shaped loopback link.

    Attributes:
      procs: MPI processes (workers), >= 2.
      bandwidths: link rates (``"10mbit"``, ``"1gbit"``; ``"unlimited"`` for no shaping).
      mtu: the loopback's MTU in bytes (9000: jumbo Ethernet frames).
      burst: the link's token bucket (:func:`jaxcomm.netem.launch`'s ``burst``): a size
        (``"256kb"``) or a time at the link's rate (default ``"1ms"``: 1 ms of the rate, at least
        one packet of ``mtu + 14`` bytes). A bucket lets that much pass at line speed after an
        idle spell, as if it had crossed while the step computed; a physical link does not. With
        256 KiB, ResNet-20's DGC step, which sends 160 kB (127 ms at 10 Mbit/s), took 124 ms at
        10 Mbit/s; with 1 ms, 158 ms.
      methods: labels from :data:`METHODS`, trained in this order.
      route: ``"decomposed"``: one job on the unshaped link trains every method and seed to the
        target; then one short job per link times each method's steps over whole communication
        periods, and time to target = steps to target x that link's step time. ``"end_to_end"``:
        one job per link trains every method and seed on it, timed by the wall clock.
        ``"compare"``: both, and their ratio per link and method (``agreement``).
      dataset: ``"fashion_mnist"``, ``"mnist"``, ``"mnist5k"`` or ``"digits"``.
      model: ``"resnet20"``, ``"eventgrad_cnn"`` or ``"mlp"``.
      batch_size: examples per worker and step.
      learning_rate, momentum: of the methods' ``optax.sgd`` (DGC applies the momentum itself,
        before its sparsification, and then plain SGD).
      learning_rates: method label -> learning rate for that method (others: ``learning_rate``);
        by default :data:`SWEPT_LEARNING_RATES`, the main job's sweep.
      lr_sweep: learning rates to try (empty: none); the unshaped training job first trains
        every method at each for the first seed and records its steps to target (``sweep``), then
        trains every seed at the rate that reached the target in the fewest steps (replacing
        the method's rate in ``learning_rates``); the timing jobs use the same rates.
      dgc_steps_per_stage: steps of each of DGC's sparsity warm-up stages (default 10: on the
        main job's MLP 367 steps to target on average against 407 with stages of 50, and on
        ResNet-20's seed 0 320 for both, with a fifth of the warm-up's steps).
      target_accuracy: the test accuracy timed, in (0, 1].
      max_steps: a method that has not reached the target by then is recorded as not reaching it.
      eval_every: steps between evaluations (evaluation is not timed).
      eval_examples: test examples evaluated (split over the workers; rounded down to a multiple
        of ``procs``).
      train_examples: keep only this many training examples (0: all).
      compute_steps: steps timed with a one-worker communicator (the step without its
        communication), once per method and learning rate; rounded up to whole communication periods.
      timing_steps: decomposed route: the least number of steps timed per method and link, after
        the method's warm-up; at least two communication periods are timed, in whole periods,
        and enough steps that the link's token bucket carries at most a tenth of the window's
        bytes (:func:`~experiments.network.worker.bucket_steps`, at most 2,000 steps).
      method_timing_steps: method label -> its own ``timing_steps`` (e.g. 800 for a method whose
        step takes milliseconds, in the job whose dense baselines take seconds a step).
      seeds: initialisation, data order and compressor randomness; one run per seed.
      timeout_s: seconds one job may take before it is ended.
      gather_metrics: ``True``: the trainer gathers every worker's loss and bit counts at every
        step (:class:`jaxcomm.train.Trainer`'s ``gather_metrics``), two small collectives that
        also make the processes wait for each other at every step. ``False`` (default): each
        process keeps its own, and the records' bits and messages are summed over the processes
        once per evaluation (training) or timed window (timing), so steps that send nothing
        (DiLoCo's inner steps) run without a collective, as their own program.
    """

    procs: int = 4
    bandwidths: tuple[str, ...] = ("10mbit", "100mbit", "1gbit")
    mtu: int = 9000
    burst: str = "1ms"
    methods: tuple[str, ...] = (
        "none",
        "fp16",
        "bf16",
        "topk-1%+EF",
        "efsignsgd+EF",
        "qsgd-16",
        "powersgd-r2+EF",
        "dgc-0.1%",
        "diloco-H20",
        "diloco-H20-int8",
        "sparseloco-H20",
        "sparseloco-H20-1%-bf16",
        "streaming-diloco-H20",
    )
    route: str = "decomposed"
    dataset: str = "fashion_mnist"
    model: str = "mlp"
    batch_size: int = 8
    learning_rate: float = 0.02
    momentum: float = 0.9
    learning_rates: dict[str, float] = dataclasses.field(default_factory=lambda: dict(SWEPT_LEARNING_RATES))
    lr_sweep: tuple[float, ...] = ()
    dgc_steps_per_stage: int = 10
    target_accuracy: float = 0.75
    max_steps: int = 600
    eval_every: int = 20
    eval_examples: int = 1000
    train_examples: int = 0
    compute_steps: int = 20
    timing_steps: int = 20
    method_timing_steps: dict[str, int] = dataclasses.field(default_factory=dict)
    seeds: tuple[int, ...] = (0, 1, 2)
    timeout_s: float = 3600.0
    gather_metrics: bool = False

    def __post_init__(self) -> None:
        """``ValueError`` naming the first invalid field (``TimeToAccuracyConfig.FIELD: ...``)."""
        super().__post_init__()
        from jaxcomm import netem

        def bad(field: str, why: str):
            raise ValueError(f"TimeToAccuracyConfig.{field}: {why}")

        if self.procs < 2:
            bad("procs", f"need at least 2 processes; got {self.procs}")
        if not self.bandwidths:
            bad("bandwidths", "give at least one link rate (e.g. 100mbit, or unlimited)")
        for bw in self.bandwidths:
            try:
                netem.parse_rate(str(bw), "bandwidths")
            except netem.NetemError as e:
                bad("bandwidths", str(e).removeprefix("bandwidths: "))
        from jaxcomm.netem._link import link_settings

        for bw in self.bandwidths:  # the link each job is given (mtu, burst), checked before any starts
            try:
                link_settings(bw, "0", self.burst, self.mtu)
            except netem.NetemError as e:
                field = "mtu" if str(e).startswith("--mtu") else "burst"
                bad(field, str(e).removeprefix("--mtu: ").removeprefix("--burst: "))
        unknown = [m for m in self.methods if m not in METHODS]
        if unknown or not self.methods:
            raise ValueError(f"TimeToAccuracyConfig.methods must be names from {list(METHODS)}; unknown: {unknown}")
        if len(set(self.methods)) != len(self.methods):
            bad("methods", f"each method once; got {list(self.methods)}")
        if not isinstance(self.gather_metrics, bool):
            bad("gather_metrics", f"must be true or false; got {self.gather_metrics!r}")
        if self.route not in ROUTES:
            bad("route", f"must be one of {', '.join(ROUTES)}; got {self.route!r}")
        if not 0.0 < self.target_accuracy <= 1.0:
            bad("target_accuracy", f"must be in (0, 1]; got {self.target_accuracy}")
        for key in ("max_steps", "eval_every", "batch_size", "compute_steps", "timing_steps", "dgc_steps_per_stage"):
            if getattr(self, key) < 1:
                bad(key, f"must be >= 1; got {getattr(self, key)}")
        if self.eval_examples < self.procs:
            bad("eval_examples", f"need at least one per process ({self.procs}); got {self.eval_examples}")
        if self.train_examples < 0:
            bad("train_examples", f"must be >= 0; got {self.train_examples}")
        if not self.seeds:
            bad("seeds", "give at least one seed")
        if any(not 0 <= s < 2**32 for s in self.seeds) or len(set(self.seeds)) != len(self.seeds):
            bad("seeds", f"distinct seeds in [0, 2**32); got {list(self.seeds)}")
        if not isinstance(self.method_timing_steps, dict):
            bad("method_timing_steps", f"a mapping of method label to steps; got {self.method_timing_steps!r}")
        for label, n in self.method_timing_steps.items():
            if label not in METHODS:
                bad("method_timing_steps", f"unknown method {label!r}; valid: {list(METHODS)}")
            if isinstance(n, bool) or not isinstance(n, int) or n < 1:
                bad("method_timing_steps", f"the steps of {label!r} must be an integer >= 1; got {n!r}")
        if not isinstance(self.learning_rates, dict):
            bad("learning_rates", f"a mapping of method label to learning rate; got {self.learning_rates!r}")
        for label, lr in self.learning_rates.items():
            if label not in METHODS:
                bad("learning_rates", f"unknown method {label!r}; valid: {list(METHODS)}")
            if isinstance(lr, bool) or not isinstance(lr, (int, float)) or not lr > 0:
                bad("learning_rates", f"the learning rate of {label!r} must be a number > 0; got {lr!r}")
        if any(not lr > 0 for lr in self.lr_sweep):
            bad("lr_sweep", f"learning rates must be > 0; got {list(self.lr_sweep)}")
        if self.lr_sweep and self.route == "end_to_end":
            bad("lr_sweep", "runs in the unshaped training job of route decomposed or compare, not end_to_end")
        if not self.timeout_s > 0:
            bad("timeout_s", f"must be > 0 seconds; got {self.timeout_s}")

    def learning_rate_of(self, method: str) -> float:
        """The learning rate ``method`` trains with: ``learning_rates[method]``, else ``learning_rate``."""
        return float(self.learning_rates.get(method, self.learning_rate))

    @classmethod
    def default(cls) -> TimeToAccuracyConfig:
        """The main study: an MLP on Fashion-MNIST, 4 processes, 10 Mbit/s, 100 Mbit/s and
        1 Gbit/s, every method at its swept learning rate (:data:`SWEPT_LEARNING_RATES`), three
        seeds, the decomposed route."""
        return cls()

    @classmethod
    def full(cls) -> TimeToAccuracyConfig:
        """The larger study (``jaxcomm run time-to-accuracy --full``): ResNet-20 (GroupNorm, 0.27 M
        parameters) on Fashion-MNIST, where a step computes for about 0.1 s on this machine's two
        cores, so that a link's share of a step is that of a cluster of accelerators on a slower
        network; up to 1,000 steps; float32 and bfloat16 dense, DGC, DiLoCo with an int8 outer
        gradient, SparseLoCo and streaming DiLoCo; three seeds (``--set methods=...`` adds the
        others of :data:`METHODS`)."""
        return dataclasses.replace(
            cls.default(),
            model="resnet20",
            learning_rates={},  # every method at learning_rate (0.02): the rates were not swept for ResNet-20
            max_steps=1000,
            methods=("none", "bf16", "dgc-0.1%", "diloco-H20-int8", "sparseloco-H20", "streaming-diloco-H20"),
            timeout_s=3 * 3600.0,
        )

    @classmethod
    def smoke(cls) -> TimeToAccuracyConfig:
        """Two processes, an MLP on the digits set, dense vs top-k 1 % with EF, one seed, the
        learning rate chosen from two: trained on the unshaped link, timed on a 200 Mbit/s and a
        1 Gbit/s one (the decomposed route); each process keeps its own metrics
        (``gather_metrics=False``), summed over the processes per evaluation and timed window."""
        return dataclasses.replace(
            cls.default(),
            procs=2,
            bandwidths=("200mbit", "1gbit"),
            methods=("none", "topk-1%+EF"),
            dataset="digits",
            model="mlp",
            batch_size=16,
            learning_rate=0.1,
            learning_rates={},
            lr_sweep=(0.05, 0.1),
            target_accuracy=0.5,
            max_steps=60,
            eval_every=10,
            eval_examples=200,
            compute_steps=5,
            timing_steps=10,
            seeds=(0,),
            timeout_s=300.0,
            gather_metrics=False,
        )
