"""Sparsifiers and hybrids against NumPy references and closed-form facts.

References: top-k = a stable argsort of the magnitudes (ties to the lowest
index, NaN above +Inf) and ``np.argpartition``; Threshold-v = a NumPy mask;
DGC = a NumPy transcription of the authors' selection loop fed the same sample
positions; adaptive = per-sign stable argsorts and means. Statistical tests use
fixed seeds and tolerances derived from the variance (stated where used).
"""

import math

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

import jaxcomm as jc
from jaxcomm.compressors import _random_sparsification as RS
from jaxcomm.compressors import _randomk as RK
from jaxcomm.compressors import _sparse as SP
from jaxcomm.compressors import _threshold as TH
from jaxcomm.compressors._kernels import compact as C
from jaxcomm.compressors._kernels import random_bits
from jaxcomm.compressors._kernels import select as S
from jaxcomm.compressors._kernels.bitpack import pack_bits

KEY = jax.random.PRNGKey(0)


# --------------------------------------------------------------------------- #
# NumPy references
# --------------------------------------------------------------------------- #
def np_keys(x):
    """The order keys of |x| (float32 bit pattern, sign cleared): NaN above +Inf."""
    return (np.asarray(x, np.float32).ravel().view(np.int32) & 0x7FFFFFFF).astype(np.int64)


def np_topk(x, k):
    """Positions of the k largest |x|, ties to the lowest index (a stable argsort)."""
    return np.argsort(-np_keys(x), kind="stable")[:k]


def roundtrip_fn(c):
    return jax.jit(lambda x, key: c.decompress(c.compress(x, key)[0]))


def mc_mean_var(c, x, n, seed):
    """Sample mean and variance of Q(x) over n keys; lax.map compiles one round trip (vmap would batch the
    selection's lax.conds into selects, a bigger program)."""
    keys = jax.random.split(jax.random.PRNGKey(seed), n)
    ys = np.asarray(jax.jit(lambda ks: jax.lax.map(lambda k: c.decompress(c.compress(x, k)[0]), ks))(keys), np.float64)
    return ys.mean(0), ys.var(0, ddof=1)


def compress_fn(c):
    return jax.jit(lambda x, key: c.compress(x, key)[0])


# --------------------------------------------------------------------------- #
# Compaction and exact selection (private helpers every sparsifier uses)
# --------------------------------------------------------------------------- #
@pytest.mark.parametrize(
    "n,cap,density",
    [
        (1, 1, 1.0),
        (33, 40, 0.5),
        (1000, 10, 0.3),
        (100_000, 5_000, 0.03),
        (100_000, 90_000, 0.01),
        (100_000, 90_000, 0.5),
    ],
)
@pytest.mark.parametrize("body", ["platform", "accelerator"])
def test_compact_matches_nonzero(n, cap, density, body):
    """compact (its CPU body here) and its accelerator body (what cuda/rocm/tpu lower) against NumPy."""
    mask = np.random.RandomState(n).rand(n) < density
    fn = C.compact if body == "platform" else C.compact_by_primitive
    pos, total = jax.jit(fn, static_argnums=1)(jnp.asarray(mask), cap)
    expected = np.flatnonzero(mask)[:cap]
    pos = np.asarray(pos)
    assert int(total) == mask.sum()
    np.testing.assert_array_equal(pos[: len(expected)], expected)
    assert (pos[len(expected) :] == 0).all()


# One compiled selection per margin, with a traced k <= kmax = 80 (d = 8192 with primitive_max=0 takes the
# sampled path; by default the CPU selects this size by top_by_float_view).
_D, _KMAX = 8192, 80
_select = jax.jit(
    lambda x, kt, margin=5.0: S.top_indices(
        x, _KMAX, KEY, k=kt, margin=margin, keys_of=S.magnitude_keys, primitive_max=0
    ),
    static_argnames=("margin",),
)
_select_float_view = jax.jit(lambda x, kt: S.top_indices(x, _KMAX, KEY, k=kt, keys_of=S.magnitude_keys))


def test_top_indices_every_path_is_exact():
    rs = np.random.RandomState(1)
    normal = rs.randn(_D).astype(np.float32)
    sparse = np.zeros(_D, np.float32)  # 50 non-zeros: the k-th largest is a tie at 0
    sparse[rs.choice(_D, 50, replace=False)] = rs.randn(50)
    cases = [
        (normal, {}, S.PATH_SAMPLED),
        (sparse, {}, S.PATH_TIES),
        (normal, {"margin": -40.0}, S.PATH_FULL),
    ]  # a margin far below 0: the bracket misses, exact fallback
    # The accelerator's large-d body on the same inputs: top-k among the sampled candidates, else (ties at
    # the threshold overflow its capacity; the bracket misses) lax.top_k over all keys.
    accelerator_path = (S.PATH_SAMPLED, S.PATH_PRIMITIVE, S.PATH_PRIMITIVE)
    for (x, kw, path), acc_path in zip(cases, accelerator_path, strict=True):
        idx, took = _select(jnp.asarray(x), _KMAX, **kw)
        assert int(took) == path
        # every path: the exact set, in increasing index order (so the payload does not depend on the path)
        np.testing.assert_array_equal(np.asarray(idx), np.sort(np_topk(x, _KMAX)))
        idx, took = _select_threshold(jnp.asarray(x), _KMAX, KEY, **kw)
        assert int(took) == acc_path
        np.testing.assert_array_equal(np.asarray(idx), np.sort(np_topk(x, _KMAX)))


_select_accelerator = jax.jit(lambda x, kt: S.top_by_primitive(S.magnitude_keys(x), kt, _KMAX))
# The accelerator body from ACCELERATOR_SAMPLED_MIN keys up, called directly (at d = 8192 it samples).
_select_threshold = jax.jit(
    lambda x, kt, key, margin=5.0: S.top_by_threshold(x, _KMAX, key, k=kt, keys_of=S.magnitude_keys, margin=margin),
    static_argnames=("margin",),
)


@settings(max_examples=10)
@given(
    seed=st.integers(0, 2**16),
    levels=st.sampled_from([0, 1, 4, 64]),  # 0: continuous; else |x| takes few values (ties at the k-th)
    nans=st.integers(0, 3),
    kt=st.integers(0, _KMAX),
)
def test_accelerator_top_k_equals_the_cpu_path(seed, levels, nans, kt):
    """The bodies lowered for cuda/rocm/tpu (lax.top_k; from ACCELERATOR_SAMPLED_MIN keys up the sampled
    threshold with lax.top_k among the candidates), run on the CPU: the CPU path's indices in its order
    (the exact set, ties to the lowest index, increasing order), NaN counted above +Inf."""
    rs = np.random.RandomState(seed)
    x = rs.randn(_D).astype(np.float32)
    if levels:
        x = (np.round(x * levels / 3) / levels).astype(np.float32)
    x[rs.choice(_D, nans, replace=False)] = np.nan
    got = np.asarray(_select_accelerator(jnp.asarray(x), kt))
    np.testing.assert_array_equal(got, np.asarray(_select(jnp.asarray(x), kt)[0]))
    idx, path = _select_float_view(jnp.asarray(x), kt)  # the CPU's default at this size
    assert int(path) == S.PATH_PRIMITIVE
    np.testing.assert_array_equal(np.asarray(idx), got)
    np.testing.assert_array_equal(got[:kt], np.sort(np_topk(x, kt)))
    assert (got[kt:] == 0).all()
    np.testing.assert_array_equal(np.asarray(_select_threshold(jnp.asarray(x), kt, jax.random.PRNGKey(seed))[0]), got)


def test_unpacked_words_are_the_packed_mask():
    """compact_words' accelerator body unpacks the words: bit b of word w is entry 32 w + b."""
    mask = np.random.RandomState(3).rand(100) < 0.4  # 4 words, the last one padded with zeros
    words = pack_bits(jnp.asarray(mask), 1, jnp.uint32)
    np.testing.assert_array_equal(np.asarray(C._unpack_words(words)), np.pad(mask, (0, 28)))


@settings(max_examples=12, deadline=None)
@given(
    seed=st.integers(0, 2**16),
    kind=st.sampled_from(["normal", "ties", "subnormal", "nonfinite", "zeros", "int32"]),
    d=st.integers(S.SMALL + 1, 6000),
    k=st.integers(1, 120),
)
def test_top_by_float_view_is_the_exact_integer_order(seed, kind, d, k):
    """int32 keys bitcast to float32 and selected by lax.top_k (the CPU's body up to CPU_PRIMITIVE_MAX keys)
    give NumPy's stable top-k of the integers: magnitude keys of ties, subnormals, NaN, +-Inf and signed zeros,
    and arbitrary int32 keys (negative ones, NaN bit patterns) with k <= #(keys >= 0). Under jit, vmap and
    shard_map with check_vma."""
    rs = np.random.RandomState(seed)
    x = rs.randn(d).astype(np.float32)
    if kind == "ties":
        x = rs.randint(-3, 4, d).astype(np.float32)
    elif kind == "subnormal":
        x = np.where(rs.rand(d) < 0.5, 0.0, rs.randn(d) * 1e-42).astype(np.float32)
    elif kind == "nonfinite":
        x[rs.randint(0, d, 6)] = [np.nan, np.nan, np.inf, -np.inf, -np.nan, np.inf]
    elif kind == "zeros":
        x = np.zeros(d, np.float32)
        x[rs.randint(0, d, 4)] = -0.0
    keys = np.asarray(S.magnitude_keys(jnp.asarray(x)))
    if kind == "int32":
        keys = rs.randint(-(2**31), 2**31, d, dtype=np.int64).astype(np.int32)
        keys[rs.randint(0, d, 40)] = keys[0]  # ties
        k = min(k, int((keys >= 0).sum()))
    want = np.sort(np.argsort(-keys.astype(np.int64), kind="stable")[:k])
    one = jax.jit(lambda v: S.top_by_float_view(v, jnp.int32(k), k))
    np.testing.assert_array_equal(np.asarray(one(jnp.asarray(keys))), want)
    batched = jax.jit(jax.vmap(lambda v: S.top_by_float_view(v, jnp.int32(k), k)))
    np.testing.assert_array_equal(np.asarray(batched(jnp.asarray(np.stack([keys, keys])))), np.stack([want, want]))
    mesh = jax.make_mesh((2,), ("w",))
    sharded = jax.jit(
        jax.shard_map(
            lambda v: S.top_by_float_view(v[0], jnp.int32(k), k)[None],
            mesh=mesh,
            in_specs=jax.P("w"),
            out_specs=jax.P("w"),
            check_vma=True,
        )
    )
    both = jax.device_put(np.stack([keys, keys]), jax.NamedSharding(mesh, jax.P("w")))
    np.testing.assert_array_equal(np.asarray(sharded(both)), np.stack([want, want]))


def test_the_cpu_body_follows_the_size_and_the_count():
    """On CPU: a stable sort up to SMALL keys, the float view up to CPU_PRIMITIVE_MAX keys with at most
    CPU_PRIMITIVE_K_MAX selected, the sampled threshold beyond either bound; the same exact set each time."""
    rs = np.random.RandomState(7)
    cases = [
        (S.SMALL, 10, S.PATH_FULL),
        (S.SMALL + 1, S.CPU_PRIMITIVE_K_MAX, S.PATH_PRIMITIVE),
        (16_384, S.CPU_PRIMITIVE_K_MAX + 1, S.PATH_SAMPLED),
        (S.CPU_PRIMITIVE_MAX + 1, 10, S.PATH_SAMPLED),
    ]
    for d, k, path in cases:
        x = rs.randn(d).astype(np.float32)
        idx, took = jax.jit(lambda v, k=k: S.top_indices(v, k, KEY, keys_of=S.magnitude_keys))(jnp.asarray(x))
        assert int(took) == path, (d, k)
        np.testing.assert_array_equal(np.sort(np.asarray(idx)), np.sort(np_topk(x, k)))


# One compressor per way into the platform-dependent kernels: top_indices (topk; qsparse calls it the
# same way, adaptive with a traced k as tested above), top_indices_reusing, DGC's compact_words, random-k's
# hashed counters, compact (threshold; random_sparsification calls it the same way).
SELECTING = {
    "topk": dict(ratio=0.05),
    "topk(reuse)": dict(ratio=0.05, reuse_threshold=True),
    "dgc": dict(ratio=0.05),
    "randomk": dict(ratio=0.05),
    "threshold": dict(v=0.5),
}


@pytest.mark.parametrize("case", sorted(SELECTING))
def test_accelerator_bodies_send_the_cpu_payload(case, monkeypatch):
    """Every compressor that selects, with every selection kernel forced to its accelerator body (what
    cuda/rocm/tpu lower), sends on the CPU exactly the payload of the CPU bodies: same indices, same order,
    same values and counts. Ties and zeros included (values on a coarse grid)."""
    name = case.split("(")[0]
    c = jc.compressors.make(name, **SELECTING[case])
    d = 3 * S.SMALL + 5  # above SMALL: the platform-dependent paths; not a whole number of 32-bit words
    x = jnp.asarray(np.round(np.random.RandomState(5).randn(d) * 4).astype(np.float32) / 4)
    state = c.init_state(x) if c.init_state is not None else None
    by_float_view = jax.jit(lambda x, k: c.compress(x, k, state)[0])(x, KEY)  # the CPU's default at this size
    monkeypatch.setattr(S, "CPU_PRIMITIVE_MAX", 0)  # the CPU's sampled bodies (what larger tensors take)
    want = jax.jit(lambda x, k: c.compress(x, k, state)[0])(x, KEY)
    for a, b in zip(jax.tree.leaves(by_float_view), jax.tree.leaves(want), strict=True):
        np.testing.assert_array_equal(np.asarray(a), np.asarray(b), err_msg=case)
    chose = []

    def accelerator_only(*, cpu, accelerator, like=()):
        chose.append(1)
        return accelerator()

    for kernels in (S, C):  # selection and compaction
        monkeypatch.setattr(kernels, "typed_platform_dependent", accelerator_only)
    monkeypatch.setattr(S, "ACCELERATOR_SAMPLED_MIN", d)  # the large-d selection body (top_by_threshold)
    got = jax.jit(lambda x, k: c.compress(x, k, state)[0])(x, KEY)
    assert chose, f"{case} never reached a platform-dependent kernel"
    for a, b in zip(jax.tree.leaves(got), jax.tree.leaves(want), strict=True):
        np.testing.assert_array_equal(np.asarray(a), np.asarray(b), err_msg=case)


def test_top_indices_traced_k():
    x = np.random.RandomState(2).randn(_D).astype(np.float32)
    for kt in (0, 1, 37):
        idx = np.asarray(_select(jnp.asarray(x), kt)[0])
        assert set(idx[:kt].tolist()) == set(np_topk(x, kt).tolist())
        assert (idx[kt:] == 0).all()


# --------------------------------------------------------------------------- #
# top-k
# --------------------------------------------------------------------------- #
_TOPK_RT = {r: roundtrip_fn(jc.compressors.topk(ratio=r)) for r in (0.01, 0.1, 0.5, 1.0)}


@settings(max_examples=8)
@given(
    d=st.sampled_from([1, 5, 64, 700, 3000]), ratio=st.sampled_from([0.01, 0.1, 0.5, 1.0]), seed=st.integers(0, 2**16)
)
def test_topk_matches_numpy(d, ratio, seed):
    x = np.random.RandomState(seed).randn(d).astype(np.float32)
    k = SP.num_selected(ratio, d)
    y = np.asarray(_TOPK_RT[ratio](jnp.asarray(x), KEY))
    kept = np.flatnonzero(y)
    # exact set (ties to the lowest index) and the kept values are the inputs
    assert set(kept.tolist()) == set(np_topk(x, k).tolist())
    np.testing.assert_array_equal(y[kept], x[kept])
    if len(np.unique(np.abs(x))) == d:  # distinct magnitudes: argpartition's set is the answer
        assert set(kept.tolist()) == set(np.argpartition(-np.abs(x), k - 1)[:k].tolist())
    # contraction: ||x - Q(x)||^2 <= (1 - k/d) ||x||^2 (the k largest carry at least k/d of the energy)
    assert np.sum((x - y) ** 2) <= (1 - k / d) * np.sum(x**2) * (1 + 1e-6) + 1e-30
    if ratio == 1.0:
        np.testing.assert_array_equal(y, x)


def test_topk_ties_and_zeros_lowest_index_first():
    # 60% of entries share the 3rd magnitude: the winners among the ties are the lowest indices.
    x = np.zeros(3000, np.float32)
    x[::5] = 1.0
    x[7], x[11] = 5.0, -4.0
    y = np.asarray(_TOPK_RT[0.01](jnp.asarray(x), KEY))  # k = 30
    kept = np.flatnonzero(y)
    assert set(kept.tolist()) == set(np_topk(x, 30).tolist())
    assert kept[-1] == 5 * 27  # 2 large + the first 28 ones (index 0, 5, ..., 135)


def test_topk_nan_counts_as_largest():
    x = np.random.RandomState(3).randn(33, 17).astype(np.float32)
    x[3, 4], x[20, 1] = np.nan, np.inf
    c = jc.compressors.topk(ratio=0.1)
    y = np.asarray(roundtrip_fn(c)(jnp.asarray(x), KEY))
    assert np.isnan(y[3, 4]) and y[20, 1] == np.inf  # NaN and Inf are kept (NaN ranks above Inf)
    k = SP.num_selected(0.1, x.size)
    assert set(np.flatnonzero(np.isnan(y) | (y != 0)).tolist()) == set(np_topk(x, k).tolist())


def test_topk_payload_and_wire_bits():
    for ratio, shape, dtype, ib in (
        (0.1, (200,), jnp.float32, 8),
        (1.0, (300, 300), jnp.float32, 32),
        (0.1, (700,), jnp.bfloat16, 16),
    ):
        c = jc.compressors.topk(ratio=ratio)
        x = jax.random.normal(KEY, shape).astype(dtype)
        p = compress_fn(c)(x, KEY)
        k = SP.num_selected(ratio, x.size)
        assert p.values.dtype == dtype and p.indices.dtype == jc.compressors.index_dtype(x.size)
        assert jc.wire_bits(p) == k * (jnp.dtype(dtype).itemsize * 8 + ib)


def test_topk_dense_below_sends_small_tensors_whole():
    """``dense_below``: a tensor of at most that many entries is sent whole (k = d, the declared
    contraction 1), a larger one keeps round(ratio · d) (the NumPy selection); bits are k (32 + index)."""
    c = jc.compressors.topk(ratio=0.05, dense_below=16)
    for d in (1, 16, 17, 400):
        x = np.random.RandomState(d).randn(d).astype(np.float32)
        k = d if d <= 16 else SP.num_selected(0.05, d)
        p = compress_fn(c)(jnp.asarray(x), KEY)
        y = np.asarray(c.decompress(p))
        assert set(np.flatnonzero(y).tolist()) == set(np_topk(x, k).tolist())
        assert jc.wire_bits(p) == k * (32 + 8 * jnp.dtype(jc.compressors.index_dtype(d)).itemsize)
        assert c.contraction(d) == k / d
    with pytest.raises(ValueError, match="dense_below"):
        jc.compressors.topk(ratio=0.1, dense_below=-1)


# --------------------------------------------------------------------------- #
# random-k
# --------------------------------------------------------------------------- #
def test_randomk_indices_distinct_uniform():
    d, k, n = 64, 8, 4000
    f = jax.jit(jax.vmap(lambda key: RK.randomk_indices(key, d, k)))
    idx = np.asarray(f(jax.random.split(KEY, n)))
    assert all(len(set(row.tolist())) == k for row in idx[:200])
    counts = np.bincount(idx.ravel(), minlength=d)
    # Each position is drawn with probability q = k/d: count ~ Binomial(n, q); 6 sigma per position,
    # two-sided tail 2e-9, x64 positions < 1.3e-7.
    q = k / d
    assert np.all(np.abs(counts - n * q) <= 6 * math.sqrt(n * q * (1 - q)))


@pytest.mark.parametrize("d,k", [(100, 7), (10_000, 100), (50_000, 2_000)])
def test_randomk_indices_are_the_top_hash_words(d, k):
    """The documented draw: positions of the k largest 31-bit words h(i) >> 1, ties to the lower index."""
    key = jax.random.PRNGKey(d)
    h = np.asarray(random_bits.uniform_bits(key, d, "murmur3")) >> 1
    want = np.sort(np.argsort(-h.astype(np.int64), kind="stable")[:k])
    got = jax.jit(RK.randomk_indices, static_argnums=(1, 2))(key, d, k)
    np.testing.assert_array_equal(np.sort(np.asarray(got)), want)


@pytest.mark.parametrize("margin", [5.0, -50.0])  # the sampled path and the forced exact fallback
def test_top_indices_counters_equal_stored_counters(margin):
    """values = d (counters rebuilt in each pass) selects exactly what the stored arange selects."""
    d, k = 9_000, 90
    words = random_bits.key_words(jax.random.PRNGKey(5))

    def keys_of(i):
        return (random_bits.bits_at(words, i, "murmur3") >> 1).astype(jnp.int32)

    @jax.jit  # one compiled program: op by op, each primitive compiled alone, the test cost twice the CPU time
    def both():
        got, _ = S.top_indices(d, k, KEY, keys_of=keys_of, margin=margin, primitive_max=0)
        want, _ = S.top_indices(
            jnp.arange(d, dtype=jnp.uint32), k, KEY, keys_of=keys_of, margin=margin, primitive_max=0
        )
        return got, want

    got, want = both()
    np.testing.assert_array_equal(np.asarray(got), np.asarray(want))


def test_randomk_large_tensor_and_shared_key():
    d = 10_000  # > 2048: the sampled selection path
    c = jc.compressors.randomk(ratio=0.01)
    x1, x2 = jax.random.normal(KEY, (2, d))

    @jax.jit
    def run(x1, x2, key):  # one program: the three decompressions share the key, hence the positions
        p1, p2 = c.compress(x1, key)[0], c.compress(x2, key)[0]
        summed = p1.__class__(values=p1.values + p2.values, key=p1.key, shape=p1.shape, dtype=p1.dtype, scale=p1.scale)
        return p1, c.decompress(p1), c.decompress(p2), c.decompress(summed)

    p1, y1, y2, ysum = (np.asarray(a) if i else a for i, a in enumerate(run(x1, x2, jax.random.PRNGKey(9))))
    idx = np.flatnonzero(y1)
    assert len(idx) == 100
    np.testing.assert_array_equal(y1[idx], np.asarray(x1)[idx])
    assert set(np.flatnonzero(y2).tolist()) == set(idx.tolist())
    # Same key, same positions: the payloads are summable (allreduce): decompress(sum) = sum of decompressions.
    np.testing.assert_allclose(ysum, y1 + y2, rtol=1e-6, atol=1e-6)
    assert jc.wire_bits(p1) == 100 * 32 + 64


def test_randomk_unbiased_scaling():
    x = jax.random.normal(jax.random.PRNGKey(4), (40,))
    c = jc.compressors.randomk(ratio=0.25, unbiased=True)
    n = 2000
    mean, var = mc_mean_var(c, x, n, seed=1)
    # Per coordinate Q(x)_i = (d/k) x_i b_i with b_i ~ Bernoulli(k/d): variance x_i^2 (d/k - 1);
    # the sample mean's error is N(0, var/N); 6 sigma (tail 2e-9 per coordinate).
    xn = np.asarray(x, np.float64)
    exact_var = xn**2 * (40 / 10 - 1)
    # the sample variance of a Bernoulli-scaled variable: relative sd ~ sqrt(2/N + kurtosis/N) < 5% here
    np.testing.assert_allclose(var, exact_var, rtol=0.25)
    assert np.all(np.abs(mean - xn) <= 6 * np.sqrt(exact_var / n) + 1e-6)
    biased = jc.compressors.randomk(ratio=0.25)
    y = np.asarray(roundtrip_fn(biased)(x, KEY))
    kept = np.flatnonzero(y)
    assert len(kept) == 10 and np.array_equal(y[kept], np.asarray(x)[kept])


@pytest.mark.parametrize("unbiased", [False, True])
def test_randomk_with_replacement_matches_numpy(unbiased):
    """``replacement=True``: k independent draws (jax.random.randint on the key folded with 2);
    each drawn position holds x_i (times 1/p when unbiased, p = 1 − (1 − 1/d)^k), the others 0."""
    d, k = 40, 30
    x = np.random.default_rng(3).standard_normal(d).astype(np.float32)
    c = jc.compressors.randomk(ratio=k / d, unbiased=unbiased, replacement=True)
    key = jax.random.PRNGKey(7)
    draws = np.asarray(jax.random.randint(jax.random.fold_in(key, 2), (k,), 0, d, dtype=jnp.int32))
    assert len(set(draws.tolist())) < k  # 30 draws of 40: repeats are all but certain, and here present
    p = 1.0 - (1.0 - 1.0 / d) ** k
    expected = np.zeros(d, np.float32)
    expected[draws] = x[draws] * (np.float32(1.0 / p) if unbiased else 1.0)
    payload, _ = c.compress(jnp.asarray(x), key)
    np.testing.assert_array_equal(np.asarray(payload.values), x[draws])  # k values, repeats included
    np.testing.assert_allclose(np.asarray(c.decompress(payload)), expected, rtol=1e-6)
    assert jc.wire_bits(payload) == 32 * k + 64
    if unbiased:
        assert c.omega(d) == pytest.approx(1.0 / p - 1.0)
    else:
        assert c.delta(d) == pytest.approx(p)
    with pytest.raises(TypeError, match="replacement"):
        jc.compressors.randomk(ratio=0.5, replacement=1)


# The two variants run the same compression; ``unbiased`` only sets the static scale ``1/p`` applied
# on decompression, so the checks that read the scale or the declaration run on both.
_SCALE_DEPENDENT_CHECKS = ("unbiased", "error_bound", "error_feedback", "decompress_sum", "strategy")


@pytest.mark.parametrize("unbiased", [False, True])
def test_randomk_with_replacement_passes_the_battery(unbiased):
    """The contract battery on the with-replacement variant: the whole battery (shapes and dtypes,
    keys, optax, wire bits, vmap ≡ shard_map, ...) on the unbiased one, and on the biased one every
    check that depends on the scale or on the declaration (unbiasedness, here skipped as declared
    biased; the contraction δ = p; error feedback; the summed decoding; the payload strategy)."""
    c = jc.compressors.randomk(ratio=0.3, unbiased=unbiased, replacement=True)
    if unbiased:
        report = jc.testing.check_compressor(c)
        assert not report["unbiased"].startswith(jc.testing.SKIPPED), report  # the Monte Carlo test ran
        return
    checks = jc.testing.contract_checks()
    report = {name: checks[name](c) for name in _SCALE_DEPENDENT_CHECKS}
    assert report["unbiased"].startswith(jc.testing.SKIPPED + "declared biased"), report
    assert not report["error_bound"].startswith(jc.testing.SKIPPED), report


# --------------------------------------------------------------------------- #
# Threshold-v
# --------------------------------------------------------------------------- #
@pytest.mark.parametrize("v,max_ratio", [(0.0, 1.0), (1.0, 1.0), (1.5, 0.05), (10.0, 1.0)])
def test_threshold_matches_numpy(v, max_ratio):
    x = np.random.RandomState(5).randn(40, 50).astype(np.float32)
    x[0, 0], x[1, 1] = np.nan, -np.inf
    c = jc.compressors.threshold(v=v, max_ratio=max_ratio)
    p = compress_fn(c)(jnp.asarray(x), KEY)
    y = np.asarray(c.decompress(p))
    flat = x.ravel()
    sel = np.flatnonzero((np.abs(flat) >= v) | np.isnan(flat))
    cap = min(flat.size, max(1, math.ceil(max_ratio * flat.size)))
    sel = sel[:cap]  # over capacity: the first cap in index order
    assert int(p.count) == len(sel)
    np.testing.assert_array_equal(np.asarray(p.indices)[: len(sel)], sel)
    expected = np.zeros_like(flat)
    expected[sel] = flat[sel]
    np.testing.assert_array_equal(y.ravel(), expected)
    assert int(jc.wire_bits(p)) == len(sel) * (32 + 16) + 32


def test_threshold_large_sparse_buffer():
    # d > 16 * 1024 with few survivors: the compaction and scatter take their small-buffer branch.
    x = np.random.RandomState(6).randn(50_000).astype(np.float32)
    c = jc.compressors.threshold(v=3.0)
    y = np.asarray(roundtrip_fn(c)(jnp.asarray(x), KEY))
    np.testing.assert_array_equal(y, np.where(np.abs(x) >= 3.0, x, 0))


# --------------------------------------------------------------------------- #
# DGC: NumPy transcription of dgc/compression.py's _sparsify (resample=True)
# --------------------------------------------------------------------------- #
def np_dgc(x, ratio, sample_ratio, sample_idx, upper=1.3, lower=0.8, iters=10):
    flat = np.asarray(x, np.float32).ravel()
    imp = np.where(np.isnan(flat), np.inf, np.abs(flat)).astype(np.float32)
    plan = TH.dgc_plan(flat.size, ratio, sample_ratio)
    k = plan.num_selects
    samples = imp[sample_idx]
    thr = np.sort(samples)[::-1][plan.top_k_samples - 1]
    mask = imp >= thr
    branch = "direct"
    if flat.size > plan.num_samples:
        for _ in range(iters):
            n = mask.sum()
            if n > k:
                if n > k * upper:
                    branch = "resample"
                    return np_topk(np.where(np.isnan(flat), np.inf, flat), k), branch
                break
            elif n < lower * k:
                thr = np.float32(thr * np.float32(lower))
                branch = "lowered"
                mask = imp >= thr
            else:
                break
    return np.flatnonzero(mask)[:k], branch


@pytest.mark.parametrize("d,ratio,sample_ratio", [(50, 0.1, 0.01), (20_000, 0.01, 0.01)])
def test_dgc_matches_numpy_transcription(d, ratio, sample_ratio):
    c = jc.compressors.dgc(ratio=ratio, sample_ratio=sample_ratio)
    f = compress_fn(c)
    plan = TH.dgc_plan(d, ratio, sample_ratio)
    branches = set()
    for seed in range(6):
        rs = np.random.RandomState(seed)
        x = rs.randn(d).astype(np.float32) * rs.choice([1.0, 10.0], d, p=[0.95, 0.05]).astype(np.float32)
        if seed == 5:
            x[: d // 2] = 3.0  # half the entries tie at a large value: more than 1.3 k selected, resample
        key = jax.random.PRNGKey(seed)
        p = f(jnp.asarray(x), key)
        sample_idx = np.asarray(TH.dgc_sample_indices(key, d, plan.num_samples))
        ref, branch = np_dgc(x, ratio, sample_ratio, sample_idx)
        branches.add(branch)
        n = int(p.count)
        assert n == len(ref) <= plan.num_selects
        assert set(np.asarray(p.indices)[:n].tolist()) == set(ref.tolist())
        np.testing.assert_array_equal(np.asarray(p.values)[:n], x[np.asarray(p.indices)[:n]])
        assert int(jc.wire_bits(p)) == n * (32 + 8 * np.dtype(jc.compressors.index_dtype(d)).itemsize) + 32
    if d > plan.num_samples:
        assert {"resample"} <= branches and len(branches) >= 2


# --------------------------------------------------------------------------- #
# adaptive (Dryden et al.)
# --------------------------------------------------------------------------- #
def np_adaptive(x, ratio):
    flat = np.asarray(x, np.float32).ravel()
    out = np.zeros_like(flat)
    counts = []
    for sign in (1, -1):
        part = np.flatnonzero(sign * flat > 0)
        n = len(part)
        k = 0 if n == 0 else int(np.clip(np.floor(np.float32(ratio) * np.float32(n) + np.float32(0.5)), 1, n))
        order = part[np.argsort(-np.abs(flat[part]), kind="stable")[:k]]
        if k:
            out[order] = np.mean(flat[order], dtype=np.float32)
        counts.append(k)
    return out, counts


_ADAPTIVE = {r: compress_fn(jc.compressors.adaptive(ratio=r)) for r in (0.01, 0.2)}
_ADAPTIVE_DEC = jax.jit(jc.compressors.adaptive(ratio=0.2).decompress)


@settings(max_examples=6)
@given(d=st.sampled_from([1, 7, 300, 5000]), ratio=st.sampled_from([0.01, 0.2]), seed=st.integers(0, 999))
def test_adaptive_matches_numpy(d, ratio, seed):
    x = np.random.RandomState(seed).randn(d).astype(np.float32)
    p = _ADAPTIVE[ratio](jnp.asarray(x), KEY)
    ref, counts = np_adaptive(x, ratio)
    assert np.asarray(p.counts).tolist() == counts
    np.testing.assert_allclose(np.asarray(_ADAPTIVE_DEC(p)), ref, rtol=1e-5, atol=1e-6)
    ib = 8 * np.dtype(jc.compressors.index_dtype(d)).itemsize
    assert int(jc.wire_bits(p)) == sum(counts) * ib + 128


def test_adaptive_ignores_nan_and_zero():
    x = np.array([np.nan, 0.0, 3.0, -2.0, 1.0, -1.0, 0.5, -0.5], np.float32)
    c = jc.compressors.adaptive(ratio=0.5)
    y = np.asarray(roundtrip_fn(c)(jnp.asarray(x), KEY))
    # 4 positives (keep 2: 3, 1 -> mean 2), 3 negatives (keep round(1.5)=2: -2, -1 -> mean -1.5)
    np.testing.assert_allclose(y, [0, 0, 2.0, -1.5, 2.0, -1.5, 0, 0])


# --------------------------------------------------------------------------- #
# random sparsification (DoubleSqueeze)
# --------------------------------------------------------------------------- #
@pytest.mark.parametrize("p,d,encoding", [(0.5, 64, "mask"), (0.01, 20_000, "indices")])
def test_random_sparsification_unbiased_and_encoding(p, d, encoding):
    assert RS.random_sparsification_plan(p, d, jnp.float32)[0] == encoding
    c = jc.compressors.random_sparsification(p=p)
    x = jax.random.normal(jax.random.PRNGKey(7), (d,))
    payload = compress_fn(c)(x, KEY)
    assert isinstance(payload, SP.MaskSparsePayload if encoding == "mask" else SP.CountSparsePayload)
    y = np.asarray(c.decompress(payload))
    kept = np.flatnonzero(y)
    p_exact = RS._keep_threshold(p)[1]
    np.testing.assert_allclose(y[kept], np.asarray(x)[kept] / p_exact, rtol=1e-6)
    vb, ib = 32, 8 * np.dtype(jc.compressors.index_dtype(d)).itemsize
    expect = 8 * math.ceil(d / 8) + len(kept) * vb if encoding == "mask" else len(kept) * (vb + ib) + 32
    assert int(jc.wire_bits(payload)) == expect
    if encoding == "indices":
        # the number kept is Binomial(d, p): within 6 sigma of d p
        assert abs(len(kept) - d * p) <= 6 * math.sqrt(d * p * (1 - p))
    else:
        # E[Q(x)] = x: Q(x)_i = x_i b_i / p, variance x_i^2 (1/p - 1); 6 sigma on the N-sample mean.
        n = 2000
        mean, _ = mc_mean_var(c, x, n, seed=3)
        xn = np.asarray(x, np.float64)
        assert np.all(np.abs(mean - xn) <= 6 * np.sqrt(xn**2 * (1 / p - 1) / n) + 1e-6)


# --------------------------------------------------------------------------- #
# qsparse = QSGD o top-k
# --------------------------------------------------------------------------- #
def test_qsparse_is_qsgd_of_topk():
    x = jax.random.normal(jax.random.PRNGKey(8), (64,))
    c = jc.compressors.qsparse(ratio=0.25, levels=4)
    k = 16
    support = np_topk(np.asarray(x), k)
    n = 3000
    mean, var = mc_mean_var(c, x, n, seed=2)
    outside = np.setdiff1d(np.arange(64), support)
    assert np.all(mean[outside] == 0) and np.all(var[outside] == 0)
    # E[Q(x)] = top_k(x): QSGD is unbiased on the kept values. Per coordinate the level is
    # floor(l) + Bernoulli(frac(l)), variance (norm/s)^2 frac(1-frac) <= (norm/s)^2 / 4; 6 sigma.
    xs = np.asarray(x, np.float64)[support]
    norm = np.linalg.norm(xs)
    tol = 6 * np.sqrt((norm / 4) ** 2 / 4 / n) + 1e-6
    assert np.all(np.abs(mean[support] - xs) <= tol)
    p = compress_fn(c)(x, KEY)
    assert jc.wire_bits(p) == k * 8 + math.ceil(k * 4 / 8) * 8 + math.ceil(k / 8) * 8 + 32  # 4 bits/level for s=4
    wide = jc.compressors.qsparse(ratio=0.25, levels=300)
    assert jc.wire_bits(compress_fn(wide)(x, KEY)) == k * 8 + k * 16 + math.ceil(k / 8) * 8 + 32


# --------------------------------------------------------------------------- #
# Bad input
# --------------------------------------------------------------------------- #
@pytest.mark.parametrize(
    "factory,kwargs,match",
    [
        ("topk", dict(ratio=0.0), "ratio"),
        ("topk", dict(ratio=1.5), "ratio"),
        ("topk", dict(ratio=float("nan")), "ratio"),
        ("randomk", dict(ratio=-0.1), "ratio"),
        ("randomk", dict(ratio=0.1, unbiased="yes"), "unbiased"),
        ("threshold", dict(v=float("nan")), "v"),
        ("threshold", dict(v=float("inf")), "v"),
        ("threshold", dict(v=-1.0), "v"),
        ("threshold", dict(v=1.0, max_ratio=0.0), "max_ratio"),
        ("dgc", dict(ratio=2.0), "ratio"),
        ("dgc", dict(ratio=0.1, sample_ratio=0.0), "sample_ratio"),
        ("dgc", dict(ratio=0.1, upper_bound=0.9), "upper_bound"),
        ("dgc", dict(ratio=0.1, lower_bound=1.0), "lower_bound"),
        ("adaptive", dict(ratio=0.0), "ratio"),
        ("random_sparsification", dict(p=0.0), "p"),
        ("random_sparsification", dict(p=1.2), "p"),
        ("qsparse", dict(ratio=0.1, levels=0), "levels"),
        ("qsparse", dict(ratio=1.1, levels=4), "ratio"),
    ],
)
def test_bad_hyperparameters(factory, kwargs, match):
    with pytest.raises((ValueError, TypeError), match=match):
        jc.compressors.make(factory, **kwargs)


def test_hyperparameters_are_keyword_only_and_integer_input_rejected():
    with pytest.raises(TypeError):
        jc.compressors.topk(0.1)
    with pytest.raises(TypeError, match="floating"):
        jc.compressors.topk(ratio=0.1).compress(jnp.arange(10), KEY)
