"""Varying manual axes: jax's type-level record of which mesh axes a value differs over.

Inside ``jax.shard_map`` (``check_vma=True``) every value's type carries the set
of manual mesh axes it *varies* over: ``jax.lax.axis_index("data")`` varies over
``"data"``, a constant or a ``psum`` result does not. jaxcomm reads this set in
two places: to refuse a gradient that ``jax.grad`` already summed over the axis
(the replicated-parameters pitfall), and to give both branches of a
``lax.cond`` / the carry of a loop the same type. Outside ``shard_map`` (and
under ``jax.vmap``) every set is empty and the casts are the identity.
"""

from __future__ import annotations

import jax

__all__ = ["varying_axes", "cast_varying", "vary_like", "typed_switch", "typed_cond"]


def varying_axes(x) -> frozenset:
    """The manual mesh axes ``x`` varies over (``frozenset`` of axis names; empty when untracked)."""
    mat = getattr(jax.typeof(x), "manual_axis_type", None)
    return frozenset(mat.varying) if mat is not None else frozenset()


def cast_varying(x, axes: frozenset):
    """``x`` marked as varying over every axis in ``axes`` (``jax.lax.pcast``; no-op where it already is)."""
    missing = tuple(sorted(frozenset(axes) - varying_axes(x)))
    return jax.lax.pcast(x, missing, to="varying") if missing else x


def vary_like(x, *refs):
    """``x`` marked as varying over every axis some of ``refs`` varies over (for loop carries and cond branches)."""
    return cast_varying(x, frozenset().union(*(varying_axes(r) for r in refs)))


def typed_switch(index, branches, operand=None):
    """``jax.lax.switch(index, branches, operand)`` whose branches may differ in varying axes.

    Every branch is traced abstractly (``jax.eval_shape``) and every output leaf is cast to
    vary over the union of the axes it varies over in any branch, so ``lax.switch`` sees one
    type. Only the taken branch runs (its collectives included) where ``index`` is a scalar
    outside ``jax.vmap``; every worker must compute the same ``index`` when branches communicate.
    """
    branches = list(branches)
    shapes = [jax.eval_shape(b, operand) for b in branches]
    axes = jax.tree.map(lambda *outs: frozenset().union(*(varying_axes(o) for o in outs)), *shapes)

    def typed(branch):
        return lambda op: jax.tree.map(cast_varying, branch(op), axes)

    return jax.lax.switch(index, [typed(b) for b in branches], operand)


def typed_cond(pred, true_fn, false_fn, operand=None):
    """``jax.lax.cond(pred, true_fn, false_fn, operand)`` whose branches may differ in varying axes
    (:func:`typed_switch` with the branches ``(false_fn, true_fn)``)."""
    return typed_switch(jax.numpy.asarray(pred).astype("int32"), (false_fn, true_fn), operand)
