"""Checkpoint and resume with orbax-checkpoint, bit-identically.

A checkpoint holds the whole :class:`~jaxcomm.train._step.TrainState` (parameters,
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

The checkpoint's record (a JSON item) holds the step, the data position, the
user's metadata, a description of the run (:func:`~._describe.describe` of the
transformation and the task: compressor, memory, strategy, optimizer and their
hyper-parameters), the PRNG key types and every array's digest, and a SHA-256
digest of each of these fields.

Restoring checks, in order, before any array is read: each record field against
its digest (an edited or damaged record is named), the recorded step against the
folder's, the metadata and the run description against the running job's; then
every file of the arrays is read to the end (orbax's metadata JSON, the OCDBT
manifest, b-tree and data files, each array decoded), so a damaged file is one error
with no orbax background-thread output; then the tree structure, shapes and dtypes
(orbax would cast silently); then, after orbax's restore, every array's digest (a
flipped bit names the array and the step's folder). Every failure is a :class:`CheckpointError` naming
what differs, never a silent fresh start. A different position, metadata or
transformation can be accepted on purpose (``accept_changes``; each accepted
difference is still reported, as a warning). A save that was interrupted (the
process killed while writing) leaves an unfinished temporary folder that orbax
never lists, and a step folder replaced by something else is not listed either;
the checkpointer warns about both and resumes from the last complete checkpoint.
Checkpoints of the earlier flat layout (items ``leaf_00000`` ...) still load, with
a warning that their record has no digests to check.
"""

from __future__ import annotations

import hashlib
import json
import warnings
from pathlib import Path

import jax
import numpy as np
import orbax.checkpoint as ocp

from .._validate import check_int

__all__ = [
    "ACCEPTABLE_CHANGES",
    "CheckpointError",
    "Checkpointer",
    "check_accept_changes",
    "check_metadata",
    "save_checkpoint",
    "restore_checkpoint",
    "latest_step",
]

LAYOUT = "structured-v1"
"""``meta["layout"]`` of checkpoints written by :class:`Checkpointer` (absent in the flat legacy layout)."""

ACCEPTABLE_CHANGES = ("position", "metadata", "transform")
"""The differences ``accept_changes`` may accept on resume: the data position recorded with the
checkpoint (edited by hand, e.g. to skip data), the run's ``metadata``, and the transformation or
task (``transform``: another learning rate, compressor or memory). The arrays, their digests, the
step and the PRNG key types are never accepted: a state that does not match is not resumed."""

_RECORDED = ("step", "position", "metadata", "run", "prng_keys", "sha256")  # the record fields with a digest
_CATEGORY = {"position": "position", "metadata": "metadata", "run": "transform"}  # others: never accepted


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


def _record_digest(value) -> str:
    """SHA-256 of a record field's canonical JSON (sorted keys, ASCII)."""
    return hashlib.sha256(json.dumps(value, sort_keys=True, separators=(",", ":")).encode()).hexdigest()


def check_metadata(metadata, name: str = "metadata") -> dict:
    """``metadata`` (``{}`` for ``None``) if it is a dict that JSON can write, else a ``TypeError`` naming ``name``."""
    if metadata is None:
        return {}
    if not isinstance(metadata, dict):
        raise TypeError(f"{name} must be a dict of JSON values (or None); got {type(metadata).__name__}")
    try:
        json.dumps(metadata, allow_nan=False)
    except (TypeError, ValueError) as e:
        raise TypeError(
            f"{name} must be JSON-serialisable (it is written with every checkpoint and compared on resume): {e}"
        ) from None
    return metadata


def check_accept_changes(accept_changes) -> frozenset:
    """``accept_changes`` as a set of names from :data:`ACCEPTABLE_CHANGES` (else a clear error)."""
    if isinstance(accept_changes, str) or not isinstance(accept_changes, (tuple, list, set, frozenset)):
        raise TypeError(
            f"accept_changes must be a tuple of names from {ACCEPTABLE_CHANGES}, e.g. ('transform',); "
            f"got {accept_changes!r}"
        )
    unknown = sorted(set(map(str, accept_changes)) - set(ACCEPTABLE_CHANGES))
    if unknown:
        raise ValueError(f"accept_changes: unknown {unknown}; the changes one can accept are {ACCEPTABLE_CHANGES}")
    return frozenset(accept_changes)


def _run_differences(saved: dict, current: dict, limit: int = 6) -> str:
    """The entries of two run descriptions that differ, the first ``limit`` of them spelled out."""
    keys = list(dict.fromkeys([*current, *saved]))
    diff = [k for k in keys if saved.get(k) != current.get(k)]
    shown = [f"{k}: saved {saved.get(k, '(absent)')}, this run {current.get(k, '(absent)')}" for k in diff[:limit]]
    more = f"; and {len(diff) - limit} more" if len(diff) > limit else ""
    counted = "1 entry differs" if len(diff) == 1 else f"{len(diff)} entries differ"
    return f"{counted}: " + "; ".join(shown) + more


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
        if max_to_keep is not None:  # None: keep every checkpoint
            max_to_keep = check_int(max_to_keep, "max_to_keep")
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
        listed = set(self._manager.all_steps())
        unlisted = sorted(p for p in self.directory.iterdir() if p.name.isdigit() and int(p.name) not in listed)
        if unlisted:  # e.g. a step folder replaced by a file: orbax skips it without a word
            what = {True: "a folder orbax does not list", False: "not a folder"}
            kinds = ", ".join(f"{p.name} ({what[p.is_dir()]})" for p in unlisted)
            warnings.warn(
                f"{self.directory}: step entries that are not complete checkpoints: {kinds}; they are ignored, "
                f"and the last complete checkpoint is step {self.latest_step()}",
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
    def save(self, step: int, state, *, position=None, metadata: dict | None = None, run: dict | None = None) -> None:
        """Start saving ``state`` (any pytree of arrays, typed PRNG keys included) as checkpoint ``step``.

        Returns once every array is copied to the host; the caller may then donate
        or overwrite ``state``'s buffers while the files are written.

        ``position`` (the data iterator's ``(epoch, index)``), ``metadata``
        (the user's JSON-serialisable run description) and ``run`` (a
        ``{path: text}`` description of the computation, :func:`~._describe.describe`)
        go in a JSON record with every array's SHA-256 digest and a digest of each
        record field; all are compared on restore.
        """
        metadata = check_metadata(metadata)
        keys = _key_impls(state)
        state = _key_data(state)  # typed PRNG keys are written as their key data, re-wrapped on restore
        host = jax.device_get(state)  # the bytes being saved: digested here, whatever the step does next
        meta = {
            "layout": LAYOUT,
            "prng_keys": keys,
            "step": int(step),
            "position": None if position is None else [int(v) for v in position],
            "metadata": metadata,
            "run": run,
            "sha256": {name: _digest(x) for name, x in _leaves_by_name(host).items()},
        }
        meta["digests"] = {field: _record_digest(meta[field]) for field in _RECORDED}
        self._manager.save(
            int(step), args=ocp.args.Composite(state=ocp.args.StandardSave(state), meta=ocp.args.JsonSave(meta))
        )

    # ----------------------------------------------------------------- restore
    def restore(
        self,
        template,
        *,
        step: int | None = None,
        metadata: dict | None = None,
        run: dict | None = None,
        accept_changes=(),
    ):
        """Restore checkpoint ``step`` (default: the latest) into the structure of ``template``.

        ``template`` is a pytree like the saved state (e.g. a freshly initialised
        ``TrainState``); its shardings place the restored arrays.

        Args:
          metadata: if given, must equal the saved metadata.
          run: if given, the running job's description (:func:`~._describe.describe`);
            must equal the saved one.
          accept_changes: names from :data:`ACCEPTABLE_CHANGES` whose differences
            are accepted on purpose (each is reported by a ``UserWarning``).
        Returns:
          ``(state, position, metadata)``.
        Raises:
          CheckpointError: no checkpoint, unreadable files, a record field that does
            not match its digest, another step, ``metadata`` or ``run`` (not
            accepted), a structure, shape or dtype that differs from ``template``,
            or an array whose digest differs. The message names what differs and,
            where it can be accepted, the ``accept_changes`` that resumes anyway.
        """
        accept = check_accept_changes(accept_changes)
        if metadata is not None:
            check_metadata(metadata)
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
        self._check_record(step, meta, metadata, run, accept)
        if meta.get("layout") != LAYOUT:
            state = _restore_flat(self._manager, where, step, meta, template)
        else:
            state = self._restore_structured(step, meta, template)
        position = meta.get("position")
        return state, (tuple(position) if position is not None else None), meta.get("metadata", {})

    def _check_record(self, step: int, meta: dict, metadata, run, accept: frozenset) -> None:
        """Every record field against its digest, then the step, metadata and run against this job's."""
        found: list[tuple[str, str]] = []  # (category, what differs)
        record = self.directory / str(step) / "meta"
        digests = meta.get("digests")
        if not isinstance(digests, dict):
            warnings.warn(
                f"checkpoint {step} in {self.directory} was written without digests of its record (an earlier "
                "jaxcomm): its step, position, metadata and run description cannot be checked",
                UserWarning,
                stacklevel=3,
            )
        else:
            for field in _RECORDED:
                if digests.get(field) != _record_digest(meta.get(field)):
                    shown = json.dumps(meta.get(field))
                    found.append(
                        (
                            _CATEGORY.get(field, "record"),
                            f"its recorded {field} ({shown[:200]}) does not match the digest written with it "
                            f"({record} was edited or damaged)",
                        )
                    )
        if meta.get("step", step) != step:
            found.append(("record", f"its recorded step {meta.get('step')} is not its folder's step {step}"))
        if metadata is not None and meta.get("metadata") != json.loads(json.dumps(metadata)):
            found.append(
                (
                    "metadata",
                    f"it was written by a different configuration: metadata saved {meta.get('metadata')} vs "
                    f"current {metadata}",
                )
            )
        if run is not None:
            saved = meta.get("run")
            if saved is None:
                warnings.warn(
                    f"checkpoint {step} in {self.directory} records no run description: the transformation "
                    "(compressor, memory, optimizer, learning rate) cannot be checked",
                    UserWarning,
                    stacklevel=3,
                )
            elif saved != json.loads(json.dumps(run)):
                found.append(("transform", "the transformation or task differs: " + _run_differences(saved, run)))
        refused = [text for category, text in found if category not in accept]
        if refused:
            fixable = sorted({c for c, _ in found if c not in accept and c != "record"})
            folder = self.directory / str(step)
            if any(c == "record" for c, _ in found):
                how = f"; resume from an earlier step (restore(step=...)) or move the folder {folder} away"
            else:
                names = tuple(sorted(accept | set(fixable)))
                how = f"; to resume from it anyway on purpose, pass accept_changes={names} (Trainer.fit or restore)"
            raise CheckpointError(f"checkpoint {step} in {self.directory}: " + "; ".join(refused) + how)
        for _, text in found:
            warnings.warn(f"checkpoint {step} in {self.directory}, accepted: {text}", UserWarning, stacklevel=3)

    def _restore_structured(self, step: int, meta: dict, template):
        where = self.directory / str(step)
        keys, saved_keys = _key_impls(template), meta.get("prng_keys", {})
        if keys != saved_keys:
            raise CheckpointError(
                f"checkpoint {step} in {self.directory} does not match this run: its typed PRNG keys "
                f"(jax.random.key) differ: saved {saved_keys or 'none'}, this run {keys or 'none'}"
            )
        typed, template = template, _key_data(template)
        _check_state_files(self.directory, step)  # before orbax opens any array
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


def _check_state_files(directory: Path, step: int) -> None:
    """Read every file of checkpoint ``step``'s arrays to the end before orbax reads any of them.

    orbax opens the arrays (for their metadata) and reads them (to restore them) in one
    ``asyncio.gather`` each; when one read fails, the gather ends while the others are
    still running, and their completions then print "Event loop is closed" and "Exception
    ignored in" tracebacks from orbax's background thread next to the error. This reads
    the same files first, and waits for every read to finish whether it failed or not:
    orbax's tree metadata (``state/_METADATA``) and array-metadata JSON
    (``state/array_metadatas/process_*``), then every array through TensorStore as orbax
    stores it (zarr or zarr3 chunks, in an OCDBT database or in plain files), decoded.
    A damaged, truncated or missing file is then one :class:`CheckpointError` naming the
    file or the array, with nothing in flight. The arrays are read twice (here and by
    orbax's restore); their SHA-256 digests are checked after the restore.
    """
    import tensorstore as ts

    state = directory / str(step) / "state"

    def unreadable(what: str, e: BaseException) -> CheckpointError:
        text = str(e).splitlines()[0] if str(e) else ""
        return CheckpointError(
            f"checkpoint {step} in {directory} is unreadable ({what}: {type(e).__name__}: {text[:600]})"
        )

    tree: dict = {}
    for path in [state / "_METADATA", *sorted((state / "array_metadatas").glob("*"))]:
        field = "tree_metadata" if path.name == "_METADATA" else "array_metadatas"
        try:
            entries = json.loads(path.read_text())
            if not isinstance(entries, dict) or not isinstance(entries.get(field), (dict, list)):
                raise TypeError(f"{field} is missing or not a JSON object or list")
        except (OSError, ValueError, TypeError) as e:
            raise unreadable(f"array metadata file {path}", e) from e
        tree = tree or entries
    use_ocdbt, use_zarr3 = bool(tree.get("use_ocdbt", True)), bool(tree.get("use_zarr3", False))
    kvstore: dict = {"driver": "file", "path": f"{state}/"}
    if use_ocdbt:
        kvstore = {"driver": "ocdbt", "base": kvstore}
    suffix = "/zarr.json" if use_zarr3 else "/.zarray"
    try:
        keys = ts.KvStore.open(kvstore).result().list().result()
    except Exception as e:  # TensorStore's errors are ValueErrors and others
        raise unreadable(f"array store {state}", e) from e
    names = sorted(k.decode()[: -len(suffix)] for k in keys if k.decode().endswith(suffix))
    listed = {  # the arrays orbax's tree metadata names (a leaf's keys joined by dots)
        ".".join(str(k.get("key")) for k in entry.get("key_metadata", ()))
        for entry in tree["tree_metadata"].values()
        if isinstance(entry, dict) and entry.get("value_metadata", {}).get("value_type") in ("jax.Array", "np.ndarray")
    }
    if listed - set(names):
        missing = ", ".join(sorted(listed - set(names))[:8])
        raise unreadable(f"array store {state}", FileNotFoundError(f"arrays in its metadata but not stored: {missing}"))

    def wait_all(futures: dict) -> dict:
        """Every future's result by array name; the first failure raised after all have finished."""
        results, failed = {}, None
        for name, future in futures.items():
            try:
                results[name] = future.result()
            except Exception as e:
                failed = failed or (name, e)
        if failed is not None:
            raise unreadable(f"array {failed[0]} in {state}", failed[1]) from failed[1]
        return results

    driver = "zarr3" if use_zarr3 else "zarr"
    opened = wait_all({n: ts.open({"driver": driver, "kvstore": {**kvstore, "path": f"{n}/"}}) for n in names})
    wait_all({n: array.read() for n, array in opened.items()})


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
    _check_state_files(directory, step)
    try:
        items = manager.restore(step, args=ocp.args.Composite(state=ocp.args.StandardRestore(abstract)))["state"]
    except Exception as e:
        raise CheckpointError(f"checkpoint {step} in {directory} is unreadable (arrays): {e}") from e
    return jax.tree.unflatten(treedef, [items[f"leaf_{i:05d}"] for i in range(len(leaves))])


# --------------------------------------------------------------------------- #
# One-call forms (one manager per call, synchronous)
# --------------------------------------------------------------------------- #
def save_checkpoint(
    directory,
    step: int,
    state,
    *,
    position=None,
    metadata: dict | None = None,
    run: dict | None = None,
    max_to_keep: int | None = 3,
) -> Path:
    """Save ``state`` as checkpoint ``step`` under ``directory`` and wait until it is on disk.

    The one-call form of :meth:`Checkpointer.save`; a training loop keeps one
    :class:`Checkpointer` instead. Returns the checkpoint root.
    """
    with Checkpointer(directory, max_to_keep=max_to_keep, async_save=False) as ckpt:
        ckpt.save(step, state, position=position, metadata=metadata, run=run)
    return Path(directory)


def latest_step(directory) -> int | None:
    """The newest complete checkpoint step under ``directory``, or ``None`` if there is none."""
    directory = Path(directory)
    if not directory.exists():
        return None
    with Checkpointer(directory) as ckpt:
        return ckpt.latest_step()


def restore_checkpoint(
    directory, template, *, step: int | None = None, metadata: dict | None = None, run=None, accept_changes=()
):
    """Restore checkpoint ``step`` (default: latest) into the structure of ``template``.

    The one-call form of :meth:`Checkpointer.restore`: returns
    ``(state, position, metadata)``; raises :class:`CheckpointError`.
    """
    directory = Path(directory)
    if not directory.exists():
        raise CheckpointError(f"no checkpoint directory at {directory}")
    with Checkpointer(directory) as ckpt:
        return ckpt.restore(template, step=step, metadata=metadata, run=run, accept_changes=accept_changes)
