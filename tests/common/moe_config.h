// One way for every test to make a flowmoe::MoeConfig: a builder over the four sizes, the rest
// named by what it sets, starting from MoeConfig's own defaults (align 128, recipe flow, softmax
// router, no aux loss, row-max transpose exponent, no communicator).
//   const MoeConfig c = flowmoe_test::moe_config(256, 128, 4, 2).recipe(Recipe::kBf16).align(16)
//                           .max_tokens(24);
// Used by the CPU and GPU layer tests (tests/cpu/test_moe*.cpp, tests/cuda/test_moe*.cu, ...).
#pragma once

#include <cstdint>

#include "flowmoe/moe.h"

namespace flowmoe_test {

class MoeConfigBuilder {
 public:
  MoeConfigBuilder(int64_t hidden, int64_t ffn, int experts, int topk) {
    c_.hidden = hidden;
    c_.ffn = ffn;
    c_.num_experts = experts;
    c_.topk = topk;
  }
  MoeConfigBuilder& recipe(flowmoe::Recipe r) {
    c_.recipe = r;
    return *this;
  }
  MoeConfigBuilder& align(int a) {
    c_.align = a;
    return *this;
  }
  MoeConfigBuilder& max_tokens(int64_t t) {
    c_.max_tokens = t;
    return *this;
  }
  // The router's score function, the renormalisation of the k chosen scores and their scale.
  MoeConfigBuilder& router(flowmoe::RouterScore score, bool renormalize = false, float scale = 1.0f) {
    c_.router = score;
    c_.router_renormalize = renormalize;
    c_.router_scale = scale;
    return *this;
  }
  MoeConfigBuilder& aux_loss(float alpha) {
    c_.aux_loss_alpha = alpha;
    return *this;
  }
  MoeConfigBuilder& exponent(flowmoe::TransposeExponent e) {
    c_.transpose_exponent = e;
    return *this;
  }
  MoeConfigBuilder& comm(flowmoe::Communicator* comm) {
    c_.comm = comm;
    return *this;
  }
  MoeConfigBuilder& external_routing(bool on = true) {
    c_.external_routing = on;
    return *this;
  }
  MoeConfigBuilder& check_columns(bool on = true) {
    c_.check_columns = on;
    return *this;
  }
  const flowmoe::MoeConfig& build() const { return c_; }
  operator flowmoe::MoeConfig() const { return c_; }  // NOLINT: a builder converts implicitly

 private:
  flowmoe::MoeConfig c_;
};

inline MoeConfigBuilder moe_config(int64_t hidden, int64_t ffn, int experts, int topk) {
  return MoeConfigBuilder(hidden, ffn, experts, topk);
}

}  // namespace flowmoe_test
