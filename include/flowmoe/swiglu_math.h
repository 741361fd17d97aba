// SwiGLU arithmetic, defined once for host and device so the CPU reference and the CUDA kernels
// produce identical bits (docs/SWIGLU.md §2).
//
// Every function here is a fixed sequence of IEEE binary32 operations, each rounded to nearest
// even: multiply, add, fused multiply-add (one rounding), and the correctly rounded reciprocal.
// No libm call (host expf and CUDA expf differ), no approximate hardware instruction.
//
// How the sequence is pinned down on both sides:
//  - device: every operation is an explicit intrinsic (__fmul_rn, __fadd_rn, __fmaf_rn,
//    __frcp_rn); nvcc never contracts these into FMAs, and they are IEEE operations whatever
//    -use_fast_math / -ftz / -prec-div say.
//  - host: multiply-adds are explicit std::fma. A host compiler with -ffp-contract=fast (GCC's
//    default in GNU mode) and an FMA target may still fuse a plain product into a following add.
//    The code is written so that this cannot change a result: every product whose value reaches an
//    addition is either exact (a multiple of a power of two, or k * kLn2Hi, see exp_nonpos) or
//    tiny next to 1 (1 + t with t < 2^-126, where fused and unfused both give 1). Every other
//    product only feeds products, selections and the reciprocal.
//  - FLT_EVAL_METHOD must be 0 (no x87 extended precision); checked below.
//  - NaN payloads differ between host and device arithmetic; stored BF16 results use the canonical
//    quiet NaN 0x7FC0 (bf16_canonical), so stored bits never depend on them.
#pragma once

#include <cfloat>
#include <cmath>
#include <cstdint>

#include "flowmoe/numerics.h"

#if !defined(__CUDA_ARCH__)
static_assert(FLT_EVAL_METHOD == 0,
              "flowmoe/swiglu_math.h needs binary32 arithmetic evaluated in binary32 "
              "(FLT_EVAL_METHOD == 0; x87 extended precision would change the bits)");
#endif

namespace flowmoe {
namespace num {

// ---- the four operations ------------------------------------------------------------------------
FLOWMOE_HD float f_mul(float a, float b) {
#if defined(__CUDA_ARCH__)
  return __fmul_rn(a, b);
#else
  return a * b;
#endif
}
FLOWMOE_HD float f_add(float a, float b) {
#if defined(__CUDA_ARCH__)
  return __fadd_rn(a, b);
#else
  return a + b;
#endif
}
FLOWMOE_HD float f_fma(float a, float b, float c) {
#if defined(__CUDA_ARCH__)
  return __fmaf_rn(a, b, c);
#else
  return std::fma(a, b, c);
#endif
}
// 1 / a, correctly rounded, for a in [1, 2] (the only range the SwiGLU code calls it with).
// Device: the hardware approximation (MUFU.RCP) refined by one FMA Newton step, which is the fast
// path nvcc emits for __frcp_rn on normal inputs, without __frcp_rn's range check and call to its
// slow path (~6 instructions per element; a in [1, 2] never needs it). A GPU test compares it with
// __frcp_rn for every binary32 in [1, 2] (SwigluMathGpu.ReciprocalIsCorrectlyRoundedOnOneToTwo).
FLOWMOE_HD float f_rcp(float a) {
#if defined(__CUDA_ARCH__)
  float y;
  asm("rcp.approx.ftz.f32 %0, %1;" : "=f"(y) : "f"(a));
  return __fmaf_rn(y, __fmaf_rn(-a, y, 1.0f), y);
#else
  return 1.0f / a;
#endif
}
FLOWMOE_HD bool f32_is_nan(float x) { return (f32_bits(x) & 0x7FFFFFFFu) > 0x7F800000u; }
// BF16 of a SwiGLU result: round to nearest even, any NaN as the canonical 0x7FC0 (the functions
// below leave NaN payloads to the hardware; only this conversion makes stored bits canonical).
FLOWMOE_HD uint16_t bf16_canonical(float x) {
  return f32_is_nan(x) ? static_cast<uint16_t>(kCanonicalNaN >> 16) : f32_to_bf16(x);
}
// A stored binary32 result: any NaN as the canonical 0x7FC00000.
FLOWMOE_HD float f32_canonical(float x) { return f32_is_nan(x) ? f32_from_bits(kCanonicalNaN) : x; }

// ---- exp(x) for x <= 0 ----------------------------------------------------------------------------
// Cody-Waite reduction x = k ln2 + r, |r| <= ln2/2 (+ a few ulp), then the degree-7 Taylor
// polynomial of e^r by Horner with FMAs, then the scaling by 2^k in two exact steps.
//  - x is first clamped to >= -104 (NaN and -inf become -104); e^-104 < 2^-150 rounds to +0.
//  - j = fma(x, log2 e, 1.5 * 2^23) holds k = round(x log2 e) in its low bits (ulp(j) = 1);
//    k = bits(j) - bits(1.5 * 2^23) in [-150, 0] and kf = j - 1.5 * 2^23 exactly.
//  - kLn2Hi has 15 significant bits and |k| < 2^8, so k * kLn2Hi is exact, and x - k * kLn2Hi is
//    exact (both are multiples of ulp(x) and the difference is below 2^(exponent of x + 1)):
//    hi = fma(-kf, kLn2Hi, x) is that exact value.
//  - r = fma(-kf, kLn2Lo, hi).
//  - e^r in [0.70, 1.42]; 2^k is applied as 2^k1 * 2^k2 (k1 = ceil(k/2), k2 = floor(k/2), both
//    >= -75) so each factor is a binary32 normal: the first product is exact, the second rounds
//    once (only when the result is subnormal).
// Accuracy against exp in float64: within 1 ulp (docs/SWIGLU.md; checked by the CPU tests).
constexpr float kLog2e = 1.44269502f;         // 0x1.715476p+0
constexpr float kRoundMagic = 12582912.0f;    // 1.5 * 2^23
constexpr uint32_t kRoundMagicBits = 0x4B400000u;
constexpr float kLn2Hi = 0.693145751953125f;  // 0x1.62e4p-1, 15 significant bits
constexpr float kLn2Lo = 1.42860677e-06f;     // ln 2 - kLn2Hi, rounded to binary32
constexpr float kExpMinArg = -104.0f;

FLOWMOE_HD float exp_nonpos(float x) {
  const float xc = x >= kExpMinArg ? x : kExpMinArg;  // NaN compares false
  const float j = f_fma(xc, kLog2e, kRoundMagic);
  const int k = static_cast<int>(f32_bits(j) - kRoundMagicBits);  // in [-150, 0]
  const float kf = f_add(j, -kRoundMagic);                         // k, exactly
  const float hi = f_fma(-kf, kLn2Hi, xc);                         // exact
  const float r = f_fma(-kf, kLn2Lo, hi);
  float p = 1.98412701e-4f;          // 1/5040
  p = f_fma(p, r, 1.38888892e-3f);   // 1/720
  p = f_fma(p, r, 8.33333377e-3f);   // 1/120
  p = f_fma(p, r, 4.16666679e-2f);   // 1/24
  p = f_fma(p, r, 1.66666672e-1f);   // 1/6
  p = f_fma(p, r, 0.5f);
  p = f_fma(p, r, 1.0f);
  p = f_fma(p, r, 1.0f);
  const int k1 = -((-k) >> 1), k2 = k - k1;  // ceil(k/2), floor(k/2): both in [-75, 0]
  return f_mul(f_mul(p, f32_from_bits(static_cast<uint32_t>(k1 + 127) << 23)),
               f32_from_bits(static_cast<uint32_t>(k2 + 127) << 23));
}

// ---- SiLU and SwiGLU ------------------------------------------------------------------------------
// With t = e^(-|g|) (never overflows) and rd = 1 / (1 + t) (correctly rounded):
//   sigmoid(g)      s  = rd      (g >= 0)   or  t * rd  (g < 0)
//   1 - sigmoid(g)  sc = t * rd  (g >= 0)   or  rd      (g < 0)   (no cancellation)
//   silu(g)            = g * s                       = g / (1 + e^-g) in exact arithmetic
//   silu'(g)           = s * fma(g, sc, 1)           = s (1 + g (1 - s))
// -0 counts as g >= 0. Non-finite g: silu(NaN) = NaN, silu(+inf) = +inf, silu(-inf) = NaN
// (-inf * 0), silu'(+-inf) = silu'(NaN) = NaN: a non-finite gate never gives finite results.
struct SiluParts {
  float s;   // sigmoid(g)
  float sc;  // 1 - sigmoid(g)
};
FLOWMOE_HD SiluParts sigmoid_parts(float g) {
  const float t = exp_nonpos(-f32_abs(g));
  const float rd = f_rcp(f_add(1.0f, t));
  const float trd = f_mul(t, rd);
  const bool pos = g >= 0.0f;
  return SiluParts{pos ? rd : trd, pos ? trd : rd};
}
FLOWMOE_HD float silu_f32(float g) { return f_mul(g, sigmoid_parts(g).s); }
FLOWMOE_HD float dsilu_f32(float g) {
  const SiluParts p = sigmoid_parts(g);
  return f_mul(p.s, f_fma(g, p.sc, 1.0f));
}

// Forward: a = silu(gate) * up.
FLOWMOE_HD float swiglu_f32(float gate, float up) {
  return f_mul(f_mul(gate, sigmoid_parts(gate).s), up);
}

// Backward: given da = dL/da,
//   dgate = da * (up * silu'(gate))
//   dup   = da * silu(gate)
struct SwigluGrad {
  float dgate;
  float dup;
};
FLOWMOE_HD SwigluGrad dswiglu_f32(float da, float gate, float up) {
  const SiluParts p = sigmoid_parts(gate);
  const float silu = f_mul(gate, p.s);
  const float ds = f_mul(p.s, f_fma(gate, p.sc, 1.0f));
  return SwigluGrad{f_mul(da, f_mul(up, ds)), f_mul(da, silu)};
}

// The MoE form a' = p * swiglu(gate, up) (p: the row's routing probability). Given da' = dL/da':
//   dgate, dup = dswiglu_f32(f_mul(da', p), gate, up)
//   a          = swiglu_f32(gate, up)        (dp = sum over the row of da' * a)
// from one sigmoid; the same bits as those two functions.
struct SwigluGradProb {
  float dgate;
  float dup;
  float a;
};
FLOWMOE_HD SwigluGradProb dswiglu_prob_f32(float da, float p, float gate, float up) {
  const SiluParts s = sigmoid_parts(gate);
  const float silu = f_mul(gate, s.s);
  const float ds = f_mul(s.s, f_fma(gate, s.sc, 1.0f));
  const float dq = f_mul(da, p);
  return SwigluGradProb{f_mul(dq, f_mul(up, ds)), f_mul(dq, silu), f_mul(silu, up)};
}

// ---- the experts' gated activation -----------------------------------------------------------------
// act(gate, up), the function between GEMM1 and GEMM2 (MoeConfig::activation):
//   kSwiglu         silu(gate) * up                                   (Qwen, DeepSeek, Mixtral, ...)
//   kClampedSwiglu  gpt-oss: g = min(gate, limit), u = clamp(up, -limit, limit),
//                   act = (u + 1) * (g * sigmoid(alpha * g))
// The clamped form in binary32, in the model's order of operations (z = alpha * g, then
// glu = g * sigmoid(z), then (u + 1) * glu); sigmoid from sigmoid_parts as for SwiGLU.
//   d act / d gate = (u + 1) * sigmoid(z) * (1 + z (1 - sigmoid(z)))  where gate <= limit, else 0
//   d act / d up   = glu                                               where |up| <= limit, else 0
// (torch.clamp's gradient: the bound itself passes it). A NaN gate or up stays NaN (the
// comparisons are false, so nothing is clamped and no gradient is masked); +inf is clamped to the
// limit like any large value (the model does the same).
enum class ActivationKind : uint8_t { kSwiglu = 0, kClampedSwiglu = 1 };

// The activations as data: each kind's name (the C ABI's MoeConfig::activation string, Python's
// activation=) and whether it takes alpha / limit. A new gated activation is a kind, its row here,
// and its branch of act_f32 / dact_prob_f32 below (both backends' kernels call those).
struct ActivationRow {
  ActivationKind kind;
  const char* name;
  bool takes_alpha_limit;
};
constexpr ActivationRow kActivations[] = {
    {ActivationKind::kSwiglu, "swiglu", false},
    {ActivationKind::kClampedSwiglu, "clamped-swiglu", true},
};

struct GatedActivation {
  ActivationKind kind = ActivationKind::kSwiglu;
  float alpha = 1.702f;  // kClampedSwiglu: the sigmoid's slope (gpt-oss: swiglu_alpha)
  float limit = 7.0f;    // kClampedSwiglu: the clamp (gpt-oss: swiglu_limit), > 0
  FLOWMOE_HD bool clamped() const { return kind == ActivationKind::kClampedSwiglu; }
};

// Why a kernel cannot compute `act` (an unknown kind; the clamped SwiGLU without limit > 0 and a
// finite alpha), or null: the host checks of the SwiGLU kernels and of the GEMMs' fused epilogues.
inline const char* activation_unsupported(const GatedActivation& act) {
  if (act.kind != ActivationKind::kSwiglu && act.kind != ActivationKind::kClampedSwiglu) return "unknown activation kind";
  if (act.clamped() && !(act.limit > 0.0f && std::isfinite(act.alpha)))
    return "the clamped SwiGLU needs limit > 0 and a finite alpha";
  return nullptr;
}

FLOWMOE_HD float clamp_gate(float gate, float limit) { return gate > limit ? limit : gate; }
FLOWMOE_HD float clamp_up(float up, float limit) {
  return up > limit ? limit : (up < -limit ? -limit : up);
}

// act(gate, up); kSwiglu: the bits of swiglu_f32.
FLOWMOE_HD float act_f32(const GatedActivation& act, float gate, float up) {
  if (!act.clamped()) return swiglu_f32(gate, up);
  const float g = clamp_gate(gate, act.limit), u = clamp_up(up, act.limit);
  const float glu = f_mul(g, sigmoid_parts(f_mul(g, act.alpha)).s);
  return f_mul(f_add(u, 1.0f), glu);
}

// The MoE form a' = p * act(gate, up) given da' (as dswiglu_prob_f32; p = 1 with dq = da for the
// plain backward): dgate, dup of f_mul(da', p), and a = act(gate, up).
FLOWMOE_HD SwigluGradProb dact_prob_f32(const GatedActivation& act, float da, float p, float gate,
                                        float up) {
  if (!act.clamped()) return dswiglu_prob_f32(da, p, gate, up);
  const float g = clamp_gate(gate, act.limit), u = clamp_up(up, act.limit);
  const float z = f_mul(g, act.alpha);
  const SiluParts s = sigmoid_parts(z);
  const float glu = f_mul(g, s.s);
  const float dglu = f_mul(s.s, f_fma(z, s.sc, 1.0f));
  const float u1 = f_add(u, 1.0f);
  const float dq = f_mul(da, p);
  const float dgate = gate > act.limit ? 0.0f : f_mul(dq, f_mul(u1, dglu));
  const float dup = (up > act.limit || up < -act.limit) ? 0.0f : f_mul(dq, glu);
  return SwigluGradProb{dgate, dup, f_mul(u1, glu)};
}
// Without the probability: dgate, dup of da (kSwiglu: the bits of dswiglu_f32).
FLOWMOE_HD SwigluGrad dact_f32(const GatedActivation& act, float da, float gate, float up) {
  if (!act.clamped()) return dswiglu_f32(da, gate, up);
  const SwigluGradProb g = dact_prob_f32(act, da, 1.0f, gate, up);
  return SwigluGrad{g.dgate, g.dup};
}

// The copy of h a flow recipe saves for its backward (FP8 or MXFP4) keeps the clamp's decision.
// With the clamped activation a gate above the limit is saved as at least 2 * limit, an up beyond
// +-limit as at least 2 * limit in magnitude: after FP8 or MXFP4 rounding (relative error below
// 1/3) the backward still finds it beyond the limit, so its gradient mask is the forward's, and the
// value it then uses is the limit itself, as in the forward. Without this, a gate a little above the
// limit could be rounded onto it and pass a gradient the forward did not have. (The other way, a
// value at or within the limit rounded past it, cannot happen in FP8 when the limit lies on the
// E4M3 grid, as 7 does; MXFP4's grid is coarser: 7 may be saved as 8. The mark itself is lost
// where its block's scale flushes it to zero: an MXFP4 1x32 block of h with amax above 27 x limit
// (192 for gpt-oss), an FP8 1x128 tile above ~5e5 x limit; there the backward sees 0.) Values within the
// limits are saved as they are; kSwiglu saves h unchanged. 2 * limit is taken rounded to BF16, so a
// BF16 h stays BF16 (the quantizers of BF16 tensors save it).
FLOWMOE_HD float saved_mark(const GatedActivation& act) { return bf16_to_f32(f32_to_bf16(f_mul(2.0f, act.limit))); }
FLOWMOE_HD float saved_gate(const GatedActivation& act, float gate) {
  if (!act.clamped() || !(gate > act.limit)) return gate;
  const float m = saved_mark(act);
  return gate > m ? gate : m;
}
FLOWMOE_HD float saved_up(const GatedActivation& act, float up) {
  if (!act.clamped()) return up;
  const float m = saved_mark(act);
  if (up > act.limit) return up > m ? up : m;
  if (up < -act.limit) return up < -m ? up : -m;
  return up;
}

}  // namespace num

using num::ActivationKind;
using num::ActivationRow;
using num::kActivations;
using num::GatedActivation;

}  // namespace flowmoe
