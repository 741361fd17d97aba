// The router of the CPU MoE layer (src/cpu/moe/layer.h), the same in every recipe: FP32 logits
// from the BF16 input, top-k and aux loss (token.h), the local experts' padded segments (EP: the
// dispatch plan); and its backward: dlogits, dWr, and dx = expert path + router path.
#include <algorithm>
#include <cmath>
#include <vector>

#include "common/moe_ep.h"
#include "cpu/moe/layer.h"
#include "flowmoe/numerics.h"

namespace flowmoe {
namespace cpu_moe {

using num::bf16_to_f32;

void CpuMoeLayer::route(const bf16_t* x, const RoutingInput& ext, QuantStats* st) {
  const int64_t T = T_;
  RoutingState& rs = route_;
  rs.x.assign(x, x + T * H_);
  if (cfg_.external_routing) {
    // the caller's routing: no logits, no aux loss; ids checked by build_routing below (non-finite
    // probs show in the SwiGLU's count, as on the GPU)
    rs.logits.clear();
    rs.expert_ids.assign(ext.ids, ext.ids + T * K_);
    rs.probs.assign(ext.probs, ext.probs + T * K_);
    rs.aux_loss = 0.0f;
    rs.aux_coef.clear();
  } else {
    route_logits(x, st);
  }
  route_tables();
}

void CpuMoeLayer::route_logits(const bf16_t* x, QuantStats* st) {
  const int64_t T = T_;
  RoutingState& rs = route_;
  // logits[t, e] = sum_h x[t, h] * Wr[e, h]: FP32 fma in h order.
  rs.logits.assign(T * E_, 0.0f);
  for (int64_t t = 0; t < T; ++t)
    for (int e = 0; e < E_; ++e) {
      float acc = 0.0f;
      const float* w = &sw().wr[int64_t(e) * H_];
      for (int64_t h = 0; h < H_; ++h) acc = std::fma(bf16_to_f32(x[t * H_ + h]), w[h], acc);
      rs.logits[t * E_ + e] = acc;
    }
  const RouterConfig rc = cfg_.router_config();
  rs.expert_ids.assign(T * K_, 0);
  rs.probs.assign(T * K_, 0.0f);
  const float* bias = sw().router_bias.empty() ? nullptr : sw().router_bias.data();
  st->nonfinite += cpu::router_forward(rs.logits.data(), T, rc, bias, rs.expert_ids.data(),
                                       rs.probs.data());
  rs.aux_loss = 0.0f;
  rs.aux_coef.clear();
  if (cfg_.aux_loss_alpha > 0.0f) {
    rs.aux_coef.assign(E_, 0.0f);
    rs.aux_loss = cpu::router_aux_loss(rs.logits.data(), rs.expert_ids.data(), T, rc,
                                       cfg_.aux_loss_alpha, rs.aux_coef.data());
  }
}

void CpuMoeLayer::route_tables() {
  const int64_t T = T_;
  RoutingState& rs = route_;
  if (comm_ == nullptr) {
    rs.routing = cpu::build_routing(rs.expert_ids.data(), T, K_, E_, cfg_.align);
    Mp_ = rs.routing.padded_rows();
    rs.row_probs.assign(Mp_, 0.0f);
    for (int64_t i = 0; i < T * K_; ++i)
      if (rs.routing.row_map[i] >= 0) rs.row_probs[rs.routing.row_map[i]] = rs.probs[i];
    report_.routed_rows = rs.routing.routed_rows();
  } else {
    // Expert parallelism: the plan (collective: configuration check, count all-to-all). The
    // forward dispatch moves each row's probability with it into row_probs (0 on padding rows).
    EpConfig ec;
    ec.num_experts = E_;
    ec.topk = K_;
    ec.hidden = H_;
    ec.align = cfg_.align;
    ec.format = spec_.forward_wire;
    ec.with_probs = true;
    rs.plan = plan_dispatch(*comm_, ec, rs.expert_ids.data(), T);
    // routing describes this rank's El local expert segments (counts, offsets, padded offsets;
    // no token map: the send side's map is plan.send_routing).
    cpu::Routing& r = rs.routing;
    r = cpu::Routing();
    r.tokens = 0;
    r.topk = K_;
    r.num_experts = El_;
    r.align = cfg_.align;
    r.counts = rs.plan.expert_counts;
    r.offsets.assign(El_ + 1, 0);
    for (int l = 0; l < El_; ++l) r.offsets[l + 1] = r.offsets[l] + r.counts[l];
    r.padded_offsets = rs.plan.padded_offsets;
    Mp_ = r.padded_rows();
    rs.row_probs.assign(Mp_, 0.0f);
    report_.routed_rows = rs.plan.send_routing.routed_rows();
  }
  rs.segments = Segments();
  rs.segments.offsets = rs.routing.padded_offsets;
  report_.tokens = T;
  report_.padded_rows = Mp_;
}

void CpuMoeLayer::backward_router(const std::vector<bf16_t>& dxp, const std::vector<float>& dp,
                                  const MoeGrads& g, bf16_t* dx) {
  const int64_t T = T_;
  const RoutingState& rs = route_;
  std::vector<bf16_t> dxe;
  std::vector<float> dprobs;
  unpermute_dx(dxp, dp, &dxe, &dprobs);
  if (g.dprobs) std::copy(dprobs.begin(), dprobs.end(), g.dprobs);
  if (cfg_.external_routing) {  // no router: dx is the expert path (dprobs went to the caller)
    std::copy(dxe.begin(), dxe.end(), dx);
    return;
  }
  std::vector<float> dlogits(T * E_);
  const RouterConfig rc = cfg_.router_config();
  cpu::router_backward(rs.logits.data(), T, rc, rs.expert_ids.data(), dprobs.data(),
                       rs.aux_coef.empty() ? nullptr : rs.aux_coef.data(), 1.0f, dlogits.data());
  // dWr[e, h] += sum_t dlogits[t, e] * x[t, h]   (FP32, fma in t order)
  if (g.dwr && !g.accumulate) std::fill(g.dwr, g.dwr + int64_t(E_) * H_, 0.0f);  // then 0 + sum
  if (g.dwr)
    for (int e = 0; e < E_; ++e)
      for (int64_t h = 0; h < H_; ++h) {
        float acc = 0.0f;
        for (int64_t t = 0; t < T; ++t)
          acc = std::fma(dlogits[t * E_ + e], bf16_to_f32(rs.x[t * H_ + h]), acc);
        g.dwr[int64_t(e) * H_ + h] += acc;
      }
  // dx[t, h] = bf16(dx_expert[t, h] + sum_e dlogits[t, e] * Wr[e, h])
  const std::vector<float>& wr = sw().wr;
  for (int64_t t = 0; t < T; ++t)
    for (int64_t h = 0; h < H_; ++h) {
      float acc = bf16_to_f32(dxe[t * H_ + h]);
      for (int e = 0; e < E_; ++e) acc = std::fma(dlogits[t * E_ + e], wr[int64_t(e) * H_ + h], acc);
      dx[t * H_ + h] = to_bf16(acc);
    }
}

}  // namespace cpu_moe
}  // namespace flowmoe
