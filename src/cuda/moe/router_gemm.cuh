// The router's two FP32 GEMMs (kernels.cuh: router_logits, router_dwr) and the dx combine as
// kernel templates, so that the launchers (kernels.cu), the benchmark (bench/flowmoe_bench_router.cu)
// and the GPU test (tests/cuda/test_router_gemm_gpu.cu) instantiate the same code. Contract and
// design: router_gemm_common.cuh; the forward kernels: router_gemm_logits.cuh; the backward
// kernels (dWr, combine_dx): router_gemm_backward.cuh.
#pragma once

#include "cuda/moe/router_gemm_backward.cuh"
#include "cuda/moe/router_gemm_logits.cuh"
