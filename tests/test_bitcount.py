"""BitCount: exact wire-bit counts past 2**31 (two uint32 words), and the pipeline's counters on tensors
whose payload is past int32.

The arithmetic is checked against Python's integers (hypothesis draws counts, weights and sums across
the whole ``[0, 2**64 - 1)`` range, the carries and the overflows included), traced and untraced,
under ``vmap`` and inside ``shard_map(check_vma=True)``. The pipeline tests put more than ``2**31``
bits of one tensor on the wire, through a static count (a dense ``none()`` payload), a dynamic one
(``threshold(v=0)``: a count of kept entries times 64 bits) and the variable-length all-gather
(bytes sent times 8).
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from hypothesis import example, given, settings
from hypothesis import strategies as st
from jax.sharding import Mesh, NamedSharding
from jax.sharding import PartitionSpec as P

import jaxcomm as jc
from jaxcomm._bitcount import BitCount
from jaxcomm.transforms import compressed_mean

pytestmark = pytest.mark.strict_promotion

U32 = st.integers(0, 2**32 - 1)
I31 = st.integers(0, 2**31 - 1)
U64 = st.integers(0, 2**64 - 2)  # every exact count (2**64 - 1 marks a saturated one)
SAT = BitCount.SATURATED


@given(count=U32, weight=U32)
def test_product_is_exact(count, weight):
    expected = count * weight
    assert int(BitCount.product(jnp.uint32(count), weight)) == expected
    assert int(jax.jit(lambda c: BitCount.product(c, weight))(jnp.uint32(count))) == expected


_add = jax.jit(lambda x, y: x + y)


@given(a=U64, b=U64)
def test_add_is_exact_or_refused_or_saturated(a, b):
    """Exact below 2**64 - 1; at or past it an OverflowError on the host and the saturated count traced."""
    traced = _add(BitCount.of(a), BitCount.of(b))
    if a + b < SAT:
        assert int(BitCount.of(a) + BitCount.of(b)) == int(traced) == a + b
        assert int(BitCount.of(a) + b) == int(b + BitCount.of(a)) == a + b
        assert not bool(traced.is_saturated())
    else:
        with pytest.raises(OverflowError, match=r"2\*\*64 - 1"):
            BitCount.of(a) + b
        assert bool(traced.is_saturated())


@settings(max_examples=10)
@example(a=2**32, b=1)  # a borrow from the high word
@given(a=U64, b=U64)
def test_subtract_borrows_exactly(a, b):
    big, small = max(a, b), min(a, b)
    assert int(BitCount.of(big) - BitCount.of(small)) == int(BitCount.of(big) - small) == big - small
    assert int(jax.jit(lambda x, y: x - y)(BitCount.of(big), BitCount.of(small))) == big - small


@given(a=U64, b=U64)
def test_comparisons_are_exact(a, b):
    x, y = BitCount.of(a), BitCount.of(b)
    assert [bool(v) for v in (x == y, x != y, x < y, x <= y, x > y, x >= y)] == [
        a == b,
        a != b,
        a < b,
        a <= b,
        a > b,
        a >= b,
    ]
    assert bool((BitCount.stack([a, a]) == a).all())


_sum = jax.jit(lambda c: c.sum())


@given(values=st.lists(st.integers(0, 2**62), min_size=0, max_size=40))
def test_sum_is_exact_or_refused_or_saturated(values):
    """Exact below 2**64 - 1 (about half the draws pass it); past it as for ``+``. The traced sum
    runs on the values padded with zeros to 40 (one compiled shape)."""
    counts = BitCount.of(np.asarray(values, np.uint64).reshape(-1))
    assert np.asarray(counts).tolist() == values
    traced = _sum(BitCount.of(np.asarray(values + [0] * (40 - len(values)), np.uint64)))
    if sum(values) < SAT:
        assert int(counts.sum()) == int(traced) == sum(values)
    else:
        with pytest.raises(OverflowError, match=r"2\*\*64"):
            counts.sum()
        assert bool(traced.is_saturated())


def test_long_sums_go_by_chunks():
    # Past 2**16 terms a uint32 sum of 16-bit halves could wrap: the sum goes by chunks of 2**15.
    rng = np.random.default_rng(0)
    values = rng.integers(2**40, 2**41, size=2 * 2**16 + 17, dtype=np.int64)
    assert int(BitCount.of(values).sum()) == int(values.astype(object).sum())
    rows = values[: 2 * 2**16].reshape(2, -1)
    matrix = BitCount.of(rows)
    assert np.asarray(matrix.sum(axis=1)).tolist() == [int(r.astype(object).sum()) for r in rows]
    assert np.asarray(matrix.sum(axis=0)).tolist() == (rows[0] + rows[1]).tolist()


def test_of_arrays_and_host_reads():
    assert int(BitCount.of(jnp.int32(7))) == 7
    assert np.asarray(BitCount.of(np.array([2**40, 3], np.int64))).tolist() == [2**40, 3]
    stacked = BitCount.stack([1, BitCount.of(2**35), jnp.int32(4)])
    assert stacked.shape == (3,) and len(stacked) == 3 and np.asarray(stacked).dtype == np.int64
    assert np.asarray(stacked).tolist() == [1, 2**35, 4] and int(stacked[1]) == 2**35
    joined = BitCount.concatenate([stacked, BitCount.zeros((2,))])
    assert np.asarray(joined.reshape(5, 1)).tolist() == [[1], [2**35], [4], [0], [0]]
    assert float(BitCount.of(2**40)) == 2.0**40
    assert repr(BitCount.of(5)) == "BitCount(5)"
    with jax.enable_x64(True):
        assert int(BitCount.of(jnp.asarray(2**45 + 9, jnp.int64))) == 2**45 + 9
    assert np.asarray(BitCount.of(2**33), np.float64) == 2.0**33


def test_refusals():
    with pytest.raises(ValueError, match=r"\[0, 2\*\*64 - 1\)"):
        BitCount.of(-1)
    with pytest.raises(ValueError, match=r"\[0, 2\*\*64 - 1\)"):
        BitCount.of(2**64)
    with pytest.raises(TypeError, match="integer dtype"):
        BitCount.of(jnp.float32(1.0))
    with pytest.raises(TypeError, match="integer"):
        BitCount.of(True)
    with pytest.raises(ValueError, match="non-negative"):
        BitCount.of(np.array([-1, 2**40]))
    with pytest.raises(TypeError, match="weight must be a Python int"):
        BitCount.product(jnp.uint32(1), 2.0)
    with pytest.raises(ValueError, match="weight"):
        BitCount.product(jnp.uint32(1), 2**32)
    with pytest.raises(TypeError, match="would wrap"):  # a jax integer array would wrap: refused
        jnp.asarray(BitCount.of(2**40))
    with pytest.raises(TypeError, match="single count"):
        int(BitCount.zeros((2,)))
    with pytest.raises(OverflowError, match="int32"):
        np.asarray(BitCount.of(2**40), np.int32)
    with pytest.raises(OverflowError, match="int64"):
        np.asarray(BitCount.of(2**63))
    assert int(BitCount.of(2**63)) == 2**63  # int() reads every count


def test_negative_and_overflowing_host_values_are_refused():
    """Concrete values that are not counts raise, naming the problem, instead of wrapping."""
    with pytest.raises(ValueError, match="non-negative, got -1"):
        BitCount.of([-1])
    with pytest.raises(ValueError, match=r"got -1 \(int8"):
        BitCount.of(jnp.int8(-1))
    with pytest.raises(ValueError, match=r"count must lie in \[0, 2\*\*32\), got -1"):
        BitCount.product(jnp.int32(-1), 64)
    with pytest.raises(ValueError, match=r"count must lie in \[0, 2\*\*32\)"):
        BitCount.product(-1, 64)
    with jax.enable_x64(True):
        with pytest.raises(ValueError, match=r"got -1 \(int64"):
            BitCount.of(jnp.int64(-1))
        with pytest.raises(ValueError, match=r"got 4294967296"):
            BitCount.product(jnp.int64(2**32), 1)  # would have been cut to its low word
    with pytest.raises(ValueError, match="saturated"):
        BitCount.of(2**64 - 1)
    with pytest.raises(ValueError, match="beyond 64 bits"):
        BitCount.of([2**64])
    with pytest.raises(OverflowError, match=r"2\*\*64 - 1"):
        BitCount.of(2**64 - 2) + 1
    with pytest.raises(OverflowError, match=r"2\*\*64 - 1"):
        BitCount.of(2**63) + BitCount.of(2**63)
    # 2**16 terms of 2**48: the high words sum to 2**32 (a uint32 sum of them would be 0)
    with pytest.raises(OverflowError, match=r"2\*\*64"):
        BitCount.of(np.full(2**16, 2**48, np.int64)).sum()
    assert int(BitCount.of(np.full(2**16 - 1, 2**48, np.int64)).sum()) == (2**16 - 1) * 2**48


def test_traced_negatives_and_overflows_saturate_and_stay_saturated():
    sat = _add(BitCount.of(2**64 - 2), BitCount.of(1))
    assert bool(sat.is_saturated()) and repr(sat) == "BitCount(saturated)"
    assert bool(_add(sat, BitCount.of(0)).is_saturated()) and bool(_add(BitCount.of(5), sat).is_saturated())
    assert bool(sat > BitCount.of(2**64 - 2))  # compares as the largest count
    with pytest.raises(OverflowError, match="saturated"):
        int(sat)
    with pytest.raises(OverflowError, match="saturated"):
        np.asarray(BitCount.stack([sat, BitCount.of(1)]))
    prod = jax.jit(lambda c: BitCount.product(c, 64))(jnp.asarray([-1, 3], jnp.int32))
    assert prod.is_saturated().tolist() == [True, False] and int(prod[1]) == 192
    assert repr(prod) == "BitCount(['saturated', 192])"
    assert jax.jit(BitCount.of)(jnp.asarray([-1, 7], jnp.int8)).is_saturated().tolist() == [True, False]
    total = jax.jit(lambda c: c.sum())(BitCount.of(np.full(2**16, 2**48, np.int64)))
    assert bool(total.is_saturated())
    per = jax.vmap(lambda c: BitCount.product(c, 2) + BitCount.of(2**64 - 4))(jnp.asarray([0, 1, 2], jnp.int32))
    assert per.is_saturated().tolist() == [False, False, True] and int(per[1]) == 2**64 - 2


def test_bool_equality_and_len_follow_python_protocols():
    assert bool(BitCount.of(7)) and bool(BitCount.of(2**40)) and not bool(BitCount.of(0))
    with pytest.raises(ValueError, match="ambiguous"):
        bool(BitCount.zeros((2,)))
    with pytest.raises(TypeError, match="integer count, got NoneType"):
        BitCount.of(None)
    with pytest.raises(TypeError, match="count must be an integer array"):
        BitCount.product(None, 8)
    assert (BitCount.of(5) == None) is False and (BitCount.of(5) != None) is True  # noqa: E711
    assert (BitCount.of(5) == "5") is False and (BitCount.of(5) == 5.0) is False
    assert BitCount.of(5) in [None, "5", BitCount.of(5)]  # membership compares with ==: no error on the others
    with pytest.raises(TypeError):
        BitCount.of(5) < None  # noqa: B015
    with pytest.raises(TypeError):
        BitCount.of(5) + None
    with pytest.raises(TypeError, match="len"):
        len(BitCount.of(5))


def test_vmap_and_shard_map_with_check_vma():
    counts = jnp.arange(8, dtype=jnp.int32) * 2**27 + 5
    per = jax.vmap(lambda c: BitCount.product(c, 96) + 2**31)(counts)
    assert np.asarray(per).tolist() == [int(c) * 96 + 2**31 for c in np.asarray(counts)]
    mesh = Mesh(np.array(jax.devices()[:8]), ("data",))

    def worker(c):
        mine = BitCount.product(c[0], 96) + 2**31  # device-varying
        every = jax.tree.map(lambda w: jax.lax.all_gather(w, "data"), mine)  # (8,) words: summed exactly below
        return jax.tree.map(lambda v: v[None], (mine, every.sum()))

    step = jax.jit(jax.shard_map(worker, mesh=mesh, in_specs=P("data"), out_specs=P("data")))
    mine, total = step(jax.device_put(counts, NamedSharding(mesh, P("data"))))
    expected = [int(c) * 96 + 2**31 for c in np.asarray(counts)]
    assert np.asarray(mine).tolist() == expected
    assert np.asarray(total).tolist() == [sum(expected)] * 8 and sum(expected) > 2**32


# --------------------------------------------------------------------------- #
# the pipeline, one tensor past 2**31 bits
# --------------------------------------------------------------------------- #
DENSE = 2**26 + 1  # float32: 32 (2**26 + 1) = 2**31 + 32 bits
SPARSE = 2**25 + 3  # threshold(v=0) keeps every entry: 64 d + 32 bits > 2**31


def test_dense_tensor_past_int32_bits_one_worker():
    tx = jc.error_feedback(jc.compressors.none())
    g = jnp.ones((DENSE,), jnp.float32)
    state = tx.init(g)
    out, state = jax.jit(tx.update)(g, state)
    assert int(state.wire_bits.sum()) == 32 * DENSE > 2**31
    assert np.asarray(state.wire_bits).tolist() == [32 * DENSE]
    assert bool(jnp.all(out == 1.0))


def test_sparse_count_past_int32_bits_one_worker():
    # A dynamic count: 64 bits per kept (value, index) pair and the 32-bit count.
    tx = jc.error_feedback(jc.compressors.threshold(v=0.0))
    g = jnp.linspace(1.0, 2.0, SPARSE, dtype=jnp.float32)
    state = tx.init(g)
    _, state = jax.jit(tx.update)(g, state)
    assert int(state.wire_bits[0]) == 64 * SPARSE + 32 > 2**31


@pytest.mark.parametrize(("compressor", "expected"), [("none", 32 * DENSE), ("threshold", 64 * SPARSE + 32)])
def test_two_workers_past_int32_bits(compressor, expected):
    """Over a 2-device mesh: the dense all-reduce's summed field, and the variable-length all-gather
    of every entry (``8 · (capacity bytes + the 4-byte count)``), both past ``2**31`` bits."""
    n = 2
    mesh = Mesh(np.array(jax.devices()[:n]), ("data",))
    c = jc.compressors.none() if compressor == "none" else jc.compressors.threshold(v=0.0)
    d = DENSE if compressor == "none" else SPARSE
    tx = compressed_mean(c, "data")

    def worker(g, state):
        g, state = jax.tree.map(lambda v: v[0], (g, state))
        _, state = tx.update(g, state)
        return jax.tree.map(lambda v: v[None], state.wire_bits)

    g = jnp.broadcast_to(jnp.linspace(1.0, 2.0, d, dtype=jnp.float32), (n, d))
    state = jax.tree.map(lambda v: jnp.broadcast_to(v, (n, *jnp.shape(v))), tx.init(g[0]))
    sharded = jax.device_put((g, state), NamedSharding(mesh, P("data")))
    bits = jax.jit(jax.shard_map(worker, mesh=mesh, in_specs=P("data"), out_specs=P("data")))(*sharded)
    assert np.asarray(bits).tolist() == [[expected]] * n
    assert expected > 2**31


def test_counted_payload_past_int32_offsets_is_gathered_whole(monkeypatch):
    """A count-prefixed payload whose buffer is beyond the variable-length gather's int32 offsets
    (here the limit is lowered to 1 KiB) is all-gathered whole and counted whole: the same mean."""
    import jaxcomm.comm._packing as packing

    n, d = 2, 1000
    mesh = Mesh(np.array(jax.devices()[:n]), ("data",))
    tx = compressed_mean(jc.compressors.threshold(v=1.0), "data")
    rng = np.random.default_rng(0)
    g = jnp.asarray(rng.standard_normal((n, d)), jnp.float32)  # about 32 % of entries kept per worker

    def run():
        def worker(g, state):
            g, state = jax.tree.map(lambda v: v[0], (g, state))
            mean, state = tx.update(g, state)
            return jax.tree.map(lambda v: v[None], (mean, state.wire_bits, state.messages))

        state = jax.tree.map(lambda v: jnp.broadcast_to(v, (n, *jnp.shape(v))), tx.init(g[0]))
        sharded = jax.device_put((g, state), NamedSharding(mesh, P("data")))
        return jax.jit(jax.shard_map(worker, mesh=mesh, in_specs=P("data"), out_specs=P("data")))(*sharded)

    mean, bits, messages = run()
    kept = int((np.abs(np.asarray(g)) > 1.0).sum(axis=1).max())
    assert np.asarray(bits)[0, 0] < 64 * d  # only the valid rows crossed
    monkeypatch.setattr(packing, "_MAX_BUFFER_BYTES", 1024)
    whole_mean, whole_bits, whole_messages = run()
    np.testing.assert_array_equal(np.asarray(whole_mean), np.asarray(mean))
    whole = (32 + 8 * np.dtype(jc.compressors.index_dtype(d)).itemsize) * d + 32  # values, indices (capacity d), count
    assert np.asarray(whole_bits).tolist() == [[whole]] * n
    # the count gather and the data gather, then one packed gather (this payload is small enough to fuse)
    assert np.asarray(messages).tolist() == [2] * n and np.asarray(whole_messages).tolist() == [1] * n and kept < d
