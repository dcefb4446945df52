"""GRACE's PyTorch compressors and jaxcomm's, compress + decompress, timed side by side in one run.

For each method of GRACE Fig. 8 (below) and each size (default 2,621,440 and
26,214,400 float32 entries = 10 and 100 MiB), this times, on the same standard
normal data:

* GRACE: ``decompress(*compress(x, name))`` of the compressor class from a
  user's GRACE checkout (``grace_dl.dist.compressor.*``, imported from
  ``--grace PATH``), one call per timing, as GRACE's training loop calls it
  (compressor only; the error-feedback memories are separate classes in GRACE);
* jaxcomm: one jitted ``decompress(compress(x, key))`` of the registered
  compressor (the call of ``compressors.py``);
* the memory pass of each framework, ``2 x + 1`` (reads and writes ``d``
  floats): jitted in JAX, ``torch.add(1, x, alpha=2)`` (one kernel) in PyTorch.

The four operations run in interleaved rounds, so that changes in machine load
hit all alike; in each round each operation is called twice and the second
call is timed (its steady state; see ``compressors.py``). Medians of
``--repeats`` rounds after one warm-up call each. Each framework's time is also
given as a ratio to its own memory pass, and the achieved memory bandwidth of
each pass (``8 d`` bytes read + written / its time) is recorded; on a GPU it is
to be compared with the HBM bandwidth.

PowerSGD (rank 1) compresses matrices only: at each size it runs on the
near-square matrix of that many entries (the largest ``n <= sqrt(d)`` dividing
``d``: 1280 x 2048 at 10 MiB, 5120 x 5120 at 100 MiB), with GRACE's
``PowerSGDCompressor(rank=1, use_memory=False, world_size=1)``, whose two
``all_reduce`` calls run on a one-process group (gloo on the CPU, NCCL on a GPU)
over an in-process store, with gloo bound to the loopback interface.

Methods (GRACE class and settings -> jaxcomm compressor): TopK 1 %
(``TopKCompressor(0.01)`` -> ``topk(ratio=0.01)``), QSGD 64
(``QSGDCompressor(64)``, buckets of 128 -> ``qsgd(levels=64)``), SignSGD, TernGrad,
DGC 1 % (``DgcCompressor(0.01)`` -> ``dgc(ratio=0.01)``), RandomK 1 % twice
(``randomk``: jaxcomm's default k-subset without replacement; ``randomk_replacement``:
``randomk(ratio=0.01, replacement=True)``, GRACE's own sampling with ``torch.randint``,
the row the targets use), OneBit, EFSignSGD (``lr=0.1``, used only by its aggregate),
FP16 and PowerSGD rank 1.

Targets, each framework's time taken as a ratio to its own memory
pass measured in the same run, the speedup being ``(GRACE / torch pass) /
(jaxcomm / jax pass)``: geometric-mean speedup >= 5x at 10 MiB and at 100 MiB;
no method slower than GRACE (speedup >= 1) at either size; jaxcomm's PowerSGD
rank 1 on 1280 x 2048 <= 4x the jax memory pass. The raw speedup (GRACE ms /
jaxcomm ms) is reported beside it.

Setup on the CPU (torch is not a jaxcomm dependency; a CPU build in its own
venv, which also sees the project venv's packages through a .pth file)::

    python3 -m venv /work/torchenv && /work/torchenv/bin/pip install torch
    echo "import site; site.addsitedir('$PWD/.venv/lib/python3.11/site-packages')" \\
        > /work/torchenv/lib/python3.11/site-packages/zz_project_venv.pth
    PYTHONPATH=. /work/torchenv/bin/python experiments/benchmarks/grace_compare.py --grace PATH

where PATH is the root of a GRACE checkout (github.com/sands-lab/grace; the
folder holding ``grace_dl/``), also taken from ``GRACE_PATH``. ``--grace none``
times jaxcomm and the jax memory pass only (no torch needed). On a GPU:
``--device cuda`` (torch on ``cuda``, jax on its GPU backend).

Threads: on a CPU, torch's operations run on ``torch.get_num_threads()``
OpenMP threads and XLA's on its own thread pool (both recorded). On a machine
whose cores are oversubscribed by other processes, an OpenMP parallel region
can take tens of times longer than the same work on one thread; there
``--torch-threads 1`` gives torch its single-thread speed (the memory pass
shows the effect: compare its GB/s with the jax pass's).

usage: python experiments/benchmarks/grace_compare.py --grace PATH|none [--device cpu|cuda]
       [--torch-threads N] [--sizes 2621440,26214400] [--repeats 10] [--only topk,qsgd]
       [--out experiments/benchmarks/results/grace_compare.json] | --markdown JSON
"""

from __future__ import annotations

import argparse
import importlib
import importlib.util
import json
import math
import os
import subprocess
import sys
import time
import warnings
from pathlib import Path


def _device_from_argv(argv) -> str:
    """``--device``'s value on the command line (default ``cpu``), read before jax is imported."""
    for i, a in enumerate(argv):
        if a == "--device" and i + 1 < len(argv):
            return argv[i + 1]
        if a.startswith("--device="):
            return a.split("=", 1)[1]
    return "cpu"


if __name__ == "__main__":  # the platform is fixed when jax is imported; an explicit JAX_PLATFORMS wins
    os.environ.setdefault("JAX_PLATFORMS", {"cuda": "cuda"}.get(_device_from_argv(sys.argv[1:]), "cpu"))
    if _device_from_argv(sys.argv[1:]) == "cuda":
        os.environ.setdefault("XLA_PYTHON_CLIENT_PREALLOCATE", "false")  # leave GPU memory to torch too

import jax  # noqa: E402  (after the platform choice above)
import numpy as np  # noqa: E402

import jaxcomm as jc  # noqa: E402

try:
    from tqdm import tqdm
except ImportError:  # pragma: no cover - tqdm is a project dependency

    def tqdm(it, **_):
        return it


def _load_compressors_bench():
    """``compressors.py`` beside this file: its KWARGS, reference pass, round trip and wire bits."""
    spec = importlib.util.spec_from_file_location(
        "_grace_compare_compressors", Path(__file__).with_name("compressors.py")
    )
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


bench = _load_compressors_bench()

DEFAULT_SIZES = (2_621_440, 26_214_400)
DEFAULT_OUT = Path(__file__).resolve().parent / "results" / "grace_compare.json"
# method -> (GRACE label, jaxcomm name, GRACE module, GRACE class, GRACE constructor kwargs)
METHODS = {
    "topk": ("TopK 1%", "topk", "topk", "TopKCompressor", dict(compress_ratio=0.01)),
    "qsgd": ("QSGD 64", "qsgd", "qsgd", "QSGDCompressor", dict(quantum_num=64)),
    "signsgd": ("SignSGD", "signsgd", "signsgd", "SignSGDCompressor", {}),
    "terngrad": ("TernGrad", "terngrad", "terngrad", "TernGradCompressor", {}),
    "dgc": ("DGC 1%", "dgc", "dgc", "DgcCompressor", dict(compress_ratio=0.01)),
    "randomk": (
        "RandomK 1% (jaxcomm: without replacement)",
        "randomk",
        "randomk",
        "RandomKCompressor",
        dict(compress_ratio=0.01),
    ),
    "randomk_replacement": (
        "RandomK 1% (with replacement)",
        "randomk",
        "randomk",
        "RandomKCompressor",
        dict(compress_ratio=0.01),
    ),
    "onebit": ("OneBit", "onebit", "onebit", "OneBitCompressor", {}),
    "efsignsgd": ("EFSignSGD", "efsignsgd", "efsignsgd", "EFSignSGDCompressor", dict(lr=0.1)),
    "fp16": ("FP16", "fp16", "fp16", "FP16Compressor", {}),
    "powersgd": (
        "PowerSGD r1",
        "powersgd",
        "powersgd",
        "PowerSGDCompressor",
        dict(rank=1, use_memory=False, world_size=1),
    ),
}
# jaxcomm settings beyond compressors.py's for the same compressor.
JAX_KWARGS = {"randomk_replacement": dict(replacement=True)}
# The methods the targets are judged on, one per GRACE method: GRACE's RandomK draws its positions
# with replacement (torch.randint), and so does randomk(replacement=True). jaxcomm's default random-k
# (a k-subset, without replacement: another sampling) is timed beside it and reported apart.
TARGET_METHODS = tuple(m for m in METHODS if m != "randomk")
TARGET_SIZES = (2_621_440, 26_214_400)
GMEAN_TARGET = 5.0
POWERSGD_TARGET = (1280, 2048), 4.0


class UsageError(SystemExit):
    """One clear line on stderr and exit status 2 (argparse's convention)."""

    def __init__(self, msg: str):
        print(f"grace_compare.py: error: {msg}", file=sys.stderr)
        super().__init__(2)
        self.msg = msg

    def __str__(self):
        return self.msg


def jax_kwargs(method: str) -> dict:
    """The jaxcomm settings: compressors.py's (GRACE Fig. 8's) for the same compressor."""
    return dict(bench.KWARGS.get(METHODS[method][1], {}), **JAX_KWARGS.get(method, {}))


def matrix_shape(d: int) -> tuple[int, int]:
    """The near-square ``(n, d // n)``, ``n`` the largest divisor of ``d`` with ``n <= sqrt(d)``."""
    n = next(k for k in range(math.isqrt(d), 0, -1) if d % k == 0)
    return n, d // n


def load_grace(path: str):
    """Import torch and ``grace_dl`` from the checkout at ``path``; one clear line if either is missing."""
    root = Path(path).expanduser()
    if not (root / "grace_dl" / "dist" / "compressor").is_dir():
        raise UsageError(
            f"--grace {path!r}: no grace_dl/dist/compressor/ there; give the root of a GRACE checkout "
            "(github.com/sands-lab/grace), or --grace none to time jaxcomm alone"
        )
    try:
        import torch
    except ImportError as e:
        raise UsageError(f"--grace needs PyTorch in this Python ({sys.executable}): {e}; or --grace none") from e
    sys.path.insert(0, str(root.resolve()))
    importlib.import_module("grace_dl.dist")
    return torch


class Torch:
    """The PyTorch side on one device: GRACE's compressors, the memory pass and the synchronisation."""

    def __init__(self, torch, device: str):
        self.torch, self.device = torch, device
        if device == "cuda" and not torch.cuda.is_available():
            raise UsageError("--device cuda: torch sees no CUDA device")
        self._one = torch.ones((), dtype=torch.float32, device=device)
        self._group = False
        self.backend = None  # of the one-process group, once GRACE's PowerSGD needs it

    def sync(self, out=None):
        if self.device == "cuda":
            self.torch.cuda.synchronize()
        return out

    def tensor(self, x_np: np.ndarray):
        return self.torch.from_numpy(x_np.copy()).to(self.device)

    def reference(self, x):
        """``2 x + 1`` in one kernel: ``1 + 2 * x`` (reads and writes ``d`` floats)."""
        return self.torch.add(self._one, x, alpha=2.0)

    def ensure_group(self):
        """A one-process group for the ``all_reduce`` calls inside GRACE's PowerSGD (loopback only)."""
        dist = self.torch.distributed
        if self._group or dist.is_initialized():
            return
        os.environ.setdefault("GLOO_SOCKET_IFNAME", "lo")
        backends = ["nccl", "gloo"] if self.device == "cuda" and dist.is_nccl_available() else ["gloo"]
        for i, backend in enumerate(backends):
            try:
                dist.init_process_group(backend, store=dist.HashStore(), rank=0, world_size=1)
                self.backend = backend
                break
            except Exception:  # NCCL unusable here: gloo (which also reduces CUDA tensors)
                if i + 1 == len(backends):
                    raise
        self._group = True

    def close(self):
        if self._group:
            self.torch.distributed.destroy_process_group()
            self._group = False

    def roundtrip(self, method: str):
        """GRACE's ``decompress(*compress(x, name))`` for ``method``, one call per timing."""
        _, _, module, cls, kwargs = METHODS[method]
        if method == "powersgd":
            self.ensure_group()
        with warnings.catch_warnings():  # GRACE's PowerSGD decorates with torch.jit.script, deprecated in torch 2.x
            warnings.filterwarnings("ignore", r".*torch\.jit\.script.* is deprecated", DeprecationWarning)
            grace_module = importlib.import_module(f"grace_dl.dist.compressor.{module}")
        comp = getattr(grace_module, cls)(**kwargs)
        name = f"grace_compare.{method}"

        def fn(x):
            tensors, ctx = comp.compress(x, name)
            return comp.decompress(tensors, ctx)

        return fn


def time_rounds(ops: dict, repeats: int) -> dict:
    """``ops``: label -> (fn, sync). Warm up each, then ``repeats`` rounds calling each twice, timing the second.

    Returns, per label, the median wall and process-CPU seconds and the timed runs.
    """
    for fn, sync in ops.values():
        sync(fn())
    walls = {k: [] for k in ops}
    cpus = {k: [] for k in ops}
    for _ in range(repeats):
        for k, (fn, sync) in ops.items():
            sync(fn())  # settle: not timed
            c0, t0 = time.process_time(), time.perf_counter()
            sync(fn())
            walls[k].append(time.perf_counter() - t0)
            cpus[k].append(time.process_time() - c0)
    return {k: dict(median_s=float(np.median(walls[k])), cpu_s=float(np.median(cpus[k])), runs_s=walls[k]) for k in ops}


def bench_one(method: str, d: int, repeats: int, jdev, tside: Torch | None) -> dict:
    """One method at one size: jaxcomm, the jax pass, and (with ``tside``) GRACE and the torch pass."""
    label, jname, _, _, gkwargs = METHODS[method]
    shape = matrix_shape(d) if method == "powersgd" else (d,)
    row = dict(
        method=method,
        grace=label,
        jaxcomm=jname,
        kwargs=jax_kwargs(method),
        grace_kwargs=gkwargs if tside else None,
        size=d,
        shape=list(shape),
        mebibytes=4 * d / 2**20,
    )
    x_np = np.random.default_rng(0).standard_normal(shape, dtype=np.float32)
    ops = {}
    with jax.default_device(jdev):
        x = jax.device_put(x_np, jdev)
        key = jax.device_put(jax.random.PRNGKey(1), jdev)
        ref = bench.reference_fn()
        ops["jax_ref"] = (lambda: ref(x), jax.block_until_ready)
        try:
            c = jc.compressors.make(jname, **row["kwargs"])
            rt = bench.roundtrip_fn(c)
            t0 = time.perf_counter()
            jax.block_until_ready(rt(x, key))
            row["jax_compile_s"] = time.perf_counter() - t0
            row["wire_bits"] = bench.wire_bits_of(c, x, key)
            row["bits_per_entry"] = row["wire_bits"] / d
            ops["jax"] = (lambda: rt(x, key), jax.block_until_ready)
        except Exception as e:  # record and go on: one failure must not end the comparison
            row["jax_error"] = f"{type(e).__name__}: {e}"
        if tside is not None:
            xt = tside.tensor(x_np)
            ops["torch_ref"] = (lambda: tside.reference(xt), tside.sync)
            try:
                g = tside.roundtrip(method)
                tside.sync(g(xt))
                ops["grace"] = (lambda: g(xt), tside.sync)
            except Exception as e:
                row["grace_error"] = f"{type(e).__name__}: {e}"
        try:
            timed = time_rounds(ops, repeats)
        except Exception as e:
            row["error"] = f"{type(e).__name__}: {e}"
            return row
    for k, t in timed.items():
        row[f"{k}_ms"] = 1e3 * t["median_s"]
        row[f"{k}_cpu_ms"] = 1e3 * t["cpu_s"]
        row[f"{k}_runs_ms"] = [1e3 * v for v in t["runs_s"]]
    for side, refk in (("jax", "jax_ref"), ("grace", "torch_ref")):
        if f"{refk}_ms" in row:
            row[f"{refk}_gbps"] = 8 * d / (row[f"{refk}_ms"] * 1e-3) / 1e9
        if f"{side}_ms" in row:
            row[f"{side}_ratio"] = row[f"{side}_ms"] / row[f"{refk}_ms"]
    if "jax_ms" in row and "grace_ms" in row:
        row["speedup_raw"] = row["grace_ms"] / row["jax_ms"]
        row["speedup"] = row["grace_ratio"] / row["jax_ratio"]
    return row


def gmean(values) -> float:
    return float(math.exp(sum(math.log(v) for v in values) / len(values)))


def evaluate_targets(rows: list[dict]) -> dict:
    """The targets, evaluated from the rows: ``{name: {value, limit, met, ...}}``.

    ``met`` is ``None`` where a target's inputs were not all measured (no GRACE,
    not every method of ``METHODS``, a size or shape not run); a method that
    failed on either side counts as missed.
    """
    targets = {}
    for d in TARGET_SIZES:
        at = {r["method"]: r for r in rows if r["size"] == d and r["method"] in TARGET_METHODS}
        mib = f"{4 * d / 2**20:g}MiB"
        if not at:
            continue
        have_grace = any("grace_ms" in r or "grace_error" in r for r in at.values())
        missing = [m for m in TARGET_METHODS if m not in at]
        failed = [m for m, r in at.items() if "speedup" not in r]
        speed = {m: r["speedup"] for m, r in at.items() if "speedup" in r}
        raw = {m: r["speedup_raw"] for m, r in at.items() if "speedup_raw" in r}
        if not have_grace or missing:
            why = "GRACE not measured" if not have_grace else f"not measured: {', '.join(missing)}"
            targets[f"gmean_speedup@{mib}"] = dict(value=None, limit=GMEAN_TARGET, met=None, why=why)
            targets[f"none_slower@{mib}"] = dict(value=None, limit=1.0, met=None, why=why)
            continue
        g = gmean(speed.values()) if speed else None
        targets[f"gmean_speedup@{mib}"] = dict(
            value=g,
            raw=gmean(raw.values()) if raw else None,
            limit=GMEAN_TARGET,
            met=bool(not failed and g >= GMEAN_TARGET),
            methods=sorted(speed),
            failed=failed,
        )
        slower = sorted(m for m, s in speed.items() if s < 1.0)
        targets[f"none_slower@{mib}"] = dict(
            value=min(speed.values()) if speed else None,
            raw=min(raw.values()) if raw else None,
            limit=1.0,
            met=bool(not failed and not slower),
            slower=slower,
            slower_raw=sorted(m for m, s in raw.items() if s < 1.0),
            failed=failed,
        )
    (n, m), limit = POWERSGD_TARGET
    for r in rows:
        if r["method"] == "powersgd" and r["shape"] == [n, m]:
            ratio = r.get("jax_ratio")
            targets[f"powersgd_r1@{n}x{m}"] = dict(
                value=ratio, limit=limit, met=bool(ratio is not None and ratio <= limit), error=r.get("jax_error")
            )
    return targets


def machine_info(device: str, torch=None) -> dict:
    info = bench.machine_info()
    root = Path(jc.__file__).resolve().parents[1]
    try:
        commit = subprocess.run(
            ["git", "-C", str(root), "rev-parse", "HEAD"], capture_output=True, text=True, timeout=30
        ).stdout.strip()
    except (OSError, subprocess.SubprocessError):
        commit = ""
    info.update(
        jaxcomm_path=str(root),
        jaxcomm_commit=commit or None,
        device=device,
        xla_flags=os.environ.get("XLA_FLAGS", ""),
        jax_platforms=os.environ.get("JAX_PLATFORMS", ""),
        jax_device_kind=jax.devices()[0].device_kind,
        xla_cpu_threads="XLA's CPU client runs one intra-op thread pool sized to the machine's cores "
        "(os.cpu_count() unless XLA_FLAGS limits it)",
    )
    if torch is not None:
        info.update(
            torch=torch.__version__,
            torch_num_threads=torch.get_num_threads(),
            torch_num_interop_threads=torch.get_num_interop_threads(),
            torch_cuda=torch.version.cuda,
        )
        if device == "cuda":
            info["torch_device_name"] = torch.cuda.get_device_name()
    return info


def _f(v, fmt):
    return "" if v is None else format(v, fmt)


def markdown_tables(res: dict) -> str:
    """Per size: GRACE ms, jaxcomm ms, raw speedup, each as a ratio to its own pass, the judged speedup; targets."""
    out = []
    for d in res["sizes"]:
        rows = [r for r in res["results"] if r["size"] == d]
        out.append(
            f"**{4 * d / 2**20:g} MiB** ({d:,} float32; PowerSGD on {matrix_shape(d)[0]}x{matrix_shape(d)[1]})\n"
        )
        out.append(
            "| method | GRACE ms | jaxcomm ms | speedup (ms) | GRACE / torch pass | jaxcomm / jax pass | "
            "speedup (ratios) |"
        )
        out.append("|---|---:|---:|---:|---:|---:|---:|")
        for r in rows:
            if "error" in r:
                out.append(f"| {r['grace']} | error: {r['error']} | | | | | |")
                continue
            g = "error" if "grace_error" in r else _f(r.get("grace_ms"), ".3g") or "absent"
            j = "error" if "jax_error" in r else _f(r.get("jax_ms"), ".3g")
            out.append(
                f"| {r['grace']} | {g} | {j} | {_f(r.get('speedup_raw'), '.2f')} | {_f(r.get('grace_ratio'), '.2f')} | "
                f"{_f(r.get('jax_ratio'), '.2f')} | {_f(r.get('speedup'), '.2f')} |"
            )
        for side, k in (("torch", "torch_ref"), ("jax", "jax_ref")):
            ms = [r[f"{k}_ms"] for r in rows if f"{k}_ms" in r]
            gb = [r[f"{k}_gbps"] for r in rows if f"{k}_gbps" in r]
            if ms:
                out.append(
                    f"| *{side} pass 2x+1 (median over rows)* | | | | | | {np.median(ms):.3g} ms, "
                    f"{np.median(gb):.1f} GB/s |"
                )
        errs = [
            f"{r['method']}: {r.get('grace_error') or r.get('jax_error')}"
            for r in rows
            if "grace_error" in r or "jax_error" in r
        ]
        out.extend(["", *(f"error {e}" for e in errs)] if errs else [""])
    out.append("| target | value | raw (ms) | limit | |")
    out.append("|---|---:|---:|---:|---|")
    for k, t in res["targets"].items():
        verdict = "absent" if t["met"] is None else ("met" if t["met"] else "**missed**")
        extra = ""
        if t.get("slower"):
            extra += f" slower: {', '.join(t['slower'])}"
        if t.get("failed"):
            extra += f" failed: {', '.join(t['failed'])}"
        if t.get("why"):
            extra += f" ({t['why']})"
        out.append(
            f"| {k} | {_f(t.get('value'), '.2f')} | {_f(t.get('raw'), '.2f')} | {t['limit']:g} | {verdict}{extra} |"
        )
    m = res["machine"]
    out.append(
        f"\n{m.get('device')} ({m.get('processor')}, {m.get('cpu_count')} cores; {m.get('torch_device_name', '')}), "
        f"jax {m.get('jax')}, torch {m.get('torch', 'absent')} ({m.get('torch_num_threads', '-')} threads), "
        f"load {res['loadavg_start'][0]:.1f} -> {res['loadavg_end'][0]:.1f}, {res['repeats']} repeats"
    )
    return "\n".join(out)


def main(argv=None) -> dict:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument(
        "--grace",
        default=os.environ.get("GRACE_PATH"),
        help="root of a GRACE checkout (holds grace_dl/); 'none': jaxcomm only. Default: $GRACE_PATH",
    )
    ap.add_argument("--device", default="cpu", choices=["cpu", "cuda"], help="where both frameworks run")
    ap.add_argument(
        "--torch-threads",
        type=int,
        default=0,
        help="torch.set_num_threads for GRACE and the torch pass (default 0: torch's own choice)",
    )
    ap.add_argument("--sizes", default=",".join(map(str, DEFAULT_SIZES)), help="comma-separated entry counts")
    ap.add_argument("--repeats", type=int, default=10, help="timed rounds per measurement (median reported)")
    ap.add_argument("--only", default="", help=f"comma-separated methods (default all: {','.join(METHODS)})")
    ap.add_argument("--out", default=str(DEFAULT_OUT), help="JSON output path")
    ap.add_argument("--markdown", metavar="JSON", help="print the tables of a results file and exit")
    args = ap.parse_args(argv)
    if args.markdown:
        res = json.loads(Path(args.markdown).read_text())
        print(markdown_tables(res))
        return res
    if args.repeats < 1:
        ap.error("--repeats must be >= 1")
    if args.torch_threads < 0:
        ap.error(f"--torch-threads must be >= 0, got {args.torch_threads}")
    try:
        sizes = [int(s) for s in args.sizes.split(",") if s]
    except ValueError:
        ap.error(f"--sizes must be comma-separated integers, got {args.sizes!r}")
    if not sizes or min(sizes) < 1:
        ap.error(f"--sizes must be positive, got {args.sizes!r}")
    methods = [m.strip() for m in args.only.split(",") if m.strip()] or list(METHODS)
    unknown = [m for m in methods if m not in METHODS]
    if unknown:
        ap.error(f"unknown method(s) {unknown}; known: {list(METHODS)}")
    if not args.grace:
        raise UsageError("give --grace PATH (a GRACE checkout; or set GRACE_PATH), or --grace none")
    torch = None if args.grace.lower() == "none" else load_grace(args.grace)
    if torch is not None and args.torch_threads:
        torch.set_num_threads(args.torch_threads)
    try:
        jdev = jax.devices("cpu" if args.device == "cpu" else "gpu")[0]
    except RuntimeError as e:
        raise UsageError(f"--device {args.device}: jax has no such backend here ({e}); set JAX_PLATFORMS") from e
    tside = Torch(torch, args.device) if torch is not None else None
    load_start = list(os.getloadavg())
    rows = []
    jobs = [(d, m) for d in sizes for m in methods]
    try:
        for d, m in tqdm(jobs, desc="GRACE vs jaxcomm", unit="method"):
            rows.append(bench_one(m, d, args.repeats, jdev, tside))
    finally:
        if tside is not None:
            tside.close()
    result = dict(
        benchmark="grace_compare",
        method="interleaved rounds of jax pass, jaxcomm, torch pass, GRACE (second of two calls timed); "
        "medians; speedup = (GRACE / torch pass) / (jaxcomm / jax pass)",
        command=" ".join(sys.argv),
        grace_path=None if torch is None else str(Path(args.grace).resolve()),
        machine=machine_info(args.device, torch),
        torch_distributed_backend=None if tside is None else tside.backend,
        loadavg_start=load_start,
        loadavg_end=list(os.getloadavg()),
        sizes=sizes,
        repeats=args.repeats,
        methods={m: dict(grace=METHODS[m][0], grace_class=METHODS[m][3], jaxcomm=METHODS[m][1]) for m in methods},
        results=rows,
        targets=evaluate_targets(rows),
    )
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(result, indent=1))
    print(markdown_tables(result))
    print(f"wrote {out}")
    return result


if __name__ == "__main__":
    main()
