#!/usr/bin/env bash
# The GPU device check: prepares Python, then runs experiments/benchmarks/device_check.py, which writes
# device_check.json (compile time of every compressor at 26M entries, the GRACE comparison at 10 and 100 MiB,
# the elementwise compressors' bandwidth against HBM, a VGG16 step's compression overhead, the accelerator top-k
# bodies side by side) to the output folder.
# About 8 minutes on one GPU: the parts share --budget seconds (default 450), the set-up takes the rest.
#
# usage (from anywhere):  bash scripts/device_check.sh [--out DIR] [--smoke] [device_check.py options]
#
#   --out DIR   where the JSON and the logs go (default: $OUT)
#   --smoke     tiny sizes, a few compressors: checks the plumbing on any machine, the CPU included
#
# Python: $PYTHON if set; else the checkout's .venv (created by scripts/setup.sh when missing, which
# needs PyPI); else python3 when it imports jax, flax and optax. Where nvidia-smi runs but jax finds no
# GPU, it tries `pip install "jax[cuda12]==<the installed jax>"`, then `pip install -U "jax[cuda12]"`
# (each may fail on a machine without a package index: the check then runs on whatever jax finds, and
# device_check.json's env.backend says which). GRACE_PATH, if set, is the GRACE checkout the comparison
# imports (with torch); without it jaxcomm is timed against the jax memory pass alone.
set -u
ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
cd "$ROOT"
out="${OUT:-}"
smoke=0
rest=()
while [ $# -gt 0 ]; do
    case $1 in
    --out) out=${2:-}; shift 2 ;;
    --out=*) out=${1#--out=}; shift ;;
    --smoke) smoke=1; rest+=("$1"); shift ;;
    *) rest+=("$1"); shift ;;
    esac
done
if [ -z "$out" ]; then
    echo "usage: bash scripts/device_check.sh --out DIR [--smoke] (or set \$OUT)" >&2
    exit 2
fi
mkdir -p "$out" || exit 2
log="$out/setup.log"
: >"$log"
note() { echo "[device_check] $*" | tee -a "$log" >&2; }
start=$SECONDS

imports() { "$1" -c "import jax, flax, optax" >/dev/null 2>&1; }
if [ -n "${PYTHON:-}" ]; then
    py=$PYTHON
elif [ -x .venv/bin/python ] && imports .venv/bin/python; then
    py=.venv/bin/python
elif command -v python3 >/dev/null 2>&1 && imports python3; then
    py=python3
else
    note "no Python with jax: bash scripts/setup.sh"
    JAXCOMM_SKIP_DATA=1 CI=true bash scripts/setup.sh >>"$log" 2>&1 || note "setup.sh failed (see setup.log)"
    py=.venv/bin/python
fi
note "python: $py ($("$py" --version 2>&1))"

if [ "$smoke" = 0 ] && command -v nvidia-smi >/dev/null 2>&1 && nvidia-smi -L >>"$log" 2>&1; then
    backend=$("$py" -c "import jax; print(jax.default_backend())" 2>>"$log")
    if [ "$backend" != "gpu" ]; then
        version=$("$py" -c "import jax; print(jax.__version__)" 2>>"$log")
        note "GPU present, jax backend '$backend': installing jax[cuda12]==$version"
        timeout 240 "$py" -m pip install -q "jax[cuda12]==$version" >>"$log" 2>&1 ||
            { note "pinned install failed: pip install -U jax[cuda12]"; timeout 240 "$py" -m pip install -q -U "jax[cuda12]" >>"$log" 2>&1; } ||
            note "jax[cuda12] could not be installed; going on with backend '$backend'"
    fi
    note "jax backend: $("$py" -c "import jax; print(jax.default_backend(), jax.devices())" 2>>"$log")"
fi
note "set-up took $((SECONDS - start)) s"
budget=450
[ "$smoke" = 1 ] && budget=120
exec "$py" experiments/benchmarks/device_check.py --out "$out" --budget "$budget" "${rest[@]}"
