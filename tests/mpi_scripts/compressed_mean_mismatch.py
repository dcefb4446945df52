"""MPI worker: ``compressed_mean`` over :class:`MPIComm` with one rank out of step.

Run: ``mpirun -n 3 python compressed_mean_mismatch.py SCENARIO``. The last rank's
parameters have 5 entries instead of 4 (``shape``) or are float16 instead of
float32 (``dtype``); ``ok`` has no mismatch. Each rank prints ``rank r: OK`` or
``rank r: ValueError: ...``, and exits 0 (the test reads the lines). No payload
may move before the error: the agreement check runs when the step is traced.
"""

from __future__ import annotations

import sys

import jax
import jax.numpy as jnp
import numpy as np
import optax

import jaxcomm as jc
from jaxcomm.comm import MPIComm
from jaxcomm.transforms import compressed_mean


def main(scenario: str) -> None:
    comm = MPIComm()
    bad = comm.size - 1
    n = 5 if (scenario == "shape" and comm.rank == bad) else 4
    dtype = jnp.float16 if (scenario == "dtype" and comm.rank == bad) else jnp.float32
    tx = optax.chain(compressed_mean(jc.compressors.topk(ratio=0.5), comm=comm), optax.sgd(0.1))
    x = jnp.ones((n,), dtype)
    state = tx.init(x)

    @jax.jit
    def step(x, state, key):
        g = x * jax.random.uniform(key, x.shape, x.dtype)
        u, state = tx.update(g, state, x)
        return optax.apply_updates(x, u), state

    try:
        for t in range(3):
            x, state = step(x, state, jax.random.PRNGKey(t))
        print(f"rank {comm.rank}: OK {np.asarray(x, np.float32).tolist()}", flush=True)
    except ValueError as e:
        print(f"rank {comm.rank}: ValueError: {e}".replace("\n", " "), flush=True)


if __name__ == "__main__":
    main(sys.argv[1])
