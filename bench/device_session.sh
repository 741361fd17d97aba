#!/usr/bin/env bash
# One device-machine call that runs every GPU test and benchmark of the project, writing each log
# under $OUT (the device tool's output folder; ./device-out elsewhere). Build here first, then carry
# the build folder:  scripts/build.sh && run: bench/device_session.sh build [quick]
#   quick: the GPU tests and one shape per benchmark (about 3 minutes); default: everything.
set -uo pipefail
BUILD=${1:-build}
MODE=${2:-full}
OUT=${OUT:-device-out}
mkdir -p "$OUT"
export PYTHONUNBUFFERED=1 NCCL_NVLS_ENABLE=0
nvidia-smi --query-gpu=name,clocks.sm,clocks.mem,driver_version --format=csv > "$OUT/smi.txt" 2>&1
step() {  # step NAME TIMEOUT COMMAND...: run with a time limit, keep the log, print a summary line
  local name=$1 limit=$2; shift 2
  local t0=$SECONDS
  timeout "$limit" "$@" > "$OUT/$name.log" 2>&1
  local rc=$?
  printf '%-28s rc=%-3s %4ss  %s\n' "$name" "$rc" "$((SECONDS - t0))" \
    "$(grep -E 'PASSED|FAILED|tests from .* ran' "$OUT/$name.log" | tail -n 2 | tr '\n' ' ')"
}
step gpu-tests 420 "$BUILD/flowmoe_gpu_tests"
grep -B3 -A8 "Failure" "$OUT/gpu-tests.log" | head -60
if [ "$MODE" = quick ]; then
  step bench-convert 120 "$BUILD/flowmoe_bench_convert" --config "DeepSeek-V3 EP8"
  step bench-gemm    120 "$BUILD/flowmoe_bench_gemm" --reps 10 --model V3
  step bench-token   120 "$BUILD/flowmoe_bench_token"
  step bench-router  120 "$BUILD/flowmoe_bench_router" --config "DeepSeek-V3 EP8" --variants
  step bench-swiglu  120 "$BUILD/flowmoe_bench_swiglu"
  step torch-layer   120 python3 bench/torch_moe_layer.py --config v3-ep8 --tokens 8192 --reps 5 --json "$OUT/torch.json"
  step moe-bench     180 "$BUILD/flowmoe" bench --config v3-ep8 --tokens 8192 --reps 5 --baseline "$OUT/torch.json"
else
  step bench-convert 300 "$BUILD/flowmoe_bench_convert"
  step bench-gemm    300 "$BUILD/flowmoe_bench_gemm" --reps 10
  step bench-token   200 "$BUILD/flowmoe_bench_token"
  step bench-router  200 "$BUILD/flowmoe_bench_router" --variants
  step bench-swiglu  200 "$BUILD/flowmoe_bench_swiglu"
  step torch-convert 120 python3 bench/torch_convert_baseline.py 32768 7168
  step torch-layer   300 python3 bench/torch_moe_layer.py --tokens 8192 --reps 10 --json "$OUT/torch.json"
  step moe-bench     400 "$BUILD/flowmoe" bench --config all --tokens 8192 --reps 10 --baseline "$OUT/torch.json"
fi
