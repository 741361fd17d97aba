#!/usr/bin/env bash
# The project's one device-machine script: runs GPU tests and benchmarks from an existing build
# (it builds nothing), one step per mode, each under a time limit, its full output in
# $OUT/<step>.log and one summary line per step on stdout:
#     <step>  rc=<exit status>  <seconds>s  <gtest / result summary>
#
# Usage:  bash bench/device.sh [-b BUILD] [-o OUT] MODE [--option ...] [MODE [--option ...] ...]
#   -b BUILD   the build folder (default $BUILD, else .devbuild: build here, carry it to the machine)
#   -o OUT     the log folder (default $OUT, the device tool's output folder, else ./device-out)
# Words after a mode that start with -- are that mode's options (below). With no mode: `tests`.
#
# One GPU
#   tests [--filter F] [--shard I/N]  flowmoe_gpu_tests (every GPU test, or the gtest filter F; with
#                          --shard, part I of N: the whole suite takes more than one 600 s call),
#                          failures shown
#   moe-tests              the MoE layer tests (*Moe*, including the stored-digest test)
#   gemm-tests             the GEMM tests (*Gemm*)
#   ep-sim                 expert parallelism through simulated ranks on the first GPU (*MoeEp*)
#   bench-kernels [--quick]  the five kernel benchmarks (convert, gemm, token, router, swiglu);
#                          --quick: one shape each (about a minute in all)
#   bench-NAME [--opts "…"]  one of them: bench-convert, bench-gemm, bench-token, bench-router,
#                          bench-swiglu; --opts: its options instead of the defaults (e.g.
#                          bench-gemm --opts "--reps 5 --model V3")
#   wgrad-kernel           flowmoe's sm_90a FP8 wgrad kernel against cuBLASLt per expert
#   cutlass [--opts "…"]   CUTLASS's grouped blockwise FP8 GEMM (flowmoe_bench_cutlass, built only
#                          with -DFLOWMOE_BENCH_CUTLASS=ON: docs/GEMM.md, "CUTLASS baseline"; taken
#                          from BUILD, else from build-cutlass/): every shape with uniform, then
#                          ragged rows per expert, each at its fastest scheduler setting (--sweep);
#                          --opts: its options instead (e.g. "--reps 50 --shape V3-GEMM1-fprop")
#   torch                  the PyTorch layer baseline: $OUT/torch.json (bench/torch_moe_layer.py)
#   torch-kernels          the eager PyTorch kernel baselines (correctness check, then timings) and
#                          the PyTorch cast baseline (bench/torch_convert_baseline.py)
#   layer [--baseline torch] [--grads accumulate|overwrite|both] [flowmoe bench options]
#                          `flowmoe bench` (default --config all --tokens 8192 --reps 5); with
#                          --baseline torch the PyTorch layer is run first and compared with
#   power [flowmoe bench options]  the layer (v3-ep8) with SM clock, power and temperature sampled
#                          every 100 ms into $OUT/power-samples.csv (clock histogram printed)
#   ncu --kernel REGEX [--bench NAME] [--args "…"] [--metrics stalls|tensor|issue]
#                          Nsight Compute on one kernel of a benchmark (default flowmoe_bench_gemm
#                          --wgrad-kernel-only --reps 3); clocks are left alone (--clock-control none)
# Two or more GPUs (kinds nvidia-h200-x2 / -x4 / -x8; NVLink multicast stays off)
#   nccl                   flowmoe_nccl_tests (2 GPUs, 100 s) and its size-mismatch scenario (40 s)
#   ep [--gpus N] [--no-layer] [--no-comm]  `flowmoe bench-ep` (default 2 GPUs): dispatch/combine
#                          (120 s) and the layer (260 s); `nccl ep` fits the device tool's 600 s
#   ep-scaling [--gpus N]  issue 8's scaling run: DeepSeek-V3, 256 experts in all, 4096 tokens per
#                          GPU, at EP = 2, 4, ... N (default: every GPU of the machine)
#
# Examples (device tool, carry .devbuild):
#   bash bench/device.sh tests bench-kernels --quick          # GPU tests + one short run per bench
#   bash bench/device.sh torch layer --baseline torch --grads both
#   bash bench/device.sh ncu --kernel swiglu_row_kernel --bench flowmoe_bench_swiglu \
#        --args "--reps 3 --config DeepSeek-V3" --metrics issue
set -uo pipefail
BUILD=${BUILD:-.devbuild}
OUT=${OUT:-device-out}
while getopts "b:o:h" opt; do
  case $opt in
    b) BUILD=$OPTARG ;;
    o) OUT=$OPTARG ;;
    *) sed -n '2,/^set -uo/p' "$0" | sed '$d' | cut -c3-; exit 2 ;;
  esac
done
shift $((OPTIND - 1))
mkdir -p "$OUT"
export PYTHONUNBUFFERED=1 NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1
export NCCL_DEBUG=${NCCL_DEBUG:-WARN}
# the stored digests of tests/cuda/test_moe_digest_gpu.cu, wherever the build was made
export FLOWMOE_TEST_DATA_DIR=${FLOWMOE_TEST_DATA_DIR:-$(cd "$(dirname "$0")/.." && pwd)/tests/cuda/data}
FAILED=0

# step NAME LIMIT CMD...: run CMD under `timeout LIMIT`, output into $OUT/NAME.log, one summary line.
step() {
  local name=$1 limit=$2; shift 2
  local t0=$SECONDS
  timeout "$limit" "$@" > "$OUT/$name.log" 2>&1
  local rc=$?
  [ "$rc" = 0 ] || FAILED=$((FAILED + 1))
  local summary
  summary=$(grep -aE '^\[=+\] .* ran|^\[ +PASSED +\]|listed below|ALL PASSED|^copy ceiling' "$OUT/$name.log" \
            | head -n 4 | tr '\n' ' ' | cut -c1-160)
  [ "$rc" = 124 ] && summary="TIMED OUT after ${limit}s; $summary"
  printf '%-24s rc=%-3s %4ss  %s\n' "$name" "$rc" "$((SECONDS - t0))" "$summary"
  return "$rc"
}
# need FILE...: the build must hold these binaries
need() {
  local f
  for f in "$@"; do
    if [ ! -x "$BUILD/$f" ]; then
      echo "missing $BUILD/$f: build it first (e.g. cmake --build build --target $f) and carry the build folder"
      FAILED=$((FAILED + 1))
      return 1
    fi
  done
}
# failures LOG: the first failing assertions of a gtest log
failures() { grep -a -B2 -A10 -E "Failure|error:" "$1" | head -40; }
# rows LOG...: the layer benchmark's result rows, targets and GEMM stages
rows() {
  grep -aE "^\| (bf16|fp8-naive|flow|flow-fp4|blockwise) |PyTorch|MISSED|met \(|GEMM. (d|w)grad|sum of stages" "$@" \
    | cut -c1-200
}
# with_defaults "FLAG VALUE"... -- ARGS...: ARGS, plus every default whose flag ARGS lacks
with_defaults() {
  local defaults=() d
  while [ "$1" != "--" ]; do defaults+=("$1"); shift; done
  shift
  local out=("$@")
  for d in "${defaults[@]}"; do
    case " $* " in *" ${d%% *} "*) ;; *) read -ra kv <<< "$d"; out+=("${kv[@]}") ;; esac
  done
  printf '%s\n' "${out[@]}"
}
# The NCCL programs find libnccl / libcudart / libcublasLt through the build's RUNPATH; where the
# image lacks them, add lib64 and the NVIDIA wheels of PyTorch's environment.
nccl_libs() {
  if ldd "$BUILD/$1" 2>/dev/null | grep -q "not found"; then
    local extra=/usr/local/cuda/lib64:/usr/local/cuda/targets/x86_64-linux/lib m d
    for m in nccl cuda_runtime cublas; do
      d=$(python3 -c "import nvidia.$m as x, os; print(os.path.join(list(x.__path__)[0], 'lib'))" 2>/dev/null)
      [ -n "$d" ] && extra="$extra:$d"
    done
    export LD_LIBRARY_PATH="$extra${LD_LIBRARY_PATH:+:$LD_LIBRARY_PATH}"
  fi
  ldd "$BUILD/$1" > "$OUT/ldd.txt" 2>&1
  nvidia-smi topo -m > "$OUT/topo.txt" 2>&1
  echo "GPUs: $(nvidia-smi -L 2>/dev/null | wc -l); $(grep -o 'libnccl[^ ]* => [^ ]*' "$OUT/ldd.txt")"
}
gpu_count() { nvidia-smi -L 2>/dev/null | wc -l; }

# Nsight Compute metric sets (ncu --metrics NAME)
STALLS=""
for s in long_scoreboard short_scoreboard barrier lg_throttle mio_throttle drain membar wait \
         math_pipe_throttle no_instruction not_selected selected dispatch_stall tex_throttle; do
  STALLS+="smsp__average_warps_issue_stalled_${s}_per_issue_active.ratio,"
done
METRICS_stalls="${STALLS}dram__bytes_read.sum,dram__bytes_write.sum,smsp__inst_executed.sum,gpu__time_duration.sum,sm__warps_active.avg.pct_of_peak_sustained_active,l1tex__data_bank_conflicts_pipe_lsu_mem_shared.sum"
METRICS_tensor="sm__pipe_tensor_op_gmma_cycles_active.avg.pct_of_peak_sustained_active,l1tex__data_bank_reads.avg.pct_of_peak_sustained_elapsed,l1tex__data_bank_writes.avg.pct_of_peak_sustained_elapsed,lts__throughput.avg.pct_of_peak_sustained_elapsed,lts__t_sector_hit_rate.pct,dram__throughput.avg.pct_of_peak_sustained_elapsed,sm__throughput.avg.pct_of_peak_sustained_elapsed,gpu__time_duration.sum,sm__cycles_elapsed.avg.per_second"
METRICS_issue="smsp__issue_active.avg.pct_of_peak_sustained_active,sm__inst_executed.sum,dram__throughput.avg.pct_of_peak_sustained_elapsed,gpu__time_duration.sum,sm__warps_active.avg.pct_of_peak_sustained_active,${STALLS%,}"

# ---- the modes ---------------------------------------------------------------------------------------
run_tests() {  # run_tests STEP LIMIT [gtest args...]
  local name=$1 limit=$2; shift 2
  need flowmoe_gpu_tests || return
  step "$name" "$limit" "$BUILD/flowmoe_gpu_tests" "$@" || failures "$OUT/$name.log"
}

bench_kernel() {  # bench_kernel NAME QUICK [options, replacing the defaults]
  local name=$1 quick=$2; shift 2
  local args=()
  if [ $# -gt 0 ]; then
    args=("$@")
  elif [ "$quick" = 1 ]; then
    case $name in
      convert) args=(--config "DeepSeek-V3 EP8") ;;
      gemm) args=(--reps 10 --model V3) ;;
      router) args=(--config "DeepSeek-V3 EP8" --variants) ;;
      token) args=(--config DeepSeek-V3 --align 128) ;;
      swiglu) args=(--config DeepSeek-V3) ;;
    esac
  else
    case $name in
      gemm) args=(--reps 10) ;;
      router) args=(--variants) ;;
    esac
  fi
  need "flowmoe_bench_$name" || return
  step "bench-$name" 300 "$BUILD/flowmoe_bench_$name" "${args[@]}"
}

run_torch() {
  step torch-layer 300 python3 bench/torch_moe_layer.py --tokens 8192 --reps 5 --json "$OUT/torch.json"
}

run_layer() {
  local baseline="" grads=accumulate args=()
  while [ $# -gt 0 ]; do
    case $1 in
      --baseline) baseline=$2; shift 2 ;;
      --grads) grads=$2; shift 2 ;;
      *) args+=("$1"); shift ;;
    esac
  done
  need flowmoe || return
  if [ "$baseline" = torch ]; then
    [ -s "$OUT/torch.json" ] || run_torch
    baseline=$OUT/torch.json
  fi
  [ -n "$baseline" ] && args+=(--baseline "$baseline")
  mapfile -t args < <(with_defaults "--config all" "--tokens 8192" "--reps 5" -- "${args[@]}")
  local g
  for g in accumulate overwrite; do
    [ "$grads" = both ] || [ "$grads" = "$g" ] || continue
    step "layer-$g" 400 "$BUILD/flowmoe" bench --grads "$g" "${args[@]}" && rows "$OUT/layer-$g.log"
  done
}

run_power() {
  need flowmoe || return
  local args
  mapfile -t args < <(with_defaults "--config v3-ep8" "--tokens 8192" "--reps 20" "--recipes blockwise,flow" -- "$@")
  nvidia-smi --query-gpu=timestamp,clocks.sm,clocks.max.sm,power.draw,power.limit,temperature.gpu,clocks_throttle_reasons.active \
    --format=csv -lms 100 > "$OUT/power-samples.csv" 2>&1 &
  local sampler=$!
  step layer-power 300 "$BUILD/flowmoe" bench --no-breakdown "${args[@]}"
  kill "$sampler" 2> /dev/null
  sleep 0.2
  rows "$OUT/layer-power.log"
  echo "SM clock (MHz) : samples"
  awk -F, 'NR > 1 {c[$2]++} END {for (k in c) print k, c[k]}' "$OUT/power-samples.csv" | sort -k2 -n | tail -6
}

run_ncu() {
  local kernel="" bench=flowmoe_bench_gemm bargs="--wgrad-kernel-only --reps 3" set=stalls
  while [ $# -gt 0 ]; do
    case $1 in
      --kernel) kernel=$2; shift 2 ;;
      --bench) bench=$2; shift 2 ;;
      --args) bargs=$2; shift 2 ;;
      --metrics) set=$2; shift 2 ;;
      *) echo "ncu: unknown option $1"; FAILED=$((FAILED + 1)); return ;;
    esac
  done
  [ -n "$kernel" ] || { echo "ncu: --kernel REGEX is required"; FAILED=$((FAILED + 1)); return; }
  local mvar="METRICS_$set"
  [ -n "${!mvar:-}" ] || { echo "ncu: --metrics stalls|tensor|issue, not $set"; FAILED=$((FAILED + 1)); return; }
  need "$bench" || return
  local name="ncu-${kernel//[^A-Za-z0-9_]/_}"
  read -ra ba <<< "$bargs"
  step "$name" 300 ncu --clock-control none -k "regex:$kernel" -c 2 --metrics "${!mvar}" "$BUILD/$bench" "${ba[@]}"
  grep -avE "^==PROF==|^\|" "$OUT/$name.log" | grep -vE "^ *-+ *$" | head -60
}

run_cutlass() {
  local opts=() bin=$BUILD/flowmoe_bench_cutlass
  [ "${1:-}" = --opts ] && read -ra opts <<< "${2:-}"
  [ -x "$bin" ] || bin=build-cutlass/flowmoe_bench_cutlass
  if [ ! -x "$bin" ]; then
    echo "missing flowmoe_bench_cutlass (in $BUILD and build-cutlass): configure with -DFLOWMOE_BENCH_CUTLASS=ON" \
         "-DFLOWMOE_CUTLASS_DIR=\"\$(bash scripts/cutlass_dir.sh)\" (pip install nvidia-cutlass), build that" \
         "target and carry its build folder (docs/GEMM.md, CUTLASS baseline)"
    FAILED=$((FAILED + 1))
    return 1
  fi
  if [ ${#opts[@]} -gt 0 ]; then
    step bench-cutlass 300 "$bin" "${opts[@]}"
    grep -aE "^cutlass |^#" "$OUT/bench-cutlass.log"
  else
    step bench-cutlass 300 "$bin" --reps 20 --sweep
    grep -aE "^cutlass |^#" "$OUT/bench-cutlass.log"
    step bench-cutlass-ragged 300 "$bin" --reps 20 --sweep --ragged
    grep -aE "^cutlass " "$OUT/bench-cutlass-ragged.log"
  fi
}

run_nccl() {
  need flowmoe_nccl_tests || return
  nccl_libs flowmoe_nccl_tests
  step nccl-tests 100 "$BUILD/flowmoe_nccl_tests" --verbose
  grep -aE "FAIL|SKIPPED|WATCHDOG|summary|ALL PASSED" "$OUT/nccl-tests.log" | head -20
  step nccl-size-mismatch 40 "$BUILD/flowmoe_nccl_tests" --scenarios size-mismatch --budget 35
}

run_ep() {
  local gpus=2 comm=1 layer=1
  while [ $# -gt 0 ]; do
    case $1 in
      --gpus) gpus=$2; shift 2 ;;
      --no-layer) layer=0; shift ;;
      --no-comm) comm=0; shift ;;
      *) echo "ep: unknown option $1"; FAILED=$((FAILED + 1)); return ;;
    esac
  done
  need flowmoe flowmoe_bench_ep || return
  nccl_libs flowmoe_bench_ep
  [ "$comm" = 1 ] && step ep-comm 120 "$BUILD/flowmoe" bench-ep --gpus "$gpus" --config v3-ep8,v2,v2-lite \
    --tokens 8192 --no-layer --timeout 110
  [ "$layer" = 1 ] && step ep-layer 260 "$BUILD/flowmoe" bench-ep --gpus "$gpus" --config v3-ep8,v2,v2-lite \
    --tokens 8192 --no-comm --reps 5 --warmup 2 --timeout 250
}

run_ep_scaling() {
  local gpus
  gpus=$(gpu_count)
  [ "${1:-}" = --gpus ] && gpus=$2
  need flowmoe flowmoe_bench_ep || return
  nccl_libs flowmoe_bench_ep
  local n
  for n in 2 4 8; do
    [ "$n" -le "$gpus" ] || continue
    step "ep-scaling-$n" 150 "$BUILD/flowmoe" bench-ep --gpus "$n" --config v3-ep8 --experts-total 256 \
      --tokens 4096 --reps 5 --warmup 2 --timeout 140
  done
}

# ---- main: split the words into modes and their options --------------------------------------------
[ $# -gt 0 ] || set -- tests
nvidia-smi --query-gpu=name,clocks.sm,clocks.mem,driver_version --format=csv > "$OUT/smi.txt" 2>&1
echo "build $BUILD, logs $OUT; $(tail -n +2 "$OUT/smi.txt" | head -1)"
while [ $# -gt 0 ]; do
  mode=$1
  shift
  opts=()
  while [ $# -gt 0 ] && [ "${1#--}" != "$1" ]; do
    opts+=("$1")
    shift
    case ${opts[-1]} in  # options that take a value: the next word, whatever it looks like
      --filter|--shard|--opts|--baseline|--grads|--kernel|--bench|--args|--metrics|--gpus|--config|--tokens|--reps|\
      --warmup|--recipes|--align|--json)
        [ $# -gt 0 ] && { opts+=("$1"); shift; } ;;
    esac
  done
  case $mode in
    tests)
      # --filter F: only the gtest filter F; --shard I/N: the I-th of N parts of the suite (gtest's
      # sharding: every test in exactly one part), so that the whole suite fits in calls of 600 s
      filter=() shard=""
      for ((j = 0; j < ${#opts[@]}; j += 2)); do
        case ${opts[j]} in
          --filter) filter=(--gtest_filter="${opts[j + 1]}") ;;
          --shard) shard=${opts[j + 1]} ;;
          *) echo "tests: unknown option ${opts[j]}"; FAILED=$((FAILED + 1)) ;;
        esac
      done
      if [[ -n $shard ]]; then
        if [[ ! $shard =~ ^([0-9]+)/([0-9]+)$ ]] || ((BASH_REMATCH[1] >= BASH_REMATCH[2])); then
          echo "tests: --shard $shard; expected I/N with 0 <= I < N, e.g. 0/2"; FAILED=$((FAILED + 1))
        else
          GTEST_SHARD_INDEX=${BASH_REMATCH[1]} GTEST_TOTAL_SHARDS=${BASH_REMATCH[2]} \
            run_tests "gpu-tests-shard-${BASH_REMATCH[1]}of${BASH_REMATCH[2]}" 540 "${filter[@]}"
        fi
      elif [ ${#filter[@]} -gt 0 ]; then run_tests gpu-tests-filtered 420 "${filter[@]}"
      else run_tests gpu-tests 420; fi ;;
    moe-tests) run_tests gpu-tests-moe 300 --gtest_filter='*Moe*' ;;
    gemm-tests) run_tests gpu-tests-gemm 240 --gtest_filter='*Gemm*' ;;
    ep-sim) CUDA_VISIBLE_DEVICES=0 run_tests gpu-tests-ep-sim 300 --gtest_filter='*MoeEp*' ;;
    bench-kernels)
      q=0
      [ "${opts[0]:-}" = --quick ] && q=1
      for k in convert gemm token router swiglu; do bench_kernel "$k" "$q"; done ;;
    bench-convert|bench-gemm|bench-token|bench-router|bench-swiglu)
      extra=()
      [ "${opts[0]:-}" = --opts ] && read -ra extra <<< "${opts[1]}"
      bench_kernel "${mode#bench-}" 0 "${extra[@]}" ;;
    wgrad-kernel)
      need flowmoe_bench_gemm && step wgrad-kernel 240 "$BUILD/flowmoe_bench_gemm" --wgrad-kernel-only --reps 10 &&
        grep -aE "^\||error|kernel did not" "$OUT/wgrad-kernel.log" ;;
    cutlass) run_cutlass "${opts[@]}" ;;
    torch) run_torch ;;
    torch-kernels)
      step torch-kernels-check 120 python3 bench/torch_kernel_baselines.py --check
      step torch-kernels 240 python3 bench/torch_kernel_baselines.py --config all --json "$OUT/torch-kernels.json"
      step torch-convert 120 python3 bench/torch_convert_baseline.py 32768 7168 ;;
    layer) run_layer "${opts[@]}" ;;
    power) run_power "${opts[@]}" ;;
    ncu) run_ncu "${opts[@]}" ;;
    nccl) run_nccl ;;
    ep) run_ep "${opts[@]}" ;;
    ep-scaling) run_ep_scaling "${opts[@]}" ;;
    *) echo "unknown mode '$mode' (bash $0 -h lists the modes)"; FAILED=$((FAILED + 1)) ;;
  esac
done
echo "done: $FAILED step(s) failed; logs in $OUT"
[ "$FAILED" = 0 ]
