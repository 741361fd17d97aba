// Kernels of the CUDA MoE layer that the operator libraries do not provide (kernels.cuh). The
// arithmetic of each is written to be the CPU backend's (src/cpu/moe/) operation for
// operation; where a reduction order differs it says so (docs/MOE_GPU.md §3).
#include <cuda_bf16.h>

#include <cmath>

#include "cuda/common.cuh"
#include "cuda/moe/kernels.cuh"
#include "cuda/moe/router_gemm.cuh"
#include "flowmoe/error.h"
#include "flowmoe/numerics.h"
#include "flowmoe/swiglu_math.h"  // f32_is_nan, bf16_canonical

namespace flowmoe {
namespace cuda {
namespace moe {
namespace {

using namespace flowmoe::num;

constexpr int kThreads = 256;

inline bool aligned16(const void* p) { return (reinterpret_cast<uintptr_t>(p) & 15u) == 0; }
// The dWr tile (experts per CTA, 32, 16 or 8) for E experts, H features, `sms` SMs (router_dwr).
int dwr_tile(int e, int64_t h, int64_t sms) {
  const int64_t hb = (h + 63) / 64;
  int best = 32;
  int64_t best_load = -1;
  for (int be : {32, 16, 8}) {
    const int64_t blocks = (e + be - 1) / be * hb;
    const int64_t load = (blocks + sms - 1) / sms * be;
    if (best_load < 0 || load < best_load) best = be, best_load = load;
  }
  return best;
}
using ::flowmoe::cuda::detail::grid_1d;
using ::flowmoe::cuda::detail::check_ptr;

// ---- utilities -----------------------------------------------------------------------------------
__global__ void f32_to_bf16_kernel(const float* __restrict__ in, int64_t n, bf16_t* __restrict__ out,
                                   unsigned long long* nonfinite) {
  int bad = 0;
  for (int64_t i = blockIdx.x * int64_t(blockDim.x) + threadIdx.x; i < n; i += int64_t(gridDim.x) * blockDim.x) {
    const float v = in[i];
    bad += !f32_is_finite(v);
    out[i] = num::f32_to_bf16(v);
  }
  if (nonfinite && bad) atomicAdd(nonfinite, static_cast<unsigned long long>(bad));
}

__device__ __forceinline__ int bf16_nonfinite(uint32_t h) { return (h & 0x7F80u) == 0x7F80u; }
// n8 groups of 8 values as 16-byte vectors (both pointers 16-byte aligned), then the tail one by one
__global__ void copy_bf16_checked_kernel(const bf16_t* __restrict__ in, int64_t n, int64_t n8,
                                         bf16_t* __restrict__ out, unsigned long long* nonfinite) {
  int bad = 0;
  const int64_t stride = int64_t(gridDim.x) * blockDim.x;
  for (int64_t i = blockIdx.x * int64_t(blockDim.x) + threadIdx.x; i < n8; i += stride) {
    const uint4 v = reinterpret_cast<const uint4*>(in)[i];
    const uint32_t words[4] = {v.x, v.y, v.z, v.w};
#pragma unroll
    for (int j = 0; j < 4; ++j) bad += bf16_nonfinite(words[j]) + bf16_nonfinite(words[j] >> 16);
    if (out) reinterpret_cast<uint4*>(out)[i] = v;
  }
  for (int64_t i = n8 * 8 + blockIdx.x * int64_t(blockDim.x) + threadIdx.x; i < n; i += stride) {
    bad += bf16_nonfinite(in[i]);
    if (out) out[i] = in[i];
  }
  if (nonfinite && bad) atomicAdd(nonfinite, static_cast<unsigned long long>(bad));
}

__device__ __forceinline__ uint64_t splitmix64(uint64_t x) {
  x += 0x9E3779B97F4A7C15ull;
  x = (x ^ (x >> 30)) * 0xBF58476D1CE4E5B9ull;
  x = (x ^ (x >> 27)) * 0x94D049BB133111EBull;
  return x ^ (x >> 31);
}
__global__ void fill_normal_kernel(float* __restrict__ f32, bf16_t* __restrict__ bf16, int64_t n,
                                   uint64_t seed, float stddev) {
  for (int64_t i = blockIdx.x * int64_t(blockDim.x) + threadIdx.x; i < n; i += int64_t(gridDim.x) * blockDim.x) {
    const uint64_t r = splitmix64(seed * 0x100000001B3ull + static_cast<uint64_t>(i));
    const float u1 = (static_cast<float>(r >> 40) + 0.5f) * (1.0f / 16777216.0f);  // (0, 1)
    const float u2 = static_cast<float>((r >> 16) & 0xFFFFFFu) * (1.0f / 16777216.0f);
    const float v = stddev * sqrtf(-2.0f * logf(u1)) * cospif(2.0f * u2);
    if (f32) f32[i] = v;
    if (bf16) bf16[i] = num::f32_to_bf16(v);
  }
}

// ---- router GEMMs: router_gemm.cuh ----------------------------------------------------------------

__global__ void scatter_row_probs_kernel(const float* __restrict__ probs, const int32_t* __restrict__ row_map,
                                         int64_t n, float* __restrict__ prow) {
  for (int64_t i = blockIdx.x * int64_t(blockDim.x) + threadIdx.x; i < n; i += int64_t(gridDim.x) * blockDim.x) {
    const int32_t r = row_map[i];
    if (r >= 0) prow[r] = probs[i];
  }
}
__global__ void gather_row_dprobs_kernel(const float* __restrict__ part, int64_t tiles, int64_t m,
                                         const int32_t* __restrict__ row_map, int64_t n,
                                         float* __restrict__ dprobs) {
  for (int64_t i = blockIdx.x * int64_t(blockDim.x) + threadIdx.x; i < n; i += int64_t(gridDim.x) * blockDim.x) {
    const int32_t r = row_map[i];
    float acc = 0.0f;
    if (r >= 0) {  // swiglu.h's order: part[0] + part[1] + ... (cuda::sum_dprow_parts)
      acc = part[r];
      for (int64_t b = 1; b < tiles; ++b) acc = __fadd_rn(acc, part[b * m + r]);
    }
    dprobs[i] = f32_canonical(acc);
  }
}


unsigned long long* nf(DeviceStatus* st) { return st ? &st->nonfinite : nullptr; }

}  // namespace

// =====================================================================================================
// launchers
// =====================================================================================================
void f32_to_bf16(const float* in, int64_t n, bf16_t* out, DeviceStatus* status, cudaStream_t stream) {
  FLOWMOE_CHECK(n >= 0, "moe::f32_to_bf16: n = " << n << " < 0");
  if (n == 0) return;
  check_ptr(in, "in", "moe::f32_to_bf16");
  check_ptr(out, "out", "moe::f32_to_bf16");
  f32_to_bf16_kernel<<<grid_1d(n, kThreads * 8), kThreads, 0, stream>>>(in, n, out, nf(status));
  FLOWMOE_LAUNCH_CHECK("moe::f32_to_bf16_kernel");
}

void copy_bf16_checked(const bf16_t* in, int64_t n, bf16_t* out, DeviceStatus* status, cudaStream_t stream) {
  FLOWMOE_CHECK(n >= 0, "moe::copy_bf16_checked: n = " << n << " < 0");
  if (n == 0) return;
  check_ptr(in, "in", "moe::copy_bf16_checked");
  const bool vec = (reinterpret_cast<uintptr_t>(in) | reinterpret_cast<uintptr_t>(out)) % 16 == 0;
  const int64_t n8 = vec ? n / 8 : 0;
  copy_bf16_checked_kernel<<<grid_1d(n, kThreads * 8), kThreads, 0, stream>>>(in, n, n8, out, nf(status));
  FLOWMOE_LAUNCH_CHECK("moe::copy_bf16_checked_kernel");
}

void fill_normal(float* f32, bf16_t* bf16, int64_t n, uint64_t seed, float stddev, cudaStream_t stream) {
  FLOWMOE_CHECK(n >= 0, "moe::fill_normal: n = " << n << " < 0");
  if (n == 0) return;
  FLOWMOE_CHECK(f32 || bf16, "moe::fill_normal: both outputs are null");
  fill_normal_kernel<<<grid_1d(n, kThreads * 8), kThreads, 0, stream>>>(f32, bf16, n, seed, stddev);
  FLOWMOE_LAUNCH_CHECK("moe::fill_normal_kernel");
}

void router_logits(const bf16_t* x, const float* wr, int64_t t, int e, int64_t h, float* z,
                   cudaStream_t stream) {
  namespace rg = router_gemm;
  const char* what = "moe::router_logits";
  FLOWMOE_CHECK(t >= 0 && e >= 1 && h > 0 && h % rg::kTiledChunk == 0,
                what << ": shape T=" << t << " E=" << e << " H=" << h
                     << " invalid; expected T >= 0, E >= 1, H a positive multiple of 32");
  if (t == 0) return;
  check_ptr(x, "x", what);
  check_ptr(wr, "wr", what);
  check_ptr(z, "z", what);
  if (h % rg::kLogitsChunk == 0 && aligned16(x) && aligned16(wr)) {
    // <expert lanes, experts per thread, tokens per thread, warps, stages>; tiles BE x BT:
    if (e <= 8) rg::launch_staged_logits<8, 1, 4, 4, 4>(x, wr, t, e, h, z, stream);          //  8 x 64
    else if (e <= 16) rg::launch_staged_logits<16, 1, 4, 8, 4>(x, wr, t, e, h, z, stream);   // 16 x 64
    else if (e <= 32) rg::launch_staged_logits<16, 2, 4, 8, 4>(x, wr, t, e, h, z, stream);   // 32 x 64
    else rg::launch_staged_logits<32, 2, 4, 8, 4>(x, wr, t, e, h, z, stream);                // 64 x 32
  } else {
    rg::launch_tiled_logits(x, wr, t, e, h, z, stream);  // H % 64 == 32, or unaligned operands
  }
  FLOWMOE_LAUNCH_CHECK("moe::router_logits_kernel");
}

void router_dwr(const float* dz, const bf16_t* x, int64_t t, int e, int64_t h, float* dwr,
                cudaStream_t stream) {
  namespace rg = router_gemm;
  const char* what = "moe::router_dwr";
  FLOWMOE_CHECK(t >= 0 && e >= 1 && h > 0,
                what << ": shape T=" << t << " E=" << e << " H=" << h
                     << " invalid; expected T >= 0, E >= 1, H >= 1");
  if (t == 0) return;
  check_ptr(dz, "dz", what);
  check_ptr(x, "x", what);
  check_ptr(dwr, "dwr", what);
  if (h % 8 == 0 && aligned16(x) && (reinterpret_cast<uintptr_t>(dz) & 3u) == 0) {
    // <experts per thread, warps along E, warps along H, stages>; tiles BE x 64 with BE 32, 16
    // or 8. Each output's sum runs over all T tokens in one thread, so a CTA's time is set by BE
    // (the rows of a tile past E cost as much as real ones) and the step by the busiest SM:
    // choose the smallest ceil(blocks / SMs) * BE, the larger tile on a tie (more reuse of each
    // staged x chunk). The order of every sum, hence the bits, is the same for every tile.
    // This rule picks, at the DeepSeek V3 EP8 / EP32, V2 and V2-Lite shapes, the variant that
    // `flowmoe_bench_router --variants` times fastest.
    const int tile = dwr_tile(e, h, detail::device_sm_count());
    if (tile == 32) rg::launch_staged_dwr<2, 8, 1, 4>(dz, x, t, e, h, dwr, stream);
    else if (tile == 16) rg::launch_staged_dwr<2, 4, 1, 4>(dz, x, t, e, h, dwr, stream);
    else rg::launch_staged_dwr<1, 4, 1, 4>(dz, x, t, e, h, dwr, stream);
  } else {
    rg::launch_tiled_dwr(dz, x, t, e, h, dwr, stream);  // H % 8 != 0, or unaligned operands
  }
  FLOWMOE_LAUNCH_CHECK("moe::router_dwr_kernel");
}

void combine_dx(const bf16_t* rows, const int32_t* row_map, int64_t t, int topk, const float* dz,
                const float* wr, int e, int64_t h, bf16_t* dx, cudaStream_t stream) {
  namespace rg = router_gemm;
  const char* what = "moe::combine_dx";
  FLOWMOE_CHECK(t >= 0 && topk >= 1 && e >= 1 && h > 0 && h % 8 == 0,
                what << ": shape T=" << t << " k=" << topk << " E=" << e << " H=" << h
                     << " invalid; expected H a positive multiple of 8");
  if (t == 0) return;
  check_ptr(rows, "rows", what);
  check_ptr(row_map, "row_map", what);
  check_ptr(dx, "dx", what);
  FLOWMOE_CHECK(!dz || wr, what << ": dz given without wr");
  auto aligned8 = [](const void* p) { return (reinterpret_cast<uintptr_t>(p) & 7u) == 0; };
  if (aligned8(rows) && aligned8(dx) && (!dz || aligned16(wr)))
    rg::launch_combine_dx4(rows, row_map, t, topk, dz, wr, e, h, dx, stream);
  else
    rg::launch_combine_dx2(rows, row_map, t, topk, dz, wr, e, h, dx, stream);
  FLOWMOE_LAUNCH_CHECK("moe::combine_dx_kernel");
}

void scatter_row_probs(const float* probs, const int32_t* row_map, int64_t t, int topk,
                       float* prow, cudaStream_t stream) {
  const int64_t n = t * topk;
  if (n == 0) return;
  scatter_row_probs_kernel<<<grid_1d(n, kThreads), kThreads, 0, stream>>>(probs, row_map, n, prow);
  FLOWMOE_LAUNCH_CHECK("moe::scatter_row_probs_kernel");
}

void gather_row_dprobs(const float* dprow_part, int64_t tiles, int64_t m, const int32_t* row_map,
                       int64_t t, int topk, float* dprobs, cudaStream_t stream) {
  const int64_t n = t * topk;
  if (n == 0) return;
  FLOWMOE_CHECK(tiles >= 1 && dprow_part != nullptr,
                "moe::gather_row_dprobs: " << tiles << " tiles of partial sums; expected >= 1, non-null");
  gather_row_dprobs_kernel<<<grid_1d(n, kThreads), kThreads, 0, stream>>>(dprow_part, tiles, m, row_map,
                                                                          n, dprobs);
  FLOWMOE_LAUNCH_CHECK("moe::gather_row_dprobs_kernel");
}

}  // namespace moe
}  // namespace cuda
}  // namespace flowmoe
