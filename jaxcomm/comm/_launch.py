"""Launching single-node ``mpirun`` jobs: where ``mpirun`` is, and the environment it needs.

Used by the experiments and the test suite that start MPI processes
themselves (``mpirun -n N --oversubscribe python script.py``): more processes
than cores, possibly as root, on one machine.
"""

from __future__ import annotations

import os
import shutil
import sys
from pathlib import Path

__all__ = ["mpirun_path", "mpirun_env"]


def mpirun_path() -> str | None:
    """Path of ``mpirun``: the one next to the interpreter (Open MPI from PyPI), else on ``PATH``, else ``None``."""
    here = Path(sys.executable).parent / "mpirun"
    return str(here) if here.exists() else shutil.which("mpirun")


def mpirun_env(single_thread: bool = False, base: dict | None = None) -> dict:
    """Environment for an oversubscribed single-node Open MPI job with one CPU JAX device per process.

    Sets: running as root allowed (``OMPI_ALLOW_RUN_AS_ROOT``,
    ``..._CONFIRM``); the ob1 PML over shared memory and TCP
    (``OMPI_MCA_pml=ob1``, ``OMPI_MCA_btl=self,vader,tcp``); no UCX one-sided
    component (``OMPI_MCA_osc=^ucx``, which only warns here); oversubscription
    (``OMPI_MCA_rmaps_base_oversubscribe``, ``PRTE_MCA_rmaps_default_mapping_policy``);
    ``JAX_PLATFORMS=cpu``; and removes ``XLA_FLAGS`` so that a simulated
    multi-device flag of the parent does not give every process 8 devices.

    Args:
      single_thread: also one OpenMP/BLAS thread per process
        (``OMP_NUM_THREADS``, ``OPENBLAS_NUM_THREADS``, ``MKL_NUM_THREADS`` = 1),
        for jobs with many processes per core.
      base: the environment to start from (default: a copy of ``os.environ``).
    Returns:
      a new ``dict`` for ``subprocess.run(..., env=...)``.
    """
    env = dict(os.environ if base is None else base)
    env.update(
        OMPI_ALLOW_RUN_AS_ROOT="1",
        OMPI_ALLOW_RUN_AS_ROOT_CONFIRM="1",
        OMPI_MCA_osc="^ucx",
        OMPI_MCA_pml="ob1",
        OMPI_MCA_btl="self,vader,tcp",
        OMPI_MCA_rmaps_base_oversubscribe="1",
        PRTE_MCA_rmaps_default_mapping_policy=":oversubscribe",
        JAX_PLATFORMS="cpu",
    )
    if single_thread:
        env.update(OMP_NUM_THREADS="1", OPENBLAS_NUM_THREADS="1", MKL_NUM_THREADS="1")
    env.pop("XLA_FLAGS", None)
    return env
