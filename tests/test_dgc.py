"""Deep Gradient Compression (Lin et al. 2018) against a NumPy transcription of its algorithm.

The reference runs, per worker k and in float64: clip the local gradient to norm
clip_norm / sqrt(N); U ← m U + G; V ← V + U; per tensor, send the exact top-k of |V|
(k = round(ρ d), ties to the lowest index) at the warm-up stage's density ρ; zero U
and V where sent; average the sent tensors over the N workers; x ← x − lr · mean
(plain SGD). Gradients depend on the parameters (g_k = a_k ⊙ x − b_k), so a wrong
mean, memory or stage shows up in the later steps.
"""

from __future__ import annotations

import dataclasses
import math

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from jax.sharding import Mesh
from jax.sharding import PartitionSpec as P

import jaxcomm as jc
from jaxcomm.compressors import topk
from jaxcomm.compressors._sparse import num_selected
from jaxcomm.transforms import compressed_mean, dgc_warmup, local_clip, topk_warmup

SHAPES = {"b": (12,), "w": (6, 7)}  # dict order == jax.tree.leaves order (sorted keys)
N = 4
LR = 0.1
MOMENTUM = 0.9
CLIP = 8.0  # each worker clips to 8 / sqrt(4) = 4; the first gradients have norms near 11-12, so it bites
RATIO = 0.05  # after the warm-up; the stages keep 25 % and 6.25 % (1.5625 % < 5 % ends the warm-up)
STEPS_PER_STAGE = 2
STEPS = 6  # stages 0, 0, 1, 1, then the final ratio twice


def stacked(tree, n):
    return jax.tree.map(lambda v: jnp.broadcast_to(v, (n, *jnp.shape(v))), tree)


def problem(seed=0):
    rng = np.random.default_rng(seed)
    a = {k: rng.uniform(0.5, 1.5, size=(N, *s)).astype(np.float32) for k, s in SHAPES.items()}
    b = {k: rng.normal(size=(N, *s)).astype(np.float32) for k, s in SHAPES.items()}
    x0 = {k: rng.normal(size=s).astype(np.float32) for k, s in SHAPES.items()}
    return a, b, x0


def stage_ratio(t, steps_per_stage=STEPS_PER_STAGE):
    """The density at 0-based step t: (1 - 0.75)^(stage + 1) during the warm-up, then RATIO."""
    stage = t // steps_per_stage
    density = 0.25 ** (stage + 1)
    return density if density > RATIO else RATIO


# --------------------------------------------------------------------------- #
# NumPy references
# --------------------------------------------------------------------------- #
def clip_np(g: dict, max_norm: float, n: int) -> dict:
    thr = max_norm / math.sqrt(n)
    norm = math.sqrt(sum(float(np.sum(np.asarray(v, np.float64) ** 2)) for v in g.values()))
    return {k: np.asarray(v, np.float64) * (1.0 if norm < thr else thr / norm) for k, v in g.items()}


def topk_mask_np(v, ratio):
    flat = np.ravel(v)
    k = num_selected(ratio, flat.size)
    idx = np.argsort(-np.abs(flat), kind="stable")[:k]  # ties to the lowest index
    mask = np.zeros(flat.size, bool)
    mask[idx] = True
    return mask.reshape(np.shape(v))


def dgc_np(a, b, x0, steps, clip_norm=CLIP, steps_per_stage=STEPS_PER_STAGE):
    """DGC for momentum SGD on N workers; returns the parameters after every step."""
    x = {k: np.asarray(v, np.float64) for k, v in x0.items()}
    U = [{k: np.zeros(s) for k, s in SHAPES.items()} for _ in range(N)]
    V = [{k: np.zeros(s) for k, s in SHAPES.items()} for _ in range(N)]
    history = []
    for t in range(steps):
        ratio = stage_ratio(t, steps_per_stage)
        sent_sum = {k: np.zeros(s) for k, s in SHAPES.items()}
        for w in range(N):
            g = {k: a[k][w] * x[k] - b[k][w] for k in SHAPES}
            g = clip_np(g, clip_norm, N) if clip_norm else g
            for k in SHAPES:
                U[w][k] = MOMENTUM * U[w][k] + g[k]  # momentum correction
                V[w][k] = V[w][k] + U[w][k]
                mask = topk_mask_np(V[w][k], ratio)
                sent_sum[k] += np.where(mask, V[w][k], 0.0)
                V[w][k] = np.where(mask, 0.0, V[w][k])  # momentum factor masking
                U[w][k] = np.where(mask, 0.0, U[w][k])
        x = {k: x[k] - LR * sent_sum[k] / N for k in SHAPES}  # plain SGD on the mean
        history.append(x)
    return history


def make_tx(**kwargs):
    dgc = jc.deep_gradient_compression(
        RATIO, momentum=MOMENTUM, clip_norm=CLIP, steps_per_stage=STEPS_PER_STAGE, axis_name="data", **kwargs
    )
    return optax.chain(dgc, optax.sgd(LR))


def worker_step(tx):
    def step(x, a, b, state):
        g = jax.tree.map(lambda a_, x_, b_: a_ * x_ - b_, a, x, b)
        updates, state = tx.update(g, state, x)
        return optax.apply_updates(x, updates), state

    return step


# --------------------------------------------------------------------------- #
# (a) local clipping
# --------------------------------------------------------------------------- #
@pytest.mark.parametrize("n", [1, 4])
@pytest.mark.parametrize("scale", [0.1, 10.0])  # norms below and above the threshold
def test_local_clip_matches_numpy(n, scale):
    rng = np.random.default_rng(1)
    g = {k: (scale * rng.normal(size=(n, *s))).astype(np.float32) for k, s in SHAPES.items()}
    tx = local_clip(3.0, axis_name="data")
    state = tx.init({k: jnp.zeros(s) for k, s in SHAPES.items()})
    out, _ = jax.vmap(lambda u: tx.update(u, state), axis_name="data")(g)
    clipped_any = False
    for w in range(n):
        ref = clip_np({k: v[w] for k, v in g.items()}, 3.0, n)
        for k in SHAPES:
            assert out[k].dtype == jnp.float32
            np.testing.assert_allclose(np.asarray(out[k][w]), ref[k], rtol=1e-6, atol=1e-7)
        norm = math.sqrt(sum(float(np.sum(ref[k] ** 2)) for k in SHAPES))
        assert norm <= 3.0 / math.sqrt(n) * (1 + 1e-9)
        clipped_any |= not np.allclose(ref["w"], g["w"][w])
    assert clipped_any == (scale > 1)  # the large gradients were clipped, the small ones kept


# --------------------------------------------------------------------------- #
# (b), (c) the whole recipe against Algorithm 1, and the wire bits of every stage
# --------------------------------------------------------------------------- #
def expected_bits(ratio):
    """Per tensor: the bits of the top-k payload at this density (k values + k narrow indices)."""
    return [
        int(jc.wire_bits(topk(ratio=ratio).compress(jnp.zeros(s, jnp.float32), jax.random.PRNGKey(0))[0]))
        for s in SHAPES.values()
    ]


def test_recipe_matches_numpy_dgc_across_stages_with_exact_wire_bits():
    assert [stage_ratio(t) for t in range(STEPS)] == [0.25, 0.25, 0.0625, 0.0625, 0.05, 0.05]
    a, b, x0 = problem()
    tx = make_tx()
    state = stacked(tx.init(x0), N)
    x = stacked(x0, N)
    step = jax.jit(jax.vmap(worker_step(tx), axis_name="data"))
    reference = dgc_np(a, b, x0, STEPS)
    for t in range(STEPS):
        x, state = step(x, a, b, state)
        for k in SHAPES:
            for w in range(N):
                np.testing.assert_allclose(np.asarray(x[k][w]), reference[t][k], rtol=2e-5, atol=2e-6)
        # Exact per-stage volume: every worker sent exactly its stage's payload per tensor.
        bits = np.asarray(state[0][1].wire_bits)
        want = expected_bits(stage_ratio(t))
        assert bits.shape == (N, len(SHAPES))
        assert (bits == np.asarray(want)[None]).all(), (t, bits, want)
    # the three densities give three different volumes on "w" (k = 11, 3, 2 of 42 entries)
    assert len({expected_bits(r)[1] for r in (0.25, 0.0625, 0.05)}) == 3


def test_topk_warmup_densities_are_dgc_warmup_stages():
    stages = topk_warmup(0.001, steps_per_stage=5)
    ratios = [c.params["ratio"] for _, c in stages]
    assert ratios == [0.25, 0.0625, 0.015625, 0.00390625]  # drop 75 %, 93.75 %, 98.4375 %, 99.61 %, then 99.9 %
    assert all(steps == 5 for steps, _ in stages)
    schedule = dgc_warmup(0.999, steps_per_stage=5)
    for j, r in enumerate(ratios):
        np.testing.assert_allclose(1.0 - float(schedule(jnp.int32(5 * j))), r, rtol=1e-6)
    assert topk_warmup(0.25, steps_per_stage=5) == ()  # the first stage would not be denser than the end


# --------------------------------------------------------------------------- #
# shard_map with jax's varying-axes check
# --------------------------------------------------------------------------- #
def test_recipe_in_shard_map_with_check_vma():
    steps = 3
    a, b, x0 = problem(2)
    tx = optax.chain(
        jc.deep_gradient_compression(RATIO, momentum=MOMENTUM, clip_norm=CLIP, steps_per_stage=1, axis_name="data"),
        optax.sgd(LR),
    )
    mesh = Mesh(np.array(jax.devices()[:N]), ("data",))

    def worker(x, a_, b_, state):
        x, a_, b_, state = jax.tree.map(lambda v: v[0], (x, a_, b_, state))
        x, state = worker_step(tx)(x, a_, b_, state)
        return jax.tree.map(lambda v: v[None], (x, state))

    step = jax.jit(jax.shard_map(worker, mesh=mesh, in_specs=(P("data"),) * 4, out_specs=P("data"), check_vma=True))
    x, state = stacked(x0, N), stacked(tx.init(x0), N)
    for _ in range(steps):
        x, state = step(x, a, b, state)
    # the reference with one step per stage: densities 25 %, 6.25 %, then 5 %
    reference = dgc_np(a, b, x0, steps, steps_per_stage=1)[-1]
    x = jax.device_get(x)
    for k in SHAPES:
        for w in range(N):
            np.testing.assert_allclose(x[k][w], reference[k], rtol=2e-5, atol=2e-6)


# --------------------------------------------------------------------------- #
# (d) bad input
# --------------------------------------------------------------------------- #
@pytest.mark.parametrize(
    "warmup, error, match",
    [
        (((2, topk(ratio=0.5, reuse_threshold=True)),), ValueError, r"warmup\[0\].*same state"),
        (((2, topk(ratio=0.5)), (2.5, topk(ratio=0.25))), TypeError, r"warmup\[1\] steps"),
        (((0, topk(ratio=0.5)),), ValueError, r"warmup\[0\] steps"),
        ((topk(ratio=0.5),), TypeError, r"warmup\[0\]"),
        (((2, "topk"),), TypeError, r"warmup\[0\] compressor"),
        ("topk", TypeError, "warmup"),
    ],
)
def test_bad_warmup(warmup, error, match):
    with pytest.raises(error, match=match):
        compressed_mean(topk(ratio=0.1), "data", warmup=warmup)


def test_stateful_main_compressor_refuses_stateless_stages():
    with pytest.raises(ValueError, match=r"warmup\[0\]"):
        compressed_mean(topk(ratio=0.1, reuse_threshold=True), "data", warmup=((2, topk(ratio=0.5)),))


def test_stage_strategy_is_checked_and_named():
    with pytest.raises(ValueError, match=r"warmup\[0\].*allreduce"):
        compressed_mean(jc.compressors.none(), "data", strategy="allreduce", warmup=((2, topk(ratio=0.5)),))


@pytest.mark.parametrize("max_norm", [0.0, -1.0, float("inf"), float("nan")])
def test_bad_max_norm(max_norm):
    with pytest.raises(ValueError, match="max_norm"):
        local_clip(max_norm, axis_name="data")
    with pytest.raises(ValueError, match="clip_norm"):
        jc.deep_gradient_compression(clip_norm=max_norm, axis_name="data")
    with pytest.raises(ValueError, match="clip_norm"):
        jc.gradient_dropping(0.9, clip_norm=max_norm, axis_name="data")


def test_bad_recipe_and_schedule_arguments():
    with pytest.raises(TypeError, match="max_norm"):
        local_clip("1.0", axis_name="data")
    with pytest.raises(ValueError, match="steps_per_stage"):
        jc.deep_gradient_compression(steps_per_stage=-1, axis_name="data")
    with pytest.raises(TypeError, match="steps_per_stage"):
        topk_warmup(0.001, steps_per_stage=1.5)
    with pytest.raises(ValueError, match="final_ratio"):
        topk_warmup(0.0, steps_per_stage=10)
    with pytest.raises(ValueError, match="initial_drop_ratio"):
        topk_warmup(0.001, steps_per_stage=10, initial_drop_ratio=1.0)
    with pytest.raises(ValueError, match="momentum"):
        jc.deep_gradient_compression(momentum=1.0, axis_name="data")


def test_dense_warmup_then_stages_then_the_compressor():
    """A compressor's own dense warm-up runs first, as a branch of the same switch, then the stages."""
    n, shape = 3, (10,)
    main = dataclasses.replace(topk(ratio=0.1), dense_warmup=1)
    tx = compressed_mean(main, "data", warmup=((2, topk(ratio=0.5)),))
    state = stacked(tx.init(jnp.zeros(shape)), n)
    g = np.random.default_rng(3).normal(size=(4, n, *shape)).astype(np.float32)
    update = jax.jit(jax.vmap(tx.update, axis_name="data"))
    for t, (ratio, bits) in enumerate([(1.0, 10 * 32), (0.5, 5 * 40), (0.5, 5 * 40), (0.1, 1 * 40)]):
        out, state = update(g[t], state)
        want = np.mean([np.where(topk_mask_np(g[t][w], ratio), g[t][w], 0.0) for w in range(n)], axis=0)
        np.testing.assert_allclose(np.asarray(out)[0], want, rtol=1e-6, atol=1e-7)
        assert (np.asarray(state.wire_bits) == bits).all(), (t, np.asarray(state.wire_bits), bits)
