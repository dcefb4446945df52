"""MPI worker: Streaming DiLoCo over MPIComm, exchanged in the step and overlapped; rank 0 saves.

Usage: ``mpirun -n 3 python tests/mpi_scripts/diloco_mpi.py OUT.npz``. Each rank is worker ``rank``
of :mod:`diloco_common`'s problem and takes 13 steps of
``diloco(sgd(0.05, momentum=0.5), every=6, fragments=3, delay=1, blend=0.25)`` twice: with the
exchanges inside the step (mpi4jax), and with ``overlap=True`` (a communication thread), where the
last rank sleeps 0.3 s after every step that starts an exchange, so the others run their next
inner step while that rank's part of the exchange is still to come; then both again with top-k 50 %
and residual memory on the outer gradient (``*_sparse``: the overlap's gather route). The npz holds
``{case}/{leaf}`` arrays ``(n, *shape)``: every rank's final parameters.
"""

from __future__ import annotations

import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

import jax
import jax.numpy as jnp
import numpy as np
import optax
from diloco_common import KEYS, N, _grad, _problem
from mpi4py import MPI

import jaxcomm as jc
from jaxcomm.comm import MPIComm, use

STEPS, EVERY, FRAGMENTS = 13, 6, 3


def run(comm: MPIComm, overlap: bool, sparse: bool = False) -> dict:
    scale, target, theta0 = _problem()
    a = {k: jnp.asarray(scale[k][comm.rank]) for k in KEYS}
    b = {k: jnp.asarray(target[k][comm.rank]) for k in KEYS}
    outer_gradient = {"compressor": jc.compressors.topk(ratio=0.5), "memory": jc.memory.residual()} if sparse else {}
    tx = jc.diloco(
        optax.sgd(0.05, momentum=0.5),
        every=EVERY,
        fragments=FRAGMENTS,
        delay=1,
        blend=0.25,
        overlap=overlap,
        **outer_gradient,
    )
    params = {k: jnp.asarray(theta0[k]) for k in KEYS}
    state = tx.init(params)

    @jax.jit
    def step(params, state):
        g = jax.tree.map(_grad, a, b, params)
        with use(comm):
            u, state = tx.update(g, state, params)
        return optax.apply_updates(params, u), state

    for t in range(1, STEPS + 1):
        params, state = step(params, state)
        jax.block_until_ready(params)
        if overlap and comm.rank == comm.size - 1 and t % (EVERY // FRAGMENTS) == 0:
            time.sleep(0.3)  # a late rank: its part of the exchange comes after the others' next steps
    return {k: np.asarray(v) for k, v in params.items()}


def main(out: str) -> None:
    comm = MPIComm()
    assert comm.size == N, f"run under mpirun -n {N}"
    results = {}
    cases = (
        ("in_step", False, False),
        ("overlap", True, False),
        ("in_step_sparse", False, True),
        ("overlap_sparse", True, True),
    )
    for case, overlap, sparse in cases:
        final = run(comm, overlap, sparse)
        for k, v in final.items():
            gathered = MPI.COMM_WORLD.gather(v, root=0)
            if comm.rank == 0:
                results[f"{case}/{k}"] = np.stack(gathered)
    if comm.rank == 0:
        np.savez(out, **results)


if __name__ == "__main__":
    main(sys.argv[1])
