"""EventGraD over MPI: one-sided RMA puts under ``mpirun -n 4`` against the mesh backend,
and its faults (hung rank, slow rank, shape mismatch) under ``mpirun -n 3``."""

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
from mpirun import ROOT, mpirun_env, mpirun_path, run_mpi

SCRIPTS = Path(__file__).parent / "mpi_scripts"


@pytest.mark.mpi
def test_one_sided_eventgrad_equals_mesh_backend_under_mpirun():
    # The script asserts, on every rank: lockstep one-sided parameters == EventGrad.step on a
    # vmap axis (paper rule, and top-K with the code's threshold rule), identical event counts,
    # and puts == fired events x 2 (ring) in both lockstep and asynchronous runs; D-PSGD and
    # EventGraD with mpi4jax sendrecv (MPIComm) inside jit == the same on the vmap axis.
    proc = run_mpi(4, SCRIPTS / "eventgrad_rma.py", timeout=400)
    report = json.loads(proc.stdout.strip().splitlines()[-1])
    steps, tensors, workers = 12, 4, 4
    for name in ("full", "topk_code_rule"):
        # Events happened, and not every tensor every time (else nothing would be tested).
        assert workers * tensors <= report[name]["events"] < steps * tensors * workers
    assert report["two_sided"] == "ok"
    assert len(report["async_puts"]) == workers
    # Forced iterations (3) x 4 tensors x 2 neighbours at least, on every rank.
    assert all(p >= 3 * tensors * 2 and p % 2 == 0 for p in report["async_puts"])


def run_rma_faults(scenario: str, lockstep: bool, timeout_s: float = 2.0):
    """tests/mpi_scripts/rma_faults.py on 3 processes; the culprit is rank 2. Not failed on rc != 0."""
    env = mpirun_env()
    env["PYTHONPATH"] = str(ROOT) + os.pathsep + env.get("PYTHONPATH", "")
    cmd = [mpirun_path(), "-n", "3", "--oversubscribe", sys.executable, str(SCRIPTS / "rma_faults.py")]
    cmd += [scenario, "1" if lockstep else "0", str(timeout_s)]
    # Backstop only: a job that does not end by itself fails the test, never hangs the suite.
    return subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=90, cwd=ROOT)


@pytest.mark.mpi
def test_one_sided_slow_rank_only_slows_and_with_usage_exits_cleanly():
    # The last rank sleeps timeout/3 before a lockstep step: no accusation, exit status 0.
    proc = run_rma_faults("slow", lockstep=True)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert sorted(line for line in proc.stdout.splitlines() if "done" in line) == [f"rank {r} done" for r in range(3)]


@pytest.mark.mpi
@pytest.mark.parametrize("lockstep", [True, False])
def test_one_sided_hung_rank_is_named_and_ends_the_job(lockstep):
    # Lockstep: caught at the next barrier; asynchronous: the others keep going and catch it at free.
    proc = run_rma_faults("hang", lockstep=lockstep)
    assert proc.returncode != 0
    lines = [ln for ln in proc.stderr.replace("\0", "").splitlines() if ln.startswith("jaxcomm: rank ")]
    assert lines, proc.stderr[-3000:]
    for line in lines:
        assert "RMAExchangeTimeout" in line and "missing ranks [2]:" in line, line
        assert ("lockstep" in line) == lockstep and ("(free)" in line) == (not lockstep), line


@pytest.mark.mpi
def test_one_sided_shape_mismatch_is_rejected_naming_the_odd_rank():
    proc = run_rma_faults("shape", lockstep=False)
    assert proc.returncode != 0
    errors = [ln for ln in proc.stderr.splitlines() if ln.startswith("ValueError: RMAExchange: ranks ")]
    assert len(errors) == 3, proc.stderr[-3000:]
    assert all(line.startswith("ValueError: RMAExchange: ranks [2] constructed") for line in errors)
