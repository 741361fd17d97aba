// Private building blocks of the SwiGLU kernels (swiglu_forward.cu, swiglu_backward.cu, and GEMM1's
// fused SwiGLU epilogue, gemm/sm90_grouped_swiglu_epilogue.cuh): element helpers (BF16
// unpack/pack, the gated activation and its gradient of 8 features, E4M3 and E2M1 decoding),
// block quantization in pieces (scale from the amax, pair encoding) and the quantization of a
// 1x128 row tile held by a half-warp (and the MXFP4 1x32 blocks of H) built from them, the tuning
// constants both directions share, and the host-side argument checks.
#pragma once

#include <cuda_bf16.h>
#include <cuda_fp16.h>
#include <cuda_fp8.h>

#include "cuda/convert/tile.cuh"
#include "flowmoe/swiglu.h"
#include "flowmoe/swiglu_math.h"

namespace flowmoe {
namespace cuda {
namespace swiglu_detail {

using namespace flowmoe::num;
using namespace detail::host;
using detail::kBytePitch;
using detail::kThreads;
using detail::kTile;

// ---- element helpers ------------------------------------------------------------------------------
__device__ __forceinline__ float bf16_lo(uint32_t w) { return __uint_as_float(w << 16); }
__device__ __forceinline__ float bf16_hi(uint32_t w) { return __uint_as_float(w & 0xFFFF0000u); }

// Two binary32 -> packed BF16 (lo in the low half), hardware round to nearest even. A NaN comes
// out with the hardware's payload: the fused kernels only test it (any NaN marks its tile), the
// plain kernels make it canonical before storing (canonical_nan8).
__device__ __forceinline__ uint32_t pack_bf16x2(float lo, float hi) {
  const __nv_bfloat162 b = __floats2bfloat162_rn(lo, hi);
  return *reinterpret_cast<const uint32_t*>(&b);
}
// Every NaN of 8 packed BF16 -> 0x7FC0 (num::bf16_canonical). `absmax` = absmax8_bits(v).
__device__ __forceinline__ uint4 canonical_nan8(uint4 v, uint32_t absmax) {
  if (absmax <= 0x7F80u) return v;  // no NaN (the usual case)
  uint32_t w[4] = {v.x, v.y, v.z, v.w};
#pragma unroll
  for (int q = 0; q < 4; ++q) {
    if ((w[q] & 0x7FFFu) > 0x7F80u) w[q] = (w[q] & 0xFFFF0000u) | 0x7FC0u;
    if ((w[q] & 0x7FFF0000u) > 0x7F800000u) w[q] = (w[q] & 0x0000FFFFu) | 0x7FC00000u;
  }
  return make_uint4(w[0], w[1], w[2], w[3]);
}

__device__ __forceinline__ uint4 ldg16(const void* p) { return __ldg(reinterpret_cast<const uint4*>(p)); }

// The gated activation `act` (num::act_f32 and its gradients; a kernel argument, so the branch
// on its kind inside act_f32 is uniform across the grid) in the three helpers below.
// A = act(gate, up) for 8 consecutive features: gate chunk g, up chunk u (8 bf16 each) -> 8
// binary32 values.
__device__ __forceinline__ void swiglu8(const GatedActivation& act, const uint4& g, const uint4& u,
                                        float (&a)[8]) {
  const uint32_t gw[4] = {g.x, g.y, g.z, g.w}, uw[4] = {u.x, u.y, u.z, u.w};
#pragma unroll
  for (int q = 0; q < 4; ++q) {
    a[2 * q] = act_f32(act, bf16_lo(gw[q]), bf16_lo(uw[q]));
    a[2 * q + 1] = act_f32(act, bf16_hi(gw[q]), bf16_hi(uw[q]));
  }
}
__device__ __forceinline__ uint4 pack8(const float (&a)[8]) {
  return make_uint4(pack_bf16x2(a[0], a[1]), pack_bf16x2(a[2], a[3]), pack_bf16x2(a[4], a[5]),
                    pack_bf16x2(a[6], a[7]));
}

// dgate and dup (num::dact_f32) for 8 consecutive features from binary32 inputs.
__device__ __forceinline__ void dswiglu8(const GatedActivation& act, const float (&da)[8],
                                         const float (&g)[8], const float (&u)[8], uint4& dg,
                                         uint4& du) {
  uint32_t a[4], b[4];
#pragma unroll
  for (int q = 0; q < 4; ++q) {
    const SwigluGrad lo = dact_f32(act, da[2 * q], g[2 * q], u[2 * q]);
    const SwigluGrad hi = dact_f32(act, da[2 * q + 1], g[2 * q + 1], u[2 * q + 1]);
    a[q] = pack_bf16x2(lo.dgate, hi.dgate);
    b[q] = pack_bf16x2(lo.dup, hi.dup);
  }
  dg = make_uint4(a[0], a[1], a[2], a[3]);
  du = make_uint4(b[0], b[1], b[2], b[3]);
}

// The same with the routing probability p (num::dact_prob_f32), and this lane's four pair
// values of dp (swiglu.h's order): pair[q] = fma(da[2q+1], a[2q+1], fma(da[2q], a[2q], +0)).
__device__ __forceinline__ void dswiglu8_prob(const GatedActivation& act, const float (&da)[8],
                                              float p, const float (&g)[8], const float (&u)[8],
                                              uint4& dg, uint4& du, float (&pair)[4]) {
  uint32_t a[4], b[4];
#pragma unroll
  for (int q = 0; q < 4; ++q) {
    const SwigluGradProb lo = dact_prob_f32(act, da[2 * q], p, g[2 * q], u[2 * q]);
    const SwigluGradProb hi = dact_prob_f32(act, da[2 * q + 1], p, g[2 * q + 1], u[2 * q + 1]);
    pair[q] = f_fma(da[2 * q + 1], hi.a, f_fma(da[2 * q], lo.a, 0.0f));
    a[q] = pack_bf16x2(lo.dgate, hi.dgate);
    b[q] = pack_bf16x2(lo.dup, hi.dup);
  }
  dg = make_uint4(a[0], a[1], a[2], a[3]);
  du = make_uint4(b[0], b[1], b[2], b[3]);
}
// dp partial of a 1x128 tile held by a half-warp, lane l holding the 8-feature group l: each pair
// position q summed over the 16 groups by the butterfly (xor 1, 2, 4, 8: the pairwise tree, adjacent
// groups first; every lane ends with the same sums, f_add being commutative), then
// (q0 + q1) + (q2 + q3) (swiglu.h's order, which GEMM2-dgrad's fused epilogue also follows).
__device__ __forceinline__ float tile_sum16(float (&pair)[4]) {
#pragma unroll
  for (int o = 1; o < 16; o <<= 1)
#pragma unroll
    for (int q = 0; q < 4; ++q) pair[q] = f_add(pair[q], __shfl_xor_sync(0xffffffffu, pair[q], o));
  return f_add(f_add(pair[0], pair[1]), f_add(pair[2], pair[3]));
}

__device__ __forceinline__ void unpack8(const uint4& v, float (&x)[8]) {
  const uint32_t w[4] = {v.x, v.y, v.z, v.w};
#pragma unroll
  for (int q = 0; q < 4; ++q) {
    x[2 * q] = bf16_lo(w[q]);
    x[2 * q + 1] = bf16_hi(w[q]);
  }
}

// The saved copy of 2 BF16 gate (up = false) or up values packed in a word (num::saved_gate /
// saved_up), and of 8 in a uint4: BF16 in, BF16 out, unchanged for SwiGLU.
__device__ __forceinline__ uint32_t saved_h2(const GatedActivation& act, uint32_t w, bool up) {
  const float lo = bf16_lo(w), hi = bf16_hi(w);
  return up ? pack_bf16x2(saved_up(act, lo), saved_up(act, hi)) : pack_bf16x2(saved_gate(act, lo), saved_gate(act, hi));
}
__device__ __forceinline__ uint4 saved_h8(const GatedActivation& act, const uint4& v, bool up) {
  if (!act.clamped()) return v;
  return make_uint4(saved_h2(act, v.x, up), saved_h2(act, v.y, up), saved_h2(act, v.z, up), saved_h2(act, v.w, up));
}

// 8 E4M3 codes (a uint2) of one 1x128 row tile with scale code `s`, decoded exactly to binary32
// (code value * 2^(s-127); a NaN scale gives NaN), as num::dequant_e4m3 up to NaN payloads.
__device__ __forceinline__ void decode8(const uint2& c, uint8_t s, float (&x)[8]) {
  const float sf = ue8m0_to_f32(s);
  const uint32_t w[2] = {c.x, c.y};
#pragma unroll
  for (int i = 0; i < 4; ++i) {
    const __half2_raw hr =
        __nv_cvt_fp8x2_to_halfraw2(static_cast<__nv_fp8x2_storage_t>(w[i >> 1] >> (16 * (i & 1))), __NV_E4M3);
    const float2 f = __half22float2(*reinterpret_cast<const __half2*>(&hr));
    x[2 * i] = f_mul(f.x, sf);  // exact: a 4-bit significand times a power of two >= 2^-127
    x[2 * i + 1] = f_mul(f.y, sf);
  }
}

// 8 E2M1 values (a uint32, value i in bits 4i..4i+3) of one 1x32 MXFP4 block with scale `s`,
// decoded exactly (= num::dequant_e2m1; a NaN scale gives NaN). Every E2M1 value is an E4M3 value,
// so each nibble becomes the E4M3 code of the same number (one byte permute per four: magnitudes
// 0, 0.5, 1, 1.5, 2, 3, 4, 6 -> 0x00 0x30 0x38 0x3C 0x40 0x44 0x48 0x4C; the sign moves to bit 7)
// and decode8 does the rest with the hardware FP8 conversion.
__device__ __forceinline__ void decode8_fp4(uint32_t c, uint8_t s, float (&x)[8]) {
  constexpr uint32_t kLo = 0x3C383000u, kHi = 0x4C484440u;
  uint32_t out[2];
#pragma unroll
  for (int q = 0; q < 2; ++q) {
    const uint32_t v = (c >> (16 * q)) & 0xFFFFu;                // 4 nibbles
    uint32_t y = (v & 0xFFu) | ((v & 0xFF00u) << 8);             // nibble pairs in bytes 0 and 2
    y = (y & 0x000F000Fu) | ((y & 0x00F000F0u) << 4);            // one nibble per byte
    out[q] = __byte_perm(kLo, kHi, v & 0x7777u) | ((y & 0x08080808u) << 4);
  }
  decode8(make_uint2(out[0], out[1]), s, x);
}

// ---- block quantization in pieces ------------------------------------------------------------------
// The scale of a block from the largest magnitude of its values, and the codes of a pair of values
// under that scale: the quantizers below (a block held by a half-warp or a quad, 8 values a lane)
// and GEMM1's fused SwiGLU epilogue (sm90_grouped_swiglu_epilogue.cuh: a row's 1x128 tile held by
// 4 lanes, 32 values each) are built from the same steps, so they give the same bits.
struct BlockScale {
  int e;     // scale exponent (meaningless when bad)
  bool bad;  // the block holds an Inf or NaN: scale code 0xFF
  __device__ __forceinline__ uint8_t code() const { return bad ? kUE8M0NaN : ue8m0_from_exp(e); }
};
// E4M3 scale from the largest |bf16| bit pattern of the block (absmax8_bits, combined by integer
// maximum: >= 0x7F80 means Inf or NaN).
__device__ __forceinline__ BlockScale e4m3_scale_bf16(uint32_t amax_bits) {
  return BlockScale{e4m3_scale_exp(detail::bf16_bits_to_f32(amax_bits)), amax_bits >= detail::kBf16NonFiniteBits};
}
// E4M3 scale from the largest |binary32| bit pattern (absmax_nan per lane, combined by integer
// maximum: NaN above Inf, >= 0x7F800000 means Inf or NaN; finite blocks get exactly max |a|).
__device__ __forceinline__ BlockScale e4m3_scale_f32(uint32_t amax_bits) {
  return BlockScale{e4m3_scale_exp(__uint_as_float(amax_bits)), amax_bits >= 0x7F800000u};
}
// E2M1 (MXFP4) scale from the largest |bf16| bit pattern of the 1x32 block.
__device__ __forceinline__ BlockScale e2m1_scale_bf16(uint32_t amax_bits) {
  return BlockScale{e2m1_scale_exp(detail::bf16_bits_to_f32(amax_bits)), amax_bits >= detail::kBf16NonFiniteBits};
}
// Two E4M3 codes (x in the low byte) of a finite block with scale exponent e, inv = inv_pow2(e).
__device__ __forceinline__ uint32_t e4m3_encode2(float x, float y, float inv, int e) {
  return detail::e4m3x4_saturate_for_scale(detail::e4m3x2(x * inv, y * inv), e);
}
// Two E2M1 nibbles (the low BF16 of w in the low nibble) of a finite MXFP4 block with exponent e.
__device__ __forceinline__ uint32_t e2m1_encode2(uint32_t w, float inv, int e) {
  return detail::e2m1x8_saturate_for_scale(detail::e2m1x2_bounded(bf16_lo(w) * inv, bf16_hi(w) * inv), e, 2);
}
// max(|x|, |y|) propagating NaN (PTX max.NaN; the absolute values fold into FMNMX's operand
// modifiers): one instruction per value where integer maxima of masked bits take two.
__device__ __forceinline__ float absmax_nan(float x, float y) {
  float r;
  asm("max.NaN.f32 %0, %1, %2;" : "=f"(r) : "f"(fabsf(x)), "f"(fabsf(y)));
  return r;
}

// MXFP4 (1x32) of 8 BF16 values per lane, a quad of lanes per block (cpu::quantize_mxfp4's rule;
// the same steps as quantize_mxfp4_kernel). All 32 lanes must call.
struct Fp4Codes {
  uint32_t codes;  // this lane's 8 nibbles
  uint8_t scale;   // the block's UE8M0 scale (0xFF: non-finite block, codes 0)
};
__device__ __forceinline__ Fp4Codes quantize_fp4x8(const uint4& v, unsigned long long* nonfinite) {
  const BlockScale s = e2m1_scale_bf16(detail::group_max_u(detail::absmax8_bits(v), 4));
  detail::count_nonfinite_warp(nonfinite, v, s.bad);
  uint32_t out = 0;
  if (!s.bad) {
    const float inv = detail::inv_pow2(s.e);
    const uint32_t w[4] = {v.x, v.y, v.z, v.w};
#pragma unroll
    for (int q = 0; q < 4; ++q)
      out |= detail::e2m1x2_bounded(bf16_lo(w[q]) * inv, bf16_hi(w[q]) * inv) << (8 * q);
    out = detail::e2m1x8_saturate_for_scale(out, s.e);
  }
  return Fp4Codes{out, s.code()};
}

// ---- quantization of a 1x128 row tile held by a half-warp (8 bf16 per lane) ----------------------
// All 32 lanes of the warp must call (shuffles); lanes of rows past the end hold zeros.
__device__ __forceinline__ uint2 encode8(const uint4& v, int e, bool nan_tile) {
  if (nan_tile) return make_uint2(0x7F7F7F7Fu, 0x7F7F7F7Fu);
  const float inv = detail::inv_pow2(e);
  const uint32_t w[4] = {v.x, v.y, v.z, v.w};
  uint32_t lo16[4];
#pragma unroll
  for (int q = 0; q < 4; ++q) lo16[q] = detail::e4m3x2(bf16_lo(w[q]) * inv, bf16_hi(w[q]) * inv);
  return make_uint2(detail::e4m3x4_saturate_for_scale(lo16[0] | (lo16[1] << 16), e),
                    detail::e4m3x4_saturate_for_scale(lo16[2] | (lo16[3] << 16), e));
}

struct TileCodes {
  uint2 codes;    // this lane's 8 codes
  uint8_t scale;  // the tile's UE8M0 scale (0xFF: non-finite tile)
};
__device__ __forceinline__ TileCodes quantize_tile8(const uint4& v, unsigned long long* nonfinite) {
  const BlockScale s = e4m3_scale_bf16(detail::group_max_u(detail::absmax8_bits(v), 16));
  detail::count_nonfinite_warp(nonfinite, v, s.bad);
  return TileCodes{encode8(v, s.e, s.bad), s.code()};
}
// The same for binary32 values (8 per lane). The lane's amax is a non-negative float or NaN, so
// its bits order like the values (NaN above Inf) and the 16 lanes combine by integer maximum; any
// bits >= 0x7F800000 mean Inf or NaN. Finite tiles get exactly the bits of max |a|.
__device__ __forceinline__ TileCodes quantize_tile8(const float (&a)[8], unsigned long long* nonfinite) {
  const float m = absmax_nan(absmax_nan(absmax_nan(a[0], a[1]), absmax_nan(a[2], a[3])),
                             absmax_nan(absmax_nan(a[4], a[5]), absmax_nan(a[6], a[7])));
  const uint32_t mx = detail::group_max_u(__float_as_uint(m), 16);
  const bool bad = mx >= 0x7F800000u;
  if (__any_sync(0xffffffffu, bad)) {
    int nbad = 0;
#pragma unroll
    for (int i = 0; i < 8; ++i) nbad += (__float_as_uint(a[i]) & 0x7F800000u) == 0x7F800000u;
    detail::warp_count(nonfinite, nbad);
  }
  if (bad) return TileCodes{make_uint2(0x7F7F7F7Fu, 0x7F7F7F7Fu), kUE8M0NaN};
  const BlockScale s = e4m3_scale_f32(mx);
  const float inv = detail::inv_pow2(s.e);
  uint32_t c[4];
#pragma unroll
  for (int q = 0; q < 4; ++q) c[q] = detail::e4m3x2(a[2 * q] * inv, a[2 * q + 1] * inv);
  return TileCodes{make_uint2(detail::e4m3x4_saturate_for_scale(c[0] | (c[1] << 16), s.e),
                             detail::e4m3x4_saturate_for_scale(c[2] | (c[3] << 16), s.e)),
                   s.code()};
}

// ---- tuning constants shared by the forward and backward kernels ----------------------------------
#ifndef FLOWMOE_SWIGLU_ROWS_PER_HALF_WARP
#define FLOWMOE_SWIGLU_ROWS_PER_HALF_WARP 2
#endif
#ifndef FLOWMOE_SWIGLU_PASS_GROUP
#define FLOWMOE_SWIGLU_PASS_GROUP 4
#endif
constexpr int kRowsPerHalfWarp = FLOWMOE_SWIGLU_ROWS_PER_HALF_WARP;  // rows in flight per half-warp
constexpr int kRowsPerCta = (kThreads / 16) * kRowsPerHalfWarp;  // 32
constexpr int kPasses = kTile / (kThreads / 16);  // 8 passes of 16 rows cover a 128-token block
constexpr int kPassGroup = FLOWMOE_SWIGLU_PASS_GROUP;  // passes whose loads are in flight together

// ---- host-side checks -------------------------------------------------------------------------------
inline void check_f(int64_t f, const char* what) {
  FLOWMOE_CHECK(f > 0 && f % kTile == 0,
                what << ": F = " << f << " is not a positive multiple of 128 (the quantization "
                     << "block); H must be [M, 2F] with gate = columns [0, F), up = [F, 2F)");
  FLOWMOE_CHECK(f / kTile <= 65535, what << ": F = " << f << " too large (at most 65535 * 128)");
}
inline void check_m(int64_t m, const char* what) {
  FLOWMOE_CHECK(m >= 0, what << ": M = " << m << " must be >= 0");
}
inline dim3 row_grid(int64_t m, int64_t f) {
  const int64_t gx = (m + kRowsPerCta - 1) / kRowsPerCta;
  FLOWMOE_CHECK(gx < (1ll << 31), "problem too large for one launch: M = " << m);
  return dim3(static_cast<unsigned>(gx), static_cast<unsigned>(f / kTile));
}
inline void check_pair(const void* codes, const void* scales, const char* cname, const char* sname,
                       const char* what) {
  check_aligned(codes, cname, what);
  FLOWMOE_CHECK(scales != nullptr, what << ": " << sname << " is null");
}
// The gated activation: a known kind; the clamped one with a limit > 0 and a finite alpha.
inline void check_act(const GatedActivation& act, const char* what) {
  const char* why = num::activation_unsupported(act);
  FLOWMOE_CHECK(why == nullptr, what << ": " << why << " (kind " << static_cast<int>(act.kind) << ", limit "
                                     << act.limit << ", alpha " << act.alpha << ")");
}
inline void check_prob(const float* prow, const float* dprow_part, const char* what) {
  FLOWMOE_CHECK(prow != nullptr || dprow_part == nullptr,
                what << ": dprow_part (the gradient of the routing probabilities) needs prow; "
                     << "give prow, or pass null for both");
}
}  // namespace swiglu_detail
}  // namespace cuda
}  // namespace flowmoe
