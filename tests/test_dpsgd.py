"""D-PSGD (Lian et al. 2017; EventGraD Eq. 2) against a NumPy reference."""

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

from jaxcomm import topology as T
from jaxcomm.algorithms import average_model, dpsgd, per_worker, replicate, simulate_decentralized
from jaxcomm.algorithms._dpsgd import consensus_distance

pytestmark = pytest.mark.strict_promotion

N = 8
LR = 0.1
STEPS = 4


def _least_squares(n, seed=0):
    """Worker i minimises 0.5 ||A_i x - b_i||^2 (gradient A_i^T (A_i x - b_i), closed form)."""
    rng = np.random.default_rng(seed)
    a = rng.standard_normal((n, 6, 5)).astype(np.float32)
    b = rng.standard_normal((n, 6)).astype(np.float32)
    x0 = {"w": rng.standard_normal((5,)).astype(np.float32), "c": np.float32(0.5)}
    return a, b, x0


def _loss(p, a, b):
    r = a @ p["w"] + p["c"] - b
    return 0.5 * jnp.sum(r * r)


def _numpy_dpsgd(w_mix, a, b, x0, steps, lr):
    """Eq. 2 in float64: X_{k+1} = W X_k - lr * G(X_k), rows are workers, columns [w..., c]."""
    n = w_mix.shape[0]
    x = np.tile(np.concatenate([x0["w"], [x0["c"]]]).astype(np.float64), (n, 1))
    for _ in range(steps):
        r = np.einsum("nij,nj->ni", a, x[:, :-1]) + x[:, -1:] - b
        g = np.concatenate([np.einsum("nij,ni->nj", a, r), r.sum(1, keepdims=True)], axis=1)
        x = w_mix @ x - lr * g
    return x


def _run(alg, a, b, x0, n, steps, mesh=None):
    params = replicate(jax.tree.map(jnp.asarray, x0), n)
    state = jax.vmap(alg.init)(params)
    a, b = jnp.asarray(a), jnp.asarray(b)

    def one(p, s, ai, bi):
        return alg.step(p, jax.grad(_loss)(p, ai, bi), s)

    step = jax.jit(per_worker(one, mesh=mesh))
    if mesh is not None:
        put = lambda t: jax.device_put(t, NamedSharding(mesh, P("data")))
        params, state, a, b = put(params), put(state), put(a), put(b)
    for _ in range(steps):
        params, state = step(params, state, a, b)
    return params, state


def _as_matrix(params):
    return np.concatenate([np.asarray(params["w"]), np.asarray(params["c"])[:, None]], axis=1)


RANDOM_GRAPH = np.array(
    [
        [0, 1, 1, 0, 0, 0, 0, 1],
        [1, 0, 1, 1, 0, 0, 0, 0],
        [1, 1, 0, 0, 1, 0, 0, 0],
        [0, 1, 0, 0, 1, 1, 0, 0],
        [0, 0, 1, 1, 0, 0, 1, 0],
        [0, 0, 0, 1, 0, 0, 1, 1],
        [0, 0, 0, 0, 1, 1, 0, 1],
        [1, 0, 0, 0, 0, 1, 1, 0],
    ],
    dtype=bool,
)


def _metropolis(adj):
    deg = adj.sum(1)
    w = np.where(adj, 1.0 / (1 + np.maximum(deg[:, None], deg[None, :])), 0.0)
    return w + np.diag(1 - w.sum(1))


@pytest.mark.parametrize(
    "topo",
    [T.ring(N), T.torus(2, 4), T.exponential(N), T.from_matrix(_metropolis(RANDOM_GRAPH), name="metropolis")],
    ids=lambda t: t.name,
)
def test_dpsgd_matches_numpy_reference(topo):
    a, b, x0 = _least_squares(N)
    params, state = _run(dpsgd(topo, LR, axis_name="data"), a, b, x0, N, STEPS)
    ref = _numpy_dpsgd(topo.weights, a, b, x0, STEPS, LR)
    # float32 vs float64 over 4 steps of O(1) values: a few ulp of float32 per step.
    np.testing.assert_allclose(_as_matrix(params), ref, rtol=2e-5, atol=2e-5)
    assert np.all(np.asarray(state.step) == STEPS)


def test_simulation_loop_runs_dpsgd_like_numpy():
    """simulate_decentralized: one batch per round from the iterator, Eq. 2, records and losses per round."""
    a, b, x0 = _least_squares(N, seed=3)
    topo = T.ring(N)

    def loss_fn(p, model_state, batch, key):
        ai, bi = batch
        return _loss(p, ai, bi), (model_state, {"c": p["c"]})

    batches = iter([(a, b)] * STEPS)
    run = simulate_decentralized(
        dpsgd(topo, LR, axis_name="w"),
        loss_fn,
        jax.tree.map(jnp.asarray, x0),
        {},
        batches,
        STEPS,
        num_workers=N,
        key=jax.random.key(0),
        axis_name="w",
        record=lambda p, s: s.step,
    )
    np.testing.assert_allclose(
        _as_matrix(run["params"]), _numpy_dpsgd(topo.weights, a, b, x0, STEPS, LR), rtol=2e-5, atol=2e-5
    )
    assert run["loss"].shape == (STEPS, N) and run["metrics"]["c"].shape == (STEPS, N)
    np.testing.assert_array_equal(run["records"], np.tile(np.arange(1, STEPS + 1)[:, None], (1, N)))
    # Round 0's loss is every worker's at x0.
    r0 = np.einsum("nij,j->ni", a, x0["w"]) + x0["c"] - b
    np.testing.assert_allclose(run["loss"][0], 0.5 * (r0**2).sum(1), rtol=1e-5)
    assert [e["round"] for e in run["history"]] == [STEPS]
    with pytest.raises(TypeError, match="batches"):
        simulate_decentralized(dpsgd(topo, LR, axis_name="w"), loss_fn, x0, {}, [(a, b)], 1, num_workers=N, key=0)


def test_dpsgd_on_mesh_equals_vmap_and_preserves_the_average():
    a, b, x0 = _least_squares(N, seed=1)
    alg = dpsgd(T.ring(N), LR, axis_name="data")
    mesh = jax.make_mesh((N,), ("data",))
    on_mesh, _ = _run(alg, a, b, x0, N, 1, mesh=mesh)
    on_vmap, _ = _run(alg, a, b, x0, N, 1)
    np.testing.assert_allclose(_as_matrix(on_mesh), _as_matrix(on_vmap), rtol=1e-6, atol=1e-6)
    # 1^T W = 1^T: the average model moves by -lr * (average gradient), exactly (Lian et al. Eq. 4).
    x = np.tile(np.concatenate([x0["w"], [x0["c"]]]).astype(np.float64), (N, 1))
    r = np.einsum("nij,nj->ni", a, x[:, :-1]) + x[:, -1:] - b
    g = np.concatenate([np.einsum("nij,ni->nj", a, r), r.sum(1, keepdims=True)], axis=1)
    avg = average_model(on_vmap)
    np.testing.assert_allclose(np.concatenate([avg["w"], [avg["c"]]]), x.mean(0) - LR * g.mean(0), rtol=1e-5, atol=1e-5)


def test_consensus_distance_contracts_by_the_spectral_gap():
    # Without gradients (lr -> optimizer that does nothing) D-PSGD is gossip: x <- W x, and the
    # disagreement shrinks at least by (1 - gap)^2 per step (rho of Lian et al.).
    topo = T.ring(N)
    alg = dpsgd(topo, optax.set_to_zero(), axis_name="data")
    x = {"v": jnp.asarray(np.random.default_rng(2).standard_normal((N, 4)), jnp.float32)}
    state = jax.vmap(alg.init)(x)
    step = jax.jit(per_worker(alg.step))
    before = float(consensus_distance(x))
    x, state = step(x, x, state)
    after = float(consensus_distance(x))
    assert after <= topo.rho * before * (1 + 1e-5)
    assert after > 0


def test_topology_must_match_worker_count():
    alg = dpsgd(T.ring(4), LR, axis_name="data")
    x = {"v": jnp.zeros((N, 3))}
    state = jax.vmap(alg.init)(x)
    with pytest.raises(ValueError, match="topology 'ring' has 4 workers but the communicator has 8"):
        per_worker(alg.step)(x, x, state)


def test_per_worker_on_a_mesh_places_its_inputs():
    """Host arrays go in as they are: per_worker places them, so the library's own topology check
    is the error users see (not jax's in_specs mismatch), and a leading axis that is not the mesh
    size is refused by name (it would otherwise put several workers on one device)."""
    mesh = jax.make_mesh((N,), ("data",))
    alg = dpsgd(T.ring(4), LR, axis_name="data")
    x = {"v": np.zeros((N, 3), np.float32)}
    state = jax.vmap(alg.init)(x)
    with pytest.raises(ValueError, match="topology 'ring' has 4 workers but the communicator has 8"):
        per_worker(alg.step, mesh=mesh)(x, x, jax.tree.map(np.asarray, state))
    with pytest.raises(ValueError, match=r"leading worker axis of length 8.*\['v'\]|\['v'\].*length 8"):
        per_worker(lambda v: v, mesh=mesh)({"v": np.zeros((4, 3), np.float32)})
    # Unplaced host inputs give the same numbers as placed ones.
    a, b, x0 = _least_squares(N)
    ok = dpsgd(T.ring(N), LR, axis_name="data")
    params = replicate(jax.tree.map(jnp.asarray, x0), N)

    def one(p, s, ai, bi):
        return ok.step(p, jax.grad(_loss)(p, ai, bi), s)

    host = jax.tree.map(np.asarray, (params, jax.vmap(ok.init)(params)))
    got, _ = jax.jit(per_worker(one, mesh=mesh))(*host, a, b)  # placed inside jit too
    want, _ = _run(ok, a, b, x0, N, 1, mesh=mesh)
    np.testing.assert_array_equal(_as_matrix(got), _as_matrix(want))


def test_bad_arguments():
    with pytest.raises(TypeError, match="optimizer"):
        dpsgd(T.ring(4), "sgd", axis_name="data")
    with pytest.raises(ValueError, match="learning rate"):
        dpsgd(T.ring(4), -0.1, axis_name="data")
    with pytest.raises(ValueError, match="num_workers"):
        dpsgd("ring", 0.1, axis_name="data")
    with pytest.raises(ValueError, match="axis"):
        per_worker(lambda x: x, mesh=jax.make_mesh((N,), ("data",)), axis_name="model")
