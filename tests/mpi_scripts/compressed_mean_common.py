"""Cases shared by the MPI worker script and the mesh side of tests/test_mpi_backend.py.

Every case is a factory ``f(**where) -> optax transform`` called with either
``axis_name="data"`` (mesh backend, inside ``jax.shard_map``) or
``comm=MPIComm()`` (MPI backend, one process per worker). The worker step is
the same function on both sides, so the two backends run the same algorithm
code. Adding a transform to the cross-backend check is one more entry in
``CASES``.
"""

from __future__ import annotations

import sys
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
import optax

import jaxcomm as jc
from jaxcomm import memory as mem
from jaxcomm.transforms import compressed_mean, doublesqueeze

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # tests/: the compressor examples
from compressor_examples import EXACT_SETTINGS

N = 4
STEPS = 3
LR = 0.1
SHAPES = {"b": (5,), "v": (16, 12), "w": (4, 4, 12)}  # v and w: one matrix view (16, 12)

CASES = {
    # allreduce with a shared key: random-k values summed, positions regenerated from the key
    "randomk_allreduce": lambda **where: compressed_mean(
        jc.compressors.randomk(ratio=0.25), memory=mem.residual(), **where
    ),
    # allgather of a stochastic compressor: per-worker keys fold_in(rank) must match fold_in(axis_index)
    # (made contractive: error feedback refuses QSGD's unscaled ω >= 1)
    "qsgd_allgather": lambda **where: compressed_mean(
        jc.compressors.contractive(jc.compressors.qsgd(levels=4)), memory=mem.residual(), **where
    ),
    # count-based payloads: a count gather, then a lax.switch of bucket-sized all-gathers
    "threshold_allgather": lambda **where: compressed_mean(
        jc.compressors.threshold(v=0.5), memory=mem.residual(), **where
    ),
    # DGC's exact setting (k = d: every entry sent, nothing left in the memory) over the counted gather
    "dgc_exact_allgather": lambda **where: compressed_mean(
        jc.compressors.dgc(ratio=1.0), memory=mem.residual(), **where
    ),
    # two allreduce rounds yielded by the compressor's rounds (P, then Q)
    "powersgd_allreduce": lambda **where: compressed_mean(
        jc.compressors.powersgd(matrix_approximation_rank=1), memory=mem.residual(), **where
    ),
    # PyTorch's options: a dense all-reduce on step 0, then v and w (one matrix view) in one vmapped batch
    "powersgd_batched_warmup": lambda **where: compressed_mean(
        jc.compressors.powersgd(rank=1, start_powerSGD_iter=1, batch_tensors_with_same_shape=True),
        memory=mem.residual(),
        **where,
    ),
    # DoubleSqueeze: worker and server error feedback around 1-bit scaled-sign payloads
    "doublesqueeze": lambda **where: doublesqueeze(jc.compressors.scaled_sign(), **where),
    # reduce-scatter: 16-bit chunks to their owners, float32 sums, 16-bit averaged chunks gathered
    "fp16_reduce_scatter": lambda **where: compressed_mean(
        jc.compressors.fp16(), memory=mem.residual(), strategy="reduce_scatter", **where
    ),
    # a NaN in worker 1's gradient at step 1: the flag's all-reduce, then every process skips the step
    "topk_skip_nonfinite": lambda **where: optax.chain(
        nan_once(step=1, worker=1, **where),
        compressed_mean(jc.compressors.topk(ratio=0.25), memory=mem.residual(), skip_nonfinite=True, **where),
    ),
}


def _exact(name: str, kwargs: dict):
    return lambda **where: compressed_mean(jc.compressors.make(name, **kwargs), memory=mem.residual(), **where)


# Every setting the docs call exact (tests/compressor_examples.EXACT_SETTINGS), with error feedback:
# over MPI each must train exactly as "exact none" (the uncompressed mean); DGC's is dgc_exact_allgather.
EXACT_CASES = {
    f"exact {label}": _exact(*setting) for label, setting in EXACT_SETTINGS.items() if label != "dgc(ratio=1)"
}
CASES.update(EXACT_CASES)

# Per-case tolerance of the MPI-vs-mesh comparison (default 1e-6: same float32
# operations, only the reduction order of the allreduce may differ).
# PowerSGD: Gram-Schmidt on the allreduced P amplifies the reduction-order difference a little.
TOLERANCE: dict[str, float] = {"powersgd_allreduce": 1e-5, "powersgd_batched_warmup": 1e-5}


def nan_once(step: int, worker: int, **where) -> optax.GradientTransformation:
    """Puts a NaN in the first entry of ``worker``'s first gradient leaf at ``step`` (0-based)."""
    comm = jc.comm.resolve(**where)

    def init(params):
        del params
        return jnp.zeros((), jnp.int32)

    def update(updates, count, params=None):
        del params
        leaves, treedef = jax.tree.flatten(updates)
        hit = (count == step) & (comm.index() == worker)
        first = jnp.ravel(leaves[0])
        first = first.at[0].set(jnp.where(hit, jnp.nan, first[0]).astype(first.dtype))
        leaves[0] = first.reshape(jnp.shape(leaves[0]))
        return treedef.unflatten(leaves), count + 1

    return optax.GradientTransformation(init, update)


def data(n: int = N, seed: int = 0):
    """Per-worker a_i, b_i (leading worker axis) and the initial parameters."""
    rng = np.random.default_rng(seed)
    a = {k: rng.uniform(0.5, 1.5, (n, *s)).astype(np.float32) for k, s in SHAPES.items()}
    b = {k: rng.normal(size=(n, *s)).astype(np.float32) for k, s in SHAPES.items()}
    x0 = {k: rng.normal(size=s).astype(np.float32) for k, s in SHAPES.items()}
    return a, b, x0


def make_worker_step(tx):
    """One worker's step: g = a ⊙ x − b, then ``chain(tx, sgd(LR))``. Same code for both backends."""
    opt = optax.chain(tx, optax.sgd(LR))

    def step(a, b, x, state):
        g = {k: a[k] * x[k] - b[k] for k in x}
        u, state = opt.update(g, state, x)
        return optax.apply_updates(x, u), state

    return opt, step


def run_mesh(case: str, n: int = N):
    """Final parameters per worker (leading axis n) on an n-device mesh axis "data"."""
    from jax.sharding import Mesh, NamedSharding
    from jax.sharding import PartitionSpec as P

    mesh = Mesh(np.array(jax.devices()[:n]), ("data",))
    opt, step = make_worker_step(CASES[case](axis_name="data"))
    a, b, x0 = data(n)

    def worker(a, b, x, state):
        a, b, x, state = jax.tree.map(lambda v: v[0], (a, b, x, state))
        x, state = step(a, b, x, state)
        return jax.tree.map(lambda v: v[None], (x, state))

    f = jax.jit(jax.shard_map(worker, mesh=mesh, in_specs=(P("data"),) * 4, out_specs=P("data")))
    put = lambda t: jax.device_put(t, NamedSharding(mesh, P("data")))
    stack = lambda t: jax.tree.map(lambda v: jnp.broadcast_to(jnp.asarray(v), (n, *jnp.shape(v))), t)
    a, b, x, state = put(a), put(b), put(stack(x0)), put(stack(opt.init(x0)))
    for _ in range(STEPS):
        x, state = f(a, b, x, state)
    return {k: np.asarray(v) for k, v in x.items()}


def run_mpi(case: str, comm):
    """This process's final parameters with ``comm`` (an MPIComm)."""
    opt, step = make_worker_step(CASES[case](comm=comm))
    a, b, x0 = data(comm.size)
    r = comm.rank
    a = {k: jnp.asarray(v[r]) for k, v in a.items()}
    b = {k: jnp.asarray(v[r]) for k, v in b.items()}
    x = {k: jnp.asarray(v) for k, v in x0.items()}
    state = opt.init(x)
    f = jax.jit(step)
    for _ in range(STEPS):
        x, state = f(a, b, x, state)
    return {k: np.asarray(v) for k, v in x.items()}


def check_protocol(comm) -> None:
    """Assert every Communicator method of ``comm`` inside jit (float32, uint8, bfloat16, bool leaves)."""
    from jaxcomm.comm import is_communicator

    n, r = comm.size, comm.rank
    assert is_communicator(comm) and n >= 3

    @jax.jit
    def f(x):
        tree = {"f": x, "u": x.astype(jnp.uint8), "h": x.astype(jnp.bfloat16), "b": x > 1}
        ring = [(i, (i + 1) % n) for i in range(n)]
        return (
            comm.sum(tree),
            comm.mean(x),
            comm.all_gather(tree),
            comm.broadcast(tree, 2),
            comm.permute(x, ring),
            comm.permute(x, [(0, 1)]),
            comm.index(),
            comm.varying(x),
        )

    x = jnp.full((4,), float(r + 1))
    s, m, g, b, ring, one, idx, v = f(x)
    total = n * (n + 1) / 2
    assert np.all(np.asarray(s["f"]) == total) and np.all(np.asarray(s["u"]) == total)
    assert s["h"].dtype == jnp.bfloat16 and np.all(np.asarray(s["h"], np.float32) == total)
    assert np.all(np.asarray(s["b"]))  # True on n - 1 workers
    assert np.allclose(np.asarray(m), (n + 1) / 2)
    assert g["h"].dtype == jnp.bfloat16 and g["h"].shape == (n, 4)
    assert np.array_equal(np.asarray(g["f"])[:, 0], np.arange(1.0, n + 1))
    assert np.array_equal(np.asarray(g["b"])[:, 0], np.arange(n) > 0)
    assert np.all(np.asarray(b["f"]) == 3.0) and b["u"].dtype == jnp.uint8
    assert np.all(np.asarray(b["h"], np.float32) == 3.0)
    assert np.all(np.asarray(ring) == float((r - 1) % n + 1))  # received from the left neighbour
    assert np.all(np.asarray(one) == (1.0 if r == 1 else 0.0))  # only worker 1 is a destination
    assert int(idx) == r and np.array_equal(np.asarray(v), np.asarray(x))
    for bad in (lambda: comm.broadcast(x, n), lambda: comm.permute(x, [(0, 1), (2, 1)])):
        try:
            bad()
        except ValueError:
            pass
        else:
            raise AssertionError("expected ValueError")
