// Expert biases on the GPU (include/flowmoe/expert_bias.h), bit-identical to flowmoe::cpu.
//
//   add_expert_bias_kernel   one thread per 8 features of a row: the row's segment by binary search
//                            over the offsets, 16-byte loads and stores of h, 2 x 16-byte bias loads.
//   bias_grad_kernel<In>     one CTA per (segment, 32 features): its 8 warps sum the segment's
//                            128-row blocks in parallel (warp w the blocks w, w + 8, ...; lane l
//                            feature l, the block's rows in row order, four loaded ahead of the
//                            adds), and after each wave of 8 blocks warp 0 adds their sums in block
//                            order: the reference's order (expert_bias.h), coalesced across a warp's
//                            32 features.
#include <cuda_runtime.h>

#include "cuda/common.cuh"
#include "flowmoe/error.h"
#include "flowmoe/expert_bias.h"
#include "flowmoe/numerics.h"
#include "flowmoe/swiglu_math.h"

namespace flowmoe {
namespace cuda {
namespace {

constexpr int kThreads = 256;

__device__ __forceinline__ int64_t row_limit(int64_t m, const int32_t* rows_bound) {
  if (!rows_bound) return m;
  const int64_t b = *rows_bound;
  return b < m ? b : m;
}

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
  uint4 v = *p;
  const float4* b = reinterpret_cast<const float4*>(bias + e * n + c);
  const float4 b0 = __ldg(b), b1 = __ldg(b + 1);
  const float bb[8] = {b0.x, b0.y, b0.z, b0.w, b1.x, b1.y, b1.z, b1.w};
  uint32_t w[4] = {v.x, v.y, v.z, v.w};
#pragma unroll
  for (int q = 0; q < 4; ++q) {
    const float lo = num::f32_canonical(__fadd_rn(num::bf16_to_f32(static_cast<bf16_t>(w[q] & 0xFFFFu)), bb[2 * q]));
    const float hi = num::f32_canonical(__fadd_rn(num::bf16_to_f32(static_cast<bf16_t>(w[q] >> 16)), bb[2 * q + 1]));
    w[q] = static_cast<uint32_t>(num::f32_to_bf16(lo)) | (static_cast<uint32_t>(num::f32_to_bf16(hi)) << 16);
  }
  *p = make_uint4(w[0], w[1], w[2], w[3]);
}

struct Bf16Rows {
  const bf16_t* dh;
  __device__ __forceinline__ float operator()(int64_t r, int64_t c, int64_t n, int64_t) const {
    return num::bf16_to_f32(dh[r * n + c]);
  }
};
struct Fp8Rows {
  const uint8_t* codes;
  const uint8_t* scales;
  __device__ __forceinline__ float operator()(int64_t r, int64_t c, int64_t n, int64_t m) const {
    return num::dequant_e4m3(codes[r * n + c], scales[(c / kFp8Block) * m + r]);
  }
};

constexpr int kGradCols = 32;                 // features per CTA: one per lane
constexpr int kGradWarps = kThreads / 32;     // blocks summed at once
constexpr int64_t kGradBlock = kExpertBiasBlockRows;

template <class In>
__global__ void __launch_bounds__(kThreads)
bias_grad_kernel(In in, int64_t m, int64_t n, const int32_t* __restrict__ offsets, float* __restrict__ db,
                 bool accumulate, const int32_t* __restrict__ rows_bound) {
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
        const float v0 = in(r, c, n, m), v1 = in(r + 1, c, n, m), v2 = in(r + 2, c, n, m), v3 = in(r + 3, c, n, m);
        p = __fadd_rn(__fadd_rn(__fadd_rn(__fadd_rn(p, v0), v1), v2), v3);
      }
      for (; r < re; ++r) p = __fadd_rn(p, in(r, c, n, m));
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
    float* out = db + e * n + c;
    *out = num::f32_canonical(accumulate ? __fadd_rn(*out, s) : s);
  }
}

void check_args(int64_t m, int64_t n, const int32_t* offsets, int num, const char* what) {
  FLOWMOE_CHECK(m >= 0 && n > 0 && n % 8 == 0,
                what << ": [" << m << ", " << n << "]; expected M >= 0 and N a positive multiple of 8");
  FLOWMOE_CHECK(offsets != nullptr && num >= 1 && num <= 65535,
                what << ": " << num << " segments; expected 1..65535 with device offsets");
}

template <class In>
void launch_grad(In in, int64_t m, int64_t n, const int32_t* offsets, int num, float* db, bool accumulate,
                 const int32_t* rows_bound, cudaStream_t stream, const char* what) {
  check_args(m, n, offsets, num, what);
  FLOWMOE_CHECK(db != nullptr, what << ": null db");
  const dim3 grid(static_cast<unsigned>((n + kGradCols - 1) / kGradCols), static_cast<unsigned>(num));
  bias_grad_kernel<In><<<grid, kThreads, 0, stream>>>(in, m, n, offsets, db, accumulate, rows_bound);
  FLOWMOE_LAUNCH_CHECK(what);
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
                      float* db, bool accumulate, const int32_t* rows_bound, cudaStream_t stream) {
  launch_grad(Bf16Rows{dh}, m, n, offsets, num_segments, db, accumulate, rows_bound, stream,
              "cuda::expert_bias_grad");
}

void expert_bias_grad_fp8(const uint8_t* codes, const uint8_t* scales, int64_t m, int64_t n,
                          const int32_t* offsets, int num_segments, float* db, bool accumulate,
                          const int32_t* rows_bound, cudaStream_t stream) {
  FLOWMOE_CHECK(n % kFp8Block == 0, "cuda::expert_bias_grad_fp8: N = " << n << "; expected a multiple of 128");
  launch_grad(Fp8Rows{codes, scales}, m, n, offsets, num_segments, db, accumulate, rows_bound, stream,
              "cuda::expert_bias_grad_fp8");
}

}  // namespace cuda
}  // namespace flowmoe
