"""Checkpoints: orbax's structured tree, one manager per run, asynchronous saves, digests,
interrupted saves, and the earlier flat layout."""

from __future__ import annotations

import json
import subprocess
import sys
import textwrap
from pathlib import Path
from typing import NamedTuple

import jax
import jax.numpy as jnp
import numpy as np
import orbax.checkpoint as ocp
import pytest

from jaxcomm.train import CheckpointError
from jaxcomm.train._checkpoint import Checkpointer, latest_step, restore_checkpoint, save_checkpoint


class Inner(NamedTuple):
    memory: dict
    count: jax.Array


class State(NamedTuple):
    step: jax.Array
    params: dict
    opt: tuple
    key: jax.Array


def _state(width=3, dtype=jnp.float32, seed=0):
    rng = np.random.default_rng(seed)
    params = {"w": jnp.asarray(rng.normal(size=(width, 2)), dtype), "b": jnp.asarray(rng.normal(size=2), jnp.bfloat16)}
    opt = (Inner({"w": jnp.asarray(rng.normal(size=(width, 2)), jnp.float32)}, jnp.int32(7)), ())
    return State(jnp.int32(5), params, opt, jax.random.PRNGKey(seed))


def _equal(a, b):
    assert jax.tree.structure(a) == jax.tree.structure(b)
    for x, y in zip(jax.tree.leaves(a), jax.tree.leaves(b)):
        assert np.asarray(x).dtype == np.asarray(y).dtype
        np.testing.assert_array_equal(np.asarray(x), np.asarray(y))


def test_structured_round_trip_keeps_node_types_dtypes_and_bits(tmp_path):
    state = _state()
    with Checkpointer(tmp_path) as ckpt:  # asynchronous saves
        ckpt.save(1, state, position=(0, 64), metadata={"lr": 0.1})
        ckpt.save(2, jax.tree.map(lambda x: x + 1 if x.dtype != jnp.uint32 else x, state))
        got, position, meta = ckpt.restore(_state(seed=1), step=1, metadata={"lr": 0.1})
    _equal(got, state)
    assert isinstance(got, State) and isinstance(got.opt[0], Inner)
    assert position == (0, 64) and meta == {"lr": 0.1}
    assert latest_step(tmp_path) == 2
    # The items on disk are the named tree, not flat leaf_* entries.
    names = set(ocp.StandardCheckpointer().metadata(tmp_path / "1" / "state").item_metadata.tree)
    assert names == {"step", "params", "opt", "key"}


def test_one_call_forms(tmp_path):
    save_checkpoint(tmp_path, 3, _state(), metadata={"a": 1})
    got, position, meta = restore_checkpoint(tmp_path, _state(seed=2))
    _equal(got, _state())
    assert position is None and meta == {"a": 1}
    with pytest.raises(CheckpointError, match="different configuration"):
        restore_checkpoint(tmp_path, _state(), metadata={"a": 2})
    with pytest.raises(CheckpointError, match="no checkpoint directory"):
        restore_checkpoint(tmp_path / "none", _state())


@pytest.mark.parametrize(
    ("template", "match"),
    [
        (_state(width=4), r"params\.w saved float32\[3, 2\], this run float32\[4, 2\]"),
        (_state(dtype=jnp.float16), r"params\.w saved float32\[3, 2\], this run float16\[3, 2\]"),
        (_state()._replace(params={"w": jnp.zeros((3, 2))}), r"only in the checkpoint: params\.b"),
    ],
)
def test_a_different_run_is_named_before_any_array_is_read(tmp_path, template, match):
    save_checkpoint(tmp_path, 1, _state())
    with pytest.raises(CheckpointError, match=match):
        restore_checkpoint(tmp_path, template)


def test_a_flipped_bit_names_the_array(tmp_path):
    state = {"w": jnp.arange(4096.0), "b": jnp.ones(3)}
    save_checkpoint(tmp_path, 1, state)
    data = max((p for p in (tmp_path / "1" / "state").rglob("*") if p.is_file()), key=lambda p: p.stat().st_size)
    raw = bytearray(data.read_bytes())
    raw[len(raw) // 2] ^= 0x01  # the largest file holds w's chunk
    data.write_bytes(bytes(raw))
    with pytest.raises(CheckpointError, match=r"array w in .*1/state is corrupted"):
        restore_checkpoint(tmp_path, state)


def test_an_interrupted_save_is_skipped_with_a_warning(tmp_path):
    # A process killed while its background save of step 2 writes: step 1 is the last complete one.
    script = textwrap.dedent(
        f"""
        import os
        import jax.numpy as jnp
        from jaxcomm.train import Checkpointer
        ckpt = Checkpointer({str(tmp_path)!r})
        ckpt.save(1, {{"w": jnp.arange(4.0)}})
        ckpt.wait()
        ckpt.save(2, {{"w": jnp.ones(4), "big": jnp.ones((32, 1024, 1024))}})
        os._exit(3)
        """
    )
    proc = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=300)
    assert proc.returncode == 3, proc.stderr[-2000:]
    assert list(tmp_path.glob("2.orbax-checkpoint-tmp*"))  # the unfinished step 2
    with pytest.warns(
        UserWarning, match=r"interrupted checkpoint save\(s\) found .*last complete checkpoint is step 1"
    ):
        ckpt = Checkpointer(tmp_path)
    with ckpt:
        got, _, _ = ckpt.restore({"w": jnp.zeros(4)})
    np.testing.assert_array_equal(np.asarray(got["w"]), np.arange(4.0))


def _save_flat_layout(directory: Path, step: int, state):
    """The writer of earlier jaxcomm versions: leaves as leaf_00000 ... and a signature of the tree."""
    leaves, treedef = jax.tree.flatten(state)
    meta = {
        "step": step,
        "position": None,
        "metadata": {},
        "signature": {
            "treedef": str(treedef),
            "shapes": [list(np.shape(x)) for x in leaves],
            "dtypes": [str(x.dtype) for x in leaves],
        },
    }
    options = ocp.CheckpointManagerOptions(create=True)
    with ocp.CheckpointManager(directory.absolute(), options=options, item_names=("state", "meta")) as mngr:
        items = {f"leaf_{i:05d}": x for i, x in enumerate(leaves)}
        mngr.save(step, args=ocp.args.Composite(state=ocp.args.StandardSave(items), meta=ocp.args.JsonSave(meta)))
        mngr.wait_until_finished()


def test_checkpoints_of_the_flat_layout_still_load(tmp_path):
    _save_flat_layout(tmp_path, 4, _state())
    with pytest.warns(UserWarning, match="without digests of its record"):
        got, _, _ = restore_checkpoint(tmp_path, _state(seed=3))
    _equal(got, _state())
    with pytest.raises(CheckpointError, match="flat layout of earlier jaxcomm versions"), pytest.warns(UserWarning):
        restore_checkpoint(tmp_path, _state(width=5))


def test_trainer_keeps_one_manager_per_run(tmp_path, monkeypatch):
    import optax
    from flax import nnx

    import jaxcomm as jc
    from jaxcomm import data, models
    from jaxcomm.train import _trainer

    made = []

    class Counting(Checkpointer):
        def __init__(self, *a, **k):
            made.append(a)
            super().__init__(*a, **k)

    monkeypatch.setattr(_trainer, "Checkpointer", Counting)
    model = models.MLP(in_features=64, hidden=(8,), num_classes=10, rngs=nnx.Rngs(0))
    tx = optax.chain(jc.compressed_mean(jc.compressors.topk(ratio=0.1), memory=jc.memory.residual()), optax.sgd(0.1))
    trainer = _trainer.Trainer(model, tx, num_workers=2)
    shards = data.split_iid(data.load_digits(), 2, jax.random.PRNGKey(0))
    batches = data.WorkerBatches(shards, 16, jax.random.PRNGKey(1))
    state, _ = trainer.fit(
        trainer.init_state(), batches, 6, checkpoint_dir=tmp_path, checkpoint_every=2, progress=False
    )
    assert len(made) == 1 and latest_step(tmp_path) == 6
    assert sorted(int(p.name) for p in tmp_path.iterdir() if p.name.isdigit()) == [2, 4, 6]  # max_to_keep=3
    restored, _, _ = restore_checkpoint(tmp_path, trainer.init_state())
    _equal(restored, state)  # the asynchronous saves wrote what the (donating) step computed
    # Step 4 was written while steps 5 and 6 donated its buffers: it equals a run that stops at 4.
    at_4, position, _ = restore_checkpoint(tmp_path, trainer.init_state(), step=4)
    batches = data.WorkerBatches(shards, 16, jax.random.PRNGKey(1))
    reference, _ = trainer.fit(trainer.init_state(), batches, 4, progress=False)
    _equal(at_4, reference)
    assert position == tuple(batches.position)


def _typed_state(seed=0):
    """A nested state with typed PRNG keys (``jax.random.key``) next to raw ones and mixed dtypes."""
    base = _state(seed=seed)
    keys = jax.random.split(jax.random.key(seed), 3)
    return base._replace(opt=(base.opt[0], (keys, jax.random.key(seed + 10, impl="rbg"))))


def test_typed_prng_keys_round_trip_and_a_raw_key_template_is_refused(tmp_path):
    state = _typed_state()
    save_checkpoint(tmp_path, 1, state)
    got, _, _ = restore_checkpoint(tmp_path, _typed_state(seed=4))
    assert jax.tree.structure(got) == jax.tree.structure(state)
    for a, b in zip(jax.tree.leaves(got), jax.tree.leaves(state)):
        assert a.dtype == b.dtype
        if jax.dtypes.issubdtype(b.dtype, jax.dtypes.prng_key):
            assert jax.random.key_impl(a) == jax.random.key_impl(b)
            a, b = jax.random.key_data(a), jax.random.key_data(b)
        np.testing.assert_array_equal(np.asarray(a), np.asarray(b))
    # The restored keys draw the same numbers as the saved ones.
    np.testing.assert_array_equal(
        np.asarray(jax.random.normal(got.opt[1][0][1], (5,))), np.asarray(jax.random.normal(state.opt[1][0][1], (5,)))
    )
    raw = state._replace(opt=(state.opt[0], (jax.random.key_data(state.opt[1][0]), state.opt[1][1])))
    with pytest.raises(CheckpointError, match=r"in .* typed PRNG keys .* differ: saved \{'opt\.1\.0'"):
        restore_checkpoint(tmp_path, raw)


def test_an_asynchronous_save_survives_the_next_step_donating_the_state(tmp_path):
    # The jitted train step donates its input: the buffers given to save are deleted right after it
    # returns, while orbax still writes in the background.
    step = jax.jit(lambda s: jax.tree.map(lambda x: x * 2 + 1, s), donate_argnums=0)
    state = {"w": jnp.arange(1 << 16, dtype=jnp.float32), "b": jnp.ones((64, 64), jnp.bfloat16)}
    expected = jax.tree.map(lambda x: np.array(x, copy=True), state)  # copies: a live host view would block donation
    with Checkpointer(tmp_path) as ckpt:
        ckpt.save(1, state)
        new = step(state)
        for x in jax.tree.leaves(state):  # on CPU a buffer still viewed by the writer is copied, not donated
            x.delete()
        ckpt.save(2, new)
        new = step(new)
        got, _, _ = ckpt.restore(jax.tree.map(jnp.zeros_like, expected), step=1)
    _equal(got, expected)
    second, _, _ = restore_checkpoint(tmp_path, got, step=2)
    _equal(second, jax.tree.map(lambda x: x * 2 + 1, expected))


# --------------------------------------------------------------------------- #
# Checkpoint identity: what determines the trajectory is checked on resume
# --------------------------------------------------------------------------- #
def _digits_trainer(compressor=None, lr=0.1):
    import optax
    from flax import nnx

    import jaxcomm as jc
    from jaxcomm import models
    from jaxcomm.train import Trainer

    c = jc.compressors.topk(ratio=0.1) if compressor is None else compressor
    model = models.MLP(in_features=64, hidden=(8,), num_classes=10, rngs=nnx.Rngs(0))
    tx = optax.chain(jc.compressed_mean(c, memory=jc.memory.residual()), optax.sgd(lr))
    return Trainer(model, tx, num_workers=2)


def _digits_batches():
    from jaxcomm import data

    return data.WorkerBatches(data.split_iid(data.load_digits(), 2, jax.random.PRNGKey(0)), 16, jax.random.PRNGKey(1))


def _fit(trainer, directory, steps, **kw):
    kw = {"checkpoint_every": 2, "metadata": {"h": 8}, "progress": False, **kw}
    return trainer.fit(trainer.init_state(), _digits_batches(), steps, checkpoint_dir=directory, **kw)


@pytest.fixture(scope="module")
def trained(tmp_path_factory):
    """A top-k run checkpointed at steps 2 and 4 (sgd 0.1, metadata {"h": 8}); tests work on copies."""
    directory = tmp_path_factory.mktemp("trained") / "run"
    _fit(_digits_trainer(), directory, 4)
    return directory


def _copy(trained, tmp_path) -> Path:
    import shutil

    return Path(shutil.copytree(trained, tmp_path / "run"))


def _edit_record(directory: Path, at: int, **fields) -> None:
    path = directory / str(at) / "meta" / "metadata"
    meta = json.loads(path.read_text())
    path.write_text(json.dumps({**meta, **fields}))


@pytest.mark.parametrize(
    ("compressor", "lr", "match"),
    [
        ("randomk", 0.1, r"compressor\.name: saved 'topk', this run 'randomk'"),
        ("contractive", 0.1, r"compressor\.name: saved 'topk', this run 'contractive'"),
        (None, 0.05, r"1 entry differs: tx\.update\S*\.step_size: saved -0\.1, this run -0\.05"),
    ],
)
def test_resuming_with_another_transformation_is_refused_naming_it(trained, tmp_path, compressor, lr, match):
    import jaxcomm as jc

    c = {
        "randomk": lambda: jc.compressors.randomk(ratio=0.1),
        "contractive": lambda: jc.compressors.contractive(jc.compressors.qsgd(levels=4)),
    }.get(compressor, lambda: None)()
    directory = _copy(trained, tmp_path)
    with pytest.raises(CheckpointError, match=match + r".*accept_changes=\('transform',\)"):
        _fit(_digits_trainer(c, lr), directory, 6)


def test_an_accepted_change_resumes_and_is_reported(trained, tmp_path):
    directory = _copy(trained, tmp_path)
    trainer = _digits_trainer(lr=0.05)
    with pytest.warns(UserWarning, match=r"accepted: the transformation .*\.step_size: saved -0\.1, this run -0\.05"):
        _, history = _fit(trainer, directory, 5, accept_changes=("transform",))
    assert [row["step"] for row in history] == [5]
    run = json.loads((directory / "5" / "meta" / "metadata").read_text())["run"]
    assert run == json.loads(json.dumps(trainer.describe_run()))  # the new checkpoint records the new run


@pytest.mark.parametrize(
    ("fields", "match", "acceptable"),
    [
        ({"position": [0, 1]}, r"its recorded position \(\[0, 1\]\) does not match the digest", True),
        ({"metadata": {"h": 9}}, r"its recorded metadata \(\{\"h\": 9\}\) does not match the digest", True),
        ({"step": 3}, r"recorded step \(3\) does not match .*recorded step 3 is not its folder's step 4", False),
        ({"sha256": {}}, r"its recorded sha256 \(\{\}\) does not match the digest", False),
    ],
)
def test_an_edited_record_is_named(trained, tmp_path, fields, match, acceptable):
    directory = _copy(trained, tmp_path)
    _edit_record(directory, 4, **fields)
    template = _digits_trainer().init_state()
    how = r"pass accept_changes=" if acceptable else r"resume from an earlier step"
    with pytest.raises(CheckpointError, match=match + ".*" + how):
        restore_checkpoint(directory, template)
    if acceptable:
        (name,) = fields
        with pytest.warns(UserWarning, match=f"accepted: its recorded {name}"):
            _, position, meta = restore_checkpoint(directory, template, accept_changes=(name,))
        assert position == tuple(fields.get("position", position)) and meta == fields.get("metadata", {"h": 8})


def test_a_step_replaced_by_a_file_is_reported(trained, tmp_path):
    import shutil

    directory = _copy(trained, tmp_path)
    shutil.rmtree(directory / "4")
    (directory / "4").write_text("not a checkpoint")
    with pytest.warns(
        UserWarning, match=r"not complete checkpoints: 4 \(not a folder\).*last complete checkpoint is step 2"
    ):
        assert latest_step(directory) == 2


def _values_file(state: Path) -> Path:
    """The OCDBT data file holding the arrays' values (the largest; the b-tree's nodes are in ``state/d``)."""
    return max(state.glob("ocdbt.process_*/d/*"), key=lambda p: p.stat().st_size)


@pytest.mark.parametrize(
    ("which", "damage", "match"),
    [
        ("metadata", "empty", r"array metadata file .*process_0: JSONDecodeError"),
        ("values", "empty", r"array \S+ in .*state: ValueError: OUT_OF_RANGE"),
        ("values", "first byte", r"array \S+ in .*state: ValueError: .*ZSTD"),
        ("b-tree", "half", r"array store .*state: ValueError: OUT_OF_RANGE: .*state/d/"),
        ("manifest", "garbage", r"array store .*state: ValueError: DATA_LOSS: .*manifest\.ocdbt"),
    ],
)
def test_a_damaged_array_file_is_one_clear_error(trained, tmp_path, capfd, which, damage, match):
    # orbax opens and reads the arrays in one asyncio.gather: a failing read used to end it
    # with the other reads in flight, whose completions printed "Event loop is closed" and
    # "Exception ignored in" tracebacks next to the error. Every file is now read to the end
    # (and every read waited for) before orbax starts, so only the one error is shown.
    directory = _copy(trained, tmp_path)
    state = directory / "4" / "state"
    path = {
        "metadata": lambda: next((state / "array_metadatas").iterdir()),
        "values": lambda: _values_file(state),
        "b-tree": lambda: next((state / "d").iterdir()),
        "manifest": lambda: state / "manifest.ocdbt",
    }[which]()
    raw = bytearray(path.read_bytes())
    raw[0] ^= 0xFF
    path.write_bytes({"empty": b"", "half": raw[: len(raw) // 2], "garbage": b"garbage", "first byte": raw}[damage])
    capfd.readouterr()
    with pytest.raises(CheckpointError, match=r"checkpoint 4 in .* is unreadable \(" + match):
        restore_checkpoint(directory, _digits_trainer().init_state())
    err = capfd.readouterr().err
    assert not any(s in err for s in ("Traceback", "Event loop is closed", "Exception ignored")), err[-2000:]


@pytest.mark.parametrize(
    ("kw", "error", "match"),
    [
        ({"checkpoint_every": -1}, ValueError, r"checkpoint_every must be an int >= 0 .*got -1"),
        ({"checkpoint_every": True}, ValueError, r"checkpoint_every must be an int >= 0"),
        ({"eval_every": -2}, ValueError, r"eval_every must be an int >= 0"),
        ({"metadata": {"lr": np.float32(0.1)}}, TypeError, r"metadata must be JSON-serialisable .*float32"),
        ({"metadata": [1]}, TypeError, r"metadata must be a dict"),
        ({"accept_changes": "transform"}, TypeError, r"accept_changes must be a tuple of names"),
        ({"accept_changes": ("lr",)}, ValueError, r"accept_changes: unknown \['lr'\]"),
    ],
)
def test_bad_fit_arguments_are_refused_before_any_work(tmp_path, kw, error, match):
    with pytest.raises(error, match=match):
        _fit(_digits_trainer(), tmp_path / "run", 2, **kw)
    assert not (tmp_path / "run").exists()
