"""A ``jax.distributed`` job as a cluster of emulated nodes: the nodes' addresses and environment.

Node ``i`` is ``CLUSTER_SUBNET.(i + 1)`` (:func:`node_address`) on its ``eth0``, one end of a veth
pair whose other end is a port of the switch, a bridge named ``jcswitch``; every process starts with
:func:`cluster_env` and calls :func:`initialize_distributed`.
"""

from __future__ import annotations

import os

MAX_NODES = 254
"""The most processes (nodes) of a ``jax.distributed`` job (``-n`` with ``--jax``): one address each
in :data:`CLUSTER_SUBNET`."""
MAX_DEVICES_PER_PROCESS = 1024
"""The most CPU devices of one process of a ``jax.distributed`` job (``--devices-per-process``)."""
CLUSTER_SUBNET = "192.0.2"
"""The nodes' addresses, ``192.0.2.1`` (node 0) to ``192.0.2.n``: TEST-NET-1 (RFC 5737), reserved
for documentation, so no real network uses it; it exists only inside the job's namespaces."""
COORDINATOR_PORT = 8476
"""The port of ``jax.distributed``'s coordinator on node 0 (the namespaces are private: always free)."""
VETH_MTU = 65535  # the largest MTU of a veth device (the loopback's 65536 is one more)
BRIDGE = "jcswitch"  # the switch: a bridge in the launcher's namespace


def node_address(index: int) -> str:
    """Node ``index``'s address in a ``jax.distributed`` job: ``CLUSTER_SUBNET.(index + 1)``."""
    return f"{CLUSTER_SUBNET}.{index + 1}"


def cluster_env(nodes: int, devices_per_process: int, base: dict | None = None) -> dict:
    """The environment every process of a ``jax.distributed`` job starts with (its
    ``JAX_PROCESS_ID`` is added by its node).

    ``base`` (default ``os.environ``) with ``JAX_COORDINATOR_ADDRESS`` (node 0,
    :data:`COORDINATOR_PORT`), ``JAX_NUM_PROCESSES``, ``JAX_PLATFORMS=cpu``,
    ``JAX_CPU_COLLECTIVES_IMPLEMENTATION=gloo`` and ``XLA_FLAGS`` whose
    ``--xla_force_host_platform_device_count`` is ``devices_per_process`` (other flags kept).
    """
    env = dict(os.environ if base is None else base)
    flags = [f for f in env.get("XLA_FLAGS", "").split() if "xla_force_host_platform_device_count" not in f]
    flags.append(f"--xla_force_host_platform_device_count={devices_per_process}")
    env.update(
        JAX_COORDINATOR_ADDRESS=f"{node_address(0)}:{COORDINATOR_PORT}",
        JAX_NUM_PROCESSES=str(nodes),
        JAX_PLATFORMS="cpu",
        JAX_CPU_COLLECTIVES_IMPLEMENTATION="gloo",
        XLA_FLAGS=" ".join(flags),
    )
    env.pop("JAX_PROCESS_ID", None)
    return env


def initialize_distributed(**kwargs) -> tuple[int, int]:
    """``jax.distributed.initialize`` from the environment :func:`launch` gives a ``jax.distributed``
    job's processes (:func:`cluster_env`); ``(process_id, num_processes)``.

    Call it before anything else uses JAX. ``kwargs`` go to ``jax.distributed.initialize``
    (e.g. ``initialization_timeout``).

    Raises:
      RuntimeError: not in such a job (naming the missing variables).
    """
    names = ("JAX_COORDINATOR_ADDRESS", "JAX_NUM_PROCESSES", "JAX_PROCESS_ID")
    missing = [name for name in names if name not in os.environ]
    if missing:
        raise RuntimeError(
            f"initialize_distributed: {', '.join(missing)} not set; start the script with "
            "jaxcomm launch --jax -n N --devices-per-process K -- python script.py"
        )
    import jax

    pid, count = int(os.environ["JAX_PROCESS_ID"]), int(os.environ["JAX_NUM_PROCESSES"])
    jax.distributed.initialize(os.environ["JAX_COORDINATOR_ADDRESS"], count, pid, **kwargs)
    return pid, count
