"""The MPI backend (MPIComm, mpi4jax inside jit) gives the same numbers as the mesh backend.

One ``mpirun -n 4`` runs every case of ``tests/mpi_scripts/compressed_mean_common.CASES``
(compressed_mean with random-k over allreduce with a shared key, QSGD over
allgather with per-rank keys, Threshold-v's variable-length all-gather, PowerSGD's
two allreduce rounds, DoubleSqueeze, and top-k with a NaN on one process at one
step, which every process skips together)
after checking every MPIComm collective; this process runs the same worker code
inside ``jax.shard_map`` on 4 of its 8 simulated devices and compares.
"""

from __future__ import annotations

import sys
from pathlib import Path

import numpy as np
import pytest

pytestmark = pytest.mark.mpi

pytest.importorskip("mpi4jax", reason="the MPI backend needs mpi4jax (pip install 'jaxcomm[mpi]')")

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE / "mpi_scripts"))
sys.path.insert(0, str(HERE))

import compressed_mean_common as common  # noqa: E402
from mpirun import run_mpi  # noqa: E402


@pytest.fixture(scope="module")
def mpi_results(tmp_path_factory):
    out = tmp_path_factory.mktemp("mpi") / "compressed_mean.npz"
    run_mpi(common.N, HERE / "mpi_scripts" / "compressed_mean_mpi.py", str(out), timeout=600)
    with np.load(out) as z:
        return {k: z[k] for k in z.files}


@pytest.mark.parametrize("case", sorted(common.CASES))
def test_mpi_matches_mesh(case, mpi_results):
    mesh = common.run_mesh(case)
    tol = common.TOLERANCE.get(case, 1e-6)
    for leaf in common.SHAPES:
        got = mpi_results[f"{case}/{leaf}"]
        assert got.shape == (common.N, *common.SHAPES[leaf])
        assert np.isfinite(got).all(), f"{case}/{leaf}: non-finite parameters"
        for r in range(1, common.N):  # every process ends the step with the same parameters
            np.testing.assert_array_equal(got[r], got[0], err_msg=f"{case}/{leaf}: rank {r} diverged")
        np.testing.assert_allclose(got[0], mesh[leaf][0], rtol=tol, atol=tol, err_msg=f"{case}/{leaf}")
        # and the run moved the parameters (the comparison is not between two no-ops)
        assert np.abs(got[0] - common.data()[2][leaf]).max() > 1e-3


@pytest.mark.parametrize("case", sorted({*common.EXACT_CASES, "dgc_exact_allgather"} - {"exact none"}))
def test_exact_settings_train_as_the_uncompressed_mean_over_mpi(case, mpi_results):
    """Every setting the docs call exact, with error feedback, over MPIComm on 4 processes: the
    parameters after the steps equal those of the uncompressed mean (``none``) over MPI, to float32
    rounding of the sums' order (a memory left non-empty would move a later step's parameters)."""
    for leaf in common.SHAPES:
        got, want = mpi_results[f"{case}/{leaf}"], mpi_results[f"exact none/{leaf}"]
        np.testing.assert_allclose(got, want, rtol=1e-6, atol=1e-6, err_msg=f"{case}/{leaf}")


def test_mpicomm_protocol_under_mpirun(mpi_results):
    """sum/mean/all_gather/broadcast/permute/index/varying of MPIComm inside jit on 4 processes
    (float32, uint8, bfloat16 and bool leaves; bad roots and permutations raise), checked in the
    worker script by ``compressed_mean_common.check_protocol``."""
    assert int(mpi_results["protocol_ok"]) == 1


def test_mpirun_env_is_one_cpu_device_per_process():
    from jaxcomm.comm._launch import mpirun_env

    base = {"XLA_FLAGS": "--xla_force_host_platform_device_count=8", "KEEP": "me"}
    env = mpirun_env(base=base)
    assert "XLA_FLAGS" not in env and env["KEEP"] == "me" and env["JAX_PLATFORMS"] == "cpu"
    assert env["OMPI_ALLOW_RUN_AS_ROOT"] == env["OMPI_ALLOW_RUN_AS_ROOT_CONFIRM"] == "1"
    assert env["OMPI_MCA_osc"] == "^ucx" and "OMP_NUM_THREADS" not in env
    assert base["XLA_FLAGS"]  # the caller's dict is not modified
    assert mpirun_env(single_thread=True, base={})["OMP_NUM_THREADS"] == "1"


@pytest.mark.parametrize("n", [3, 4])
def test_mpicomm_reduce_scatter_all_to_all_broadcast_under_mpirun(n):
    """MPIComm's reduce_scatter (float32, int32, uint8, bool; bfloat16/float16 summed in float32),
    all_to_all (with typed PRNG keys) and broadcast from every root, against NumPy in every
    process of ``mpirun -n {3, 4}`` (tests/mpi_scripts/collectives.py)."""
    proc = run_mpi(n, HERE / "mpi_scripts" / "collectives.py", timeout=600)
    assert f"collectives ok on {n} processes" in proc.stdout


@pytest.mark.parametrize("scenario", ["ok", "shape", "dtype"])
def test_compressed_mean_mismatch_is_an_error_naming_the_odd_rank(scenario):
    """compressed_mean (top-k, all-gather) over MPIComm on 3 processes, the last one with 5
    parameters instead of 4 (shape) or float16 instead of float32 (dtype): every process raises
    a ValueError naming rank 2 (and only it) when the step is traced, before any payload moves;
    without a mismatch all three finish with identical parameters
    (tests/mpi_scripts/compressed_mean_mismatch.py)."""
    proc = run_mpi(3, HERE / "mpi_scripts" / "compressed_mean_mismatch.py", scenario, timeout=300)
    lines = [line for line in proc.stdout.splitlines() if line.startswith("rank ")]
    assert len(lines) == 3, proc.stdout[-3000:]
    if scenario == "ok":
        assert all(": OK " in line for line in lines)
        assert len({line.split(": OK ")[1] for line in lines}) == 1
    else:
        for line in lines:
            assert "ValueError: MPIComm: ranks [2] called a collective that does not match" in line, line
