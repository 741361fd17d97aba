// The fp8-naive recipe's pipeline (Dataflow::kFp8Naive; pipeline.h): DeepSeek-V3-style operator
// substitution with FP32 scales (amax / 448). The entry quantizes x (dy) row-wise, moves it (FP8 on
// the wire with EP) and dequantizes it; each FP8 GEMM quantizes its BF16 input row-wise with
// expert-packed FP32 scales; the wgrads' column copies are made by dequantize -> transpose ->
// quantize (double quantization).
#include <cuda_runtime.h>

#include <memory>

#include "cuda/common.cuh"
#include "cuda/moe/pipelines/pipeline.h"
#include "flowmoe/swiglu.h"

namespace flowmoe {
namespace cuda {
namespace moe {
namespace {

// fp8-naive's entry (SPEC §6), forward for x and backward for dy: quantize `in` [T, H] with FP32
// scales, move it to the experts (FP8 on the wire with a communicator), dequantize, and lay it out
// permuted and padded in `out` [Mp, H] BF16.
void naive_entry(StepContext& c, MoePass pass, const bf16_t* in, bf16_t* out) {
  ExpertBuffers& b = c.ws_.expert;
  const bool f = pass == MoePass::kForward;
  {
    auto s = c.stage(pass, f ? "quantize x (entry, fp32 scales)" : "quantize dy (entry, fp32 scales)");
    quantize_row_fp32_scale(in, c.step_.T, c.H_, nullptr, c.E_, b.entry_f32.codes, b.entry_f32.f32(),
                            f ? c.st_fwd() : c.st_bwd(), c.stream_);
  }
  const RecipeSpec& spec = c.path_.spec();
  c.log(pass, CastKind::kQuantize, f ? spec.quantize_x_entry : spec.quantize_dy_entry, 1, 1, c.step_.T * c.H_);
  const char* deq = f ? spec.dequantize_x_after_dispatch : spec.dequantize_dy_after_dispatch;
  if (c.comm_ == nullptr) {
    {
      auto s = c.stage(pass, deq);
      dequantize_row_fp32_scale(b.entry_f32.codes, b.entry_f32.f32(), c.step_.T, c.H_, nullptr, c.E_, b.entry_dequantized,
                                c.stream_);
    }
    c.log(pass, CastKind::kDequantize, deq, 1, 1, c.step_.T * c.H_);
    {
      auto s = c.stage(pass, f ? "permute+pad x (bf16)" : "permute+pad dy (bf16)");
      permute_pad_bf16(b.entry_dequantized, c.H_, c.ws_.routing.tokens, out, c.stream_);
    }
  } else {
    {
      auto s = c.stage(
          pass, f ? "dispatch x (fp8, fp32 scales) + dequantize" : "dispatch dy (fp8, fp32 scales) + dequantize");
      c.move_naive(out, pass, f ? report_names::kDispatchX : report_names::kDispatchDy);
    }
    c.log_held(pass, CastKind::kDequantize, deq, 1, 1, c.H_);  // the received routed rows (as the CPU layer)
  }
}

void forward_naive(StepContext& c, bf16_t* y) {
  ExpertBuffers& b = c.ws_.expert;
  const WeightBuffers& w = c.ws_.weights;
  bf16_t* xp = b.rows_bf16;  // x_perm staged in BF16 until its quantization (GEMM2 writes y there)
  naive_entry(c, MoePass::kForward, c.ws_.routing.x, xp);
  {
    auto s = c.fwd("quantize x_perm (row, fp32 scales)");
    quantize_row_fp32_scale(xp, c.step_.Mp, c.H_, c.segment_offsets(), c.El_, b.x_perm_f32.codes, b.x_perm_f32.f32(),
                            c.st_fwd(), c.stream_);
  }
  c.log_rows(MoePass::kForward, CastKind::kQuantize, report_names::kQuantizeXpermFp32Scale, 1, 1, c.H_);
  {
    auto s = c.fwd("GEMM1 fprop (fp8)");
    c.fp8_fprop(b.x_perm_f32, 2 * c.F_, c.H_, w.w1, b.h, c.st_fwd_aux());
  }
  {
    auto s = c.fwd("SwiGLU*prob (bf16)");
    cuda::swiglu(b.h, c.step_.Mp, c.F_, b.a, c.st_fwd(), c.stream_, c.ws_.routing.row_prob, c.rows_bound(),
                 c.cfg_.activation);
  }
  {
    auto s = c.fwd("quantize a' (row, fp32 scales)");
    quantize_row_fp32_scale(b.a, c.step_.Mp, c.F_, c.segment_offsets(), c.El_, b.a_f32.codes, b.a_f32.f32(), c.st_fwd(),
                            c.stream_);
  }
  c.log_rows(MoePass::kForward, CastKind::kQuantize, report_names::kQuantizeAFp32Scale, 1, 1, c.F_);
  c.gemm2_then_combine(
      "GEMM2 fprop (fp8)", [&] { c.fp8_fprop(b.a_f32, c.H_, c.F_, w.w2, b.rows_bf16, c.st_fwd_aux()); }, y);
}

// Column copy: dequantize (row, FP32 scales, expert-packed) -> transpose -> quantize column-wise
// with fresh FP32 scales into `col`.
void naive_col(StepContext& c, const QTensorView& row, int64_t cols, const QTensorView& col, WgradOperand what) {
  ExpertBuffers& b = c.ws_.expert;
  const SegmentBlocks sb = c.blocks();
  dequantize_row_fp32_scale(row.codes, row.f32(), c.step_.Mp, cols, c.segment_offsets(), c.El_, b.naive_dequantized,
                            c.stream_);
  c.log_rows(MoePass::kBackward, CastKind::kDequantize, dq_t_q_dequantize_name(what), 1, 1, cols);
  transpose_bf16(b.naive_dequantized, c.step_.Mp, cols, b.naive_transposed, c.stream_);
  quantize_transposed_fp32_scale(b.naive_transposed, cols, sb, col.codes, col.f32(), c.st_bwd(), c.stream_);
  c.log_rows(MoePass::kBackward, CastKind::kQuantize, dq_t_q_quantize_name(what), 1, 1, cols);
}

void backward_naive(StepContext& c, const bf16_t* dy, const MoeGrads& g) {
  ExpertBuffers& b = c.ws_.expert;
  naive_entry(c, MoePass::kBackward, dy, b.rows_bf16);  // the dY rows
  {
    auto s = c.bwd("quantize dY (row, fp32 scales)");
    quantize_row_fp32_scale(b.rows_bf16, c.step_.Mp, c.H_, c.segment_offsets(), c.El_, b.dy_row_f32.codes,
                            b.dy_row_f32.f32(), c.st_bwd(), c.stream_);
  }
  c.log_rows(MoePass::kBackward, CastKind::kQuantize, report_names::kQuantizeDYFp32Scale, 1, 1, c.H_);
  {
    auto s = c.bwd("DQ->T->Q dY");
    naive_col(c, b.dy_row_f32, c.H_, b.dy_col_f32, WgradOperand::kGemm2Grad);
  }
  c.weight_dgrad(2, b.dy_row_f32, b.da, c.st_bwd_aux());
  {
    auto s = c.bwd("DQ->T->Q a'");
    naive_col(c, b.a_f32, c.F_, b.a_col_f32, WgradOperand::kGemm2Input);
  }
  if (g.wants_dw2()) {
    auto s = c.bwd("GEMM2 wgrad (fp8)");
    c.fp8_wgrad(b.dy_col_f32, c.H_, b.a_col_f32, c.F_, g.dw2, g.dw2_bf16);
  }
  {
    auto s = c.bwd("dSwiGLU*prob (bf16)");
    cuda::dswiglu(b.da, b.h, c.step_.Mp, c.F_, b.dh, c.st_bwd(), c.stream_, c.ws_.routing.row_prob,
                  c.ws_.routing.dprob_partials, c.rows_bound(), c.cfg_.activation);
  }
  c.gemm1_bias_grad_bf16(g);
  {
    auto s = c.bwd("quantize dh (row, fp32 scales)");
    quantize_row_fp32_scale(b.dh, c.step_.Mp, 2 * c.F_, c.segment_offsets(), c.El_, b.dh_row_f32.codes, b.dh_row_f32.f32(),
                            c.st_bwd(), c.stream_);
  }
  c.log_rows(MoePass::kBackward, CastKind::kQuantize, report_names::kQuantizeDhFp32Scale, 1, 1, 2 * c.F_);
  {
    auto s = c.bwd("DQ->T->Q dh");
    naive_col(c, b.dh_row_f32, 2 * c.F_, b.dh_col_f32, WgradOperand::kGemm1Grad);
  }
  c.weight_dgrad(1, b.dh_row_f32, b.rows_bf16, c.st_bwd_aux());
  c.mark_dx_rows_ready();
  {
    auto s = c.bwd("DQ->T->Q x_perm");
    naive_col(c, b.x_perm_f32, c.H_, b.x_perm_col_f32, WgradOperand::kGemm1Input);
  }
  if (g.wants_dw1()) {
    auto s = c.bwd("GEMM1 wgrad (fp8)");
    c.fp8_wgrad(b.dh_col_f32, 2 * c.F_, b.x_perm_col_f32, c.H_, g.dw1, g.dw1_bf16);
  }
}

class Fp8NaiveSteps final : public PipelineSteps {
 public:
  void forward(StepContext& c, bf16_t* y) override { forward_naive(c, y); }
  void backward(StepContext& c, const bf16_t* dy, const MoeGrads& g) override { backward_naive(c, dy, g); }
};

}  // namespace

// The buffers only fp8-naive uses (workspace.h DataflowBufferPlan): the entry's FP32-scale rows and their
// dequantized copy, the saved x_perm and a' with FP32 scales, the DQ -> T -> Q column copies' scratch.
void plan_fp8_naive_buffers(const DataflowBufferPlan& p) {
  DeviceArena& a = p.arena;
  ExpertBuffers& x = p.x;
  const int64_t R = p.R, Tm = p.Tm, H = p.H, F = p.F, maxC = p.maxC;
  constexpr Region kS = Region::kSaved, kT = Region::kTransient;
  x.entry_f32 = row_1x128_f32(a.device<uint8_t>(Tm * H, kT), a.device<float>(Tm * H / 128, kT), Tm, H);
  x.entry_dequantized = a.device<bf16_t>(Tm * H, kT);
  x.x_perm_f32 = row_1x128_f32(a.device<uint8_t>(R * H, kS), a.device<float>(R * H / 128, kS), R, H);
  x.a_f32 = row_1x128_f32(a.device<uint8_t>(R * F, kS), a.device<float>(R * F / 128, kS), R, F);
  x.naive_dequantized = a.device<bf16_t>(R * maxC, kT);
  x.naive_transposed = a.device<bf16_t>(R * maxC, kT);
}

std::unique_ptr<PipelineSteps> make_fp8_naive_pipeline() { return std::unique_ptr<PipelineSteps>(new Fp8NaiveSteps); }

}  // namespace moe
}  // namespace cuda
}  // namespace flowmoe
