"""jaxcomm: communication-efficient distributed training in JAX.

Compressors and error feedback are optax gradient transformations; collectives
run on a named mesh axis inside ``jax.shard_map`` or over MPI processes.
"""

from . import comm, compressors, experiments, testing
from .compressors import wire_bits

__version__ = "0.1.0"

__all__ = ["comm", "compressors", "experiments", "testing", "wire_bits", "__version__"]
