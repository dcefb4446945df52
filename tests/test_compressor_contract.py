"""The contract battery (jaxcomm.testing) over every registered compressor."""

import jax
import pytest

import jaxcomm as jc
from jaxcomm import testing

# Small-tensor-friendly hyper-parameters for each registered name; a name
# missing here is built with its defaults.
EXAMPLE_KWARGS = {
    "qsgd": dict(levels=4),
    "randomk": dict(ratio=0.3),
    "topk": dict(ratio=0.3),
    "threshold": dict(v=0.5),
    "dgc": dict(ratio=0.3),
    "adaptive": dict(ratio=0.3),
    "powersgd": dict(matrix_approximation_rank=2),
    "qsparse": dict(ratio=0.3, levels=4),
    "random_sparsification": dict(p=0.5),
    "clipping": dict(bits=8),
    "stochastic_rounding": dict(bits=4),
    "sketchml": dict(buckets=16),
    "inceptionn": dict(error_bound=0.01),
}


TOPK = jc.compressors.topk(ratio=0.3)


def build(name):
    return jc.compressors.make(name, **EXAMPLE_KWARGS.get(name, {}))


@pytest.mark.parametrize("check", sorted(testing.contract_checks()))
@pytest.mark.parametrize("name", jc.compressors.names())
def test_contract(name, check):
    testing.contract_checks()[check](build(name))


def test_registry_rejects_unknown_name():
    with pytest.raises(ValueError, match="valid names"):
        jc.compressors.make("no-such-compressor")


def test_check_compressor_rejects_non_compressor():
    with pytest.raises(TypeError):
        testing.check_compressor(object())


def test_battery_catches_a_biased_estimator():
    # A deliberately biased "unbiased" compressor (scales by 0.9) must fail the battery.
    base = jc.compressors.none()
    bad = jc.compressors.Compressor.create(
        name="bad",
        compress=lambda x, k, s: base.compress(0.9 * x, k),
        decompress=base.decompress,
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
    bad = jc.compressors.Compressor.create(
        name="bad",
        compress=lambda x, k, s: TOPK.compress(x, k),
        decompress=TOPK.decompress,
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
