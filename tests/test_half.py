"""jaxcomm.compressors.half: any compressor's floating payload arrays sent in 16 bits.

Against NumPy (float16 / ml_dtypes bfloat16 round to nearest even): the payload a top-k sends, its
decoding, its wire bits and the error-feedback memory that keeps the rounding; stochastic rounding's
two neighbours and mean; PowerSGD's two messages in 16 bits against a NumPy transcription of its
rounds; the declared bounds in closed form; and the contract battery on wrapped compressors.
"""

import jax
import jax.numpy as jnp
import ml_dtypes
import numpy as np
import pytest

import jaxcomm as jc
from jaxcomm import testing
from jaxcomm.comm import MeshAxis
from jaxcomm.compressors._half import round_stochastic
from jaxcomm.transforms._collectives import run_rounds

NP_WIRE = {"float16": np.float16, "bfloat16": ml_dtypes.bfloat16}
U = {"float16": 2.0**-11, "bfloat16": 2.0**-8}
X = np.random.default_rng(0).normal(size=20).astype(np.float32)  # d = 20: k = 6 of top-k(0.3), uint8 indices


def _np_round(a, dtype):
    return np.asarray(a, np.float32).astype(NP_WIRE[dtype]).astype(np.float32)


@pytest.mark.parametrize("dtype", ["float16", "bfloat16"])
def test_topk_values_cross_in_16_bits(dtype):
    inner = jc.compressors.topk(ratio=0.3)
    c = jc.compressors.half(inner, dtype)
    p, _ = c.compress(jnp.asarray(X))
    idx = np.argsort(-np.abs(X))[:6]
    assert p.values.dtype == jnp.dtype(dtype) and p.indices.dtype == jnp.uint8
    np.testing.assert_array_equal(np.sort(np.asarray(p.indices)), np.sort(idx))
    np.testing.assert_array_equal(np.asarray(p.values, np.float32), _np_round(X[np.asarray(p.indices)], dtype))
    want = np.zeros(20, np.float32)
    want[idx] = _np_round(X[idx], dtype)
    y = c.decompress(p)
    assert y.dtype == jnp.float32
    np.testing.assert_array_equal(np.asarray(y), want)
    # 16-bit values and 8-bit indices; the wrapped format: 32-bit values
    assert int(jc.wire_bits(p)) == 6 * (16 + 8) == jc.compressors.payloads.array_bits(p)
    assert int(jc.wire_bits(inner.compress(jnp.asarray(X))[0])) == 6 * (32 + 8)


def test_counted_rows_and_inferred_counts():
    # threshold (count-prefixed rows): the valid rows at 16 + 8 bits and the int32 count, under jit too
    c = jc.compressors.half(jc.compressors.threshold(v=0.5), "bfloat16")
    p = jax.jit(lambda x: c.compress(x)[0])(jnp.asarray(X))
    kept = int(np.sum(np.abs(X) > 0.5))
    assert int(p.count) == kept and int(jc.wire_bits(p)) == kept * (16 + 8) + 32
    assert int(jax.jit(jc.wire_bits)(p)) == kept * (16 + 8) + 32


def test_error_feedback_memory_keeps_the_rounding():
    c = jc.compressors.half(jc.compressors.topk(ratio=0.3))
    tx = jc.error_feedback(c)
    out, state = jax.jit(tx.update)(jnp.asarray(X), tx.init(jnp.asarray(X)))
    idx = np.argsort(-np.abs(X))[:6]
    sent = np.zeros(20, np.float32)
    sent[idx] = _np_round(X[idx], "float16")
    np.testing.assert_array_equal(np.asarray(out), sent)
    np.testing.assert_array_equal(np.asarray(state.memory), X - sent)
    assert np.any(np.asarray(state.memory)[idx] != 0)  # the 16-bit rounding of the sent entries is kept


@pytest.mark.parametrize("dtype", ["float16", "bfloat16"])
def test_stochastic_rounding_picks_a_neighbour_with_mean_the_value(dtype):
    v = np.array([1.0 / 3, -2.7182817, 1234.567, 3.0e-3, 0.0], np.float32)
    wire = NP_WIRE[dtype]
    lo = np.where(v.astype(wire).astype(np.float32) > v, np.nextafter(v.astype(wire), wire(-np.inf)), v.astype(wire))
    hi = np.where(v.astype(wire).astype(np.float32) < v, np.nextafter(v.astype(wire), wire(np.inf)), v.astype(wire))
    keys = jax.random.split(jax.random.PRNGKey(0), 4000)
    draws = np.asarray(
        jax.jit(jax.vmap(lambda k: round_stochastic(jnp.asarray(v), jnp.dtype(dtype), k)))(keys), np.float32
    )
    lo32, hi32 = lo.astype(np.float32), hi.astype(np.float32)
    assert np.all((draws == lo32) | (draws == hi32))
    p = np.where(hi32 > lo32, (v - lo32) / np.where(hi32 > lo32, hi32 - lo32, 1), 0)
    se = (hi32 - lo32) * np.sqrt(p * (1 - p) / len(keys))
    assert np.all(np.abs(draws.mean(0) - v) <= 5 * se + 1e-7 * np.abs(v))


def test_powersgd_rounds_send_16_bit_messages():
    # Two workers, rank 2: each round's message crosses in float16 and the sum comes back in float32.
    c = jc.compressors.half(jc.compressors.powersgd(matrix_approximation_rank=2))
    xs = jax.random.normal(jax.random.PRNGKey(5), (2, 24, 18))
    key = jax.random.PRNGKey(1)
    state0 = c.init_state(xs[0])
    states = jax.tree.map(lambda a: jnp.broadcast_to(a, (2,) + a.shape), state0)

    def worker(x, state):
        payload, _, sent = run_rounds(c, x, key, state, MeshAxis("w"))
        return payload, sent

    payloads, sent = jax.jit(jax.vmap(worker, axis_name="w"))(xs, states)
    assert [m.dtype for m in sent] == [jnp.float16, jnp.float16]
    assert sum(m[0].size * 16 for m in sent) == 16 * (24 + 18) * 2
    # NumPy: P = orth(Σ_i f16(M_i Q)) (two f16 terms: one rounding of their sum), Q = Σ_i f16(M_iᵀ P)
    q0 = np.asarray(jax.random.normal(key, (18, 2), jnp.float32), np.float64)  # the first step's Q
    mats = [np.asarray(x, np.float64) for x in xs]
    f16 = lambda a: np.asarray(a, np.float32).astype(np.float16).astype(np.float64)
    p = f16(sum(f16(m @ q0) for m in mats))
    for i in range(2):  # Gram-Schmidt as PowerSGD's orthogonalize
        col = p[:, i] - p[:, :i] @ (p[:, :i].T @ p[:, i])
        col = col - p[:, :i] @ (p[:, :i].T @ col)
        p[:, i] = col / np.linalg.norm(col)
    q = f16(sum(f16(m.T @ p) for m in mats))
    np.testing.assert_allclose(np.asarray(payloads.p[0]), p, rtol=1e-4, atol=1e-4)
    np.testing.assert_allclose(np.asarray(payloads.q[0]), q, rtol=1e-3, atol=1e-3)


def test_declared_bounds_in_closed_form_and_error_feedback():
    eps = 2 * U["float16"] + U["float16"] ** 2
    c = jc.compressors.half(jc.compressors.topk(ratio=0.3))
    r = np.sqrt(1 - 0.3)
    assert c.delta(1000) == pytest.approx(1 - (r + eps * (1 + r)) ** 2, rel=1e-12) and not c.unbiased
    powersgd = jc.compressors.half(jc.compressors.powersgd())  # δ = 0: no uniform δ' left, a local one
    assert powersgd.delta(1000) is None
    assert float(powersgd.local_contraction(jnp.ones((10, 10)))) == pytest.approx(1 - (1 + 2 * eps) ** 2, rel=1e-6)
    q = jc.compressors.half(jc.compressors.qsgd(levels=16), "bfloat16")  # stochastic rounding keeps it unbiased
    omega = jc.compressors.qsgd(levels=16).omega(5000)
    assert q.unbiased and q.stochastic and q.omega(5000) == pytest.approx(omega + 2.0**-16 * (1 + omega))
    with pytest.raises(ValueError, match=r"contractive\("):
        jc.error_feedback(q).init(jnp.zeros((5000,)))
    jc.error_feedback(jc.compressors.contractive(q)).init(jnp.zeros((5000,)))
    sign = jc.compressors.half(jc.compressors.signsgd())
    assert sign.no_contraction == jc.compressors.signsgd().no_contraction
    with pytest.raises(ValueError, match="declares none"):
        jc.error_feedback(sign).init(jnp.zeros((100,)))


def test_a_wrapped_compressor_passes_the_battery():
    # Count-prefixed rows (threshold), a bfloat16 wire, its decompress_sum hook and the counted all-gather.
    report = testing.check_compressor(jc.compressors.half(jc.compressors.threshold(v=0.5), "bfloat16"))
    assert list(report) == list(testing.contract_checks())
    assert report["wire_bits"].startswith("wire_bits == bits of the payload's arrays (HalfCountSparsePayload: ")


def test_stochastic_rounding_keeps_an_unbiased_compressor_unbiased_within_its_bound():
    # QSGD at s = 64 (ω = 0.24 at d = 1000): one chunk of 4,000 draws reaches the check's stated power.
    c = jc.compressors.half(jc.compressors.qsgd(levels=64))
    assert testing.check_unbiased(c, num_samples=4000).endswith(", 4000 samples")
    assert testing.check_error_bound(c, num_samples=256).startswith("declared ω = 0.24")
