# third session, final validation of the last commit on two H200s: every GPU test (first GPU) and
# the NCCL tests
B=.devbuild; export NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1
timeout 60 $B/flowmoe_nccl_tests --verbose > $OUT/nccl-tests.log 2>&1; echo "nccl rc=$?"; grep -A6 "summary" $OUT/nccl-tests.log
CUDA_VISIBLE_DEVICES=0 timeout 240 $B/flowmoe_gpu_tests > $OUT/gpu-tests.log 2>&1; echo "gpu rc=$?"; tail -3 $OUT/gpu-tests.log; grep -B2 -A12 Failure $OUT/gpu-tests.log | head -30
