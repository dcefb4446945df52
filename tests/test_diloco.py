"""DiLoCo, Streaming DiLoCo and SparseLoCo (``jaxcomm.diloco``) against NumPy references and closed forms.

Workers are a ``jax.vmap`` axis (``axis_name="data"``) over quadratic losses
``f_i(θ) = ½ Σ (a_i ⊙ θ − b_i)²`` whose gradients ``a_i ⊙ (a_i ⊙ θ − b_i)`` depend on the
parameters, so a reference that applied an update at the wrong step would drift from the
transform. One case runs in the data-parallel trainer inside ``shard_map(check_vma=True)``, with
a checkpoint and a resume.
"""

from __future__ import annotations

import sys
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from hypothesis import given
from hypothesis import strategies as st

import jaxcomm as jc
from jaxcomm.transforms._diloco import fragment_leaves

sys.path.insert(0, str(Path(__file__).resolve().parent / "mpi_scripts"))
sys.path.insert(0, str(Path(__file__).resolve().parent))

from diloco_common import KEYS, N, _grad, _problem, _reference

pytestmark = pytest.mark.strict_promotion


def _run(tx, steps: int, seed: int = 0):
    """Params of every worker (leading axis N) and the states, after ``steps`` steps of ``tx``."""
    scale, target, theta0 = _problem(seed)
    params = jax.tree.map(lambda x: jnp.stack([jnp.asarray(x)] * N), theta0)
    state = jax.vmap(tx.init)(params)

    @jax.jit
    def step(params, state):
        def one(a, b, p, s):
            g = jax.tree.map(_grad, a, b, p)
            with jc.comm.use(jc.comm.MeshAxis("data")):  # the ambient communicator, as the trainer sets it
                u, s = tx.update(g, s, p)
            return optax.apply_updates(p, u), s

        return jax.vmap(one, axis_name="data")(scale, target, params, state)

    states = []
    for _ in range(steps):
        params, state = step(params, state)
        states.append(state)
    return params, states


def _close(params, ref, rtol=2e-5, atol=2e-5):
    for k in KEYS:
        np.testing.assert_allclose(np.asarray(params[k], np.float64), ref[k], rtol=rtol, atol=atol, err_msg=k)


def test_every_one_with_unit_outer_sgd_is_data_parallel_sgd():
    """H = 1, outer sgd(1), inner sgd(lr): θ ← θ − lr · mean_i g_i, identical on every worker."""
    tx = jc.diloco(optax.sgd(0.05), every=1, outer=optax.sgd(1.0))
    params, _ = _run(tx, 6)
    scale, target, theta = _problem()
    theta = {k: v.astype(np.float64) for k, v in theta.items()}
    for _ in range(6):
        theta = {
            k: theta[k] - 0.05 * np.mean([_grad(scale[k][i], target[k][i], theta[k]) for i in range(N)], axis=0)
            for k in theta
        }
    _close(params, {k: np.stack([v] * N) for k, v in theta.items()})


@pytest.mark.parametrize(
    ("every", "fragments", "delay", "blend", "carry", "mom"),
    [(4, 1, 0, 0.0, False, 0.9), (4, 2, 1, 0.5, False, 0.0), (6, 3, 1, 0.25, False, 0.5), (6, 2, 2, 0.0, True, 0.5)],
    ids=["diloco", "streaming", "streaming-3", "carry-local"],
)
def test_matches_numpy_reference(every, fragments, delay, blend, carry, mom):
    """Inner momentum SGD, outer Nesterov (0.7, 0.9), fragments in turn, delayed blend (or the local
    progress carried past the delayed outer step): 13 steps."""
    tx = jc.diloco(
        optax.sgd(0.05, momentum=mom or None),
        every=every,
        fragments=fragments,
        delay=delay,
        blend=blend,
        carry_local=carry,
    )
    params, states = _run(tx, 13)
    ref = _reference(13, every=every, fragments=fragments, delay=delay, blend=blend, carry=carry, mom=mom)
    _close(params, ref)
    if carry:  # the carried progress is real: it differs from taking the global fragment alone
        assert any(
            np.abs(ref[k] - _reference(13, every=every, fragments=fragments, delay=delay, mom=mom)[k]).max() > 1e-3
            for k in KEYS
        )
    # the anchor is every worker's shared θ (identical), and counters show an exchange only on sync steps
    anchor = states[-1].anchor
    for k in KEYS:
        assert np.all(np.asarray(anchor[k]) == np.asarray(anchor[k])[:1])
    period = every // fragments
    for t, s in enumerate(states, start=1):
        sent = sum(int(np.asarray(e.wire_bits, np.int64).sum()) for e in s.exchange_states)
        assert (sent > 0) == (t % period == 0), t


def test_compressed_outer_gradient_conserves_mass_with_error_feedback():
    """SparseLoCo's route: top-k 50 % with the residual memory, outer sgd(1), H = 2. At every sync
    ``Σ_i Δm_i + n Δ̄ = Σ_i Δ_i`` (the memories keep exactly what the mean did not carry)."""
    lr = 0.05
    tx = jc.diloco(
        optax.sgd(lr),
        every=2,
        outer=optax.sgd(1.0),
        compressor=jc.compressors.topk(ratio=0.5),
        memory=jc.memory.residual(),
        axis_name="data",
    )
    scale, target, theta0 = _problem()
    params = jax.tree.map(lambda x: jnp.stack([jnp.asarray(x)] * N), theta0)
    state = jax.vmap(tx.init)(params)

    def one(a, b, p, s):
        g = jax.tree.map(_grad, a, b, p)
        u, s = tx.update(g, s, p)
        return optax.apply_updates(p, u), s, g

    step = jax.jit(jax.vmap(one, axis_name="data"))
    syncs = 0
    for t in range(1, 9):
        old_anchor, old_memory = state.anchor, state.exchange_states[0].memory
        old_params = params
        params, state, grads = step(scale, target, params, state)
        if t % 2:
            continue
        syncs += 1
        new_memory = state.exchange_states[0].memory  # the fragment's memory: a list of leaves in tree order
        for j, k in enumerate(KEYS):
            local = np.asarray(old_params[k], np.float64) - lr * np.asarray(grads[k], np.float64)
            delta = np.asarray(old_anchor[k], np.float64) - local  # Δ_i per worker
            mean = np.asarray(old_anchor[k], np.float64)[0] - np.asarray(state.anchor[k], np.float64)[0]
            dm = np.asarray(new_memory[j], np.float64) - np.asarray(old_memory[j], np.float64)
            np.testing.assert_allclose(dm.sum(0) + N * mean, delta.sum(0), rtol=1e-5, atol=1e-6, err_msg=k)
            assert np.count_nonzero(dm) > 0  # the compression did drop something
    assert syncs == 4


def test_trainer_shard_map_checkpoint_resumes_bit_identically(tmp_path):
    """Streaming DiLoCo in the data-parallel trainer (shard_map, check_vma=True, 2 workers): 8 steps
    straight equal 5 steps, a checkpoint, a resume from a fresh state, 3 more steps, bit for bit."""
    from flax import nnx

    from jaxcomm import data, models
    from jaxcomm.train import Trainer

    full = data.load_digits()

    def make():
        model = models.MLP(in_features=64, hidden=(16,), num_classes=10, rngs=nnx.Rngs(0))
        tx = jc.diloco(optax.sgd(0.1, momentum=0.9), every=4, fragments=2, delay=1, blend=0.5)
        return Trainer(model, tx, num_workers=2, seed=0)

    def batches():
        return data.WorkerBatches(data.split_iid(full, 2, jax.random.PRNGKey(1)), 32, jax.random.PRNGKey(2))

    trainer = make()  # one trainer (one compiled step); each fit starts from a fresh state
    straight, hist = trainer.fit(trainer.init_state(), batches(), 8, progress=False)
    assert [r["wire_bits_total"] > 0 for r in hist] == [t % 2 == 0 for t in range(1, 9)]
    trainer.fit(trainer.init_state(), batches(), 5, checkpoint_dir=tmp_path / "ck", progress=False)
    resumed, _ = trainer.fit(trainer.init_state(), batches(), 8, checkpoint_dir=tmp_path / "ck", progress=False)
    for a, b in zip(jax.tree.leaves(straight), jax.tree.leaves(resumed)):
        assert np.array_equal(np.asarray(a), np.asarray(b))


HIER_SHAPES = {"a": (4, 2), "b": (6,)}  # every leaf splits into 2 shards over "local"


def test_hierarchical_outer_gradient_on_a_two_by_two_mesh_is_flat_diloco_of_four_workers():
    """``axis_name=("node", "local")`` on a 2x2 mesh (shard_map, check_vma=True), exact compressor: the
    hierarchical mean of the pseudo-gradient is the plain mean of the 4 workers, so Streaming DiLoCo
    (2 fragments, delay 1) follows the NumPy reference of 4 workers; the slow axis carries each
    fragment's 1/2 shard in float32 on its sync steps only (its counters zero between them)."""
    from jax.sharding import Mesh
    from jax.sharding import PartitionSpec as P

    n, steps = 4, 9
    scale, target, theta0 = _problem(n=n, shapes=HIER_SHAPES)
    tx = jc.diloco(optax.sgd(0.05, momentum=0.5), every=4, fragments=2, delay=1, axis_name=("node", "local"))
    mesh = Mesh(np.array(jax.devices()[:n]).reshape(2, 2), ("node", "local"))
    spec = P(("node", "local"))

    def on_mesh(fn):
        def worker(*args):
            out = fn(*jax.tree.map(lambda v: v[0], args))
            return jax.tree.map(lambda v: v[None], out)

        return jax.jit(jax.shard_map(worker, mesh=mesh, in_specs=spec, out_specs=spec, check_vma=True))

    def step(a, b, p, s):
        u, s = tx.update(jax.tree.map(_grad, a, b, p), s, p)
        return optax.apply_updates(p, u), s

    params = {k: np.stack([v] * n) for k, v in theta0.items()}
    state, step = on_mesh(tx.init)(params), on_mesh(step)
    slow_bits = []
    for _ in range(steps):
        params, state = step(scale, target, params, state)
        slow_bits.append([int(np.asarray(e.slow.wire_bits, np.int64).sum()) for e in state.exchange_states])
    ref = _reference(steps, every=4, fragments=2, delay=1, mom=0.5, n=n, shapes=HIER_SHAPES)
    for k in HIER_SHAPES:
        np.testing.assert_allclose(np.asarray(params[k], np.float64), ref[k], rtol=2e-5, atol=2e-5, err_msg=k)
    # fragment p syncs at t = 2 (p + 1) mod 4; each of the 4 workers sends its shard's 32 bits an entry
    shard_bits = [32 * 8 // 2 * n, 32 * 6 // 2 * n]  # fragments: leaf "a" (8 entries), leaf "b" (6)
    want = [[shard_bits[p] if t % 4 == (2 * (p + 1)) % 4 else 0 for p in range(2)] for t in range(1, steps + 1)]
    assert slow_bits == want


@given(st.lists(st.integers(1, 50), min_size=1, max_size=12), st.integers(1, 12))
def test_fragments_are_contiguous_nonempty_and_cover_every_leaf(sizes, fragments):
    if fragments > len(sizes):
        with pytest.raises(ValueError, match="fragments"):
            fragment_leaves(sizes, fragments)
        return
    groups = fragment_leaves(sizes, fragments)
    assert len(groups) == fragments
    assert all(groups) and [j for g in groups for j in g] == list(range(len(sizes)))
    assert all(g == list(range(g[0], g[-1] + 1)) for g in groups)


@pytest.mark.parametrize(
    ("kwargs", "match"),
    [
        ({"every": 0}, "every"),
        ({"every": 6, "fragments": 4}, "multiple of fragments"),
        ({"every": 4, "fragments": 2, "delay": 2}, "delay"),
        ({"every": 4, "delay": -1}, "delay"),
        ({"every": 4, "blend": 1.0}, "blend"),
        ({"every": 4, "delay": 1, "blend": 0.5, "carry_local": True}, "carry_local"),
        ({"every": 4, "overlap": True, "compressor": jc.compressors.powersgd()}, "overlap"),
        ({"every": 4, "overlap": True, "compressor": jc.compressors.fp16(), "memory": jc.memory.residual()}, "overlap"),
    ],
)
def test_bad_arguments_are_refused_by_name(kwargs, match):
    with pytest.raises(ValueError, match=match):
        jc.diloco(optax.sgd(0.1), **kwargs)


def test_overlap_needs_an_mpi_communicator_and_update_needs_params():
    with pytest.raises(ValueError, match="MPIComm"):
        jc.diloco(optax.sgd(0.1), every=2, overlap=True, axis_name="data")
    tx = jc.diloco(optax.sgd(0.1), every=2, overlap=True)
    params = {"w": jnp.ones((3,))}
    state = tx.init(params)
    with pytest.raises(ValueError, match="needs params"):
        tx.update(params, state)
    with pytest.raises(ValueError, match="MPIComm"), jc.comm.use(jc.comm.Local()):
        tx.update(params, state, params)
    with pytest.raises(TypeError, match="inner"):
        jc.diloco("sgd", every=2)


@pytest.mark.parametrize("poll_s", [0, -1e-3, float("nan"), "1ms"])
def test_async_mean_refuses_a_bad_poll_interval_before_mpi(poll_s):
    """The communication thread's poll interval is checked by name before MPI is imported."""
    with pytest.raises((ValueError, TypeError), match="poll_s"):
        jc.comm.AsyncMean(None, poll_s=poll_s)


@pytest.mark.mpi
def test_mpi_in_step_and_overlapped_match_the_reference_with_a_late_rank(tmp_path):
    """``mpirun -n 3`` (tests/mpi_scripts/diloco_mpi.py): Streaming DiLoCo over MPIComm, with the
    exchanges inside the step and overlapped by a communication thread while the last rank is
    late, both equal the NumPy reference (and so the mesh runs above). With top-k 50 % and
    residual memory (SparseLoCo's outer gradient), the overlapped gather route equals the
    in-step pipeline, and every rank ends with the same anchor."""
    pytest.importorskip("mpi4jax", reason="the MPI backend needs mpi4jax (pip install 'jaxcomm[mpi]')")
    from mpirun import run_mpi

    out = tmp_path / "diloco.npz"
    run_mpi(N, Path(__file__).resolve().parent / "mpi_scripts" / "diloco_mpi.py", str(out), timeout=300)
    ref = _reference(13, every=6, fragments=3, delay=1, blend=0.25, mom=0.5)
    with np.load(out) as z:
        for case in ("in_step", "overlap"):
            _close({k: z[f"{case}/{k}"] for k in KEYS}, ref)
        for k in KEYS:
            sparse = z[f"overlap_sparse/{k}"]
            np.testing.assert_allclose(sparse, z[f"in_step_sparse/{k}"], rtol=1e-6, atol=1e-7)
            assert np.abs(sparse - ref[k]).max() > 1e-4  # top-k 50 % really dropped entries


def test_initial_states_hold_no_buffer_twice():
    """A jitted step donates its state: no buffer may appear twice in ``(params, tx.init(params))``
    (DiLoCo's anchor is a copy of the parameters; DGC's two buffers are two arrays)."""
    params = {"w": jnp.ones((4, 3)), "b": jnp.zeros((3,))}
    for tx in (
        jc.diloco(
            optax.sgd(0.1, momentum=0.9),
            every=4,
            fragments=2,
            compressor=jc.compressors.topk(ratio=0.5),
            memory=jc.memory.residual(),
        ),
        optax.chain(jc.deep_gradient_compression(0.5, axis_name="data"), optax.sgd(0.1)),
    ):
        leaves = [x for x in jax.tree.leaves((params, tx.init(params))) if isinstance(x, jax.Array)]
        pointers = [x.unsafe_buffer_pointer() for x in leaves]
        assert len(pointers) == len(set(pointers))


def test_trainer_step_runs_the_quiet_program_exactly_at_the_steps_that_send_nothing():
    """With a communicator and per-worker metrics the step is two programs: the quiet one (no switch
    between the inner step and the exchanges, so over MPI no collective and no ordered effect) runs
    exactly at the steps where no fragment sends or receives, as the schedule's closed form says, and
    the run is bit-identical to one made with the full program alone. A state whose optimizer state
    is not the last output (a copy) runs the full program."""
    from jaxcomm.comm import Local
    from jaxcomm.train._step import init_train_state, make_train_step

    every, fragments, delay, steps = 6, 2, 1, 13
    period = every // fragments
    tx = jc.diloco(optax.sgd(0.05, momentum=0.5), every=every, fragments=fragments, delay=delay)
    scale, target, theta0 = _problem()
    batch = {k: (jnp.asarray(scale[k][0]), jnp.asarray(target[k][0])) for k in KEYS}

    def loss(params, model_state, batch, key):
        value = sum(0.5 * jnp.sum((batch[k][0] * params[k] - batch[k][1]) ** 2) for k in KEYS)
        return value, (model_state, {})

    def init():
        return init_train_state({k: jnp.asarray(v) for k, v in theta0.items()}, {}, tx, jnp.zeros(2))

    step = make_train_step(loss, tx, comm=Local(), gather_metrics=False)
    state, ran = init(), []
    for _ in range(steps):
        before = dict(step.calls)
        state, _ = step(state, batch)
        ran.append("quiet" if step.calls["quiet"] > before["quiet"] else "full")

    def communicates(t):  # a fragment sends at t ≡ 0 (mod H/F) and receives delay steps later
        return t % period == 0 or (t - delay >= period and (t - delay) % period == 0)

    # the first step has no report before it: full
    assert ran == ["full"] + ["full" if communicates(t) else "quiet" for t in range(2, steps + 1)]
    assert "quiet" in ran and ran.count("full") > 1
    alone = init()
    for _ in range(steps):
        alone, _, _ = step.full(alone, batch)  # the full program alone (the wrapper's choice untouched)
    for got, want in zip(jax.tree.leaves(state), jax.tree.leaves(alone)):
        np.testing.assert_array_equal(np.asarray(got), np.asarray(want))
    assert "stablehlo.case" in step.full.lower(state, batch).as_text()
    assert "stablehlo.case" not in step.quiet.lower(state, batch).as_text()
    copy = jax.tree.map(jnp.copy, state)
    quiet_before = step.calls["quiet"]
    state, _ = step(state, batch)  # step 14: quiet (14 ≡ 2 mod 3), from the last output
    copy, _ = step(copy, batch)  # the same step from a copy: full
    assert step.calls["quiet"] == quiet_before + 1
