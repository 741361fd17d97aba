// The CUDA layer's token movement: token rows [T, H] to the padded rows [Mp, H] of the local
// experts and back. One GPU: permute+pad / unpermute (token.h). Expert parallelism (cfg.comm, a
// device-memory communicator; docs/EP.md §6): dispatch / combine in the recipe's wire format (the
// CPU layer's plan), deduplicated by default (CudaLayerOptions::ep_dedup). Step context services
// (step_context.h), which every pipeline calls.
#include <cuda_runtime.h>

#include <algorithm>
#include <string>
#include <vector>

#include "common/moe_ep.h"
#include "cuda/common.cuh"
#include "cuda/moe/step_context.h"
#include "flowmoe/cuda/copy_pieces.h"

namespace flowmoe {
namespace cuda {
namespace moe {

void StepContext::log_combine(MoePass pass, const std::string& name, const std::string& format,
                              int64_t row_bytes) {
  rep_->wire.push_back(ep_detail::combine_transfer(pass, name, format, row_bytes, step_.plan));
}

// One exchange of the communicator. Stream contract: the send buffers were written (and the
// receive buffers zeroed) on stream_, so stream_ is synchronised first; the communicator then
// moves the bytes (device SimWorld: blocking copies; NCCL: ordered on its own stream) and
// comm.synchronize() waits for them, so the work enqueued on stream_ afterwards reads complete
// rows whatever stream the communicator uses. One host sync of stream_ per exchange (counted)
// plus the communicator's.
void StepContext::ep_exchange(const std::function<void()>& fn) {
  FLOWMOE_CUDA_CHECK(cudaStreamSynchronize(stream_));
  ++*host_syncs_;
  fn();
  comm_->synchronize();
}

// EP: moves `streams` (send-order rows -> their padded rows on the experts' ranks) in one
// exchange, with the routing probabilities (FP32, into row_prob) in the forward; the padding rows
// of every receive buffer are zero.
void StepContext::ep_dispatch(MoePass pass, const char* name, WireFormat f, std::vector<RowStream> streams) {
  EpBuffers& ep = ws_.ep;
  if (pass == MoePass::kForward) {
    ep_gather_rows(ws_.routing.probs, int64_t(sizeof(float)), true, ws_.routing.tokens.row_map_unpadded, step_.T, K_,
                   ep.send_probs, stream_);
    streams.push_back({ep.send_probs, ws_.routing.row_prob, int64_t(sizeof(float))});
  }
  if (device_ep()) {  // the plan's pieces on the device, padding pieces zero-filled
    pull_exchange(ep.dispatch_pieces, dispatch_piece_count(), streams, stream_);
    pending_wire_->push_back({PendingWire::kDispatch, pass, name, "", f, 0});
    return;
  }
  const DispatchPlan p = ep_detail::plan_for(step_.plan, pass, f);
  // the exchange writes every row but the padding: one batched fill of El ranges per stream
  std::vector<CopyPiece> pad;
  for (const RowStream& st : streams)
    for (int l = 0; l < p.local_experts; ++l) {
      const int64_t first = int64_t(p.padded_offsets[l]) + p.expert_counts[l], end = p.padded_offsets[l + 1];
      if (end > first)
        pad.push_back({nullptr, static_cast<uint8_t*>(st.recv) + first * st.row_bytes, (end - first) * st.row_bytes});
    }
  cuda::comm::copy_pieces(pad, stream_);
  ep_exchange([&] { dispatch_rows(*comm_, p, streams, direct_bytes_); });
  rep_->wire.push_back(ep_detail::dispatch_transfer(pass, name, p));
}

// Deduplicated dispatch: each token travels once to each rank holding one of its experts
// (tokens_to_ranks.row_map gives its row among the rows to that rank, token order per rank); the
// forward adds its k expert ids and probabilities. The receiver routes the received tokens over
// its El experts (received_tokens: rank 0's tokens first, each rank's in token order, so the
// padded layout is the plan's, row for row) and then runs the one-GPU permute+pad kernels on
// them: the bits of the per-(token, expert) exchange, with at most min(W, k) rows per token on
// the wire instead of k. `streams`: the token rows already gathered by tokens_to_ranks.row_map
// (send) and the recv_* buffers, rank-major. One message per peer and stream; own rows by a
// local copy.
void StepContext::dedup_exchange(MoePass pass, const char* name, const std::string& format,
                                 std::vector<RowStream> streams) {
  EpBuffers& ep = ws_.ep;
  const bool fwd = pass == MoePass::kForward;
  const int W = comm_->world_size(), me = comm_->rank();
  if (fwd) {
    ep_gather_rows(ws_.routing.ids, int64_t(sizeof(int32_t)) * K_, false, ep.tokens_to_ranks.row_map, step_.T, K_,
                   ep.send_ids, stream_);
    ep_gather_rows(ws_.routing.probs, int64_t(sizeof(float)) * K_, false, ep.tokens_to_ranks.row_map, step_.T, K_,
                   ep.send_token_probs, stream_);
    streams.push_back({ep.send_ids, ep.recv_ids, int64_t(sizeof(int32_t)) * K_});
    streams.push_back({ep.send_token_probs, ep.recv_probs, int64_t(sizeof(float)) * K_});
  }
  int64_t row_bytes = 0;
  for (const RowStream& st : streams) row_bytes += st.row_bytes;
  const std::string wire_format =
      format + (fwd ? " + k ids + k probs" : "") + " (deduplicated: one row per token and rank)";
  if (device_ep()) {
    // the received tokens' count stays on the device: the slots past it keep ids -1 (no expert),
    // and the routing below runs over every slot (W * max_tokens)
    if (fwd)
      FLOWMOE_CUDA_CHECK(cudaMemsetAsync(ep.recv_ids, 0xFF, sizeof(int32_t) * size_t(W) * max_tokens_ * K_, stream_));
    pull_exchange(ep.dedup_pieces, W, streams, stream_);
    pending_wire_->push_back({PendingWire::kDedup, pass, name, wire_format, WireFormat::kBf16, row_bytes});
    if (fwd) route_received_tokens(int64_t(W) * max_tokens_);
    return;
  }
  std::vector<int64_t> so(W + 1, 0), ro(W + 1, 0);
  for (int p = 0; p < W; ++p) {
    so[p + 1] = so[p] + step_.plan.send_tokens[p];
    ro[p + 1] = ro[p] + step_.plan.recv_tokens[p];
  }
  FLOWMOE_CHECK(ro[W] <= int64_t(W) * max_tokens_,
                "MoeLayer: " << ro[W] << " tokens received; expected at most " << int64_t(W) * max_tokens_);
  std::vector<P2pOp> sends, recvs;
  std::vector<CopyPiece> own;
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
  if (fwd) route_received_tokens(ro[W]);
  rep_->wire.push_back(dedup_transfer(pass, name, wire_format, row_bytes, step_.plan));
}

// The received tokens (n slots: rank 0's first, each rank's in token order) over the local
// experts: the padded layout of the plan, row for row, and each row's probability.
void StepContext::route_received_tokens(int64_t n) {
  EpBuffers& ep = ws_.ep;
  step_.dedup_recv_tokens = n;
  Routing& rr = ep.received_tokens;
  rr.tokens = n;
  if (n == 0) return;
  ep_local_ids(ep.recv_ids, n, K_, El_, comm_->rank(), ep.recv_local_ids, stream_);
  build_routing(ep.recv_local_ids, rr, nullptr, stream_);
  scatter_row_probs(ep.recv_probs, rr.row_map, n, K_, ws_.routing.row_prob, stream_);
}

WireTransfer StepContext::dedup_transfer(MoePass pass, const std::string& name, const std::string& format,
                                         int64_t row_bytes, const DispatchPlan& plan) {
  WireTransfer w;
  w.pass = pass;
  w.name = name;
  w.format = format;
  for (int p = 0; p < plan.world; ++p)
    if (p != plan.rank) w.rows += plan.send_tokens[p];
  w.bytes = w.rows * row_bytes;
  return w;
}

// token rows [T, H] bf16 -> padded rows [Mp, H] bf16 of the local experts
void StepContext::move_bf16(const bf16_t* tok, bf16_t* rows, MoePass pass, const char* name) {
  const Routing& routing = ws_.routing.tokens;
  EpBuffers& ep = ws_.ep;
  if (comm_ == nullptr) {
    permute_pad_bf16(tok, H_, routing, rows, stream_);
    return;
  }
  if (path_.ep_dedup) {
    ep_gather_rows(tok, 2 * H_, false, ep.tokens_to_ranks.row_map, step_.T, K_, ep.send_rows, stream_);
    dedup_exchange(pass, name, "bf16", {{ep.send_rows, ep.recv_tokens, 2 * H_}});
    permute_pad_bf16(reinterpret_cast<const bf16_t*>(ep.recv_tokens), H_, ep.received_tokens, rows, stream_);
    return;
  }
  ep_gather_rows(tok, 2 * H_, false, routing.row_map_unpadded, step_.T, K_, ep.send_rows, stream_);
  ep_dispatch(pass, name, WireFormat::kBf16, {{ep.send_rows, rows, 2 * H_}});
}

// FP8 row-wise token rows (codes [T, H], scales [H/128][T]) -> rows: codes [Mp, H], scales
// [H/128][Mp]. EP wire format fp8: codes + UE8M0 scales row-major [rows][H/128] next to them; the
// receiver transposes the scales (as the CPU's ep_dispatch_fp8).
void StepContext::move_fp8(const QTensorView& tok, const QTensorView& rows, MoePass pass, const char* name) {
  const Routing& routing = ws_.routing.tokens;
  EpBuffers& ep = ws_.ep;
  if (comm_ == nullptr) {
    permute_pad_fp8(tok.codes, tok.ue8m0(), H_, routing, rows.codes, rows.ue8m0(), step_.Mp, stream_);
    return;
  }
  const int64_t nc = H_ / 128;
  if (path_.ep_dedup) {
    ep_gather_rows(tok.codes, H_, false, ep.tokens_to_ranks.row_map, step_.T, K_, ep.send_rows, stream_);
    ep_gather_col_scales(tok.ue8m0(), nc, 1, ep.tokens_to_ranks.row_map, step_.T, K_, ep.send_scales, stream_);
    dedup_exchange(pass, name, "fp8 + ue8m0 1x128 scales",
                   {{ep.send_rows, ep.recv_tokens, H_}, {ep.send_scales, ep.recv_token_scales, nc}});
    ep_transpose_scales(ep.recv_token_scales, step_.dedup_recv_tokens, nc, 1, ep.recv_token_scales_col,
                        std::max<int64_t>(step_.dedup_recv_tokens, 1), stream_);
    permute_pad_fp8(ep.recv_tokens, ep.recv_token_scales_col, H_, ep.received_tokens, rows.codes, rows.ue8m0(),
                    std::max<int64_t>(step_.Mp, 1), stream_);
    return;
  }
  ep_gather_rows(tok.codes, H_, false, routing.row_map_unpadded, step_.T, K_, ep.send_rows, stream_);
  ep_gather_col_scales(tok.ue8m0(), nc, 1, routing.row_map_unpadded, step_.T, K_, ep.send_scales, stream_);
  ep_dispatch(pass, name, WireFormat::kFp8, {{ep.send_rows, rows.codes, H_}, {ep.send_scales, ep.recv_scales, nc}});
  ep_transpose_scales(ep.recv_scales, step_.Mp, nc, 1, rows.ue8m0(), step_.Mp, stream_);
}

// MXFP4 token rows (codes [T, H/2], scales [T][H/32]) -> rows [Mp, H/2] + [Mp][H/32] (the wire
// layout is the final layout). Forward only.
void StepContext::move_mxfp4(const QTensorView& tok, const QTensorView& rows) {
  const Routing& routing = ws_.routing.tokens;
  EpBuffers& ep = ws_.ep;
  if (comm_ == nullptr) {
    permute_pad_mxfp4(tok.codes, tok.ue8m0(), H_, routing, rows.codes, rows.ue8m0(), stream_);
    return;
  }
  if (path_.ep_dedup) {
    ep_gather_rows(tok.codes, H_ / 2, false, ep.tokens_to_ranks.row_map, step_.T, K_, ep.send_rows, stream_);
    ep_gather_rows(tok.ue8m0(), H_ / 32, false, ep.tokens_to_ranks.row_map, step_.T, K_, ep.send_scales, stream_);
    dedup_exchange(MoePass::kForward, report_names::kDispatchX, "mxfp4 + ue8m0 1x32 scales",
                   {{ep.send_rows, ep.recv_tokens, H_ / 2}, {ep.send_scales, ep.recv_token_scales, H_ / 32}});
    permute_pad_mxfp4(ep.recv_tokens, ep.recv_token_scales, H_, ep.received_tokens, rows.codes, rows.ue8m0(),
                      stream_);
    return;
  }
  ep_gather_rows(tok.codes, H_ / 2, false, routing.row_map_unpadded, step_.T, K_, ep.send_rows, stream_);
  ep_gather_rows(tok.ue8m0(), H_ / 32, false, routing.row_map_unpadded, step_.T, K_, ep.send_scales, stream_);
  ep_dispatch(MoePass::kForward, report_names::kDispatchX, WireFormat::kMxfp4,
              {{ep.send_rows, rows.codes, H_ / 2}, {ep.send_scales, rows.scales, H_ / 32}});
}

// fp8-naive with EP: the entry codes and FP32 scales ([H/128][T]) travel (wire format
// fp8-fp32scale, scales row-major next to the codes), land in x_recv_f32's codes and recv_scales,
// the scales are transposed into x_recv_f32's scales ([H/128][Mp]) and the rows dequantized into
// out [Mp, H] bf16 (padding rows: code 0 x scale 0 = +0, the zero rows one GPU's permute+pad
// writes). Dequantization is element-wise, so this gives the bits of dequantize-then-permute.
void StepContext::move_naive(bf16_t* out, MoePass pass, const char* name) {
  const Routing& routing = ws_.routing.tokens;
  EpBuffers& ep = ws_.ep;
  const QTensorView& entry = ws_.expert.entry_f32;
  const QTensorView& recv = ws_.expert.x_recv_f32;
  const int64_t nc = H_ / 128;
  ep_gather_rows(entry.codes, H_, false, routing.row_map_unpadded, step_.T, K_, ep.send_rows, stream_);
  ep_gather_col_scales(entry.f32(), nc, 4, routing.row_map_unpadded, step_.T, K_, ep.send_scales, stream_);
  ep_dispatch(pass, name, WireFormat::kFp8Fp32Scale,
              {{ep.send_rows, recv.codes, H_}, {ep.send_scales, ep.recv_scales, 4 * nc}});
  ep_transpose_scales(ep.recv_scales, step_.Mp, nc, 4, recv.f32(), step_.Mp, stream_);
  dequantize_row_fp32_scale(recv.codes, recv.f32(), step_.Mp, H_, nullptr, El_, out, stream_);
}

// expert output rows [Mp, H] -> y [T, H] (plain sum in slot order; EP: the rows come back to the
// token's rank in send order first, and the sum runs there, as unpermute does)
void StepContext::combine_y(bf16_t* y) {
  const Routing& routing = ws_.routing.tokens;
  const bf16_t* rows = ws_.expert.rows_bf16;
  if (comm_ == nullptr) {
    unpermute_unpad(rows, nullptr, H_, routing, y, stream_);
    return;
  }
  bf16_t* back = ws_.ep.combined_rows;
  if (device_ep()) {
    pull_exchange(ws_.ep.combine_pieces, combine_piece_count(), {{rows, back, 2 * H_}}, stream_);
    pending_wire_->push_back({PendingWire::kCombine, MoePass::kForward, report_names::kCombineOutput,
                             report_names::kCombineOutputFormat, WireFormat::kBf16, 2 * H_});
  } else {
    ep_exchange([&] { combine_rows(*comm_, step_.plan, {{rows, back, 2 * H_}}, direct_bytes_); });
    log_combine(MoePass::kForward, report_names::kCombineOutput, report_names::kCombineOutputFormat, 2 * H_);
  }
  // the unpadded map addresses the send-order rows that just came back; same kernel and
  // arithmetic as unpermute_unpad (token.h)
  unpermute(back, nullptr, H_, routing, y, stream_);
}

// Called by every recipe's backward right after GEMM1 dgrad wrote the dX rows and before GEMM1
// wgrad: marks the point (dx_ready), so that the tail (one GPU: on the tail stream; EP: the
// combine, after each row's dprob partials are summed here) runs while the wgrad computes.
void StepContext::mark_dx_rows_ready() {
  if (!comm_) {
    if (streams_->tail()) {
      FLOWMOE_CUDA_CHECK(cudaEventRecord(streams_->dx_ready(), stream_));
      dx_ready_marked_ = true;
    }
    return;
  }
  ep_sum_row_dprobs(ws_.routing.dprob_partials, F_ / 128, step_.Mp, ws_.ep.row_dprob, stream_);
  FLOWMOE_CUDA_CHECK(cudaEventRecord(streams_->dx_ready(), stream_));
  dx_ready_marked_ = true;
}

}  // namespace moe
}  // namespace cuda
}  // namespace flowmoe
