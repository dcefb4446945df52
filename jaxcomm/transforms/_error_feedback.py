"""Single-process error feedback (EF-SGD) as an optax gradient transformation.

GRACE Algorithm 1 with one node: the pipeline (:mod:`._pipeline`) over a
one-worker communicator, so nothing is sent and the output is this worker's own
reconstruction ``Q⁻¹(Q(φ(m, g)))``; chain any optax optimizer after it.
"""

from __future__ import annotations

import optax

from .. import memory as memory_lib
from ..compressors import Compressor
from ._checks import check_compressor, check_memory, check_skip_nonfinite
from ._collectives import LOCAL
from ._pipeline import compress_step, if_finite
from ._state import CompressionState, init_state

__all__ = ["error_feedback"]


def error_feedback(
    compressor: Compressor, memory: memory_lib.Memory | None = None, *, skip_nonfinite: bool = False
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

    Non-finite gradients: with ``skip_nonfinite=True``, a step whose gradient has a NaN or
    Inf in any leaf outputs zeros and leaves the state (count, key, memories) as it was,
    adding one to ``state.notfinite_count`` (what ``optax.apply_if_finite`` does around
    it; nothing is communicated either way). With ``False`` (default) the step runs as it
    is, a memory that keeps the error keeps the non-finite entries for later steps, and
    ``state.notfinite_count`` counts such steps.

    Args:
      compressor: a :class:`~jaxcomm.compressors.Compressor`.
      memory: a :class:`~jaxcomm.memory.Memory`; default ``residual()``.
      skip_nonfinite: skip a step whose gradient is not finite (above).
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
      TypeError: ``compressor`` or ``memory`` of the wrong type, ``skip_nonfinite`` not a bool;
        non-float leaves.
      ValueError: ``update`` sees a different tree than ``init``.
    """
    compressor = check_compressor(compressor)
    memory = memory_lib.residual() if memory is None else check_memory(memory)
    skip = check_skip_nonfinite(skip_nonfinite)
    strategy = compressor.strategy
    scale = float(memory.output_scale)

    def init_fn(params):
        return init_state(params, compressor, memory)

    def step(updates, state: CompressionState):
        done = compress_step(LOCAL, updates, state, compressor=compressor, memory=memory, strategy=strategy)
        return done.output(scale), done.state

    def update_fn(updates, state: CompressionState, params=None, **extra_args):
        del params, extra_args
        return if_finite(LOCAL, updates, state, step, skip=skip)

    return optax.GradientTransformationExtraArgs(init_fn, update_fn)
