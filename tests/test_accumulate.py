"""Gradient accumulation that communicates once every k micro-steps (jaxcomm.transforms.accumulate).

References: a NumPy replay of SGD on the mean over workers of the mean of each k-step window;
the honest counters (zero bits and messages on the k - 1 silent micro-steps); the program's
structure (every collective inside the branch of the ``cond`` that runs on the k-th step only).
"""

from __future__ import annotations

import warnings

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
from jaxcomm.transforms import accumulate
from jaxcomm.transforms._accumulate import AccumulateState, warn_multisteps, zero_counters

N, LR = 4, 0.1
COLLECTIVES = {
    "psum",
    "psum_invariant",
    "all_gather",
    "all_gather_invariant",
    "ppermute",
    "all_to_all",
    "reduce_scatter",
    "psum_scatter",
}


def _grads(steps, seed=0):
    return np.random.default_rng(seed).normal(size=(steps, N, 5, 3)).astype(np.float32)


def _run_vmap(tx, grads):
    params = {"w": jnp.zeros((N, 5, 3))}
    state = jax.vmap(tx.init)({"w": jnp.zeros((N, 5, 3))})

    def step(p, s, g):
        u, s = tx.update({"w": g}, s, p)
        return optax.apply_updates(p, u), s

    step = jax.jit(jax.vmap(step, axis_name="data"))
    bits = []
    for g in grads:
        params, state = step(params, state, jnp.asarray(g))
        bits.append(state)
    return params, bits


@given(k=st.integers(1, 4), windows=st.integers(1, 3), seed=st.integers(0, 2**16))
@settings(max_examples=12, deadline=None)
def test_sgd_on_the_mean_of_each_window(k, windows, seed):
    """Exact mean (compressor none): params move only on every k-th step, by lr * mean_workers(mean_window(g))."""
    tx = accumulate(optax.chain(jc.compressed_mean(jc.compressors.none(), axis_name="data"), optax.sgd(LR)), k)
    grads = _grads(k * windows + (k - 1), seed)  # a trailing incomplete window must not be applied
    params, states = _run_vmap(tx, grads)
    want = np.zeros((5, 3), np.float64)
    for w in range(windows):
        want -= LR * grads[w * k : (w + 1) * k].astype(np.float64).mean(axis=(0, 1))
    np.testing.assert_allclose(np.asarray(params["w"]), np.broadcast_to(want, (N, 5, 3)), rtol=1e-5, atol=1e-6)
    # The pending window is kept, in float32: sum of the trailing k - 1 micro-gradients.
    tail = grads[k * windows :].astype(np.float64).sum(0)
    np.testing.assert_allclose(np.asarray(states[-1].grad_sum["w"]), tail, rtol=1e-5, atol=1e-5)


def test_counters_are_zero_on_silent_micro_steps():
    k = 3
    tx = accumulate(optax.chain(jc.compressed_mean(jc.compressors.topk(ratio=0.4), axis_name="data"), optax.sgd(LR)), k)
    _, states = _run_vmap(tx, _grads(7))
    bits = [int(np.asarray(s.inner_state[0].wire_bits).sum()) for s in states]
    msgs = [int(np.asarray(s.inner_state[0].messages).sum()) for s in states]
    per = bits[k - 1]
    assert per > 0 and bits == [0, 0, per, 0, 0, per, 0]
    assert msgs[k - 1] > 0 and [m > 0 for m in msgs] == [False, False, True, False, False, True, False]


def _collectives(jaxpr, inside_cond=False, found=None):
    """(primitive, inside a cond branch?) for every collective in a closed jaxpr, recursively."""
    found = [] if found is None else found
    for eqn in jaxpr.eqns:
        if eqn.primitive.name in COLLECTIVES:
            found.append((eqn.primitive.name, inside_cond))
        for v in eqn.params.values():
            for j in v if isinstance(v, (tuple, list)) else [v]:
                inner = getattr(j, "jaxpr", None)
                if inner is not None and hasattr(inner, "eqns"):
                    _collectives(inner, inside_cond or eqn.primitive.name == "cond", found)
                elif hasattr(j, "eqns"):
                    _collectives(j, inside_cond or eqn.primitive.name == "cond", found)
    return found


@pytest.mark.parametrize("strategy", ["allreduce", "allgather", "reduce_scatter", "broadcast"])
def test_every_strategy_under_shard_map_communicates_inside_the_cond_only(strategy):
    """shard_map (check_vma=True), per-worker params and state: equals the vmap run, and every
    collective of the step sits in a branch of the cond (none runs on a silent micro-step)."""
    c = jc.compressors.none() if strategy == "allreduce" else jc.compressors.topk(ratio=0.4)
    tx = accumulate(optax.chain(jc.compressed_mean(c, axis_name="data", strategy=strategy), optax.sgd(LR)), 2)
    mesh = jax.make_mesh((N,), ("data",))
    put = lambda t: jax.device_put(t, NamedSharding(mesh, P("data")))

    def step(p, s, g):
        p, s, g = jax.tree.map(lambda a: a[0], (p, s, g))
        u, s = tx.update({"w": g}, s, p)
        return jax.tree.map(lambda a: a[None], (optax.apply_updates(p, u), s))

    f = jax.jit(jax.shard_map(step, mesh=mesh, in_specs=P("data"), out_specs=P("data")))
    grads = _grads(4, seed=3)
    params = put({"w": jnp.zeros((N, 5, 3))})
    state = put(jax.vmap(tx.init)({"w": jnp.zeros((N, 5, 3))}))
    found = _collectives(jax.make_jaxpr(f)(params, state, put(jnp.asarray(grads[0]))).jaxpr)
    assert found and all(inside for _, inside in found), found
    for g in grads:
        params, state = f(params, state, put(jnp.asarray(g)))
    want, _ = _run_vmap(tx, grads)
    np.testing.assert_allclose(np.asarray(jax.device_get(params["w"])), np.asarray(want["w"]), rtol=1e-6, atol=1e-7)


def test_every_k_one_is_the_inner_transformation():
    inner = optax.chain(jc.compressed_mean(jc.compressors.topk(ratio=0.4), axis_name="data"), optax.sgd(LR))
    grads = _grads(3, seed=5)
    a, _ = _run_vmap(accumulate(inner, 1), grads)
    b, _ = _run_vmap(inner, grads)
    np.testing.assert_array_equal(np.asarray(a["w"]), np.asarray(b["w"]))


def test_16_bit_gradients_are_summed_in_float32():
    tx = accumulate(optax.sgd(1.0), 4)
    state = tx.init({"w": jnp.zeros(3, jnp.float16)})
    assert state.grad_sum["w"].dtype == jnp.float32
    for _ in range(3):
        _, state = tx.update({"w": jnp.full(3, 1e-4, jnp.float16)}, state)
    np.testing.assert_allclose(np.asarray(state.grad_sum["w"]), 3 * np.float32(np.float16(1e-4)), rtol=1e-6)


def test_zero_counters_zeroes_only_the_counters():
    s = jc.transforms.CompressionState(
        count=jnp.int32(3),
        key=jax.random.PRNGKey(0),
        memory={},
        compressor_states=(),
        wire_bits=jnp.array([5, 7]),
        messages=jnp.int32(2),
        notfinite_count=jnp.int32(1),
    )
    z = zero_counters((s, {"x": jnp.ones(2)}))
    assert int(z[0].count) == 3 and z[0].wire_bits.tolist() == [0, 0] and int(z[0].messages) == 0
    assert int(z[0].notfinite_count) == 1  # a count of steps, like count: not a per-step counter
    assert z[1]["x"].tolist() == [1.0, 1.0]


def test_bad_input():
    with pytest.raises(ValueError, match="every_k"):
        accumulate(optax.sgd(0.1), 0)
    with pytest.raises((ValueError, TypeError), match="every_k"):
        accumulate(optax.sgd(0.1), 2.5)
    with pytest.raises(TypeError, match="inner must be an optax GradientTransformation"):
        accumulate(lambda g: g, 2)
    assert isinstance(accumulate(optax.sgd(0.1), 2).init({"w": jnp.zeros(2)}), AccumulateState)


def test_multisteps_around_a_communicating_transform_is_named():
    inner = optax.chain(jc.compressed_mean(jc.compressors.topk(ratio=0.1), axis_name="data"), optax.sgd(0.1))
    state = optax.MultiSteps(inner, every_k_schedule=2).init({"w": jnp.zeros(3)})
    with pytest.warns(UserWarning, match="communicate on every micro-step"):
        assert warn_multisteps(state)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        assert not warn_multisteps(optax.MultiSteps(optax.sgd(0.1), 2).init({"w": jnp.zeros(3)}))
        assert not warn_multisteps(accumulate(inner, 2).init({"w": jnp.zeros(3)}))


def test_trainer_refuses_multisteps_around_a_communicating_transform():
    from flax import nnx

    from jaxcomm import data, models
    from jaxcomm.train import Trainer

    model = models.MLP(in_features=64, hidden=(8,), num_classes=10, rngs=nnx.Rngs(0))
    batches = data.WorkerBatches(
        data.split_iid(data.load_digits(), 2, jax.random.PRNGKey(0)), 16, jax.random.PRNGKey(1)
    )
    inner = optax.chain(jc.compressed_mean(jc.compressors.topk(ratio=0.1)), optax.sgd(0.1))
    trainer = Trainer(model, optax.MultiSteps(inner, every_k_schedule=2), num_workers=2)
    with pytest.raises(ValueError, match=r"jaxcomm.transforms.accumulate\(tx, every_k=k\)"):
        trainer.fit(trainer.init_state(), batches, 1, progress=False)
    trainer = Trainer(model, accumulate(inner, 2), num_workers=2)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        _, history = trainer.fit(trainer.init_state(), batches, 4, progress=False)
    bits = [row["wire_bits_total"] for row in history]
    assert bits[0] == bits[2] == 0 and bits[1] == bits[3] > 0  # honest: bits only on the communicating steps
