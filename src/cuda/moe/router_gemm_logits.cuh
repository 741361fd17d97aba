// The router logits GEMM, z [T, E] = x [T, H] (bf16) . wr [E, H]^T (kernels.cuh: router_logits),
// as kernel templates: the staged kernel and its launcher, and the previous 4x4-tile kernel
// (tiled_logits: the fallback for operands that are not 16-byte aligned or H % 64 != 0, and the
// benchmark's baseline) with its launcher. Contract and design: router_gemm_common.cuh.
#pragma once

#include "cuda/moe/router_gemm_common.cuh"

namespace flowmoe {
namespace cuda {
namespace moe {
namespace router_gemm {
namespace {  // internal linkage: each including translation unit owns its instantiations

// =================================================================================================
// logits: z [T, E] = x [T, H] (bf16) . wr [E, H]^T, sums over h in order
// =================================================================================================
constexpr int kLogitsChunk = 64;                // h per staged chunk (H % 64 == 0)
constexpr int kLogitsXStride = kLogitsChunk + 8;  // bf16 per staged x row: 144 B = 9 x 16 B
constexpr int kLogitsWStride = kLogitsChunk + 4;  // floats per staged w row: 272 B = 17 x 16 B

template <int LE, int TN, int TM, int WARPS, int STAGES>
struct LogitsTile {
  static_assert(LE == 8 || LE == 16 || LE == 32, "expert lanes: 8, 16 or 32");
  static_assert(STAGES >= 2, "at least double buffering");
  static constexpr int kTokenLanes = 32 / LE;
  static constexpr int kBE = LE * TN;                        // experts per CTA
  static constexpr int kBT = kTokenLanes * TM * WARPS;       // tokens per CTA
  static constexpr int kThreads = 32 * WARPS;
  static constexpr int kXBytes = kBT * kLogitsXStride * 2;
  static constexpr int kWBytes = kBE * kLogitsWStride * 4;
  static constexpr int kStageBytes = kXBytes + kWBytes;      // multiple of 16
  static constexpr int kSmemBytes = STAGES * kStageBytes;
  static int64_t blocks(int64_t t, int e) { return int64_t((e + kBE - 1) / kBE) * ((t + kBT - 1) / kBT); }
};

template <int LE, int TN, int TM, int WARPS, int STAGES>
__global__ void __launch_bounds__(32 * WARPS, WARPS <= 4 ? 3 : 2)
staged_logits_kernel(const bf16_t* __restrict__ x, const float* __restrict__ wr, int64_t T, int E,
                     int64_t H, float* __restrict__ z) {
  using L = LogitsTile<LE, TN, TM, WARPS, STAGES>;
  constexpr int kLT = L::kTokenLanes;
  extern __shared__ __align__(16) unsigned char smem[];
  const int n_eb = (E + L::kBE - 1) / L::kBE;
  const int e0 = static_cast<int>(blockIdx.x % n_eb) * L::kBE;
  const int64_t t0 = int64_t(blockIdx.x / n_eb) * L::kBT;
  const int warp = threadIdx.x >> 5, lane = threadIdx.x & 31;
  const int tl = lane % kLT, el = lane / kLT;
  const int xrow = warp * (kLT * TM) + tl;  // the thread's tokens: xrow + i * kLT, i < TM
  const int nch = static_cast<int>(H / kLogitsChunk);

  auto load = [&](int c, int s) {
    const int64_t h0 = int64_t(c) * kLogitsChunk;
    unsigned char* st = smem + s * L::kStageBytes;
    bf16_t* xs = reinterpret_cast<bf16_t*>(st);
    float* ws = reinterpret_cast<float*>(st + L::kXBytes);
    constexpr int kXV = L::kBT * (kLogitsChunk / 8);  // 16-byte vectors of x
#pragma unroll
    for (int k = 0; k < (kXV + L::kThreads - 1) / L::kThreads; ++k) {
      const int i = threadIdx.x + k * L::kThreads;
      if (kXV % L::kThreads == 0 || i < kXV) {
        const int r = i / (kLogitsChunk / 8), v = i % (kLogitsChunk / 8);
        const int64_t t = t0 + r;
        const bool ok = t < T;
        cp_async16(xs + r * kLogitsXStride + v * 8, ok ? x + t * H + h0 + v * 8 : x, ok);
      }
    }
    constexpr int kWV = L::kBE * (kLogitsChunk / 4);
#pragma unroll
    for (int k = 0; k < (kWV + L::kThreads - 1) / L::kThreads; ++k) {
      const int i = threadIdx.x + k * L::kThreads;
      if (kWV % L::kThreads == 0 || i < kWV) {
        const int r = i / (kLogitsChunk / 4), v = i % (kLogitsChunk / 4);
        const int e = e0 + r;
        const bool ok = e < E;
        cp_async16(ws + r * kLogitsWStride + v * 4, ok ? wr + int64_t(e) * H + h0 + v * 4 : wr, ok);
      }
    }
  };

  float acc[TM][TN];
#pragma unroll
  for (int i = 0; i < TM; ++i)
#pragma unroll
    for (int j = 0; j < TN; ++j) acc[i][j] = 0.0f;

  // operands of h = 8b .. 8b+7 of the staged chunk: x of the TM tokens, w of the TN experts
  auto frag = [&](const bf16_t* xs, const float* ws, int b, uint4 (&xv)[TM], float4 (&w0)[TN],
                  float4 (&w1)[TN]) {
#pragma unroll
    for (int i = 0; i < TM; ++i)
      xv[i] = *reinterpret_cast<const uint4*>(xs + i * kLT * kLogitsXStride + b * 8);
#pragma unroll
    for (int j = 0; j < TN; ++j) {
      w0[j] = *reinterpret_cast<const float4*>(ws + j * LE * kLogitsWStride + b * 8);
      w1[j] = *reinterpret_cast<const float4*>(ws + j * LE * kLogitsWStride + b * 8 + 4);
    }
  };
  // acc[i][j] = fma(x, w, acc[i][j]) for the 8 h, in increasing h
  auto fma8 = [&](const uint4 (&xv)[TM], const float4 (&w0)[TN], const float4 (&w1)[TN]) {
#pragma unroll
    for (int k = 0; k < 8; ++k) {
#pragma unroll
      for (int i = 0; i < TM; ++i) {
        const uint32_t w2 = word_of(xv[i], k >> 1);
        const float xf = (k & 1) ? bf16_hi(w2) : bf16_lo(w2);
#pragma unroll
        for (int j = 0; j < TN; ++j)
          acc[i][j] = __fmaf_rn(xf, comp_of(k < 4 ? w0[j] : w1[j], k & 3), acc[i][j]);
      }
    }
  };

#pragma unroll
  for (int s = 0; s < STAGES - 1; ++s) {
    if (s < nch) load(s, s);
    cp_async_commit();  // always commit (possibly empty): the group count stays uniform
  }
  int s_cur = 0, s_next = STAGES - 1;
  for (int c = 0; c < nch; ++c) {
    cp_async_wait<STAGES - 2>();  // this thread's copies of chunk c have landed
    __syncthreads();              // everyone's have; and everyone is done with chunk c-1's stage
    if (c + STAGES - 1 < nch) load(c + STAGES - 1, s_next);
    cp_async_commit();
    const unsigned char* st = smem + s_cur * L::kStageBytes;
    const bf16_t* xs = reinterpret_cast<const bf16_t*>(st) + xrow * kLogitsXStride;
    const float* ws = reinterpret_cast<const float*>(st + L::kXBytes) + el * kLogitsWStride;
    // 8 h at a time, in order; the next 8 h's operands are loaded before these are used (two
    // register sets, A and B, so that nothing is copied)
    uint4 xa[TM], xb[TM];
    float4 wa0[TN], wa1[TN], wb0[TN], wb1[TN];
    frag(xs, ws, 0, xa, wa0, wa1);
    for (int b = 0; b < kLogitsChunk / 8; b += 2) {
      frag(xs, ws, b + 1, xb, wb0, wb1);
      fma8(xa, wa0, wa1);
      if (b + 2 < kLogitsChunk / 8) frag(xs, ws, b + 2, xa, wa0, wa1);
      fma8(xb, wb0, wb1);
    }
    s_cur = s_cur + 1 == STAGES ? 0 : s_cur + 1;
    s_next = s_next + 1 == STAGES ? 0 : s_next + 1;
  }
  cp_async_wait<0>();  // nothing useful is in flight; leave no copy outstanding at exit

#pragma unroll
  for (int i = 0; i < TM; ++i) {
    const int64_t t = t0 + xrow + i * kLT;
    if (t >= T) continue;
#pragma unroll
    for (int j = 0; j < TN; ++j) {
      const int e = e0 + el + j * LE;
      if (e < E) z[t * E + e] = acc[i][j];
    }
  }
}

// Launch one instantiation (no argument checks: the caller's). Requires H % 64 == 0 and x, wr
// 16-byte aligned.
template <int LE, int TN, int TM, int WARPS, int STAGES>
void launch_staged_logits(const bf16_t* x, const float* wr, int64_t t, int e, int64_t h, float* z,
                          cudaStream_t stream) {
  using L = LogitsTile<LE, TN, TM, WARPS, STAGES>;
  auto* k = staged_logits_kernel<LE, TN, TM, WARPS, STAGES>;
  if (L::kSmemBytes > 48 * 1024)
    FLOWMOE_CUDA_CHECK(cudaFuncSetAttribute(k, cudaFuncAttributeMaxDynamicSharedMemorySize, L::kSmemBytes));
  const int64_t blocks = L::blocks(t, e);
  FLOWMOE_CHECK(blocks <= 0x7FFFFFFF, "moe::router_logits: T = " << t << ", E = " << e
                                          << " need " << blocks << " blocks, more than one launch takes");
  k<<<static_cast<unsigned>(blocks), L::kThreads, L::kSmemBytes, stream>>>(x, wr, t, e, h, z);
}

// =================================================================================================
// The previous logits kernel (fallback and benchmark baseline): tiles of BT tokens x BE experts,
// 4x4 outputs per thread; every output's sum in the same order as above.
// =================================================================================================
template <int BT, int BE>
__global__ void __launch_bounds__((BT / 4) * (BE / 4))
tiled_logits_kernel(const bf16_t* __restrict__ x, const float* __restrict__ wr, int64_t T, int E,
                    int64_t H, float* __restrict__ z) {
  constexpr int kTh = (BT / 4) * (BE / 4);
  __shared__ float xs[kTiledChunk][BT + 1];
  __shared__ float ws[kTiledChunk][BE + 1];
  const int64_t t0 = int64_t(blockIdx.x) * BT;
  const int e0 = blockIdx.y * BE;
  const int tx = threadIdx.x % (BE / 4), ty = threadIdx.x / (BE / 4);
  float acc[4][4];
#pragma unroll
  for (int i = 0; i < 4; ++i)
#pragma unroll
    for (int j = 0; j < 4; ++j) acc[i][j] = 0.0f;
  for (int64_t h0 = 0; h0 < H; h0 += kTiledChunk) {
    for (int i = threadIdx.x; i < BT * kTiledChunk; i += kTh) {
      const int r = i / kTiledChunk, c = i % kTiledChunk;
      const int64_t t = t0 + r;
      xs[c][r] = t < T ? num::bf16_to_f32(x[t * H + h0 + c]) : 0.0f;
    }
    for (int i = threadIdx.x; i < BE * kTiledChunk; i += kTh) {
      const int r = i / kTiledChunk, c = i % kTiledChunk;
      const int e = e0 + r;
      ws[c][r] = e < E ? wr[int64_t(e) * H + h0 + c] : 0.0f;
    }
    __syncthreads();
#pragma unroll 4
    for (int c = 0; c < kTiledChunk; ++c) {
      float a[4], b[4];
#pragma unroll
      for (int i = 0; i < 4; ++i) a[i] = xs[c][ty * 4 + i];
#pragma unroll
      for (int j = 0; j < 4; ++j) b[j] = ws[c][tx * 4 + j];
#pragma unroll
      for (int i = 0; i < 4; ++i)
#pragma unroll
        for (int j = 0; j < 4; ++j) acc[i][j] = __fmaf_rn(a[i], b[j], acc[i][j]);
    }
    __syncthreads();
  }
#pragma unroll
  for (int i = 0; i < 4; ++i) {
    const int64_t t = t0 + ty * 4 + i;
    if (t >= T) continue;
#pragma unroll
    for (int j = 0; j < 4; ++j) {
      const int e = e0 + tx * 4 + j;
      if (e < E) z[t * E + e] = acc[i][j];
    }
  }
}

// The previous launcher's tile choice: H % 32 == 0.
inline void launch_tiled_logits(const bf16_t* x, const float* wr, int64_t t, int e, int64_t h, float* z,
                                cudaStream_t stream) {
  FLOWMOE_CHECK((t + 63) / 64 <= 0x7FFFFFFF && (e + 31) / 32 <= 65535,
                "moe::router_logits: T = " << t << ", E = " << e << " too large for one launch");
  if (e <= 32) {
    const dim3 grid(static_cast<unsigned>((t + 63) / 64), static_cast<unsigned>((e + 31) / 32));
    tiled_logits_kernel<64, 32><<<grid, (64 / 4) * (32 / 4), 0, stream>>>(x, wr, t, e, h, z);
  } else {
    const dim3 grid(static_cast<unsigned>((t + 63) / 64), static_cast<unsigned>((e + 63) / 64));
    tiled_logits_kernel<64, 64><<<grid, (64 / 4) * (64 / 4), 0, stream>>>(x, wr, t, e, h, z);
  }
}

}  // namespace
}  // namespace router_gemm
}  // namespace moe
}  // namespace cuda
}  // namespace flowmoe
