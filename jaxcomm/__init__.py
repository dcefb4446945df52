"""jaxcomm: communication-efficient distributed training in JAX.

Compressors and error feedback are optax gradient transformations; collectives
run on a named mesh axis inside ``jax.shard_map`` or over MPI processes.

>>> import optax, jaxcomm as jc
>>> tx = optax.chain(jc.error_feedback(jc.compressors.topk(ratio=0.01)), optax.sgd(0.1, momentum=0.9))
"""

from . import (
    algorithms,
    comm,
    compressors,
    cost_model,
    data,
    experiments,
    imbalance,
    memory,
    models,
    testing,
    topology,
    train,
    transforms,
)
from .compressors import wire_bits
from .transforms import compressed_mean, doublesqueeze, error_feedback, gradient_dropping, periodic_average

__version__ = "0.1.0"

__all__ = [
    "algorithms",
    "comm",
    "compressed_mean",
    "compressors",
    "cost_model",
    "data",
    "doublesqueeze",
    "error_feedback",
    "experiments",
    "gradient_dropping",
    "imbalance",
    "memory",
    "models",
    "periodic_average",
    "testing",
    "topology",
    "train",
    "transforms",
    "wire_bits",
    "__version__",
]
