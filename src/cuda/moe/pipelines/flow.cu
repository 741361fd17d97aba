// The flow recipes' pipeline (Dataflow::kFlow; pipeline.h): flow and flow-fp4. x and dy are
// quantized once at the entry (flow-fp4: x as MXFP4, GEMM1 reading it through FP4RowToFP8Row), move
// and stay FP8 / MXFP4 between the GEMMs; SwiGLU*prob and dSwiGLU*prob write their quantized
// outputs directly (or as the GEMMs' fused epilogues: RecipePath::fused_swiglu / fused_dswiglu);
// the wgrads' column copies are exact conversions (scaling-aware transpose, FP4RowToFP8Col) made
// on the side stream next to the GEMMs (RecipePath::side_stream). Saved: x_perm in its entry
// format, h quantized (FP8 rows or MXFP4), a' column-wise FP8.
#include <cuda_runtime.h>

#include <memory>

#include "cuda/common.cuh"
#include "cuda/moe/pipelines/pipeline.h"
#include "flowmoe/swiglu.h"

namespace flowmoe {
namespace cuda {
namespace moe {
namespace {

void forward_flow(StepContext& c, bf16_t* y) {
  ExpertBuffers& b = c.ws_.expert;
  const WeightBuffers& w = c.ws_.weights;
  const RecipeSpec& spec = c.path_.spec();
  const bool h4 = c.path_.h_mxfp4();  // h saved as MXFP4 (else FP8 row-wise)
  const SegmentBlocks sb = c.blocks();
  QTensorView x_in;  // GEMM1's input, row-wise FP8 [Mp, H]
  if (!c.path_.x_mxfp4) {
    {
      auto s = c.fwd("quantize x (entry)");
      quantize_row(c.ws_.routing.x, c.step_.T, c.H_, b.entry_fp8.codes, b.entry_fp8.ue8m0(), c.st_fwd(), c.stream_);
    }
    c.log(MoePass::kForward, CastKind::kQuantize, spec.quantize_x_entry, 1, 1, c.step_.T * c.H_);
    {
      auto s = c.fwd(c.comm_ ? "dispatch x (fp8)" : "permute+pad x (fp8)");
      c.move_fp8(b.entry_fp8, b.x_perm_row, MoePass::kForward, report_names::kDispatchX);
    }
    x_in = b.x_perm_row;
  } else {
    {
      auto s = c.fwd("quantize x (entry, mxfp4)");
      quantize_mxfp4(c.ws_.routing.x, c.step_.T, c.H_, b.entry_mxfp4.codes, b.entry_mxfp4.ue8m0(), c.st_fwd(), c.stream_);
    }
    c.log(MoePass::kForward, CastKind::kQuantize, spec.quantize_x_entry, 1, 1, c.step_.T * c.H_);
    {
      auto s = c.fwd(c.comm_ ? "dispatch x (mxfp4)" : "permute+pad x (mxfp4)");
      c.move_mxfp4(b.entry_mxfp4, b.x_perm_mxfp4);
    }
    // (the fused GEMM1 writes a_row while it reads its input: then not in a_row's storage)
    x_in = c.path_.fused_swiglu ? b.x_perm_fp8_fused : b.x_perm_fp8;
    {
      auto s = c.fwd("FP4RowToFP8Row x_perm");
      fp4_to_fp8_row(b.x_perm_mxfp4.codes, b.x_perm_mxfp4.ue8m0(), c.step_.Mp, c.H_, x_in.codes, x_in.ue8m0(), c.st_fwd(),
                     c.stream_, c.rows_bound());
    }
    c.log_rows(MoePass::kForward, CastKind::kConvert, report_names::kFp4RowToFp8RowXperm, 1, 1, c.H_);
  }
  const QTensorView& ar = b.a_row;  // (flow-fp4 unfused: its storage held GEMM1's input, consumed by now)
  const QTensorView& hs = b.h_saved;
  if (c.path_.fused_swiglu) {
    // one kernel: GEMM1 on the interleaved W1 with (b1 +) SwiGLU*prob and both quantizations in its
    // epilogue
    const float* b1 = c.gemm1_bias_on_read(/*store_h=*/false).bias;
    auto s = c.fwd(h4 ? (b1 ? "GEMM1 fprop (fp8) + b1 + SwiGLU*prob + quantize (a' row, h mxfp4)"
                            : "GEMM1 fprop (fp8) + SwiGLU*prob + quantize (a' row, h mxfp4)")
                      : (b1 ? "GEMM1 fprop (fp8) + b1 + SwiGLU*prob + quantize (a' row, h row)"
                            : "GEMM1 fprop (fp8) + SwiGLU*prob + quantize (a' row, h row)"));
    c.gemm_->fprop_swiglu(gemm::DeviceSegments{c.segment_offsets(), c.El_, c.step_.Mp, c.st_fwd_aux()}, c.F_, c.H_,
                          c.gemm_rows(x_in, c.H_), w.w1, c.ws_.routing.row_prob,
                          row_1x128(ar.codes, ar.ue8m0(), c.step_.Mp, c.F_), c.saved_h(), c.st_fwd(), c.stream_,
                          c.cfg_.activation, b1);
    c.log_rows(MoePass::kForward, CastKind::kFused,
               h4 ? report_names::kGemm1SwigluQuantRowHMxfp4 : report_names::kGemm1SwigluQuantRowHRow, 1, 2, 2 * c.F_);
  } else {
    {
      auto s = c.fwd("GEMM1 fprop (fp8)");
      c.fp8_fprop(x_in, 2 * c.F_, c.H_, w.w1, b.h, c.st_fwd_aux());
    }
    // (GEMM1's bias added as the kernel reads h: h is scratch here, saved quantized)
    const GateUpBias bias = c.gemm1_bias_on_read(/*store_h=*/false);
    if (!h4) {
      auto s = c.fwd(bias.bias ? "b1 + SwiGLU*prob + quantize (a' row, h row)" : "SwiGLU*prob + quantize (a' row, h row)");
      cuda::swiglu_quant(b.h, c.step_.Mp, c.F_, ar.codes, ar.ue8m0(), hs.codes, hs.ue8m0(), c.st_fwd(), c.stream_,
                         c.ws_.routing.row_prob, c.rows_bound(), c.cfg_.activation, bias);
      c.log_rows(MoePass::kForward, CastKind::kFused, report_names::kSwigluQuantRowHRow, 1, 2, 2 * c.F_);
    } else {
      auto s = c.fwd(bias.bias ? "b1 + SwiGLU*prob + quantize (a' row, h mxfp4)"
                               : "SwiGLU*prob + quantize (a' row, h mxfp4)");
      cuda::swiglu_quant_h4(b.h, c.step_.Mp, c.F_, ar.codes, ar.ue8m0(), hs.codes, hs.ue8m0(), c.st_fwd(), c.stream_,
                            c.ws_.routing.row_prob, c.rows_bound(), c.cfg_.activation, bias);
      c.log_rows(MoePass::kForward, CastKind::kFused, report_names::kSwigluQuantRowHMxfp4, 1, 2, 2 * c.F_);
    }
  }
  {  // the wgrad copy of a' is needed in the backward only: next to GEMM2 (both read a' row-wise)
    cudaStream_t ts = c.streams_->fork();
    {  // the stage's events close before mark(), so that join() covers them too
      auto s =
          c.fwd(c.streams_->side_on() ? "scaling-aware transpose a' (side stream)" : "scaling-aware transpose a'", ts);
      scaling_aware_transpose(ar.codes, ar.ue8m0(), c.F_, sb, b.a_col.codes, b.a_col.ue8m0(), c.st_fwd_aux(), ts,
                              c.cfg_.transpose_exponent);
    }
    c.streams_->mark(LayerStreams::kSideA);
  }
  c.log_rows(MoePass::kForward, CastKind::kConvert, spec.column(WgradOperand::kGemm2Input).op, 1, 1, c.F_);
  c.gemm2_then_combine(
      "GEMM2 fprop (fp8)", [&] { c.fp8_fprop(ar, c.H_, c.F_, w.w2, b.rows_bf16, c.st_fwd_aux()); }, y);
  c.streams_->join(LayerStreams::kSideA);  // a' col ready before anything later on stream_ (the backward) runs
}

// flow's unfused dSwiGLU*prob + quantize: from da' (BF16) and the saved h into dh's row and column
// copies (the storage of dY's).
void backward_flow_dswiglu(StepContext& c) {
  ExpertBuffers& b = c.ws_.expert;
  const QTensorView& hs = b.h_saved;
  const SegmentBlocks sb = c.blocks();
  if (!c.path_.h_mxfp4()) {
    auto s = c.bwd("dSwiGLU*prob + quantize (dh row + col, from fp8 h)");
    dswiglu_quant_fp8h(b.da, hs.codes, hs.ue8m0(), c.F_, sb, b.dh_row.codes, b.dh_row.ue8m0(), b.dh_col.codes,
                       b.dh_col.ue8m0(), c.st_bwd(), c.stream_, c.ws_.routing.row_prob, c.ws_.routing.dprob_partials,
                       c.cfg_.activation);
  } else {
    auto s = c.bwd("dSwiGLU*prob + quantize (dh row + col, from mxfp4 h)");
    dswiglu_quant_fp4h(b.da, hs.codes, hs.ue8m0(), c.F_, sb, b.dh_row.codes, b.dh_row.ue8m0(), b.dh_col.codes,
                       b.dh_col.ue8m0(), c.st_bwd(), c.stream_, c.ws_.routing.row_prob, c.ws_.routing.dprob_partials,
                       c.cfg_.activation);
  }
  c.log_rows(MoePass::kBackward, CastKind::kFused, report_names::kDswigluQuantRowCol, 1, 2, 2 * c.F_);
}

void backward_flow(StepContext& c, const bf16_t* dy, const MoeGrads& g) {
  ExpertBuffers& b = c.ws_.expert;
  const RecipeSpec& spec = c.path_.spec();
  const bool side = c.streams_->side_on();
  const SegmentBlocks sb = c.blocks();
  {
    auto s = c.bwd("quantize dy (entry)");
    quantize_row(dy, c.step_.T, c.H_, b.entry_fp8.codes, b.entry_fp8.ue8m0(), c.st_bwd(), c.stream_);
  }
  c.log(MoePass::kBackward, CastKind::kQuantize, spec.quantize_dy_entry, 1, 1, c.step_.T * c.H_);
  {
    auto s = c.bwd(c.comm_ ? "dispatch dy (fp8)" : "permute+pad dy (fp8)");
    c.move_fp8(b.entry_fp8, b.dy_row, MoePass::kBackward, report_names::kDispatchDy);
  }
  {  // the wgrad copies on the side stream: dY's next to GEMM2 dgrad (both read dY row-wise),
     // then x_perm's next to everything up to GEMM1 wgrad (its buffer is free until then); none for
     // a weight whose gradient is not asked for (frozen experts)
    cudaStream_t ts = c.streams_->fork();
    if (g.wants_dw2()) {
      auto s = c.bwd(side ? "scaling-aware transpose dY (side stream)" : "scaling-aware transpose dY", ts);
      scaling_aware_transpose(b.dy_row.codes, b.dy_row.ue8m0(), c.H_, sb, b.dy_col.codes, b.dy_col.ue8m0(), c.st_bwd(),
                              ts, c.cfg_.transpose_exponent);
    }
    c.streams_->mark(LayerStreams::kSideA);
    if (g.wants_dw1() && !c.path_.x_mxfp4) {
      auto s = c.bwd(side ? "scaling-aware transpose x_perm (side stream)" : "scaling-aware transpose x_perm", ts);
      scaling_aware_transpose(b.x_perm_row.codes, b.x_perm_row.ue8m0(), c.H_, sb, b.x_perm_col_flow.codes,
                              b.x_perm_col_flow.ue8m0(), c.st_bwd(), ts, c.cfg_.transpose_exponent);
    } else if (g.wants_dw1()) {
      auto s = c.bwd(side ? "FP4RowToFP8Col x_perm (side stream)" : "FP4RowToFP8Col x_perm", ts);
      fp4_to_fp8_col(b.x_perm_mxfp4.codes, b.x_perm_mxfp4.ue8m0(), c.H_, sb, b.x_perm_col_flow.codes,
                     b.x_perm_col_flow.ue8m0(), c.st_bwd(), ts, c.cfg_.transpose_exponent);
    }
    c.streams_->mark(LayerStreams::kSideB);
  }
  if (g.wants_dw2())
    c.log_rows(MoePass::kBackward, CastKind::kConvert, spec.column(WgradOperand::kGemm2Grad).op, 1, 1, c.H_);
  if (c.path_.fused_dswiglu) {
    {  // one kernel: GEMM2 dgrad with dSwiGLU*prob and dh's quantizations in its epilogue (no BF16 da')
      const QTensorView w2t = c.path_.transposes_in_backward ? c.make_dgrad_weights(2, 0, c.El_) : c.ws_.weights.w2t;
      auto s = c.bwd(c.path_.h_mxfp4() ? "GEMM2 dgrad (fp8) + dSwiGLU*prob + quantize (dh row + col, from mxfp4 h)"
                                       : "GEMM2 dgrad (fp8) + dSwiGLU*prob + quantize (dh row + col, from fp8 h)");
      // the step's views: step_.Mp rows (the buffers hold the largest step's)
      c.gemm_->dgrad_dswiglu(
          gemm::DeviceSegments{c.segment_offsets(), c.El_, c.step_.Mp, c.st_bwd_aux()}, c.H_, c.F_,
          c.gemm_rows(b.dy_row, c.H_), w2t, c.ws_.routing.row_prob, c.saved_h(),
          row_1x128(b.dh_row_fused.codes, b.dh_row_fused.ue8m0(), c.step_.Mp, 2 * c.F_),
          col_128x1(b.dh_col_fused.codes, b.dh_col_fused.ue8m0(), c.step_.Mp, 2 * c.F_, segment_max_blocks(c.step_.Mp, c.El_)),
          c.ws_.routing.dprob_partials, c.st_bwd(), c.stream_, c.cfg_.activation);
    }
    c.log_rows(MoePass::kBackward, CastKind::kFused, report_names::kGemm2DgradDswigluQuantRowCol, 1, 2, 2 * c.F_);
    c.fp8_gemm2_wgrad(g, LayerStreams::kSideA);  // after dY's column copy; dh did not overwrite dY's copies
  } else {
    c.fp8_gemm2_grads(g, LayerStreams::kSideA);  // the wgrad after dY's column copy
    // the dSwiGLU below overwrites dY's row and column copies
    c.streams_->join(LayerStreams::kSideA);  // (also when there is no wgrad of W2: the transpose read dY row)
    backward_flow_dswiglu(c);
  }
  const bool fused = c.path_.fused_dswiglu;
  c.gemm1_bias_grad_fp8(g, fused ? b.dh_row_fused : b.dh_row);
  if (g.wants_dw1())
    c.log_rows(MoePass::kBackward, CastKind::kConvert, spec.column(WgradOperand::kGemm1Input).op, 1, 1, c.H_);
  // the wgrad after x_perm's column copy
  c.fp8_gemm1_grads(g, fused ? b.dh_row_fused : b.dh_row, fused ? b.dh_col_fused : b.dh_col, b.x_perm_col_flow,
                    LayerStreams::kSideB);
  c.streams_->join(LayerStreams::kSideB);  // the side stream idle before the next forward reuses x_perm
}

class FlowSteps final : public PipelineSteps {
 public:
  void forward(StepContext& c, bf16_t* y) override {
    c.streams_->with_side_drained([&] { forward_flow(c, y); });
  }
  void backward(StepContext& c, const bf16_t* dy, const MoeGrads& g) override {
    c.streams_->with_side_drained([&] { backward_flow(c, dy, g); });
  }
};

}  // namespace

// The buffers only the flow recipes use (workspace.h DataflowBufferPlan): the entry's FP8 / MXFP4 rows,
// the saved quantized h, a' column-wise and x_perm (FP8 rows or MXFP4), the fused dSwiGLU's dh.
void plan_flow_buffers(const DataflowBufferPlan& p) {
  DeviceArena& a = p.arena;
  ExpertBuffers& x = p.x;
  const RecipePath& path = p.path;
  const int64_t R = p.R, Tm = p.Tm, H = p.H, F = p.F, MB = p.MB;
  constexpr Region kS = Region::kSaved, kT = Region::kTransient;
  uint8_t* entry_codes = a.device<uint8_t>(Tm * H, kT);
  x.entry_fp8 = row_1x128(entry_codes, a.device<uint8_t>((H / 128) * Tm, kT), Tm, H);
  if (!path.h_mxfp4()) {  // h saved row-wise FP8 (flow)
    uint8_t* codes = a.device<uint8_t>(R * 2 * F, kS);
    x.h_saved = row_1x128(codes, a.device<uint8_t>((2 * F / 128) * R, kS), R, 2 * F);
  } else {  // h saved as MXFP4 [R, 2F/2] + [R][2F/32] (flow-fp4)
    uint8_t* codes = a.device<uint8_t>(R * F, kS);
    x.h_saved = mxfp4_1x32(codes, a.device<uint8_t>(R * (2 * F / 32), kS), R, 2 * F);
  }
  x.a_col = col_128x1(a.device<uint8_t>(F * R, kS), a.device<uint8_t>(MB * F, kS), R, F, MB);
  if (path.fused_dswiglu) {
    x.dh_row_fused =
        row_1x128(a.device<uint8_t>(R * 2 * F, kT), a.device<uint8_t>((2 * F / 128) * R, kT), R, 2 * F);
    uint8_t* h_bytes = reinterpret_cast<uint8_t*>(x.h);  // free in the backward: h is saved quantized
    if (h_bytes && 2 * F * R + MB * 2 * F <= int64_t(sizeof(bf16_t)) * R * 2 * F)
      x.dh_col_fused = col_128x1(h_bytes, h_bytes + 2 * F * R, R, 2 * F, MB);
    else
      x.dh_col_fused =
          col_128x1(a.device<uint8_t>(2 * F * R, kT), a.device<uint8_t>(MB * 2 * F, kT), R, 2 * F, MB);
  }
  if (!path.x_mxfp4) {  // x_perm saved row-wise FP8 (flow)
    uint8_t* codes = a.device<uint8_t>(R * H, kS);
    x.x_perm_row = row_1x128(codes, a.device<uint8_t>((H / 128) * R, kS), R, H);
  } else {
    uint8_t* codes = a.device<uint8_t>(Tm * H / 2, kT);
    x.entry_mxfp4 = mxfp4_1x32(codes, a.device<uint8_t>(Tm * H / 32, kT), Tm, H);
    uint8_t* xcodes = a.device<uint8_t>(R * H / 2, kS);
    x.x_perm_mxfp4 = mxfp4_1x32(xcodes, a.device<uint8_t>(R * H / 32, kS), R, H);
    // [H/128][R] scale bytes fit dy_col's [MB][maxC] (MB >= R/128, maxC >= H)
    x.x_perm_fp8_fused = row_1x128(x.dy_col.codes, x.dy_col.ue8m0(), R, H);
  }
}

std::unique_ptr<PipelineSteps> make_flow_pipeline() { return std::unique_ptr<PipelineSteps>(new FlowSteps); }

}  // namespace moe
}  // namespace cuda
}  // namespace flowmoe
