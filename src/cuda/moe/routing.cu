// The CUDA layer's routing (every recipe): router logits, top-k, aux loss, the routing tables, the
// one host synchronisation of a forward (the per-expert counts the grouped GEMM's per-expert
// launches need on the host; none with sync_free) and, with expert parallelism, the dispatch plan
// (sync_free: made on the device, plan_on_device below; its kernels in ep_device.cu).
#include <cuda_runtime.h>

#include <algorithm>
#include <vector>

#include "cuda/common.cuh"
#include "cuda/moe/layer.h"

namespace flowmoe {
namespace cuda {
namespace moe {

void StepContext::route(const bf16_t* x) {
  RoutingBuffers& r = ws_.routing;
  EpBuffers& ep = ws_.ep;
  const RouterConfig rc = cfg_.router_config();
  if (cfg_.external_routing) {  // the caller's ids and probs: no logits, no top-k, no aux loss
    auto s = fwd("routing from the caller (ids, probs)");
    FLOWMOE_CUDA_CHECK(cudaMemcpyAsync(r.x, x, sizeof(bf16_t) * step_.T * H_, cudaMemcpyDeviceToDevice, stream_));
    FLOWMOE_CUDA_CHECK(cudaMemcpyAsync(r.ids, routing_ids_, sizeof(int32_t) * step_.T * K_, cudaMemcpyDeviceToDevice, stream_));
    FLOWMOE_CUDA_CHECK(cudaMemcpyAsync(r.probs, routing_probs_, sizeof(float) * step_.T * K_, cudaMemcpyDeviceToDevice, stream_));
  } else {
    auto s = fwd("router (logits GEMM, top-k, aux loss)");
    FLOWMOE_CUDA_CHECK(cudaMemcpyAsync(r.x, x, sizeof(bf16_t) * step_.T * H_, cudaMemcpyDeviceToDevice, stream_));
    router_logits(r.x, ws_.weights.wr, step_.T, E_, H_, r.logits, stream_);
    router_forward(r.logits, step_.T, rc, router_bias_, r.ids, r.probs, st_fwd(),
                   stream_);
    if (cfg_.aux_loss_alpha > 0.0f)
      router_aux_loss(r.logits, r.ids, step_.T, rc, cfg_.aux_loss_alpha, r.aux_loss, r.aux_coef, r.aux_workspace,
                      stream_);
  }
  if (path_.sync_free) {  // the counts stay on the device; a copy for the report, read when it is read
    auto s = fwd("routing tables");
    r.tokens.tokens = step_.T;
    build_routing(r.ids, r.tokens, st_fwd_aux(), stream_);
    FLOWMOE_CUDA_CHECK(cudaMemcpyAsync(r.host_counts, r.tokens.counts, sizeof(int32_t) * E_, cudaMemcpyDeviceToHost,
                                       stream_));
    if (comm_) plan_on_device();
    step_.Mp = max_rows_;
    step_.blocks = segment_max_blocks(step_.Mp, El_);
    step_.routed = step_.held = 0;  // unknown here (resolve_report)
    step_.seg = Segments();
    rep_->tokens = step_.T;
  } else {
    auto s = fwd("routing tables + count fetch (host sync)");
    r.tokens.tokens = step_.T;
    build_routing(r.ids, r.tokens, st_fwd_aux(), stream_);
    if (path_.ep_dedup) {  // tokens per destination rank, fetched by the same host sync
      ep.tokens_to_ranks.tokens = step_.T;
      if (step_.T > 0) {
        ep_peer_ids(r.ids, step_.T, K_, El_, ep.peer_ids, stream_);
        build_routing(ep.peer_ids, ep.tokens_to_ranks, nullptr, stream_);
        FLOWMOE_CUDA_CHECK(cudaMemcpyAsync(ep.host_tokens_to_rank, ep.tokens_to_ranks.counts,
                                           sizeof(int32_t) * comm_->world_size(), cudaMemcpyDeviceToHost,
                                           stream_));
      } else {
        std::fill(ep.host_tokens_to_rank, ep.host_tokens_to_rank + comm_->world_size(), 0);
      }
    }
    step_.Mp = fetch_routing_counts(r.tokens, r.host_counts, stream_);
    ++*host_syncs_;
    std::vector<int32_t> padded(E_);
    step_.routed = 0;
    for (int e = 0; e < E_; ++e) {
      step_.routed += r.host_counts[e];
      padded[e] = (r.host_counts[e] + cfg_.align - 1) / cfg_.align * cfg_.align;
    }
    if (comm_ == nullptr) {
      step_.seg = Segments::from_counts(padded);
      step_.held = step_.routed;
    } else {
      plan_expert_parallel();
    }
    step_.blocks = step_.seg.num_blocks();
    rep_->tokens = step_.T;
    rep_->routed_rows = step_.routed;
    rep_->padded_rows = step_.Mp;
  }
  {
    auto s = fwd("row probabilities + segment blocks");
    FLOWMOE_CUDA_CHECK(cudaMemsetAsync(r.row_prob, 0, sizeof(float) * std::max<int64_t>(step_.Mp, 1), stream_));
    // EP: the forward dispatch brings each received row's probability into row_prob
    if (comm_ == nullptr) scatter_row_probs(r.probs, r.tokens.row_map, step_.T, K_, r.row_prob, stream_);
    if (path_.segment_blocks && step_.Mp > 0) build_segment_blocks(blocks(), st_fwd_aux(), stream_);
  }
}

EpConfig ep_config(const MoeConfig& cfg) {
  EpConfig ec;
  ec.num_experts = cfg.num_experts;
  ec.topk = cfg.topk;
  ec.hidden = cfg.hidden;
  ec.align = cfg.align;
  ec.format = ep_detail::forward_wire_format(cfg.recipe);
  ec.with_probs = true;
  return ec;
}

// Expert parallelism: the plan from the per-expert counts just fetched (collective: count
// all-to-all), the CPU layer's plan (plan_dispatch_counts gives what plan_dispatch gives without the
// send routing, which lives on the device here as row_map_unpadded). From here on step_.Mp, step_.seg and
// the device offsets describe this rank's El local expert segments of the rows every rank sends.
void StepContext::plan_expert_parallel() {
  EpBuffers& ep = ws_.ep;
  auto s = fwd("dispatch plan (count all-to-all)");
  // the configuration was agreed on at construction (make_cuda_layer): one collective here
  step_.plan = plan_dispatch_counts(*comm_, ep_config(cfg_), ws_.routing.host_counts, step_.T, /*config_agreed=*/true,
                               path_.ep_dedup ? ep.host_tokens_to_rank : nullptr);
  step_.Mp = step_.plan.padded_rows();
  FLOWMOE_CHECK(step_.Mp <= max_rows_, "MoeLayer::forward: " << step_.Mp << " padded rows received; the workspaces hold "
                                      "max_rows() = " << max_rows_ << " (a rank passed T > max_tokens?)");
  step_.seg = step_.plan.padded_segments();
  step_.held = step_.plan.recv_rows();
  // The combines stage up to every padded row (2H + 4 bytes) through the communicator's scratch:
  // grow it here, at a point where the stream is idle anyway, not inside the backward's overlap of
  // combine and GEMM1 wgrad (growth waits for the device).
  comm_->scratch(step_.Mp * (2 * H_ + 4) + int64_t(4096) * comm_->world_size());
  std::copy(step_.plan.padded_offsets.begin(), step_.plan.padded_offsets.end(), ep.host_local_offsets);
  FLOWMOE_CUDA_CHECK(cudaMemcpyAsync(ep.local_offsets, ep.host_local_offsets, sizeof(int32_t) * (El_ + 1),
                                     cudaMemcpyHostToDevice, stream_));
}

// route(), after build_routing: every rank's counts (and, deduplicated, its tokens per rank) ->
// count_matrix / token_matrix -> the plan's local offsets and pieces; the matrices also go to
// pinned memory for the report (read when it is read).
void StepContext::plan_on_device() {
  auto s = fwd("dispatch plan (on the device)");
  RoutingBuffers& r = ws_.routing;
  EpBuffers& ep = ws_.ep;
  const int W = comm_->world_size();
  if (path_.ep_dedup) {
    ep.tokens_to_ranks.tokens = step_.T;
    ep_peer_ids(r.ids, step_.T, K_, El_, ep.peer_ids, stream_);
    build_routing(ep.peer_ids, ep.tokens_to_ranks, nullptr, stream_);
  }
  // A peer rewrites its counts only in its next forward, after barriers this rank reaches once the
  // gathers below have run: one barrier before them suffices.
  peers_->barrier(stream_);
  ep_gather_peer_ints(reinterpret_cast<const int32_t* const*>(peer_table(r.tokens.counts)), W, E_, ep.count_matrix,
                      stream_);
  if (path_.ep_dedup)
    ep_gather_peer_ints(reinterpret_cast<const int32_t* const*>(peer_table(ep.tokens_to_ranks.counts)), W, W,
                        ep.token_matrix, stream_);
  ep_device_plan(ep.count_matrix, path_.ep_dedup ? ep.token_matrix : nullptr, W, El_, comm_->rank(), cfg_.align,
                 ep.local_offsets, ep.dispatch_pieces, ep.combine_pieces, path_.ep_dedup ? ep.dedup_pieces : nullptr,
                 stream_);
  const int64_t n = int64_t(W) * E_ + (path_.ep_dedup ? int64_t(W) * W : 0);  // token_matrix follows count_matrix
  FLOWMOE_CUDA_CHECK(cudaMemcpyAsync(ep.host_matrices, ep.count_matrix, sizeof(int32_t) * n, cudaMemcpyDeviceToHost,
                                     stream_));
}

}  // namespace moe
}  // namespace cuda
}  // namespace flowmoe
