"""Helpers shared by the models: parameter counting and dropout keys."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any, NamedTuple

import jax
from flax import nnx

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


def check_features(value, name: str) -> int:
    """Validate a positive layer width."""
    if isinstance(value, bool) or not isinstance(value, int):
        raise TypeError(f"{name} must be a positive int; got {value!r}")
    if value < 1:
        raise ValueError(f"{name} must be >= 1; got {value}")
    return value


def check_rate(rate, name: str) -> float:
    """Validate a dropout rate in [0, 1)."""
    rate = float(rate)
    if not 0.0 <= rate < 1.0:
        raise ValueError(f"{name} must be in [0, 1); got {rate}")
    return rate


def make_dropout(rate: float, rngs: nnx.Rngs | None) -> nnx.Dropout:
    """A dropout layer with its own forked ``dropout`` stream (falls back to ``default``)."""
    return nnx.Dropout(rate, rngs=rngs)
