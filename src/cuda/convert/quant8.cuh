// The 8-value FP8 encode and amax of the 128-wide tile kernels (quantize.cu: rows, columns;
// quantize_weights.cu: the weight blocks). Device code only, in the kernels' own namespace.
#pragma once

#include <cstdint>

#include "cuda/convert/tile.cuh"
#include "flowmoe/numerics.h"

namespace flowmoe {
namespace cuda {
namespace detail {

// Quantizes 8 finite-checked bf16 values (packed in a uint4) with scale exponent e -> 8 codes.
__device__ __forceinline__ uint2 encode8(const uint4& v, int e, bool nan_tile) {
  if (nan_tile) return make_uint2(0x7F7F7F7Fu, 0x7F7F7F7Fu);
  const float inv = detail::inv_pow2(e);
  const uint32_t w[4] = {v.x, v.y, v.z, v.w};
  uint32_t out[2];
#pragma unroll
  for (int q = 0; q < 2; ++q) {
    const uint32_t a = w[2 * q], b = w[2 * q + 1];
    const uint32_t lo = detail::e4m3x2(__uint_as_float(a << 16) * inv, __uint_as_float(a & 0xFFFF0000u) * inv);
    const uint32_t hi = detail::e4m3x2(__uint_as_float(b << 16) * inv, __uint_as_float(b & 0xFFFF0000u) * inv);
    out[q] = detail::e4m3x4_saturate_for_scale(lo | (hi << 16), e);
  }
  return make_uint2(out[0], out[1]);
}

// amax and non-finite count of 8 bf16 values
__device__ __forceinline__ void amax8(const uint4& v, float& amax, int& bad) {
  const uint32_t w[4] = {v.x, v.y, v.z, v.w};
#pragma unroll
  for (int q = 0; q < 4; ++q) {
#pragma unroll
    for (int h = 0; h < 2; ++h) {
      const uint16_t b = static_cast<uint16_t>(h ? (w[q] >> 16) : (w[q] & 0xFFFFu));
      if (!detail::bf16_finite(b)) ++bad;
      else amax = fmaxf(amax, __uint_as_float(static_cast<uint32_t>(b & 0x7FFFu) << 16));
    }
  }
}

}  // namespace detail
}  // namespace cuda
}  // namespace flowmoe
