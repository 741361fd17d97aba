// The FP8 wgrad kernel writing dW where a model stores the weight (gemm.h StoredDw; issue 52):
// with the operands swapped it computes the stored weight's gradient, the transpose of the layer
// layout's, and writes [E][rows][cols] with the padding's rows and columns left out and, for
// gpt-oss's gate_up_proj, the gate and up halves interleaved. Against the plain launch (dW [E][N][K],
// itself checked against the CPU reference in test_gemm_grouped_gpu.cu), transposed and mapped on
// the host: the same bits (the same products summed in the same order), for FP32 and UE8M0 column
// scales, FP32 (=, +=) and BF16 outputs, an empty expert; nothing written past the stored tensor.
// Shapes the kernel cannot store are clear errors. The BF16 wgrad kernel's stored outputs likewise
// (values: see its test below). GPU label.
#include <cuda_runtime.h>
#include <gtest/gtest.h>

#include <cmath>
#include <string>
#include <vector>

#include "cuda/gemm_test_problem.h"
#include "flowmoe/cuda/qtensor_view.h"
#include "flowmoe/error.h"

namespace flowmoe {
namespace {

using namespace gemmtest;

struct StoredCase {
  const char* name;
  int64_t n, k;            // the plain problem dW [E][N][K] (N = 2F' for W1, H' for W2)
  int64_t rows, cols;      // the stored gradient [E][rows][cols] of the swapped problem
  bool interleaved;        // (then N = 2F', cols = 2F with F <= F')
};

// The stored gradient's (e, r, c) as an index into the plain dW [E][N][K]: the stored weight is the
// transpose (its row r is K's index), its column c is N's row c, or (interleaved) gate row c / 2 or
// up row N / 2 + c / 2.
int64_t plain_index(const StoredCase& t, int64_t e, int64_t r, int64_t c) {
  const int64_t row = !t.interleaved ? c : (c % 2 == 0 ? c / 2 : t.n / 2 + c / 2);
  return (e * t.n + row) * t.k + r;
}

// The stored gradient [E][rows][cols] the plain one pw [E][N][K] maps to.
std::vector<float> stored_of_plain(const StoredCase& t, int64_t experts, const std::vector<float>& pw) {
  std::vector<float> out(size_t(experts * t.rows * t.cols));
  for (int64_t e = 0; e < experts; ++e)
    for (int64_t r = 0; r < t.rows; ++r)
      for (int64_t c = 0; c < t.cols; ++c) out[(e * t.rows + r) * t.cols + c] = pw[plain_index(t, e, r, c)];
  return out;
}

class WgradStoredGpu : public ::testing::TestWithParam<StoredCase> {};

TEST_P(WgradStoredGpu, SameBitsAsThePlainGradientTransposedAndMapped) {
  REQUIRE_SM90();
  const StoredCase& t = GetParam();
  const Problem p = make_problem(Case{t.name, {256, 0, 384}, t.n, t.k, {}}, false, 97u);
  Device d(p);
  GBuf<uint8_t> dy_s8(p.dy_col.scales), x_s8(p.x_col.scales);
  const int64_t nb = p.m / 128;
  for (int ue8m0 = 0; ue8m0 < 2; ++ue8m0) {
    SCOPED_TRACE(ue8m0 ? "UE8M0 column scales" : "FP32 column scales");
    cuda::QTensorView dy_col = cuda::col_128x1(d.dyc_c.p, dy_s8.p, p.m, p.n, nb);
    cuda::QTensorView x_col = cuda::col_128x1(d.xc_c.p, x_s8.p, p.m, p.k, nb);
    if (!ue8m0) {
      dy_col.scales = d.dyc_s.p, dy_col.scale_format = cuda::ScaleFormat::kF32;
      x_col.scales = d.xc_s.p, x_col.scale_format = cuda::ScaleFormat::kF32;
    }
    cuda::GroupedGemm gg(env_gemm_options());
    const gemm::DeviceSegments seg{d.offsets.p, p.E, p.m, nullptr};
    const int64_t nw = int64_t(p.E) * p.n * p.k, ns = int64_t(p.E) * t.rows * t.cols, guard = 4096;
    GBuf<float> plain(nw);
    gg.wgrad(seg, p.n, p.k, dy_col, x_col, gemm::WgradOut::f32(plain.p, nw), 0);
    const auto pw = plain.get();
    const gemm::StoredDw sd{t.rows, t.cols, t.interleaved};
    const std::vector<float> want = stored_of_plain(t, p.E, pw);
    // FP32 =, the buffer one guard longer, all NaN: the stored tensor written whole, nothing past it
    GBuf<float> st(ns + guard);
    st.put(std::vector<float>(ns + guard, std::nanf("")));
    gemm::WgradOut o = gemm::WgradOut::f32(st.p, ns);
    o.stored = sd;
    gg.wgrad(seg, p.k, p.n, x_col, dy_col, o, 0);  // (swapped: the stored weight's gradient)
    auto got = st.get();
    expect_same_bits(want, std::vector<float>(got.begin(), got.begin() + ns), "stored FP32");
    for (int64_t i = ns; i < ns + guard; ++i) ASSERT_TRUE(std::isnan(got[i])) << "written past the stored tensor at " << i;
    // FP32 +=
    std::vector<float> g0(ns), want_acc(ns);
    for (int64_t i = 0; i < ns; ++i) g0[i] = float((i * 31) % 89) - 44.0f, want_acc[i] = g0[i] + want[i];
    GBuf<float> acc(ns);
    acc.put(g0);
    gemm::WgradOut oa = gemm::WgradOut::accumulate(acc.p, ns);
    oa.stored = sd;
    gg.wgrad(seg, p.k, p.n, x_col, dy_col, oa, 0);
    expect_same_bits(want_acc, acc.get(), "stored FP32 +=");
    // BF16 =: each FP32 sum rounded once
    std::vector<bf16_t> want16(ns);
    for (int64_t i = 0; i < ns; ++i) want16[i] = num::f32_to_bf16(want[i]);
    GBuf<bf16_t> s16(ns + guard);
    s16.put(std::vector<bf16_t>(ns + guard, bf16_t(0x7FC1)));  // (a NaN pattern the kernel never writes)
    gemm::WgradOut ob = gemm::WgradOut::bf16(s16.p, ns);
    ob.stored = sd;
    gg.wgrad(seg, p.k, p.n, x_col, dy_col, ob, 0);
    const auto got16 = s16.get();
    expect_same_bits(want16, std::vector<bf16_t>(got16.begin(), got16.begin() + ns), "stored BF16");
    for (int64_t i = ns; i < ns + guard; ++i) ASSERT_EQ(got16[i], 0x7FC1) << "written past the stored tensor at " << i;
  }
}

INSTANTIATE_TEST_SUITE_P(
    Shapes, WgradStoredGpu,
    ::testing::Values(StoredCase{"w1_interleaved_padded", 256, 384, 300, 200, true},   // F 100 of 128, H 300 of 384
                      StoredCase{"w1_interleaved_whole", 512, 256, 256, 512, true},
                      StoredCase{"w1_concatenated", 256, 384, 384, 256, false},       // F = F' (no gap)
                      StoredCase{"w2_padded", 384, 256, 200, 296, false}),           // dW2^T [F' rows][H' cols]
    [](const ::testing::TestParamInfo<StoredCase>& i) { return std::string(i.param.name); });

// The BF16 wgrad kernel (the bf16 recipe's, sm90_bf16_grouped.cu) writing the stored gradient: with
// dy and x swapped, against its plain launch transposed and mapped. Data whose sums are exact give
// the same bits whatever order the products are added in; normal data the same products in the
// tensor cores' order for the other operand roles, within 2^-20 of the sum of |products|. FP32 (=,
// +=) and BF16 outputs, an empty expert, nothing written past the stored tensor.
TEST_P(WgradStoredGpu, Bf16KernelSameValuesAsThePlainGradientTransposedAndMapped) {
  REQUIRE_SM90();
  const StoredCase& t = GetParam();
  const std::vector<int32_t> offsets = {0, 256, 256, 640};  // (an empty expert in the middle)
  const int E = 3;
  const int64_t m = 640, guard = 4096;
  const int64_t nw = int64_t(E) * t.n * t.k, ns = int64_t(E) * t.rows * t.cols;
  for (const bool small : {true, false}) {
    SCOPED_TRACE(small ? "exact sums" : "normal data");
    GBuf<bf16_t> dy(make_data(m, t.n, small ? 11u : 12u, small)), x(make_data(m, t.k, small ? 13u : 14u, small));
    GBuf<int32_t> off(offsets);
    cuda::GroupedGemm gg(env_gemm_options());
    const gemm::DeviceSegments seg{off.p, E, m, nullptr};
    GBuf<float> plain(nw);
    gg.wgrad_bf16(seg, t.n, t.k, dy.cspan(), x.cspan(), gemm::WgradOut::f32(plain.p, nw), 0);
    const std::vector<float> want = stored_of_plain(t, E, plain.get());
    // |products| summed, for the normal data's bound
    std::vector<double> bound(ns, 0.0);
    if (!small) {
      const auto dyf = widen(dy.get()), xf = widen(x.get());
      for (int64_t e = 0; e < E; ++e)
        for (int64_t r = 0; r < t.rows; ++r)
          for (int64_t c = 0; c < t.cols; ++c) {
            const int64_t row = !t.interleaved ? c : (c % 2 == 0 ? c / 2 : t.n / 2 + c / 2);
            double sum = 0.0;
            for (int64_t tok = offsets[e]; tok < offsets[e + 1]; ++tok)
              sum += std::fabs(double(dyf[tok * t.n + row]) * double(xf[tok * t.k + r]));
            bound[(e * t.rows + r) * t.cols + c] = sum * std::ldexp(1.0, -20);
          }
    }
    const auto expect = [&](const std::vector<float>& want_v, const std::vector<float>& got, const char* what) {
      if (small) {
        expect_same_bits(want_v, got, what);
        return;
      }
      for (int64_t i = 0; i < ns; ++i)
        ASSERT_LE(std::fabs(double(got[i]) - double(want_v[i])), bound[i]) << what << " at " << i;
    };
    const gemm::StoredDw sd{t.rows, t.cols, t.interleaved};
    // FP32 =, the buffer one guard longer, all NaN: the stored tensor written whole, nothing past it
    GBuf<float> st(ns + guard);
    st.put(std::vector<float>(ns + guard, std::nanf("")));
    gemm::WgradOut o = gemm::WgradOut::f32(st.p, ns);
    o.stored = sd;
    gg.wgrad_bf16(seg, t.k, t.n, x.cspan(), dy.cspan(), o, 0);  // (swapped: the stored weight's gradient)
    const auto got = st.get();
    const std::vector<float> got_f32(got.begin(), got.begin() + ns);
    expect(want, got_f32, "stored FP32");
    for (int64_t i = ns; i < ns + guard; ++i) ASSERT_TRUE(std::isnan(got[i])) << "written past the stored tensor at " << i;
    // FP32 +=
    std::vector<float> g0(ns), want_acc(ns);
    for (int64_t i = 0; i < ns; ++i) g0[i] = float((i * 31) % 89) - 44.0f, want_acc[i] = g0[i] + got_f32[i];
    GBuf<float> acc(ns);
    acc.put(g0);
    gemm::WgradOut oa = gemm::WgradOut::accumulate(acc.p, ns);
    oa.stored = sd;
    gg.wgrad_bf16(seg, t.k, t.n, x.cspan(), dy.cspan(), oa, 0);
    expect_same_bits(want_acc, acc.get(), "stored FP32 += (the stored = sums added once)");
    // BF16 =: each FP32 sum of the stored launch rounded once
    std::vector<bf16_t> want16(ns);
    for (int64_t i = 0; i < ns; ++i) want16[i] = num::f32_to_bf16(got_f32[i]);
    GBuf<bf16_t> s16(ns + guard);
    s16.put(std::vector<bf16_t>(ns + guard, bf16_t(0x7FC1)));
    gemm::WgradOut ob = gemm::WgradOut::bf16(s16.p, ns);
    ob.stored = sd;
    gg.wgrad_bf16(seg, t.k, t.n, x.cspan(), dy.cspan(), ob, 0);
    const auto got16 = s16.get();
    expect_same_bits(want16, std::vector<bf16_t>(got16.begin(), got16.begin() + ns), "stored BF16");
    for (int64_t i = ns; i < ns + guard; ++i) ASSERT_EQ(got16[i], 0x7FC1) << "written past the stored tensor at " << i;
  }
}

TEST(WgradStoredGpuErrors, ShapesTheKernelCannotStoreAreClearErrors) {
  REQUIRE_SM90();
  const Problem p = make_problem(Case{"errors", {256}, 256, 384, {}}, false, 5u);
  Device d(p);
  GBuf<uint8_t> dy_s8(p.dy_col.scales), x_s8(p.x_col.scales);
  const cuda::QTensorView dy_col = cuda::col_128x1(d.dyc_c.p, dy_s8.p, p.m, p.n, p.m / 128);
  const cuda::QTensorView x_col = cuda::col_128x1(d.xc_c.p, x_s8.p, p.m, p.k, p.m / 128);
  cuda::GroupedGemm gg(env_gemm_options());
  const gemm::DeviceSegments seg{d.offsets.p, p.E, p.m, nullptr};
  GBuf<float> out(int64_t(p.n) * p.k);
  const auto run = [&](gemm::StoredDw sd) {
    gemm::WgradOut o = gemm::WgradOut::f32(out.p, int64_t(p.n) * p.k);
    o.stored = sd;
    gg.wgrad(seg, p.k, p.n, x_col, dy_col, o, 0);
  };
  EXPECT_THROW(run({p.k + 1, 100, false}), Error) << "more rows than N";
  EXPECT_THROW(run({100, 101, false}), Error) << "rows not a multiple of 16 bytes";
  EXPECT_THROW(run({100, p.n + 8, false}), Error) << "more columns than K";
  // the host-segment path (cuBLASLt or the kernel by host offsets) writes no stored output
  gemm::WgradOut o = gemm::WgradOut::f32(out.p, int64_t(p.n) * p.k);
  o.stored = {100, 64, false};
  EXPECT_THROW(gg.wgrad(p.seg, p.k, p.n, d.op(d.xc_c, d.xc_s), d.op(d.dyc_c, d.dyc_s), o, 0), Error);
  // the BF16 kernel refuses the same shapes
  GBuf<bf16_t> xb(int64_t(p.m) * p.k), dyb(int64_t(p.m) * p.n);
  const auto run16 = [&](gemm::StoredDw sd) {
    gemm::WgradOut ob = gemm::WgradOut::f32(out.p, int64_t(p.n) * p.k);
    ob.stored = sd;
    gg.wgrad_bf16(seg, p.k, p.n, xb.cspan(), dyb.cspan(), ob, 0);
  };
  EXPECT_THROW(run16({p.k + 1, 100, false}), Error) << "BF16: more rows than N";
  EXPECT_THROW(run16({100, 101, false}), Error) << "BF16: rows not a multiple of 16 bytes";
  EXPECT_THROW(run16({100, p.n + 8, false}), Error) << "BF16: more columns than K";
}

}  // namespace
}  // namespace flowmoe
