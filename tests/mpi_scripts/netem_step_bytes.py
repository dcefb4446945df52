"""MPI worker: the bytes one ``compressed_mean`` step sends through the emulated link.

Usage: ``python tests/mpi_scripts/netem_step_bytes.py ROWS OUT.json`` under ``jaxcomm launch``
(or :func:`jaxcomm.netem.launch`). Every rank holds a float32 gradient ``{"w": (ROWS, 1024)}``
(``4096 ROWS`` bytes, different on every rank) and runs, for each case of :data:`CASES`,
``jaxcomm.compressed_mean(compressor, comm=MPIComm(), strategy=...)`` inside ``jax.jit``:
twice to warm up (compilation, TCP connections), then once between barriers while rank 0
reads the loopback qdisc's counters (:func:`jaxcomm.netem.measure`): a window with the
barriers alone, and a window with the step. Rank 0 writes, per case, both windows (bytes,
packets, drops), the step window's wall seconds, ``state.wire_bits.sum()`` and
``state.messages`` to OUT.json. A window in which TCP retransmitted a segment (``RetransSegs``
of the namespace's ``/proc/net/snmp``; such a segment crosses the link twice) is kept under
``retried`` and measured again, up to ``TRIES`` times. Every rank checks that the
step's output is the workers' mean for the exact compressors (``none``, ``fp16`` on values
representable in float16). ``threshold`` (Threshold-v, a data-dependent count in a buffer of
capacity ``d``) goes through the variable-length all-gather: a count gather, then the smallest
bucket that holds every rank's valid entries.
"""

from __future__ import annotations

import json
import sys

import jax
import jax.numpy as jnp
import numpy as np

import jaxcomm as jc
from jaxcomm.comm import MPIComm
from jaxcomm.netem import measure

COLS = 1024
# A retry costs one step (under 1 s at 4 MiB); on a loaded machine delayed ACKs make tail loss
# probes common enough that 5 tries all saw one, so the window is measured up to 20 times.
TRIES = 20
THRESHOLD_V = 7.9  # |g| >= 7.9 for g = k / 64, k in [-512, 512): |k| >= 506, about 1.3 % of the entries
CASES = {  # name: (compressor, strategy)
    "none": (lambda: jc.compressors.none(), "allreduce"),
    "topk": (lambda: jc.compressors.topk(ratio=0.01), "allgather"),
    "threshold": (lambda: jc.compressors.threshold(v=THRESHOLD_V), "allgather"),
    "fp16": (lambda: jc.compressors.fp16(), "reduce_scatter"),
    "powersgd": (lambda: jc.compressors.powersgd(rank=2), "allreduce"),
}


def gradient(rank: int, rows: int) -> dict:
    """Rank ``rank``'s gradient: multiples of 1/64 in [-8, 8) (exact in float16), distinct per rank."""
    rng = np.random.default_rng(1234 + rank)
    return {"w": jnp.asarray(rng.integers(-512, 512, size=(rows, COLS)) / 64.0, jnp.float32)}


def main() -> None:
    from mpi4py import MPI  # here, so that tests can import gradient() without starting MPI

    rows, out = int(sys.argv[1]), sys.argv[2]
    comm = MPIComm()
    world = MPI.COMM_WORLD
    n, r = comm.size, comm.rank
    g = gradient(r, rows)
    everyone = [np.asarray(gradient(i, rows)["w"]) for i in range(n)]
    mean = sum(e.astype(np.float64) for e in everyone) / n

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
        if name == "threshold":  # the mean of the entries |g| >= v: sums of a few k / 64, exact in float32
            sent = [np.where(np.abs(g_i) >= np.float32(THRESHOLD_V), g_i, 0) for g_i in everyone]
            np.testing.assert_array_equal(np.asarray(upd["w"]), (sum(sent) / n).astype(np.float32))
        holder = {"state": state}

        def one(holder=holder, step=step):
            u, s = step(g, holder["state"])
            jax.block_until_ready((u, s))
            holder["state"] = s

        measured = measure(one, world, tries=TRIES)  # again while TCP retransmitted inside the window
        if measured is not None:  # rank 0
            s = holder["state"]
            report["cases"][name] = {
                "strategy": strategy,
                "wire_bits": int(np.asarray(s.wire_bits, np.int64).sum()),
                "messages": int(s.messages),
                **measured.to_json(),
            }
    if r == 0:
        with open(out, "w") as f:
            json.dump(report, f)
        print(json.dumps(report))


if __name__ == "__main__":
    main()
