// The MoE layer on the CPU (include/flowmoe/moe.h; docs/MOE.md): the readable reference of the
// five recipes of SPEC §6, built from the CPU reference operators (flowmoe::cpu conversions,
// token.h router/permute/unpermute, the SwiGLU arithmetic of swiglu_math.h, the grouped GEMM
// references of gemm.h). Plain loops, one thread, deterministic.
//
// Every operator that converts precision is run through OpLog, which appends it to the cast report
// when it runs: the report counts what this file executes, not a table.
//
// Expert parallelism (MoeConfig::comm, a host-memory Communicator such as SimWorld's; docs/EP.md §5):
// the token movement changes and nothing else. Each rank routes its own T tokens over all E experts
// (replicated router), plans the dispatch (DispatchPlan: counts exchanged, each local expert's
// segment holds rank 0's rows, then rank 1's, ..., each in (token, slot) order, padded to A), moves
// its rows in the recipe's wire format where one rank would permute+pad, runs its El local experts
// on the padded rows exactly as one rank does, and combines the expert outputs (BF16) back to the
// token's rank where one rank would unpermute. Every step between dispatch and combine is row-wise
// or per expert segment, and the segments hold the same rows in the same order as one rank holding
// all experts over the concatenated batch, so the results are that layer's bits.
#include <algorithm>
#include <cmath>
#include <cstring>
#include <exception>
#include <string>
#include <vector>

#include "common/moe_ep.h"
#include "flowmoe/comm.h"
#include "flowmoe/cpu/convert.h"
#include "flowmoe/error.h"
#include "flowmoe/gemm.h"
#include "flowmoe/moe.h"
#include "flowmoe/numerics.h"
#include "flowmoe/swiglu_math.h"
#include "flowmoe/token.h"

namespace flowmoe {
namespace {

using num::bf16_to_f32;
using num::f32_to_bf16;

// ---- the cast log ---------------------------------------------------------------------------------
class OpLog {
 public:
  OpLog(CastReport* rep, MoePass pass) : rep_(rep), pass_(pass) {}
  void add(CastKind kind, const std::string& name, int64_t outputs, int64_t elements) {
    for (CastOp& op : rep_->ops) {
      if (op.pass == pass_ && op.kind == kind && op.name == name) {
        ++op.calls;
        op.outputs += outputs;
        op.elements += elements;
        return;
      }
    }
    CastOp op;
    op.pass = pass_;
    op.kind = kind;
    op.name = name;
    op.calls = 1;
    op.outputs = outputs;
    op.elements = elements;
    rep_->ops.push_back(op);
  }

 private:
  CastReport* rep_;
  MoePass pass_;
};

void drop_ops(CastReport* rep, MoePass p) {
  rep->ops.erase(std::remove_if(rep->ops.begin(), rep->ops.end(),
                                [p](const CastOp& op) { return op.pass == p; }),
                 rep->ops.end());
}

inline bf16_t to_bf16(float x) { return num::bf16_canonical(x); }

int64_t count_nonfinite(const float* v, int64_t n) {
  int64_t c = 0;
  for (int64_t i = 0; i < n; ++i) c += !num::f32_is_finite(v[i]);
  return c;
}

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

int64_t qbytes(const QTensor& q) {
  return static_cast<int64_t>(q.codes.size() + q.scales.size());
}

// =================================================================================================
// FP8 with FP32 scales (DeepSeek-V3 style), for the fp8-naive recipe only. The tile scale is
// s = amax / 448 in FP32 (not a power of two), q = RNE_E4M3(x / s) with the FP32 quotient. So a
// dequantize -> transpose -> quantize column copy rounds a second time (double quantization),
// which power-of-two scales avoid (docs/NUMERICS.md §8). Same layouts and scale grids as QTensor,
// scales as float. An all-zero tile gets s = 1; a tile holding a non-finite value gets s = NaN and
// codes 0x7F (counted as nonfinite).
struct F32Q {
  Layout layout = Layout::kRow1x128;
  int64_t rows = 0, cols = 0;
  std::vector<uint8_t> codes;
  std::vector<float> scales;
  Segments segments;  // column-wise only
  int64_t bytes() const { return static_cast<int64_t>(codes.size() + 4 * scales.size()); }
};

constexpr float kNanF = __builtin_nanf("");

float f32_scale(float amax) { return amax > 0.0f ? amax / num::kE4M3Max : 1.0f; }
uint8_t f32_quant(float x, float s) { return num::f32_to_e4m3(x / s); }
float f32_dequant(uint8_t c, float s) {
  if (num::e4m3_is_nan(c) || std::isnan(s)) return kNanF;
  return num::e4m3_to_f32(c) * s;
}

// Quantizes `n` values v(i) into codes at out(i) with one FP32 scale; returns the scale.
template <typename Get, typename Put>
float f32_tile(int64_t n, Get v, Put out, QuantStats* st) {
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
    for (int64_t i = 0; i < n; ++i) out(i, num::kE4M3NaN);
    return kNanF;
  }
  const float s = f32_scale(amax);
  for (int64_t i = 0; i < n; ++i) out(i, f32_quant(v(i), s));
  return s;
}

// x [M, K] bf16 -> row-wise 1x128, scales [K/128][M].
QuantStats f32q_row(const bf16_t* x, int64_t m, int64_t k, F32Q* q) {
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
      q->scales[b * m + t] = f32_tile(
          kFp8Block, [&](int64_t i) { return bf16_to_f32(x[base + i]); },
          [&](int64_t i, uint8_t c) { q->codes[base + i] = c; }, &st);
    }
  return st;
}

// x [M, K] bf16 -> column-wise 128x1 over the segments: codes [K, M], scales [NB][K].
QuantStats f32q_col(const bf16_t* x, int64_t m, int64_t k, const Segments& seg, F32Q* q) {
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
        q->scales[blk * k + c] = f32_tile(
            t1 - t0, [&](int64_t i) { return bf16_to_f32(x[(t0 + i) * k + c]); },
            [&](int64_t i, uint8_t code) { q->codes[c * m + t0 + i] = code; }, &st);
    }
  return st;
}

// w [N, K] bf16 -> 128x128 blocks, scales [N/128][K/128]; wt receives the exact transpose.
QuantStats f32q_weight(const bf16_t* w, int64_t n, int64_t k, F32Q* q, F32Q* wt) {
  QuantStats st;
  const int64_t nb = n / kFp8Block, kb = k / kFp8Block;
  q->layout = Layout::kWeight128x128;
  q->rows = n;
  q->cols = k;
  q->codes.assign(n * k, 0);
  q->scales.assign(nb * kb, 1.0f);
  for (int64_t bi = 0; bi < nb; ++bi)
    for (int64_t bj = 0; bj < kb; ++bj) {
      auto idx = [&](int64_t i) {
        return (bi * kFp8Block + i / kFp8Block) * k + bj * kFp8Block + i % kFp8Block;
      };
      q->scales[bi * kb + bj] = f32_tile(
          kFp8Block * kFp8Block, [&](int64_t i) { return bf16_to_f32(w[idx(i)]); },
          [&](int64_t i, uint8_t c) { q->codes[idx(i)] = c; }, &st);
    }
  wt->layout = Layout::kWeight128x128;
  wt->rows = k;
  wt->cols = n;
  wt->codes.assign(n * k, 0);
  wt->scales.assign(nb * kb, 1.0f);
  for (int64_t i = 0; i < n; ++i)
    for (int64_t j = 0; j < k; ++j) wt->codes[j * n + i] = q->codes[i * k + j];
  for (int64_t bi = 0; bi < nb; ++bi)
    for (int64_t bj = 0; bj < kb; ++bj) wt->scales[bj * nb + bi] = q->scales[bi * kb + bj];
  return st;
}

// Decoded logical [rows, cols] values (column-wise tensors come back as [M, K]).
std::vector<float> f32q_decode(const F32Q& q) {
  std::vector<float> out(q.rows * q.cols);
  const int64_t m = q.rows, k = q.cols;
  if (q.layout == Layout::kRow1x128) {
    for (int64_t t = 0; t < m; ++t)
      for (int64_t c = 0; c < k; ++c)
        out[t * k + c] = f32_dequant(q.codes[t * k + c], q.scales[(c / kFp8Block) * m + t]);
  } else if (q.layout == Layout::kCol128x1) {
    int64_t blk = 0;
    const Segments& seg = q.segments;
    for (int e = 0; e < seg.num_segments(); ++e)
      for (int64_t t0 = seg.offsets[e]; t0 < seg.offsets[e + 1]; t0 += kFp8Block, ++blk) {
        const int64_t t1 = std::min<int64_t>(t0 + kFp8Block, seg.offsets[e + 1]);
        for (int64_t t = t0; t < t1; ++t)
          for (int64_t c = 0; c < k; ++c)
            out[t * k + c] = f32_dequant(q.codes[c * m + t], q.scales[blk * k + c]);
      }
  } else {
    FLOWMOE_CHECK(false, "f32q_decode: unsupported layout " << layout_name(q.layout));
  }
  return out;
}

// Dequantize to BF16 (what the naive path hands to the next BF16 operator).
std::vector<bf16_t> f32q_dequant_bf16(const F32Q& q) { return round_bf16(f32q_decode(q)); }

// Block-scaled GEMMs with FP32 scales, summed exactly like cpu::grouped_*_ref: per output element
// and 128-wide contraction block, decoded code products summed in FP32 in index order, the block
// sum times (scale_a * scale_b), block results summed in FP32 in block order.
// a row-wise [M, C]; w: E weights [J, C] (fprop: W [N, K]; dgrad: Wt [K, N]); out [M, J].
void f32q_rowwise_gemm(const F32Q& a, const std::vector<F32Q>& w, const Segments& seg,
                       float* out) {
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

// dy_col [N over M], x_col [K over M] (same segments) -> dw [E][N][K] (+= when accumulate).
void f32q_wgrad(const F32Q& dy, const F32Q& x, float* dw, bool accumulate) {
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

// =================================================================================================
// SwiGLU with the routing probability applied to its output (Megatron-Core's activation with
// probs), in binary32 with the shared arithmetic of swiglu_math.h.
//   forward   a'[r, j] = p_r * (silu(g) * u)                      g = h[r, j], u = h[r, F + j]
//   backward  with da'[r, j] given (BF16, GEMM2's dgrad):
//             da          = p_r * da'                             (binary32, not rounded)
//             dgate, dup  = dswiglu_f32(da, g, u)                 (then BF16, RNE)
//             dp_r        = sum_j da'[r, j] * (silu(g) * u)       (FP32, fma in j order)
// Padding rows have p = 0 and h = 0 and give zeros.

// h [M, 2F] as binary32 values -> a [M, F] binary32; returns the non-finite outputs.
int64_t swiglu_prob(const float* h, const float* prow, int64_t m, int64_t f, float* a) {
  for (int64_t r = 0; r < m; ++r)
    for (int64_t j = 0; j < f; ++j)
      a[r * f + j] = num::f_mul(num::swiglu_f32(h[r * 2 * f + j], h[r * 2 * f + f + j]), prow[r]);
  return count_nonfinite(a, m * f);
}

// da [M, F] bf16, h [M, 2F] binary32 -> dh [M, 2F] bf16, dp [M] fp32; returns non-finite dh.
int64_t dswiglu_prob(const bf16_t* da, const float* h, const float* prow, int64_t m, int64_t f,
                     bf16_t* dh, float* dp) {
  int64_t bad = 0;
  for (int64_t r = 0; r < m; ++r) {
    float acc = 0.0f;
    for (int64_t j = 0; j < f; ++j) {
      const float g = h[r * 2 * f + j], u = h[r * 2 * f + f + j];
      const float dap = bf16_to_f32(da[r * f + j]);
      const num::SwigluGrad d = num::dswiglu_f32(num::f_mul(dap, prow[r]), g, u);
      const float dg = d.dgate, du = d.dup;
      bad += !num::f32_is_finite(dg) + !num::f32_is_finite(du);
      dh[r * 2 * f + j] = to_bf16(dg);
      dh[r * 2 * f + f + j] = to_bf16(du);
      acc = num::f_fma(dap, num::swiglu_f32(g, u), acc);
    }
    dp[r] = acc;
  }
  return bad;
}

// ---- comparison of a wgrad column operand with its row-wise twin ----------------------------------
ColumnCheck compare_columns(const std::string& name, const std::string& method,
                            const std::vector<float>& row, const std::vector<float>& col,
                            const cpu::Routing& r, int64_t c, int64_t underflow) {
  ColumnCheck cc;
  cc.name = name;
  cc.method = method;
  cc.underflow = underflow;
  for (int e = 0; e < r.num_experts; ++e)
    for (int64_t t = r.padded_offsets[e]; t < r.padded_offsets[e] + r.counts[e]; ++t)
      for (int64_t j = 0; j < c; ++j) {
        const float a = row[t * c + j], b = col[t * c + j];
        ++cc.elements;
        if (!(a == b || (std::isnan(a) && std::isnan(b)))) ++cc.differ;
      }
  return cc;
}

std::vector<float> decode(const QTensor& q) {
  std::vector<float> out(q.rows * q.cols);
  cpu::dequantize(q, out.data());
  return out;
}

// =================================================================================================
class CpuMoeLayer final : public MoeLayer {
 public:
  explicit CpuMoeLayer(const MoeConfig& cfg)
      : MoeLayer(cfg), E_(cfg.num_experts), El_(cfg.num_local_experts()), H_(cfg.hidden),
        F_(cfg.ffn), K_(cfg.topk), comm_(cfg.comm) {
    rep_.recipe = cfg.recipe;
    // Host workspaces for cfg.max_tokens (the reference operators still allocate their outputs).
    const int64_t R = cfg.max_rows();
    x_.reserve(cfg.max_tokens * H_);
    logits_.reserve(cfg.max_tokens * E_);
    prow_.reserve(R);
  }

  const char* backend() const override { return "cpu"; }

  void set_weights(const MoeWeights& w) override {
    const char* what = "MoeLayer::set_weights";
    FLOWMOE_CHECK(w.w1 && w.w2 && w.wr,
                  what << ": w1, w2 and wr must be non-null host pointers (W1 [El, 2F, H], W2 "
                          "[El, H, F] of the El = "
                       << El_ << " local experts, Wr [E, H] fp32)");
    // W1, W2: this rank's El local experts (El = E on a single rank); Wr: all E (replicated).
    const int64_t n1 = int64_t(El_) * 2 * F_ * H_, n2 = int64_t(El_) * H_ * F_;
    check_finite(w.w1, n1, "W1");
    check_finite(w.w2, n2, "W2");
    check_finite(w.wr, int64_t(E_) * H_, "Wr");
    wr_.assign(w.wr, w.wr + int64_t(E_) * H_);
    has_bias_ = w.router_bias != nullptr;
    if (has_bias_) bias_.assign(w.router_bias, w.router_bias + E_);
    w1b_.resize(n1);
    w2b_.resize(n2);
    for (int64_t i = 0; i < n1; ++i) w1b_[i] = f32_to_bf16(w.w1[i]);
    for (int64_t i = 0; i < n2; ++i) w2b_[i] = f32_to_bf16(w.w2[i]);

    drop_ops(&rep_, MoePass::kWeightUpdate);
    OpLog log(&rep_, MoePass::kWeightUpdate);
    const Recipe rc = cfg_.recipe;
    if (rc == Recipe::kBlockwise || rc == Recipe::kFlow || rc == Recipe::kFlowFp4) {
      w1q_.assign(El_, QTensor());
      w1t_.assign(El_, QTensor());
      w2q_.assign(El_, QTensor());
      w2t_.assign(El_, QTensor());
      for (int e = 0; e < El_; ++e) {
        cpu::quantize_weight(&w1b_[e * 2 * F_ * H_], 2 * F_, H_, &w1q_[e], &w1t_[e]);
        cpu::quantize_weight(&w2b_[e * H_ * F_], H_, F_, &w2q_[e], &w2t_[e]);
      }
      log.add(CastKind::kQuantize, "quantize W1 (128x128 + exact transpose)", 2, n1);
      log.add(CastKind::kQuantize, "quantize W2 (128x128 + exact transpose)", 2, n2);
    } else if (rc == Recipe::kFp8Naive) {
      w1n_.assign(El_, F32Q());
      w1nt_.assign(El_, F32Q());
      w2n_.assign(El_, F32Q());
      w2nt_.assign(El_, F32Q());
      for (int e = 0; e < El_; ++e) {
        f32q_weight(&w1b_[e * 2 * F_ * H_], 2 * F_, H_, &w1n_[e], &w1nt_[e]);
        f32q_weight(&w2b_[e * H_ * F_], H_, F_, &w2n_[e], &w2nt_[e]);
      }
      log.add(CastKind::kQuantize, "quantize W1 (128x128 FP32 scales + exact transpose)", 2, n1);
      log.add(CastKind::kQuantize, "quantize W2 (128x128 FP32 scales + exact transpose)", 2, n2);
    }
    have_weights_ = true;
  }

  void forward(const bf16_t* x, int64_t tokens, bf16_t* y) override {
    const char* what = "MoeLayer::forward";
    collective_checks(comm_, what, [&] {
      FLOWMOE_CHECK(have_weights_, what << ": no weights; call set_weights first");
      FLOWMOE_CHECK(tokens >= 1 && tokens <= cfg_.max_tokens,
                    what << ": T = " << tokens << " tokens; expected 1 <= T <= max_tokens = "
                         << cfg_.max_tokens);
      FLOWMOE_CHECK(x && y, what << ": x and y must be non-null host pointers to [T, H] bf16");
    });
    T_ = tokens;
    have_forward_ = false;
    drop_ops(&rep_, MoePass::kForward);
    drop_ops(&rep_, MoePass::kBackward);
    rep_.saved.clear();
    rep_.columns.clear();
    rep_.wire.clear();
    rep_.forward_stats = QuantStats();
    rep_.backward_stats = QuantStats();
    status_ = MoeStatus();
    QuantStats& st = rep_.forward_stats;

    route(x, &st);
    switch (cfg_.recipe) {
      case Recipe::kBf16: forward_bf16(y, &st); break;
      case Recipe::kBlockwise: forward_blockwise(y, &st); break;
      case Recipe::kFp8Naive: forward_naive(y, &st); break;
      case Recipe::kFlow:
      case Recipe::kFlowFp4: forward_flow(y, &st); break;
    }
    save_routing_state();
    forward_columns_ = rep_.columns.size();
    status_.nonfinite = st.nonfinite;
    status_.underflow = st.underflow;
    status_.aux_loss = aux_loss_;
    have_forward_ = true;
  }

  void backward(const bf16_t* dy, bf16_t* dx, const MoeGrads& g) override {
    const char* what = "MoeLayer::backward";
    collective_checks(comm_, what, [&] {
      FLOWMOE_CHECK(have_forward_, what << ": no saved forward; call forward first (backward "
                                           "consumes the activations of the latest forward)");
      FLOWMOE_CHECK(dy && dx, what << ": dy and dx must be non-null host pointers to [T, H] bf16");
    });
    drop_ops(&rep_, MoePass::kBackward);
    rep_.wire.erase(std::remove_if(rep_.wire.begin(), rep_.wire.end(),
                                   [](const WireTransfer& w) { return w.pass == MoePass::kBackward; }),
                    rep_.wire.end());
    rep_.columns.resize(forward_columns_);  // drop the checks of an earlier backward
    rep_.backward_stats = QuantStats();
    QuantStats& st = rep_.backward_stats;
    // expert path: dXp [Mp, H] bf16, dp [Mp] fp32
    std::vector<bf16_t> dxp(Mp_ * H_);
    std::vector<float> dp(Mp_, 0.0f);
    switch (cfg_.recipe) {
      case Recipe::kBf16: backward_bf16(dy, g, dxp.data(), dp.data(), &st); break;
      case Recipe::kBlockwise: backward_blockwise(dy, g, dxp.data(), dp.data(), &st); break;
      case Recipe::kFp8Naive: backward_naive(dy, g, dxp.data(), dp.data(), &st); break;
      case Recipe::kFlow:
      case Recipe::kFlowFp4: backward_flow(dy, g, dxp.data(), dp.data(), &st); break;
    }
    backward_router(dxp, dp, g, dx);
    status_.nonfinite += st.nonfinite;
    status_.underflow += st.underflow;
  }

  const CastReport& cast_report() const override { return rep_; }
  MoeStatus status() const override { return status_; }

 private:
  static void check_finite(const float* v, int64_t n, const char* name) {
    for (int64_t i = 0; i < n; ++i)
      if (!num::f32_is_finite(v[i]))
        throw NonFiniteError(__FILE__, __LINE__,
                             std::string("MoeLayer::set_weights: ") + name +
                                 " holds a non-finite value at element " + std::to_string(i) +
                                 "; expected finite weights");
  }

  Segments padded_segments() const {
    Segments s;
    s.offsets = r_.padded_offsets;
    return s;
  }


  // ---- router and routing (the same in every recipe: FP32 from the BF16 input) ----------------
  void route(const bf16_t* x, QuantStats* st) {
    const int64_t T = T_;
    x_.assign(x, x + T * H_);
    // logits[t, e] = sum_h x[t, h] * Wr[e, h]: FP32 fma in h order.
    logits_.assign(T * E_, 0.0f);
    for (int64_t t = 0; t < T; ++t)
      for (int e = 0; e < E_; ++e) {
        float acc = 0.0f;
        const float* w = &wr_[int64_t(e) * H_];
        for (int64_t h = 0; h < H_; ++h) acc = std::fma(bf16_to_f32(x[t * H_ + h]), w[h], acc);
        logits_[t * E_ + e] = acc;
      }
    const RouterConfig rc = cfg_.router_config();
    ids_.assign(T * K_, 0);
    probs_.assign(T * K_, 0.0f);
    st->nonfinite += cpu::router_forward(logits_.data(), T, rc, has_bias_ ? bias_.data() : nullptr,
                                         ids_.data(), probs_.data());
    aux_loss_ = 0.0f;
    aux_coef_.clear();
    if (cfg_.aux_loss_alpha > 0.0f) {
      aux_coef_.assign(E_, 0.0f);
      aux_loss_ = cpu::router_aux_loss(logits_.data(), ids_.data(), T, rc, cfg_.aux_loss_alpha,
                                       aux_coef_.data());
    }
    if (comm_ == nullptr) {
      r_ = cpu::build_routing(ids_.data(), T, K_, E_, cfg_.align);
      seg_ = padded_segments();
      Mp_ = r_.padded_rows();
      prow_.assign(Mp_, 0.0f);
      for (int64_t i = 0; i < T * K_; ++i)
        if (r_.row_map[i] >= 0) prow_[r_.row_map[i]] = probs_[i];
      rep_.routed_rows = r_.routed_rows();
    } else {
      // Expert parallelism: the plan (collective: configuration check, count all-to-all). The
      // forward dispatch moves each row's probability with it into prow_ (0 on padding rows).
      EpConfig ec;
      ec.num_experts = E_;
      ec.topk = K_;
      ec.hidden = H_;
      ec.align = cfg_.align;
      ec.format = forward_wire_format();
      ec.with_probs = true;
      plan_ = plan_dispatch(*comm_, ec, ids_.data(), T);
      // r_ describes this rank's El local expert segments (counts, offsets, padded offsets; no
      // token map: the send side's map is plan_.send_routing).
      r_ = cpu::Routing();
      r_.tokens = 0;
      r_.topk = K_;
      r_.num_experts = El_;
      r_.align = cfg_.align;
      r_.counts = plan_.expert_counts;
      r_.offsets.assign(El_ + 1, 0);
      for (int l = 0; l < El_; ++l) r_.offsets[l + 1] = r_.offsets[l] + r_.counts[l];
      r_.padded_offsets = plan_.padded_offsets;
      seg_ = padded_segments();
      Mp_ = r_.padded_rows();
      prow_.assign(Mp_, 0.0f);
      rep_.routed_rows = plan_.send_routing.routed_rows();
    }
    rep_.tokens = T;
    rep_.padded_rows = Mp_;
  }

  WireFormat forward_wire_format() const { return ep_detail::forward_wire_format(cfg_.recipe); }
  DispatchPlan plan_for(MoePass pass, WireFormat f) const { return ep_detail::plan_for(plan_, pass, f); }
  void log_dispatch(MoePass pass, const std::string& name, const DispatchPlan& p) {
    rep_.wire.push_back(ep_detail::dispatch_transfer(pass, name, p));
  }
  void log_combine(MoePass pass, const std::string& name, const std::string& format, int64_t row_bytes) {
    rep_.wire.push_back(ep_detail::combine_transfer(pass, name, format, row_bytes, plan_));
  }

  // token rows [T, H] bf16 -> padded rows [Mp, H] bf16 of the local experts
  void permute_bf16(const bf16_t* tok, bf16_t* rows, MoePass pass, const char* name) {
    if (comm_ == nullptr) {
      cpu::permute_pad_bf16(tok, H_, r_, rows);
      return;
    }
    const DispatchPlan p = plan_for(pass, WireFormat::kBf16);
    const bool fwd = pass == MoePass::kForward;
    ep_dispatch_bf16(*comm_, p, tok, fwd ? probs_.data() : nullptr, rows,
                     fwd ? prow_.data() : nullptr);
    log_dispatch(pass, name, p);
  }

  // padded expert output rows [Mp, H] bf16 -> y [T, H] bf16 (plain sum in slot order)
  void unpermute_bf16(const std::vector<bf16_t>& rows, bf16_t* tok) {
    if (comm_ == nullptr) {
      cpu::unpermute_unpad(rows.data(), nullptr, H_, r_, tok);
      return;
    }
    ep_combine_bf16(*comm_, plan_, rows.data(), nullptr, tok);
    log_combine(MoePass::kForward, "combine expert output rows", "bf16", 2 * H_);
  }

  // MXFP4 token rows (codes [T, H/2], scales [T][H/32]) -> xp_fp4_ [Mp, H] MXFP4 (forward)
  void permute_mxfp4(const QTensor& q) {
    if (comm_ == nullptr) {
      cpu::permute_pad_mxfp4(q.codes.data(), q.scales.data(), H_, r_, xp_fp4_.codes.data(),
                             xp_fp4_.scales.data());
      return;
    }
    const DispatchPlan p = plan_for(MoePass::kForward, WireFormat::kMxfp4);
    ep_dispatch_mxfp4(*comm_, p, q.codes.data(), q.scales.data(), probs_.data(),
                      xp_fp4_.codes.data(), xp_fp4_.scales.data(), prow_.data());
    log_dispatch(MoePass::kForward, "dispatch x", p);
  }

  // fp8-naive with EP: the FP8 codes and FP32 scales of token rows q [T, H] travel (wire format
  // fp8-fp32scale), then the received rows are dequantized to BF16 rows [Mp, H] (padding rows 0).
  // Dequantization is element-wise, so dequantizing the moved rows gives the bits one rank gets by
  // dequantizing the tokens and permuting them. Returns the elements dequantized.
  int64_t dispatch_naive(const F32Q& q, MoePass pass, const char* name, bf16_t* rows) {
    const DispatchPlan p = plan_for(pass, WireFormat::kFp8Fp32Scale);
    const bool fwd = pass == MoePass::kForward;
    const int64_t nc = H_ / kFp8Block, n = p.send_rows(), T = T_;
    const cpu::Routing& sr = p.send_routing;
    // send order; scales row-major [rows][H/128] next to their codes (as ep_dispatch_fp8)
    std::vector<uint8_t> sc(n * H_);
    std::vector<float> ss(n * nc), sp(fwd ? n : 0);
    for (int64_t t = 0; t < T; ++t)
      for (int s = 0; s < K_; ++s) {
        const int32_t row = sr.row_map[t * K_ + s];
        if (row < 0) continue;
        std::memcpy(&sc[row * H_], &q.codes[t * H_], H_);
        for (int64_t c = 0; c < nc; ++c) ss[row * nc + c] = q.scales[c * T + t];
        if (fwd) sp[row] = probs_[t * K_ + s];
      }
    std::vector<uint8_t> rc(Mp_ * H_, 0);
    std::vector<float> rs(Mp_ * nc, 0.0f);
    std::vector<RowStream> streams = {{sc.data(), rc.data(), H_},
                                      {ss.data(), rs.data(), int64_t(sizeof(float)) * nc}};
    if (fwd) streams.push_back({sp.data(), prow_.data(), int64_t(sizeof(float))});
    dispatch_rows(*comm_, p, streams);  // padding rows are not written: rc, rs, prow_ stay 0
    log_dispatch(pass, name, p);
    int64_t elements = 0;
    for (int l = 0; l < El_; ++l)
      for (int64_t row = r_.padded_offsets[l]; row < r_.padded_offsets[l] + r_.counts[l]; ++row) {
        for (int64_t c = 0; c < H_; ++c)
          rows[row * H_ + c] = to_bf16(f32_dequant(rc[row * H_ + c], rs[row * nc + c / kFp8Block]));
        elements += H_;
      }
    return elements;
  }

  // ---- saved-tensor bookkeeping --------------------------------------------------------------
  // per_row: bytes of one row (codes + row scales); the unpadded figure counts routed rows only.
  void save_rows(const std::string& name, const std::string& format, int64_t bytes,
                 double per_row) {
    SavedTensor s;
    s.name = name;
    s.format = format;
    s.bytes = bytes;
    // the rows this rank holds: its routed rows (one rank) or the rows its El experts received
    s.bytes_per_token_unpadded = per_row * double(r_.routed_rows()) / double(T_);
    rep_.saved.push_back(s);
  }
  void save_tokens(const std::string& name, const std::string& format, int64_t bytes) {
    SavedTensor s;
    s.name = name;
    s.format = format;
    s.bytes = bytes;
    s.bytes_per_token_unpadded = double(bytes) / double(T_);
    rep_.saved.push_back(s);
  }
  void save_routing_state() {
    save_tokens("router input x", "bf16 [T, H]", T_ * H_ * 2);
    save_tokens("router logits", "fp32 [T, E]", T_ * E_ * 4);
    save_tokens("expert ids + probs + row map", "int32/fp32/int32 [T, k]", T_ * K_ * 12);
  }
  // Per-row byte costs of the formats.
  static double fp8_row(int64_t c) { return double(c) + double(c) / kFp8Block; }
  static double fp8_row_f32s(int64_t c) { return double(c) + 4.0 * double(c) / kFp8Block; }
  static double mxfp4_row(int64_t c) { return double(c) / 2 + double(c) / kFp4Block; }

  std::string dims(const char* rows, const char* cols) const {
    return std::string("[") + rows + ", " + cols + "]";
  }

  // ---- GEMM helpers (FP32 results rounded once to BF16) --------------------------------------
  void fprop_bf16(const std::vector<bf16_t>& a, const std::vector<bf16_t>& w, int64_t n,
                  int64_t k, std::vector<bf16_t>* out) {
    std::vector<float> acc(Mp_ * n);
    cpu::grouped_fprop_bf16_ref(a.data(), w.data(), seg_, n, k, acc.data());
    *out = round_bf16(acc);
  }
  void dgrad_bf16(const std::vector<bf16_t>& dy, const std::vector<bf16_t>& w, int64_t n,
                  int64_t k, bf16_t* out) {
    std::vector<float> acc(Mp_ * k);
    cpu::grouped_dgrad_bf16_ref(dy.data(), w.data(), seg_, n, k, acc.data());
    for (int64_t i = 0; i < Mp_ * k; ++i) out[i] = to_bf16(acc[i]);
  }
  void fprop_fp8(const QTensor& a, const std::vector<QTensor>& w, int64_t n,
                 std::vector<bf16_t>* out) {
    std::vector<float> acc(Mp_ * n);
    cpu::grouped_fprop_ref(a, w, seg_, acc.data());
    *out = round_bf16(acc);
  }
  void dgrad_fp8(const QTensor& dy, const std::vector<QTensor>& wt, int64_t k, bf16_t* out) {
    std::vector<float> acc(Mp_ * k);
    cpu::grouped_dgrad_ref(dy, wt, seg_, acc.data());
    for (int64_t i = 0; i < Mp_ * k; ++i) out[i] = to_bf16(acc[i]);
  }
  void fprop_f32q(const F32Q& a, const std::vector<F32Q>& w, int64_t n, bf16_t* out) {
    std::vector<float> acc(Mp_ * n);
    f32q_rowwise_gemm(a, w, seg_, acc.data());
    for (int64_t i = 0; i < Mp_ * n; ++i) out[i] = to_bf16(acc[i]);
  }

  // ---- forward, per recipe ----------------------------------------------------------------------
  // bf16: BF16 operands, FP32 accumulation.
  void forward_bf16(bf16_t* y, QuantStats* st) {
    xp_.assign(Mp_ * H_, 0);
    permute_bf16(x_.data(), xp_.data(), MoePass::kForward, "dispatch x");
    fprop_bf16(xp_, w1b_, 2 * F_, H_, &h1_);
    std::vector<float> a(Mp_ * F_);
    st->nonfinite += swiglu_prob(widen(h1_.data(), Mp_ * 2 * F_).data(), prow_.data(), Mp_, F_,
                                 a.data());
    a_bf16_ = round_bf16(a);
    std::vector<bf16_t> o;
    fprop_bf16(a_bf16_, w2b_, H_, F_, &o);
    unpermute_bf16(o, y);
    save_rows("GEMM1 input x_perm", "bf16 [Mp, H]", Mp_ * H_ * 2, 2.0 * H_);
    save_rows("GEMM1 output h", "bf16 [Mp, 2F]", Mp_ * 2 * F_ * 2, 4.0 * F_);
    save_rows("GEMM2 input a'", "bf16 [Mp, F]", Mp_ * F_ * 2, 2.0 * F_);
  }

  // blockwise: BF16 dataflow; each grouped linear quantizes its BF16 input, row and column copies.
  void forward_blockwise(bf16_t* y, QuantStats* st) {
    OpLog log(&rep_, MoePass::kForward);
    std::vector<bf16_t> xp(Mp_ * H_);
    permute_bf16(x_.data(), xp.data(), MoePass::kForward, "dispatch x");
    QTensor xr;
    *st += cpu::quantize_both(xp.data(), Mp_, H_, seg_, &xr, &xc_);
    log.add(CastKind::kQuantize, "quantize x_perm (row + col, from BF16)", 2, Mp_ * H_);
    fprop_fp8(xr, w1q_, 2 * F_, &h1_);
    std::vector<float> a(Mp_ * F_);
    st->nonfinite += swiglu_prob(widen(h1_.data(), Mp_ * 2 * F_).data(), prow_.data(), Mp_, F_,
                                 a.data());
    const std::vector<bf16_t> ab = round_bf16(a);
    QTensor ar;
    *st += cpu::quantize_both(ab.data(), Mp_, F_, seg_, &ar, &ac_);
    log.add(CastKind::kQuantize, "quantize a' (row + col, from BF16)", 2, Mp_ * F_);
    std::vector<bf16_t> o;
    fprop_fp8(ar, w2q_, H_, &o);
    unpermute_bf16(o, y);
    save_rows("GEMM1 input x_perm (wgrad copy)", "fp8 col 128x1 [Mp, H]", qbytes(xc_),
              fp8_row(H_));
    save_rows("GEMM1 output h", "bf16 [Mp, 2F]", Mp_ * 2 * F_ * 2, 4.0 * F_);
    save_rows("GEMM2 input a' (wgrad copy)", "fp8 col 128x1 [Mp, F]", qbytes(ac_), fp8_row(F_));
    if (cfg_.check_columns) {
      rep_.columns.push_back(compare_columns("GEMM1 input x_perm", "quantize col from BF16",
                                             decode(xr), decode(xc_), r_, H_, 0));
      rep_.columns.push_back(compare_columns("GEMM2 input a'", "quantize col from BF16",
                                             decode(ar), decode(ac_), r_, F_, 0));
    }
  }

  // fp8-naive: DeepSeek-V3-style substitution with FP32 scales: FP8 dispatch (quantize before,
  // dequantize after), each FP8 GEMM quantizes its BF16 input row-wise; BF16 between operators.
  void forward_naive(bf16_t* y, QuantStats* st) {
    OpLog log(&rep_, MoePass::kForward);
    F32Q xq;
    *st += f32q_row(x_.data(), T_, H_, &xq);
    log.add(CastKind::kQuantize, "quantize x (row, FP32 scales, before dispatch)", 1, T_ * H_);
    std::vector<bf16_t> xp(Mp_ * H_);
    if (comm_ == nullptr) {
      // dispatch: identity on a single rank; the FP8 payload is what would travel
      const std::vector<bf16_t> xd = f32q_dequant_bf16(xq);
      log.add(CastKind::kDequantize, "dequantize x (after dispatch)", 1, T_ * H_);
      cpu::permute_pad_bf16(xd.data(), H_, r_, xp.data());
    } else {
      const int64_t n = dispatch_naive(xq, MoePass::kForward, "dispatch x", xp.data());
      log.add(CastKind::kDequantize, "dequantize x (after dispatch)", 1, n);
    }
    *st += f32q_row(xp.data(), Mp_, H_, &xn_);
    log.add(CastKind::kQuantize, "quantize x_perm (row, FP32 scales)", 1, Mp_ * H_);
    h1_.assign(Mp_ * 2 * F_, 0);
    fprop_f32q(xn_, w1n_, 2 * F_, h1_.data());
    std::vector<float> a(Mp_ * F_);
    st->nonfinite += swiglu_prob(widen(h1_.data(), Mp_ * 2 * F_).data(), prow_.data(), Mp_, F_,
                                 a.data());
    const std::vector<bf16_t> ab = round_bf16(a);
    *st += f32q_row(ab.data(), Mp_, F_, &an_);
    log.add(CastKind::kQuantize, "quantize a' (row, FP32 scales)", 1, Mp_ * F_);
    std::vector<bf16_t> o(Mp_ * H_);
    fprop_f32q(an_, w2n_, H_, o.data());
    unpermute_bf16(o, y);
    save_rows("GEMM1 input x_perm", "fp8 row 1x128 fp32-scale [Mp, H]", xn_.bytes(),
              fp8_row_f32s(H_));
    save_rows("GEMM1 output h", "bf16 [Mp, 2F]", Mp_ * 2 * F_ * 2, 4.0 * F_);
    save_rows("GEMM2 input a'", "fp8 row 1x128 fp32-scale [Mp, F]", an_.bytes(),
              fp8_row_f32s(F_));
  }

  // flow / flow-fp4: quantize once at the entry, permute in FP8 (MXFP4), fused SwiGLU+quant,
  // activations saved quantized.
  void forward_flow(bf16_t* y, QuantStats* st) {
    OpLog log(&rep_, MoePass::kForward);
    const bool fp4 = cfg_.recipe == Recipe::kFlowFp4;
    QTensor xr;
    if (!fp4) {
      QTensor xq;
      *st += cpu::quantize_row(x_.data(), T_, H_, &xq);
      log.add(CastKind::kQuantize, "quantize x (row 1x128, entry)", 1, T_ * H_);
      // dispatch: identity on a single rank, FP8 payload
      permute_fp8(xq, &xp_row_, MoePass::kForward, "dispatch x");
      xr = xp_row_;
    } else {
      QTensor xq;
      *st += cpu::quantize_mxfp4(x_.data(), T_, H_, &xq);
      log.add(CastKind::kQuantize, "quantize x (MXFP4 1x32, entry)", 1, T_ * H_);
      xp_fp4_.layout = Layout::kMxfp4Row1x32;
      xp_fp4_.rows = Mp_;
      xp_fp4_.cols = H_;
      xp_fp4_.segments = Segments();
      xp_fp4_.codes.assign(Mp_ * H_ / 2, 0);
      xp_fp4_.scales.assign(Mp_ * H_ / kFp4Block, 0);
      permute_mxfp4(xq);
      *st += cpu::fp4_to_fp8_row(xp_fp4_, &xr);
      log.add(CastKind::kConvert, "FP4RowToFP8Row x_perm (GEMM1 input)", 1, Mp_ * H_);
      if (cfg_.check_columns) xp_row_ = xr;  // kept only to compare with the wgrad copy
    }
    fprop_fp8(xr, w1q_, 2 * F_, &h1_);
    // fused SwiGLU * prob + quantize: a' row-wise (GEMM2 input), a' column-wise (its wgrad copy,
    // = scaling-aware transpose of the row-wise tiles), h row-wise (saved for dSwiGLU)
    std::vector<float> a(Mp_ * F_);
    st->nonfinite += swiglu_prob(widen(h1_.data(), Mp_ * 2 * F_).data(), prow_.data(), Mp_, F_,
                                 a.data());
    QTensor ar;
    QuantStats qa = cpu::quantize_row(a.data(), Mp_, F_, &ar);
    qa.nonfinite = 0;  // already counted by swiglu_prob (each value once)
    *st += qa;
    const QuantStats tr = cpu::scaling_aware_transpose(ar, seg_, &ac_, cfg_.transpose_exponent);
    st->underflow += tr.underflow;
    // h saved for dSwiGLU: row-wise FP8 (flow) or MXFP4 1x32 (flow-fp4: FP4 saved activations)
    if (!fp4) *st += cpu::quantize_row(h1_.data(), Mp_, 2 * F_, &h_row_);
    else *st += cpu::quantize_mxfp4(h1_.data(), Mp_, 2 * F_, &h_row_);
    log.add(CastKind::kFused, fp4 ? "SwiGLU*prob + quantize (a' row + col, h MXFP4)"
                                  : "SwiGLU*prob + quantize (a' row + col, h row)",
            3, Mp_ * 2 * F_);
    h1_.clear();
    std::vector<bf16_t> o;
    fprop_fp8(ar, w2q_, H_, &o);
    unpermute_bf16(o, y);
    if (!fp4)
      save_rows("GEMM1 input x_perm", "fp8 row 1x128 [Mp, H]", qbytes(xp_row_), fp8_row(H_));
    else
      save_rows("GEMM1 input x_perm", "mxfp4 row 1x32 [Mp, H]", qbytes(xp_fp4_), mxfp4_row(H_));
    if (!fp4) save_rows("GEMM1 output h", "fp8 row 1x128 [Mp, 2F]", qbytes(h_row_), fp8_row(2 * F_));
    else save_rows("GEMM1 output h", "mxfp4 row 1x32 [Mp, 2F]", qbytes(h_row_), mxfp4_row(2 * F_));
    save_rows("GEMM2 input a' (wgrad copy)", "fp8 col 128x1 [Mp, F]", qbytes(ac_), fp8_row(F_));
    if (cfg_.check_columns)
      rep_.columns.push_back(compare_columns("GEMM2 input a'", "scaling-aware transpose",
                                             decode(ar), decode(ac_), r_, F_, tr.underflow));
  }

  // FP8 row-wise [T, C] -> permuted and padded row-wise [Mp, C] (EP: dispatched in FP8, wire
  // format fp8, with the probabilities in the forward).
  void permute_fp8(const QTensor& q, QTensor* out, MoePass pass, const char* name) {
    const int64_t c = q.cols;
    out->layout = Layout::kRow1x128;
    out->rows = Mp_;
    out->cols = c;
    out->segments = Segments();
    out->codes.assign(Mp_ * c, 0);
    out->scales.assign((c / kFp8Block) * Mp_, 0);
    if (comm_ == nullptr) {
      cpu::permute_pad_fp8(q.codes.data(), q.scales.data(), c, r_, out->codes.data(),
                           out->scales.data(), Mp_);
      return;
    }
    const DispatchPlan p = plan_for(pass, WireFormat::kFp8);
    const bool fwd = pass == MoePass::kForward;
    ep_dispatch_fp8(*comm_, p, q.codes.data(), q.scales.data(), fwd ? probs_.data() : nullptr,
                    out->codes.data(), out->scales.data(), Mp_, fwd ? prow_.data() : nullptr);
    log_dispatch(pass, name, p);
  }

  // ---- backward, per recipe -------------------------------------------------------------------
  // Each fills dxp [Mp, H] bf16 (GEMM1 dgrad) and dp [Mp] (d loss / d prob per row) and adds to
  // the weight gradients.
  void backward_bf16(const bf16_t* dy, const MoeGrads& g, bf16_t* dxp, float* dp,
                     QuantStats* st) {
    std::vector<bf16_t> dy2(Mp_ * H_);
    permute_bf16(dy, dy2.data(), MoePass::kBackward, "dispatch dy");
    std::vector<bf16_t> da(Mp_ * F_);
    dgrad_bf16(dy2, w2b_, H_, F_, da.data());
    if (g.dw2) cpu::grouped_wgrad_bf16_ref(dy2.data(), a_bf16_.data(), seg_, H_, F_, g.dw2, g.accumulate);
    std::vector<bf16_t> dh(Mp_ * 2 * F_);
    st->nonfinite += dswiglu_prob(da.data(), widen(h1_.data(), Mp_ * 2 * F_).data(), prow_.data(),
                                  Mp_, F_, dh.data(), dp);
    dgrad_bf16(dh, w1b_, 2 * F_, H_, dxp);
    if (g.dw1) cpu::grouped_wgrad_bf16_ref(dh.data(), xp_.data(), seg_, 2 * F_, H_, g.dw1, g.accumulate);
  }

  void backward_blockwise(const bf16_t* dy, const MoeGrads& g, bf16_t* dxp, float* dp,
                          QuantStats* st) {
    OpLog log(&rep_, MoePass::kBackward);
    std::vector<bf16_t> dy2(Mp_ * H_);
    permute_bf16(dy, dy2.data(), MoePass::kBackward, "dispatch dy");
    QTensor dyr, dyc;
    *st += cpu::quantize_both(dy2.data(), Mp_, H_, seg_, &dyr, &dyc);
    log.add(CastKind::kQuantize, "quantize dY (row + col, from BF16)", 2, Mp_ * H_);
    std::vector<bf16_t> da(Mp_ * F_);
    dgrad_fp8(dyr, w2t_, F_, da.data());
    if (g.dw2) cpu::grouped_wgrad_ref(dyc, ac_, g.dw2, g.accumulate);
    std::vector<bf16_t> dh(Mp_ * 2 * F_);
    st->nonfinite += dswiglu_prob(da.data(), widen(h1_.data(), Mp_ * 2 * F_).data(), prow_.data(),
                                  Mp_, F_, dh.data(), dp);
    QTensor dhr, dhc;
    *st += cpu::quantize_both(dh.data(), Mp_, 2 * F_, seg_, &dhr, &dhc);
    log.add(CastKind::kQuantize, "quantize dh (row + col, from BF16)", 2, Mp_ * 2 * F_);
    dgrad_fp8(dhr, w1t_, H_, dxp);
    if (g.dw1) cpu::grouped_wgrad_ref(dhc, xc_, g.dw1, g.accumulate);
    if (cfg_.check_columns) {
      rep_.columns.push_back(compare_columns("GEMM2 grad dY", "quantize col from BF16",
                                             decode(dyr), decode(dyc), r_, H_, 0));
      rep_.columns.push_back(compare_columns("GEMM1 grad dh", "quantize col from BF16",
                                             decode(dhr), decode(dhc), r_, 2 * F_, 0));
    }
  }

  // The naive column copy: dequantize (to BF16) -> transpose -> quantize with fresh FP32 scales.
  F32Q naive_col(OpLog* log, const F32Q& row, const std::string& what, QuantStats* st) {
    const std::vector<bf16_t> d = f32q_dequant_bf16(row);
    log->add(CastKind::kDequantize, "dequantize " + what + " (for its column copy)", 1,
             row.rows * row.cols);
    F32Q col;
    *st += f32q_col(d.data(), row.rows, row.cols, seg_, &col);
    log->add(CastKind::kQuantize, "quantize " + what + " col (transposed, FP32 scales)", 1,
             row.rows * row.cols);
    return col;
  }

  void backward_naive(const bf16_t* dy, const MoeGrads& g, bf16_t* dxp, float* dp,
                      QuantStats* st) {
    OpLog log(&rep_, MoePass::kBackward);
    // combine's backward is a dispatch of dy: FP8 on the wire, quantize before, dequantize after
    F32Q dyq;
    *st += f32q_row(dy, T_, H_, &dyq);
    log.add(CastKind::kQuantize, "quantize dy (row, FP32 scales, before dispatch)", 1, T_ * H_);
    std::vector<bf16_t> dy2(Mp_ * H_);
    if (comm_ == nullptr) {
      const std::vector<bf16_t> dyd = f32q_dequant_bf16(dyq);
      log.add(CastKind::kDequantize, "dequantize dy (after dispatch)", 1, T_ * H_);
      cpu::permute_pad_bf16(dyd.data(), H_, r_, dy2.data());
    } else {
      const int64_t n = dispatch_naive(dyq, MoePass::kBackward, "dispatch dy", dy2.data());
      log.add(CastKind::kDequantize, "dequantize dy (after dispatch)", 1, n);
    }
    F32Q dyr;
    *st += f32q_row(dy2.data(), Mp_, H_, &dyr);
    log.add(CastKind::kQuantize, "quantize dY (row, FP32 scales)", 1, Mp_ * H_);
    const F32Q dyc = naive_col(&log, dyr, "dY", st);
    std::vector<bf16_t> da(Mp_ * F_);
    fprop_f32q(dyr, w2nt_, F_, da.data());  // dgrad: dY [Mp, H] x W2t [F, H]
    const F32Q acn = naive_col(&log, an_, "a'", st);
    if (g.dw2) f32q_wgrad(dyc, acn, g.dw2, g.accumulate);
    std::vector<bf16_t> dh(Mp_ * 2 * F_);
    st->nonfinite += dswiglu_prob(da.data(), widen(h1_.data(), Mp_ * 2 * F_).data(), prow_.data(),
                                  Mp_, F_, dh.data(), dp);
    F32Q dhr;
    *st += f32q_row(dh.data(), Mp_, 2 * F_, &dhr);
    log.add(CastKind::kQuantize, "quantize dh (row, FP32 scales)", 1, Mp_ * 2 * F_);
    const F32Q dhc = naive_col(&log, dhr, "dh", st);
    fprop_f32q(dhr, w1nt_, H_, dxp);  // dgrad: dh [Mp, 2F] x W1t [H, 2F]
    const F32Q xpc = naive_col(&log, xn_, "x_perm", st);
    if (g.dw1) f32q_wgrad(dhc, xpc, g.dw1, g.accumulate);
    if (cfg_.check_columns) {
      rep_.columns.push_back(compare_columns("GEMM1 input x_perm", "DQ->T->Q (FP32 scales)",
                                             f32q_decode(xn_), f32q_decode(xpc), r_, H_, 0));
      rep_.columns.push_back(compare_columns("GEMM2 input a'", "DQ->T->Q (FP32 scales)",
                                             f32q_decode(an_), f32q_decode(acn), r_, F_, 0));
      rep_.columns.push_back(compare_columns("GEMM2 grad dY", "DQ->T->Q (FP32 scales)",
                                             f32q_decode(dyr), f32q_decode(dyc), r_, H_, 0));
      rep_.columns.push_back(compare_columns("GEMM1 grad dh", "DQ->T->Q (FP32 scales)",
                                             f32q_decode(dhr), f32q_decode(dhc), r_, 2 * F_, 0));
    }
  }

  void backward_flow(const bf16_t* dy, const MoeGrads& g, bf16_t* dxp, float* dp,
                     QuantStats* st) {
    OpLog log(&rep_, MoePass::kBackward);
    const bool fp4 = cfg_.recipe == Recipe::kFlowFp4;
    QTensor dyq, dyr, dyc;
    *st += cpu::quantize_row(dy, T_, H_, &dyq);
    log.add(CastKind::kQuantize, "quantize dy (row 1x128, entry)", 1, T_ * H_);
    // combine's backward: FP8 dispatch of dy (identity on one rank), FP8 permute+pad
    permute_fp8(dyq, &dyr, MoePass::kBackward, "dispatch dy");
    const QuantStats tdy = cpu::scaling_aware_transpose(dyr, seg_, &dyc, cfg_.transpose_exponent);
    *st += tdy;
    log.add(CastKind::kConvert, "scaling-aware transpose dY (wgrad copy)", 1, Mp_ * H_);
    std::vector<bf16_t> da(Mp_ * F_);
    dgrad_fp8(dyr, w2t_, F_, da.data());
    if (g.dw2) cpu::grouped_wgrad_ref(dyc, ac_, g.dw2, g.accumulate);
    // fused dSwiGLU * prob + quantize: dh row-wise (GEMM1 dgrad) and column-wise (its wgrad),
    // both from the BF16 dh, with h decoded exactly from its saved FP8 copy
    std::vector<float> h(Mp_ * 2 * F_);
    cpu::dequantize(h_row_, h.data());
    std::vector<bf16_t> dh(Mp_ * 2 * F_);
    st->nonfinite += dswiglu_prob(da.data(), h.data(), prow_.data(), Mp_, F_, dh.data(), dp);
    QTensor dhr, dhc;
    QuantStats qd = cpu::quantize_row(dh.data(), Mp_, 2 * F_, &dhr);
    qd += cpu::quantize_col(dh.data(), Mp_, 2 * F_, seg_, &dhc);
    qd.nonfinite = 0;  // counted by dswiglu_prob
    *st += qd;
    log.add(CastKind::kFused, "dSwiGLU*prob + quantize (dh row + col)", 2, Mp_ * 2 * F_);
    dgrad_fp8(dhr, w1t_, H_, dxp);
    QTensor xpc;
    QuantStats tx;
    if (!fp4) {
      tx = cpu::scaling_aware_transpose(xp_row_, seg_, &xpc, cfg_.transpose_exponent);
      log.add(CastKind::kConvert, "scaling-aware transpose x_perm (wgrad copy)", 1, Mp_ * H_);
    } else {
      tx = cpu::fp4_to_fp8_col(xp_fp4_, seg_, &xpc, cfg_.transpose_exponent);
      log.add(CastKind::kConvert, "FP4RowToFP8Col x_perm (wgrad copy)", 1, Mp_ * H_);
    }
    *st += tx;
    if (g.dw1) cpu::grouped_wgrad_ref(dhc, xpc, g.dw1, g.accumulate);
    if (cfg_.check_columns) {
      rep_.columns.push_back(compare_columns(
          "GEMM1 input x_perm", fp4 ? "FP4RowToFP8Col vs FP4RowToFP8Row" : "scaling-aware transpose",
          decode(xp_row_), decode(xpc), r_, H_, tx.underflow));
      rep_.columns.push_back(compare_columns("GEMM2 grad dY", "scaling-aware transpose",
                                             decode(dyr), decode(dyc), r_, H_, tdy.underflow));
      rep_.columns.push_back(compare_columns("GEMM1 grad dh", "quantize col from BF16",
                                             decode(dhr), decode(dhc), r_, 2 * F_, 0));
    }
  }

  // ---- the common tail: unpermute dx, router backward, dx = expert path + router path ----------
  void backward_router(const std::vector<bf16_t>& dxp, const std::vector<float>& dp,
                       const MoeGrads& g, bf16_t* dx) {
    const int64_t T = T_;
    std::vector<bf16_t> dxe(T * H_);
    std::vector<float> dprobs(T * K_, 0.0f);
    if (comm_ == nullptr) {
      cpu::unpermute_unpad(dxp.data(), nullptr, H_, r_, dxe.data());
      for (int64_t i = 0; i < T * K_; ++i)
        if (r_.row_map[i] >= 0) dprobs[i] = dp[r_.row_map[i]];
    } else {
      // combine: the dX rows (BF16) and each row's d loss / d prob (FP32) go back to the token's
      // rank in one exchange; the sum over slots runs there in slot order, as on one rank.
      const cpu::Routing& sr = plan_.send_routing;
      std::vector<bf16_t> back(plan_.send_rows() * H_);
      std::vector<float> back_dp(plan_.send_rows());
      combine_rows(*comm_, plan_,
                   {{dxp.data(), back.data(), 2 * H_}, {dp.data(), back_dp.data(),
                                                        int64_t(sizeof(float))}});
      log_combine(MoePass::kBackward, "combine dX rows + dprob", "bf16 + fp32 dprob",
                  2 * H_ + int64_t(sizeof(float)));
      cpu::unpermute_unpad(back.data(), nullptr, H_, sr, dxe.data());
      for (int64_t i = 0; i < T * K_; ++i)
        if (sr.row_map[i] >= 0) dprobs[i] = back_dp[sr.row_map[i]];
    }
    std::vector<float> dlogits(T * E_);
    const RouterConfig rc = cfg_.router_config();
    cpu::router_backward(logits_.data(), T, rc, ids_.data(), dprobs.data(),
                         aux_coef_.empty() ? nullptr : aux_coef_.data(), 1.0f, dlogits.data());
    // dWr[e, h] += sum_t dlogits[t, e] * x[t, h]   (FP32, fma in t order)
    if (g.dwr && !g.accumulate) std::fill(g.dwr, g.dwr + int64_t(E_) * H_, 0.0f);  // then 0 + sum
    if (g.dwr)
      for (int e = 0; e < E_; ++e)
        for (int64_t h = 0; h < H_; ++h) {
          float acc = 0.0f;
          for (int64_t t = 0; t < T; ++t)
            acc = std::fma(dlogits[t * E_ + e], bf16_to_f32(x_[t * H_ + h]), acc);
          g.dwr[int64_t(e) * H_ + h] += acc;
        }
    // dx[t, h] = bf16(dx_expert[t, h] + sum_e dlogits[t, e] * Wr[e, h])
    for (int64_t t = 0; t < T; ++t)
      for (int64_t h = 0; h < H_; ++h) {
        float acc = bf16_to_f32(dxe[t * H_ + h]);
        for (int e = 0; e < E_; ++e) acc = std::fma(dlogits[t * E_ + e], wr_[int64_t(e) * H_ + h], acc);
        dx[t * H_ + h] = to_bf16(acc);
      }
  }

  // ---- state -----------------------------------------------------------------------------------
  const int E_, El_;  // all experts; local experts (E_ / ranks with a communicator)
  const int64_t H_, F_;
  const int K_;
  Communicator* const comm_;  // null: single rank
  DispatchPlan plan_;         // EP: the plan of the latest forward (backward reuses it)
  bool have_weights_ = false, have_forward_ = false;
  // weights
  std::vector<float> wr_, bias_;
  bool has_bias_ = false;
  std::vector<bf16_t> w1b_, w2b_;                 // [El, 2F, H], [El, H, F] bf16
  std::vector<QTensor> w1q_, w1t_, w2q_, w2t_;    // UE8M0 128x128 + exact transposes
  std::vector<F32Q> w1n_, w1nt_, w2n_, w2nt_;     // fp8-naive: FP32-scale copies
  // routing state (every recipe)
  int64_t T_ = 0, Mp_ = 0;
  std::vector<bf16_t> x_;        // [T, H] router input
  std::vector<float> logits_;    // [T, E]
  std::vector<int32_t> ids_;     // [T, k]
  std::vector<float> probs_;     // [T, k]
  std::vector<float> aux_coef_;  // [E] or empty
  float aux_loss_ = 0.0f;
  cpu::Routing r_;
  Segments seg_;                 // padded expert segments over [0, Mp)
  std::vector<float> prow_;      // [Mp] prob of each row (0 for padding)
  // saved activations (which ones depends on the recipe)
  std::vector<bf16_t> xp_;       // bf16: GEMM1 input [Mp, H]
  std::vector<bf16_t> h1_;       // bf16, blockwise, fp8-naive: GEMM1 output [Mp, 2F]
  std::vector<bf16_t> a_bf16_;   // bf16: GEMM2 input [Mp, F]
  QTensor xc_, ac_;              // blockwise: column copies; ac_ also flow's a' column copy
  QTensor xp_row_, h_row_;       // flow: GEMM1 input row-wise, h row-wise
  QTensor xp_fp4_;               // flow-fp4: GEMM1 input MXFP4
  F32Q xn_, an_;                 // fp8-naive: GEMM1 / GEMM2 inputs row-wise
  CastReport rep_;
  size_t forward_columns_ = 0;  // column checks made by the forward
  MoeStatus status_;
};

}  // namespace

std::unique_ptr<MoeLayer> make_cpu_layer(const MoeConfig& cfg) {
  if (cfg.comm == nullptr) {
    cfg.validate();
    return std::unique_ptr<MoeLayer>(new CpuMoeLayer(cfg));
  }
  // Expert parallelism: collective. First the configuration across ranks (a mismatch is a
  // CommError on every rank, reported identically), then each rank's own checks, agreed on by
  // every rank, so that nobody is left waiting in a later collective.
  Communicator& comm = *cfg.comm;
  const char* what = "make_cpu_layer";
  ep_detail::check_uniform_config(comm, what, cfg);
  collective_checks(&comm, what, [&] {
    cfg.validate();
    FLOWMOE_CHECK(comm.memory_space() == MemorySpace::kHost,
                  what << ": the CPU layer moves host memory but the communicator ("
                       << comm.backend() << ") moves device memory; expected a host-memory "
                          "communicator such as SimWorld's");
  });
  return std::unique_ptr<MoeLayer>(new CpuMoeLayer(cfg));
}

}  // namespace flowmoe
