"""Every registered compressor on extreme inputs: NaN, Inf, huge finite, subnormal, zero, fp16/bf16
extremes, and with ``jax_enable_x64`` on.

One table (``NONFINITE``) holds each compressor's documented policy for a NaN or an Inf entry
(the behaviour its docstring states, and the table in ``docs/guide/compressors.md``); the other
tests assert properties that hold for every compressor: finite in -> finite out where the output
format can represent the values (``CANNOT_REPRESENT`` lists the documented exceptions), exact
scale equivariance ``Q(2^s x) = 2^s Q(x)`` for huge ``2^s``, lossless settings exact on
subnormals. Hyper-parameters come from :mod:`compressor_examples`.
"""

from __future__ import annotations

import subprocess
import sys
import textwrap

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from compressor_examples import EXAMPLE_KWARGS

import jaxcomm as jc

NAMES = jc.compressors.names()
KEY = jax.random.PRNGKey(3)
SHAPE = (64, 64)  # a matrix, so that PowerSGD compresses it (vectors are sent dense)


_BUILT: dict = {}


def make(name, **overrides):
    """The compressor ``name`` (example hyper-parameters), built once per configuration so that its
    jitted round trip compiles once per input shape and dtype."""
    kwargs = {**EXAMPLE_KWARGS.get(name, {}), **overrides}
    cache_key = (name, tuple(sorted(kwargs.items())))
    if cache_key not in _BUILT:
        c = jc.compressors.make(name, **kwargs)
        _BUILT[cache_key] = (c, jax.jit(lambda x, k, c=c: c.roundtrip(x, k)[0]))
    return _BUILT[cache_key]


def roundtrip(c, x, key=KEY):
    return np.asarray(c[1](jnp.asarray(x), key))


def sample(seed=0, shape=SHAPE):
    return np.random.default_rng(seed).standard_normal(shape).astype(np.float32)


# --------------------------------------------------------------------------- #
# NaN and Inf entries
# --------------------------------------------------------------------------- #
POISON = "every entry decodes to NaN"
POISON_INF = "NaN poisons every entry; an Inf makes every entry +-Inf"
ENTRY = "the entry itself decodes to NaN/Inf (when sent), the others stay finite"
NATURAL = "NaN and Inf decode to +-Inf (the sign bit), the others stay finite"
SIGN = "only the sign is sent: NaN and +Inf give +1, -Inf gives -1"
ADAPTIVE = "NaN is never sent (decodes to 0); an Inf makes its sign's mean, hence its sign's kept entries, +-Inf"
KEPT_POISON = "top-k keeps the NaN/Inf; the kept values' norm is then NaN/Inf: every kept entry decodes to NaN"

NONFINITE = {
    "adaptive": ADAPTIVE,
    "bf16": ENTRY,
    "clipping": ENTRY,
    "dgc": ENTRY,
    "efsignsgd": POISON,
    "eightbit": POISON,
    "fp16": ENTRY,
    "inceptionn": ENTRY,
    "natural": NATURAL,
    "none": ENTRY,
    "onebit": POISON,
    "powersgd": POISON,
    "qsgd": POISON,
    "qsparse": KEPT_POISON,
    "random_sparsification": ENTRY,
    "randomk": ENTRY,
    "scaled_sign": POISON_INF,
    "signsgd": SIGN,
    "signum": SIGN,
    "sketchml": POISON,
    "stochastic_rounding": POISON,
    "terngrad": POISON,
    "threshold": ENTRY,
    "topk": ENTRY,
}


def test_table_covers_every_registered_compressor():
    assert sorted(NONFINITE) == NAMES


@pytest.mark.parametrize("bad", [np.nan, np.inf, -np.inf], ids=["nan", "inf", "-inf"])
@pytest.mark.parametrize("name", NAMES)
def test_nonfinite_entry(name, bad):
    x = sample(1)
    pos = (5, 7)
    x[pos] = bad
    c = make(name)
    y = roundtrip(c, x)
    assert y.shape == x.shape and y.dtype == x.dtype
    rest = np.ones(x.shape, bool)
    rest[pos] = False
    policy = NONFINITE[name]
    if policy == POISON:
        assert np.isnan(y).all(), name
    elif policy == POISON_INF:
        if np.isnan(bad):
            assert np.isnan(y).all()
        else:
            assert np.isinf(y).all()
    elif policy == ENTRY:
        assert np.isfinite(y[rest]).all(), name
        if y[pos] != 0:  # sent (a sparsifier may leave it out; top-k and threshold always send it)
            assert np.isnan(y[pos]) if np.isnan(bad) else y[pos] == bad
        if name in ("topk", "threshold", "dgc", "none", "fp16", "bf16", "clipping", "inceptionn"):
            assert np.isnan(y[pos]) if np.isnan(bad) else y[pos] == bad, name
    elif policy == NATURAL:
        assert y[pos] == (-np.inf if bad == -np.inf else np.inf)
        assert np.isfinite(y[rest]).all()
    elif policy == SIGN:
        assert y[pos] == (-1.0 if bad == -np.inf else 1.0)
        assert np.isfinite(y).all()
    elif policy == ADAPTIVE:
        if np.isnan(bad):
            assert y[pos] == 0 and np.isfinite(y).all()
        else:
            assert y[pos] == bad  # the largest of its sign: kept, and the mean is +-Inf
            same_sign_kept = rest & (np.sign(y) == np.sign(bad)) & (y != 0)
            assert np.isinf(y[same_sign_kept]).all()
            other = rest & (np.sign(y) != np.sign(bad))
            assert np.isfinite(y[other]).all()
    elif policy == KEPT_POISON:
        kept = y != 0
        assert np.isnan(y[kept]).all() and kept[pos] and kept.sum() > 1
    else:  # pragma: no cover - the table is checked above
        raise AssertionError(policy)


def test_max_abs_sees_nan_in_large_tensors():
    """XLA:CPU's vectorised max reduction drops NaN; the quantizers' scale must not (issue: eightbit,
    stochastic_rounding and terngrad decoded a NaN input of 4,096 entries to finite values)."""
    from jaxcomm.compressors._quantize import max_abs

    for d in (7, 4096, 100_003):
        x = jnp.ones((d,), jnp.float32).at[d // 3].set(jnp.nan)
        assert np.asarray(jax.jit(max_abs)(x)) == np.inf


# --------------------------------------------------------------------------- #
# Huge finite inputs
# --------------------------------------------------------------------------- #
CANNOT_REPRESENT = {
    # name: why a finite input near the float32 maximum may give a non-finite output
    "qsgd": "the float32 norm ||x|| exceeds the float32 range: NaN (documented)",
    "qsparse": "the float32 norm of the kept values exceeds the float32 range: NaN (documented)",
    "powersgd": "P = M Q exceeds the float32 range: NaN (documented)",
    "natural": "values of at least 2^127 may round up to 2^128, which is Inf (documented)",
    "fp16": "float16 cannot represent values above 65504 (documented)",
}


def _scaled_input(top: float, seed=2, dtype=np.float32):
    """A Gaussian sample scaled by a power of two so that max|x| is in ``[top/2, top)``."""
    x = sample(seed)
    m = np.abs(x).max()
    s = np.exp2(np.floor(np.log2(top / m)))
    return x, s, (x * s).astype(dtype)


@pytest.mark.parametrize("name", NAMES)
def test_huge_finite_inputs_give_finite_outputs(name):
    """``max|x|`` near 1e20 (squares overflow float32) and near 3e38 (sums overflow): finite out."""
    c = make(name)
    for top in (1e20, 3e38):
        _, _, x = _scaled_input(top)
        y = roundtrip(c, x)
        if name in CANNOT_REPRESENT and (top > 1e30 or name == "fp16"):
            continue
        assert np.isfinite(y).all(), (name, top)


EQUIVARIANT = sorted(set(NAMES) - {"fp16", "signsgd", "signum", "threshold", "inceptionn", "random_sparsification"})
"""``Q(2^s x) = 2^s Q(x)`` bit for bit (same key) while nothing overflows or underflows: every
compressor whose decisions depend on x only through ratios to its own scale (threshold and
inceptionn use absolute hyper-parameters; signs are scale-free; random sparsification's ``x / p``
saturates near the top)."""


@pytest.mark.parametrize("name", EQUIVARIANT)
def test_power_of_two_scale_equivariance_for_huge_inputs(name):
    """No overflow inside the scale, norm or mean: the huge tensor is quantised exactly as the
    unit one (issue: qsgd/qsparse gave NaN for entries ~1e20, PowerSGD all zeros)."""
    c = make(name)
    x = sample(4)
    base = roundtrip(c, x)
    tops = [2.0**66] + ([] if name in CANNOT_REPRESENT else [2.0**122])
    for s in tops:
        y = roundtrip(c, (x * np.float32(s)).astype(np.float32))
        want = (base.astype(np.float64) * s).astype(np.float32)
        if name in SUM_ORDER_VARIES:
            np.testing.assert_allclose(y, want, rtol=4 * np.finfo(np.float32).eps, atol=0, err_msg=f"{name} {s}")
        else:
            np.testing.assert_array_equal(y, want, err_msg=f"{name} {s}")


# The scale is a float32 sum over the tensor computed in one pass with the sign bits
# (bitpack.pack_reduce); XLA:CPU orders that reduction differently depending on what it is fused
# with (the decode in the round trip, or the overflow branch's rescaled pass), so the rescaled
# result may differ from the unit one by an ulp of the sum: equal to 4 ulps, not bit for bit.
SUM_ORDER_VARIES = {"efsignsgd"}


def test_powersgd_rank_one_huge_matrix_is_reconstructed():
    u = np.random.default_rng(5).standard_normal((64, 1))
    v = np.random.default_rng(6).standard_normal((1, 48))
    m = (u @ v * 1e30).astype(np.float32)
    y = roundtrip(make("powersgd", matrix_approximation_rank=1), m)
    np.testing.assert_allclose(y, m, rtol=1e-4, atol=1e-4 * np.abs(m).max())


# --------------------------------------------------------------------------- #
# fp16 / bf16 extremes
# --------------------------------------------------------------------------- #
@pytest.mark.parametrize("name", NAMES)
@pytest.mark.parametrize("dtype", ["float16", "bfloat16"])
def test_half_precision_extremes_stay_finite(name, dtype):
    """Inputs up to the dtype's maximum (65504; ~3.39e38): decoded values beyond the dtype's
    range (QSGD's ``||x||/s`` multiples, ``x / p``, natural's round-up) saturate at its largest
    finite value instead of overflowing to Inf (issue: qsparse, random_sparsification near 3e4)."""
    dt = jnp.dtype(dtype)
    top = float(jnp.finfo(dt).max)
    x = sample(7)
    x = x / np.abs(x).max() * top * 0.999
    xd = jnp.asarray(x).astype(dt)
    for p_name, kw in [(name, {})] + (
        [("random_sparsification", dict(p=0.1))] if name == "random_sparsification" else []
    ):
        c = make(p_name, **kw)
        y = roundtrip(c, xd)
        assert y.dtype == dt
        y32 = y.astype(np.float32)
        if dtype == "bfloat16" and name in CANNOT_REPRESENT and name != "fp16":
            continue  # norms and P beyond float32, natural's 2^128 (documented)
        if name == "fp16" and dtype == "bfloat16":
            continue  # float16 cannot hold bfloat16's range
        assert np.isfinite(y32).all(), (name, dtype)


def test_saturation_is_towards_the_input():
    """Saturated values are clipped to the dtype's range, so the error never grows."""
    from jaxcomm.compressors._primitives import saturate

    v = jnp.asarray([1e5, -1e5, 3.0, np.inf, -np.inf, np.nan], jnp.float32)
    out = np.asarray(saturate(v, jnp.float16).astype(jnp.float16)).astype(np.float32)
    np.testing.assert_array_equal(out[:5], [65504.0, -65504.0, 3.0, np.inf, -np.inf])
    assert np.isnan(out[5])
    assert saturate(v, jnp.float32) is v


# --------------------------------------------------------------------------- #
# Subnormals and zeros
# --------------------------------------------------------------------------- #
LOSSLESS = {
    "none": {},
    "topk": dict(ratio=1.0),
    "threshold": dict(v=0.0),
    "randomk": dict(ratio=1.0),
    "random_sparsification": dict(p=1.0),
    "dgc": dict(ratio=1.0),
    "clipping": dict(bits=23),
    "adaptive": None,  # not lossless (means): listed to keep the table complete
}


@pytest.mark.parametrize("name", sorted(k for k, v in LOSSLESS.items() if v is not None))
@pytest.mark.parametrize("d", [300, 5000])
def test_lossless_settings_keep_subnormals(name, d):
    """Lossless settings decode subnormals bit for bit: sparse payloads are written into the
    output (a scatter-set), not added to zeros, which XLA:CPU would flush."""
    rng = np.random.default_rng(8)
    x = rng.standard_normal(d).astype(np.float32)
    x[::3] *= np.float32(1e-39)  # subnormal (float32's smallest normal is ~1.18e-38)
    x[1::7] = np.float32(1.4e-45) * np.sign(x[1::7])  # the smallest subnormal
    assert (np.abs(x[::3]) < np.finfo(np.float32).tiny).all()
    c = make(name, **LOSSLESS[name])
    y = roundtrip(c, x)
    np.testing.assert_array_equal(y.view(np.uint32), x.view(np.uint32))


def test_xla_cpu_flushes_subnormal_arithmetic():
    """The XLA:CPU property behind the remaining flushes: a subnormal result of arithmetic (here
    ``0 + x`` in a scatter-add, as in the sum of several payloads) is flushed to zero, and a
    subnormal operand reads as zero (``x > 0`` is false). Lossy quantizers (their scales and
    divisions) therefore decode subnormal inputs to zero; a scatter-set keeps them."""
    if jax.default_backend() != "cpu":
        pytest.skip("XLA:CPU property")
    x = jnp.full((4,), 1e-40, jnp.float32)
    idx = jnp.arange(4)
    assert not np.asarray(jax.jit(lambda v: jnp.zeros(4).at[idx].add(v))(x)).any()
    assert not np.asarray(jax.jit(lambda v: v > 0)(x)).any()
    np.testing.assert_array_equal(np.asarray(jax.jit(lambda v: jnp.zeros(4).at[idx].set(v))(x)), np.asarray(x))


@pytest.mark.parametrize("name", NAMES)
def test_subnormal_and_zero_inputs_give_finite_outputs(name):
    """Zeros decode to zeros (signs: +1); subnormal input to finite values no larger than float32's
    smallest normal ``2^-126`` (natural compression's unbiased round-up; 0 or exact elsewhere)."""
    c = make(name)
    signs = name in ("signsgd", "signum")  # sign(0) and sign(subnormal) are sent as +-1
    y = roundtrip(c, np.zeros(SHAPE, np.float32))
    assert np.array_equal(np.abs(y), np.ones(SHAPE)) if signs else not y.any(), name
    y = roundtrip(c, sample(9) * np.float32(1e-40))
    assert np.isfinite(y).all(), name
    if not signs:
        assert (np.abs(y) <= np.float32(2.0**-126)).all(), name


# --------------------------------------------------------------------------- #
# jax_enable_x64
# --------------------------------------------------------------------------- #
X64_CASES = sorted(NAMES) + ["topk:0.01", "randomk:0.01", "dgc:0.01", "adaptive:0.01", "qsparse:0.01"]

_X64_SCRIPT = textwrap.dedent(
    """
    import sys, json
    import jax, jax.numpy as jnp, numpy as np
    sys.path.insert(0, "tests")
    from compressor_examples import EXAMPLE_KWARGS
    import jaxcomm as jc

    def build(case):
        name, _, ratio = case.partition(":")
        kw = dict(EXAMPLE_KWARGS.get(name, {}))
        if ratio:
            kw["ratio"] = float(ratio)
        return jc.compressors.make(name, **kw)

    cases = sys.argv[1].split(",")
    x32 = np.random.default_rng(0).standard_normal((100, 50)).astype(np.float32)  # 5000 > 2048 entries
    key = jax.random.PRNGKey(1)
    # One program per phase with every case in it (compiling 29 small programs apiece costs more).
    # x64 off: the reference outputs for float32.
    ref = jax.jit(lambda x, k: {case: build(case).roundtrip(x, k)[0] for case in cases})(jnp.asarray(x32), key)
    errors = {}
    with jax.enable_x64(True):

        def one(case, x, k):  # compress, decompress, error, sum decoding and bits
            c = build(case)
            payload, _ = c.compress(x, k)
            y = c.decompress(payload)
            stacked = jax.tree.map(lambda a: jnp.stack([a, a]), payload)
            total = c.decompress_sum(stacked, y.dtype) if c.decompress_sum else y + y
            return y, c.error(x, payload), total, jc.BitCount.of(jc.compressors.wire_bits(payload))

        @jax.jit
        def run(xs, k):  # {dtype: x} -> {case: {dtype: outputs}}; a case that fails to trace is reported
            res = {}
            for case in cases:
                try:
                    res[case] = {dt: one(case, x, k) for dt, x in xs.items()}
                except Exception as e:  # noqa: BLE001 - reported per case, the others still run
                    errors[case] = f"{type(e).__name__}: {e}"
            return res

        outs = run({dt: jnp.asarray(x32.astype(dt)) for dt in ("float32", "float64")}, key)
        out = {case: {"error": msg} for case, msg in errors.items()}
        for case, per_dt in outs.items():
            res = {}
            for dt, (y, err, total, bits) in per_dt.items():
                x = x32.astype(dt)
                y = np.asarray(y)
                r32 = np.asarray(ref[case])
                res[dt] = dict(
                    dtype=str(y.dtype), shape=list(y.shape), finite=bool(np.isfinite(y).all()),
                    err_ok=bool(np.allclose(np.asarray(err), x - y, atol=1e-5)),
                    sum_ok=bool(np.allclose(np.asarray(total), 2 * y, rtol=1e-5, atol=1e-5)),
                    bits=int(bits),
                    same_as_x32=bool(np.array_equal(y.astype(np.float32), r32)) if dt == "float32" else None,
                    close_to_x32=bool(np.allclose(y, r32, rtol=1e-3, atol=1e-3)),
                )
            out[case] = res
    print(json.dumps(out))
    """
)


@pytest.fixture(scope="module")
def x64_results():
    """Run every case once in a subprocess with x64 on (the flag cannot leak into this process)."""
    import json

    proc = subprocess.run(
        [sys.executable, "-c", _X64_SCRIPT, ",".join(X64_CASES)], capture_output=True, text=True, timeout=900
    )
    assert proc.returncode == 0, proc.stderr[-4000:]
    return json.loads(proc.stdout.strip().splitlines()[-1])


@pytest.mark.parametrize("case", X64_CASES)
def test_every_compressor_works_with_x64(case, x64_results):
    """With ``jax_enable_x64`` on, float32 and float64 tensors of 5,000 entries compress and decode
    under jit (issue: top-k, random-k, DGC, adaptive and qsparse crashed: int32 vs int64 cond
    branches), keep their dtype, match the float32 result without x64, and their error and
    sum-decoding hooks agree with decompress."""
    res = x64_results[case]
    assert "error" not in res, (case, res.get("error"))
    for dt in ("float32", "float64"):
        r = res[dt]
        assert r["dtype"] == dt and r["shape"] == [100, 50], (case, r)
        assert r["finite"] and r["err_ok"] and r["sum_ok"], (case, dt, r)
        assert r["bits"] > 0
    assert res["float32"]["same_as_x32"], case
    assert res["float64"]["close_to_x32"], case


def test_x64_does_not_leak():
    assert not jax.config.jax_enable_x64
    assert jnp.asarray(1.0).dtype == jnp.float32
