"""Launch a Python script under ``mpirun -n N`` for the MPI tests."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

from jaxcomm.comm._launch import mpirun_env as _mpirun_env
from jaxcomm.comm._launch import mpirun_path

ROOT = Path(__file__).resolve().parents[1]

__all__ = ["ROOT", "mpirun_env", "mpirun_path", "run_mpi", "suite_xla_flags"]


def suite_xla_flags() -> str:
    """This process's ``XLA_FLAGS`` without the simulated device count: the suite's compile options
    (tests/conftest.py), for a process that sets its own device count."""
    return " ".join(
        f for f in os.environ.get("XLA_FLAGS", "").split() if "xla_force_host_platform_device_count" not in f
    )


def mpirun_env(single_thread: bool = False) -> dict:
    """:func:`jaxcomm.comm._launch.mpirun_env` (one CPU device per process: ``XLA_FLAGS`` removed), with the
    suite's compile options put back, so that an MPI process compiles as the test process that
    checks its results does."""
    env = _mpirun_env(single_thread=single_thread)
    if suite_xla_flags():
        env["XLA_FLAGS"] = suite_xla_flags()
    return env


def run_mpi(n: int, script: str | Path, *args: str, timeout: float = 300.0) -> subprocess.CompletedProcess:
    """Run ``python script args...`` on ``n`` MPI processes; fail the test on non-zero exit.

    Each process sees one CPU device. Returns the completed process (stdout/stderr text).
    """
    mpirun = mpirun_path()
    if mpirun is None:
        pytest.fail("mpirun not found: install the project's 'mpi' extra (pip install -e .[mpi])")
    env = mpirun_env()  # one CPU device per process, the suite's compile options
    env["PYTHONPATH"] = str(ROOT) + os.pathsep + env.get("PYTHONPATH", "")
    cmd = [mpirun, "-n", str(n), "--oversubscribe", sys.executable, str(script), *map(str, args)]
    proc = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=timeout, cwd=ROOT)
    if proc.returncode != 0:
        pytest.fail(
            f"{' '.join(cmd)} exited {proc.returncode}\nstdout:\n{proc.stdout[-4000:]}\nstderr:\n{proc.stderr[-4000:]}"
        )
    return proc
