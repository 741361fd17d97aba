// The CPU reference's bf16 (Dataflow::kBf16Gemms): BF16 operands, FP32 accumulation.
// Its forward: x [T, H] (routed by router.cpp) -> GEMM1 -> SwiGLU*prob -> GEMM2 -> y [T, H], saving what
// the backward needs in the formats of the recipe's table row; its backward: dy -> GEMM2 dgrad and
// wgrad -> dSwiGLU*prob -> GEMM1 dgrad and wgrad, filling dxp [Mp, H] and dp [Mp] and adding to dW1,
// dW2 (SPEC §6). The CUDA layer's twin: src/cuda/moe/pipelines/bf16.cu; the row that runs both:
// kCpuDataflows (layer.cpp).
#include <vector>

#include "cpu/moe/layer.h"
#include "flowmoe/gemm.h"
#include "flowmoe/swiglu.h"

namespace flowmoe {
namespace cpu_moe {

namespace rn = report_names;

// bf16: BF16 operands, FP32 accumulation.
void CpuMoeLayer::forward_bf16(bf16_t* y, QuantStats* st) {
  SavedActivations& sv = saved_;
  sv.xperm_bf16.assign(Mp_ * H_, 0);
  permute_bf16(route_.x.data(), sv.xperm_bf16.data(), MoePass::kForward, rn::kDispatchX);
  fprop_bf16(sv.xperm_bf16, sw().w1_bf16, 2 * F_, H_, &sv.h_bf16);  // GEMM1
  add_gemm1_bias(&sv.h_bf16);
  std::vector<float> a(Mp_ * F_);
  st->nonfinite += swiglu_prob(widen(sv.h_bf16.data(), Mp_ * 2 * F_).data(),
                               route_.row_probs.data(), Mp_, F_, a.data(), cfg_.activation);
  sv.a_bf16 = round_bf16(a);
  std::vector<bf16_t> o;
  fprop_bf16(sv.a_bf16, sw().w2_bf16, H_, F_, &o);  // GEMM2
  unpermute_bf16(o, y);
  save_activation(spec_.gemm1_input, Mp_ * H_ * 2);
  save_activation(spec_.gemm1_output, Mp_ * 2 * F_ * 2);
  save_activation(spec_.gemm2_input, Mp_ * F_ * 2);
}

void CpuMoeLayer::backward_bf16(const bf16_t* dy, const MoeGrads& g, bf16_t* dxp, float* dp,
                                QuantStats* st) {
  const SavedActivations& sv = saved_;
  const Segments& seg = route_.segments;
  std::vector<bf16_t> dy_rows(Mp_ * H_);
  permute_bf16(dy, dy_rows.data(), MoePass::kBackward, rn::kDispatchDy);
  // GEMM2 dgrad and wgrad
  std::vector<bf16_t> da(Mp_ * F_);
  dgrad_bf16(dy_rows, sw().w2_bf16, H_, F_, da.data());
  if (g.dw2)
    cpu::grouped_wgrad_bf16_ref(dy_rows.data(), sv.a_bf16.data(), seg, H_, F_, g.dw2,
                                g.accumulate);
  std::vector<bf16_t> dh(Mp_ * 2 * F_);
  st->nonfinite += dswiglu_prob(da.data(), widen(sv.h_bf16.data(), Mp_ * 2 * F_).data(),
                                route_.row_probs.data(), Mp_, F_, dh.data(), dp, cfg_.activation);
  gemm1_bias_grad(dh, g);
  // GEMM1 dgrad and wgrad
  dgrad_bf16(dh, sw().w1_bf16, 2 * F_, H_, dxp);
  if (g.dw1)
    cpu::grouped_wgrad_bf16_ref(dh.data(), sv.xperm_bf16.data(), seg, 2 * F_, H_, g.dw1,
                                g.accumulate);
}

}  // namespace cpu_moe
}  // namespace flowmoe
