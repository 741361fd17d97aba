// CPU reference conversions: the readable specification of SPEC §2-§4.
#include "flowmoe/cpu/convert.h"

#include <algorithm>
#include <vector>

#include "flowmoe/error.h"
#include "flowmoe/numerics.h"

namespace flowmoe {
namespace cpu {
namespace {

using namespace flowmoe::num;

inline float load(const float* x, int64_t i) { return x[i]; }
inline float load(const bf16_t* x, int64_t i) { return bf16_to_f32(x[i]); }

void check_matrix(const void* x, int64_t m, int64_t k, const char* what) {
  FLOWMOE_CHECK(m >= 0 && k > 0, what << ": shape [" << m << ", " << k
                                      << "] invalid; expected M >= 0 tokens and K > 0 features");
  FLOWMOE_CHECK(x != nullptr || m == 0, what << ": input pointer is null for a non-empty [" << m
                                             << ", " << k << "] matrix");
}

void check_multiple(int64_t v, int block, const char* dim, const char* what) {
  FLOWMOE_CHECK(v % block == 0, what << ": " << dim << " = " << v << " is not a multiple of "
                                     << block << " (the quantization block); expected " << dim
                                     << " % " << block << " == 0");
}

// The output must exist and must not be an input: outputs are resized before inputs are read.
void check_output(const QTensor* out, const char* what, const QTensor* in = nullptr,
                  const QTensor* in2 = nullptr) {
  FLOWMOE_CHECK(out != nullptr, what << ": output QTensor pointer is null");
  FLOWMOE_CHECK(out != in && out != in2,
                what << ": the output QTensor is also an input; pass a separate output");
}

void check_layout(const QTensor& q, Layout want, const char* what) {
  FLOWMOE_CHECK(q.layout == want, what << ": input is " << layout_name(q.layout) << ", expected "
                                       << layout_name(want));
  FLOWMOE_CHECK(q.rows >= 0 && q.cols >= 0,
                what << ": " << q.describe() << " has a negative shape");
  // The shape must tile exactly, or the scale grid below is too small for the elements.
  if (q.layout == Layout::kRow1x128) check_multiple(q.cols, kFp8Block, "K", what);
  if (q.layout == Layout::kWeight128x128) {
    check_multiple(q.rows, kFp8Block, "N", what);
    check_multiple(q.cols, kFp8Block, "K", what);
  }
  if (q.layout == Layout::kMxfp4Row1x32) check_multiple(q.cols, kFp4Block, "K", what);
  FLOWMOE_CHECK(static_cast<int64_t>(q.codes.size()) == q.code_bytes(),
                what << ": " << q.describe() << " holds " << q.codes.size()
                     << " code bytes, expected " << q.code_bytes());
  FLOWMOE_CHECK(static_cast<int64_t>(q.scales.size()) == q.scale_rows() * q.scale_cols(),
                what << ": " << q.describe() << " holds " << q.scales.size()
                     << " scale bytes, expected " << q.scale_rows() << " x " << q.scale_cols());
}

// Mark a tile as non-finite: scale NaN, codes NaN (E4M3) so nothing decodes to a finite value.
constexpr uint8_t kNanCodeE4M3 = kE4M3NaN;
constexpr uint8_t kNanCodeE2M1 = 0x0;  // E2M1 has no NaN; the NaN scale carries it

// Calls fn(block, t0, t1) for every 128-token block [t0, t1) of every segment, in order: a
// block never straddles two segments, the last block of a segment may be partial, an empty
// segment has none. `block` numbers the blocks (the row of the column-wise scale grid).
template <typename Fn>
void for_each_token_block(const Segments& seg, Fn&& fn) {
  int64_t blk = 0;
  for (int s = 0; s < seg.num_segments(); ++s) {
    for (int64_t t0 = seg.offsets[s]; t0 < seg.offsets[s + 1]; t0 += kFp8Block, ++blk) {
      fn(blk, t0, std::min<int64_t>(t0 + kFp8Block, seg.offsets[s + 1]));
    }
  }
}

// Infinities in a decoded BF16 intermediate: codes and scales hold no Inf, so each one is a finite
// value beyond the range (an overflow of the stepwise paths), never an input Inf.
int64_t count_bf16_inf(const std::vector<bf16_t>& x) {
  int64_t n = 0;
  for (bf16_t h : x) n += (h & 0x7FFFu) == 0x7F80u;
  return n;
}

// The largest |value| of a tile over its finite values, and how many were not finite.
struct TileAmax {
  float amax = 0.0f;
  int64_t bad = 0;
  void add(float v) {
    if (!f32_is_finite(v))
      ++bad;
    else
      amax = f32_max_nonneg(amax, f32_abs(v));
  }
};

// The largest UE8M0 scale code among finite scales (0 when none), and how many were NaN (0xFF).
struct MaxScaleCode {
  int cmax = 0;
  int bad = 0;
  void add(uint8_t e) {
    if (e == kUE8M0NaN)
      ++bad;
    else
      cmax = std::max<int>(cmax, e);
  }
};

// The column-amax target exponent (TransposeExponent::kColumnAmax) of one column block whose
// elements are v * 2^(e - 127): a small exact value v (an E4M3 or E2M1 value) under the scale
// code e. element(t, &v, &e) gives token t's element and returns false for one to skip (a NaN
// code). The result is the scale code of the fresh power-of-two scale of the block's amax,
// 2^ceil(log2(amax / 448)), clamped to [0, 254]; an all-zero block gets 0 (the smallest scale).
// The amax is taken relative to 2^(r - 127), r the largest scale code among the non-zero values:
// the maximum is then >= 2^-9, an exact binary32 value, and values more than 160 binades below
// r cannot hold it.
template <typename Element>
int column_amax_scale_code(int64_t t0, int64_t t1, Element&& element) {
  int r = -1;
  for (int64_t t = t0; t < t1; ++t) {
    float v;
    int e;
    if (element(t, &v, &e) && v != 0.0f) r = std::max(r, e);
  }
  if (r < 0) return 0;
  float amax_rel = 0.0f;
  for (int64_t t = t0; t < t1; ++t) {
    float v;
    int e;
    if (!element(t, &v, &e) || e - r < -160) continue;
    amax_rel = std::max(amax_rel, f32_abs(v) * exp2i(std::max(e - r, -149)));
  }
  return std::min(std::max(r + e4m3_scale_exp(amax_rel), 0), 254);
}

// ---- FP8 row-wise -----------------------------------------------------------------------------
template <typename T>
QuantStats quantize_row_impl(const T* x, int64_t m, int64_t k, QTensor* out) {
  check_output(out, "quantize_row");
  check_matrix(x, m, k, "quantize_row");
  check_multiple(k, kFp8Block, "K", "quantize_row");
  out->layout = Layout::kRow1x128;
  out->rows = m;
  out->cols = k;
  out->segments = Segments{};
  out->codes.assign(m * k, 0);
  out->scales.assign((k / kFp8Block) * m, 0);
  QuantStats st;
  for (int64_t r = 0; r < m; ++r) {
    for (int64_t b = 0; b < k / kFp8Block; ++b) {
      const int64_t base = r * k + b * kFp8Block;
      TileAmax ta;
      for (int i = 0; i < kFp8Block; ++i) {
        ta.add(load(x, base + i));
      }
      const float amax = ta.amax;
      const int64_t bad = ta.bad;
      uint8_t* codes = &out->codes[base];
      if (bad) {
        st.nonfinite += bad;
        out->scales[b * m + r] = kUE8M0NaN;
        std::fill(codes, codes + kFp8Block, kNanCodeE4M3);
        continue;
      }
      const int e = e4m3_scale_exp(amax);
      out->scales[b * m + r] = ue8m0_from_exp(e);
      for (int i = 0; i < kFp8Block; ++i) {
        codes[i] = quant_e4m3_finite(load(x, base + i), e);
        st.flushed += (codes[i] & 0x7F) == 0 && load(x, base + i) != 0.0f;
      }
    }
  }
  return st;
}

// ---- FP8 column-wise (from high precision) ------------------------------------------------------
template <typename T>
QuantStats quantize_col_impl(const T* x, int64_t m, int64_t k, const Segments& seg, QTensor* out) {
  check_output(out, "quantize_col");
  check_matrix(x, m, k, "quantize_col");
  seg.validate(m);
  out->layout = Layout::kCol128x1;
  out->rows = m;
  out->cols = k;
  out->segments = seg;
  const int64_t nb = seg.num_blocks();
  out->codes.assign(k * m, 0);
  out->scales.assign(nb * k, 0);
  QuantStats st;
  for_each_token_block(seg, [&](int64_t blk, int64_t t0, int64_t t1) {
    for (int64_t c = 0; c < k; ++c) {
      TileAmax ta;
      for (int64_t t = t0; t < t1; ++t) {
        ta.add(load(x, t * k + c));
      }
      const float amax = ta.amax;
      const int64_t bad = ta.bad;
      uint8_t* codes = &out->codes[c * m];
      if (bad) {
        st.nonfinite += bad;
        out->scales[blk * k + c] = kUE8M0NaN;
        for (int64_t t = t0; t < t1; ++t) codes[t] = kNanCodeE4M3;
        continue;
      }
      const int e = e4m3_scale_exp(amax);
      out->scales[blk * k + c] = ue8m0_from_exp(e);
      for (int64_t t = t0; t < t1; ++t) {
        codes[t] = quant_e4m3_finite(load(x, t * k + c), e);
        st.flushed += (codes[t] & 0x7F) == 0 && load(x, t * k + c) != 0.0f;
      }
    }
  });
  return st;
}

// ---- FP8 weights 128x128 ------------------------------------------------------------------------
template <typename T>
QuantStats quantize_weight_impl(const T* w, int64_t n, int64_t k, QTensor* out, QTensor* wt) {
  check_output(out, "quantize_weight");
  FLOWMOE_CHECK(wt != out, "quantize_weight: the transposed copy and the weight share one QTensor");
  check_matrix(w, n, k, "quantize_weight");
  check_multiple(n, kFp8Block, "N", "quantize_weight");
  check_multiple(k, kFp8Block, "K", "quantize_weight");
  out->layout = Layout::kWeight128x128;
  out->rows = n;
  out->cols = k;
  out->segments = Segments{};
  out->codes.assign(n * k, 0);
  const int64_t nbn = n / kFp8Block, nbk = k / kFp8Block;
  out->scales.assign(nbn * nbk, 0);
  QuantStats st;
  for (int64_t bn = 0; bn < nbn; ++bn) {
    for (int64_t bk = 0; bk < nbk; ++bk) {
      TileAmax ta;
      for (int64_t r = bn * kFp8Block; r < (bn + 1) * kFp8Block; ++r) {
        for (int64_t c = bk * kFp8Block; c < (bk + 1) * kFp8Block; ++c) {
          ta.add(load(w, r * k + c));
        }
      }
      const float amax = ta.amax;
      const int64_t bad = ta.bad;
      st.nonfinite += bad;
      const int e = e4m3_scale_exp(amax);
      out->scales[bn * nbk + bk] = bad ? kUE8M0NaN : ue8m0_from_exp(e);
      for (int64_t r = bn * kFp8Block; r < (bn + 1) * kFp8Block; ++r) {
        for (int64_t c = bk * kFp8Block; c < (bk + 1) * kFp8Block; ++c) {
          out->codes[r * k + c] = bad ? kNanCodeE4M3 : quant_e4m3_finite(load(w, r * k + c), e);
          st.flushed += !bad && (out->codes[r * k + c] & 0x7F) == 0 && load(w, r * k + c) != 0.0f;
        }
      }
    }
  }
  if (wt) transpose_weight(*out, wt);
  return st;
}

// ---- MXFP4 --------------------------------------------------------------------------------------
template <typename T>
QuantStats quantize_mxfp4_impl(const T* x, int64_t m, int64_t k, QTensor* out) {
  check_output(out, "quantize_mxfp4");
  check_matrix(x, m, k, "quantize_mxfp4");
  check_multiple(k, kFp4Block, "K", "quantize_mxfp4");
  out->layout = Layout::kMxfp4Row1x32;
  out->rows = m;
  out->cols = k;
  out->segments = Segments{};
  out->codes.assign(m * k / 2, 0);
  out->scales.assign(m * (k / kFp4Block), 0);
  QuantStats st;
  for (int64_t r = 0; r < m; ++r) {
    for (int64_t b = 0; b < k / kFp4Block; ++b) {
      const int64_t base = r * k + b * kFp4Block;
      TileAmax ta;
      for (int i = 0; i < kFp4Block; ++i) {
        ta.add(load(x, base + i));
      }
      const float amax = ta.amax;
      const int64_t bad = ta.bad;
      st.nonfinite += bad;
      const int e = e2m1_scale_exp(amax);
      out->scales[r * (k / kFp4Block) + b] = bad ? kUE8M0NaN : ue8m0_from_exp(e);
      for (int i = 0; i < kFp4Block; i += 2) {
        const uint8_t lo = bad ? kNanCodeE2M1 : quant_e2m1_finite(load(x, base + i), e);
        const uint8_t hi = bad ? kNanCodeE2M1 : quant_e2m1_finite(load(x, base + i + 1), e);
        out->codes[(base + i) / 2] = e2m1_pack(lo, hi);
        if (!bad) {
          st.flushed += (lo & 7) == 0 && load(x, base + i) != 0.0f;
          st.flushed += (hi & 7) == 0 && load(x, base + i + 1) != 0.0f;
        }
      }
    }
  }
  return st;
}

}  // namespace

QuantStats quantize_row(const float* x, int64_t m, int64_t k, QTensor* out) {
  return quantize_row_impl(x, m, k, out);
}
QuantStats quantize_row(const bf16_t* x, int64_t m, int64_t k, QTensor* out) {
  return quantize_row_impl(x, m, k, out);
}
QuantStats quantize_col(const float* x, int64_t m, int64_t k, const Segments& seg, QTensor* out) {
  return quantize_col_impl(x, m, k, seg, out);
}
QuantStats quantize_col(const bf16_t* x, int64_t m, int64_t k, const Segments& seg, QTensor* out) {
  return quantize_col_impl(x, m, k, seg, out);
}
QuantStats quantize_both(const bf16_t* x, int64_t m, int64_t k, const Segments& seg, QTensor* row,
                         QTensor* col) {
  FLOWMOE_CHECK(row != col, "quantize_both: row and col outputs share one QTensor");
  QuantStats st = quantize_row_impl(x, m, k, row);
  quantize_col_impl(x, m, k, seg, col);  // counts the same non-finite elements again
  return st;
}
QuantStats quantize_weight(const float* w, int64_t n, int64_t k, QTensor* out, QTensor* wt) {
  return quantize_weight_impl(w, n, k, out, wt);
}
QuantStats quantize_weight(const bf16_t* w, int64_t n, int64_t k, QTensor* out, QTensor* wt) {
  return quantize_weight_impl(w, n, k, out, wt);
}
QuantStats quantize_mxfp4(const float* x, int64_t m, int64_t k, QTensor* out) {
  return quantize_mxfp4_impl(x, m, k, out);
}
QuantStats quantize_mxfp4(const bf16_t* x, int64_t m, int64_t k, QTensor* out) {
  return quantize_mxfp4_impl(x, m, k, out);
}

void transpose_weight(const QTensor& w, QTensor* wt) {
  check_output(wt, "transpose_weight", &w);
  check_layout(w, Layout::kWeight128x128, "transpose_weight");
  const int64_t n = w.rows, k = w.cols, nbn = n / kFp8Block, nbk = k / kFp8Block;
  wt->layout = Layout::kWeight128x128;
  wt->rows = k;
  wt->cols = n;
  wt->segments = Segments{};
  wt->codes.assign(n * k, 0);
  wt->scales.assign(nbn * nbk, 0);
  for (int64_t r = 0; r < n; ++r)
    for (int64_t c = 0; c < k; ++c) wt->codes[c * n + r] = w.codes[r * k + c];
  for (int64_t bn = 0; bn < nbn; ++bn)
    for (int64_t bk = 0; bk < nbk; ++bk) wt->scales[bk * nbn + bn] = w.scales[bn * nbk + bk];
}

void dequantize(const QTensor& q, float* out) {
  FLOWMOE_CHECK(out != nullptr || q.rows * q.cols == 0, "dequantize: output pointer is null");
  check_layout(q, q.layout, "dequantize");
  const int64_t m = q.rows, k = q.cols;
  switch (q.layout) {
    case Layout::kRow1x128:
      for (int64_t r = 0; r < m; ++r)
        for (int64_t c = 0; c < k; ++c)
          out[r * k + c] = dequant_e4m3(q.codes[r * k + c], q.scales[(c / kFp8Block) * m + r]);
      break;
    case Layout::kCol128x1: {
      q.segments.validate(m);
      const Segments& seg = q.segments;
      for_each_token_block(seg, [&](int64_t blk, int64_t t0, int64_t t1) {
        for (int64_t c = 0; c < k; ++c) {
          const uint8_t sc = q.scales[blk * k + c];
          for (int64_t t = t0; t < t1; ++t) out[t * k + c] = dequant_e4m3(q.codes[c * m + t], sc);
        }
      });
      break;
    }
    case Layout::kWeight128x128: {
      const int64_t nbk = k / kFp8Block;
      for (int64_t r = 0; r < m; ++r)
        for (int64_t c = 0; c < k; ++c)
          out[r * k + c] =
              dequant_e4m3(q.codes[r * k + c], q.scales[(r / kFp8Block) * nbk + c / kFp8Block]);
      break;
    }
    case Layout::kMxfp4Row1x32:
      for (int64_t r = 0; r < m; ++r)
        for (int64_t c = 0; c < k; ++c)
          out[r * k + c] = dequant_e2m1(e2m1_get(q.codes.data(), r * k + c),
                                        q.scales[r * (k / kFp4Block) + c / kFp4Block]);
      break;
  }
}

void dequantize(const QTensor& q, bf16_t* out) {
  check_layout(q, q.layout, "dequantize");
  std::vector<float> tmp(q.rows * q.cols);
  dequantize(q, tmp.data());
  for (size_t i = 0; i < tmp.size(); ++i) out[i] = f32_to_bf16(tmp[i]);
}

QuantStats naive_col_copy(const QTensor& row, const Segments& seg, QTensor* col) {
  check_output(col, "naive_col_copy", &row);
  check_layout(row, Layout::kRow1x128, "naive_col_copy");
  std::vector<bf16_t> x(row.rows * row.cols);
  dequantize(row, x.data());  // FP8 -> BF16 (what users do), exact for in-range values
  QuantStats st = quantize_col_impl(x.data(), row.rows, row.cols, seg, col);  // transpose + fresh scales
  st.overflow = count_bf16_inf(x);
  return st;
}

QuantStats scaling_aware_transpose(const QTensor& row, const Segments& seg, QTensor* col,
                                   TransposeExponent mode) {
  check_output(col, "scaling_aware_transpose", &row);
  check_layout(row, Layout::kRow1x128, "scaling_aware_transpose");
  const int64_t m = row.rows, k = row.cols;
  seg.validate(m);
  col->layout = Layout::kCol128x1;
  col->rows = m;
  col->cols = k;
  col->segments = seg;
  col->codes.assign(k * m, 0);
  col->scales.assign(seg.num_blocks() * k, 0);
  QuantStats st;
  for_each_token_block(seg, [&](int64_t blk, int64_t t0, int64_t t1) {
    for (int64_t c = 0; c < k; ++c) {
      const uint8_t* rs = &row.scales[(c / kFp8Block) * m];  // row exponents of this K tile
      MaxScaleCode msc;
      for (int64_t t = t0; t < t1; ++t) {
        msc.add(rs[t]);
      }
      const int cmax = msc.cmax, bad = msc.bad;
      uint8_t* codes = &col->codes[c * m];
      if (bad) {
        st.nonfinite += bad;
        col->scales[blk * k + c] = kUE8M0NaN;
        for (int64_t t = t0; t < t1; ++t) codes[t] = kNanCodeE4M3;
        continue;
      }
      int target = cmax;
      if (mode == TransposeExponent::kColumnAmax) {
        target = column_amax_scale_code(t0, t1, [&](int64_t t, float* v, int* e) {
          const uint8_t q = row.codes[t * k + c];
          *v = e4m3_to_f32(q);
          *e = rs[t];
          return !e4m3_is_nan(q);
        });
      }
      col->scales[blk * k + c] = static_cast<uint8_t>(target);
      for (int64_t t = t0; t < t1; ++t) {
        bool lost = false;
        const uint8_t q = row.codes[t * k + c];
        st.nonfinite += e4m3_is_nan(q);  // a NaN code under a finite scale stays NaN, counted
        // NaN codes stay NaN; zeros keep their sign (and need no shift, which for kColumnAmax
        // may be far upwards when the block's other values are small).
        codes[t] = (e4m3_is_nan(q) || (q & 0x7F) == 0)
                       ? q
                       : e4m3_encode_shifted(e4m3_to_f32(q), target - rs[t], &lost);
        st.underflow += lost;
      }
    }
  });
  return st;
}

QuantStats fp4_to_fp8_row(const QTensor& fp4, QTensor* row) {
  check_output(row, "fp4_to_fp8_row", &fp4);
  check_layout(fp4, Layout::kMxfp4Row1x32, "fp4_to_fp8_row");
  const int64_t m = fp4.rows, k = fp4.cols, ng = k / kFp4Block;
  check_multiple(k, kFp8Block, "K", "fp4_to_fp8_row");
  row->layout = Layout::kRow1x128;
  row->rows = m;
  row->cols = k;
  row->segments = Segments{};
  row->codes.assign(m * k, 0);
  row->scales.assign((k / kFp8Block) * m, 0);
  QuantStats st;
  constexpr int kGroups = kFp8Block / kFp4Block;  // four MXFP4 blocks per FP8 tile
  for (int64_t r = 0; r < m; ++r) {
    for (int64_t b = 0; b < k / kFp8Block; ++b) {
      const uint8_t* es = &fp4.scales[r * ng + b * kGroups];
      MaxScaleCode msc;
      for (int j = 0; j < kGroups; ++j) {
        msc.add(es[j]);
      }
      const int cmax = msc.cmax, bad = msc.bad;
      uint8_t* codes = &row->codes[r * k + b * kFp8Block];
      if (bad) {
        st.nonfinite += bad * kFp4Block;
        row->scales[b * m + r] = kUE8M0NaN;
        std::fill(codes, codes + kFp8Block, kNanCodeE4M3);
        continue;
      }
      const int sc = fp8_scale_code_from_fp4_max(cmax);
      row->scales[b * m + r] = static_cast<uint8_t>(sc);
      for (int i = 0; i < kFp8Block; ++i) {
        const float p = e2m1_to_f32(e2m1_get(fp4.codes.data(), r * k + b * kFp8Block + i));
        bool lost = false;
        codes[i] = e4m3_encode_shifted(p, sc - es[i / kFp4Block], &lost);
        st.underflow += lost;
      }
    }
  }
  return st;
}

QuantStats fp4_to_fp8_col(const QTensor& fp4, const Segments& seg, QTensor* col,
                          TransposeExponent mode) {
  check_output(col, "fp4_to_fp8_col", &fp4);
  check_layout(fp4, Layout::kMxfp4Row1x32, "fp4_to_fp8_col");
  const int64_t m = fp4.rows, k = fp4.cols, ng = k / kFp4Block;
  seg.validate(m);
  col->layout = Layout::kCol128x1;
  col->rows = m;
  col->cols = k;
  col->segments = seg;
  col->codes.assign(k * m, 0);
  col->scales.assign(seg.num_blocks() * k, 0);
  QuantStats st;
  for_each_token_block(seg, [&](int64_t blk, int64_t t0, int64_t t1) {
    for (int64_t c = 0; c < k; ++c) {
      const int64_t g = c / kFp4Block;
      MaxScaleCode msc;
      for (int64_t t = t0; t < t1; ++t) {
        const uint8_t e = fp4.scales[t * ng + g];
        msc.add(e);
      }
      const int cmax = msc.cmax, bad = msc.bad;
      uint8_t* codes = &col->codes[c * m];
      if (bad) {
        st.nonfinite += bad;
        col->scales[blk * k + c] = kUE8M0NaN;
        for (int64_t t = t0; t < t1; ++t) codes[t] = kNanCodeE4M3;
        continue;
      }
      int sc = fp8_scale_code_from_fp4_max(cmax);
      if (mode == TransposeExponent::kColumnAmax) {
        sc = column_amax_scale_code(t0, t1, [&](int64_t t, float* v, int* e) {
          *v = e2m1_to_f32(e2m1_get(fp4.codes.data(), t * k + c));
          *e = fp4.scales[t * ng + g];
          return true;
        });
      }
      col->scales[blk * k + c] = static_cast<uint8_t>(sc);
      for (int64_t t = t0; t < t1; ++t) {
        const float p = e2m1_to_f32(e2m1_get(fp4.codes.data(), t * k + c));
        bool lost = false;
        // A zero keeps its sign; under kColumnAmax its shift may be far upwards (its token's
        // block exponent can lie far above the column's amax), so it is not shifted at all.
        codes[t] = p == 0.0f ? static_cast<uint8_t>((f32_bits(p) >> 24) & 0x80u)
                             : e4m3_encode_shifted(p, sc - fp4.scales[t * ng + g], &lost);
        st.underflow += lost;
      }
    }
  });
  return st;
}

QuantStats fp4_to_fp8_col_stepwise(const QTensor& fp4, const Segments& seg, QTensor* col) {
  check_output(col, "fp4_to_fp8_col_stepwise", &fp4);
  check_layout(fp4, Layout::kMxfp4Row1x32, "fp4_to_fp8_col_stepwise");
  std::vector<bf16_t> x(fp4.rows * fp4.cols);
  dequantize(fp4, x.data());  // FP4 -> BF16 is exact (up to overflow at the largest scales)
  QuantStats st = quantize_col_impl(x.data(), fp4.rows, fp4.cols, seg, col);
  st.overflow = count_bf16_inf(x);
  return st;
}

}  // namespace cpu
}  // namespace flowmoe
