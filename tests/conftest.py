"""Test configuration: 8 simulated CPU devices, set before jax is imported."""

import os

os.environ.setdefault("XLA_FLAGS", "--xla_force_host_platform_device_count=8")
os.environ.setdefault("OMPI_MCA_osc", "^ucx")
os.environ.setdefault("JAX_PLATFORMS", "cpu")

from hypothesis import settings  # noqa: E402

settings.register_profile("ci", max_examples=25, deadline=None, derandomize=True, print_blob=True)
settings.load_profile("ci")
