B=.devbuild; export NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1
timeout 100 $B/flowmoe_nccl_tests --verbose > $OUT/nccl-tests.log 2>&1; echo "nccl rc=$?"; grep -A6 "summary" $OUT/nccl-tests.log
timeout 200 $B/flowmoe bench-ep --gpus 2 --config v3-ep8,v2,v2-lite --tokens 8192 --stages --reps 5 --warmup 2 --timeout 190 > $OUT/bench-ep-all-stages.log 2>&1; echo "layer rc=$?"; grep -E "^\| (bf16|blockwise|fp8-naive|flow|flow-fp4|fp8|mxfp4) \|" $OUT/bench-ep-all-stages.log; grep -E "combine dX|GEMM1 wgrad" $OUT/bench-ep-all-stages.log
