"""DoubleSqueeze: error-compensated compression on the workers *and* the server.

Tang, Lian, Yu, Zhang, Liu (2019), "DoubleSqueeze: Parallel Stochastic
Gradient Descent with Double-Pass Error-Compensated Compression", Algorithm 1.
At step t, with compressor Q and learning rate γ:

    worker i:  v_t^(i) = g_t^(i) + δ_{t-1}^(i);   send Q[v_t^(i)];   δ_t^(i) = v_t^(i) − Q[v_t^(i)]
    server:    v_t = δ_{t-1} + (1/n) Σ_i Q[v_t^(i)];   send Q[v_t];   δ_t = v_t − Q[v_t]
    update:    x_{t+1} = x_t − γ Q[v_t]

No unbiasedness is required of Q: 1-bit with the scale ‖v‖₂/‖sign(v)‖₂
(:func:`jaxcomm.compressors.scaled_sign`), top-k, clipping, stochastic rounding
and random sparsification all converge.

There is no separate server process. Two placements of the server step:

* ``server="replicated"``: the worker half is exactly
  :func:`~jaxcomm.transforms.compressed_mean` with residual memory (the
  workers' payloads are summed or all-gathered and averaged), and every worker
  then runs the server half, :func:`~jaxcomm.transforms.error_feedback` of the
  average, itself: identical inputs and an identical PRNG key, so the server
  error δ is the same on every worker and nothing more is sent.
* ``server="sharded"`` (DeepSpeed's compressed allreduce): each worker owns one
  of n chunks of every tensor. The workers compress their n chunks and send
  each to its owner (n − 1 permutation rounds: an all-to-all, i.e. a
  compressed reduce-scatter); the owner averages its chunk, compensates it with
  its part of the server error, compresses, and the compressed chunks are
  all-gathered.

The transform emits ``Q[v_t]`` (identical on every worker); chain an optimizer
after it, e.g. ``optax.chain(doublesqueeze(...), optax.sgd(γ))`` for the paper's
update. The paper's baselines are ready-made: :func:`memsgd` (worker error
feedback only, the server sends the average uncompressed),
:func:`qsgd_no_feedback` and :func:`topk_no_feedback`.
"""

from __future__ import annotations

from typing import NamedTuple

import jax
import jax.numpy as jnp
import numpy as np
import optax

from .. import memory as memory_lib
from ..comm import resolve
from ..compressors._base import Compressor, make, wire_bits
from ._compressed_mean import CompressedMeanState, _check_gradients_are_per_worker, _check_served, compressed_mean
from ._error_feedback import (
    ErrorFeedbackState,
    bits_int32,
    check_compressor,
    check_memory,
    error_feedback,
    flatten_updates,
    step_keys,
)

__all__ = [
    "DoubleSqueezeState",
    "doublesqueeze",
    "memsgd",
    "qsgd_no_feedback",
    "topk_no_feedback",
]

SERVER_MODES = ("replicated", "sharded")


class DoubleSqueezeState(NamedTuple):
    """State of :func:`doublesqueeze` (one worker's view; same layout for both server modes).

    Attributes:
      worker: :class:`~jaxcomm.transforms.CompressedMeanState` of the worker
        half. ``worker.memory`` holds the worker errors ``δ^(i)`` (a tree like
        the parameters) and is **per worker**: it differs between workers.
        ``worker.wire_bits[l]``: bits this worker sent for leaf ``l`` (its
        payload; sharded: its n − 1 chunk payloads).
      server: :class:`~jaxcomm.transforms.ErrorFeedbackState` of the server
        half. ``server.memory`` holds the server error ``δ`` (a tree like the
        parameters). ``server="replicated"``: **identical on every worker**,
        and ``server.wire_bits`` is zero (the server step is recomputed, not
        sent). ``server="sharded"``: each worker holds the entries of the
        chunks it owns and zeros elsewhere, and ``server.wire_bits[l]`` is its
        compressed chunk's size.
    """

    worker: CompressedMeanState
    server: ErrorFeedbackState


# --------------------------------------------------------------------------- #
# chunk helpers (server="sharded")
# --------------------------------------------------------------------------- #
def _chunk_len(size: int, n: int) -> int:
    return -(-size // n)


def _to_chunks(x, n: int):
    """``x`` flattened, zero-padded to ``n·c`` entries (``c = ceil(size/n)``) and reshaped ``(n, c)``."""
    flat = jnp.ravel(x)
    c = _chunk_len(flat.shape[0], n)
    return jnp.pad(flat, (0, n * c - flat.shape[0])).reshape(n, c)


def _from_chunks(chunks, shape):
    """Inverse of :func:`_to_chunks`: drop the padding, restore ``shape``."""
    size = int(np.prod(shape, dtype=np.int64))
    return chunks.reshape(-1)[:size].reshape(shape)


def _take_chunk(tree, n: int, me):
    """Chunk ``me`` (traced index) of every array of ``tree``."""
    return jax.tree.map(lambda a: jax.lax.dynamic_index_in_dim(_to_chunks(a, n), me, keepdims=False), tree)


def _put_chunk(tree, chunk_tree, n: int, me):
    """``tree`` with chunk ``me`` of every array replaced by ``chunk_tree``'s."""

    def put(full, part):
        chunks = jax.lax.dynamic_update_index_in_dim(_to_chunks(full, n), part.astype(full.dtype), me, 0)
        return _from_chunks(chunks, jnp.shape(full))

    return jax.tree.map(put, tree, chunk_tree)


def _is_stateless(c: Compressor) -> bool:
    return not jax.tree.leaves(c.init_state(jnp.zeros((2,), jnp.float32)))


def _sharded_update(worker_c, server_c, worker_mem, server_mem, comm, updates, state: DoubleSqueezeState):
    """One DoubleSqueeze step with the server step split over chunk owners (see module docstring)."""
    n = int(comm.size)
    _check_served(comm, "allgather", server_c)
    leaves, treedef, w_mems = flatten_updates(updates, state.worker)
    _, _, s_mems = flatten_updates(updates, state.server)
    _check_gradients_are_per_worker(comm, leaves)
    me = comm.index()
    w_key, w_keys = step_keys(state.worker.key, len(leaves))
    s_key, s_keys = step_keys(state.server.key, len(leaves))

    # Worker half: v_i = φ(δ_i, g_i), compressed chunk by chunk.
    phis, stacked, g_hats = [], [], []
    for i, (g, m) in enumerate(zip(leaves, w_mems)):
        phi = worker_mem.compensate(m, g)
        # independent draws per worker, except for summable payloads (shared fields must agree)
        k = w_keys[i] if worker_c.strategy == "allreduce" else jax.random.fold_in(w_keys[i], me)
        chunk_keys = jax.random.split(k, n)
        payloads = jax.vmap(lambda x, kk: worker_c.compress(x, kk, ())[0])(_to_chunks(phi, n), chunk_keys)
        phis.append(phi)
        stacked.append(payloads)
        g_hats.append(_from_chunks(jax.vmap(worker_c.decompress)(payloads), jnp.shape(g)).astype(phi.dtype))

    # Compressed reduce-scatter: in round r, chunk (me + r) % n goes to its owner.
    received = [jax.tree.map(lambda a: a[me], stacked)]
    w_bits = [0] * len(leaves)
    for r in range(1, n):
        send = jax.tree.map(lambda a, r=r: a[(me + r) % n], stacked)
        w_bits = [b + wire_bits(p) for b, p in zip(w_bits, send)]
        received.append(comm.permute(send, [(s, (s + r) % n) for s in range(n)]))

    # Server half on the owned chunk: v = δ + (1/n) Σ_i Q[v_i];  δ = v − Q[v].
    server_payloads, new_s_mems, s_bits = [], [], []
    for i, (g, sm_full) in enumerate(zip(leaves, s_mems)):
        dtype = jnp.result_type(g)
        acc = jnp.promote_types(dtype, jnp.float32)
        size = int(np.size(g))
        c = _chunk_len(size, n)
        real = me * c + jnp.arange(c) < size  # entries of this chunk that are not padding
        total = jnp.zeros((c,), acc)
        for rec in received:
            total = total + worker_c.decompress(rec[i]).astype(acc)
        mean = jnp.where(real, total / n, 0).astype(dtype)
        sm = _take_chunk(sm_full, n, me)
        v = server_mem.compensate(sm, mean)
        payload, _ = server_c.compress(v, jax.random.fold_in(s_keys[i], me), ())
        q = jnp.where(real, server_c.decompress(payload), 0).astype(v.dtype)
        new_s_mems.append(_put_chunk(sm_full, server_mem.update(sm, mean, v, q), n, me))
        server_payloads.append(payload)
        s_bits.append(bits_int32(wire_bits(payload)))

    # Compressed all-gather of the owners' chunks.
    gathered = comm.all_gather(server_payloads)
    scale = worker_mem.output_scale * server_mem.output_scale
    outs = []
    for g, payloads in zip(leaves, gathered):
        full = _from_chunks(jax.vmap(server_c.decompress)(payloads), jnp.shape(g))
        outs.append((full if scale == 1.0 else full * scale).astype(jnp.result_type(g)))

    new_w_mems = [worker_mem.update(m, g, phi, gh) for m, g, phi, gh in zip(w_mems, leaves, phis, g_hats)]
    worker = CompressedMeanState(
        count=state.worker.count + 1,
        key=w_key,
        memory=jax.tree_util.tree_unflatten(treedef, new_w_mems),
        compressor_states=state.worker.compressor_states,
        wire_bits=jnp.stack([bits_int32(b) for b in w_bits]) if leaves else jnp.zeros((0,), jnp.int32),
    )
    server = ErrorFeedbackState(
        count=state.server.count + 1,
        key=s_key,
        memory=jax.tree_util.tree_unflatten(treedef, new_s_mems),
        compressor_states=state.server.compressor_states,
        wire_bits=jnp.stack(s_bits) if leaves else jnp.zeros((0,), jnp.int32),
    )
    return jax.tree_util.tree_unflatten(treedef, outs), DoubleSqueezeState(worker, server)


# --------------------------------------------------------------------------- #
# public constructors
# --------------------------------------------------------------------------- #
def doublesqueeze(
    compressor: Compressor,
    *,
    axis_name: str | None = None,
    comm=None,
    server_compressor: Compressor | None = None,
    server: str = "replicated",
    worker_memory: memory_lib.Memory | None = None,
    server_memory: memory_lib.Memory | None = None,
) -> optax.GradientTransformationExtraArgs:
    """DoubleSqueeze (Tang et al. 2019, Algorithm 1): error-compensated compression on both passes.

    Per leaf, on worker i of n (``v``, ``δ`` have the leaf's shape and dtype)::

        v_i = g_i + δ_i;  δ_i ← v_i − Q(v_i)                    (worker_memory: residual)
        v = δ + (1/n) Σ_i Q(v_i);  δ ← v − Q_s(v)               (server_memory: residual)
        output Q_s(v)                                            (identical on every worker)

    Randomness: the worker half follows
    :func:`~jaxcomm.transforms.compressed_mean`'s key schedule (key
    ``PRNGKey(compressor.seed)``, folded with the worker index unless the
    payload is summable); the server half follows
    :func:`~jaxcomm.transforms.error_feedback`'s, from
    ``fold_in(PRNGKey(server_compressor.seed), 1)`` so that it is independent
    of the workers' draws (sharded: also folded with the chunk owner's index).

    Args:
      compressor: the workers' compressor ``Q``: any single-round
        :class:`~jaxcomm.compressors.Compressor`; biased ones are fine (e.g.
        ``scaled_sign()``, ``topk(ratio)``).
      axis_name: mesh axis to communicate over (inside ``jax.shard_map`` or
        ``jax.vmap(..., axis_name=...)``).
      comm: any :class:`~jaxcomm.comm.Communicator` instead (e.g. MPI). With
        neither, the ambient communicator of :func:`jaxcomm.comm.use`.
      server_compressor: the server's ``Q_s`` (default: ``compressor``).
      server: ``"replicated"`` (every worker runs the server step on the
        gathered average; one collective per leaf) or ``"sharded"`` (each
        worker owns a ``ceil(d/n)``-entry chunk of every ``d``-entry tensor:
        compressed reduce-scatter in n − 1 permutation rounds, server step on
        the chunk, compressed all-gather; the compressors then act on each
        zero-padded chunk and must be stateless).
      worker_memory: worker error feedback (default
        :func:`jaxcomm.memory.residual`: ``v_i = g_i + δ_i``).
      server_memory: server error feedback (default ``residual()``).

    Returns:
      An optax transformation with state :class:`DoubleSqueezeState`; ``update``
      maps each worker's gradient tree to ``Q_s(v)``.

    Raises:
      TypeError: ``compressor``/``server_compressor`` not a Compressor, a
        memory not a Memory, ``comm`` not a Communicator.
      ValueError: a compressor strategy the communicator cannot serve, a
        multi-round compressor (``compress_allreduce``), a stateful compressor
        with ``server="sharded"``, an unknown ``server``; at trace time, a
        gradient tree that differs from the one ``init`` saw.
    """
    compressor = _single_round(check_compressor(compressor), "compressor")
    server_c = compressor if server_compressor is None else check_compressor(server_compressor)
    server_c = _single_round(server_c, "server_compressor")
    worker_mem = memory_lib.residual() if worker_memory is None else check_memory(worker_memory)
    server_mem = memory_lib.residual() if server_memory is None else check_memory(server_memory)
    if server not in SERVER_MODES:
        raise ValueError(f"server must be one of {SERVER_MODES}; got {server!r}")
    if server == "sharded":
        for c, name in ((compressor, "compressor"), (server_c, "server_compressor")):
            if not _is_stateless(c):
                raise ValueError(
                    f"server='sharded' compresses chunks whose size depends on the number of workers, so "
                    f"{name} {c.name!r} must be stateless; use server='replicated'"
                )
    communicator = resolve(axis_name=axis_name, comm=comm)
    # The worker half *is* compressed_mean (which also validates the strategy against the communicator).
    worker_tx = compressed_mean(compressor, axis_name=axis_name, comm=comm, memory=worker_mem)
    # The server half is error feedback of the (identical) average, run on every worker.
    server_tx = error_feedback(server_c, server_mem)

    def init(params):
        server_state = server_tx.init(params)
        return DoubleSqueezeState(
            worker=worker_tx.init(params),
            server=server_state._replace(key=jax.random.fold_in(server_state.key, 1)),
        )

    def update(updates, state, params=None, **extra_args):
        del params, extra_args
        if not isinstance(state, DoubleSqueezeState):
            raise TypeError(f"state must be a DoubleSqueezeState (from init); got {type(state).__name__}")
        if server == "sharded":
            return _sharded_update(compressor, server_c, worker_mem, server_mem, communicator, updates, state)
        mean, worker_state = worker_tx.update(updates, state.worker)
        out, server_state = server_tx.update(mean, state.server)
        # Recomputed identically on every worker: the server step sends nothing.
        server_state = server_state._replace(wire_bits=jnp.zeros_like(server_state.wire_bits))
        return out, DoubleSqueezeState(worker_state, server_state)

    return optax.GradientTransformationExtraArgs(init, update)


def _single_round(c: Compressor, name: str) -> Compressor:
    if getattr(c, "compress_allreduce", None) is not None:
        raise ValueError(
            f"{name} {c.name!r} is a multi-round method that communicates inside compress_allreduce; "
            "DoubleSqueeze needs every worker's own single-round payload Q(v_i) and its error v_i - Q(v_i)"
        )
    if c.strategy not in ("allreduce", "allgather"):
        raise ValueError(
            f"{name} {c.name!r} declares strategy {c.strategy!r}, which a communicator cannot serve here: "
            "payloads must be summable ('allreduce') or gathered ('allgather')"
        )
    return c


def memsgd(
    compressor: Compressor, *, axis_name: str | None = None, comm=None
) -> optax.GradientTransformationExtraArgs:
    """MEM-SGD, DoubleSqueeze's baseline: worker error feedback, uncompressed server.

    ``v_i = g_i + δ_i``; ``δ_i ← v_i − Q(v_i)``; output ``(1/n) Σ_i Q(v_i)``:
    the server sends the average as it is, so it keeps no error. This is
    exactly ``compressed_mean(compressor, memory=jaxcomm.memory.residual())``
    (state :class:`~jaxcomm.transforms.CompressedMeanState`); arguments as in
    :func:`doublesqueeze`.
    """
    return compressed_mean(
        check_compressor(compressor), axis_name=axis_name, comm=comm, memory=memory_lib.residual()
    )


def qsgd_no_feedback(
    levels: int = 1, *, axis_name: str | None = None, comm=None, seed: int = 0
) -> optax.GradientTransformationExtraArgs:
    """DoubleSqueeze's "QSGD" baseline: ``(1/n) Σ_i Q(g_i)``, no error feedback, uncompressed server.

    ``Q = jaxcomm.compressors.qsgd(levels=levels)`` (``levels=1``: a norm times
    ternary codes in {−1, 0, 1}, as in the paper's comparison), an unbiased
    quantiser, so it converges without feedback. Exactly
    ``compressed_mean(qsgd(levels=levels, seed=seed))`` (memory ``none``).
    """
    return compressed_mean(make("qsgd", levels=levels, seed=seed), axis_name=axis_name, comm=comm)


def topk_no_feedback(
    ratio: float = 0.01, *, axis_name: str | None = None, comm=None
) -> optax.GradientTransformationExtraArgs:
    """DoubleSqueeze's "Top-k SGD" baseline: ``(1/n) Σ_i topk(g_i)`` without error feedback.

    The dropped entries are discarded and the server sends the average
    uncompressed. ``ratio`` is the kept fraction, as in
    ``jaxcomm.compressors.topk``. Exactly ``compressed_mean(topk(ratio))``.
    """
    return compressed_mean(make("topk", ratio=ratio), axis_name=axis_name, comm=comm)
