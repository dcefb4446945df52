"""Single-process error feedback (EF-SGD) as an optax gradient transformation.

GRACE Algorithm 1 with one node: per tensor, compensate with the memory,
compress, decompress, update the memory (lines 5-6, 9). The output is this
worker's reconstruction ``Q⁻¹(Q(φ(m, g)))``; chain any optax optimizer after it.
The helpers here are shared with :func:`jaxcomm.compressed_mean`.
"""

from __future__ import annotations

from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
import numpy as np
import optax

from .. import memory as memory_lib
from ..compressors._base import Compressor, check_float_input, wire_bits

__all__ = ["ErrorFeedbackState", "error_feedback"]

_INT32_MAX = int(np.iinfo(np.int32).max)


class ErrorFeedbackState(NamedTuple):
    """State of :func:`error_feedback`.

    Attributes:
      count: int32 scalar, steps taken.
      key: PRNG key (raw ``uint32[2]``), split once per step.
      memory: a tree with the parameters' structure whose leaves are the
        per-array memory states (arrays like the parameters for
        :func:`~jaxcomm.memory.residual`; ``()`` for :func:`~jaxcomm.memory.none`).
      compressor_states: tuple, the compressor's per-array state for each
        gradient leaf (``jax.tree.leaves`` order).
      wire_bits: ``int32[num_leaves]``, the exact bits of each tensor's payload
        at the last step (the volume a worker would send).
    """

    count: jax.Array
    key: jax.Array
    memory: Any
    compressor_states: tuple
    wire_bits: jax.Array


# --------------------------------------------------------------------------- #
# Helpers shared with compressed_mean
# --------------------------------------------------------------------------- #
def check_compressor(compressor) -> Compressor:
    if not isinstance(compressor, Compressor):
        raise TypeError(
            f"compressor must be a jaxcomm.compressors.Compressor (e.g. jaxcomm.compressors.topk(0.01)); "
            f"got {type(compressor).__name__}"
        )
    return compressor


def check_memory(memory) -> memory_lib.Memory:
    if not isinstance(memory, memory_lib.Memory):
        raise TypeError(
            f"memory must be a jaxcomm.memory.Memory (e.g. jaxcomm.memory.residual()); got {type(memory).__name__}"
        )
    return memory


def init_leaves(params, compressor: Compressor, memory: memory_lib.Memory):
    """(count, key, memory tree, compressor states, wire bits) for ``params``."""
    leaves, treedef = jax.tree_util.tree_flatten(params)
    for leaf in leaves:
        check_float_input(leaf, "params")
    leaves = [jnp.asarray(x) for x in leaves]
    mem = jax.tree_util.tree_unflatten(treedef, [memory.init(x) for x in leaves])
    cstates = tuple(compressor.init_state(x) for x in leaves)
    return (
        jnp.zeros((), jnp.int32),
        jax.random.PRNGKey(compressor.seed),
        mem,
        cstates,
        jnp.zeros((len(leaves),), jnp.int32),
    )


def flatten_updates(updates, state):
    """Leaves and per-leaf memory states; ``ValueError`` if the trees do not match."""
    leaves, treedef = jax.tree_util.tree_flatten(updates)
    try:
        mem_leaves = treedef.flatten_up_to(state.memory)
    except (ValueError, TypeError) as e:
        raise ValueError(
            f"updates has tree structure {treedef} but the state was initialised for a different tree; "
            f"init and update must see the same tree ({e})"
        ) from None
    if len(leaves) != len(state.compressor_states):
        raise ValueError(
            f"updates has {len(leaves)} leaves but the state was initialised for "
            f"{len(state.compressor_states)}; init and update must see the same tree"
        )
    for g in leaves:
        check_float_input(g, "updates")
    return leaves, treedef, mem_leaves


def step_keys(key, num_leaves: int):
    """The key schedule: ``key, step_key = split(key)``; leaf ``i`` uses ``split(step_key, L)[i]``."""
    key, step_key = jax.random.split(key)
    return key, jax.random.split(step_key, max(num_leaves, 1))


def bits_int32(bits):
    """A payload's wire bits as an int32 scalar (exact; ``ValueError`` past 2**31 - 1)."""
    if isinstance(bits, (int, np.integer)):
        if bits > _INT32_MAX:
            raise ValueError(
                f"a single tensor's payload has {bits} bits, beyond the int32 wire-bit counter; "
                "split the tensor"
            )
        return jnp.asarray(bits, jnp.int32)
    return jnp.asarray(bits).astype(jnp.int32)


# --------------------------------------------------------------------------- #
# error_feedback
# --------------------------------------------------------------------------- #
def error_feedback(compressor: Compressor, memory: memory_lib.Memory | None = None) -> optax.GradientTransformationExtraArgs:
    """Error-feedback compression of a gradient tree (EF-SGD; GRACE Algorithm 1 with one node).

    Per leaf ``g`` (any shape, floating dtype), with memory state ``m``:

        φ = memory.compensate(m, g)            (GRACE Eq. 4: β m + γ g)
        g̃ = Q(φ);   ĝ = Q⁻¹(g̃)                 (the compressor's payload and reconstruction)
        m ← memory.update(m, g, φ, ĝ)          (Eq. 4: φ − ĝ)
        output = memory.output_scale · ĝ

    The output has the gradient's tree, shapes and dtypes; chain an optimizer
    after it: ``optax.chain(error_feedback(topk(ratio=0.01)), optax.sgd(0.1))``.
    With :func:`~jaxcomm.memory.residual` (``β = γ = 1``) this is EF-SGD
    (Stich et al. 2018; Karimireddy et al. 2019), and gradient mass is
    conserved: ``Σ_t output_t + m_T = Σ_t g_t``.

    Randomness: ``state.key`` starts at ``PRNGKey(compressor.seed)``; each step
    ``key, step_key = split(key)`` and leaf ``i`` (``jax.tree.leaves`` order)
    uses ``split(step_key, num_leaves)[i]`` (the compressor's own optax key
    schedule). Works under ``jax.jit``, and per worker inside ``jax.shard_map``.

    Args:
      compressor: a :class:`~jaxcomm.compressors.Compressor`.
      memory: a :class:`~jaxcomm.memory.Memory`; default ``residual()``.
    Returns:
      An optax ``GradientTransformationExtraArgs`` with state :class:`ErrorFeedbackState`.
    Raises:
      TypeError: ``compressor`` or ``memory`` of the wrong type; non-float leaves.
      ValueError: ``update`` sees a different tree than ``init``.
    """
    compressor = check_compressor(compressor)
    memory = memory_lib.residual() if memory is None else check_memory(memory)
    scale = float(memory.output_scale)

    def init_fn(params):
        return ErrorFeedbackState(*init_leaves(params, compressor, memory))

    def update_fn(updates, state, params=None, **extra_args):
        del params, extra_args
        leaves, treedef, mem_leaves = flatten_updates(updates, state)
        key, keys = step_keys(state.key, len(leaves))
        outs, mems, cstates, bits = [], [], [], []
        for i, (g, m, cs) in enumerate(zip(leaves, mem_leaves, state.compressor_states)):
            phi = memory.compensate(m, g)
            payload, cs = compressor.compress(phi, keys[i], cs)
            g_hat = compressor.decompress(payload)
            mems.append(memory.update(m, g, phi, g_hat))
            out = g_hat if scale == 1.0 else g_hat * scale
            outs.append(out.astype(jnp.result_type(g)))
            cstates.append(cs)
            bits.append(bits_int32(wire_bits(payload)))
        new_state = ErrorFeedbackState(
            count=state.count + 1,
            key=key,
            memory=jax.tree_util.tree_unflatten(treedef, mems),
            compressor_states=tuple(cstates),
            wire_bits=jnp.stack(bits) if bits else jnp.zeros((0,), jnp.int32),
        )
        return jax.tree_util.tree_unflatten(treedef, outs), new_state

    return optax.GradientTransformationExtraArgs(init_fn, update_fn)
