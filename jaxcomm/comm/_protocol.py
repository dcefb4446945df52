"""The communicator protocol: the collectives every algorithm is written against.

Two backends implement it: :class:`~jaxcomm.comm.MeshAxis` (a named axis, valid
inside ``jax.shard_map`` and inside ``jax.vmap(axis_name=...)``) and
:class:`~jaxcomm.comm.MPIComm` (mpi4jax collectives inside jit, one device per
process). All methods act on pytrees and are traceable.
"""

from __future__ import annotations

from typing import Any, Protocol, Sequence, runtime_checkable

import jax

__all__ = ["Communicator", "resolve"]

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


def resolve(axis_name: str | None = None, comm: Communicator | None = None) -> Communicator:
    """Return the communicator named by exactly one of ``axis_name`` or ``comm``.

    Raises:
      ValueError: both or neither given.
      TypeError: ``comm`` does not implement :class:`Communicator`.
    """
    if (axis_name is None) == (comm is None):
        raise ValueError("pass exactly one of axis_name=... (a mesh axis) or comm=... (a Communicator)")
    if comm is not None:
        if not isinstance(comm, Communicator):
            raise TypeError(f"comm must implement jaxcomm.comm.Communicator; got {type(comm).__name__}")
        return comm
    from ._mesh import MeshAxis

    return MeshAxis(axis_name)
