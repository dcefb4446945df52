"""Every compressor on a real model's gradients: relative error and wire bits.

``jaxcomm demo`` takes one MNIST batch (sklearn's digits if MNIST has not been
fetched), computes the EventGraD CNN's gradient (8 tensors, 27,480 entries)
and compresses it with every registered compressor, printing per method:

* ``rel_error`` = ``sum_t ||Q(g_t) - g_t||^2 / sum_t ||g_t||^2`` (one draw),
* ``wire_bits`` = exact bits on the wire (:func:`jaxcomm.wire_bits`),
* ``ratio`` = 32-bit dense bits / wire bits.
"""

from __future__ import annotations

from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
import optax
from flax import nnx

from . import compressors as C
from ._table import format_table

__all__ = [
    "run_demo",
]

DEMO_KWARGS: dict[str, dict[str, Any]] = {
    "qsgd": dict(levels=16),
    "randomk": dict(ratio=0.01),
    "topk": dict(ratio=0.01),
    "threshold": dict(v=1e-3),
    "dgc": dict(ratio=0.01),
    "adaptive": dict(ratio=0.01),
    "powersgd": dict(matrix_approximation_rank=2),
    "qsparse": dict(ratio=0.01, levels=16),
    "random_sparsification": dict(p=0.1),
    "clipping": dict(bits=8),
    "stochastic_rounding": dict(bits=4),
    "sketchml": dict(buckets=64),
    "inceptionn": dict(error_bound=1e-4),
}
"""Hyper-parameters used per compressor in the demo (others use their defaults)."""


def _real_gradient():
    from . import data, models

    try:
        ds = data.load_mnist(split="train")
        model: nnx.Module = models.EventGradCNN(rngs=nnx.Rngs(0))
        source = "MNIST (64 images), EventGraD CNN"
    except FileNotFoundError:
        ds = data.load_digits()
        model = models.MLP(in_features=64, hidden=(64,), num_classes=10, rngs=nnx.Rngs(0))
        source = "sklearn digits (64 images), MLP (MNIST not fetched)"
    x, y = jnp.asarray(ds.images[:64]), jnp.asarray(ds.labels[:64])
    graphdef, params, *rest = nnx.split(model, nnx.Param, ...)

    def loss(p):
        m = nnx.merge(graphdef, p, *rest)
        logits = m(x, deterministic=True)
        return optax.softmax_cross_entropy_with_integer_labels(logits, y).mean()

    return jax.grad(loss)(params), source


def gradient_table(grads, kwargs: dict | None = None, seed: int = 0) -> list[dict]:
    """One row per registered compressor: relative error, wire bits, compression ratio."""
    kwargs = DEMO_KWARGS if kwargs is None else kwargs
    leaves = [jnp.asarray(g, jnp.float32) for g in jax.tree.leaves(grads)]
    dense_bits = 32 * sum(g.size for g in leaves)
    norm2 = float(sum(jnp.sum(g * g) for g in leaves))
    rows = []
    for name in C.names():
        c = C.make(name, **kwargs.get(name, {}))
        keys = jax.random.split(jax.random.PRNGKey(seed), len(leaves))

        @jax.jit
        def roundtrip(g, k, c=c):  # one compiled program per compressor and shape, not one per op
            payload, _ = c.compress(g, k)
            return jnp.sum((c.decompress(payload) - g) ** 2), C.wire_bits(payload)

        err, bits = 0.0, 0
        for g, k in zip(leaves, keys):
            e, b = roundtrip(g, k)
            err += float(e)
            bits += int(b)
        rows.append(
            {
                "compressor": name,
                "rel_error": err / norm2,
                "wire_bits": bits,
                "ratio": dense_bits / bits,
                "unbiased": c.unbiased,
                "strategy": c.strategy,
            }
        )
    return rows


def run_demo() -> list[dict]:
    """Print and return the table for a real model's gradient."""
    grads, source = _real_gradient()
    n = sum(np.size(g) for g in jax.tree.leaves(grads))
    print(f"Gradient of {source}: {n} entries in {len(jax.tree.leaves(grads))} tensors ({32 * n} bits dense)\n")
    rows = gradient_table(grads)
    print(format_table(rows))
    return rows
