"""Shared helpers of the eager-SGD MPI worker scripts (run under ``mpirun``).

The workers load ``jaxcomm/comm/_partial_mpi.py`` straight from its file, so
each process imports only NumPy and mpi4py (about 40 MB and 0.2 s) instead of
the whole ``jaxcomm`` package with JAX (about 200 MB and 1.5 s of CPU each).
Its package-relative imports -- ``jaxcomm._validate`` and its two sibling modules
``_partial_protocol`` and ``_partial_progress`` (NumPy and mpi4py only) -- resolve
inside stand-in packages whose modules are loaded from the same files, so this
is the same code the package exports.
"""

from __future__ import annotations

import importlib.util
import sys
import types
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]


def load_partial_mpi():
    """Import ``jaxcomm.comm._partial_mpi`` without importing ``jaxcomm`` (nor JAX).

    The module is loaded as ``jaxcomm_standalone.comm._partial_mpi`` under two stand-in
    packages whose ``__path__`` is the real folders but whose ``__init__`` never runs, so its
    ``from .._validate import ...`` loads ``jaxcomm/_validate.py`` alone, and its
    ``from ._partial_progress import ...`` (which imports ``._partial_protocol``) the sibling
    files of ``jaxcomm/comm/`` alone."""
    name = "jaxcomm_standalone.comm._partial_mpi"
    if name in sys.modules:
        return sys.modules[name]
    for package, folder in (
        ("jaxcomm_standalone", ROOT / "jaxcomm"),
        ("jaxcomm_standalone.comm", ROOT / "jaxcomm" / "comm"),
    ):
        stand_in = types.ModuleType(package)
        stand_in.__path__ = [str(folder)]
        sys.modules.setdefault(package, stand_in)
    spec = importlib.util.spec_from_file_location(name, ROOT / "jaxcomm" / "comm" / "_partial_mpi.py")
    mod = importlib.util.module_from_spec(spec)
    sys.modules[name] = mod
    spec.loader.exec_module(mod)
    return mod
