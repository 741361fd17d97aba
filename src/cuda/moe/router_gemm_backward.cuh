// The router's backward kernels (kernels.cuh: router_dwr, combine_dx) as kernel templates: dWr
// [E, H] += dz^T . x (the staged kernel and its launcher), the dx combine with the router path
// (combine_dx4), and the previous kernels (tiled_dwr: the fallback for operands that are not
// 16-byte aligned or H % 8 != 0, and the benchmark's baseline; combine_dx2) with their launchers.
// Contract and design: router_gemm_common.cuh.
#pragma once

#include "cuda/moe/router_gemm_common.cuh"

namespace flowmoe {
namespace cuda {
namespace moe {
namespace router_gemm {
namespace {  // internal linkage: each including translation unit owns its instantiations

// =================================================================================================
// dwr: dwr [E, H] += dz [T, E]^T . x [T, H] (bf16), sums over t in order
// =================================================================================================
constexpr int kDwrChunk = 64;  // tokens per staged chunk

template <int TE, int WE, int WH, int STAGES>
struct DwrTile {
  static_assert(STAGES >= 2, "at least double buffering");
  static constexpr int kBE = 2 * TE * WE;   // experts per CTA
  static constexpr int kBH = 64 * WH;       // features per CTA
  static constexpr int kThreads = 32 * WE * WH;
  static constexpr int kXBytes = kDwrChunk * kBH * 2;
  static constexpr int kDBytes = kDwrChunk * kBE * 4;
  static constexpr int kStageBytes = kXBytes + kDBytes;  // multiple of 16 (kBE even... x 4 x 64)
  static constexpr int kSmemBytes = STAGES * kStageBytes;
  static int64_t blocks(int e, int64_t h) { return int64_t((e + kBE - 1) / kBE) * ((h + kBH - 1) / kBH); }
};

// dz_vec: E % 4 == 0 and dz 16-byte aligned (16-byte copies of dz rows), else 4-byte copies.
template <int TE, int WE, int WH, int STAGES>
__global__ void __launch_bounds__(32 * WE * WH, 32 * WE * WH <= 128 ? 3 : 2)
staged_dwr_kernel(const float* __restrict__ dz, const bf16_t* __restrict__ x, int64_t T, int E,
                  int64_t H, bool dz_vec, float* __restrict__ dwr) {
  using D = DwrTile<TE, WE, WH, STAGES>;
  static_assert(TE == 1 || TE == 2 || TE == 4, "experts per thread: 1, 2 or 4");
  extern __shared__ __align__(16) unsigned char smem[];
  const int n_eb = (E + D::kBE - 1) / D::kBE;
  const int e0 = static_cast<int>(blockIdx.x % n_eb) * D::kBE;
  const int64_t h0 = int64_t(blockIdx.x / n_eb) * D::kBH;
  const int warp = threadIdx.x >> 5, lane = threadIdx.x & 31;
  const int we = warp % WE, wh = warp / WE;
  const int le = we * 2 * TE + (lane & 1) * TE;  // the thread's experts: e0 + le + j, j < TE
  const int lh = wh * 64 + (lane >> 1) * 4;      // the thread's features: h0 + lh + k, k < 4
  const int64_t nch = (T + kDwrChunk - 1) / kDwrChunk;

  auto load = [&](int64_t c, int s) {
    const int64_t tc0 = c * kDwrChunk;
    unsigned char* st = smem + s * D::kStageBytes;
    bf16_t* xs = reinterpret_cast<bf16_t*>(st);
    float* ds = reinterpret_cast<float*>(st + D::kXBytes);
    constexpr int kRowV = D::kBH / 8;  // 16-byte vectors per staged x row
    constexpr int kXV = kDwrChunk * kRowV;
#pragma unroll
    for (int k = 0; k < (kXV + D::kThreads - 1) / D::kThreads; ++k) {
      const int i = threadIdx.x + k * D::kThreads;
      if (kXV % D::kThreads == 0 || i < kXV) {
        const int r = i / kRowV, v = i % kRowV;
        const int64_t t = tc0 + r, h = h0 + v * 8;
        const bool ok = t < T && h < H;  // H % 8 == 0: a vector is wholly in or out
        cp_async16(xs + r * D::kBH + v * 8, ok ? x + t * H + h : x, ok);
      }
    }
    if (dz_vec) {
      constexpr int kRowD = D::kBE / 4;
      constexpr int kDV = kDwrChunk * kRowD;
#pragma unroll
      for (int k = 0; k < (kDV + D::kThreads - 1) / D::kThreads; ++k) {
        const int i = threadIdx.x + k * D::kThreads;
        if (kDV % D::kThreads == 0 || i < kDV) {
          const int r = i / kRowD, v = i % kRowD;
          const int64_t t = tc0 + r;
          const int e = e0 + v * 4;
          const bool ok = t < T && e < E;  // E % 4 == 0
          cp_async16(ds + r * D::kBE + v * 4, ok ? dz + t * E + e : dz, ok);
        }
      }
    } else {
      constexpr int kDS = kDwrChunk * D::kBE;
#pragma unroll
      for (int k = 0; k < (kDS + D::kThreads - 1) / D::kThreads; ++k) {
        const int i = threadIdx.x + k * D::kThreads;
        if (kDS % D::kThreads == 0 || i < kDS) {
          const int r = i / D::kBE, q = i % D::kBE;
          const int64_t t = tc0 + r;
          const int e = e0 + q;
          const bool ok = t < T && e < E;
          cp_async4(ds + r * D::kBE + q, ok ? dz + t * E + e : dz, ok);
        }
      }
    }
  };

  float acc[TE][4];
#pragma unroll
  for (int j = 0; j < TE; ++j)
#pragma unroll
    for (int k = 0; k < 4; ++k) acc[j][k] = 0.0f;

  // one token: acc[j][k] = fma(dz[t, e_j], x[t, h_k], acc[j][k])
  auto step = [&](const bf16_t* xs, const float* ds, int t) {
    const uint2 xv = *reinterpret_cast<const uint2*>(xs + t * D::kBH);
    const float xf[4] = {bf16_lo(xv.x), bf16_hi(xv.x), bf16_lo(xv.y), bf16_hi(xv.y)};
    float d[TE];
    if constexpr (TE == 4) {
      const float4 d4 = *reinterpret_cast<const float4*>(ds + t * D::kBE);
      d[0] = d4.x;
      d[1] = d4.y;
      d[2] = d4.z;
      d[3] = d4.w;
    } else if constexpr (TE == 2) {
      const float2 d2 = *reinterpret_cast<const float2*>(ds + t * D::kBE);
      d[0] = d2.x;
      d[1] = d2.y;
    } else {
      d[0] = ds[t * D::kBE];
    }
#pragma unroll
    for (int j = 0; j < TE; ++j)
#pragma unroll
      for (int k = 0; k < 4; ++k) acc[j][k] = __fmaf_rn(d[j], xf[k], acc[j][k]);
  };

#pragma unroll
  for (int s = 0; s < STAGES - 1; ++s) {
    if (s < nch) load(s, s);
    cp_async_commit();
  }
  int s_cur = 0, s_next = STAGES - 1;
  for (int64_t c = 0; c < nch; ++c) {
    cp_async_wait<STAGES - 2>();
    __syncthreads();
    if (c + STAGES - 1 < nch) load(c + STAGES - 1, s_next);
    cp_async_commit();
    const unsigned char* st = smem + s_cur * D::kStageBytes;
    const bf16_t* xs = reinterpret_cast<const bf16_t*>(st) + lh;
    const float* ds = reinterpret_cast<const float*>(st + D::kXBytes) + le;
    const int64_t left = T - c * kDwrChunk;
    if (left >= kDwrChunk) {
#pragma unroll 16
      for (int t = 0; t < kDwrChunk; ++t) step(xs, ds, t);
    } else {
      const int n = static_cast<int>(left);  // the last chunk: only its real tokens
#pragma unroll 4
      for (int t = 0; t < n; ++t) step(xs, ds, t);
    }
    s_cur = s_cur + 1 == STAGES ? 0 : s_cur + 1;
    s_next = s_next + 1 == STAGES ? 0 : s_next + 1;
  }
  cp_async_wait<0>();

#pragma unroll
  for (int j = 0; j < TE; ++j) {
    const int e = e0 + le + j;
    if (e >= E) continue;
#pragma unroll
    for (int k = 0; k < 4; ++k) {
      const int64_t h = h0 + lh + k;
      if (h < H) {
        float* p = dwr + int64_t(e) * H + h;
        *p = __fadd_rn(*p, acc[j][k]);
      }
    }
  }
}

// Launch one instantiation (no argument checks: the caller's). Requires H % 8 == 0, x 16-byte
// aligned, dz 4-byte aligned.
template <int TE, int WE, int WH, int STAGES>
void launch_staged_dwr(const float* dz, const bf16_t* x, int64_t t, int e, int64_t h, float* dwr,
                       cudaStream_t stream) {
  using D = DwrTile<TE, WE, WH, STAGES>;
  auto* k = staged_dwr_kernel<TE, WE, WH, STAGES>;
  if (D::kSmemBytes > 48 * 1024)
    FLOWMOE_CUDA_CHECK(cudaFuncSetAttribute(k, cudaFuncAttributeMaxDynamicSharedMemorySize, D::kSmemBytes));
  const int64_t blocks = D::blocks(e, h);
  FLOWMOE_CHECK(blocks <= 0x7FFFFFFF, "moe::router_dwr: E = " << e << ", H = " << h << " need "
                                          << blocks << " blocks, more than one launch takes");
  const bool dz_vec = e % 4 == 0 && detail::aligned16(dz);
  k<<<static_cast<unsigned>(blocks), D::kThreads, D::kSmemBytes, stream>>>(dz, x, t, e, h, dz_vec, dwr);
}

// =================================================================================================
// combine_dx: dx [T, H] = bf16( bf16(sum_s rows[row_map[t, s]]) + sum_e dz[t, e] * wr[e, :] )
// (kernels.cuh): the expert rows added in slot order from 0 (dropped slots skipped), rounded to
// BF16, then the router path as acc = fma(dz, w, acc) for e = 0..E-1, one rounding to BF16.
// A CTA: 16 tokens x 1024 features, a thread 4 consecutive features of the 16 tokens. The routed
// rows are read 8 bytes per lane, the loads of two tokens' slots (up to 2 x 8) issued before any is
// added; the router path reads 16 bytes of Wr per expert and the 16 tokens' dz as 4 broadcast
// float4 from shared memory (dz staged transposed, [E][16]): 64 fmas per 20 registers loaded.
// =================================================================================================
constexpr int kCombineTokens = 16;
constexpr int kCombineThreads = 256;
constexpr int kCombineFeatures = 4 * kCombineThreads;  // per CTA
constexpr int kCombineSlots = 8;                       // row loads issued together, per token

inline size_t combine_smem_bytes(int topk, int e, bool router) {
  return (router ? size_t(kCombineTokens) * e * 4 : 0) + size_t(kCombineTokens) * topk * 4;
}

// Requires H % 4 == 0, rows and dx 8-byte aligned, wr 16-byte aligned.
__global__ void __launch_bounds__(kCombineThreads, 2)
combine_dx4_kernel(const bf16_t* __restrict__ rows, const int32_t* __restrict__ row_map, int64_t T,
                   int topk, const float* __restrict__ dz, const float* __restrict__ wr, int E,
                   int64_t H, bf16_t* __restrict__ dx) {
  extern __shared__ __align__(16) float cdx_smem[];
  float* s_dz = cdx_smem;  // [E][16] when dz
  int32_t* s_map = reinterpret_cast<int32_t*>(cdx_smem + (dz ? E * kCombineTokens : 0));  // [16][topk]
  const int64_t t0 = int64_t(blockIdx.y) * kCombineTokens;
  const int64_t h = (int64_t(blockIdx.x) * kCombineThreads + threadIdx.x) * 4;
  const int nt = T - t0 < kCombineTokens ? static_cast<int>(T - t0) : kCombineTokens;
  for (int i = threadIdx.x; i < kCombineTokens * topk; i += kCombineThreads)
    s_map[i] = i < nt * topk ? row_map[t0 * topk + i] : -1;
  if (dz) {
    for (int i = threadIdx.x; i < kCombineTokens * E; i += kCombineThreads) {
      const int tt = i / E, e = i % E;
      s_dz[e * kCombineTokens + tt] = tt < nt ? dz[(t0 + tt) * E + e] : 0.0f;
    }
  }
  __syncthreads();
  if (h >= H) return;

  float acc[kCombineTokens][4];
#pragma unroll
  for (int i = 0; i < kCombineTokens; i += 2) {
    float a[2][4] = {};
    if (i < nt) {  // token i+1 >= nt: its slots read -1 (nothing loaded, nothing stored)
      for (int s0 = 0; s0 < topk; s0 += kCombineSlots) {
        uint2 v[2][kCombineSlots];
        bool ok[2][kCombineSlots];
#pragma unroll
        for (int u = 0; u < 2; ++u)
#pragma unroll
          for (int q = 0; q < kCombineSlots; ++q) {
            const int s = s0 + q;
            const int32_t r = s < topk ? s_map[(i + u) * topk + s] : -1;
            ok[u][q] = r >= 0;
            v[u][q] = ok[u][q] ? *reinterpret_cast<const uint2*>(rows + int64_t(r) * H + h) : make_uint2(0u, 0u);
          }
#pragma unroll
        for (int u = 0; u < 2; ++u)
#pragma unroll
          for (int q = 0; q < kCombineSlots; ++q)
            if (ok[u][q]) {  // slot order
              a[u][0] = __fadd_rn(a[u][0], bf16_lo(v[u][q].x));
              a[u][1] = __fadd_rn(a[u][1], bf16_hi(v[u][q].x));
              a[u][2] = __fadd_rn(a[u][2], bf16_lo(v[u][q].y));
              a[u][3] = __fadd_rn(a[u][3], bf16_hi(v[u][q].y));
            }
      }
    }
    // the expert path is rounded to BF16 (unpermute's output), then the router path is added
#pragma unroll
    for (int u = 0; u < 2; ++u)
#pragma unroll
      for (int c = 0; c < 4; ++c) acc[i + u][c] = num::bf16_to_f32(num::bf16_canonical(a[u][c]));
  }
  if (dz) {
#pragma unroll 2
    for (int e = 0; e < E; ++e) {
      const float4 w = *reinterpret_cast<const float4*>(wr + int64_t(e) * H + h);
      const float4* d4 = reinterpret_cast<const float4*>(s_dz + e * kCombineTokens);
#pragma unroll
      for (int g = 0; g < kCombineTokens / 4; ++g) {
        const float4 d = d4[g];
        const float dv[4] = {d.x, d.y, d.z, d.w};
#pragma unroll
        for (int u = 0; u < 4; ++u) {
          float* r = acc[4 * g + u];
          r[0] = __fmaf_rn(dv[u], w.x, r[0]);
          r[1] = __fmaf_rn(dv[u], w.y, r[1]);
          r[2] = __fmaf_rn(dv[u], w.z, r[2]);
          r[3] = __fmaf_rn(dv[u], w.w, r[3]);
        }
      }
    }
  }
#pragma unroll
  for (int i = 0; i < kCombineTokens; ++i) {
    if (i >= nt) break;
    uint2 o;
    o.x = uint32_t(num::bf16_canonical(acc[i][0])) | (uint32_t(num::bf16_canonical(acc[i][1])) << 16);
    o.y = uint32_t(num::bf16_canonical(acc[i][2])) | (uint32_t(num::bf16_canonical(acc[i][3])) << 16);
    *reinterpret_cast<uint2*>(dx + (t0 + i) * H + h) = o;
  }
}

inline void launch_combine_dx4(const bf16_t* rows, const int32_t* row_map, int64_t t, int topk, const float* dz,
                               const float* wr, int e, int64_t h, bf16_t* dx, cudaStream_t stream) {
  const dim3 grid(static_cast<unsigned>((h + kCombineFeatures - 1) / kCombineFeatures),
                  static_cast<unsigned>((t + kCombineTokens - 1) / kCombineTokens));
  FLOWMOE_CHECK((t + kCombineTokens - 1) / kCombineTokens <= 65535,
                "moe::combine_dx: T = " << t << " too large for one launch");
  const size_t smem = combine_smem_bytes(topk, e, dz != nullptr);
  if (smem > 48 * 1024)  // E > 760: opt in to more dynamic shared memory
    FLOWMOE_CUDA_CHECK(cudaFuncSetAttribute(combine_dx4_kernel, cudaFuncAttributeMaxDynamicSharedMemorySize,
                                            static_cast<int>(smem)));
  combine_dx4_kernel<<<grid, kCombineThreads, smem, stream>>>(rows, row_map, t, topk, dz, wr, e, h, dx);
}

// =================================================================================================
// The previous kernels (fallback and benchmark baseline): tiles of BE experts x BH features (dwr),
// 4x4 outputs per thread; every output's sum in the same order as above. combine_dx2: 16 tokens x
// 512 features per CTA, 2 features per thread, 4-byte row loads one slot at a time.
// =================================================================================================
template <int BE, int BH>
__global__ void __launch_bounds__((BE / 4) * (BH / 4))
tiled_dwr_kernel(const float* __restrict__ dz, const bf16_t* __restrict__ x, int64_t T, int E,
                 int64_t H, float* __restrict__ dwr) {
  constexpr int kTh = (BE / 4) * (BH / 4);
  __shared__ float ds[kTiledChunk][BE + 1];
  __shared__ float xs[kTiledChunk][BH + 1];
  const int e0 = blockIdx.y * BE;
  const int64_t h0 = int64_t(blockIdx.x) * BH;
  const int tx = threadIdx.x % (BH / 4), ty = threadIdx.x / (BH / 4);
  float acc[4][4];
#pragma unroll
  for (int i = 0; i < 4; ++i)
#pragma unroll
    for (int j = 0; j < 4; ++j) acc[i][j] = 0.0f;
  for (int64_t t0 = 0; t0 < T; t0 += kTiledChunk) {
    for (int i = threadIdx.x; i < kTiledChunk * BE; i += kTh) {
      const int c = i / BE, r = i % BE;
      const int64_t t = t0 + c;
      const int e = e0 + r;
      ds[c][r] = (t < T && e < E) ? dz[t * E + e] : 0.0f;
    }
    for (int i = threadIdx.x; i < kTiledChunk * BH; i += kTh) {
      const int c = i / BH, r = i % BH;
      const int64_t t = t0 + c;
      const int64_t h = h0 + r;
      xs[c][r] = (t < T && h < H) ? num::bf16_to_f32(x[t * H + h]) : 0.0f;
    }
    __syncthreads();
    const int n = static_cast<int>(T - t0 < kTiledChunk ? T - t0 : kTiledChunk);  // no padding terms
    for (int c = 0; c < n; ++c) {
      float a[4], b[4];
#pragma unroll
      for (int i = 0; i < 4; ++i) a[i] = ds[c][ty * 4 + i];
#pragma unroll
      for (int j = 0; j < 4; ++j) b[j] = xs[c][tx * 4 + j];
#pragma unroll
      for (int i = 0; i < 4; ++i)
#pragma unroll
        for (int j = 0; j < 4; ++j) acc[i][j] = __fmaf_rn(a[i], b[j], acc[i][j]);
    }
    __syncthreads();
  }
#pragma unroll
  for (int i = 0; i < 4; ++i) {
    const int e = e0 + ty * 4 + i;
    if (e >= E) continue;
#pragma unroll
    for (int j = 0; j < 4; ++j) {
      const int64_t h = h0 + tx * 4 + j;
      if (h < H) dwr[int64_t(e) * H + h] = __fadd_rn(dwr[int64_t(e) * H + h], acc[i][j]);
    }
  }
}

// dx: one CTA per (16 tokens, 512 features); thread = 2 adjacent features of 16 tokens.
constexpr int kDxTokens = 16;
constexpr int kDxThreads = 256;
__global__ void __launch_bounds__(kDxThreads)
combine_dx2_kernel(const bf16_t* __restrict__ rows, const int32_t* __restrict__ row_map, int64_t T,
                   int topk, const float* __restrict__ dz, const float* __restrict__ wr, int E,
                   int64_t H, bf16_t* __restrict__ dx) {
  extern __shared__ float s_dz[];  // [kDxTokens][E]
  const int64_t t0 = int64_t(blockIdx.y) * kDxTokens;
  const int64_t h = (int64_t(blockIdx.x) * kDxThreads + threadIdx.x) * 2;
  if (dz) {
    for (int i = threadIdx.x; i < kDxTokens * E; i += kDxThreads) {
      const int64_t t = t0 + i / E;
      s_dz[i] = t < T ? dz[t * E + i % E] : 0.0f;
    }
  }
  __syncthreads();
  if (h >= H) return;
  float acc0[kDxTokens], acc1[kDxTokens];
#pragma unroll
  for (int i = 0; i < kDxTokens; ++i) {
    const int64_t t = t0 + i;
    float a0 = 0.0f, a1 = 0.0f;
    if (t < T) {
      for (int s = 0; s < topk; ++s) {
        const int32_t r = row_map[t * topk + s];
        if (r < 0) continue;
        const uint32_t w = *reinterpret_cast<const uint32_t*>(rows + int64_t(r) * H + h);
        a0 = __fadd_rn(a0, __uint_as_float(w << 16));
        a1 = __fadd_rn(a1, __uint_as_float(w & 0xFFFF0000u));
      }
    }
    // the expert path is rounded to BF16 (unpermute's output), then the router path is added
    acc0[i] = num::bf16_to_f32(num::bf16_canonical(a0));
    acc1[i] = num::bf16_to_f32(num::bf16_canonical(a1));
  }
  if (dz) {
    for (int e = 0; e < E; ++e) {
      const float2 w = *reinterpret_cast<const float2*>(wr + int64_t(e) * H + h);
#pragma unroll
      for (int i = 0; i < kDxTokens; ++i) {
        const float d = s_dz[i * E + e];
        acc0[i] = __fmaf_rn(d, w.x, acc0[i]);
        acc1[i] = __fmaf_rn(d, w.y, acc1[i]);
      }
    }
  }
#pragma unroll
  for (int i = 0; i < kDxTokens; ++i) {
    const int64_t t = t0 + i;
    if (t >= T) break;
    const uint32_t o = uint32_t(num::bf16_canonical(acc0[i])) | (uint32_t(num::bf16_canonical(acc1[i])) << 16);
    *reinterpret_cast<uint32_t*>(dx + t * H + h) = o;
  }
}

// The previous launchers: dwr takes any H.
inline void launch_tiled_dwr(const float* dz, const bf16_t* x, int64_t t, int e, int64_t h, float* dwr,
                             cudaStream_t stream) {
  FLOWMOE_CHECK((h + 63) / 64 <= 0x7FFFFFFF && (e + 31) / 32 <= 65535,
                "moe::router_dwr: E = " << e << ", H = " << h << " too large for one launch");
  const dim3 grid(static_cast<unsigned>((h + 63) / 64), static_cast<unsigned>((e + 31) / 32));
  tiled_dwr_kernel<32, 64><<<grid, (32 / 4) * (64 / 4), 0, stream>>>(dz, x, t, e, h, dwr);
}
// H % 2 == 0; rows, dx 4-byte and wr 8-byte aligned.
inline void launch_combine_dx2(const bf16_t* rows, const int32_t* row_map, int64_t t, int topk, const float* dz,
                               const float* wr, int e, int64_t h, bf16_t* dx, cudaStream_t stream) {
  const dim3 grid(static_cast<unsigned>((h / 2 + kDxThreads - 1) / kDxThreads),
                  static_cast<unsigned>((t + kDxTokens - 1) / kDxTokens));
  FLOWMOE_CHECK((t + kDxTokens - 1) / kDxTokens <= 65535, "moe::combine_dx: T = " << t << " too large for one launch");
  const size_t smem = dz ? size_t(kDxTokens) * e * sizeof(float) : 0;
  if (smem > 48 * 1024)  // E > 768: opt in to more dynamic shared memory (at most 64 KB here)
    FLOWMOE_CUDA_CHECK(cudaFuncSetAttribute(combine_dx2_kernel, cudaFuncAttributeMaxDynamicSharedMemorySize,
                                            static_cast<int>(smem)));
  combine_dx2_kernel<<<grid, kDxThreads, smem, stream>>>(rows, row_map, t, topk, dz, wr, e, h, dx);
}

}  // namespace
}  // namespace router_gemm
}  // namespace moe
}  // namespace cuda
}  // namespace flowmoe
