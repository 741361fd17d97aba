// Exhaustive tests of the format codecs and scale rules in flowmoe/numerics.h against the
// independent table/formula reference of tests/common/reference.h.
#include <gtest/gtest.h>

#include <cfloat>
#include <cmath>
#include <cstdint>
#include <sstream>
#include <string>
#include <vector>

#include "common/reference.h"
#include "flowmoe/numerics.h"

namespace num = flowmoe::num;
using namespace flowmoe_test;

namespace {

std::string hex(uint32_t v, int digits) {
  std::ostringstream os;
  os << "0x" << std::hex;
  os.width(digits);
  os.fill('0');
  os << v;
  return os.str();
}

// Same double value, NaN matching NaN, and the same sign (so -0 != +0).
::testing::AssertionResult SameDouble(double want, double got) {
  if (std::isnan(want) && std::isnan(got)) return ::testing::AssertionSuccess();
  if (want == got && std::signbit(want) == std::signbit(got)) return ::testing::AssertionSuccess();
  return ::testing::AssertionFailure() << "want " << want << ", got " << got;
}

// Every BF16 bit pattern, as a float.
std::vector<float> all_bf16_values() {
  std::vector<float> v(65536);
  for (uint32_t h = 0; h < 65536; ++h) v[h] = bf16_bits_to_float(static_cast<uint16_t>(h));
  return v;
}

// Random binary32 patterns: half fully random bits, half with an exponent near the small-float
// ranges (2^-30 .. 2^12) so the interesting roundings get plenty of samples.
std::vector<float> random_floats(size_t n, uint64_t seed) {
  Rng rng(seed);
  std::vector<float> v(n);
  for (size_t i = 0; i < n; ++i) {
    uint32_t u = rng.next32();
    if (i % 2) u = (u & 0x807FFFFFu) | (static_cast<uint32_t>(rng.uniform_int(127 - 30, 127 + 12)) << 23);
    v[i] = float_of(u);
  }
  return v;
}

}  // namespace

// ================================================================================================
// E4M3
// ================================================================================================
TEST(E4M3, EveryCodeDecodesToTheFormulaValue) {
  for (unsigned c = 0; c < 256; ++c) {
    const uint8_t code = static_cast<uint8_t>(c);
    // independent formula: sign, exponent field e (bias 7), mantissa m; subnormals m * 2^-9
    const unsigned e = (c >> 3) & 0xF, m = c & 7;
    double want;
    if (e == 0xF && m == 7) want = NAN;
    else if (e == 0) want = m * std::ldexp(1.0, -9);
    else want = (1.0 + m / 8.0) * std::ldexp(1.0, static_cast<int>(e) - 7);
    if (c & 0x80) want = -want;
    EXPECT_TRUE(SameDouble(want, num::e4m3_to_f32(code))) << "code " << hex(c, 2);
    EXPECT_EQ(num::e4m3_is_nan(code), std::isnan(want)) << "code " << hex(c, 2);
  }
  EXPECT_EQ(num::e4m3_to_f32(0x7E), 448.0f);
  EXPECT_EQ(num::e4m3_to_f32(0x08), 0.015625f);  // min normal 2^-6
  EXPECT_EQ(num::e4m3_to_f32(0x01), 0.001953125f);  // min subnormal 2^-9
}

TEST(E4M3, EveryCodeReencodesToItself) {
  for (unsigned c = 0; c < 256; ++c) {
    const uint8_t code = static_cast<uint8_t>(c);
    EXPECT_EQ(num::f32_to_e4m3(num::e4m3_to_f32(code)), code) << "code " << hex(c, 2);
  }
  EXPECT_EQ(num::f32_to_e4m3(-0.0f), 0x80);
  EXPECT_EQ(num::f32_to_e4m3(0.0f), 0x00);
}

TEST(E4M3, SpecialInputs) {
  EXPECT_EQ(num::f32_to_e4m3(NAN), 0x7F);
  EXPECT_EQ(num::f32_to_e4m3(-NAN), 0xFF);
  EXPECT_EQ(num::f32_to_e4m3(INFINITY), 0x7E);    // saturate, no infinity in E4M3
  EXPECT_EQ(num::f32_to_e4m3(-INFINITY), 0xFE);
  EXPECT_EQ(num::f32_to_e4m3(FLT_MAX), 0x7E);
  EXPECT_EQ(num::f32_to_e4m3(464.0f), 0x7E);      // the midpoint 448..480 saturates too
  EXPECT_EQ(num::f32_to_e4m3(1e-30f), 0x00);
  EXPECT_EQ(num::f32_to_e4m3(-1e-30f), 0x80);     // negative underflow keeps the sign
  EXPECT_EQ(num::f32_to_e4m3(std::ldexp(1.0f, -10)), 0x00);   // half the min subnormal: tie to even 0
  EXPECT_EQ(num::f32_to_e4m3(3 * std::ldexp(1.0f, -10)), 0x02);  // 1.5 * 2^-9: tie to even 2 * 2^-9
  EXPECT_EQ(num::f32_to_e4m3(std::nextafter(std::ldexp(1.0f, -10), 1.0f)), 0x01);
}

// ================================================================================================
// E2M1
// ================================================================================================
TEST(E2M1, EveryCodeDecodesToTheFormulaValue) {
  for (unsigned c = 0; c < 16; ++c) {
    const unsigned e = (c >> 1) & 3, m = c & 1;
    double want = e == 0 ? m * 0.5 : (1.0 + m / 2.0) * std::ldexp(1.0, static_cast<int>(e) - 1);
    if (c & 8) want = -want;
    EXPECT_TRUE(SameDouble(want, num::e2m1_to_f32(static_cast<uint8_t>(c)))) << "code " << c;
  }
  const float expected[8] = {0, 0.5f, 1, 1.5f, 2, 3, 4, 6};  // SPEC §1
  for (unsigned c = 0; c < 8; ++c) EXPECT_EQ(num::e2m1_to_f32(static_cast<uint8_t>(c)), expected[c]);
}

TEST(E2M1, EveryCodeReencodesToItself) {
  for (unsigned c = 0; c < 16; ++c) {
    EXPECT_EQ(num::f32_to_e2m1(num::e2m1_to_f32(static_cast<uint8_t>(c))), c) << "code " << c;
  }
}

TEST(E2M1, SpecialInputs) {
  // E2M1 has no NaN and no infinity: NaN and +-Inf saturate to +-6 keeping the sign
  // (the quantizers mark such blocks NaN through the scale; see test_convert.cpp).
  EXPECT_EQ(num::f32_to_e2m1(NAN), 0x7);
  EXPECT_EQ(num::f32_to_e2m1(-NAN), 0xF);
  EXPECT_EQ(num::f32_to_e2m1(INFINITY), 0x7);
  EXPECT_EQ(num::f32_to_e2m1(-INFINITY), 0xF);
  EXPECT_EQ(num::f32_to_e2m1(-0.0f), 0x8);
  EXPECT_EQ(num::f32_to_e2m1(0.25f), 0x0);   // tie 0 / 0.5 -> 0 (even)
  EXPECT_EQ(num::f32_to_e2m1(0.75f), 0x2);   // tie 0.5 / 1 -> 1 (even)
  EXPECT_EQ(num::f32_to_e2m1(2.5f), 0x4);    // tie 2 / 3 -> 2 (even)
  EXPECT_EQ(num::f32_to_e2m1(5.0f), 0x6);    // tie 4 / 6 -> 4 (even)
  EXPECT_EQ(num::f32_to_e2m1(7.0f), 0x7);    // beyond the max: saturate
  EXPECT_EQ(num::f32_to_e2m1(-0.2f), 0x8);   // signed zero
}

TEST(E2M1, PackAndGetPutElementTwoIInTheLowNibble) {
  for (unsigned a = 0; a < 16; ++a) {
    for (unsigned b = 0; b < 16; ++b) {
      const uint8_t byte = num::e2m1_pack(static_cast<uint8_t>(a), static_cast<uint8_t>(b));
      EXPECT_EQ(byte, a | (b << 4));
      const uint8_t buf[2] = {0x00, byte};
      EXPECT_EQ(num::e2m1_get(buf, 2), a);
      EXPECT_EQ(num::e2m1_get(buf, 3), b);
    }
  }
}

// ================================================================================================
// UE8M0
// ================================================================================================
TEST(UE8M0, EveryCodeDecodesToPowerOfTwo) {
  for (unsigned c = 0; c < 256; ++c) {
    const double want = c == 255 ? NAN : std::ldexp(1.0, static_cast<int>(c) - 127);
    EXPECT_TRUE(SameDouble(want, num::ue8m0_to_f32(static_cast<uint8_t>(c)))) << "code " << c;
  }
}

TEST(UE8M0, FromExponentClampsToTheFiniteCodes) {
  for (int e = -127; e <= 127; ++e) EXPECT_EQ(num::ue8m0_from_exp(e), e + 127);
  EXPECT_EQ(num::ue8m0_from_exp(-128), 0);
  EXPECT_EQ(num::ue8m0_from_exp(-1000), 0);
  EXPECT_EQ(num::ue8m0_from_exp(128), 254);  // never the NaN code
  EXPECT_EQ(num::ue8m0_from_exp(1000), 254);
}

TEST(Exp2i, ExactOverTheWholeRange) {
  for (int e = -149; e <= 127; ++e) EXPECT_EQ(static_cast<double>(num::exp2i(e)), std::ldexp(1.0, e)) << e;
}

// ================================================================================================
// Saturating RNE casts: all 65,536 BF16 inputs and random binary32 inputs vs the table reference
// ================================================================================================
struct CastCase {
  const char* name;
  uint8_t (*lib)(float);
  uint8_t (*ref)(double);
  const std::vector<double>& (*table)();
};
std::ostream& operator<<(std::ostream& os, const CastCase& c) { return os << c.name; }

class SmallFloatCast : public ::testing::TestWithParam<CastCase> {
 protected:
  // Compares lib and ref on every input; reports the first few mismatches and the count.
  void check_all(const std::vector<float>& xs, const char* what) {
    const CastCase& p = GetParam();
    int64_t bad = 0;
    for (float x : xs) {
      const uint8_t got = p.lib(x), want = p.ref(static_cast<double>(x));
      if (got != want && ++bad <= 8) {
        ADD_FAILURE() << p.name << "(" << x << " = bits " << hex(bits_of(x), 8) << "): got "
                      << hex(got, 2) << ", want " << hex(want, 2);
      }
    }
    EXPECT_EQ(bad, 0) << what << ": " << bad << " of " << xs.size() << " inputs differ";
  }
};

TEST_P(SmallFloatCast, AllBf16InputsMatchTableReference) { check_all(all_bf16_values(), "all bf16"); }

TEST_P(SmallFloatCast, RandomFloat32InputsMatchTableReference) {
  check_all(random_floats(1 << 20, 0xC0FFEE), "random float32");
}

// Midpoints between neighbouring representable magnitudes and their float neighbours: the
// ties-to-even decisions, exhaustively.
TEST_P(SmallFloatCast, EveryMidpointAndItsNeighbours) {
  const auto& t = GetParam().table();
  std::vector<float> xs;
  for (size_t i = 0; i + 1 < t.size(); ++i) {
    const float mid = static_cast<float>((t[i] + t[i + 1]) / 2);  // exact in binary32
    ASSERT_EQ(static_cast<double>(mid), (t[i] + t[i + 1]) / 2);
    for (float v : {mid, std::nextafter(mid, 0.0f), std::nextafter(mid, INFINITY)}) {
      xs.push_back(v);
      xs.push_back(-v);
    }
  }
  // above the max: the would-be next value and beyond
  const float mx = static_cast<float>(t.back());
  for (float v : {std::nextafter(mx, INFINITY), mx * 1.0625f, mx * 1.125f, mx * 1.5f, mx * 2.0f, FLT_MAX}) {
    xs.push_back(v);
    xs.push_back(-v);
  }
  check_all(xs, "midpoints");
}

INSTANTIATE_TEST_SUITE_P(
    Formats, SmallFloatCast,
    ::testing::Values(CastCase{"e4m3", num::f32_to_e4m3, ref_encode_e4m3, e4m3_magnitudes},
                      CastCase{"e2m1", num::f32_to_e2m1, ref_encode_e2m1, e2m1_magnitudes}),
    [](const ::testing::TestParamInfo<CastCase>& i) { return std::string(i.param.name); });

// ================================================================================================
// BF16
// ================================================================================================
TEST(BF16, ToFloatIsExactForEveryPattern) {
  for (uint32_t h = 0; h < 65536; ++h) {
    const float f = num::bf16_to_f32(static_cast<uint16_t>(h));
    EXPECT_EQ(bits_of(f), h << 16) << hex(h, 4);
    const uint32_t u = h << 16;
    const bool is_nan = ((u >> 23) & 0xFF) == 0xFF && (u & 0x7FFFFF);
    if (!is_nan) {
      const bool is_inf = ((u >> 23) & 0xFF) == 0xFF;
      const double want = is_inf ? ((u >> 31) ? -INFINITY : INFINITY) : binary32_value_unbounded(u);
      EXPECT_TRUE(SameDouble(want, f)) << hex(h, 4);
    } else {
      EXPECT_TRUE(std::isnan(f)) << hex(h, 4);
    }
  }
}

TEST(BF16, FromFloatRoundsToNearestEven) {
  std::vector<float> xs = random_floats(1 << 21, 0xBF16);
  Rng rng(77);
  // ties and near-ties in the dropped half-word, around every exponent
  for (int i = 0; i < (1 << 18); ++i) {
    const uint32_t hi = rng.next32() & 0xFFFF0000u;
    for (uint32_t lo : {0x8000u, 0x7FFFu, 0x8001u, 0x0000u, 0xFFFFu}) xs.push_back(float_of(hi | lo));
  }
  for (float v : {FLT_MAX, -FLT_MAX, INFINITY, -INFINITY, 0.0f, -0.0f, FLT_MIN, FLT_TRUE_MIN,
                  float_of(0x7F7F8000u), float_of(0x7F7F7FFFu), float_of(0xFF7F8000u)}) {
    xs.push_back(v);
  }
  int64_t bad = 0;
  for (float x : xs) {
    const uint16_t got = num::f32_to_bf16(x), want = ref_f32_to_bf16(x);
    bool ok;
    if (std::isnan(x)) {  // NaN stays NaN (quiet), sign kept
      ok = std::isnan(bf16_bits_to_float(got)) && (got >> 15) == (bits_of(x) >> 31);
    } else {
      ok = got == want;
    }
    if (!ok && ++bad <= 8) {
      ADD_FAILURE() << "f32_to_bf16(bits " << hex(bits_of(x), 8) << "): got " << hex(got, 4)
                    << ", want " << hex(want, 4);
    }
  }
  EXPECT_EQ(bad, 0) << "of " << xs.size();
  EXPECT_EQ(num::f32_to_bf16(float_of(0x7F7F8000u)), 0x7F80);  // tie above the max -> infinity
  EXPECT_EQ(num::f32_to_bf16(float_of(0x7F7F7FFFu)), 0x7F7F);
  EXPECT_EQ(num::f32_to_bf16(float_of(0x3F808000u)), 0x3F80);  // tie -> even
  EXPECT_EQ(num::f32_to_bf16(float_of(0x3F818000u)), 0x3F82);
}

// ================================================================================================
// Scale rules (SPEC §2)
// ================================================================================================
struct ScaleCase {
  const char* name;
  int (*lib)(float);
  double fmax;
  uint8_t (*quant)(float, int);
  uint8_t (*ref)(double);
  double (*value)(uint8_t);
};
std::ostream& operator<<(std::ostream& os, const ScaleCase& c) { return os << c.name; }

class ScaleRule : public ::testing::TestWithParam<ScaleCase> {
 protected:
  // lib == reference, and quantizing amax with that scale never clips.
  void check_amax(const std::vector<float>& amaxes, const char* what) {
    const ScaleCase& p = GetParam();
    int64_t bad = 0;
    for (float a : amaxes) {
      if (!std::isfinite(a)) continue;
      const double amax = std::fabs(static_cast<double>(a));
      const int got = p.lib(a), want = ref_scale_exp(amax, p.fmax);
      bool ok = got == want;
      // never clips: |amax / 2^e| <= FMAX, and amax itself encodes to its nearest value
      ok = ok && amax / std::ldexp(1.0, got) <= p.fmax;
      // and amax itself quantizes to its nearest representable value under that scale
      const uint8_t q = p.quant(a, got);
      ok = ok && q == p.ref(std::ldexp(static_cast<double>(a), -got));
      const double back = std::fabs(p.value(q)) * std::ldexp(1.0, got);
      if (!ok && ++bad <= 8) {
        ADD_FAILURE() << p.name << "(amax " << a << " = bits " << hex(bits_of(a), 8) << "): got " << got
                      << ", want " << want << " (dequantized amax " << back << ")";
      }
    }
    EXPECT_EQ(bad, 0) << what;
  }
};

TEST_P(ScaleRule, AllBf16AmaxValues) { check_amax(all_bf16_values(), "all bf16"); }

TEST_P(ScaleRule, RandomFloat32AmaxIncludingSubnormals) {
  Rng rng(2024);
  std::vector<float> xs;
  for (int i = 0; i < (1 << 19); ++i) {
    const uint32_t exp_field = static_cast<uint32_t>(rng.uniform_int(0, 254));  // 0: subnormal
    xs.push_back(float_of((exp_field << 23) | (rng.next32() & 0x7FFFFFu)));
  }
  for (uint32_t u = 1; u < 4096; ++u) xs.push_back(float_of(u));  // the smallest subnormals
  xs.push_back(FLT_MAX);
  xs.push_back(FLT_MIN);
  xs.push_back(FLT_TRUE_MIN);
  check_amax(xs, "random float32");
}

TEST_P(ScaleRule, BoundariesAtFmaxTimesPowersOfTwo) {
  const ScaleCase& p = GetParam();
  EXPECT_EQ(p.lib(0.0f), -127);
  EXPECT_EQ(p.lib(-0.0f), -127);
  for (int e = -126; e <= 120; ++e) {
    const float b = static_cast<float>(std::ldexp(p.fmax, e));
    if (!std::isfinite(b) || b < FLT_MIN) continue;
    EXPECT_EQ(p.lib(b), e) << p.name << " amax = fmax * 2^" << e;
    EXPECT_EQ(p.lib(std::nextafter(b, INFINITY)), e + 1) << p.name << " just above fmax * 2^" << e;
    EXPECT_EQ(p.lib(std::nextafter(b, 0.0f)), e) << p.name << " just below fmax * 2^" << e;
  }
}

INSTANTIATE_TEST_SUITE_P(
    Formats, ScaleRule,
    ::testing::Values(ScaleCase{"e4m3", num::e4m3_scale_exp, 448.0, num::quant_e4m3, ref_encode_e4m3, e4m3_value},
                      ScaleCase{"e2m1", num::e2m1_scale_exp, 6.0, num::quant_e2m1, ref_encode_e2m1, e2m1_value}),
    [](const ::testing::TestParamInfo<ScaleCase>& i) { return std::string(i.param.name); });

TEST(DivPow2, ExactForNormalQuotients) {
  Rng rng(5);
  for (int e = -127; e <= 127; ++e) {
    for (int i = 0; i < 200; ++i) {
      const float x = float_of((rng.next32() & 0x807FFFFFu) |
                               (static_cast<uint32_t>(rng.uniform_int(1, 254)) << 23));
      const double want = std::ldexp(static_cast<double>(x), -e);
      if (std::fabs(want) < FLT_MIN || std::fabs(want) > FLT_MAX) continue;
      ASSERT_EQ(static_cast<double>(num::div_pow2(x, e)), want) << x << " / 2^" << e;
    }
  }
}

// ================================================================================================
// Exponent-shift re-encoding (the core of the exact layout conversions, SPEC §4)
// ================================================================================================
TEST(E4M3Rescale, EveryCodeEveryShiftRoundsToNearestEven) {
  for (unsigned c = 0; c < 256; ++c) {
    const uint8_t q = static_cast<uint8_t>(c);
    for (int shift = 0; shift <= 30; ++shift) {
      bool lost = true;
      const uint8_t got = num::e4m3_rescale(q, shift, &lost);
      if (num::e4m3_is_nan(q)) {
        EXPECT_EQ(got, q);
        EXPECT_FALSE(lost);
        continue;
      }
      const double exact = std::ldexp(e4m3_value(q), -shift);
      const uint8_t want = ref_encode_e4m3(exact);
      ASSERT_EQ(got, want) << "code " << hex(c, 2) << " shifted down by " << shift;
      EXPECT_EQ(lost, e4m3_value(want) != exact) << "code " << hex(c, 2) << " shift " << shift;
    }
  }
}

TEST(E4M3EncodeShifted, EveryE2M1ValueEveryShift) {
  for (unsigned c = 0; c < 16; ++c) {
    const float v = static_cast<float>(e2m1_value(static_cast<uint8_t>(c)));
    for (int shift = -6; shift <= 30; ++shift) {
      bool lost = true;
      const uint8_t got = num::e4m3_encode_shifted(v, shift, &lost);
      const double exact = std::ldexp(static_cast<double>(v), -shift);
      const uint8_t want = ref_encode_e4m3(exact);
      ASSERT_EQ(got, want) << "e2m1 value " << v << " * 2^" << -shift;
      EXPECT_EQ(lost, e4m3_value(want) != exact) << v << " * 2^" << -shift;
      // SPEC §4: exact for shifts in [-6, 8] (0.5 * 2^-8 = 2^-9 is the smallest subnormal)
      if (shift <= 8) {
        EXPECT_FALSE(lost) << v << " * 2^" << -shift;
      }
    }
  }
}
