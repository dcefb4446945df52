"""Device-mesh set-up for data-parallel workers on one named axis."""

from __future__ import annotations

import jax
import jax.numpy as jnp
from jax.sharding import Mesh, NamedSharding
from jax.sharding import PartitionSpec as P

from .._validate import check_int

__all__ = ["make_mesh", "shard_workers", "stack_workers", "unstack_worker"]


def make_mesh(num_workers: int | None = None, axis_name: str = "data") -> Mesh:
    """A 1-D mesh of ``num_workers`` devices (default: all) with axis ``axis_name``.

    Raises:
      ValueError: more workers than devices, with the XLA flag that simulates more on CPU.
    """
    available = jax.device_count()
    if num_workers is None:
        num_workers = available
    num_workers = check_int(num_workers, "num_workers")
    if not isinstance(axis_name, str) or not axis_name:
        raise TypeError(f"axis_name must be a non-empty string; got {axis_name!r}")
    if num_workers > available:
        raise ValueError(
            f"num_workers={num_workers} but this process sees only {available} device(s) "
            f"({jax.devices()[0].platform}). On CPU, simulate more by setting "
            f"XLA_FLAGS=--xla_force_host_platform_device_count={num_workers} before importing jax "
            f"(the jaxcomm command line does this for --devices)."
        )
    return jax.make_mesh((num_workers,), (axis_name,), devices=jax.devices()[:num_workers])


def stack_workers(tree, num_workers: int):
    """Repeat every leaf on a new leading worker axis: ``(n, *leaf.shape)``."""
    num_workers = check_int(num_workers, "num_workers")
    return jax.tree.map(lambda x: jnp.broadcast_to(jnp.asarray(x), (num_workers, *jnp.shape(x))), tree)


def unstack_worker(tree, index: int = 0):
    """Worker ``index``'s slice of a tree with a leading worker axis."""
    return jax.tree.map(lambda x: x[index], tree)


def shard_workers(tree, mesh: Mesh):
    """Place a tree whose leaves have a leading worker axis so that axis is split over the mesh."""
    axis = mesh.axis_names[0]
    sharding = NamedSharding(mesh, P(axis))
    return jax.tree.map(lambda x: jax.device_put(x, sharding), tree)
