"""Bad input across the public API: a clear ValueError/TypeError naming the argument, before work starts.

Each row is ``(id, call, exception type, regex)``: ``call()`` must raise that type with a
message matching the regex, which names the argument (and, where there is one, the accepted
range). Dataset files that are truncated, corrupt or malformed raise one-line
``jaxcomm.data.DatasetError`` messages naming the file and the fix.
"""

from __future__ import annotations

import gzip

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

import jaxcomm as jc
import jaxcomm.data as jd
from jaxcomm import algorithms, compressors, memory, topology
from jaxcomm import transforms as T
from jaxcomm._validate import SEED_LIMIT
from jaxcomm.algorithms import _eventgrad
from jaxcomm.data._idx import read_csv_images, write_idx
from jaxcomm.train._mesh import stack_workers

KEY = jax.random.PRNGKey(0)
X = jnp.arange(1.0, 9.0)

# One valid set of hyper-parameters per compressor that needs some.
REQUIRED = {
    "adaptive": {"ratio": 0.5},
    "dgc": {"ratio": 0.5},
    "qsparse": {"ratio": 0.5, "levels": 4},
    "random_sparsification": {"p": 0.5},
    "randomk": {"ratio": 0.5},
    "threshold": {"v": 0.1},
    "topk": {"ratio": 0.5},
}
NAMES = compressors.names()


def build(name, **kwargs):
    return compressors.make(name, **{**REQUIRED.get(name, {}), **kwargs})


def update_with(tx, init_tree, update_tree):
    """``tx.update(update_tree, tx.init(init_tree))``: the init/update mismatch cases."""
    return tx.update(update_tree, tx.init(init_tree), init_tree)


# --------------------------------------------------------------------------- #
# The compressors' per-array calls, for every registered compressor
# --------------------------------------------------------------------------- #
PER_COMPRESSOR = [
    ("empty", lambda c: c.compress(jnp.zeros((0,)), KEY), ValueError, r"\bx has no entries .*non-empty"),
    ("empty-2d", lambda c: c.compress(jnp.zeros((3, 0)), KEY), ValueError, r"\bx has no entries"),
    ("int", lambda c: c.compress(jnp.arange(4), KEY), TypeError, r"\bx must have a real floating dtype"),
    ("complex", lambda c: c.compress(jnp.ones(4, jnp.complex64), KEY), TypeError, r"\bx must have a real floating"),
    ("bool", lambda c: c.compress(jnp.ones(4, bool), KEY), TypeError, r"\bx must have a real floating dtype"),
    ("list", lambda c: c.compress([1.0, 2.0], KEY), TypeError, r"\bx must be a JAX or NumPy array"),
    ("str-key", lambda c: c.compress(X, "abc"), TypeError, r"\bkey must be a single JAX PRNG key.*got str"),
    ("float-key", lambda c: c.compress(X, 1.5), TypeError, r"\bkey must be a single JAX PRNG key.*got float"),
    ("int-key", lambda c: c.compress(X, 3), TypeError, r"\bkey must be a single JAX PRNG key.*got int"),
    ("key-shape", lambda c: c.compress(X, jnp.zeros(3, jnp.uint32)), TypeError, r"\bkey must .*shape \(3,\)"),
    ("key-float", lambda c: c.compress(X, jnp.zeros(2, jnp.float32)), TypeError, r"\bkey must .*float32"),
    ("keys-batch", lambda c: c.compress(X, jax.random.split(KEY, 2)), TypeError, r"\bkey must be a single"),
    ("payload-str", lambda c: c.decompress("abc"), TypeError, r"\bpayload must be a jaxcomm.compressors.Payload"),
    ("payload-array", lambda c: c.decompress(X), TypeError, r"\bpayload must be a .*got ArrayImpl"),
    ("init-int", lambda c: c.init({"a": jnp.arange(4)}), TypeError, r"\bparams must have a real floating dtype"),
    ("init-empty", lambda c: c.init({"a": jnp.zeros((0,))}), ValueError, r"\bparams has no entries"),
    ("seed-negative", lambda c: None, ValueError, r"\bseed must be >= 0"),
    ("seed-2**32", lambda c: None, ValueError, r"\bseed must be below 2\*\*32"),
    ("seed-float", lambda c: None, TypeError, r"\bseed must be an integer"),
    ("seed-bool", lambda c: None, TypeError, r"\bseed must be an integer"),
]
_SEEDS = {"seed-negative": -1, "seed-2**32": 2**32, "seed-float": 1.5, "seed-bool": True}


@pytest.mark.parametrize("name", NAMES)
@pytest.mark.parametrize("case, call, exc, pattern", PER_COMPRESSOR, ids=[c[0] for c in PER_COMPRESSOR])
def test_compressor_per_array_bad_input(name, case, call, exc, pattern):
    with pytest.raises(exc, match=pattern):
        if case in _SEEDS:
            build(name, seed=_SEEDS[case])
        else:
            call(build(name))


@pytest.mark.parametrize("name", NAMES)
def test_compressor_valid_edge_inputs_still_work(name):
    """The checks refuse nothing valid: a 0-d array, a typed key and a raw key round-trip to x's shape."""
    c = build(name)
    for x, key in ((jnp.asarray(3.0), KEY), (X, jax.random.key(1)), (X.reshape(2, 4), KEY)):
        y, _ = c.roundtrip(x, key)
        assert y.shape == x.shape and y.dtype == x.dtype


@pytest.mark.parametrize("name", [n for n in NAMES if jax.tree.leaves(build(n).init_state(jnp.ones((8, 8))))])
def test_stateful_compressor_update_names_a_changed_leaf_shape(name):
    """A stateful compressor's state is built for one shape (PowerSGD's Q, signum's momentum): another shape is
    refused with the shapes named; the check runs on shapes only (``jax.eval_shape``)."""
    c = build(name)
    with pytest.raises(ValueError, match=r"updates: a tensor of shape \(8, 9\) does not match its .* state"):
        update_with(c, {"a": jnp.ones((8, 8))}, {"a": jnp.ones((8, 9))})


@pytest.mark.parametrize("name", [n for n in NAMES if not jax.tree.leaves(build(n).init_state(jnp.ones((8, 8))))])
def test_stateless_compressor_update_accepts_any_shapes(name):
    """A stateless compressor keeps nothing shaped, so (like ``optax.scale``) a new leaf shape is valid input."""
    c = build(name)
    out, _ = update_with(c, {"a": jnp.ones((3, 4))}, {"a": jnp.ones((4, 5))})
    assert out["a"].shape == (4, 5)


# --------------------------------------------------------------------------- #
# Factories, transforms, memories, algorithms, the rest of the API
# --------------------------------------------------------------------------- #
NAN, INF = float("nan"), float("inf")
_PS = compressors.powersgd(rank=1)
_TK = compressors.topk(ratio=0.5)

CASES = [
    # compressor hyper-parameters
    ("topk-ratio-0", lambda: compressors.topk(ratio=0), ValueError, r"ratio must be in \(0, 1\]"),
    ("topk-ratio-1.5", lambda: compressors.topk(ratio=1.5), ValueError, r"ratio must be in \(0, 1\]"),
    ("topk-ratio-nan", lambda: compressors.topk(ratio=NAN), ValueError, r"ratio must be in \(0, 1\]"),
    ("topk-ratio-bool", lambda: compressors.topk(ratio=True), TypeError, r"ratio must be a real number"),
    ("topk-ratio-str", lambda: compressors.topk(ratio="0.1"), TypeError, r"ratio must be a real number"),
    ("qsgd-levels-0", lambda: compressors.qsgd(levels=0), ValueError, r"levels must be >= 1"),
    ("qsgd-levels-float", lambda: compressors.qsgd(levels=1.5), TypeError, r"levels must be an integer"),
    ("qsparse-levels-0", lambda: compressors.qsparse(ratio=0.5, levels=0), ValueError, r"levels must be >= 1"),
    ("powersgd-rank-0", lambda: compressors.powersgd(rank=0), ValueError, r"rank"),
    ("random-sparsification-p-0", lambda: compressors.random_sparsification(p=0), ValueError, r"\bp must be in"),
    ("signum-momentum-7", lambda: compressors.signum(momentum=7.0), ValueError, r"momentum"),
    ("inceptionn-error-bound-inf", lambda: compressors.inceptionn(error_bound=INF), ValueError, r"error_bound"),
    ("make-unknown", lambda: compressors.make("nope"), ValueError, r"unknown compressor 'nope'; valid names"),
    ("contractive-str", lambda: compressors.contractive("topk"), TypeError, r"compressor must be"),
    ("half-str", lambda: compressors.half("topk"), TypeError, r"compressor must be a jaxcomm\.compressors"),
    ("half-dtype", lambda: compressors.half(_TK, "float32"), ValueError, r"dtype must be 'float16' or 'bfloat16'"),
    # memories
    ("residual-beta-nan", lambda: memory.residual(beta=NAN), ValueError, r"beta must be finite"),
    ("residual-gamma-negative", lambda: memory.residual(gamma=-1.0), ValueError, r"gamma must be > 0"),
    ("dgc-momentum-7", lambda: memory.dgc(momentum=7), ValueError, r"momentum must be in \[0, 1\)"),
    ("efsignsgd-lr-0", lambda: memory.efsignsgd(0.0), ValueError, r"learning_rate"),
    # transforms: construction
    ("error-feedback-str", lambda: jc.error_feedback("topk"), TypeError, r"compressor must be a jaxcomm"),
    ("error-feedback-memory-str", lambda: jc.error_feedback(_TK, memory="residual"), TypeError, r"memory must be"),
    ("compressed-mean-strategy", lambda: jc.compressed_mean(_TK, axis_name="d", strategy="x"), ValueError, r"strategy"),
    ("gradient-dropping-1.5", lambda: jc.gradient_dropping(1.5, axis_name="d"), ValueError, r"drop_ratio"),
    ("gradient-dropping-mode", lambda: jc.gradient_dropping(0.9, mode="x", axis_name="d"), ValueError, r"mode"),
    ("periodic-average-0", lambda: jc.periodic_average(0, axis_name="d"), ValueError, r"every"),
    ("accumulate-every-k-0", lambda: T.accumulate(optax.sgd(0.1), 0), ValueError, r"every_k must be >= 1"),
    ("accumulate-inner-str", lambda: T.accumulate("sgd", 2), TypeError, r"inner must be an optax"),
    # transforms: init and update must see the same tree
    (
        "issue-powersgd-no-memory-leaf-shape",
        lambda: update_with(
            jc.error_feedback(_PS, memory=memory.none()), {"a": jnp.ones((8, 8))}, {"a": jnp.ones((8, 9))}
        ),
        ValueError,
        r"updates: a tensor of shape \(8, 9\) does not match its 'powersgd' compressor state",
    ),
    (
        "powersgd-no-memory-3d-leaf",
        lambda: update_with(
            jc.error_feedback(compressors.powersgd(rank=2), memory=memory.none()),
            {"a": jnp.ones((2, 8, 8))},
            {"a": jnp.ones((2, 8, 9))},
        ),
        ValueError,
        r"updates: a tensor of shape \(2, 8, 9\)",
    ),
    (
        "compressed-mean-powersgd-no-memory",
        lambda: update_with(
            jc.compressed_mean(_PS, comm=jc.comm.Local(), memory=memory.none()),
            {"a": jnp.ones((8, 8))},
            {"a": jnp.ones((8, 9))},
        ),
        ValueError,
        r"updates: a tensor of shape \(8, 9\)",
    ),
    (
        "error-feedback-residual-leaf-shape",
        lambda: update_with(jc.error_feedback(_TK), {"a": jnp.ones((3,))}, {"a": jnp.ones((4,))}),
        ValueError,
        r"updates: a gradient leaf has shape \(4,\)",
    ),
    (
        "error-feedback-tree",
        lambda: update_with(jc.error_feedback(_TK), {"a": jnp.ones((3,))}, {"b": jnp.ones((3,))}),
        ValueError,
        r"updates has tree structure",
    ),
    (
        "error-feedback-int-updates",
        lambda: update_with(jc.error_feedback(_TK), {"a": jnp.ones((3,))}, {"a": jnp.ones((3,), jnp.int32)}),
        TypeError,
        r"updates must have a real floating dtype",
    ),
    (
        "issue-scaled-sign-empty-leaf",
        lambda: jc.error_feedback(compressors.scaled_sign(), memory=memory.none()).init({"a": jnp.zeros((0,))}),
        ValueError,
        r"params has no entries \(shape \(0,\)\)",
    ),
    (
        "accumulate-leaf-shape",
        lambda: update_with(T.accumulate(optax.sgd(0.1), 2), {"a": jnp.ones((3,))}, {"a": jnp.ones((4,))}),
        ValueError,
        r"updates: leaf 0 has shape \(4,\) but the accumulated gradient was initialised for shape \(3,\)",
    ),
    (
        "accumulate-tree",
        lambda: update_with(T.accumulate(optax.sgd(0.1), 2), {"a": jnp.ones((3,))}, {"b": jnp.ones((3,))}),
        ValueError,
        r"updates has tree structure .* but the accumulated gradient",
    ),
    # topology, algorithms
    ("ring-0", lambda: topology.ring(0), ValueError, r"num_workers"),
    ("topology-unknown", lambda: topology.make("x", 4), ValueError, r"unknown topology 'x'"),
    ("from-matrix-not-stochastic", lambda: topology.from_matrix(np.ones((3, 3))), ValueError, r"weights"),
    ("spectral-gap-str", lambda: topology.spectral_gap("abc"), TypeError, r"weights must be a numeric"),
    ("spectral-gap-non-square", lambda: topology.spectral_gap(np.ones((2, 3))), ValueError, r"weights must be"),
    ("topk-count-size", lambda: _eventgrad.topk_count(-1, 0.5), ValueError, r"size must be >= 0"),
    ("topk-count-ratio", lambda: _eventgrad.topk_count(10, 0.0), ValueError, r"ratio must be in \(0, 1\]"),
    ("eventgrad-horizon", lambda: algorithms.eventgrad("ring", 0.1, num_workers=4, horizon=-1), ValueError, "horizon"),
    ("dpsgd-lr", lambda: algorithms.dpsgd("ring", -1.0, num_workers=4), ValueError, r"learning rate|optimizer"),
    (
        "eager-sgd-key-alias",
        lambda: algorithms.eager_sgd("solo", jc.imbalance.RandomDelay(4), key=2**32 + 5, axis_name="d"),
        ValueError,
        r"key: an int key is a seed; seed must be below 2\*\*32 .* same key as 5",
    ),
    (
        "eager-sgd-key-negative",
        lambda: algorithms.eager_sgd("solo", jc.imbalance.RandomDelay(4), key=-1, axis_name="d"),
        ValueError,
        r"key: an int key is a seed; seed must be >= 0",
    ),
    (
        "eager-sgd-key-str",
        lambda: algorithms.eager_sgd("solo", jc.imbalance.RandomDelay(4), key="abc", axis_name="d"),
        TypeError,
        r"key must be a jax PRNG key",
    ),
    # training
    ("make-mesh-axis-name", lambda: jc.train.make_mesh(1, axis_name=3), TypeError, r"axis_name must be a non-empty"),
    ("make-mesh-0", lambda: jc.train.make_mesh(0), ValueError, r"num_workers must be >= 1; got 0"),
    ("stack-workers-0", lambda: stack_workers({"a": jnp.ones(2)}, 0), ValueError, r"num_workers must be"),
    # cost model
    ("network-bandwidth-0", lambda: jc.cost_model.Network(0.0), ValueError, r"bandwidth_gbps"),
    (
        "allreduce-time-workers-0",
        lambda: jc.cost_model.allreduce_time(8, 0, jc.cost_model.Network(1.0)),
        ValueError,
        r"workers",
    ),
    # data
    ("charcorpus-empty", lambda: jd.CharCorpus(""), ValueError, r"text must be a non-empty string"),
    ("load-mnist-split", lambda: jd.load_mnist(split="x"), ValueError, r"split must be one of"),
]


@pytest.mark.parametrize("case, call, exc, pattern", CASES, ids=[c[0] for c in CASES])
def test_bad_input_names_the_argument(case, call, exc, pattern):
    with pytest.raises(exc, match=pattern):
        call()


def _tiny_model():
    from flax import nnx

    class Linear(nnx.Module):
        def __init__(self, rngs):
            self.layer = nnx.Linear(4, 2, rngs=rngs)

        def __call__(self, x):
            return self.layer(x)

    return Linear(nnx.Rngs(0))


@pytest.mark.parametrize(
    "kwargs, exc, pattern",
    [
        ({"tx": "sgd"}, TypeError, r"tx must be an optax GradientTransformation"),
        ({"seed": -1}, ValueError, r"seed must be >= 0"),
        ({"seed": 2**32}, ValueError, r"seed must be below 2\*\*32"),
        ({"seed": "a"}, TypeError, r"seed must be an integer"),
        ({"num_workers": 0}, ValueError, r"num_workers must be >= 1; got 0"),
        ({"task": "x"}, ValueError, r"task must be"),
    ],
    ids=["tx", "seed-negative", "seed-2**32", "seed-str", "num-workers", "task"],
)
def test_trainer_bad_input(kwargs, exc, pattern):
    args = {"tx": optax.sgd(0.1), "num_workers": 1, **kwargs}
    with pytest.raises(exc, match=pattern):
        jc.train.Trainer(_tiny_model(), **args)


# --------------------------------------------------------------------------- #
# Varying inputs
# --------------------------------------------------------------------------- #
@settings(max_examples=60, deadline=None)
@given(seed=st.integers(min_value=-(2**70), max_value=2**70))
def test_seeds_any_python_int_accepted_in_range_or_refused_by_name(seed):
    """Any Python int: a seed in [0, 2**32) gives PRNGKey(seed); anything else is refused, never aliased."""
    if 0 <= seed < SEED_LIMIT:
        c = compressors.topk(ratio=0.5, seed=seed)
        assert c.seed == seed
        np.testing.assert_array_equal(c.init({"a": X}).key, jax.random.PRNGKey(seed))
    else:
        with pytest.raises(ValueError, match=r"\bseed must be (>= 0|below 2\*\*32)"):
            compressors.topk(ratio=0.5, seed=seed)


@settings(max_examples=60, deadline=None)
@given(ratio=st.one_of(st.floats(allow_nan=True, allow_infinity=True), st.integers(-5, 5)))
def test_ratio_outside_unit_interval_refused(ratio):
    """``ratio`` in (0, 1] builds; every other real number is refused by name with the range."""
    if (isinstance(ratio, float) and 0.0 < ratio <= 1.0) or ratio == 1:
        assert compressors.topk(ratio=ratio).params["ratio"] == float(ratio)
    else:
        with pytest.raises(ValueError, match=r"ratio must be in \(0, 1\]"):
            compressors.topk(ratio=ratio)


@settings(max_examples=40, deadline=None)
@given(
    shape=st.lists(st.integers(0, 4), min_size=0, max_size=3).map(tuple),
    dtype=st.sampled_from([jnp.uint32, jnp.int32, jnp.float32, jnp.uint8]),
)
def test_only_a_single_prng_key_is_accepted(shape, dtype):
    """A raw key is exactly uint32[2]; any other shape or dtype is refused by name."""
    c = compressors.randomk(ratio=0.5)
    key = jnp.zeros(shape, dtype)
    if dtype == jnp.uint32 and shape == (2,):
        c.compress(X, key)
    else:
        with pytest.raises(TypeError, match=r"\bkey must be a single JAX PRNG key"):
            c.compress(X, key)


def test_key_check_holds_under_jit():
    """The key check reads only shapes and dtypes, so it runs (once) at trace time under jax.jit."""
    c = compressors.randomk(ratio=0.5)
    f = jax.jit(lambda x, k: c.roundtrip(x, k)[0])
    assert f(X, KEY).shape == X.shape
    with pytest.raises(TypeError, match=r"\bkey must be a single JAX PRNG key.*float32"):
        f(X, jnp.zeros(2, jnp.float32))


# --------------------------------------------------------------------------- #
# Dataset files: validated on load, one line naming the file and the fix
# --------------------------------------------------------------------------- #
def _mnist_dir(root, name, labels=(0, 1, 2, 3, 4), images=5):
    d = root / name
    d.mkdir()
    write_idx(d / "train-images-idx3-ubyte.gz", np.arange(images * 16, dtype=np.uint8).reshape(images, 4, 4))
    write_idx(d / "train-labels-idx1-ubyte.gz", np.asarray(labels, np.uint8))
    return d


def _assert_one_line(err: pytest.ExceptionInfo, path, pattern: str):
    message = str(err.value)
    assert "\n" not in message
    assert repr(str(path)) in message, message
    assert "python -m jaxcomm.data.fetch" in message
    assert err.match(pattern)
    assert isinstance(err.value, ValueError) and err.value.path == str(path)


def test_valid_idx_dataset_loads(tmp_path):
    d = _mnist_dir(tmp_path, "ok")
    ds = jd.load_mnist(d)
    np.testing.assert_array_equal(ds.labels, [0, 1, 2, 3, 4])
    assert ds.images.shape == (5, 4, 4, 1) and ds.labels.dtype == np.int32


@pytest.mark.parametrize("labels, pattern", [((0, 1, 12, 3, 4), r"labels must lie in \[0, 10\); label 12 at index 2")])
def test_idx_labels_out_of_range(tmp_path, labels, pattern):
    d = _mnist_dir(tmp_path, "bad", labels=labels)
    with pytest.raises(jd.DatasetError) as err:
        jd.load_mnist(d)
    _assert_one_line(err, d / "train-labels-idx1-ubyte.gz", pattern)


def test_idx_label_count_differs_from_images(tmp_path):
    d = _mnist_dir(tmp_path, "count", labels=(0, 1, 2))
    with pytest.raises(jd.DatasetError) as err:
        jd.load_mnist(d)
    _assert_one_line(err, d / "train-labels-idx1-ubyte.gz", r"labels \(3,\) do not pair with the 5 images")


@pytest.mark.parametrize("cut", [1, 12, 40])
def test_truncated_gzip_names_the_file(tmp_path, cut):
    d = _mnist_dir(tmp_path, "trunc")
    f = d / "train-images-idx3-ubyte.gz"
    f.write_bytes(f.read_bytes()[:-cut])
    with pytest.raises(jd.DatasetError) as err:
        jd.load_mnist(d)
    _assert_one_line(err, f, r"truncated gzip file|corrupt gzip file")


@pytest.mark.parametrize(
    "offset, pattern", [(12, r"corrupt gzip file \(zlib.error"), (-6, r"corrupt gzip file \(BadGzipFile: CRC")]
)
def test_corrupt_gzip_names_the_file(tmp_path, offset, pattern):
    d = _mnist_dir(tmp_path, "corrupt")
    f = d / "train-labels-idx1-ubyte.gz"
    raw = bytearray(f.read_bytes())
    raw[offset] ^= 0xFF
    if offset > 0:
        raw[offset + 1] ^= 0xFF
    f.write_bytes(bytes(raw))
    with pytest.raises(jd.DatasetError) as err:
        jd.load_mnist(d)
    _assert_one_line(err, f, pattern)


def test_truncated_idx_payload_names_the_file(tmp_path):
    d = _mnist_dir(tmp_path, "short")
    f = d / "train-images-idx3-ubyte.gz"
    f.write_bytes(gzip.compress(gzip.decompress(f.read_bytes())[:-10]))
    with pytest.raises(jd.DatasetError) as err:
        jd.load_mnist(d)
    _assert_one_line(err, f, r"IDX header says shape \(5, 4, 4\) .* holds 70 bytes")


def _csv(rows) -> str:
    return "".join(",".join(str(v) for v in row) + "\n" for row in rows)


@pytest.mark.parametrize(
    "content, pattern",
    [
        (_csv([[0] * 784 + [3], [0] * 784 + [10]]), r"labels must lie in \[0, 10\); label 10 at index 1"),
        (_csv([[0] * 784 + [3], [0] * 784 + [-1]]), r"labels must lie in \[0, 10\); label -1 at index 1"),
        (_csv([[0] * 784 + [3], [0] * 300]), r"row 2 of the data has 300 fields; .* needs 785"),
        (_csv([[0] * 784 + [3], [0] * 783 + ["x", 1]]), r"every field must be a number"),
        (_csv([[0] * 784 + [2.5]]), r"non-integer values"),
        (_csv([[0] * 783 + ["nan", 2]]), r"non-finite values"),
    ],
    ids=["label-10", "label-negative", "truncated-row", "non-numeric", "float-label", "nan"],
)
def test_malformed_csv_names_the_file(tmp_path, content, pattern):
    f = tmp_path / "mnist_5k.csv"
    f.write_text(content)
    with pytest.raises(jd.DatasetError) as err:
        jd.load_mnist5k(f)
    _assert_one_line(err, f, pattern)


def test_csv_gzip_truncated_and_not_utf8(tmp_path):
    f = tmp_path / "mnist_5k.csv.gz"
    f.write_bytes(gzip.compress(_csv([[0] * 784 + [1]] * 50).encode())[:-30])
    with pytest.raises(jd.DatasetError) as err:
        jd.load_mnist5k(f)
    _assert_one_line(err, f, r"truncated gzip file")
    g = tmp_path / "latin1.csv"
    g.write_bytes(b"1,2,\xff,0\n")
    with pytest.raises(jd.DatasetError) as err:
        read_csv_images(g, image_shape=(3,))
    _assert_one_line(err, g, r"not UTF-8 text \(byte 0xff at offset 4\)")


def test_shakespeare_not_utf8_names_the_file(tmp_path):
    (tmp_path / "a.md").write_text("**HAMLET**\nTo be.\n")
    bad = tmp_path / "b.txt"
    bad.write_bytes("Or not to be.".encode("utf-16"))
    with pytest.raises(jd.DatasetError) as err:
        jd.load_shakespeare(tmp_path)
    _assert_one_line(err, bad, r"not UTF-8 text \(byte 0xff at offset 0\)")


@pytest.mark.parametrize(
    ("images", "labels", "num_classes", "pattern"),
    [
        (np.zeros((4, 2, 2, 1)), np.array([0, 1, 2, 12]), 10, r"labels must lie in \[0, 10\); label 12 at index 3"),
        (np.zeros((4, 2, 2, 1)), np.array([0, 1, -1, 2]), 10, r"label -1 at index 2"),
        (np.zeros((4, 2, 2, 1)), np.array([0.0, 1.5, 2.0, 3.0]), 10, "labels must be integers"),
        (np.zeros((3, 2, 2, 1)), np.array([0, 1, 2, 3]), 10, r"disagree on N"),
        (np.zeros((4, 2, 2, 1)), np.zeros((4, 1), np.int32), 10, "one-dimensional"),
        (np.zeros((4, 2, 2, 1)), np.array([0, 1, 2, 3]), 0, "num_classes must be a positive int"),
    ],
)
def test_hand_built_dataset_is_checked_where_it_is_used(images, labels, num_classes, pattern):
    """A Dataset built in memory is checked by WorkerBatches (naming the shard) and the splits."""
    ds = jd.Dataset(images, labels, num_classes)
    with pytest.raises(jd.DatasetError, match=pattern) as err:
        jd.WorkerBatches([ds.take(slice(0, 4)), ds], 2, jax.random.PRNGKey(0))
    assert "'shard 0'" in str(err.value) and "\n" not in str(err.value)
    with pytest.raises(jd.DatasetError, match=pattern):
        jd.split_iid(ds, 2, jax.random.PRNGKey(0))
    with pytest.raises(jd.DatasetError, match=pattern):
        ds.check()
