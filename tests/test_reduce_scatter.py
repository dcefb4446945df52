"""compressed_mean(strategy="reduce_scatter") against a NumPy transcription of the chunked route.

Each worker flattens a tensor, zero-pads it to n·c entries (c = ceil(d/n)) and cuts it into n
chunks; chunk j travels compressed to worker j, which decompresses the n chunks, sums them in
float32, divides by n, compresses the average again, and the compressed averages are all-gathered.
(The cross-backend MPI check of the same route is the ``fp16_reduce_scatter`` case of
tests/test_mpi_backend.py.)
"""

import math

import jax
import jax.numpy as jnp
import ml_dtypes
import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

import jaxcomm as jc
from jaxcomm import memory as mem
from jaxcomm.transforms import compressed_mean, doublesqueeze

pytestmark = pytest.mark.strict_promotion

WIRE = {"none": np.float32, "fp16": np.float16, "bf16": ml_dtypes.bfloat16}


def stacked(state, n):
    return jax.tree.map(lambda a: jnp.broadcast_to(a, (n,) + jnp.shape(a)), state)


def reference(xs, wire):
    """The owners' averages, reassembled: float32 (n, d) -> float32 (d,)."""
    n, d = xs.shape
    c = math.ceil(d / n)
    padded = np.zeros((n, n * c), np.float32)
    padded[:, :d] = xs
    q = padded.astype(wire).astype(np.float32).reshape(n, n, c)  # [worker, chunk, entry]
    out = np.empty((n, c), np.float32)
    for j in range(n):  # owner j sums chunk j in float32, in arrival order: itself, then j-1, j-2, ...
        total = np.zeros(c, np.float32)
        for r in range(n):
            total += q[(j - r) % n, j]
        # XLA divides by the constant n as a multiplication by its float32 reciprocal.
        out[j] = (total * np.float32(1.0 / n)).astype(wire).astype(np.float32)
    return out.reshape(-1)[:d]


@pytest.mark.parametrize("name", sorted(WIRE))
@settings(max_examples=10)  # each (n, d) compiles a new step
@given(n=st.integers(1, 8), d=st.integers(1, 40), seed=st.integers(0, 2**16))
def test_matches_numpy(name, n, d, seed):
    xs = np.random.default_rng(seed).normal(size=(n, d)).astype(np.float32) * 100
    tx = compressed_mean(jc.compressors.make(name), "i", strategy="reduce_scatter")
    st0 = stacked(tx.init({"w": jnp.zeros(d)}), n)
    out, state = jax.jit(jax.vmap(tx.update, axis_name="i"))({"w": jnp.asarray(xs)}, st0)
    ref = reference(xs, WIRE[name])
    for w in range(n):  # every worker ends with the same mean
        np.testing.assert_array_equal(np.asarray(out["w"][w]), ref)
    # Wire: n - 1 chunks to their owners and one averaged chunk, each c entries of the wire dtype.
    c = math.ceil(d / n)
    bits = n * c * np.dtype(WIRE[name]).itemsize * 8
    assert np.asarray(state.wire_bits).tolist() == [[bits]] * n


def test_fp16_moves_half_the_bytes_of_float32_with_float32_sums():
    """Eight workers whose 16-bit sum would overflow float16 (8 x 30000 > 65504): the owners sum in
    float32, so the mean is the float16 rounding of the true mean, and the wire is 16 bits an entry."""
    n, d = 8, 64
    xs = np.full((n, d), 30000.0, np.float32)
    tx = compressed_mean(jc.compressors.fp16(), "i", strategy="reduce_scatter")
    out, state = jax.jit(jax.vmap(tx.update, axis_name="i"))(
        {"w": jnp.asarray(xs)}, stacked(tx.init({"w": jnp.zeros(d)}), n)
    )
    np.testing.assert_array_equal(np.asarray(out["w"]), np.float32(np.float16(30000.0)))
    dense = compressed_mean(jc.compressors.none(), "i", strategy="reduce_scatter")
    _, dense_state = jax.jit(jax.vmap(dense.update, axis_name="i"))(
        {"w": jnp.asarray(xs)}, stacked(dense.init({"w": jnp.zeros(d)}), n)
    )
    assert 2 * int(state.wire_bits[0].sum()) == int(dense_state.wire_bits[0].sum())


def test_error_feedback_keeps_each_workers_rounding_and_the_owners():
    """With residual memory each worker keeps m = φ − Q(φ) (φ = m + g), plus, on the chunk it owns,
    n (mean − Q(mean)) of the owner's re-compression: the memories follow the NumPy recursion."""
    n, d, steps = 4, 30, 5
    rng = np.random.default_rng(0)
    tx = compressed_mean(jc.compressors.bf16(), "i", memory=mem.residual(), strategy="reduce_scatter")
    state = stacked(tx.init({"w": jnp.zeros(d)}), n)
    upd = jax.jit(jax.vmap(tx.update, axis_name="i"))
    bf16 = lambda x: x.astype(ml_dtypes.bfloat16).astype(np.float32)
    clen = -(-d // n)
    m = np.zeros((n, d), np.float32)
    for _ in range(steps):
        g = rng.normal(size=(n, d)).astype(np.float32)
        out, state = upd({"w": jnp.asarray(g)}, state)
        phi = m + g
        sent = bf16(phi)
        mean = sent.sum(0, dtype=np.float32) / np.float32(n)
        m = phi - sent
        for owner in range(n):
            c = slice(owner * clen, min(d, (owner + 1) * clen))
            m[owner, c] += (mean[c] - bf16(mean[c])) * n
        np.testing.assert_allclose(np.asarray(state.memory["w"]), m, rtol=1e-6, atol=1e-6)
        np.testing.assert_array_equal(np.asarray(out["w"][0]), bf16(mean))
    assert np.abs(m).max() > 0  # bf16 rounding left something to carry


def test_needs_a_stateless_single_round_compressor():
    with pytest.raises(ValueError, match="stateless"):
        compressed_mean(jc.compressors.signum(), "i", strategy="reduce_scatter")
    with pytest.raises(ValueError, match="rounds"):
        compressed_mean(jc.compressors.powersgd(), "i", strategy="reduce_scatter")


def test_doublesqueeze_sharded_is_the_same_route():
    """DoubleSqueeze's sharded server is the reduce-scatter route with the server's error feedback at
    the owners: with the identity compressor on both passes it is the exact mean."""
    n, d = 4, 23
    xs = np.random.default_rng(1).normal(size=(n, d)).astype(np.float32)
    tx = doublesqueeze(jc.compressors.none(), axis_name="i", server="sharded")
    out, _ = jax.jit(jax.vmap(tx.update, axis_name="i"))(
        {"w": jnp.asarray(xs)}, stacked(tx.init({"w": jnp.zeros(d)}), n)
    )
    np.testing.assert_allclose(np.asarray(out["w"][0]), xs.mean(0), rtol=1e-6, atol=1e-6)


@pytest.mark.parametrize("name", ["fp16", "bf16"])
def test_16_bit_sums_conserve_the_gradient_under_error_feedback(name):
    """Σ_t n ḡ_t + Σ_i m_i = Σ_t Σ_i g_i: with a residual memory, "auto" routes a 16-bit payload
    through the float32 reduce-scatter and the owners feed their rounding back, so the identity
    holds to float32 rounding. The 16-bit all-reduce misses it by the sum's rounding (the control,
    at least 10x larger here, shows the check can fail)."""
    n, d, steps = 4, 257, 6
    rng = np.random.default_rng(0)
    grads = [rng.normal(size=(n, d)).astype(np.float32) * 3 for _ in range(steps)]

    def gap(strategy):
        tx = compressed_mean(jc.compressors.make(name), "i", memory=mem.residual(), strategy=strategy)
        state = stacked(tx.init({"w": jnp.zeros(d)}), n)
        upd = jax.jit(jax.vmap(tx.update, axis_name="i"))
        sent = np.zeros(d)
        for g in grads:
            out, state = upd({"w": jnp.asarray(g)}, state)
            sent += n * np.asarray(out["w"][0], np.float64)
        lhs = sent + np.asarray(state.memory["w"], np.float64).sum(0)
        return np.abs(lhs - np.sum(grads, axis=(0, 1), dtype=np.float64)).max()

    exact = gap("auto")
    assert exact < 1e-4 * steps * n  # float32 sums of O(10) values
    assert gap("allreduce") > 10 * exact
