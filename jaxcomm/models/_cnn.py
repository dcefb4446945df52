"""The EventGraD MNIST convolutional network."""

from __future__ import annotations

from typing import Any

import jax
from flax import nnx

from ._common import check_rate, dropout_keys, make_dropout

__all__ = ["EventGradCNN"]


def _pool(x: jax.Array) -> jax.Array:
    return nnx.max_pool(x, window_shape=(2, 2), strides=(2, 2), padding="VALID")


class EventGradCNN(nnx.Module):
    """The small CNN of EventGraD's MNIST experiments (Ghosh et al.; PyTorch's MNIST example, 3x3 kernels).

    For a ``[B, 28, 28, 1]`` input (NHWC, no padding)::

        conv 1->10 k3   [B, 26, 26, 10] -> max-pool 2 [B, 13, 13, 10] -> relu
        conv 10->20 k3  [B, 11, 11, 20] -> channel dropout -> max-pool 2 [B, 5, 5, 20] -> relu
        flatten [B, 500] -> fc 500->50 -> relu -> dropout 0.5 -> fc 50->10  (logits)

    The convolutional dropout drops whole feature maps (PyTorch's ``Dropout2d``: the mask is
    shared over height and width). The network returns logits; the PyTorch original applies
    ``log_softmax`` inside the model, which ``optax.softmax_cross_entropy_with_integer_labels``
    does for us.

    Parameters: conv1 90 + 10, conv2 1,800 + 20, fc1 25,000 + 50, fc2 500 + 10 = 27,480 in
    8 tensors.

    Args:
      rngs: ``nnx.Rngs`` for initialisation (and the dropout streams).
      conv_dropout: rate of the channel dropout after conv2 (PyTorch default 0.5).
      fc_dropout: rate of the dropout after fc1 (0.5 as in the paper's network).
    """

    in_shape = (28, 28, 1)

    def __init__(self, rngs: nnx.Rngs, *, conv_dropout: float = 0.5, fc_dropout: float = 0.5):
        self.conv1 = nnx.Conv(1, 10, (3, 3), padding="VALID", rngs=rngs)
        self.conv2 = nnx.Conv(10, 20, (3, 3), padding="VALID", rngs=rngs)
        self.conv_dropout = nnx.Dropout(check_rate(conv_dropout, "conv_dropout"), broadcast_dims=(-3, -2), rngs=rngs)
        self.fc1 = nnx.Linear(20 * 5 * 5, 50, rngs=rngs)
        self.fc_dropout = make_dropout(check_rate(fc_dropout, "fc_dropout"), rngs)
        self.fc2 = nnx.Linear(50, 10, rngs=rngs)

    def __call__(self, x: jax.Array, *, deterministic: bool | None = None, rngs: Any = None) -> jax.Array:
        """``x [B, 28, 28, 1]`` -> logits ``[B, 10]``.

        Args:
          deterministic: ``True`` disables both dropouts (evaluation); ``None`` uses the layers'
            own setting (training, as constructed).
          rngs: dropout key (``jax.Array``) or ``nnx.Rngs``; overrides the constructor streams.
        """
        if x.shape[-3:] != self.in_shape:
            raise ValueError(f"x must have shape [B, 28, 28, 1]; got {x.shape}")
        k_conv, k_fc = dropout_keys(rngs, 2)
        x = jax.nn.relu(_pool(self.conv1(x)))
        x = self.conv_dropout(self.conv2(x), deterministic=deterministic, rngs=k_conv)
        x = jax.nn.relu(_pool(x))
        x = x.reshape(x.shape[0], -1)
        x = jax.nn.relu(self.fc1(x))
        x = self.fc_dropout(x, deterministic=deterministic, rngs=k_fc)
        return self.fc2(x)
