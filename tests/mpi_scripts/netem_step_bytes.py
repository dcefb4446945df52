"""MPI worker: the bytes one ``compressed_mean`` step sends through the emulated link.

Usage: ``python tests/mpi_scripts/netem_step_bytes.py ROWS OUT.json`` under ``jaxcomm launch``
(or :func:`jaxcomm.netem.launch`). Every rank holds a float32 gradient ``{"w": (ROWS, 1024)}``
(``4096 ROWS`` bytes, different on every rank) and runs, for each case of :data:`CASES`,
``jaxcomm.compressed_mean(compressor, comm=MPIComm(), strategy=...)`` inside ``jax.jit``:
twice to warm up (compilation, TCP connections), then once between barriers while rank 0
reads the loopback qdisc's counters (:func:`jaxcomm.netem.link_counters`), as in
``netem_bytes.py``: a window with the barriers alone, and a window with the step. Rank 0
writes, per case, both windows (bytes, packets, drops), the step window's wall seconds,
``state.wire_bits.sum()`` and ``state.messages`` to OUT.json. A window in which TCP
retransmitted a segment (``RetransSegs`` of the namespace's ``/proc/net/snmp``; such a
segment crosses the link twice) is kept under ``retried`` and measured again, up to
``TRIES`` times. Every rank checks that the
step's output is the workers' mean for the exact compressors (``none``, ``fp16`` on values
representable in float16).
"""

from __future__ import annotations

import json
import sys
import time

import jax
import jax.numpy as jnp
import numpy as np
from mpi4py import MPI

import jaxcomm as jc
from jaxcomm.comm import MPIComm
from jaxcomm.netem import link_counters

COLS = 1024
TRIES = 5
CASES = {  # name: (compressor, strategy)
    "none": (lambda: jc.compressors.none(), "allreduce"),
    "topk": (lambda: jc.compressors.topk(ratio=0.01), "allgather"),
    "fp16": (lambda: jc.compressors.fp16(), "reduce_scatter"),
    "powersgd": (lambda: jc.compressors.powersgd(rank=2), "allreduce"),
}


def gradient(rank: int, rows: int) -> dict:
    """Rank ``rank``'s gradient: multiples of 1/64 in [-8, 8) (exact in float16), distinct per rank."""
    rng = np.random.default_rng(1234 + rank)
    return {"w": jnp.asarray(rng.integers(-512, 512, size=(rows, COLS)) / 64.0, jnp.float32)}


def tcp_retransmissions() -> int:
    """Segments TCP retransmitted in this network namespace (``RetransSegs`` of ``/proc/net/snmp``):
    a retransmission (a tail loss probe after a delayed ACK, say) puts payload on the link twice."""
    with open("/proc/net/snmp") as f:
        rows = [line.split() for line in f if line.startswith("Tcp:")]
    return int(rows[1][rows[0].index("RetransSegs")])


def main() -> None:
    rows, out = int(sys.argv[1]), sys.argv[2]
    comm = MPIComm()
    world = MPI.COMM_WORLD
    n, r = comm.size, comm.rank
    g = gradient(r, rows)
    mean = sum(np.asarray(gradient(i, rows)["w"], np.float64) for i in range(n)) / n

    def window(run):
        world.Barrier()
        c0 = link_counters() if r == 0 else None
        x0 = tcp_retransmissions() if r == 0 else 0
        world.Barrier()
        t0 = time.perf_counter()
        run()
        world.Barrier()
        wall = time.perf_counter() - t0
        c1 = link_counters() if r == 0 else None
        if r != 0:
            return None
        c = c1 - c0
        return {
            "bytes": c.bytes,
            "packets": c.packets,
            "drops": c.drops,
            "qdisc": c.kind,
            "wall_s": wall,
            "retransmitted": tcp_retransmissions() - x0,
        }

    report: dict = {"n": n, "shape": [rows, COLS], "gradient_bytes": rows * COLS * 4, "cases": {}}
    for name, (make, strategy) in CASES.items():
        tx = jc.compressed_mean(make(), comm=comm, strategy=strategy)
        step = jax.jit(tx.update)
        state = tx.init(g)
        for _ in range(2):  # compile, connect, warm PowerSGD's Q
            upd, state = step(g, state)
            jax.block_until_ready((upd, state))
        if name in ("none", "fp16"):
            np.testing.assert_allclose(np.asarray(upd["w"], np.float64), mean, rtol=0, atol=4e-3)  # fp16: 2**-9
        holder = {"state": state}

        def one(holder=holder, step=step):
            u, s = step(g, holder["state"])
            jax.block_until_ready((u, s))
            holder["state"] = s

        retried = []
        for _ in range(TRIES):  # measure again while TCP retransmitted inside the window
            base = window(lambda: None)
            meas = window(one)
            again = world.bcast(r == 0 and (base["retransmitted"] > 0 or meas["retransmitted"] > 0), root=0)
            if not again:
                break
            if r == 0:
                retried.append({"barriers": base, "window": meas})
        if r == 0:
            s = holder["state"]
            report["cases"][name] = {
                "strategy": strategy,
                "wire_bits": int(np.asarray(s.wire_bits, np.int64).sum()),
                "messages": int(s.messages),
                "barriers": base,
                "window": meas,
                "retried": retried,
            }
    if r == 0:
        with open(out, "w") as f:
            json.dump(report, f)
        print(json.dumps(report))


if __name__ == "__main__":
    main()
