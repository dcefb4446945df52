"""Asynchronous solo and majority allreduce over MPI processes (eager-SGD, Li et al. 2020, Sec. 4).

A partial allreduce does not wait for late processes. Each process owns a send
buffer and a progress thread (the role of fflib2's offloaded schedule, Sec. 4.3)
that takes part in every round, whether or not the application has arrived:

1. **Activation.** A round starts at its *initiator*: for ``solo`` any process
   that calls the collective before the round was activated (the first
   arrival, Sec. 4.1); for ``majority`` the rank drawn from the shared seed, and
   only when it arrives (Sec. 4.2). The initiator's progress thread sends an
   activation message down a binomial tree rooted at itself (recursive
   doubling, ``log2 P`` steps); every process forwards the activations it
   receives to its children in that tree. Several solo initiators are allowed:
   each one's tree is forwarded, so every process is reached.
2. **Snapshot.** On activation each progress thread takes whatever its send
   buffer holds -- this call's gradient if the application has already
   deposited it (the process is *active*), otherwise only older, stale
   gradients (or nothing) -- and empties the buffer.
3. **Allreduce.** Recursive doubling (with the usual fold-in of the ranks above
   the largest power of two) over a dedicated communicator; the message carries
   the data and a ``P``-byte contributor mask. Both partners add the same two
   operands at every stage, so the result is bitwise identical on every process.

A call ``k`` returns round ``k``'s result: ``(sum of contributions, included,
nap, contributors)``. A late process (round ``k`` already snapshotted when it
arrives) returns immediately after the round finishes, and its gradient stays
in the send buffer for the next round: it becomes a stale gradient, delivered
exactly once. Every process applies every round's result in order, so the
models of all processes stay identical (unlike fflib2, whose single receive
buffer shows a lagging process only the latest result, Sec. 5); the price is
one stored result per round a process lags behind.

Guarantees (Lemma 6.1): *liveness* -- every call returns (or raises
:class:`PartialCollectiveTimeout` naming the ranks that are missing);
*safety* -- the result is the sum of a subset of the proposed updates, the
contributor mask says which, identical on every process; *quorum* -- solo:
at least one fresh gradient (the initiator's), majority: the initiator's plus
all who arrived before it (``(P+1)/2`` on average under full skew), sync:
all; *staleness* -- with ``sync_every = N`` every ``N``-th round is a full
synchronous allreduce, so no gradient waits more than ``N`` rounds.

Why NumPy and threads rather than jit: the whole point is that a process's
collective runs while its application thread is still computing, driven by
messages from other processes; XLA programs (and mpi4jax inside them) are
synchronous at the step boundary. The collective therefore runs between jitted
steps on host buffers: ``grads -> np.asarray -> PartialAllreduce -> update``.
The cost is one device-to-host copy per step, negligible next to the waits it
removes.

Requirements: mpi4py with ``MPI_THREAD_MULTIPLE`` (the default of mpi4py and Open
MPI 5). The progress thread is the only thread that touches the dedicated
communicator, and it polls with an adaptive back-off (``poll_s``) instead of
blocking in ``MPI_Wait`` because Open MPI spins in ``MPI_Wait``, which starves an
oversubscribed machine.

This module and the two it builds on (``_partial_protocol``: the wire and the records;
``_partial_progress``: the progress thread) import only NumPy and mpi4py, so that MPI worker
scripts can load them without importing JAX.
"""

from __future__ import annotations

import time

import numpy as np

from .._validate import check_choice, check_int
from ._partial_progress import _ProgressThread
from ._partial_protocol import (
    _TAG_HELLO,
    PARTIAL_MODES,
    PartialCollectiveError,
    PartialCollectiveTimeout,
    PartialResult,
    _abort_job,
    _close_or_abort,
    _import_mpi,
    _odd_ones,
    _splitmix64,
    majority_initiator,
)
from ._partial_protocol import _children as _children  # the activation tree, which the tests walk

__all__ = [
    "PartialAllreduce",
    "PartialResult",
    "PartialCollectiveError",
    "PartialCollectiveTimeout",
    "majority_initiator",
    "PARTIAL_MODES",
]


class PartialAllreduce(_ProgressThread):
    """Persistent solo / majority / synchronous allreduce with a progress thread.

    Collective: every process of ``comm`` constructs it (same arguments), calls
    it the same number of times, and closes it. Use as a context manager.

    >>> pa = PartialAllreduce(grad.shape, np.float32, mode="solo")   # doctest: +SKIP
    >>> res = pa(grad)                       # doctest: +SKIP
    >>> params -= lr * res.data / pa.size    # doctest: +SKIP
    >>> pa.close()                           # doctest: +SKIP

    Args:
      shape: shape (or element count) of the arrays reduced every call.
      dtype: NumPy floating dtype of the data.
      mode: ``"solo"``, ``"majority"`` or ``"sync"`` (an ordinary allreduce through
        the same engine, for baselines).
      comm: the MPI communicator (default ``MPI.COMM_WORLD``); a duplicate is used.
      seed: shared seed of the majority initiators (same on every process).
      timeout: seconds to wait for other processes before raising
        :class:`PartialCollectiveTimeout`.
      sync_every: every ``sync_every``-th round is synchronous (0: never).
      poll_s: longest sleep of the progress thread between polls, seconds.
      probe_s: how long the liveness probe after a timeout waits for answers
        (default ``min(1, timeout / 4)``).
      abort_on_fault: when a fault of this collective (a timeout naming the
        culprit ranks, a call-count mismatch) leaves the ``with`` block, print it
        on stderr and call ``MPI_Abort`` on ``comm``, so the job ends instead of
        blocking in ``MPI_Finalize`` on a hung peer. ``False``: only raise.
    """

    def __init__(
        self,
        shape,
        dtype=np.float32,
        *,
        mode: str = "solo",
        comm=None,
        seed: int = 0,
        timeout: float = 60.0,
        sync_every: int = 0,
        poll_s: float = 1e-3,
        probe_s: float | None = None,
        abort_on_fault: bool = True,
    ):
        check_choice(mode, "mode", PARTIAL_MODES)
        self.shape = (int(shape),) if np.ndim(shape) == 0 else tuple(int(s) for s in shape)
        if any(s < 0 for s in self.shape):
            raise ValueError(f"shape must be non-negative; got {shape!r}")
        self.dtype = np.dtype(dtype)
        if not np.issubdtype(self.dtype, np.floating):
            raise TypeError(f"dtype must be a floating dtype; got {self.dtype}")
        for name, v in (("timeout", timeout), ("poll_s", poll_s)):
            if not isinstance(v, (int, float)) or isinstance(v, bool) or not np.isfinite(v) or v <= 0:
                raise ValueError(f"{name} must be a positive number of seconds; got {v!r}")
        sync_every = check_int(sync_every, "sync_every", 0)
        self.mode = mode
        self.seed = int(seed)
        self.timeout = float(timeout)
        self.sync_every = int(sync_every)
        self.poll_s = float(poll_s)
        self.probe_s = float(probe_s) if probe_s is not None else min(1.0, self.timeout / 4)
        self.abort_on_fault = bool(abort_on_fault)
        MPI = _import_mpi()
        if MPI.Query_thread() < MPI.THREAD_MULTIPLE:
            raise PartialCollectiveError(
                "PartialAllreduce needs MPI_THREAD_MULTIPLE (mpi4py.rc.thread_level = 'multiple' before importing MPI)"
            )
        parent = MPI.COMM_WORLD if comm is None else comm
        self.rank = parent.Get_rank()
        self.size = parent.Get_size()
        self.count = int(np.prod(self.shape, dtype=np.int64))

        self._parent = parent
        self._handshake(parent)
        self._comm = parent.Dup()
        self._start_progress()

    # ------------------------------------------------------------------ API
    def __call__(self, x) -> PartialResult:
        """Deposit ``x`` and return the result of round ``k`` (``k`` = earlier calls).

        Blocks while this process is early (until the round is triggered and
        finished); returns as soon as the round finishes when this process is
        late, leaving ``x`` in the send buffer for a later round.
        """
        arr = np.asarray(x)
        if arr.shape != self.shape:
            raise ValueError(f"x must have shape {self.shape}; got {arr.shape}")
        arr = arr.astype(self.dtype, copy=False).reshape(-1)
        with self._cond:
            self._check_usable()
            k = self._calls
            self._in_call = True
            self._sbuf += arr
            self._calls = k + 1
            if self._snap_rounds == k and self._initiates(k):
                self._internal_round = k
                self._wake.set()
            self._waiting = (k, time.monotonic())
            # The progress thread enforces `timeout` (and names the missing ranks);
            # this bound only guards against a dead progress thread.
            backstop = time.monotonic() + self.timeout + 4 * self.probe_s + 30.0
            while self._done_rounds <= k and self._error is None:
                left = backstop - time.monotonic()
                if left <= 0:
                    self._error = PartialCollectiveError(
                        f"rank {self.rank}: round {k} did not finish and the progress thread reported nothing"
                    )
                    break
                self._cond.wait(min(left, 1.0))
            self._waiting = None
            self._in_call = False
            self._app_left = time.monotonic()
            if self._error is not None:
                self._error_reported = True
                raise self._error
            data, mask = self._results.pop(k)
        contributors = mask.astype(bool)
        return PartialResult(
            data.reshape(self.shape), bool(contributors[self.rank]), int(contributors.sum()), contributors, k
        )

    def leftover(self) -> np.ndarray:
        """Deposited data not yet delivered by any round (a copy, input shape)."""
        with self._cond:
            return self._sbuf.copy().reshape(self.shape)

    @property
    def rounds_done(self) -> int:
        """Rounds completed by this process's progress thread."""
        with self._cond:
            return self._done_rounds

    @property
    def stats(self) -> dict:
        """Counters: ``rounds``, ``activations_sent``, ``activations_received`` (this process)."""
        return dict(self._stats)

    def initiator(self, round_index: int) -> int:
        """The majority initiator of ``round_index`` (:func:`majority_initiator`)."""
        return majority_initiator(self.seed, round_index, self.size)

    def is_sync_round(self, round_index: int) -> bool:
        """Whether round ``round_index`` is a synchronous round."""
        return self.mode == "sync" or (self.sync_every > 0 and (round_index + 1) % self.sync_every == 0)

    def close(self) -> None:
        """Finish: wait for the other processes (a non-blocking barrier with the timeout),
        stop the progress thread, cancel its receives and free the communicator.

        Collective. Leaves no thread and no pending request behind. Raises the
        stored error (or a timeout) if the processes could not finish together.
        """
        with self._cond:
            if self._closed:
                return
            self._closing = True
            self._in_call = True
            self._wake.set()
        self._thread.join(self.timeout + 4 * self.probe_s + 30.0)
        if self._thread.is_alive():  # pragma: no cover - the thread enforces its own deadlines
            raise PartialCollectiveError(f"rank {self.rank}: the progress thread did not stop")
        with self._cond:
            self._closed = True
            err = self._error
            reported = self._error_reported
        if err is None:
            self._comm.Free()
        elif not reported:
            self._error_reported = True
            raise err

    def __enter__(self):
        return self

    def __exit__(self, exc_type, exc, tb):
        if exc_type is None:
            _close_or_abort(self.close, (PartialCollectiveTimeout, PartialCollectiveError), self._fault_exit)
        else:
            # Do not mask the original exception; stop the thread quickly.
            with self._cond:
                if self._error is None:
                    self._error = PartialCollectiveError(f"rank {self.rank}: aborted by {exc_type.__name__}")
                self._closing = True
                self._wake.set()
            self._thread.join(self.timeout + 30.0)
            self._closed = True
            if isinstance(exc, (PartialCollectiveTimeout, PartialCollectiveError)):
                self._fault_exit(exc)
        return False

    def _fault_exit(self, err: BaseException) -> None:
        """End the job on a fault (``abort_on_fault``): a hung peer never reaches
        ``MPI_Finalize``, which would otherwise block this process forever."""
        if self.abort_on_fault and self.size > 1:
            _abort_job(self._parent, self.rank, err)

    def pending_requests(self) -> int:
        """Number of MPI requests still owned by this object (0 after :meth:`close`)."""
        MPI = _import_mpi()
        n = sum(int(r != MPI.REQUEST_NULL) for r, _ in self._sends)
        n += sum(
            int(r is not None and r != MPI.REQUEST_NULL) for r in (self._act_req, self._ping_req, self._verdict_req)
        )
        n += sum(int(r != MPI.REQUEST_NULL) for r in self._recvs)
        return n

    # ------------------------------------------------------------ internals
    def _check_usable(self):
        if self._error is not None:
            self._error_reported = True
            raise self._error
        if self._closing or self._closed:
            raise PartialCollectiveError(f"rank {self.rank}: this PartialAllreduce is closed")

    def _initiates(self, k: int) -> bool:
        if self.is_sync_round(k) or self.mode == "solo":
            return True
        return self.initiator(k) == self.rank

    def _handshake(self, parent) -> None:
        """Every process says hello to every other on ``parent``; name who never does."""
        MPI = _import_mpi()
        if self.size == 1:
            return
        # The hello carries a fingerprint of (shape, dtype, mode, seed, sync_every):
        # processes that disagree get an error naming them, not silently mixed data.
        out = np.array([self.rank, self._fingerprint()], np.int64)
        ins = {r: np.zeros(2, np.int64) for r in range(self.size) if r != self.rank}
        rreqs = {r: parent.Irecv(buf, source=r, tag=_TAG_HELLO) for r, buf in ins.items()}
        sreqs = [parent.Isend(out, dest=r, tag=_TAG_HELLO) for r in ins]
        deadline = time.monotonic() + self.timeout
        delay = 1e-5
        while True:
            missing = [r for r, q in rreqs.items() if not q.Test()]
            if not missing:
                break
            if time.monotonic() > deadline:
                for r in missing:
                    rreqs[r].Cancel()
                    rreqs[r].Wait()
                for q in sreqs:
                    if not q.Test():
                        q.Cancel()
                        q.Test()
                raise PartialCollectiveTimeout(
                    self.rank,
                    -1,
                    missing,
                    f"these ranks did not construct the PartialAllreduce within {self.timeout:g} s",
                )
            time.sleep(delay)
            delay = min(delay * 2, self.poll_s)
        MPI.Request.Waitall(sreqs)
        prints = {r: int(buf[1]) for r, buf in ins.items()}
        prints[self.rank] = int(out[1])
        if len(set(prints.values())) > 1:
            odd = _odd_ones(prints)
            raise ValueError(
                f"rank {self.rank}: ranks {odd} constructed the PartialAllreduce with a different shape, dtype, "
                f"mode, seed or sync_every than the others (this rank: shape={self.shape}, dtype={self.dtype}, "
                f"mode={self.mode!r}, seed={self.seed}, sync_every={self.sync_every}); every process must pass "
                "the same arguments"
            )

    def _fingerprint(self) -> int:
        """A 63-bit hash of the arguments every process must agree on (stable across processes)."""
        h = 0x243F6A8885A308D3
        key = f"{self.shape}|{self.dtype.str}|{self.mode}|{self.seed}|{self.sync_every}"
        for byte in key.encode():
            h = _splitmix64(h ^ byte)
        return h >> 1
