"""The GPU device check: compile times, the GRACE comparison, elementwise bandwidth and step overhead, in one JSON.

Run by ``scripts/device_check.sh`` (which prepares the Python environment first);
on one GPU the whole check stays within ``--budget`` seconds (default 450: with
the set-up, 8 minutes). Five parts, each in its own subprocess under its own time
limit (``PART_BUDGETS``, cut to what is left of the whole budget), each going on
if another fails or runs out of time:

1. ``compile``: every registered compressor's jitted ``decompress(compress(x,
   key))`` (``compressors.py``'s settings: 1 % density for the sparsifiers) on
   26,214,400 float32 entries (a 5120 x 5120 matrix), lowered and compiled, not
   run; ``lower_s`` and ``compile_s`` each. Target: ``compile_s <= 10`` for every
   compressor. A compressor still compiling after ``--compile-limit`` seconds
   (default 30) is recorded as unfinished and the rest go on in a fresh process.
2. ``grace``: ``grace_compare.py`` on the device at 10 and 100 MiB
   (2,621,440 and 26,214,400 entries), against GRACE's PyTorch compressors when
   ``GRACE_PATH`` names a GRACE checkout and torch is installed, else jaxcomm and
   the jax memory pass only (``--grace none``). Target: no method slower than GRACE.
3. ``bandwidth``: each elementwise compressor (``compressors.py``'s
   ``TARGETS["elementwise"]``) on 26,214,400 entries, ``--queue`` calls (default 20)
   issued before one ``block_until_ready``, so that launch latency hides behind the
   device's work; ``gbps = 8 d / time per call`` (the 4-byte input read and the
   4-byte output written once: the least traffic of a round trip) against the
   card's nominal HBM bandwidth (``HBM_GBPS`` by device name; ``null`` for a card
   not listed) and against the jax memory pass ``2 x + 1`` timed the same way.
   Target: ``gbps >= 0.5 x`` HBM.
4. ``step``: ``step_overhead.py --devices 1`` on the device: a VGG16 training step
   (forward and backward on 32 CIFAR images) with each of top-k, QSGD, signSGD and
   FP16 (GRACE's memory choice) against the same step without compression.
5. ``select``: ``gpu_select.py`` on the device: the accelerator top-k bodies
   (``lax.top_k`` over all keys against the sampled threshold) side by side at 2.6 M
   and 26 M entries, and the ``topk`` / ``randomk`` round trips with each; both
   bodies' indices compared on every input. Target: identical indices.

``--smoke`` runs every part at tiny sizes on whatever platform jax finds (the
test suite runs it on the CPU). Output: ``device_check.json`` in ``--out``, with
the jax backend and devices actually used, each part's rows, limit, wall time and
status, and the targets met or missed; each part's log beside it.

usage: python experiments/benchmarks/device_check.py --out DIR [--smoke] [--budget 450]
       [--compile-limit 30] [--queue 20] [--parts compile,grace,bandwidth,step]
       python experiments/benchmarks/device_check.py --markdown device_check.json   (its tables)
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import subprocess
import sys
import time
from pathlib import Path

HERE = Path(__file__).resolve().parent
ROOT = HERE.parents[1]
PARTS = ("compile", "grace", "bandwidth", "step", "select")
PART_BUDGETS = {"compile": 110, "grace": 80, "bandwidth": 40, "step": 80, "select": 140}
"""Seconds each part may take on the GPU (450 in all; an H200 took 18, 35, 9 and 42 s for the first four);
cut to what is left of ``--budget``."""
SIZE, SMOKE_SIZE = 26_214_400, 4096
COMPILE_TARGET_S = 10.0
BANDWIDTH_TARGET = 0.5
HBM_GBPS = {"H200": 4800.0, "H100 PCIe": 2000.0, "H100": 3350.0, "A100-SXM4-80GB": 2039.0, "A100": 1555.0}
"""Nominal HBM bandwidth (GB/s) by a substring of ``jax.Device.device_kind``, the first match wins (NVIDIA's
data sheets: H200 SXM 4.8 TB/s, H100 PCIe 2 TB/s, H100 SXM 3.35 TB/s, A100 80 GB SXM 2.04 TB/s, A100 40 GB
1.56 TB/s)."""
SMOKE = {"compile": ("fp16", "signsgd"), "bandwidth": ("fp16",)}
"""The compressors ``--smoke`` compiles and times (every registered one, every elementwise one otherwise)."""


def hbm_gbps(device_kind: str) -> float | None:
    """The nominal HBM bandwidth of a device named ``device_kind`` (:data:`HBM_GBPS`), ``None`` if not listed."""
    return next((v for k, v in HBM_GBPS.items() if k in device_kind), None)


# --------------------------------------------------------------------------- #
# Parts run in a worker process (jax imported there only)
# --------------------------------------------------------------------------- #
def _emit(fh, record: dict) -> None:
    fh.write(json.dumps(record, default=str) + "\n")
    fh.flush()


def _jax_env() -> dict:
    import jax

    dev = jax.devices()[0]
    return dict(
        jax=jax.__version__,
        backend=jax.default_backend(),
        devices=[str(d) for d in jax.devices()],
        device_kind=dev.device_kind,
        hbm_gbps=hbm_gbps(dev.device_kind),
    )


def _grace_compare():
    """``grace_compare.py`` beside this file: its ``matrix_shape``, and ``compressors.py`` as its ``bench``
    (the settings, the round trip and the memory pass)."""
    import importlib.util

    spec = importlib.util.spec_from_file_location("_device_check_grace_compare", HERE / "grace_compare.py")
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


def worker_compile(names, d: int, fh) -> None:
    """One JSON line per compressor (every registered one if ``names`` is empty): ``{"start": name}`` before,
    then its row (lower and compile seconds)."""
    import jax
    import jax.numpy as jnp

    import jaxcomm as jc

    gc = _grace_compare()
    bench = gc.bench
    _emit(fh, dict(env=_jax_env()))
    names = names or jc.compressors.names()
    _emit(fh, dict(names=names))
    x = jax.ShapeDtypeStruct(gc.matrix_shape(d), jnp.float32)
    key = jax.ShapeDtypeStruct((2,), jnp.uint32)
    for name in names:
        _emit(fh, dict(start=name))
        row = dict(name=name, kwargs=bench.KWARGS.get(name, {}), size=d)
        try:
            fn = bench.roundtrip_fn(jc.compressors.make(name, **row["kwargs"]))
            t0 = time.perf_counter()
            lowered = fn.trace(x, key).lower()
            t1 = time.perf_counter()
            lowered.compile()
            row.update(lower_s=t1 - t0, compile_s=time.perf_counter() - t1)
        except Exception as e:  # record and go on
            row["error"] = f"{type(e).__name__}: {e}"
        _emit(fh, dict(row=row))


def worker_bandwidth(names, d: int, queue: int, fh) -> None:
    """One JSON line per compressor (and the memory pass first): seconds per call with ``queue`` calls in flight."""
    import jax
    import jax.numpy as jnp

    import jaxcomm as jc

    bench = _grace_compare().bench
    env = _jax_env()
    _emit(fh, dict(env=env))
    x = jax.random.normal(jax.random.PRNGKey(0), (d,), jnp.float32)
    key = jax.random.PRNGKey(1)

    def per_call(fn, *args) -> float:
        jax.block_until_ready(fn(*args))  # compile and warm up
        best = float("inf")
        for _ in range(3):  # the best of three queues
            t0 = time.perf_counter()
            outs = [fn(*args) for _ in range(queue)]
            jax.block_until_ready(outs)
            best = min(best, (time.perf_counter() - t0) / queue)
        return best

    ref_s = per_call(bench.reference_fn(), x)
    ref_gbps = 8 * d / ref_s / 1e9
    _emit(fh, dict(row=dict(name="memory pass 2x+1", size=d, queue=queue, s_per_call=ref_s, gbps=ref_gbps)))
    for name in names:
        row = dict(name=name, kwargs=bench.KWARGS.get(name, {}), size=d, queue=queue)
        try:
            s = per_call(bench.roundtrip_fn(jc.compressors.make(name, **row["kwargs"])), x, key)
            gbps = 8 * d / s / 1e9
            row.update(s_per_call=s, gbps=gbps, of_memory_pass=gbps / ref_gbps)
            if env["hbm_gbps"]:
                row["of_hbm"] = gbps / env["hbm_gbps"]
        except Exception as e:  # record and go on
            row["error"] = f"{type(e).__name__}: {e}"
        _emit(fh, dict(row=row))


# --------------------------------------------------------------------------- #
# The parent: no jax, every part a subprocess under a time limit
# --------------------------------------------------------------------------- #
def _read_jsonl(path: Path) -> list[dict]:
    if not path.exists():
        return []
    out = []
    for line in path.read_text().splitlines():
        with contextlib.suppress(json.JSONDecodeError):  # a line cut off by a killed worker
            out.append(json.loads(line))
    return out


def _worker_cmd(part: str, names, d: int, args, jsonl: Path) -> list[str]:
    return [
        sys.executable,
        str(Path(__file__).resolve()),
        "--worker",
        part,
        "--names",
        ",".join(names),
        "--size",
        str(d),
        "--queue",
        str(args.queue),
        "--jsonl",
        str(jsonl),
    ]


def run_worker_part(part: str, names, d: int, args, out: Path, limit_s: float, item_limit_s: float) -> dict:
    """Run ``names`` through a worker process; one still at work after ``item_limit_s`` is recorded as unfinished
    and the rest go on in a fresh process, until ``limit_s`` is spent."""
    t_end = time.monotonic() + limit_s
    rows, env, todo, round_ = [], None, list(names), 0  # no names: the worker lists them (the registry)
    status = "done"
    with open(out / f"{part}.log", "w") as log:
        while todo or round_ == 0:
            if time.monotonic() >= t_end:
                status = "out of time"
                break
            jsonl = out / f"{part}.{round_}.jsonl"
            cmd = _worker_cmd(part, todo, d, args, jsonl)
            proc = subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT, cwd=ROOT, env=_env())
            seen, t_item = 0, time.monotonic()
            while proc.poll() is None:
                time.sleep(0.2)
                recs = _read_jsonl(jsonl)
                if len(recs) != seen:
                    seen, t_item = len(recs), time.monotonic()
                now = time.monotonic()
                if now >= t_end or now - t_item >= item_limit_s:
                    proc.kill()
                    proc.wait()
                    break
            recs = _read_jsonl(jsonl)
            env = next((r["env"] for r in recs if "env" in r), env)
            todo = next((r["names"] for r in recs if "names" in r), todo)
            done = [r["row"] for r in recs if "row" in r]
            rows.extend(done)
            finished = {r["name"] for r in done}
            started = [r["start"] for r in recs if "start" in r and r["start"] not in finished]
            if proc.returncode != 0 and started:  # killed in the middle of one: record it, go on after it
                rows.append(dict(name=started[0], size=d, error=f"not finished within {item_limit_s:.0f} s"))
                finished.add(started[0])
            elif proc.returncode != 0:  # died before starting anything (or in a part without start lines)
                status = f"worker exit {proc.returncode}"
                break
            todo = [n for n in todo if n not in finished]
            round_ += 1
    return dict(status=status, env=env, rows=rows)


def run_script_part(part: str, cmd, out: Path, limit_s: float, result_json: Path) -> dict:
    """One existing benchmark script under a time limit; its JSON results file read back."""
    with open(out / f"{part}.log", "w") as log:
        try:
            done = subprocess.run(cmd, stdout=log, stderr=subprocess.STDOUT, timeout=limit_s, cwd=ROOT, env=_env())
            status = "done" if done.returncode == 0 else f"exit {done.returncode}"
        except subprocess.TimeoutExpired:
            status = "out of time"
    res = dict(status=status, command=" ".join(cmd))
    if result_json.exists():
        res["results"] = json.loads(result_json.read_text())
    return res


def evaluate(parts: dict) -> dict:
    """Each target of the check, ``met`` or not, with the figures it was judged on."""
    targets = {}
    comp = parts.get("compile", {})
    if comp.get("rows"):
        slow = [r["name"] for r in comp["rows"] if "error" in r or r["compile_s"] > COMPILE_TARGET_S]
        targets["compile_s <= 10 for every compressor"] = dict(met=not slow and comp["status"] == "done", slower=slow)
    bw = [r for r in parts.get("bandwidth", {}).get("rows", []) if "kwargs" in r]
    if bw and all("of_hbm" in r for r in bw):
        low = [r["name"] for r in bw if r["of_hbm"] < BANDWIDTH_TARGET]
        targets["elementwise bandwidth >= 50 % of HBM"] = dict(met=not low, below=low)
    select = parts.get("select", {}).get("results", {})
    if "identical" in select:
        targets["selection bodies give identical indices"] = dict(met=bool(select["identical"]))
    grace = parts.get("grace", {}).get("results", {})
    if grace.get("targets"):
        targets["GRACE comparison"] = grace["targets"]
    return targets


def _table(head: list[str], rows: list[list]) -> str:
    rule = "|" + "|".join("---" if i == 0 else "---:" for i in range(len(head))) + "|"
    lines = ["| " + " | ".join(head) + " |", rule]
    return "\n".join(lines + ["| " + " | ".join(str(c) for c in r) + " |" for r in rows])


def markdown_tables(result: dict) -> str:
    """The tables of a ``device_check.json`` (as the docs show them): compile, bandwidth, GRACE, step.

    GRACE rows give both speed-ups of ``grace_compare.py``: ``raw`` = GRACE's ms / jaxcomm's ms, and
    ``ratios`` = (GRACE / torch's memory pass) / (jaxcomm / jax's memory pass); a part that did not run
    gives no table.
    """
    parts, out = result.get("parts", {}), []
    env = result.get("env") or {}
    out.append(f"device: {env.get('device_kind')}, jax {env.get('jax')} ({env.get('backend')})")
    rows = parts.get("compile", {}).get("rows", [])
    if rows:
        out.append(
            _table(
                ["compressor", "lower (s)", "compile (s)"],
                [
                    [r["name"], f"{r['lower_s']:.2f}", f"{r['compile_s']:.2f}"]
                    if "error" not in r
                    else [r["name"], "", r["error"]]
                    for r in rows
                ],
            )
        )
    rows = [r for r in parts.get("bandwidth", {}).get("rows", []) if "gbps" in r]
    if rows:
        out.append(
            _table(
                ["compressor", "µs per call", "8d bytes / time (GB/s)", "of the jax pass", "of HBM"],
                [
                    [
                        r["name"],
                        f"{r['s_per_call'] * 1e6:.0f}",
                        f"{r['gbps']:.0f}",
                        f"{r['of_memory_pass']:.2f}" if "of_memory_pass" in r else "1",
                        f"{r['of_hbm']:.2f}" if r.get("of_hbm") is not None else "",
                    ]
                    for r in rows
                ],
            )
        )
    grace = parts.get("grace", {}).get("results", {}).get("results", [])
    if grace:
        out.append(
            _table(
                ["method", "MiB", "GRACE ms", "jaxcomm ms", "raw", "ratios", "torch / jax pass ms"],
                [
                    [
                        r["method"],
                        f"{r['mebibytes']:.0f}",
                        f"{r['grace_ms']:.3f}",
                        f"{r['jax_ms']:.3f}",
                        f"{r['speedup_raw']:.2f}",
                        f"{r['speedup']:.2f}",
                        f"{r['torch_ref_ms']:.3f} / {r['jax_ref_ms']:.3f}",
                    ]
                    for r in grace
                    if "grace_ms" in r
                ],
            )
        )
    select = parts.get("select", {}).get("results", {})
    if select.get("select"):
        out.append(
            _table(
                ["top-k body", "d", "k", "lax.top_k ms", "sampled ms", "ratio", "path", "identical"],
                [
                    [
                        "select",
                        f"{r['d']:,}",
                        f"{r['k']:,}",
                        f"{r['old_ms']:.3f}",
                        f"{r['new_ms']:.3f}",
                        f"{r['old_over_new']:.2f}",
                        r["new_path"],
                        r["identical"],
                    ]
                    for r in select["select"]
                ],
            )
        )
    if select.get("compressors"):
        out.append(
            _table(
                ["round trip", "d", "density", "lax.top_k ms", "as lowered ms", "ratio", "lowered with", "identical"],
                [
                    [
                        r["name"],
                        f"{r['d']:,}",
                        f"{r['density']:g}",
                        f"{r['old_ms']:.3f}",
                        f"{r['lib_ms']:.3f}",
                        f"{r['old_over_lib']:.2f}",
                        r["lib_selection"],
                        r["identical"],
                    ]
                    for r in select["compressors"]
                ],
            )
        )
    trees = parts.get("step", {}).get("results", {}).get("trees", {})
    for tree, t in trees.items():
        out.append(
            _table(
                [f"{tree} step", "compressed / plain (median)", "paired", "step ms", "plain ms", "compression"],
                [
                    [
                        name,
                        f"{r['ratio']:.2f}",
                        f"{r['paired_ratio']:.2f}",
                        f"{r['step_ms']:.2f}",
                        f"{r['baseline_step_ms']:.2f}",
                        f"{r['compression']:.1f}x",
                    ]
                    for name, r in t["results"].items()
                ],
            )
        )
    return "\n\n".join(out)


def main(argv=None) -> dict:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--out", default=os.environ.get("OUT"), help="output folder (default: $OUT)")
    ap.add_argument("--smoke", action="store_true", help="tiny sizes, a few compressors: the plumbing only")
    ap.add_argument("--budget", type=float, default=450.0, help="seconds for every part together")
    ap.add_argument("--compile-limit", type=float, default=30.0, help="seconds one compressor may compile")
    ap.add_argument("--queue", type=int, default=20, help="calls queued before one wait (bandwidth part)")
    ap.add_argument("--parts", default=",".join(PARTS), help=f"comma-separated, of {','.join(PARTS)}")
    ap.add_argument("--markdown", metavar="JSON", help="print the tables of a device_check.json and exit")
    ap.add_argument("--worker", choices=("compile", "bandwidth"), help=argparse.SUPPRESS)
    ap.add_argument("--names", default="", help=argparse.SUPPRESS)
    ap.add_argument("--size", type=int, default=SIZE, help=argparse.SUPPRESS)
    ap.add_argument("--jsonl", help=argparse.SUPPRESS)
    args = ap.parse_args(argv)
    if args.markdown:
        print(markdown_tables(json.loads(Path(args.markdown).read_text())))
        return {}
    if args.worker:
        names = [n for n in args.names.split(",") if n]
        with open(args.jsonl, "w") as fh:
            if args.worker == "compile":
                worker_compile(names, args.size, fh)
            else:
                worker_bandwidth(names, args.size, args.queue, fh)
        return {}
    if not args.out:
        ap.error("--out DIR is required (or set $OUT)")
    parts = [p.strip() for p in args.parts.split(",") if p.strip()]
    bad = [p for p in parts if p not in PARTS]
    if bad or not parts:
        ap.error(f"--parts takes some of {','.join(PARTS)}; got {args.parts!r}")
    if args.budget <= 0 or args.compile_limit <= 0 or args.queue < 1:
        ap.error("--budget and --compile-limit must be > 0 and --queue >= 1")
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    t_end = time.monotonic() + args.budget
    t0 = time.time()
    d = SMOKE_SIZE if args.smoke else SIZE
    elementwise = _elementwise_names()
    os.environ.setdefault("JAX_PLATFORMS", _device_arg())  # every part's process inherits it
    setup = out / "setup.log"
    result = dict(
        benchmark="device_check",
        command=" ".join(
            ["python", "experiments/benchmarks/device_check.py", *(sys.argv[1:] if argv is None else argv)]
        ),
        smoke=args.smoke,
        budget_s=args.budget,
        setup_log=setup.read_text()[-4000:] if setup.exists() else None,
        parts={},
    )
    for part in parts:
        left = t_end - time.monotonic()
        limit = min(PART_BUDGETS[part] * (args.budget / sum(PART_BUDGETS.values())), left) if not args.smoke else left
        if limit < 5:
            result["parts"][part] = dict(status="skipped: the budget was spent")
            continue
        p0 = time.monotonic()
        if part == "compile":
            names = SMOKE["compile"] if args.smoke else ()
            res = run_worker_part(part, names, d, args, out, limit, args.compile_limit)
        elif part == "bandwidth":
            names = SMOKE["bandwidth"] if args.smoke else elementwise
            res = run_worker_part(part, names, d, args, out, limit, args.compile_limit + 30)
        elif part == "grace":
            res = run_script_part(part, _grace_cmd(args.smoke, out), out, limit, out / "grace_compare.json")
        elif part == "select":
            cmd = [sys.executable, str(HERE / "gpu_select.py"), *(["--smoke"] if args.smoke else [])]
            res = run_script_part(
                part, [*cmd, "--out", str(out / "gpu_select.json")], out, limit, out / "gpu_select.json"
            )
        else:
            res = run_script_part(part, _step_cmd(args.smoke, out), out, limit, out / "step_overhead.json")
        res.update(limit_s=limit, wall_s=time.monotonic() - p0)
        result["parts"][part] = res
    envs = [p["env"] for p in result["parts"].values() if p.get("env")]
    result["env"] = envs[0] if envs else None
    result["targets"] = evaluate(result["parts"])
    result["wall_s"] = time.time() - t0
    (out / "device_check.json").write_text(json.dumps(result, indent=1, default=str))
    for name, part in result["parts"].items():
        print(f"{name}: {part['status']} ({part.get('wall_s', 0):.0f} s)")
    for name, t in result["targets"].items():
        print(f"target {name}: {'met' if t.get('met') else t}")
    print(f"wrote {out / 'device_check.json'}")
    return result


def _elementwise_names() -> list[str]:
    """``compressors.py``'s elementwise target group (read from its source with ``ast``, no import)."""
    import ast

    tree = ast.parse((HERE / "compressors.py").read_text())
    for node in tree.body:
        if isinstance(node, ast.Assign) and getattr(node.targets[0], "id", "") == "TARGETS":
            return list(ast.literal_eval(node.value)["elementwise"][0])
    raise RuntimeError("compressors.py has no TARGETS")


def _env() -> dict:
    env = dict(os.environ)
    env["PYTHONPATH"] = str(ROOT) + (os.pathsep + env["PYTHONPATH"] if env.get("PYTHONPATH") else "")
    return env


def _device_arg() -> str:
    """``cuda`` when ``nvidia-smi`` lists a GPU, else ``cpu`` (the device grace_compare.py runs on)."""
    try:
        ok = subprocess.run(["nvidia-smi", "-L"], capture_output=True, timeout=30).returncode == 0
    except (OSError, subprocess.TimeoutExpired):
        ok = False
    return "cuda" if ok else "cpu"


def _grace_cmd(smoke: bool, out: Path) -> list[str]:
    grace = os.environ.get("GRACE_PATH") or "none"
    sizes, repeats = ("2048", "1") if smoke else ("2621440,26214400", "3")  # it writes its JSON at the end only
    cmd = [sys.executable, str(HERE / "grace_compare.py"), "--device", _device_arg(), "--grace", grace]
    cmd += ["--sizes", sizes, "--repeats", repeats, "--out", str(out / "grace_compare.json")]
    return cmd + (["--only", "fp16"] if smoke else [])


def _step_cmd(smoke: bool, out: Path) -> list[str]:
    cmd = [sys.executable, str(HERE / "step_overhead.py"), "--devices", "1", "--in-process", "--memory", "grace"]
    if smoke:
        cmd += ["--trees", "tiny", "--compressors", "signsgd", "--repeats", "1"]
    else:
        cmd += ["--trees", "vgg16", "--batch", "32", "--compressors", "topk,qsgd,signsgd,fp16", "--repeats", "5"]
    return cmd + ["--out", str(out / "step_overhead.json")]


if __name__ == "__main__":
    main()
