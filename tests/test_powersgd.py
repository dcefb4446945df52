"""PowerSGD against closed-form facts and a NumPy transcription of its two rounds.

Facts used: one power-iteration step reproduces a matrix of rank <= r exactly
(P spans its column space, and P P^T M = M); P has orthonormal columns; warm
started steps converge to the best rank-r approximation (Eckart-Young: the
error tends to the norm of the discarded singular values); the distributed
version equals the local one applied to the sum of the workers' matrices.
"""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import jaxcomm as jc
from jaxcomm.comm import MeshAxis
from jaxcomm.compressors import _lowrank as L
from jaxcomm.compressors._base import DensePayload
from jaxcomm.transforms._collectives import run_rounds

pytestmark = pytest.mark.strict_promotion

KEY = jax.random.PRNGKey(0)


def low_rank(n, m, r, seed=0):
    rs = np.random.RandomState(seed)
    return (rs.randn(n, r) @ rs.randn(r, m)).astype(np.float32)


def rel_err(a, b):
    return float(np.linalg.norm(np.asarray(a, np.float64) - b) / np.linalg.norm(b))


@pytest.mark.parametrize("r", [1, 2])
def test_exact_on_rank_r_matrix_after_one_step(r):
    m = low_rank(40, 30, r)
    c = jc.compressors.powersgd(r)
    y, state = jax.jit(c.roundtrip)(jnp.asarray(m), KEY)
    assert rel_err(y, m) < 1e-5
    assert isinstance(state, L.PowerSGDState) and bool(state.initialized)
    # A second (warm-started) step stays exact.
    y2, _ = jax.jit(c.roundtrip)(jnp.asarray(m), jax.random.PRNGKey(1), state)
    assert rel_err(y2, m) < 1e-5


def test_p_is_orthonormal_and_orthogonalize_matches_qr():
    x = np.random.RandomState(1).randn(50, 20).astype(np.float32)
    c = jc.compressors.powersgd(matrix_approximation_rank=4)
    payload, _ = jax.jit(lambda x, k: c.compress(x, k))(jnp.asarray(x), KEY)
    p = np.asarray(payload.p, np.float64)
    np.testing.assert_allclose(p.T @ p, np.eye(4), atol=1e-5)
    a = np.random.RandomState(2).randn(30, 5).astype(np.float32)
    q_ref, _ = np.linalg.qr(a.astype(np.float64))
    orth = jax.jit(L.orthogonalize, static_argnums=1)
    q = np.asarray(orth(jnp.asarray(a), 0.0), np.float64)
    np.testing.assert_allclose(np.abs(q), np.abs(q_ref), atol=1e-5)  # Q of QR up to column signs
    # a zero column stays zero with epsilon = 0; epsilon > 0 divides by norm + epsilon
    z = np.asarray(orth(jnp.zeros((6, 2)), 0.0))
    assert np.all(z == 0)
    e = np.asarray(orth(jnp.asarray([[3.0], [4.0]]), 1.0))
    np.testing.assert_allclose(e[:, 0], [0.5, 2.0 / 3.0], rtol=1e-6)


@pytest.mark.parametrize("shape", [(37, 53, 1), (37, 53, 3), (2, 37, 53), (1, 37, 1)])
def test_matmul_is_the_matrix_product(shape):
    # L._matmul computes PowerSGD's three products (M Q, P^T M, P Q^T) as row-major dots behind
    # optimization barriers: the value of a @ b, under jit and under vmap (a batch dimension).
    k, l, j = shape
    rs = np.random.RandomState(k * 100 + j)
    a, b = rs.randn(k, l).astype(np.float32), rs.randn(l, j).astype(np.float32)
    want = a.astype(np.float64) @ b
    np.testing.assert_allclose(np.asarray(jax.jit(L._matmul)(a, b)), want, rtol=1e-5, atol=1e-5)
    # the transposed operands the compressor passes (P^T, Q^T) are transposes of live arrays
    got_t = jax.jit(lambda at, bt: L._matmul(at.T, bt.T))(jnp.asarray(a.T), jnp.asarray(b.T))
    np.testing.assert_allclose(np.asarray(got_t), want, rtol=1e-5, atol=1e-5)
    batch_a = np.stack([a, 2 * a, -a])
    batch_b = np.stack([b, b, 3 * b])
    got = np.asarray(jax.jit(jax.vmap(L._matmul))(batch_a, batch_b))
    for i, s in enumerate([1.0, 2.0, -3.0]):
        np.testing.assert_allclose(got[i], s * want, rtol=1e-5, atol=1e-4)


def test_warm_start_converges_to_best_rank_r_approximation():
    # Spectrum 10, 5, 1, 0.5, ...: the error of the rank-2 approximation must reach the Eckart-Young
    # bound sqrt(sum_{i>2} s_i^2) as the warm-started power iteration converges (ratio s3/s2 = 0.2/step).
    rs = np.random.RandomState(3)
    u, _ = np.linalg.qr(rs.randn(60, 8))
    v, _ = np.linalg.qr(rs.randn(45, 8))
    s = np.array([10, 5, 1, 0.5, 0.3, 0.2, 0.1, 0.05])
    m = (u * s) @ v.T
    bound = np.sqrt(np.sum(s[2:] ** 2))
    c = jc.compressors.powersgd(2)
    step = jax.jit(c.roundtrip)
    state = c.init_state(jnp.asarray(m, jnp.float32))
    errs = []
    for t in range(12):
        y, state = step(jnp.asarray(m, jnp.float32), jax.random.PRNGKey(t), state)
        errs.append(np.linalg.norm(np.asarray(y, np.float64) - m))
    assert errs[-1] <= bound * (1 + 1e-3)
    assert min(errs) >= bound * (1 - 1e-4)  # never better than the best rank-2 approximation
    # Without warm start the compressor is stateless (a fresh Q every step).
    cold = jc.compressors.powersgd(2, warm_start=False)
    assert cold.init_state(jnp.asarray(m)) == ()


def np_two_rounds(mats, q, eps=0.0):
    """NumPy transcription of Vogels et al. Alg. 1 across workers: P = sum M_i Q; orth; Q = sum M_i^T P."""
    p = sum(mi @ q for mi in mats)
    for i in range(p.shape[1]):  # Gram-Schmidt, projections applied twice
        col = p[:, i].copy()
        for _ in range(2 if i else 0):
            col -= p[:, :i] @ (p[:, :i].T @ col)
        nrm = np.linalg.norm(col)
        p[:, i] = col / (nrm + eps) if eps else (col / nrm if nrm > 0 else col * 0)
    qn = sum(mi.T @ p for mi in mats)
    return p, qn


def test_compress_allreduce_under_vmap_is_the_compression_of_the_sum():
    n_workers, shape = 4, (4, 6, 18)  # viewed as the 24 x 18 matrix (prod(shape[:-1]), shape[-1])
    xs = jax.random.normal(jax.random.PRNGKey(5), (n_workers,) + shape)
    c = jc.compressors.powersgd(matrix_approximation_rank=2)
    comm = MeshAxis("w")

    def worker(x, state):
        payload, new_state, _ = run_rounds(c, x, KEY, state, comm)
        return c.decompress(payload), new_state, payload

    state0 = c.init_state(xs[0])
    states = jax.tree.map(lambda a: jnp.broadcast_to(a, (n_workers,) + a.shape), state0)
    out, new_states, payloads = jax.jit(jax.vmap(worker, axis_name="w"))(xs, states)
    total = jnp.sum(xs, axis=0)
    local, _ = jax.jit(c.roundtrip)(total, KEY, state0)
    for w in range(n_workers):
        np.testing.assert_allclose(np.asarray(out[w]), np.asarray(local), rtol=1e-4, atol=1e-4)
        np.testing.assert_array_equal(np.asarray(new_states.q[w]), np.asarray(new_states.q[0]))
    # NumPy transcription of the two rounds, from the same initial Q (drawn from the shared key).
    q0 = np.asarray(jax.random.normal(KEY, (18, 2), jnp.float32), np.float64)
    mats = [np.asarray(x, np.float64).reshape(24, 18) for x in xs]
    p_ref, q_ref = np_two_rounds(mats, q0)
    np.testing.assert_allclose(np.asarray(payloads.p[0]), p_ref, rtol=1e-4, atol=1e-4)
    np.testing.assert_allclose(np.asarray(payloads.q[0]), q_ref, rtol=1e-4, atol=1e-4)
    np.testing.assert_allclose(np.asarray(new_states.q[0]), q_ref / n_workers, rtol=1e-4, atol=1e-4)
    assert jc.wire_bits(jax.tree.map(lambda a: a[0], payloads)) == 32 * (24 + 18) * 2


def test_small_and_1d_arrays_are_sent_uncompressed():
    c = jc.compressors.powersgd(matrix_approximation_rank=2)
    comm = MeshAxis("w")
    allreduce = jax.jit(
        jax.vmap(lambda v: c.decompress(run_rounds(c, v, KEY, c.init_state(v), comm)[0]), axis_name="w")
    )
    for shape in [(7,), (2, 3, 4)]:  # rank < 2, or (n + m) r * 2 >= n m  (6 x 4: 40 >= 24)
        x = jax.random.normal(KEY, (3,) + shape)
        assert L.powersgd_plan(shape, 2, 2.0) is None
        np.testing.assert_allclose(np.asarray(allreduce(x)[0]), np.asarray(x.sum(0)), rtol=1e-6)
        p, _ = c.compress(x[0], KEY)
        assert isinstance(p, DensePayload)
        np.testing.assert_array_equal(np.asarray(c.decompress(p)), np.asarray(x[0]))
    assert L.powersgd_plan((), 2, 2.0) is None and L.powersgd_plan((4, 4), 2, 2.0) is None
    assert L.powersgd_plan((40, 30), 2, 2.0) == (40, 30, 2)
    assert L.powersgd_plan((40, 30), 2, 20.0) is None  # (40+30)*2*20 >= 1200
    assert L.powersgd_plan((5, 30), 8, 0.5) == (5, 30, 5)  # r capped at min(n, m); (5+30)*5*0.5 < 150
    # Flax kernels (kh, kw, in, out) are fan-in x outputs: 3x3x16x16 -> 144 x 16, compressed at rank 2.
    assert L.powersgd_plan((3, 3, 16, 16), 2, 2.0) == (144, 16, 2)
    assert L.powersgd_plan((3, 5, 7), 2, 2.0) == (15, 7, 2)


def test_dtype_rank_alias_and_nonfinite_recovery():
    m = low_rank(32, 16, 1)
    a = jc.compressors.powersgd(2)
    assert a.params == jc.compressors.powersgd(matrix_approximation_rank=2).params
    assert a.params == jc.compressors.powersgd(2, matrix_approximation_rank=2).params
    step = jax.jit(a.roundtrip)
    yh, _ = jax.jit(a.roundtrip)(jnp.asarray(m, jnp.bfloat16), KEY)
    assert yh.dtype == jnp.bfloat16 and rel_err(yh.astype(jnp.float32), m) < 2e-2
    # NaN propagates to the output and the state; the next finite step starts afresh from the key.
    bad = jnp.asarray(m).at[0, 0].set(jnp.nan)
    y, state = step(bad, KEY, a.init_state(bad))
    assert bool(jnp.isnan(y).any()) and not bool(jnp.all(jnp.isfinite(state.q)))
    y, state = step(jnp.asarray(m), KEY, state)
    assert rel_err(y, m) < 1e-5


@pytest.mark.parametrize(
    "kwargs,match",
    [
        (dict(rank=0), "rank"),
        (dict(matrix_approximation_rank=0), "matrix_approximation_rank"),
        (dict(rank=2, matrix_approximation_rank=3), "alias"),
        (dict(rank=2, min_compression_rate=0.0), "min_compression_rate"),
        (dict(rank=2, orthogonalization_epsilon=-1.0), "orthogonalization_epsilon"),
        (dict(rank=2, min_compression_rate=float("inf")), "min_compression_rate"),
        (dict(rank=2, warm_start=1), "warm_start"),
    ],
)
def test_bad_hyperparameters(kwargs, match):
    with pytest.raises((ValueError, TypeError), match=match):
        jc.compressors.powersgd(**kwargs)


# --------------------------------------------------------------------------- #
# PyTorch's start_powerSGD_iter: dense all-reduce first, error feedback from the switch
# --------------------------------------------------------------------------- #
def _np_orth(p):
    p = p.copy()
    for i in range(p.shape[1]):
        col = p[:, i].copy()
        for _ in range(2 if i else 0):
            col -= p[:, :i] @ (p[:, :i].T @ col)
        nrm = np.linalg.norm(col)
        p[:, i] = col / nrm if nrm > 0 else 0 * col
    return p


def _np_powersgd_hook(grads, start, rank, seed, lr):
    """NumPy replay of powerSGD_hook's semantics over steps (grads: [steps][worker] dict of w (24, 18), b (18,)).

    Steps < start: the dense mean, no error kept, Q not drawn. From the switch: phi_i = g_i + e_i
    (e_i = 0 at the switch); Q = the key's normal draw at the first compressed step, then the
    orthogonalised previous Q/n; P = orth(sum phi_i Q); Q = sum phi_i^T P; mean = P Q^T / n;
    e_i = phi_i - mean; 1-D b is sent dense. The keys follow compressed_mean's documented schedule
    (key, step_key = split(key); leaf keys = split(step_key, 2), leaves in sorted order b, w).
    """
    n = len(grads[0])
    key = jax.random.PRNGKey(seed)
    params = {"b": np.zeros(18), "w": np.zeros((24, 18))}
    err = [np.zeros((24, 18)) for _ in range(n)]
    q_prev, bits = None, []
    for t, gs in enumerate(grads):
        key, step_key = jax.random.split(key)
        leaf_keys = jax.random.split(step_key, 2)
        b_mean = np.mean([g["b"] for g in gs], axis=0)
        if t < start:
            w_mean = np.mean([g["w"] for g in gs], axis=0)
            bits.append(32 * (18 + 24 * 18))
        else:
            phis = [g["w"] + e for g, e in zip(gs, err)]
            if q_prev is None:
                q = np.asarray(jax.random.normal(leaf_keys[1], (18, rank), jnp.float32), np.float64)
            else:
                q = _np_orth(q_prev)
            p = _np_orth(sum(phi @ q for phi in phis))
            q = sum(phi.T @ p for phi in phis)
            w_mean = p @ q.T / n
            err = [phi - w_mean for phi in phis]
            q_prev = q / n
            bits.append(32 * 18 + 32 * (24 + 18) * rank)
        params = {"b": params["b"] - lr * b_mean, "w": params["w"] - lr * w_mean}
    return params, err, bits


def _grads(steps, n, seed=0):
    rng = np.random.default_rng(seed)
    return [[{"b": rng.normal(size=18), "w": rng.normal(size=(24, 18))} for _ in range(n)] for _ in range(steps)]


@pytest.mark.parametrize(("start", "n", "use_shard_map"), [(0, 4, False), (1, 4, False), (3, 4, False), (2, 2, True)])
def test_start_powersgd_iter_matches_the_hook_semantics(start, n, use_shard_map):
    import optax

    steps, rank, lr = 6, 2, 0.1
    grads = _grads(steps, n, seed=start)
    c = jc.compressors.powersgd(rank=rank, start_powerSGD_iter=start, seed=3)
    assert c.dense_warmup == start and c.params["start_powerSGD_iter"] == start
    tx = optax.chain(jc.compressed_mean(c, axis_name="w", memory=jc.memory.residual()), optax.sgd(lr))
    params = {"b": jnp.zeros((n, 18)), "w": jnp.zeros((n, 24, 18))}
    state = jax.vmap(tx.init)(params)

    def worker_step(p, s, g):
        u, s = tx.update(g, s, p)
        return optax.apply_updates(p, u), s

    if use_shard_map:  # one device per worker, check_vma on (jax.shard_map's default)
        mesh = jax.make_mesh((n,), ("w",))
        spec = jax.sharding.PartitionSpec("w")
        put = lambda t: jax.device_put(t, jax.sharding.NamedSharding(mesh, spec))
        body = lambda *a: jax.tree.map(lambda v: v[None], worker_step(*jax.tree.map(lambda v: v[0], a)))
        step = jax.jit(jax.shard_map(body, mesh=mesh, in_specs=spec, out_specs=spec))
        params, state = put(params), put(state)
    else:
        put = lambda t: t
        step = jax.jit(jax.vmap(worker_step, axis_name="w"))
    bits = []
    for gs in grads:
        g = put({k: jnp.asarray(np.stack([w[k] for w in gs]), jnp.float32) for k in ("b", "w")})
        params, state = step(params, state, g)
        bits.append(int(np.asarray(state[0].wire_bits)[0].sum()))
    params, state = jax.device_get((params, state))
    want, err, want_bits = _np_powersgd_hook(grads, start, rank, seed=3, lr=lr)
    for k in ("b", "w"):
        np.testing.assert_allclose(np.asarray(params[k][0]), want[k], rtol=2e-4, atol=2e-5, err_msg=k)
    for i in range(n):  # the error-feedback memory: PyTorch's error_dict
        np.testing.assert_allclose(np.asarray(state[0].memory["w"][i]), err[i], rtol=2e-4, atol=2e-5)
    assert bits == want_bits


def test_warmup_memory_stays_zero_and_only_one_branch_communicates():
    import optax

    n, start = 4, 2
    c = jc.compressors.powersgd(rank=1, start_powerSGD_iter=start)
    tx = jc.compressed_mean(c, axis_name="w", memory=jc.memory.residual())
    g = {"w": jax.random.normal(KEY, (n, 24, 18))}
    state = jax.vmap(tx.init)({"w": jnp.zeros((n, 24, 18))})
    update = jax.jit(jax.vmap(tx.update, axis_name="w"))
    for t in range(start + 1):
        _, state = update(g, state)
        zero = not np.any(np.asarray(state.memory["w"]))
        assert zero == (t < start), t  # zero through the warm-up, an error from the switch
        assert bool(np.asarray(state.compressor_states[0].initialized)[0]) == (t >= start)
    # Under shard_map the dense and compressed paths sit in the two branches of one cond.
    mesh = jax.make_mesh((n,), ("w",))
    f = jax.shard_map(
        lambda g, s: jax.tree.map(lambda a: a[None], tx.update(*jax.tree.map(lambda a: a[0], (g, s)))),
        mesh=mesh,
        in_specs=jax.sharding.PartitionSpec("w"),
        out_specs=jax.sharding.PartitionSpec("w"),
    )
    put = lambda t: jax.device_put(t, jax.sharding.NamedSharding(mesh, jax.sharding.PartitionSpec("w")))
    text = str(jax.make_jaxpr(f)(put(g), put(jax.vmap(tx.init)({"w": jnp.zeros((n, 24, 18))}))))
    assert text.count("cond[") == 1
    del optax


def test_dense_warmup_only_where_it_is_run():
    c = jc.compressors.powersgd(rank=1, start_powerSGD_iter=5)
    with pytest.raises(ValueError, match=r"only jaxcomm\.compressed_mean runs"):
        jc.error_feedback(c)
    with pytest.raises((ValueError, TypeError), match="start_powerSGD_iter"):
        jc.compressors.powersgd(rank=1, start_powerSGD_iter=-1)
    with pytest.raises((ValueError, TypeError), match="start_powerSGD_iter"):
        jc.compressors.powersgd(rank=1, start_powerSGD_iter=2.5)


def _three_steps(c, use_shard_map=False, fuse=True):
    """compressed_mean(c) + residual memory over 4 workers, 3 steps; leaves of shared and unique shapes."""
    n = 4
    shapes = {"k1": (6, 4, 18), "k2": (24, 18), "k3": (24, 18), "b1": (18,), "b2": (18,), "u": (10, 7)}
    rng = np.random.default_rng(0)
    tx = jc.compressed_mean(c, axis_name="w", memory=jc.memory.residual(), fuse=fuse)
    state = jax.vmap(tx.init)({k: jnp.zeros((n, *s)) for k, s in shapes.items()})
    if use_shard_map:
        mesh = jax.make_mesh((n,), ("w",))
        spec = jax.sharding.PartitionSpec("w")
        put = lambda t: jax.device_put(t, jax.sharding.NamedSharding(mesh, spec))
        body = lambda g, s: jax.tree.map(lambda a: a[None], tx.update(*jax.tree.map(lambda a: a[0], (g, s))))
        update = jax.jit(jax.shard_map(body, mesh=mesh, in_specs=spec, out_specs=spec))
        state = put(state)
    else:
        put = lambda t: t
        update = jax.jit(jax.vmap(tx.update, axis_name="w"))
    outs = []
    for _ in range(3):
        g = put({k: jnp.asarray(rng.normal(size=(n, *s)), jnp.float32) for k, s in shapes.items()})
        u, state = update(g, state)
        outs.append(jax.device_get(u))
    return outs, jax.device_get(state)


@pytest.mark.parametrize("use_shard_map", [False, True])
def test_batch_tensors_with_same_shape_equals_the_per_tensor_run(use_shard_map):
    plain = jc.compressors.powersgd(rank=2, start_powerSGD_iter=1)
    batched = jc.compressors.powersgd(rank=2, start_powerSGD_iter=1, batch_tensors_with_same_shape=True)
    (u_a, s_a), (u_b, s_b) = _three_steps(plain, use_shard_map), _three_steps(batched, use_shard_map)
    for a, b in zip(
        jax.tree.leaves((u_a, s_a.memory, s_a.compressor_states)),
        jax.tree.leaves((u_b, s_b.memory, s_b.compressor_states)),
    ):
        np.testing.assert_allclose(np.asarray(a), np.asarray(b), rtol=1e-5, atol=1e-6)
    np.testing.assert_array_equal(s_a.wire_bits, s_b.wire_bits)  # the same bits, other collectives:
    # a compressed matrix takes 2 rounds, a 1-D tensor 1 (sent dense). Unbatched and fused (the default),
    # every tensor's round-r message shares one all-reduce: 2. Batched, by matrix view as PyTorch's
    # tensor.view(n, -1): k1 (6, 4, 18) joins the (24, 18) pair k2, k3: 2; the (18,) pair: 1; u alone: 2 = 5.
    assert int(s_a.messages[0]) == 2 and int(s_b.messages[0]) == 5
    if not use_shard_map:  # unfused, one all-reduce per tensor and round: k1, k2, k3, u: 2 each, b1, b2: 1 each
        u_c, s_c = _three_steps(plain, fuse=False)
        assert int(s_c.messages[0]) == 10
        np.testing.assert_array_equal(s_c.wire_bits, s_a.wire_bits)
        for a, c in zip(jax.tree.leaves((u_a, s_a.memory)), jax.tree.leaves((u_c, s_c.memory))):
            np.testing.assert_array_equal(np.asarray(a), np.asarray(c))  # fusion changes no bit
    for k in ("k1", "k2"):  # the updates keep each tensor's own shape
        assert np.shape(u_b[0][k]) == np.shape(u_a[0][k])
    with pytest.raises(TypeError, match="batch_tensors_with_same_shape must be a bool"):
        jc.compressors.powersgd(rank=1, batch_tensors_with_same_shape=1)
