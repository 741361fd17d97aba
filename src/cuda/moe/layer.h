// The CUDA MoE layer (include/flowmoe/moe.h make_cuda_layer; docs/MOE_GPU.md): the five recipes of
// SPEC §6 built from the CUDA operators (convert.h, token.h, swiglu.h, gemm.h) and the layer's own
// kernels (kernels.cuh), with the dataflow of the CPU backend step for step, so that the two can
// be compared on the same inputs. One class, its members defined by job:
//   layer.cu        API and lifecycle: construction, set_weights, forward / backward entry points,
//                   make_cuda_layer, moe_debug.h
//   recipe_path.h/.cu the recipe as data (RecipePath: dataflow, formats, the options that apply),
//                   made once at construction; the rooms read it instead of the Recipe enum
//   workspace.h/.cu the device buffers (named views), allocated once at construction
//   streams.h/.cu   side stream (fork / mark / join), tail stream, stage clock
//   routing.cu      router, routing tables, the one host sync, the EP dispatch plan
//   ep_exchange.cu  token movement: permute+pad / unpermute on one GPU, dispatch / combine with EP
//   ep_device.cu    EP without host synchronisation (sync_free): the plan on the device, pulls
//   forward.cu      forward per pipeline (forward_bf16, forward_blockwise, forward_naive, forward_flow)
//   backward.cu     backward per pipeline: GEMM2 / GEMM1 dgrad + wgrad (backward_*, fp8_gemm*_grads)
//   backward_tail.cu the common tail: dprobs, router backward, dWr, dx (tail stream / EP combine)
//   operands.cu     the workspace's FP8 tensors and the weights as GEMM operands
//   report.cu       the cast report, saved tensors, status counters, stage times
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
#include "cuda/moe/recipe_path.h"
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

// GEMM spans of n elements: read-only (cs) and written (ms).
template <typename T>
gemm::Span<const T> cs(const T* p, int64_t n) { return {p, n}; }
template <typename T>
gemm::Span<T> ms(T* p, int64_t n) { return {p, n}; }

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
  std::unique_ptr<MoeStep> take_step() override;
  void resume_step(std::unique_ptr<MoeStep> step) override;
  MoeMemoryPlan memory_plan() const override { return caller_memory_ ? plan_bytes_ : MoeMemoryPlan(); }
  void bind_memory(const MoeMemory& memory) override;
  bool takes_backward_weights() const override;
  void set_backward_weights(const MoeWeights& w) override;

  // moe_debug.h
  void set_profiling(bool on) { clock_.profiling = on; }
  std::vector<StageTime> stage_times() const;
  size_t allocated_bytes() const { return arena_.allocated() + gemm_workspace_; }
  LayerCounters counters() const;
  // moe_graph.h
  bool sync_free() const { return sync_free_; }
  bool caller_memory() const { return caller_memory_; }
  // The token counts the routing views carry on the host (set by each forward): kept across a
  // re-layout of the workspace and in a step (take_step).
  struct RoutingTokens {
    int64_t tokens = 0, to_ranks = 0, received = 0;
  };
  bool has_weights() const { return have_weights_; }
  cudaStream_t stream() const { return stream_; }

 private:
  using Fp8Op = gemm::Fp8Operand;
  enum { kStatusFwd = 0, kStatusFwdAux = 1, kStatusBwd = 2, kStatusBwdAux = 3 };
  static constexpr int kHostStatusWeights = 4;  // routing.host_status[4]: set_weights' check (sync_free)

  // ---- lifecycle (layer.cu) --------------------------------------------------------------------
  void allocate(const CudaLayerOptions& options);
  void release();
  void layout_workspace();  // ws_'s views over the arena's current pass
  RoutingTokens routing_tokens() const;
  void set_routing_tokens(const RoutingTokens& t);
  // caller memory: the regions `what` needs are bound (weights, plus saved for forward / backward)
  void check_bound(const char* what, bool saved, bool weights = true) const;
  // GEMM g's dgrad (g = 1: dX rows from dh; 2: da' from dY) through W_g^T: the copy kept since
  // set_weights, or (caller memory) made here a group of experts at a time (RecipePath::wt_chunk*)
  void weight_dgrad(int g, const QTensorView& in, bf16_t* out, DeviceStatus* st);
  // W_g^T of experts [e0, e0 + n) in WeightBuffers::wt_*: quantized from this backward's parameters
  // (set_backward_weights) or transposed from the forward's W (caller memory)
  QTensorView make_dgrad_weights(int g, int e0, int n);
  // Wr as the backward reads it: set_backward_weights' parameter, else the weights region's copy
  const float* router_weights() const { return backward_params_.wr ? backward_params_.wr : ws_.weights.wr; }

  // ---- routing (routing.cu) --------------------------------------------------------------------
  void route(const bf16_t* x, const RoutingInput& ext);  // ext: MoeConfig::external_routing's ids, probs
  void plan_expert_parallel();  // EP: the dispatch plan from the fetched counts (collective)
  SegmentBlocks blocks() const;
  // the device offsets of the expert segments the GEMMs and the segment-aware kernels see
  const int32_t* segment_offsets() const;

  // ---- token movement (ep_exchange.cu) ---------------------------------------------------------
  void ep_exchange(const std::function<void()>& fn);
  void ep_dispatch(MoePass pass, const char* name, WireFormat f, std::vector<RowStream> streams);
  void dedup_exchange(MoePass pass, const char* name, const std::string& format, std::vector<RowStream> streams);
  void route_received_tokens(int64_t n);  // dedup: the received token slots over the local experts
  void move_bf16(const bf16_t* tok, bf16_t* rows, MoePass pass, const char* name);
  void move_fp8(const QTensorView& tok, const QTensorView& rows, MoePass pass, const char* name);
  void move_mxfp4(const QTensorView& tok, const QTensorView& rows);
  void move_naive(bf16_t* out, MoePass pass, const char* name);
  void combine_y(bf16_t* y);
  void mark_dx_rows_ready();  // after GEMM1 dgrad: the tail (one GPU) or the EP combine may start
  void log_combine(MoePass pass, const std::string& name, const std::string& format, int64_t row_bytes);
  EpConfig ep_config() const;  // the plan's configuration (forward wire format, probabilities)
  // The report's entry of a deduplicated exchange: one row of row_bytes per (token, peer rank).
  static WireTransfer dedup_transfer(MoePass pass, const std::string& name, const std::string& format,
                                     int64_t row_bytes, const DispatchPlan& plan);

  // ---- expert parallelism without host synchronisation (ep_device.cu; sync_free with comm_) -----
 public:
  void share_ep_buffers();  // make_cuda_layer, once every rank built its layer (collective)
 private:
  void plan_on_device();    // route(): the plan from every rank's device counts
  void pull_exchange(const EpPiece* pieces, int n, const std::vector<RowStream>& streams, cudaStream_t s);
  void* const* peer_table(const void* mine) const;  // the peers' addresses of a shared buffer
  int dispatch_piece_count() const;
  int combine_piece_count() const;
  bool device_ep() const { return sync_free_ && comm_ != nullptr; }

  // ---- forward per pipeline (forward.cu; path_.dataflow picks one) -------------------------------
  void forward_bf16(bf16_t* y);
  void forward_blockwise(bf16_t* y);
  void naive_entry(MoePass pass, const bf16_t* in, bf16_t* out);
  void forward_naive(bf16_t* y);
  void forward_flow(bf16_t* y);
  void gemm2_then_combine(const char* gemm_stage, const std::function<void()>& gemm2, bf16_t* y);

  // ---- backward per pipeline (backward.cu, backward_tail.cu) ------------------------------------
  void backward_bf16(const bf16_t* dy, const MoeGrads& g);
  void backward_blockwise(const bf16_t* dy, const MoeGrads& g);
  void backward_naive(const bf16_t* dy, const MoeGrads& g);
  void backward_flow(const bf16_t* dy, const MoeGrads& g);
  void fp8_gemm2_grads(const MoeGrads& g, int side);
  void fp8_gemm2_wgrad(const MoeGrads& g, int side);
  void backward_flow_dswiglu();
  // MoeConfig::gemm1_bias (forward.cu, backward.cu): h += b1 after GEMM1; db1 from dH
  void add_gemm1_bias();
  void gemm1_bias_grad_bf16(const MoeGrads& g);
  void gemm1_bias_grad_fp8(const MoeGrads& g, const QTensorView& dh_row);
  void fp8_gemm1_grads(const MoeGrads& g, const QTensorView& dh_row, const QTensorView& dh_col,
                       const QTensorView& x_perm_col, int side);
  void naive_col(const QTensorView& row, int64_t c, const QTensorView& col, WgradOperand what);
  void backward_tail(const MoeGrads& g, bf16_t* dx);

  // ---- GEMM operands (operands.cu) -------------------------------------------------------------
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
  QTensorView gemm_rows(const QTensorView& rows, int64_t c) const;  // `rows` as the [Mp, c] the GEMM reads
  QTensorView saved_h() const;  // flow's saved h as this step's [Mp, 2F] view (FP8 rows or MXFP4)
  // FP8 wgrad dW [El, n, k] from the column-wise copies of the gradient [n over Mp] and the input
  // [k over Mp] (UE8M0 scales, converted to FP32 on the way): cuBLASLt per expert or the kernel on
  // host segments, or the kernel on device segments (sync_free).
  void fp8_wgrad(const QTensorView& grad_col, int64_t n, const QTensorView& in_col, int64_t k, float* dw,
                 bf16_t* dw_bf16);
  // The bf16 recipe's GEMMs (fprop: in [Mp, k], w = W [El*n, k], out [Mp, n]; dgrad: in [Mp, n],
  // the same W, out [Mp, k]; wgrad: dW [El, n, k] from the gradient [Mp, n] and the input [Mp, k]):
  // cuBLASLt per expert on the host segments, or the sm_90a BF16 kernels on the device segments
  // (path_.grouped_gemm: sync_free or CudaLayerOptions::FpropDgrad::kGrouped; wgrad with align 128).
  void bf16_fprop(const bf16_t* in, int64_t n, int64_t k, const bf16_t* w, bf16_t* out);
  void bf16_dgrad(const bf16_t* in, int64_t n, int64_t k, const bf16_t* w, bf16_t* out);
  void bf16_wgrad(const bf16_t* grad, int64_t n, const bf16_t* in, int64_t k, float* dw, bf16_t* dw_bf16);
  // The device row count the row-wise kernels stop at (sync_free: padded offsets[El]), or null.
  const int32_t* rows_bound() const { return sync_free_ ? segment_offsets() + El_ : nullptr; }

  // ---- report (report.cu) ----------------------------------------------------------------------
  void log(MoePass pass, CastKind kind, const std::string& name, int64_t calls, int64_t outputs, int64_t elements);
  // An operator over the padded rows: Mp x cols elements (sync_free: resolved when the report is read).
  void log_rows(MoePass pass, CastKind kind, const std::string& name, int64_t calls, int64_t outputs, int64_t cols);
  // An operator over the rows the local experts hold: held x cols elements (sync_free: resolved later).
  void log_held(MoePass pass, CastKind kind, const std::string& name, int64_t calls, int64_t outputs, int64_t cols);
  // The row counts the report needs: padded rows, rows held, 128-row blocks.
  struct RowCounts {
    int64_t padded = 0, held = 0, blocks = 0;
  };
  RowCounts row_counts() const { return {Mp_, held_, blocks_}; }
  // sync_free: the step's operators and saved tensors completed with the counts fetched now.
  void resolve_report() const;
  void save_rows(const std::string& name, const std::string& format, int64_t bytes, double per_row,
                 int64_t held) const;
  void save_tokens(const std::string& name, const std::string& format, int64_t bytes) const;
  // The recipe's three saved tensors (recipe.h SavedSpec) and the router's, for these row counts.
  void save_activations(const RowCounts& rc) const;
  int64_t saved_bytes(TensorFormat f, int64_t cols, const RowCounts& rc) const;
  void read_status() const;
  StageClock::Scope fwd(const char* name, cudaStream_t s = nullptr) {
    return StageClock::Scope(&clock_, MoePass::kForward, name, s ? s : stream_);
  }
  StageClock::Scope bwd(const char* name, cudaStream_t s = nullptr) {
    return StageClock::Scope(&clock_, MoePass::kBackward, name, s ? s : stream_);
  }
  StageClock::Scope stage(MoePass pass, const char* name) { return StageClock::Scope(&clock_, pass, name, stream_); }
  DeviceStatus* st_fwd() { return ws_.routing.pass_status + kStatusFwd; }
  DeviceStatus* st_fwd_aux() { return ws_.routing.pass_status + kStatusFwdAux; }
  DeviceStatus* st_bwd() { return ws_.routing.pass_status + kStatusBwd; }
  DeviceStatus* st_bwd_aux() { return ws_.routing.pass_status + kStatusBwdAux; }

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
  const float* gemm1_bias_ = nullptr;  // b1 of the current forward (set_gemm1_bias), else null
  bool sync_free_ = false;    // CudaLayerOptions::sync_free: Mp_ is the capacity max_rows_
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
  MoeWeights backward_weights_;  // set_backward_weights' parameters, for the next backward only
  MoeWeights backward_params_;   // ... taken by the backward running now
  bool grads_accumulate_ = true;  // MoeGrads::accumulate of the backward running
  bool dx_ready_marked_ = false;  // mark_dx_rows_ready ran in this backward
  int64_t T_ = 0;                 // tokens of the forward
  int64_t Mp_ = 0;                // padded rows of the local experts
  int64_t routed_ = 0;            // routed rows of this rank's tokens
  int64_t held_ = 0;              // routed rows the local experts hold (= routed_ alone)
  int64_t blocks_ = 0;            // 128-row blocks of the segments
  Segments seg_;
  DispatchPlan plan_;             // EP: of the latest forward (backward reuses it)
  int64_t dedup_recv_tokens_ = 0; // EP dedup: tokens received by the forward's dispatch
  int64_t host_syncs_ = 0;
  DevicePeers* peers_ = nullptr;  // sync-free EP: comm_->device_peers()
  std::vector<std::pair<const void*, void* const*>> peer_tables_;  // buffer -> its peers' addresses

  // ---- report ----------------------------------------------------------------------------------
  struct PendingOp {  // sync_free: an operator of the step, elements + Mp * row_cols
    MoePass pass;
    CastKind kind;
    std::string name;
    int64_t calls, outputs, elements, row_cols, held_cols;  // + held rows * held_cols
  };
  std::vector<PendingOp> pending_ops_;
  struct PendingWire {  // sync-free EP: an exchange of the step, sized from the plan when resolved
    enum Kind { kDispatch, kDedup, kCombine } kind;
    MoePass pass;
    std::string name, format;
    WireFormat wire;    // kDispatch
    int64_t row_bytes;  // kDedup, kCombine
  };
  std::vector<PendingWire> pending_wire_;
  mutable CastReport rep_;
  mutable MoeStatus mstatus_;
  mutable bool stats_valid_ = false;
};

}  // namespace moe
}  // namespace cuda
}  // namespace flowmoe
