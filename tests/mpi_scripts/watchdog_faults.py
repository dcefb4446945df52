"""MPI worker: a jitted ``compressed_mean`` step under :class:`MPIWatchdog`, one rank at fault.

Run: ``mpirun -n P python watchdog_faults.py SCENARIO TIMEOUT``. The last rank is
the culprit; nothing is caught (the documented ``with comm.watchdog(...)`` usage).
Scenarios, the fault striking before or in step ``FAULT_STEP``:

* ``ok``: no fault; every rank prints ``rank r done <params>`` and the job exits 0.
* ``slow``: the culprit sleeps ``TIMEOUT / 3`` s before a step: it only slows the job.
* ``hang``: the culprit's application sleeps forever between two steps (its
  watchdog thread keeps beating): the others wait inside the next step.
* ``stop``: the culprit stops itself (``SIGSTOP``) inside a step: no more heartbeats.
* ``raise``: the culprit raises inside a step.
* ``exit`` / ``kill``: the culprit exits with status 3 / is killed (``SIGKILL``)
  inside a step: ``mpirun`` itself ends the job and names it.
* ``fewer``: the culprit makes one step fewer than the others (it closes while
  they wait inside their last step).
* ``fewer_local``: as ``fewer`` with a step without collectives, so every rank
  reaches the close-time count check.
"""

from __future__ import annotations

import os
import signal
import sys
import time

import jax
import jax.numpy as jnp
import numpy as np
import optax

import jaxcomm as jc
from jaxcomm.comm import MPIComm
from jaxcomm.transforms import compressed_mean

STEPS = 8
FAULT_STEP = 3


def main(scenario: str, timeout: float) -> None:
    comm = MPIComm()
    bad = comm.rank == comm.size - 1
    local = scenario == "fewer_local"
    tx = (
        optax.sgd(0.1)
        if local
        else optax.chain(compressed_mean(jc.compressors.topk(ratio=0.5), comm=comm), optax.sgd(0.1))
    )
    x = jnp.ones((8,), jnp.float32)
    state = tx.init(x)

    @jax.jit
    def jstep(x, state, key):
        g = x * jax.random.uniform(key, x.shape, x.dtype)
        u, state = tx.update(g, state, x)
        return optax.apply_updates(x, u), state

    def body(x, state, key, t):
        if bad and t == FAULT_STEP:
            if scenario in ("stop", "raise", "exit", "kill"):
                print(f"rank {comm.rank} fault at {time.time():.3f}", flush=True)
            if scenario == "stop":
                os.kill(os.getpid(), signal.SIGSTOP)
            elif scenario == "exit":
                os._exit(3)
            elif scenario == "kill":
                os.kill(os.getpid(), signal.SIGKILL)
            elif scenario == "raise":
                raise RuntimeError("the culprit's step failed")
        return jstep(x, state, key)

    if local:
        # Without collectives the ranks do not wait for each other, so a rank still compiling
        # its first step when a faster one closes would (rightly) be named for not closing;
        # compile before the watched loop.
        jstep(x, state, jax.random.PRNGKey(0))
    steps = STEPS - 1 if (bad and scenario.startswith("fewer")) else STEPS
    with comm.watchdog(timeout_s=timeout) as wd:
        step = wd.watch(body)
        for t in range(steps):
            if bad and t == FAULT_STEP:
                if scenario in ("hang", "slow"):
                    print(f"rank {comm.rank} fault at {time.time():.3f}", flush=True)
                if scenario == "hang":
                    time.sleep(3600)
                elif scenario == "slow":
                    time.sleep(timeout / 3)
            x, state = step(x, state, jax.random.PRNGKey(t), t)
    print(f"rank {comm.rank} done {np.asarray(x).tolist()}", flush=True)


if __name__ == "__main__":
    main(sys.argv[1], float(sys.argv[2]))
