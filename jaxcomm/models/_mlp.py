"""Fully connected models: a multi-layer perceptron and linear regression."""

from __future__ import annotations

import itertools
from collections.abc import Sequence
from typing import Any

import jax
from flax import nnx

from .._validate import check_int
from ._common import check_rate, dropout_keys, make_dropout

__all__ = ["MLP", "LinearRegression"]


class MLP(nnx.Module):
    """Multi-layer perceptron ``in -> hidden[0] -> ... -> hidden[-1] -> num_classes`` with ReLU.

    Inputs of any trailing shape are flattened (``[B, 28, 28, 1] -> [B, 784]``). Optional
    dropout after every hidden activation.

    Parameters: ``sum_l (d_l * d_{l+1} + d_{l+1})`` with ``d = (in_features, *hidden, num_classes)``,
    in ``2 * (len(hidden) + 1)`` tensors.

    Args:
      in_features: flattened input size.
      hidden: width of each hidden layer (an int for one layer; ``()`` gives logistic regression).
      num_classes: number of logits.
      dropout: dropout rate after each hidden layer, in ``[0, 1)``.
      rngs: ``nnx.Rngs`` for initialisation (and the dropout stream).
    """

    def __init__(
        self,
        in_features: int,
        hidden: int | Sequence[int],
        num_classes: int,
        rngs: nnx.Rngs,
        *,
        dropout: float = 0.0,
    ):
        hidden = (hidden,) if isinstance(hidden, int) else tuple(hidden)
        sizes = [check_int(in_features, "in_features")]
        sizes += [check_int(h, "hidden") for h in hidden]
        sizes.append(check_int(num_classes, "num_classes"))
        self.in_features = sizes[0]
        self.layers = nnx.List([nnx.Linear(a, b, rngs=rngs) for a, b in itertools.pairwise(sizes)])
        rate = check_rate(dropout, "dropout")
        self.dropouts = nnx.List([make_dropout(rate, rngs) for _ in hidden] if rate > 0 else [])

    def __call__(self, x: jax.Array, *, deterministic: bool | None = None, rngs: Any = None) -> jax.Array:
        """``x [B, ...]`` with ``prod(...) == in_features`` -> logits ``[B, num_classes]``.

        Args:
          deterministic: ``True`` disables dropout; ``None`` uses each layer's own setting.
          rngs: dropout key (``jax.Array``, split per layer) or ``nnx.Rngs``; overrides the
            stream forked at construction, which keeps a jitted step a pure function of its inputs.
        """
        x = x.reshape(x.shape[0], -1)
        if x.shape[1] != self.in_features:
            raise ValueError(f"x has {x.shape[1]} features per example; MLP expects in_features={self.in_features}")
        keys = dropout_keys(rngs, max(len(self.dropouts), 1))
        for i, layer in enumerate(self.layers[:-1]):
            x = jax.nn.relu(layer(x))
            if self.dropouts:
                x = self.dropouts[i](x, deterministic=deterministic, rngs=keys[i])
        return self.layers[-1](x)


class LinearRegression(nnx.Module):
    """``y = w . x + b``, a one-layer network with a scalar output (eager-SGD's hyperplane task).

    Parameters: ``features + 1`` in two tensors (8,193 for the paper's 8,192-dimensional
    hyperplane, matching eager-SGD Table 1).

    Args:
      features: input dimension.
      rngs: ``nnx.Rngs`` for initialisation.
      zero_init: start from ``w = 0`` (the convex problem needs no symmetry breaking).
    """

    def __init__(self, features: int, rngs: nnx.Rngs, *, zero_init: bool = False):
        self.features = check_int(features, "features")
        init = nnx.initializers.zeros_init() if zero_init else nnx.initializers.lecun_normal()
        self.linear = nnx.Linear(self.features, 1, kernel_init=init, rngs=rngs)

    def __call__(self, x: jax.Array, *, deterministic: bool | None = None, rngs: Any = None) -> jax.Array:
        """``x [B, features]`` -> predictions ``[B]``. ``deterministic``/``rngs`` are accepted for a
        uniform model interface and unused (no dropout)."""
        del deterministic, rngs
        if x.shape[-1] != self.features:
            raise ValueError(f"x has {x.shape[-1]} features; LinearRegression expects features={self.features}")
        return self.linear(x)[..., 0]
