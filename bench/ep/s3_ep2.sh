B=.devbuild; export NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1
timeout 100 $B/flowmoe_nccl_tests --verbose > $OUT/nccl-tests.log 2>&1; echo "nccl rc=$?"; grep -A6 "summary" $OUT/nccl-tests.log; grep -E "FAIL" $OUT/nccl-tests.log | head
for c in 4 1; do
FLOWMOE_EP_COMBINE_CHUNKS=$c timeout 150 $B/flowmoe bench-ep --gpus 2 --config v3-ep8,v2,v2-lite --tokens 8192 --no-comm --recipes bf16,blockwise,flow,flow-fp4 --reps 5 --warmup 2 --timeout 140 $( [ $c = 4 ] && echo --stages ) > $OUT/bench-ep-layer-chunks$c.log 2>&1; echo "layer chunks=$c rc=$?"; grep -E "^\| (bf16|blockwise|flow|flow-fp4) \|" $OUT/bench-ep-layer-chunks$c.log
done
grep -E "combine|GEMM2 fprop" $OUT/bench-ep-layer-chunks4.log | head -20
CUDA_VISIBLE_DEVICES=0 timeout 300 $B/flowmoe_gpu_tests > $OUT/gpu-tests.log 2>&1; echo "gpu rc=$?"; tail -3 $OUT/gpu-tests.log; grep -B2 -A12 Failure $OUT/gpu-tests.log | head -40
