"""Training: mesh set-up, the jit-compiled step, the two loops (data-parallel and simulated), checkpoints.

>>> import optax, jaxcomm as jc
>>> from flax import nnx
>>> # tx = optax.chain(jc.compressed_mean(jc.compressors.topk(ratio=0.01)), optax.sgd(0.1))
>>> # trainer = jc.train.Trainer(model, tx)
"""

from ._checkpoint import Checkpointer, CheckpointError
from ._mesh import make_mesh
from ._nnx import classification_eval, classification_loss, evaluate_classifier, language_model_loss, split_model
from ._simulate import simulate
from ._trainer import NonFiniteLossError, Trainer

__all__ = [
    "Trainer",
    "NonFiniteLossError",
    "Checkpointer",
    "CheckpointError",
    "make_mesh",
    "simulate",
    "split_model",
    "classification_loss",
    "language_model_loss",
    "classification_eval",
    "evaluate_classifier",
]
