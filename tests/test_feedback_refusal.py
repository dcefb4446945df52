"""Error feedback refuses unbiased compressors with variance factor ω ≥ 1; contractive() fixes them."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import jaxcomm as jc

EXPANSIVE = {  # name: (kwargs, d) with ω(d) >= 1
    "random_sparsification": (dict(p=0.1), 100),
    "qsgd": (dict(levels=16), 5000),
    "terngrad": ({}, 100),
    "stochastic_rounding": (dict(bits=4), 1000),
}


def _transforms():
    return {
        "error_feedback": lambda c: jc.error_feedback(c),
        "compressed_mean": lambda c: jc.compressed_mean(c, memory=jc.memory.residual(), axis_name="w"),
        "doublesqueeze": lambda c: jc.doublesqueeze(c, axis_name="w"),
        "dgc memory": lambda c: jc.compressed_mean(c, memory=jc.memory.dgc(momentum=0.9), axis_name="w"),
    }


@pytest.mark.parametrize("transform", list(_transforms()))
@pytest.mark.parametrize("name", list(EXPANSIVE))
def test_error_feedback_refuses_an_expansive_unbiased_compressor(name, transform):
    kwargs, d = EXPANSIVE[name]
    c = jc.compressors.make(name, **kwargs)
    assert c.omega(d) >= 1.0
    with pytest.raises(ValueError, match=r"contractive\(") as e:
        _transforms()[transform](c).init({"w": jnp.zeros((d,))})
    assert name in str(e.value) and f"{d} entries" in str(e.value)


@pytest.mark.parametrize("name", list(EXPANSIVE))
def test_no_memory_and_contractive_are_accepted(name):
    kwargs, d = EXPANSIVE[name]
    c = jc.compressors.make(name, **kwargs)
    jc.compressed_mean(c, axis_name="w").init(jnp.zeros((d,)))  # no feedback: fine
    for make in _transforms().values():
        make(jc.compressors.contractive(c)).init(jnp.zeros((d,)))


def test_small_tensors_where_omega_is_below_one_are_accepted():
    # QSGD's ω = min(d/s², √d/s) < 1 for d < s² = 256 at s = 16.
    c = jc.compressors.qsgd(levels=16)
    assert c.omega(200) < 1.0
    jc.error_feedback(c).init(jnp.zeros((200,)))


@pytest.mark.parametrize("p", [0.05, 0.1, 0.3])
def test_contractive_random_sparsification_keeps_the_memory_bounded(p):
    # EF with a δ-contraction: ‖e_t‖ ≤ sqrt(4(1 − δ)/δ²) max_t ‖g_t‖ (Stich et al. 2018, Lemma 3.2's
    # recursion with E‖e'‖² ≤ (1 − δ)‖e + g‖²), checked over 400 steps of a drifting gradient;
    # the unscaled compressor grows by ω = 1/p − 1 per step instead (refused above).
    c = jc.compressors.contractive(jc.compressors.random_sparsification(p=p))
    d = 2000
    delta = c.delta(d)
    tx = jc.error_feedback(c)
    state = tx.init(jnp.zeros((d,)))
    update = jax.jit(tx.update)
    bound = np.sqrt(4 * (1 - delta) / delta**2)
    worst, gmax, total_g, total_out = 0.0, 0.0, np.zeros(d), np.zeros(d)
    for t in range(400):
        g = jax.random.normal(jax.random.PRNGKey(t), (d,)) + jnp.sin(t / 50.0)
        out, state = update(g, state)
        gmax = max(gmax, float(jnp.linalg.norm(g)))
        worst = max(worst, float(jnp.linalg.norm(state.memory)))
        total_g += np.asarray(g, np.float64)
        total_out += np.asarray(out, np.float64)
    assert worst <= bound * gmax, (worst, bound * gmax)
    # and nothing is lost: Σ out + e = Σ g
    np.testing.assert_allclose(total_out + np.asarray(state.memory), total_g, atol=1e-3 * np.abs(total_g).max())


NO_CONTRACTION = ["signsgd", "signum"]


@pytest.mark.parametrize("transform", list(_transforms()))
@pytest.mark.parametrize("name", NO_CONTRACTION)
def test_error_feedback_refuses_a_compressor_with_no_contraction(name, transform):
    c = jc.compressors.make(name)
    assert c.no_contraction and c.delta(100) is None
    with pytest.raises(ValueError, match=r"declares none: .*efsignsgd\(\).*needs_contraction=False") as e:
        _transforms()[transform](c).init({"w": jnp.zeros((100,))})
    assert name in str(e.value)


@pytest.mark.parametrize("name", NO_CONTRACTION)
def test_a_memory_that_does_not_need_a_contraction_accepts_it(name):
    # GRACE's study measures error feedback on sign methods: residual(needs_contraction=False) runs it,
    # and no memory never needed a contraction.
    c = jc.compressors.make(name)
    mem = jc.memory.residual(needs_contraction=False)
    assert not mem.needs_contraction and "needs_contraction=False" in repr(mem)
    jc.error_feedback(c, mem).init(jnp.zeros((100,)))
    jc.compressed_mean(c, memory=jc.memory.none(), axis_name="w").init(jnp.zeros((100,)))
    with pytest.raises(TypeError, match=r"needs_contraction must be a bool \(True or False\)"):
        jc.memory.residual(needs_contraction=1)


@pytest.mark.parametrize("name, kwargs", [("scaled_sign", {}), ("dgc", dict(ratio=0.3)), ("powersgd", {})])
def test_non_expansive_and_data_dependent_bounds_are_accepted(name, kwargs):
    # DoubleSqueeze's scaled sign (δ(x), negative for a sparse x), DGC and PowerSGD (δ = 0) are used
    # with error feedback by their papers: declared bounds, not "no contraction", so no refusal.
    c = jc.compressors.make(name, **kwargs)
    assert not c.no_contraction
    jc.error_feedback(c).init({"w": jnp.zeros((10, 10))})
