"""all_gather_packed: one collective for a whole tree, equal to the per-leaf all-gather bit for bit;
all_gather_counted: the same with count-prefixed fields sent only up to their counts."""

from __future__ import annotations

import itertools
import math
from typing import ClassVar

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from counted_bytes import expected_sent
from hypothesis import given, settings
from hypothesis import strategies as st
from jax.sharding import Mesh, NamedSharding
from jax.sharding import PartitionSpec as P

import jaxcomm as jc
from jaxcomm.comm import MeshAxis, all_gather_counted, all_gather_packed
from jaxcomm.comm._packing import bucket_sizes, sum_packed
from jaxcomm.compressors.payloads import Payload, payload_dataclass, static_field

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


def leaf_specs(dtypes):
    """1 to 6 leaves: (index into ``dtypes``, shape of up to 3 axes of 0 to 5 entries)."""
    return st.lists(
        st.tuples(st.sampled_from(range(len(dtypes))), st.lists(st.integers(0, 5), min_size=0, max_size=3)),
        min_size=1,
        max_size=6,
    )


@settings(max_examples=12, deadline=None)
@given(
    leaf_specs(DTYPES),
    st.integers(1, 4),
    st.integers(0, 2**31 - 1),
)
def test_equals_per_leaf_all_gather(spec, n, seed):
    """Any mix of dtypes and shapes (scalars, empty arrays): the packed gather equals jax's per-leaf one."""
    rng = np.random.default_rng(seed)
    tree = [jnp.stack([_leaf(rng, DTYPES[d], tuple(shape)) for _ in range(n)]) for d, shape in spec]
    comm = MeshAxis("i")
    packed, plain = jax.jit(
        lambda t: (
            jax.vmap(lambda w: all_gather_packed(comm, w), axis_name="i")(t),
            jax.vmap(comm.all_gather, axis_name="i")(t),
        )
    )(tree)
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


SUM_DTYPES = [jnp.float32, jnp.bfloat16, jnp.float16, jnp.int32, jnp.uint8]


@settings(max_examples=12, deadline=None)
@given(
    leaf_specs(SUM_DTYPES),
    st.integers(1, 4),
    st.sampled_from([None, 0, 16]),
    st.integers(0, 2**31 - 1),
)
def test_sum_packed_equals_per_leaf_sum(spec, n, max_bytes, seed):
    """Any mix of dtypes and shapes: the packed sums equal jax's per-leaf psum bit for bit, and the
    collectives are one per dtype of the packed (non-empty, at most max_bytes) leaves plus one per other leaf."""
    rng = np.random.default_rng(seed)
    trees = [{"a": jnp.stack([_leaf(rng, SUM_DTYPES[d], tuple(shape)) for _ in range(n)])} for d, shape in spec]
    trees = jax.tree.map(lambda a: jnp.where(jnp.isnan(a), 0, a) if jnp.issubdtype(a.dtype, jnp.floating) else a, trees)
    comm = MeshAxis("i")
    packed, count = jax.vmap(lambda t: sum_packed(comm, t, max_bytes), axis_name="i", out_axes=(0, None))(trees)
    plain = jax.vmap(lambda t: comm.sum(t), axis_name="i")(trees)
    for a, b in zip(jax.tree.leaves(packed), jax.tree.leaves(plain)):
        assert a.dtype == b.dtype and a.shape == b.shape
        np.testing.assert_array_equal(np.asarray(a).view(np.uint8), np.asarray(b).view(np.uint8))
    leaves = [t["a"][0] for t in trees]
    small = [a for a in leaves if a.size and (max_bytes is None or a.size * a.dtype.itemsize <= max_bytes)]
    assert count == len({a.dtype for a in small}) + len(leaves) - len(small)


def test_sum_packed_inside_shard_map_one_all_reduce_per_dtype():
    n = 4
    mesh = Mesh(np.array(jax.devices()[:n]), ("data",))
    comm = MeshAxis("data")

    def worker(x):
        x = x[0]
        trees = [{"p": x[:3]}, {"q": x.reshape(2, 3), "h": x.astype(jnp.float16)}, {"s": jnp.sum(x)}]
        sums, _ = sum_packed(comm, trees)
        return jax.tree.map(lambda v: v[None], sums)

    f = jax.jit(jax.shard_map(worker, mesh=mesh, in_specs=P("data"), out_specs=P("data")))
    x = jax.device_put(jnp.arange(n * 6, dtype=jnp.float32).reshape(n, 6), NamedSharding(mesh, P("data")))
    hlo = f.lower(x).as_text()
    assert hlo.count('"stablehlo.all_reduce"') + hlo.count("stablehlo.all_reduce(") == 2, hlo  # f32 and f16
    out = f(x)
    xs = np.asarray(x)
    total = xs.sum(axis=0)
    for w in range(n):
        np.testing.assert_array_equal(np.asarray(out[0]["p"][w]), total[:3])
        np.testing.assert_array_equal(np.asarray(out[1]["q"][w]), total.reshape(2, 3))
        np.testing.assert_array_equal(np.asarray(out[2]["s"][w]), xs.sum())


# --------------------------------------------------------------------------- #
# all_gather_counted: count-prefixed fields send only their valid rows
# --------------------------------------------------------------------------- #
@payload_dataclass
class Rows(Payload):
    """A test payload: a fixed head, two buffers sharing one count, one buffer counted by a pair."""

    head: jax.Array
    values: jax.Array  # (cap, *row), rows >= count are zero
    tags: jax.Array  # (cap,), rows >= count are zero
    count: jax.Array  # int32 scalar
    other: jax.Array  # (cap2, *row2), rows >= pair.sum() are zero
    pair: jax.Array  # int32 (2,)
    shape: tuple = static_field()
    counted: ClassVar[tuple[tuple[str, str], ...]] = (("values", "count"), ("tags", "count"), ("other", "pair"))


def _rows_payload(rng, n, spec):
    """``n`` workers' Rows payloads stacked on a leading axis: (with random bits past each worker's
    counts, the same zeroed there)."""
    (hd, vd, vrow, cap, od, orow, cap2) = spec
    count = rng.integers(0, cap + 1, n)
    pair = np.stack([rng.integers(0, cap2 // 2 + 1, n), rng.integers(0, cap2 - cap2 // 2 + 1, n)], axis=1)
    values = np.stack([_leaf(rng, DTYPES[vd], (cap, *vrow)) for _ in range(n)])
    tags = np.stack([_leaf(rng, DTYPES[hd], (cap,)) for _ in range(n)])
    other = np.stack([_leaf(rng, DTYPES[od], (cap2, *orow)) for _ in range(n)])
    head = np.stack([_leaf(rng, DTYPES[hd], (3,)) for _ in range(n)])
    arr = lambda a: jnp.asarray(a)
    counts = (arr(count.astype(np.int32)), arr(pair.astype(np.int32)))
    garbage = Rows(arr(head), arr(values), arr(tags), counts[0], arr(other), counts[1], (cap,))
    values, tags, other = values.copy(), tags.copy(), other.copy()
    for w in range(n):
        values[w, count[w] :] = 0
        tags[w, count[w] :] = 0
        other[w, pair[w].sum() :] = 0
    return garbage, Rows(arr(head), arr(values), arr(tags), counts[0], arr(other), counts[1], (cap,))


def _same_bits(a, b):
    assert a.dtype == b.dtype and a.shape == b.shape, (a.dtype, b.dtype, a.shape, b.shape)
    view = lambda x: np.asarray(x) if x.dtype == jnp.bool_ else np.asarray(x).view(np.uint8)
    np.testing.assert_array_equal(view(a), view(b))


_ROW_SPEC = st.tuples(
    st.sampled_from(range(len(DTYPES))),  # head and tags dtype
    st.sampled_from(range(len(DTYPES))),  # values dtype
    st.lists(st.integers(1, 3), max_size=2),  # values' row shape
    st.integers(0, 40),  # values' capacity
    st.sampled_from(range(len(DTYPES))),  # other dtype
    st.lists(st.integers(1, 3), max_size=1),
    st.integers(0, 30),
)


# 8 examples (each compiles one program for its own shapes: about 1.5 s apiece), to pay for other tests.
@settings(max_examples=8, deadline=None)
@given(st.lists(_ROW_SPEC, min_size=1, max_size=3), st.booleans(), st.integers(1, 4), st.integers(0, 2**31 - 1))
def test_counted_gather_equals_all_gather(specs, with_plain, n, seed):
    """Rows payloads with random dtypes, capacities and per-worker counts (and a plain array item):
    the variable-length gather equals comm.all_gather bit for bit (of the payloads with their unused
    rows zeroed: the random bits a sender leaves there never arrive), sends 4 m + B bytes per worker
    with B the smallest bucket >= the longest worker's valid bytes, and splits them per item."""
    rng = np.random.default_rng(seed)
    pairs = [_rows_payload(rng, n, (d1, d2, tuple(r1), c1, d3, tuple(r2), c2)) for d1, d2, r1, c1, d3, r2, c2 in specs]
    sent_items, items = [p for p, _ in pairs], [z for _, z in pairs]
    if with_plain:
        extra = jnp.asarray(rng.standard_normal((n, 2, 3)), jnp.float32)
        sent_items, items = sent_items + [extra], items + [extra]
    comm, minimum = MeshAxis("i"), 16  # a small first bucket: many branches on small buffers
    # one jitted program per example (eager vmap would compile each primitive and switch branch apart)
    res, plain = jax.jit(
        lambda s, z: (
            jax.vmap(lambda t: all_gather_counted(comm, t, minimum=minimum), axis_name="i")(s),
            jax.vmap(comm.all_gather, axis_name="i")(z),
        )
    )(sent_items, items)
    for a, b in zip(jax.tree.leaves(res.items), jax.tree.leaves(plain)):
        _same_bits(a, b)
    # the bytes: NumPy from the counts
    bucket, expect = expected_sent([[jax.tree.map(lambda a, w=w: a[w], p) for p in items] for w in range(n)], minimum)
    np.testing.assert_array_equal(np.asarray(res.bucket_bytes), [bucket] * n)
    sent = np.stack([np.asarray(s) for s in res.sent_bytes], axis=1)  # (n, items)
    assert sent.tolist() == expect
    entries = 3 * sum(isinstance(p, Rows) for p in items)  # count and pair: 3 int32 per Rows payload
    assert (sent.sum(axis=1) == 4 * entries + bucket).all()
    assert np.asarray(res.messages).tolist() == [2] * n  # a Python int, broadcast by vmap


def test_bucket_sizes():
    for capacity in (0, 1, 1024, 1025, 5000, 1 << 25):
        sizes = bucket_sizes(capacity)
        assert sizes[-1] == capacity and list(sizes) == sorted(set(sizes))
        if capacity > 1024:
            assert sizes[0] == 1024 and all(b <= math.ceil(a * 2**0.25) for a, b in itertools.pairwise(sizes))
            # the smallest size >= L is below 2**(1/4) L + 1 for every L above the minimum
            for L in np.unique(np.linspace(1025, capacity, 200).astype(int)):
                assert min(b for b in sizes if b >= L) < 2**0.25 * L + 1
        else:
            assert sizes == (capacity,)
    assert len(bucket_sizes(32 << 20)) == 61
    with pytest.raises(ValueError):
        bucket_sizes(10, growth=1.0)


def test_counted_gather_inside_shard_map_one_switch_and_equal():
    """Inside jax.shard_map (check_vma=True) and jit: one count all-gather, one switch over the
    buckets whose branches each all-gather one bucket, and the result equals comm.all_gather."""
    n = 4
    mesh = Mesh(np.array(jax.devices()[:n]), ("data",))
    comm = MeshAxis("data")
    x = jax.random.normal(jax.random.key(0), (n, 3000)) * jnp.arange(1.0, n + 1)[:, None]
    c = jc.compressors.threshold(v=1.5)

    def worker(x):
        p, _ = c.compress(x[0])
        res = all_gather_counted(comm, [p])
        return jax.tree.map(lambda v: v[None], (res.items[0], comm.all_gather(p), res.sent_bytes[0], res.bucket_bytes))

    f = jax.jit(jax.shard_map(worker, mesh=mesh, in_specs=P("data"), out_specs=P("data")))
    x = jax.device_put(x, NamedSharding(mesh, P("data")))
    text = f.lower(x).compile().as_text()
    assert text.count(" conditional(") == 1
    counted, plain, sent, bucket = f(x)
    for a, b in zip(jax.tree.leaves(counted), jax.tree.leaves(plain)):
        _same_bits(a[0], b[0])
    counts = (np.abs(np.asarray(x)) >= 1.5).sum(axis=1)  # float32 values, uint16 indices: 6 bytes a row
    bucket0 = min(b for b in bucket_sizes(3000 * 6) if b >= 6 * counts.max())
    np.testing.assert_array_equal(np.asarray(bucket), [bucket0] * n)
    np.testing.assert_array_equal(np.asarray(sent), [bucket0 + 4] * n)  # the padding and the count
