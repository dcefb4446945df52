"""The problem and the NumPy reference shared by tests/test_diloco.py and diloco_mpi.py.

``N`` workers, quadratic losses ``f_i(θ) = ½ Σ (a_i ⊙ θ − b_i)²`` over a tree of four leaves;
:func:`_reference` is DiLoCo / Streaming DiLoCo in float64 NumPy.
"""

from __future__ import annotations

import numpy as np

from jaxcomm.transforms import fragment_leaves

N = 3
SHAPES = {"a": (4, 3), "b": (5,), "c": (2, 2), "d": (6,)}  # leaves in this (sorted-key) order
KEYS = sorted(SHAPES)


def _problem(seed: int = 0):
    rng = np.random.default_rng(seed)
    scale = {k: rng.uniform(0.5, 1.5, (N, *s)).astype(np.float32) for k, s in SHAPES.items()}
    target = {k: rng.normal(size=(N, *s)).astype(np.float32) for k, s in SHAPES.items()}
    theta0 = {k: rng.normal(size=s).astype(np.float32) for k, s in SHAPES.items()}
    return scale, target, theta0


def _grad(a, b, theta):
    return a * (a * theta - b)


def _reference(
    steps, *, every, fragments=1, delay=0, blend=0.0, carry=False, lr=0.05, mom=0.0, outer_lr=0.7, outer_mom=0.9
):
    """DiLoCo / Streaming DiLoCo in NumPy (float64): inner SGD with momentum, outer Nesterov SGD; with
    ``carry`` a worker's fragment becomes the new global one plus its own progress since the sync."""
    scale, target, theta0 = _problem()
    groups = fragment_leaves([int(np.prod(SHAPES[k])) for k in KEYS], fragments)
    period = every // fragments
    anchor = {k: theta0[k].astype(np.float64) for k in KEYS}
    local = [{k: anchor[k].copy() for k in KEYS} for _ in range(N)]
    trace_in = [{k: np.zeros(SHAPES[k]) for k in KEYS} for _ in range(N)]
    trace_out = {k: np.zeros(SHAPES[k]) for k in KEYS}
    pending = {k: np.zeros(SHAPES[k]) for k in KEYS}
    synced = [{k: anchor[k].copy() for k in KEYS} for _ in range(N)]
    for t in range(1, steps + 1):
        for i in range(N):
            for k in KEYS:
                g = _grad(scale[k][i].astype(np.float64), target[k][i].astype(np.float64), local[i][k])
                trace_in[i][k] = g + mom * trace_in[i][k]
                local[i][k] = local[i][k] - lr * trace_in[i][k]
        for p, idx in enumerate(groups):
            if t % every == ((p + 1) * period) % every:
                for j in idx:
                    k = KEYS[j]
                    pending[k] = np.mean([anchor[k] - local[i][k] for i in range(N)], axis=0)
                    for i in range(N):
                        synced[i][k] = local[i][k].copy()
        lag = t - delay
        for q, idx in enumerate(groups):
            if lag >= (q + 1) * period and lag % every == ((q + 1) * period) % every:
                for j in idx:
                    k = KEYS[j]
                    trace_out[k] = pending[k] + outer_mom * trace_out[k]
                    new = anchor[k] - outer_lr * (pending[k] + outer_mom * trace_out[k])  # Nesterov
                    for i in range(N):
                        if carry:
                            local[i][k] = new + (local[i][k] - synced[i][k])
                        else:
                            local[i][k] = blend * local[i][k] + (1 - blend) * new
                    anchor[k] = new
    return {k: np.stack([local[i][k] for i in range(N)]) for k in KEYS}
