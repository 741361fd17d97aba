// flowmoe's sm_90a BF16 kernels on device segments (GroupedGemm::fprop_bf16 / dgrad_bf16 /
// wgrad_bf16 with DeviceSegments: one launch, offsets read on the device) against the CPU
// references within the BF16 tolerance of gemm_test_problem.h and bit for bit on exactly
// representable sums; ragged counts (0, 1, 127, 129, more than 65536 rows) for fprop and dgrad,
// 128-aligned ones with empty experts for wgrad (= zeroes them, += leaves them), both tile widths,
// rows past the segments untouched, malformed offsets counted, bad shapes rejected, and a CUDA-graph
// replay equal to the eager calls. GPU label.
#include <cuda_runtime.h>
#include <gtest/gtest.h>

#include <cmath>
#include <cstring>
#include <functional>
#include <string>
#include <vector>

#include "cuda/gemm_test_problem.h"
#include "flowmoe/cuda/status.h"
#include "flowmoe/error.h"

namespace flowmoe {
namespace {

using namespace gemmtest;

// A BF16 problem on the host: x [m, k], dy [m, n], w [E][n][k], its references and their S.
struct Bf16Problem {
  Segments seg;
  int64_t m = 0, n = 0, k = 0;
  int E = 0;
  std::vector<bf16_t> x, dy, w;
  std::vector<float> y, dx, dw;
  std::vector<double> sy, sdx, sdw;
};

Bf16Problem make_bf16(const std::vector<int32_t>& counts, int64_t n, int64_t k, uint32_t seed, bool small,
                      bool with_wgrad) {
  Bf16Problem p;
  p.seg = Segments::from_counts(counts);
  p.m = p.seg.num_tokens(), p.n = n, p.k = k, p.E = p.seg.num_segments();
  p.x = make_data(p.m, k, seed, small);
  p.dy = make_data(p.m, n, seed + 1, small);
  p.w = make_data(p.E * n, k, seed + 2, small);
  p.y.resize(p.m * n), p.dx.resize(p.m * k), p.sy.resize(p.m * n), p.sdx.resize(p.m * k);
  cpu::grouped_fprop_bf16_ref(p.x.data(), p.w.data(), p.seg, n, k, p.y.data());
  cpu::grouped_dgrad_bf16_ref(p.dy.data(), p.w.data(), p.seg, n, k, p.dx.data());
  const auto xf = widen(p.x), dyf = widen(p.dy), wf = widen(p.w);
  for (int e = 0; e < p.E; ++e) {
    const int64_t t0 = p.seg.offsets[e], t1 = p.seg.offsets[e + 1];
    abs_gemm(xf.data(), &wf[e * n * k], t0, t1, n, k, p.sy.data(), n);
    const auto wte = transpose(std::vector<float>(wf.begin() + e * n * k, wf.begin() + (e + 1) * n * k), n, k);
    abs_gemm(dyf.data(), wte.data(), t0, t1, k, n, p.sdx.data(), k);
  }
  if (with_wgrad) {
    p.dw.resize(p.E * n * k), p.sdw.resize(p.E * n * k);
    cpu::grouped_wgrad_bf16_ref(p.dy.data(), p.x.data(), p.seg, n, k, p.dw.data(), false);
    const auto dyt = transpose(dyf, p.m, n), xt = transpose(xf, p.m, k);
    for (int e = 0; e < p.E; ++e) {
      const int64_t t0 = p.seg.offsets[e], t1 = p.seg.offsets[e + 1];
      for (int64_t i = 0; i < n; ++i)
        for (int64_t j = 0; j < k; ++j) {
          double s = 0;
          for (int64_t t = t0; t < t1; ++t) s += std::fabs(double(dyt[i * p.m + t]) * xt[j * p.m + t]);
          p.sdw[(e * n + i) * k + j] = s;
        }
    }
  }
  return p;
}

const Tol kT16{1.0 / 256, 1.0 / 16384};  // BF16 outputs
const Tol kT32{0.0, 1.0 / 16384};        // FP32 outputs

std::vector<float> prefix(const std::vector<float>& v, int64_t n) { return {v.begin(), v.begin() + n}; }
std::vector<double> prefix(const std::vector<double>& v, int64_t n) { return {v.begin(), v.begin() + n}; }
bool is_poison(const std::vector<bf16_t>& v, size_t from) {
  for (size_t i = from; i < v.size(); ++i)
    if (v[i] != 0xFFFF) return false;
  return true;
}

// fprop and dgrad on ragged counts; `tail` trailing segments lie outside the GEMM (rows past
// offsets[E], which must keep their NaN fill).
struct RowsCase {
  const char* name;
  std::vector<int32_t> counts;
  int64_t n, k;
  int tail;
};
std::ostream& operator<<(std::ostream& os, const RowsCase& c) { return os << c.name; }
class GemmBf16GroupedGpu : public ::testing::TestWithParam<RowsCase> {};

TEST_P(GemmBf16GroupedGpu, FpropDgradMatchReference) {
  REQUIRE_SM90();
  const RowsCase& c = GetParam();
  const Bf16Problem p = make_bf16(c.counts, c.n, c.k, 700u + uint32_t(c.n + c.k), false, false);
  const int E = p.E - c.tail;
  const int64_t rows = p.seg.offsets[E];
  GBuf<bf16_t> x(p.x), dy(p.dy), w(p.w), y(p.m * p.n), dx(p.m * p.k);
  GBuf<int32_t> off(p.seg.offsets);
  cuda::DeviceStatus* st = nullptr;
  ASSERT_EQ(cudaMallocManaged(&st, sizeof(*st)), cudaSuccess);
  std::memset(st, 0, sizeof(*st));
  cuda::GroupedGemm gg(env_gemm_options());
  const gemm::DeviceSegments seg{off.p, E, p.m, st};
  gg.fprop_bf16(seg, p.n, p.k, x.cspan(), w.cspan(), y.span(), 0);
  gg.dgrad_bf16(seg, p.n, p.k, dy.cspan(), w.cspan(), dx.span(), 0);
  EXPECT_EQ(gg.stats().bf16_kernel_calls, 2);
  EXPECT_EQ(gg.stats().matmuls, 0) << "no cuBLASLt call";
  const auto yg = y.get(), dxg = dx.get();
  EXPECT_TRUE(close(prefix(widen(yg), rows * p.n), prefix(p.y, rows * p.n), prefix(p.sy, rows * p.n), kT16,
                    std::string(c.name) + " bf16 grouped fprop"));
  EXPECT_TRUE(close(prefix(widen(dxg), rows * p.k), prefix(p.dx, rows * p.k), prefix(p.sdx, rows * p.k), kT16,
                    std::string(c.name) + " bf16 grouped dgrad"));
  EXPECT_TRUE(is_poison(yg, rows * p.n)) << "fprop wrote rows past offsets[E]";
  EXPECT_TRUE(is_poison(dxg, rows * p.k)) << "dgrad wrote rows past offsets[E]";
  EXPECT_EQ(st->bad_segments, 0u);
  cudaFree(st);
}

// Values whose every partial sum is exact: the kernels' results are the reference's BF16 (fprop,
// dgrad) bit for bit, which pins both operand layouts (K-major and MN-major) with no tolerance.
TEST_P(GemmBf16GroupedGpu, ExactOnSmallValues) {
  REQUIRE_SM90();
  const RowsCase& c = GetParam();
  const Bf16Problem p = make_bf16(c.counts, c.n, c.k, 31u + uint32_t(c.n), true, false);
  const int E = p.E - c.tail;
  const int64_t rows = p.seg.offsets[E];
  GBuf<bf16_t> x(p.x), dy(p.dy), w(p.w), y(p.m * p.n), dx(p.m * p.k);
  GBuf<int32_t> off(p.seg.offsets);
  cuda::GroupedGemm gg(env_gemm_options());
  const gemm::DeviceSegments seg{off.p, E, p.m, nullptr};
  gg.fprop_bf16(seg, p.n, p.k, x.cspan(), w.cspan(), y.span(), 0);
  gg.dgrad_bf16(seg, p.n, p.k, dy.cspan(), w.cspan(), dx.span(), 0);
  expect_same_bits(prefix(widen(narrow(p.y)), rows * p.n), widen(y.get(rows * p.n)), "bf16 fprop (exact sums)");
  expect_same_bits(prefix(widen(narrow(p.dx)), rows * p.k), widen(dx.get(rows * p.k)), "bf16 dgrad (exact sums)");
}

// n = 256, k = 384: fprop on 128 x 256 tiles, dgrad (n_out = 384) on 128 x 128; n = 128, k = 256
// the other way round.
INSTANTIATE_TEST_SUITE_P(Ragged, GemmBf16GroupedGpu,
                         ::testing::Values(RowsCase{"zero_one_127_129", {0, 1, 127, 129, 0, 256, 3}, 256, 384, 0},
                                           RowsCase{"tail_untouched", {130, 0, 5, 200, 77}, 128, 256, 2},
                                           RowsCase{"all_empty", {0, 0, 0, 40}, 128, 128, 1},
                                           RowsCase{"one_token", {1}, 384, 128, 0},
                                           RowsCase{"over_65536_rows", {65601, 2}, 128, 128, 0},
                                           RowsCase{"forty_experts", [] {
                                             std::vector<int32_t> c;
                                             for (int e = 0; e < 40; ++e) c.push_back((e * 37) % 131);
                                             return c;
                                           }(), 128, 128, 0},
                                           // 152 fprop tiles: CTAs take a second tile (ring phases carry on)
                                           RowsCase{"tiles_past_one_wave", {1500, 1, 0, 2000, 1100}, 1024, 128, 0}),
                         [](const ::testing::TestParamInfo<RowsCase>& i) { return std::string(i.param.name); });

// wgrad on 128-aligned device offsets: within tolerance of the reference (= onto a NaN-filled
// output, so empty experts must be zeroed), += adds onto the old values and leaves empty experts
// untouched, and exact sums give the reference's bits. k = 384: 128-wide tiles; k = 512 and 1024:
// 256-wide. `tail` trailing segments lie outside the GEMM (tokens past offsets[E], within the
// capacity: never part of a gradient).
struct WgradCase {
  const char* name;
  std::vector<int32_t> counts;
  int64_t n, k;
  int tail;
};
std::ostream& operator<<(std::ostream& os, const WgradCase& c) { return os << c.name; }
class GemmBf16GroupedGpuWgrad : public ::testing::TestWithParam<WgradCase> {};

TEST_P(GemmBf16GroupedGpuWgrad, OverwriteAndAccumulateMatchReference) {
  REQUIRE_SM90();
  const WgradCase& c = GetParam();
  for (const bool small : {false, true}) {
    const Bf16Problem p = make_bf16(c.counts, c.n, c.k, small ? 77u : 78u, small, true);
    const int E = p.E - c.tail;
    GBuf<bf16_t> x(p.x), dy(p.dy);
    GBuf<int32_t> off(p.seg.offsets);
    const int64_t nw = int64_t(E) * p.n * p.k;
    GBuf<float> dw(nw);
    cuda::GroupedGemm gg(env_gemm_options());
    const gemm::DeviceSegments seg{off.p, E, p.m, nullptr};
    gg.wgrad_bf16(seg, p.n, p.k, dy.cspan(), x.cspan(), gemm::WgradOut::f32(dw.p, nw), 0);
    const auto got = dw.get();
    {  // BF16 output (=): the FP32 sums rounded once, RNE; empty experts zeroed (the buffer starts as NaN)
      GBuf<bf16_t> dw16(nw);
      gg.wgrad_bf16(seg, p.n, p.k, dy.cspan(), x.cspan(), gemm::WgradOut::bf16(dw16.p, nw), 0);
      std::vector<bf16_t> want16(nw);
      for (int64_t i = 0; i < nw; ++i) want16[i] = num::f32_to_bf16(got[i]);
      expect_same_bits(want16, dw16.get(), std::string(c.name) + " bf16 wgrad, BF16 output = rounded FP32 output");
    }
    if (small) {
      expect_same_bits(prefix(p.dw, nw), got, std::string(c.name) + " bf16 wgrad (exact sums)");
      continue;
    }
    EXPECT_TRUE(close(got, prefix(p.dw, nw), prefix(p.sdw, nw), kT32, std::string(c.name) + " bf16 grouped wgrad ="));
    std::vector<float> g0(nw), want(nw);
    for (int64_t i = 0; i < nw; ++i) g0[i] = float((i * 37) % 101) - 50.0f, want[i] = g0[i] + p.dw[i];
    dw.put(g0);
    gg.wgrad_bf16(seg, p.n, p.k, dy.cspan(), x.cspan(), gemm::WgradOut::accumulate(dw.p, nw), 0);
    const auto acc = dw.get();
    EXPECT_TRUE(close(acc, want, prefix(p.sdw, nw), {2 * kU, 1.0 / 16384}, std::string(c.name) + " bf16 grouped wgrad +="));
    for (int e = 0; e < E; ++e)
      if (c.counts[e] == 0)
        for (int64_t i = 0; i < p.n * p.k; ++i)
          ASSERT_EQ(acc[e * p.n * p.k + i], g0[e * p.n * p.k + i]) << "empty expert " << e << " must be untouched";
    EXPECT_EQ(gg.stats().bf16_kernel_calls, 3);
  }
}
INSTANTIATE_TEST_SUITE_P(Tiles, GemmBf16GroupedGpuWgrad,
                         ::testing::Values(WgradCase{"ragged_k384_tail", {256, 0, 128, 384, 0, 128, 256}, 256, 384, 1},
                                           WgradCase{"long_k512", {1024, 0, 640}, 128, 512, 0},
                                           // 160 to 224 tiles of 128 x 256: CTAs refill their epilogue
                                           // buffers while the previous tile's bulk operations drain
                                           WgradCase{"tiles_past_one_wave", {128, 256, 0, 128, 128, 128, 0}, 1024, 1024, 0},
                                           // more than 32 experts: every lane of the offset check has several
                                           WgradCase{"forty_experts", [] {
                                             std::vector<int32_t> c;
                                             for (int e = 0; e < 40; ++e) c.push_back(128 * (e % 3));
                                             return c;
                                           }(), 128, 128, 0}),
                         [](const ::testing::TestParamInfo<WgradCase>& i) { return std::string(i.param.name); });

// Malformed device offsets: counted once per call in bad_segments, outputs untouched; bad shapes
// throw before anything is launched.
TEST(GemmBf16GroupedGpuErrors, MalformedOffsetsAndBadShapes) {
  REQUIRE_SM90();
  const Bf16Problem p = make_bf16({128, 128}, 128, 128, 5u, false, false);
  GBuf<bf16_t> x(p.x), dy(p.dy), w(p.w);
  cuda::GroupedGemm gg(env_gemm_options());
  cuda::DeviceStatus* st = nullptr;
  ASSERT_EQ(cudaMallocManaged(&st, sizeof(*st)), cudaSuccess);
  std::memset(st, 0, sizeof(*st));
  // decreasing, past the capacity, starting below 0 (offsets[0] > 0 is a range of the experts)
  for (const std::vector<int32_t>& bad : {std::vector<int32_t>{0, 200, 100}, {0, 128, 300}, {-128, 0, 128}}) {
    GBuf<int32_t> off(bad);
    const gemm::DeviceSegments seg{off.p, 2, p.m, st};
    GBuf<bf16_t> y(p.m * p.n), dx(p.m * p.k);
    GBuf<float> dw(2 * p.n * p.k);
    gg.fprop_bf16(seg, p.n, p.k, x.cspan(), w.cspan(), y.span(), 0);
    gg.dgrad_bf16(seg, p.n, p.k, dy.cspan(), w.cspan(), dx.span(), 0);
    gg.wgrad_bf16(seg, p.n, p.k, dy.cspan(), x.cspan(), gemm::WgradOut::f32(dw.p, dw.n), 0);
    EXPECT_TRUE(is_poison(y.get(), 0)) << "fprop wrote with malformed offsets";
    EXPECT_TRUE(is_poison(dx.get(), 0)) << "dgrad wrote with malformed offsets";
    for (float f : dw.get()) ASSERT_TRUE(std::isnan(f)) << "wgrad wrote with malformed offsets";
  }
  {  // 128-aligned for fprop/dgrad purposes but not for wgrad: only wgrad refuses
    GBuf<int32_t> off(std::vector<int32_t>{0, 100, 256});
    const gemm::DeviceSegments seg{off.p, 2, p.m, st};
    GBuf<float> dw(2 * p.n * p.k);
    gg.wgrad_bf16(seg, p.n, p.k, dy.cspan(), x.cspan(), gemm::WgradOut::f32(dw.p, dw.n), 0);
    for (float f : dw.get()) ASSERT_TRUE(std::isnan(f)) << "wgrad wrote with unaligned offsets";
  }
  EXPECT_EQ(st->bad_segments, 10u) << "each malformed call counted once";
  cudaFree(st);
  GBuf<int32_t> off(p.seg.offsets);
  const gemm::DeviceSegments seg{off.p, p.E, p.m, nullptr};
  GBuf<bf16_t> y(p.m * p.n);
  {  // no rows: nothing computed; wgrad = zeroes dW, += leaves it
    const gemm::DeviceSegments none{off.p, p.E, 0, nullptr};
    GBuf<float> dw(2 * p.n * p.k);
    EXPECT_NO_THROW(gg.fprop_bf16(none, p.n, p.k, {x.p, 0}, w.cspan(), {y.p, 0}, 0));
    EXPECT_NO_THROW(gg.wgrad_bf16(none, p.n, p.k, {dy.p, 0}, {x.p, 0}, gemm::WgradOut::f32(dw.p, dw.n), 0));
    for (float f : dw.get()) ASSERT_EQ(f, 0.0f) << "overwrite with no rows gives zero gradients";
    EXPECT_TRUE(is_poison(y.get(), 0));
  }
  // each error says what was wrong (its message checked), before anything is launched
  const auto expect_error = [](const std::function<void()>& call, const char* says) {
    try {
      call();
      ADD_FAILURE() << "no error; expected one saying \"" << says << "\"";
    } catch (const Error& e) {
      EXPECT_NE(std::string(e.what()).find(says), std::string::npos) << e.what();
    }
  };
  using CB = gemm::Span<const bf16_t>;
  expect_error([&] { gg.fprop_bf16(seg, 100, p.k, x.cspan(), w.cspan(), y.span(), 0); }, "multiples of 128");
  expect_error([&] { gg.dgrad_bf16(seg, p.n, 64, dy.cspan(), w.cspan(), y.span(), 0); }, "multiples of 128");
  expect_error([&] { gg.fprop_bf16(gemm::DeviceSegments{off.p, p.E, 0, nullptr}, 100, p.k, {x.p, 0}, w.cspan(),
                                   {y.p, 0}, 0); },
               "multiples of 128");  // (checked with no rows too)
  expect_error([&] { gg.fprop_bf16(gemm::DeviceSegments{nullptr, p.E, p.m, nullptr}, p.n, p.k, x.cspan(), w.cspan(),
                                   y.span(), 0); },
               "offsets");
  // (a weight span as large as 2000 experts need, so that the expert limit is what is hit)
  expect_error([&] { gg.fprop_bf16(gemm::DeviceSegments{off.p, 2000, p.m, nullptr}, p.n, p.k, x.cspan(),
                                   CB{w.p, int64_t(2000) * p.n * p.k}, y.span(), 0); },
               "expert count");
  expect_error([&] { gg.fprop_bf16(seg, p.n, p.k, x.cspan(), w.cspan(), gemm::Span<bf16_t>{y.p, 10}, 0); }, "y holds");
  expect_error([&] { gg.fprop_bf16(seg, p.n, p.k, x.cspan(), CB{w.p, 10}, y.span(), 0); }, "w holds");
  expect_error([&] { gg.wgrad_bf16(seg, p.n, p.k, dy.cspan(), x.cspan(), gemm::WgradOut::bf16(nullptr, 0), 0); },
               "dw holds");
  expect_error([&] { gg.wgrad_bf16(seg, p.n, p.k, dy.cspan(), x.cspan(), gemm::WgradOut::f32(nullptr, 2 * p.n * p.k),
                                   0); },
               "null gradient");
  GBuf<bf16_t> wide(x.n + 8);
  expect_error([&] { gg.fprop_bf16(seg, p.n, p.k, CB{wide.p + 1, int64_t(x.n)}, w.cspan(), y.span(), 0); },
               "16-byte aligned");
  EXPECT_EQ(cudaDeviceSynchronize(), cudaSuccess);
}

// The three passes captured in one CUDA graph and replayed twice give the eager calls' bits.
TEST(GemmBf16GroupedGpuGraph, ReplayEqualsEager) {
  REQUIRE_SM90();
  const Bf16Problem p = make_bf16({256, 0, 384, 128}, 256, 256, 11u, false, false);
  GBuf<bf16_t> x(p.x), dy(p.dy), w(p.w), y(p.m * p.n), dx(p.m * p.k);
  GBuf<int32_t> off(p.seg.offsets);
  const int64_t nw = int64_t(p.E) * p.n * p.k;
  GBuf<float> dw(nw);
  cuda::GroupedGemm gg(env_gemm_options());
  const gemm::DeviceSegments seg{off.p, p.E, p.m, nullptr};
  cudaStream_t s;
  ASSERT_EQ(cudaStreamCreateWithFlags(&s, cudaStreamNonBlocking), cudaSuccess);
  expect_graph_replays_equal_eager(s, [&] {
    gg.fprop_bf16(seg, p.n, p.k, x.cspan(), w.cspan(), y.span(), s);
    gg.dgrad_bf16(seg, p.n, p.k, dy.cspan(), w.cspan(), dx.span(), s);
    gg.wgrad_bf16(seg, p.n, p.k, dy.cspan(), x.cspan(), gemm::WgradOut::f32(dw.p, nw), s);
  }, y, dx, dw, "BF16 kernels");
  cudaStreamDestroy(s);
}

}  // namespace
}  // namespace flowmoe
