"""The hierarchical compressed mean, axis_name=("node", "local"), on a 2x2 mesh against NumPy.

The reference does what the documentation says, in NumPy: a dense reduce-scatter over "local" (each
worker keeps the local mean of its shard), the strategy's exchange of the shards over "node" with
the library's compressor called on each shard (deterministic compressors: scaled sign, bf16, none) and the
residual memory, then the all-gather over "local". Error feedback conserves the gradient exactly:
N·L Σ_t out_t + L Σ_{a,b} m_{a,b} == Σ_t Σ_{a,b} g_{a,b,t} (memories placed on their shards).
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from hlo_collectives import collectives
from hypothesis import given, settings
from hypothesis import strategies as st
from jax.sharding import Mesh, NamedSharding
from jax.sharding import PartitionSpec as P

import jaxcomm as jc
from jaxcomm import memory as mem
from jaxcomm.comm import MeshAxis
from jaxcomm.transforms import compressed_mean

N, L = 2, 2  # nodes (slow axis), devices per node (fast axis)
SHAPES = {"b": (8,), "w": (4, 8)}  # two leaves, dict order == jax.tree.leaves order
STEPS = 3
SPEC = P("node", "local")
KEY = jax.random.PRNGKey(0)  # the reference's compressors are deterministic: any key


def grid_mesh(n=N, l_=L):
    return Mesh(np.array(jax.devices()[: n * l_]).reshape(n, l_), ("node", "local"))


def per_worker(tree, shape=(N, L)):
    return jax.tree.map(lambda v: jnp.broadcast_to(jnp.asarray(v), (*shape, *jnp.shape(v))), tree)


PARAMS = {k: np.zeros(s, np.float32) for k, s in SHAPES.items()}


_STEPS: dict = {}


def hierarchical(settings_, skip_nonfinite=False):
    """``(txs, step)`` for ``settings_``, ``((compressor, strategy, memory, fast), ...)``: one jitted shard_map step
    on the 2x2 mesh running every setting's transformation, ``(grads, states) -> (updates, states)``."""
    key = (repr(settings_), skip_nonfinite)
    if key not in _STEPS:
        txs = tuple(
            compressed_mean(c, ("node", "local"), memory=m, strategy=s, fast=f, skip_nonfinite=skip_nonfinite)
            for c, s, m, f in settings_
        )
        _STEPS[key] = txs, _mesh_step(txs, grid_mesh(), SPEC, 2)
    return _STEPS[key]


def _mesh_step(txs, mesh, spec, rank):
    def worker(g, states):
        g, states = jax.tree.map(lambda v: v[(0,) * rank], (g, states))
        out = [tx.update(g, s) for tx, s in zip(txs, states)]
        return jax.tree.map(lambda v: v[(None,) * rank], (tuple(u for u, _ in out), tuple(s for _, s in out)))

    return jax.jit(jax.shard_map(worker, mesh=mesh, in_specs=(spec, spec), out_specs=spec, check_vma=True))


def run_all(settings_, grads, skip_nonfinite=False):
    """Per setting: every step's update (worker (0, 0); all agree) and the final state, from ``grads[t]``
    ``(N, L, *shape)``."""
    txs, step = hierarchical(settings_, skip_nonfinite)
    mesh = grid_mesh()
    with jax.set_mesh(mesh):
        states = tuple(per_worker(tx.init(PARAMS)) for tx in txs)
    states = jax.device_put(states, NamedSharding(mesh, SPEC))
    outs: list = [[] for _ in txs]
    for g in grads:
        updates, states = step(g, states)
        for u, o in zip(updates, outs):
            for k in u:  # every worker holds the same mean
                np.testing.assert_array_equal(np.asarray(u[k]), np.broadcast_to(np.asarray(u[k][0, 0]), u[k].shape))
            o.append({k: np.asarray(v[0, 0], np.float64) for k, v in u.items()})
    return list(zip(outs, states))


def run(compressor, strategy, memory, grads, fast=None):
    """:func:`run_all` of one setting: ``(updates per step, final state)``."""
    return run_all(((compressor, strategy, memory, fast),), grads)[0]


def gradients(seed, scale=1.0):
    rng = np.random.default_rng(seed)
    return [
        {k: (scale * rng.normal(size=(N, L, *s))).astype(np.float32) for k, s in SHAPES.items()} for _ in range(STEPS)
    ]


# --------------------------------------------------------------------------- #
# The NumPy reference
# --------------------------------------------------------------------------- #
_ROUNDTRIPS: dict = {}


def roundtrip(c, x):
    """The library's compressor on one shard: Q⁻¹(Q(x)) in float64 (jit-compiled once per compressor and shape)."""
    if repr(c) not in _ROUNDTRIPS:
        _ROUNDTRIPS[repr(c)] = jax.jit(lambda v: c.decompress(c.compress(v, KEY, ())[0]))
    return np.asarray(_ROUNDTRIPS[repr(c)](jnp.asarray(x, jnp.float32)), np.float64)


def cast(x, fast):
    """The fast axis' wire format: float32 (none) or float16."""
    return np.asarray(x, np.float32) if fast is None else np.asarray(x, np.float32).astype(np.float16)


def slow_exchange(c, strategy, phis):
    """One shard's exchange over the N nodes: ``(out, new memories)`` (residual memory: the errors)."""
    if strategy == "allreduce":  # summable payload (none, fp16, bf16): summed in its own dtype, decoded once
        wire = {"fp16": np.float16, "bf16": jnp.bfloat16}.get(c.name, np.float32)  # the payload's dtype
        p0, p1 = (np.float32(p).astype(wire).astype(np.float32) for p in phis)
        out = (p0 + p1).astype(wire).astype(np.float64) / N  # the sum of 2 in the payload's dtype: one rounding
        return out, [p - roundtrip(c, p) for p in phis]
    if strategy in ("allgather", "broadcast"):
        decoded = [roundtrip(c, p) for p in phis]
        return sum(decoded) / N, [p - d for p, d in zip(phis, decoded)]
    # reduce_scatter: sub-chunk k of every node's shard goes to node k, which averages and compresses again;
    # its rounding N (mean_k − Q(mean_k)) joins node k's memory on that sub-chunk.
    subs = [np.split(p, N) for p in phis]
    decoded = [[roundtrip(c, s) for s in sub] for sub in subs]
    memories = [p - np.concatenate(d) for p, d in zip(phis, decoded)]
    out = []
    for k in range(N):
        mean = np.float32(sum(d[k] for d in decoded) / N)
        q = roundtrip(c, mean)
        memories[k][k * len(q) : (k + 1) * len(q)] += N * (mean - q)
        out.append(q)
    return np.concatenate(out), memories


def reference(c, strategy, residual, grads, fast=None):
    """Every step's mean and the final memories ``{leaf: (N, L, shard)}``, as documented."""
    memory = {k: np.zeros((N, L, int(np.prod(s)) // L), np.float32) for k, s in SHAPES.items()}
    outs = []
    for g in grads:
        out = {}
        for k, shape in SHAPES.items():
            rows = cast(g[k].reshape(N, L, L, -1), fast).astype(np.float32)  # [node, worker, shard, entries]
            shard = (rows.sum(axis=1).astype(rows.dtype if fast is None else np.float16)).astype(np.float32) / L
            means = []
            for b in range(L):
                phis = [memory[k][a, b] + shard[a, b] for a in range(N)]
                y, errors = slow_exchange(c, strategy, phis)
                means.append(cast(y, fast).astype(np.float64))
                for a in range(N):
                    memory[k][a, b] = errors[a] if residual else 0.0
            out[k] = np.concatenate(means).reshape(shape)
        outs.append(out)
    return outs, memory


STRATEGIES = ("allreduce", "allgather", "broadcast", "reduce_scatter")
LOSSY = {  # deterministic, cheap to compile
    "allreduce": jc.compressors.bf16(),
    "allgather": jc.compressors.scaled_sign(),
    "broadcast": jc.compressors.scaled_sign(),
    "reduce_scatter": jc.compressors.scaled_sign(),
}
FAST = {"allreduce": jc.compressors.fp16()}  # the bf16 case sends the fast axis' rows and means in float16
NONE = jc.compressors.none()
RESIDUAL = mem.residual()


# --------------------------------------------------------------------------- #
# Every strategy: exact setting == the plain mean; lossy == the reference, conserved
# --------------------------------------------------------------------------- #
def test_exact_setting_gives_the_plain_mean_with_every_strategy():
    """none() under every strategy: the plain mean. With skip_nonfinite, a NaN on one worker skips the step on
    every worker: zeros out, the states as they were but for the count of skipped steps, only the flag sent."""
    grads = gradients(1)[:1]
    bad = {k: v.copy() for k, v in grads[0].items()}
    bad["w"][1, 0, 2, 3] = np.nan
    settings_ = tuple((NONE, s, None, None) for s in STRATEGIES)
    # one worker's slow bits: its shard of every leaf in float32 (reduce_scatter: N − 1 sub-chunks out, then
    # its averaged sub-chunk: a shard too), and the flag (32 bits on leaf 0); fast bits: its L rows
    # reduce-scattered, its shard all-gathered
    shard_bits = np.array([32 * int(np.prod(s)) // L for s in SHAPES.values()])
    flag = np.array([32, 0])
    for strategy, (outs, state) in zip(STRATEGIES, run_all(settings_, grads, skip_nonfinite=True)):
        for k in SHAPES:
            mean = grads[0][k].astype(np.float64).mean((0, 1))
            np.testing.assert_allclose(outs[0][k], mean, rtol=1e-6, atol=1e-6, err_msg=strategy)
        np.testing.assert_array_equal(np.asarray(state.slow.wire_bits)[0, 0], shard_bits + flag, err_msg=strategy)
        np.testing.assert_array_equal(np.asarray(state.fast.wire_bits)[0, 0], shard_bits * (L + 1), err_msg=strategy)
    for strategy, (outs, state) in zip(STRATEGIES, run_all(settings_, [grads[0], bad], skip_nonfinite=True)):
        for k in SHAPES:  # the NaN step is skipped on every worker: zeros, only the flag sent
            np.testing.assert_array_equal(outs[1][k], 0.0)
        for part in (state.slow, state.fast):
            np.testing.assert_array_equal(np.asarray(part.count), 1)
            np.testing.assert_array_equal(np.asarray(part.notfinite_count), 1)
        np.testing.assert_array_equal(np.asarray(state.slow.wire_bits)[0, 0], flag, err_msg=strategy)
        np.testing.assert_array_equal(np.asarray(state.fast.wire_bits)[0, 0], 0, err_msg=strategy)


@pytest.mark.parametrize("strategy", STRATEGIES)
def test_lossy_compressor_with_residual_memory_matches_numpy(strategy):
    """Every step's mean and the final memories as the reference computes them. Under "allreduce" (bf16 between
    the nodes, fp16 inside them: the fast axis' rows summed in float32 at the shard's owner and rounded to float16
    once, the gathered means in float16) the roundings of the sums are fed back by no memory; under the other
    strategies error feedback conserves the gradient."""
    c, fast = LOSSY[strategy], FAST.get(strategy)
    grads = gradients(2)
    outs, state = run(c, strategy, RESIDUAL, grads, fast)
    want, memory = reference(c, strategy, True, grads, fast)
    for t in range(STEPS):
        for k in SHAPES:
            np.testing.assert_allclose(outs[t][k], want[t][k], rtol=1e-5, atol=1e-6, err_msg=f"step {t} {k}")
    for k in SHAPES:
        np.testing.assert_allclose(np.asarray(state.slow.memory[k]), memory[k], rtol=1e-5, atol=1e-6)
    assert all(np.abs(m).max() > 0 for m in memory.values())  # lossy: something was kept back
    width = 32 if fast is None else 16
    shard_bits = np.array([width * int(np.prod(s)) // L for s in SHAPES.values()])
    np.testing.assert_array_equal(np.asarray(state.fast.wire_bits)[0, 0], shard_bits * (L + 1))
    if fast is None:
        conserved(outs, state, grads, atol=1e-5)


def conserved(outs, state, grads, atol):
    """N·L Σ_t out_t + L Σ_{a,b} m_{a,b} (on their shards) == Σ_t Σ_{a,b} g_{a,b,t}."""
    for k, shape in SHAPES.items():
        sent = N * L * sum(o[k] for o in outs)
        memory = np.asarray(state.slow.memory[k], np.float64).sum(0).reshape(shape)  # shard b from worker b
        np.testing.assert_allclose(sent + L * memory, sum(g[k].sum((0, 1)) for g in grads), rtol=0, atol=atol)


@settings(max_examples=4)
@given(seed=st.integers(0, 2**31 - 1), scale=st.floats(0.01, 100.0))
def test_reduce_scatter_error_feedback_conserves_the_gradient(seed, scale):
    """The most involved route (chunks of shards to their owners, owners' rounding fed back), any gradients."""
    grads = gradients(seed, scale)
    outs, state = run(LOSSY["reduce_scatter"], "reduce_scatter", RESIDUAL, grads)
    conserved(outs, state, grads, atol=1e-5 * scale)


# --------------------------------------------------------------------------- #
# Bytes on the slow axis
# --------------------------------------------------------------------------- #
def test_slow_axis_carries_one_fast_axis_size_fewer_bytes_than_the_flat_mean():
    """Per worker, the slow axis carries 1/L of the flat compressed mean's bits over all N·L workers, and the
    lowered step's collectives carry exactly the slow and the fast bits."""
    setting = (LOSSY["allreduce"], "allreduce", RESIDUAL, FAST["allreduce"])
    grads = gradients(2)[:1]
    _, state = run(*setting[:3], grads, setting[3])
    flat = compressed_mean(setting[0], "data", memory=RESIDUAL, strategy="allreduce")
    mesh = Mesh(np.array(jax.devices()[: N * L]), ("data",))
    g = {k: v.reshape(N * L, *v.shape[2:]) for k, v in grads[0].items()}
    (_,), (flat_state,) = _mesh_step((flat,), mesh, P("data"), 1)(g, (per_worker(flat.init(PARAMS), (N * L,)),))
    slow = np.asarray(state.slow.wire_bits)[0, 0]
    np.testing.assert_array_equal(np.asarray(flat_state.wire_bits)[0], L * slow)

    (tx,), step = hierarchical((setting,))
    with jax.set_mesh(grid_mesh()):
        st0 = (per_worker(tx.init(PARAMS)),)
    found = collectives(step.lower(grads[0], st0).as_text(dialect="hlo"), N)  # N == L: every group has 2
    assert not found.switches
    assert sum(b for _, b in found.fixed) * 8 == slow.sum() + np.asarray(state.fast.wire_bits)[0, 0].sum()


# --------------------------------------------------------------------------- #
# Bad input
# --------------------------------------------------------------------------- #
def test_bad_axis_names_and_arguments():
    c = NONE
    with pytest.raises(ValueError, match=r"axis_name.*tuple of 3"):
        compressed_mean(c, ("a", "b", "c"))
    with pytest.raises(ValueError, match=r"axis_name.*tuple of 1"):
        compressed_mean(c, ("a",))
    with pytest.raises(TypeError, match="two non-empty strings"):
        compressed_mean(c, ("node", 3))
    with pytest.raises(ValueError, match="two different mesh axes"):
        compressed_mean(c, ("node", "node"))
    with pytest.raises(ValueError, match="pass no comm"):
        compressed_mean(c, ("node", "local"), comm=MeshAxis("node"))
    with pytest.raises(ValueError, match=r"axis_name=\('node', 'local'\), the slow axis first"):
        compressed_mean(c, "local", comm=MeshAxis("node"))
    with pytest.raises(TypeError, match=r"comm must implement jaxcomm\.comm\.Communicator"):
        compressed_mean(c, "local", comm=object())
    with pytest.raises(ValueError, match=r"fast= .*axis_name=\(slow, fast\)"):
        compressed_mean(c, "data", fast=jc.compressors.fp16())
    with pytest.raises(ValueError, match="fast must be a dense format"):
        compressed_mean(c, ("node", "local"), fast=jc.compressors.topk(ratio=0.5))
    with pytest.raises(TypeError, match=r"fast must be a jaxcomm.compressors.Compressor"):
        compressed_mean(c, ("node", "local"), fast="fp16")


def test_init_needs_the_fast_axis_and_divisible_leaves():
    tx = compressed_mean(NONE, ("node", "local"))
    with pytest.raises(ValueError, match=r"fast axis 'local'.*jax.set_mesh"):
        tx.init(PARAMS)
    divisible = r"params\['b'\] has 5 entries.*not divisible by the size 2 of the fast axis 'local'"
    with jax.set_mesh(grid_mesh()), pytest.raises(ValueError, match=divisible):
        tx.init({"b": np.zeros(5, np.float32)})


def test_axes_not_in_the_mesh_and_a_state_for_another_fast_size():
    tx = compressed_mean(NONE, ("node", "gpu"))
    mesh = grid_mesh()
    g = per_worker({k: np.zeros(s, np.float32) for k, s in SHAPES.items()})
    with jax.set_mesh(Mesh(np.array(jax.devices()[:4]).reshape(2, 2), ("node", "gpu"))):
        state = per_worker(tx.init(PARAMS))
    with pytest.raises(ValueError, match="'gpu'"):
        _mesh_step((tx,), mesh, SPEC, 2).trace(g, (state,))
    tx = compressed_mean(NONE, ("node", "local"), memory=RESIDUAL)
    with jax.set_mesh(Mesh(np.array(jax.devices()[:4]).reshape(1, 4), ("node", "local"))):
        state = per_worker(tx.init(PARAMS))  # shards of 1/4
    with pytest.raises(ValueError, match=r"fast axis 'local' \(size 2\)"):
        _mesh_step((tx,), mesh, SPEC, 2).trace(g, (state,))


# --------------------------------------------------------------------------- #
# MPI outside, the mesh axis inside: compressed_mean(c, "local", comm=MPIComm())
# --------------------------------------------------------------------------- #
@pytest.fixture(scope="module")
def over_mpi(tmp_path_factory):
    """One ``mpirun -n 2`` (2 CPU devices per process) runs every strategy (tests/mpi_scripts/hierarchical_mpi.py)."""
    pytest.importorskip("mpi4jax", reason="the MPI backend needs mpi4jax (pip install 'jaxcomm[mpi]')")
    import sys
    from pathlib import Path

    here = Path(__file__).resolve().parent
    sys.path.insert(0, str(here))
    from mpirun import run_mpi

    out = tmp_path_factory.mktemp("hier_mpi") / "hierarchical.npz"
    run_mpi(N, here / "mpi_scripts" / "hierarchical_mpi.py", str(out), timeout=600)
    with np.load(out) as z:
        return {k: z[k] for k in z.files}


@pytest.mark.mpi
@pytest.mark.parametrize("strategy", STRATEGIES)
def test_mpi_outside_mesh_axis_inside_equals_the_2d_mesh_form(strategy, over_mpi):
    """Process a with 2 devices under MPIComm gives worker (a, b) of the 2x2 mesh form: every step's mean, the
    memories, the slow and fast bits and the counts; the means equal the NumPy reference and error feedback
    conserves the gradient (bf16 between the nodes with fp16 inside under "allreduce": the reference's roundings)."""
    c, fast = LOSSY[strategy], FAST.get(strategy)
    grads = gradients(2)
    outs, state = run(c, strategy, RESIDUAL, grads, fast)
    want, memory = reference(c, strategy, True, grads, fast)
    for t in range(STEPS):
        for k in SHAPES:
            got = over_mpi[f"{strategy}/out{t}/{k}"]  # (N, L, *shape): every worker's mean
            assert got.shape == (N, L, *SHAPES[k])
            np.testing.assert_array_equal(got, np.broadcast_to(got[0, 0], got.shape))
            np.testing.assert_array_equal(got[0, 0], outs[t][k].astype(np.float32), err_msg=f"step {t} {k}")
            np.testing.assert_allclose(got[0, 0], want[t][k], rtol=1e-5, atol=1e-6, err_msg=f"step {t} {k}")
    for k in SHAPES:
        np.testing.assert_array_equal(over_mpi[f"{strategy}/memory/{k}"], np.asarray(state.slow.memory[k]))
        np.testing.assert_allclose(over_mpi[f"{strategy}/memory/{k}"], memory[k], rtol=1e-5, atol=1e-6)
    np.testing.assert_array_equal(over_mpi[f"{strategy}/slow_bits"], np.asarray(state.slow.wire_bits))
    np.testing.assert_array_equal(over_mpi[f"{strategy}/fast_bits"], np.asarray(state.fast.wire_bits))
    counts = np.stack([np.asarray(v) for v in (state.slow.count, state.fast.count)], axis=-1)
    np.testing.assert_array_equal(over_mpi[f"{strategy}/counts"][..., :2], counts)
    np.testing.assert_array_equal(over_mpi[f"{strategy}/counts"][..., 2:], 0)
    assert int(np.asarray(state.slow.count)[0, 0]) == STEPS
    if fast is None:
        mpi_outs = [
            {k: over_mpi[f"{strategy}/out{t}/{k}"][0, 0].astype(np.float64) for k in SHAPES} for t in range(STEPS)
        ]
        mpi_state = state._replace(
            slow=state.slow._replace(memory={k: over_mpi[f"{strategy}/memory/{k}"] for k in SHAPES})
        )
        conserved(mpi_outs, mpi_state, grads, atol=1e-5)


@pytest.mark.mpi
def test_mpi_outside_refusals(over_mpi):
    """Under mpirun: skip_nonfinite=True, update under jax.jit, a leaf without the device axis and diloco with
    comm= and a mesh axis each raise a ValueError naming the argument (checked in the worker)."""
    assert over_mpi["refusals_ok"].tolist() == [1] * N
