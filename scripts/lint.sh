#!/usr/bin/env bash
# Lint, format and type-check the tree with the configuration in pyproject.toml
# (the same checks as tests/test_lint.py).
#   bash scripts/lint.sh          check only (exit status != 0 on any finding)
#   bash scripts/lint.sh --fix    apply ruff's safe fixes and the formatter first
set -euo pipefail
cd "$(dirname "${BASH_SOURCE[0]}")/.."
PY=${PYTHON:-.venv/bin/python}
PATHS=(jaxcomm tests experiments scripts)
if [[ "${1:-}" == "--fix" ]]; then
  "$PY" -m ruff check --fix "${PATHS[@]}" || true
  "$PY" -m ruff format "${PATHS[@]}"
fi
status=0
"$PY" -m ruff check "${PATHS[@]}" || status=1
"$PY" -m ruff format --check "${PATHS[@]}" > /dev/null || { echo "ruff format: files would be reformatted"; status=1; }
"$PY" -m mypy || status=1
exit $status
