"""MPI worker: a jitted ``compressed_mean`` step under :class:`MPIWatchdog`, one rank at fault.

Run: ``mpirun -n P python watchdog_faults.py SCENARIO TIMEOUT``. The last rank is
the culprit; nothing is caught (the documented ``with comm.watchdog(...)`` usage).
Scenarios, the fault striking before or in step ``FAULT_STEP``:

* ``ok``: no fault; every rank prints ``rank r done <params>`` and the job exits 0.
* ``slow``: the culprit sleeps ``TIMEOUT / 3`` s before a step: it only slows the job.
* ``hang``: the culprit's application sleeps forever between two steps (its
  watchdog thread keeps beating): the others wait inside the next step.
* ``stop``: the culprit stops itself (``SIGSTOP``) inside a step: no more heartbeats.
* ``late``: with ``on_verdict="raise"``, the culprit waits between two steps until
  every other rank has reached its verdict, then goes on: every rank's ``except``
  runs (the others' when their blocked step returns, the culprit's at close) and
  the job exits 0.
* ``raise``: the culprit raises inside a step.
* ``exit`` / ``kill``: the culprit exits with status 3 / is killed (``SIGKILL``)
  inside a step: ``mpirun`` itself ends the job and names it.
* ``fewer``: the culprit makes one step fewer than the others (it closes while
  they wait inside their last step).
* ``fewer_local``: as ``fewer`` with a step without collectives, so every rank
  reaches the close-time count check.

In ``hang``, ``stop``, ``fewer`` and ``late`` the healthy rank 0 holds the GIL for
``1.25 * TIMEOUT`` s inside the step where the fault strikes, so its heartbeats are
late by more than the timeout (as on a busy machine) but by less than the silence
that names a rank when nobody is behind (twice the timeout): it must not be named.
"""

from __future__ import annotations

import ctypes
import os
import signal
import sys
import time

import jax
import jax.numpy as jnp
import numpy as np
import optax

import jaxcomm as jc
from jaxcomm.comm import MPIComm, MPIWatchdogError
from jaxcomm.comm._watchdog import _B_VERDICT
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

    fault_step = STEPS - 1 if scenario in ("fewer", "late") else FAULT_STEP
    late_beats = scenario in ("hang", "stop", "fewer", "late") and comm.rank == 0

    def body(x, state, key, t):
        if late_beats and t == fault_step:
            # A C call that keeps the GIL: this process's watchdog thread cannot beat meanwhile.
            ctypes.PyDLL(None).usleep(int(1.25 * timeout * 1e6))
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
    on_verdict = "raise" if scenario == "late" else "abort"
    try:
        with comm.watchdog(timeout_s=timeout, on_verdict=on_verdict) as wd:
            step = wd.watch(body)
            for t in range(steps):
                if bad and t == FAULT_STEP:
                    if scenario in ("hang", "slow"):
                        print(f"rank {comm.rank} fault at {time.time():.3f}", flush=True)
                    if scenario == "hang":
                        time.sleep(3600)
                    elif scenario == "slow":
                        time.sleep(timeout / 3)
                if bad and scenario == "late" and t == fault_step:
                    backstop = time.monotonic() + 60.0
                    while not all(wd._state[q][_B_VERDICT] for q in wd._peers) and time.monotonic() < backstop:
                        time.sleep(0.01)
                x, state = step(x, state, jax.random.PRNGKey(t), t)
    except MPIWatchdogError as e:  # only with on_verdict="raise"; an abort never gets here
        print(f"rank {comm.rank} caught {e}", flush=True)
        return
    print(f"rank {comm.rank} done {np.asarray(x).tolist()}", flush=True)


if __name__ == "__main__":
    main(sys.argv[1], float(sys.argv[2]))
