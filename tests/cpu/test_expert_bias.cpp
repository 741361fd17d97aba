// Expert biases and the clamped SwiGLU in the CPU layer (issue 46; flowmoe/expert_bias.h): the
// operators against plain loops, the layer with a zero bias against the layer without one (same
// bits), a bias that moves the output, and the configuration's refusals.
#include <gtest/gtest.h>

#include <algorithm>
#include <cmath>
#include <memory>
#include <random>
#include <string>
#include <vector>

#include "common/moe_config.h"
#include "common/routed_problem.h"
#include "flowmoe/cpu/convert.h"
#include "flowmoe/error.h"
#include "flowmoe/expert_bias.h"
#include "flowmoe/moe.h"
#include "flowmoe/numerics.h"
#include "flowmoe/swiglu.h"

namespace flowmoe {
namespace {

Segments segs(std::vector<int32_t> offsets) {
  Segments s;
  s.offsets = std::move(offsets);
  return s;
}

TEST(ExpertBias, AddIsOneRoundingPerElement) {
  const Segments seg = segs({0, 3, 3, 7});
  const int64_t m = 7, n = 8;
  std::mt19937 rng(1);
  std::normal_distribution<float> nd(0.0f, 4.0f);
  std::vector<bf16_t> h(m * n);
  std::vector<float> b(3 * n);
  for (auto& v : h) v = num::f32_to_bf16(nd(rng));
  for (auto& v : b) v = nd(rng);
  h[5] = 0x7FC1;  // a NaN payload comes out canonical
  std::vector<bf16_t> out = h;
  cpu::add_expert_bias(out.data(), m, n, seg, b.data());
  for (int64_t r = 0; r < m; ++r) {
    const int e = r < 3 ? 0 : 2;
    for (int64_t c = 0; c < n; ++c) {
      const double exact = double(num::bf16_to_f32(h[r * n + c])) + double(b[e * n + c]);
      const float want = static_cast<float>(static_cast<float>(exact));  // binary32 add is exact-then-round
      if (r * n + c == 5) {
        EXPECT_EQ(out[5], 0x7FC0);
        continue;
      }
      EXPECT_EQ(out[r * n + c], num::f32_to_bf16(want)) << r << "," << c;
    }
  }
}

// The order of expert_bias.h: 128-row blocks from each segment's first row, each summed in row
// order, the blocks' sums added in block order (segment 2 holds 3 blocks, the last one partial).
TEST(ExpertBias, GradIsTheRowSumPerSegment) {
  const Segments seg = segs({0, 128, 128, 440});
  const int64_t m = 440, n = 256;
  std::mt19937 rng(2);
  std::normal_distribution<float> nd(0.0f, 1.0f);
  std::vector<bf16_t> dh(m * n);
  for (auto& v : dh) v = num::f32_to_bf16(nd(rng));
  std::vector<float> db(3 * n, 5.0f), acc(3 * n, 5.0f);
  cpu::expert_bias_grad(dh.data(), m, n, seg, db.data(), false);
  cpu::expert_bias_grad(dh.data(), m, n, seg, acc.data(), true);
  for (int e = 0; e < 3; ++e)
    for (int64_t c = 0; c < n; ++c) {
      float s = 0.0f;
      double d = 0.0;
      for (int64_t b = seg.offsets[e]; b < seg.offsets[e + 1]; b += 128) {
        float p = 0.0f;
        for (int64_t r = b; r < std::min<int64_t>(b + 128, seg.offsets[e + 1]); ++r) {
          p += num::bf16_to_f32(dh[r * n + c]);
          d += num::bf16_to_f32(dh[r * n + c]);
        }
        s += p;
      }
      ASSERT_EQ(num::f32_bits(db[e * n + c]), num::f32_bits(s)) << e << "," << c;
      ASSERT_EQ(num::f32_bits(acc[e * n + c]), num::f32_bits(5.0f + s)) << e << "," << c;
      ASSERT_NEAR(db[e * n + c], d, 1e-4 * (1 + std::fabs(d)));
    }
  // the FP8 row copy: the sum of its exactly decoded values
  QTensor q;
  cpu::quantize_row(dh.data(), m, n, &q);
  std::vector<float> db8(3 * n);
  cpu::expert_bias_grad(q, seg, db8.data(), false);
  std::vector<float> deq(m * n);
  cpu::dequantize(q, deq.data());
  for (int e = 0; e < 3; ++e)
    for (int64_t c = 0; c < n; ++c) {
      float s = 0.0f;
      for (int64_t b = seg.offsets[e]; b < seg.offsets[e + 1]; b += 128) {
        float p = 0.0f;
        for (int64_t r = b; r < std::min<int64_t>(b + 128, seg.offsets[e + 1]); ++r) p += deq[r * n + c];
        s += p;
      }
      ASSERT_EQ(num::f32_bits(db8[e * n + c]), num::f32_bits(s)) << e << "," << c;
    }
}

// The flow recipes' saved h keeps the clamp's decision: after FP8 quantization of the saved copy, a
// gate is above the limit (an up beyond +-limit) exactly when the forward's was, for values around
// gpt-oss's limit 7; after MXFP4 every value beyond the limit still is.
TEST(SavedH, QuantizedCopyKeepsTheClampDecision) {
  GatedActivation act;
  act.kind = ActivationKind::kClampedSwiglu;
  const int64_t m = 64, f = 128;
  std::mt19937 rng(4);
  std::uniform_real_distribution<float> ud(5.0f, 9.0f);
  std::vector<bf16_t> h(m * 2 * f);
  for (size_t i = 0; i < h.size(); ++i) h[i] = num::f32_to_bf16((i % 3 == 0 ? -1.0f : 1.0f) * ud(rng));
  std::vector<bf16_t> hs(h.size());
  cpu::saved_h(h.data(), m, f, hs.data(), act);
  for (bool fp4 : {false, true}) {
    QTensor q;
    if (fp4) cpu::quantize_mxfp4(hs.data(), m, 2 * f, &q);
    else cpu::quantize_row(hs.data(), m, 2 * f, &q);
    std::vector<float> d(h.size());
    cpu::dequantize(q, d.data());
    for (int64_t t = 0; t < m; ++t)
      for (int64_t j = 0; j < 2 * f; ++j) {
        const float x = num::bf16_to_f32(h[t * 2 * f + j]), y = d[t * 2 * f + j];
        const bool beyond = j < f ? x > act.limit : std::fabs(x) > act.limit;
        const bool seen = j < f ? y > act.limit : std::fabs(y) > act.limit;
        // FP8 keeps both directions (the limit is on its grid); MXFP4's coarser grid may round a
        // value at or within the limit past it (7 -> 8 at scale 2^2), never one beyond back inside
        if (fp4 && !beyond) continue;
        ASSERT_EQ(beyond, seen) << (fp4 ? "mxfp4 " : "fp8 ") << (j < f ? "gate " : "up ") << x << " saved as " << y;
      }
  }
  GatedActivation plain;
  cpu::saved_h(h.data(), m, f, hs.data(), plain);
  EXPECT_EQ(h, hs);  // SwiGLU saves h itself
}

struct Out {
  std::vector<bf16_t> y, dx;
  std::vector<float> dw1, db1;
};

Out run(const MoeConfig& cfg, const flowmoe_test::RoutedProblem& p, const std::vector<float>* b1) {
  std::unique_ptr<MoeLayer> l = make_cpu_layer(cfg);
  l->set_weights(MoeWeights{p.w1.data(), p.w2.data(), nullptr, nullptr});
  l->set_routing(p.ids.data(), p.probs.data());
  if (b1) l->set_gemm1_bias(b1->data());
  Out o;
  o.y.resize(p.T * cfg.hidden);
  o.dx.resize(p.T * cfg.hidden);
  o.dw1.resize(p.w1.size());
  o.db1.resize(b1 ? b1->size() : 0);
  l->forward(p.x.data(), p.T, o.y.data());
  std::vector<float> dw2(p.w2.size()), dprobs(p.probs.size());
  MoeGrads g{o.dw1.data(), dw2.data(), nullptr, false};
  g.dprobs = dprobs.data();
  if (b1) g.db1 = o.db1.data();
  l->backward(p.dy.data(), o.dx.data(), g);
  return o;
}

class ExpertBiasLayer : public ::testing::TestWithParam<Recipe> {};

TEST_P(ExpertBiasLayer, ZeroBiasSameBitsAndABiasMovesTheOutput) {
  constexpr int64_t H = 128, F = 256, T = 40;
  MoeConfig cfg = flowmoe_test::moe_config(H, F, 4, 2).align(16).recipe(GetParam()).max_tokens(T);
  const flowmoe_test::RoutedProblem p = flowmoe_test::make_routed_problem(cfg, T, 9);
  cfg.external_routing = true;
  for (bool clamped : {false, true}) {
    SCOPED_TRACE(clamped ? "clamped SwiGLU" : "SwiGLU");
    MoeConfig c = cfg;
    if (clamped) c.activation.kind = ActivationKind::kClampedSwiglu;
    const Out plain = run(c, p, nullptr);
    c.gemm1_bias = true;
    const std::vector<float> zero(size_t(4) * 2 * F, 0.0f);
    const Out z = run(c, p, &zero);
    EXPECT_EQ(plain.y, z.y);
    EXPECT_EQ(plain.dx, z.dx);
    EXPECT_EQ(plain.dw1, z.dw1);
    std::vector<float> b1(zero.size());
    std::mt19937 rng(3);
    std::normal_distribution<float> nd(0.0f, 0.5f);
    for (float& v : b1) v = nd(rng);
    const Out wb = run(c, p, &b1);
    EXPECT_NE(plain.y, wb.y);
    double n2 = 0;
    for (float v : wb.db1) n2 += double(v) * v;
    EXPECT_GT(n2, 0.0);
  }
}

INSTANTIATE_TEST_SUITE_P(Recipes, ExpertBiasLayer,
                         ::testing::Values(Recipe::kBf16, Recipe::kBlockwise, Recipe::kFlow, Recipe::kFlowFp4),
                         [](const ::testing::TestParamInfo<Recipe>& p) {  // "flow_fp4": names are [A-Za-z0-9_]
                           std::string n = flowmoe::recipe_name(p.param);
                           for (char& c : n)
                             if (c == '-') c = '_';
                           return n;
                         });

TEST(ExpertBiasLayer, Refusals) {
  MoeConfig cfg = flowmoe_test::moe_config(128, 128, 4, 2).recipe(Recipe::kFp8Naive).max_tokens(8);
  cfg.external_routing = true;
  cfg.gemm1_bias = true;
  EXPECT_THROW(make_cpu_layer(cfg), Error);  // fp8-naive
  cfg.recipe = Recipe::kFlow;
  cfg.activation.kind = ActivationKind::kClampedSwiglu;
  cfg.activation.limit = 0.0f;
  EXPECT_THROW(make_cpu_layer(cfg), Error);  // limit must be > 0
  cfg.activation.limit = 7.0f;
  std::unique_ptr<MoeLayer> l = make_cpu_layer(cfg);
  std::vector<float> w1(4 * 256 * 128, 0.01f), w2(4 * 128 * 128, 0.01f);
  l->set_weights(MoeWeights{w1.data(), w2.data(), nullptr, nullptr});
  std::vector<int32_t> ids(16, 0);
  std::vector<float> probs(16, 0.5f);
  std::vector<bf16_t> x(8 * 128, 0), y(8 * 128);
  l->set_routing(ids.data(), probs.data());
  EXPECT_THROW(l->forward(x.data(), 8, y.data()), Error);  // no set_gemm1_bias
  // a bias given to a forward refused by its checks is not kept for the next one
  std::vector<float> b1(4 * 256, 0.0f);
  l->set_routing(ids.data(), probs.data());
  l->set_gemm1_bias(b1.data());
  EXPECT_THROW(l->forward(x.data(), 9, y.data()), Error);  // T > max_tokens
  l->set_routing(ids.data(), probs.data());
  EXPECT_THROW(l->forward(x.data(), 8, y.data()), Error);  // the refused forward's bias is gone
  l->set_routing(ids.data(), probs.data());
  l->set_gemm1_bias(b1.data());
  EXPECT_NO_THROW(l->forward(x.data(), 8, y.data()));
  cfg.gemm1_bias = false;
  std::unique_ptr<MoeLayer> nb = make_cpu_layer(cfg);
  EXPECT_THROW(nb->set_gemm1_bias(w1.data()), Error);  // a layer without biases
}

}  // namespace
}  // namespace flowmoe
