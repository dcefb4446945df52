"""Trainer step vs a hand-written jitted data-parallel step (same model, optimizer, data).

Both steps run on 8 simulated CPU devices under ``jax.shard_map``: the hand-written
one is the textbook version (params made device-varying, ``jax.grad``, ``lax.pmean``,
SGD with momentum); the trainer's is ``jaxcomm.train.Trainer`` with
``optax.chain(jaxcomm.compressed_mean(none()), optax.sgd(...))``. They are timed
interleaved in one process, the order alternating every step (A, B, B, A, A, B, ...)
so that neither always runs right after the other, median of ``--repeats`` steps
after warm-up, so machine noise hits both alike. Target: trainer / hand-written <= 1.05.
Dropout is off in both (``--model eventgrad_cnn``); ``--model resnet20`` uses the
GroupNorm ResNet-20-style network, which has no dropout.

usage: python experiments/benchmarks/trainer_overhead.py [--repeats 50] [--model eventgrad_cnn|resnet20]
       [--batch 256] [--out PATH]
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

import jax
import numpy as np
import optax
from flax import nnx
from jax.sharding import PartitionSpec as P

import jaxcomm as jc
from jaxcomm.train import Trainer
from jaxcomm.train._trainer import to_workers


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
    ap.add_argument("--model", choices=("eventgrad_cnn", "resnet20"), default="eventgrad_cnn")
    ap.add_argument("--out", default=None, help="default: experiments/benchmarks/results/trainer_overhead[_MODEL].json")
    args = ap.parse_args()
    if args.out is None:
        suffix = "" if args.model == "eventgrad_cnn" else f"_{args.model}"
        args.out = f"experiments/benchmarks/results/trainer_overhead{suffix}.json"

    def new_model():
        if args.model == "resnet20":
            return jc.models.ResNet20(num_classes=10, in_channels=1, rngs=nnx.Rngs(0))
        return jc.models.EventGradCNN(rngs=nnx.Rngs(0), conv_dropout=0.0, fc_dropout=0.0)

    n = 8
    rng = np.random.default_rng(0)
    x = rng.standard_normal((n, args.batch // n, 28, 28, 1)).astype(np.float32)
    y = rng.integers(0, 10, (n, args.batch // n)).astype(np.int32)

    # Trainer (dropout off so both compute the same function).
    model = new_model()
    tx = optax.chain(jc.compressed_mean(jc.compressors.none()), optax.sgd(0.05, momentum=0.9))
    trainer = Trainer(model, tx, num_workers=n)
    t_state = trainer.init_state()
    batch = trainer.worker_batch({"x": x, "y": y})

    hw_tx = optax.sgd(0.05, momentum=0.9)
    params, hw_step = hand_written_step(new_model(), hw_tx, trainer.mesh)
    stacked = jax.tree.map(lambda a: np.broadcast_to(np.asarray(a), (n, *np.shape(a))).copy(), params)
    hw_p = to_workers(stacked, trainer.mesh)
    hw_opt = to_workers(
        jax.tree.map(lambda a: np.broadcast_to(np.asarray(a), (n, *np.shape(a))).copy(), hw_tx.init(params)),
        trainer.mesh,
    )
    hx, hy = to_workers(x, trainer.mesh), to_workers(y, trainer.mesh)

    def run_trainer():
        nonlocal t_state
        t0 = time.perf_counter()
        t_state, m = trainer.step_fn(t_state, batch)
        jax.block_until_ready((t_state, m))
        return time.perf_counter() - t0

    def run_hand_written():
        nonlocal hw_p, hw_opt
        t0 = time.perf_counter()
        hw_p, hw_opt, loss = hw_step(hw_p, hw_opt, hx, hy)
        jax.block_until_ready((hw_p, hw_opt, loss))
        return time.perf_counter() - t0

    times = {"trainer": [], "hand_written": []}
    for i in range(args.repeats + 5):
        order = (("trainer", run_trainer), ("hand_written", run_hand_written))
        if i % 2:
            order = order[::-1]
        for name, fn in order:
            dt = fn()
            if i >= 5:
                times[name].append(dt)
    med = {k: float(np.median(v)) for k, v in times.items()}
    result = {
        "median_s": med,
        "quartiles_s": {k: [float(np.percentile(v, 25)), float(np.percentile(v, 75))] for k, v in times.items()},
        # the ratio of each interleaved pair, so its spread shows how much load noise there was
        "pair_ratio_quartiles": [
            float(q)
            for q in np.percentile(np.asarray(times["trainer"]) / np.asarray(times["hand_written"]), [25, 50, 75])
        ],
        "ratio_trainer_over_hand_written": med["trainer"] / med["hand_written"],
        "repeats": args.repeats,
        "batch": args.batch,
        "devices": n,
        "model": args.model,
        "order": "alternating",
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
