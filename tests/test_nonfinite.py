"""Non-finite gradients: ``skip_nonfinite=True`` skips the step on every worker, state untouched.

Four simulated devices in ``jax.shard_map(check_vma=True)``; worker 1's gradient has a NaN at
step ``BAD``, every other gradient is finite. With the policy on, every worker outputs zeros at
that step and keeps its state (count, key, memories, compressor states) as it was, so every
later output equals the run without that step: a float32 NumPy run of GRACE Algorithm 1 with
each memory of :mod:`jaxcomm.memory` and a compressor per strategy of the pipeline, or, for the
other transforms on the pipeline, the library's own run on the gradients without that step.
"""

from __future__ import annotations

import functools
import math

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from hlo_collectives import collectives
from jax.sharding import Mesh, NamedSharding
from jax.sharding import PartitionSpec as P

import jaxcomm as jc
from jaxcomm import memory as mem
from jaxcomm.compressors._randomk import randomk_indices
from jaxcomm.transforms import compressed_mean

N = 4
SHAPES = {"b": (5,), "w": (2, 6)}  # dict order == jax.tree.leaves order (sorted keys)
NAMES = sorted(SHAPES)
STEPS = 4
BAD = 1  # worker 1's gradient has a NaN at this step


def gradients(seed=0) -> list[dict]:
    """``STEPS`` finite gradient trees with a leading worker axis of ``N`` (float32)."""
    rng = np.random.default_rng(seed)
    return [{k: rng.normal(size=(N, *s)).astype(np.float32) for k, s in SHAPES.items()} for _ in range(STEPS)]


def with_nan(seq: list[dict]) -> list[dict]:
    out = [{k: v.copy() for k, v in g.items()} for g in seq]
    out[BAD]["w"][1, 1, 3] = np.nan
    return out


# --------------------------------------------------------------------------- #
# The NumPy reference (float32, the library's order of operations)
# --------------------------------------------------------------------------- #
def _k(ratio: float, d: int) -> int:
    return max(1, math.floor(ratio * d + 0.5))  # round half up


def randomk_np(phi, key):
    flat = phi.ravel()
    idx = np.asarray(randomk_indices(key, flat.size, _k(0.5, flat.size)))
    out = np.zeros_like(flat)
    out[idx] = flat[idx]
    return out.reshape(phi.shape)


def topk_np(phi, key):
    flat = phi.ravel()
    idx = np.argsort(-np.abs(flat), kind="stable")[: _k(0.25, flat.size)]
    out = np.zeros_like(flat)
    out[idx] = flat[idx]
    return out.reshape(phi.shape)


def threshold_np(phi, key):
    return np.where(np.abs(phi) >= np.float32(0.5), phi, np.float32(0))


def scaled_sign_np(phi, key):
    return np.sqrt(np.mean(phi * phi, dtype=np.float32)) * np.where(phi < 0, np.float32(-1), np.float32(1))


def fp16_np(phi, key):
    return phi.astype(np.float16).astype(np.float32)


# strategy, compressor, its NumPy twin, memory (name, parameter), how the mean is formed
CASES = {
    "allreduce": ("allreduce", lambda: jc.compressors.randomk(ratio=0.5), randomk_np, ("none", None), "mean"),
    "allgather": ("allgather", lambda: jc.compressors.topk(ratio=0.25), topk_np, ("dgc", 0.9), "mean"),
    "allgather_counted": (
        "allgather",
        lambda: jc.compressors.threshold(v=0.5),
        threshold_np,
        ("residual", 0.5),
        "mean",
    ),
    "broadcast": ("broadcast", jc.compressors.scaled_sign, scaled_sign_np, ("efsignsgd", 0.5), "mean"),
    "reduce_scatter": ("reduce_scatter", jc.compressors.fp16, fp16_np, ("residual", 1.0), "owners"),
    # full rank: PowerSGD's two rounds reproduce the mean, and the memory keeps φ_i − mean
    "rounds": (
        "allreduce",
        lambda: jc.compressors.powersgd(rank=2, min_compression_rate=0.1),
        None,
        ("residual", 0.5),
        "exact",
    ),
}


def memory_of(name, param):
    if name == "none":
        return mem.none()
    if name == "residual":
        return mem.residual(beta=param)
    if name == "dgc":
        return mem.dgc(param)
    return mem.efsignsgd(param)


def reference(case: str, seq: list[dict]) -> list[dict]:
    """The outputs (identical on every worker) of ``compressed_mean`` on the gradients ``seq``."""
    _, _, q, (name, param), route = CASES[case]
    f32 = np.float32
    m = {k: np.zeros((N, *s), f32) for k, s in SHAPES.items()}
    u = {k: np.zeros((N, *s), f32) for k, s in SHAPES.items()}  # dgc's momentum (m is its accumulation)
    key = jax.random.PRNGKey(0)
    outs = []
    for g in seq:
        key, step_key = jax.random.split(key)
        leaf_keys = jax.random.split(step_key, len(NAMES))
        out = {}
        for j, k in enumerate(NAMES):
            if name == "none":
                phi = g[k]
            elif name == "residual":
                phi = f32(param) * m[k] + g[k]
            elif name == "dgc":
                u[k] = f32(param) * u[k] + g[k]
                phi = m[k] + u[k]
            else:  # efsignsgd
                phi = m[k] + f32(param) * g[k]
            if route == "exact":
                own = np.broadcast_to(phi.mean(axis=0, dtype=f32), phi.shape)
                mean = own[0]
            else:
                own = np.stack([q(phi[i], leaf_keys[j]) for i in range(N)])
                mean = own.sum(axis=0, dtype=f32) / f32(N)
            new_m = phi - own
            if route == "owners":  # each chunk's owner re-compresses the mean and keeps n (mean − Q(mean))
                avg = q(mean, None)
                d = avg.size
                owner = np.arange(d) // -(-d // N)
                for i in range(N):
                    new_m[i] += np.where(owner == i, f32(N) * (mean - avg).ravel(), f32(0)).reshape(avg.shape)
                mean = avg
            if name == "dgc":
                sent = own != 0
                u[k], new_m = np.where(sent, f32(0), u[k]), np.where(sent, f32(0), phi)
            if name != "none":
                m[k] = new_m
            out[k] = mean / f32(param) if name == "efsignsgd" else mean
        outs.append(out)
    return outs


# --------------------------------------------------------------------------- #
# The mesh harness: one jitted step per transform
# --------------------------------------------------------------------------- #
@functools.cache
def mesh():
    return Mesh(np.array(jax.devices()[:N]), ("data",))


def put(tree):
    return jax.device_put(tree, NamedSharding(mesh(), P("data")))


def stacked(tree):
    return jax.tree.map(lambda v: jnp.broadcast_to(jnp.asarray(v), (N, *jnp.shape(v))), tree)


def step_of(tx, with_params=False):
    """``(g, state) -> (outputs, state)``, every array with a leading worker axis."""
    params = {k: jnp.ones(s, jnp.float32) for k, s in SHAPES.items()}

    def worker(g, state):
        g, state = jax.tree.map(lambda v: v[0], (g, state))
        x = jax.lax.pcast(params, "data", to="varying")
        out, state = tx.update(g, state, x) if with_params else tx.update(g, state)
        return jax.tree.map(lambda v: v[None], (out, state))

    f = jax.jit(jax.shard_map(worker, mesh=mesh(), in_specs=(P("data"), P("data")), out_specs=P("data")))
    return f, put(stacked(tx.init(params)))


def run(f, state, seq):
    """Outputs per step and the states after every step."""
    outs, states = [], []
    for g in seq:
        out, state = f(put(g), state)
        outs.append(jax.tree.map(np.asarray, out))
        states.append(state)
    return outs, states


def compression_states(state):
    is_cs = lambda node: isinstance(node, jc.transforms.CompressionState)
    return [s for s in jax.tree.leaves(state, is_leaf=is_cs) if is_cs(s)]


def assert_skipped(before, after):
    """``after`` is ``before`` with one more skipped step: counters hold only the flag's all-reduce."""
    for b, a in zip(compression_states(before), compression_states(after)):
        kept = lambda s: (s.count, s.key, s.memory, s.compressor_states)
        jax.tree.map(np.testing.assert_array_equal, kept(b), kept(a))
        np.testing.assert_array_equal(np.asarray(a.notfinite_count), np.asarray(b.notfinite_count) + 1)
    first = compression_states(after)[0]
    bits = np.asarray(first.wire_bits)
    assert bits[:, 0].tolist() == [32] * N and not bits[:, 1:].any()  # the int32 flag, on the first tensor
    assert np.asarray(first.messages).tolist() == [1] * N


# --------------------------------------------------------------------------- #
# compressed_mean: every strategy, every memory, against NumPy
# --------------------------------------------------------------------------- #
@pytest.mark.parametrize("case", sorted(CASES))
def test_skipped_step_leaves_the_run_of_the_other_steps(case):
    strategy, compressor, _, memory, route = CASES[case]
    tx = compressed_mean(compressor(), "data", memory=memory_of(*memory), strategy=strategy, skip_nonfinite=True)
    f, state0 = step_of(tx)
    clean = gradients()
    outs, states = run(f, state0, with_nan(clean))

    assert_skipped(states[BAD - 1], states[BAD])
    for k in NAMES:
        np.testing.assert_array_equal(outs[BAD][k], 0.0)
    want = reference(case, clean[:BAD] + clean[BAD + 1 :])
    tol = 2e-5 if route == "exact" else 1e-6  # PowerSGD: Gram-Schmidt's rounding; else summation order
    for t, out in enumerate(outs):
        if t == BAD:
            continue
        for k in NAMES:
            assert np.isfinite(out[k]).all(), (t, k)
            for i in range(1, N):  # every worker outputs the same mean
                np.testing.assert_array_equal(out[k][i], out[k][0], err_msg=f"step {t}, {k}: worker {i}")
            np.testing.assert_allclose(out[k][0], want[t - (t > BAD)][k], rtol=tol, atol=tol, err_msg=f"{t} {k}")
    last = states[-1]
    assert np.asarray(last.notfinite_count).tolist() == [1] * N
    assert np.asarray(last.count).tolist() == [STEPS - 1] * N

    # The lowered program: the flag's int32 all-reduce before the cond, the step's collectives in its
    # run branch and none in the skip branch; wire_bits counts both.
    found = collectives(f.lower(put(clean[0]), state0).as_text(dialect="hlo"), N)
    assert found.fixed == [("all-reduce", 4)]
    ((run_bytes, skip_bytes),) = found.switches
    assert skip_bytes == 0 and run_bytes > 0
    if strategy != "broadcast":  # on a mesh a broadcast is an all-reduce of n payloads; a worker sends one
        np.testing.assert_array_equal(np.asarray(states[0].wire_bits).sum(axis=1), 8 * (4 + run_bytes))


# --------------------------------------------------------------------------- #
# The other transforms on the pipeline: the run equals their run without that step
# --------------------------------------------------------------------------- #
OTHERS = {
    # server="replicated" goes through the same if_finite call; "sharded" adds the owners' memory
    "doublesqueeze_sharded": lambda: jc.transforms.doublesqueeze(
        jc.compressors.scaled_sign(), axis_name="data", server="sharded", skip_nonfinite=True
    ),
    "gradient_dropping": lambda: jc.transforms.gradient_dropping(
        0.75, mode="partial", axis_name="data", skip_nonfinite=True
    ),
    # a warm-up stage of one step: the skipped step does not advance the stages
    "deep_gradient_compression": lambda: jc.transforms.deep_gradient_compression(
        0.25, steps_per_stage=1, initial_drop_ratio=0.5, clip_norm=10.0, axis_name="data", skip_nonfinite=True
    ),
}


@pytest.mark.parametrize("name", sorted(OTHERS))
def test_other_transforms_skip_the_step_on_every_worker(name):
    f, state0 = step_of(OTHERS[name]())
    clean = gradients(seed=1)
    outs, states = run(f, state0, with_nan(clean))
    want, want_states = run(f, state0, clean[:BAD] + clean[BAD + 1 :])

    assert_skipped(states[BAD - 1], states[BAD])
    for t, out in enumerate(outs):
        for k in NAMES:
            if t == BAD:
                np.testing.assert_array_equal(out[k], 0.0)
            else:  # the same compiled step on the same inputs: bit for bit
                assert np.isfinite(out[k]).all(), (t, k)
                np.testing.assert_array_equal(out[k], want[t - (t > BAD)][k], err_msg=f"step {t}, {k}")
    for got, ref in zip(compression_states(states[-1]), compression_states(want_states[-1])):
        jax.tree.map(np.testing.assert_array_equal, got._replace(notfinite_count=0), ref._replace(notfinite_count=0))
        assert np.asarray(got.notfinite_count).tolist() == [1] * N


def test_diloco_skips_the_exchange_and_keeps_the_memory():
    tx = jc.transforms.diloco(
        optax.sgd(0.1),
        2,
        outer=optax.sgd(1.0),
        compressor=jc.compressors.topk(ratio=0.25),
        memory=mem.residual(),
        axis_name="data",
        skip_nonfinite=True,
    )
    f, state0 = step_of(tx, with_params=True)
    outs, states = run(f, state0, with_nan(gradients(seed=2)))  # BAD = 1: the first exchange (t = 2)
    exchange = lambda s: s.exchange_states[0]
    assert_skipped(exchange(states[BAD - 1]), exchange(states[BAD]))
    np.testing.assert_array_equal(np.asarray(exchange(states[BAD]).memory[1]), 0.0)  # ["b", "w"]: no NaN kept
    for k in NAMES:
        assert np.isfinite(np.asarray(states[-1].anchor[k])).all()
        assert np.isfinite(outs[-1][k]).all()
    assert np.asarray(exchange(states[-1]).notfinite_count).tolist() == [1] * N


# --------------------------------------------------------------------------- #
# One worker; the policy off
# --------------------------------------------------------------------------- #
def test_error_feedback_skip_equals_optax_apply_if_finite():
    """Alone, a worker's skip is ``optax.apply_if_finite`` around the transform (zeros, state kept)."""
    tx = jc.transforms.error_feedback(jc.compressors.topk(ratio=0.25), skip_nonfinite=True)
    wrapped = optax.apply_if_finite(jc.transforms.error_feedback(jc.compressors.topk(ratio=0.25)), 10)
    params = {k: jnp.zeros(s, jnp.float32) for k, s in SHAPES.items()}
    s, w = tx.init(params), wrapped.init(params)
    step, wstep = jax.jit(tx.update), jax.jit(wrapped.update)
    for g in with_nan(gradients(seed=3)):
        g = {k: jnp.asarray(v[1]) for k, v in g.items()}  # worker 1's gradients: NaN at step BAD
        (out, s), (ref, w) = step(g, s), wstep(g, w)
        jax.tree.map(np.testing.assert_array_equal, out, ref)
    jax.tree.map(
        np.testing.assert_array_equal, s._replace(notfinite_count=0), w.inner_state._replace(notfinite_count=0)
    )
    assert int(s.notfinite_count) == int(w.total_notfinite) == 1


def test_without_the_policy_the_count_is_kept_and_nothing_is_sent_for_it():
    """``skip_nonfinite=False``: the step runs (the NaN reaches the mean and the memory), no flag is
    sent, and each worker counts its own non-finite gradients."""
    tx = compressed_mean(jc.compressors.topk(ratio=0.25), "data", memory=mem.residual())
    f, state0 = step_of(tx)
    outs, states = run(f, state0, with_nan(gradients()))
    assert np.asarray(states[-1].notfinite_count).tolist() == [0, 1, 0, 0]
    assert np.asarray(states[-1].count).tolist() == [STEPS] * N
    assert np.isnan(outs[-1]["w"]).any()  # the residual memory kept the NaN (why the policy exists)
    assert np.asarray(states[BAD].messages).tolist() == np.asarray(states[0].messages).tolist()


def test_skip_nonfinite_must_be_a_bool():
    for make in (
        lambda: compressed_mean(jc.compressors.topk(ratio=0.5), "data", skip_nonfinite=1),
        lambda: jc.transforms.error_feedback(jc.compressors.topk(ratio=0.5), skip_nonfinite="yes"),
        lambda: jc.transforms.doublesqueeze(jc.compressors.scaled_sign(), axis_name="data", skip_nonfinite=None),
        lambda: jc.transforms.gradient_dropping(0.5, axis_name="data", skip_nonfinite=0),
    ):
        with pytest.raises(TypeError, match="skip_nonfinite"):
            make()
    with pytest.raises(ValueError, match="skip_nonfinite"):
        jc.transforms.diloco(optax.sgd(0.1), 2, axis_name="data", overlap=True, skip_nonfinite=True)
