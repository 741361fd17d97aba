// The sm_90a FP8 wgrad kernel with 1x128 token-block scales behind cuda::GroupedGemm::wgrad
// (sm90_fp8_wgrad_1x128.cu; docs/GEMM.md).
#pragma once
#include <cstdint>

#include "flowmoe/tensor.h"

typedef struct CUstream_st* cudaStream_t;

namespace flowmoe {
namespace cuda {
namespace sm90 {

constexpr int kMaxWgradExperts = 256;

// dW [E][N][K] FP32 (+)= per expert dY_col_e . X_col_e^T with 1x128 scales along tokens (gemm.h
// conventions; scales GEMM-ready FP32 [NB][N], [NB][K]). The problem must pass
// gemm::wgrad_kernel_unsupported (checked: flowmoe::Error otherwise) and every pointer be 16-byte
// aligned (TMA and bulk copies; the caller checks). Zero-token experts: zero-filled when
// overwriting, untouched when accumulating. `tile_counter`: one device int of the caller's, used
// by no other launch at the same time (reset here, stream-ordered; two calls overlapping on
// different streams would share it and skip or repeat tiles). Nothing is enqueued before
// everything that can throw has run. One kernel launch on `stream`; returns the launches (0 when
// every expert is empty).
int64_t fp8_wgrad_1x128(const Segments& seg, int64_t n, int64_t k, const uint8_t* dy_codes, const float* dy_scales,
                   const uint8_t* x_codes, const float* x_scales, float* dw, bool accumulate, int* tile_counter,
                   cudaStream_t stream);

}  // namespace sm90
}  // namespace cuda
}  // namespace flowmoe
