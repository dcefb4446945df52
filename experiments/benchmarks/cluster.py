"""Flat against hierarchical compressed mean on an emulated cluster of nodes (``jax.distributed``).

Each job is :func:`jaxcomm.netem.launch` with ``devices_per_process``: ``N`` processes (nodes) of
``L`` CPU devices each, gloo collectives over TCP; the devices of a node talk in memory, the nodes
through their own ``--bandwidth`` link to a switch. Every worker (device) holds a synthetic
float32 gradient tree of two ``(rows, 1024)`` leaves (standard normal, its own seed per worker
and step). Four steps are compiled in every job and measured in turn, round after round (the
machine is shared and noisy, so the routes alternate):

* ``flat``: ``compressed_mean(c, "data")`` over a 1-D mesh of all ``N L`` devices (node-major);
* ``hierarchical``: ``compressed_mean(c, ("node", "local"))`` over the ``N x L`` mesh (a dense
  float32 reduce-scatter inside a node, ``c`` on each ``1/L`` shard between nodes, an
  all-gather inside a node);

each with ``topk`` (top-k 1 % with the residual memory), ``bf16`` (dense bfloat16) and ``none``
(dense float32); ``sign`` (scaled sign with the residual memory) is there for the suite's
smallest job. A step
is measured between barriers by :func:`jaxcomm.netem.measure` (the kernel's count of what the
nodes sent into the switch, the barriers' own bytes and time subtracted). Per configuration the
results hold the bytes a worker reports (``state.wire_bits``; the slow axis' for
``hierarchical``), the measured payload bytes of all nodes and the step's seconds, and
:func:`jaxcomm.cost_model.step_time` with ``topology=Cluster(N, L)`` (latency 0: a tbf link adds
none) against them.

usage: python experiments/benchmarks/cluster.py [--shapes 2x2,4x2] [--reps 3] [--rounds 3]
       [--rows 512] [--bandwidth 100mbit] [--out experiments/benchmarks/results/cluster.json]
       python experiments/benchmarks/cluster.py --markdown experiments/benchmarks/results/cluster.json
The job's processes run ``cluster.py --worker CONFIG`` (needs root: network namespaces).
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import sys
import time
from pathlib import Path

HERE = Path(__file__).resolve().parent
ROOT = HERE.parents[1]
ROUTES = ("flat", "hierarchical")
METHODS = ("topk", "bf16", "none", "sign")
"""Every method :func:`transform` knows; the study runs the first three (``--methods``)."""
COLS = 1024
LEAVES = ("w0", "w1")


def gradients(worker: int, step: int, rows: int) -> dict:
    """Worker ``worker``'s float32 gradient tree at ``step``: two ``(rows, 1024)`` standard normal leaves."""
    import numpy as np

    rng = np.random.default_rng(1_000_003 * step + worker)
    return {name: rng.standard_normal((rows, COLS)).astype(np.float32) for name in LEAVES}


def transform(route: str, method: str):
    """The compressed mean of ``route`` with ``method``'s compressor and memory."""
    import jaxcomm as jc

    if method == "topk":
        compressor, memory = jc.compressors.topk(ratio=0.01), jc.memory.residual()
    elif method in ("bf16", "none"):
        compressor, memory = jc.compressors.make(method), None
    elif method == "sign":  # EF-SignSGD: scaled sign with the residual memory (cheap to compile)
        compressor, memory = jc.compressors.make("scaled_sign"), jc.memory.residual()
    else:
        raise ValueError(f"method must be one of {METHODS}; got {method!r}")
    axis = "data" if route == "flat" else ("node", "local")
    return jc.compressed_mean(compressor, axis, memory=memory)


class Step:
    """One route and method on ``devices`` (node-major: ``nodes`` rows of ``local`` devices): the
    jitted per-worker step ``(grads, state) -> (updates, state)`` over a leading worker axis."""

    def __init__(self, route: str, method: str, devices, nodes: int, local: int, rows: int):
        import jax
        import numpy as np
        from jax.sharding import Mesh, NamedSharding
        from jax.sharding import PartitionSpec as P

        grid = np.array(devices, dtype=object).reshape(nodes, local)
        if route == "flat":
            mesh, spec = Mesh(grid.reshape(-1), ("data",)), P("data")
        else:
            mesh, spec = Mesh(grid, ("node", "local")), P(("node", "local"))
        self.route, self.method, self.workers, self.rows = route, method, nodes * local, rows
        self.sharding = NamedSharding(mesh, spec)
        tx = transform(route, method)

        def per_worker(fn):
            def run(*args):
                out = fn(*jax.tree.map(lambda v: v[0], args))
                return jax.tree.map(lambda v: v[None], out)

            return jax.jit(jax.shard_map(run, mesh=mesh, in_specs=spec, out_specs=spec, check_vma=True))

        self.init = per_worker(tx.init)
        self.update = per_worker(tx.update)

    def place(self, tree_of) -> dict:
        """A global tree of two ``(workers, rows, 1024)`` leaves: worker ``w``'s rows from ``tree_of(w)``
        (called for this process's workers only)."""
        import jax
        import numpy as np

        def leaf(name):
            def rows_of(index):
                return np.stack([tree_of(w)[name] for w in range(self.workers)[index[0]]])

            return jax.make_array_from_callback((self.workers, self.rows, COLS), self.sharding, rows_of)

        return {name: leaf(name) for name in LEAVES}

    def grads(self, step: int) -> dict:
        """Every worker's :func:`gradients` at ``step``, placed."""
        return self.place(lambda w: gradients(w, step, self.rows))

    def zeros(self) -> dict:
        """Zero parameters of the gradients' shapes, placed (for ``init``)."""
        import numpy as np

        return self.place(lambda w: dict.fromkeys(LEAVES, np.zeros((self.rows, COLS), np.float32)))


def reported(state) -> tuple[int, int, str]:
    """``(bytes, messages, strategy)`` one worker reports for the network between nodes: the
    state's own, or the slow axis' of a hierarchical state (worker 0's: all report alike)."""
    import jax
    import numpy as np

    slow = jax.tree.map(lambda a: a.addressable_shards[0].data, getattr(state, "slow", state))
    return int(np.asarray(slow.wire_bits, np.int64)[0].sum()) // 8, int(np.asarray(slow.messages)[0]), ""


def worker(config: dict) -> None:
    """A process of the job: every configuration's steps, measured in rounds; process 0 writes the JSON."""
    from jaxcomm import netem

    pid, nodes = netem.initialize_distributed(initialization_timeout=120)
    import jax
    import numpy as np
    from jax.experimental import multihost_utils

    local = jax.local_device_count()
    devices = sorted(jax.devices(), key=lambda d: (d.process_index, d.id))
    rows, rounds = int(config["rows"]), int(config["rounds"])
    methods = config.get("methods", list(METHODS[:3]))
    routes = config.get("routes", list(ROUTES))
    out: dict = {"nodes": nodes, "devices_per_node": local, "rows": rows, "configs": {}}
    warm: dict = {}
    steps: dict = {}
    for method in methods:
        for route in routes:
            s = Step(route, method, devices, nodes, local, rows)
            state = s.init(s.zeros())
            grads = [s.grads(t) for t in range(2)]
            ups = []
            for t in range(2):  # compile and connect; these updates are the job's results
                u, state = s.update(grads[t], state)
                ups.append({k: np.asarray(multihost_utils.process_allgather(v, tiled=True)) for k, v in u.items()})
            warm[f"{route}/{method}"] = ups
            steps[(route, method)] = [s, state, grads]
    for r in range(rounds):
        for (route, method), held in steps.items():
            s, _, grads = held

            def one(held=held, s=s, grads=grads, r=r):
                held[1] = jax.block_until_ready(s.update(grads[r % 2], held[1])[1])

            m = netem.measure(one)
            sent, messages, _ = reported(held[1])
            row = out["configs"].setdefault(
                f"{route}/{method}", {"route": route, "method": method, "reported_bytes": sent, "messages": messages}
            )
            row.setdefault("measured", []).append(
                {
                    "payload_bytes": m.payload_bytes,
                    "step_s": m.window.wall_s - m.barriers.wall_s,
                    "window": m.to_json()["window"],
                    "barriers": m.to_json()["barriers"],
                    "retried": len(m.retried),
                }
            )
    if pid == 0:
        Path(config["out"]).write_text(json.dumps(out, indent=2) + "\n")
        if config.get("updates"):
            flat = {
                f"{key}/{t}/{leaf}": v for key, ups in warm.items() for t, u in enumerate(ups) for leaf, v in u.items()
            }
            np.savez(config["updates"], **flat)
    multihost_utils.sync_global_devices("cluster.py:end")


def predict(row: dict, nodes: int, local: int, bandwidth_bps: float | None) -> dict:
    """The cost model's bytes per node and step time for one configuration's report."""
    from jaxcomm import cost_model

    strategy = "allgather" if row["method"] == "topk" else "allreduce"
    workers = nodes * local if row["route"] == "flat" else nodes
    cluster = cost_model.Cluster(nodes, local)
    per_node = float(cluster.node_bytes(strategy, row["reported_bytes"], workers))
    seconds = 0.0  # an unlimited link: the model prices no time
    if bandwidth_bps is not None:
        net = cost_model.Network(bandwidth_bps / 1e9, 0.0)
        seconds = float(cost_model.step_time(strategy, row["reported_bytes"], workers, net, topology=cluster))
    return {"strategy": strategy, "bytes_per_node": per_node, "bytes_all_nodes": per_node * nodes, "step_s": seconds}


def run(args) -> dict:
    """The parent: ``reps`` jobs of every shape, shapes interleaved; the summary with the model."""
    import statistics

    from jaxcomm import netem
    from jaxcomm.netem._link import link_settings

    shapes = [tuple(int(v) for v in s.split("x")) for s in args.shapes.split(",")]
    settings = link_settings(args.bandwidth)
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(ROOT), os.environ.get("PYTHONPATH", "")])}
    jobs: dict = {f"{n}x{k}": [] for n, k in shapes}
    for rep in range(args.reps):
        for n, k in shapes:
            out = Path(args.out).with_suffix(f".{n}x{k}.{rep}.job.json")
            config = {"rows": args.rows, "rounds": args.rounds, "out": str(out)}
            if args.methods:
                config["methods"] = args.methods.split(",")
            cmd = [sys.executable, str(Path(__file__).resolve()), "--worker", json.dumps(config)]
            res = netem.launch(
                n, cmd, bandwidth=args.bandwidth, env=env, timeout=args.timeout, cwd=ROOT, devices_per_process=k,
                capture_output=True,
            )  # fmt: skip
            if res.returncode != 0:
                raise RuntimeError(f"the {n}x{k} job exited {res.returncode}: {(res.stderr or '')[-3000:]}")
            job = json.loads(out.read_text())
            out.unlink()
            job["launch"] = {key: v for key, v in res.to_json().items() if key not in ("stdout", "stderr")}
            jobs[f"{n}x{k}"].append(job)
            print(f"rep {rep + 1}/{args.reps} {n}x{k}: {res.wall_s:.1f} s", file=sys.stderr, flush=True)
    summary: dict = {}
    for shape, reps in jobs.items():
        n, k = (int(v) for v in shape.split("x"))
        for key in reps[0]["configs"]:
            rows = [job["configs"][key] for job in reps]
            times = [m["step_s"] for r in rows for m in r["measured"]]
            sent = [m["payload_bytes"] for r in rows for m in r["measured"]]
            model = predict(rows[0], n, k, settings.bandwidth_bps)
            mean_t = statistics.fmean(times)
            summary[f"{shape}/{key}"] = {
                "nodes": n,
                "devices_per_node": k,
                **{f: rows[0][f] for f in ("route", "method", "reported_bytes", "messages")},
                "measured_bytes_mean": statistics.fmean(sent),
                "measured_bytes_min": min(sent),
                "measured_bytes_max": max(sent),
                "step_s_mean": mean_t,
                "step_s_stdev": statistics.stdev(times) if len(times) > 1 else 0.0,
                "step_s_min": min(times),
                "step_s_max": max(times),
                "samples": len(times),
                "model": model,
                "model_over_measured_time": model["step_s"] / mean_t if mean_t > 0 else None,
                "measured_over_model_bytes": statistics.fmean(sent) / model["bytes_all_nodes"],
            }
    return {"jobs": jobs, "summary": summary}


def markdown_table(saved: dict) -> str:
    """The docs' table of a results file."""
    meta = saved["meta"]
    lines = [
        f"{meta['bandwidth']} per node, float32 gradient of {2 * meta['rows'] * COLS * 4 / 2**20:g} MiB per worker; "
        f"{meta['reps']} jobs x {meta['rounds']} rounds per configuration; bytes: all nodes' payload per step.",
        "",
        "| nodes x devices | method | route | reported B/worker | measured bytes | model bytes | step s (mean ± sd, "
        "min–max) | model s | model / measured |",
        "|---|---|---|---|---|---|---|---|---|",
    ]
    for r in saved["summary"].values():
        m = r["model"]
        lines.append(
            f"| {r['nodes']}x{r['devices_per_node']} | {r['method']} | {r['route']} | {r['reported_bytes']:,} "
            f"| {r['measured_bytes_mean']:,.0f} | {m['bytes_all_nodes']:,.0f} | {r['step_s_mean']:.3f} ± "
            f"{r['step_s_stdev']:.3f} ({r['step_s_min']:.3f}–{r['step_s_max']:.3f}) | {m['step_s']:.3f} "
            f"| {r['model_over_measured_time']:.2f} |"
        )
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    if argv[:1] == ["--worker"]:
        worker(json.loads(argv[1]))
        return 0
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--shapes", default="2x2,4x2", help="nodes x devices per node, comma-separated")
    parser.add_argument("--reps", type=int, default=3, help="jobs per shape")
    parser.add_argument("--rounds", type=int, default=3, help="measured steps per configuration and job")
    parser.add_argument("--rows", type=int, default=512, help="rows of each of the two (rows, 1024) leaves")
    parser.add_argument("--methods", default="", help="comma-separated, of topk,bf16,none,sign (default: the first 3)")
    parser.add_argument("--bandwidth", default="100mbit")
    parser.add_argument("--timeout", type=float, default=600.0)
    parser.add_argument("--out", default=str(HERE / "results" / "cluster.json"))
    parser.add_argument("--markdown", default=None, metavar="FILE", help="print the table of a results file")
    args = parser.parse_args(argv)
    if args.markdown:
        print(markdown_table(json.loads(Path(args.markdown).read_text())))
        return 0
    import jax

    t0 = time.time()
    saved = run(args)
    saved["meta"] = {
        "benchmark": "cluster",
        "command": "python experiments/benchmarks/cluster.py " + " ".join(argv),
        "bandwidth": args.bandwidth,
        "rows": args.rows,
        "reps": args.reps,
        "rounds": args.rounds,
        "host_cpus": os.cpu_count(),
        "platform": platform.platform(),
        "jax": jax.__version__,
        "date": time.strftime("%Y-%m-%d %H:%M:%S"),
        "load_average_at_end": list(os.getloadavg()),
        "wall_s": time.time() - t0,
    }
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text(json.dumps(saved, indent=2) + "\n")
    print(markdown_table(saved))
    return 0


if __name__ == "__main__":
    sys.exit(main())
