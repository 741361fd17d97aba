B=.devbuild; export NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1
CUDA_VISIBLE_DEVICES=0 timeout 120 $B/flowmoe_gpu_tests --gtest_filter='*MoeEp*:CopyPieces*' > $OUT/gpu-tests-ep.log 2>&1; echo "gpu rc=$?"; tail -3 $OUT/gpu-tests-ep.log; grep -B2 -A12 Failure $OUT/gpu-tests-ep.log | head -40
timeout 100 $B/flowmoe_nccl_tests --verbose > $OUT/nccl-tests.log 2>&1; echo "nccl rc=$?"; grep -A6 "summary" $OUT/nccl-tests.log; grep -E "FAIL" $OUT/nccl-tests.log | head
for d in 1 0; do
FLOWMOE_EP_DEDUP=$d timeout 150 $B/flowmoe bench-ep --gpus 2 --config v3-ep8,v2,v2-lite --tokens 8192 --no-comm --recipes bf16,blockwise,flow,flow-fp4 --reps 5 --warmup 2 --timeout 140 > $OUT/bench-ep-layer-dedup$d.log 2>&1; echo "layer dedup=$d rc=$?"; grep -E "^\| (bf16|blockwise|flow|flow-fp4) \|" $OUT/bench-ep-layer-dedup$d.log
done
