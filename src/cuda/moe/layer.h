// The CUDA MoE layer (include/flowmoe/moe.h make_cuda_layer; docs/MOE_GPU.md): the five recipes of
// SPEC §6 built from the CUDA operators (convert.h, token.h, swiglu.h, gemm.h) and the layer's own
// kernels (kernels.cuh), with the dataflow of the CPU backend step for step, so that the two can
// be compared on the same inputs. The class holds what construction fixed (shapes, recipe path,
// workspace plan, streams, GEMM object), the weights' state and the latest step; each forward and
// backward runs in a step context made for it (step_context.h: the setup, the memory bound, the
// step as a value, the call's inputs), and the dataflows themselves are pipelines
// (pipelines/pipeline.h) over that context:
//   layer.cu        API and lifecycle: construction, set_weights, forward / backward entry points
//                   (a context, routing, the pipeline, the tail; the step kept), make_cuda_layer,
//                   moe_debug.h
//   routing.cu      (context) router, routing tables, the one host sync, the EP dispatch plan
//                   (sync_free: made on the device)
//   backward_tail.cu (context) the common tail: dprobs, router backward, dWr, dx (tail stream / EP
//                   combine)
//   report.cu       the cast report's saved tensors, status counters, stage times
// Around it:
//   recipe_path.h/.cu the recipe as data (RecipePath: dataflow, formats, the options that apply),
//                   made once at construction; the rooms read it instead of the Recipe enum
//   workspace.h/.cu the device buffers (named views), allocated once at construction
//   streams.h/.cu   side stream (fork / mark / join), tail stream, stage clock
//   step_context.h  the step, a call's inputs, and the context a pipeline runs in with the services
//                   the dataflows share: step_context.cu (segments, report logging), operands.cu
//                   (GEMMs and operands), ep_exchange.cu / ep_device.cu (token movement, EP)
//   pipelines/      one file per dataflow (bf16, blockwise, fp8_naive, flow) with its forward and
//                   backward; shared.cu, the steps several of them run
//
// Synchronisation: one per forward (the per-expert padded counts, which the grouped GEMM's
// per-expert launches need on the host, fetched right after routing); backward reuses them and
// does not synchronise. None with sync_free (the counts stay on the device; with EP the plan too).
// set_weights synchronises once (non-finite check of the masters; not with sync_free).
// cast_report() and status() synchronise to read the device counters.
#pragma once

#include <cuda_runtime.h>

#include <cstdint>
#include <functional>
#include <memory>
#include <string>
#include <vector>

#include "common/moe_ep.h"
#include "cuda/moe/kernels.cuh"
#include "cuda/moe/pipelines/pipeline.h"
#include "cuda/moe/recipe_path.h"
#include "cuda/moe/step_context.h"
#include "flowmoe/cuda/qtensor_view.h"
#include "cuda/moe/streams.h"
#include "cuda/moe/workspace.h"
#include "flowmoe/comm.h"
#include "flowmoe/cuda/convert.h"
#include "flowmoe/cuda/moe_debug.h"
#include "flowmoe/gemm.h"
#include "flowmoe/moe.h"
#include "flowmoe/recipe.h"
#include "flowmoe/token.h"

namespace flowmoe {
namespace cuda {
namespace moe {

class CudaMoeLayer final : public MoeLayer {
 public:
  CudaMoeLayer(const MoeConfig& cfg, cudaStream_t stream, const CudaLayerOptions& options);
  ~CudaMoeLayer() override;

  const char* backend() const override { return "cuda"; }
  void set_weights(const MoeWeights& w) override;
  void forward(const bf16_t* x, int64_t tokens, bf16_t* y) override;
  void backward(const bf16_t* dy, bf16_t* dx, const MoeGrads& g) override;
  const CastReport& cast_report() const override;
  MoeStatus status() const override;
  std::vector<uint8_t> step_state() const override;
  void load_step(const uint8_t* bytes, size_t size) override;
  MoeMemoryPlan memory_plan() const override { return caller_memory_ ? plan_bytes_ : MoeMemoryPlan(); }
  void bind_memory(const MoeMemory& memory) override;
  bool takes_backward_weights() const override;
  void set_backward_weights(const MoeWeights& w) override;
  bool reads_params_in_place() const override { return path_.bf16_params_in_place; }
  void set_forward_weights(const MoeWeights& w) override;
  bool reads_stored_weights(bool bf16_params) const override;
  bool writes_stored_grads(const ExpertStorage& storage, bool bf16_grads) const override;

  // moe_debug.h
  void set_profiling(bool on) { clock_.profiling = on; }
  std::vector<StageTime> stage_times() const;
  size_t allocated_bytes() const { return arena_.allocated() + gemm_workspace_; }
  LayerCounters counters() const;
  // moe_graph.h
  bool sync_free() const { return path_.sync_free; }
  bool caller_memory() const { return caller_memory_; }
  bool has_weights() const { return have_weights_; }
  cudaStream_t stream() const { return stream_; }
  // Sync-free EP (sync_free with comm_): make_cuda_layer, once every rank built its layer
  // (collective): the peers' addresses of the buffers the pulls read
  void share_ep_buffers();

 private:
  friend class StepContext;  // made from the setup below, per call (step_context.h)
  static constexpr int kHostStatusWeights = 4;  // routing.host_status[4]: set_weights' check (sync_free)

  // ---- lifecycle (layer.cu) --------------------------------------------------------------------
  void allocate(const CudaLayerOptions& options);
  void release();
  void layout_workspace();  // ws_'s views over the arena's current pass
  // caller memory: the regions `what` needs are bound (weights, plus saved for forward / backward)
  void check_bound(const char* what, bool saved, bool weights = true) const;
  // bf16_params_in_place: the parameters are BF16 in the layer's layout (else throws, naming `what`)
  void check_params_in_place(const MoeWeights& w, const char* what) const;
  // bf16_relay_per_pass: the stored parameters `p` relaid into the pass's BF16 copies (transient)
  void relay_params(const MoeWeights& p, const char* what);

  // A context for one forward or backward (step_context.h): this layer's setup and memory, `step`, `call`.
  StepContext context(Step step, const StepCall& call) { return StepContext(*this, std::move(step), call); }

  // ---- report (report.cu) ----------------------------------------------------------------------
  // The row counts the report needs: padded rows, rows held, 128-row blocks.
  struct RowCounts {
    int64_t padded = 0, held = 0, blocks = 0;
  };
  RowCounts row_counts() const { return {step_.Mp, step_.held, step_.blocks}; }
  // sync_free: the step's operators and saved tensors completed with the counts fetched now.
  void resolve_report() const;
  void save_rows(const std::string& name, const std::string& format, int64_t bytes, double per_row,
                 int64_t held) const;
  void save_tokens(const std::string& name, const std::string& format, int64_t bytes) const;
  // The recipe's three saved tensors (recipe.h SavedSpec) and the router's, for these row counts.
  void save_activations(const RowCounts& rc) const;
  int64_t saved_bytes(TensorFormat f, int64_t cols, const RowCounts& rc) const;
  void read_status() const;

  // ---- configuration ---------------------------------------------------------------------------
  cudaStream_t stream_;
  const int E_;
  const int64_t H_, F_;
  const int K_;
  const int El_;              // experts held here: E_ alone, E_ / ranks with a communicator
  Communicator* const comm_;  // null: single GPU, all experts local
  const int64_t max_tokens_, max_rows_;
  // The recipe's path (recipe_path.h): dataflow, formats, and the options that depend on the recipe
  // (grouped GEMMs, fused epilogues, side stream, deduplicated EP dispatch)
  const RecipePath path_;
  int64_t direct_bytes_ = -1; // dispatch_rows / combine_rows message grouping (comm.h)
  bool caller_memory_ = false;  // CudaLayerOptions::caller_memory: ws_ laid over bound_ per call
  MoeMemoryPlan plan_bytes_;    // the sizes of the caller's regions
  MoeMemory bound_;             // the regions bound last (null: none)

  // ---- resources -------------------------------------------------------------------------------
  DeviceArena arena_;
  Workspace ws_;
  std::unique_ptr<GroupedGemm> gemm_;
  size_t gemm_workspace_ = 0;
  LayerStreams streams_;
  StageClock clock_;

  // ---- state of the latest set_weights / forward / backward --------------------------------------
  bool have_weights_ = false, have_forward_ = false, backward_done_ = false, has_bias_ = false;
  MoeWeights forward_weights_;   // set_forward_weights' parameters, for the next forward only
  MoeWeights backward_weights_;  // set_backward_weights' parameters, for the next backward only
  // The step of the latest forward, or of load_step since: what a backward takes when given no step
  // (MoeLayer::backward), and what step_state serialises.
  Step step_;
  int64_t host_syncs_ = 0;
  DevicePeers* peers_ = nullptr;  // sync-free EP: comm_->device_peers()
  std::vector<std::pair<const void*, void* const*>> peer_tables_;  // buffer -> its peers' addresses

  // ---- report ----------------------------------------------------------------------------------
  std::vector<PendingOp> pending_ops_;      // sync_free: the step's operators (step_context.h)
  std::vector<PendingWire> pending_wire_;  // sync-free EP: the step's exchanges
  mutable CastReport rep_;
  mutable MoeStatus mstatus_;
  mutable bool stats_valid_ = false;

  // ---- the dataflow ----------------------------------------------------------------------------
  std::unique_ptr<PipelineSteps> pipeline_;  // path_.dataflow's (pipelines/pipeline.h)
};

}  // namespace moe
}  // namespace cuda
}  // namespace flowmoe
