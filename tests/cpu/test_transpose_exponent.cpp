// The scaling-aware transpose with the column's own amax as target exponent (kColumnAmax):
// one FP8 pass that equals the naive dequantize -> transpose -> quantize path bit for bit.
#include <gtest/gtest.h>

#include <algorithm>
#include <cmath>
#include <cstdio>
#include <random>
#include <string>
#include <vector>

#include "flowmoe/cpu/convert.h"
#include "flowmoe/numerics.h"

namespace flowmoe {
namespace {

std::vector<bf16_t> data(int64_t n, int kind, uint32_t seed) {
  std::mt19937 rng(seed);
  std::normal_distribution<float> nd(0.f, 1.f);
  std::uniform_real_distribution<float> ud(0.f, 1.f);
  std::vector<bf16_t> x(n);
  for (auto& v : x) {
    float f = nd(rng);
    if (kind == 1 && ud(rng) < 0.005f) f *= 100.f + 900.f * ud(rng);                 // outliers
    if (kind == 2) f = (ud(rng) < 0.5f ? -1.f : 1.f) * std::ldexp(1.f + ud(rng), int(ud(rng) * 40) - 30);
    v = num::f32_to_bf16(f);
  }
  return x;
}

int64_t changed(const QTensor& a, const QTensor& b) {
  std::vector<float> da(a.rows * a.cols), db(b.rows * b.cols);
  cpu::dequantize(a, da.data());
  cpu::dequantize(b, db.data());
  int64_t n = 0;
  for (size_t i = 0; i < da.size(); ++i) n += da[i] != db[i];
  return n;
}

class ColumnAmax : public ::testing::TestWithParam<int> {};

TEST_P(ColumnAmax, EqualsNaivePathBitForBitAndUnderflowsLess) {
  const int kind = GetParam();
  const int64_t m = 777, k = 384;
  const auto x = data(m * k, kind, 5 + kind);
  const Segments seg = Segments::from_counts({0, 1, 128, 129, 300, 0, 219});
  QTensor row, tight, rowmax, naive;
  cpu::quantize_row(x.data(), m, k, &row);
  const QuantStats st = cpu::scaling_aware_transpose(row, seg, &tight, cpu::TransposeExponent::kColumnAmax);
  const QuantStats st_rowmax = cpu::scaling_aware_transpose(row, seg, &rowmax);
  cpu::naive_col_copy(row, seg, &naive);
  EXPECT_EQ(tight.scales, naive.scales);
  EXPECT_EQ(tight.codes, naive.codes);
  EXPECT_EQ(changed(tight, row), st.underflow) << "every changed value is a counted underflow";
  EXPECT_EQ(changed(rowmax, row), st_rowmax.underflow);
  EXPECT_LE(st.underflow, st_rowmax.underflow);
  std::printf("[ measure  ] data %d: underflow column-amax %lld vs row-max %lld of %lld values\n", kind,
              static_cast<long long>(st.underflow), static_cast<long long>(st_rowmax.underflow),
              static_cast<long long>(m * k));
  if (kind == 1) EXPECT_LT(st.underflow, st_rowmax.underflow) << "outliers: the tighter exponent must help";
}

INSTANTIATE_TEST_SUITE_P(Data, ColumnAmax, ::testing::Values(0, 1, 2),
                         [](const ::testing::TestParamInfo<int>& i) {
                           return std::string(i.param == 0 ? "normal" : i.param == 1 ? "outliers" : "binades");
                         });

TEST(ColumnAmax, AllZeroBlockGetsTheSmallestScale) {
  std::vector<float> x(256 * 128, 0.0f);
  x[5] = 3.0f;  // token 0 only
  QTensor row, col;
  cpu::quantize_row(x.data(), 256, 128, &row);
  cpu::scaling_aware_transpose(row, Segments::from_counts({128, 128}), &col, cpu::TransposeExponent::kColumnAmax);
  EXPECT_EQ(col.scales[1 * 128 + 0], 0) << "second block, all zero";
  EXPECT_EQ(col.scales[0 * 128 + 6], 0) << "first block, zero column";
  EXPECT_EQ(col.scales[0 * 128 + 5], num::ue8m0_from_exp(num::e4m3_scale_exp(3.0f)));
}

// One token per 128-token block 2^20 times larger than the others (kind 3 of fp4_data).
std::vector<bf16_t> fp4_data(int64_t m, int64_t k, int kind, uint32_t seed) {
  if (kind < 3) return data(m * k, kind, seed);
  std::vector<bf16_t> x = data(m * k, 0, seed);
  for (int64_t t = 5; t < m; t += 128)
    for (int64_t c = 0; c < k; ++c)
      x[t * k + c] = num::f32_to_bf16(num::bf16_to_f32(x[t * k + c]) * 1048576.0f);
  return x;
}

class Fp4ColumnAmax : public ::testing::TestWithParam<int> {};

// FP4RowToFP8Col with the column-amax rule equals the stepwise FP4 -> BF16 -> T -> Q path bit for
// bit, changes exactly the values it counts as underflow, never more than the row-max rule, and
// never picks a larger exponent than it.
TEST_P(Fp4ColumnAmax, EqualsStepwisePathBitForBit) {
  const int kind = GetParam();
  const int64_t m = 777, k = 384;
  const auto x = fp4_data(m, k, kind, 9 + kind);
  const Segments seg = Segments::from_counts({0, 1, 128, 129, 300, 0, 219});
  QTensor fp4, tight, rowmax, stepwise;
  cpu::quantize_mxfp4(x.data(), m, k, &fp4);
  const QuantStats st = cpu::fp4_to_fp8_col(fp4, seg, &tight, cpu::TransposeExponent::kColumnAmax);
  const QuantStats st_rowmax = cpu::fp4_to_fp8_col(fp4, seg, &rowmax, cpu::TransposeExponent::kRowMax);
  cpu::fp4_to_fp8_col_stepwise(fp4, seg, &stepwise);
  EXPECT_EQ(tight.scales, stepwise.scales);
  EXPECT_EQ(tight.codes, stepwise.codes);
  EXPECT_EQ(changed(tight, fp4), st.underflow) << "every changed value is a counted underflow";
  EXPECT_EQ(changed(rowmax, fp4), st_rowmax.underflow);
  EXPECT_LE(st.underflow, st_rowmax.underflow);
  ASSERT_EQ(tight.scales.size(), rowmax.scales.size());
  for (size_t i = 0; i < tight.scales.size(); ++i) ASSERT_LE(tight.scales[i], rowmax.scales[i]) << i;
  std::printf("[ measure  ] FP4 data %d: underflow column-amax %lld vs row-max %lld of %lld values\n", kind,
              static_cast<long long>(st.underflow), static_cast<long long>(st_rowmax.underflow),
              static_cast<long long>(m * k));
  if (kind == 3) EXPECT_LT(st.underflow, st_rowmax.underflow) << "outlier tokens: the tighter rule must help";
}

INSTANTIATE_TEST_SUITE_P(Data, Fp4ColumnAmax, ::testing::Values(0, 1, 2, 3),
                         [](const ::testing::TestParamInfo<int>& i) {
                           return std::string(i.param == 0   ? "normal"
                                              : i.param == 1 ? "outliers"
                                              : i.param == 2 ? "binades"
                                                             : "outlier_token");
                         });

TEST(Fp4ColumnAmax, ZerosKeepTheirSignAndAllZeroBlocksGetTheSmallestScale) {
  std::vector<float> x(256 * 128, 0.0f);
  x[5] = 3.0f;          // token 0 only
  x[128 + 7] = -0.0f;   // token 1, a negative zero
  x[128 + 5] = 1e-30f;  // token 1: tiny against token 0 in column 5 (scale code far below)
  for (int64_t t = 128; t < 256; ++t) x[t * 128 + 9] = -0.0f;
  QTensor fp4, col;
  cpu::quantize_mxfp4(x.data(), 256, 128, &fp4);
  const QuantStats st = cpu::fp4_to_fp8_col(fp4, Segments::from_counts({128, 128}), &col,
                                            cpu::TransposeExponent::kColumnAmax);
  EXPECT_EQ(col.scales[1 * 128 + 9], 0) << "second block, only negative zeros";
  EXPECT_EQ(col.scales[0 * 128 + 6], 0) << "first block, zero column";
  EXPECT_EQ(col.scales[0 * 128 + 5], num::ue8m0_from_exp(num::e4m3_scale_exp(3.0f)));
  EXPECT_EQ(col.codes[9 * 256 + 200], 0x80) << "negative zero keeps its sign";
  EXPECT_EQ(col.codes[7 * 256 + 1], 0x80);
  EXPECT_EQ(col.codes[5 * 256 + 1], 0x00) << "1e-30 under 3's exponent underflows to zero";
  EXPECT_EQ(st.underflow, 1);
}

// The integer keys the kernels use (numerics.h) give the CPU reference's exponent for every pair
// of codes of two tokens whose scale codes differ by up to 20 binades, near both clamps.
TEST(ColumnAmaxKeys, E4M3KeysGiveTheReferenceExponent) {
  const int64_t k = 256 * 256;
  for (int e1 : {0, 1, 9, 127, 240, 254}) {
    for (int d : {-20, -18, -17, -16, -15, -9, -8, -7, -1, 0, 1, 7, 8, 9, 15, 16, 17, 18, 20}) {
      const int e2 = e1 + d;
      if (e2 < 0 || e2 > 254) continue;
      QTensor row;
      row.layout = Layout::kRow1x128;
      row.rows = 2;
      row.cols = k;
      row.codes.resize(2 * k);
      row.scales.resize(2 * (k / 128));
      for (int64_t c = 0; c < k; ++c) {
        row.codes[c] = static_cast<uint8_t>(c >> 8);
        row.codes[k + c] = static_cast<uint8_t>(c & 0xFF);
      }
      for (int64_t b = 0; b < k / 128; ++b) {
        row.scales[b * 2] = static_cast<uint8_t>(e1);
        row.scales[b * 2 + 1] = static_cast<uint8_t>(e2);
      }
      QTensor col;
      cpu::scaling_aware_transpose(row, Segments::whole(2), &col, cpu::TransposeExponent::kColumnAmax);
      for (int64_t c = 0; c < k; ++c) {
        const int key = std::max(num::e4m3_amax_key(row.codes[c], e1), num::e4m3_amax_key(row.codes[k + c], e2));
        ASSERT_EQ(col.scales[c], num::scale_code_from_e4m3_amax_key(key))
            << "codes " << (c >> 8) << ", " << (c & 0xFF) << " under " << e1 << ", " << e2;
      }
    }
  }
}

TEST(ColumnAmaxKeys, E2M1KeysGiveTheReferenceExponent) {
  const int64_t k = 256;  // column c: nibble c >> 4 in token 0, c & 15 in token 1
  for (int e1 = 0; e1 <= 254; ++e1) {
    for (int d = -12; d <= 12; ++d) {
      const int e2 = e1 + d;
      if (e2 < 0 || e2 > 254) continue;
      QTensor fp4;
      fp4.layout = Layout::kMxfp4Row1x32;
      fp4.rows = 2;
      fp4.cols = k;
      fp4.codes.resize(k);
      fp4.scales.resize(2 * (k / 32));
      for (int64_t c = 0; c < k; c += 2) {
        fp4.codes[c / 2] = num::e2m1_pack(static_cast<uint8_t>(c >> 4), static_cast<uint8_t>((c + 1) >> 4));
        fp4.codes[(k + c) / 2] = num::e2m1_pack(static_cast<uint8_t>(c & 15), static_cast<uint8_t>((c + 1) & 15));
      }
      for (int64_t g = 0; g < k / 32; ++g) {
        fp4.scales[g] = static_cast<uint8_t>(e1);
        fp4.scales[k / 32 + g] = static_cast<uint8_t>(e2);
      }
      QTensor col;
      cpu::fp4_to_fp8_col(fp4, Segments::whole(2), &col, cpu::TransposeExponent::kColumnAmax);
      for (int64_t c = 0; c < k; ++c) {
        const int key = std::max(num::e2m1_amax_key(static_cast<uint8_t>(c >> 4), e1),
                                 num::e2m1_amax_key(static_cast<uint8_t>(c & 15), e2));
        ASSERT_EQ(col.scales[c], num::scale_code_from_e2m1_amax_key(key))
            << "nibbles " << (c >> 4) << ", " << (c & 15) << " under " << e1 << ", " << e2;
      }
    }
  }
}

}  // namespace
}  // namespace flowmoe
