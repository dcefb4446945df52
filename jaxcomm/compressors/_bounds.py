"""The kinds of error bound a compressor declares, and two helpers for data-dependent ones.

For a compressor ``Q`` acting on ``x`` of ``d`` entries (``E`` over its randomness):

* unbiased, variance factor ω:   ``E‖Q(x) − x‖² ≤ ω ‖x‖²`` (``Compressor.variance_factor``);
* biased, contraction δ ∈ [0, 1]: ``E‖Q(x) − x‖² ≤ (1 − δ) ‖x‖²`` (``.contraction``; ``δ = 0``:
  non-expansive, no uniform contraction);
* data-dependent, ``δ(x)``:       ``E‖Q(x) − x‖² ≤ (1 − δ(x)) ‖x‖²`` for that ``x``
  (``.local_contraction``; ``δ(x) < 0`` where ``Q`` may expand ``x``);
* no contraction: no bound ``c ‖x‖²`` holds (sign without a scale), with the reason
  (``.no_contraction``).

Each built-in factory declares its compressor's bound where it builds it, with its source
(``.bound``: paper, lemma, derivation). ``jaxcomm.testing`` checks every declared bound by
Monte Carlo; error feedback refuses an unbiased compressor whose ω ≥ 1 and one that declares
no contraction, under a memory that needs a contraction.
"""

from __future__ import annotations

import jax.numpy as jnp

__all__ = ["absolute", "ratio_of"]


def ratio_of(x, kept2):
    """``kept2 / ‖x‖²`` in float32 (1 for ``x = 0``, where every bound holds)."""
    norm2 = jnp.sum(jnp.square(jnp.ravel(x).astype(jnp.float32)))
    return jnp.where(norm2 > 0, kept2 / jnp.where(norm2 > 0, norm2, 1.0), 1.0)


def absolute(b: float):
    """``x -> δ(x) = 1 − Σ_i min(x_i², b²) / ‖x‖²``: the bound of an operator that changes every entry
    by at most ``min(|x_i|, b)``."""

    def delta(x):
        xf = jnp.ravel(x).astype(jnp.float32)
        return 1.0 - ratio_of(x, jnp.sum(jnp.minimum(jnp.square(xf), b * b)))

    return delta
