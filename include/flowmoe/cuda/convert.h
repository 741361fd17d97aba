// CUDA conversion kernels (sm_90a), bit-identical to flowmoe::cpu (flowmoe/cpu/convert.h).
//
// All pointers are device pointers; layouts are those of flowmoe/tensor.h. Every launcher checks
// its arguments on the host (throws flowmoe::Error), takes a stream, never synchronises and never
// allocates. Codes and scale buffers must be 16-byte aligned (cudaMalloc gives 256).
//
// Non-finite input and underflow are reported through a DeviceStatus in device memory (counters
// are added to, so one status can collect a whole layer pass); read it when convenient, e.g. once
// per step to skip a step with non-finite values. A null status means "do not count" (except in
// build_segment_blocks, where it is required).
#pragma once

#include <cuda_runtime.h>

#include <cstdint>

#include "flowmoe/cuda/qtensor_view.h"
#include "flowmoe/cuda/status.h"  // DeviceStatus
#include "flowmoe/error.h"
#include "flowmoe/expert_layout.h"  // ExpertRowMap (quantize_weights_stored)
#include "flowmoe/tensor.h"

namespace flowmoe {
namespace cuda {


// SegmentBlocks, segment_max_blocks: flowmoe/cuda/qtensor_view.h (next to the views that use them).
// Fills block_start/block_end/block_offsets of `sb` (buffers provided by the caller) from
// sb.offsets. Malformed offsets (not from 0 to M, decreasing) count in status->bad_segments
// (status is required) and leave every block empty, so the column-wise outputs are not written:
// check bad_segments before using them. Only the first block_offsets[E] rows of a column-wise
// scale grid are written; rows up to max_blocks are left as they were.
void build_segment_blocks(const SegmentBlocks& sb, DeviceStatus* status, cudaStream_t stream);

// ---- FP8 quantize from BF16 ------------------------------------------------------------------
// x [M, K] bf16 -> codes [M, K], scales [K/128][M]. K % 128 == 0.
void quantize_row(const bf16_t* x, int64_t m, int64_t k, uint8_t* codes, uint8_t* scales,
                  DeviceStatus* status, cudaStream_t stream);
// x [M, K] bf16 -> column-wise codes [K, M], scales [max_blocks][K]; optionally (row_codes and
// row_scales not null) the row-wise copy in the same pass. K % 128 == 0.
void quantize_col(const bf16_t* x, int64_t k, const SegmentBlocks& sb, uint8_t* col_codes,
                  uint8_t* col_scales, uint8_t* row_codes, uint8_t* row_scales,
                  DeviceStatus* status, cudaStream_t stream);
// Weights w [N, K] bf16 -> codes [N, K], scales [N/128][K/128], and (if not null) the exact
// transpose codes [K, N], scales [K/128][N/128]. N, K multiples of 128.
void quantize_weight(const bf16_t* w, int64_t n, int64_t k, uint8_t* codes, uint8_t* scales,
                     uint8_t* t_codes, uint8_t* t_scales, DeviceStatus* status,
                     cudaStream_t stream);
// The same for E experts in one launch: w [E][N][K] -> codes [E][N][K], scales [E][N/128][K/128]
// and (if not null) t_codes [E][K][N], t_scales [E][K/128][N/128]; each expert's bits those of
// quantize_weight on its own slices. codes and scales may be null (the transposed copy alone: the
// backward's dgrad weights derived from the parameters), not both copies. gate_up_interleaved:
// W's copy (codes, scales) written with each expert's 128-row blocks in W1's gate / up interleaving
// (flowmoe/gemm.h interleave_gate_up, the layout GroupedGemm::fprop_swiglu reads; N = 2F, F a
// multiple of 128): the bits of interleave_gate_up on the natural copy, without it; the
// transposed copy stays as it is.
void quantize_weights(const bf16_t* w, int num_experts, int64_t n, int64_t k, uint8_t* codes,
                      uint8_t* scales, uint8_t* t_codes, uint8_t* t_scales, DeviceStatus* status,
                      cudaStream_t stream, bool gate_up_interleaved = false);
// FP32 weights (masters), rounded to BF16 (RNE) on the way: the bits of quantize_weights on their
// BF16 copy, without one; status->nonfinite counts the FP32 values that are not finite.
void quantize_weights(const float* w, int num_experts, int64_t n, int64_t k, uint8_t* codes,
                      uint8_t* scales, uint8_t* t_codes, uint8_t* t_scales, DeviceStatus* status,
                      cudaStream_t stream, bool gate_up_interleaved = false);

// quantize_weights of the layer's W [E][N][K] read where a model stores it transposed
// (flowmoe/expert_layout.h): src [E][C][L] with W[e][r][c] = (c < C and map(r) >= 0) ?
// src[e][c][map(r)] : 0 (gpt-oss's gate_up_proj and down_proj; map: ExpertStorage::w1_rows /
// w2_rows). The outputs and bits of expert_weights_to_layer followed by quantize_weights(W, ...),
// without the BF16 copy (128 x 128 blocks quantize the same either way round). N, K multiples of
// 128, C <= K, every map(r) < L; any src alignment (16-byte aligned rows take vector loads).
// gate_up_interleaved: W's copy in W1's gate / up block interleaving, as for quantize_weights.
void quantize_weights_stored(const bf16_t* src, int num_experts, int64_t c, int64_t l, const ExpertRowMap& map,
                             int64_t n, int64_t k, uint8_t* codes, uint8_t* scales, uint8_t* t_codes,
                             uint8_t* t_scales, DeviceStatus* status, cudaStream_t stream,
                             bool gate_up_interleaved = false);
void quantize_weights_stored(const float* src, int num_experts, int64_t c, int64_t l, const ExpertRowMap& map,
                             int64_t n, int64_t k, uint8_t* codes, uint8_t* scales, uint8_t* t_codes,
                             uint8_t* t_scales, DeviceStatus* status, cudaStream_t stream,
                             bool gate_up_interleaved = false);

// ---- dequantize -------------------------------------------------------------------------------
// Row-wise FP8 [M, K] -> bf16 [M, K].
void dequantize_row(const uint8_t* codes, const uint8_t* scales, int64_t m, int64_t k, bf16_t* y,
                    cudaStream_t stream);
// MXFP4 [M, K] -> bf16 [M, K] (exact).
void dequantize_mxfp4(const uint8_t* codes, const uint8_t* scales, int64_t m, int64_t k,
                      bf16_t* y, cudaStream_t stream);

// ---- building blocks of the baselines --------------------------------------------------------
// Plain transpose x [M, K] -> y [K, M], bf16.
void transpose_bf16(const bf16_t* x, int64_t m, int64_t k, bf16_t* y, cudaStream_t stream);
// xt [K, M] bf16 (already transposed), quantized along M in the segments' 128-token blocks:
// codes [K, M], scales [max_blocks][K] (the column-wise layout).
void quantize_transposed(const bf16_t* xt, int64_t k, const SegmentBlocks& sb, uint8_t* codes,
                         uint8_t* scales, DeviceStatus* status, cudaStream_t stream);

// ---- FP8 row-wise -> column-wise ----------------------------------------------------------------
// Scaling-aware transpose: row-wise [M, K] -> column-wise [K, M] by exponent shifts only.
// `mode` as in cpu::scaling_aware_transpose: kRowMax (SPEC §4) or kColumnAmax (each column
// block's own amax, taken from the codes in the same pass).
void scaling_aware_transpose(const uint8_t* row_codes, const uint8_t* row_scales, int64_t k,
                             const SegmentBlocks& sb, uint8_t* col_codes, uint8_t* col_scales,
                             DeviceStatus* status, cudaStream_t stream,
                             TransposeExponent mode = TransposeExponent::kRowMax);
// The naive path users run today (three kernels): dequantize -> transpose -> quantize.
// `work` holds 2*M*K bf16 (two intermediates).
void naive_col_copy(const uint8_t* row_codes, const uint8_t* row_scales, int64_t k,
                    const SegmentBlocks& sb, uint8_t* col_codes, uint8_t* col_scales,
                    bf16_t* work, DeviceStatus* status, cudaStream_t stream);

// ---- MXFP4 ------------------------------------------------------------------------------------
// BF16ToFP4Row: x [M, K] -> packed e2m1 [M, K/2], scales [M][K/32]. K % 32 == 0.
void quantize_mxfp4(const bf16_t* x, int64_t m, int64_t k, uint8_t* codes, uint8_t* scales,
                    DeviceStatus* status, cudaStream_t stream);
// FP4RowToFP8Row: MXFP4 [M, K] -> row-wise FP8 codes [M, K], scales [K/128][M]. K % 128 == 0.
// rows_bound: a device int; rows at or past min(M, *rows_bound) are untouched (M stays the scale
// grid's stride): a row count the host has not fetched. Null: all M rows.
void fp4_to_fp8_row(const uint8_t* fp4_codes, const uint8_t* fp4_scales, int64_t m, int64_t k,
                    uint8_t* codes, uint8_t* scales, DeviceStatus* status, cudaStream_t stream,
                    const int32_t* rows_bound = nullptr);
// FP4RowToFP8Col: MXFP4 [M, K] -> column-wise FP8 [K, M] in one pass. K % 128 == 0. `mode` as in
// cpu::fp4_to_fp8_col (the exponent of each column block).
void fp4_to_fp8_col(const uint8_t* fp4_codes, const uint8_t* fp4_scales, int64_t k,
                    const SegmentBlocks& sb, uint8_t* col_codes, uint8_t* col_scales,
                    DeviceStatus* status, cudaStream_t stream,
                    TransposeExponent mode = TransposeExponent::kRowMax);
// The stepwise baseline: FP4 -> BF16, transpose, quantize. `work` holds 2*M*K bf16.
void fp4_to_fp8_col_stepwise(const uint8_t* fp4_codes, const uint8_t* fp4_scales, int64_t k,
                             const SegmentBlocks& sb, uint8_t* col_codes, uint8_t* col_scales,
                             bf16_t* work, DeviceStatus* status, cudaStream_t stream);

// ---- FP32-scale mode (the fp8-naive recipe, SPEC §6): E4M3 with FP32 scales s = amax / 448 ----
// Scale rule of a tile with largest finite magnitude amax: s = amax / 448 (FP32 division, RNE),
// s = 1 for an all-zero tile; q = RNE_E4M3(x / s); decoded value e4m3(q) * s. A tile holding a
// non-finite value gets s = NaN and codes 0x7F (counted in status->nonfinite). Kernels:
// src/cuda/convert/fp32_scale.cu.
float fp32_scale(float amax);  // host copy of the rule, for tests
// x [M, C] bf16 -> codes [M, C]; FP32 scales, GEMM-ready: with d_offsets [E+1] (device,
// offsets[E] <= M; rows past offsets[E] belong to no expert and are left untouched) expert-packed
// (gemm.h), without (null) the plain [C/128][M] grid. C % 128 == 0.
void quantize_row_fp32_scale(const bf16_t* x, int64_t m, int64_t c, const int32_t* d_offsets,
                             int num_experts, uint8_t* codes, float* scales, DeviceStatus* status,
                             cudaStream_t stream);
// The inverse: codes [M, C] + FP32 scales (same two layouts) -> y [M, C] bf16 (RNE).
void dequantize_row_fp32_scale(const uint8_t* codes, const float* scales, int64_t m, int64_t c,
                               const int32_t* d_offsets, int num_experts, bf16_t* y,
                               cudaStream_t stream);
// xt [C, M] bf16 (already transposed) -> column-wise codes [C, M] and FP32 scales [max_blocks][C]
// over the segments' 128-token blocks (GEMM-ready for wgrad).
void quantize_transposed_fp32_scale(const bf16_t* xt, int64_t c, const SegmentBlocks& sb,
                                    uint8_t* codes, float* scales, DeviceStatus* status,
                                    cudaStream_t stream);
// E weights w [E][N][K] bf16 -> codes [E][N][K], GEMM-ready FP32 block scales
// [E][N/128][round_up(K/128, 4)], and (if not null) the exact transpose: t_codes [E][K][N],
// t_scales [E][K/128][round_up(N/128, 4)] (padding entries 0).
void quantize_weights_fp32_scale(const bf16_t* w, int num_experts, int64_t n, int64_t k,
                                 uint8_t* codes, float* scales, uint8_t* t_codes, float* t_scales,
                                 DeviceStatus* status, cudaStream_t stream);


// ---- the same launchers on device views (flowmoe/cuda/qtensor_view.h) ---------------------------
// Thin wrappers: each checks the views' layouts, scale formats and shapes on the host (throws
// flowmoe::Error) and calls the pointer launcher above. Views with UE8M0 scales; a row-wise view's
// scale_ld must equal its rows (the kernels write the tight [K/128][M] grid), a column-wise view
// covers sb.m tokens with at least sb.max_blocks scale rows.
// (view_detail::check_row, check_col, check_same_shape: flowmoe/cuda/qtensor_view.h)

// x [out.rows, out.cols] bf16 -> out (row-wise).
inline void quantize_row(const bf16_t* x, const QTensorView& out, DeviceStatus* status,
                         cudaStream_t stream) {
  view_detail::check_row(out, "quantize_row");
  quantize_row(x, out.rows, out.cols, out.codes, out.ue8m0(), status, stream);
}
// x [sb.m, col.cols] bf16 -> col (column-wise) and, if `row` is not null, the row-wise copy.
inline void quantize_col(const bf16_t* x, const SegmentBlocks& sb, const QTensorView& col,
                         const QTensorView* row, DeviceStatus* status, cudaStream_t stream) {
  view_detail::check_col(col, sb, col.cols, "quantize_col");
  if (row) {
    view_detail::check_row(*row, "quantize_col");
    view_detail::check_same_shape(col, *row, "quantize_col");
  }
  quantize_col(x, col.cols, sb, col.codes, col.ue8m0(), row ? row->codes : nullptr,
               row ? row->ue8m0() : nullptr, status, stream);
}
// One weight w [out.rows, out.cols] -> out and, if not null, its exact transpose t [cols, rows].
inline void quantize_weight(const bf16_t* w, const QTensorView& out, const QTensorView* t,
                            DeviceStatus* status, cudaStream_t stream) {
  check_view(out, Layout::kWeight128x128, ScaleFormat::kUe8m0, "quantize_weight");
  if (t) {
    check_view(*t, Layout::kWeight128x128, ScaleFormat::kUe8m0, "quantize_weight");
    FLOWMOE_CHECK(t->rows == out.cols && t->cols == out.rows,
                  "quantize_weight: transposed view [" << t->rows << ", " << t->cols
                                                       << "]; expected [" << out.cols << ", "
                                                       << out.rows << "]");
  }
  quantize_weight(w, out.rows, out.cols, out.codes, out.ue8m0(), t ? t->codes : nullptr,
                  t ? t->ue8m0() : nullptr, status, stream);
}
inline void dequantize_row(const QTensorView& in, bf16_t* y, cudaStream_t stream) {
  view_detail::check_row(in, "dequantize_row");
  dequantize_row(in.codes, in.ue8m0(), in.rows, in.cols, y, stream);
}
inline void dequantize_mxfp4(const QTensorView& in, bf16_t* y, cudaStream_t stream) {
  check_view(in, Layout::kMxfp4Row1x32, ScaleFormat::kUe8m0, "dequantize_mxfp4");
  dequantize_mxfp4(in.codes, in.ue8m0(), in.rows, in.cols, y, stream);
}
inline void scaling_aware_transpose(const QTensorView& row, const SegmentBlocks& sb,
                                    const QTensorView& col, DeviceStatus* status,
                                    cudaStream_t stream,
                                    TransposeExponent mode = TransposeExponent::kRowMax) {
  view_detail::check_row(row, "scaling_aware_transpose");
  view_detail::check_col(col, sb, row.cols, "scaling_aware_transpose");
  scaling_aware_transpose(row.codes, row.ue8m0(), row.cols, sb, col.codes, col.ue8m0(), status,
                          stream, mode);
}
inline void naive_col_copy(const QTensorView& row, const SegmentBlocks& sb, const QTensorView& col,
                           bf16_t* work, DeviceStatus* status, cudaStream_t stream) {
  view_detail::check_row(row, "naive_col_copy");
  view_detail::check_col(col, sb, row.cols, "naive_col_copy");
  naive_col_copy(row.codes, row.ue8m0(), row.cols, sb, col.codes, col.ue8m0(), work, status,
                 stream);
}
inline void quantize_mxfp4(const bf16_t* x, const QTensorView& out, DeviceStatus* status,
                           cudaStream_t stream) {
  check_view(out, Layout::kMxfp4Row1x32, ScaleFormat::kUe8m0, "quantize_mxfp4");
  quantize_mxfp4(x, out.rows, out.cols, out.codes, out.ue8m0(), status, stream);
}
inline void fp4_to_fp8_row(const QTensorView& in, const QTensorView& out, DeviceStatus* status,
                           cudaStream_t stream) {
  check_view(in, Layout::kMxfp4Row1x32, ScaleFormat::kUe8m0, "fp4_to_fp8_row");
  view_detail::check_row(out, "fp4_to_fp8_row");
  view_detail::check_same_shape(in, out, "fp4_to_fp8_row");
  fp4_to_fp8_row(in.codes, in.ue8m0(), in.rows, in.cols, out.codes, out.ue8m0(), status, stream);
}
inline void fp4_to_fp8_col(const QTensorView& in, const SegmentBlocks& sb, const QTensorView& col,
                           DeviceStatus* status, cudaStream_t stream) {
  check_view(in, Layout::kMxfp4Row1x32, ScaleFormat::kUe8m0, "fp4_to_fp8_col");
  view_detail::check_col(col, sb, in.cols, "fp4_to_fp8_col");
  fp4_to_fp8_col(in.codes, in.ue8m0(), in.cols, sb, col.codes, col.ue8m0(), status, stream);
}

}  // namespace cuda
}  // namespace flowmoe
