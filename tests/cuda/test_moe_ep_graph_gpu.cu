// Expert parallelism without host synchronisation (CudaLayerOptions::sync_free with a
// communicator; docs/EP.md §8), captured: every rank of a device SimWorld (threads on one GPU, each
// with its own stream and layer) captures its step into a CUDA graph on its own thread
// (LayerStepGraph) and replays it. The replays of the ranks run concurrently and meet only at the
// device barriers. Checked: every replay gives the eager step's bits on every rank (outputs
// poisoned between replays), no host synchronisation, every recipe, deduplicated or not; the
// DevicePeers of the device world (shared pointers, barrier, a barrier that times out); the
// argument checks (a communicator without device peer access, ranks that disagree on sync_free).
#include <cuda_runtime.h>
#include <gtest/gtest.h>

#include <chrono>
#include <cstdlib>
#include <cstring>
#include <memory>
#include <random>
#include <string>
#include <thread>
#include <vector>

#include "cuda/gpu_test_util.h"
#include "cuda/moe/kernels.cuh"
#include "cuda/moe_ep_model.h"
#include "flowmoe/comm.h"
#include "flowmoe/cuda/moe_debug.h"
#include "flowmoe/cuda/moe_graph.h"
#include "flowmoe/error.h"
#include "flowmoe/moe.h"

namespace flowmoe {
namespace {

// The simulated ranks share one GPU, and a device barrier waits on the GPU, so two things CUDA does
// by default could make one rank's waiting barrier block the peer it waits for:
//   * lazy module loading: a kernel's first launch loads its module, and the load waits for the
//     work in flight, which a peer's barrier kernel then is (NVIDIA's documented advice for kernels
//     that wait on each other: load eagerly);
//   * two ranks' streams on one hardware queue (8 by default; 32, the most, here).
// Both set before the process makes its CUDA context (this test binary's, for every test in it).
[[maybe_unused]] const int kEagerModules = setenv("CUDA_MODULE_LOADING", "EAGER", /*overwrite=*/0);
[[maybe_unused]] const int kHardwareQueues = setenv("CUDA_DEVICE_MAX_CONNECTIONS", "32", /*overwrite=*/0);

using namespace testutil;  // REQUIRE_DEVICE
using namespace eptest;    // Dev, Model, make_model, kH, kF, kE, kK

template <typename T>
bool same_bits(const std::vector<T>& a, const std::vector<T>& b) {
  return a.size() == b.size() && (a.empty() || std::memcmp(a.data(), b.data(), sizeof(T) * a.size()) == 0);
}

void expect_graph_replays_equal_eager(Recipe recipe, int W, bool dedup, bool side_stream) {
  const std::vector<int64_t> tokens = W == 2 ? std::vector<int64_t>{37, 64} : std::vector<int64_t>{37, 64, 1, 50};
  const Model m = make_model(recipe, tokens, 128, RouterScore::kSigmoid, true, uint32_t(300 + W));
  const int El = kE / W;
  const int64_t n1 = int64_t(El) * 2 * kF * kH, n2 = int64_t(El) * kH * kF;
  std::unique_ptr<SimWorld> world = make_device_sim_world(W, 20.0);
  const std::vector<std::string> errs = world->run([&](Communicator& comm) {
    const int r = comm.rank();
    const int64_t T = m.tokens[r];
    MoeConfig cfg = m.cfg;
    cfg.max_tokens = m.max_tokens();
    cfg.comm = &comm;
    CudaLayerOptions o;
    o.sync_free = true;
    o.ep_dedup = dedup;
    o.side_stream = side_stream;
    cudaStream_t s = nullptr;
    FLOWMOE_CHECK(cudaStreamCreateWithFlags(&s, cudaStreamNonBlocking) == cudaSuccess, "cudaStreamCreate");
    {
      // Allocations (cudaMalloc, graph instantiation) can wait for the whole device to idle: on one
      // GPU that would wait for a peer's barrier kernel waiting for this rank. So: buffers before
      // the layers exist, a host barrier after every rank's capture, and one before teardown.
      Dev<float> w1(n1, s, m.w1.data() + int64_t(r) * n1), w2(n2, s, m.w2.data() + int64_t(r) * n2);
      Dev<float> wr(m.wr.size(), s, m.wr.data());
      Dev<bf16_t> x(T * kH, s, m.x[r].data()), dy(T * kH, s, m.dy[r].data()), y(T * kH, s), dx(T * kH, s);
      Dev<float> dw1(n1, s), dw2(n2, s), dwr(m.wr.size(), s);
      std::unique_ptr<MoeLayer> layer = make_cuda_layer(cfg, s, o);
      layer->set_weights(MoeWeights{w1.p, w2.p, wr.p, nullptr});
      const MoeGrads g{dw1.p, dw2.p, dwr.p, /*accumulate=*/false};
      layer->forward(x.p, T, y.p);
      layer->backward(dy.p, dx.p, g);
      const std::vector<bf16_t> y0 = y.get(s), dx0 = dx.get(s);
      const std::vector<float> dw10 = dw1.get(s), dw20 = dw2.get(s), dwr0 = dwr.get(s);
      auto poison = [&] {
        cudaMemsetAsync(y.p, 0xFF, sizeof(bf16_t) * T * kH, s);
        cudaMemsetAsync(dx.p, 0xFF, sizeof(bf16_t) * T * kH, s);
        cudaMemsetAsync(dw1.p, 0xFF, sizeof(float) * n1, s);
        cudaMemsetAsync(dw2.p, 0xFF, sizeof(float) * n2, s);
        cudaMemsetAsync(dwr.p, 0xFF, sizeof(float) * m.wr.size(), s);
      };
      poison();
      cuda::moe::LayerStepGraph graph(layer.get(), s, {x.p, T, y.p, dy.p, dx.p, g});
      FLOWMOE_CHECK(cudaStreamSynchronize(s) == cudaSuccess, "upload");
      comm.barrier();
      for (int i = 0; i < 3; ++i) {
        graph.replay();
        FLOWMOE_CHECK(cudaStreamSynchronize(s) == cudaSuccess, "replay");
        const std::string failed = comm.device_peers()->failed();
        const std::string at = "rank " + std::to_string(r) + " replay " + std::to_string(i) + " (" + failed + "): ";
        FLOWMOE_CHECK(same_bits(y.get(s), y0), at << "y differs from the eager step");
        FLOWMOE_CHECK(same_bits(dx.get(s), dx0), at << "dx differs from the eager step");
        FLOWMOE_CHECK(same_bits(dw1.get(s), dw10), at << "dW1 differs from the eager step");
        FLOWMOE_CHECK(same_bits(dw2.get(s), dw20), at << "dW2 differs from the eager step");
        FLOWMOE_CHECK(same_bits(dwr.get(s), dwr0), at << "dWr differs from the eager step");
        poison();
      }
      FLOWMOE_CHECK(layer->status().nonfinite == 0, "rank " << r << ": non-finite values counted");
      FLOWMOE_CHECK(layer->cast_report().padded_rows > 0 || r > 0, "rank " << r << ": no padded rows reported");
      const int64_t syncs = cuda::moe::counters(layer.get()).host_syncs;
      FLOWMOE_CHECK(syncs == 0, "rank " << r << ": " << syncs << " host synchronisations; expected none");
      comm.barrier();
    }
    cudaStreamDestroy(s);
  });
  for (int r = 0; r < W; ++r)
    EXPECT_EQ(errs[r], "") << recipe_name(recipe) << " W=" << W << (dedup ? "" : " (no dedup)")
                           << (side_stream ? " (side stream)" : "") << " rank " << r;
}

TEST(MoeEpSyncFreeGpu, GraphReplaysEqualEagerEveryRecipe) {
  REQUIRE_DEVICE();
  for (Recipe rc : all_recipes()) expect_graph_replays_equal_eager(rc, 2, true, false);
  expect_graph_replays_equal_eager(Recipe::kFlow, 4, true, false);
  expect_graph_replays_equal_eager(Recipe::kFlow, 4, false, false);
  expect_graph_replays_equal_eager(Recipe::kFlowFp4, 4, true, false);
  expect_graph_replays_equal_eager(Recipe::kFlow, 2, true, true);
  expect_graph_replays_equal_eager(Recipe::kFlow, 4, true, true);
}

// ep_device_plan (one block, on the device) against plan_from_all_counts (the host's DispatchPlan)
// for random count matrices with empty experts: the local offsets and every piece of the dispatch
// (with the padding pieces), the combine and the deduplicated dispatch, for every rank.
TEST(MoeEpSyncFreeGpu, DevicePlanEqualsTheHostPlan) {
  REQUIRE_DEVICE();
  std::mt19937 rng(2026);
  for (int W : {1, 2, 3, 8})
    for (int El : {1, 4, 32})
      for (int A : {16, 128}) {
        const int E = W * El;
        std::vector<int32_t> C(size_t(W) * E), D(size_t(W) * W);
        for (int32_t& c : C) c = rng() % 3 == 0 ? 0 : int32_t(rng() % 300);
        for (int32_t& d : D) d = rng() % 4 == 0 ? 0 : int32_t(rng() % 500);
        const EpConfig cfg{E, 1, 128, A, WireFormat::kFp8, true};
        std::vector<DispatchPlan> plan;
        for (int r = 0; r < W; ++r) plan.push_back(plan_from_all_counts(cfg, r, W, C.data(), 1 << 20, D.data()));
        Dev<int32_t> dC(C.size(), nullptr, C.data()), dD(D.size(), nullptr, D.data()), off(El + 1, nullptr);
        Dev<cuda::moe::EpPiece> disp(W * El + El, nullptr), comb(W * El, nullptr), dedup(W, nullptr);
        for (int me = 0; me < W; ++me) {
          const std::string at = "W=" + std::to_string(W) + " El=" + std::to_string(El) + " A=" + std::to_string(A) +
                                 " rank " + std::to_string(me);
          cuda::moe::ep_device_plan(dC.p, dD.p, W, El, me, A, off.p, disp.p, comb.p, dedup.p, nullptr);
          ASSERT_EQ(cudaDeviceSynchronize(), cudaSuccess) << at;
          const DispatchPlan& p = plan[me];
          const std::vector<int32_t> o = off.get(nullptr);
          EXPECT_EQ(o, p.padded_offsets) << at;
          const std::vector<cuda::moe::EpPiece> d = disp.get(nullptr), c = comb.get(nullptr), t = dedup.get(nullptr);
          auto expect = [&](const cuda::moe::EpPiece& got, int peer, int64_t src, int64_t dst, int64_t rows,
                            const std::string& what) {
            EXPECT_TRUE(got.peer == peer && got.src_row == src && got.dst_row == dst && got.rows == rows)
                << at << " " << what << ": got (" << got.peer << ", " << got.src_row << ", " << got.dst_row << ", "
                << got.rows << "), expected (" << peer << ", " << src << ", " << dst << ", " << rows << ")";
          };
          for (int q = 0; q < W; ++q)
            for (int l = 0; l < El; ++l) {
              const int g = me * El + l, i = q * El + l;
              expect(d[i], q, plan[q].send_offsets[g], p.recv_offsets[i], p.recv_counts[i], "dispatch " + std::to_string(i));
              const int h = q * El + l;  // combine: this rank's rows of rank q's expert l
              expect(c[h], q, plan[q].recv_offsets[me * El + l], p.send_offsets[h], p.send_counts[h],
                     "combine " + std::to_string(h));
            }
          for (int l = 0; l < El; ++l) {
            const int64_t end = int64_t(p.padded_offsets[l]) + p.expert_counts[l];
            expect(d[W * El + l], -1, 0, end, p.padded_offsets[l + 1] - end, "padding " + std::to_string(l));
          }
          for (int q = 0; q < W; ++q) {
            int64_t src = 0, dst = 0;
            for (int r = 0; r < me; ++r) src += plan[q].send_tokens[r];
            for (int r = 0; r < q; ++r) dst += p.recv_tokens[r];
            expect(t[q], q, src, dst, p.recv_tokens[q], "dedup " + std::to_string(q));
          }
        }
      }
}

// The device world's DevicePeers: share() gives every rank every rank's pointer in rank order;
// barriers in sequence pass; a barrier a peer never reaches gives up after the timeout and
// failed() says so.
TEST(MoeEpSyncFreeGpu, DevicePeersShareAndBarrier) {
  REQUIRE_DEVICE();
  const int W = 3;
  std::vector<void*> mine(W, nullptr);
  {
    std::unique_ptr<SimWorld> world = make_device_sim_world(W, 30.0);
    const std::vector<std::string> errs = world->run([&](Communicator& comm) {
      DevicePeers* peers = comm.device_peers();
      FLOWMOE_CHECK(peers != nullptr, "no device peers");
      Dev<int32_t> buf(4, nullptr), seen(2, nullptr);  // (allocated before any barrier runs)
      mine[comm.rank()] = buf.p;
      void* const* table = peers->share(buf.p);
      std::vector<void*> got(W);
      FLOWMOE_CHECK(cudaMemcpy(got.data(), table, sizeof(void*) * W, cudaMemcpyDeviceToHost) == cudaSuccess, "copy");
      for (int q = 0; q < W; ++q) FLOWMOE_CHECK(got[q] == mine[q], "rank " << comm.rank() << ": pointer " << q);
      cudaStream_t s = nullptr;
      FLOWMOE_CHECK(cudaStreamCreateWithFlags(&s, cudaStreamNonBlocking) == cudaSuccess, "stream");
      for (int i = 0; i < 5; ++i) peers->barrier(s);
      FLOWMOE_CHECK(cudaStreamSynchronize(s) == cudaSuccess, "sync");
      // Ordering, with the writer (read-after-write) and then the reader (write-after-read) held
      // back 300 ms by a host function on its stream: without the device barrier rank 0 would read
      // rank 1's buffer before the write, or after the overwrite.
      auto hold = [&] {
        FLOWMOE_CHECK(cudaLaunchHostFunc(
                          s, [](void*) { std::this_thread::sleep_for(std::chrono::milliseconds(300)); },
                          nullptr) == cudaSuccess,
                      "host function");
      };
      if (comm.rank() == 1) {
        hold();
        cudaMemsetAsync(buf.p, 0x11, sizeof(int32_t), s);
      }
      peers->barrier(s);
      if (comm.rank() == 0) {
        cudaMemcpyAsync(seen.p, got[1], sizeof(int32_t), cudaMemcpyDeviceToDevice, s);
        hold();
        cudaMemcpyAsync(seen.p + 1, got[1], sizeof(int32_t), cudaMemcpyDeviceToDevice, s);
      }
      peers->barrier(s);
      if (comm.rank() == 1) cudaMemsetAsync(buf.p, 0x22, sizeof(int32_t), s);
      FLOWMOE_CHECK(cudaStreamSynchronize(s) == cudaSuccess, "sync");
      if (comm.rank() == 0) {
        const std::vector<int32_t> v = seen.get(s);
        FLOWMOE_CHECK(v[0] == 0x11111111 && v[1] == 0x11111111,
                      "rank 0 read " << std::hex << v[0] << ", " << v[1] << " from rank 1; expected 11111111 twice");
      }
      FLOWMOE_CHECK(peers->failed().empty(), "rank " << comm.rank() << ": " << peers->failed());
      comm.barrier();  // every rank has read its table before the buffers go
      cudaStreamDestroy(s);
    });
    for (int r = 0; r < W; ++r) EXPECT_EQ(errs[r], "") << "rank " << r;
  }
  // rank 1's barrier kernel waits 2 s behind a host function on its stream: rank 0's gives up after
  // the world's 0.5 s timeout and failed() says who and where, on both ranks (the world is failed:
  // rank 1's barrier then returns at once)
  std::unique_ptr<SimWorld> world = make_device_sim_world(2, 0.5);
  const std::vector<std::string> errs = world->run([&](Communicator& comm) {
    cudaStream_t s = nullptr;
    FLOWMOE_CHECK(cudaStreamCreateWithFlags(&s, cudaStreamNonBlocking) == cudaSuccess, "stream");
    if (comm.rank() == 1)
      FLOWMOE_CHECK(cudaLaunchHostFunc(s, [](void*) { std::this_thread::sleep_for(std::chrono::seconds(2)); },
                                       nullptr) == cudaSuccess, "host function");
    comm.device_peers()->barrier(s);
    FLOWMOE_CHECK(cudaStreamSynchronize(s) == cudaSuccess, "sync");
    const std::string f = comm.device_peers()->failed();
    FLOWMOE_CHECK(f.find("rank 0 waited at its device barrier #1 longer than the timeout") != std::string::npos,
                  "rank " << comm.rank() << ": expected rank 0's timeout, got '" << f << "'");
    cudaStreamDestroy(s);
  });
  EXPECT_EQ(errs[0], "");
  EXPECT_EQ(errs[1], "");
}

// A device-memory communicator without device peer access (NCCL's today) cannot run the sync-free
// exchange: a clear error on every rank; and sync_free is part of what the ranks must agree on.
TEST(MoeEpSyncFreeGpu, ArgumentErrors) {
  REQUIRE_DEVICE();
  SimWorld::Copier c;  // a device world without DevicePeers; make_cuda_layer stops before any copy
  c.copy = [](int, void*, const void*, int64_t) { throw Error(__FILE__, __LINE__, "unused"); };
  c.wait = [](int) {};
  c.copy_local = [](int, const std::vector<CopyPiece>&) { throw Error(__FILE__, __LINE__, "unused"); };
  c.scratch = [](int, int64_t) -> void* { return nullptr; };
  SimWorld plain(2, 30.0, MemorySpace::kDevice, c);
  std::vector<std::string> errs = plain.run([&](Communicator& comm) {
    MoeConfig cfg = make_model(Recipe::kFlow, {8, 8}, 128, RouterScore::kSoftmax, false, 1).cfg;
    cfg.max_tokens = 8;
    cfg.comm = &comm;
    CudaLayerOptions o;
    o.sync_free = true;
    make_cuda_layer(cfg, nullptr, o);
  });
  for (int r = 0; r < 2; ++r) EXPECT_NE(errs[r].find("device_peers"), std::string::npos) << errs[r];

  std::unique_ptr<SimWorld> world = make_device_sim_world(2, 30.0);
  errs = world->run([&](Communicator& comm) {
    MoeConfig cfg = make_model(Recipe::kFlow, {8, 8}, 128, RouterScore::kSoftmax, false, 1).cfg;
    cfg.max_tokens = 8;
    cfg.comm = &comm;
    CudaLayerOptions o;
    o.sync_free = comm.rank() == 0;
    make_cuda_layer(cfg, nullptr, o);
  });
  for (int r = 0; r < 2; ++r) EXPECT_NE(errs[r].find("sync_free"), std::string::npos) << errs[r];
}

}  // namespace
}  // namespace flowmoe
