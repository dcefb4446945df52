#!/usr/bin/env bash
# The main job: set up (idempotent: .venv, dependencies, data), then measure what compression
# buys on a real, throttled network: `jaxcomm run time-to-accuracy` (MPI processes in a private
# network namespace; needs root or CAP_NET_ADMIN + CAP_SYS_ADMIN). Where this machine cannot
# make one, it says why in one line and runs the simulated study instead, `jaxcomm run
# quickstart` (8 simulated devices, communication estimated by the cost model).
# Extra arguments go to `jaxcomm run` (try --help, --smoke, --set key=value).
set -euo pipefail
cd "$(dirname "${BASH_SOURCE[0]}")/.."
bash scripts/setup.sh
if why=$(.venv/bin/jaxcomm launch --check 2>&1); then
    exec .venv/bin/jaxcomm run time-to-accuracy "$@"
fi
echo "main.sh: no emulated network here (${why}); running the simulated quickstart instead" >&2
exec .venv/bin/jaxcomm run quickstart "$@"
