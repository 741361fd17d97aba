// The fused SwiGLU epilogue of the grouped FP8 kernel (sm90_fp8_grouped_1x128.cu) for GEMM1 of the
// flow recipes: from a 64 x 256 accumulator half tile whose two 128-feature halves are the gate and
// the up projections of the same 128 features (W1's rows interleaved in 128-row blocks g0, u0, g1,
// u1, ...), it writes a' = p * act(gate, up) as FP8 1x128 row tiles and the saved h (FP8 1x128
// row tiles, or MXFP4 1x32 blocks) in the layouts cuda::swiglu_quant / swiglu_quant_h4 write, with
// the same bits: the accumulator is rounded to BF16 as the BF16 epilogue rounds it, GEMM1's bias
// added as swiglu.h's GateUpBias adds it (when given), then the steps of swiglu_row_kernel
// (swiglu_math.h's act_f32 and saved_gate / saved_up, and the block quantization pieces of
// swiglu_common.cuh). h in BF16 is never written.
//
// Fragment layout (wgmma m64nNk32, FP32 accumulator): thread t of the warpgroup (warp w, lane l)
// holds rows r0 = 16 w + l / 4 (values 4 j + 0, 1) and r0 + 8 (values 4 j + 2, 3), columns
// 8 j + 2 (l % 4) + {0, 1} of each 128-feature half, j = 0 .. 15. A row's 128 features lie in the 4
// lanes of a quad (l / 4 equal): the tile amaxes combine over the quad by two shuffles; an MXFP4
// block of 32 columns is j = 4 b .. 4 b + 3 of the same quad.
//
// The codes go to shared memory first (the warpgroup's BF16 staging buffer, idle in this mode) and
// leave as 16-byte row chunks, so the global writes are whole rows of a tile; scales go straight
// from the quad's first lane. Rows past the expert's (the last token tile's tail, which belongs to
// the next expert or lies past the segments) are computed on zeros and never written.
#pragma once

#include "cuda/bias/expert_bias.cuh"
#include "cuda/sm90/arch.cuh"
#include "cuda/swiglu/swiglu_common.cuh"

namespace flowmoe {
namespace cuda {
namespace sm90 {

// What the grouped kernel's epilogue writes: BF16 D; GEMM1's SwiGLU (h saved as FP8 rows or
// MXFP4); GEMM2-dgrad's dSwiGLU (sm90_grouped_dswiglu_epilogue.cuh; h read as FP8 rows or MXFP4).
enum class Epi { kBf16, kSwigluH8, kSwigluH4, kDswigluH8, kDswigluH4 };
constexpr bool is_swiglu(Epi e) { return e == Epi::kSwigluH8 || e == Epi::kSwigluH4; }
constexpr bool is_dswiglu(Epi e) { return e == Epi::kDswigluH8 || e == Epi::kDswigluH4; }

// The SwiGLU epilogue's outputs (kernel parameters).
struct SwigluEpiParams {
  const float* prob = nullptr;  // [m] routing probability per row, or null (a' = swiglu)
  uint8_t* a_codes = nullptr;   // E4M3 [m, f]
  uint8_t* a_scales = nullptr;  // UE8M0 [f/128][scale_ld]
  uint8_t* h_codes = nullptr;   // kSwigluH8: E4M3 [m, 2f]; kSwigluH4: E2M1 [m, f] (2 per byte)
  uint8_t* h_scales = nullptr;  // kSwigluH8: UE8M0 [2f/128][h_scale_ld]; kSwigluH4: [m][2f/32]
  int64_t a_scale_ld = 0, h_scale_ld = 0;
  int f = 0;
  GatedActivation act;          // SwiGLU or gpt-oss's clamped SwiGLU
  const float* bias = nullptr;  // GEMM1's bias [experts][2f] FP32 (gate then up), or null
  unsigned long long* nonfinite = nullptr;  // non-finite a', gate and up values counted (may be null)
};

template <Epi kEpi>
struct SwigluStage {
  static constexpr int kHBytes = kEpi == Epi::kSwigluH8 ? 128 : 64;  // gate (and up) bytes per row
  static constexpr int kRowBytes = 128 + 2 * kHBytes;                // a', gate, up
  static constexpr int kChunks = kRowBytes / 16;
  // +16: a row starts 4 banks after the previous one, so the 8 rows of a warp's 2-byte writes hit
  // 16 different banks
  static constexpr int kPitch = kRowBytes + 16;
  static constexpr int kBytes = 64 * kPitch;
};

__device__ __forceinline__ int nonfinite_bf16x2(uint32_t w) {
  return ((w & 0x7F80u) == 0x7F80u) + ((w & 0x7F800000u) == 0x7F800000u);
}
// Largest |bf16| bit pattern of words w[j0 .. j0 + n).
template <int n>
__device__ __forceinline__ uint32_t absmax_bf16_words(const uint32_t* w) {
  uint32_t m = 0;
#pragma unroll
  for (int j = 0; j < n; ++j) m = __vmaxu2(m, w[j] & 0x7FFF7FFFu);
  return max(m & 0xFFFFu, m >> 16);
}

#ifdef FLOWMOE_SM90A  // (named_sync exists on sm_90a only; the kernel that calls this is guarded too)
// One warpgroup's half tile: acc[0] = gate, acc[1] = up of features 128 nt .. 128 nt + 127 for the
// 64 rows row0 .. row0 + 63 (global), of which the first `rows` belong to expert e (may be <= 0).
// t: the thread in the warpgroup; bar: the warpgroup's named barrier; stage: SwigluStage::kBytes of
// shared memory. All 128 threads must call.
template <Epi kEpi>
__device__ __forceinline__ void swiglu_epilogue(const float (&acc)[2][64], uint8_t* stage, const SwigluEpiParams& q,
                                                int64_t row0, int rows, int e, int nt, int t, int bar) {
  using namespace swiglu_detail;
  using S = SwigluStage<kEpi>;
  const int warp = t / 32, lane = t % 32, r0 = 16 * warp + lane / 4, c0 = 2 * (lane % 4);
  const int64_t f = q.f;
  int nbad = 0;
  // gate and up as GEMM1's BF16 output (RN, as the BF16 epilogue writes h), zeros past the rows;
  // both rows first, so that the FP32 accumulators are dead before the SwiGLU math
  uint32_t gw2[2][16], uw2[2][16];
#pragma unroll
  for (int rh = 0; rh < 2; ++rh) {
    const bool valid = r0 + 8 * rh < rows;
#pragma unroll
    for (int j = 0; j < 16; ++j) {
      gw2[rh][j] = valid ? pack_bf16x2(acc[0][4 * j + 2 * rh], acc[0][4 * j + 2 * rh + 1]) : 0u;
      uw2[rh][j] = valid ? pack_bf16x2(acc[1][4 * j + 2 * rh], acc[1][4 * j + 2 * rh + 1]) : 0u;
    }
  }
  if (q.bias) {  // GEMM1's bias, on the expert's rows only (the others stay zero, as in h)
    const float* gb = q.bias + int64_t(e) * 2 * f + 128 * nt + c0;  // up's at + f
#pragma unroll
    for (int j = 0; j < 16; ++j) {
      const float2 bg = __ldg(reinterpret_cast<const float2*>(gb + 8 * j));
      const float2 bu = __ldg(reinterpret_cast<const float2*>(gb + f + 8 * j));
#pragma unroll
      for (int rh = 0; rh < 2; ++rh) {
        if (r0 + 8 * rh >= rows) continue;
        gw2[rh][j] = bias_detail::add_bias2(gw2[rh][j], bg);
        uw2[rh][j] = bias_detail::add_bias2(uw2[rh][j], bu);
      }
    }
  }
  named_sync(bar, 128);  // the previous tile's chunks have been read out of `stage`
#pragma unroll
  for (int rh = 0; rh < 2; ++rh) {
    const int row = r0 + 8 * rh;
    const bool valid = row < rows;
    const int64_t grow = row0 + row;
    uint8_t* srow = stage + row * S::kPitch;
    uint32_t(&gw)[16] = gw2[rh];
    uint32_t(&uw)[16] = uw2[rh];
    float p = 0.0f;
    if (q.prob && valid) p = __ldg(q.prob + grow);
    // a' = act(gate, up) * p in binary32 (swiglu8 and the f_mul of swiglu_row_kernel)
    float a[32];
#pragma unroll
    for (int j = 0; j < 16; ++j) {
      a[2 * j] = act_f32(q.act, bf16_lo(gw[j]), bf16_lo(uw[j]));
      a[2 * j + 1] = act_f32(q.act, bf16_hi(gw[j]), bf16_hi(uw[j]));
      if (q.prob) {
        a[2 * j] = f_mul(a[2 * j], p);
        a[2 * j + 1] = f_mul(a[2 * j + 1], p);
      }
    }
    float m = 0.0f;
#pragma unroll
    for (int i = 0; i < 32; i += 2) m = absmax_nan(m, absmax_nan(a[i], a[i + 1]));
    const BlockScale sa = e4m3_scale_f32(detail::group_max_u(__float_as_uint(m), 4));
    {
      const float inv = detail::inv_pow2(sa.e);
#pragma unroll
      for (int j = 0; j < 16; ++j)
        *reinterpret_cast<uint16_t*>(srow + 8 * j + c0) =
            static_cast<uint16_t>(sa.bad ? 0x7F7Fu : e4m3_encode2(a[2 * j], a[2 * j + 1], inv, sa.e));
    }
    // the saved h: gate and up, with the clamp's marks (saved_h8; a' no longer reads them)
    if (q.act.clamped()) {
#pragma unroll
      for (int j = 0; j < 16; ++j) {
        gw[j] = saved_h2(q.act, gw[j], false);
        uw[j] = saved_h2(q.act, uw[j], true);
      }
    }
    bool hbad = false;
    if constexpr (kEpi == Epi::kSwigluH8) {
      const BlockScale sg = e4m3_scale_bf16(detail::group_max_u(absmax_bf16_words<16>(gw), 4));
      const BlockScale su = e4m3_scale_bf16(detail::group_max_u(absmax_bf16_words<16>(uw), 4));
      const float ig = detail::inv_pow2(sg.e), iu = detail::inv_pow2(su.e);
#pragma unroll
      for (int j = 0; j < 16; ++j) {
        *reinterpret_cast<uint16_t*>(srow + 128 + 8 * j + c0) =
            static_cast<uint16_t>(sg.bad ? 0x7F7Fu : e4m3_encode2(bf16_lo(gw[j]), bf16_hi(gw[j]), ig, sg.e));
        *reinterpret_cast<uint16_t*>(srow + 256 + 8 * j + c0) =
            static_cast<uint16_t>(su.bad ? 0x7F7Fu : e4m3_encode2(bf16_lo(uw[j]), bf16_hi(uw[j]), iu, su.e));
      }
      hbad = sg.bad || su.bad;
      if (valid && lane % 4 == 0) {
        q.h_scales[nt * q.h_scale_ld + grow] = sg.code();
        q.h_scales[(f / 128 + nt) * q.h_scale_ld + grow] = su.code();
      }
    } else {
      uint32_t gsc = 0, usc = 0;  // the 4 blocks' scale codes, block b in byte b
#pragma unroll
      for (int b = 0; b < 4; ++b) {
        const BlockScale sg = e2m1_scale_bf16(detail::group_max_u(absmax_bf16_words<4>(gw + 4 * b), 4));
        const BlockScale su = e2m1_scale_bf16(detail::group_max_u(absmax_bf16_words<4>(uw + 4 * b), 4));
        const float ig = detail::inv_pow2(sg.e), iu = detail::inv_pow2(su.e);
#pragma unroll
        for (int j = 4 * b; j < 4 * b + 4; ++j) {
          srow[128 + 4 * j + c0 / 2] = static_cast<uint8_t>(sg.bad ? 0u : e2m1_encode2(gw[j], ig, sg.e));
          srow[192 + 4 * j + c0 / 2] = static_cast<uint8_t>(su.bad ? 0u : e2m1_encode2(uw[j], iu, su.e));
        }
        hbad |= sg.bad || su.bad;
        gsc |= uint32_t(sg.code()) << (8 * b);
        usc |= uint32_t(su.code()) << (8 * b);
      }
      if (valid && lane % 4 == 0) {  // scales [m][2f/32]: gate blocks 4 nt .., up blocks f/32 + 4 nt ..
        uint8_t* dst = q.h_scales + grow * (f / 16) + 4 * nt;
        *reinterpret_cast<uint32_t*>(dst) = gsc;
        *reinterpret_cast<uint32_t*>(dst + f / 32) = usc;
      }
    }
    if (valid && lane % 4 == 0) q.a_scales[nt * q.a_scale_ld + grow] = sa.code();
    // non-finite a', gate and up values (as swiglu_row_kernel counts them; zero rows count none)
    if (__any_sync(0xffffffffu, sa.bad || hbad)) {
#pragma unroll
      for (int i = 0; i < 32; ++i) nbad += (__float_as_uint(a[i]) & 0x7F800000u) == 0x7F800000u;
#pragma unroll
      for (int j = 0; j < 16; ++j) nbad += nonfinite_bf16x2(gw[j]) + nonfinite_bf16x2(uw[j]);
    }
  }
  detail::warp_count(q.nonfinite, nbad);
  named_sync(bar, 128);  // every row's codes are in `stage`
  // 16-byte chunks of the expert's rows: a' [m, f], then gate and up
  for (int i = t; i < 64 * S::kChunks; i += 128) {
    const int row = i / S::kChunks, c = i % S::kChunks;
    if (row >= rows) break;  // i grows with the row
    const uint4 v = *reinterpret_cast<const uint4*>(stage + row * S::kPitch + 16 * c);
    const int64_t grow = row0 + row;
    uint8_t* dst;
    if (c < 8) {
      dst = q.a_codes + grow * f + 128 * nt + 16 * c;
    } else if constexpr (kEpi == Epi::kSwigluH8) {  // gate cols 128 nt .., up cols f + 128 nt ..
      dst = q.h_codes + grow * 2 * f + (c < 16 ? 128 * nt + 16 * (c - 8) : f + 128 * nt + 16 * (c - 16));
    } else {  // packed [m, f] bytes: gate bytes 64 nt .., up bytes f/2 + 64 nt ..
      dst = q.h_codes + grow * f + (c < 12 ? 64 * nt + 16 * (c - 8) : f / 2 + 64 * nt + 16 * (c - 12));
    }
    *reinterpret_cast<uint4*>(dst) = v;
  }
}
#endif

}  // namespace sm90
}  // namespace cuda
}  // namespace flowmoe
