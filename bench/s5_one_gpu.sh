#!/usr/bin/env bash
# Fifth session, one H200: the wgrads on their own stream next to the dgrads (layer.cu grad_pair).
# Logs under $OUT. Usage (device tool, carry .devbuild): bash bench/s5_one_gpu.sh [mode ...]
source "$(dirname "$0")/session_lib.sh"  # B, OUT, step, rows
for what in "${@:-wg}"; do
  case $what in
    tests)
      step gpu-tests 300 $B/flowmoe_gpu_tests
      tail -3 $OUT/gpu-tests.log; grep -B2 -A10 Failure $OUT/gpu-tests.log | head -40 ;;
    moe-tests)
      step gpu-tests-moe 300 $B/flowmoe_gpu_tests --gtest_filter='*Moe*'
      tail -3 $OUT/gpu-tests-moe.log; grep -B2 -A10 Failure $OUT/gpu-tests-moe.log | head -40 ;;
    gemm-tests)
      step gpu-tests-gemm 200 $B/flowmoe_gpu_tests --gtest_filter='*Gemm*'
      tail -3 $OUT/gpu-tests-gemm.log; grep -B2 -A10 -E "Failure|error" $OUT/gpu-tests-gemm.log | head -60 ;;
    wgk)  # the sm_90a wgrad kernel against cuBLASLt per expert
      step bench-wgrad-kernel 200 $B/flowmoe_bench_gemm --wgrad-kernel-only --reps 10
      grep -E "^\||error|kernel did not" $OUT/bench-wgrad-kernel.log ;;
    ncu-wgk)
      m="sm__pipe_tensor_op_gmma_cycles_active.avg.pct_of_peak_sustained_active,sm__throughput.avg.pct_of_peak_sustained_elapsed,lts__throughput.avg.pct_of_peak_sustained_elapsed,dram__throughput.avg.pct_of_peak_sustained_elapsed,lts__t_sector_hit_rate.pct,gpu__time_duration.sum,sm__cycles_active.avg,smsp__cycles_active.avg"
      step ncu-wgk 200 ncu --clock-control none -k "regex:wgrad_kernel" -c 2 --metrics "$m" --section WarpStateStats $B/flowmoe_bench_gemm --wgrad-kernel-only --reps 3
      grep -vE "^==PROF==|^\|" $OUT/ncu-wgk.log | grep -E "wgrad_kernel|gmma|throughput|hit_rate|duration|cycles|Stall|stall|Warp Cycles|Issued" | head -60 ;;
    torch)
      step torch-layer 200 python3 bench/torch_moe_layer.py --tokens 8192 --reps 5 --json $OUT/torch.json
      tail -5 $OUT/torch-layer.log ;;
    wk)  # A/B: the sm_90a wgrad kernel on (default) and off, accumulate and overwrite, same call
      step bench-wk1 240 $B/flowmoe bench --config all --tokens 8192 --reps 5 --baseline $OUT/torch.json
      rows $OUT/bench-wk1.log
      FLOWMOE_GEMM_WGRAD_KERNEL=0 step bench-wk0 240 $B/flowmoe bench --config all --tokens 8192 --reps 5 --recipes blockwise,flow --baseline $OUT/torch.json --no-breakdown
      rows $OUT/bench-wk0.log
      step bench-wk1-ovw 240 $B/flowmoe bench --config all --tokens 8192 --reps 5 --recipes blockwise,flow,flow-fp4 --grads overwrite --baseline $OUT/torch.json --no-breakdown
      rows $OUT/bench-wk1-ovw.log ;;
    power)  # SM clock and power while the layer runs (are the FP8 GEMM phases power-bound?)
      nvidia-smi --query-gpu=timestamp,clocks.sm,clocks.max.sm,power.draw,power.limit,temperature.gpu,clocks_throttle_reasons.active --format=csv -lms 50 > $OUT/power-samples.csv 2>&1 &
      P=$!
      step bench-power 200 $B/flowmoe bench --config v3-ep8 --tokens 8192 --reps 20 --recipes fp8-naive,flow --no-breakdown
      kill $P; sleep 0.2
      rows $OUT/bench-power.log; head -2 $OUT/power-samples.csv; awk -F, 'NR>1{c[$2]++} END{for(k in c) print k, c[k]}' $OUT/power-samples.csv | sort -k2 -n | tail -8 ;;
    router)
      step gpu-tests-router 120 $B/flowmoe_gpu_tests --gtest_filter='*Router*'
      tail -2 $OUT/gpu-tests-router.log; grep -B2 -A8 Failure $OUT/gpu-tests-router.log | head -30
      step bench-router 150 $B/flowmoe_bench_router --tokens 8192 --variants
      grep -iE "dwr|===|##" $OUT/bench-router.log | head -50 ;;
    layer)  # the layer, every recipe, accumulate and overwrite, next to PyTorch (run torch first)
      step bench-acc 240 $B/flowmoe bench --config all --tokens 8192 --reps 5 --baseline $OUT/torch.json
      rows $OUT/bench-acc.log
      step bench-ovw 240 $B/flowmoe bench --config all --tokens 8192 --reps 5 --recipes blockwise,flow,flow-fp4 --grads overwrite --baseline $OUT/torch.json --no-breakdown
      rows $OUT/bench-ovw.log ;;
    align16)  # expert alignment 16 (less padding, cuBLASLt wgrads) against the default 128
      step bench-a16 240 $B/flowmoe bench --config all --tokens 8192 --reps 5 --recipes blockwise,flow --align 16 --baseline $OUT/torch.json --no-breakdown
      rows $OUT/bench-a16.log ;;
    tail)  # A/B of the tail stream now that GEMM1 wgrad may be one persistent kernel
      step bench-tail1 240 $B/flowmoe bench --config all --tokens 8192 --reps 5 --recipes blockwise,flow --baseline $OUT/torch.json
      rows $OUT/bench-tail1.log
      FLOWMOE_LAYER_TAIL_OVERLAP=0 step bench-tail0 240 $B/flowmoe bench --config all --tokens 8192 --reps 5 --recipes blockwise,flow --baseline $OUT/torch.json
      rows $OUT/bench-tail0.log ;;
    overlap0)  # the flow recipes' side stream off, now that the wgrads may be one persistent kernel
      FLOWMOE_LAYER_OVERLAP=0 step bench-overlap0 240 $B/flowmoe bench --config all --tokens 8192 --reps 5 --recipes flow,flow-fp4 --baseline $OUT/torch.json --no-breakdown
      rows $OUT/bench-overlap0.log ;;
    final)  # the last one-GPU call: every GPU test, then the layer next to PyTorch
      step gpu-tests 300 $B/flowmoe_gpu_tests
      tail -3 $OUT/gpu-tests.log; grep -B2 -A10 Failure $OUT/gpu-tests.log | head -40 ;;
    wg)  # A/B: wgrad stream on (default) and off, accumulate, same call
      step bench-wg1 240 $B/flowmoe bench --config all --tokens 8192 --reps 5 --recipes bf16,blockwise,flow,flow-fp4 --baseline $OUT/torch.json
      rows $OUT/bench-wg1.log
      FLOWMOE_LAYER_WGRAD_OVERLAP=0 step bench-wg0 240 $B/flowmoe bench --config all --tokens 8192 --reps 5 --recipes blockwise,flow --baseline $OUT/torch.json --no-breakdown
      rows $OUT/bench-wg0.log ;;
  esac
done
