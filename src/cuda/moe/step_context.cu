// The CUDA layer's step context (step_context.h): its references to the layer's state, the expert
// segments as the kernels see them, and report logging.
#include <cuda_runtime.h>

#include "cuda/common.cuh"
#include "cuda/moe/layer.h"

namespace flowmoe {
namespace cuda {
namespace moe {

StepContext::StepContext(CudaMoeLayer& l)
    : cfg_(l.cfg_), E_(l.E_), H_(l.H_), F_(l.F_), K_(l.K_), El_(l.El_), comm_(l.comm_), max_tokens_(l.max_tokens_),
      path_(l.path_), stream_(l.stream_), direct_bytes_(l.direct_bytes_),
      gemm1_bias_(l.gemm1_bias_), ws_(l.ws_), gemm_(l.gemm_), streams_(l.streams_), clock_(l.clock_), T_(l.T_),
      Mp_(l.Mp_), held_(l.held_), blocks_(l.blocks_), seg_(l.seg_), plan_(l.plan_),
      dedup_recv_tokens_(l.dedup_recv_tokens_), call_params_(l.call_params_),
      grads_accumulate_(l.grads_accumulate_), dx_ready_marked_(l.dx_ready_marked_), host_syncs_(l.host_syncs_),
      peers_(l.peers_), peer_tables_(l.peer_tables_), rep_(l.rep_), pending_ops_(l.pending_ops_),
      pending_wire_(l.pending_wire_) {}

const int32_t* StepContext::segment_offsets() const {
  return comm_ ? ws_.ep.local_offsets : ws_.routing.tokens.padded_offsets;
}

SegmentBlocks StepContext::blocks() const {
  SegmentBlocks sb;
  sb.offsets = segment_offsets();
  sb.num_segments = El_;
  sb.m = Mp_;
  sb.max_blocks = segment_max_blocks(Mp_, El_);
  sb.capacity = path_.sync_free;  // Mp_ is the row capacity, offsets[El] the rows in use
  sb.block_start = ws_.routing.block_start;
  sb.block_end = ws_.routing.block_end;
  sb.block_offsets = ws_.routing.block_offsets;
  return sb;
}

void StepContext::log(MoePass pass, CastKind kind, const std::string& name, int64_t calls, int64_t outputs,
                      int64_t elements) {
  if (path_.sync_free && pass != MoePass::kWeightUpdate)  // (weight updates: no row counts, kept)
    pending_ops_.push_back({pass, kind, name, calls, outputs, elements, 0, 0});
  else
    rep_.add_op(pass, kind, name, calls, outputs, elements);
}

void StepContext::log_rows(MoePass pass, CastKind kind, const std::string& name, int64_t calls, int64_t outputs,
                           int64_t cols) {
  if (path_.sync_free)
    pending_ops_.push_back({pass, kind, name, calls, outputs, 0, cols, 0});
  else
    rep_.add_op(pass, kind, name, calls, outputs, Mp_ * cols);
}

void StepContext::log_held(MoePass pass, CastKind kind, const std::string& name, int64_t calls, int64_t outputs,
                           int64_t cols) {
  if (path_.sync_free)
    pending_ops_.push_back({pass, kind, name, calls, outputs, 0, 0, cols});
  else
    rep_.add_op(pass, kind, name, calls, outputs, held_ * cols);
}

}  // namespace moe
}  // namespace cuda
}  // namespace flowmoe
