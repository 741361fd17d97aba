// Expert biases and the clamped SwiGLU on the GPU (issue 46): the bias kernels equal their CPU
// references bit for bit (odd sizes, padding rows, a rows bound, NaN, accumulation, segments of
// many 128-row blocks), and the
// experts-only CUDA layer with gpt-oss's experts (clamped SwiGLU, GEMM1 bias) matches the CPU layer
// within the GEMM tolerance of test_moe_routed_gpu.cu, with the same bits with and without
// sync_free.
#include <cuda_runtime.h>
#include <gtest/gtest.h>

#include <cmath>
#include <functional>
#include <memory>
#include <random>
#include <string>
#include <vector>

#include "common/moe_config.h"
#include "common/routed_problem.h"
#include "cuda/device_buffer.h"
#include "cuda/gpu_test_util.h"
#include "flowmoe/cpu/convert.h"
#include "flowmoe/error.h"
#include "flowmoe/expert_bias.h"
#include "flowmoe/moe.h"
#include "flowmoe/numerics.h"
#include "flowmoe/swiglu.h"

namespace flowmoe {
namespace {

using namespace testutil;

Segments padded_segments(const std::vector<int32_t>& lens, int align) {
  Segments s;
  s.offsets.push_back(0);
  for (int32_t n : lens) s.offsets.push_back(s.offsets.back() + (n + align - 1) / align * align);
  return s;
}

// The first `rows` rows of a row-wise FP8 tensor (its scales [K/128][M] laid out for the fewer rows).
QTensor first_rows(const QTensor& q, int64_t rows) {
  QTensor f = q;
  f.rows = rows;
  f.codes.assign(q.codes.begin(), q.codes.begin() + rows * q.cols);
  f.scales.clear();
  for (int64_t b = 0; b < q.cols / 128; ++b)
    f.scales.insert(f.scales.end(), q.scales.begin() + b * q.rows, q.scales.begin() + b * q.rows + rows);
  return f;
}

TEST(ExpertBiasGpu, AddMatchesCpu) {
  REQUIRE_DEVICE();
  std::mt19937 rng(5);
  for (int64_t n : {8, 136, 5888}) {
    const Segments seg = padded_segments({37, 0, 1, 200, 64}, 16);
    const int64_t m = seg.num_tokens();
    std::vector<bf16_t> h = normal_bf16(m * n, 3.0f, rng);
    std::vector<float> b = normal_f32(seg.num_segments() * n, 2.0f, rng);
    h[3] = 0x7FC1;               // NaN in
    b[n + 1] = INFINITY;         // an infinite bias (segment 1 is empty)
    b[2] = -INFINITY;            // -inf bias on a row with +inf? -> NaN
    h[2] = 0x7F80;
    std::vector<bf16_t> want = h;
    cpu::add_expert_bias(want.data(), m, n, seg, b.data());
    DBuf<bf16_t> dh(h);
    DBuf<float> db(b);
    DBuf<int32_t> off(seg.offsets);
    cuda::add_expert_bias(dh.p, m, n, off.p, seg.num_segments(), db.p, nullptr, nullptr);
    expect_same_bits(want, dh.get(), "h + b1");
    // a rows bound: rows at or past it are left alone
    DBuf<bf16_t> dh2(h);
    DBuf<int32_t> bound(std::vector<int32_t>{static_cast<int32_t>(seg.offsets[3] + 5)});
    cuda::add_expert_bias(dh2.p, m, n, off.p, seg.num_segments(), db.p, bound.p, nullptr);
    std::vector<bf16_t> got2 = dh2.get();
    const size_t cut = size_t(seg.offsets[3] + 5) * n;
    expect_same_bits(want, got2, cut, "bounded rows");
    EXPECT_TRUE(std::equal(got2.begin() + cut, got2.end(), h.begin() + cut)) << "rows past the bound untouched";
  }
}

TEST(ExpertBiasGpu, GradMatchesCpu) {
  REQUIRE_DEVICE();
  std::mt19937 rng(6);
  for (int64_t n : {128, 384, 5888}) {
    // (1500 rows: 12 blocks of 128, more than one wave of the kernel's 8 warps)
    const Segments seg = padded_segments({300, 0, 1, 129, 1500}, 128);
    const int64_t m = seg.num_tokens();
    const int E = seg.num_segments();
    std::vector<bf16_t> dh = normal_bf16(m * n, 1.0f, rng);
    dh[n * 5 + 7] = 0x7FC0;
    std::vector<float> old = normal_f32(E * n, 1.0f, rng);
    QTensor q;
    cpu::quantize_row(dh.data(), m, n, &q);
    DBuf<bf16_t> d(dh);
    DBuf<uint8_t> codes(q.codes), scales(q.scales);
    DBuf<int32_t> off(seg.offsets);
    for (bool acc : {false, true}) {
      std::vector<float> want = old, want8 = old;
      cpu::expert_bias_grad(dh.data(), m, n, seg, want.data(), acc);
      cpu::expert_bias_grad(q, seg, want8.data(), acc);
      DBuf<float> g(old), g8(old);
      cuda::expert_bias_grad(d.p, m, n, off.p, E, g.p, acc, nullptr, nullptr);
      cuda::expert_bias_grad_fp8(codes.p, scales.p, m, n, off.p, E, g8.p, acc, nullptr, nullptr);
      expect_same_bits(want, g.get(), acc ? "db (bf16, +=)" : "db (bf16)");
      expect_same_bits(want8, g8.get(), acc ? "db (fp8, +=)" : "db (fp8)");
    }
    // a rows bound inside the last segment (sync_free's device row count): the rows past it are
    // not summed, as the reference over segments cut there
    const int32_t bound_row = seg.offsets[E - 1] + 777;
    Segments cut = seg;
    cut.offsets[E] = bound_row;
    std::vector<float> want = old;
    cpu::expert_bias_grad(dh.data(), bound_row, n, cut, want.data(), false);
    DBuf<float> gb(old);
    DBuf<int32_t> bound(std::vector<int32_t>{bound_row});
    cuda::expert_bias_grad(d.p, m, n, off.p, E, gb.p, false, bound.p, nullptr);
    expect_same_bits(want, gb.get(), "db (bf16) under a rows bound");
    // dh as gate / up pairs (the bf16 recipe reading gate_up_proj where stored): db in the layer's order
    std::vector<bf16_t> pairs(m * n);
    for (int64_t r = 0; r < m; ++r)
      for (int64_t j = 0; j < n / 2; ++j)
        pairs[r * n + 2 * j] = dh[r * n + j], pairs[r * n + 2 * j + 1] = dh[r * n + n / 2 + j];
    DBuf<bf16_t> dp(pairs);
    DBuf<float> gp(old);
    std::vector<float> want_pairs = old;
    cpu::expert_bias_grad(dh.data(), m, n, seg, want_pairs.data(), true);
    cuda::expert_bias_grad(dp.p, m, n, off.p, E, gp.p, true, nullptr, nullptr, /*dh_gate_up=*/true);
    expect_same_bits(want_pairs, gp.get(), "db (bf16 dh as gate / up pairs, +=)");
    std::vector<float> want8 = old;
    cpu::expert_bias_grad(first_rows(q, bound_row), cut, want8.data(), false);
    DBuf<float> gb8(old);
    cuda::expert_bias_grad_fp8(codes.p, scales.p, m, n, off.p, E, gb8.p, false, bound.p, nullptr);
    expect_same_bits(want8, gb8.get(), "db (fp8) under a rows bound");
  }
}

// GEMM1's bias added as the SwiGLU kernels read h (swiglu.h GateUpBias): the bits of
// add_expert_bias followed by the same kernel on the biased h, for the plain BF16 activation (the
// biased h stored back in place), the FP8 forward saving H row-wise and the one saving H as MXFP4
// (h left as it was); clamped activation, rows past the last segment (unbiased), NaN, an infinite
// bias, probabilities, and a rows bound.
TEST(ExpertBiasGpu, SwigluReadsBiasedH) {
  REQUIRE_DEVICE();
  std::mt19937 rng(8);
  GatedActivation act;
  act.kind = ActivationKind::kClampedSwiglu;
  act.limit = 1.5f;
  for (int64_t f : {128, 384}) {
    const int64_t n = 2 * f;
    const Segments seg = padded_segments({37, 0, 1, 200, 64}, 16);
    const int64_t rows = seg.num_tokens(), m = rows + 9;  // (9 rows past the last segment)
    const int E = seg.num_segments();
    std::vector<bf16_t> h = normal_bf16(m * n, 1.5f, rng);
    std::vector<float> b = normal_f32(E * n, 1.0f, rng), prow = normal_f32(m, 1.0f, rng);
    h[5] = 0x7FC1;        // NaN in
    b[3 * n + 9] = INFINITY;
    std::vector<bf16_t> hb = h;
    cpu::add_expert_bias(hb.data(), rows, n, seg, b.data());
    DBuf<float> db(b), dp(prow);
    DBuf<int32_t> off(seg.offsets);
    // plain BF16, biased h stored in place
    std::vector<bf16_t> want_a(m * f);
    cpu::swiglu(hb.data(), m, f, want_a.data(), prow.data(), act);
    DBuf<bf16_t> dh(h), da(m * f);
    cuda::GateUpBias stored{db.p, off.p, E, dh.p};
    cuda::swiglu(dh.p, m, f, da.p, nullptr, 0, dp.p, nullptr, act, stored);
    expect_same_bits(want_a, da.get(), "a' (bf16, b1 on read)");
    expect_same_bits(hb, dh.get(), "h + b1 stored in place");
    // FP8 a' and H row-wise; h only read
    QTensor arow, hrow;
    cpu::swiglu_quant(hb.data(), m, f, &arow, nullptr, nullptr, &hrow, prow.data(), act);
    DBuf<bf16_t> dh2(h);
    DBuf<uint8_t> ac(m * f), as(m * f / 128), hc(m * n), hs(m * n / 128);
    cuda::GateUpBias read{db.p, off.p, E, nullptr};
    cuda::swiglu_quant(dh2.p, m, f, ac.p, as.p, hc.p, hs.p, nullptr, 0, dp.p, nullptr, act, read);
    expect_same_bits(arow.codes, ac.get(), "a' codes (fp8, b1 on read)");
    expect_same_bits(arow.scales, as.get(), "a' scales (fp8, b1 on read)");
    expect_same_bits(hrow.codes, hc.get(), "saved H codes (b1 on read)");
    expect_same_bits(hrow.scales, hs.get(), "saved H scales (b1 on read)");
    expect_same_bits(h, dh2.get(), "h unchanged without biased_h");
    // H saved as MXFP4
    std::vector<bf16_t> hsv(m * n);
    cpu::saved_h(hb.data(), m, f, hsv.data(), act);
    QTensor h4;
    cpu::quantize_mxfp4(hsv.data(), m, n, &h4);
    DBuf<uint8_t> h4c(m * n / 2), h4s(m * n / 32);
    cuda::swiglu_quant_h4(dh2.p, m, f, ac.p, as.p, h4c.p, h4s.p, nullptr, 0, dp.p, nullptr, act, read);
    expect_same_bits(arow.codes, ac.get(), "a' codes (h mxfp4, b1 on read)");
    expect_same_bits(h4.codes, h4c.get(), "saved H mxfp4 codes (b1 on read)");
    expect_same_bits(h4.scales, h4s.get(), "saved H mxfp4 scales (b1 on read)");
    // a rows bound inside segment 3: the rows past it neither read nor stored
    const int32_t bound_row = seg.offsets[3] + 50;
    DBuf<bf16_t> dh3(h), da3(std::vector<bf16_t>(m * f, 0));
    DBuf<int32_t> bound(std::vector<int32_t>{bound_row});
    cuda::swiglu(dh3.p, m, f, da3.p, nullptr, 0, dp.p, bound.p, act, cuda::GateUpBias{db.p, off.p, E, dh3.p});
    const std::vector<bf16_t> got3 = dh3.get(), a3 = da3.get();
    expect_same_bits(hb, got3, size_t(bound_row) * n, "h + b1 under a rows bound");
    EXPECT_TRUE(std::equal(got3.begin() + size_t(bound_row) * n, got3.end(), h.begin() + size_t(bound_row) * n))
        << "rows past the bound untouched";
    expect_same_bits(want_a, a3, size_t(bound_row) * f, "a' under a rows bound");
  }
  // arguments: a bias without offsets, biased_h other than h
  DBuf<bf16_t> x(std::vector<bf16_t>(256, 0)), y(std::vector<bf16_t>(256, 0)), a(std::vector<bf16_t>(128, 0));
  DBuf<float> b(std::vector<float>(256, 0.f));
  DBuf<int32_t> off(std::vector<int32_t>{0, 1});
  expect_error([&] { cuda::swiglu(x.p, 1, 128, a.p, nullptr, 0, nullptr, nullptr, {}, cuda::GateUpBias{b.p, nullptr, 1, nullptr}); },
               "offsets");
  expect_error([&] { cuda::swiglu(x.p, 1, 128, a.p, nullptr, 0, nullptr, nullptr, {}, cuda::GateUpBias{b.p, off.p, 1, y.p}); },
               "biased_h is not h");
}

// Every E4M3 code under every kind of scale, a segment per kind so that each is seen: the smallest
// scales 2^-127 and 2^-126 (subnormal products), 2^0, the largest 2^127 (positive codes: sums
// overflowing to +inf), each without NaN codes; then NaN codes, and the NaN scale. Against the CPU
// reference's decode and sums, bit for bit.
TEST(ExpertBiasGpu, Fp8GradOfEveryCodeAndScale) {
  REQUIRE_DEVICE();
  const int64_t n = 256;
  const std::vector<int32_t> lens = {300, 256, 128, 200, 131, 128};
  const uint8_t kScale[] = {0, 1, 127, 254, 120, 255};
  const Segments seg = padded_segments(lens, 128);
  const int64_t m = seg.num_tokens();
  const int E = seg.num_segments();
  QTensor q;
  std::vector<bf16_t> zeros(m * n, 0);
  cpu::quantize_row(zeros.data(), m, n, &q);  // (the layout; codes and scales set below)
  for (int e = 0; e < E; ++e)
    for (int64_t r = seg.offsets[e]; r < seg.offsets[e + 1]; ++r) {
      for (int64_t c = 0; c < n; ++c) {
        uint8_t v = static_cast<uint8_t>((37 * c + 11 * r) & 0xFF);  // (every code, -0 = 0x80 among them)
        if (e < 4 && num::e4m3_is_nan(v)) v = static_cast<uint8_t>((v & 0x80u) | 0x7Eu);
        if (e == 3) v &= 0x7Fu;  // (+inf sums, no inf - inf)
        q.codes[r * n + c] = v;
      }
      for (int64_t b = 0; b < n / 128; ++b) q.scales[b * m + r] = kScale[e];
    }
  std::vector<float> old(E * n, 1.5f), want = old;
  cpu::expert_bias_grad(q, seg, want.data(), true);
  DBuf<uint8_t> codes(q.codes), scales(q.scales);
  DBuf<int32_t> off(seg.offsets);
  DBuf<float> g(old);
  cuda::expert_bias_grad_fp8(codes.p, scales.p, m, n, off.p, E, g.p, true, nullptr, nullptr);
  const std::vector<float> got = g.get();
  expect_same_bits(want, got, "db (fp8, every code)");
  // (each kind seen: finite sums under the small and unit scales, +inf under the largest, NaN last)
  for (int e : {0, 1, 2}) EXPECT_TRUE(std::isfinite(want[e * n])) << "segment " << e;
  EXPECT_TRUE(std::isinf(want[3 * n]) && want[3 * n] > 0);
  EXPECT_TRUE(std::isnan(want[4 * n]) && std::isnan(want[5 * n]));
}

// The experts-only layer with gpt-oss's experts: CUDA against the CPU layer, and sync_free's bits.
struct LayerOut {
  std::vector<bf16_t> y, dx;
  std::vector<float> dw1, dw2, dprobs, db1;
};

LayerOut run_gpu(const flowmoe_test::RoutedProblem& p, const MoeConfig& cfg, const std::vector<float>& b1,
            bool sync_free, bool fused_epilogues = false) {
  CudaLayerOptions opt;
  opt.sync_free = sync_free;
  if (fused_epilogues) {  // flow's GEMM1 + b1 + clamped SwiGLU and GEMM2-dgrad + dSwiGLU as one kernel each
    opt.fprop_dgrad = CudaLayerOptions::FpropDgrad::kGrouped;
    opt.fused_swiglu = opt.fused_dswiglu = true;
  }
  std::unique_ptr<MoeLayer> l = make_cuda_layer(cfg, nullptr, opt);
  const int64_t T = p.T, H = cfg.hidden;
  DBuf<float> w1(p.w1), w2(p.w2), b(b1), dw1(p.w1.size()), dw2(p.w2.size()), dprobs(p.probs.size()),
      db1(b1.size());
  DBuf<bf16_t> x(p.x), dy(p.dy), y(T * H), dx(T * H);
  DBuf<int32_t> ids(p.ids);
  DBuf<float> probs(p.probs);
  l->set_weights(MoeWeights{w1.p, w2.p, nullptr, nullptr});
  l->set_routing(ids.p, probs.p);
  l->set_gemm1_bias(b.p);
  l->forward(x.p, T, y.p);
  MoeGrads g{dw1.p, dw2.p, nullptr, false};
  g.dprobs = dprobs.p;
  g.db1 = db1.p;
  l->backward(dy.p, dx.p, g);
  return LayerOut{y.get(), dx.get(), dw1.get(), dw2.get(), dprobs.get(), db1.get()};
}

class ClampedBiasLayer : public ::testing::TestWithParam<Recipe> {};

TEST_P(ClampedBiasLayer, MatchesTheCpuLayerAndSyncFreeBits) {
  REQUIRE_SM90();
  const Recipe recipe = GetParam();
  constexpr int64_t H = 256, F = 384, T = 301;
  MoeConfig cfg = flowmoe_test::moe_config(H, F, 8, 2).align(128).recipe(recipe).max_tokens(T);
  const flowmoe_test::RoutedProblem p = flowmoe_test::make_routed_problem(cfg, T, 46);
  cfg.external_routing = true;
  cfg.activation.kind = ActivationKind::kClampedSwiglu;
  cfg.activation.alpha = 1.702f;
  cfg.activation.limit = 0.5f;  // small enough that many of this problem's h values are clamped
  cfg.gemm1_bias = true;
  std::vector<float> b1 = normal_f32(size_t(8) * 2 * F, 0.3f, 47u);
  const LayerOut gpu = run_gpu(p, cfg, b1, false), gpu_sf = run_gpu(p, cfg, b1, true);
  expect_same_bits(gpu.y, gpu_sf.y, "y (sync_free)");
  expect_same_bits(gpu.dw1, gpu_sf.dw1, "dW1 (sync_free)");
  expect_same_bits(gpu.db1, gpu_sf.db1, "db1 (sync_free)");
  if (recipe == Recipe::kFlow || recipe == Recipe::kFlowFp4) {  // the fused epilogues: the same bits
    const LayerOut fused = run_gpu(p, cfg, b1, false, true);
    expect_same_bits(gpu.y, fused.y, "y (fused epilogues)");
    expect_same_bits(gpu.dx, fused.dx, "dx (fused epilogues)");
    expect_same_bits(gpu.dw1, fused.dw1, "dW1 (fused epilogues)");
    expect_same_bits(gpu.dw2, fused.dw2, "dW2 (fused epilogues)");
    expect_same_bits(gpu.dprobs, fused.dprobs, "dprobs (fused epilogues)");
    expect_same_bits(gpu.db1, fused.db1, "db1 (fused epilogues)");
  }
  std::unique_ptr<MoeLayer> c = make_cpu_layer(cfg);
  c->set_weights(MoeWeights{p.w1.data(), p.w2.data(), nullptr, nullptr});
  c->set_routing(p.ids.data(), p.probs.data());
  c->set_gemm1_bias(b1.data());
  std::vector<bf16_t> y(T * H), dx(T * H);
  std::vector<float> dw1(p.w1.size()), dw2(p.w2.size()), dprobs(p.probs.size()), db1(b1.size());
  c->forward(p.x.data(), T, y.data());
  MoeGrads g{dw1.data(), dw2.data(), nullptr, false};
  g.dprobs = dprobs.data();
  g.db1 = db1.data();
  c->backward(p.dy.data(), dx.data(), g);
  const double tol = recipe == Recipe::kBf16 ? 2e-2 : 6e-2;
  EXPECT_LT(rel_rms(gpu.y, y), tol);
  EXPECT_LT(rel_rms(gpu.dx, dx), tol);
  EXPECT_LT(rel_rms(gpu.dw1, dw1), tol);
  EXPECT_LT(rel_rms(gpu.dw2, dw2), tol);
  EXPECT_LT(rel_rms(gpu.dprobs, dprobs), tol);
  EXPECT_LT(rel_rms(gpu.db1, db1), tol);
  double norm = 0;
  for (float v : gpu.db1) norm += double(v) * v;
  EXPECT_GT(norm, 0.0) << "db1 was written";
}

INSTANTIATE_TEST_SUITE_P(Recipes, ClampedBiasLayer,
                         ::testing::Values(Recipe::kBf16, Recipe::kBlockwise, Recipe::kFlow, Recipe::kFlowFp4),
                         [](const ::testing::TestParamInfo<Recipe>& p) { return recipe_param_name(p.param); });

}  // namespace
}  // namespace flowmoe
