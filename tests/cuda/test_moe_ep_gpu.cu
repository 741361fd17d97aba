// The CUDA MoE layer with expert parallelism (MoeConfig::comm; docs/EP.md §6) on ONE GPU: the ranks
// are threads of a device-memory SimWorld (make_device_sim_world), each with its own stream and
// layer, exchanging device buffers. Every recipe, forward and backward, for 2 and 4 ranks:
//   * bits: y, dx, dW1, dW2 of every rank equal one single-rank CUDA layer holding all experts run
//     on the concatenation of every rank's tokens (rank 0's first); dWr (this rank's contribution)
//     equals one single-rank CUDA layer run on the rank's own tokens (the argument of the CPU test,
//     tests/cpu/test_moe_ep.cpp: the same rows in the same order reach every operator);
//   * against the CPU EP layer (host SimWorld) within the GPU-vs-CPU tolerances of
//     test_moe_gpu.cu (2e-2 bf16, 6e-2 FP8 recipes, relative RMS), and the same wire bytes;
//   * a rank whose experts receive no row (Mp = 0) still takes part in every exchange;
//   * the send path (device build_routing's row_map_unpadded + ep_gather_rows + dispatch_rows):
//     a payload encoding (rank, token) lands where the DispatchPlan says, and comes back.
// A bit mismatch between EP and the single-rank layer would point at data movement, or at a
// cuBLASLt algorithm that differs with the leading dimension (Mp) of the wgrad operands.
#include <cuda_runtime.h>
#include <gtest/gtest.h>

#include <algorithm>
#include <cmath>
#include <cstdio>
#include <cstring>
#include <memory>
#include <random>
#include <string>
#include <cstdlib>
#include <vector>

#include "cuda/moe/kernels.cuh"
#include "flowmoe/comm.h"
#include "flowmoe/error.h"
#include "flowmoe/moe.h"
#include "flowmoe/numerics.h"
#include "flowmoe/token.h"
#include "cuda/gpu_test_util.h"
#include "cuda/moe_ep_model.h"

namespace flowmoe {
namespace {

using namespace testutil;  // REQUIRE_DEVICE, rel_rms
using namespace eptest;  // Dev, Model, make_model, Out, run_gpu_one, kH, kF, kE, kK

Out run_cpu_one(const MoeConfig& cfg, const Model& m, int e0, int n, const bf16_t* x,
                const bf16_t* dy, int64_t T) {
  auto layer = make_cpu_layer(cfg);
  MoeWeights w{m.w1.data() + int64_t(e0) * 2 * kF * kH, m.w2.data() + int64_t(e0) * kH * kF,
               m.wr.data(), m.bias.empty() ? nullptr : m.bias.data()};
  layer->set_weights(w);
  Out o;
  o.y.assign(T * kH, 0);
  o.dx.assign(T * kH, 0);
  o.dw1.assign(int64_t(n) * 2 * kF * kH, 0.0f);
  o.dw2.assign(int64_t(n) * kH * kF, 0.0f);
  o.dwr.assign(int64_t(kE) * kH, 0.0f);
  layer->forward(x, T, o.y.data());
  layer->backward(dy, o.dx.data(), {o.dw1.data(), o.dw2.data(), o.dwr.data()});
  o.rep = layer->cast_report();
  o.st = layer->status();
  return o;
}

// Expert parallelism over W ranks: rank r holds experts [r*El, (r+1)*El). gpu: device SimWorld
// and CUDA layers; otherwise host SimWorld and CPU layers.
std::vector<Out> run_ep(const Model& m, int W, bool gpu, const CudaLayerOptions& options = CudaLayerOptions()) {
  const int El = kE / W;
  std::unique_ptr<SimWorld> world = gpu ? make_device_sim_world(W, options.sync_free ? 20.0 : 60.0)
                                        : std::unique_ptr<SimWorld>(new SimWorld(W, 60.0));
  std::vector<Out> out(W);
  const std::vector<std::string> errs = world->run([&](Communicator& comm) {
    const int r = comm.rank();
    MoeConfig cfg = m.cfg;
    cfg.max_tokens = m.max_tokens();
    cfg.comm = &comm;
    out[r] = gpu ? run_gpu_one(cfg, m, r * El, El, m.x[r].data(), m.dy[r].data(), m.tokens[r], options)
                 : run_cpu_one(cfg, m, r * El, El, m.x[r].data(), m.dy[r].data(), m.tokens[r]);
  });
  for (size_t r = 0; r < errs.size(); ++r) EXPECT_EQ(errs[r], "") << (gpu ? "gpu" : "cpu") << " rank " << r;
  return out;
}

template <typename T>
int64_t bit_diff(const std::vector<T>& a, const std::vector<T>& b, size_t off, size_t n,
                 const std::string& what) {
  EXPECT_LE(off + n, b.size()) << what;
  EXPECT_EQ(a.size(), n) << what;
  if (off + n > b.size() || a.size() != n) return 1;
  int64_t bad = 0;
  for (size_t i = 0; i < n; ++i)
    if (std::memcmp(&a[i], &b[off + i], sizeof(T)) != 0) {
      if (bad == 0) ADD_FAILURE() << what << ": first differing element " << i << " of " << n;
      ++bad;
    }
  return bad;
}

std::string case_name(const Model& m, int W) {
  std::string s = std::string(recipe_name(m.cfg.recipe)) + " W=" + std::to_string(W) + " T={";
  for (size_t r = 0; r < m.tokens.size(); ++r) s += (r ? "," : "") + std::to_string(m.tokens[r]);
  return s + "} " + m.cfg.describe();
}

// A sync-free EP layer's report (remade from the count matrices when read) against the synchronous
// EP layer's: every operator with its elements, the saved tensors, the wire entries, the rows.
void expect_same_report(const CastReport& a, const CastReport& b, const std::string& what) {
  EXPECT_EQ(a.routed_rows, b.routed_rows) << what;
  EXPECT_EQ(a.padded_rows, b.padded_rows) << what;
  ASSERT_EQ(a.ops.size(), b.ops.size()) << what;
  for (size_t i = 0; i < a.ops.size(); ++i) {
    EXPECT_EQ(a.ops[i].name, b.ops[i].name) << what;
    EXPECT_EQ(a.ops[i].pass, b.ops[i].pass) << what << " " << b.ops[i].name;
    EXPECT_EQ(a.ops[i].calls, b.ops[i].calls) << what << " " << b.ops[i].name;
    EXPECT_EQ(a.ops[i].outputs, b.ops[i].outputs) << what << " " << b.ops[i].name;
    EXPECT_EQ(a.ops[i].elements, b.ops[i].elements) << what << " " << b.ops[i].name;
  }
  ASSERT_EQ(a.saved.size(), b.saved.size()) << what;
  for (size_t i = 0; i < a.saved.size(); ++i) {
    EXPECT_EQ(a.saved[i].name, b.saved[i].name) << what;
    EXPECT_EQ(a.saved[i].format, b.saved[i].format) << what << " " << b.saved[i].name;
    EXPECT_EQ(a.saved[i].bytes, b.saved[i].bytes) << what << " " << b.saved[i].name;
    EXPECT_EQ(a.saved[i].bytes_per_token_unpadded, b.saved[i].bytes_per_token_unpadded) << what << " " << b.saved[i].name;
  }
  ASSERT_EQ(a.wire.size(), b.wire.size()) << what;
  for (size_t i = 0; i < a.wire.size(); ++i) {
    EXPECT_EQ(a.wire[i].name, b.wire[i].name) << what;
    EXPECT_EQ(a.wire[i].pass, b.wire[i].pass) << what << " " << b.wire[i].name;
    EXPECT_EQ(a.wire[i].format, b.wire[i].format) << what << " " << b.wire[i].name;
    EXPECT_EQ(a.wire[i].rows, b.wire[i].rows) << what << " " << b.wire[i].name;
    EXPECT_EQ(a.wire[i].bytes, b.wire[i].bytes) << what << " " << b.wire[i].name;
  }
}

// The EP CUDA layer against one CUDA layer holding all experts (bits) and the CPU EP layer
// (tolerance, wire bytes); sync_free: also against the synchronous EP layer's report, exactly.
void expect_ep_gpu(const Model& m, int W, const CudaLayerOptions& options = CudaLayerOptions()) {
  const int El = kE / W;
  const std::string name = case_name(m, W);
  const std::vector<Out> ep = run_ep(m, W, true, options);
  if (options.sync_free) {
    CudaLayerOptions sync = options;
    sync.sync_free = false;
    const std::vector<Out> ref = run_ep(m, W, true, sync);
    for (int r = 0; r < W; ++r)
      expect_same_report(ep[r].rep, ref[r].rep, name + " rank " + std::to_string(r) + " (sync-free vs synchronous EP)");
  }
  const std::vector<Out> cpu = run_ep(m, W, false);
  MoeConfig one_cfg = m.cfg;
  one_cfg.max_tokens = m.total_tokens();
  const std::vector<bf16_t> xa = m.concat(m.x), dya = m.concat(m.dy);
  const Out one = run_gpu_one(one_cfg, m, 0, kE, xa.data(), dya.data(), m.total_tokens());
  const double tol = m.cfg.recipe == Recipe::kBf16 ? 2e-2 : 6e-2;
  size_t tok0 = 0;
  double worst = 0.0;
  for (int r = 0; r < W; ++r) {
    const Out& o = ep[r];
    const std::string rn = name + " rank " + std::to_string(r);
    const size_t nt = m.tokens[r] * kH;
    const size_t n1 = size_t(El) * 2 * kF * kH, n2 = size_t(El) * kH * kF;
    EXPECT_EQ(bit_diff(o.y, one.y, tok0 * kH, nt, rn + " y"), 0);
    EXPECT_EQ(bit_diff(o.dx, one.dx, tok0 * kH, nt, rn + " dx"), 0);
    EXPECT_EQ(bit_diff(o.dw1, one.dw1, r * n1, n1, rn + " dW1"), 0);
    EXPECT_EQ(bit_diff(o.dw2, one.dw2, r * n2, n2, rn + " dW2"), 0);
    EXPECT_EQ(o.st.nonfinite, 0) << rn;
    if (options.sync_free) EXPECT_EQ(o.host_syncs, 0) << rn;
    // dWr: this rank's contribution = one GPU on this rank's tokens alone (so are y and dx)
    MoeConfig own_cfg = m.cfg;
    own_cfg.max_tokens = m.max_tokens();
    const Out own = run_gpu_one(own_cfg, m, 0, kE, m.x[r].data(), m.dy[r].data(), m.tokens[r]);
    EXPECT_EQ(bit_diff(o.dwr, own.dwr, 0, own.dwr.size(), rn + " dWr vs own-token run"), 0);
    EXPECT_EQ(bit_diff(o.y, own.y, 0, nt, rn + " y vs own-token run"), 0);
    // the casts as executed: the own-token single GPU's forward/backward operators
    std::vector<const CastOp*> a, b;
    for (const CastOp& op : o.rep.ops) if (op.pass != MoePass::kWeightUpdate) a.push_back(&op);
    for (const CastOp& op : own.rep.ops) if (op.pass != MoePass::kWeightUpdate) b.push_back(&op);
    EXPECT_EQ(a.size(), b.size()) << rn;
    for (size_t i = 0; i < std::min(a.size(), b.size()); ++i) {
      EXPECT_EQ(a[i]->name, b[i]->name) << rn;
      EXPECT_EQ(a[i]->calls, b[i]->calls) << rn << " " << b[i]->name;
      EXPECT_EQ(a[i]->outputs, b[i]->outputs) << rn << " " << b[i]->name;
    }
    // against the CPU EP layer: same routing, plan and wire bytes; values within tolerance
    const Out& c = cpu[r];
    EXPECT_EQ(o.rep.padded_rows, c.rep.padded_rows) << rn;
    EXPECT_EQ(o.rep.routed_rows, c.rep.routed_rows) << rn;
    ASSERT_EQ(o.rep.wire.size(), c.rep.wire.size()) << rn;
    for (size_t i = 0; i < c.rep.wire.size(); ++i) {
      EXPECT_EQ(o.rep.wire[i].name, c.rep.wire[i].name) << rn;
      if (o.rep.wire[i].format.find("(deduplicated") != std::string::npos) {
        // one row per (token, rank) instead of per (token, expert): never more rows than the
        // CPU reference exchange moves (the payload itself is checked by the bits above)
        EXPECT_LE(o.rep.wire[i].rows, c.rep.wire[i].rows) << rn << " " << c.rep.wire[i].name;
        EXPECT_EQ(o.rep.wire[i].rows == 0, o.rep.wire[i].bytes == 0) << rn << " " << c.rep.wire[i].name;
        continue;
      }
      EXPECT_EQ(o.rep.wire[i].format, c.rep.wire[i].format) << rn;
      EXPECT_EQ(o.rep.wire[i].rows, c.rep.wire[i].rows) << rn << " " << c.rep.wire[i].name;
      EXPECT_EQ(o.rep.wire[i].bytes, c.rep.wire[i].bytes) << rn << " " << c.rep.wire[i].name;
    }
    EXPECT_EQ(o.rep.saved_bytes(), c.rep.saved_bytes()) << rn;
    const double e[5] = {rel_rms(o.y, c.y), rel_rms(o.dx, c.dx), rel_rms(o.dw1, c.dw1),
                         rel_rms(o.dw2, c.dw2), rel_rms(o.dwr, c.dwr)};
    const char* nm[5] = {"y", "dx", "dW1", "dW2", "dWr"};
    for (int i = 0; i < 5; ++i) {
      EXPECT_LE(e[i], tol) << rn << " " << nm[i] << " vs CPU EP";
      worst = std::max(worst, e[i]);
    }
    tok0 += m.tokens[r];
  }
  std::printf("[ measure  ] %s: y, dx, dW1, dW2 = one GPU's bits; worst rel RMS vs CPU EP %.2e (tol %.0e)\n",
              name.c_str(), worst, tol);
}

class MoeEpGpuRecipe : public ::testing::TestWithParam<Recipe> {};

// W = 2 (A = 16, softmax) and W = 4 (A = 128, sigmoid + renormalisation, a rank with one token).
TEST_P(MoeEpGpuRecipe, EqualsOneGpuOnConcatenatedBatchAndNearCpuEp) {
  REQUIRE_DEVICE();
  expect_ep_gpu(make_model(GetParam(), {37, 64}, 16, RouterScore::kSoftmax, false, 101), 2);
  expect_ep_gpu(make_model(GetParam(), {37, 64, 1, 50}, 128, RouterScore::kSigmoid, true, 102), 4);
}

// The same with CudaLayerOptions::ep_dedup false: every (token, expert) row travels (the CPU
// layer's exchange, wire bytes equal too). The deduplicated dispatch above is the default.
TEST_P(MoeEpGpuRecipe, WithoutDeduplicationToo) {
  REQUIRE_DEVICE();
  CudaLayerOptions no_dedup;
  no_dedup.ep_dedup = false;
  expect_ep_gpu(make_model(GetParam(), {37, 64}, 16, RouterScore::kSoftmax, false, 103), 2, no_dedup);
  expect_ep_gpu(make_model(GetParam(), {37, 64, 1, 50}, 128, RouterScore::kSigmoid, true, 104), 4, no_dedup);
}

// A router bias sends every token to experts 0 and 1 (rank 0's with W = 2): rank 1's experts
// receive no row (Mp = 0), run every operator on zero rows and still take part in every exchange.
TEST_P(MoeEpGpuRecipe, RankWithNoRows) {
  REQUIRE_DEVICE();
  Model m = make_model(GetParam(), {37, 64}, 16, RouterScore::kSoftmax, false, 7);
  m.bias.assign(kE, 0.0f);
  m.bias[0] = m.bias[1] = 100.0f;
  expect_ep_gpu(m, 2);
}

// CudaLayerOptions::sync_free with expert parallelism (docs/EP.md §8): the plan made on the device
// from every rank's counts and the rows pulled from the peers' buffers give everything the
// synchronous exchange gives above (one GPU's bits, the CPU EP layer's report and wire bytes),
// deduplicated or not, with a rank whose experts receive no row, and no host synchronisation.
TEST_P(MoeEpGpuRecipe, SyncFreeEqualsOneGpu) {
  REQUIRE_DEVICE();
  CudaLayerOptions sf;
  sf.sync_free = true;
  expect_ep_gpu(make_model(GetParam(), {37, 64}, 128, RouterScore::kSoftmax, false, 105), 2, sf);
  expect_ep_gpu(make_model(GetParam(), {37, 64, 1, 50}, 128, RouterScore::kSigmoid, true, 106), 4, sf);
  Model none = make_model(GetParam(), {37, 64}, 128, RouterScore::kSoftmax, false, 9);
  none.bias.assign(kE, 0.0f);
  none.bias[0] = none.bias[1] = 100.0f;
  expect_ep_gpu(none, 2, sf);
  sf.ep_dedup = false;
  expect_ep_gpu(make_model(GetParam(), {37, 64, 1, 50}, 128, RouterScore::kSigmoid, true, 107), 4, sf);
}

INSTANTIATE_TEST_SUITE_P(AllRecipes, MoeEpGpuRecipe, ::testing::ValuesIn(all_recipes()),
                         [](const ::testing::TestParamInfo<Recipe>& i) {
                           std::string s = recipe_name(i.param);
                           std::replace(s.begin(), s.end(), '-', '_');
                           return s;
                         });

// The layer's send path: device build_routing's row_map_unpadded is the plan's send order (the
// CPU build_routing at align 1), ep_gather_rows puts token rows there, dispatch_rows over the
// device world lands row (p, t, s) in rank q's padded segment of its local expert l at the plan's
// position (rank 0's rows first, each rank's in (token, slot) order), padding rows untouched; and
// combine_rows brings every row back to its send position.
TEST(MoeEpGpuDispatch, PayloadLandsWherePlanSays) {
  REQUIRE_DEVICE();
  for (int W : {2, 4}) {
    const std::vector<int64_t> tokens = W == 2 ? std::vector<int64_t>{37, 64}
                                               : std::vector<int64_t>{37, 64, 1, 50};
    const int El = kE / W, A = 16;
    // every rank's ids (distinct experts per token, some slots dropped)
    std::mt19937 rng(1234 + W);
    std::vector<std::vector<int32_t>> ids(W);
    for (int r = 0; r < W; ++r) {
      for (int64_t t = 0; t < tokens[r]; ++t) {
        std::vector<int32_t> e(kE);
        for (int i = 0; i < kE; ++i) e[i] = i;
        std::shuffle(e.begin(), e.end(), rng);
        for (int s = 0; s < kK; ++s) ids[r].push_back(rng() % 7 == 0 ? -1 : e[s]);
      }
    }
    std::unique_ptr<SimWorld> world = make_device_sim_world(W, 60.0);
    const std::vector<std::string> errs = world->run([&](Communicator& comm) {
      const int me = comm.rank();
      const int64_t T = tokens[me];
      cudaStream_t s = nullptr;
      if (cudaStreamCreateWithFlags(&s, cudaStreamNonBlocking) != cudaSuccess) throw Error(__FILE__, __LINE__, "stream");
      EpConfig ec;
      ec.num_experts = kE;
      ec.topk = kK;
      ec.hidden = 128;
      ec.align = A;
      const DispatchPlan plan = plan_dispatch(comm, ec, ids[me].data(), T);
      // device routing of this rank's ids
      const DeviceRouting dr(ids[me].data(), T, kK, kE, A, s);
      const Dev<int32_t>& rmu = dr.row_map_unpadded;
      const std::vector<int32_t> h_rmu = rmu.get(s);
      FLOWMOE_CHECK(h_rmu == plan.send_routing.row_map,
                    "rank " << me << ": device row_map_unpadded differs from the plan's send order");
      // payload of token t: {rank, t, 0x5EED, ~t}
      std::vector<int32_t> pay(T * 4);
      for (int64_t t = 0; t < T; ++t) {
        pay[t * 4 + 0] = me;
        pay[t * 4 + 1] = int32_t(t);
        pay[t * 4 + 2] = 0x5EED;
        pay[t * 4 + 3] = ~int32_t(t);
      }
      Dev<int32_t> d_pay(T * 4, s, pay.data());
      const int64_t S = plan.send_rows(), Mp = plan.padded_rows();
      Dev<int32_t> send(S * 4, s), recv(Mp * 4, s), back(S * 4, s);
      cudaMemsetAsync(recv.p, 0xFF, std::max<int64_t>(Mp, 1) * 16, s);
      cuda::moe::ep_gather_rows(d_pay.p, 16, false, rmu.p, T, kK, send.p, s);
      cudaStreamSynchronize(s);
      dispatch_rows(comm, plan, {{send.p, recv.p, 16}});
      comm.synchronize();
      const std::vector<int32_t> got = recv.get(s);
      for (int l = 0; l < El; ++l) {
        int64_t row = plan.padded_offsets[l];
        const int g = me * El + l;
        for (int p = 0; p < W; ++p)
          for (int64_t t = 0; t < tokens[p]; ++t)
            for (int sl = 0; sl < kK; ++sl) {
              if (ids[p][t * kK + sl] != g) continue;
              const int32_t* v = &got[row * 4];
              FLOWMOE_CHECK(v[0] == p && v[1] == t && v[2] == 0x5EED && v[3] == ~int32_t(t),
                            "rank " << me << " expert " << l << " row " << row << ": got (" << v[0]
                                    << ", " << v[1] << ") expected (" << p << ", " << t << ")");
              ++row;
            }
        FLOWMOE_CHECK(row == plan.padded_offsets[l] + plan.expert_counts[l], "row count");
        for (; row < plan.padded_offsets[l + 1]; ++row)
          for (int c = 0; c < 4; ++c)
            FLOWMOE_CHECK(got[row * 4 + c] == -1, "rank " << me << ": padding row " << row << " written");
      }
      // and back
      combine_rows(comm, plan, {{recv.p, back.p, 16}});
      comm.synchronize();
      FLOWMOE_CHECK(back.get(s) == send.get(s), "rank " << me << ": combine did not restore the send rows");
      cudaStreamDestroy(s);
    });
    for (int r = 0; r < W; ++r) EXPECT_EQ(errs[r], "") << "W=" << W << " rank " << r;
    EXPECT_GT(world->bytes_sent(0), 0) << "W=" << W;
  }
}

// The CUDA layer needs a device-memory communicator: a host SimWorld is an error on every rank.
TEST(MoeEpGpuArgs, HostCommunicatorIsRejectedOnEveryRank) {
  REQUIRE_DEVICE();
  SimWorld world(2, 30.0);
  const std::vector<std::string> errs = world.run([&](Communicator& comm) {
    MoeConfig cfg = make_model(Recipe::kFlow, {8, 8}, 16, RouterScore::kSoftmax, false, 1).cfg;
    cfg.max_tokens = 8;
    cfg.comm = &comm;
    make_cuda_layer(cfg, nullptr);
  });
  for (int r = 0; r < 2; ++r) EXPECT_NE(errs[r].find("device-memory communicator"), std::string::npos) << errs[r];
}

// CudaLayerOptions::ep_dedup is part of the configuration every rank must agree on: ranks that
// differ get an error naming it, every one of them.
TEST(MoeEpGpuArgs, DedupMismatchIsAnErrorOnEveryRank) {
  REQUIRE_DEVICE();
  std::unique_ptr<SimWorld> world = make_device_sim_world(2, 30.0);
  const std::vector<std::string> errs = world->run([&](Communicator& comm) {
    MoeConfig cfg = make_model(Recipe::kFlow, {8, 8}, 16, RouterScore::kSoftmax, false, 1).cfg;
    cfg.max_tokens = 8;
    cfg.comm = &comm;
    CudaLayerOptions o;
    o.ep_dedup = comm.rank() == 0;
    make_cuda_layer(cfg, nullptr, o);
  });
  for (int r = 0; r < 2; ++r) EXPECT_NE(errs[r].find("ep_dedup"), std::string::npos) << errs[r];
}

}  // namespace
}  // namespace flowmoe
