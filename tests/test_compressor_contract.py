"""The contract battery (jaxcomm.testing) over every registered compressor."""

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
        name="bad", compress=lambda x, k, s: base.compress(0.9 * x, k), decompress=base.decompress,
        unbiased=True, strategy="allreduce",
    )
    with pytest.raises(AssertionError, match="biased"):
        testing.check_unbiased(bad)
