"""The per-tensor pipeline every gradient transformation is built on.

One step, per worker ``i`` and per tensor (GRACE Algorithm 1, generalised)::

    φ_i   = memory.compensate(m_i, g_i)                compensate
    p_i   = Q(φ_i)                                      compress: the payload is what is sent
    Σ     = communicate(p_1 .. p_n)                     strategy (below)
    m_i  ← memory.update(m_i, g_i, φ_i, Q⁻¹(p_i))       memory update (or from Q's error hook)

Strategies (how the payloads become the sum ``Σ_i Q⁻¹(p_i)``):

* ``"allreduce"``: the payloads' ``summable`` fields are summed by one
  all-reduce and decompressed once, ``Q⁻¹(Σ_i p_i)``. A compressor with
  ``rounds`` (PowerSGD) instead yields its messages, which are summed in turn
  (:func:`run_rounds`).
* ``"allgather"``: every payload is gathered and decompressed; with ``fuse``,
  the payloads of at most :data:`FUSE_MAX_BYTES` share one collective.
* ``"broadcast"``: each worker's payload is broadcast in turn.
* ``"reduce_scatter"``: each worker owns one of ``n`` chunks of every tensor;
  the chunks travel compressed to their owners (``n − 1`` permutation
  rounds), each owner decompresses and averages its chunk in float32,
  compresses the average again (optionally with its own error feedback,
  DoubleSqueeze's server), and the compressed chunks are all-gathered. A
  worker sends ``(n − 1)`` chunk payloads and one averaged chunk, about
  ``2 (n − 1) / n`` of its payload whatever ``n``.

A one-worker communicator (:class:`jaxcomm.comm.Local`) turns the pipeline into plain error
feedback: nothing is sent and ``Σ`` is the worker's own reconstruction.

Wire accounting happens here and only here: ``state.wire_bits[j]`` is the exact
number of bits this worker put on the wire for tensor (or group) ``j`` in the
last step, and ``state.messages`` the number of arrays it handed to collectives.
It counts what the collectives carry: under ``"allreduce"`` the summed fields;
under ``"allgather"`` every array of a fixed-size payload, and for a payload
with count-prefixed fields (``Payload.counted``: threshold, DGC, adaptive,
INCEPTIONN, random sparsification) what :func:`~jaxcomm.comm.all_gather_counted`
sent for it -- its valid rows, its other arrays, its int32 counts, and, for the
first payload of a fused group, the group's bucket padding -- so that
``int(state.wire_bits.sum())`` is the bytes of the step's collectives times 8;
``"broadcast"`` and ``"reduce_scatter"`` send payloads whole, capacity buffers
included, and count them whole. With one worker nothing is sent, and
``wire_bits`` is the payload's own format count (:func:`~jaxcomm.compressors.wire_bits`).
The counts are :class:`~jaxcomm.BitCount` values (two uint32 words each): exact up to
``2**64 - 2`` bits, whatever the tensor's size (past it: an error, or saturated when traced).

Non-finite gradients (:func:`if_finite`, the transforms' ``skip_nonfinite``): every worker
checks its own gradient, ``bad_i = any(¬isfinite(g_i))`` over every leaf. With
``skip_nonfinite=True`` the workers sum their flags (one int32 all-reduce; none with one
worker) and, if any worker's gradient is not finite, *every* worker skips the step: the
output is zeros, and the state (step count, key, memories, compressor states) is left as it
was, so the run continues exactly as if that step had not happened; ``notfinite_count``
counts the skipped steps. With ``skip_nonfinite=False`` (the default) the step runs as it
is and ``notfinite_count`` counts the steps at which this worker's own gradient was not
finite: a memory that keeps the error (``residual``, ``dgc``, ``efsignsgd``) then keeps the
non-finite entries, and they reach the output again at later steps.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence
from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
import numpy as np

from .. import memory as memory_lib
from .._bitcount import BitCount
from .._keys import step_keys
from .._validate import check_bool, check_choice, check_float_input
from .._vma import typed_cond, varying_axes
from ..comm import (
    ALL_GATHER,
    BROADCAST,
    PERMUTE,
    SUM,
    Local,
    all_gather_counted,
    all_gather_packed,
    fits_counted_gather,
    has_counted_fields,
    require,
    sum_packed,
)
from ..compressors import Compressor, wire_bits

__all__ = [
    "STRATEGIES",
    "FUSE_MAX_BYTES",
    "NONFINITE_FLAG_BITS",
    "CompressionState",
    "if_finite",
    "run_rounds",
]

STRATEGIES = ("allreduce", "allgather", "broadcast", "reduce_scatter")
"""The ways the pipeline turns payloads into a sum over workers (see the module docstring)."""

FUSE_MAX_BYTES = 1 << 20
"""With ``fuse=True``, payloads of at most this many bytes (per worker) share one all-gather;
a larger payload is gathered on its own (Horovod's fusion threshold)."""

NONFINITE_FLAG_BITS = 32
"""Bits each worker sends per step for the non-finite flag with ``skip_nonfinite=True`` and more
than one worker (one int32 all-reduce; :func:`if_finite`)."""

_UNROLL_MAX = 16
"""Up to this many workers, gathered payloads are decompressed in one unrolled sum (XLA fuses
elementwise decoders into one pass); beyond it, a ``lax.scan`` keeps the program small."""


class CompressionState(NamedTuple):
    """Per-worker state of every compressing transformation.

    Give it a leading worker axis sharded over the mesh axis (``P("data")``) in a
    data-parallel step, or keep one per MPI process: memories differ between workers.

    Attributes:
      count: int32 scalar, steps taken.
      key: PRNG key (raw ``uint32[2]``), identical on every worker; split once per step.
      memory: a tree with the parameters' structure whose leaves are the
        per-array memory states (:class:`~jaxcomm.memory.Memory`).
      compressor_states: tuple, the compressor's state per compressed tensor
        (per leaf, or per group where leaves are compressed together).
      wire_bits: :class:`~jaxcomm.BitCount` of shape ``(num_tensors,)``: exact bits
        this worker put on the wire per compressed tensor at the last step (the
        arrays handed to the collectives; see the module docstring for
        count-prefixed payloads). ``int(state.wire_bits.sum())`` is the step's
        volume per worker, ``np.asarray(state.wire_bits)`` the int64 counts per tensor.
      messages: int32 scalar, arrays this worker handed to collectives at the
        last step (one per MPI call on the MPI backend).
      notfinite_count: int32 scalar, steps with a gradient that was not finite (optax's
        ``apply_if_finite`` keeps the same count). With ``skip_nonfinite=True``: the steps
        skipped because some worker's gradient was not finite (the same on every worker);
        ``count`` does not include them. Otherwise: the steps at which this worker's own
        gradient was not finite (they ran as they were).
    """

    count: jax.Array  # type: ignore[assignment]  # optax's name for the step count; shadows tuple.count
    key: jax.Array
    memory: Any
    compressor_states: tuple
    wire_bits: BitCount
    messages: jax.Array
    notfinite_count: jax.Array


# --------------------------------------------------------------------------- #
# Validation shared by the transforms
# --------------------------------------------------------------------------- #
def check_compressor(compressor, name: str = "compressor", *, dense_warmup: bool = False) -> Compressor:
    """``compressor`` if it is a :class:`Compressor`; a transform that does not run a dense
    warm-up (``dense_warmup=False``) refuses one that asks for it."""
    if not isinstance(compressor, Compressor):
        raise TypeError(
            f"{name} must be a jaxcomm.compressors.Compressor (e.g. jaxcomm.compressors.topk(ratio=0.01)); "
            f"got {type(compressor).__name__}"
        )
    if compressor.dense_warmup and not dense_warmup:
        raise ValueError(
            f"{name} {compressor!r} asks for {compressor.dense_warmup} dense warm-up steps (dense_warmup / "
            "start_powerSGD_iter), which only jaxcomm.compressed_mean runs; build it without them here"
        )
    return compressor


def check_feedback(compressor: Compressor, memory: memory_lib.Memory, sizes) -> None:
    """Refuse error feedback around a compressor that is not a contraction: an unbiased one whose
    variance factor is ``ω ≥ 1``, or one that declares ``no_contraction``.

    With a memory that needs a contraction (``memory.needs_contraction``: every memory that
    feeds the error back, unless built to accept any compressor), the error ``e' = v − Q(v)``
    of an unbiased compressor has ``E‖e'‖² = ω ‖v‖²`` (random sparsification: exactly), so
    once the memory dominates ``v = g + e`` it grows by a factor ``ω`` per step; a compressor
    with no contraction has no such factor at all. ``sizes`` are the entries of each compressed
    tensor.

    Raises:
      ValueError: naming the compressor, why it is not a contraction (``ω`` and the tensor
        size, or its ``no_contraction`` reason) and the fix
        (:func:`jaxcomm.compressors.contractive`, a scaled variant, or no memory).
    """
    if not memory.needs_contraction:
        return
    if compressor.no_contraction:
        raise ValueError(
            f"error feedback ({memory!r}) needs a contraction, E‖Q(x) − x‖² ≤ (1 − δ)‖x‖², but {compressor!r} "
            f"declares none: {compressor.no_contraction}. Use a compressor that scales its output into a "
            "contraction, or no memory (memory=jaxcomm.memory.none()); to measure error feedback on it anyway, "
            "jaxcomm.memory.residual(needs_contraction=False)"
        )
    if compressor.variance_factor is None:
        return
    for d in sizes:
        omega = compressor.omega(d)
        if omega is not None and omega >= 1.0:
            raise ValueError(
                f"error feedback ({memory!r}) needs a contraction, E‖Q(x) − x‖² ≤ (1 − δ)‖x‖² with δ > 0, but "
                f"{compressor!r} is unbiased with variance factor ω = {omega:.4g} ≥ 1 on a tensor of {d} entries "
                f"({compressor.bound}); its memory would grow by a factor ω per step. Use "
                f"jaxcomm.compressors.contractive({compressor!r}), which scales it by 1/(1 + ω), or no memory"
            )


def check_memory(memory, name: str = "memory") -> memory_lib.Memory:
    if not isinstance(memory, memory_lib.Memory):
        raise TypeError(
            f"{name} must be a jaxcomm.memory.Memory (e.g. jaxcomm.memory.residual()); got {type(memory).__name__}"
        )
    return memory


def choose_strategy(compressor: Compressor, strategy: str) -> str:
    """The strategy a step uses: ``compressor.strategy`` for ``"auto"``; ``ValueError`` if it cannot serve."""
    check_choice(strategy, "strategy", ("auto", *STRATEGIES))
    chosen = compressor.strategy if strategy == "auto" else strategy
    if chosen == "allreduce" and compressor.strategy != "allreduce" and compressor.rounds is None:
        raise ValueError(
            f"strategy='allreduce' was requested but compressor {compressor.name!r} has strategy "
            f"{compressor.strategy!r}: its payloads cannot be summed as they are (and it has no rounds); "
            f"use strategy='allgather', 'reduce_scatter' or 'broadcast' (or 'auto')"
        )
    if chosen == "reduce_scatter":
        check_stateless(compressor, "compressor", "strategy='reduce_scatter'")
    return chosen


def sums_in_16_bits(compressor: Compressor) -> bool:
    """Whether ``compressor``'s ``"allreduce"`` sums 16-bit floats (fp16/bf16 payload fields), whose
    rounding in the sum no worker's memory sees. Probed on a small float32 array at build time."""
    if compressor.strategy != "allreduce" or compressor.rounds is not None:
        return False
    payload, _ = compressor.compress(jnp.zeros((4,), jnp.float32), jax.random.PRNGKey(0))
    fields = [getattr(payload, f) for f in getattr(type(payload), "summable", ())]
    return any(jnp.result_type(v) in (jnp.float16, jnp.bfloat16) for v in fields)


def check_stateless(compressor: Compressor, name: str, why: str) -> None:
    """``ValueError`` unless ``compressor`` keeps no per-array state (chunks change shape with ``n``)."""
    if jax.tree.leaves(compressor.init_state(jnp.zeros((2,), jnp.float32))):
        raise ValueError(
            f"{why} compresses chunks whose size depends on the number of workers, so {name} "
            f"{compressor.name!r} must be stateless"
        )
    if compressor.rounds is not None:
        raise ValueError(f"{why} needs a single-round compressor; {name} {compressor.name!r} has rounds")


_NEEDS = {
    "allreduce": (SUM,),
    "allgather": (ALL_GATHER,),
    "broadcast": (BROADCAST,),
    "reduce_scatter": (PERMUTE, ALL_GATHER),
}
"""The collectives each strategy runs."""


def check_served(comm, chosen: str, compressor: Compressor) -> None:
    """``ValueError`` (from :func:`jaxcomm.comm.require`) if ``comm`` cannot run strategy ``chosen``."""
    require(comm, *_NEEDS[chosen], for_what=f"strategy {chosen!r} for compressor {compressor.name!r}")


def check_per_worker(comm, leaves) -> None:
    """``ValueError`` if a gradient was already summed over the axis (the shard_map pitfall).

    Inside ``jax.shard_map`` (``check_vma=True``), ``jax.grad`` with respect to
    replicated parameters returns the gradient *summed over the axis*, an
    invariant value: compressing it would compress the already-communicated
    dense sum. The axis index varies over the axis and such a gradient does
    not; under ``jax.vmap`` nothing is tracked and the check passes.
    """
    axis = getattr(comm, "axis_name", None)
    if not isinstance(axis, str) or axis not in varying_axes(comm.index()):
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


def accumulator(dtype):
    """The dtype sums over workers run in: float32, or the tensor's own when it is wider (float64)."""
    return jnp.dtype(dtype) if jnp.dtype(dtype).itemsize > 4 else jnp.dtype(jnp.float32)


def _array_bits(a) -> int:
    return int(np.size(a)) * jnp.dtype(a.dtype).itemsize * 8


# --------------------------------------------------------------------------- #
# State
# --------------------------------------------------------------------------- #
def groups_of(num_leaves: int, scope: str) -> list[list[int]]:
    """Leaf indices compressed together: one group per leaf (``"leaf"``) or all leaves (``"global"``)."""
    if scope == "leaf":
        return [[i] for i in range(num_leaves)]
    if scope == "global":
        return [list(range(num_leaves))] if num_leaves else []
    raise ValueError(f"scope must be 'leaf' or 'global'; got {scope!r}")


def group_vector(leaves, idx):
    """The leaves ``idx`` as one tensor: the leaf itself for a single leaf, else flattened and concatenated."""
    if len(idx) == 1:
        return leaves[idx[0]]
    dtype = jnp.result_type(*[leaves[i] for i in idx])
    return jnp.concatenate([jnp.ravel(leaves[i]).astype(dtype) for i in idx])


def ungroup(flat, leaves, idx) -> dict:
    """Inverse of :func:`_group_vector`: ``{i: array shaped and typed like leaves[i]}``."""
    if len(idx) == 1:
        return {idx[0]: flat.astype(jnp.result_type(leaves[idx[0]]))}
    out, start = {}, 0
    for i in idx:
        size = int(np.size(leaves[i]))
        out[i] = flat[start : start + size].reshape(jnp.shape(leaves[i])).astype(jnp.result_type(leaves[i]))
        start += size
    return out


def init_state(
    params, compressor: Compressor, memory: memory_lib.Memory, *, scope: str = "leaf", key=None
) -> CompressionState:
    """The state for ``params`` (floating leaves): zero memories, fresh compressor states, ``PRNGKey(seed)``."""
    leaves, treedef = jax.tree_util.tree_flatten(params)
    for leaf in leaves:
        check_float_input(leaf, "params", nonempty=True)
    leaves = [jnp.asarray(x) for x in leaves]
    groups = groups_of(len(leaves), scope)
    check_feedback(compressor, memory, [sum(int(np.size(leaves[i])) for i in g) for g in groups])
    return CompressionState(
        count=jnp.zeros((), jnp.int32),
        key=jax.random.PRNGKey(compressor.seed) if key is None else key,
        memory=jax.tree_util.tree_unflatten(treedef, [memory.init(x) for x in leaves]),
        compressor_states=tuple(compressor.init_state(group_vector(leaves, g)) for g in groups),
        wire_bits=BitCount.zeros((len(groups),)),
        messages=jnp.zeros((), jnp.int32),
        notfinite_count=jnp.zeros((), jnp.int32),
    )


def flatten_updates(updates, state: CompressionState, scope: str = "leaf"):
    """``(leaves, treedef, memory leaves)``; ``ValueError`` if the tree differs from ``init``'s."""
    leaves, treedef = jax.tree.flatten(updates)
    try:
        mem_leaves = treedef.flatten_up_to(state.memory)
    except (ValueError, TypeError) as e:
        raise ValueError(
            f"updates has tree structure {treedef} but the state was initialised for a different tree; "
            f"init and update must see the same tree ({e})"
        ) from None
    if len(groups_of(len(leaves), scope)) != len(state.compressor_states):
        raise ValueError(
            f"updates has {len(leaves)} leaves but the state was initialised for "
            f"{len(state.compressor_states)}; init and update must see the same tree"
        )
    for g in leaves:
        check_float_input(g, "updates", nonempty=True)
    return leaves, treedef, mem_leaves


# --------------------------------------------------------------------------- #
# Communication of one step's payloads
# --------------------------------------------------------------------------- #
class Exchanged(NamedTuple):
    """What one exchange produced, per compressed tensor (lists in tensor order).

    Attributes:
      payloads: this worker's payloads.
      states: the compressors' new per-tensor states.
      totals: ``Σ_i Q⁻¹(p_i)`` in float32 (or wider), or ``None`` under
        ``"reduce_scatter"``, whose owners average instead.
      means: ``totals / n`` in float32 or wider (``"reduce_scatter"``: the
        all-gathered owners' averages, in the tensor's dtype).
      own: this worker's own reconstruction ``Q⁻¹(p_i)``, when it is not
        recovered from the error hook (``None`` otherwise).
      errors: ``φ_i − Q⁻¹(p_i)`` per tensor where the memory keeps the
        error (``memory.from_error``); ``None`` entries otherwise.
      bits: scalar :class:`~jaxcomm.BitCount` values, bits this worker sent per tensor.
      owner_bits: scalar ``BitCount`` values, bits of the owners' averaged chunks
        (``"reduce_scatter"``; zeros otherwise).
      owner_memory: new owner memories (``"reduce_scatter"`` with an owner memory).
      messages: arrays handed to collectives (Python int).
    """

    payloads: list
    states: list
    totals: list
    means: list
    own: list
    errors: list
    bits: list
    owner_bits: list
    owner_memory: list
    messages: int


class Owner(NamedTuple):
    """The chunk owners' step under ``"reduce_scatter"``: compress the averaged chunk again.

    Attributes:
      compressor: the owners' compressor (stateless, single-round).
      memory: the owners' error feedback (``none()`` for a plain compressed mean;
        DoubleSqueeze's server error with ``residual()``).
      memory_leaves: per tensor, the owner memory state over the whole tensor
        (each owner reads and writes only its chunk).
      keys: per tensor, the key the owners draw from (folded with the owner index).
      fold_rounding: return, in place of the owner memories, each owner's
        ``n (mean − Q(mean))`` on its chunk (zero elsewhere, the tensor's shape and
        dtype): what a plain compressed mean with error feedback adds to the owner's
        worker memory so the re-compression's rounding is fed back too.
    """

    compressor: Compressor
    memory: memory_lib.Memory
    memory_leaves: Sequence
    keys: Sequence
    fold_rounding: bool = False


def run_rounds(compressor: Compressor, x, key, state, comm):
    """Drive a multi-round compressor's ``rounds`` over ``comm``: ``(payload, new_state, sent)``.

    Every message the generator yields is summed over the workers
    (``comm.sum``) and sent back into it; ``sent`` lists the messages (this
    worker's contributions, for wire accounting). The payload decompresses to
    the sum over workers.
    """
    (result,), _ = run_rounds_together(comm, [(compressor, x, key, state)], fuse=False)
    return result


def run_rounds_together(comm, jobs: Sequence, fuse: bool = True) -> tuple[list, int]:
    """:func:`run_rounds` for several tensors in lockstep: ``([(payload, new_state, sent)], collectives)``.

    ``jobs``: ``(compressor, x, key, state)`` per tensor. Round ``r`` of every tensor
    that has one runs at once: with ``fuse``, the messages' leaves of at most
    :data:`FUSE_MAX_BYTES` share one all-reduce per dtype (:func:`~jaxcomm.comm.sum_packed`;
    PowerSGD: one for all the ``P`` matrices, one for all the ``Q``), the others are
    summed alone. Each tensor's sums, so its result, are those of its own run.
    """
    gens: list = []
    sent: list[list] = []
    results: list[Any] = [None] * len(jobs)
    waiting: dict[int, Any] = {}
    for j, (compressor, x, key, state) in enumerate(jobs):
        if compressor.rounds is None:
            raise ValueError(f"compressor {compressor.name!r} has no rounds")
        x = jnp.asarray(x)
        check_float_input(x, "x")
        if state is None:
            state = compressor.init_state(x)
        gens.append(compressor.rounds(x, key, state, int(comm.size)))
        sent.append([])
        try:
            waiting[j] = next(gens[j])
        except StopIteration as stop:
            results[j] = (*stop.value, [])
    collectives = 0
    while waiting:
        order = list(waiting)
        for j in order:
            sent[j].append(waiting[j])
        sums, k = sum_packed(comm, [waiting[j] for j in order], FUSE_MAX_BYTES if fuse else 0)
        collectives += k
        waiting = {}
        for j, total in zip(order, sums):
            try:
                waiting[j] = gens[j].send(total)
            except StopIteration as stop:
                payload, new_state = stop.value
                results[j] = (payload, new_state, sent[j])
    return results, collectives


def _matrix_view(shape: tuple) -> tuple:
    """``(prod(shape[:-1]), shape[-1])`` for arrays of rank >= 2, else ``shape``: the matrix a
    batching compressor sees (:func:`jaxcomm.compressors.powersgd_plan`)."""
    return shape if len(shape) < 2 else (int(np.prod(shape[:-1], dtype=np.int64)), int(shape[-1]))


def _batched_rounds(comm, phis, keys, states, compressors) -> tuple[dict, int]:
    """Rounds of tensors with one matrix view run as one batch (PyTorch PowerSGD's ``batch_tensors_with_same_shape``).

    Tensors whose compressor has ``params["batch_tensors_with_same_shape"]`` and ``rounds``
    are grouped by compressor, dtype, state shapes and matrix view (:func:`_matrix_view`:
    a ``(6, 4, 18)`` and a ``(24, 18)`` tensor share the view ``(24, 18)``, as PyTorch
    groups its ``tensor.view(n, -1)`` matrices); such a compressor must give the same
    result on a tensor and on its view, as PowerSGD does. Each group of two or more runs
    :func:`run_rounds` and ``decompress`` once under ``jax.vmap`` over the stacked views,
    keys and states: batched matrix products and one collective per round for the whole
    group, with each tensor's own key and state, so each result equals the tensor's own
    run up to float rounding. Returns ``({index: (payload, state, sent, total)},
    collectives run)``; ``total`` (the decompressed sum) has the tensor's shape, the
    payload the view's.
    """
    groups: dict = {}
    for i, (phi, st, c) in enumerate(zip(phis, states, compressors)):
        if c.rounds is not None and c.params.get("batch_tensors_with_same_shape"):
            st_shapes = tuple(jnp.shape(v) for v in jax.tree.leaves(st))
            sig = (id(c), _matrix_view(jnp.shape(phi)), jnp.result_type(phi), jax.tree.structure(st), st_shapes)
            groups.setdefault(sig, []).append(i)
    out, messages = {}, 0
    for (_, view, *_), idx in groups.items():
        if len(idx) < 2:
            continue
        c = compressors[idx[0]]
        views = [jnp.reshape(phis[i], view) for i in idx]
        seqs = (views, [keys[i] for i in idx], [states[i] for i in idx])
        stack = [jax.tree.map(lambda *v: jnp.stack(v), *seq) for seq in seqs]

        def one(x, k, s, c=c):
            payload, state, sent = run_rounds(c, x, k, s, comm)
            return payload, state, sent, c.decompress(payload)

        payload, state, sent, total = jax.vmap(one)(*stack)
        messages += sum(len(jax.tree.leaves(m)) for m in sent)
        for j, i in enumerate(idx):
            p_j, s_j, sent_j, t_j = jax.tree.map(lambda v, j=j: v[j], (payload, state, sent, total))
            out[i] = (p_j, s_j, sent_j, jnp.reshape(t_j, jnp.shape(phis[i])))
    return out, messages


def _gather_payloads(comm, payloads: list, fuse: bool) -> tuple[list, list, int]:
    """``[comm.all_gather(p) for p in payloads]``, the bits this worker sent per payload, and the
    collectives run.

    Fixed-size payloads: with ``fuse``, those of at most :data:`FUSE_MAX_BYTES` share one
    :func:`~jaxcomm.comm.all_gather_packed` collective; the others are gathered leaf by leaf.
    Their bits are their arrays' bits. Payloads with count-prefixed fields (``counted``) go
    through :func:`~jaxcomm.comm.all_gather_counted` (a count gather, then only the valid
    rows in the smallest bucket that holds every worker's): with ``fuse`` those of at most
    :data:`FUSE_MAX_BYTES` of capacity share one, each other one has its own. Their bits are
    what that gather sent for them, the group's bucket padding charged to its first payload
    (the lowest tensor index), so the bits sum to the collectives' bytes times 8. A counted
    payload of more than ``2**31 - 1`` bytes (beyond the int32 offsets of that gather) is
    gathered whole, leaf by leaf, and counted whole.
    """
    sizes = [sum(map(_array_bits, jax.tree.leaves(p))) for p in payloads]
    bits: list[Any] = [BitCount.of(b) for b in sizes]
    # A buffer past int32 byte offsets cannot go through the variable-length gather: whole, leaf by leaf.
    counted = [i for i, p in enumerate(payloads) if has_counted_fields(p) and fits_counted_gather(sizes[i])]
    small = [i for i, b in enumerate(sizes) if fuse and b <= 8 * FUSE_MAX_BYTES]
    small_fixed = [i for i in small if i not in counted]
    small_counted = [i for i in small if i in counted]
    out = dict(zip(small_fixed, all_gather_packed(comm, [payloads[i] for i in small_fixed]))) if small_fixed else {}
    messages = 1 if small_fixed else 0
    groups = ([small_counted] if small_counted else []) + [[i] for i in counted if i not in small_counted]
    for group in groups:
        res = all_gather_counted(comm, [payloads[i] for i in group])
        messages += res.messages
        for i, gathered, sent in zip(group, res.items, res.sent_bytes):
            out[i], bits[i] = gathered, BitCount.product(sent, 8)
    for i, p in enumerate(payloads):
        if i not in out:
            out[i] = comm.all_gather(p)
            messages += len(jax.tree.leaves(p))
    return [out[i] for i in range(len(payloads))], bits, messages


def _sent_bits(payload):
    """Bits of every array of ``payload``: what crosses when it is sent whole (broadcast, permute)."""
    return BitCount.of(sum(map(_array_bits, jax.tree.leaves(payload))))


def _sum_decompressed(compressor: Compressor, gathered, n: int, acc_dtype):
    """``Σ_i decompress(gathered[i])`` over ``n`` stacked payloads, in ``acc_dtype``."""
    if compressor.decompress_sum is not None:
        return compressor.decompress_sum(gathered, acc_dtype)

    def one(i):
        return compressor.decompress(jax.tree.map(lambda a: a[i], gathered)).astype(acc_dtype)

    if n <= _UNROLL_MAX:
        total = one(0)
        for i in range(1, n):
            total = total + one(i)
        return total

    def add_one(total, payload):
        return total + compressor.decompress(payload).astype(acc_dtype), None

    return jax.lax.scan(add_one, one(0), jax.tree.map(lambda a: a[1:], gathered))[0]


def _data_fields(payload) -> list[str]:
    if not dataclasses.is_dataclass(payload):
        raise TypeError(
            f"strategy='allreduce' needs a dataclass payload (jaxcomm.compressors.payloads.payload_dataclass); "
            f"got {type(payload).__name__}"
        )
    return [f.name for f in dataclasses.fields(payload) if not f.metadata.get("static", False)]


def _summable_fields(compressor: Compressor, payload) -> tuple:
    fields = _data_fields(payload)
    summable = tuple(type(payload).summable)
    unknown = [f for f in summable if f not in fields]
    if not summable or unknown:
        raise ValueError(
            f"compressor {compressor.name!r} has strategy 'allreduce' but its payload "
            f"{type(payload).__name__} names summable fields {summable} (array fields: {fields})"
        )
    return summable


def exchange(
    comm,
    phis: list,
    keys: list,
    states: list,
    compressors: list,
    strategy: str,
    *,
    fuse: bool = True,
    memory: memory_lib.Memory | None = None,
    owner: Owner | None = None,
) -> Exchanged:
    """Compress every tensor of ``phis``, communicate with ``strategy``, aggregate.

    Args:
      comm: the communicator (``size``, ``index()`` and the strategy's collectives).
      phis: the compensated tensors ``φ_i`` (any shapes, floating dtypes).
      keys: one leaf key per tensor (:func:`~jaxcomm._keys.step_keys`); the
        worker index is folded in where workers must draw independently.
      states: the compressors' per-tensor states.
      compressors: one compressor per tensor.
      strategy: one of :data:`STRATEGIES`.
      fuse: gather small payloads with one collective (``"allgather"``); sum the small
        summable fields, and each round's small messages of multi-round compressors,
        with one all-reduce per dtype (``"allreduce"``; :func:`~jaxcomm.comm.sum_packed`).
      memory: the worker memory; when it keeps the compression error
        (``from_error``), ``errors`` come from each compressor's ``error``.
      owner: the owners' step (``"reduce_scatter"`` only).
    """
    n = int(comm.size)
    index = comm.index()
    want_error = memory is not None and memory.from_error is not None
    acc = [accumulator(jnp.result_type(phi)) for phi in phis]
    if strategy == "reduce_scatter":
        return _reduce_scatter(comm, phis, keys, compressors, acc, memory, owner, n, index)

    payloads, new_states, bits, totals, messages = [], [], [], [], 0
    rounds = strategy == "allreduce" and any(c.rounds is not None for c in compressors)
    batched, messages = (
        _batched_rounds(comm if n > 1 else LOCAL, phis, keys, states, compressors) if rounds else ({}, 0)
    )
    # the other multi-round tensors, in lockstep: one all-reduce per round for their small messages
    lockstep = [i for i, c in enumerate(compressors) if rounds and c.rounds is not None and i not in batched]
    ran, round_collectives = run_rounds_together(
        comm if n > 1 else LOCAL, [(compressors[i], phis[i], keys[i], states[i]) for i in lockstep], fuse and n > 1
    )
    together = dict(zip(lockstep, ran))
    messages = messages + round_collectives if n > 1 else 0
    for i, (phi, key, state, c, a) in enumerate(zip(phis, keys, states, compressors, acc)):
        if i in batched:
            payload, state, sent, total = batched[i]
            bits.append(BitCount.of(sum(_array_bits(m) for m in sent)))
            totals.append(total.astype(a))
        elif i in together:
            payload, state, sent = together[i]
            bits.append(BitCount.of(sum(_array_bits(m) for m in sent)))
            totals.append(c.decompress(payload).astype(a))
        else:
            payload, new_state = c.compress(phi, key if n == 1 else jax.random.fold_in(key, index), state)
            if strategy == "allreduce":
                summable = _summable_fields(c, payload)
                if n > 1 and any(f not in summable for f in _data_fields(payload)):
                    # Fields that are not summed must agree on every worker: compress with the shared key.
                    payload, new_state = c.compress(phi, key, state)
                bits.append(BitCount.of(sum(_array_bits(getattr(payload, f)) for f in summable)))
            else:
                bits.append(BitCount.of(wire_bits(payload)))
            state = new_state
            totals.append(None)
        payloads.append(payload)
        new_states.append(state)

    pending = [i for i, t in enumerate(totals) if t is None]
    if pending and n == 1:
        for i in pending:
            totals[i] = compressors[i].decompress(payloads[i]).astype(acc[i])
    elif pending and strategy == "allreduce":
        fields = [{f: getattr(payloads[i], f) for f in type(payloads[i]).summable} for i in pending]
        sums, m = sum_packed(comm, fields, FUSE_MAX_BYTES if fuse else 0)
        messages += m
        for i, s in zip(pending, sums):
            totals[i] = compressors[i].decompress(dataclasses.replace(payloads[i], **s)).astype(acc[i])
    elif pending and strategy == "allgather":
        gathered, sent, m = _gather_payloads(comm, [payloads[i] for i in pending], fuse)
        messages += m
        for i, gp, b in zip(pending, gathered, sent):
            totals[i] = _sum_decompressed(compressors[i], gp, n, acc[i])
            bits[i] = b
    elif pending:  # broadcast: root r's payload to everyone, for r = 0..n-1; the whole payload crosses
        for i in pending:
            total = jnp.zeros(jnp.shape(phis[i]), acc[i])
            for r in range(n):
                total = total + compressors[i].decompress(comm.broadcast(payloads[i], r)).astype(acc[i])
            messages += n * len(jax.tree.leaves(payloads[i]))
            totals[i] = total
            bits[i] = _sent_bits(payloads[i])

    errors: list[Any] = []
    own: list[Any] = []
    for phi, payload, c, total in zip(phis, payloads, compressors, totals):
        if c.rounds is not None and rounds:
            # Multi-round methods: the memory keeps the aggregated reconstruction
            # (GRACE's and PyTorch's PowerSGD convention).
            own.append((total / n).astype(jnp.result_type(phi)))
            errors.append(None)
        elif want_error:
            own.append(None)
            errors.append(c.error(phi, payload))
        else:
            own.append(c.decompress(payload))
            errors.append(None)
    means = [t / n for t in totals]
    zeros = [BitCount.zeros()] * len(phis)
    return Exchanged(payloads, new_states, totals, means, own, errors, bits, zeros, [], messages)


# --------------------------------------------------------------------------- #
# reduce-scatter: chunks travel compressed to their owners
# --------------------------------------------------------------------------- #
def _chunk_len(size: int, n: int) -> int:
    return -(-size // n)


def to_chunks(x, n: int):
    """``x`` flattened, zero-padded to ``n·c`` entries (``c = ceil(size/n)``) and reshaped ``(n, c)``."""
    flat = jnp.ravel(x)
    c = _chunk_len(flat.shape[0], n)
    return jnp.pad(flat, (0, n * c - flat.shape[0])).reshape(n, c)


def from_chunks(chunks, shape):
    """Inverse of :func:`to_chunks`: drop the padding, restore ``shape``."""
    size = int(np.prod(shape, dtype=np.int64))
    return chunks.reshape(-1)[:size].reshape(shape)


def _take_chunk(x, n: int, me):
    return jax.lax.dynamic_index_in_dim(to_chunks(x, n), me, keepdims=False)


def _put_chunk(full, part, n: int, me):
    chunks = jax.lax.dynamic_update_index_in_dim(to_chunks(full, n), part.astype(full.dtype), me, 0)
    return from_chunks(chunks, jnp.shape(full))


def _reduce_scatter(comm, phis, keys, compressors, acc, memory, owner: Owner | None, n: int, me) -> Exchanged:
    if owner is None:
        raise ValueError("strategy 'reduce_scatter' needs the owners' step (Owner)")
    payloads, own, errors, bits, stacked = [], [], [], [], []
    want_error = memory is not None and memory.from_error is not None
    for phi, key, c in zip(phis, keys, compressors):
        # Independent draws per worker, except for summable payloads (their shared fields must agree).
        k = key if c.strategy == "allreduce" else jax.random.fold_in(key, me)
        chunk_payloads = jax.vmap(lambda x, kk, c=c: c.compress(x, kk, ())[0])(
            to_chunks(phi, n), jax.random.split(k, n)
        )
        stacked.append(chunk_payloads)
        g_hat = from_chunks(jax.vmap(c.decompress)(chunk_payloads), jnp.shape(phi)).astype(jnp.result_type(phi))
        own.append(None if want_error else g_hat)
        errors.append((phi - g_hat).astype(jnp.result_type(phi)) if want_error else None)
        payloads.append(chunk_payloads)

    # Compressed all-to-all in n - 1 permutation rounds: in round r, chunk (me + r) % n goes to its owner.
    received = [jax.tree.map(lambda a: a[me], stacked)]
    sent_bits: list[Any] = [0] * len(phis)
    messages = 0
    for r in range(1, n):
        send = jax.tree.map(lambda a, r=r: a[(me + r) % n], stacked)
        sent_bits = [b + _sent_bits(p) for b, p in zip(sent_bits, send)]  # whole: capacity buffers included
        messages += len(jax.tree.leaves(send))
        received.append(comm.permute(send, [(s, (s + r) % n) for s in range(n)]))

    # Each owner: average its chunk in float32, compensate with its memory, compress again.
    owner_payloads, owner_bits, owner_mems = [], [], []
    for i, (phi, c, a) in enumerate(zip(phis, compressors, acc)):
        dtype = jnp.result_type(phi)
        size = int(np.size(phi))
        clen = _chunk_len(size, n)
        real = me * clen + jnp.arange(clen) < size  # entries of this chunk that are not padding
        total = jnp.zeros((clen,), a)
        for rec in received:
            total = total + c.decompress(rec[i]).astype(a)
        mean = jnp.where(real, total / n, 0).astype(dtype)
        full_mem = owner.memory_leaves[i]
        m = jax.tree.map(lambda s: _take_chunk(s, n, me), full_mem)
        v = owner.memory.compensate(m, mean)
        payload, _ = owner.compressor.compress(v, jax.random.fold_in(owner.keys[i], me), ())
        q = jnp.where(real, owner.compressor.decompress(payload), 0).astype(v.dtype)
        if owner.fold_rounding:
            rounding = jnp.where(real, (mean.astype(a) - q.astype(a)) * n, 0).astype(dtype)
            owner_mems.append(_put_chunk(jnp.zeros(jnp.shape(phi), dtype), rounding, n, me))
        else:
            new_m = owner.memory.update(m, mean, v, q)
            owner_mems.append(jax.tree.map(lambda full, part: _put_chunk(full, part, n, me), full_mem, new_m))
        owner_payloads.append(payload)
        owner_bits.append(_sent_bits(payload))

    gathered = comm.all_gather(owner_payloads)
    messages += len(jax.tree.leaves(owner_payloads))
    means = [
        from_chunks(jax.vmap(owner.compressor.decompress)(g), jnp.shape(phi)).astype(jnp.result_type(phi))
        for phi, g in zip(phis, gathered)
    ]
    bits = [BitCount.of(b) for b in sent_bits]
    states = [()] * len(phis)
    return Exchanged(payloads, states, [None] * len(phis), means, own, errors, bits, owner_bits, owner_mems, messages)


# --------------------------------------------------------------------------- #
# One step of a compressing transformation
# --------------------------------------------------------------------------- #
def compress_step(
    comm,
    updates,
    state: CompressionState,
    *,
    compressor,
    memory: memory_lib.Memory,
    strategy: str,
    fuse: bool = True,
    scope: str = "leaf",
    owner_step=None,
):
    """Compensate → compress → communicate → aggregate → memory update, for a gradient tree.

    Args:
      comm: the communicator.
      updates: this worker's gradient tree (floating leaves).
      state: its :class:`CompressionState`.
      compressor: a :class:`~jaxcomm.compressors.Compressor`, or a function
        ``tensor -> Compressor`` called per compressed tensor at trace time
        (for hyper-parameters that depend on the tensor's size).
      memory: the worker memory (φ, ψ).
      strategy: one of :data:`STRATEGIES`.
      fuse: see :func:`exchange`.
      scope: ``"leaf"`` (each array compressed alone) or ``"global"`` (all
        leaves flattened into one tensor, one selection over the whole tree).
      owner_step: ``"reduce_scatter"`` only: ``leaf_keys -> Owner``.
    Returns:
      ``(exchanged, leaves, treedef, new_state, groups)``: the exchange (per
      compressed tensor), the gradient leaves, their treedef, the new state
      (memory updated) and the leaf indices of each compressed tensor.
    """
    leaves, treedef, mem_leaves = flatten_updates(updates, state, scope)
    if int(comm.size) > 1:
        check_per_worker(comm, leaves)
    groups = groups_of(len(leaves), scope)
    key, keys = step_keys(state.key, len(groups))
    phi_leaves = [memory.compensate(m, g) for m, g in zip(mem_leaves, leaves)]
    phis = [group_vector(phi_leaves, idx) for idx in groups]
    compressors = [compressor if isinstance(compressor, Compressor) else compressor(phi) for phi in phis]
    for c, phi, cs in zip(compressors, phis, state.compressor_states):
        c.check_state(phi, cs, "compressor state")
    owner = owner_step(keys) if owner_step is not None else None
    ex = exchange(
        comm,
        phis,
        list(keys[: len(groups)]),
        list(state.compressor_states),
        compressors,
        strategy,
        fuse=fuse,
        memory=memory,
        owner=owner,
    )

    new_mem = list(mem_leaves)
    from_error = memory.from_error
    for idx, err, own in zip(groups, ex.errors, ex.own):
        parts = ungroup(err if err is not None else own, phi_leaves, idx)
        for i, part in parts.items():
            if err is not None and from_error is not None:  # errors come only for such memories
                new_mem[i] = from_error(mem_leaves[i], part)
            else:
                new_mem[i] = memory.update(mem_leaves[i], leaves[i], phi_leaves[i], part)
    new_state = CompressionState(
        count=state.count + 1,
        key=key,
        memory=jax.tree_util.tree_unflatten(treedef, new_mem),
        compressor_states=tuple(ex.states),
        wire_bits=BitCount.stack(ex.bits) if ex.bits else BitCount.zeros((0,)),
        messages=jnp.asarray(ex.messages, jnp.int32),
        notfinite_count=state.notfinite_count,
    )
    return ex, leaves, treedef, new_state, groups


# --------------------------------------------------------------------------- #
# Non-finite gradients
# --------------------------------------------------------------------------- #
def check_skip_nonfinite(skip_nonfinite) -> bool:
    """``skip_nonfinite`` if it is a bool; ``TypeError`` naming it otherwise."""
    return check_bool(skip_nonfinite, "skip_nonfinite")


def _each_compression_state(fn, state):
    """``state`` with ``fn(s, first)`` applied to every :class:`CompressionState` ``s`` in it (tree order;
    ``first`` is true for the first one only)."""
    seen: list = []

    def one(node):
        if not isinstance(node, CompressionState):
            return node
        seen.append(node)
        return fn(node, len(seen) == 1)

    return jax.tree.map(one, state, is_leaf=lambda node: isinstance(node, CompressionState))


def if_finite(comm, updates, state, step, *, skip: bool):
    """One step of a compressing transformation under the non-finite policy: ``(outputs, new_state)``.

    Every worker computes ``bad_i = any(¬isfinite(g))`` over every leaf of its ``updates``.

    * ``skip=False``: ``step(updates, state)`` runs as it is, and every
      :class:`CompressionState` in the new state adds ``bad_i`` to its ``notfinite_count``
      (this worker's own gradient; nothing is communicated).
    * ``skip=True``: with ``n > 1`` workers, the flags are summed, ``B = Σ_i bad_i``, by one
      all-reduce of an int32 scalar (:data:`NONFINITE_FLAG_BITS` bits, reported on the first
      tensor of the first :class:`CompressionState`, and one message); with one worker
      ``B = bad_0``. ``B > 0`` is the same on every worker, so every worker takes the same
      branch of a ``lax.cond``: when ``B = 0``, ``step(updates, state)``; otherwise zeros
      shaped and typed like ``updates`` and ``state`` unchanged except that every
      :class:`CompressionState` adds 1 to ``notfinite_count`` and records only the flag in
      ``wire_bits`` and ``messages``. Skipping together keeps the workers' outputs (and
      so their parameters) identical, and every collective of the step is run by all of
      them or by none.

    Args:
      comm: the workers' communicator (``size`` and ``sum``).
      updates: this worker's gradient tree.
      state: the transformation's state: a :class:`CompressionState` or a NamedTuple of them.
      step: ``(updates, state) -> (outputs, new_state)``, the transformation's step.
      skip: the policy (the transformations' ``skip_nonfinite``).
    """
    leaves = jax.tree.leaves(updates)
    if not leaves:
        return step(updates, state)
    bad = jnp.logical_not(jnp.all(jnp.stack([jnp.all(jnp.isfinite(g)) for g in leaves])))
    if not skip:
        outputs, new_state = step(updates, state)
        flagged = bad.astype(jnp.int32)
        return outputs, _each_compression_state(
            lambda s, first: s._replace(notfinite_count=s.notfinite_count + flagged), new_state
        )
    n = int(comm.size)
    if n > 1:
        skipped = comm.sum(bad.astype(jnp.int32)) > 0
        flag_bits, flag_messages = NONFINITE_FLAG_BITS, 1
    else:
        skipped, flag_bits, flag_messages = bad, 0, 0

    def charge(s: CompressionState, first: bool) -> CompressionState:
        if not first or not flag_messages or not s.wire_bits.shape[0]:
            return s
        extra = BitCount.stack([flag_bits] + [0] * (s.wire_bits.shape[0] - 1))
        return s._replace(wire_bits=s.wire_bits + extra, messages=s.messages + flag_messages)

    def run(_):
        outputs, new_state = step(updates, state)
        return outputs, _each_compression_state(charge, new_state)

    def skip_step(_):
        def skipped_state(s: CompressionState, first: bool) -> CompressionState:
            quiet = s._replace(
                wire_bits=BitCount.zeros(s.wire_bits.shape),
                messages=jnp.zeros((), jnp.int32),
                notfinite_count=s.notfinite_count + 1,
            )
            return charge(quiet, first)

        zeros = jax.tree.map(lambda g: jnp.zeros(jnp.shape(g), jnp.result_type(g)), updates)
        return zeros, _each_compression_state(skipped_state, state)

    return typed_cond(skipped, skip_step, run)


LOCAL = Local()
"""The one-worker communicator the single-process transforms run the pipeline on."""
