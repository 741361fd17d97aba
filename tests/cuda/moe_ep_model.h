// Helpers shared by the expert-parallel CUDA layer tests: tests/cuda/test_moe_ep_gpu.cu (ranks as
// threads of a device SimWorld on one GPU) and tests/nccl/flowmoe_nccl_tests.cu (one process per
// GPU over NCCL). A small model (H 256, F 128, E 8, top-2) whose weights and per-rank tokens are
// generated from a seed, so every process can rebuild every rank's data and the single-GPU
// reference by itself; and one CUDA layer's forward + backward with outputs copied to the host.
#pragma once

#include <cuda_runtime.h>

#include <algorithm>
#include <cmath>
#include <memory>
#include <random>
#include <stdexcept>
#include <vector>

#include "common/moe_config.h"
#include "cuda/device_buffer.h"
#include "flowmoe/cuda/moe_debug.h"
#include "flowmoe/moe.h"
#include "flowmoe/numerics.h"
#include "flowmoe/token.h"

namespace flowmoe {
namespace eptest {

constexpr int64_t kH = 256, kF = 128;
constexpr int kE = 8, kK = 2;

// Device buffer owned by one rank's thread; copies on that rank's stream.
template <typename T>
using Dev = testutil::StreamBuf<T>;

// One rank's device routing tables of its ids [T, k] (cuda::build_routing on stream s; tables
// left zero when T = 0). row_map_unpadded is what the EP gathers use as the send order.
struct DeviceRouting {
  Dev<int32_t> ids, counts, offsets, padded_offsets, row_map, row_map_unpadded;
  Dev<uint8_t> workspace;
  DeviceRouting(const int32_t* h_ids, int64_t T, int k, int E, int align, cudaStream_t s)
      : ids(T * k, s, h_ids), counts(E, s), offsets(E + 1, s), padded_offsets(E + 1, s), row_map(T * k, s),
        row_map_unpadded(T * k, s), workspace(cuda::routing_workspace_bytes(T, k, E), s) {
    cuda::Routing rt;
    rt.tokens = T;
    rt.topk = k;
    rt.num_experts = E;
    rt.align = align;
    rt.counts = counts.p;
    rt.offsets = offsets.p;
    rt.padded_offsets = padded_offsets.p;
    rt.row_map = row_map.p;
    rt.row_map_unpadded = row_map_unpadded.p;
    rt.workspace = workspace.p;
    if (T > 0) cuda::build_routing(ids.p, rt, nullptr, s);
  }
};

struct Model {
  MoeConfig cfg;  // comm null, max_tokens unset
  std::vector<float> w1, w2, wr, bias;
  std::vector<std::vector<bf16_t>> x, dy;  // per rank [T_r, H]
  std::vector<int64_t> tokens;
  int64_t total_tokens() const {
    int64_t n = 0;
    for (int64_t t : tokens) n += t;
    return n;
  }
  int64_t max_tokens() const { return *std::max_element(tokens.begin(), tokens.end()); }
  std::vector<bf16_t> concat(const std::vector<std::vector<bf16_t>>& v) const {
    std::vector<bf16_t> all;
    for (const auto& r : v) all.insert(all.end(), r.begin(), r.end());
    return all;
  }
};

inline Model make_model(Recipe recipe, const std::vector<int64_t>& tokens, int align, RouterScore score,
                 bool renorm, uint32_t seed) {
  Model m;
  m.cfg = flowmoe_test::moe_config(kH, kF, kE, kK)
              .router(score, renorm, renorm ? 2.5f : 1.0f)
              .align(align)
              .recipe(recipe);
  m.tokens = tokens;
  std::mt19937 rng(seed);
  std::normal_distribution<float> nd(0.0f, 1.0f);
  m.w1.resize(int64_t(kE) * 2 * kF * kH);
  m.w2.resize(int64_t(kE) * kH * kF);
  m.wr.resize(int64_t(kE) * kH);
  for (float& v : m.w1) v = nd(rng) / std::sqrt(float(kH));
  for (float& v : m.w2) v = nd(rng) / std::sqrt(float(kF));
  for (float& v : m.wr) v = nd(rng) / std::sqrt(float(kH));
  for (int64_t t : tokens) {
    std::vector<bf16_t> x(t * kH), dy(t * kH);
    for (bf16_t& v : x) v = num::f32_to_bf16(nd(rng));
    for (bf16_t& v : dy) v = num::f32_to_bf16(nd(rng));
    m.x.push_back(x);
    m.dy.push_back(dy);
  }
  return m;
}

struct Out {
  std::vector<bf16_t> y, dx;
  std::vector<float> dw1, dw2, dwr;  // from zero; dw1/dw2 of the layer's (local) experts
  CastReport rep;
  MoeStatus st;
  int64_t host_syncs = -1;  // the layer's count (moe_debug.h)
};

// Forward + backward of one CUDA layer whose weights are experts [e0, e0 + n) of the model.
inline Out run_gpu_one(const MoeConfig& cfg, const Model& m, int e0, int n, const bf16_t* x,
                const bf16_t* dy, int64_t T, const CudaLayerOptions& options = CudaLayerOptions()) {
  cudaStream_t s = nullptr;
  if (cudaStreamCreateWithFlags(&s, cudaStreamNonBlocking) != cudaSuccess)
    throw std::runtime_error("cudaStreamCreate");
  Out o;
  {
    // buffers first: with sync_free and several ranks, a peer's step may already wait at a device
    // barrier once the layers exist, and cudaMalloc can wait for the device to idle
    Dev<float> w1(int64_t(n) * 2 * kF * kH, s, m.w1.data() + int64_t(e0) * 2 * kF * kH);
    Dev<float> w2(int64_t(n) * kH * kF, s, m.w2.data() + int64_t(e0) * kH * kF);
    Dev<float> wr(m.wr.size(), s, m.wr.data());
    Dev<float> bias(kE, s, m.bias.empty() ? nullptr : m.bias.data());
    Dev<bf16_t> dx_in(T * kH, s, x), dy_in(T * kH, s, dy), y(T * kH, s), dx(T * kH, s);
    Dev<float> dw1(int64_t(n) * 2 * kF * kH, s), dw2(int64_t(n) * kH * kF, s), dwr(m.wr.size(), s);
    std::unique_ptr<MoeLayer> layer = make_cuda_layer(cfg, s, options);
    layer->set_weights(MoeWeights{w1.p, w2.p, wr.p, m.bias.empty() ? nullptr : bias.p});
    layer->forward(dx_in.p, T, y.p);
    layer->backward(dy_in.p, dx.p, MoeGrads{dw1.p, dw2.p, dwr.p});
    o.y = y.get(s);
    o.dx = dx.get(s);
    o.dw1 = dw1.get(s);
    o.dw2 = dw2.get(s);
    o.dwr = dwr.get(s);
    o.rep = layer->cast_report();
    o.st = layer->status();
    o.host_syncs = cuda::moe::counters(layer.get()).host_syncs;
  }
  cudaStreamDestroy(s);
  return o;
}

}  // namespace eptest
}  // namespace flowmoe
