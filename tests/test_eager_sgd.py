"""eager-SGD mesh simulation (jaxcomm.algorithms.eager_sgd) against a NumPy reference and closed forms."""

import functools
import importlib

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from flax import nnx
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

import jaxcomm.imbalance as im
from jaxcomm.comm import MeshAxis

# The package re-exports the *function* eager_sgd under the module's name; take the module.
es = importlib.import_module("jaxcomm.algorithms._eager_sgd")

AXIS = "w"


def run_rounds(config, grads, key=0):
    """Apply ``partial_allreduce`` for ``T`` rounds on ``P`` vmapped workers.

    ``grads``: ``[P, T, n]``. Returns per-round ``mean [P, T, n]``, ``nap [P, T]``,
    ``active [P, T]``, ``clock [P, T]`` and the final ``undelivered [P, n]``.
    """
    comm = MeshAxis(AXIS)

    def worker(gs):
        state = es.init_eager_state(gs[0], config, key)

        def body(st, g):
            mean, st = es.partial_allreduce(g, st, config, comm)
            return st, (mean, st.nap, st.active, st.clock_ms)

        state, outs = jax.lax.scan(body, state, gs)
        return outs, es.undelivered(state), state.overflows

    (mean, nap, active, clock), rest, overflows = jax.jit(jax.vmap(worker, axis_name=AXIS))(grads)
    return [np.asarray(a) for a in (mean, nap, active, clock, rest, overflows)]


def reference(config, grads, key=0):
    """The partial-allreduce protocol in plain NumPy (module docstring of eager_sgd)."""
    p, t_steps, _ = grads.shape
    means, naps, actives, clocks = [], [], [], []
    # float32 like the simulation, so that ties between arrivals break the same way.
    f32 = np.float32
    if config.clock == "reset":
        buffer = np.zeros_like(grads[:, 0])
        clock = f32(0.0)
    else:
        ready = np.zeros(p, f32)
        fifo = [dict() for _ in range(p)]  # slot -> (arrival, vector)
    for t in range(t_steps):
        times, init = (np.asarray(a) for a in es.round_draws(config, jax.random.key(key), t))
        times = times.astype(f32)
        sync = config.mode == "sync" or (config.sync_every and (t + 1) % config.sync_every == 0)
        arrive = times if config.clock == "reset" else ready + times
        trig = (
            arrive.max()
            if sync
            else {"solo": arrive.min(), "majority": arrive[init], "sync": arrive.max()}[config.mode]
        )
        active = arrive <= trig
        if config.clock == "reset":
            contrib = buffer + active[:, None] * grads[:, t]
            buffer = np.where(active[:, None], 0.0, grads[:, t])
            clock = f32(clock + trig) + f32(config.comm_ms)
        else:
            contrib = np.zeros_like(grads[:, 0])
            for i in range(p):
                slot = t % config.max_lag
                vec = grads[i, t].copy()
                if slot in fifo[i]:  # the oldest pending gradient: merged into the newest
                    vec += fifo[i].pop(slot)[1]
                fifo[i][slot] = (arrive[i], vec)
                for s in [s for s, (a, _) in fifo[i].items() if a <= trig]:
                    contrib[i] += fifo[i].pop(s)[1]
            clock = f32(trig + f32(config.comm_ms))
            ready = np.maximum(arrive, clock)
        means.append(contrib.sum(0) / p)
        naps.append(active.sum())
        actives.append(active)
        clocks.append(clock)
    return np.array(means), np.array(naps), np.array(actives), np.array(clocks)


def one_hot_grads(p, t_steps):
    """Gradient of worker i at step t: the unit vector e_{i*T + t} (a distinct code per gradient)."""
    g = np.zeros((p, t_steps, p * t_steps), np.float32)
    for i in range(p):
        for t in range(t_steps):
            g[i, t, i * t_steps + t] = 1.0
    return g


CONFIGS = [
    (mode, clock, model)
    for clock, model in (("reset", "random"), ("carry", "rotating"))
    for mode in ("sync", "solo", "majority")
]


@functools.cache
def config_for(mode, clock, model, sync_every=0, max_lag=4):
    # Levels 8, 16, 24, 32 ms are exact in binary: arrival ties are exact in both float widths.
    imb = im.RandomDelay(4, 1, 30.0, base_ms=10.0) if model == "random" else im.RotatingSkew(4, 8.0, 32.0)
    return es.EagerSGDConfig(mode, imb, clock=clock, comm_ms=0.5, sync_every=sync_every, max_lag=max_lag)


@pytest.mark.parametrize("mode, clock, model", CONFIGS)
def test_exactly_once_identical_and_matches_reference(mode, clock, model):
    config = config_for(mode, clock, model)
    p, t_steps = 4, 12
    grads = one_hot_grads(p, t_steps)
    mean, nap, active, clock_ms, rest, _ = run_rounds(config, grads)
    # The result of every round is the same on every worker (Lemma 6.1, safety).
    np.testing.assert_array_equal(mean, np.broadcast_to(mean[:1], mean.shape))
    # Exactly once: P * sum of the results + what is left in the buffers = every gradient once.
    delivered = p * mean[0].sum(0) + rest.sum(0)
    np.testing.assert_allclose(delivered, np.ones(p * t_steps), atol=1e-6)
    # Each round holds whole gradients only, and the fresh ones are exactly the active workers'.
    counts = np.rint(p * mean[0]).astype(int)
    assert set(np.unique(counts)) <= {0, 1}
    for t in range(t_steps):
        fresh = counts[t].reshape(p, t_steps)[:, t].astype(bool)
        np.testing.assert_array_equal(fresh, active[:, t])
        assert nap[0, t] == fresh.sum() >= 1
        assert not counts[t].reshape(p, t_steps)[:, t + 1 :].any()  # nothing from the future
    # Same numbers as the NumPy reference of the protocol.
    ref_mean, ref_nap, ref_active, ref_clock = reference(config, grads)
    np.testing.assert_allclose(mean[0], ref_mean, atol=1e-6)
    np.testing.assert_array_equal(nap[0], ref_nap)
    np.testing.assert_array_equal(active.T, ref_active)
    np.testing.assert_allclose(clock_ms[0], ref_clock, rtol=1e-5)


@pytest.mark.parametrize("mode, clock, model", CONFIGS)
def test_staleness_profile_matches_the_reference_deliveries(mode, clock, model):
    config = config_for(mode, clock, model)
    p, t_steps = 4, 12
    profile = es.staleness_profile(config, t_steps, key=0)
    # Expected: from the NumPy reference's deliveries of the coded gradients e_{i*T+t}.
    ref_mean, ref_nap, _, ref_clock = reference(config, one_hot_grads(p, t_steps))
    counts = np.rint(p * ref_mean).astype(int)  # [round s, code i*T + t]
    expected = np.zeros(t_steps)
    for s in range(t_steps):
        for code in np.nonzero(counts[s])[0]:
            expected[s - code % t_steps] += counts[s, code]
    np.testing.assert_array_equal(np.asarray(profile.counts), expected)
    np.testing.assert_array_equal(np.asarray(profile.delivered), counts.sum(1))
    np.testing.assert_array_equal(np.asarray(profile.nap), ref_nap)
    np.testing.assert_allclose(np.asarray(profile.clock_ms), ref_clock, rtol=1e-5)
    # Fresh gradients are the active workers'; every gradient is delivered once or still pending.
    assert profile.counts[0] == ref_nap.sum()
    assert float(profile.counts.sum() + profile.undelivered) == p * t_steps
    summary = profile.summary()
    assert type(summary["undelivered"]) is int and summary["undelivered"] == float(profile.undelivered)
    assert summary["fresh_fraction"] == pytest.approx(ref_nap.sum() / expected.sum())
    assert summary["mean_staleness"] == pytest.approx((np.arange(t_steps) * expected).sum() / expected.sum())
    assert summary["round_ms"] == pytest.approx(ref_clock[-1] / t_steps, rel=1e-5)
    assert summary["delivered_std"] == pytest.approx(np.std(counts.sum(1)))
    if mode == "sync":
        assert summary["max_staleness"] == 0 and summary["undelivered"] == 0


@pytest.mark.parametrize("mode", ["solo", "majority"])
def test_staleness_profile_reset_clock_closed_form(mode):
    # With the reset clock a late gradient waits exactly one round: counts[1] is every
    # inactive worker's gradient except the last round's, which is still in the buffer.
    p, t_steps = 8, 64
    config = es.EagerSGDConfig(mode, im.RandomDelay(p, 3, 100.0, base_ms=10.0), clock="reset")
    profile = es.staleness_profile(config, t_steps, key=3)
    nap = np.asarray(profile.nap)
    assert profile.counts[0] == nap.sum()
    assert profile.counts[1] == p * (t_steps - 1) - nap[:-1].sum()
    assert not np.asarray(profile.counts[2:]).any()
    assert profile.undelivered == p - nap[-1]
    with pytest.raises(ValueError, match="rounds must be >= 1; got 0"):
        es.staleness_profile(config, 0, key=3)


def test_sync_mode_is_the_ordinary_mean():
    config = config_for("sync", "reset", "random")
    grads = np.random.default_rng(0).standard_normal((4, 5, 7)).astype(np.float32)
    mean, nap, *_ = run_rounds(config, grads)
    np.testing.assert_allclose(mean[0], grads.mean(0), rtol=1e-6, atol=1e-6)
    assert np.all(nap == 4)


def test_linear_skew_nap_and_clock_closed_forms():
    # Sec. 7.1: linear skew 1..P ms. Solo: only the first worker is active (NAP = 1), a round
    # takes 1 ms. Majority: NAP = initiator + 1 with the initiator uniform on 0..P-1, so
    # E[NAP] = (P+1)/2 with variance (P^2-1)/12; over T rounds the mean's sd is
    # sqrt((P^2-1)/(12 T)) = 0.115 for P=8, T=400; we allow 4 sd. Sync: P ms per round.
    p, t_steps = 8, 400
    grads = np.zeros((p, t_steps, 1), np.float32)
    skew = im.LinearSkew(p)
    out = {m: run_rounds(es.EagerSGDConfig(m, skew), grads, key=3) for m in ("solo", "majority", "sync")}
    assert np.all(out["solo"][1] == 1)
    np.testing.assert_allclose(out["solo"][3][0, -1], t_steps * 1.0)
    np.testing.assert_allclose(out["sync"][3][0, -1], t_steps * float(p))
    nap = out["majority"][1][0]
    assert abs(nap.mean() - (p + 1) / 2) < 4 * np.sqrt((p * p - 1) / (12 * t_steps))
    inits = np.array(
        [int(es.round_draws(es.EagerSGDConfig("majority", skew), jax.random.key(3), t)[1]) for t in range(20)]
    )
    np.testing.assert_array_equal(nap[:20], inits + 1)
    # Majority's round takes the initiator's time: (initiator + 1) ms.
    np.testing.assert_allclose(out["majority"][3][0, -1], nap.sum(), rtol=1e-6)


def test_carry_clock_solo_is_free_running():
    # With the carried clock and no communication cost, solo never makes anyone wait, so each
    # worker runs on its own cumulative compute time and round t ends at the first arrival:
    # clock_t = min_i sum_{s <= t} c_i(s).
    config = es.EagerSGDConfig("solo", im.RandomDelay(4, 1, 30.0, base_ms=10.0), clock="carry", max_lag=16)
    t_steps = 20
    _, _, _, clock_ms, _, overflows = run_rounds(config, np.zeros((4, t_steps, 1), np.float32))
    times = np.stack([np.asarray(es.round_draws(config, jax.random.key(0), t)[0]) for t in range(t_steps)])
    np.testing.assert_allclose(clock_ms[0], np.cumsum(times, 0).min(1), rtol=1e-6)
    assert overflows.max() == 0


def test_fifo_overflow_merges_and_still_delivers_exactly_once():
    # A worker permanently 10x slower lags more rounds than the FIFO holds.
    config = es.EagerSGDConfig("solo", im.EmpiricalTimes(3, [[1.0, 1.0, 10.0]]), clock="carry", max_lag=2)
    grads = one_hot_grads(3, 10)
    mean, _, _, _, rest, overflows = run_rounds(config, grads)
    assert overflows[2] > 0 and overflows[0] == 0
    np.testing.assert_allclose(3 * mean[0].sum(0) + rest.sum(0), np.ones(30), atol=1e-6)
    ref_mean = reference(config, grads)[0]
    np.testing.assert_allclose(mean[0], ref_mean, atol=1e-6)


def test_sync_every_bounds_staleness():
    # Every 3rd round is synchronous: it flushes every buffer, so gradient (i, s) is delivered
    # in a round t with s <= t <= s + 2 (Lemma 6.1's staleness bound, tau = N - 1).
    config = config_for("solo", "carry", "rotating", sync_every=3, max_lag=8)
    p, t_steps = 4, 12
    mean, nap, *_ = run_rounds(config, one_hot_grads(p, t_steps))
    counts = np.rint(p * mean[0]).astype(int)
    for t in range(t_steps):
        for idx in np.nonzero(counts[t])[0]:
            s = idx % t_steps
            assert s <= t <= s + 2
        if (t + 1) % 3 == 0:
            assert nap[0, t] == p


def test_runs_inside_shard_map_like_under_vmap():
    devices = jax.devices()[:4]
    mesh = jax.make_mesh((4,), (AXIS,), devices=devices)
    config = config_for("majority", "carry", "random")
    grads = np.random.default_rng(1).standard_normal((4, 6, 5)).astype(np.float32)
    comm = MeshAxis(AXIS)

    def worker(gs):
        gs = gs[0]
        state = es.init_eager_state(gs[0], config, 0, comm=comm)

        def body(st, g):
            mean, st = es.partial_allreduce(g, st, config, comm)
            return st, mean

        _, means = jax.lax.scan(body, state, gs)
        return means[None]

    f = jax.jit(jax.shard_map(worker, mesh=mesh, in_specs=P(AXIS), out_specs=P(AXIS)))
    out = np.asarray(f(jax.device_put(grads, NamedSharding(mesh, P(AXIS)))))
    np.testing.assert_allclose(out, run_rounds(config, grads)[0], atol=1e-6)


def test_optax_transform_chains_and_sync_equals_data_parallel_sgd():
    skew = im.LinearSkew(4)
    params = {"w": jnp.ones((3,)), "b": jnp.zeros(())}
    grads = {"w": jnp.arange(12.0).reshape(4, 3), "b": jnp.arange(4.0)}

    def worker(g, mode):
        tx = optax.chain(es.eager_sgd(mode, skew, axis_name=AXIS), optax.sgd(0.5))
        state = tx.init(params)
        upd, state = tx.update(g, state, params)
        return optax.apply_updates(params, upd), state[0]

    new, st = jax.jit(jax.vmap(functools.partial(worker, mode="sync"), axis_name=AXIS))(grads)
    np.testing.assert_allclose(new["w"][0], 1.0 - 0.5 * grads["w"].mean(0))
    np.testing.assert_allclose(new["b"][0], -0.5 * grads["b"].mean())
    new, st = jax.jit(jax.vmap(functools.partial(worker, mode="solo"), axis_name=AXIS))(grads)
    # Solo, linear skew, empty buffers: only worker 0's gradient, divided by P (not by NAP).
    np.testing.assert_allclose(new["w"][0], 1.0 - 0.5 * grads["w"][0] / 4)
    assert int(st.nap[0]) == 1 and bool(st.active[0]) and not bool(st.active[1])


class TinyMLP(nnx.Module):
    def __init__(self, rngs):
        self.l1 = nnx.Linear(6, 16, rngs=rngs)
        self.l2 = nnx.Linear(16, 3, rngs=rngs)

    def __call__(self, x, deterministic=None):
        return self.l2(jax.nn.relu(self.l1(x)))


def test_simulate_training_tiny_mlp():
    rng = np.random.default_rng(0)
    centers = rng.standard_normal((3, 6)) * 3
    y = rng.integers(0, 3, 512).astype(np.int32)
    x = (centers[y] + rng.standard_normal((512, 6))).astype(np.float32)

    def loss_fn(m, xb, yb):
        return optax.softmax_cross_entropy_with_integer_labels(m(xb), yb).mean()

    def evaluate(m):
        return {"acc": float(jnp.mean(jnp.argmax(m(x), -1) == y))}

    skew = im.RotatingSkew(4, 50.0, 400.0)
    seen = []
    r = es.simulate_training(
        TinyMLP(nnx.Rngs(0)),
        loss_fn,
        x,
        y,
        mode="majority",
        imbalance=skew,
        batch_per_worker=16,
        epochs=2,
        optimizer=optax.sgd(0.1),
        key=0,
        clock="carry",
        eval_fn=evaluate,
        progress=True,
        on_eval=seen.append,
    )
    assert seen == r["history"]  # every entry, as soon as it was made
    assert r["steps_per_epoch"] == 8 and len(r["nap"]) == 16 and len(r["history"]) == 2
    assert r["history"][-1]["acc"] > 0.9  # well-separated clusters
    assert r["loss"][-1] < r["loss"][0]
    assert min(r["nap"]) >= 1 and max(r["nap"]) <= 4
    # Synchronous SGD would take 16 rounds x 400 ms (the slowest worker every round);
    # majority waits for a random initiator only.
    assert r["history"][-1]["sim_time_s"] < 16 * 0.4
    # The collective's key is split(key)[0]: the staleness profile replays this run's rounds.
    config = es.EagerSGDConfig("majority", skew, clock="carry")
    profile = es.staleness_profile(config, 16, jax.random.split(jax.random.key(0))[0])
    np.testing.assert_array_equal(np.asarray(profile.nap), r["nap"])
    np.testing.assert_allclose(np.asarray(profile.clock_ms), r["clock_ms"], rtol=1e-6)


def test_flush_delivers_the_rest():
    config = config_for("solo", "carry", "random")
    comm = MeshAxis(AXIS)
    grads = one_hot_grads(4, 6)

    def worker(gs):
        state = es.init_eager_state(gs[0], config, 0)

        def body(st, g):
            mean, st = es.partial_allreduce(g, st, config, comm)
            return st, mean

        state, means = jax.lax.scan(body, state, gs)
        last, state = es.flush(state, comm)
        return means, last, es.undelivered(state)

    means, last, rest = jax.jit(jax.vmap(worker, axis_name=AXIS))(grads)
    np.testing.assert_allclose(4 * (np.asarray(means[0]).sum(0) + np.asarray(last[0])), np.ones(24), atol=1e-6)
    assert not np.asarray(rest).any()


@pytest.mark.parametrize(
    "build, error, match",
    [
        (lambda: es.EagerSGDConfig("fast", im.LinearSkew(2)), ValueError, "mode"),
        (lambda: es.EagerSGDConfig("solo", im.LinearSkew(2), clock="wall"), ValueError, "clock"),
        (lambda: es.EagerSGDConfig("solo", "skew"), TypeError, "imbalance"),
        (lambda: es.EagerSGDConfig("solo", im.LinearSkew(2), comm_ms=-1.0), ValueError, "comm_ms"),
        (lambda: es.EagerSGDConfig("solo", im.LinearSkew(2), max_lag=0), ValueError, "max_lag"),
        (lambda: es.EagerSGDConfig("solo", im.LinearSkew(2), sync_every=-2), ValueError, "sync_every"),
        (
            lambda: es.init_eager_state(jnp.zeros(2), es.EagerSGDConfig("solo", im.LinearSkew(2)), "seed"),
            TypeError,
            "key",
        ),
    ],
)
def test_bad_input(build, error, match):
    with pytest.raises(error, match=match):
        build()


def test_communicator_size_must_match_the_model():
    config = es.EagerSGDConfig("solo", im.LinearSkew(3))

    def worker(g):
        return es.partial_allreduce(g, es.init_eager_state(g, config, 0), config, MeshAxis(AXIS))[0]

    with pytest.raises(ValueError, match="num_workers=3"):
        jax.vmap(worker, axis_name=AXIS)(jnp.zeros((4, 2)))
