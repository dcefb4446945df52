"""The DDP habit: one replicated copy of the parameters (``P()``), the gradient made per-worker
with one documented cast, and a compressed mean that leaves ``jax.shard_map`` with ``out_specs=P()``.

Inside ``shard_map(check_vma=True)`` a value may leave with ``out_specs=P()`` only if jax types
it device-invariant. The compressed mean is the same on every worker; the pipeline's collectives
(``psum`` for ``"allreduce"`` and rounds, the invariant all-gather for ``"allgather"`` and
``"reduce_scatter"``) type it so. The reference is the NumPy mean of the workers' own round trips
``Q⁻¹(Q(g_i))`` under the documented key schedule (``compressed_mean``'s docstring), or, for
``"reduce_scatter"`` (chunks re-compressed by their owners), the same transform run under
``jax.vmap``, which ``test_compressed_mean.py`` checks against NumPy.

The transform state is laid out by ``jaxcomm.transforms.state_layout``: the compressing
transforms' state per worker (``P("data")``, key ``P()``), an optimizer's state after the mean
replicated (``P()``). With adam, momentum SGD and adamw on a schedule after the mean, the
parameters after a few steps are the NumPy optimizer's on the NumPy mean of the workers'
decompressed gradients, identical on every worker.
"""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from compressor_examples import MEAN_KWARGS
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

import jaxcomm as jc
from jaxcomm.transforms import compressed_mean, state_layout

N = 4
LR = 0.1
X0 = {"b": np.linspace(-1.0, 1.0, 5, dtype=np.float32), "w": np.linspace(-2.0, 2.0, 42, dtype=np.float32).reshape(6, 7)}


def _batch():
    rng = np.random.default_rng(0)
    return rng.standard_normal((N, 3)).astype(np.float32)


def _loss(p, data):
    # Per-worker gradient depends on the worker's batch: g_i = 2 (p - mean(data_i)) * (1 + |data_i|_1).
    return sum(jnp.sum((p[k] - jnp.mean(data)) ** 2) * (1.0 + jnp.sum(jnp.abs(data))) for k in p)


def _mesh():
    return jax.make_mesh((N,), ("data",), axis_types=(jax.sharding.AxisType.Explicit,), devices=jax.devices()[:N])


def _ddp_step(tx, mesh, layout):
    """params P() (one replicated copy), batch P('data'), the transform state laid out by ``layout``."""

    def worker(params, batch, state):
        batch, state = batch[0], layout.local(state)
        local = jax.lax.pcast(params, "data", to="varying")  # the one documented cast
        g = jax.grad(_loss)(local, batch)
        u, state = tx.update(g, state, params)
        return optax.apply_updates(params, u), layout.stacked(state)

    f = jax.shard_map(
        worker, mesh=mesh, in_specs=(P(), P("data"), layout.specs), out_specs=(P(), layout.specs), check_vma=True
    )
    return jax.jit(f)


def _place(mesh, params, batch, layout):
    return (
        jax.device_put(params, NamedSharding(mesh, P())),
        jax.device_put(batch, NamedSharding(mesh, P("data"))),
        layout.init(params, mesh),
    )


def _grads(batch):
    return [jax.grad(_loss)(jax.tree.map(jnp.asarray, X0), batch[i]) for i in range(N)]


def _leaf_key(c: jc.compressors.Compressor, step: int, leaf: int):
    """The key schedule as documented: at each step ``key, step_key = split(key)`` from
    ``PRNGKey(seed)``; leaf ``j`` of step ``t`` draws from ``split(step_key, num_leaves)[j]``."""
    key = jax.random.PRNGKey(c.seed)
    for _ in range(step + 1):
        key, step_key = jax.random.split(key)
    return jax.random.split(step_key, len(X0))[leaf]


def _numpy_mean_of_roundtrips(c: jc.compressors.Compressor, grads):
    """(1/n) Σ_i Q⁻¹(Q(g_i)) per leaf at the first step, keys as documented (``_leaf_key``), folded with
    the worker (the shared leaf key where the payload has fields that are not summed)."""
    names = sorted(X0)
    leaf_keys = [_leaf_key(c, 0, j) for j in range(len(names))]
    roundtrip = jax.jit(lambda g, key: c.roundtrip(g, key, c.init_state(g))[0])  # one program per leaf shape
    out = {}
    for j, name in enumerate(names):
        hats = []
        for i in range(N):
            g = grads[i][name]
            shared = False
            if c.strategy == "allreduce":
                p, _ = c.compress(g, leaf_keys[j])
                data = [f.name for f in dataclasses.fields(p) if not f.metadata.get("static")]
                shared = any(f not in type(p).summable for f in data)
            key = leaf_keys[j] if shared else jax.random.fold_in(leaf_keys[j], i)
            hats.append(np.asarray(roundtrip(g, key), np.float64))
        out[name] = np.mean(hats, axis=0)
    return out


def _vmap_mean(tx, grads):
    g = jax.tree.map(lambda *xs: jnp.stack(xs), *grads)
    state = jax.tree.map(lambda v: jnp.broadcast_to(v, (N, *jnp.shape(v))), tx.init(X0))
    u, _ = jax.jit(jax.vmap(tx.update, axis_name="data"))(g, state)
    return jax.tree.map(lambda v: np.asarray(v[0], np.float64), u)


def _run(name, strategy):
    c = jc.compressors.make(name, **MEAN_KWARGS.get(name, {}))
    mean_tx = compressed_mean(c, "data", strategy=strategy)
    tx = optax.chain(mean_tx, optax.sgd(LR))
    mesh = _mesh()
    batch = _batch()
    layout = state_layout(tx, X0, "data")
    params, batch_d, state = _place(mesh, X0, batch, layout)
    new, _ = _ddp_step(tx, mesh, layout)(params, batch_d, state)
    assert all(leaf.sharding.is_fully_replicated for leaf in jax.tree.leaves(new))  # one replicated copy
    grads = _grads(batch)
    if strategy == "reduce_scatter" or (c.rounds is not None and strategy in ("auto", "allreduce")):
        mean = _vmap_mean(mean_tx, grads)
    else:
        mean = _numpy_mean_of_roundtrips(c, grads)
    tol = 2e-2 if name in ("fp16", "bf16") else 1e-5  # 16-bit payloads are summed in 16 bits on the wire
    for k in X0:
        np.testing.assert_allclose(
            np.asarray(new[k], np.float64), X0[k] - LR * mean[k], rtol=tol, atol=tol, err_msg=f"{name} {strategy}"
        )


@pytest.mark.parametrize("name", jc.compressors.names())
def test_every_compressor_trains_ddp_style(name):
    """Replicated params + one pcast + compressed_mean (the compressor's own strategy): out_specs=P() holds
    and the update is params − lr · (NumPy mean of the workers' round trips)."""
    _run(name, "auto")


STRATEGY_CASES = [
    ("none", "allreduce"),
    ("none", "allgather"),
    ("none", "reduce_scatter"),
    ("topk", "allgather"),
    ("topk", "reduce_scatter"),
    ("threshold", "allgather"),  # count-prefixed payload: the variable-length all-gather
    ("qsgd", "reduce_scatter"),
    ("randomk", "allreduce"),  # shared-key fields
    ("powersgd", "allreduce"),  # rounds
]


@pytest.mark.parametrize(("name", "strategy"), STRATEGY_CASES)
def test_every_strategy_trains_ddp_style(name, strategy):
    _run(name, strategy)


def test_broadcast_strategy_mean_is_typed_varying():
    """jax types a ppermute's result device-varying (it has no invariant point-to-point), so the
    "broadcast" strategy's mean cannot leave with out_specs=P() (it keeps per-worker specs), and
    jax says so when the step is traced."""
    tx = compressed_mean(jc.compressors.make("topk", ratio=0.3), "data", strategy="broadcast")
    mesh = _mesh()
    layout = state_layout(tx, X0, "data")
    params, batch, state = _place(mesh, X0, _batch(), layout)
    with pytest.raises(ValueError, match="could not infer replication"):
        _ddp_step(tx, mesh, layout).lower(params, batch, state)


# --------------------------------------------------------------------------- #
# Stateful optimizers after the mean: state_layout's replicated moments
# --------------------------------------------------------------------------- #
STEPS = 3
B1, B2, EPS = 0.9, 0.999, 1e-8
SCHEDULE = optax.linear_schedule(init_value=0.1, end_value=0.02, transition_steps=2)
WEIGHT_DECAY = 0.1


def _np_grads(p, batch):
    """Worker i's gradient of ``_loss`` in closed form: 2 (p − mean(d_i)) (1 + ‖d_i‖₁), float64."""
    data = batch.astype(np.float64)
    return [{k: 2.0 * (v - data[i].mean()) * (1.0 + np.abs(data[i]).sum()) for k, v in p.items()} for i in range(N)]


def _np_adam(g, s, p, t, *, lr=LR, weight_decay=0.0):
    """optax.adam / adamw at step t (0-based): bias-corrected moments, decay on the parameters."""
    mu = B1 * s.get("mu", 0.0) + (1 - B1) * g
    nu = B2 * s.get("nu", 0.0) + (1 - B2) * g * g
    mu_hat, nu_hat = mu / (1 - B1 ** (t + 1)), nu / (1 - B2 ** (t + 1))
    rate = lr(t) if callable(lr) else lr
    return -rate * (mu_hat / (np.sqrt(nu_hat) + EPS) + weight_decay * p), {"mu": mu, "nu": nu}


def _np_momentum(g, s, p, t):
    """optax.sgd(lr, momentum=0.9): trace ← g + 0.9 trace, update −lr · trace."""
    trace = g + 0.9 * s.get("trace", 0.0)
    return -LR * trace, {"trace": trace}


def _np_adamw_schedule(g, s, p, t):
    return _np_adam(g, s, p, t, lr=lambda i: float(SCHEDULE(i)), weight_decay=WEIGHT_DECAY)


def _opt(kind):
    """The optax optimizer and its NumPy reference."""
    if kind == "adam":
        return optax.adam(LR, b1=B1, b2=B2, eps=EPS), _np_adam
    if kind == "momentum":
        return optax.sgd(LR, momentum=0.9), _np_momentum
    assert kind == "adamw+schedule"
    return optax.inject_hyperparams(optax.adamw)(learning_rate=SCHEDULE, weight_decay=WEIGHT_DECAY), _np_adamw_schedule


def _transform(kind, name, kwargs, strategy, memory):
    c = jc.compressors.make(name, **kwargs)
    if kind == "doublesqueeze":  # server="replicated": the server error is one replicated copy
        return c, jc.transforms.doublesqueeze(c, axis_name="data")
    return c, compressed_mean(c, "data", strategy=strategy, memory=jc.memory.residual() if memory else None)


# Per leaf: (transform, compressor, its kwargs, strategy, residual memory, optimizer). The exact
# settings' reference is the NumPy mean of the workers' gradients; the lossy top-k's is error
# feedback around a NumPy top-k (GRACE's Algorithm 1), and for DoubleSqueeze the server's error
# feedback of that mean after it; random-k's (a shared key: the same entries on every worker, a
# linear map) is the compressor's round trip of the mean gradient with the step's leaf key.
TOPK_EF = ("mean", "topk", dict(ratio=0.3), "allgather", True, "adam")  # lossy: 13 of 42 entries sent, 2 of 5
OPTIMIZER_CASES = {
    "none-allreduce-adam": (("mean", "none", {}, "allreduce", False, "adam"),) * 2,
    # random-k's indices come from the key every worker shares (P()): the summed values decode invariant
    "randomk-allreduce-momentum": (("mean", "randomk", dict(ratio=0.3), "allreduce", False, "momentum"),) * 2,
    "accumulate(2)-none-reduce_scatter-residual-adamw+schedule": (
        ("mean", "none", {}, "reduce_scatter", True, "adamw+schedule"),
    )
    * 2,
    # multi_transform: each leaf's chain inside a MaskedState
    "multi_transform-topk-allgather-residual-adam/none-momentum": (
        TOPK_EF,
        ("mean", "none", {}, "auto", False, "momentum"),
    ),
    "doublesqueeze-topk-adam": (("doublesqueeze", "topk", dict(ratio=0.3), "auto", True, "adam"),) * 2,
}


def _np_topk_ef(ratio, phis):
    """Each worker's top-k of its compensated gradient φ_i (the k = max(1, round(ratio·d)) entries of
    largest magnitude, the rest zero) and its new memory φ_i − topk(φ_i)."""
    hats = []
    for phi in phis:
        flat = phi.ravel()
        keep = np.argsort(-np.abs(flat), kind="stable")[: max(1, round(ratio * flat.size))]
        hat = np.zeros_like(flat)
        hat[keep] = flat[keep]
        hats.append(hat.reshape(phi.shape))
    return hats, [phi - hat for phi, hat in zip(phis, hats)]


@pytest.mark.parametrize("case", list(OPTIMIZER_CASES))
def test_stateful_optimizer_after_the_mean(case):
    """Replicated params, an optimizer with state after compressed_mean (or doublesqueeze), the
    state laid out by state_layout (check_vma=True): after STEPS steps every worker holds the same
    parameters, equal to the NumPy optimizer applied to the NumPy mean of the workers'
    decompressed gradients."""
    settings = dict(zip("wb", OPTIMIZER_CASES[case]))
    every_k = 2 if case.startswith("accumulate") else 1
    built = {k: _transform(*settings[k][:5]) for k in "wb"}
    opts = {k: _opt(settings[k][5]) for k in "wb"}
    if settings["w"] == settings["b"]:  # one chain for both leaves
        tx = optax.chain(built["w"][1], opts["w"][0])
    else:
        labels = {"b": "b", "w": "w"}
        tx = optax.multi_transform({k: optax.chain(built[k][1], opts[k][0]) for k in "wb"}, labels)
    if every_k > 1:
        tx = jc.transforms.accumulate(tx, every_k)
    mesh, batch = _mesh(), _batch()
    layout = state_layout(tx, X0, "data")
    params, batch_d, state = _place(mesh, X0, batch, layout)
    step = _ddp_step(tx, mesh, layout)
    for _ in range(STEPS):
        params, state = step(params, batch_d, state)

    roundtrip = jax.jit(lambda x, key: built["w"][0].roundtrip(x, key)[0])  # compiled once per shape
    p = {k: v.astype(np.float64) for k, v in X0.items()}
    opt_states = {k: {} for k in p}
    memories = {k: [np.zeros_like(p[k])] * N for k in p}
    server = {k: np.zeros_like(p[k]) for k in p}
    for t in range(STEPS):
        grads = _np_grads(p, batch)
        mean = {}
        for k in p:
            kind, name, ratio = settings[k][0], settings[k][1], settings[k][2].get("ratio", 1.0)
            if ratio == 1.0:  # an exact setting
                mean[k] = np.mean([g[k] for g in grads], axis=0)
                continue
            if name == "randomk":
                j = sorted(p).index(k)  # the leaf's index in jax.tree.leaves order
                g = np.mean([g[k] for g in grads], axis=0).astype(np.float32)
                mean[k] = np.asarray(roundtrip(g, _leaf_key(built[k][0], t, j)), np.float64)
                continue
            assert name == "topk"
            hats, memories[k] = _np_topk_ef(ratio, [memories[k][i] + grads[i][k] for i in range(N)])
            mean[k] = np.mean(hats, axis=0)
            if kind == "doublesqueeze":
                (mean[k],), (server[k],) = _np_topk_ef(ratio, [server[k] + mean[k]])
        if (t + 1) % every_k:  # accumulate: no optimizer step, the parameters stay
            continue
        for k in p:
            u, opt_states[k] = opts[k][1](mean[k], opt_states[k], p[k], t // every_k)
            p[k] = p[k] + u
    for k in X0:
        shards = [np.asarray(s.data) for s in params[k].addressable_shards]
        assert len(shards) == N and all(np.array_equal(s, shards[0]) for s in shards), f"{case}: workers differ on {k}"
        np.testing.assert_allclose(np.asarray(params[k], np.float64), p[k], rtol=2e-5, atol=2e-6, err_msg=f"{case} {k}")


def test_state_layout_refuses_bad_input():
    """Clear errors naming the argument, before any step is traced; transformations with local
    steps (per-worker parameters) are refused by their state's type."""
    tx = optax.chain(compressed_mean(jc.compressors.none(), "data"), optax.adam(LR))
    with pytest.raises(TypeError, match="tx must be an optax"):
        state_layout(object(), X0, "data")
    with pytest.raises(TypeError, match="axis_name must be a non-empty string"):
        state_layout(tx, X0, "")
    for local_steps in (
        jc.transforms.periodic_average(2, axis_name="data"),
        jc.transforms.diloco(optax.sgd(LR), 2, axis_name="data"),
    ):
        with pytest.raises(ValueError, match="takes local steps"):
            state_layout(optax.chain(optax.sgd(LR), local_steps), X0, "data")
    layout = state_layout(tx, X0, "data")
    with pytest.raises(TypeError, match=r"mesh must be a jax\.sharding\.Mesh"):
        layout.init(X0, "data")
    with pytest.raises(ValueError, match="not the layout's axis_name 'data'"):
        layout.init(X0, jax.make_mesh((N,), ("model",), devices=jax.devices()[:N]))
    with pytest.raises(ValueError, match="build the layout"):
        layout.init({"w": X0["w"]}, _mesh())
    with pytest.raises(ValueError, match="leading dimension of 1"):
        layout.local(layout.init(X0, _mesh()))  # outside the step: every worker's slice, not one
