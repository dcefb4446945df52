"""The per-tensor pipeline every gradient transformation is built on.

One step, per worker ``i`` and per tensor (GRACE Algorithm 1, generalised)::

    φ_i   = memory.compensate(m_i, g_i)                compensate
    p_i   = Q(φ_i)                                      compress: the payload is what is sent
    Σ     = communicate(p_1 .. p_n)                     strategy (below)
    m_i  ← memory.update(m_i, g_i, φ_i, Q⁻¹(p_i))       memory update (or from Q's error hook)

The strategies (how the payloads become the sum ``Σ_i Q⁻¹(p_i)``: ``"allreduce"``, ``"allgather"``,
``"broadcast"``, ``"reduce_scatter"``, and the rounds of multi-round compressors) are one function
each in :mod:`._strategies`, dispatched by the strategy's name; the collectives they run and the
rounds' drivers are in :mod:`._collectives`, the state in :mod:`._state`, the checks every
transform shares in :mod:`._checks`. This module is the per-tree step, :func:`compress_step`, its
result (:class:`Step`, whose :meth:`Step.output` applies the memory's output scale, :func:`scaled`)
and the non-finite policy, :func:`if_finite`.

A one-worker communicator (:class:`jaxcomm.comm.Local`) turns the pipeline into plain error
feedback: nothing is sent and ``Σ`` is the worker's own reconstruction.

Wire accounting happens in the pipeline and only there (the strategies count what they hand to the
collectives; :func:`compress_step` stores it): ``state.wire_bits[j]`` is the exact
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

from typing import Any, NamedTuple

import jax
import jax.numpy as jnp

from .. import memory as memory_lib
from .._bitcount import BitCount
from .._keys import step_keys
from .._vma import typed_cond
from ..compressors import Compressor
from ._checks import check_compressor, check_per_worker, check_stateless
from ._state import CompressionState, flatten_updates, group_vector, groups_of, ungroup
from ._strategies import Owned, exchange, stack_bits

__all__ = [
    "NONFINITE_FLAG_BITS",
    "Step",
    "compress_step",
    "if_finite",
    "scaled",
    # where the hierarchical mean imports them from
    "CompressionState",
    "check_compressor",
    "check_per_worker",
    "check_stateless",
]

NONFINITE_FLAG_BITS = 32
"""Bits each worker sends per step for the non-finite flag with ``skip_nonfinite=True`` and more
than one worker (one int32 all-reduce; :func:`if_finite`)."""


def scaled(mean, scale: float):
    """``scale · mean``: a memory's ``output_scale`` applied to the mean over workers (shape and dtype of
    ``mean``). With ``scale == 1`` the mean itself, with no multiplication."""
    return mean if scale == 1.0 else mean * scale


class Step(NamedTuple):
    """One step of the pipeline over a gradient tree (:func:`compress_step`), per compressed tensor ``j``.

    Attributes:
      state: the new :class:`CompressionState` (memory, compressor states, wire bits updated).
      leaves: the gradient leaves (``jax.tree.leaves`` order); treedef: their tree.
      groups: the leaf indices of each compressed tensor.
      payloads: this worker's payload per tensor.
      totals: ``Σ_i Q⁻¹(p_i)`` per tensor in float32 or wider (``None`` under ``"reduce_scatter"``).
      means: the mean over workers per tensor, ``totals / n`` in float32 or wider
        (``"reduce_scatter"``: the owners' averages, in the tensor's dtype).
      owner: the chunk owners' bits and memories (:class:`Owned`) under ``"reduce_scatter"``, else ``None``.
    """

    state: CompressionState
    leaves: list
    treedef: Any
    groups: list
    payloads: list
    totals: list
    means: list
    owner: Owned | None

    def output(self, scale: float = 1.0):
        """``scale · mean`` per leaf (:func:`scaled`), cast to the leaf's dtype, as the gradient's tree
        (``"leaf"`` scope: one tensor per leaf)."""
        return self.treedef.unflatten([scaled(m, scale).astype(g.dtype) for m, g in zip(self.means, self.leaves)])


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
) -> Step:
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
      fuse: see :func:`~._strategies.exchange`.
      scope: ``"leaf"`` (each array compressed alone) or ``"global"`` (all
        leaves flattened into one tensor, one selection over the whole tree).
      owner_step: ``"reduce_scatter"`` only: ``leaf_keys -> Owner``.
    Returns:
      a :class:`Step`: the new state (memory updated), the gradient leaves and their treedef,
      the leaf indices of each compressed tensor, and per tensor the payload, the sum and the
      mean over workers, with the chunk owners' part under ``"reduce_scatter"``.
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
        wire_bits=stack_bits(ex.bits),
        messages=jnp.asarray(ex.messages, jnp.int32),
        notfinite_count=state.notfinite_count,
    )
    return Step(new_state, leaves, treedef, groups, ex.payloads, ex.totals, ex.means, ex.owner)


# --------------------------------------------------------------------------- #
# Non-finite gradients
# --------------------------------------------------------------------------- #
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
