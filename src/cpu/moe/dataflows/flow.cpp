// The CPU reference's flow and flow-fp4 (Dataflow::kFlow): quantized once at the entry, FP8 / MXFP4 between the
// GEMMs, fused (d)SwiGLU + quantize, exact column copies.
// Its forward: x [T, H] (routed by router.cpp) -> GEMM1 -> SwiGLU*prob -> GEMM2 -> y [T, H], saving what
// the backward needs in the formats of the recipe's table row; its backward: dy -> GEMM2 dgrad and
// wgrad -> dSwiGLU*prob -> GEMM1 dgrad and wgrad, filling dxp [Mp, H] and dp [Mp] and adding to dW1,
// dW2 (SPEC §6). The CUDA layer's twin: src/cuda/moe/pipelines/flow.cu; the row that runs both:
// kCpuDataflows (layer.cpp).
#include <vector>

#include "cpu/moe/layer.h"
#include "flowmoe/gemm.h"
#include "flowmoe/swiglu.h"

namespace flowmoe {
namespace cpu_moe {

namespace rn = report_names;

// flow / flow-fp4: quantize once at the entry, permute in FP8 (MXFP4), fused SwiGLU+quant,
// activations saved quantized.
void CpuMoeLayer::forward_flow(bf16_t* y, QuantStats* st) {
  OpLog log(&report_, MoePass::kForward);
  SavedActivations& sv = saved_;
  const bool fp4 = spec_.entry == TensorFormat::kMxfp4Row;
  QTensor xr;  // GEMM1 input, FP8 row-wise [Mp, H]
  if (!fp4) {
    QTensor xq;
    *st += cpu::quantize_row(route_.x.data(), T_, H_, &xq);
    log.add(CastKind::kQuantize, spec_.quantize_x_entry, 1, T_ * H_);
    // dispatch: identity on a single rank, FP8 payload
    permute_fp8(xq, &sv.xperm_fp8, MoePass::kForward, rn::kDispatchX);
    xr = sv.xperm_fp8;
  } else {
    QTensor xq;
    *st += cpu::quantize_mxfp4(route_.x.data(), T_, H_, &xq);
    log.add(CastKind::kQuantize, spec_.quantize_x_entry, 1, T_ * H_);
    permute_mxfp4(xq);
    *st += cpu::fp4_to_fp8_row(sv.xperm_mxfp4, &xr);
    log.add(CastKind::kConvert, rn::kFp4RowToFp8RowXperm, 1, Mp_ * H_);
    if (cfg_.check_columns) sv.xperm_fp8 = xr;  // kept only to compare with the wgrad copy
  }
  std::vector<bf16_t> h;
  fprop_fp8(xr, sw().w1_fp8, 2 * F_, &h);  // GEMM1
  add_gemm1_bias(&h);
  // fused SwiGLU * prob + quantize: a' row-wise (GEMM2 input), a' column-wise (its wgrad copy,
  // = scaling-aware transpose of the row-wise tiles), h row-wise (saved for dSwiGLU)
  std::vector<float> a(Mp_ * F_);
  st->nonfinite += swiglu_prob(widen(h.data(), Mp_ * 2 * F_).data(), route_.row_probs.data(),
                               Mp_, F_, a.data(), cfg_.activation);
  QTensor ar;
  QuantStats qa = cpu::quantize_row(a.data(), Mp_, F_, &ar);
  qa.nonfinite = 0;  // already counted by swiglu_prob (each value once)
  *st += qa;
  const QuantStats tr =
      cpu::scaling_aware_transpose(ar, route_.segments, &sv.a_col, cfg_.transpose_exponent);
  st->underflow += tr.underflow;
  // h saved for dSwiGLU: row-wise FP8 (flow) or MXFP4 1x32 (flow-fp4: FP4 saved activations), of
  // the copy that keeps the clamped activation's decisions (cpu::saved_h; SwiGLU: h itself)
  if (cfg_.activation.clamped()) cpu::saved_h(h.data(), Mp_, F_, h.data(), cfg_.activation);  // (a' is made)
  if (spec_.gemm1_output.format == TensorFormat::kFp8Row)
    *st += cpu::quantize_row(h.data(), Mp_, 2 * F_, &sv.h_quantized);
  else
    *st += cpu::quantize_mxfp4(h.data(), Mp_, 2 * F_, &sv.h_quantized);
  log.add(CastKind::kFused, fp4 ? rn::kSwigluQuantRowColHMxfp4 : rn::kSwigluQuantRowColHRow, 3,
          Mp_ * 2 * F_);
  std::vector<bf16_t> o;
  fprop_fp8(ar, sw().w2_fp8, H_, &o);  // GEMM2
  unpermute_bf16(o, y);
  save_activation(spec_.gemm1_input, qbytes(fp4 ? sv.xperm_mxfp4 : sv.xperm_fp8));
  save_activation(spec_.gemm1_output, qbytes(sv.h_quantized));
  save_activation(spec_.gemm2_input, qbytes(sv.a_col));
  if (cfg_.check_columns)
    check_column(WgradOperand::kGemm2Input, spec_.column(WgradOperand::kGemm2Input).method,
                 decode(ar), decode(sv.a_col), F_, tr.underflow);
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
