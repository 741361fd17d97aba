// A forward's state as a value on the CPU layer (MoeLayer::step_state / load_step, moe.h): forward
// A, set_weights with other weights, forward B, backward B, backward A give the bits of the plain
// (set_weights, forward, backward) runs of A and B, every recipe (each step keeps the weight
// copies its forward ran with); the same bytes back a second backward with the same bits, also in
// another layer of the same shape; foreign, truncated or misshapen bytes are refused and leave the
// layer as it was; caller memory is refused.
#include <gtest/gtest.h>

#include <cmath>
#include <cstring>
#include <memory>
#include <string>
#include <vector>

#include "common/moe_config.h"
#include "common/reference.h"
#include "flowmoe/error.h"
#include "flowmoe/moe.h"
#include "flowmoe/numerics.h"

namespace {

using flowmoe::bf16_t;
using flowmoe::MoeConfig;
using flowmoe::Recipe;

constexpr int64_t kH = 128, kF = 128;
constexpr int kE = 4, kK = 2;

struct Problem {
  std::vector<float> w1, w2, wr;
  std::vector<bf16_t> x, dy;
  int64_t T = 0;
};

Problem make_problem(int64_t T, uint64_t seed) {
  flowmoe_test::Rng rng(seed);
  Problem p;
  p.T = T;
  p.w1.resize(kE * 2 * kF * kH);
  p.w2.resize(kE * kH * kF);
  p.wr.resize(kE * kH);
  for (float& v : p.w1) v = float(rng.normal() / std::sqrt(double(kH)));
  for (float& v : p.w2) v = float(rng.normal() / std::sqrt(double(kF)));
  for (float& v : p.wr) v = float(rng.normal() / std::sqrt(double(kH)));
  p.x.resize(T * kH);
  p.dy.resize(T * kH);
  for (auto& v : p.x) v = flowmoe::num::f32_to_bf16(float(rng.normal()));
  for (auto& v : p.dy) v = flowmoe::num::f32_to_bf16(float(rng.normal()));
  return p;
}

MoeConfig config(Recipe r) {
  return flowmoe_test::moe_config(kH, kF, kE, kK).recipe(r).aux_loss(0.01f).max_tokens(64);
}

struct Out {
  std::vector<bf16_t> y, dx;
  std::vector<float> dw1, dw2, dwr;
  explicit Out(int64_t T)
      : y(T * kH), dx(T * kH), dw1(kE * 2 * kF * kH), dw2(kE * kH * kF), dwr(kE * kH) {}
  flowmoe::MoeGrads grads() { return flowmoe::MoeGrads{dw1.data(), dw2.data(), dwr.data(), false}; }
};

flowmoe::MoeWeights weights(const Problem& p) { return {p.w1.data(), p.w2.data(), p.wr.data(), nullptr}; }

void expect_same(const Out& want, const Out& got, const std::string& what) {
  EXPECT_EQ(0, std::memcmp(want.y.data(), got.y.data(), want.y.size() * sizeof(bf16_t))) << what << " y";
  EXPECT_EQ(0, std::memcmp(want.dx.data(), got.dx.data(), want.dx.size() * sizeof(bf16_t))) << what << " dx";
  EXPECT_EQ(0, std::memcmp(want.dw1.data(), got.dw1.data(), want.dw1.size() * 4)) << what << " dW1";
  EXPECT_EQ(0, std::memcmp(want.dw2.data(), got.dw2.data(), want.dw2.size() * 4)) << what << " dW2";
  EXPECT_EQ(0, std::memcmp(want.dwr.data(), got.dwr.data(), want.dwr.size() * 4)) << what << " dWr";
}

class MoeSteps : public ::testing::TestWithParam<Recipe> {};

TEST_P(MoeSteps, TwoForwardsInFlightAcrossAWeightUpdateGiveThePairsBits) {
  const Recipe r = GetParam();
  const Problem a = make_problem(37, 1), b = make_problem(50, 2);  // b: other weights and tokens
  Out want_a(a.T), want_b(b.T);
  for (auto [p, o] : {std::make_pair(&a, &want_a), std::make_pair(&b, &want_b)}) {
    auto l = flowmoe::make_cpu_layer(config(r));
    l->set_weights(weights(*p));
    l->forward(p->x.data(), p->T, o->y.data());
    l->backward(p->dy.data(), o->dx.data(), o->grads());
  }
  auto l = flowmoe::make_cpu_layer(config(r));
  Out got_a(a.T), got_b(b.T);
  l->set_weights(weights(a));
  l->forward(a.x.data(), a.T, got_a.y.data());
  const std::vector<uint8_t> sa = l->step_state();
  l->set_weights(weights(b));  // the forward in flight keeps the copies of a's weights
  l->forward(b.x.data(), b.T, got_b.y.data());
  const std::vector<uint8_t> sb = l->step_state();
  l->load_step(sb.data(), sb.size());
  l->backward(b.dy.data(), got_b.dx.data(), got_b.grads());
  l->load_step(sa.data(), sa.size());
  l->backward(a.dy.data(), got_a.dx.data(), got_a.grads());
  // the same bytes again (retain_graph): the same bits, on this layer and on a fresh one
  Out again_a(a.T), other_a(a.T);
  again_a.y = got_a.y, other_a.y = got_a.y;
  l->load_step(sa.data(), sa.size());
  l->backward(a.dy.data(), again_a.dx.data(), again_a.grads());
  auto fresh = flowmoe::make_cpu_layer(config(r));
  fresh->set_weights(weights(b));  // (its own weights are not the step's)
  fresh->load_step(sa.data(), sa.size());
  fresh->backward(a.dy.data(), other_a.dx.data(), other_a.grads());
  expect_same(want_a, again_a, flowmoe::recipe_name(r) + std::string(": the first forward's second backward"));
  expect_same(want_a, other_a, flowmoe::recipe_name(r) + std::string(": the first forward on another layer"));
  expect_same(want_a, got_a, flowmoe::recipe_name(r) + std::string(": the first forward"));
  expect_same(want_b, got_b, flowmoe::recipe_name(r) + std::string(": the second forward"));
}

INSTANTIATE_TEST_SUITE_P(Recipes, MoeSteps,
                         ::testing::Values(Recipe::kBf16, Recipe::kBlockwise, Recipe::kFp8Naive, Recipe::kFlow,
                                           Recipe::kFlowFp4),
                         [](const ::testing::TestParamInfo<Recipe>& p) {
                           std::string n = flowmoe::recipe_name(p.param);
                           for (char& c : n)
                             if (c == '-') c = '_';
                           return n;
                         });

TEST(MoeStepsErrors, MisuseIsAClearError) {
  const Problem a = make_problem(20, 3);
  auto l = flowmoe::make_cpu_layer(config(Recipe::kFlow));
  auto other = flowmoe::make_cpu_layer(config(Recipe::kFlow));
  l->set_weights(weights(a));
  other->set_weights(weights(a));
  Out o(a.T);
  EXPECT_THROW(l->step_state(), flowmoe::Error);  // no forward yet
  l->forward(a.x.data(), a.T, o.y.data());
  std::vector<uint8_t> st = l->step_state();
  auto refused = [&](flowmoe::MoeLayer& layer, const std::vector<uint8_t>& bytes, const char* expect) {
    try {
      layer.load_step(bytes.data(), bytes.size());
      ADD_FAILURE() << "load_step accepted " << expect;
    } catch (const flowmoe::Error& e) {
      EXPECT_NE(std::string(e.what()).find(expect), std::string::npos) << e.what();
    }
  };
  refused(*l, std::vector<uint8_t>(st.begin(), st.begin() + st.size() / 2), "truncated");
  std::vector<uint8_t> longer = st;
  longer.push_back(0);
  refused(*l, longer, "left over");
  std::vector<uint8_t> foreign(st.size(), 0x5a);
  refused(*l, foreign, "not a flowmoe step");
  auto fp4 = flowmoe::make_cpu_layer(config(Recipe::kFlowFp4));  // another recipe
  refused(*fp4, st, "another shape");
  // refused bytes leave the layer as it was: the backward still backs its own forward
  Out want(a.T), got(a.T);
  l->backward(a.dy.data(), got.dx.data(), got.grads());
  other->forward(a.x.data(), a.T, want.y.data());
  other->backward(a.dy.data(), want.dx.data(), want.grads());
  got.y = want.y;
  expect_same(want, got, "after refused steps");
  // the CPU layer owns its memory: a plan of zeros, and caller regions are refused
  EXPECT_EQ(l->memory_plan().saved, 0);
  char region[256];
  try {
    l->bind_memory(flowmoe::MoeMemory{region, nullptr, nullptr});
    FAIL() << "bind_memory accepted caller memory on the CPU layer";
  } catch (const flowmoe::Error& e) {
    EXPECT_NE(std::string(e.what()).find("owns its memory"), std::string::npos) << e.what();
  }
  l->bind_memory(flowmoe::MoeMemory{});  // null regions: nothing to bind, accepted
}

}  // namespace
