#!/usr/bin/env bash
# The compressor speed benchmarks on one GPU, in one go (about 5 minutes at these settings).
#
# usage (from the repository root):  bash experiments/benchmarks/gpu_suite.sh GRACE_PATH OUT_DIR
#
#   GRACE_PATH  root of a GRACE checkout (github.com/sands-lab/grace; the folder holding grace_dl/),
#               or "none" to time jaxcomm alone. It is the user's copy: never commit it here.
#   OUT_DIR     where every JSON, table and log goes (created if missing).
#
# Needs python3 with torch (CUDA build), jax with its CUDA plugin, flax, optax, chex,
# orbax-checkpoint, tqdm and matplotlib; jaxcomm itself comes from this tree (PYTHONPATH=.),
# not from an install. Runs, each under its own time limit, each going on if another fails:
#   1. the environment: versions, devices, nvidia-smi, and that jaxcomm's compressors import;
#   2. grace_compare.py --device cuda at 10 and 100 MiB (GRACE vs jaxcomm, both memory passes);
#   3. compressors.py on the GPU (JAX_PLATFORMS=cuda), every registered compressor at 10 and
#      100 MB in one process, and the PowerSGD matrix.
# Tables: python3 experiments/benchmarks/grace_compare.py --markdown OUT_DIR/grace_compare_cuda.json
#         python3 experiments/benchmarks/compressors.py --markdown OUT_DIR/compressors_cuda.json
set -u
if [ $# -ne 2 ]; then
    echo "usage: bash experiments/benchmarks/gpu_suite.sh GRACE_PATH|none OUT_DIR" >&2
    exit 2
fi
GRACE=$1
OUT=$2
# Knobs (environment): REPEATS (10), SIZES (10 and 100 MiB of float32), DEVICE (cuda; cpu checks the
# plumbing), PYTHON (python3).
REPEATS=${REPEATS:-10}
SIZES=${SIZES:-2621440,26214400}
DEVICE=${DEVICE:-cuda}
PYTHON=${PYTHON:-python3}
case $DEVICE in cuda | cpu) ;; *)
    echo "DEVICE must be cuda or cpu, got $DEVICE" >&2
    exit 2
    ;;
esac
mkdir -p "$OUT"
export PYTHONPATH=.${PYTHONPATH:+:$PYTHONPATH}
export XLA_PYTHON_CLIENT_PREALLOCATE=false # torch and XLA share the GPU's memory
status=0

step() { # step NAME LIMIT_S CMD...: run, log to OUT/NAME.log, record the exit status
    local name=$1 limit=$2
    shift 2
    echo "== $name: $*"
    local t0=$SECONDS
    timeout "$limit" "$@" >"$OUT/$name.log" 2>&1
    local rc=$?
    echo "== $name: exit $rc after $((SECONDS - t0)) s" | tee -a "$OUT/steps.txt"
    tail -n 40 "$OUT/$name.log"
    [ $rc -eq 0 ] || status=1
}

nvidia-smi >"$OUT/nvidia-smi.txt" 2>&1 || true
step env 120 "$PYTHON" -c "
import platform, jax, jaxcomm as jc
print('python', platform.python_version(), 'jax', jax.__version__, jax.devices())
try:
    import torch
    print('torch', torch.__version__, 'cuda', torch.version.cuda, torch.cuda.is_available() and torch.cuda.get_device_name())
except ImportError as e:
    print('no torch:', e)
print(len(jc.compressors.names()), 'compressors:', ', '.join(jc.compressors.names()))
"
step "grace_compare_$DEVICE" 240 "$PYTHON" experiments/benchmarks/grace_compare.py --device "$DEVICE" \
    --grace "$GRACE" --sizes "$SIZES" --repeats "$REPEATS" --out "$OUT/grace_compare_$DEVICE.json"
JAX_PLATFORMS=$DEVICE step "compressors_$DEVICE" 300 "$PYTHON" experiments/benchmarks/compressors.py --in-process \
    --sizes "$SIZES" --repeats "$REPEATS" --out "$OUT/compressors_$DEVICE.json"
cat "$OUT/steps.txt"
exit $status
