"""DoubleSqueeze (Tang et al. 2019, Algorithm 1), its baselines and the scaled 1-bit compressor.

References are NumPy transcriptions of the algorithm; the compressors used for
exact comparisons are deterministic (scaled sign, none), so outputs must agree
to float32 rounding. Stochastic compressors are checked through an identity
that holds for every draw: nothing is lost (error feedback on both passes).
"""

import dataclasses
import functools

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

import jaxcomm as jc
from experiments.doublesqueeze.baselines import memsgd, qsgd_no_feedback, topk_no_feedback
from jaxcomm.comm import MeshAxis, use
from jaxcomm.compressors import scaled_sign
from jaxcomm.transforms import doublesqueeze

SHAPES = {"b": (6,), "w": (3, 5)}  # 6 and 15 entries: chunks of 4 workers need padding


def grads(num_workers, steps, seed=0):
    """g[t]: per-worker gradient trees stacked on a leading worker axis (float32)."""
    rng = np.random.default_rng(seed)
    return [
        {k: rng.standard_normal((num_workers, *s)).astype(np.float32) for k, s in SHAPES.items()} for _ in range(steps)
    ]


def init_stacked(tx, n):
    zeros = {k: jnp.zeros(s) for k, s in SHAPES.items()}
    return jax.tree.map(lambda x: jnp.broadcast_to(x, (n, *x.shape)), tx.init(zeros))


@functools.cache
def squeeze(server="replicated", server_compressor=None):
    """doublesqueeze(scaled_sign()) on axis "i", built once per configuration (compiled steps are reused)."""
    sc = None if server_compressor is None else jc.compressors.make(server_compressor)
    return doublesqueeze(scaled_sign(), axis_name="i", server=server, server_compressor=sc)


TRACES = {}  # tx -> number of times its vmapped step was traced


@functools.cache
def vmapped_step(tx):
    def step(g, s):
        TRACES[tx] = TRACES.get(tx, 0) + 1
        return tx.update(g, s)

    return jax.jit(jax.vmap(step, axis_name="i"))


def run(tx, g_all):
    n = next(iter(g_all[0].values())).shape[0]
    state, step, outs = init_stacked(tx, n), vmapped_step(tx), []
    for g in g_all:
        out, state = step(g, state)
        outs.append(jax.tree.map(np.asarray, out))
    return outs, state


# --------------------------------------------------------------------------- #
# NumPy reference
# --------------------------------------------------------------------------- #
def q_sign(v):
    """Q(v) = ||v||_2 / ||sign(v)||_2 * sign(v), sign(0) = +1 (one bit per entry)."""
    v = np.asarray(v, np.float64)
    return np.where(v < 0, -1.0, 1.0) * np.linalg.norm(v) / np.sqrt(v.size)


def chunked(Q, n):
    """Q applied to each of the n zero-padded chunks of ceil(d/n) entries (server='sharded')."""

    def apply(v):
        d = v.size
        c = -(-d // n)
        padded = np.zeros(n * c)
        padded[:d] = v.ravel()
        return np.concatenate([Q(padded[j * c : (j + 1) * c]) for j in range(n)])[:d].reshape(v.shape)

    return apply


def identity(v):
    return np.asarray(v, np.float64)


def doublesqueeze_numpy(g_all, Q, Q_server, worker_feedback=True):
    """Algorithm 1 of DoubleSqueeze on one leaf. g_all[t]: (n, ...). Returns outputs, δ_i, δ."""
    n = g_all[0].shape[0]
    delta_i = np.zeros(g_all[0].shape)
    delta = np.zeros(g_all[0].shape[1:])
    outs = []
    for g in g_all:
        v_i = g + delta_i if worker_feedback else g.astype(np.float64)
        q_i = np.stack([Q(v_i[i]) for i in range(n)])
        if worker_feedback:
            delta_i = v_i - q_i
        v = delta + q_i.mean(0)
        q = Q_server(v)
        delta = v - q
        outs.append(q)
    return outs, delta_i, delta


def check_against_numpy(outs, state, g_all, Q, Q_server, sharded, worker_feedback=True, server_state=True):
    n = g_all[0]["w"].shape[0]
    for k in SHAPES:
        ref, d_i, d = doublesqueeze_numpy([g[k] for g in g_all], Q, Q_server, worker_feedback)
        for t in range(len(g_all)):
            for i in range(n):  # every worker gets the same Q(v)
                np.testing.assert_allclose(outs[t][k][i], ref[t], rtol=2e-5, atol=2e-5, err_msg=f"{k} step {t}")
        worker_memory = state.worker.memory if server_state else state.memory
        np.testing.assert_allclose(np.asarray(worker_memory[k]), d_i, rtol=2e-5, atol=2e-5)
        if not server_state:
            continue
        server = np.asarray(state.server.memory[k])
        if sharded:
            # each worker holds the server error of the chunk it owns, zeros elsewhere
            c = -(-d.size // n)
            for i in range(n):
                owned = np.zeros(n * c, bool)
                owned[i * c : (i + 1) * c] = True
                owned = owned[: d.size].reshape(d.shape)
                assert not np.any(server[i][~owned])
            np.testing.assert_allclose(server.sum(0), d, rtol=2e-5, atol=2e-5)
        else:
            for i in range(n):  # identical on every worker
                np.testing.assert_allclose(server[i], d, rtol=2e-5, atol=2e-5)


# --------------------------------------------------------------------------- #
# Exactness
# --------------------------------------------------------------------------- #
@pytest.mark.parametrize("server", ["replicated", "sharded"])
def test_none_equals_sgd(server):
    # Quadratic per-worker losses f_i(x) = 0.5 x'A_i x - b_i'x: the trajectory depends on every step.
    n, lr, steps = 4, 0.1, 4
    rng = np.random.default_rng(1)
    A = rng.standard_normal((n, 6, 6)).astype(np.float32)
    A = np.einsum("nij,nkj->nik", A, A) / 6 + np.eye(6, dtype=np.float32)
    b = rng.standard_normal((n, 6)).astype(np.float32)
    tx = optax.chain(doublesqueeze(jc.compressors.none(), axis_name="i", server=server), optax.sgd(lr))

    def step(x, s, A, b):
        g = {"x": A @ x["x"] - b, "y": 2.0 * x["y"] - b[:3]}
        u, s = tx.update(g, s, x)
        return optax.apply_updates(x, u), s

    step = jax.jit(jax.vmap(step, axis_name="i"))
    x0 = {"x": np.ones(6, np.float32), "y": np.ones(3, np.float32)}
    x = jax.tree.map(lambda v: jnp.broadcast_to(v, (n, *v.shape)), x0)
    s = jax.tree.map(lambda v: jnp.broadcast_to(v, (n, *v.shape)), tx.init(x0))
    ref = {k: v.astype(np.float64) for k, v in x0.items()}
    for _ in range(steps):
        x, s = step(x, s, A, b)
        g = {
            "x": np.mean([A[i] @ ref["x"] - b[i] for i in range(n)], 0),
            "y": np.mean([2.0 * ref["y"] - b[i, :3] for i in range(n)], 0),
        }
        ref = {k: ref[k] - lr * g[k] for k in ref}
        for k in ref:
            np.testing.assert_allclose(np.asarray(x[k]), np.broadcast_to(ref[k], x[k].shape), rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("server", ["replicated", "sharded"])
def test_scaled_sign_matches_numpy(server):
    n = 4
    g_all = grads(n, steps=4, seed=2)
    outs, state = run(squeeze(server), g_all)
    Q = chunked(q_sign, n) if server == "sharded" else q_sign
    check_against_numpy(outs, state, g_all, Q, Q, sharded=server == "sharded")
    # exact wire volume: packed signs + a float32 scale per payload
    sign_bits = lambda d: 8 * -(-d // 8) + 32
    d = [int(np.prod(SHAPES[k])) for k in sorted(SHAPES)]  # jax.tree.leaves order of a dict
    worker_bits, server_bits = np.asarray(state.worker.wire_bits)[0], np.asarray(state.server.wire_bits)[0]
    if server == "replicated":
        assert worker_bits.tolist() == [sign_bits(x) for x in d]
        assert server_bits.tolist() == [0, 0]  # recomputed on every worker, nothing sent
    else:  # n - 1 chunk payloads to their owners, then the owned chunk to everyone
        c = [-(-x // n) for x in d]
        assert worker_bits.tolist() == [(n - 1) * sign_bits(x) for x in c]
        assert server_bits.tolist() == [sign_bits(x) for x in c]


def test_memsgd_and_uncompressed_server():
    n = 4
    g_all = grads(n, steps=3, seed=3)
    outs, state = run(memsgd(scaled_sign(), axis_name="i"), g_all)
    check_against_numpy(outs, state, g_all, q_sign, identity, sharded=False, server_state=False)
    # DoubleSqueeze whose server sends uncompressed is MEM-SGD (the server error stays 0).
    outs2, state2 = run(squeeze(server_compressor="none"), g_all)
    for a, b in zip(jax.tree.leaves(outs), jax.tree.leaves(outs2)):
        np.testing.assert_allclose(a, b, rtol=1e-6, atol=1e-6)
    assert all(not np.any(np.asarray(x)) for x in jax.tree.leaves(state2.server.memory))


# --------------------------------------------------------------------------- #
# Nothing lost, for any compressor (stochastic ones included)
# --------------------------------------------------------------------------- #
COMPRESSORS = {  # stochastic; error feedback needs them scaled into contractions (ω ≥ 1 here)
    "qsgd": lambda: jc.compressors.contractive(jc.compressors.make("qsgd", levels=2)),
    "terngrad": lambda: jc.compressors.contractive(jc.compressors.make("terngrad")),
}


@functools.cache
def _tx(name, server):
    return doublesqueeze(COMPRESSORS[name](), axis_name="i", server=server)


@functools.cache
def _stochastic_step():
    """One compiled step running DoubleSqueeze with QSGD (replicated) and TernGrad (sharded)."""
    txs = (_tx("qsgd", "replicated"), _tx("terngrad", "sharded"))
    return txs, jax.jit(jax.vmap(lambda g, s: tuple(zip(*[t.update(g, si) for t, si in zip(txs, s)])), axis_name="i"))


@settings(max_examples=3)
@given(seed=st.integers(0, 2**16))
def test_nothing_lost(seed):
    # Σ_t Q(v_t) + δ_T + (1/n) Σ_i δ_i,T = Σ_t (1/n) Σ_i g_i,t   (telescoping; exact in real arithmetic),
    # for stochastic worker and server compressors, whatever the draws.
    n, steps = 4, 3
    g_all = grads(n, steps, seed=seed)
    txs, step = _stochastic_step()
    states = tuple(init_stacked(t, n) for t in txs)
    outs = []
    for g in g_all:
        out, states = step(g, states)
        outs.append(jax.tree.map(np.asarray, out))
    for j, server in enumerate(("replicated", "sharded")):
        state = states[j]
        for k in SHAPES:
            per_worker = np.stack([o[j][k] for o in outs])  # (steps, n, ...)
            assert np.ptp(per_worker, axis=1).max() == 0  # Q(v) is the same on every worker
            sent = per_worker[:, 0].astype(np.float64).sum(0)
            server_error = np.asarray(state.server.memory[k], np.float64)
            if server == "sharded":
                server_error = server_error.sum(0)
            else:
                assert np.ptp(server_error, axis=0).max() == 0  # identical server error everywhere
                server_error = server_error[0]
            worker_error = np.asarray(state.worker.memory[k], np.float64).mean(0)
            total = sum(g[k].astype(np.float64).mean(0) for g in g_all)
            # float32 rounding of O(10) sums of O(1) terms
            np.testing.assert_allclose(sent + server_error + worker_error, total, atol=3e-5 * (1 + np.abs(total).max()))


# --------------------------------------------------------------------------- #
# Baselines without feedback
# --------------------------------------------------------------------------- #
def test_qsgd_no_feedback_support():
    # Identical gradients on every worker: each Q(g)_j ∈ {0, sign(g_j) ||g||} (levels=1), so
    # n·out_j / ||g|| is an integer in [0, n] times sign(g_j).
    n = 4
    g = np.random.default_rng(5).standard_normal(9).astype(np.float32)
    tx = qsgd_no_feedback(levels=1, axis_name="i")
    out, _ = jax.jit(jax.vmap(lambda x, s: tx.update(x, s), axis_name="i"))(
        jnp.broadcast_to(g, (n, 9)), init_stacked_single(tx, n, 9)
    )
    counts = np.asarray(out)[0] * n / np.linalg.norm(g) * np.sign(g)
    np.testing.assert_allclose(counts, np.round(counts), atol=1e-4)
    assert counts.min() > -1e-4 and counts.max() < n + 1e-4
    assert np.ptp(np.asarray(out), axis=0).max() == 0  # identical on every worker


def init_stacked_single(tx, n, d):
    return jax.tree.map(lambda x: jnp.broadcast_to(x, (n, *x.shape)), tx.init(jnp.zeros(d)))


def test_topk_no_feedback_matches_numpy():
    n, ratio = 4, 0.25
    g = np.random.default_rng(6).standard_normal((n, 16)).astype(np.float32)
    tx = topk_no_feedback(ratio, axis_name="i")
    out, state = jax.jit(jax.vmap(lambda x, s: tx.update(x, s), axis_name="i"))(
        jnp.asarray(g), init_stacked_single(tx, n, 16)
    )
    k = 4
    ref = np.zeros(16)
    for i in range(n):
        keep = np.argsort(-np.abs(g[i]))[:k]
        ref[keep] += g[i][keep] / n
    np.testing.assert_allclose(np.asarray(out)[0], ref, rtol=1e-6, atol=1e-6)
    assert not jax.tree.leaves(state.memory)  # no feedback: no memory


# --------------------------------------------------------------------------- #
# shard_map on 8 devices, any Communicator, tracing
# --------------------------------------------------------------------------- #
def test_shard_map_eight_devices():
    n = 8
    mesh = jax.make_mesh((n,), ("data",), devices=jax.devices()[:n])
    txs = [doublesqueeze(scaled_sign(), axis_name="data", server=s) for s in ("replicated", "sharded")]
    zeros = {k: jnp.zeros(s) for k, s in SHAPES.items()}
    put = lambda tree: jax.tree.map(lambda x: jax.device_put(x, NamedSharding(mesh, P("data"))), tree)
    states = put([jax.tree.map(lambda x: jnp.broadcast_to(x, (n, *x.shape)), t.init(zeros)) for t in txs])

    def body(g, states):
        g, states = jax.tree.map(lambda x: x[0], (g, states))
        res = [t.update(g, s) for t, s in zip(txs, states)]
        return jax.tree.map(lambda x: x[None], ([r[0] for r in res], [r[1] for r in res]))

    step = jax.jit(jax.shard_map(body, mesh=mesh, in_specs=P("data"), out_specs=P("data")))
    g_all = grads(n, steps=2, seed=8)
    outs = [[], []]
    for g in g_all:
        out, states = step(put(g), states)
        for j in range(2):
            outs[j].append(jax.tree.map(np.asarray, out[j]))
    states = jax.tree.map(np.asarray, states)
    check_against_numpy(outs[0], states[0], g_all, q_sign, q_sign, sharded=False)
    check_against_numpy(outs[1], states[1], g_all, chunked(q_sign, n), chunked(q_sign, n), sharded=True)


class RecordingComm:
    """A Communicator of our own: forwards to MeshAxis and records the collectives used."""

    capabilities = frozenset({"sum", "all_gather", "broadcast", "permute"})  # the collectives it forwards

    def __init__(self, axis):
        self.inner, self.calls = MeshAxis(axis), []

    size = property(lambda self: self.inner.size)

    def index(self):
        return self.inner.index()

    def _fwd(name):
        def method(self, *args, **kwargs):
            self.calls.append(name)
            return getattr(self.inner, name)(*args, **kwargs)

        return method

    sum, mean, all_gather, broadcast, permute, varying = (
        _fwd("sum"),
        _fwd("mean"),
        _fwd("all_gather"),
        _fwd("broadcast"),
        _fwd("permute"),
        _fwd("varying"),
    )


def test_any_communicator():
    # comm= takes any object implementing the Communicator protocol; every collective goes through it.
    n = 4
    g_all = grads(n, steps=1, seed=9)
    state = jax.eval_shape(lambda: init_stacked(squeeze(), n))
    for server, expected in (
        ("replicated", ["all_gather"]),  # every tensor's payload packed into one all-gather (fuse=True)
        ("sharded", ["permute"] * (n - 1) + ["all_gather"]),  # n - 1 all-to-all rounds, one all-gather
    ):
        comm = RecordingComm("i")
        tx = doublesqueeze(scaled_sign(), comm=comm, server=server)
        out, _ = jax.eval_shape(jax.vmap(tx.update, axis_name="i"), g_all[0], state)
        assert comm.calls == expected
        assert jax.tree.map(lambda x: x.shape, out) == {k: (n, *s) for k, s in SHAPES.items()}
    # the ambient communicator of jaxcomm.comm.use(...), as the trainer installs it: same numbers
    tx = doublesqueeze(scaled_sign())
    with use(RecordingComm("i")):
        out, _ = jax.jit(jax.vmap(lambda g, s: tx.update(g, s), axis_name="i"))(g_all[0], init_stacked(tx, n))
    ref, _ = run(squeeze(), g_all)
    for x, y in zip(jax.tree.leaves(out), jax.tree.leaves(ref[0])):
        np.testing.assert_array_equal(np.asarray(x), y)


def test_step_traces_once():
    # The jitted step of a transform is traced once, however many steps run (same shapes).
    tx = squeeze("sharded")
    for g_all in (grads(4, steps=3, seed=10), grads(4, steps=2, seed=11)):
        run(tx, g_all)
    assert TRACES[tx] == 1


# --------------------------------------------------------------------------- #
# Bad input
# --------------------------------------------------------------------------- #
class GatherOnly(RecordingComm):
    capabilities = frozenset({"all_gather"})


class SumOnly(RecordingComm):
    capabilities = frozenset({"sum"})


def test_strategy_the_communicator_cannot_serve():
    with pytest.raises(ValueError, match="allgather"):
        doublesqueeze(scaled_sign(), comm=SumOnly("i"))  # 1-bit payloads must be gathered
    with pytest.raises(ValueError, match="allreduce"):
        doublesqueeze(jc.compressors.none(), comm=GatherOnly("i"))
    with pytest.raises(ValueError, match="strategy"):
        doublesqueeze(dataclasses.replace(scaled_sign(), strategy="broadcast"), axis_name="i")

    def rounds(x, key, state, size):
        yield x

    multi = dataclasses.replace(jc.compressors.none(), rounds=rounds)
    with pytest.raises(ValueError, match="multi-round"):
        doublesqueeze(multi, axis_name="i")


def test_bad_arguments():
    with pytest.raises(TypeError, match="compressor"):
        doublesqueeze("scaled_sign", axis_name="i")
    with pytest.raises(ValueError, match="server"):
        doublesqueeze(scaled_sign(), axis_name="i", server="parameter-server")
    with pytest.raises(ValueError, match="stateless"):
        doublesqueeze(jc.compressors.make("signum"), axis_name="i", server="sharded")
    with pytest.raises(TypeError, match="memory"):
        doublesqueeze(scaled_sign(), axis_name="i", worker_memory="residual")
    with pytest.raises(ValueError, match="at most one"):
        doublesqueeze(scaled_sign(), axis_name="i", comm=MeshAxis("i"))


@pytest.mark.parametrize("server", ["replicated", "sharded"])
def test_mismatched_trees(server):
    tx = squeeze(server)
    state = jax.eval_shape(lambda: init_stacked(tx, 4))
    trace = lambda g: jax.eval_shape(jax.vmap(lambda g, s: tx.update(g, s), axis_name="i"), g, state)
    with pytest.raises(ValueError, match="tree"):
        trace({"w": jax.ShapeDtypeStruct((4, 3, 5), jnp.float32)})
    with pytest.raises(ValueError, match="shape"):
        trace({"b": jax.ShapeDtypeStruct((4, 6), jnp.float32), "w": jax.ShapeDtypeStruct((4, 5, 3), jnp.float32)})


# --------------------------------------------------------------------------- #
# The scaled 1-bit compressor itself
# --------------------------------------------------------------------------- #
@functools.cache
def _scaled_sign_roundtrip():
    c = scaled_sign()
    return jax.jit(lambda x: (c.decompress(c.compress(x)[0]), jc.wire_bits(c.compress(x)[0])))


@settings(max_examples=10)
@given(st.lists(st.floats(-1e30, 1e30, width=64), min_size=37, max_size=37), st.integers(-40, 30))
def test_scaled_sign_closed_form(values, exponent):
    # Q(x) = ||x||/sqrt(d) * sign(x) with sign(0) = +1; ||Q(x)|| = ||x||, also for tiny and huge entries.
    x = np.clip(np.asarray(values, np.float64) * 10.0**exponent, -3e38, 3e38)
    # XLA on CPU flushes subnormals to zero; keep every entry normal (or exactly zero) in float32.
    x = np.where(np.abs(x) < 1e-30, 0.0, x).astype(np.float32)
    y, bits = _scaled_sign_roundtrip()(jnp.asarray(x))
    y = np.asarray(y, np.float64)
    ref = q_sign(x)
    np.testing.assert_allclose(y, ref, rtol=1e-5, atol=1e-45)
    np.testing.assert_allclose(np.linalg.norm(y), np.linalg.norm(x.astype(np.float64)), rtol=1e-5, atol=1e-45)
    assert int(bits) == 8 * 5 + 32
