"""An exchange that overlaps computation: a mean or a gather over MPI processes, run by a communication thread.

Inside a jitted step, :meth:`AsyncMean.start` hands arrays to the host (``jax.experimental.io_callback``,
ordered), where a background thread runs the MPI collectives on a private duplicate of the
communicator while the process goes on computing; a later step's :meth:`AsyncMean.finish` waits
for that thread and returns the mean. :meth:`AsyncMean.start_gather` and
:meth:`AsyncMean.finish_gather` do the same for an all-gather (every process's arrays, stacked),
the route of a compressed payload that is decompressed and summed after it arrives. The DiLoCo
family uses them to overlap a fragment's outer exchange with the next inner steps
(:func:`jaxcomm.transforms.diloco` with ``overlap=True``).

Arithmetic, per array of ``d`` entries over ``n`` processes:

* float32/float64: ``MPI_Allreduce(SUM)`` (non-blocking, as every collective here), then ``/ n``;
* float16/bfloat16: the 16-bit route of :class:`~jaxcomm.comm.MPIComm`'s ``sum`` done on the host:
  zero-pad to ``n c`` (``c = ⌈d / n⌉``), ``MPI_Alltoall`` of the 16-bit words, a float32 sum of
  the ``n`` chunks at each owner rounded once to 16 bits, ``MPI_Allgather`` of the rounded
  chunks; the mean is that sum in float32 divided by ``n`` (each process sends
  ``2 (n − 1) c`` 16-bit words);
* gather (any dtype, shape ``s``): ``MPI_Allgather`` of the array's bytes; the result is
  ``(n, *s)``, row ``r`` process ``r``'s array, bit for bit.

The thread starts each collective non-blocking (``MPI_Iallreduce``, ``MPI_Ialltoall``,
``MPI_Iallgather``) and waits for it by testing it every ``poll_s`` seconds, sleeping in between.
A blocking MPI call busy-polls (Open MPI spins on its progress engine), so a communication thread
waiting on a slow link would take a core from the computation it is meant to overlap; a sleeping
thread gives it back. The cost is a completion noticed up to ``poll_s`` late.
"""

from __future__ import annotations

import threading
import time
from concurrent.futures import Future, ThreadPoolExecutor

import jax
import jax.numpy as jnp
import numpy as np

__all__ = ["AsyncMean"]

_SIXTEEN = ("float16", "bfloat16")


class AsyncMean:
    """Means of arrays over the processes of an mpi4py communicator, computed by a background thread.

    Every process must start and finish the same tags in the same order (SPMD), as for any
    collective; tags identify exchanges in flight (at most one per tag: a tag started again
    before it was finished, as when training restarts from a fresh state, replaces the one in
    flight, which still completes in the thread and whose result is dropped). The thread runs
    the exchanges one at a time, in the order they were started.

    Args:
      comm: an ``mpi4py.MPI.Comm`` (e.g. ``MPIComm().comm``); a private duplicate is used, so the
        thread's messages never match the step's own collectives.
      poll_s: seconds the thread sleeps between tests of a collective in flight (> 0; default
        0.5 ms). Smaller notices completion sooner and takes more of a core while waiting.
    Raises:
      RuntimeError: MPI was not initialised with ``MPI_THREAD_MULTIPLE`` (mpi4py asks for it by
        default), which a communication thread beside the step's collectives needs.
      TypeError, ValueError: ``poll_s`` not a real number, or not finite and > 0.
    """

    def __init__(self, comm, poll_s: float = 5e-4):
        from .._validate import check_finite_scalar

        self.poll_s = check_finite_scalar(poll_s, "poll_s", positive=True)  # before MPI is touched
        from mpi4py import MPI

        if MPI.Query_thread() < MPI.THREAD_MULTIPLE:
            raise RuntimeError(
                "AsyncMean needs MPI initialised with MPI_THREAD_MULTIPLE (mpi4py's default; check "
                "mpi4py.rc.thread_level), to run collectives in a thread beside the step's own"
            )
        self._MPI = MPI
        self.comm = comm.Dup()
        self.size = int(self.comm.Get_size())
        self._pool = ThreadPoolExecutor(max_workers=1, thread_name_prefix="jaxcomm-async-mean")
        self._jobs: dict[int, Future] = {}
        self._lock = threading.Lock()

    def __repr__(self) -> str:
        return f"AsyncMean(size={self.size}, in_flight={sorted(self._jobs)})"

    # -- host side --------------------------------------------------------- #
    def _submit(self, tag: int, arrays, run=None) -> None:
        copies = [np.array(a, copy=True) for a in arrays]  # the device buffers may be reused
        with self._lock:
            # A tag started again while in flight (training restarted from a fresh state): every process
            # does the same, the old exchange completes in the thread first, and its result is dropped.
            self._jobs[tag] = self._pool.submit(run or self._mean, copies)

    def _collect(self, tag: int) -> list[np.ndarray]:
        with self._lock:
            job = self._jobs.pop(tag, None)
        if job is None:
            raise RuntimeError(f"AsyncMean: exchange {tag} finished without having been started")
        return job.result()

    def _mean(self, arrays: list[np.ndarray]) -> list[np.ndarray]:
        return [self._mean_one(a) for a in arrays]

    def _wait_all(self, requests: list) -> None:
        """Wait for non-blocking collectives, testing them every ``poll_s`` seconds (each test also
        drives MPI's progress) and sleeping in between, so the wait leaves the cores to the step."""
        while not self._MPI.Request.Testall(requests):
            time.sleep(self.poll_s)

    def _mean_one(self, x: np.ndarray) -> np.ndarray:
        MPI, n = self._MPI, self.size
        if x.dtype.name not in _SIXTEEN:
            out = np.empty_like(x)
            self._wait_all([self.comm.Iallreduce(x, out, op=MPI.SUM)])
            return (out / n).astype(np.promote_types(x.dtype, np.float32))
        flat = x.reshape(-1)
        d = flat.shape[0]
        c = -(-d // n)
        words = np.zeros(n * c, np.uint16)
        words[:d] = flat.view(np.uint16)
        received = np.empty_like(words)
        self._wait_all([self.comm.Ialltoall(words, received)])  # chunk j to process j
        mine = received.reshape(n, c).view(x.dtype).astype(np.float32).sum(axis=0).astype(x.dtype)
        gathered = np.empty(n * c, np.uint16)
        self._wait_all([self.comm.Iallgather(mine.view(np.uint16), gathered)])
        total = gathered.view(x.dtype)[:d].astype(np.float32).reshape(x.shape)
        return total / np.float32(n)

    def _gather(self, arrays: list[np.ndarray]) -> list[np.ndarray]:
        flats = [np.ascontiguousarray(x).reshape(-1).view(np.uint8) for x in arrays]
        received = [np.empty(self.size * f.shape[0], np.uint8) for f in flats]
        self._wait_all([self.comm.Iallgather(f, r) for f, r in zip(flats, received)])
        return [r.view(x.dtype).reshape(self.size, *x.shape) for r, x in zip(received, arrays)]

    # -- traced side ------------------------------------------------------- #
    def start(self, tag: int, leaves) -> jax.Array:
        """Begin the mean of ``leaves`` (arrays) under ``tag`` (a Python int); returns an int32 token.

        Traceable; the arrays leave the device when the step runs, and the exchange proceeds in
        the background while later computation runs.
        """
        tag = int(tag)

        def host(*arrays):
            self._submit(tag, arrays)
            return np.zeros((), np.int32)

        from jax.experimental import io_callback

        return io_callback(host, jax.ShapeDtypeStruct((), jnp.int32), *leaves, ordered=True)

    def finish(self, tag: int, like) -> list[jax.Array]:
        """The means of the exchange ``tag``, waiting for it: one array per leaf of ``like``, in
        float32 (float64 for float64 leaves), shaped like it. Traceable."""
        tag = int(tag)
        shapes = tuple(jax.ShapeDtypeStruct(jnp.shape(x), jnp.promote_types(x.dtype, jnp.float32)) for x in like)

        def host():
            return tuple(self._collect(tag))

        from jax.experimental import io_callback

        return list(io_callback(host, shapes, ordered=True))

    def start_gather(self, tag: int, leaves) -> jax.Array:
        """Begin the all-gather of ``leaves`` (arrays of any dtype) under ``tag``; returns an int32
        token. Traceable; as :meth:`start`, the exchange runs in the background."""
        tag = int(tag)

        def host(*arrays):
            self._submit(tag, arrays, self._gather)
            return np.zeros((), np.int32)

        from jax.experimental import io_callback

        return io_callback(host, jax.ShapeDtypeStruct((), jnp.int32), *leaves, ordered=True)

    def finish_gather(self, tag: int, like) -> list[jax.Array]:
        """The gathered arrays of the exchange ``tag``, waiting for it: for each leaf of ``like``
        (shape ``s``, dtype ``t``) an array ``(n, *s)`` of dtype ``t`` whose row ``r`` is process
        ``r``'s. Traceable."""
        tag = int(tag)
        shapes = tuple(jax.ShapeDtypeStruct((self.size, *jnp.shape(x)), x.dtype) for x in like)

        def host():
            return tuple(self._collect(tag))

        from jax.experimental import io_callback

        return list(io_callback(host, shapes, ordered=True))

    def close(self) -> None:
        """Wait for the exchanges in flight, stop the thread and free the duplicate communicator."""
        self._pool.shutdown(wait=True)
        if self.comm != self._MPI.COMM_NULL:
            self.comm.Free()
