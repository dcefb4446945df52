"""Trainer step vs a hand-written jitted data-parallel step (same model, optimizer, data).

Both steps run on 8 simulated CPU devices under ``jax.shard_map``: the hand-written
one is the textbook version (params made device-varying, ``jax.grad``, ``lax.pmean``,
SGD with momentum); the trainer's is ``jaxcomm.train.Trainer`` with
``optax.chain(jaxcomm.compressed_mean(none()), optax.sgd(...))``. They are timed
interleaved (A, B, A, B, ...) in one process, median of ``--repeats`` steps after
warm-up, so machine noise hits both alike. Target: trainer / hand-written <= 1.05.

usage: python experiments/benchmarks/trainer_overhead.py [--repeats 50] [--out PATH]
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import time
from pathlib import Path

os.environ.setdefault("XLA_FLAGS", "--xla_force_host_platform_device_count=8")
os.environ.setdefault("JAX_PLATFORMS", "cpu")

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402
import optax  # noqa: E402
from flax import nnx  # noqa: E402
from jax.sharding import PartitionSpec as P  # noqa: E402

import jaxcomm as jc  # noqa: E402
from jaxcomm.train import Trainer, to_workers  # noqa: E402


def hand_written_step(model, tx, mesh):
    graphdef, params, rest = nnx.split(model, nnx.Param, ...)

    def loss(p, x, y):
        m = nnx.merge(graphdef, p, rest)
        logits = m(x, deterministic=True)
        return optax.softmax_cross_entropy_with_integer_labels(logits, y).mean()

    def step(p, opt, x, y):
        p, opt, x, y = jax.tree.map(lambda a: a[0], (p, opt, x, y))
        l, g = jax.value_and_grad(loss)(p, x, y)
        g = jax.lax.pmean(g, "data")
        u, opt = tx.update(g, opt, p)
        return jax.tree.map(lambda a: a[None], (optax.apply_updates(p, u), opt, l))

    f = jax.shard_map(step, mesh=mesh, in_specs=P("data"), out_specs=P("data"))
    return params, jax.jit(f, donate_argnums=(0, 1))


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--repeats", type=int, default=50)
    ap.add_argument("--batch", type=int, default=256)
    ap.add_argument("--out", default="experiments/benchmarks/results/trainer_overhead.json")
    args = ap.parse_args()
    n = 8
    rng = np.random.default_rng(0)
    x = rng.standard_normal((n, args.batch // n, 28, 28, 1)).astype(np.float32)
    y = rng.integers(0, 10, (n, args.batch // n)).astype(np.int32)

    # Trainer (dropout off so both compute the same function).
    model = jc.models.EventGradCNN(rngs=nnx.Rngs(0), conv_dropout=0.0, fc_dropout=0.0)
    tx = optax.chain(jc.compressed_mean(jc.compressors.none()), optax.sgd(0.05, momentum=0.9))
    trainer = Trainer(model, tx, num_workers=n)
    t_state = trainer.init_state()
    batch = trainer.worker_batch({"x": x, "y": y})

    hw_tx = optax.sgd(0.05, momentum=0.9)
    params, hw_step = hand_written_step(jc.models.EventGradCNN(rngs=nnx.Rngs(0), conv_dropout=0.0, fc_dropout=0.0),
                                        hw_tx, trainer.mesh)
    stacked = jax.tree.map(lambda a: np.broadcast_to(np.asarray(a), (n, *np.shape(a))).copy(), params)
    hw_p = to_workers(stacked, trainer.mesh)
    hw_opt = to_workers(jax.tree.map(lambda a: np.broadcast_to(np.asarray(a), (n, *np.shape(a))).copy(),
                                     hw_tx.init(params)), trainer.mesh)
    hx, hy = to_workers(x, trainer.mesh), to_workers(y, trainer.mesh)

    times = {"trainer": [], "hand_written": []}
    for i in range(args.repeats + 5):
        t0 = time.perf_counter()
        t_state, m = trainer.step_fn(t_state, batch)
        jax.block_until_ready((t_state, m))
        t1 = time.perf_counter()
        hw_p, hw_opt, loss = hw_step(hw_p, hw_opt, hx, hy)
        jax.block_until_ready((hw_p, hw_opt, loss))
        t2 = time.perf_counter()
        if i >= 5:
            times["trainer"].append(t1 - t0)
            times["hand_written"].append(t2 - t1)
    med = {k: float(np.median(v)) for k, v in times.items()}
    result = {
        "median_s": med,
        "ratio_trainer_over_hand_written": med["trainer"] / med["hand_written"],
        "repeats": args.repeats,
        "batch": args.batch,
        "devices": n,
        "model": "EventGradCNN",
        "jax": jax.__version__,
        "cpu_count": os.cpu_count(),
        "machine": platform.machine(),
    }
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(result, indent=2))
    print(json.dumps(result, indent=2))


if __name__ == "__main__":
    main()
