"""jaxcomm: communication-efficient distributed training in JAX.

Compressors and error feedback are optax gradient transformations; collectives
run on a named mesh axis inside ``jax.shard_map`` or over MPI processes.

>>> import optax, jaxcomm as jc
>>> tx = optax.chain(jc.error_feedback(jc.compressors.topk(ratio=0.01)), optax.sgd(0.1, momentum=0.9))

``import jaxcomm`` imports no submodule: each one (and so JAX, Flax, Orbax or
Matplotlib) is imported on first attribute access (PEP 562), so the command
line and the MPI worker scripts start fast.
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING

__version__ = "0.1.0"

# The public names, grouped. Each submodule is imported on first use (``__getattr__`` below).
_SUBMODULES = (
    # communication-efficient optimisation
    "compressors",  # lossy operators with exact wire formats, and their registry
    "memory",  # error-feedback memories
    "transforms",  # optax transformations that communicate
    "comm",  # communicators: mesh axis, MPI
    "topology",  # graphs and mixing matrices for decentralized training
    "algorithms",  # parameter-level algorithms: D-PSGD, EventGraD, eager-SGD
    # modelling and training
    "imbalance",  # load-imbalance models
    "cost_model",  # alpha-beta communication time
    "train",  # mesh, jit-compiled step, training loop, checkpoints
    "models",  # Flax models of the experiments
    "data",  # offline datasets and per-worker batching
    # running studies, and checks
    "studies",  # the registry behind ``jaxcomm list`` and ``jaxcomm run NAME``
    "testing",  # the compressor contract battery
)

# Functions re-exported at the top level: name -> submodule defining it.
_REEXPORTS = {
    "compressed_mean": "transforms",
    "deep_gradient_compression": "transforms",
    "local_clip": "transforms",
    "topk_warmup": "transforms",
    "error_feedback": "transforms",
    "doublesqueeze": "transforms",
    "gradient_dropping": "transforms",
    "periodic_average": "transforms",
    "diloco": "transforms",
    "wire_bits": "compressors",
    "BitCount": "compressors",
}

if TYPE_CHECKING:  # static tools (type checkers, the API docs) see plain imports
    # `name as name`: an explicit re-export (PEP 484), so neither ruff (F401) nor mypy
    # calls these unused; the runtime path is __getattr__ below.
    from . import algorithms as algorithms
    from . import comm as comm
    from . import compressors as compressors
    from . import cost_model as cost_model
    from . import data as data
    from . import imbalance as imbalance
    from . import memory as memory
    from . import models as models
    from . import studies as studies
    from . import testing as testing
    from . import topology as topology
    from . import train as train
    from . import transforms as transforms
    from .compressors import BitCount as BitCount
    from .compressors import wire_bits as wire_bits
    from .transforms import compressed_mean as compressed_mean
    from .transforms import deep_gradient_compression as deep_gradient_compression
    from .transforms import diloco as diloco
    from .transforms import doublesqueeze as doublesqueeze
    from .transforms import error_feedback as error_feedback
    from .transforms import gradient_dropping as gradient_dropping
    from .transforms import local_clip as local_clip
    from .transforms import periodic_average as periodic_average
    from .transforms import topk_warmup as topk_warmup

__all__ = [*_SUBMODULES, *_REEXPORTS, "__version__"]


def __getattr__(name: str):
    """Import a submodule or a re-exported function on first access, then cache it here."""
    if name in _SUBMODULES:
        value = importlib.import_module(f"{__name__}.{name}")
    elif name in _REEXPORTS:
        value = getattr(importlib.import_module(f"{__name__}.{_REEXPORTS[name]}"), name)
    else:
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    globals()[name] = value
    return value


def __dir__() -> list[str]:
    """The public names (``__all__``), whether imported yet or not."""
    return sorted(__all__)
