// The CUDA layer's backward tail, common to every recipe: from the dX rows of GEMM1 dgrad to the
// router backward (dprobs, dlogits), dWr and dx = unpermute(dX rows) + router path. One GPU: on the
// tail stream next to GEMM1 wgrad (CudaLayerOptions::tail_stream). EP: the dX rows and their dprobs
// travel back to the tokens' ranks first (while GEMM1 wgrad computes).
#include <cuda_runtime.h>

#include "cuda/common.cuh"
#include "cuda/moe/layer.h"

namespace flowmoe {
namespace cuda {
namespace moe {

void StepContext::backward_tail(const MoeGrads& g, bf16_t* dx) {
  RoutingBuffers& r = ws_.routing;
  const RouterConfig rc = cfg_.router_config();
  const bool external = cfg_.external_routing;  // no router: dprobs to the caller, no dlogits, no dWr
  const bf16_t* rows = ws_.expert.rows_bf16;  // [Mp, H] padded (one GPU)
  const int32_t* map = r.tokens.row_map;
  cudaStream_t rs = stream_;  // the stream of the tail below
  if (!comm_ && streams_->tail()) {  // one GPU: from the dX rows on, next to GEMM1 wgrad
    FLOWMOE_CHECK(dx_ready_marked_, "MoeLayer::backward: internal error: the recipe did not mark the dX rows");
    dx_ready_marked_ = false;
    FLOWMOE_CUDA_CHECK(cudaStreamWaitEvent(streams_->tail(), streams_->dx_ready(), 0));
    rs = streams_->tail();
  }
  if (device_ep()) {  // the same combine as pulls, after GEMM1 wgrad on the layer's stream, no host wait
    auto s = bwd("combine dX rows + dprob (after GEMM1 wgrad)");
    EpBuffers& ep = ws_.ep;
    FLOWMOE_CHECK(dx_ready_marked_, "MoeLayer::backward: internal error: the recipe did not mark the dX rows");
    dx_ready_marked_ = false;
    pull_exchange(ep.combine_pieces, combine_piece_count(),
                  {{rows, ep.combined_rows, 2 * H_}, {ep.row_dprob, ep.combined_dprobs, int64_t(sizeof(float))}}, rs);
    pending_wire_->push_back({PendingWire::kCombine, MoePass::kBackward, report_names::kCombineDx,
                             report_names::kCombineDxFormat, WireFormat::kBf16, 2 * H_ + int64_t(sizeof(float))});
    rows = ep.combined_rows;
    map = r.tokens.row_map_unpadded;
  } else if (comm_) {
    // combine: the dX rows (BF16) and each row's d loss / d prob (FP32, summed over the F/128
    // partial sums in gather_row_dprobs' order) go back to the token's rank in one exchange, into
    // send order; the slot sums then run there, in slot order, as on one GPU. Waits (host) for the
    // dX rows only, not for GEMM1 wgrad queued behind them: the exchange runs while the wgrad
    // computes; the stage's events on stream_ show what stays exposed.
    auto s = bwd("combine dX rows + dprob (exposed; overlaps GEMM1 wgrad)");
    FLOWMOE_CHECK(dx_ready_marked_, "MoeLayer::backward: internal error: the recipe did not mark the dX rows");
    dx_ready_marked_ = false;
    FLOWMOE_CUDA_CHECK(cudaEventSynchronize(streams_->dx_ready()));
    ++*host_syncs_;
    EpBuffers& ep = ws_.ep;
    combine_rows(*comm_, step_.plan,
                 {{rows, ep.combined_rows, 2 * H_}, {ep.row_dprob, ep.combined_dprobs, int64_t(sizeof(float))}},
                 direct_bytes_);
    comm_->synchronize();
    log_combine(MoePass::kBackward, report_names::kCombineDx, report_names::kCombineDxFormat,
                2 * H_ + int64_t(sizeof(float)));
    rows = ep.combined_rows;
    map = r.tokens.row_map_unpadded;
  }
  const bool on_tail = rs != stream_;
  { auto s = bwd(on_tail ? "router backward (dprobs, dlogits; tail stream)" : "router backward (dprobs, dlogits)", rs);
    if (comm_ == nullptr)
      gather_row_dprobs(r.dprob_partials, F_ / 128, step_.Mp, r.tokens.row_map, step_.T, K_, r.dprobs, rs);
    else  // one "tile": the sums that came back (x + nothing = x, canonicalised as on one GPU)
      gather_row_dprobs(ws_.ep.combined_dprobs, 1, device_ep() ? step_.T * K_ : step_.plan.send_rows(), map, step_.T, K_, r.dprobs,
                        rs);
    if (g.dprobs)
      FLOWMOE_CUDA_CHECK(cudaMemcpyAsync(g.dprobs, r.dprobs, sizeof(float) * step_.T * K_, cudaMemcpyDeviceToDevice, rs));
    if (!external)
      router_backward(r.logits, step_.T, rc, r.ids, r.dprobs, cfg_.aux_loss_alpha > 0.0f ? r.aux_coef : nullptr, 1.0f,
                      r.dlogits, rs); }
  if (g.dwr && !external) { auto s = bwd(on_tail ? "router dWr (tail stream)" : "router dWr", rs);
    // overwrite: the kernel adds in a fixed order to what is there, so start from zeros (the CPU
    // layer does the same: 0 + sum, so -0 sums give +0 in both)
    if (!g.accumulate) FLOWMOE_CUDA_CHECK(cudaMemsetAsync(g.dwr, 0, sizeof(float) * size_t(E_) * H_, rs));
    router_dwr(r.dlogits, r.x, step_.T, E_, H_, g.dwr, rs); }
  { auto s = bwd(on_tail ? "unpermute dx + router path (tail stream)" : "unpermute dx + router path", rs);
    // external routing: dx is the expert path only (the caller back-propagates dprobs)
    combine_dx(rows, map, step_.T, K_, external ? nullptr : r.dlogits, external ? nullptr : router_weights(), E_, H_, dx,
               rs); }
  if (on_tail) streams_->join_tail();  // stream_ (the caller's) orders everything after the tail again
}

}  // namespace moe
}  // namespace cuda
}  // namespace flowmoe
