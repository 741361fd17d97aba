// FP8 with FP32 scales, the fp8-naive scaling mode of the CPU convert module (cpu/convert.h,
// QTensorF32): every tile's scale is amax / 448 in FP32 (1 for an all-zero tile, NaN for a tile
// holding a non-finite value, whose codes are then 0x7F), every code RNE_E4M3(x / s); checked
// element by element against that definition (the arithmetic the CPU MoE layer used before it moved
// here), on row-wise, column-wise (ragged segments, empty ones) and weight layouts, plus the exact
// weight transpose, dequantize, the DQ->T->Q column copy and the argument errors.
#include <gtest/gtest.h>

#include <cmath>
#include <cstdint>
#include <vector>

#include "common/reference.h"
#include "flowmoe/cpu/convert.h"
#include "flowmoe/error.h"
#include "flowmoe/numerics.h"

namespace flowmoe {
namespace {

namespace num = flowmoe::num;

std::vector<bf16_t> random_bf16(int64_t n, uint64_t seed) {
  flowmoe_test::Rng rng(seed);
  std::vector<bf16_t> v(n);
  for (int64_t i = 0; i < n; ++i) {
    // magnitudes over many binades so that the scales are not powers of two
    const double mag = std::exp2(rng.uniform(-20.0, 12.0));
    v[i] = num::f32_to_bf16(static_cast<float>(rng.normal() * mag));
  }
  return v;
}

// The definition: scale of the values v[idx[i]], codes in idx order.
struct Tile {
  float scale;
  std::vector<uint8_t> codes;
  int64_t nonfinite = 0;
};
Tile reference_tile(const std::vector<bf16_t>& x, const std::vector<int64_t>& idx) {
  Tile t;
  float amax = 0.0f;
  for (int64_t i : idx) {
    const float v = num::bf16_to_f32(x[i]);
    if (!std::isfinite(v))
      ++t.nonfinite;
    else
      amax = std::max(amax, std::fabs(v));
  }
  if (t.nonfinite) {
    t.scale = std::nanf("");
    t.codes.assign(idx.size(), 0x7F);
    return t;
  }
  t.scale = amax > 0.0f ? amax / 448.0f : 1.0f;
  for (int64_t i : idx) t.codes.push_back(num::f32_to_e4m3(num::bf16_to_f32(x[i]) / t.scale));
  return t;
}

bool same_scale(float a, float b) { return (std::isnan(a) && std::isnan(b)) || a == b; }

TEST(Fp32ScaleQuantize, RowTilesFollowTheDefinition) {
  const int64_t m = 37, k = 384;
  std::vector<bf16_t> x = random_bf16(m * k, 1);
  for (int64_t c = 128; c < 256; ++c) x[5 * k + c] = 0;        // an all-zero tile: scale 1
  x[9 * k + 300] = num::f32_to_bf16(INFINITY);                   // a non-finite tile
  x[9 * k + 301] = num::f32_to_bf16(std::nanf(""));
  cpu::QTensorF32 q;
  const QuantStats st = cpu::quantize_row_fp32_scale(x.data(), m, k, &q);
  EXPECT_EQ(q.layout, Layout::kRow1x128);
  EXPECT_EQ(st.nonfinite, 2);
  ASSERT_EQ(q.codes.size(), size_t(m * k));
  ASSERT_EQ(q.scales.size(), size_t(m * k / 128));
  EXPECT_EQ(q.bytes(), m * k + 4 * m * k / 128);
  for (int64_t t = 0; t < m; ++t)
    for (int64_t b = 0; b < k / 128; ++b) {
      std::vector<int64_t> idx;
      for (int64_t i = 0; i < 128; ++i) idx.push_back(t * k + b * 128 + i);
      const Tile want = reference_tile(x, idx);
      ASSERT_TRUE(same_scale(q.scales[b * m + t], want.scale)) << "token " << t << " tile " << b;
      for (int64_t i = 0; i < 128; ++i) ASSERT_EQ(q.codes[idx[i]], want.codes[i]);
    }
  EXPECT_EQ(q.scales[1 * m + 5], 1.0f);
  EXPECT_TRUE(std::isnan(q.scales[2 * m + 9]));
}

TEST(Fp32ScaleQuantize, ColumnBlocksFollowTheSegments) {
  const int64_t k = 256;
  const Segments seg = Segments::from_counts({130, 0, 7, 256});
  const int64_t m = seg.num_tokens();
  const std::vector<bf16_t> x = random_bf16(m * k, 2);
  cpu::QTensorF32 q;
  const QuantStats st = cpu::quantize_col_fp32_scale(x.data(), m, k, seg, &q);
  EXPECT_EQ(st.nonfinite, 0);
  EXPECT_EQ(q.layout, Layout::kCol128x1);
  ASSERT_EQ(q.scales.size(), size_t(seg.num_blocks() * k));
  int64_t blk = 0;
  for (int e = 0; e < seg.num_segments(); ++e)
    for (int64_t t0 = seg.offsets[e]; t0 < seg.offsets[e + 1]; t0 += 128, ++blk) {
      const int64_t t1 = std::min<int64_t>(t0 + 128, seg.offsets[e + 1]);
      for (int64_t c = 0; c < k; ++c) {
        std::vector<int64_t> idx;
        for (int64_t t = t0; t < t1; ++t) idx.push_back(t * k + c);
        const Tile want = reference_tile(x, idx);
        ASSERT_TRUE(same_scale(q.scales[blk * k + c], want.scale));
        for (int64_t t = t0; t < t1; ++t) ASSERT_EQ(q.codes[c * m + t], want.codes[t - t0]);
      }
    }
  EXPECT_EQ(blk, seg.num_blocks());
}

TEST(Fp32ScaleQuantize, WeightBlocksAndTheirExactTranspose) {
  const int64_t n = 256, k = 384;
  const std::vector<bf16_t> w = random_bf16(n * k, 3);
  cpu::QTensorF32 q, qt;
  cpu::quantize_weight_fp32_scale(w.data(), n, k, &q, &qt);
  EXPECT_EQ(q.layout, Layout::kWeight128x128);
  EXPECT_EQ(qt.rows, k);
  EXPECT_EQ(qt.cols, n);
  for (int64_t bi = 0; bi < n / 128; ++bi)
    for (int64_t bj = 0; bj < k / 128; ++bj) {
      std::vector<int64_t> idx;  // row-major within the block, as the tile is read
      for (int64_t i = 0; i < 128; ++i)
        for (int64_t j = 0; j < 128; ++j) idx.push_back((bi * 128 + i) * k + bj * 128 + j);
      const Tile want = reference_tile(w, idx);
      ASSERT_EQ(q.scales[bi * (k / 128) + bj], want.scale);
      for (size_t i = 0; i < idx.size(); ++i) ASSERT_EQ(q.codes[idx[i]], want.codes[i]);
      EXPECT_EQ(qt.scales[bj * (n / 128) + bi], want.scale);
    }
  for (int64_t i = 0; i < n; ++i)
    for (int64_t j = 0; j < k; ++j) ASSERT_EQ(qt.codes[j * n + i], q.codes[i * k + j]);
  cpu::QTensorF32 alone;  // the transpose is optional
  cpu::quantize_weight_fp32_scale(w.data(), n, k, &alone, nullptr);
  EXPECT_EQ(alone.codes, q.codes);
}

TEST(Fp32ScaleDequantize, CodeTimesScaleNanWhereEitherIsNan) {
  EXPECT_EQ(cpu::dequantize_fp32_scale(0x38, 0.5f), num::e4m3_to_f32(0x38) * 0.5f);
  EXPECT_TRUE(std::isnan(cpu::dequantize_fp32_scale(0x7F, 1.0f)));
  EXPECT_TRUE(std::isnan(cpu::dequantize_fp32_scale(0x10, std::nanf(""))));
  const int64_t m = 20, k = 256;
  std::vector<bf16_t> x = random_bf16(m * k, 4);
  x[3 * k + 7] = num::f32_to_bf16(std::nanf(""));
  cpu::QTensorF32 q;
  cpu::quantize_row_fp32_scale(x.data(), m, k, &q);
  std::vector<float> d(m * k);
  std::vector<bf16_t> db(m * k);
  cpu::dequantize(q, d.data());
  cpu::dequantize(q, db.data());
  for (int64_t t = 0; t < m; ++t)
    for (int64_t c = 0; c < k; ++c) {
      const float want = cpu::dequantize_fp32_scale(q.codes[t * k + c], q.scales[(c / 128) * m + t]);
      const float got = d[t * k + c];
      ASSERT_TRUE((std::isnan(want) && std::isnan(got)) || want == got);
      ASSERT_EQ(db[t * k + c], std::isnan(want) ? bf16_t(0x7FC0) : num::f32_to_bf16(want));
    }
  EXPECT_TRUE(std::isnan(d[3 * k + 100]));  // the whole tile of the NaN decodes to NaN
}

TEST(Fp32ScaleNaiveColCopy, IsDequantizeTransposeQuantizeAndRoundsTwice) {
  const int64_t k = 256;
  const Segments seg = Segments::from_counts({100, 60, 0, 140});
  const int64_t m = seg.num_tokens();
  const std::vector<bf16_t> x = random_bf16(m * k, 5);
  cpu::QTensorF32 row, col, want;
  cpu::quantize_row_fp32_scale(x.data(), m, k, &row);
  cpu::naive_col_copy(row, seg, &col);
  std::vector<bf16_t> d(m * k);
  cpu::dequantize(row, d.data());
  cpu::quantize_col_fp32_scale(d.data(), m, k, seg, &want);
  EXPECT_EQ(col.codes, want.codes);
  ASSERT_EQ(col.scales.size(), want.scales.size());
  for (size_t i = 0; i < col.scales.size(); ++i) ASSERT_EQ(col.scales[i], want.scales[i]);
  // FP32 scales are not powers of two: the second quantization moves some values
  std::vector<float> a(m * k), b(m * k);
  cpu::dequantize(row, a.data());
  cpu::dequantize(col, b.data());
  int64_t differ = 0;
  for (int64_t i = 0; i < m * k; ++i) differ += a[i] != b[i];
  EXPECT_GT(differ, 0);
}

TEST(Fp32ScaleErrors, ShapesLayoutsAndOutputs) {
  const std::vector<bf16_t> x(4 * 256, 0);
  cpu::QTensorF32 q;
  EXPECT_THROW(cpu::quantize_row_fp32_scale(x.data(), 4, 200, &q), Error);  // K % 128
  EXPECT_THROW(cpu::quantize_row_fp32_scale(nullptr, 4, 256, &q), Error);
  EXPECT_THROW(cpu::quantize_row_fp32_scale(x.data(), 4, 256, nullptr), Error);
  EXPECT_THROW(cpu::quantize_col_fp32_scale(x.data(), 4, 256, Segments::from_counts({3}), &q),
               Error);  // segments do not cover M
  EXPECT_THROW(cpu::quantize_weight_fp32_scale(x.data(), 4, 256, &q, nullptr), Error);  // N % 128
  cpu::QTensorF32 w;
  std::vector<bf16_t> wb(128 * 128, 0);
  cpu::quantize_weight_fp32_scale(wb.data(), 128, 128, &w, nullptr);
  std::vector<float> out(128 * 128);
  EXPECT_THROW(cpu::dequantize(w, out.data()), Error);  // weights are not decoded here
  cpu::QTensorF32 col;
  EXPECT_THROW(cpu::naive_col_copy(w, Segments::whole(128), &col), Error);  // needs row-wise
  cpu::quantize_row_fp32_scale(x.data(), 4, 256, &q);
  EXPECT_THROW(cpu::naive_col_copy(q, Segments::whole(4), &q), Error);  // output is the input
}

}  // namespace
}  // namespace flowmoe
