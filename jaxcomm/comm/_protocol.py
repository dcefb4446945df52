"""The communicator protocol: the collectives every algorithm is written against.

Two backends implement it: :class:`~jaxcomm.comm.MeshAxis` (a named axis, valid
inside ``jax.shard_map`` and inside ``jax.vmap(axis_name=...)``) and
:class:`~jaxcomm.comm.MPIComm` (mpi4jax collectives inside jit, one device per
process). All methods act on pytrees and are traceable.

A communicator *declares* the collectives it serves in ``capabilities``, a
``frozenset`` of names from one fixed vocabulary (:data:`CAPABILITIES`):
:data:`SUM`, :data:`ALL_GATHER`, :data:`REDUCE_SCATTER`, :data:`ALL_TO_ALL`,
:data:`BROADCAST`, :data:`PERMUTE`. Each name is also the method that serves it
(``mean`` comes with :data:`SUM`). Code that needs a collective states so with
:func:`require`, which raises a ``ValueError`` naming the communicator, the
missing collective and what needed it; nothing probes for methods.

A communicator that runs one worker per process (the ``comm`` of
:class:`~jaxcomm.train.Trainer`) also has the *host-side* members of
:data:`HOST_MEMBERS`, used outside jit: ``rank`` (this process's rank, a Python
``int``), ``agree_min(value)`` (the smallest ``int`` over the processes, e.g. the
checkpoint step they all resume from) and ``watchdog`` (a watchdog factory, or
``None``: declared not served). :func:`require_host` checks them; a backend that
lacks one is refused by name, never run without checkpoint agreement.

Which communicator a transform uses is decided in one place, :func:`resolve`:
an explicit ``comm=``, else ``axis_name=`` (a :class:`~jaxcomm.comm.MeshAxis`),
else the ambient communicator of :func:`use` (looked up at trace time), else a
``ValueError`` at trace time.
"""

from __future__ import annotations

import contextlib
import contextvars
import inspect
from collections.abc import Iterable, Iterator, Sequence
from typing import Any, Protocol

import jax

__all__ = [
    "ALL_GATHER",
    "ALL_TO_ALL",
    "BROADCAST",
    "CAPABILITIES",
    "Communicator",
    "HOST_MEMBERS",
    "PERMUTE",
    "REDUCE_SCATTER",
    "SUM",
    "capabilities_of",
    "current",
    "is_communicator",
    "require",
    "require_host",
    "resolve",
    "serves",
    "use",
]

PyTree = Any

SUM = "sum"
"""``sum(tree)`` (allreduce) and ``mean(tree)``."""
ALL_GATHER = "all_gather"
"""``all_gather(tree)``: every worker's value stacked on a new leading axis."""
REDUCE_SCATTER = "reduce_scatter"
"""``reduce_scatter(tree)``: ``(n, *s)`` chunks in, this worker's summed chunk ``(*s)`` out."""
ALL_TO_ALL = "all_to_all"
"""``all_to_all(tree)``: ``(n, *s)`` in, row ``j`` goes to worker ``j``; ``(n, *s)`` out."""
BROADCAST = "broadcast"
"""``broadcast(tree, root)``: ``root``'s value on every worker."""
PERMUTE = "permute"
"""``permute(tree, perm)``: send along ``(source, destination)`` pairs."""

CAPABILITIES: frozenset[str] = frozenset({SUM, ALL_GATHER, REDUCE_SCATTER, ALL_TO_ALL, BROADCAST, PERMUTE})
"""The vocabulary of collectives a communicator can declare in ``capabilities``."""

# Members every communicator has, whatever it declares.
_CORE = ("size", "index", "varying")

HOST_MEMBERS = ("rank", "agree_min", "watchdog")
"""The host-side members a communicator needs to run one worker per process (see :func:`require_host`)."""
# The methods that serve each capability.
_METHODS = {
    SUM: (SUM, "mean"),
    ALL_GATHER: (ALL_GATHER,),
    REDUCE_SCATTER: (REDUCE_SCATTER,),
    ALL_TO_ALL: (ALL_TO_ALL,),
    BROADCAST: (BROADCAST,),
    PERMUTE: (PERMUTE,),
}


class Communicator(Protocol):
    """Collectives over a group of ``size`` workers, each with a rank ``index()``.

    A structural protocol: a communicator need not subclass it, but it must
    declare ``capabilities`` (checked by :func:`is_communicator`). All methods
    are pure and traceable; inputs are per-worker values, ``n = size``.

    Always present:
      capabilities: ``frozenset`` of names from :data:`CAPABILITIES`, the
        collectives this communicator serves (a class attribute, or a property
        where it depends on the instance).
      size: the number of workers ``n``, a static Python ``int`` (valid where
        the group is bound, e.g. inside the ``vmap``/``shard_map`` of a mesh axis).
      index(): this worker's rank, a traced int32 scalar in ``[0, n)``. ``size``
        and ``index()`` are the pair ``(n, rank)``; a backend whose rank is known
        on the host may also offer it as a Python ``int`` (``MPIComm.rank``).
      varying(tree): mark replicated values as per-worker (the shard_map pitfall:
        ``jax.grad`` of replicated parameters would otherwise sum the gradient
        over the axis and bypass compression). Identity where it does not apply.

    Served when declared (capability: methods):
      ``SUM``: ``sum(tree)`` -- element-wise sum over workers (allreduce);
        ``mean(tree)`` -- ``sum(tree) / n`` in each leaf's dtype.
      ``ALL_GATHER``: ``all_gather(tree)`` -- a leaf of shape ``s`` becomes
        ``(n, *s)``, worker ``i``'s value in row ``i``.
      ``REDUCE_SCATTER``: ``reduce_scatter(tree)`` -- every leaf has shape
        ``(n, *s)``: row ``j`` is this worker's contribution to the chunk owned
        by worker ``j``. Worker ``j`` receives ``sum_w x_w[j]``, shape ``(*s)``.
        16-bit floats are summed in float32 and cast back; ``bool`` sums are a
        logical or. A flat vector of length ``n * c`` is ``x.reshape(n, c)``.
      ``ALL_TO_ALL``: ``all_to_all(tree)`` -- every leaf has shape ``(n, *s)``;
        row ``j`` is sent to worker ``j``; the result has shape ``(n, *s)`` and
        row ``i`` is what worker ``i`` sent here (``out_j[i] = x_i[j]``).
        ``reduce_scatter(x)`` equals ``all_to_all(x).sum(0)``, and a compressed
        reduce-scatter is ``all_to_all`` of per-owner payloads.
      ``BROADCAST``: ``broadcast(tree, root)`` -- ``root``'s value on every worker.
      ``PERMUTE``: ``permute(tree, perm)`` -- ``perm`` is a list of
        ``(source, destination)`` pairs with distinct sources and distinct
        destinations; a worker receives the value of the source that names it
        (zeros if none).

    Host-side (:data:`HOST_MEMBERS`, outside jit; needed by the trainer's
    ``comm``, checked by :func:`require_host`):
      rank: this process's rank among the processes that run the program, a
        Python ``int`` (``0`` where one process drives every worker).
      agree_min(value): collective over those processes: the smallest of their
        ``value`` (a Python ``int``), returned on every process; ``value``
        itself where there is one process.
      watchdog: ``watchdog(timeout_s, **kwargs)``, a context manager whose
        ``watch(step)`` guards a jitted step against a process that holds it
        up (:class:`~jaxcomm.comm.MPIWatchdog`), or ``None``: the communicator
        declares that it serves none.
    """

    @property
    def capabilities(self) -> frozenset[str]: ...

    @property
    def size(self) -> int: ...

    def index(self) -> jax.Array: ...

    def varying(self, tree: PyTree) -> PyTree: ...

    def sum(self, tree: PyTree) -> PyTree: ...

    def mean(self, tree: PyTree) -> PyTree: ...

    def all_gather(self, tree: PyTree) -> PyTree: ...

    def reduce_scatter(self, tree: PyTree) -> PyTree: ...

    def all_to_all(self, tree: PyTree) -> PyTree: ...

    def broadcast(self, tree: PyTree, root: int = 0) -> PyTree: ...

    def permute(self, tree: PyTree, perm: Sequence[tuple[int, int]]) -> PyTree: ...

    @property
    def rank(self) -> int: ...

    def agree_min(self, value: int) -> int: ...

    watchdog: Any


def require_host(comm, for_what: str = "this use"):
    """Return ``comm`` if it has every host-side member (:data:`HOST_MEMBERS`); else ``TypeError``.

    A communicator declares the watchdog it does not serve with ``watchdog =
    None``; one that lacks ``rank``, ``agree_min`` or ``watchdog`` altogether is
    refused, naming what it lacks and ``for_what`` needed it, so a new backend
    cannot silently skip the agreement on a checkpoint step.
    """
    missing = [m for m in HOST_MEMBERS if not hasattr(comm, m)]
    if missing:
        raise TypeError(
            f"{for_what} needs a communicator with the host-side members {list(HOST_MEMBERS)} (rank, "
            f"agree_min(int), and watchdog or watchdog = None); {comm!r} lacks {missing}"
        )
    return comm


def _host_int(value, name: str = "value") -> int:
    """``value`` as a Python ``int`` for :meth:`Communicator.agree_min` (``TypeError`` otherwise)."""
    import numpy as np

    if isinstance(value, (bool, np.bool_)) or not isinstance(value, (int, np.integer)):
        raise TypeError(f"{name} must be an int; got {value!r}")
    return int(value)


def _check_perm(perm: Iterable[tuple[int, int]], n: int) -> list[tuple[int, int]]:
    """``perm`` as a list of ``(source, destination)`` ``int`` pairs for ``permute`` among ``n`` workers.

    Raises:
      ValueError: a pair names a worker outside ``[0, n)``, or two pairs share a source or a
        destination.
    """
    pairs = [(int(s), int(d)) for s, d in perm]
    for s, d in pairs:
        if not (0 <= s < n and 0 <= d < n):
            raise ValueError(f"permutation pair {(s, d)} is out of range for {n} workers")
    srcs = [s for s, _ in pairs]
    dsts = [d for _, d in pairs]
    if len(set(srcs)) != len(srcs) or len(set(dsts)) != len(dsts):
        raise ValueError(f"perm must have distinct sources and distinct destinations; got {pairs}")
    return pairs


def _check_declared(caps, owner) -> frozenset[str]:
    if not isinstance(caps, frozenset):
        raise TypeError(f"{owner}.capabilities must be a frozenset of collective names; got {caps!r}")
    unknown = caps - CAPABILITIES
    if unknown:
        raise TypeError(
            f"{owner}.capabilities names unknown collectives {sorted(unknown)}; "
            f"the vocabulary is {sorted(CAPABILITIES)}"
        )
    return caps


def is_communicator(obj) -> bool:
    """Whether ``obj`` declares the :class:`Communicator` protocol.

    True when ``obj``'s class declares ``capabilities`` -- a ``frozenset`` of
    names from :data:`CAPABILITIES` (or a property, for a communicator whose
    capabilities depend on the instance) -- defines the core members ``size``,
    ``index`` and ``varying``, and defines the methods of every capability it
    declares. Checked on the class, so no property is evaluated outside a bound
    axis.
    """
    cls = type(obj)
    caps = inspect.getattr_static(cls, "capabilities", None)
    if isinstance(caps, property):
        declared: frozenset = frozenset()
    elif isinstance(caps, frozenset) and caps <= CAPABILITIES:
        declared = caps
    else:
        return False
    needed = list(_CORE) + [m for c in declared for m in _METHODS[c]]
    return all(hasattr(cls, m) for m in needed)


def capabilities_of(comm) -> frozenset[str]:
    """The collectives ``comm`` declares it serves (``TypeError`` if it declares none)."""
    caps = getattr(comm, "capabilities", None)
    if caps is None:
        raise TypeError(
            f"{comm!r} is not a jaxcomm communicator: it declares no capabilities "
            f"(a frozenset of names from jaxcomm.comm.CAPABILITIES)"
        )
    return _check_declared(caps, type(comm).__name__)


def serves(comm, capability: str) -> bool:
    """Whether ``comm`` declares ``capability`` (a name from :data:`CAPABILITIES`)."""
    if capability not in CAPABILITIES:
        raise ValueError(f"unknown collective {capability!r}; the vocabulary is {sorted(CAPABILITIES)}")
    return capability in capabilities_of(comm)


def require(comm, *capabilities: str, for_what: str | None = None):
    """Return ``comm`` if it serves every collective in ``capabilities``; else ``ValueError``.

    The one check code makes before using a collective, e.g.
    ``require(comm, REDUCE_SCATTER, for_what="compressed_mean strategy 'reduce_scatter'")``.
    On the ambient proxy of :func:`resolve` the check reads the ambient
    communicator, so call it at trace time there.

    Args:
      comm: a communicator.
      *capabilities: names from :data:`CAPABILITIES`.
      for_what: what needs them, for the error message.
    Raises:
      ValueError: a name is not in the vocabulary, or ``comm`` does not serve it
        (the message names the communicator, the collective and ``for_what``).
      TypeError: ``comm`` declares no capabilities.
    """
    for c in capabilities:
        if c not in CAPABILITIES:
            raise ValueError(f"unknown collective {c!r}; the vocabulary is {sorted(CAPABILITIES)}")
    caps = capabilities_of(comm)
    missing = [c for c in capabilities if c not in caps]
    if missing:
        who = f"{for_what} needs" if for_what else "needs"
        raise ValueError(
            f"{who} the collective{'s' if len(missing) > 1 else ''} {', '.join(map(repr, missing))}, "
            f"which communicator {comm!r} does not serve (it serves: {', '.join(sorted(caps)) or 'nothing'})"
        )
    return comm


_CURRENT: contextvars.ContextVar = contextvars.ContextVar("jaxcomm_communicator", default=None)


def _check_communicator(comm) -> None:
    if not is_communicator(comm):
        raise TypeError(
            f"comm must implement jaxcomm.comm.Communicator (declare capabilities, a frozenset of "
            f"names from jaxcomm.comm.CAPABILITIES, and define their methods); got {type(comm).__name__}"
        )


@contextlib.contextmanager
def use(comm: Communicator) -> Iterator[Communicator]:
    """Make ``comm`` the ambient communicator while tracing a step.

    Transforms built without ``axis_name``/``comm`` (e.g. ``compressed_mean(c)``)
    communicate through it, so the same optimizer runs on a mesh axis or over MPI
    depending on the launcher: the trainer wraps its step in ``use(...)``.
    """
    _check_communicator(comm)
    token = _CURRENT.set(comm)
    try:
        yield comm
    finally:
        _CURRENT.reset(token)


def current() -> Communicator:
    """The ambient communicator set by :func:`use`; ``ValueError`` if none is set."""
    comm = _CURRENT.get()
    if comm is None:
        raise ValueError(
            "no communicator: pass axis_name=... or comm=..., or run inside jaxcomm.comm.use(...) "
            "(the trainer does this for you)"
        )
    return comm


class _Ambient:
    """A communicator that forwards every call to :func:`current` at trace time.

    With ``needs``, every lookup also checks (:func:`require`) that the ambient
    communicator serves those collectives.
    """

    def __init__(self, needs: tuple = (), for_what: str | None = None):
        self._needs = tuple(needs)
        self._for_what = for_what

    def __repr__(self):
        return "AmbientCommunicator()"

    def _comm(self):
        comm = current()
        if self._needs:
            require(comm, *self._needs, for_what=self._for_what)
        return comm

    @property
    def capabilities(self) -> frozenset[str]:
        return capabilities_of(current())

    @property
    def size(self) -> int:
        return self._comm().size

    def index(self):
        return self._comm().index()

    def varying(self, tree):
        return self._comm().varying(tree)

    def sum(self, tree):
        return self._comm().sum(tree)

    def mean(self, tree):
        return self._comm().mean(tree)

    def all_gather(self, tree):
        return self._comm().all_gather(tree)

    def reduce_scatter(self, tree):
        return self._comm().reduce_scatter(tree)

    def all_to_all(self, tree):
        return self._comm().all_to_all(tree)

    def broadcast(self, tree, root: int = 0):
        return self._comm().broadcast(tree, root)

    def permute(self, tree, perm):
        return self._comm().permute(tree, perm)

    def __getattr__(self, name):
        # Backend-specific extras (e.g. MPIComm attributes) of the ambient communicator.
        if name.startswith("_"):
            raise AttributeError(name)
        return getattr(current(), name)


def resolve(
    axis_name: str | None = None,
    comm: Communicator | None = None,
    *,
    needs: Iterable[str] = (),
    for_what: str | None = None,
) -> Communicator:
    """The communicator a transform uses: the one place that decides it.

    Order: an explicit ``comm`` (any :class:`Communicator`); else ``axis_name``
    (a :class:`~jaxcomm.comm.MeshAxis` over that axis); else a proxy for the
    ambient communicator of :func:`use`, looked up when the step is traced
    (``ValueError`` then if none is set). Giving both ``comm`` and
    ``axis_name`` is an error.

    Args:
      axis_name: a mesh axis name.
      comm: a communicator.
      needs: names from :data:`CAPABILITIES` the caller will use; checked with
        :func:`require` now for ``comm``/``axis_name``, and at every trace-time
        lookup for the ambient communicator.
      for_what: what needs them, for :func:`require`'s message.
    Raises:
      ValueError: both given; a needed collective is not served.
      TypeError: ``comm`` does not implement :class:`Communicator`.
    """
    needs = tuple(needs)
    for c in needs:
        if c not in CAPABILITIES:
            raise ValueError(f"unknown collective {c!r}; the vocabulary is {sorted(CAPABILITIES)}")
    if axis_name is not None and comm is not None:
        raise ValueError("pass at most one of axis_name=... (a mesh axis) or comm=... (a Communicator)")
    if comm is not None:
        _check_communicator(comm)
        return require(comm, *needs, for_what=for_what)
    if axis_name is not None:
        from ._mesh import MeshAxis

        return require(MeshAxis(axis_name), *needs, for_what=for_what)
    return _Ambient(needs, for_what)
