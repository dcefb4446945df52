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

__all__ = ["varying_axes", "cast_varying", "vary_like", "typed_cond", "typed_switch", "typed_platform_dependent"]


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


def _typed_branches(branches, operand):
    """``branches`` with every output leaf cast to vary over the union of the axes it varies over in any
    branch (each branch traced abstractly, ``jax.eval_shape``), so ``lax.cond``/``lax.switch`` sees one type."""
    shapes = [jax.eval_shape(branch, operand) for branch in branches]
    axes = jax.tree.map(lambda *outs: frozenset().union(*(varying_axes(o) for o in outs)), *shapes)

    def typed(branch):
        return lambda op: jax.tree.map(cast_varying, branch(op), axes)

    return [typed(branch) for branch in branches]


def typed_cond(pred, true_fn, false_fn, operand=None):
    """``jax.lax.cond(pred, true_fn, false_fn, operand)`` whose branches may differ in varying axes.

    Both branches are traced abstractly (``jax.eval_shape``) and every output leaf is cast to
    vary over the union of the axes it varies over in either branch, so ``lax.cond`` sees one
    type. Only the taken branch runs (its collectives included) where ``pred`` is a scalar
    outside ``jax.vmap``.
    """
    true_typed, false_typed = _typed_branches([true_fn, false_fn], operand)
    return jax.lax.cond(pred, true_typed, false_typed, operand)


def typed_switch(index, branches, operand=None):
    """``jax.lax.switch(index, branches, operand)`` whose branches may differ in varying axes.

    :func:`typed_cond` for any number of branches (``index`` an int32 scalar, clamped to
    ``[0, len(branches) - 1]`` by ``lax.switch``). One branch is the call itself, without a switch.
    """
    if len(branches) == 1:
        return branches[0](operand)
    return jax.lax.switch(index, _typed_branches(list(branches), operand), operand)


def typed_platform_dependent(*, cpu, accelerator, like=()):
    """``cpu()`` where the computation is lowered for CPU, ``accelerator()`` for ``cuda``, ``rocm`` and ``tpu``.

    ``jax.lax.platform_dependent`` with branches that take no operands and may differ in
    varying axes: every output leaf of either is cast to vary over every axis some leaf of
    ``like`` varies over, so both give one type (``like`` must hold every array the branches
    read, closed-over ones included; casting from it costs no second trace, unlike
    :func:`typed_cond`). The choice is made when the computation is lowered, for the platform
    it is lowered for (``jax.jit(f).trace(...).lower(lowering_platforms=("cuda",))`` on a CPU
    host lowers the accelerator branch), not by ``jax.default_backend()``: a module lowered for
    one platform holds that branch only. Both branches are traced, so both must be valid for
    the inputs; under ``jax.vmap`` the choice stays a choice (the platform index is never
    batched).
    """
    axes = frozenset().union(*(varying_axes(r) for r in jax.tree.leaves(like)))

    def typed(branch):
        return lambda: jax.tree.map(lambda out: cast_varying(out, axes), branch())

    return jax.lax.platform_dependent(cpu=typed(cpu), default=typed(accelerator))
