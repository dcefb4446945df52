"""The data-parallel trainer: model + transform chain + mesh (or MPI) + data.

``Trainer`` composes a Flax NNX model, any optax chain (with jaxcomm's
communicating transforms inside) and a launcher: a device mesh on one host,
several hosts under ``jax.distributed`` (the mesh spans every process's
devices), or one worker per MPI process. Its ``fit`` loop shows a progress bar,
evaluates, records per-step metrics (loss, accuracy, wire bits sent per worker,
messages, step time), checkpoints with orbax and resumes bit-identically.
"""

from __future__ import annotations

import contextlib
import dataclasses
import math
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
import optax
from flax import nnx
from jax.sharding import Mesh, NamedSharding
from jax.sharding import PartitionSpec as P

from .._progress import progress_bar
from ..comm._protocol import require_host
from ._checkpoint import Checkpointer, check_accept_changes, check_metadata
from ._describe import describe
from ._mesh import make_mesh
from ._nnx import TASK_LOSSES, PureModel, classification_eval, evaluate_classifier, split_model
from ._step import TrainState, init_train_state, make_train_step

__all__ = ["Trainer", "NonFiniteLossError", "to_workers"]


class NonFiniteLossError(FloatingPointError):
    """The loss became NaN or Inf; training stopped and the last good checkpoint was kept."""


def to_workers(tree, mesh, spec: P | None = None) -> Any:
    """Place host arrays with a leading worker axis onto ``mesh`` (split over its axis).

    ``spec=P()`` instead places one replicated copy (no worker axis) on every device.
    Works on one process and under ``jax.distributed`` (each process supplies the
    rows of its own devices from the full host array).
    """
    sharding = NamedSharding(mesh, P(mesh.axis_names[0]) if spec is None else spec)

    def put(x):
        x = np.asarray(x) if not isinstance(x, jax.Array) else x
        if jax.process_count() == 1:
            return jax.device_put(x, sharding)
        host = np.asarray(x)
        return jax.make_array_from_callback(host.shape, sharding, lambda idx: host[idx])

    return jax.tree.map(put, tree)


def _to_host(x) -> np.ndarray:
    """A (possibly multi-process) array as a host array, gathering across processes if needed."""
    if isinstance(x, jax.Array) and not x.is_fully_addressable:
        from jax.experimental import multihost_utils

        return np.asarray(multihost_utils.process_allgather(x, tiled=True))
    return np.asarray(x)


def _first_worker(x):
    """Worker 0's (or this process's first worker's) slice, as a host array."""
    if isinstance(x, jax.Array) and not x.is_fully_addressable:
        return np.asarray(x.addressable_shards[0].data)[0]
    return np.asarray(x)[0]


@dataclasses.dataclass
class Trainer:
    """Data-parallel training of an NNX model with any optax chain.

    Args:
      model: a Flax NNX module (all workers start from its parameters).
      tx: optax transformation; communicating transforms built without
        ``axis_name``/``comm`` use the trainer's communicator.
      task: ``"classification"`` (batch ``{"x", "y"}``) or ``"language_model"``,
        or a custom loss ``(params, model_state, batch, key) -> (loss, (state, metrics))``.
      num_workers: mesh size (default: every device); ignored with ``comm``.
      comm: a communicator for one worker per process (e.g. ``MPIComm()``, or
        ``Local()`` for one process alone): it must have the protocol's
        host-side members (:func:`~jaxcomm.comm._protocol.require_host`: ``rank``,
        ``agree_min`` for the checkpoint step every process resumes from, and
        ``watchdog`` or ``watchdog = None``), else ``TypeError``.
      seed: seeds the per-worker PRNG keys (dropout, stochastic compressors).
      replicated_params: on a mesh, keep one replicated copy of the parameters
        (spec ``P()``, no worker axis) instead of one per worker. ``jax.grad`` of
        replicated parameters inside ``shard_map`` returns the gradient already
        *summed* over the workers (a dense allreduce): right for a plain optax
        optimizer (scale its learning rate by ``1 / num_workers`` for the mean),
        refused by jaxcomm's communicating transforms (``ValueError``: "is not
        device-varying"), whose compression it would bypass. Every worker must
        then apply the same update; the step's type check (``check_vma``) enforces it.
      gather_metrics: with ``comm``, gather every worker's metrics at every step
        (default; two small collectives that make every process wait for the
        slowest at every step). ``False``: each process's history holds its own
        worker's loss, ``wire_bits_total`` and ``messages``, and steps whose
        optimizer sends nothing (local SGD's, DiLoCo's inner steps) run without a
        collective (:func:`make_train_step`). Ignored on a mesh, whose metrics cost
        no collective.
    """

    model: nnx.Module
    tx: optax.GradientTransformation
    task: Any = "classification"
    num_workers: int | None = None
    comm: Any = None
    seed: int = 0
    replicated_params: bool = False
    gather_metrics: bool = True

    def __post_init__(self):
        from .._validate import check_bool, check_seed

        self.seed = int(check_seed(self.seed))
        self.gather_metrics = check_bool(self.gather_metrics, "gather_metrics")  # on a mesh too, where unused
        if not (callable(getattr(self.tx, "init", None)) and callable(getattr(self.tx, "update", None))):
            raise TypeError(
                f"tx must be an optax GradientTransformation (e.g. optax.sgd(0.1)); got {type(self.tx).__name__}"
            )
        self.pure: PureModel = split_model(self.model)
        if callable(self.task):
            self.loss_fn = self.task
        elif isinstance(self.task, str) and self.task in TASK_LOSSES:
            self.loss_fn = TASK_LOSSES[self.task](self.pure)
        else:
            named = ", ".join(map(repr, TASK_LOSSES))
            raise ValueError(f"task must be {named} or a loss function; got {self.task!r}")
        self.mesh: Mesh | None = None
        if self.comm is None:
            mesh = self.mesh = make_mesh(self.num_workers)
            self.num_workers = mesh.shape[mesh.axis_names[0]]
            axis = P(mesh.axis_names[0])
            self.state_specs = TrainState(axis, P() if self.replicated_params else axis, axis, axis, axis)
            self.step_fn = make_train_step(self.loss_fn, self.tx, mesh=self.mesh, state_specs=self.state_specs)
        else:
            if self.replicated_params:
                raise ValueError(
                    "replicated_params applies to a device mesh; with comm=... every process holds its own copy already"
                )
            require_host(self.comm, for_what="Trainer(comm=...)")
            self.num_workers = int(self.comm.size)
            self.step_fn = make_train_step(self.loss_fn, self.tx, comm=self.comm, gather_metrics=self.gather_metrics)
        self._eval_fn = classification_eval(self.pure)

    # ------------------------------------------------------------------ state
    def init_state(self) -> TrainState:
        """Initial state: identical parameters on every worker, distinct worker keys."""
        n = int(self.num_workers or 1)  # set in __post_init__
        keys = jax.random.split(jax.random.PRNGKey(self.seed), n)
        if self.mesh is None:
            rank = int(self.comm.rank)
            # Copies: the step donates its state, and the model's own arrays must outlive it
            # (a second init_state, evaluation of the initial model).
            params, model_state = jax.tree.map(jnp.copy, (self.pure.params, self.pure.model_state))
            return init_train_state(params, model_state, self.tx, keys[rank])

        def one(key):
            return init_train_state(self.pure.params, self.pure.model_state, self.tx, key)

        host = jax.tree.map(np.asarray, jax.vmap(one)(keys))
        if not self.replicated_params:
            return to_workers(host, self.mesh)
        params = to_workers(jax.tree.map(lambda x: x[0], host.params), self.mesh, P())
        return to_workers(host._replace(params=None), self.mesh)._replace(params=params)

    def worker_batch(self, batch):
        """Device placement of one global batch ``(num_workers, per_worker, ...)``."""
        if self.mesh is None:
            rank = int(self.comm.rank)
            return jax.tree.map(lambda x: jnp.asarray(np.asarray(x)[rank]), batch)
        return to_workers(batch, self.mesh)

    def params_of(self, state: TrainState, average: bool = False):
        """Worker 0's parameters (data-parallel replicas are identical), or the workers' mean."""
        if self.mesh is None:
            return state.params
        if self.replicated_params:
            return jax.tree.map(_to_host, state.params)
        if average:
            return jax.tree.map(lambda x: np.asarray(x).mean(0), state.params)
        return jax.tree.map(_first_worker, state.params)

    # ------------------------------------------------------------- evaluation
    def evaluate(self, state: TrainState, x, y, batch_size: int = 1000, average: bool = False) -> dict:
        """Mean loss and accuracy of (worker 0's or the averaged) model on ``(x, y)``.

        For language models ``y`` is ``[N, T]`` token targets and ``perplexity`` is added.
        """
        params = self.params_of(state, average)
        model_state = state.model_state if self.mesh is None else jax.tree.map(_first_worker, state.model_state)
        out = evaluate_classifier(self._eval_fn, params, model_state, x, y, batch_size)
        if self.task != "language_model":
            out.pop("perplexity")
        return out

    # ------------------------------------------------------------------- loop
    def fit(
        self,
        state: TrainState,
        batches,
        num_steps: int,
        *,
        eval_fn: Callable[[TrainState], dict] | None = None,
        eval_every: int = 0,
        checkpoint_dir: str | Path | None = None,
        checkpoint_every: int = 0,
        metadata: dict | None = None,
        resume: bool = True,
        progress: bool = True,
        desc: str = "train",
        callback: Callable[[int, TrainState, dict], TrainState] | None = None,
        watchdog_s: float | None = None,
        accept_changes=(),
        stop: Callable[[int, dict], bool] | None = None,
    ):
        """Train until ``state.step == num_steps`` or ``stop`` says so; returns ``(state, history)``.

        Long because checkpoints, evaluation, the watchdog and the stop rule all act on the one loop's state
        between steps; the arguments are checked first.

        Args:
          batches: a :class:`jaxcomm.data.WorkerBatches` (or any iterator of global
            batches with a ``position``/``seek`` for resumption).
          eval_fn: ``state -> dict`` run every ``eval_every`` steps and at the end.
          checkpoint_dir: if given, save every ``checkpoint_every`` steps (an int
            ``>= 0``; 0: only at the end) and at the end through one
            :class:`Checkpointer` (asynchronous saves, all on disk when ``fit``
            returns or raises); with ``resume`` the latest complete checkpoint is
            restored first. Its record (step, data position, ``metadata``), the
            run's description (:meth:`describe_run`: the transformation chain with
            its compressor, memory, strategy, optimizer and hyper-parameters, and
            the task), its structure, dtypes and array digests must match, else
            ``CheckpointError`` naming what differs. With ``comm``
            (one process per worker) each process keeps its own folder
            ``checkpoint_dir/rank_NNNNN`` and all resume from the newest step every
            process has completed.
          metadata: a JSON-serialisable dict describing the run (refused up front
            otherwise), saved with every checkpoint and compared on resume.
          accept_changes: names from :data:`~jaxcomm.train._checkpoint.ACCEPTABLE_CHANGES`
            (``"position"``, ``"metadata"``, ``"transform"``) whose differences from
            the checkpoint are accepted on purpose when resuming, e.g.
            ``("transform",)`` to go on with another learning rate; each accepted
            difference is reported by a ``UserWarning``.
          callback: ``(step, state, row) -> state`` after each step (e.g. periodic
            parameter averaging).
          stop: ``(step, row) -> bool``, called after every step once that step
            is complete -- after ``callback``, the evaluation due at it, its
            history row and the checkpoint due at it -- with the step count
            ``state.step`` and that row. ``True`` ends ``fit`` there as
            ``num_steps`` would: a checkpoint is saved at that step (if
            ``checkpoint_dir`` and none was due) and ``(state, history)`` is
            returned, so a later ``fit`` resumes bit-identically. It must return
            a ``bool`` (``TypeError`` otherwise). With ``comm``, every process
            must decide alike (from values equal on every process: the step, or
            an agreed value), or their step counts differ.
          watchdog_s: with an ``MPIComm`` (one process per worker), run the steps
            under its :class:`~jaxcomm.comm.MPIWatchdog` with this timeout in
            seconds: a process that holds up a step for longer (hung or stopped)
            ends the job, named, and processes that make different numbers of
            steps get an error. It must exceed a step's time plus the longest
            gap between steps (evaluation, checkpoints) and the first step's
            compilation. An exception leaving ``fit`` on one process (e.g.
            :class:`NonFiniteLossError`) then aborts the job, since the others
            would wait in the step forever. The communicator must serve a
            watchdog (``comm.watchdog`` is not ``None``), else ``ValueError``
            naming ``watchdog_s``. Default ``None``: no watchdog.
        Returns:
          ``(state, history)``: history is a list of per-step dicts with ``step``,
          ``loss``, metrics averaged over workers, ``wire_bits_total`` (``int``:
          the bits all workers handed to collectives in this step, the exact sum
          over workers, ``Σ_i Σ_tensors wire_bits_i``; one worker's share is
          ``wire_bits_total / num_workers`` when every worker sends alike, as
          fixed-size payloads do, while count-prefixed payloads may differ),
          ``messages`` (``int``: arrays handed to collectives in this step,
          summed over all workers), ``step_time`` (s) and eval results. With
          ``comm`` and ``gather_metrics=False``, ``loss``, the metrics,
          ``wire_bits_total`` and ``messages`` are this process's worker's only.
        Raises:
          NonFiniteLossError: NaN/Inf loss; the last good checkpoint stays on disk.
        """
        for name, value in (("checkpoint_every", checkpoint_every), ("eval_every", eval_every)):
            if isinstance(value, bool) or not isinstance(value, (int, np.integer)) or value < 0:
                raise ValueError(f"{name} must be an int >= 0 (0: only at the end); got {value!r}")
        check_metadata(metadata)
        accept_changes = check_accept_changes(accept_changes)
        if stop is not None and not callable(stop):
            raise TypeError(f"stop must be a callable (step, row) -> bool; got {type(stop).__name__}")
        if watchdog_s is not None and (self.comm is None or self.comm.watchdog is None):
            raise ValueError(
                f"watchdog_s needs a communicator that serves a watchdog (e.g. MPIComm); comm={self.comm!r} "
                "declares none"
            )
        run = self.describe_run() if checkpoint_dir is not None else None
        if checkpoint_dir is not None and self.comm is not None and (self.num_workers or 1) > 1:
            # One process per worker: each keeps its own state (memories, keys) in its own folder.
            checkpoint_dir = Path(checkpoint_dir) / f"rank_{int(self.comm.rank):05d}"
        ckpt = Checkpointer(checkpoint_dir) if checkpoint_dir is not None else None  # one manager for the run
        with contextlib.ExitStack() as stack:
            if ckpt is not None:
                stack.enter_context(ckpt)  # close() waits for the last save
            history: list[dict] = []
            step = self._agreed_step(ckpt.latest_step()) if ckpt is not None and resume else None
            if ckpt is not None and step is not None:
                state, position, _ = ckpt.restore(
                    state, step=step, metadata=metadata, run=run, accept_changes=accept_changes
                )
                if position is not None and hasattr(batches, "seek"):
                    batches.seek(position)
            start = int(_first_worker(state.step)) if self.mesh is not None else int(state.step)
            step_fn = self.step_fn
            if watchdog_s is not None:  # after the restore; closed (step counts checked) before the checkpointer
                step_fn = stack.enter_context(self.comm.watchdog(watchdog_s)).watch(step_fn)
            bar = progress_bar(total=num_steps, initial=start, desc=desc, disable=not progress)
            for step in range(start, num_steps):
                batch = self.worker_batch(next(batches))
                t0 = time.perf_counter()
                state, metrics = step_fn(state, batch)
                metrics = jax.tree.map(_to_host, metrics)
                elapsed = time.perf_counter() - t0
                row = {"step": step + 1, "step_time": elapsed}
                for k, v in metrics.items():
                    if k == "wire_bits":  # BitCount per tensor [workers, tensors]: one exact int64 sum
                        row["wire_bits_total"] = int(np.asarray(v, np.int64).sum())
                    elif k == "messages":  # per worker on a mesh, the workers' total with comm: counts
                        row[k] = int(np.rint(np.asarray(v, np.float64).sum()))
                    else:
                        row[k] = float(np.asarray(v, np.float64).mean())
                if not math.isfinite(row["loss"]):
                    bar.close()
                    where = f"; the last good checkpoint is in {checkpoint_dir}" if checkpoint_dir else ""
                    raise NonFiniteLossError(f"loss became {row['loss']} at step {step + 1}{where}")
                if callback is not None:
                    state = callback(step + 1, state, row)
                if eval_fn is not None and ((eval_every and (step + 1) % eval_every == 0) or step + 1 == num_steps):
                    row.update({f"eval_{k}": v for k, v in eval_fn(state).items()})
                history.append(row)
                bar.update(1)
                bar.set_postfix(loss=f"{row['loss']:.4f}")
                due = (checkpoint_every and (step + 1) % checkpoint_every == 0) or step + 1 == num_steps
                if ckpt is not None and due:
                    ckpt.save(step + 1, state, position=getattr(batches, "position", None), metadata=metadata, run=run)
                if stop is not None:
                    verdict = stop(step + 1, row)
                    if not isinstance(verdict, (bool, np.bool_)):
                        raise TypeError(f"stop must return a bool; it returned {verdict!r} at step {step + 1}")
                    if verdict:
                        if ckpt is not None and not due:
                            position = getattr(batches, "position", None)
                            ckpt.save(step + 1, state, position=position, metadata=metadata, run=run)
                        break
            bar.close()
            return state, history

    def describe_run(self) -> dict[str, str]:
        """What a checkpoint records of this trainer's computation, ``{path: text}``
        (:func:`~jaxcomm.train._describe.describe` of ``tx`` and ``task``).

        Covered: the transformation chain's structure and every value its functions
        captured (compressor name and hyper-parameters, memory, strategy, warm-up
        stages, the optimizer's learning rate, momentum and schedules) and the task
        (its name, or the loss function's name and captures). Not covered: the
        model (its parameters' names, shapes and dtypes are checked with the
        state), function bodies, and globals a function reads.
        """
        task = {"task": repr(self.task)} if isinstance(self.task, str) else describe(self.task, "task")
        return {**describe(self.tx, "tx"), **task}

    def _agreed_step(self, latest: int | None) -> int | None:
        """The step every process resumes from: the smallest of their latest complete checkpoints
        (``None``, a fresh start, if one has none; ``comm.agree_min``), so processes never resume at
        different steps."""
        if self.comm is None:
            return latest
        agreed = self.comm.agree_min(-1 if latest is None else int(latest))
        return None if agreed < 0 else agreed
