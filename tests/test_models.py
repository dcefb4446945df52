"""Tests of jaxcomm.models: shapes, closed-form parameter counts, layer arithmetic, a NumPy LSTM
reference, dropout semantics, and that a few gradient steps reduce the loss.

Cost control (XLA compiles every initializer and op shape once, which dominates on 2 CPU cores):
parameter counts and shapes use abstract evaluation (``nnx.eval_shape`` / ``jax.eval_shape``: no
compilation, no FLOPs); each concrete model is built once per module (fixtures) and numerical
checks run jitted, one compilation each.
"""

from __future__ import annotations

import itertools

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from flax import nnx
from hypothesis import given, settings
from hypothesis import strategies as st

import jaxcomm.models as jm
from jaxcomm.models._resnet import BasicBlock

pytestmark = pytest.mark.strict_promotion


def _mlp_count(sizes):
    return sum(a * b + b for a, b in itertools.pairwise(sizes))


def _lstm_lm_count(v, e, h, layers):
    d = [e] + [h] * (layers - 1)
    return v * e + sum(4 * h * (di + h + 1) for di in d) + h * v + v


def _resnet20_count(c, k):
    convs = 9 * (16 * c + 6 * 16 * 16 + 16 * 32 + 5 * 32 * 32 + 32 * 64 + 5 * 64 * 64)
    norms = 2 * (16 * 7 + 32 * 6 + 64 * 6)
    return convs + norms + 64 * k + k


def _abstract(build):
    """The model with ShapeDtypeStruct leaves: parameters counted without initialising them."""
    return nnx.eval_shape(build)


def _out_shape(build, x, **kwargs):
    """Output shape of ``build()(x)``, initialisation and call both abstract."""
    return jax.eval_shape(lambda x: build()(x, **kwargs), x).shape


@pytest.fixture(scope="module")
def cnn():
    return jm.EventGradCNN(rngs=nnx.Rngs(params=0, dropout=1))


@pytest.fixture(scope="module")
def resnet():
    return jm.ResNet20(10, 1, rngs=nnx.Rngs(0))


# --------------------------------------------------------------------------- #
# Parameter counts against closed forms, and output shapes
# --------------------------------------------------------------------------- #
@settings(max_examples=8)
@given(sizes=st.lists(st.integers(1, 12), min_size=2, max_size=4))
def test_mlp_count_and_shape(sizes):
    build = lambda: jm.MLP(sizes[0], sizes[1:-1], sizes[-1], rngs=nnx.Rngs(0))
    assert jm.count_params(_abstract(build)) == (_mlp_count(sizes), 2 * (len(sizes) - 1))
    assert _out_shape(build, jnp.ones((3, sizes[0])), deterministic=True) == (3, sizes[-1])


@settings(max_examples=6)
@given(v=st.integers(2, 20), e=st.integers(1, 8), h=st.integers(1, 8), layers=st.integers(1, 3))
def test_char_lstm_count_and_shape(v, e, h, layers):
    build = lambda: jm.CharLSTM(v, e, h, layers, rngs=nnx.Rngs(0))
    assert jm.count_params(_abstract(build)) == (_lstm_lm_count(v, e, h, layers), 1 + 3 * layers + 2)
    assert _out_shape(build, jnp.ones((2, 5), jnp.int32)) == (2, 5, v)


@pytest.mark.parametrize("c,k", [(1, 10), (3, 10), (3, 7)])
def test_resnet20_count_and_shape(c, k):
    build = lambda: jm.ResNet20(k, c, rngs=nnx.Rngs(0))
    model = _abstract(build)
    assert jm.count_params(model) == (_resnet20_count(c, k), 59)
    assert _resnet20_count(3, 10) == 269_722 and _resnet20_count(1, 10) == 269_434
    # 19 convolutions + the classifier = the 20 weighted layers of ResNet-20.
    assert len([x for x in jax.tree.leaves(nnx.state(model, nnx.Param)) if x.ndim >= 2]) == 20
    assert _out_shape(build, jnp.ones((2, 28, 28, c))) == (2, k)
    assert _out_shape(build, jnp.ones((2, 9, 9, c))) == (2, k)  # fully convolutional up to the pool
    batchnorm = _abstract(lambda: jm.ResNet20(k, c, norm="batch", rngs=nnx.Rngs(0)))
    assert jm.count_params(batchnorm) == jm.count_params(model)  # running stats are not parameters


def test_linear_regression_is_affine():
    model = jm.LinearRegression(64, rngs=nnx.Rngs(0))
    assert jm.count_params(_abstract(lambda: jm.LinearRegression(8192, rngs=nnx.Rngs(0)))) == (8193, 2)
    x = jax.random.normal(jax.random.key(1), (4, 64))  # eager-SGD Table 1: 8,193 parameters ^
    w, b = np.asarray(model.linear.kernel[...]), np.asarray(model.linear.bias[...])
    np.testing.assert_allclose(model(x), np.asarray(x) @ w[:, 0] + b[0], rtol=1e-5, atol=1e-5)
    with pytest.raises(ValueError, match="features"):
        model(jnp.ones((2, 3)))


# --------------------------------------------------------------------------- #
# The EventGraD CNN's layer arithmetic and dropout
# --------------------------------------------------------------------------- #
def test_eventgrad_cnn_layers():
    model = _abstract(lambda: jm.EventGradCNN(rngs=nnx.Rngs(0)))
    assert model.conv1.kernel.shape == (3, 3, 1, 10) and model.conv2.kernel.shape == (3, 3, 10, 20)
    assert model.fc1.kernel.shape == (500, 50) and model.fc2.kernel.shape == (50, 10)
    assert jm.count_params(model) == (90 + 10 + 1800 + 20 + 25000 + 50 + 500 + 10, 8)

    def trace(x):
        m = jm.EventGradCNN(rngs=nnx.Rngs(0))
        pool = lambda h: nnx.max_pool(h, (2, 2), (2, 2))
        h1 = m.conv1(x)
        h2 = pool(h1)
        h3 = m.conv2(h2)
        return h1, h2, h3, pool(h3)

    shapes = [s.shape for s in jax.eval_shape(trace, jnp.ones((2, 28, 28, 1)))]
    # 28 - 3 + 1 = 26; 26 / 2 = 13; 13 - 3 + 1 = 11; floor(11 / 2) = 5, so fc1 sees 20 * 5 * 5 = 500.
    assert shapes == [(2, 26, 26, 10), (2, 13, 13, 10), (2, 11, 11, 20), (2, 5, 5, 20)]
    with pytest.raises(ValueError, match="28, 28, 1"):
        _out_shape(lambda: jm.EventGradCNN(rngs=nnx.Rngs(0)), jnp.ones((2, 32, 32, 1)))


def test_eventgrad_dropout_semantics(cnn):
    x = jax.random.uniform(jax.random.key(0), (4, 28, 28, 1))

    @nnx.jit
    def run(m, k):
        # Evaluation equals the network with both dropouts removed, written out layer by layer.
        pool = lambda h: nnx.max_pool(h, (2, 2), (2, 2))
        h = jax.nn.relu(pool(m.conv1(x)))
        h = jax.nn.relu(pool(m.conv2(h))).reshape(4, -1)
        reference = m.fc2(jax.nn.relu(m.fc1(h)))
        maps = m.conv_dropout(jnp.ones((3, 11, 11, 20)), deterministic=False, rngs=k)
        return m(x, deterministic=False, rngs=k), m(x, deterministic=True), reference, maps

    tr1, ev, reference, maps = run(cnn, jax.random.key(1))
    np.testing.assert_allclose(ev, reference, rtol=1e-6, atol=1e-6)
    tr2 = run(cnn, jax.random.key(1))[0]
    np.testing.assert_array_equal(tr1, tr2)  # a call-time key makes training mode a pure function
    assert not np.allclose(tr1, ev)
    assert not np.allclose(tr1, run(cnn, jax.random.key(2))[0])
    # Channel dropout (Dropout2d): each feature map is wholly dropped or wholly scaled by 1 / (1 - 0.5).
    per_map = np.asarray(maps).reshape(3, 121, 20)
    assert np.all(per_map.min(axis=1) == per_map.max(axis=1))
    assert set(np.unique(per_map).tolist()) == {0.0, 2.0}


# --------------------------------------------------------------------------- #
# ResNet-20 blocks
# --------------------------------------------------------------------------- #
def test_basic_block_option_a_shortcut():
    block = BasicBlock(16, 32, 2, "group", 8, rngs=nnx.Rngs(0))  # first block of stage 2
    # With the residual branch zeroed (zero conv -> GroupNorm output = its zero bias), the block is
    # relu(shortcut(x)) = relu(zero-pad 8 channels | x[:, ::2, ::2] | 8 channels).
    block.conv1.kernel[...] = jnp.zeros_like(block.conv1.kernel[...])
    block.conv2.kernel[...] = jnp.zeros_like(block.conv2.kernel[...])
    x = jax.random.normal(jax.random.key(0), (2, 14, 14, 16))
    y = np.asarray(nnx.jit(lambda b, x: b(x))(block, x))
    expected = np.zeros((2, 7, 7, 32), np.float32)
    expected[..., 8:24] = np.maximum(np.asarray(x)[:, ::2, ::2, :], 0)
    np.testing.assert_allclose(y, expected, atol=1e-6)


def test_batchnorm_block_tracks_statistics_only_in_training():
    block = BasicBlock(4, 4, 1, "batch", 1, rngs=nnx.Rngs(0))
    x = jax.random.normal(jax.random.key(0), (4, 6, 6, 4)) + 3.0
    before = np.asarray(block.norm1.mean[...])
    run = nnx.jit(lambda b, det: b(x, det), static_argnums=1)
    run(block, True)
    np.testing.assert_array_equal(block.norm1.mean[...], before)  # evaluation leaves stats alone
    run(block, False)
    assert not np.allclose(block.norm1.mean[...], before)
    group = _abstract(lambda: jm.ResNet20(10, 1, rngs=nnx.Rngs(0)))
    assert jax.tree.leaves(nnx.state(group, nnx.BatchStat)) == []  # GroupNorm: parameters only
    with pytest.raises(ValueError, match="norm"):
        jm.ResNet20(norm="layer", rngs=nnx.Rngs(0))
    with pytest.raises(ValueError, match="norm_groups"):
        jm.ResNet20(norm_groups=3, rngs=nnx.Rngs(0))


# --------------------------------------------------------------------------- #
# LSTM against a NumPy reference
# --------------------------------------------------------------------------- #
def _np_lstm(x, w_x, w_h, b):
    sig = lambda z: 1 / (1 + np.exp(-z))
    bsz, t, _ = x.shape
    hid = w_h.shape[0]
    h, c = np.zeros((bsz, hid)), np.zeros((bsz, hid))
    out = []
    for s in range(t):
        z = x[:, s] @ w_x + h @ w_h + b
        i, f, g, o = z[:, :hid], z[:, hid : 2 * hid], z[:, 2 * hid : 3 * hid], z[:, 3 * hid :]
        c = sig(f) * c + sig(i) * np.tanh(g)
        h = sig(o) * np.tanh(c)
        out.append(h)
    return np.stack(out, axis=1)


@pytest.fixture(scope="module")
def lstm():
    return jm.CharLSTM(12, 3, 4, 2, dropout=0.1, rngs=nnx.Rngs(0))


def test_char_lstm_matches_numpy_reference_and_is_causal(lstm):
    b = np.asarray(lstm.lstms[0].b[...])
    assert np.all(b[4:8] == 1.0) and np.all(np.delete(b, range(4, 8)) == 0.0)  # forget-gate bias 1
    tokens = jnp.array([[1, 2, 3, 4, 5], [1, 2, 3, 9, 5]])  # differ at position 3 only
    got = np.asarray(nnx.jit(lambda m, t: m(t, deterministic=True))(lstm, tokens))
    f64 = lambda v: np.asarray(v[...], np.float64)
    h = f64(lstm.embed.embedding)[np.asarray(tokens)]
    for layer in lstm.lstms:
        h = _np_lstm(h, f64(layer.w_x), f64(layer.w_h), f64(layer.b))
    expected = h @ f64(lstm.head.kernel) + f64(lstm.head.bias)
    assert got.shape == (2, 5, 12)
    np.testing.assert_allclose(got, expected, rtol=1e-5, atol=1e-5)
    np.testing.assert_array_equal(got[0, :3], got[1, :3])  # logits before position 3 cannot see it
    assert not np.allclose(got[0, 3:], got[1, 3:])
    with pytest.raises(TypeError, match="integer"):
        lstm(jnp.ones((1, 5)))


# --------------------------------------------------------------------------- #
# A few gradient steps reduce the loss (pure step built on nnx.split / nnx.merge)
# --------------------------------------------------------------------------- #
def _xent(logits, y):
    return optax.softmax_cross_entropy_with_integer_labels(logits.reshape(-1, logits.shape[-1]), y.reshape(-1)).mean()


def _mse(pred, y):
    return jnp.mean((pred - y) ** 2)


CASES = {  # model, input shape, targets, loss, learning rate
    "mlp": (lambda: jm.MLP(64, 16, 10, dropout=0.1, rngs=nnx.Rngs(0)), (8, 8, 8, 1), "int10", _xent, 0.1),
    "eventgrad_cnn": ("cnn", (8, 28, 28, 1), "int10", _xent, 0.05),
    "resnet20": ("resnet", (4, 8, 8, 1), "int10", _xent, 0.05),
    "char_lstm": ("lstm", (4, 6), "int12", _xent, 0.5),
    "linear_regression": (lambda: jm.LinearRegression(16, rngs=nnx.Rngs(0)), (16, 16), "real", _mse, 0.05),
}


@pytest.mark.parametrize("name", sorted(CASES))
def test_sgd_steps_reduce_loss(name, request):
    build, shape, target, loss_fn, lr = CASES[name]
    model = request.getfixturevalue(build) if isinstance(build, str) else build()
    kx, ky, kd = jax.random.split(jax.random.key(42), 3)
    x = jax.random.randint(kx, shape, 0, 12) if name == "char_lstm" else jax.random.uniform(kx, shape)
    y = {
        "int10": lambda: jax.random.randint(ky, shape[:1], 0, 10),
        "int12": lambda: jax.random.randint(ky, shape, 0, 12),
        "real": lambda: jax.random.normal(ky, shape[:1]),
    }[target]()
    graphdef, params, rest = nnx.split(model, nnx.Param, ...)

    def loss(p, key, deterministic):
        return loss_fn(nnx.merge(graphdef, p, rest)(x, deterministic=deterministic, rngs=key), y)

    @jax.jit
    def step(p, key):
        # Training mode (dropout from the explicit key) is a pure function of arrays under jit;
        # the returned loss is the evaluation-mode loss of the parameters before the update.
        g = jax.grad(loss)(p, key, False)
        return jax.tree.map(lambda a, b: a - lr * b, p, g), loss(p, None, True)

    losses = []
    for i in range(6):
        params, value = step(params, jax.random.fold_in(kd, i))
        losses.append(float(value))
    first, last = losses[0], losses[-1]  # before any update, after five
    assert np.isfinite(first) and last < first, losses


def test_make_and_names():
    assert jm.names() == ["char_lstm", "eventgrad_cnn", "linear_regression", "mlp", "resnet20"]
    model = nnx.eval_shape(lambda: jm.make("mlp", in_features=4, hidden=3, num_classes=2, rngs=nnx.Rngs(0)))
    assert isinstance(model, jm.MLP)
    with pytest.raises(ValueError, match="name"):
        jm.make("vgg16", rngs=nnx.Rngs(0))
    with pytest.raises(ValueError, match="dropout"):
        jm.MLP(4, 3, 2, dropout=1.0, rngs=nnx.Rngs(0))
