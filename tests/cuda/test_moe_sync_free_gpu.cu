// The CUDA layer without host synchronisation (CudaLayerOptions::sync_free) and its step replayed
// from a CUDA graph (LayerStepGraph, flowmoe/cuda/moe_graph.h): for every recipe, the sync-free
// layer gives the default layer's bits (y, dx, dW1, dW2, dWr; bf16: the default with fprop_dgrad =
// kGrouped), status and cast report with zero host synchronisations, and a captured step replayed
// twice gives the eager step's bits.
// Runs on the device machine only (CTest label `gpu`).
#include <cuda_runtime.h>
#include <gtest/gtest.h>

#include <cmath>
#include <cstring>
#include <limits>
#include <memory>
#include <random>
#include <string>
#include <vector>

#include "common/moe_config.h"
#include "cuda/gpu_test_util.h"
#include "flowmoe/cuda/moe_debug.h"
#include "flowmoe/cuda/moe_graph.h"
#include "flowmoe/moe.h"

namespace flowmoe {
namespace {

using namespace testutil;

struct Model {
  int64_t H = 256, F = 256, T = 300;
  int E = 8, K = 2;
  std::vector<float> w1, w2, wr, bias, g0;
  std::vector<bf16_t> x, dy;
  explicit Model(int64_t tokens) : T(tokens) {
    std::mt19937 rng(777);
    w1 = normal_f32(E * 2 * F * H, 1.0f / std::sqrt(float(H)), rng);
    w2 = normal_f32(E * H * F, 1.0f / std::sqrt(float(F)), rng);
    wr = normal_f32(E * H, 1.0f / std::sqrt(float(H)), rng);
    bias = normal_f32(E, 0.1f, rng);
    g0 = normal_f32(E * 2 * F * H, 0.5f, rng);
    x = normal_bf16(T * H, 1.0f, rng);
    dy = normal_bf16(T * H, 1.0f, rng);
  }
  MoeConfig config(Recipe r) const {
    return flowmoe_test::moe_config(H, F, E, K).aux_loss(0.01f).align(128).recipe(r).max_tokens(T);
  }
};

// A layer with its buffers, the model's weights set, gradients starting at g0.
struct LayerRun {
  cudaStream_t s = nullptr;
  std::unique_ptr<MoeLayer> layer;
  std::unique_ptr<StreamBuf<float>> dw1, dw2, dwr, w1, w2, wr, bias;
  std::unique_ptr<StreamBuf<bf16_t>> x, dy, y, dx;
  MoeGrads g;
  // fused: flow's GEMM epilogues (CudaLayerOptions::fused_swiglu and fused_dswiglu)
  LayerRun(const Model& m, Recipe r, bool sync_free, bool accumulate, bool fused = false) {
    if (cudaStreamCreateWithFlags(&s, cudaStreamNonBlocking) != cudaSuccess) throw std::runtime_error("stream");
    CudaLayerOptions o;
    o.sync_free = sync_free;
    o.fused_swiglu = o.fused_dswiglu = fused;
    // bf16: the sync-free layer's GEMMs are the BF16 kernels, whose bits the default layer gives
    // with fprop_dgrad = kGrouped (its default, cuBLASLt, sums in another order: BF16CloseToCublasLt)
    if (r == Recipe::kBf16 && !sync_free) o.fprop_dgrad = CudaLayerOptions::FpropDgrad::kGrouped;
    layer = make_cuda_layer(m.config(r), s, o);
    const int64_t n1 = int64_t(m.E) * 2 * m.F * m.H, n2 = int64_t(m.E) * m.H * m.F;
    dw1.reset(new StreamBuf<float>(n1, s, m.g0.data()));
    dw2.reset(new StreamBuf<float>(n2, s, m.g0.data() + 7));
    dwr.reset(new StreamBuf<float>(m.E * m.H, s, m.g0.data() + 13));
    w1.reset(new StreamBuf<float>(n1, s, m.w1.data()));
    w2.reset(new StreamBuf<float>(n2, s, m.w2.data()));
    wr.reset(new StreamBuf<float>(m.E * m.H, s, m.wr.data()));
    bias.reset(new StreamBuf<float>(m.E, s, m.bias.data()));
    x.reset(new StreamBuf<bf16_t>(m.T * m.H, s, m.x.data()));
    dy.reset(new StreamBuf<bf16_t>(m.T * m.H, s, m.dy.data()));
    y.reset(new StreamBuf<bf16_t>(m.T * m.H, s));
    dx.reset(new StreamBuf<bf16_t>(m.T * m.H, s));
    layer->set_weights(MoeWeights{w1->p, w2->p, wr->p, bias->p});
    g = MoeGrads{dw1->p, dw2->p, dwr->p};
    g.accumulate = accumulate;
  }
  ~LayerRun() {
    layer.reset();
    cudaStreamSynchronize(s);
    cudaStreamDestroy(s);
  }
  void step(int64_t T) {
    layer->forward(x->p, T, y->p);
    layer->backward(dy->p, dx->p, g);
  }
  struct Out {
    std::vector<bf16_t> y, dx;
    std::vector<float> dw1, dw2, dwr;
  };
  Out out() const { return {y->get(s), dx->get(s), dw1->get(s), dw2->get(s), dwr->get(s)}; }
};

void expect_same(const LayerRun::Out& a, const LayerRun::Out& b, const std::string& what) {
  expect_same_bits(a.y, b.y, what + ": y");
  expect_same_bits(a.dx, b.dx, what + ": dx");
  expect_same_bits(a.dw1, b.dw1, what + ": dW1");
  expect_same_bits(a.dw2, b.dw2, what + ": dW2");
  expect_same_bits(a.dwr, b.dwr, what + ": dWr");
}

class MoeSyncFreeGpu : public ::testing::TestWithParam<Recipe> {};

TEST_P(MoeSyncFreeGpu, SameBitsStatusAndReportWithoutHostSync) {
  REQUIRE_SM90();
  for (int64_t T : {int64_t(300), int64_t(1)}) {
    const Model m(300);
    LayerRun ref(m, GetParam(), false, true), sf(m, GetParam(), true, true);
    for (int step = 0; step < 2; ++step) {  // the second step on reused workspaces
      ref.step(T);
      sf.step(T);
    }
    const std::string what = std::string(recipe_name(GetParam())) + " T=" + std::to_string(T);
    expect_same(ref.out(), sf.out(), what);
    EXPECT_EQ(cuda::moe::counters(sf.layer.get()).host_syncs, 0) << what;
    EXPECT_EQ(cuda::moe::counters(ref.layer.get()).host_syncs, 2) << what << ": one count fetch per forward";
    const MoeStatus a = ref.layer->status(), b = sf.layer->status();
    EXPECT_EQ(a.nonfinite, b.nonfinite) << what;
    EXPECT_EQ(a.underflow, b.underflow) << what;
    EXPECT_EQ(std::memcmp(&a.aux_loss, &b.aux_loss, sizeof(float)), 0) << what << ": aux loss";
    const CastReport& ra = ref.layer->cast_report();
    const CastReport& rb = sf.layer->cast_report();
    EXPECT_EQ(ra.to_string(), rb.to_string()) << what << ": cast report";
    EXPECT_EQ(ra.routed_rows, rb.routed_rows) << what;
    EXPECT_EQ(ra.padded_rows, rb.padded_rows) << what;
    EXPECT_EQ(ra.saved_bytes(), rb.saved_bytes()) << what;
    EXPECT_DOUBLE_EQ(ra.saved_bytes_per_token_unpadded(), rb.saved_bytes_per_token_unpadded()) << what;
  }
}

// `graph`'s step captured once and replayed twice, its outputs poisoned before each replay: every
// replay gives `eager`'s outputs, gradients and status counters (eager has run its step), with no
// host synchronisation.
void expect_replays_equal(LayerRun& graph, LayerRun& eager, int64_t T, const std::string& what) {
  const LayerRun::Out want = eager.out();
  const MoeStatus want_status = eager.layer->status();
  cuda::moe::LayerStepGraph g(graph.layer.get(), graph.s, {graph.x->p, T, graph.y->p, graph.dy->p, graph.dx->p, graph.g});
  for (int rep = 0; rep < 2; ++rep) {
    for (auto* b : {graph.dw1.get(), graph.dw2.get(), graph.dwr.get()})
      ASSERT_EQ(cudaMemsetAsync(b->p, 0xFF, b->n * sizeof(float), graph.s), cudaSuccess);
    ASSERT_EQ(cudaMemsetAsync(graph.y->p, 0xFF, graph.y->n * sizeof(bf16_t), graph.s), cudaSuccess);
    g.replay();
    ASSERT_EQ(cudaStreamSynchronize(graph.s), cudaSuccess);
    expect_same(want, graph.out(), what + " replay " + std::to_string(rep));
    const MoeStatus st = graph.layer->status();
    EXPECT_EQ(st.nonfinite, want_status.nonfinite) << what;
    EXPECT_EQ(st.underflow, want_status.underflow) << what;
  }
  EXPECT_EQ(cuda::moe::counters(graph.layer.get()).host_syncs, 0) << what;
}

TEST_P(MoeSyncFreeGpu, GraphReplayEqualsEagerStep) {
  REQUIRE_SM90();
  const Model m(300);
  LayerRun eager(m, GetParam(), true, false), graph(m, GetParam(), true, false);  // gradients overwritten
  eager.step(m.T);
  expect_replays_equal(graph, eager, m.T, recipe_name(GetParam()));
  EXPECT_EQ(graph.layer->cast_report().to_string(), eager.layer->cast_report().to_string());
}

// flow's fused GEMM epilogues (SwiGLU in GEMM1's, dSwiGLU in GEMM2-dgrad's) captured and replayed:
// every replay gives the bits of the eager step without them.
TEST(MoeSyncFreeGpuFused, GraphReplayEqualsTheUnfusedEagerStep) {
  REQUIRE_SM90();
  const Model m(300);
  for (Recipe r : {Recipe::kFlow, Recipe::kFlowFp4}) {
    const std::string what = std::string(recipe_name(r)) + " fused epilogues";
    LayerRun eager(m, r, true, false), graph(m, r, true, false, /*fused=*/true);
    eager.step(m.T);
    expect_replays_equal(graph, eager, m.T, what);
  }
}

// A training step in one graph: LayerStepGraph::Step::weights puts set_weights (BF16 copies and FP8
// quantization of the FP32 masters) at the start of every replay, so masters changed in place
// between replays (an optimizer step) are what the next replay computes with, as an eager step
// after set_weights does; nothing synchronises with the host, set_weights included.
TEST_P(MoeSyncFreeGpu, GraphWithWeightUpdateFollowsTheMasters) {
  REQUIRE_SM90();
  const Model m(300);
  LayerRun eager(m, GetParam(), true, false), graph(m, GetParam(), true, false);
  const MoeWeights gw{graph.w1->p, graph.w2->p, graph.wr->p, graph.bias->p};
  cuda::moe::LayerStepGraph::Step st{graph.x->p, m.T, graph.y->p, graph.dy->p, graph.dx->p, graph.g};
  st.weights = &gw;
  cuda::moe::LayerStepGraph g(graph.layer.get(), graph.s, st);
  const std::string what = recipe_name(GetParam());
  std::vector<float> w1 = m.w1, w2 = m.w2;
  for (int update = 0; update < 3; ++update) {
    if (update > 0) {  // "optimizer step": new masters, written in place
      for (size_t i = 0; i < w1.size(); ++i) w1[i] = w1[i] * 0.75f + 0.001f * float(int(i % 7) - 3);
      for (size_t i = 0; i < w2.size(); ++i) w2[i] = -w2[i];
      for (auto* r : {&eager, &graph}) {
        ASSERT_EQ(cudaMemcpyAsync(r->w1->p, w1.data(), w1.size() * 4, cudaMemcpyHostToDevice, r->s), cudaSuccess);
        ASSERT_EQ(cudaMemcpyAsync(r->w2->p, w2.data(), w2.size() * 4, cudaMemcpyHostToDevice, r->s), cudaSuccess);
      }
      eager.layer->set_weights(MoeWeights{eager.w1->p, eager.w2->p, eager.wr->p, eager.bias->p});
    }
    eager.step(m.T);
    g.replay();
    expect_same(eager.out(), graph.out(), what + " after " + std::to_string(update) + " weight update(s)");
  }
  EXPECT_EQ(cuda::moe::counters(graph.layer.get()).host_syncs, 0);
  EXPECT_EQ(graph.layer->status().nonfinite, 0) << what;
}

// sync_free: set_weights does not synchronise, so the non-finite weights are counted into
// status().nonfinite (from the next forward on) instead of thrown, each once; the default layer
// throws.
TEST(MoeSyncFreeGpuWeights, NonFiniteWeightsAreCountedNotThrown) {
  REQUIRE_SM90();
  Model m(300);
  m.w1[5] = std::numeric_limits<float>::quiet_NaN();
  m.w2[9] = std::numeric_limits<float>::infinity();
  {
    LayerRun sf(m, Recipe::kFlow, true, false);  // (its constructor calls set_weights)
    sf.step(m.T);
    const MoeStatus st = sf.layer->status();
    const CastReport& r = sf.layer->cast_report();  // the passes' own counts (the weights poison them)
    EXPECT_EQ(st.nonfinite - r.forward_stats.nonfinite - r.backward_stats.nonfinite, 2) << "the two weights";
  }
  cudaStream_t s = nullptr;
  ASSERT_EQ(cudaStreamCreateWithFlags(&s, cudaStreamNonBlocking), cudaSuccess);
  {
    auto layer = make_cuda_layer(m.config(Recipe::kFlow), s, CudaLayerOptions{});
    StreamBuf<float> w1(m.w1.size(), s, m.w1.data()), w2(m.w2.size(), s, m.w2.data()), wr(m.wr.size(), s, m.wr.data());
    EXPECT_THROW(layer->set_weights(MoeWeights{w1.p, w2.p, wr.p, nullptr}), NonFiniteError);
    cudaStreamSynchronize(s);
  }
  cudaStreamDestroy(s);
}

INSTANTIATE_TEST_SUITE_P(Recipes, MoeSyncFreeGpu,
                         ::testing::Values(Recipe::kBf16, Recipe::kBlockwise, Recipe::kFp8Naive, Recipe::kFlow,
                                           Recipe::kFlowFp4),
                         [](const ::testing::TestParamInfo<Recipe>& i) {
                           std::string n = recipe_name(i.param);
                           for (char& c : n)
                             if (c == '-') c = '_';
                           return n;
                         });

// bf16 sync-free against the default bf16 layer (cuBLASLt per expert): the same math with FP32
// sums in another order, so close (relative RMS difference within 2^-7 on every output; a wrong
// operand layout gives ~1, a missed expert of the eight ~0.35), with no host synchronisation and six BF16 kernel
// launches (two each of fprop, dgrad, wgrad) per step instead of cuBLASLt calls.
TEST(MoeSyncFreeGpuBf16, CloseToCublasLtDefault) {
  REQUIRE_SM90();
  const Model m(300);
  LayerRun sf(m, Recipe::kBf16, true, false);
  cudaStream_t s = sf.s;
  auto def = make_cuda_layer(m.config(Recipe::kBf16), s, CudaLayerOptions{});
  StreamBuf<float> w1(m.w1.size(), s, m.w1.data()), w2(m.w2.size(), s, m.w2.data()), wr(m.wr.size(), s, m.wr.data()),
      bias(m.bias.size(), s, m.bias.data());
  StreamBuf<float> dw1(sf.dw1->n, s), dw2(sf.dw2->n, s), dwr(sf.dwr->n, s);
  StreamBuf<bf16_t> y(sf.y->n, s), dx(sf.dx->n, s);
  def->set_weights(MoeWeights{w1.p, w2.p, wr.p, bias.p});
  def->forward(sf.x->p, m.T, y.p);
  def->backward(sf.dy->p, dx.p, MoeGrads{dw1.p, dw2.p, dwr.p});
  sf.step(m.T);
  const LayerRun::Out a = sf.out();
  const auto rel_rms = [](const std::vector<float>& got, const std::vector<float>& want) {
    double d = 0, n = 0;
    for (size_t i = 0; i < want.size(); ++i) d += (got[i] - want[i]) * double(got[i] - want[i]), n += double(want[i]) * want[i];
    return std::sqrt(d / (n > 0 ? n : 1));
  };
  const auto widen = [](const std::vector<bf16_t>& v) {
    std::vector<float> f(v.size());
    for (size_t i = 0; i < v.size(); ++i) f[i] = num::bf16_to_f32(v[i]);
    return f;
  };
  const double tol = 1.0 / 128;
  EXPECT_LE(rel_rms(widen(a.y), widen(y.get(s))), tol) << "y";
  EXPECT_LE(rel_rms(widen(a.dx), widen(dx.get(s))), tol) << "dx";
  EXPECT_LE(rel_rms(a.dw1, dw1.get(s)), tol) << "dW1";
  EXPECT_LE(rel_rms(a.dw2, dw2.get(s)), tol) << "dW2";
  EXPECT_LE(rel_rms(a.dwr, dwr.get(s)), tol) << "dWr";
  const auto c = cuda::moe::counters(sf.layer.get());
  EXPECT_EQ(c.host_syncs, 0);
  EXPECT_EQ(c.gemm_bf16_kernel_launches, 6);
  EXPECT_EQ(c.gemm_matmuls, 0) << "no cuBLASLt call";
  EXPECT_GT(cuda::moe::counters(def.get()).gemm_matmuls, 0) << "the default bf16 layer runs cuBLASLt";
  def.reset();
  cudaStreamSynchronize(s);
}

// The options the sync-free layer does not take are refused at construction, and a layer that
// synchronises cannot be captured; both with errors that say what to change.
TEST(MoeSyncFreeGpuErrors, RejectedConfigurations) {
  REQUIRE_SM90();
  const Model m(16);
  CudaLayerOptions o;
  o.sync_free = true;
  cudaStream_t s = nullptr;
  ASSERT_EQ(cudaStreamCreateWithFlags(&s, cudaStreamNonBlocking), cudaSuccess);
  MoeConfig a16 = m.config(Recipe::kFlow);
  a16.align = 16;
  EXPECT_THROW(make_cuda_layer(a16, s, o), Error);
  {
    LayerRun sync(m, Recipe::kFlow, false, false);
    try {
      cuda::moe::LayerStepGraph g(sync.layer.get(), sync.s, {sync.x->p, m.T, sync.y->p, sync.dy->p, sync.dx->p, sync.g});
      ADD_FAILURE() << "captured a layer that synchronises";
    } catch (const Error& e) {
      EXPECT_NE(std::string(e.what()).find("sync_free"), std::string::npos) << e.what();
    }
    sync.step(m.T);  // still usable
    EXPECT_EQ(cudaStreamSynchronize(sync.s), cudaSuccess);
  }
  cudaStreamDestroy(s);
}

}  // namespace
}  // namespace flowmoe
