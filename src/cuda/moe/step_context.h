// The CUDA layer's step context: everything one forward or one backward runs with, and the services
// every dataflow shares. The layer (layer.h) makes one per call (StepContext::context) from what
// its construction fixed (shapes, recipe path, streams, GEMM object), the memory bound for the call
// (the workspace's views), the step (a value: the forward fills it, the backward reads a copy) and
// the call's inputs (parameters read in place, biases); the context refers to no field of the layer.
// Its members keep the names the layer gives them, so that a step reads the same in a service and
// in a pipeline (`c.ws_.expert`, `c.step_.Mp`, `c.fwd(...)`).
//
// The services, by file:
//   routing.cu       the forward's routing (router, routing tables, the one host sync, the EP plan)
//   backward_tail.cu the backward's common tail (router backward, dWr, dx)
//   step_context.cu  construction, the stage scopes and status counters, the segments (offsets, 128-row blocks),
//                    report logging (log, log_rows, log_held)
//   operands.cu      the GEMMs and their operands: FP8 fprop / dgrad / wgrad, the dgrad weights
//                    W^T (kept or made per backward), BF16 GEMMs, the wgrad output mode
//   ep_exchange.cu   token movement: permute+pad / unpermute on one GPU, dispatch / combine with
//                    EP (deduplicated or per row), the dX rows' ready mark
//   ep_device.cu     EP without host synchronisation: the pulls from the peers' buffers
//   pipelines/shared.cu  steps more than one pipeline runs: GEMM2 + combine, GEMM1's bias and
//                    its gradient, the UE8M0 recipes' backward GEMM pairs
// What only one dataflow runs lives in its pipeline's file.
#pragma once

#include <cuda_runtime.h>

#include <cstdint>
#include <functional>
#include <memory>
#include <string>
#include <utility>
#include <vector>

#include "cuda/moe/kernels.cuh"
#include "cuda/moe/recipe_path.h"
#include "cuda/moe/streams.h"
#include "cuda/moe/workspace.h"
#include "flowmoe/comm.h"
#include "flowmoe/cuda/qtensor_view.h"
#include "flowmoe/gemm.h"
#include "flowmoe/moe.h"
#include "flowmoe/recipe.h"
#include "flowmoe/swiglu.h"
#include "flowmoe/token.h"

namespace flowmoe {
namespace cuda {
namespace moe {

class CudaMoeLayer;

// GEMM spans of n elements: read-only (cs) and written (ms).
template <typename T>
gemm::Span<const T> cs(const T* p, int64_t n) { return {p, n}; }
template <typename T>
gemm::Span<T> ms(T* p, int64_t n) { return {p, n}; }

// RoutingBuffers::pass_status: the device counters of each pass
enum PassStatus { kStatusFwd = 0, kStatusFwdAux = 1, kStatusBwd = 2, kStatusBwdAux = 3 };

// sync_free: an operator of the step, elements + Mp * row_cols (+ held rows * held_cols), entered
// into the report when it is read (the row counts stay on the device until then)
struct PendingOp {
  MoePass pass;
  CastKind kind;
  std::string name;
  int64_t calls, outputs, elements, row_cols, held_cols;
};
// sync-free EP: an exchange of the step, sized from the plan when resolved
struct PendingWire {
  enum Kind { kDispatch, kDedup, kCombine } kind;
  MoePass pass;
  std::string name, format;
  WireFormat wire;    // kDispatch
  int64_t row_bytes;  // kDedup, kCombine
};

// The step: what a forward decided and its backward reads (the rows and segments of the routing,
// the EP plan, the token counts of the routing views). A value: the forward's context fills it,
// the layer keeps the latest (MoeLayer::step_state serialises it, load_step restores it) and each
// backward's context starts from a copy of it.
struct Step {
  int64_t T = 0;                  // tokens of the forward
  int64_t Mp = 0;                 // padded rows of the local experts (sync_free: the row capacity)
  int64_t routed = 0;             // routed rows of this rank's tokens
  int64_t held = 0;               // routed rows the local experts hold (= routed alone)
  int64_t blocks = 0;             // 128-row blocks of the segments
  int64_t dedup_recv_tokens = 0;  // EP dedup: tokens received by the forward's dispatch
  // the token counts the routing views carry on the host (RoutingView::tokens)
  int64_t routing_tokens = 0, tokens_to_ranks = 0, received_tokens = 0;
  Segments seg;
  DispatchPlan plan;  // EP: the forward's dispatch plan (the backward's combines reuse it)
};

// What one forward or backward is given besides its tensors.
struct StepCall {
  MoeWeights params;                  // the parameters it reads in place (else none: the weights region)
  const float* gemm1_bias = nullptr;  // b1 of the forward (MoeConfig::gemm1_bias), else null
  const float* router_bias = nullptr; // the router's bias set_weights copied, else null
  // MoeConfig::external_routing: the forward's routing from the caller, ids [T, k] and probs [T, k]
  const int32_t* routing_ids = nullptr;
  const float* routing_probs = nullptr;
  bool grads_accumulate = true;       // MoeGrads::accumulate of the backward
};

// The configuration of the sync-free and host-planned EP dispatch (forward wire format, probabilities).
EpConfig ep_config(const MoeConfig& cfg);

// A step context is made for one forward or one backward (StepContext::context) from the layer's
// setup, the memory bound for the call, the step and the call's inputs; it holds values, and
// pointers to the resources and sinks the layer owns (GEMM object, streams, clock, report).
class StepContext {
 public:
  StepContext(CudaMoeLayer& layer, Step step, const StepCall& call);  // (step_context.cu)
  StepContext(const StepContext&) = delete;
  StepContext& operator=(const StepContext&) = delete;
  using Fp8Op = gemm::Fp8Operand;

  // ---- what the layer's construction fixed (recipe_path.h), copied -----------------------------------
  const MoeConfig cfg_;
  const int E_;
  const int64_t H_, F_;
  const int K_;
  const int El_;              // experts held here: E_ alone, E_ / ranks with a communicator
  Communicator* const comm_;  // null: single GPU, all experts local
  const int64_t max_tokens_, max_rows_;
  const RecipePath path_;
  const cudaStream_t stream_;
  const int64_t direct_bytes_;

  // ---- resources the layer owns ----------------------------------------------------------------------
  GroupedGemm* const gemm_;
  LayerStreams* const streams_;
  StageClock* const clock_;
  DevicePeers* const peers_;  // sync-free EP: the peers' buffers, else null
  const std::vector<std::pair<const void*, void* const*>>* const peer_tables_;

  // ---- this call: the workspace's views over the memory bound for it, its inputs ---------------------
  Workspace ws_;  // (its routing views' host token counts those of step_)
  const MoeWeights call_params_;  // the parameters the forward / backward reads in place, else none
  const float* const gemm1_bias_;
  const float* const router_bias_;
  const int32_t* const routing_ids_;
  const float* const routing_probs_;
  const bool grads_accumulate_;

  // ---- the step: filled by the forward (routing.cu, the dispatch), read by the backward -------------
  Step step_;
  bool dx_ready_marked_ = false;  // mark_dx_rows_ready ran in this backward
  // The step as the layer keeps it (the routing views' token counts recorded); the context is done.
  Step take_step();

  // ---- routing (routing.cu): the forward's first part, before the pipeline ----------------------------
  void route(const bf16_t* x);
  void plan_expert_parallel();  // EP: the dispatch plan from the fetched counts (collective)
  void plan_on_device();        // sync-free EP: the plan from every rank's device counts

  // ---- the backward's common tail (backward_tail.cu), after the pipeline's dX rows ------------------
  void backward_tail(const MoeGrads& g, bf16_t* dx);
  // Wr as the backward reads it: the backward's parameter, else the weights region's copy
  const float* router_weights() const { return call_params_.wr ? call_params_.wr : ws_.weights.wr; }

  // ---- the layer's report and counters --------------------------------------------------------------
  CastReport* const rep_;
  std::vector<PendingOp>* const pending_ops_;
  std::vector<PendingWire>* const pending_wire_;
  int64_t* const host_syncs_;
  // ---- report (step_context.cu) ------------------------------------------------------------------------
  void log(MoePass pass, CastKind kind, const std::string& name, int64_t calls, int64_t outputs, int64_t elements);
  // An operator over the padded rows: Mp x cols elements (sync_free: resolved when the report is read).
  void log_rows(MoePass pass, CastKind kind, const std::string& name, int64_t calls, int64_t outputs, int64_t cols);
  // An operator over the rows the local experts hold: held x cols elements (sync_free: resolved later).
  void log_held(MoePass pass, CastKind kind, const std::string& name, int64_t calls, int64_t outputs, int64_t cols);
  StageClock::Scope fwd(const char* name, cudaStream_t s = nullptr) {
    return StageClock::Scope(clock_, MoePass::kForward, name, s ? s : stream_);
  }
  StageClock::Scope bwd(const char* name, cudaStream_t s = nullptr) {
    return StageClock::Scope(clock_, MoePass::kBackward, name, s ? s : stream_);
  }
  StageClock::Scope stage(MoePass pass, const char* name) { return StageClock::Scope(clock_, pass, name, stream_); }
  DeviceStatus* st_fwd() { return ws_.routing.pass_status + kStatusFwd; }
  DeviceStatus* st_fwd_aux() { return ws_.routing.pass_status + kStatusFwdAux; }
  DeviceStatus* st_bwd() { return ws_.routing.pass_status + kStatusBwd; }
  DeviceStatus* st_bwd_aux() { return ws_.routing.pass_status + kStatusBwdAux; }

  // ---- segments (step_context.cu) ----------------------------------------------------------------------
  SegmentBlocks blocks() const;
  // the device offsets of the expert segments the GEMMs and the segment-aware kernels see
  const int32_t* segment_offsets() const;
  // The device row count the row-wise kernels stop at (sync_free: padded offsets[El]), or null.
  const int32_t* rows_bound() const { return path_.sync_free ? segment_offsets() + El_ : nullptr; }

  // ---- GEMM operands and GEMMs (operands.cu) ------------------------------------------------------------
  Fp8Op act_operand(const QTensorView& rows, int64_t c, DeviceStatus* st);
  Fp8Op col_operand(const QTensorView& col, int64_t c, float* scales_f32, cudaStream_t s);
  Fp8Op f32_row_operand(const QTensorView& rows, int64_t c) const;
  Fp8Op f32_col_operand(const QTensorView& col, int64_t c) const;
  Fp8Op weight_operand(const QTensorView& w, int64_t n, int64_t k) const;
  gemm::WgradOut dw_out(float* f32, bf16_t* b16, int64_t n) const;
  // The FP8 fprop (in = x [Mp, k], w = W [El*n, k], out [Mp, n]) and dgrad (in = dy [Mp, n],
  // w = Wt [El*k, n], out [Mp, k]) of every FP8 recipe: `in` row-wise with UE8M0 scales
  // [c/128][Mp] or (fp8-naive) expert-packed FP32; the grouped kernel or cuBLASLt per expert
  // (CudaLayerOptions::fprop_dgrad); `st` counts malformed offsets / non-finite scales.
  void fp8_fprop(const QTensorView& in, int64_t n, int64_t k, const QTensorView& w, bf16_t* out, DeviceStatus* st);
  // (e0, ne: the dgrad of experts [e0, e0 + ne) alone, w holding theirs; the grouped kernel only)
  void fp8_dgrad(const QTensorView& in, int64_t n, int64_t k, const QTensorView& w, bf16_t* out, DeviceStatus* st,
                 int e0 = 0, int ne = -1);
  // GEMM g's dgrad (g = 1: dX rows from dh; 2: da' from dY) through W_g^T: the copy kept since
  // set_weights, or (caller memory) made here a group of experts at a time (RecipePath::wt_chunk*)
  void weight_dgrad(int g, const QTensorView& in, bf16_t* out, DeviceStatus* st);
  // W_g^T of experts [e0, e0 + n) in WeightBuffers::wt_*: quantized from this backward's parameters
  // (set_backward_weights) or transposed from the forward's W (caller memory)
  QTensorView make_dgrad_weights(int g, int e0, int n);
  QTensorView gemm_rows(const QTensorView& rows, int64_t c) const;  // `rows` as the [Mp, c] the GEMM reads
  QTensorView saved_h() const;  // flow's saved h as this step's [Mp, 2F] view (FP8 rows or MXFP4)
  // FP8 wgrad dW [El, n, k] from the column-wise copies of the gradient [n over Mp] and the input
  // [k over Mp] (UE8M0 scales, converted to FP32 on the way): cuBLASLt per expert or the kernel on
  // host segments, or the kernel on device segments (sync_free). `stored` (rows > 0): the weight's
  // gradient where the model stores it (MoeGrads::storage), by the kernel with the operands swapped.
  void fp8_wgrad(const QTensorView& grad_col, int64_t n, const QTensorView& in_col, int64_t k, float* dw,
                 bf16_t* dw_bf16, const gemm::StoredDw& stored = {});
  // The bf16 recipe's GEMMs (fprop: in [Mp, k], w = W [El*n, k], out [Mp, n]; dgrad: in [Mp, n],
  // the same W, out [Mp, k]; wgrad: dW [El, n, k] from the gradient [Mp, n] and the input [Mp, k]):
  // cuBLASLt per expert on the host segments, or the sm_90a BF16 kernels on the device segments
  // (path_.grouped_gemm: sync_free or CudaLayerOptions::FpropDgrad::kGrouped; wgrad with align 128).
  // The BF16 W_g [El, n, k] the bf16 recipe's GEMMs read: the weights region's copy, or the
  // parameters of the running forward / backward where the layer reads them in place
  const bf16_t* bf16_weight(int g) const;
  // RecipePath::bf16_stored_gemms: whether this forward's (and, for a backward, its gradients') storage
  // lets the GEMMs read the stored parameters in place (gate / up pairs or no padding of F; a
  // backward's dW1 stored the same way or not asked for), else the pass relays them (relay_params).
  bool stored_gemms() const;
  bool stored_gemms(const MoeGrads& g) const;
  // W_g where the model stores it (stored_gemms): W1^T [Hs][2Fs], W2^T [Fs][Hs] per expert.
  gemm::StoredW stored_weight(int g) const;
  void bf16_fprop(const bf16_t* in, int64_t n, int64_t k, const bf16_t* w, bf16_t* out);
  void bf16_dgrad(const bf16_t* in, int64_t n, int64_t k, const bf16_t* w, bf16_t* out);
  void bf16_wgrad(const bf16_t* grad, int64_t n, const bf16_t* in, int64_t k, float* dw, bf16_t* dw_bf16,
                  const gemm::StoredDw& stored = {});
  // The same fprop and dgrad on a stored weight (stored_weight; the grouped kernels)
  void bf16_fprop(const bf16_t* in, int64_t n, int64_t k, const gemm::StoredW& w, bf16_t* out);
  void bf16_dgrad(const bf16_t* in, int64_t n, int64_t k, const gemm::StoredW& w, bf16_t* out);

  // ---- token movement (ep_exchange.cu) ----------------------------------------------------------------
  void move_bf16(const bf16_t* tok, bf16_t* rows, MoePass pass, const char* name);
  void move_fp8(const QTensorView& tok, const QTensorView& rows, MoePass pass, const char* name);
  void move_mxfp4(const QTensorView& tok, const QTensorView& rows);
  void move_naive(bf16_t* out, MoePass pass, const char* name);
  void combine_y(bf16_t* y);
  void mark_dx_rows_ready();  // after GEMM1 dgrad: the tail (one GPU) or the EP combine may start
  void log_combine(MoePass pass, const std::string& name, const std::string& format, int64_t row_bytes);
  // The report's entry of a deduplicated exchange: one row of row_bytes per (token, peer rank).
  static WireTransfer dedup_transfer(MoePass pass, const std::string& name, const std::string& format,
                                     int64_t row_bytes, const DispatchPlan& plan);
  bool device_ep() const { return path_.sync_free && comm_ != nullptr; }
  // sync-free EP (ep_device.cu): one exchange as pulls from the peers' buffers
  void pull_exchange(const EpPiece* pieces, int n, const std::vector<RowStream>& streams, cudaStream_t s);
  void* const* peer_table(const void* mine) const;  // the peers' addresses of a shared buffer
  int dispatch_piece_count() const;
  int combine_piece_count() const;

  // ---- steps more than one pipeline runs (pipelines/shared.cu) ----------------------------------------
  // GEMM2 (gemm2() computes the expert output rows into ExpertBuffers::rows_bf16) and the way back
  void gemm2_then_combine(const char* gemm_stage, const std::function<void()>& gemm2, bf16_t* y);
  // MoeConfig::gemm1_bias: b1 added to h as the activation reads it (swiglu.h GateUpBias; none
  // without the bias), the biased h stored back where `store_h` (the recipes that save h in BF16);
  // db1 from dH (BF16 or row-wise FP8)
  GateUpBias gemm1_bias_on_read(bool store_h) const;
  // (dh_gate_up: dh's columns as gate / up pairs, db1 still in the layer's order)
  void gemm1_bias_grad_bf16(const MoeGrads& g, bool dh_gate_up = false);
  void gemm1_bias_grad_fp8(const MoeGrads& g, const QTensorView& dh_row);
  // The UE8M0 recipes' backward GEMMs (blockwise, flow, flow-fp4); `side`: the side event the
  // wgrad waits for, or -1
  void fp8_gemm2_grads(const MoeGrads& g, int side);
  void fp8_gemm2_wgrad(const MoeGrads& g, int side);
  void fp8_gemm1_grads(const MoeGrads& g, const QTensorView& dh_row, const QTensorView& dh_col,
                       const QTensorView& x_perm_col, int side);

 private:
  void ep_exchange(const std::function<void()>& fn);
  void ep_dispatch(MoePass pass, const char* name, WireFormat f, std::vector<RowStream> streams);
  void dedup_exchange(MoePass pass, const char* name, const std::string& format, std::vector<RowStream> streams);
  void route_received_tokens(int64_t n);  // dedup: the received token slots over the local experts
};

}  // namespace moe
}  // namespace cuda
}  // namespace flowmoe
