// The edge cases of tests/cpu/test_edge_cases.cpp on the GPU (issue 34), bit for bit against the
// CPU reference (codes, scales, counters):
//   - an expert segment of exactly 128 rows whose columns are all zero: quantize_col, the
//     scaling-aware transpose (row-max and column-amax), FP4RowToFP8Col (both), and the FP8 wgrad
//     within its tolerance, exactly zero where the column is (deepseek-ai/DeepGEMM#365);
//   - MXFP4 blocks 0..20 binades below their tile's (or column block's) largest exponent:
//     FP4RowToFP8Row and FP4RowToFP8Col, the underflow counter equal to the CPU's.
// Runs on the device machine only (CTest label `gpu`).
#include <cuda_runtime.h>
#include <gtest/gtest.h>

#include <cstdint>
#include <string>
#include <vector>

#include "common/reference.h"
#include "cuda/gemm_test_problem.h"
#include "cuda/gpu_test_util.h"
#include "flowmoe/cpu/convert.h"
#include "flowmoe/cuda/convert.h"
#include "flowmoe/gemm.h"
#include "flowmoe/numerics.h"

namespace flowmoe {
namespace {

using namespace testutil;  // DBuf, REQUIRE_DEVICE, REQUIRE_SM90, expect_same_bits

const std::vector<int64_t> kZeroCols = {0, 77, 255};

struct ZeroCase {
  const char* name;
  std::vector<int32_t> counts;
  int zero_seg;  // a segment of exactly 128 rows
};

// Normal BF16 values [m, k]; the kZeroCols columns are zero in the rows of segment `zs`.
std::vector<bf16_t> zero_column_data(int64_t m, int64_t k, const Segments& seg, int zs, uint64_t seed) {
  flowmoe_test::Rng rng(seed);
  std::vector<bf16_t> x(static_cast<size_t>(m * k));
  for (auto& v : x) v = num::f32_to_bf16(static_cast<float>(rng.normal()));
  for (int64_t r = seg.offsets[zs]; r < seg.offsets[zs + 1]; ++r)
    for (int64_t c : kZeroCols) x[static_cast<size_t>(r * k + c)] = 0;
  return x;
}

// The device block table of `seg`, and a status.
struct Blocks {
  int E;
  int64_t m, maxb, nb;
  DBuf<int32_t> off, bstart, bend, boff;
  DBuf<cuda::DeviceStatus> st;
  cuda::SegmentBlocks sb;
  explicit Blocks(const Segments& seg)
      : E(seg.num_segments()), m(seg.num_tokens()), maxb(cuda::segment_max_blocks(m, E)), nb(seg.num_blocks()),
        off(seg.offsets), bstart(maxb), bend(maxb), boff(E + 1), st(1),
        sb{off.p, E, m, maxb, bstart.p, bend.p, boff.p} {
    reset();
    cuda::build_segment_blocks(sb, st.p, 0);
  }
  void reset() { cudaMemset(st.p, 0, sizeof(cuda::DeviceStatus)); }
  cuda::DeviceStatus status() const { return st.get(1)[0]; }
};

class ZeroColumnSegmentGpu : public ::testing::TestWithParam<ZeroCase> {
 protected:
  void SetUp() override { REQUIRE_DEVICE(); }
};

TEST_P(ZeroColumnSegmentGpu, ConversionsBitExactAgainstCpu) {
  const ZeroCase& c = GetParam();
  const Segments seg = Segments::from_counts(c.counts);
  const int64_t m = seg.num_tokens(), k = 256;
  const std::vector<bf16_t> x = zero_column_data(m, k, seg, c.zero_seg, 365);
  Blocks b(seg);
  DBuf<bf16_t> dx(x);
  DBuf<uint8_t> cc(m * k), cs(b.maxb * k);

  QTensor col;
  cpu::quantize_col(x.data(), m, k, seg, &col);
  b.reset();
  cuda::quantize_col(dx.p, k, b.sb, cc.p, cs.p, nullptr, nullptr, b.st.p, 0);
  expect_same_bits(col.codes, cc.get(m * k), "quantize_col codes");
  expect_same_bits(col.scales, cs.get(b.nb * k), "quantize_col scales");

  QTensor row;
  cpu::quantize_row(x.data(), m, k, &row);
  DBuf<uint8_t> rc(row.codes), rs(row.scales);
  QTensor f4;
  cpu::quantize_mxfp4(x.data(), m, k, &f4);
  DBuf<uint8_t> fc(f4.codes), fs(f4.scales);
  for (TransposeExponent mode : {TransposeExponent::kRowMax, TransposeExponent::kColumnAmax}) {
    const std::string name = mode == TransposeExponent::kRowMax ? "row-max" : "column-amax";
    QTensor want;
    const QuantStats st = cpu::scaling_aware_transpose(row, seg, &want, mode);
    b.reset();
    cuda::scaling_aware_transpose(rc.p, rs.p, k, b.sb, cc.p, cs.p, b.st.p, 0, mode);
    expect_same_bits(want.codes, cc.get(m * k), "transpose " + name + " codes");
    expect_same_bits(want.scales, cs.get(b.nb * k), "transpose " + name + " scales");
    EXPECT_EQ(b.status().underflow, static_cast<unsigned long long>(st.underflow)) << name;

    QTensor want4;
    const QuantStats st4 = cpu::fp4_to_fp8_col(f4, seg, &want4, mode);
    b.reset();
    cuda::fp4_to_fp8_col(fc.p, fs.p, k, b.sb, cc.p, cs.p, b.st.p, 0, mode);
    expect_same_bits(want4.codes, cc.get(m * k), "FP4RowToFP8Col " + name + " codes");
    expect_same_bits(want4.scales, cs.get(b.nb * k), "FP4RowToFP8Col " + name + " scales");
    EXPECT_EQ(b.status().underflow, static_cast<unsigned long long>(st4.underflow)) << name;
    EXPECT_EQ(b.status().nonfinite, 0u) << name;
  }
  EXPECT_EQ(cudaGetLastError(), cudaSuccess);
}

TEST_P(ZeroColumnSegmentGpu, WgradWithinToleranceAndZeroOnTheZeroColumns) {
  REQUIRE_SM90();
  using namespace gemmtest;
  const ZeroCase& c = GetParam();
  Problem p = make_problem(Case{c.name, c.counts, 128, 256, {}}, false, 365u);
  for (int64_t r = p.seg.offsets[c.zero_seg]; r < p.seg.offsets[c.zero_seg + 1]; ++r)
    for (int64_t col : kZeroCols) p.x[static_cast<size_t>(r * p.k + col)] = 0;
  p.x_row = QTensor();
  p.x_col = QTensor();
  cpu::quantize_row(p.x.data(), p.m, p.k, &p.x_row);
  cpu::quantize_col(p.x.data(), p.m, p.k, p.seg, &p.x_col);
  Device d(p);
  const Refs r = fp8_refs(p);
  GBuf<float> dw(p.E * p.n * p.k);
  using WK = gemm::GroupedGemmOptions::WgradKernel;
  for (WK kernel : {WK::kOff, WK::kAlways}) {
    gemm::GroupedGemmOptions o = env_gemm_options();
    o.wgrad_kernel = kernel;
    cuda::GroupedGemm gg(o);
    const std::string what = std::string(c.name) + (kernel == WK::kOff ? " cuBLASLt" : " kernel");
    gg.wgrad(p.seg, p.n, p.k, d.op(d.dyc_c, d.dyc_s), d.op(d.xc_c, d.xc_s), gemm::WgradOut::f32(dw.p, dw.n), 0);
    const std::vector<float> got = dw.get();
    EXPECT_TRUE(close(got, r.dw, r.sdw, {0.0, kFp8C}, what + " wgrad"));
    for (int64_t i = 0; i < p.n; ++i)
      for (int64_t col : kZeroCols)
        ASSERT_EQ(num::f32_bits(got[static_cast<size_t>((c.zero_seg * p.n + i) * p.k + col)]) & 0x7FFFFFFFu, 0u)
            << what << ": dW[" << c.zero_seg << "][" << i << "][" << col << "]";
  }
  EXPECT_EQ(cudaDeviceSynchronize(), cudaSuccess);
}

INSTANTIATE_TEST_SUITE_P(
    Segments, ZeroColumnSegmentGpu,
    ::testing::Values(ZeroCase{"alone", {128}, 0}, ZeroCase{"first", {128, 128, 0, 128}, 0},
                      ZeroCase{"middle", {256, 0, 128, 384}, 2}, ZeroCase{"last", {384, 128, 128}, 2}),
    [](const ::testing::TestParamInfo<ZeroCase>& i) { return std::string(i.param.name); });

// ---- MXFP4 blocks far below the largest exponent ---------------------------------------------------

// MXFP4 [m, 128]: every nibble value cycled through each block, scale codes from scale_of(row, block).
template <typename F>
QTensor mxfp4_tensor(int64_t m, F scale_of) {
  QTensor q;
  q.layout = Layout::kMxfp4Row1x32;
  q.rows = m;
  q.cols = 128;
  q.codes.assign(static_cast<size_t>(m * 64), 0);
  q.scales.assign(static_cast<size_t>(m * 4), 0);
  for (int64_t r = 0; r < m; ++r) {
    for (int64_t c = 0; c < 128; ++c) {
      const uint8_t nib = static_cast<uint8_t>((c + r) % 16);
      uint8_t& byte = q.codes[static_cast<size_t>(r * 64 + c / 2)];
      byte = static_cast<uint8_t>(c % 2 ? (byte | (nib << 4)) : (byte | nib));
    }
    for (int j = 0; j < 4; ++j) q.scales[static_cast<size_t>(r * 4 + j)] = scale_of(r, j);
  }
  return q;
}

TEST(Mxfp4SpreadGapGpu, RowAndColumnBitExactWithTheirUnderflowCounts) {
  REQUIRE_DEVICE();
  const Segments seg = Segments::from_counts({128, 70, 0, 58});
  const int64_t m = seg.num_tokens();
  Blocks b(seg);
  DBuf<uint8_t> cc(m * 128), cs(b.maxb * 128 + m);
  for (int delta = 0; delta <= 20; ++delta) {
    const std::string d = "delta " + std::to_string(delta);
    // rows: block 2 `delta` binades below block 0 of the same 1x128 tile
    const QTensor tile = mxfp4_tensor(m, [&](int64_t, int j) {
      return static_cast<uint8_t>(137 - (j == 2 ? delta : j == 0 ? 0 : delta / 2));
    });
    QTensor want;
    const QuantStats st = cpu::fp4_to_fp8_row(tile, &want);
    DBuf<uint8_t> tc(tile.codes), ts(tile.scales);
    b.reset();
    cuda::fp4_to_fp8_row(tc.p, ts.p, m, 128, cc.p, cs.p, b.st.p, 0);
    expect_same_bits(want.codes, cc.get(m * 128), "FP4RowToFP8Row codes, " + d);
    expect_same_bits(want.scales, cs.get(m), "FP4RowToFP8Row scales, " + d);
    EXPECT_EQ(b.status().underflow, static_cast<unsigned long long>(st.underflow)) << d;
    if (delta <= 14) EXPECT_EQ(st.underflow, 0) << d;
    // columns: one token per 16 at the top, the rest `delta` binades below
    const QTensor cols = mxfp4_tensor(m, [&](int64_t r, int) {
      return static_cast<uint8_t>(r % 16 == 3 ? 137 : 137 - delta);
    });
    DBuf<uint8_t> kc(cols.codes), ks(cols.scales);
    for (TransposeExponent mode : {TransposeExponent::kRowMax, TransposeExponent::kColumnAmax}) {
      QTensor wantc;
      const QuantStats stc = cpu::fp4_to_fp8_col(cols, seg, &wantc, mode);
      b.reset();
      cuda::fp4_to_fp8_col(kc.p, ks.p, 128, b.sb, cc.p, cs.p, b.st.p, 0, mode);
      const std::string what = std::string(mode == TransposeExponent::kRowMax ? "row-max " : "column-amax ") + d;
      expect_same_bits(wantc.codes, cc.get(m * 128), "FP4RowToFP8Col codes, " + what);
      expect_same_bits(wantc.scales, cs.get(b.nb * 128), "FP4RowToFP8Col scales, " + what);
      EXPECT_EQ(b.status().underflow, static_cast<unsigned long long>(stc.underflow)) << what;
      if (delta <= 14) EXPECT_EQ(stc.underflow, 0) << what;
    }
  }
  EXPECT_EQ(cudaGetLastError(), cudaSuccess);
}

}  // namespace
}  // namespace flowmoe
