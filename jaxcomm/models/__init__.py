"""Flax (``flax.nnx``) models of the project's experiments.

Every model is called as ``model(x, *, deterministic=None, rngs=None)``: ``deterministic=True``
is evaluation (no dropout; running statistics for ``ResNet20(norm="batch")``), and ``rngs``
(a ``jax.Array`` key or ``nnx.Rngs``) supplies dropout randomness at call time, so a jitted
step built on ``nnx.split``/``nnx.merge`` stays a pure function of arrays.

>>> import jax.numpy as jnp
>>> from flax import nnx
>>> import jaxcomm.models as jm
>>> model = jm.LinearRegression(3, rngs=nnx.Rngs(0))
>>> model(jnp.ones((2, 3)), deterministic=True).shape
(2,)
>>> cnn = nnx.eval_shape(lambda: jm.EventGradCNN(rngs=nnx.Rngs(0)))  # abstract: counted, not initialised
>>> jm.count_params(cnn)
ParamCount(params=27480, tensors=8)
"""

from __future__ import annotations

from typing import Any

from flax import nnx

from .._validate import lookup
from ._cnn import EventGradCNN
from ._common import count_params
from ._lstm import CharLSTM
from ._mlp import MLP, LinearRegression
from ._resnet import ResNet20

__all__ = [
    "MLP",
    "LinearRegression",
    "EventGradCNN",
    "ResNet20",
    "CharLSTM",
    "count_params",
    "make",
    "names",
]

_REGISTRY = {
    "mlp": MLP,
    "eventgrad_cnn": EventGradCNN,
    "resnet20": ResNet20,
    "char_lstm": CharLSTM,
    "linear_regression": LinearRegression,
}


def names() -> list[str]:
    """Registered model names, for configuration files."""
    return sorted(_REGISTRY)


def make(name: str, *, rngs: nnx.Rngs, **kwargs: Any) -> nnx.Module:
    """Build a model by name, e.g. ``make("resnet20", in_channels=1, rngs=nnx.Rngs(0))``."""
    return lookup(_REGISTRY, name, "model")(rngs=rngs, **kwargs)
