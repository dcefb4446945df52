"""Checkpoint and resume with orbax-checkpoint, bit-identically.

A checkpoint holds the whole :class:`~jaxcomm.train.TrainState` (parameters,
optimizer state with every error-feedback memory and server error, per-worker
PRNG keys, step) plus the data position and the run's metadata. Restoring
checks the tree structure, shapes and dtypes against the running job, so a
mismatched or corrupted checkpoint is an error, never a silent fresh start.
"""

from __future__ import annotations

import json
from pathlib import Path

import jax
import numpy as np
import orbax.checkpoint as ocp

__all__ = ["CheckpointError", "save_checkpoint", "restore_checkpoint", "latest_step"]


class CheckpointError(RuntimeError):
    """A checkpoint is missing, unreadable, or does not match the running job."""


def _signature(tree) -> dict:
    leaves, treedef = jax.tree.flatten(tree)
    return {
        "treedef": str(treedef),
        "shapes": [list(np.shape(x)) for x in leaves],
        "dtypes": [str(np.asarray(x).dtype) if not hasattr(x, "dtype") else str(x.dtype) for x in leaves],
    }


def _manager(directory: Path, max_to_keep: int | None = 3) -> ocp.CheckpointManager:
    options = ocp.CheckpointManagerOptions(max_to_keep=max_to_keep, create=True)
    return ocp.CheckpointManager(
        Path(directory).absolute(),
        options=options,
        item_names=("state", "meta"),
    )


def save_checkpoint(
    directory, step: int, state, *, position=None, metadata: dict | None = None, max_to_keep: int | None = 3
) -> Path:
    """Save ``state`` (any pytree of arrays) as checkpoint ``step`` under ``directory``.

    Args:
      directory: checkpoint root (created); one sub-folder per step.
      step: the step number (int).
      state: e.g. a ``TrainState``; sharded arrays are saved as they are.
      position: the data iterator's position (``(epoch, index)``), stored as JSON.
      metadata: JSON-serialisable run description (configuration); restore
        compares it with the running job's.
      max_to_keep: older checkpoints beyond this many are deleted.
    Returns:
      the checkpoint root.
    """
    directory = Path(directory)
    meta = {
        "step": int(step),
        "position": None if position is None else [int(v) for v in position],
        "metadata": metadata or {},
        "signature": _signature(state),
    }
    leaves = jax.tree.leaves(state)
    items = {f"leaf_{i:05d}": x for i, x in enumerate(leaves)}
    with _manager(directory, max_to_keep) as mngr:
        mngr.save(
            int(step),
            args=ocp.args.Composite(state=ocp.args.StandardSave(items), meta=ocp.args.JsonSave(meta)),
        )
        mngr.wait_until_finished()
    return directory


def latest_step(directory) -> int | None:
    """The newest checkpoint step under ``directory``, or ``None`` if there is none."""
    directory = Path(directory)
    if not directory.exists():
        return None
    with _manager(directory) as mngr:
        return mngr.latest_step()


def restore_checkpoint(directory, template, *, step: int | None = None, metadata: dict | None = None):
    """Restore checkpoint ``step`` (default: latest) into the structure of ``template``.

    ``template`` is a pytree like the saved state (e.g. a freshly initialised
    ``TrainState``); its shardings are used for the restored arrays.

    Returns:
      ``(state, position, metadata)``.
    Raises:
      CheckpointError: no checkpoint, unreadable files, or a structure, shape,
        dtype or metadata mismatch (the message says which).
    """
    directory = Path(directory)
    if not directory.exists():
        raise CheckpointError(f"no checkpoint directory at {directory}")
    with _manager(directory) as mngr:
        if step is None:
            step = mngr.latest_step()
        if step is None:
            raise CheckpointError(f"no checkpoint found in {directory}")
        try:
            meta = mngr.restore(step, args=ocp.args.Composite(meta=ocp.args.JsonRestore()))["meta"]
        except Exception as e:  # orbax raises several types for unreadable files
            raise CheckpointError(f"checkpoint {step} in {directory} is unreadable (metadata): {e}") from e
        expected = _signature(template)
        saved = meta.get("signature", {})
        for field in ("treedef", "shapes", "dtypes"):
            if saved.get(field) != expected[field]:
                raise CheckpointError(
                    f"checkpoint {step} in {directory} does not match this run: its {field} differ "
                    f"(saved {str(saved.get(field))[:300]} vs expected {str(expected[field])[:300]}); "
                    "was it written by a different model, optimizer or worker count?"
                )
        if metadata is not None and meta.get("metadata") != json.loads(json.dumps(metadata)):
            raise CheckpointError(
                f"checkpoint {step} in {directory} was written by a different configuration: "
                f"saved {meta.get('metadata')} vs current {metadata}"
            )
        leaves, treedef = jax.tree.flatten(template)
        abstract = {
            f"leaf_{i:05d}": jax.ShapeDtypeStruct(np.shape(x), x.dtype, sharding=getattr(x, "sharding", None))
            for i, x in enumerate(leaves)
        }
        try:
            items = mngr.restore(step, args=ocp.args.Composite(state=ocp.args.StandardRestore(abstract)))["state"]
        except Exception as e:
            raise CheckpointError(f"checkpoint {step} in {directory} is unreadable (arrays): {e}") from e
    state = jax.tree.unflatten(treedef, [items[f"leaf_{i:05d}"] for i in range(len(leaves))])
    position = meta.get("position")
    return state, (tuple(position) if position is not None else None), meta.get("metadata", {})
