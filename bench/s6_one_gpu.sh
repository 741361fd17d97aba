#!/usr/bin/env bash
# Sixth session, one H200: GPU tests, the wgrad kernel against cuBLASLt, the layer next to PyTorch,
# Nsight Compute on the wgrad kernel. Logs under $OUT. Usage (device tool, carry .devbuild): bash bench/s6_one_gpu.sh [mode ...]
source "$(dirname "$0")/session_lib.sh"  # B, OUT, step, rows
for what in "${@:-wgk}"; do
  case $what in
    tests)
      step gpu-tests 400 $B/flowmoe_gpu_tests
      tail -3 $OUT/gpu-tests.log; grep -B2 -A10 Failure $OUT/gpu-tests.log | head -40 ;;
    gemm-tests)
      step gpu-tests-gemm 200 $B/flowmoe_gpu_tests --gtest_filter='*Gemm*'
      tail -3 $OUT/gpu-tests-gemm.log; grep -B2 -A10 -E "Failure|error" $OUT/gpu-tests-gemm.log | head -60 ;;
    moe-tests)
      step gpu-tests-moe 300 $B/flowmoe_gpu_tests --gtest_filter='*Moe*'
      tail -3 $OUT/gpu-tests-moe.log; grep -B2 -A10 Failure $OUT/gpu-tests-moe.log | head -40 ;;
    wgk)  # the sm_90a wgrad kernel against cuBLASLt per expert
      step bench-wgrad-kernel 240 $B/flowmoe_bench_gemm --wgrad-kernel-only --reps 10
      grep -E "^\||error|kernel did not" $OUT/bench-wgrad-kernel.log ;;
    torch)
      step torch-layer 200 python3 bench/torch_moe_layer.py --tokens 8192 --reps 5 --json $OUT/torch.json
      tail -5 $OUT/torch-layer.log ;;
    layer)  # the layer, every recipe, accumulate and overwrite, next to PyTorch (run torch first)
      step bench-acc 240 $B/flowmoe bench --config all --tokens 8192 --reps 5 --baseline $OUT/torch.json
      rows $OUT/bench-acc.log
      step bench-ovw 240 $B/flowmoe bench --config all --tokens 8192 --reps 5 --recipes blockwise,flow,flow-fp4 --grads overwrite --baseline $OUT/torch.json --no-breakdown
      rows $OUT/bench-ovw.log ;;
    wk0)  # A/B: the wgrad kernel off (cuBLASLt per expert), same call
      FLOWMOE_GEMM_WGRAD_KERNEL=0 step bench-wk0 240 $B/flowmoe bench --config all --tokens 8192 --reps 5 --recipes blockwise,flow --baseline $OUT/torch.json --no-breakdown
      rows $OUT/bench-wk0.log ;;
    power)  # SM clock and power while the layer runs
      nvidia-smi --query-gpu=timestamp,clocks.sm,clocks.max.sm,power.draw,power.limit,temperature.gpu,clocks_throttle_reasons.active --format=csv -lms 50 > $OUT/power-samples.csv 2>&1 &
      P=$!
      step bench-power 200 $B/flowmoe bench --config v3-ep8 --tokens 8192 --reps 20 --recipes blockwise,flow --no-breakdown
      kill $P; sleep 0.2
      rows $OUT/bench-power.log; awk -F, 'NR>1{c[$2]++} END{for(k in c) print k, c[k]}' $OUT/power-samples.csv | sort -k2 -n | tail -8 ;;
    ncu-wgk)  # what limits the wgrad kernel: tensor pipe, shared-memory banks, L2, DRAM
      m="sm__pipe_tensor_op_gmma_cycles_active.avg.pct_of_peak_sustained_active,l1tex__data_bank_reads.avg.pct_of_peak_sustained_elapsed,l1tex__data_bank_writes.avg.pct_of_peak_sustained_elapsed,lts__throughput.avg.pct_of_peak_sustained_elapsed,dram__throughput.avg.pct_of_peak_sustained_elapsed,sm__throughput.avg.pct_of_peak_sustained_elapsed,gpu__time_duration.sum,sm__cycles_elapsed.avg.per_second"
      step ncu-wgk 200 ncu --clock-control none -k "regex:wgrad_kernel" -c 2 --metrics "$m" $B/flowmoe_bench_gemm --wgrad-kernel-only --reps 3
      grep -vE "^==PROF==|^\|" $OUT/ncu-wgk.log | grep -E "wgrad_kernel|gmma|bank|throughput|duration|per_second" | head -40 ;;
    a16ab)  # alignment 16 against 128 at DeepSeek-V3's shapes, interleaved twice (run-to-run spread)
      for r in 1 2; do
        for c in v3-ep8 v3-ep32; do
          for a in 128 16; do
            step bench-$c-a$a-r$r 200 $B/flowmoe bench --config $c --tokens 8192 --reps 5 --recipes blockwise,flow --align $a --baseline $OUT/torch.json --no-breakdown
            echo "$c align $a run $r"; rows $OUT/bench-$c-a$a-r$r.log | grep -E "^\| (blockwise|flow) "
          done
        done
      done ;;
    ovwtune)  # the v3-ep32 overwrite outlier of --config all runs: default, tuning off, default again
      for v in 1 0 1b; do
        FLOWMOE_GEMM_TUNE=${v%b} step bench-ovw-tune$v 240 $B/flowmoe bench --config all --tokens 8192 --reps 5 --recipes blockwise,flow,flow-fp4 --grads overwrite --baseline ${BASE:-$OUT/torch.json}
        echo "FLOWMOE_GEMM_TUNE=${v%b}"; grep -E "^## |^\| (blockwise|flow|flow-fp4) \|" $OUT/bench-ovw-tune$v.log | cut -c1-60
      done ;;
    nccl)  # TWO GPUs (nvidia-h200-x2): the NCCL tests (payload, EP = 2 layer against one GPU, mismatch, dead rank)
      export TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1 NCCL_NVLS_ENABLE=0 NCCL_DEBUG=${NCCL_DEBUG:-WARN}
      echo "GPUs: $(nvidia-smi -L | wc -l)"
      step nccl-tests 150 $B/flowmoe_nccl_tests --verbose
      grep -E "FAIL|SKIPPED|WATCHDOG|PASS |summary|ALL PASSED|FAILED" $OUT/nccl-tests.log | head -40 ;;
    thermal)  # the layer pair of runs (accumulate, then overwrite) with power, clock and temperature
      # sampled every 100 ms; each progress line of the bench gets a timestamp to line them up
      nvidia-smi --query-gpu=timestamp,clocks.sm,power.draw,temperature.gpu,temperature.memory,clocks_throttle_reasons.active --format=csv,noheader -lms 100 > $OUT/thermal-samples.csv 2>&1 &
      P=$!
      for g in accumulate overwrite; do
        stdbuf -oL -eL $B/flowmoe bench --config all --tokens 8192 --reps 5 --recipes blockwise,flow,flow-fp4 --grads $g --baseline ${BASE:-$OUT/torch.json} --no-breakdown 2>&1 \
          | while IFS= read -r l; do echo "$(date +%H:%M:%S.%N | cut -c1-12) $l"; done > $OUT/thermal-$g.log
        grep -E "running|^[0-9:.]+ \| (blockwise|flow|flow-fp4) \|" $OUT/thermal-$g.log | cut -c1-75
      done
      kill $P; sleep 0.2
      awk -F', ' '{split($1,a," "); t=substr(a[2],1,8); n[t]++; c[t]+=$2; p[t]+=$3; g[t]+=$4; if(!(t in first)){first[t]=1; order[++k]=t}} END{for(i=1;i<=k;i++){t=order[i]; printf "%s sm %4.0f MHz  %5.0f W  gpu %3.0f C\n", t, c[t]/n[t], p[t]/n[t], g[t]/n[t]}}' $OUT/thermal-samples.csv | awk 'NR%2==1' ;;
    ncu-stalls)  # the wgrad kernel's warp states (where its warps wait) and its tensor-pipe metrics
      ncu --query-metrics 2>/dev/null | grep -iE "gmma|tensor_op" | head -30 > $OUT/ncu-metric-names.txt
      cat $OUT/ncu-metric-names.txt | cut -c1-100
      m=$(grep -oE "^sm__[a-z_]*gmma[a-z_]*" $OUT/ncu-metric-names.txt | head -4 | sed 's/$/.avg.pct_of_peak_sustained_active/' | paste -sd,)
      step ncu-stalls 200 ncu --clock-control none -k "regex:wgrad_kernel" -c 1 --section WarpStateStats --section ComputeWorkloadAnalysis ${m:+--metrics $m} $B/flowmoe_bench_gemm --wgrad-kernel-only --reps 3
      grep -vE "^==PROF==|^\|" $OUT/ncu-stalls.log | grep -vE "^ *-+ *$" | head -80 ;;
    ncu-gmma)  # the wgrad kernel against cuBLASLt's kernel: tensor-pipe instructions, shared-memory
      # wavefronts and bank conflicts of the WGMMA operand reads, where the warps stall
      ncu --query-metrics 2>/dev/null | awk '{print $1}' | grep -E "^smsp__average_warps_issue_stalled_[a-z_]+_per_issue_active$" > $OUT/stall-names.txt
      st=$(sed 's/$/.ratio/' $OUT/stall-names.txt | paste -sd,)
      m="sm__inst_executed_pipe_tensor_op_gmma.sum,l1tex__data_bank_conflicts_pipe_lsu_mem_shared_op_gmma.sum,l1tex__data_pipe_lsu_wavefronts_mem_shared_op_gmma.sum,sm__cycles_elapsed.avg,gpu__time_duration.sum,smsp__inst_executed.sum${st:+,$st}"
      FLOWMOE_GEMM_TUNE=0 step ncu-gmma 240 ncu --clock-control none -k "regex:wgrad_kernel|nvjet|xmma|cutlass|gemm" --launch-skip 3 -c 3 --metrics "$m" $B/flowmoe_bench_gemm --wgrad-kernel-only --reps 1
      grep -vE "^==PROF==|^\|" $OUT/ncu-gmma.log | grep -vE "^ *-+ *$|Section|Metric Name|Warning" | awk '$NF != "0" && $NF != "(!)"' | head -90 ;;
    ep-tests)  # the one-GPU expert-parallel suites (simulated ranks) on the first GPU
      CUDA_VISIBLE_DEVICES=0 step gpu-tests-ep 300 $B/flowmoe_gpu_tests --gtest_filter='*MoeEp*:*Ep*'
      tail -3 $OUT/gpu-tests-ep.log; grep -B2 -A10 Failure $OUT/gpu-tests-ep.log | head -40 ;;
    *) echo "unknown mode $what" ;;
  esac
done
