// SwiGLU forward and backward on the GPU: plain BF16 kernels (the baselines) and the fused
// SwiGLU + FP8 quantize kernels, bit-identical to flowmoe::cpu (flowmoe/swiglu.h).
//
// Kernels
//   swiglu_row_kernel<Out>      half-warp per (token, 128-feature tile of A): reads the gate and
//                               up chunks, computes A in binary32 (swiglu_math.h) and either
//                               stores it as BF16 (plain) or quantizes the 1x128 tile straight
//                               from binary32 (fused), optionally quantizing the two H tiles it
//                               read as well.
//   swiglu_quant_col_kernel     one CTA per (128-token block of a segment, 128-feature tile):
//                               the row pass above into a shared byte tile, then the column copy
//                               by exponent shifts (the scaling-aware transpose, fused).
//   dswiglu_row_kernel          plain backward, same grid as the forward row kernel.
//   dswiglu_quant_kernel<Fp8H>  one CTA per (token block, feature tile): dA, gate and up tiles in,
//                               dgate and dup (BF16) formed once, row-wise tiles quantized from
//                               registers, the BF16 tile kept in shared memory for the column-wise
//                               quantization along tokens.
#include <cuda_bf16.h>
#include <cuda_fp16.h>
#include <cuda_fp8.h>

#include <algorithm>
#include <atomic>

#include "cuda/convert/tile.cuh"
#include "flowmoe/swiglu.h"
#include "flowmoe/swiglu_math.h"

namespace flowmoe {
namespace cuda {
namespace {

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

// A for 8 consecutive features: gate chunk g, up chunk u (8 bf16 each) -> 8 binary32 values.
__device__ __forceinline__ void swiglu8(const uint4& g, const uint4& u, float (&a)[8]) {
  const uint32_t gw[4] = {g.x, g.y, g.z, g.w}, uw[4] = {u.x, u.y, u.z, u.w};
#pragma unroll
  for (int q = 0; q < 4; ++q) {
    a[2 * q] = swiglu_f32(bf16_lo(gw[q]), bf16_lo(uw[q]));
    a[2 * q + 1] = swiglu_f32(bf16_hi(gw[q]), bf16_hi(uw[q]));
  }
}
__device__ __forceinline__ uint4 pack8(const float (&a)[8]) {
  return make_uint4(pack_bf16x2(a[0], a[1]), pack_bf16x2(a[2], a[3]), pack_bf16x2(a[4], a[5]),
                    pack_bf16x2(a[6], a[7]));
}

// dgate and dup for 8 consecutive features from binary32 inputs.
__device__ __forceinline__ void dswiglu8(const float (&da)[8], const float (&g)[8], const float (&u)[8],
                                         uint4& dg, uint4& du) {
  uint32_t a[4], b[4];
#pragma unroll
  for (int q = 0; q < 4; ++q) {
    const SwigluGrad lo = dswiglu_f32(da[2 * q], g[2 * q], u[2 * q]);
    const SwigluGrad hi = dswiglu_f32(da[2 * q + 1], g[2 * q + 1], u[2 * q + 1]);
    a[q] = pack_bf16x2(lo.dgate, hi.dgate);
    b[q] = pack_bf16x2(lo.dup, hi.dup);
  }
  dg = make_uint4(a[0], a[1], a[2], a[3]);
  du = make_uint4(b[0], b[1], b[2], b[3]);
}

// The same with the routing probability p (num::dswiglu_prob_f32), accumulating this lane's share
// of dp: acc = fma(da[i], a[i], acc) for its 8 features in order.
__device__ __forceinline__ void dswiglu8_prob(const float (&da)[8], float p, const float (&g)[8],
                                              const float (&u)[8], uint4& dg, uint4& du, float& acc) {
  uint32_t a[4], b[4];
#pragma unroll
  for (int q = 0; q < 4; ++q) {
    const SwigluGradProb lo = dswiglu_prob_f32(da[2 * q], p, g[2 * q], u[2 * q]);
    const SwigluGradProb hi = dswiglu_prob_f32(da[2 * q + 1], p, g[2 * q + 1], u[2 * q + 1]);
    acc = f_fma(da[2 * q], lo.a, acc);
    acc = f_fma(da[2 * q + 1], hi.a, acc);
    a[q] = pack_bf16x2(lo.dgate, hi.dgate);
    b[q] = pack_bf16x2(lo.dup, hi.dup);
  }
  dg = make_uint4(a[0], a[1], a[2], a[3]);
  du = make_uint4(b[0], b[1], b[2], b[3]);
}
// dp partial of a 1x128 tile held by a half-warp: the 16 lane sums combined by the butterfly
// (xor 8, 4, 2, 1; every lane ends with the same value, f_add being commutative).
__device__ __forceinline__ float tile_sum16(float acc) {
#pragma unroll
  for (int o = 8; o > 0; o >>= 1) acc = f_add(acc, __shfl_xor_sync(0xffffffffu, acc, o));
  return acc;
}

__device__ __forceinline__ void unpack8(const uint4& v, float (&x)[8]) {
  const uint32_t w[4] = {v.x, v.y, v.z, v.w};
#pragma unroll
  for (int q = 0; q < 4; ++q) {
    x[2 * q] = bf16_lo(w[q]);
    x[2 * q + 1] = bf16_hi(w[q]);
  }
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

// MXFP4 (1x32) of 8 BF16 values per lane, a quad of lanes per block (cpu::quantize_mxfp4's rule;
// the same steps as quantize_mxfp4_kernel). All 32 lanes must call.
struct Fp4Codes {
  uint32_t codes;  // this lane's 8 nibbles
  uint8_t scale;   // the block's UE8M0 scale (0xFF: non-finite block, codes 0)
};
__device__ __forceinline__ Fp4Codes quantize_fp4x8(const uint4& v, unsigned long long* nonfinite) {
  const uint32_t amax_bits = detail::group_max_u(detail::absmax8_bits(v), 4);
  const bool bad = amax_bits >= detail::kBf16NonFiniteBits;
  detail::count_nonfinite_warp(nonfinite, v, bad);
  const int e = e2m1_scale_exp(detail::bf16_bits_to_f32(amax_bits));
  uint32_t out = 0;
  if (!bad) {
    const float inv = detail::inv_pow2(e);
    const uint32_t w[4] = {v.x, v.y, v.z, v.w};
#pragma unroll
    for (int q = 0; q < 4; ++q)
      out |= detail::e2m1x2_bounded(bf16_lo(w[q]) * inv, bf16_hi(w[q]) * inv) << (8 * q);
    out = detail::e2m1x8_saturate_for_scale(out, e);
  }
  return Fp4Codes{out, bad ? kUE8M0NaN : ue8m0_from_exp(e)};
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
  const uint32_t amax_bits = detail::group_max_u(detail::absmax8_bits(v), 16);
  const bool bad = amax_bits >= detail::kBf16NonFiniteBits;
  detail::count_nonfinite_warp(nonfinite, v, bad);
  const int e = e4m3_scale_exp(detail::bf16_bits_to_f32(amax_bits));
  return TileCodes{encode8(v, e, bad), bad ? kUE8M0NaN : ue8m0_from_exp(e)};
}
// max(|x|, |y|) propagating NaN (PTX max.NaN; the absolute values fold into FMNMX's operand
// modifiers): one instruction per value where integer maxima of masked bits take two.
__device__ __forceinline__ float absmax_nan(float x, float y) {
  float r;
  asm("max.NaN.f32 %0, %1, %2;" : "=f"(r) : "f"(fabsf(x)), "f"(fabsf(y)));
  return r;
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
  const int e = e4m3_scale_exp(__uint_as_float(mx));
  const float inv = detail::inv_pow2(e);
  uint32_t c[4];
#pragma unroll
  for (int q = 0; q < 4; ++q) c[q] = detail::e4m3x2(a[2 * q] * inv, a[2 * q + 1] * inv);
  return TileCodes{make_uint2(detail::e4m3x4_saturate_for_scale(c[0] | (c[1] << 16), e),
                             detail::e4m3x4_saturate_for_scale(c[2] | (c[3] << 16), e)),
                   ue8m0_from_exp(e)};
}

// ---- forward, row-wise: plain BF16 or fused quantize ----------------------------------------------
enum class FwdOut { kBf16, kFp8, kFp8SaveH, kFp8SaveH4 };
// Tuning constants (a -D override exists for benchmark sweeps; the defaults are the measured best).
#ifndef FLOWMOE_SWIGLU_ROWS_PER_HALF_WARP
#define FLOWMOE_SWIGLU_ROWS_PER_HALF_WARP 2
#endif
#ifndef FLOWMOE_SWIGLU_PASS_GROUP
#define FLOWMOE_SWIGLU_PASS_GROUP 4
#endif
#ifndef FLOWMOE_SWIGLU_BWD_CTAS_PER_SM
#define FLOWMOE_SWIGLU_BWD_CTAS_PER_SM 3
#endif
constexpr int kRowsPerHalfWarp = FLOWMOE_SWIGLU_ROWS_PER_HALF_WARP;  // rows in flight per half-warp
constexpr int kRowsPerCta = (kThreads / 16) * kRowsPerHalfWarp;  // 32

template <FwdOut kOut>
__global__ void __launch_bounds__(kThreads)
swiglu_row_kernel(const bf16_t* __restrict__ h, const float* __restrict__ prow, int64_t m, int64_t f,
                  bf16_t* __restrict__ a, uint8_t* __restrict__ a_codes, uint8_t* __restrict__ a_scales,
                  uint8_t* __restrict__ h_codes, uint8_t* __restrict__ h_scales,
                  unsigned long long* nonfinite) {
  const int64_t kb = blockIdx.y;  // feature tile
  const int lane = threadIdx.x & 15;
  const int64_t r0 = static_cast<int64_t>(blockIdx.x) * kRowsPerCta + (threadIdx.x >> 4);
  uint4 g[kRowsPerHalfWarp], u[kRowsPerHalfWarp];
  float p[kRowsPerHalfWarp];
#pragma unroll
  for (int i = 0; i < kRowsPerHalfWarp; ++i) {
    const int64_t r = r0 + i * (kThreads / 16);
    g[i] = u[i] = make_uint4(0, 0, 0, 0);
    p[i] = 0.0f;
    if (r < m) {
      const bf16_t* src = h + r * 2 * f + kb * kTile + lane * 8;
      g[i] = ldg16(src);
      u[i] = ldg16(src + f);
      if (prow) p[i] = __ldg(prow + r);
    }
  }
#pragma unroll
  for (int i = 0; i < kRowsPerHalfWarp; ++i) {
    const int64_t r = r0 + i * (kThreads / 16);
    float a32[8];
    swiglu8(g[i], u[i], a32);
    if (prow) {
#pragma unroll
      for (int q = 0; q < 8; ++q) a32[q] = f_mul(a32[q], p[i]);
    }
    if constexpr (kOut == FwdOut::kBf16) {
      const uint4 av = pack8(a32);
      const uint32_t mx = detail::absmax8_bits(av);
      if (nonfinite) detail::count_nonfinite_warp(nonfinite, av, mx >= detail::kBf16NonFiniteBits);
      if (r < m) *reinterpret_cast<uint4*>(a + r * f + kb * kTile + lane * 8) = canonical_nan8(av, mx);
    } else {
      const TileCodes q = quantize_tile8(a32, nonfinite);
      if (r < m) {
        *reinterpret_cast<uint2*>(a_codes + r * f + kb * kTile + lane * 8) = q.codes;
        if (lane == 0) a_scales[kb * m + r] = q.scale;
      }
      if constexpr (kOut == FwdOut::kFp8SaveH4) {  // H as MXFP4: codes [M, 2F/2], scales [M][2F/32]
        const Fp4Codes qg = quantize_fp4x8(g[i], nonfinite);
        const Fp4Codes qu = quantize_fp4x8(u[i], nonfinite);
        if (r < m) {
          const int64_t col = kb * kTile + lane * 8;
          uint8_t* dst = h_codes + (r * 2 * f + col) / 2;
          *reinterpret_cast<uint32_t*>(dst) = qg.codes;
          *reinterpret_cast<uint32_t*>(dst + f / 2) = qu.codes;
          if ((lane & 3) == 0) {
            h_scales[r * (2 * f / 32) + col / 32] = qg.scale;
            h_scales[r * (2 * f / 32) + (f + col) / 32] = qu.scale;
          }
        }
      }
      if constexpr (kOut == FwdOut::kFp8SaveH) {
        const TileCodes qg = quantize_tile8(g[i], nonfinite);
        const TileCodes qu = quantize_tile8(u[i], nonfinite);
        if (r < m) {
          uint8_t* dst = h_codes + r * 2 * f + kb * kTile + lane * 8;
          *reinterpret_cast<uint2*>(dst) = qg.codes;
          *reinterpret_cast<uint2*>(dst + f) = qu.codes;
          if (lane == 0) {
            h_scales[kb * m + r] = qg.scale;
            h_scales[(f / kTile + kb) * m + r] = qu.scale;
          }
        }
      }
    }
  }
}

// ---- forward with the column-wise copy (fused scaling-aware transpose) ------------------------------
// Re-encodes the 4 codes of a word of a finite tile with shift d > 0 (RNE into subnormals where
// the value leaves the normal range; counted in `lost`). Fast path: every byte keeps an exponent
// field >= 1, so only the exponent field drops by d (finite quantized codes are never NaN).
__device__ __forceinline__ uint32_t shift_codes4(uint32_t w, int d, int& lost) {
  if (d < 15) {
    const uint32_t ef = (w >> 3) & 0x0F0F0F0Fu;  // exponent fields
    const uint32_t keep = ((ef | 0x10101010u) - 0x01010101u * static_cast<uint32_t>(d + 1)) & 0x10101010u;
    if (keep == 0x10101010u) return w - 0x01010101u * (static_cast<uint32_t>(d) << 3);
  }
  uint32_t out = 0;
#pragma unroll
  for (int i = 0; i < 4; ++i) {
    bool l = false;
    out |= static_cast<uint32_t>(e4m3_rescale_fast(static_cast<uint8_t>(w >> (8 * i)), d, &l)) << (8 * i);
    lost += l;
  }
  return out;
}

constexpr int kPasses = kTile / (kThreads / 16);  // 8 passes of 16 rows cover a 128-token block
constexpr int kPassGroup = FLOWMOE_SWIGLU_PASS_GROUP;  // passes whose loads are in flight together

template <bool kSaveH>
__global__ void __launch_bounds__(kThreads)
swiglu_quant_col_kernel(const bf16_t* __restrict__ h, const float* __restrict__ prow, int64_t m, int64_t f,
                        const int32_t* __restrict__ bstart, const int32_t* __restrict__ bend,
                        uint8_t* __restrict__ a_codes, uint8_t* __restrict__ a_scales,
                        uint8_t* __restrict__ a_col_codes, uint8_t* __restrict__ a_col_scales,
                        uint8_t* __restrict__ h_codes, uint8_t* __restrict__ h_scales,
                        DeviceStatus* status) {
  __shared__ __align__(16) uint8_t s_q[kTile * kBytePitch];
  __shared__ uint8_t s_e[kTile];
  __shared__ unsigned s_wmax[kTile / 32], s_wbad[kTile / 32];
  int64_t b, kt;
  detail::tile_coords(b, kt);
  const int bs = bstart[b];
  if (bs < 0) return;
  const int n = bend[b] - bs;
  const int tid = threadIdx.x, lane = tid & 15;
  unsigned long long* nonfinite = status ? &status->nonfinite : nullptr;

  // Row pass: A row tiles quantized, codes to global and to the byte tile.
#pragma unroll
  for (int p0 = 0; p0 < kPasses; p0 += kPassGroup) {
    uint4 g[kPassGroup], u[kPassGroup];
#pragma unroll
    for (int i = 0; i < kPassGroup; ++i) {
      const int row = (p0 + i) * (kThreads / 16) + (tid >> 4);
      g[i] = u[i] = make_uint4(0, 0, 0, 0);
      if (row < n) {
        const bf16_t* src = h + static_cast<int64_t>(bs + row) * 2 * f + kt * kTile + lane * 8;
        g[i] = ldg16(src);
        u[i] = ldg16(src + f);
      }
    }
#pragma unroll
    for (int i = 0; i < kPassGroup; ++i) {
      const int row = (p0 + i) * (kThreads / 16) + (tid >> 4);
      const int64_t r = static_cast<int64_t>(bs) + row;
      float a32[8];
      swiglu8(g[i], u[i], a32);
      if (prow) {
        const float p = row < n ? __ldg(prow + r) : 0.0f;
#pragma unroll
        for (int q = 0; q < 8; ++q) a32[q] = f_mul(a32[q], p);
      }
      const TileCodes q = quantize_tile8(a32, nonfinite);
      *reinterpret_cast<uint2*>(&s_q[row * kBytePitch + lane * 8]) = row < n ? q.codes : make_uint2(0, 0);
      if (lane == 0) s_e[row] = row < n ? q.scale : 0;
      if (row < n) {
        *reinterpret_cast<uint2*>(a_codes + r * f + kt * kTile + lane * 8) = q.codes;
        if (lane == 0) a_scales[kt * m + r] = q.scale;
      }
      if constexpr (kSaveH) {
        const TileCodes qg = quantize_tile8(g[i], nonfinite);
        const TileCodes qu = quantize_tile8(u[i], nonfinite);
        if (row < n) {
          uint8_t* dst = h_codes + r * 2 * f + kt * kTile + lane * 8;
          *reinterpret_cast<uint2*>(dst) = qg.codes;
          *reinterpret_cast<uint2*>(dst + f) = qu.codes;
          if (lane == 0) {
            h_scales[kt * m + r] = qg.scale;
            h_scales[(f / kTile + kt) * m + r] = qu.scale;
          }
        }
      }
    }
  }
  __syncthreads();

  // Shared exponent of the block: the largest row scale; a NaN row tile makes the block NaN.
  if (tid < kTile) {
    const unsigned e = s_e[tid];  // rows past n hold 0, which never wins the maximum
    const unsigned wmax = __reduce_max_sync(0xffffffffu, e == kUE8M0NaN ? 0u : e);
    const unsigned wbad = __reduce_add_sync(0xffffffffu, e == kUE8M0NaN ? 1u : 0u);
    if ((tid & 31) == 0) {
      s_wmax[tid >> 5] = wmax;
      s_wbad[tid >> 5] = wbad;
    }
  }
  __syncthreads();
  unsigned emax = 0, nbad = 0;
#pragma unroll
  for (int w = 0; w < kTile / 32; ++w) {
    emax = max(emax, s_wmax[w]);
    nbad += s_wbad[w];
  }

  // Shift every row's codes down to the shared exponent, in place.
  int lost = 0;
  for (int c = tid; c < kTile * (kTile / 16); c += kThreads) {
    const int row = c / (kTile / 16), ch = c % (kTile / 16);
    if (row >= n) continue;
    uint4* p = reinterpret_cast<uint4*>(&s_q[row * kBytePitch + ch * 16]);
    if (nbad) {
      *p = make_uint4(0x7F7F7F7Fu, 0x7F7F7F7Fu, 0x7F7F7F7Fu, 0x7F7F7F7Fu);
      continue;
    }
    const int d = static_cast<int>(emax) - s_e[row];
    if (d == 0) continue;
    uint4 w = *p;
    w.x = shift_codes4(w.x, d, lost);
    w.y = shift_codes4(w.y, d, lost);
    w.z = shift_codes4(w.z, d, lost);
    w.w = shift_codes4(w.w, d, lost);
    *p = w;
  }
  detail::warp_count(status ? &status->underflow : nullptr, lost);
  if (tid < kTile) a_col_scales[b * f + kt * kTile + tid] = nbad ? kUE8M0NaN : static_cast<uint8_t>(emax);
  __syncthreads();
  detail::store_col_tile(s_q, n, a_col_codes + (kt * kTile) * m + bs, m, (m % 16 == 0) && (bs % 16 == 0));
}

// ---- backward: plain BF16 -------------------------------------------------------------------------
template <bool kProb>
__global__ void __launch_bounds__(kThreads)
dswiglu_row_kernel(const bf16_t* __restrict__ da, const bf16_t* __restrict__ h,
                   const float* __restrict__ prow, int64_t m, int64_t f, bf16_t* __restrict__ dh,
                   float* __restrict__ dpart, unsigned long long* nonfinite) {
  const int64_t kb = blockIdx.y;
  const int lane = threadIdx.x & 15;
  const int64_t r0 = static_cast<int64_t>(blockIdx.x) * kRowsPerCta + (threadIdx.x >> 4);
  uint4 vd[kRowsPerHalfWarp], vg[kRowsPerHalfWarp], vu[kRowsPerHalfWarp];
  float p[kRowsPerHalfWarp];
#pragma unroll
  for (int i = 0; i < kRowsPerHalfWarp; ++i) {
    const int64_t r = r0 + i * (kThreads / 16);
    vd[i] = vg[i] = vu[i] = make_uint4(0, 0, 0, 0);
    p[i] = 0.0f;
    if (r < m) {
      const bf16_t* src = h + r * 2 * f + kb * kTile + lane * 8;
      vd[i] = ldg16(da + r * f + kb * kTile + lane * 8);
      vg[i] = ldg16(src);
      vu[i] = ldg16(src + f);
      if constexpr (kProb) p[i] = __ldg(prow + r);
    }
  }
#pragma unroll
  for (int i = 0; i < kRowsPerHalfWarp; ++i) {
    const int64_t r = r0 + i * (kThreads / 16);
    float xd[8], xg[8], xu[8];
    unpack8(vd[i], xd);
    unpack8(vg[i], xg);
    unpack8(vu[i], xu);
    uint4 dg, du;
    if constexpr (kProb) {
      float acc = 0.0f;
      dswiglu8_prob(xd, p[i], xg, xu, dg, du, acc);
      acc = tile_sum16(acc);
      if (dpart && lane == 0 && r < m) dpart[kb * m + r] = f32_canonical(acc);
    } else {
      dswiglu8(xd, xg, xu, dg, du);
    }
    const uint32_t mg = detail::absmax8_bits(dg), mu = detail::absmax8_bits(du);
    if (nonfinite) {
      detail::count_nonfinite_warp(nonfinite, dg, mg >= detail::kBf16NonFiniteBits);
      detail::count_nonfinite_warp(nonfinite, du, mu >= detail::kBf16NonFiniteBits);
    }
    if (r < m) {
      bf16_t* dst = dh + r * 2 * f + kb * kTile + lane * 8;
      *reinterpret_cast<uint4*>(dst) = canonical_nan8(dg, mg);
      *reinterpret_cast<uint4*>(dst + f) = canonical_nan8(du, mu);
    }
  }
}

// ---- backward: fused dSwiGLU + row-wise and column-wise quantize --------------------------------------
// Shared tile: 128 tokens x 256 bf16 (dgate features [0, 128), dup features [128, 256)), pitch
// 264 elements (528 bytes: 16-byte aligned rows; a warp reading 32 consecutive words of a row
// touches every bank once).
constexpr int kBwdPitch = 2 * kTile + 8;  // bf16 elements
constexpr int kBwdWords = kBwdPitch / 2;  // 32-bit words per row
constexpr size_t kBwdSmem = size_t(kTile) * kBwdPitch * 2 + 2 * kTile * sizeof(uint32_t) + 2 * kTile;
// Swizzled 16-byte chunks of a tile row (32 chunks of 8 bf16): chunk c of row r is stored at chunk
// c ^ ((r / 16) % 8) so that lanes reading the same word of rows 16 apart hit different banks.
__device__ __forceinline__ int bwd_chunk(int row, int chunk) {  // bf16 element offset
  return row * kBwdPitch + ((chunk ^ ((row >> 4) & 7)) << 3);
}
__device__ __forceinline__ int bwd_word(int row, int p) {  // 32-bit word offset of pair p
  return row * kBwdWords + ((((p >> 2) ^ ((row >> 4) & 7)) << 2) | (p & 3));
}
constexpr int kBwdCtasPerSm = FLOWMOE_SWIGLU_BWD_CTAS_PER_SM;

enum class HIn { kBf16, kFp8, kFp4 };  // how the backward reads the saved H

template <HIn kH, bool kProb>
__global__ void __launch_bounds__(kThreads, kBwdCtasPerSm)
dswiglu_quant_kernel(const bf16_t* __restrict__ da, const bf16_t* __restrict__ h,
                     const uint8_t* __restrict__ hc, const uint8_t* __restrict__ hs,
                     const float* __restrict__ prow, int64_t m, int64_t f,
                     const int32_t* __restrict__ bstart, const int32_t* __restrict__ bend,
                     uint8_t* __restrict__ row_codes, uint8_t* __restrict__ row_scales,
                     uint8_t* __restrict__ col_codes, uint8_t* __restrict__ col_scales,
                     float* __restrict__ dpart, unsigned long long* nonfinite) {
  extern __shared__ __align__(16) uint8_t smem[];
  uint16_t* s_t = reinterpret_cast<uint16_t*>(smem);
  uint32_t* s_amax = reinterpret_cast<uint32_t*>(smem + size_t(kTile) * kBwdPitch * 2);  // [2][128]
  int64_t b, kt;
  detail::tile_coords(b, kt);
  const int bs = bstart[b];
  if (bs < 0) return;
  const int n = bend[b] - bs;
  const int tid = threadIdx.x, lane = tid & 15;
  const int64_t k2 = 2 * f;

  // Phase 1: rows. dH for 8 features of (row, gate side) and (row, up side) per lane.
#pragma unroll
  for (int p0 = 0; p0 < kPasses; p0 += kPassGroup) {
    uint4 vd[kPassGroup], vg[kPassGroup], vu[kPassGroup];
    uint2 cg[kPassGroup], cu[kPassGroup];
    uint8_t sg[kPassGroup], su[kPassGroup];
    float pr[kPassGroup];
#pragma unroll
    for (int i = 0; i < kPassGroup; ++i) {
      const int row = (p0 + i) * (kThreads / 16) + (tid >> 4);
      const int64_t r = static_cast<int64_t>(bs) + row;
      vd[i] = vg[i] = vu[i] = make_uint4(0, 0, 0, 0);
      cg[i] = cu[i] = make_uint2(0, 0);
      sg[i] = su[i] = 0;
      pr[i] = 0.0f;
      if (row < n) {
        vd[i] = ldg16(da + r * f + kt * kTile + lane * 8);
        if constexpr (kProb) pr[i] = __ldg(prow + r);
        if constexpr (kH == HIn::kFp8) {
          const uint8_t* src = hc + r * k2 + kt * kTile + lane * 8;
          cg[i] = __ldg(reinterpret_cast<const uint2*>(src));
          cu[i] = __ldg(reinterpret_cast<const uint2*>(src + f));
          sg[i] = __ldg(hs + kt * m + r);
          su[i] = __ldg(hs + (f / kTile + kt) * m + r);
        } else if constexpr (kH == HIn::kFp4) {
          const int64_t col = kt * kTile + lane * 8;
          const uint8_t* src = hc + (r * k2 + col) / 2;
          cg[i].x = __ldg(reinterpret_cast<const uint32_t*>(src));
          cu[i].x = __ldg(reinterpret_cast<const uint32_t*>(src + f / 2));
          sg[i] = __ldg(hs + r * (k2 / 32) + col / 32);
          su[i] = __ldg(hs + r * (k2 / 32) + (f + col) / 32);
        } else {
          const bf16_t* src = h + r * k2 + kt * kTile + lane * 8;
          vg[i] = ldg16(src);
          vu[i] = ldg16(src + f);
        }
      }
    }
#pragma unroll
    for (int i = 0; i < kPassGroup; ++i) {
      const int row = (p0 + i) * (kThreads / 16) + (tid >> 4);
      const int64_t r = static_cast<int64_t>(bs) + row;
      float xd[8], xg[8], xu[8];
      unpack8(vd[i], xd);
      if constexpr (kH != HIn::kBf16) {
        if (row < n) {
          if constexpr (kH == HIn::kFp8) {
            decode8(cg[i], sg[i], xg);
            decode8(cu[i], su[i], xu);
          } else {
            decode8_fp4(cg[i].x, sg[i], xg);
            decode8_fp4(cu[i].x, su[i], xu);
          }
        } else {
#pragma unroll
          for (int j = 0; j < 8; ++j) xg[j] = xu[j] = 0.0f;
        }
      } else {
        unpack8(vg[i], xg);
        unpack8(vu[i], xu);
      }
      uint4 dg, du;
      if constexpr (kProb) {
        float acc = 0.0f;
        dswiglu8_prob(xd, pr[i], xg, xu, dg, du, acc);
        acc = tile_sum16(acc);
        if (dpart && lane == 0 && row < n) dpart[kt * m + r] = f32_canonical(acc);
      } else {
        dswiglu8(xd, xg, xu, dg, du);
      }
      const TileCodes qg = quantize_tile8(dg, nonfinite);
      const TileCodes qu = quantize_tile8(du, nonfinite);
      if (row < n) {
        uint8_t* dst = row_codes + r * k2 + kt * kTile + lane * 8;
        *reinterpret_cast<uint2*>(dst) = qg.codes;
        *reinterpret_cast<uint2*>(dst + f) = qu.codes;
        if (lane == 0) {
          row_scales[kt * m + r] = qg.scale;
          row_scales[(f / kTile + kt) * m + r] = qu.scale;
        }
      }
      // rows past n are all zero (zero inputs give zero gradients)
      *reinterpret_cast<uint4*>(&s_t[bwd_chunk(row, lane)]) = dg;
      *reinterpret_cast<uint4*>(&s_t[bwd_chunk(row, 16 + lane)]) = du;
    }
  }
  __syncthreads();

  // Phase 2: columns. (a) amax per pair of adjacent features p over the block: thread = (p, half
  // of the tokens); (b) encode and store: task = (16-token group j, pair p), the 8 lanes of a
  // group covering one feature row's 128 tokens, so each store instruction writes full 128-byte
  // row segments. The swizzle (bwd_word) keeps both read patterns free of bank conflicts.
  uint8_t* s_code = reinterpret_cast<uint8_t*>(s_amax + 2 * kTile);  // [2][128]: scale code of pair p
  {
    const int p = tid & (kTile - 1), half = tid >> 7;
    uint32_t mx = 0;
#pragma unroll 8
    for (int i = 0; i < kTile / 2; ++i) {
      const int t = half * (kTile / 2) + i;
      mx = __vmaxu2(mx, reinterpret_cast<const uint32_t*>(s_t)[bwd_word(t, p)] & 0x7FFF7FFFu);
    }
    s_amax[half * kTile + p] = mx;
  }
  __syncthreads();
  if (tid < kTile) {
    const int p = tid;
    const uint32_t mx = __vmaxu2(s_amax[p], s_amax[kTile + p]);
    const uint32_t a0 = mx & 0xFFFFu, a1 = mx >> 16;
    const uint8_t s0 = a0 >= detail::kBf16NonFiniteBits ? kUE8M0NaN : ue8m0_from_exp(e4m3_scale_exp(detail::bf16_bits_to_f32(a0)));
    const uint8_t s1 = a1 >= detail::kBf16NonFiniteBits ? kUE8M0NaN : ue8m0_from_exp(e4m3_scale_exp(detail::bf16_bits_to_f32(a1)));
    s_code[p] = s0;
    s_code[kTile + p] = s1;
    const int c = 2 * p;  // tile column in [0, 256): dgate side below 128, dup side above
    const int64_t feat = (c < kTile ? 0 : f - kTile) + kt * kTile + c;  // dH feature of column c
    col_scales[b * k2 + feat] = s0;
    col_scales[b * k2 + feat + 1] = s1;
  }
  __syncthreads();
  const bool vec = (m % 16 == 0) && (bs % 16 == 0);
  for (int task = tid; task < kTile * (kTile / 16); task += kThreads) {
    const int j = task & 7, p = task >> 3;
    const int t0 = j * 16;
    if (t0 >= n) continue;
    const uint8_t s0 = s_code[p], s1 = s_code[kTile + p];
    const bool bad0 = s0 == kUE8M0NaN, bad1 = s1 == kUE8M0NaN;
    const float inv0 = bad0 ? 0.0f : detail::inv_pow2(static_cast<int>(s0) - 127);
    const float inv1 = bad1 ? 0.0f : detail::inv_pow2(static_cast<int>(s1) - 127);
    const int c = 2 * p;
    const int64_t feat = (c < kTile ? 0 : f - kTile) + kt * kTile + c;
    uint8_t* dst0 = col_codes + feat * m + bs;
    uint8_t* dst1 = dst0 + m;
    uint32_t w0[4], w1[4];
#pragma unroll
    for (int q = 0; q < 4; ++q) {
      uint32_t x0 = 0, x1 = 0;
#pragma unroll
      for (int pp = 0; pp < 2; ++pp) {
        const int t = t0 + 4 * q + 2 * pp;
        const uint32_t va = reinterpret_cast<const uint32_t*>(s_t)[bwd_word(t, p)];
        const uint32_t vb = reinterpret_cast<const uint32_t*>(s_t)[bwd_word(t + 1, p)];
        const uint32_t c0 = bad0 ? 0x7F7Fu : detail::e4m3x2(bf16_lo(va) * inv0, bf16_lo(vb) * inv0);
        const uint32_t c1 = bad1 ? 0x7F7Fu : detail::e4m3x2(bf16_hi(va) * inv1, bf16_hi(vb) * inv1);
        x0 |= c0 << (16 * pp);
        x1 |= c1 << (16 * pp);
      }
      w0[q] = bad0 ? x0 : detail::e4m3x4_saturate_for_scale(x0, static_cast<int>(s0) - 127);
      w1[q] = bad1 ? x1 : detail::e4m3x4_saturate_for_scale(x1, static_cast<int>(s1) - 127);
    }
    if (vec && t0 + 16 <= n) {
      *reinterpret_cast<uint4*>(dst0 + t0) = make_uint4(w0[0], w0[1], w0[2], w0[3]);
      *reinterpret_cast<uint4*>(dst1 + t0) = make_uint4(w1[0], w1[1], w1[2], w1[3]);
    } else {
      for (int t = t0; t < min(t0 + 16, n); ++t) {
        dst0[t] = static_cast<uint8_t>(w0[(t - t0) >> 2] >> (8 * ((t - t0) & 3)));
        dst1[t] = static_cast<uint8_t>(w1[(t - t0) >> 2] >> (8 * ((t - t0) & 3)));
      }
    }
  }
}

// ---- host-side checks -------------------------------------------------------------------------------
void check_f(int64_t f, const char* what) {
  FLOWMOE_CHECK(f > 0 && f % kTile == 0,
                what << ": F = " << f << " is not a positive multiple of 128 (the quantization "
                     << "block); H must be [M, 2F] with gate = columns [0, F), up = [F, 2F)");
  FLOWMOE_CHECK(f / kTile <= 65535, what << ": F = " << f << " too large (at most 65535 * 128)");
}
void check_m(int64_t m, const char* what) {
  FLOWMOE_CHECK(m >= 0, what << ": M = " << m << " must be >= 0");
}
dim3 row_grid(int64_t m, int64_t f) {
  const int64_t gx = (m + kRowsPerCta - 1) / kRowsPerCta;
  FLOWMOE_CHECK(gx < (1ll << 31), "problem too large for one launch: M = " << m);
  return dim3(static_cast<unsigned>(gx), static_cast<unsigned>(f / kTile));
}
void check_pair(const void* codes, const void* scales, const char* cname, const char* sname,
                const char* what) {
  check_aligned(codes, cname, what);
  FLOWMOE_CHECK(scales != nullptr, what << ": " << sname << " is null");
}
void check_prob(const float* prow, const float* dprow_part, const char* what) {
  FLOWMOE_CHECK(prow != nullptr || dprow_part == nullptr,
                what << ": dprow_part (the gradient of the routing probabilities) needs prow; "
                     << "give prow, or pass null for both");
}

}  // namespace

// ================================================================================================
// launchers
// ================================================================================================
void swiglu(const bf16_t* h, int64_t m, int64_t f, bf16_t* a, DeviceStatus* status,
            cudaStream_t stream, const float* prow) {
  const char* what = "cuda::swiglu";
  check_f(f, what);
  check_m(m, what);
  if (m == 0) return;
  check_aligned(h, "h", what);
  check_aligned(a, "a", what);
  swiglu_row_kernel<FwdOut::kBf16><<<row_grid(m, f), kThreads, 0, stream>>>(
      h, prow, m, f, a, nullptr, nullptr, nullptr, nullptr, nonfinite_ptr(status));
  FLOWMOE_LAUNCH_CHECK(what);
}

void swiglu_quant(const bf16_t* h, int64_t m, int64_t f, uint8_t* a_codes, uint8_t* a_scales,
                  uint8_t* h_codes, uint8_t* h_scales, DeviceStatus* status, cudaStream_t stream,
                  const float* prow) {
  const char* what = "cuda::swiglu_quant";
  check_f(f, what);
  check_m(m, what);
  FLOWMOE_CHECK((h_codes == nullptr) == (h_scales == nullptr),
                what << ": give both h_codes and h_scales (H saved as FP8), or neither");
  if (m == 0) return;
  check_aligned(h, "h", what);
  check_pair(a_codes, a_scales, "a_codes", "a_scales", what);
  if (h_codes) {
    check_aligned(h_codes, "h_codes", what);
    swiglu_row_kernel<FwdOut::kFp8SaveH><<<row_grid(m, f), kThreads, 0, stream>>>(
        h, prow, m, f, nullptr, a_codes, a_scales, h_codes, h_scales, nonfinite_ptr(status));
  } else {
    swiglu_row_kernel<FwdOut::kFp8><<<row_grid(m, f), kThreads, 0, stream>>>(
        h, prow, m, f, nullptr, a_codes, a_scales, nullptr, nullptr, nonfinite_ptr(status));
  }
  FLOWMOE_LAUNCH_CHECK(what);
}

void swiglu_quant_col(const bf16_t* h, int64_t f, const SegmentBlocks& sb, uint8_t* a_codes,
                      uint8_t* a_scales, uint8_t* a_col_codes, uint8_t* a_col_scales,
                      uint8_t* h_codes, uint8_t* h_scales, DeviceStatus* status,
                      cudaStream_t stream, const float* prow) {
  const char* what = "cuda::swiglu_quant_col";
  check_f(f, what);
  check_blocks(sb, what);
  FLOWMOE_CHECK((h_codes == nullptr) == (h_scales == nullptr),
                what << ": give both h_codes and h_scales (H saved as FP8), or neither");
  if (sb.m == 0) return;
  check_aligned(h, "h", what);
  check_pair(a_codes, a_scales, "a_codes", "a_scales", what);
  check_pair(a_col_codes, a_col_scales, "a_col_codes", "a_col_scales", what);
  if (h_codes) check_aligned(h_codes, "h_codes", what);
  const dim3 grid = tile_grid(sb.max_blocks, f / kTile);
  if (h_codes) {
    swiglu_quant_col_kernel<true><<<grid, kThreads, 0, stream>>>(
        h, prow, sb.m, f, sb.block_start, sb.block_end, a_codes, a_scales, a_col_codes,
        a_col_scales, h_codes, h_scales, status);
  } else {
    swiglu_quant_col_kernel<false><<<grid, kThreads, 0, stream>>>(
        h, prow, sb.m, f, sb.block_start, sb.block_end, a_codes, a_scales, a_col_codes,
        a_col_scales, nullptr, nullptr, status);
  }
  FLOWMOE_LAUNCH_CHECK(what);
}

void dswiglu(const bf16_t* da, const bf16_t* h, int64_t m, int64_t f, bf16_t* dh,
             DeviceStatus* status, cudaStream_t stream, const float* prow, float* dprow_part) {
  const char* what = "cuda::dswiglu";
  check_f(f, what);
  check_m(m, what);
  check_prob(prow, dprow_part, what);
  if (m == 0) return;
  check_aligned(da, "da", what);
  check_aligned(h, "h", what);
  check_aligned(dh, "dh", what);
  if (prow) {
    dswiglu_row_kernel<true><<<row_grid(m, f), kThreads, 0, stream>>>(
        da, h, prow, m, f, dh, dprow_part, nonfinite_ptr(status));
  } else {
    dswiglu_row_kernel<false><<<row_grid(m, f), kThreads, 0, stream>>>(
        da, h, nullptr, m, f, dh, nullptr, nonfinite_ptr(status));
  }
  FLOWMOE_LAUNCH_CHECK(what);
}

namespace {
template <HIn kH, bool kProb>
void launch_dswiglu_quant(const bf16_t* da, const bf16_t* h, const uint8_t* hc, const uint8_t* hs,
                          const float* prow, int64_t f, const SegmentBlocks& sb, uint8_t* row_codes,
                          uint8_t* row_scales, uint8_t* col_codes, uint8_t* col_scales,
                          float* dprow_part, DeviceStatus* status, cudaStream_t stream,
                          const char* what) {
  // More than 48 KB of dynamic shared memory needs an opt-in, per function and device; done once
  // per device (not on every launch, so that launches can be captured in a CUDA graph).
  static std::atomic<uint64_t> opted_in{0};
  int dev = 0;
  FLOWMOE_CUDA_CHECK(cudaGetDevice(&dev));
  const uint64_t bit = dev < 64 ? (uint64_t(1) << dev) : 0;
  if (!bit || !(opted_in.load(std::memory_order_relaxed) & bit)) {
    FLOWMOE_CUDA_CHECK(cudaFuncSetAttribute(dswiglu_quant_kernel<kH, kProb>,
                                            cudaFuncAttributeMaxDynamicSharedMemorySize,
                                            static_cast<int>(kBwdSmem)));
    opted_in.fetch_or(bit, std::memory_order_relaxed);
  }
  const dim3 grid = tile_grid(sb.max_blocks, f / kTile);
  dswiglu_quant_kernel<kH, kProb><<<grid, kThreads, kBwdSmem, stream>>>(
      da, h, hc, hs, prow, sb.m, f, sb.block_start, sb.block_end, row_codes, row_scales, col_codes,
      col_scales, dprow_part, nonfinite_ptr(status));
  FLOWMOE_LAUNCH_CHECK(what);
}

void check_bwd_outputs(const uint8_t* row_codes, const uint8_t* row_scales,
                       const uint8_t* col_codes, const uint8_t* col_scales, const char* what) {
  check_pair(row_codes, row_scales, "row_codes", "row_scales", what);
  check_pair(col_codes, col_scales, "col_codes", "col_scales", what);
}
}  // namespace

namespace {
// The three fused backward entry points: checks, then the kernel for the saved H's format and
// whether a routing probability is given.
template <HIn kH>
void dswiglu_quant_entry(const bf16_t* da, const bf16_t* h, const uint8_t* hc, const uint8_t* hs,
                         const char* hc_name, const char* hs_name, int64_t f, const SegmentBlocks& sb,
                         uint8_t* row_codes, uint8_t* row_scales, uint8_t* col_codes,
                         uint8_t* col_scales, DeviceStatus* status, cudaStream_t stream,
                         const float* prow, float* dprow_part, const char* what) {
  check_f(f, what);
  check_blocks(sb, what);
  check_prob(prow, dprow_part, what);
  if (sb.m == 0) return;
  check_aligned(da, "da", what);
  if constexpr (kH == HIn::kBf16) check_aligned(h, "h", what);
  else check_pair(hc, hs, hc_name, hs_name, what);
  check_bwd_outputs(row_codes, row_scales, col_codes, col_scales, what);
  if (prow)
    launch_dswiglu_quant<kH, true>(da, h, hc, hs, prow, f, sb, row_codes, row_scales, col_codes,
                                   col_scales, dprow_part, status, stream, what);
  else
    launch_dswiglu_quant<kH, false>(da, h, hc, hs, nullptr, f, sb, row_codes, row_scales, col_codes,
                                    col_scales, nullptr, status, stream, what);
}
}  // namespace

void dswiglu_quant(const bf16_t* da, const bf16_t* h, int64_t f, const SegmentBlocks& sb,
                   uint8_t* row_codes, uint8_t* row_scales, uint8_t* col_codes,
                   uint8_t* col_scales, DeviceStatus* status, cudaStream_t stream,
                   const float* prow, float* dprow_part) {
  dswiglu_quant_entry<HIn::kBf16>(da, h, nullptr, nullptr, nullptr, nullptr, f, sb, row_codes, row_scales,
                                  col_codes, col_scales, status, stream, prow, dprow_part,
                                  "cuda::dswiglu_quant");
}

void dswiglu_quant_fp8h(const bf16_t* da, const uint8_t* h_codes, const uint8_t* h_scales,
                        int64_t f, const SegmentBlocks& sb, uint8_t* row_codes,
                        uint8_t* row_scales, uint8_t* col_codes, uint8_t* col_scales,
                        DeviceStatus* status, cudaStream_t stream, const float* prow,
                        float* dprow_part) {
  dswiglu_quant_entry<HIn::kFp8>(da, nullptr, h_codes, h_scales, "h_codes", "h_scales", f, sb, row_codes,
                                 row_scales, col_codes, col_scales, status, stream, prow, dprow_part,
                                 "cuda::dswiglu_quant_fp8h");
}

void swiglu_quant_h4(const bf16_t* h, int64_t m, int64_t f, uint8_t* a_codes, uint8_t* a_scales,
                     uint8_t* h4_codes, uint8_t* h4_scales, DeviceStatus* status,
                     cudaStream_t stream, const float* prow) {
  const char* what = "cuda::swiglu_quant_h4";
  check_f(f, what);
  check_m(m, what);
  if (m == 0) return;
  check_aligned(h, "h", what);
  check_pair(a_codes, a_scales, "a_codes", "a_scales", what);
  check_pair(h4_codes, h4_scales, "h4_codes", "h4_scales", what);
  swiglu_row_kernel<FwdOut::kFp8SaveH4><<<row_grid(m, f), kThreads, 0, stream>>>(
      h, prow, m, f, nullptr, a_codes, a_scales, h4_codes, h4_scales, nonfinite_ptr(status));
  FLOWMOE_LAUNCH_CHECK(what);
}

void dswiglu_quant_fp4h(const bf16_t* da, const uint8_t* h4_codes, const uint8_t* h4_scales,
                        int64_t f, const SegmentBlocks& sb, uint8_t* row_codes,
                        uint8_t* row_scales, uint8_t* col_codes, uint8_t* col_scales,
                        DeviceStatus* status, cudaStream_t stream, const float* prow,
                        float* dprow_part) {
  dswiglu_quant_entry<HIn::kFp4>(da, nullptr, h4_codes, h4_scales, "h4_codes", "h4_scales", f, sb, row_codes,
                                 row_scales, col_codes, col_scales, status, stream, prow, dprow_part,
                                 "cuda::dswiglu_quant_fp4h");
}

namespace {
__global__ void sum_dprow_parts_kernel(const float* __restrict__ part, int64_t m, int64_t tiles,
                                       float* __restrict__ dprow) {
  for (int64_t r = blockIdx.x * int64_t(blockDim.x) + threadIdx.x; r < m;
       r += int64_t(gridDim.x) * blockDim.x) {
    float acc = part[r];
    for (int64_t b = 1; b < tiles; ++b) acc = f_add(acc, part[b * m + r]);
    dprow[r] = f32_canonical(acc);
  }
}
}  // namespace

void sum_dprow_parts(const float* dprow_part, int64_t m, int64_t f, float* dprow,
                     cudaStream_t stream) {
  const char* what = "cuda::sum_dprow_parts";
  check_f(f, what);
  check_m(m, what);
  if (m == 0) return;
  FLOWMOE_CHECK(dprow_part != nullptr && dprow != nullptr,
                what << ": dprow_part and dprow must both be given");
  const int64_t blocks = std::min<int64_t>((m + kThreads - 1) / kThreads, 4096);
  sum_dprow_parts_kernel<<<static_cast<unsigned>(blocks), kThreads, 0, stream>>>(
      dprow_part, m, f / kTile, dprow);
  FLOWMOE_LAUNCH_CHECK(what);
}

void dswiglu_quant_unfused(const bf16_t* da, const bf16_t* h, int64_t f, const SegmentBlocks& sb,
                           uint8_t* row_codes, uint8_t* row_scales, uint8_t* col_codes,
                           uint8_t* col_scales, bf16_t* work, DeviceStatus* status,
                           cudaStream_t stream) {
  const char* what = "cuda::dswiglu_quant_unfused";
  check_f(f, what);
  check_blocks(sb, what);
  if (sb.m == 0) return;
  check_aligned(work, "work", what);
  dswiglu(da, h, sb.m, f, work, nullptr, stream);
  quantize_row(work, sb.m, 2 * f, row_codes, row_scales, status, stream);
  quantize_col(work, 2 * f, sb, col_codes, col_scales, nullptr, nullptr, nullptr, stream);
}

}  // namespace cuda
}  // namespace flowmoe
