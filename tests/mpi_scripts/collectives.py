"""MPI worker: MPIComm's reduce_scatter, all_to_all, broadcast and capabilities against NumPy.

Usage: ``mpirun -n N python tests/mpi_scripts/collectives.py`` (N >= 2). Every
rank builds every rank's input from a seed, so each computes the NumPy reference
of its own result locally and asserts it; a failed assertion exits non-zero.
Rank 0 prints ``collectives ok on N processes`` when every rank passed. Also
:func:`jaxcomm.comm.all_gather_counted` on count-based payloads (:func:`check_counted_gather`).
"""

from __future__ import annotations

import sys
from pathlib import Path

import jax
import jax.numpy as jnp
import ml_dtypes
import numpy as np
from mpi4py import MPI

import jaxcomm as jc
from jaxcomm.comm import CAPABILITIES, MPIComm, all_gather_counted, is_communicator, require
from jaxcomm.comm._protocol import REDUCE_SCATTER

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # tests/: the NumPy byte counts
from counted_bytes import expected_sent


def inputs(n: int, w: int) -> dict:
    """Worker ``w``'s leaves, each of shape ``(n, ...)``: row ``j`` is its chunk for owner ``j``."""
    rng = np.random.default_rng(1000 + w)
    return {
        "f32": rng.normal(size=(n, 3, 2)).astype(np.float32),
        "i32": rng.integers(-50, 50, size=(n, 4)).astype(np.int32),
        "u8": rng.integers(0, 256, size=(n, 5)).astype(np.uint8),
        "bool": rng.integers(0, 2, size=(n, 3)).astype(np.bool_),
        "bf16": rng.normal(size=(n, 6)).astype(ml_dtypes.bfloat16),
        "f16": rng.normal(size=(n, 6)).astype(np.float16),
    }


COUNT_BASED = [
    jc.compressors.threshold(v=1.5),
    jc.compressors.threshold(v=1e9),  # every count 0: the smallest bucket
    jc.compressors.adaptive(ratio=0.05),
    jc.compressors.inceptionn(error_bound=2.0**-4),
    jc.compressors.random_sparsification(p=0.01),  # an index list at this size
]


@jax.jit
def counted_payloads(w):
    """Worker ``w``'s payloads of :data:`COUNT_BASED` for 3000 entries whose scale grows with ``w``
    (so the counts differ between workers)."""
    x = jax.random.normal(jax.random.key(2000), (3000,)) * (1.0 + w.astype(jnp.float32)) + w.astype(jnp.float32)
    return [c.compress(x, jax.random.fold_in(jax.random.key(1), w))[0] for c in COUNT_BASED]


def check_counted_gather(comm, n: int, r: int) -> None:
    """all_gather_counted inside jit over MPI (a lax.switch of MPI_Allgather branches): equal to
    comm.all_gather bit for bit, the bucket and the bytes sent per payload as NumPy computes them
    from every worker's counts; alone, for the payloads whose counts are all 0, and together."""
    everyone = [counted_payloads(jnp.int32(w)) for w in range(n)]
    gather = jax.jit(lambda t: (all_gather_counted(comm, t), comm.all_gather(t)))
    for pick in ([0], [1], [2], [3], [4], [0, 2, 3, 4]):
        mine = [everyone[r][i] for i in pick]
        res, plain = gather(mine)
        for a, b in zip(jax.tree.leaves(res.items), jax.tree.leaves(plain)):
            assert a.dtype == b.dtype and a.shape == b.shape
            np.testing.assert_array_equal(np.asarray(a).view(np.uint8), np.asarray(b).view(np.uint8))
        bucket, sent = expected_sent([[row[i] for i in pick] for row in everyone])
        assert int(res.bucket_bytes) == bucket, (pick, int(res.bucket_bytes), bucket)
        assert [int(s) for s in res.sent_bytes] == sent[r], (pick, res.sent_bytes, sent[r])
        assert res.messages == 2


def main() -> None:
    comm = MPIComm()
    n, r = comm.size, comm.rank
    assert n >= 2, "run under mpirun -n N with N >= 2"
    assert is_communicator(comm) and comm.capabilities == CAPABILITIES
    assert require(comm, REDUCE_SCATTER, for_what="the test") is comm

    everyone = [inputs(n, w) for w in range(n)]
    mine = {k: jnp.asarray(v) for k, v in everyone[r].items()}
    keys = jax.random.split(jax.random.key(7), n * n).reshape(n, n)  # the same on every rank
    my_keys = keys[r]  # row j: this rank's key for rank j (n keys)

    @jax.jit
    def step(tree, k):
        return comm.reduce_scatter(tree), comm.all_to_all(tree), comm.all_to_all(k)

    rs, a2a, a2a_keys = step(mine, jnp.stack([my_keys[j] for j in range(n)]))

    # all_to_all: row i came from rank i, its row r.
    for k, v in a2a.items():
        want = np.stack([everyone[i][k][r] for i in range(n)])
        assert v.dtype == mine[k].dtype, k
        np.testing.assert_array_equal(np.asarray(v), want, err_msg=f"all_to_all {k}")
    assert a2a_keys.dtype == keys.dtype
    np.testing.assert_array_equal(
        np.asarray(jax.random.key_data(a2a_keys)), np.asarray(jax.random.key_data(keys[:, r]))
    )

    # reduce_scatter: this rank owns chunk r, the sum over ranks.
    rows = {k: np.stack([everyone[i][k][r] for i in range(n)]) for k in everyone[r]}
    np.testing.assert_allclose(np.asarray(rs["f32"]), rows["f32"].sum(0), rtol=1e-6, atol=1e-6)
    np.testing.assert_array_equal(np.asarray(rs["i32"]), rows["i32"].sum(0, dtype=np.int32))
    np.testing.assert_array_equal(np.asarray(rs["u8"]), rows["u8"].sum(0, dtype=np.uint8))
    np.testing.assert_array_equal(np.asarray(rs["bool"]), rows["bool"].any(0))
    for k in ("bf16", "f16"):  # summed in float32, cast back once
        assert rs[k].dtype == mine[k].dtype, k
        want = rows[k].astype(np.float32).sum(0).astype(rows[k].dtype).astype(np.float32)
        np.testing.assert_allclose(
            np.asarray(rs[k], np.float32), want, rtol=float(ml_dtypes.finfo(rows[k].dtype).eps), err_msg=k
        )
    # float32 accumulation is visible: 256 + 1 + ... + 1 is 256 in a bfloat16 running sum.
    big = np.ones((n, 2), np.float32)
    if r == 0:
        big[:] = 256.0
    got = jax.jit(comm.reduce_scatter)(jnp.asarray(big, jnp.bfloat16))
    want = np.float32(256.0 + n - 1).astype(ml_dtypes.bfloat16).astype(np.float32)
    np.testing.assert_array_equal(np.asarray(got, np.float32), np.full(2, want))

    # sum of 16-bit floats: a 16-bit reduce-scatter + all-gather, summed in float32 and rounded
    # once; odd lengths are padded to n chunks. 256 + 1 + ... + 1 survives float32 accumulation.
    for k in ("bf16", "f16"):
        x = np.concatenate([mine[k].reshape(-1), mine[k].reshape(-1)[:5]])  # 6 n + 5 entries
        got = jax.jit(comm.sum)(jnp.asarray(x))
        assert got.dtype == x.dtype, k
        allx = [np.concatenate([e[k].reshape(-1), e[k].reshape(-1)[:5]]) for e in everyone]
        want = np.sum([a.astype(np.float32) for a in allx], axis=0).astype(x.dtype).astype(np.float32)
        np.testing.assert_allclose(
            np.asarray(got, np.float32), want, rtol=float(ml_dtypes.finfo(x.dtype).eps), err_msg=f"sum {k}"
        )
    big = np.full(7, 256.0 if r == 0 else 1.0, np.float32)
    got = jax.jit(comm.sum)(jnp.asarray(big, jnp.bfloat16))
    want = np.float32(256.0 + n - 1).astype(ml_dtypes.bfloat16).astype(np.float32)
    np.testing.assert_array_equal(np.asarray(got, np.float32), np.full(7, want))

    # broadcast from every root: integers, bool, 16-bit floats and typed keys.
    tree = {"i32": mine["i32"], "bool": mine["bool"], "bf16": mine["bf16"], "key": my_keys}
    outs = jax.jit(lambda t: [comm.broadcast(t, root) for root in range(n)])(tree)
    for root, out in enumerate(outs):
        for k in ("i32", "bool", "bf16"):
            np.testing.assert_array_equal(np.asarray(out[k]), everyone[root][k], err_msg=f"root {root} {k}")
        np.testing.assert_array_equal(
            np.asarray(jax.random.key_data(out["key"])), np.asarray(jax.random.key_data(keys[root]))
        )

    # a leaf without the (n, ...) leading axis is refused, naming the collective
    for f, name in ((comm.reduce_scatter, "reduce_scatter"), (comm.all_to_all, "all_to_all")):
        try:
            f(jnp.ones((n + 1, 2)))
        except ValueError as e:
            assert name in str(e) and f"length {n}" in str(e), e
        else:
            raise AssertionError(f"{name}: expected ValueError")

    check_counted_gather(comm, n, r)

    # host side: the smallest value over the processes, on every process (the resume step)
    assert comm.rank == r and comm.agree_min(10 - r) == 10 - (n - 1), comm.agree_min(10 - r)

    ok = MPI.COMM_WORLD.allreduce(1, op=MPI.SUM) == n
    if r == 0 and ok:
        print(f"collectives ok on {n} processes")


if __name__ == "__main__":
    main()
