// The steps more than one pipeline runs (pipeline.h; members of the step context, step_context.h):
// GEMM2 and the way back to the tokens (every pipeline), GEMM1's bias and its gradient (bf16,
// blockwise, flow), the UE8M0 recipes' backward GEMM pairs (blockwise, flow).
#include <cuda_runtime.h>

#include <functional>

#include "cuda/common.cuh"
#include "cuda/moe/step_context.h"
#include "flowmoe/expert_bias.h"
#include "flowmoe/swiglu.h"

namespace flowmoe {
namespace cuda {
namespace moe {

// GEMM1's bias (MoeConfig::gemm1_bias) on h as the activation kernel reads it: every row of the
// segments, as the CPU layer adds it before the activation (none without the bias).
GateUpBias StepContext::gemm1_bias_on_read(bool store_h) const {
  GateUpBias b;
  if (gemm1_bias_ == nullptr) return b;
  b.bias = gemm1_bias_;
  b.offsets = segment_offsets();
  b.num_segments = El_;
  b.biased_h = store_h ? ws_.expert.h : nullptr;
  return b;
}

// GEMM2 (gemm2() computes the expert output rows into ExpertBuffers::rows_bf16) and the way back
// to the tokens.
void StepContext::gemm2_then_combine(const char* gemm_stage, const std::function<void()>& gemm2, bf16_t* y) {
  {
    auto s = fwd(gemm_stage);
    gemm2();
  }
  {
    auto s = fwd(comm_ ? "combine + unpermute" : "unpermute+unpad");
    combine_y(y);
  }
}

// db1 (MoeConfig::gemm1_bias) from the dH that GEMM1's dgrad reads: BF16 (bf16, blockwise) or
// row-wise FP8 (flow, flow-fp4), as the CPU layer.
void StepContext::gemm1_bias_grad_bf16(const MoeGrads& g, bool dh_gate_up) {
  if (!g.db1) return;
  auto s = bwd("GEMM1 bias grad (db1 from bf16 dh)");
  expert_bias_grad(ws_.expert.dh, step_.Mp, 2 * F_, segment_offsets(), El_, g.db1, g.accumulate, rows_bound(), stream_,
                   dh_gate_up);
}
void StepContext::gemm1_bias_grad_fp8(const MoeGrads& g, const QTensorView& dh_row) {
  if (!g.db1) return;
  auto s = bwd("GEMM1 bias grad (db1 from fp8 dh)");
  expert_bias_grad_fp8(dh_row.codes, dh_row.ue8m0(), step_.Mp, 2 * F_, segment_offsets(), El_, g.db1, g.accumulate,
                       rows_bound(), stream_);
}

// The UE8M0 recipes' backward GEMMs (blockwise, flow, flow-fp4), each dgrad followed by the wgrad
// that reads the same gradient; `side`: the side event the wgrad waits for, or -1.
// GEMM2: dgrad from dY row-wise into da, wgrad from dY's and a''s column copies into dW2.
void StepContext::fp8_gemm2_grads(const MoeGrads& g, int side) {
  ExpertBuffers& b = ws_.expert;
  weight_dgrad(2, b.dy_row, b.da, st_bwd_aux());
  fp8_gemm2_wgrad(g, side);
}
// GEMM2's wgrad alone (after the side event `side`, or -1), from dY's and a''s column copies.
void StepContext::fp8_gemm2_wgrad(const MoeGrads& g, int side) {
  if (side >= 0) streams_->join(side);
  if (!g.wants_dw2()) return;
  auto s = bwd("GEMM2 wgrad (fp8)");
  const ExpertStorage& st = g.storage;  // (stored: W2 as [El, Fs, Hs])
  fp8_wgrad(ws_.expert.dy_col, H_, ws_.expert.a_col, F_, g.dw2, g.dw2_bf16,
            st.is_layer_layout() ? gemm::StoredDw{} : gemm::StoredDw{st.ffn, st.hidden, false});
}
// GEMM1: dgrad from dh row-wise into the dX rows (rows_bf16), then mark_dx_rows_ready; wgrad from dh's column
// copy and x_perm's (`x_perm_col`) into dW1. RecipePath::dx_rows_in_column_copies: the wgrad first,
// since the dgrad then writes the dX rows over the two column copies.
void StepContext::fp8_gemm1_grads(const MoeGrads& g, const QTensorView& dh_row, const QTensorView& dh_col,
                                 const QTensorView& x_perm_col, int side) {
  ExpertBuffers& b = ws_.expert;
  const auto wgrad = [&] {
    if (side >= 0) streams_->join(side);
    if (!g.wants_dw1()) return;
    auto s = bwd("GEMM1 wgrad (fp8)");
    const ExpertStorage& st = g.storage;  // (stored: W1 as [El, Hs, 2Fs])
    fp8_wgrad(dh_col, 2 * F_, x_perm_col, H_, g.dw1, g.dw1_bf16,
              st.is_layer_layout() ? gemm::StoredDw{} : gemm::StoredDw{st.hidden, 2 * st.ffn, st.interleaved});
  };
  if (path_.dx_rows_in_column_copies) wgrad();
  weight_dgrad(1, dh_row, b.rows_bf16, st_bwd_aux());
  mark_dx_rows_ready();
  if (!path_.dx_rows_in_column_copies) wgrad();
}

}  // namespace moe
}  // namespace cuda
}  // namespace flowmoe
