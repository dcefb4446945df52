"""Compress + decompress latency of every registered compressor (GRACE Fig. 8's method).

For each compressor in ``jaxcomm.compressors.names()`` (read at run time, so
every registered quantiser, sparsifier and low-rank method is included) and
each size (default 262,144 / 2,621,440 / 26,214,400 float32 entries = 1 / 10 /
100 MB), this times one jitted ``decompress(compress(x, key))`` on a standard
normal vector, ``block_until_ready``, after a warm-up call (compilation
excluded), and reports the median of ``--repeats`` runs. GRACE (Sec. V-D)
measures the same combined latency in isolation, on a GPU; here it is the CPU.

Alongside, in the same run and on the same array, a memory-bandwidth
reference: a jitted elementwise pass ``2 x + 1`` (reads and writes ``d``
floats). Reference and compressor are timed in interleaved rounds so that drifts
in machine load hit both alike: each round calls the reference twice and the
compressor twice and times the *second* call of each (ref, REF, c, C, ref, REF,
...). Timing only the repeated call measures each operation in its steady state:
a call that directly follows a different, larger computation pays for cold
caches and freshly faulted output pages, which inflated the reference by up to
2x behind the sparsifiers when every call was timed. The reported ratio is
``median(compressor) / median(reference)``. Process CPU time per call is
recorded too (less sensitive to other processes on a shared machine).

PowerSGD is also timed on matrices (default 1280 x 2048 and 1024 x 2560, 10 MB
each; ``--powersgd-shape`` takes a comma-separated list, e.g. adding 5120x5120)
for ranks 1, 2, 4, each against the reference on the same matrix (the 1-D
vectors of the main sweep are sent uncompressed by PowerSGD, as in PyTorch).
Each is timed twice: ``cold``, from the initial state (the first step: ``Q``
drawn from the key), and ``warm``, from the state one step left, returning the
next state too (every later training step: the previous ``Q``, orthogonalised;
PowerSGD's default ``warm_start``).
Targets, as ratios to the reference: at 10 and 100 MB, elementwise
quantizers (fp16, bf16, signsgd, onebit, efsignsgd, terngrad, qsgd, natural,
eightbit) within 4x; top-k, dgc and qsparse within 10x; PowerSGD ranks 1, 2, 4
within 10x on every matrix; PowerSGD rank 1 on 1280 x 2048 within 4x
(three passes over the matrix, ``M Q``, ``P^T M``, ``P Q^T``, plus small work).
Every target is reported met or missed.

Each compressor runs in its own subprocess (``--in-process`` turns this off),
so that a compiler crash in one is recorded as an error instead of ending the
sweep.

The sweep runs on the CPU unless ``JAX_PLATFORMS`` names another platform
(``JAX_PLATFORMS=cuda``: the GPU; the subprocesses inherit it); the devices used
are recorded in the JSON (``machine.devices``).

usage: python experiments/benchmarks/compressors.py [--sizes 262144,2621440,26214400]
       [--repeats 10] [--only topk,qsgd] [--out experiments/benchmarks/results/compressors.json]
       [--no-powersgd-matrix] [--powersgd-shape 1280x2048,1024x2560] [--in-process]
"""

from __future__ import annotations

import argparse
import importlib.metadata
import json
import os
import platform
import subprocess
import sys
import time
from pathlib import Path

os.environ.setdefault("JAX_PLATFORMS", "cpu")

import jax
import jax.numpy as jnp
import numpy as np

import jaxcomm as jc

try:
    from tqdm import tqdm
except ImportError:  # pragma: no cover - tqdm is a project dependency

    def tqdm(it, **_):
        return it


DEFAULT_SIZES = (262_144, 2_621_440, 26_214_400)
DEFAULT_OUT = Path(__file__).resolve().parent / "results" / "compressors.json"
# GRACE Fig. 8's settings: 1% density for sparsifiers, 64 levels / buckets for QSGD / SketchML.
KWARGS = {
    "topk": dict(ratio=0.01),
    "randomk": dict(ratio=0.01),
    "dgc": dict(ratio=0.01),
    "adaptive": dict(ratio=0.01),
    "qsparse": dict(ratio=0.01, levels=64),
    "threshold": dict(v=2.5758),  # |N(0,1)| >= 2.5758 for 1% of the entries
    "random_sparsification": dict(p=0.01),
    "powersgd": dict(matrix_approximation_rank=1),
    "qsgd": dict(levels=64),
    "sketchml": dict(buckets=64),
}
POWERSGD_SHAPES = ((1280, 2048), (1024, 2560))
POWERSGD_RANKS = (1, 2, 4)
# The targets: (compressors, largest ratio to the reference) at TARGET_SIZES.
TARGETS = {
    "elementwise": (("fp16", "bf16", "signsgd", "onebit", "efsignsgd", "terngrad", "qsgd", "natural", "eightbit"), 4.0),
    "sparsifier": (("topk", "dgc", "qsparse"), 10.0),
}
TARGET_SIZES = (2_621_440, 26_214_400)
POWERSGD_TARGET = 10.0  # every rank and matrix
# Tighter limits for (rows, cols, rank); rank 1 is three passes over the matrix.
POWERSGD_TARGETS = {(1280, 2048, 1): 4.0}


def powersgd_limit(shape, rank) -> float:
    """The largest ratio to the reference allowed for PowerSGD of ``rank`` on a ``shape`` matrix."""
    return POWERSGD_TARGETS.get((*map(int, shape), int(rank)), POWERSGD_TARGET)


def parse_shapes(text: str) -> list[tuple[int, int]]:
    """``"1280x2048,1024x2560"`` -> ``[(1280, 2048), (1024, 2560)]``; ValueError on anything else."""
    shapes = []
    for item in text.lower().split(","):
        dims = item.strip().split("x")
        if len(dims) != 2 or not all(d.isdigit() and int(d) >= 1 for d in dims):
            raise ValueError(f"--powersgd-shape takes ROWSxCOLS[,ROWSxCOLS...], got {text!r}")
        shapes.append((int(dims[0]), int(dims[1])))
    return shapes


def shapes_arg(shapes) -> str:
    return ",".join("x".join(map(str, s)) for s in shapes)


def reference_fn():
    """The memory-bandwidth reference: one jitted elementwise pass (read d, write d floats)."""
    return jax.jit(lambda x: x * 2.0 + 1.0)


def roundtrip_fn(c):
    """Jitted ``decompress(compress(x, key))`` of compressor ``c``."""
    return jax.jit(lambda x, key: c.decompress(c.compress(x, key)[0]))


def time_interleaved(fn, args, ref, ref_args, repeats: int):
    """Warm up both, then ``repeats`` rounds of (ref, REF, fn, FN): wall and process-CPU seconds.

    Only the second (capitalised) call of each pair is timed: the steady-state
    latency of the operation, not the cost of following a different one.
    """
    jax.block_until_ready(fn(*args))
    jax.block_until_ready(ref(*ref_args))
    walls, cpus, ref_walls, ref_cpus = [], [], [], []
    for _ in range(repeats):
        for f, a, w, c in ((ref, ref_args, ref_walls, ref_cpus), (fn, args, walls, cpus)):
            jax.block_until_ready(f(*a))  # settle: not timed
            c0, t0 = time.process_time(), time.perf_counter()
            jax.block_until_ready(f(*a))
            w.append(time.perf_counter() - t0)
            c.append(time.process_time() - c0)
    med = lambda v: float(np.median(v))
    return dict(
        median_s=med(walls),
        ref_median_s=med(ref_walls),
        ratio=med(walls) / med(ref_walls),
        cpu_s=med(cpus),
        ref_cpu_s=med(ref_cpus),
        cpu_ratio=med(cpus) / max(med(ref_cpus), 1e-9),
        runs_s=[float(v) for v in walls],
    )


def wire_bits_of(c, x, key) -> int:
    payload, _ = jax.jit(lambda x, k: c.compress(x, k))(x, key)
    return int(jc.wire_bits(payload))


def bench_one(name: str, kwargs: dict, d: int, repeats: int, ref) -> dict:
    row = dict(name=name, kwargs=kwargs, size=d, megabytes=4 * d / 2**20)
    try:
        c = jc.compressors.make(name, **kwargs)
        x = jax.random.normal(jax.random.PRNGKey(0), (d,), jnp.float32)
        key = jax.random.PRNGKey(1)
        fn = roundtrip_fn(c)
        t0 = time.perf_counter()
        jax.block_until_ready(fn(x, key))
        row["compile_s"] = time.perf_counter() - t0
        row.update(time_interleaved(fn, (x, key), ref, (x,), repeats))
        row["wire_bits"] = wire_bits_of(c, x, key)
        row["bits_per_entry"] = row["wire_bits"] / d
    except Exception as e:  # record and go on: one compressor's failure must not end the sweep
        row["error"] = f"{type(e).__name__}: {e}"
    return row


def bench_powersgd_matrix(repeats: int, ref, shapes=POWERSGD_SHAPES) -> list[dict]:
    """Rows for every (shape, rank): the round trip of one standard normal matrix, against the reference."""
    rows = []
    key = jax.random.PRNGKey(1)
    for shape in shapes:
        x = jax.random.normal(jax.random.PRNGKey(0), shape, jnp.float32)
        for r in POWERSGD_RANKS:
            c = jc.compressors.powersgd(matrix_approximation_rank=r)
            warm_state = jax.jit(c.roundtrip)(x, jax.random.PRNGKey(2))[1]  # after one step
            warm_fn = jax.jit(c.roundtrip)  # output and next state, as in a training step
            for start, fn, args in (
                ("cold", roundtrip_fn(c), (x, key)),
                ("warm", warm_fn, (x, key, warm_state)),
            ):
                row = dict(
                    name="powersgd",
                    kwargs=dict(matrix_approximation_rank=r),
                    shape=list(shape),
                    size=int(np.prod(shape)),
                    start=start,
                )
                row.update(time_interleaved(fn, args, ref, (x,), repeats))
                row["wire_bits"] = wire_bits_of(c, x, key)
                rows.append(row)
    return rows


def run_worker(job: str, sizes, repeats: int, shapes=POWERSGD_SHAPES) -> list[dict]:
    """Run one compressor (or the PowerSGD matrix job) in a subprocess; a crash becomes an error row."""
    cmd = [
        sys.executable,
        str(Path(__file__).resolve()),
        "--worker",
        job,
        "--sizes",
        ",".join(map(str, sizes)),
        "--repeats",
        str(repeats),
        "--powersgd-shape",
        shapes_arg(shapes),
    ]
    env = dict(os.environ)
    env["PYTHONPATH"] = os.pathsep.join([str(Path(__file__).resolve().parents[2]), env.get("PYTHONPATH", "")])
    proc = subprocess.run(cmd, capture_output=True, text=True, env=env)
    for line in proc.stdout.splitlines():
        if line.startswith("ROWS "):
            return json.loads(line[5:])
    err = f"subprocess exited with {proc.returncode}: {proc.stderr.strip().splitlines()[-1:] if proc.stderr else ''}"
    if job == "powersgd-matrix":
        return [
            dict(name="powersgd", kwargs=dict(matrix_approximation_rank=r), shape=list(shape), start=start, error=err)
            for shape in shapes
            for r in POWERSGD_RANKS
            for start in ("cold", "warm")
        ]
    return [dict(name=job, kwargs=KWARGS.get(job, {}), size=d, error=err) for d in sizes]


def _dist_version(name: str) -> str | None:
    try:
        return importlib.metadata.version(name)
    except importlib.metadata.PackageNotFoundError:
        return None


def machine_info() -> dict:
    return dict(
        jaxcomm=str(Path(jc.__file__).resolve().parent),
        jax=jax.__version__,
        jaxlib=_dist_version("jaxlib"),
        numpy=np.__version__,
        python=platform.python_version(),
        platform=platform.platform(),
        processor=platform.processor() or platform.machine(),
        cpu_count=os.cpu_count(),
        devices=[str(dev) for dev in jax.devices()],
        loadavg=list(os.getloadavg()),
    )


def markdown_table(rows: list[dict], sizes, cpu: bool = False) -> str:
    """Rows: compressors; columns: sizes; cells ``ratio (ms)`` (``wall ratio / CPU ratio (ms)`` with ``cpu``)."""
    by = {}
    for r in rows:
        by.setdefault(r["name"], {})[r["size"]] = r
    head = "| compressor | " + " | ".join(f"{4 * d / 2**20:g} MB" for d in sizes) + " | wire bits/entry |"
    sep = "|---|" + "---:|" * (len(sizes) + 1)
    lines = [head, sep]
    for name in sorted(by):
        cells = []
        for d in sizes:
            r = by[name].get(d)
            if r is None:
                cells.append("")
            elif "error" in r:
                cells.append("error")
            elif cpu:
                cells.append(f"{r['ratio']:.1f}x / {r['cpu_ratio']:.1f}x ({1e3 * r['median_s']:.1f} ms)")
            else:
                cells.append(f"{r['ratio']:.1f}x ({1e3 * r['median_s']:.1f} ms)")
        last = by[name].get(sizes[-1]) or {}
        bits = f"{last['wire_bits'] / last['size']:.3g}" if "wire_bits" in last else ""
        lines.append(f"| {name} | " + " | ".join(cells) + f" | {bits} |")
    refs = []
    for d in sizes:
        vals = [r["ref_median_s"] for r in rows if r["size"] == d and "ref_median_s" in r]
        refs.append(f"{1e3 * float(np.median(vals)):.2f} ms" if vals else "")
    lines.append("| *reference (2x+1)* | " + " | ".join(refs) + " | |")
    return "\n".join(lines)


def evaluate_targets(rows: list[dict], matrix_rows: list[dict]) -> dict:
    """``{"name@size": {ratio, limit, met}}`` for every target measured (an error counts as missed).

    PowerSGD rows are keyed ``powersgd_r{rank}@{rows}x{cols}`` (``..._warm`` for warm-started
    rows) with the limit of :func:`powersgd_limit`.
    """
    targets = {}
    for group, (names, limit) in TARGETS.items():
        for r in rows:
            if r["name"] in names and r.get("size") in TARGET_SIZES:
                ratio = r.get("ratio", float("inf"))
                targets[f"{r['name']}@{4 * r['size'] / 2**20:g}MB"] = dict(
                    group=group,
                    ratio=ratio,
                    cpu_ratio=r.get("cpu_ratio"),
                    limit=limit,
                    met=bool(ratio <= limit),
                    error=r.get("error"),
                )
    for r in matrix_rows:
        ratio = r.get("ratio", float("inf"))
        rank, shape = r["kwargs"].get("matrix_approximation_rank", "?"), r["shape"]
        limit = powersgd_limit(shape, rank) if rank != "?" else POWERSGD_TARGET
        warm = "_warm" if r.get("start") == "warm" else ""
        targets[f"powersgd_r{rank}@{shape[0]}x{shape[1]}{warm}"] = dict(
            group="powersgd",
            ratio=ratio,
            cpu_ratio=r.get("cpu_ratio"),
            limit=limit,
            met=bool(ratio <= limit),
            error=r.get("error"),
        )
    return targets


def powersgd_table(matrix_rows: list[dict]) -> str:
    """One table per matrix shape: a line per rank and start (wall and CPU ratios, ms, wire bits/entry)."""
    tables = {}
    for r in matrix_rows:
        tables.setdefault("x".join(map(str, r["shape"])), []).append(r)
    out = []
    for shape, shape_rows in tables.items():
        lines = [
            f"| PowerSGD on {shape} | Q | ratio | CPU-time ratio | ms | wire bits/entry |",
            "|---|---|---:|---:|---:|---:|",
        ]
        for r in shape_rows:
            rank = r["kwargs"].get("matrix_approximation_rank", "?")
            head = f"| rank {rank} | {r.get('start', 'cold')} |"
            if "ratio" in r:
                lines.append(
                    f"{head} {r['ratio']:.1f}x | {r['cpu_ratio']:.1f}x | {1e3 * r['median_s']:.1f} | "
                    f"{r['wire_bits'] / r['size']:.4f} |"
                )
            else:
                lines.append(f"{head} error: {r['error']} | | | |")
        out.append("\n".join(lines))
    return "\n\n".join(out)


def targets_table(targets: dict) -> str:
    """One line per target: wall-time ratio (the one judged), CPU-time ratio, limit, met or missed."""
    lines = ["| target | ratio | CPU-time ratio | limit | |", "|---|---:|---:|---:|---|"]
    for k, v in targets.items():
        ratio = "error" if v.get("error") else f"{v['ratio']:.2f}x"
        cpu = f"{v['cpu_ratio']:.2f}x" if v.get("cpu_ratio") is not None else ""
        lines.append(f"| {k} | {ratio} | {cpu} | {v['limit']:g}x | {'met' if v['met'] else '**missed**'} |")
    return "\n".join(lines)


def main(argv=None) -> dict:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--sizes", default=",".join(map(str, DEFAULT_SIZES)), help="comma-separated entry counts")
    ap.add_argument("--repeats", type=int, default=10, help="timed runs per measurement (median reported)")
    ap.add_argument("--only", default="", help="comma-separated compressor names (default: all registered)")
    ap.add_argument("--out", default=str(DEFAULT_OUT), help="JSON output path")
    ap.add_argument("--no-powersgd-matrix", action="store_true", help="skip the PowerSGD matrix runs")
    ap.add_argument(
        "--powersgd-shape",
        default=shapes_arg(POWERSGD_SHAPES),
        help=f"matrix shapes of the PowerSGD runs, ROWSxCOLS[,ROWSxCOLS...] (default {shapes_arg(POWERSGD_SHAPES)})",
    )
    ap.add_argument("--in-process", action="store_true", help="run every compressor in this process")
    ap.add_argument("--worker", default="", help=argparse.SUPPRESS)  # internal: one compressor, rows to stdout
    ap.add_argument(
        "--markdown", metavar="JSON", help="print the tables of a results file (wall / CPU ratios) and exit"
    )
    args = ap.parse_args(argv)
    if args.markdown:
        res = json.loads(Path(args.markdown).read_text())
        print(markdown_table(res["results"], res["sizes"], cpu=True))
        if res["powersgd_matrix"]:
            print("\n" + powersgd_table(res["powersgd_matrix"]))
        print("\n" + targets_table(evaluate_targets(res["results"], res["powersgd_matrix"])))
        return res
    if args.repeats < 1:
        ap.error("--repeats must be >= 1")
    sizes = [int(s) for s in args.sizes.split(",") if s]
    try:
        shapes = parse_shapes(args.powersgd_shape)
    except ValueError as e:
        ap.error(str(e))
    names = jc.compressors.names()
    if args.only:
        wanted = [n.strip() for n in args.only.split(",") if n.strip()]
        unknown = [n for n in wanted if n not in names]
        if unknown:
            ap.error(f"unknown compressor(s) {unknown}; registered: {names}")
        names = wanted
    if args.worker:
        ref = reference_fn()
        if args.worker == "powersgd-matrix":
            out_rows = bench_powersgd_matrix(args.repeats, ref, shapes)
        else:
            out_rows = [bench_one(args.worker, KWARGS.get(args.worker, {}), d, args.repeats, ref) for d in sizes]
        print("ROWS " + json.dumps(out_rows))
        return {"rows": out_rows}
    jobs = list(names)
    if not args.no_powersgd_matrix and (not args.only or "powersgd" in names):
        jobs.append("powersgd-matrix")
    rows, matrix_rows = [], []
    ref = None if not args.in_process else reference_fn()
    for job in tqdm(jobs, desc=f"compress+decompress x {len(sizes)} sizes", unit="compressor"):
        if args.in_process:
            got = (
                bench_powersgd_matrix(args.repeats, ref, shapes)
                if job == "powersgd-matrix"
                else [bench_one(job, KWARGS.get(job, {}), d, args.repeats, ref) for d in sizes]
            )
        else:
            got = run_worker(job, sizes, args.repeats, shapes)
        (matrix_rows if job == "powersgd-matrix" else rows).extend(got)
    targets = evaluate_targets(rows, matrix_rows)
    result = dict(
        benchmark="compressors",
        method="median wall time of jitted decompress(compress(x)) / median of a "
        "jitted elementwise pass 2x+1 on the same array, interleaved",
        command=" ".join(sys.argv),
        machine=machine_info(),
        sizes=sizes,
        repeats=args.repeats,
        kwargs=KWARGS,
        results=rows,
        powersgd_matrix=matrix_rows,
        targets=targets,
        target_limits={
            **{g: dict(names=list(n), max_ratio=lim, sizes=list(TARGET_SIZES)) for g, (n, lim) in TARGETS.items()},
            "powersgd": dict(
                shapes=[list(s) for s in shapes],
                ranks=list(POWERSGD_RANKS),
                max_ratio=POWERSGD_TARGET,
                tighter={f"r{r}@{n}x{m}": lim for (n, m, r), lim in POWERSGD_TARGETS.items()},
            ),
        },
    )
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(result, indent=1))
    print(markdown_table(rows, sizes))
    if matrix_rows:
        print("\n" + powersgd_table(matrix_rows))
    print("\n" + targets_table(targets))
    missed = [k for k, v in targets.items() if not v["met"]]
    print(
        f"targets: {len(targets) - len(missed)} met, {len(missed)} missed"
        + (f" ({', '.join(missed)})" if missed else "")
    )
    errors = [r for r in rows if "error" in r]
    for r in errors:
        print(f"error {r['name']}@{r['size']}: {r['error']}")
    print(f"wrote {out}")
    return result


if __name__ == "__main__":
    main()
