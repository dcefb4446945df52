"""The communicator protocol: declared capabilities, resolve's order, and the mesh collectives.

reduce_scatter, all_to_all, broadcast and permute of :class:`MeshAxis` are checked
against NumPy under ``jax.vmap`` and under ``jax.shard_map`` (``check_vma=True``)
for every group size 1..8; the MPI backend runs the same checks under ``mpirun``
(tests/test_mpi_backend.py, tests/mpi_scripts/collectives.py).
"""

from __future__ import annotations

import math
import re

import jax
import jax.numpy as jnp
import ml_dtypes
import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

from jaxcomm.comm import CAPABILITIES, Local, MeshAxis, MPIComm, current, is_communicator, require, resolve, use
from jaxcomm.comm._protocol import (
    ALL_GATHER,
    ALL_TO_ALL,
    BROADCAST,
    HOST_MEMBERS,
    PERMUTE,
    REDUCE_SCATTER,
    SUM,
    capabilities_of,
    require_host,
    serves,
)

pytestmark = pytest.mark.strict_promotion

AXIS = "i"
comm = MeshAxis(AXIS)


def on_vmap(f, *xs):
    """``f`` on every worker; ``xs`` stacked over the workers (leading axis n)."""
    return jax.vmap(f, axis_name=AXIS)(*xs)


def on_mesh(f, *xs):
    """``f`` on every worker of a mesh of ``n`` devices (``shard_map``, ``check_vma=True``)."""
    n = jax.tree.leaves(xs)[0].shape[0]
    mesh = jax.make_mesh((n,), (AXIS,), devices=jax.devices()[:n])
    put = lambda t: jax.device_put(t, NamedSharding(mesh, P(AXIS)))
    body = lambda *v: jax.tree.map(lambda o: o[None], f(*jax.tree.map(lambda a: a[0], v)))
    sm = jax.shard_map(body, mesh=mesh, in_specs=P(AXIS), out_specs=P(AXIS), check_vma=True)
    return jax.jit(sm)(*jax.tree.map(put, xs))


RUNNERS = {"vmap": on_vmap, "shard_map": on_mesh}


def np_of(x):
    x = jax.random.key_data(x) if jax.dtypes.issubdtype(x.dtype, jax.dtypes.prng_key) else x
    return np.asarray(x)


# --------------------------------------------------------------------------- #
# Declared capabilities
# --------------------------------------------------------------------------- #
def test_vocabulary_and_backends_declare_everything():
    assert {SUM, ALL_GATHER, REDUCE_SCATTER, ALL_TO_ALL, BROADCAST, PERMUTE} == CAPABILITIES
    assert MeshAxis.capabilities == CAPABILITIES and MPIComm.capabilities == CAPABILITIES
    assert is_communicator(comm) and capabilities_of(comm) == CAPABILITIES
    assert all(serves(comm, c) for c in CAPABILITIES)
    for c in CAPABILITIES:  # the capability names the method that serves it
        assert callable(getattr(MeshAxis, c)) and callable(getattr(MPIComm, c))


def test_host_side_members_of_every_communicator():
    """rank, agree_min and watchdog (declared None where not served) on every backend, outside
    jit; one process here: the agreement is the value itself. MPIComm's, over several processes:
    tests/mpi_scripts/collectives.py."""
    for c in (Local(), MeshAxis(AXIS)):
        assert require_host(c) is c and c.rank == 0 and c.agree_min(np.int64(7)) == 7 == c.agree_min(7)
        assert isinstance(c.agree_min(-1), int)
        with pytest.raises(TypeError, match=r"value must be an int; got 2\.5"):
            c.agree_min(2.5)
    assert Local.watchdog is None and MeshAxis.watchdog is None
    assert callable(MPIComm.watchdog) and callable(MPIComm.agree_min)
    assert set(HOST_MEMBERS) == {"rank", "agree_min", "watchdog"}
    with pytest.raises(TypeError, match=r"the checkpoint needs .*Minimal.* lacks \['rank', 'agree_min', 'watchdog'\]"):
        require_host(Minimal(), for_what="the checkpoint")


class Minimal:
    """Core members only, and a sum."""

    capabilities = frozenset({SUM})
    size = 2

    def index(self):
        return jnp.int32(0)

    def varying(self, tree):
        return tree

    def sum(self, tree):
        return tree

    def mean(self, tree):
        return tree


def test_is_communicator_reads_the_declaration():
    assert is_communicator(Minimal()) and capabilities_of(Minimal()) == {SUM}

    class Undeclared(MeshAxis):  # every method, but no declaration
        capabilities = None

    class Unknown(Minimal):
        capabilities = frozenset({SUM, "gossip"})

    class Lying(Minimal):  # declares a collective it has no method for
        capabilities = frozenset({SUM, ALL_TO_ALL})

    class NoCore(Minimal):
        varying = None

    del NoCore.varying
    assert not is_communicator(Undeclared(AXIS))
    assert not is_communicator(Unknown()) and not is_communicator(Lying())
    assert not is_communicator(object()) and not is_communicator(Minimal)  # the class is no instance
    assert is_communicator(resolve())  # the ambient proxy declares through a property
    with pytest.raises(TypeError, match="capabilities"):
        resolve(comm=Undeclared(AXIS))
    with pytest.raises(TypeError, match="capabilities"), use(Lying()):
        pass


def test_require_names_the_communicator_the_collective_and_the_need():
    assert require(comm, REDUCE_SCATTER, BROADCAST, for_what="x") is comm
    with pytest.raises(ValueError) as e:
        require(Minimal(), REDUCE_SCATTER, for_what="compressed_mean strategy 'reduce_scatter'")
    msg = str(e.value)
    assert "compressed_mean strategy 'reduce_scatter'" in msg and "'reduce_scatter'" in msg
    assert "Minimal" in msg and "serves: sum" in msg
    with pytest.raises(ValueError, match="'all_gather', 'permute'"):
        require(Minimal(), ALL_GATHER, PERMUTE)
    with pytest.raises(ValueError, match="unknown collective 'gossip'"):
        require(comm, "gossip")
    with pytest.raises(ValueError, match="unknown collective"):
        serves(comm, "allreduce")  # strategy names are not collective names
    with pytest.raises(TypeError, match="declares no capabilities"):
        require(object(), SUM)


# --------------------------------------------------------------------------- #
# resolve: comm= > axis_name= > ambient use(...) > error
# --------------------------------------------------------------------------- #
def test_resolve_order():
    explicit = Minimal()
    assert resolve(comm=explicit) is explicit
    assert repr(resolve(axis_name="data")) == "MeshAxis('data')"
    with pytest.raises(ValueError, match="at most one"):
        resolve("data", explicit)
    ambient = resolve()
    with pytest.raises(ValueError, match="no communicator"):
        _ = ambient.size  # nothing set: the error comes at use (trace) time
    with use(MeshAxis(AXIS)) as c:
        assert current() is c and ambient.capabilities == CAPABILITIES
        out = on_vmap(lambda x: (ambient.mean(x), ambient.index()), jnp.arange(4.0))
        np.testing.assert_array_equal(out[0], [1.5] * 4)
        np.testing.assert_array_equal(out[1], np.arange(4))
        assert ambient.axis_name == AXIS  # backend extras are forwarded
    with use(Minimal()):
        assert current().size == 2


def test_resolve_checks_what_the_caller_needs():
    assert resolve(axis_name=AXIS, needs=(REDUCE_SCATTER,)).axis_name == AXIS
    with pytest.raises(ValueError, match=r"my transform needs the collective 'broadcast'.*Minimal"):
        resolve(comm=Minimal(), needs=(SUM, BROADCAST), for_what="my transform")
    with pytest.raises(ValueError, match="unknown collective"):
        resolve(axis_name=AXIS, needs=("allgather",))
    ambient = resolve(needs=(ALL_TO_ALL,), for_what="my transform")  # checked when looked up
    with use(Minimal()), pytest.raises(ValueError, match="my transform needs the collective 'all_to_all'"):
        ambient.sum(1.0)
    with use(comm):
        np.testing.assert_array_equal(on_vmap(ambient.sum, jnp.ones(3)), [3.0] * 3)


# --------------------------------------------------------------------------- #
# broadcast: a binomial tree of ppermutes
# --------------------------------------------------------------------------- #
def bcast_inputs(n):
    rng = np.random.default_rng(n)
    return {
        "f32": jnp.asarray(rng.normal(size=(n, 3)), jnp.float32),
        "i32": jnp.asarray(rng.integers(-9, 9, size=(n, 2)), jnp.int32),
        "u8": jnp.asarray(rng.integers(0, 255, size=(n,)), jnp.uint8),
        "bf16": jnp.asarray(rng.normal(size=(n, 2)), jnp.bfloat16),
        "bool": jnp.asarray(rng.integers(0, 2, size=(n, 4)), jnp.bool_),
        "key": jax.random.split(jax.random.key(n), n),
    }


@pytest.mark.parametrize("how", sorted(RUNNERS))
@pytest.mark.parametrize("n", range(1, 9))
def test_broadcast_every_root_matches_numpy(n, how):
    tree = bcast_inputs(n)
    outs = RUNNERS[how](lambda t: [comm.broadcast(t, root) for root in range(n)], tree)
    for root, out in enumerate(outs):
        for k, x in tree.items():
            assert out[k].dtype == x.dtype, k
            want = np.broadcast_to(np_of(x)[root], np_of(x).shape)
            np.testing.assert_array_equal(np_of(out[k]), want, err_msg=f"n={n} root={root} {k}")


@pytest.mark.parametrize("n", [2, 3, 5, 8])
def test_broadcast_is_a_tree_of_permutes_not_all_reduces(n):
    mesh = jax.make_mesh((n,), (AXIS,), devices=jax.devices()[:n])
    f = jax.jit(jax.shard_map(lambda x: comm.broadcast(x, n - 1), mesh=mesh, in_specs=P(AXIS), out_specs=P(AXIS)))
    x = jax.device_put(jnp.zeros((n, 16), jnp.float32), NamedSharding(mesh, P(AXIS)))
    hlo = f.lower(x).as_text(dialect="hlo")
    assert "all-reduce" not in hlo
    permutes = re.findall(r"collective-permute(?:-start)?\(", hlo)
    assert len(permutes) == math.ceil(math.log2(n))
    # round k sends from 2**k workers (fewer in the last round): n - 1 transfers in all
    pairs = re.findall(r"source_target_pairs=\{((?:\{\d+,\d+\},?)*)\}", hlo)
    assert sum(len(re.findall(r"\{\d+,\d+\}", p)) for p in pairs) == n - 1


def test_broadcast_bad_root():
    for root in (-1, 4):
        with pytest.raises(ValueError, match=r"root must be in \[0, 4\)"):
            on_vmap(lambda x, root=root: comm.broadcast(x, root), jnp.ones(4))


# --------------------------------------------------------------------------- #
# reduce_scatter and all_to_all
# --------------------------------------------------------------------------- #
DTYPES = {"float32": jnp.float32, "int32": jnp.int32, "int8": jnp.int8, "uint8": jnp.uint8}


@settings(max_examples=12)
@given(
    n=st.integers(1, 8),
    tail=st.lists(st.integers(1, 3), max_size=2),
    dtype=st.sampled_from(sorted(DTYPES)),
    how=st.sampled_from(sorted(RUNNERS)),
    seed=st.integers(0, 2**16),
)
def test_reduce_scatter_and_all_to_all_match_numpy(n, tail, dtype, how, seed):
    rng = np.random.default_rng(seed)
    shape = (n, n, *tail)  # worker w, chunk j (owned by worker j), chunk shape
    if dtype != "float32":  # integers wrap around in their dtype, as NumPy's sum(dtype=...) does
        x = rng.integers(-128, 128, size=shape).astype(dtype)
    else:
        x = rng.normal(size=shape).astype(np.float32)
    xj = jnp.asarray(x, DTYPES[dtype])
    rs, a2a = RUNNERS[how](lambda v: (comm.reduce_scatter(v), comm.all_to_all(v)), xj)
    assert rs.shape == (n, *tail) and rs.dtype == xj.dtype and a2a.dtype == xj.dtype
    np.testing.assert_array_equal(np.asarray(a2a), np.asarray(xj).swapaxes(0, 1))  # out_j[i] = x_i[j]
    want = np.asarray(xj).sum(0, dtype=np.asarray(xj).dtype)  # owner j: sum over workers of chunk j
    if dtype != "float32":
        np.testing.assert_array_equal(np.asarray(rs), want)
    else:
        np.testing.assert_allclose(np.asarray(rs), want, rtol=1e-6, atol=1e-6)


@pytest.mark.parametrize("how", sorted(RUNNERS))
@pytest.mark.parametrize(
    "dtype, big, n", [(jnp.bfloat16, 256.0, 4), (jnp.float16, 2048.0, 4), (jnp.bfloat16, 256.0, 7)]
)
def test_16bit_reduce_scatter_sums_in_float32(dtype, big, n, how):
    # Worker 0 contributes `big`, the others 1 each, to every chunk. At `big` the 16-bit spacing
    # is 2, so a 16-bit running sum stays at `big`; the float32 sum is big + n - 1, rounded once.
    x = np.ones((n, n, 3), np.float32)
    x[0] = big
    rs = RUNNERS[how](comm.reduce_scatter, jnp.asarray(x, dtype))
    np_dtype = ml_dtypes.bfloat16 if dtype == jnp.bfloat16 else np.float16
    want = np.float32(big + n - 1).astype(np_dtype)
    assert rs.dtype == dtype and float(want) != big
    np.testing.assert_array_equal(np.asarray(rs, np.float32), np.full((n, 3), float(want), np.float32))
    # and random values: the float32 sum, cast back
    rng = np.random.default_rng(n)
    y = jnp.asarray(rng.normal(size=(n, n, 5)), dtype)
    rs = RUNNERS[how](comm.reduce_scatter, y)
    ref = np.asarray(y, np.float32).sum(0).astype(np_dtype).astype(np.float32)
    np.testing.assert_allclose(np.asarray(rs, np.float32), ref, rtol=float(ml_dtypes.finfo(np_dtype).eps))


@pytest.mark.parametrize("how", sorted(RUNNERS))
def test_reduce_scatter_and_all_to_all_of_trees_bools_and_keys(how):
    n = 3
    rng = np.random.default_rng(0)
    b = jnp.asarray(rng.integers(0, 2, size=(n, n, 4)), jnp.bool_)
    keys = jax.random.split(jax.random.key(1), n * n).reshape(n, n)
    tree = {"b": b, "u": jnp.asarray(rng.integers(0, 9, size=(n, n)), jnp.uint8)}
    rs = RUNNERS[how](comm.reduce_scatter, tree)
    np.testing.assert_array_equal(np.asarray(rs["b"]), np.asarray(b).any(0))  # a logical or
    np.testing.assert_array_equal(np.asarray(rs["u"]), np.asarray(tree["u"]).sum(0, dtype=np.uint8))
    a2a = RUNNERS[how](comm.all_to_all, {"b": b, "k": keys})
    np.testing.assert_array_equal(np.asarray(a2a["b"]), np.asarray(b).swapaxes(0, 1))
    assert a2a["k"].dtype == keys.dtype
    np.testing.assert_array_equal(np_of(a2a["k"]), np_of(keys).swapaxes(0, 1))


def test_reduce_scatter_is_all_to_all_then_sum():
    n = 5
    x = jnp.asarray(np.random.default_rng(3).normal(size=(n, n, 7)), jnp.float32)
    rs, a2a = on_mesh(lambda v: (comm.reduce_scatter(v), comm.all_to_all(v)), x)
    np.testing.assert_allclose(np.asarray(rs), np.asarray(a2a).sum(1), rtol=1e-6, atol=1e-6)


def test_leading_axis_must_be_the_group():
    for f in (comm.reduce_scatter, comm.all_to_all):
        with pytest.raises(ValueError, match="leading axis of length 4"):
            on_vmap(f, jnp.ones((4, 3)))
        with pytest.raises(ValueError, match="leading axis of length 4"):
            on_vmap(f, jnp.ones(4))  # scalars per worker
    with pytest.raises(ValueError, match="not bound"):
        comm.reduce_scatter(jnp.ones((4, 3)))


# --------------------------------------------------------------------------- #
# permute: partial permutations under vmap too
# --------------------------------------------------------------------------- #
@pytest.mark.parametrize("how", sorted(RUNNERS))
def test_partial_permute_gives_zeros_to_unnamed_receivers(how):
    n = 5
    x = jnp.arange(1.0, n + 1)
    for perm in ([(0, 1)], [(4, 0), (1, 3)], [(i, (i + 1) % n) for i in range(n)]):
        want = np.zeros(n, np.float32)
        for s, d in perm:
            want[d] = s + 1
        np.testing.assert_array_equal(np.asarray(RUNNERS[how](lambda v, perm=perm: comm.permute(v, perm), x)), want)
    keys = jax.random.split(jax.random.key(0), n)
    out = RUNNERS[how](lambda v: comm.permute(v, [(2, 0)]), keys)
    np.testing.assert_array_equal(np_of(out)[0], np_of(keys)[2])
    np.testing.assert_array_equal(np_of(out)[1:], 0)
    with pytest.raises(ValueError, match="distinct"):
        on_vmap(lambda v: comm.permute(v, [(0, 1), (2, 1)]), x)
