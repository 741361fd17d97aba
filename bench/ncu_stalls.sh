#!/usr/bin/env bash
# Stall breakdown and DRAM bytes of one kernel of flowmoe_bench_convert, under Nsight Compute
# (clock control off: the card's clocks are left alone). Usage: bench/ncu_stalls.sh BENCH KERNEL_REGEX
set -euo pipefail
bench=$1; kernel=$2
m=""
for s in long_scoreboard short_scoreboard barrier lg_throttle mio_throttle drain membar wait \
         math_pipe_throttle no_instruction not_selected selected dispatch_stall tex_throttle; do
  m+="smsp__average_warps_issue_stalled_${s}_per_issue_active.ratio,"
done
m+="dram__bytes_read.sum,dram__bytes_write.sum,smsp__inst_executed.sum,gpu__time_duration.sum,"
m+="sm__warps_active.avg.pct_of_peak_sustained_active,l1tex__data_bank_conflicts_pipe_lsu_mem_shared.sum"
ncu --clock-control none -k "regex:$kernel" -c 1 --metrics "$m" "$bench" --reps 3 --config "DeepSeek-V3 EP8"
