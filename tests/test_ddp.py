"""The DDP habit: one replicated copy of the parameters (``P()``), the gradient made per-worker
with one documented cast, and a compressed mean that leaves ``jax.shard_map`` with ``out_specs=P()``.

Inside ``shard_map(check_vma=True)`` a value may leave with ``out_specs=P()`` only if jax types
it device-invariant. The compressed mean is the same on every worker; the pipeline's collectives
(``psum`` for ``"allreduce"`` and rounds, the invariant all-gather for ``"allgather"`` and
``"reduce_scatter"``) type it so. The reference is the NumPy mean of the workers' own round trips
``Q⁻¹(Q(g_i))`` under the documented key schedule (``compressed_mean``'s docstring), or, for
``"reduce_scatter"`` (chunks re-compressed by their owners), the same transform run under
``jax.vmap``, which ``test_compressed_mean.py`` checks against NumPy.
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
from jaxcomm.transforms import CompressionState, compressed_mean

N = 4
LR = 0.1
X0 = {"b": np.linspace(-1.0, 1.0, 5, dtype=np.float32), "w": np.linspace(-2.0, 2.0, 42, dtype=np.float32).reshape(6, 7)}


def _batch():
    rng = np.random.default_rng(0)
    return rng.standard_normal((N, 3)).astype(np.float32)


def _loss(p, data):
    # Per-worker gradient depends on the worker's batch: g_i = 2 (p - mean(data_i)) * (1 + |data_i|_1).
    return sum(jnp.sum((p[k] - jnp.mean(data)) ** 2) * (1.0 + jnp.sum(jnp.abs(data))) for k in p)


def _state_specs(state):
    """P('data') (a leading worker axis) for the per-worker state; P() for the key every worker shares.

    The shared key must be typed invariant where a payload has fields that are not summed (random-k
    under "allreduce": its indices are drawn from it and decode the psum-ed values).
    """
    specs = jax.tree.map(lambda _: P("data"), state)
    is_cs = lambda x: isinstance(x, CompressionState)
    return jax.tree.map(lambda s: s._replace(key=P()) if is_cs(s) else s, specs, is_leaf=is_cs)


def _ddp_step(tx, mesh, specs):
    """params P() (one replicated copy), batch P('data'), per-worker transform state (``specs``)."""
    is_p = lambda x: isinstance(x, P)

    def worker(params, batch, state):
        batch = batch[0]
        state = jax.tree.map(lambda s, v: v[0] if s == P("data") else v, specs, state, is_leaf=is_p)
        local = jax.lax.pcast(params, "data", to="varying")  # the one documented cast
        g = jax.grad(_loss)(local, batch)
        u, state = tx.update(g, state, params)
        params = optax.apply_updates(params, u)
        return params, jax.tree.map(lambda s, v: v[None] if s == P("data") else v, specs, state, is_leaf=is_p)

    f = jax.shard_map(worker, mesh=mesh, in_specs=(P(), P("data"), specs), out_specs=(P(), specs))
    return jax.jit(f)


def _place(mesh, params, batch, state, specs):
    is_p = lambda x: isinstance(x, P)
    per_worker = jax.tree.map(
        lambda s, v: np.broadcast_to(np.asarray(v), (N, *np.shape(v))) if s == P("data") else v,
        specs,
        state,
        is_leaf=is_p,
    )
    shardings = jax.tree.map(lambda s: NamedSharding(mesh, s), specs, is_leaf=is_p)
    return (
        jax.device_put(params, NamedSharding(mesh, P())),
        jax.device_put(batch, NamedSharding(mesh, P("data"))),
        jax.device_put(per_worker, shardings),
    )


def _grads(batch):
    return [jax.grad(_loss)(jax.tree.map(jnp.asarray, X0), batch[i]) for i in range(N)]


def _numpy_mean_of_roundtrips(c: jc.compressors.Compressor, grads):
    """(1/n) Σ_i Q⁻¹(Q(g_i)) per leaf, keys as documented: split(seed) → split per leaf → fold_in(worker)
    (the shared leaf key where the payload has fields that are not summed)."""
    _, step_key = jax.random.split(jax.random.PRNGKey(c.seed))
    names = sorted(X0)
    leaf_keys = jax.random.split(step_key, len(names))
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
            hats.append(np.asarray(c.roundtrip(g, key, c.init_state(g))[0], np.float64))
        out[name] = np.mean(hats, axis=0)
    return out


def _vmap_mean(tx, grads):
    g = jax.tree.map(lambda *xs: jnp.stack(xs), *grads)
    state = jax.tree.map(lambda v: jnp.broadcast_to(v, (N, *jnp.shape(v))), tx.init(X0))
    u, _ = jax.vmap(tx.update, axis_name="data")(g, state)
    return jax.tree.map(lambda v: np.asarray(v[0], np.float64), u)


def _run(name, strategy):
    c = jc.compressors.make(name, **MEAN_KWARGS.get(name, {}))
    mean_tx = compressed_mean(c, "data", strategy=strategy)
    tx = optax.chain(mean_tx, optax.sgd(LR))
    mesh = jax.make_mesh((N,), ("data",), axis_types=(jax.sharding.AxisType.Explicit,), devices=jax.devices()[:N])
    batch = _batch()
    state = tx.init(X0)
    specs = _state_specs(state)
    params, batch_d, state = _place(mesh, X0, batch, state, specs)
    new, _ = _ddp_step(tx, mesh, specs)(params, batch_d, state)
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
    mesh = jax.make_mesh((N,), ("data",), axis_types=(jax.sharding.AxisType.Explicit,), devices=jax.devices()[:N])
    state = tx.init(X0)
    specs = _state_specs(state)
    params, batch, state = _place(mesh, X0, _batch(), state, specs)
    with pytest.raises(ValueError, match="could not infer replication"):
        _ddp_step(tx, mesh, specs).lower(params, batch, state)
