"""A character-level LSTM language model."""

from __future__ import annotations

from typing import Any

import jax
import jax.numpy as jnp
from flax import nnx

from .._validate import check_int
from ._common import check_rate, dropout_keys, make_dropout

__all__ = ["CharLSTM", "LSTMLayer"]


class LSTMLayer(nnx.Module):
    """One LSTM layer run over a whole sequence with ``jax.lax.scan`` (Hochreiter & Schmidhuber 1997).

    With gates stacked as ``[i, f, g, o]`` (each ``H`` wide)::

        z_t = x_t W_x + h_{t-1} W_h + b
        i, f, o = sigmoid(z_i), sigmoid(z_f), sigmoid(z_o);   g = tanh(z_g)
        c_t = f * c_{t-1} + i * g;   h_t = o * tanh(c_t)

    The input projection ``x W_x`` of all steps is one matmul before the scan. Parameters:
    ``W_x [d_in, 4H]``, ``W_h [H, 4H]``, one bias ``b [4H]`` (PyTorch keeps two biases,
    ``4H`` more): ``4H (d_in + H + 1)`` in three tensors. The forget-gate bias starts at 1
    (Jozefowicz et al. 2015), ``W_h`` is orthogonal, ``W_x`` LeCun-normal.

    Args:
      in_features: ``d_in``; hidden: ``H``; rngs: ``nnx.Rngs``.
    """

    def __init__(self, in_features: int, hidden: int, *, rngs: nnx.Rngs):
        self.hidden = hidden
        kx, kh = rngs.params(), rngs.params()
        self.w_x = nnx.Param(nnx.initializers.lecun_normal()(kx, (in_features, 4 * hidden)))
        orth = nnx.initializers.orthogonal()
        self.w_h = nnx.Param(jnp.concatenate([orth(k, (hidden, hidden)) for k in jax.random.split(kh, 4)], axis=1))
        self.b = nnx.Param(jnp.zeros((4 * hidden,)).at[hidden : 2 * hidden].set(1.0))

    def __call__(self, x: jax.Array) -> jax.Array:
        """``x [B, T, d_in]`` -> hidden states ``[B, T, H]`` (zero initial state)."""
        w_h = self.w_h[...]
        zx = x @ self.w_x[...] + self.b[...]  # [B, T, 4H]
        # zeros_like of a slice of zx: inside shard_map the carry then has the same
        # (device-varying) type as the step's output, which lax.scan requires.
        h0 = jnp.zeros_like(zx[:, 0, : self.hidden])

        def step(carry, z_t):
            h, c = carry
            z = z_t + h @ w_h
            i, f, g, o = jnp.split(z, 4, axis=-1)
            c = jax.nn.sigmoid(f) * c + jax.nn.sigmoid(i) * jnp.tanh(g)
            h = jax.nn.sigmoid(o) * jnp.tanh(c)
            return (h, c), h

        _, hs = jax.lax.scan(step, (h0, h0), jnp.swapaxes(zx, 0, 1))
        return jnp.swapaxes(hs, 0, 1)


class CharLSTM(nnx.Module):
    """Character-level language model: embedding -> ``layers`` stacked LSTMs -> linear to the vocabulary.

    Dropout (Zaremba et al. 2014: non-recurrent connections only) is applied to the embedding
    output and to every LSTM layer's output when ``dropout > 0``.

    Parameters: ``V E + sum_l 4H (d_l + H + 1) + H V + V`` with ``d_0 = E`` and ``d_l = H``
    for ``l >= 1``, in ``1 + 3 * layers + 2`` tensors.

    Args:
      vocab_size: ``V``; embed: ``E``; hidden: ``H``; layers: number of stacked LSTM layers.
      dropout: rate in ``[0, 1)``.
      rngs: ``nnx.Rngs``.
    """

    def __init__(self, vocab_size: int, embed: int, hidden: int, layers: int, rngs: nnx.Rngs, *, dropout: float = 0.0):
        for v, n in ((vocab_size, "vocab_size"), (embed, "embed"), (hidden, "hidden"), (layers, "layers")):
            check_int(v, n)
        self.vocab_size = vocab_size
        self.embed = nnx.Embed(vocab_size, embed, rngs=rngs)
        self.lstms = nnx.List([LSTMLayer(embed if l == 0 else hidden, hidden, rngs=rngs) for l in range(layers)])
        self.head = nnx.Linear(hidden, vocab_size, rngs=rngs)
        rate = check_rate(dropout, "dropout")
        self.dropouts = nnx.List([make_dropout(rate, rngs) for _ in range(layers + 1)] if rate > 0 else [])

    def __call__(self, tokens: jax.Array, *, deterministic: bool | None = None, rngs: Any = None) -> jax.Array:
        """``tokens int [B, T]`` -> next-character logits ``[B, T, vocab_size]``.

        Args:
          deterministic: ``True`` disables dropout; ``None`` uses the layers' setting.
          rngs: dropout key (``jax.Array``, split per layer) or ``nnx.Rngs``.
        """
        if not jnp.issubdtype(tokens.dtype, jnp.integer):
            raise TypeError(f"tokens must be integer ids; got dtype {tokens.dtype}")
        keys = dropout_keys(rngs, len(self.lstms) + 1)
        x = self.embed(tokens)
        if self.dropouts:
            x = self.dropouts[0](x, deterministic=deterministic, rngs=keys[0])
        for l, lstm in enumerate(self.lstms):
            x = lstm(x)
            if self.dropouts:
                x = self.dropouts[l + 1](x, deterministic=deterministic, rngs=keys[l + 1])
        return self.head(x)
