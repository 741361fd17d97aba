// Kernels of the CUDA MoE layer that the operator libraries do not provide (kernels.cuh). The
// arithmetic of each is written to be the CPU backend's (src/cpu/moe_cpu.cpp) operation for
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
constexpr int kWarps = kThreads / 32;

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
inline unsigned grid_1d(int64_t items, int per_block, int64_t cap = 1 << 20) {
  int64_t g = (items + per_block - 1) / per_block;
  if (g < 1) g = 1;
  return static_cast<unsigned>(g < cap ? g : cap);
}
inline void check_ptr(const void* p, const char* name, const char* what) {
  FLOWMOE_CHECK(p != nullptr, what << ": " << name << " is null; expected a device buffer");
}

__device__ __forceinline__ uint32_t max_u32_warp(uint32_t v) {
#pragma unroll
  for (int o = 16; o > 0; o >>= 1) v = max(v, __shfl_xor_sync(0xffffffffu, v, o));
  return v;
}
__device__ __forceinline__ int sum_i_warp(int v) {
#pragma unroll
  for (int o = 16; o > 0; o >>= 1) v += __shfl_xor_sync(0xffffffffu, v, o);
  return v;
}
__device__ __forceinline__ void add_count(unsigned long long* c, int lane, int n) {
  if (c && lane == 0 && n) atomicAdd(c, static_cast<unsigned long long>(n));
}

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

__device__ __forceinline__ void load_bf16x4(const bf16_t* p, float v[4]) {
  const uint2 w = *reinterpret_cast<const uint2*>(p);
  v[0] = __uint_as_float(w.x << 16);
  v[1] = __uint_as_float(w.x & 0xFFFF0000u);
  v[2] = __uint_as_float(w.y << 16);
  v[3] = __uint_as_float(w.y & 0xFFFF0000u);
}

// ---- fp8-naive: FP32 scales ------------------------------------------------------------------------
__host__ __device__ __forceinline__ float naive_scale_of(float amax) {
#if defined(__CUDA_ARCH__)
  return amax > 0.0f ? __fdiv_rn(amax, kE4M3Max) : 1.0f;
#else
  return amax > 0.0f ? amax / kE4M3Max : 1.0f;
#endif
}
// 4 values per lane, one warp per tile of up to 128 values (`valid` lanes' values are real; the
// others must be passed as 0 and are not written). Returns the scale (NaN for a non-finite tile)
// and writes the codes into c4; bad = the tile's non-finite count.
__device__ __forceinline__ float naive_tile4(const float v[4], uint32_t* c4, int* bad_out) {
  uint32_t amax = 0;
  int bad = 0;
#pragma unroll
  for (int i = 0; i < 4; ++i) {
    if (f32_is_finite(v[i])) amax = max(amax, f32_bits(v[i]) & 0x7FFFFFFFu);
    else ++bad;
  }
  amax = max_u32_warp(amax);
  bad = sum_i_warp(bad);
  *bad_out = bad;
  if (bad) {
    *c4 = 0x7F7F7F7Fu;
    return f32_from_bits(kCanonicalNaN);
  }
  const float s = naive_scale_of(f32_from_bits(amax));
  uint32_t packed = 0;
#pragma unroll
  for (int i = 0; i < 4; ++i) packed |= uint32_t(f32_to_e4m3(__fdiv_rn(v[i], s))) << (8 * i);
  *c4 = packed;
  return s;
}
__device__ __forceinline__ float naive_dequant(uint8_t c, float s) {
  if (e4m3_is_nan(c) || f32_is_nan(s)) return f32_from_bits(kCanonicalNaN);
  return __fmul_rn(e4m3_to_f32(c), s);
}

// Index of the FP32 scale of (row r, tile l) in the GEMM-ready layout: expert-packed when the
// offsets are given (s_off [E+1] in shared memory), else [L][M].
__device__ __forceinline__ int64_t act_scale_index(const int32_t* s_off, int E, int64_t m, int64_t L,
                                                   int64_t r, int64_t l) {
  if (!s_off) return l * m + r;
  int lo = 0, hi = E - 1;  // last expert with offsets[e] <= r
  while (lo < hi) {
    const int mid = (lo + hi + 1) / 2;
    if (s_off[mid] <= r) lo = mid;
    else hi = mid - 1;
  }
  const int64_t o = s_off[lo], len = s_off[lo + 1] - o;
  return L * o + l * len + (r - o);
}

__global__ void __launch_bounds__(kThreads)
naive_quantize_row_kernel(const bf16_t* __restrict__ x, int64_t m, int64_t c, const int32_t* __restrict__ offsets,
                          int E, uint8_t* __restrict__ codes, float* __restrict__ scales,
                          unsigned long long* nonfinite) {
  extern __shared__ int32_t s_off[];
  if (offsets)
    for (int i = threadIdx.x; i <= E; i += kThreads) s_off[i] = offsets[i];
  __syncthreads();
  const int lane = threadIdx.x & 31;
  const int64_t L = c / 128, total = m * L;
  for (int64_t w = blockIdx.x * int64_t(kWarps) + (threadIdx.x >> 5); w < total; w += int64_t(gridDim.x) * kWarps) {
    const int64_t r = w / L, l = w % L;
    const int64_t col = l * 128 + lane * 4;
    float v[4];
    load_bf16x4(x + r * c + col, v);
    uint32_t c4;
    int bad;
    const float s = naive_tile4(v, &c4, &bad);
    *reinterpret_cast<uint32_t*>(codes + r * c + col) = c4;
    if (lane == 0) scales[act_scale_index(offsets ? s_off : nullptr, E, m, L, r, l)] = s;
    add_count(nonfinite, lane, bad);
  }
}

__global__ void __launch_bounds__(kThreads)
naive_dequantize_row_kernel(const uint8_t* __restrict__ codes, const float* __restrict__ scales, int64_t m,
                            int64_t c, const int32_t* __restrict__ offsets, int E, bf16_t* __restrict__ y) {
  extern __shared__ int32_t s_off[];
  if (offsets)
    for (int i = threadIdx.x; i <= E; i += kThreads) s_off[i] = offsets[i];
  __syncthreads();
  const int lane = threadIdx.x & 31;
  const int64_t L = c / 128, total = m * L;
  for (int64_t w = blockIdx.x * int64_t(kWarps) + (threadIdx.x >> 5); w < total; w += int64_t(gridDim.x) * kWarps) {
    const int64_t r = w / L, l = w % L;
    const int64_t col = l * 128 + lane * 4;
    const float s = scales[act_scale_index(offsets ? s_off : nullptr, E, m, L, r, l)];
    const uint32_t c4 = *reinterpret_cast<const uint32_t*>(codes + r * c + col);
    uint16_t o[4];
#pragma unroll
    for (int i = 0; i < 4; ++i) o[i] = bf16_canonical(naive_dequant(static_cast<uint8_t>(c4 >> (8 * i)), s));
    *reinterpret_cast<uint2*>(y + r * c + col) =
        make_uint2(uint32_t(o[0]) | (uint32_t(o[1]) << 16), uint32_t(o[2]) | (uint32_t(o[3]) << 16));
  }
}

// Column-wise from the transposed BF16 [C, M]: one warp per (feature, token block).
__global__ void __launch_bounds__(kThreads)
naive_quantize_transposed_kernel(const bf16_t* __restrict__ xt, int64_t c, int64_t m, int64_t max_blocks,
                                 const int32_t* __restrict__ bstart, const int32_t* __restrict__ bend,
                                 uint8_t* __restrict__ codes, float* __restrict__ scales,
                                 unsigned long long* nonfinite) {
  const int lane = threadIdx.x & 31;
  const int64_t total = max_blocks * c;
  for (int64_t w = blockIdx.x * int64_t(kWarps) + (threadIdx.x >> 5); w < total; w += int64_t(gridDim.x) * kWarps) {
    const int64_t b = w / c, feat = w % c;
    const int bs = bstart[b];
    if (bs < 0) continue;  // uniform in the warp
    const int n = bend[b] - bs;
    float v[4];
#pragma unroll
    for (int i = 0; i < 4; ++i) {
      const int t = lane * 4 + i;
      v[i] = t < n ? bf16_to_f32(xt[feat * m + bs + t]) : 0.0f;
    }
    uint32_t c4;
    int bad;
    const float s = naive_tile4(v, &c4, &bad);
#pragma unroll
    for (int i = 0; i < 4; ++i) {
      const int t = lane * 4 + i;
      if (t < n) codes[feat * m + bs + t] = static_cast<uint8_t>(c4 >> (8 * i));
    }
    if (lane == 0) scales[b * c + feat] = s;
    add_count(nonfinite, lane, bad);
  }
}

// Weights: one CTA per (expert, 128x128 block); thread i handles column i % 128 of rows
// i / 128, i / 128 + 2, ...
__global__ void __launch_bounds__(kThreads)
naive_quantize_weights_kernel(const bf16_t* __restrict__ w, int64_t n, int64_t k, uint8_t* __restrict__ codes,
                              float* __restrict__ scales, uint8_t* __restrict__ t_codes,
                              float* __restrict__ t_scales, unsigned long long* nonfinite) {
  __shared__ uint32_t s_max[kWarps];
  __shared__ int s_bad[kWarps];
  const int64_t nb = n / 128, kb = k / 128;
  const int64_t e = blockIdx.z;
  const int64_t bi = blockIdx.y, bj = blockIdx.x;
  const bf16_t* we = w + e * n * k;
  const int cx = threadIdx.x & 127, ry = threadIdx.x >> 7;
  uint32_t amax = 0;
  int bad = 0;
  for (int rr = ry; rr < 128; rr += 2) {
    const float v = bf16_to_f32(we[(bi * 128 + rr) * k + bj * 128 + cx]);
    if (f32_is_finite(v)) amax = max(amax, f32_bits(v) & 0x7FFFFFFFu);
    else ++bad;
  }
  amax = max_u32_warp(amax);
  bad = sum_i_warp(bad);
  if ((threadIdx.x & 31) == 0) {
    s_max[threadIdx.x >> 5] = amax;
    s_bad[threadIdx.x >> 5] = bad;
  }
  __syncthreads();
  amax = 0;
  bad = 0;
  for (int i = 0; i < kWarps; ++i) {
    amax = max(amax, s_max[i]);
    bad += s_bad[i];
  }
  const float s = bad ? f32_from_bits(kCanonicalNaN) : naive_scale_of(f32_from_bits(amax));
  for (int rr = ry; rr < 128; rr += 2) {
    const int64_t row = bi * 128 + rr, col = bj * 128 + cx;
    const float v = bf16_to_f32(we[row * k + col]);
    const uint8_t q = bad ? kE4M3NaN : f32_to_e4m3(__fdiv_rn(v, s));
    codes[e * n * k + row * k + col] = q;
    t_codes[e * n * k + col * n + row] = q;
  }
  if (threadIdx.x == 0) {
    const int64_t ldk = (kb + 3) / 4 * 4, ldn = (nb + 3) / 4 * 4;
    scales[e * nb * ldk + bi * ldk + bj] = s;
    t_scales[e * kb * ldn + bj * ldn + bi] = s;
    if (nonfinite && bad) atomicAdd(nonfinite, static_cast<unsigned long long>(bad));
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
    // Measured on the H200 (flowmoe_bench_router --variants, fifth session): V3 EP8 (E 32) 32 x 64,
    // V3 EP32 (E 8) 8 x 64, V2 (E 20, H 5120) 8 x 64, V2-Lite (E 64, H 2048) 16 x 64: each the
    // fastest variant of its shape.
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

float naive_scale(float amax) { return naive_scale_of(amax); }

// The shape checks of the naive row-wise (de)quantizers: [m, c] with c a positive multiple of 128,
// and 1..4096 experts when per-expert offsets are given.
static void check_naive_rows(const char* what, int64_t m, int64_t c, const int32_t* d_offsets, int num_experts) {
  FLOWMOE_CHECK(m >= 0 && c > 0 && c % 128 == 0,
                what << ": [" << m << ", " << c << "]; expected C a positive multiple of 128");
  FLOWMOE_CHECK(!d_offsets || (num_experts >= 1 && num_experts <= 4096),
                what << ": " << num_experts << " experts with offsets; expected 1..4096");
}

void naive_quantize_row(const bf16_t* x, int64_t m, int64_t c, const int32_t* d_offsets,
                        int num_experts, uint8_t* codes, float* scales, DeviceStatus* status,
                        cudaStream_t stream) {
  const char* what = "moe::naive_quantize_row";
  check_naive_rows(what, m, c, d_offsets, num_experts);
  if (m == 0) return;
  check_ptr(x, "x", what);
  check_ptr(codes, "codes", what);
  check_ptr(scales, "scales", what);
  const size_t smem = d_offsets ? (num_experts + 1) * sizeof(int32_t) : 0;
  naive_quantize_row_kernel<<<grid_1d(m * (c / 128), kWarps), kThreads, smem, stream>>>(
      x, m, c, d_offsets, num_experts, codes, scales, nf(status));
  FLOWMOE_LAUNCH_CHECK("moe::naive_quantize_row_kernel");
}

void naive_dequantize_row(const uint8_t* codes, const float* scales, int64_t m, int64_t c,
                          const int32_t* d_offsets, int num_experts, bf16_t* y,
                          cudaStream_t stream) {
  const char* what = "moe::naive_dequantize_row";
  check_naive_rows(what, m, c, d_offsets, num_experts);
  if (m == 0) return;
  check_ptr(codes, "codes", what);
  check_ptr(scales, "scales", what);
  check_ptr(y, "y", what);
  const size_t smem = d_offsets ? (num_experts + 1) * sizeof(int32_t) : 0;
  naive_dequantize_row_kernel<<<grid_1d(m * (c / 128), kWarps), kThreads, smem, stream>>>(
      codes, scales, m, c, d_offsets, num_experts, y);
  FLOWMOE_LAUNCH_CHECK("moe::naive_dequantize_row_kernel");
}

void naive_quantize_transposed(const bf16_t* xt, int64_t c, const SegmentBlocks& sb,
                               uint8_t* codes, float* scales, DeviceStatus* status,
                               cudaStream_t stream) {
  const char* what = "moe::naive_quantize_transposed";
  FLOWMOE_CHECK(c > 0 && c % 128 == 0, what << ": C = " << c << "; expected a positive multiple of 128");
  FLOWMOE_CHECK(sb.m >= 0 && sb.max_blocks >= segment_max_blocks(sb.m, sb.num_segments),
                what << ": segment blocks sized " << sb.max_blocks << " for M = " << sb.m);
  if (sb.m == 0) return;
  check_ptr(xt, "xt", what);
  check_ptr(codes, "codes", what);
  check_ptr(scales, "scales", what);
  check_ptr(sb.block_start, "block_start", what);
  check_ptr(sb.block_end, "block_end", what);
  naive_quantize_transposed_kernel<<<grid_1d(sb.max_blocks * c, kWarps), kThreads, 0, stream>>>(
      xt, c, sb.m, sb.max_blocks, sb.block_start, sb.block_end, codes, scales, nf(status));
  FLOWMOE_LAUNCH_CHECK("moe::naive_quantize_transposed_kernel");
}

void naive_quantize_weights(const bf16_t* w, int num_experts, int64_t n, int64_t k,
                            uint8_t* codes, float* scales, uint8_t* t_codes, float* t_scales,
                            DeviceStatus* status, cudaStream_t stream) {
  const char* what = "moe::naive_quantize_weights";
  FLOWMOE_CHECK(num_experts >= 1 && num_experts <= 65535 && n > 0 && k > 0 && n % 128 == 0 &&
                    k % 128 == 0,
                what << ": E=" << num_experts << " [" << n << ", " << k
                     << "]; expected N, K positive multiples of 128");
  check_ptr(w, "w", what);
  check_ptr(codes, "codes", what);
  check_ptr(scales, "scales", what);
  check_ptr(t_codes, "t_codes", what);
  check_ptr(t_scales, "t_scales", what);
  const int64_t nb = n / 128, kb = k / 128;
  const int64_t ldk = (kb + 3) / 4 * 4, ldn = (nb + 3) / 4 * 4;
  FLOWMOE_CUDA_CHECK(cudaMemsetAsync(scales, 0, size_t(num_experts) * nb * ldk * sizeof(float), stream));
  FLOWMOE_CUDA_CHECK(cudaMemsetAsync(t_scales, 0, size_t(num_experts) * kb * ldn * sizeof(float), stream));
  const dim3 grid(static_cast<unsigned>(kb), static_cast<unsigned>(nb), static_cast<unsigned>(num_experts));
  naive_quantize_weights_kernel<<<grid, kThreads, 0, stream>>>(w, n, k, codes, scales, t_codes, t_scales,
                                                               nf(status));
  FLOWMOE_LAUNCH_CHECK("moe::naive_quantize_weights_kernel");
}

}  // namespace moe
}  // namespace cuda
}  // namespace flowmoe
