"""Top-k selection with and without the threshold carried between steps, side by side.

For each size ``d`` (default: the VGG16-sized tree's two largest tensors, 2,359,296 and
1,179,648 entries) and ``k = round(ratio d)`` (default ratio 0.01), this runs an
error-feedback loop on one CPU device,

    φ_t = m_t + g_t,   S_t = top-k(|φ_t|),   m_{t+1} = φ_t with S_t zeroed,

with the gradients ``g_t`` drawn from one of two models (``--gradients``):

* ``fresh``: ``g_t ~ N(0, 1)`` i.i.d. per step (a stationary memory: the carried
  threshold keeps admitting about the same number of entries);
* ``fixed``: ``g_t = a ⊙ x_t`` with ``a`` fixed and ``x_t`` drifting slowly, as in
  ``step_overhead.py`` (every unsent entry grows by about the same amount each
  step, so the count above last step's threshold drifts).

At every step both selections run on the same ``φ_t``, interleaved and alternating
which goes first: ``top_indices`` (the sampled threshold, what ``topk()`` does) and
``top_indices_reusing`` (``topk(reuse_threshold=True)``), each jitted, and their
indices are checked to be identical. Reported: the median time of each over the
steps after a warm-up, their ratio, and how often the carried threshold was used
(``PATH_REUSED``) rather than the sampled fallback.

usage: python experiments/benchmarks/topk_reuse.py [--sizes 2359296,1179648] [--ratio 0.01]
       [--steps 30] [--warmup 3] [--gradients fresh,fixed] [--out experiments/benchmarks/results/topk_reuse.json]
"""

from __future__ import annotations

import argparse
import collections
import json
import os
import platform
import sys
import time
from pathlib import Path

os.environ.setdefault("JAX_PLATFORMS", "cpu")

import jax
import jax.numpy as jnp
import numpy as np

from jaxcomm.compressors._kernels import select as S
from jaxcomm.compressors._sparse import num_selected

GRADIENTS = ("fresh", "fixed")


def measure(d: int, ratio: float, steps: int, warmup: int, gradients: str, seed: int = 0) -> dict:
    """One size and gradient model: median seconds of each selection, the ratio, the paths taken."""
    if gradients not in GRADIENTS:
        raise ValueError(f"gradients must be one of {GRADIENTS}; got {gradients!r}")
    k = num_selected(ratio, d)
    plain = jax.jit(lambda v, key: S.top_indices(v, k, key, keys_of=S.magnitude_keys)[0])
    reuse = jax.jit(lambda v, key, s: S.top_indices_reusing(v, k, key, s, keys_of=S.magnitude_keys))
    update = jax.jit(lambda phi, idx: phi.at[idx].set(0.0))
    rng = np.random.default_rng(seed)
    a = jnp.asarray(rng.standard_normal(d, dtype=np.float32))
    x = jnp.asarray(rng.standard_normal(d, dtype=np.float32))
    m = jnp.zeros((d,), jnp.float32)
    state = S.reuse_state(k, d)
    t_plain, t_reuse, paths, mismatches = [], [], collections.Counter(), 0
    for step in range(warmup + steps):
        if gradients == "fresh":
            g = jnp.asarray(rng.standard_normal(d, dtype=np.float32))
        else:
            x = x - 0.001 * jnp.asarray(rng.standard_normal(d, dtype=np.float32))
            g = a * x
        phi = jax.block_until_ready(m + g)
        key = jax.random.PRNGKey(step)
        order = ("plain", "reuse") if step % 2 == 0 else ("reuse", "plain")
        times = {}
        for which in order:
            t0 = time.perf_counter()
            if which == "plain":
                idx_p = jax.block_until_ready(plain(phi, key))
            else:
                idx_r, path, state = jax.block_until_ready(reuse(phi, key, state))
            times[which] = time.perf_counter() - t0
        mismatches += int(not np.array_equal(np.asarray(idx_p), np.asarray(idx_r)))
        if step >= warmup:
            t_plain.append(times["plain"])
            t_reuse.append(times["reuse"])
            paths[{S.PATH_REUSED: "reused", S.PATH_SAMPLED: "sampled", S.PATH_TIES: "ties"}.get(int(path), "full")] += 1
        m = update(phi, idx_r)
    med_p, med_r = float(np.median(t_plain)), float(np.median(t_reuse))
    return {
        "d": d,
        "k": k,
        "reuse_capacity": S.reuse_capacity(k, d),
        "sampled_capacity": S._sample_plan(d, k, S._MARGIN)[2] if S._sample_plan(d, k, S._MARGIN) else None,
        "gradients": gradients,
        "plain_ms": 1e3 * med_p,
        "reuse_ms": 1e3 * med_r,
        "reuse_over_plain": med_r / med_p,
        "paired_ratio": float(np.median(np.asarray(t_reuse) / np.asarray(t_plain))),
        "paths": dict(paths),
        "mismatches": mismatches,
        "plain_steps_ms": [1e3 * t for t in t_plain],
        "reuse_steps_ms": [1e3 * t for t in t_reuse],
    }


def main(argv=None) -> dict:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--sizes", default="2359296,1179648")
    ap.add_argument("--ratio", type=float, default=0.01)
    ap.add_argument("--steps", type=int, default=30)
    ap.add_argument("--warmup", type=int, default=3)
    ap.add_argument("--gradients", default="fresh,fixed")
    ap.add_argument("--out", default="experiments/benchmarks/results/topk_reuse.json")
    args = ap.parse_args(argv)
    sizes = [int(s) for s in args.sizes.split(",") if s]
    models = [g for g in args.gradients.split(",") if g]
    if any(g not in GRADIENTS for g in models):
        ap.error(f"--gradients: each of {GRADIENTS}; got {args.gradients!r}")
    if args.steps < 1 or args.warmup < 1:
        ap.error("--steps and --warmup must be >= 1")
    out = {
        "meta": {
            "benchmark": "topk_reuse",
            "command": " ".join(["python", "experiments/benchmarks/topk_reuse.py", *(argv or sys.argv[1:])]),
            "platform": platform.platform(),
            "host_cpus": os.cpu_count(),
            "jax": jax.__version__,
            "load_average_at_start": list(os.getloadavg()),
            "timing": "per step, both selections on the same phi, interleaved (order alternating); medians",
            "ratio": args.ratio,
            "steps": args.steps,
            "warmup": args.warmup,
        },
        "results": [],
    }
    for g in models:
        for d in sizes:
            r = measure(d, args.ratio, args.steps, args.warmup, g)
            out["results"].append(r)
            print(
                f"{g:6s} d={d:>9,d} k={r['k']:>7,d}: plain {r['plain_ms']:7.2f} ms  reuse {r['reuse_ms']:7.2f} ms  "
                f"ratio {r['reuse_over_plain']:.2f} (paired {r['paired_ratio']:.2f})  paths {r['paths']}  "
                f"mismatches {r['mismatches']}",
                flush=True,
            )
    out["meta"]["load_average_at_end"] = list(os.getloadavg())
    path = Path(args.out)
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(out, indent=2) + "\n")
    print(f"wrote {path}")
    return out


if __name__ == "__main__":
    main()
