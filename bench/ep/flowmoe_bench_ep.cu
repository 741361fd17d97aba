// flowmoe_bench_ep: the expert-parallel benchmark of issue 7, one process per GPU over NCCL.
// Start it with `flowmoe bench-ep [--gpus N] ...` (the CLI launches one rank per GPU) or under
// torchrun (`torchrun --nproc-per-node=N --no-python build/flowmoe_bench_ep ...`). Rank 0 prints.
// NOT YET RUN ON GPUs: written and compiled on a machine without a GPU. docs/EP.md §7 defines
// every number printed.
//
// Per configuration (the token shapes of DeepSeek-V3 / V2 / V2-Lite: H, k; El local experts per
// GPU as `flowmoe bench`, E = N * El experts in all; T tokens per GPU, uniform random top-k):
//   1. dispatch and combine per wire format (bf16, fp8 = flow's UE8M0 1x128, fp8-fp32scale =
//      fp8-naive's, mxfp4): the NCCL exchange alone, the whole dispatch (send-order gather +
//      exchange + receiver relayout) and the dispatch with the entry quantization the format needs
//      (fp8: quantize_row; fp8-fp32scale: quantize_row_fp32_scale before and dequantize_row_fp32_scale of the
//      received rows after; mxfp4: quantize_mxfp4); combine: exchange alone and exchange +
//      unpermute (the sum over slots). Times are medians of CUDA events on the communicator's
//      stream, each repetition after a barrier; GB/s = bytes this rank sends to other ranks / time.
//      Wire bytes per element and per token are read from the DispatchPlan.
//   2. the layer forward + backward per recipe at EP = N (NCCL), next to two single-GPU layers
//      (no communication) on each rank's own GPU: "share" = El experts, T tokens (this GPU's share
//      of the expert work, what `flowmoe bench` measures: the communication-free ideal), and "all"
//      = N * El experts, N * T tokens (the whole EP group's problem on one GPU).
#include <cuda_runtime.h>

#include <algorithm>
#include <chrono>
#include <cmath>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <functional>
#include <memory>
#include <random>
#include <sstream>
#include <string>
#include <vector>

#include "flowmoe/comm.h"
#include "flowmoe/cuda/convert.h"
#include "flowmoe/cuda/ep_rows.h"
#include "flowmoe/cuda/moe_debug.h"
#include "flowmoe/error.h"
#include "flowmoe/settings.h"
#include "flowmoe/moe.h"
#include "flowmoe/token.h"
#include "layer_options.h"  // tools/common/: the layer's options from the environment
#include "timing.h"         // tools/common/: the timing harness

namespace flowmoe {
namespace {

#define BCUDA(expr)                                                                    \
  do {                                                                                 \
    cudaError_t e_ = (expr);                                                           \
    FLOWMOE_CHECK(e_ == cudaSuccess, #expr << ": " << cudaGetErrorString(e_));         \
  } while (0)

template <typename T>
struct Buf {
  T* p = nullptr;
  explicit Buf(int64_t n) { BCUDA(cudaMalloc(&p, sizeof(T) * size_t(std::max<int64_t>(n, 1)))); }
  ~Buf() { cudaFree(p); }
  Buf(const Buf&) = delete;
  Buf& operator=(const Buf&) = delete;
};

struct Cfg {
  const char* name;
  const char* paper;
  int64_t hidden, ffn;
  int experts, topk;  // experts: local experts per GPU (as `flowmoe bench`)
  RouterScore score;
  bool renorm;
  float scale;
};
const Cfg kCfgs[] = {
    {"v3-ep8", "DeepSeek-V3 EP8", 7168, 2048, 32, 8, RouterScore::kSigmoid, true, 2.5f},
    {"v3-ep32", "DeepSeek-V3 EP32", 7168, 2048, 8, 8, RouterScore::kSigmoid, true, 2.5f},
    {"v2", "DeepSeek-V2 EP8", 5120, 1536, 20, 6, RouterScore::kSoftmax, false, 1.0f},
    {"v2-lite", "DeepSeek-V2-Lite", 2048, 1408, 64, 6, RouterScore::kSoftmax, false, 1.0f},
};

using bench::median;

std::vector<std::string> split(const std::string& s) {
  std::vector<std::string> out;
  std::stringstream ss(s);
  std::string x;
  while (std::getline(ss, x, ','))
    if (!x.empty()) out.push_back(x);
  return out;
}

struct Opts {
  std::string configs = "v3-ep8,v2,v2-lite";
  int64_t tokens = 8192;
  std::string recipes = recipe_names(",");
  int reps = 10, warmup = 3, align = 128;
  int experts_total = 0;  // > 0: E experts in all, El = E / ranks (issue 8: 256 at every EP degree)
  bool layer = true, single = true, comm = true;
  bool stages = false;  // --stages: per-stage times of the EP layer next to the 1 GPU share's
  double timeout = 60.0;
};

// Local experts per GPU: the configuration's El, or E / ranks with --experts-total E.
int local_experts(const Cfg& c, const Opts& o, int world) {
  if (o.experts_total <= 0) return c.experts;
  FLOWMOE_CHECK(o.experts_total % world == 0, "--experts-total " << o.experts_total << " is not divisible by the "
                                                                 << world << " ranks");
  return o.experts_total / world;
}

// The max over ranks of a per-rank value (milliseconds), exchanged as integer nanoseconds / 16.
double max_over_ranks(Communicator& comm, double ms) {
  const int W = comm.world_size();
  std::vector<int32_t> s(W, int32_t(std::min(ms * 1e6 / 16.0, 2.0e9))), r(W, 0);
  comm.alltoall_i32(s.data(), r.data(), 1);
  int32_t m = 0;
  for (int32_t v : r) m = std::max(m, v);
  return double(m) * 16.0 / 1e6;
}

// Median of `reps` timings of `fn` (enqueued on stream s, the communicator's stream), each after
// a barrier; returns {median on this rank, max over ranks of the medians}.
std::pair<double, double> time_op(Communicator& comm, cudaStream_t s, int warmup, int reps,
                                  const std::function<void()>& fn) {
  const bench::PhaseTimes t =
      bench::time_phases({fn}, warmup, reps, s, [&] { comm.barrier(); }, [&] { comm.synchronize(); });
  const double m = median(t.ms[0]);
  return {m, max_over_ranks(comm, m)};
}

// ---- 1. dispatch and combine ------------------------------------------------------------------------
void bench_comm(Communicator& comm, cudaStream_t s, const Cfg& c, const Opts& o) {
  const int W = comm.world_size(), me = comm.rank();
  const int El = local_experts(c, o, W), E = El * W, k = c.topk;
  const int64_t H = c.hidden, T = o.tokens, nc = H / 128;
  // uniform random top-k distinct experts per token (seeded by rank)
  std::mt19937 rng(1000 + me);
  std::vector<int32_t> ids(T * k);
  std::vector<int32_t> perm(E);
  for (int64_t t = 0; t < T; ++t) {
    for (int i = 0; i < E; ++i) perm[i] = i;
    for (int sl = 0; sl < k; ++sl) {
      const int j = sl + int(rng() % uint32_t(E - sl));
      std::swap(perm[sl], perm[j]);
      ids[t * k + sl] = perm[sl];
    }
  }
  EpConfig ec;
  ec.num_experts = E;
  ec.topk = k;
  ec.hidden = H;
  ec.align = o.align;
  DispatchPlan plan = plan_dispatch(comm, ec, ids.data(), T);
  const int64_t S = plan.send_rows(), Mp = plan.padded_rows();
  Buf<int32_t> d_ids(T * k), counts(E), offs(E + 1), poffs(E + 1), rmap(T * k), rmu(T * k);
  Buf<uint8_t> ws(int64_t(cuda::routing_workspace_bytes(T, k, E)));
  BCUDA(cudaMemcpyAsync(d_ids.p, ids.data(), sizeof(int32_t) * T * k, cudaMemcpyHostToDevice, s));
  cuda::Routing rt;
  rt.tokens = T;
  rt.topk = k;
  rt.num_experts = E;
  rt.align = 1;
  rt.counts = counts.p;
  rt.offsets = offs.p;
  rt.padded_offsets = poffs.p;
  rt.row_map = rmap.p;
  rt.row_map_unpadded = rmu.p;
  rt.workspace = ws.p;
  cuda::build_routing(d_ids.p, rt, nullptr, s);
  Buf<bf16_t> x(T * H), y(T * H);
  Buf<float> probs(T * k);
  cuda::moe::fill_normal_bf16(x.p, T * H, 21 + me, 1.0f, s);
  cuda::moe::fill_normal_f32(probs.p, T * k, 31 + me, 0.1f, s);
  Buf<uint8_t> q_codes(T * H), q_sc(T * nc * 4), send(S * 2 * H), send_sc(S * nc * 4), recv(Mp * 2 * H),
      recv_sc(Mp * nc * 4), relaid(Mp * nc * 4);
  Buf<bf16_t> deq(Mp * H);
  BCUDA(cudaMemsetAsync(recv.p, 0, size_t(std::max<int64_t>(Mp, 1) * 2 * H), s));
  BCUDA(cudaStreamSynchronize(s));

  int64_t rows_out = 0, rows_in = 0;
  for (int p = 0; p < W; ++p)
    if (p != me) {
      rows_out += plan.rows_to(p);
      rows_in += plan.rows_from(p);
    }
  if (me == 0) {
    std::printf("\n### dispatch / combine, %s token shape: H %lld, top-%d, E %d (%d per GPU), T %lld per GPU, "
                "align %d; rank 0 sends %lld of %lld routed rows to other ranks, receives %lld\n",
                c.name, static_cast<long long>(H), k, E, El, static_cast<long long>(T), o.align,
                static_cast<long long>(rows_out), static_cast<long long>(S), static_cast<long long>(rows_in));
    std::printf("\n| payload | B/element (plan) | expected | wire B/token | exchange ms (max rank) | exchange GB/s "
                "| dispatch ms | dispatch GB/s | + quantize ms | + quantize GB/s |\n");
    std::printf("| --- | --- | --- | --- | --- | --- | --- | --- | --- | --- |\n");
  }
  struct F {
    WireFormat f;
    const char* quant;
  };
  const F formats[] = {{WireFormat::kBf16, nullptr},
                       {WireFormat::kFp8, "quantize_row (1x128 UE8M0)"},
                       {WireFormat::kFp8Fp32Scale, "quantize_row_fp32_scale + dequantize received"},
                       {WireFormat::kMxfp4, "quantize_mxfp4 (1x32)"}};
  for (const F& fm : formats) {
    const WireFormat f = fm.f;
    plan.format = f;
    plan.with_probs = false;
    const int64_t cb = wire_code_bytes(f, H), sb = wire_scale_bytes(f, H);
    const int64_t wire = plan.wire_bytes(f, false);
    std::vector<RowStream> streams = {{send.p, recv.p, cb}};
    if (sb) streams.push_back({send_sc.p, recv_sc.p, sb});
    auto gather = [&] {
      switch (f) {
        case WireFormat::kBf16:
          cuda::moe::ep_gather_rows(x.p, 2 * H, false, rmu.p, T, k, send.p, s);
          break;
        case WireFormat::kFp8:
          cuda::moe::ep_gather_rows(q_codes.p, H, false, rmu.p, T, k, send.p, s);
          cuda::moe::ep_gather_col_scales(q_sc.p, nc, 1, rmu.p, T, k, send_sc.p, s);
          break;
        case WireFormat::kFp8Fp32Scale:
          cuda::moe::ep_gather_rows(q_codes.p, H, false, rmu.p, T, k, send.p, s);
          cuda::moe::ep_gather_col_scales(q_sc.p, nc, 4, rmu.p, T, k, send_sc.p, s);
          break;
        case WireFormat::kMxfp4:
          cuda::moe::ep_gather_rows(q_codes.p, H / 2, false, rmu.p, T, k, send.p, s);
          cuda::moe::ep_gather_rows(q_sc.p, H / 32, false, rmu.p, T, k, send_sc.p, s);
          break;
      }
    };
    auto quantize = [&] {
      if (f == WireFormat::kFp8) cuda::quantize_row(x.p, T, H, q_codes.p, q_sc.p, nullptr, s);
      if (f == WireFormat::kFp8Fp32Scale)
        cuda::quantize_row_fp32_scale(x.p, T, H, nullptr, E, q_codes.p, reinterpret_cast<float*>(q_sc.p), nullptr, s);
      if (f == WireFormat::kMxfp4) cuda::quantize_mxfp4(x.p, T, H, q_codes.p, q_sc.p, nullptr, s);
    };
    auto after = [&](bool with_quant) {
      if (f == WireFormat::kFp8) cuda::moe::ep_transpose_scales(recv_sc.p, Mp, nc, 1, relaid.p, Mp, s);
      if (f == WireFormat::kFp8Fp32Scale) {
        cuda::moe::ep_transpose_scales(recv_sc.p, Mp, nc, 4, relaid.p, Mp, s);
        if (with_quant)
          cuda::dequantize_row_fp32_scale(recv.p, reinterpret_cast<const float*>(relaid.p), Mp, H, nullptr, El,
                                          deq.p, s);
      }
    };
    quantize();
    gather();
    BCUDA(cudaStreamSynchronize(s));
    const auto ex = time_op(comm, s, o.warmup, o.reps, [&] { dispatch_rows(comm, plan, streams); });
    const auto disp = time_op(comm, s, o.warmup, o.reps, [&] {
      gather();
      dispatch_rows(comm, plan, streams);
      after(false);
    });
    std::pair<double, double> withq{0, 0};
    if (fm.quant)
      withq = time_op(comm, s, o.warmup, o.reps, [&] {
        quantize();
        gather();
        dispatch_rows(comm, plan, streams);
        after(true);
      });
    const double gbs = 1e-6;  // bytes / ms -> GB/s
    if (me == 0) {
      const double bpe = rows_out ? double(wire) / double(rows_out) / double(H) : 0.0;
      char q1[64] = "-", q2[64] = "-";
      if (fm.quant) {
        std::snprintf(q1, sizeof q1, "%.3f (%.3f)", withq.first, withq.second);
        std::snprintf(q2, sizeof q2, "%.1f", double(wire) / withq.first * gbs);
      }
      std::printf("| %s | %.4f | %.4f | %.0f | %.3f (%.3f) | %.1f | %.3f (%.3f) | %.1f | %s | %s |\n",
                  wire_format_name(f), bpe, wire_bytes_per_element(f, H), T ? double(wire) / double(T) : 0.0,
                  ex.first, ex.second, double(wire) / ex.first * gbs, disp.first, disp.second,
                  double(wire) / disp.first * gbs, q1, q2);
    }
  }
  // combine: BF16 rows [Mp, H] back to send order, then the sum over slots (unpermute with probs)
  plan.format = WireFormat::kBf16;
  const int64_t cwire = rows_in * 2 * H;
  const std::vector<RowStream> back = {{recv.p, send.p, 2 * H}};
  cuda::Routing rt1 = rt;  // unpermute over the send routing (align 1)
  const auto cex = time_op(comm, s, o.warmup, o.reps, [&] { combine_rows(comm, plan, back); });
  const auto call = time_op(comm, s, o.warmup, o.reps, [&] {
    combine_rows(comm, plan, back);
    cuda::unpermute(reinterpret_cast<const bf16_t*>(send.p), probs.p, H, rt1, y.p, s);
  });
  if (me == 0) {
    std::printf("| combine bf16 (exchange) | 2.0000 | 2.0000 | %.0f | %.3f (%.3f) | %.1f | - | - | - | - |\n",
                T ? double(cwire) / double(T) : 0.0, cex.first, cex.second, double(cwire) / cex.first * 1e-6);
    std::printf("| combine bf16 + unpermute | 2.0000 | 2.0000 | %.0f | - | - | %.3f (%.3f) | %.1f | - | - |\n",
                T ? double(cwire) / double(T) : 0.0, call.first, call.second, double(cwire) / call.first * 1e-6);
    std::printf("\n(ms: rank 0's median, in parentheses the slowest rank's median; GB/s: rank 0's bytes to other "
                "ranks / rank 0's median; 'expected' = wire_bytes_per_element of the format: 2, 1 + 1/128, "
                "1 + 4/128 (the issue's 'about 1.03'), 0.5 + 1/32 (0.53); probabilities not included: the layer "
                "adds 4 B per row)\n");
    std::fflush(stdout);
  }
}

// ---- 2. the layer ---------------------------------------------------------------------------------------
struct LayerTime {
  double fwd = 0, bwd = 0, total = 0, total_max = 0;
  int64_t routed = 0, padded = 0, wire_fwd = 0, wire_bwd = 0;
  std::vector<std::pair<std::string, double>> stages;  // "pass/stage", median ms (--stages)
  double layer_gib = 0;     // the layer's own device memory (allocated_bytes)
  double device_gib = 0;    // device memory in use after the timed steps (cudaMemGetInfo: the
                            // layer, its inputs, weights and gradients, NCCL and its scratch)
};

// One layer (comm may be null) with `el` local experts of E = el * world experts, T tokens.
LayerTime run_layer(Communicator* comm, const Cfg& c, Recipe rc, int el, int64_t T, const Opts& o,
                    cudaStream_t s, int seed_rank) {
  const int W = comm ? comm->world_size() : 1;
  const int E = el * W;
  const int64_t H = c.hidden, F = c.ffn;
  MoeConfig cfg;
  cfg.hidden = H;
  cfg.ffn = F;
  cfg.num_experts = E;
  cfg.topk = c.topk;
  cfg.router = c.score;
  cfg.router_renormalize = c.renorm;
  cfg.router_scale = c.scale;
  cfg.align = o.align;
  cfg.recipe = rc;
  cfg.max_tokens = T;
  cfg.comm = comm;
  Buf<float> w1(el * 2 * F * H), w2(el * H * F), wr(int64_t(E) * H), dw1(el * 2 * F * H), dw2(el * H * F),
      dwr(int64_t(E) * H);
  Buf<bf16_t> x(T * H), dy(T * H), y(T * H), dx(T * H);
  cuda::moe::fill_normal_f32(w1.p, el * 2 * F * H, 11 + 100 * seed_rank, float(1.0 / std::sqrt(double(H))), s);
  cuda::moe::fill_normal_f32(w2.p, el * H * F, 12 + 100 * seed_rank, float(1.0 / std::sqrt(double(F))), s);
  cuda::moe::fill_normal_f32(wr.p, int64_t(E) * H, 13, float(1.0 / std::sqrt(double(H))), s);  // replicated
  cuda::moe::fill_normal_bf16(x.p, T * H, 14 + 100 * seed_rank, 1.0f, s);
  cuda::moe::fill_normal_bf16(dy.p, T * H, 15 + 100 * seed_rank, 1.0f, s);
  BCUDA(cudaMemsetAsync(dw1.p, 0, sizeof(float) * el * 2 * F * H, s));
  BCUDA(cudaMemsetAsync(dw2.p, 0, sizeof(float) * el * H * F, s));
  BCUDA(cudaMemsetAsync(dwr.p, 0, sizeof(float) * E * H, s));
  BCUDA(cudaStreamSynchronize(s));
  std::unique_ptr<MoeLayer> layer = make_cuda_layer(cfg, s, bench::layer_options_from_env());
  layer->set_weights(MoeWeights{w1.p, w2.p, wr.p, nullptr});
  const MoeGrads g{dw1.p, dw2.p, dwr.p};
  const bench::PhaseTimes pt = bench::time_phases(
      {[&] { layer->forward(x.p, T, y.p); }, [&] { layer->backward(dy.p, dx.p, g); }}, o.warmup, o.reps, s,
      [&] {
        if (comm) comm->barrier();
      });
  LayerTime r;
  {
    size_t free_b = 0, total_b = 0;
    BCUDA(cudaMemGetInfo(&free_b, &total_b));
    r.device_gib = double(total_b - free_b) / double(1ull << 30);
    r.layer_gib = double(cuda::moe::allocated_bytes(layer.get())) / double(1ull << 30);
  }
  if (o.stages) {  // the layer's own stage events (flowmoe/cuda/moe_debug.h), medians of 3 profiled steps
    cuda::moe::set_profiling(layer.get(), true);
    std::vector<std::vector<double>> acc;
    for (int i = 0; i < 3; ++i) {
      if (comm) comm->barrier();
      layer->forward(x.p, T, y.p);
      layer->backward(dy.p, dx.p, g);
      const std::vector<cuda::moe::StageTime> st = cuda::moe::stage_times(layer.get());
      if (i == 0) {
        for (const auto& x2 : st) r.stages.push_back({std::string(moe_pass_name(x2.pass)) + "/" + x2.name, 0.0});
        acc.resize(st.size());
      }
      for (size_t j = 0; j < st.size() && j < acc.size(); ++j) acc[j].push_back(st[j].ms);
    }
    for (size_t j = 0; j < r.stages.size(); ++j) r.stages[j].second = median(acc[j]);
    cuda::moe::set_profiling(layer.get(), false);
  }
  r.fwd = median(pt.ms[0]);
  r.bwd = median(pt.ms[1]);
  r.total = median(pt.total_ms);
  r.total_max = comm ? max_over_ranks(*comm, r.total) : r.total;
  const CastReport& rep = layer->cast_report();
  r.routed = rep.routed_rows;
  r.padded = rep.padded_rows;
  for (const WireTransfer& w : rep.wire) (w.pass == MoePass::kForward ? r.wire_fwd : r.wire_bwd) += w.bytes;
  FLOWMOE_CHECK(layer->status().nonfinite == 0, "non-finite values in the layer");
  layer.reset();
  BCUDA(cudaStreamSynchronize(s));
  return r;
}

void bench_layer(Communicator& comm, cudaStream_t s, const Cfg& c, const Opts& o) {
  const int W = comm.world_size(), me = comm.rank();
  const int El = local_experts(c, o, W);
  const int64_t T = o.tokens;
  std::vector<Recipe> recipes;
  for (const std::string& n : split(o.recipes)) {
    Recipe r = Recipe::kBf16;
    FLOWMOE_CHECK(try_parse_recipe(n, &r), "--recipes: unknown recipe '" << n << "'");
    recipes.push_back(r);
  }
  if (me == 0) {
    std::printf("\n### layer forward + backward, %s: H %lld, F %lld, top-%d; EP = %d: %d experts per GPU, %d in all, "
                "T %lld per GPU\n",
                c.name, static_cast<long long>(c.hidden), static_cast<long long>(c.ffn), c.topk, W, El, El * W,
                static_cast<long long>(T));
    std::printf("\n| recipe | EP fwd ms | EP bwd ms | EP fwd+bwd ms (slowest rank) | EP tokens/s per GPU | EP tokens/s "
                "all GPUs | wire B/token fwd / bwd | 1 GPU share ms (%d exp, T %lld) | EP efficiency | 1 GPU all ms "
                "(%d exp, T %lld) | EP speed-up | layer GiB / GPU in use GiB (rank 0) |\n",
                El, static_cast<long long>(T), El * W, static_cast<long long>(W * T));
    std::printf("| --- | --- | --- | --- | --- | --- | --- | --- | --- | --- | --- | --- |\n");
    std::fflush(stdout);
  }
  std::string stage_text;
  for (Recipe rc : recipes) {
    const LayerTime ep = run_layer(&comm, c, rc, El, T, o, s, me);
    LayerTime share, all;
    bool all_fits = true;
    if (o.single) {
      // every rank runs the single-GPU layers on its own GPU at the same time (no communication)
      share = run_layer(nullptr, c, rc, El, T, o, s, me);
      // The whole group's problem on one GPU is the speed-up's reference; from EP = 4 on it may
      // not fit in one GPU's memory (DeepSeek-V3, 256 experts, 16384 tokens, blockwise: > 139 GB
      // with this benchmark's buffers). Then the row says so and the run goes on; any other
      // failure still stops it.
      try {
        all = run_layer(nullptr, c, rc, El * W, W * T, o, s, me);
      } catch (const Error& e) {
        const std::string m = e.what();
        if (m.find("out of memory") == std::string::npos) throw;
        cudaGetLastError();  // clear the allocation failure
        all_fits = false;
        if (me == 0) std::fprintf(stderr, "flowmoe bench-ep: '1 GPU all' reference of %s skipped: %s\n", recipe_name(rc), e.what());
      }
      comm.barrier();
    }
    if (me == 0) {
      char sh[64] = "-", eff[32] = "-", al[64] = "-", sp[32] = "-";
      if (o.single) {
        std::snprintf(sh, sizeof sh, "%.2f", share.total);
        std::snprintf(eff, sizeof eff, "%.0f%%", 100.0 * share.total / ep.total_max);
        if (all_fits) {
          std::snprintf(al, sizeof al, "%.2f", all.total);
          std::snprintf(sp, sizeof sp, "%.2fx", all.total / ep.total_max);
        } else {
          std::snprintf(al, sizeof al, "does not fit");
        }
      }
      std::printf("| %s | %.2f | %.2f | %.2f (%.2f) | %.0f | %.0f | %.0f / %.0f | %s | %s | %s | %s | %.2f / %.2f |\n",
                  recipe_name(rc), ep.fwd, ep.bwd, ep.total, ep.total_max, double(T) / (ep.total_max * 1e-3),
                  double(W * T) / (ep.total_max * 1e-3), double(ep.wire_fwd) / double(T),
                  double(ep.wire_bwd) / double(T), sh, eff, al, sp, ep.layer_gib, ep.device_gib);
      std::fflush(stdout);
      if (o.stages) {
        std::ostringstream os;
        os << "\n#### stages of " << recipe_name(rc) << " (rank 0; medians of 3 profiled steps; ms)\n\n"
           << "| stage | EP | 1 GPU share |\n| --- | --- | --- |\n";
        for (const auto& st : ep.stages) {
          double sv = -1;
          for (const auto& q : share.stages)
            if (q.first == st.first) sv = q.second;
          char b[64] = "-";
          if (sv >= 0) std::snprintf(b, sizeof b, "%.3f", sv);
          char e[32];
          std::snprintf(e, sizeof e, "%.3f", st.second);
          os << "| " << st.first << " | " << e << " | " << b << " |\n";
        }
        stage_text += os.str();
      }
    }
  }
  if (me == 0 && !stage_text.empty()) std::printf("%s", stage_text.c_str());
  if (me == 0)
    std::printf("\n(EP efficiency = 1 GPU share / EP slowest rank: 100%% = communication and EP overheads cost "
                "nothing; EP speed-up = 1 GPU all / EP slowest rank, ideal %d; tokens/s from the slowest rank's "
                "median; wire B/token = bytes this rank sent to other ranks per token, probabilities and dprobs "
                "included)\n",
                W);
}

int run(int argc, char** argv) {
  Opts o;
  for (int i = 1; i < argc; ++i) {
    const std::string a = argv[i];
    auto val = [&]() -> std::string {
      FLOWMOE_CHECK(i + 1 < argc, a << " needs a value");
      return argv[++i];
    };
    if (a == "--config") o.configs = val();
    else if (a == "--tokens") o.tokens = std::atoll(val().c_str());
    else if (a == "--recipes") o.recipes = val();
    else if (a == "--reps") o.reps = std::atoi(val().c_str());
    else if (a == "--warmup") o.warmup = std::atoi(val().c_str());
    else if (a == "--align") o.align = std::atoi(val().c_str());
    else if (a == "--experts-total") o.experts_total = std::atoi(val().c_str());
    else if (a == "--comm-timeout") o.timeout = std::atof(val().c_str());
    else if (a == "--no-layer") o.layer = false;
    else if (a == "--no-single") o.single = false;
    else if (a == "--no-comm") o.comm = false;
    else if (a == "--stages") o.stages = true;
    else FLOWMOE_CHECK(false, "unknown argument '" << a << "' (see `flowmoe bench-ep --help`)");
  }
  FLOWMOE_CHECK(o.tokens >= 1 && o.reps >= 1 && o.warmup >= 0, "bad --tokens/--reps/--warmup");
  FLOWMOE_CHECK(o.experts_total >= 0, "--experts-total " << o.experts_total << ": expected a positive expert count");
  std::vector<const Cfg*> cfgs;
  for (const std::string& n : split(o.configs)) {
    const Cfg* f = nullptr;
    for (const Cfg& c : kCfgs)
      if (n == c.name || n == "all") f = &c;
    FLOWMOE_CHECK(f, "--config: '" << n << "' is not one of v3-ep8|v3-ep32|v2|v2-lite");
    if (n == "all") {
      for (const Cfg& c : kCfgs) cfgs.push_back(&c);
    } else {
      cfgs.push_back(f);
    }
  }
  const BootstrapEnv env = bootstrap_env_from_environment();
  BCUDA(cudaSetDevice(env.local_rank));
  cudaStream_t s;
  BCUDA(cudaStreamCreateWithFlags(&s, cudaStreamNonBlocking));
  NcclCommOptions no;
  no.timeout_s = std::max(o.timeout, 30.0);
  std::unique_ptr<Communicator> comm = make_nccl_comm_from_env(no);
  comm->set_timeout_s(o.timeout);
  if (comm->rank() == 0) {
    cudaDeviceProp prop{};
    BCUDA(cudaGetDeviceProperties(&prop, env.local_rank));
    std::printf("# flowmoe bench-ep: %d ranks (one per GPU, NCCL), rank 0 on %s; T = %lld tokens per GPU, "
                "%d warm-up + %d timed repetitions (medians), align %d; NCCL_NVLS_ENABLE=%s\n",
                comm->world_size(), prop.name, static_cast<long long>(o.tokens), o.warmup, o.reps, o.align,
                std::getenv("NCCL_NVLS_ENABLE") ? std::getenv("NCCL_NVLS_ENABLE") : "(unset)");
    std::fflush(stdout);
  }
  for (const Cfg* c : cfgs) {
    // dispatch / combine: exchanges on s, ordered with the timed gathers and relayouts; the layer:
    // the communicator's own high-priority stream (as users get by default), so that the
    // backward's combine can overlap GEMM1 wgrad
    if (o.comm) {
      set_nccl_stream(*comm, s);
      bench_comm(*comm, s, *c, o);
      set_nccl_stream(*comm, nullptr);
    }
    if (o.layer) bench_layer(*comm, s, *c, o);
  }
  comm->barrier();
  comm.reset();
  cudaStreamDestroy(s);
  return 0;
}

}  // namespace
}  // namespace flowmoe

int main(int argc, char** argv) {
  ::setenv("NCCL_NVLS_ENABLE", "0", 1);  // NVLink multicast must stay off
  try {
    return flowmoe::run(argc, argv);
  } catch (const std::exception& e) {
    std::fprintf(stderr, "flowmoe_bench_ep rank %s: %s\n", std::getenv("RANK") ? std::getenv("RANK") : "?", e.what());
    return 1;
  }
}
