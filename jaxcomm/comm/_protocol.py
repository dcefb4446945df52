"""The communicator protocol: the collectives every algorithm is written against.

Two backends implement it: :class:`~jaxcomm.comm.MeshAxis` (a named axis, valid
inside ``jax.shard_map`` and inside ``jax.vmap(axis_name=...)``) and
:class:`~jaxcomm.comm.MPIComm` (mpi4jax collectives inside jit, one device per
process). All methods act on pytrees and are traceable.
"""

from __future__ import annotations

import contextlib
import contextvars
from typing import Any, Iterator, Protocol, Sequence, runtime_checkable

import jax

__all__ = ["Communicator", "resolve", "use", "current", "is_communicator"]

PyTree = Any


@runtime_checkable
class Communicator(Protocol):
    """Collectives over a group of ``size`` workers (static), each with an ``index()``.

    Methods (all pure and traceable; inputs are per-worker values):
      size: number of workers (Python ``int``; valid where the group is bound).
      index(): this worker's rank, int32 scalar in ``[0, size)``.
      sum(tree): element-wise sum over workers (allreduce).
      mean(tree): ``sum(tree) / size``.
      all_gather(tree): every worker's value stacked on a new leading axis of length ``size``.
      broadcast(tree, root): ``root``'s value on every worker.
      permute(tree, perm): ``perm`` is a list of ``(source, destination)`` pairs;
        a worker receives the value of the source that names it (zeros if none).
      varying(tree): mark replicated values as per-worker (the shard_map pitfall:
        ``jax.grad`` of replicated parameters would otherwise sum the gradient over
        the axis and bypass compression). Identity where it does not apply.
    """

    @property
    def size(self) -> int: ...

    def index(self) -> jax.Array: ...

    def sum(self, tree: PyTree) -> PyTree: ...

    def mean(self, tree: PyTree) -> PyTree: ...

    def all_gather(self, tree: PyTree) -> PyTree: ...

    def broadcast(self, tree: PyTree, root: int = 0) -> PyTree: ...

    def permute(self, tree: PyTree, perm: Sequence[tuple[int, int]]) -> PyTree: ...

    def varying(self, tree: PyTree) -> PyTree: ...


_METHODS = ("size", "index", "sum", "mean", "all_gather", "broadcast", "permute", "varying")


def is_communicator(obj) -> bool:
    """Whether ``obj``'s class implements every :class:`Communicator` member.

    Checked on the class, so no property (``size``) is evaluated outside a bound axis.
    """
    return all(hasattr(type(obj), m) for m in _METHODS)


_CURRENT: contextvars.ContextVar = contextvars.ContextVar("jaxcomm_communicator", default=None)


@contextlib.contextmanager
def use(comm: "Communicator") -> Iterator["Communicator"]:
    """Make ``comm`` the ambient communicator while tracing a step.

    Transforms built without ``axis_name``/``comm`` (e.g. ``compressed_mean(c)``)
    communicate through it, so the same optimizer runs on a mesh axis or over MPI
    depending on the launcher: the trainer wraps its step in ``use(...)``.
    """
    if not is_communicator(comm):
        raise TypeError(f"comm must implement jaxcomm.comm.Communicator; got {type(comm).__name__}")
    token = _CURRENT.set(comm)
    try:
        yield comm
    finally:
        _CURRENT.reset(token)


def current() -> "Communicator":
    """The ambient communicator set by :func:`use`; ``ValueError`` if none is set."""
    comm = _CURRENT.get()
    if comm is None:
        raise ValueError(
            "no communicator: pass axis_name=... or comm=..., or run inside jaxcomm.comm.use(...) "
            "(the trainer does this for you)"
        )
    return comm


class _Ambient:
    """A communicator that forwards every call to :func:`current` at trace time."""

    def __repr__(self):
        return "AmbientCommunicator()"

    @property
    def size(self) -> int:
        return current().size

    def index(self):
        return current().index()

    def sum(self, tree):
        return current().sum(tree)

    def mean(self, tree):
        return current().mean(tree)

    def all_gather(self, tree):
        return current().all_gather(tree)

    def broadcast(self, tree, root: int = 0):
        return current().broadcast(tree, root)

    def permute(self, tree, perm):
        return current().permute(tree, perm)

    def varying(self, tree):
        return current().varying(tree)

    def __getattr__(self, name):
        # Backend-specific extras (e.g. MPIComm attributes) of the ambient communicator.
        return getattr(current(), name)


def resolve(axis_name: str | None = None, comm: Communicator | None = None) -> Communicator:
    """Return the communicator named by ``axis_name`` or ``comm`` (at most one).

    With neither, returns a proxy for the ambient communicator of :func:`use`,
    looked up when the step is traced.

    Raises:
      ValueError: both given.
      TypeError: ``comm`` does not implement :class:`Communicator`.
    """
    if axis_name is not None and comm is not None:
        raise ValueError("pass at most one of axis_name=... (a mesh axis) or comm=... (a Communicator)")
    if axis_name is None and comm is None:
        return _Ambient()
    if comm is not None:
        if not is_communicator(comm):
            raise TypeError(f"comm must implement jaxcomm.comm.Communicator; got {type(comm).__name__}")
        return comm
    from ._mesh import MeshAxis

    return MeshAxis(axis_name)
