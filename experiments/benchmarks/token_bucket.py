"""The emulated link's token bucket against a wire: what a step that computes, then sends, pays.

Each case is one job of ``--procs`` MPI processes on a shared emulated link
(:func:`jaxcomm.netem.launch`, ring all-gather). Every iteration, after a barrier, each rank
sleeps ``compute_ms`` (the link idle, as while a step computes), then all-gathers ``payload``
bytes. Rank 0 records the median over the iterations after the first two of the slowest rank's
all-gather time (an all-gather is done when its last rank has every block), and
the link's bytes per iteration (the kernel's count, barriers included). Per case:

* ``wire_ms``: bytes per iteration × 8 / rate, the transfer time on a link that serialises every
  byte after it exists;
* ``allgather_ms``: the measured median;
* ``free_ms``: ``wire_ms − allgather_ms``, the transfer the bucket's tokens, earned while the link
  was idle, let through at line speed (at most ``burst / rate``);
* ``drops``: packets the qdisc dropped in the timed iterations.

The cases pair each link rate and payload with two shapes: ``--burst 256kb`` at the loopback's
MTU of 65536 (the launcher's default) and ``--burst 1ms --mtu 9000`` (the time-to-accuracy
study's).

usage: python experiments/benchmarks/token_bucket.py [--procs 4] [--compute-ms 83] [--iters 12]
       [--out experiments/benchmarks/results/token_bucket.json]
       python experiments/benchmarks/token_bucket.py --smoke --procs 2 --iters 3 --out /tmp/t.json
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
SHAPES = ({"burst": "256kb", "mtu": 65536}, {"burst": "1ms", "mtu": 9000})
CASES = (  # (link, bytes each rank all-gathers): DGC's ResNet-20 payload (13,080 B) and a 1 MB one
    ("10mbit", 13080),
    ("100mbit", 13080),
    ("10mbit", 1_000_000),
)
SMOKE_CASES = (("100mbit", 4096),)
RING = {
    "OMPI_MCA_coll_tuned_use_dynamic_rules": "1",
    "OMPI_MCA_coll_tuned_allgather_algorithm": "4",
}


def worker(args) -> None:
    """One rank: sleep, all-gather, repeat; rank 0 writes the case's JSON line to ``args.out``."""
    import numpy as np
    from mpi4py import MPI

    from jaxcomm.netem import link_counters

    world = MPI.COMM_WORLD
    buf = np.ones(args.payload, np.uint8)
    out = np.empty(args.payload * world.Get_size(), np.uint8)
    times = []
    before = None
    for i in range(args.iters):
        if i == 2:  # the first two load the connections
            world.Barrier()
            before = link_counters() if world.Get_rank() == 0 else None
        world.Barrier()
        time.sleep(args.compute_ms / 1e3)
        t0 = time.perf_counter()
        world.Allgather(buf, out)
        times.append(time.perf_counter() - t0)
    world.Barrier()
    gathered = world.gather(times)
    if world.Get_rank() == 0:
        window = link_counters() - before
        # an all-gather is done when its last rank has every block: per iteration, the slowest rank's time
        slowest = np.max(np.array(gathered), axis=0)
        Path(args.out).write_text(
            json.dumps(
                {
                    "allgather_ms": 1e3 * float(np.median(slowest[2:])),
                    "link_bytes": window.bytes / (args.iters - 2),
                    "drops": window.drops,
                }
            )
        )


def main(argv=None) -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--procs", type=int, default=4)
    p.add_argument("--compute-ms", type=float, default=83.0, help="idle time before each all-gather (ms)")
    p.add_argument("--iters", type=int, default=12)
    p.add_argument("--out", default=str(HERE / "results" / "token_bucket.json"))
    p.add_argument("--smoke", action="store_true", help="one 100 Mbit/s case of 4 kB per rank, both shapes")
    p.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    p.add_argument("--payload", type=int, default=0, help=argparse.SUPPRESS)
    args = p.parse_args(argv)
    if args.procs < 2 or args.iters < 3 or not args.compute_ms >= 0:
        p.error("--procs must be >= 2, --iters >= 3 and --compute-ms >= 0")
    if args.worker:
        worker(args)
        return
    from jaxcomm import netem
    from jaxcomm.netem._link import link_settings

    rows = []
    tmp = Path(args.out).resolve().with_suffix(".case.json")
    for link, payload in SMOKE_CASES if args.smoke else CASES:
        for shape in SHAPES:
            settings = link_settings(link, "0", shape["burst"], shape["mtu"])
            cmd = [sys.executable, str(Path(__file__).resolve()), "--worker", "--payload", str(payload)]
            cmd += ["--compute-ms", str(args.compute_ms), "--iters", str(args.iters), "--out", str(tmp)]
            env = {**os.environ, **RING, "PYTHONPATH": os.pathsep.join([str(ROOT), os.environ.get("PYTHONPATH", "")])}
            res = netem.launch(args.procs, cmd, bandwidth=link, env=env, timeout=600, cwd=ROOT, **shape)
            if res.returncode != 0:
                raise SystemExit(f"token_bucket: the job on {link} with {shape} failed (exit {res.returncode})")
            got = json.loads(tmp.read_text())
            wire_ms = 1e3 * 8 * got["link_bytes"] / settings.bandwidth_bps
            row = {
                "link": link,
                **shape,
                "burst_bytes": settings.burst_bytes,
                "payload_bytes_per_rank": payload,
                "compute_ms": args.compute_ms,
                "link_bytes_per_iteration": got["link_bytes"],
                "wire_ms": wire_ms,
                "allgather_ms": got["allgather_ms"],
                "free_ms": wire_ms - got["allgather_ms"],
                "drops": got["drops"],
                "burst_ms": 1e3 * 8 * settings.burst_bytes / settings.bandwidth_bps,
            }
            rows.append(row)
            print(
                f"{link:8s} payload {payload:>9,d} B/rank  burst {shape['burst']:>5s} mtu {shape['mtu']:>5d}: "
                f"all-gather {row['allgather_ms']:7.1f} ms, wire {wire_ms:7.1f} ms, free {row['free_ms']:6.1f} ms "
                f"(burst / rate {row['burst_ms']:.1f} ms), {got['drops']} drops",
                flush=True,
            )
    tmp.unlink(missing_ok=True)
    result = {
        "procs": args.procs,
        "iters": args.iters,
        "host": platform.node(),
        "date": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()),
        "rows": rows,
    }
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text(json.dumps(result, indent=1))
    print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
