"""optax.inject_hyperparams over jaxcomm's compressor factories.

Traceable hyper-parameters (used only in array arithmetic) may be injected and changed between jitted
steps; the change must take effect exactly as a NumPy reference says. Structural ones (they fix a
shape, a code width, a number of levels) raise a TypeError naming them and ``static_args``.
"""

import inspect

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from compressor_examples import EXAMPLE_KWARGS
from hypothesis import given, settings
from hypothesis import strategies as st

import jaxcomm as jc

# (compressor, hyper-parameter) pairs that may be traced.
TRACEABLE = {("signum", "momentum"), ("onebit", "threshold"), ("threshold", "v")}


BUILTIN = sorted(n for n in jc.compressors.names() if n in jc.compressors.__all__)


def _numeric_params(name, kwargs=None):
    """The hyper-parameters optax.inject_hyperparams would inject as arrays: numbers, not bools."""
    factory = getattr(jc.compressors, name)
    kwargs = EXAMPLE_KWARGS.get(name, {}) if kwargs is None else kwargs
    out = {}
    for p in inspect.signature(factory).parameters.values():
        value = kwargs.get(p.name, p.default)
        if isinstance(value, (int, float)) and not isinstance(value, bool):
            out[p.name] = value
    return out


STRUCTURAL = [
    (name, param, EXAMPLE_KWARGS.get(name, {}))
    for name in BUILTIN
    for param in _numeric_params(name)
    if param != "seed" and (name, param) not in TRACEABLE
] + [("powersgd", "rank", dict(rank=2))]  # an alias whose default is None


def test_structural_list_is_not_empty():
    # The parametrization below must cover the shape-fixing parameters the issue names.
    pairs = {(name, param) for name, param, _ in STRUCTURAL}
    for pair in [("topk", "ratio"), ("qsgd", "levels"), ("powersgd", "rank"), ("threshold", "max_ratio")]:
        assert pair in pairs


@pytest.mark.parametrize(("name", "param", "base"), STRUCTURAL, ids=[f"{n}-{p}" for n, p, _ in STRUCTURAL])
def test_structural_hyperparameter_names_itself(name, param, base):
    factory = getattr(jc.compressors, name)
    kwargs = {**base}
    value = _numeric_params(name, base)[param]
    kwargs[param] = value
    others = [p for p in _numeric_params(name, base) if p != param]
    # Injected: init hands the factory a JAX array.
    tx = optax.inject_hyperparams(factory, static_args=others)(**kwargs)
    with pytest.raises(TypeError, match=rf"{param} is a static hyper-parameter \(.+\).*static_args=\('{param}',\)"):
        tx.init({"w": jnp.zeros((4, 4))})

    # Traced: the factory called inside jax.jit with the parameter as an argument.
    def roundtrip(v, x):
        c = factory(**{**kwargs, param: v})
        return c.roundtrip(x, jax.random.PRNGKey(0))[0]

    with pytest.raises(TypeError, match=rf"{param} is a static hyper-parameter"):
        jax.jit(roundtrip)(value, jnp.ones((4, 4)))
    # As a Python value it builds.
    assert factory(**kwargs).name == name


def _run(tx, grads, schedule, name):
    """Jitted steps of ``tx``; before step t, ``state.hyperparams[name] = schedule[t]``."""
    state = tx.init(grads[0])
    update = jax.jit(tx.update)
    outs = []
    for g, value in zip(grads, schedule):
        state.hyperparams[name] = jnp.float32(value)
        u, state = update(g, state)
        outs.append(np.asarray(u))
    return outs


def _signum_reference(grads, betas):
    m = np.zeros_like(grads[0], np.float64)
    outs = []
    for g, b in zip(grads, betas):
        m = b * m + (1.0 - b) * np.asarray(g, np.float64)
        outs.append(np.where(m < 0, -1.0, 1.0))
    return outs


@settings(max_examples=10, deadline=None)
@given(
    betas=st.lists(st.sampled_from([0.0, 0.3, 0.5, 0.9, 0.99]), min_size=4, max_size=4),
    seed=st.integers(0, 2**16),
)
def test_signum_momentum_changes_between_steps(betas, seed):
    grads = list(np.random.default_rng(seed).normal(size=(4, 64)).astype(np.float32))
    tx = optax.inject_hyperparams(jc.compressors.signum)(momentum=betas[0])
    got = _run(tx, grads, betas, "momentum")
    want = _signum_reference(grads, betas)
    # Signs agree except where the float64 momentum is within float32 rounding of zero.
    m = np.zeros(64)
    for g, b, o, w in zip(grads, betas, got, want):
        m = b * m + (1 - b) * g
        clear = np.abs(m) > 1e-5 * (np.abs(g).max() + np.abs(m).max())
        np.testing.assert_array_equal(o[clear], w[clear])


def test_signum_momentum_change_takes_effect():
    # Power: with momentum kept at 0.9 the second step's signs differ from those with 0.0.
    g1 = np.array([1.0, -2.0, 3.0, -4.0], np.float32)
    g2 = -0.5 * g1
    tx = optax.inject_hyperparams(jc.compressors.signum)(momentum=0.9)
    kept = _run(tx, [g1, g2], [0.9, 0.9], "momentum")
    changed = _run(tx, [g1, g2], [0.9, 0.0], "momentum")
    np.testing.assert_array_equal(kept[1], np.sign(g1))  # m = 0.09 g1 - 0.05 g1
    np.testing.assert_array_equal(changed[1], np.sign(g2))  # m = g2
    for got, want in zip(changed, _signum_reference([g1, g2], [0.9, 0.0])):
        np.testing.assert_array_equal(got, want)


def _onebit_reference(x, tau):
    x = np.asarray(x, np.float64)
    high = x >= tau
    mu_high = x[high].mean() if high.any() else 0.0
    mu_low = x[~high].mean() if (~high).any() else 0.0
    return np.where(high, mu_high, mu_low), high


@settings(max_examples=10, deadline=None)
@given(taus=st.lists(st.floats(-1.5, 1.5, width=32), min_size=3, max_size=3), seed=st.integers(0, 2**16))
def test_onebit_threshold_changes_between_steps(taus, seed):
    grads = list(np.random.default_rng(seed).normal(size=(3, 50)).astype(np.float32))
    tx = optax.inject_hyperparams(jc.compressors.onebit)(threshold=taus[0])
    got = _run(tx, grads, taus, "threshold")
    for g, tau, o in zip(grads, taus, got):
        want, high = _onebit_reference(g, np.float32(tau))
        # The split is exact; the two means are float32 sums (relative error ~ d eps).
        np.testing.assert_allclose(o, want, rtol=1e-5, atol=1e-6)
        if high.any() and (~high).any():  # mu_high >= tau > mu_low: the split is read off exactly
            np.testing.assert_array_equal(o > (want[high][0] + want[~high][0]) / 2, high)


def test_threshold_v_changes_between_steps():
    rng = np.random.default_rng(0)
    grads = list(rng.normal(size=(4, 200)).astype(np.float32))
    vs = [0.5, 2.0, 0.0, 1.0]
    tx = optax.inject_hyperparams(jc.compressors.threshold, static_args=("max_ratio",))(v=vs[0])
    got = _run(tx, grads, vs, "v")
    for g, v, o in zip(grads, vs, got):
        np.testing.assert_array_equal(o, np.where(np.abs(g) >= np.float32(v), g, 0.0))
    # Power: the four thresholds keep different numbers of entries.
    assert len({int(np.count_nonzero(o)) for o in got}) == 4


def test_error_feedback_around_an_injected_compressor():
    # The transforms take a compressor; a factory that builds both injects the compressor's
    # hyper-parameters. Reference: EF-SGD with residual memory around SIGNUM.
    def ef_signum(momentum):
        # signum declares no contraction: error feedback around it is asked for explicitly
        memory = jc.memory.residual(needs_contraction=False)
        return jc.error_feedback(jc.compressors.signum(momentum=momentum), memory=memory)

    rng = np.random.default_rng(1)
    grads = list(rng.normal(size=(3, 32)).astype(np.float32))
    betas = [0.9, 0.2, 0.6]
    got = _run(optax.inject_hyperparams(ef_signum)(momentum=betas[0]), grads, betas, "momentum")
    e = np.zeros(32)
    m = np.zeros(32)
    for g, b, o in zip(grads, betas, got):
        phi = e + g
        m = b * m + (1 - b) * phi
        out = np.where(m < 0, -1.0, 1.0)
        e = phi - out
        np.testing.assert_array_equal(o, out)


def test_injected_seed_is_the_init_key():
    # The seed is read once, at init; injected it gives the same key and draws as a Python seed.
    x = {"w": jnp.arange(20.0)}
    tx = optax.inject_hyperparams(jc.compressors.randomk, static_args=("ratio",))(ratio=0.25, seed=3)
    plain = jc.compressors.randomk(ratio=0.25, seed=3)
    state, ref_state = tx.init(x), plain.init(x)
    np.testing.assert_array_equal(state.inner_state.key, ref_state.key)
    for _ in range(2):
        u, state = jax.jit(tx.update)(x, state)
        ref, ref_state = plain.update(x, ref_state)
        np.testing.assert_array_equal(u["w"], ref["w"])


@pytest.mark.parametrize(
    ("factory", "kwargs", "match"),
    [
        (jc.compressors.signum, dict(momentum=1.5), "momentum must be in"),
        (jc.compressors.threshold, dict(v=-1.0, max_ratio=1.0), "v must be >= 0"),
        (jc.compressors.onebit, dict(threshold=float("nan")), "threshold must be finite"),
    ],
)
def test_injected_values_are_checked_when_concrete(factory, kwargs, match):
    static = ["max_ratio"] if "max_ratio" in kwargs else []
    tx = optax.inject_hyperparams(factory, static_args=static)(**kwargs)
    with pytest.raises(ValueError, match=match):
        tx.init({"w": jnp.zeros(3)})


def test_traced_vector_or_float_seed_is_rejected():
    with pytest.raises(TypeError, match="momentum must be a real scalar"):
        jax.jit(lambda b: jc.compressors.signum(momentum=b).roundtrip(jnp.ones(3))[0])(jnp.ones(2))
    with pytest.raises(TypeError, match="seed must be an integer scalar"):
        jax.jit(lambda s: jc.compressors.signum(seed=s).roundtrip(jnp.ones(3))[0])(jnp.float32(1))


def test_changing_a_hyperparameter_does_not_retrace():
    tx = optax.inject_hyperparams(jc.compressors.onebit)(threshold=0.0)
    traces = []

    def update(g, state):
        traces.append(1)
        return tx.update(g, state)

    step = jax.jit(update)
    g = {"w": jnp.arange(-3.0, 3.0)}
    state = tx.init(g)
    for tau in [0.0, 1.0, -2.0]:
        state.hyperparams["threshold"] = jnp.float32(tau)
        out, state = step(g, state)
        want, _ = _onebit_reference(np.arange(-3.0, 3.0), tau)
        np.testing.assert_allclose(out["w"], want, rtol=1e-6)
    assert len(traces) == 1


def test_bfloat16_gradients_under_strict_promotion():
    # inject_hyperparams casts float hyper-parameters to the parameters' dtype; the compressor
    # computes in float32 either way (no bf16 x f32 promotion error, the reference in float32).
    g = np.array([1.0, -2.0, 3.0, -4.0], np.float32)
    tx = optax.inject_hyperparams(jc.compressors.signum)(momentum=0.5)
    with jax.numpy_dtype_promotion("strict"):
        got = _run(tx, [jnp.asarray(g, jnp.bfloat16), jnp.asarray(-0.5 * g, jnp.bfloat16)], [0.5, 0.5], "momentum")
    for o, w in zip(got, _signum_reference([g, -0.5 * g], [0.5, 0.5])):
        np.testing.assert_array_equal(o.astype(np.float32), w)


def test_compressed_mean_in_shard_map_with_injected_threshold():
    # Four workers on a mesh; each worker's state carries its own v (sharded with the rest).
    n = 4
    mesh = jax.make_mesh((n,), ("data",), devices=jax.devices()[:n])

    def thresholded_mean(v):
        return jc.compressed_mean(jc.compressors.threshold(v=v), "data", memory=jc.memory.none())

    tx = optax.inject_hyperparams(thresholded_mean)(v=0.5)
    grads = np.random.default_rng(2).normal(size=(n, 16)).astype(np.float32)
    state = jc.algorithms.per_worker(tx.init, mesh=mesh)(jnp.asarray(grads))
    step = jax.jit(jc.algorithms.per_worker(lambda g, s: tx.update(g, s), mesh=mesh))
    for v in [0.5, 1.5]:
        state.hyperparams["v"] = jnp.full((n,), v, jnp.float32)
        out, state = step(jnp.asarray(grads), state)
        want = np.where(np.abs(grads) >= np.float32(v), grads, 0.0).mean(0)
        for worker in range(n):
            np.testing.assert_allclose(np.asarray(out)[worker], want, rtol=1e-6, atol=1e-7)
