// Output arguments: null or aliased outputs are rejected; NaN codes under finite scales are counted.
#include <gtest/gtest.h>

#include <string>
#include <vector>

#include "flowmoe/cpu/convert.h"
#include "flowmoe/error.h"
#include "flowmoe/numerics.h"

namespace flowmoe {
namespace {

std::vector<float> ramp(int64_t n) {
  std::vector<float> x(n);
  for (int64_t i = 0; i < n; ++i) x[i] = static_cast<float>((i * 37) % 101) - 50.0f;
  return x;
}

template <typename F>
void expect_error(F&& f, const std::string& needle) {
  try {
    f();
    FAIL() << "expected an error mentioning '" << needle << "'";
  } catch (const Error& e) {
    EXPECT_NE(std::string(e.what()).find(needle), std::string::npos) << e.what();
  }
}

TEST(OutputArgs, NullAndAliasedOutputsAreRejected) {
  const auto x = ramp(256 * 128);
  QTensor row, w;
  cpu::quantize_row(x.data(), 256, 128, &row);
  expect_error([&] { cpu::quantize_row(x.data(), 256, 128, nullptr); }, "null");
  expect_error([&] { cpu::scaling_aware_transpose(row, Segments::whole(256), &row); }, "also an input");
  expect_error([&] { cpu::naive_col_copy(row, Segments::whole(256), &row); }, "also an input");
  cpu::quantize_weight(x.data(), 256, 128, &w, nullptr);
  expect_error([&] { cpu::transpose_weight(w, &w); }, "also an input");
  expect_error([&] { cpu::quantize_weight(x.data(), 256, 128, &w, &w); }, "share one QTensor");
  QTensor f4;
  cpu::quantize_mxfp4(x.data(), 256, 128, &f4);
  expect_error([&] { cpu::fp4_to_fp8_row(f4, &f4); }, "also an input");
  expect_error([&] { cpu::fp4_to_fp8_col(f4, Segments::whole(256), &f4); }, "also an input");
}

TEST(OutputArgs, TransposeCountsNaNCodesUnderFiniteScales) {
  const auto x = ramp(256 * 128);
  QTensor row, col;
  cpu::quantize_row(x.data(), 256, 128, &row);
  row.codes[7] = 0x7F;
  row.codes[300] = 0xFF;
  const QuantStats st = cpu::scaling_aware_transpose(row, Segments::whole(256), &col);
  EXPECT_EQ(st.nonfinite, 2);
  std::vector<float> y(256 * 128);
  cpu::dequantize(col, y.data());
  EXPECT_TRUE(y[7] != y[7]) << "a NaN code stays NaN";
  EXPECT_TRUE(y[300] != y[300]);
}

}  // namespace
}  // namespace flowmoe
