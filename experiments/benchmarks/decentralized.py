"""Benchmark: D-PSGD vs EventGraD over MPI, one-sided (RMA) vs two-sided (sendrecv) exchange.

Run (one process per worker, ring topology, the EventGraD MNIST CNN, 64 examples per
worker and step as in the paper)::

    OMPI_MCA_osc=^ucx mpirun -n 4 --oversubscribe python experiments/benchmarks/decentralized.py \
        [--iterations 60] [--forced 10] [--out runs/benchmarks/decentralized.json]

Variants (all from the same initialisation on the same batches):

* ``local``                 -- gradient + SGD step, no exchange (the compute floor);
* ``dpsgd/two-sided``       -- D-PSGD, mpi4jax ``sendrecv`` per neighbour inside jit (``MPIComm``);
* ``dpsgd/one-sided``       -- D-PSGD as EventGraD with horizon 0: every tensor put every step (RMA);
* ``eventgrad/two-sided``   -- EventGraD's fixed-shape gated exchange over ``sendrecv`` (every tensor and
                               its flag cross the wire every step: what a receiver-driven protocol costs);
* ``eventgrad/one-sided``   -- EventGraD with ``MPI_Put`` only on events (``OneSidedEventGrad``);
* ``eventgrad-top10/one-sided`` -- the same sending top-10 % values + indices.

Reported per variant (mean over ranks; iterations after ``--warmup`` only): wall seconds per
iteration, one-sided exchange seconds per iteration, bytes sent per worker per iteration, and
the percentage of D-PSGD's messages. Rank 0 writes the JSON and prints a markdown table.
Timings on an oversubscribed machine (more ranks than cores) measure contention as much as
the network: compare variants within one run.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import time
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
import optax
from mpi4py import MPI

from jaxcomm import topology
from jaxcomm.algorithms import OneSidedEventGrad, dpsgd, eventgrad
from jaxcomm.comm import MPIComm


def _data(rank: int, n: int, batch: int, iterations: int, seed: int):
    """This rank's batches: MNIST if fetched (rank's strided shard), else synthetic images."""
    try:
        from jaxcomm.data import load_mnist

        train = load_mnist(split="train")
        images = train.images[rank::n][: batch * iterations]
        labels = train.labels[rank::n][: batch * iterations]
        source = "mnist"
    except (FileNotFoundError, OSError):
        rng = np.random.default_rng(seed + rank)
        images = rng.random((batch * iterations, 28, 28, 1), dtype=np.float32)
        labels = rng.integers(0, 10, batch * iterations).astype(np.int32)
        source = "synthetic"
    images = (images - 0.1307) / 0.3081
    reps = -(-batch * iterations // len(labels))
    images, labels = np.concatenate([images] * reps), np.concatenate([labels] * reps)
    xs = images[: batch * iterations].reshape(iterations, batch, 28, 28, 1).astype(np.float32)
    ys = labels[: batch * iterations].reshape(iterations, batch)
    return xs, ys, source


def _model(seed: int):
    from flax import nnx

    from jaxcomm.models import EventGradCNN

    graphdef, params, rest = nnx.split(EventGradCNN(rngs=nnx.Rngs(seed)), nnx.Param, ...)

    def loss(p, x, y, key):
        logits = nnx.merge(graphdef, p, rest)(x, deterministic=False, rngs=key)
        return optax.softmax_cross_entropy_with_integer_labels(logits, y).mean()

    return loss, params


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--iterations", type=int, default=60)
    ap.add_argument("--warmup", type=int, default=3, help="first iterations excluded from timings (compile)")
    ap.add_argument("--batch", type=int, default=64, help="examples per worker and step (paper: 64)")
    ap.add_argument("--lr", type=float, default=0.05)
    ap.add_argument("--horizon", type=float, default=1.0)
    ap.add_argument("--forced", type=int, default=10, help="forced exchange iterations (reference: 30)")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--out", default="runs/benchmarks/decentralized.json")
    args = ap.parse_args()

    world = MPI.COMM_WORLD
    rank, n = world.Get_rank(), world.Get_size()
    topo = topology.ring(n)
    loss, params0 = _model(args.seed)
    xs, ys, source = _data(rank, n, args.batch, args.iterations, args.seed)
    grad = jax.jit(jax.grad(loss))
    key = jax.random.key(args.seed)
    mpicomm = MPIComm()
    leaves = jax.tree.leaves(params0)
    param_bytes = sum(int(x.size) * x.dtype.itemsize for x in leaves)
    num_tensors = len(leaves)
    deg = int(topo.degrees[rank])

    def timed(step_fn):
        """Run all iterations with ``step_fn(t, params, state) -> (params, state)``; per-iteration times."""
        params, state = jax.tree.map(jnp.asarray, params0), None
        times = []
        for t in range(args.iterations):
            world.Barrier() if t == args.warmup else None
            t0 = time.perf_counter()
            params, state = step_fn(t, params, state)
            jax.block_until_ready(params)
            times.append(time.perf_counter() - t0)
        return params, state, np.asarray(times[args.warmup :])

    def batch(t):
        return jnp.asarray(xs[t]), jnp.asarray(ys[t]), jax.random.fold_in(jax.random.fold_in(key, t), rank)

    results = {}

    # local SGD: the compute floor
    # The model's gradient is compiled once (``grad``); each variant jits only its exchange step.
    sgd = jax.jit(lambda p, g: jax.tree.map(lambda a, b: a - args.lr * b, p, g))
    _, _, times = timed(lambda t, p, s: (sgd(p, grad(p, *batch(t))), None))
    results["local"] = dict(seconds_per_iteration=times.mean(), bytes_per_iteration=0.0, percent_messages=0.0)

    # two-sided: the algorithm's own jitted step with MPIComm (mpi4jax sendrecv)
    for name, alg in (
        ("dpsgd/two-sided", dpsgd(topo, args.lr, comm=mpicomm)),
        (
            "eventgrad/two-sided",
            eventgrad(topo, args.lr, horizon=args.horizon, forced_iterations=args.forced, comm=mpicomm),
        ),
    ):
        step = jax.jit(alg.step)
        init = alg.init

        def run_step(t, p, s, step=step, init=init):
            return step(p, grad(p, *batch(t)), init(p) if s is None else s)

        _, state, times = timed(run_step)
        flags = num_tensors if name.startswith("eventgrad") else 0  # one bool per tensor rides along
        sent = topo.num_permutations * (param_bytes + flags)
        entry = dict(seconds_per_iteration=times.mean(), bytes_per_iteration=float(sent), percent_messages=100.0)
        if name.startswith("eventgrad"):
            entry["percent_messages_if_event_driven"] = alg.stats(state, worker=rank)["percent_messages"]
        results[name] = entry

    # one-sided: prepare (jit) -> MPI_Put of fired tensors -> finish (jit)
    for name, kw in (
        ("dpsgd/one-sided", dict(horizon=0.0, forced_iterations=0)),
        ("eventgrad/one-sided", dict(horizon=args.horizon, forced_iterations=args.forced)),
        ("eventgrad-top10/one-sided", dict(horizon=args.horizon, forced_iterations=args.forced, topk=0.1)),
    ):
        alg = eventgrad(topo, args.lr, **kw)
        ose = OneSidedEventGrad(alg, params0)
        marks = {}

        def run_step(t, p, s, ose=ose, marks=marks):
            if t == args.warmup:
                marks.update(puts=ose.exchange.puts, bytes=ose.exchange.bytes_put, sec=ose.exchange.exchange_seconds)
            x, y, k = batch(t)
            return ose.step(p, grad(p, x, y, k), ose.init(p) if s is None else s)

        _, state, times = timed(run_step)
        measured = args.iterations - args.warmup
        stats = ose.stats(state)
        results[name] = dict(
            seconds_per_iteration=times.mean(),
            exchange_seconds_per_iteration=(ose.exchange.exchange_seconds - marks["sec"]) / measured,
            bytes_per_iteration=(ose.exchange.bytes_put - marks["bytes"]) / measured,
            puts_per_iteration=(ose.exchange.puts - marks["puts"]) / measured,
            percent_messages=100.0 * (ose.exchange.puts - marks["puts"]) / (measured * num_tensors * deg),
            percent_messages_whole_run=stats["percent_messages"],
        )
        ose.free()

    gathered = world.gather(results, root=0)
    if rank == 0:
        summary = {}
        for name in results:
            rows = [g[name] for g in gathered]
            summary[name] = {k: float(np.mean([r[k] for r in rows])) for k in rows[0]}
            summary[name]["seconds_per_iteration_max_rank"] = float(max(r["seconds_per_iteration"] for r in rows))
        out = {
            "benchmark": "decentralized",
            "command": f"mpirun -n {n} python experiments/benchmarks/decentralized.py "
            f"--iterations {args.iterations} --warmup {args.warmup} --batch {args.batch} "
            f"--forced {args.forced} --horizon {args.horizon}",
            "workers": n,
            "topology": topo.name,
            "model": "EventGradCNN",
            "data": source,
            "parameters": sum(int(x.size) for x in leaves),
            "tensors": num_tensors,
            "param_bytes": param_bytes,
            "iterations": args.iterations,
            "warmup": args.warmup,
            "batch_per_worker": args.batch,
            "forced_iterations": args.forced,
            "horizon": args.horizon,
            "host": platform.node(),
            "cpus": os.cpu_count(),
            "load_average": list(os.getloadavg()),
            "mpi": MPI.Get_library_version().splitlines()[0],
            "results": summary,
            "per_rank": gathered,
        }
        path = Path(args.out)
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(json.dumps(out, indent=2, default=float))
        print(
            "| variant | s / iteration | exchange s / iter (one-sided) | bytes sent / worker / iter "
            "| % of D-PSGD messages |"
        )
        print("|---|---|---|---|---|")
        for name, r in summary.items():
            ex = r.get("exchange_seconds_per_iteration")
            print(
                f"| {name} | {r['seconds_per_iteration']:.4f} | {'' if ex is None else f'{ex:.4f}'} "
                f"| {r['bytes_per_iteration']:.0f} | {r['percent_messages']:.1f} |"
            )
        print(f"wrote {path}")


if __name__ == "__main__":
    main()
