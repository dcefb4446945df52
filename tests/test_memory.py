"""Error-feedback memories (GRACE Eq. 4, DGC, EF-SignSGD) and jaxcomm.error_feedback (single process)."""

from __future__ import annotations

from typing import Any, ClassVar

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

import jaxcomm as jc
from jaxcomm import memory as mem
from jaxcomm.compressors import Compressor
from jaxcomm.compressors.payloads import Payload, payload_dataclass, static_field
from jaxcomm.transforms import error_feedback


# --------------------------------------------------------------------------- #
# A tiny top-k test compressor (values + int32 indices) and its NumPy twin
# --------------------------------------------------------------------------- #
@payload_dataclass
class TopkPayload(Payload):
    values: jax.Array
    indices: jax.Array
    shape: tuple = static_field()
    dtype: Any = static_field()
    summable: ClassVar[tuple[str, ...]] = ()


def topk(k: int) -> Compressor:
    def compress(x, key, state):
        del key
        _, idx = jax.lax.top_k(jnp.abs(x.ravel()), k)
        return TopkPayload(values=x.ravel()[idx], indices=idx.astype(jnp.int32), shape=x.shape, dtype=x.dtype), state

    def decompress(p):
        d = int(np.prod(p.shape))
        return jnp.zeros((d,), p.dtype).at[p.indices].set(p.values).reshape(p.shape)

    return Compressor(
        name="toy_topk", compress_fn=compress, decompress_fn=decompress, unbiased=False, strategy="allgather"
    )


def topk_np(x, k):
    flat = x.ravel()
    keep = np.argsort(-np.abs(flat), kind="stable")[:k]
    out = np.zeros_like(flat)
    out[keep] = flat[keep]
    return out.reshape(x.shape), keep


# --------------------------------------------------------------------------- #
# Eq. 4 and the simple memories
# --------------------------------------------------------------------------- #
@settings(max_examples=10)
@given(beta=st.floats(0.05, 2.0), gamma=st.floats(0.05, 2.0), seed=st.integers(0, 2**16))
def test_residual_is_grace_eq4(beta, gamma, seed):
    rng = np.random.default_rng(seed)
    m0, g, g_hat = (rng.normal(size=(4, 3)).astype(np.float32) for _ in range(3))
    memory = mem.residual(beta, gamma)
    phi = memory.compensate(jnp.asarray(m0), jnp.asarray(g))
    np.testing.assert_allclose(np.asarray(phi), beta * m0 + gamma * g, rtol=1e-6, atol=1e-6)
    m1 = memory.update(jnp.asarray(m0), jnp.asarray(g), phi, jnp.asarray(g_hat))
    np.testing.assert_allclose(np.asarray(m1), beta * m0 + gamma * g - g_hat, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("memory", [mem.residual(), mem.residual(0.5, 2.0), mem.efsignsgd(0.1)], ids=repr)
@pytest.mark.parametrize("dtype", [jnp.float32, jnp.bfloat16])
def test_from_error_is_update_with_the_error(memory, dtype):
    # from_error(m, phi - g_hat) must be update(m, g, phi, g_hat): the transforms use either.
    rng = np.random.default_rng(3)
    m0, g, g_hat = (jnp.asarray(rng.normal(size=(5, 7)), dtype) for _ in range(3))
    phi = memory.compensate(m0, g)
    want = memory.update(m0, g, phi, g_hat)
    got = memory.from_error(m0, phi - g_hat.astype(phi.dtype))
    assert got.dtype == want.dtype == m0.dtype
    np.testing.assert_array_equal(np.asarray(got, np.float32), np.asarray(want, np.float32))


def test_memories_without_from_error():
    # dgc's state is not the error (it masks momentum); none keeps nothing: both use update only.
    assert mem.dgc().from_error is None and mem.none().from_error is None


def test_none_memory_and_init_states():
    x = jnp.ones((2, 3), jnp.bfloat16)
    none = mem.none()
    assert none.init(x) == ()
    assert none.compensate((), x) is x
    assert none.update((), x, x, 0 * x) == ()
    z = mem.residual().init(x)
    assert z.shape == x.shape and z.dtype == jnp.bfloat16 and not bool(jnp.any(z != 0))
    s = mem.dgc(0.5).init(x)
    assert isinstance(s, mem.DGCMemoryState) and s.momentum.shape == (2, 3) and s.accumulation.dtype == jnp.bfloat16


def test_registry_and_repr():
    assert mem.names() == ["dgc", "efsignsgd", "none", "residual"]
    m = mem.make("residual", beta=0.5)
    assert m.params == {"beta": 0.5, "gamma": 1.0} and repr(m) == "jaxcomm.memory.residual(beta=0.5, gamma=1.0)"
    with pytest.raises(ValueError, match="valid names"):
        mem.make("momentum")


@pytest.mark.parametrize(
    "factory,kwargs,match",
    [
        (mem.residual, dict(beta=0.0), "beta"),
        (mem.residual, dict(gamma=-1.0), "gamma"),
        (mem.residual, dict(beta=float("nan")), "beta"),
        (mem.dgc, dict(momentum=1.0), "momentum"),
        (mem.dgc, dict(momentum=-0.1), "momentum"),
        (mem.efsignsgd, dict(learning_rate=0.0), "learning_rate"),
    ],
)
def test_bad_hyper_parameters(factory, kwargs, match):
    with pytest.raises(ValueError, match=match):
        factory(**kwargs)
    with pytest.raises(TypeError):
        mem.residual(beta="1")


# --------------------------------------------------------------------------- #
# DGC momentum correction + factor masking vs NumPy (Lin et al. 2018, Alg. 1)
# --------------------------------------------------------------------------- #
def test_dgc_memory_matches_numpy():
    mu, k, steps, lr = 0.9, 4, 6, 0.1
    rng = np.random.default_rng(0)
    grads = rng.normal(size=(steps, 5, 4)).astype(np.float32)
    tx = optax.chain(error_feedback(topk(k), mem.dgc(mu)), optax.sgd(lr))
    params = {"w": jnp.zeros((5, 4))}

    @jax.jit
    def run(params):
        def body(carry, g):
            p, s = carry
            u, s = tx.update({"w": g}, s, p)
            return (optax.apply_updates(p, u), s), u["w"]

        (p, s), us = jax.lax.scan(body, (params, tx.init(params)), jnp.asarray(grads))
        return p, s, us

    p, s, us = run(params)
    u_ref, v_ref, x_ref = np.zeros((5, 4)), np.zeros((5, 4)), np.zeros((5, 4))
    for t in range(steps):
        u_ref = mu * u_ref + grads[t]  # momentum correction
        v_ref = v_ref + u_ref  # accumulate velocity
        sent, keep = topk_np(v_ref, k)
        mask = np.zeros(20, bool)
        mask[keep] = True
        mask = mask.reshape(5, 4)
        u_ref[mask] = 0.0  # factor masking
        v_ref[mask] = 0.0
        x_ref = x_ref - lr * sent
        np.testing.assert_allclose(np.asarray(us[t]), -lr * sent, rtol=1e-5, atol=1e-6, err_msg=f"step {t}")
    np.testing.assert_allclose(np.asarray(p["w"]), x_ref, rtol=1e-5, atol=1e-6)
    dgc_state = s[0].memory["w"]
    np.testing.assert_allclose(np.asarray(dgc_state.momentum), u_ref, rtol=1e-5, atol=1e-6)
    np.testing.assert_allclose(np.asarray(dgc_state.accumulation), v_ref, rtol=1e-5, atol=1e-6)


# --------------------------------------------------------------------------- #
# EF-SignSGD (Karimireddy et al. 2019, Algorithm 1) vs NumPy
# --------------------------------------------------------------------------- #
def test_efsignsgd_memory_reproduces_ef_signsgd():
    """chain(error_feedback(efsignsgd(), efsignsgd(γ)), sgd(γ)) runs x ← x − Δ, Δ = (‖p‖₁/d) sign(p), p = γg + e."""
    lr, steps = 0.05, 8
    rng = np.random.default_rng(1)
    a = rng.uniform(0.5, 2.0, size=(3, 7)).astype(np.float32)
    b = rng.normal(size=(3, 7)).astype(np.float32)
    x0 = rng.normal(size=(3, 7)).astype(np.float32)
    tx = optax.chain(error_feedback(jc.compressors.efsignsgd(), mem.efsignsgd(lr)), optax.sgd(lr))

    @jax.jit
    def run(x):
        def body(carry, _):
            x, s = carry
            u, s = tx.update({"w": a * x["w"] - b}, s, x)  # gradient of Σ a x²/2 − b x
            return (optax.apply_updates(x, u), s), None

        (x, s), _ = jax.lax.scan(body, (x, tx.init(x)), None, length=steps)
        return x, s

    x, s = run({"w": jnp.asarray(x0)})
    xr, e = x0.astype(np.float64), np.zeros((3, 7))
    for _ in range(steps):
        p = lr * (a * xr - b) + e
        delta = np.abs(p).mean() * np.where(p < 0, -1.0, 1.0)
        xr, e = xr - delta, p - delta
    np.testing.assert_allclose(np.asarray(x["w"]), xr, rtol=1e-5, atol=1e-5)
    np.testing.assert_allclose(np.asarray(s[0].memory["w"]), e, rtol=1e-4, atol=1e-5)


# --------------------------------------------------------------------------- #
# error_feedback: conservation, key schedule, tree handling
# --------------------------------------------------------------------------- #
@jax.jit
def _ef_run(scale, seed):
    """50 steps of error_feedback on a two-leaf tree; returns Σ outputs, final memory, Σ gradients."""
    tx = error_feedback(jc.compressors.scaled_sign(), mem.residual())
    tx2 = error_feedback(topk(5), mem.residual())
    shapes = {"a": (3, 11), "b": (17,)}
    params = {k: jnp.zeros(s) for k, s in shapes.items()}

    def body(carry, t):
        s1, s2, sent1, sent2, total = carry
        key = jax.random.fold_in(jax.random.PRNGKey(seed), t)
        g = {k: jax.random.normal(jax.random.fold_in(key, i), s) * scale for i, (k, s) in enumerate(shapes.items())}
        u1, s1 = tx.update(g, s1)
        u2, s2 = tx2.update(g, s2)
        add = lambda x, y: jax.tree.map(jnp.add, x, y)
        return (s1, s2, add(sent1, u1), add(sent2, u2), add(total, g)), None

    z = jax.tree.map(jnp.zeros_like, params)
    (s1, s2, sent1, sent2, total), _ = jax.lax.scan(body, (tx.init(params), tx2.init(params), z, z, z), jnp.arange(50))
    return sent1, s1.memory, sent2, s2.memory, total


@settings(max_examples=4)
@given(seed=st.integers(0, 2**31 - 1), scale=st.floats(1e-3, 1e3))
def test_error_feedback_conserves_gradient_mass(seed, scale):
    """Σ_t ĝ_t + m_50 == Σ_t g_t per entry (β = γ = 1), for scaled sign and top-k."""
    sent1, m1, sent2, m2, total = _ef_run(jnp.float32(scale), jnp.uint32(seed))
    for sent, m in ((sent1, m1), (sent2, m2)):
        for k in total:
            lhs = np.asarray(sent[k], np.float64) + np.asarray(m[k], np.float64)
            # Per step the float32 identity m' = φ − ĝ rounds once at |φ| ≲ 10·scale
            # (|m| stays within a few gradients), and the running sums round once
            # each: 50 steps · 3 roundings · 10·scale · 2⁻²⁴ < 1e-4·scale.
            np.testing.assert_allclose(lhs, np.asarray(total[k], np.float64), rtol=0, atol=1e-4 * scale)
    assert max(float(jnp.abs(v).max()) for v in jax.tree.leaves(m2)) > 0  # lossy: memory holds something


def test_error_feedback_without_memory_is_the_compressor_itself():
    """error_feedback(c, none()) uses the compressor's own key schedule: same output as c.update."""
    c = jc.compressors.qsgd(levels=4)
    params = {"a": jnp.linspace(-1.0, 1.0, 12).reshape(3, 4), "b": jnp.linspace(0.5, -2.0, 5)}
    ef = error_feedback(c, mem.none())
    u1, s1 = jax.jit(ef.update)(params, ef.init(params))
    u2, s2 = jax.jit(c.update)(params, c.init(params))
    for k in params:
        np.testing.assert_array_equal(np.asarray(u1[k]), np.asarray(u2[k]))
    np.testing.assert_array_equal(np.asarray(s1.key), np.asarray(s2.key))
    assert s1.memory == {"a": (), "b": ()}
    # wire bits: qsgd's exact payload bits, per leaf
    exact = [
        jc.wire_bits(jax.eval_shape(lambda x: c.compress(x, jax.random.PRNGKey(0))[0], params[k]))
        for k in sorted(params)
    ]
    np.testing.assert_array_equal(np.asarray(s1.wire_bits), exact)


def test_error_feedback_bad_input():
    with pytest.raises(TypeError, match="compressor"):
        error_feedback(optax.sgd(0.1))
    with pytest.raises(TypeError, match="memory"):
        error_feedback(jc.compressors.none(), memory=mem.residual)
    tx = error_feedback(jc.compressors.none())
    state = tx.init({"a": jnp.ones(3), "b": jnp.ones(2)})
    with pytest.raises(ValueError, match="same tree"):
        tx.update({"a": jnp.ones(3)}, state)
    with pytest.raises(ValueError, match="shape"):
        tx.update({"a": jnp.ones(4), "b": jnp.ones(2)}, state)
    with pytest.raises(TypeError, match="floating"):
        tx.init({"a": jnp.ones(3, jnp.int32)})
