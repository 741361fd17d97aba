// The experts-only CUDA layer (MoeConfig::external_routing, issue 31): given the full layer's own
// routing (recomputed on the host, tests/common/routed_problem.h: the router kernels are the CPU
// reference's bits) it gives the full CUDA layer's bits: y, dW1, dW2, dprobs, and dx once the
// router path is added back. Every recipe, with and without sync_free; caller memory with two
// forwards in flight; and the experts-only CUDA layer against the experts-only CPU layer
// (the GEMM tolerance of tests/cuda/test_moe_gpu.cu).
#include <cuda_runtime.h>
#include <gtest/gtest.h>

#include <memory>
#include <string>
#include <tuple>
#include <vector>

#include "common/moe_config.h"
#include "common/routed_problem.h"
#include "cuda/device_buffer.h"
#include "cuda/gpu_test_util.h"
#include "flowmoe/error.h"
#include "flowmoe/moe.h"
#include "flowmoe/numerics.h"

namespace flowmoe {
namespace {

using namespace testutil;
using flowmoe_test::RoutedProblem;

constexpr int64_t kH = 256, kF = 256, kT = 300;
constexpr int kE = 8, kK = 2;

struct Out {
  std::vector<bf16_t> y, dx;
  std::vector<float> dw1, dw2, dprobs, dwr;
};

std::vector<bf16_t> rne_bf16(const std::vector<float>& v) {
  std::vector<bf16_t> out(v.size());
  for (size_t i = 0; i < v.size(); ++i) out[i] = num::f32_to_bf16(v[i]);
  return out;
}

// The full layer (external = false) or the experts-only one given p.ids / p.probs (device copies).
// bf16_params: W1, W2 given as BF16 parameters (the RNE of p's masters) instead of FP32 masters.
Out run(const RoutedProblem& p, bool external, bool sync_free, bool bf16_params = false,
        bool fused_swiglu = false) {
  MoeConfig cfg = p.cfg;
  cfg.external_routing = external;
  CudaLayerOptions opt;
  opt.sync_free = sync_free;
  opt.fused_swiglu = fused_swiglu;
  std::unique_ptr<MoeLayer> l = make_cuda_layer(cfg, nullptr, opt);
  DBuf<float> w1(p.w1), w2(p.w2), wr(p.wr);
  DBuf<bf16_t> w1b(rne_bf16(p.w1)), w2b(rne_bf16(p.w2));
  DBuf<bf16_t> x(p.x), dy(p.dy), y(kT * kH), dx(kT * kH);
  DBuf<int32_t> ids(p.ids);
  DBuf<float> probs(p.probs), dw1(p.w1.size()), dw2(p.w2.size()), dwr(p.wr.size()), dprobs(p.probs.size());
  MoeWeights w{w1.p, w2.p, external ? nullptr : wr.p, nullptr};
  if (bf16_params) {
    w.w1 = w.w2 = nullptr;
    w.w1_bf16 = w1b.p;
    w.w2_bf16 = w2b.p;
  }
  l->set_weights(w);
  if (external) l->set_routing(ids.p, probs.p);
  l->forward(x.p, kT, y.p);
  MoeGrads g{dw1.p, dw2.p, external ? nullptr : dwr.p, false};
  g.dprobs = dprobs.p;
  l->backward(dy.p, dx.p, g);
  return Out{y.get(), dx.get(), dw1.get(), dw2.get(), dprobs.get(), external ? std::vector<float>() : dwr.get()};
}

class Routed : public ::testing::TestWithParam<std::tuple<Recipe, bool>> {};

TEST_P(Routed, SameBitsAsTheFullLayer) {
  REQUIRE_SM90();
  const Recipe recipe = std::get<0>(GetParam());
  const bool sync_free = std::get<1>(GetParam());
  const MoeConfig cfg = flowmoe_test::moe_config(kH, kF, kE, kK).align(128).recipe(recipe).max_tokens(kT);
  const RoutedProblem p = flowmoe_test::make_routed_problem(cfg, kT, 31);
  const Out full = run(p, false, sync_free), ext = run(p, true, sync_free);
  expect_same_bits(full.y, ext.y, "y");
  expect_same_bits(full.dw1, ext.dw1, "dW1");
  expect_same_bits(full.dw2, ext.dw2, "dW2");
  expect_same_bits(full.dprobs, ext.dprobs, "dprobs");
  expect_same_bits(full.dx, flowmoe_test::full_layer_dx(p, ext.dx, ext.dprobs), "dx + router path");
}

// BF16 parameters (MoeWeights::w1_bf16 / w2_bf16: quantized straight from them, no FP32 copy) give
// the bits of FP32 masters holding the same values: the full layer (router path, dWr) and the
// experts-only one; with sync_free also with GEMM1's fused SwiGLU (W1 interleaved after the
// quantization).
TEST_P(Routed, Bf16ParamsSameBitsAsFp32Masters) {
  REQUIRE_SM90();
  const Recipe recipe = std::get<0>(GetParam());
  const bool sync_free = std::get<1>(GetParam());
  const MoeConfig cfg = flowmoe_test::moe_config(kH, kF, kE, kK).align(128).recipe(recipe).max_tokens(kT);
  const RoutedProblem p = flowmoe_test::make_routed_problem(cfg, kT, 35);
  for (bool external : {false, true}) {
    SCOPED_TRACE(external ? "experts-only layer" : "full layer");
    const Out masters = run(p, external, sync_free, false, sync_free);
    const Out params = run(p, external, sync_free, true, sync_free);
    expect_same_bits(masters.y, params.y, "y");
    expect_same_bits(masters.dx, params.dx, "dx");
    expect_same_bits(masters.dw1, params.dw1, "dW1");
    expect_same_bits(masters.dw2, params.dw2, "dW2");
    expect_same_bits(masters.dwr, params.dwr, "dWr");
    expect_same_bits(masters.dprobs, params.dprobs, "dprobs");
  }
}

// A NaN or Inf among BF16 parameters is refused like one among FP32 masters (every recipe: its
// copy or quantization counts it); W1 given both ways is refused.
TEST(RoutedBf16Params, NonFiniteRefused) {
  REQUIRE_SM90();
  for (Recipe recipe : all_recipes()) {
    SCOPED_TRACE(recipe_name(recipe));
    MoeConfig cfg = flowmoe_test::moe_config(kH, kF, kE, kK).align(128).recipe(recipe).max_tokens(kT);
    cfg.external_routing = true;
    std::unique_ptr<MoeLayer> l = make_cuda_layer(cfg, nullptr, CudaLayerOptions());
    std::vector<bf16_t> h1(size_t(kE) * 2 * kF * kH, num::f32_to_bf16(0.01f)), h2(size_t(kE) * kH * kF, 0);
    MoeWeights w;
    DBuf<bf16_t> w1(h1), w2(h2);
    w.w1_bf16 = w1.p;
    w.w2_bf16 = w2.p;
    EXPECT_NO_THROW(l->set_weights(w));
    h2[h2.size() - 5] = 0x7F80;  // +Inf in the last expert's W2
    DBuf<bf16_t> w2_bad(h2);
    w.w2_bf16 = w2_bad.p;
    EXPECT_THROW(l->set_weights(w), NonFiniteError);
    DBuf<float> w1f(h1.size());
    w.w1 = w1f.p;
    EXPECT_THROW(l->set_weights(w), Error);
  }
}

TEST_P(Routed, MatchesTheCpuLayer) {
  REQUIRE_SM90();
  const Recipe recipe = std::get<0>(GetParam());
  MoeConfig cfg = flowmoe_test::moe_config(kH, kF, kE, kK).align(128).recipe(recipe).max_tokens(kT);
  const RoutedProblem p = flowmoe_test::make_routed_problem(cfg, kT, 32);
  const Out gpu = run(p, true, std::get<1>(GetParam()));
  cfg.external_routing = true;
  std::unique_ptr<MoeLayer> c = make_cpu_layer(cfg);
  c->set_weights(MoeWeights{p.w1.data(), p.w2.data(), nullptr, nullptr});
  c->set_routing(p.ids.data(), p.probs.data());
  std::vector<bf16_t> y(kT * kH), dx(kT * kH);
  std::vector<float> dw1(p.w1.size()), dw2(p.w2.size()), dprobs(p.probs.size());
  c->forward(p.x.data(), kT, y.data());
  MoeGrads g{dw1.data(), dw2.data(), nullptr, false};
  g.dprobs = dprobs.data();
  c->backward(p.dy.data(), dx.data(), g);
  const double tol = recipe == Recipe::kBf16 ? 2e-2 : 6e-2;  // GEMM summation order (test_moe_gpu.cu)
  EXPECT_LT(rel_rms(gpu.y, y), tol);
  EXPECT_LT(rel_rms(gpu.dx, dx), tol);
  EXPECT_LT(rel_rms(gpu.dw1, dw1), tol);
  EXPECT_LT(rel_rms(gpu.dw2, dw2), tol);
  EXPECT_LT(rel_rms(gpu.dprobs, dprobs), tol);
}

TEST_P(Routed, CallerMemoryTwoForwardsInFlight) {
  REQUIRE_SM90();
  const Recipe recipe = std::get<0>(GetParam());
  CudaLayerOptions opt;
  opt.sync_free = std::get<1>(GetParam());
  MoeConfig cfg = flowmoe_test::moe_config(kH, kF, kE, kK).align(128).recipe(recipe).max_tokens(kT);
  const RoutedProblem a = flowmoe_test::make_routed_problem(cfg, kT, 33);
  RoutedProblem b = flowmoe_test::make_routed_problem(cfg, kT, 34);
  b.w1 = a.w1, b.w2 = a.w2;
  const Out want_a = run(a, true, opt.sync_free), want_b = run(b, true, opt.sync_free);
  cfg.external_routing = true;
  opt.caller_memory = true;
  std::unique_ptr<MoeLayer> l = make_cuda_layer(cfg, nullptr, opt);
  const MoeMemoryPlan plan = l->memory_plan();
  DBuf<uint8_t> wm(plan.weights), s1(plan.saved), s2(plan.saved), tm(plan.transient);
  DBuf<float> w1(a.w1), w2(a.w2);
  l->bind_memory(MoeMemory{wm.p, nullptr, tm.p});
  l->set_weights(MoeWeights{w1.p, w2.p, nullptr, nullptr});
  DBuf<bf16_t> xa(a.x), xb(b.x), dya(a.dy), dyb(b.dy), ya(kT * kH), yb(kT * kH), dxa(kT * kH), dxb(kT * kH);
  DBuf<int32_t> ida(a.ids), idb(b.ids);
  DBuf<float> pa(a.probs), pb(b.probs), dpa(a.probs.size()), dpb(b.probs.size());
  l->bind_memory(MoeMemory{wm.p, s1.p, tm.p});
  l->set_routing(ida.p, pa.p);
  l->forward(xa.p, kT, ya.p);
  const std::vector<uint8_t> sa = l->step_state();
  l->bind_memory(MoeMemory{wm.p, s2.p, tm.p});
  l->set_routing(idb.p, pb.p);
  l->forward(xb.p, kT, yb.p);
  const std::vector<uint8_t> sb = l->step_state();
  MoeGrads g;
  g.dprobs = dpb.p;
  l->load_step(sb.data(), sb.size());
  l->backward(dyb.p, dxb.p, g);
  l->bind_memory(MoeMemory{wm.p, s1.p, tm.p});
  g.dprobs = dpa.p;
  l->load_step(sa.data(), sa.size());
  l->backward(dya.p, dxa.p, g);
  expect_same_bits(want_a.y, ya.get(), "y of the first");
  expect_same_bits(want_b.y, yb.get(), "y of the second");
  expect_same_bits(want_a.dx, dxa.get(), "dx of the first");
  expect_same_bits(want_b.dx, dxb.get(), "dx of the second");
  expect_same_bits(want_a.dprobs, dpa.get(), "dprobs of the first");
  expect_same_bits(want_b.dprobs, dpb.get(), "dprobs of the second");
}

// Caller memory as the PyTorch op runs it, experts-only and full layer, BF16 parameters and FP32
// masters: the backward takes its dgrad weights (and Wr) from the parameters (set_backward_weights;
// the FP8 block recipes), a group of experts at a time (also one expert per group), with the
// weights region poisoned and unbound, and writes BF16 expert gradients (MoeGrads::dw1_bf16): the
// FP32 gradients of the owned layer rounded once, and its dx, dprobs and dWr, bit for bit. The
// other recipes refuse set_backward_weights and give the same bits with the weights region bound,
// but bf16 with CudaLayerOptions::bf16_params_in_place: its GEMMs read the BF16 parameters in both
// passes (set_forward_weights, set_backward_weights), its weights region holds no copy of them, the
// bits are the copies', and a forward given other parameters than set_weights' reads the ones it
// is given. The option changes nothing for the other recipes.
TEST_P(Routed, CallerMemoryBackwardWeightsFromParamsAndBf16Grads) {
  REQUIRE_SM90();
  const Recipe recipe = std::get<0>(GetParam());
  const bool sync_free = std::get<1>(GetParam());
  const MoeConfig base = flowmoe_test::moe_config(kH, kF, kE, kK).align(128).recipe(recipe).max_tokens(kT);
  const RoutedProblem p = flowmoe_test::make_routed_problem(base, kT, 36);
  // (chunk bytes 1: W^T made and the dgrad run one expert at a time, where the path allows groups)
  struct Variant {
    bool external, bf16_params;
    int64_t chunk_bytes;
    bool in_place;
  };
  for (const Variant v : {Variant{true, true, -1, false}, Variant{true, false, -1, false}, Variant{true, true, 1, false},
                          Variant{false, true, -1, false}, Variant{false, false, 1, false}, Variant{true, true, -1, true},
                          Variant{false, true, -1, true}}) {
    SCOPED_TRACE(std::string(v.external ? "experts-only layer, " : "full layer, ") +
                 (v.bf16_params ? "BF16 parameters" : "FP32 masters") +
                 (v.chunk_bytes == 1 ? ", one expert per dgrad group" : "") +
                 (v.in_place ? ", bf16_params_in_place" : ""));
    const Out want = run(p, v.external, sync_free, v.bf16_params);
    MoeConfig cfg = base;
    cfg.external_routing = v.external;
    CudaLayerOptions opt;
    opt.sync_free = sync_free;
    opt.caller_memory = true;
    if (v.chunk_bytes > 0) opt.dgrad_weight_chunk_bytes = v.chunk_bytes;
    opt.bf16_params_in_place = v.in_place;
    std::unique_ptr<MoeLayer> l = make_cuda_layer(cfg, nullptr, opt);
    const bool in_place = v.in_place && recipe == Recipe::kBf16;
    const bool from_params =
        recipe == Recipe::kBlockwise || recipe == Recipe::kFlow || recipe == Recipe::kFlowFp4 || in_place;
    EXPECT_EQ(l->takes_backward_weights(), from_params);
    EXPECT_EQ(l->reads_params_in_place(), in_place);
    const MoeMemoryPlan plan = l->memory_plan();
    if (in_place)  // (no BF16 copy of W1, W2 in the weights region)
      EXPECT_LT(plan.weights, int64_t(sizeof(bf16_t)) * int64_t(p.w1.size() + p.w2.size()));
    DBuf<uint8_t> wm(plan.weights), sm(plan.saved), tm(plan.transient);
    DBuf<float> w1(p.w1), w2(p.w2), wr(p.wr);
    DBuf<bf16_t> w1b(rne_bf16(p.w1)), w2b(rne_bf16(p.w2));
    MoeWeights w;
    if (v.bf16_params) {
      w.w1_bf16 = w1b.p, w.w2_bf16 = w2b.p;
    } else {
      w.w1 = w1.p, w.w2 = w2.p;
    }
    if (!v.external) w.wr = wr.p;
    l->bind_memory(MoeMemory{wm.p, sm.p, tm.p});
    l->set_weights(w);
    DBuf<bf16_t> x(p.x), dy(p.dy), y(kT * kH), dx(kT * kH), dw1(p.w1.size()), dw2(p.w2.size());
    DBuf<int32_t> ids(p.ids);
    DBuf<float> probs(p.probs), dprobs(p.probs.size()), dwr(p.wr.size());
    if (v.external) l->set_routing(ids.p, probs.p);
    if (in_place) {
      EXPECT_THROW(l->forward(x.p, kT, y.p), Error);  // (the parameters are required)
      if (v.external) l->set_routing(ids.p, probs.p);
      l->set_forward_weights(w);
    } else {
      EXPECT_THROW(l->set_forward_weights(w), Error);
    }
    l->forward(x.p, kT, y.p);
    if (from_params) {  // the forward's weight copies gone: the backward must not read them
      ASSERT_EQ(cudaMemset(wm.p, 0xFF, plan.weights), cudaSuccess);
      l->bind_memory(MoeMemory{nullptr, sm.p, tm.p});
      l->set_backward_weights(w);
    } else {
      EXPECT_THROW(l->set_backward_weights(w), Error);
    }
    MoeGrads g;
    g.dw1_bf16 = dw1.p;
    g.dw2_bf16 = dw2.p;
    g.dwr = v.external ? nullptr : dwr.p;
    g.dprobs = dprobs.p;
    g.accumulate = false;
    l->backward(dy.p, dx.p, g);
    expect_same_bits(want.y, y.get(), "y");
    expect_same_bits(want.dx, dx.get(), "dx");
    expect_same_bits(want.dprobs, dprobs.get(), "dprobs");
    if (!v.external) expect_same_bits(want.dwr, dwr.get(), "dWr");
    expect_same_bits(rne_bf16(want.dw1), dw1.get(), "dW1 (BF16) = the FP32 dW1 rounded");
    expect_same_bits(rne_bf16(want.dw2), dw2.get(), "dW2 (BF16) = the FP32 dW2 rounded");
    if (in_place) {
      // the forward reads the parameters it is given, not a copy of set_weights' ones: the same
      // forward given other values (W1 halved: exact in BF16) after set_weights of the first gives
      // the output of set_weights of the second
      std::vector<bf16_t> half(w1b.get());
      for (bf16_t& b : half) b = num::f32_to_bf16(0.5f * num::bf16_to_f32(b));
      DBuf<bf16_t> w1h(half);
      MoeWeights wh = w;
      wh.w1_bf16 = w1h.p;
      const auto forward_y = [&](const MoeWeights& seen, const MoeWeights& read) {
        l->bind_memory(MoeMemory{wm.p, sm.p, tm.p});
        l->set_weights(seen);
        if (v.external) l->set_routing(ids.p, probs.p);
        l->set_forward_weights(read);
        l->forward(x.p, kT, y.p);
        return y.get();
      };
      const std::vector<bf16_t> y_read = forward_y(w, wh), y_set = forward_y(wh, wh), y_first = forward_y(w, w);
      expect_same_bits(y_set, y_read, "y of the parameters given to the forward");
      EXPECT_NE(y_read, y_first) << "halving W1 changed nothing: the test cannot tell the parameters apart";
    }
  }
}

INSTANTIATE_TEST_SUITE_P(Recipes, Routed,
                         ::testing::Combine(::testing::Values(Recipe::kBf16, Recipe::kBlockwise, Recipe::kFp8Naive,
                                                              Recipe::kFlow, Recipe::kFlowFp4),
                                            ::testing::Bool()),
                         [](const ::testing::TestParamInfo<std::tuple<Recipe, bool>>& p) {
                           return recipe_param_name(std::get<0>(p.param), std::get<1>(p.param));
                         });

}  // namespace
}  // namespace flowmoe
