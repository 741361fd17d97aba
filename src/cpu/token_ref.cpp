// CPU reference of the token-movement operators (flowmoe/token.h): the readable specification
// the CUDA kernels are tested against bit for bit. Every reduction below is written in the exact
// order the kernels use; "warp order" is the 32-lane order of one CUDA warp (see warp_sum).
#include <algorithm>
#include <cmath>
#include <limits>
#include <vector>

#include "flowmoe/error.h"
#include "flowmoe/numerics.h"
#include "flowmoe/token.h"

namespace flowmoe {

void validate_router(const RouterConfig& cfg, const char* what) {
  FLOWMOE_CHECK(cfg.num_experts >= 1 && cfg.num_experts <= kRouterMaxExperts,
                what << ": number of experts E = " << cfg.num_experts << " out of range; expected 1 <= E <= "
                     << kRouterMaxExperts);
  FLOWMOE_CHECK(cfg.topk >= 1 && cfg.topk <= cfg.num_experts && cfg.topk <= kMaxTopk,
                what << ": top-k k = " << cfg.topk << " invalid for E = " << cfg.num_experts
                     << " experts; expected 1 <= k <= min(E, " << kMaxTopk << ")");
  FLOWMOE_CHECK(std::isfinite(cfg.scale),
                what << ": probability scale " << cfg.scale << " is not finite; expected a finite factor");
}

int64_t routing_max_rows(int64_t tokens, int topk, int num_experts, int align) {
  const int64_t pairs = tokens * topk;
  return pairs + std::min<int64_t>(num_experts, pairs) * (align - 1);
}

namespace cpu {
namespace {

using num::bf16_to_f32;
using num::f32_to_bf16;
using tok::fma_rn;
using tok::mul_rn;
using tok::canon;

// ---- warp order --------------------------------------------------------------------------
// Lane l of a warp accumulates elements l, l+32, l+64, ... in turn from 0; then a butterfly
// tree adds lanes (l, l^16), (l, l^8), ..., (l, l^1). Every lane ends with the same bits
// (addition commutes); lane 0's sequence of additions is the one below.
float tree32(float a[32]) {
  for (int o = 16; o > 0; o >>= 1)
    for (int l = 0; l < o; ++l) a[l] = a[l] + a[l + o];
  return a[0];
}
float warp_sum(const float* v, int n) {
  float a[32] = {};
  for (int e = 0; e < n; ++e) a[e & 31] = a[e & 31] + v[e];
  return tree32(a);
}
float warp_dot(const float* x, const float* y, int n) {
  float a[32] = {};
  for (int e = 0; e < n; ++e) a[e & 31] = fma_rn(x[e], y[e], a[e & 31]);
  return tree32(a);
}

void check_tokens(int64_t tokens, const char* what) {
  FLOWMOE_CHECK(tokens >= 0 && tokens <= std::numeric_limits<int32_t>::max(),
                what << ": T = " << tokens << " tokens out of range; expected 0 <= T < 2^31");
}
void check_ptr(const void* p, bool needed, const char* name, const char* what) {
  FLOWMOE_CHECK(p != nullptr || !needed, what << ": " << name << " is null; expected a buffer");
}

// Router scores of one token: p [E] (softmax probabilities or sigmoid values) and, for sigmoid,
// ds [E] = s * (1 - s) (may be null). Returns the number of non-finite logits.
int token_scores(const float* z, const RouterConfig& cfg, float* p, float* ds) {
  const int E = cfg.num_experts;
  int nonfinite = 0;
  for (int e = 0; e < E; ++e) nonfinite += !num::f32_is_finite(z[e]);
  if (cfg.score == RouterScore::kSoftmax) {
    float m = -std::numeric_limits<float>::infinity();
    for (int e = 0; e < E; ++e) m = std::fmax(m, z[e]);  // NaN ignored, as fmaxf on the device
    for (int e = 0; e < E; ++e) p[e] = tok::exp_f32(z[e] - m);
    const float s = warp_sum(p, E);
    for (int e = 0; e < E; ++e) p[e] = p[e] / s;
  } else {
    for (int e = 0; e < E; ++e) {
      float s, d;
      tok::sigmoid_and_grad(z[e], &s, &d);
      p[e] = s;
      if (ds) ds[e] = d;
    }
  }
  return nonfinite;
}

// Probability of e over all experts used by the aux loss: softmax p_e; sigmoid s_e / sum s
// (0 when the sum is 0). `sall` is warp_sum(s) for sigmoid.
inline float aux_prob(const RouterConfig& cfg, float p, float sall) {
  if (cfg.score == RouterScore::kSoftmax) return p;
  return sall == 0.0f ? 0.0f : p / sall;
}

void check_h(int64_t h, int multiple, const char* fmt, const char* what) {
  FLOWMOE_CHECK(h > 0 && h % multiple == 0,
                what << ": hidden size H = " << h << " must be a positive multiple of " << multiple
                     << " for " << fmt << " rows");
}

void check_routing(const Routing& r, const char* what) {
  const int E = r.num_experts;
  FLOWMOE_CHECK(E >= 1 && r.topk >= 1 && static_cast<int64_t>(r.counts.size()) == E &&
                    static_cast<int64_t>(r.offsets.size()) == E + 1 &&
                    static_cast<int64_t>(r.padded_offsets.size()) == E + 1 &&
                    static_cast<int64_t>(r.row_map.size()) == r.tokens * r.topk,
                what << ": routing tables are not built (sizes do not match T = " << r.tokens
                     << ", k = " << r.topk << ", E = " << E << "); call build_routing first");
}

// Copies one row of `bytes` bytes, or zeroes it when src is null.
inline void put_row(uint8_t* dst, const uint8_t* src, int64_t bytes) {
  if (src) std::copy(src, src + bytes, dst);
  else std::fill(dst, dst + bytes, uint8_t{0});
}

// The generic permute+pad: `parts` row-contiguous payloads (bytes per row each), plus an optional
// column-major scale grid [ncols][ld] (FP8).
struct Part {
  const uint8_t* src;
  uint8_t* dst;
  int64_t row_bytes;
};
void permute_pad_impl(const Part* parts, int nparts, const uint8_t* col_src, uint8_t* col_dst,
                      int64_t ncols, int64_t dst_ld, const Routing& r) {
  const int64_t T = r.tokens;
  const int k = r.topk;
  for (int64_t t = 0; t < T; ++t) {
    for (int s = 0; s < k; ++s) {
      const int32_t row = r.row_map[t * k + s];
      if (row < 0) continue;
      for (int i = 0; i < nparts; ++i)
        put_row(parts[i].dst + row * parts[i].row_bytes, parts[i].src + t * parts[i].row_bytes,
                parts[i].row_bytes);
      for (int64_t c = 0; c < ncols; ++c) col_dst[c * dst_ld + row] = col_src[c * T + t];
    }
  }
  for (int e = 0; e < r.num_experts; ++e) {
    for (int64_t row = r.padded_offsets[e] + r.counts[e]; row < r.padded_offsets[e + 1]; ++row) {
      for (int i = 0; i < nparts; ++i)
        put_row(parts[i].dst + row * parts[i].row_bytes, nullptr, parts[i].row_bytes);
      for (int64_t c = 0; c < ncols; ++c) col_dst[c * dst_ld + row] = 0;
    }
  }
}

}  // namespace

// ---- router ----------------------------------------------------------------------------------
int64_t router_forward(const float* logits, int64_t tokens, const RouterConfig& cfg,
                       const float* bias, int32_t* ids, float* probs) {
  const char* what = "router_forward";
  validate_router(cfg, what);
  check_tokens(tokens, what);
  check_ptr(logits, tokens > 0, "logits", what);
  check_ptr(ids, tokens > 0, "ids", what);
  check_ptr(probs, tokens > 0, "probs", what);
  const int E = cfg.num_experts, k = cfg.topk;
  std::vector<float> p(E), chosen(k);
  std::vector<char> taken(E);
  int64_t nonfinite = 0;
  for (int64_t t = 0; t < tokens; ++t) {
    nonfinite += token_scores(logits + t * E, cfg, p.data(), nullptr);
    std::fill(taken.begin(), taken.end(), 0);
    for (int j = 0; j < k; ++j) {
      float bv = num::f32_from_bits(num::kCanonicalNaN);
      int bi = std::numeric_limits<int>::max();
      for (int e = 0; e < E; ++e) {
        if (taken[e]) continue;
        const float v = bias ? p[e] + bias[e] : p[e];
        if (tok::better(v, e, bv, bi)) {
          bv = v;
          bi = e;
        }
      }
      taken[bi] = 1;
      ids[t * k + j] = bi;
      chosen[j] = p[bi];
    }
    float sum = 0.0f;
    if (cfg.renormalize)
      for (int j = 0; j < k; ++j) sum = sum + chosen[j];
    for (int j = 0; j < k; ++j) {
      const float q = !cfg.renormalize ? chosen[j] : (sum == 0.0f ? 0.0f : chosen[j] / sum);
      probs[t * k + j] = canon(mul_rn(q, cfg.scale));
    }
  }
  return nonfinite;
}

float router_aux_loss(const float* logits, const int32_t* ids, int64_t tokens,
                      const RouterConfig& cfg, float alpha, float* aux_coef) {
  const char* what = "router_aux_loss";
  validate_router(cfg, what);
  check_tokens(tokens, what);
  FLOWMOE_CHECK(tokens >= 1, what << ": T = 0 tokens; the aux loss is a mean over tokens, expected T >= 1");
  check_ptr(logits, true, "logits", what);
  check_ptr(ids, true, "ids", what);
  check_ptr(aux_coef, true, "aux_coef", what);
  const int E = cfg.num_experts, k = cfg.topk;
  std::vector<float> p(E), part(E), sum_p(E, 0.0f), f(E), mean_p(E);
  std::vector<int64_t> cnt(E, 0);
  for (int64_t i = 0; i < tokens * k; ++i)
    if (ids[i] >= 0 && ids[i] < E) ++cnt[ids[i]];
  for (int64_t t0 = 0; t0 < tokens; t0 += kAuxChunk) {
    std::fill(part.begin(), part.end(), 0.0f);
    for (int64_t t = t0; t < std::min<int64_t>(t0 + kAuxChunk, tokens); ++t) {
      token_scores(logits + t * E, cfg, p.data(), nullptr);
      const float sall = cfg.score == RouterScore::kSigmoid ? warp_sum(p.data(), E) : 0.0f;
      for (int e = 0; e < E; ++e) part[e] = part[e] + aux_prob(cfg, p[e], sall);
    }
    for (int e = 0; e < E; ++e) sum_p[e] = sum_p[e] + part[e];
  }
  const float ae = mul_rn(alpha, static_cast<float>(E));
  const float tf = static_cast<float>(tokens), tk = static_cast<float>(tokens * k);
  for (int e = 0; e < E; ++e) {
    mean_p[e] = sum_p[e] / tf;
    f[e] = static_cast<float>(cnt[e]) / tk;
    aux_coef[e] = canon(mul_rn(ae, f[e]) / tf);
  }
  return canon(mul_rn(ae, warp_dot(f.data(), mean_p.data(), E)));
}

void router_backward(const float* logits, int64_t tokens, const RouterConfig& cfg,
                     const int32_t* ids, const float* dprobs, const float* aux_coef,
                     float aux_dloss, float* dlogits) {
  const char* what = "router_backward";
  validate_router(cfg, what);
  check_tokens(tokens, what);
  check_ptr(logits, tokens > 0, "logits", what);
  check_ptr(ids, tokens > 0, "ids", what);
  check_ptr(dprobs, tokens > 0, "dprobs", what);
  check_ptr(dlogits, tokens > 0, "dlogits", what);
  const int E = cfg.num_experts, k = cfg.topk;
  const bool softmax = cfg.score == RouterScore::kSoftmax;
  std::vector<float> p(E), ds(E), d1(E), a(E), pa(E);
  for (int64_t t = 0; t < tokens; ++t) {
    const float* z = logits + t * E;
    token_scores(z, cfg, p.data(), ds.data());
    const int32_t* id = ids + t * k;
    const float* dp = dprobs + t * k;
    std::fill(d1.begin(), d1.end(), 0.0f);
    auto valid = [&](int j) { return id[j] >= 0 && id[j] < E; };
    if (softmax && !cfg.renormalize) {
      // probs_j = p_{i_j}: dz_m = p_m * (G_m - sum_j g_j p_{i_j})
      float c = 0.0f;
      for (int j = 0; j < k; ++j)
        if (valid(j)) c = fma_rn(mul_rn(dp[j], cfg.scale), p[id[j]], c);
      for (int j = 0; j < k; ++j)
        if (valid(j)) d1[id[j]] = d1[id[j]] + mul_rn(dp[j], cfg.scale);
      for (int m = 0; m < E; ++m) d1[m] = mul_rn(p[m], d1[m] - c);
    } else if (cfg.renormalize) {
      // q_j = v_j / S (v = p or s): dv_j = (g_j - sum_l g_l q_l) / S; softmax: dz = q (g - c)
      float sum = 0.0f;
      for (int j = 0; j < k; ++j)
        if (valid(j)) sum = sum + p[id[j]];
      if (sum != 0.0f) {
        float c = 0.0f;
        for (int j = 0; j < k; ++j)
          if (valid(j)) c = fma_rn(mul_rn(dp[j], cfg.scale), p[id[j]] / sum, c);
        for (int j = 0; j < k; ++j) {
          if (!valid(j)) continue;
          const float g = mul_rn(dp[j], cfg.scale);
          const float v = softmax ? mul_rn(p[id[j]] / sum, g - c) : mul_rn(ds[id[j]], g - c) / sum;
          d1[id[j]] = d1[id[j]] + v;
        }
      }
    } else {  // sigmoid, not renormalised: probs_j = s_{i_j}
      for (int j = 0; j < k; ++j)
        if (valid(j)) d1[id[j]] = d1[id[j]] + mul_rn(ds[id[j]], mul_rn(dp[j], cfg.scale));
    }
    float* dz = dlogits + t * E;
    if (!aux_coef) {
      for (int m = 0; m < E; ++m) dz[m] = canon(d1[m]);
      continue;
    }
    for (int m = 0; m < E; ++m) a[m] = mul_rn(aux_coef[m], aux_dloss);
    if (softmax) {
      const float c2 = warp_dot(a.data(), p.data(), E);
      for (int m = 0; m < E; ++m) dz[m] = canon(d1[m] + mul_rn(p[m], a[m] - c2));
    } else {
      const float sall = warp_sum(p.data(), E);
      for (int m = 0; m < E; ++m) pa[m] = aux_prob(cfg, p[m], sall);
      const float c2 = warp_dot(a.data(), pa.data(), E);
      for (int m = 0; m < E; ++m)
        dz[m] = canon(d1[m] + (sall == 0.0f ? 0.0f : mul_rn(ds[m], a[m] - c2) / sall));
    }
  }
}

// ---- routing metadata ----------------------------------------------------------------------
Routing build_routing(const int32_t* ids, int64_t tokens, int topk, int num_experts, int align) {
  const char* what = "build_routing";
  check_tokens(tokens, what);
  FLOWMOE_CHECK(num_experts >= 1, what << ": E = " << num_experts << " experts; expected E >= 1");
  FLOWMOE_CHECK(topk >= 1 && topk <= kMaxTopk,
                what << ": top-k k = " << topk << " out of range; expected 1 <= k <= " << kMaxTopk);
  FLOWMOE_CHECK(align >= 1 && align <= kMaxAlign,
                what << ": alignment A = " << align << " out of range; expected 1 <= A <= " << kMaxAlign
                     << " (e.g. 16, 32 or 128)");
  FLOWMOE_CHECK(routing_max_rows(tokens, topk, num_experts, align) <= std::numeric_limits<int32_t>::max(),
                what << ": up to " << routing_max_rows(tokens, topk, num_experts, align)
                     << " padded rows do not fit int32 row indices");
  check_ptr(ids, tokens > 0, "ids", what);
  const int64_t pairs = tokens * topk;
  for (int64_t i = 0; i < pairs; ++i)
    FLOWMOE_CHECK(ids[i] >= -1 && ids[i] < num_experts,
                  what << ": expert id " << ids[i] << " at token " << i / topk << ", slot " << i % topk
                       << " out of range; expected -1 (dropped) or 0 <= id < E = " << num_experts);
  Routing r;
  r.tokens = tokens;
  r.topk = topk;
  r.num_experts = num_experts;
  r.align = align;
  r.counts.assign(num_experts, 0);
  for (int64_t i = 0; i < pairs; ++i)
    if (ids[i] >= 0) ++r.counts[ids[i]];
  r.offsets.assign(num_experts + 1, 0);
  r.padded_offsets.assign(num_experts + 1, 0);
  for (int e = 0; e < num_experts; ++e) {
    r.offsets[e + 1] = r.offsets[e] + r.counts[e];
    r.padded_offsets[e + 1] = r.padded_offsets[e] + (r.counts[e] + align - 1) / align * align;
  }
  std::vector<int32_t> next(num_experts, 0);  // rank of the next pair of each expert
  r.row_map.assign(pairs, -1);
  r.row_map_unpadded.assign(pairs, -1);
  for (int64_t i = 0; i < pairs; ++i) {  // flat order = ascending token, then slot
    const int32_t e = ids[i];
    if (e < 0) continue;
    r.row_map[i] = r.padded_offsets[e] + next[e];
    r.row_map_unpadded[i] = r.offsets[e] + next[e];
    ++next[e];
  }
  return r;
}

// ---- permute + pad ---------------------------------------------------------------------------
void permute_pad_bf16(const bf16_t* x, int64_t h, const Routing& r, bf16_t* out) {
  const char* what = "permute_pad_bf16";
  check_routing(r, what);
  check_h(h, 8, "BF16", what);
  check_ptr(x, r.tokens > 0, "x", what);
  check_ptr(out, r.padded_rows() > 0, "out", what);
  const Part part{reinterpret_cast<const uint8_t*>(x), reinterpret_cast<uint8_t*>(out), 2 * h};
  permute_pad_impl(&part, 1, nullptr, nullptr, 0, 0, r);
}

void permute_pad_fp8(const uint8_t* codes, const uint8_t* scales, int64_t h, const Routing& r,
                     uint8_t* out_codes, uint8_t* out_scales, int64_t scale_ld) {
  const char* what = "permute_pad_fp8";
  check_routing(r, what);
  check_h(h, kFp8Block, "FP8 row-wise (1x128 tiles)", what);
  check_ptr(codes, r.tokens > 0, "codes", what);
  check_ptr(scales, r.tokens > 0, "scales", what);
  check_ptr(out_codes, r.padded_rows() > 0, "out_codes", what);
  check_ptr(out_scales, r.padded_rows() > 0, "out_scales", what);
  FLOWMOE_CHECK(scale_ld >= r.padded_rows(), what << ": scale_ld = " << scale_ld
                                                   << " is smaller than the padded rows Mp = "
                                                   << r.padded_rows());
  const Part part{codes, out_codes, h};
  permute_pad_impl(&part, 1, scales, out_scales, h / kFp8Block, scale_ld, r);
}

void permute_pad_mxfp4(const uint8_t* codes, const uint8_t* scales, int64_t h, const Routing& r,
                       uint8_t* out_codes, uint8_t* out_scales) {
  const char* what = "permute_pad_mxfp4";
  check_routing(r, what);
  check_h(h, kFp4Block, "MXFP4 (1x32 blocks)", what);
  check_ptr(codes, r.tokens > 0, "codes", what);
  check_ptr(scales, r.tokens > 0, "scales", what);
  check_ptr(out_codes, r.padded_rows() > 0, "out_codes", what);
  check_ptr(out_scales, r.padded_rows() > 0, "out_scales", what);
  const Part parts[2] = {{codes, out_codes, h / 2}, {scales, out_scales, h / kFp4Block}};
  permute_pad_impl(parts, 2, nullptr, nullptr, 0, 0, r);
}

// ---- unpermute + unpad -------------------------------------------------------------------------
void unpermute_unpad(const bf16_t* y_rows, const float* probs, int64_t h, const Routing& r,
                     bf16_t* y) {
  const char* what = "unpermute_unpad";
  check_routing(r, what);
  check_h(h, 8, "BF16", what);
  check_ptr(y_rows, r.routed_rows() > 0, "y_rows", what);
  check_ptr(y, r.tokens > 0, "y", what);
  const int k = r.topk;
  std::vector<float> acc(h);
  for (int64_t t = 0; t < r.tokens; ++t) {
    std::fill(acc.begin(), acc.end(), 0.0f);
    for (int s = 0; s < k; ++s) {
      const int32_t row = r.row_map[t * k + s];
      if (row < 0) continue;
      const float p = probs ? probs[t * k + s] : 1.0f;
      for (int64_t i = 0; i < h; ++i) acc[i] = fma_rn(p, bf16_to_f32(y_rows[row * h + i]), acc[i]);
    }
    for (int64_t i = 0; i < h; ++i) y[t * h + i] = f32_to_bf16(canon(acc[i]));
  }
}

void unpermute_unpad_backward(const bf16_t* dy, const bf16_t* y_rows, const float* probs,
                              int64_t h, const Routing& r, bf16_t* dy_rows, float* dprobs) {
  const char* what = "unpermute_unpad_backward";
  check_routing(r, what);
  check_h(h, 8, "BF16", what);
  check_ptr(dy, r.tokens > 0, "dy", what);
  check_ptr(y_rows, r.routed_rows() > 0, "y_rows", what);
  check_ptr(dy_rows, r.padded_rows() > 0, "dy_rows", what);
  check_ptr(dprobs, r.tokens > 0, "dprobs", what);
  const int k = r.topk;
  for (int64_t t = 0; t < r.tokens; ++t) {
    const bf16_t* g = dy + t * h;
    for (int s = 0; s < k; ++s) {
      const int32_t row = r.row_map[t * k + s];
      if (row < 0) {
        dprobs[t * k + s] = 0.0f;
        continue;
      }
      const float p = probs ? probs[t * k + s] : 1.0f;
      const bf16_t* v = y_rows + row * h;
      float lanes[32] = {};
      for (int64_t i = 0; i < h; ++i) {
        const float gi = bf16_to_f32(g[i]);
        dy_rows[row * h + i] = f32_to_bf16(canon(mul_rn(p, gi)));
        float& acc = lanes[(i / 8) & 31];  // 8-element group i/8 belongs to lane (i/8) % 32
        acc = fma_rn(gi, bf16_to_f32(v[i]), acc);
      }
      dprobs[t * k + s] = canon(tree32(lanes));
    }
  }
  for (int e = 0; e < r.num_experts; ++e)
    for (int64_t row = r.padded_offsets[e] + r.counts[e]; row < r.padded_offsets[e + 1]; ++row)
      std::fill(dy_rows + row * h, dy_rows + (row + 1) * h, bf16_t{0});
}

}  // namespace cpu
}  // namespace flowmoe
