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
floats). Reference and compressor calls are interleaved (ref, c, ref, c, ...)
so that drifts in machine load hit both alike; the reported ratio is
``median(compressor) / median(reference)``. Process CPU time per call is
recorded too (less sensitive to other processes on a shared machine).

PowerSGD is also timed on a 1024 x 2560 matrix (10 MB) for ranks 1, 2, 4 (the
1-D vectors of the main sweep are sent uncompressed by PowerSGD, as in
PyTorch). Targets (issue 2): top-k within 10x of the reference at 10 and 100 MB;
PowerSGD within 10x on the matrix.

usage: python experiments/benchmarks/compressors.py [--sizes 262144,2621440,26214400]
       [--repeats 10] [--only topk,qsgd] [--out experiments/benchmarks/results/compressors.json]
       [--no-powersgd-matrix]
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import sys
import time
from pathlib import Path

os.environ.setdefault("JAX_PLATFORMS", "cpu")

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402

import jaxcomm as jc  # noqa: E402

try:  # noqa: E402
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
POWERSGD_MATRIX = (1024, 2560)
POWERSGD_RANKS = (1, 2, 4)
TARGET_RATIO = 10.0


def reference_fn():
    """The memory-bandwidth reference: one jitted elementwise pass (read d, write d floats)."""
    return jax.jit(lambda x: x * 2.0 + 1.0)


def roundtrip_fn(c):
    """Jitted ``decompress(compress(x, key))`` of compressor ``c``."""
    return jax.jit(lambda x, key: c.decompress(c.compress(x, key)[0]))


def time_interleaved(fn, args, ref, ref_args, repeats: int):
    """Warm up both, then alternate ref / fn ``repeats`` times; wall and process-CPU seconds per call."""
    jax.block_until_ready(fn(*args))
    jax.block_until_ready(ref(*ref_args))
    walls, cpus, ref_walls, ref_cpus = [], [], [], []
    for _ in range(repeats):
        for f, a, w, c in ((ref, ref_args, ref_walls, ref_cpus), (fn, args, walls, cpus)):
            c0, t0 = time.process_time(), time.perf_counter()
            jax.block_until_ready(f(*a))
            w.append(time.perf_counter() - t0)
            c.append(time.process_time() - c0)
    med = lambda v: float(np.median(v))  # noqa: E731
    return dict(median_s=med(walls), ref_median_s=med(ref_walls), ratio=med(walls) / med(ref_walls),
                cpu_s=med(cpus), ref_cpu_s=med(ref_cpus), cpu_ratio=med(cpus) / max(med(ref_cpus), 1e-9),
                runs_s=[float(v) for v in walls])


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


def bench_powersgd_matrix(repeats: int, ref) -> list[dict]:
    rows = []
    x = jax.random.normal(jax.random.PRNGKey(0), POWERSGD_MATRIX, jnp.float32)
    for r in POWERSGD_RANKS:
        c = jc.compressors.powersgd(matrix_approximation_rank=r)
        fn = roundtrip_fn(c)
        row = dict(name="powersgd", kwargs=dict(matrix_approximation_rank=r), shape=list(POWERSGD_MATRIX),
                   size=int(np.prod(POWERSGD_MATRIX)))
        row.update(time_interleaved(fn, (x, jax.random.PRNGKey(1)), ref, (x,), repeats))
        row["wire_bits"] = wire_bits_of(c, x, jax.random.PRNGKey(1))
        rows.append(row)
    return rows


def machine_info() -> dict:
    return dict(
        jax=jax.__version__, jaxlib=getattr(jax.lib, "__version__", None) or jax.__version__,
        numpy=np.__version__, python=platform.python_version(), platform=platform.platform(),
        processor=platform.processor() or platform.machine(), cpu_count=os.cpu_count(),
        devices=[str(dev) for dev in jax.devices()], loadavg=list(os.getloadavg()),
    )


def markdown_table(rows: list[dict], sizes) -> str:
    """Rows: compressors; columns: sizes; cells ``ratio (ms)``."""
    by = {}
    for r in rows:
        by.setdefault(r["name"], {})[r["size"]] = r
    head = "| compressor | " + " | ".join(f"{4 * d / 2**20:g} MB" for d in sizes) + " |"
    sep = "|---|" + "---:|" * len(sizes)
    lines = [head, sep]
    for name in sorted(by):
        cells = []
        for d in sizes:
            r = by[name].get(d)
            if r is None:
                cells.append("")
            elif "error" in r:
                cells.append("error")
            else:
                cells.append(f"{r['ratio']:.1f}x ({1e3 * r['median_s']:.1f} ms)")
        lines.append(f"| {name} | " + " | ".join(cells) + " |")
    refs = []
    for d in sizes:
        vals = [r["ref_median_s"] for r in rows if r["size"] == d and "ref_median_s" in r]
        refs.append(f"{1e3 * float(np.median(vals)):.2f} ms" if vals else "")
    lines.append("| *reference (2x+1)* | " + " | ".join(refs) + " |")
    return "\n".join(lines)


def main(argv=None) -> dict:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--sizes", default=",".join(map(str, DEFAULT_SIZES)), help="comma-separated entry counts")
    ap.add_argument("--repeats", type=int, default=10, help="timed runs per measurement (median reported)")
    ap.add_argument("--only", default="", help="comma-separated compressor names (default: all registered)")
    ap.add_argument("--out", default=str(DEFAULT_OUT), help="JSON output path")
    ap.add_argument("--no-powersgd-matrix", action="store_true", help="skip the 1024x2560 PowerSGD runs")
    args = ap.parse_args(argv)
    if args.repeats < 1:
        ap.error("--repeats must be >= 1")
    sizes = [int(s) for s in args.sizes.split(",") if s]
    names = jc.compressors.names()
    if args.only:
        wanted = [n.strip() for n in args.only.split(",") if n.strip()]
        unknown = [n for n in wanted if n not in names]
        if unknown:
            ap.error(f"unknown compressor(s) {unknown}; registered: {names}")
        names = wanted
    ref = reference_fn()
    rows = []
    jobs = [(d, n) for d in sizes for n in names]
    for d, name in tqdm(jobs, desc="compress+decompress", unit="run"):
        rows.append(bench_one(name, KWARGS.get(name, {}), d, args.repeats, ref))
    matrix_rows = []
    if not args.no_powersgd_matrix and (not args.only or "powersgd" in names):
        matrix_rows = bench_powersgd_matrix(args.repeats, ref)
    targets = {}
    for r in rows:
        if r["name"] == "topk" and r["size"] in (2_621_440, 26_214_400) and "ratio" in r:
            targets[f"topk@{r['size']}"] = dict(ratio=r["ratio"], met=r["ratio"] <= TARGET_RATIO)
    for r in matrix_rows:
        targets[f"powersgd_r{r['kwargs']['matrix_approximation_rank']}@1024x2560"] = dict(
            ratio=r["ratio"], met=r["ratio"] <= TARGET_RATIO)
    result = dict(
        benchmark="compressors", method="median wall time of jitted decompress(compress(x)) / median of a "
        "jitted elementwise pass 2x+1 on the same array, interleaved", command=" ".join(sys.argv),
        machine=machine_info(), sizes=sizes, repeats=args.repeats, kwargs=KWARGS, results=rows,
        powersgd_matrix=matrix_rows, targets=targets, target_ratio=TARGET_RATIO,
    )
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(result, indent=1))
    print(markdown_table(rows, sizes))
    if matrix_rows:
        print("\n| PowerSGD on 1024x2560 | ratio | ms |\n|---|---:|---:|")
        for r in matrix_rows:
            print(f"| rank {r['kwargs']['matrix_approximation_rank']} | {r['ratio']:.1f}x | {1e3 * r['median_s']:.1f} |")
    for k, v in targets.items():
        print(f"target {k}: {v['ratio']:.2f}x {'met' if v['met'] else 'MISSED'} (<= {TARGET_RATIO:g}x)")
    errors = [r for r in rows if "error" in r]
    for r in errors:
        print(f"error {r['name']}@{r['size']}: {r['error']}")
    print(f"wrote {out}")
    return result


if __name__ == "__main__":
    main()
