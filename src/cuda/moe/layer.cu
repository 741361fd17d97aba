// The MoE layer on the GPU (include/flowmoe/moe.h, make_cuda_layer; docs/MOE_GPU.md): the five
// recipes of SPEC §6 built from the CUDA operators (convert.h, token.h, swiglu.h, gemm.h) and the
// layer's own kernels (kernels.cuh), with the dataflow of the CPU backend (src/cpu/moe_cpu.cpp)
// step for step, so the two can be compared on the same inputs.
//
// Expert parallelism (cfg.comm, a device-memory communicator; docs/EP.md §6): the token movement
// becomes dispatch / combine (the CPU layer's plan and wire formats), the experts are the El local
// ones; see route(), the "token movement" helpers and backward_router().
//
// Memory: every buffer is allocated in the constructor for cfg.max_tokens, rows sized by the
// host-side bound R = routing_max_rows(max_tokens, k, E, A) (scale grids and column copies use the
// real padded row count Mp as their leading dimension inside those buffers). set_weights converts
// and quantizes into buffers allocated there too; forward and backward allocate nothing.
//
// Synchronisation: one per forward (the per-expert padded counts, which the grouped GEMM's
// per-expert launches need on the host, fetched right after routing: fetch_routing_counts);
// backward reuses them and does not synchronise. set_weights synchronises once (non-finite check
// of the masters). cast_report() and status() synchronise to read the device counters.
#include <cuda_runtime.h>

#include <algorithm>
#include <cstring>
#include <exception>
#include <memory>
#include <cstdlib>
#include <string>
#include <vector>

#include "flowmoe/cuda/copy_pieces.h"
#include "cuda/common.cuh"
#include "cuda/moe/kernels.cuh"
#include "cuda/moe/moe_cuda.h"
#include "flowmoe/cuda/convert.h"
#include "common/moe_ep.h"
#include "flowmoe/comm.h"
#include "flowmoe/error.h"
#include "flowmoe/gemm.h"
#include "flowmoe/moe.h"
#include "flowmoe/swiglu.h"
#include "flowmoe/token.h"

namespace flowmoe {
namespace cuda {
namespace moe {
namespace {

// FLOWMOE_EP_DEDUP=0 turns the deduplicated dispatch off (every (token, expert) row travels, as
// the CPU layer's reference exchange); anything else or unset: on. Read once per layer; part of
// the configuration every rank must agree on (make_cuda_layer checks it).
bool ep_dedup_from_env() {
  const char* v = std::getenv("FLOWMOE_EP_DEDUP");
  return !(v && std::string(v) == "0");
}
// FLOWMOE_EP_COMBINE_CHUNKS: the forward's GEMM2 runs in this many chunks of local experts, each
// chunk's rows sent back while the next computes (1: one GEMM2, then one combine). Default 1:
// measured on two H200s with 4 chunks, the exposed combine drops (V3 flow 2.12 -> 1.34 ms) but the
// GEMM2 chunks, sharing SMs with NCCL and filling the GEMM pool less, take as much longer
// (1.90 -> 2.27 ms): bf16 V3 -3.6 %, flow V3 +0.6 %, flow V2 -2 %, flow V2-Lite +5 %.
constexpr int kMaxCombineChunks = 16;
int ep_combine_chunks_from_env() {
  const char* v = std::getenv("FLOWMOE_EP_COMBINE_CHUNKS");
  if (v == nullptr || *v == '\0') return 1;
  char* end = nullptr;
  const long n = std::strtol(v, &end, 10);
  FLOWMOE_CHECK(end != v && *end == '\0' && n >= 1 && n <= kMaxCombineChunks,
                "FLOWMOE_EP_COMBINE_CHUNKS='" << v << "'; expected 1.." << kMaxCombineChunks);
  return int(n);
}

constexpr int kStatusFwd = 0, kStatusFwdAux = 1, kStatusBwd = 2, kStatusBwdAux = 3;
constexpr int kEventPool = 256;

void drop_ops(CastReport* rep, MoePass p) {
  rep->ops.erase(std::remove_if(rep->ops.begin(), rep->ops.end(),
                                [p](const CastOp& op) { return op.pass == p; }),
                 rep->ops.end());
}

// Row-wise FP8 operand: codes [rows, C] + UE8M0 scales [C/128][Mp].
struct Fp8Buf {
  uint8_t* codes = nullptr;
  uint8_t* scales = nullptr;
};
// FP8 with FP32 scales (fp8-naive): codes + GEMM-ready FP32 scales.
struct F32sBuf {
  uint8_t* codes = nullptr;
  float* scales = nullptr;
};

class CudaMoeLayer final : public MoeLayer {
 public:
  CudaMoeLayer(const MoeConfig& cfg, cudaStream_t stream)
      : MoeLayer(cfg), stream_(stream), E_(cfg.num_experts), H_(cfg.hidden), F_(cfg.ffn),
        K_(cfg.topk), El_(cfg.num_local_experts()), comm_(cfg.comm), Tm_(cfg.max_tokens),
        R_(cfg.max_rows()), MB_(segment_max_blocks(cfg.max_rows(), cfg.num_local_experts())) {
    int ndev = 0;
    const cudaError_t err = cudaGetDeviceCount(&ndev);
    FLOWMOE_CHECK(err == cudaSuccess && ndev > 0,
                  "make_cuda_layer: no CUDA device is available ("
                      << (err == cudaSuccess ? "0 devices" : cudaGetErrorString(err))
                      << "); expected a Hopper GPU (sm_90). Use make_cpu_layer without one");
    rep_.recipe = cfg.recipe;
    try {
      allocate();
    } catch (...) {
      release();
      throw;
    }
  }
  ~CudaMoeLayer() override { release(); }

  const char* backend() const override { return "cuda"; }

  // ---- weights ---------------------------------------------------------------------------------
  void set_weights(const MoeWeights& w) override {
    const char* what = "MoeLayer::set_weights";
    FLOWMOE_CHECK(w.w1 && w.w2 && w.wr,
                  what << ": w1, w2 and wr must be non-null device pointers (W1 [El, 2F, H], W2 "
                          "[El, H, F] of the El = "
                       << El_ << " local experts, Wr [E, H] fp32)");
    const int64_t n1 = int64_t(El_) * 2 * F_ * H_, n2 = int64_t(El_) * H_ * F_;
    FLOWMOE_CUDA_CHECK(cudaMemsetAsync(wstatus_, 0, sizeof(DeviceStatus), stream_));
    f32_to_bf16(w.w1, n1, w1b_, wstatus_, stream_);
    f32_to_bf16(w.w2, n2, w2b_, wstatus_, stream_);
    f32_to_bf16(w.wr, int64_t(E_) * H_, scratch_bf16_wr_, wstatus_, stream_);  // finite check of Wr
    FLOWMOE_CUDA_CHECK(cudaMemcpyAsync(wr_, w.wr, sizeof(float) * E_ * H_, cudaMemcpyDeviceToDevice, stream_));
    has_bias_ = w.router_bias != nullptr;
    if (has_bias_)
      FLOWMOE_CUDA_CHECK(cudaMemcpyAsync(bias_, w.router_bias, sizeof(float) * E_,
                                         cudaMemcpyDeviceToDevice, stream_));
    DeviceStatus st{};
    FLOWMOE_CUDA_CHECK(cudaMemcpyAsync(&st, wstatus_, sizeof st, cudaMemcpyDeviceToHost, stream_));
    FLOWMOE_CUDA_CHECK(cudaStreamSynchronize(stream_));
    if (st.nonfinite)
      throw NonFiniteError(__FILE__, __LINE__,
                           std::string(what) + ": the weights hold " + std::to_string(st.nonfinite) +
                               " non-finite value(s); expected finite W1, W2 and Wr");

    drop_ops(&rep_, MoePass::kWeightUpdate);
    const Recipe rc = cfg_.recipe;
    if (rc == Recipe::kBlockwise || rc == Recipe::kFlow || rc == Recipe::kFlowFp4) {
      const int64_t s1 = (2 * F_ / 128) * (H_ / 128), s2 = (H_ / 128) * (F_ / 128);
      for (int e = 0; e < El_; ++e) {
        quantize_weight(w1b_ + e * 2 * F_ * H_, 2 * F_, H_, w1_.codes + e * 2 * F_ * H_,
                        w1s8_ + e * s1, w1t_.codes + e * 2 * F_ * H_, w1ts8_ + e * s1, wstatus_,
                        stream_);
        quantize_weight(w2b_ + e * H_ * F_, H_, F_, w2_.codes + e * H_ * F_, w2s8_ + e * s2,
                        w2t_.codes + e * H_ * F_, w2ts8_ + e * s2, wstatus_, stream_);
      }
      weight_scales_to_f32(w1s8_, El_, 2 * F_, H_, w1_.scales, stream_);
      weight_scales_to_f32(w1ts8_, El_, H_, 2 * F_, w1t_.scales, stream_);
      weight_scales_to_f32(w2s8_, El_, H_, F_, w2_.scales, stream_);
      weight_scales_to_f32(w2ts8_, El_, F_, H_, w2t_.scales, stream_);
      log(MoePass::kWeightUpdate, CastKind::kQuantize, "quantize W1 (128x128 + exact transpose)", El_,
          2 * El_, n1);
      log(MoePass::kWeightUpdate, CastKind::kQuantize, "quantize W2 (128x128 + exact transpose)", El_,
          2 * El_, n2);
    } else if (rc == Recipe::kFp8Naive) {
      naive_quantize_weights(w1b_, El_, 2 * F_, H_, w1_.codes, w1_.scales, w1t_.codes, w1t_.scales,
                             wstatus_, stream_);
      naive_quantize_weights(w2b_, El_, H_, F_, w2_.codes, w2_.scales, w2t_.codes, w2t_.scales,
                             wstatus_, stream_);
      log(MoePass::kWeightUpdate, CastKind::kQuantize,
          "quantize W1 (128x128 FP32 scales + exact transpose)", 1, 2, n1);
      log(MoePass::kWeightUpdate, CastKind::kQuantize,
          "quantize W2 (128x128 FP32 scales + exact transpose)", 1, 2, n2);
    }
    have_weights_ = true;
    have_forward_ = false;
  }

  // ---- forward ---------------------------------------------------------------------------------
  void forward(const bf16_t* x, int64_t tokens, bf16_t* y) override {
    const char* what = "MoeLayer::forward";
    collective_checks(comm_, what, [&] {
      FLOWMOE_CHECK(have_weights_, what << ": no weights; call set_weights first");
      FLOWMOE_CHECK(tokens >= 1 && tokens <= cfg_.max_tokens,
                    what << ": T = " << tokens << " tokens; expected 1 <= T <= max_tokens = "
                         << cfg_.max_tokens);
      FLOWMOE_CHECK(x && y, what << ": x and y must be non-null device pointers to [T, H] bf16");
    });
    T_ = tokens;
    have_forward_ = false;
    drop_ops(&rep_, MoePass::kForward);
    drop_ops(&rep_, MoePass::kBackward);
    rep_.saved.clear();
    rep_.columns.clear();
    rep_.wire.clear();
    stats_valid_ = false;
    backward_done_ = false;
    stages_fwd_.clear();
    stages_bwd_.clear();
    ev_used_ = 0;
    FLOWMOE_CUDA_CHECK(cudaMemsetAsync(status_, 0, 4 * sizeof(DeviceStatus), stream_));

    route(x);
    switch (cfg_.recipe) {
      case Recipe::kBf16: forward_bf16(y); break;
      case Recipe::kBlockwise: forward_blockwise(y); break;
      case Recipe::kFp8Naive: forward_naive(y); break;
      case Recipe::kFlow:
      case Recipe::kFlowFp4: with_side_drained([&] { forward_flow(y); }); break;
    }
    save_tokens("router input x", "bf16 [T, H]", T_ * H_ * 2);
    save_tokens("router logits", "fp32 [T, E]", T_ * E_ * 4);
    save_tokens("expert ids + probs + row map", "int32/fp32/int32 [T, k]", T_ * K_ * 12);
    have_forward_ = true;
  }

  // ---- backward --------------------------------------------------------------------------------
  void backward(const bf16_t* dy, bf16_t* dx, const MoeGrads& g) override {
    const char* what = "MoeLayer::backward";
    collective_checks(comm_, what, [&] {
      FLOWMOE_CHECK(have_forward_, what << ": no saved forward; call forward first (backward "
                                           "consumes the activations of the latest forward)");
      FLOWMOE_CHECK(dy && dx, what << ": dy and dx must be non-null device pointers to [T, H] bf16");
    });
    drop_ops(&rep_, MoePass::kBackward);
    rep_.wire.erase(std::remove_if(rep_.wire.begin(), rep_.wire.end(),
                                   [](const WireTransfer& w) { return w.pass == MoePass::kBackward; }),
                    rep_.wire.end());
    stats_valid_ = false;
    stages_bwd_.clear();
    FLOWMOE_CUDA_CHECK(cudaMemsetAsync(status_ + kStatusBwd, 0, 2 * sizeof(DeviceStatus), stream_));
    grads_accumulate_ = g.accumulate;
    dx_ready_marked_ = false;  // (a backward that threw may have left it set)
    // the wgrads next to the dgrads from the second backward on (the first one runs them in
    // order, so that the GEMMs' one-time algorithm timing is not disturbed by concurrent work)
    wconc_ = wstream_ != nullptr && backwards_ > 0;
    ++backwards_;
    switch (cfg_.recipe) {
      case Recipe::kBf16: with_side_drained([&] { backward_bf16(dy, g); }); break;
      case Recipe::kBlockwise: with_side_drained([&] { backward_blockwise(dy, g); }); break;
      case Recipe::kFp8Naive: backward_naive(dy, g); break;
      case Recipe::kFlow:
      case Recipe::kFlowFp4: with_side_drained([&] { backward_flow(dy, g); }); break;
    }
    if (tail_) {  // the tail stream joins stream_ even when the tail throws (stream-ordered, so
                  // that a graph capture stays well-formed; errors of the join itself ignored)
      try {
        backward_router(g, dx);
      } catch (...) {
        if (cudaEventRecord(ev_tail_, tail_) == cudaSuccess) cudaStreamWaitEvent(stream_, ev_tail_, 0);
        throw;
      }
    } else {
      backward_router(g, dx);
    }
    backward_done_ = true;
  }

  const CastReport& cast_report() const override {
    read_status();
    return rep_;
  }
  MoeStatus status() const override {
    read_status();
    return mstatus_;
  }

  // ---- internal interface (moe_cuda.h) -----------------------------------------------------------
  void set_profiling(bool on) { profiling_ = on; }
  std::vector<StageTime> stage_times() const {
    std::vector<StageTime> out;
    if (stages_fwd_.empty() && stages_bwd_.empty()) return out;
    FLOWMOE_CUDA_CHECK(cudaStreamSynchronize(stream_));
    for (const auto* list : {&stages_fwd_, &stages_bwd_})
      for (const Stage& s : *list) {
        StageTime t;
        t.pass = s.pass;
        t.name = s.name;
        FLOWMOE_CUDA_CHECK(cudaEventElapsedTime(&t.ms, events_[s.ev0], events_[s.ev1]));
        out.push_back(t);
      }
    return out;
  }
  size_t allocated_bytes() const { return allocated_ + gg_workspace_; }
  LayerCounters counters() const {
    LayerCounters c;
    c.host_syncs = host_syncs_;
    c.gemm_matmuls = (gg_ ? gg_->stats().matmuls : 0) + (gw_ ? gw_->stats().matmuls : 0);
    return c;
  }

 private:
  // ---- allocation ------------------------------------------------------------------------------
  template <typename T>
  T* dalloc(int64_t n) {
    if (n <= 0) n = 1;
    void* p = nullptr;
    const size_t bytes = (size_t(n) * sizeof(T) + 255) / 256 * 256;
    const cudaError_t err = cudaMalloc(&p, bytes);
    FLOWMOE_CHECK(err == cudaSuccess, "make_cuda_layer: cudaMalloc of " << bytes << " bytes failed ("
                                          << cudaGetErrorString(err) << ") for "
                                          << cfg_.describe() << ", max_tokens = " << cfg_.max_tokens
                                          << "; " << allocated_ << " bytes allocated before it");
    allocs_.push_back(p);
    allocated_ += bytes;
    return static_cast<T*>(p);
  }

  // Device tables of a routing of up to `tokens` tokens (k = K_) over `experts` experts; tokens
  // is set per call (0 here). row_src / row_map_unpadded only where asked for.
  Routing alloc_routing(int64_t tokens, int experts, int align, bool row_src, bool unpadded) {
    Routing r;
    r.tokens = 0;
    r.topk = K_;
    r.num_experts = experts;
    r.align = align;
    r.counts = dalloc<int32_t>(experts);
    r.offsets = dalloc<int32_t>(experts + 1);
    r.padded_offsets = dalloc<int32_t>(experts + 1);
    r.row_map = dalloc<int32_t>(tokens * K_);
    if (row_src) r.row_src = dalloc<int32_t>(routing_max_rows(tokens, K_, experts, align));
    if (unpadded) r.row_map_unpadded = dalloc<int32_t>(tokens * K_);
    r.workspace = dalloc<uint8_t>(int64_t(routing_workspace_bytes(tokens, K_, experts)));
    return r;
  }

  void allocate() {
    const int64_t R = R_, Tm = Tm_, H = H_, F = F_, E = E_, El = El_, K = K_, MB = MB_;
    dedup_ = comm_ != nullptr && cfg_.recipe != Recipe::kFp8Naive && ep_dedup_from_env();
    if (comm_) {  // agreed across ranks by make_cuda_layer
      direct_bytes_ = ep_direct_bytes_from_settings(env_lookup());
      combine_chunks_ = ep_combine_chunks_from_env();
    }
    const int64_t maxC = std::max(H, 2 * F);
    const Recipe rc = cfg_.recipe;
    const bool pow2 = rc == Recipe::kBlockwise || rc == Recipe::kFlow || rc == Recipe::kFlowFp4;
    const bool fp8 = rc != Recipe::kBf16;

    // routing state (every recipe)
    x_ = dalloc<bf16_t>(Tm * H);
    logits_ = dalloc<float>(Tm * E);
    dlogits_ = dalloc<float>(Tm * E);
    ids_ = dalloc<int32_t>(Tm * K);
    probs_ = dalloc<float>(Tm * K);
    dprobs_ = dalloc<float>(Tm * K);
    // inverse row map (coalesced FP8 scale permute) only without a communicator: the EP path does
    // not permute its own tokens locally. EP: the send order of the dispatch is the unpadded
    // routing (rows by global expert, then (token, slot)): the send-side gathers use
    // row_map_unpadded.
    routing_ = alloc_routing(Tm, E_, cfg_.align, /*row_src=*/!comm_, /*unpadded=*/comm_ != nullptr);
    if (cfg_.aux_loss_alpha > 0.0f) {
      aux_ws_ = dalloc<uint8_t>(int64_t(router_aux_workspace_bytes(Tm, E_)));
      aux_coef_ = dalloc<float>(E);
    }
    loss_ = dalloc<float>(1);
    prow_ = dalloc<float>(R);
    dpart_ = dalloc<float>(R * (F_ / 128));
    bstart_ = dalloc<int32_t>(MB);
    bend_ = dalloc<int32_t>(MB);
    boff_ = dalloc<int32_t>(E + 1);
    status_ = dalloc<DeviceStatus>(4);
    wstatus_ = dalloc<DeviceStatus>(1);
    FLOWMOE_CUDA_CHECK(cudaMallocHost(&h_counts_, sizeof(int32_t) * E));
    FLOWMOE_CUDA_CHECK(cudaMallocHost(&h_status_, sizeof(DeviceStatus) * 4));
    FLOWMOE_CUDA_CHECK(cudaMallocHost(&h_loss_, sizeof(float)));
    if (comm_) {
      // Expert parallelism, worst case: this rank sends at most T*k rows (Tm*k here) and its El
      // experts receive at most R = max_rows() = routing_max_rows(ranks * Tm, k, El, A) padded rows
      // (every rank routing every slot here), which is what the expert buffers below are sized
      // for. The send buffer holds the widest row (BF16, 2H bytes); the combines come back into it.
      const int64_t nc = H / 128;
      d_loff_ = dalloc<int32_t>(El + 1);
      FLOWMOE_CUDA_CHECK(cudaMallocHost(&h_loff_, sizeof(int32_t) * (El + 1)));
      ep_send_ = dalloc<uint8_t>(Tm * K * 2 * H);
      ep_send_sc_ = dalloc<uint8_t>(Tm * K * 4 * nc);
      ep_send_p_ = dalloc<float>(Tm * K);
      ep_recv_sc_ = dalloc<uint8_t>(R * 4 * nc);
      ep_dprow_ = dalloc<float>(R);
      if (dedup_) {
        // Deduplicated dispatch: a token goes once to each rank holding one of its experts. Send
        // side: peer ids [Tm, k] and their routing over the W ranks (token order per rank); the
        // token rows go through ep_send_ / ep_send_sc_ (at most min(W, k) * Tm rows), the ids and
        // probs rows (k each) through dd_send_ids_ / dd_send_p_. Receive side: at most W * Tm
        // tokens: codes, row-major scales, their column relayout, ids, probs, and the routing of
        // the received tokens over the El local experts (it reproduces the plan's padded layout).
        const int W = comm_->world_size();
        const int64_t Wt = int64_t(W) * Tm;
        dd_peer_ids_ = dalloc<int32_t>(Tm * K);
        prt_ = alloc_routing(Tm, W, 1, false, false);
        FLOWMOE_CUDA_CHECK(cudaMallocHost(&h_tok_, sizeof(int32_t) * W));
        dd_send_ids_ = dalloc<int32_t>(Tm * K * K);
        dd_send_p_ = dalloc<float>(Tm * K * K);
        dd_recv_ = dalloc<uint8_t>(Wt * 2 * H);
        dd_recv_sc_ = dalloc<uint8_t>(Wt * (H / 32));  // FP8: H/128 bytes per row; MXFP4: H/32
        dd_recv_scc_ = dalloc<uint8_t>(Wt * nc);
        dd_recv_ids_ = dalloc<int32_t>(Wt * K);
        dd_recv_p_ = dalloc<float>(Wt * K);
        dd_local_ids_ = dalloc<int32_t>(Wt * K);
        rrt_ = alloc_routing(Wt, El_, cfg_.align, true, false);
      }
    }

    // weights
    wr_ = dalloc<float>(E * H);
    bias_ = dalloc<float>(E);
    scratch_bf16_wr_ = dalloc<bf16_t>(E * H);
    w1b_ = dalloc<bf16_t>(El * 2 * F * H);
    w2b_ = dalloc<bf16_t>(El * H * F);
    if (fp8) {
      w1_.codes = dalloc<uint8_t>(El * 2 * F * H);
      w1t_.codes = dalloc<uint8_t>(El * 2 * F * H);
      w2_.codes = dalloc<uint8_t>(El * H * F);
      w2t_.codes = dalloc<uint8_t>(El * H * F);
      w1_.scales = dalloc<float>(gemm::weight_scale_f32_elems(El_, 2 * F, H));
      w1t_.scales = dalloc<float>(gemm::weight_scale_f32_elems(El_, H, 2 * F));
      w2_.scales = dalloc<float>(gemm::weight_scale_f32_elems(El_, H, F));
      w2t_.scales = dalloc<float>(gemm::weight_scale_f32_elems(El_, F, H));
      if (pow2) {
        w1s8_ = dalloc<uint8_t>(El * (2 * F / 128) * (H / 128));
        w1ts8_ = dalloc<uint8_t>(El * (2 * F / 128) * (H / 128));
        w2s8_ = dalloc<uint8_t>(El * (H / 128) * (F / 128));
        w2ts8_ = dalloc<uint8_t>(El * (H / 128) * (F / 128));
      }
    }

    // activations (saved and scratch), per recipe
    o_ = dalloc<bf16_t>(R * H);       // GEMM2 output; backward: dY rows, then GEMM1 dgrad output
    h1_ = dalloc<bf16_t>(R * 2 * F);  // GEMM1 output (saved in bf16, blockwise, fp8-naive)
    abuf_ = dalloc<bf16_t>(R * F);    // a' in BF16 (saved in bf16); backward: da'
    if (rc == Recipe::kBf16) {
      xp_ = dalloc<bf16_t>(R * H);
      da_ = dalloc<bf16_t>(R * F);
    } else {
      da_ = abuf_;
    }
    if (rc == Recipe::kFlow || rc == Recipe::kFlowFp4)
      dh_ = h1_;  // h1 is scratch in flow (h is saved in FP8)
    else
      dh_ = dalloc<bf16_t>(R * 2 * F);
    if (fp8) {
      rowA_.codes = dalloc<uint8_t>(R * maxC);
      rowA_.scales = dalloc<uint8_t>((maxC / 128) * R);
      colA_.codes = dalloc<uint8_t>(maxC * R);
      colA_.scales = dalloc<uint8_t>(MB * maxC);
      colB_.codes = dalloc<uint8_t>(maxC * R);
      colB_.scales = dalloc<uint8_t>(MB * maxC);
      act32_ = dalloc<float>(R * maxC / 128);
      col32A_ = dalloc<float>(MB * maxC);
      col32B_ = dalloc<float>(MB * maxC);
    }
    switch (rc) {
      case Recipe::kBf16: break;
      case Recipe::kBlockwise:
        xc_.codes = dalloc<uint8_t>(H * R);
        xc_.scales = dalloc<uint8_t>(MB * H);
        ac_.codes = dalloc<uint8_t>(F * R);
        ac_.scales = dalloc<uint8_t>(MB * F);
        break;
      case Recipe::kFp8Naive:
        ent_.codes = dalloc<uint8_t>(Tm * H);
        ent32_ = dalloc<float>(Tm * H / 128);
        entb_ = dalloc<bf16_t>(Tm * H);
        xn_.codes = dalloc<uint8_t>(R * H);
        xn_.scales = dalloc<float>(R * H / 128);
        an_.codes = dalloc<uint8_t>(R * F);
        an_.scales = dalloc<float>(R * F / 128);
        work1_ = dalloc<bf16_t>(R * maxC);
        work2_ = dalloc<bf16_t>(R * maxC);
        break;
      case Recipe::kFlow:
      case Recipe::kFlowFp4:
        ent_.codes = dalloc<uint8_t>(Tm * H);
        ent8s_ = dalloc<uint8_t>((H / 128) * Tm);
        if (rc == Recipe::kFlow) {  // h saved row-wise FP8
          hr_.codes = dalloc<uint8_t>(R * 2 * F);
          hr_.scales = dalloc<uint8_t>((2 * F / 128) * R);
        } else {  // flow-fp4: h saved as MXFP4 [R, 2F/2] + [R][2F/32]
          hr_.codes = dalloc<uint8_t>(R * F);
          hr_.scales = dalloc<uint8_t>(R * (2 * F / 32));
        }
        ac_.codes = dalloc<uint8_t>(F * R);
        ac_.scales = dalloc<uint8_t>(MB * F);
        if (rc == Recipe::kFlow) {
          xr_.codes = dalloc<uint8_t>(R * H);
          xr_.scales = dalloc<uint8_t>((H / 128) * R);
        } else {
          ent4c_ = dalloc<uint8_t>(Tm * H / 2);
          ent4s_ = dalloc<uint8_t>(Tm * H / 32);
          x4c_ = dalloc<uint8_t>(R * H / 2);
          x4s_ = dalloc<uint8_t>(R * H / 32);
        }
        break;
    }

    // flow / flow-fp4: the column copies for wgrad (scaling-aware transposes, FP4RowToFP8Col) run
    // on a side stream next to the GEMMs that do not need them (FLOWMOE_LAYER_OVERLAP=0: inline)
    const char* ov = std::getenv("FLOWMOE_LAYER_OVERLAP");
    overlap_ = (rc == Recipe::kFlow || rc == Recipe::kFlowFp4) && !(ov && std::string(ov) == "0");
    // GEMM object: cuBLASLt handle, descriptors and its workspace (allocated once here); options
    // from the defaults and FLOWMOE_GEMM_TUNE / _STREAMS / _PRIORITY. With the side stream, the
    // matmuls run one priority step above it (unless FLOWMOE_GEMM_PRIORITY says otherwise), so the
    // copies fill the GEMMs' gaps instead of taking SMs from them.
    GroupedGemm::Options gopt = GroupedGemm::Options::from_settings(env_lookup());
    if (overlap_ && !std::getenv("FLOWMOE_GEMM_PRIORITY")) gopt.pool_priority = 1;
    gg_.reset(new GroupedGemm(gopt));
    gg_workspace_ = gg_->device_bytes();
    // The wgrads on their own stream next to the dgrads (bf16, blockwise, flow, flow-fp4; not the
    // fp8-naive baseline): both GEMMs of a pair read what the previous step wrote and write
    // different outputs, so they can share the GPU; the accumulating wgrads' epilogues (FP32 main
    // gradients read and written) then overlap the dgrads' math. A second GEMM object (its own
    // pool streams and workspaces; algorithm choices shared) carries them.
    // FLOWMOE_LAYER_WGRAD_OVERLAP=1 turns this on; default off: measured on the H200 (fifth
    // session, cuBLASLt wgrads) it did not pay (V3 EP8 flow 22.8 -> 24.7 ms, V2 10.0 -> 9.7,
    // V2-Lite 5.65 -> 5.55), and the sm_90a wgrad kernel takes every SM for itself.
    const char* wo = std::getenv("FLOWMOE_LAYER_WGRAD_OVERLAP");
    FLOWMOE_CHECK(!wo || std::string(wo) == "0" || std::string(wo) == "1",
                  "FLOWMOE_LAYER_WGRAD_OVERLAP=\"" << wo << "\"; expected 0 or 1");
    if (rc != Recipe::kFp8Naive && wo && std::string(wo) == "1") {
      gw_.reset(new GroupedGemm(gopt));
      gg_workspace_ += gw_->device_bytes();
      FLOWMOE_CUDA_CHECK(cudaStreamCreateWithFlags(&wstream_, cudaStreamNonBlocking));
      for (cudaEvent_t& e : wevents_) FLOWMOE_CUDA_CHECK(cudaEventCreateWithFlags(&e, cudaEventDisableTiming));
    }
    events_.resize(kEventPool);
    for (int i = 0; i < kEventPool; ++i) FLOWMOE_CUDA_CHECK(cudaEventCreate(&events_[i]));
    // One GPU: the backward's tail (router backward, dWr, dx = unpermute + router path) needs only
    // the dX rows of GEMM1 dgrad, so it runs on its own stream, above the GEMMs' priority, while
    // GEMM1 wgrad computes (FLOWMOE_LAYER_TAIL_OVERLAP=0: after it, on the caller's stream).
    const char* to = std::getenv("FLOWMOE_LAYER_TAIL_OVERLAP");
    FLOWMOE_CHECK(!to || std::string(to) == "0" || std::string(to) == "1",
                  "FLOWMOE_LAYER_TAIL_OVERLAP=\"" << to << "\"; expected 0 or 1");
    if (!comm_ && !(to && std::string(to) == "0")) {
      int least = 0, greatest = 0;
      FLOWMOE_CUDA_CHECK(cudaDeviceGetStreamPriorityRange(&least, &greatest));
      FLOWMOE_CUDA_CHECK(cudaStreamCreateWithPriority(&tail_, cudaStreamNonBlocking, greatest));
      FLOWMOE_CUDA_CHECK(cudaEventCreateWithFlags(&ev_tail_, cudaEventDisableTiming));
    }
    if (comm_ || tail_) FLOWMOE_CUDA_CHECK(cudaEventCreateWithFlags(&ev_dx_, cudaEventDisableTiming));
    if (comm_) {
      for (cudaEvent_t& e : ev_chunk_) FLOWMOE_CUDA_CHECK(cudaEventCreateWithFlags(&e, cudaEventDisableTiming));
    }
    if (overlap_) {
      FLOWMOE_CUDA_CHECK(cudaStreamCreateWithFlags(&side_, cudaStreamNonBlocking));
      for (cudaEvent_t& e : side_events_) FLOWMOE_CUDA_CHECK(cudaEventCreateWithFlags(&e, cudaEventDisableTiming));
    }
  }

  // Side-stream work: fork() makes the side stream wait for everything issued on stream_ so far and
  // returns it (stream_ itself without overlap); mark(i) records side event i on the side stream;
  // join(i) makes stream_ wait for it.
  cudaStream_t fork() {
    if (!overlap_) return stream_;
    FLOWMOE_CUDA_CHECK(cudaEventRecord(side_events_[kSideFork], stream_));
    FLOWMOE_CUDA_CHECK(cudaStreamWaitEvent(side_, side_events_[kSideFork], 0));
    return side_;
  }
  void mark(int i) {
    if (overlap_) FLOWMOE_CUDA_CHECK(cudaEventRecord(side_events_[i], side_));
  }
  void join(int i) {
    if (overlap_) FLOWMOE_CUDA_CHECK(cudaStreamWaitEvent(stream_, side_events_[i], 0));
  }
  // Runs a pass; if it throws between fork() and its joins, waits for the side stream before
  // rethrowing, so that no column copy is still reading or writing when the next call reuses the
  // buffers.
  template <typename Pass>
  void with_side_drained(Pass&& pass) {
    try {
      pass();
    } catch (...) {
      if (side_) cudaStreamSynchronize(side_);
      if (wstream_) cudaStreamSynchronize(wstream_);
      throw;
    }
  }

  // A dgrad and the wgrad that reads the same gradient. In order (no wgrad stream, or the first
  // backward): dgrad() on stream_, side event `side` (>= 0) joined, wgrad(*gg_, stream_). With
  // the wgrad stream: the fork point recorded on stream_, dgrad() enqueued first (it feeds the
  // next step), then wgrad(*gw_, wstream_) after the fork point and side event `side`, next to
  // it; stream_ waits for the wgrad stream at the end. dgrad() may record events of its own
  // (ep_combine_dx_begin): later work on other streams can wait for the dgrad alone.
  template <class D, class W>
  void grad_pair(int side, D&& dgrad, W&& wgrad) {
    if (!wconc_) {
      dgrad();
      if (side >= 0) join(side);
      wgrad(*gg_, stream_);
      return;
    }
    FLOWMOE_CUDA_CHECK(cudaEventRecord(wevents_[0], stream_));
    dgrad();
    FLOWMOE_CUDA_CHECK(cudaStreamWaitEvent(wstream_, wevents_[0], 0));
    if (side >= 0 && overlap_) FLOWMOE_CUDA_CHECK(cudaStreamWaitEvent(wstream_, side_events_[side], 0));
    wgrad(*gw_, wstream_);
    FLOWMOE_CUDA_CHECK(cudaEventRecord(wevents_[1], wstream_));
    FLOWMOE_CUDA_CHECK(cudaStreamWaitEvent(stream_, wevents_[1], 0));
  }

  void release() {
    gg_.reset();
    gw_.reset();
    if (wstream_) {
      cudaStreamSynchronize(wstream_);
      for (cudaEvent_t e : wevents_)
        if (e) cudaEventDestroy(e);
      cudaStreamDestroy(wstream_);
      wstream_ = nullptr;
    }
    if (side_) {
      cudaStreamSynchronize(side_);
      for (cudaEvent_t e : side_events_)
        if (e) cudaEventDestroy(e);
      cudaStreamDestroy(side_);
      side_ = nullptr;
    }
    for (cudaEvent_t e : events_) cudaEventDestroy(e);
    events_.clear();
    if (ev_dx_) cudaEventDestroy(ev_dx_);
    ev_dx_ = nullptr;
    if (tail_) {
      cudaStreamSynchronize(tail_);
      cudaStreamDestroy(tail_);
      tail_ = nullptr;
    }
    if (ev_tail_) cudaEventDestroy(ev_tail_);
    ev_tail_ = nullptr;
    for (cudaEvent_t& e : ev_chunk_) {
      if (e) cudaEventDestroy(e);
      e = nullptr;
    }
    for (void* p : allocs_) cudaFree(p);
    allocs_.clear();
    if (h_counts_) cudaFreeHost(h_counts_);
    if (h_status_) cudaFreeHost(h_status_);
    if (h_loss_) cudaFreeHost(h_loss_);
    if (h_loff_) cudaFreeHost(h_loff_);
    h_loff_ = nullptr;
    if (h_tok_) cudaFreeHost(h_tok_);
    h_tok_ = nullptr;
    h_counts_ = nullptr;
    h_status_ = nullptr;
    h_loss_ = nullptr;
  }

  // ---- report and timing helpers ---------------------------------------------------------------
  void log(MoePass pass, CastKind kind, const std::string& name, int64_t calls, int64_t outputs,
           int64_t elements) {
    for (CastOp& op : rep_.ops)
      if (op.pass == pass && op.kind == kind && op.name == name) {
        op.calls += calls;
        op.outputs += outputs;
        op.elements += elements;
        return;
      }
    CastOp op;
    op.pass = pass;
    op.kind = kind;
    op.name = name;
    op.calls = calls;
    op.outputs = outputs;
    op.elements = elements;
    rep_.ops.push_back(op);
  }
  void save_rows(const std::string& name, const std::string& format, int64_t bytes, double per_row) {
    SavedTensor s;
    s.name = name;
    s.format = format;
    s.bytes = bytes;
    // the rows held here: this rank's routed rows (one GPU) or the rows its El experts received
    s.bytes_per_token_unpadded = per_row * double(held_) / double(T_);
    rep_.saved.push_back(s);
  }
  void save_tokens(const std::string& name, const std::string& format, int64_t bytes) {
    SavedTensor s;
    s.name = name;
    s.format = format;
    s.bytes = bytes;
    s.bytes_per_token_unpadded = double(bytes) / double(T_);
    rep_.saved.push_back(s);
  }
  static double fp8_row(int64_t c) { return double(c) + double(c) / 128; }
  static double fp8_row_f32s(int64_t c) { return double(c) + 4.0 * double(c) / 128; }
  static double mxfp4_row(int64_t c) { return double(c) / 2 + double(c) / 32; }
  int64_t row_bytes(int64_t c) const { return Mp_ * c + (c / 128) * Mp_; }  // FP8 row-wise
  int64_t col_bytes(int64_t c) const { return Mp_ * c + NB_ * c; }          // FP8 column-wise

  struct Stage {
    MoePass pass;
    std::string name;
    int ev0, ev1;
  };
  // Brackets a stage with two events when profiling (pool exhausted: the stage goes untimed).
  class Scope {
   public:
    Scope(CudaMoeLayer* l, MoePass pass, const char* name, cudaStream_t stream) : l_(l), stream_(stream) {
      if (!l_->profiling_ || l_->ev_used_ + 2 > kEventPool) return;
      ev0_ = l_->ev_used_++;
      ev1_ = l_->ev_used_++;
      pass_ = pass;
      name_ = name;
      cudaEventRecord(l_->events_[ev0_], stream_);
    }
    ~Scope() {
      if (ev0_ < 0) return;
      cudaEventRecord(l_->events_[ev1_], stream_);
      (pass_ == MoePass::kForward ? l_->stages_fwd_ : l_->stages_bwd_).push_back({pass_, name_, ev0_, ev1_});
    }

   private:
    CudaMoeLayer* l_;
    cudaStream_t stream_;
    int ev0_ = -1, ev1_ = -1;
    MoePass pass_ = MoePass::kForward;
    std::string name_;
  };
  Scope fwd(const char* name, cudaStream_t s = nullptr) { return Scope(this, MoePass::kForward, name, s ? s : stream_); }
  Scope bwd(const char* name, cudaStream_t s = nullptr) { return Scope(this, MoePass::kBackward, name, s ? s : stream_); }

  void read_status() const {
    if (stats_valid_ || !have_forward_) return;
    FLOWMOE_CUDA_CHECK(cudaMemcpyAsync(h_status_, status_, 4 * sizeof(DeviceStatus),
                                       cudaMemcpyDeviceToHost, stream_));
    FLOWMOE_CUDA_CHECK(cudaMemcpyAsync(h_loss_, loss_, sizeof(float), cudaMemcpyDeviceToHost, stream_));
    FLOWMOE_CUDA_CHECK(cudaStreamSynchronize(stream_));
    const DeviceStatus* s = h_status_;
    rep_.forward_stats.nonfinite = int64_t(s[kStatusFwd].nonfinite);
    rep_.forward_stats.underflow = int64_t(s[kStatusFwd].underflow + s[kStatusFwdAux].underflow);
    rep_.backward_stats = QuantStats();
    if (backward_done_) {
      rep_.backward_stats.nonfinite = int64_t(s[kStatusBwd].nonfinite);
      rep_.backward_stats.underflow = int64_t(s[kStatusBwd].underflow + s[kStatusBwdAux].underflow);
    }
    mstatus_.nonfinite = rep_.forward_stats.nonfinite + rep_.backward_stats.nonfinite;
    mstatus_.underflow = rep_.forward_stats.underflow + rep_.backward_stats.underflow;
    mstatus_.aux_loss = cfg_.aux_loss_alpha > 0.0f ? *h_loss_ : 0.0f;
    stats_valid_ = true;
  }

  DeviceStatus* st_fwd() { return status_ + kStatusFwd; }
  DeviceStatus* st_fwd_aux() { return status_ + kStatusFwdAux; }
  DeviceStatus* st_bwd() { return status_ + kStatusBwd; }
  DeviceStatus* st_bwd_aux() { return status_ + kStatusBwdAux; }

  SegmentBlocks blocks() const {
    SegmentBlocks sb;
    sb.offsets = poff();
    sb.num_segments = El_;
    sb.m = Mp_;
    sb.max_blocks = segment_max_blocks(Mp_, El_);
    sb.block_start = bstart_;
    sb.block_end = bend_;
    sb.block_offsets = boff_;
    return sb;
  }

  // ---- GEMM wrappers ---------------------------------------------------------------------------
  using Fp8Op = gemm::Fp8Operand;
  template <typename T>
  static gemm::Span<const T> cs(const T* p, int64_t n) { return {p, n}; }
  template <typename T>
  static gemm::Span<T> ms(T* p, int64_t n) { return {p, n}; }

  // Row-wise UE8M0 operand [Mp, C] -> GEMM-ready (expert-packed FP32 scales in act32_).
  Fp8Op act_operand(const Fp8Buf& b, int64_t c, DeviceStatus* st) {
    act_scales_to_f32(b.scales, Mp_, c, poff(), El_, act32_, st, stream_);
    return Fp8Op{cs<uint8_t>(b.codes, Mp_ * c), cs<float>(act32_, Mp_ * c / 128)};
  }
  // Column-wise UE8M0 operand [C over Mp] -> GEMM-ready FP32 [NB][C] in `buf32`.
  Fp8Op col_operand(const Fp8Buf& b, int64_t c, float* buf32, cudaStream_t s = nullptr) {
    col_scales_to_f32(b.scales, NB_, c, buf32, s ? s : stream_);
    return Fp8Op{cs<uint8_t>(b.codes, c * Mp_), cs<float>(buf32, NB_ * c)};
  }
  Fp8Op w1_op() const {
    return Fp8Op{cs<uint8_t>(w1_.codes, int64_t(El_) * 2 * F_ * H_),
                 cs<float>(w1_.scales, gemm::weight_scale_f32_elems(El_, 2 * F_, H_))};
  }
  Fp8Op w1t_op() const {
    return Fp8Op{cs<uint8_t>(w1t_.codes, int64_t(El_) * 2 * F_ * H_),
                 cs<float>(w1t_.scales, gemm::weight_scale_f32_elems(El_, H_, 2 * F_))};
  }
  Fp8Op w2_op() const {
    return Fp8Op{cs<uint8_t>(w2_.codes, int64_t(El_) * H_ * F_),
                 cs<float>(w2_.scales, gemm::weight_scale_f32_elems(El_, H_, F_))};
  }
  Fp8Op w2t_op() const {
    return Fp8Op{cs<uint8_t>(w2t_.codes, int64_t(El_) * H_ * F_),
                 cs<float>(w2t_.scales, gemm::weight_scale_f32_elems(El_, F_, H_))};
  }
  // MoeGrads::accumulate: beta = 1 into the gradients, or beta = 0 (the old values never read)
  gemm::WgradOut dw_out(float* p, int64_t n) const {
    return grads_accumulate_ ? gemm::WgradOut::accumulate(p, n) : gemm::WgradOut::f32(p, n);
  }

  // ---- routing (every recipe) ------------------------------------------------------------------
  void route(const bf16_t* x) {
    const RouterConfig rc = cfg_.router_config();
    {
      auto s = fwd("router (logits GEMM, top-k, aux loss)");
      FLOWMOE_CUDA_CHECK(cudaMemcpyAsync(x_, x, sizeof(bf16_t) * T_ * H_, cudaMemcpyDeviceToDevice, stream_));
      router_logits(x_, wr_, T_, E_, H_, logits_, stream_);
      router_forward(logits_, T_, rc, has_bias_ ? bias_ : nullptr, ids_, probs_, st_fwd(), stream_);
      if (cfg_.aux_loss_alpha > 0.0f)
        router_aux_loss(logits_, ids_, T_, rc, cfg_.aux_loss_alpha, loss_, aux_coef_, aux_ws_, stream_);
    }
    {
      auto s = fwd("routing tables + count fetch (host sync)");
      routing_.tokens = T_;
      build_routing(ids_, routing_, st_fwd_aux(), stream_);
      if (dedup_) {  // tokens per destination rank, fetched by the same host sync
        prt_.tokens = T_;
        if (T_ > 0) {
          ep_peer_ids(ids_, T_, K_, El_, dd_peer_ids_, stream_);
          build_routing(dd_peer_ids_, prt_, nullptr, stream_);
          FLOWMOE_CUDA_CHECK(cudaMemcpyAsync(h_tok_, prt_.counts, sizeof(int32_t) * comm_->world_size(),
                                             cudaMemcpyDeviceToHost, stream_));
        } else {
          std::fill(h_tok_, h_tok_ + comm_->world_size(), 0);
        }
      }
      Mp_ = fetch_routing_counts(routing_, h_counts_, stream_);
      ++host_syncs_;
    }
    std::vector<int32_t> padded(E_);
    routed_ = 0;
    for (int e = 0; e < E_; ++e) {
      routed_ += h_counts_[e];
      padded[e] = (h_counts_[e] + cfg_.align - 1) / cfg_.align * cfg_.align;
    }
    if (comm_ == nullptr) {
      seg_ = Segments::from_counts(padded);
      held_ = routed_;
    } else {
      // Expert parallelism: the plan from the per-expert counts just fetched (collective:
      // configuration check, count all-to-all), the CPU layer's plan (plan_dispatch_counts gives
      // what plan_dispatch gives without the send routing, which lives on the device here as
      // routing_.row_map_unpadded). From here on Mp_, seg_ and the device offsets describe this
      // rank's El local expert segments of the rows every rank sends here.
      auto s = fwd("dispatch plan (count all-to-all)");
      EpConfig ec;
      ec.num_experts = E_;
      ec.topk = K_;
      ec.hidden = H_;
      ec.align = cfg_.align;
      ec.format = forward_wire_format();
      ec.with_probs = true;
      // the configuration was agreed on at construction (make_cuda_layer): one collective here
      plan_ = plan_dispatch_counts(*comm_, ec, h_counts_, T_, /*config_agreed=*/true,
                                   dedup_ ? h_tok_ : nullptr);
      Mp_ = plan_.padded_rows();
      FLOWMOE_CHECK(Mp_ <= R_, "MoeLayer::forward: " << Mp_ << " padded rows received; the "
                                   "workspaces hold max_rows() = " << R_ << " (a rank passed T > max_tokens?)");
      seg_ = plan_.padded_segments();
      held_ = plan_.recv_rows();
      // The combines stage up to every padded row (2H + 4 bytes) through the communicator's
      // scratch: grow it here, at a point where the stream is idle anyway, not inside the
      // backward's overlap of combine and GEMM1 wgrad (growth waits for the device).
      comm_->scratch(Mp_ * (2 * H_ + 4) + int64_t(4096) * comm_->world_size());
      std::copy(plan_.padded_offsets.begin(), plan_.padded_offsets.end(), h_loff_);
      FLOWMOE_CUDA_CHECK(cudaMemcpyAsync(d_loff_, h_loff_, sizeof(int32_t) * (El_ + 1),
                                         cudaMemcpyHostToDevice, stream_));
    }
    NB_ = seg_.num_blocks();
    rep_.tokens = T_;
    rep_.routed_rows = routed_;
    rep_.padded_rows = Mp_;
    {
      auto s = fwd("row probabilities + segment blocks");
      FLOWMOE_CUDA_CHECK(cudaMemsetAsync(prow_, 0, sizeof(float) * std::max<int64_t>(Mp_, 1), stream_));
      // EP: the forward dispatch brings each received row's probability into prow_
      if (comm_ == nullptr) scatter_row_probs(probs_, routing_.row_map, T_, K_, prow_, stream_);
      if (cfg_.recipe != Recipe::kBf16 && Mp_ > 0) build_segment_blocks(blocks(), st_fwd_aux(), stream_);
    }
  }

  // ---- token movement: permute+pad / unpermute on one GPU, dispatch / combine with EP ------------
  // The device offsets of the expert segments the GEMMs and the segment-aware kernels see.
  const int32_t* poff() const { return comm_ ? d_loff_ : routing_.padded_offsets; }


  WireFormat forward_wire_format() const { return ep_detail::forward_wire_format(cfg_.recipe); }
  void log_dispatch(MoePass pass, const std::string& name, const DispatchPlan& p) {
    rep_.wire.push_back(ep_detail::dispatch_transfer(pass, name, p));
  }
  void log_combine(MoePass pass, const std::string& name, const std::string& format, int64_t row_bytes) {
    rep_.wire.push_back(ep_detail::combine_transfer(pass, name, format, row_bytes, plan_));
  }

  // One exchange of the communicator. Stream contract: the send buffers were written (and the
  // receive buffers zeroed) on stream_, so stream_ is synchronised first; the communicator then
  // moves the bytes (device SimWorld: blocking copies; NCCL: ordered on its own stream) and
  // comm.synchronize() waits for them, so the work enqueued on stream_ afterwards reads complete
  // rows whatever stream the communicator uses. One host sync of stream_ per exchange (counted)
  // plus the communicator's; overlapping the exchange with compute is future work.
  template <typename Fn>
  void ep_exchange(Fn&& fn) {
    FLOWMOE_CUDA_CHECK(cudaStreamSynchronize(stream_));
    ++host_syncs_;
    fn();
    comm_->synchronize();
  }

  // EP: moves `streams` (send-order rows -> their padded rows on the experts' ranks) in one
  // exchange, with the routing probabilities (FP32, into prow_) in the forward; the padding rows
  // of every receive buffer are zero (memset before the exchange).
  void ep_dispatch(MoePass pass, const char* name, WireFormat f, std::vector<RowStream> streams) {
    const bool fwd = pass == MoePass::kForward;
    const DispatchPlan p = ep_detail::plan_for(plan_, pass, f);
    if (fwd) {
      ep_gather_rows(probs_, int64_t(sizeof(float)), true, routing_.row_map_unpadded, T_, K_,
                     ep_send_p_, stream_);
      streams.push_back({ep_send_p_, prow_, int64_t(sizeof(float))});
    }
    // the padding rows of every receive buffer are zero (the exchange writes every other row):
    // one batched fill of El ranges per stream instead of a memset of the whole buffer
    std::vector<CopyPiece> pad;
    for (const RowStream& st : streams)
      for (int l = 0; l < p.local_experts; ++l) {
        const int64_t first = int64_t(p.padded_offsets[l]) + p.expert_counts[l], end = p.padded_offsets[l + 1];
        if (end > first)
          pad.push_back({nullptr, static_cast<uint8_t*>(st.recv) + first * st.row_bytes, (end - first) * st.row_bytes});
      }
    cuda::comm::copy_pieces(pad, stream_);
    ep_exchange([&] { dispatch_rows(*comm_, p, streams, direct_bytes_); });
    log_dispatch(pass, name, p);
  }

  // Deduplicated dispatch (dedup_): each token travels once to each rank holding one of its
  // experts (prt_.row_map gives its row among the rows to that rank, token order per rank); the
  // forward adds its k expert ids and probabilities. The receiver routes the received tokens over
  // its El experts (rrt_: rank 0's tokens first, each rank's in token order, so the padded layout
  // is the plan's, row for row) and then runs the one-GPU permute+pad kernels on them: the bits of
  // the per-(token, expert) exchange, with at most min(W, k) rows per token on the wire instead
  // of k. `streams`: the token rows already gathered by prt_.row_map (send) and the dd_* receive
  // buffers, rank-major. One message per peer and stream; own rows by a local copy.
  void dd_exchange(MoePass pass, const char* name, const std::string& format, std::vector<RowStream> streams) {
    const bool fwd = pass == MoePass::kForward;
    const int W = comm_->world_size(), me = comm_->rank();
    if (fwd) {
      ep_gather_rows(ids_, int64_t(sizeof(int32_t)) * K_, false, prt_.row_map, T_, K_, dd_send_ids_, stream_);
      ep_gather_rows(probs_, int64_t(sizeof(float)) * K_, false, prt_.row_map, T_, K_, dd_send_p_, stream_);
      streams.push_back({dd_send_ids_, dd_recv_ids_, int64_t(sizeof(int32_t)) * K_});
      streams.push_back({dd_send_p_, dd_recv_p_, int64_t(sizeof(float)) * K_});
    }
    std::vector<int64_t> so(W + 1, 0), ro(W + 1, 0);
    for (int p = 0; p < W; ++p) {
      so[p + 1] = so[p] + plan_.send_tokens[p];
      ro[p + 1] = ro[p] + plan_.recv_tokens[p];
    }
    FLOWMOE_CHECK(ro[W] <= int64_t(W) * Tm_, "MoeLayer: " << ro[W] << " tokens received; expected at most "
                                                          << int64_t(W) * Tm_);
    std::vector<P2pOp> sends, recvs;
    std::vector<CopyPiece> own;
    int64_t row_bytes = 0;
    for (const RowStream& st : streams) row_bytes += st.row_bytes;
    for (int p = 0; p < W; ++p)
      for (const RowStream& st : streams) {
        uint8_t* src = const_cast<uint8_t*>(static_cast<const uint8_t*>(st.send)) + so[p] * st.row_bytes;
        uint8_t* dst = static_cast<uint8_t*>(st.recv) + ro[p] * st.row_bytes;
        const int64_t ns = (so[p + 1] - so[p]) * st.row_bytes, nr = (ro[p + 1] - ro[p]) * st.row_bytes;
        if (p == me) {
          if (ns > 0) own.push_back({src, dst, ns});
          continue;
        }
        if (ns > 0) sends.push_back({p, src, ns});
        if (nr > 0) recvs.push_back({p, dst, nr});
      }
    cuda::comm::copy_pieces(own, stream_);
    ep_exchange([&] { comm_->exchange(sends, recvs); });
    if (fwd) {
      dd_recv_tokens_ = ro[W];
      rrt_.tokens = dd_recv_tokens_;
      if (rrt_.tokens > 0) {
        ep_local_ids(dd_recv_ids_, rrt_.tokens, K_, El_, me, dd_local_ids_, stream_);
        build_routing(dd_local_ids_, rrt_, nullptr, stream_);
        scatter_row_probs(dd_recv_p_, rrt_.row_map, rrt_.tokens, K_, prow_, stream_);
      }
    }
    WireTransfer w;
    w.pass = pass;
    w.name = name;
    w.format = format + (fwd ? " + k ids + k probs" : "") + " (deduplicated: one row per token and rank)";
    for (int p = 0; p < W; ++p)
      if (p != me) w.rows += so[p + 1] - so[p];
    w.bytes = w.rows * row_bytes;
    rep_.wire.push_back(w);
  }

  // token rows [T, H] bf16 -> padded rows [Mp, H] bf16 of the local experts
  void move_bf16(const bf16_t* tok, bf16_t* rows, MoePass pass, const char* name) {
    if (comm_ == nullptr) {
      permute_pad_bf16(tok, H_, routing_, rows, stream_);
      return;
    }
    if (dedup_) {
      ep_gather_rows(tok, 2 * H_, false, prt_.row_map, T_, K_, ep_send_, stream_);
      dd_exchange(pass, name, "bf16", {{ep_send_, dd_recv_, 2 * H_}});
      permute_pad_bf16(reinterpret_cast<const bf16_t*>(dd_recv_), H_, rrt_, rows, stream_);
      return;
    }
    ep_gather_rows(tok, 2 * H_, false, routing_.row_map_unpadded, T_, K_, ep_send_, stream_);
    ep_dispatch(pass, name, WireFormat::kBf16, {{ep_send_, rows, 2 * H_}});
  }
  // FP8 row-wise token rows (codes [T, H], scales [H/128][T]) -> out_codes [Mp, H], out_scales
  // [H/128][Mp]. EP wire format fp8: codes + UE8M0 scales row-major [rows][H/128] next to them;
  // the receiver transposes the scales (as the CPU's ep_dispatch_fp8).
  void move_fp8(const uint8_t* codes, const uint8_t* scales, uint8_t* out_codes,
                uint8_t* out_scales, MoePass pass, const char* name) {
    if (comm_ == nullptr) {
      permute_pad_fp8(codes, scales, H_, routing_, out_codes, out_scales, Mp_, stream_);
      return;
    }
    const int64_t nc = H_ / 128;
    if (dedup_) {
      ep_gather_rows(codes, H_, false, prt_.row_map, T_, K_, ep_send_, stream_);
      ep_gather_col_scales(scales, nc, 1, prt_.row_map, T_, K_, ep_send_sc_, stream_);
      dd_exchange(pass, name, "fp8 + ue8m0 1x128 scales", {{ep_send_, dd_recv_, H_}, {ep_send_sc_, dd_recv_sc_, nc}});
      ep_transpose_scales(dd_recv_sc_, dd_recv_tokens_, nc, 1, dd_recv_scc_, std::max<int64_t>(dd_recv_tokens_, 1),
                          stream_);
      permute_pad_fp8(dd_recv_, dd_recv_scc_, H_, rrt_, out_codes, out_scales, std::max<int64_t>(Mp_, 1), stream_);
      return;
    }
    ep_gather_rows(codes, H_, false, routing_.row_map_unpadded, T_, K_, ep_send_, stream_);
    ep_gather_col_scales(scales, nc, 1, routing_.row_map_unpadded, T_, K_, ep_send_sc_, stream_);
    ep_dispatch(pass, name, WireFormat::kFp8, {{ep_send_, out_codes, H_}, {ep_send_sc_, ep_recv_sc_, nc}});
    ep_transpose_scales(ep_recv_sc_, Mp_, nc, 1, out_scales, Mp_, stream_);
  }
  // MXFP4 entry rows (ent4c_ [T, H/2], ent4s_ [T][H/32]) -> x4c_ [Mp, H/2], x4s_ [Mp][H/32]
  // (the wire layout is the final layout). Forward only.
  void move_mxfp4() {
    if (comm_ == nullptr) {
      permute_pad_mxfp4(ent4c_, ent4s_, H_, routing_, x4c_, x4s_, stream_);
      return;
    }
    if (dedup_) {
      ep_gather_rows(ent4c_, H_ / 2, false, prt_.row_map, T_, K_, ep_send_, stream_);
      ep_gather_rows(ent4s_, H_ / 32, false, prt_.row_map, T_, K_, ep_send_sc_, stream_);
      dd_exchange(MoePass::kForward, "dispatch x", "mxfp4 + ue8m0 1x32 scales",
                  {{ep_send_, dd_recv_, H_ / 2}, {ep_send_sc_, dd_recv_sc_, H_ / 32}});
      permute_pad_mxfp4(dd_recv_, dd_recv_sc_, H_, rrt_, x4c_, x4s_, stream_);
      return;
    }
    ep_gather_rows(ent4c_, H_ / 2, false, routing_.row_map_unpadded, T_, K_, ep_send_, stream_);
    ep_gather_rows(ent4s_, H_ / 32, false, routing_.row_map_unpadded, T_, K_, ep_send_sc_, stream_);
    ep_dispatch(MoePass::kForward, "dispatch x", WireFormat::kMxfp4,
                {{ep_send_, x4c_, H_ / 2}, {ep_send_sc_, x4s_, H_ / 32}});
  }
  // fp8-naive with EP: the entry codes (ent_) and FP32 scales (ent32_ [H/128][T]) travel (wire
  // format fp8-fp32scale, scales row-major next to the codes), land in rowA_.codes and
  // ep_recv_sc_, the scales are transposed into act32_ ([H/128][Mp]) and the rows dequantized into
  // out [Mp, H] bf16 (padding rows: code 0 x scale 0 = +0, the zero rows one GPU's permute+pad
  // writes). Dequantization is element-wise, so this gives the bits of dequantize-then-permute.
  // Returns the elements counted for the report: the received routed rows (as the CPU layer).
  int64_t move_naive(bf16_t* out, MoePass pass, const char* name) {
    const int64_t nc = H_ / 128;
    ep_gather_rows(ent_.codes, H_, false, routing_.row_map_unpadded, T_, K_, ep_send_, stream_);
    ep_gather_col_scales(ent32_, nc, 4, routing_.row_map_unpadded, T_, K_, ep_send_sc_, stream_);
    ep_dispatch(pass, name, WireFormat::kFp8Fp32Scale,
                {{ep_send_, rowA_.codes, H_}, {ep_send_sc_, ep_recv_sc_, 4 * nc}});
    ep_transpose_scales(ep_recv_sc_, Mp_, nc, 4, act32_, Mp_, stream_);
    naive_dequantize_row(rowA_.codes, act32_, Mp_, H_, nullptr, El_, out, stream_);
    return held_ * H_;
  }
  // expert output rows o_ [Mp, H] -> y [T, H] (plain sum in slot order; EP: the rows come back
  // to the token's rank in send order first, and the sum runs there, as unpermute does)
  // GEMM2 (gemm2(e_begin, e_end) computes the expert outputs o_ of local experts [e_begin,
  // e_end)) and the way back to the tokens. With a communicator and combine_chunks_ > 1, GEMM2 runs
  // in chunks of El / n experts (the same cuts on every rank: combine_rows_experts is collective);
  // the host waits for each chunk's rows only and sends them back on the communicator's
  // high-priority stream while the next chunks compute. The same rows reach the same places, and
  // one unpermute sums them afterwards: the bits of one GEMM2 and one combine.
  template <typename Gemm2>
  void gemm2_then_combine(const char* gemm_stage, Gemm2&& gemm2, bf16_t* y) {
    const int n = comm_ ? std::min(combine_chunks_, El_) : 1;
    if (n <= 1) {
      { auto s = fwd(gemm_stage); gemm2(0, El_); }
      { auto s = fwd(comm_ ? "combine + unpermute" : "unpermute+unpad"); combine_y(y); }
      return;
    }
    std::vector<int> cut(n + 1);
    for (int c = 0; c <= n; ++c) cut[c] = int(int64_t(El_) * c / n);
    for (int c = 0; c < n; ++c) {
      { auto s = fwd(gemm_stage); gemm2(cut[c], cut[c + 1]); }
      FLOWMOE_CUDA_CHECK(cudaEventRecord(ev_chunk_[c], stream_));
    }
    auto s = fwd("combine (in chunks, overlapping GEMM2) + unpermute");
    bf16_t* back = reinterpret_cast<bf16_t*>(ep_send_);
    for (int c = 0; c < n; ++c) {
      FLOWMOE_CUDA_CHECK(cudaEventSynchronize(ev_chunk_[c]));
      ++host_syncs_;
      combine_rows_experts(*comm_, plan_, {{o_, back, 2 * H_}}, cut[c], cut[c + 1], direct_bytes_);
    }
    comm_->synchronize();
    log_combine(MoePass::kForward, "combine expert output rows", "bf16", 2 * H_);
    unpermute(back, nullptr, H_, routing_, y, stream_);
  }

  void combine_y(bf16_t* y) {
    if (comm_ == nullptr) {
      unpermute_unpad(o_, nullptr, H_, routing_, y, stream_);
      return;
    }
    bf16_t* back = reinterpret_cast<bf16_t*>(ep_send_);
    ep_exchange([&] { combine_rows(*comm_, plan_, {{o_, back, 2 * H_}}, direct_bytes_); });
    log_combine(MoePass::kForward, "combine expert output rows", "bf16", 2 * H_);
    // the unpadded map addresses the send-order rows that just came back; same kernel and
    // arithmetic as unpermute_unpad (token.h)
    unpermute(back, nullptr, H_, routing_, y, stream_);
  }

  // ---- forward, per recipe (the CPU backend's dataflow) -----------------------------------------
  void forward_bf16(bf16_t* y) {
    { auto s = fwd(comm_ ? "dispatch x (bf16)" : "permute+pad x (bf16)");
      move_bf16(x_, xp_, MoePass::kForward, "dispatch x"); }
    { auto s = fwd("GEMM1 fprop (bf16)");
      gg_->fprop_bf16(seg_, 2 * F_, H_, cs<bf16_t>(xp_, Mp_ * H_), cs<bf16_t>(w1b_, int64_t(El_) * 2 * F_ * H_),
                      ms<bf16_t>(h1_, Mp_ * 2 * F_), stream_); }
    { auto s = fwd("SwiGLU*prob (bf16)");
      cuda::swiglu(h1_, Mp_, F_, abuf_, st_fwd(), stream_, prow_); }
    gemm2_then_combine("GEMM2 fprop (bf16)", [&](int e0, int e1) {
      gg_->fprop_bf16(seg_, H_, F_, cs<bf16_t>(abuf_, Mp_ * F_), cs<bf16_t>(w2b_, int64_t(El_) * H_ * F_),
                      ms<bf16_t>(o_, Mp_ * H_), stream_, e0, e1);
    }, y);
    save_rows("GEMM1 input x_perm", "bf16 [Mp, H]", Mp_ * H_ * 2, 2.0 * H_);
    save_rows("GEMM1 output h", "bf16 [Mp, 2F]", Mp_ * 2 * F_ * 2, 4.0 * F_);
    save_rows("GEMM2 input a'", "bf16 [Mp, F]", Mp_ * F_ * 2, 2.0 * F_);
  }

  void forward_blockwise(bf16_t* y) {
    const SegmentBlocks sb = blocks();
    bf16_t* xp = o_;  // BF16 permuted input, scratch
    { auto s = fwd(comm_ ? "dispatch x (bf16)" : "permute+pad x (bf16)");
      move_bf16(x_, xp, MoePass::kForward, "dispatch x"); }
    { auto s = fwd("quantize x_perm (row + col)");
      quantize_col(xp, H_, sb, xc_.codes, xc_.scales, rowA_.codes, rowA_.scales, st_fwd(), stream_); }
    log(MoePass::kForward, CastKind::kQuantize, "quantize x_perm (row + col, from BF16)", 1, 2, Mp_ * H_);
    { auto s = fwd("GEMM1 fprop (fp8)");
      const Fp8Op xo = act_operand(rowA_, H_, st_fwd_aux());
      gg_->fprop(seg_, 2 * F_, H_, xo, w1_op(), ms<bf16_t>(h1_, Mp_ * 2 * F_), stream_); }
    { auto s = fwd("SwiGLU*prob (bf16)");
      cuda::swiglu(h1_, Mp_, F_, abuf_, st_fwd(), stream_, prow_); }
    { auto s = fwd("quantize a' (row + col)");
      quantize_col(abuf_, F_, sb, ac_.codes, ac_.scales, rowA_.codes, rowA_.scales, st_fwd(), stream_); }
    log(MoePass::kForward, CastKind::kQuantize, "quantize a' (row + col, from BF16)", 1, 2, Mp_ * F_);
    {
      const Fp8Op ao = act_operand(rowA_, F_, st_fwd_aux());
      gemm2_then_combine("GEMM2 fprop (fp8)", [&](int e0, int e1) {
        gg_->fprop(seg_, H_, F_, ao, w2_op(), ms<bf16_t>(o_, Mp_ * H_), stream_, e0, e1);
      }, y);
    }
    save_rows("GEMM1 input x_perm (wgrad copy)", "fp8 col 128x1 [Mp, H]", col_bytes(H_), fp8_row(H_));
    save_rows("GEMM1 output h", "bf16 [Mp, 2F]", Mp_ * 2 * F_ * 2, 4.0 * F_);
    save_rows("GEMM2 input a' (wgrad copy)", "fp8 col 128x1 [Mp, F]", col_bytes(F_), fp8_row(F_));
  }

  // fp8-naive's entry (SPEC §6), forward for x and backward for dy: quantize `in` [T, H] with FP32
  // scales, move it to the experts (FP8 on the wire with a communicator), dequantize, and lay it
  // out permuted and padded in `out` [Mp, H] BF16.
  void naive_entry(MoePass pass, const bf16_t* in, bf16_t* out) {
    const bool f = pass == MoePass::kForward;
    { Scope s(this, pass, f ? "quantize x (entry, fp32 scales)" : "quantize dy (entry, fp32 scales)", stream_);
      naive_quantize_row(in, T_, H_, nullptr, E_, ent_.codes, ent32_, f ? st_fwd() : st_bwd(), stream_); }
    log(pass, CastKind::kQuantize,
        f ? "quantize x (row, FP32 scales, before dispatch)" : "quantize dy (row, FP32 scales, before dispatch)", 1, 1,
        T_ * H_);
    const char* deq = f ? "dequantize x (after dispatch)" : "dequantize dy (after dispatch)";
    if (comm_ == nullptr) {
      { Scope s(this, pass, deq, stream_);
        naive_dequantize_row(ent_.codes, ent32_, T_, H_, nullptr, E_, entb_, stream_); }
      log(pass, CastKind::kDequantize, deq, 1, 1, T_ * H_);
      { Scope s(this, pass, f ? "permute+pad x (bf16)" : "permute+pad dy (bf16)", stream_);
        permute_pad_bf16(entb_, H_, routing_, out, stream_); }
    } else {
      int64_t n = 0;
      { Scope s(this, pass, f ? "dispatch x (fp8, fp32 scales) + dequantize" : "dispatch dy (fp8, fp32 scales) + dequantize",
                stream_);
        n = move_naive(out, pass, f ? "dispatch x" : "dispatch dy"); }
      log(pass, CastKind::kDequantize, deq, 1, 1, n);
    }
  }

  void forward_naive(bf16_t* y) {
    bf16_t* xp = o_;
    naive_entry(MoePass::kForward, x_, xp);
    { auto s = fwd("quantize x_perm (row, fp32 scales)");
      naive_quantize_row(xp, Mp_, H_, poff(), El_, xn_.codes, xn_.scales, st_fwd(), stream_); }
    log(MoePass::kForward, CastKind::kQuantize, "quantize x_perm (row, FP32 scales)", 1, 1, Mp_ * H_);
    { auto s = fwd("GEMM1 fprop (fp8)");
      gg_->fprop(seg_, 2 * F_, H_, Fp8Op{cs<uint8_t>(xn_.codes, Mp_ * H_), cs<float>(xn_.scales, Mp_ * H_ / 128)},
                 w1_op(), ms<bf16_t>(h1_, Mp_ * 2 * F_), stream_); }
    { auto s = fwd("SwiGLU*prob (bf16)");
      cuda::swiglu(h1_, Mp_, F_, abuf_, st_fwd(), stream_, prow_); }
    { auto s = fwd("quantize a' (row, fp32 scales)");
      naive_quantize_row(abuf_, Mp_, F_, poff(), El_, an_.codes, an_.scales, st_fwd(), stream_); }
    log(MoePass::kForward, CastKind::kQuantize, "quantize a' (row, FP32 scales)", 1, 1, Mp_ * F_);
    gemm2_then_combine("GEMM2 fprop (fp8)", [&](int e0, int e1) {
      gg_->fprop(seg_, H_, F_, Fp8Op{cs<uint8_t>(an_.codes, Mp_ * F_), cs<float>(an_.scales, Mp_ * F_ / 128)},
                 w2_op(), ms<bf16_t>(o_, Mp_ * H_), stream_, e0, e1);
    }, y);
    save_rows("GEMM1 input x_perm", "fp8 row 1x128 fp32-scale [Mp, H]", Mp_ * H_ + 4 * (H_ / 128) * Mp_,
              fp8_row_f32s(H_));
    save_rows("GEMM1 output h", "bf16 [Mp, 2F]", Mp_ * 2 * F_ * 2, 4.0 * F_);
    save_rows("GEMM2 input a'", "fp8 row 1x128 fp32-scale [Mp, F]", Mp_ * F_ + 4 * (F_ / 128) * Mp_,
              fp8_row_f32s(F_));
  }

  void forward_flow(bf16_t* y) {
    const bool fp4 = cfg_.recipe == Recipe::kFlowFp4;
    const SegmentBlocks sb = blocks();
    Fp8Buf xin;  // GEMM1 input, row-wise FP8 [Mp, H]
    if (!fp4) {
      { auto s = fwd("quantize x (entry)");
        quantize_row(x_, T_, H_, ent_.codes, ent8s_, st_fwd(), stream_); }
      log(MoePass::kForward, CastKind::kQuantize, "quantize x (row 1x128, entry)", 1, 1, T_ * H_);
      { auto s = fwd(comm_ ? "dispatch x (fp8)" : "permute+pad x (fp8)");
        move_fp8(ent_.codes, ent8s_, xr_.codes, xr_.scales, MoePass::kForward, "dispatch x"); }
      xin = xr_;
    } else {
      { auto s = fwd("quantize x (entry, mxfp4)");
        quantize_mxfp4(x_, T_, H_, ent4c_, ent4s_, st_fwd(), stream_); }
      log(MoePass::kForward, CastKind::kQuantize, "quantize x (MXFP4 1x32, entry)", 1, 1, T_ * H_);
      { auto s = fwd(comm_ ? "dispatch x (mxfp4)" : "permute+pad x (mxfp4)"); move_mxfp4(); }
      { auto s = fwd("FP4RowToFP8Row x_perm");
        fp4_to_fp8_row(x4c_, x4s_, Mp_, H_, rowA_.codes, rowA_.scales, st_fwd(), stream_); }
      log(MoePass::kForward, CastKind::kConvert, "FP4RowToFP8Row x_perm (GEMM1 input)", 1, 1, Mp_ * H_);
      xin = rowA_;
    }
    { auto s = fwd("GEMM1 fprop (fp8)");
      const Fp8Op xo = act_operand(xin, H_, st_fwd_aux());
      gg_->fprop(seg_, 2 * F_, H_, xo, w1_op(), ms<bf16_t>(h1_, Mp_ * 2 * F_), stream_); }
    const Fp8Buf ar = rowA_;  // a' row-wise (flow-fp4: rowA held GEMM1's input, consumed by now)
    if (!fp4) {
      auto s = fwd("SwiGLU*prob + quantize (a' row, h row)");
      cuda::swiglu_quant(h1_, Mp_, F_, ar.codes, ar.scales, hr_.codes, hr_.scales, st_fwd(), stream_, prow_);
      log(MoePass::kForward, CastKind::kFused, "SwiGLU*prob + quantize (a' row, h row)", 1, 2, Mp_ * 2 * F_);
    } else {
      auto s = fwd("SwiGLU*prob + quantize (a' row, h mxfp4)");
      cuda::swiglu_quant_h4(h1_, Mp_, F_, ar.codes, ar.scales, hr_.codes, hr_.scales, st_fwd(), stream_, prow_);
      log(MoePass::kForward, CastKind::kFused, "SwiGLU*prob + quantize (a' row, h MXFP4)", 1, 2, Mp_ * 2 * F_);
    }
    {  // the wgrad copy of a' is needed in the backward only: next to GEMM2 (both read a' row-wise)
      cudaStream_t ts = fork();
      {  // the stage's events close before mark(), so that join() covers them too
        auto s = fwd(overlap_ ? "scaling-aware transpose a' (side stream)" : "scaling-aware transpose a'", ts);
        scaling_aware_transpose(ar.codes, ar.scales, F_, sb, ac_.codes, ac_.scales, st_fwd_aux(), ts,
                                cfg_.transpose_exponent);
      }
      mark(kSideA);
    }
    log(MoePass::kForward, CastKind::kConvert, "scaling-aware transpose a' (wgrad copy)", 1, 1, Mp_ * F_);
    {
      const Fp8Op ao = act_operand(ar, F_, st_fwd_aux());
      gemm2_then_combine("GEMM2 fprop (fp8)", [&](int e0, int e1) {
        gg_->fprop(seg_, H_, F_, ao, w2_op(), ms<bf16_t>(o_, Mp_ * H_), stream_, e0, e1);
      }, y);
    }
    join(kSideA);  // a' col ready before anything later on stream_ (the backward) runs
    if (!fp4)
      save_rows("GEMM1 input x_perm", "fp8 row 1x128 [Mp, H]", row_bytes(H_), fp8_row(H_));
    else
      save_rows("GEMM1 input x_perm", "mxfp4 row 1x32 [Mp, H]", Mp_ * H_ / 2 + Mp_ * H_ / 32, mxfp4_row(H_));
    if (!fp4)
      save_rows("GEMM1 output h", "fp8 row 1x128 [Mp, 2F]", row_bytes(2 * F_), fp8_row(2 * F_));
    else
      save_rows("GEMM1 output h", "mxfp4 row 1x32 [Mp, 2F]", Mp_ * F_ + Mp_ * 2 * F_ / 32, mxfp4_row(2 * F_));
    save_rows("GEMM2 input a' (wgrad copy)", "fp8 col 128x1 [Mp, F]", col_bytes(F_), fp8_row(F_));
  }

  // ---- backward, per recipe: each leaves dXp [Mp, H] bf16 in o_ and the partial sums of dp
  //      ([F/128][Mp], swiglu.h) in dpart_ -------------------------------------------------------
  void backward_bf16(const bf16_t* dy, const MoeGrads& g) {
    bf16_t* dy2 = o_;
    { auto s = bwd(comm_ ? "dispatch dy (bf16)" : "permute+pad dy (bf16)");
      move_bf16(dy, dy2, MoePass::kBackward, "dispatch dy"); }
    grad_pair(-1, [&] {  // (the pair ends before GEMM1 dgrad overwrites dY in o_)
      auto s = bwd("GEMM2 dgrad (bf16)");
      gg_->dgrad_bf16(seg_, H_, F_, cs<bf16_t>(dy2, Mp_ * H_), cs<bf16_t>(w2b_, int64_t(El_) * H_ * F_),
                      ms<bf16_t>(da_, Mp_ * F_), stream_);
    }, [&](GroupedGemm& gg, cudaStream_t ws) {
      if (!g.dw2) return;
      auto s = bwd("GEMM2 wgrad (bf16)", ws);
      gg.wgrad_bf16(seg_, H_, F_, cs<bf16_t>(dy2, Mp_ * H_), cs<bf16_t>(abuf_, Mp_ * F_),
                    dw_out(g.dw2, int64_t(El_) * H_ * F_), ws);
    });
    { auto s = bwd("dSwiGLU*prob (bf16)");
      cuda::dswiglu(da_, h1_, Mp_, F_, dh_, st_bwd(), stream_, prow_, dpart_); }
    bf16_t* dxp = o_;
    grad_pair(-1, [&] {
      { auto s = bwd("GEMM1 dgrad (bf16)");
        gg_->dgrad_bf16(seg_, 2 * F_, H_, cs<bf16_t>(dh_, Mp_ * 2 * F_), cs<bf16_t>(w1b_, int64_t(El_) * 2 * F_ * H_),
                        ms<bf16_t>(dxp, Mp_ * H_), stream_); }
      ep_combine_dx_begin();
    }, [&](GroupedGemm& gg, cudaStream_t ws) {
      if (!g.dw1) return;
      auto s = bwd("GEMM1 wgrad (bf16)", ws);
      gg.wgrad_bf16(seg_, 2 * F_, H_, cs<bf16_t>(dh_, Mp_ * 2 * F_), cs<bf16_t>(xp_, Mp_ * H_),
                    dw_out(g.dw1, int64_t(El_) * 2 * F_ * H_), ws);
    });
  }

  void backward_blockwise(const bf16_t* dy, const MoeGrads& g) {
    const SegmentBlocks sb = blocks();
    bf16_t* dy2 = o_;
    { auto s = bwd(comm_ ? "dispatch dy (bf16)" : "permute+pad dy (bf16)");
      move_bf16(dy, dy2, MoePass::kBackward, "dispatch dy"); }
    { auto s = bwd("quantize dY (row + col)");
      quantize_col(dy2, H_, sb, colA_.codes, colA_.scales, rowA_.codes, rowA_.scales, st_bwd(), stream_); }
    log(MoePass::kBackward, CastKind::kQuantize, "quantize dY (row + col, from BF16)", 1, 2, Mp_ * H_);
    fp8_gemm2_grads(g, -1);  // (it ends before the dh quantize overwrites dY's copies)
    { auto s = bwd("dSwiGLU*prob (bf16)");
      cuda::dswiglu(da_, h1_, Mp_, F_, dh_, st_bwd(), stream_, prow_, dpart_); }
    { auto s = bwd("quantize dh (row + col)");
      quantize_col(dh_, 2 * F_, sb, colA_.codes, colA_.scales, rowA_.codes, rowA_.scales, st_bwd(), stream_); }
    log(MoePass::kBackward, CastKind::kQuantize, "quantize dh (row + col, from BF16)", 1, 2, Mp_ * 2 * F_);
    fp8_gemm1_grads(g, xc_, -1);
  }

  // The FP8 recipes' backward GEMMs, each dgrad with the wgrad that reads the same gradient
  // (grad_pair; `side`: the side event the wgrad waits for, or -1). GEMM2: dgrad from dY row-wise
  // (rowA_) into da_, wgrad from dY's and a''s column copies (colA_, ac_) into dW2. GEMM1: dgrad
  // from dh row-wise (rowA_) into the dX rows (o_), then ep_combine_dx_begin; wgrad from dh's
  // column copy (colA_) and x_perm's (`xcol`) into dW1.
  void fp8_gemm2_grads(const MoeGrads& g, int side) {
    grad_pair(side, [&] {
      auto s = bwd("GEMM2 dgrad (fp8)");
      const Fp8Op dyo = act_operand(rowA_, H_, st_bwd_aux());
      gg_->dgrad(seg_, H_, F_, dyo, w2t_op(), ms<bf16_t>(da_, Mp_ * F_), stream_);
    }, [&](GroupedGemm& gg, cudaStream_t ws) {
      if (!g.dw2) return;
      auto s = bwd("GEMM2 wgrad (fp8)", ws);
      const Fp8Op dyc = col_operand(colA_, H_, col32A_, ws);
      const Fp8Op acc = col_operand(ac_, F_, col32B_, ws);
      gg.wgrad(seg_, H_, F_, dyc, acc, dw_out(g.dw2, int64_t(El_) * H_ * F_), ws);
    });
  }
  void fp8_gemm1_grads(const MoeGrads& g, const Fp8Buf& xcol, int side) {
    grad_pair(side, [&] {
      { auto s = bwd("GEMM1 dgrad (fp8)");
        const Fp8Op dho = act_operand(rowA_, 2 * F_, st_bwd_aux());
        gg_->dgrad(seg_, 2 * F_, H_, dho, w1t_op(), ms<bf16_t>(o_, Mp_ * H_), stream_); }
      ep_combine_dx_begin();
    }, [&](GroupedGemm& gg, cudaStream_t ws) {
      if (!g.dw1) return;
      auto s = bwd("GEMM1 wgrad (fp8)", ws);
      const Fp8Op dhc = col_operand(colA_, 2 * F_, col32A_, ws);
      const Fp8Op xc = col_operand(xcol, H_, col32B_, ws);
      gg.wgrad(seg_, 2 * F_, H_, dhc, xc, dw_out(g.dw1, int64_t(El_) * 2 * F_ * H_), ws);
    });
  }

  // fp8-naive column copy: dequantize (row, FP32 scales, expert-packed) -> transpose ->
  // quantize column-wise with fresh FP32 scales. Codes into `col`, scales into `col32`.
  void naive_col(const F32sBuf& row, int64_t c, uint8_t* col, float* col32, const std::string& what) {
    const SegmentBlocks sb = blocks();
    naive_dequantize_row(row.codes, row.scales, Mp_, c, poff(), El_, work1_, stream_);
    log(MoePass::kBackward, CastKind::kDequantize, "dequantize " + what + " (for its column copy)", 1, 1, Mp_ * c);
    transpose_bf16(work1_, Mp_, c, work2_, stream_);
    naive_quantize_transposed(work2_, c, sb, col, col32, st_bwd(), stream_);
    log(MoePass::kBackward, CastKind::kQuantize, "quantize " + what + " col (transposed, FP32 scales)", 1, 1,
        Mp_ * c);
  }

  void backward_naive(const bf16_t* dy, const MoeGrads& g) {
    bf16_t* dy2 = o_;
    naive_entry(MoePass::kBackward, dy, dy2);
    const F32sBuf dyr{rowA_.codes, act32_};
    { auto s = bwd("quantize dY (row, fp32 scales)");
      naive_quantize_row(dy2, Mp_, H_, poff(), El_, dyr.codes, dyr.scales, st_bwd(), stream_); }
    log(MoePass::kBackward, CastKind::kQuantize, "quantize dY (row, FP32 scales)", 1, 1, Mp_ * H_);
    { auto s = bwd("DQ->T->Q dY"); naive_col(dyr, H_, colA_.codes, col32A_, "dY"); }
    { auto s = bwd("GEMM2 dgrad (fp8)");
      gg_->dgrad(seg_, H_, F_, Fp8Op{cs<uint8_t>(dyr.codes, Mp_ * H_), cs<float>(dyr.scales, Mp_ * H_ / 128)},
                 w2t_op(), ms<bf16_t>(da_, Mp_ * F_), stream_); }
    { auto s = bwd("DQ->T->Q a'"); naive_col(an_, F_, colB_.codes, col32B_, "a'"); }
    if (g.dw2) { auto s = bwd("GEMM2 wgrad (fp8)");
      gg_->wgrad(seg_, H_, F_, Fp8Op{cs<uint8_t>(colA_.codes, H_ * Mp_), cs<float>(col32A_, NB_ * H_)},
                 Fp8Op{cs<uint8_t>(colB_.codes, F_ * Mp_), cs<float>(col32B_, NB_ * F_)},
                 dw_out(g.dw2, int64_t(El_) * H_ * F_), stream_); }
    { auto s = bwd("dSwiGLU*prob (bf16)");
      cuda::dswiglu(da_, h1_, Mp_, F_, dh_, st_bwd(), stream_, prow_, dpart_); }
    const F32sBuf dhr{rowA_.codes, act32_};
    { auto s = bwd("quantize dh (row, fp32 scales)");
      naive_quantize_row(dh_, Mp_, 2 * F_, poff(), El_, dhr.codes, dhr.scales, st_bwd(), stream_); }
    log(MoePass::kBackward, CastKind::kQuantize, "quantize dh (row, FP32 scales)", 1, 1, Mp_ * 2 * F_);
    { auto s = bwd("DQ->T->Q dh"); naive_col(dhr, 2 * F_, colA_.codes, col32A_, "dh"); }
    { auto s = bwd("GEMM1 dgrad (fp8)");
      gg_->dgrad(seg_, 2 * F_, H_, Fp8Op{cs<uint8_t>(dhr.codes, Mp_ * 2 * F_), cs<float>(dhr.scales, Mp_ * 2 * F_ / 128)},
                 w1t_op(), ms<bf16_t>(o_, Mp_ * H_), stream_); }
    ep_combine_dx_begin();
    { auto s = bwd("DQ->T->Q x_perm"); naive_col(xn_, H_, colB_.codes, col32B_, "x_perm"); }
    if (g.dw1) { auto s = bwd("GEMM1 wgrad (fp8)");
      gg_->wgrad(seg_, 2 * F_, H_, Fp8Op{cs<uint8_t>(colA_.codes, 2 * F_ * Mp_), cs<float>(col32A_, NB_ * 2 * F_)},
                 Fp8Op{cs<uint8_t>(colB_.codes, H_ * Mp_), cs<float>(col32B_, NB_ * H_)},
                 dw_out(g.dw1, int64_t(El_) * 2 * F_ * H_), stream_); }
  }

  void backward_flow(const bf16_t* dy, const MoeGrads& g) {
    const bool fp4 = cfg_.recipe == Recipe::kFlowFp4;
    const SegmentBlocks sb = blocks();
    { auto s = bwd("quantize dy (entry)"); quantize_row(dy, T_, H_, ent_.codes, ent8s_, st_bwd(), stream_); }
    log(MoePass::kBackward, CastKind::kQuantize, "quantize dy (row 1x128, entry)", 1, 1, T_ * H_);
    const Fp8Buf dyr = rowA_;
    { auto s = bwd(comm_ ? "dispatch dy (fp8)" : "permute+pad dy (fp8)");
      move_fp8(ent_.codes, ent8s_, dyr.codes, dyr.scales, MoePass::kBackward, "dispatch dy"); }
    {  // the wgrad copies on the side stream: dY's next to GEMM2 dgrad (both read dY row-wise),
       // then x_perm's next to everything up to GEMM1 wgrad (colB_ is free until then)
      cudaStream_t ts = fork();
      {
        {
          auto s = bwd(overlap_ ? "scaling-aware transpose dY (side stream)" : "scaling-aware transpose dY", ts);
          scaling_aware_transpose(dyr.codes, dyr.scales, H_, sb, colA_.codes, colA_.scales, st_bwd(), ts,
                                  cfg_.transpose_exponent);
        }
        mark(kSideA);
      }
      if (!fp4) {
        auto s = bwd(overlap_ ? "scaling-aware transpose x_perm (side stream)" : "scaling-aware transpose x_perm", ts);
        scaling_aware_transpose(xr_.codes, xr_.scales, H_, sb, colB_.codes, colB_.scales, st_bwd(), ts,
                                cfg_.transpose_exponent);
      } else {
        auto s = bwd(overlap_ ? "FP4RowToFP8Col x_perm (side stream)" : "FP4RowToFP8Col x_perm", ts);
        fp4_to_fp8_col(x4c_, x4s_, H_, sb, colB_.codes, colB_.scales, st_bwd(), ts);
      }
      mark(kSideB);
    }
    log(MoePass::kBackward, CastKind::kConvert, "scaling-aware transpose dY (wgrad copy)", 1, 1, Mp_ * H_);
    fp8_gemm2_grads(g, kSideA);  // dY row in dyr (= rowA_); the wgrad after dY's column copy
    // the pair has ended (the dSwiGLU below overwrites dY's row and column copies)
    join(kSideA);  // (also when there is no wgrad of W2: the transpose read dY row)
    if (!fp4) {
      auto s = bwd("dSwiGLU*prob + quantize (dh row + col, from fp8 h)");
      dswiglu_quant_fp8h(da_, hr_.codes, hr_.scales, F_, sb, rowA_.codes, rowA_.scales, colA_.codes, colA_.scales,
                         st_bwd(), stream_, prow_, dpart_);
    } else {
      auto s = bwd("dSwiGLU*prob + quantize (dh row + col, from mxfp4 h)");
      dswiglu_quant_fp4h(da_, hr_.codes, hr_.scales, F_, sb, rowA_.codes, rowA_.scales, colA_.codes, colA_.scales,
                         st_bwd(), stream_, prow_, dpart_);
    }
    log(MoePass::kBackward, CastKind::kFused, "dSwiGLU*prob + quantize (dh row + col)", 1, 2, Mp_ * 2 * F_);
    if (!fp4)
      log(MoePass::kBackward, CastKind::kConvert, "scaling-aware transpose x_perm (wgrad copy)", 1, 1, Mp_ * H_);
    else
      log(MoePass::kBackward, CastKind::kConvert, "FP4RowToFP8Col x_perm (wgrad copy)", 1, 1, Mp_ * H_);
    fp8_gemm1_grads(g, colB_, kSideB);  // the wgrad after x_perm's column copy
    join(kSideB);  // the side stream idle before the next forward reuses x_perm (also without dW1)
  }

  // EP: called by every recipe's backward right after GEMM1 dgrad wrote the dX rows (o_) and
  // before GEMM1 wgrad: sums each row's dprob partials and marks the point (ev_dx_), so that
  // backward_router can send the rows while the wgrad (enqueued meanwhile, and touching none of
  // o_, ep_dprow_, ep_send_, ep_send_p_) runs on the GPU.
  void ep_combine_dx_begin() {
    if (!comm_) {  // one GPU: the tail stream starts here (backward_router)
      if (tail_) {
        FLOWMOE_CUDA_CHECK(cudaEventRecord(ev_dx_, stream_));
        dx_ready_marked_ = true;
      }
      return;
    }
    ep_sum_row_dprobs(dpart_, F_ / 128, Mp_, ep_dprow_, stream_);
    FLOWMOE_CUDA_CHECK(cudaEventRecord(ev_dx_, stream_));
    dx_ready_marked_ = true;
  }

  // ---- the common tail: dprobs, router backward, dx = unpermute(dXp) + router path --------------
  void backward_router(const MoeGrads& g, bf16_t* dx) {
    const RouterConfig rc = cfg_.router_config();
    const bf16_t* rows = o_;                 // dX rows, [Mp, H] padded (one GPU)
    const int32_t* map = routing_.row_map;
    cudaStream_t rs = stream_;  // the stream of the tail below
    if (!comm_ && tail_) {     // one GPU: from the dX rows on, next to GEMM1 wgrad
      FLOWMOE_CHECK(dx_ready_marked_, "MoeLayer::backward: internal error: the recipe did not mark the dX rows");
      dx_ready_marked_ = false;
      FLOWMOE_CUDA_CHECK(cudaStreamWaitEvent(tail_, ev_dx_, 0));
      rs = tail_;
    }
    if (comm_) {
      // combine: the dX rows (BF16) and each row's d loss / d prob (FP32, summed over the F/128
      // partial sums here, in gather_row_dprobs' order) go back to the token's rank in one
      // exchange, into send order; the slot sums then run there, in slot order, as on one GPU.
      // Waits (host) for the dX rows only, not for GEMM1 wgrad queued behind them: the exchange
      // runs while the wgrad computes; the stage's events on stream_ show what stays exposed.
      auto s = bwd("combine dX rows + dprob (exposed; overlaps GEMM1 wgrad)");
      FLOWMOE_CHECK(dx_ready_marked_, "MoeLayer::backward: internal error: the recipe did not mark the dX rows");
      dx_ready_marked_ = false;
      FLOWMOE_CUDA_CHECK(cudaEventSynchronize(ev_dx_));
      ++host_syncs_;
      bf16_t* back = reinterpret_cast<bf16_t*>(ep_send_);
      combine_rows(*comm_, plan_, {{o_, back, 2 * H_}, {ep_dprow_, ep_send_p_, int64_t(sizeof(float))}},
                   direct_bytes_);
      comm_->synchronize();
      log_combine(MoePass::kBackward, "combine dX rows + dprob", "bf16 + fp32 dprob",
                  2 * H_ + int64_t(sizeof(float)));
      rows = back;
      map = routing_.row_map_unpadded;
    }
    { auto s = bwd(rs == stream_ ? "router backward (dprobs, dlogits)" : "router backward (dprobs, dlogits; tail stream)", rs);
      if (comm_ == nullptr)
        gather_row_dprobs(dpart_, F_ / 128, Mp_, routing_.row_map, T_, K_, dprobs_, rs);
      else  // one "tile": the sums that came back (x + nothing = x, canonicalised as on one GPU)
        gather_row_dprobs(ep_send_p_, 1, plan_.send_rows(), map, T_, K_, dprobs_, rs);
      router_backward(logits_, T_, rc, ids_, dprobs_, cfg_.aux_loss_alpha > 0.0f ? aux_coef_ : nullptr, 1.0f,
                      dlogits_, rs); }
    if (g.dwr) { auto s = bwd(rs == stream_ ? "router dWr" : "router dWr (tail stream)", rs);
      // overwrite: the kernel adds in a fixed order to what is there, so start from zeros (the
      // CPU layer does the same: 0 + sum, so -0 sums give +0 in both)
      if (!g.accumulate) FLOWMOE_CUDA_CHECK(cudaMemsetAsync(g.dwr, 0, sizeof(float) * size_t(E_) * H_, rs));
      router_dwr(dlogits_, x_, T_, E_, H_, g.dwr, rs); }
    { auto s = bwd(rs == stream_ ? "unpermute dx + router path" : "unpermute dx + router path (tail stream)", rs);
      combine_dx(rows, map, T_, K_, dlogits_, wr_, E_, H_, dx, rs); }
    if (rs != stream_) {  // stream_ (the caller's) orders everything after the tail again
      FLOWMOE_CUDA_CHECK(cudaEventRecord(ev_tail_, rs));
      FLOWMOE_CUDA_CHECK(cudaStreamWaitEvent(stream_, ev_tail_, 0));
    }
  }

  // ---- state -----------------------------------------------------------------------------------
  cudaStream_t stream_;
  const int E_;
  const int64_t H_, F_;
  const int K_;
  const int El_;               // experts held here: E_ alone, E_ / ranks with a communicator
  Communicator* const comm_;   // null: single GPU, all experts local
  const int64_t Tm_, R_, MB_;
  // expert parallelism (comm_ set)
  DispatchPlan plan_;                  // of the latest forward (backward reuses it)
  int32_t* d_loff_ = nullptr;          // [El+1] device: padded offsets of the local segments
  int32_t* h_loff_ = nullptr;          // [El+1] pinned host copy
  uint8_t* ep_send_ = nullptr;         // [T*k, 2H] bytes: send-order rows; combines land here too
  uint8_t* ep_send_sc_ = nullptr;      // [T*k, 4*H/128] bytes: send-order scales
  float* ep_send_p_ = nullptr;         // [T*k]: send-order probs; backward: dprobs coming back
  uint8_t* ep_recv_sc_ = nullptr;      // [R, 4*H/128] bytes: received row-major scales
  float* ep_dprow_ = nullptr;          // [R]: d loss / d prob of each received row
  int64_t held_ = 0;                   // routed rows the local experts hold (= routed_ alone)
  std::vector<void*> allocs_;
  size_t allocated_ = 0, gg_workspace_ = 0;
  std::unique_ptr<GroupedGemm> gg_;
  std::unique_ptr<GroupedGemm> gw_;   // the wgrads' GEMM object when they run on wstream_
  cudaStream_t wstream_ = nullptr;    // the wgrad stream (FLOWMOE_LAYER_WGRAD_OVERLAP=1; never fp8-naive)
  cudaEvent_t wevents_[2] = {};       // fork, join
  bool wconc_ = false;                // this backward runs the wgrads on wstream_
  int64_t backwards_ = 0;             // backward calls so far
  bool have_weights_ = false, have_forward_ = false, backward_done_ = false, has_bias_ = false;
  // per call
  int64_t T_ = 0, Mp_ = 0, routed_ = 0, NB_ = 0;
  Segments seg_;
  int64_t host_syncs_ = 0;
  // routing
  bf16_t* x_ = nullptr;
  float *logits_ = nullptr, *dlogits_ = nullptr, *probs_ = nullptr, *dprobs_ = nullptr;
  int32_t* ids_ = nullptr;
  Routing routing_;
  uint8_t* aux_ws_ = nullptr;
  float *aux_coef_ = nullptr, *loss_ = nullptr, *prow_ = nullptr, *dpart_ = nullptr;
  int32_t *bstart_ = nullptr, *bend_ = nullptr, *boff_ = nullptr;
  DeviceStatus *status_ = nullptr, *wstatus_ = nullptr;
  int32_t* h_counts_ = nullptr;
  DeviceStatus* h_status_ = nullptr;
  float* h_loss_ = nullptr;
  // weights
  float *wr_ = nullptr, *bias_ = nullptr;
  bf16_t *w1b_ = nullptr, *w2b_ = nullptr, *scratch_bf16_wr_ = nullptr;
  F32sBuf w1_, w1t_, w2_, w2t_;  // FP8 codes + GEMM-ready FP32 scales
  uint8_t *w1s8_ = nullptr, *w1ts8_ = nullptr, *w2s8_ = nullptr, *w2ts8_ = nullptr;
  // activations
  bf16_t *o_ = nullptr, *h1_ = nullptr, *abuf_ = nullptr, *xp_ = nullptr, *da_ = nullptr, *dh_ = nullptr;
  Fp8Buf rowA_, colA_, colB_, xc_, ac_, xr_, hr_, ent_;
  uint8_t *ent8s_ = nullptr, *ent4c_ = nullptr, *ent4s_ = nullptr, *x4c_ = nullptr, *x4s_ = nullptr;
  float *act32_ = nullptr, *col32A_ = nullptr, *col32B_ = nullptr, *ent32_ = nullptr;
  bf16_t *entb_ = nullptr, *work1_ = nullptr, *work2_ = nullptr;
  F32sBuf xn_, an_;
  // report, status, profiling
  mutable CastReport rep_;
  mutable MoeStatus mstatus_;
  mutable bool stats_valid_ = false;
  bool profiling_ = false;
  std::vector<cudaEvent_t> events_;
  // side stream of flow / flow-fp4 (see fork / mark / join)
  enum { kSideFork, kSideA, kSideB, kSideEvents };
  bool overlap_ = false;
  cudaStream_t side_ = nullptr;
  cudaEvent_t side_events_[kSideEvents] = {};
  bool grads_accumulate_ = true;  // MoeGrads::accumulate of the backward running
  // deduplicated EP dispatch (FLOWMOE_EP_DEDUP, default on; not for fp8-naive): see dd_dispatch
  bool dedup_ = false;
  int64_t direct_bytes_ = -1;     // dispatch_rows / combine_rows message grouping (read once)
  int combine_chunks_ = 1;        // the forward's GEMM2 + combine pipeline (gemm2_then_combine)
  cudaEvent_t ev_chunk_[kMaxCombineChunks] = {};
  int32_t* h_tok_ = nullptr;      // [W] tokens to each rank (pinned)
  int32_t* dd_peer_ids_ = nullptr;
  Routing prt_;                   // this rank's tokens over the W ranks
  Routing rrt_;                   // received tokens over the El local experts
  int32_t* dd_send_ids_ = nullptr;
  float* dd_send_p_ = nullptr;
  uint8_t* dd_recv_ = nullptr;
  uint8_t* dd_recv_sc_ = nullptr;
  uint8_t* dd_recv_scc_ = nullptr;
  int32_t* dd_recv_ids_ = nullptr;
  float* dd_recv_p_ = nullptr;
  int32_t* dd_local_ids_ = nullptr;
  int64_t dd_recv_tokens_ = 0;    // tokens received by the last forward's dispatch
  cudaEvent_t ev_dx_ = nullptr;  // the dX rows (EP: and their dprobs) are ready (ep_combine_dx_begin)
  cudaStream_t tail_ = nullptr;  // one GPU: the backward's tail next to GEMM1 wgrad (highest priority)
  cudaEvent_t ev_tail_ = nullptr;
  bool dx_ready_marked_ = false;
  int ev_used_ = 0;
  std::vector<Stage> stages_fwd_, stages_bwd_;
};

CudaMoeLayer* as_cuda(MoeLayer* l) {
  CudaMoeLayer* c = dynamic_cast<CudaMoeLayer*>(l);
  FLOWMOE_CHECK(c != nullptr, "cuda::moe: the layer is not a CUDA layer (backend "
                                  << (l ? l->backend() : "null") << "); expected one made by make_cuda_layer");
  return c;
}
const CudaMoeLayer* as_cuda(const MoeLayer* l) { return as_cuda(const_cast<MoeLayer*>(l)); }

}  // namespace

bool is_cuda_layer(const MoeLayer* layer) { return dynamic_cast<const CudaMoeLayer*>(layer) != nullptr; }
void set_profiling(MoeLayer* layer, bool on) { as_cuda(layer)->set_profiling(on); }
std::vector<StageTime> stage_times(const MoeLayer* layer) { return as_cuda(layer)->stage_times(); }
size_t allocated_bytes(const MoeLayer* layer) { return as_cuda(layer)->allocated_bytes(); }
LayerCounters counters(const MoeLayer* layer) { return as_cuda(layer)->counters(); }
void fill_normal_f32(float* p, int64_t n, uint64_t seed, float stddev, cudaStream_t stream) {
  fill_normal(p, nullptr, n, seed, stddev, stream);
}
void fill_normal_bf16(bf16_t* p, int64_t n, uint64_t seed, float stddev, cudaStream_t stream) {
  fill_normal(nullptr, p, n, seed, stddev, stream);
}

}  // namespace moe
}  // namespace cuda

std::unique_ptr<MoeLayer> make_cuda_layer(const MoeConfig& cfg, cudaStream_t stream) {
  if (cfg.comm == nullptr) {
    cfg.validate();
    return std::unique_ptr<MoeLayer>(new cuda::moe::CudaMoeLayer(cfg, stream));
  }
  // Expert parallelism (docs/EP.md §6): collective, as make_cpu_layer. First the configuration
  // across ranks (a mismatch is a CommError on every rank), then each rank's own checks and
  // allocation, agreed on by every rank, so that nobody is left waiting in a later collective.
  Communicator& comm = *cfg.comm;
  const char* what = "make_cuda_layer";
  ep_detail::check_uniform_config(comm, what, cfg,
                                  {{"deduplicated dispatch (FLOWMOE_EP_DEDUP)", cuda::moe::ep_dedup_from_env() ? 1 : 0},
                                   {"FLOWMOE_EP_DIRECT_BYTES", ep_direct_bytes_from_settings(env_lookup())},
                                   {"FLOWMOE_EP_COMBINE_CHUNKS", cuda::moe::ep_combine_chunks_from_env()}});
  std::unique_ptr<MoeLayer> layer;
  collective_checks(&comm, what, [&] {
    cfg.validate();
    FLOWMOE_CHECK(comm.memory_space() == MemorySpace::kDevice,
                  what << ": the CUDA layer moves device memory but the communicator ("
                       << comm.backend() << ") moves host memory; expected a device-memory "
                          "communicator (NCCL, or make_device_sim_world's ranks)");
    layer.reset(new cuda::moe::CudaMoeLayer(cfg, stream));
  });
  return layer;
}

}  // namespace flowmoe
