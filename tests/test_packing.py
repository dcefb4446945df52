"""all_gather_packed: one collective for a whole tree, equal to the per-leaf all-gather bit for bit."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from jax.sharding import Mesh, NamedSharding
from jax.sharding import PartitionSpec as P

from jaxcomm.comm import MeshAxis, all_gather_packed

pytestmark = pytest.mark.strict_promotion

DTYPES = [
    jnp.float32,
    jnp.bfloat16,
    jnp.float16,
    jnp.int8,
    jnp.uint8,
    jnp.int16,
    jnp.uint16,
    jnp.int32,
    jnp.uint32,
    jnp.bool_,
]


def _leaf(rng, dtype, shape):
    if dtype == jnp.bool_:
        return jnp.asarray(rng.random(shape) < 0.5)
    if jnp.issubdtype(dtype, jnp.floating):
        v = rng.standard_normal(shape).astype(np.float32)
        if v.size:
            v.flat[0] = np.nan  # payload bits must survive, NaN included
        return jnp.asarray(v).astype(dtype)
    info = jnp.iinfo(dtype)
    return jnp.asarray(rng.integers(info.min, info.max, shape, dtype=np.int64)).astype(dtype)


@settings(max_examples=12, deadline=None)
@given(
    st.lists(
        st.tuples(st.sampled_from(range(len(DTYPES))), st.lists(st.integers(0, 5), min_size=0, max_size=3)),
        min_size=1,
        max_size=6,
    ),
    st.integers(1, 4),
    st.integers(0, 2**31 - 1),
)
def test_equals_per_leaf_all_gather(spec, n, seed):
    """Any mix of dtypes and shapes (scalars, empty arrays): the packed gather equals jax's per-leaf one."""
    rng = np.random.default_rng(seed)
    tree = [jnp.stack([_leaf(rng, DTYPES[d], tuple(shape)) for _ in range(n)]) for d, shape in spec]
    comm = MeshAxis("i")
    packed = jax.vmap(lambda t: all_gather_packed(comm, t), axis_name="i")(tree)
    plain = jax.vmap(lambda t: comm.all_gather(t), axis_name="i")(tree)
    assert jax.tree.structure(packed) == jax.tree.structure(plain)
    for a, b in zip(packed, plain):
        assert a.dtype == b.dtype and a.shape == b.shape == (n, n, *b.shape[2:])
        np.testing.assert_array_equal(
            np.asarray(a).view(np.uint8) if a.dtype != jnp.bool_ else np.asarray(a),
            np.asarray(b).view(np.uint8) if b.dtype != jnp.bool_ else np.asarray(b),
        )


def test_one_collective_inside_shard_map_and_keys_apart():
    """Inside shard_map: one all-gather for any number of packable leaves; a typed PRNG key goes on its own."""
    n = 4
    mesh = Mesh(np.array(jax.devices()[:n]), ("data",))
    comm = MeshAxis("data")

    def worker(x):
        x = x[0]
        tree = {"f": x, "i": (x * 3).astype(jnp.int8), "b": x > 0, "s": jnp.sum(x)}
        return jax.tree.map(lambda v: v[None], all_gather_packed(comm, tree))

    f = jax.jit(jax.shard_map(worker, mesh=mesh, in_specs=P("data"), out_specs=P("data")))
    x = jax.device_put(jnp.arange(n * 6, dtype=jnp.float32).reshape(n, 6) - 7.0, NamedSharding(mesh, P("data")))
    hlo = f.lower(x).as_text()
    assert hlo.count('stablehlo.all_gather"') + hlo.count("stablehlo.all_gather(") == 1, hlo
    out = f(x)
    xs = np.asarray(x)
    for w in range(n):  # every worker holds every worker's leaves, in worker order
        np.testing.assert_array_equal(np.asarray(out["f"][w]), xs)
        np.testing.assert_array_equal(np.asarray(out["i"][w]), (xs * 3).astype(np.int8))
        np.testing.assert_array_equal(np.asarray(out["b"][w]), xs > 0)
        np.testing.assert_array_equal(np.asarray(out["s"][w]), xs.sum(axis=1))

    keys = jax.vmap(lambda k, v: all_gather_packed(MeshAxis("i"), (k, v)), axis_name="i")(
        jax.random.split(jax.random.key(0), 3), jnp.arange(3.0)
    )
    assert jax.dtypes.issubdtype(keys[0].dtype, jax.dtypes.prng_key) and keys[0].shape == (3, 3)
    np.testing.assert_array_equal(np.asarray(keys[1]), np.tile(np.arange(3.0), (3, 1)))
