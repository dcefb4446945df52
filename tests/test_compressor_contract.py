"""The contract battery (jaxcomm.testing) over every registered compressor."""

import dataclasses
import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from compressor_examples import EXAMPLE_KWARGS
from hypothesis import given, settings
from hypothesis import strategies as st

import jaxcomm as jc
from jaxcomm import testing
from jaxcomm.compressors import _sparse as SP

TOPK = jc.compressors.topk(ratio=0.3)


@functools.cache
def build(name):
    # One compressor per name, so the checks of test_contract share its compiled round trip
    # (jaxcomm.testing caches it per compressor).
    return jc.compressors.make(name, **EXAMPLE_KWARGS.get(name, {}))


@pytest.mark.parametrize("check", sorted(testing.contract_checks()))
@pytest.mark.parametrize("name", jc.compressors.names())
def test_contract(name, check):
    # Every check reports what it ran, or that it skipped and why: none passes silently.
    outcome = testing.contract_checks()[check](build(name))
    assert isinstance(outcome, str) and outcome.strip(), f"{check} on {name} reported nothing"
    if outcome.startswith(testing.SKIPPED):
        assert len(outcome) > len(testing.SKIPPED) + 10, f"{check} on {name} skipped without a reason: {outcome!r}"


def test_registry_rejects_unknown_name():
    with pytest.raises(ValueError, match="valid names"):
        jc.compressors.make("no-such-compressor")


def test_check_compressor_rejects_non_compressor():
    with pytest.raises(TypeError):
        testing.check_compressor(object())


def test_battery_catches_a_biased_estimator():
    # A deliberately biased "unbiased" compressor (scales by 0.9) must fail the battery.
    base = jc.compressors.none()
    bad = jc.compressors.Compressor(
        name="bad",
        compress_fn=lambda x, k, s: base.compress(0.9 * x, k),
        decompress_fn=base.decompress,
        unbiased=True,
        strategy="allreduce",
    )
    with pytest.raises(AssertionError, match="biased"):
        testing.check_unbiased(bad)


@pytest.mark.parametrize(
    "hook, check, match",
    [
        # A decompress_sum that drops all payloads but the first.
        (
            dict(decompress_sum=lambda g, dtype: TOPK.decompress(jax.tree.map(lambda a: a[0], g)).astype(dtype)),
            testing.check_decompress_sum,
            "decompress_sum differs",
        ),
        # A compression_error that forgets the sent entries (returns x).
        (dict(compression_error=lambda x, p: x), testing.check_compression_error, "compression_error differs"),
    ],
    ids=["decompress_sum", "compression_error"],
)
def test_battery_catches_a_wrong_hook(hook, check, match):
    bad = jc.compressors.Compressor(
        name="bad",
        compress_fn=lambda x, k, s: TOPK.compress(x, k),
        decompress_fn=TOPK.decompress,
        unbiased=False,
        strategy="allgather",
        **hook,
    )
    with pytest.raises(AssertionError, match=match):
        check(bad)


@pytest.mark.parametrize("name", ["topk", "dgc", "threshold", "qsparse"])
def test_sparse_compressors_have_the_fast_hooks(name):
    # The step-overhead benchmark depends on these: one scatter per sum, in-place error.
    c = build(name)
    assert c.decompress_sum is not None and c.compression_error is not None


# --------------------------------------------------------------------------- #
# The battery's power: it rejects what is wrong, naming the check and compressor
# --------------------------------------------------------------------------- #
UNBIASED = [n for n in jc.compressors.names() if build(n).unbiased and n != "none"]


def _wrap(c, *, decode=None, name="bad", **fields):
    """``c`` with its decode post-processed by ``decode`` (and other Compressor fields replaced)."""
    return jc.compressors.Compressor(
        name=name,
        compress_fn=c.compress_fn,
        decompress_fn=(lambda p: decode(c.decompress(p))) if decode else c.decompress,
        unbiased=fields.pop("unbiased", c.unbiased),
        strategy=fields.pop("strategy", c.strategy),
        init_state=c.init_state,
        **fields,
    )


@pytest.mark.parametrize("name", UNBIASED)
def test_battery_catches_a_one_percent_relative_bias(name):
    # E[Q(x)] = 1.01 x: the power the docstring of check_unbiased states (>= 95 % at 1 %).
    with pytest.raises(AssertionError, match="biased"):
        testing.check_unbiased(_wrap(build(name), decode=lambda y: y * 1.01, unbiased=True))


def test_battery_catches_an_offset_of_the_mean():
    # E[Q(x)] = x + 0.04 on every entry (the bias that passed the old per-coordinate test).
    with pytest.raises(AssertionError, match="biased"):
        testing.check_unbiased(_wrap(build("stochastic_rounding"), decode=lambda y: y + 0.04, unbiased=True))


def test_battery_catches_a_false_contraction():
    # top-k keeps k of d entries: δ = k/d is tight on a flat vector, so declaring 2k/d is false.
    c = build("topk")
    bad = dataclasses.replace(c, contraction=lambda d: 2 * c.delta(d), bound="wrong on purpose")
    with pytest.raises(AssertionError, match="violated on the 'flat' input"):
        testing.check_error_bound(bad)


def test_battery_catches_a_false_variance_factor():
    # random sparsification at p = 0.5 has ω = 1 exactly; declaring 0.5 is false.
    c = build("random_sparsification")
    with pytest.raises(AssertionError, match="violated"):
        testing.check_error_bound(dataclasses.replace(c, variance_factor=0.5))


def test_battery_catches_unsummable_payloads_declared_allreduce():
    # Packed sign bits summed as integers do not decode to the sum of the signs.
    sign = jc.compressors.signsgd()
    bad = jc.compressors.Compressor(
        name="bad",
        compress_fn=sign.compress_fn,
        decompress_fn=sign.decompress,
        unbiased=False,
        strategy="allreduce",
    )
    with pytest.raises(AssertionError, match=r"summable|sum of payloads"):
        testing.check_strategy(bad)


def test_battery_names_the_check_and_compressor_of_any_exception():
    # A Python `if` on a traced value inside a candidate compressor fails under jit.
    base = jc.compressors.none()

    def compress(x, key, state):
        if x.sum() > 0:  # not jit-compatible
            return base.compress_fn(x, key, state)
        return base.compress_fn(-x, key, state)

    bad = jc.compressors.Compressor(
        name="candidate", compress_fn=compress, decompress_fn=base.decompress, unbiased=True, strategy="allreduce"
    )
    with pytest.raises(AssertionError, match=r"\[jit_shapes_dtypes\] candidate: TracerBoolConversionError"):
        testing.check_compressor(bad)


@pytest.mark.parametrize("name", jc.compressors.names())
def test_every_builtin_declares_its_bound_or_why_not(name):
    # ω for the unbiased, δ (uniform or data-dependent) for the biased, or no contraction with its
    # reason, and its randomness; and where a bound is declared, check_error_bound checks it
    # (test_contract runs it), where randomness is, check_key_use and check_deterministic do.
    # The factory itself declares them: called directly, not through the registry, it gives the
    # same facts as make() (register() adds nothing: it returns the factory).
    c = build(name)
    direct = getattr(jc.compressors, name)(**EXAMPLE_KWARGS.get(name, {}))
    facts = ("unbiased", "stochastic", "bound", "no_contraction")
    assert [getattr(direct, f) for f in facts] == [getattr(c, f) for f in facts]
    assert [direct.omega(d) for d in (1, 10, 1000)] == [c.omega(d) for d in (1, 10, 1000)]
    assert [direct.delta(d) for d in (1, 10, 1000)] == [c.delta(d) for d in (1, 10, 1000)]
    assert c.stochastic in (True, False), f"{name} does not declare whether it draws from its key"
    assert c.bound, f"{name} declares no bound text"
    if c.unbiased:
        assert c.variance_factor is not None and c.contraction is None
    else:
        assert c.variance_factor is None
        declared = c.contraction is not None or c.local_contraction is not None
        assert declared != bool(c.no_contraction), f"{name}: declare a bound or why there is none, not both"
        if c.no_contraction:
            assert c.bound == f"no contraction: {c.no_contraction}"


SCALED_SIGN = build("scaled_sign")
_SCALED_SIGN_DELTA_AND_ERROR = jax.jit(
    lambda x: (SCALED_SIGN.local_contraction(x), jnp.sum((SCALED_SIGN.roundtrip(x)[0] - x) ** 2))
)


@settings(max_examples=15, deadline=None)
@given(sparse=st.integers(1, 200), seed=st.integers(0, 2**16))
def test_scaled_sign_declares_its_exact_error(sparse, seed):
    # (‖x‖₂/√d) sign(x): ‖Q(x) − x‖² = (2 − 2‖x‖₁/(√d‖x‖₂)) ‖x‖², i.e. δ(x) = 2‖x‖₁/(√d‖x‖₂) − 1 (NumPy),
    # negative for a sparse x, so scaled sign is not a contraction for every x.
    d = 200
    x = np.random.default_rng(seed).normal(size=d).astype(np.float32)
    x[sparse:] *= 1e-3
    want = 2 * np.abs(x).sum() / (np.sqrt(d) * np.linalg.norm(x)) - 1
    delta, err = _SCALED_SIGN_DELTA_AND_ERROR(jnp.asarray(x))
    assert float(delta) == pytest.approx(want, rel=1e-5, abs=1e-6)
    assert float(err) == pytest.approx((1 - want) * float(np.sum(x.astype(np.float64) ** 2)), rel=1e-4)


def test_a_sparse_vector_is_expanded_by_scaled_sign():
    delta, err = _SCALED_SIGN_DELTA_AND_ERROR(jnp.zeros(200).at[0].set(1.0))
    assert float(delta) == pytest.approx(2 / np.sqrt(200) - 1) and float(err) > 1.0


def test_battery_catches_a_false_data_dependent_bound():
    # Scaled sign's δ(x) is exact, so claiming δ(x) + 0.01 is false on every input (deterministic: few draws).
    bad = dataclasses.replace(SCALED_SIGN, local_contraction=lambda x: SCALED_SIGN.local_contraction(x) + 0.01)
    with pytest.raises(AssertionError, match="violated on the 'gaussian' input"):
        testing.check_error_bound(bad, num_samples=8)


def test_declarations_are_exclusive_and_typed():
    base = jc.compressors.none()
    kwargs = dict(
        name="x", compress_fn=base.compress_fn, decompress_fn=base.decompress, unbiased=False, strategy="allreduce"
    )
    with pytest.raises(ValueError, match="declare one or the other"):
        jc.compressors.Compressor(**kwargs, contraction=0.5, no_contraction="why")
    with pytest.raises(TypeError, match="no_contraction must be a string"):
        jc.compressors.Compressor(**kwargs, no_contraction=True)
    with pytest.raises(TypeError, match="local_contraction must be callable"):
        jc.compressors.Compressor(**kwargs, local_contraction=0.5)


# --------------------------------------------------------------------------- #
# Wire bits against the payload's own arrays
# --------------------------------------------------------------------------- #
@jc.compressors.payloads.payload_dataclass
class _ValuesOnlyBits(jc.compressors.payloads.Payload):
    """Top-k's arrays, with a format count that leaves out the indices."""

    values: jax.Array
    indices: jax.Array
    shape: tuple = jc.compressors.payloads.static_field()
    dtype: object = jc.compressors.payloads.static_field()

    def wire_bits(self):
        return int(self.values.size) * 32


@pytest.mark.parametrize("name", ["random_sparsification", "inceptionn"])
def test_inferred_fields_are_implied_by_the_rest(name):
    # The declared exception: the fields a format leaves out must be recoverable from what it sends.
    c = build(name)
    compress = jax.jit(lambda x, k: c.compress(x, k)[0])
    for seed in range(3):
        x = jax.random.normal(jax.random.PRNGKey(seed), (300,)) * 0.02
        p = compress(x, jax.random.PRNGKey(seed + 10))
        if name == "random_sparsification":
            assert type(p).inferred == ("count",)
            bits = np.unpackbits(np.asarray(p.mask), bitorder="little")[:300]
            assert int(p.count) == min(int(bits.sum()), p.values.shape[0])
        else:
            assert type(p).inferred == ("n8", "n16", "n32")
            tags = np.asarray(jc.compressors.unpack(p.tags, 2, 300))
            assert [int(p.n8), int(p.n16), int(p.n32)] == [int(np.sum(tags == k)) for k in (1, 2, 3)]
        assert jc.compressors.payloads.array_bits(p) == int(jc.wire_bits(p))


def test_array_bits_counts_valid_rows_and_whole_arrays():
    # threshold at v = 1 on a known vector: 3 valid rows of (float32 value, uint8 index) + the int32 count.
    x = jnp.array([0.5, 2.0, -3.0, 0.1, 1.5, 0.0, 0.2], jnp.float32)
    p, _ = jc.compressors.threshold(v=1.0).compress(x)
    assert jc.compressors.payloads.array_bits(p) == 3 * (32 + 8) + 32 == int(jc.wire_bits(p))
    q, _ = TOPK.compress(x)
    assert jc.compressors.payloads.array_bits(q) == 2 * (32 + 8)


# --------------------------------------------------------------------------- #
# Planted bugs: the whole battery (check_compressor) catches each, naming the check
# --------------------------------------------------------------------------- #
def _planted():
    base = jc.compressors.none()

    def topk_like(**fields):
        kwargs = dict(compress_fn=TOPK.compress_fn, decompress_fn=TOPK.decompress, contraction=TOPK.contraction)
        return jc.compressors.Compressor(
            name="bad", unbiased=False, strategy="allgather", stochastic=False, **{**kwargs, **fields}
        )

    def values_only(x, key, state):
        p, state = TOPK.compress_fn(x, key, state)
        return _ValuesOnlyBits(values=p.values, indices=p.indices, shape=p.shape, dtype=p.dtype), state

    def unpack(p):
        return TOPK.decompress(SP.SparsePayload(p.values, p.indices, p.shape, p.dtype))

    def keyed(x, key, state):  # "deterministic", but the selection breaks ties with the key
        noise = 1e-3 * jax.random.normal(key, jnp.shape(x))
        idx = TOPK.compress_fn(x + noise.astype(x.dtype), key, state)[0].indices
        flat = jnp.ravel(x)[idx.astype(jnp.int32)]
        return SP.SparsePayload(flat, idx, tuple(np.shape(x)), x.dtype), state

    return {
        "wire_bits": topk_like(compress_fn=values_only, decompress_fn=unpack),
        "unbiased": jc.compressors.Compressor(
            name="bad",
            compress_fn=lambda x, k, s: base.compress_fn(0.98 * x, k, s),
            decompress_fn=base.decompress,
            unbiased=True,
            strategy="allreduce",
            stochastic=False,
            variance_factor=0.01,
        ),
        "key_use": topk_like(compress_fn=keyed),
        "jit_shapes_dtypes": topk_like(decompress_fn=lambda p: TOPK.decompress(p).astype(jnp.float32)),
        "error_bound": topk_like(contraction=lambda d: 2 * TOPK.delta(d)),
    }


# Each planted bug runs only the check it is planted for, at the smallest size that shows it.
_SMALLEST = {
    "wire_bits": lambda c: testing.check_wire_bits(c, shape=(7,)),
    "unbiased": lambda c: testing.check_unbiased(c, num_samples=4000),  # one chunk: the bug has no variance
    "key_use": testing.check_key_use,  # stops at its first input, where the key changes the payload
    "jit_shapes_dtypes": lambda c: testing.check_jit_shapes_dtypes(c, shapes=((7,),), bfloat16_shapes=((7,),)),
    "error_bound": lambda c: testing.check_error_bound(c, num_samples=8),  # deterministic: few draws
}


@pytest.mark.parametrize("check", list(_SMALLEST))
def test_the_battery_catches_a_planted_bug(check):
    # Five kinds of bug, one per compressor: wire bits without the indices (32 k bits reported, 40 k
    # held), a biased "unbiased" estimator (E Q(x) = 0.98 x), a "deterministic" compressor whose
    # payload depends on its key, a decompress that returns float32 for a bfloat16 input, and a
    # contraction δ = 2k/d that top-k violates on a flat vector. The check named catches each.
    match = {
        "wire_bits": r"reports \d+ bits .* but the payload's arrays hold \d+",
        "unbiased": r"biased: E\[Q\(x\)\] ≈ \(1 -0.02",
        "key_use": "declared stochastic=False but two keys give different payloads",
        "jit_shapes_dtypes": "dtype bfloat16 -> float32",
        "error_bound": "violated on the 'flat' input",
    }[check]
    with pytest.raises(AssertionError, match=match):
        _SMALLEST[check](_planted()[check])


def test_check_compressor_names_the_failing_check():
    # The whole battery stops at the first failure and names it (the key check comes after 2 checks it passes).
    with pytest.raises(AssertionError, match=r"^\[key_use\] bad: AssertionError: bad: declared stochastic=False"):
        testing.check_compressor(_planted()["key_use"])


def test_a_compressor_that_declares_no_bound_fails_the_battery():
    bad = jc.compressors.Compressor(
        name="bad", compress_fn=TOPK.compress_fn, decompress_fn=TOPK.decompress, unbiased=False, strategy="allgather"
    )
    with pytest.raises(AssertionError, match="declares no error bound"):
        testing.check_error_bound(bad)


def test_the_report_lists_every_check():
    report = testing.check_compressor(build("signsgd"))
    assert list(report) == list(testing.contract_checks())
    assert report["unbiased"].startswith(testing.SKIPPED + "declared biased")
    assert report["error_bound"].startswith(testing.SKIPPED + "declares no contraction: sign(x) has no scale")
    assert report["error_feedback"].startswith("error_feedback(c) refused (no contraction)")
    assert report["wire_bits"].startswith("wire_bits == bits of the payload's arrays (SignPayload: ")


@settings(max_examples=30, deadline=None)
@given(
    name=st.sampled_from(["qsgd", "terngrad", "random_sparsification", "stochastic_rounding", "natural"]),
    d=st.integers(1, 5000),
)
def test_contractive_declares_delta_one_over_one_plus_omega(name, d):
    c = build(name)
    wrapped = jc.compressors.contractive(c)
    assert not wrapped.unbiased and wrapped.strategy == c.strategy
    assert wrapped.delta(d) == pytest.approx(1.0 / (1.0 + c.omega(d)))


@pytest.mark.parametrize("name", ["qsgd", "random_sparsification"])
def test_contractive_passes_the_battery(name):
    # (test_contract runs every check on the unbiased originals; unbiasedness passes there.)
    wrapped = jc.compressors.contractive(build(name))
    for check in ("error_bound", "error_feedback", "strategy"):
        testing.contract_checks()[check](wrapped)


def test_contractive_keeps_the_wire_format():
    c = build("random_sparsification")
    x = jax.random.normal(jax.random.PRNGKey(0), (500,))
    p_inner, _ = c.compress(x, jax.random.PRNGKey(1))
    p_outer, _ = jc.compressors.contractive(c).compress(x, jax.random.PRNGKey(1))
    assert int(jc.wire_bits(p_inner)) == int(jc.wire_bits(p_outer))
    np.testing.assert_allclose(
        np.asarray(jc.compressors.contractive(c).decompress(p_outer)),
        0.5 * np.asarray(c.decompress(p_inner)),
        rtol=1e-6,
    )


def test_contractive_rejects_what_it_cannot_scale():
    with pytest.raises(ValueError, match="declares no variance factor"):
        jc.compressors.contractive(build("topk"))
    with pytest.raises(TypeError, match="Compressor"):
        jc.compressors.contractive("qsgd")


def test_register_overwrite():
    name = "test-overwrite-compressor"
    factory = lambda: jc.compressors.none()
    assert jc.compressors.register(name)(factory) is factory  # registered as it is: nothing filled in
    with pytest.raises(ValueError, match="overwrite=True"):
        jc.compressors.register(name)(lambda: jc.compressors.fp16())
    jc.compressors.register(name, overwrite=True)(lambda: jc.compressors.fp16())
    assert jc.compressors.make(name).name == "fp16"


def test_dgc_declares_no_delta_it_cannot_keep():
    # 12 entries of 1 and one of 1000 among small noise (d = 1000, k = 10): when 10 < count <= 1.3 k
    # entries pass the sampled threshold, DGC sends the first k in index order and misses the 1000,
    # so E‖x − Q(x)‖²/‖x‖² ≈ 1 − 1e-5 exceeds 1 − 1/d: no δ = 1/d may be declared.
    c = jc.compressors.dgc(ratio=0.01)
    x = np.random.default_rng(0).normal(0, 0.01, 1000).astype(np.float32)
    x[:12] = 1.0
    x[999] = 1000.0
    x = jnp.asarray(x)
    # One compiled program for the 20 draws (keys PRNGKey(0..19)), not 20 eager runs of DGC.
    error_ratio = jax.jit(jax.vmap(lambda k: jnp.sum((x - c.decompress(c.compress(x, k)[0])) ** 2) / jnp.sum(x**2)))
    ratios = np.asarray(error_ratio(jax.vmap(jax.random.PRNGKey)(jnp.arange(20)))).tolist()
    assert max(ratios) > 1 - 1 / 1000  # the input does defeat a 1/d claim
    assert c.delta(1000) is None or max(ratios) <= 1 - c.delta(1000)


def test_stochastic_compressor_requires_a_key():
    # A default key would make two calls the same "random" draw: the library refuses it.
    x = jnp.linspace(-1.0, 1.0, 50)
    with pytest.raises(TypeError, match="pass key= explicitly"):
        jc.compressors.qsgd(levels=4).compress(x)
    with pytest.raises(TypeError, match="pass key= explicitly"):
        jc.compressors.randomk(ratio=0.3).roundtrip(x)
    # Deterministic built-ins need none and give the keyed result.
    c = jc.compressors.topk(ratio=0.3)
    np.testing.assert_array_equal(c.roundtrip(x)[0], c.roundtrip(x, jax.random.PRNGKey(7))[0])


def test_custom_compressor_declares_its_randomness():
    base = jc.compressors.none()
    kwargs = dict(
        name="ident",
        compress_fn=lambda x, k, s: base.compress(x, k),
        decompress_fn=base.decompress,
        unbiased=True,
        strategy="allreduce",
    )
    undeclared = jc.compressors.Compressor(**kwargs)
    assert undeclared.stochastic is None
    with pytest.raises(TypeError, match="key"):
        undeclared.compress(jnp.ones(3))
    declared = jc.compressors.Compressor(**kwargs, stochastic=False)
    declared.compress(jnp.ones(3))
    testing.check_key_use(declared)
    # A false declaration is caught by the battery.
    qsgd = jc.compressors.qsgd(levels=4)
    liar = dataclasses.replace(qsgd, stochastic=False)
    with pytest.raises(AssertionError, match="two keys give different payloads"):
        testing.check_key_use(liar)
    with pytest.raises(TypeError, match="stochastic must be"):
        jc.compressors.Compressor(**kwargs, stochastic="yes")


@pytest.mark.parametrize("seed", [2**32, 2**32 + 5, 2**64])
def test_seeds_that_would_alias_are_refused(seed):
    # Without x64, PRNGKey keeps 32 bits: PRNGKey(2**32) == PRNGKey(0). Such seeds are refused by name.
    with pytest.raises(ValueError, match=r"seed must be below 2\*\*32"):
        jc.compressors.randomk(ratio=0.3, seed=seed)
    from flax import nnx

    from jaxcomm.models import MLP
    from jaxcomm.train import Trainer

    with pytest.raises(ValueError, match=r"seed must be below 2\*\*32"):
        Trainer(MLP(in_features=4, hidden=(2,), num_classes=2, rngs=nnx.Rngs(0)), jc.compressors.none(), seed=seed)


def test_the_largest_seed_gives_its_own_key():
    c = jc.compressors.randomk(ratio=0.3, seed=2**32 - 1)
    state = c.init({"w": jnp.zeros(10)})
    assert not np.array_equal(
        np.asarray(state.key), np.asarray(jc.compressors.randomk(ratio=0.3).init({"w": jnp.zeros(10)}).key)
    )
    with pytest.raises((ValueError, TypeError), match="seed"):
        jc.compressors.randomk(ratio=0.3, seed=-1)
