// The blockwise recipe's pipeline (Dataflow::kBlockwise; pipeline.h): BF16 token rows and BF16
// between the GEMMs; each grouped linear quantizes its BF16 input into a row-wise and a
// column-wise FP8 copy (UE8M0 scales, quantize_col) and runs the FP8 GEMM. The backward's GEMM
// pairs are the UE8M0 recipes' (StepContext::fp8_gemm2_grads / fp8_gemm1_grads, shared.cu).
#include <cuda_runtime.h>

#include <memory>

#include "cuda/common.cuh"
#include "cuda/moe/pipelines/pipeline.h"
#include "flowmoe/swiglu.h"

namespace flowmoe {
namespace cuda {
namespace moe {
namespace {

void forward_blockwise(StepContext& c, bf16_t* y) {
  ExpertBuffers& b = c.ws_.expert;
  const WeightBuffers& w = c.ws_.weights;
  const SegmentBlocks sb = c.blocks();
  bf16_t* xp = b.rows_bf16;  // x_perm staged in BF16 until its quantization (GEMM2 writes y there)
  {
    auto s = c.fwd(c.comm_ ? "dispatch x (bf16)" : "permute+pad x (bf16)");
    c.move_bf16(c.ws_.routing.x, xp, MoePass::kForward, report_names::kDispatchX);
  }
  const QTensorView& x_row = b.x_perm_fp8;
  {
    auto s = c.fwd("quantize x_perm (row + col)");
    quantize_col(xp, c.H_, sb, b.x_perm_col.codes, b.x_perm_col.ue8m0(), x_row.codes, x_row.ue8m0(), c.st_fwd(),
                 c.stream_);
  }
  c.log_rows(MoePass::kForward, CastKind::kQuantize, report_names::kQuantizeXpermBoth, 1, 2, c.H_);
  {
    auto s = c.fwd("GEMM1 fprop (fp8)");
    c.fp8_fprop(x_row, 2 * c.F_, c.H_, w.w1, b.h, c.st_fwd_aux());
  }
  {  // (GEMM1's bias added as the kernel reads h, the biased h stored back: the backward reads it)
    const GateUpBias bias = c.gemm1_bias_on_read(/*store_h=*/true);
    auto s = c.fwd(bias.bias ? "b1 + SwiGLU*prob (bf16)" : "SwiGLU*prob (bf16)");
    cuda::swiglu(b.h, c.step_.Mp, c.F_, b.a, c.st_fwd(), c.stream_, c.ws_.routing.row_prob, c.rows_bound(),
                 c.cfg_.activation, bias);
  }
  {
    auto s = c.fwd("quantize a' (row + col)");
    quantize_col(b.a, c.F_, sb, b.a_col.codes, b.a_col.ue8m0(), b.a_row.codes, b.a_row.ue8m0(), c.st_fwd(), c.stream_);
  }
  c.log_rows(MoePass::kForward, CastKind::kQuantize, report_names::kQuantizeABoth, 1, 2, c.F_);
  c.gemm2_then_combine(
      "GEMM2 fprop (fp8)", [&] { c.fp8_fprop(b.a_row, c.H_, c.F_, w.w2, b.rows_bf16, c.st_fwd_aux()); }, y);
}

void backward_blockwise(StepContext& c, const bf16_t* dy, const MoeGrads& g) {
  ExpertBuffers& b = c.ws_.expert;
  const SegmentBlocks sb = c.blocks();
  {
    auto s = c.bwd(c.comm_ ? "dispatch dy (bf16)" : "permute+pad dy (bf16)");  // dY rows into rows_bf16
    c.move_bf16(dy, b.rows_bf16, MoePass::kBackward, report_names::kDispatchDy);
  }
  {
    auto s = c.bwd("quantize dY (row + col)");
    quantize_col(b.rows_bf16, c.H_, sb, b.dy_col.codes, b.dy_col.ue8m0(), b.dy_row.codes, b.dy_row.ue8m0(), c.st_bwd(),
                 c.stream_);
  }
  c.log_rows(MoePass::kBackward, CastKind::kQuantize, report_names::kQuantizeDYBoth, 1, 2, c.H_);
  c.fp8_gemm2_grads(g, -1);  // (it ends before the dh quantize overwrites dY's copies)
  {
    auto s = c.bwd("dSwiGLU*prob (bf16)");
    cuda::dswiglu(b.da, b.h, c.step_.Mp, c.F_, b.dh, c.st_bwd(), c.stream_, c.ws_.routing.row_prob,
                  c.ws_.routing.dprob_partials, c.rows_bound(), c.cfg_.activation);
  }
  c.gemm1_bias_grad_bf16(g);
  {
    auto s = c.bwd("quantize dh (row + col)");
    quantize_col(b.dh, 2 * c.F_, sb, b.dh_col.codes, b.dh_col.ue8m0(), b.dh_row.codes, b.dh_row.ue8m0(), c.st_bwd(),
                 c.stream_);
  }
  c.log_rows(MoePass::kBackward, CastKind::kQuantize, report_names::kQuantizeDhBoth, 1, 2, 2 * c.F_);
  c.fp8_gemm1_grads(g, b.dh_row, b.dh_col, b.x_perm_col, -1);
}

class BlockwiseSteps final : public PipelineSteps {
 public:
  void forward(StepContext& c, bf16_t* y) override { forward_blockwise(c, y); }
  void backward(StepContext& c, const bf16_t* dy, const MoeGrads& g) override {
    c.streams_->with_side_drained([&] { backward_blockwise(c, dy, g); });
  }
};

}  // namespace

// The buffers only blockwise uses (workspace.h DataflowBufferPlan): the saved column copies of x_perm and a'.
void plan_blockwise_buffers(const DataflowBufferPlan& p) {
  DeviceArena& a = p.arena;
  ExpertBuffers& x = p.x;
  const int64_t R = p.R, H = p.H, F = p.F, MB = p.MB;
  constexpr Region kS = Region::kSaved;
  x.x_perm_col = col_128x1(a.device<uint8_t>(H * R, kS), a.device<uint8_t>(MB * H, kS), R, H, MB);
  x.a_col = col_128x1(a.device<uint8_t>(F * R, kS), a.device<uint8_t>(MB * F, kS), R, F, MB);
}

std::unique_ptr<PipelineSteps> make_blockwise_pipeline() { return std::unique_ptr<PipelineSteps>(new BlockwiseSteps); }

}  // namespace moe
}  // namespace cuda
}  // namespace flowmoe
