"""Scaling: the cost model's step against the emulated network at n = 2, 4, 8, then projected.

For each ``n`` of ``--procs``, one job of ``n`` MPI processes on a ``--bandwidth`` shared link
(:func:`jaxcomm.netem.launch`, Open MPI's ring collectives) times one ``compressed_mean`` step
per case on a ``(rows, 1024)`` float32 gradient, between barriers
(:func:`jaxcomm.netem.measure`; ``--repeats`` windows, the median kept):

=================  =================  ===========================================
case               strategy           bytes on the wire, all workers
=================  =================  ===========================================
``none``           ring all-reduce    ``2 (n − 1) P``
``topk`` (1 %)     all-gather         ``n (n − 1) P``
``fp16``           reduce-scatter     ``2 (n − 1) P`` (``P`` = half the dense bytes)
=================  =================  ===========================================

It records the pipeline's ``P`` (``state.wire_bits``), the kernel's byte count and the wall
clock, beside :func:`jaxcomm.cost_model.step_bytes` and the shared-link
:func:`jaxcomm.cost_model.step_time` (``α = 0``). Then it projects the same three routes to
16-1024 workers with ``step_time(..., topology="switched")`` (one full-duplex link per
worker) for a ``--project-params``-entry float32 gradient at ``--project-gbps``, and writes
``scaling.png``: the measured points and the model at n = 2, 4, 8 (left), the projection
(right).

usage: python experiments/benchmarks/scaling.py [--procs 2,4,8] [--rows 1024] [--bandwidth 400mbit]
       [--repeats 3] [--out experiments/benchmarks/results/scaling.json] [--smoke]
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import sys
from pathlib import Path

HERE = Path(__file__).resolve().parent
ROOT = HERE.parents[1]
COLS = 1024
CASES = {  # name: (compressor factory, strategy, cost-model strategy)
    "none": ("none", {}, "allreduce"),
    "topk": ("topk", {"ratio": 0.01}, "allgather"),
    "fp16": ("fp16", {}, "reduce_scatter"),
}
PROJECT_N = (2, 4, 8, 16, 32, 64, 128, 256, 512, 1024)


def _worker(rows: int, repeats: int, out: str) -> None:
    import jax
    import jax.numpy as jnp
    import numpy as np
    from mpi4py import MPI

    import jaxcomm as jc
    from jaxcomm.comm import MPIComm
    from jaxcomm.netem import measure

    comm, world = MPIComm(), MPI.COMM_WORLD
    n, r = comm.size, comm.rank
    rng = np.random.default_rng(1234 + r)
    g = {"w": jnp.asarray(rng.integers(-512, 512, size=(rows, COLS)) / 64.0, jnp.float32)}
    report: dict = {"n": n, "shape": [rows, COLS], "cases": {}}
    for name, (factory, kwargs, strategy) in CASES.items():
        tx = jc.compressed_mean(jc.compressors.make(factory, **kwargs), comm=comm, strategy=strategy)
        step = jax.jit(tx.update)
        state = tx.init(g)
        for _ in range(2):  # compile, connect
            upd, state = step(g, state)
            jax.block_until_ready((upd, state))
        holder = {"state": state}

        def one(holder=holder, step=step):
            u, s = step(g, holder["state"])
            jax.block_until_ready((u, s))
            holder["state"] = s

        windows = [measure(one, world) for _ in range(repeats)]
        if r == 0:
            s = holder["state"]
            report["cases"][name] = {
                "strategy": strategy,
                "wire_bits": int(np.asarray(s.wire_bits, np.int64).sum()),
                "messages": int(s.messages),
                "windows": [m.to_json() for m in windows],
            }
    if r == 0:
        Path(out).write_text(json.dumps(report))


def _measure(args) -> list[dict]:
    from jaxcomm import netem

    rows_out = []
    env = {**os.environ, **netem.RING_COLLECTIVES}
    env["PYTHONPATH"] = os.pathsep.join(p for p in (str(ROOT), env.get("PYTHONPATH", "")) if p)
    for n in args.procs:
        rows = args.rows
        if rows * COLS % n:
            raise SystemExit(f"--rows: {rows} x {COLS} entries must divide among {n} workers")
        tmp = Path(args.out).with_suffix(f".n{n}.json")
        cmd = [sys.executable, str(Path(__file__).resolve()), "--worker", str(rows), str(args.repeats), str(tmp)]
        res = netem.launch(n, cmd, bandwidth=args.bandwidth, env=env, timeout=1800, cwd=ROOT)
        if res.returncode != 0:
            raise SystemExit(f"the job with {n} processes failed (exit code {res.returncode})")
        report = json.loads(tmp.read_text())
        tmp.unlink()
        rate = res.settings["bandwidth_bps"]
        for name, c in report["cases"].items():
            rows_out.append(_row(name, c, n, rate))
    return rows_out


def _row(name: str, c: dict, n: int, rate_bps: float) -> dict:
    import numpy as np

    from jaxcomm import cost_model

    payload = [w["payload_bytes"] for w in c["windows"]]
    wall = [w["window"]["wall_s"] - w["barriers"]["wall_s"] for w in c["windows"]]
    P = c["wire_bits"] / 8
    net = cost_model.Network(rate_bps / 1e9, 0.0)
    return {
        "case": name,
        "strategy": c["strategy"],
        "n": n,
        "wire_bytes_per_worker": P,
        "messages": c["messages"],
        "predicted_bytes": float(cost_model.step_bytes(c["strategy"], P, n)),
        "measured_bytes": float(np.median(payload)),
        "predicted_s": float(cost_model.step_time(c["strategy"], P, n, net, messages=c["messages"])),
        "measured_s": float(np.median(wall)),
        "retransmission_retries": sum(len(w["retried"]) for w in c["windows"]),
    }


def _projection(args, measured: list[dict]) -> list[dict]:
    from jaxcomm import cost_model

    d = args.project_params
    net = cost_model.Network(args.project_gbps, args.project_latency)
    per_entry = {}  # one worker's payload bytes per gradient entry, from the measured wire_bits
    for row in measured:
        per_entry.setdefault(row["case"], row["wire_bytes_per_worker"] / (args.rows * COLS))
    out = []
    for name, (_, _, strategy) in CASES.items():
        P = per_entry[name] * d
        for n in PROJECT_N:
            m = n if strategy == "reduce_scatter" else 1
            t = float(cost_model.step_time(strategy, P, n, net, messages=m, topology="switched"))
            out.append({"case": name, "strategy": strategy, "n": n, "payload_bytes": P, "predicted_s": t})
    return out


def _plot(args, measured: list[dict], projected: list[dict], path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    colors = {"none": "tab:blue", "topk": "tab:red", "fp16": "tab:green"}
    label = {"none": "dense ring all-reduce", "topk": "top-k 1 %, all-gather", "fp16": "fp16, reduce-scatter"}
    fig, (a, b) = plt.subplots(1, 2, figsize=(10.5, 4.0))
    for name in CASES:
        rows = sorted((r for r in measured if r["case"] == name), key=lambda r: r["n"])
        ns = [r["n"] for r in rows]
        a.plot(ns, [r["predicted_s"] for r in rows], color=colors[name], lw=1.2, label=f"{label[name]}: model")
        a.scatter(ns, [r["measured_s"] for r in rows], color=colors[name], marker="o", s=30, label="measured")
        proj = sorted((r for r in projected if r["case"] == name), key=lambda r: r["n"])
        b.plot(
            [r["n"] for r in proj], [r["predicted_s"] for r in proj], color=colors[name], marker=".", label=label[name]
        )
    a.set_xscale("log", base=2)
    a.set_yscale("log")
    a.set_xlabel("workers (MPI processes)")
    a.set_ylabel("step communication (s)")
    a.set_title(
        f"measured: one shared {args.bandwidth} link, {4 * args.rows * COLS / 2**20:g} MiB gradient", fontsize=9
    )
    a.grid(alpha=0.3, which="both")
    a.legend(fontsize=6)
    b.set_xscale("log", base=2)
    b.set_yscale("log")
    b.set_xlabel("workers")
    b.set_title(
        f"projected (model): switched {args.project_gbps:g} Gbit/s per worker, α = {args.project_latency * 1e6:g} µs,\n"
        f"{args.project_params / 1e6:g}M float32 entries",
        fontsize=9,
    )
    b.grid(alpha=0.3, which="both")
    b.legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    if argv[:1] == ["--worker"]:
        _worker(int(argv[1]), int(argv[2]), argv[3])
        return 0
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--procs", default="2,4,8", help="comma-separated process counts")
    p.add_argument("--rows", type=int, default=1024, help="gradient rows of 1024 float32 entries")
    p.add_argument("--bandwidth", default="400mbit")
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--project-params", type=float, default=25.6e6, help="entries of the projected gradient")
    p.add_argument("--project-gbps", type=float, default=10.0)
    p.add_argument("--project-latency", type=float, default=5e-6, help="α of the projection (s)")
    p.add_argument("--smoke", action="store_true", help="n = 2 and 4, a 256 KiB gradient, one window")
    p.add_argument("--out", default=str(HERE / "results" / "scaling.json"))
    args = p.parse_args(argv)
    if args.smoke:
        args.procs, args.rows, args.repeats = "2,4", 64, 1
    args.procs = [int(v) for v in str(args.procs).split(",")]
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    measured = _measure(args)
    projected = _projection(args, measured)
    figure = Path(args.out).with_suffix(".png")
    _plot(args, measured, projected, figure)
    result = {
        "benchmark": "scaling",
        "machine": {"platform": platform.platform(), "cpus": os.cpu_count()},
        "args": dict(vars(args)),
        "measured": measured,
        "projected": projected,
        "figure": str(figure),
    }
    Path(args.out).write_text(json.dumps(result, indent=1))
    for row in measured:
        print(
            f"n={row['n']} {row['case']:5s} bytes {row['measured_bytes']:.0f} / predicted {row['predicted_bytes']:.0f}"
            f" = {row['measured_bytes'] / max(row['predicted_bytes'], 1):.4f}; time {row['measured_s']:.3f} s"
            f" / predicted {row['predicted_s']:.3f} s"
        )
    print(f"results: {args.out}\nfigure: {figure}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
