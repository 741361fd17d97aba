// Expert biases on the GPU (include/flowmoe/expert_bias.h), bit-identical to flowmoe::cpu.
//
//   add_expert_bias_kernel   one thread per 8 features of a row: the row's segment by binary search
//                            over the offsets, 16-byte loads and stores of h, 2 x 16-byte bias loads.
//   bias_grad_kernel<In, 4>  one thread per (segment, 4 features): each feature's sum over the
//                            segment's rows in row order (the reference's order), one 4- or 8-byte
//                            load per row, eight rows loaded ahead of the adds (<In, 1>: one
//                            feature per thread, for operands not so aligned).
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

// The features c .. c + kCols - 1 of row r as floats (kCols 4: one 8- or 4-byte load; 1: a value).
struct Bf16Rows {
  const bf16_t* dh;
  bool aligned(int) const { return reinterpret_cast<uintptr_t>(dh) % 8 == 0; }
  template <int kCols>
  __device__ __forceinline__ void load(int64_t r, int64_t c, int64_t n, int64_t, float* v) const {
    if constexpr (kCols == 4) {
      const uint2 w = __ldg(reinterpret_cast<const uint2*>(dh + r * n + c));
      v[0] = num::bf16_to_f32(static_cast<bf16_t>(w.x & 0xFFFFu)), v[1] = num::bf16_to_f32(static_cast<bf16_t>(w.x >> 16));
      v[2] = num::bf16_to_f32(static_cast<bf16_t>(w.y & 0xFFFFu)), v[3] = num::bf16_to_f32(static_cast<bf16_t>(w.y >> 16));
    } else {
      v[0] = num::bf16_to_f32(dh[r * n + c]);
    }
  }
};
struct Fp8Rows {
  const uint8_t* codes;
  const uint8_t* scales;
  bool aligned(int) const { return reinterpret_cast<uintptr_t>(codes) % 4 == 0; }
  template <int kCols>
  __device__ __forceinline__ void load(int64_t r, int64_t c, int64_t n, int64_t m, float* v) const {
    const uint8_t s = __ldg(scales + (c / kFp8Block) * m + r);  // (the kCols features share a 128-block)
    if constexpr (kCols == 4) {
      const uint32_t w = __ldg(reinterpret_cast<const uint32_t*>(codes + r * n + c));
#pragma unroll
      for (int q = 0; q < 4; ++q) v[q] = num::dequant_e4m3(static_cast<uint8_t>(w >> (8 * q)), s);
    } else {
      v[0] = num::dequant_e4m3(codes[r * n + c], s);
    }
  }
};

// kCols features per thread, each its own sum over the segment's rows in row order; kRows rows
// loaded ahead of their adds (the loads of a thread are independent; only each feature's adds chain)
template <class In, int kCols>
__global__ void __launch_bounds__(kThreads)
bias_grad_kernel(In in, int64_t m, int64_t n, const int32_t* __restrict__ offsets, float* __restrict__ db,
                 bool accumulate, const int32_t* __restrict__ rows_bound) {
  constexpr int kRows = 8;
  const int e = blockIdx.y;
  const int64_t c = (static_cast<int64_t>(blockIdx.x) * kThreads + threadIdx.x) * kCols;
  if (c >= n) return;
  const int64_t lim = row_limit(m, rows_bound);
  const int64_t r0 = offsets[e];
  const int64_t r1 = offsets[e + 1] < lim ? offsets[e + 1] : lim;
  float s[kCols];
#pragma unroll
  for (int q = 0; q < kCols; ++q) s[q] = 0.0f;
  int64_t r = r0;
  for (; r + kRows <= r1; r += kRows) {
    float v[kRows][kCols];
#pragma unroll
    for (int j = 0; j < kRows; ++j) in.template load<kCols>(r + j, c, n, m, v[j]);
#pragma unroll
    for (int j = 0; j < kRows; ++j)
#pragma unroll
      for (int q = 0; q < kCols; ++q) s[q] = __fadd_rn(s[q], v[j][q]);
  }
  for (; r < r1; ++r) {
    float v[kCols];
    in.template load<kCols>(r, c, n, m, v);
#pragma unroll
    for (int q = 0; q < kCols; ++q) s[q] = __fadd_rn(s[q], v[q]);
  }
#pragma unroll
  for (int q = 0; q < kCols; ++q) {
    float* out = db + e * n + c + q;
    *out = num::f32_canonical(accumulate ? __fadd_rn(*out, s[q]) : s[q]);
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
  if (in.aligned(4)) {  // (n % 8 == 0: every 4-feature group's load is aligned with the base)
    const dim3 grid(static_cast<unsigned>((n / 4 + kThreads - 1) / kThreads), static_cast<unsigned>(num));
    bias_grad_kernel<In, 4><<<grid, kThreads, 0, stream>>>(in, m, n, offsets, db, accumulate, rows_bound);
  } else {
    const dim3 grid(static_cast<unsigned>((n + kThreads - 1) / kThreads), static_cast<unsigned>(num));
    bias_grad_kernel<In, 1><<<grid, kThreads, 0, stream>>>(in, m, n, offsets, db, accumulate, rows_bound);
  }
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
