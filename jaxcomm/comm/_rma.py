"""One-sided (MPI RMA) neighbour exchange for EventGraD, with mpi4py.

EventGraD Sec. 6: a sender decides locally when a tensor is sent, so its
neighbours cannot know when to post a receive; the exchange must be one-sided.
Every worker exposes an RMA window holding its copies of the neighbours'
tensors, one *slot* per neighbour permutation ``k`` of the topology (slot ``k``
of worker ``i`` holds the tensors of ``src_k(i)``). When a tensor fires, its
owner writes it into the matching slot of each neighbour with ``MPI_Put`` inside
a passive-target ``MPI_LOCK_SHARED`` epoch on that neighbour; nothing is posted
at the receiver and nothing is sent for quiet tensors. With top-K the put uses an
indexed target datatype built from the top-K indices, so the values land
directly at their positions: the window always holds the full last received copy
(values + indices cross the wire: ``2K`` of the tensor).

Race-free reads (the reference C++ reads its window with plain loads while
neighbours may be writing it: a data race that can mix two versions of a tensor).
Here a worker reads its own window only while holding ``MPI_LOCK_EXCLUSIVE`` on
itself. Writers hold ``MPI_LOCK_SHARED`` (their slots are disjoint), so by MPI's
lock semantics no put epoch overlaps a read: a read sees each sender's epoch
entirely or not at all, and a put is complete at the target once ``MPI_Win_unlock``
returns at the origin. The window is allocated with ``MPI_Win_allocate``; in the
``MPI_WIN_SEPARATE`` memory model the lock/unlock on self also synchronises the
public and private copies.

Where the MPI calls run: *outside* jit, between two jitted halves of the step
(:meth:`EventGrad.prepare` -> puts/read on host NumPy arrays ->
:meth:`EventGrad.finish`). A host callback inside jit was rejected: RMA epochs
would run on XLA's callback thread with ordering constraints invisible to the
compiler, a blocked lock would stall the XLA executor, and on CPU the
device-to-host copies the split needs are zero-copy anyway.

Two modes. Asynchronous (default): no synchronisation besides the locks, the
real event-driven execution (a fast worker may read an older copy, as in the
paper). ``lockstep=True``: a barrier before the puts and one after, so the copies
read at iteration ``k`` are exactly those sent at ``k``; then the run is
deterministic and equals :meth:`EventGrad.step` on a mesh (used by the tests).

The window is freed by :meth:`RMAExchange.free` (collective), also on ``with`` exit.

Faults. Every barrier (``free``, the two of ``lockstep``) is a non-blocking
barrier polled up to ``timeout`` seconds. Each worker publishes, in a second
small window, how many barriers it has entered and how many exchanges it has
done; after a timeout a worker reads every worker's counters (passive-target
``MPI_Get``) and raises :class:`RMAExchangeTimeout` naming the workers that have
not reached the barrier (a hung application: its counters stop advancing). In
the asynchronous mode a hung neighbour blocks nothing until ``free``: the others
keep reading its last copy, as EventGraD intends. Construction checks that every
worker passes the same parameter shapes and dtypes, topology size and top-K
setting (``ValueError`` naming the odd workers). With ``abort_on_fault`` a fault
that leaves the ``with`` block aborts the MPI job, since a hung worker would
block ``MPI_Finalize``.
"""

from __future__ import annotations

import time

import jax
import numpy as np

from ._partial_protocol import _abort_job, _close_or_abort

__all__ = ["RMAExchange", "RMAExchangeTimeout"]


class RMAExchangeTimeout(TimeoutError):
    """A barrier of the one-sided exchange waited longer than ``timeout``.

    Attributes:
      rank: the worker that timed out; missing_ranks: the workers that had not
      reached the barrier (hung or dead); detail: human-readable explanation.
    """

    def __init__(self, rank: int, missing_ranks, detail: str):
        self.rank = int(rank)
        self.missing_ranks = tuple(sorted(int(r) for r in missing_ranks))
        self.detail = detail
        missing = list(self.missing_ranks)
        super().__init__(f"one-sided exchange timed out on rank {self.rank}; missing ranks {missing}: {detail}")


def _odd_ones(values: list) -> list:
    """Indices whose value differs from the most common one (ties: the lowest rank's value wins)."""
    counts = {v: values.count(v) for v in values}
    common = max(counts, key=lambda v: (counts[v], -values.index(v)))
    return [i for i, v in enumerate(values) if v != common]


def _common_index(values: list) -> int:
    counts = {v: values.count(v) for v in values}
    common = max(counts, key=lambda v: (counts[v], -values.index(v)))
    return values.index(common)


def _mpi():
    try:
        from mpi4py import MPI
    except ImportError as e:  # pragma: no cover - depends on the environment
        raise ImportError("the one-sided exchange needs mpi4py: pip install 'jaxcomm[mpi]'") from e
    return MPI


class RMAExchange:
    """The RMA windows of one worker (MPI rank) for EventGraD's one-sided exchange.

    Args:
      algorithm: an :class:`~jaxcomm.algorithms.EventGrad` (its topology and top-K setting).
      params: this worker's initial parameters (the window slots start as copies of them,
        matching :meth:`EventGrad.init`; all workers must start from the same initialisation).
      comm: an ``mpi4py`` intracommunicator (default ``COMM_WORLD``); rank ``i`` is worker ``i``.
      lockstep: synchronise every exchange with two barriers (deterministic; see module doc).
      timeout: seconds a barrier (``lockstep``, ``free``) waits before raising
        :class:`RMAExchangeTimeout` naming the workers that did not arrive (default 60).
      abort_on_fault: when such a fault leaves the ``with`` block, print it on stderr
        and ``MPI_Abort`` the job (default ``True``).
      shared_memory: ``True`` (default): the window is ``MPI_Win_allocate``'d, and Open MPI maps
        the windows of processes on one host into shared memory, where a put is a plain copy.
        ``False``: ``MPI_Win_create`` on ``MPI_Alloc_mem`` memory, so every put goes through the
        transport (TCP on :func:`jaxcomm.netem.launch`'s emulated link, which then counts and
        shapes it).

    Attributes (cumulative counters of this worker):
      puts: ``MPI_Put`` calls (one per fired tensor per neighbour: the paper's messages).
      bytes_put: payload bytes written into neighbours' windows.
      exchange_seconds: wall time spent in :meth:`exchange`.

    Raises:
      ValueError: the topology does not match the communicator size, or the workers
        disagree on parameter shapes/dtypes, topology or top-K (naming the odd ones).
    """

    def __init__(
        self,
        algorithm,
        params,
        *,
        comm=None,
        lockstep: bool = False,
        timeout: float = 60.0,
        abort_on_fault: bool = True,
        shared_memory: bool = True,
    ):
        if isinstance(timeout, bool) or not isinstance(timeout, (int, float)) or not timeout > 0 or timeout == np.inf:
            raise ValueError(f"timeout must be a positive number of seconds; got {timeout!r}")
        self.timeout = float(timeout)
        self.abort_on_fault = bool(abort_on_fault)
        MPI = _mpi()
        self._MPI = MPI
        self.comm = MPI.COMM_WORLD if comm is None else comm
        self.rank = self.comm.Get_rank()
        self.topology = algorithm.topology
        self.topology.check_workers(self.comm.Get_size(), where="the MPI communicator")
        self.topk = algorithm.topk
        self.lockstep = bool(lockstep)
        leaves = [np.asarray(x) for x in jax.tree.leaves(params)]
        for x in leaves:
            if x.dtype not in (np.float32, np.float64):
                raise TypeError(f"params leaves must be float32 or float64 for MPI puts; got {x.dtype}")
        self.shapes = [x.shape for x in leaves]
        self.dtypes = [x.dtype for x in leaves]
        desc = (
            f"leaves={[(tuple(x.shape), x.dtype.str) for x in leaves]} workers={self.topology.num_workers} "
            f"slots={self.topology.num_permutations} topk={self.topk!r} lockstep={self.lockstep}"
        )
        descs = self.comm.allgather(desc)
        odd = _odd_ones(descs)
        if odd:
            raise ValueError(
                f"RMAExchange: ranks {odd} constructed the exchange with different parameter shapes/dtypes, "
                f"topology, top-K or lockstep than the others; most workers: {descs[_common_index(descs)]}; "
                + "; ".join(f"rank {r}: {descs[r]}" for r in odd)
            )
        self.nbytes = [x.nbytes for x in leaves]
        self.slot_bytes = int(sum(self.nbytes))
        self.num_slots = self.topology.num_permutations
        self.leaf_offsets = np.concatenate([[0], np.cumsum(self.nbytes)[:-1]]).astype(np.int64)
        size = max(1, self.num_slots * self.slot_bytes)
        self._mem = None if shared_memory else MPI.Alloc_mem(size)
        if self._mem is None:
            self.win = MPI.Win.Allocate(size, disp_unit=1, comm=self.comm)
        else:
            self.win = MPI.Win.Create(self._mem, disp_unit=1, comm=self.comm)
        self._buf = np.frombuffer(self.win.tomemory(), dtype=np.uint8)[: self.num_slots * self.slot_bytes]
        # Outgoing real edges: (slot k at the destination, destination rank).
        send_mask = self.topology.send_mask()
        self.out_edges = [
            (k, int(self.topology.destinations(k)[self.rank])) for k in range(self.num_slots) if send_mask[k, self.rank]
        ]
        # Progress counters read after a barrier timeout: [barriers entered, exchanges done].
        self._pwin = MPI.Win.Allocate(16, disp_unit=8, comm=self.comm)
        self._progress = np.frombuffer(self._pwin.tomemory(), dtype=np.int64)[:2]
        self._progress[...] = 0
        self._barriers = 0
        self._exchanges = 0
        self.puts = 0
        self.bytes_put = 0
        self.exchange_seconds = 0.0
        self._freed = False
        self.win.Lock(self.rank, MPI.LOCK_EXCLUSIVE)
        for k in range(self.num_slots):
            for l, x in enumerate(leaves):
                self._view(k, l)[...] = x
        self.win.Unlock(self.rank)
        self._barrier("construction")

    # ------------------------------------------------------------------ #
    def _view(self, k: int, l: int) -> np.ndarray:
        start = k * self.slot_bytes + int(self.leaf_offsets[l])
        raw = self._buf[start : start + self.nbytes[l]]
        return raw.view(self.dtypes[l]).reshape(self.shapes[l])

    def _mpi_type(self, dtype):
        return self._MPI.FLOAT if dtype == np.float32 else self._MPI.DOUBLE

    def exchange(self, fire, payload) -> list:
        """Put the fired tensors into the neighbours' windows, then read this worker's window.

        Args:
          fire: per leaf ``bool``: whether the tensor fired (from :meth:`EventGrad.prepare`).
          payload: per leaf the tensor, or with top-K ``(values [k], indices int32 [k])``.

        Returns:
          per leaf a NumPy ``[K, *shape]`` array: the last received copy in each slot.
        """
        MPI = self._MPI
        if self._freed:
            raise ValueError("the RMA window has been freed")
        t0 = time.perf_counter()
        fire = [bool(f) for f in fire]
        if self.lockstep:
            self._barrier("lockstep, before the puts")  # every worker has read the previous iteration's copies
        fired = [l for l, f in enumerate(fire) if f]
        if fired:
            msgs = []
            for l in fired:
                if self.topk is None:
                    data = np.ascontiguousarray(np.asarray(payload[l], dtype=self.dtypes[l]))
                    msgs.append((l, data, None))
                else:
                    values, indices = payload[l]
                    values = np.ascontiguousarray(np.asarray(values, dtype=self.dtypes[l]))
                    indices = np.asarray(indices, dtype=np.int64)
                    mtype = self._mpi_type(self.dtypes[l])
                    target_type = mtype.Create_indexed_block(1, indices.tolist()).Commit()
                    msgs.append((l, values, target_type))
            for k, dst in self.out_edges:
                self.win.Lock(dst, MPI.LOCK_SHARED)
                for l, data, target_type in msgs:
                    disp = k * self.slot_bytes + int(self.leaf_offsets[l])
                    if target_type is None:
                        self.win.Put([data.view(np.uint8), MPI.BYTE], dst, target=(disp, data.nbytes, MPI.BYTE))
                        self.bytes_put += data.nbytes
                    else:
                        self.win.Put([data, self._mpi_type(data.dtype)], dst, target=(disp, 1, target_type))
                        self.bytes_put += data.nbytes * 2  # values + indices (int32-sized) on the wire
                    self.puts += 1
                self.win.Unlock(dst)
            for _, _, target_type in msgs:
                if target_type is not None:
                    target_type.Free()
        if self.lockstep:
            self._barrier("lockstep, after the puts")  # every put of this iteration is complete at its target
        self.win.Lock(self.rank, MPI.LOCK_EXCLUSIVE)
        out = [
            np.stack([self._view(k, l).copy() for k in range(self.num_slots)])
            if self.num_slots
            else np.zeros((0,) + self.shapes[l], self.dtypes[l])
            for l in range(len(self.shapes))
        ]
        self.win.Unlock(self.rank)
        self._exchanges += 1
        self._publish()
        self.exchange_seconds += time.perf_counter() - t0
        return out

    def free(self) -> None:
        """Free the windows (collective: every rank must call it; idempotent).

        Raises :class:`RMAExchangeTimeout` naming the workers that do not call it
        within ``timeout`` (the windows then stay allocated)."""
        if not self._freed:
            self._barrier("free")
            self.win.Free()
            self._pwin.Free()
            if self._mem is not None:
                self._MPI.Free_mem(self._mem)
            self._freed = True

    def __enter__(self):
        return self

    def __exit__(self, exc_type, exc, tb):
        if exc is None:
            _close_or_abort(self.free, RMAExchangeTimeout, self._fault_exit)
        elif isinstance(exc, RMAExchangeTimeout):
            self._fault_exit(exc)
        else:
            self.free()
        return False

    # ------------------------------------------------------------------ #
    def _publish(self) -> None:
        MPI = self._MPI
        self._pwin.Lock(self.rank, MPI.LOCK_EXCLUSIVE)
        self._progress[0] = self._barriers
        self._progress[1] = self._exchanges
        self._pwin.Unlock(self.rank)

    def _barrier(self, what: str) -> None:
        """A barrier bounded by ``timeout``; on timeout name who has not entered it."""
        self._barriers += 1
        self._publish()
        req = self.comm.Ibarrier()
        start = time.monotonic()
        delay = 1e-5
        while not req.Test():
            if time.monotonic() - start > self.timeout:
                raise self._diagnose(what)
            time.sleep(delay)
            delay = min(1e-3, delay * 2)

    def _diagnose(self, what: str) -> RMAExchangeTimeout:
        MPI = self._MPI
        size = self.comm.Get_size()
        seen = {}
        for q in range(size):
            buf = np.zeros(2, np.int64)
            self._pwin.Lock(q, MPI.LOCK_SHARED)
            self._pwin.Get(buf, q, target=(0, 2, MPI.INT64_T))
            self._pwin.Unlock(q)
            seen[q] = (int(buf[0]), int(buf[1]))
        missing = [q for q in range(size) if seen[q][0] < self._barriers]
        where = ", ".join(f"rank {q}: {seen[q][0]} barriers, {seen[q][1]} exchanges" for q in missing)
        return RMAExchangeTimeout(
            self.rank,
            missing,
            f"ranks {missing} did not reach barrier {self._barriers} ({what}) within {self.timeout:g} s "
            f"(hung or dead; their counters: {where}; this rank: {self._exchanges} exchanges)",
        )

    def _fault_exit(self, err: BaseException) -> None:
        if self.abort_on_fault and self.comm.Get_size() > 1:
            _abort_job(self.comm, self.rank, err)
