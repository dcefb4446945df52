"""Tensor fusion over MPI: compressed_mean(fuse=True) against fuse=False, on real processes.

Launches ``mpirun -n P`` on this script (one CPU device per process, mpi4jax
collectives inside the jitted step) and times, per compressor, the step

    g = a_r * x            (a per-rank elementwise stand-in for back-propagation)
    ḡ = compressed_mean(c, comm=MPIComm(), memory=..., fuse=F)(g)
    x ← x − 0.01 ḡ

with ``fuse=True`` (every tensor's payload in one packed ``MPI_Allgather``) and
``fuse=False`` (one ``MPI_Allgather`` per tensor and payload field), interleaved
in one process (A, B, B, A, ...) with the uncompressed ``none()`` step, median
of ``--repeats`` steps after warm-up. Every MPI collective is a real message
exchange between processes, with a per-call latency the simulated devices of
``step_overhead.py`` do not have. The memory follows GRACE (``--memory grace``
of step_overhead.py: none for QSGD and the sign methods, residual for top-k).
Rank 0 writes the JSON.

``--breakdown`` times, per compressor, where the step's time goes instead
(default compressors none, signsgd, qsgd, topk, powersgd; fused; output
``results/step_mpi_breakdown.json``). Per (tree, compressor) it builds, in
every process, eleven jitted programs and times them interleaved (the order
reversed every other repeat), each after an idle barrier so that all ranks
start it together and none busy-polls the shared cores meanwhile:

* ``step`` / ``dense_step``: the step above with the compressor and with
  ``none()`` (dense all-reduce), over :class:`~jaxcomm.comm.MPIComm` (the
  ``none`` row times the dense programs under both labels: its ratios are
  the timing noise).
* ``compute`` / ``dense_compute``: the same two steps over :class:`Loopback`,
  a communicator of the same size ``n`` whose collectives are local copies
  (MPI on ``MPI_COMM_SELF``; ``all_gather`` copies this worker's payload into
  each of the ``n`` rows): the same compiled pipeline for ``n`` workers --
  packing, the decode of ``n`` payloads, PowerSGD's rounds -- with no message
  between processes. This is the step's *compute*; ``step - compute`` is the
  time spent in, or waiting on, the network.
* the parts, each jitted alone on the same tree and the same arrays:
  ``compressor`` (compensate + compress per leaf; PowerSGD: its rounds over
  :class:`Loopback`), ``memory`` (compensate again + the memory update from
  the compression error or the reconstruction), ``collective`` (this step's
  payload arrays through the same MPIComm collectives: the packed all-gather,
  the all-reduce of the summable fields, or one all-reduce per PowerSGD
  message), ``pack`` (the same collective over :class:`Loopback`: packing,
  unpacking and the local copies, all included in ``collective``) and ``decode`` (decompress and
  sum the ``n`` gathered payloads; PowerSGD: ``P Q^T`` once).

Each time is the median over repeats of the slowest rank's time (a
synchronous step goes at its slowest worker's pace). Reported per compressor:
``step / dense step`` (the end-to-end cost over MPI), ``compute / dense
compute`` (the compressed step's compute against the dense step's gradient
and optimizer passes; the target: at most 1.3x on the VGG16-sized
tree) and ``(compressor + memory + decode) / dense compute`` (the work
compression adds, against the same denominator).

usage: python experiments/benchmarks/fusion_mpi.py [--procs 4] [--trees resnet20,vgg16]
       [--compressors topk,qsgd] [--repeats 15] [--out experiments/benchmarks/results/fusion_mpi.json]
       python experiments/benchmarks/fusion_mpi.py --breakdown [--procs 4] [--trees vgg16,resnet20]
       [--compressors none,signsgd,qsgd,topk,powersgd] [--repeats 15] [--memory grace|residual]
       [--out experiments/benchmarks/results/step_mpi_breakdown.json]
       python experiments/benchmarks/fusion_mpi.py --markdown JSON
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import subprocess
import sys
import time
from pathlib import Path

import jax
import jax.numpy as jnp

from jaxcomm.comm import Local

HERE = Path(__file__).resolve().parent
ROOT = HERE.parents[1]


def run_meta(benchmark: str, args, size: int) -> dict:
    """The JSON's run description shared by both modes: processes, machine, versions, command, memory."""
    return {
        "benchmark": benchmark,
        "processes": size,
        "devices_per_process": jax.local_device_count(),
        "host_cpus": os.cpu_count(),
        "platform": platform.platform(),
        "jax": jax.__version__,
        "repeats": args.repeats,
        "load_average_at_start": list(os.getloadavg()),
        "command": "python experiments/benchmarks/fusion_mpi.py " + " ".join(args.argv),
        "memory": MEMORY_NOTE[args.memory],
    }


def run_worker(script: Path, procs: int, worker_argv: list[str]) -> int:
    """Run ``script --worker *worker_argv`` under ``mpirun -n procs`` from the repository root; its exit code.

    A ``PYTHONPATH`` given by the caller comes first (to time another checkout's
    jaxcomm with this tree's scripts), then this repository.
    """
    from jaxcomm.comm._launch import mpirun_env, mpirun_path

    mpirun = mpirun_path()
    if mpirun is None:
        raise SystemExit("mpirun not found: install the project's 'mpi' extra (pip install -e .[mpi])")
    env = mpirun_env()
    env["PYTHONPATH"] = os.pathsep.join([p for p in (env.get("PYTHONPATH", ""), str(ROOT)) if p])
    cmd = [mpirun, "-n", str(procs), "--oversubscribe", sys.executable, str(Path(script).resolve())]
    return subprocess.run([*cmd, "--worker", *worker_argv], env=env, cwd=ROOT).returncode


def launch(args) -> int:
    """Parent: run this script under mpirun with ``--worker``."""
    argv = ["--trees", args.trees, "--compressors", args.compressors, "--repeats", str(args.repeats)]
    argv += ["--memory", args.memory, "--out", str(Path(args.out).resolve())]
    argv += ["--breakdown"] if args.breakdown else []
    return run_worker(Path(__file__), args.procs, argv)


class Loopback(Local):
    """A communicator of ``size`` workers whose collectives stay in this process: a step's compute.

    ``index()`` is ``rank``. ``sum`` is an ``MPI_Allreduce`` and ``all_gather``
    ``size`` ``MPI_Allgather`` calls on ``MPI_COMM_SELF``, through an
    :class:`~jaxcomm.comm.MPIComm` of that one process (``all_gather``: this
    worker's value in every row of the ``(size, *s)`` result): each a local
    copy into a fresh buffer, where a real collective's result lands, so the
    compiled program has the same boundaries as over an ``MPIComm`` of that
    size -- the same packing, the decode of ``size`` payloads held in distinct
    buffers (rows that XLA could see are equal it would decode once), PowerSGD's
    rounds -- and no message crosses between processes. ``mean`` divides the
    sum by ``size``; ``broadcast``, ``permute`` and ``all_to_all`` return their
    input and ``reduce_scatter`` keeps row 0 (no strategy measured here uses
    them). Its results are not a mean over workers.
    """

    def __init__(self, size: int, rank: int = 0):
        from mpi4py import MPI

        from jaxcomm.comm import MPIComm

        self._local = MPIComm(MPI.COMM_SELF)  # one process: its collectives are local copies
        self._size, self.rank = int(size), int(rank)

    def __repr__(self):
        return f"Loopback(size={self._size}, rank={self.rank})"

    @property
    def size(self) -> int:
        return self._size

    def index(self):
        return jnp.asarray(self.rank, jnp.int32)

    def sum(self, tree):
        return self._local.sum(tree)

    def mean(self, tree):
        return jax.tree.map(lambda a: (a / self._size).astype(a.dtype), self.sum(tree))

    def all_gather(self, tree):
        rows = [self._local.all_gather(tree) for _ in range(self._size)]
        return jax.tree.map(lambda *r: jnp.concatenate(r), *rows)

    def broadcast(self, tree, root: int = 0):
        return tree

    def permute(self, tree, perm):
        return tree

    def all_to_all(self, tree):
        return tree

    def reduce_scatter(self, tree):
        return jax.tree.map(lambda a: a[0], tree)


def init_arrays(shapes, rank: int):
    """``(x, a)``: parameters ``x ~ N(0, 0.05²)`` (the same on every rank) and the per-rank
    factors ``a ~ N(0, 1) / 0.05`` of the stand-in gradient ``g = a ⊙ x`` (so ``g ~ N(0, 1)``)."""
    import numpy as np

    rng = np.random.default_rng(0)
    x = {k: (rng.standard_normal(s) * 0.05).astype(np.float32) for k, s in shapes.items()}
    a = {k: (np.random.default_rng(1 + rank).standard_normal(s) / 0.05).astype(np.float32) for k, s in shapes.items()}
    return x, a


def step_runner(comm, c, memory, shapes, fuse: bool, rank: int):
    """A zero-argument callable timing one jitted step ``g = a ⊙ x; ḡ = compressed_mean(c)(g);
    x ← x − 0.01 ḡ`` over ``comm`` (seconds, blocked until ready); the buffers carry over."""
    import jax

    from jaxcomm.transforms import compressed_mean

    tx = compressed_mean(c, comm=comm, memory=memory, fuse=fuse)
    x, a = init_arrays(shapes, rank)

    @jax.jit
    def step(a, x, state):
        g = jax.tree.map(lambda p, s: p * s, x, a)
        u, state = tx.update(g, state, x)
        return jax.tree.map(lambda p, d: p - 0.01 * d, x, u), state

    buf = {"x": jax.device_put(x), "s": tx.init(x)}

    def call():
        t0 = time.perf_counter()
        buf["x"], buf["s"] = step(a, buf["x"], buf["s"])
        jax.block_until_ready(buf["x"])
        return time.perf_counter() - t0

    return call


def part_runners(c, memory, comm, loop, shapes, fuse: bool, rank: int) -> tuple[dict, dict]:
    """The step's parts for compressor ``c`` with ``memory``, each jitted alone on the same tree
    (see the module docstring): ``(calls, arrays)``, ``calls`` mapping ``"compressor"``,
    ``"memory"``, ``"collective"``, ``"pack"`` and ``"decode"`` to zero-argument callables
    returning seconds, ``arrays`` the inputs they were given: ``"g"`` (this rank's gradient
    leaves), ``"payloads"`` (per leaf; PowerSGD: ``(payload, messages)``), ``"received"`` (the
    MPI collective's output) and ``"totals"`` (the decoded sums per leaf). Every part's inputs
    are the previous part's outputs, computed once here, so each reads the arrays the step would."""
    import dataclasses

    import jax

    from jaxcomm._keys import step_keys
    from jaxcomm.transforms._collectives import accumulator, gather_payloads, run_rounds, sum_decompressed
    from jaxcomm.transforms._state import init_state

    n = int(comm.size)
    x, a = init_arrays(shapes, rank)
    g = jax.device_put(jax.tree.map(lambda p, s: p * s, x, a))
    leaves, treedef = jax.tree.flatten(g)
    state = init_state(g, c, memory)
    mem_leaves = treedef.flatten_up_to(state.memory)
    cstates = list(state.compressor_states)
    acc = [accumulator(leaf.dtype) for leaf in leaves]
    rounds = c.rounds is not None
    strategy = "rounds" if rounds else c.strategy
    if strategy not in ("allgather", "allreduce", "rounds"):
        raise ValueError(f"--breakdown: strategy {c.strategy!r} of {c.name!r} is not broken down")

    @jax.jit
    def compress(leaves, mem_leaves, cstates, key):
        _, keys = step_keys(key, len(leaves))
        out = []
        for g, m, st, k in zip(leaves, mem_leaves, cstates, keys):
            phi = memory.compensate(m, g)
            if rounds:  # the step's run_rounds, its sums over the loopback
                payload, _, sent = run_rounds(c, phi, k, st, loop)
                out.append((payload, sent))
            else:
                out.append(c.compress(phi, jax.random.fold_in(k, rank), st)[0])
        return out

    def summable(p):
        return {f: getattr(p, f) for f in type(p).summable}

    def collective(comm_):
        if strategy == "allgather":
            return jax.jit(lambda ps: gather_payloads(comm_, ps, fuse)[0])
        if strategy == "allreduce":
            return jax.jit(lambda ps: comm_.sum([summable(p) for p in ps]))
        return jax.jit(lambda ps: [[comm_.sum(m) for m in sent] for _, sent in ps])

    @jax.jit
    def decode(ps, received):
        if strategy == "allgather":
            return [sum_decompressed(c, gp, n, ac) for gp, ac in zip(received, acc)]
        if strategy == "allreduce":
            return [c.decompress(dataclasses.replace(p, **s)).astype(ac) for p, s, ac in zip(ps, received, acc)]
        return [c.decompress(p).astype(ac) for (p, _), ac in zip(ps, acc)]

    @jax.jit
    def update(leaves, mem_leaves, ps, totals):
        new = []
        for g, m, p, total in zip(leaves, mem_leaves, ps, totals):
            phi = memory.compensate(m, g)
            if rounds:  # the memory keeps the aggregated reconstruction (as the pipeline does)
                new.append(memory.update(m, g, phi, (total / n).astype(phi.dtype)))
            elif memory.from_error is not None:
                new.append(memory.from_error(m, c.error(phi, p)))
            else:
                new.append(memory.update(m, g, phi, c.decompress(p)))
        return new

    coll_mpi, coll_loop = collective(comm), collective(loop)
    payloads = compress(leaves, mem_leaves, cstates, state.key)
    received = coll_mpi(payloads)
    totals = decode(payloads, received)
    jax.block_until_ready((payloads, received, totals))

    def timed(f, *args):
        def call():
            t0 = time.perf_counter()
            jax.block_until_ready(f(*args))
            return time.perf_counter() - t0

        return call

    calls = {
        "compressor": timed(compress, leaves, mem_leaves, cstates, state.key),
        "memory": timed(update, leaves, mem_leaves, payloads, totals),
        "collective": timed(coll_mpi, payloads),
        "pack": timed(coll_loop, payloads),
        "decode": timed(decode, payloads, received),
    }
    arrays = {"payloads": payloads, "received": received, "totals": totals, "g": leaves}
    return calls, arrays


def worker(args) -> None:
    """One MPI process: build and time the steps; rank 0 saves the results."""
    # One CPU device per process (mpirun_env removed XLA_FLAGS): keep step_overhead's
    # import from asking for 8 simulated devices.
    os.environ.setdefault("XLA_FLAGS", "")
    import numpy as np

    sys.path.insert(0, str(HERE))
    from step_overhead import TREES, make_compressor, memory_for

    import jaxcomm as jc
    from jaxcomm.comm import MPIComm

    comm = MPIComm()
    rank, size = comm.rank, comm.size
    if args.breakdown:
        return breakdown_worker(args, comm)

    def runner(c, shapes, fuse):
        return step_runner(comm, c, memory_for(c.name, args.memory), shapes, fuse, rank)

    out = {
        "meta": run_meta("fusion_mpi", args, size),
        "trees": {},
    }
    for tree in [t for t in args.trees.split(",") if t]:
        shapes = TREES[tree]()
        res = {}
        for name in [c for c in args.compressors.split(",") if c]:
            c = make_compressor(name)
            calls = {
                "none": runner(jc.compressors.none(), shapes, True),
                "fused": runner(c, shapes, True),
                "unfused": runner(c, shapes, False),
            }
            for f in calls.values():  # compile and warm up
                f(), f()
            times = {k: [] for k in calls}
            order = list(calls)
            for i in range(args.repeats):
                for k in order if i % 2 == 0 else order[::-1]:
                    times[k].append(calls[k]())
            # every rank's step ends at the same collective; take rank 0's clock
            med = {k: float(np.median(v)) * 1e3 for k, v in times.items()}
            res[name] = {
                "none_ms": med["none"],
                "fused_ms": med["fused"],
                "unfused_ms": med["unfused"],
                "fused_ratio": med["fused"] / med["none"],
                "unfused_ratio": med["unfused"] / med["none"],
                "fused_over_unfused_paired": float(
                    np.median(np.asarray(times["fused"]) / np.asarray(times["unfused"]))
                ),
                "steps_ms": {k: [1e3 * t for t in v] for k, v in times.items()},
            }
            if rank == 0:
                r = res[name]
                print(
                    f"{tree:9s} {name:8s} none {r['none_ms']:8.1f} ms  fused {r['fused_ms']:8.1f} ms "
                    f"({r['fused_ratio']:.2f}x)  unfused {r['unfused_ms']:8.1f} ms ({r['unfused_ratio']:.2f}x)  "
                    f"fused/unfused {r['fused_over_unfused_paired']:.3f}",
                    flush=True,
                )
        out["trees"][tree] = {"num_tensors": len(shapes), "results": res}
    if rank == 0:
        save(out, args.out)


MEMORY_NOTE = {
    "grace": "GRACE Table I (none for qsgd/sign methods, residual otherwise)",
    "residual": "residual for every compressor (none for unbiased ones and none())",
}
BREAKDOWN_COMPRESSORS = "none,signsgd,qsgd,topk,powersgd"
STEPS = ("dense_step", "step", "dense_compute", "compute")
PARTS = ("compressor", "memory", "collective", "pack", "decode")


def save(out: dict, path) -> None:
    """Write ``out`` (with the load average now) as JSON to ``path``."""
    out["meta"]["load_average_at_end"] = list(os.getloadavg())
    Path(path).parent.mkdir(parents=True, exist_ok=True)
    Path(path).write_text(json.dumps(out, indent=2) + "\n")
    print(f"wrote {path}", flush=True)


def summarize(times: dict) -> dict:
    """Per-label arrays ``(ranks, repeats)`` of seconds -> the breakdown row (milliseconds, ratios).

    Each label's time is the median over repeats of the slowest rank's time; ``*_paired`` ratios
    are medians over repeats of the per-repeat ratio of those maxima.
    """
    import numpy as np

    slowest = {k: np.max(np.asarray(v), axis=0) for k, v in times.items()}
    ms = {k: 1e3 * float(np.median(v)) for k, v in slowest.items()}
    paired = lambda a, b: float(np.median(slowest[a] / slowest[b]))
    added = ms["compressor"] + ms["memory"] + ms["decode"]
    return {
        "ms": ms,
        "rank0_ms": {k: 1e3 * float(np.median(np.asarray(v)[0])) for k, v in times.items()},
        "step_ratio": ms["step"] / ms["dense_step"],
        "step_ratio_paired": paired("step", "dense_step"),
        "compute_ratio": ms["compute"] / ms["dense_compute"],
        "compute_ratio_paired": paired("compute", "dense_compute"),
        "added_compute_ratio": added / ms["dense_compute"],
        "network_ms": ms["step"] - ms["compute"],
        "dense_network_ms": ms["dense_step"] - ms["dense_compute"],
        "steps_ms": {k: [1e3 * t for t in v] for k, v in slowest.items()},
    }


def breakdown_worker(args, comm) -> None:
    """``--breakdown``: the steps over MPI and over :class:`Loopback` and their parts, interleaved."""
    import numpy as np
    from step_overhead import TARGET_RATIO, TREES, make_compressor, memory_for

    import jaxcomm as jc
    from experiments.network.worker import _idle_barrier

    rank, size, world = comm.rank, comm.size, comm.comm
    loop = Loopback(size, rank)
    names = [c for c in args.compressors.split(",") if c]
    out = {
        "meta": {
            **run_meta("step_mpi_breakdown", args, size),
            "jaxcomm": str(Path(jc.__file__).resolve().parent),
            "fuse": True,
            "step": "g = a * x; compressed_mean(c, comm, memory) over the processes; x -= 0.01 * mean",
            "timing": "each program after an idle barrier, interleaved (order reversed every other repeat); "
            "per program the median over repeats of the slowest rank's time",
            "compute": "the same step over Loopback(n): the collectives move nothing",
            "target": f"compute / dense compute <= {TARGET_RATIO} on vgg16",
            "complete": False,
        },
        "trees": {},
    }
    for tree in [t for t in args.trees.split(",") if t]:
        shapes = TREES[tree]()
        num_params = int(sum(np.prod(s) for s in shapes.values()))
        res = {}
        out["trees"][tree] = {"num_params": num_params, "num_tensors": len(shapes), "results": res}
        if rank == 0:
            print(f"== {tree}: {num_params:,} parameters in {len(shapes)} tensors, {size} processes", flush=True)
        none = jc.compressors.none()
        dense = {
            "dense_step": step_runner(comm, none, memory_for("none"), shapes, True, rank),
            "dense_compute": step_runner(loop, none, memory_for("none"), shapes, True, rank),
        }
        for name in names:
            c = make_compressor(name)
            memory = memory_for(name, args.memory)
            t0 = time.perf_counter()
            calls = dict(dense)
            if name == "none":  # the dense programs again: the row shows the timing noise
                calls["step"], calls["compute"] = dense["dense_step"], dense["dense_compute"]
            else:
                calls["step"] = step_runner(comm, c, memory, shapes, True, rank)
                calls["compute"] = step_runner(loop, c, memory, shapes, True, rank)
            calls.update(part_runners(c, memory, comm, loop, shapes, True, rank)[0])
            for f in calls.values():  # compile and warm up
                _idle_barrier(world, 0.002)
                f()
                _idle_barrier(world, 0.002)
                f()
            setup_s = time.perf_counter() - t0
            times = {k: [] for k in calls}
            order = list(calls)
            for i in range(args.repeats):
                for k in order if i % 2 == 0 else order[::-1]:
                    _idle_barrier(world, 0.002)
                    times[k].append(calls[k]())
            everyone = world.allgather(times)
            r = summarize({k: [t[k] for t in everyone] for k in calls})
            r.update(
                strategy=c.strategy + (" (rounds)" if c.rounds is not None else ""),
                memory=memory.name,
                params=c.params,
                setup_s=setup_s,
            )
            res[name] = r
            if rank == 0:
                ms = r["ms"]
                print(
                    f"{tree:9s} {name:9s} step {ms['step']:7.1f} ms ({r['step_ratio']:.2f}x dense "
                    f"{ms['dense_step']:.1f})  compute {ms['compute']:7.1f} ms ({r['compute_ratio']:.2f}x dense "
                    f"{ms['dense_compute']:.1f})  compressor {ms['compressor']:.1f}  memory {ms['memory']:.1f}  "
                    f"collective {ms['collective']:.1f} (pack {ms['pack']:.1f})  decode {ms['decode']:.1f}  "
                    f"added {r['added_compute_ratio']:.2f}x",
                    flush=True,
                )
                save(out, args.out)  # after every compressor: an interrupted run keeps what it measured
    if "vgg16" in out["trees"]:
        res = out["trees"]["vgg16"]["results"]
        out["target_met"] = {k: res[k]["compute_ratio"] <= TARGET_RATIO for k in res if k != "none"}
    out["meta"]["complete"] = True
    if rank == 0:
        save(out, args.out)
        print(markdown_table(out), flush=True)


def markdown_table(out: dict) -> str:
    """A ``--breakdown`` results file as a Markdown table: one row per tree and compressor."""
    target = 1.3
    rows = [
        "| tree | compressor | memory | step / dense step (paired) | compute / dense compute (paired) | "
        "(compressor + memory + decode) / dense compute | compressor ms | memory ms | collective ms "
        "(of which pack) | decode ms | compute ms (dense) | step ms (dense) |",
        "|" + "---|" * 12,
    ]
    for tree, t in out["trees"].items():
        for name, r in t["results"].items():
            ms = r["ms"]
            mark = " **>1.3**" if tree == "vgg16" and name != "none" and r["compute_ratio"] > target else ""
            rows.append(
                f"| {tree} | {name} | {r['memory']} | {r['step_ratio']:.2f}x ({r['step_ratio_paired']:.2f}x) | "
                f"{r['compute_ratio']:.2f}x ({r['compute_ratio_paired']:.2f}x){mark} | "
                f"{r['added_compute_ratio']:.2f}x | {ms['compressor']:.1f} | {ms['memory']:.1f} | "
                f"{ms['collective']:.1f} ({ms['pack']:.1f}) | {ms['decode']:.1f} | "
                f"{ms['compute']:.1f} ({ms['dense_compute']:.1f}) | {ms['step']:.1f} ({ms['dense_step']:.1f}) |"
            )
    return "\n".join(rows)


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--procs", type=int, default=4)
    ap.add_argument("--trees", default="resnet20,vgg16")
    ap.add_argument("--compressors", default=None, help=f"default topk,qsgd; --breakdown: {BREAKDOWN_COMPRESSORS}")
    ap.add_argument("--repeats", type=int, default=15)
    ap.add_argument("--memory", choices=tuple(MEMORY_NOTE), default="grace")
    ap.add_argument("--breakdown", action="store_true", help="time the step's parts (see the module docstring)")
    ap.add_argument("--markdown", metavar="JSON", help="print the table of a --breakdown results file and exit")
    ap.add_argument("--out", default=None, help="default results/fusion_mpi.json; --breakdown: step_mpi_breakdown.json")
    ap.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    args = ap.parse_args(argv)
    args.argv = list(sys.argv[1:] if argv is None else argv)
    if args.markdown:
        print(markdown_table(json.loads(Path(args.markdown).read_text())))
        return 0
    if args.compressors is None:
        args.compressors = BREAKDOWN_COMPRESSORS if args.breakdown else "topk,qsgd"
    if args.out is None:
        name = "step_mpi_breakdown.json" if args.breakdown else "fusion_mpi.json"
        args.out = str(HERE / "results" / name)
    if args.procs < 2:
        ap.error(f"--procs must be >= 2; got {args.procs}")
    if args.repeats < 1:
        ap.error(f"--repeats must be >= 1; got {args.repeats}")
    if args.worker:
        worker(args)
        return 0
    return launch(args)


if __name__ == "__main__":
    sys.exit(main())
