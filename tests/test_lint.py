"""The tree passes ruff (lint and format) and mypy, with the configuration in pyproject.toml.

The tools come with the ``test`` extra; a missing tool fails here (it is not skipped).
Fix with ``ruff check --fix jaxcomm tests experiments scripts`` then
``ruff format jaxcomm tests experiments scripts``; mypy's errors need hand fixes.
"""

import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
PATHS = ["jaxcomm", "tests", "experiments", "scripts"]

pytestmark = pytest.mark.lint


def _run(*args: str, timeout: float) -> subprocess.CompletedProcess:
    proc = subprocess.run(
        [sys.executable, "-m", *args], cwd=ROOT, capture_output=True, text=True, timeout=timeout, check=False
    )
    if "No module named" in proc.stderr and proc.returncode != 0:
        pytest.fail(f"{args[0]} is not installed (pip install -e '.[test]'):\n{proc.stderr}")
    return proc


def test_ruff_check():
    proc = _run("ruff", "check", "--no-cache", *PATHS, timeout=120)
    assert proc.returncode == 0, f"ruff check found problems:\n{proc.stdout}{proc.stderr}"


def test_ruff_format():
    proc = _run("ruff", "format", "--check", "--no-cache", *PATHS, timeout=120)
    assert proc.returncode == 0, f"ruff format would reformat:\n{proc.stdout}{proc.stderr}"


def test_mypy():
    # Packages and options come from [tool.mypy] in pyproject.toml.
    proc = _run("mypy", "--no-incremental", timeout=900)
    assert proc.returncode == 0, f"mypy found type errors:\n{proc.stdout}{proc.stderr}"
