// The gated activation of the SwiGLU operators (num::GatedActivation, flowmoe/swiglu_math.h;
// flowmoe/swiglu.h's `act` parameter): the clamped SwiGLU of gpt-oss against a float64 evaluation
// of its formula, its gradient masks and non-finite behaviour, the default kind giving exactly the
// bits of the SwiGLU-only functions, and every cpu:: operator with the clamped activation against
// a direct loop over act_f32 / dact_f32 / dact_prob_f32 (BF16 and binary32 outputs, quantized
// outputs, dH from BF16, FP8 and MXFP4 H, the dprow partial sums).
#include <gtest/gtest.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstdio>
#include <string>
#include <vector>

#include "common/reference.h"
#include "common/swiglu_data.h"
#include "flowmoe/cpu/convert.h"
#include "flowmoe/error.h"
#include "flowmoe/moe.h"
#include "flowmoe/numerics.h"
#include "flowmoe/swiglu.h"
#include "flowmoe/swiglu_math.h"

using flowmoe::ActivationKind;
using flowmoe::ActivationRow;
using flowmoe::activation_from_name;
using flowmoe::activation_name;
using flowmoe::kActivations;
using flowmoe::MoeConfig;
using flowmoe::bf16_t;
using flowmoe::GatedActivation;
using flowmoe::QTensor;
using flowmoe::QuantStats;
using flowmoe::Segments;
namespace cpu = flowmoe::cpu;
namespace num = flowmoe::num;
using flowmoe_test::Rng;

namespace {

// gpt-oss's parameters (swiglu_alpha, swiglu_limit).
GatedActivation clamped(float alpha = 1.702f, float limit = 7.0f) {
  GatedActivation a;
  a.kind = ActivationKind::kClampedSwiglu;
  a.alpha = alpha;
  a.limit = limit;
  return a;
}
float bf(bf16_t h) { return num::bf16_to_f32(h); }
uint32_t bits(float x) { return num::f32_bits(x); }
double ulp_of(double v) {  // binary32 ulp at |v| (2^-149 below the normal range)
  const double a = std::fabs(v);
  if (a < std::ldexp(1.0, -126)) return std::ldexp(1.0, -149);
  int e;
  std::frexp(a, &e);
  return std::ldexp(1.0, e - 24);
}

// ---- float64 reference of the clamped SwiGLU ----------------------------------------------------
// z = alpha * g is taken rounded to binary32 (the model's first operation, done in its precision;
// the error of sigmoid(z) from that rounding alone grows like |z| 2^-24 and is not the arithmetic's),
// everything after it in float64. dq = da * p exactly.
struct Clamped64 {
  double act, dgate, dup;
  double z;            // alpha * g (binary32)
  double dgate_scale;  // |dq| |u + 1| (|dglu| + s |z| (1 - s)): the size of dgate's terms
};
Clamped64 clamped64(const GatedActivation& a, float gate, float up, double dq) {
  const float gf = gate > a.limit ? a.limit : gate;
  const double g = gf;
  const double u = up > a.limit ? a.limit : (up < -a.limit ? -a.limit : up);
  const double z = num::f_mul(gf, a.alpha);
  const double s = 1.0 / (1.0 + std::exp(-z));
  const double glu = g * s, u1 = u + 1.0;
  const double dglu = s * (1.0 + z * (1.0 - s));
  Clamped64 r;
  r.act = u1 * glu;
  r.dgate = gate > a.limit ? 0.0 : dq * u1 * dglu;
  r.dup = (up > a.limit || up < -a.limit) ? 0.0 : dq * glu;
  r.z = z;
  r.dgate_scale = std::fabs(dq) * std::fabs(u1) * (std::fabs(dglu) + s * std::fabs(z) * (1.0 - s));
  return r;
}

// Every finite BF16 value, and a few up values around the clamp and around -1 (where u + 1 cancels).
std::vector<float> all_finite_bf16() {
  std::vector<float> v;
  for (uint32_t b = 0; b < 0x10000u; ++b) {
    const float x = bf(static_cast<bf16_t>(b));
    if (std::isfinite(x)) v.push_back(x);
  }
  return v;
}
const float kUps[] = {0.0f,     -0.0f,  1.0f,      -1.0f,    -0.99609375f, -1.0078125f, 0.5f,
                      -0.5f,    2.5f,   -3.25f,    6.96875f, -6.96875f,    7.0f,        -7.0f,
                      7.03125f, -7.03125f, 7.5f,   -8.0f,    12.0f,        -30.0f,      1e3f,
                      -1e30f,   3e38f,  1e-20f,    -1e-40f,  0.1f,         -2.0f,       4.0f};

// ================================================================================================
// (a) accuracy of act_f32 / dact_prob_f32 (kClampedSwiglu) against float64
// ================================================================================================
TEST(SwigluAct, ClampedWithinFewUlpOfFloat64) {
  const GatedActivation act = clamped();
  // Bounds (measured on this sweep: act 3.84 ulp, dup 4.09 ulp, dgate 6.19, absolute 2^-141.2):
  // act within 4 ulp and dup within 4.5 ulp (one rounding more: dq = da * p) of the float64 value
  // while t = e^-|z| is a binary32 normal (z >= -87); below, the true value is below 2^-117 and t
  // subnormal: absolute 2^-136. dgate within 7 * 2^-24 * dgate_scale (relative to the size of its
  // terms: d/dg of g sigmoid(alpha g) has a root near alpha g = -1.278, as silu').
  double worst_a = 0, worst_u = 0, worst_g = 0, worst_abs = 0;
  float at_a = 0, at_g = 0;
  int64_t n = 0;
  auto check = [&](float gate, float up, float da, float p) {
    const double dq = static_cast<double>(da) * p;
    const Clamped64 want = clamped64(act, gate, up, dq);
    if (!std::isfinite(want.z)) return;  // |alpha g| > FLT_MAX: ClampedNonFiniteInputs
    const float a = num::act_f32(act, gate, up);
    const num::SwigluGradProb d = num::dact_prob_f32(act, da, p, gate, up);
    ASSERT_EQ(bits(d.a), bits(a)) << "dact_prob_f32's a is act_f32, gate " << gate << " up " << up;
    ++n;
    if (want.z >= -87.0) {
      const double ea = std::fabs(a - want.act) / ulp_of(want.act);
      if (ea > worst_a) worst_a = ea, at_a = gate;
      worst_u = std::max(worst_u, std::fabs(d.dup - want.dup) / ulp_of(want.dup));
    } else {
      worst_abs = std::max({worst_abs, std::fabs(a - want.act), std::fabs(d.dup - want.dup)});
    }
    if (want.dgate_scale >= std::ldexp(1.0, -100)) {
      const double eg = std::fabs(d.dgate - want.dgate) / (want.dgate_scale * std::ldexp(1.0, -24));
      if (eg > worst_g) worst_g = eg, at_g = gate;
    } else {
      ASSERT_LE(std::fabs(d.dgate), std::ldexp(1.0, -100)) << "gate " << gate << " up " << up;
    }
  };
  // every finite BF16 gate (beyond +-limit too) x the up values above, da = 1, p = 1 and a
  // probability that rounds dq
  for (float g : all_finite_bf16())
    for (float u : kUps) {
      check(g, u, 1.0f, 1.0f);
      check(g, u, -0.375f, 0.3f);
    }
  // 4M random binary32 pairs, |x| in [2^-12, 2^5): mostly inside the clamp, many beyond
  Rng rng(91);
  auto rnd = [&] {
    return static_cast<float>(rng.sign() * std::ldexp(1.0 + rng.uniform(), rng.uniform_int(-12, 4)));
  };
  for (int i = 0; i < 4000000; ++i) check(rnd(), rnd(), rnd(), static_cast<float>(rng.uniform(0.01, 1.0)));
  std::printf("[ measure  ] clamped swiglu (alpha 1.702, limit 7), %lld points: act %.3f ulp (at gate %.9g), "
              "dup %.3f ulp (z >= -87); abs 2^%.1f below; dgate %.3f * 2^-24 * scale (at gate %.9g)\n",
              static_cast<long long>(n), worst_a, at_a, worst_u, std::log2(worst_abs + 1e-300), worst_g, at_g);
  EXPECT_LE(worst_a, 4.0) << "at gate " << at_a;
  EXPECT_LE(worst_u, 4.5);
  EXPECT_LE(worst_abs, std::ldexp(1.0, -136));
  EXPECT_LE(worst_g, 7.0) << "at gate " << at_g;
}

// ================================================================================================
// (b) the gradient masks: torch.clamp's gradient (the bound itself passes it)
// ================================================================================================
TEST(SwigluAct, ClampedGradientMasks) {
  const GatedActivation act = clamped();
  const float above = std::nextafter(7.0f, 100.0f);
  const float ups[] = {-3.0f, -1.0f, 0.0f, 0.5f, 6.5f, 7.0f, -7.0f};
  const float gates[] = {-40.0f, -3.0f, -1.2784645f, 0.0f, 1.0f, 6.5f, 7.0f};
  for (float u : ups) {
    // gate > limit: no gradient, and the value of gate = limit
    for (float g : {above, 7.03125f, 8.0f, 1e30f, INFINITY}) {
      const num::SwigluGradProb d = num::dact_prob_f32(act, 1.5f, 0.75f, g, u);
      EXPECT_EQ(bits(d.dgate), 0u) << "gate " << g << " up " << u;
      EXPECT_EQ(bits(num::act_f32(act, g, u)), bits(num::act_f32(act, 7.0f, u))) << g;
      EXPECT_EQ(bits(d.dup), bits(num::dact_prob_f32(act, 1.5f, 0.75f, 7.0f, u).dup)) << g;
      EXPECT_EQ(bits(num::dact_f32(act, 1.5f, g, u).dgate), 0u) << g;
    }
    // gate == limit passes it: (u + 1) * sigmoid(z) * (1 + z (1 - sigmoid(z))), nonzero unless u = -1
    const num::SwigluGradProb d = num::dact_prob_f32(act, 1.5f, 0.75f, 7.0f, u);
    const Clamped64 w = clamped64(act, 7.0f, u, 1.5 * 0.75);
    EXPECT_NEAR(d.dgate, w.dgate, 1e-6 * std::fabs(w.dgate)) << "up " << u;
    if (u != -1.0f) EXPECT_NE(d.dgate, 0.0f) << "up " << u;
  }
  for (float g : gates) {
    // |up| > limit: no gradient, and the value of up = +-limit
    for (float u : {above, -above, 7.03125f, -7.03125f, 50.0f, -1e30f, INFINITY, -INFINITY}) {
      const float lim = u > 0 ? 7.0f : -7.0f;
      const num::SwigluGradProb d = num::dact_prob_f32(act, -2.0f, 0.5f, g, u);
      EXPECT_EQ(bits(d.dup), 0u) << "gate " << g << " up " << u;
      EXPECT_EQ(bits(num::act_f32(act, g, u)), bits(num::act_f32(act, g, lim))) << u;
      EXPECT_EQ(bits(d.dgate), bits(num::dact_prob_f32(act, -2.0f, 0.5f, g, lim).dgate)) << u;
      EXPECT_EQ(bits(num::dact_f32(act, -2.0f, g, u).dup), 0u) << u;
    }
    // up == +-limit passes it: dq * glu, glu = g * sigmoid(alpha g) = act(g, 0), nonzero unless g = 0
    for (float u : {7.0f, -7.0f}) {
      const num::SwigluGradProb d = num::dact_prob_f32(act, -2.0f, 0.5f, g, u);
      EXPECT_EQ(bits(d.dup), bits(num::f_mul(-1.0f, num::act_f32(act, g, 0.0f)))) << "gate " << g << " up " << u;
      if (g != 0.0f) EXPECT_NE(d.dup, 0.0f) << "gate " << g << " up " << u;
    }
  }
  // the masks zero the gradient even where dA is not finite (torch's clamp backward selects 0)
  EXPECT_EQ(bits(num::dact_f32(act, NAN, 9.0f, 9.0f).dgate), 0u);
  EXPECT_EQ(bits(num::dact_f32(act, INFINITY, 9.0f, 9.0f).dup), 0u);
  // another limit and alpha: the mask follows act.limit
  const GatedActivation a3 = clamped(1.0f, 3.0f);
  EXPECT_EQ(bits(num::dact_f32(a3, 1.0f, 3.5f, 0.0f).dgate), 0u);
  EXPECT_NE(num::dact_f32(a3, 1.0f, 3.0f, 0.0f).dgate, 0.0f);
  EXPECT_EQ(bits(num::dact_f32(a3, 1.0f, 1.0f, -3.5f).dup), 0u);
  EXPECT_NE(num::dact_f32(a3, 1.0f, 1.0f, -3.0f).dup, 0.0f);
}

// ================================================================================================
// (c) kSwiglu: exactly the bits of the SwiGLU-only functions
// ================================================================================================
TEST(SwigluAct, SwigluKindIsTheOldFunctionsBitForBit) {
  GatedActivation odd;  // kSwiglu ignores alpha and limit
  odd.alpha = 3.0f;
  odd.limit = 0.5f;
  const GatedActivation kinds[] = {GatedActivation{}, odd};
  const float das[] = {1.0f, -0.375f, 3e38f, NAN, INFINITY};
  const float ps[] = {1.0f, 0.3f, 0.0f, 1e-30f};
  int64_t n = 0, bad = 0;
  for (const GatedActivation& act : kinds) {
    ASSERT_FALSE(act.clamped());
    for (float g : all_finite_bf16()) {
      for (float u : {0.0f, -1.0f, 0.5f, 7.5f, -30.0f, 3e38f, INFINITY, NAN}) {
        bad += bits(num::act_f32(act, g, u)) != bits(num::swiglu_f32(g, u));
        for (float da : das) {
          const num::SwigluGrad d0 = num::dswiglu_f32(da, g, u), d1 = num::dact_f32(act, da, g, u);
          bad += bits(d0.dgate) != bits(d1.dgate) || bits(d0.dup) != bits(d1.dup);
          for (float p : ps) {
            const num::SwigluGradProb e0 = num::dswiglu_prob_f32(da, p, g, u);
            const num::SwigluGradProb e1 = num::dact_prob_f32(act, da, p, g, u);
            bad += bits(e0.dgate) != bits(e1.dgate) || bits(e0.dup) != bits(e1.dup) || bits(e0.a) != bits(e1.a);
          }
          ++n;
        }
      }
    }
  }
  EXPECT_EQ(bad, 0) << "of " << n << " points";
}

// ================================================================================================
// (d) non-finite input
// ================================================================================================
TEST(SwigluAct, ClampedNonFiniteInputs) {
  const GatedActivation act = clamped();
  const float sp[] = {0.0f, -0.0f, 1.0f, -1.0f, 6.5f, 7.0f, -7.0f, 8.0f, -8.0f, -60.0f, 1e30f, -1e30f,
                      INFINITY, -INFINITY, NAN};
  for (float x : sp) {
    // a NaN gate or up is never clamped: NaN act, and a NaN gradient for gate (it sees up and gate)
    EXPECT_TRUE(std::isnan(num::act_f32(act, NAN, x))) << "up " << x;
    EXPECT_TRUE(std::isnan(num::act_f32(act, x, NAN))) << "gate " << x;
    EXPECT_TRUE(std::isnan(num::dact_f32(act, 1.0f, NAN, x).dgate)) << "up " << x;
    EXPECT_TRUE(std::isnan(num::dact_f32(act, 1.0f, NAN, x).dup) || x > 7.0f || x < -7.0f) << "up " << x;
    EXPECT_TRUE(std::isnan(num::dact_f32(act, 1.0f, x, NAN).dgate) || x > 7.0f) << "gate " << x;
    EXPECT_TRUE(std::isnan(num::dact_prob_f32(act, 1.0f, 0.5f, x, NAN).a)) << "gate " << x;
    EXPECT_EQ(num::bf16_canonical(num::act_f32(act, NAN, x)), 0x7FC0);
    // +inf gate and +-inf up are clamped to the limit like any large value (as the model does)
    EXPECT_EQ(bits(num::act_f32(act, INFINITY, x)), bits(num::act_f32(act, 7.0f, x))) << "up " << x;
    if (!std::isnan(x)) {
      EXPECT_EQ(bits(num::act_f32(act, x, INFINITY)), bits(num::act_f32(act, x, 7.0f))) << "gate " << x;
      EXPECT_EQ(bits(num::act_f32(act, x, -INFINITY)), bits(num::act_f32(act, x, -7.0f))) << "gate " << x;
    }
    // -inf gate: -inf * sigmoid(-inf) = -inf * 0 = NaN (as in float arithmetic in the model)
    EXPECT_TRUE(std::isnan(num::act_f32(act, -INFINITY, x))) << "up " << x;
  }
  EXPECT_TRUE(std::isfinite(num::act_f32(act, INFINITY, 3.0f)));
  EXPECT_EQ(bits(num::dact_f32(act, 1.0f, INFINITY, 3.0f).dgate), 0u);
  EXPECT_TRUE(std::isfinite(num::dact_f32(act, 1.0f, INFINITY, 3.0f).dup));
  // A finite gate below -FLT_MAX / alpha overflows z = alpha * g to -inf: act is -0 * (u + 1),
  // and dgate's s * fma(z, 1 - s, 1) is 0 * -inf = NaN (docs/SWIGLU.md §11).
  EXPECT_EQ(num::act_f32(act, -3e38f, 2.0f), 0.0f);
  EXPECT_TRUE(std::isnan(num::dact_f32(act, 1.0f, -3e38f, 2.0f).dgate));
  EXPECT_EQ(num::dact_f32(act, 1.0f, -1e38f, 2.0f).dgate, 0.0f);
}

// ================================================================================================
// (e) the cpu:: operators with the clamped activation == a direct loop over the shared functions
// ================================================================================================
// H: N(0, 1) * 6 in BF16 (about 24% of the values beyond +-7), with the clamp's boundary values
// and (when `specials`) NaN and +-inf sprinkled in; rows r % 7 == 1 all zero (padding rows).
std::vector<bf16_t> make_h(int64_t m, int64_t cols, uint64_t seed, bool specials) {
  auto h = flowmoe_test::make_bf16(flowmoe_test::HDist::kNormal, m, cols, seed, 7);
  const float sp[] = {7.0f, -7.0f, 7.03125f, -7.03125f, -1.0f, INFINITY, -INFINITY, NAN};
  for (size_t i = 0; i < h.size(); ++i) {
    h[i] = num::bf16_canonical(6.0f * bf(h[i]));
    if (i % 23 == 5 && h[i] != 0) h[i] = num::bf16_canonical(sp[(i / 23) % (specials ? 8 : 5)]);
  }
  return h;
}

struct ActCase {
  std::string name;
  std::vector<int32_t> counts;
  int64_t f;
  bool prob, specials;
  int64_t m() const {
    int64_t s = 0;
    for (int32_t c : counts) s += c;
    return s;
  }
};
std::ostream& operator<<(std::ostream& os, const ActCase& c) { return os << c.name; }

class SwigluActTensors : public ::testing::TestWithParam<ActCase> {};

void expect_same(const QTensor& want, const QTensor& got, const std::string& what) {
  EXPECT_EQ(want.layout, got.layout) << what;
  EXPECT_EQ(want.codes, got.codes) << what;
  EXPECT_EQ(want.scales, got.scales) << what;
}
std::vector<float> make_prow(int64_t m, bool prob) {
  if (!prob) return {};
  std::vector<float> p(m);
  for (int64_t t = 0; t < m; ++t) p[t] = t % 9 == 4 ? 0.0f : 0.05f + 0.9f * static_cast<float>((t * 37) % 101) / 101;
  return p;
}

TEST_P(SwigluActTensors, ForwardEqualsDirectLoop) {
  const ActCase& c = GetParam();
  const int64_t m = c.m(), f = c.f;
  const GatedActivation act = clamped();
  const Segments seg = Segments::from_counts(c.counts);
  const auto h = make_h(m, 2 * f, 700 + m, c.specials);
  const auto prow = make_prow(m, c.prob);
  const float* pp = c.prob ? prow.data() : nullptr;

  // the direct loop: binary32 A' and its BF16 rounding
  std::vector<float> want(m * f);
  std::vector<bf16_t> want16(m * f);
  int64_t bad16 = 0;
  for (int64_t t = 0; t < m; ++t)
    for (int64_t j = 0; j < f; ++j) {
      float a = num::act_f32(act, bf(h[t * 2 * f + j]), bf(h[t * 2 * f + f + j]));
      if (pp) a = num::f_mul(a, pp[t]);
      want[t * f + j] = a;
      want16[t * f + j] = num::bf16_canonical(a);
      bad16 += !std::isfinite(bf(want16[t * f + j]));
    }
  std::vector<float> a32(m * f);
  std::vector<bf16_t> a16(m * f);
  cpu::swiglu(h.data(), m, f, a32.data(), pp, act);
  const QuantStats st16 = cpu::swiglu(h.data(), m, f, a16.data(), pp, act);
  for (int64_t i = 0; i < m * f; ++i) {
    const uint32_t nan = std::isnan(want[i]) ? 0x7FFFFFFFu : 0u;  // any NaN
    ASSERT_EQ(bits(a32[i]) | nan, bits(want[i]) | nan) << i;
  }
  EXPECT_EQ(a16, want16);
  EXPECT_EQ(st16.nonfinite, bad16);

  // quantized: quantize_row of the binary32 values, its scaling-aware transpose, H quantized
  QTensor want_row, want_col, want_h, row, col, hq;
  const QuantStats sr = cpu::quantize_row(want.data(), m, f, &want_row);
  const QuantStats stt = cpu::scaling_aware_transpose(want_row, seg, &want_col);
  std::vector<bf16_t> hsv(h.size());  // H as saved: beyond-limit values marked (cpu::saved_h)
  cpu::saved_h(h.data(), m, f, hsv.data(), act);
  const QuantStats sh = cpu::quantize_row(hsv.data(), m, 2 * f, &want_h);
  const QuantStats st = cpu::swiglu_quant(h.data(), m, f, &row, &seg, &col, &hq, pp, act);
  expect_same(want_row, row, "A row-wise");
  expect_same(want_col, col, "A column-wise");
  expect_same(want_h, hq, "H row-wise");
  EXPECT_EQ(st.nonfinite, sr.nonfinite + sh.nonfinite);
  EXPECT_EQ(st.underflow, stt.underflow);
  if (c.specials) EXPECT_GT(sr.nonfinite, 0) << "NaN gate/up, -inf gate";
  // the clamp is real: the default activation gives other values
  std::vector<float> plain(m * f);
  cpu::swiglu(h.data(), m, f, plain.data(), pp);
  int64_t differ = 0;
  for (int64_t i = 0; i < m * f; ++i) differ += plain[i] != want[i];
  EXPECT_GT(differ, m * f / 10);
}

// dH and the dprow parts of H given as gate(t, j) / up(t, j) accessors, by the direct loop in
// swiglu.h's order (pair value fma(d1, a1, fma(d0, a0, 0)), pairwise tree over the 16 groups of each
// pair position, then (R0 + R1) + (R2 + R3)).
template <typename Gate, typename Up>
void direct_backward(const std::vector<bf16_t>& da, int64_t m, int64_t f, const float* prow, Gate gate, Up up,
                     std::vector<bf16_t>* dh, std::vector<float>* part) {
  const GatedActivation act = clamped();
  dh->assign(m * 2 * f, 0);
  part->assign(m * (f / 128), 0.0f);
  for (int64_t t = 0; t < m; ++t)
    for (int64_t b = 0; b < f / 128; ++b) {
      float pair[16][4];
      for (int g = 0; g < 16; ++g)
        for (int q = 0; q < 4; ++q) {
          float acc = 0.0f;
          for (int i = 0; i < 2; ++i) {
            const int64_t j = b * 128 + 8 * g + 2 * q + i;
            const float d = bf(da[t * f + j]);
            float dg, du;
            if (prow) {
              const num::SwigluGradProb r = num::dact_prob_f32(act, d, prow[t], gate(t, j), up(t, j));
              dg = r.dgate, du = r.dup;
              acc = num::f_fma(d, r.a, acc);
            } else {
              const num::SwigluGrad r = num::dact_f32(act, d, gate(t, j), up(t, j));
              dg = r.dgate, du = r.dup;
            }
            (*dh)[t * 2 * f + j] = num::bf16_canonical(dg);
            (*dh)[t * 2 * f + f + j] = num::bf16_canonical(du);
          }
          pair[g][q] = acc;
        }
      for (int w = 1; w < 16; w *= 2)
        for (int g = 0; g < 16; g += 2 * w)
          for (int q = 0; q < 4; ++q) pair[g][q] = num::f_add(pair[g][q], pair[g + w][q]);
      (*part)[b * m + t] =
          num::f32_canonical(num::f_add(num::f_add(pair[0][0], pair[0][1]), num::f_add(pair[0][2], pair[0][3])));
    }
}

std::vector<uint32_t> f32_bits_of(const std::vector<float>& v) {
  std::vector<uint32_t> b(v.size());
  for (size_t i = 0; i < v.size(); ++i) b[i] = bits(v[i]);
  return b;
}

TEST_P(SwigluActTensors, BackwardEqualsDirectLoop) {
  const ActCase& c = GetParam();
  const int64_t m = c.m(), f = c.f, k = 2 * f, tiles = f / 128;
  const GatedActivation act = clamped();
  const Segments seg = Segments::from_counts(c.counts);
  const auto h = make_h(m, k, 800 + m, c.specials);
  auto da = flowmoe_test::make_bf16(flowmoe_test::HDist::kHeavy, m, f, 900 + m, 7);
  if (c.specials)
    for (size_t i = 5; i < da.size(); i += 499) da[i] = num::bf16_canonical(i % 2 ? NAN : -INFINITY);
  const auto prow = make_prow(m, c.prob);
  const float* pp = c.prob ? prow.data() : nullptr;

  // H in BF16, H as row-wise FP8, H as MXFP4: each decoded exactly, then the same loop
  QTensor h8, h4;
  cpu::quantize_row(h.data(), m, k, &h8);
  cpu::quantize_mxfp4(h.data(), m, k, &h4);
  std::vector<float> hd8(m * k), hd4(m * k);
  cpu::dequantize(h8, hd8.data());
  cpu::dequantize(h4, hd4.data());
  for (int src = 0; src < 3; ++src) {
    const std::string what = src == 0 ? "BF16 H" : src == 1 ? "FP8 H" : "MXFP4 H";
    auto at = [&](int64_t t, int64_t col) {
      return src == 0 ? bf(h[t * k + col]) : src == 1 ? hd8[t * k + col] : hd4[t * k + col];
    };
    std::vector<bf16_t> want;
    std::vector<float> want_part;
    direct_backward(
        da, m, f, pp, [&](int64_t t, int64_t j) { return at(t, j); },
        [&](int64_t t, int64_t j) { return at(t, f + j); }, &want, &want_part);
    int64_t bad = 0;
    for (bf16_t v : want) bad += !std::isfinite(bf(v));

    std::vector<bf16_t> dh(m * k);
    std::vector<float> part(m * tiles, -1.0f), part2(m * tiles, -1.0f);
    float* pout = pp ? part.data() : nullptr;
    const QuantStats st = src == 0 ? cpu::dswiglu(da.data(), h.data(), m, f, dh.data(), pp, pout, act)
                                   : cpu::dswiglu(da.data(), src == 1 ? h8 : h4, dh.data(), pp, pout, act);
    EXPECT_EQ(dh, want) << what;
    EXPECT_EQ(st.nonfinite, bad) << what;
    if (pp) EXPECT_EQ(f32_bits_of(part), f32_bits_of(want_part)) << what << ": dprow parts";

    QTensor want_row, want_col, row, col;
    cpu::quantize_row(want.data(), m, k, &want_row);
    cpu::quantize_col(want.data(), m, k, seg, &want_col);
    float* pout2 = pp ? part2.data() : nullptr;
    const QuantStats sq =
        src == 0 ? cpu::dswiglu_quant(da.data(), h.data(), m, f, seg, &row, &col, pp, pout2, act)
                 : cpu::dswiglu_quant(da.data(), src == 1 ? h8 : h4, seg, &row, &col, pp, pout2, act);
    expect_same(want_row, row, what + ": dH row-wise");
    expect_same(want_col, col, what + ": dH column-wise");
    EXPECT_EQ(sq.nonfinite, bad) << what;
    if (pp) EXPECT_EQ(f32_bits_of(part2), f32_bits_of(want_part)) << what << ": dprow parts (fused)";
    if (c.specials) EXPECT_GT(bad, 0) << what;
  }
}

INSTANTIATE_TEST_SUITE_P(Cases, SwigluActTensors,
                         ::testing::Values(ActCase{"m1", {1}, 128, false, false},
                                           ActCase{"m1_prob", {1}, 128, true, true},
                                           ActCase{"m37", {0, 37}, 256, false, true},
                                           ActCase{"m37_prob", {20, 0, 17}, 256, true, false},
                                           ActCase{"m300_prob", {129, 0, 1, 170}, 384, true, true},
                                           ActCase{"m300", {300}, 128, false, false}),
                         [](const ::testing::TestParamInfo<ActCase>& i) { return i.param.name; });

TEST(SwigluAct, BadActivationIsRejected) {
  const std::vector<bf16_t> h(2 * 256, 0x3F80), da(2 * 128, 0x3F80);
  std::vector<bf16_t> out(2 * 256);
  auto expect_error = [](auto fn, const std::string& needle) {
    try {
      fn();
      ADD_FAILURE() << "expected an error mentioning \"" << needle << "\"";
    } catch (const flowmoe::Error& e) {
      EXPECT_NE(std::string(e.what()).find(needle), std::string::npos) << e.what();
    }
  };
  expect_error([&] { cpu::swiglu(h.data(), 2, 128, out.data(), nullptr, clamped(1.702f, 0.0f)); }, "limit > 0");
  expect_error([&] { cpu::swiglu(h.data(), 2, 128, out.data(), nullptr, clamped(NAN, 7.0f)); }, "finite alpha");
  expect_error([&] { cpu::dswiglu(da.data(), h.data(), 2, 128, out.data(), nullptr, nullptr, clamped(1.0f, -1.0f)); },
               "limit > 0");
  GatedActivation unknown;
  unknown.kind = static_cast<ActivationKind>(7);
  expect_error([&] { cpu::dswiglu(da.data(), h.data(), 2, 128, out.data(), nullptr, nullptr, unknown); },
               "unknown activation kind");
  // a limit of +inf never clamps: the plain gated form (u + 1) * g * sigmoid(alpha g)
  EXPECT_NO_THROW(cpu::swiglu(h.data(), 2, 128, out.data(), nullptr, clamped(1.0f, INFINITY)));
}

// The activations as data (kActivations): every row's name gives its kind back, alpha / limit
// only where the row takes them; an unknown name is refused with the known ones listed; a config
// describes itself with the row's name.
TEST(ActivationTable, NamesAndKindsRoundTrip) {
  for (const ActivationRow& r : kActivations) {
    const GatedActivation a = activation_from_name(r.name, 2.5f, 3.5f, "test");
    EXPECT_EQ(a.kind, r.kind) << r.name;
    EXPECT_STREQ(activation_name(r.kind), r.name);
    EXPECT_EQ(a.alpha, r.takes_alpha_limit ? 2.5f : GatedActivation().alpha) << r.name;
    EXPECT_EQ(a.limit, r.takes_alpha_limit ? 3.5f : GatedActivation().limit) << r.name;
  }
  EXPECT_EQ(activation_name(static_cast<ActivationKind>(7)), nullptr);
  try {
    activation_from_name("gelu-gated", 1.0f, 1.0f, "test");
    ADD_FAILURE() << "an unknown activation name was accepted";
  } catch (const flowmoe::Error& e) {
    const std::string m = e.what();
    EXPECT_NE(m.find("'gelu-gated' is unknown"), std::string::npos) << m;
    for (const ActivationRow& r : kActivations) EXPECT_NE(m.find(r.name), std::string::npos) << m;
  }
  MoeConfig cfg;
  cfg.activation = activation_from_name("clamped-swiglu", 1.702f, 7.0f, "test");
  EXPECT_NE(cfg.describe().find("clamped-swiglu(alpha=1.702,limit=7)"), std::string::npos) << cfg.describe();
}

}  // namespace
