// The CPU reference's fp8-naive (Dataflow::kFp8Naive): operator substitution with FP32 scales,
// column copies DQ -> T -> Q.
// Its forward: x [T, H] (routed by router.cpp) -> GEMM1 -> SwiGLU*prob -> GEMM2 -> y [T, H], saving what
// the backward needs in the formats of the recipe's table row; its backward: dy -> GEMM2 dgrad and
// wgrad -> dSwiGLU*prob -> GEMM1 dgrad and wgrad, filling dxp [Mp, H] and dp [Mp] and adding to dW1,
// dW2 (SPEC §6). The CUDA layer's twin: src/cuda/moe/pipelines/fp8_naive.cu; the row that runs both:
// kCpuDataflows (layer.cpp).
#include <vector>

#include "cpu/moe/layer.h"
#include "flowmoe/gemm.h"
#include "flowmoe/swiglu.h"

namespace flowmoe {
namespace cpu_moe {

namespace rn = report_names;

// fp8-naive: DeepSeek-V3-style substitution with FP32 scales: FP8 dispatch (quantize before,
// dequantize after), each FP8 GEMM quantizes its BF16 input row-wise; BF16 between operators.
void CpuMoeLayer::forward_fp8_naive(bf16_t* y, QuantStats* st) {
  OpLog log(&report_, MoePass::kForward);
  SavedActivations& sv = saved_;
  cpu::QTensorF32 xq;
  *st += cpu::quantize_row_fp32_scale(route_.x.data(), T_, H_, &xq);
  log.add(CastKind::kQuantize, spec_.quantize_x_entry, 1, T_ * H_);
  std::vector<bf16_t> xp(Mp_ * H_);
  permute_fp32_scale(xq, MoePass::kForward, rn::kDispatchX, spec_.dequantize_x_after_dispatch,
                     &log, xp.data());
  *st += cpu::quantize_row_fp32_scale(xp.data(), Mp_, H_, &sv.xperm_fp32s);
  log.add(CastKind::kQuantize, rn::kQuantizeXpermFp32Scale, 1, Mp_ * H_);
  sv.h_bf16.assign(Mp_ * 2 * F_, 0);
  gemm_fp32_scale(sv.xperm_fp32s, sw().w1_fp32s, 2 * F_, sv.h_bf16.data());  // GEMM1
  std::vector<float> a(Mp_ * F_);
  st->nonfinite += swiglu_prob(widen(sv.h_bf16.data(), Mp_ * 2 * F_).data(),
                               route_.row_probs.data(), Mp_, F_, a.data(), cfg_.activation);
  const std::vector<bf16_t> ab = round_bf16(a);
  *st += cpu::quantize_row_fp32_scale(ab.data(), Mp_, F_, &sv.a_fp32s);
  log.add(CastKind::kQuantize, rn::kQuantizeAFp32Scale, 1, Mp_ * F_);
  std::vector<bf16_t> o(Mp_ * H_);
  gemm_fp32_scale(sv.a_fp32s, sw().w2_fp32s, H_, o.data());  // GEMM2
  unpermute_bf16(o, y);
  save_activation(spec_.gemm1_input, sv.xperm_fp32s.bytes());
  save_activation(spec_.gemm1_output, Mp_ * 2 * F_ * 2);
  save_activation(spec_.gemm2_input, sv.a_fp32s.bytes());
}

cpu::QTensorF32 CpuMoeLayer::dq_t_q_column(OpLog* log, const cpu::QTensorF32& row,
                                           WgradOperand operand, QuantStats* st) {
  cpu::QTensorF32 col;
  *st += cpu::naive_col_copy(row, route_.segments, &col);
  log->add(CastKind::kDequantize, dq_t_q_dequantize_name(operand), 1, row.rows * row.cols);
  log->add(CastKind::kQuantize, dq_t_q_quantize_name(operand), 1, row.rows * row.cols);
  return col;
}

void CpuMoeLayer::backward_fp8_naive(const bf16_t* dy, const MoeGrads& g, bf16_t* dxp, float* dp,
                                     QuantStats* st) {
  OpLog log(&report_, MoePass::kBackward);
  const SavedActivations& sv = saved_;
  // combine's backward is a dispatch of dy: FP8 on the wire, quantize before, dequantize after
  cpu::QTensorF32 dyq;
  *st += cpu::quantize_row_fp32_scale(dy, T_, H_, &dyq);
  log.add(CastKind::kQuantize, spec_.quantize_dy_entry, 1, T_ * H_);
  std::vector<bf16_t> dy_rows(Mp_ * H_);
  permute_fp32_scale(dyq, MoePass::kBackward, rn::kDispatchDy,
                     spec_.dequantize_dy_after_dispatch, &log, dy_rows.data());
  cpu::QTensorF32 dyr;
  *st += cpu::quantize_row_fp32_scale(dy_rows.data(), Mp_, H_, &dyr);
  log.add(CastKind::kQuantize, rn::kQuantizeDYFp32Scale, 1, Mp_ * H_);
  const cpu::QTensorF32 dyc = dq_t_q_column(&log, dyr, WgradOperand::kGemm2Grad, st);
  // GEMM2 dgrad: dY [Mp, H] x W2t [F, H]; GEMM2 wgrad with a''s column copy
  std::vector<bf16_t> da(Mp_ * F_);
  gemm_fp32_scale(dyr, sw().w2t_fp32s, F_, da.data());
  const cpu::QTensorF32 acn = dq_t_q_column(&log, sv.a_fp32s, WgradOperand::kGemm2Input, st);
  if (g.dw2) fp32_scale_wgrad(dyc, acn, g.dw2, g.accumulate);
  std::vector<bf16_t> dh(Mp_ * 2 * F_);
  st->nonfinite += dswiglu_prob(da.data(), widen(sv.h_bf16.data(), Mp_ * 2 * F_).data(),
                                route_.row_probs.data(), Mp_, F_, dh.data(), dp, cfg_.activation);
  cpu::QTensorF32 dhr;
  *st += cpu::quantize_row_fp32_scale(dh.data(), Mp_, 2 * F_, &dhr);
  log.add(CastKind::kQuantize, rn::kQuantizeDhFp32Scale, 1, Mp_ * 2 * F_);
  const cpu::QTensorF32 dhc = dq_t_q_column(&log, dhr, WgradOperand::kGemm1Grad, st);
  // GEMM1 dgrad: dh [Mp, 2F] x W1t [H, 2F]; GEMM1 wgrad with x_perm's column copy
  gemm_fp32_scale(dhr, sw().w1t_fp32s, H_, dxp);
  const cpu::QTensorF32 xpc = dq_t_q_column(&log, sv.xperm_fp32s, WgradOperand::kGemm1Input, st);
  if (g.dw1) fp32_scale_wgrad(dhc, xpc, g.dw1, g.accumulate);
  if (cfg_.check_columns) {
    const ColumnMethod m = ColumnMethod::kDequantTransposeQuant;
    check_column(WgradOperand::kGemm1Input, m, decode(sv.xperm_fp32s), decode(xpc), H_, 0);
    check_column(WgradOperand::kGemm2Input, m, decode(sv.a_fp32s), decode(acn), F_, 0);
    check_column(WgradOperand::kGemm2Grad, m, decode(dyr), decode(dyc), H_, 0);
    check_column(WgradOperand::kGemm1Grad, m, decode(dhr), decode(dhc), 2 * F_, 0);
  }
}

}  // namespace cpu_moe
}  // namespace flowmoe
