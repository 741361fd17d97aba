// CPU reference of SwiGLU and its fused quantization (flowmoe/swiglu.h): plain loops over
// 1x128 tiles and 128-token blocks, the specification the CUDA kernels are tested against bit for
// bit. The tests check these loops against the composition of the existing conversions
// (quantize_row, quantize_col, scaling_aware_transpose).
#include "flowmoe/swiglu.h"

#include <algorithm>
#include <cmath>
#include <vector>

#include "flowmoe/error.h"
#include "flowmoe/numerics.h"
#include "flowmoe/swiglu_math.h"

namespace flowmoe {
namespace cpu {
namespace {

using namespace flowmoe::num;

constexpr int kT = kFp8Block;  // 128

void check_shape(int64_t m, int64_t f, const char* what) {
  FLOWMOE_CHECK(m >= 0, what << ": M = " << m << " tokens is negative; expected M >= 0");
  FLOWMOE_CHECK(f > 0 && f % kT == 0,
                what << ": F = " << f << " is not a positive multiple of 128 (the quantization "
                     << "block); H must be [M, 2F] with gate = columns [0, F), up = [F, 2F)");
}
// The gated activation: a known kind; the clamped one with a limit > 0 and a finite alpha.
void check_act(const GatedActivation& act, const char* what) {
  const char* why = num::activation_unsupported(act);
  FLOWMOE_CHECK(why == nullptr, what << ": " << why << " (kind " << static_cast<int>(act.kind) << ", limit "
                                     << act.limit << ", alpha " << act.alpha << ")");
}
void check_ptr(const void* p, int64_t m, const char* name, const char* what) {
  FLOWMOE_CHECK(p != nullptr || m == 0, what << ": " << name << " is null for M = " << m);
}
void check_h_row(const QTensor& h, const char* what) {
  const bool fp4 = h.layout == Layout::kMxfp4Row1x32;
  FLOWMOE_CHECK(h.layout == Layout::kRow1x128 || fp4,
                what << ": saved H is " << layout_name(h.layout) << ", expected "
                     << layout_name(Layout::kRow1x128) << " or " << layout_name(Layout::kMxfp4Row1x32)
                     << " [M, 2F]");
  FLOWMOE_CHECK(h.cols > 0 && h.cols % (2 * kT) == 0,
                what << ": saved H has " << h.cols << " columns; expected 2F with F a positive "
                     << "multiple of 128");
  const int64_t codes = fp4 ? h.rows * h.cols / 2 : h.rows * h.cols;
  const int64_t scales = h.rows * (h.cols / (fp4 ? kFp4Block : kT));
  FLOWMOE_CHECK(h.rows >= 0 && static_cast<int64_t>(h.codes.size()) == codes &&
                    static_cast<int64_t>(h.scales.size()) == scales,
                what << ": saved H " << h.describe() << " holds " << h.codes.size()
                     << " code and " << h.scales.size() << " scale bytes, expected " << codes
                     << " and " << scales);
}

void init_row(QTensor* q, int64_t m, int64_t k) {
  q->layout = Layout::kRow1x128;
  q->rows = m;
  q->cols = k;
  q->segments = Segments{};
  q->codes.assign(m * k, 0);
  q->scales.assign((k / kT) * m, 0);
}
void init_col(QTensor* q, int64_t m, int64_t k, const Segments& seg) {
  q->layout = Layout::kCol128x1;
  q->rows = m;
  q->cols = k;
  q->segments = seg;
  q->codes.assign(k * m, 0);
  q->scales.assign(seg.num_blocks() * k, 0);
}

// One 1x128 tile -> codes and scale code (SPEC §2), from BF16 or binary32 values. Returns the
// number of non-finite values (the tile is then marked NaN).
inline float value(bf16_t v) { return bf16_to_f32(v); }
inline float value(float v) { return v; }
template <typename T>
int64_t quantize_tile(const T* v, uint8_t* codes, uint8_t* scale) {
  float amax = 0.0f;
  int64_t bad = 0;
  for (int i = 0; i < kT; ++i) {
    const float x = value(v[i]);
    if (!f32_is_finite(x)) ++bad;
    else amax = f32_max_nonneg(amax, f32_abs(x));
  }
  if (bad) {
    *scale = kUE8M0NaN;
    std::fill(codes, codes + kT, kE4M3NaN);
    return bad;
  }
  const int e = e4m3_scale_exp(amax);
  *scale = ue8m0_from_exp(e);
  for (int i = 0; i < kT; ++i) codes[i] = quant_e4m3_finite(value(v[i]), e);
  return 0;
}

// The same along tokens for a column block of n <= 128 values.
void quantize_col_block(const bf16_t* v, int64_t stride, int64_t n, uint8_t* codes,
                        uint8_t* scale) {
  float amax = 0.0f;
  bool bad = false;
  for (int64_t i = 0; i < n; ++i) {
    const float x = bf16_to_f32(v[i * stride]);
    if (!f32_is_finite(x)) bad = true;
    else amax = f32_max_nonneg(amax, f32_abs(x));
  }
  if (bad) {
    *scale = kUE8M0NaN;
    std::fill(codes, codes + n, kE4M3NaN);
    return;
  }
  const int e = e4m3_scale_exp(amax);
  *scale = ue8m0_from_exp(e);
  for (int64_t i = 0; i < n; ++i) codes[i] = quant_e4m3_finite(bf16_to_f32(v[i * stride]), e);
}

// Gate and up of row t, feature j, as binary32: from BF16, or decoded from row-wise FP8.
struct HBf16 {
  const bf16_t* h;
  int64_t f;
  float gate(int64_t t, int64_t j) const { return bf16_to_f32(h[t * 2 * f + j]); }
  float up(int64_t t, int64_t j) const { return bf16_to_f32(h[t * 2 * f + f + j]); }
};
struct HFp8 {
  const QTensor* q;
  int64_t f;
  float at(int64_t t, int64_t c) const {
    return dequant_e4m3(q->codes[t * 2 * f + c], q->scales[(c / kT) * q->rows + t]);
  }
  float gate(int64_t t, int64_t j) const { return at(t, j); }
  float up(int64_t t, int64_t j) const { return at(t, f + j); }
};

struct HFp4 {  // MXFP4 1x32: codes [M, 2F/2], scales [M][2F/32]
  const QTensor* q;
  int64_t f;
  float at(int64_t t, int64_t c) const {
    return dequant_e2m1(e2m1_get(q->codes.data(), t * 2 * f + c), q->scales[t * (2 * f / kFp4Block) + c / kFp4Block]);
  }
  float gate(int64_t t, int64_t j) const { return at(t, j); }
  float up(int64_t t, int64_t j) const { return at(t, f + j); }
};

// Without prow: dH = dact_f32(act, dA, gate, up). With prow: dact_prob_f32(act, dA', p, gate, up),
// and (dprow_part not null) the per-tile partial sums of dA' * A in the order swiglu.h specifies.
template <typename HSrc>
QuantStats dswiglu_impl(const bf16_t* da, const HSrc& h, int64_t m, int64_t f, bf16_t* dh,
                        const float* prow, float* dprow_part, const GatedActivation& act) {
  QuantStats st;
  // swiglu.h's order of dp: feature 8 g + 2 q + i of a tile (group g = 0..15, pair q = 0..3)
  constexpr int kGroups = kT / 8;
  for (int64_t t = 0; t < m; ++t) {
    for (int64_t b = 0; b < f / kT; ++b) {
      float pair[kGroups][4];
      for (int g = 0; g < kGroups; ++g) {
        for (int q = 0; q < 4; ++q) {
          float acc = 0.0f;
          for (int i = 0; i < 2; ++i) {
            const int64_t j = b * kT + 8 * g + 2 * q + i;
            const float d = bf16_to_f32(da[t * f + j]);
            float dgate, dup;
            if (prow) {
              const SwigluGradProb gr = dact_prob_f32(act, d, prow[t], h.gate(t, j), h.up(t, j));
              dgate = gr.dgate;
              dup = gr.dup;
              acc = f_fma(d, gr.a, acc);
            } else {
              const SwigluGrad gr = dact_f32(act, d, h.gate(t, j), h.up(t, j));
              dgate = gr.dgate;
              dup = gr.dup;
            }
            const bf16_t dg = bf16_canonical(dgate), du = bf16_canonical(dup);
            dh[t * 2 * f + j] = dg;
            dh[t * 2 * f + f + j] = du;
            st.nonfinite += !f32_is_finite(bf16_to_f32(dg));
            st.nonfinite += !f32_is_finite(bf16_to_f32(du));
          }
          pair[g][q] = acc;
        }
      }
      if (!dprow_part) continue;
      for (int w = 1; w < kGroups; w *= 2)  // each pair position: the pairwise tree over the groups
        for (int g = 0; g < kGroups; g += 2 * w)
          for (int q = 0; q < 4; ++q) pair[g][q] = f_add(pair[g][q], pair[g + w][q]);
      dprow_part[b * m + t] = f32_canonical(f_add(f_add(pair[0][0], pair[0][1]), f_add(pair[0][2], pair[0][3])));
    }
  }
  return st;
}

void check_prob(const float* prow, const float* dprow_part, const char* what) {
  FLOWMOE_CHECK(prow != nullptr || dprow_part == nullptr,
                what << ": dprow_part (the gradient of the routing probabilities) needs prow; "
                     << "give prow, or pass null for both");
}

// Fused backward: dH tile by tile. The BF16 dH is formed once (it is what both layouts quantize).
template <typename HSrc>
QuantStats dswiglu_quant_impl(const bf16_t* da, const HSrc& h, int64_t m, int64_t f,
                              const Segments& seg, QTensor* dh_row, QTensor* dh_col,
                              const float* prow, float* dprow_part, const GatedActivation& act) {
  const int64_t k = 2 * f;
  std::vector<bf16_t> dh(m * k);
  const QuantStats st = dswiglu_impl(da, h, m, f, dh.data(), prow, dprow_part, act);
  init_row(dh_row, m, k);
  for (int64_t t = 0; t < m; ++t)
    for (int64_t b = 0; b < k / kT; ++b)
      quantize_tile(&dh[t * k + b * kT], &dh_row->codes[t * k + b * kT], &dh_row->scales[b * m + t]);
  init_col(dh_col, m, k, seg);
  int64_t blk = 0;
  for (int s = 0; s < seg.num_segments(); ++s) {
    for (int64_t t0 = seg.offsets[s]; t0 < seg.offsets[s + 1]; t0 += kT, ++blk) {
      const int64_t n = std::min<int64_t>(kT, seg.offsets[s + 1] - t0);
      for (int64_t c = 0; c < k; ++c)
        quantize_col_block(&dh[t0 * k + c], k, n, &dh_col->codes[c * m + t0],
                           &dh_col->scales[blk * k + c]);
    }
  }
  return st;  // each non-finite dH value once, though it is written in two layouts
}

void check_dswiglu_quant_args(const bf16_t* da, int64_t m, int64_t f, const Segments& seg,
                              QTensor* dh_row, QTensor* dh_col, const char* what) {
  check_shape(m, f, what);
  check_ptr(da, m, "dA", what);
  FLOWMOE_CHECK(dh_row != nullptr && dh_col != nullptr,
                what << ": dh_row and dh_col outputs must both be given");
  seg.validate(m);
}

}  // namespace

// A = act(gate, up) (or A' = p * A) of row t, feature j, in binary32.
inline float swiglu_at(const bf16_t* h, int64_t f, int64_t t, int64_t j, const float* prow,
                       const GatedActivation& act) {
  const float a = act_f32(act, bf16_to_f32(h[t * 2 * f + j]), bf16_to_f32(h[t * 2 * f + f + j]));
  return prow ? f_mul(a, prow[t]) : a;
}

QuantStats swiglu(const bf16_t* h, int64_t m, int64_t f, float* a, const float* prow,
                  const GatedActivation& act) {
  const char* what = "swiglu";
  check_shape(m, f, what);
  check_act(act, what);
  check_ptr(h, m, "H", what);
  check_ptr(a, m, "A", what);
  QuantStats st;
  for (int64_t t = 0; t < m; ++t) {
    for (int64_t j = 0; j < f; ++j) {
      a[t * f + j] = swiglu_at(h, f, t, j, prow, act);
      st.nonfinite += !f32_is_finite(a[t * f + j]);
    }
  }
  return st;
}

QuantStats swiglu(const bf16_t* h, int64_t m, int64_t f, bf16_t* a, const float* prow,
                  const GatedActivation& act) {
  const char* what = "swiglu";
  check_shape(m, f, what);
  check_act(act, what);
  check_ptr(h, m, "H", what);
  check_ptr(a, m, "A", what);
  QuantStats st;
  for (int64_t t = 0; t < m; ++t) {
    for (int64_t j = 0; j < f; ++j) {
      const float v = swiglu_at(h, f, t, j, prow, act);
      a[t * f + j] = bf16_canonical(v);
      st.nonfinite += !f32_is_finite(bf16_to_f32(a[t * f + j]));
    }
  }
  return st;
}

void saved_h(const bf16_t* h, int64_t m, int64_t f, bf16_t* out, const GatedActivation& act) {
  for (int64_t t = 0; t < m; ++t)
    for (int64_t j = 0; j < 2 * f; ++j) {
      const bf16_t v = h[t * 2 * f + j];
      const float x = num::bf16_to_f32(v);
      const float y = j < f ? num::saved_gate(act, x) : num::saved_up(act, x);
      out[t * 2 * f + j] = num::f32_bits(y) == num::f32_bits(x) ? v : num::f32_to_bf16(y);  // (NaN payloads kept)
    }
}

QuantStats swiglu_quant(const bf16_t* h, int64_t m, int64_t f, QTensor* a_row,
                        const Segments* seg, QTensor* a_col, QTensor* h_row, const float* prow,
                        const GatedActivation& act) {
  const char* what = "swiglu_quant";
  check_shape(m, f, what);
  check_act(act, what);
  check_ptr(h, m, "H", what);
  FLOWMOE_CHECK(a_row != nullptr, what << ": a_row (the row-wise output) is null");
  FLOWMOE_CHECK((seg == nullptr) == (a_col == nullptr),
                what << ": the column-wise copy needs both `seg` and `a_col` (got "
                     << (seg ? "seg" : "no seg") << " and " << (a_col ? "a_col" : "no a_col")
                     << ")");
  if (seg) seg->validate(m);

  // Row pass: per (token, 128-feature tile), the binary32 A values, then the tile quantization
  // (each A value is rounded once, straight to E4M3).
  init_row(a_row, m, f);
  QuantStats st;
  float tile[kT];
  for (int64_t t = 0; t < m; ++t) {
    for (int64_t b = 0; b < f / kT; ++b) {
      for (int i = 0; i < kT; ++i) {
        const int64_t j = b * kT + i;
        tile[i] = swiglu_at(h, f, t, j, prow, act);
      }
      st.nonfinite += quantize_tile(tile, &a_row->codes[t * f + b * kT], &a_row->scales[b * m + t]);
    }
  }
  if (h_row) {
    init_row(h_row, m, 2 * f);
    std::vector<bf16_t> hs;
    const bf16_t* hq = h;
    if (act.clamped()) {  // the saved copy keeps the clamp's decision (saved_h)
      hs.resize(static_cast<size_t>(m) * 2 * f);
      saved_h(h, m, f, hs.data(), act);
      hq = hs.data();
    }
    for (int64_t t = 0; t < m; ++t)
      for (int64_t b = 0; b < 2 * f / kT; ++b)
        st.nonfinite += quantize_tile(&hq[t * 2 * f + b * kT], &h_row->codes[t * 2 * f + b * kT],
                                      &h_row->scales[b * m + t]);
  }
  if (!a_col) return st;

  // Column copy (SPEC §4): per (feature, 128-token block) the shared exponent is the largest
  // row exponent of the block; each row code is shifted down to it. A NaN row tile in the block
  // makes the whole column block NaN (already counted by the row pass).
  init_col(a_col, m, f, *seg);
  int64_t blk = 0;
  for (int s = 0; s < seg->num_segments(); ++s) {
    for (int64_t t0 = seg->offsets[s]; t0 < seg->offsets[s + 1]; t0 += kT, ++blk) {
      const int64_t t1 = std::min<int64_t>(t0 + kT, seg->offsets[s + 1]);
      for (int64_t b = 0; b < f / kT; ++b) {
        const uint8_t* rs = &a_row->scales[b * m];
        int emax = 0;
        bool nan_block = false;
        for (int64_t t = t0; t < t1; ++t) {
          if (rs[t] == kUE8M0NaN) nan_block = true;
          else emax = std::max<int>(emax, rs[t]);
        }
        for (int64_t c = b * kT; c < (b + 1) * kT; ++c) {
          a_col->scales[blk * f + c] = nan_block ? kUE8M0NaN : static_cast<uint8_t>(emax);
          for (int64_t t = t0; t < t1; ++t) {
            if (nan_block) {
              a_col->codes[c * m + t] = kE4M3NaN;
              continue;
            }
            bool lost = false;
            a_col->codes[c * m + t] = e4m3_rescale(a_row->codes[t * f + c], emax - rs[t], &lost);
            st.underflow += lost;
          }
        }
      }
    }
  }
  return st;
}

QuantStats dswiglu(const bf16_t* da, const bf16_t* h, int64_t m, int64_t f, bf16_t* dh,
                   const float* prow, float* dprow_part, const GatedActivation& act) {
  const char* what = "dswiglu";
  check_shape(m, f, what);
  check_act(act, what);
  check_ptr(da, m, "dA", what);
  check_ptr(h, m, "H", what);
  check_ptr(dh, m, "dH", what);
  check_prob(prow, dprow_part, what);
  return dswiglu_impl(da, HBf16{h, f}, m, f, dh, prow, dprow_part, act);
}

QuantStats dswiglu(const bf16_t* da, const QTensor& h_row, bf16_t* dh, const float* prow,
                   float* dprow_part, const GatedActivation& act) {
  const char* what = "dswiglu (saved H)";
  check_h_row(h_row, what);
  check_act(act, what);
  const int64_t m = h_row.rows, f = h_row.cols / 2;
  check_ptr(da, m, "dA", what);
  check_ptr(dh, m, "dH", what);
  check_prob(prow, dprow_part, what);
  if (h_row.layout == Layout::kMxfp4Row1x32)
    return dswiglu_impl(da, HFp4{&h_row, f}, m, f, dh, prow, dprow_part, act);
  return dswiglu_impl(da, HFp8{&h_row, f}, m, f, dh, prow, dprow_part, act);
}

QuantStats dswiglu_quant(const bf16_t* da, const bf16_t* h, int64_t m, int64_t f,
                         const Segments& seg, QTensor* dh_row, QTensor* dh_col, const float* prow,
                         float* dprow_part, const GatedActivation& act) {
  const char* what = "dswiglu_quant";
  check_dswiglu_quant_args(da, m, f, seg, dh_row, dh_col, what);
  check_act(act, what);
  check_ptr(h, m, "H", what);
  check_prob(prow, dprow_part, what);
  return dswiglu_quant_impl(da, HBf16{h, f}, m, f, seg, dh_row, dh_col, prow, dprow_part, act);
}

QuantStats dswiglu_quant(const bf16_t* da, const QTensor& h_row, const Segments& seg,
                         QTensor* dh_row, QTensor* dh_col, const float* prow, float* dprow_part,
                         const GatedActivation& act) {
  const char* what = "dswiglu_quant (saved H)";
  check_h_row(h_row, what);
  check_act(act, what);
  const int64_t m = h_row.rows, f = h_row.cols / 2;
  check_dswiglu_quant_args(da, m, f, seg, dh_row, dh_col, what);
  check_prob(prow, dprow_part, what);
  if (h_row.layout == Layout::kMxfp4Row1x32)
    return dswiglu_quant_impl(da, HFp4{&h_row, f}, m, f, seg, dh_row, dh_col, prow, dprow_part,
                              act);
  return dswiglu_quant_impl(da, HFp8{&h_row, f}, m, f, seg, dh_row, dh_col, prow, dprow_part, act);
}

void sum_dprow_parts(const float* dprow_part, int64_t m, int64_t f, float* dprow) {
  const char* what = "sum_dprow_parts";
  check_shape(m, f, what);
  check_ptr(dprow_part, m, "dprow_part", what);
  check_ptr(dprow, m, "dprow", what);
  for (int64_t t = 0; t < m; ++t) {
    float acc = dprow_part[t];
    for (int64_t b = 1; b < f / kT; ++b) acc = f_add(acc, dprow_part[b * m + t]);
    dprow[t] = f32_canonical(acc);
  }
}

}  // namespace cpu
}  // namespace flowmoe
