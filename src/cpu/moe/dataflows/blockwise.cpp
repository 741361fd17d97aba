// The CPU reference's blockwise (Dataflow::kBlockwise): BF16 between the GEMMs, each grouped linear quantizes its BF16
// input (row and column copies, UE8M0 scales).
// Its forward: x [T, H] (routed by router.cpp) -> GEMM1 -> SwiGLU*prob -> GEMM2 -> y [T, H], saving what
// the backward needs in the formats of the recipe's table row; its backward: dy -> GEMM2 dgrad and
// wgrad -> dSwiGLU*prob -> GEMM1 dgrad and wgrad, filling dxp [Mp, H] and dp [Mp] and adding to dW1,
// dW2 (SPEC §6). The CUDA layer's twin: src/cuda/moe/pipelines/blockwise.cu; the row that runs both:
// kCpuDataflows (layer.cpp).
#include <vector>

#include "cpu/moe/layer.h"
#include "flowmoe/gemm.h"
#include "flowmoe/swiglu.h"

namespace flowmoe {
namespace cpu_moe {

namespace rn = report_names;

// blockwise: BF16 dataflow; each grouped linear quantizes its BF16 input, row and column copies.
void CpuMoeLayer::forward_blockwise(bf16_t* y, QuantStats* st) {
  OpLog log(&report_, MoePass::kForward);
  SavedActivations& sv = saved_;
  std::vector<bf16_t> xp(Mp_ * H_);
  permute_bf16(route_.x.data(), xp.data(), MoePass::kForward, rn::kDispatchX);
  QTensor xr;
  *st += cpu::quantize_both(xp.data(), Mp_, H_, route_.segments, &xr, &sv.xperm_col);
  log.add(CastKind::kQuantize, rn::kQuantizeXpermBoth, 2, Mp_ * H_);
  fprop_fp8(xr, sw().w1_fp8, 2 * F_, &sv.h_bf16);  // GEMM1
  add_gemm1_bias(&sv.h_bf16);
  std::vector<float> a(Mp_ * F_);
  st->nonfinite += swiglu_prob(widen(sv.h_bf16.data(), Mp_ * 2 * F_).data(),
                               route_.row_probs.data(), Mp_, F_, a.data(), cfg_.activation);
  const std::vector<bf16_t> ab = round_bf16(a);
  QTensor ar;
  *st += cpu::quantize_both(ab.data(), Mp_, F_, route_.segments, &ar, &sv.a_col);
  log.add(CastKind::kQuantize, rn::kQuantizeABoth, 2, Mp_ * F_);
  std::vector<bf16_t> o;
  fprop_fp8(ar, sw().w2_fp8, H_, &o);  // GEMM2
  unpermute_bf16(o, y);
  save_activation(spec_.gemm1_input, qbytes(sv.xperm_col));
  save_activation(spec_.gemm1_output, Mp_ * 2 * F_ * 2);
  save_activation(spec_.gemm2_input, qbytes(sv.a_col));
  if (cfg_.check_columns) {
    const ColumnMethod m = ColumnMethod::kQuantizeFromBf16;
    check_column(WgradOperand::kGemm1Input, m, decode(xr), decode(sv.xperm_col), H_, 0);
    check_column(WgradOperand::kGemm2Input, m, decode(ar), decode(sv.a_col), F_, 0);
  }
}

void CpuMoeLayer::backward_blockwise(const bf16_t* dy, const MoeGrads& g, bf16_t* dxp, float* dp,
                                     QuantStats* st) {
  OpLog log(&report_, MoePass::kBackward);
  const SavedActivations& sv = saved_;
  const Segments& seg = route_.segments;
  std::vector<bf16_t> dy_rows(Mp_ * H_);
  permute_bf16(dy, dy_rows.data(), MoePass::kBackward, rn::kDispatchDy);
  QTensor dyr, dyc;
  *st += cpu::quantize_both(dy_rows.data(), Mp_, H_, seg, &dyr, &dyc);
  log.add(CastKind::kQuantize, rn::kQuantizeDYBoth, 2, Mp_ * H_);
  // GEMM2 dgrad and wgrad
  std::vector<bf16_t> da(Mp_ * F_);
  dgrad_fp8(dyr, sw().w2t_fp8, F_, da.data());
  if (g.dw2) cpu::grouped_wgrad_ref(dyc, sv.a_col, g.dw2, g.accumulate);
  std::vector<bf16_t> dh(Mp_ * 2 * F_);
  st->nonfinite += dswiglu_prob(da.data(), widen(sv.h_bf16.data(), Mp_ * 2 * F_).data(),
                                route_.row_probs.data(), Mp_, F_, dh.data(), dp, cfg_.activation);
  QTensor dhr, dhc;
  *st += cpu::quantize_both(dh.data(), Mp_, 2 * F_, seg, &dhr, &dhc);
  log.add(CastKind::kQuantize, rn::kQuantizeDhBoth, 2, Mp_ * 2 * F_);
  gemm1_bias_grad(dh, g);
  // GEMM1 dgrad and wgrad
  dgrad_fp8(dhr, sw().w1t_fp8, H_, dxp);
  if (g.dw1) cpu::grouped_wgrad_ref(dhc, sv.xperm_col, g.dw1, g.accumulate);
  if (cfg_.check_columns) {
    const ColumnMethod m = ColumnMethod::kQuantizeFromBf16;
    check_column(WgradOperand::kGemm2Grad, m, decode(dyr), decode(dyc), H_, 0);
    check_column(WgradOperand::kGemm1Grad, m, decode(dhr), decode(dhc), 2 * F_, 0);
  }
}

}  // namespace cpu_moe
}  // namespace flowmoe
