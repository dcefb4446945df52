"""A watchdog for jitted MPI steps: a hung or stopped process ends the job, named.

The collectives of :class:`~jaxcomm.comm.MPIComm` are MPI calls compiled into
the XLA program, so a process whose peer never arrives blocks inside the
jitted step, in MPI, where no timeout can reach it. (A peer that *exits* or is
killed mid-step is not the problem: ``mpirun`` itself ends the job and
names it.) The watchdog works outside jit:

* **Progress.** :meth:`MPIWatchdog.watch` wraps the step function: the wrapper
  counts the call as *entered*, runs it, blocks until its outputs are ready and
  counts it as *left*. So each process knows ``(entered, left)`` and when its
  last transition happened.
* **Heartbeats.** A daemon thread sends that state to every other process every
  ``poll_s`` seconds with non-blocking point-to-point messages (``Isend`` /
  ``Irecv`` / ``Test``, never a collective, which would block on the hung
  process) on a private duplicate of the communicator, so they never match the
  step's own traffic. At most one heartbeat per peer is in flight.
* **Verdict.** When this process has waited longer than ``timeout_s`` -- inside
  a step (``entered > left``) or in :meth:`MPIWatchdog.close` -- the thread names
  the culprits: peers whose heartbeat is older than ``timeout_s`` (*dead or
  stopped*), and peers whose heartbeat is fresh but which have entered fewer
  steps than the most advanced process and made no progress for ``timeout_s``
  (*hung*: alive, their application stuck before or inside an earlier step). When
  some processes are closing and others wait in a step, the culprits are
  instead the processes whose step count differs from the most common one
  (*call-count mismatch*). With at least one culprit it prints one line on
  stderr and calls ``MPI_Abort`` with :data:`WATCHDOG_ABORT_CODE`; without one
  (every process is in the same step and alive: a long step) it keeps waiting,
  so a slow process is never named.
* **Close.** :meth:`MPIWatchdog.close` (the end of the ``with`` block) gathers
  every process's step count with a non-blocking allgather under the same
  timeout; different counts raise :class:`MPIWatchdogError` naming the ranks
  whose count differs from the most common one. An exception leaving the
  ``with`` block on one process (which would leave the others blocked in the
  step and this one blocked in ``MPI_Finalize``) is printed and aborts the job.

This module imports only NumPy and mpi4py (JAX only inside :meth:`watch`'s
wrapper, to wait for the outputs).
"""

from __future__ import annotations

import functools
import sys
import threading
import time
from typing import Any

import numpy as np

from .._validate import check_bool
from ._partial_mpi import _import_mpi, _odd_ones

__all__ = ["MPIWatchdog", "MPIWatchdogError", "WATCHDOG_ABORT_CODE"]

WATCHDOG_ABORT_CODE = 75
"""The ``MPI_Abort`` error code of a watchdog verdict (``mpirun`` exits non-zero)."""

_TAG_BEAT = 21
# Heartbeat: int64 [rank, entered, left, ms since the last transition, closing].
_B_RANK, _B_ENTERED, _B_LEFT, _B_IDLE_MS, _B_CLOSING = range(5)
_B_LEN = 5


class MPIWatchdogError(RuntimeError):
    """Processes disagree on the number of steps (raised by :meth:`MPIWatchdog.close`)."""


class MPIWatchdog:
    """End an MPI job whose step is blocked by a hung or stopped process, naming it.

    Collective: every process constructs it (with the same ``timeout_s``) and
    wraps the same step with :meth:`watch`; see the module docstring for the
    protocol.

    Args:
      timeout_s: seconds a process may wait -- in a step, or at close -- before
        the processes that hold it up are named and the job is aborted. It must
        exceed the longest legitimate lag: one step's time plus the largest gap
        between steps on any process (data loading, logging, checkpoints) and,
        for the first step, tracing and compilation.
      comm: an ``mpi4py.MPI.Comm`` or an object with a ``comm`` attribute (an
        :class:`~jaxcomm.comm.MPIComm`); default ``MPI.COMM_WORLD``. The
        watchdog uses a private duplicate of it.
      poll_s: seconds between heartbeats (default ``min(0.25, timeout_s / 8)``).
      abort_on_fault: when an exception (or :class:`MPIWatchdogError`) leaves
        the ``with`` block, print it on stderr and ``MPI_Abort`` the job
        (default ``True``; a single process never aborts).

    Example (``mpirun -n 4 python train.py``)::

        comm = MPIComm()
        step = jax.jit(train_step)  # uses comm's collectives
        with comm.watchdog(timeout_s=60.0) as wd:
            step = wd.watch(step)
            for batch in batches:
                params, state = step(params, state, batch)
    """

    def __init__(self, timeout_s: float, comm: Any = None, *, poll_s: float | None = None, abort_on_fault: bool = True):
        if isinstance(timeout_s, bool) or not isinstance(timeout_s, (int, float)) or not 0 < timeout_s < float("inf"):
            raise ValueError(f"timeout_s must be a positive finite number of seconds; got {timeout_s!r}")
        if poll_s is None:
            poll_s = min(0.25, timeout_s / 8)
        if isinstance(poll_s, bool) or not isinstance(poll_s, (int, float)) or not 0 < poll_s <= timeout_s:
            raise ValueError(f"poll_s must be in (0, timeout_s]; got {poll_s!r}")
        abort_on_fault = check_bool(abort_on_fault, "abort_on_fault")
        MPI = _import_mpi()
        if comm is None:
            comm = MPI.COMM_WORLD
        comm = getattr(comm, "comm", comm)
        if not isinstance(comm, MPI.Comm):
            raise TypeError(f"comm must be an mpi4py.MPI.Comm or an MPIComm; got {type(comm).__name__}")
        self.timeout_s = float(timeout_s)
        self.poll_s = float(poll_s)
        self.abort_on_fault = abort_on_fault
        self._MPI = MPI
        self._parent = comm
        self.rank = int(comm.Get_rank())
        self.size = int(comm.Get_size())
        self._comm = comm.Dup()  # collective: every process is here
        now = time.monotonic()
        # This process's state; written by the application thread, read by the watchdog thread.
        self._entered = 0
        self._left = 0
        self._changed = now  # time of the last transition (enter, leave or close)
        self._closing = False
        self._closed = False
        # Peers' last heartbeat and when it arrived.
        self._peers = [q for q in range(self.size) if q != self.rank]
        self._state = {q: np.zeros(_B_LEN, np.int64) for q in self._peers}
        self._heard = dict.fromkeys(self._peers, now)
        self._stop = threading.Event()
        self._thread = None
        # One pending receive per peer (its newest heartbeat lands in its buffer) and at most
        # one heartbeat in flight to each peer; only the watchdog thread touches them after this.
        self._bufs = {q: np.zeros(_B_LEN, np.int64) for q in self._peers}
        self._recvs = {q: self._comm.Irecv(self._bufs[q], source=q, tag=_TAG_BEAT) for q in self._peers}
        self._sends: dict[int, tuple] = {}
        if self.size > 1:
            self._thread = threading.Thread(target=self._run, name=f"jaxcomm-watchdog-{self.rank}", daemon=True)
            self._thread.start()

    def __repr__(self):
        return f"MPIWatchdog(rank={self.rank}, size={self.size}, timeout_s={self.timeout_s:g}, steps={self._entered})"

    @property
    def steps(self) -> int:
        """Number of steps this process has entered."""
        return self._entered

    # -- application side ---------------------------------------------------- #
    def watch(self, fn):
        """Wrap ``fn`` (the jitted step): count the call, run it, wait for its outputs.

        The wrapper returns ``fn``'s outputs after ``jax.block_until_ready``, so
        a step is *left* only when its collectives have finished on this process.
        """
        if not callable(fn):
            raise TypeError(f"fn must be callable; got {type(fn).__name__}")
        import jax

        @functools.wraps(fn)
        def step(*args, **kwargs):
            self._enter()
            out = jax.block_until_ready(fn(*args, **kwargs))
            self._leave()
            return out

        return step

    def _enter(self):
        if self._closed or self._closing:
            raise MPIWatchdogError(f"rank {self.rank}: the watchdog is closed")
        self._entered += 1
        self._changed = time.monotonic()

    def _leave(self):
        self._left = self._entered
        self._changed = time.monotonic()

    def close(self) -> None:
        """Stop the watchdog and check that every process made the same number of steps.

        Collective, bounded by ``timeout_s`` (a process that never closes is
        named by the watchdog thread, which aborts the job). Raises
        :class:`MPIWatchdogError` naming the ranks whose step count differs from
        the most common one.
        """
        if self._closed:
            return
        self._changed = time.monotonic()
        self._closing = True
        counts = np.zeros(self.size, np.int64)
        if self.size > 1:
            # The watchdog thread keeps beating (and judging) while we wait here.
            gather = self._comm.Iallgather(np.array([self._entered], np.int64), counts)
            backstop = time.monotonic() + self.timeout_s + 4 * self.poll_s + 30.0
            delay = 1e-5
            while not gather.Test():
                if time.monotonic() > backstop:  # pragma: no cover - the thread aborts first
                    raise MPIWatchdogError(f"rank {self.rank}: not every process closed the watchdog")
                time.sleep(delay)
                delay = min(self.poll_s, delay * 2)
        self._shutdown()
        self._closed = True
        per_rank = dict(enumerate(counts.tolist())) if self.size > 1 else {0: self._entered}
        if len(set(per_rank.values())) > 1:
            raise MPIWatchdogError(
                f"rank {self.rank}: call-count mismatch, ranks {_odd_ones(per_rank)} made a different number of "
                f"steps than the others (steps per rank {per_rank}); every process must call the step the same "
                "number of times"
            )

    def __enter__(self):
        return self

    def __exit__(self, exc_type, exc, tb):
        if exc_type is None:
            try:
                self.close()
            except MPIWatchdogError as e:
                self._fault_exit(e)
                raise
        else:
            self._closing = True
            self._stop.set()
            if self._thread is not None:
                self._thread.join(self.poll_s * 4 + 1.0)
            self._closed = True
            self._fault_exit(exc)
        return False

    def _fault_exit(self, err: BaseException) -> None:
        if not self.abort_on_fault or self.size == 1:
            return
        sys.stderr.write(
            f"jaxcomm: rank {self.rank}: {type(err).__name__} left the MPI watchdog block: {err}; aborting the job\n"
        )
        sys.stderr.flush()
        self._parent.Abort(WATCHDOG_ABORT_CODE)

    # -- watchdog thread ----------------------------------------------------- #
    def _beat(self) -> np.ndarray:
        idle_ms = int(1e3 * (time.monotonic() - self._changed))
        return np.array([self.rank, self._entered, self._left, idle_ms, int(self._closing)], np.int64)

    def _run(self):
        comm = self._comm
        bufs, recvs, sends = self._bufs, self._recvs, self._sends
        next_beat = 0.0
        while not self._stop.is_set():
            now = time.monotonic()
            if now >= next_beat:
                msg = self._beat()
                for q in self._peers:
                    if q in sends and not sends[q][0].Test():
                        continue  # the previous heartbeat has not left yet (a stopped peer)
                    sends[q] = (comm.Isend(msg, dest=q, tag=_TAG_BEAT), msg)
                next_beat = now + self.poll_s
            for q in self._peers:
                while recvs[q].Test():  # drain: keep the newest heartbeat
                    self._state[q] = bufs[q].copy()
                    self._heard[q] = time.monotonic()
                    recvs[q] = comm.Irecv(bufs[q], source=q, tag=_TAG_BEAT)
            verdict = self._judge(time.monotonic())
            if verdict is not None:
                sys.stderr.write(f"jaxcomm: rank {self.rank}: MPI watchdog: {verdict}; aborting the job\n")
                sys.stderr.flush()
                self._parent.Abort(WATCHDOG_ABORT_CODE)
                return  # pragma: no cover - Abort does not return
            self._stop.wait(min(self.poll_s, 0.05))

    def _judge(self, now: float) -> str | None:
        """The verdict line if this process has waited too long and someone is to blame, else ``None``.

        Only processes that can be holding this one up are named: in step ``k``,
        those that have not entered it; at close, those that have not closed.
        Among them: no heartbeat for ``timeout_s`` (dead or stopped); closed with
        fewer steps than this process's, or still stepping past this process's
        count at close (call-count mismatch: the ranks whose count differs from
        the most common one); alive but without progress for ``timeout_s``, and
        not themselves waiting inside a step for someone further behind (hung).
        """
        waiting_in_step = self._entered > self._left
        if not (waiting_in_step or self._closing) or now - self._changed <= self.timeout_s:
            return None
        mine = self._entered
        states = {q: self._state[q] for q in self._peers}
        stale = {q: now - self._heard[q] for q in self._peers if now - self._heard[q] > self.timeout_s}
        fresh = {q: st for q, st in states.items() if q not in stale}
        if self._closing:  # held up by whoever has not closed
            blockers = {q: st for q, st in fresh.items() if not st[_B_CLOSING]}
            mismatched = [q for q, st in blockers.items() if st[_B_ENTERED] > mine]
            behind = {q: st for q, st in blockers.items() if st[_B_ENTERED] <= mine}
            where = f"close (after {mine} steps)"
        else:  # held up by whoever has not entered this step
            blockers = {q: st for q, st in fresh.items() if st[_B_ENTERED] < mine}
            mismatched = [q for q, st in blockers.items() if st[_B_CLOSING]]
            behind = {q: st for q, st in blockers.items() if not st[_B_CLOSING]}
            where = f"step {mine - 1}"
        if not self._closing:  # a peer already past this step is not holding it up
            stale = {q: a for q, a in stale.items() if states[q][_B_ENTERED] <= mine}
        parts = [f"rank {self.rank} waited {now - self._changed:.1f} s in {where}"]
        culprits = set(stale)
        if stale:
            ages = {q: round(a, 1) for q, a in sorted(stale.items())}
            parts.append(f"ranks {sorted(stale)} sent no heartbeat for {ages} s (dead or stopped)")
        if mismatched:
            counts = {q: int(st[_B_ENTERED]) for q, st in fresh.items()}
            counts[self.rank] = mine
            odd = _odd_ones(counts)
            culprits.update(odd)
            parts.append(
                f"call-count mismatch: steps per rank {dict(sorted(counts.items()))}, closing ranks "
                f"{sorted([q for q, st in fresh.items() if st[_B_CLOSING]] + ([self.rank] if self._closing else []))}; "
                f"ranks {odd} differ from the most common count"
            )
        else:
            lowest = min(int(st[_B_ENTERED]) for st in states.values())
            for q, st in sorted(behind.items()):
                idle = st[_B_IDLE_MS] / 1e3 + (now - self._heard[q])
                inside = st[_B_ENTERED] > st[_B_LEFT]
                if idle <= self.timeout_s or (inside and st[_B_ENTERED] > lowest):
                    continue  # progressing, or itself waiting for someone further behind
                culprits.add(q)
                at = f"stuck inside step {st[_B_ENTERED] - 1}" if inside else f"not entered step {st[_B_ENTERED]}"
                parts.append(f"rank {q} is alive but its application has {at} for {idle:.1f} s (hung)")
        if not culprits:
            return None
        return f"culprit ranks {sorted(culprits)}: " + "; ".join(parts)

    def _shutdown(self):
        """After the close gather: stop beating, meet everyone, retire leftover heartbeats, free."""
        MPI = self._MPI
        self._stop.set()
        if self._thread is not None:
            self._thread.join(self.timeout_s + 30.0)
        sends = self._sends
        deadline = time.monotonic() + self.timeout_s
        while any(not req.Test() for req, _ in sends.values()) and time.monotonic() < deadline:
            time.sleep(1e-4)
        # Every process has stopped sending once this barrier completes.
        barrier = self._comm.Ibarrier()
        while not barrier.Test():
            if time.monotonic() > deadline:  # pragma: no cover - every process got past the gather
                raise MPIWatchdogError(f"rank {self.rank}: not every process stopped its watchdog")
            time.sleep(1e-4)
        for q, req in self._recvs.items():
            while req.Test():  # heartbeats already delivered
                req = self._comm.Irecv(self._bufs[q], source=q, tag=_TAG_BEAT)
            req.Cancel()
            req.Wait()
        status = MPI.Status()
        scratch = np.zeros(_B_LEN, np.int64)
        while self._comm.Iprobe(source=MPI.ANY_SOURCE, tag=_TAG_BEAT, status=status):
            self._comm.Recv(scratch, source=status.Get_source(), tag=_TAG_BEAT)
        self._comm.Free()
