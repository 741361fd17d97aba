// The fused dSwiGLU epilogue of the grouped FP8 kernel (sm90_fp8_grouped_1x128.cu) for GEMM2-dgrad
// of the flow recipes: from a 64 x 128 accumulator half tile of da' (128 tokens x 128 features per
// CTA tile, kBN = 128) and the saved h of the same rows and features, it writes
//   dh = [dgate, dup] as FP8 1x128 row tiles and FP8 128x1 column tiles (the expert's 128-token
//        block: the CTA's token tile), with UE8M0 scales, and
//   dp's partial sum of the 128 features (swiglu.h's order) per row,
// in the layouts cuda::dswiglu_quant_fp8h / dswiglu_quant_fp4h write, with the same bits: the
// accumulator is rounded to BF16 as the BF16 epilogue rounds it, then the steps of
// dswiglu_quant_kernel (swiglu_math.h's dact_prob_f32 / dact_f32 for either activation, and the
// block quantization pieces of swiglu_common.cuh).
// da' in BF16 is never written.
//
// Fragment layout (wgmma m64n128, FP32 accumulator): thread t of the warpgroup (warp w, lane l)
// holds rows r0 = 16 w + l / 4 (values 4 j + 0, 1) and r0 + 8 (values 4 j + 2, 3), columns
// 8 j + 2 (l % 4) + {0, 1}, j = 0 .. 15.
//  - rows: a row's 128 features lie in the 4 lanes of a quad: the tile amax is two shuffles, and
//    dp sums the thread's 16 groups in the thread, then over the quad (swiglu.h's order).
//  - columns: a column's 128 tokens are 2 values of each of 8 quads in each of 4 warps of both
//    consumer warpgroups: a 3-level exchange within the warp (each level halves what a lane keeps),
//    then the 8 warps' maxima meet in shared memory behind a barrier of both warpgroups.
//
// Shared memory (per warpgroup, kWgBytes): the saved h tile of its 64 rows, loaded by cp.async
// when the tile starts (it lands during the mainloop); da' staged as BF16 pairs (D), overwritten in
// place by dgate, and dup (U), both at the thread's own fragment positions; the row-wise codes
// staged for 16-byte row stores over the dead h tile, then the column-wise codes [256 columns][64
// tokens] for 16-byte token-run stores. Rows past the expert's (the last token tile's tail) are
// computed on zeros and never written.
//
// Code size. The loops over the 16 column groups are not unrolled: unrolled, the epilogue's 64
// values per thread were ~100 KB of straight-line SASS, and the warps stalled on instruction fetch
// (ncu: 4.5 "no instruction" stall cycles per issue against 0.05 for the plain dgrad), the
// mainloop's code evicted with it. So the values go through shared memory between the steps
// (the D / U stages), and only the column maxima exchange is unrolled.
#pragma once

#include "cuda/gemm/sm90_grouped_swiglu_epilogue.cuh"  // Epi, absmax_bf16_words, nonfinite_bf16x2
#include "cuda/sm90/arch.cuh"
#include "cuda/swiglu/swiglu_common.cuh"

namespace flowmoe {
namespace cuda {
namespace sm90 {

// The dSwiGLU epilogue's inputs and outputs (kernel parameters).
struct DswigluEpiParams {
  const float* prob = nullptr;      // [m] routing probability per row, or null (plain dSwiGLU, no dp)
  const uint8_t* h_codes = nullptr; // saved h: FP8 E4M3 [m, 2f], or MXFP4 E2M1 [m, f] (2 per byte)
  const uint8_t* h_scales = nullptr;  // FP8: UE8M0 [2f/128][h_scale_ld]; MXFP4: [m][2f/32]
  int64_t h_scale_ld = 0;
  int64_t m = 0;                    // rows (the capacity): the leading dimension of the grids below
  uint8_t* row_codes = nullptr;     // dh row-wise E4M3 [m, 2f]
  uint8_t* row_scales = nullptr;    // UE8M0 [2f/128][m]
  uint8_t* col_codes = nullptr;     // dh column-wise E4M3 [2f, m]
  uint8_t* col_scales = nullptr;    // UE8M0 [blocks][2f]: block = the expert's 128-token block
  float* dpart = nullptr;           // [f/128][m] dp partial sums, or null
  int f = 0;
  GatedActivation act;              // SwiGLU or the clamped SwiGLU (the forward's)
  unsigned long long* nonfinite = nullptr;  // non-finite dgate and dup values counted (may be null)
};

// Shared memory of the epilogue.
struct DswigluSmem {
  static constexpr int kHBytes = 2 * 64 * 128;       // gate and up of 64 rows (FP8; MXFP4 uses half)
  static constexpr int kRowStage = 64 * 256;         // row-wise codes: dgate 128 B, dup 128 B per row
  static constexpr int kColPitch = 64 + 16;          // column-wise codes: 64 tokens per column
  static constexpr int kColStage = 256 * kColPitch;
  static constexpr int kFirst = kColStage;           // h, then the row-wise codes, then the column-wise
  static constexpr int kPairs = 64 * 64 * 4;         // [64 rows][64 pairs] BF16x2 words
  static constexpr int kD = kFirst, kU = kFirst + kPairs;
  static constexpr int kWgBytes = kFirst + 2 * kPairs;  // per consumer warpgroup
  static constexpr int kExchBytes = 8 * 128 * 4;     // [8 warps][128 column pairs] BF16x2 maxima
  static constexpr int kCodeBytes = 128 * 2;         // [128 column pairs] scale code pairs
  static constexpr int kBytes = 2 * kWgBytes + kExchBytes + kCodeBytes;
  static_assert(kHBytes <= kFirst && kRowStage <= kFirst, "the h tile and the row-wise codes overlay the first buffer");
};
// Word of pair p (columns 2p, 2p + 1) of `row` in a D / U stage: pairs XOR-swizzled by the row so
// that a warp's 8 rows x 4 quad lanes hit 32 different banks.
__device__ __forceinline__ int pair_word(int row, int p) { return row * 64 + (p ^ ((row & 7) << 2)); }

// The saved h's per-row inputs a thread needs (its rows r0 and r0 + 8), read from global memory
// when the tile starts so that their latency hides behind the mainloop.
struct DswigluRowIn {
  float p[2];      // routing probability (0 past the rows)
  uint32_t sg[2];  // gate scale(s): FP8 one UE8M0 code; MXFP4 the 4 block codes, block b in byte b
  uint32_t su[2];  // up scale(s), as sg
};

#ifdef FLOWMOE_SM90A
using ::flowmoe::cuda::detail::cp_async16_zfill;  // (cuda/common.cuh)
using ::flowmoe::cuda::detail::cp_async_commit;

// Offsets of the saved h tile in the warpgroup's buffer. FP8: gate [64][128 B] then up, 16-byte
// chunk c of row r at c ^ (r % 8); MXFP4: gate [64][64 B] then up, chunk c at c ^ (r / 2 % 4). Both
// keep a warp's fragment reads (8 rows, 8 bytes each) free of bank conflicts.
template <bool kFp4>
__device__ __forceinline__ int h_tile_offset(int side, int row, int byte) {
  if constexpr (kFp4) return side * 4096 + row * 64 + ((((byte >> 4) ^ (row >> 1)) & 3) << 4) + (byte & 15);
  else return side * 8192 + row * 128 + ((((byte >> 4) ^ row) & 7) << 4) + (byte & 15);
}

// Tile start: the saved h of this warpgroup's 64 rows (row0 .. row0 + 63, the first `rows` the
// expert's; the others zero) into `buf` by cp.async, and the thread's row inputs into registers.
// All 128 threads of the warpgroup call; the epilogue waits for the copies.
template <bool kFp4>
__device__ __forceinline__ DswigluRowIn dswiglu_tile_start(uint8_t* buf, const DswigluEpiParams& q, int64_t row0,
                                                          int rows, int nt, int t) {
  const int64_t f = q.f;
  constexpr int kChunksPerRow = kFp4 ? 4 : 8, kChunks = 2 * 64 * kChunksPerRow;
#pragma unroll
  for (int i = t; i < kChunks; i += 128) {
    const int side = i / (64 * kChunksPerRow), row = (i / kChunksPerRow) % 64, c = i % kChunksPerRow;
    const bool valid = row < rows;
    const uint8_t* src = q.h_codes;
    if (valid)
      src += kFp4 ? (row0 + row) * f + side * (f / 2) + nt * 64 + 16 * c
                  : (row0 + row) * 2 * f + side * f + nt * 128 + 16 * c;
    cp_async16_zfill(buf + h_tile_offset<kFp4>(side, row, 16 * c), src, valid);
  }
  cp_async_commit();
  DswigluRowIn in;
  const int r0 = 16 * (t / 32) + (t % 32) / 4;
#pragma unroll
  for (int rh = 0; rh < 2; ++rh) {
    const int row = r0 + 8 * rh;
    const int64_t g = row0 + row;
    in.p[rh] = 0.0f;
    in.sg[rh] = in.su[rh] = 0;
    if (row < rows) {
      if (q.prob) in.p[rh] = __ldg(q.prob + g);
      if constexpr (kFp4) {
        const uint8_t* s = q.h_scales + g * (f / 16) + 4 * nt;
        in.sg[rh] = __ldg(reinterpret_cast<const uint32_t*>(s));
        in.su[rh] = __ldg(reinterpret_cast<const uint32_t*>(s + f / 32));
      } else {
        in.sg[rh] = __ldg(q.h_scales + nt * q.h_scale_ld + g);
        in.su[rh] = __ldg(q.h_scales + (f / 128 + nt) * q.h_scale_ld + g);
      }
    }
  }
  return in;
}

// Two saved-h values (columns c, c + 1 of the tile, c even) of one row, decoded exactly.
template <bool kFp4>
__device__ __forceinline__ float2 dswiglu_h_pair(const uint8_t* buf, int side, int row, int c, uint32_t scales) {
  using namespace swiglu_detail;
  uint16_t e4m3_pair;
  float sf;
  if constexpr (kFp4) {
    // one byte holds both nibbles; as decode8_fp4: each E2M1 magnitude is an E4M3 code
    const uint32_t v = buf[h_tile_offset<true>(side, row, c / 2)];
    constexpr uint32_t kLo = 0x3C383000u, kHi = 0x4C484440u;
    const uint32_t y = (v & 0xFu) | ((v & 0xF0u) << 4);  // one nibble per byte
    e4m3_pair = static_cast<uint16_t>(__byte_perm(kLo, kHi, v & 0x77u) | ((y & 0x0808u) << 4));
    sf = ue8m0_to_f32(static_cast<uint8_t>(scales >> (8 * (c / 32))));
  } else {
    e4m3_pair = *reinterpret_cast<const uint16_t*>(buf + h_tile_offset<false>(side, row, c));
    sf = ue8m0_to_f32(static_cast<uint8_t>(scales));
  }
  const __half2_raw hr = __nv_cvt_fp8x2_to_halfraw2(static_cast<__nv_fp8x2_storage_t>(e4m3_pair), __NV_E4M3);
  const float2 x = __half22float2(*reinterpret_cast<const __half2*>(&hr));
  return make_float2(f_mul(x.x, sf), f_mul(x.y, sf));  // exact, as decode8
}

// One warpgroup's half tile: acc = da' of features 128 nt .. 128 nt + 127 for the 64 rows row0 ..
// row0 + 63 (global), of which the first `rows` belong to the expert (may be <= 0); `block`: the
// column-wise scale row of the CTA's token tile. buf: this warpgroup's kWgBytes; exch, codes: the
// CTA's shared exchange. t: the thread in the warpgroup, ci: the warpgroup (0, 1), bar: its named
// barrier; barrier 3 joins both. All 256 consumer threads must call, for every tile.
template <bool kFp4>
__device__ __forceinline__ void dswiglu_epilogue(const float (&acc)[64], uint8_t* buf, uint32_t* exch, uint16_t* codes,
                                                 const DswigluEpiParams& q, const DswigluRowIn& in, int64_t row0,
                                                 int rows, int nt, int64_t block, int t, int ci, int bar) {
  using namespace swiglu_detail;
  using S = DswigluSmem;
  const int warp = t / 32, lane = t % 32, quad = lane % 4, r0 = 16 * warp + lane / 4, c0 = 2 * quad;
  const int64_t f = q.f;
  uint32_t* D = reinterpret_cast<uint32_t*>(buf + S::kD);
  uint32_t* U = reinterpret_cast<uint32_t*>(buf + S::kU);
  // da' as GEMM2-dgrad's BF16 output (RN), zeros past the rows, into D at the thread's own positions
#pragma unroll
  for (int rh = 0; rh < 2; ++rh) {
    const bool valid = r0 + 8 * rh < rows;
#pragma unroll
    for (int j = 0; j < 16; ++j)
      D[pair_word(r0 + 8 * rh, 4 * j + quad)] = valid ? pack_bf16x2(acc[4 * j + 2 * rh], acc[4 * j + 2 * rh + 1]) : 0u;
  }
  ::flowmoe::cuda::detail::cp_async_wait<0>();
  named_sync(bar, 128);  // every thread's h chunks have landed

  // dgate and dup (BF16, as dswiglu8 / dswiglu8_prob form them) over D and into U; the rows' BF16
  // maxima; dp's pairwise tree over the groups, as a stack of 4 levels per row (level L holds the
  // left sum while bit L of the group index is 0)
  uint32_t mg[2] = {0, 0}, mu[2] = {0, 0};
  float lvl[2][4] = {}, dp[2] = {0.0f, 0.0f};
#pragma unroll 1
  for (int j = 0; j < 16; ++j) {
    const int c = 8 * j + c0;
#pragma unroll
    for (int rh = 0; rh < 2; ++rh) {
      const int row = r0 + 8 * rh, w = pair_word(row, 4 * j + quad);
      const float2 g = dswiglu_h_pair<kFp4>(buf, 0, row, c, in.sg[rh]);
      const float2 u = dswiglu_h_pair<kFp4>(buf, 1, row, c, in.su[rh]);
      const uint32_t dw = D[w];
      const float d0 = bf16_lo(dw), d1 = bf16_hi(dw);
      uint32_t gw, uw;
      if (q.prob) {
        const SwigluGradProb lo = dact_prob_f32(q.act, d0, in.p[rh], g.x, u.x);
        const SwigluGradProb hi = dact_prob_f32(q.act, d1, in.p[rh], g.y, u.y);
        float v = f_fma(d1, hi.a, f_fma(d0, lo.a, 0.0f));
        if (j & 1) {
          v = f_add(lvl[rh][0], v);
          if (j & 2) {
            v = f_add(lvl[rh][1], v);
            if (j & 4) {
              v = f_add(lvl[rh][2], v);
              if (j & 8) dp[rh] = f_add(lvl[rh][3], v);
              else lvl[rh][3] = v;
            } else {
              lvl[rh][2] = v;
            }
          } else {
            lvl[rh][1] = v;
          }
        } else {
          lvl[rh][0] = v;
        }
        gw = pack_bf16x2(lo.dgate, hi.dgate);
        uw = pack_bf16x2(lo.dup, hi.dup);
      } else {
        const SwigluGrad lo = dact_f32(q.act, d0, g.x, u.x);
        const SwigluGrad hi = dact_f32(q.act, d1, g.y, u.y);
        gw = pack_bf16x2(lo.dgate, hi.dgate);
        uw = pack_bf16x2(lo.dup, hi.dup);
      }
      D[w] = gw;
      U[w] = uw;
      mg[rh] = __vmaxu2(mg[rh], gw & 0x7FFF7FFFu);
      mu[rh] = __vmaxu2(mu[rh], uw & 0x7FFF7FFFu);
    }
  }
  // dp: the thread's sum, then the quad's (q0 + q1) + (q2 + q3)
  if (q.prob) {
#pragma unroll
    for (int rh = 0; rh < 2; ++rh) {
      float s = f_add(dp[rh], __shfl_xor_sync(0xffffffffu, dp[rh], 1));
      s = f_add(s, __shfl_xor_sync(0xffffffffu, s, 2));
      if (q.dpart && r0 + 8 * rh < rows && quad == 0) q.dpart[nt * q.m + row0 + r0 + 8 * rh] = f32_canonical(s);
    }
  }
  // row-wise: one 1x128 tile of dgate and one of dup per row (quantize_tile8's steps)
  BlockScale sg[2], su[2];
  int nbad = 0;
#pragma unroll
  for (int rh = 0; rh < 2; ++rh) {
    sg[rh] = e4m3_scale_bf16(detail::group_max_u(max(mg[rh] & 0xFFFFu, mg[rh] >> 16), 4));
    su[rh] = e4m3_scale_bf16(detail::group_max_u(max(mu[rh] & 0xFFFFu, mu[rh] >> 16), 4));
    const int64_t grow = row0 + r0 + 8 * rh;
    if (r0 + 8 * rh < rows && quad == 0) {
      q.row_scales[nt * q.m + grow] = sg[rh].code();
      q.row_scales[(f / 128 + nt) * q.m + grow] = su[rh].code();
    }
  }
  if (__any_sync(0xffffffffu, sg[0].bad || su[0].bad || sg[1].bad || su[1].bad)) {
#pragma unroll 1
    for (int j = 0; j < 16; ++j)
#pragma unroll
      for (int rh = 0; rh < 2; ++rh) {
        const int w = pair_word(r0 + 8 * rh, 4 * j + quad);
        nbad += nonfinite_bf16x2(D[w]) + nonfinite_bf16x2(U[w]);
      }
  }
  detail::warp_count(q.nonfinite, nbad);
  named_sync(bar, 128);  // every thread is past its reads of the h tile: the row-wise codes go there
  uint8_t* rstage = buf;  // [64 rows][256 B], 16-byte chunk c of row r at c ^ (r % 8)
  const float ig[2] = {detail::inv_pow2(sg[0].e), detail::inv_pow2(sg[1].e)};
  const float iu[2] = {detail::inv_pow2(su[0].e), detail::inv_pow2(su[1].e)};
#pragma unroll 1
  for (int j = 0; j < 16; ++j)
#pragma unroll
    for (int rh = 0; rh < 2; ++rh) {
      const int row = r0 + 8 * rh, w = pair_word(row, 4 * j + quad);
      const uint32_t gw = D[w], uw = U[w];
      uint8_t* srow = rstage + row * 256 + (8 * j + c0) % 16;
      *reinterpret_cast<uint16_t*>(srow + (((j / 2) ^ (row & 7)) << 4)) = static_cast<uint16_t>(
          sg[rh].bad ? 0x7F7Fu : e4m3_encode2(bf16_lo(gw), bf16_hi(gw), ig[rh], sg[rh].e));
      *reinterpret_cast<uint16_t*>(srow + (((8 + j / 2) ^ (row & 7)) << 4)) = static_cast<uint16_t>(
          su[rh].bad ? 0x7F7Fu : e4m3_encode2(bf16_lo(uw), bf16_hi(uw), iu[rh], su[rh].e));
    }
  named_sync(bar, 128);  // the row-wise codes are staged
  for (int i = t; i < 64 * 16; i += 128) {  // 16-byte chunks: dgate columns 128 nt .., dup f + 128 nt ..
    const int row = i / 16, c = i % 16;
    if (row >= rows) break;  // i grows with the row
    const uint4 v = *reinterpret_cast<const uint4*>(rstage + row * 256 + ((c ^ (row & 7)) << 4));
    *reinterpret_cast<uint4*>(q.row_codes + (row0 + row) * 2 * f + (c < 8 ? 0 : f) + 128 * nt + 16 * (c % 8)) = v;
  }

  // column-wise: the largest |value| of each column over the 128 tokens. Word w = side * 16 + j
  // holds the BF16x2 maxima of columns 8 j + c0, + 1 (side 0 dgate, 1 dup) over the thread's rows;
  // each exchange level keeps half the words (lane bit 2, 3, 4 picks the upper half).
  uint32_t m32[32];
#pragma unroll
  for (int j = 0; j < 16; ++j) {
    const int w0 = pair_word(r0, 4 * j + quad), w1 = pair_word(r0 + 8, 4 * j + quad);
    m32[j] = __vmaxu2(D[w0] & 0x7FFF7FFFu, D[w1] & 0x7FFF7FFFu);
    m32[16 + j] = __vmaxu2(U[w0] & 0x7FFF7FFFu, U[w1] & 0x7FFF7FFFu);
  }
  const bool b2 = lane & 4, b3 = lane & 8, b4 = lane & 16;
  uint32_t m16[16], m8[8], m4[4];
#pragma unroll
  for (int k = 0; k < 16; ++k) {
    const uint32_t other = __shfl_xor_sync(0xffffffffu, b2 ? m32[k] : m32[16 + k], 4);
    m16[k] = __vmaxu2(b2 ? m32[16 + k] : m32[k], other);
  }
#pragma unroll
  for (int k = 0; k < 8; ++k) {
    const uint32_t other = __shfl_xor_sync(0xffffffffu, b3 ? m16[k] : m16[8 + k], 8);
    m8[k] = __vmaxu2(b3 ? m16[8 + k] : m16[k], other);
  }
#pragma unroll
  for (int k = 0; k < 4; ++k) {
    const uint32_t other = __shfl_xor_sync(0xffffffffu, b4 ? m8[k] : m8[4 + k], 16);
    m4[k] = __vmaxu2(b4 ? m8[4 + k] : m8[k], other);
  }
  const int wfirst = 16 * b2 + 8 * b3 + 4 * b4;  // the first of this lane's 4 words
#pragma unroll
  for (int k = 0; k < 4; ++k) exch[(4 * ci + warp) * 128 + (wfirst + k) * 4 + quad] = m4[k];
  named_sync(3, 256);  // both warpgroups' maxima are in (and each is past its row-wise stores)
  if (ci == 0) {  // column pair i = w * 4 + quad: the block's scale codes
    const int i = t, w = i / 4, qd = i % 4;
    uint32_t mx = 0;
#pragma unroll
    for (int k = 0; k < 8; ++k) mx = __vmaxu2(mx, exch[k * 128 + i]);
    const uint32_t s0 = e4m3_scale_bf16(mx & 0xFFFFu).code(), s1 = e4m3_scale_bf16(mx >> 16).code();
    const uint16_t pair_code = static_cast<uint16_t>(s0 | (s1 << 8));
    codes[i] = pair_code;
    const int64_t feat = (w < 16 ? 0 : f) + 128 * nt + 8 * (w % 16) + 2 * qd;
    *reinterpret_cast<uint16_t*>(q.col_scales + block * 2 * f + feat) = pair_code;
  }
  named_sync(3, 256);  // the codes are in
  uint8_t* cstage = buf;  // [256 columns][kColPitch]: column side * 128 + c, token row
#pragma unroll 1
  for (int w = 0; w < 32; ++w) {
    const uint32_t code = codes[w * 4 + quad];
    const uint32_t* src = w < 16 ? D : U;
    const int p = 4 * (w % 16) + quad;
    const uint32_t v0 = src[pair_word(r0, p)], v1 = src[pair_word(r0 + 8, p)];
    const int col = (w < 16 ? 0 : 128) + 8 * (w % 16) + c0;
#pragma unroll
    for (int h = 0; h < 2; ++h) {  // column col + h: the low (h = 0) or high BF16 of each row's word
      const uint32_t sc = (code >> (8 * h)) & 0xFFu;
      const bool bad = sc == kUE8M0NaN;
      const int e = static_cast<int>(sc) - 127;
      const float x0 = h ? bf16_hi(v0) : bf16_lo(v0), x1 = h ? bf16_hi(v1) : bf16_lo(v1);
      const uint32_t c2 = bad ? 0x7F7Fu : e4m3_encode2(x0, x1, bad ? 0.0f : detail::inv_pow2(e), e);
      uint8_t* dst = cstage + (col + h) * S::kColPitch;
      dst[r0] = static_cast<uint8_t>(c2);
      dst[r0 + 8] = static_cast<uint8_t>(c2 >> 8);
    }
  }
  named_sync(bar, 128);  // the column-wise codes are staged
  const bool vec = (q.m % 16 == 0) && (row0 % 16 == 0);  // 16-byte aligned token runs
#pragma unroll 1
  for (int i = t; i < 256 * 4; i += 128) {  // 16 tokens of one column per task
    const int col = i / 4, t0 = 16 * (i % 4);
    if (t0 >= rows) continue;
    const uint4 v = *reinterpret_cast<const uint4*>(cstage + col * S::kColPitch + t0);
    const int64_t feat = (col < 128 ? 0 : f - 128) + 128 * nt + col;
    uint8_t* dst = q.col_codes + feat * q.m + row0 + t0;
    if (vec && t0 + 16 <= rows) {
      *reinterpret_cast<uint4*>(dst) = v;
    } else {
      for (int k = 0; k < min(16, rows - t0); ++k) {
        const uint32_t w = k < 4 ? v.x : k < 8 ? v.y : k < 12 ? v.z : v.w;  // (no local-memory array)
        dst[k] = static_cast<uint8_t>(w >> (8 * (k & 3)));
      }
    }
  }
  named_sync(bar, 128);  // buf is free for the next tile's h
}
#endif

}  // namespace sm90
}  // namespace cuda
}  // namespace flowmoe
