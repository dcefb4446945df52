"""Test configuration: 8 simulated CPU devices and XLA's CPU backend at -O0, set before jax is imported.

Strict dtype promotion (``jax_numpy_dtype_promotion="strict"``: no implicit
int->float, f32+f64 or weak-type surprises) runs where it holds: every test of a
module marked ``pytestmark = pytest.mark.strict_promotion``, or every test when
``JAXCOMM_STRICT_PROMOTION=1`` (exported, so the scripts and mpirun jobs the tests
start inherit it). A test marked ``@pytest.mark.standard_promotion`` (deliberately
mixed dtypes) always runs under "standard".
"""

import os

import pytest

os.environ.setdefault("XLA_FLAGS", "--xla_force_host_platform_device_count=8")
# LLVM at -O0 in XLA's CPU backend: the suite's programs are small and each runs a few times, so
# compiling them is most of the suite's CPU time, and -O0 compiles them in about half of it (the
# same HLO, the same IEEE float operations in the same order; no instruction fusion such as FMA
# contraction). Exported, so every process the tests start compiles the same way (tests/mpirun.py
# keeps it for the MPI jobs, whose environment drops XLA_FLAGS for the device count).
if "xla_backend_optimization_level" not in os.environ["XLA_FLAGS"]:
    os.environ["XLA_FLAGS"] += " --xla_backend_optimization_level=0"
os.environ.setdefault("OMPI_MCA_osc", "^ucx")
os.environ.setdefault("JAX_PLATFORMS", "cpu")
# The repository's studies, wherever a test runs from (some change into a temporary folder first).
os.environ.setdefault("JAXCOMM_EXPERIMENTS", os.path.join(os.path.dirname(os.path.dirname(__file__)), "experiments"))
STRICT_PROMOTION = os.environ.get("JAXCOMM_STRICT_PROMOTION", "0") == "1"
if STRICT_PROMOTION:
    os.environ["JAX_NUMPY_DTYPE_PROMOTION"] = "strict"

import jax  # noqa: E402  (after the XLA/JAX environment above)
from hypothesis import settings  # noqa: E402

if STRICT_PROMOTION:
    jax.config.update("jax_numpy_dtype_promotion", "strict")

settings.register_profile("ci", max_examples=25, deadline=None, derandomize=True, print_blob=True)
settings.load_profile("ci")


@pytest.fixture(autouse=True)
def _dtype_promotion(request):
    """Strict promotion for ``strict_promotion`` modules (or everywhere), standard where marked so."""
    strict = STRICT_PROMOTION or request.node.get_closest_marker("strict_promotion") is not None
    if request.node.get_closest_marker("standard_promotion") is not None:
        strict = False
    with jax.numpy_dtype_promotion("strict" if strict else "standard"):
        yield


# --------------------------------------------------------------------------- #
# Emulated networks (jaxcomm.netem): tests that need a private network namespace
# --------------------------------------------------------------------------- #
_CAN: list = []


def _can_make_namespaces() -> str | None:
    """``None`` if this machine can make a private network namespace with a qdisc, else why not."""
    if not _CAN:
        from jaxcomm import netem

        _CAN.append(netem.unavailable())
    return _CAN[0]


@pytest.fixture
def namespaces():
    """Skip the test where no private network namespace with a shaped loopback can be made."""
    why = _can_make_namespaces()
    if why:
        pytest.skip(why)
