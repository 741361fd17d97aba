// Expert biases on the GPU (include/flowmoe/expert_bias.h), bit-identical to flowmoe::cpu.
//
//   add_expert_bias_kernel   one thread per 8 features of a row: the row's segment by binary search
//                            over the offsets, 16-byte loads and stores of h, 2 x 16-byte bias loads.
//   bias_grad_kernel         (BF16 dH) one CTA per (segment, 32 features): its 8 warps sum the
//                            segment's 128-row blocks in parallel (warp w the blocks w, w + 8, ...;
//                            lane l feature l, the block's rows in row order, four loaded ahead of
//                            the adds), and after each wave of 8 blocks warp 0 adds their sums in
//                            block order: the reference's order (expert_bias.h), coalesced across a
//                            warp's 32 features.
//   bias_grad_fp8_kernel     (row-wise FP8 dH) the same order, one CTA per (segment, 128 features:
//                            one scale block): lane l features 4l .. 4l + 3, one 4-byte load per row
//                            (128 bytes per warp and row), decoded by the hardware (e4m3x2 -> f16x2
//                            -> f32, exact) and multiplied by the row's scale, as num::dequant_e4m3.
#include <cuda_fp16.h>
#include <cuda_fp8.h>
#include <cuda_runtime.h>

#include "cuda/bias/expert_bias.cuh"
#include "cuda/common.cuh"
#include "flowmoe/error.h"
#include "flowmoe/expert_bias.h"
#include "flowmoe/numerics.h"
#include "flowmoe/swiglu_math.h"

namespace flowmoe {
namespace cuda {
namespace {

using bias_detail::segment_of;
constexpr int kThreads = 256;

__device__ __forceinline__ int64_t row_limit(int64_t m, const int32_t* rows_bound) {
  if (!rows_bound) return m;
  const int64_t b = *rows_bound;
  return b < m ? b : m;
}

__global__ void __launch_bounds__(kThreads)
add_expert_bias_kernel(bf16_t* __restrict__ h, int64_t m, int64_t n, const int32_t* __restrict__ offsets,
                       int num, const float* __restrict__ bias, const int32_t* __restrict__ rows_bound) {
  const int64_t groups = n / 8;
  const int64_t i = static_cast<int64_t>(blockIdx.x) * kThreads + threadIdx.x;
  const int64_t r = i / groups, c = (i % groups) * 8;
  if (r >= row_limit(m, rows_bound)) return;
  const int e = segment_of(offsets, num, r);
  if (e < 0) return;
  uint4* p = reinterpret_cast<uint4*>(h + r * n + c);
  *p = bias_detail::add_bias8(*p, bias + e * n + c);
}


constexpr int kGradCols = 32;                 // features per CTA: one per lane
constexpr int kGradWarps = kThreads / 32;     // blocks summed at once
constexpr int64_t kGradBlock = kExpertBiasBlockRows;

__global__ void __launch_bounds__(kThreads)
bias_grad_kernel(const bf16_t* __restrict__ dh, int64_t m, int64_t n, const int32_t* __restrict__ offsets,
                 float* __restrict__ db, bool accumulate, const int32_t* __restrict__ rows_bound, bool gate_up) {
  __shared__ float part[kGradWarps][kGradCols];
  const int e = blockIdx.y;
  const int warp = threadIdx.x / 32, lane = threadIdx.x % 32;
  const int64_t c = static_cast<int64_t>(blockIdx.x) * kGradCols + lane;
  const int64_t lim = row_limit(m, rows_bound);
  const int64_t r0 = offsets[e];
  const int64_t r1 = offsets[e + 1] < lim ? offsets[e + 1] : lim;
  const int64_t nb = r1 > r0 ? (r1 - r0 + kGradBlock - 1) / kGradBlock : 0;
  float s = 0.0f;  // (warp 0's) the blocks' sums so far, in block order
  for (int64_t w0 = 0; w0 < nb; w0 += kGradWarps) {  // (the same trip count for every thread)
    const int64_t b = w0 + warp;
    float p = 0.0f;
    if (b < nb && c < n) {
      const int64_t rb = r0 + b * kGradBlock, re = rb + kGradBlock < r1 ? rb + kGradBlock : r1;
      int64_t r = rb;
      for (; r + 4 <= re; r += 4) {
        const float v0 = num::bf16_to_f32(dh[r * n + c]), v1 = num::bf16_to_f32(dh[(r + 1) * n + c]),
                    v2 = num::bf16_to_f32(dh[(r + 2) * n + c]), v3 = num::bf16_to_f32(dh[(r + 3) * n + c]);
        p = __fadd_rn(__fadd_rn(__fadd_rn(__fadd_rn(p, v0), v1), v2), v3);
      }
      for (; r < re; ++r) p = __fadd_rn(p, num::bf16_to_f32(dh[r * n + c]));
    }
    part[warp][lane] = p;
    __syncthreads();
    if (warp == 0) {
      const int64_t k = nb - w0 < kGradWarps ? nb - w0 : kGradWarps;
      for (int i = 0; i < k; ++i) s = __fadd_rn(s, part[i][lane]);
    }
    __syncthreads();
  }
  if (warp == 0 && c < n) {
    float* out = db + e * n + (gate_up ? (c % 2 ? n / 2 : 0) + c / 2 : c);
    *out = num::f32_canonical(accumulate ? __fadd_rn(*out, s) : s);
  }
}

// Four E4M3 codes (the bytes of w, lowest first) times the scale sf: num::dequant_e4m3 of each
// (the hardware conversions are exact; the product rounds as the reference's), NaN for a NaN code
// (the final sum is canonicalised, so the NaN's payload does not matter).
__device__ __forceinline__ float4 dequant4(uint32_t w, float sf) {
  const __half2_raw lo = __nv_cvt_fp8x2_to_halfraw2(static_cast<__nv_fp8x2_storage_t>(w & 0xFFFFu), __NV_E4M3);
  const __half2_raw hi = __nv_cvt_fp8x2_to_halfraw2(static_cast<__nv_fp8x2_storage_t>(w >> 16), __NV_E4M3);
  const float2 a = __half22float2(*reinterpret_cast<const __half2*>(&lo));
  const float2 b = __half22float2(*reinterpret_cast<const __half2*>(&hi));
  return make_float4(a.x * sf, a.y * sf, b.x * sf, b.y * sf);
}

__device__ __forceinline__ void add4(float4& p, const float4& v) {
  p.x = __fadd_rn(p.x, v.x), p.y = __fadd_rn(p.y, v.y), p.z = __fadd_rn(p.z, v.z), p.w = __fadd_rn(p.w, v.w);
}

constexpr int kFp8Unroll = 8;  // rows loaded ahead of their adds

__global__ void __launch_bounds__(kThreads)
bias_grad_fp8_kernel(const uint8_t* __restrict__ codes, const uint8_t* __restrict__ scales, int64_t m, int64_t n,
                     const int32_t* __restrict__ offsets, float* __restrict__ db, bool accumulate,
                     const int32_t* __restrict__ rows_bound) {
  __shared__ float4 part[kGradWarps][32];
  const int e = blockIdx.y;
  const int warp = threadIdx.x / 32, lane = threadIdx.x % 32;
  const int64_t cb = blockIdx.x;  // the scale block: features 128 cb .. 128 cb + 127
  const int64_t c = cb * kFp8Block + 4 * lane;
  const uint8_t* __restrict__ sc = scales + cb * m;
  const int64_t lim = row_limit(m, rows_bound);
  const int64_t r0 = offsets[e];
  const int64_t r1 = offsets[e + 1] < lim ? offsets[e + 1] : lim;
  const int64_t nb = r1 > r0 ? (r1 - r0 + kGradBlock - 1) / kGradBlock : 0;
  float4 s = make_float4(0.0f, 0.0f, 0.0f, 0.0f);  // (warp 0's) the blocks' sums so far, in block order
  for (int64_t w0 = 0; w0 < nb; w0 += kGradWarps) {  // (the same trip count for every thread)
    const int64_t b = w0 + warp;
    float4 p = make_float4(0.0f, 0.0f, 0.0f, 0.0f);
    if (b < nb) {
      const int64_t rb = r0 + b * kGradBlock, re = rb + kGradBlock < r1 ? rb + kGradBlock : r1;
      int64_t r = rb;
      for (; r + kFp8Unroll <= re; r += kFp8Unroll) {
        uint32_t w[kFp8Unroll];
        uint8_t q[kFp8Unroll];
#pragma unroll
        for (int i = 0; i < kFp8Unroll; ++i) {
          w[i] = __ldg(reinterpret_cast<const uint32_t*>(codes + (r + i) * n + c));
          q[i] = __ldg(sc + r + i);
        }
#pragma unroll
        for (int i = 0; i < kFp8Unroll; ++i) add4(p, dequant4(w[i], num::ue8m0_to_f32(q[i])));
      }
      for (; r < re; ++r)
        add4(p, dequant4(__ldg(reinterpret_cast<const uint32_t*>(codes + r * n + c)),
                         num::ue8m0_to_f32(__ldg(sc + r))));
    }
    part[warp][lane] = p;
    __syncthreads();
    if (warp == 0) {
      const int64_t k = nb - w0 < kGradWarps ? nb - w0 : kGradWarps;
      for (int i = 0; i < k; ++i) add4(s, part[i][lane]);
    }
    __syncthreads();
  }
  if (warp == 0) {
    float* out = db + e * n + c;
    const float v[4] = {s.x, s.y, s.z, s.w};
#pragma unroll
    for (int i = 0; i < 4; ++i) out[i] = num::f32_canonical(accumulate ? __fadd_rn(out[i], v[i]) : v[i]);
  }
}

void check_args(int64_t m, int64_t n, const int32_t* offsets, int num, const char* what) {
  FLOWMOE_CHECK(m >= 0 && n > 0 && n % 8 == 0,
                what << ": [" << m << ", " << n << "]; expected M >= 0 and N a positive multiple of 8");
  FLOWMOE_CHECK(offsets != nullptr && num >= 1 && num <= 65535,
                what << ": " << num << " segments; expected 1..65535 with device offsets");
}

}  // namespace

void add_expert_bias(bf16_t* h, int64_t m, int64_t n, const int32_t* offsets, int num_segments,
                     const float* bias, const int32_t* rows_bound, cudaStream_t stream) {
  const char* what = "cuda::add_expert_bias";
  check_args(m, n, offsets, num_segments, what);
  FLOWMOE_CHECK(h != nullptr && bias != nullptr && detail::aligned16(h) && detail::aligned16(bias),
                what << ": h and bias must be non-null and 16-byte aligned");
  if (m == 0) return;
  const int64_t threads = m * (n / 8);
  const int64_t blocks = (threads + kThreads - 1) / kThreads;
  add_expert_bias_kernel<<<static_cast<unsigned>(blocks), kThreads, 0, stream>>>(h, m, n, offsets, num_segments,
                                                                                bias, rows_bound);
  FLOWMOE_LAUNCH_CHECK(what);
}

void expert_bias_grad(const bf16_t* dh, int64_t m, int64_t n, const int32_t* offsets, int num_segments,
                      float* db, bool accumulate, const int32_t* rows_bound, cudaStream_t stream, bool dh_gate_up) {
  const char* what = "cuda::expert_bias_grad";
  check_args(m, n, offsets, num_segments, what);
  FLOWMOE_CHECK(!dh_gate_up || n % 2 == 0, what << ": N = " << n << " gate / up pairs; expected an even N");
  FLOWMOE_CHECK(db != nullptr && dh != nullptr, what << ": dh and db must be non-null");
  const dim3 grid(static_cast<unsigned>((n + kGradCols - 1) / kGradCols), static_cast<unsigned>(num_segments));
  bias_grad_kernel<<<grid, kThreads, 0, stream>>>(dh, m, n, offsets, db, accumulate, rows_bound, dh_gate_up);
  FLOWMOE_LAUNCH_CHECK(what);
}

void expert_bias_grad_fp8(const uint8_t* codes, const uint8_t* scales, int64_t m, int64_t n,
                          const int32_t* offsets, int num_segments, float* db, bool accumulate,
                          const int32_t* rows_bound, cudaStream_t stream) {
  const char* what = "cuda::expert_bias_grad_fp8";
  check_args(m, n, offsets, num_segments, what);
  FLOWMOE_CHECK(n % kFp8Block == 0, what << ": N = " << n << "; expected a multiple of 128");
  FLOWMOE_CHECK(db != nullptr && codes != nullptr && scales != nullptr &&
                    reinterpret_cast<uintptr_t>(codes) % 4 == 0,
                what << ": codes, scales and db must be non-null, the codes 4-byte aligned");
  const dim3 grid(static_cast<unsigned>(n / kFp8Block), static_cast<unsigned>(num_segments));
  bias_grad_fp8_kernel<<<grid, kThreads, 0, stream>>>(codes, scales, m, n, offsets, db, accumulate, rows_bound);
  FLOWMOE_LAUNCH_CHECK(what);
}

}  // namespace cuda
}  // namespace flowmoe
