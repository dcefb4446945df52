"""One process of a multi-process data-parallel run (jax.distributed, CPU devices, gloo).

usage: train_distributed.py PROCESS_ID NUM_PROCESSES PORT DEVICES_PER_PROCESS OUT
Process 0 writes the final parameters, losses and wire bits to OUT (.npz).
"""

import os
import sys

pid, nproc, port, ndev, out = int(sys.argv[1]), int(sys.argv[2]), int(sys.argv[3]), int(sys.argv[4]), sys.argv[5]
os.environ["XLA_FLAGS"] = " ".join(
    [*os.environ.get("XLA_FLAGS", "").split(), f"--xla_force_host_platform_device_count={ndev}"]
)
os.environ["JAX_PLATFORMS"] = "cpu"
sys.path.insert(0, os.path.dirname(__file__))

import jax  # noqa: E402

jax.config.update("jax_cpu_collectives_implementation", "gloo")
jax.distributed.initialize(f"127.0.0.1:{port}", num_processes=nproc, process_id=pid, initialization_timeout=120)

import digits_job  # noqa: E402

result = digits_job.run(jax.device_count())
if pid == 0:
    digits_job.save(out, *result)
jax.distributed.shutdown()
