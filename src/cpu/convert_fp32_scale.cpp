// CPU reference of FP8 with FP32 scales (amax / 448), the scaling mode of the fp8-naive recipe
// (cpu/convert.h, QTensorF32). Plain loops; the CUDA fp8-naive kernels equal these bit for bit.
#include <algorithm>
#include <cmath>
#include <vector>

#include "flowmoe/cpu/convert.h"
#include "flowmoe/error.h"
#include "flowmoe/numerics.h"

namespace flowmoe {
namespace cpu {
namespace {

constexpr float kNanF = __builtin_nanf("");

float tile_scale(float amax) { return amax > 0.0f ? amax / num::kE4M3Max : 1.0f; }

// Quantizes `n` values v(i) into codes put(i, code) with one FP32 scale; returns the scale.
template <typename Get, typename Put>
float quantize_tile(int64_t n, Get v, Put put, QuantStats* st) {
  float amax = 0.0f;
  int64_t bad = 0;
  for (int64_t i = 0; i < n; ++i) {
    const float x = v(i);
    if (!num::f32_is_finite(x))
      ++bad;
    else
      amax = std::max(amax, std::fabs(x));
  }
  if (bad) {
    st->nonfinite += bad;
    for (int64_t i = 0; i < n; ++i) put(i, num::kE4M3NaN);
    return kNanF;
  }
  const float s = tile_scale(amax);
  for (int64_t i = 0; i < n; ++i) put(i, num::f32_to_e4m3(v(i) / s));
  return s;
}

void check_input(const bf16_t* x, int64_t m, int64_t k, const char* what) {
  FLOWMOE_CHECK(m >= 0 && k > 0, what << ": shape [" << m << ", " << k
                                      << "] invalid; expected M >= 0 rows and K > 0 columns");
  FLOWMOE_CHECK(x != nullptr || m == 0, what << ": input pointer is null for a non-empty [" << m
                                             << ", " << k << "] matrix");
}

void check_multiple(int64_t v, const char* dim, const char* what) {
  FLOWMOE_CHECK(v % kFp8Block == 0, what << ": " << dim << " = " << v
                                         << " is not a multiple of 128 (the FP8 tile); expected "
                                         << dim << " % 128 == 0");
}

void check_tensor(const QTensorF32& q, const char* what) {
  FLOWMOE_CHECK(q.rows >= 0 && q.cols >= 0 &&
                    static_cast<int64_t>(q.codes.size()) == q.rows * q.cols,
                what << ": the FP32-scale tensor [" << q.rows << ", " << q.cols << "] holds "
                     << q.codes.size() << " codes; expected rows * cols");
  int64_t want = 0;
  if (q.layout == Layout::kRow1x128) {
    check_multiple(q.cols, "K", what);
    want = (q.cols / kFp8Block) * q.rows;
  } else if (q.layout == Layout::kCol128x1) {
    q.segments.validate(q.rows);
    want = q.segments.num_blocks() * q.cols;
  } else {
    FLOWMOE_CHECK(false, what << ": layout " << layout_name(q.layout)
                              << " not supported; expected row-wise 1x128 or column-wise 128x1");
  }
  FLOWMOE_CHECK(static_cast<int64_t>(q.scales.size()) == want,
                what << ": " << q.scales.size() << " scales, expected " << want);
}

}  // namespace

float dequantize_fp32_scale(uint8_t code, float scale) {
  if (num::e4m3_is_nan(code) || std::isnan(scale)) return kNanF;
  return num::e4m3_to_f32(code) * scale;
}

QuantStats quantize_row_fp32_scale(const bf16_t* x, int64_t m, int64_t k, QTensorF32* q) {
  const char* what = "quantize_row_fp32_scale";
  check_input(x, m, k, what);
  check_multiple(k, "K", what);
  FLOWMOE_CHECK(q != nullptr, what << ": output pointer is null");
  QuantStats st;
  q->layout = Layout::kRow1x128;
  q->rows = m;
  q->cols = k;
  q->segments = Segments();
  q->codes.assign(m * k, 0);
  q->scales.assign((k / kFp8Block) * m, 1.0f);
  for (int64_t t = 0; t < m; ++t)
    for (int64_t b = 0; b < k / kFp8Block; ++b) {
      const int64_t base = t * k + b * kFp8Block;
      q->scales[b * m + t] = quantize_tile(
          kFp8Block, [&](int64_t i) { return num::bf16_to_f32(x[base + i]); },
          [&](int64_t i, uint8_t c) { q->codes[base + i] = c; }, &st);
    }
  return st;
}

QuantStats quantize_col_fp32_scale(const bf16_t* x, int64_t m, int64_t k, const Segments& seg,
                                   QTensorF32* q) {
  const char* what = "quantize_col_fp32_scale";
  check_input(x, m, k, what);
  FLOWMOE_CHECK(q != nullptr, what << ": output pointer is null");
  seg.validate(m);
  QuantStats st;
  q->layout = Layout::kCol128x1;
  q->rows = m;
  q->cols = k;
  q->segments = seg;
  q->codes.assign(k * m, 0);
  q->scales.assign(seg.num_blocks() * k, 1.0f);
  int64_t blk = 0;
  for (int e = 0; e < seg.num_segments(); ++e)
    for (int64_t t0 = seg.offsets[e]; t0 < seg.offsets[e + 1]; t0 += kFp8Block, ++blk) {
      const int64_t t1 = std::min<int64_t>(t0 + kFp8Block, seg.offsets[e + 1]);
      for (int64_t c = 0; c < k; ++c)
        q->scales[blk * k + c] = quantize_tile(
            t1 - t0, [&](int64_t i) { return num::bf16_to_f32(x[(t0 + i) * k + c]); },
            [&](int64_t i, uint8_t code) { q->codes[c * m + t0 + i] = code; }, &st);
    }
  return st;
}

QuantStats quantize_weight_fp32_scale(const bf16_t* w, int64_t n, int64_t k, QTensorF32* q,
                                      QTensorF32* wt) {
  const char* what = "quantize_weight_fp32_scale";
  check_input(w, n, k, what);
  check_multiple(n, "N", what);
  check_multiple(k, "K", what);
  FLOWMOE_CHECK(q != nullptr && q != wt, what << ": output pointer is null or equals the "
                                                 "transpose's; expected two separate outputs");
  QuantStats st;
  const int64_t nb = n / kFp8Block, kb = k / kFp8Block;
  q->layout = Layout::kWeight128x128;
  q->rows = n;
  q->cols = k;
  q->segments = Segments();
  q->codes.assign(n * k, 0);
  q->scales.assign(nb * kb, 1.0f);
  for (int64_t bi = 0; bi < nb; ++bi)
    for (int64_t bj = 0; bj < kb; ++bj) {
      auto idx = [&](int64_t i) {
        return (bi * kFp8Block + i / kFp8Block) * k + bj * kFp8Block + i % kFp8Block;
      };
      q->scales[bi * kb + bj] = quantize_tile(
          kFp8Block * kFp8Block, [&](int64_t i) { return num::bf16_to_f32(w[idx(i)]); },
          [&](int64_t i, uint8_t c) { q->codes[idx(i)] = c; }, &st);
    }
  if (wt == nullptr) return st;
  wt->layout = Layout::kWeight128x128;
  wt->rows = k;
  wt->cols = n;
  wt->segments = Segments();
  wt->codes.assign(n * k, 0);
  wt->scales.assign(nb * kb, 1.0f);
  for (int64_t i = 0; i < n; ++i)
    for (int64_t j = 0; j < k; ++j) wt->codes[j * n + i] = q->codes[i * k + j];
  for (int64_t bi = 0; bi < nb; ++bi)
    for (int64_t bj = 0; bj < kb; ++bj) wt->scales[bj * nb + bi] = q->scales[bi * kb + bj];
  return st;
}

void dequantize(const QTensorF32& q, float* out) {
  const char* what = "dequantize (FP32 scales)";
  check_tensor(q, what);
  FLOWMOE_CHECK(out != nullptr || q.rows * q.cols == 0, what << ": output pointer is null");
  const int64_t m = q.rows, k = q.cols;
  if (q.layout == Layout::kRow1x128) {
    for (int64_t t = 0; t < m; ++t)
      for (int64_t c = 0; c < k; ++c)
        out[t * k + c] =
            dequantize_fp32_scale(q.codes[t * k + c], q.scales[(c / kFp8Block) * m + t]);
    return;
  }
  int64_t blk = 0;
  const Segments& seg = q.segments;
  for (int e = 0; e < seg.num_segments(); ++e)
    for (int64_t t0 = seg.offsets[e]; t0 < seg.offsets[e + 1]; t0 += kFp8Block, ++blk) {
      const int64_t t1 = std::min<int64_t>(t0 + kFp8Block, seg.offsets[e + 1]);
      for (int64_t t = t0; t < t1; ++t)
        for (int64_t c = 0; c < k; ++c)
          out[t * k + c] = dequantize_fp32_scale(q.codes[c * m + t], q.scales[blk * k + c]);
    }
}

void dequantize(const QTensorF32& q, bf16_t* out) {
  std::vector<float> v(q.rows * q.cols);
  dequantize(q, v.data());
  for (size_t i = 0; i < v.size(); ++i)
    out[i] = std::isnan(v[i]) ? static_cast<bf16_t>(0x7FC0) : num::f32_to_bf16(v[i]);
}

QuantStats naive_col_copy(const QTensorF32& row, const Segments& seg, QTensorF32* col) {
  const char* what = "naive_col_copy (FP32 scales)";
  FLOWMOE_CHECK(row.layout == Layout::kRow1x128,
                what << ": input is " << layout_name(row.layout) << ", expected row-wise 1x128");
  FLOWMOE_CHECK(col != nullptr && col != &row,
                what << ": output pointer is null or is the input; pass a separate output");
  std::vector<bf16_t> d(row.rows * row.cols);
  dequantize(row, d.data());
  return quantize_col_fp32_scale(d.data(), row.rows, row.cols, seg, col);
}

}  // namespace cpu
}  // namespace flowmoe
