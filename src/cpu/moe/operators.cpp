// The arithmetic of the CPU MoE layer (src/cpu/moe/layer.h): SwiGLU with the routing probability,
// the grouped GEMMs over the padded expert segments (FP32 results rounded once to BF16), and the
// block-scaled GEMMs with FP32 scales of fp8-naive.
#include <algorithm>
#include <vector>

#include "cpu/moe/layer.h"
#include "flowmoe/gemm.h"
#include "flowmoe/numerics.h"
#include "flowmoe/expert_bias.h"
#include "flowmoe/swiglu_math.h"

namespace flowmoe {
namespace cpu_moe {

using num::bf16_to_f32;

bf16_t to_bf16(float x) { return num::bf16_canonical(x); }

std::vector<bf16_t> round_bf16(const std::vector<float>& v) {
  std::vector<bf16_t> out(v.size());
  for (size_t i = 0; i < v.size(); ++i) out[i] = to_bf16(v[i]);
  return out;
}

std::vector<float> widen(const bf16_t* v, int64_t n) {
  std::vector<float> out(n);
  for (int64_t i = 0; i < n; ++i) out[i] = bf16_to_f32(v[i]);
  return out;
}

int64_t qbytes(const QTensor& q) { return static_cast<int64_t>(q.codes.size() + q.scales.size()); }

namespace {
int64_t count_nonfinite(const float* v, int64_t n) {
  int64_t c = 0;
  for (int64_t i = 0; i < n; ++i) c += !num::f32_is_finite(v[i]);
  return c;
}
}  // namespace

// ---- SwiGLU with probabilities --------------------------------------------------------------------
int64_t swiglu_prob(const float* h, const float* row_probs, int64_t m, int64_t f, float* a,
                    const GatedActivation& act) {
  for (int64_t r = 0; r < m; ++r)
    for (int64_t j = 0; j < f; ++j)
      a[r * f + j] =
          num::f_mul(num::act_f32(act, h[r * 2 * f + j], h[r * 2 * f + f + j]), row_probs[r]);
  return count_nonfinite(a, m * f);
}

int64_t dswiglu_prob(const bf16_t* da, const float* h, const float* row_probs, int64_t m,
                     int64_t f, bf16_t* dh, float* dp, const GatedActivation& act) {
  int64_t bad = 0;
  for (int64_t r = 0; r < m; ++r) {
    float acc = 0.0f;
    for (int64_t j = 0; j < f; ++j) {
      const float g = h[r * 2 * f + j], u = h[r * 2 * f + f + j];
      const float dap = bf16_to_f32(da[r * f + j]);
      const num::SwigluGrad d = num::dact_f32(act, num::f_mul(dap, row_probs[r]), g, u);
      const float dg = d.dgate, du = d.dup;
      bad += !num::f32_is_finite(dg) + !num::f32_is_finite(du);
      dh[r * 2 * f + j] = to_bf16(dg);
      dh[r * 2 * f + f + j] = to_bf16(du);
      acc = num::f_fma(dap, num::act_f32(act, g, u), acc);
    }
    dp[r] = acc;
  }
  return bad;
}

// ---- GEMM1's bias ---------------------------------------------------------------------------------
void CpuMoeLayer::add_gemm1_bias(std::vector<bf16_t>* h) {
  if (cfg_.gemm1_bias) cpu::add_expert_bias(h->data(), Mp_, 2 * F_, route_.segments, gemm1_bias_.data());
}
void CpuMoeLayer::gemm1_bias_grad(const std::vector<bf16_t>& dh, const MoeGrads& g) {
  if (g.db1) cpu::expert_bias_grad(dh.data(), Mp_, 2 * F_, route_.segments, g.db1, g.accumulate);
}
void CpuMoeLayer::gemm1_bias_grad(const QTensor& dh_row, const MoeGrads& g) {
  if (g.db1) cpu::expert_bias_grad(dh_row, route_.segments, g.db1, g.accumulate);
}

// ---- FP32-scale block GEMMs (fp8-naive) ---------------------------------------------------------------
void fp32_scale_rowwise_gemm(const cpu::QTensorF32& a, const std::vector<cpu::QTensorF32>& w,
                             const Segments& seg, float* out) {
  const int64_t m = a.rows, c = a.cols, L = c / kFp8Block, jd = w[0].rows;
  std::vector<float> ad(a.codes.size());
  for (size_t i = 0; i < ad.size(); ++i) ad[i] = num::e4m3_to_f32(a.codes[i]);
  for (int e = 0; e < seg.num_segments(); ++e) {
    std::vector<float> wd(w[e].codes.size());
    for (size_t i = 0; i < wd.size(); ++i) wd[i] = num::e4m3_to_f32(w[e].codes[i]);
    for (int64_t t = seg.offsets[e]; t < seg.offsets[e + 1]; ++t)
      for (int64_t j = 0; j < jd; ++j) {
        float total = 0.0f;
        for (int64_t b = 0; b < L; ++b) {
          float acc = 0.0f;
          for (int l = 0; l < kFp8Block; ++l)
            acc += ad[t * c + b * kFp8Block + l] * wd[j * c + b * kFp8Block + l];
          total += acc * (a.scales[b * m + t] * w[e].scales[(j / kFp8Block) * L + b]);
        }
        out[t * jd + j] = total;
      }
  }
}

void fp32_scale_wgrad(const cpu::QTensorF32& dy, const cpu::QTensorF32& x, float* dw,
                      bool accumulate) {
  const int64_t m = x.rows, n = dy.cols, k = x.cols;
  const Segments& seg = x.segments;
  std::vector<float> dd(dy.codes.size()), xd(x.codes.size());
  for (size_t i = 0; i < dd.size(); ++i) dd[i] = num::e4m3_to_f32(dy.codes[i]);
  for (size_t i = 0; i < xd.size(); ++i) xd[i] = num::e4m3_to_f32(x.codes[i]);
  const std::vector<int64_t> bo = seg.block_offsets();
  for (int e = 0; e < seg.num_segments(); ++e) {
    const int64_t off = seg.offsets[e], end = seg.offsets[e + 1];
    float* dwe = dw + static_cast<int64_t>(e) * n * k;
    for (int64_t i = 0; i < n; ++i)
      for (int64_t j = 0; j < k; ++j) {
        float total = 0.0f;
        for (int64_t b = bo[e]; b < bo[e + 1]; ++b) {
          const int64_t t0 = off + (b - bo[e]) * kFp8Block;
          const int64_t t1 = std::min<int64_t>(t0 + kFp8Block, end);
          float acc = 0.0f;
          for (int64_t t = t0; t < t1; ++t) acc += dd[i * m + t] * xd[j * m + t];
          total += acc * (dy.scales[b * n + i] * x.scales[b * k + j]);
        }
        float& o = dwe[i * k + j];
        o = accumulate ? o + total : total;
      }
  }
}

// ---- grouped GEMMs of the layer (members: they run over the latest forward's segments) ----------------
void CpuMoeLayer::fprop_bf16(const std::vector<bf16_t>& a, const std::vector<bf16_t>& w,
                             int64_t n, int64_t k, std::vector<bf16_t>* out) {
  std::vector<float> acc(Mp_ * n);
  cpu::grouped_fprop_bf16_ref(a.data(), w.data(), route_.segments, n, k, acc.data());
  *out = round_bf16(acc);
}

void CpuMoeLayer::dgrad_bf16(const std::vector<bf16_t>& dy, const std::vector<bf16_t>& w,
                             int64_t n, int64_t k, bf16_t* out) {
  std::vector<float> acc(Mp_ * k);
  cpu::grouped_dgrad_bf16_ref(dy.data(), w.data(), route_.segments, n, k, acc.data());
  for (int64_t i = 0; i < Mp_ * k; ++i) out[i] = to_bf16(acc[i]);
}

void CpuMoeLayer::fprop_fp8(const QTensor& a, const std::vector<QTensor>& w, int64_t n,
                            std::vector<bf16_t>* out) {
  std::vector<float> acc(Mp_ * n);
  cpu::grouped_fprop_ref(a, w, route_.segments, acc.data());
  *out = round_bf16(acc);
}

void CpuMoeLayer::dgrad_fp8(const QTensor& dy, const std::vector<QTensor>& wt, int64_t k,
                            bf16_t* out) {
  std::vector<float> acc(Mp_ * k);
  cpu::grouped_dgrad_ref(dy, wt, route_.segments, acc.data());
  for (int64_t i = 0; i < Mp_ * k; ++i) out[i] = to_bf16(acc[i]);
}

void CpuMoeLayer::gemm_fp32_scale(const cpu::QTensorF32& a, const std::vector<cpu::QTensorF32>& w,
                                  int64_t n, bf16_t* out) {
  std::vector<float> acc(Mp_ * n);
  fp32_scale_rowwise_gemm(a, w, route_.segments, acc.data());
  for (int64_t i = 0; i < Mp_ * n; ++i) out[i] = to_bf16(acc[i]);
}

}  // namespace cpu_moe
}  // namespace flowmoe
