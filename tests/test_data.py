"""Tests of jaxcomm.data: IDX/CSV readers, loaders, worker splits, resumable batching, text.

Synthetic files in tmp_path exercise every code path without the fetched data; the
``test_real_*`` tests check the real datasets' record counts when they are present (CI
fetches them in its set-up step) and skip with the reason otherwise.
"""

from __future__ import annotations

import gzip

import jax
import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

import jaxcomm.data as jd
from jaxcomm.data import _idx, _split, _text
from jaxcomm.data import fetch as jfetch
from jaxcomm.data._sources import data_dir

pytestmark = pytest.mark.strict_promotion

SKIP_REASON = "dataset not fetched; run python -m jaxcomm.data.fetch"


def _require(name: str):
    if not (data_dir() / name).exists():
        pytest.skip(SKIP_REASON)
    return data_dir() / name


def _labelled(n: int, num_classes: int = 10, hw: int = 2) -> jd.Dataset:
    """Images whose every pixel is the example's index, so examples can be identified after shuffling."""
    images = np.broadcast_to(np.arange(n, dtype=np.float32)[:, None, None, None], (n, hw, hw, 1)).copy()
    return jd.Dataset(images, (np.arange(n) % num_classes).astype(np.int32), num_classes)


def _ids(images: np.ndarray) -> np.ndarray:
    return images[..., 0, 0, 0].astype(np.int64)


def _write_mnist_like(directory, n_train=6, n_test=4, gz=False, dotted=False, seed=0):
    rng = np.random.default_rng(seed)
    directory.mkdir(parents=True, exist_ok=True)
    out = {}
    for prefix, n in (("train", n_train), ("t10k", n_test)):
        images = rng.integers(0, 256, size=(n, 28, 28), dtype=np.uint8)
        labels = rng.integers(0, 10, size=(n,), dtype=np.uint8)
        sep = "." if dotted else "-"
        suffix = ".gz" if gz else ""
        _idx.write_idx(directory / f"{prefix}-images{sep}idx3-ubyte{suffix}", images)
        _idx.write_idx(directory / f"{prefix}-labels{sep}idx1-ubyte{suffix}", labels)
        out[prefix] = (images, labels)
    return out


# --------------------------------------------------------------------------- #
# IDX and CSV
# --------------------------------------------------------------------------- #
def test_read_idx_matches_hand_built_bytes(tmp_path):
    # magic 00 00 08 02, dims 2 and 3 as big-endian uint32, then 6 bytes in C order.
    raw = bytes([0, 0, 8, 2, 0, 0, 0, 2, 0, 0, 0, 3, 1, 2, 3, 4, 5, 6])
    (tmp_path / "a").write_bytes(raw)
    (tmp_path / "a.gz").write_bytes(gzip.compress(raw))
    expected = np.array([[1, 2, 3], [4, 5, 6]], np.uint8)
    for name in ("a", "a.gz"):
        arr = _idx.read_idx(tmp_path / name)
        assert arr.dtype == np.uint8
        np.testing.assert_array_equal(arr, expected)
    # int32 is big-endian on disk: 258 = 0x00000102
    (tmp_path / "b").write_bytes(bytes([0, 0, 0x0C, 1, 0, 0, 0, 1, 0, 0, 1, 2]))
    assert _idx.read_idx(tmp_path / "b").tolist() == [258]


@settings(max_examples=10)
@given(
    dtype=st.sampled_from(["uint8", "int8", "int16", "int32", "float32", "float64"]),
    shape=st.lists(st.integers(0, 4), min_size=1, max_size=3),
    gz=st.booleans(),
)
def test_idx_round_trip(tmp_path_factory, dtype, shape, gz):
    rng = np.random.default_rng(0)
    arr = (rng.standard_normal(shape) * 100).astype(dtype)
    path = tmp_path_factory.mktemp("idx") / ("x.gz" if gz else "x")
    _idx.write_idx(path, arr)
    assert (path.read_bytes()[:2] == b"\x1f\x8b") == gz
    back = _idx.read_idx(path)
    assert back.dtype == arr.dtype and back.shape == arr.shape
    np.testing.assert_array_equal(back, arr)


def test_read_idx_rejects_malformed(tmp_path):
    (tmp_path / "bad_magic").write_bytes(bytes([1, 0, 8, 1, 0, 0, 0, 1, 7]))
    (tmp_path / "short").write_bytes(bytes([0, 0, 8, 1, 0, 0, 0, 3, 7]))
    (tmp_path / "code").write_bytes(bytes([0, 0, 0x42, 1, 0, 0, 0, 1, 7]))
    for name, match in (("bad_magic", "not an IDX"), ("short", "holds 1 bytes"), ("code", "type code")):
        with pytest.raises(ValueError, match=match):
            _idx.read_idx(tmp_path / name)
    with pytest.raises(TypeError, match="cannot be stored"):
        _idx.write_idx(tmp_path / "c", np.zeros(2, np.complex64))


def test_missing_path_says_how_to_fetch(tmp_path):
    missing = tmp_path / "no" / "such"
    for call in (
        lambda: _idx.read_idx(missing),
        lambda: jd.load_mnist(missing),
        lambda: jd.load_fashion_mnist(missing),
        lambda: jd.load_mnist5k(missing),
        lambda: jd.load_shakespeare(missing),
    ):
        with pytest.raises(FileNotFoundError) as e:
            call()
        assert str(missing) in str(e.value) and "python -m jaxcomm.data.fetch" in str(e.value)
    (tmp_path / "empty").mkdir()
    with pytest.raises(FileNotFoundError, match="train images"):
        jd.load_mnist(tmp_path / "empty")


def test_read_csv_images_label_positions_and_header(tmp_path):
    rng = np.random.default_rng(1)
    pixels = rng.integers(0, 256, size=(5, 2, 3, 1))
    labels = rng.integers(0, 10, size=5)
    flat = pixels.reshape(5, -1)
    last = "\n".join(",".join(map(str, [*row, y])) for row, y in zip(flat, labels))
    first = "p,q,r,s,t,u,label_first_header\n" + "\n".join(
        ",".join(map(str, [y, *row])) for row, y in zip(flat, labels)
    )
    (tmp_path / "last.csv.gz").write_bytes(gzip.compress(last.encode()))
    (tmp_path / "first.csv").write_text(first)
    for name, col in (("last.csv.gz", -1), ("first.csv", 0)):
        x, y = _idx.read_csv_images(tmp_path / name, image_shape=(2, 3, 1), label_column=col)
        assert x.dtype == np.float32 and y.dtype == np.int32
        np.testing.assert_array_equal(x, pixels.astype(np.float32))
        np.testing.assert_array_equal(y, labels)
    with pytest.raises(ValueError, match="fields"):
        _idx.read_csv_images(tmp_path / "last.csv.gz", image_shape=(2, 2, 1))


# --------------------------------------------------------------------------- #
# Loaders on synthetic files
# --------------------------------------------------------------------------- #
@pytest.mark.parametrize("gz,dotted", [(False, False), (True, False), (False, True)])
def test_load_mnist_and_fashion_from_synthetic_idx(tmp_path, gz, dotted):
    written = _write_mnist_like(tmp_path / "d", gz=gz, dotted=dotted)
    for loader in (jd.load_mnist, jd.load_fashion_mnist):
        for split, prefix in (("train", "train"), ("test", "t10k")):
            images, labels = written[prefix]
            ds = loader(tmp_path / "d", split=split)
            assert ds.images.shape == (len(labels), 28, 28, 1) and ds.images.dtype == np.float32
            np.testing.assert_allclose(ds.images[..., 0], images / 255.0, rtol=1e-7)
            assert ds.labels.dtype == np.int32 and ds.num_classes == 10
            np.testing.assert_array_equal(ds.labels, labels)
            raw = loader(tmp_path / "d", split=split, normalize=False)
            assert raw.images.dtype == np.uint8
            np.testing.assert_array_equal(raw.images[..., 0], images)
    with pytest.raises(ValueError, match="split"):
        jd.load_mnist(tmp_path / "d", split="valid")


def test_default_location_follows_env(tmp_path, monkeypatch):
    monkeypatch.setenv("JAXCOMM_DATA", str(tmp_path))
    assert data_dir() == tmp_path
    written = _write_mnist_like(tmp_path / "mnist")
    np.testing.assert_array_equal(jd.load_mnist(split="test").labels, written["t10k"][1])
    monkeypatch.delenv("JAXCOMM_DATA")
    assert str(data_dir()).endswith(".cache/jaxcomm")


def test_load_mnist5k_synthetic(tmp_path):
    rng = np.random.default_rng(2)
    flat = rng.integers(0, 256, size=(4, 784))
    labels = np.array([3, 0, 9, 3])
    text = "\n".join(",".join(map(str, [*row, y])) for row, y in zip(flat, labels))
    (tmp_path / "mnist5k").mkdir()
    (tmp_path / "mnist5k" / "mnist_5k.csv.gz").write_bytes(gzip.compress(text.encode()))
    ds = jd.load_mnist5k(tmp_path / "mnist5k")
    assert ds.images.shape == (4, 28, 28, 1)
    np.testing.assert_allclose(ds.images.reshape(4, -1), flat / 255.0, rtol=1e-6)
    np.testing.assert_array_equal(ds.labels, labels)


def test_load_digits_is_sklearn_digits():
    ds = jd.load_digits()
    assert ds.images.shape == (1797, 8, 8, 1) and ds.images.dtype == np.float32
    assert ds.images.min() == 0.0 and ds.images.max() == 1.0
    assert set(np.unique(ds.labels).tolist()) == set(range(10))


def test_standardize_uses_given_stats():
    ds = _labelled(10)
    out, (mean, std) = jd.standardize(ds)
    assert abs(out.images.mean()) < 1e-5 and abs(out.images.std() - 1) < 1e-5
    np.testing.assert_allclose(mean, [4.5])
    again, _ = jd.standardize(ds, mean, std)
    np.testing.assert_array_equal(again.images, out.images)
    with pytest.raises(ValueError, match="std"):
        jd.standardize(ds, [0.0], [0.0])


# --------------------------------------------------------------------------- #
# Worker splits
# --------------------------------------------------------------------------- #
@settings(max_examples=10)
@given(n=st.integers(8, 60), p=st.integers(1, 8), seed=st.integers(0, 2**16))
def test_split_iid_is_a_partition(n, p, seed):
    shards = jd.split_iid(_labelled(n), p, jax.random.key(seed))
    sizes = [s.num_examples for s in shards]
    assert len(shards) == p and max(sizes) - min(sizes) <= 1
    ids = np.concatenate([_ids(s.images) for s in shards])
    np.testing.assert_array_equal(np.sort(ids), np.arange(n))
    for s in shards:  # labels travel with their images
        np.testing.assert_array_equal(s.labels, _ids(s.images) % 10)


def test_split_iid_depends_on_key_only():
    ds = _labelled(40)
    a = jd.split_iid(ds, 4, jax.random.key(0))
    b = jd.split_iid(ds, 4, jax.random.key(0))
    c = jd.split_iid(ds, 4, jax.random.key(1))
    assert all(np.array_equal(x.labels, y.labels) and np.array_equal(x.images, y.images) for x, y in zip(a, b))
    assert not all(np.array_equal(_ids(x.images), _ids(y.images)) for x, y in zip(a, c))
    with pytest.raises(ValueError, match="num_workers"):
        jd.split_iid(ds, 41, jax.random.key(0))


@settings(max_examples=10)
@given(p=st.integers(1, 8), k=st.integers(1, 10), keyed=st.booleans())
def test_split_by_label_assigns_exact_label_sets(p, k, keyed):
    ds = _labelled(400)  # 40 examples per class
    if p * k < 10:
        with pytest.raises(ValueError, match="labels_per_worker"):
            jd.split_by_label(ds, p, k)
        return
    shards = jd.split_by_label(ds, p, k, key=jax.random.key(3) if keyed else None)
    ids = np.concatenate([_ids(s.images) for s in shards])
    np.testing.assert_array_equal(np.sort(ids), np.arange(400))  # a partition
    for w, s in enumerate(shards):
        assigned = {(w * k + j) % 10 for j in range(k)}
        assert set(np.unique(s.labels).tolist()) == assigned
        np.testing.assert_array_equal(s.labels, _ids(s.images) % 10)


def test_split_by_label_rejects_too_many_labels():
    with pytest.raises(ValueError, match="labels_per_worker"):
        jd.split_by_label(_labelled(40), 2, 11)


# --------------------------------------------------------------------------- #
# Resumable per-worker batches
# --------------------------------------------------------------------------- #
def test_worker_batches_shapes_and_epoch_coverage():
    shards = jd.split_iid(_labelled(50, hw=3), 4, jax.random.key(0))  # shard sizes 13, 13, 12, 12
    it = jd.WorkerBatches(shards, batch_size=8, key=jax.random.key(1))
    assert it.per_worker_batch == 2 and it.steps_per_epoch == 6  # floor(12 / 2)
    epoch = [next(it) for _ in range(it.steps_per_epoch)]
    assert it.position == _split.BatchPosition(1, 0)
    for b in epoch:
        assert b.images.shape == (4, 2, 3, 3, 1) and b.labels.shape == (4, 2)
    for w, shard in enumerate(shards):
        seen = np.concatenate([_ids(b.images[w]) for b in epoch])
        assert len(set(seen.tolist())) == 12  # no repeats within an epoch
        assert set(seen.tolist()) <= set(_ids(shard.images).tolist())  # only this worker's data
    nxt = next(it)  # a new epoch reshuffles
    assert not np.array_equal(_ids(nxt.images), _ids(epoch[0].images))


def test_worker_batches_resume_is_bit_identical():
    shards = jd.split_iid(_labelled(30, hw=2), 2, jax.random.key(0))
    key = jax.random.key(7)
    straight = jd.WorkerBatches(shards, 4, key)  # 7 steps per epoch
    run = [next(straight) for _ in range(17)]  # crosses two epoch boundaries
    first = jd.WorkerBatches(shards, 4, key)
    for _ in range(9):
        next(first)
    saved = tuple(first.position)  # what a checkpoint stores
    resumed = jd.WorkerBatches(shards, 4, key, start=_split.BatchPosition(*saved))
    for expected in run[9:]:
        got = next(resumed)
        np.testing.assert_array_equal(got.images, expected.images)
        np.testing.assert_array_equal(got.labels, expected.labels)
    assert resumed.position == straight.position


def test_worker_batches_key_forms_agree():
    shards = [_labelled(12)]
    typed = jd.WorkerBatches(shards, 4, jax.random.key(5))
    raw = jd.WorkerBatches(shards, 4, jax.random.PRNGKey(5))  # same key data, legacy form
    np.testing.assert_array_equal(next(typed).images, next(raw).images)
    with pytest.raises(TypeError, match="key"):
        jd.WorkerBatches(shards, 4, 5)


def test_worker_batches_unshuffled_reads_in_order():
    it = jd.WorkerBatches([_labelled(6)], 3, jax.random.key(0), shuffle=False, worker_axis=False)
    assert [_ids(next(it).images).tolist() for _ in range(3)] == [[0, 1, 2], [3, 4, 5], [0, 1, 2]]


def test_worker_batches_bad_input():
    shards = jd.split_iid(_labelled(40), 4, jax.random.key(0))
    with pytest.raises(ValueError, match="batch_size"):
        jd.WorkerBatches(shards, 10, jax.random.key(0))
    with pytest.raises(ValueError, match="batch_size"):
        jd.WorkerBatches(shards, 44, jax.random.key(0))  # 11 per worker > 10 per shard
    with pytest.raises(ValueError, match="steps_per_epoch"):
        jd.WorkerBatches(shards, 8, jax.random.key(0), start=_split.BatchPosition(0, 5))


# --------------------------------------------------------------------------- #
# Text
# --------------------------------------------------------------------------- #
def test_strip_play_markdown():
    md = "# Hamlet\n\n## ACT I\n\n**HAMLET**  \nTo be, or not to be  \n_Exit_\n__\\[Aside]_  \n"
    assert _text.strip_play_markdown(md) == "Hamlet\n\nACT I\n\nHAMLET:\nTo be, or not to be\nExit\n[Aside]\n"


def test_load_shakespeare_reads_sorted_files(tmp_path):
    (tmp_path / "b").mkdir()
    (tmp_path / "b" / "z.md").write_text("**A**  \nsecond\n")
    (tmp_path / "a.txt").write_text("first **kept**\n")
    assert jd.load_shakespeare(tmp_path) == "first **kept**\n\nA:\nsecond\n"
    assert jd.load_shakespeare(tmp_path / "b" / "z.md", strip_markdown=False) == "**A**  \nsecond\n"
    (tmp_path / "none").mkdir()
    with pytest.raises(FileNotFoundError, match="fetch"):
        jd.load_shakespeare(tmp_path / "none")


@settings(max_examples=15)
@given(text=st.text(alphabet="abc xyz\n.!", min_size=12, max_size=200))
def test_char_corpus_round_trip_and_split(text):
    c = jd.CharCorpus(text, valid_fraction=0.25)
    assert c.vocab == "".join(sorted(set(text)))
    assert c.decode(c.encode(text)) == text
    assert len(c.train) + len(c.valid) == len(text) and len(c.valid) == round(len(text) * 0.25)
    assert c.decode(np.concatenate([c.train, c.valid])) == text


def test_char_corpus_windows_and_batches():
    text = "".join(chr(ord("a") + i % 26) for i in range(1000))
    c = jd.CharCorpus(text, valid_fraction=0.1)
    x, y = c.windows(10)
    assert x.shape == ((900 - 1) // 10, 10)
    np.testing.assert_array_equal(x[:, 1:], y[:, :-1])  # targets are inputs shifted by one
    np.testing.assert_array_equal(x.reshape(-1), c.train[: x.size])  # windows tile the text
    it = c.batches(10, 8, jax.random.key(0))
    bx, by = next(it)
    assert bx.shape == by.shape == (8, 10) and bx.dtype == np.int32
    np.testing.assert_array_equal((bx + 1) % 26, by)
    wit = c.batches(10, 8, jax.random.key(0), num_workers=4, split="valid")
    wx, _ = next(wit)
    assert wx.shape == (4, 2, 10)
    with pytest.raises(ValueError, match="outside the vocabulary"):
        c.encode("A")
    with pytest.raises(ValueError, match="batch_size"):
        c.batches(10, 6, jax.random.key(0), num_workers=4)


# --------------------------------------------------------------------------- #
# Fetch CLI (offline parts) and the real datasets
# --------------------------------------------------------------------------- #
def test_fetch_rejects_unknown_names_and_verify_reports_missing(tmp_path):
    with pytest.raises(ValueError, match="unknown dataset"):
        jfetch.fetch(["cifar10"], root=tmp_path)
    assert jfetch.main(["--only", "cifar10", "--root", str(tmp_path)]) == 1
    with pytest.raises(jfetch.FetchError, match="missing"):
        jfetch.verify("mnist", tmp_path)


def test_real_mnist():
    path = _require("mnist")
    train, test = jd.load_mnist(path, "train"), jd.load_mnist(path, "test")
    assert train.images.shape == (60000, 28, 28, 1) and test.images.shape == (10000, 28, 28, 1)
    assert train.images.min() >= 0.0 and train.images.max() <= 1.0
    # Published facts of MNIST: 6,742 training ones; pixel mean 0.1307 and std 0.3081.
    assert np.bincount(train.labels).tolist()[1] == 6742 and np.bincount(test.labels).sum() == 10000
    _, (mean, std) = jd.standardize(train)
    np.testing.assert_allclose([mean[0], std[0]], [0.1307, 0.3081], atol=5e-5)


def test_real_fashion_mnist():
    path = _require("fashion_mnist")
    train, test = jd.load_fashion_mnist(path, "train", normalize=False), jd.load_fashion_mnist(path, "test")
    assert train.images.shape == (60000, 28, 28, 1) and test.images.shape == (10000, 28, 28, 1)
    assert np.bincount(train.labels).tolist() == [6000] * 10  # balanced by construction
    assert np.bincount(test.labels).tolist() == [1000] * 10


def test_real_mnist5k():
    path = _require("mnist5k")
    ds = jd.load_mnist5k(path)
    assert ds.images.shape == (5000, 28, 28, 1) and ds.images.max() == 1.0
    assert np.bincount(ds.labels).tolist() == [500] * 10


def test_real_shakespeare():
    path = _require("shakespeare")
    assert "38 plays" in jfetch.verify("shakespeare", path.parent)
    text = jd.load_shakespeare(path)
    assert len(text) > 4_900_000 and "To be, or not to be" in text
    corpus = jd.CharCorpus(text)
    assert corpus.vocab_size < 100 and set("abcdefghijklmnopqrstuvwxyz") <= set(corpus.vocab)
    reports = jfetch.fetch(["shakespeare"], root=path.parent, log=lambda s: None)
    assert [r.status for r in reports] == ["present"]  # idempotent: nothing refetched
