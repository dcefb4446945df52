"""Gradient accumulation that communicates once every ``k`` micro-steps.

``optax.MultiSteps`` cannot save communication: on every micro-step it runs the
inner transformation's ``update`` and discards the result with ``jnp.where``, so
a communicating transform inside it (``compressed_mean``, ...) sends on every
micro-step, while its counters are discarded on ``k - 1`` of them. :func:`accumulate`
instead sums the micro-gradients locally and calls the wrapped transformation
under ``jax.lax.cond`` on the ``k``-th micro-step only: the other ``k - 1`` steps
run no collective and record zero wire bits and messages.
"""

from __future__ import annotations

from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
import optax

from .._validate import check_int, check_same_tree
from .._vma import typed_cond

__all__ = ["AccumulateState", "accumulate", "warn_multisteps", "zero_counters"]

COUNTERS = ("wire_bits", "messages")
"""State fields that record a step's communication (summed by the trainer)."""


class AccumulateState(NamedTuple):
    """State of :func:`accumulate`.

    Attributes:
      count: int32 scalar, micro-steps seen (this one included after ``update``).
      grad_sum: the micro-gradients summed since the last communication, float32
        (float64 for float64 gradients), shaped like the gradient tree.
      inner_state: the wrapped transformation's state; its ``wire_bits`` and
        ``messages`` fields read zero after a micro-step that did not communicate.
    """

    count: jax.Array  # type: ignore[assignment]  # optax's name for the step count; shadows tuple.count
    grad_sum: Any
    inner_state: Any


def _has_counters(node) -> bool:
    return hasattr(node, "_fields") and any(f in node._fields for f in COUNTERS)


def zero_counters(state):
    """``state`` with every NamedTuple's ``wire_bits``/``messages`` fields set to zero (same shapes)."""

    def zero(node):
        if not _has_counters(node):
            return node
        return node._replace(
            **{f: jax.tree.map(jnp.zeros_like, getattr(node, f)) for f in COUNTERS if f in node._fields}
        )

    return jax.tree.map(zero, state, is_leaf=_has_counters)


def warn_multisteps(opt_state, *, refuse: bool = False) -> bool:
    """Warn (``UserWarning``), or with ``refuse`` raise ``ValueError``, when ``opt_state`` holds an
    ``optax.MultiSteps`` state around a communicating transformation's state; return whether it did.

    ``optax.MultiSteps`` runs the wrapped update on every micro-step, so the
    collectives run ``k`` times per optimizer step and ``k - 1`` of their counts are
    discarded. :func:`accumulate` is the replacement.
    """
    import warnings

    def is_ms(node):
        return isinstance(node, optax.MultiStepsState)

    for node in jax.tree.leaves(opt_state, is_leaf=is_ms):
        inner = jax.tree.leaves(getattr(node, "inner_opt_state", None), is_leaf=_has_counters)
        if is_ms(node) and any(_has_counters(n) for n in inner):
            message = (
                "optax.MultiSteps wraps a communicating jaxcomm transform: it would communicate on every "
                "micro-step (and discard k - 1 of the counts). Use jaxcomm.transforms.accumulate(tx, every_k=k), "
                "which communicates once per k micro-steps."
            )
            if refuse:
                raise ValueError(message)
            warnings.warn(message, UserWarning, stacklevel=2)
            return True
    return False


def _sum_dtype(g):
    return jnp.promote_types(jnp.result_type(g), jnp.float32)


def accumulate(inner: optax.GradientTransformation, every_k: int) -> optax.GradientTransformationExtraArgs:
    """Sum ``every_k`` micro-step gradients locally, then run ``inner`` once on their mean.

    With micro-gradients ``g_1, ..., g_k`` since the last communication, the
    ``k``-th micro-step returns ``inner.update((1/k) Σ_j g_j, inner_state, params)``;
    the other micro-steps return zero updates, leave ``inner``'s state unchanged
    (except its counters, which read zero) and communicate nothing. Wrap the whole
    chain, as with ``optax.MultiSteps``::

        tx = jaxcomm.transforms.accumulate(
            optax.chain(jaxcomm.compressed_mean(c, axis_name="data"), optax.sgd(0.1)), every_k=4)

    Works under ``jax.jit``, ``jax.vmap`` (both branches run, as ``lax.cond``
    does under ``vmap``; the result is the selected one) and ``jax.shard_map``
    (only the taken branch, collectives included, runs; every worker takes the same
    branch because the count is the same on every worker). The sum is kept in
    float32 (float64 for float64 gradients), so 16-bit gradients are not rounded
    ``k`` times.

    Args:
      inner: any optax transformation (typically the chain that communicates).
      every_k: micro-steps per communication, integer ``>= 1`` (1: ``inner`` itself,
        called every step).
    Returns:
      An optax transformation with :class:`AccumulateState`; extra arguments of
      ``update`` are passed to ``inner`` on the communicating micro-step.
    Raises:
      TypeError: ``inner`` is not an optax transformation.
      ValueError: ``every_k`` is not an integer ``>= 1``; at ``update``, gradients whose tree or
        leaf shapes differ from the parameters ``init`` saw.
    """
    if not (callable(getattr(inner, "init", None)) and callable(getattr(inner, "update", None))):
        raise TypeError(f"inner must be an optax GradientTransformation; got {type(inner).__name__}")
    every_k = check_int(every_k, "every_k", minimum=1)
    inner = optax.with_extra_args_support(inner)

    def init(params):
        grad_sum = jax.tree.map(lambda p: jnp.zeros(jnp.shape(p), _sum_dtype(p)), params)
        return AccumulateState(jnp.zeros((), jnp.int32), grad_sum, inner.init(params))

    def update(updates, state, params=None, **extra_args):
        check_same_tree(updates, state.grad_sum, "the accumulated gradient")
        count = state.count + 1
        total = jax.tree.map(lambda s, g: s + g.astype(s.dtype), state.grad_sum, updates)

        def communicate(_):
            mean = jax.tree.map(lambda s, g: (s / every_k).astype(jnp.result_type(g)), total, updates)
            new_updates, inner_state = inner.update(mean, state.inner_state, params, **extra_args)
            return new_updates, inner_state, jax.tree.map(jnp.zeros_like, total)

        def hold(_):
            # Zeros typed device-invariant (``zeros_like`` of a per-worker gradient would vary): with
            # replicated parameters the communicating branch's mean is invariant, and the two branches
            # are typed alike as the union of their varying axes.
            zeros = jax.tree.map(lambda g: jnp.zeros(jnp.shape(g), jnp.result_type(g)), updates)
            return zeros, zero_counters(state.inner_state), total

        new_updates, inner_state, grad_sum = typed_cond(count % every_k == 0, communicate, hold)
        return new_updates, AccumulateState(count, grad_sum, inner_state)

    return optax.GradientTransformationExtraArgs(init, update)
