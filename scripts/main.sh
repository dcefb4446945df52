#!/usr/bin/env bash
# The main job: set up (idempotent: .venv, dependencies, data), then run the quickstart
# experiment. Extra arguments go to `jaxcomm run quickstart` (try --help).
set -euo pipefail
cd "$(dirname "${BASH_SOURCE[0]}")/.."
bash scripts/setup.sh
exec .venv/bin/jaxcomm run quickstart "$@"
