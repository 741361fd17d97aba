// Device pieces of GEMM1's expert bias (flowmoe/expert_bias.h) shared by its kernel
// (expert_bias.cu add_expert_bias) and by the SwiGLU forward, which applies it as it reads h
// (swiglu.h GateUpBias): one place for the segment lookup and the rounding.
#pragma once

#include <cstdint>

#include "cuda/common.cuh"
#include "flowmoe/numerics.h"
#include "flowmoe/swiglu_math.h"  // num::f32_canonical
#include "flowmoe/tensor.h"        // bf16_t

namespace flowmoe {
namespace cuda {
namespace bias_detail {

// The segment holding row r (offsets[0] <= r < offsets[num]); -1 when past the last segment.
__device__ __forceinline__ int segment_of(const int32_t* offsets, int num, int64_t r) {
  if (r >= offsets[num]) return -1;
  int lo = 0, hi = num - 1;  // offsets[lo] <= r < offsets[hi + 1]
  while (lo < hi) {
    const int mid = (lo + hi + 1) >> 1;
    if (offsets[mid] <= r) lo = mid; else hi = mid - 1;
  }
  return lo;
}

// 8 BF16 values of h (packed in a uint4) plus 8 FP32 biases b[0..7] (16-byte aligned):
// bf16_rne(f32(h) + b) each, NaN results canonical (add_expert_bias's bits).
__device__ __forceinline__ uint4 add_bias8(const uint4& v, const float* b) {
  const float4 b0 = __ldg(reinterpret_cast<const float4*>(b)), b1 = __ldg(reinterpret_cast<const float4*>(b) + 1);
  const float bb[8] = {b0.x, b0.y, b0.z, b0.w, b1.x, b1.y, b1.z, b1.w};
  uint32_t w[4] = {v.x, v.y, v.z, v.w};
#pragma unroll
  for (int q = 0; q < 4; ++q) {
    const float lo = num::f32_canonical(__fadd_rn(num::bf16_to_f32(static_cast<bf16_t>(w[q] & 0xFFFFu)), bb[2 * q]));
    const float hi = num::f32_canonical(__fadd_rn(num::bf16_to_f32(static_cast<bf16_t>(w[q] >> 16)), bb[2 * q + 1]));
    w[q] = static_cast<uint32_t>(num::f32_to_bf16(lo)) | (static_cast<uint32_t>(num::f32_to_bf16(hi)) << 16);
  }
  return make_uint4(w[0], w[1], w[2], w[3]);
}

}  // namespace bias_detail
}  // namespace cuda
}  // namespace flowmoe
