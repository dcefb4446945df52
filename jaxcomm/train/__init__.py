"""Training: mesh set-up, the jit-compiled step, the two loops (data-parallel and simulated), checkpoints.

>>> import optax, jaxcomm as jc
>>> from flax import nnx
>>> # tx = optax.chain(jc.compressed_mean(jc.compressors.topk(ratio=0.01)), optax.sgd(0.1))
>>> # trainer = jc.train.Trainer(model, tx)
"""

from ._checkpoint import (
    ACCEPTABLE_CHANGES,
    Checkpointer,
    CheckpointError,
    latest_step,
    restore_checkpoint,
    save_checkpoint,
)
from ._mesh import make_mesh, shard_workers, stack_workers, unstack_worker
from ._nnx import (
    PureModel,
    classification_eval,
    classification_loss,
    evaluate_classifier,
    language_model_loss,
    split_model,
)
from ._simulate import SimulationResult, simulate
from ._step import TrainState, collect_counter, init_train_state, make_train_step
from ._trainer import NonFiniteLossError, Trainer, to_workers

__all__ = [
    "ACCEPTABLE_CHANGES",
    "CheckpointError",
    "Checkpointer",
    "NonFiniteLossError",
    "PureModel",
    "TrainState",
    "Trainer",
    "classification_eval",
    "classification_loss",
    "collect_counter",
    "evaluate_classifier",
    "init_train_state",
    "language_model_loss",
    "latest_step",
    "make_mesh",
    "make_train_step",
    "restore_checkpoint",
    "SimulationResult",
    "save_checkpoint",
    "shard_workers",
    "simulate",
    "split_model",
    "stack_workers",
    "to_workers",
    "unstack_worker",
]
