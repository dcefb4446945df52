"""Test configuration: 8 simulated CPU devices, set before jax is imported.

Strict dtype promotion: ``JAXCOMM_STRICT_PROMOTION=1`` runs every test under
``jax_numpy_dtype_promotion="strict"`` (no implicit int->float, f32+f64, weak-type
surprises); tests marked ``@pytest.mark.standard_promotion`` (deliberately mixed
dtypes) run under "standard". The environment variable is exported, so the
subprocesses the tests start (scripts, mpirun) inherit it. Default: off, until the
library passes under it (the switch's status and the remaining breaks are listed in
docs / the habits report); turn it on by default by changing ``_STRICT_DEFAULT``.
"""

import os

import pytest

_STRICT_DEFAULT = "0"

os.environ.setdefault("XLA_FLAGS", "--xla_force_host_platform_device_count=8")
os.environ.setdefault("OMPI_MCA_osc", "^ucx")
os.environ.setdefault("JAX_PLATFORMS", "cpu")
STRICT_PROMOTION = os.environ.setdefault("JAXCOMM_STRICT_PROMOTION", _STRICT_DEFAULT) == "1"
if STRICT_PROMOTION:
    os.environ["JAX_NUMPY_DTYPE_PROMOTION"] = "strict"

import jax  # noqa: E402  (after the XLA/JAX environment above)
from hypothesis import settings  # noqa: E402

if STRICT_PROMOTION:
    jax.config.update("jax_numpy_dtype_promotion", "strict")

settings.register_profile("ci", max_examples=25, deadline=None, derandomize=True, print_blob=True)
settings.load_profile("ci")


@pytest.fixture(autouse=True)
def _standard_promotion_if_marked(request):
    """Run a test marked ``standard_promotion`` under jax's standard dtype promotion."""
    if STRICT_PROMOTION and request.node.get_closest_marker("standard_promotion") is not None:
        with jax.numpy_dtype_promotion("standard"):
            yield
    else:
        yield
