// Bad input is rejected with flowmoe::Error whose message names the problem (and what was
// expected). One table of cases, one parametrised test.
#include <gtest/gtest.h>

#include <functional>
#include <string>
#include <vector>

#include "flowmoe/cpu/convert.h"
#include "flowmoe/error.h"
#include "flowmoe/tensor.h"

using flowmoe::Layout;
using flowmoe::QTensor;
using flowmoe::Segments;
namespace cpu = flowmoe::cpu;

namespace {

// Runs f; succeeds when it throws flowmoe::Error and what() contains every needle.
::testing::AssertionResult ThrowsErrorMentioning(const std::function<void()>& f,
                                                 const std::vector<std::string>& needles) {
  try {
    f();
  } catch (const flowmoe::Error& e) {
    const std::string msg = e.what();
    for (const std::string& n : needles) {
      if (msg.find(n) == std::string::npos) {
        return ::testing::AssertionFailure() << "message does not mention \"" << n << "\": " << msg;
      }
    }
    return ::testing::AssertionSuccess() << msg;
  } catch (const std::exception& e) {
    return ::testing::AssertionFailure() << "threw a non-flowmoe exception: " << e.what();
  } catch (...) {
    return ::testing::AssertionFailure() << "threw something that is not a std::exception";
  }
  return ::testing::AssertionFailure() << "did not throw";
}

// Input large enough for every shape used below (checks run before any element is read).
const std::vector<float>& data() {
  static const std::vector<float> d(1 << 16, 0.5f);
  return d;
}
const std::vector<uint16_t>& data_bf16() {
  static const std::vector<uint16_t> d(1 << 16, 0x3F00);
  return d;
}

// Small valid tensors to break in various ways.
QTensor row_tensor(int64_t m = 4, int64_t k = 256) {
  QTensor q;
  cpu::quantize_row(data().data(), m, k, &q);
  return q;
}
QTensor col_tensor(int64_t m = 4, int64_t k = 256) {
  QTensor q;
  cpu::quantize_col(data().data(), m, k, Segments::whole(m), &q);
  return q;
}
QTensor fp4_tensor(int64_t m = 4, int64_t k = 256) {
  QTensor q;
  cpu::quantize_mxfp4(data().data(), m, k, &q);
  return q;
}
QTensor weight_tensor() {
  static const std::vector<float> w(128 * 256, 0.25f);
  QTensor q;
  cpu::quantize_weight(w.data(), 128, 256, &q, nullptr);
  return q;
}
Segments offsets(std::vector<int32_t> o) { return Segments{std::move(o)}; }

struct ErrorCase {
  const char* name;
  std::function<void()> call;
  std::vector<std::string> mentions;
};
std::ostream& operator<<(std::ostream& os, const ErrorCase& c) { return os << c.name; }

std::vector<ErrorCase> cases() {
  static const float* const X = data().data();
  static const uint16_t* const XB = data_bf16().data();
  return {
      // ---- shapes ----
      {"row_k_not_multiple_of_128", [] { QTensor o; cpu::quantize_row(X, 2, 100, &o); },
       {"quantize_row", "K = 100", "multiple of 128"}},
      {"row_bf16_k_not_multiple_of_128", [] { QTensor o; cpu::quantize_row(XB, 2, 200, &o); },
       {"quantize_row", "K = 200", "multiple of 128"}},
      {"row_k_zero", [] { QTensor o; cpu::quantize_row(X, 2, 0, &o); }, {"quantize_row", "K > 0"}},
      {"row_negative_m", [] { QTensor o; cpu::quantize_row(X, -1, 128, &o); }, {"quantize_row", "-1", "M >= 0"}},
      {"row_null_input", [] { QTensor o; cpu::quantize_row(static_cast<const float*>(nullptr), 3, 128, &o); },
       {"quantize_row", "null"}},
      {"col_negative_m", [] { QTensor o; cpu::quantize_col(X, -5, 128, Segments::whole(0), &o); },
       {"quantize_col", "M >= 0"}},
      {"col_null_input", [] { QTensor o; cpu::quantize_col(static_cast<const uint16_t*>(nullptr), 3, 128, Segments::whole(3), &o); },
       {"quantize_col", "null"}},
      {"mxfp4_k_not_multiple_of_32", [] { QTensor o; cpu::quantize_mxfp4(X, 2, 48, &o); },
       {"quantize_mxfp4", "K = 48", "multiple of 32"}},
      {"mxfp4_null_input", [] { QTensor o; cpu::quantize_mxfp4(static_cast<const float*>(nullptr), 1, 32, &o); },
       {"quantize_mxfp4", "null"}},
      {"weight_n_not_multiple_of_128", [] { QTensor o; cpu::quantize_weight(X, 100, 128, &o, nullptr); },
       {"quantize_weight", "N = 100", "multiple of 128"}},
      {"weight_k_not_multiple_of_128", [] { QTensor o; cpu::quantize_weight(X, 128, 130, &o, nullptr); },
       {"quantize_weight", "K = 130", "multiple of 128"}},
      {"weight_null_input", [] { QTensor o; cpu::quantize_weight(static_cast<const uint16_t*>(nullptr), 128, 128, &o, nullptr); },
       {"quantize_weight", "null"}},
      {"fp4_to_fp8_row_k_not_multiple_of_128", [] { QTensor o; cpu::fp4_to_fp8_row(fp4_tensor(2, 96), &o); },
       {"fp4_to_fp8_row", "K = 96", "multiple of 128"}},
      {"dequantize_null_output", [] { cpu::dequantize(row_tensor(), static_cast<float*>(nullptr)); },
       {"dequantize", "null"}},

      // ---- segments ----
      {"segments_not_starting_at_zero", [] { QTensor o; cpu::quantize_col(X, 4, 128, offsets({1, 4}), &o); },
       {"start at 0", "1"}},
      {"segments_decreasing", [] { QTensor o; cpu::quantize_col(X, 8, 128, offsets({0, 5, 3, 8}), &o); },
       {"non-decreasing", "offsets[2] = 3"}},
      {"segments_not_ending_at_m", [] { QTensor o; cpu::quantize_col(X, 8, 128, offsets({0, 5}), &o); },
       {"end at the token count", "M = 8", "5"}},
      {"segments_empty_offsets", [] { QTensor o; cpu::quantize_col(X, 4, 128, offsets({}), &o); },
       {"at least one segment", "0 offsets"}},
      {"segments_single_offset", [] { QTensor o; cpu::quantize_col(X, 0, 128, offsets({0}), &o); },
       {"at least one segment", "1 offsets"}},
      {"segments_wrong_m_in_transpose", [] { QTensor o; cpu::scaling_aware_transpose(row_tensor(4), Segments::whole(5), &o); },
       {"end at the token count", "M = 4"}},
      {"segments_wrong_m_in_fp4_to_fp8_col", [] { QTensor o; cpu::fp4_to_fp8_col(fp4_tensor(4), offsets({0, 2, 3}), &o); },
       {"end at the token count", "M = 4"}},
      {"segments_negative_count", [] { Segments::from_counts({3, -1}); }, {"negative", "-1"}},
      {"segments_whole_negative", [] { Segments::whole(-2); }, {"-2", "out of range"}},
      {"dequantize_col_with_broken_segments", [] {
         QTensor q = col_tensor(4);
         q.segments = offsets({0, 5, 4});  // still one block in all, so the size checks pass
         std::vector<float> v(4 * 256);
         cpu::dequantize(q, v.data());
       },
       {"non-decreasing"}},

      // ---- layouts ----
      {"transpose_given_column_wise", [] { QTensor o; cpu::scaling_aware_transpose(col_tensor(), Segments::whole(4), &o); },
       {"scaling_aware_transpose", "column-wise 128x1", "expected row-wise 1x128 e4m3"}},
      {"transpose_given_mxfp4", [] { QTensor o; cpu::scaling_aware_transpose(fp4_tensor(), Segments::whole(4), &o); },
       {"scaling_aware_transpose", "mxfp4", "expected row-wise 1x128 e4m3"}},
      {"naive_col_copy_given_weight", [] { QTensor o; cpu::naive_col_copy(weight_tensor(), Segments::whole(128), &o); },
       {"naive_col_copy", "weight 128x128", "expected row-wise 1x128 e4m3"}},
      {"fp4_to_fp8_row_given_fp8_row", [] { QTensor o; cpu::fp4_to_fp8_row(row_tensor(), &o); },
       {"fp4_to_fp8_row", "expected row-wise 1x32 mxfp4"}},
      {"fp4_to_fp8_col_given_fp8_col", [] { QTensor o; cpu::fp4_to_fp8_col(col_tensor(), Segments::whole(4), &o); },
       {"fp4_to_fp8_col", "column-wise 128x1", "expected row-wise 1x32 mxfp4"}},
      {"fp4_to_fp8_col_stepwise_given_fp8_row", [] { QTensor o; cpu::fp4_to_fp8_col_stepwise(row_tensor(), Segments::whole(4), &o); },
       {"fp4_to_fp8_col_stepwise", "expected row-wise 1x32 mxfp4"}},
      {"transpose_weight_given_row", [] { QTensor o; cpu::transpose_weight(row_tensor(), &o); },
       {"transpose_weight", "expected weight 128x128"}},

      // ---- inconsistent QTensor ----
      {"row_tensor_too_few_code_bytes", [] {
         QTensor q = row_tensor();
         q.codes.pop_back();
         QTensor o;
         cpu::scaling_aware_transpose(q, Segments::whole(4), &o);
       },
       {"scaling_aware_transpose", "1023 code bytes", "expected 1024"}},
      {"row_tensor_too_many_scale_bytes", [] {
         QTensor q = row_tensor();
         q.scales.push_back(0);
         std::vector<float> v(4 * 256);
         cpu::dequantize(q, v.data());
       },
       {"dequantize", "9 scale bytes", "expected 2 x 4"}},
      {"mxfp4_tensor_wrong_code_bytes", [] {
         QTensor q = fp4_tensor();
         q.codes.resize(4 * 256);  // one byte per element instead of packed pairs
         QTensor o;
         cpu::fp4_to_fp8_row(q, &o);
       },
       {"fp4_to_fp8_row", "1024 code bytes", "expected 512"}},
      {"mxfp4_tensor_wrong_scale_bytes", [] {
         QTensor q = fp4_tensor();
         q.scales.resize(4);
         QTensor o;
         cpu::fp4_to_fp8_col(q, Segments::whole(4), &o);
       },
       {"fp4_to_fp8_col", "4 scale bytes", "expected 4 x 8"}},
      {"col_tensor_scales_for_other_segments", [] {
         QTensor q = col_tensor(4);
         q.segments = offsets({0, 1, 2, 3, 4});  // four blocks now: the scale grid no longer fits
         std::vector<float> v(4 * 256);
         cpu::dequantize(q, v.data());
       },
       {"dequantize", "scale bytes", "expected 4 x 256"}},
      // hand-built tensors whose byte counts match their (impossible) shapes: the shape itself
      // must be rejected, or the scale lookups read past the end of the scale grid
      {"row_tensor_k_not_multiple_of_128", [] {
         QTensor q;
         q.layout = Layout::kRow1x128;
         q.rows = 2;
         q.cols = 200;
         q.codes.assign(400, 0x38);
         q.scales.assign(2, 127);  // (200 / 128) x 2
         std::vector<float> v(400);
         cpu::dequantize(q, v.data());
       },
       {"dequantize", "K = 200", "multiple of 128"}},
      {"weight_tensor_n_not_multiple_of_128", [] {
         QTensor q;
         q.layout = Layout::kWeight128x128;
         q.rows = 200;
         q.cols = 128;
         q.codes.assign(200 * 128, 0x38);
         q.scales.assign(1, 127);  // (200 / 128) x (128 / 128)
         QTensor o;
         cpu::transpose_weight(q, &o);
         std::vector<float> v(200 * 128);
         cpu::dequantize(q, v.data());
       },
       {"N = 200", "multiple of 128"}},
      {"mxfp4_tensor_k_not_multiple_of_32", [] {
         QTensor q;
         q.layout = Layout::kMxfp4Row1x32;
         q.rows = 1;
         q.cols = 48;
         q.codes.assign(24, 0x22);
         q.scales.assign(1, 127);  // 1 x (48 / 32)
         std::vector<float> v(48);
         cpu::dequantize(q, v.data());
       },
       {"dequantize", "K = 48", "multiple of 32"}},
      {"row_tensor_negative_shape", [] {
         QTensor q;
         q.layout = Layout::kRow1x128;
         q.rows = -1;
         q.cols = -128;  // byte counts (-1) x (-128) = 128 and (-1) x (-1) = 1 would "fit"
         q.codes.assign(128, 0);
         q.scales.assign(1, 0);
         QTensor o;
         cpu::scaling_aware_transpose(q, Segments::whole(0), &o);
       },
       {"scaling_aware_transpose", "negative shape"}},
      {"weight_tensor_wrong_code_bytes", [] {
         QTensor q = weight_tensor();
         q.codes.clear();
         QTensor o;
         cpu::transpose_weight(q, &o);
       },
       {"transpose_weight", "0 code bytes"}},
  };
}

class BadInput : public ::testing::TestWithParam<ErrorCase> {};

TEST_P(BadInput, ThrowsFlowmoeErrorNamingTheProblem) {
  const ErrorCase& c = GetParam();
  const ::testing::AssertionResult r = ThrowsErrorMentioning(c.call, c.mentions);
  EXPECT_TRUE(r);
  if (r) RecordProperty("message", r.message());
}

INSTANTIATE_TEST_SUITE_P(Cases, BadInput, ::testing::ValuesIn(cases()),
                         [](const ::testing::TestParamInfo<ErrorCase>& i) { return std::string(i.param.name); });

}  // namespace

TEST(ErrorTypes, NonFiniteErrorIsAnError) {
  flowmoe::QuantStats st;
  st.nonfinite = 3;
  EXPECT_TRUE(ThrowsErrorMentioning([&] { flowmoe::throw_if_nonfinite(st, "dY"); }, {"dY", "3 non-finite", "0xFF"}));
  EXPECT_THROW(flowmoe::throw_if_nonfinite(st, "dY"), flowmoe::NonFiniteError);
}

TEST(ErrorTypes, MessagesCarryFileAndLine) {
  try {
    QTensor o;
    cpu::quantize_row(data().data(), 2, 100, &o);
    FAIL() << "did not throw";
  } catch (const flowmoe::Error& e) {
    const std::string msg = e.what();
    EXPECT_NE(msg.find("convert.cpp:"), std::string::npos) << msg;
  }
}

TEST(ErrorTypes, FailedCallLeavesValidInputUsable) {
  // a rejected call must not have corrupted its (const) input
  const QTensor row = row_tensor();
  QTensor o;
  EXPECT_THROW(cpu::scaling_aware_transpose(row, Segments::whole(5), &o), flowmoe::Error);
  EXPECT_NO_THROW(cpu::scaling_aware_transpose(row, Segments::whole(4), &o));
}
