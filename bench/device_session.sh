#!/usr/bin/env bash
# One device-machine call that runs every GPU test and benchmark of the project, writing each log
# under $OUT (the device tool's output folder; ./device-out elsewhere). Build here first, then carry
# the build folder:  scripts/build.sh && run: bench/device_session.sh build [quick]
#   quick: the GPU tests and one shape per benchmark (about 3 minutes); default: everything.
#   ep4 / ep8: issue 8's scaling run (nvidia-h200-x4 / -x8): bench-ep at EP 2, 4 (8), 256 experts.
#   ep2: TWO GPUs (nvidia-h200-x2): flowmoe_nccl_tests (< 100 s) and `flowmoe bench-ep` (dispatch /
#        combine < 120 s, layer < 260 s; < 9 min in all, under the device tool's 600 s); needs flowmoe, flowmoe_nccl_tests and flowmoe_bench_ep.
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
if [ "$MODE" = ep2 ] || [ "$MODE" = ep2-tests ] || [ "$MODE" = ep2-layer ]; then
  # Two GPUs (kind nvidia-h200-x2), NCCL: NOT YET RUN ANYWHERE (written without a GPU). Every step
  # has a time limit; logs under $OUT. NVLink multicast stays off (NCCL_NVLS_ENABLE=0 above, also
  # forced by the programs and the launcher); TORCH_SYMM_MEM_DISABLE_MULTICAST / NVSHMEM_DISABLE_NVLS
  # are kept set for anything else started here.
  export TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1 NCCL_DEBUG=${NCCL_DEBUG:-WARN}
  nvidia-smi topo -m > "$OUT/topo.txt" 2>&1
  # libnccl.so.2 / libcudart / libcublasLt: the toolkit's (the build's RUNPATH /usr/local/cuda/lib)
  # or, where the image lacks one, lib64 or the NVIDIA wheels of PyTorch's environment
  if ldd "$BUILD/flowmoe_nccl_tests" 2>/dev/null | grep -q "not found"; then
    extra=/usr/local/cuda/lib64:/usr/local/cuda/targets/x86_64-linux/lib
    for m in nccl cuda_runtime cublas; do
      d=$(python3 -c "import nvidia.$m as x, os; print(os.path.join(list(x.__path__)[0], 'lib'))" 2>/dev/null)
      [ -n "$d" ] && extra="$extra:$d"
    done
    export LD_LIBRARY_PATH="$extra${LD_LIBRARY_PATH:+:$LD_LIBRARY_PATH}"
  fi
  ldd "$BUILD/flowmoe_nccl_tests" > "$OUT/ldd.txt" 2>&1
  echo "GPUs: $(nvidia-smi -L 2>/dev/null | wc -l); libnccl: $(grep -o 'libnccl[^ ]* => [^ ]*' "$OUT/ldd.txt")"
  if [ "$MODE" != ep2-layer ]; then
    step nccl-tests      100 "$BUILD/flowmoe_nccl_tests" --verbose
    grep -E "FAIL|SKIPPED|WATCHDOG|PASS |summary|ALL PASSED|FAILED" "$OUT/nccl-tests.log" | head -40
    step nccl-size-mismatch 40 "$BUILD/flowmoe_nccl_tests" --scenarios size-mismatch --budget 35
    step bench-ep-comm  120 "$BUILD/flowmoe" bench-ep --gpus 2 --config v3-ep8,v2,v2-lite --tokens 8192 --no-layer --timeout 110
  fi
  # ep2-tests: also the one-GPU test suite (about 140 s) on the first GPU, so that one call of the
  # two-GPU machine checks everything but the layer benchmark (ep2-layer runs that alone)
  if [ "$MODE" = ep2-tests ]; then
    CUDA_VISIBLE_DEVICES=0 step gpu-tests 300 "$BUILD/flowmoe_gpu_tests"
    grep -B3 -A8 "Failure" "$OUT/gpu-tests.log" | head -60
  fi
  if [ "$MODE" != ep2-tests ]; then
    step bench-ep-layer 260 "$BUILD/flowmoe" bench-ep --gpus 2 --config v3-ep8,v2,v2-lite --tokens 8192 --no-comm --reps 5 --warmup 2 --timeout 250
  fi
  exit 0
fi
if [ "$MODE" = ep4 ] || [ "$MODE" = ep8 ]; then
  # Issue 8 (kinds nvidia-h200-x4 / -x8), NOT YET RUN: DeepSeek-V3 layer, 256 experts in all,
  # 4096 tokens per GPU, at EP = 2, 4 (and 8); dispatch/combine and the layer per recipe.
  export TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1 NCCL_DEBUG=${NCCL_DEBUG:-WARN}
  nvidia-smi topo -m > "$OUT/topo.txt" 2>&1
  ngpu=${MODE#ep}
  step nccl-tests 100 "$BUILD/flowmoe_nccl_tests" --verbose
  for n in 2 4 8; do
    [ "$n" -le "$ngpu" ] || continue
    step "bench-ep${n}" 150 "$BUILD/flowmoe" bench-ep --gpus "$n" --config v3-ep8 --experts-total 256 \
      --tokens 4096 --reps 5 --warmup 2 --timeout 140
  done
  exit 0
fi
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
