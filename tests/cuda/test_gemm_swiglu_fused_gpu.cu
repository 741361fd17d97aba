// GEMM1 with the fused SwiGLU epilogue (GroupedGemm::fprop_swiglu over W1 interleaved by
// interleave_gate_up) against the unfused path on the same inputs: the grouped fprop writing h in
// BF16, then cuda::swiglu_quant (flow: h saved as FP8 rows) or swiglu_quant_h4 (flow-fp4: h saved
// as MXFP4). Every output byte equal, including the bytes neither path may write (rows past
// offsets[E], the poisoned tail), and the same non-finite count, on ragged experts (0, 1, 129, 300
// rows), rows with widely spread magnitudes, and injected NaN / Inf (also a row whose a' overflows
// while h stays finite). Then the layer: flow and flow-fp4 with CudaLayerOptions::fused_swiglu and
// fused_dswiglu (GEMM2-dgrad's epilogue, test_gemm_dswiglu_fused_gpu.cu) on and off give the same
// y, dx, dW1, dW2, dWr and status. GPU label.
#include <cuda_runtime.h>
#include <gtest/gtest.h>

#include <cmath>
#include <limits>
#include <memory>
#include <random>
#include <string>
#include <vector>

#include "common/moe_config.h"
#include "cuda/gpu_test_util.h"
#include "flowmoe/cuda/convert.h"
#include "flowmoe/cuda/qtensor_view.h"
#include "flowmoe/cuda/status.h"
#include "flowmoe/error.h"
#include "flowmoe/gemm.h"
#include "flowmoe/moe.h"
#include "flowmoe/swiglu.h"

namespace flowmoe {
namespace {

using namespace testutil;

constexpr int64_t kK = 256, kF = 384;  // 3 gate + 3 up blocks per expert: 3 output tiles of 256
const std::vector<int> kCounts = {0, 1, 129, 300, 0, 128, 7};
constexpr int64_t kTailRows = 40;  // rows past offsets[E]: neither path may write them

struct Case {
  bool mxfp4_h;       // flow-fp4 (h saved MXFP4) or flow (h saved FP8 rows)
  bool f32_w_scales;  // W1's scales GEMM-ready FP32 (the layer's) or UE8M0
  bool nonfinite;     // NaN / Inf injected into x
  bool gpt_oss = false;  // the clamped SwiGLU (h spread far past its limit) and GEMM1's bias
};

void run_case(const Case& c) {
  const int E = int(kCounts.size());
  std::vector<int32_t> off(E + 1, 0);
  for (int e = 0; e < E; ++e) off[e + 1] = off[e] + kCounts[e];
  const int64_t rows = off[E], m = rows + kTailRows;
  std::mt19937 rng(1234u + 2u * c.mxfp4_h + 4u * c.f32_w_scales + 8u * c.nonfinite + 16u * c.gpt_oss);
  GatedActivation act;
  if (c.gpt_oss) act.kind = ActivationKind::kClampedSwiglu;  // alpha 1.702, limit 7 (gpt-oss's)
  // x rows with magnitudes 2^-8 .. 2^8 (scale exponents spread over tiles), plus special rows
  std::vector<float> xf = normal_f32(m * kK, 1.0f, rng);
  for (int64_t r = 0; r < m; ++r)
    for (int64_t k = 0; k < kK; ++k) xf[r * kK + k] = std::ldexp(xf[r * kK + k], int(r % 17) - 8);
  if (c.nonfinite) {
    const float inf = std::numeric_limits<float>::infinity(), nan = std::numeric_limits<float>::quiet_NaN();
    // offsets 0 0 1 130 430 430 558 565: expert 2 rows 1 .. 129 (row 129 alone in its token tile)
    xf[129 * kK + 5] = nan;
    xf[200 * kK + 140] = inf;   // expert 3
    xf[431 * kK + 7] = -inf;    // expert 5
    xf[570 * kK + 3] = inf;     // past offsets[E]: never counted
    // expert 5: |h| ~ 2^72 stays finite in BF16, a' = silu(gate) up overflows to Inf
    for (int64_t k = 0; k < kK; ++k) xf[500 * kK + k] = std::ldexp(xf[500 * kK + k] >= 0 ? 1.0f : -1.0f, 72);
  }
  std::vector<bf16_t> xb(m * kK);
  for (size_t i = 0; i < xb.size(); ++i) xb[i] = num::f32_to_bf16(xf[i]);
  const std::vector<bf16_t> wb = normal_bf16(int64_t(E) * 2 * kF * kK, 1.0f / 16, rng);
  std::vector<float> prob(m);
  std::uniform_real_distribution<float> u01(0.0f, 1.0f);
  for (float& p : prob) p = u01(rng);

  // GEMM1's bias [E, 2F] (gate then up): magnitudes up to ~16, so that it moves values across the
  // limit; with non-finite input also an infinite bias and a NaN bias
  std::vector<float> bias = normal_f32(int64_t(E) * 2 * kF, 4.0f, rng);
  if (c.nonfinite) {
    bias[3 * 2 * kF + 17] = std::numeric_limits<float>::infinity();      // expert 3, a gate feature
    bias[6 * 2 * kF + kF + 300] = std::numeric_limits<float>::quiet_NaN();  // expert 6, an up feature
  }
  DBuf<float> d_bias(bias);
  const float* b1 = c.gpt_oss ? d_bias.p : nullptr;
  DBuf<bf16_t> x_bf(xb), w_bf(wb);
  DBuf<float> d_prob(prob);
  DBuf<int32_t> d_off(off);
  cuda::GateUpBias ref_bias;  // the unfused SwiGLU kernel adds it as it reads h
  if (c.gpt_oss) ref_bias = cuda::GateUpBias{d_bias.p, d_off.p, E, nullptr};
  ManagedStatus quant_st, ref_st, fused_st;
  DBuf<uint8_t> x_c(m * kK), x_s((kK / 128) * m);
  cuda::quantize_row(x_bf.p, m, kK, x_c.p, x_s.p, quant_st.p, 0);
  const cuda::QTensorView x = cuda::row_1x128(x_c.p, x_s.p, m, kK);
  // W1 [E][2F, K] in the natural order (gate rows, then up rows), and interleaved
  const int64_t n1 = int64_t(E) * 2 * kF * kK, sblk = (2 * kF / 128) * (kK / 128);
  DBuf<uint8_t> w_c(n1), w_s(E * sblk), wt_c(n1), wt_s(E * sblk);
  for (int e = 0; e < E; ++e)
    cuda::quantize_weight(w_bf.p + e * 2 * kF * kK, 2 * kF, kK, w_c.p + e * 2 * kF * kK, w_s.p + e * sblk,
                          wt_c.p + e * 2 * kF * kK, wt_s.p + e * sblk, quant_st.p, 0);
  DBuf<float> w_f32(gemm::weight_scale_f32_elems(E, 2 * kF, kK));
  cuda::QTensorView w_nat = cuda::weight_128x128(w_c.p, w_s.p, E, 2 * kF, kK);
  if (c.f32_w_scales) {
    cuda::weight_scales_to_f32(w_s.p, E, 2 * kF, kK, w_f32.p, 0);
    w_nat = cuda::weight_128x128_f32(w_c.p, w_f32.p, E, 2 * kF, kK);
  }
  DBuf<uint8_t> wi_c(n1), wi_s(w_nat.scale_bytes());
  cuda::QTensorView w_int = w_nat;
  w_int.codes = wi_c.p;
  w_int.scales = wi_s.p;
  cuda::interleave_gate_up(w_nat, w_int, 0);

  // outputs: a' [m, F] + [F/128][m]; h FP8 [m, 2F] + [2F/128][m] or MXFP4 [m, F] bytes + [m][2F/32]
  const int64_t h_code_bytes = c.mxfp4_h ? m * kF : m * 2 * kF;
  const int64_t h_scale_bytes = c.mxfp4_h ? m * (2 * kF / 32) : (2 * kF / 128) * m;
  DBuf<uint8_t> ra_c(m * kF), ra_s((kF / 128) * m), rh_c(h_code_bytes), rh_s(h_scale_bytes);
  DBuf<uint8_t> fa_c(m * kF), fa_s((kF / 128) * m), fh_c(h_code_bytes), fh_s(h_scale_bytes);
  cuda::GroupedGemm gg;
  const gemm::DeviceSegments seg{d_off.p, E, m, nullptr};
  {  // unfused: BF16 h, then the SwiGLU kernel on the rows < offsets[E]
    DBuf<bf16_t> h(m * 2 * kF);
    gg.fprop(seg, 2 * kF, kK, x, w_nat, {h.p, m * 2 * kF}, 0);
    if (c.mxfp4_h)
      cuda::swiglu_quant_h4(h.p, m, kF, ra_c.p, ra_s.p, rh_c.p, rh_s.p, ref_st.p, 0, d_prob.p, d_off.p + E, act,
                            ref_bias);
    else
      cuda::swiglu_quant(h.p, m, kF, ra_c.p, ra_s.p, rh_c.p, rh_s.p, ref_st.p, 0, d_prob.p, d_off.p + E, act,
                         ref_bias);
    ASSERT_CUDA_OK(cudaDeviceSynchronize());
  }
  const cuda::QTensorView h_out = c.mxfp4_h ? cuda::mxfp4_1x32(fh_c.p, fh_s.p, m, 2 * kF)
                                            : cuda::row_1x128(fh_c.p, fh_s.p, m, 2 * kF);
  gg.fprop_swiglu(seg, kF, kK, x, w_int, d_prob.p, cuda::row_1x128(fa_c.p, fa_s.p, m, kF), h_out, fused_st.p, 0, act,
                  b1);
  ASSERT_CUDA_OK(cudaDeviceSynchronize());
  EXPECT_EQ(gg.stats().grouped_kernel_calls, 2);

  const std::string what = std::string(c.mxfp4_h ? "h mxfp4" : "h fp8") + (c.f32_w_scales ? ", fp32 w scales" : "") +
                           (c.nonfinite ? ", nan/inf" : "") + (c.gpt_oss ? ", clamped + bias" : "");
  expect_same_bits(ra_c.get(), fa_c.get(), what + ": a' codes");
  expect_same_bits(ra_s.get(), fa_s.get(), what + ": a' scales");
  expect_same_bits(rh_c.get(), fh_c.get(), what + ": h codes");
  expect_same_bits(rh_s.get(), fh_s.get(), what + ": h scales");
  EXPECT_EQ(ref_st.p->nonfinite, fused_st.p->nonfinite) << what;
  if (c.nonfinite)
    EXPECT_GT(ref_st.p->nonfinite, 0u) << what << ": the injected values must reach h and a'";
  else
    EXPECT_EQ(ref_st.p->nonfinite, 0u) << what;
  // the tail rows untouched (both paths; poison bytes)
  const std::vector<uint8_t> fa = fa_c.get();
  for (int64_t i = rows * kF; i < m * kF; ++i)
    if (fa[i] != kPoisonByte) {
      ADD_FAILURE() << what << ": a' byte " << i << " past offsets[E] written";
      break;
    }
}

TEST(GemmSwigluFusedGpu, FlowBitsEqualUnfused) {
  REQUIRE_SM90();
  run_case({false, false, false});
  run_case({false, true, false});
}
TEST(GemmSwigluFusedGpu, FlowFp4BitsEqualUnfused) {
  REQUIRE_SM90();
  run_case({true, false, false});
  run_case({true, true, false});
}
TEST(GemmSwigluFusedGpu, NonFiniteCountedAsUnfused) {
  REQUIRE_SM90();
  run_case({false, true, true});
  run_case({true, true, true});
}

// gpt-oss: the clamped SwiGLU with its saved-h marks and GEMM1's bias added in the epilogue
TEST(GemmSwigluFusedGpu, ClampedSwigluWithBiasBitsEqualUnfused) {
  REQUIRE_SM90();
  run_case({false, true, false, true});
  run_case({true, false, false, true});
  run_case({false, true, true, true});
  run_case({true, true, true, true});
}

TEST(GemmSwigluFusedGpu, BadArgumentsRejected) {
  REQUIRE_SM90();
  const int E = 2;
  const int64_t m = 256;
  DBuf<int32_t> d_off(std::vector<int32_t>{0, 100, 256});
  DBuf<uint8_t> x_c(m * kK), x_s(m * kK / 128), w_c(E * 2 * kF * kK), w_s(E * 2 * kF * kK / 128 / 128);
  DBuf<uint8_t> a_c(m * kF), a_s(m * kF / 128), h_c(m * 2 * kF), h_s(m * 2 * kF / 128);
  const cuda::QTensorView x = cuda::row_1x128(x_c.p, x_s.p, m, kK);
  const cuda::QTensorView w = cuda::weight_128x128(w_c.p, w_s.p, E, 2 * kF, kK);
  const cuda::QTensorView a = cuda::row_1x128(a_c.p, a_s.p, m, kF), h = cuda::row_1x128(h_c.p, h_s.p, m, 2 * kF);
  cuda::GroupedGemm gg;
  const gemm::DeviceSegments seg{d_off.p, E, m, nullptr};
  EXPECT_THROW(gg.fprop_swiglu(seg, kF - 64, kK, x, w, nullptr, a, h, nullptr, 0), Error);    // F not % 128
  EXPECT_THROW(gg.fprop_swiglu(seg, kF, kK, x, w, nullptr, h, h, nullptr, 0), Error);         // a' [m, 2F]
  EXPECT_THROW(gg.fprop_swiglu(seg, kF, kK, x, w, nullptr, a, a, nullptr, 0), Error);         // h [m, F]
  const cuda::QTensorView w_half = cuda::weight_128x128(w_c.p, w_s.p, E, kF, kK);
  EXPECT_THROW(gg.fprop_swiglu(seg, kF, kK, x, w_half, nullptr, a, h, nullptr, 0), Error);    // W1 [F, K]
  DBuf<float> bias(E * 2 * kF + 4);
  EXPECT_THROW(gg.fprop_swiglu(seg, kF, kK, x, w, nullptr, a, h, nullptr, 0, {}, bias.p + 1), Error);  // unaligned bias
  GatedActivation bad_act;
  bad_act.kind = ActivationKind::kClampedSwiglu;
  bad_act.limit = 0.0f;
  EXPECT_THROW(gg.fprop_swiglu(seg, kF, kK, x, w, nullptr, a, h, nullptr, 0, bad_act), Error);  // limit 0
  cuda::QTensorView w_odd = cuda::weight_128x128(w_c.p, w_s.p, 3, 128, kK);                  // 128 rows per expert
  EXPECT_THROW(cuda::interleave_gate_up(w_odd, w_odd, 0), Error);
  EXPECT_THROW(cuda::interleave_gate_up(w, w, 0), Error);                                     // in place
  ASSERT_CUDA_OK(cudaDeviceSynchronize());
}

// ---- the layer: fused_swiglu on / off ------------------------------------------------------------
struct LayerOut {
  std::vector<bf16_t> y, dx;
  std::vector<float> dw1, dw2, dwr;
  MoeStatus st;
  int64_t fused_fwd = 0;  // CastKind::kFused operators of the forward
  int64_t fused_bwd = 0;  // and of the backward
};

LayerOut run_layer(Recipe r, bool fused, bool sync_free, int64_t T, bool fused_bwd = false) {
  constexpr int64_t H = 256, F = 384;
  constexpr int E = 8, K = 2, Tmax = 300;
  std::mt19937 rng(4242);
  const std::vector<float> w1 = normal_f32(E * 2 * F * H, 1.0f / 16, rng), w2 = normal_f32(E * H * F, 1.0f / 20, rng);
  const std::vector<float> wr = normal_f32(E * H, 1.0f / 16, rng);
  const std::vector<bf16_t> x = normal_bf16(Tmax * H, 1.0f, rng), dy = normal_bf16(Tmax * H, 1.0f, rng);
  const MoeConfig cfg = flowmoe_test::moe_config(H, F, E, K).align(128).recipe(r).max_tokens(Tmax);
  CudaLayerOptions o;
  o.fprop_dgrad = CudaLayerOptions::FpropDgrad::kGrouped;
  o.fused_swiglu = fused;
  o.fused_dswiglu = fused_bwd;
  o.sync_free = sync_free;
  cudaStream_t s = nullptr;
  if (cudaStreamCreateWithFlags(&s, cudaStreamNonBlocking) != cudaSuccess) throw std::runtime_error("stream");
  LayerOut out;
  {
    std::unique_ptr<MoeLayer> layer = make_cuda_layer(cfg, s, o);
    StreamBuf<float> dw1(w1.size(), s), dw2(w2.size(), s), dwr(wr.size(), s);
    StreamBuf<float> w1d(w1.size(), s, w1.data()), w2d(w2.size(), s, w2.data()), wrd(wr.size(), s, wr.data());
    StreamBuf<bf16_t> xd(x.size(), s, x.data()), dyd(dy.size(), s, dy.data()), y(x.size(), s), dx(x.size(), s);
    layer->set_weights(MoeWeights{w1d.p, w2d.p, wrd.p, nullptr});
    for (int step = 0; step < 2; ++step) {  // the second on reused workspaces
      layer->forward(xd.p, T, y.p);
      layer->backward(dyd.p, dx.p, MoeGrads{dw1.p, dw2.p, dwr.p});
    }
    out = LayerOut{y.get(s), dx.get(s), dw1.get(s), dw2.get(s), dwr.get(s), layer->status()};
    out.fused_fwd = layer->cast_report().count(MoePass::kForward, CastKind::kFused);
    out.fused_bwd = layer->cast_report().count(MoePass::kBackward, CastKind::kFused);
  }
  cudaStreamDestroy(s);
  return out;
}

// Every output, gradient and counter of two layer runs bit for bit.
void expect_same_layer(const LayerOut& a, const LayerOut& b, const std::string& what) {
  expect_same_bits(a.y, b.y, what + ": y");
  expect_same_bits(a.dx, b.dx, what + ": dx");
  expect_same_bits(a.dw1, b.dw1, what + ": dW1");
  expect_same_bits(a.dw2, b.dw2, what + ": dW2");
  expect_same_bits(a.dwr, b.dwr, what + ": dWr");
  EXPECT_EQ(a.st.nonfinite, b.st.nonfinite) << what;
  EXPECT_EQ(a.st.underflow, b.st.underflow) << what;
}

class MoeFusedSwigluGpu : public ::testing::TestWithParam<Recipe> {};

TEST_P(MoeFusedSwigluGpu, SameBitsAsTwoKernels) {
  REQUIRE_SM90();
  for (bool sync_free : {false, true})
    for (int64_t T : {int64_t(300), int64_t(1)}) {  // T = 1: most experts empty
      const std::string what = std::string(recipe_name(GetParam())) + " T=" + std::to_string(T) +
                               (sync_free ? " sync-free" : "");
      const LayerOut a = run_layer(GetParam(), false, sync_free, T), b = run_layer(GetParam(), true, sync_free, T);
      expect_same_layer(a, b, what);
      EXPECT_EQ(a.fused_fwd, b.fused_fwd) << what << ": the SwiGLU operator counted once either way";
    }
}

TEST_P(MoeFusedSwigluGpu, SameBitsWithTheFusedDswiglu) {
  REQUIRE_SM90();
  for (bool sync_free : {false, true})
    for (int64_t T : {int64_t(300), int64_t(1)}) {
      const LayerOut a = run_layer(GetParam(), false, sync_free, T);
      for (bool fwd_too : {false, true}) {
        const std::string what = std::string(recipe_name(GetParam())) + " T=" + std::to_string(T) +
                                 (sync_free ? " sync-free" : "") + (fwd_too ? " fused fwd + bwd" : " fused bwd");
        const LayerOut b = run_layer(GetParam(), fwd_too, sync_free, T, /*fused_bwd=*/true);
        expect_same_layer(a, b, what);
        EXPECT_EQ(a.fused_bwd, b.fused_bwd) << what << ": the dSwiGLU operator counted once either way";
      }
    }
}

INSTANTIATE_TEST_SUITE_P(Recipes, MoeFusedSwigluGpu, ::testing::Values(Recipe::kFlow, Recipe::kFlowFp4),
                         [](const ::testing::TestParamInfo<Recipe>& i) {
                           return std::string(i.param == Recipe::kFlow ? "flow" : "flow_fp4");
                         });

}  // namespace
}  // namespace flowmoe
