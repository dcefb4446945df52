"""The kernel choices of ``jaxcomm/compressors/_kernels/``, measured on XLA:CPU side by side.

Four comparisons, each kernel against the alternative it replaced:

* ``random_bits``: ``n`` uint32 words from the counter hash ``random_bits.uniform_bits`` in its
  two schemes (``"murmur3"``, the sparsifiers'; ``"lowbias32"``, the quantizers') against
  threefry (``jax.random.bits``), and ``n`` floats from ``jax.random.uniform`` (threefry);
* ``prefix_sum``: the inclusive prefix sum of ``n`` int32, ``compact._cumsum_i32`` (a sequential
  ``lax.scan``) against ``jnp.cumsum`` (an associative scan on XLA:CPU): run time, and the time
  to lower and compile each program;
* ``class_ranks``: INCEPTIONN's per-class ranks of ``n`` tags in ``{0, 1, 2, 3}``,
  ``compact.class_ranks`` (the three class counters packed into 10-bit fields of one int32,
  one prefix sum per block of 512) against the same blocks with three prefix sums, one per class;
* ``code_packing``: ``n`` codes of 2 and 4 bits in bytes, the plane-major layout of
  ``bitpack.pack_codes`` (code ``i`` in byte ``i mod B``) against the interleaved layout of
  ``bitpack.pack`` (code ``i`` in byte ``i div m``), each encoded and decoded;
* ``top_k 0.1%`` and ``top_k 1%``: the exact top-k by magnitude of ``m`` float32 (each of
  ``--select-sizes``), ``select.top_by_float_view`` (one ``lax.top_k`` of the order keys viewed as
  float32: the CPU's body up to ``select.CPU_PRIMITIVE_MAX`` keys) against the sampled threshold
  (``select.top_indices`` with ``primitive_max=0``: the CPU's body above it); the ratio is sampled /
  float view, so above 1 the float view is faster at that size.

Every kernel is jitted and checked against its alternative's result (equal outputs, or a round
trip for the packings). Then, with ``compressors.py``'s timer (rounds of a, A, b, B: the second
call of each timed; ``--repeats`` rounds; medians):

* each kernel interleaved with the memory pass ``2x + 1`` over ``n`` float32 (``compressors.py``'s
  reference): its median time, ns per element, and ``passes`` = its median / the pass's;
* each comparison's two kernels interleaved with each other: ``alternative / kernel``, the ratio
  of their medians (above 1: the kernel the library uses is faster), of wall and of process CPU
  time, and for the prefix sums of their compile times.

usage: python experiments/benchmarks/kernels.py [--n 4194304] [--prefix-sizes 65536,4194304]
       [--select-sizes 9216,36864,65536,147456,589824] [--comparisons random_bits,...,top_k]
       [--repeats 15] [--compile-repeats 3] [--smoke] [--out experiments/benchmarks/results/kernels_cpu.json]
       python experiments/benchmarks/kernels.py --markdown experiments/benchmarks/results/kernels_cpu.json
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
from pathlib import Path

os.environ.setdefault("JAX_PLATFORMS", "cpu")

import jax
import jax.numpy as jnp
import numpy as np

from jaxcomm._paths import check_output_path
from jaxcomm.compressors._kernels import bitpack, compact, random_bits, select

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))
from compressors import machine_info, reference_fn, time_interleaved  # noqa: E402

SMOKE = dict(n=4096, prefix_sizes=[1024], select_sizes=[4096], repeats=2, compile_repeats=1)
"""A tiny run: the plumbing only (the timings are noise at this size)."""

WIDTHS = (2, 4)
SELECT_RATIOS = (0.001, 0.01)
FAMILIES = ("random_bits", "prefix_sum", "class_ranks", "code_packing", "top_k")
"""The values of ``--comparisons``: each names the comparisons whose name starts with it."""


def ranks_three_prefix_sums(tags):
    """:func:`compact.class_ranks` with one prefix sum per class: the same blocks of 512 and block
    offsets, the three counters in three int32 arrays instead of packed into one."""
    d = tags.shape[0]
    block = min(compact._RANK_BLOCK, max(d, 1))
    t = jnp.pad(tags.astype(jnp.int32), (0, -(-d // block) * block - d)).reshape(-1, block)
    out = jnp.zeros_like(t)
    for c in (1, 2, 3):
        unit = (t == c).astype(jnp.int32)
        inclusive = jnp.cumsum(unit, axis=1)
        row_total = inclusive[:, -1]
        offset = compact.materialize(jnp.cumsum(row_total) - row_total)[:, None]
        out = jnp.where(t == c, inclusive - unit + offset, out)
    return out.reshape(-1)[:d]


def selection_cases(sizes) -> list[dict]:
    """The exact top-k of ``m`` normal float32 for every ``m`` in ``sizes`` and every ratio of
    :data:`SELECT_RATIOS`: the float view of the keys against the sampled threshold."""
    key = jax.random.PRNGKey(0)
    out = []
    for m in sizes:
        x = jnp.asarray(np.random.default_rng(m).standard_normal(m, dtype=np.float32))
        for ratio in SELECT_RATIOS:
            k = max(1, round(ratio * m))
            bodies = {
                "float view": lambda v, k=k: select.top_by_float_view(select.magnitude_keys(v), jnp.int32(k), k),
                "sampled threshold": lambda v, k=k: select.top_indices(
                    v, k, key, keys_of=select.magnitude_keys, primitive_max=0
                )[0],
            }
            out += [
                dict(
                    comparison=f"top_k {100 * ratio:g}%",
                    kernel=name,
                    n=m,
                    fn=jax.jit(f),
                    args=(x,),
                    same_as="sampled threshold",
                )
                for name, f in bodies.items()
            ]
    return out


def cases(n: int, prefix_sizes, select_sizes=()) -> list[dict]:
    """Every kernel: its comparison, name, jitted function and argument, and the check of its result."""
    rng = np.random.default_rng(0)
    key = jax.random.PRNGKey(0)
    tags = jnp.asarray(rng.integers(0, 4, n, dtype=np.int32))
    out = [
        dict(comparison="random_bits", kernel=name, n=n, fn=jax.jit(f), args=(key,))
        for name, f in (
            ("murmur3", lambda k: random_bits.uniform_bits(k, n, "murmur3")),
            ("lowbias32", lambda k: random_bits.uniform_bits(k, n, "lowbias32")),
            ("threefry", lambda k: jax.random.bits(k, (n,), jnp.uint32)),
            ("threefry_uniform", lambda k: jax.random.uniform(k, (n,), jnp.float32)),
        )
    ]
    for m in prefix_sizes:
        a = jnp.asarray(rng.integers(0, 4, m, dtype=np.int32))
        out += [
            dict(comparison="prefix_sum", kernel=name, n=m, fn=jax.jit(f), args=(a,), same_as="jnp.cumsum")
            for name, f in (("lax.scan", compact._cumsum_i32), ("jnp.cumsum", lambda v: jnp.cumsum(v)))
        ]
    out += [
        dict(comparison="class_ranks", kernel=name, n=n, fn=jax.jit(f), args=(tags,), same_as="three prefix sums")
        for name, f in (("one packed prefix sum", compact.class_ranks), ("three prefix sums", ranks_three_prefix_sums))
    ]
    for w in WIDTHS:
        codes = jnp.asarray(rng.integers(0, 1 << w, n, dtype=np.uint8))
        layouts = {
            "planar": (lambda c, w=w: bitpack._planar_pack(c, w), lambda p, w=w: bitpack._planar_unpack(p, w, n)),
            "interleaved": (lambda c, w=w: bitpack.pack(c, w), lambda p, w=w: bitpack.unpack(p, w, n)),
        }
        for layout, (enc, dec) in layouts.items():
            packed = jax.jit(enc)(codes)
            comparison = f"code_packing_{w}bit"
            out.append(dict(comparison=comparison, kernel=f"{layout} encode", n=n, fn=jax.jit(enc), args=(codes,)))
            out.append(
                dict(
                    comparison=comparison, kernel=f"{layout} decode", n=n, fn=jax.jit(dec), args=(packed,), codes=codes
                )
            )
    return out + selection_cases(select_sizes)


def check(case: dict, results: dict) -> None:
    """Raise unless the kernel's output equals its alternative's (a decode: the codes it was packed from)."""
    got = np.asarray(case["fn"](*case["args"]))
    if "codes" in case and not np.array_equal(got, np.asarray(case["codes"])):
        raise AssertionError(f"{case['kernel']} ({case['n']} codes) does not give back its codes")
    other = results.get((case["comparison"], case.get("same_as"), case["n"]))
    if case.get("same_as") and other is not None and not np.array_equal(got, other):
        raise AssertionError(f"{case['comparison']}: {case['kernel']} differs from {case['same_as']} at n={case['n']}")
    results[(case["comparison"], case["kernel"], case["n"])] = got


def compile_seconds(fn, args, repeats: int) -> float:
    """Median wall seconds to lower and compile ``fn`` for ``args`` (a fresh compilation each time)."""
    times = []
    for _ in range(repeats):
        jax.clear_caches()
        t0 = time.perf_counter()
        fn.lower(*args).compile()
        times.append(time.perf_counter() - t0)
    return float(np.median(times))


COMPARISONS = [
    # (comparison, the alternative, the library's kernel): the ratio is alternative / kernel
    ("random_bits", "threefry", "murmur3"),
    ("random_bits", "threefry", "lowbias32"),
    ("prefix_sum", "jnp.cumsum", "lax.scan"),
    ("class_ranks", "three prefix sums", "one packed prefix sum"),
    *[(f"code_packing_{w}bit", f"interleaved {op}", f"planar {op}") for w in WIDTHS for op in ("decode", "encode")],
    *[(f"top_k {100 * r:g}%", "sampled threshold", "float view") for r in SELECT_RATIOS],
]


def measure(
    n: int, prefix_sizes, repeats: int, compile_repeats: int, select_sizes=(), comparisons=FAMILIES
) -> tuple[list[dict], list[dict]]:
    """Every kernel against the memory pass over its ``n`` (median seconds, ns per element, passes),
    and every comparison's two kernels interleaved with each other (their ratio); only the comparisons
    whose name starts with one of ``comparisons``."""
    all_cases = [c for c in cases(n, prefix_sizes, select_sizes) if c["comparison"].startswith(tuple(comparisons))]
    outputs: dict = {}
    for case in sorted(all_cases, key=lambda c: c["kernel"] != c.get("same_as")):  # alternatives first
        check(case, outputs)
    rows, refs = [], {}
    for case in all_cases:
        m = case["n"]
        if m not in refs:
            refs[m] = (reference_fn(), (jnp.asarray(np.random.default_rng(1).standard_normal(m, dtype=np.float32)),))
        t = time_interleaved(case["fn"], case["args"], refs[m][0], refs[m][1], repeats)
        row = dict(comparison=case["comparison"], kernel=case["kernel"], n=m, **t)
        row["passes"] = row.pop("ratio")
        row["ns_per_element"] = 1e9 * t["median_s"] / m
        if case["comparison"] == "prefix_sum":
            row["compile_s"] = compile_seconds(case["fn"], case["args"], compile_repeats)
        rows.append(row)
        print(f"{row['comparison']:18s} {row['kernel']:22s} n={m:>9,d}: {row['ns_per_element']:7.2f} ns/element, "
              f"{row['passes']:6.2f} passes", flush=True)  # fmt: skip
    by = {(c["comparison"], c["kernel"], c["n"]): c for c in all_cases}
    compiled = {(r["kernel"], r["n"]): r["compile_s"] for r in rows if "compile_s" in r}
    pairs = []
    for comparison, slower, faster in COMPARISONS:
        if not comparison.startswith(tuple(comparisons)):
            continue
        for m in sorted({c["n"] for c in all_cases if c["comparison"] == comparison}):
            s, f = by[(comparison, slower, m)], by[(comparison, faster, m)]
            t = time_interleaved(s["fn"], s["args"], f["fn"], f["args"], repeats)
            pair = dict(comparison=comparison, slower=slower, faster=faster, n=m, ratio=t["ratio"])
            pair.update(slower_median_s=t["median_s"], faster_median_s=t["ref_median_s"], cpu_ratio=t["cpu_ratio"])
            if (slower, m) in compiled:
                pair["compile_ratio"] = compiled[(slower, m)] / compiled[(faster, m)]
            pairs.append(pair)
    return rows, pairs


def markdown_table(res: dict) -> str:
    """The kernels' table and the comparisons' table of a results file."""
    lines = [
        "| comparison | kernel | n | ns / element | passes of `2x + 1` | compile (s) |",
        "|---|---|---:|---:|---:|---:|",
    ]
    for r in res["results"]:
        comp = f"{r['compile_s']:.3f}" if "compile_s" in r else ""
        cells = [r["comparison"], r["kernel"], f"{r['n']:,}", f"{r['ns_per_element']:.2f}", f"{r['passes']:.2f}", comp]
        lines.append(f"| {' | '.join(cells)} |")
    lines += ["", "| comparison | n | run time: alternative / kernel | CPU time | compile time |"]
    lines.append("|---|---:|---:|---:|---:|")
    for c in res["ratios"]:
        comp = f"{c['compile_ratio']:.1f}x" if "compile_ratio" in c else ""
        name = f"{c['comparison']}: {c['slower']} / {c['faster']}"
        lines.append(f"| {name} | {c['n']:,} | {c['ratio']:.1f}x | {c['cpu_ratio']:.1f}x | {comp} |")
    return "\n".join(lines)


def main(argv=None) -> dict:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--n", type=int, default=4194304, help="entries of every kernel but the prefix sums")
    ap.add_argument("--prefix-sizes", default="65536,4194304", help="entries of the prefix sums (comma-separated)")
    ap.add_argument(
        "--select-sizes",
        default="9216,36864,65536,147456,589824",
        help="entries of the top-k selections (comma-separated)",
    )
    ap.add_argument("--comparisons", default=",".join(FAMILIES), help=f"which to run, from {', '.join(FAMILIES)}")
    ap.add_argument("--repeats", type=int, default=15)
    ap.add_argument("--compile-repeats", type=int, default=3)
    ap.add_argument("--smoke", action="store_true", help=f"a tiny run: {SMOKE}")
    ap.add_argument("--out", default="experiments/benchmarks/results/kernels_cpu.json")
    ap.add_argument("--markdown", metavar="JSON", help="print the tables of a results file and exit")
    args = ap.parse_args(argv)
    if args.markdown:
        print(markdown_table(json.loads(Path(args.markdown).read_text())))
        return {}
    sizes = {}
    for flag in ("prefix_sizes", "select_sizes"):
        try:
            sizes[flag] = [int(s) for s in getattr(args, flag).split(",") if s]
        except ValueError:
            ap.error(f"--{flag.replace('_', '-')}: comma-separated integers; got {getattr(args, flag)!r}")
    prefix_sizes, select_sizes = sizes["prefix_sizes"], sizes["select_sizes"]
    if args.n < 1 or not prefix_sizes or min(prefix_sizes) < 1:
        ap.error("--n and every --prefix-sizes entry must be >= 1")
    if not select_sizes or min(select_sizes) <= select.SMALL:
        ap.error(
            f"every --select-sizes entry must be > {select.SMALL} (smaller vectors are sorted); got {select_sizes}"
        )
    comparisons = [c for c in args.comparisons.split(",") if c]
    if not comparisons or set(comparisons) - set(FAMILIES):
        ap.error(f"--comparisons: comma-separated names from {', '.join(FAMILIES)}; got {args.comparisons!r}")
    if args.repeats < 1 or args.compile_repeats < 1:
        ap.error("--repeats and --compile-repeats must be >= 1")
    try:
        path = check_output_path(args.out, "--out", folder=False)
    except ValueError as e:
        ap.error(str(e))
    config = (
        SMOKE
        if args.smoke
        else dict(
            n=args.n,
            prefix_sizes=prefix_sizes,
            select_sizes=select_sizes,
            repeats=args.repeats,
            compile_repeats=args.compile_repeats,
        )
    )
    config = dict(config, comparisons=comparisons)
    out = {
        "meta": {
            "benchmark": "kernels",
            "command": " ".join(
                ["python", "experiments/benchmarks/kernels.py", *(argv if argv is not None else sys.argv[1:])]
            ),
            "machine": machine_info(),
            "load_average_at_start": list(os.getloadavg()),
            "threefry_partitionable": bool(jax.config.jax_threefry_partitionable),
            "timing": "each kernel interleaved with the memory pass 2x + 1 over n float32 (ref, REF, kernel, KERNEL; "
            "the second call of each timed); medians; passes = kernel / pass",
            **config,
        },
    }
    out["results"], out["ratios"] = measure(**config)
    out["meta"]["load_average_at_end"] = list(os.getloadavg())
    path.write_text(json.dumps(out, indent=2) + "\n")
    print(f"{markdown_table(out)}\n\nwrote {path}")
    return out


if __name__ == "__main__":
    main()
