"""Honest payloads: the bytes one compressed_mean step puts on an emulated link, per compressor.

Every compressor of the catalogue (``jaxcomm.compressors.names()``) runs
``compressed_mean(c, comm=MPIComm())`` at its own strategy inside ``jax.jit``, on ``--procs``
MPI processes launched by :func:`jaxcomm.netem.launch` on a ``--bandwidth`` shared link (Open
MPI over TCP through a private loopback; ring all-reduce and all-gather selected). Each rank's
gradient is a float32 ``--shape`` array of standard normal entries (its own seed). After two
warm-up steps, one step is measured between barriers (:func:`jaxcomm.netem.measure`: the
kernel's count of TCP payload, the barriers' own bytes subtracted, measured again while TCP
retransmitted). Per compressor, rank 0 records:

* ``reported``: ``state.wire_bits.sum() / 8``, the bytes one worker reports (the same on every
  worker);
* ``predicted``: :func:`jaxcomm.cost_model.step_bytes` of it (``n (n − 1) P`` for an
  all-gather, ``2 (n − 1) P`` for an all-reduce or PowerSGD's rounds), all workers together;
* ``measured``: the link's TCP payload, all workers together; ``ratio = measured / predicted``
  (the target: at most 1.2);
* for all-gather compressors, ``format``: the payload's own bit count
  (:func:`jaxcomm.compressors.wire_bits`, what the pipeline reported before count-based
  payloads went through :func:`jaxcomm.comm.all_gather_counted`) of every rank's payload of
  the measured step, and ``whole``: the bytes of every array of the payload (what gathering
  the fixed-capacity buffer whole sent), both as ``(n − 1) Σ_r`` bytes on the link.

usage: python experiments/benchmarks/payload_bytes.py [--procs 4] [--shape 4096x1024]
       [--bandwidth 400mbit] [--only threshold,topk] [--out experiments/benchmarks/results/payload_bytes.json]
       python experiments/benchmarks/payload_bytes.py --smoke --out /tmp/p.json   (2 processes, 64x32, 4 compressors)
       python experiments/benchmarks/payload_bytes.py --markdown experiments/benchmarks/results/payload_bytes.json
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
TARGET = 1.2
"""Measured bytes at most this multiple of the accounting's prediction."""

KWARGS = {
    "threshold": dict(v=2.0),  # Threshold-v at v = 2: about 4.55 % of standard normal entries
    "topk": dict(ratio=0.01),
    "randomk": dict(ratio=0.01),
    "dgc": dict(ratio=0.01),
    "adaptive": dict(ratio=0.01),
    "qsparse": dict(ratio=0.01, levels=16),
    "random_sparsification": dict(p=0.01),
    "qsgd": dict(levels=16),
    "powersgd": dict(matrix_approximation_rank=4),
    "clipping": dict(bits=8),
    "stochastic_rounding": dict(bits=4),
}
"""Hyper-parameters per compressor; a name missing here uses its defaults."""

SMOKE = dict(procs=2, shape="64x32", only="none,topk,threshold,inceptionn")
RING = {  # Open MPI's tuned collectives: ring all-reduce (4) and ring all-gather (4), as tests/test_netem.py
    "OMPI_MCA_coll_tuned_use_dynamic_rules": "1",
    "OMPI_MCA_coll_tuned_allreduce_algorithm": "4",
    "OMPI_MCA_coll_tuned_allgather_algorithm": "4",
}


def _shape(text: str) -> tuple[int, int]:
    rows, cols = (int(v) for v in text.lower().split("x"))
    return rows, cols


def launch(args) -> int:
    """Parent: run this script's workers on the emulated link; then print the table."""
    from jaxcomm import netem

    out = Path(args.out).resolve()
    cmd = [sys.executable, str(Path(__file__).resolve()), "--worker", "--shape", args.shape, "--out", str(out)]
    if args.only:
        cmd += ["--only", args.only]
    env = {**os.environ, **RING, "PYTHONPATH": os.pathsep.join([str(ROOT), os.environ.get("PYTHONPATH", "")])}
    res = netem.launch(args.procs, cmd, bandwidth=args.bandwidth, env=env, timeout=args.timeout, cwd=ROOT)
    if res.returncode != 0:
        print(f"the job exited {res.returncode} (timed out: {res.timed_out})", file=sys.stderr)
        return res.returncode or 1
    saved = json.loads(out.read_text())
    saved["meta"]["command"] = "python experiments/benchmarks/payload_bytes.py " + " ".join(args.argv)
    saved["meta"]["launch"] = {k: v for k, v in res.to_json().items() if k not in ("stdout", "stderr")}
    out.write_text(json.dumps(saved, indent=2) + "\n")
    print(markdown_table(saved))
    return 0


def worker(args) -> None:
    """One MPI process: every compressor's step, measured on the link; rank 0 writes the JSON."""
    os.environ.setdefault("XLA_FLAGS", "")  # one CPU device per process (mpirun_netem_env removed the flag)
    import jax
    import numpy as np
    from mpi4py import MPI

    import jaxcomm as jc
    from jaxcomm import cost_model, netem
    from jaxcomm._keys import step_keys
    from jaxcomm.comm import MPIComm
    from jaxcomm.transforms import compressed_mean

    comm, world = MPIComm(), MPI.COMM_WORLD
    n, rank = comm.size, comm.rank
    rows, cols = _shape(args.shape)
    g = {"w": jax.numpy.asarray(np.random.default_rng(1234 + rank).standard_normal((rows, cols)), jax.numpy.float32)}
    names = [s for s in args.only.split(",") if s] if args.only else jc.compressors.names()
    out: dict = {
        "meta": {
            "benchmark": "payload_bytes",
            "processes": n,
            "shape": [rows, cols],
            "gradient_bytes_per_worker": rows * cols * 4,
            "host_cpus": os.cpu_count(),
            "platform": platform.platform(),
            "jax": jax.__version__,
            "date": time.strftime("%Y-%m-%d %H:%M:%S"),
            "load_average_at_start": list(os.getloadavg()),
            "target_ratio": TARGET,
            "kwargs": {k: v for k, v in KWARGS.items() if k in names},
        },
        "results": {},
    }
    for name in names:
        c = jc.compressors.make(name, **KWARGS.get(name, {}))
        tx = compressed_mean(c, comm=comm)
        step = jax.jit(tx.update)
        state = tx.init(g)
        for _ in range(2):  # compile, connect, warm PowerSGD's Q
            state = jax.block_until_ready(step(g, state))[1]
        before = state
        holder = {"state": state}

        def one(holder=holder, step=step):
            holder["state"] = jax.block_until_ready(step(g, holder["state"]))[1]

        measured = netem.measure(one, world)
        # The payload this rank sent in the measured step (the pipeline's key for it), for the format count.
        fmt = whole = None
        if c.strategy == "allgather":
            key = jax.random.fold_in(step_keys(before.key, 1)[1][0], rank)
            p = jax.jit(lambda x, k, c=c: c.compress(x, k)[0])(g["w"], key)
            fmt = world.gather(int(jc.compressors.wire_bits(p)), root=0)
            whole = world.gather(8 * sum(int(np.asarray(a).nbytes) for a in jax.tree.leaves(p)), root=0)
        if measured is None:  # not rank 0
            continue
        s = holder["state"]
        reported = int(np.asarray(s.wire_bits, np.int64).sum()) // 8
        model = "rounds" if c.rounds is not None and c.strategy == "allreduce" else c.strategy
        predicted = int(cost_model.step_bytes(model, reported, n))
        row = {
            "strategy": c.strategy,
            "kwargs": KWARGS.get(name, {}),
            "reported_bytes_per_worker": reported,
            "messages": int(s.messages),
            "predicted_bytes": predicted,
            "measured_bytes": measured.payload_bytes,
            "ratio": measured.payload_bytes / predicted,
            "met": measured.payload_bytes <= TARGET * predicted,
            **{k: v for k, v in measured.to_json().items() if k != "payload_bytes"},
        }
        if fmt is not None and whole is not None:
            row["format_bytes_per_worker"] = [b / 8 for b in fmt]
            row["format_bytes"] = (n - 1) * sum(fmt) / 8
            row["whole_bytes"] = (n - 1) * sum(whole) / 8
            row["ratio_to_format"] = measured.payload_bytes / row["format_bytes"]
        out["results"][name] = row
        print(
            f"{name:22s} {model:14s} reported {reported:>10d} B/worker  predicted {predicted:>11d}  "
            f"measured {measured.payload_bytes:>11d}  ratio {row['ratio']:.4f}",
            flush=True,
        )
    if rank == 0:
        out["meta"]["load_average_at_end"] = list(os.getloadavg())
        Path(args.out).parent.mkdir(parents=True, exist_ok=True)
        Path(args.out).write_text(json.dumps(out, indent=2) + "\n")


def _num(x) -> str:
    return f"{x:,.0f}".replace(",", " ")


def markdown_table(saved: dict) -> str:
    """The docs' table of a results file."""
    meta = saved["meta"]
    lines = [
        f"{meta['processes']} processes, float32 gradient {meta['shape'][0]}x{meta['shape'][1]} "
        f"({_num(meta['gradient_bytes_per_worker'])} bytes per worker); bytes summed over all workers.",
        "",
        "| compressor | strategy | reported B/worker | predicted | measured | measured / predicted | ≤ 1.2× "
        "| format (old report) | measured / format | whole buffer / format |",
        "|---|---|---|---|---|---|---|---|---|---|",
    ]
    for name, r in saved["results"].items():
        fmt = ["", "", ""]
        if "format_bytes" in r:
            fmt = [
                _num(r["format_bytes"]),
                f"{r['ratio_to_format']:.3f}",
                f"{r['whole_bytes'] / r['format_bytes']:.2f}",
            ]
        cells = [
            f"`{name}`",
            r["strategy"],
            _num(r["reported_bytes_per_worker"]),
            _num(r["predicted_bytes"]),
            _num(r["measured_bytes"]),
            f"{r['ratio']:.4f}",
            "met" if r["met"] else "MISSED",
            *fmt,
        ]
        lines.append("| " + " | ".join(cells) + " |")
    return "\n".join(lines)


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--procs", type=int, default=4)
    ap.add_argument("--shape", default="4096x1024", help="ROWSxCOLS of each rank's float32 gradient")
    ap.add_argument("--bandwidth", default="400mbit")
    ap.add_argument("--only", default="", help="comma-separated compressor names (default: the whole catalogue)")
    ap.add_argument("--timeout", type=float, default=3600.0)
    ap.add_argument("--smoke", action="store_true", help=f"a tiny run: {SMOKE}")
    ap.add_argument("--out", default="experiments/benchmarks/results/payload_bytes.json")
    ap.add_argument("--markdown", metavar="JSON", help="print the table of a results file and exit")
    ap.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    args = ap.parse_args(argv)
    args.argv = list(sys.argv[1:] if argv is None else argv)
    if args.markdown:
        print(markdown_table(json.loads(Path(args.markdown).read_text())))
        return 0
    if args.smoke:
        args.procs, args.shape, args.only = SMOKE["procs"], SMOKE["shape"], args.only or SMOKE["only"]
    if args.procs < 2:
        ap.error(f"--procs must be >= 2; got {args.procs}")
    if args.worker:
        worker(args)
        return 0
    return launch(args)


if __name__ == "__main__":
    sys.exit(main())
