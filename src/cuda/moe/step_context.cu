// The CUDA layer's step context (step_context.h): made from the layer for one call, the step's
// value handed back to it, the expert segments as the kernels see them, and report logging.
#include <cuda_runtime.h>

#include <utility>

#include "cuda/common.cuh"
#include "cuda/moe/layer.h"

namespace flowmoe {
namespace cuda {
namespace moe {

StepContext::StepContext(CudaMoeLayer& l, Step step, const StepCall& call)
    : cfg_(l.cfg_), E_(l.E_), H_(l.H_), F_(l.F_), K_(l.K_), El_(l.El_), comm_(l.comm_), max_tokens_(l.max_tokens_),
      max_rows_(l.max_rows_), path_(l.path_), stream_(l.stream_), direct_bytes_(l.direct_bytes_),
      gemm_(l.gemm_.get()), streams_(&l.streams_), clock_(&l.clock_), peers_(l.peers_), peer_tables_(&l.peer_tables_),
      ws_(l.ws_), call_params_(call.params), gemm1_bias_(call.gemm1_bias), router_bias_(call.router_bias),
      routing_ids_(call.routing_ids), routing_probs_(call.routing_probs),
      grads_accumulate_(call.grads_accumulate), step_(std::move(step)), rep_(&l.rep_),
      pending_ops_(&l.pending_ops_), pending_wire_(&l.pending_wire_), host_syncs_(&l.host_syncs_) {
  ws_.routing.tokens.tokens = step_.routing_tokens;
  ws_.ep.tokens_to_ranks.tokens = step_.tokens_to_ranks;
  ws_.ep.received_tokens.tokens = step_.received_tokens;
}

Step StepContext::take_step() {
  step_.routing_tokens = ws_.routing.tokens.tokens;
  step_.tokens_to_ranks = ws_.ep.tokens_to_ranks.tokens;
  step_.received_tokens = ws_.ep.received_tokens.tokens;
  return std::move(step_);
}

const int32_t* StepContext::segment_offsets() const {
  return comm_ ? ws_.ep.local_offsets : ws_.routing.tokens.padded_offsets;
}

SegmentBlocks StepContext::blocks() const {
  SegmentBlocks sb;
  sb.offsets = segment_offsets();
  sb.num_segments = El_;
  sb.m = step_.Mp;
  sb.max_blocks = segment_max_blocks(step_.Mp, El_);
  sb.capacity = path_.sync_free;  // step_.Mp is the row capacity, offsets[El] the rows in use
  sb.block_start = ws_.routing.block_start;
  sb.block_end = ws_.routing.block_end;
  sb.block_offsets = ws_.routing.block_offsets;
  return sb;
}

void StepContext::log(MoePass pass, CastKind kind, const std::string& name, int64_t calls, int64_t outputs,
                      int64_t elements) {
  if (path_.sync_free && pass != MoePass::kWeightUpdate)  // (weight updates: no row counts, kept)
    pending_ops_->push_back({pass, kind, name, calls, outputs, elements, 0, 0});
  else
    rep_->add_op(pass, kind, name, calls, outputs, elements);
}

void StepContext::log_rows(MoePass pass, CastKind kind, const std::string& name, int64_t calls, int64_t outputs,
                           int64_t cols) {
  if (path_.sync_free)
    pending_ops_->push_back({pass, kind, name, calls, outputs, 0, cols, 0});
  else
    rep_->add_op(pass, kind, name, calls, outputs, step_.Mp * cols);
}

void StepContext::log_held(MoePass pass, CastKind kind, const std::string& name, int64_t calls, int64_t outputs,
                           int64_t cols) {
  if (path_.sync_free)
    pending_ops_->push_back({pass, kind, name, calls, outputs, 0, 0, cols});
  else
    rep_->add_op(pass, kind, name, calls, outputs, step_.held * cols);
}

}  // namespace moe
}  // namespace cuda
}  // namespace flowmoe
