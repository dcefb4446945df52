"""Steps that send nothing: a transform's communication schedule, read by the step that traces it.

A transform that communicates only at some steps (DiLoCo's syncs) chooses its branch with a
``lax.switch`` on its step count, so the one compiled step holds the collectives of every branch.
Over MPI those collectives are mpi4jax custom calls with an ordered JAX effect, and JAX dispatches a
program with effects through its Python path (its C++ fast path serves effect-free programs
only), with a runtime token per call: about 4,500 Python calls per step for the MLP of the
time-to-accuracy study, paid at every inner step although the branch that holds the
collectives never runs there.

So the step (:func:`jaxcomm.train.make_train_step` with a communicator) traces such a transform
inside :func:`tracing_schedule`. Every scheduled transform reports, with :func:`report_next_step`,
whether the *next* call of its ``update`` communicates (a traced boolean scalar, computed from its
own step count), and asks :func:`quiet_step` whether this trace is the step's *quiet*
specialization, in which it takes its no-communication branch statically. The step compiles the
quiet program besides the full one and runs it only where every report of the previous step,
from the very state it is given, said that nothing is sent: the two programs compute the same
numbers there, and the quiet one holds no collective of the scheduled transforms.

A report made below the step's own trace (inside another transform's ``lax.cond``, ``scan`` or
``vmap``, where the next call of ``update`` need not be the next step) makes the schedule unknown:
no quiet program is run.
"""

from __future__ import annotations

import contextlib
import contextvars
import dataclasses
from collections.abc import Iterator
from typing import Any

import jax
import jax.numpy as jnp
from jax.extend.core import get_opaque_trace_state

__all__ = ["Schedule", "quiet_step", "report_next_step", "tracing_schedule"]


@dataclasses.dataclass
class Schedule:
    """What the scheduled transforms of one traced step reported.

    Attributes:
      quiet: the trace is the step's quiet specialization (every scheduled transform sends nothing).
      sends_next: the reports, traced boolean scalars: ``True`` where the next call of that
        transform's ``update`` communicates.
      nested: some report came from below the step's trace (the schedule is then unknown).
    """

    quiet: bool
    trace: Any = None
    sends_next: list = dataclasses.field(default_factory=list)
    nested: bool = False

    def quiet_next(self) -> jax.Array | None:
        """Boolean scalar, ``True`` where no scheduled transform communicates at the next step; ``None``
        where nothing was reported or a report was nested (no quiet program then)."""
        if not self.sends_next or self.nested:
            return None
        return jnp.logical_not(jnp.any(jnp.stack([jnp.asarray(s, bool) for s in self.sends_next])))


_SCHEDULE: contextvars.ContextVar[Schedule | None] = contextvars.ContextVar("jaxcomm_schedule", default=None)


@contextlib.contextmanager
def tracing_schedule(quiet: bool) -> Iterator[Schedule]:
    """Collect the scheduled transforms' reports while the step is traced (call it inside the traced
    function); ``quiet=True`` traces the quiet specialization."""
    schedule = Schedule(quiet=bool(quiet), trace=get_opaque_trace_state())
    token = _SCHEDULE.set(schedule)
    try:
        yield schedule
    finally:
        _SCHEDULE.reset(token)


def _current() -> Schedule | None:
    """The schedule of the step being traced, if this is its own trace (not a nested one)."""
    schedule = _SCHEDULE.get()
    if schedule is None:
        return None
    if get_opaque_trace_state() != schedule.trace:
        schedule.nested = True
        return None
    return schedule


def quiet_step() -> bool:
    """``True`` while the step's quiet specialization is traced (at the step's own trace level): a
    scheduled transform then takes its no-communication branch statically."""
    schedule = _current()
    return schedule is not None and schedule.quiet


def report_next_step(sends) -> None:
    """Report, while a step is traced, whether this transform's next ``update`` communicates
    (``sends``: boolean scalar). Outside a step's trace it does nothing."""
    schedule = _current()
    if schedule is not None:
        schedule.sends_next.append(sends)
