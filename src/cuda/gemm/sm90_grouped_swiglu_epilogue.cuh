// The fused SwiGLU epilogue of the grouped FP8 kernel (sm90_fp8_grouped_1x128.cu) for GEMM1 of the
// flow recipes: from a 128 x 256 output tile whose two 128-feature halves are the gate and the up
// projections of the same 128 features (W1's rows interleaved in 128-row blocks g0, u0, g1, u1, ...),
// it writes a' = p * silu(gate) * up as FP8 1x128 row tiles and the saved h (FP8 1x128 row tiles, or
// MXFP4 1x32 blocks) in the layouts cuda::swiglu_quant / swiglu_quant_h4 write, with the same bits:
// the accumulator is rounded to BF16 as the BF16 epilogue rounds it, then the steps of
// swiglu_row_kernel (swiglu_math.h, and the block quantization pieces of swiglu_common.cuh).
// h in BF16 is never written to global memory.
//
// Two sides, so that the SwiGLU arithmetic (ALU-bound) runs while the tensor cores work on the next
// tile instead of after every tile:
//  - swiglu_stage_tile: each consumer warpgroup rounds its 64 x 256 accumulator half to BF16 into a
//    shared-memory tile (row r: 512 bytes, gate then up; 16-byte chunk c at position c ^ (r % 32), so
//    both the fragment writes and the row reads below are free of bank conflicts) and goes on;
//  - swiglu_epilogue_rows: a fourth warpgroup, one thread per row, quantizes h and computes a'
//    (below), and the warpgroup copies the a' codes out along rows.
// Rows past the expert's (the last token tile's tail, which belongs to the next expert or lies past
// the segments) are never computed nor written.
#pragma once

#include "cuda/sm90/arch.cuh"
#include "cuda/swiglu/swiglu_common.cuh"

namespace flowmoe {
namespace cuda {
namespace sm90 {

// What the grouped kernel's epilogue writes.
enum class Epi { kBf16, kSwigluH8, kSwigluH4 };

// The SwiGLU epilogue's outputs (kernel parameters).
struct SwigluEpiParams {
  const float* prob = nullptr;  // [m] routing probability per row, or null (a' = swiglu)
  uint8_t* a_codes = nullptr;   // E4M3 [m, f]
  uint8_t* a_scales = nullptr;  // UE8M0 [f/128][scale_ld]
  uint8_t* h_codes = nullptr;   // kSwigluH8: E4M3 [m, 2f]; kSwigluH4: E2M1 [m, f] (2 per byte)
  uint8_t* h_scales = nullptr;  // kSwigluH8: UE8M0 [2f/128][h_scale_ld]; kSwigluH4: [m][2f/32]
  int64_t a_scale_ld = 0, h_scale_ld = 0;
  int f = 0;
  unsigned long long* nonfinite = nullptr;  // non-finite a', gate and up values counted (may be null)
};

__device__ __forceinline__ int nonfinite_bf16x2(uint32_t w) {
  return ((w & 0x7F80u) == 0x7F80u) + ((w & 0x7F800000u) == 0x7F800000u);
}

#ifdef FLOWMOE_SM90A  // (named_sync exists on sm_90a only; the kernel that calls this is guarded too)
constexpr int kSwigluRowBytes = 512;  // a staged row: 128 gate then 128 up values, BF16

// Where 16-byte chunk c (0-15 gate, 16-31 up) of staged row r lies in shared memory.
__device__ __forceinline__ int staged_chunk(int r, int c) { return r * kSwigluRowBytes + ((c ^ (r % 32)) << 4); }

// Consumer side: warpgroup ci's accumulator half (rows 64 ci .. 64 ci + 63 of the tile; acc[0] the
// gate, acc[1] the up of the tile's 128 features) rounded to BF16 (RN, as the BF16 epilogue writes
// h), then written into the staged tile once `wait_free` has returned (the epilogue warpgroup has
// read out the previous tile). t: the thread in the warpgroup.
template <typename WaitFree>
__device__ __forceinline__ void swiglu_stage_tile(const float (&acc)[2][64], uint8_t* tile, int ci, int t,
                                                  WaitFree wait_free) {
  const int warp = t / 32, lane = t % 32, r0 = 64 * ci + 16 * warp + lane / 4, b0 = 4 * (lane % 4);
  uint32_t w[2][2][16];  // [row r0, r0 + 8][gate, up][pair j]: the accumulator is dead after this
#pragma unroll
  for (int rh = 0; rh < 2; ++rh)
#pragma unroll
    for (int h = 0; h < 2; ++h)
#pragma unroll
      for (int j = 0; j < 16; ++j)
        w[rh][h][j] = swiglu_detail::pack_bf16x2(acc[h][4 * j + 2 * rh], acc[h][4 * j + 2 * rh + 1]);
  wait_free();
#pragma unroll
  for (int rh = 0; rh < 2; ++rh) {
    const int r = r0 + 8 * rh;
    uint8_t* row = tile + r * kSwigluRowBytes + b0;
#pragma unroll
    for (int c = 0; c < 32; ++c) *reinterpret_cast<uint32_t*>(row + ((c ^ (r % 32)) << 4)) = w[rh][c / 16][c % 16];
  }
}

// Epilogue side: thread t of the epilogue warpgroup takes row t of the staged tile (feature tile
// nt: features 128 nt .. 128 nt + 127 of a' and of gate and up); `rows` of the tile's rows belong
// to the expert (may be <= 0), the first of them global row `row0`. All 128 threads must call;
// `bar` is the warpgroup's named barrier. On return the tile may be overwritten. Three passes over
// the row, SwiGLU evaluated once per value:
//  0. the amaxes of gate and up (per 32 features; combined for H8) and so their scales;
//  1. per 8 features j: the h codes straight to global memory (8 bytes of gate and of up for H8,
//     4 for H4), and a' = p * swiglu in binary32 back into the row's chunks j (features 0-3) and
//     16 + j (4-7), which it has just read, and a''s amax;
//  2. a''s codes from those binary32 values into the first 8 bytes of chunk j; then the
//     warpgroup copies the a' code rows out, 8 bytes per thread along a row.
template <Epi kEpi>
__device__ __forceinline__ void swiglu_epilogue_rows(uint8_t* tile, const SwigluEpiParams& q, int64_t row0, int rows,
                                                     int nt, int t, int bar) {
  using namespace swiglu_detail;
  constexpr bool kH8 = kEpi == Epi::kSwigluH8;
  const int64_t f = q.f;
  int nbad = 0;
  if (t < rows) {
    const int64_t grow = row0 + t;
    uint8_t* row = tile + t * kSwigluRowBytes;
    const int sw = t % 32;
    auto chunk = [&](int c) { return row + ((c ^ sw) << 4); };
    // pass 0
    uint32_t gm[4], um[4];
#pragma unroll
    for (int b = 0; b < 4; ++b) {
      gm[b] = um[b] = 0;
#pragma unroll 1
      for (int j = 4 * b; j < 4 * b + 4; ++j) {
        gm[b] = max(gm[b], detail::absmax8_bits(*reinterpret_cast<const uint4*>(chunk(j))));
        um[b] = max(um[b], detail::absmax8_bits(*reinterpret_cast<const uint4*>(chunk(16 + j))));
      }
    }
    bool hbad = false;
    if constexpr (kH8) {
      gm[0] = max(max(gm[0], gm[1]), max(gm[2], gm[3]));
      um[0] = max(max(um[0], um[1]), max(um[2], um[3]));
      const BlockScale sg = e4m3_scale_bf16(gm[0]), su = e4m3_scale_bf16(um[0]);
      hbad = sg.bad || su.bad;
      q.h_scales[nt * q.h_scale_ld + grow] = sg.code();
      q.h_scales[(f / 128 + nt) * q.h_scale_ld + grow] = su.code();
    } else {
      uint32_t gsc = 0, usc = 0;  // the 4 blocks' scale codes, block b in byte b
#pragma unroll
      for (int b = 0; b < 4; ++b) {
        const BlockScale sg = e2m1_scale_bf16(gm[b]), su = e2m1_scale_bf16(um[b]);
        hbad |= sg.bad || su.bad;
        gsc |= uint32_t(sg.code()) << (8 * b);
        usc |= uint32_t(su.code()) << (8 * b);
      }
      uint8_t* dst = q.h_scales + grow * (f / 16) + 4 * nt;  // [m][2f/32]: gate 4 nt .., up f/32 + 4 nt ..
      *reinterpret_cast<uint32_t*>(dst) = gsc;
      *reinterpret_cast<uint32_t*>(dst + f / 32) = usc;
    }
    // pass 1
    const float p = q.prob ? __ldg(q.prob + grow) : 0.0f;
    float am = 0.0f;
#pragma unroll 1
    for (int j = 0; j < 16; ++j) {
      const uint4 g = *reinterpret_cast<const uint4*>(chunk(j)), u = *reinterpret_cast<const uint4*>(chunk(16 + j));
      if (hbad) nbad += detail::count_nonfinite8(g) + detail::count_nonfinite8(u);
      const uint32_t gw[4] = {g.x, g.y, g.z, g.w}, uw[4] = {u.x, u.y, u.z, u.w};
      if constexpr (kH8) {
        const BlockScale sg = e4m3_scale_bf16(gm[0]), su = e4m3_scale_bf16(um[0]);
        const float ig = detail::inv_pow2(sg.e), iu = detail::inv_pow2(su.e);
        uint32_t gc[2], uc[2];
#pragma unroll
        for (int w = 0; w < 2; ++w) {
          const uint32_t g0 = e4m3_encode2(bf16_lo(gw[2 * w]), bf16_hi(gw[2 * w]), ig, sg.e) & 0xFFFFu;
          const uint32_t g1 = e4m3_encode2(bf16_lo(gw[2 * w + 1]), bf16_hi(gw[2 * w + 1]), ig, sg.e) & 0xFFFFu;
          const uint32_t u0 = e4m3_encode2(bf16_lo(uw[2 * w]), bf16_hi(uw[2 * w]), iu, su.e) & 0xFFFFu;
          const uint32_t u1 = e4m3_encode2(bf16_lo(uw[2 * w + 1]), bf16_hi(uw[2 * w + 1]), iu, su.e) & 0xFFFFu;
          gc[w] = sg.bad ? 0x7F7F7F7Fu : g0 | (g1 << 16);
          uc[w] = su.bad ? 0x7F7F7F7Fu : u0 | (u1 << 16);
        }
        uint8_t* h = q.h_codes + grow * 2 * f + 128 * nt + 8 * j;  // gate cols 128 nt .., up f + 128 nt ..
        *reinterpret_cast<uint2*>(h) = make_uint2(gc[0], gc[1]);
        *reinterpret_cast<uint2*>(h + f) = make_uint2(uc[0], uc[1]);
      } else {
        const int b = j / 4;  // the MXFP4 block (selected, not indexed: gm and um stay in registers)
        const BlockScale sg = e2m1_scale_bf16(b == 0 ? gm[0] : b == 1 ? gm[1] : b == 2 ? gm[2] : gm[3]);
        const BlockScale su = e2m1_scale_bf16(b == 0 ? um[0] : b == 1 ? um[1] : b == 2 ? um[2] : um[3]);
        const float ig = detail::inv_pow2(sg.e), iu = detail::inv_pow2(su.e);
        uint32_t gv = 0, uv = 0;
#pragma unroll
        for (int w = 0; w < 4; ++w) {
          gv |= (e2m1_encode2(gw[w], ig, sg.e) & 0xFFu) << (8 * w);
          uv |= (e2m1_encode2(uw[w], iu, su.e) & 0xFFu) << (8 * w);
        }
        uint8_t* h = q.h_codes + grow * f + 64 * nt + 4 * j;  // packed [m, f]: gate bytes 64 nt .., up f/2 + 64 nt ..
        *reinterpret_cast<uint32_t*>(h) = sg.bad ? 0u : gv;
        *reinterpret_cast<uint32_t*>(h + f / 2) = su.bad ? 0u : uv;
      }
      float a[8];  // a' = swiglu * p (swiglu8 and the f_mul of swiglu_row_kernel), 4 values at a time
#pragma unroll
      for (int h = 0; h < 2; ++h) {
        const float gf[4] = {bf16_lo(gw[2 * h]), bf16_hi(gw[2 * h]), bf16_lo(gw[2 * h + 1]), bf16_hi(gw[2 * h + 1])};
        const float uf[4] = {bf16_lo(uw[2 * h]), bf16_hi(uw[2 * h]), bf16_lo(uw[2 * h + 1]), bf16_hi(uw[2 * h + 1])};
        float r[4];
        swiglu_f32_n(gf, uf, r);
#pragma unroll
        for (int i = 0; i < 4; ++i) a[4 * h + i] = r[i];
      }
      if (q.prob)
#pragma unroll
        for (int i = 0; i < 8; ++i) a[i] = f_mul(a[i], p);
#pragma unroll
      for (int i = 0; i < 8; i += 2) am = absmax_nan(am, absmax_nan(a[i], a[i + 1]));
      *reinterpret_cast<float4*>(chunk(j)) = make_float4(a[0], a[1], a[2], a[3]);
      *reinterpret_cast<float4*>(chunk(16 + j)) = make_float4(a[4], a[5], a[6], a[7]);
    }
    // pass 2
    const BlockScale sa = e4m3_scale_f32(__float_as_uint(am));
    q.a_scales[nt * q.a_scale_ld + grow] = sa.code();
    const float ia = detail::inv_pow2(sa.e);
#pragma unroll 2
    for (int j = 0; j < 16; ++j) {
      const float4 lo = *reinterpret_cast<const float4*>(chunk(j)), hi = *reinterpret_cast<const float4*>(chunk(16 + j));
      uint2 c = make_uint2(0x7F7F7F7Fu, 0x7F7F7F7Fu);
      if (!sa.bad) {
        c.x = (e4m3_encode2(lo.x, lo.y, ia, sa.e) & 0xFFFFu) | ((e4m3_encode2(lo.z, lo.w, ia, sa.e) & 0xFFFFu) << 16);
        c.y = (e4m3_encode2(hi.x, hi.y, ia, sa.e) & 0xFFFFu) | ((e4m3_encode2(hi.z, hi.w, ia, sa.e) & 0xFFFFu) << 16);
      } else {  // (as swiglu_row_kernel counts them)
        const float v[8] = {lo.x, lo.y, lo.z, lo.w, hi.x, hi.y, hi.z, hi.w};
#pragma unroll
        for (int i = 0; i < 8; ++i) nbad += (__float_as_uint(v[i]) & 0x7F800000u) == 0x7F800000u;
      }
      *reinterpret_cast<uint2*>(chunk(j)) = c;
    }
  }
  detail::warp_count(q.nonfinite, nbad);
  named_sync(bar, 128);  // every row's a' codes are in its chunks
  // a' [m, f] bytes 128 nt + 8 j from chunk j, consecutive threads along a row
  for (int i = t; i < 128 * 16; i += 128) {
    const int r = i / 16, j = i % 16;
    if (r >= rows) break;  // i grows with the row
    *reinterpret_cast<uint2*>(q.a_codes + (row0 + r) * f + 128 * nt + 8 * j) =
        *reinterpret_cast<const uint2*>(tile + staged_chunk(r, j));
  }
}
#endif

}  // namespace sm90
}  // namespace cuda
}  // namespace flowmoe
