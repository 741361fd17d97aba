// Independent, deliberately slow reference for the flowmoe number formats, scale rules and
// layouts, written from SPEC §1-§3 and the layout table in flowmoe/tensor.h only.
//
// Nothing here includes flowmoe/numerics.h: values come from the textbook formulas evaluated in
// double (every value of every format involved is exact in double), rounding is "pick the nearest
// entry of a table of all representable magnitudes", scale exponents come from a search with
// std::ldexp. The tests compare the library against this, bit for bit.
#pragma once

#include <algorithm>
#include <cfloat>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <limits>
#include <vector>

#include "flowmoe/tensor.h"

namespace flowmoe_test {

// ---- bits ---------------------------------------------------------------------------------------
inline uint32_t bits_of(float x) {
  uint32_t u;
  std::memcpy(&u, &x, 4);
  return u;
}
inline float float_of(uint32_t u) {
  float x;
  std::memcpy(&x, &u, 4);
  return x;
}
// Same value in the strictest sense: both NaN, or identical bits (so +0 and -0 differ).
inline bool same_value(float a, float b) {
  return (std::isnan(a) && std::isnan(b)) || bits_of(a) == bits_of(b);
}

// ---- value formulas -------------------------------------------------------------------------------
// Magnitude of a small float with exponent field e, mantissa field m, `mbits` mantissa bits and
// exponent bias `bias`: subnormal (e == 0) m * 2^(1 - bias - mbits), else (1 + m / 2^mbits) * 2^(e - bias).
inline double minifloat_magnitude(unsigned e, unsigned m, int mbits, int bias) {
  if (e == 0) return std::ldexp(static_cast<double>(m), 1 - bias - mbits);
  return std::ldexp(1.0 + std::ldexp(static_cast<double>(m), -mbits), static_cast<int>(e) - bias);
}

// E4M3 (OCP fn): s.eeee.mmm, bias 7; 0x7F / 0xFF are NaN, there is no infinity.
inline double e4m3_value(uint8_t c) {
  if ((c & 0x7F) == 0x7F) return std::numeric_limits<double>::quiet_NaN();
  const double mag = minifloat_magnitude((c >> 3) & 0xF, c & 0x7, 3, 7);
  return (c & 0x80) ? -mag : mag;
}
// E2M1: s.ee.m, bias 1, no NaN, no infinity. The 4-bit code sits in the low nibble.
inline double e2m1_value(uint8_t c) {
  const double mag = minifloat_magnitude((c >> 1) & 0x3, c & 0x1, 1, 1);
  return (c & 0x8) ? -mag : mag;
}
// UE8M0: 2^(e - 127); 0xFF is NaN.
inline double ue8m0_value(uint8_t c) {
  if (c == 0xFF) return std::numeric_limits<double>::quiet_NaN();
  return std::ldexp(1.0, static_cast<int>(c) - 127);
}

// ---- tables of representable magnitudes (index == unsigned code, ascending) ----------------------
inline const std::vector<double>& e4m3_magnitudes() {
  static const std::vector<double> t = [] {
    std::vector<double> v;
    for (unsigned c = 0; c <= 0x7E; ++c) v.push_back(e4m3_value(static_cast<uint8_t>(c)));
    return v;
  }();
  return t;
}
inline const std::vector<double>& e2m1_magnitudes() {
  static const std::vector<double> t = [] {
    std::vector<double> v;
    for (unsigned c = 0; c <= 0x7; ++c) v.push_back(e2m1_value(static_cast<uint8_t>(c)));
    return v;
  }();
  return t;
}

// Index of the table entry nearest to a >= 0 (a may be +inf); ties go to the even index, which is
// the code with an even mantissa. Beyond the last entry: the last entry (saturation).
inline unsigned nearest_code(const std::vector<double>& table, double a) {
  const auto it = std::lower_bound(table.begin(), table.end(), a);
  if (it == table.end()) return static_cast<unsigned>(table.size() - 1);
  const unsigned hi = static_cast<unsigned>(it - table.begin());
  if (hi == 0 || table[hi] == a) return hi;
  const unsigned lo = hi - 1;
  const double dlo = a - table[lo], dhi = table[hi] - a;  // exact: all values are short doubles
  if (dlo < dhi) return lo;
  if (dhi < dlo) return hi;
  return (lo % 2 == 0) ? lo : hi;
}

// Saturating round-to-nearest-even encoders (sign kept, also on zero results).
inline uint8_t ref_encode_e4m3(double x) {
  const unsigned s = std::signbit(x) ? 0x80u : 0u;
  if (std::isnan(x)) return static_cast<uint8_t>(s | 0x7Fu);
  return static_cast<uint8_t>(s | nearest_code(e4m3_magnitudes(), std::fabs(x)));
}
// E2M1 has no NaN: the library saturates NaN to the largest magnitude with the input's sign
// (callers mark the block NaN through its scale); the reference does the same on purpose.
inline uint8_t ref_encode_e2m1(double x) {
  const unsigned s = std::signbit(x) ? 0x8u : 0u;
  if (std::isnan(x)) return static_cast<uint8_t>(s | 0x7u);
  return static_cast<uint8_t>(s | nearest_code(e2m1_magnitudes(), std::fabs(x)));
}

// ---- BF16 ------------------------------------------------------------------------------------------
// Value of the upper-half binary32 pattern hi16, or of a binary32 pattern, in double.
inline double binary32_value_unbounded(uint32_t u) {
  // For rounding decisions: exponent field 255 with mantissa 0 stands for 2^128 (the value an
  // unbounded exponent would give), so "round up past the largest finite" becomes infinity.
  const int e = static_cast<int>((u >> 23) & 0xFF);
  const uint32_t m = u & 0x7FFFFF;
  double mag;
  if (e == 0) mag = std::ldexp(static_cast<double>(m), -149);
  else mag = std::ldexp(1.0 + std::ldexp(static_cast<double>(m), -23), e - 127);
  return (u >> 31) ? -mag : mag;
}
// binary32 -> bf16 bits, round to nearest even, by comparing distances in double.
inline uint16_t ref_f32_to_bf16(float x) {
  const uint32_t u = bits_of(x);
  if (std::isnan(x)) return static_cast<uint16_t>((u >> 16) | 0x40);  // any quiet NaN of that sign
  if (std::isinf(x)) return static_cast<uint16_t>(u >> 16);
  const uint32_t lo = u & 0xFFFF0000u;  // truncation: toward zero
  const uint32_t hi = lo + 0x10000u;    // next bf16 away from zero (may be the infinity pattern)
  const double v = std::fabs(static_cast<double>(x));
  const double vlo = std::fabs(binary32_value_unbounded(lo)), vhi = std::fabs(binary32_value_unbounded(hi));
  const double dlo = v - vlo, dhi = vhi - v;
  uint32_t pick;
  if (dlo < dhi) pick = lo;
  else if (dhi < dlo) pick = hi;
  else pick = ((lo >> 16) & 1u) ? hi : lo;
  return static_cast<uint16_t>(pick >> 16);
}
inline float bf16_bits_to_float(uint16_t h) { return float_of(static_cast<uint32_t>(h) << 16); }

// ---- scale rule (SPEC §2) ------------------------------------------------------------------------
// Smallest integer e in [-127, 127] with amax <= fmax * 2^e; -127 when even that is too big a
// scale (tiny or zero amax). Binary search over a monotone predicate, exact in double.
inline int ref_scale_exp(double amax, double fmax) {
  int lo = -127, hi = 127;  // predicate true at hi for every finite float amax
  if (amax <= std::ldexp(fmax, lo)) return lo;
  while (hi - lo > 1) {  // invariant: false at lo, true at hi
    const int mid = lo + (hi - lo) / 2;
    if (amax <= std::ldexp(fmax, mid)) hi = mid;
    else lo = mid;
  }
  return hi;
}
inline int ref_e4m3_scale_exp(double amax) { return ref_scale_exp(amax, 448.0); }
inline int ref_e2m1_scale_exp(double amax) { return ref_scale_exp(amax, 6.0); }

// double -> float for values that are exact in binary32 or beyond its range (-> +-Inf, as the
// float arithmetic of a dequantizer gives; a plain cast would be undefined behaviour there).
inline float to_float(double d) {
  if (d > FLT_MAX) return INFINITY;
  if (d < -FLT_MAX) return -INFINITY;
  return static_cast<float>(d);
}

// Value that quantizing x with scale 2^e must dequantize to: nearest representable of x / 2^e,
// times 2^e. Double arithmetic is exact here; the float conversion is exact too (checked by the
// numerics tests: 4 significant bits at >= 2^-136 always fit binary32).
// Decoded saturation (docs/NUMERICS.md): a result beyond FLT_MAX becomes the largest code value
// whose product with 2^e is still finite, with the sign of the result.
inline double ref_saturate_decoded(double v, int e, double (*value)(uint8_t), unsigned max_code) {
  if (std::fabs(v) <= FLT_MAX) return v;
  unsigned c = max_code;
  while (c > 0 && value(static_cast<uint8_t>(c)) * std::ldexp(1.0, e) > FLT_MAX) --c;
  return std::copysign(value(static_cast<uint8_t>(c)) * std::ldexp(1.0, e), v);
}
inline float ref_quant_e4m3(float x, int e) {
  const double v = e4m3_value(ref_encode_e4m3(std::ldexp(static_cast<double>(x), -e))) * std::ldexp(1.0, e);
  return to_float(ref_saturate_decoded(v, e, e4m3_value, 0x7E));
}
inline float ref_quant_e2m1(float x, int e) {
  const double v = e2m1_value(ref_encode_e2m1(std::ldexp(static_cast<double>(x), -e))) * std::ldexp(1.0, e);
  return to_float(ref_saturate_decoded(v, e, e2m1_value, 0x7));
}

// ---- layouts (tensor.h) ---------------------------------------------------------------------------
// One 128-token block of a column-wise tensor: tokens [t0, t1) of one segment.
struct TokenBlock {
  int64_t t0, t1;
};
// Blocks in storage order: per segment, from its first token, 128 at a time, last one partial.
inline std::vector<TokenBlock> token_blocks(const flowmoe::Segments& seg) {
  std::vector<TokenBlock> out;
  for (size_t s = 0; s + 1 < seg.offsets.size(); ++s) {
    for (int64_t t = seg.offsets[s]; t < seg.offsets[s + 1]; t += 128) {
      out.push_back({t, std::min<int64_t>(t + 128, seg.offsets[s + 1])});
    }
  }
  return out;
}

// Scale byte of logical element (r, c) and the element's code, per the layout table of tensor.h.
inline uint8_t scale_of(const flowmoe::QTensor& q, const std::vector<TokenBlock>& blocks, int64_t r,
                        int64_t c) {
  using flowmoe::Layout;
  const int64_t m = q.rows, k = q.cols;
  switch (q.layout) {
    case Layout::kRow1x128: return q.scales[(c / 128) * m + r];
    case Layout::kCol128x1: {
      const auto it = std::upper_bound(blocks.begin(), blocks.end(), r,
                                       [](int64_t t, const TokenBlock& b) { return t < b.t1; });
      return q.scales[(it - blocks.begin()) * k + c];
    }
    case Layout::kWeight128x128: return q.scales[(r / 128) * (k / 128) + c / 128];
    case Layout::kMxfp4Row1x32: return q.scales[r * (k / 32) + c / 32];
  }
  return 0;
}
inline double code_value_of(const flowmoe::QTensor& q, int64_t r, int64_t c) {
  using flowmoe::Layout;
  const int64_t m = q.rows, k = q.cols;
  switch (q.layout) {
    case Layout::kRow1x128:
    case Layout::kWeight128x128: return e4m3_value(q.codes[r * k + c]);
    case Layout::kCol128x1: return e4m3_value(q.codes[c * m + r]);
    case Layout::kMxfp4Row1x32: {
      const int64_t i = r * k + c;
      const uint8_t b = q.codes[i / 2];
      return e2m1_value(static_cast<uint8_t>(i % 2 ? b >> 4 : b & 0xF));
    }
  }
  return 0;
}
// The logical [rows, cols] matrix a quantized tensor stands for (NaN where the scale is NaN).
inline std::vector<float> ref_decode(const flowmoe::QTensor& q) {
  const auto blocks = token_blocks(q.segments);
  std::vector<float> out(static_cast<size_t>(q.rows * q.cols));
  for (int64_t r = 0; r < q.rows; ++r)
    for (int64_t c = 0; c < q.cols; ++c)
      out[r * q.cols + c] = to_float(code_value_of(q, r, c) * ue8m0_value(scale_of(q, blocks, r, c)));
  return out;
}

// ---- deterministic random data ---------------------------------------------------------------------
// splitmix64: portable, so the data (and what the tests check) is the same on every platform.
class Rng {
 public:
  explicit Rng(uint64_t seed) : s_(seed) {}
  uint64_t next() {
    uint64_t z = (s_ += 0x9E3779B97F4A7C15ull);
    z = (z ^ (z >> 30)) * 0xBF58476D1CE4E5B9ull;
    z = (z ^ (z >> 27)) * 0x94D049BB133111EBull;
    return z ^ (z >> 31);
  }
  uint32_t next32() { return static_cast<uint32_t>(next() >> 32); }
  double uniform() { return static_cast<double>(next() >> 11) * 0x1.0p-53; }  // [0, 1)
  double uniform(double a, double b) { return a + (b - a) * uniform(); }
  int uniform_int(int lo, int hi) {  // [lo, hi]
    return lo + static_cast<int>(next() % static_cast<uint64_t>(hi - lo + 1));
  }
  double normal() {  // Box-Muller
    const double u1 = 1.0 - uniform(), u2 = uniform();
    return std::sqrt(-2.0 * std::log(u1)) * std::cos(6.283185307179586 * u2);
  }
  double sign() { return (next() & 1) ? -1.0 : 1.0; }

 private:
  uint64_t s_;
};

enum class Dist {
  kNormal,       // N(0, 1)
  kHeavyTail,    // N(0, 1), 0.5% of the values multiplied by U(100, 1000)
  kBinades,      // sign * 2^U(-30, 10): many binades inside every tile
  kRowBinades,   // kBinades times a per-row factor 2^U{-12..12}: row exponents differ a lot
};
inline const char* dist_name(Dist d) {
  switch (d) {
    case Dist::kNormal: return "normal";
    case Dist::kHeavyTail: return "heavytail";
    case Dist::kBinades: return "binades";
    case Dist::kRowBinades: return "rowbinades";
  }
  return "?";
}
// [m, k] row-major. Every row r with zero_row_every > 0 and r % zero_row_every == 1 is all zero
// (like the padding rows of a permuted activation).
inline std::vector<float> make_data(Dist d, int64_t m, int64_t k, uint64_t seed,
                                    int64_t zero_row_every = 0) {
  Rng rng(seed);
  std::vector<float> x(static_cast<size_t>(m * k));
  for (int64_t r = 0; r < m; ++r) {
    const double row_factor = d == Dist::kRowBinades ? std::ldexp(1.0, rng.uniform_int(-12, 12)) : 1.0;
    const bool zero = zero_row_every > 0 && r % zero_row_every == 1;
    for (int64_t c = 0; c < k; ++c) {
      double v = 0;
      switch (d) {
        case Dist::kNormal: v = rng.normal(); break;
        case Dist::kHeavyTail:
          v = rng.normal();
          if (rng.uniform() < 0.005) v *= rng.uniform(100.0, 1000.0);
          break;
        case Dist::kBinades:
        case Dist::kRowBinades: v = rng.sign() * std::exp2(rng.uniform(-30.0, 10.0)) * row_factor; break;
      }
      x[r * k + c] = zero ? 0.0f : static_cast<float>(v);
    }
  }
  return x;
}
// BF16 copy of float data by truncation (any BF16 data will do; the rounding is tested elsewhere).
inline std::vector<uint16_t> truncate_to_bf16(const std::vector<float>& x) {
  std::vector<uint16_t> h(x.size());
  for (size_t i = 0; i < x.size(); ++i) h[i] = static_cast<uint16_t>(bits_of(x[i]) >> 16);
  return h;
}
inline std::vector<float> widen_bf16(const std::vector<uint16_t>& h) {
  std::vector<float> x(h.size());
  for (size_t i = 0; i < h.size(); ++i) x[i] = bf16_bits_to_float(h[i]);
  return x;
}

}  // namespace flowmoe_test
