// SwiGLU reference (flowmoe/swiglu.h, flowmoe/swiglu_math.h): accuracy of the shared binary32
// arithmetic against float64 formulas, the non-finite policy, and the fused quantizers against the
// composition of the existing conversions (quantize_row, quantize_col, scaling_aware_transpose),
// bit for bit, on several distributions, odd token counts and ragged segments with empty experts.
// The gated activation's other kind (gpt-oss's clamped SwiGLU): test_swiglu_act.cpp.
#include <gtest/gtest.h>

#include <cmath>
#include <cstdint>
#include <cstdio>
#include <functional>
#include <limits>
#include <string>
#include <vector>

#include "common/reference.h"
#include "common/swiglu_data.h"
#include "flowmoe/cpu/convert.h"
#include "flowmoe/error.h"
#include "flowmoe/numerics.h"
#include "flowmoe/swiglu.h"
#include "flowmoe/swiglu_math.h"

using flowmoe::bf16_t;
using flowmoe::Layout;
using flowmoe::QTensor;
using flowmoe::QuantStats;
using flowmoe::Segments;
namespace cpu = flowmoe::cpu;
namespace num = flowmoe::num;
using flowmoe_test::Rng;

namespace {

// ---- float64 references -----------------------------------------------------------------------------
double ulp_of(double v) {  // binary32 ulp at |v| (2^-149 below the normal range)
  const double a = std::fabs(v);
  if (a < std::ldexp(1.0, -126)) return std::ldexp(1.0, -149);
  int e;
  std::frexp(a, &e);
  return std::ldexp(1.0, e - 24);
}
double silu64(double g) { return g / (1.0 + std::exp(-g)); }
double sigmoid64(double g) { return 1.0 / (1.0 + std::exp(-g)); }
double dsilu64(double g) {
  const double s = sigmoid64(g);
  return s * (1.0 + g * (1.0 - s));
}
bool finite(float x) { return std::isfinite(x); }
float bf(uint16_t h) { return num::bf16_to_f32(h); }

// Every finite BF16 value.
std::vector<float> all_finite_bf16() {
  std::vector<float> v;
  for (uint32_t b = 0; b < 0x10000u; ++b) {
    const float x = bf(static_cast<uint16_t>(b));
    if (finite(x)) v.push_back(x);
  }
  return v;
}
// Random binary32 values sign * 2^U(lo, hi) * (1 + u).
std::vector<float> random_floats(size_t n, int lo, int hi, uint64_t seed) {
  Rng rng(seed);
  std::vector<float> v(n);
  for (auto& x : v) x = static_cast<float>(rng.sign() * std::ldexp(1.0 + rng.uniform(), rng.uniform_int(lo, hi)));
  return v;
}

// ================================================================================================
// The shared arithmetic (swiglu_math.h)
// ================================================================================================
TEST(SwigluMath, ExpWithinOneUlpOfFloat64) {
  double worst = 0;
  float at = 0;
  auto check = [&](float x) {
    if (!(x <= 0.0f) || x < num::kExpMinArg) return;
    const double u = std::fabs(num::exp_nonpos(x) - std::exp(static_cast<double>(x))) /
                     ulp_of(std::exp(static_cast<double>(x)));
    if (u > worst) worst = u, at = x;
  };
  for (float x : all_finite_bf16()) check(x);
  for (float x : random_floats(4000000, -12, 6, 11)) check(-std::fabs(x));
  std::printf("[ measure  ] exp_nonpos: max error %.3f ulp (at %.9g) on all BF16 and 4M random x <= 0\n", worst, at);
  EXPECT_LE(worst, 1.0) << "at x = " << at;
}

TEST(SwigluMath, ExpSpecialValues) {
  EXPECT_EQ(num::exp_nonpos(0.0f), 1.0f);
  EXPECT_EQ(num::exp_nonpos(-0.0f), 1.0f);
  EXPECT_EQ(num::exp_nonpos(-104.0f), 0.0f);
  EXPECT_EQ(num::exp_nonpos(-1e30f), 0.0f);
  EXPECT_EQ(num::exp_nonpos(-INFINITY), 0.0f);
  EXPECT_EQ(num::exp_nonpos(NAN), 0.0f) << "NaN is clamped like -inf; callers propagate NaN through g";
  // subnormal results are rounded once
  EXPECT_GT(num::exp_nonpos(-100.0f), 0.0f);
  EXPECT_LT(num::exp_nonpos(-100.0f), std::ldexp(1.0f, -126));
  EXPECT_NEAR(num::exp_nonpos(-100.0f), std::exp(-100.0), std::ldexp(1.0, -149));
}

TEST(SwigluMath, SiluWithinFourUlpOfFloat64) {
  // g >= -87: t = e^-|g| is a binary32 normal and the relative bound holds. Below, the true value
  // is below 2^-119 and t is subnormal: the bound is absolute.
  double worst = 0, worst_abs = 0;
  float at = 0;
  auto check = [&](float g) {
    const double want = silu64(g);
    const double err = std::fabs(num::silu_f32(g) - want);
    if (g >= -87.0f) {
      if (err / ulp_of(want) > worst) worst = err / ulp_of(want), at = g;
    } else {
      worst_abs = std::max(worst_abs, err);
    }
  };
  for (float g : all_finite_bf16()) check(g);
  for (float g : random_floats(4000000, -10, 7, 12)) check(g);
  std::printf("[ measure  ] silu: max error %.3f ulp (at %.9g) for g >= -87; max abs error 2^%.1f below\n",
              worst, at, std::log2(worst_abs));
  EXPECT_LE(worst, 4.0) << "at g = " << at;
  EXPECT_LE(worst_abs, std::ldexp(1.0, -140));
}

TEST(SwigluMath, DsiluWithinBoundOfFloat64) {
  // silu'(g) = s (1 + g (1 - s)) has a root near g = -1.278 where 1 + g(1 - s) cancels; the
  // bound is relative to the size of the terms: |err| <= 5 * 2^-24 * (|silu'| + s |g| (1 - s)).
  double worst = 0;
  float at = 0;
  auto check = [&](float g) {
    const double s = sigmoid64(g);
    const double scale = std::fabs(dsilu64(g)) + s * std::fabs(g) * (1.0 - s);
    if (scale < std::ldexp(1.0, -100)) return;  // g < -70: both are ~0
    const double k = std::fabs(num::dsilu_f32(g) - dsilu64(g)) / (scale * std::ldexp(1.0, -24));
    if (k > worst) worst = k, at = g;
  };
  for (float g : all_finite_bf16()) check(g);
  for (float g : random_floats(4000000, -10, 7, 13)) check(g);
  std::printf("[ measure  ] silu': max error %.3f * 2^-24 * (|silu'| + s|g|(1-s)) (at %.9g)\n", worst, at);
  EXPECT_LE(worst, 5.0) << "at g = " << at;
}

TEST(SwigluMath, SpecialValues) {
  EXPECT_EQ(num::f32_bits(num::silu_f32(0.0f)), 0u);
  EXPECT_EQ(num::f32_bits(num::silu_f32(-0.0f)), 0x80000000u);
  EXPECT_EQ(num::silu_f32(INFINITY), INFINITY);
  EXPECT_TRUE(std::isnan(num::silu_f32(-INFINITY)));
  EXPECT_TRUE(std::isnan(num::silu_f32(NAN)));
  EXPECT_EQ(num::silu_f32(200.0f), 200.0f);
  EXPECT_EQ(num::silu_f32(-200.0f), 0.0f);
  EXPECT_EQ(num::dsilu_f32(0.0f), 0.5f);
  EXPECT_EQ(num::dsilu_f32(200.0f), 1.0f);
  EXPECT_TRUE(std::isnan(num::dsilu_f32(INFINITY)));
  EXPECT_TRUE(std::isnan(num::dsilu_f32(-INFINITY)));
  EXPECT_EQ(num::bf16_canonical(NAN), 0x7FC0);
  EXPECT_EQ(num::bf16_canonical(-NAN), 0x7FC0);
  EXPECT_EQ(num::bf16_canonical(num::f32_from_bits(0xFFC12345u)), 0x7FC0);
  EXPECT_EQ(num::bf16_canonical(3.4e38f), 0x7F80) << "overflow rounds to +inf";
}

// SPEC §2: non-finite input must not silently become finite. The SwiGLU arithmetic alone cannot
// guarantee that every output is non-finite (dup = dA * silu(g) does not see `up`), but a
// non-finite input always makes at least one output of the same element non-finite, so the
// per-tensor count the kernels report is > 0. Exhaustive over special values.
TEST(SwigluMath, NonFiniteInputAlwaysGivesANonFiniteOutput) {
  const float sp[] = {0.0f, -0.0f, 1.0f, -1.0f, -1.2784645f, 1e-40f, -1e-40f, 0.5f, 30.0f, -30.0f,
                      -90.0f, -120.0f, 1e20f, -1e20f, 3.3e38f, -3.3e38f, INFINITY, -INFINITY, NAN};
  int cases = 0;
  for (float g : sp) {
    for (float u : sp) {
      const bool bad_in = !finite(g) || !finite(u);
      if (bad_in) {
        ++cases;
        EXPECT_FALSE(finite(bf(num::bf16_canonical(num::swiglu_f32(g, u))))) << "g " << g << " u " << u;
      }
      for (float da : sp) {
        if (!bad_in && finite(da)) continue;
        const num::SwigluGrad d = num::dswiglu_f32(da, g, u);
        EXPECT_FALSE(finite(bf(num::bf16_canonical(d.dgate))) && finite(bf(num::bf16_canonical(d.dup))))
            << "da " << da << " g " << g << " u " << u;
      }
    }
  }
  EXPECT_GT(cases, 100);
}

// ================================================================================================
// Tensors
// ================================================================================================
// HDist, hdist_name, make_bf16: the generator shared with the GPU tests (tests/common/swiglu_data.h).
using flowmoe_test::HDist;
using flowmoe_test::hdist_name;
using flowmoe_test::make_bf16;

void expect_same(const QTensor& want, const QTensor& got, const std::string& what) {
  EXPECT_EQ(want.layout, got.layout) << what;
  EXPECT_EQ(want.rows, got.rows) << what;
  EXPECT_EQ(want.cols, got.cols) << what;
  EXPECT_EQ(want.segments.offsets, got.segments.offsets) << what;
  ASSERT_EQ(want.codes.size(), got.codes.size()) << what;
  ASSERT_EQ(want.scales.size(), got.scales.size()) << what;
  size_t bad = 0, first = 0;
  for (size_t i = 0; i < want.codes.size(); ++i)
    if (want.codes[i] != got.codes[i] && bad++ == 0) first = i;
  EXPECT_EQ(bad, 0u) << what << ": " << bad << " codes differ, first at " << first;
  bad = 0;
  for (size_t i = 0; i < want.scales.size(); ++i)
    if (want.scales[i] != got.scales[i] && bad++ == 0) first = i;
  EXPECT_EQ(bad, 0u) << what << ": " << bad << " scales differ, first at " << first;
}

TEST(Swiglu, GateIsTheFirstHalfAndEveryElementIsTheSharedFormula) {
  const int64_t m = 3, f = 256;
  auto h = make_bf16(HDist::kWide, m, 2 * f, 5);
  std::vector<bf16_t> a(m * f);
  const QuantStats st = cpu::swiglu(h.data(), m, f, a.data());
  EXPECT_EQ(st.nonfinite, 0);
  for (int64_t t = 0; t < m; ++t)
    for (int64_t j = 0; j < f; ++j) {
      const float g = bf(h[t * 2 * f + j]), u = bf(h[t * 2 * f + f + j]);
      ASSERT_EQ(a[t * f + j], num::bf16_canonical(num::silu_f32(g) * u)) << t << "," << j;
    }
  // up = 1 everywhere: A is silu(gate), rounded to BF16
  for (int64_t t = 0; t < m; ++t)
    for (int64_t j = 0; j < f; ++j) h[t * 2 * f + f + j] = 0x3F80;
  cpu::swiglu(h.data(), m, f, a.data());
  for (int64_t j = 0; j < f; ++j) ASSERT_EQ(a[j], num::bf16_canonical(num::silu_f32(bf(h[j]))));
}

struct Case {
  std::string name;
  std::vector<int32_t> counts;  // tokens per expert segment
  int64_t f;
  HDist dist;
  int64_t zero_row_every;
  int64_t m() const {
    int64_t s = 0;
    for (int32_t c : counts) s += c;
    return s;
  }
};
std::ostream& operator<<(std::ostream& os, const Case& c) { return os << c.name; }

std::vector<Case> cases() {
  std::vector<Case> v;
  const HDist all[] = {HDist::kNormal, HDist::kHeavy, HDist::kWide, HDist::kTiny, HDist::kNearMax, HDist::kNonFinite};
  for (HDist d : all) {
    const std::string n = hdist_name(d);
    v.push_back({"m1_" + n, {1}, 128, d, 0});
    v.push_back({"m127_" + n, {0, 60, 67}, 256, d, 0});
    v.push_back({"m129_" + n, {128, 0, 1}, 128, d, 0});
    v.push_back({"m1000_" + n, {0, 1, 127, 128, 129, 0, 300, 315}, 384, d, 7});
  }
  v.push_back({"v2lite_f1408", {200, 0, 57}, 1408, HDist::kNormal, 0});
  v.push_back({"empty", {0, 0}, 128, HDist::kNormal, 0});
  return v;
}

class SwigluTensors : public ::testing::TestWithParam<Case> {};

TEST_P(SwigluTensors, ForwardFusedEqualsQuantizeRowOfBinary32AThenTranspose) {
  const Case& c = GetParam();
  const int64_t m = c.m(), f = c.f;
  const Segments seg = Segments::from_counts(c.counts);
  const auto h = make_bf16(c.dist, m, 2 * f, 100 + m, c.zero_row_every);

  std::vector<float> a(m * f);
  const QuantStats st_a = cpu::swiglu(h.data(), m, f, a.data());
  for (int64_t i = 0; i < std::min<int64_t>(m * f, 1000); ++i) {
    const int64_t t = i / f, j = i % f;
    ASSERT_EQ(num::f32_bits(a[i]) | (std::isnan(a[i]) ? 0x7FFFFFFFu : 0u),
              num::f32_bits(num::swiglu_f32(bf(h[t * 2 * f + j]), bf(h[t * 2 * f + f + j]))) |
                  (std::isnan(a[i]) ? 0x7FFFFFFFu : 0u));
  }
  QTensor want_row, want_col, want_h;
  const QuantStats st_row = cpu::quantize_row(a.data(), m, f, &want_row);
  const QuantStats st_tr = cpu::scaling_aware_transpose(want_row, seg, &want_col);
  const QuantStats st_h = cpu::quantize_row(h.data(), m, 2 * f, &want_h);
  EXPECT_EQ(st_a.nonfinite, st_row.nonfinite);

  QTensor row, col, hq;
  const QuantStats st = cpu::swiglu_quant(h.data(), m, f, &row, &seg, &col, &hq);
  expect_same(want_row, row, "A row-wise");
  expect_same(want_col, col, "A column-wise");
  expect_same(want_h, hq, "H row-wise");
  EXPECT_EQ(st.nonfinite, st_row.nonfinite + st_h.nonfinite);
  EXPECT_EQ(st.underflow, st_tr.underflow);

  QTensor row_only;
  const QuantStats st1 = cpu::swiglu_quant(h.data(), m, f, &row_only, nullptr, nullptr, nullptr);
  expect_same(want_row, row_only, "A row-wise (no options)");
  EXPECT_EQ(st1.nonfinite, st_row.nonfinite);
  EXPECT_EQ(st1.underflow, 0);

  // The plain BF16 output is the same binary32 value rounded once more.
  std::vector<bf16_t> a16(m * f);
  const QuantStats st16 = cpu::swiglu(h.data(), m, f, a16.data());
  for (int64_t i = 0; i < m * f; ++i) ASSERT_EQ(a16[i], num::bf16_canonical(a[i])) << i;
  EXPECT_GE(st16.nonfinite, st_a.nonfinite) << "BF16 can only add overflows";

  if (c.dist == HDist::kNonFinite && m >= 127) EXPECT_GT(st.nonfinite, 0);
  if (c.dist == HDist::kNearMax && m >= 127) EXPECT_GT(st_a.nonfinite, 0) << "finite H can overflow A";
  if (c.dist == HDist::kNormal || c.dist == HDist::kHeavy || c.dist == HDist::kWide) EXPECT_EQ(st.nonfinite, 0);
}

TEST_P(SwigluTensors, BackwardFusedEqualsPlainThenQuantizeRowAndCol) {
  const Case& c = GetParam();
  const int64_t m = c.m(), f = c.f;
  const Segments seg = Segments::from_counts(c.counts);
  const auto h = make_bf16(c.dist, m, 2 * f, 200 + m, c.zero_row_every);
  const auto da = make_bf16(c.dist == HDist::kNonFinite ? HDist::kNonFinite : HDist::kHeavy, m, f, 300 + m,
                            c.zero_row_every);

  // ---- H in BF16
  std::vector<bf16_t> dh(m * 2 * f);
  const QuantStats st_dh = cpu::dswiglu(da.data(), h.data(), m, f, dh.data());
  for (int64_t t = 0; t < std::min<int64_t>(m, 3); ++t)
    for (int64_t j = 0; j < f; ++j) {
      const num::SwigluGrad g = num::dswiglu_f32(bf(da[t * f + j]), bf(h[t * 2 * f + j]), bf(h[t * 2 * f + f + j]));
      ASSERT_EQ(dh[t * 2 * f + j], num::bf16_canonical(g.dgate));
      ASSERT_EQ(dh[t * 2 * f + f + j], num::bf16_canonical(g.dup));
    }
  QTensor want_row, want_col;
  const QuantStats st_row = cpu::quantize_row(dh.data(), m, 2 * f, &want_row);
  cpu::quantize_col(dh.data(), m, 2 * f, seg, &want_col);
  EXPECT_EQ(st_dh.nonfinite, st_row.nonfinite);
  QTensor row, col;
  const QuantStats st = cpu::dswiglu_quant(da.data(), h.data(), m, f, seg, &row, &col);
  expect_same(want_row, row, "dH row-wise");
  expect_same(want_col, col, "dH column-wise");
  EXPECT_EQ(st.nonfinite, st_dh.nonfinite) << "each non-finite dH value counts once";
  EXPECT_EQ(st.underflow, 0);

  // ---- H saved as row-wise FP8: decoded exactly, same arithmetic
  QTensor hq;
  cpu::quantize_row(h.data(), m, 2 * f, &hq);
  std::vector<float> hdec(m * 2 * f);
  cpu::dequantize(hq, hdec.data());
  std::vector<bf16_t> dh8(m * 2 * f);
  const QuantStats st_dh8 = cpu::dswiglu(da.data(), hq, dh8.data());
  size_t bad = 0;
  for (int64_t t = 0; t < m; ++t)
    for (int64_t j = 0; j < f; ++j) {
      const num::SwigluGrad g = num::dswiglu_f32(bf(da[t * f + j]), hdec[t * 2 * f + j], hdec[t * 2 * f + f + j]);
      bad += dh8[t * 2 * f + j] != num::bf16_canonical(g.dgate);
      bad += dh8[t * 2 * f + f + j] != num::bf16_canonical(g.dup);
    }
  EXPECT_EQ(bad, 0u) << "dswiglu from FP8 H";
  QTensor want_row8, want_col8, row8, col8;
  cpu::quantize_row(dh8.data(), m, 2 * f, &want_row8);
  cpu::quantize_col(dh8.data(), m, 2 * f, seg, &want_col8);
  const QuantStats st8 = cpu::dswiglu_quant(da.data(), hq, seg, &row8, &col8);
  expect_same(want_row8, row8, "dH row-wise (FP8 H)");
  expect_same(want_col8, col8, "dH column-wise (FP8 H)");
  EXPECT_EQ(st8.nonfinite, st_dh8.nonfinite);
  if (c.dist == HDist::kNonFinite && m >= 127) EXPECT_GT(st.nonfinite, 0);
}

TEST_P(SwigluTensors, Deterministic) {
  const Case& c = GetParam();
  const int64_t m = c.m(), f = c.f;
  const Segments seg = Segments::from_counts(c.counts);
  const auto h = make_bf16(c.dist, m, 2 * f, 400 + m);
  const auto da = make_bf16(HDist::kNormal, m, f, 500 + m);
  QTensor r1, c1, r2, c2;
  cpu::dswiglu_quant(da.data(), h.data(), m, f, seg, &r1, &c1);
  cpu::dswiglu_quant(da.data(), h.data(), m, f, seg, &r2, &c2);
  expect_same(r1, r2, "run 2 vs run 1");
  expect_same(c1, c2, "run 2 vs run 1");
}

INSTANTIATE_TEST_SUITE_P(Cases, SwigluTensors, ::testing::ValuesIn(cases()),
                         [](const ::testing::TestParamInfo<Case>& i) { return i.param.name; });

// ================================================================================================
// Measured effects of two design choices (docs/SWIGLU.md §4)
// ================================================================================================
// (1) The fused forward quantizes the binary32 A (one rounding per value); the unfused sequence
// (plain BF16 SwiGLU, then quantize_row) rounds twice. They differ where the BF16 rounding moves a
// value onto or across an E4M3 rounding boundary (about 1/32 of the values: a BF16 ulp is 1/16 of
// an E4M3 ulp), or the tile maximum across a power of two.
TEST(SwigluMeasure, FusedBinary32VsUnfusedBf16Quantization) {
  const int64_t m = 512, f = 2048;
  for (HDist d : {HDist::kNormal, HDist::kHeavy}) {
    const auto h = make_bf16(d, m, 2 * f, 77);
    std::vector<float> a32(m * f);
    std::vector<bf16_t> a16(m * f);
    cpu::swiglu(h.data(), m, f, a32.data());
    cpu::swiglu(h.data(), m, f, a16.data());
    QTensor fused, unfused;
    cpu::swiglu_quant(h.data(), m, f, &fused, nullptr, nullptr, nullptr);
    cpu::quantize_row(a16.data(), m, f, &unfused);
    std::vector<float> df(m * f), du(m * f);
    cpu::dequantize(fused, df.data());
    cpu::dequantize(unfused, du.data());
    int64_t diff = 0, nz = 0;
    double ef = 0, eu = 0;
    for (int64_t i = 0; i < m * f; ++i) {
      diff += df[i] != du[i];
      if (a32[i] != 0) {
        ef += std::fabs(df[i] - a32[i]) / std::fabs(a32[i]);
        eu += std::fabs(du[i] - a32[i]) / std::fabs(a32[i]);
        ++nz;
      }
    }
    std::printf("[ measure  ] %s: A FP8 fused (from binary32) vs unfused (from BF16): %lld of %lld values differ "
                "(%.3f%%); mean rel err vs binary32 A %.4e fused, %.4e unfused\n",
                hdist_name(d), static_cast<long long>(diff), static_cast<long long>(m * f), 100.0 * diff / (m * f),
                ef / nz, eu / nz);
    EXPECT_LT(static_cast<double>(diff) / (m * f), 0.05);
    EXPECT_LT(ef, eu) << "one rounding is more accurate than two";
  }
}

// (2) The `flow` recipe saves H as row-wise FP8 instead of BF16. Effect on dH, relative to dH
// computed from BF16 H (both in binary32, before the output rounding).
TEST(SwigluMeasure, SavedFp8HVsBf16HEffectOnGradient) {
  const int64_t m = 512, f = 2048;
  for (HDist d : {HDist::kNormal, HDist::kHeavy}) {
    const auto h = make_bf16(d, m, 2 * f, 88);
    const auto da = make_bf16(HDist::kNormal, m, f, 89);
    QTensor hq;
    cpu::quantize_row(h.data(), m, 2 * f, &hq);
    std::vector<float> hdec(m * 2 * f);
    cpu::dequantize(hq, hdec.data());
    double num_g = 0, den_g = 0, num_u = 0, den_u = 0;
    for (int64_t t = 0; t < m; ++t)
      for (int64_t j = 0; j < f; ++j) {
        const float x = bf(da[t * f + j]);
        const num::SwigluGrad ref = num::dswiglu_f32(x, bf(h[t * 2 * f + j]), bf(h[t * 2 * f + f + j]));
        const num::SwigluGrad q = num::dswiglu_f32(x, hdec[t * 2 * f + j], hdec[t * 2 * f + f + j]);
        num_g += (q.dgate - ref.dgate) * static_cast<double>(q.dgate - ref.dgate);
        den_g += ref.dgate * static_cast<double>(ref.dgate);
        num_u += (q.dup - ref.dup) * static_cast<double>(q.dup - ref.dup);
        den_u += ref.dup * static_cast<double>(ref.dup);
      }
    const double rg = std::sqrt(num_g / den_g), ru = std::sqrt(num_u / den_u);
    std::printf("[ measure  ] %s H: dH from FP8 H vs BF16 H: relative RMS error dgate %.3e, dup %.3e\n",
                hdist_name(d), rg, ru);
    EXPECT_LT(rg, 0.05);
    EXPECT_LT(ru, 0.05);
  }
}

// ================================================================================================
// Errors
// ================================================================================================
::testing::AssertionResult ThrowsMentioning(const std::function<void()>& fn, const std::string& needle) {
  try {
    fn();
  } catch (const flowmoe::Error& e) {
    if (std::string(e.what()).find(needle) == std::string::npos)
      return ::testing::AssertionFailure() << "message does not mention \"" << needle << "\": " << e.what();
    return ::testing::AssertionSuccess();
  } catch (...) {
    return ::testing::AssertionFailure() << "threw something else than flowmoe::Error";
  }
  return ::testing::AssertionFailure() << "did not throw";
}

// ================================================================================================
// The routing probability (a' = p * SwiGLU, the MoE layer's form)
// ================================================================================================
TEST(SwigluProb, ProbabilityOneIsThePlainSwiglu) {
  const int64_t m = 77, f = 256;
  const auto h = make_bf16(HDist::kHeavy, m, 2 * f, 11);
  const auto da = make_bf16(HDist::kNormal, m, f, 12);
  const std::vector<float> one(m, 1.0f);
  std::vector<bf16_t> a0(m * f), a1(m * f), d0(m * 2 * f), d1(m * 2 * f);
  cpu::swiglu(h.data(), m, f, a0.data());
  cpu::swiglu(h.data(), m, f, a1.data(), one.data());
  EXPECT_EQ(a0, a1);
  cpu::dswiglu(da.data(), h.data(), m, f, d0.data());
  std::vector<float> part(m * (f / 128));
  cpu::dswiglu(da.data(), h.data(), m, f, d1.data(), one.data(), part.data());
  EXPECT_EQ(d0, d1);
  QTensor r0, r1;
  cpu::swiglu_quant(h.data(), m, f, &r0, nullptr, nullptr, nullptr);
  cpu::swiglu_quant(h.data(), m, f, &r1, nullptr, nullptr, nullptr, one.data());
  expect_same(r0, r1, "p = 1");
}

TEST(SwigluProb, PowerOfTwoProbabilityOnlyShiftsTheScale) {
  // p = 2^-3 multiplies every A exactly: the codes stay, each tile's scale drops by 3. In the
  // backward, p = 2 is the plain dSwiGLU of 2 * dA (exact in BF16).
  const int64_t m = 64, f = 384;
  const auto h = make_bf16(HDist::kNormal, m, 2 * f, 21);
  const std::vector<float> eighth(m, 0.125f), two(m, 2.0f);
  QTensor r0, r1;
  cpu::swiglu_quant(h.data(), m, f, &r0, nullptr, nullptr, nullptr);
  cpu::swiglu_quant(h.data(), m, f, &r1, nullptr, nullptr, nullptr, eighth.data());
  EXPECT_EQ(r0.codes, r1.codes);
  for (size_t i = 0; i < r0.scales.size(); ++i) ASSERT_EQ(r1.scales[i] + 3, r0.scales[i]) << i;
  const auto da = make_bf16(HDist::kNormal, m, f, 22);
  std::vector<bf16_t> da2(da.size());
  for (size_t i = 0; i < da.size(); ++i) da2[i] = num::bf16_canonical(2.0f * num::bf16_to_f32(da[i]));
  std::vector<bf16_t> d0(m * 2 * f), d1(m * 2 * f);
  cpu::dswiglu(da2.data(), h.data(), m, f, d0.data());
  cpu::dswiglu(da.data(), h.data(), m, f, d1.data(), two.data());
  EXPECT_EQ(d0, d1);
}

TEST(SwigluProb, ProbabilityGradientIsTheRowSumOfDaTimesA) {
  // dp[t] = sum_j dA'[t, j] * A[t, j]: the fixed-order FP32 sum against float64, within the
  // accumulated rounding (a few ulp of sum |terms| per term added).
  const int64_t m = 33, f = 1408;
  const auto h = make_bf16(HDist::kHeavy, m, 2 * f, 31, 5);
  const auto da = make_bf16(HDist::kNormal, m, f, 32);
  std::vector<float> prow(m);
  for (int64_t t = 0; t < m; ++t) prow[t] = 0.01f + 0.03f * static_cast<float>(t);
  std::vector<bf16_t> dh(m * 2 * f);
  std::vector<float> part(m * (f / 128), -1.0f), dp(m);
  cpu::dswiglu(da.data(), h.data(), m, f, dh.data(), prow.data(), part.data());
  cpu::sum_dprow_parts(part.data(), m, f, dp.data());
  std::vector<float> a(m * f);
  cpu::swiglu(h.data(), m, f, a.data());
  for (int64_t t = 0; t < m; ++t) {
    double want = 0.0, mag = 0.0;
    for (int64_t j = 0; j < f; ++j) {
      const double term = static_cast<double>(num::bf16_to_f32(da[t * f + j])) * a[t * f + j];
      want += term;
      mag += std::fabs(term);
    }
    EXPECT_NEAR(dp[t], want, 1e-6 * mag + 1e-30) << "row " << t;
    if (t % 5 == 1) EXPECT_EQ(dp[t], 0.0f) << "zero row " << t;  // padding-like rows give 0
  }
  // the fused backward writes the same partial sums
  QTensor row, col;
  std::vector<float> part2(m * (f / 128));
  cpu::dswiglu_quant(da.data(), h.data(), m, f, Segments::from_counts({static_cast<int32_t>(m)}), &row, &col,
                     prow.data(), part2.data());
  EXPECT_EQ(part, part2);
}

TEST(SwigluProb, Mxfp4SavedHIsDecodedExactly) {
  // flow-fp4 saves H as MXFP4. Its values are exactly representable in BF16, so the backward
  // from the MXFP4 copy equals the backward from that copy decoded to BF16, bit for bit.
  const int64_t m = 129, f = 256;
  const auto h = make_bf16(HDist::kHeavy, m, 2 * f, 51, 9);
  const auto da = make_bf16(HDist::kNormal, m, f, 52);
  std::vector<float> prow(m);
  for (int64_t t = 0; t < m; ++t) prow[t] = 0.25f + 0.005f * static_cast<float>(t);
  QTensor h4;
  cpu::quantize_mxfp4(h.data(), m, 2 * f, &h4);
  std::vector<bf16_t> hd(m * 2 * f);
  cpu::dequantize(h4, hd.data());
  const Segments seg = Segments::from_counts({0, 64, 65});
  QTensor r4, c4, rb, cb;
  std::vector<float> p4(m * (f / 128)), pb(m * (f / 128));
  const QuantStats s4 = cpu::dswiglu_quant(da.data(), h4, seg, &r4, &c4, prow.data(), p4.data());
  const QuantStats sb = cpu::dswiglu_quant(da.data(), hd.data(), m, f, seg, &rb, &cb, prow.data(), pb.data());
  expect_same(rb, r4, "dH row-wise (MXFP4 H)");
  expect_same(cb, c4, "dH column-wise (MXFP4 H)");
  EXPECT_EQ(pb, p4);
  EXPECT_EQ(s4.nonfinite, sb.nonfinite);
  // and it is not the same as the backward from the BF16 H (the MXFP4 rounding is real)
  QTensor rh, ch;
  cpu::dswiglu_quant(da.data(), h.data(), m, f, seg, &rh, &ch, prow.data(), nullptr);
  EXPECT_NE(rh.codes, r4.codes);
}

TEST(SwigluProb, GradientOfProbabilitiesNeedsProbabilities) {
  const int64_t m = 4, f = 128;
  const auto h = make_bf16(HDist::kNormal, m, 2 * f, 41);
  const auto da = make_bf16(HDist::kNormal, m, f, 42);
  std::vector<bf16_t> dh(m * 2 * f);
  std::vector<float> part(m);
  try {
    cpu::dswiglu(da.data(), h.data(), m, f, dh.data(), nullptr, part.data());
    FAIL() << "expected an error";
  } catch (const flowmoe::Error& e) {
    EXPECT_NE(std::string(e.what()).find("needs prow"), std::string::npos) << e.what();
  }
}

TEST(SwigluErrors, BadShapesAndArgumentsAreRejectedWithClearMessages) {
  const std::vector<bf16_t> h(4 * 512, 0x3F80), da(4 * 256, 0x3F80);
  std::vector<bf16_t> out(4 * 512);
  QTensor q, c;
  const Segments seg = Segments::from_counts({1, 3});
  EXPECT_TRUE(ThrowsMentioning([&] { cpu::swiglu(h.data(), 4, 100, out.data()); }, "not a positive multiple of 128"));
  EXPECT_TRUE(ThrowsMentioning([&] { cpu::swiglu(h.data(), 4, 0, out.data()); }, "F = 0"));
  EXPECT_TRUE(ThrowsMentioning([&] { cpu::swiglu(h.data(), -1, 128, out.data()); }, "M = -1"));
  EXPECT_TRUE(ThrowsMentioning([&] { cpu::swiglu(nullptr, 4, 128, out.data()); }, "H is null"));
  EXPECT_TRUE(ThrowsMentioning([&] { cpu::swiglu_quant(h.data(), 4, 192, &q, nullptr, nullptr, nullptr); },
                               "F = 192"));
  EXPECT_TRUE(ThrowsMentioning([&] { cpu::swiglu_quant(h.data(), 4, 128, nullptr, nullptr, nullptr, nullptr); },
                               "a_row"));
  EXPECT_TRUE(ThrowsMentioning([&] { cpu::swiglu_quant(h.data(), 4, 128, &q, &seg, nullptr, nullptr); },
                               "needs both `seg` and `a_col`"));
  const Segments short_seg = Segments::from_counts({1, 2});
  EXPECT_TRUE(ThrowsMentioning([&] { cpu::swiglu_quant(h.data(), 4, 128, &q, &short_seg, &c, nullptr); },
                               "must end at the token count M = 4"));
  EXPECT_TRUE(ThrowsMentioning([&] { cpu::dswiglu(da.data(), h.data(), 4, 64, out.data()); }, "F = 64"));
  EXPECT_TRUE(ThrowsMentioning([&] { cpu::dswiglu(nullptr, h.data(), 4, 128, out.data()); }, "dA is null"));
  EXPECT_TRUE(ThrowsMentioning([&] { cpu::dswiglu_quant(da.data(), h.data(), 4, 128, short_seg, &q, &c); },
                               "must end at the token count"));
  EXPECT_TRUE(ThrowsMentioning([&] { cpu::dswiglu_quant(da.data(), h.data(), 4, 128, seg, &q, nullptr); },
                               "must both be given"));
  // saved FP8 H of the wrong layout or shape
  QTensor hc;
  cpu::quantize_col(h.data(), 4, 256, Segments::whole(4), &hc);
  EXPECT_TRUE(ThrowsMentioning([&] { cpu::dswiglu(da.data(), hc, out.data()); }, "expected row-wise"));
  QTensor h3;
  cpu::quantize_row(h.data(), 4, 384, &h3);  // 2F = 384: F = 192
  EXPECT_TRUE(ThrowsMentioning([&] { cpu::dswiglu(da.data(), h3, out.data()); }, "384 columns"));
  QTensor hr;
  cpu::quantize_row(h.data(), 4, 256, &hr);
  hr.scales.pop_back();
  EXPECT_TRUE(ThrowsMentioning([&] { cpu::dswiglu_quant(da.data(), hr, seg, &q, &c); }, "scale bytes"));
}

TEST(SwigluErrors, EmptyTokenCountIsValid) {
  QTensor q, c, hq;
  const Segments seg = Segments::from_counts({0, 0});
  EXPECT_NO_THROW(cpu::swiglu_quant(nullptr, 0, 128, &q, &seg, &c, &hq));
  EXPECT_EQ(q.codes.size(), 0u);
  EXPECT_EQ(c.scales.size(), 0u);
  EXPECT_NO_THROW(cpu::dswiglu_quant(nullptr, nullptr, 0, 256, seg, &q, &c));
}

}  // namespace
