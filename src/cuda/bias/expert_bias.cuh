// Device pieces of GEMM1's expert bias (flowmoe/expert_bias.h) shared by its kernel
// (expert_bias.cu add_expert_bias), by the SwiGLU forward, which applies it as it reads h
// (swiglu.h GateUpBias), and by GEMM1's fused SwiGLU epilogue: one place for the segment lookup
// and the rounding.
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

// One BF16 value of h plus its FP32 bias: bf16_rne(f32(h) + b), a NaN result canonical
// (add_expert_bias's bits).
__device__ __forceinline__ uint32_t add_bias1(uint32_t h_bits, float b) {
  const float v = num::f32_canonical(__fadd_rn(num::bf16_to_f32(static_cast<bf16_t>(h_bits)), b));
  return static_cast<uint32_t>(num::f32_to_bf16(v));
}
// Two BF16 values packed in a word (low half first) plus their biases b.x, b.y.
__device__ __forceinline__ uint32_t add_bias2(uint32_t w, float2 b) {
  return add_bias1(w & 0xFFFFu, b.x) | (add_bias1(w >> 16, b.y) << 16);
}
// 8 BF16 values of h (packed in a uint4) plus 8 FP32 biases b[0..7] (16-byte aligned).
__device__ __forceinline__ uint4 add_bias8(const uint4& v, const float* b) {
  const float4 b0 = __ldg(reinterpret_cast<const float4*>(b)), b1 = __ldg(reinterpret_cast<const float4*>(b) + 1);
  return make_uint4(add_bias2(v.x, make_float2(b0.x, b0.y)), add_bias2(v.y, make_float2(b0.z, b0.w)),
                    add_bias2(v.z, make_float2(b1.x, b1.y)), add_bias2(v.w, make_float2(b1.z, b1.w)));
}

}  // namespace bias_detail
}  // namespace cuda
}  // namespace flowmoe
