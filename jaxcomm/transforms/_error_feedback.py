"""Single-process error feedback (EF-SGD) as an optax gradient transformation.

GRACE Algorithm 1 with one node: the pipeline (:mod:`._pipeline`) over a
one-worker communicator, so nothing is sent and the output is this worker's own
reconstruction ``Q⁻¹(Q(φ(m, g)))``; chain any optax optimizer after it.
"""

from __future__ import annotations

import optax

from .. import memory as memory_lib
from ..compressors._base import Compressor
from ._pipeline import LOCAL, CompressionState, check_compressor, check_memory, compress_step, init_state

__all__ = ["error_feedback"]


def error_feedback(
    compressor: Compressor, memory: memory_lib.Memory | None = None
) -> optax.GradientTransformationExtraArgs:
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
    uses ``split(step_key, num_leaves)[i]``. Works under ``jax.jit``, and per
    worker inside ``jax.shard_map``.

    Args:
      compressor: a :class:`~jaxcomm.compressors.Compressor`.
      memory: a :class:`~jaxcomm.memory.Memory`; default ``residual()``.
    Returns:
      An optax ``GradientTransformationExtraArgs`` with state
      :class:`~jaxcomm.transforms.CompressionState`; ``state.wire_bits[i]`` is
      the exact size of leaf ``i``'s payload at the last step (what a worker
      would send).
    Raises:
      ValueError: at ``init``, a memory that needs a contraction (``Memory.needs_contraction``)
        around an unbiased compressor whose variance factor is ``ω ≥ 1`` at a tensor's size (it
        would diverge; :func:`jaxcomm.compressors.contractive` scales it into a contraction),
        or around one that declares ``no_contraction`` (signsgd, signum).
      TypeError: ``compressor`` or ``memory`` of the wrong type; non-float leaves.
      ValueError: ``update`` sees a different tree than ``init``.
    """
    compressor = check_compressor(compressor)
    memory = memory_lib.residual() if memory is None else check_memory(memory)
    strategy = compressor.strategy
    scale = float(memory.output_scale)

    def init_fn(params):
        return init_state(params, compressor, memory)

    def update_fn(updates, state: CompressionState, params=None, **extra_args):
        del params, extra_args
        ex, leaves, treedef, new_state, _ = compress_step(
            LOCAL, updates, state, compressor=compressor, memory=memory, strategy=strategy
        )
        outs = [(m if scale == 1.0 else m * scale).astype(g.dtype) for m, g in zip(ex.means, leaves)]
        return treedef.unflatten(outs), new_state

    return optax.GradientTransformationExtraArgs(init_fn, update_fn)
