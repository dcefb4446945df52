#!/usr/bin/env bash
# The test suite: set up (idempotent: .venv, dependencies, data), then pytest on two
# worker processes (pytest-xdist), one test file per worker at a time so each file's
# jit-compiled functions and module fixtures are reused by its tests.
# Extra arguments go to pytest (later options win, e.g. `-n 0` runs in-process).
set -euo pipefail
cd "$(dirname "${BASH_SOURCE[0]}")/.."
bash scripts/setup.sh
exec .venv/bin/python -m pytest -n 2 --dist loadfile "$@"
