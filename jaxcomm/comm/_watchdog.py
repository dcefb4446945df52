"""A watchdog for jitted MPI steps: a hung or stopped process is named, and the job ends or the caller decides.

The collectives of :class:`~jaxcomm.comm.MPIComm` are MPI calls compiled into
the XLA program, so a process whose peer never arrives blocks inside the
jitted step, in MPI, where no timeout can reach it. (A peer that *exits* or is
killed mid-step is not the problem: ``mpirun`` itself ends the job and
names it.) The watchdog works outside jit:

* **Progress.** :meth:`MPIWatchdog.watch` wraps the step function: the wrapper
  counts the call as *entered*, runs it, blocks until its outputs are ready and
  counts it as *left*. So each process knows what it has *reached*: ``entered``
  and ``left`` step counts, its phase (between steps, inside step
  ``entered - 1``, or closing) and when its last transition happened.
* **Heartbeats.** A daemon thread sends that state to every other process every
  ``poll_s`` seconds with non-blocking point-to-point messages (``Isend`` /
  ``Irecv`` / ``Test``, never a collective, which would block on the hung
  process) on a private duplicate of the communicator, so they never match the
  step's own traffic. At most one heartbeat per peer is in flight.
* **Verdict.** When this process has waited longer than ``timeout_s`` -- inside
  step ``k`` (``entered > left``) or in :meth:`MPIWatchdog.close` -- the thread
  names the processes that hold it up, judged first by what each has reached
  and only then by the age of its heartbeat:

  1. *Call-count mismatch.* Some processes are closing while others wait in a
     step: the culprits are the ranks whose step count differs from the most
     common one, among the counts whose side is known: a closing process's
     count is final, a stepping process's only a lower bound (its heartbeat
     may predate its last steps), so it votes only if that bound already puts
     it beyond the closers.
  2. *Behind.* Otherwise the *blockers* are the processes that have not reached
     where this one waits: in step ``k``, those that have not entered it; at
     close, those that have not closed. A blocker whose heartbeats still arrive
     (the last one is at most ``timeout_s`` old) is named *hung* when it has
     itself reported no progress for ``timeout_s`` (the idle time in its
     heartbeat; a late heartbeat is not read as idleness) and is not itself
     waiting inside an earlier step for a process further behind. While such a blocker still progresses, nobody is
     named. A process that has reached this step is never named while another
     is identifiably behind, however late its heartbeats: on a busy machine a
     healthy process's heartbeat thread can be held up for seconds (starved of
     CPU, the GIL held by a C call of the application, a paused process), and
     silence alone would then blame it.
  3. *Silence.* When no process is identifiably behind -- every process has
     reached this step (or close), as when one is stopped inside the step, or
     the only blockers are silent, so what they reached is as old as their last
     heartbeat (a heartbeat's counts are a lower bound) -- only heartbeats can
     tell. A process is then named *dead or stopped* when it has sent no
     heartbeat for longer than ``timeout_s + max(timeout_s, late_s)``, where
     ``late_s`` is the longest silence this process has seen from any peer that
     then spoke again: at least twice the timeout, and longer on a machine where
     healthy heartbeats have been seen to be late. Silence is counted only while
     this process's own watchdog thread runs: a process that was itself stopped
     or starved does not blame its peers for the heartbeats it did not read.

  Without a culprit (every process in the same step and alive: a long step) it
  keeps waiting, so a slow process is never named. With one, it prints one line
  on stderr and acts on ``on_verdict``:

  * ``"abort"`` (default): ``MPI_Abort`` with :data:`WATCHDOG_ABORT_CODE`; every
    process ends at once. The abort happens inside the ``with`` block, in the
    watchdog thread: no ``except`` or ``finally`` of the caller runs, and the job
    exits with the code ``75``.
  * ``"raise"``: no abort. The verdict is raised as :class:`MPIWatchdogError` in
    the caller's thread at the first point where that thread runs again: when
    the watched call it waits in returns (its outputs are dropped), at the next
    watched call, or in :meth:`~MPIWatchdog.close`. A call blocked in MPI cannot
    be interrupted, so if the culprit never arrives this process stays blocked:
    the mode helps where the culprit is late but arrives, or at close; a job
    whose culprit is stopped or hung for good hangs, as it would without a
    watchdog. The heartbeats carry the verdict, and the close check reports it
    on every process, so every process that reaches the close raises.

* **Close.** :meth:`MPIWatchdog.close` (the end of the ``with`` block) gathers
  every process's step count (and whether it reached a verdict) with a
  non-blocking allgather under the same timeout; different counts, or a verdict
  on any process, raise :class:`MPIWatchdogError` naming the ranks. An exception
  leaving the ``with`` block on one process (which would leave the others blocked
  in the step and this one blocked in ``MPI_Finalize``) is printed and aborts the
  job when ``abort_on_fault`` (the default with ``on_verdict="abort"``);
  otherwise the process joins the close gather for at most ``timeout_s`` and
  the exception goes on to the caller.

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

from .._validate import check_bool, check_choice
from ._partial_protocol import _abort_job, _close_or_abort, _import_mpi, _odd_ones

__all__ = ["MPIWatchdog", "MPIWatchdogError", "WATCHDOG_ABORT_CODE"]

WATCHDOG_ABORT_CODE = 75
"""The ``MPI_Abort`` error code of a watchdog verdict (``mpirun`` exits non-zero)."""

_ON_VERDICT = ("abort", "raise")  # what a verdict does: end the job, or raise in the caller's thread

_TAG_BEAT = 21
# Heartbeat: int64 [rank, entered, left, ms since the last transition, closing, reached a verdict].
_B_RANK, _B_ENTERED, _B_LEFT, _B_IDLE_MS, _B_CLOSING, _B_VERDICT = range(6)
_B_LEN = 6


class MPIWatchdogError(RuntimeError):
    """A watchdog verdict (with ``on_verdict="raise"``), or processes that disagree on the number of
    steps (raised by :meth:`MPIWatchdog.close`)."""


class MPIWatchdog:
    """Name the process that holds up a blocked MPI step; end the job or raise.

    Collective: every process constructs it (with the same ``timeout_s`` and
    ``on_verdict``) and wraps the same step with :meth:`watch`; see the module
    docstring for the protocol and the verdict rule.

    Args:
      timeout_s: seconds a process may wait -- in a step, or at close -- before
        the processes that hold it up are named. It must exceed the longest
        legitimate lag: one step's time plus the largest gap between steps on
        any process (data loading, logging, checkpoints) and, for the first
        step, tracing and compilation. A process named only by the silence of
        its heartbeats (every process has reached the step) is named after at
        least ``2 * timeout_s``.
      comm: an ``mpi4py.MPI.Comm`` or an object with a ``comm`` attribute (an
        :class:`~jaxcomm.comm.MPIComm`); default ``MPI.COMM_WORLD``. The
        watchdog uses a private duplicate of it.
      poll_s: seconds between heartbeats (default ``min(0.25, timeout_s / 8)``).
      on_verdict: ``"abort"`` (default): print the verdict and ``MPI_Abort`` the
        job from the watchdog thread, inside the ``with`` block, so the caller's
        ``except``/``finally`` never run. ``"raise"``: print it and raise
        :class:`MPIWatchdogError` in the caller's thread when the blocked call
        returns, at the next watched call or at close (a call that never returns
        stays blocked; see the module docstring).
      abort_on_fault: when an exception (or :class:`MPIWatchdogError`) leaves
        the ``with`` block, print it on stderr and ``MPI_Abort`` the job
        (default: ``True`` with ``on_verdict="abort"``, ``False`` with
        ``"raise"``; a single process never aborts).

    Example (``mpirun -n 4 python train.py``)::

        comm = MPIComm()
        step = jax.jit(train_step)  # uses comm's collectives
        with comm.watchdog(timeout_s=60.0) as wd:
            step = wd.watch(step)
            for batch in batches:
                params, state = step(params, state, batch)

    With ``on_verdict="raise"`` the verdict reaches the caller's ``except``
    (after the late process has arrived)::

        try:
            with comm.watchdog(timeout_s=60.0, on_verdict="raise") as wd:
                ...
        except MPIWatchdogError as e:
            log(e)
    """

    def __init__(
        self,
        timeout_s: float,
        comm: Any = None,
        *,
        poll_s: float | None = None,
        on_verdict: str = "abort",
        abort_on_fault: bool | None = None,
    ):
        if isinstance(timeout_s, bool) or not isinstance(timeout_s, (int, float)) or not 0 < timeout_s < float("inf"):
            raise ValueError(f"timeout_s must be a positive finite number of seconds; got {timeout_s!r}")
        if poll_s is None:
            poll_s = min(0.25, timeout_s / 8)
        if isinstance(poll_s, bool) or not isinstance(poll_s, (int, float)) or not 0 < poll_s <= timeout_s:
            raise ValueError(f"poll_s must be in (0, timeout_s]; got {poll_s!r}")
        on_verdict = check_choice(on_verdict, "on_verdict", _ON_VERDICT)
        if abort_on_fault is None:
            abort_on_fault = on_verdict == "abort"
        abort_on_fault = check_bool(abort_on_fault, "abort_on_fault")
        MPI = _import_mpi()
        if comm is None:
            comm = MPI.COMM_WORLD
        comm = getattr(comm, "comm", comm)
        if not isinstance(comm, MPI.Comm):
            raise TypeError(f"comm must be an mpi4py.MPI.Comm or an MPIComm; got {type(comm).__name__}")
        self.timeout_s = float(timeout_s)
        self.poll_s = float(poll_s)
        self.on_verdict = on_verdict
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
        # The verdict line (on_verdict="raise"); written once by the watchdog thread.
        self._verdict: str | None = None
        self._gathered = np.zeros((self.size, 2), np.int64)  # at close: every rank's (steps, verdict)
        # Peers' last heartbeat, when it arrived, and the longest silence seen from a peer that then
        # spoke again (late_s of the silence rule).
        self._peers = [q for q in range(self.size) if q != self.rank]
        self._state = {q: np.zeros(_B_LEN, np.int64) for q in self._peers}
        self._heard = dict.fromkeys(self._peers, now)
        self._late_s = 0.0
        self._resumed = float("-inf")  # when this thread last ran again after not running (see _run)
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
        return (
            f"MPIWatchdog(rank={self.rank}, size={self.size}, timeout_s={self.timeout_s:g}, "
            f"on_verdict={self.on_verdict!r}, steps={self._entered})"
        )

    @property
    def steps(self) -> int:
        """Number of steps this process has entered."""
        return self._entered

    # -- application side ---------------------------------------------------- #
    def watch(self, fn):
        """Wrap ``fn`` (the jitted step): count the call, run it, wait for its outputs.

        The wrapper returns ``fn``'s outputs after ``jax.block_until_ready``, so
        a step is *left* only when its collectives have finished on this process.
        With ``on_verdict="raise"``, a verdict reached while this call waited is
        raised (:class:`MPIWatchdogError`) instead of returning the outputs, and
        a verdict still pending is raised before the next call starts.
        """
        if not callable(fn):
            raise TypeError(f"fn must be callable; got {type(fn).__name__}")
        import jax

        @functools.wraps(fn)
        def step(*args, **kwargs):
            self._enter()
            out = jax.block_until_ready(fn(*args, **kwargs))
            self._leave()
            self._raise_verdict()
            return out

        return step

    def _enter(self):
        if self._closed or self._closing:
            raise MPIWatchdogError(f"rank {self.rank}: the watchdog is closed")
        self._raise_verdict()
        self._entered += 1
        self._changed = time.monotonic()

    def _leave(self):
        self._left = self._entered
        self._changed = time.monotonic()

    def _raise_verdict(self):
        if self._verdict is not None:
            raise MPIWatchdogError(f"rank {self.rank}: MPI watchdog: {self._verdict}")

    def close(self) -> None:
        """Stop the watchdog and check that every process made the same number of steps.

        Collective, bounded by ``timeout_s`` (a process that never closes is
        named by the watchdog thread). Raises :class:`MPIWatchdogError` naming
        the ranks whose step count differs from the most common one, or, with
        ``on_verdict="raise"``, the ranks that reached a verdict (on every
        process, including those that reached none).
        """
        if self._closed:
            return
        if not self._gather(self.timeout_s + 4 * self.poll_s + 30.0):
            self._raise_verdict()  # on_verdict="raise": reached while waiting here
            raise MPIWatchdogError(f"rank {self.rank}: not every process closed the watchdog")  # pragma: no cover
        self._check_gathered()

    def _gather(self, limit_s: float) -> bool:
        """The close gather of every process's ``(steps, reached a verdict)``, waited for at most
        ``limit_s`` seconds (with ``on_verdict="raise"``, until this process reaches a verdict).
        ``False`` if it did not complete; then the watchdog stops without meeting the others."""
        self._changed = time.monotonic()
        self._closing = True
        mine = np.array([self._entered, self._verdict is not None], np.int64)
        if self.size > 1:
            # The watchdog thread keeps beating (and judging) while we wait here.
            gather = self._comm.Iallgather(mine, self._gathered)
            backstop = time.monotonic() + limit_s
            delay = 1e-5
            while not gather.Test():
                if time.monotonic() > backstop or (self._verdict is not None and not mine[1]):
                    self._stop.set()
                    if self._thread is not None:
                        self._thread.join(self.poll_s * 4 + 1.0)
                    self._closed = True
                    return False
                time.sleep(delay)
                delay = min(self.poll_s, delay * 2)
        else:
            self._gathered[0] = mine
        self._shutdown()
        self._closed = True
        return True

    def _check_gathered(self) -> None:
        """Raise :class:`MPIWatchdogError` if the close gather shows different counts or verdicts."""
        self._raise_verdict()  # this process's own verdict first: it names the culprits
        per_rank = {r: int(n) for r, n in enumerate(self._gathered[:, 0])}
        if len(set(per_rank.values())) > 1:
            raise MPIWatchdogError(
                f"rank {self.rank}: call-count mismatch, ranks {_odd_ones(per_rank)} made a different number of "
                f"steps than the others (steps per rank {per_rank}); every process must call the step the same "
                "number of times"
            )
        judged = [r for r in range(self.size) if self._gathered[r, 1]]
        if judged:
            raise MPIWatchdogError(
                f"rank {self.rank}: MPI watchdog: ranks {judged} reached a verdict (printed on their stderr) "
                "while they waited in a step"
            )

    def __enter__(self):
        return self

    def __exit__(self, exc_type, exc, tb):
        if exc_type is None:
            _close_or_abort(self.close, MPIWatchdogError, self._fault_exit)
        elif self.abort_on_fault and self.size > 1:
            self._closing = True
            self._stop.set()
            if self._thread is not None:
                self._thread.join(self.poll_s * 4 + 1.0)
            self._closed = True
            self._fault_exit(exc)
        elif not self._closed:
            # Meet the others at close if they get there, so their close neither waits for
            # this process nor misses its verdict; the exception goes on to the caller.
            self._gather(self.timeout_s)
        return False

    def _fault_exit(self, err: BaseException) -> None:
        if self.abort_on_fault and self.size > 1:
            _abort_job(self._parent, self.rank, err, where=" left the MPI watchdog block", code=WATCHDOG_ABORT_CODE)

    # -- watchdog thread ----------------------------------------------------- #
    def _beat(self) -> np.ndarray:
        idle_ms = int(1e3 * (time.monotonic() - self._changed))
        return np.array(
            [self.rank, self._entered, self._left, idle_ms, int(self._closing), int(self._verdict is not None)],
            np.int64,
        )

    def _run(self):
        comm = self._comm
        bufs, recvs, sends = self._bufs, self._recvs, self._sends
        next_beat = 0.0
        heard_from: set[int] = set()
        nap = min(self.poll_s, 0.05)
        last = time.monotonic()
        while not self._stop.is_set():
            now = time.monotonic()
            absent = now - last - nap
            if absent > self.poll_s:
                # This thread did not run (this process stopped, starved, or its GIL held): what
                # the peers said meanwhile is unread, so their silence counts from now.
                self._resumed = now
            last = now
            if now >= next_beat:
                msg = self._beat()
                for q in self._peers:
                    if q in sends and not sends[q][0].Test():
                        continue  # the previous heartbeat has not left yet (a stopped peer)
                    sends[q] = (comm.Isend(msg, dest=q, tag=_TAG_BEAT), msg)
                next_beat = now + self.poll_s
            for q in self._peers:
                while recvs[q].Test():  # drain: keep the newest heartbeat
                    arrived = time.monotonic()
                    if q in heard_from:  # a silence that ended: how late a live peer's heartbeat can be
                        self._late_s = max(self._late_s, arrived - self._heard[q])
                    heard_from.add(q)
                    self._state[q] = bufs[q].copy()
                    self._heard[q] = arrived
                    recvs[q] = comm.Irecv(bufs[q], source=q, tag=_TAG_BEAT)
            verdict = None if self._verdict is not None else self._judge(time.monotonic())
            if verdict is not None:
                if self.on_verdict == "abort":
                    sys.stderr.write(f"jaxcomm: rank {self.rank}: MPI watchdog: {verdict}; aborting the job\n")
                    sys.stderr.flush()
                    self._parent.Abort(WATCHDOG_ABORT_CODE)
                    return  # pragma: no cover - Abort does not return
                sys.stderr.write(
                    f"jaxcomm: rank {self.rank}: MPI watchdog: {verdict}; raising MPIWatchdogError in the caller\n"
                )
                sys.stderr.flush()
                self._verdict = verdict
            self._stop.wait(nap)

    def _judge(self, now: float) -> str | None:
        """The verdict line if this process has waited too long and someone is to blame, else ``None``.

        The rule of the module docstring. A heartbeat's ``entered`` count is a
        lower bound (the peer may have stepped since), and a closing peer's count
        is final, so: a call-count mismatch names the odd ranks among the counts
        that are known; else the processes that have not reached where this one
        waits (in step ``k``: not entered it; at close: not closed) and whose
        heartbeats still arrive are the candidates, named when without progress
        for ``timeout_s`` and not waiting inside an earlier step for someone
        further behind; while one of them still progresses nobody is named; only
        then does silence alone name a process, after ``timeout_s + max(timeout_s,
        late_s)`` without a heartbeat.
        """
        waited = now - self._changed
        if not (self._entered > self._left or self._closing) or waited <= self.timeout_s:
            return None
        mine, states, limit = self._entered, self._state, self.timeout_s
        # Silence counts only while this thread ran; a peer not heard since it ran again is unknown.
        age = {q: now - max(self._heard[q], self._resumed) for q in self._peers}
        entered = {q: int(st[_B_ENTERED]) for q, st in states.items()}
        closing = [q for q, st in states.items() if st[_B_CLOSING]]
        silent = [q for q in self._peers if age[q] > limit or self._heard[q] < self._resumed]
        if self._closing:  # held up by whoever has not closed
            blockers = [q for q in self._peers if q not in closing]
            mismatched = [q for q in blockers if entered[q] > mine]
            where = f"close (after {mine} steps)"
        else:  # held up by whoever has not entered this step
            blockers = [q for q in self._peers if entered[q] < mine]
            mismatched = [q for q in blockers if q in closing]
            where = f"step {mine - 1}"
        parts = [f"rank {self.rank} waited {waited:.1f} s in {where}"]
        culprits: list[int] = []
        if mismatched:
            # Vote with the counts whose side is known: a closing rank's count is final; a stepping
            # rank's is a lower bound, so it is known to be beyond the closers only at or past this
            # step (closing here: past this count). Others (maybe stale, maybe about to close) abstain.
            past = mine if not self._closing else mine + 1
            known = [q for q in self._peers if q in closing or entered[q] >= past]
            counts = {**{q: entered[q] for q in known}, self.rank: mine}
            culprits = _odd_ones(counts)
            closers = sorted(closing + ([self.rank] if self._closing else []))
            parts.append(
                f"call-count mismatch: steps per rank {dict(sorted(counts.items()))}, closing ranks {closers}; "
                f"ranks {culprits} differ from the most common count"
            )
            return f"culprit ranks {culprits}: " + "; ".join(parts)
        lowest = min([entered[q] for q in blockers], default=mine)
        progressing = False
        for q in blockers:
            if q in silent:
                continue  # what it reached is as old as its silence: judged by the silence below
            st = states[q]
            idle = st[_B_IDLE_MS] / 1e3  # as the peer reported it: not extrapolated over a late heartbeat
            inside = st[_B_ENTERED] > st[_B_LEFT]
            if idle <= limit:
                progressing = True
            elif not (inside and entered[q] > lowest):  # else itself waiting for someone further behind
                culprits.append(q)
                at = f"stuck inside step {entered[q] - 1}" if inside else f"not entered step {entered[q]}"
                parts.append(f"rank {q} is alive but its application has {at} for {idle:.1f} s (hung)")
        if not culprits and not progressing:  # nobody is identifiably behind: only silence can tell
            limit += max(self.timeout_s, self._late_s)
            stale = {q: round(age[q], 1) for q in silent if age[q] > limit and (self._closing or entered[q] <= mine)}
            culprits = sorted(stale)
            if stale:
                parts.append(
                    f"ranks {culprits} sent no heartbeat for {stale} s (dead or stopped; no rank is identifiably "
                    f"behind, and a silence over {limit:.1f} s names a rank)"
                )
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
