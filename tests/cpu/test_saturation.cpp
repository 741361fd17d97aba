// Decoded saturation (docs/NUMERICS.md, issue 20): finite input never quantizes to codes that
// decode to +-Inf, in every layout, for float32 and BF16 input at the top of the binary32 range;
// below the thresholds nothing changes. Also the `flushed` and `overflow` counters (docs/NPY_FILES.md).
#include <gtest/gtest.h>

#include <cfloat>
#include <cmath>
#include <random>
#include <vector>

#include "common/convert_checks.h"
#include "common/reference.h"
#include "flowmoe/cpu/convert.h"
#include "flowmoe/numerics.h"

namespace {

using namespace flowmoe;
using namespace flowmoe_test;

double e4m3_decoded(uint32_t c, int e) { return e4m3_value(static_cast<uint8_t>(c)) * std::ldexp(1.0, e); }
double e2m1_decoded(uint32_t c, int e) { return e2m1_value(static_cast<uint8_t>(c)) * std::ldexp(1.0, e); }

TEST(DecodedSaturation, LimitIsTheLargestCodeThatDecodesFinite) {
  for (int e = num::kScaleExpMin; e <= num::kScaleExpMax; ++e) {
    const uint32_t l4 = num::e4m3_max_code_for_scale(e), l2 = num::e2m1_max_code_for_scale(e);
    ASSERT_LE(l4, 0x7Eu);
    ASSERT_LE(l2, 0x7u);
    EXPECT_LE(e4m3_decoded(l4, e), FLT_MAX) << "e4m3, scale 2^" << e;
    if (l4 < 0x7E) EXPECT_GT(e4m3_decoded(l4 + 1, e), FLT_MAX) << "e4m3, scale 2^" << e;
    EXPECT_LE(e2m1_decoded(l2, e), FLT_MAX) << "e2m1, scale 2^" << e;
    if (l2 < 0x7) EXPECT_GT(e2m1_decoded(l2 + 1, e), FLT_MAX) << "e2m1, scale 2^" << e;
    // the thresholds: below them every code decodes finite
    EXPECT_EQ(l4 == 0x7E, e < num::kE4M3SaturateScaleExp) << e;
    EXPECT_EQ(l2 == 0x7, e < num::kE2M1SaturateScaleExp) << e;
  }
}

TEST(DecodedSaturation, ChangesExactlyTheCodesThatWouldDecodeToInf) {
  for (int e = num::kScaleExpMin; e <= num::kScaleExpMax; ++e) {
    for (unsigned c = 0; c < 256; ++c) {
      const uint8_t q = static_cast<uint8_t>(c), s = num::e4m3_saturate_for_scale(q, e);
      if (num::e4m3_is_nan(q)) {
        ASSERT_EQ(s, q) << "NaN codes are kept";
        continue;
      }
      const bool inf = e4m3_decoded(q & 0x7F, e) > FLT_MAX;
      ASSERT_EQ(s != q, inf) << "code " << c << " scale 2^" << e;
      if (inf) ASSERT_EQ(s, (q & 0x80) | num::e4m3_max_code_for_scale(e));
      ASSERT_TRUE(std::isfinite(num::dequant_e4m3(s, num::ue8m0_from_exp(e)))) << c << " 2^" << e;
    }
    for (unsigned c = 0; c < 16; ++c) {
      const uint8_t n = static_cast<uint8_t>(c), s = num::e2m1_saturate_for_scale(n, e);
      const bool inf = e2m1_decoded(n & 7, e) > FLT_MAX;
      ASSERT_EQ(s != n, inf) << "nibble " << c << " scale 2^" << e;
      if (inf) ASSERT_EQ(s, (n & 8) | num::e2m1_max_code_for_scale(e));
      ASSERT_TRUE(std::isfinite(num::dequant_e2m1(s, num::ue8m0_from_exp(e)))) << c << " 2^" << e;
    }
  }
}

// Float32 data at the top of the range: random magnitudes in [2^126, FLT_MAX] with random signs,
// every float32 around the E4M3 and MXFP4 thresholds, and FLT_MAX itself.
std::vector<float> top_of_range(int64_t n, uint32_t seed) {
  std::mt19937 rng(seed);
  std::vector<float> x(n);
  const float edges[] = {FLT_MAX,
                         std::ldexp(1.9375f, 127),
                         std::nextafter(std::ldexp(1.9375f, 127), 0.0f),
                         std::ldexp(1.875f, 127),
                         std::ldexp(1.75f, 127),
                         std::nextafter(std::ldexp(1.75f, 127), 0.0f),
                         std::nextafter(std::ldexp(1.75f, 127), INFINITY),
                         std::ldexp(1.5f, 127),
                         std::ldexp(1.0f, 127),
                         0.0f,
                         1.0f};
  for (int64_t i = 0; i < n; ++i) {
    float v;
    if (i % 7 == 0) {
      v = edges[(i / 7) % (sizeof(edges) / sizeof(edges[0]))];
    } else {
      const uint32_t bits = 0x7E800000u + (rng() % (0x7F7FFFFFu - 0x7E800000u + 1));  // [2^126, FLT_MAX]
      std::memcpy(&v, &bits, 4);
    }
    x[i] = (rng() & 1) ? -v : v;
  }
  return x;
}

std::vector<bf16_t> to_bf16_top(const std::vector<float>& x) {
  std::vector<bf16_t> b(x.size());
  for (size_t i = 0; i < x.size(); ++i) {
    bf16_t h = num::f32_to_bf16(x[i]);
    if ((h & 0x7FFFu) == 0x7F80u) h = static_cast<bf16_t>((h & 0x8000u) | 0x7F7Fu);  // keep it finite
    b[i] = h;
  }
  return b;
}

std::vector<float> widen(const std::vector<bf16_t>& b) {
  std::vector<float> f(b.size());
  for (size_t i = 0; i < b.size(); ++i) f[i] = num::bf16_to_f32(b[i]);
  return f;
}

// Dequantizes q and checks that every value is finite; returns how many elements would have
// decoded to +-Inf without the saturation (plain RNE codes under the same scale).
void expect_all_finite(const QTensor& q) {
  std::vector<float> y(q.rows * q.cols);
  cpu::dequantize(q, y.data());
  int64_t inf = 0;
  for (float v : y) inf += !std::isfinite(v);
  EXPECT_EQ(inf, 0) << q.describe() << ": finite input decoded to Inf";
}

template <typename T>
void check_every_layout(const std::vector<T>& x, const std::vector<float>& xf, int64_t m, int64_t k) {
  const Segments seg = Segments::from_counts({static_cast<int32_t>(m - 100), 0, 100});
  QTensor row, col, w, wt, fp4, row2, col2;
  EXPECT_EQ(cpu::quantize_row(x.data(), m, k, &row).nonfinite, 0);
  expect_matches_reference_quantization(xf, row, Fmt::kE4M3);
  expect_all_finite(row);
  EXPECT_EQ(cpu::quantize_col(x.data(), m, k, seg, &col).nonfinite, 0);
  expect_matches_reference_quantization(xf, col, Fmt::kE4M3);
  expect_all_finite(col);
  EXPECT_EQ(cpu::quantize_weight(x.data(), m, k, &w, &wt).nonfinite, 0);
  expect_matches_reference_quantization(xf, w, Fmt::kE4M3);
  expect_all_finite(w);
  expect_all_finite(wt);
  EXPECT_EQ(cpu::quantize_mxfp4(x.data(), m, k, &fp4).nonfinite, 0);
  expect_matches_reference_quantization(xf, fp4, Fmt::kE2M1);
  expect_all_finite(fp4);
  // The exact conversions keep the (finite) values of their saturated sources.
  QTensor sat, f8r, f8c;
  cpu::scaling_aware_transpose(row, seg, &sat);
  expect_all_finite(sat);
  cpu::fp4_to_fp8_row(fp4, &f8r);
  expect_all_finite(f8r);
  cpu::fp4_to_fp8_col(fp4, seg, &f8c);
  expect_all_finite(f8c);
}

TEST(DecodedSaturation, Float32TopOfRangeEveryLayout) {
  const int64_t m = 256, k = 256;
  const std::vector<float> x = top_of_range(m * k, 20);
  check_every_layout(x, x, m, k);
}

TEST(DecodedSaturation, Bf16TopOfRangeEveryLayout) {
  const int64_t m = 256, k = 256;
  const std::vector<bf16_t> x = to_bf16_top(top_of_range(m * k, 21));
  check_every_layout(x, widen(x), m, k);
}

// Exactly the elements at or above the thresholds change: 248 * 2^120 (E4M3, scale 2^120) and
// 3.5 * 2^126 (MXFP4, scale 2^126); everything else keeps the plain RNE code of x / 2^e.
TEST(DecodedSaturation, OnlyInputsAboveTheThresholdsChange) {
  const int64_t m = 128, k = 128;
  const std::vector<float> x = top_of_range(m * k, 22);
  QTensor row, fp4;
  cpu::quantize_row(x.data(), m, k, &row);
  cpu::quantize_mxfp4(x.data(), m, k, &fp4);
  const double t8 = std::ldexp(1.9375, 127), t4 = std::ldexp(1.75, 127);
  int64_t changed8 = 0, changed4 = 0;
  for (int64_t r = 0; r < m; ++r) {
    for (int64_t c = 0; c < k; ++c) {
      const float v = x[r * k + c];
      const int e8 = row.scales[(c / 128) * m + r] - 127;
      const uint8_t q8 = row.codes[r * k + c], plain8 = num::quant_e4m3(v, e8);
      EXPECT_EQ(q8 != plain8, std::fabs(static_cast<double>(v)) >= t8) << v;
      changed8 += q8 != plain8;
      const int e4 = fp4.scales[r * (k / 32) + c / 32] - 127;
      const uint8_t q4 = num::e2m1_get(fp4.codes.data(), r * k + c), plain4 = num::quant_e2m1(v, e4);
      EXPECT_EQ(q4 != plain4, std::fabs(static_cast<double>(v)) >= t4) << v;
      changed4 += q4 != plain4;
    }
  }
  EXPECT_GT(changed8, 0);
  EXPECT_GT(changed4, 0);
}

// `flushed`: non-zero finite inputs whose code is zero, in every quantizer.
TEST(Counters, QuantizeCountsFlushedElements) {
  const int64_t m = 128, k = 128;
  std::vector<float> x(m * k, 0.0f);
  for (int64_t r = 0; r < m; ++r) {
    x[r * k] = 448.0f;          // the tile's maximum: scale 2^0
    x[r * k + 1] = 1e-4f;       // below 2^-10: flushes to zero in E4M3 (and in E2M1)
    x[r * k + 2] = -1e-4f;      // negative: flushes to -0
    x[r * k + 3] = 0.01f;       // an E4M3 subnormal, not flushed; zero in E2M1 under scale 2^7
  }
  QTensor q, col, w, fp4;
  EXPECT_EQ(cpu::quantize_row(x.data(), m, k, &q).flushed, 2 * m);
  EXPECT_EQ(cpu::quantize_col(x.data(), m, k, Segments::whole(m), &col).flushed, 0)  // column max is the value itself
      << "a column tile holding one value never flushes it";
  EXPECT_EQ(cpu::quantize_weight(x.data(), m, k, &w, nullptr).flushed, 2 * m);
  EXPECT_EQ(cpu::quantize_mxfp4(x.data(), m, k, &fp4).flushed, 3 * m);
}

// `overflow`: the naive path's BF16 intermediate turning finite codes into Inf.
TEST(Counters, NaiveColCopyCountsBf16Overflow) {
  const int64_t m = 4, k = 128;
  QTensor row;
  row.layout = Layout::kRow1x128;
  row.rows = m;
  row.cols = k;
  row.codes.assign(m * k, 0x38);  // 1.0
  row.scales.assign(m, 127);      // 2^0
  row.codes[0] = 0x7E;            // 448
  row.scales[0] = 254;            // 448 * 2^127: beyond every format's range
  QTensor col;
  const QuantStats st = cpu::naive_col_copy(row, Segments::whole(m), &col);
  EXPECT_EQ(st.overflow, 1);
  EXPECT_EQ(st.nonfinite, 1) << "the overflowed element is non-finite in the path";
}

}  // namespace
