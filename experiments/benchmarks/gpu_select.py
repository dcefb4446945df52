"""The accelerator top-k bodies side by side, on whatever device jax finds.

Exact top-``k`` of the magnitudes of ``x`` (``k = round(density d)``, ``x ~ N(0, 1)``
float32 on the device) with the two bodies that ``top_indices`` lowers for ``cuda``,
``rocm`` and ``tpu`` (``jaxcomm/compressors/_kernels/select.py``):

* ``old``: ``top_by_primitive``, one ``lax.top_k`` over all ``d`` keys (a sort of the
  keys and their positions on a GPU), then a sort of the ``k`` winners;
* ``new``: ``top_by_threshold``, a threshold from a sample of the keys, one counting
  pass, ``jnp.nonzero`` of the candidates, ``lax.top_k`` among them (``lax.top_k``
  over all keys when the count falls outside ``[k, C]``).

Both are called directly, so ``new`` is timed at every size whatever
``ACCELERATOR_SAMPLED_MIN`` says; their indices are compared on every input
(``identical``) and ``new``'s branch is recorded (``new_path``: ``sampled`` or the
``top_k`` fallback). Then the whole ``topk`` and ``randomk`` compressors'
``decompress(compress(x, key))``, each traced twice: once as the library lowers it
(``lib``), once with the selection forced to ``old`` (``ACCELERATOR_SAMPLED_MIN`` raised
while tracing). ``--crossover-sizes`` times the two bodies alone at smaller sizes
(density 1 %), to place ``ACCELERATOR_SAMPLED_MIN``.

Timing: every function is compiled and called ``--warmup`` times first; then
``--calls`` rounds, each calling every function of the case once (the order rotating
by round), each call waited for with ``block_until_ready``; reported are the medians
(ms) and the ratio ``old / new``. A call's time includes jax's dispatch (about 0.1 ms
on an H100). ``first_call_s``: each function's first call (tracing, compiling, one run).

usage: python experiments/benchmarks/gpu_select.py [--sizes 2621440,26214400] [--densities 0.01,0.001]
       [--crossover-sizes 131072,262144,524288,1048576] [--calls 20] [--warmup 3]
       [--out experiments/benchmarks/results/gpu_select.json] [--smoke]
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import platform
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))  # the repository: `jaxcomm`

import jax
import jax.numpy as jnp
import numpy as np

import jaxcomm as jc
from jaxcomm.compressors._kernels import select as S
from jaxcomm.compressors._sparse import num_selected

DEFAULT_SIZES = (2_621_440, 26_214_400)
DEFAULT_DENSITIES = (0.01, 0.001)
DEFAULT_CROSSOVER = (131_072, 262_144, 524_288, 1_048_576)
DEFAULT_OUT = Path(__file__).resolve().parent / "results" / "gpu_select.json"
SMOKE = dict(sizes=(4_096,), densities=(0.01,), crossover=(), compressor_sizes=(2_048,), calls=20, warmup=1)
"""``--smoke``: the bodies where ``new`` samples; the compressors at ``SMALL`` entries (a sort on every platform,
cheap to compile on a CPU; the switch to ``old`` changes nothing there)."""
PATHS = {S.PATH_SAMPLED: "sampled", S.PATH_PRIMITIVE: "top_k fallback"}


@contextlib.contextmanager
def old_selection():
    """Inside: ``top_indices`` lowers ``top_by_primitive`` for an accelerator at every size (trace-time switch)."""
    saved = S.ACCELERATOR_SAMPLED_MIN
    S.ACCELERATOR_SAMPLED_MIN = 2**62
    try:
        yield
    finally:
        S.ACCELERATOR_SAMPLED_MIN = saved


def bodies(k: int):
    """The two selection bodies on magnitudes, jitted: ``(x, key) -> indices`` (``new`` also its path)."""
    old = jax.jit(lambda x, key: S.top_by_primitive(S.magnitude_keys(x), jnp.int32(k), k))
    new = jax.jit(lambda x, key: S.top_by_threshold(x, k, key, keys_of=S.magnitude_keys))
    return old, new


def compressor_fns(name: str, density: float, x, key):
    """``({lib, old}, first-call seconds of each)``: ``decompress(compress(x, key))`` of one compressor as the
    library lowers it and with the ``old`` selection; both traced and compiled here (the first call's time
    is tracing, compiling and one run)."""
    c = jc.compressors.make(name, ratio=density)
    fns, first = {}, {}
    for which in ("lib", "old"):
        fn = jax.jit(lambda x, key, c=c: c.decompress(c.compress(x, key)[0]))
        t0 = time.perf_counter()
        with old_selection() if which == "old" else contextlib.nullcontext():
            jax.block_until_ready(fn(x, key))  # traced and compiled under the switch; later calls reuse it
        first[which] = time.perf_counter() - t0
        fns[which] = fn
    return fns, first


def time_rounds(fns: dict, args, calls: int, warmup: int) -> dict:
    """Median ms per call of each function, interleaved: ``calls`` rounds, each calling every function once
    (order rotating), after ``warmup`` calls each."""
    names = list(fns)
    for name in names:
        for _ in range(warmup):
            jax.block_until_ready(fns[name](*args))
    times = {n: [] for n in names}
    for r in range(calls):
        order = names[r % len(names) :] + names[: r % len(names)]
        for name in order:
            t0 = time.perf_counter()
            jax.block_until_ready(fns[name](*args))
            times[name].append(time.perf_counter() - t0)
    return {n: 1e3 * float(np.median(t)) for n, t in times.items()}


def select_case(d: int, density: float, calls: int, warmup: int, seed: int = 0) -> dict:
    """One size and density: the two bodies timed and compared."""
    k = num_selected(density, d)
    x = jax.random.normal(jax.random.PRNGKey(seed), (d,), jnp.float32)
    key = jax.random.PRNGKey(seed + 1)
    old, new = bodies(k)
    first = {}
    t0 = time.perf_counter()
    idx_old = np.asarray(old(x, key))
    first["old"] = time.perf_counter() - t0
    t0 = time.perf_counter()
    idx_new, path = jax.block_until_ready(new(x, key))
    first["new"] = time.perf_counter() - t0
    plan = S._sample_plan(d, k, S._MARGIN)
    ms = time_rounds({"old": old, "new": new}, (x, key), calls, warmup)
    return dict(
        d=d,
        density=density,
        k=k,
        capacity=plan[2] if plan else None,
        sample=plan[0] if plan else None,
        identical=bool(np.array_equal(idx_old, np.asarray(idx_new))),
        new_path=PATHS.get(int(path), int(path)),
        old_ms=ms["old"],
        new_ms=ms["new"],
        old_over_new=ms["old"] / ms["new"],
        first_call_s=first,
    )


def compressor_case(name: str, d: int, density: float, calls: int, warmup: int, seed: int = 0) -> dict:
    """One compressor, size and density: its round trip as lowered by the library and with the old body."""
    x = jax.random.normal(jax.random.PRNGKey(seed), (d,), jnp.float32)
    key = jax.random.PRNGKey(seed + 1)
    fns, first = compressor_fns(name, density, x, key)
    same = bool(np.array_equal(np.asarray(fns["lib"](x, key)), np.asarray(fns["old"](x, key))))
    ms = time_rounds(fns, (x, key), calls, warmup)
    return dict(
        name=name,
        d=d,
        density=density,
        identical=same,
        lib_ms=ms["lib"],
        old_ms=ms["old"],
        old_over_lib=ms["old"] / ms["lib"],
        lib_selection="new" if d >= S.ACCELERATOR_SAMPLED_MIN else "old",
        first_call_s=first,
    )


def main(argv=None) -> dict:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--sizes", default=",".join(map(str, DEFAULT_SIZES)))
    ap.add_argument("--densities", default=",".join(map(str, DEFAULT_DENSITIES)))
    ap.add_argument("--crossover-sizes", default=",".join(map(str, DEFAULT_CROSSOVER)))
    ap.add_argument("--calls", type=int, default=20)
    ap.add_argument("--warmup", type=int, default=3)
    ap.add_argument("--out", default=str(DEFAULT_OUT))
    ap.add_argument("--smoke", action="store_true", help="tiny sizes on any device: the plumbing only")
    args = ap.parse_args(argv)
    try:
        sizes = [int(s) for s in args.sizes.split(",") if s]
        densities = [float(s) for s in args.densities.split(",") if s]
        crossover = [int(s) for s in args.crossover_sizes.split(",") if s]
    except ValueError as e:
        ap.error(f"--sizes, --densities, --crossover-sizes: comma-separated numbers ({e})")
    compressor_sizes = sizes
    if args.smoke:
        sizes, densities, crossover = SMOKE["sizes"], SMOKE["densities"], SMOKE["crossover"]
        compressor_sizes = SMOKE["compressor_sizes"]
        args.calls, args.warmup = SMOKE["calls"], SMOKE["warmup"]
    if args.calls < 20 or args.warmup < 1:
        ap.error("--calls must be >= 20 and --warmup >= 1")
    if not sizes or any(d <= 0 for d in [*sizes, *crossover]):
        ap.error("--sizes: at least one positive size; --crossover-sizes: positive sizes")
    if not densities or any(not 0 < p < 1 for p in densities):
        ap.error("--densities: at least one, each in (0, 1)")
    t_start = time.perf_counter()
    dev = jax.devices()[0]
    out = {
        "meta": {
            "benchmark": "gpu_select",
            "command": " ".join(["python", "experiments/benchmarks/gpu_select.py", *(argv or sys.argv[1:])]),
            "smoke": args.smoke,
            "jax": jax.__version__,
            "backend": jax.default_backend(),
            "device": str(dev),
            "device_kind": dev.device_kind,
            "platform": platform.platform(),
            "host_cpus": os.cpu_count(),
            "accelerator_sampled_min": S.ACCELERATOR_SAMPLED_MIN,
            "timing": f"medians of {args.calls} interleaved calls each (order rotating) after {args.warmup} "
            "warm-up calls, each waited for with block_until_ready",
            "calls": args.calls,
            "warmup": args.warmup,
        },
        "select": [],
        "crossover": [],
        "compressors": [],
    }
    for d in sizes:
        for p in densities:
            r = select_case(d, p, args.calls, args.warmup)
            out["select"].append(r)
            print(
                f"select d={d:>10,d} k={r['k']:>8,d}: old {r['old_ms']:8.3f} ms  new {r['new_ms']:8.3f} ms  "
                f"old/new {r['old_over_new']:5.2f}  identical {r['identical']}  new path {r['new_path']}",
                flush=True,
            )
    for d in crossover:
        r = select_case(d, 0.01, args.calls, args.warmup)
        out["crossover"].append(r)
        print(
            f"crossover d={d:>10,d}: old {r['old_ms']:8.3f} ms  new {r['new_ms']:8.3f} ms  "
            f"old/new {r['old_over_new']:5.2f}  identical {r['identical']}  new path {r['new_path']}",
            flush=True,
        )
    for name in ("topk", "randomk"):
        for d in compressor_sizes:
            for p in densities:
                r = compressor_case(name, d, p, args.calls, args.warmup)
                out["compressors"].append(r)
                print(
                    f"{name:8s} d={d:>10,d} density {p:g}: lib {r['lib_ms']:8.3f} ms  old {r['old_ms']:8.3f} ms  "
                    f"old/lib {r['old_over_lib']:5.2f}  identical {r['identical']}",
                    flush=True,
                )
    out["identical"] = all(r["identical"] for part in ("select", "crossover", "compressors") for r in out[part])
    out["meta"]["wall_s"] = time.perf_counter() - t_start
    path = Path(args.out)
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(out, indent=2) + "\n")
    print(f"identical: {str(out['identical']).lower()}; {out['meta']['wall_s']:.0f} s; wrote {path}")
    return out


if __name__ == "__main__":
    main()
