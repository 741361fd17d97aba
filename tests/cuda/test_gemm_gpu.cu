// Grouped GEMMs on the GPU (cuBLASLt) against the CPU reference, and the scale conversion kernels
// against the host layouts bit for bit. Runs on the device machine only (CTest label `gpu`).
//
// Tolerance: see gemm_test_problem.h (documented in docs/GEMM.md).
#include <cuda_runtime.h>
#include <gtest/gtest.h>

#include <algorithm>
#include <cmath>
#include <cstring>
#include <functional>
#include <iostream>
#include <random>
#include <string>
#include <vector>

#include "flowmoe/cpu/convert.h"
#include "flowmoe/cuda/convert.h"
#include "flowmoe/error.h"
#include "flowmoe/gemm.h"
#include "flowmoe/numerics.h"
#include "cuda/gemm_test_problem.h"
#include "cuda/gpu_test_util.h"

namespace flowmoe {
namespace {

using namespace testutil;  // DBuf, REQUIRE_DEVICE, REQUIRE_SM90, ASSERT_CUDA_OK, same_bits

using namespace gemmtest;  // problems, device copies, references, tolerance


class GemmGpu : public ::testing::TestWithParam<Case> {};

TEST_P(GemmGpu, Fp8MatchesReferenceWithinTolerance) {
  REQUIRE_SM90();
  const Case& c = GetParam();
  const Problem p = make_problem(c, false, 1000u + static_cast<uint32_t>(c.n * 7 + c.k));
  Device d(p);
  // the converted scales are the host layouts, bit for bit
  expect_same_bits(gemm::act_scales_f32(p.x_row, p.seg), d.xr_s.get(), "x row scales");
  expect_same_bits(gemm::act_scales_f32(p.dy_row, p.seg), d.dyr_s.get(), "dy row scales");
  expect_same_bits(gemm::col_scales_f32(p.x_col), d.xc_s.get(), "x col scales");
  expect_same_bits(gemm::col_scales_f32(p.dy_col), d.dyc_s.get(), "dy col scales");
  expect_same_bits(gemm::weight_scales_f32(p.wq), d.w_s.get(), "w scales");
  expect_same_bits(gemm::weight_scales_f32(p.wtq), d.wt_s.get(), "wt scales");

  const Refs r = fp8_refs(p);
  cuda::GroupedGemm gg(env_gemm_options());
  const int ne = nonempty(p.seg), empty = p.E - ne;

  GBuf<bf16_t> y(p.m * p.n), dx(p.m * p.k), dw16(p.E * p.n * p.k);
  GBuf<float> dw32(p.E * p.n * p.k);
  gg.fprop(p.seg, p.n, p.k, d.op(d.xr_c, d.xr_s), d.op(d.w_c, d.w_s), y.span(), 0);
  EXPECT_EQ(gg.stats().matmuls, ne) << "one matmul per non-empty expert";
  EXPECT_TRUE(close(widen(y.get()), r.y, r.sy, {1.0 / 256, kFp8C}, std::string(c.name) + " fprop"));

  gg.dgrad(p.seg, p.n, p.k, d.op(d.dyr_c, d.dyr_s), d.op(d.wt_c, d.wt_s), dx.span(), 0);
  EXPECT_TRUE(close(widen(dx.get()), r.dx, r.sdx, {1.0 / 256, kFp8C}, std::string(c.name) + " dgrad"));

  gg.wgrad(p.seg, p.n, p.k, d.op(d.dyc_c, d.dyc_s), d.op(d.xc_c, d.xc_s),
           gemm::WgradOut::bf16(dw16.p, dw16.n), 0);
  EXPECT_TRUE(close(widen(dw16.get()), r.dw, r.sdw, {1.0 / 256, kFp8C}, std::string(c.name) + " wgrad bf16"));
  gg.wgrad(p.seg, p.n, p.k, d.op(d.dyc_c, d.dyc_s), d.op(d.xc_c, d.xc_s),
           gemm::WgradOut::f32(dw32.p, dw32.n), 0);
  EXPECT_TRUE(close(dw32.get(), r.dw, r.sdw, {0.0, kFp8C}, std::string(c.name) + " wgrad f32"));
  EXPECT_EQ(gg.stats().zero_fills, 2 * empty) << "empty experts' dW zeroed in overwrite modes";

  // accumulate into main gradients: G = G0 + dW
  std::vector<float> g0(dw32.n), want(dw32.n);
  std::mt19937 rng(5);
  std::normal_distribution<float> nd(0.f, 1.f);
  for (size_t i = 0; i < g0.size(); ++i) g0[i] = nd(rng) * 100.0f, want[i] = g0[i] + r.dw[i];
  dw32.put(g0);
  gg.wgrad(p.seg, p.n, p.k, d.op(d.dyc_c, d.dyc_s), d.op(d.xc_c, d.xc_s),
           gemm::WgradOut::accumulate(dw32.p, dw32.n), 0);
  const auto got = dw32.get();
  EXPECT_TRUE(close(got, want, r.sdw, {2 * kU, kFp8C}, std::string(c.name) + " wgrad accumulate"));
  for (int e = 0; e < p.E; ++e)
    if (p.seg.offsets[e + 1] == p.seg.offsets[e])
      for (int64_t i = 0; i < p.n * p.k; ++i)
        ASSERT_EQ(got[e * p.n * p.k + i], g0[e * p.n * p.k + i]) << "empty expert " << e << " must be untouched";

  // the same shapes again: no new heuristic query
  const auto before = gg.stats();
  gg.fprop(p.seg, p.n, p.k, d.op(d.xr_c, d.xr_s), d.op(d.w_c, d.w_s), y.span(), 0);
  EXPECT_EQ(gg.stats().heuristic_queries, before.heuristic_queries) << "plan cache";
  EXPECT_EQ(cudaDeviceSynchronize(), cudaSuccess);
}

TEST_P(GemmGpu, Fp8ExactOnSmallValues) {
  REQUIRE_SM90();
  const Case& c = GetParam();
  const Problem p = make_problem(c, true, 77u + static_cast<uint32_t>(c.n));
  Device d(p);
  const Refs r = fp8_refs(p);
  cuda::GroupedGemm gg(env_gemm_options());
  GBuf<bf16_t> y(p.m * p.n), dx(p.m * p.k);
  GBuf<float> dw(p.E * p.n * p.k);
  gg.fprop(p.seg, p.n, p.k, d.op(d.xr_c, d.xr_s), d.op(d.w_c, d.w_s), y.span(), 0);
  gg.dgrad(p.seg, p.n, p.k, d.op(d.dyr_c, d.dyr_s), d.op(d.wt_c, d.wt_s), dx.span(), 0);
  gg.wgrad(p.seg, p.n, p.k, d.op(d.dyc_c, d.dyc_s), d.op(d.xc_c, d.xc_s), gemm::WgradOut::f32(dw.p, dw.n), 0);
  expect_same_bits(widen(narrow(r.y)), widen(y.get()), "fprop (BF16 of the exact value)");
  expect_same_bits(widen(narrow(r.dx)), widen(dx.get()), "dgrad (BF16 of the exact value)");
  // wgrad's FP32 output shows the tensor cores' in-block accumulator (about 14 significant bits,
  // measured on the H200: errors of one unit in the 14th bit, e.g. 252.984375 -> 252.96875), so
  // it is compared to that precision, relative to S = sum |a||b| (the partial sums' scale; a value
  // of 40.078125 came out as 40.0625); fprop and dgrad round to BF16 and must match exactly.
  {
    const auto got = dw.get();
    size_t bad = 0, first = 0;
    for (size_t i = 0; i < got.size(); ++i)
      if (std::fabs(static_cast<double>(got[i]) - r.dw[i]) > std::ldexp(r.sdw[i], -12) && bad++ == 0) first = i;
    EXPECT_EQ(bad, 0u) << "wgrad (FP32) beyond 2^-12 S: first at " << first << " (want " << r.dw[first]
                       << ", got " << got[first] << ")";
  }
}

TEST_P(GemmGpu, Bf16MatchesReferenceWithinTolerance) {
  REQUIRE_DEVICE();
  const Case& c = GetParam();
  const Problem p = make_problem(c, false, 2000u + static_cast<uint32_t>(c.k));
  const int64_t m = p.m, n = p.n, k = p.k;
  const int E = p.E;
  std::vector<float> y(m * n), dx(m * k), dw(E * n * k);
  cpu::grouped_fprop_bf16_ref(p.x.data(), p.w.data(), p.seg, n, k, y.data());
  cpu::grouped_dgrad_bf16_ref(p.dy.data(), p.w.data(), p.seg, n, k, dx.data());
  cpu::grouped_wgrad_bf16_ref(p.dy.data(), p.x.data(), p.seg, n, k, dw.data(), false);
  std::vector<double> sy(m * n), sdx(m * k), sdw(E * n * k);
  const auto xf = widen(p.x), dyf = widen(p.dy), wf = widen(p.w);
  const auto dyt = transpose(dyf, m, n), xt = transpose(xf, m, k);
  for (int e = 0; e < E; ++e) {
    const int64_t t0 = p.seg.offsets[e], t1 = p.seg.offsets[e + 1];
    abs_gemm(xf.data(), &wf[e * n * k], t0, t1, n, k, sy.data(), n);
    const auto wte = transpose(std::vector<float>(wf.begin() + e * n * k, wf.begin() + (e + 1) * n * k), n, k);
    abs_gemm(dyf.data(), wte.data(), t0, t1, k, n, sdx.data(), k);
    for (int64_t i = 0; i < n; ++i)
      for (int64_t j = 0; j < k; ++j) {
        double s = 0;
        for (int64_t t = t0; t < t1; ++t) s += std::fabs(static_cast<double>(dyt[i * m + t]) * xt[j * m + t]);
        sdw[(e * n + i) * k + j] = s;
      }
  }
  GBuf<bf16_t> gx(p.x), ddy(p.dy), dwt(p.w), gy(m * n), gdx(m * k), gdw16(E * n * k);
  GBuf<float> gdw32(E * n * k);
  cuda::GroupedGemm gg(env_gemm_options());
  const Tol t16{1.0 / 256, 1.0 / 16384}, t32{0.0, 1.0 / 16384};
  gg.fprop_bf16(p.seg, n, k, gx.cspan(), dwt.cspan(), gy.span(), 0);
  EXPECT_TRUE(close(widen(gy.get()), y, sy, t16, std::string(c.name) + " bf16 fprop"));
  gg.dgrad_bf16(p.seg, n, k, ddy.cspan(), dwt.cspan(), gdx.span(), 0);
  EXPECT_TRUE(close(widen(gdx.get()), dx, sdx, t16, std::string(c.name) + " bf16 dgrad"));
  gg.wgrad_bf16(p.seg, n, k, ddy.cspan(), gx.cspan(), gemm::WgradOut::bf16(gdw16.p, gdw16.n), 0);
  EXPECT_TRUE(close(widen(gdw16.get()), dw, sdw, t16, std::string(c.name) + " bf16 wgrad bf16"));
  gg.wgrad_bf16(p.seg, n, k, ddy.cspan(), gx.cspan(), gemm::WgradOut::f32(gdw32.p, gdw32.n), 0);
  EXPECT_TRUE(close(gdw32.get(), dw, sdw, t32, std::string(c.name) + " bf16 wgrad f32"));
  std::vector<float> g0(gdw32.n, 0.5f), want(gdw32.n);
  for (size_t i = 0; i < g0.size(); ++i) want[i] = g0[i] + dw[i];
  gdw32.put(g0);
  gg.wgrad_bf16(p.seg, n, k, ddy.cspan(), gx.cspan(), gemm::WgradOut::accumulate(gdw32.p, gdw32.n), 0);
  EXPECT_TRUE(close(gdw32.get(), want, sdw, {2 * kU, 1.0 / 16384}, std::string(c.name) + " bf16 wgrad accumulate"));
  EXPECT_EQ(cudaDeviceSynchronize(), cudaSuccess);
}

// Counts are multiples of 16 (the FP8 wgrad requirement); "one_token" is one real token padded
// with 15 zero rows, the production case (permute+pad).
INSTANTIATE_TEST_SUITE_P(
    Experts, GemmGpu,
    ::testing::Values(Case{"three_one_empty", {64, 0, 80}, 256, 384, {}},
                      Case{"five_one_token_padded", {16, 256, 0, 144, 32}, 384, 256,
                           {1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15}},
                      Case{"k1408_partial_blocks", {208, 48}, 256, 1408, {}},
                      Case{"seven_small", {16, 32, 0, 48, 16, 0, 64}, 128, 128, {}},
                      Case{"dense", {512}, 512, 512, {}},
                      // every count a multiple of 128: the FP8 wgrads with FP32 output run flowmoe's
                      // sm_90a kernel (zero-token experts, a padded one-token expert, K 1408)
                      Case{"aligned128_empty", {256, 0, 128, 384, 0}, 256, 384, {}},
                      Case{"aligned128_k1408_one_token", {128, 256}, 384, 1408,
                           [] { std::vector<int64_t> z; for (int64_t r = 1; r < 128; ++r) z.push_back(r); return z; }()}),
    [](const ::testing::TestParamInfo<Case>& i) { return std::string(i.param.name); });

// BF16 takes any token counts, including a single unpadded token.
TEST(GemmGpuBf16, UnpaddedTinyExperts) {
  REQUIRE_DEVICE();
  const Segments seg = Segments::from_counts({1, 7, 0, 33});
  const int64_t m = seg.num_tokens(), n = 136, k = 264;
  const auto x = make_data(m, k, 1, false), dy = make_data(m, n, 2, false), w = make_data(4 * n, k, 3, false);
  std::vector<float> y(m * n), dx(m * k), dw(4 * n * k);
  cpu::grouped_fprop_bf16_ref(x.data(), w.data(), seg, n, k, y.data());
  cpu::grouped_dgrad_bf16_ref(dy.data(), w.data(), seg, n, k, dx.data());
  cpu::grouped_wgrad_bf16_ref(dy.data(), x.data(), seg, n, k, dw.data(), false);
  GBuf<bf16_t> gx(x), gdy(dy), gw(w), gy(m * n), gdx(m * k);
  GBuf<float> gdw(4 * n * k);
  cuda::GroupedGemm gg(env_gemm_options());
  gg.fprop_bf16(seg, n, k, gx.cspan(), gw.cspan(), gy.span(), 0);
  gg.dgrad_bf16(seg, n, k, gdy.cspan(), gw.cspan(), gdx.span(), 0);
  gg.wgrad_bf16(seg, n, k, gdy.cspan(), gx.cspan(), gemm::WgradOut::f32(gdw.p, gdw.n), 0);
  EXPECT_EQ(gg.stats().matmuls, 9);
  EXPECT_EQ(gg.stats().zero_fills, 1);
  // loose relative check (the parametrised test has the S-based bound)
  auto rel = [](const std::vector<float>& got, const std::vector<float>& ref) {
    double num = 0, den = 0;
    for (size_t i = 0; i < ref.size(); ++i) num += (got[i] - ref[i]) * double(got[i] - ref[i]), den += double(ref[i]) * ref[i];
    return std::sqrt(num / std::max(den, 1e-300));
  };
  EXPECT_LT(rel(widen(gy.get()), y), 1.0 / 256);
  EXPECT_LT(rel(widen(gdx.get()), dx), 1.0 / 256);
  EXPECT_LT(rel(gdw.get(), dw), 1e-5);
}

// ---- concurrency and algorithm choice --------------------------------------------------------------
// The pool of streams and the tuned algorithm change no bit: the concurrent path equals the serial
// one (the same object with set_concurrency(1), so the same algorithm choices), every call equals
// the first (which timed the candidates, writing trial outputs), and wgrad accumulation is never
// disturbed by the trials. No CPU reference here: the tolerance tests above run the default object.
struct Bits {
  std::vector<bf16_t> y, dx, dw16;
  std::vector<float> dw32, acc1, acc2;  // overwrite; G0 + dW; G0 + dW + dW
};

// Every pass and output kind once, accumulation twice from the same G0.
Bits run_passes(cuda::GroupedGemm& gg, const Problem& p, const Device& d, const std::vector<float>& g0,
                cudaStream_t s) {
  GBuf<bf16_t> y(p.m * p.n), dx(p.m * p.k), dw16(p.E * p.n * p.k);  // poisoned (NaN)
  GBuf<float> dw32(p.E * p.n * p.k), acc(p.E * p.n * p.k);
  // the poison is written on the legacy stream, which a non-blocking `s` does not wait for
  EXPECT_EQ(cudaDeviceSynchronize(), cudaSuccess);
  gg.fprop(p.seg, p.n, p.k, d.op(d.xr_c, d.xr_s), d.op(d.w_c, d.w_s), y.span(), s);
  gg.dgrad(p.seg, p.n, p.k, d.op(d.dyr_c, d.dyr_s), d.op(d.wt_c, d.wt_s), dx.span(), s);
  const auto dyc = d.op(d.dyc_c, d.dyc_s), xc = d.op(d.xc_c, d.xc_s);
  gg.wgrad(p.seg, p.n, p.k, dyc, xc, gemm::WgradOut::bf16(dw16.p, dw16.n), s);
  gg.wgrad(p.seg, p.n, p.k, dyc, xc, gemm::WgradOut::f32(dw32.p, dw32.n), s);
  Bits b;
  acc.put(g0);
  EXPECT_EQ(cudaDeviceSynchronize(), cudaSuccess);  // the copy is on the legacy stream too
  gg.wgrad(p.seg, p.n, p.k, dyc, xc, gemm::WgradOut::accumulate(acc.p, acc.n), s);
  b.acc1 = acc.get();
  gg.wgrad(p.seg, p.n, p.k, dyc, xc, gemm::WgradOut::accumulate(acc.p, acc.n), s);
  b.acc2 = acc.get();
  b.y = y.get();
  b.dx = dx.get();
  b.dw16 = dw16.get();
  b.dw32 = dw32.get();
  return b;
}

using testutil::same_bits;  // the element overload, next to this one
::testing::AssertionResult same_bits(const Bits& a, const Bits& b) {
  for (auto r : {same_bits(a.y, b.y), same_bits(a.dx, b.dx), same_bits(a.dw16, b.dw16)})
    if (!r) return r << " (bf16 output: y, dx or dw bf16)";
  for (auto r : {same_bits(a.dw32, b.dw32), same_bits(a.acc1, b.acc1), same_bits(a.acc2, b.acc2)})
    if (!r) return r << " (fp32 output: dw, G0 + dW or G0 + 2 dW)";
  return ::testing::AssertionSuccess();
}

cuda::GroupedGemm::Options own_tuning(int streams) {
  cuda::GroupedGemm::Options o;  // defaults: tuning on, 8 candidates
  o.streams = streams;
  o.tune = true;
  o.share_tuning = false;  // this object times its own keys (the test needs the first call to tune)
  o.wgrad_kernel = cuda::GroupedGemm::Options::WgradKernel::kOff;  // the cuBLASLt pool is under test
                                                                    // (the sm_90a wgrad kernel: below)
  return o;
}

std::vector<float> random_grads(size_t n, uint32_t seed) {
  std::vector<float> g(n);
  std::mt19937 rng(seed);
  std::normal_distribution<float> nd(0.f, 1.f);
  for (auto& v : g) v = nd(rng);
  return g;
}

class GemmGpuConcurrency : public ::testing::TestWithParam<Case> {};

TEST_P(GemmGpuConcurrency, BitIdenticalToSerialAndAcrossCalls) {
  REQUIRE_SM90();
  const Case& c = GetParam();
  const Problem p = make_problem(c, false, 4000u + static_cast<uint32_t>(c.n + c.k));
  const Device d(p);
  const std::vector<float> g0 = random_grads(p.E * p.n * p.k, 11);
  const int ne = nonempty(p.seg);

  cuda::GroupedGemm gg(own_tuning(4));
  const Bits first = run_passes(gg, p, d, g0, 0);  // times every key (on its first expert)
  const auto tuned = gg.stats();
  EXPECT_GT(tuned.tunings, 0);
  EXPECT_EQ(tuned.tunings, tuned.tuned_keys);
  EXPECT_EQ(tuned.concurrent_calls, ne > 1 ? 6 : 0) << "six calls, each on min(4, experts) streams";
  for (const auto& r : gg.tune_records()) {
    const std::string how = r.how;
    EXPECT_TRUE(how == "timed" || how == "one candidate") << r.what << ": " << how;
    EXPECT_GE(r.picked, 0);
    EXPECT_LT(r.picked, r.candidates);
    EXPECT_FALSE(r.shared);
    std::cout << "    [" << c.name << "] " << r.what << (r.accumulate ? " +=" : "") << " m " << r.m << " n " << r.n
              << " k " << r.k << " bucket " << r.token_bucket << ": " << how << ", picked " << r.picked << " of "
              << r.candidates << " (algo " << r.algo_id << ", tile " << r.tile_id << ", split-k " << r.splitk
              << "), " << r.picked_us << " us vs first " << r.first_us << " us\n";
  }

  const Bits again = run_passes(gg, p, d, g0, 0);
  EXPECT_TRUE(same_bits(first, again)) << "second call vs the first (which tuned)";
  EXPECT_EQ(gg.stats().tunings, tuned.tunings) << "no key is timed twice";
  gg.set_concurrency(1);
  EXPECT_TRUE(same_bits(first, run_passes(gg, p, d, g0, 0))) << "serial (one stream) vs four streams";
  gg.set_concurrency(3);
  EXPECT_TRUE(same_bits(first, run_passes(gg, p, d, g0, 0))) << "three streams vs four";
  gg.set_concurrency(4);
  cudaStream_t s = nullptr;
  ASSERT_CUDA_OK(cudaStreamCreateWithFlags(&s, cudaStreamNonBlocking));
  EXPECT_TRUE(same_bits(first, run_passes(gg, p, d, g0, s))) << "on a non-blocking caller stream";
  ASSERT_CUDA_OK(cudaStreamDestroy(s));
  EXPECT_EQ(gg.stats().tunings, tuned.tunings);
  EXPECT_THROW(gg.set_concurrency(5), Error);
  EXPECT_THROW(gg.set_concurrency(0), Error);

  // empty experts: zeroed in the overwrite modes, untouched when accumulating
  const int64_t nk = p.n * p.k;
  for (int e = 0; e < p.E; ++e) {
    if (p.seg.offsets[e + 1] != p.seg.offsets[e]) continue;
    for (int64_t i = 0; i < nk; ++i) {
      ASSERT_EQ(first.dw32[e * nk + i], 0.0f) << "empty expert " << e;
      ASSERT_EQ(num::bf16_to_f32(first.dw16[e * nk + i]), 0.0f) << "empty expert " << e;
      ASSERT_EQ(std::memcmp(&first.acc2[e * nk + i], &g0[e * nk + i], 4), 0) << "empty expert " << e << " must be untouched";
    }
  }

  // without tuning (the heuristic's first algorithm per shape): pool of 4 == one stream == previous()
  cuda::GroupedGemm::Options untuned = cuda::GroupedGemm::Options::previous();
  untuned.streams = 4;
  cuda::GroupedGemm gu(untuned), g1(cuda::GroupedGemm::Options::previous());
  const Bits u4 = run_passes(gu, p, d, g0, 0);
  EXPECT_TRUE(same_bits(u4, run_passes(g1, p, d, g0, 0))) << "untuned: four streams vs previous()";
  EXPECT_TRUE(same_bits(u4, run_passes(gu, p, d, g0, 0))) << "untuned: repeated";
  {  // every matmul on raised-priority pool streams (the MoE layer's setting with its side stream)
    cuda::GroupedGemm::Options hp = untuned;
    hp.pool_priority = 1;
    cuda::GroupedGemm gp(hp);
    EXPECT_TRUE(same_bits(u4, run_passes(gp, p, d, g0, 0))) << "untuned: priority pool vs default pool";
    EXPECT_EQ(gp.stats().concurrent_calls, ne > 1 ? 6 : 0);
    gp.set_concurrency(1);
    EXPECT_TRUE(same_bits(u4, run_passes(gp, p, d, g0, 0))) << "untuned: priority pool, one stream";
    EXPECT_EQ(gp.device_bytes(), 4 * hp.workspace_bytes);
  }
  EXPECT_EQ(gu.stats().tunings + g1.stats().tunings, 0);
  EXPECT_EQ(g1.stats().concurrent_calls, 0);
  EXPECT_EQ(g1.device_bytes(), g1.options().workspace_bytes) << "previous(): one workspace";
  EXPECT_EQ(gg.device_bytes(), 4 * gg.options().workspace_bytes) << "one workspace per stream";
  EXPECT_GE(cuda::GroupedGemm::tuning_scratch_bytes(), gg.options().tune_scratch_bytes) << "gg reserved it";
  // the sm_90a wgrad kernel (where the experts are 128-aligned): the same bits call after call
  cuda::GroupedGemm::Options ko = own_tuning(4);
  ko.wgrad_kernel = cuda::GroupedGemm::Options::WgradKernel::kAlways;
  cuda::GroupedGemm kg(ko);
  const Bits k1 = run_passes(kg, p, d, g0, 0), k2 = run_passes(kg, p, d, g0, 0);
  EXPECT_TRUE(same_bits(k1, k2)) << "wgrad kernel, two calls";
  std::cout << "    [" << c.name << "] wgrad kernel calls: " << kg.stats().wgrad_kernel_calls << "\n";
  EXPECT_EQ(cudaDeviceSynchronize(), cudaSuccess);
}

// Zero-token experts (first, middle, last), a single expert, one non-empty expert among empty
// ones, and experts large enough to overlap (several 128-token tiles, > 4 experts).
INSTANTIATE_TEST_SUITE_P(
    Pool, GemmGpuConcurrency,
    ::testing::Values(Case{"mixed_empty", {0, 64, 144, 0, 16, 256, 32, 48, 112, 0}, 256, 384, {}},
                      Case{"single_expert", {512}, 384, 256, {}},
                      Case{"one_of_four", {0, 0, 96, 0}, 256, 256, {}},
                      Case{"overlap", {640, 384, 0, 512, 256, 128, 768}, 512, 512, {}}),
    [](const ::testing::TestParamInfo<Case>& i) { return std::string(i.param.name); });

// Choices shared in the process: a second object adopts the first one's algorithms (same bits).
// The shape is used nowhere else in these tests, so the first object is the one that times.
TEST(GemmGpuTuning, SharedChoicesGiveTheSameBits) {
  REQUIRE_SM90();
  const Case c{"shared", {48, 0, 160, 96}, 640, 896, {}};
  const Problem p = make_problem(c, false, 51);
  const Device d(p);
  const auto g0 = random_grads(p.E * p.n * p.k, 12);
  cuda::GroupedGemm::Options o;
  o.tune = true;
  o.share_tuning = true;
  cuda::GroupedGemm a(o), b(o);
  const Bits ra = run_passes(a, p, d, g0, 0);
  const Bits rb = run_passes(b, p, d, g0, 0);
  EXPECT_TRUE(same_bits(ra, rb));
  EXPECT_GT(a.stats().tunings, 0);
  EXPECT_EQ(b.stats().tunings, 0) << "b adopts a's choices";
  const auto ka = a.tune_records(), kb = b.tune_records();
  ASSERT_EQ(ka.size(), kb.size());
  for (size_t i = 0; i < ka.size(); ++i) {
    EXPECT_FALSE(ka[i].shared);
    EXPECT_TRUE(kb[i].shared);
    EXPECT_EQ(ka[i].picked, kb[i].picked);
    EXPECT_EQ(ka[i].algo_id, kb[i].algo_id);
  }
  // clear_cache: b re-adopts the same choices; the bits stay
  b.clear_cache();
  EXPECT_TRUE(same_bits(ra, run_passes(b, p, d, g0, 0)));
  EXPECT_EQ(b.stats().tunings, 0);
}

// A key first met while the stream is captured is not timed (nothing may synchronise) and keeps the
// heuristic's first algorithm for good: the graph and later eager calls give the same bits. Keys
// timed before capture are replayed from the graph on the pool of streams.
TEST(GemmGpuTuning, GraphCaptureBeforeAndAfterTuning) {
  REQUIRE_SM90();
  const Case c{"graph", {128, 0, 256, 64, 32}, 256, 384, {}};
  const Problem p = make_problem(c, false, 61);
  const Device d(p);
  cuda::GroupedGemm gg(own_tuning(4));
  cudaStream_t s = nullptr;
  ASSERT_CUDA_OK(cudaStreamCreateWithFlags(&s, cudaStreamNonBlocking));
  auto capture = [&](const std::function<void()>& f) {
    cudaGraph_t g = nullptr;
    cudaGraphExec_t x = nullptr;
    EXPECT_EQ(cudaStreamBeginCapture(s, cudaStreamCaptureModeThreadLocal), cudaSuccess);
    f();
    EXPECT_EQ(cudaStreamEndCapture(s, &g), cudaSuccess);
    EXPECT_EQ(cudaGraphInstantiate(&x, g, 0), cudaSuccess);
    EXPECT_EQ(cudaGraphLaunch(x, s), cudaSuccess);
    EXPECT_EQ(cudaStreamSynchronize(s), cudaSuccess);
    cudaGraphExecDestroy(x);
    cudaGraphDestroy(g);
  };
  GBuf<bf16_t> y_graph(p.m * p.n), y_eager(p.m * p.n), dx_graph(p.m * p.k), dx_eager(p.m * p.k);
  const auto x8 = d.op(d.xr_c, d.xr_s), w8 = d.op(d.w_c, d.w_s);
  const auto dy8 = d.op(d.dyr_c, d.dyr_s), wt8 = d.op(d.wt_c, d.wt_s);
  ASSERT_CUDA_OK(cudaDeviceSynchronize());  // the buffers' poison (legacy stream) before work on `s`
  // fprop: first met inside the capture
  capture([&] { gg.fprop(p.seg, p.n, p.k, x8, w8, y_graph.span(), s); });
  ASSERT_FALSE(gg.tune_records().empty());
  for (const auto& r : gg.tune_records()) {
    const std::string how = r.how;
    EXPECT_TRUE(how == "stream capture" || how == "one candidate") << how;
    EXPECT_EQ(r.picked, 0);
  }
  gg.fprop(p.seg, p.n, p.k, x8, w8, y_eager.span(), s);
  EXPECT_TRUE(same_bits(y_graph.get(), y_eager.get())) << "graph (untimed key) vs eager";
  // dgrad: timed eagerly first, then captured on four streams
  gg.dgrad(p.seg, p.n, p.k, dy8, wt8, dx_eager.span(), s);
  const auto calls = gg.stats().concurrent_calls;
  capture([&] { gg.dgrad(p.seg, p.n, p.k, dy8, wt8, dx_graph.span(), s); });
  EXPECT_EQ(gg.stats().concurrent_calls, calls + 1) << "the captured call forked the pool";
  EXPECT_TRUE(same_bits(dx_graph.get(), dx_eager.get())) << "graph on the pool vs eager";
  ASSERT_CUDA_OK(cudaStreamDestroy(s));
}

// Accumulation trials need a scratch output; without one the key is not timed, and the gradients
// are still right (and the calls deterministic).
TEST(GemmGpuTuning, AccumulateWithoutScratchIsNotTimed) {
  REQUIRE_SM90();
  const Case c{"no_scratch", {64, 32, 0, 96}, 256, 256, {}};
  const Problem p = make_problem(c, false, 71);
  const Device d(p);
  cuda::GroupedGemm::Options o = own_tuning(1);
  o.tune_scratch_bytes = 0;  // this object never times an accumulating wgrad
  cuda::GroupedGemm gg(o);
  EXPECT_EQ(gg.device_bytes(), o.workspace_bytes);
  const auto g0 = random_grads(p.E * p.n * p.k, 13);
  const Bits a = run_passes(gg, p, d, g0, 0);
  EXPECT_TRUE(same_bits(a, run_passes(gg, p, d, g0, 0)));
  bool seen = false;
  for (const auto& r : gg.tune_records())
    if (r.accumulate) {
      seen = true;
      const std::string how = r.how;
      EXPECT_TRUE(how == "scratch too small" || how == "one candidate") << how;
    }
  EXPECT_TRUE(seen);
  // G0 + dW against the reference (the usual bound)
  const Refs r = fp8_refs(p);
  std::vector<float> want(g0.size());
  for (size_t i = 0; i < want.size(); ++i) want[i] = g0[i] + r.dw[i];
  EXPECT_TRUE(close(a.acc1, want, r.sdw, {2 * kU, kFp8C}, "no_scratch wgrad accumulate"));
}

// ---- conversion kernels ---------------------------------------------------------------------
TEST(GemmScales, ConversionsMatchHostLayoutsBitForBit) {
  REQUIRE_DEVICE();
  std::mt19937 rng(3);
  auto codes = [&](size_t n) {
    std::vector<uint8_t> v(n);
    for (auto& c : v) {
      const uint32_t r = rng() % 100;
      c = r == 0 ? 0xFF : r == 1 ? 0 : static_cast<uint8_t>(rng() % 255);
    }
    return v;
  };
  for (const auto& counts : std::vector<std::vector<int32_t>>{{12, 0, 36, 4, 0}, {5, 3, 0, 9}, {0, 0, 1}, {257}}) {
    const Segments seg = Segments::from_counts(counts);
    const int64_t m = seg.num_tokens(), c = 384;
    QTensor row;
    row.layout = Layout::kRow1x128;
    row.rows = m;
    row.cols = c;
    row.codes.assign(m * c, 0);
    row.scales = codes(m * c / 128);
    GBuf<uint8_t> in(row.scales);
    GBuf<int32_t> off(seg.offsets);
    GBuf<float> out(m * c / 128);
    cuda::act_scales_to_f32(in.p, m, c, off.p, seg.num_segments(), out.p, nullptr, 0);
    expect_same_bits(gemm::act_scales_f32(row, seg), out.get(), "act scales");
  }
  {  // malformed offsets: counted once, nothing written
    const std::vector<int32_t> bad = {0, 20, 10, 40};
    GBuf<uint8_t> in(codes(3 * 40));
    GBuf<int32_t> off(bad);
    GBuf<float> out(3 * 40);
    GBuf<cuda::DeviceStatus> st(1);
    cudaMemset(st.p, 0, sizeof(cuda::DeviceStatus));
    cuda::act_scales_to_f32(in.p, 40, 384, off.p, 3, out.p, st.p, 0);
    EXPECT_EQ(st.get()[0].bad_segments, 1u);
    for (float v : out.get()) ASSERT_TRUE(std::isnan(v)) << "output must stay untouched (poison)";
  }
  {
    QTensor col;
    col.layout = Layout::kCol128x1;
    col.scales = codes(7 * 256);
    GBuf<uint8_t> in(col.scales);
    GBuf<float> out(7 * 256);
    cuda::col_scales_to_f32(in.p, 7, 256, out.p, 0);
    expect_same_bits(gemm::col_scales_f32(col), out.get(), "col scales");
  }
  {
    std::vector<QTensor> w(3);
    std::vector<uint8_t> all;
    for (auto& q : w) {
      q.layout = Layout::kWeight128x128;
      q.rows = 256;
      q.cols = 1408;
      q.codes.assign(256 * 1408, 0);
      q.scales = codes(2 * 11);
      all.insert(all.end(), q.scales.begin(), q.scales.end());
    }
    GBuf<uint8_t> in(all);
    GBuf<float> out(gemm::weight_scale_f32_elems(3, 256, 1408));
    cuda::weight_scales_to_f32(in.p, 3, 256, 1408, out.p, 0);
    expect_same_bits(gemm::weight_scales_f32(w), out.get(), "weight scales (padded to 12)");
  }
}

// ---- argument errors through the CUDA entry points -----------------------------------------------
TEST(GemmGpuErrors, RejectedBeforeAnyLaunch) {
  REQUIRE_DEVICE();
  cuda::GroupedGemm gg(env_gemm_options());
  const Segments seg = Segments::from_counts({16, 1, 32});
  const int64_t m = seg.num_tokens(), n = 256, k = 384;
  GBuf<uint8_t> codes(64 * k);
  GBuf<float> scales(64 * k / 128), ws(gemm::weight_scale_f32_elems(3, n, k));
  GBuf<uint8_t> wc(3 * n * k);
  GBuf<bf16_t> y(64 * n);
  auto expect_error = [](const std::function<void()>& f, const char* needle) {
    try {
      f();
      ADD_FAILURE() << "no error; expected one mentioning \"" << needle << "\"";
    } catch (const Error& e) {
      EXPECT_NE(std::string(e.what()).find(needle), std::string::npos) << e.what();
    }
  };
  expect_error([&] { gg.fprop(seg, n, k, {codes.cspan(), scales.cspan()}, {wc.cspan(), ws.cspan()}, y.span(), 0); },
               "expert 1 has 1 tokens");
  const Segments ok = Segments::from_counts({16, 4, 32});
  expect_error(
      [&] {
        gg.fprop(ok, n, k, {{codes.p + 1, codes.cspan().size - 1}, scales.cspan()}, {wc.cspan(), ws.cspan()}, y.span(), 0);
      },
      "not 16-byte aligned");
  expect_error([&] { gg.fprop(ok, n, 200, {codes.cspan(), scales.cspan()}, {wc.cspan(), ws.cspan()}, y.span(), 0); },
               "K = 200");
  EXPECT_EQ(gg.stats().matmuls, 0);
  EXPECT_EQ(cudaDeviceSynchronize(), cudaSuccess);
}

}  // namespace
}  // namespace flowmoe
