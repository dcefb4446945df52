"""Top-k with the selection threshold carried between steps (``topk(reuse_threshold=True)``).

The carried threshold only changes which branch finds the top-k, never the result:
every test compares indices and payloads bit for bit with :func:`top_indices` /
``topk()`` and with a NumPy reference (a stable argsort of the magnitudes, ties to the
lowest index, returned in increasing index order for more than 2048 entries), on
inputs where the carried threshold is taken and where the sampled fallback runs.
"""

from __future__ import annotations

import collections

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from jax.sharding import Mesh, NamedSharding
from jax.sharding import PartitionSpec as P

import jaxcomm as jc
from jaxcomm import memory as mem
from jaxcomm.compressors import _sparse as SP
from jaxcomm.compressors._kernels import select as S
from jaxcomm.transforms import compressed_mean


def np_keys(x):
    return (np.asarray(x, np.float32).ravel().view(np.int32) & 0x7FFFFFFF).astype(np.int64)


def np_topk_sorted(x, k):
    """The k largest |x| (ties to the lowest index), in increasing index order."""
    return np.sort(np.argsort(-np_keys(x), kind="stable")[:k])


_D, _K = 6000, 60  # d > 2048 with primitive_max=0: the sampled path, so a threshold is carried
_plain = jax.jit(lambda v, key: S.top_indices(v, _K, key, keys_of=S.magnitude_keys, primitive_max=0))
_reuse = jax.jit(lambda v, key, s: S.top_indices_reusing(v, _K, key, s, keys_of=S.magnitude_keys, primitive_max=0))


def test_reuse_capacity_and_initial_state():
    cap = S._sample_plan(_D, _K, S._MARGIN)[2]
    assert S.reuse_capacity(_K, _D) == min(cap, _K + max(64, int(np.ceil(S.REUSE_SLACK * _K))))
    assert S.reuse_capacity(10, 2048) == 0 and S.reuse_capacity(3000, 3000) == 0
    np.testing.assert_array_equal(S.reuse_state(_K, _D), [S.NO_GUESS, (_K + S.reuse_capacity(_K, _D)) // 2])


@settings(max_examples=30)
@given(
    seed=st.integers(0, 2**16),
    where=st.sampled_from(["none", "below", "above", "at", "random"]),
    offset=st.integers(0, 2**22),
    aim=st.integers(1, 200),
    heavy=st.booleans(),
)
def test_any_carried_state_gives_the_exact_top_k(seed, where, offset, aim, heavy):
    """Whatever the carried guess (none, below, at or above the k-th key, arbitrary), the indices equal
    top_indices' and the NumPy reference's, and PATH_REUSED is taken exactly when the count of keys
    >= guess lies in [k, C_r]."""
    rs = np.random.RandomState(seed)
    x = (rs.standard_cauchy(_D) if heavy else rs.randn(_D)).astype(np.float32)
    keys = np_keys(x)
    kth = int(np.sort(keys)[::-1][_K - 1])
    guess = {
        "none": S.NO_GUESS,
        "below": max(kth - offset, 0),
        "above": kth + offset,
        "at": kth,
        "random": int(rs.randint(0, 2**31 - 1)),
    }[where]
    state = jnp.asarray([guess, aim], jnp.int32)
    key = jax.random.PRNGKey(seed)
    idx, path, new_state = _reuse(jnp.asarray(x), key, state)
    np.testing.assert_array_equal(np.asarray(idx), np.asarray(_plain(jnp.asarray(x), key)[0]))
    np.testing.assert_array_equal(np.asarray(idx), np_topk_sorted(x, _K))
    count = int((keys >= guess).sum())
    reusable = guess >= 0 and _K <= count <= S.reuse_capacity(_K, _D)
    assert (int(path) == S.PATH_REUSED) == reusable
    assert new_state.shape == (2,) and new_state.dtype == jnp.int32
    assert int(new_state[0]) == S.NO_GUESS or 0 <= int(new_state[0]) <= 0x7FC00000


def test_reuse_across_drifting_steps_takes_both_branches():
    """An error-feedback loop (φ = m + g, m ← φ with the sent entries zeroed) on fresh gradients, then
    on a gradient scaled up 4x (the carried threshold admits too few: fallback): every step is
    exact, the carried threshold is used on most steps and the fallback runs too."""
    rs = np.random.RandomState(3)
    m = np.zeros(_D, np.float32)
    state = S.reuse_state(_K, _D)
    paths = collections.Counter()
    for step in range(24):
        g = rs.randn(_D).astype(np.float32) * (4.0 if step == 16 else 1.0)
        phi = m + g
        key = jax.random.PRNGKey(step)
        idx, path, state = _reuse(jnp.asarray(phi), key, state)
        expected = np_topk_sorted(phi, _K)
        np.testing.assert_array_equal(np.asarray(idx), expected)
        np.testing.assert_array_equal(np.asarray(idx), np.asarray(_plain(jnp.asarray(phi), key)[0]))
        paths[int(path)] += 1
        m = phi.copy()
        m[expected] = 0
    assert paths[S.PATH_REUSED] >= 12, paths
    assert paths[S.PATH_SAMPLED] >= 2, paths  # the first step (no guess) and the jump at step 16


def test_reuse_on_ties_and_small_tensors():
    """A mostly-zero vector (the k-th key a tie at 0: tie branch, nothing carried) and tensors of at most
    2048 entries (a stable sort, nothing carried) give the reference too."""
    rs = np.random.RandomState(4)
    sparse = np.zeros(_D, np.float32)
    sparse[rs.choice(_D, 30, replace=False)] = rs.randn(30)
    state = S.reuse_state(_K, _D)
    for _ in range(2):
        idx, path, state = _reuse(jnp.asarray(sparse), jax.random.PRNGKey(0), state)
        assert int(path) == S.PATH_TIES
        np.testing.assert_array_equal(np.asarray(idx), np_topk_sorted(sparse, _K))
        assert int(state[0]) == S.NO_GUESS
    x = rs.randn(1000).astype(np.float32)
    idx, path, st2 = S.top_indices_reusing(
        jnp.asarray(x), 10, jax.random.PRNGKey(0), S.reuse_state(10, 1000), keys_of=S.magnitude_keys
    )
    np.testing.assert_array_equal(np.asarray(idx), np.argsort(-np_keys(x), kind="stable")[:10])
    np.testing.assert_array_equal(st2, S.reuse_state(10, 1000))


def test_topk_reuse_threshold_argument():
    with pytest.raises(TypeError, match="reuse_threshold"):
        jc.compressors.topk(ratio=0.1, reuse_threshold=1)
    c = jc.compressors.topk(ratio=0.1, reuse_threshold=True)
    assert c.params == {"ratio": 0.1, "reuse_threshold": True}
    assert jc.compressors.topk(ratio=0.1).params == {"ratio": 0.1}
    with pytest.raises(ValueError, match="stateless"):
        compressed_mean(c, "data", strategy="reduce_scatter")


# --------------------------------------------------------------------------- #
# In the data-parallel step: shard_map(check_vma=True), vmap, checkpoint
# --------------------------------------------------------------------------- #
SHAPES = {"b": (40,), "w": (60, 70)}  # 4200 entries: the carried path; 40: a stable sort
N = 4


def _data(seed=0):
    rs = np.random.RandomState(seed)
    a = {k: rs.randn(N, *s).astype(np.float32) for k, s in SHAPES.items()}
    x0 = {k: rs.randn(*s).astype(np.float32) for k, s in SHAPES.items()}
    return a, x0


def _run_shard_map(c, steps, a, x0):
    """Steps of compressed_mean(c, residual) + sgd inside shard_map(check_vma=True); per step: the
    mean, the per-worker memories and states (stacked on the worker axis)."""
    mesh = Mesh(np.array(jax.devices()[:N]), ("data",))
    tx = compressed_mean(c, "data", memory=mem.residual())

    def worker(a, x, state):
        a, x, state = jax.tree.map(lambda v: v[0], (a, x, state))
        g = {k: a[k] * x[k] + jnp.sin(7.0 * x[k]) for k in x}
        u, state = tx.update(g, state, x)
        return jax.tree.map(
            lambda v: v[None], (g, u, optax.apply_updates(x, jax.tree.map(lambda d: -0.1 * d, u)), state)
        )

    step = jax.jit(jax.shard_map(worker, mesh=mesh, in_specs=(P("data"),) * 3, out_specs=P("data"), check_vma=True))
    put = lambda t: jax.device_put(t, NamedSharding(mesh, P("data")))
    stack = lambda t: jax.tree.map(lambda v: np.broadcast_to(np.asarray(v), (N, *np.shape(v))).copy(), t)
    x, state = put(stack(x0)), put(stack(tx.init(x0)))
    a = put(a)
    out = []
    for _ in range(steps):
        old_memory = state.memory
        g, u, x, state = step(a, x, state)
        out.append(jax.tree.map(np.asarray, (old_memory, g, u, state)))
    return out, tx


def test_step_with_reuse_is_bit_identical_and_conserves_mass(monkeypatch):
    """compressed_mean(topk(reuse_threshold=True)) inside shard_map(check_vma=True) over 6 steps: the
    mean, the memories and the wire bits equal topk()'s bit for bit; the NumPy reference of the step
    holds (m_i' = φ_i with its top-k zeroed; ḡ = Σ_i (φ_i − m_i') / n) and so does the conservation
    Σ_i m_i' + n ḡ = Σ_i φ_i. The sampled CPU bodies (CPU_PRIMITIVE_MAX = 0), so a threshold is carried."""
    monkeypatch.setattr(S, "CPU_PRIMITIVE_MAX", 0)
    a, x0 = _data()
    k = jc.compressors.topk(ratio=0.02)
    r = jc.compressors.topk(ratio=0.02, reuse_threshold=True)
    plain, _ = _run_shard_map(k, 6, a, x0)
    reused, _ = _run_shard_map(r, 6, a, x0)
    carried = []
    for (m0, g, u, sk), (_, _, ur, sr) in zip(plain, reused):
        for kname in SHAPES:
            np.testing.assert_array_equal(ur[kname], u[kname])
            np.testing.assert_array_equal(sr.memory[kname], sk.memory[kname])
            phi = m0[kname] + g[kname]  # per worker, float32 as in the step
            d = phi[0].size
            kk = SP.num_selected(0.02, d)
            expected_m = phi.reshape(N, -1).copy()
            for i in range(N):  # the sent set (its order does not matter here)
                expected_m[i, np.argsort(-np_keys(phi[i]), kind="stable")[:kk]] = 0
            np.testing.assert_array_equal(sr.memory[kname].reshape(N, -1), expected_m)
            sent = phi.reshape(N, -1).astype(np.float64) - expected_m
            np.testing.assert_allclose(ur[kname][0].ravel(), sent.sum(0) / N, rtol=1e-6, atol=1e-6)
            lhs = expected_m.astype(np.float64).sum(0) + N * ur[kname][0].ravel().astype(np.float64)
            np.testing.assert_allclose(lhs, phi.reshape(N, -1).astype(np.float64).sum(0), rtol=1e-5, atol=1e-5)
        np.testing.assert_array_equal(sr.wire_bits, sk.wire_bits)
        carried.append(np.asarray(sr.compressor_states[1][:, 0]))  # "w": the 4200-entry tensor
    assert (np.asarray(carried[-1]) >= 0).all()  # a threshold is carried per worker


def test_reuse_under_vmap_and_checkpoint_roundtrip(tmp_path):
    """The same step under jax.vmap(axis_name=...) equals topk()'s; the carried state is saved and
    restored by the checkpointer bit-identically and a resumed run continues identically."""
    from jaxcomm.train._checkpoint import restore_checkpoint, save_checkpoint

    a, x0 = _data(1)
    steps_of = {}  # one compiled step per setting, shared by the runs below

    def run(reuse: bool, steps, state=None, x=None):
        if reuse not in steps_of:
            tx = compressed_mean(jc.compressors.topk(ratio=0.02, reuse_threshold=reuse), "data", memory=mem.residual())

            def worker(a, x, state):
                g = {kk: a[kk] * x[kk] for kk in x}
                u, state = tx.update(g, state, x)
                return jax.tree.map(lambda p, d: p - 0.1 * d, x, u), state

            steps_of[reuse] = tx, jax.jit(jax.vmap(worker, axis_name="data"))
        tx, f = steps_of[reuse]
        x = jax.tree.map(lambda v: jnp.broadcast_to(v, (N, *v.shape)), x0) if x is None else x
        state = jax.vmap(lambda _: tx.init(x0))(jnp.arange(N)) if state is None else state
        for _ in range(steps):
            x, state = f(a, x, state)
        return x, state

    xp, sp = run(False, 4)
    xr, sr = run(True, 4)
    jax.tree.map(np.testing.assert_array_equal, xp, xr)
    np.testing.assert_array_equal(sp.wire_bits, sr.wire_bits)

    x2, s2 = run(True, 2)
    save_checkpoint(tmp_path, 2, {"x": x2, "state": s2})
    restored, _, _ = restore_checkpoint(tmp_path, {"x": x2, "state": s2})
    jax.tree.map(np.testing.assert_array_equal, restored["state"].compressor_states, s2.compressor_states)
    x4, s4 = run(True, 2, restored["state"], restored["x"])
    jax.tree.map(np.testing.assert_array_equal, x4, xr)
    jax.tree.map(np.testing.assert_array_equal, s4.compressor_states, sr.compressor_states)
