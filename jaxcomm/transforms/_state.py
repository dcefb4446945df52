"""The pipeline's state, :class:`CompressionState`, and the grouping of gradient leaves into the
tensors it compresses (one per leaf, or the whole tree as one)."""

from __future__ import annotations

from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
import numpy as np

from .. import memory as memory_lib
from .._bitcount import BitCount
from .._validate import check_float_input
from ..compressors import Compressor
from ._checks import check_feedback

__all__ = ["CompressionState", "flatten_updates", "group_vector", "groups_of", "init_state", "ungroup"]


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
    """Inverse of :func:`group_vector`: ``{i: array shaped and typed like leaves[i]}``."""
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
