// flowmoe numerics core: the bits of every format, defined once for host and device.
//
// Everything here is integer bit manipulation (no floating-point rounding modes, no
// intrinsics), so the CPU reference and the CUDA kernels produce identical bits.
//
// Formats (SPEC §1):
//   E4M3 (OCP "fn")  s.eeee.mmm, bias 7, max ±448, NaN = 0x7F/0xFF, no Inf, subnormals k·2^-9
//   E2M1             s.ee.m, bias 1, ±{0, 0.5, 1, 1.5, 2, 3, 4, 6}; two per byte, element 2i low nibble
//   UE8M0            one byte e: 2^(e-127); 0xFF = NaN. Every scale is one of these.
//   BF16             upper half of an IEEE binary32
// Encoders round to nearest, ties to even, and saturate to the largest finite value.
#pragma once

#include <cstdint>
#include <cstring>

#if defined(__CUDACC__)
#define FLOWMOE_HD __host__ __device__ __forceinline__
#else
#define FLOWMOE_HD inline
#endif

namespace flowmoe {
namespace num {

// ---------------------------------------------------------------------------------------------
// binary32 <-> bits
FLOWMOE_HD uint32_t f32_bits(float x) {
#if defined(__CUDA_ARCH__)
  return __float_as_uint(x);
#else
  uint32_t u;
  std::memcpy(&u, &x, 4);
  return u;
#endif
}
FLOWMOE_HD float f32_from_bits(uint32_t u) {
#if defined(__CUDA_ARCH__)
  return __uint_as_float(u);
#else
  float x;
  std::memcpy(&x, &u, 4);
  return x;
#endif
}
FLOWMOE_HD bool f32_is_finite(float x) { return (f32_bits(x) & 0x7F800000u) != 0x7F800000u; }
FLOWMOE_HD float f32_abs(float x) { return f32_from_bits(f32_bits(x) & 0x7FFFFFFFu); }
// max of two non-negative finite floats: ordered like their bit patterns.
FLOWMOE_HD float f32_max_nonneg(float a, float b) { return f32_bits(a) > f32_bits(b) ? a : b; }

// 2^e as binary32, exact for e in [-149, 127].
FLOWMOE_HD float exp2i(int e) {
  if (e >= -126) return f32_from_bits(static_cast<uint32_t>(e + 127) << 23);
  return f32_from_bits(1u << (e + 149));  // subnormal
}

// ---------------------------------------------------------------------------------------------
// BF16
FLOWMOE_HD float bf16_to_f32(uint16_t h) { return f32_from_bits(static_cast<uint32_t>(h) << 16); }
FLOWMOE_HD uint16_t f32_to_bf16(float x) {
  uint32_t u = f32_bits(x);
  if ((u & 0x7FFFFFFFu) > 0x7F800000u) return static_cast<uint16_t>((u >> 16) | 0x0040u);  // quiet NaN
  u += 0x7FFFu + ((u >> 16) & 1u);  // RNE; overflow carries into Inf as IEEE requires
  return static_cast<uint16_t>(u >> 16);
}

// ---------------------------------------------------------------------------------------------
// Generic small-float encoder: |x| finite -> unsigned code (without sign) of a format with
// `MBITS` mantissa bits and minimum normal exponent `EMIN`, RNE, saturating at `MAXCODE`.
// The code is (biased exponent << MBITS) | mantissa; subnormals have exponent field 0.
template <int MBITS, int EMIN, uint32_t MAXCODE>
FLOWMOE_HD uint32_t encode_small_abs(uint32_t abs_bits) {
  if (abs_bits >= 0x7F800000u) return MAXCODE;  // Inf (callers handle NaN first)
  int e = static_cast<int>(abs_bits >> 23);
  uint32_t m = abs_bits & 0x7FFFFFu;
  if (e == 0) {
    e = -126;  // binary32 subnormal: value = m * 2^-149
  } else {
    m |= 0x800000u;
    e -= 127;
  }
  // value = m * 2^(e-23). Target ulp is 2^(max(e,EMIN) - MBITS).
  const int eff = e > EMIN ? e : EMIN;
  const int shift = 23 - MBITS + (eff - e);
  if (shift >= 25) return 0;  // below half of the smallest subnormal (m < 2^24)
  uint32_t r = m >> shift;
  const uint32_t rem = m & ((1u << shift) - 1u);
  const uint32_t half = 1u << (shift - 1);
  if (rem > half || (rem == half && (r & 1u))) ++r;
  // For normals r is in [2^MBITS, 2^(MBITS+1)] and the implicit bit lands in the exponent
  // field; a carry to 2^(MBITS+1) moves to the next binade by itself. Subnormals: eff == EMIN.
  const uint32_t code = (static_cast<uint32_t>(eff - EMIN) << MBITS) + r;
  return code > MAXCODE ? MAXCODE : code;
}

// E4M3 -------------------------------------------------------------------------------------------
constexpr float kE4M3Max = 448.0f;
constexpr uint8_t kE4M3NaN = 0x7F;

FLOWMOE_HD uint8_t f32_to_e4m3(float x) {
  const uint32_t u = f32_bits(x);
  const uint32_t s = (u >> 24) & 0x80u;
  const uint32_t a = u & 0x7FFFFFFFu;
  if (a > 0x7F800000u) return static_cast<uint8_t>(s | kE4M3NaN);
  return static_cast<uint8_t>(s | encode_small_abs<3, -6, 0x7Eu>(a));
}
FLOWMOE_HD float e4m3_to_f32(uint8_t c) {
  const uint32_t s = static_cast<uint32_t>(c & 0x80u) << 24;
  const uint32_t e = (c >> 3) & 0xFu, m = c & 7u;
  if (e == 0xF && m == 7) return f32_from_bits(s | 0x7FC00000u);
  if (e == 0) return f32_from_bits(s | f32_bits(static_cast<float>(m) * (1.0f / 512.0f)));
  return f32_from_bits(s | ((e + 120u) << 23) | (m << 20));
}
FLOWMOE_HD bool e4m3_is_nan(uint8_t c) { return (c & 0x7Fu) == 0x7Fu; }

// E2M1 (4-bit code in the low nibble) ------------------------------------------------------------
constexpr float kE2M1Max = 6.0f;

// E2M1 has no NaN: NaN input saturates like Inf. Callers detect non-finite input before
// encoding and mark the block's scale NaN (see scale rules below), so nothing decodes finite.
FLOWMOE_HD uint8_t f32_to_e2m1(float x) {
  const uint32_t u = f32_bits(x);
  const uint32_t s = (u >> 28) & 0x8u;
  const uint32_t a = u & 0x7FFFFFFFu;
  return static_cast<uint8_t>(s | encode_small_abs<1, 0, 0x7u>(a > 0x7F800000u ? 0x7F800000u : a));
}
FLOWMOE_HD float e2m1_to_f32(uint8_t c) {
  // magnitudes in units of 0.5: 0,1,2,3,4,6,8,12
  const uint32_t mag = c & 7u;
  const uint32_t halves = mag < 4 ? mag : (mag == 4 ? 4u : mag == 5 ? 6u : mag == 6 ? 8u : 12u);
  const float v = static_cast<float>(halves) * 0.5f;
  return (c & 8u) ? -v : v;
}
// Packed pair access: element 2i in the low nibble of byte i.
FLOWMOE_HD uint8_t e2m1_pack(uint8_t even, uint8_t odd) {
  return static_cast<uint8_t>((even & 0xFu) | ((odd & 0xFu) << 4));
}
FLOWMOE_HD uint8_t e2m1_get(const uint8_t* packed, int64_t i) {
  const uint8_t b = packed[i >> 1];
  return (i & 1) ? static_cast<uint8_t>(b >> 4) : static_cast<uint8_t>(b & 0xFu);
}

// UE8M0 -----------------------------------------------------------------------------------------
constexpr uint8_t kUE8M0NaN = 0xFF;
constexpr int kUE8M0Bias = 127;
constexpr int kScaleExpMin = -127;  // code 0: the scale of an all-zero tile
constexpr int kScaleExpMax = 127;   // code 254

FLOWMOE_HD float ue8m0_to_f32(uint8_t c) {
  if (c == kUE8M0NaN) return f32_from_bits(0x7FC00000u);
  return exp2i(static_cast<int>(c) - kUE8M0Bias);
}
FLOWMOE_HD uint8_t ue8m0_from_exp(int e) {
  e = e < kScaleExpMin ? kScaleExpMin : (e > kScaleExpMax ? kScaleExpMax : e);
  return static_cast<uint8_t>(e + kUE8M0Bias);
}

// ---------------------------------------------------------------------------------------------
// Scale rules (SPEC §2): the smallest power of two s = 2^e with amax / s <= FMAX, i.e.
// e = ceil(log2(amax / FMAX)), computed exactly from the bits of amax. FMAX = 1.F * 2^P with the
// fraction bits given as FMAX_FRAC (23-bit field). amax == 0 gives kScaleExpMin. The result is
// clamped to [kScaleExpMin, kScaleExpMax] (never reached above for finite amax).
template <int P, uint32_t FMAX_FRAC>
FLOWMOE_HD int scale_exp_for_amax(float amax) {
  // Branch-free: with E the biased exponent field, se = E - 127 - P + (fraction > FMAX_FRAC). A
  // subnormal or zero amax (E = 0) would need normalising, but its exact exponent is <= -127, so
  // se <= -127 - P + 1 <= kScaleExpMin for every P >= 1 and the clamp gives kScaleExpMin either
  // way. The ScaleRule CPU tests check it against a float64 reference (all BF16, random float32
  // with subnormals, every FMAX * 2^e boundary).
  static_assert(P >= 1, "the branch-free form needs FMAX >= 2");
  const uint32_t a = f32_bits(amax) & 0x7FFFFFFFu;
  const int se = static_cast<int>(a >> 23) - 127 - P + ((a & 0x7FFFFFu) > FMAX_FRAC ? 1 : 0);
  return se < kScaleExpMin ? kScaleExpMin : (se > kScaleExpMax ? kScaleExpMax : se);
}
// FP8 tiles (1x128, 128x128): 448 = 1.75 * 2^8.
FLOWMOE_HD int e4m3_scale_exp(float amax) { return scale_exp_for_amax<8, 0x600000u>(amax); }
// MXFP4 blocks (1x32): 6 = 1.5 * 2^2.
FLOWMOE_HD int e2m1_scale_exp(float amax) { return scale_exp_for_amax<2, 0x400000u>(amax); }

// x / 2^e, exact whenever the quotient is a binary32 normal (always so when it matters: a
// quotient below 2^-126 encodes to zero in E4M3 and E2M1 either way).
FLOWMOE_HD float div_pow2(float x, int e) {
  // e in [-127, 127]; 2^-e in [2^-127, 2^127]. Split to stay in binary32 normal range.
  if (e > 126) return (x * exp2i(-126)) * exp2i(126 - e);
  return x * exp2i(-e);
}

// Quantize one value with a tile scale exponent (the element encoding alone, RNE saturating at
// the format's largest value; quantizers use the *_finite forms below).
FLOWMOE_HD uint8_t quant_e4m3(float x, int scale_exp) { return f32_to_e4m3(div_pow2(x, scale_exp)); }
FLOWMOE_HD uint8_t quant_e2m1(float x, int scale_exp) { return f32_to_e2m1(div_pow2(x, scale_exp)); }

// Decoded saturation: a finite input never decodes to Inf. The scale rule above never clips, but
// at the top of the binary32 range the RNE of x / 2^e can round up to a code whose value times
// 2^e is 2^128 (E4M3: amax in [1.9375, 2) * 2^127 gives e = 120 and x / 2^e rounds to 256;
// MXFP4: amax in [1.75, 2) * 2^127 gives e = 126 and x / 2^e rounds to 4). No other scale helps:
// RNE of any power-of-two multiple of such x rounds up to the next binade as well. So under the
// large scales the code saturates at the largest magnitude whose decoded value is finite, as
// SPEC §1 saturates to the largest finite value. Below the thresholds every code decodes finite
// and nothing changes. Exhaustive CPU tests: tests/cpu/test_numerics.cpp (DecodedSaturation).
constexpr int kE4M3SaturateScaleExp = 120;  // 448 * 2^120 > FLT_MAX; 448 * 2^119 is finite
constexpr int kE2M1SaturateScaleExp = 126;  // 6 * 2^126 > FLT_MAX; 6 * 2^125 is finite
// Largest E4M3 magnitude code (sign clear) whose value times 2^scale_exp is below 2^128.
FLOWMOE_HD uint32_t e4m3_max_code_for_scale(int scale_exp) {
  // the code of 2^(128 - e) is (128 - e + 7) << 3; the one below it is the largest under 2^128
  return scale_exp < kE4M3SaturateScaleExp ? 0x7Eu : (static_cast<uint32_t>(135 - scale_exp) << 3) - 1u;
}
// Largest E2M1 magnitude code whose value times 2^scale_exp is below 2^128 (4 * 2^126 is not).
FLOWMOE_HD uint32_t e2m1_max_code_for_scale(int scale_exp) {
  return scale_exp < kE2M1SaturateScaleExp ? 0x7u : static_cast<uint32_t>(2 * (128 - scale_exp) + 1);
}
// An E4M3 code of a finite tile with scale exponent e, saturated as above (NaN codes kept).
FLOWMOE_HD uint8_t e4m3_saturate_for_scale(uint8_t q, int scale_exp) {
  const uint32_t lim = e4m3_max_code_for_scale(scale_exp), mag = q & 0x7Fu;
  return (mag > lim && mag != 0x7Fu) ? static_cast<uint8_t>((q & 0x80u) | lim) : q;
}
// An E2M1 nibble of a finite block with scale exponent e, saturated as above.
FLOWMOE_HD uint8_t e2m1_saturate_for_scale(uint8_t n, int scale_exp) {
  const uint32_t lim = e2m1_max_code_for_scale(scale_exp), mag = n & 0x7u;
  return mag > lim ? static_cast<uint8_t>((n & 0x8u) | lim) : n;
}
// What every quantizer with a power-of-two tile scale writes for one finite element.
FLOWMOE_HD uint8_t quant_e4m3_finite(float x, int scale_exp) {
  return e4m3_saturate_for_scale(quant_e4m3(x, scale_exp), scale_exp);
}
FLOWMOE_HD uint8_t quant_e2m1_finite(float x, int scale_exp) {
  return e2m1_saturate_for_scale(quant_e2m1(x, scale_exp), scale_exp);
}

// Encode v * 2^-shift_down in E4M3 (RNE, into the subnormals where needed), for an exactly
// representable small value v (|v| <= 448: an E4M3 or E2M1 value) and any shift that keeps
// |v * 2^-shift_down| <= 448 (up-shifts are exact).
// *lost is set when the encoded value differs from v * 2^-shift_down.
FLOWMOE_HD uint8_t e4m3_encode_shifted(float v, int shift_down, bool* lost) {
  // |v| < 2^9: for shift_down >= 19 the result is below half the smallest subnormal (2^-10)
  // and rounds to a signed zero; otherwise v * 2^-shift_down is an exact binary32 value.
  if (shift_down >= 19) {
    *lost = v != 0.0f;
    return static_cast<uint8_t>((f32_bits(v) >> 24) & 0x80u);
  }
  const float w = v * exp2i(-shift_down);
  const uint8_t r = f32_to_e4m3(w);
  *lost = e4m3_to_f32(r) != w;
  return r;
}

// Re-encode an E4M3 code q of a tile with scale exponent e_from under scale exponent
// e_to = e_from + shift_down (shift_down >= 0): RNE_E4M3(q * 2^-shift_down). Exact unless the
// value leaves the normal range; then it rounds to nearest even into the subnormals (*lost set).
FLOWMOE_HD uint8_t e4m3_rescale(uint8_t q, int shift_down, bool* lost) {
  if (e4m3_is_nan(q)) {
    *lost = false;
    return q;
  }
  return e4m3_encode_shifted(e4m3_to_f32(q), shift_down, lost);
}



// FP4 -> FP8 (SPEC §4): the FP8 scale code for MXFP4 block scale codes whose maximum is cmax:
// 2^(e_max - 6), clamped at the smallest scale (code 0). Every E2M1 value P * 2^(e_j) is then
// P * 2^(6 - Δ_j) in the FP8 tile, exact for Δ_j <= 14.
FLOWMOE_HD int fp8_scale_code_from_fp4_max(int cmax) { return cmax > 6 ? cmax - 6 : 0; }

// Column-amax exponent (TransposeExponent::kColumnAmax) from integer keys, for the kernels: a key
// orders the values v * 2^(e - 127) of codes under scale codes e (0 = no value: a zero or NaN
// code), so the block's target scale code follows from the maximum key alone. Proven equal to
// the CPU reference's amax rule by tests/cpu/test_transpose_exponent.cpp.
// E4M3: a normal code is (1 + m/8) * 2^(ef - 7), key 8 * (e + ef) + m + 24 = 8e + 24 + magnitude;
// a subnormal m * 2^-9 is renormalised (m = 1..7 -> 2^-9, 2^-8, 1.5*2^-8, 2^-7, 1.25*2^-7, ...).
// The scale code is then ceil(log2(amax / 448)) + 127: the binade minus 8, plus 1 for a
// mantissa 1.875 (> 1.75).
FLOWMOE_HD int e4m3_amax_key(uint8_t q, int e) {
  const int mag = q & 0x7F;
  if (mag == 0 || mag == 0x7F) return 0;
  if (mag >= 8) return 8 * e + 24 + mag;
  return 8 * e + 24 + (mag < 4 ? (mag == 1 ? -16 : mag == 2 ? -8 : -4) : 2 * (mag - 4));
}
FLOWMOE_HD int scale_code_from_e4m3_amax_key(int key) {
  if (key == 0) return 0;
  const int c = (key >> 3) - 18 + ((key & 7) == 7 ? 1 : 0);
  return c < 0 ? 0 : (c > 254 ? 254 : c);
}
// E2M1: magnitude 1..7 is 0.5, 1, 1.5, 2, 3, 4, 6, binade (mag >> 1) - 1 and mantissa <= 1.5,
// so the scale code is e + binade - 8; key e + (mag >> 1) + 1.
FLOWMOE_HD int e2m1_amax_key(uint8_t nibble, int e) {
  const int mag = nibble & 7;
  return mag == 0 ? 0 : e + (mag >> 1) + 1;
}
FLOWMOE_HD int scale_code_from_e2m1_amax_key(int key) {
  if (key == 0) return 0;
  const int c = key - 10;
  return c < 0 ? 0 : (c > 254 ? 254 : c);
}

// ---------------------------------------------------------------------------------------------
// Dequantization of one element: code value times scale, exact in binary32. A NaN code or a NaN
// scale gives the canonical quiet NaN (0x7FC00000), so NaN bits never depend on the hardware.
constexpr uint32_t kCanonicalNaN = 0x7FC00000u;
FLOWMOE_HD float dequant_e4m3(uint8_t code, uint8_t scale) {
  if (e4m3_is_nan(code) || scale == kUE8M0NaN) return f32_from_bits(kCanonicalNaN);
  return e4m3_to_f32(code) * ue8m0_to_f32(scale);
}
FLOWMOE_HD float dequant_e2m1(uint8_t nibble, uint8_t scale) {
  if (scale == kUE8M0NaN) return f32_from_bits(kCanonicalNaN);
  return e2m1_to_f32(nibble) * ue8m0_to_f32(scale);
}

// ---------------------------------------------------------------------------------------------
// Fast paths used by the kernels; each is proven equal to the generic code above by exhaustive
// tests (tests/cpu/test_fast_paths.cpp).

// E2M1 encode of a finite v with |v| <= 6 (a quantizer's x / 2^e): RNE by thresholds. Ties go
// to the even code: 0.25->0, 0.75->1.0, 1.25->1.0, 1.75->2.0, 2.5->2.0, 3.5->4.0, 5->4.0.
FLOWMOE_HD uint8_t e2m1_encode_bounded(float v) {
  const float a = f32_abs(v);
  const uint32_t mag = (a > 0.25f) + (a >= 0.75f) + (a > 1.25f) + (a >= 1.75f) + (a > 2.5f) +
                       (a >= 3.5f) + (a > 5.0f);
  return static_cast<uint8_t>(mag | ((f32_bits(v) >> 28) & 0x8u));
}

// e4m3_rescale with an integer fast path: a normal code whose exponent field stays >= 1 after
// the shift only loses d from its exponent field.
FLOWMOE_HD uint8_t e4m3_rescale_fast(uint8_t q, int shift_down, bool* lost) {
  const uint32_t mag = q & 0x7Fu;
  if (shift_down == 0 || mag == 0 || mag == 0x7Fu) {
    *lost = false;
    return q;
  }
  if (static_cast<int>(mag >> 3) > shift_down) {
    *lost = false;
    return static_cast<uint8_t>(q - (static_cast<uint32_t>(shift_down) << 3));
  }
  return e4m3_rescale(q, shift_down, lost);
}

}  // namespace num
}  // namespace flowmoe
