// Grouped GEMM: the CPU reference (block-scaled numerics as cuBLASLt defines them), the
// GEMM-ready FP32 scale layouts, and the argument checks shared with the CUDA path.
#include <cstring>
#include <vector>

#include "flowmoe/error.h"
#include "flowmoe/gemm.h"
#include "flowmoe/numerics.h"

namespace flowmoe {
namespace gemm {
namespace {

bool aligned16(const void* p) { return (reinterpret_cast<uintptr_t>(p) & 15u) == 0; }

void check_segments(const Segments& seg, const char* what) {
  FLOWMOE_CHECK(seg.num_segments() >= 1,
                what << ": no experts (segments need offsets of size E+1 >= 2, got "
                     << seg.offsets.size() << ")");
  seg.validate(seg.num_tokens());
}

void check_dim(int64_t v, int64_t multiple, const char* dim, const char* what, const char* why) {
  FLOWMOE_CHECK(v > 0 && v % multiple == 0, what << ": " << dim << " = " << v
                                                 << " is not a positive multiple of " << multiple
                                                 << " (" << why << "); expected " << dim << " % "
                                                 << multiple << " == 0");
}

void check_token_counts(const Segments& seg, int multiple, const char* what) {
  for (int e = 0; e < seg.num_segments(); ++e) {
    const int64_t c = static_cast<int64_t>(seg.offsets[e + 1]) - seg.offsets[e];
    FLOWMOE_CHECK(c % multiple == 0,
                  what << ": expert " << e << " has " << c
                       << " tokens; the FP8 path needs every expert's token count to be a multiple "
                          "of "
                       << multiple
                       << " (cuBLASLt block-scaled FP8 limits, see docs/GEMM.md); pad the segments "
                          "with zero rows (permute+pad does) or use the BF16 path");
  }
}

// `name` is printed as name_prefix followed by name (formatted only when a check fails, so a
// passing call allocates nothing).
template <typename T>
void check_span(const T* p, int64_t size, int64_t need, const char* name, const char* what,
                const char* name_prefix = "") {
  if (need == 0) return;
  FLOWMOE_CHECK(p != nullptr, what << ": " << name_prefix << name
                                   << " is null; expected a device pointer to at least " << need
                                   << " elements");
  FLOWMOE_CHECK(aligned16(p), what << ": " << name_prefix << name << " = "
                                   << static_cast<const void*>(p)
                                   << " is not 16-byte aligned; expected a 16-byte aligned "
                                      "pointer (cudaMalloc gives 256)");
  FLOWMOE_CHECK(size >= need, what << ": " << name_prefix << name << " holds " << size
                                   << " elements, expected at least " << need);
}

void check_fp8_rowwise_pass(const char* what, Pass p, const Segments& seg, int64_t n, int64_t k,
                            const Fp8Operand& act, const Fp8Operand& w, const bf16_t* out,
                            int64_t out_size) {
  check_segments(seg, what);
  check_dim(n, kFp8Block, "N", what, "128x128 weight blocks");
  check_dim(k, kFp8Block, "K", what, "128x128 weight blocks and 1x128 activation tiles");
  check_token_counts(seg, fp8_token_multiple(p), what);
  const int64_t m = seg.num_tokens();
  const int E = seg.num_segments();
  // fprop contracts over K with an [M, K] activation; dgrad over N with an [M, N] gradient.
  const int64_t c_in = p == Pass::kFprop ? k : n;
  const int64_t c_out = p == Pass::kFprop ? n : k;
  const char* an = p == Pass::kFprop ? "x" : "dy";
  const char* wn = p == Pass::kFprop ? "w" : "wt";
  check_span(act.codes.data, act.codes.size, m * c_in, ".codes", what, an);
  check_span(act.scales.data, act.scales.size, act_scale_f32_elems(m, c_in),
             ".scales (expert-packed FP32)", what, an);
  check_span(w.codes.data, w.codes.size, static_cast<int64_t>(E) * n * k, ".codes", what, wn);
  check_span(w.scales.data, w.scales.size, weight_scale_f32_elems(E, c_out, c_in),
             ".scales (FP32, padded)", what, wn);
  check_span(out, out_size, m * c_out, p == Pass::kFprop ? "y" : "dx", what);
}

}  // namespace

const char* pass_name(Pass p) {
  switch (p) {
    case Pass::kFprop: return "fprop";
    case Pass::kDgrad: return "dgrad";
    case Pass::kWgrad: return "wgrad";
  }
  return "?";
}

const char* wgrad_kind_name(WgradOut::Kind k) {
  switch (k) {
    case WgradOut::Kind::kBf16: return "bf16";
    case WgradOut::Kind::kF32: return "f32";
    case WgradOut::Kind::kF32Accumulate: return "f32 accumulate";
  }
  return "?";
}

int fp8_token_multiple(Pass p) { return p == Pass::kWgrad ? 16 : 4; }

int64_t act_scale_f32_elems(int64_t m, int64_t c) { return m * (c / kFp8Block); }
int64_t col_scale_f32_elems(const Segments& seg, int64_t c) { return seg.num_blocks() * c; }
int64_t weight_scale_ld(int64_t cols) { return round_up(cols / kFp8Block, 4); }
int64_t weight_scale_f32_elems(int num_experts, int64_t rows, int64_t cols) {
  return static_cast<int64_t>(num_experts) * (rows / kFp8Block) * weight_scale_ld(cols);
}

std::vector<float> act_scales_f32(const QTensor& row, const Segments& seg) {
  FLOWMOE_CHECK(row.layout == Layout::kRow1x128,
                "act_scales_f32: input is " << layout_name(row.layout) << ", expected "
                                            << layout_name(Layout::kRow1x128));
  const int64_t m = row.rows, L = row.cols / kFp8Block;
  FLOWMOE_CHECK(static_cast<int64_t>(row.scales.size()) == L * m,
                "act_scales_f32: " << row.describe() << " holds " << row.scales.size()
                                   << " scales, expected " << L * m);
  seg.validate(m);
  std::vector<float> out(L * m);
  for (int e = 0; e < seg.num_segments(); ++e) {
    const int64_t off = seg.offsets[e], me = seg.offsets[e + 1] - off;
    for (int64_t b = 0; b < L; ++b)
      for (int64_t t = 0; t < me; ++t)
        out[L * off + b * me + t] = num::ue8m0_to_f32(row.scales[b * m + off + t]);
  }
  return out;
}

std::vector<float> col_scales_f32(const QTensor& col) {
  FLOWMOE_CHECK(col.layout == Layout::kCol128x1,
                "col_scales_f32: input is " << layout_name(col.layout) << ", expected "
                                            << layout_name(Layout::kCol128x1));
  std::vector<float> out(col.scales.size());
  for (size_t i = 0; i < out.size(); ++i) out[i] = num::ue8m0_to_f32(col.scales[i]);
  return out;
}

std::vector<float> weight_scales_f32(const std::vector<QTensor>& w) {
  FLOWMOE_CHECK(!w.empty(), "weight_scales_f32: no weights; expected one QTensor per expert");
  const int64_t rows = w[0].rows, cols = w[0].cols;
  const int64_t rb = rows / kFp8Block, cb = cols / kFp8Block, ld = weight_scale_ld(cols);
  std::vector<float> out(static_cast<int64_t>(w.size()) * rb * ld, 0.0f);
  for (size_t e = 0; e < w.size(); ++e) {
    FLOWMOE_CHECK(w[e].layout == Layout::kWeight128x128 && w[e].rows == rows && w[e].cols == cols &&
                      static_cast<int64_t>(w[e].scales.size()) == rb * cb,
                  "weight_scales_f32: expert " << e << " is " << w[e].describe()
                                               << ", expected weight 128x128 e4m3 [" << rows
                                               << ", " << cols << "] like expert 0");
    for (int64_t r = 0; r < rb; ++r)
      for (int64_t c = 0; c < cb; ++c)
        out[(static_cast<int64_t>(e) * rb + r) * ld + c] = num::ue8m0_to_f32(w[e].scales[r * cb + c]);
  }
  return out;
}

Fp8Operand fp8_operand(const cuda::QTensorView& v, const char* what) {
  FLOWMOE_CHECK(v.layout != Layout::kMxfp4Row1x32,
                what << ": the view is " << layout_name(v.layout)
                     << "; expected FP8 (row-wise 1x128, column-wise 128x1 or weight 128x128)");
  cuda::check_view(v, v.layout, cuda::ScaleFormat::kF32, what);
  return Fp8Operand{{v.codes, v.code_bytes()}, {v.f32(), v.scale_elems()}};
}

void check_fp8_fprop(const Segments& seg, int64_t n, int64_t k, const Fp8Operand& x,
                     const Fp8Operand& w, Span<const bf16_t> y) {
  check_fp8_rowwise_pass("FP8 fprop", Pass::kFprop, seg, n, k, x, w, y.data, y.size);
}

void check_fp8_dgrad(const Segments& seg, int64_t n, int64_t k, const Fp8Operand& dy,
                     const Fp8Operand& wt, Span<const bf16_t> dx) {
  check_fp8_rowwise_pass("FP8 dgrad", Pass::kDgrad, seg, n, k, dy, wt, dx.data, dx.size);
}

void check_fp8_wgrad(const Segments& seg, int64_t n, int64_t k, const Fp8Operand& dy_col,
                     const Fp8Operand& x_col, const WgradOut& dw) {
  const char* what = "FP8 wgrad";
  FLOWMOE_CHECK(dw.stored.rows == 0, what << ": a stored output (WgradOut::stored) on host segments; only the "
                                            "wgrad on device segments (flowmoe's kernel) writes one");
  check_segments(seg, what);
  check_dim(n, kFp8Block, "N", what, "128x128 weight-gradient blocks");
  check_dim(k, kFp8Block, "K", what, "128x128 weight-gradient blocks");
  check_token_counts(seg, fp8_token_multiple(Pass::kWgrad), what);
  const int64_t m = seg.num_tokens();
  const int E = seg.num_segments();
  check_span(dy_col.codes.data, dy_col.codes.size, n * m, "dy_col.codes ([N, M])", what);
  check_span(dy_col.scales.data, dy_col.scales.size, col_scale_f32_elems(seg, n),
             "dy_col.scales (FP32 [NB][N])", what);
  check_span(x_col.codes.data, x_col.codes.size, k * m, "x_col.codes ([K, M])", what);
  check_span(x_col.scales.data, x_col.scales.size, col_scale_f32_elems(seg, k),
             "x_col.scales (FP32 [NB][K])", what);
  FLOWMOE_CHECK(dw.kind == WgradOut::Kind::kBf16 || dw.kind == WgradOut::Kind::kF32 ||
                    dw.kind == WgradOut::Kind::kF32Accumulate,
                what << ": unknown output kind " << static_cast<int>(dw.kind));
  check_span(static_cast<const uint8_t*>(dw.data), dw.size, static_cast<int64_t>(E) * n * k,
             "dw ([E][N][K])", what);
}

void check_bf16(Pass p, const Segments& seg, int64_t n, int64_t k, Span<const bf16_t> in_a,
                Span<const bf16_t> in_b, const void* out, int64_t out_size) {
  const char* what = p == Pass::kFprop ? "BF16 fprop" : p == Pass::kDgrad ? "BF16 dgrad" : "BF16 wgrad";
  check_segments(seg, what);
  check_dim(n, 8, "N", what, "16-byte rows of BF16");
  check_dim(k, 8, "K", what, "16-byte rows of BF16");
  const int64_t m = seg.num_tokens();
  const int64_t E = seg.num_segments();
  switch (p) {
    case Pass::kFprop:
      check_span(in_a.data, in_a.size, m * k, "x ([M, K])", what);
      check_span(in_b.data, in_b.size, E * n * k, "w ([E][N][K])", what);
      check_span(static_cast<const uint8_t*>(out), out_size, m * n, "y ([M, N])", what);
      break;
    case Pass::kDgrad:
      check_span(in_a.data, in_a.size, m * n, "dy ([M, N])", what);
      check_span(in_b.data, in_b.size, E * n * k, "w ([E][N][K])", what);
      check_span(static_cast<const uint8_t*>(out), out_size, m * k, "dx ([M, K])", what);
      break;
    case Pass::kWgrad:
      check_span(in_a.data, in_a.size, m * n, "dy ([M, N])", what);
      check_span(in_b.data, in_b.size, m * k, "x ([M, K])", what);
      check_span(static_cast<const uint8_t*>(out), out_size, E * n * k, "dw ([E][N][K])", what);
      break;
  }
}

}  // namespace gemm

// =================================================================================================
namespace cpu {
namespace {

using num::e4m3_to_f32;
using num::ue8m0_to_f32;

std::vector<float> decode_codes(const std::vector<uint8_t>& codes) {
  std::vector<float> out(codes.size());
  for (size_t i = 0; i < codes.size(); ++i) out[i] = e4m3_to_f32(codes[i]);
  return out;
}

void check_q(const QTensor& q, Layout want, int64_t rows, int64_t cols, const char* name,
             const char* what) {
  FLOWMOE_CHECK(q.layout == want, what << ": " << name << " is " << layout_name(q.layout)
                                       << ", expected " << layout_name(want));
  FLOWMOE_CHECK(q.rows == rows && q.cols == cols,
                what << ": " << name << " is " << q.describe() << ", expected shape [" << rows
                     << ", " << cols << "]");
  FLOWMOE_CHECK(cols % kFp8Block == 0 && (want != Layout::kWeight128x128 || rows % kFp8Block == 0),
                what << ": " << name << " " << q.describe()
                     << " does not tile into 128-wide blocks; expected multiples of 128");
  FLOWMOE_CHECK(static_cast<int64_t>(q.codes.size()) == rows * cols,
                what << ": " << name << " holds " << q.codes.size() << " code bytes, expected "
                     << rows * cols);
  FLOWMOE_CHECK(static_cast<int64_t>(q.scales.size()) == q.scale_rows() * q.scale_cols(),
                what << ": " << name << " holds " << q.scales.size() << " scales, expected "
                     << q.scale_rows() * q.scale_cols());
}

// Shared by fprop and dgrad: out[t][j] = sum over blocks b of (sum_l a[t][128b+l] * w[j][128b+l])
// * (sa[b][t] * sw[j/128][b]); a row-wise [M, C], w a weight [J, C] (fprop: W; dgrad: Wt).
void rowwise_times_weight(const QTensor& a, const std::vector<QTensor>& w, const Segments& seg,
                          int64_t j_dim, float* out) {
  const int64_t m = a.rows, c = a.cols, L = c / kFp8Block;
  const std::vector<float> ad = decode_codes(a.codes);
  for (int e = 0; e < seg.num_segments(); ++e) {
    const std::vector<float> wd = decode_codes(w[e].codes);
    for (int64_t t = seg.offsets[e]; t < seg.offsets[e + 1]; ++t) {
      const float* ar = &ad[t * c];
      for (int64_t j = 0; j < j_dim; ++j) {
        const float* wr = &wd[j * c];
        float total = 0.0f;
        for (int64_t b = 0; b < L; ++b) {
          float acc = 0.0f;
          for (int l = 0; l < kFp8Block; ++l) acc += ar[b * kFp8Block + l] * wr[b * kFp8Block + l];
          const float sa = ue8m0_to_f32(a.scales[b * m + t]);
          const float sw = ue8m0_to_f32(w[e].scales[(j / kFp8Block) * L + b]);
          total += acc * (sa * sw);
        }
        out[t * j_dim + j] = total;
      }
    }
  }
}

void check_rowwise_pass(const QTensor& a, const std::vector<QTensor>& w, const Segments& seg,
                        int64_t j_dim, const void* out, const char* aname, const char* wname,
                        const char* what) {
  FLOWMOE_CHECK(seg.num_segments() >= 1, what << ": no experts (segments empty)");
  seg.validate(a.rows);
  check_q(a, Layout::kRow1x128, a.rows, a.cols, aname, what);
  FLOWMOE_CHECK(static_cast<int>(w.size()) == seg.num_segments(),
                what << ": " << w.size() << " " << wname << " tensors for " << seg.num_segments()
                     << " experts; expected one per expert");
  for (size_t e = 0; e < w.size(); ++e) check_q(w[e], Layout::kWeight128x128, j_dim, a.cols, wname, what);
  FLOWMOE_CHECK(out != nullptr || a.rows * j_dim == 0, what << ": output pointer is null");
}

}  // namespace

void grouped_fprop_ref(const QTensor& x, const std::vector<QTensor>& w, const Segments& seg,
                       float* y) {
  const char* what = "grouped_fprop_ref";
  FLOWMOE_CHECK(!w.empty(), what << ": no weights; expected one [N, K] weight per expert");
  const int64_t n = w[0].rows;
  check_rowwise_pass(x, w, seg, n, y, "x", "w", what);
  rowwise_times_weight(x, w, seg, n, y);
}

void grouped_dgrad_ref(const QTensor& dy, const std::vector<QTensor>& wt, const Segments& seg,
                       float* dx) {
  const char* what = "grouped_dgrad_ref";
  FLOWMOE_CHECK(!wt.empty(), what << ": no weights; expected one transposed [K, N] weight per expert");
  const int64_t k = wt[0].rows;
  check_rowwise_pass(dy, wt, seg, k, dx, "dy", "wt", what);
  rowwise_times_weight(dy, wt, seg, k, dx);
}

void grouped_wgrad_ref(const QTensor& dy_col, const QTensor& x_col, float* dw, bool accumulate) {
  const char* what = "grouped_wgrad_ref";
  const int64_t m = x_col.rows, n = dy_col.cols, k = x_col.cols;
  check_q(dy_col, Layout::kCol128x1, dy_col.rows, n, "dy_col", what);
  check_q(x_col, Layout::kCol128x1, m, k, "x_col", what);
  FLOWMOE_CHECK(dy_col.rows == m, what << ": dy_col has " << dy_col.rows << " tokens, x_col "
                                       << m << "; expected the same token count");
  FLOWMOE_CHECK(dy_col.segments.offsets == x_col.segments.offsets,
                what << ": dy_col and x_col have different segments; expected the same experts");
  const Segments& seg = x_col.segments;
  FLOWMOE_CHECK(seg.num_segments() >= 1, what << ": no experts (segments empty)");
  seg.validate(m);
  const int E = seg.num_segments();
  FLOWMOE_CHECK(dw != nullptr || n * k == 0, what << ": output pointer is null");
  const std::vector<float> dyd = decode_codes(dy_col.codes), xd = decode_codes(x_col.codes);
  const std::vector<int64_t> bo = seg.block_offsets();
  for (int e = 0; e < E; ++e) {
    const int64_t off = seg.offsets[e], end = seg.offsets[e + 1];
    float* dwe = dw + static_cast<int64_t>(e) * n * k;
    for (int64_t i = 0; i < n; ++i) {
      const float* dr = &dyd[i * m];
      for (int64_t j = 0; j < k; ++j) {
        const float* xr = &xd[j * m];
        float total = 0.0f;
        for (int64_t b = bo[e]; b < bo[e + 1]; ++b) {
          const int64_t t0 = off + (b - bo[e]) * kFp8Block;
          const int64_t t1 = t0 + kFp8Block < end ? t0 + kFp8Block : end;
          float acc = 0.0f;
          for (int64_t t = t0; t < t1; ++t) acc += dr[t] * xr[t];
          total += acc * (ue8m0_to_f32(dy_col.scales[b * n + i]) * ue8m0_to_f32(x_col.scales[b * k + j]));
        }
        float& o = dwe[i * k + j];
        o = accumulate ? o + total : total;
      }
    }
  }
}

// ---- BF16 --------------------------------------------------------------------------------------
namespace {
void check_bf16_ref(const void* a, const void* b, const void* out, const Segments& seg, int64_t n,
                    int64_t k, const char* what) {
  FLOWMOE_CHECK(seg.num_segments() >= 1, what << ": no experts (segments empty)");
  seg.validate(seg.num_tokens());
  FLOWMOE_CHECK(n > 0 && k > 0, what << ": N = " << n << ", K = " << k << "; expected both > 0");
  FLOWMOE_CHECK((a && b && out) || seg.num_tokens() == 0,
                what << ": null pointer among the operands; expected host arrays");
}
std::vector<float> widen(const bf16_t* p, int64_t count) {
  std::vector<float> out(count);
  for (int64_t i = 0; i < count; ++i) out[i] = num::bf16_to_f32(p[i]);
  return out;
}
}  // namespace

void grouped_fprop_bf16_ref(const bf16_t* x, const bf16_t* w, const Segments& seg, int64_t n,
                            int64_t k, float* y) {
  check_bf16_ref(x, w, y, seg, n, k, "grouped_fprop_bf16_ref");
  const int64_t m = seg.num_tokens();
  const std::vector<float> xf = widen(x, m * k), wf = widen(w, seg.num_segments() * n * k);
  for (int e = 0; e < seg.num_segments(); ++e)
    for (int64_t t = seg.offsets[e]; t < seg.offsets[e + 1]; ++t)
      for (int64_t j = 0; j < n; ++j) {
        const float* xr = &xf[t * k];
        const float* wr = &wf[(static_cast<int64_t>(e) * n + j) * k];
        float acc = 0.0f;
        for (int64_t l = 0; l < k; ++l) acc += xr[l] * wr[l];
        y[t * n + j] = acc;
      }
}

void grouped_dgrad_bf16_ref(const bf16_t* dy, const bf16_t* w, const Segments& seg, int64_t n,
                            int64_t k, float* dx) {
  check_bf16_ref(dy, w, dx, seg, n, k, "grouped_dgrad_bf16_ref");
  const int64_t m = seg.num_tokens();
  const std::vector<float> df = widen(dy, m * n), wf = widen(w, seg.num_segments() * n * k);
  for (int e = 0; e < seg.num_segments(); ++e)
    for (int64_t t = seg.offsets[e]; t < seg.offsets[e + 1]; ++t)
      for (int64_t j = 0; j < k; ++j) {
        float acc = 0.0f;
        for (int64_t l = 0; l < n; ++l) acc += df[t * n + l] * wf[(static_cast<int64_t>(e) * n + l) * k + j];
        dx[t * k + j] = acc;
      }
}

void grouped_wgrad_bf16_ref(const bf16_t* dy, const bf16_t* x, const Segments& seg, int64_t n,
                            int64_t k, float* dw, bool accumulate) {
  check_bf16_ref(dy, x, dw, seg, n, k, "grouped_wgrad_bf16_ref");
  const int64_t m = seg.num_tokens();
  const std::vector<float> df = widen(dy, m * n), xf = widen(x, m * k);
  for (int e = 0; e < seg.num_segments(); ++e) {
    float* dwe = dw + static_cast<int64_t>(e) * n * k;
    for (int64_t i = 0; i < n; ++i)
      for (int64_t j = 0; j < k; ++j) {
        float acc = 0.0f;
        for (int64_t t = seg.offsets[e]; t < seg.offsets[e + 1]; ++t) acc += df[t * n + i] * xf[t * k + j];
        dwe[i * k + j] = accumulate ? dwe[i * k + j] + acc : acc;
      }
  }
}

}  // namespace cpu
}  // namespace flowmoe
