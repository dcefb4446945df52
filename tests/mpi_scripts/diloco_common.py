"""The problem and the NumPy reference shared by tests/test_diloco.py and diloco_mpi.py.

``N`` workers, quadratic losses ``f_i(θ) = ½ Σ (a_i ⊙ θ − b_i)²`` over a tree of four leaves;
:func:`_reference` is DiLoCo / Streaming DiLoCo in float64 NumPy.
"""

from __future__ import annotations

import numpy as np

from jaxcomm.transforms._diloco import fragment_leaves

N = 3
SHAPES = {"a": (4, 3), "b": (5,), "c": (2, 2), "d": (6,)}  # leaves in this (sorted-key) order
KEYS = sorted(SHAPES)


def _problem(seed: int = 0, n: int = N, shapes: dict = SHAPES):
    """``(scale, target, theta0)`` of ``n`` workers (leading axis) over leaves of ``shapes``."""
    rng = np.random.default_rng(seed)
    scale = {k: rng.uniform(0.5, 1.5, (n, *s)).astype(np.float32) for k, s in shapes.items()}
    target = {k: rng.normal(size=(n, *s)).astype(np.float32) for k, s in shapes.items()}
    theta0 = {k: rng.normal(size=s).astype(np.float32) for k, s in shapes.items()}
    return scale, target, theta0


def _grad(a, b, theta):
    return a * (a * theta - b)


def _reference(
    steps,
    *,
    every,
    fragments=1,
    delay=0,
    blend=0.0,
    carry=False,
    lr=0.05,
    mom=0.0,
    outer_lr=0.7,
    outer_mom=0.9,
    n=N,
    shapes=SHAPES,
):
    """DiLoCo / Streaming DiLoCo in NumPy (float64): inner SGD with momentum, outer Nesterov SGD;
    ``n`` workers over leaves of ``shapes`` (sorted keys); with ``carry`` a worker's fragment becomes
    the new global one plus its own progress since the sync."""
    keys = sorted(shapes)
    scale, target, theta0 = _problem(n=n, shapes=shapes)
    groups = fragment_leaves([int(np.prod(shapes[k])) for k in keys], fragments)
    period = every // fragments
    anchor = {k: theta0[k].astype(np.float64) for k in keys}
    local = [{k: anchor[k].copy() for k in keys} for _ in range(n)]
    trace_in = [{k: np.zeros(shapes[k]) for k in keys} for _ in range(n)]
    trace_out = {k: np.zeros(shapes[k]) for k in keys}
    pending = {k: np.zeros(shapes[k]) for k in keys}
    synced = [{k: anchor[k].copy() for k in keys} for _ in range(n)]
    for t in range(1, steps + 1):
        for i in range(n):
            for k in keys:
                g = _grad(scale[k][i].astype(np.float64), target[k][i].astype(np.float64), local[i][k])
                trace_in[i][k] = g + mom * trace_in[i][k]
                local[i][k] = local[i][k] - lr * trace_in[i][k]
        for p, idx in enumerate(groups):
            if t % every == ((p + 1) * period) % every:
                for j in idx:
                    k = keys[j]
                    pending[k] = np.mean([anchor[k] - local[i][k] for i in range(n)], axis=0)
                    for i in range(n):
                        synced[i][k] = local[i][k].copy()
        lag = t - delay
        for q, idx in enumerate(groups):
            if lag >= (q + 1) * period and lag % every == ((q + 1) * period) % every:
                for j in idx:
                    k = keys[j]
                    trace_out[k] = pending[k] + outer_mom * trace_out[k]
                    new = anchor[k] - outer_lr * (pending[k] + outer_mom * trace_out[k])  # Nesterov
                    for i in range(n):
                        if carry:
                            local[i][k] = new + (local[i][k] - synced[i][k])
                        else:
                            local[i][k] = blend * local[i][k] + (1 - blend) * new
                    anchor[k] = new
    return {k: np.stack([local[i][k] for i in range(n)]) for k in keys}
