# Third session, one H200: every GPU test, the layer in both gradient modes next to PyTorch, and
# the eager PyTorch kernel baselines next to the fused kernels' benchmarks (logs under $OUT).
B=.devbuild
step() { local n=$1 l=$2; shift 2; local t0=$SECONDS; timeout "$l" "$@" > "$OUT/$n.log" 2>&1; echo "$n rc=$? $((SECONDS-t0))s"; }
step torch-kernels-check 120 python3 bench/torch_kernel_baselines.py --check
tail -3 $OUT/torch-kernels-check.log
step torch-kernels 180 python3 bench/torch_kernel_baselines.py --config all --json $OUT/torch-kernels.json
cat $OUT/torch-kernels.log | tail -40
step bench-swiglu 150 $B/flowmoe_bench_swiglu
step bench-token 150 $B/flowmoe_bench_token
step torch-layer 200 python3 bench/torch_moe_layer.py --tokens 8192 --reps 5 --json $OUT/torch.json
step bench-acc 200 $B/flowmoe bench --config all --tokens 8192 --reps 5 --recipes blockwise,flow,flow-fp4 --no-breakdown --baseline $OUT/torch.json
step bench-ovw 200 $B/flowmoe bench --config all --tokens 8192 --reps 5 --recipes blockwise,flow,flow-fp4 --no-breakdown --grads overwrite --baseline $OUT/torch.json
grep -E "^\| (flow|flow-fp4|blockwise|PyTorch)" $OUT/bench-acc.log $OUT/bench-ovw.log | cut -c1-200
step gpu-tests 300 $B/flowmoe_gpu_tests
tail -3 $OUT/gpu-tests.log; grep -B2 -A10 Failure $OUT/gpu-tests.log | head -30
