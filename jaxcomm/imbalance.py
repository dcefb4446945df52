"""Load-imbalance models: per-step, per-worker compute times (eager-SGD, Li et al. 2020, Sec. 7).

Every model answers one question: *how long does worker ``i`` compute in step
``t``?*  ``model.sample(key, step)`` returns ``float32[P]`` milliseconds, a pure
function of an explicit PRNG key and the step (jit- and vmap-compatible). Workers
that share the key draw the same numbers, which is how the paper keeps the
injected delays consistent across ranks ("same random stream on all ranks"): a
simulation calls ``sample`` inside the jitted step with the shared key; an MPI
run computes :func:`schedule` once (``[T, P]`` milliseconds) and every process
reads its column.

Models (``base_ms`` is added to every draw, the balanced compute time):

* :class:`RandomDelay` -- ``num_delayed`` random workers out of ``P`` are delayed
  by ``delay_ms`` each step (Sec. 7.2.1: one of 8 by 200/300/400 ms; Sec. 7.2.2:
  4 of 64 by 300/460 ms). ``replace=True`` draws the ranks with replacement, as
  the reference code does ("up to two random ranks by 320 ms").
* :class:`LinearSkew` -- worker ``i`` takes ``(i + 1) * unit_ms`` (Sec. 7.1,
  the 1..32 ms microbenchmark, Fig. 8-9).
* :class:`RotatingSkew` -- the ``P`` workers get ``P`` evenly spaced times from
  ``min_ms`` to ``max_ms``, shifted by one worker every step (Sec. 7.2.3,
  50..400 ms, "the injection amount over the processes is shifted after each
  step").
* :class:`EmpiricalTimes` -- measured step times (Sec. 2, Fig. 2-4): a 1-D list
  is sampled i.i.d. per (step, worker); a 2-D ``[T, P]`` table is replayed.
"""

from __future__ import annotations

import dataclasses
from typing import Protocol, runtime_checkable

import jax
import jax.numpy as jnp
import numpy as np

from ._validate import check_int, lookup

__all__ = [
    "RandomDelay",
    "LinearSkew",
    "RotatingSkew",
    "EmpiricalTimes",
    "schedule",
    "make",
    "names",
]


@runtime_checkable
class ImbalanceModel(Protocol):
    """Per-step compute times of ``num_workers`` workers.

    ``sample(key, step) -> float32[num_workers]`` (milliseconds, >= 0) must be a
    pure function of ``key`` (a PRNG key shared by all workers) and ``step``
    (an int or int32 scalar, may be traced).
    """

    # Read-only, so frozen dataclasses (RandomDelay, LinearSkew, ...) satisfy the protocol.
    @property
    def num_workers(self) -> int: ...

    def sample(self, key: jax.Array, step) -> jax.Array: ...


def _check_ms(name: str, value, *, positive: bool = False) -> float:
    try:
        v = float(value)
    except (TypeError, ValueError):
        raise TypeError(f"{name} must be a number of milliseconds; got {value!r}") from None
    if not np.isfinite(v) or v < 0 or (positive and v == 0):
        raise ValueError(f"{name} must be finite and {'> 0' if positive else '>= 0'} ms; got {value!r}")
    return v


def _step_key(key: jax.Array, step) -> jax.Array:
    if isinstance(key, (int, np.integer)):
        key = jax.random.key(int(key))
    return jax.random.fold_in(key, jnp.asarray(step, jnp.uint32))


@dataclasses.dataclass(frozen=True)
class RandomDelay:
    """``num_delayed`` random workers per step take ``base_ms + delay_ms``, the rest ``base_ms``.

    Paper Sec. 7.2.1-7.2.2. With ``replace=False`` exactly ``num_delayed``
    distinct workers are delayed (a uniformly random subset); with
    ``replace=True`` ``num_delayed`` ranks are drawn independently, so up to
    ``num_delayed`` distinct workers are delayed (the reference implementation).

    Attributes:
      num_workers: ``P``.
      num_delayed: ``r`` in ``[0, P]``.
      delay_ms: ``d`` >= 0.
      base_ms: balanced compute time >= 0.
      replace: draw ranks with replacement.
    """

    num_workers: int
    num_delayed: int = 1
    delay_ms: float = 200.0
    base_ms: float = 0.0
    replace: bool = False

    def __post_init__(self):
        object.__setattr__(self, "num_workers", check_int(self.num_workers, "num_workers"))
        num_delayed = check_int(self.num_delayed, "num_delayed", 0, maximum=self.num_workers)
        object.__setattr__(self, "num_delayed", num_delayed)
        object.__setattr__(self, "delay_ms", _check_ms("delay_ms", self.delay_ms))
        object.__setattr__(self, "base_ms", _check_ms("base_ms", self.base_ms))

    def sample(self, key, step) -> jax.Array:
        """``float32[P]`` ms: ``base_ms + delay_ms * [i is delayed]``."""
        p, r = self.num_workers, self.num_delayed
        k = _step_key(key, step)
        if r == 0:
            delayed = jnp.zeros((p,), bool)
        elif self.replace:
            ranks = jax.random.randint(k, (r,), 0, p)
            delayed = jnp.any(ranks[:, None] == jnp.arange(p)[None, :], axis=0)
        else:
            ranks = jax.random.permutation(k, p)[:r]
            delayed = jnp.zeros((p,), bool).at[ranks].set(True)
        return (self.base_ms + self.delay_ms * delayed.astype(jnp.float32)).astype(jnp.float32)


@dataclasses.dataclass(frozen=True)
class LinearSkew:
    """Worker ``i`` takes ``base_ms + (i + 1) * unit_ms`` every step (Sec. 7.1, Fig. 8-9).

    Deterministic; ``key`` and ``step`` are ignored. With ``P = 32`` and
    ``unit_ms = 1`` this is the paper's 1..32 ms microbenchmark skew.
    """

    num_workers: int
    unit_ms: float = 1.0
    base_ms: float = 0.0

    def __post_init__(self):
        object.__setattr__(self, "num_workers", check_int(self.num_workers, "num_workers"))
        object.__setattr__(self, "unit_ms", _check_ms("unit_ms", self.unit_ms, positive=True))
        object.__setattr__(self, "base_ms", _check_ms("base_ms", self.base_ms))

    def sample(self, key, step) -> jax.Array:
        """``float32[P]`` ms: ``base_ms + unit_ms * (1, 2, ..., P)``."""
        del key, step
        return (self.base_ms + self.unit_ms * jnp.arange(1, self.num_workers + 1, dtype=jnp.float32)).astype(
            jnp.float32
        )


@dataclasses.dataclass(frozen=True)
class RotatingSkew:
    """Evenly spaced times ``min_ms..max_ms`` over the workers, rotated by one every step.

    Sec. 7.2.3 (ResNet-32, severe imbalance): worker ``i`` in step ``t`` takes
    ``base_ms + levels[(i + t) mod P]`` with ``levels = linspace(min_ms, max_ms, P)``,
    so every step has one worker at each level and over ``P`` steps every worker
    visits every level.
    """

    num_workers: int
    min_ms: float = 50.0
    max_ms: float = 400.0
    base_ms: float = 0.0

    def __post_init__(self):
        object.__setattr__(self, "num_workers", check_int(self.num_workers, "num_workers"))
        lo = _check_ms("min_ms", self.min_ms)
        hi = _check_ms("max_ms", self.max_ms)
        if hi < lo:
            raise ValueError(f"max_ms must be >= min_ms; got min_ms={lo}, max_ms={hi}")
        object.__setattr__(self, "min_ms", lo)
        object.__setattr__(self, "max_ms", hi)
        object.__setattr__(self, "base_ms", _check_ms("base_ms", self.base_ms))

    def sample(self, key, step) -> jax.Array:
        """``float32[P]`` ms: ``base_ms + levels[(i + step) mod P]``."""
        del key
        p = self.num_workers
        levels = jnp.asarray(np.linspace(self.min_ms, self.max_ms, p), jnp.float32)
        idx = (jnp.arange(p) + jnp.asarray(step, jnp.int32)) % p
        return (self.base_ms + levels[idx]).astype(jnp.float32)


@dataclasses.dataclass(frozen=True)
class EmpiricalTimes:
    """Measured step times (ms), e.g. the UCF101/WMT16/cloud distributions of Sec. 2.

    ``times_ms`` 1-D (any length ``n``): every (step, worker) draws i.i.d.
    uniformly from the list. 2-D ``[T, P]``: step ``t`` replays row ``t mod T``
    (``P`` must equal ``num_workers``). Stored as nested tuples so the model is
    hashable (a static argument under jit).
    """

    num_workers: int
    times_ms: tuple
    base_ms: float = 0.0

    def __post_init__(self):
        object.__setattr__(self, "num_workers", check_int(self.num_workers, "num_workers"))
        arr = np.asarray(self.times_ms, dtype=np.float64)
        if arr.ndim not in (1, 2) or arr.size == 0:
            raise ValueError(f"times_ms must be a non-empty 1-D list or a 2-D [T, P] table; got shape {arr.shape}")
        if arr.ndim == 2 and arr.shape[1] != self.num_workers:
            raise ValueError(f"times_ms table has {arr.shape[1]} columns but num_workers={self.num_workers}")
        if not np.all(np.isfinite(arr)) or np.any(arr < 0):
            raise ValueError("times_ms must be finite and >= 0 ms")
        object.__setattr__(self, "times_ms", tuple(map(tuple, arr.tolist())) if arr.ndim == 2 else tuple(arr.tolist()))
        object.__setattr__(self, "base_ms", _check_ms("base_ms", self.base_ms))

    def sample(self, key, step) -> jax.Array:
        """``float32[P]`` ms drawn from (1-D) or replayed from (2-D) ``times_ms``."""
        table = jnp.asarray(np.asarray(self.times_ms, np.float32))
        if table.ndim == 2:
            row = table[jnp.asarray(step, jnp.int32) % table.shape[0]]
        else:
            idx = jax.random.randint(_step_key(key, step), (self.num_workers,), 0, table.shape[0])
            row = table[idx]
        return (self.base_ms + row).astype(jnp.float32)


def schedule(model: ImbalanceModel, key, num_steps: int) -> np.ndarray:
    """All compute times of ``num_steps`` steps: ``float32[num_steps, P]`` ms (NumPy).

    Row ``t`` equals ``model.sample(key, t)``. ``key`` is a PRNG key or an int
    seed. An MPI launcher computes this once and hands every rank the same
    table (the paper's shared random stream).
    """
    if not isinstance(model, ImbalanceModel):
        raise TypeError(f"model must implement ImbalanceModel (num_workers, sample); got {type(model).__name__}")
    num_steps = check_int(num_steps, "num_steps", 0)
    if isinstance(key, (int, np.integer)):
        key = jax.random.key(int(key))
    if num_steps == 0:
        return np.zeros((0, model.num_workers), np.float32)
    steps = jnp.arange(num_steps, dtype=jnp.int32)
    out = jax.jit(jax.vmap(lambda s: model.sample(key, s)))(steps)
    return np.asarray(out, np.float32)


_FACTORIES = {
    "random_delay": RandomDelay,
    "linear_skew": LinearSkew,
    "rotating_skew": RotatingSkew,
    "empirical": EmpiricalTimes,
}


def names() -> list[str]:
    """Names accepted by :func:`make`."""
    return sorted(_FACTORIES)


def make(name: str, num_workers: int, **kwargs) -> ImbalanceModel:
    """Build a model by name (``random_delay``, ``linear_skew``, ``rotating_skew``, ``empirical``)."""
    return lookup(_FACTORIES, name, "imbalance model")(num_workers, **kwargs)
