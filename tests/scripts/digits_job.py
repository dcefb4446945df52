"""The small data-parallel job shared by the multi-process tests and their in-process references."""

import jax
import numpy as np
import optax
from flax import nnx

import jaxcomm as jc
from jaxcomm import data, models
from jaxcomm.train import Trainer


def run(
    workers: int,
    comm=None,
    compressor: str = "qsgd",
    steps: int = 8,
    checkpoint_dir=None,
    stop=None,
    gather_metrics: bool = True,
):
    """Train an MLP on sklearn digits; return ``(param leaves, losses, wire bits)`` as NumPy arrays.

    The optimizer is built without ``axis_name``/``comm``: the trainer's communicator is used.
    With ``checkpoint_dir`` it saves every 2 steps and resumes; ``stop`` ends the run early there
    (an interrupted job). ``gather_metrics``: the trainer's (with ``comm``, ``False``: this
    process's own losses and bits).
    """
    ds = data.load_digits()
    model = models.MLP(in_features=64, hidden=(32,), num_classes=10, rngs=nnx.Rngs(0))
    c = jc.compressors.make(compressor, **({"levels": 4} if compressor == "qsgd" else {}))
    if compressor == "qsgd":  # ω = min(d/16, √d/4) >= 1: error feedback needs the 1/(1+ω) rescaling
        c = jc.compressors.contractive(c)
    tx = optax.chain(jc.compressed_mean(c, memory=jc.memory.residual()), optax.sgd(0.1, momentum=0.9))
    trainer = Trainer(
        model,
        tx,
        comm=comm,
        num_workers=None if comm is not None else workers,
        seed=0,
        gather_metrics=gather_metrics,
    )
    batches = data.WorkerBatches(data.split_iid(ds, workers, jax.random.PRNGKey(0)), 64, jax.random.PRNGKey(1))
    state, history = trainer.fit(
        trainer.init_state(), batches, stop or steps, progress=False, checkpoint_dir=checkpoint_dir, checkpoint_every=2
    )
    leaves = [np.asarray(x) for x in jax.tree.leaves(trainer.params_of(state))]
    return leaves, np.array([r["loss"] for r in history]), np.array([r["wire_bits_total"] for r in history])


def save(path, leaves, losses, bits):
    np.savez(path, *leaves, loss=losses, bits=bits)
