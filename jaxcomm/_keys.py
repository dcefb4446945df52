"""The key schedule every jaxcomm transformation follows.

A transformation's state holds one PRNG key. Each step splits it once,
``key, step_key = split(key)``, and leaf ``i`` of the gradient tree
(``jax.tree.leaves`` order) draws from ``split(step_key, num_leaves)[i]``. Where
workers must draw independently the pipeline folds the worker index into that
leaf key; where they must agree (summable payloads with shared fields, PowerSGD's
initial ``Q``) it uses the leaf key as it is.
"""

from __future__ import annotations

import jax

__all__ = ["step_keys"]


def step_keys(key, num_leaves: int):
    """``(next_key, leaf_keys)``: ``key, step_key = split(key)``; ``leaf_keys = split(step_key, max(L, 1))``."""
    key, step_key = jax.random.split(key)
    return key, jax.random.split(step_key, max(num_leaves, 1))
