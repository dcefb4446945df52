"""Shared helpers of the eager-SGD MPI worker scripts (run under ``mpirun``).

The workers load ``jaxcomm/comm/_partial_mpi.py`` straight from its file, so
each process imports only NumPy and mpi4py (about 40 MB and 0.2 s) instead of
the whole ``jaxcomm`` package with JAX (about 200 MB and 1.5 s of CPU each).
The module has no package-relative imports, so this is the same code the
package exports.
"""

from __future__ import annotations

import importlib.util
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]


def load_partial_mpi():
    """Import ``jaxcomm.comm._partial_mpi`` without importing ``jaxcomm``."""
    name = "jaxcomm_partial_mpi_standalone"
    if name in sys.modules:
        return sys.modules[name]
    spec = importlib.util.spec_from_file_location(name, ROOT / "jaxcomm" / "comm" / "_partial_mpi.py")
    mod = importlib.util.module_from_spec(spec)
    sys.modules[name] = mod
    spec.loader.exec_module(mod)
    return mod
