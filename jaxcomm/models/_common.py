"""Helpers shared by the models: parameter counting and dropout keys."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any, NamedTuple

import jax
from flax import nnx

from .._validate import check_finite_scalar

__all__ = ["ParamCount", "count_params"]


class ParamCount(NamedTuple):
    """Size of a model's trainable parameters.

    Attributes:
      params: total number of scalars in ``nnx.Param`` variables.
      tensors: number of ``nnx.Param`` arrays (GRACE Table II's "gradient vectors": one
        collective per tensor when layers are communicated separately).
    """

    params: int
    tensors: int


def count_params(model: nnx.Module) -> ParamCount:
    """Count the trainable parameters (``nnx.Param``) of ``model``; batch statistics are excluded."""
    leaves = jax.tree.leaves(nnx.state(model, nnx.Param))
    return ParamCount(int(sum(x.size for x in leaves)), len(leaves))


def dropout_keys(rngs: Any, n: int) -> Sequence[Any]:
    """``n`` dropout key sources from a call-time ``rngs``.

    A ``jax.Array`` key is split into ``n`` independent keys (each dropout layer gets its own
    mask); ``nnx.Rngs``/``RngStream`` (which hand out a fresh key per draw) and ``None`` (use
    the streams forked at construction) are passed through.
    """
    if isinstance(rngs, jax.Array):
        return list(jax.random.split(rngs, n))
    return [rngs] * n


def check_rate(rate, name: str) -> float:
    """``rate`` as a ``float`` in ``[0, 1)``: a dropout rate (1 would drop every unit)."""
    rate = check_finite_scalar(rate, name, nonnegative=True)
    if rate >= 1.0:
        raise ValueError(f"{name} must be in [0, 1); got {rate}")
    return rate


def make_dropout(rate: float, rngs: nnx.Rngs | None) -> nnx.Dropout:
    """A dropout layer with its own forked ``dropout`` stream (falls back to ``default``)."""
    return nnx.Dropout(rate, rngs=rngs)
