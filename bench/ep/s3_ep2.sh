B=.devbuild; export NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1
CUDA_VISIBLE_DEVICES=0 timeout 90 $B/flowmoe_gpu_tests --gtest_filter='CopyPieces*:*MoeEp*' > $OUT/gpu-tests-ep.log 2>&1; echo "gpu rc=$?"; tail -3 $OUT/gpu-tests-ep.log
timeout 100 $B/flowmoe_nccl_tests --verbose > $OUT/nccl-tests.log 2>&1; echo "nccl rc=$?"; grep -A6 "summary" $OUT/nccl-tests.log
for d in 0 1048576 def; do
  if [ $d = def ]; then unset FLOWMOE_EP_DIRECT_BYTES; else export FLOWMOE_EP_DIRECT_BYTES=$d; fi
  timeout 100 $B/flowmoe bench-ep --gpus 2 --config v3-ep8,v2,v2-lite --tokens 8192 --no-layer --timeout 90 > $OUT/bench-ep-comm-$d.log 2>&1; echo "comm $d rc=$?"
  grep -E "^\| (bf16|fp8|mxfp4|combine bf16 \(ex)" $OUT/bench-ep-comm-$d.log | cut -c1-90
done
unset FLOWMOE_EP_DIRECT_BYTES
timeout 280 $B/flowmoe bench-ep --gpus 2 --config v3-ep8,v2,v2-lite --tokens 8192 --no-comm --reps 5 --warmup 2 --timeout 270 > $OUT/bench-ep-layer.log 2>&1; echo "layer rc=$?"; tail -30 $OUT/bench-ep-layer.log
