// SwiGLU and its fused FP8 quantization, forward and backward (SPEC §5, issue 4; docs/SWIGLU.md).
//
// Layout of the GEMM1 output H [M, 2F] (row-major BF16): gate = columns [0, F), up = columns
// [F, 2F) (Megatron's chunk(2, dim=-1) order).
//   forward    A[t, j]      = act(H[t, j], H[t, F + j])                            A [M, F]
//   backward   dH[t, j]     = dA[t, j] * d act / d gate                            dH [M, 2F]
//              dH[t, F + j] = dA[t, j] * d act / d up
// computed in binary32 by the shared functions of flowmoe/swiglu_math.h (num::act_f32, dact_f32,
// dact_prob_f32: host and device give the same bits). F must be a positive multiple of 128.
//
// The gated activation (every function's last parameter `act`, a num::GatedActivation; the
// default is SwiGLU, so existing calls are unchanged):
//   kSwiglu         act = silu(gate) * up: dgate = dA * (up * silu'(gate)), dup = dA * silu(gate)
//   kClampedSwiglu  gpt-oss: g = min(gate, limit), u = clamp(up, -limit, limit),
//                   act = (u + 1) * g * sigmoid(alpha * g); the gradient of gate is 0 where
//                   gate > limit, that of up 0 where |up| > limit (docs/SWIGLU.md §11).
// The GEMMs' fused SwiGLU epilogues (src/cuda/gemm) compute SwiGLU only.
//
// Quantized outputs use the layouts of flowmoe/tensor.h and the scale rule and NaN policy of
// cpu::quantize_row / quantize_col:
//   swiglu_quant     A row-wise   == quantize_row(binary32 A)  (one rounding per value; the
//                                    unfused path rounds to BF16 first, docs/SWIGLU.md §4)
//                    A col-wise   == scaling_aware_transpose(A row-wise, segments)      (option)
//                    H row-wise   == quantize_row(H)  [M, 2F]                            (option)
//   dswiglu_quant    dH row-wise  == quantize_row(dswiglu(dA, H))        dH formed in BF16, as
//                    dH col-wise  == quantize_col(dswiglu(dA, H), seg)   the unfused sequence does
// The backward also takes H saved as row-wise FP8 (what the `flow` recipe keeps) or as MXFP4 1x32
// (`flow-fp4`): it is decoded exactly (code * 2^e in binary32) and goes through the same arithmetic.
//
// Counters (QuantStats on the CPU, DeviceStatus on the GPU):
//   nonfinite  the non-finite values among the tensors being quantized (binary32 A, BF16 dH, and
//              BF16 H when it is quantized too), each counted once however many layouts it is
//              written in. Their tiles are marked NaN (codes 0x7F, scale 0xFF). With SwiGLU a
//              non-finite input always makes at least one output of its row non-finite
//              (docs/SWIGLU.md §3; the clamped activation clamps an infinite up or +inf gate to
//              the limit, §11), and finite inputs can overflow, so the count is > 0 whenever
//              anything went bad.
//   underflow  the values the forward column copy could not keep exactly (as
//              scaling_aware_transpose counts them).
//
// Routing probability (the MoE layer's form a' = p * act; docs/SWIGLU.md §10). Every function
// takes an optional `prow` [M] fp32, the probability of each row (null: p = 1, the plain form):
//   forward   A'[t, j] = f_mul(act_f32(act, gate, up), prow[t]), then rounded / quantized as A
//   backward  dH from num::dact_prob_f32(act, dA'[t, j], prow[t], gate, up), i.e. the gradient
//             given dA = f_mul(dA', p); with `dprow_part` also the gradient of prow as partial
//             sums per 128-feature tile, dprow_part [F/128][M] (tile-major like the row scales):
//               part[b][t] = sum over the features j of tile b of dA'[t, j] * A[t, j]
//             in this fixed order: the tile's feature 8g + 2q + i (group g = 0..15, pair q = 0..3,
//             i = 0, 1) gives the pair value P(g, q) = fma(dA'_1, A_1, fma(dA'_0, A_0, +0.0)); for
//             each q the 16 groups are summed by the pairwise tree (adjacent groups first:
//             ((P0 + P1) + (P2 + P3)) + ...), R(q); part = (R(0) + R(1)) + (R(2) + R(3)). (A
//             half-warp holding a tile, lane g the group g, sums by the butterfly xor 1, 2, 4, 8;
//             a WGMMA fragment holding pair q of every group sums in the thread, then over its quad.)
//             The row's gradient is dprow[t] = part[0][t] + part[1][t] + ... (tile order):
//             sum_dprow_parts. Padding rows (A = 0, finite dA') get 0; a NaN is stored as 0x7FC00000.
//             dprow_part needs prow.
#pragma once

#include <cstdint>

#include "flowmoe/swiglu_math.h"  // GatedActivation
#include "flowmoe/tensor.h"

namespace flowmoe {
namespace cpu {

// ---- forward --------------------------------------------------------------------------------------
// h [M, 2F] bf16 -> a [M, F] bf16 (RNE, NaN 0x7FC0). Returns nonfinite = non-finite elements of a.
QuantStats swiglu(const bf16_t* h, int64_t m, int64_t f, bf16_t* a, const float* prow = nullptr,
                  const GatedActivation& act = {});
// The same in binary32: the values the fused forward quantizes.
QuantStats swiglu(const bf16_t* h, int64_t m, int64_t f, float* a, const float* prow = nullptr,
                  const GatedActivation& act = {});
// Fused: h -> A row-wise FP8 [M, F] (a_row). Options: with `seg` and `a_col`, the column-wise
// copy of A over the token segments; with `h_row`, H itself quantized row-wise [M, 2F]
// (the activation the `flow` recipe saves for the backward). Pass null to skip an option.
QuantStats swiglu_quant(const bf16_t* h, int64_t m, int64_t f, QTensor* a_row,
                        const Segments* seg, QTensor* a_col, QTensor* h_row,
                        const float* prow = nullptr, const GatedActivation& act = {});

// The copy of H [M, 2F] bf16 a flow recipe saves for the backward, before its quantization
// (num::saved_gate / saved_up: with the clamped activation, values beyond the limits pushed to
// twice the limit so that the quantized copy keeps the clamp's decision; SwiGLU: H itself).
// swiglu_quant's h_row and the CUDA launchers' saved H quantize this copy.
void saved_h(const bf16_t* h, int64_t m, int64_t f, bf16_t* out, const GatedActivation& act);

// ---- backward -------------------------------------------------------------------------------------
// da [M, F] bf16, h [M, 2F] bf16 -> dh [M, 2F] bf16. Returns nonfinite = non-finite elements of dh.
QuantStats dswiglu(const bf16_t* da, const bf16_t* h, int64_t m, int64_t f, bf16_t* dh,
                   const float* prow = nullptr, float* dprow_part = nullptr,
                   const GatedActivation& act = {});
// The same with H saved as row-wise FP8 (h_row: kRow1x128, [M, 2F]) or MXFP4 (kMxfp4Row1x32).
QuantStats dswiglu(const bf16_t* da, const QTensor& h_row, bf16_t* dh,
                   const float* prow = nullptr, float* dprow_part = nullptr,
                   const GatedActivation& act = {});
// Fused: -> dH row-wise [M, 2F] and column-wise [2F, M] over the segments, from one pass.
QuantStats dswiglu_quant(const bf16_t* da, const bf16_t* h, int64_t m, int64_t f,
                         const Segments& seg, QTensor* dh_row, QTensor* dh_col,
                         const float* prow = nullptr, float* dprow_part = nullptr,
                         const GatedActivation& act = {});
QuantStats dswiglu_quant(const bf16_t* da, const QTensor& h_row, const Segments& seg,
                         QTensor* dh_row, QTensor* dh_col, const float* prow = nullptr,
                         float* dprow_part = nullptr, const GatedActivation& act = {});
// dprow [M] from the partial sums [F/128][M]: part[0] + part[1] + ... in tile order.
void sum_dprow_parts(const float* dprow_part, int64_t m, int64_t f, float* dprow);

}  // namespace cpu
}  // namespace flowmoe

#if defined(FLOWMOE_HAVE_CUDA)
#include <cuda_runtime.h>

#include "flowmoe/cuda/qtensor_view.h"  // QTensorView, SegmentBlocks, the views' checks
#include "flowmoe/cuda/status.h"        // DeviceStatus

namespace flowmoe {
namespace cuda {

// Device pointers, layouts as above; arguments are checked on the host (flowmoe::Error), launches
// are stream-ordered, nothing allocates or synchronises. BF16 and code buffers must be 16-byte
// aligned (cudaMalloc gives 256). `status` may be null (then nothing is counted).

// ---- forward --------------------------------------------------------------------------------------
// GEMM1's expert bias (flowmoe/expert_bias.h) applied as the row launchers below read h: a row r
// of segment e reads bf16_rne(f32(h[r, c]) + bias[e, c]) (add_expert_bias's bits; rows past the
// last segment as they are), so the activation and the saved copy of H see the biased h, without
// add_expert_bias's pass over h. biased_h: h itself where the biased values are also stored there
// (in place: the recipes that save h in BF16, as add_expert_bias leaves it), or null where h is
// scratch (read only). Default: no bias.
struct GateUpBias {
  const float* bias = nullptr;        // [num_segments, 2F] FP32, 16-byte aligned; null: none
  const int32_t* offsets = nullptr;   // [num_segments + 1] device int32, offsets[0] == 0
  int num_segments = 0;
  bf16_t* biased_h = nullptr;
};
// Plain BF16 activation (the baseline): h [M, 2F] -> a [M, F].
// rows_bound (every row-wise launcher below): a device int; rows at or past min(M, *rows_bound)
// are neither read nor written nor counted (M still the scale grids' stride): the row count of a
// step the host has not fetched, e.g. the padded offsets[E] of routing. Null: all M rows.
void swiglu(const bf16_t* h, int64_t m, int64_t f, bf16_t* a, DeviceStatus* status,
            cudaStream_t stream, const float* prow = nullptr, const int32_t* rows_bound = nullptr,
            const GatedActivation& act = {}, const GateUpBias& bias = {});
// Fused activation + row-wise quantize: a_codes [M, F], a_scales [F/128][M]. Optionally (h_codes
// and h_scales not null) H row-wise in the same pass: h_codes [M, 2F], h_scales [2F/128][M].
void swiglu_quant(const bf16_t* h, int64_t m, int64_t f, uint8_t* a_codes, uint8_t* a_scales,
                  uint8_t* h_codes, uint8_t* h_scales, DeviceStatus* status, cudaStream_t stream,
                  const float* prow = nullptr, const int32_t* rows_bound = nullptr,
                  const GatedActivation& act = {}, const GateUpBias& bias = {});
// The same with H saved as MXFP4 instead (the `flow-fp4` recipe): h4_codes [M, 2F/2] (two E2M1 per
// byte, even index in the low nibble), h4_scales [M][2F/32] == cpu::quantize_mxfp4(H).
void swiglu_quant_h4(const bf16_t* h, int64_t m, int64_t f, uint8_t* a_codes, uint8_t* a_scales,
                     uint8_t* h4_codes, uint8_t* h4_scales, DeviceStatus* status,
                     cudaStream_t stream, const float* prow = nullptr,
                     const int32_t* rows_bound = nullptr, const GatedActivation& act = {},
                     const GateUpBias& bias = {});
// The same plus the column-wise copy of A over the segments (M = sb.m), fused (no GateUpBias: no
// pipeline with GEMM1's bias calls it; add_expert_bias first where one would): a_col_codes
// [F, M], a_col_scales [sb.max_blocks][F]; bit-identical to scaling_aware_transpose of the
// row-wise output (underflow counted). h_codes/h_scales optional as above.
void swiglu_quant_col(const bf16_t* h, int64_t f, const SegmentBlocks& sb, uint8_t* a_codes,
                      uint8_t* a_scales, uint8_t* a_col_codes, uint8_t* a_col_scales,
                      uint8_t* h_codes, uint8_t* h_scales, DeviceStatus* status,
                      cudaStream_t stream, const float* prow = nullptr,
                      const GatedActivation& act = {});

// ---- backward -------------------------------------------------------------------------------------
// Plain BF16 backward (first step of the unfused baseline): da [M, F], h [M, 2F] -> dh [M, 2F].
// dh_gate_up: dh's columns as gate / up pairs (2 j: d gate j, 2 j + 1: d up j; the order of a
// gate_up_proj stored so, gemm.h StoredW) instead of the gate half then the up half.
void dswiglu(const bf16_t* da, const bf16_t* h, int64_t m, int64_t f, bf16_t* dh,
             DeviceStatus* status, cudaStream_t stream, const float* prow = nullptr,
             float* dprow_part = nullptr, const int32_t* rows_bound = nullptr,
             const GatedActivation& act = {}, bool dh_gate_up = false);
// Fused backward + row-wise and column-wise quantize, one pass (M = sb.m):
// row_codes [M, 2F], row_scales [2F/128][M], col_codes [2F, M], col_scales [sb.max_blocks][2F].
void dswiglu_quant(const bf16_t* da, const bf16_t* h, int64_t f, const SegmentBlocks& sb,
                   uint8_t* row_codes, uint8_t* row_scales, uint8_t* col_codes,
                   uint8_t* col_scales, DeviceStatus* status, cudaStream_t stream,
                   const float* prow = nullptr, float* dprow_part = nullptr,
                   const GatedActivation& act = {});
// The same with H saved as row-wise FP8: h_codes [M, 2F], h_scales [2F/128][M].
void dswiglu_quant_fp8h(const bf16_t* da, const uint8_t* h_codes, const uint8_t* h_scales,
                        int64_t f, const SegmentBlocks& sb, uint8_t* row_codes,
                        uint8_t* row_scales, uint8_t* col_codes, uint8_t* col_scales,
                        DeviceStatus* status, cudaStream_t stream, const float* prow = nullptr,
                        float* dprow_part = nullptr, const GatedActivation& act = {});
// The same with H saved as MXFP4 (h4_codes [M, 2F/2], h4_scales [M][2F/32]), decoded exactly.
void dswiglu_quant_fp4h(const bf16_t* da, const uint8_t* h4_codes, const uint8_t* h4_scales,
                        int64_t f, const SegmentBlocks& sb, uint8_t* row_codes,
                        uint8_t* row_scales, uint8_t* col_codes, uint8_t* col_scales,
                        DeviceStatus* status, cudaStream_t stream, const float* prow = nullptr,
                        float* dprow_part = nullptr, const GatedActivation& act = {});
// dprow [M] = sum of dprow_part [F/128][M] over the tiles in order (as cpu::sum_dprow_parts).
void sum_dprow_parts(const float* dprow_part, int64_t m, int64_t f, float* dprow,
                     cudaStream_t stream);
// The unfused sequence users run today (three kernels): dswiglu -> quantize_row -> quantize_col.
// `work` holds M * 2F bf16 (dH). Same outputs, bit for bit, as dswiglu_quant (non-finite values
// are counted by the row quantizer only, so the count matches too). SwiGLU only (no `act`):
// it is the baseline the fused backward is measured against.
void dswiglu_quant_unfused(const bf16_t* da, const bf16_t* h, int64_t f, const SegmentBlocks& sb,
                           uint8_t* row_codes, uint8_t* row_scales, uint8_t* col_codes,
                           uint8_t* col_scales, bf16_t* work, DeviceStatus* status,
                           cudaStream_t stream);


// ---- the same on device views (flowmoe/cuda/qtensor_view.h) ------------------------------------
// UE8M0 views, checked on the host; F = a_row.cols. The saved H view picks the launcher: row-wise
// FP8 [M, 2F] (swiglu_quant / dswiglu_quant_fp8h) or MXFP4 [M, 2F] (swiglu_quant_h4 /
// dswiglu_quant_fp4h); null saves nothing (forward only).
namespace view_detail {
inline void check_saved_h(const QTensorView& h, int64_t m, int64_t f, const char* what) {
  check_view(h, h.layout == Layout::kMxfp4Row1x32 ? Layout::kMxfp4Row1x32 : Layout::kRow1x128,
             ScaleFormat::kUe8m0, what);
  FLOWMOE_CHECK(h.rows == m && h.cols == 2 * f &&
                    (h.layout == Layout::kMxfp4Row1x32 || h.scale_ld == h.rows),
                what << ": saved H view [" << h.rows << ", " << h.cols << "]; expected [" << m
                     << ", " << 2 * f << "] (row-wise FP8 with scale_ld = rows, or MXFP4)");
}
}  // namespace view_detail

// h [M, 2F] bf16 -> a_row [M, F] and, if h_saved is not null, H in its format.
inline void swiglu_quant(const bf16_t* h, const QTensorView& a_row, const QTensorView* h_saved,
                         DeviceStatus* status, cudaStream_t stream, const float* prow = nullptr,
                         const GatedActivation& act = {}) {
  view_detail::check_row(a_row, "swiglu_quant");
  const int64_t m = a_row.rows, f = a_row.cols;
  if (h_saved) view_detail::check_saved_h(*h_saved, m, f, "swiglu_quant");
  if (h_saved && h_saved->layout == Layout::kMxfp4Row1x32)
    swiglu_quant_h4(h, m, f, a_row.codes, a_row.ue8m0(), h_saved->codes, h_saved->ue8m0(), status,
                    stream, prow, nullptr, act);
  else
    swiglu_quant(h, m, f, a_row.codes, a_row.ue8m0(), h_saved ? h_saved->codes : nullptr,
                 h_saved ? h_saved->ue8m0() : nullptr, status, stream, prow, nullptr, act);
}
// The same plus A column-wise over the segments (M = sb.m); h_saved null or row-wise FP8.
inline void swiglu_quant_col(const bf16_t* h, const SegmentBlocks& sb, const QTensorView& a_row,
                             const QTensorView& a_col, const QTensorView* h_saved,
                             DeviceStatus* status, cudaStream_t stream,
                             const float* prow = nullptr, const GatedActivation& act = {}) {
  view_detail::check_row(a_row, "swiglu_quant_col");
  view_detail::check_col(a_col, sb, a_row.cols, "swiglu_quant_col");
  const int64_t f = a_row.cols;
  if (h_saved) {
    view_detail::check_saved_h(*h_saved, sb.m, f, "swiglu_quant_col");
    FLOWMOE_CHECK(h_saved->layout == Layout::kRow1x128,
                  "swiglu_quant_col: saves H row-wise FP8 only; expected a row-wise 1x128 view");
  }
  swiglu_quant_col(h, f, sb, a_row.codes, a_row.ue8m0(), a_col.codes, a_col.ue8m0(),
                   h_saved ? h_saved->codes : nullptr, h_saved ? h_saved->ue8m0() : nullptr,
                   status, stream, prow, act);
}
// da [M, F] bf16 and the saved H (row-wise FP8 or MXFP4) -> dH row-wise and column-wise.
inline void dswiglu_quant(const bf16_t* da, const QTensorView& h_saved, const SegmentBlocks& sb,
                          const QTensorView& dh_row, const QTensorView& dh_col,
                          DeviceStatus* status, cudaStream_t stream, const float* prow = nullptr,
                          float* dprow_part = nullptr, const GatedActivation& act = {}) {
  const int64_t f = h_saved.cols / 2;
  view_detail::check_saved_h(h_saved, sb.m, f, "dswiglu_quant");
  view_detail::check_row(dh_row, "dswiglu_quant");
  view_detail::check_col(dh_col, sb, 2 * f, "dswiglu_quant");
  view_detail::check_same_shape(dh_row, h_saved, "dswiglu_quant");
  if (h_saved.layout == Layout::kMxfp4Row1x32)
    dswiglu_quant_fp4h(da, h_saved.codes, h_saved.ue8m0(), f, sb, dh_row.codes, dh_row.ue8m0(),
                       dh_col.codes, dh_col.ue8m0(), status, stream, prow, dprow_part, act);
  else
    dswiglu_quant_fp8h(da, h_saved.codes, h_saved.ue8m0(), f, sb, dh_row.codes, dh_row.ue8m0(),
                       dh_col.codes, dh_col.ue8m0(), status, stream, prow, dprow_part, act);
}

}  // namespace cuda
}  // namespace flowmoe
#endif  // FLOWMOE_HAVE_CUDA
