// The scaling-aware transpose with the column's own amax as target exponent (kColumnAmax):
// one FP8 pass that equals the naive dequantize -> transpose -> quantize path bit for bit.
#include <gtest/gtest.h>

#include <cmath>
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

}  // namespace
}  // namespace flowmoe
