// Edge cases other implementations have tripped on (issue 34), on the CPU reference:
//   - an expert segment of exactly 128 rows (one whole token block) whose column is all zeros
//     (zero amax) through the column quantizer, the scaling-aware transpose (both exponent rules),
//     FP4RowToFP8Col and the FP8 wgrad reference (DeepGEMM's k-grouped wgrad returned wrong results
//     there: deepseek-ai/DeepGEMM#365);
//   - MXFP4 blocks whose exponent lies 0..20 binades below the largest of their 1x128 tile (or of
//     their 128-token column block): the FP4 -> FP8 conversions are exact up to 14 binades (SPEC §4)
//     and count as underflow exactly the elements they change beyond.
// The GPU versions are in tests/cuda/test_edge_cases_gpu.cu.
#include <gtest/gtest.h>

#include <cmath>
#include <cstdint>
#include <string>
#include <vector>

#include "common/reference.h"
#include "flowmoe/cpu/convert.h"
#include "flowmoe/gemm.h"
#include "flowmoe/numerics.h"
#include "flowmoe/tensor.h"

namespace flowmoe {
namespace {

namespace ft = flowmoe_test;

// [m, k] normal values; in the rows of segment `zero_seg` every column listed in `zero_cols` is 0.
std::vector<float> data_with_zero_columns(int64_t m, int64_t k, const Segments& seg, int zero_seg,
                                          const std::vector<int64_t>& zero_cols, uint64_t seed) {
  ft::Rng rng(seed);
  std::vector<float> x(static_cast<size_t>(m * k));
  for (float& v : x) v = static_cast<float>(rng.normal());
  for (int64_t r = seg.offsets[zero_seg]; r < seg.offsets[zero_seg + 1]; ++r)
    for (int64_t c : zero_cols) x[static_cast<size_t>(r * k + c)] = 0.0f;
  return x;
}

std::vector<float> decoded(const QTensor& q) {
  std::vector<float> y(static_cast<size_t>(q.rows * q.cols));
  cpu::dequantize(q, y.data());
  return y;
}

// The column block of segment `s` (whole 128-token blocks only) and feature `c`: its scale byte.
uint8_t col_scale(const QTensor& col, const Segments& seg, int s, int64_t c) {
  const int64_t block = seg.block_offsets()[static_cast<size_t>(s)];
  return col.scales[static_cast<size_t>(block * col.cols + c)];
}

// Same values except the `underflow` elements, which may differ; returns how many differ.
int64_t count_changed(const std::vector<float>& want, const std::vector<float>& got) {
  int64_t n = 0;
  for (size_t i = 0; i < want.size(); ++i) n += num::f32_bits(want[i]) != num::f32_bits(got[i]);
  return n;
}

struct ZeroColumnCase {
  const char* name;
  std::vector<int32_t> counts;  // one segment of exactly 128 rows
  int zero_seg;
};

class ZeroColumnSegment : public ::testing::TestWithParam<ZeroColumnCase> {};

TEST_P(ZeroColumnSegment, QuantizersAndExactConversionsGiveZeroWithTheSmallestScale) {
  const ZeroColumnCase& c = GetParam();
  const Segments seg = Segments::from_counts(c.counts);
  const int64_t m = seg.num_tokens(), k = 256;
  ASSERT_EQ(seg.offsets[c.zero_seg + 1] - seg.offsets[c.zero_seg], 128);
  const std::vector<int64_t> zero_cols = {0, 77, 255};
  const std::vector<float> x = data_with_zero_columns(m, k, seg, c.zero_seg, zero_cols, 365);

  // column quantizer from the high-precision values
  QTensor col;
  QuantStats st = cpu::quantize_col(x.data(), m, k, seg, &col);
  EXPECT_EQ(st.nonfinite, 0);
  // row quantizer, then the exact conversions
  QTensor row, aware, colamax, fp4, fp4col, fp4col_amax, stepwise;
  st = cpu::quantize_row(x.data(), m, k, &row);
  EXPECT_EQ(st.nonfinite, 0);
  const QuantStats st_aware = cpu::scaling_aware_transpose(row, seg, &aware, TransposeExponent::kRowMax);
  const QuantStats st_amax = cpu::scaling_aware_transpose(row, seg, &colamax, TransposeExponent::kColumnAmax);
  cpu::quantize_mxfp4(x.data(), m, k, &fp4);
  const QuantStats st_fp4 = cpu::fp4_to_fp8_col(fp4, seg, &fp4col, TransposeExponent::kRowMax);
  const QuantStats st_fp4_amax = cpu::fp4_to_fp8_col(fp4, seg, &fp4col_amax, TransposeExponent::kColumnAmax);
  cpu::fp4_to_fp8_col_stepwise(fp4, seg, &stepwise);

  for (int64_t zc : zero_cols) {
    // A zero amax gets scale code 0 wherever the scale comes from the column's own values.
    EXPECT_EQ(col_scale(col, seg, c.zero_seg, zc), 0) << "quantize_col, column " << zc;
    EXPECT_EQ(col_scale(colamax, seg, c.zero_seg, zc), 0) << "column-amax transpose, column " << zc;
    EXPECT_EQ(col_scale(fp4col_amax, seg, c.zero_seg, zc), 0) << "FP4RowToFP8Col column-amax, column " << zc;
    EXPECT_EQ(col_scale(stepwise, seg, c.zero_seg, zc), 0) << "stepwise, column " << zc;
    // Row-max takes the rows' exponents (their other columns are not zero): any scale, zero codes.
    for (const QTensor* q : {&col, &aware, &colamax, &fp4col, &fp4col_amax, &stepwise})
      for (int64_t t = seg.offsets[c.zero_seg]; t < seg.offsets[c.zero_seg + 1]; ++t)
        ASSERT_EQ(q->codes[static_cast<size_t>(zc * m + t)] & 0x7F, 0)
            << q->describe() << " token " << t << " column " << zc;
  }
  // Every exact conversion still decodes to its source, except what it counts.
  const std::vector<float> xr = decoded(row), xf = decoded(fp4);
  EXPECT_EQ(count_changed(xr, decoded(aware)), st_aware.underflow);
  EXPECT_EQ(count_changed(xr, decoded(colamax)), st_amax.underflow);
  EXPECT_EQ(count_changed(xf, decoded(fp4col)), st_fp4.underflow);
  EXPECT_EQ(count_changed(xf, decoded(fp4col_amax)), st_fp4_amax.underflow);
  // and the column-amax rule equals the stepwise path bit for bit
  EXPECT_EQ(fp4col_amax.codes, stepwise.codes);
  EXPECT_EQ(fp4col_amax.scales, stepwise.scales);
}

TEST_P(ZeroColumnSegment, WgradReferenceIsZeroThereAndRightEverywhere) {
  const ZeroColumnCase& c = GetParam();
  const Segments seg = Segments::from_counts(c.counts);
  const int64_t m = seg.num_tokens(), k = 256, n = 128;
  const std::vector<int64_t> zero_cols = {0, 77, 255};
  const std::vector<float> x = data_with_zero_columns(m, k, seg, c.zero_seg, zero_cols, 365);
  const std::vector<float> dy = data_with_zero_columns(m, n, seg, c.zero_seg, {}, 366);
  // the flow recipe's operands: X column-wise from the row-wise copy, dY column-wise
  QTensor xrow, xcol, dyrow, dycol;
  cpu::quantize_row(x.data(), m, k, &xrow);
  cpu::scaling_aware_transpose(xrow, seg, &xcol);
  cpu::quantize_row(dy.data(), m, n, &dyrow);
  cpu::scaling_aware_transpose(dyrow, seg, &dycol);
  const int e = seg.num_segments();
  std::vector<float> dw(static_cast<size_t>(e * n * k), -1.0f);
  cpu::grouped_wgrad_ref(dycol, xcol, dw.data(), false);
  const std::vector<float> xd = decoded(xcol), dyd = decoded(dycol);
  for (int s = 0; s < e; ++s) {
    const int64_t blocks = (seg.offsets[s + 1] - seg.offsets[s] + 127) / 128;
    for (int64_t i = 0; i < n; ++i) {
      for (int64_t j = 0; j < k; ++j) {
        double want = 0, mag = 0;
        for (int64_t t = seg.offsets[s]; t < seg.offsets[s + 1]; ++t) {
          const double p = static_cast<double>(dyd[static_cast<size_t>(t * n + i)]) * xd[static_cast<size_t>(t * k + j)];
          want += p;
          mag += std::fabs(p);
        }
        const float got = dw[static_cast<size_t>((s * n + i) * k + j)];
        // the reference's documented bound (docs/GEMM.md, "Numerics and tolerance")
        ASSERT_LE(std::fabs(got - want), (128.0 + blocks + 2) * std::ldexp(1.0, -24) * mag)
            << "expert " << s << " dW[" << i << ", " << j << "]";
        if (s == c.zero_seg && (j == 0 || j == 77 || j == 255)) {
          ASSERT_EQ(num::f32_bits(got) & 0x7FFFFFFFu, 0u) << "expert " << s << " dW[" << i << ", " << j << "]";
        }
      }
    }
  }
}

INSTANTIATE_TEST_SUITE_P(
    Segments, ZeroColumnSegment,
    ::testing::Values(ZeroColumnCase{"alone", {128}, 0}, ZeroColumnCase{"first", {128, 100, 0, 29}, 0},
                      ZeroColumnCase{"middle", {77, 0, 128, 131}, 2}, ZeroColumnCase{"last", {256, 1, 128}, 2}),
    [](const ::testing::TestParamInfo<ZeroColumnCase>& i) { return std::string(i.param.name); });

// ---- MXFP4 blocks far below the tile's largest exponent -------------------------------------------

// One MXFP4 tensor [m, 128]: every block holds all 15 non-zero E2M1 codes and a zero (cycled), block
// scale codes from `scale_of(row, block)`.
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
      uint8_t& b = q.codes[static_cast<size_t>(r * 64 + c / 2)];
      b = static_cast<uint8_t>(c % 2 ? (b | (nib << 4)) : (b | nib));
    }
    for (int j = 0; j < 4; ++j) q.scales[static_cast<size_t>(r * 4 + j)] = scale_of(r, j);
  }
  return q;
}

TEST(Mxfp4SpreadGap, RowConversionExactToFourteenBinadesCountsBeyond) {
  for (int delta = 0; delta <= 20; ++delta) {
    // block 0 at 2^10, block 2 `delta` binades below, the others in between
    const QTensor fp4 = mxfp4_tensor(8, [&](int64_t, int j) {
      return static_cast<uint8_t>(137 - (j == 2 ? delta : j == 0 ? 0 : delta / 2));
    });
    QTensor row;
    const QuantStats st = cpu::fp4_to_fp8_row(fp4, &row);
    const int64_t changed = count_changed(decoded(fp4), decoded(row));
    EXPECT_EQ(st.nonfinite, 0) << "delta " << delta;
    EXPECT_EQ(st.underflow, changed) << "delta " << delta;
    if (delta <= 14) EXPECT_EQ(changed, 0) << "delta " << delta << ": must be exact";
    else EXPECT_GT(changed, 0) << "delta " << delta << ": 0.5 * 2^(6 - delta) is below 2^-9";
    EXPECT_EQ(row.scales[0], 137 - 6) << "delta " << delta << ": the tile scale is 2^(max e - 6)";
  }
}

TEST(Mxfp4SpreadGap, ColumnConversionExactToFourteenBinadesCountsBeyond) {
  const Segments seg = Segments::from_counts({128, 70, 0, 58});
  for (int delta = 0; delta <= 20; ++delta) {
    // within every 128-token block, one token per 16 at 2^10 and the rest `delta` binades lower
    const QTensor fp4 = mxfp4_tensor(seg.num_tokens(), [&](int64_t r, int) {
      return static_cast<uint8_t>(r % 16 == 3 ? 137 : 137 - delta);
    });
    for (TransposeExponent mode : {TransposeExponent::kRowMax, TransposeExponent::kColumnAmax}) {
      QTensor col;
      const QuantStats st = cpu::fp4_to_fp8_col(fp4, seg, &col, mode);
      const int64_t changed = count_changed(decoded(fp4), decoded(col));
      const char* name = mode == TransposeExponent::kRowMax ? "row-max" : "column-amax";
      EXPECT_EQ(st.underflow, changed) << name << " delta " << delta;
      if (delta <= 14) EXPECT_EQ(changed, 0) << name << " delta " << delta << ": must be exact";
      else if (mode == TransposeExponent::kRowMax) EXPECT_GT(changed, 0) << name << " delta " << delta;
    }
  }
}

}  // namespace
}  // namespace flowmoe
