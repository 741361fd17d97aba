// The experts-only layer (MoeConfig::external_routing, issue 31) on the CPU: given the full layer's
// own routing it gives the full layer's bits (y, dW1, dW2, dprobs; dx once the router path is
// added back), in every recipe and router; dropped slots; several forwards in flight; the errors.
#include <gtest/gtest.h>

#include <cmath>
#include <cstring>
#include <functional>
#include <memory>
#include <string>
#include <vector>

#include "common/moe_config.h"
#include "common/routed_problem.h"
#include "flowmoe/error.h"
#include "flowmoe/moe.h"
#include "flowmoe/numerics.h"

using flowmoe::bf16_t;
using flowmoe::MoeConfig;
using flowmoe::Recipe;
using flowmoe::RouterScore;
using flowmoe_test::RoutedProblem;

namespace {

struct Out {
  std::vector<bf16_t> y, dx;
  std::vector<float> dw1, dw2, dwr, dprobs;
};

std::vector<bf16_t> rne_bf16(const std::vector<float>& v) {
  std::vector<bf16_t> out(v.size());
  for (size_t i = 0; i < v.size(); ++i) out[i] = flowmoe::num::f32_to_bf16(v[i]);
  return out;
}

// The full layer (external = false) or the experts-only layer given p's ids and probs.
// bf16_params: W1, W2 given as BF16 parameters (the RNE of p's masters, MoeWeights::w1_bf16).
Out run(const RoutedProblem& p, bool external, int passes = 1, bool bf16_params = false) {
  MoeConfig cfg = p.cfg;
  cfg.external_routing = external;
  auto layer = flowmoe::make_cpu_layer(cfg);
  flowmoe::MoeWeights w;
  const std::vector<bf16_t> w1b = rne_bf16(p.w1), w2b = rne_bf16(p.w2);
  if (bf16_params) {
    w.w1_bf16 = w1b.data();
    w.w2_bf16 = w2b.data();
  } else {
    w.w1 = p.w1.data();
    w.w2 = p.w2.data();
  }
  if (!external) {
    w.wr = p.wr.data();
    w.router_bias = p.bias.empty() ? nullptr : p.bias.data();
  }
  layer->set_weights(w);
  const int64_t H = cfg.hidden, F = cfg.ffn, E = cfg.num_experts, T = p.T;
  Out o;
  o.y.resize(T * H);
  o.dx.resize(T * H);
  o.dw1.assign(E * 2 * F * H, 7.0f);
  o.dw2.assign(E * H * F, 7.0f);
  o.dwr.assign(E * H, 7.0f);
  o.dprobs.assign(T * cfg.topk, 7.0f);
  flowmoe::MoeGrads g;
  g.dw1 = o.dw1.data();
  g.dw2 = o.dw2.data();
  g.dwr = external ? nullptr : o.dwr.data();
  g.dprobs = o.dprobs.data();
  g.accumulate = false;
  for (int i = 0; i < passes; ++i) {
    if (external) layer->set_routing(p.ids.data(), p.probs.data());
    layer->forward(p.x.data(), T, o.y.data());
    layer->backward(p.dy.data(), o.dx.data(), g);
  }
  return o;
}

template <typename V>
void expect_same_bits(const V& a, const V& b, const char* what) {
  ASSERT_EQ(a.size(), b.size()) << what;
  EXPECT_EQ(0, std::memcmp(a.data(), b.data(), a.size() * sizeof(a[0]))) << what << " differs";
}

MoeConfig cfg_for(Recipe r, RouterScore score, bool renorm, float scale, int64_t T) {
  return flowmoe_test::moe_config(256, 128, 4, 2).recipe(r).align(16).router(score, renorm, scale).max_tokens(T);
}

}  // namespace

TEST(MoeRouted, SameBitsAsTheFullLayerEveryRecipe) {
  for (Recipe r : flowmoe::all_recipes()) {
    SCOPED_TRACE(flowmoe::recipe_name(r));
    const RoutedProblem p = flowmoe_test::make_routed_problem(cfg_for(r, RouterScore::kSoftmax, false, 1.0f, 37), 37, 11);
    const Out full = run(p, false), ext = run(p, true);
    expect_same_bits(ext.y, full.y, "y");
    expect_same_bits(ext.dw1, full.dw1, "dW1");
    expect_same_bits(ext.dw2, full.dw2, "dW2");
    expect_same_bits(ext.dprobs, full.dprobs, "dprobs");
    expect_same_bits(flowmoe_test::full_layer_dx(p, ext.dx, ext.dprobs), full.dx, "dx + router path");
  }
}

// BF16 parameters give the bits of FP32 masters of the same values (the layer keeps only BF16
// copies of W1 and W2), in every recipe, for the full layer (router path, dWr) and the experts-only
// layer. The masters here are not BF16 values: the layer rounds them to the same copies.
TEST(MoeRouted, Bf16ParamsSameBitsAsFp32Masters) {
  for (Recipe r : flowmoe::all_recipes()) {
    SCOPED_TRACE(flowmoe::recipe_name(r));
    const RoutedProblem p = flowmoe_test::make_routed_problem(cfg_for(r, RouterScore::kSoftmax, false, 1.0f, 37), 37, 17);
    for (bool external : {false, true}) {
      SCOPED_TRACE(external ? "experts-only layer" : "full layer");
      const Out masters = run(p, external, 1, false), params = run(p, external, 1, true);
      expect_same_bits(params.y, masters.y, "y");
      expect_same_bits(params.dx, masters.dx, "dx");
      expect_same_bits(params.dw1, masters.dw1, "dW1");
      expect_same_bits(params.dw2, masters.dw2, "dW2");
      expect_same_bits(params.dwr, masters.dwr, "dWr");
      expect_same_bits(params.dprobs, masters.dprobs, "dprobs");
    }
  }
}

// BF16 expert gradients (MoeGrads::dw1_bf16, the gradients of BF16 parameters) are the FP32 ones
// rounded once (RNE), in every recipe, for both layers; dx, dWr and dprobs are unchanged.
TEST(MoeRouted, Bf16GradsAreTheFp32GradsRounded) {
  for (Recipe r : flowmoe::all_recipes()) {
    SCOPED_TRACE(flowmoe::recipe_name(r));
    const RoutedProblem p = flowmoe_test::make_routed_problem(cfg_for(r, RouterScore::kSoftmax, false, 1.0f, 37), 37, 23);
    for (bool external : {false, true}) {
      SCOPED_TRACE(external ? "experts-only layer" : "full layer");
      const Out f32 = run(p, external, 1, true);
      MoeConfig cfg = p.cfg;
      cfg.external_routing = external;
      auto layer = flowmoe::make_cpu_layer(cfg);
      const std::vector<bf16_t> w1b = rne_bf16(p.w1), w2b = rne_bf16(p.w2);
      flowmoe::MoeWeights w;
      w.w1_bf16 = w1b.data();
      w.w2_bf16 = w2b.data();
      if (!external) w.wr = p.wr.data();
      layer->set_weights(w);
      const int64_t H = cfg.hidden, F = cfg.ffn, E = cfg.num_experts;
      std::vector<bf16_t> y(p.T * H), dx(p.T * H), dw1(E * 2 * F * H, 0x7777), dw2(E * H * F, 0x7777);
      std::vector<float> dwr(E * H, 7.0f), dprobs(p.T * cfg.topk, 7.0f);
      flowmoe::MoeGrads g;
      g.dw1_bf16 = dw1.data();
      g.dw2_bf16 = dw2.data();
      g.dwr = external ? nullptr : dwr.data();
      g.dprobs = dprobs.data();
      g.accumulate = false;
      if (external) layer->set_routing(p.ids.data(), p.probs.data());
      layer->forward(p.x.data(), p.T, y.data());
      layer->backward(p.dy.data(), dx.data(), g);
      expect_same_bits(dw1, rne_bf16(f32.dw1), "dW1 (BF16)");
      expect_same_bits(dw2, rne_bf16(f32.dw2), "dW2 (BF16)");
      expect_same_bits(dx, f32.dx, "dx");
      expect_same_bits(dprobs, f32.dprobs, "dprobs");
      if (!external) expect_same_bits(dwr, f32.dwr, "dWr");
    }
  }
}

TEST(MoeRouted, SameBitsSigmoidRenormalizedScaledBiased) {  // DeepSeek-V3's router, its probs given
  for (Recipe r : {Recipe::kBf16, Recipe::kFlow}) {
    SCOPED_TRACE(flowmoe::recipe_name(r));
    const RoutedProblem p =
        flowmoe_test::make_routed_problem(cfg_for(r, RouterScore::kSigmoid, true, 2.5f, 29), 29, 12, /*bias=*/true);
    const Out full = run(p, false), ext = run(p, true);
    expect_same_bits(ext.y, full.y, "y");
    expect_same_bits(ext.dw1, full.dw1, "dW1");
    expect_same_bits(ext.dprobs, full.dprobs, "dprobs");
    expect_same_bits(flowmoe_test::full_layer_dx(p, ext.dx, ext.dprobs), full.dx, "dx + router path");
  }
}

TEST(MoeRouted, ArbitraryRoutingAndDroppedSlots) {
  // any ids and weights (not a softmax's): a dropped slot (-1) contributes nothing and gets dprob 0;
  // the output is linear in the weights (doubling them doubles y up to BF16 rounding)
  RoutedProblem p = flowmoe_test::make_routed_problem(cfg_for(Recipe::kBf16, RouterScore::kSoftmax, false, 1.0f, 16), 16, 13);
  for (int64_t t = 0; t < p.T; ++t) {
    p.ids[t * 2] = int32_t(t % 4);
    p.ids[t * 2 + 1] = t % 5 == 0 ? -1 : int32_t((t + 1) % 4);
    p.probs[t * 2] = 0.25f + 0.01f * float(t);
    p.probs[t * 2 + 1] = 0.5f;
  }
  const Out a = run(p, true);
  for (int64_t t = 0; t < p.T; t += 5) EXPECT_EQ(a.dprobs[t * 2 + 1], 0.0f) << "dropped slot of token " << t;
  RoutedProblem q = p;
  for (float& v : q.probs) v *= 2.0f;
  const Out b = run(q, true);
  for (size_t i = 0; i < a.y.size(); ++i) {
    const float ya = flowmoe::num::bf16_to_f32(a.y[i]), yb = flowmoe::num::bf16_to_f32(b.y[i]);
    EXPECT_NEAR(yb, 2.0f * ya, 0.02f * std::fabs(ya) + 1e-3f) << i;
  }
}

TEST(MoeRouted, ForwardsInFlight) {
  const RoutedProblem p = flowmoe_test::make_routed_problem(cfg_for(Recipe::kFlow, RouterScore::kSoftmax, false, 1.0f, 24), 24, 14);
  RoutedProblem q = flowmoe_test::make_routed_problem(p.cfg, 24, 15);
  q.w1 = p.w1, q.w2 = p.w2;
  const Out a = run(p, true), b = run(q, true);
  MoeConfig cfg = p.cfg;
  cfg.external_routing = true;
  auto layer = flowmoe::make_cpu_layer(cfg);
  flowmoe::MoeWeights w;
  w.w1 = p.w1.data();
  w.w2 = p.w2.data();
  layer->set_weights(w);
  const int64_t n = p.T * cfg.hidden;
  std::vector<bf16_t> ya(n), yb(n), dxa(n), dxb(n);
  std::vector<float> da(p.T * 2), db(p.T * 2);
  layer->set_routing(p.ids.data(), p.probs.data());
  layer->forward(p.x.data(), p.T, ya.data());
  const std::vector<uint8_t> sa = layer->step_state();
  layer->set_routing(q.ids.data(), q.probs.data());
  layer->forward(q.x.data(), q.T, yb.data());
  const std::vector<uint8_t> sb = layer->step_state();
  flowmoe::MoeGrads g;
  g.dprobs = db.data();
  layer->load_step(sb.data(), sb.size());
  layer->backward(q.dy.data(), dxb.data(), g);
  g.dprobs = da.data();
  layer->load_step(sa.data(), sa.size());
  layer->backward(p.dy.data(), dxa.data(), g);
  expect_same_bits(ya, a.y, "y of the first");
  expect_same_bits(yb, b.y, "y of the second");
  expect_same_bits(dxa, a.dx, "dx of the first");
  expect_same_bits(dxb, b.dx, "dx of the second");
  expect_same_bits(da, a.dprobs, "dprobs of the first");
  expect_same_bits(db, b.dprobs, "dprobs of the second");
}

TEST(MoeRouted, ErrorsSayWhatIsExpected) {
  const RoutedProblem p = flowmoe_test::make_routed_problem(cfg_for(Recipe::kBf16, RouterScore::kSoftmax, false, 1.0f, 8), 8, 16);
  auto expect_throw = [](const std::function<void()>& fn, const std::string& needle) {
    try {
      fn();
      ADD_FAILURE() << "no error; expected one mentioning '" << needle << "'";
    } catch (const flowmoe::Error& e) {
      EXPECT_NE(std::string(e.what()).find(needle), std::string::npos) << e.what();
    }
  };
  MoeConfig ext = p.cfg;
  ext.external_routing = true;
  MoeConfig aux = ext;
  aux.aux_loss_alpha = 0.01f;
  expect_throw([&] { flowmoe::make_cpu_layer(aux); }, "external_routing");
  auto full = flowmoe::make_cpu_layer(p.cfg);
  expect_throw([&] { full->set_routing(p.ids.data(), p.probs.data()); }, "own router");
  auto layer = flowmoe::make_cpu_layer(ext);
  flowmoe::MoeWeights w;
  w.w1 = p.w1.data();
  w.w2 = p.w2.data();
  w.wr = p.wr.data();
  expect_throw([&] { layer->set_weights(w); }, "without a router");
  w.wr = nullptr;
  // BF16 parameters: one kind per weight, finite values
  std::vector<bf16_t> w1b = rne_bf16(p.w1), w2b = rne_bf16(p.w2);
  w.w1_bf16 = w1b.data();
  expect_throw([&] { layer->set_weights(w); }, "both as FP32 masters and as BF16");
  w.w1 = nullptr;
  expect_throw([&] { layer->set_weights(w); }, "of one kind");
  w.w2 = nullptr;
  w.w2_bf16 = w2b.data();
  layer->set_weights(w);
  w2b[w2b.size() - 3] = 0xFFC0;  // NaN
  EXPECT_THROW(layer->set_weights(w), flowmoe::NonFiniteError);
  w.w1_bf16 = w.w2_bf16 = nullptr;
  w.w1 = p.w1.data();
  w.w2 = p.w2.data();
  layer->set_weights(w);
  std::vector<bf16_t> y(p.T * ext.hidden), dx(p.T * ext.hidden);
  expect_throw([&] { layer->forward(p.x.data(), p.T, y.data()); }, "set_routing");
  std::vector<int32_t> bad = p.ids;
  bad[3] = 4;
  layer->set_routing(bad.data(), p.probs.data());
  EXPECT_THROW(layer->forward(p.x.data(), p.T, y.data()), flowmoe::Error);
  layer->set_routing(p.ids.data(), p.probs.data());
  layer->forward(p.x.data(), p.T, y.data());
  std::vector<float> dwr(ext.num_experts * ext.hidden);
  flowmoe::MoeGrads g;
  g.dwr = dwr.data();
  expect_throw([&] { layer->backward(p.dy.data(), dx.data(), g); }, "dwr");
  // gradients: one buffer per weight, BF16 ones overwritten only
  std::vector<float> dw1(ext.num_experts * 2 * ext.ffn * ext.hidden);
  std::vector<bf16_t> dw1b(dw1.size());
  flowmoe::MoeGrads both;
  both.dw1 = dw1.data();
  both.dw1_bf16 = dw1b.data();
  both.accumulate = false;
  expect_throw([&] { layer->backward(p.dy.data(), dx.data(), both); }, "both as FP32 and as BF16");
  flowmoe::MoeGrads acc;
  acc.dw1_bf16 = dw1b.data();
  acc.accumulate = true;
  expect_throw([&] { layer->backward(p.dy.data(), dx.data(), acc); }, "accumulate = true");
  // only the CUDA experts-only layer with caller memory derives the backward's weights itself
  EXPECT_FALSE(layer->takes_backward_weights());
  expect_throw([&] { layer->set_backward_weights(w); }, "takes_backward_weights");
  // ... and only the CUDA bf16 layer built with bf16_params_in_place reads the forward's in place
  EXPECT_FALSE(layer->reads_params_in_place());
  expect_throw([&] { layer->set_forward_weights(w); }, "reads_params_in_place");
}
