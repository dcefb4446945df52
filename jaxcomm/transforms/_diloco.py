"""The DiLoCo family: local steps, then an outer step on the workers' compressed pseudo-gradient.

DiLoCo (Douillard et al., 2023, Algorithm 1) trains every worker ``i`` alone for ``H`` inner
steps from the shared parameters ``θ`` (the *anchor*), then takes one outer step on the mean
pseudo-gradient::

    θ_i ← θ;  H × (θ_i ← θ_i + inner(g_i))                    inner steps, no communication
    Δ_i = θ − θ_i                                            the pseudo-gradient
    Δ̄ = (1/n) Σ_i Q⁻¹(Q(φ(m_i, Δ_i)))                         compressed mean (the pipeline)
    θ ← θ + outer(Δ̄)                                         outer step (Nesterov SGD by default)

The mean is :func:`~jaxcomm.compressed_mean` on the pseudo-gradient tree, so any compressor
and memory of the catalogue apply: int8 or 4-bit quantization of the outer gradient
(INTELLECT-1, Streaming DiLoCo), or top-k with the residual memory ``residual(beta)`` as the
outer momentum and plain ``sgd`` as the outer optimizer (SparseLoCo).

Streaming DiLoCo (Douillard et al., 2025) splits the parameters into ``F`` fragments that sync
in turn, fragment ``p`` at the steps ``t ≡ (p + 1) H / F (mod H)``; its exchange may overlap
``τ`` (``delay``) further inner steps, after which the new global fragment ``θ̃_p`` is blended
into the local one, ``θ_{i,p} ← α θ_{i,p} + (1 − α) θ̃_p`` (``blend = α``; ``α = 0`` takes the
global fragment, as plain DiLoCo). With ``carry_local`` the worker keeps instead what it learnt
during those ``τ`` steps: ``θ_{i,p} ← θ̃_p + (θ_{i,p} − θ^s_{i,p})``, ``θ^s_{i,p}`` its local
fragment at the sync (with ``τ = 0``: ``θ̃_p``, plain DiLoCo), so an overlapped exchange delays the
outer step without discarding inner steps.
"""

from __future__ import annotations

import itertools
from collections.abc import Sequence
from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
import numpy as np
import optax

from .. import compressors as compressors_lib
from .. import memory as memory_lib
from .._bitcount import BitCount
from .._keys import step_keys
from .._validate import check_bool, check_finite_scalar, check_int
from .._vma import cast_varying, typed_switch, varying_axes
from ..compressors import Compressor, wire_bits
from ._accumulate import zero_counters
from ._checks import check_compressor, check_memory, choose_strategy
from ._collectives import LOCAL, accumulator, sent_bits, sum_decompressed
from ._compressed_mean import compressed_mean
from ._pipeline import compress_step, scaled
from ._schedule import quiet_step, report_next_step
from ._state import CompressionState

__all__ = ["DiLoCoState", "diloco", "fragment_leaves"]


class DiLoCoState(NamedTuple):
    """Per-worker state of :func:`diloco`.

    Attributes:
      count: int32 scalar, inner steps taken (identical on every worker).
      anchor: the shared parameters ``θ`` (the last outer step's result, per fragment), a tree
        like the parameters; identical on every worker.
      inner_state: the inner optimizer's state (per worker).
      outer_states: tuple, the outer optimizer's state of each fragment (identical on every worker).
      exchange_states: tuple, the :class:`~jaxcomm.transforms.CompressionState` of each
        fragment's compressed mean (memories per worker; a
        :class:`~jaxcomm.transforms._hierarchical.HierarchicalState` with ``axis_name=(slow, fast)``). Its
        ``wire_bits`` and ``messages`` are this step's (zero on steps without an exchange), so
        the trainer's counters read them.
      pending: a tree like the parameters: the mean pseudo-gradient ``Δ̄`` of the fragment
        exchanged last, held until it is applied ``delay`` steps later (float32 or wider).
      synced: with ``carry_local``, a tree like the parameters: each fragment's local parameters
        at its last sync (per worker); ``None`` otherwise.
    """

    count: jax.Array  # type: ignore[assignment]  # optax's name for the step count; shadows tuple.count
    anchor: Any
    inner_state: Any
    outer_states: tuple
    exchange_states: tuple
    pending: Any
    synced: Any = None


def fragment_leaves(sizes: Sequence[int], fragments: int) -> list[list[int]]:
    """Contiguous groups of leaf indices of about equal size (Streaming DiLoCo's fragments).

    Fragment ``k`` starts at the first leaf (``jax.tree.leaves`` order) with at least ``k D / F``
    entries before it (``D`` the total), moved so that every fragment keeps at least one leaf:
    fragments are runs of consecutive leaves (layers) of about ``D / F`` entries each.

    Args:
      sizes: entries of each leaf.
      fragments: ``F``, at least 1 and at most ``len(sizes)``.
    Returns:
      ``F`` lists of leaf indices, in order.
    Raises:
      ValueError: ``fragments`` outside ``[1, len(sizes)]``.
    """
    fragments = check_int(fragments, "fragments", minimum=1)
    count = len(sizes)
    if fragments > count:
        raise ValueError(f"fragments must be at most the number of parameter arrays ({count}); got {fragments}")
    before = np.concatenate([[0], np.cumsum(np.asarray(sizes, np.float64))])  # entries before leaf j
    cuts = [0]
    for k in range(1, fragments):
        # the first leaf at or past k·D/F, leaving at least one leaf to each later fragment
        j = int(np.searchsorted(before, k * before[-1] / fragments, side="left"))
        cuts.append(min(max(j, cuts[-1] + 1), count - (fragments - k)))
    cuts.append(count)
    return [list(range(a, b)) for a, b in itertools.pairwise(cuts)]


def diloco(
    inner: optax.GradientTransformation,
    every: int,
    *,
    outer: optax.GradientTransformation | None = None,
    compressor: Compressor | None = None,
    memory: memory_lib.Memory | None = None,
    fragments: int = 1,
    delay: int = 0,
    blend: float = 0.0,
    carry_local: bool = False,
    axis_name: str | tuple[str, str] | None = None,
    comm=None,
    strategy: str = "auto",
    fuse: bool = True,
    overlap: bool = False,
    skip_nonfinite: bool = False,
) -> optax.GradientTransformationExtraArgs:
    """DiLoCo (and Streaming DiLoCo, SparseLoCo): ``every`` local steps, then an outer step.

    Long because an optax factory's closures share the validated hyper-parameters; each inner function is short.

    The whole optimizer: ``update(grads, state, params)`` returns the update of this worker's
    parameters. Per step ``t = count + 1`` (every worker takes the same branch):

    1. inner step: ``u, s_in = inner.update(g_i, s_in, θ_i)``; ``θ'_i = θ_i + u``;
    2. if fragment ``p`` syncs now (``t ≡ (p + 1) H / F (mod H)``): its pseudo-gradient
       ``Δ_{i,p} = θ_p − θ'_{i,p}`` goes through ``compressed_mean(compressor, memory)``, and the
       mean ``Δ̄_p`` waits in ``state.pending``;
    3. ``delay`` (``τ``) steps after fragment ``q`` synced: the outer step
       ``θ̃_q = θ_q + outer(Δ̄_q)`` (its own outer state), then
       ``θ'_{i,q} ← α θ'_{i,q} + (1 − α) θ̃_q`` and ``θ_q ← θ̃_q``;
    4. the update is ``θ'_i − θ_i``.

    While the trainer's step traces it (:mod:`jaxcomm.transforms._schedule`), ``update`` reports
    whether step ``t + 1`` sends or receives, and in the step's quiet program (run only where that
    report said no) it traces stages 2 and 3 as their no-communication branches alone.

    With ``every = 1``, ``outer = optax.sgd(1.0)``, no compressor and a memoryless ``inner``
    (``optax.sgd(lr)``), this is data-parallel SGD: ``θ ← θ − lr ḡ``. With ``every = H``,
    ``outer = sgd(1.0)``, it is local SGD with periodic averaging.

    Args:
      inner: the workers' optimizer (any optax transformation; it sees only local gradients).
      every: ``H``, inner steps between two syncs of a fragment, ``>= 1``.
      outer: the outer optimizer on ``Δ̄`` (default ``optax.sgd(0.7, momentum=0.9,
        nesterov=True)``, DiLoCo's).
      compressor: compresses the pseudo-gradient (default :func:`~jaxcomm.compressors.none`).
      memory: the pipeline's memory around it (default :func:`~jaxcomm.memory.none`;
        ``residual(beta)`` is SparseLoCo's error feedback as the outer momentum).
      fragments: ``F``, the number of parameter fragments that sync in turn (Streaming DiLoCo);
        ``every`` must be a multiple of ``F``. Fragments: :func:`fragment_leaves`.
      delay: ``τ``, inner steps between a fragment's exchange and the application of its outer
        step, ``0 <= τ < H / F``. On MPI with an overlapping communicator the exchange runs
        during those steps; elsewhere the mean is computed at once and applied ``τ`` steps later
        (the same numbers).
      blend: ``α`` in ``[0, 1)``, the weight of the local fragment when the global one arrives.
      carry_local: when the global fragment arrives, add to it this worker's progress since the
        sync, ``θ_{i,q} ← θ̃_q + (θ_{i,q} − θ^s_{i,q})``, instead of the blend (``blend`` must be
        0); the state keeps ``θ^s`` (one more copy of the parameters per worker). With
        ``delay = 0`` it is plain DiLoCo.
      axis_name / comm: the workers' communicator (default: the ambient one of
        :func:`jaxcomm.comm.use`, as set by the trainer). ``axis_name=(slow, fast)`` (e.g.
        ``("node", "local")``, the slow axis first) averages the pseudo-gradient with the
        hierarchical mean of :func:`~jaxcomm.compressed_mean`: a dense reduce-scatter over
        ``fast``, the compressor and memory on each ``1/L`` shard over ``slow`` only, an
        all-gather over ``fast`` (each of ``exchange_states`` is then a
        :class:`~jaxcomm.transforms._hierarchical.HierarchicalState`; ``init`` runs inside the
        ``shard_map`` or under ``jax.set_mesh``). Not with ``overlap``.
      strategy, fuse: of :func:`~jaxcomm.compressed_mean`.
      overlap: over MPI (the communicator an :class:`~jaxcomm.comm.MPIComm`), run each fragment's
        exchange in a communication thread (:class:`~jaxcomm.comm.AsyncMean`) that overlaps the
        ``delay`` inner steps after it. Two routes: the compressors ``none``, ``fp16`` and
        ``bf16`` without memory send their payload to a mean (the pipeline's ``allreduce``
        route, summed in float32); a single-round compressor whose strategy is ``"allgather"``
        (top-k, random-k, sign, ...; SparseLoCo's), with any memory, is compensated,
        compressed and its memory updated in the step, exactly as the pipeline does with
        that strategy, then its payload arrays are all-gathered by the thread, and ``delay``
        steps later every worker's payload is decompressed and summed in the step (each
        worker's draws use the key ``fold_in(key, rank)``, where the in-step pipeline folds the
        rank into each tensor's key: a stochastic compressor draws differently, a
        deterministic one gives the in-step result). An exchange still in flight is not part
        of the state: checkpoint at steps where none is (``t mod (H / F) >= delay``).
      skip_nonfinite: of :func:`~jaxcomm.compressed_mean`, for the exchanges: when some
        worker's pseudo-gradient has a NaN or Inf, every worker skips that exchange, whose
        mean is then zero, and the fragment's memories stay as they were (its
        ``exchange_states[p].notfinite_count`` counts it). The outer step and the blend
        still run with that zero mean. Not with ``overlap``.
    Returns:
      An optax transformation with state :class:`DiLoCoState`; ``update`` requires ``params``.
    Raises:
      ValueError: ``every < 1``; ``every`` not a multiple of ``fragments``; ``delay`` outside
        ``[0, H / F)``; ``blend`` outside ``[0, 1)``; ``skip_nonfinite`` with ``overlap``; (at
        ``init``) more fragments than parameter arrays; (at ``update``) no ``params``, or a tree
        other than ``init``'s.
      TypeError: ``inner``/``outer`` not optax transformations; a wrong ``compressor``/``memory``.
    """
    for name, tx in (("inner", inner), ("outer", outer)):
        if tx is not None and not (callable(getattr(tx, "init", None)) and callable(getattr(tx, "update", None))):
            raise TypeError(f"{name} must be an optax GradientTransformation (e.g. optax.sgd(0.1)); got {tx!r}")
    every = check_int(every, "every", minimum=1)
    fragments = check_int(fragments, "fragments", minimum=1)
    if every % fragments:
        raise ValueError(f"every ({every}) must be a multiple of fragments ({fragments}): a fragment syncs every H/F")
    period = every // fragments
    delay = check_int(delay, "delay", minimum=0)
    if delay >= period:
        raise ValueError(f"delay must be in [0, every / fragments) = [0, {period}); got {delay}")
    blend = check_finite_scalar(blend, "blend", nonnegative=True)
    if blend >= 1.0:
        raise ValueError(f"blend must be in [0, 1) (the local fragment's weight); got {blend}")
    carry_local = check_bool(carry_local, "carry_local")
    if carry_local and blend:
        raise ValueError(f"carry_local=True replaces the blend: blend must be 0; got {blend}")
    outer = optax.sgd(0.7, momentum=0.9, nesterov=True) if outer is None else outer
    compressor = compressors_lib.none() if compressor is None else check_compressor(compressor)
    memory = memory_lib.none() if memory is None else check_memory(memory)
    if comm is not None and isinstance(axis_name, str):
        raise ValueError(
            f"diloco with comm={comm!r} outside and the mesh axis axis_name={axis_name!r} inside is not served: that "
            "hierarchical mean runs as three compiled programs from the host, and DiLoCo's outer step is one compiled "
            "step. Pass axis_name=(slow, fast) on one mesh (under jax.distributed across processes), or comm= alone"
        )
    mean = compressed_mean(
        compressor, axis_name, comm=comm, memory=memory, strategy=strategy, fuse=fuse, skip_nonfinite=skip_nonfinite
    )
    overlap = check_bool(overlap, "overlap")
    if overlap and skip_nonfinite:
        raise ValueError(
            "skip_nonfinite=True needs the pipeline's exchange, but overlap=True sends the payloads from an MPI "
            "communication thread; use one of them"
        )
    gather = overlap and not (compressor.name in _OVERLAP_COMPRESSORS and memory.name == "none")
    if gather and (compressor.rounds is not None or choose_strategy(compressor, strategy) != "allgather"):
        raise ValueError(
            f"overlap supports the compressors {_OVERLAP_COMPRESSORS} without memory, and single-round "
            f"compressors with strategy 'allgather' (any memory); got {compressor!r} with {memory!r} and "
            f"strategy={strategy!r}"
        )
    exchanges: dict = {}  # mpi4py communicator -> its AsyncMean, made at the first trace

    def mpi_only(target):
        from ..comm import MPIComm

        if not isinstance(target, MPIComm):
            raise ValueError(
                f"diloco(overlap=True) runs its exchanges in an MPI communication thread: the communicator "
                f"must be an MPIComm; got {target!r}"
            )
        return target

    if overlap and (axis_name is not None or comm is not None):
        mpi_only(comm if comm is not None else f"axis_name={axis_name!r}")

    def target_comm():
        from ..comm import current

        return mpi_only(comm if comm is not None else current())

    def async_mean():
        target = target_comm()
        if id(target.comm) not in exchanges:
            from ..comm import AsyncMean

            exchanges[id(target.comm)] = AsyncMean(target.comm)
        return exchanges[id(target.comm)]

    def _local_step(es: CompressionState, delta):
        """The pipeline's compensate → compress → memory update on this worker alone (no exchange):
        ``(payloads, new state)``; the draws use ``fold_in(key, rank)``, the next key is the pipeline's."""
        rank = int(target_comm().rank)
        mine = es._replace(key=jax.random.fold_in(es.key, rank))
        done = compress_step(LOCAL, delta, mine, compressor=compressor, memory=memory, strategy="allgather")
        next_key = step_keys(es.key, len(es.compressor_states))[0]
        return done.payloads, done.state._replace(key=next_key)

    def _compress_here(tag: int, es: CompressionState, delta):
        """Gather route, at the sync: ``(state, token, collectives)``; the payloads leave in the thread."""
        payloads, done = _local_step(es, delta)
        leaves = [leaf for payload in payloads for leaf in jax.tree.leaves(payload)]
        token = async_mean().start_gather(tag, leaves)
        bits = BitCount.stack([sent_bits(payload) for payload in payloads])
        return done._replace(wire_bits=bits), token, len(leaves)

    def _gathered_mean(tag: int, es: CompressionState, like):
        """Gather route, ``delay`` steps later: ``(1/n) Σ_r decompress(payload_r)`` per leaf, scaled by
        the memory's ``output_scale`` as the pipeline does."""
        shapes = jax.eval_shape(lambda d: _local_step(es, d)[0], like)
        flat = [(jax.tree.leaves(payload), jax.tree.structure(payload)) for payload in shapes]
        got = async_mean().finish_gather(tag, [leaf for leaves, _ in flat for leaf in leaves])
        n = int(target_comm().size)
        means, start = [], 0
        for (leaves, tree), x in zip(flat, like):
            stacked = jax.tree.unflatten(tree, got[start : start + len(leaves)])
            start += len(leaves)
            total = sum_decompressed(compressor, stacked, n, accumulator(jnp.result_type(x)))
            means.append(scaled(total / n, float(memory.output_scale)))
        return means

    def schedule(t) -> tuple[list, list]:
        """At step ``t`` (traced int32): whether each fragment sends (``t ≡ (p + 1) H / F (mod H)``) and
        whether each receives (``delay`` steps after it sent): two lists of ``F`` boolean scalars."""
        phase, lag = t % every, t - delay
        sends = [phase == ((p + 1) * period) % every for p in range(fragments)]
        receives = [
            jnp.logical_and(lag >= (q + 1) * period, (lag % every) == ((q + 1) * period) % every)
            for q in range(fragments)
        ]
        return sends, receives

    def split(params) -> list[list[int]]:
        sizes = [int(np.size(x)) for x in jax.tree.leaves(params)]
        return fragment_leaves(sizes, fragments)

    def init_fn(params):
        leaves = jax.tree.leaves(params)
        for leaf in leaves:
            if not jnp.issubdtype(jnp.result_type(leaf), jnp.floating):
                raise TypeError(f"params must be floating point; got a leaf of dtype {jnp.result_type(leaf)}")
        groups = split(params)
        parts = [[leaves[j] for j in g] for g in groups]
        return DiLoCoState(
            count=jnp.zeros((), jnp.int32),
            anchor=jax.tree.map(lambda x: jnp.array(x, copy=True), params),  # its own buffers (donation)
            inner_state=inner.init(params),
            outer_states=tuple(outer.init(p) for p in parts),
            exchange_states=tuple(mean.init(p) for p in parts),
            pending=jax.tree.map(lambda x: jnp.zeros(jnp.shape(x), jnp.promote_types(x.dtype, jnp.float32)), params),
            synced=jax.tree.map(lambda x: jnp.array(x, copy=True), params) if carry_local else None,
        )

    def update_fn(updates, state: DiLoCoState, params=None, **extra_args):
        """One step: the inner step, the fragments' sends and receives (``lax.switch`` on the step), the update.

        Long because its numbered stages share the step's checked inputs and state; each branch function is short.
        """
        if params is None:
            raise ValueError("diloco needs params: call update(grads, state, params)")
        if not isinstance(state, DiLoCoState):
            raise TypeError(f"state must be a DiLoCoState (from init); got {type(state).__name__}")
        p_leaves, treedef = jax.tree.flatten(params)
        if jax.tree.structure(updates) != treedef or jax.tree.structure(state.anchor) != treedef:
            raise ValueError("diloco: grads, params and the state's anchor must have the same tree structure")
        groups = split(params)
        t = state.count + 1
        # 1. the inner step
        u, inner_state = inner.update(updates, state.inner_state, params, **extra_args)
        local = jax.tree.leaves(optax.apply_updates(params, u))
        anchor = jax.tree.leaves(state.anchor)
        pending = jax.tree.leaves(state.pending)
        quiet = tuple(zero_counters(s) for s in state.exchange_states)

        # 2. send: fragment p's pseudo-gradient through the compressed mean (branch 0: no fragment syncs)
        def no_send(_):
            return pending, quiet

        def sender(p):
            def send(_):
                delta = [(anchor[j] - local[j]).astype(local[j].dtype) for j in groups[p]]
                if gather:  # compressed and memory updated now; the payloads arrive `delay` steps later
                    sent, token, count = _compress_here(p, state.exchange_states[p], delta)
                    sent = sent._replace(messages=(token + count).astype(jnp.int32))
                    return pending, quiet[:p] + (sent,) + quiet[p + 1 :]
                if overlap:  # the payloads leave now; the mean arrives `delay` steps later
                    payloads = [compressor.compress(x, state.exchange_states[p].key)[0] for x in delta]
                    token = async_mean().start(p, [q.data for q in payloads])
                    sent = state.exchange_states[p]._replace(
                        count=state.exchange_states[p].count + 1,
                        wire_bits=BitCount.stack([wire_bits(q) for q in payloads]),
                        messages=(token + (2 if _is16(compressor) else 1) * len(payloads)).astype(jnp.int32),
                    )
                    return pending, quiet[:p] + (sent,) + quiet[p + 1 :]
                mean_p, exchanged = mean.update(delta, state.exchange_states[p])
                out = list(pending)
                for j, m in zip(groups[p], mean_p):
                    out[j] = m.astype(pending[j].dtype)
                return out, quiet[:p] + (exchanged,) + quiet[p + 1 :]

            return send

        sends, receives = schedule(t)
        # the step's quiet program (this step sends and receives nothing, as the last step reported):
        # the no-communication branches only, so the program holds none of the exchange's collectives
        static = quiet_step()
        if static:
            pending, exchange_states = no_send(None)
        else:
            senders = [no_send] + [sender(p) for p in range(fragments)]
            pending, exchange_states = typed_switch(_which(sends), senders, None)
        synced: list | None = None
        if carry_local:  # each fragment's local parameters at its sync: what the worker learnt since is carried
            if state.synced is None or jax.tree.structure(state.synced) != treedef:
                raise ValueError("diloco(carry_local=True): the state has no synced parameters; make it with this init")
            synced = jax.tree.leaves(state.synced)
            for p, group in enumerate(groups):
                for j in group:
                    synced[j] = jnp.where(sends[p], local[j], synced[j])

        # 3. receive: delay steps after fragment q synced, its outer step and the blend
        def no_receive(_):
            return local, anchor, state.outer_states

        def receiver(q):
            def receive(_):
                if gather:
                    delta = _gathered_mean(q, state.exchange_states[q], [local[j] for j in groups[q]])
                elif overlap:
                    # the payloads' shapes and dtypes only (traced abstractly: nothing is compressed here)
                    key = state.exchange_states[q].key
                    like = [jax.eval_shape(lambda x: compressor.compress(x, key)[0].data, local[j]) for j in groups[q]]
                    delta = async_mean().finish(q, like)
                else:
                    delta = [pending[j] for j in groups[q]]
                base = [anchor[j] for j in groups[q]]
                step, outer_q = outer.update(delta, state.outer_states[q], base)
                new_global = optax.apply_updates(base, step)
                new_local, new_anchor = list(local), list(anchor)
                for j, g in zip(groups[q], new_global):
                    g = g.astype(anchor[j].dtype)
                    if synced is not None:  # carry_local
                        mixed = g + (local[j] - synced[j])
                    else:
                        mixed = g if blend == 0.0 else blend * local[j] + (1.0 - blend) * g
                    new_local[j] = mixed.astype(local[j].dtype)
                    new_anchor[j] = g
                outer_states = state.outer_states[:q] + (outer_q,) + state.outer_states[q + 1 :]
                return new_local, new_anchor, outer_states

            return receive

        if static:
            local, anchor, outer_states = no_receive(None)
        else:
            receivers = [no_receive] + [receiver(q) for q in range(fragments)]
            local, anchor, outer_states = typed_switch(_which(receives), receivers, None)
        report_next_step(jnp.any(jnp.stack(list(itertools.chain(*schedule(t + 1))))))

        # 4. the update of this worker's parameters, typed as the parameters vary
        outs = [
            cast_varying((n - p).astype(p.dtype), varying_axes(p) | varying_axes(n)) for n, p in zip(local, p_leaves)
        ]
        new_state = DiLoCoState(
            count=t,
            anchor=treedef.unflatten(anchor),
            inner_state=inner_state,
            outer_states=outer_states,
            exchange_states=exchange_states,
            pending=treedef.unflatten(pending),
            synced=None if synced is None else treedef.unflatten(synced),
        )
        return treedef.unflatten(outs), new_state

    return optax.GradientTransformationExtraArgs(init_fn, update_fn)


_OVERLAP_COMPRESSORS = ("none", "fp16", "bf16")


def _is16(compressor: Compressor) -> bool:
    return compressor.name in ("fp16", "bf16")


def _which(flags: list) -> jax.Array:
    """0 when no flag is set, else ``1 + `` the index of the (only) set flag (int32 scalar)."""
    index = jnp.zeros((), jnp.int32)
    for k, flag in enumerate(flags):
        index = jnp.where(flag, k + 1, index)
    return index
