// The CUDA layer's report (moe.h CastReport, MoeStatus): the tensors the forward saved, the
// operators and exchanges of a sync-free step resolved, the device status counters, and the stage
// times of moe_debug.h. (The operators are logged as they run: StepContext::log*, step_context.cu.)
#include <cuda_runtime.h>

#include "cuda/common.cuh"
#include "cuda/moe/layer.h"

namespace flowmoe {
namespace cuda {
namespace moe {

void CudaMoeLayer::save_rows(const std::string& name, const std::string& format, int64_t bytes, double per_row,
                             int64_t held) const {
  SavedTensor s;
  s.name = name;
  s.format = format;
  s.bytes = bytes;
  // the rows held here: this rank's routed rows (one GPU) or the rows its El experts received
  s.bytes_per_token_unpadded = per_row * double(held) / double(step_.T);
  rep_.saved.push_back(s);
}

// Bytes of a saved [Mp, cols] tensor in format f (column-wise: the scales of the real 128-row blocks).
int64_t CudaMoeLayer::saved_bytes(TensorFormat f, int64_t cols, const RowCounts& rc) const {
  const int64_t mp = rc.padded;
  switch (f) {
    case TensorFormat::kBf16: return mp * cols * 2;
    case TensorFormat::kFp8Row: return mp * cols + (cols / 128) * mp;
    case TensorFormat::kFp8Col: return mp * cols + rc.blocks * cols;
    case TensorFormat::kFp8RowFp32Scale: return mp * cols + 4 * (cols / 128) * mp;
    case TensorFormat::kMxfp4Row: return mp * cols / 2 + mp * cols / 32;
  }
  return 0;
}

void CudaMoeLayer::save_activations(const RowCounts& rc) const {
  const RecipeSpec& spec = path_.spec();
  for (const SavedSpec* s : {&spec.gemm1_input, &spec.gemm1_output, &spec.gemm2_input}) {
    const int64_t cols = s->width == LayerWidth::kH ? H_ : s->width == LayerWidth::k2F ? 2 * F_ : F_;
    save_rows(s->name, s->format_string(), saved_bytes(s->format, cols, rc), s->row_bytes(H_, F_), rc.held);
  }
  namespace rn = report_names;
  save_tokens(rn::kSavedRouterInput, rn::kSavedRouterInputFormat, step_.T * H_ * 2);
  save_tokens(rn::kSavedRouterLogits, rn::kSavedRouterLogitsFormat, step_.T * E_ * 4);
  save_tokens(rn::kSavedRouting, rn::kSavedRoutingFormat, step_.T * K_ * 12);
}

void CudaMoeLayer::save_tokens(const std::string& name, const std::string& format, int64_t bytes) const {
  SavedTensor s;
  s.name = name;
  s.format = format;
  s.bytes = bytes;
  s.bytes_per_token_unpadded = double(bytes) / double(step_.T);
  rep_.saved.push_back(s);
}

// sync_free: the counts route() copied to the host (pinned, stream-ordered: read after the stream
// synchronisation of read_status) give the padded rows, the routed rows and the blocks (with
// expert parallelism: every rank's counts, the plan made again on the host, and the exchanges'
// rows and bytes); the step's operators and saved tensors are then entered as the synchronous
// layer enters them.
void CudaMoeLayer::resolve_report() const {
  RowCounts rc;
  int64_t routed = 0;
  if (comm_ == nullptr) {
    const int32_t* counts = ws_.routing.host_counts;
    std::vector<int32_t> padded(E_);
    for (int e = 0; e < E_; ++e) {
      routed += counts[e];
      padded[e] = (counts[e] + cfg_.align - 1) / cfg_.align * cfg_.align;
    }
    const Segments seg = Segments::from_counts(padded);
    rc = {seg.num_tokens(), routed, seg.num_blocks()};
  } else {
    const int W = comm_->world_size(), me = comm_->rank();
    const int32_t* m = ws_.ep.host_matrices;
    const DispatchPlan plan =
        plan_from_all_counts(ep_config(cfg_), me, W, m, step_.T, path_.ep_dedup ? m + int64_t(W) * E_ : nullptr);
    for (int g = 0; g < E_; ++g) routed += m[int64_t(me) * E_ + g];
    rc = {plan.padded_rows(), plan.recv_rows(), plan.padded_segments().num_blocks()};
    rep_.wire.clear();
    for (const PendingWire& w : pending_wire_) {
      if (w.pass == MoePass::kBackward && !backward_done_) continue;
      if (w.kind == PendingWire::kDispatch) {
        rep_.wire.push_back(ep_detail::dispatch_transfer(w.pass, w.name, ep_detail::plan_for(plan, w.pass, w.wire)));
      } else if (w.kind == PendingWire::kCombine) {
        rep_.wire.push_back(ep_detail::combine_transfer(w.pass, w.name, w.format, w.row_bytes, plan));
      } else {
        rep_.wire.push_back(StepContext::dedup_transfer(w.pass, w.name, w.format, w.row_bytes, plan));
      }
    }
  }
  rep_.routed_rows = routed;
  rep_.padded_rows = rc.padded;
  rep_.drop_ops(MoePass::kForward);
  rep_.drop_ops(MoePass::kBackward);
  for (const PendingOp& p : pending_ops_)
    if (p.pass != MoePass::kBackward || backward_done_)
      rep_.add_op(p.pass, p.kind, p.name, p.calls, p.outputs,
                  p.elements + rc.padded * p.row_cols + rc.held * p.held_cols);
  rep_.saved.clear();
  save_activations(rc);
}

void CudaMoeLayer::read_status() const {
  // sync_free: always read (a graph replay of the step changes the device values, not this object)
  if ((stats_valid_ && !path_.sync_free) || !have_forward_) return;
  const RoutingBuffers& r = ws_.routing;
  FLOWMOE_CUDA_CHECK(cudaMemcpyAsync(r.host_status, r.pass_status, 4 * sizeof(DeviceStatus), cudaMemcpyDeviceToHost,
                                     stream_));
  FLOWMOE_CUDA_CHECK(cudaMemcpyAsync(r.host_aux_loss, r.aux_loss, sizeof(float), cudaMemcpyDeviceToHost, stream_));
  if (path_.sync_free)  // set_weights' non-finite count, not checked on the host there
    FLOWMOE_CUDA_CHECK(cudaMemcpyAsync(r.host_status + kHostStatusWeights, r.weight_status + 1, sizeof(DeviceStatus),
                                       cudaMemcpyDeviceToHost, stream_));
  FLOWMOE_CUDA_CHECK(cudaStreamSynchronize(stream_));
  if (path_.sync_free && comm_) {  // sync-free EP: a device barrier that timed out: the exchanges after it read incomplete rows
    const std::string failed = peers_->failed();
    if (!failed.empty()) throw CommError(__FILE__, __LINE__, "MoeLayer (rank " + std::to_string(comm_->rank()) + "): " + failed);
  }
  const DeviceStatus* s = r.host_status;
  rep_.forward_stats.nonfinite = int64_t(s[kStatusFwd].nonfinite);
  rep_.forward_stats.underflow = int64_t(s[kStatusFwd].underflow + s[kStatusFwdAux].underflow);
  rep_.backward_stats = QuantStats();
  if (backward_done_) {
    rep_.backward_stats.nonfinite = int64_t(s[kStatusBwd].nonfinite);
    rep_.backward_stats.underflow = int64_t(s[kStatusBwd].underflow + s[kStatusBwdAux].underflow);
  }
  mstatus_.nonfinite = rep_.forward_stats.nonfinite + rep_.backward_stats.nonfinite +
                      (path_.sync_free ? int64_t(s[kHostStatusWeights].nonfinite) : 0);
  mstatus_.underflow = rep_.forward_stats.underflow + rep_.backward_stats.underflow;
  mstatus_.aux_loss = cfg_.aux_loss_alpha > 0.0f ? *r.host_aux_loss : 0.0f;
  if (path_.sync_free) resolve_report();
  stats_valid_ = true;
}

const CastReport& CudaMoeLayer::cast_report() const {
  read_status();
  return rep_;
}

MoeStatus CudaMoeLayer::status() const {
  read_status();
  return mstatus_;
}

std::vector<StageTime> CudaMoeLayer::stage_times() const {
  std::vector<StageTime> out;
  if (clock_.empty()) return out;
  FLOWMOE_CUDA_CHECK(cudaStreamSynchronize(stream_));
  clock_.read([&](const StageEvents& s, cudaEvent_t ev0, cudaEvent_t ev1) {
    StageTime t;
    t.pass = s.pass;
    t.name = s.name;
    FLOWMOE_CUDA_CHECK(cudaEventElapsedTime(&t.ms, ev0, ev1));
    out.push_back(t);
  });
  return out;
}

}  // namespace moe
}  // namespace cuda
}  // namespace flowmoe
