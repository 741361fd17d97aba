// The backward path of each recipe of the CPU MoE layer (src/cpu/moe/layer.h; SPEC §6): dy [T, H]
// -> GEMM2 dgrad and wgrad -> dSwiGLU*prob -> GEMM1 dgrad and wgrad. Each path fills dxp [Mp, H]
// (GEMM1 dgrad, unpermuted by router.cpp's tail) and dp [Mp] (d loss / d prob per row) and adds
// to dW1 and dW2. How each wgrad column operand is made is the recipe's table row
// (RecipeSpec::columns): quantized from BF16, scaling-aware transpose, DQ->T->Q, FP4RowToFP8Col.
#include <vector>

#include "cpu/moe/layer.h"
#include "flowmoe/gemm.h"

namespace flowmoe {
namespace cpu_moe {

namespace rn = report_names;

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

void CpuMoeLayer::backward_flow(const bf16_t* dy, const MoeGrads& g, bf16_t* dxp, float* dp,
                                QuantStats* st) {
  OpLog log(&report_, MoePass::kBackward);
  const SavedActivations& sv = saved_;
  const Segments& seg = route_.segments;
  QTensor dyq, dyr, dyc;
  *st += cpu::quantize_row(dy, T_, H_, &dyq);
  log.add(CastKind::kQuantize, spec_.quantize_dy_entry, 1, T_ * H_);
  // combine's backward: FP8 dispatch of dy (identity on one rank), FP8 permute+pad
  permute_fp8(dyq, &dyr, MoePass::kBackward, rn::kDispatchDy);
  // dY's wgrad copy: scaling-aware transpose
  const QuantStats tdy = cpu::scaling_aware_transpose(dyr, seg, &dyc, cfg_.transpose_exponent);
  *st += tdy;
  log.add(CastKind::kConvert, spec_.column(WgradOperand::kGemm2Grad).op, 1, Mp_ * H_);
  // GEMM2 dgrad and wgrad
  std::vector<bf16_t> da(Mp_ * F_);
  dgrad_fp8(dyr, sw().w2t_fp8, F_, da.data());
  if (g.dw2) cpu::grouped_wgrad_ref(dyc, sv.a_col, g.dw2, g.accumulate);
  // fused dSwiGLU * prob + quantize: dh row-wise (GEMM1 dgrad) and column-wise (its wgrad),
  // both from the BF16 dh, with h decoded exactly from its saved FP8 (MXFP4) copy
  std::vector<float> h(Mp_ * 2 * F_);
  cpu::dequantize(sv.h_quantized, h.data());
  std::vector<bf16_t> dh(Mp_ * 2 * F_);
  st->nonfinite += dswiglu_prob(da.data(), h.data(), route_.row_probs.data(), Mp_, F_, dh.data(),
                                dp, cfg_.activation);
  QTensor dhr, dhc;
  QuantStats qd = cpu::quantize_row(dh.data(), Mp_, 2 * F_, &dhr);
  qd += cpu::quantize_col(dh.data(), Mp_, 2 * F_, seg, &dhc);
  qd.nonfinite = 0;  // counted by dswiglu_prob
  *st += qd;
  log.add(CastKind::kFused, rn::kDswigluQuantRowCol, 2, Mp_ * 2 * F_);
  gemm1_bias_grad(dhr, g);
  // GEMM1 dgrad
  dgrad_fp8(dhr, sw().w1t_fp8, H_, dxp);
  // GEMM1 wgrad: x_perm's column copy (flow: scaling-aware transpose of the saved FP8 rows;
  // flow-fp4: FP4RowToFP8Col of the saved MXFP4 rows), then dW1 = dhᵀ · x_perm
  const ColumnSpec& xcol = spec_.column(WgradOperand::kGemm1Input);
  QTensor xpc;
  QuantStats tx;
  if (xcol.method == ColumnMethod::kScalingAwareTranspose)
    tx = cpu::scaling_aware_transpose(sv.xperm_fp8, seg, &xpc, cfg_.transpose_exponent);
  else
    tx = cpu::fp4_to_fp8_col(sv.xperm_mxfp4, seg, &xpc, cfg_.transpose_exponent);
  log.add(CastKind::kConvert, xcol.op, 1, Mp_ * H_);
  *st += tx;
  if (g.dw1) cpu::grouped_wgrad_ref(dhc, xpc, g.dw1, g.accumulate);
  if (cfg_.check_columns) {
    check_column(WgradOperand::kGemm1Input, xcol.method, decode(sv.xperm_fp8), decode(xpc), H_,
                 tx.underflow);
    check_column(WgradOperand::kGemm2Grad, spec_.column(WgradOperand::kGemm2Grad).method,
                 decode(dyr), decode(dyc), H_, tdy.underflow);
    check_column(WgradOperand::kGemm1Grad, spec_.column(WgradOperand::kGemm1Grad).method,
                 decode(dhr), decode(dhc), 2 * F_, 0);
  }
}

}  // namespace cpu_moe
}  // namespace flowmoe
