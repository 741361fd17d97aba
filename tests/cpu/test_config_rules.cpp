// Each configuration rule lives in one place (issue 55): MoeConfig::validate for the layer's
// configuration and check_sync_free_options for the CUDA layer's sync-free options (moe.h,
// src/common/moe_common.cpp). make_cpu_layer and make_cuda_layer run them, and so does the C ABI's
// flowmoe_config_check, without making a layer and without a communicator (a CommShape describes
// the one the layer will get); tests/python/torch/test_config_errors.py checks that the Python
// package's errors are these texts. This file runs in the CPU-only build: the sync-free rules are
// host code, there without CUDA.
#include <gtest/gtest.h>

#include <functional>
#include <string>

#include "common/moe_config.h"
#include "flowmoe/comm.h"
#include "flowmoe/error.h"
#include "flowmoe/moe.h"

namespace {

using flowmoe::CommShape;
using flowmoe::MoeConfig;
using flowmoe::Recipe;
using flowmoe_test::moe_config;

// The message of the flowmoe::Error fn throws ("" when it throws none).
std::string error_of(const std::function<void()>& fn) {
  try {
    fn();
  } catch (const flowmoe::Error& e) {
    return e.what();
  }
  return "";
}

bool mentions(const std::string& msg, const std::string& needle) { return msg.find(needle) != std::string::npos; }

MoeConfig base() { return moe_config(256, 128, 6, 2).max_tokens(16); }

// validate(CommShape) is the check the C ABI runs before a communicator exists: for every rule that
// depends on the communicator it gives the text validate() gives with a real one of that many ranks.
TEST(ConfigRules, ValidateWithACommShapeIsValidateWithThatCommunicator) {
  flowmoe::SimWorld world3(3), world4(4);
  struct Case {
    const char* what;
    std::function<void(MoeConfig&)> edit;
    flowmoe::SimWorld* world;
    const char* needle;  // "" = accepted
  };
  const Case cases[] = {
      {"E = 6 over 3 ranks", [](MoeConfig&) {}, &world3, ""},
      {"E = 6 over 4 ranks", [](MoeConfig&) {}, &world4, "num_experts E = 6 is not divisible by the 4 ranks"},
      {"external routing", [](MoeConfig& c) { c.external_routing = true; }, &world3,
       "external_routing with a communicator (expert parallelism) is not supported"},
      {"GEMM1 bias", [](MoeConfig& c) { c.gemm1_bias = true; }, &world3,
       "GEMM1 biases with a communicator (expert parallelism) are not supported"},
      {"rows past int32", [](MoeConfig& c) { c.max_tokens = int64_t(1) << 30; }, &world3,
       "do not fit int32 row indices"},
  };
  for (const Case& k : cases) {
    MoeConfig c = base();
    k.edit(c);
    MoeConfig with_comm = c;
    with_comm.comm = &k.world->comm(0);
    CommShape shape;
    shape.world = k.world->comm(0).world_size();
    const std::string real = error_of([&] { with_comm.validate(); });
    const std::string described = error_of([&] { c.validate(shape); });
    EXPECT_EQ(real, described) << k.what;
    if (*k.needle)
      EXPECT_TRUE(mentions(real, k.needle)) << k.what << ": " << real;
    else
      EXPECT_EQ(real, "") << k.what;
  }
  // no communicator: world 0, and validate() is validate(CommShape())
  MoeConfig c = base();
  c.external_routing = true;
  EXPECT_EQ(error_of([&] { c.validate(); }), "");
  EXPECT_EQ(error_of([&] { c.validate(CommShape()); }), "");
  CommShape bad;
  bad.world = -1;
  EXPECT_TRUE(mentions(error_of([&] { base().validate(bad); }), "a communicator of -1 ranks"));
}

TEST(ConfigRules, CommShapeOfACommunicator) {
  EXPECT_EQ(CommShape::of(nullptr).world, 0);
  flowmoe::SimWorld world(2);
  const CommShape s = CommShape::of(&world.comm(1));
  EXPECT_EQ(s.world, 2);
  EXPECT_FALSE(s.device_peers);  // the host SimWorld: no device-side peer access
  EXPECT_EQ(s.backend, world.comm(1).backend());
}

// The fp8-naive rule for GEMM1 biases (issue 46): once, in MoeConfig::validate; its message names
// the recipes that take biases from the recipe table, and each of them is accepted.
TEST(ConfigRules, Gemm1BiasRefusedWithFp8NaiveOnlyNamingTheOthers) {
  for (Recipe r : flowmoe::all_recipes()) {
    MoeConfig c = base();
    c.recipe = r;
    c.gemm1_bias = true;
    const std::string msg = error_of([&] { c.validate(); });
    if (r == Recipe::kFp8Naive) {
      EXPECT_TRUE(mentions(msg, "MoeConfig: GEMM1 (expert) biases with the fp8-naive recipe are not supported; "
                                "expected one of bf16, blockwise, flow, flow-fp4"))
          << msg;
      EXPECT_EQ(error_of([&] { flowmoe::make_cpu_layer(c); }), msg);  // what the layer's construction says
    } else {
      EXPECT_EQ(msg, "") << flowmoe::recipe_name(r);
    }
  }
}

// H and F: multiples of kMoeSizeMultiple; the message names the nearest multiples.
TEST(ConfigRules, SizesNotMultiplesNameTheNearest) {
  EXPECT_EQ(flowmoe::kMoeSizeMultiple, 128);
  MoeConfig c = base();
  c.hidden = 200;
  EXPECT_TRUE(mentions(error_of([&] { c.validate(); }),
                       "hidden H = 200 is not a positive multiple of 128 (1x128 FP8 tiles and 128x128 weight "
                       "blocks); expected H % 128 == 0 such as 128 or 256 (the nearest)"));
  c.hidden = 100;
  EXPECT_TRUE(mentions(error_of([&] { c.validate(); }), "expected H % 128 == 0 such as 128 (the nearest)"));
  c = base();
  c.ffn = 0;
  EXPECT_TRUE(mentions(error_of([&] { c.validate(); }), "ffn F = 0 is not a positive multiple of 128"));
  EXPECT_TRUE(mentions(error_of([&] { c.validate(); }), "expected F % 128 == 0, e.g. 1408 or 2048"));
  c = base();
  c.num_experts = 2000;
  EXPECT_TRUE(mentions(error_of([&] { c.validate(); }), "expected 1 <= E <= 1024 (the router kernels' limit"));
  c = base();
  c.topk = 7;
  EXPECT_TRUE(mentions(error_of([&] { c.validate(); }),
                       "top_k k = 7 exceeds num_experts E = 6; expected k <= E (each token picks k distinct"));
}

// The sync-free rules (CudaLayerOptions::sync_free): host code, run by make_cuda_layer and by the C
// ABI's flowmoe_config_check; here in a build without CUDA.
TEST(ConfigRules, SyncFreeRulesAreHostCode) {
  const MoeConfig one = base();
  MoeConfig a64 = base();
  a64.align = 64;
  CommShape none, host, peers;
  flowmoe::SimWorld world(2);
  host = CommShape::of(&world.comm(0));
  peers.world = 2;
  peers.device_peers = true;
  peers.backend = "device sim";
  auto rules = [](const MoeConfig& c, const CommShape& s, bool sync_free, bool caller_memory) {
    return error_of([&] { flowmoe::check_sync_free_options("who", c, s, sync_free, caller_memory); });
  };
  // without sync_free nothing is asked of the configuration
  EXPECT_EQ(rules(a64, host, false, true), "");
  // one GPU: align 128, any memory
  EXPECT_EQ(rules(one, none, true, false), "");
  EXPECT_EQ(rules(one, none, true, true), "");
  const std::string align = rules(a64, none, true, true);
  EXPECT_EQ(align.rfind("who: CudaLayerOptions::sync_free needs align = 128", 0), 0u) << align;
  EXPECT_TRUE(mentions(align, "align is 64")) << align;
  // expert parallelism: a communicator with device peers and the layer's own memory
  const std::string host_msg = rules(one, host, true, false);
  EXPECT_TRUE(mentions(host_msg, "sync_free with expert parallelism needs a communicator whose kernels reach the "
                                 "peers' memory"))
      << host_msg;
  EXPECT_TRUE(mentions(host_msg, "this one (" + host.backend + ") sizes its messages on the host")) << host_msg;
  EXPECT_TRUE(mentions(host_msg, "expected sync_free off, or one GPU (no communicator)")) << host_msg;
  EXPECT_EQ(rules(one, peers, true, false), "");
  EXPECT_TRUE(mentions(rules(one, peers, true, true), "caller_memory with sync_free expert parallelism"));
}

}  // namespace
