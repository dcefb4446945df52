"""Compressed data-parallel gradient mean: GRACE Algorithm 1 on a communicator.

The pipeline (:mod:`._pipeline`) with the workers' communicator: every worker
compensates, compresses and sends its payload, and receives the mean of the
decompressed payloads, identical on every worker.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import optax

from .. import compressors as compressors_lib
from .. import memory as memory_lib
from .._bitcount import BitCount
from .._vma import typed_cond
from ..comm import resolve
from ..compressors._base import Compressor
from ._pipeline import (
    FUSE_MAX_BYTES,
    STRATEGIES,
    CompressionState,
    Owner,
    check_compressor,
    check_memory,
    check_served,
    choose_strategy,
    compress_step,
    init_state,
    sums_in_16_bits,
)

__all__ = ["FUSE_MAX_BYTES", "STRATEGIES", "compressed_mean"]


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
    own reconstruction (for PowerSGD's rounds, the aggregated one: GRACE's and
    PyTorch's convention).

    Strategies (GRACE Sec. IV-B; :mod:`jaxcomm.transforms` has the details):
      * ``"allreduce"``: the payloads' ``summable`` fields are summed with one
        all-reduce and decompressed once, ``Q⁻¹(Σ_i g̃_i)/n`` (none, fp16,
        random-k with a shared key: fields not summed must agree, so such
        compressors draw with the *shared* key). A compressor with ``rounds``
        (PowerSGD) runs them, every tensor's round ``r`` at once. With ``fuse``
        (default), the fields and round messages of at most :data:`FUSE_MAX_BYTES`
        share one all-reduce per dtype (:func:`~jaxcomm.comm.sum_packed`): PowerSGD
        sends two messages per step instead of two per matrix.
      * ``"allgather"``: every worker's payload is gathered and decompressed.
        With ``fuse`` (default), payloads of at most :data:`FUSE_MAX_BYTES`
        share one collective (Horovod's tensor fusion); the numbers and bytes
        are identical either way, only the count of collectives changes.
      * ``"broadcast"``: each worker's payload is broadcast in turn.
      * ``"reduce_scatter"``: chunks travel compressed to their owners, who
        average in float32 and compress again; the compressed chunks are
        all-gathered (stateless single-round compressors).
      * ``"auto"``: the compressor's own ``strategy``; except that a 16-bit
        ``"allreduce"`` payload (fp16, bf16) with a memory that keeps the compression
        error (``residual``, ``efsignsgd``) takes ``"reduce_scatter"``, the same bytes
        as a ring all-reduce, so that the sum is taken in float32 and the owners'
        rounding of the average is fed back too (error feedback then conserves the
        gradient exactly, up to float32 sums).

    Under ``"reduce_scatter"`` with such a memory, the owner of each chunk adds
    ``n (mean − Q(mean))`` (its re-compression's rounding) to its own memory on that
    chunk, so ``Σ_i m_i + n ḡ = Σ_i φ_i`` holds after every step.

    Randomness: ``state.key`` starts at ``PRNGKey(compressor.seed)`` on every
    worker; each step ``key, step_key = split(key)`` and leaf ``i`` gets
    ``k_i = split(step_key, num_leaves)[i]``; a worker compresses with
    ``fold_in(k_i, comm.index())`` (with one worker: ``k_i``), or with ``k_i``
    itself where workers must agree (shared payload fields, rounds). Under
    ``"reduce_scatter"`` chunk ``c`` is compressed with ``split(k, n)[c]``, and
    the owners draw from ``fold_in(fold_in(k_i, n), owner)``.

    Wire volume: ``state.wire_bits[i]`` is the exact bits this worker sent for
    leaf ``i`` at the last step (its payload; under ``"allreduce"`` only the
    summed fields; for rounds, every message).

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
      strategy: ``"auto"`` or one of :data:`STRATEGIES`.
      fuse: all-gather the payloads up to :data:`FUSE_MAX_BYTES` with one
        collective, and all-reduce the summed arrays up to that size with one per
        dtype (default); or every payload (array) with its own.
    Returns:
      ``GradientTransformationExtraArgs`` with per-worker state
      :class:`~jaxcomm.transforms.CompressionState`.
    Raises:
      ValueError: at ``init``, a memory that feeds back (any but ``none``) around an
        unbiased compressor whose variance factor is ``ω ≥ 1`` at a tensor's size (it would
        diverge; :func:`jaxcomm.compressors.contractive` scales it into a contraction).
      ValueError: unknown ``strategy``; ``"allreduce"`` for a compressor whose
        payloads cannot be summed; a communicator that cannot serve the
        strategy; both ``axis_name`` and ``comm``; (at trace time) the axis is
        not bound, the tree differs from ``init``'s, or the gradient was
        already summed over the axis.
      TypeError: wrong types for ``compressor``, ``memory``, ``comm`` or ``fuse``.
    """
    compressor = check_compressor(compressor, dense_warmup=True)
    memory = memory_lib.none() if memory is None else check_memory(memory)
    comm_obj = resolve(axis_name, comm)
    if not isinstance(fuse, bool):
        raise TypeError(f"fuse must be a bool; got {type(fuse).__name__}")
    chosen = choose_strategy(compressor, strategy)
    feeds_back = memory.from_error is not None  # the memory is the compression error itself
    if strategy == "auto" and feeds_back and sums_in_16_bits(compressor):
        # A 16-bit all-reduce rounds the sum where no memory sees it; the reduce-scatter route (the same
        # bytes as a ring all-reduce) sums in float32 at the chunks' owners, who feed the rounding back.
        chosen = "reduce_scatter"
    fold = chosen == "reduce_scatter" and feeds_back
    scale = float(memory.output_scale)
    if axis_name is not None or comm is not None:
        check_served(comm_obj, chosen, compressor)
    no_memory = memory_lib.none()

    def owner_step(keys, n):
        return Owner(compressor, no_memory, [()] * len(keys), [jax.random.fold_in(k, n) for k in keys], fold)

    def init_fn(params):
        return init_state(params, compressor, memory)

    warmup = compressor.dense_warmup
    dense = compressors_lib.none()

    def update_fn(updates, state: CompressionState, params=None, **extra_args):
        del params, extra_args
        n = int(comm_obj.size)  # raises ValueError naming the axis where it is not bound
        check_served(comm_obj, chosen, compressor)
        if not warmup:
            return compressed(updates, state, n)

        def dense_step(_):
            # The uncompressed mean (one all-reduce per tensor); memory and compressor states untouched.
            plain = state._replace(compressor_states=tuple(() for _ in state.compressor_states))
            ex, leaves, treedef, new, _ = compress_step(
                comm_obj, updates, plain, compressor=dense, memory=no_memory, strategy="allreduce", fuse=fuse
            )
            outs = [m.astype(g.dtype) for m, g in zip(ex.means, leaves)]
            return treedef.unflatten(outs), new._replace(memory=state.memory, compressor_states=state.compressor_states)

        return typed_cond(state.count < warmup, dense_step, lambda _: compressed(updates, state, n))

    def compressed(updates, state, n):
        ex, leaves, treedef, new_state, _ = compress_step(
            comm_obj,
            updates,
            state,
            compressor=compressor,
            memory=memory,
            strategy=chosen,
            fuse=fuse,
            owner_step=(lambda keys: owner_step(keys, n)) if chosen == "reduce_scatter" else None,
        )
        if fold:  # this worker owns a chunk of each tensor: n (mean − Q(mean)) joins its memory there
            new_state = new_state._replace(
                memory=jax.tree.map(jnp.add, new_state.memory, treedef.unflatten(ex.owner_memory))
            )
        bits = new_state.wire_bits
        if chosen == "reduce_scatter" and ex.owner_bits:  # the chunks sent, then the averaged chunk
            bits = bits + BitCount.stack(ex.owner_bits)
        outs = [(m if scale == 1.0 else m * scale).astype(g.dtype) for m, g in zip(ex.means, leaves)]
        return treedef.unflatten(outs), new_state._replace(wire_bits=bits)

    return optax.GradientTransformationExtraArgs(init_fn, update_fn)
