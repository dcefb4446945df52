"""The simulation loop: ``P`` workers on a named axis of one device, round by round.

The data-parallel :class:`~jaxcomm.train.Trainer` runs one worker per device.
Decentralized and asynchronous algorithms (D-PSGD, EventGraD, eager-SGD) are
studied instead with many simulated workers on one device: every pytree holds a
leading worker axis of size ``P`` and a round is one jit-compiled function of the
whole stacked state, in which the per-worker parts run under
``jax.vmap(..., axis_name=...)`` (or ``jax.shard_map`` on a mesh, see
:func:`jaxcomm.algorithms.per_worker`) so the communicators see the axis.

:func:`simulate` is the one host loop around such a round: it compiles it once
(optionally ``rounds_per_call`` rounds in one ``lax.scan``), feeds host inputs,
collects the per-round outputs, shows a tqdm bar, evaluates every ``eval_every``
calls and at the end, and hands every history entry to ``on_eval`` as soon as
it is made.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
import numpy as np

from .._progress import progress_bar
from .._validate import check_int

__all__ = ["SimulationResult", "simulate"]


class SimulationResult(NamedTuple):
    """What :func:`simulate` recorded besides the final state.

    Attributes:
      history: one dict per evaluation point: ``summary``'s keys (default
        ``round``, the rounds done), then ``eval_fn``'s (as Python floats).
      outputs: the step's per-round outputs as host arrays, each leaf with a
        leading round axis ``[num_rounds, ...]`` (``None`` if the step returns none).
      wall_s: seconds spent in the rounds, host inputs and compilation included,
        evaluation and ``summary`` excluded.
      first_call_s: seconds of the first call (compilation plus its rounds).
    """

    history: list
    outputs: Any
    wall_s: float
    first_call_s: float


def _concat(chunks: list, scanned: bool):
    """Host arrays ``[num_rounds, ...]`` of the per-call outputs (stacked, or concatenated if scanned)."""
    if not chunks or jax.tree.leaves(chunks[0]) == []:
        return None
    host = jax.device_get(chunks)
    join = np.concatenate if scanned else np.stack
    return jax.tree.map(lambda *xs: join([np.asarray(x) for x in xs]), *host)


def simulate(
    step: Callable,
    state: Any,
    num_rounds: int,
    *,
    rounds_per_call: int = 1,
    inputs: Callable[[int], Any] | None = None,
    summary: Callable[[int, Any], dict] | None = None,
    eval_fn: Callable[[Any], dict] | None = None,
    eval_every: int = 0,
    on_eval: Callable[[dict], None] | None = None,
    progress: bool = False,
    desc: str = "simulate",
    unit: str = "round",
) -> tuple:
    """Run ``num_rounds`` rounds of ``step`` from ``state``; returns ``(state, SimulationResult)``.

    Long because the checks, the compiled chunk of rounds and the evaluation loop share one progress bar and
    history; the loop is short.

    Args:
      step: one round of every worker, ``(state, t) -> (state, outputs)`` or, with
        ``inputs``, ``(state, t, inputs(t)) -> (state, outputs)``; ``t`` is the
        round index (traced ``int32[]``), ``outputs`` any pytree of arrays (e.g.
        per-worker losses ``float32[P]``). jit-compiled here, once.
      state: the initial state (any pytree; typically leaves ``[P, ...]``).
      num_rounds: ``T >= 1``; must be a multiple of ``rounds_per_call``.
      rounds_per_call: rounds per compiled call (a ``lax.scan``; ``> 1`` only
        without ``inputs``). The progress bar, evaluations and ``summary``
        count calls.
      inputs: host function ``t -> pytree`` giving round ``t``'s inputs (e.g. the
        next batch of every worker, ``[P, b, ...]``).
      summary: ``(calls_done, outputs_of_that_call) -> dict``, the entry's own
        keys (with ``rounds_per_call > 1`` the outputs have a leading axis of
        ``rounds_per_call`` rounds). Default: ``{"round": rounds done}``.
      eval_fn: ``state -> dict`` of floats, added to every history entry.
      eval_every: make a history entry every ``eval_every`` calls (0: only after
        the last call, which always makes one).
      on_eval: ``entry -> None``, called with every history entry as soon as it is made.
      progress: show a tqdm bar over calls (postfix: the last entry's values).
      desc, unit: the bar's label and the name of what it counts (one call).
    Raises:
      ValueError / TypeError: bad counts or non-callable hooks, naming the argument.
    """
    num_rounds = check_int(num_rounds, "num_rounds", 1)
    per_call = check_int(rounds_per_call, "rounds_per_call", 1)
    eval_every = check_int(eval_every, "eval_every", 0)
    if num_rounds % per_call:
        raise ValueError(f"num_rounds={num_rounds} is not a multiple of rounds_per_call={per_call}")
    for name, fn in (
        ("step", step),
        ("inputs", inputs),
        ("summary", summary),
        ("eval_fn", eval_fn),
        ("on_eval", on_eval),
    ):
        if fn is not None and not callable(fn):
            raise TypeError(f"{name} must be callable{'' if name == 'step' else ' or None'}; got {type(fn).__name__}")
    if inputs is not None and per_call > 1:
        raise ValueError("inputs are fed once per call: use rounds_per_call=1 with inputs")
    if per_call == 1:
        call = jax.jit(step)
    else:

        def scanned(st, first):
            return jax.lax.scan(step, st, first + jnp.arange(per_call, dtype=jnp.int32))

        call = jax.jit(scanned)
    num_calls = num_rounds // per_call
    history, chunks = [], []
    wall, first_call_s = 0.0, 0.0
    bar = progress_bar(range(num_calls), desc=desc, unit=unit, disable=not progress)
    for c in bar:
        t0 = time.perf_counter()
        t = jnp.asarray(c * per_call, jnp.int32)
        args = (state, t) if inputs is None else (state, t, inputs(c))
        state, out = call(*args)
        chunks.append(out)
        entry_due = (eval_every and (c + 1) % eval_every == 0) or c + 1 == num_calls
        if c == 0 or entry_due:
            jax.block_until_ready(state)
        wall += time.perf_counter() - t0
        if c == 0:
            first_call_s = wall
        if entry_due:  # evaluation time is not counted in wall_s
            if summary is None:
                entry = {"round": (c + 1) * per_call}
            else:
                entry = dict(summary(c + 1, jax.device_get(out)))
            if eval_fn is not None:
                entry.update({k: float(v) for k, v in eval_fn(state).items()})
            history.append(entry)
            bar.set_postfix({k: round(v, 4) for k, v in entry.items() if isinstance(v, float)})
            if on_eval is not None:
                on_eval(entry)
    bar.close()
    return state, SimulationResult(history, _concat(chunks, per_call > 1), wall, first_call_s)
