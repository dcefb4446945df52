"""compressed_mean on 4 and 8 simulated devices against a NumPy reference of GRACE Algorithm 1.

The reference runs Algorithm 1 literally (per worker: φ = β m + γ g,
ĝ = Q⁻¹(Q(φ)), m ← φ − ĝ; all workers: x ← x − lr · mean_i ĝ_i) in float64
NumPy with each compressor written in NumPy. It re-derives the documented key
schedule with jax.random (split per step, split per leaf, fold_in(worker)
unless the workers must share the key), so stochastic compressors draw the
same numbers. Gradients depend on the parameters (g_i = a_i ⊙ x − b_i), so
the loop is closed: a wrong mean, memory or key shows up in later steps.
"""

from __future__ import annotations

import dataclasses
import re
from typing import Any, ClassVar

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from compressor_examples import EXACT_SETTINGS, MEAN_KWARGS
from hypothesis import given, settings
from hypothesis import strategies as st
from jax.sharding import Mesh, NamedSharding
from jax.sharding import PartitionSpec as P

import jaxcomm as jc
from jaxcomm import memory as mem
from jaxcomm.comm import MeshAxis
from jaxcomm.compressors import Compressor
from jaxcomm.compressors.payloads import Payload, payload_dataclass, static_field
from jaxcomm.transforms import compressed_mean
from jaxcomm.transforms._checks import sums_in_16_bits

SHAPES = {"b": (5,), "w": (6, 7)}  # two tensors; dict order == jax.tree.leaves order (sorted keys)
LR = 0.1
STEPS = 3


# --------------------------------------------------------------------------- #
# Tiny test compressors with NumPy twins
# --------------------------------------------------------------------------- #
@payload_dataclass
class DitherPayload(Payload):
    codes: jax.Array  # int8, shape of x
    scale: jax.Array  # float32 scalar
    shape: tuple = static_field()
    dtype: Any = static_field()
    summable: ClassVar[tuple[str, ...]] = ()


def dither() -> Compressor:
    """Stochastic, unbiased, allgather: codes = floor(x/s + u), u ~ U[0,1), s = max|x|/127."""

    def compress(x, key, state):
        s = jnp.max(jnp.abs(x)) / 127.0
        s = jnp.where(s > 0, s, 1.0)
        u = jax.random.uniform(key, x.shape)
        codes = jnp.clip(jnp.floor(x / s + u), -127, 127).astype(jnp.int8)
        return DitherPayload(codes=codes, scale=s, shape=x.shape, dtype=x.dtype), state

    def decompress(p):
        return (p.codes.astype(jnp.float32) * p.scale).astype(p.dtype)

    return Compressor(
        name="dither", compress_fn=compress, decompress_fn=decompress, unbiased=True, strategy="allgather"
    )


def dither_np(x, key):
    x = np.asarray(x, np.float32)  # the compressor works in float32
    s = np.float32(np.max(np.abs(x)) / np.float32(127.0))
    s = s if s > 0 else np.float32(1.0)
    u = np.asarray(jax.random.uniform(key, x.shape))
    codes = np.clip(np.floor(x / s + u), -127, 127)
    return codes.astype(np.float64) * np.float64(s)


@payload_dataclass
class RandkPayload(Payload):
    values: jax.Array  # float32[k], scaled by d/k
    key: jax.Array  # uint32[2], the shared key (not sent under allreduce)
    shape: tuple = static_field()
    dtype: Any = static_field()
    summable: ClassVar[tuple[str, ...]] = ("values",)


@payload_dataclass
class RandkGatherPayload(RandkPayload):
    summable: ClassVar[tuple[str, ...]] = ()


def _randk_indices(key, d, k):
    return jax.random.choice(key, d, (k,), replace=False)


def randk(ratio=0.5, hook=False) -> Compressor:
    """Unbiased random-k (values scaled by d/k); indices come from the key.

    hook=False: strategy allreduce, ``values`` summable, key shared.
    hook=True: strategy allgather, plus rounds that yield the values to be
    summed (a stand-in for a multi-round method such as PowerSGD).
    """
    cls = RandkGatherPayload if hook else RandkPayload

    def compress(x, key, state):
        d = x.size
        k = max(1, int(round(ratio * d)))
        idx = _randk_indices(key, d, k)
        vals = x.ravel()[idx].astype(jnp.float32) * (d / k)
        return cls(values=vals, key=key, shape=x.shape, dtype=x.dtype), state

    def decompress(p):
        d = int(np.prod(p.shape))
        idx = _randk_indices(p.key, d, p.values.shape[0])
        return jnp.zeros((d,), jnp.float32).at[idx].add(p.values).reshape(p.shape).astype(p.dtype)

    def rounds(x, key, state, size):
        p, state = compress(x, key, state)
        total = yield p.values
        return cls(values=total, key=p.key, shape=p.shape, dtype=p.dtype), state

    return Compressor(
        name="randk_hook" if hook else "randk",
        compress_fn=compress,
        decompress_fn=decompress,
        unbiased=True,
        strategy="allgather" if hook else "allreduce",
        rounds=rounds if hook else None,
    )


def randk_np(x, key, ratio=0.5):
    x = np.asarray(x, np.float64)
    d = x.size
    k = max(1, int(round(ratio * d)))
    idx = np.asarray(_randk_indices(key, d, k))
    out = np.zeros(d)
    np.add.at(out, idx, x.ravel()[idx] * (d / k))
    return out.reshape(x.shape)


def scaled_sign_np(x, key):
    x = np.asarray(x, np.float64)
    return np.sqrt(np.mean(x * x)) * np.where(x < 0, -1.0, 1.0)


# name -> (compressor factory, strategy, memory, (beta, gamma) or None, numpy Q, key mode,
#          exact wire bits per worker for a d-element tensor)
CASES = {
    "none": (
        jc.compressors.none,
        "auto",
        mem.none(),
        None,
        lambda x, k: np.asarray(x, np.float64),
        "folded",
        lambda d: 32 * d,
    ),
    "scaled_sign": (
        jc.compressors.scaled_sign,
        "auto",
        mem.residual(),
        (1.0, 1.0),
        scaled_sign_np,
        "folded",
        lambda d: 8 * -(-d // 8) + 32,
    ),  # packed signs + one float32 scale
    "dither": (dither, "auto", mem.residual(0.5, 2.0), (0.5, 2.0), dither_np, "folded", lambda d: 8 * d + 32),
    "dither_broadcast": (dither, "broadcast", mem.residual(), (1.0, 1.0), dither_np, "folded", lambda d: 8 * d + 32),
    # allreduce: only the summed values travel; the shared key does not.
    "randk_allreduce": (randk, "auto", mem.residual(), (1.0, 1.0), randk_np, "shared", lambda d: 32 * round(d / 2)),
    # rounds: the yielded messages are what was sent (the values; the shared key is not)
    "randk_hook": (
        lambda: randk(hook=True),
        "allreduce",
        mem.residual(),
        (1.0, 1.0),
        randk_np,
        "hook",
        lambda d: 32 * round(d / 2),
    ),
}


# --------------------------------------------------------------------------- #
# Harness: data, the mesh step, the NumPy reference
# --------------------------------------------------------------------------- #
def make_data(n, seed=0):
    rng = np.random.default_rng(seed)
    a = {k: rng.uniform(0.5, 1.5, (n, *s)).astype(np.float32) for k, s in SHAPES.items()}
    b = {k: rng.normal(size=(n, *s)).astype(np.float32) for k, s in SHAPES.items()}
    x0 = {k: rng.normal(size=s).astype(np.float32) for k, s in SHAPES.items()}
    return a, b, x0


def stacked(tree, n):
    return jax.tree.map(lambda v: jnp.broadcast_to(jnp.asarray(v), (n, *jnp.shape(v))), tree)


def mesh_of(n):
    return Mesh(np.array(jax.devices()[:n]), ("data",))


def make_step(tx, n, trace_counter=None):
    """One jitted data-parallel step on n devices; every input/output has a leading worker axis."""
    mesh = mesh_of(n)

    def worker(a, b, x, state):
        if trace_counter is not None:
            trace_counter.append(1)
        a, b, x, state = jax.tree.map(lambda v: v[0], (a, b, x, state))
        g = {k: a[k] * x[k] - b[k] for k in x}
        u, state = tx.update(g, state, x)
        x = optax.apply_updates(x, u)
        return jax.tree.map(lambda v: v[None], (x, state))

    step = jax.jit(jax.shard_map(worker, mesh=mesh, in_specs=(P("data"),) * 4, out_specs=P("data")))
    put = lambda t: jax.device_put(t, NamedSharding(mesh, P("data")))
    return step, put


def run_mesh(tx, n, steps=STEPS, seed=0):
    """Run ``optax.chain(tx, sgd(LR))`` for ``steps`` steps; returns (params per worker, tx's state)."""
    tx = optax.chain(tx, optax.sgd(LR))
    a, b, x0 = make_data(n, seed)
    step, put = make_step(tx, n)
    a, b = put(a), put(b)
    x, state = put(stacked(x0, n)), put(stacked(tx.init(x0), n))
    for _ in range(steps):
        x, state = step(a, b, x, state)
    return jax.tree.map(np.asarray, x), state[0]


def reference(q_np, n, beta_gamma, key_mode, steps=STEPS, seed=0, comp_seed=0):
    """GRACE Algorithm 1 in float64 NumPy (keys via the documented schedule)."""
    a, b, x0 = make_data(n, seed)
    names = sorted(SHAPES)
    x = {k: x0[k].astype(np.float64) for k in names}
    m = {k: np.zeros((n, *SHAPES[k])) for k in names}
    key = jax.random.PRNGKey(comp_seed)
    for _ in range(steps):
        key, step_key = jax.random.split(key)
        leaf_keys = jax.random.split(step_key, len(names))
        for j, k in enumerate(names):
            g = a[k].astype(np.float64) * x[k] - b[k]
            g_hats = []
            for i in range(n):
                if beta_gamma is None:
                    phi = g[i]
                else:
                    phi = beta_gamma[0] * m[k][i] + beta_gamma[1] * g[i]
                wkey = leaf_keys[j] if key_mode in ("shared", "hook") else jax.random.fold_in(leaf_keys[j], i)
                g_hat = q_np(phi, wkey)
                g_hats.append(g_hat)
                if beta_gamma is not None:
                    m[k][i] = phi - g_hat
            mean = np.mean(g_hats, axis=0)
            if key_mode == "hook" and beta_gamma is not None:
                # rounds: the memory keeps phi - (aggregated reconstruction)
                for i in range(n):
                    m[k][i] = m[k][i] + g_hats[i] - mean
            x[k] = x[k] - LR * mean
    return x, m


# --------------------------------------------------------------------------- #
# Algorithm 1 vs the reference
# --------------------------------------------------------------------------- #
@pytest.mark.parametrize(
    "case,n",
    [
        ("scaled_sign", 4),
        ("scaled_sign", 8),
        ("dither", 4),
        ("dither", 8),
        ("none", 8),
        ("dither_broadcast", 4),
        ("randk_allreduce", 4),
        ("randk_hook", 4),
    ],
)
def test_matches_numpy_algorithm1(case, n):
    factory, strategy, memory, bg, q_np, key_mode, bits = CASES[case]
    tx = compressed_mean(factory(), "data", memory=memory, strategy=strategy)
    x, state = run_mesh(tx, n)
    assert isinstance(state.wire_bits, jc.BitCount)
    np.testing.assert_array_equal(
        np.asarray(state.wire_bits), [[bits(int(np.prod(SHAPES[k]))) for k in sorted(SHAPES)]] * n
    )
    x_ref, m_ref = reference(q_np, n, bg, key_mode)
    for k in SHAPES:
        # All replicas end the step with bit-identical parameters.
        for i in range(1, n):
            np.testing.assert_array_equal(x[k][i], x[k][0], err_msg=f"worker {i} diverged on {k}")
        # float32 vs float64 over 3 closed-loop steps of O(1) values: 1e-5 is ~100 ulps.
        np.testing.assert_allclose(x[k][0], x_ref[k], rtol=1e-5, atol=1e-5, err_msg=k)
        if bg is not None:
            np.testing.assert_allclose(np.asarray(state.memory[k]), m_ref[k], rtol=1e-5, atol=1e-5)


def test_none_equals_exact_mean():
    """compressed_mean(none()) is the exact pmean, bit for bit."""
    n = 8
    tx = compressed_mean(jc.compressors.none(), "data")
    g = {k: jax.random.normal(jax.random.PRNGKey(i), (n, *s)) for i, (k, s) in enumerate(SHAPES.items())}

    def f(g, st):
        g, st = jax.tree.map(lambda v: v[0], (g, st))
        u, _ = tx.update(g, st)
        return jax.tree.map(lambda v: v[None], (u, MeshAxis("data").mean(g)))

    mesh = mesh_of(n)
    put = lambda t: jax.device_put(t, NamedSharding(mesh, P("data")))
    u, exact = jax.jit(jax.shard_map(f, mesh=mesh, in_specs=(P("data"),) * 2, out_specs=P("data")))(
        put(g), put(stacked(tx.init(jax.tree.map(lambda v: v[0], g)), n))
    )
    for k in SHAPES:
        np.testing.assert_array_equal(np.asarray(u[k]), np.asarray(exact[k]))
        np.testing.assert_allclose(np.asarray(u[k][0]), np.asarray(g[k]).mean(0), rtol=1e-6, atol=1e-6)


def test_step_traces_once():
    n = 4
    tx = optax.chain(compressed_mean(jc.compressors.scaled_sign(), "data", memory=mem.residual()), optax.sgd(LR))
    a, b, x0 = make_data(n)
    traces = []
    step, put = make_step(tx, n, traces)
    a, b = put(a), put(b)
    x, state = put(stacked(x0, n)), put(stacked(tx.init(x0), n))
    for _ in range(4):
        x, state = step(a, b, x, state)
    assert len(traces) == 1
    assert int(state[0].count[0]) == 4


# --------------------------------------------------------------------------- #
# Every registered compressor through compressed_mean (vmap axis, cheap)
# --------------------------------------------------------------------------- #


def for_feedback(c, d: int):
    """``c``, or ``contractive(c)`` where error feedback refuses it (unbiased, ω(d) ≥ 1)."""
    if c.variance_factor is not None and c.omega(d) >= 1.0:
        return jc.compressors.contractive(c)
    return c


@pytest.mark.parametrize("name", jc.compressors.names())
def test_every_compressor_matches_per_worker_roundtrips(name):
    """vmap-axis compressed_mean == mean over workers of each worker's own Q⁻¹(Q(φ)); memory φ − Q⁻¹(Q(φ))."""
    c = jc.compressors.make(name, **MEAN_KWARGS.get(name, {}))
    if c.strategy == "allreduce" and c.rounds is not None:
        pytest.skip(f"{name} communicates in rounds; covered by its own tests and randk_hook")
    n, shape = 3, SHAPES["w"]
    c = for_feedback(c, int(np.prod(shape)))
    # 16-bit payloads: the all-reduce route is pinned (under "auto" error feedback takes the float32
    # reduce-scatter route, whose owners also feed their rounding back: test_reduce_scatter.py).
    memory = mem.residual(needs_contraction=not c.no_contraction)  # sign methods: error feedback by choice
    tx = compressed_mean(c, "i", memory=memory, strategy="allreduce" if sums_in_16_bits(c) else "auto")
    g = jax.random.normal(jax.random.PRNGKey(3), (n, *shape))
    g = g.at[:, 0, 0].set(0.0)  # an exact zero (sign conventions, sparsifier ties)
    u, state = jax.jit(jax.vmap(tx.update, axis_name="i"))({"w": g}, stacked(tx.init({"w": g[0]}), n))

    # Reference: the compressor's own primitives, one worker at a time, single process.
    shared = False
    if c.strategy == "allreduce":
        p, _ = c.compress(jnp.ones(shape), jax.random.PRNGKey(0))
        shared = any(f.name not in type(p).summable for f in dataclasses.fields(p) if not f.metadata.get("static"))

    @jax.jit
    def reference(g):
        _, step_key = jax.random.split(jax.random.PRNGKey(c.seed))
        k0 = jax.random.split(step_key, 1)[0]
        hats = []
        for i in range(n):
            key = k0 if shared else jax.random.fold_in(k0, i)
            hats.append(c.decompress(c.compress(g[i], key, c.init_state(g[i]))[0]))
        return sum(hats) / n, jnp.stack([g[i] - hats[i] for i in range(n)])

    mean, memory = reference(g)
    tol = 2e-2 if name in ("fp16", "bf16") else 1e-5  # fp16/bf16 are summed on the wire in 16 bits
    np.testing.assert_allclose(
        np.asarray(u["w"]), np.broadcast_to(np.asarray(mean), (n, *shape)), rtol=tol, atol=tol, err_msg=name
    )
    np.testing.assert_allclose(np.asarray(state.memory["w"]), np.asarray(memory), rtol=1e-5, atol=1e-5)
    for i in range(1, n):
        np.testing.assert_array_equal(np.asarray(u["w"][i]), np.asarray(u["w"][0]))


@pytest.mark.parametrize("name", jc.compressors.names())
def test_every_compressor_traces_inside_shard_map(name):
    """Every compressor runs in a shard_map step with jax's varying-axes check on (trace only, no compile).

    A 3x3x32x32 kernel (9216 entries) takes the large-tensor code paths of the
    sparsifiers; values must keep consistent device-varying types through
    their loops and branches, or the step cannot be built inside shard_map.
    """
    c = jc.compressors.make(name, **MEAN_KWARGS.get(name, {}))
    n, mesh = 4, mesh_of(4)
    c = for_feedback(c, 9216)  # the largest leaf; ω grows with the size
    tx = compressed_mean(c, "data", memory=mem.residual(needs_contraction=not c.no_contraction))
    x0 = {"b": jnp.zeros(16), "w": jnp.zeros((3, 3, 32, 32))}

    def worker(a, x, state):
        a, x, state = jax.tree.map(lambda v: v[0], (a, x, state))
        u, state = tx.update(jax.tree.map(lambda p, s: p * s, x, a), state, x)
        return jax.tree.map(lambda v: v[None], (optax.apply_updates(x, u), state))

    f = jax.jit(jax.shard_map(worker, mesh=mesh, in_specs=(P("data"),) * 3, out_specs=P("data")))
    spec = lambda t: jax.tree.map(
        lambda v: jax.ShapeDtypeStruct((n, *jnp.shape(v)), jnp.result_type(v), sharding=NamedSharding(mesh, P("data"))),
        t,
    )
    f.trace(spec(x0), spec(x0), spec(tx.init(x0)))


@pytest.mark.parametrize("setting", sorted(EXACT_SETTINGS))
def test_exact_settings_give_the_uncompressed_mean_inside_shard_map(setting):
    """Every setting the docs call exact, in a shard_map step with the varying-axes check on, sends
    the uncompressed mean (NumPy, float64) and leaves nothing in the error-feedback memory.

    A 2400-entry tensor takes the sparsifiers' large-tensor paths (bit-packed masks, the sampled
    threshold, DGC's adaptation with its exact top-k branch), a 5-entry one the small-tensor paths.
    """
    name, kwargs = EXACT_SETTINGS[setting]
    n, mesh = 4, mesh_of(4)
    tx = compressed_mean(jc.compressors.make(name, **kwargs), "data", memory=mem.residual())
    rng = np.random.default_rng(0)
    g = {"b": rng.standard_normal((n, 5)), "w": rng.standard_normal((n, 48, 50))}
    g = jax.tree.map(lambda v: v.astype(np.float32), g)
    x0 = jax.tree.map(lambda v: jnp.zeros(v.shape[1:]), g)

    def worker(g, state):
        g, state = jax.tree.map(lambda v: v[0], (g, state))
        u, state = tx.update(g, state, x0)
        return jax.tree.map(lambda v: v[None], (u, state.memory))

    f = jax.jit(jax.shard_map(worker, mesh=mesh, in_specs=(P("data"),) * 2, out_specs=P("data"), check_vma=True))
    put = lambda t: jax.device_put(t, NamedSharding(mesh, P("data")))
    u, memory = f(put(g), put(stacked(tx.init(x0), n)))
    for k, v in g.items():
        mean = v.astype(np.float64).mean(0)  # every worker receives it
        np.testing.assert_allclose(np.asarray(u[k]), np.broadcast_to(mean, v.shape), rtol=1e-6, atol=1e-6, err_msg=k)
        np.testing.assert_array_equal(np.asarray(memory[k]), 0.0, err_msg=k)


# --------------------------------------------------------------------------- #
# The payload that crosses the axis is the compressed one
# --------------------------------------------------------------------------- #
_HLO_BITS = {
    "pred": 8,
    "s8": 8,
    "u8": 8,
    "s16": 16,
    "u16": 16,
    "f16": 16,
    "bf16": 16,
    "s32": 32,
    "u32": 32,
    "f32": 32,
    "s64": 64,
    "u64": 64,
    "f64": 64,
}


def collective_bits_per_worker(hlo: str, n: int) -> tuple[int, list[str]]:
    """Bits each worker contributes to the collectives in an HLO module (all-gather results / n)."""
    total, ops = 0, []
    for line in hlo.splitlines():
        mo = re.search(r"=\s*(.*?)\s+(all-gather|all-reduce|collective-permute|all-to-all|reduce-scatter)\(", line)
        if not mo:
            continue
        shapes = re.findall(r"(\w+)\[([\d,]*)\]", mo.group(1))
        bits = sum(_HLO_BITS[t] * int(np.prod([int(d) for d in dims.split(",") if d] or [1])) for t, dims in shapes)
        if mo.group(2) == "all-gather":
            bits //= n
        ops.append(f"{mo.group(2)} {mo.group(1)}")
        total += bits
    return total, ops


def _grad_step(tx, n, pcast=True):
    mesh = mesh_of(n)

    def worker(data, x, state):
        data, state = jax.tree.map(lambda v: v[0], (data, state))
        if pcast:
            x = jax.lax.pcast(x, "data", to="varying")
        loss = lambda p: sum(jnp.sum((p[k] - data) ** 2) for k in p)
        g = jax.grad(loss)(x)
        u, state = tx.update(g, state, x)
        x = jax.tree.map(lambda p, d: p - LR * d, x, u)
        return jax.tree.map(lambda v: v[None], (x, state))

    return mesh, jax.jit(jax.shard_map(worker, mesh=mesh, in_specs=(P("data"), P(), P("data")), out_specs=P("data")))


def test_hlo_collectives_carry_exactly_the_payload():
    """The lowered step's collectives move exactly state.wire_bits per worker: packed uint8 signs, not f32."""
    n = 4
    x0 = {"b": jnp.zeros(5), "w": jnp.zeros((64, 33))}
    tx = compressed_mean(jc.compressors.scaled_sign(), "data", memory=mem.residual())
    mesh, step = _grad_step(tx, n)
    data = jax.device_put(jnp.arange(float(n)), NamedSharding(mesh, P("data")))
    state = jax.device_put(stacked(tx.init(x0), n), NamedSharding(mesh, P("data")))
    hlo = step.lower(data, x0, state).as_text(dialect="hlo")
    bits, ops = collective_bits_per_worker(hlo, n)
    _, state = step(data, x0, state)
    expected = int(np.asarray(state.wire_bits[0]).sum())
    assert expected == (8 * 1 + 32) + (8 * 264 + 32)  # ceil(5/8) bytes + scale, ceil(2112/8) bytes + scale
    assert bits == expected, ops
    assert not any("f32[64,33]" in op or "f32[4,64,33]" in op for op in ops), ops


def test_fused_allgather_is_one_collective_with_the_same_bits_and_numbers():
    """fuse=True packs every tensor's payload into one all-gather; fuse=False sends one per tensor and
    field. Same bits on the wire, bit-identical updates and memories."""
    n = 4
    x0 = {"b": jnp.zeros(5), "w": jnp.zeros((64, 33)), "z": jnp.zeros((3, 300))}
    results = {}
    for fuse in (True, False):
        tx = compressed_mean(jc.compressors.topk(ratio=0.1), "data", memory=mem.residual(), fuse=fuse)
        mesh, step = _grad_step(tx, n)
        data = jax.device_put(jnp.arange(float(n)), NamedSharding(mesh, P("data")))
        state = jax.device_put(stacked(tx.init(x0), n), NamedSharding(mesh, P("data")))
        bits, ops = collective_bits_per_worker(step.lower(data, x0, state).as_text(dialect="hlo"), n)
        x, state = step(data, x0, state)
        assert bits == int(np.asarray(state.wire_bits[0]).sum()), ops
        assert all(op.startswith("all-gather") for op in ops), ops
        results[fuse] = (len(ops), x, state.memory)
    assert results[True][0] == 1 and results[False][0] == 2 * len(x0)  # values + indices per tensor
    for a, b in zip(jax.tree.leaves(results[True][1:]), jax.tree.leaves(results[False][1:])):
        np.testing.assert_array_equal(np.asarray(a), np.asarray(b))


def test_fusion_packs_only_payloads_up_to_the_threshold(monkeypatch):
    """Payloads above FUSE_MAX_BYTES get their own all-gather; the smaller ones share one."""
    import jaxcomm.transforms._collectives as cm

    calls = []

    class Recording(MeshAxis):
        def all_gather(self, tree):
            calls.append(sorted(int(np.size(a)) for a in jax.tree.leaves(tree)))
            return super().all_gather(tree)

    monkeypatch.setattr(cm, "FUSE_MAX_BYTES", 200)  # bytes
    tx = compressed_mean(jc.compressors.qsgd(levels=4), comm=Recording("i"))  # 4-bit codes + a norm
    g = {"big": jnp.ones((2, 1000)), "s1": jnp.ones((2, 30)), "s2": jnp.ones((2, 50))}
    jax.vmap(tx.update, axis_name="i")(g, stacked(tx.init(jax.tree.map(lambda v: v[0], g)), 2))
    # big: 1000 codes -> 500 bytes + norm, alone; s1, s2: 15 + 4 and 25 + 4 bytes, packed together.
    assert sorted(calls) == sorted([[1, 500], [15 + 4 + 25 + 4]]), calls
    assert cm.FUSE_MAX_BYTES == 200


# One compressor per payload layout: sparse values + indices, packed codes + a norm, packed sign
# bits + scales, a count-sparse buffer, an allreduce payload, a compress_allreduce hook, sketches.
@pytest.mark.parametrize("name", ["topk", "qsgd", "onebit", "dgc", "randomk", "powersgd", "sketchml"])
def test_fuse_does_not_change_the_numbers(name):
    """fuse=True and fuse=False give bit-identical means, memories and wire bits (float32 and bfloat16
    leaves in one tree; the packed gather itself is checked for every dtype in tests/test_packing.py).
    Count-based payloads (dgc) are the exception for wire bits: each variable-length gather pads to
    its own bucket, so the padding depends on the grouping (tests/test_wire_accounting.py checks it)."""
    c = for_feedback(jc.compressors.make(name, **MEAN_KWARGS.get(name, {})), 42)
    n = 3
    g = {
        "a": jax.random.normal(jax.random.PRNGKey(1), (n, 40)),
        "w": jax.random.normal(jax.random.PRNGKey(2), (n, 6, 7)).astype(jnp.bfloat16),
    }
    txs = [compressed_mean(c, "i", memory=mem.residual(), fuse=fuse) for fuse in (True, False)]
    st0 = stacked(txs[0].init(jax.tree.map(lambda v: v[0], g)), n)
    out = jax.jit(jax.vmap(lambda g, s: [tx.update(g, s) for tx in txs], axis_name="i"))(g, st0)
    # Only the count of collectives differs (state.messages): one packed all-gather against one per array.
    counted = name == "dgc"
    out = [(mean, state._replace(messages=None, wire_bits=None if counted else state.wire_bits)) for mean, state in out]
    for a, b in zip(jax.tree.leaves(out[0]), jax.tree.leaves(out[1])):
        np.testing.assert_array_equal(np.asarray(a, np.float32), np.asarray(b, np.float32), err_msg=name)


def test_pitfall_grad_of_replicated_params_is_summed_and_rejected():
    n = 4
    x0 = {"b": jnp.zeros(5), "w": jnp.zeros((64, 33))}
    mesh = mesh_of(n)
    data = jax.device_put(jnp.arange(float(n)), NamedSharding(mesh, P("data")))

    # The premise: without pcast, jax.grad inserts a dense f32 all-reduce of the gradient.
    def plain(data, x):
        g = jax.grad(lambda p: sum(jnp.sum((p[k] - data[0]) ** 2) for k in p))(x)
        return g

    f = jax.jit(jax.shard_map(plain, mesh=mesh, in_specs=(P("data"), P()), out_specs=P()))
    _, ops = collective_bits_per_worker(f.lower(data, x0).as_text(dialect="hlo"), n)
    assert any(op.startswith("all-reduce") and "f32[64,33]" in op for op in ops), ops
    g = f(data, x0)
    np.testing.assert_allclose(np.asarray(g["b"]), 2 * np.sum(0 - np.arange(n)) * np.ones(5))  # summed over 4

    # compressed_mean refuses the already-summed gradient and says how to fix it.
    tx = compressed_mean(jc.compressors.scaled_sign(), "data", memory=mem.residual())
    _, step = _grad_step(tx, n, pcast=False)
    state = jax.device_put(stacked(tx.init(x0), n), NamedSharding(mesh, P("data")))
    with pytest.raises(ValueError, match="pcast"):
        step.lower(data, x0, state)


# --------------------------------------------------------------------------- #
# Error-feedback conservation inside compressed_mean (50 steps)
# --------------------------------------------------------------------------- #
@settings(max_examples=4)
@given(seed=st.integers(0, 2**31 - 1), scale=st.floats(0.01, 100.0))
def test_compressed_mean_conserves_gradient_mass(seed, scale):
    """Σ_t n·mean_t + Σ_i m_i,T == Σ_t Σ_i g_i,t over 50 steps (β = γ = 1)."""
    n = 4
    totals = _conservation_run(jnp.float32(scale), jnp.uint32(seed))
    sent, memory, grads = (np.asarray(t, np.float64) for t in totals)
    # Each step adds one float32 rounding of |φ| ≲ 4·scale per entry to the
    # memory identity m' = φ − ĝ and to the mean; over 50 steps and 4 workers the
    # accumulated error is below 50·4·4·scale·2⁻²³·(a few) < 1e-3·scale.
    np.testing.assert_allclose(n * sent + memory, grads, rtol=0, atol=1e-3 * scale)
    assert np.abs(memory).max() > 0  # the compressor is lossy: something was kept back


@jax.jit
def _conservation_run(scale, seed):
    n, steps = 4, 50
    tx = compressed_mean(jc.compressors.scaled_sign(), "i", memory=mem.residual())
    x0 = {"w": jnp.zeros((3, 11))}

    def body(carry, t):
        state, sent, grads = carry
        g = jax.random.normal(jax.random.fold_in(jax.random.PRNGKey(seed), t), (n, 3, 11)) * scale
        u, state = jax.vmap(tx.update, axis_name="i")({"w": g}, state)
        return (state, sent + u["w"][0], grads + g.sum(0)), None

    z = jnp.zeros((3, 11))
    (state, sent, grads), _ = jax.lax.scan(body, (stacked(tx.init(x0), n), z, z), jnp.arange(steps))
    return sent, state.memory["w"].sum(0), grads


# --------------------------------------------------------------------------- #
# Bad input
# --------------------------------------------------------------------------- #
def test_axis_not_bound_in_mesh():
    n = 4
    mesh = mesh_of(n)
    tx = compressed_mean(jc.compressors.none(), "model")
    x0 = {"w": jnp.ones(3)}

    def f(g, st):
        return tx.update(g, jax.tree.map(lambda v: v[0], st))[0]

    g = jax.device_put(jnp.ones((n, 3)), NamedSharding(mesh, P("data")))
    with pytest.raises(ValueError, match="'model'"):
        jax.jit(jax.shard_map(f, mesh=mesh, in_specs=(P("data"), P("data")), out_specs=P("data")))(
            {"w": g}, stacked(tx.init(x0), n)
        )
    with pytest.raises(ValueError, match="'model'"):
        tx.update({"w": jnp.ones(3)}, tx.init(x0))  # outside any mapping


def test_strategy_the_compressor_or_communicator_cannot_serve():
    with pytest.raises(ValueError, match=r"scaled_sign.*allgather|allreduce.*scaled_sign"):
        compressed_mean(jc.compressors.scaled_sign(), "data", strategy="allreduce")
    with pytest.raises(ValueError, match="strategy must be one of"):
        compressed_mean(jc.compressors.none(), "data", strategy="ring")
    with pytest.raises(ValueError, match="strategy must be one of"):  # the record refuses it up front
        dataclasses.replace(jc.compressors.none(), strategy="neighbour")

    class SumOnly(MeshAxis):
        capabilities = frozenset({"sum"})

    with pytest.raises(ValueError, match=r"'all_gather', which communicator .* does not serve"):
        compressed_mean(jc.compressors.scaled_sign(), comm=SumOnly("data"))
    compressed_mean(jc.compressors.none(), comm=SumOnly("data"))  # allreduce is served


def test_mismatched_trees_and_types():
    tx = compressed_mean(jc.compressors.none(), "i", memory=mem.residual())
    st0 = tx.init({"w": jnp.ones(3), "b": jnp.ones(2)})
    upd = jax.vmap(tx.update, axis_name="i")
    with pytest.raises(ValueError, match="same tree"):
        upd({"w": jnp.ones((2, 3))}, stacked(st0, 2))
    with pytest.raises(ValueError, match="shape"):
        upd({"w": jnp.ones((2, 4)), "b": jnp.ones((2, 2))}, stacked(st0, 2))
    with pytest.raises(TypeError, match="compressor"):
        compressed_mean(optax.sgd(0.1), "data")
    with pytest.raises(TypeError, match="memory"):
        compressed_mean(jc.compressors.none(), "data", memory="residual")
    with pytest.raises(ValueError, match="at most one"):
        compressed_mean(jc.compressors.none(), "data", comm=MeshAxis("data"))
    with pytest.raises(ValueError, match=r"axis_name=\(slow, fast\)"):
        compressed_mean(jc.compressors.none(), "local", comm=MeshAxis("node"))
    with pytest.raises(TypeError, match="floating"):
        tx.init({"w": jnp.ones(3, jnp.int32)})
    with pytest.raises(TypeError, match="fuse must be a bool"):
        compressed_mean(jc.compressors.topk(ratio=0.1), "data", fuse="yes")


def test_powersgd_two_rounds_through_the_hook():
    """PowerSGD (compress_allreduce): P̂ = orth(Σ_i M_i Q₀), Q = Σ_i M_iᵀ P̂, mean = P̂ Qᵀ / n, m_i = M_i − mean."""
    n, shape, r = 4, (16, 12), 2
    c = jc.compressors.powersgd(matrix_approximation_rank=r)
    tx = compressed_mean(c, "i", memory=mem.residual())
    mats = np.asarray(jax.random.normal(jax.random.PRNGKey(5), (n, *shape)), np.float64)
    u, state = jax.jit(jax.vmap(tx.update, axis_name="i"))(
        {"w": jnp.asarray(mats, jnp.float32)}, stacked(tx.init({"w": jnp.zeros(shape)}), n)
    )
    # Reference: the shared key of leaf 0 draws Q₀ (PowerSGD's first step), NumPy does the rest.
    _, step_key = jax.random.split(jax.random.PRNGKey(c.seed))
    q0 = np.asarray(jax.random.normal(jax.random.split(step_key, 1)[0], (shape[1], r), jnp.float32), np.float64)
    qr, rr = np.linalg.qr(sum(mats[i] @ q0 for i in range(n)))
    p_hat = qr * np.sign(np.diag(rr))  # Gram-Schmidt's orthonormal basis (positive diagonal of R)
    q = sum(mats[i].T @ p_hat for i in range(n))
    mean = p_hat @ q.T / n
    np.testing.assert_allclose(np.asarray(u["w"][0]), mean, rtol=1e-4, atol=1e-4)
    np.testing.assert_allclose(np.asarray(state.memory["w"]), mats - mean, rtol=1e-4, atol=1e-4)
    assert int(state.wire_bits[0, 0]) == 32 * (shape[0] + shape[1]) * r  # P and Q, each allreduced once
