// The CPU MoE layer's outputs, gradients and cast report pinned by digests: every recipe on one
// rank (with router bias, aux loss and the column checks; gradients accumulated and overwritten),
// flow with the column-amax transpose exponent, and every recipe expert-parallel over two and four
// simulated ranks (SimWorld). Each case hashes (FNV-1a 64) the bits of y, dx, dW1, dW2, dWr, the
// status counters and aux loss, and the whole text of the cast report (operator names, saved
// tensors, column checks, wire transfers), and compares with the table below, recorded from the
// layer before it was split into src/cpu/moe/: a reorganisation must leave every digest equal.
//
// A change that is meant to move bits must say why in its commit and re-record the table: a
// mismatching case prints its new line.
#include <gtest/gtest.h>

#include <cinttypes>
#include <cmath>
#include <cstdio>
#include <cstring>
#include <map>
#include <string>
#include <vector>

#include "common/fnv.h"
#include "common/moe_config.h"
#include "common/reference.h"
#include "flowmoe/comm.h"
#include "flowmoe/moe.h"
#include "flowmoe/numerics.h"

namespace flowmoe {
namespace {

using testutil::Fnv;

constexpr int64_t kH = 256, kF = 256;
constexpr int kE = 4, kK = 2;

struct Case {
  Recipe recipe = Recipe::kBf16;
  int world = 1;                    // 1: no communicator
  std::vector<int64_t> tokens;      // per rank
  TransposeExponent exponent = TransposeExponent::kRowMax;
  bool extras = false;              // router bias, aux loss, sigmoid+renorm, column checks
};

std::string case_name(const Case& c) {
  std::string s = std::string(recipe_name(c.recipe)) + " W=" + std::to_string(c.world);
  if (c.exponent == TransposeExponent::kColumnAmax) s += " column-amax";
  if (c.extras) s += " extras";
  return s;
}

// Forward + backward twice (accumulated, then overwritten gradients) of one rank's layer; hashes
// everything into `h`.
void run_rank(const Case& c, Communicator* comm, int rank, Fnv* h) {
  flowmoe_test::Rng rng(1234);  // same weights on every rank
  std::vector<float> w1(int64_t(kE) * 2 * kF * kH), w2(int64_t(kE) * kH * kF), wr(int64_t(kE) * kH),
      bias(kE);
  for (float& v : w1) v = static_cast<float>(rng.normal() / std::sqrt(double(kH)));
  for (float& v : w2) v = static_cast<float>(rng.normal() / std::sqrt(double(kF)));
  for (float& v : wr) v = static_cast<float>(rng.normal() / std::sqrt(double(kH)));
  for (float& v : bias) v = static_cast<float>(0.1 * rng.normal());
  int64_t max_t = 0;
  for (int64_t t : c.tokens) max_t = std::max(max_t, t);
  flowmoe_test::MoeConfigBuilder b = flowmoe_test::moe_config(kH, kF, kE, kK);
  b.align(c.extras ? 32 : 16).recipe(c.recipe).exponent(c.exponent).max_tokens(max_t).comm(comm);
  if (c.extras) b.router(RouterScore::kSigmoid, true, 2.5f).aux_loss(0.01f).check_columns();
  const MoeConfig cfg = b;
  const int El = kE / c.world;
  const int64_t T = c.tokens[rank];
  flowmoe_test::Rng data(77 + rank);
  std::vector<bf16_t> x(T * kH), dy(T * kH);
  for (bf16_t& v : x) v = num::f32_to_bf16(static_cast<float>(2.0 * data.normal()));
  for (bf16_t& v : dy) v = num::f32_to_bf16(static_cast<float>(data.normal()));
  // a few outliers so that underflow counters and column checks see something
  for (int64_t i = 0; i < T * kH; i += 97) x[i] = num::f32_to_bf16(static_cast<float>(300.0 * data.normal()));

  auto layer = make_cpu_layer(cfg);
  MoeWeights w;
  w.w1 = w1.data() + int64_t(rank) * El * 2 * kF * kH;
  w.w2 = w2.data() + int64_t(rank) * El * kH * kF;
  w.wr = wr.data();
  w.router_bias = c.extras ? bias.data() : nullptr;
  layer->set_weights(w);
  std::vector<float> dw1(int64_t(El) * 2 * kF * kH, 0.5f), dw2(int64_t(El) * kH * kF, 0.25f),
      dwr(int64_t(kE) * kH, 1.0f);
  for (int pass = 0; pass < 2; ++pass) {
    std::vector<bf16_t> y(T * kH), dx(T * kH);
    layer->forward(x.data(), T, y.data());
    MoeGrads g{dw1.data(), dw2.data(), dwr.data()};
    g.accumulate = pass == 0;
    layer->backward(dy.data(), dx.data(), g);
    const MoeStatus st = layer->status();
    h->add(y);
    h->add(dx);
    h->add(dw1);
    h->add(dw2);
    h->add(dwr);
    h->add(&st.nonfinite, sizeof st.nonfinite);
    h->add(&st.underflow, sizeof st.underflow);
    h->add(&st.aux_loss, sizeof st.aux_loss);
    h->add(layer->cast_report().to_string());
  }
}

std::string digest(const Case& c) {
  std::vector<Fnv> per_rank(c.world);
  if (c.world == 1) {
    run_rank(c, nullptr, 0, &per_rank[0]);
  } else {
    SimWorld world(c.world, 60.0);
    const std::vector<std::string> errs =
        world.run([&](Communicator& comm) { run_rank(c, &comm, comm.rank(), &per_rank[comm.rank()]); });
    for (size_t r = 0; r < errs.size(); ++r) EXPECT_EQ(errs[r], "") << "rank " << r;
  }
  Fnv all;
  for (const Fnv& f : per_rank) all.add(&f.h, sizeof f.h);
  char buf[32];
  std::snprintf(buf, sizeof buf, "%016" PRIx64, all.h);
  return buf;
}

// Recorded from the CPU layer of main 4d8fca5 (src/cpu/moe_cpu.cpp, before the split).
const std::map<std::string, std::string>& stored() {
  static const std::map<std::string, std::string> table = {
      {"bf16 W=1", "36c9a2a792f4d68b"},
      {"bf16 W=1 extras", "b017158205b9c697"},
      {"bf16 W=2", "06c0440649dbc1e0"},
      {"bf16 W=4 extras", "bd9b199a04e27cc0"},
      {"blockwise W=1", "e90c1cda3ba03fc8"},
      {"blockwise W=1 extras", "64ca405a29a7bc26"},
      {"blockwise W=2", "80460d7086d715a5"},
      {"blockwise W=4 extras", "e48a3204e9d661d4"},
      {"fp8-naive W=1", "a0a76b25fbafc461"},
      {"fp8-naive W=1 extras", "8cc86b4df2907a61"},
      {"fp8-naive W=2", "628ac2250164a612"},
      {"fp8-naive W=4 extras", "5e8fe4c73e2717d0"},
      {"flow W=1", "11364186ef08c470"},
      {"flow W=1 extras", "3534a668d37a61ab"},
      {"flow W=2", "e231ad34df25b783"},
      {"flow W=4 extras", "97393f1751577ecf"},
      {"flow-fp4 W=1", "403109af1572eba9"},
      {"flow-fp4 W=1 extras", "56398f0691c18e83"},
      {"flow-fp4 W=2", "01ee9ab4ceb29fca"},
      {"flow-fp4 W=4 extras", "add2e798935b212e"},
      {"flow W=1 column-amax extras", "ea581024e9509e12"},
      {"flow-fp4 W=2 column-amax", "065b64afea2570d1"},
  };
  return table;
}

std::vector<Case> cases() {
  std::vector<Case> out;
  for (Recipe r : all_recipes()) {
    out.push_back({r, 1, {40}, TransposeExponent::kRowMax, false});
    out.push_back({r, 1, {37}, TransposeExponent::kRowMax, true});
    out.push_back({r, 2, {24, 17}, TransposeExponent::kRowMax, false});
    out.push_back({r, 4, {9, 0 + 13, 5, 11}, TransposeExponent::kRowMax, true});
  }
  out.push_back({Recipe::kFlow, 1, {40}, TransposeExponent::kColumnAmax, true});
  out.push_back({Recipe::kFlowFp4, 2, {24, 17}, TransposeExponent::kColumnAmax, false});
  return out;
}

TEST(MoeDigest, EveryRecipeAndEpMatchesTheRecordedBits) {
  int missing = 0, differ = 0;
  for (const Case& c : cases()) {
    const std::string name = case_name(c), got = digest(c);
    const auto it = stored().find(name);
    if (it == stored().end()) {
      ++missing;
      std::printf("      {\"%s\", \"%s\"},\n", name.c_str(), got.c_str());
    } else if (it->second != got) {
      ++differ;
      ADD_FAILURE() << name << ": digest " << got << ", recorded " << it->second;
    }
  }
  EXPECT_EQ(missing, 0) << "cases without a recorded digest (lines printed above)";
  EXPECT_EQ(differ, 0);
  EXPECT_EQ(stored().size(), cases().size()) << "recorded digests of cases no longer run";
}

}  // namespace
}  // namespace flowmoe
