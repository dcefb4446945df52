"""An α-β (latency-bandwidth) model of collective communication time.

A message of ``n`` bits between two processes costs ``α + n / B`` seconds (Hockney's model):
``α`` is the per-message latency and ``B`` the link bandwidth in bits per second (the ``β``
of Thakur, Rabenseifner & Gropp 2005 is ``1 / B``, seconds per bit). As in that paper, every
process can send one message and receive one message at the same time (single-port,
full-duplex) and all links are equal. Costs of the collectives, with ``p`` processes and
``lg p = ceil(log2 p)``:

| collective (``algorithm``)        | latency term           | bandwidth term             |
|-----------------------------------|------------------------|----------------------------|
| allreduce, ring                   | ``2 (p-1) α``          | ``2 (p-1)/p · n / B``      |
| allreduce, rabenseifner           | ``2 lg p · α``         | ``2 (p-1)/p · n / B``      |
| allreduce, recursive_doubling     | ``lg p · α``           | ``lg p · n / B``           |
| reduce-scatter, ring              | ``(p-1) α``            | ``(p-1)/p · n / B``        |
| reduce-scatter, recursive_halving | ``lg p · α``           | ``(p-1)/p · n / B``        |
| allgather (m bits each), ring     | ``(p-1) α``            | ``(p-1) · m / B``          |
| allgather, recursive_doubling     | ``lg p · α``           | ``(p-1) · m / B``          |
| broadcast, binomial               | ``lg p · α``           | ``lg p · n / B``           |
| broadcast, scatter_allgather      | ``(lg p + p - 1) α``   | ``2 (p-1)/p · n / B``      |
| neighbour exchange, degree d      | ``d α``                | ``d · n / B``              |

(Thakur et al. 2005; the ring allreduce is their ring reduce-scatter followed by the
ring allgather, Patarasuk & Yuan 2009. Computation of the reductions, Thakur's ``γ`` term, is
not communication and is left out. For ``p`` not a power of two the recursive algorithms
are charged ``ceil(log2 p)`` rounds, a lower bound of MPICH's cost.) A single process
communicates nothing: every cost is 0 at ``p = 1``.

Use it to turn the exact wire bits a compressor reports (:func:`jaxcomm.wire_bits`) into an
estimated communication time at 1, 10 and 25 Gbps (:data:`STANDARD_NETWORKS`, the link speeds
of GRACE's testbed, Sec. V-A), so experiments report estimated time-to-accuracy next to epochs.

**Default latency.** ``α = 25 µs`` (:data:`DEFAULT_LATENCY_S`) for all three networks: the
order of small-message MPI latency over kernel TCP on commodity Ethernet (roughly 15-50 µs),
the transport of GRACE's measurements (Open MPI over TCP). RDMA fabrics reach 1-3 µs; build
``Network(25, 2e-6)`` to model one. The choice only matters for small or many messages: for a
fp32 ResNet-20 (8.6 Mbit) ring allreduce over 8 workers at 10 Gbps the bandwidth term is
1.51 ms and one message's latency term 0.35 ms, but sending its 59 tensors as 59 separate
allreduces (``messages=59``) pays 20.7 ms of latency, which is why tensor fusion exists.

**Bytes of a whole step.** :func:`step_bytes` predicts the total bytes one
:func:`jaxcomm.compressed_mean` step puts on the wire, summed over the workers, from one
worker's ``state.wire_bits`` (ring algorithms; the derivations are in its docstring), and
:func:`step_time` turns them into seconds on a *shared* link (every byte crosses one link of
the given rate, as on :mod:`jaxcomm.netem`'s emulated network):
``8 · step_bytes / B + step_latency_rounds · α``. With ``topology=Cluster(nodes, devices)`` it
prices a two-level cluster instead (the emulated cluster of ``jaxcomm launch --jax``): the
traffic inside a node is free, and every node has its own link of ``B`` to a switch
(:meth:`Cluster.node_bytes`), for a flat mean over all devices and for the slow axis of the
hierarchical one.

Every function is plain arithmetic, so ``bits`` may be a Python number, a NumPy array or a
(possibly traced) JAX array; the result has the same kind and broadcasts over ``bits``.
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Mapping
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

from ._validate import check_choice, check_finite_scalar, check_int

__all__ = [
    "Network",
    "Cluster",
    "STANDARD_NETWORKS",
    "comm_time",
    "cumulative_comm_time",
    "estimate_times",
    "step_bytes",
    "step_time",
]

DEFAULT_LATENCY_S = 25e-6


@dataclasses.dataclass(frozen=True)
class Network:
    """A homogeneous network in the α-β model.

    Attributes:
      bandwidth_gbps: link bandwidth ``B`` in gigabits per second (``10**9`` bits/s).
      latency_s: per-message latency ``α`` in seconds.
    """

    bandwidth_gbps: float
    latency_s: float = DEFAULT_LATENCY_S

    def __post_init__(self):
        check_finite_scalar(self.bandwidth_gbps, "bandwidth_gbps", positive=True)
        check_finite_scalar(self.latency_s, "latency_s", nonnegative=True)

    @property
    def bits_per_s(self) -> float:
        """``B`` in bits per second."""
        return float(self.bandwidth_gbps) * 1e9

    def transfer_time(self, bits) -> Any:
        """Point-to-point time of one message: ``α + bits / B`` seconds."""
        return self.latency_s + bits / self.bits_per_s


STANDARD_NETWORKS: Mapping[str, Network] = {
    "1Gbps": Network(1.0),
    "10Gbps": Network(10.0),
    "25Gbps": Network(25.0),
}

COLLECTIVES = ("allreduce", "allgather", "reduce_scatter", "broadcast", "neighbor_exchange")


# --------------------------------------------------------------------------- #
# Validation helpers
# --------------------------------------------------------------------------- #
def _check_net(net) -> Network:
    if not isinstance(net, Network):
        raise TypeError(f"net must be a jaxcomm.cost_model.Network; got {type(net).__name__}")
    return net


def _check_bits(bits, name: str = "bits"):
    if isinstance(bits, jax.core.Tracer):
        return bits
    if isinstance(bits, (list, tuple)):
        bits = np.asarray(bits, dtype=np.float64)
    arr = np.asarray(bits)
    if not (np.issubdtype(arr.dtype, np.integer) or np.issubdtype(arr.dtype, np.floating)):
        raise TypeError(f"{name} must be a real number or array of bit counts; got dtype {arr.dtype}")
    if np.any(arr < 0) or not np.all(np.isfinite(arr)):
        raise ValueError(f"{name} must be finite and >= 0")
    return bits


def _lg(p: int) -> int:
    return (p - 1).bit_length()  # ceil(log2 p) for p >= 1; 0 at p = 1


def _minimum(a, b):
    if isinstance(a, jax.Array) or isinstance(b, jax.Array):
        return jnp.minimum(a, b)
    out = np.minimum(a, b)
    return float(out) if np.ndim(out) == 0 else out


def _cost(latency_rounds: float, bandwidth_factor: float, bits, net: Network):
    """``latency_rounds · α + bandwidth_factor · bits / B``."""
    return latency_rounds * net.latency_s + bandwidth_factor * (bits / net.bits_per_s)


# --------------------------------------------------------------------------- #
# Collectives
# --------------------------------------------------------------------------- #
def allreduce_time(bits, workers: int, net: Network, algorithm: str = "ring"):
    """Time of an allreduce of an ``n = bits`` vector over ``p = workers`` processes.

    ``ring``: ``2(p-1) α + 2 (p-1)/p · n / B`` (ring reduce-scatter + ring allgather; Thakur et
    al. 2005, Patarasuk & Yuan 2009); ``rabenseifner``: ``2 lg p · α + 2 (p-1)/p · n / B``;
    ``recursive_doubling``: ``lg p (α + n / B)``.

    Args:
      bits: size of the (per-worker, summable) vector in bits; scalar or array.
      workers: ``p >= 1``.
      net: the :class:`Network`.
      algorithm: ``"ring"``, ``"rabenseifner"`` or ``"recursive_doubling"``.
    Returns:
      seconds, same kind as ``bits``.
    """
    p = check_int(workers, "workers", 1)
    net, bits = _check_net(net), _check_bits(bits)
    if algorithm == "ring":
        return _cost(2 * (p - 1), 2 * (p - 1) / p, bits, net)
    if algorithm == "rabenseifner":
        return _cost(2 * _lg(p), 2 * (p - 1) / p, bits, net)
    if algorithm == "recursive_doubling":
        return _cost(_lg(p), _lg(p), bits, net)
    raise ValueError(f"algorithm must be 'ring', 'rabenseifner' or 'recursive_doubling'; got {algorithm!r}")


def reduce_scatter_time(bits, workers: int, net: Network, algorithm: str = "ring"):
    """Time of a reduce-scatter of an ``n = bits`` vector (each process ends with ``n/p`` reduced).

    ``ring`` (pairwise exchange): ``(p-1) α + (p-1)/p · n / B``; ``recursive_halving``:
    ``lg p · α + (p-1)/p · n / B`` (Thakur et al. 2005).

    Args:
      bits: the full vector's size in bits; workers: ``p >= 1``; net: the :class:`Network`;
      algorithm: ``"ring"`` or ``"recursive_halving"``.
    Returns:
      seconds.
    """
    p = check_int(workers, "workers", 1)
    net, bits = _check_net(net), _check_bits(bits)
    if algorithm == "ring":
        return _cost(p - 1, (p - 1) / p, bits, net)
    if algorithm == "recursive_halving":
        return _cost(_lg(p), (p - 1) / p, bits, net)
    raise ValueError(f"algorithm must be 'ring' or 'recursive_halving'; got {algorithm!r}")


def allgather_time(bits_per_worker, workers: int, net: Network, algorithm: str = "ring"):
    """Time of an allgather where each process contributes ``m = bits_per_worker`` bits.

    ``ring``: ``(p-1) α + (p-1) · m / B``; ``recursive_doubling``: ``lg p · α + (p-1) · m / B``
    (Thakur et al. 2005, with their total ``n = p m``). This is what compressors with
    ``strategy == "allgather"`` (non-summable payloads: top-k, signSGD, ...) pay.

    Args:
      bits_per_worker: one process's payload in bits; workers: ``p >= 1``; net: the
        :class:`Network`; algorithm: ``"ring"`` or ``"recursive_doubling"``.
    Returns:
      seconds.
    """
    p = check_int(workers, "workers", 1)
    net, bits = _check_net(net), _check_bits(bits_per_worker, "bits_per_worker")
    if algorithm == "ring":
        return _cost(p - 1, p - 1, bits, net)
    if algorithm == "recursive_doubling":
        return _cost(_lg(p), p - 1, bits, net)
    raise ValueError(f"algorithm must be 'ring' or 'recursive_doubling'; got {algorithm!r}")


def broadcast_time(bits, workers: int, net: Network, algorithm: str = "best"):
    """Time of a broadcast of ``n = bits`` from one process to ``p - 1`` others.

    ``binomial`` tree: ``lg p (α + n / B)``; ``scatter_allgather`` (van de Geijn):
    ``(lg p + p - 1) α + 2 (p-1)/p · n / B`` (Thakur et al. 2005); ``best``: the
    cheaper of the two for this ``n`` (what a tuned MPI's size-based selection approximates).

    Args:
      bits: message size in bits; workers: ``p >= 1``; net: the :class:`Network`;
      algorithm: ``"binomial"``, ``"scatter_allgather"`` or ``"best"``.
    Returns:
      seconds.
    """
    p = check_int(workers, "workers", 1)
    net, bits = _check_net(net), _check_bits(bits)
    binomial = _cost(_lg(p), _lg(p), bits, net)
    scatter = _cost(_lg(p) + p - 1, 2 * (p - 1) / p, bits, net)
    if algorithm == "binomial":
        return binomial
    if algorithm == "scatter_allgather":
        return scatter
    if algorithm == "best":
        return _minimum(binomial, scatter)
    raise ValueError(f"algorithm must be 'binomial', 'scatter_allgather' or 'best'; got {algorithm!r}")


def neighbor_exchange_time(bits, degree: int, net: Network):
    """Time for every process to send ``n = bits`` to each of its ``d = degree`` neighbours
    (and receive as much): ``d (α + n / B)``.

    In the single-port full-duplex model a process's ``d`` sends are serialised while its
    receives overlap them. This is a decentralized round (D-PSGD on a ring: ``d = 2``;
    EventGraD sends only the tensors whose event fired, so pass the bits actually sent).

    Args:
      bits: bits sent to each neighbour; degree: ``d >= 0``; net: the :class:`Network`.
    Returns:
      seconds.
    """
    d = check_int(degree, "degree", 0)
    net, bits = _check_net(net), _check_bits(bits)
    return _cost(d, d, bits, net)


def comm_time(
    strategy: str,
    bits,
    workers: int,
    net: Network,
    *,
    degree: int = 2,
    messages: int = 1,
    algorithm: str | None = None,
):
    """Communication time of one training step, dispatched on the strategy.

    ``bits`` is the step's total payload, split evenly over ``messages`` separate collectives
    (one per tensor when tensors are not fused), each paying its own latency:
    ``messages · T(bits / messages)``.

    Args:
      strategy: ``"allreduce"`` (bits = the summed vector), ``"allgather"`` (bits = one
        worker's payload), ``"reduce_scatter"``, ``"broadcast"`` or ``"neighbor_exchange"``
        (``"neighbour_exchange"`` accepted; bits = per neighbour, ``degree`` neighbours).
      bits: scalar or array of bit counts.
      workers: ``p >= 1`` (unused by ``neighbor_exchange``).
      net: the :class:`Network`.
      degree: neighbours for ``neighbor_exchange``.
      messages: number of separate collectives the bits are sent in, ``>= 1``.
      algorithm: the collective's algorithm (default: each function's default).
    Returns:
      seconds.
    """
    messages = check_int(messages, "messages", 1)
    kw = {} if algorithm is None else {"algorithm": algorithm}
    if strategy == "neighbour_exchange":
        strategy = "neighbor_exchange"
    check_choice(strategy, "strategy", COLLECTIVES)
    per_message = _check_bits(bits) / messages
    if strategy == "neighbor_exchange":
        if algorithm is not None:
            raise ValueError("algorithm does not apply to neighbor_exchange")
        one = neighbor_exchange_time(per_message, degree, net)
    else:
        fn = {
            "allreduce": allreduce_time,
            "allgather": allgather_time,
            "reduce_scatter": reduce_scatter_time,
            "broadcast": broadcast_time,
        }[strategy]
        one = fn(per_message, workers, net, **kw)
    return messages * one


def cumulative_comm_time(strategy: str, bits_per_step, workers: int, net: Network, **kwargs) -> np.ndarray:
    """Running total of :func:`comm_time` over steps: element ``t`` is the communication time of
    steps ``0..t``. Index it at the step that reached the target accuracy for time-to-accuracy.

    Args:
      strategy, workers, net, kwargs: as :func:`comm_time`.
      bits_per_step: ``[T]`` measured wire bits of each step.
    Returns:
      ``float64 [T]`` seconds.
    """
    bits = np.asarray(bits_per_step, dtype=np.float64).reshape(-1)
    return np.cumsum(np.asarray(comm_time(strategy, bits, workers, net, **kwargs), dtype=np.float64))


def estimate_times(
    strategy: str,
    bits_per_step,
    workers: int,
    networks: Mapping[str, Network] = STANDARD_NETWORKS,
    *,
    compute_s_per_step: float = 0.0,
    **kwargs,
) -> dict[str, float]:
    """Estimated wall time of a run on each network: ``sum_t comm_time(bits_t) + T · compute``.

    Communication and computation are not overlapped (an upper bound for a pipelined
    implementation, exact for a synchronous one).

    Args:
      strategy, workers, kwargs: as :func:`comm_time`.
      bits_per_step: ``[T]`` wire bits of each step (a scalar means one step).
      networks: name -> :class:`Network` (default :data:`STANDARD_NETWORKS`).
      compute_s_per_step: measured or assumed computation seconds per step, ``>= 0``.
    Returns:
      ``{network name: seconds}``.
    """
    compute = float(compute_s_per_step)
    if not math.isfinite(compute) or compute < 0:
        raise ValueError(f"compute_s_per_step must be finite and >= 0; got {compute_s_per_step}")
    bits = np.asarray(bits_per_step, dtype=np.float64).reshape(-1)
    out = {}
    for name, net in networks.items():
        comm = np.asarray(comm_time(strategy, bits, workers, net, **kwargs), dtype=np.float64)
        out[name] = float(comm.sum() + compute * bits.size)
    return out


# --------------------------------------------------------------------------- #
# Bytes and time of one compressed_mean step
# --------------------------------------------------------------------------- #
STEP_STRATEGIES = ("allreduce", "rounds", "allgather", "reduce_scatter", "broadcast")
"""The strategies :func:`step_bytes` prices: the pipeline's (:data:`jaxcomm.transforms.STRATEGIES`)
and ``"rounds"``, a multi-round compressor (PowerSGD) under ``"allreduce"``."""


def _check_strategy(strategy) -> str:
    check_choice(strategy, "strategy", STEP_STRATEGIES)
    return strategy


def step_bytes(strategy: str, payload_bytes, workers: int):
    """Total bytes one :func:`jaxcomm.compressed_mean` step puts on the wire, summed over workers.

    ``P = payload_bytes`` is one worker's ``state.wire_bits.sum() / 8`` for that strategy (what
    the pipeline counts, below); ``n = workers``. Collectives are the ring algorithms (Open
    MPI's ``coll_tuned`` all-reduce and all-gather algorithm 4), the counts are payload bytes
    (no protocol headers), and ``n = 1`` sends nothing.

    - ``"allreduce"``: ``P`` = the summed fields. A ring all-reduce is a reduce-scatter then
      an all-gather over ``n`` blocks; each block is sent ``n − 1`` times in each phase, so
      ``2 (n − 1) P`` bytes in all, whatever the block sizes. (``MPIComm``'s float16/bfloat16
      sum, an all-to-all then an all-gather of ``c = ceil(d / n)``-entry chunks, sends
      ``2 (n − 1) n c`` words: the same when ``n`` divides ``d``.)
    - ``"rounds"`` (PowerSGD): ``P = Σ_j m_j`` over the messages it yields, each summed by
      its own ring all-reduce: ``Σ_j 2 (n − 1) m_j = 2 (n − 1) P``.
    - ``"allgather"``: ``P`` = the whole payload (fused or not: fusion only packs the
      payloads into one buffer). Every worker receives the other ``n − 1`` payloads once:
      ``n (n − 1) P``. For count-based payloads (:func:`jaxcomm.comm.all_gather_counted`)
      ``P`` is what the pipeline reports: the int32 counts (the count gather) plus the bucket
      ``B`` of the data gather (valid rows and padding). Both are all-gathers, so the total is
      still ``n (n − 1) P``, and ``state.messages`` counts both.
    - ``"broadcast"``: each worker's payload broadcast in turn; with a tree or linear
      broadcast (binomial, pipelined) every other worker receives it once: ``n (n − 1) P``.
      (A scatter-allgather broadcast sends up to twice that; not measured.)
    - ``"reduce_scatter"``: a worker sends ``n − 1`` chunk payloads of ``s`` bytes to their
      owners (``permute``) and its averaged chunk's payload ``a`` goes to the ``n − 1`` others
      in the ring all-gather: ``n (n − 1) (s + a)`` in all. The pipeline reports
      ``P = (n − 1) s + a``, and in :func:`jaxcomm.compressed_mean` the owners compress their
      ``c``-entry chunk with the same compressor, whose payload size depends only on the
      length, so ``a = s = P / n`` and the total is ``n (n − 1) · 2 P / n = 2 (n − 1) P``.
      (Not for DoubleSqueeze, whose owners use another compressor and whose ``wire_bits`` is
      the averaged chunk alone.)

    Args:
      strategy: one of :data:`STEP_STRATEGIES`.
      payload_bytes: ``P``, one worker's bytes per step (scalar or array, ``>= 0``).
      workers: ``n >= 1``.
    Returns:
      bytes summed over the workers, same kind as ``payload_bytes``.
    """
    strategy = _check_strategy(strategy)
    n = check_int(workers, "workers", 1)
    payload = _check_bits(payload_bytes, "payload_bytes")
    if strategy in ("allgather", "broadcast"):
        return n * (n - 1) * payload
    return 2 * (n - 1) * payload


def step_latency_rounds(strategy: str, workers: int, messages: int = 1) -> int:
    """Sequential message steps of one step, each paying the latency ``α`` once.

    ``messages`` is ``state.messages``, the arrays the worker handed to collectives (one MPI
    call each). A ring all-reduce takes ``2 (n − 1)`` steps, a ring all-gather ``n − 1``, a
    binomial broadcast ``ceil(log2 n)``, a ``permute`` one:

    - ``"allreduce"``, ``"rounds"``: ``2 (n − 1) · messages``;
    - ``"allgather"``: ``(n − 1) · messages``;
    - ``"broadcast"``: ``ceil(log2 n) · messages``;
    - ``"reduce_scatter"``: the payload's ``L`` arrays go out in ``n − 1`` permutes and one
      all-gather each, so ``messages = n L`` and the steps are
      ``(n − 1) L + (n − 1) L = 2 (n − 1) · messages / n``.

    Args:
      strategy: one of :data:`STEP_STRATEGIES`; workers: ``n >= 1``;
      messages: ``>= 0`` (a multiple of ``n`` for ``"reduce_scatter"``).
    Returns:
      the number of steps (0 for ``n = 1``).
    """
    strategy = _check_strategy(strategy)
    n = check_int(workers, "workers", 1)
    m = check_int(messages, "messages", 0)
    if n == 1:
        return 0
    if strategy in ("allreduce", "rounds"):
        return 2 * (n - 1) * m
    if strategy == "allgather":
        return (n - 1) * m
    if strategy == "broadcast":
        return _lg(n) * m
    if m % n:
        raise ValueError(f"messages must be a multiple of workers ({n}) for 'reduce_scatter'; got {m}")
    return 2 * (n - 1) * (m // n)


@dataclasses.dataclass(frozen=True)
class Cluster:
    """A two-level cluster: ``nodes`` nodes (``N``) of ``devices`` devices (``L``) each.

    Inside a node the devices share memory: their traffic costs nothing here. Between nodes every
    node has one full-duplex link of the :class:`Network`'s bandwidth to a non-blocking switch (the
    emulated cluster of :func:`jaxcomm.netem.launch` with ``devices_per_process``). The workers of a
    flat collective are numbered node-major (node ``a``'s devices are workers ``a L`` to
    ``a L + L − 1``, as ``jax.devices()`` orders a ``jax.distributed`` job's devices).

    Attributes:
      nodes: ``N >= 1``; devices: ``L >= 1``.
    """

    nodes: int
    devices: int

    def __post_init__(self):
        check_int(self.nodes, "nodes", 1)
        check_int(self.devices, "devices", 1)

    def node_bytes(self, strategy: str, payload_bytes, workers: int):
        """Bytes each node sends to the switch in one step (every node alike), payload only.

        - ``workers == N L``, a flat mean over every device: the ring of :func:`step_bytes` runs
          through the devices in node-major order, so ``N`` of its ``N L`` edges leave a node, one
          per node, and every edge carries the same share: ``step_bytes(strategy, P, N L) / (N L)``
          (``2 (N L − 1) P / (N L)`` for a ring all-reduce, ``(N L − 1) P`` for an all-gather).
        - ``workers == N`` (``L > 1``), the slow axis of the hierarchical mean
          (``compressed_mean(..., axis_name=(slow, fast))``, ``P`` = one worker's
          ``state.slow.wire_bits.sum() / 8``): ``L`` independent collectives over the ``N`` nodes,
          one per device index, all through the node's one link:
          ``L · step_bytes(strategy, P, N) / N``.

        Raises:
          ValueError: ``workers`` neither ``N L`` nor ``N``; ``strategy == "broadcast"`` (its root
            sends more than its share).
        """
        n = check_int(workers, "workers", 1)
        if _check_strategy(strategy) == "broadcast":
            raise ValueError("a Cluster does not price 'broadcast' (its root sends more than its share)")
        if n == self.nodes * self.devices:
            groups = 1
        elif n == self.nodes:
            groups = self.devices
        else:
            raise ValueError(
                f"workers must be nodes x devices = {self.nodes * self.devices} (a flat mean over every device) "
                f"or nodes = {self.nodes} (the slow axis of the hierarchical mean); got {workers}"
            )
        if self.nodes == 1:
            return 0 * _check_bits(payload_bytes, "payload_bytes")
        return groups * step_bytes(strategy, payload_bytes, n) / n


TOPOLOGIES = ("shared", "switched")
"""The networks :func:`step_time` models: one link shared by all workers, or one full-duplex
link per worker to a non-blocking switch."""


def step_time(
    strategy: str, payload_bytes, workers: int, net: Network, *, messages: int = 1, topology: str | Cluster = "shared"
):
    """Seconds of one step's communication:
    ``8 · step_bytes(strategy, P, n) / (L · B) + step_latency_rounds(strategy, n, messages) · α``.

    - ``topology="shared"`` (``L = 1``): the model of :mod:`jaxcomm.netem`'s emulated
      network: all workers' bytes cross one link of ``B`` bits per second (a shared medium,
      or a single bottleneck), so the bandwidth term is the total bytes of :func:`step_bytes`.
    - ``topology="switched"`` (``L = n``): every worker has its own full-duplex link of ``B``
      bits per second to a non-blocking switch (a cluster). The ring collectives, the
      reduce-scatter route and the all-gather spread :func:`step_bytes` evenly over the ``n``
      senders, which send at once: ``2 (n − 1) P / n`` bytes per worker for a ring
      all-reduce, ``(n − 1) P`` for an all-gather (the α-β times of
      :func:`allreduce_time` and :func:`allgather_time`). A broadcast's root sends more than
      its share, so ``"broadcast"`` is priced only on a shared link.
    - ``topology=Cluster(N, L)``: two levels, free inside a node and one link of ``B`` per node
      between nodes; the nodes send at once, so the bandwidth term is one node's bytes,
      ``8 · Cluster.node_bytes(strategy, P, n) / B``, with ``n = N L`` for a flat mean over every
      device and ``n = N`` for the slow axis of the hierarchical mean (``P`` and ``messages``
      from ``state.slow``); the latency term is that of the ``n``-worker collective.

    Message steps are sequential and each pays ``α``. Computation and protocol headers are
    left out.

    Args:
      strategy: one of :data:`STEP_STRATEGIES`; payload_bytes: one worker's
        ``state.wire_bits.sum() / 8``; workers: ``n >= 1``; net: the :class:`Network`;
      messages: ``state.messages``; topology: one of :data:`TOPOLOGIES`, or a :class:`Cluster`.
    Returns:
      seconds, same kind as ``payload_bytes``.
    """
    net = _check_net(net)
    if isinstance(topology, Cluster):
        sent = topology.node_bytes(strategy, payload_bytes, workers)
        rounds = step_latency_rounds(strategy, workers, messages) if topology.nodes > 1 else 0
        return 8 * sent / net.bits_per_s + rounds * net.latency_s
    if topology not in TOPOLOGIES:
        raise ValueError(f"topology must be one of {TOPOLOGIES} or a Cluster; got {topology!r}")
    if topology == "switched" and strategy == "broadcast":
        raise ValueError("topology='switched' does not price 'broadcast' (its root sends more than its share)")
    total = step_bytes(strategy, payload_bytes, workers)
    links = check_int(workers, "workers", 1) if topology == "switched" else 1
    return 8 * total / (links * net.bits_per_s) + step_latency_rounds(strategy, workers, messages) * net.latency_s
