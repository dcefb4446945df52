"""Checkpoint and resume with orbax-checkpoint, bit-identically.

A checkpoint holds the whole :class:`~jaxcomm.train.TrainState` (parameters,
optimizer state with every error-feedback memory and server error, per-worker
PRNG keys, step) as orbax's structured pytree, plus the data position, the run's
metadata and a SHA-256 digest of every array. Typed PRNG keys (``jax.random.key``)
are written as their ``uint32`` key data and re-wrapped with the template's
implementation on restore. One :class:`Checkpointer` (one
``orbax.checkpoint.CheckpointManager``) serves a whole run; saves are
asynchronous: ``save`` returns once the arrays are copied to the host and
digested, and the files are written in the background (:meth:`Checkpointer.wait`).
The jitted train step donates its input state, so the buffers handed to ``save``
are deleted by the next step: this is safe because orbax finishes the
device-to-host copy of every array before ``save`` returns (all arrays are
"prioritized" when no ``device_host_max_bytes`` limit is set, and none is set
here), so nothing in flight reads device memory (on CPU the host copy may be a
view that keeps the buffer alive, and JAX then copies instead of donating). Waiting before the next step
instead would serialise training and writing; copying the state on device would
double its memory.

Restoring checks, in order: orbax's own validation of the tree structure and
shapes against the running job's state, the stored dtypes (orbax would cast
silently), every array's digest (a flipped bit names the array and the step's
folder) and the run's metadata. Every failure is a :class:`CheckpointError`,
never a silent fresh start. A save that was interrupted (the process killed
while writing) leaves an unfinished temporary folder that orbax never lists; the
checkpointer warns about it and resumes from the last complete checkpoint.
Checkpoints of the earlier flat layout (items ``leaf_00000`` ...) still load.
"""

from __future__ import annotations

import hashlib
import json
import warnings
from pathlib import Path

import jax
import numpy as np
import orbax.checkpoint as ocp

__all__ = ["CheckpointError", "Checkpointer", "save_checkpoint", "restore_checkpoint", "latest_step"]

LAYOUT = "structured-v1"
"""``meta["layout"]`` of checkpoints written by :class:`Checkpointer` (absent in the flat legacy layout)."""


class CheckpointError(RuntimeError):
    """A checkpoint is missing, unreadable, or does not match the running job."""


def _path_name(path) -> str:
    """Orbax's name of a leaf: its key path joined by dots (``opt_state.0.memory.w``)."""
    parts = []
    for k in path:
        for attr in ("key", "name", "idx"):
            if hasattr(k, attr):
                parts.append(str(getattr(k, attr)))
                break
    return ".".join(parts)


def _leaves_by_name(tree) -> dict:
    return {_path_name(p): x for p, x in jax.tree_util.tree_flatten_with_path(tree)[0]}


def _digest(x) -> str:
    a = np.ascontiguousarray(np.asarray(x))
    return hashlib.sha256(a.view(np.uint8).reshape(-1).tobytes() if a.size else b"").hexdigest()


def _is_key(x) -> bool:
    """A typed PRNG key array (``jax.random.key``); raw ``uint32`` keys are ordinary arrays."""
    return hasattr(x, "dtype") and jax.dtypes.issubdtype(x.dtype, jax.dtypes.prng_key)


def _key_impls(tree) -> dict:
    """``{leaf name: PRNG implementation}`` of the typed key arrays in ``tree``."""
    return {name: str(jax.random.key_impl(x)) for name, x in _leaves_by_name(tree).items() if _is_key(x)}


def _key_data(tree):
    """``tree`` with every typed key array replaced by its ``uint32`` key data (what orbax can write)."""
    return jax.tree.map(lambda x: jax.random.key_data(x) if _is_key(x) else x, tree)


def _abstract(tree):
    return jax.tree.map(
        lambda x: jax.ShapeDtypeStruct(np.shape(x), x.dtype, sharding=getattr(x, "sharding", None)), tree
    )


class Checkpointer:
    """One orbax ``CheckpointManager`` for a run's checkpoints under ``directory``.

    Args:
      directory: checkpoint root (created); one sub-folder per step.
      max_to_keep: older checkpoints beyond this many are deleted (``None``: keep all).
      async_save: write in a background thread (``save`` returns after the host copy).

    Use it as a context manager, or call :meth:`close` (which waits for the last save).
    """

    def __init__(self, directory, *, max_to_keep: int | None = 3, async_save: bool = True):
        if max_to_keep is not None and (isinstance(max_to_keep, bool) or not isinstance(max_to_keep, int)):
            raise TypeError(f"max_to_keep must be a positive int or None; got {max_to_keep!r}")
        if max_to_keep is not None and max_to_keep < 1:
            raise ValueError(f"max_to_keep must be >= 1 or None; got {max_to_keep}")
        self.directory = Path(directory).absolute()
        options = ocp.CheckpointManagerOptions(
            max_to_keep=max_to_keep, create=True, enable_async_checkpointing=bool(async_save)
        )
        handlers = {"state": ocp.StandardCheckpointHandler(), "meta": ocp.JsonCheckpointHandler()}
        self._manager = ocp.CheckpointManager(self.directory, options=options, item_handlers=handlers)
        unfinished = sorted(p.name for p in self.directory.glob("*.orbax-checkpoint-tmp*"))
        if unfinished:
            warnings.warn(
                f"{self.directory}: interrupted checkpoint save(s) found ({', '.join(unfinished)}); they are "
                f"ignored, and the last complete checkpoint is step {self.latest_step()}",
                UserWarning,
                stacklevel=2,
            )

    # ---------------------------------------------------------------- lifetime
    def __enter__(self) -> Checkpointer:
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    def wait(self) -> None:
        """Block until every started save is on disk."""
        self._manager.wait_until_finished()

    def close(self) -> None:
        """Wait for the last save and release the manager."""
        self._manager.wait_until_finished()
        self._manager.close()

    def latest_step(self) -> int | None:
        """The newest complete checkpoint's step, or ``None``."""
        self._manager.reload()
        return self._manager.latest_step()

    # -------------------------------------------------------------------- save
    def save(self, step: int, state, *, position=None, metadata: dict | None = None) -> None:
        """Start saving ``state`` (any pytree of arrays, typed PRNG keys included) as checkpoint ``step``.

        Returns once every array is copied to the host; the caller may then donate
        or overwrite ``state``'s buffers while the files are written.

        ``position`` (the data iterator's ``(epoch, index)``) and ``metadata``
        (JSON-serialisable run description, compared on restore) go in a JSON item
        with every array's SHA-256 digest.
        """
        keys = _key_impls(state)
        state = _key_data(state)  # typed PRNG keys are written as their key data, re-wrapped on restore
        host = jax.device_get(state)  # the bytes being saved: digested here, whatever the step does next
        meta = {
            "layout": LAYOUT,
            "prng_keys": keys,
            "step": int(step),
            "position": None if position is None else [int(v) for v in position],
            "metadata": metadata or {},
            "sha256": {name: _digest(x) for name, x in _leaves_by_name(host).items()},
        }
        self._manager.save(
            int(step), args=ocp.args.Composite(state=ocp.args.StandardSave(state), meta=ocp.args.JsonSave(meta))
        )

    # ----------------------------------------------------------------- restore
    def restore(self, template, *, step: int | None = None, metadata: dict | None = None):
        """Restore checkpoint ``step`` (default: the latest) into the structure of ``template``.

        ``template`` is a pytree like the saved state (e.g. a freshly initialised
        ``TrainState``); its shardings place the restored arrays.

        Returns:
          ``(state, position, metadata)``.
        Raises:
          CheckpointError: no checkpoint, unreadable files, a structure, shape or
            dtype that differs from ``template``, an array whose digest differs
            (named), or different ``metadata`` (the message says which).
        """
        self.wait()
        where = self.directory
        if step is None:
            step = self.latest_step()
        if step is None:
            raise CheckpointError(f"no checkpoint found in {where}")
        try:
            meta = self._manager.restore(step, args=ocp.args.Composite(meta=ocp.args.JsonRestore()))["meta"]
        except Exception as e:  # orbax raises several types for unreadable files
            raise CheckpointError(f"checkpoint {step} in {where} is unreadable (metadata): {e}") from e
        if meta.get("layout") != LAYOUT:
            state = _restore_flat(self._manager, where, step, meta, template)
        else:
            state = self._restore_structured(step, meta, template)
        if metadata is not None and meta.get("metadata") != json.loads(json.dumps(metadata)):
            raise CheckpointError(
                f"checkpoint {step} in {where} was written by a different configuration: "
                f"saved {meta.get('metadata')} vs current {metadata}"
            )
        position = meta.get("position")
        return state, (tuple(position) if position is not None else None), meta.get("metadata", {})

    def _restore_structured(self, step: int, meta: dict, template):
        where = self.directory / str(step)
        keys, saved_keys = _key_impls(template), meta.get("prng_keys", {})
        if keys != saved_keys:
            raise CheckpointError(
                f"checkpoint {step} in {self.directory} does not match this run: its typed PRNG keys "
                f"(jax.random.key) differ: saved {saved_keys or 'none'}, this run {keys or 'none'}"
            )
        typed, template = template, _key_data(template)
        try:
            stored = self._manager.item_metadata(step)["state"]
        except Exception as e:
            raise CheckpointError(f"checkpoint {step} in {self.directory} is unreadable (array metadata): {e}") from e
        stored_arrays = {m.name: m for m in jax.tree.leaves(getattr(stored, "tree", stored)) if hasattr(m, "dtype")}
        if not stored_arrays:
            raise CheckpointError(f"checkpoint {step} in {self.directory} is unreadable (no array metadata)")
        wanted = _leaves_by_name(template)
        missing, extra = sorted(set(wanted) - set(stored_arrays)), sorted(set(stored_arrays) - set(wanted))
        problems = [f"not in the checkpoint: {', '.join(missing[:8])}"] if missing else []
        problems += [f"only in the checkpoint: {', '.join(extra[:8])}"] if extra else []
        for name in sorted(set(wanted) & set(stored_arrays)):
            m, x = stored_arrays[name], wanted[name]
            if tuple(m.shape) != tuple(np.shape(x)) or np.dtype(m.dtype) != np.dtype(x.dtype):
                problems.append(
                    f"{name} saved {np.dtype(m.dtype)}{list(m.shape)}, this run {np.dtype(x.dtype)}{list(np.shape(x))}"
                )
        if problems:  # checked on orbax's metadata before reading any array
            raise CheckpointError(
                f"checkpoint {step} in {self.directory} does not match this run (was it written by a different "
                f"model, optimizer or worker count?): " + "; ".join(problems[:10])
            )
        try:
            args = ocp.args.Composite(state=ocp.args.StandardRestore(_abstract(template)))
            state = self._manager.restore(step, args=args)["state"]
        except ValueError as e:  # orbax's structure and shape validation
            raise CheckpointError(
                f"checkpoint {step} in {self.directory} does not match this run (was it written by a different "
                f"model, optimizer or worker count?): {str(e)[:1500]}"
            ) from e
        except Exception as e:
            raise CheckpointError(f"checkpoint {step} in {self.directory} is unreadable (arrays): {e}") from e
        digests = meta.get("sha256", {})
        for name, x in _leaves_by_name(jax.device_get(state)).items():
            if digests.get(name) != _digest(x):
                raise CheckpointError(
                    f"checkpoint {step}: array {name} in {where / 'state'} is corrupted (its SHA-256 differs from "
                    "the one recorded at save time)"
                )
        by_name = _leaves_by_name(state)  # back into the template's node types (NamedTuples), by leaf name
        state = jax.tree.unflatten(jax.tree.structure(template), [by_name[n] for n in _leaves_by_name(template)])
        return jax.tree.map(
            lambda t, x: jax.random.wrap_key_data(x, impl=jax.random.key_impl(t)) if _is_key(t) else x, typed, state
        )


def _restore_flat(manager, directory: Path, step: int, meta: dict, template):
    """The earlier layout: ``leaf_00000`` ... items and a ``signature`` of the flattened tree."""
    leaves, treedef = jax.tree.flatten(template)
    saved = meta.get("signature", {})
    expected = {
        "treedef": str(treedef),
        "shapes": [list(np.shape(x)) for x in leaves],
        "dtypes": [str(x.dtype) for x in leaves],
    }
    for field in ("treedef", "shapes", "dtypes"):
        if saved.get(field) != expected[field]:
            raise CheckpointError(
                f"checkpoint {step} in {directory} (flat layout of earlier jaxcomm versions) does not match this "
                f"run: its {field} differ (saved {str(saved.get(field))[:300]} vs expected "
                f"{str(expected[field])[:300]})"
            )
    abstract = {f"leaf_{i:05d}": a for i, a in enumerate(_abstract(leaves))}
    try:
        items = manager.restore(step, args=ocp.args.Composite(state=ocp.args.StandardRestore(abstract)))["state"]
    except Exception as e:
        raise CheckpointError(f"checkpoint {step} in {directory} is unreadable (arrays): {e}") from e
    return jax.tree.unflatten(treedef, [items[f"leaf_{i:05d}"] for i in range(len(leaves))])


# --------------------------------------------------------------------------- #
# One-call forms (one manager per call, synchronous)
# --------------------------------------------------------------------------- #
def save_checkpoint(
    directory, step: int, state, *, position=None, metadata: dict | None = None, max_to_keep: int | None = 3
) -> Path:
    """Save ``state`` as checkpoint ``step`` under ``directory`` and wait until it is on disk.

    The one-call form of :meth:`Checkpointer.save`; a training loop keeps one
    :class:`Checkpointer` instead. Returns the checkpoint root.
    """
    with Checkpointer(directory, max_to_keep=max_to_keep, async_save=False) as ckpt:
        ckpt.save(step, state, position=position, metadata=metadata)
    return Path(directory)


def latest_step(directory) -> int | None:
    """The newest complete checkpoint step under ``directory``, or ``None`` if there is none."""
    directory = Path(directory)
    if not directory.exists():
        return None
    with Checkpointer(directory) as ckpt:
        return ckpt.latest_step()


def restore_checkpoint(directory, template, *, step: int | None = None, metadata: dict | None = None):
    """Restore checkpoint ``step`` (default: latest) into the structure of ``template``.

    The one-call form of :meth:`Checkpointer.restore`: returns
    ``(state, position, metadata)``; raises :class:`CheckpointError`.
    """
    directory = Path(directory)
    if not directory.exists():
        raise CheckpointError(f"no checkpoint directory at {directory}")
    with Checkpointer(directory) as ckpt:
        return ckpt.restore(template, step=step, metadata=metadata)
