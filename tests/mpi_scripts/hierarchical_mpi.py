"""MPI worker: the hierarchical mean with MPIComm outside and a mesh axis of 2 devices inside each process.

Usage: ``mpirun -n 2 python tests/mpi_scripts/hierarchical_mpi.py OUT.npz``. Every process sees two CPU
devices; each runs ``compressed_mean(c, "local", comm=MPIComm(), ...)`` for every strategy of
``test_hierarchical.LOSSY`` with the residual memory on the 2-D gradients of ``test_hierarchical.gradients(2)``
(process ``a`` holds node ``a``'s rows), and checks the refusals (``skip_nonfinite=True``, ``update`` under
``jax.jit``, a leading axis that is not the device count, ``diloco``). Rank 0 saves ``{strategy}/...`` arrays
stacked over the processes: ``out{t}/{leaf}`` ``(N, L, *shape)``, ``memory/{leaf}`` ``(N, L, d / L)``,
``slow_bits``, ``fast_bits`` ``(N, L, num_leaves)``, ``counts`` ``(N, L, 4)`` (slow and fast ``count`` and
``notfinite_count``), and ``refusals_ok``.
"""

from __future__ import annotations

import os
import sys
from pathlib import Path

os.environ["XLA_FLAGS"] = " ".join(
    [*os.environ.get("XLA_FLAGS", "").split(), "--xla_force_host_platform_device_count=2"]
)
HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE.parent))

import jax  # noqa: E402
import numpy as np  # noqa: E402
import optax  # noqa: E402
import test_hierarchical as th  # noqa: E402
from mpi4py import MPI  # noqa: E402

from jaxcomm.comm import MPIComm  # noqa: E402
from jaxcomm.transforms import compressed_mean, diloco  # noqa: E402


def refusals(comm: MPIComm) -> bool:
    """Every refusal raises its ValueError, naming the argument."""
    cases = [
        (lambda: compressed_mean(th.NONE, "local", comm=comm, skip_nonfinite=True), "skip_nonfinite=True"),
        (lambda: diloco(optax.sgd(0.1), 2, axis_name="local", comm=comm), "diloco with comm="),
    ]
    tx = compressed_mean(th.NONE, "local", comm=comm)
    state = tx.init(th.PARAMS)
    rows = {k: np.zeros((2, *s), np.float32) for k, s in th.SHAPES.items()}
    cases.append((lambda: jax.jit(tx.update)(rows, state), r"updates\['b'\] is traced"))
    cases.append((lambda: tx.update({k: v[0] for k, v in rows.items()}, state), "leading axis of length 2"))
    import re

    for fn, match in cases:
        try:
            fn()
        except ValueError as e:
            assert re.search(match, str(e)), (match, str(e))
        else:
            raise AssertionError(f"no ValueError for {match!r}")
    return True


def main(out: str) -> None:
    comm = MPIComm()
    assert comm.size == th.N and jax.local_device_count() == th.L, "run under mpirun -n 2 (2 devices each)"
    a = comm.rank
    grads = th.gradients(2)
    mine: dict = {"refusals_ok": np.int32(refusals(comm))}
    for strategy in th.STRATEGIES:
        c, fast = th.LOSSY[strategy], th.FAST.get(strategy)
        tx = compressed_mean(c, "local", comm=comm, memory=th.RESIDUAL, strategy=strategy, fast=fast)
        state = tx.init(th.PARAMS)
        for t, g in enumerate(grads):
            updates, state = tx.update({k: v[a] for k, v in g.items()}, state)
            for k in th.SHAPES:
                mine[f"{strategy}/out{t}/{k}"] = np.asarray(updates[k])
        for k in th.SHAPES:
            mine[f"{strategy}/memory/{k}"] = np.asarray(state.slow.memory[k])
        mine[f"{strategy}/slow_bits"] = np.asarray(state.slow.wire_bits)
        mine[f"{strategy}/fast_bits"] = np.asarray(state.fast.wire_bits)
        mine[f"{strategy}/counts"] = np.stack(
            [
                np.asarray(v)
                for v in (state.slow.count, state.fast.count, state.slow.notfinite_count, state.fast.notfinite_count)
            ],
            axis=-1,
        )
    every = MPI.COMM_WORLD.gather(mine, root=0)
    if a == 0:
        np.savez(out, **{k: np.stack([m[k] for m in every]) for k in mine})
        print("hierarchical over MPI: ok")


if __name__ == "__main__":
    main(sys.argv[1])
