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
#   3. compressors.py on the GPU (JAX_PLATFORMS=cuda), the compressors in $ONLY at 10 and
#      100 MB in one process, and the PowerSGD matrix;
#   4. step_overhead.py on the GPU, one worker: the VGG16 training step (forward/backward on
#      $STEP_BATCH images) with each compressor and its memory against the plain step.
# Tables: python3 experiments/benchmarks/grace_compare.py --markdown OUT_DIR/grace_compare_cuda.json
#         python3 experiments/benchmarks/compressors.py --markdown OUT_DIR/compressors_cuda.json
#         python3 experiments/benchmarks/step_overhead.py --markdown OUT_DIR/step_cuda.json
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
# compressors.py: which compressors (every registered one compiles twice per size: minutes on a GPU)
# and PowerSGD matrices; step_overhead.py on one device with the network's forward/backward pass
# (STEP_BATCH=0 skips it); each step's time limit in seconds.
ONLY=${ONLY:-fp16,bf16,signsgd,signum,onebit,efsignsgd,scaled_sign,qsgd,terngrad,natural,eightbit,topk,dgc,randomk}
POWERSGD_SHAPES=${POWERSGD_SHAPES:-1280x2048}
STEP_TREES=${STEP_TREES:-vgg16}
STEP_BATCH=${STEP_BATCH:-32}
STEP_COMPRESSORS=${STEP_COMPRESSORS:-topk,qsgd,signsgd,powersgd,fp16}
STEP_REPEATS=${STEP_REPEATS:-5}
GRACE_S=${GRACE_S:-240}
COMPRESSORS_S=${COMPRESSORS_S:-300}
STEP_S=${STEP_S:-240}
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
step "grace_compare_$DEVICE" "$GRACE_S" "$PYTHON" experiments/benchmarks/grace_compare.py --device "$DEVICE" \
    --grace "$GRACE" --sizes "$SIZES" --repeats "$REPEATS" --out "$OUT/grace_compare_$DEVICE.json"
JAX_PLATFORMS=$DEVICE step "compressors_$DEVICE" "$COMPRESSORS_S" "$PYTHON" experiments/benchmarks/compressors.py \
    --in-process --only "$ONLY" --powersgd-shape "$POWERSGD_SHAPES" \
    --sizes "$SIZES" --repeats "$REPEATS" --out "$OUT/compressors_$DEVICE.json"
if [ "$STEP_BATCH" != 0 ]; then
    JAX_PLATFORMS=$DEVICE step "step_$DEVICE" "$STEP_S" "$PYTHON" experiments/benchmarks/step_overhead.py --in-process \
        --devices 1 --trees "$STEP_TREES" --batch "$STEP_BATCH" --memory grace --compressors "$STEP_COMPRESSORS" \
        --repeats "$STEP_REPEATS" --out "$OUT/step_$DEVICE.json"
fi
cat "$OUT/steps.txt"
exit $status
