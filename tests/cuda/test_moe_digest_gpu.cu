// The CUDA MoE layer's outputs and gradients pinned by digests: every recipe, on one GPU (two
// shapes, gradients accumulated and overwritten) and expert-parallel through simulated ranks
// (make_device_sim_world, 2 ranks). Each case hashes the bits of y, dx, dW1, dW2, dWr, the aux loss
// and the status counters (FNV-1a 64) and compares them with tests/cuda/data/moe_layer_digests.txt,
// recorded from the layer before a refactor: a change that is meant to move no bit (a code
// reorganisation, a new kernel claimed bit-identical) must leave every line equal.
//
// A case without a stored line fails. To record the file after a change that is meant to move bits
// (say why in the commit), run the test with FLOWMOE_DIGEST_RECORD=path: each case then writes its
// line to `path` (appending) and still fails when a stored line exists and differs. Where the
// binary runs outside the build's source tree, FLOWMOE_TEST_DATA_DIR names tests/cuda/data.
#include <cuda_runtime.h>
#include <gtest/gtest.h>

#include <cinttypes>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <fstream>
#include <map>
#include <memory>
#include <random>
#include <sstream>
#include <string>
#include <vector>

#include "flowmoe/comm.h"
#include "flowmoe/moe.h"
#include "flowmoe/numerics.h"
#include "common/moe_config.h"
#include "common/fnv.h"
#include "cuda/gpu_test_util.h"

#ifndef FLOWMOE_TEST_DATA_DIR
#error "FLOWMOE_TEST_DATA_DIR must name tests/cuda/data"
#endif

namespace flowmoe {
namespace {

using namespace testutil;  // REQUIRE_DEVICE, StreamBuf, normal_f32/bf16, Fnv

struct Case {
  const char* name;
  int64_t hidden, ffn;
  int experts, topk;
  RouterScore score;
  bool renorm;
  float scale, aux;
  int align;
  bool bias;
  std::vector<int64_t> tokens;  // per rank; one entry = one GPU
};

const Case kCases[] = {
    {"a128", 256, 256, 8, 2, RouterScore::kSoftmax, false, 1.0f, 0.01f, 128, false, {300}},
    {"a16_sigmoid", 384, 128, 6, 3, RouterScore::kSigmoid, true, 2.5f, 0.0f, 16, true, {77}},
    {"ep2_a32", 256, 128, 8, 2, RouterScore::kSoftmax, false, 1.0f, 0.01f, 32, false, {90, 41}},
};

// One rank's forward + backward (experts [e0, e0 + El) of the model); returns its digest text.
std::string run_rank(const Case& c, Recipe r, bool accumulate, Communicator* comm, int rank) {
  const int64_t H = c.hidden, F = c.ffn, E = c.experts;
  const int W = static_cast<int>(c.tokens.size());
  const int El = c.experts / W;
  int64_t max_t = 0;
  for (int64_t t : c.tokens) max_t = std::max(max_t, t);
  std::mt19937 rng(4242);
  const std::vector<float> w1 = normal_f32(E * 2 * F * H, 1.0f / std::sqrt(float(H)), rng);
  const std::vector<float> w2 = normal_f32(E * H * F, 1.0f / std::sqrt(float(F)), rng);
  const std::vector<float> wr = normal_f32(E * H, 1.0f / std::sqrt(float(H)), rng);
  const std::vector<float> bias = normal_f32(E, 0.1f, rng);
  const std::vector<float> g0 = normal_f32(E * 2 * F * H, 0.5f, rng);  // initial gradient buffers
  std::vector<std::vector<bf16_t>> xs, dys;
  for (int64_t t : c.tokens) {
    xs.push_back(normal_bf16(t * H, 1.0f, rng));
    dys.push_back(normal_bf16(t * H, 1.0f, rng));
  }
  const int64_t T = c.tokens[rank];

  const MoeConfig cfg = flowmoe_test::moe_config(H, F, c.experts, c.topk)
                            .router(c.score, c.renorm, c.scale)
                            .aux_loss(c.aux)
                            .align(c.align)
                            .recipe(r)
                            .max_tokens(max_t)
                            .comm(comm);

  cudaStream_t s = nullptr;
  if (cudaStreamCreateWithFlags(&s, cudaStreamNonBlocking) != cudaSuccess) throw std::runtime_error("stream");
  std::string line;
  {
    std::unique_ptr<MoeLayer> layer = make_cuda_layer(cfg, s);
    const int64_t n1 = int64_t(El) * 2 * F * H, n2 = int64_t(El) * H * F;
    StreamBuf<float> dw1(n1, s, g0.data()), dw2(n2, s, g0.data() + 7), dwr(E * H, s, g0.data() + 13);
    StreamBuf<float> d_w1(n1, s, w1.data() + int64_t(rank) * El * 2 * F * H);
    StreamBuf<float> d_w2(n2, s, w2.data() + int64_t(rank) * El * H * F);
    StreamBuf<float> d_wr(E * H, s, wr.data()), d_bias(E, s, bias.data());
    StreamBuf<bf16_t> x(T * H, s, xs[rank].data()), dy(T * H, s, dys[rank].data()), y(T * H, s), dx(T * H, s);
    layer->set_weights(MoeWeights{d_w1.p, d_w2.p, d_wr.p, c.bias ? d_bias.p : nullptr});
    MoeGrads g{dw1.p, dw2.p, dwr.p};
    g.accumulate = accumulate;
    // two steps: the second forward/backward runs on reused workspaces
    for (int step = 0; step < 2; ++step) {
      layer->forward(x.p, T, y.p);
      layer->backward(dy.p, dx.p, g);
    }
    Fnv h;
    h.add(y.get(s));
    h.add(dx.get(s));
    h.add(dw1.get(s));
    h.add(dw2.get(s));
    h.add(dwr.get(s));
    const MoeStatus st = layer->status();
    h.add(&st.aux_loss, sizeof st.aux_loss);
    char buf[160];
    std::snprintf(buf, sizeof buf, "%016" PRIx64 " nonfinite=%" PRId64 " underflow=%" PRId64, h.h, st.nonfinite,
                  st.underflow);
    line = buf;
  }
  cudaStreamDestroy(s);
  return line;
}

std::map<std::string, std::string> load_digests() {
  std::map<std::string, std::string> m;
  // the build's source tree, or FLOWMOE_TEST_DATA_DIR where the binary runs elsewhere
  const char* dir = std::getenv("FLOWMOE_TEST_DATA_DIR");
  std::ifstream f(std::string(dir ? dir : FLOWMOE_TEST_DATA_DIR) + "/moe_layer_digests.txt");
  std::string l;
  while (std::getline(f, l)) {
    if (l.empty() || l[0] == '#') continue;
    const size_t sp = l.find(' ');
    if (sp != std::string::npos) m[l.substr(0, sp)] = l.substr(sp + 1);
  }
  return m;
}

class MoeDigest : public ::testing::TestWithParam<std::tuple<int, Recipe, bool>> {};

TEST_P(MoeDigest, OutputsAndGradientsEqualTheStoredBits) {
  REQUIRE_DEVICE();
  const Case& c = kCases[std::get<0>(GetParam())];
  const Recipe r = std::get<1>(GetParam());
  const bool acc = std::get<2>(GetParam());
  const int W = static_cast<int>(c.tokens.size());
  std::vector<std::string> lines(W);
  if (W == 1) {
    lines[0] = run_rank(c, r, acc, nullptr, 0);
  } else {
    std::unique_ptr<SimWorld> world = make_device_sim_world(W, 60.0);
    const std::vector<std::string> errs =
        world->run([&](Communicator& comm) { lines[comm.rank()] = run_rank(c, r, acc, &comm, comm.rank()); });
    for (int i = 0; i < W; ++i) ASSERT_EQ(errs[i], "") << "rank " << i;
  }
  const std::map<std::string, std::string> stored = load_digests();
  const char* record = std::getenv("FLOWMOE_DIGEST_RECORD");
  for (int i = 0; i < W; ++i) {
    const std::string key = std::string(c.name) + "/" + recipe_name(r) + (acc ? "/acc" : "/set") + "/rank" +
                            std::to_string(i);
    if (record) {
      std::ofstream out(record, std::ios::app);
      out << key << " " << lines[i] << "\n";
    }
    const auto it = stored.find(key);
    if (it == stored.end()) {
      if (!record) ADD_FAILURE() << key << ": no stored digest (got " << lines[i] << ")";
      continue;
    }
    EXPECT_EQ(lines[i], it->second) << key;
  }
}

std::string case_label(const ::testing::TestParamInfo<MoeDigest::ParamType>& info) {
  std::string n = std::string(kCases[std::get<0>(info.param)].name) + "_" + recipe_name(std::get<1>(info.param)) +
                  (std::get<2>(info.param) ? "_acc" : "_set");
  for (char& ch : n)
    if (ch == '-') ch = '_';
  return n;
}

INSTANTIATE_TEST_SUITE_P(AllRecipes, MoeDigest,
                         ::testing::Combine(::testing::Values(0, 1, 2),
                                            ::testing::Values(Recipe::kBf16, Recipe::kBlockwise, Recipe::kFp8Naive,
                                                              Recipe::kFlow, Recipe::kFlowFp4),
                                            ::testing::Bool()),
                         case_label);

}  // namespace
}  // namespace flowmoe
