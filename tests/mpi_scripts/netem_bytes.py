"""MPI worker: the bytes one collective sends through the emulated link (run under ``jaxcomm launch``).

Usage: ``python tests/mpi_scripts/netem_bytes.py OP NBYTES OUT.json`` with OP ``sum`` (allreduce
by ``MPIComm().sum``), ``all_gather`` (``MPIComm().all_gather``) or ``none``. Each rank holds a
float32 array of NBYTES bytes. The op is compiled with ``jax.jit`` and run once before measuring
(so TCP connections and compilation are done). :func:`jaxcomm.netem.measure` then reads
the loopback qdisc's counters on rank 0 around two windows, each closed by barriers:

- ``barriers``: barrier, read, barrier, barrier, read  -- the cost of the barriers alone;
- ``window``:   barrier, read, barrier, OP, barrier, read.

Rank 0 writes both (bytes, packets, drops, retransmissions) to OUT.json; every rank checks the
op's result.
"""

from __future__ import annotations

import json
import sys

import jax
import jax.numpy as jnp
import numpy as np
from mpi4py import MPI

from jaxcomm.comm import MPIComm
from jaxcomm.netem import measure


def main() -> None:
    op, nbytes, out = sys.argv[1], int(sys.argv[2]), sys.argv[3]
    comm = MPIComm()
    world = MPI.COMM_WORLD
    n, r = comm.size, comm.rank
    x = jnp.full((nbytes // 4,), float(r + 1), jnp.float32)
    fn = {"sum": comm.sum, "all_gather": comm.all_gather, "none": lambda a: a}[op]
    step = jax.jit(fn)
    y = step(x).block_until_ready()  # compile, connect
    if op == "sum":
        np.testing.assert_array_equal(np.asarray(y), np.full(x.shape, n * (n + 1) / 2, np.float32))
    elif op == "all_gather":
        np.testing.assert_array_equal(
            np.asarray(y),
            np.repeat(np.arange(1, n + 1, dtype=np.float32)[:, None], x.size, 1),
        )

    m = measure(lambda: step(x).block_until_ready(), world)
    if m is not None:  # rank 0
        rows = {k: v for k, v in m.to_json().items() if k != "payload_bytes"}  # the test subtracts itself
        rows.update(n=n, payload_bytes=x.size * 4, collective=op)
        with open(out, "w") as f:
            json.dump(rows, f)
        print(json.dumps(rows))


if __name__ == "__main__":
    main()
