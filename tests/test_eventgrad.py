"""EventGraD (Eq. 3-6, Algorithm B): trigger, stale-copy mixing, message counts, top-K."""

import math

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

from jaxcomm import topology as T
from jaxcomm.algorithms import dpsgd, eventgrad, per_worker, replicate
from jaxcomm.algorithms._eventgrad import communication_stats, init_trigger, topk_count, trigger

pytestmark = pytest.mark.strict_promotion

N = 4
LR = 0.05


# --------------------------------------------------------------------------- #
# the threshold rule, by hand
# --------------------------------------------------------------------------- #
NORMS = [1.0, 1.5, 1.7, 2.6, 2.7, 2.75, 4.2]


def _run_trigger(rule, horizon):
    state = init_trigger(2)
    fires, checks, thresholds = [], [], []
    for k, norm in enumerate(NORMS):
        fire, check, state = trigger(
            jnp.float32(norm), state, k, horizon=horizon, forced_iterations=1, threshold_rule=rule
        )
        fires.append(bool(fire))
        checks.append(float(check))
        thresholds.append(float(state.threshold))
    return fires, checks, thresholds


def test_threshold_paper_rule_matches_hand_computed_sequence():
    # horizon 2, history 2 (zeros at start, mean over both entries), first iteration forced.
    # k=0: forced; slope (1.0-0)/1 = 1 -> slopes [0, 1], delta = 2 * 0.5 = 1.
    # k=1: |1.5-1| = .5 < 1;  k=2: .7 < 1;  k=3: 1.6 >= 1 -> slope 1.6/(4-1) = .5333 ->
    #      slopes [1, .5333], delta = 2 * .76667 = 1.53333.
    # k=4: .1, k=5: .15 < 1.5333;  k=6: |4.2-2.6| = 1.6 >= 1.5333 -> slope 1.6/3, delta = 2 * .5333.
    fires, checks, thresholds = _run_trigger("paper", 2.0)
    assert fires == [True, False, False, True, False, False, True]
    np.testing.assert_allclose(checks, [0, 1, 1, 1, 23 / 15, 23 / 15, 23 / 15], rtol=1e-6)
    np.testing.assert_allclose(thresholds, [1, 1, 1, 23 / 15, 23 / 15, 23 / 15, 16 / 15], rtol=1e-6)


def test_threshold_code_rule_matches_hand_computed_sequence():
    # The reference C++: delta <- delta * h before every check; delta <- mean slope on events.
    # h = .5.  k=0: check 0, forced; slope 1 -> [0, 1], delta .5.
    # k=1: check .25; |1.5-1| = .5 fires; slope .5/1 -> [1, .5], delta .75.
    # k=2: check .375; .2 quiet; delta .375.   k=3: check .1875; 1.1 fires; slope 1.1/2 = .55 -> delta .525.
    # k=4: check .2625; .1 quiet.   k=5: check .13125; .15 fires; slope .15/2 = .075 -> delta .3125.
    # k=6: check .15625; 1.45 fires; slope 1.45 -> delta .7625.
    fires, checks, thresholds = _run_trigger("code", 0.5)
    assert fires == [True, True, False, True, False, True, True]
    np.testing.assert_allclose(checks, [0, 0.25, 0.375, 0.1875, 0.2625, 0.13125, 0.15625], rtol=1e-6)
    np.testing.assert_allclose(thresholds, [0.5, 0.75, 0.375, 0.525, 0.2625, 0.3125, 0.7625], rtol=1e-6)


def test_rules_agree_at_horizon_one():
    # h = 1: the code's per-iteration multiply is the identity, so both rules are the paper's.
    assert _run_trigger("paper", 1.0) == _run_trigger("code", 1.0)


# --------------------------------------------------------------------------- #
# the algorithm on a vmap axis
# --------------------------------------------------------------------------- #
def _problem(n=N, seed=0):
    rng = np.random.default_rng(seed)
    a = jnp.asarray(rng.standard_normal((n, 8, 6)), jnp.float32)
    b = jnp.asarray(rng.standard_normal((n, 8)), jnp.float32)
    x0 = {
        "w": jnp.asarray(rng.standard_normal((6, 3)), jnp.float32),
        "v": jnp.asarray(rng.standard_normal((3,)), jnp.float32),
    }
    return a, b, x0


def _loss(p, a, b):
    return 0.5 * jnp.sum((jnp.tanh(a @ p["w"]) @ p["v"] - b) ** 2)


def _trajectory(alg, steps, n=N, seed=0, record=False, mesh=None):
    a, b, x0 = _problem(n, seed)
    params = replicate(x0, n)
    state = jax.vmap(alg.init)(params)

    def one(p, s, ai, bi):
        return alg.step(p, jax.grad(_loss)(p, ai, bi), s)

    step = jax.jit(per_worker(one, mesh=mesh))
    if mesh is not None:
        put = lambda t: jax.device_put(t, NamedSharding(mesh, P("data")))
        params, state, a, b = put(params), put(state), put(a), put(b)
    history = []
    for _ in range(steps):
        if record:
            history.append((params, state))
        params, state = step(params, state, a, b)
    return params, state, history


@pytest.mark.parametrize("rule", ["paper", "code"])
def test_zero_horizon_is_dpsgd_exactly(rule):
    steps = 6
    ref, _, _ = _trajectory(dpsgd(T.ring(N), LR, axis_name="data"), steps)
    got, state, _ = _trajectory(
        eventgrad(T.ring(N), LR, horizon=0.0, forced_iterations=0, threshold_rule=rule, axis_name="data"), steps
    )
    for x, y in zip(jax.tree.leaves(got), jax.tree.leaves(ref)):
        np.testing.assert_array_equal(np.asarray(x), np.asarray(y))
    stats = communication_stats(state, T.ring(N))
    assert stats["percent_messages"] == 100.0 and stats["messages"] == steps * 2 * N * 2


def test_eq5_mixing_with_last_received_copies_and_message_count():
    """Replay the recorded events through a NumPy Eq. 5 and recount the messages."""
    topo = T.ring(N)
    alg = eventgrad(topo, LR, horizon=1.0, forced_iterations=2, axis_name="data")
    steps = 10
    params, state, hist = _trajectory(alg, steps, record=True)
    a, b, _ = _problem()
    grad = jax.vmap(jax.grad(_loss))
    names = ["v", "w"]  # jax.tree.leaves order of the dict
    copies = dict.fromkeys(names)  # copies[k][i] = what i's neighbours hold of worker i
    fired_total = 0
    for t, (p, _) in enumerate(hist):
        nxt = hist[t + 1][1] if t + 1 < steps else state
        g = grad(p, a, b)
        for k in names:
            x = np.asarray(p[k], np.float64)
            fired = np.asarray(nxt.fired[k])
            fired_total += int(fired.sum())
            if copies[k] is None:
                copies[k] = x.copy()
            copies[k][fired] = x[fired]
            # Eq. 5: own current value + stale copies of the neighbours.
            mixed = (x + copies[k][np.roll(np.arange(N), 1)] + copies[k][np.roll(np.arange(N), -1)]) / 3
            expected = mixed - LR * np.asarray(g[k], np.float64)
            got = np.asarray(hist[t + 1][0][k] if t + 1 < steps else params[k])
            np.testing.assert_allclose(got, expected, rtol=1e-5, atol=1e-6)
        # The trigger saw ||x|| of the un-mixed parameters.
        np.testing.assert_allclose(
            np.asarray(nxt.norm["w"]), np.linalg.norm(np.asarray(p["w"]).reshape(N, -1), axis=1), rtol=1e-6
        )
    stats = alg.stats(state)
    assert fired_total == stats["events"] == sum(int(np.sum(e)) for e in jax.tree.leaves(state.events))
    assert stats["messages"] == 2 * fired_total  # +2 per tensor event on a ring
    assert stats["regular_messages"] == steps * 2 * N * 2
    assert stats["percent_messages"] == pytest.approx(100 * 2 * fired_total / (steps * 2 * N * 2))
    assert 2 * N * 2 <= fired_total < steps * 2 * N  # forced iterations fire; later some stay quiet


def test_topk_receivers_hold_the_senders_mirror_and_count_2k():
    topo = T.ring(N)
    alg = eventgrad(topo, LR, horizon=0.5, forced_iterations=1, topk=0.25, axis_name="data")
    params, state, _ = _trajectory(alg, 6)
    # Invariant: slot k of worker i is exactly sent_copy of src_k(i) (scatter on both ends).
    for k in range(topo.num_permutations):
        src = topo.sources(k)
        for leaf_rep, leaf_sent in zip(jax.tree.leaves(state.replicas), jax.tree.leaves(state.sent_copy)):
            np.testing.assert_array_equal(np.asarray(leaf_rep)[:, k], np.asarray(leaf_sent)[src])
    # The copies are not the full tensors: only top-K entries travelled.
    assert not np.allclose(np.asarray(state.sent_copy["w"]), np.asarray(params["w"]))
    stats = alg.stats(state)
    cost = {"v": 2 * topk_count(3, 0.25), "w": 2 * topk_count(18, 0.25)}
    assert topk_count(18, 0.25) == math.ceil(4.5) == 5
    expected = sum(2 * int(np.sum(state.events[k])) * cost[k] for k in cost)
    assert stats["elements_sent"] == expected and stats["bytes_sent"] == 4 * expected
    assert stats["percent_communication"] < stats["percent_messages"]


def test_topk_of_everything_at_zero_horizon_is_dpsgd():
    ref, _, _ = _trajectory(dpsgd(T.ring(N), LR, axis_name="data"), 4)
    got, _, _ = _trajectory(eventgrad(T.ring(N), LR, horizon=0.0, forced_iterations=0, topk=1.0, axis_name="data"), 4)
    for x, y in zip(jax.tree.leaves(got), jax.tree.leaves(ref)):
        np.testing.assert_allclose(np.asarray(x), np.asarray(y), rtol=1e-6, atol=1e-7)


def test_mesh_backend_equals_vmap_on_a_torus():
    topo = T.torus(2, 4)
    alg = eventgrad(topo, LR, horizon=1.0, forced_iterations=1, axis_name="data")
    mesh = jax.make_mesh((8,), ("data",))
    p_mesh, s_mesh, _ = _trajectory(alg, 4, n=8, mesh=mesh)
    p_vmap, s_vmap, _ = _trajectory(alg, 4, n=8)
    for x, y in zip(jax.tree.leaves(p_mesh), jax.tree.leaves(p_vmap)):
        np.testing.assert_allclose(np.asarray(x), np.asarray(y), rtol=1e-5, atol=1e-6)
    assert alg.stats(s_mesh)["messages"] == alg.stats(s_vmap)["messages"]
    # torus(2x4): 3 neighbours, so 3 messages per event.
    assert alg.stats(s_mesh)["messages"] == 3 * alg.stats(s_mesh)["events"]


def test_bad_arguments_and_mismatched_topology():
    topo = T.ring(N)
    with pytest.raises(ValueError, match="horizon"):
        eventgrad(topo, LR, horizon=-1.0)
    with pytest.raises(ValueError, match="history"):
        eventgrad(topo, LR, history=0)
    with pytest.raises(ValueError, match="topk"):
        eventgrad(topo, LR, topk=1.5)
    with pytest.raises(ValueError, match="topk"):
        eventgrad(topo, LR, topk=0.0)
    with pytest.raises(ValueError, match="threshold_rule"):
        eventgrad(topo, LR, threshold_rule="both")
    with pytest.raises(TypeError, match="forced_iterations"):
        eventgrad(topo, LR, forced_iterations=2.5)
    alg = eventgrad(T.ring(8), LR, axis_name="data")
    x = {"v": jnp.zeros((N, 3))}
    with pytest.raises(ValueError, match="topology 'ring' has 8 workers but the communicator has 4"):
        per_worker(alg.step)(x, x, jax.vmap(alg.init)(x))
    with pytest.raises(TypeError, match="floating"):
        alg.init({"v": jnp.zeros(3, jnp.int32)})


# --------------------------------------------------------------------------- #
# the experiment (smoke configuration: digits, 4 workers, 12 iterations)
# --------------------------------------------------------------------------- #
def test_eventgrad_experiment_smoke(tmp_path):
    import json

    from jaxcomm.studies import get_experiment, write_results

    exp = get_experiment("eventgrad")
    cfg = exp.config(smoke=True)
    results = exp.run(cfg, tmp_path)
    write_results(tmp_path, results)
    assert json.loads((tmp_path / "results.json").read_text())["config"]["tasks"] == ["digits_cnn"]
    runs = {r["algorithm"]: r for r in results["runs"]}
    assert set(runs) == {"dpsgd", "eventgrad", "eventgrad_topk"}
    assert runs["dpsgd"]["percent_messages"] == 100.0
    # The forced iterations (3 of 12) fire every tensor; after them some stay quiet.
    assert 25.0 <= runs["eventgrad"]["percent_messages"] < 100.0
    # Top-10 %: an event costs 2 * ceil(0.1 n) numbers of n, so communication < messages.
    assert runs["eventgrad_topk"]["percent_communication"] < 0.3 * runs["eventgrad_topk"]["percent_messages"]
    # 300 test examples: chance is 10 % with sd sqrt(.1 * .9 / 300) = 1.7 %; 15 % is ~3 sd above it.
    assert all(r["accuracy"] > 15.0 for r in runs.values())
    (t1,), (t2,) = results["table1"], results["table2"]
    assert t1["workers"] == 4 and "regular_accuracy" in t1 and "percent_communication" in t2
    trace = results["traces"]["digits_cnn"]["trace"]
    assert len(trace["tensors"]) == 4 and all(len(v) == 12 for v in trace["norm"])
    assert all(f[0] is True for f in trace["fired"])  # the first iteration always fires (flags as bools)
    for png in ("norms_events_digits_cnn.png", "thresholds_digits_cnn.png", "tables.png"):
        assert (tmp_path / png).stat().st_size > 0
