"""The trainer: replicas agree, resume is bit-identical, faults give clear errors,
and the same optimizer runs multi-process (jax.distributed, mpirun) with the same numbers."""

import os
import socket
import subprocess
import sys
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from compressor_examples import EXACT_SETTINGS
from flax import nnx
from mpirun import ROOT, run_mpi, suite_xla_flags

import jaxcomm as jc
from jaxcomm import data, models
from jaxcomm.comm import Local
from jaxcomm.train import CheckpointError, NonFiniteLossError, Trainer, make_mesh, split_model
from jaxcomm.train._checkpoint import latest_step
from jaxcomm.transforms._gradient_dropping import PeriodicAverageState

sys.path.insert(0, str(Path(__file__).parent / "scripts"))
import digits_job

SCRIPTS = Path(__file__).parent / "scripts"


def _digits_run(
    tmp=None, steps=6, stop=None, compressor="qsgd", hidden=32, shards=None, resume=True, every=3, until=None
):
    ds = data.load_digits()
    model = models.MLP(in_features=64, hidden=(hidden,), num_classes=10, rngs=nnx.Rngs(0))
    c = jc.compressors.make(compressor, **({"ratio": 0.1} if compressor == "topk" else {}))
    tx = optax.chain(jc.compressed_mean(c, memory=jc.memory.residual()), optax.sgd(0.1, momentum=0.9))
    trainer = Trainer(model, tx, num_workers=4, seed=0)
    if shards is None:
        batches = data.WorkerBatches(data.split_iid(ds, 4, jax.random.PRNGKey(0)), 64, jax.random.PRNGKey(1))
    else:
        batches = data.WorkerBatches(shards, 64, jax.random.PRNGKey(1), shuffle=False)
    state, history = trainer.fit(
        trainer.init_state(),
        batches,
        stop or steps,
        checkpoint_dir=tmp,
        checkpoint_every=every,
        metadata={"hidden": hidden},
        resume=resume,
        progress=False,
        stop=until,
    )
    return trainer, state, history


def test_replicas_identical_and_wire_bits_are_the_compressed_ones():
    trainer, state, history = _digits_run(steps=3, compressor="topk")
    for leaf in jax.tree.leaves(state.params):
        leaf = np.asarray(leaf)
        np.testing.assert_array_equal(leaf, np.broadcast_to(leaf[0], leaf.shape))
    # top-k 10 %: per tensor k = round(0.1 d) values (float32) + k indices (narrowest unsigned type).
    expected = 0
    for p in jax.tree.leaves(trainer.pure.params):
        d = int(np.size(p))
        k = max(1, round(0.1 * d))
        expected += k * 32 + k * 8 * np.dtype(jc.compressors.index_dtype(d)).itemsize
    # The history counts all workers' bits, exactly, as ints.
    assert all(type(row["wire_bits_total"]) is int for row in history)
    assert [row["wire_bits_total"] for row in history] == [trainer.num_workers * expected] * len(history)
    assert history[-1]["loss"] < history[0]["loss"] + 0.5


def test_resume_is_bit_identical(tmp_path):
    _, full, _ = _digits_run(tmp_path / "a", steps=6)
    # Stopped by fit's stop condition after step 3 of 6, checkpoints due only at the end: fit
    # checks it after every step and saves the step where it stops.
    asked = []
    _, _, stopped = _digits_run(tmp_path / "b", steps=6, every=0, until=lambda s, row: asked.append((s, row)) or s == 3)
    assert [r["step"] for r in stopped] == [1, 2, 3] and asked == [(r["step"], r) for r in stopped]
    assert sorted(int(p.name) for p in (tmp_path / "b").iterdir() if p.name.isdigit()) == [3]
    _, resumed, history = _digits_run(tmp_path / "b", steps=6)
    assert [r["step"] for r in history] == [4, 5, 6]
    for a, b in zip(jax.tree.leaves(full), jax.tree.leaves(resumed)):
        np.testing.assert_array_equal(np.asarray(a), np.asarray(b))


def test_mismatched_checkpoint_is_an_error(tmp_path):
    _digits_run(tmp_path, steps=3)
    with pytest.raises(CheckpointError, match=r"does not match|different configuration"):
        _digits_run(tmp_path, steps=6, hidden=16)


def test_corrupted_checkpoint_is_an_error(tmp_path):
    _digits_run(tmp_path, steps=3)
    for f in (tmp_path / "3").rglob("*"):
        if f.is_file():
            f.write_bytes(b"garbage")
    with pytest.raises(CheckpointError):
        _digits_run(tmp_path, steps=6)


def test_nan_loss_stops_and_keeps_last_good_checkpoint(tmp_path):
    ds = data.load_digits()
    images = np.array(ds.images)
    images[4 * 16 : 5 * 16] = np.nan  # worker 0 reads rows 64..79 of its shard at step 5
    shard = len(ds.labels) // 4
    shards = [
        data.Dataset(images[w * shard : (w + 1) * shard], ds.labels[w * shard : (w + 1) * shard], ds.num_classes)
        for w in range(4)
    ]
    with pytest.raises(NonFiniteLossError, match="step 5"):
        _digits_run(tmp_path, steps=8, shards=shards, every=2)
    assert latest_step(tmp_path) == 4


def _least_squares(replicated_params=False, tx=None, steps=5, lr=0.1, workers=4, per=8, features=5):
    """A linear model on a fixed least-squares problem: (Trainer's parameters, NumPy's).

    NumPy: ``w <- w - lr * (1/P) sum_i X_i^T (X_i w + b - y_i) / B``, the same for ``b``.
    """
    rng = np.random.default_rng(0)
    xs = rng.standard_normal((steps, workers, per, features)).astype(np.float32)
    ys = rng.standard_normal((steps, workers, per)).astype(np.float32)
    model = models.LinearRegression(features, nnx.Rngs(0))
    pure = split_model(model)

    def mse(params, model_state, batch, key):
        pred, model_state = pure.apply(params, model_state, batch["x"])
        return 0.5 * jnp.mean((pred - batch["y"]) ** 2), (model_state, {})

    if tx is None:
        tx = optax.chain(jc.compressed_mean(jc.compressors.make("none")), optax.sgd(lr))
    trainer = Trainer(model, tx, task=mse, num_workers=workers, replicated_params=replicated_params)
    batches = iter([{"x": x, "y": y} for x, y in zip(xs, ys)])
    state, _ = trainer.fit(trainer.init_state(), batches, steps, progress=False)
    got = trainer.params_of(state)
    w = np.asarray(pure.params["linear"]["kernel"][...], np.float64)[:, 0]
    b = float(np.asarray(pure.params["linear"]["bias"][...])[0])
    for x, y in zip(xs.astype(np.float64), ys.astype(np.float64)):
        resid = x @ w + b - y  # [P, B]
        w = w - lr * np.einsum("pbf,pb->pf", x, resid).mean(0) / per
        b = b - lr * resid.mean()
    return got, (w, b)


def _assert_matches_numpy(got, reference):
    w, b = reference
    np.testing.assert_allclose(np.asarray(got["linear"]["kernel"][...])[:, 0], w, rtol=1e-5, atol=1e-6)
    np.testing.assert_allclose(np.asarray(got["linear"]["bias"][...])[0], b, rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize("setting", sorted(EXACT_SETTINGS))
def test_step_trains_like_numpy_with_the_type_check_on(setting):
    """check_vma=True: per-worker parameters through compressed_mean with every setting the docs
    call exact (none() among them) give plain mean-gradient SGD."""
    name, kwargs = EXACT_SETTINGS[setting]
    tx = optax.chain(jc.compressed_mean(jc.compressors.make(name, **kwargs)), optax.sgd(0.1))
    _assert_matches_numpy(*_least_squares(tx=tx))


def test_replicated_parameters_trip_the_guard_inside_the_step():
    """jax.grad of replicated (P()) parameters inside the step is the gradient summed over the
    workers; compressed_mean's guard sees that at trace time instead of compressing a dense sum."""
    with pytest.raises(ValueError, match="is not device-varying"):
        _least_squares(replicated_params=True)
    # A plain optax optimizer applies the summed gradient: lr / P gives the mean again, and the
    # replicated state passes the type check (every worker applied the same update).
    _assert_matches_numpy(*_least_squares(replicated_params=True, tx=optax.sgd(0.1 / 4)))


def test_gather_metrics_must_be_a_bool_on_either_backend():
    model = models.MLP(in_features=64, hidden=(8,), num_classes=10, rngs=nnx.Rngs(0))
    for comm in (None, Local()):
        with pytest.raises(TypeError, match="gather_metrics"):
            Trainer(model, optax.sgd(0.1), comm=comm, num_workers=None if comm else 1, gather_metrics="no")


def test_too_many_devices_is_a_clear_error():
    with pytest.raises(ValueError, match="xla_force_host_platform_device_count"):
        make_mesh(jax.device_count() + 1)


def test_batch_not_divisible_by_workers():
    ds = data.load_digits()
    with pytest.raises(ValueError, match="batch_size"):
        data.WorkerBatches(data.split_iid(ds, 3, jax.random.PRNGKey(0)), 64, jax.random.PRNGKey(1))


def test_missing_dataset_path(tmp_path):
    with pytest.raises(FileNotFoundError, match=r"jaxcomm.data.fetch|does not exist|not found"):
        data.load_mnist(tmp_path / "nowhere")


def _free_port():
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _compare(reference, path, exact):
    leaves, losses, bits = reference
    got = np.load(path)
    check = (
        np.testing.assert_array_equal
        if exact
        # MPI_Allreduce and XLA's all-reduce sum in different orders: float32 rounding only.
        else (lambda a, b: np.testing.assert_allclose(a, b, rtol=1e-5, atol=1e-5))
    )
    for i, leaf in enumerate(leaves):
        check(leaf, got[f"arr_{i}"])
    check(losses, got["loss"])
    np.testing.assert_array_equal(bits, got["bits"])


def test_jax_distributed_two_processes_match_one(tmp_path):
    """2 processes x 4 CPU devices (gloo) end bit-identical to this process's 8-device mesh."""
    env = dict(os.environ, PYTHONPATH=str(ROOT), XLA_FLAGS=suite_xla_flags())  # the script sets the device count
    port = _free_port()
    procs = [
        subprocess.Popen(
            [
                sys.executable,
                str(SCRIPTS / "train_distributed.py"),
                str(i),
                "2",
                str(port),
                "4",
                str(tmp_path / "d.npz"),
            ],
            env=env,
            stdout=subprocess.PIPE,
            stderr=subprocess.STDOUT,
            text=True,
        )
        for i in range(2)
    ]
    reference = digits_job.run(8)
    for p in procs:
        out, _ = p.communicate(timeout=600)
        assert p.returncode == 0, out[-3000:]
    _compare(reference, tmp_path / "d.npz", exact=True)


@pytest.fixture(scope="module")
def mpirun_runs(tmp_path_factory):
    """One ``mpirun -n 4`` launch of ``train_mpi.py``: the uninterrupted run (``mpi.npz``), then the
    run interrupted after 4 steps and restarted from per-rank checkpoints (``ckpt/``,
    ``resumed.npz``); and the 4-device mesh run both are compared with."""
    tmp = tmp_path_factory.mktemp("mpirun")
    run_mpi(4, SCRIPTS / "train_mpi.py", str(tmp / "mpi.npz"), str(tmp / "ckpt"), str(tmp / "resumed.npz"))
    return tmp, digits_job.run(4)


@pytest.mark.mpi
def test_mpirun_trainer_matches_mesh(mpirun_runs):
    """The same optimizer under mpirun -n 4 (MPI communicator) matches a 4-device mesh run."""
    tmp, reference = mpirun_runs
    _compare(reference, tmp / "mpi.npz", exact=False)


@pytest.mark.mpi
def test_mpirun_trainer_without_gathered_metrics_trains_the_same(mpirun_runs):
    """``gather_metrics=False`` under mpirun -n 4: the same parameters as the gathered run, and each
    rank's own losses and bits are the gathered ones' parts (their mean, their exact sum)."""
    tmp, _ = mpirun_runs
    with np.load(tmp / "mpi.npz") as gathered:
        ranks = [np.load(tmp / f"mpi_local{r}.npz") for r in range(4)]
        for i in range(len([k for k in gathered.files if k.startswith("arr_")])):
            for got in ranks:
                np.testing.assert_array_equal(got[f"arr_{i}"], gathered[f"arr_{i}"])
        np.testing.assert_allclose(np.mean([g["loss"] for g in ranks], axis=0), gathered["loss"], rtol=1e-6)
        np.testing.assert_array_equal(np.sum([g["bits"] for g in ranks], axis=0), gathered["bits"])
        assert len({float(g["loss"][0]) for g in ranks}) > 1  # each rank's own loss, not a shared one


@pytest.mark.mpi
def test_mpirun_trainer_resumes_from_per_rank_checkpoints(mpirun_runs):
    """Interrupted after 4 steps and restarted under mpirun -n 4: every rank resumes from its own
    folder at the same step, and the run ends where the uninterrupted mesh run does."""
    tmp, reference = mpirun_runs
    assert sorted(p.name for p in (tmp / "ckpt").iterdir()) == [f"rank_{r:05d}" for r in range(4)]
    assert all(latest_step(tmp / "ckpt" / f"rank_{r:05d}") == 8 for r in range(4))
    with np.load(tmp / "resumed.npz") as saved:
        assert len(saved["loss"]) == 4  # the restarted run trained steps 5..8 only
        for i, leaf in enumerate(reference[0]):
            np.testing.assert_allclose(saved[f"arr_{i}"], leaf, rtol=1e-5, atol=1e-5)  # MPI vs XLA sum order


def test_simulate_loop_rounds_inputs_history_and_errors():
    """The simulation loop: per-round outputs in order, entries every eval_every calls and at the end."""
    from jaxcomm.comm import MeshAxis
    from jaxcomm.train import simulate

    comm = MeshAxis("w")

    def step(total, t):  # 3 workers; each adds its index + t, then the workers' mean is shared
        mine = jax.vmap(lambda s, i: comm.mean(s + i + t), axis_name="w")(total, jnp.arange(3.0))
        return mine, {"t": t, "mean": mine[0]}

    seen = []
    total, res = simulate(
        step,
        jnp.zeros(3),
        6,
        rounds_per_call=2,
        eval_every=2,
        on_eval=seen.append,
        summary=lambda calls, out: {"calls": calls, "last": float(out["mean"][-1])},
        eval_fn=lambda s: {"sum": jnp.sum(s)},
    )
    expected = np.cumsum(1.0 + np.arange(6))  # the mean of i + t over i = 0, 1, 2 is 1 + t
    np.testing.assert_array_equal(res.outputs["t"], np.arange(6))
    np.testing.assert_allclose(res.outputs["mean"], expected)
    assert (
        seen
        == res.history
        == [
            {"calls": 2, "last": expected[3], "sum": 3 * expected[3]},
            {"calls": 3, "last": expected[5], "sum": 3 * expected[5]},
        ]
    )
    np.testing.assert_allclose(total, np.full(3, expected[-1]))
    assert res.wall_s >= res.first_call_s > 0

    feed = iter([1.0, 2.0, 3.0])
    _, res = simulate(lambda s, t, x: (s + x, s + x), jnp.zeros(()), 3, inputs=lambda c: next(feed))
    np.testing.assert_array_equal(res.outputs, [1.0, 3.0, 6.0])
    assert res.history == [{"round": 3}]
    with pytest.raises(ValueError, match="rounds_per_call"):
        simulate(step, jnp.zeros(3), 5, rounds_per_call=2)
    with pytest.raises(TypeError, match="on_eval"):
        simulate(step, jnp.zeros(3), 2, on_eval="print")
    with pytest.raises(ValueError, match="num_rounds"):
        simulate(step, jnp.zeros(3), 0)


def test_process_trainer_state_does_not_alias_the_model():
    """With a communicator (one worker per process) the step donates its state; the model's own
    arrays must survive it: a second ``init_state`` starts from the same, intact parameters."""
    from jaxcomm.comm import Local

    train = data.load_digits()
    model = models.MLP(in_features=64, hidden=(8,), num_classes=10, rngs=nnx.Rngs(0))
    trainer = Trainer(model, optax.sgd(0.1), comm=Local())
    first = trainer.init_state()
    before = jax.tree.map(np.asarray, first.params)
    batches = data.WorkerBatches([train], 16, jax.random.PRNGKey(0))
    trained, _ = trainer.fit(first, batches, 2, progress=False)
    again = trainer.init_state()
    for a, b in zip(jax.tree.leaves(before), jax.tree.leaves(again.params)):
        np.testing.assert_array_equal(a, np.asarray(b))
    moved = [
        not np.array_equal(a, np.asarray(b)) for a, b in zip(jax.tree.leaves(before), jax.tree.leaves(trained.params))
    ]
    assert any(moved)
    # fit's stop condition is checked up front and must answer with a bool.
    with pytest.raises(TypeError, match="stop must be a callable"):
        trainer.fit(trainer.init_state(), batches, 2, progress=False, stop="step 1")
    with pytest.raises(TypeError, match="stop must return a bool; it returned None at step 1"):
        trainer.fit(trainer.init_state(), batches, 2, progress=False, stop=lambda step, row: None)


def test_process_trainer_needs_the_host_side_protocol():
    """A communicator without ``agree_min`` (a backend that forgot it) is refused by name before
    anything is built: it would otherwise resume its processes from different checkpoints."""
    from jaxcomm.comm import Local

    class Forgetful:
        capabilities, size, rank, watchdog = Local.capabilities, 1, 0, None
        index, varying, sum, mean = Local.index, Local.varying, Local.sum, Local.mean

    model = models.MLP(in_features=64, hidden=(8,), num_classes=10, rngs=nnx.Rngs(0))
    with pytest.raises(TypeError, match=r"Trainer\(comm=...\) needs .* lacks \['agree_min'\]"):
        Trainer(model, optax.sgd(0.1), comm=Forgetful())


def test_linen_module_is_refused_with_the_wrapping_and_the_wrapped_one_trains():
    import flax.linen as nn

    class Linear(nn.Module):
        @nn.compact
        def __call__(self, x, train=False):
            return nn.Dense(10)(x.reshape(x.shape[0], -1))

    with pytest.raises(TypeError, match=r"linen module \(Linear\).*nnx.bridge.ToNNX"):
        Trainer(Linear(), optax.sgd(0.1), num_workers=2)
    with pytest.raises(TypeError, match=r"model must be a flax\.nnx\.Module; got dict"):
        Trainer({"w": np.zeros(3)}, optax.sgd(0.1), num_workers=2)
    model = nnx.bridge.ToNNX(Linear(), rngs=nnx.Rngs(0))
    nnx.bridge.lazy_init(model, jnp.ones((1, 64)))
    trainer = Trainer(model, optax.sgd(0.5), num_workers=2)
    ds = data.load_digits()
    batches = data.WorkerBatches(data.split_iid(ds, 2, jax.random.PRNGKey(0)), 32, jax.random.PRNGKey(1))
    _, history = trainer.fit(trainer.init_state(), batches, 20, progress=False)
    assert history[-1]["loss"] < history[0]["loss"] - 0.2  # it learns: the parameters are NNX Params


def test_messages_count_the_arrays_handed_to_collectives():
    # compressed_mean(none) allreduces the tensors densely: fused (the default), one all-reduce for the
    # four small float32 tensors per worker; unfused, one per tensor. topk's payloads go in one bucketed
    # all-gather: one message per worker.
    workers, leaves = 4, 4  # MLP 64 -> 32 -> 10: two kernels, two biases
    ds = data.load_digits()
    cases = (
        (jc.compressors.none(), True, 1),
        (jc.compressors.none(), False, leaves),
        (jc.compressors.topk(ratio=0.1), True, 1),
    )
    for c, fuse, per_worker in cases:
        model = models.MLP(in_features=64, hidden=(32,), num_classes=10, rngs=nnx.Rngs(0))
        tx = optax.chain(jc.compressed_mean(c, fuse=fuse), optax.sgd(0.1))
        trainer = Trainer(model, tx, num_workers=workers)
        assert len(jax.tree.leaves(trainer.pure.params)) == leaves
        batches = data.WorkerBatches(data.split_iid(ds, workers, jax.random.PRNGKey(0)), 64, jax.random.PRNGKey(1))
        _, history = trainer.fit(trainer.init_state(), batches, 2, progress=False)
        assert [row["messages"] for row in history] == [workers * per_worker] * 2, c.name
        assert all(type(row["messages"]) is int for row in history), c.name


def test_wire_bit_counters_are_kept_per_tensor_and_summed_exactly():
    # Two transforms' counters past int32's limit (one a user's plain int32 counts): a float32 sum
    # would round, an int32 one would wrap.
    from jaxcomm.train._step import collect_counter

    big, huge = 2**31 - 1, 5 * 2**33 + 7
    state = (
        PeriodicAverageState(count=jnp.int32(1), wire_bits=jnp.array([big, 3]), messages=jnp.int32(1)),
        {"inner": PeriodicAverageState(jnp.int32(1), jc.BitCount.stack([huge]), jnp.int32(2))},
    )
    counts = collect_counter(state)
    assert isinstance(counts, jc.BitCount) and np.asarray(counts).tolist() == [big, 3, huge]
    assert int(counts.sum()) == int(jax.jit(lambda c: c.sum())(counts)) == big + 3 + huge
    messages = collect_counter(state, "messages")
    assert messages.dtype == jnp.int32 and int(messages.sum()) == 3
    assert collect_counter({}).shape == (0,)


def test_process_trainer_under_the_mpi_watchdog_trains_the_same():
    """``fit(watchdog_s=...)`` runs the steps under MPIComm's watchdog (here one process, the MPI
    singleton): the same history as without it, the watchdog's thread gone afterwards; a
    communicator without a watchdog is refused before any step."""
    pytest.importorskip("mpi4jax")
    import threading

    from jaxcomm.comm import Local, MPIComm

    train = data.load_digits()
    comm = MPIComm()
    losses = []
    for watchdog_s in (None, 30.0):
        model = models.MLP(in_features=64, hidden=(8,), num_classes=10, rngs=nnx.Rngs(0))
        trainer = Trainer(model, optax.sgd(0.1), comm=comm)
        batches = data.WorkerBatches([train], 16, jax.random.PRNGKey(0))
        threads = threading.active_count()
        _, history = trainer.fit(trainer.init_state(), batches, 3, progress=False, watchdog_s=watchdog_s)
        assert threading.active_count() == threads
        losses.append([row["loss"] for row in history])
    assert losses[0] == losses[1] and len(losses[0]) == 3
    trainer = Trainer(
        models.MLP(in_features=64, hidden=(8,), num_classes=10, rngs=nnx.Rngs(0)), optax.sgd(0.1), comm=Local()
    )
    with pytest.raises(ValueError, match="watchdog_s"):
        trainer.fit(trainer.init_state(), data.WorkerBatches([train], 16, jax.random.PRNGKey(0)), 1, watchdog_s=5.0)
