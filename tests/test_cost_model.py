"""Tests of jaxcomm.cost_model: closed forms (Thakur, Rabenseifner & Gropp 2005), identities
between collectives, monotonicity, p = 1, traced inputs, and bad input."""

from __future__ import annotations

import math

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

import jaxcomm as jc
import jaxcomm.cost_model as cm

pytestmark = pytest.mark.strict_promotion

NET = cm.Network(10.0, 25e-6)  # B = 1e10 bit/s, α = 25 µs
bits_st = st.floats(0, 1e10, allow_nan=False)
workers_st = st.integers(1, 64)
net_st = st.builds(cm.Network, st.floats(0.1, 400), st.floats(0, 1e-3))


def test_closed_forms_by_hand():
    # p = 4, n = 1e6 bits, α = 25e-6 s, 1/B = 1e-10 s/bit
    assert cm.allreduce_time(1e6, 4, NET) == pytest.approx(6 * 25e-6 + 1.5 * 1e-4)  # 2(p-1)α + 2(p-1)/p n/B
    assert cm.allreduce_time(1e6, 4, NET, "rabenseifner") == pytest.approx(4 * 25e-6 + 1.5e-4)  # 2 lg p α
    assert cm.allreduce_time(1e6, 4, NET, "recursive_doubling") == pytest.approx(2 * (25e-6 + 1e-4))
    assert cm.reduce_scatter_time(1e6, 4, NET) == pytest.approx(3 * 25e-6 + 0.75e-4)
    assert cm.reduce_scatter_time(1e6, 4, NET, "recursive_halving") == pytest.approx(2 * 25e-6 + 0.75e-4)
    assert cm.allgather_time(1e6, 4, NET) == pytest.approx(3 * 25e-6 + 3e-4)  # (p-1)α + (p-1) m/B
    assert cm.allgather_time(1e6, 4, NET, "recursive_doubling") == pytest.approx(2 * 25e-6 + 3e-4)
    assert cm.broadcast_time(1e6, 4, NET, "binomial") == pytest.approx(2 * (25e-6 + 1e-4))
    assert cm.broadcast_time(1e6, 4, NET, "scatter_allgather") == pytest.approx(5 * 25e-6 + 1.5e-4)
    assert cm.neighbor_exchange_time(1e6, 2, NET) == pytest.approx(2 * (25e-6 + 1e-4))
    # lg p rounds up for p not a power of two: lg 5 -> 3
    assert cm.allreduce_time(0, 5, NET, "recursive_doubling") == pytest.approx(3 * 25e-6)
    assert NET.transfer_time(1e6) == pytest.approx(25e-6 + 1e-4)


def test_standard_networks():
    assert sorted(n.bandwidth_gbps for n in cm.STANDARD_NETWORKS.values()) == [1.0, 10.0, 25.0]
    assert {n.latency_s for n in cm.STANDARD_NETWORKS.values()} == {cm.DEFAULT_LATENCY_S}
    # With α = 0 the time is bandwidth-bound: 10x the bandwidth is exactly a tenth of the time.
    t1, t10 = (cm.allreduce_time(8e6, 8, cm.Network(g, 0.0)) for g in (1.0, 10.0))
    assert t1 == pytest.approx(10 * t10)


ALL = [
    lambda b, p, n: cm.allreduce_time(b, p, n),
    lambda b, p, n: cm.allreduce_time(b, p, n, "rabenseifner"),
    lambda b, p, n: cm.allreduce_time(b, p, n, "recursive_doubling"),
    lambda b, p, n: cm.reduce_scatter_time(b, p, n),
    lambda b, p, n: cm.reduce_scatter_time(b, p, n, "recursive_halving"),
    lambda b, p, n: cm.allgather_time(b, p, n),
    lambda b, p, n: cm.allgather_time(b, p, n, "recursive_doubling"),
    lambda b, p, n: cm.broadcast_time(b, p, n),
]


@settings(max_examples=20)
@given(bits=bits_st, net=net_st)
def test_one_worker_costs_nothing(bits, net):
    for f in ALL:
        assert f(bits, 1, net) == 0.0
    assert cm.neighbor_exchange_time(bits, 0, net) == 0.0


@settings(max_examples=20)
@given(b1=bits_st, b2=bits_st, p=workers_st, net=net_st, extra_latency=st.floats(1e-7, 1e-3))
def test_monotone_in_bits_latency_and_bandwidth(b1, b2, p, net, extra_latency):
    lo, hi = sorted((b1, b2))
    slower = cm.Network(net.bandwidth_gbps / 2, net.latency_s + extra_latency)
    for f in ALL:
        assert f(lo, p, net) <= f(hi, p, net)
        assert f(hi, p, net) <= f(hi, p, slower)
        if p > 1:
            assert f(hi, p, net) < f(hi, p, slower)


@settings(max_examples=20)
@given(bits=bits_st, p=st.integers(1, 63), net=net_st)
def test_ring_costs_grow_with_workers(bits, p, net):
    for f in (cm.allreduce_time, cm.reduce_scatter_time, cm.allgather_time):
        assert f(bits, p, net) <= f(bits, p + 1, net)


@settings(max_examples=20)
@given(bits=bits_st, p=workers_st, net=net_st)
def test_allreduce_is_reduce_scatter_then_allgather(bits, p, net):
    # Each process ends the reduce-scatter with n/p bits, which the allgather distributes.
    ring = cm.reduce_scatter_time(bits, p, net) + cm.allgather_time(bits / p, p, net)
    assert cm.allreduce_time(bits, p, net) == pytest.approx(ring, rel=1e-12, abs=1e-15)
    if p & (p - 1) == 0:  # Rabenseifner = recursive halving + recursive doubling (powers of two)
        rab = cm.reduce_scatter_time(bits, p, net, "recursive_halving") + cm.allgather_time(
            bits / p, p, net, "recursive_doubling"
        )
        assert cm.allreduce_time(bits, p, net, "rabenseifner") == pytest.approx(rab, rel=1e-12, abs=1e-15)
    # Bandwidth-optimal: no algorithm moves fewer than 2 (p-1)/p n bits per process.
    assert cm.allreduce_time(bits, p, net) >= 2 * (p - 1) / p * bits / net.bits_per_s * (1 - 1e-12)


@settings(max_examples=20)
@given(bits=bits_st, p=workers_st, net=net_st)
def test_broadcast_best_is_the_cheaper_algorithm(bits, p, net):
    a = cm.broadcast_time(bits, p, net, "binomial")
    b = cm.broadcast_time(bits, p, net, "scatter_allgather")
    assert cm.broadcast_time(bits, p, net) == min(a, b)


@settings(max_examples=20)
@given(bits=bits_st, p=workers_st, m=st.integers(1, 100), net=net_st)
def test_messages_pay_latency_each(bits, p, m, net):
    one = cm.comm_time("allreduce", bits, p, net)
    many = cm.comm_time("allreduce", bits, p, net, messages=m)
    assert many - one == pytest.approx((m - 1) * 2 * (p - 1) * net.latency_s, rel=1e-9, abs=1e-12)


def test_comm_time_dispatch():
    b, p = 3.3e5, 6
    assert cm.comm_time("allreduce", b, p, NET) == cm.allreduce_time(b, p, NET)
    assert cm.comm_time("allgather", b, p, NET, algorithm="recursive_doubling") == cm.allgather_time(
        b, p, NET, "recursive_doubling"
    )
    assert cm.comm_time("reduce_scatter", b, p, NET) == cm.reduce_scatter_time(b, p, NET)
    assert cm.comm_time("broadcast", b, p, NET) == cm.broadcast_time(b, p, NET)
    assert cm.comm_time("neighbour_exchange", b, p, NET, degree=3) == cm.neighbor_exchange_time(b, 3, NET)


def test_arrays_and_traced_bits():
    bits = np.array([0.0, 1e3, 1e6])
    out = cm.allreduce_time(bits, 8, NET)
    assert out.shape == (3,)
    np.testing.assert_allclose(out, [cm.allreduce_time(float(x), 8, NET) for x in bits])
    jitted = jax.jit(lambda b: cm.comm_time("broadcast", b, 8, NET))(jnp.asarray(bits, jnp.float32))
    np.testing.assert_allclose(jitted, cm.broadcast_time(bits, 8, NET), rtol=1e-6)


def test_wire_bits_to_time():
    # A dense fp32 payload of n values is 32 n bits on the wire.
    x = jnp.ones((1000,), jnp.float32)
    payload, _ = jc.compressors.none().compress(x, jax.random.key(0))
    bits = jc.wire_bits(payload)
    assert bits == 32_000
    assert cm.comm_time("allreduce", bits, 2, NET) == pytest.approx(2 * 25e-6 + 32_000 / 1e10)


def test_cumulative_and_estimates_agree():
    bits = np.array([1e6, 2e6, 0.0, 5e5])
    cum = cm.cumulative_comm_time("allgather", bits, 4, NET)
    assert np.all(np.diff(cum) >= 0)
    np.testing.assert_allclose(cum[-1], sum(cm.allgather_time(b, 4, NET) for b in bits))
    est = cm.estimate_times("allgather", bits, 4, compute_s_per_step=0.01)
    assert set(est) == set(cm.STANDARD_NETWORKS)
    assert est["10Gbps"] == pytest.approx(cum[-1] + 0.04)
    assert est["1Gbps"] > est["10Gbps"] > est["25Gbps"]


def test_bad_input():
    with pytest.raises(ValueError, match="workers"):
        cm.allreduce_time(1.0, 0, NET)
    with pytest.raises(TypeError, match="workers"):
        cm.allreduce_time(1.0, 2.5, NET)
    with pytest.raises(ValueError, match="bits"):
        cm.allreduce_time(-1.0, 2, NET)
    with pytest.raises(ValueError, match="bits_per_worker"):
        cm.allgather_time(math.inf, 2, NET)
    with pytest.raises(ValueError, match="strategy"):
        cm.comm_time("alltoall", 1.0, 2, NET)
    with pytest.raises(ValueError, match="algorithm"):
        cm.allreduce_time(1.0, 2, NET, "tree")
    with pytest.raises(ValueError, match="messages"):
        cm.comm_time("allreduce", 1.0, 2, NET, messages=0)
    with pytest.raises(ValueError, match="degree"):
        cm.neighbor_exchange_time(1.0, -1, NET)
    with pytest.raises(ValueError, match="bandwidth_gbps"):
        cm.Network(0.0)
    with pytest.raises(ValueError, match="latency_s"):
        cm.Network(1.0, -1e-6)
    with pytest.raises(TypeError, match="net"):
        cm.allreduce_time(1.0, 2, 10.0)
    with pytest.raises(ValueError, match="compute_s_per_step"):
        cm.estimate_times("allreduce", [1.0], 2, compute_s_per_step=-1.0)


# --------------------------------------------------------------------------- #
# Bytes and time of one compressed_mean step
# --------------------------------------------------------------------------- #
def test_step_bytes_closed_forms():
    P = 1_000_000.0
    for n in (1, 2, 3, 4, 8):
        assert cm.step_bytes("allreduce", P, n) == 2 * (n - 1) * P  # ring: 2(n-1)/n P per worker
        assert cm.step_bytes("rounds", P, n) == 2 * (n - 1) * P
        assert cm.step_bytes("allgather", P, n) == n * (n - 1) * P
        assert cm.step_bytes("broadcast", P, n) == n * (n - 1) * P
        assert cm.step_bytes("reduce_scatter", P, n) == 2 * (n - 1) * P
    # n = 4, fp16 on d = 1000 entries, reduce-scatter: chunks of c = 250 entries, s = a = 500 bytes;
    # each worker reports (n-1) s + a = 2000 bytes; on the wire n(n-1)(s + a) = 12 * 1000.
    assert cm.step_bytes("reduce_scatter", 2000, 4) == 12_000
    # PowerSGD rank 2 on (512, 1024): messages of 512*2*4 and 1024*2*4 bytes, each a ring all-reduce.
    m1, m2 = 512 * 2 * 4, 1024 * 2 * 4
    assert cm.step_bytes("rounds", m1 + m2, 4) == 6 * m1 + 6 * m2
    np.testing.assert_array_equal(cm.step_bytes("allgather", np.array([0, 10, 20]), 3), [0, 60, 120])


def test_step_latency_rounds_closed_forms():
    assert cm.step_latency_rounds("allreduce", 4, 3) == 18  # 2(n-1) steps per ring all-reduce
    assert cm.step_latency_rounds("rounds", 4, 2) == 12
    assert cm.step_latency_rounds("allgather", 4, 1) == 3
    assert cm.step_latency_rounds("broadcast", 5, 10) == 30  # ceil(log2 5) = 3 per broadcast
    # reduce-scatter of a one-array payload over n = 4: messages = 3 permutes + 1 all-gather = 4;
    # 3 permute steps + 3 all-gather steps.
    assert cm.step_latency_rounds("reduce_scatter", 4, 4) == 6
    for s in cm.STEP_STRATEGIES:
        assert cm.step_latency_rounds(s, 1, 5) == 0


def test_step_time_is_bytes_over_rate_plus_latency():
    net = cm.Network(0.4, 1e-4)  # 400 Mbit/s, 100 µs
    P = 2 * 1024 * 1024
    # ring all-reduce over n = 2 on a shared link: 2 P bytes, 2 steps
    assert cm.step_time("allreduce", P, 2, net) == pytest.approx(8 * 2 * P / 4e8 + 2 * 1e-4)
    assert cm.step_time("allgather", 41944, 4, net) == pytest.approx(8 * 12 * 41944 / 4e8 + 3 * 1e-4)
    assert cm.step_time("reduce_scatter", P, 4, net, messages=4) == pytest.approx(8 * 6 * P / 4e8 + 6 * 1e-4)
    assert cm.step_time("rounds", 12288, 4, net, messages=2) == pytest.approx(8 * 6 * 12288 / 4e8 + 12 * 1e-4)
    assert cm.step_time("allreduce", P, 1, net) == 0.0
    traced = jax.jit(lambda b: cm.step_time("allgather", b, 4, cm.Network(1.0, 0.0)))(jnp.float32(1e6))
    assert float(traced) == pytest.approx(8 * 12e6 / 1e9, rel=1e-6)


@pytest.mark.parametrize("n", [2, 4, 16, 1024])
def test_switched_step_time_is_the_alpha_beta_collectives(n):
    """On a switched network each worker sends its share at once: the ring all-reduce and the
    all-gather of the α-β model (Thakur et al. 2005) with one latency per message step."""
    net = cm.Network(10.0, 5e-6)
    P = 100e6  # bytes
    assert cm.step_time("allreduce", P, n, net, topology="switched") == pytest.approx(cm.allreduce_time(8 * P, n, net))
    assert cm.step_time("allgather", P / 100, n, net, topology="switched") == pytest.approx(
        cm.allgather_time(8 * P / 100, n, net)
    )
    # reduce-scatter route: n - 1 chunk sends and an all-gather of the averaged chunk, P / n each
    rs = cm.step_time("reduce_scatter", P / 2, n, net, messages=n, topology="switched")
    assert rs == pytest.approx(8 * 2 * (n - 1) * (P / 2) / n / 1e10 + 2 * (n - 1) * 5e-6)
    # the shared link carries n times the switched network's per-link bytes
    assert cm.step_time("allgather", P, n, cm.Network(10.0, 0.0)) == pytest.approx(
        n * cm.step_time("allgather", P, n, cm.Network(10.0, 0.0), topology="switched")
    )
    with pytest.raises(ValueError, match="topology"):
        cm.step_time("allreduce", P, n, net, topology="torus")
    with pytest.raises(ValueError, match="broadcast"):
        cm.step_time("broadcast", P, n, net, topology="switched")


@given(st.integers(1, 16), st.integers(1, 8), st.floats(1.0, 1e9))
def test_cluster_node_bytes_closed_forms(nodes, devices, P):
    """Two levels: a flat ring over the N L devices (node-major) leaves each node on one of its edges,
    ``step_bytes / (N L)`` bytes; the hierarchical slow axis runs L collectives over the N nodes,
    ``L step_bytes(N) / N`` per node. With one device per node both are the switched network's
    per-worker share; one node sends nothing."""
    c = cm.Cluster(nodes, devices)
    n = nodes * devices
    if nodes == 1:
        assert c.node_bytes("allreduce", P, n) == 0 and c.node_bytes("allgather", P, 1) == 0
        return
    assert c.node_bytes("allreduce", P, n) == pytest.approx(2 * (n - 1) * P / n)
    assert c.node_bytes("allgather", P, n) == pytest.approx((n - 1) * P)
    assert c.node_bytes("allreduce", P / devices, nodes) == pytest.approx(2 * (nodes - 1) * P / nodes)
    assert c.node_bytes("allgather", P, nodes) == pytest.approx(devices * (nodes - 1) * P)
    net = cm.Network(0.1, 1e-4)
    t = cm.step_time("allgather", P, nodes, net, messages=2, topology=c)
    assert t == pytest.approx(8 * devices * (nodes - 1) * P / 1e8 + 2 * (nodes - 1) * 1e-4)
    if devices == 1:  # one device per node: the switched network of n workers
        assert t == pytest.approx(cm.step_time("allgather", P, n, net, messages=2, topology="switched"))


def test_cluster_bad_input():
    with pytest.raises(ValueError, match="nodes must be >= 1"):
        cm.Cluster(0, 2)
    with pytest.raises(TypeError, match="devices"):
        cm.Cluster(2, 2.0)
    with pytest.raises(ValueError, match=r"workers must be nodes x devices = 8 .* or nodes = 4 .*; got 2"):
        cm.Cluster(4, 2).node_bytes("allreduce", 1.0, 2)
    with pytest.raises(ValueError, match="broadcast"):
        cm.step_time("broadcast", 1.0, 4, cm.Network(1.0), topology=cm.Cluster(4, 2))


def _vmapped_state(compressor, strategy, n, shape):
    """``state`` after one ``compressed_mean`` step over ``n`` workers simulated with ``jax.vmap``."""
    tx = jc.compressed_mean(compressor, "w", strategy=strategy)
    g = {"w": jnp.arange(n * math.prod(shape), dtype=jnp.float32).reshape(n, *shape) / 7.0}
    state = jax.vmap(tx.init)(g)
    _, state = jax.jit(jax.vmap(tx.update, axis_name="w"))(g, state)
    return int(np.asarray(state.wire_bits)[0].sum()), int(np.asarray(state.messages)[0])


@pytest.mark.parametrize(
    "make, strategy, step_strategy, shape, payload_bytes, total, messages",
    [
        # none: 64*32 float32 = 8192 bytes summed; ring all-reduce 2*3*8192.
        (lambda: jc.compressors.none(), "allreduce", "allreduce", (64, 32), 8192, 6 * 8192, 1),
        # top-k 1%: k = round(20.48) = 20 float32 values + 20 uint16 indices (d = 2048 < 2**16) = 120 bytes,
        # gathered to the 3 others.
        (lambda: jc.compressors.topk(ratio=0.01), "allgather", "allgather", (64, 32), 120, 12 * 120, 1),
        # fp16 reduce-scatter: chunks of 512 entries (1024 bytes); 3 sent + 1 averaged = 4096 bytes.
        (lambda: jc.compressors.fp16(), "reduce_scatter", "reduce_scatter", (64, 32), 4096, 12 * 2048, 4),
        # PowerSGD rank 2: P (64x2) and Q (32x2) in float32 = 512 + 256 bytes, two all-reduces.
        (lambda: jc.compressors.powersgd(rank=2), "allreduce", "rounds", (64, 32), 768, 6 * 768, 2),
    ],
)
def test_step_bytes_from_the_pipelines_wire_bits(make, strategy, step_strategy, shape, payload_bytes, total, messages):
    n = 4
    bits, msgs = _vmapped_state(make(), strategy, n, shape)
    assert (bits, msgs) == (8 * payload_bytes, messages)
    assert cm.step_bytes(step_strategy, bits / 8, n) == total


def test_step_bad_input():
    with pytest.raises(ValueError, match="strategy"):
        cm.step_bytes("alltoall", 1.0, 2)
    with pytest.raises(ValueError, match="payload_bytes"):
        cm.step_bytes("allreduce", -1.0, 2)
    with pytest.raises(TypeError, match="workers"):
        cm.step_bytes("allreduce", 1.0, 2.0)
    with pytest.raises(ValueError, match="messages"):
        cm.step_latency_rounds("reduce_scatter", 4, 3)
    with pytest.raises(ValueError, match="messages"):
        cm.step_latency_rounds("allreduce", 4, -1)
    with pytest.raises(TypeError, match="net"):
        cm.step_time("allreduce", 1.0, 2, 0.4)
