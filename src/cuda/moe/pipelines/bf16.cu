// The bf16 recipe's pipeline (Dataflow::kBf16Gemms; pipeline.h): BF16 token rows, BF16 GEMMs
// (cuBLASLt per expert or the sm_90a BF16 kernels: StepContext::bf16_*), BF16 activations saved.
// Its backward runs the GEMMs' dgrads and wgrads from the BF16 dY rows; no quantization anywhere.
// Parameters stored as a model keeps them (gpt-oss) are read there by the grouped kernels
// (StepContext::stored_gemms) or relaid for the pass (CudaMoeLayer::relay_params).
#include <cuda_runtime.h>

#include <memory>

#include "cuda/common.cuh"
#include "cuda/moe/pipelines/pipeline.h"
#include "flowmoe/swiglu.h"

namespace flowmoe {
namespace cuda {
namespace moe {
namespace {

void forward_bf16(StepContext& c, bf16_t* y) {
  ExpertBuffers& b = c.ws_.expert;
  {
    auto s = c.fwd(c.comm_ ? "dispatch x (bf16)" : "permute+pad x (bf16)");
    c.move_bf16(c.ws_.routing.x, b.x_perm, MoePass::kForward, report_names::kDispatchX);
  }
  const bool stored = c.stored_gemms();  // (the parameters where the model stores them: no relaid copy)
  {
    auto s = c.fwd("GEMM1 fprop (bf16)");
    if (stored)
      c.bf16_fprop(b.x_perm, 2 * c.F_, c.H_, c.stored_weight(1), b.h);  // (h in the layer's order)
    else
      c.bf16_fprop(b.x_perm, 2 * c.F_, c.H_, c.bf16_weight(1), b.h);
  }
  {  // (GEMM1's bias added as the kernel reads h, the biased h stored back: the backward reads it)
    const GateUpBias bias = c.gemm1_bias_on_read(/*store_h=*/true);
    auto s = c.fwd(bias.bias ? "b1 + SwiGLU*prob (bf16)" : "SwiGLU*prob (bf16)");
    cuda::swiglu(b.h, c.step_.Mp, c.F_, b.a, c.st_fwd(), c.stream_, c.ws_.routing.row_prob, c.rows_bound(),
                 c.cfg_.activation, bias);
  }
  c.gemm2_then_combine(
      "GEMM2 fprop (bf16)",
      [&] {
        if (stored)
          c.bf16_fprop(b.a, c.H_, c.F_, c.stored_weight(2), b.rows_bf16);
        else
          c.bf16_fprop(b.a, c.H_, c.F_, c.bf16_weight(2), b.rows_bf16);
      },
      y);
}

void backward_bf16(StepContext& c, const bf16_t* dy, const MoeGrads& g) {
  ExpertBuffers& b = c.ws_.expert;
  {
    auto s = c.bwd(c.comm_ ? "dispatch dy (bf16)" : "permute+pad dy (bf16)");  // dY rows into rows_bf16
    c.move_bf16(dy, b.rows_bf16, MoePass::kBackward, report_names::kDispatchDy);
  }
  // Stored parameters read in place: with gate / up pairs, dh in their order (GEMM1's dgrad reduces
  // over W1's stored columns; its wgrad then writes dW1 as stored without interleaving it again)
  const bool stored = c.stored_gemms(g);
  const bool dh_gate_up = stored && c.call_params_.storage.interleaved;
  {
    auto s = c.bwd("GEMM2 dgrad (bf16)");
    if (stored)
      c.bf16_dgrad(b.rows_bf16, c.H_, c.F_, c.stored_weight(2), b.da);
    else
      c.bf16_dgrad(b.rows_bf16, c.H_, c.F_, c.bf16_weight(2), b.da);
  }
  if (g.wants_dw2()) {
    auto s = c.bwd("GEMM2 wgrad (bf16)");
    const ExpertStorage& st = g.storage;  // (stored: W2 as [El, Fs, Hs])
    c.bf16_wgrad(b.rows_bf16, c.H_, b.a, c.F_, g.dw2, g.dw2_bf16,
                 st.is_layer_layout() ? gemm::StoredDw{} : gemm::StoredDw{st.ffn, st.hidden, false});
  }
  {
    auto s = c.bwd("dSwiGLU*prob (bf16)");
    cuda::dswiglu(b.da, b.h, c.step_.Mp, c.F_, b.dh, c.st_bwd(), c.stream_, c.ws_.routing.row_prob,
                  c.ws_.routing.dprob_partials, c.rows_bound(), c.cfg_.activation, dh_gate_up);
  }
  c.gemm1_bias_grad_bf16(g, dh_gate_up);
  // GEMM1 dgrad overwrites dY's storage with the dX rows: GEMM2's grads have read it
  {
    auto s = c.bwd("GEMM1 dgrad (bf16)");
    if (stored)
      c.bf16_dgrad(b.dh, 2 * c.F_, c.H_, c.stored_weight(1), b.rows_bf16);
    else
      c.bf16_dgrad(b.dh, 2 * c.F_, c.H_, c.bf16_weight(1), b.rows_bf16);
  }
  c.mark_dx_rows_ready();
  if (g.wants_dw1()) {
    auto s = c.bwd("GEMM1 wgrad (bf16)");
    const ExpertStorage& st = g.storage;  // (stored: W1 as [El, Hs, 2Fs])
    c.bf16_wgrad(b.dh, 2 * c.F_, b.x_perm, c.H_, g.dw1, g.dw1_bf16,
                 st.is_layer_layout() ? gemm::StoredDw{}
                                      : gemm::StoredDw{st.hidden, 2 * st.ffn, st.interleaved && !dh_gate_up});
  }
}

class Bf16Steps final : public PipelineSteps {
 public:
  void forward(StepContext& c, bf16_t* y) override { forward_bf16(c, y); }
  void backward(StepContext& c, const bf16_t* dy, const MoeGrads& g) override {
    c.streams_->with_side_drained([&] { backward_bf16(c, dy, g); });
  }
};

}  // namespace

std::unique_ptr<PipelineSteps> make_bf16_pipeline() { return std::unique_ptr<PipelineSteps>(new Bf16Steps); }

}  // namespace moe
}  // namespace cuda
}  // namespace flowmoe
