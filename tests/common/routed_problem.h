// The experts-only layer's tests (MoeConfig::external_routing, issue 31), shared by the CPU test
// (tests/cpu/test_moe_routed.cpp) and its GPU twin (tests/cuda/test_moe_routed_gpu.cu): a problem,
// the full layer's routing recomputed on the host (the router's FP32 logits in h order, then
// token.h's cpu::router_forward: the bits the layer's own router chooses), and the full layer's dx
// rebuilt from the experts-only layer's dx and dprobs (the router path the full layer adds).
#pragma once

#include <cmath>
#include <cstdint>
#include <vector>

#include "common/reference.h"
#include "flowmoe/moe.h"
#include "flowmoe/numerics.h"
#include "flowmoe/swiglu_math.h"
#include "flowmoe/token.h"

namespace flowmoe_test {

struct RoutedProblem {
  flowmoe::MoeConfig cfg;  // the full layer's (router and all); external_routing off
  int64_t T = 0;
  std::vector<float> w1, w2, wr, bias;  // masters [E,2F,H], [E,H,F], [E,H]; bias [E] or empty
  std::vector<flowmoe::bf16_t> x, dy;   // [T,H]
  std::vector<float> logits;            // [T,E] as the full layer's router computes them
  std::vector<int32_t> ids;             // [T,k] the full layer's choice
  std::vector<float> probs;             // [T,k]
};

inline RoutedProblem make_routed_problem(const flowmoe::MoeConfig& cfg, int64_t T, uint64_t seed,
                                         bool with_bias = false) {
  namespace num = flowmoe::num;
  RoutedProblem p;
  p.cfg = cfg;
  p.T = T;
  Rng rng(seed);
  const int64_t H = cfg.hidden, F = cfg.ffn, E = cfg.num_experts, k = cfg.topk;
  p.w1.resize(E * 2 * F * H);
  p.w2.resize(E * H * F);
  p.wr.resize(E * H);
  for (float& v : p.w1) v = static_cast<float>(rng.normal() / std::sqrt(double(H)));
  for (float& v : p.w2) v = static_cast<float>(rng.normal() / std::sqrt(double(F)));
  for (float& v : p.wr) v = static_cast<float>(rng.normal() / std::sqrt(double(H)));
  if (with_bias) {
    p.bias.resize(E);
    for (float& v : p.bias) v = static_cast<float>(rng.uniform(-0.1, 0.1));
  }
  p.x.resize(T * H);
  p.dy.resize(T * H);
  for (auto& v : p.x) v = num::f32_to_bf16(static_cast<float>(rng.normal()));
  for (auto& v : p.dy) v = num::f32_to_bf16(static_cast<float>(rng.normal()));
  // the router: logits[t, e] = sum_h x[t, h] * Wr[e, h], FP32 fma in h order (moe.h)
  p.logits.assign(T * E, 0.0f);
  for (int64_t t = 0; t < T; ++t)
    for (int64_t e = 0; e < E; ++e) {
      float acc = 0.0f;
      for (int64_t h = 0; h < H; ++h) acc = std::fma(num::bf16_to_f32(p.x[t * H + h]), p.wr[e * H + h], acc);
      p.logits[t * E + e] = acc;
    }
  p.ids.assign(T * k, 0);
  p.probs.assign(T * k, 0.0f);
  flowmoe::cpu::router_forward(p.logits.data(), T, cfg.router_config(), p.bias.empty() ? nullptr : p.bias.data(),
                               p.ids.data(), p.probs.data());
  return p;
}

// The full layer's dx from the experts-only layer's (expert path) and its dprobs: dlogits by the
// router's backward, then dx[t, h] = bf16(dx_expert[t, h] + sum_e dlogits[t, e] * Wr[e, h]) with
// the fma chain in e order (the full layer's tail, CPU and GPU).
inline std::vector<flowmoe::bf16_t> full_layer_dx(const RoutedProblem& p, const std::vector<flowmoe::bf16_t>& dx_expert,
                                                  const std::vector<float>& dprobs) {
  namespace num = flowmoe::num;
  const int64_t H = p.cfg.hidden, E = p.cfg.num_experts, T = p.T;
  std::vector<float> dlogits(T * E);
  flowmoe::cpu::router_backward(p.logits.data(), T, p.cfg.router_config(), p.ids.data(), dprobs.data(), nullptr,
                                1.0f, dlogits.data());
  std::vector<flowmoe::bf16_t> dx(T * H);
  for (int64_t t = 0; t < T; ++t)
    for (int64_t h = 0; h < H; ++h) {
      float acc = num::bf16_to_f32(dx_expert[t * H + h]);
      for (int64_t e = 0; e < E; ++e) acc = std::fma(dlogits[t * E + e], p.wr[e * H + h], acc);
      dx[t * H + h] = num::bf16_canonical(acc);
    }
  return dx;
}

}  // namespace flowmoe_test
