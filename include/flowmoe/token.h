// Token movement for an MoE layer (SPEC §5): the router, the routing metadata, fused
// permute+pad and fused unpermute+unpad (with its backward). docs/TOKEN.md is the long form.
//
// Every function exists twice: flowmoe::cpu (plain loops, the specification) and flowmoe::cuda
// (kernels, stream-ordered, no allocation, no host synchronisation except fetch_routing_counts).
// The CUDA results equal the CPU results bit for bit: expert ids, probabilities, logit gradients,
// the auxiliary loss, every routing table and every moved or reduced row. That holds because
//   - exp is our own function (tok::exp_f32 below: integer and IEEE-rounded operations only), not
//     the host's expf or the device's __expf / expf;
//   - every reduction has one fixed order, written down below and in docs/TOKEN.md, and the CPU
//     reproduces the GPU's order (including its 32-lane tree);
//   - every multiply-add that matters is an explicit fma (no compiler contraction can change it).
// Assumptions: no --use_fast_math / -ffast-math, no -ftz=true / denormals-are-zero, IEEE binary32
// arithmetic on the host (SSE, not x87), default rounding mode. Products that meet an addition go
// through tok::mul_rn, so contraction into FMA cannot change a result on either side.
//
// Shapes are row-major and written like `[T, E] fp32`. T = tokens, E = experts, k = top-k,
// H = hidden size, A = alignment of expert segments, Mp = padded rows (device value
// padded_offsets[E]), R = row capacity of the permuted buffers (routing_max_rows).
#pragma once

#include <cmath>
#include <cstdint>
#include <vector>

#include "flowmoe/numerics.h"
#include "flowmoe/tensor.h"

namespace flowmoe {

// ---- router configuration ------------------------------------------------------------------
constexpr int kRouterMaxExperts = 1024;  // E limit of the router kernels (one warp per token)
constexpr int kMaxTopk = 32;             // k limit everywhere (one lane per slot)
constexpr int kMaxAlign = 1024;          // segment alignment limit
constexpr int kAuxChunk = 64;            // tokens per partial sum of the aux loss (fixed order)

enum class RouterScore : uint8_t {
  kSoftmax,  // p = softmax(z) over all E; select top-k of p (+bias); probs = p (or renormalised)
  kSigmoid,  // s = sigmoid(z);            select top-k of s (+bias); probs = s (or renormalised)
};

struct RouterConfig {
  int num_experts = 0;  // E, 1..kRouterMaxExperts
  int topk = 0;         // k, 1..min(E, kMaxTopk)
  RouterScore score = RouterScore::kSoftmax;
  // Divide the k chosen scores by their sum (in slot order). DeepSeek-V3: sigmoid + renormalise.
  // For sigmoid, an all-zero chosen sum (every chosen logit below about -103) gives probs 0.
  bool renormalize = false;
  float scale = 1.0f;  // multiplies the final probs (DeepSeek-V3's routed_scaling_factor)
};
// Throws flowmoe::Error unless 1 <= E <= kRouterMaxExperts and 1 <= k <= min(E, kMaxTopk).
void validate_router(const RouterConfig& cfg, const char* what);

// ---- shared host/device arithmetic (the definition both sides execute) -----------------------
namespace tok {

FLOWMOE_HD float fma_rn(float a, float b, float c) {
#if defined(__CUDA_ARCH__)
  return __fmaf_rn(a, b, c);
#else
  return std::fma(a, b, c);
#endif
}
// A product rounded on its own: never contracted into a following addition. (Where the host has
// FMA instructions, __FP_FAST_FMAF, a compiler may contract a*b+c; the volatile prevents it.)
FLOWMOE_HD float mul_rn(float a, float b) {
#if defined(__CUDA_ARCH__)
  return __fmul_rn(a, b);
#elif defined(__FP_FAST_FMAF)
  volatile float r = a * b;
  return r;
#else
  return a * b;
#endif
}
FLOWMOE_HD float rint_f32(float x) {
#if defined(__CUDA_ARCH__)
  return rintf(x);
#else
  return std::nearbyint(x);  // default rounding mode: to nearest even
#endif
}
FLOWMOE_HD bool is_nan(float x) { return (num::f32_bits(x) & 0x7FFFFFFFu) > 0x7F800000u; }
// Every float result is stored through canon(): a NaN becomes the canonical quiet NaN
// (0x7FC00000), since the NaN bits the hardware produces differ (x86: sign set, payload
// propagated; CUDA: 0x7FFFFFFF).
FLOWMOE_HD float canon(float x) { return is_nan(x) ? num::f32_from_bits(num::kCanonicalNaN) : x; }

// e^x for binary32, max error about 1 ulp (tested against double exp). Range reduction
// x = k*ln2 + r with a two-part ln2 (fma), degree-7 Taylor polynomial by Horner fma on
// |r| <= ln2/2, scaling by 2^k through the exponent bits (one rounding into subnormals).
// NaN -> NaN, x > 88.7228 -> +Inf, x < -103.9721 -> 0.
FLOWMOE_HD float exp_f32(float x) {
  if (is_nan(x)) return x;
  if (x > 88.72283935546875f) return num::f32_from_bits(0x7F800000u);
  if (x < -103.97208404541015625f) return 0.0f;
  const float kf = rint_f32(mul_rn(x, 1.44269502162933349609375f));  // x * log2(e), one rounding
  const int k = static_cast<int>(kf);
  float r = fma_rn(kf, -0.693145751953125f, x);  // ln2 high part (16 significant bits)
  r = fma_rn(kf, -1.428606765330187045037746429443359375e-06f, r);  // ln2 - high part
  float p = 1.98412701138295233249664306640625e-04f;                // 1/5040
  p = fma_rn(p, r, 1.388888922519981861114501953125e-03f);          // 1/720
  p = fma_rn(p, r, 8.333333767950534820556640625e-03f);             // 1/120
  p = fma_rn(p, r, 4.16666679084300994873046875e-02f);               // 1/24
  p = fma_rn(p, r, 1.6666667163372039794921875e-01f);               // 1/6
  p = fma_rn(p, r, 0.5f);
  p = fma_rn(p, r, 1.0f);
  p = fma_rn(p, r, 1.0f);
  if (k > 127) return mul_rn(mul_rn(p, 2.0f), num::exp2i(k - 1));
  if (k < -126) return mul_rn(mul_rn(p, num::exp2i(k + 64)), num::exp2i(-64));
  return mul_rn(p, num::exp2i(k));
}

// sigmoid(z) and its derivative sigmoid(z) * sigmoid(-z), from one e = exp(-|z|):
// sigmoid(|z|) = 1 / (1 + e), sigmoid(-|z|) = e / (1 + e).
FLOWMOE_HD void sigmoid_and_grad(float z, float* s, float* ds) {
  const float e = exp_f32(-num::f32_abs(z));
  const float d = 1.0f + e;
  const float pos = 1.0f / d, neg = e / d;
  const bool nonneg = !(z < 0.0f);
  *s = nonneg ? pos : neg;
  *ds = mul_rn(pos, neg);
}
FLOWMOE_HD float sigmoid_f32(float z) {
  float s, ds;
  sigmoid_and_grad(z, &s, &ds);
  return s;
}

// The selection order of the top-k: larger value first, any number before NaN, ties (equal
// values, or both NaN) to the lower expert index. A strict total order on (value, index).
FLOWMOE_HD bool better(float a, int ia, float b, int ib) {
  const bool na = is_nan(a), nb = is_nan(b);
  if (na != nb) return nb;
  if (!na && a != b) return a > b;
  return ia < ib;
}

}  // namespace tok

// ---- routing metadata -------------------------------------------------------------------------
// From expert ids [T, k] int32 (the router's output, or after dispatch the local ids): each
// (token, slot) pair routed to expert e gets one row of e's segment. Segments follow each other
// in expert order; within a segment rows are ordered by ascending token, then ascending slot.
// Each segment is padded up to a multiple of A with zero rows (an empty expert has no rows).
//   counts[e]          pairs routed to e
//   offsets[e]         sum of counts before e                        (unpadded segment start)
//   padded_offsets[e]  sum of round_up(counts, A) before e           (padded segment start)
//   row_map[t, s]      padded_offsets[e] + rank of (t, s) within e   (-1: slot dropped)
//   row_map_unpadded   offsets[e] + rank                             (-1: slot dropped)
// An id of -1 marks a dropped slot (not routed on this device): it gets row -1, contributes
// nothing to unpermute and gets dprob 0. Any other id outside [0, E) is bad input (the CPU throws;
// the GPU counts it in DeviceStatus::bad_segments and treats it as dropped).
//
// Bound on the padded rows, for sizing buffers on the host without a sync:
// R = T*k + min(E, T*k) * (A - 1).
int64_t routing_max_rows(int64_t tokens, int topk, int num_experts, int align);

namespace cpu {

// ---- router ------------------------------------------------------------------------------
// logits [T, E] fp32, bias [E] fp32 or null (added to the scores for selection only, DeepSeek-V3's
// aux-loss-free balancing) -> ids [T, k] int32 in selection order, probs [T, k] fp32.
// Per token: softmax: m = max_e z (NaN ignored), x_e = exp_f32(z_e - m), S = warp_sum(x),
// p_e = x_e / S. sigmoid: p_e = sigmoid(z_e). Selection by tok::better on p_e (+ bias_e). With
// renormalize: q_j = p_j / (p_0 + p_1 + ... in slot order). probs_j = q_j * scale.
// warp_sum is the 32-lane order of docs/TOKEN.md: lane l sums e = l, l+32, ... in turn, then a
// butterfly tree (l, l+16), (l, l+8), ... Returns the number of non-finite logits (their tokens'
// probs come out NaN: never silently finite).
int64_t router_forward(const float* logits, int64_t tokens, const RouterConfig& cfg,
                       const float* bias, int32_t* ids, float* probs);

// Load-balancing auxiliary loss (Switch Transformer): loss = alpha * E * sum_e f_e * P_e with
// f_e = (pairs routed to e) / (T*k) from ids [T, k] (ids outside [0, E) are not counted) and
// P_e = mean over tokens of the router probability of e over all E experts (softmax: p_e;
// sigmoid: s_e / sum_e' s_e', DeepSeek-V3's sequence-wise form). f is a constant (no gradient).
// Writes aux_coef [E] = d loss / d P_{t,e} = alpha*E*f_e / T (the same for every token), which
// router_backward takes. Order: P_e sums tokens in chunks of kAuxChunk (in token order), chunks in
// order; the final sum over e is a warp_sum of fma products. T >= 1.
float router_aux_loss(const float* logits, const int32_t* ids, int64_t tokens,
                      const RouterConfig& cfg, float alpha, float* aux_coef);

// Backward to the logits: dlogits [T, E] = d/dz of (sum_{t,j} dprobs[t,j] * probs[t,j]) plus, when
// aux_coef [E] is not null, aux_dloss * d(aux loss)/dz. logits [T, E] as in the forward, ids [T, k]
// from it (ids outside [0, E) are skipped), dprobs [T, k]. dlogits is overwritten.
void router_backward(const float* logits, int64_t tokens, const RouterConfig& cfg,
                     const int32_t* ids, const float* dprobs, const float* aux_coef,
                     float aux_dloss, float* dlogits);

// ---- routing metadata ----------------------------------------------------------------------
struct Routing {
  int64_t tokens = 0;  // T
  int topk = 0;        // k
  int num_experts = 0; // E
  int align = 1;       // A
  std::vector<int32_t> counts;            // [E]
  std::vector<int32_t> offsets;           // [E+1]
  std::vector<int32_t> padded_offsets;    // [E+1]
  std::vector<int32_t> row_map;           // [T, k]
  std::vector<int32_t> row_map_unpadded;  // [T, k]
  int64_t padded_rows() const { return padded_offsets.empty() ? 0 : padded_offsets.back(); }
  int64_t routed_rows() const { return offsets.empty() ? 0 : offsets.back(); }
};
// ids [T, k] int32. Throws on ids < -1 or >= E, k outside [1, kMaxTopk], A outside [1, kMaxAlign].
Routing build_routing(const int32_t* ids, int64_t tokens, int topk, int num_experts, int align);

// ---- permute + pad: token rows -> padded expert segments (rows [0, Mp) written) -------------
// x [T, H] bf16 -> out [Mp, H] bf16 (H % 8 == 0). Padding rows are zero.
void permute_pad_bf16(const bf16_t* x, int64_t h, const Routing& r, bf16_t* out);
// FP8 row-wise: codes [T, H] e4m3, scales [H/128][T] -> out_codes [Mp, H],
// out_scales [H/128][scale_ld] (scale_ld >= Mp; rows >= Mp of each scale row untouched).
// Padding rows: codes 0, scale code 0. H % 128 == 0.
void permute_pad_fp8(const uint8_t* codes, const uint8_t* scales, int64_t h, const Routing& r,
                     uint8_t* out_codes, uint8_t* out_scales, int64_t scale_ld);
// MXFP4: codes [T, H/2] packed e2m1, scales [T][H/32] -> out_codes [Mp, H/2], out_scales
// [Mp][H/32]. Padding rows: codes 0, scale code 0. H % 32 == 0.
void permute_pad_mxfp4(const uint8_t* codes, const uint8_t* scales, int64_t h, const Routing& r,
                       uint8_t* out_codes, uint8_t* out_scales);

// ---- unpermute + unpad ----------------------------------------------------------------------
// y [T, H] bf16 = bf16( sum over s = 0..k-1 with row_map[t,s] >= 0 of probs[t,s] * y_rows[row] ),
// the sum in FP32 as acc = fma(prob, value, acc) from acc = 0 in slot order, rounded once to BF16
// (RNE). y_rows [Mp, H] bf16. probs [T, k] fp32, or null for weight 1 (the backward of permute).
void unpermute_unpad(const bf16_t* y_rows, const float* probs, int64_t h, const Routing& r,
                     bf16_t* y);
// Backward: dy [T, H] bf16, y_rows [Mp, H] bf16 (the forward input), probs [T, k] ->
//   dy_rows [Mp, H] bf16: dy_rows[row(t,s)] = bf16(probs[t,s] * dy[t]) (FP32 product, one BF16
//                         rounding); padding rows zero;
//   dprobs [T, k] fp32:   dot(dy[t], y_rows[row(t,s)]) in FP32 (0 for a dropped slot); order: the
//                         row is read as 8-element groups, group g goes to lane g % 32, each lane
//                         accumulates its groups in order by fma, then the butterfly tree.
void unpermute_unpad_backward(const bf16_t* dy, const bf16_t* y_rows, const float* probs,
                              int64_t h, const Routing& r, bf16_t* dy_rows, float* dprobs);

}  // namespace cpu
}  // namespace flowmoe

// =============================================================================================
// CUDA (declared when the CUDA backend is built: link flowmoe_cuda, which defines FLOWMOE_HAVE_CUDA)
#if defined(FLOWMOE_HAVE_CUDA) || defined(__CUDACC__)
#include <cuda_runtime.h>

#include "flowmoe/cuda/qtensor_view.h"
#include "flowmoe/cuda/status.h"  // DeviceStatus
#include "flowmoe/error.h"

namespace flowmoe {
namespace cuda {

// ---- router (one warp per token) ------------------------------------------------------------
// Same contract as cpu::router_forward; non-finite logits are added to status->nonfinite.
// logits [T, E] fp32, bias [E] or null -> ids [T, k] int32, probs [T, k] fp32.
void router_forward(const float* logits, int64_t tokens, const RouterConfig& cfg,
                    const float* bias, int32_t* ids, float* probs, DeviceStatus* status,
                    cudaStream_t stream);
// Aux loss as cpu::router_aux_loss: loss [1] fp32 and aux_coef [E] fp32 (device). workspace of
// router_aux_workspace_bytes(T, E) bytes (16-byte aligned). T >= 1.
size_t router_aux_workspace_bytes(int64_t tokens, int num_experts);
void router_aux_loss(const float* logits, const int32_t* ids, int64_t tokens,
                     const RouterConfig& cfg, float alpha, float* loss, float* aux_coef,
                     void* workspace, cudaStream_t stream);
// dlogits [T, E] fp32 (overwritten), as cpu::router_backward. aux_coef [E] (device) or null.
void router_backward(const float* logits, int64_t tokens, const RouterConfig& cfg,
                     const int32_t* ids, const float* dprobs, const float* aux_coef,
                     float aux_dloss, float* dlogits, cudaStream_t stream);

// ---- routing metadata ----------------------------------------------------------------------
// Device buffers, provided by the caller (build_routing fills them). Row capacity R =
// max_rows() = routing_max_rows(T, k, E, A); the padded total Mp = padded_offsets[E] stays on the
// device. row_map_unpadded is optional (needed only by the baseline kernels below).
struct Routing {
  int64_t tokens = 0;                  // T
  int topk = 0;                        // k, 1..kMaxTopk
  int num_experts = 0;                 // E, >= 1
  int align = 1;                       // A, 1..kMaxAlign
  int32_t* counts = nullptr;           // [E]
  int32_t* offsets = nullptr;          // [E+1]
  int32_t* padded_offsets = nullptr;   // [E+1]
  int32_t* row_map = nullptr;          // [T, k]
  int32_t* row_map_unpadded = nullptr; // [T, k] or null
  // [max_rows()] or null: the source token of each padded row, -1 for padding rows (and rows past
  // Mp). When given, build_routing fills it and permute_pad_fp8 gathers the scale grid through it
  // (coalesced writes) instead of scattering each token's scale bytes.
  int32_t* row_src = nullptr;
  void* workspace = nullptr;           // routing_workspace_bytes(T, k, E) bytes
  int64_t max_rows() const { return routing_max_rows(tokens, topk, num_experts, align); }
};
size_t routing_workspace_bytes(int64_t tokens, int topk, int num_experts);
// ids [T, k] int32 (device) -> every table of `r`. Two kernels, no host sync. Ids outside [-1, E)
// count in status->bad_segments (status may be null) and are treated as dropped.
void build_routing(const int32_t* ids, const Routing& r, DeviceStatus* status, cudaStream_t stream);
// Copies counts [E] to the host (h_counts, pageable or pinned) and waits for the stream: the one
// call that synchronises. Returns Mp (the padded rows).
int64_t fetch_routing_counts(const Routing& r, int32_t* h_counts, cudaStream_t stream);

// ---- fused permute + pad (one kernel each; rows >= Mp are not written) ----------------------
// x [T, H] bf16 -> out [R, H] bf16. H % 8 == 0.
void permute_pad_bf16(const bf16_t* x, int64_t h, const Routing& r, bf16_t* out,
                      cudaStream_t stream);
// codes [T, H], scales [H/128][T] -> out_codes [R, H], out_scales [H/128][scale_ld]. scale_ld must
// be >= Mp: R always is; Mp itself (from fetch_routing_counts) gives a tight grid. Mp is on the
// device, so the host checks only 1 <= scale_ld < 2^31. H % 128 == 0.
void permute_pad_fp8(const uint8_t* codes, const uint8_t* scales, int64_t h, const Routing& r,
                     uint8_t* out_codes, uint8_t* out_scales, int64_t scale_ld,
                     cudaStream_t stream);
// codes [T, H/2], scales [T][H/32] -> out_codes [R, H/2], out_scales [R][H/32]. H % 32 == 0.
void permute_pad_mxfp4(const uint8_t* codes, const uint8_t* scales, int64_t h, const Routing& r,
                       uint8_t* out_codes, uint8_t* out_scales, cudaStream_t stream);

// The same on device views (flowmoe/cuda/qtensor_view.h), UE8M0 scales. in: row-wise [T, H]
// (scale_ld = T); out: row-wise [R, H] with its scale_ld (>= Mp, as above). Both checked on the host.
inline void permute_pad_fp8(const QTensorView& in, const Routing& r, const QTensorView& out,
                            cudaStream_t stream) {
  check_view(in, Layout::kRow1x128, ScaleFormat::kUe8m0, "permute_pad_fp8 (input)");
  check_view(out, Layout::kRow1x128, ScaleFormat::kUe8m0, "permute_pad_fp8 (output)");
  FLOWMOE_CHECK(in.rows == r.tokens && in.scale_ld == in.rows && out.cols == in.cols &&
                    out.rows >= r.max_rows(),
                "permute_pad_fp8: input [" << in.rows << ", " << in.cols << "] (scale_ld "
                                           << in.scale_ld << "), output [" << out.rows << ", "
                                           << out.cols << "]; expected input [" << r.tokens
                                           << ", H] with scale_ld = T and output [>= "
                                           << r.max_rows() << ", H]");
  permute_pad_fp8(in.codes, in.ue8m0(), in.cols, r, out.codes, out.ue8m0(), out.scale_ld, stream);
}
// in: MXFP4 [T, H]; out: MXFP4 [R, H].
inline void permute_pad_mxfp4(const QTensorView& in, const Routing& r, const QTensorView& out,
                              cudaStream_t stream) {
  check_view(in, Layout::kMxfp4Row1x32, ScaleFormat::kUe8m0, "permute_pad_mxfp4 (input)");
  check_view(out, Layout::kMxfp4Row1x32, ScaleFormat::kUe8m0, "permute_pad_mxfp4 (output)");
  FLOWMOE_CHECK(in.rows == r.tokens && out.cols == in.cols && out.rows >= r.max_rows(),
                "permute_pad_mxfp4: input [" << in.rows << ", " << in.cols << "], output ["
                                             << out.rows << ", " << out.cols
                                             << "]; expected input [" << r.tokens
                                             << ", H] and output [>= " << r.max_rows() << ", H]");
  permute_pad_mxfp4(in.codes, in.ue8m0(), in.cols, r, out.codes, out.ue8m0(), stream);
}

// ---- fused unpermute + unpad ------------------------------------------------------------------
// y_rows [R, H] bf16, probs [T, k] or null (weight 1) -> y [T, H] bf16. H % 8 == 0.
void unpermute_unpad(const bf16_t* y_rows, const float* probs, int64_t h, const Routing& r,
                     bf16_t* y, cudaStream_t stream);
// dy [T, H], y_rows [R, H], probs [T, k] -> dy_rows [R, H] (padding rows zero), dprobs [T, k].
void unpermute_unpad_backward(const bf16_t* dy, const bf16_t* y_rows, const float* probs,
                              int64_t h, const Routing& r, bf16_t* dy_rows, float* dprobs,
                              cudaStream_t stream);

// ---- building blocks of the baselines (unfused sequences, for the benchmark and tests) ------
// "Compact" buffers hold the routed rows without padding: [T*k, ...] capacity, offsets[E] rows
// used, expert e's rows at offsets[e] + rank. They need r.row_map_unpadded.
// permute without padding: x [T, ...] -> compact rows (row_map_unpadded); FP8 scales
// [H/128][scale_ld], scale_ld >= offsets[E] (T*k always is).
void permute_bf16(const bf16_t* x, int64_t h, const Routing& r, bf16_t* out, cudaStream_t stream);
void permute_fp8(const uint8_t* codes, const uint8_t* scales, int64_t h, const Routing& r,
                 uint8_t* out_codes, uint8_t* out_scales, int64_t scale_ld, cudaStream_t stream);
void permute_mxfp4(const uint8_t* codes, const uint8_t* scales, int64_t h, const Routing& r,
                   uint8_t* out_codes, uint8_t* out_scales, cudaStream_t stream);
// pad: compact rows -> padded segments (zero rows), one gather kernel.
void pad_bf16(const bf16_t* in, int64_t h, const Routing& r, bf16_t* out, cudaStream_t stream);
void pad_fp8(const uint8_t* codes, const uint8_t* scales, int64_t in_scale_ld, int64_t h,
             const Routing& r, uint8_t* out_codes, uint8_t* out_scales, int64_t out_scale_ld,
             cudaStream_t stream);
void pad_mxfp4(const uint8_t* codes, const uint8_t* scales, int64_t h, const Routing& r,
               uint8_t* out_codes, uint8_t* out_scales, cudaStream_t stream);
// unpad: padded segments -> compact rows (bf16).
void unpad_bf16(const bf16_t* in, int64_t h, const Routing& r, bf16_t* out, cudaStream_t stream);
// unpermute of compact rows (row_map_unpadded); same arithmetic as unpermute_unpad.
void unpermute(const bf16_t* y_compact, const float* probs, int64_t h, const Routing& r,
               bf16_t* y, cudaStream_t stream);
// backward of unpermute into compact rows (row_map_unpadded); pad_bf16 then gives the padded
// dy_rows of unpermute_unpad_backward.
void unpermute_backward(const bf16_t* dy, const bf16_t* y_compact, const float* probs, int64_t h,
                        const Routing& r, bf16_t* dy_compact, float* dprobs, cudaStream_t stream);

}  // namespace cuda
}  // namespace flowmoe
#endif
