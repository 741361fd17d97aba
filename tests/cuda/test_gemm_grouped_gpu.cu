// flowmoe's sm_90a grouped FP8 kernels on device segments (GroupedGemm's DeviceSegments entry
// points: one launch, offsets read on the device) against the CPU reference within the tolerance of
// gemm_test_problem.h, bit for bit on exactly representable sums, ragged counts (0, 1, 127, 129,
// more than 65536 rows), every scale format, rows past the segments untouched, malformed offsets
// counted, bad shapes rejected, and a CUDA-graph replay equal to the eager calls. GPU label.
#include <cuda_runtime.h>
#include <gtest/gtest.h>

#include <cstring>
#include <string>
#include <vector>

#include "cuda/gemm_test_problem.h"
#include "flowmoe/cuda/qtensor_view.h"
#include "flowmoe/cuda/status.h"
#include "flowmoe/error.h"

namespace flowmoe {
namespace {

using namespace gemmtest;

// The views of a problem's device copies. The first `experts` experts and rows
// 0 .. offsets[experts] are the GEMM's; rows past them (the problem's last segments) must stay
// as they were. Scale formats: x UE8M0 (raw, read as is) with w FP32, dy FP32 expert-packed with
// wt UE8M0, so both formats of both operands are exercised.
struct Views {
  GBuf<uint8_t> x_s8, wt_s8;  // raw UE8M0 scales
  cuda::QTensorView x, w, dy, wt, dy_col, x_col;
  Views(const Problem& p, Device& d, int experts)
      : x_s8(p.x_row.scales), wt_s8(concat<uint8_t>(p.wtq, true)) {
    x = cuda::row_1x128(d.xr_c.p, x_s8.p, p.m, p.k);
    w = cuda::weight_128x128(d.w_c.p, nullptr, experts, p.n, p.k);
    w.scales = d.w_s.p, w.scale_format = cuda::ScaleFormat::kF32, w.scale_ld = gemm::weight_scale_ld(p.k);
    dy = cuda::row_1x128(d.dyr_c.p, nullptr, p.m, p.n);
    dy.scales = d.dyr_s.p, dy.scale_format = cuda::ScaleFormat::kF32, dy.scale_ld = p.m;
    wt = cuda::weight_128x128(d.wt_c.p, wt_s8.p, experts, p.k, p.n);
    dy_col = cuda::col_128x1(d.dyc_c.p, nullptr, p.m, p.n, p.m / 128);
    dy_col.scales = d.dyc_s.p, dy_col.scale_format = cuda::ScaleFormat::kF32;
    x_col = cuda::col_128x1(d.xc_c.p, nullptr, p.m, p.k, p.m / 128);
    x_col.scales = d.xc_s.p, x_col.scale_format = cuda::ScaleFormat::kF32;
  }
};

bool is_poison(const std::vector<bf16_t>& v, size_t from) {
  for (size_t i = from; i < v.size(); ++i)
    if (v[i] != 0xFFFF) return false;
  return true;
}

// The grouped cases: `tail` trailing segments are outside the GEMM (rows past offsets[E]).
struct GroupedCase {
  Case c;
  int tail;
};
std::ostream& operator<<(std::ostream& os, const GroupedCase& g) { return os << g.c.name; }

class GemmGroupedGpu : public ::testing::TestWithParam<GroupedCase> {};

TEST_P(GemmGroupedGpu, FpropDgradMatchReference) {
  REQUIRE_SM90();
  const Case& c = GetParam().c;
  const Problem p = make_problem(c, false, 4000u + static_cast<uint32_t>(c.n * 3 + c.k));
  Device d(p);
  const int E = p.E - GetParam().tail;
  const int64_t rows = p.seg.offsets[E];
  Views v(p, d, E);
  const Refs r = fp8_refs(p);
  cuda::GroupedGemm gg(env_gemm_options());
  cuda::DeviceStatus* st = nullptr;
  ASSERT_EQ(cudaMallocManaged(&st, sizeof(*st)), cudaSuccess);
  std::memset(st, 0, sizeof(*st));
  const gemm::DeviceSegments seg{d.offsets.p, E, p.m, st};
  GBuf<bf16_t> y(p.m * p.n), dx(p.m * p.k);
  gg.fprop(seg, p.n, p.k, v.x, v.w, y.span(), 0);
  gg.dgrad(seg, p.n, p.k, v.dy, v.wt, dx.span(), 0);
  EXPECT_EQ(gg.stats().grouped_kernel_calls, 2);
  EXPECT_EQ(gg.stats().matmuls, 0) << "no cuBLASLt call";
  const auto yg = y.get(), dxg = dx.get();
  const auto prefix = [](const std::vector<float>& f, int64_t n) { return std::vector<float>(f.begin(), f.begin() + n); };
  const auto dprefix = [](const std::vector<double>& f, int64_t n) { return std::vector<double>(f.begin(), f.begin() + n); };
  EXPECT_TRUE(close(prefix(widen(yg), rows * p.n), prefix(r.y, rows * p.n), dprefix(r.sy, rows * p.n),
                    {1.0 / 256, kFp8C}, std::string(c.name) + " grouped fprop"));
  EXPECT_TRUE(close(prefix(widen(dxg), rows * p.k), prefix(r.dx, rows * p.k), dprefix(r.sdx, rows * p.k),
                    {1.0 / 256, kFp8C}, std::string(c.name) + " grouped dgrad"));
  EXPECT_TRUE(is_poison(yg, rows * p.n)) << "fprop wrote rows past offsets[E]";
  EXPECT_TRUE(is_poison(dxg, rows * p.k)) << "dgrad wrote rows past offsets[E]";
  EXPECT_EQ(st->bad_segments, 0u);
  cudaFree(st);
}

TEST_P(GemmGroupedGpu, ExactOnSmallValues) {
  REQUIRE_SM90();
  const Case& c = GetParam().c;
  const Problem p = make_problem(c, true, 99u + static_cast<uint32_t>(c.n));
  Device d(p);
  const int E = p.E - GetParam().tail;
  const int64_t rows = p.seg.offsets[E];
  Views v(p, d, E);
  const Refs r = fp8_refs(p);
  cuda::GroupedGemm gg(env_gemm_options());
  const gemm::DeviceSegments seg{d.offsets.p, E, p.m, nullptr};
  GBuf<bf16_t> y(p.m * p.n), dx(p.m * p.k);
  gg.fprop(seg, p.n, p.k, v.x, v.w, y.span(), 0);
  gg.dgrad(seg, p.n, p.k, v.dy, v.wt, dx.span(), 0);
  auto want_y = widen(narrow(r.y)), want_dx = widen(narrow(r.dx));
  want_y.resize(rows * p.n), want_dx.resize(rows * p.k);
  expect_same_bits(want_y, widen(y.get(rows * p.n)), "grouped fprop (BF16 of the exact value)");
  expect_same_bits(want_dx, widen(dx.get(rows * p.k)), "grouped dgrad (BF16 of the exact value)");
}

INSTANTIATE_TEST_SUITE_P(
    Ragged, GemmGroupedGpu,
    ::testing::Values(GroupedCase{{"zero_one_127_129", {0, 1, 127, 129, 0, 256, 3}, 256, 384, {}}, 0},
                      GroupedCase{{"tail_untouched", {130, 0, 5, 200, 77}, 128, 256, {}}, 2},
                      GroupedCase{{"all_empty", {0, 0, 0, 40}, 128, 128, {}}, 1},
                      GroupedCase{{"one_token", {1}, 384, 128, {}}, 0},
                      GroupedCase{{"over_65536_rows", {65601, 2}, 128, 128, {}}, 0}),
    [](const ::testing::TestParamInfo<GroupedCase>& i) { return std::string(i.param.c.name); });

// wgrad on device offsets (multiples of 128): the kernel with the offsets read on the device equals
// the host-offset launch bit for bit, is within tolerance of the reference, zeroes empty experts
// when overwriting (the output starts as NaN) and leaves them untouched when accumulating. The
// first two cases run the kernel's 128 x 128 output tiles by shape, the third its 128 x 256 tiles (K
// a multiple of 256 and at least 1024 tokens per expert on average); each is also run with every
// tile width forced, which must give the same bits.
struct WgradCase {
  Case c;
  std::vector<int> empty;  // the empty experts
};
class GemmGroupedGpuWgrad : public ::testing::TestWithParam<WgradCase> {};
TEST_P(GemmGroupedGpuWgrad, DeviceOffsetsMatchReferenceAndHostPath) {
  REQUIRE_SM90();
  const Case& c = GetParam().c;
  const Problem p = make_problem(c, false, 321u);
  Device d(p);
  Views v(p, d, p.E);
  const Refs r = fp8_refs(p);
  cuda::GroupedGemm::Options kernel_always = env_gemm_options();
  kernel_always.wgrad_kernel = cuda::GroupedGemm::Options::WgradKernel::kAlways;
  cuda::GroupedGemm gg(kernel_always);
  const gemm::DeviceSegments seg{d.offsets.p, p.E, p.m, nullptr};
  const int64_t nw = int64_t(p.E) * p.n * p.k;
  GBuf<float> dev(nw), host(nw);
  gg.wgrad(seg, p.n, p.k, v.dy_col, v.x_col, gemm::WgradOut::f32(dev.p, nw), 0);
  gg.wgrad(p.seg, p.n, p.k, d.op(d.dyc_c, d.dyc_s), d.op(d.xc_c, d.xc_s), gemm::WgradOut::f32(host.p, nw), 0);
  EXPECT_EQ(gg.stats().wgrad_kernel_calls, 2);
  const auto dv = dev.get();
  expect_same_bits(host.get(), dv, "wgrad: device offsets vs host offsets");
  EXPECT_TRUE(close(dv, r.dw, r.sdw, {0.0, kFp8C}, "grouped wgrad f32"));
  // each tile width forced (256 where K allows): the same products in the same order, same bits
  for (int tile_n : {128, 256}) {
    if (p.k % tile_n != 0) continue;
    cuda::GroupedGemm::Options forced = kernel_always;
    forced.wgrad_tile_n = tile_n;
    cuda::GroupedGemm gt(forced);
    GBuf<float> out(nw);
    gt.wgrad(seg, p.n, p.k, v.dy_col, v.x_col, gemm::WgradOut::f32(out.p, nw), 0);
    expect_same_bits(dv, out.get(), ("wgrad: tile width " + std::to_string(tile_n) + " vs by shape").c_str());
  }
  // BF16 output (=, the gradient of a BF16 parameter): the FP32 output rounded once (RNE), on both
  // offset paths and at every tile width; empty experts zeroed (the buffer starts as NaN)
  std::vector<bf16_t> want16(nw);
  for (int64_t i = 0; i < nw; ++i) want16[i] = num::f32_to_bf16(dv[i]);
  for (int tile_n : {0, 128, 256}) {
    if (tile_n != 0 && p.k % tile_n != 0) continue;
    cuda::GroupedGemm::Options forced = kernel_always;
    forced.wgrad_tile_n = tile_n;
    cuda::GroupedGemm gt(forced);
    GBuf<bf16_t> out16(nw), host16(nw);
    gt.wgrad(seg, p.n, p.k, v.dy_col, v.x_col, gemm::WgradOut::bf16(out16.p, nw), 0);
    gt.wgrad(p.seg, p.n, p.k, d.op(d.dyc_c, d.dyc_s), d.op(d.xc_c, d.xc_s), gemm::WgradOut::bf16(host16.p, nw), 0);
    EXPECT_EQ(gt.stats().wgrad_kernel_calls, 2);
    const std::string what = "wgrad BF16 output, tile width " + std::to_string(tile_n);
    expect_same_bits(want16, out16.get(), what + ", device offsets");
    expect_same_bits(want16, host16.get(), what + ", host offsets");
  }
  std::vector<float> g0(nw), want(nw);
  for (int64_t i = 0; i < nw; ++i) g0[i] = float((i * 37) % 101) - 50.0f, want[i] = g0[i] + r.dw[i];
  dev.put(g0);
  gg.wgrad(seg, p.n, p.k, v.dy_col, v.x_col, gemm::WgradOut::accumulate(dev.p, nw), 0);
  const auto acc = dev.get();
  EXPECT_TRUE(close(acc, want, r.sdw, {2 * kU, kFp8C}, "grouped wgrad accumulate"));
  for (int e : GetParam().empty)
    for (int64_t i = 0; i < p.n * p.k; ++i)
      ASSERT_EQ(acc[e * p.n * p.k + i], g0[e * p.n * p.k + i]) << "empty expert " << e << " must be untouched";
  // NaN sums (an E4M3 NaN code in dY's first column block): BF16 output = f32_to_bf16 of the FP32
  // output there too (a quiet NaN keeping sign and payload, not the cvt instruction's canonical one)
  ASSERT_EQ(cudaMemset(d.dyc_c.p, 0x7F, 1), cudaSuccess);
  GBuf<float> nan32(nw);
  GBuf<bf16_t> nan16(nw);
  gg.wgrad(seg, p.n, p.k, v.dy_col, v.x_col, gemm::WgradOut::f32(nan32.p, nw), 0);
  gg.wgrad(seg, p.n, p.k, v.dy_col, v.x_col, gemm::WgradOut::bf16(nan16.p, nw), 0);
  const auto f = nan32.get();
  std::vector<bf16_t> want_nan(nw);
  int64_t nans = 0;
  for (int64_t i = 0; i < nw; ++i) want_nan[i] = num::f32_to_bf16(f[i]), nans += f[i] != f[i];
  EXPECT_GT(nans, 0);
  expect_same_bits(want_nan, nan16.get(), "wgrad BF16 output with NaN sums");
}
// The column copies' UE8M0 scales read as they are (the kernel decodes them in shared memory) give
// the bits of their FP32 conversion (col_scales_to_f32), at every tile width and output kind, also
// with the extreme codes: 0 (2^-127, a subnormal), 254 (2^127) and 255 (NaN) in both operands.
TEST_P(GemmGroupedGpuWgrad, Ue8m0ScalesGiveTheBitsOfTheirConversion) {
  REQUIRE_SM90();
  const Case& c = GetParam().c;
  Problem p = make_problem(c, false, 654u);
  for (int round = 0; round < 2; ++round) {
    SCOPED_TRACE(round == 0 ? "scales as quantized" : "extreme scale codes");
    if (round == 1) {  // a few scales of each operand set to the extreme codes
      const uint8_t codes[] = {0, 254, 255, 0, 254};
      for (size_t i = 0; i < sizeof codes; ++i) {
        p.dy_col.scales[(i * 131) % p.dy_col.scales.size()] = codes[i];
        p.x_col.scales[(i * 197 + 3) % p.x_col.scales.size()] = codes[i];
      }
    }
    Device d(p);  // (its FP32 column scales converted from the UE8M0 bytes by col_scales_to_f32)
    Views v(p, d, p.E);
    GBuf<uint8_t> dy_s8(p.dy_col.scales), x_s8(p.x_col.scales);
    const cuda::QTensorView dy8 = cuda::col_128x1(d.dyc_c.p, dy_s8.p, p.m, p.n, p.m / 128);
    const cuda::QTensorView x8 = cuda::col_128x1(d.xc_c.p, x_s8.p, p.m, p.k, p.m / 128);
    const gemm::DeviceSegments seg{d.offsets.p, p.E, p.m, nullptr};
    const int64_t nw = int64_t(p.E) * p.n * p.k;
    for (int tile_n : {0, 128, 256}) {
      if (tile_n != 0 && p.k % tile_n != 0) continue;
      cuda::GroupedGemm::Options o = env_gemm_options();
      o.wgrad_tile_n = tile_n;
      cuda::GroupedGemm gg(o);
      const std::string what = "tile width " + std::to_string(tile_n);
      GBuf<float> f32(nw), u8(nw), acc32(nw), acc8(nw);
      GBuf<bf16_t> b32(nw), b8(nw);
      gg.wgrad(seg, p.n, p.k, v.dy_col, v.x_col, gemm::WgradOut::f32(f32.p, nw), 0);
      gg.wgrad(seg, p.n, p.k, dy8, x8, gemm::WgradOut::f32(u8.p, nw), 0);
      gg.wgrad(seg, p.n, p.k, v.dy_col, v.x_col, gemm::WgradOut::bf16(b32.p, nw), 0);
      gg.wgrad(seg, p.n, p.k, dy8, x8, gemm::WgradOut::bf16(b8.p, nw), 0);
      std::vector<float> g0(nw);
      for (int64_t i = 0; i < nw; ++i) g0[i] = float((i * 29) % 97) - 48.0f;
      acc32.put(g0), acc8.put(g0);
      gg.wgrad(seg, p.n, p.k, v.dy_col, v.x_col, gemm::WgradOut::accumulate(acc32.p, nw), 0);
      gg.wgrad(seg, p.n, p.k, dy8, x8, gemm::WgradOut::accumulate(acc8.p, nw), 0);
      const auto want = f32.get();
      if (round == 1) {
        int64_t nans = 0;
        for (float f : want) nans += f != f;
        EXPECT_GT(nans, 0) << what << ": the NaN scale reached no output";
      }
      expect_same_bits(want, u8.get(), what + ", FP32 output");
      expect_same_bits(b32.get(), b8.get(), what + ", BF16 output");
      expect_same_bits(acc32.get(), acc8.get(), what + ", accumulated");
    }
    // one operand UE8M0 and the other FP32: refused before anything is launched
    cuda::GroupedGemm gg(env_gemm_options());
    GBuf<float> dw(nw);
    EXPECT_THROW(gg.wgrad(seg, p.n, p.k, dy8, v.x_col, gemm::WgradOut::f32(dw.p, nw), 0), Error);
    for (float f : dw.get()) ASSERT_TRUE(std::isnan(f)) << "a refused wgrad wrote dW";
  }
}

INSTANTIATE_TEST_SUITE_P(Tiles, GemmGroupedGpuWgrad,
                         ::testing::Values(WgradCase{{"ragged_k384", {256, 0, 128, 384, 0, 128}, 256, 384, {}}, {1, 4}},
                                           WgradCase{{"ragged_k512", {256, 0, 128, 384, 0, 128}, 128, 512, {}}, {1, 4}},
                                           WgradCase{{"long_k512", {2048, 0, 1024}, 256, 512, {}}, {1}}),
                         [](const ::testing::TestParamInfo<WgradCase>& i) { return std::string(i.param.c.name); });

// Malformed device offsets: counted once per call in bad_segments, outputs untouched; bad shapes
// and views throw before anything is launched.
TEST(GemmGroupedGpuErrors, MalformedOffsetsAndBadShapes) {
  REQUIRE_SM90();
  const Case c{"errors", {128, 128}, 128, 128, {}};
  const Problem p = make_problem(c, false, 5u);
  Device d(p);
  Views v(p, d, p.E);
  cuda::GroupedGemm gg(env_gemm_options());
  cuda::DeviceStatus* st = nullptr;
  ASSERT_EQ(cudaMallocManaged(&st, sizeof(*st)), cudaSuccess);
  std::memset(st, 0, sizeof(*st));
  for (const std::vector<int32_t>& bad : {std::vector<int32_t>{0, 200, 100}, {0, 128, 300}, {-128, 0, 128}}) {
    GBuf<int32_t> off(bad);
    const gemm::DeviceSegments seg{off.p, 2, p.m, st};
    GBuf<bf16_t> y(p.m * p.n);
    GBuf<float> dw(2 * p.n * p.k);
    gg.fprop(seg, p.n, p.k, v.x, v.w, y.span(), 0);
    gg.wgrad(seg, p.n, p.k, v.dy_col, v.x_col, gemm::WgradOut::f32(dw.p, dw.n), 0);
    EXPECT_TRUE(is_poison(y.get(), 0)) << "fprop wrote with malformed offsets";
    for (float f : dw.get()) ASSERT_TRUE(std::isnan(f)) << "wgrad wrote with malformed offsets";
  }
  EXPECT_EQ(st->bad_segments, 6u) << "each malformed call counted once";
  cudaFree(st);
  const gemm::DeviceSegments seg{d.offsets.p, p.E, p.m, nullptr};
  GBuf<bf16_t> y(p.m * p.n);
  {  // no rows (an expert-parallel rank that received none): nothing computed; wgrad = zeroes dW
    const gemm::DeviceSegments none{d.offsets.p, p.E, 0, nullptr};
    cuda::QTensorView empty_rows = v.x, empty_col = v.x_col;
    empty_rows.rows = 0, empty_col.rows = 0;
    GBuf<float> dw(2 * p.n * p.k);
    EXPECT_NO_THROW(gg.fprop(none, p.n, p.k, empty_rows, v.w, gemm::Span<bf16_t>{y.p, 0}, 0));
    EXPECT_NO_THROW(gg.wgrad(none, p.n, p.k, empty_col, empty_col, gemm::WgradOut::f32(dw.p, dw.n), 0));
    for (float f : dw.get()) ASSERT_EQ(f, 0.0f) << "overwrite with no rows gives zero gradients";
    EXPECT_TRUE(is_poison(y.get(), 0));
  }
  EXPECT_THROW(gg.fprop(seg, 100, p.k, v.x, v.w, y.span(), 0), Error) << "n not a multiple of 128";
  EXPECT_THROW(gg.fprop(gemm::DeviceSegments{nullptr, p.E, p.m, nullptr}, p.n, p.k, v.x, v.w, y.span(), 0), Error);
  EXPECT_THROW(gg.fprop(gemm::DeviceSegments{d.offsets.p, 2000, p.m, nullptr}, p.n, p.k, v.x, v.w, y.span(), 0), Error)
      << "more experts than the kernel takes";
  EXPECT_THROW(gg.fprop(seg, p.n, p.k, v.x, v.w, gemm::Span<bf16_t>{y.p, 10}, 0), Error) << "output too small";
  EXPECT_THROW(gg.wgrad(seg, p.n, p.k, v.dy_col, v.x_col, gemm::WgradOut::bf16(nullptr, 0), 0), Error)
      << "BF16 wgrad output too small";
  EXPECT_THROW(gg.fprop(seg, p.n, p.k, v.dy_col, v.w, y.span(), 0), Error) << "column-wise view as fprop input";
  {  // a forced tile width the shape does not allow (K = 128): a clear error, dW untouched
    cuda::GroupedGemm::Options wide = env_gemm_options();
    wide.wgrad_kernel = cuda::GroupedGemm::Options::WgradKernel::kAlways;
    wide.wgrad_tile_n = 256;
    cuda::GroupedGemm gw(wide);
    GBuf<float> dw(2 * p.n * p.k);
    try {
      gw.wgrad(seg, p.n, p.k, v.dy_col, v.x_col, gemm::WgradOut::f32(dw.p, dw.n), 0);
      ADD_FAILURE() << "tile width 256 with K = 128 was accepted";
    } catch (const Error& e) {
      EXPECT_NE(std::string(e.what()).find("tile width 256 with K not a multiple of 256"), std::string::npos) << e.what();
    }
    for (float f : dw.get()) ASSERT_TRUE(std::isnan(f)) << "a refused wgrad wrote dW";
  }
  EXPECT_EQ(cudaDeviceSynchronize(), cudaSuccess);
}

// The three passes captured in one CUDA graph and replayed twice give the eager calls' bits.
TEST(GemmGroupedGpuGraph, ReplayEqualsEager) {
  REQUIRE_SM90();
  const Case c{"graph", {256, 0, 384, 128}, 256, 256, {}};
  const Problem p = make_problem(c, false, 11u);
  Device d(p);
  Views v(p, d, p.E);
  cuda::GroupedGemm gg(env_gemm_options());
  const gemm::DeviceSegments seg{d.offsets.p, p.E, p.m, nullptr};
  const int64_t nw = int64_t(p.E) * p.n * p.k;
  GBuf<bf16_t> y(p.m * p.n), dx(p.m * p.k);
  GBuf<float> dw(nw);
  cudaStream_t s;
  ASSERT_EQ(cudaStreamCreateWithFlags(&s, cudaStreamNonBlocking), cudaSuccess);
  expect_graph_replays_equal_eager(s, [&] {
    gg.fprop(seg, p.n, p.k, v.x, v.w, y.span(), s);
    gg.dgrad(seg, p.n, p.k, v.dy, v.wt, dx.span(), s);
    gg.wgrad(seg, p.n, p.k, v.dy_col, v.x_col, gemm::WgradOut::f32(dw.p, nw), s);
  }, y, dx, dw, "grouped FP8");
  cudaStreamDestroy(s);
}

}  // namespace
}  // namespace flowmoe
