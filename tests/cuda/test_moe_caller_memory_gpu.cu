// The CUDA layer on caller memory (CudaLayerOptions::caller_memory, the PyTorch op's mode): two
// forwards in flight (step_state / load_step; a step's bytes backing a second backward), the scratch region overwritten with 0xFF between
// every call, the weights and saved regions moved to other addresses before the backward, give
// the bits of the layer that owns its memory running (forward, backward) pairs. Every recipe, with
// and without sync_free, and the flow pipeline with its fused epilogues. The FP8 recipes' weights
// region holds W alone (each backward transposes W^T from it). Also: the plan is smaller than the
// owned layer's allocation, and misuse (unbound regions, a step of another layer, take_step on
// owned memory) is a clear error.
#include <cuda_runtime.h>
#include <gtest/gtest.h>

#include <cmath>
#include <memory>
#include <string>
#include <vector>

#include "common/moe_config.h"
#include "cuda/device_buffer.h"
#include "cuda/gpu_test_util.h"
#include "flowmoe/cuda/moe_debug.h"
#include "flowmoe/error.h"
#include "flowmoe/moe.h"

namespace flowmoe {
namespace {

using namespace testutil;

constexpr int64_t kH = 256, kF = 256, kTm = 300;
constexpr int kE = 8, kK = 2;

MoeConfig config(Recipe r) {
  return flowmoe_test::moe_config(kH, kF, kE, kK).aux_loss(0.01f).align(128).recipe(r).max_tokens(kTm);
}

struct Step {
  std::vector<bf16_t> y, dx;
  std::vector<float> dw1, dw2, dwr;
};

struct Inputs {
  DBuf<float> w1, w2, wr;
  DBuf<bf16_t> x1, dy1, x2, dy2;
  Inputs()
      : w1(normal_f32(kE * 2 * kF * kH, 1.0f / 16, 1)), w2(normal_f32(kE * kH * kF, 1.0f / 16, 2)),
        wr(normal_f32(kE * kH, 1.0f / 16, 3)), x1(normal_bf16(kTm * kH, 1.0f, 4)), dy1(normal_bf16(kTm * kH, 1.0f, 5)),
        x2(normal_bf16(211 * kH, 1.0f, 6)), dy2(normal_bf16(211 * kH, 1.0f, 7)) {}
  MoeWeights weights() const { return MoeWeights{w1.p, w2.p, wr.p, nullptr}; }
};

struct Outs {
  DBuf<bf16_t> y, dx;
  DBuf<float> dw1, dw2, dwr;
  explicit Outs(int64_t T)
      : y(T * kH), dx(T * kH), dw1(kE * 2 * kF * kH), dw2(kE * kH * kF), dwr(kE * kH) {}
  MoeGrads grads() { return MoeGrads{dw1.p, dw2.p, dwr.p, false}; }
  Step get() const { return Step{y.get(), dx.get(), dw1.get(), dw2.get(), dwr.get()}; }
};

void expect_same(const Step& want, const Step& got, const std::string& what) {
  expect_same_bits(want.y, got.y, what + " y");
  expect_same_bits(want.dx, got.dx, what + " dx");
  expect_same_bits(want.dw1, got.dw1, what + " dW1");
  expect_same_bits(want.dw2, got.dw2, what + " dW2");
  expect_same_bits(want.dwr, got.dwr, what + " dWr");
}

// A region of the caller's memory (null when the plan asks for none).
struct Region {
  void* p = nullptr;
  int64_t n = 0;
  explicit Region(int64_t bytes) : n(bytes) {
    if (bytes) EXPECT_EQ(cudaMalloc(&p, size_t(bytes)), cudaSuccess);
  }
  ~Region() { cudaFree(p); }
  void poison() {
    if (n) EXPECT_EQ(cudaMemset(p, 0xFF, size_t(n)), cudaSuccess);
  }
};

class CallerMemory : public ::testing::TestWithParam<std::tuple<Recipe, bool>> {};

void two_forwards_in_flight_give_the_bits_of_owned_pairs(Recipe recipe, CudaLayerOptions opt) {
  Inputs in;
  const int64_t T1 = kTm, T2 = 211;

  // the layer that owns its memory: (forward, backward) pairs
  std::unique_ptr<MoeLayer> owned = make_cuda_layer(config(recipe), nullptr, opt);
  owned->set_weights(in.weights());
  Outs a1(T1), a2(T2);
  owned->forward(in.x1.p, T1, a1.y.p);
  owned->backward(in.dy1.p, a1.dx.p, a1.grads());
  owned->forward(in.x2.p, T2, a2.y.p);
  owned->backward(in.dy2.p, a2.dx.p, a2.grads());
  ASSERT_EQ(cudaDeviceSynchronize(), cudaSuccess);

  // caller memory: forward 1, forward 2, backward 2, backward 1
  opt.caller_memory = true;
  std::unique_ptr<MoeLayer> l = make_cuda_layer(config(recipe), nullptr, opt);
  const MoeMemoryPlan plan = l->memory_plan();
  EXPECT_GT(plan.weights, 0);
  EXPECT_GT(plan.saved, 0);
  EXPECT_GT(plan.transient, 0);
  EXPECT_LT(cuda::moe::allocated_bytes(l.get()), cuda::moe::allocated_bytes(owned.get()));
  // FP8 recipes: the weights region holds W alone (each backward transposes W^T from it), i.e.
  // less than the codes of W and W^T together
  const int64_t expert_params = int64_t(kE) * 3 * kF * kH;
  if (recipe != Recipe::kBf16) EXPECT_LT(plan.weights, 2 * expert_params) << recipe_name(recipe);
  Region w(plan.weights), s1(plan.saved), s2(plan.saved), t(plan.transient);
  t.poison();
  l->bind_memory(MoeMemory{w.p, nullptr, t.p});
  l->set_weights(in.weights());
  Outs b1(T1), b2(T2);
  t.poison();
  l->bind_memory(MoeMemory{w.p, s1.p, t.p});
  l->forward(in.x1.p, T1, b1.y.p);
  const std::vector<uint8_t> st1 = l->step_state();
  t.poison();
  l->bind_memory(MoeMemory{w.p, s2.p, t.p});
  l->forward(in.x2.p, T2, b2.y.p);
  const std::vector<uint8_t> st2 = l->step_state();
  t.poison();
  l->load_step(st2.data(), st2.size());
  l->backward(in.dy2.p, b2.dx.p, b2.grads());
  t.poison();
  // the first forward's weights and saved bytes moved elsewhere (e.g. offloaded and brought back)
  Region w_moved(plan.weights), s1_moved(plan.saved);
  ASSERT_EQ(cudaMemcpy(w_moved.p, w.p, size_t(plan.weights), cudaMemcpyDeviceToDevice), cudaSuccess);
  ASSERT_EQ(cudaMemcpy(s1_moved.p, s1.p, size_t(plan.saved), cudaMemcpyDeviceToDevice), cudaSuccess);
  w.poison();
  s1.poison();
  l->bind_memory(MoeMemory{w_moved.p, s1_moved.p, t.p});
  l->load_step(st1.data(), st1.size());
  l->backward(in.dy1.p, b1.dx.p, b1.grads());
  // the first forward's bytes again (PyTorch's retain_graph): the same bits; the backward must not
  // have changed what its forward saved
  Outs again1(T1);
  ASSERT_EQ(cudaMemcpy(again1.y.p, b1.y.p, size_t(T1 * kH) * sizeof(bf16_t), cudaMemcpyDeviceToDevice), cudaSuccess);
  t.poison();
  l->load_step(st1.data(), st1.size());
  l->backward(in.dy1.p, again1.dx.p, again1.grads());
  ASSERT_EQ(cudaDeviceSynchronize(), cudaSuccess);
  const std::string what = std::string(recipe_name(recipe)) + (opt.sync_free ? " sync_free" : "") +
                           (opt.fused_swiglu ? " fused epilogues" : "");
  expect_same(a1.get(), b1.get(), what + " first forward");
  expect_same(a2.get(), b2.get(), what + " second forward");
  expect_same(a1.get(), again1.get(), what + " first forward's second backward");
  EXPECT_EQ(l->status().nonfinite, 0);
}

TEST_P(CallerMemory, TwoForwardsInFlightGiveTheBitsOfOwnedPairs) {
  REQUIRE_SM90();
  CudaLayerOptions opt;
  opt.sync_free = std::get<1>(GetParam());
  two_forwards_in_flight_give_the_bits_of_owned_pairs(std::get<0>(GetParam()), opt);
}

// The fused epilogues keep W1 with its gate/up blocks interleaved: the backward's W1^T is the
// transpose of the natural order all the same.
TEST(CallerMemoryFused, FlowPipelineWithFusedEpiloguesGivesTheBitsOfOwnedPairs) {
  REQUIRE_SM90();
  for (Recipe recipe : {Recipe::kFlow, Recipe::kFlowFp4}) {
    CudaLayerOptions opt;
    opt.fprop_dgrad = CudaLayerOptions::FpropDgrad::kGrouped;
    opt.fused_swiglu = opt.fused_dswiglu = true;
    two_forwards_in_flight_give_the_bits_of_owned_pairs(recipe, opt);
  }
}

INSTANTIATE_TEST_SUITE_P(Recipes, CallerMemory,
                         ::testing::Combine(::testing::Values(Recipe::kBf16, Recipe::kBlockwise, Recipe::kFp8Naive,
                                                              Recipe::kFlow, Recipe::kFlowFp4),
                                            ::testing::Bool()),
                         [](const ::testing::TestParamInfo<std::tuple<Recipe, bool>>& p) {
                           return recipe_param_name(std::get<0>(p.param), std::get<1>(p.param));
                         });

TEST(CallerMemoryErrors, UnboundRegionsForeignStepsAndOwnedStepsAreClearErrors) {
  REQUIRE_SM90();
  Inputs in;
  CudaLayerOptions opt;
  opt.caller_memory = true;
  std::unique_ptr<MoeLayer> l = make_cuda_layer(config(Recipe::kFlow), nullptr, opt);
  std::unique_ptr<MoeLayer> other = make_cuda_layer(config(Recipe::kFlow), nullptr, opt);
  try {
    l->set_weights(in.weights());
    FAIL() << "set_weights without bound regions";
  } catch (const Error& e) {
    EXPECT_NE(std::string(e.what()).find("bind_memory"), std::string::npos) << e.what();
  }
  const MoeMemoryPlan plan = l->memory_plan();
  Region w(plan.weights), s(plan.saved), t(plan.transient);
  char* unaligned = static_cast<char*>(t.p) + 16;
  EXPECT_THROW(l->bind_memory(MoeMemory{w.p, s.p, unaligned}), Error);
  l->bind_memory(MoeMemory{w.p, nullptr, t.p});
  l->set_weights(in.weights());
  Outs o(kTm);
  EXPECT_THROW(l->forward(in.x1.p, kTm, o.y.p), Error);  // no saved region bound
  l->bind_memory(MoeMemory{w.p, s.p, t.p});
  l->forward(in.x1.p, kTm, o.y.p);
  const std::vector<uint8_t> st = l->step_state();
  EXPECT_THROW(l->load_step(st.data(), st.size() - 1), Error);  // truncated
  std::unique_ptr<MoeLayer> fp4 = make_cuda_layer(config(Recipe::kFlowFp4), nullptr, opt);
  EXPECT_THROW(fp4->load_step(st.data(), st.size()), Error);  // a layer of another shape
  std::unique_ptr<MoeLayer> cpu = make_cpu_layer(config(Recipe::kFlow));
  EXPECT_THROW(cpu->load_step(st.data(), st.size()), Error);  // the other backend
  other->load_step(st.data(), st.size());                      // a value: any layer of this shape
  std::unique_ptr<MoeLayer> owned = make_cuda_layer(config(Recipe::kFlow), nullptr, CudaLayerOptions());
  owned->set_weights(in.weights());
  owned->forward(in.x1.p, kTm, o.y.p);
  EXPECT_THROW(owned->step_state(), Error);  // owned memory: one forward in flight
  EXPECT_THROW(owned->bind_memory(MoeMemory{w.p, s.p, t.p}), Error);
  ASSERT_EQ(cudaDeviceSynchronize(), cudaSuccess);
}

}  // namespace
}  // namespace flowmoe
