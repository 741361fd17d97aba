// The CUDA layer's backward per pipeline (recipe_path.h), up to the dX rows: dY to the experts,
// GEMM2 dgrad + wgrad, dSwiGLU*prob, GEMM1 dgrad + wgrad. Each path leaves the dX rows [Mp, H] bf16
// in ExpertBuffers::rows_bf16 (the BF16 dY rows' storage, if any) and the partial sums of dp ([F/128][Mp], swiglu.h) in
// RoutingBuffers::dprob_partials, and calls mark_dx_rows_ready() between GEMM1 dgrad and GEMM1
// wgrad; the tail (backward_tail.cu) continues from there. In every path a dgrad runs before the
// wgrad that reads the same gradient.
//   GEMM2 dgrad / wgrad: bf16 and fp8-naive below, blockwise / flow / flow-fp4 in fp8_gemm2_grads
//   GEMM1 dgrad / wgrad: bf16 and fp8-naive below, blockwise / flow / flow-fp4 in fp8_gemm1_grads
#include <cuda_runtime.h>

#include <string>

#include "cuda/common.cuh"
#include "cuda/moe/layer.h"
#include "flowmoe/expert_bias.h"
#include "flowmoe/swiglu.h"

namespace flowmoe {
namespace cuda {
namespace moe {

// ---- bf16 ----------------------------------------------------------------------------------------
void CudaMoeLayer::backward_bf16(const bf16_t* dy, const MoeGrads& g) {
  ExpertBuffers& b = ws_.expert;
  const WeightBuffers& w = ws_.weights;
  { auto s = bwd(comm_ ? "dispatch dy (bf16)" : "permute+pad dy (bf16)");  // dY rows into rows_bf16
    move_bf16(dy, b.rows_bf16, MoePass::kBackward, report_names::kDispatchDy); }
  { auto s = bwd("GEMM2 dgrad (bf16)"); bf16_dgrad(b.rows_bf16, H_, F_, w.w2_bf16, b.da); }
  if (g.wants_dw2()) { auto s = bwd("GEMM2 wgrad (bf16)"); bf16_wgrad(b.rows_bf16, H_, b.a, F_, g.dw2, g.dw2_bf16); }
  { auto s = bwd("dSwiGLU*prob (bf16)");
    cuda::dswiglu(b.da, b.h, Mp_, F_, b.dh, st_bwd(), stream_, ws_.routing.row_prob, ws_.routing.dprob_partials,
                  rows_bound(), cfg_.activation); }
  gemm1_bias_grad_bf16(g);
  // GEMM1 dgrad overwrites dY's storage with the dX rows: GEMM2's grads have read it
  { auto s = bwd("GEMM1 dgrad (bf16)"); bf16_dgrad(b.dh, 2 * F_, H_, w.w1_bf16, b.rows_bf16); }
  mark_dx_rows_ready();
  if (g.wants_dw1()) {
    auto s = bwd("GEMM1 wgrad (bf16)");
    bf16_wgrad(b.dh, 2 * F_, b.x_perm, H_, g.dw1, g.dw1_bf16);
  }
}

// ---- blockwise -----------------------------------------------------------------------------------
void CudaMoeLayer::backward_blockwise(const bf16_t* dy, const MoeGrads& g) {
  ExpertBuffers& b = ws_.expert;
  const SegmentBlocks sb = blocks();
  { auto s = bwd(comm_ ? "dispatch dy (bf16)" : "permute+pad dy (bf16)");  // dY rows into rows_bf16
    move_bf16(dy, b.rows_bf16, MoePass::kBackward, report_names::kDispatchDy); }
  { auto s = bwd("quantize dY (row + col)");
    quantize_col(b.rows_bf16, H_, sb, b.dy_col.codes, b.dy_col.ue8m0(), b.dy_row.codes, b.dy_row.ue8m0(),
                 st_bwd(), stream_); }
  log_rows(MoePass::kBackward, CastKind::kQuantize, report_names::kQuantizeDYBoth, 1, 2, H_);
  fp8_gemm2_grads(g, -1);  // (it ends before the dh quantize overwrites dY's copies)
  { auto s = bwd("dSwiGLU*prob (bf16)");
    cuda::dswiglu(b.da, b.h, Mp_, F_, b.dh, st_bwd(), stream_, ws_.routing.row_prob, ws_.routing.dprob_partials,
                  rows_bound(), cfg_.activation); }
  gemm1_bias_grad_bf16(g);
  { auto s = bwd("quantize dh (row + col)");
    quantize_col(b.dh, 2 * F_, sb, b.dh_col.codes, b.dh_col.ue8m0(), b.dh_row.codes, b.dh_row.ue8m0(), st_bwd(),
                 stream_); }
  log_rows(MoePass::kBackward, CastKind::kQuantize, report_names::kQuantizeDhBoth, 1, 2, 2 * F_);
  fp8_gemm1_grads(g, b.dh_row, b.dh_col, b.x_perm_col, -1);
}

// The UE8M0 recipes' backward GEMMs (blockwise, flow, flow-fp4), each dgrad followed by the wgrad
// that reads the same gradient; `side`: the side event the wgrad waits for, or -1.
// GEMM2: dgrad from dY row-wise into da, wgrad from dY's and a''s column copies into dW2.
void CudaMoeLayer::fp8_gemm2_grads(const MoeGrads& g, int side) {
  ExpertBuffers& b = ws_.expert;
  weight_dgrad(2, b.dy_row, b.da, st_bwd_aux());
  fp8_gemm2_wgrad(g, side);
}
// GEMM2's wgrad alone (after the side event `side`, or -1), from dY's and a''s column copies.
void CudaMoeLayer::fp8_gemm2_wgrad(const MoeGrads& g, int side) {
  if (side >= 0) streams_.join(side);
  if (!g.wants_dw2()) return;
  auto s = bwd("GEMM2 wgrad (fp8)");
  fp8_wgrad(ws_.expert.dy_col, H_, ws_.expert.a_col, F_, g.dw2, g.dw2_bf16);
}
// GEMM1: dgrad from dh row-wise into the dX rows (rows_bf16), then mark_dx_rows_ready; wgrad from dh's column
// copy and x_perm's (`x_perm_col`) into dW1.
void CudaMoeLayer::fp8_gemm1_grads(const MoeGrads& g, const QTensorView& dh_row, const QTensorView& dh_col,
                                   const QTensorView& x_perm_col, int side) {
  ExpertBuffers& b = ws_.expert;
  weight_dgrad(1, dh_row, b.rows_bf16, st_bwd_aux());
  mark_dx_rows_ready();
  if (side >= 0) streams_.join(side);
  if (!g.wants_dw1()) return;
  auto s = bwd("GEMM1 wgrad (fp8)");
  fp8_wgrad(dh_col, 2 * F_, x_perm_col, H_, g.dw1, g.dw1_bf16);
}

// ---- fp8-naive -----------------------------------------------------------------------------------
// Column copy: dequantize (row, FP32 scales, expert-packed) -> transpose -> quantize column-wise
// with fresh FP32 scales into `col`.
void CudaMoeLayer::naive_col(const QTensorView& row, int64_t c, const QTensorView& col, WgradOperand what) {
  ExpertBuffers& b = ws_.expert;
  const SegmentBlocks sb = blocks();
  dequantize_row_fp32_scale(row.codes, row.f32(), Mp_, c, segment_offsets(), El_, b.naive_dequantized, stream_);
  log_rows(MoePass::kBackward, CastKind::kDequantize, dq_t_q_dequantize_name(what), 1, 1, c);
  transpose_bf16(b.naive_dequantized, Mp_, c, b.naive_transposed, stream_);
  quantize_transposed_fp32_scale(b.naive_transposed, c, sb, col.codes, col.f32(), st_bwd(), stream_);
  log_rows(MoePass::kBackward, CastKind::kQuantize, dq_t_q_quantize_name(what), 1, 1, c);
}

void CudaMoeLayer::backward_naive(const bf16_t* dy, const MoeGrads& g) {
  ExpertBuffers& b = ws_.expert;
  naive_entry(MoePass::kBackward, dy, b.rows_bf16);  // the dY rows
  { auto s = bwd("quantize dY (row, fp32 scales)");
    quantize_row_fp32_scale(b.rows_bf16, Mp_, H_, segment_offsets(), El_, b.dy_row_f32.codes, b.dy_row_f32.f32(),
                            st_bwd(), stream_); }
  log_rows(MoePass::kBackward, CastKind::kQuantize, report_names::kQuantizeDYFp32Scale, 1, 1, H_);
  { auto s = bwd("DQ->T->Q dY"); naive_col(b.dy_row_f32, H_, b.dy_col_f32, WgradOperand::kGemm2Grad); }
  weight_dgrad(2, b.dy_row_f32, b.da, st_bwd_aux());
  { auto s = bwd("DQ->T->Q a'"); naive_col(b.a_f32, F_, b.a_col_f32, WgradOperand::kGemm2Input); }
  if (g.wants_dw2()) { auto s = bwd("GEMM2 wgrad (fp8)");
    fp8_wgrad(b.dy_col_f32, H_, b.a_col_f32, F_, g.dw2, g.dw2_bf16); }
  { auto s = bwd("dSwiGLU*prob (bf16)");
    cuda::dswiglu(b.da, b.h, Mp_, F_, b.dh, st_bwd(), stream_, ws_.routing.row_prob, ws_.routing.dprob_partials,
                  rows_bound(), cfg_.activation); }
  gemm1_bias_grad_bf16(g);
  { auto s = bwd("quantize dh (row, fp32 scales)");
    quantize_row_fp32_scale(b.dh, Mp_, 2 * F_, segment_offsets(), El_, b.dh_row_f32.codes, b.dh_row_f32.f32(), st_bwd(),
                       stream_); }
  log_rows(MoePass::kBackward, CastKind::kQuantize, report_names::kQuantizeDhFp32Scale, 1, 1, 2 * F_);
  { auto s = bwd("DQ->T->Q dh"); naive_col(b.dh_row_f32, 2 * F_, b.dh_col_f32, WgradOperand::kGemm1Grad); }
  weight_dgrad(1, b.dh_row_f32, b.rows_bf16, st_bwd_aux());
  mark_dx_rows_ready();
  { auto s = bwd("DQ->T->Q x_perm"); naive_col(b.x_perm_f32, H_, b.x_perm_col_f32, WgradOperand::kGemm1Input); }
  if (g.wants_dw1()) { auto s = bwd("GEMM1 wgrad (fp8)");
    fp8_wgrad(b.dh_col_f32, 2 * F_, b.x_perm_col_f32, H_, g.dw1, g.dw1_bf16); }
}

// db1 (MoeConfig::gemm1_bias) from the dH that GEMM1's dgrad reads: BF16 (bf16, blockwise) or
// row-wise FP8 (flow, flow-fp4), as the CPU layer.
void CudaMoeLayer::gemm1_bias_grad_bf16(const MoeGrads& g) {
  if (!g.db1) return;
  auto s = bwd("GEMM1 bias grad (db1 from bf16 dh)");
  expert_bias_grad(ws_.expert.dh, Mp_, 2 * F_, segment_offsets(), El_, g.db1, g.accumulate, rows_bound(), stream_);
}
void CudaMoeLayer::gemm1_bias_grad_fp8(const MoeGrads& g, const QTensorView& dh_row) {
  if (!g.db1) return;
  auto s = bwd("GEMM1 bias grad (db1 from fp8 dh)");
  expert_bias_grad_fp8(dh_row.codes, dh_row.ue8m0(), Mp_, 2 * F_, segment_offsets(), El_, g.db1, g.accumulate,
                       rows_bound(), stream_);
}

// ---- flow, flow-fp4 ------------------------------------------------------------------------------
void CudaMoeLayer::backward_flow(const bf16_t* dy, const MoeGrads& g) {
  ExpertBuffers& b = ws_.expert;
  const RecipeSpec& spec = path_.spec();
  const bool side = streams_.side_on();
  const SegmentBlocks sb = blocks();
  { auto s = bwd("quantize dy (entry)");
    quantize_row(dy, T_, H_, b.entry_fp8.codes, b.entry_fp8.ue8m0(), st_bwd(), stream_); }
  log(MoePass::kBackward, CastKind::kQuantize, spec.quantize_dy_entry, 1, 1, T_ * H_);
  { auto s = bwd(comm_ ? "dispatch dy (fp8)" : "permute+pad dy (fp8)");
    move_fp8(b.entry_fp8, b.dy_row, MoePass::kBackward, report_names::kDispatchDy); }
  {  // the wgrad copies on the side stream: dY's next to GEMM2 dgrad (both read dY row-wise),
     // then x_perm's next to everything up to GEMM1 wgrad (its buffer is free until then)
    cudaStream_t ts = streams_.fork();
    {
      auto s = bwd(side ? "scaling-aware transpose dY (side stream)" : "scaling-aware transpose dY", ts);
      scaling_aware_transpose(b.dy_row.codes, b.dy_row.ue8m0(), H_, sb, b.dy_col.codes, b.dy_col.ue8m0(), st_bwd(),
                              ts, cfg_.transpose_exponent);
    }
    streams_.mark(LayerStreams::kSideA);
    if (!path_.x_mxfp4) {
      auto s = bwd(side ? "scaling-aware transpose x_perm (side stream)" : "scaling-aware transpose x_perm", ts);
      scaling_aware_transpose(b.x_perm_row.codes, b.x_perm_row.ue8m0(), H_, sb, b.x_perm_col_flow.codes,
                              b.x_perm_col_flow.ue8m0(), st_bwd(), ts, cfg_.transpose_exponent);
    } else {
      auto s = bwd(side ? "FP4RowToFP8Col x_perm (side stream)" : "FP4RowToFP8Col x_perm", ts);
      fp4_to_fp8_col(b.x_perm_mxfp4.codes, b.x_perm_mxfp4.ue8m0(), H_, sb, b.x_perm_col_flow.codes,
                     b.x_perm_col_flow.ue8m0(), st_bwd(), ts, cfg_.transpose_exponent);
    }
    streams_.mark(LayerStreams::kSideB);
  }
  log_rows(MoePass::kBackward, CastKind::kConvert, spec.column(WgradOperand::kGemm2Grad).op, 1, 1, H_);
  if (path_.fused_dswiglu) {
    {  // one kernel: GEMM2 dgrad with dSwiGLU*prob and dh's quantizations in its epilogue (no BF16 da')
      const QTensorView w2t = path_.transposes_in_backward ? make_dgrad_weights(2, 0, El_) : ws_.weights.w2t;
      auto s = bwd(path_.h_mxfp4() ? "GEMM2 dgrad (fp8) + dSwiGLU*prob + quantize (dh row + col, from mxfp4 h)"
                       : "GEMM2 dgrad (fp8) + dSwiGLU*prob + quantize (dh row + col, from fp8 h)");
      // the step's views: Mp_ rows (the buffers hold the largest step's)
      gemm_->dgrad_dswiglu(gemm::DeviceSegments{segment_offsets(), El_, Mp_, st_bwd_aux()}, H_, F_,
                           gemm_rows(b.dy_row, H_), w2t, ws_.routing.row_prob, saved_h(),
                           row_1x128(b.dh_row_fused.codes, b.dh_row_fused.ue8m0(), Mp_, 2 * F_),
                           col_128x1(b.dh_col_fused.codes, b.dh_col_fused.ue8m0(), Mp_, 2 * F_, segment_max_blocks(Mp_, El_)),
                           ws_.routing.dprob_partials, st_bwd(), stream_);
    }
    log_rows(MoePass::kBackward, CastKind::kFused, report_names::kGemm2DgradDswigluQuantRowCol, 1, 2, 2 * F_);
    fp8_gemm2_wgrad(g, LayerStreams::kSideA);  // after dY's column copy; dh did not overwrite dY's copies
  } else {
    fp8_gemm2_grads(g, LayerStreams::kSideA);  // the wgrad after dY's column copy
    // the dSwiGLU below overwrites dY's row and column copies
    streams_.join(LayerStreams::kSideA);  // (also when there is no wgrad of W2: the transpose read dY row)
    backward_flow_dswiglu();
  }
  const bool fused = path_.fused_dswiglu;
  gemm1_bias_grad_fp8(g, fused ? b.dh_row_fused : b.dh_row);
  log_rows(MoePass::kBackward, CastKind::kConvert, spec.column(WgradOperand::kGemm1Input).op, 1, 1, H_);
  // the wgrad after x_perm's column copy
  fp8_gemm1_grads(g, fused ? b.dh_row_fused : b.dh_row, fused ? b.dh_col_fused : b.dh_col, b.x_perm_col_flow,
                  LayerStreams::kSideB);
  streams_.join(LayerStreams::kSideB);  // the side stream idle before the next forward reuses x_perm
}

// flow's unfused dSwiGLU*prob + quantize: from da' (BF16) and the saved h into dh's row and column
// copies (the storage of dY's).
void CudaMoeLayer::backward_flow_dswiglu() {
  ExpertBuffers& b = ws_.expert;
  const QTensorView& hs = b.h_saved;
  const SegmentBlocks sb = blocks();
  if (!path_.h_mxfp4()) {
    auto s = bwd("dSwiGLU*prob + quantize (dh row + col, from fp8 h)");
    dswiglu_quant_fp8h(b.da, hs.codes, hs.ue8m0(), F_, sb, b.dh_row.codes, b.dh_row.ue8m0(), b.dh_col.codes,
                       b.dh_col.ue8m0(), st_bwd(), stream_, ws_.routing.row_prob, ws_.routing.dprob_partials,
                       cfg_.activation);
  } else {
    auto s = bwd("dSwiGLU*prob + quantize (dh row + col, from mxfp4 h)");
    dswiglu_quant_fp4h(b.da, hs.codes, hs.ue8m0(), F_, sb, b.dh_row.codes, b.dh_row.ue8m0(), b.dh_col.codes,
                       b.dh_col.ue8m0(), st_bwd(), stream_, ws_.routing.row_prob, ws_.routing.dprob_partials,
                       cfg_.activation);
  }
  log_rows(MoePass::kBackward, CastKind::kFused, report_names::kDswigluQuantRowCol, 1, 2, 2 * F_);
}

}  // namespace moe
}  // namespace cuda
}  // namespace flowmoe
