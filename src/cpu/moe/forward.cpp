// The forward path of each recipe of the CPU MoE layer (src/cpu/moe/layer.h; SPEC §6): x [T, H]
// (routed by router.cpp) -> GEMM1 -> SwiGLU*prob -> GEMM2 -> y [T, H], saving what the backward
// needs in the format of the recipe's table row (RecipeSpec::gemm1_input, gemm1_output,
// gemm2_input).
#include <vector>

#include "cpu/moe/layer.h"
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

}  // namespace cpu_moe
}  // namespace flowmoe
