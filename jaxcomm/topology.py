"""Communication topologies for decentralized training: mixing matrices and the
neighbour permutations they imply.

A topology over ``n`` workers is a symmetric doubly stochastic mixing matrix
``W`` (Lian et al. 2017, Sec. 3; EventGraD Sec. 3): worker ``i`` replaces its
parameters by ``sum_j W[i, j] x_j``. ``W[i, j] > 0`` for ``i != j`` makes ``j`` a
neighbour of ``i``.

To run the mixing with point-to-point collectives, the off-diagonal support of
``W`` is decomposed into *permutations*: in permutation ``k`` every worker ``i``
receives exactly one value, from ``src_k(i)``, and scales it by
``receive_weights[k, i] = W[i, src_k(i)]``. For circulant graphs (ring,
exponential, complete, torus) the permutations are the shifts; for a user matrix
they come from a bipartite edge colouring with ``max degree`` colours (Koenig's
theorem), completed to full permutations by zero-weight pairs (``receive_mask``
is ``False`` there) because ``jax.lax.ppermute`` under ``jax.vmap`` only accepts
full permutations. Then

    (W x)_i = W[i, i] x_i + sum_k receive_weights[k, i] * x_{src_k(i)}      (Eq. 2 mixing)

is one ``ppermute`` per permutation on a mesh, one ``sendrecv`` per permutation
over MPI, and one RMA window slot per permutation for one-sided puts.

>>> from jaxcomm import topology
>>> t = topology.ring(4)
>>> t.weights[0].tolist()
[0.3333333333333333, 0.3333333333333333, 0.0, 0.3333333333333333]
>>> len(t.permutations), round(t.spectral_gap, 4)
(2, 0.6667)
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Sequence

import numpy as np

from ._validate import check_int

__all__ = [
    "Topology",
    "ring",
    "torus",
    "exponential",
    "complete",
    "from_matrix",
    "make",
    "names",
    "spectral_gap",
]

_ATOL = 1e-6


def validate_mixing_matrix(
    weights, num_workers: int | None = None, *, atol: float = _ATOL, name: str = "weights"
) -> np.ndarray:
    """Check that ``weights`` is a valid mixing matrix and return it as ``float64 [n, n]``.

    Valid means (Lian et al. 2017, Assumption 1; EventGraD Sec. 3): square, finite,
    entries in ``[0, 1]``, symmetric (``|W - W^T| <= atol``), and doubly stochastic
    (every row and every column sums to 1 within ``atol``). If ``num_workers`` is
    given, ``n`` must equal it.

    Raises:
      TypeError: ``weights`` is not numeric.
      ValueError: naming the violated property (and ``name``).
    """
    try:
        w = np.asarray(weights, dtype=np.float64)
    except (TypeError, ValueError) as e:
        raise TypeError(f"{name} must be a numeric [n, n] matrix; got {type(weights).__name__}") from e
    if w.ndim != 2 or w.shape[0] != w.shape[1] or w.shape[0] < 1:
        raise ValueError(f"{name} must be a square [n, n] matrix with n >= 1; got shape {w.shape}")
    n = w.shape[0]
    if num_workers is not None and n != int(num_workers):
        raise ValueError(f"{name} is {n}x{n} (a topology of {n} workers) but there are {num_workers} workers")
    if not np.all(np.isfinite(w)):
        raise ValueError(f"{name} must be finite")
    if np.any(w < -atol) or np.any(w > 1 + atol):
        raise ValueError(f"{name} entries must lie in [0, 1]; got min {w.min():.3g}, max {w.max():.3g}")
    asym = float(np.max(np.abs(w - w.T)))
    if asym > atol:
        raise ValueError(f"{name} must be symmetric; max |W - W^T| = {asym:.3g} > {atol:g}")
    rows = w.sum(axis=1)
    cols = w.sum(axis=0)
    if np.max(np.abs(rows - 1)) > atol or np.max(np.abs(cols - 1)) > atol:
        bad_r = int(np.argmax(np.abs(rows - 1)))
        bad_c = int(np.argmax(np.abs(cols - 1)))
        raise ValueError(
            f"{name} must be doubly stochastic (rows and columns summing to 1); "
            f"row {bad_r} sums to {rows[bad_r]:.6g}, column {bad_c} sums to {cols[bad_c]:.6g}"
        )
    return np.clip(w, 0.0, 1.0)


def spectral_gap(weights) -> float:
    """``1 - max(|lambda_2(W)|, |lambda_n(W)|)`` of a symmetric mixing matrix ``W`` (``[n, n]``).

    Lian et al. (2017) and EventGraD (Assumption 2.2) require
    ``rho = max(|lambda_2|, |lambda_n|)**2 < 1``, i.e. a positive gap; consensus
    error contracts by ``sqrt(rho) = 1 - gap`` per mixing step. ``n = 1`` gives 1.
    """
    try:
        w = np.asarray(weights, dtype=np.float64)
    except (TypeError, ValueError):
        raise TypeError(f"weights must be a numeric [n, n] matrix; got {type(weights).__name__}") from None
    if w.ndim != 2 or w.shape[0] != w.shape[1] or w.shape[0] < 1 or not np.all(np.isfinite(w)):
        raise ValueError(f"weights must be a finite square [n, n] matrix with n >= 1; got shape {w.shape}")
    if w.shape[0] == 1:
        return 1.0
    lam = np.sort(np.linalg.eigvalsh((w + w.T) / 2))[::-1]  # lam[0] == 1 for a doubly stochastic W
    return float(1.0 - max(abs(lam[1]), abs(lam[-1])))


@dataclasses.dataclass(frozen=True, eq=False)
class Topology:
    """A mixing matrix and its neighbour permutations (see the module docstring).

    Attributes:
      name: e.g. ``"ring"``, ``"torus(2x4)"``, ``"custom"``.
      weights: ``float64 [n, n]`` symmetric doubly stochastic mixing matrix ``W``.
      permutations: ``K`` full permutations of ``range(n)``, each a tuple of ``n``
        ``(source, destination)`` pairs (the ``jax.lax.ppermute`` format).
      receive_weights: ``float64 [K, n]``; ``W[i, src_k(i)]`` for a real edge, else 0.
      receive_mask: ``bool [K, n]``; whether ``i``'s incoming pair in permutation
        ``k`` is a real edge (padding pairs carry no information).
    """

    name: str
    weights: np.ndarray
    permutations: tuple
    receive_weights: np.ndarray
    receive_mask: np.ndarray

    def __post_init__(self):
        for arr in (self.weights, self.receive_weights, self.receive_mask):
            arr.setflags(write=False)

    def __repr__(self):
        return f"Topology({self.name!r}, n={self.num_workers}, permutations={len(self.permutations)})"

    @property
    def num_workers(self) -> int:
        """``n``, the number of workers."""
        return int(self.weights.shape[0])

    @property
    def num_permutations(self) -> int:
        """``K``, the number of neighbour permutations (RMA window slots per worker)."""
        return len(self.permutations)

    @property
    def self_weights(self) -> np.ndarray:
        """``float64 [n]``: ``W[i, i]``, the weight of a worker's own parameters."""
        return np.diag(self.weights).copy()

    def sources(self, k: int) -> np.ndarray:
        """``int [n]``: ``src_k(i)``, whom worker ``i`` receives from in permutation ``k``."""
        src = np.empty(self.num_workers, dtype=np.int64)
        for s, d in self.permutations[k]:
            src[d] = s
        return src

    def destinations(self, k: int) -> np.ndarray:
        """``int [n]``: whom worker ``j`` sends to in permutation ``k``."""
        dst = np.empty(self.num_workers, dtype=np.int64)
        for s, d in self.permutations[k]:
            dst[s] = d
        return dst

    def send_mask(self) -> np.ndarray:
        """``bool [K, n]``: whether worker ``j``'s outgoing pair in permutation ``k`` is a real edge."""
        out = np.zeros_like(self.receive_mask)
        for k in range(self.num_permutations):
            out[k, self.sources(k)] = self.receive_mask[k]
        return out

    def neighbors(self, i: int) -> tuple:
        """Sorted neighbours ``j != i`` with ``W[i, j] > 0``."""
        if not 0 <= i < self.num_workers:
            raise ValueError(f"worker index i must be in [0, {self.num_workers}); got {i}")
        return tuple(int(j) for j in np.nonzero(self.weights[i] > 0)[0] if j != i)

    @property
    def degrees(self) -> np.ndarray:
        """``int [n]``: number of distinct neighbours: messages one full exchange of one tensor sends."""
        w = self.weights > 0
        np.fill_diagonal(w, False)
        return w.sum(axis=1)

    @property
    def spectral_gap(self) -> float:
        """``1 - max(|lambda_2|, |lambda_n|)`` of ``weights`` (see :func:`spectral_gap`)."""
        return spectral_gap(self.weights)

    @property
    def rho(self) -> float:
        """Lian et al.'s ``rho = max(|lambda_2|, |lambda_n|)**2`` (Assumption 2.2; < 1 when connected)."""
        return (1.0 - self.spectral_gap) ** 2

    def check_workers(self, num_workers: int, where: str = "the communicator") -> None:
        """Raise ``ValueError`` unless this topology has ``num_workers`` workers."""
        if int(num_workers) != self.num_workers:
            raise ValueError(
                f"topology {self.name!r} has {self.num_workers} workers but {where} has {num_workers}; "
                f"build the topology for {num_workers} workers"
            )


# --------------------------------------------------------------------------- #
# construction
# --------------------------------------------------------------------------- #
def _from_shifts(name: str, w: np.ndarray, shape: tuple, offsets) -> Topology:
    """Permutations of a circulant (over ``Z_shape``) topology: one per offset."""
    n = w.shape[0]
    coords = np.array(np.unravel_index(np.arange(n), shape)).T  # [n, d]
    perms, rw, rm = [], [], []
    for off in offsets:
        src = np.ravel_multi_index(tuple(((coords + np.asarray(off)) % np.asarray(shape)).T), shape)
        perms.append(tuple((int(src[i]), i) for i in range(n)))
        rw.append(w[np.arange(n), src])
        rm.append(np.ones(n, dtype=bool))
    if not perms:
        return Topology(name, w, (), np.zeros((0, n)), np.zeros((0, n), dtype=bool))
    return Topology(name, w, tuple(perms), np.array(rw), np.array(rm))


def _uniform_shift_topology(name: str, shape: tuple, offsets) -> Topology:
    """Uniform weights ``1 / (deg + 1)`` over the distinct non-zero offsets (and self)."""
    shape = tuple(int(s) for s in shape)
    n = int(np.prod(shape))
    distinct = []
    for off in offsets:
        off = tuple(int(o) % s for o, s in zip(off, shape))
        if any(off) and off not in distinct:
            distinct.append(off)
    w = np.zeros((n, n))
    weight = 1.0 / (len(distinct) + 1)
    coords = np.array(np.unravel_index(np.arange(n), shape)).T
    np.fill_diagonal(w, weight)
    for off in distinct:
        src = np.ravel_multi_index(tuple(((coords + np.asarray(off)) % np.asarray(shape)).T), shape)
        w[np.arange(n), src] += weight
    return _from_shifts(name, w, shape, distinct)


def ring(num_workers: int) -> Topology:
    """Ring: ``W[i, i] = W[i, i-1] = W[i, i+1] = 1/3`` (EventGraD Sec. 3, the paper's topology).

    Two permutations: receive from the left (``i-1``) and from the right (``i+1``).
    With 2 workers left and right coincide, so the single neighbour gets weight 2/3
    (one permutation); with 1 worker ``W = [[1]]``.
    """
    n = check_int(num_workers, "num_workers")
    if n == 1:
        return _from_shifts("ring", np.ones((1, 1)), (1,), [])
    if n == 2:
        w = np.array([[1 / 3, 2 / 3], [2 / 3, 1 / 3]])
        return _from_shifts("ring", w, (2,), [(1,)])
    w = np.zeros((n, n))
    for i in range(n):
        for j in (i - 1, i, i + 1):
            w[i, j % n] += 1.0 / 3.0
    return _from_shifts("ring", w, (n,), [(-1,), (1,)])


def torus(rows: int, cols: int) -> Topology:
    """2-D torus ``rows x cols`` (worker ``i = r * cols + c``), uniform weights ``1/(deg+1)``.

    Neighbours are up, down, left and right with wrap-around (``deg = 4`` when both
    sides are >= 3; coinciding neighbours are merged).
    """
    r = check_int(rows, "rows")
    c = check_int(cols, "cols")
    return _uniform_shift_topology(f"torus({r}x{c})", (r, c), [(-1, 0), (1, 0), (0, -1), (0, 1)])


def exponential(num_workers: int) -> Topology:
    """Exponential-2 graph: ``i`` is linked to ``i +- 2**k (mod n)`` for ``2**k < n``; weights ``1/(deg+1)``.

    The graph is symmetric and circulant, so uniform weights are doubly stochastic.
    """
    n = check_int(num_workers, "num_workers")
    offsets = []
    k = 1
    while k < n:
        offsets += [(-k,), (k,)]
        k *= 2
    return _uniform_shift_topology("exponential", (n,), offsets)


def complete(num_workers: int) -> Topology:
    """Complete graph: ``W = 1/n`` everywhere (one mixing step is the exact average)."""
    n = check_int(num_workers, "num_workers")
    return _uniform_shift_topology("complete", (n,), [(s,) for s in range(1, n)])


def _edge_colouring(n: int, support: np.ndarray) -> list:
    """Colour the directed edges ``src -> dst`` of ``support[dst, src]`` so that no two
    edges of a colour share a source or a destination, with ``max degree`` colours.

    Bipartite edge colouring by alternating-path swaps (Koenig's line-colouring
    theorem). Returns one ``{dst: src}`` dict per colour.
    """
    edges = [(int(s), int(d)) for d, s in zip(*np.nonzero(support))]
    if not edges:
        return []
    delta = int(max(support.sum(axis=0).max(), support.sum(axis=1).max()))
    at_src: list[dict[int, int]] = [{} for _ in range(n)]  # colour -> dst
    at_dst: list[dict[int, int]] = [{} for _ in range(n)]  # colour -> src
    for s, d in edges:
        a = next(c for c in range(delta) if c not in at_src[s])
        b = next(c for c in range(delta) if c not in at_dst[d])
        if a in at_dst[d]:
            # Swap colours a <-> b along the alternating path from d (a-edge, b-edge, ...);
            # it cannot reach s because a is free at s, so afterwards a is free at both.
            path = []
            node, side, col = d, "dst", a
            while True:
                if side == "dst":
                    if col not in at_dst[node]:
                        break
                    other = at_dst[node][col]
                    path.append((other, node, col))
                    node, side = other, "src"
                else:
                    if col not in at_src[node]:
                        break
                    other = at_src[node][col]
                    path.append((node, other, col))
                    node, side = other, "dst"
                col = b if col == a else a
            for ps, pd, pc in path:
                del at_src[ps][pc]
                del at_dst[pd][pc]
            for ps, pd, pc in path:
                nc = b if pc == a else a
                at_src[ps][nc] = pd
                at_dst[pd][nc] = ps
        at_src[s][a] = d
        at_dst[d][a] = s
    return [{d: at_dst[d][c] for d in range(n) if c in at_dst[d]} for c in range(delta)]


def _is_circulant(w: np.ndarray) -> bool:
    n = w.shape[0]
    idx = np.arange(n)
    return all(np.allclose(w[idx, (idx + s) % n], w[0, s], atol=1e-12) for s in range(n))


def from_matrix(
    weights,
    num_workers: int | None = None,
    *,
    name: str = "custom",
    allow_disconnected: bool = False,
    atol: float = _ATOL,
) -> Topology:
    """A topology from a user-given symmetric doubly stochastic matrix ``weights [n, n]``.

    Validated by :func:`validate_mixing_matrix` (and against ``num_workers`` if
    given). A disconnected graph (spectral gap 0, violating Assumption 2.2 of
    Lian et al. / EventGraD) is rejected unless ``allow_disconnected``.

    Raises:
      ValueError / TypeError: as :func:`validate_mixing_matrix`; or a zero spectral gap.
    """
    w = validate_mixing_matrix(weights, num_workers, atol=atol)
    n = w.shape[0]
    gap = spectral_gap(w)
    if not allow_disconnected and n > 1 and gap <= 1e-9:
        raise ValueError(
            f"weights describe a disconnected (or periodic) graph: spectral gap {gap:.3g}; "
            "D-PSGD needs max(|lambda_2|, |lambda_n|) < 1 (pass allow_disconnected=True to accept it)"
        )
    support = w > 0
    np.fill_diagonal(support, False)
    if _is_circulant(w):
        return _from_shifts(name, w, (n,), [(s,) for s in range(1, n) if support[0, s]])
    perms, rw, rm = [], [], []
    for colour in _edge_colouring(n, support):
        srcs_used = set(colour.values())
        free_src = [j for j in range(n) if j not in srcs_used]
        free_dst = [i for i in range(n) if i not in colour]
        pairs = dict(colour)  # dst -> src
        mask = np.array([i in colour for i in range(n)])
        # Complete to a full permutation: idle workers keep their own value (self pairs), then the rest.
        both = sorted(set(free_src) & set(free_dst))
        for i in both:
            pairs[i] = i
        rest_src = [j for j in free_src if j not in both]
        rest_dst = [i for i in free_dst if i not in both]
        for s, d in zip(rest_src, rest_dst):
            pairs[d] = s
        perms.append(tuple((int(pairs[d]), d) for d in range(n)))
        rw.append(np.where(mask, w[np.arange(n), [pairs[d] for d in range(n)]], 0.0))
        rm.append(mask)
    if not perms:
        return Topology(name, w, (), np.zeros((0, n)), np.zeros((0, n), dtype=bool))
    return Topology(name, w, tuple(perms), np.array(rw), np.array(rm))


def _square_factors(n: int) -> tuple:
    r = int(math.isqrt(n))
    while n % r:
        r -= 1
    return r, n // r


_NAMED = {
    "ring": ring,
    "torus": lambda n: torus(*_square_factors(check_int(n, "num_workers"))),
    "exponential": exponential,
    "complete": complete,
}


def names() -> list:
    """Names accepted by :func:`make`."""
    return sorted(_NAMED)


def make(name: str, num_workers: int) -> Topology:
    """The named topology over ``num_workers`` workers (``"torus"`` picks the squarest ``rows x cols``).

    Raises:
      ValueError: unknown ``name`` (listing the valid ones).
    """
    if name not in _NAMED:
        raise ValueError(f"unknown topology {name!r}; valid: {', '.join(names())}")
    return _NAMED[name](num_workers)


def as_topology(topology, num_workers: int | None = None) -> Topology:
    """``topology`` as a :class:`Topology`: a Topology, a name for :func:`make`, or a matrix.

    Checks it against ``num_workers`` if given (``ValueError`` on mismatch).
    """
    if isinstance(topology, Topology):
        t = topology
    elif isinstance(topology, str):
        if num_workers is None:
            raise ValueError("a topology given by name needs num_workers")
        t = make(topology, num_workers)
    elif isinstance(topology, (np.ndarray, Sequence)):
        t = from_matrix(topology)
    else:
        raise TypeError(f"topology must be a Topology, a name or a matrix; got {type(topology).__name__}")
    if num_workers is not None:
        t.check_workers(num_workers)
    return t
