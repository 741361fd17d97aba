#!/usr/bin/env bash
# Fourth session, one H200: the GPU tests, the SwiGLU and token benchmarks, and an Nsight Compute
# look at the forward SwiGLU kernels (plain and fused; issue-bound or memory-bound?). Logs under $OUT.
# Usage (device tool, carry .devbuild): bash bench/s4_one_gpu.sh [tests|bench|ncu|layer ...]
source "$(dirname "$0")/session_lib.sh"  # B, OUT, step, rows
for what in "${@:-tests bench}"; do
  case $what in
    tests)
      step gpu-tests 300 $B/flowmoe_gpu_tests
      tail -3 $OUT/gpu-tests.log; grep -B2 -A10 Failure $OUT/gpu-tests.log | head -40 ;;
    tests-quick)
      step gpu-tests-quick 200 $B/flowmoe_gpu_tests --gtest_filter='*Swiglu*:*Token*:*Permute*:*Convert*:*Quant*'
      tail -3 $OUT/gpu-tests-quick.log; grep -B2 -A10 Failure $OUT/gpu-tests-quick.log | head -40 ;;
    bench)
      step bench-swiglu 150 $B/flowmoe_bench_swiglu
      grep -E "swiglu|SwiGLU|copy" $OUT/bench-swiglu.log | head -40
      step bench-token 150 $B/flowmoe_bench_token
      grep -E "copy|permute\+pad|===|A = " $OUT/bench-token.log | head -60 ;;
    ncu)
      m="smsp__issue_active.avg.pct_of_peak_sustained_active,sm__inst_executed.sum,dram__throughput.avg.pct_of_peak_sustained_elapsed,gpu__time_duration.sum,sm__warps_active.avg.pct_of_peak_sustained_active,smsp__average_warps_issue_stalled_long_scoreboard_per_issue_active.ratio,smsp__average_warps_issue_stalled_math_pipe_throttle_per_issue_active.ratio,smsp__average_warps_issue_stalled_wait_per_issue_active.ratio,smsp__average_warps_issue_stalled_lg_throttle_per_issue_active.ratio,smsp__average_warps_issue_stalled_not_selected_per_issue_active.ratio,smsp__average_warps_issue_stalled_selected_per_issue_active.ratio"
      step ncu-swiglu 200 ncu --clock-control none -k "regex:swiglu_row_kernel" -c 4 --metrics "$m" $B/flowmoe_bench_swiglu --reps 3 --config DeepSeek-V3
      grep -E "swiglu_row_kernel|issue_active|inst_executed|dram__|duration|warps_active|stalled" $OUT/ncu-swiglu.log | head -60 ;;
    tail)  # A/B of the one-GPU tail stream (router backward, dWr, dx next to GEMM1 wgrad)
      step torch-layer 200 python3 bench/torch_moe_layer.py --tokens 8192 --reps 5 --json $OUT/torch.json
      step bench-tail1 240 $B/flowmoe bench --config all --tokens 8192 --reps 5 --recipes blockwise,flow,flow-fp4 --grads overwrite --baseline $OUT/torch.json
      grep -E "^\| (flow|flow-fp4|blockwise) |PyTorch|MISSED|met" $OUT/bench-tail1.log | cut -c1-160
      FLOWMOE_LAYER_TAIL_OVERLAP=0 step bench-tail0 240 $B/flowmoe bench --config all --tokens 8192 --reps 5 --recipes blockwise,flow --grads overwrite --baseline $OUT/torch.json --no-breakdown
      grep -E "^\| (flow|blockwise) " $OUT/bench-tail0.log | cut -c1-160 ;;
    token)
      step bench-token 150 $B/flowmoe_bench_token
      grep -E "copy|permute\+pad|unpermute|===|A = " $OUT/bench-token.log | head -80 ;;
    moe-tests)
      step gpu-tests-moe 300 $B/flowmoe_gpu_tests --gtest_filter='*Moe*:*Gemm*:*Swiglu*'
      tail -3 $OUT/gpu-tests-moe.log; grep -B2 -A10 Failure $OUT/gpu-tests-moe.log | head -40 ;;
    final)  # the last one-GPU call: everything quoted in the closing note, in one call
      step gpu-tests 300 $B/flowmoe_gpu_tests
      tail -3 $OUT/gpu-tests.log; grep -B2 -A10 Failure $OUT/gpu-tests.log | head -40
      step bench-swiglu 150 $B/flowmoe_bench_swiglu
      step bench-token 150 $B/flowmoe_bench_token
      step torch-kernels 200 python3 bench/torch_kernel_baselines.py --config all --json $OUT/torch-kernels.json
      grep -E "swiglu|permute|unpermute" $OUT/torch-kernels.log | head -30
      step torch-layer 200 python3 bench/torch_moe_layer.py --tokens 8192 --reps 5 --json $OUT/torch.json
      step bench-acc 240 $B/flowmoe bench --config all --tokens 8192 --reps 5 --baseline $OUT/torch.json
      step bench-ovw 240 $B/flowmoe bench --config all --tokens 8192 --reps 5 --recipes blockwise,flow,flow-fp4 --grads overwrite --baseline $OUT/torch.json --no-breakdown
      grep -E "^\| (bf16|fp8-naive|flow|flow-fp4|blockwise) |PyTorch|MISSED|met" $OUT/bench-acc.log $OUT/bench-ovw.log | cut -c1-170 ;;
    layer)
      step torch-layer 200 python3 bench/torch_moe_layer.py --tokens 8192 --reps 5 --json $OUT/torch.json
      step bench-ovw 240 $B/flowmoe bench --config all --tokens 8192 --reps 5 --recipes blockwise,flow,flow-fp4 --grads overwrite --baseline $OUT/torch.json
      grep -E "^\| (flow|flow-fp4|blockwise) |PyTorch|MISSED|met" $OUT/bench-ovw.log | cut -c1-220
      # A/B of the GEMM stream priority (the layer's new default with its side stream is 1)
      FLOWMOE_GEMM_PRIORITY=0 step bench-ovw-prio0 200 $B/flowmoe bench --config v3-ep8,v2-lite --tokens 8192 --reps 5 --recipes flow,flow-fp4 --grads overwrite --baseline $OUT/torch.json
      grep -E "^\| (flow|flow-fp4) " $OUT/bench-ovw-prio0.log | cut -c1-160
      FLOWMOE_GEMM_STREAMS=8 step bench-ovw-streams8 200 $B/flowmoe bench --config v2,v2-lite --tokens 8192 --reps 5 --recipes blockwise,flow --grads overwrite --baseline $OUT/torch.json
      grep -E "^\| (flow|blockwise) " $OUT/bench-ovw-streams8.log | cut -c1-160 ;;
  esac
done
