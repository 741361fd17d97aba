// UE8M0 scale grids -> the FP32 layouts cuBLASLt's block-scaled FP8 GEMMs read (flowmoe/gemm.h).
// Exact: every UE8M0 code is a power of two representable in FP32 (code 0 = 2^-127 is an FP32
// subnormal), 0xFF becomes the canonical NaN, as in num::ue8m0_to_f32 (the host builders in
// src/cpu/gemm_ref.cpp use the same function, so both sides agree bit for bit).
#include "cuda/common.cuh"
#include "flowmoe/cuda/convert.h"
#include "flowmoe/gemm.h"
#include "flowmoe/numerics.h"

namespace flowmoe {
namespace cuda {
namespace {

constexpr int kThreads = 256;
constexpr int kMaxExperts = 8192;  // offsets live in shared memory: (E+1) * 4 bytes

int grid_for(int64_t items) {
  const int64_t blocks = (items + kThreads - 1) / kThreads;
  return static_cast<int>(blocks < 4096 ? (blocks > 0 ? blocks : 1) : 4096);
}

// Row-wise scales [L][M] (tokens contiguous) -> per expert e, at float offset L*off[e], the block
// [L][M_e]. One thread: 4 consecutive tokens of one K-block row (coalesced reads and writes).
// Every CTA validates the offsets first (0 .. M, non-decreasing); if they are malformed nothing is
// written and CTA 0 counts it once.
__global__ void __launch_bounds__(kThreads)
act_scales_kernel(const uint8_t* __restrict__ in, int64_t m, int64_t L,
                  const int32_t* __restrict__ offsets, int num_experts, float* __restrict__ out,
                  unsigned long long* bad_segments) {
  extern __shared__ int32_t s_off[];
  __shared__ int s_ok;
  if (threadIdx.x == 0) s_ok = 1;
  __syncthreads();
  for (int e = threadIdx.x; e <= num_experts; e += blockDim.x) {
    const int32_t v = offsets[e];
    s_off[e] = v;
    const bool ok = e == 0 ? v == 0 : (v >= offsets[e - 1] && (e < num_experts || v == m));
    if (!ok) atomicAnd(&s_ok, 0);
  }
  __syncthreads();
  if (!s_ok) {
    if (blockIdx.x == 0 && threadIdx.x == 0 && bad_segments) atomicAdd(bad_segments, 1ull);
    return;
  }
  const int64_t groups = (m + 3) / 4;
  const int64_t items = L * groups;
  for (int64_t g = blockIdx.x * static_cast<int64_t>(blockDim.x) + threadIdx.x; g < items;
       g += static_cast<int64_t>(gridDim.x) * blockDim.x) {
    const int64_t kb = g / groups;
    const int64_t t0 = (g - kb * groups) * 4;
    // largest e with off[e] <= t0 (then off[e+1] > t0 since off[E] = m > t0)
    int lo = 0, hi = num_experts;
    while (hi - lo > 1) {
      const int mid = (lo + hi) >> 1;
      if (s_off[mid] <= t0) lo = mid;
      else hi = mid;
    }
    int e = lo;
    for (int j = 0; j < 4; ++j) {
      const int64_t t = t0 + j;
      if (t >= m) break;
      while (t >= s_off[e + 1]) ++e;
      const int64_t off = s_off[e], me = s_off[e + 1] - off;
      out[L * off + kb * me + (t - off)] = num::ue8m0_to_f32(in[kb * m + t]);
    }
  }
}

// Elementwise, four at a time (n % 4 == 0; in 4-byte and out 16-byte aligned).
__global__ void __launch_bounds__(kThreads)
col_scales_kernel(const uchar4* __restrict__ in, int64_t n4, float4* __restrict__ out) {
  for (int64_t i = blockIdx.x * static_cast<int64_t>(blockDim.x) + threadIdx.x; i < n4;
       i += static_cast<int64_t>(gridDim.x) * blockDim.x) {
    const uchar4 c = in[i];
    out[i] = make_float4(num::ue8m0_to_f32(c.x), num::ue8m0_to_f32(c.y), num::ue8m0_to_f32(c.z),
                         num::ue8m0_to_f32(c.w));
  }
}

// [E][rb][cb] -> [E][rb][ld], padding columns 0.
__global__ void __launch_bounds__(kThreads)
weight_scales_kernel(const uint8_t* __restrict__ in, int64_t rows_total, int64_t cb, int64_t ld,
                     float* __restrict__ out) {
  const int64_t total = rows_total * ld;
  for (int64_t i = blockIdx.x * static_cast<int64_t>(blockDim.x) + threadIdx.x; i < total;
       i += static_cast<int64_t>(gridDim.x) * blockDim.x) {
    const int64_t r = i / ld, c = i - r * ld;
    out[i] = c < cb ? num::ue8m0_to_f32(in[r * cb + c]) : 0.0f;
  }
}

void check_common(const void* in, const void* out, int64_t count, const char* what) {
  if (count == 0) return;
  FLOWMOE_CHECK(in != nullptr && out != nullptr,
                what << ": null pointer (scales " << in << ", out " << out
                     << "); expected device pointers for " << count << " scales");
  FLOWMOE_CHECK(detail::aligned16(out), what << ": out = " << out
                                             << " is not 16-byte aligned; expected 16-byte "
                                                "alignment (cuBLASLt reads scales from 16-byte "
                                                "aligned addresses)");
}

}  // namespace

void act_scales_to_f32(const uint8_t* scales, int64_t m, int64_t c, const int32_t* d_offsets,
                       int num_experts, float* out, DeviceStatus* status, cudaStream_t stream) {
  const char* what = "act_scales_to_f32";
  FLOWMOE_CHECK(m >= 0 && c > 0 && c % kFp8Block == 0,
                what << ": shape [" << m << ", " << c
                     << "] invalid; expected M >= 0 and C a positive multiple of 128");
  FLOWMOE_CHECK(num_experts >= 1 && num_experts <= kMaxExperts,
                what << ": " << num_experts << " experts; expected 1 .. " << kMaxExperts);
  FLOWMOE_CHECK(d_offsets != nullptr, what << ": offsets pointer is null; expected [E+1] device "
                                              "token offsets");
  const int64_t L = c / kFp8Block;
  check_common(scales, out, m * L, what);
  if (m == 0) return;
  act_scales_kernel<<<grid_for(L * ((m + 3) / 4)), kThreads, (num_experts + 1) * sizeof(int32_t),
                      stream>>>(scales, m, L, d_offsets, num_experts, out,
                                status ? &status->bad_segments : nullptr);
  FLOWMOE_LAUNCH_CHECK("act_scales_kernel");
}

void col_scales_to_f32(const uint8_t* scales, int64_t num_blocks, int64_t c, float* out,
                       cudaStream_t stream) {
  const char* what = "col_scales_to_f32";
  FLOWMOE_CHECK(num_blocks >= 0 && c > 0 && c % kFp8Block == 0,
                what << ": grid [" << num_blocks << ", " << c
                     << "] invalid; expected num_blocks >= 0 and C a positive multiple of 128");
  const int64_t n = num_blocks * c;
  check_common(scales, out, n, what);
  if (n == 0) return;
  FLOWMOE_CHECK((reinterpret_cast<uintptr_t>(scales) & 3u) == 0,
                what << ": scales = " << static_cast<const void*>(scales)
                     << " is not 4-byte aligned; expected the start of a scale grid");
  col_scales_kernel<<<grid_for(n / 4), kThreads, 0, stream>>>(
      reinterpret_cast<const uchar4*>(scales), n / 4, reinterpret_cast<float4*>(out));
  FLOWMOE_LAUNCH_CHECK("col_scales_kernel");
}

void weight_scales_to_f32(const uint8_t* scales, int num_experts, int64_t rows, int64_t cols,
                          float* out, cudaStream_t stream) {
  const char* what = "weight_scales_to_f32";
  FLOWMOE_CHECK(num_experts >= 1, what << ": " << num_experts << " experts; expected >= 1");
  FLOWMOE_CHECK(rows > 0 && cols > 0 && rows % kFp8Block == 0 && cols % kFp8Block == 0,
                what << ": weight [" << rows << ", " << cols
                     << "] invalid; expected positive multiples of 128");
  const int64_t rows_total = static_cast<int64_t>(num_experts) * (rows / kFp8Block);
  const int64_t ld = gemm::weight_scale_ld(cols);
  check_common(scales, out, rows_total * ld, what);
  weight_scales_kernel<<<grid_for(rows_total * ld), kThreads, 0, stream>>>(
      scales, rows_total, cols / kFp8Block, ld, out);
  FLOWMOE_LAUNCH_CHECK("weight_scales_kernel");
}

}  // namespace cuda
}  // namespace flowmoe
