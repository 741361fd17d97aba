// The CUDA layer's forward per recipe (the CPU backend's dataflow): routing has run (routing.cu);
// each path moves the token rows to the experts, runs GEMM1, SwiGLU*prob and GEMM2 in the recipe's
// precision, saves what its backward needs and brings the expert rows back to y.
#include <cuda_runtime.h>

#include "cuda/common.cuh"
#include "cuda/moe/layer.h"
#include "flowmoe/expert_bias.h"
#include "flowmoe/swiglu.h"

namespace flowmoe {
namespace cuda {
namespace moe {

// GEMM1's bias (MoeConfig::gemm1_bias), in place on h before the activation: every row of the
// segments, as the CPU layer (no-op without the bias).
void CudaMoeLayer::add_gemm1_bias() {
  if (gemm1_bias_ == nullptr) return;
  auto s = fwd("GEMM1 bias (bf16 h += b1)");
  cuda::add_expert_bias(ws_.expert.h, Mp_, 2 * F_, segment_offsets(), El_, gemm1_bias_, rows_bound(), stream_);
}

// GEMM2 (gemm2() computes the expert output rows into ExpertBuffers::rows_bf16) and the way back
// to the tokens.
void CudaMoeLayer::gemm2_then_combine(const char* gemm_stage, const std::function<void()>& gemm2, bf16_t* y) {
  { auto s = fwd(gemm_stage); gemm2(); }
  { auto s = fwd(comm_ ? "combine + unpermute" : "unpermute+unpad"); combine_y(y); }
}

// ---- bf16 ----------------------------------------------------------------------------------------
void CudaMoeLayer::forward_bf16(bf16_t* y) {
  ExpertBuffers& b = ws_.expert;
  const WeightBuffers& w = ws_.weights;
  { auto s = fwd(comm_ ? "dispatch x (bf16)" : "permute+pad x (bf16)");
    move_bf16(ws_.routing.x, b.x_perm, MoePass::kForward, report_names::kDispatchX); }
  { auto s = fwd("GEMM1 fprop (bf16)"); bf16_fprop(b.x_perm, 2 * F_, H_, w.w1_bf16, b.h); }
  add_gemm1_bias();
  { auto s = fwd("SwiGLU*prob (bf16)");
    cuda::swiglu(b.h, Mp_, F_, b.a, st_fwd(), stream_, ws_.routing.row_prob, rows_bound(), cfg_.activation); }
  gemm2_then_combine("GEMM2 fprop (bf16)", [&] { bf16_fprop(b.a, H_, F_, w.w2_bf16, b.rows_bf16); }, y);
}

// ---- blockwise -----------------------------------------------------------------------------------
void CudaMoeLayer::forward_blockwise(bf16_t* y) {
  ExpertBuffers& b = ws_.expert;
  const WeightBuffers& w = ws_.weights;
  const SegmentBlocks sb = blocks();
  bf16_t* xp = b.rows_bf16;  // x_perm staged in BF16 until its quantization (GEMM2 writes y there)
  { auto s = fwd(comm_ ? "dispatch x (bf16)" : "permute+pad x (bf16)");
    move_bf16(ws_.routing.x, xp, MoePass::kForward, report_names::kDispatchX); }
  const QTensorView& x_row = b.x_perm_fp8;
  { auto s = fwd("quantize x_perm (row + col)");
    quantize_col(xp, H_, sb, b.x_perm_col.codes, b.x_perm_col.ue8m0(), x_row.codes, x_row.ue8m0(), st_fwd(),
                 stream_); }
  log_rows(MoePass::kForward, CastKind::kQuantize, report_names::kQuantizeXpermBoth, 1, 2, H_);
  { auto s = fwd("GEMM1 fprop (fp8)");
    fp8_fprop(x_row, 2 * F_, H_, w.w1, b.h, st_fwd_aux()); }
  add_gemm1_bias();
  { auto s = fwd("SwiGLU*prob (bf16)");
    cuda::swiglu(b.h, Mp_, F_, b.a, st_fwd(), stream_, ws_.routing.row_prob, rows_bound(), cfg_.activation); }
  { auto s = fwd("quantize a' (row + col)");
    quantize_col(b.a, F_, sb, b.a_col.codes, b.a_col.ue8m0(), b.a_row.codes, b.a_row.ue8m0(), st_fwd(), stream_); }
  log_rows(MoePass::kForward, CastKind::kQuantize, report_names::kQuantizeABoth, 1, 2, F_);
  gemm2_then_combine("GEMM2 fprop (fp8)", [&] { fp8_fprop(b.a_row, H_, F_, w.w2, b.rows_bf16, st_fwd_aux()); }, y);
}

// ---- fp8-naive -----------------------------------------------------------------------------------
// fp8-naive's entry (SPEC §6), forward for x and backward for dy: quantize `in` [T, H] with FP32
// scales, move it to the experts (FP8 on the wire with a communicator), dequantize, and lay it out
// permuted and padded in `out` [Mp, H] BF16.
void CudaMoeLayer::naive_entry(MoePass pass, const bf16_t* in, bf16_t* out) {
  ExpertBuffers& b = ws_.expert;
  const bool f = pass == MoePass::kForward;
  { auto s = stage(pass, f ? "quantize x (entry, fp32 scales)" : "quantize dy (entry, fp32 scales)");
    quantize_row_fp32_scale(in, T_, H_, nullptr, E_, b.entry_f32.codes, b.entry_f32.f32(), f ? st_fwd() : st_bwd(),
                       stream_); }
  const RecipeSpec& spec = path_.spec();
  log(pass, CastKind::kQuantize, f ? spec.quantize_x_entry : spec.quantize_dy_entry, 1, 1, T_ * H_);
  const char* deq = f ? spec.dequantize_x_after_dispatch : spec.dequantize_dy_after_dispatch;
  if (comm_ == nullptr) {
    { auto s = stage(pass, deq);
      dequantize_row_fp32_scale(b.entry_f32.codes, b.entry_f32.f32(), T_, H_, nullptr, E_, b.entry_dequantized, stream_); }
    log(pass, CastKind::kDequantize, deq, 1, 1, T_ * H_);
    { auto s = stage(pass, f ? "permute+pad x (bf16)" : "permute+pad dy (bf16)");
      permute_pad_bf16(b.entry_dequantized, H_, ws_.routing.tokens, out, stream_); }
  } else {
    { auto s = stage(pass, f ? "dispatch x (fp8, fp32 scales) + dequantize" : "dispatch dy (fp8, fp32 scales) + dequantize");
      move_naive(out, pass, f ? report_names::kDispatchX : report_names::kDispatchDy); }
    log_held(pass, CastKind::kDequantize, deq, 1, 1, H_);  // the received routed rows (as the CPU layer)
  }
}

void CudaMoeLayer::forward_naive(bf16_t* y) {
  ExpertBuffers& b = ws_.expert;
  const WeightBuffers& w = ws_.weights;
  bf16_t* xp = b.rows_bf16;  // x_perm staged in BF16 until its quantization (GEMM2 writes y there)
  naive_entry(MoePass::kForward, ws_.routing.x, xp);
  { auto s = fwd("quantize x_perm (row, fp32 scales)");
    quantize_row_fp32_scale(xp, Mp_, H_, segment_offsets(), El_, b.x_perm_f32.codes, b.x_perm_f32.f32(), st_fwd(), stream_); }
  log_rows(MoePass::kForward, CastKind::kQuantize, report_names::kQuantizeXpermFp32Scale, 1, 1, H_);
  { auto s = fwd("GEMM1 fprop (fp8)");
    fp8_fprop(b.x_perm_f32, 2 * F_, H_, w.w1, b.h, st_fwd_aux()); }
  { auto s = fwd("SwiGLU*prob (bf16)");
    cuda::swiglu(b.h, Mp_, F_, b.a, st_fwd(), stream_, ws_.routing.row_prob, rows_bound(), cfg_.activation); }
  { auto s = fwd("quantize a' (row, fp32 scales)");
    quantize_row_fp32_scale(b.a, Mp_, F_, segment_offsets(), El_, b.a_f32.codes, b.a_f32.f32(), st_fwd(), stream_); }
  log_rows(MoePass::kForward, CastKind::kQuantize, report_names::kQuantizeAFp32Scale, 1, 1, F_);
  gemm2_then_combine("GEMM2 fprop (fp8)", [&] { fp8_fprop(b.a_f32, H_, F_, w.w2, b.rows_bf16, st_fwd_aux()); }, y);
}

// ---- flow, flow-fp4 ------------------------------------------------------------------------------
void CudaMoeLayer::forward_flow(bf16_t* y) {
  ExpertBuffers& b = ws_.expert;
  const WeightBuffers& w = ws_.weights;
  const RecipeSpec& spec = path_.spec();
  const bool h4 = path_.h_mxfp4();  // h saved as MXFP4 (else FP8 row-wise)
  const SegmentBlocks sb = blocks();
  QTensorView x_in;  // GEMM1's input, row-wise FP8 [Mp, H]
  if (!path_.x_mxfp4) {
    { auto s = fwd("quantize x (entry)");
      quantize_row(ws_.routing.x, T_, H_, b.entry_fp8.codes, b.entry_fp8.ue8m0(), st_fwd(), stream_); }
    log(MoePass::kForward, CastKind::kQuantize, spec.quantize_x_entry, 1, 1, T_ * H_);
    { auto s = fwd(comm_ ? "dispatch x (fp8)" : "permute+pad x (fp8)");
      move_fp8(b.entry_fp8, b.x_perm_row, MoePass::kForward, report_names::kDispatchX); }
    x_in = b.x_perm_row;
  } else {
    { auto s = fwd("quantize x (entry, mxfp4)");
      quantize_mxfp4(ws_.routing.x, T_, H_, b.entry_mxfp4.codes, b.entry_mxfp4.ue8m0(), st_fwd(), stream_); }
    log(MoePass::kForward, CastKind::kQuantize, spec.quantize_x_entry, 1, 1, T_ * H_);
    { auto s = fwd(comm_ ? "dispatch x (mxfp4)" : "permute+pad x (mxfp4)"); move_mxfp4(b.entry_mxfp4, b.x_perm_mxfp4); }
    // (the fused GEMM1 writes a_row while it reads its input: then not in a_row's storage)
    x_in = path_.fused_swiglu ? b.x_perm_fp8_fused : b.x_perm_fp8;
    { auto s = fwd("FP4RowToFP8Row x_perm");
      fp4_to_fp8_row(b.x_perm_mxfp4.codes, b.x_perm_mxfp4.ue8m0(), Mp_, H_, x_in.codes, x_in.ue8m0(), st_fwd(),
                     stream_, rows_bound()); }
    log_rows(MoePass::kForward, CastKind::kConvert, report_names::kFp4RowToFp8RowXperm, 1, 1, H_);
  }
  const QTensorView& ar = b.a_row;  // (flow-fp4 unfused: its storage held GEMM1's input, consumed by now)
  const QTensorView& hs = b.h_saved;
  if (path_.fused_swiglu) {
    // one kernel: GEMM1 on the interleaved W1 with SwiGLU*prob and both quantizations in its epilogue
    auto s = fwd(h4 ? "GEMM1 fprop (fp8) + SwiGLU*prob + quantize (a' row, h mxfp4)"
                    : "GEMM1 fprop (fp8) + SwiGLU*prob + quantize (a' row, h row)");
    gemm_->fprop_swiglu(gemm::DeviceSegments{segment_offsets(), El_, Mp_, st_fwd_aux()}, F_, H_, gemm_rows(x_in, H_),
                        w.w1, ws_.routing.row_prob, row_1x128(ar.codes, ar.ue8m0(), Mp_, F_), saved_h(), st_fwd(), stream_);
    log_rows(MoePass::kForward, CastKind::kFused,
             h4 ? report_names::kGemm1SwigluQuantRowHMxfp4 : report_names::kGemm1SwigluQuantRowHRow, 1, 2, 2 * F_);
  } else {
    { auto s = fwd("GEMM1 fprop (fp8)");
      fp8_fprop(x_in, 2 * F_, H_, w.w1, b.h, st_fwd_aux()); }
    add_gemm1_bias();
    if (!h4) {
      auto s = fwd("SwiGLU*prob + quantize (a' row, h row)");
      cuda::swiglu_quant(b.h, Mp_, F_, ar.codes, ar.ue8m0(), hs.codes, hs.ue8m0(), st_fwd(), stream_,
                         ws_.routing.row_prob, rows_bound(), cfg_.activation);
      log_rows(MoePass::kForward, CastKind::kFused, report_names::kSwigluQuantRowHRow, 1, 2, 2 * F_);
    } else {
      auto s = fwd("SwiGLU*prob + quantize (a' row, h mxfp4)");
      cuda::swiglu_quant_h4(b.h, Mp_, F_, ar.codes, ar.ue8m0(), hs.codes, hs.ue8m0(), st_fwd(), stream_,
                            ws_.routing.row_prob, rows_bound(), cfg_.activation);
      log_rows(MoePass::kForward, CastKind::kFused, report_names::kSwigluQuantRowHMxfp4, 1, 2, 2 * F_);
    }
  }
  {  // the wgrad copy of a' is needed in the backward only: next to GEMM2 (both read a' row-wise)
    cudaStream_t ts = streams_.fork();
    {  // the stage's events close before mark(), so that join() covers them too
      auto s = fwd(streams_.side_on() ? "scaling-aware transpose a' (side stream)" : "scaling-aware transpose a'", ts);
      scaling_aware_transpose(ar.codes, ar.ue8m0(), F_, sb, b.a_col.codes, b.a_col.ue8m0(), st_fwd_aux(), ts,
                              cfg_.transpose_exponent);
    }
    streams_.mark(LayerStreams::kSideA);
  }
  log_rows(MoePass::kForward, CastKind::kConvert, spec.column(WgradOperand::kGemm2Input).op, 1, 1, F_);
  gemm2_then_combine("GEMM2 fprop (fp8)", [&] { fp8_fprop(ar, H_, F_, w.w2, b.rows_bf16, st_fwd_aux()); }, y);
  streams_.join(LayerStreams::kSideA);  // a' col ready before anything later on stream_ (the backward) runs
}

}  // namespace moe
}  // namespace cuda
}  // namespace flowmoe
