"""Compressed data-parallel gradient mean: GRACE Algorithm 1 on a communicator.

Per worker ``i`` and per tensor (GRACE Sec. IV-A, Algorithm 1, lines 5-13):

    φ_i = φ(m_i, g_i)                                   compensate (Eq. 4)
    g̃_i = Q(φ_i)                                        compress: the payload
    m_i ← ψ(m_i, g_i, g̃_i)                              memory update (Eq. 4)
    allreduce:           ḡ = Q⁻¹(Σ_i g̃_i) / n            (payloads summed as they are)
    allgather/broadcast: ḡ = (1/n) Σ_i Q⁻¹(g̃_i)          (every payload, decompressed, averaged)

The payload arrays are what cross the device (or process) boundary: packed
bits, narrow codes, indices. Everything is written against the
:class:`~jaxcomm.comm.Communicator` protocol, so the same transform runs on a
mesh axis (inside ``jax.shard_map`` or ``jax.vmap(axis_name=...)``) and over MPI.
"""

from __future__ import annotations

import dataclasses
from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
import optax

from .. import memory as memory_lib
from .._vma import varying_axes
from ..comm import all_gather_packed, resolve
from ..compressors._base import Compressor, wire_bits
from ._error_feedback import (
    bits_int32,
    check_compressor,
    check_memory,
    flatten_updates,
    init_leaves,
    step_keys,
)

__all__ = ["FUSE_MAX_BYTES", "STRATEGIES", "CompressedMeanState", "compressed_mean"]

STRATEGIES = ("auto", "allreduce", "allgather", "broadcast")
"""Values of ``compressed_mean(strategy=...)``."""

_COMPRESSOR_STRATEGIES = ("allreduce", "allgather")


class CompressedMeanState(NamedTuple):
    """Per-worker state of :func:`compressed_mean`.

    In a data-parallel step this state is *per worker* (memories differ): give
    it a leading worker axis sharded over the mesh axis (``P("data")``), or keep
    one per MPI process.

    Attributes:
      count: int32 scalar, steps taken.
      key: PRNG key (raw ``uint32[2]``), identical on every worker; split once per step.
      memory: tree with the parameters' structure whose leaves are the
        per-array memory states (see :class:`~jaxcomm.memory.Memory`).
      compressor_states: tuple, the compressor's per-array state per gradient leaf.
      wire_bits: ``int32[num_leaves]``: exact bits this worker put on the wire
        for each tensor at the last step (its payload; for ``allreduce`` only
        the summed fields, since the others are shared and never sent).
        ``int(state.wire_bits.sum())`` is the step's volume per worker.
    """

    count: jax.Array
    key: jax.Array
    memory: Any
    compressor_states: tuple
    wire_bits: jax.Array


def _check_gradients_are_per_worker(comm, leaves) -> None:
    """Raise if a gradient was already summed over the axis (the shard_map pitfall).

    Inside ``jax.shard_map`` (with its default ``check_vma=True``), ``jax.grad``
    with respect to replicated (device-invariant) parameters returns the
    gradient *summed over the axis* -- an invariant value. Compressing it would
    compress the already-communicated dense sum: every compressor bypassed.
    Detectable at trace time: the axis index varies over the axis, the
    gradient does not. Under ``jax.vmap`` or ``check_vma=False`` nothing is
    tracked and the check is skipped.
    """
    axis = getattr(comm, "axis_name", None)
    if not isinstance(axis, str):
        return
    if axis not in varying_axes(comm.index()):
        return
    for i, g in enumerate(leaves):
        if axis not in varying_axes(g):
            raise ValueError(
                f"updates: gradient leaf {i} (shape {tuple(jnp.shape(g))}) is not device-varying over axis "
                f"{axis!r}: inside jax.shard_map, jax.grad of replicated parameters has already summed it "
                f"across devices, which would bypass compression. Make the parameters per-device before "
                f"jax.grad: params = jax.lax.pcast(params, {axis!r}, to='varying') "
                f"(or jaxcomm.comm.MeshAxis({axis!r}).varying(params))."
            )


def _data_fields(payload):
    if not dataclasses.is_dataclass(payload):
        raise TypeError(
            f"strategy='allreduce' needs a dataclass payload (jaxcomm.compressors.payload_dataclass); "
            f"got {type(payload).__name__}"
        )
    return [f.name for f in dataclasses.fields(payload) if not f.metadata.get("static", False)]


def _summable_fields(compressor: Compressor, payload) -> tuple:
    """The payload's ``summable`` fields, checked against its array fields (``ValueError`` if unusable)."""
    fields = _data_fields(payload)
    summable = tuple(type(payload).summable)
    unknown = [f for f in summable if f not in fields]
    if not summable or unknown:
        raise ValueError(
            f"compressor {compressor.name!r} has strategy 'allreduce' but its payload "
            f"{type(payload).__name__} names summable fields {summable} (array fields: {fields})"
        )
    return summable


def _array_bits(a) -> int:
    return int(a.size) * jnp.dtype(a.dtype).itemsize * 8


def compressed_mean(
    compressor: Compressor,
    axis_name: str | None = None,
    *,
    comm=None,
    memory: memory_lib.Memory | None = None,
    strategy: str = "auto",
    fuse: bool = True,
) -> optax.GradientTransformationExtraArgs:
    """Mean of the workers' gradients, communicated compressed (GRACE Algorithm 1).

    An optax transformation whose ``update`` runs on every worker (inside
    ``jax.shard_map`` over ``axis_name``, inside ``jax.vmap(axis_name=...)``,
    or in every MPI process with ``comm=MPIComm()``) and returns, per leaf,

        ḡ = output_scale · (1/n) Σ_i Q⁻¹(Q(φ(m_i, g_i)))

    identical on every worker; chain an optimizer after it (its state is then
    replicated). Per tensor: compensate → compress → communicate → decompress →
    average → memory update ``m_i ← ψ(m_i, g_i, Q(φ_i))`` with this worker's
    own reconstruction ``Q⁻¹(Q(φ_i))``. (For the residual memories, whose ψ is
    the compression error ``φ_i − Q⁻¹(Q(φ_i))``, the error comes from
    ``compressor.error``: sparse compressors zero the sent entries of ``φ_i``
    in place rather than building a dense reconstruction. Sparse compressors
    also sum the ``n`` gathered payloads with one scatter-add,
    ``compressor.decompress_sum``.)

    Strategies (GRACE Sec. IV-B):
      * ``"allreduce"``: the payload's ``summable`` fields are summed with one
        allreduce (``comm.sum``) and the sum is decompressed once:
        ``Q⁻¹(Σ_i g̃_i)/n``; valid for compressors whose payloads add up (none,
        fp16, random-k with a shared key). Fields not in ``summable`` must be
        identical on every worker: those compressors get the *shared* key. A
        compressor with a ``compress_allreduce`` hook (PowerSGD's two rounds)
        runs it instead; its memory then uses the aggregated reconstruction
        (GRACE's and PyTorch's PowerSGD convention).
      * ``"allgather"``: every worker's payload is gathered and each is decompressed.
      * ``"broadcast"``: each worker's payload is broadcast in turn (``n``
        broadcasts); same result as ``"allgather"``.
      * ``"auto"``: the compressor's own ``strategy``.

    Tensor fusion (``fuse=True``, the default; Horovod's tensor fusion, with
    which GRACE's experiments ran): under ``"allgather"`` every tensor is
    compressed first, then the payloads of at most :data:`FUSE_MAX_BYTES`
    (1 MiB) are all-gathered together with one collective, their bytes packed
    into a single buffer (:func:`~jaxcomm.comm.all_gather_packed`); larger
    payloads are gathered on their own. Unfused, every tensor and payload
    field has its own all-gather (top-k on a VGG16-sized tree: 60 a step).
    The numbers are identical either way and so are the bytes sent; only the
    count of collectives, each with a fixed cost (a rendezvous of every
    worker, a message latency), changes. Over MPI (4 processes) this made
    QSGD's ResNet-20-sized step 1.26x faster. ``"allreduce"`` sums each tensor
    on its own: packing dense tensors costs a copy, and the uncompressed
    VGG16-sized step measured 10 % slower packed (628 ms against 568 ms, 8
    simulated CPU devices). ``"broadcast"`` and ``compress_allreduce`` hooks
    are per tensor too. ``fuse=False`` gathers per tensor (e.g. to let a
    backend overlap one tensor's communication with the next one's
    compression, or to bound memory: fused, the gathered small payloads of
    all tensors are held at once).

    Randomness: ``state.key`` starts at ``PRNGKey(compressor.seed)`` on every
    worker. Each step ``key, step_key = split(key)``; leaf ``i`` gets
    ``k_i = split(step_key, num_leaves)[i]``; the worker compresses with
    ``fold_in(k_i, comm.index())`` (independent across workers), or with
    ``k_i`` itself where workers must agree (allreduce with shared fields, the
    ``compress_allreduce`` hook).

    Wire volume: ``state.wire_bits[i]`` is the exact bits this worker sent for
    leaf ``i`` at the last step (its payload's :func:`~jaxcomm.wire_bits`;
    under ``allreduce`` only the summed fields).

    Pitfall: inside ``jax.shard_map``, ``jax.grad`` of replicated parameters
    silently sums the gradient over the axis; cast the parameters first with
    ``jax.lax.pcast(params, axis, to="varying")``. Where jax tracks it
    (``shard_map`` with ``check_vma=True``) an already-summed gradient raises
    ``ValueError`` here instead of being compressed after the fact.

    Args:
      compressor: a :class:`~jaxcomm.compressors.Compressor`.
      axis_name: the mesh axis to average over (e.g. ``"data"``).
      comm: a :class:`~jaxcomm.comm.Communicator` instead (e.g.
        ``jaxcomm.comm.MPIComm()``). With neither, the ambient communicator of
        ``jaxcomm.comm.use(...)`` is used when the step is traced.
      memory: a :class:`~jaxcomm.memory.Memory`; default
        :func:`~jaxcomm.memory.none` (pass ``residual()`` for error feedback).
      strategy: one of :data:`STRATEGIES`.
      fuse: all-gather the payloads up to :data:`FUSE_MAX_BYTES` with one collective (default)
        or every payload with its own.
    Returns:
      ``GradientTransformationExtraArgs`` with per-worker state :class:`CompressedMeanState`.
    Raises:
      ValueError: unknown ``strategy``; ``"allreduce"`` for a compressor whose
        payloads cannot be summed; a compressor strategy or a communicator that
        cannot serve the requested strategy; both ``axis_name`` and ``comm``;
        (at trace time) the axis is not bound, the tree differs from ``init``'s,
        or the gradient was already summed over the axis.
      TypeError: wrong types for ``compressor``, ``memory`` or ``comm``.
    """
    compressor = check_compressor(compressor)
    memory = memory_lib.none() if memory is None else check_memory(memory)
    comm_obj = resolve(axis_name, comm)
    if strategy not in STRATEGIES:
        raise ValueError(f"strategy must be one of {STRATEGIES}; got {strategy!r}")
    if compressor.strategy not in _COMPRESSOR_STRATEGIES:
        raise ValueError(
            f"compressor {compressor.name!r} declares strategy {compressor.strategy!r}, which compressed_mean "
            f"cannot serve (compressor strategies it serves: {_COMPRESSOR_STRATEGIES})"
        )
    if not isinstance(fuse, bool):
        raise TypeError(f"fuse must be a bool; got {type(fuse).__name__}")
    chosen = compressor.strategy if strategy == "auto" else strategy
    hook = getattr(compressor, "compress_allreduce", None)
    if chosen == "allreduce" and compressor.strategy != "allreduce" and hook is None:
        raise ValueError(
            f"strategy='allreduce' was requested but compressor {compressor.name!r} has strategy "
            f"{compressor.strategy!r}: its payloads cannot be summed as they are (and it has no "
            f"compress_allreduce hook); use strategy='allgather' or 'broadcast' (or 'auto')"
        )
    use_hook = chosen == "allreduce" and hook is not None
    scale = float(memory.output_scale)
    if axis_name is not None or comm is not None:
        _check_served(comm_obj, chosen, compressor)

    def init_fn(params):
        return CompressedMeanState(*init_leaves(params, compressor, memory))

    def update_fn(updates, state, params=None, **extra_args):
        del params, extra_args
        c = comm_obj
        n = int(c.size)  # raises ValueError naming the axis where it is not bound
        _check_served(c, chosen, compressor)
        leaves, treedef, mem_leaves = flatten_updates(updates, state)
        _check_gradients_are_per_worker(c, leaves)
        key, keys = step_keys(state.key, len(leaves))
        index = c.index()
        # 1. Per tensor: compensate and compress (a compress_allreduce hook communicates itself).
        phis, payloads, cstates, bits = [], [], [], []
        for i, (g, m, cs) in enumerate(zip(leaves, mem_leaves, state.compressor_states)):
            phi = memory.compensate(m, g)
            if use_hook:
                payload, cs = hook(phi, keys[i], cs, c)
                nbits = bits_int32(wire_bits(payload))
            else:
                payload, cs_new = compressor.compress(phi, jax.random.fold_in(keys[i], index), cs)
                if chosen == "allreduce":
                    summable = _summable_fields(compressor, payload)
                    if any(f not in summable for f in _data_fields(payload)):
                        # Shared fields must agree on every worker: compress with the shared key.
                        payload, cs_new = compressor.compress(phi, keys[i], cs)
                    nbits = bits_int32(sum(_array_bits(getattr(payload, f)) for f in summable))
                else:
                    nbits = bits_int32(wire_bits(payload))
                cs = cs_new
            phis.append(phi)
            payloads.append(payload)
            cstates.append(cs)
            bits.append(nbits)

        # 2. Communicate: with fuse, one collective for every tensor of the step.
        acc = [jnp.promote_types(jnp.result_type(g), jnp.float32) for g in leaves]
        if use_hook:  # the payload already holds the sum over workers
            totals = [compressor.decompress(p).astype(a) for p, a in zip(payloads, acc)]
        elif chosen == "allreduce":
            fields = [{f: getattr(p, f) for f in type(p).summable} for p in payloads]
            sums = [c.sum(f) for f in fields]
            totals = [compressor.decompress(dataclasses.replace(p, **s)).astype(a)
                      for p, s, a in zip(payloads, sums, acc)]
        elif chosen == "allgather":
            gathered = _gather_payloads(c, payloads, fuse)
            totals = [_sum_decompressed(compressor, gp, n, a) for gp, a in zip(gathered, acc)]
        else:  # broadcast: root r's payload to everyone, for r = 0..n-1
            totals = []
            for p, g, a in zip(payloads, leaves, acc):
                total = jnp.zeros(jnp.shape(g), a)
                for r in range(n):
                    total = total + compressor.decompress(c.broadcast(p, r)).astype(a)
                totals.append(total)

        # 3. Per tensor: the mean, and the memory update with this worker's own reconstruction.
        outs, mems = [], []
        for g, m, phi, payload, total in zip(leaves, mem_leaves, phis, payloads, totals):
            dtype = jnp.result_type(g)
            mean = total / n
            if use_hook:  # the memory keeps the aggregated reconstruction (GRACE's PowerSGD convention)
                mems.append(memory.update(m, g, phi, mean.astype(dtype)))
            elif memory.from_error is not None:
                mems.append(memory.from_error(m, compressor.error(phi, payload)))
            else:
                mems.append(memory.update(m, g, phi, compressor.decompress(payload)))
            out = mean if scale == 1.0 else mean * scale
            outs.append(out.astype(dtype))
        new_state = CompressedMeanState(
            count=state.count + 1,
            key=key,
            memory=jax.tree_util.tree_unflatten(treedef, mems),
            compressor_states=tuple(cstates),
            wire_bits=jnp.stack(bits) if bits else jnp.zeros((0,), jnp.int32),
        )
        return jax.tree_util.tree_unflatten(treedef, outs), new_state

    return optax.GradientTransformationExtraArgs(init_fn, update_fn)


FUSE_MAX_BYTES = 1 << 20
"""``compressed_mean(fuse=True)`` packs the payloads of at most this many bytes (per worker) into
one all-gather; a larger payload is gathered on its own (Horovod's fusion threshold). Over MPI
(4 processes, experiments/benchmarks/fusion_mpi.py) packing every payload made QSGD's
VGG16-sized step 1.29x slower (its 2.4 MB payloads were copied into the buffer for little
saved latency), while packing the small ones made the ResNet-20-sized step 1.26x faster."""


def _gather_payloads(comm, payloads: list, fuse: bool) -> list:
    """``[comm.all_gather(p) for p in payloads]``; with ``fuse``, the payloads of at most
    :data:`FUSE_MAX_BYTES` share one :func:`~jaxcomm.comm.all_gather_packed` collective."""
    bits = [sum(map(_array_bits, jax.tree.leaves(p))) for p in payloads]
    small = [i for i, b in enumerate(bits) if fuse and b <= 8 * FUSE_MAX_BYTES]
    packed = dict(zip(small, all_gather_packed(comm, [payloads[i] for i in small]))) if small else {}
    return [packed[i] if i in packed else comm.all_gather(p) for i, p in enumerate(payloads)]


_UNROLL_MAX = 16
"""Up to this many workers, the gathered payloads are decompressed in one unrolled sum."""


def _sum_decompressed(compressor: Compressor, gathered, n: int, acc_dtype):
    """``sum_i decompress(gathered[i])`` over the ``n`` gathered payloads, in ``acc_dtype``.

    A compressor with a ``decompress_sum`` hook computes the sum itself (sparse
    payloads: one scatter-add of all ``n k`` entries into one dense buffer,
    instead of ``n`` dense tensors; with ``compression_error`` it took the
    top-k step on 8 simulated CPU devices with a VGG16-sized tree at 1 %
    density from 2.05x to 1.82x and 1.94x (two runs) the uncompressed step,
    docs/benchmarks.md).
    Otherwise, for ``n <= _UNROLL_MAX`` the sum is written out: for an
    elementwise decoder (sign, 1-bit, QSGD, ... codes) XLA fuses the ``n``
    decodes and the adds into one pass that reads the ``n`` payloads and writes
    the dense sum once (measured on 8 simulated CPU devices, VGG16-sized
    signSGD: 2.4x faster than a loop, faster than the uncompressed all-reduce).
    Beyond that, a ``lax.scan`` keeps the program small: one decode and one
    dense read-modify-write per payload.
    """
    hook = getattr(compressor, "decompress_sum", None)
    if hook is not None:
        return hook(gathered, acc_dtype)

    def one(i):
        return compressor.decompress(jax.tree.map(lambda a: a[i], gathered)).astype(acc_dtype)

    if n <= _UNROLL_MAX:
        total = one(0)
        for i in range(1, n):
            total = total + one(i)
        return total

    def add_one(total, payload):
        return total + compressor.decompress(payload).astype(acc_dtype), None

    rest = jax.tree.map(lambda a: a[1:], gathered)
    return jax.lax.scan(add_one, one(0), rest)[0]


_COLLECTIVE = {"allreduce": "sum", "allgather": "all_gather", "broadcast": "broadcast"}


def _check_served(comm, chosen: str, compressor: Compressor) -> None:
    """``ValueError`` if ``comm`` declares the strategies it serves and ``chosen`` is not one.

    A communicator may expose ``strategies`` (a tuple of strategy names), e.g.
    a partial-collective backend that can only sum; the mesh and MPI backends
    serve all three.
    """
    served = getattr(comm, "strategies", None)
    if served is not None and chosen not in tuple(served):
        raise ValueError(
            f"communicator {comm!r} serves strategies {tuple(served)} but compressor {compressor.name!r} "
            f"needs {chosen!r}"
        )
    if not callable(getattr(comm, _COLLECTIVE[chosen], None)):
        raise ValueError(
            f"communicator {comm!r} has no {_COLLECTIVE[chosen]}() to serve strategy {chosen!r} "
            f"for compressor {compressor.name!r}"
        )
