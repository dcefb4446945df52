"""Quantizers (jaxcomm.compressors._quantize, _sign) against NumPy references and closed-form facts.

Statistical tests use fixed seeds; every tolerance is z standard errors of the
estimator (z = 6: a two-sided normal tail of 2e-9 per coordinate, < 1e-6 over
the few hundred coordinates tested here), with the standard error computed from
the estimator's own variance as stated next to each test.
"""

import functools
import math

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

import jaxcomm as jc
from jaxcomm.compressors import _eightbit as E8
from jaxcomm.compressors._kernels import bitpack, random_bits
from jaxcomm.compressors._stochastic import QSGDPayload

Z = 6.0
QUANTIZERS = {
    "eightbit": {},
    "onebit": {},
    "signsgd": {},
    "signum": {},
    "efsignsgd": {},
    "qsgd": dict(levels=4),
    "natural": {},
    "terngrad": {},
    "inceptionn": dict(error_bound=0.01),
    "sketchml": dict(buckets=16),
    "clipping": dict(bits=8),
    "stochastic_rounding": dict(bits=4),
}
UNBIASED = {"qsgd", "natural", "terngrad", "stochastic_rounding"}
SCALE_BASED = {"eightbit", "onebit", "efsignsgd", "qsgd", "terngrad", "sketchml", "stochastic_rounding"}
SHAPES = ((), (7,), (33, 17))


@functools.cache
def make(name, **kwargs):
    return jc.compressors.make(name, **kwargs)


@functools.cache
def jitted(name, kw_items=()):
    """One jit-compiled round trip per (compressor, hyper-parameters); shapes retrace."""
    c = make(name, **dict(kw_items))

    def f(x, key):
        payload, state = c.compress(x, key)
        return c.decompress(payload), payload, state

    return jax.jit(f)


def roundtrip(name, x, key=0, **kwargs):
    kw = dict(QUANTIZERS[name], **kwargs)
    y, payload, state = jitted(name, tuple(sorted(kw.items())))(jnp.asarray(x), jax.random.PRNGKey(key))
    return np.asarray(y), payload, state


def sample(shape, seed, scale=1.0):
    return np.asarray(np.random.default_rng(seed).standard_normal(shape) * scale, np.float32)


def field_bits(d, width):
    """pw(d, w): the binary digits 2^j of w, each packed into ceil(d 2^j / 8) bytes."""
    return sum(8 * math.ceil(d * w / 8) for w in (1, 2, 4, 8, 16, 32) if width & w)


def leaf_bits(payload):
    return sum(int(np.size(a)) * np.dtype(a.dtype).itemsize * 8 for a in jax.tree.leaves(payload))


# --------------------------------------------------------------------------- #
# Registry, metadata, wire bits
# --------------------------------------------------------------------------- #
def test_registered_with_metadata():
    assert set(QUANTIZERS) <= set(jc.compressors.names())
    for name in QUANTIZERS:
        c = make(name, **QUANTIZERS[name])
        assert c.strategy == "allgather", name
        assert c.unbiased == (name in UNBIASED), name
        assert getattr(jc.compressors, name) is not None and name in jc.compressors.__all__


def expected_bits(name, d, x):
    kw = QUANTIZERS[name]
    if name == "eightbit":
        return 8 * d + 32
    if name == "onebit":
        return 8 * math.ceil(d / 8) + 64
    if name in ("signsgd", "signum"):
        return 8 * math.ceil(d / 8)
    if name == "efsignsgd":
        return 8 * math.ceil(d / 8) + 32
    if name == "qsgd":
        return field_bits(d, math.ceil(math.log2(2 * kw["levels"] + 1))) + 32
    if name == "natural":
        return 8 * math.ceil(d / 8) + 8 * d
    if name == "terngrad":
        return 8 * math.ceil(d / 4) + 32
    if name == "sketchml":
        return field_bits(d, math.ceil(math.log2(kw["buckets"]))) + 32 * kw["buckets"]
    if name == "clipping":
        return field_bits(d, 9 + kw["bits"])
    if name == "stochastic_rounding":
        return field_bits(d, kw["bits"]) + 32
    if name == "inceptionn":
        q = np.floor(np.abs(x.astype(np.float64).ravel()) / 2.0**-7)  # delta = 2^floor(log2 0.01) = 2^-7
        n8, n16 = np.sum((q >= 1) & (q < 2**7)), np.sum((q >= 2**7) & (q < 2**15))
        n32 = np.sum(q >= 2**15)
        return 8 * math.ceil(d / 4) + 8 * n8 + 16 * n16 + 32 * n32
    raise AssertionError(name)


@pytest.mark.parametrize("name", sorted(QUANTIZERS))
def test_wire_bits_formula(name):
    # d = 1, 7, 8, 561: byte-aligned and not (the shapes other tests compile too).
    for shape in ((), (7,), (8,), (33, 17)):
        d = math.prod(shape)
        x = sample(shape, d) * np.float32(10.0 ** np.random.default_rng(d).uniform(-3, 4, shape))
        _, payload, _ = roundtrip(name, x)
        bits = jc.wire_bits(payload)
        assert int(bits) == expected_bits(name, d, x), (name, d)
        if name == "inceptionn":
            # Fixed-capacity buffers: only the first n_c slots of each are sent.
            n8, n16, n32 = (int(v) for v in payload.class_counts())
            assert int(bits) == leaf_bits(payload.tags) + 8 * n8 + 16 * n16 + 32 * n32
        else:
            assert isinstance(bits, int) and bits == leaf_bits(payload), (name, d)


def test_bit_exact_widths():
    # The code width is exact up to byte padding of each binary-digit field.
    for d in (1, 9, 1000):
        for w in range(1, 33):
            assert d * w <= field_bits(d, w) <= d * w + 7 * bin(w).count("1")
    # QSGD's joint sign+level code never exceeds a separate sign bit + level.
    for s in (1, 2, 3, 4, 7, 64, 127, 255, 1000):
        assert math.ceil(math.log2(2 * s + 1)) <= 1 + math.ceil(math.log2(s + 1))


@pytest.mark.parametrize("n,widths", [(9, tuple(range(1, 33))), (1, (1, 5, 17, 32)), (70, (3, 4, 23, 31))])
def test_pack_codes_roundtrip(n, widths):

    @jax.jit
    def roundtrips(codes):  # every width in one compilation
        fields = [bitpack.pack_codes(codes[w - 1], w) for w in widths]
        return [bitpack.unpack_codes(f, w, n) for f, w in zip(fields, widths)], fields

    rng = np.random.default_rng(n)
    codes = np.zeros((32, n), np.uint32)
    for w in widths:
        codes[w - 1] = rng.integers(0, 2**w, n, dtype=np.uint64).astype(np.uint32)
    backs, fields = roundtrips(jnp.asarray(codes))
    for w, back, f in zip(widths, backs, fields):
        np.testing.assert_array_equal(np.asarray(back).astype(np.uint32), codes[w - 1])
        assert leaf_bits(f) == bitpack.packed_code_bits(n, w) == field_bits(n, w)


@settings(max_examples=10, deadline=None)
@given(n=st.sampled_from([0, 1, 7, 31, 32, 33, 64, 95, 1000, 4099]), seed=st.integers(0, 2**31 - 1))
def test_pack_reduce_matches_pack_and_numpy(n, seed):
    """pack_reduce's bits are pack(mask, 1) exactly; its sum and max are NumPy's (sum to float32 rounding)."""
    rng = np.random.default_rng(seed)
    x = (rng.standard_normal(n) * 10.0 ** rng.uniform(-3, 3, n)).astype(np.float32)
    bits, (total, top) = jax.jit(lambda v: bitpack.pack_reduce(v < 0, (jnp.abs(v), jnp.abs(v)), ("sum", "max")))(x)
    np.testing.assert_array_equal(np.asarray(bits), np.asarray(bitpack.pack(jnp.asarray(x) < 0, 1)))
    assert bits.shape == (bitpack.packed_size(n, 1),)
    a = np.abs(x).astype(np.float64)
    # float32 summation (rows of 32, then the row sums): error <= n eps sum|x|
    assert abs(float(total) - a.sum()) <= n * 2.0**-24 * a.sum()
    assert float(top) == (a.max() if n else -np.inf)


def test_pack_reduce_propagates_nan():
    x = np.ones(70, np.float32)
    x[40] = np.nan
    _, (total, top) = bitpack.pack_reduce(jnp.asarray(x) < 0, (jnp.asarray(x), jnp.asarray(x)), ("sum", "max"))
    assert np.isnan(float(total)) and np.isnan(float(top))
    with pytest.raises(ValueError, match="ops"):
        bitpack.pack_reduce(jnp.asarray(x) < 0, (jnp.asarray(x),), ("min",))


def test_bits_at_is_uniform_bits_at_the_counters():
    key = jax.random.PRNGKey(3)
    i = jnp.asarray([0, 5, 999, 17], jnp.uint32)
    for scheme in ("murmur3", "lowbias32"):
        full = random_bits.uniform_bits(key, 1000, scheme)
        np.testing.assert_array_equal(
            np.asarray(random_bits.bits_at(random_bits.key_words(key), i, scheme)), np.asarray(full)[np.asarray(i)]
        )


# --------------------------------------------------------------------------- #
# The 1-bit family
# --------------------------------------------------------------------------- #
@settings(max_examples=8)
@given(shape=st.sampled_from(SHAPES), seed=st.integers(0, 2**31 - 1), scale=st.sampled_from([1e-6, 1.0, 1e4]))
def test_signsgd_and_efsignsgd_match_numpy(shape, seed, scale):
    x = sample(shape, seed, scale)
    x.ravel()[:1] = 0.0  # zero decodes to +1
    sign = np.where(x < 0, -1.0, 1.0).astype(np.float32)
    y, p, _ = roundtrip("signsgd", x)
    np.testing.assert_array_equal(y, sign)
    np.testing.assert_array_equal(np.asarray(p.signs), np.packbits(x.ravel() < 0, bitorder="little"))
    y, p, _ = roundtrip("efsignsgd", x)
    np.testing.assert_allclose(y, np.abs(x).mean(dtype=np.float64) * sign, rtol=1e-5)


@settings(max_examples=8)
@given(shape=st.sampled_from(SHAPES[1:]), seed=st.integers(0, 2**31 - 1), threshold=st.sampled_from([0.0, -0.5]))
def test_onebit_matches_numpy(shape, seed, threshold):
    x = sample(shape, seed)
    high = x >= threshold
    mu1 = x[high].mean(dtype=np.float64) if high.any() else 0.0
    mu0 = x[~high].mean(dtype=np.float64) if (~high).any() else 0.0
    y, p, _ = roundtrip("onebit", x, threshold=threshold)
    # Tolerance: float32 sums of <= 561 terms, mu_0 via sum(x) - sum_high.
    np.testing.assert_allclose(y, np.where(high, mu1, mu0), rtol=1e-4, atol=1e-5)
    np.testing.assert_array_equal(np.asarray(p.bits), np.packbits(high.ravel(), bitorder="little"))
    # 1-bit SGD preserves the sum of the tensor.
    np.testing.assert_allclose(y.sum(), x.sum(dtype=np.float64), rtol=1e-4, atol=1e-3)


def test_signum_state_matches_numpy_loop():
    beta, shape = 0.8, (5, 3)
    grads = [sample(shape, s) for s in range(4)]
    c = jc.compressors.signum(momentum=beta)
    step = jax.jit(lambda g, s: c.compress(g, None, s))
    state, m = c.init_state(jnp.zeros(shape)), np.zeros(shape)
    for g in grads:
        m = beta * m + (1 - beta) * g
        payload, state = step(jnp.asarray(g), state)
        np.testing.assert_allclose(np.asarray(state.momentum), m, rtol=1e-6, atol=1e-7)
        np.testing.assert_array_equal(np.asarray(c.decompress(payload)), np.where(m < 0, -1.0, 1.0))
    # Same through optax: the per-leaf state is carried by CompressorState.
    tx = optax.chain(c, optax.scale(-1.0))
    params = {"w": jnp.zeros(shape)}
    opt_state, m = tx.init(params), np.zeros(shape)
    update = jax.jit(tx.update)
    for g in grads:
        m = beta * m + (1 - beta) * g
        upd, opt_state = update({"w": jnp.asarray(g)}, opt_state, params)
        np.testing.assert_array_equal(np.asarray(upd["w"]), -np.where(m < 0, -1.0, 1.0))


# --------------------------------------------------------------------------- #
# 8-bit dynamic tree quantization
# --------------------------------------------------------------------------- #
def test_eightbit_codebook_structure():
    mags = E8._eightbit_magnitudes()
    assert mags[0] == 0 and np.all(np.diff(mags) > 0) and mags[-1] < 1
    book = E8.eightbit_codebook()
    assert book.shape == (256,) and book.dtype == np.float32
    np.testing.assert_array_equal(book[128:], -book[:128])
    # 1 sign bit, e leading zeros (base-10 exponent), then 6 - e fraction bits.
    for m in (1, 2, 3, 64, 100, 127):
        e = 7 - m.bit_length()
        frac_bits = 6 - e
        frac = m - (1 << frac_bits)
        assert np.isclose(book[m], 10.0**-e * (0.1 + 0.9 * (frac + 0.5) / 2**frac_bits), rtol=1e-6)


@settings(max_examples=8)
@given(shape=st.sampled_from(SHAPES), seed=st.integers(0, 2**31 - 1))
def test_eightbit_nearest_code_and_error_bound(shape, seed):
    rng = np.random.default_rng(seed)
    x = (rng.standard_normal(shape) * 10.0 ** rng.uniform(-8, 0, shape)).astype(np.float32)
    y, p, _ = roundtrip("eightbit", x)
    mags = E8._eightbit_magnitudes()
    scale = np.abs(x).max()
    assert float(p.scale) == scale
    u = np.abs(x.ravel().astype(np.float64)) / scale if scale > 0 else np.zeros(x.size)
    m = np.asarray(p.codes).astype(np.int64) & 127
    # Error <= half the gap between the two codes around |x|/scale (times the scale).
    hi = np.clip(np.searchsorted(mags, u), 1, 127)
    half_gap = (mags[hi] - mags[hi - 1]) / 2
    err = np.abs(u - mags[m])
    assert np.all(err <= half_gap * (1 + 1e-5) + 1e-7), err.max()
    # The chosen code is the nearest one (up to float32 rounding at exact ties).
    nearest = np.abs(u[:, None] - mags[None, :]).min(1)
    assert np.all(err <= nearest + 1e-6 * np.maximum(u, 1e-6))
    np.testing.assert_allclose(y.ravel(), np.sign(x.ravel()) * mags[m] * scale, rtol=1e-6, atol=1e-30)


# --------------------------------------------------------------------------- #
# Stochastic quantizers
# --------------------------------------------------------------------------- #
def mc_samples(name, x, n, seed=0, **kwargs):
    c = make(name, **dict(QUANTIZERS[name], **kwargs))
    keys = jax.random.split(jax.random.PRNGKey(seed), n)
    f = jax.jit(jax.vmap(lambda k: c.decompress(c.compress(jnp.asarray(x), k)[0])))
    return np.asarray(f(keys), np.float64)


def assert_unbiased(samples, x):
    # Per coordinate the sample mean is ~ N(x, var/N): |mean - x| <= Z sqrt(var/N)
    # (+ float32 rounding of deterministic coordinates).
    n = samples.shape[0]
    mean, var = samples.mean(0), samples.var(0, ddof=1)
    tol = Z * np.sqrt(var / n) + 1e-6 * (1 + np.abs(x))
    assert np.all(np.abs(mean - x) <= tol), np.max(np.abs(mean - x) - tol)


def test_terngrad_support_probability_and_mean():
    x = sample((48,), 1).astype(np.float64)
    x[0] = 0.0
    s = np.abs(x).max()
    ys = mc_samples("terngrad", x.astype(np.float32), 4000)
    s32 = float(np.float32(s))
    assert np.all(np.isin(ys, [-s32, 0.0, s32]))
    assert np.all(ys * x >= 0)  # nonzero outputs carry the sign of x
    # P(|Q_i| = s) = |x_i|/s: the frequency of N Bernoulli(p) has sd sqrt(p(1-p)/N).
    p, n = np.abs(x) / s, ys.shape[0]
    freq = (ys != 0).mean(0)
    assert np.all(np.abs(freq - p) <= Z * np.sqrt(p * (1 - p) / n) + 1e-6)
    assert_unbiased(ys, x)


def test_natural_support_and_mean():
    x = sample((40,), 2).astype(np.float32) * np.float32(10.0 ** np.linspace(-30, 30, 40))
    x[:4] = [0.0, 0.25, -8.0, 2.0**-130]  # zero, exact powers of two, a subnormal
    ys = mc_samples("natural", x, 4000)
    xd = x.astype(np.float64)
    nz = xd != 0
    lo = np.where(nz, 2.0 ** np.floor(np.log2(np.abs(np.where(nz, xd, 1.0)))), 0.0)
    lo[3] = 0.0  # subnormals round between 0 and 2^-126
    hi = np.where(nz, 2 * lo, 0.0)
    hi[3] = 2.0**-126
    mag = np.abs(ys)
    assert np.all((mag == lo) | (mag == hi))
    assert np.all(np.sign(ys) == np.sign(xd)[None, :] * (mag > 0))
    assert np.all(ys[:, :3] == xd[:3])  # powers of two (and 0) are exact
    # Unbiased: compare means relative to each coordinate's scale (the values span 60 decades).
    unit = np.where(nz, hi / 2, 1.0)
    assert_unbiased(ys / unit, xd / unit)


@pytest.mark.parametrize("levels", [1, 4])
def test_qsgd_unbiased_and_variance(levels):
    d, n = 64, 4000
    x = sample((d,), 3).astype(np.float64)
    ys = mc_samples("qsgd", x.astype(np.float32), n, levels=levels)
    assert_unbiased(ys, x)
    norm = np.linalg.norm(x)
    # Levels: |Q_i| is norm/s times floor(s|x_i|/norm) or that + 1.
    lev = np.abs(ys) * levels / norm
    low = np.floor(levels * np.abs(x) / norm)
    assert np.all((np.abs(lev - low) < 1e-3) | (np.abs(lev - low - 1) < 1e-3))
    # E||Q(x) - x||^2 exactly: sum_i (norm/s)^2 p_i (1 - p_i), p_i = frac(s|x_i|/norm);
    # the MC mean of N i.i.d. errors e_k has standard error sd(e)/sqrt(N).
    frac = levels * np.abs(x) / norm - low
    exact = np.sum((norm / levels) ** 2 * frac * (1 - frac))
    errs = np.sum((ys - x) ** 2, axis=1)
    se = errs.std(ddof=1) / np.sqrt(n)
    assert abs(errs.mean() - exact) <= Z * se
    # Alistarh et al., Lemma 3.1: E||Q(x) - x||^2 <= min(d/s^2, sqrt(d)/s) ||x||^2.
    bound = min(d / levels**2, np.sqrt(d) / levels) * norm**2
    assert errs.mean() <= bound + Z * se
    assert exact <= bound


def test_qsgd_code_width():
    for levels in (1, 64, 1000):  # widths 2, 8 and 11 = 1 + 2 + 8
        _, p, _ = roundtrip("qsgd", sample((7,), 0), levels=levels)
        assert jc.wire_bits(p) == leaf_bits(p) == field_bits(7, math.ceil(math.log2(2 * levels + 1))) + 32


@pytest.mark.parametrize("levels", [1, 64, 1000])
def test_qsgd_decode_equals_dequantize(levels):
    """decompress == jc.compressors.dequantize(|c - s|, c < s, norm, s) (NaN where the norm is not
    finite), bit for bit, for every code c and for norms 0, subnormal, small, ordinary, huge, inf, NaN."""
    c = jc.compressors.qsgd(levels=levels)
    width = bitpack.code_width(2 * levels + 1)
    codes = jnp.arange(2 * levels + 1, dtype=jnp.int32)

    @jax.jit
    def reference(norm):
        y = jc.compressors.dequantize(jnp.abs(codes - levels), codes < levels, norm, levels, jnp.float32)
        return jnp.where(jnp.isfinite(norm), y, jnp.nan)

    for norm in (0.0, 1e-38, 1e-30, 3.5, 3e38, np.inf, np.nan):
        p = QSGDPayload(
            codes=bitpack.pack_codes(codes, width),
            norm=jnp.float32(norm),
            levels=levels,
            shape=(codes.size,),
            dtype=jnp.float32,
        )
        got, want = np.asarray(c.decompress(p)), np.asarray(reference(jnp.float32(norm)))
        np.testing.assert_array_equal(got.view(np.uint32), want.view(np.uint32), err_msg=str(norm))
        if 1e-37 < norm < 1e38:  # and NumPy's sign * level * (norm / s), to an ulp (XLA:CPU flushes subnormals)
            ref = np.sign(np.asarray(codes) - levels) * np.abs(np.asarray(codes) - levels) * (np.float32(norm) / levels)
            np.testing.assert_allclose(got, ref.astype(np.float32), rtol=2e-7, atol=0)


def test_stochastic_rounding_grid_and_mean():
    bits, d = 3, 32
    x = sample((d,), 4).astype(np.float64)
    ys = mc_samples("stochastic_rounding", x.astype(np.float32), 4000, bits=bits)
    m, top = np.abs(x).max(), 2**bits - 1
    k = (ys + m) * top / (2 * m)  # grid index of each output
    assert np.all(np.abs(k - np.round(k)) < 1e-4)
    kx = (x + m) * top / (2 * m)
    # Adjacent grid points only: floor(k(x)) or floor(k(x)) + 1.
    assert np.all((np.abs(np.round(k) - np.floor(kx)) < 0.5) | (np.abs(np.round(k) - np.floor(kx) - 1) < 0.5))
    assert np.all(np.abs(ys) <= m * (1 + 1e-6))
    assert_unbiased(ys, x)


def test_hash_uniform_bits_statistics():
    n = 1 << 16
    u = np.asarray(random_bits.uniform_floats(jax.random.PRNGKey(0), n), np.float64)
    # Mean and variance of U[0,1): 1/2 (sd 1/sqrt(12n)) and 1/12 (sd sqrt(1/180n)).
    assert abs(u.mean() - 0.5) <= Z / np.sqrt(12 * n)
    assert abs(u.var() - 1 / 12) <= Z * np.sqrt(1 / (180 * n))
    # Lag-1 correlation within a stream and correlation across keys: sd 1/sqrt(n).
    assert abs(np.corrcoef(u[:-1], u[1:])[0, 1]) <= Z / np.sqrt(n)
    v = np.asarray(random_bits.uniform_floats(jax.random.PRNGKey(1), n), np.float64)
    assert abs(np.corrcoef(u, v)[0, 1]) <= Z / np.sqrt(n)
    # Counts in 16 equal bins: chi-square with 15 dof, mean 15, sd sqrt(30).
    counts = np.bincount((u * 16).astype(int), minlength=16)
    chi2 = np.sum((counts - n / 16) ** 2 / (n / 16))
    assert chi2 <= 15 + Z * np.sqrt(30)


# --------------------------------------------------------------------------- #
# INCEPTIONN, SketchML, clipping
# --------------------------------------------------------------------------- #
@settings(max_examples=6)
@given(error_bound=st.sampled_from([1e-4, 0.01, 3.0]), seed=st.integers(0, 2**31 - 1))
def test_inceptionn_error_bound_is_exact(error_bound, seed):
    rng = np.random.default_rng(seed)
    x = (rng.standard_normal((33, 17)) * 10.0 ** rng.uniform(-8, 6, (33, 17))).astype(np.float32)
    y, p, _ = roundtrip("inceptionn", x, error_bound=error_bound)
    delta = 2.0 ** math.floor(math.log2(error_bound))
    assert p.quantum == delta <= error_bound
    xd, yd = x.astype(np.float64), y.astype(np.float64)
    err = np.abs(xd - yd)
    assert np.all(err < delta)  # exact: no tolerance
    assert np.all(np.abs(yd) <= np.abs(xd)) and np.all(yd * xd >= 0)  # truncation toward zero
    q = np.floor(np.abs(xd) / delta)
    np.testing.assert_array_equal(yd, np.sign(xd) * np.where(q < 2**15, q * delta, np.abs(xd)))
    q = q.ravel()
    tags = np.asarray(jc.compressors.unpack(p.tags, 2, x.size))
    np.testing.assert_array_equal(tags, np.select([q < 1, q < 2**7, q < 2**15], [0, 1, 2], 3))


@settings(max_examples=6)
@given(shape=st.sampled_from(SHAPES[1:]), seed=st.integers(0, 2**31 - 1), buckets=st.sampled_from([16, 100]))
def test_sketchml_matches_numpy_sketch(shape, seed, buckets):
    x = sample(shape, seed)
    x.ravel()[: x.size // 4] = 0.0  # ties: a quarter of the entries in one cell
    y, p, _ = roundtrip("sketchml", x, buckets=buckets)
    xf = x.ravel()
    d = xf.size
    # Reference sketch: cells = top 16 bits of the order-preserving key.
    u = xf.view(np.uint32)
    key = np.where(u >> 31 == 1, ~u, u | np.uint32(0x80000000))
    cell = (key >> 16).astype(np.int64)
    counts = np.bincount(cell, minlength=1 << 16)
    before = (np.cumsum(counts) - counts).astype(np.float32)
    cell_bucket = np.minimum(np.floor(before * np.float32(buckets / d)), buckets - 1).astype(np.int64)
    bucket = cell_bucket[cell]
    codes = np.asarray(bitpack.unpack_codes(p.codes, math.ceil(math.log2(buckets)), d))
    np.testing.assert_array_equal(codes, bucket)
    order = np.argsort(xf, kind="stable")
    assert np.all(np.diff(bucket[order]) >= 0)  # buckets are consecutive value ranges
    means = np.array([xf[bucket == b].mean(dtype=np.float64) if (bucket == b).any() else 0.0 for b in range(buckets)])
    np.testing.assert_allclose(np.asarray(p.means), means, rtol=1e-5, atol=1e-7)
    np.testing.assert_allclose(y.ravel(), means[bucket], rtol=1e-5, atol=1e-7)
    # A bucket holds ~d/B entries: at most d/B + 1 plus the largest single cell.
    assert np.bincount(bucket, minlength=buckets).max() <= d / buckets + 1 + counts.max()


@settings(max_examples=6)
@given(seed=st.integers(0, 2**31 - 1), bits=st.sampled_from([0, 10, 23]))
def test_clipping_is_numpy_bit_masking(seed, bits):
    rng = np.random.default_rng(seed)
    x = (rng.standard_normal(50) * 10.0 ** rng.uniform(-40, 37, 50)).astype(np.float32)
    x[:4] = [0.0, -0.0, np.inf, -np.inf]
    y, _, _ = roundtrip("clipping", x, bits=bits)
    mask = np.uint32(0xFFFFFFFF ^ ((1 << (23 - bits)) - 1))
    np.testing.assert_array_equal(y.view(np.uint32), x.view(np.uint32) & mask)
    if bits == 23:
        np.testing.assert_array_equal(y.view(np.uint32), x.view(np.uint32))  # lossless


# --------------------------------------------------------------------------- #
# Non-finite input
# --------------------------------------------------------------------------- #
@pytest.mark.parametrize("name", sorted(QUANTIZERS))
def test_nonfinite_behaviour(name):
    x = sample((7,), 5)
    for bad in (np.nan, np.inf, -np.inf):
        xb = x.copy()
        xb[3] = bad
        y, _, _ = roundtrip(name, xb)
        rest = np.arange(7) != 3
        if name in SCALE_BASED:
            assert np.all(np.isnan(y)), (name, bad)  # documented: a non-finite scale -> all NaN
        elif name in ("signsgd", "signum"):
            assert y[3] == (-1.0 if bad == -np.inf else 1.0)  # NaN and +Inf -> +1
            np.testing.assert_array_equal(y[rest], np.where(xb[rest] < 0, -1.0, 1.0))
        elif name == "natural":
            assert y[3] == (-np.inf if bad == -np.inf else np.inf)  # NaN -> +Inf (its sign bit)
            assert np.all(np.isfinite(y[rest]))
        elif name == "clipping":
            assert np.isnan(y[3]) if np.isnan(bad) else y[3] == bad  # canonical NaN kept for bits >= 1
            assert np.all(np.isfinite(y[rest]))
        elif name == "inceptionn":
            assert np.isnan(y[3]) if np.isnan(bad) else y[3] == bad  # sent raw
            assert np.all(np.abs(y[rest] - xb[rest]) < 0.01)
        else:
            raise AssertionError(name)
    # clipping with no mantissa bit kept turns NaN into Inf (documented).
    xb = x.copy()
    xb[3] = np.nan
    assert roundtrip("clipping", xb, bits=0)[0][3] == np.inf


def test_signum_nan_poisons_its_momentum_entry():
    c = jc.compressors.signum(momentum=0.5)
    g = jnp.asarray(sample((4,), 6)).at[1].set(jnp.nan)
    _, state = c.compress(g)
    payload, state = c.compress(-jnp.ones(4), None, state)
    assert np.isnan(np.asarray(state.momentum)[1]) and np.asarray(c.decompress(payload))[1] == 1.0


# --------------------------------------------------------------------------- #
# Bad input
# --------------------------------------------------------------------------- #
BAD = [
    ("qsgd", dict(levels=0), ValueError, "levels"),
    ("qsgd", dict(levels=2**16 + 1), ValueError, "levels"),
    ("qsgd", dict(levels=2.5), TypeError, "levels"),
    ("onebit", dict(threshold=float("nan")), ValueError, "threshold"),
    ("onebit", dict(threshold="0"), TypeError, "threshold"),
    ("signum", dict(momentum=1.0), ValueError, "momentum"),
    ("signum", dict(momentum=-0.1), ValueError, "momentum"),
    ("inceptionn", dict(error_bound=0.0), ValueError, "error_bound"),
    ("inceptionn", dict(error_bound=float("inf")), ValueError, "error_bound"),
    ("inceptionn", dict(error_bound=1e-45), ValueError, "error_bound"),
    ("sketchml", dict(buckets=1), ValueError, "buckets"),
    ("sketchml", dict(buckets=2**16 + 1), ValueError, "buckets"),
    ("sketchml", dict(buckets=4.0), TypeError, "buckets"),
    ("clipping", dict(bits=24), ValueError, "bits"),
    ("clipping", dict(bits=-1), ValueError, "bits"),
    ("clipping", dict(bits=True), TypeError, "bits"),
    ("stochastic_rounding", dict(bits=0), ValueError, "bits"),
    ("stochastic_rounding", dict(bits=17), ValueError, "bits"),
    ("eightbit", dict(seed=-1), ValueError, "seed"),
    ("terngrad", dict(levels=3), TypeError, "levels"),  # no such hyper-parameter
]


@pytest.mark.parametrize("name,kwargs,exc,match", BAD)
def test_bad_hyperparameters(name, kwargs, exc, match):
    with pytest.raises(exc, match=match):
        jc.compressors.make(name, **kwargs)


@pytest.mark.parametrize("name", sorted(QUANTIZERS))
def test_rejects_integer_and_complex_input(name):
    c = make(name, **QUANTIZERS[name])
    for x in (jnp.arange(4), jnp.ones(4, jnp.complex64)):
        with pytest.raises(TypeError, match="floating"):
            c.compress(x, jax.random.PRNGKey(0))
