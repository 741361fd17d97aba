// Token movement of the CPU MoE layer (src/cpu/moe/layer.h): on one rank permute+pad into the
// local experts' padded segments and unpermute back; with a communicator (expert parallelism,
// docs/EP.md §5) the same moves as dispatch / combine over the ranks, in the recipe's wire format
// (RecipeSpec::forward_wire, backward_wire), each exchange recorded as a WireTransfer.
#include <cstring>
#include <vector>

#include "common/moe_ep.h"
#include "cpu/moe/layer.h"

namespace flowmoe {
namespace cpu_moe {

namespace rn = report_names;

DispatchPlan CpuMoeLayer::plan_for(MoePass pass, WireFormat f) const {
  return ep_detail::plan_for(route_.plan, pass, f);
}

void CpuMoeLayer::log_dispatch(MoePass pass, const std::string& name, const DispatchPlan& p) {
  report_.wire.push_back(ep_detail::dispatch_transfer(pass, name, p));
}

void CpuMoeLayer::log_combine(MoePass pass, const std::string& name, const std::string& format,
                              int64_t row_bytes) {
  report_.wire.push_back(ep_detail::combine_transfer(pass, name, format, row_bytes, route_.plan));
}

void CpuMoeLayer::permute_bf16(const bf16_t* tokens, bf16_t* rows, MoePass pass,
                               const char* name) {
  if (comm_ == nullptr) {
    cpu::permute_pad_bf16(tokens, H_, route_.routing, rows);
    return;
  }
  const DispatchPlan p = plan_for(pass, WireFormat::kBf16);
  const bool fwd = pass == MoePass::kForward;
  ep_dispatch_bf16(*comm_, p, tokens, fwd ? route_.probs.data() : nullptr, rows,
                   fwd ? route_.row_probs.data() : nullptr);
  log_dispatch(pass, name, p);
}

void CpuMoeLayer::unpermute_bf16(const std::vector<bf16_t>& rows, bf16_t* tokens) {
  if (comm_ == nullptr) {
    cpu::unpermute_unpad(rows.data(), nullptr, H_, route_.routing, tokens);
    return;
  }
  ep_combine_bf16(*comm_, route_.plan, rows.data(), nullptr, tokens);
  log_combine(MoePass::kForward, rn::kCombineOutput, rn::kCombineOutputFormat, 2 * H_);
}

// EP: dispatched in FP8 (wire format fp8), with the probabilities in the forward.
void CpuMoeLayer::permute_fp8(const QTensor& q, QTensor* out, MoePass pass, const char* name) {
  const int64_t c = q.cols;
  out->layout = Layout::kRow1x128;
  out->rows = Mp_;
  out->cols = c;
  out->segments = Segments();
  out->codes.assign(Mp_ * c, 0);
  out->scales.assign((c / kFp8Block) * Mp_, 0);
  if (comm_ == nullptr) {
    cpu::permute_pad_fp8(q.codes.data(), q.scales.data(), c, route_.routing, out->codes.data(),
                         out->scales.data(), Mp_);
    return;
  }
  const DispatchPlan p = plan_for(pass, WireFormat::kFp8);
  const bool fwd = pass == MoePass::kForward;
  ep_dispatch_fp8(*comm_, p, q.codes.data(), q.scales.data(),
                  fwd ? route_.probs.data() : nullptr, out->codes.data(), out->scales.data(), Mp_,
                  fwd ? route_.row_probs.data() : nullptr);
  log_dispatch(pass, name, p);
}

// MXFP4 token rows (codes [T, H/2], scales [T][H/32]) -> xperm_mxfp4 [Mp, H] (forward; EP: wire
// format mxfp4 with the probabilities).
void CpuMoeLayer::permute_mxfp4(const QTensor& q) {
  QTensor& out = saved_.xperm_mxfp4;
  out.layout = Layout::kMxfp4Row1x32;
  out.rows = Mp_;
  out.cols = H_;
  out.segments = Segments();
  out.codes.assign(Mp_ * H_ / 2, 0);
  out.scales.assign(Mp_ * H_ / kFp4Block, 0);
  if (comm_ == nullptr) {
    cpu::permute_pad_mxfp4(q.codes.data(), q.scales.data(), H_, route_.routing, out.codes.data(),
                           out.scales.data());
    return;
  }
  const DispatchPlan p = plan_for(MoePass::kForward, WireFormat::kMxfp4);
  ep_dispatch_mxfp4(*comm_, p, q.codes.data(), q.scales.data(), route_.probs.data(),
                    out.codes.data(), out.scales.data(), route_.row_probs.data());
  log_dispatch(MoePass::kForward, rn::kDispatchX, p);
}

// fp8-naive. One rank: the dispatch is the identity, so the tokens are dequantized to BF16 and
// permuted (the FP8 payload is what would travel). EP: the FP8 codes and FP32 scales of the token
// rows travel (wire format fp8-fp32scale), then the received rows are dequantized to BF16 (padding
// rows 0). Dequantization is element-wise, so dequantizing the moved rows gives the bits one rank
// gets by dequantizing the tokens and permuting them. `rows` [Mp, H] must hold zeros.
void CpuMoeLayer::permute_fp32_scale(const cpu::QTensorF32& q, MoePass pass, const char* name,
                                     const char* dequantize_name, OpLog* log, bf16_t* rows) {
  const cpu::Routing& routing = route_.routing;
  if (comm_ == nullptr) {
    std::vector<bf16_t> tokens(q.rows * q.cols);
    cpu::dequantize(q, tokens.data());
    log->add(CastKind::kDequantize, dequantize_name, 1, T_ * H_);
    cpu::permute_pad_bf16(tokens.data(), H_, routing, rows);
    return;
  }
  const DispatchPlan p = plan_for(pass, WireFormat::kFp8Fp32Scale);
  const bool fwd = pass == MoePass::kForward;
  const int64_t nc = H_ / kFp8Block, n = p.send_rows(), T = T_;
  const cpu::Routing& sr = p.send_routing;
  // send order; scales row-major [rows][H/128] next to their codes (as ep_dispatch_fp8)
  std::vector<uint8_t> send_codes(n * H_);
  std::vector<float> send_scales(n * nc), send_probs(fwd ? n : 0);
  for (int64_t t = 0; t < T; ++t)
    for (int s = 0; s < K_; ++s) {
      const int32_t row = sr.row_map[t * K_ + s];
      if (row < 0) continue;
      std::memcpy(&send_codes[row * H_], &q.codes[t * H_], H_);
      for (int64_t c = 0; c < nc; ++c) send_scales[row * nc + c] = q.scales[c * T + t];
      if (fwd) send_probs[row] = route_.probs[t * K_ + s];
    }
  std::vector<uint8_t> recv_codes(Mp_ * H_, 0);
  std::vector<float> recv_scales(Mp_ * nc, 0.0f);
  std::vector<RowStream> streams = {
      {send_codes.data(), recv_codes.data(), H_},
      {send_scales.data(), recv_scales.data(), int64_t(sizeof(float)) * nc}};
  if (fwd) streams.push_back({send_probs.data(), route_.row_probs.data(), int64_t(sizeof(float))});
  dispatch_rows(*comm_, p, streams);  // padding rows are not written: they stay 0
  log_dispatch(pass, name, p);
  int64_t elements = 0;
  for (int l = 0; l < El_; ++l)
    for (int64_t row = routing.padded_offsets[l];
         row < routing.padded_offsets[l] + routing.counts[l]; ++row) {
      for (int64_t c = 0; c < H_; ++c)
        rows[row * H_ + c] = to_bf16(cpu::dequantize_fp32_scale(
            recv_codes[row * H_ + c], recv_scales[row * nc + c / kFp8Block]));
      elements += H_;
    }
  log->add(CastKind::kDequantize, dequantize_name, 1, elements);
}

void CpuMoeLayer::unpermute_dx(const std::vector<bf16_t>& dxp, const std::vector<float>& dp,
                               std::vector<bf16_t>* dx_expert, std::vector<float>* dprobs) {
  const int64_t T = T_;
  dx_expert->assign(T * H_, 0);
  dprobs->assign(T * K_, 0.0f);
  if (comm_ == nullptr) {
    const cpu::Routing& r = route_.routing;
    cpu::unpermute_unpad(dxp.data(), nullptr, H_, r, dx_expert->data());
    for (int64_t i = 0; i < T * K_; ++i)
      if (r.row_map[i] >= 0) (*dprobs)[i] = dp[r.row_map[i]];
    return;
  }
  // combine: the dX rows (BF16) and each row's d loss / d prob (FP32) go back to the token's rank
  // in one exchange; the sum over slots runs there in slot order, as on one rank.
  const DispatchPlan& plan = route_.plan;
  const cpu::Routing& sr = plan.send_routing;
  std::vector<bf16_t> back(plan.send_rows() * H_);
  std::vector<float> back_dp(plan.send_rows());
  combine_rows(*comm_, plan,
               {{dxp.data(), back.data(), 2 * H_},
                {dp.data(), back_dp.data(), int64_t(sizeof(float))}});
  log_combine(MoePass::kBackward, rn::kCombineDx, rn::kCombineDxFormat,
              2 * H_ + int64_t(sizeof(float)));
  cpu::unpermute_unpad(back.data(), nullptr, H_, sr, dx_expert->data());
  for (int64_t i = 0; i < T * K_; ++i)
    if (sr.row_map[i] >= 0) (*dprobs)[i] = back_dp[sr.row_map[i]];
}

}  // namespace cpu_moe
}  // namespace flowmoe
