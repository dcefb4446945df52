"""The progress thread of the partial allreduce: the rounds, the liveness probes, the diagnosis of a
timeout and the closing barrier (the protocol: :mod:`jaxcomm.comm._partial_mpi`).

NumPy and mpi4py only, so that MPI worker scripts can load it without JAX.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable
from typing import Any

import numpy as np

from ._partial_protocol import (
    _ST_CALLS,
    _ST_CLOSING,
    _ST_FAILED,
    _ST_IDLE_MS,
    _ST_IN_CALL,
    _ST_LEN,
    _TAG_ACT,
    _TAG_PING,
    _TAG_PONG,
    _TAG_POST,
    _TAG_PRE,
    _TAG_RD,
    _TAG_VERDICT,
    _VERDICT_DETAIL,
    PartialCollectiveError,
    PartialCollectiveTimeout,
    _children,
    _import_mpi,
    _odd_ones,
)


class _ProgressThread:
    """The progress thread of a :class:`~jaxcomm.comm.PartialAllreduce`, one per process: it runs
    every round (activation, snapshot, recursive-doubling allreduce), answers liveness probes,
    diagnoses a timeout and closes. The application side (the subclass) sets the configuration
    below and the dedicated communicator, then calls :meth:`_start_progress`.
    """

    # Set by the application side before _start_progress.
    rank: int
    size: int
    mode: str
    timeout: float
    poll_s: float
    probe_s: float
    count: int
    dtype: np.dtype
    _comm: Any  # the dedicated communicator (an mpi4py Comm)
    is_sync_round: Callable[[int], bool]
    initiator: Callable[[int], int]

    def _start_progress(self) -> None:
        """Make the message buffers, the state both threads share (under ``_cond``) and the
        progress thread's own; start the thread."""
        # Message layout: int64 round | data | uint8 mask[P]
        self._nbytes = 8 + self.count * self.dtype.itemsize + self.size
        self._msg = np.zeros(self._nbytes, np.uint8)
        self._tmp = np.zeros(self._nbytes, np.uint8)
        self._msg_round, self._msg_data, self._msg_mask = self._views(self._msg)
        self._tmp_round, self._tmp_data, self._tmp_mask = self._views(self._tmp)

        self._sbuf = np.zeros(self.count, self.dtype)
        self._cond = threading.Condition()
        self._wake = threading.Event()
        self._calls = 0  # application calls made (deposits)
        self._snap_rounds = 0  # rounds whose snapshot was taken
        self._done_rounds = 0  # rounds completed
        self._results: dict = {}
        self._internal_round = -1  # round the application asked to initiate
        self._waiting: tuple | None = None  # (round, since) while the application waits
        self._in_call = False  # the application is inside a call (or close)
        self._app_left = time.monotonic()  # when the application last left a call
        self._error: BaseException | None = None
        self._error_reported = False
        self._closing = False
        self._closed = False
        self._thread_done = False

        # Progress-thread-only state.
        self._round = 0
        self._pending_acts: dict = {}  # round -> set of roots already forwarded
        self._sends: list = []  # outstanding (request, buffer)
        self._recvs: list = []  # outstanding receive requests (for cleanup)
        self._act_in = np.zeros(2, np.int64)
        self._ping_in = np.zeros(1, np.int64)
        self._act_req: Any = None  # MPI requests once the progress thread starts
        self._ping_req: Any = None
        self._verdict_in = np.zeros(8 * (4 + self.size) + _VERDICT_DETAIL, np.uint8)
        self._verdict_req: Any = None
        self._stats = {"activations_sent": 0, "activations_received": 0, "rounds": 0}

        self._thread = threading.Thread(target=self._run, name=f"partial-allreduce-{self.rank}", daemon=True)
        self._thread.start()

    def _views(self, buf: np.ndarray):
        """``buf``'s round (``int64[1]``), data (``dtype[count]``) and contributor mask (``uint8[P]``)."""
        rnd = buf[:8].view(np.int64)
        data = buf[8 : 8 + self.count * self.dtype.itemsize].view(self.dtype)
        mask = buf[8 + self.count * self.dtype.itemsize :]
        return rnd, data, mask

    def _run(self):
        MPI = _import_mpi()
        try:
            self._act_req = self._comm.Irecv(self._act_in, source=MPI.ANY_SOURCE, tag=_TAG_ACT)
            self._ping_req = self._comm.Irecv(self._ping_in, source=MPI.ANY_SOURCE, tag=_TAG_PING)
            self._verdict_req = self._comm.Irecv(self._verdict_in, source=MPI.ANY_SOURCE, tag=_TAG_VERDICT)
            while True:
                self._service()
                with self._cond:
                    if self._error is not None:
                        break
                    r = self._round
                    internal = self._internal_round == r
                    closing = self._closing
                    calls = self._calls
                    waiting = self._waiting
                external = r in self._pending_acts
                if internal or external:
                    self._execute_round(r, internal)
                    continue
                if closing and r >= calls:
                    self._finish()
                    break
                if waiting is not None and waiting[0] == r and time.monotonic() - waiting[1] > self.timeout:
                    self._timeout(r, "the round was never activated")
                # Idle: sleep poll_s unless the application wakes us (it initiates a round or
                # closes). Polling faster costs CPU that an oversubscribed machine lacks.
                self._wake.wait(self.poll_s)
                self._wake.clear()
        except BaseException as e:
            with self._cond:
                if self._error is None:
                    self._error = e
                self._cond.notify_all()
        finally:
            with self._cond:
                failed = self._error is not None
            if failed:
                self._linger()
                self._abandon()
            with self._cond:
                self._thread_done = True
                self._cond.notify_all()

    def _linger(self):
        """After a failure, keep answering liveness probes until the application closes.

        Other processes usually time out a moment later and probe; a process that
        failed itself must still look alive to them, or they would blame it.
        """
        MPI = _import_mpi()
        status = MPI.Status()
        while True:
            with self._cond:
                if self._closing:
                    return
            try:
                while self._ping_req is not None and self._ping_req.Test(status):
                    src = status.Get_source()
                    self._ping_req = self._comm.Irecv(self._ping_in, source=MPI.ANY_SOURCE, tag=_TAG_PING)
                    self._send(self._state_vector(), src, _TAG_PONG)
                if self._sends:
                    self._sends = [(q, b) for q, b in self._sends if not q.Test()]
            except Exception:
                return
            self._wake.wait(self.poll_s)
            self._wake.clear()

    def _state_vector(self) -> np.ndarray:
        """``int64[_ST_LEN]``: rank, calls, snapshots, rounds done, closing, failed,
        application inside a call, milliseconds since the application last left one."""
        with self._cond:
            idle_ms = 0 if self._in_call else int(1e3 * (time.monotonic() - self._app_left))
            return np.array(
                [
                    self.rank,
                    self._calls,
                    self._snap_rounds,
                    self._done_rounds,
                    int(self._closing),
                    int(self._error is not None),
                    int(self._in_call),
                    idle_ms,
                ],
                np.int64,
            )

    def _send(self, payload: np.ndarray, dest: int, tag: int):
        req = self._comm.Isend(payload, dest=dest, tag=tag)
        self._sends.append((req, payload))
        return req

    def _activate(self, r: int, root: int):
        """Forward (or, as root, start) round ``r``'s activation down ``root``'s tree."""
        seen = self._pending_acts.setdefault(r, set())
        if root in seen:
            return
        seen.add(root)
        for child in _children(self.rank, root, self.size):
            self._send(np.array([r, root], np.int64), child, _TAG_ACT)
            self._stats["activations_sent"] += 1

    def _service(self):
        """Receive activations and pings; retire finished sends. Never blocks."""
        MPI = _import_mpi()
        status = MPI.Status()
        while self._act_req.Test(status):
            r, root = int(self._act_in[0]), int(self._act_in[1])
            self._stats["activations_received"] += 1
            self._act_req = self._comm.Irecv(self._act_in, source=MPI.ANY_SOURCE, tag=_TAG_ACT)
            if r >= self._round:  # rounds before ours are finished everywhere
                self._activate(r, root)
        while self._ping_req.Test(status):
            src = status.Get_source()
            self._ping_req = self._comm.Irecv(self._ping_in, source=MPI.ANY_SOURCE, tag=_TAG_PING)
            self._send(self._state_vector(), src, _TAG_PONG)
        if self._sends:
            self._sends = [(q, b) for q, b in self._sends if not q.Test()]
        if self._verdict_req is not None and self._verdict_req.Test():
            self._verdict_req = None
            raise self._decode_verdict()

    def _send_verdict(self, err: PartialCollectiveTimeout) -> None:
        """Tell every other process the diagnosis, so all of them fail naming the same
        culprits (and none blames a healthy process that stopped answering after failing)."""
        detail = err.detail.encode()[:_VERDICT_DETAIL]
        msg = np.zeros_like(self._verdict_in)
        head = msg[: 8 * (4 + self.size)].view(np.int64)
        head[:4] = [self.rank, err.round, len(err.missing_ranks), len(detail)]
        head[4 : 4 + len(err.missing_ranks)] = err.missing_ranks
        msg[8 * (4 + self.size) : 8 * (4 + self.size) + len(detail)] = np.frombuffer(detail, np.uint8)
        for q in range(self.size):
            if q != self.rank:
                self._send(msg, q, _TAG_VERDICT)

    def _decode_verdict(self) -> PartialCollectiveTimeout:
        head = self._verdict_in[: 8 * (4 + self.size)].view(np.int64)
        reporter, rnd, n, nbytes = (int(v) for v in head[:4])
        start = 8 * (4 + self.size)
        detail = bytes(self._verdict_in[start : start + nbytes]).decode(errors="replace")
        return PartialCollectiveTimeout(
            self.rank, rnd, [int(v) for v in head[4 : 4 + n]], f"diagnosed by rank {reporter}: {detail}"
        )

    def _execute_round(self, r: int, internal: bool):
        sync_round = self.is_sync_round(r)
        if internal and not sync_round:
            self._activate(r, self.rank)
        with self._cond:
            self._msg_data[...] = self._sbuf
            self._sbuf[...] = 0
            included = self._calls > r
            self._snap_rounds = r + 1
        self._msg_round[0] = r
        self._msg_mask[...] = 0
        self._msg_mask[self.rank] = 1 if included else 0
        self._allreduce(r, sync_round)
        data = self._msg_data.copy()
        mask = self._msg_mask.copy()
        with self._cond:
            self._results[r] = (data, mask)
            self._done_rounds = r + 1
            self._round = r + 1
            self._cond.notify_all()
        self._pending_acts = {m: s for m, s in self._pending_acts.items() if m > r}
        self._stats["rounds"] += 1

    def _allreduce(self, r: int, sync_round: bool):
        """Recursive-doubling sum of ``self._msg`` (data + mask), in place."""
        p, me = self.size, self.rank
        if p == 1:
            return
        p2 = 1 << (p.bit_length() - 1)
        rem = p - p2
        if me >= p2:  # fold into me - p2, get the result back
            self._exchange(r, [("send", me - p2, _TAG_PRE)], sync_round)
            self._exchange(r, [("recv", me - p2, _TAG_POST)], sync_round, into_msg=True)
            return
        if me < rem:
            self._exchange(r, [("recv", me + p2, _TAG_PRE)], sync_round)
            self._combine(r)
        stage, bit = 0, 1
        while bit < p2:
            partner = me ^ bit
            self._exchange(r, [("recv", partner, _TAG_RD + stage), ("send", partner, _TAG_RD + stage)], sync_round)
            self._combine(r)
            bit <<= 1
            stage += 1
        if me < rem:
            self._exchange(r, [("send", me + p2, _TAG_POST)], sync_round)

    def _combine(self, r: int):
        if int(self._tmp_round[0]) != r:
            raise PartialCollectiveError(
                f"rank {self.rank}: protocol error, got data of round {int(self._tmp_round[0])} in round {r}"
            )
        # a + b == b + a in IEEE arithmetic: both partners get identical bits.
        self._msg_data += self._tmp_data
        np.maximum(self._msg_mask, self._tmp_mask, out=self._msg_mask)

    def _exchange(self, r: int, ops, sync_round: bool, into_msg: bool = False):
        reqs = []
        peers = []
        for kind, peer, tag in ops:
            peers.append(peer)
            if kind == "recv":
                q = self._comm.Irecv(self._msg if into_msg else self._tmp, source=peer, tag=tag)
                self._recvs.append(q)
            else:
                q = self._comm.Isend(self._msg, dest=peer, tag=tag)
                self._sends.append((q, self._msg))
            reqs.append(q)
        self._wait(reqs, r, peers, sync_round)
        self._recvs = [q for q in self._recvs if all(q is not x for x in reqs)]
        if into_msg and int(self._msg_round[0]) != r:
            raise PartialCollectiveError(
                f"rank {self.rank}: protocol error, got the result of round {int(self._msg_round[0])} in round {r}"
            )

    def _wait(self, reqs, r: int, peers, sync_round: bool):
        start = time.monotonic()
        delay = 0.0
        done = [False] * len(reqs)
        while True:
            progressed = False
            for i, q in enumerate(reqs):
                if not done[i] and q.Test():
                    done[i] = True
                    progressed = True
            if all(done):
                return
            self._service()
            with self._cond:
                if self._error is not None:
                    raise self._error
            if time.monotonic() - start > self.timeout:
                waiting_on = [p for p, d in zip(peers, done) if not d]
                self._timeout(r, f"no message from rank(s) {waiting_on} in the allreduce", sync_round=sync_round)
            if progressed:
                delay = 0.0
            else:
                delay = min(self.poll_s, max(2e-5, delay * 2))
            time.sleep(delay)

    def _probe(self) -> dict:
        """Ping every other process; return ``{rank: state}`` of those that answered."""
        MPI = _import_mpi()
        answers: dict[int, np.ndarray] = {}
        others = [q for q in range(self.size) if q != self.rank]
        pong = np.zeros(_ST_LEN, np.int64)
        for q in others:
            self._send(np.array([self.rank], np.int64), q, _TAG_PING)
        req = self._comm.Irecv(pong, source=MPI.ANY_SOURCE, tag=_TAG_PONG)
        self._recvs.append(req)
        status = MPI.Status()
        end = time.monotonic() + self.probe_s
        while time.monotonic() < end and len(answers) < len(others):
            if req.Test(status):
                answers[int(pong[0])] = pong.copy()
                self._recvs = [q for q in self._recvs if q is not req]
                req = self._comm.Irecv(pong, source=MPI.ANY_SOURCE, tag=_TAG_PONG)
                self._recvs.append(req)
                continue
            self._service()
            time.sleep(1e-4)
        req.Cancel()
        req.Wait()
        self._recvs = [q for q in self._recvs if q is not req]
        return answers

    def _timeout(self, r: int, what: str, sync_round: bool = False):
        """Diagnose a timeout in round ``r``: probe, name the culprits, tell the others, raise.

        Culprits, in order: *dead* (no answer to the probe); *hung* (its progress
        thread answers, but its application is outside the collective, has not
        called round ``r`` and has not called for longer than ``timeout``: a slow
        process that calls within the timeout is never named); where the round
        needs them, the alive-but-not-arrived (majority initiator; everyone in a
        synchronous round); failing all these, when some process is closing with a
        different number of calls, the ranks whose call count differs from the
        most common one (call-count mismatch).
        """
        answers = self._probe()
        with self._cond:
            me_closing = self._closing
        # Arrived at round r: made call r (calls > r); at close, made every round's call.
        need = r if me_closing else r + 1
        dead = [q for q in range(self.size) if q != self.rank and q not in answers]
        not_arrived = sorted(q for q, st in answers.items() if st[_ST_CALLS] < need)
        closed = sorted(q for q, st in answers.items() if st[_ST_CLOSING] and not st[_ST_FAILED])
        failed = sorted(q for q, st in answers.items() if st[_ST_FAILED])
        hung = sorted(
            q
            for q, st in answers.items()
            if not (st[_ST_FAILED] or st[_ST_IN_CALL] or st[_ST_CLOSING])
            and st[_ST_CALLS] < need
            and st[_ST_IDLE_MS] > 1e3 * self.timeout
        )
        sync_round = sync_round or self.is_sync_round(r)
        missing = set(dead) | set(hung)
        if sync_round:
            missing.update(not_arrived)
        elif self.mode == "majority":
            init = self.initiator(r)
            if init in not_arrived or (init != self.rank and init in dead):
                missing.add(init)
        with self._cond:
            counts = {q: int(st[_ST_CALLS]) for q, st in answers.items()}
            counts[self.rank] = self._calls
        mismatch: list = []
        if not missing and (closed or me_closing) and len(set(counts.values())) > 1:
            mismatch = _odd_ones(counts)
            missing.update(mismatch)
        parts = [f"{what} after {self.timeout:g} s"]
        if dead:
            parts.append(f"ranks {dead} did not answer a liveness probe (dead)")
        if hung:
            idle = {q: round(float(answers[q][_ST_IDLE_MS]) / 1e3, 1) for q in hung}
            parts.append(
                f"ranks {hung} are alive but their application has not called the collective for {idle} s (hung)"
            )
        if self.mode == "majority" and not sync_round:
            parts.append(f"the designated initiator of round {r} is rank {self.initiator(r)}")
        if not_arrived:
            parts.append(f"ranks {not_arrived} have not called round {r} yet")
        if failed:
            parts.append(f"ranks {failed} are alive but already failed")
        if closed:
            parts.append(f"ranks {closed} already closed")
        if mismatch:
            parts.append(f"call-count mismatch: calls per rank {dict(sorted(counts.items()))}")
        err = PartialCollectiveTimeout(self.rank, r, sorted(missing), "; ".join(parts))
        self._send_verdict(err)
        raise err

    def _finish(self):
        """Close: complete our sends, barrier with everyone, cancel our receives."""
        MPI = _import_mpi()
        start = time.monotonic()
        delay = 1e-5
        while self._sends:
            self._service()
            if time.monotonic() - start > self.timeout:
                self._timeout(self._round, "sends did not complete at close")
            time.sleep(delay)
            delay = min(self.poll_s, delay * 2)
        # A barrier that also gathers every process's call count (the close-time
        # agreement check: a process that made more or fewer calls is named).
        mine = np.array([self._calls], np.int64)
        counts = np.zeros(self.size, np.int64)
        barrier = self._comm.Iallgather(mine, counts)
        self._recvs.append(barrier)
        start = time.monotonic()
        delay = 1e-5
        while not barrier.Test():
            self._service()
            if time.monotonic() - start > self.timeout:
                self._timeout(self._round, "not every process closed")
            time.sleep(delay)
            delay = min(self.poll_s, delay * 2)
        self._recvs = [q for q in self._recvs if q is not barrier]
        if len(set(counts.tolist())) > 1:
            per_rank = dict(enumerate(counts.tolist()))
            raise PartialCollectiveError(
                f"rank {self.rank}: call-count mismatch, ranks {_odd_ones(per_rank)} made a different number "
                f"of calls than the others (calls per rank {per_rank}); every process must call the same number "
                "of times"
            )
        # After the barrier every process has finished every round: retire the
        # remaining (duplicate) activations and stop listening.
        end = time.monotonic() + min(1.0, self.timeout)
        while self._comm.Iprobe(source=MPI.ANY_SOURCE, tag=_TAG_ACT) and time.monotonic() < end:
            self._service()
        for name in ("_act_req", "_ping_req", "_verdict_req"):
            q = getattr(self, name)
            if q is None or q.Test():
                continue
            q.Cancel()
            q.Wait()
        end = time.monotonic() + self.timeout
        while self._sends:  # pongs to a peer's probe, the last duplicates
            self._sends = [(q, b) for q, b in self._sends if not q.Test()]
            if self._sends and time.monotonic() > end:
                raise PartialCollectiveError(f"rank {self.rank}: {len(self._sends)} sends did not complete at close")
            time.sleep(1e-4)

    def _abandon(self):
        """After an error: cancel whatever can be cancelled, without waiting on peers."""
        MPI = _import_mpi()
        for q in [self._act_req, self._ping_req, self._verdict_req, *self._recvs]:
            if q is None or q == MPI.REQUEST_NULL:
                continue
            try:
                if not q.Test():
                    q.Cancel()
                    q.Test()
            except Exception:
                pass
