// The CUDA layer's device memory: every buffer allocated once, at construction, for cfg.max_tokens
// (Tm), with rows sized by the host-side bound R = cfg.max_rows() in whole 128-row blocks
// (workspace_rows; scale grids and column copies
// use the real padded row count Mp of a pass as their leading dimension inside them). Forward and
// backward allocate nothing. Each field is a named view (quantized tensors:
// flowmoe/cuda/qtensor_view.h); where one allocation holds different tensors at different points
// of a step, each tensor has its own view (same address) and the comment says when it is live.
#pragma once

#include <cstddef>
#include <cstdint>
#include <vector>

#include "cuda/moe/kernels.cuh"
#include "cuda/moe/recipe_path.h"
#include "flowmoe/cuda/convert.h"
#include "flowmoe/cuda/qtensor_view.h"
#include "flowmoe/moe.h"
#include "flowmoe/token.h"

namespace flowmoe {
namespace cuda {
namespace moe {

// The rows of the expert workspaces: cfg.max_rows() rounded up to whole 128-row blocks.
inline int64_t workspace_rows(const MoeConfig& cfg) { return (cfg.max_rows() + 127) / 128 * 128; }


// Where a buffer lives (CudaLayerOptions::caller_memory): kLayer with the layer for its lifetime
// (counters, small tables); kWeights, kSaved, kTransient in the caller's regions of those names
// (moe.h MoeMemoryPlan). A layer that owns its memory allocates every region itself.
enum class Region : uint8_t { kLayer, kWeights, kSaved, kTransient };

// Hands out the workspace's buffers. Owned memory: one cudaMalloc per buffer, once. Caller memory:
// kLayer buffers and pinned host memory are allocated by the first layout pass and handed out
// again, in the same order, by every later pass; the other regions are carved from the bases of
// the pass (256-byte aligned offsets), the first pass only measuring them (addresses that fault).
// Error messages name the layer's configuration.
class DeviceArena {
 public:
  explicit DeviceArena(const MoeConfig& cfg) : cfg_(cfg) {}
  ~DeviceArena() { release(); }
  DeviceArena(const DeviceArena&) = delete;
  DeviceArena& operator=(const DeviceArena&) = delete;

  void set_caller_memory(bool on) { caller_ = on; }
  // A new layout pass over the caller's regions (null: the first, measuring pass).
  void begin_pass(const MoeMemory* bases);
  MoeMemoryPlan plan() const { return {used_[1], used_[2], used_[3]}; }

  template <typename T>
  T* device(int64_t n, Region r = Region::kLayer) {
    return static_cast<T*>(device_bytes(size_t(n <= 0 ? 1 : n) * sizeof(T), r));
  }
  template <typename T>
  T* pinned(int64_t n) { return static_cast<T*>(fixed(size_t(n) * sizeof(T), /*pinned=*/true)); }
  size_t allocated() const { return allocated_; }  // device bytes the layer holds itself
  void release();

 private:
  void* device_bytes(size_t bytes, Region r);
  void* fixed(size_t bytes, bool pinned);  // kLayer and pinned: allocated once, replayed after
  const MoeConfig& cfg_;
  bool caller_ = false;
  std::vector<void*> device_, pinned_;
  std::vector<void*> fixed_;  // the first pass's kLayer / pinned buffers in allocation order
  size_t next_fixed_ = 0;
  int64_t used_[4] = {0, 0, 0, 0};   // bytes carved per region in this pass
  char* base_[4] = {nullptr, nullptr, nullptr, nullptr};
  size_t allocated_ = 0;
};

// Routing state of a pass (every recipe).
struct RoutingBuffers {
  bf16_t* x = nullptr;        // [Tm, H] the forward's input (router dWr reads it in backward)
  float* logits = nullptr;    // [Tm, E]
  float* dlogits = nullptr;   // [Tm, E]
  int32_t* ids = nullptr;     // [Tm, k] expert ids
  float* probs = nullptr;     // [Tm, k]
  float* dprobs = nullptr;    // [Tm, k]
  // This rank's tokens over the E experts; one GPU: row_src (the inverse row map of the coalesced
  // FP8 scale permute); EP: row_map_unpadded (the dispatch's send order).
  Routing tokens;
  uint8_t* aux_workspace = nullptr;  // aux loss (cfg.aux_loss_alpha > 0)
  float* aux_coef = nullptr;         // [E]
  float* aux_loss = nullptr;         // [1]
  float* row_prob = nullptr;         // [R] probability of each padded row (0 on padding rows)
  float* dprob_partials = nullptr;   // [F/128][R] per-tile partial sums of d loss / d prob
  // the segments' 128-row blocks of the padded rows (segment_max_blocks(R, El) entries)
  int32_t* block_start = nullptr;
  int32_t* block_end = nullptr;
  int32_t* block_offsets = nullptr;  // [E+1]
  DeviceStatus* pass_status = nullptr;    // [4]: forward, forward aux, backward, backward aux
  DeviceStatus* weight_status = nullptr;  // [2]: set_weights' counters; [1] the non-finite check (sync_free)
  int32_t* host_counts = nullptr;         // [E] pinned: routed rows per expert
  DeviceStatus* host_status = nullptr;    // [5] pinned: the passes' four, then weight_status
  float* host_aux_loss = nullptr;         // [1] pinned
};

// Router weights and the expert weights in every form the recipe's GEMMs read.
struct WeightBuffers {
  float* wr = nullptr;            // [E, H]
  float* router_bias = nullptr;   // [E]
  bf16_t* wr_check = nullptr;     // [E, H] scratch of set_weights' non-finite check of Wr
  bf16_t* w1_bf16 = nullptr;      // [El, 2F, H] (FP8 with FP32 scales: scratch; FP8 blocks: none;
                                  // none where bf16 reads the parameters in place: StepContext::bf16_weight)
  bf16_t* w2_bf16 = nullptr;      // [El, H, F] (FP8 with FP32 scales: scratch; FP8 blocks: none)
  // FP8 recipes: codes + GEMM-ready FP32 128x128 block scales, and the exact transposes (dgrad;
  // with caller memory transposed from W at the start of each backward, in the transient region);
  // with the fused SwiGLU (CudaLayerOptions::fused_swiglu) w1's 128-row blocks are interleaved
  // gate/up per expert (as interleave_gate_up; quantize_weights writes them so)
  QTensorView w1, w1t, w2, w2t;  // (w1t, w2t: not with caller memory, which makes W^T in the backward)
  // power-of-two recipes: the UE8M0 block scales quantize_weight writes, [El][N/128][K/128],
  // converted into w*.scales
  uint8_t *w1_ue8m0 = nullptr, *w1t_ue8m0 = nullptr, *w2_ue8m0 = nullptr, *w2t_ue8m0 = nullptr;
  // caller memory: the backward's dgrad weights, RecipePath::wt_chunk1 experts of W1^T or
  // wt_chunk2 of W2^T at a time (transient; flow: in the BF16 h scratch, which its backward does
  // not use): codes, GEMM-ready FP32 scales, and the UE8M0 scales a quantization writes first
  uint8_t* wt_codes = nullptr;
  float* wt_scales = nullptr;
  uint8_t* wt_ue8m0 = nullptr;
};

// Activations, saved tensors and scratch of the expert path (shapes for R padded rows).
struct ExpertBuffers {
  // [R, H] bf16 token-width rows, one allocation holding in turn (never two at once):
  //   forward  1. x_perm staging (blockwise, fp8-naive): the permuted x in BF16, read only by its
  //               quantization before GEMM1 (x_perm row + col, or row with FP32 scales)
  //            2. y rows (every pipeline): GEMM2's output, read by the combine / unpermute
  //   backward 3. dY rows (bf16, blockwise, fp8-naive): the permuted dY in BF16, last read by
  //               GEMM2's grads (flow moves dY in FP8: dy_row)
  //            4. dX rows (every pipeline): GEMM1 dgrad's output, read by the tail or the EP combine
  // Sync-free EP shares this one address with the peers, which pull 2. and 4. from it.
  bf16_t* rows_bf16 = nullptr;
  bf16_t* x_perm = nullptr;          // [R, H] bf16 recipe: GEMM1 input (saved)
  bf16_t* h = nullptr;               // [R, 2F] GEMM1 output (saved in bf16, blockwise, fp8-naive; null
                                     // with the fused SwiGLU)
  bf16_t* a = nullptr;               // [R, F] a' in BF16 (saved in bf16; null with the fused dSwiGLU)
  bf16_t* da = nullptr;              // [R, F] d a' (FP8 recipes: the allocation of `a`)
  bf16_t* dh = nullptr;              // [R, 2F] (flow: the allocation of `h`, scratch there)

  // FP8 recipes: one row-wise UE8M0 operand [R, max(H, 2F)], four tensors never live at once:
  QTensorView x_perm_fp8;  // forward: x_perm row-wise, GEMM1's input (blockwise: quantized from
                         // BF16; flow-fp4: converted from MXFP4)
  QTensorView a_row;       // forward: a' row-wise (GEMM2's input)
  QTensorView dy_row;      // backward: dY row-wise (GEMM2 dgrad)
  QTensorView dh_row;      // backward: dh row-wise (GEMM1 dgrad)
  // fp8-naive, the same codes with FP32 scales in `gemm_row_scales`:
  QTensorView dy_row_f32, dh_row_f32;
  QTensorView x_recv_f32;  // EP forward / backward entry: the received FP8 rows and their scales
  float* gemm_row_scales = nullptr;  // [max(H, 2F)/128][R] GEMM-ready FP32 scales of the row operand
  // column copies for wgrad [max(H, 2F) over R], with their GEMM-ready FP32 scales
  QTensorView dy_col, dh_col;          // one allocation: dY's copy, then dh's
  QTensorView x_perm_col_flow;         // flow / flow-fp4: x_perm's copy (made in backward)
  QTensorView dy_col_f32, dh_col_f32;  // fp8-naive: dY's, then dh's (codes of dy_col)
  QTensorView a_col_f32, x_perm_col_f32;  // fp8-naive: a''s, then x_perm's (codes of x_perm_col_flow)
  float* grad_col_scales = nullptr;  // [blocks][max(H, 2F)] FP32 scales of dy_col / dh_col
  float* input_col_scales = nullptr; // the same for the wgrad's other operand

  // saved by the forward, per recipe
  QTensorView x_perm_col;   // blockwise: x_perm column-wise [H over R]
  QTensorView a_col;        // blockwise, flow, flow-fp4: a' column-wise [F over R]
  QTensorView x_perm_row;   // flow: x_perm row-wise FP8 [R, H]
  QTensorView x_perm_mxfp4; // flow-fp4: x_perm MXFP4 [R, H]
  QTensorView h_saved;      // flow: h row-wise FP8 [R, 2F]; flow-fp4: h MXFP4
  // flow-fp4 with the fused SwiGLU: GEMM1's FP8 input [R, H] in the storage of dy_col (backward
  // only), since the kernel that reads it writes a_row, whose storage x_perm_fp8 shares
  QTensorView x_perm_fp8_fused;
  // flow / flow-fp4 with the fused dSwiGLU: dh row-wise [R, 2F] (its own allocation: the kernel that
  // writes it reads dY row-wise, whose storage dh_row shares) and column-wise [2F over R] (in BF16
  // h's storage when there is one, scales dense [MB][2F]), which GEMM1's grads read
  QTensorView dh_row_fused, dh_col_fused;
  QTensorView x_perm_f32;   // fp8-naive: x_perm row-wise, FP32 scales (expert-packed)
  QTensorView a_f32;        // fp8-naive: a' row-wise, FP32 scales (expert-packed)

  // entry quantization of the token rows [Tm, H] (x in forward, dy in backward)
  QTensorView entry_fp8;    // flow, flow-fp4 (flow-fp4: dy only)
  QTensorView entry_mxfp4;  // flow-fp4: x
  QTensorView entry_f32;    // fp8-naive
  bf16_t* entry_dequantized = nullptr;  // fp8-naive, one GPU: [Tm, H]
  // fp8-naive column copies (DQ -> T -> Q): the dequantized rows and their transpose
  bf16_t* naive_dequantized = nullptr;  // [R, max(H, 2F)]
  bf16_t* naive_transposed = nullptr;   // [max(H, 2F), R]
};

// Expert parallelism (cfg.comm): send and receive staging. Worst case: this rank sends at most
// Tm*k rows and its El experts receive at most R padded rows.
struct EpBuffers {
  int32_t* local_offsets = nullptr;       // [El+1] device: padded offsets of the local segments
  int32_t* host_local_offsets = nullptr;  // [El+1] pinned
  uint8_t* send_rows = nullptr;     // [Tm*k, 2H] bytes: send-order rows (the widest, BF16)
  bf16_t* combined_rows = nullptr;  // the same allocation: the combines' rows coming back
  uint8_t* send_scales = nullptr;   // [Tm*k, 4*H/128] bytes: send-order scales, row-major
  float* send_probs = nullptr;      // [Tm*k] send-order probs
  float* combined_dprobs = nullptr; // the same allocation: backward, the row dprobs coming back
  uint8_t* recv_scales = nullptr;   // [R, 4*H/128] bytes: received scales, row-major
  float* row_dprob = nullptr;       // [R] d loss / d prob of each received row

  // Deduplicated dispatch: a token goes once to each rank holding one of its experts.
  int32_t* peer_ids = nullptr;        // [Tm, k] destination rank of each slot (-1: repeat)
  Routing tokens_to_ranks;            // this rank's tokens over the W ranks (token order per rank)
  int32_t* host_tokens_to_rank = nullptr;  // [W] pinned
  int32_t* send_ids = nullptr;        // [Tm, k] rows of k expert ids
  float* send_token_probs = nullptr;  // [Tm, k] rows of k probs
  uint8_t* recv_tokens = nullptr;     // [W*Tm, 2H] bytes: received token rows (codes)
  uint8_t* recv_token_scales = nullptr;  // [W*Tm, H/32] bytes: their scales, row-major
  uint8_t* recv_token_scales_col = nullptr;  // [H/128][W*Tm]: FP8 scales relaid column-wise
  int32_t* recv_ids = nullptr;        // [W*Tm, k]
  float* recv_probs = nullptr;        // [W*Tm, k]
  int32_t* recv_local_ids = nullptr;  // [W*Tm, k] local expert ids (-1: another rank's)
  Routing received_tokens;            // the received tokens over the El local experts

  // Sync-free expert parallelism (CudaLayerOptions::sync_free; ep_device.cu): the plan on the device.
  int32_t* count_matrix = nullptr;    // [W, E] rows each rank routes to each global expert
  int32_t* token_matrix = nullptr;    // [W, W] tokens each rank sends to each rank (dedup; right after count_matrix)
  int32_t* host_matrices = nullptr;   // [W*E + W*W] pinned: both, copied each forward for the report
  EpPiece* dispatch_pieces = nullptr; // [W*El + El]
  EpPiece* combine_pieces = nullptr;  // [W*El]
  EpPiece* dedup_pieces = nullptr;    // [W]
};

// The buffers only one dataflow uses, planned by its pipeline's file (pipelines/*.cu), last of
// Workspace::allocate's allocations (so the other buffers' places do not depend on the dataflow):
// what it saves (Region::kSaved) and its own scratch. R rows of the expert path, Tm tokens, MB
// 128-row blocks, maxC = max(H, 2F).
struct DataflowBufferPlan {
  DeviceArena& arena;
  ExpertBuffers& x;
  const RecipePath& path;
  int64_t R, Tm, H, F, MB, maxC;
};
void plan_blockwise_buffers(const DataflowBufferPlan& p);  // pipelines/blockwise.cu
void plan_fp8_naive_buffers(const DataflowBufferPlan& p);  // pipelines/fp8_naive.cu
void plan_flow_buffers(const DataflowBufferPlan& p);       // pipelines/flow.cu

struct Workspace {
  RoutingBuffers routing;
  WeightBuffers weights;
  ExpertBuffers expert;
  EpBuffers ep;
  // The buffers of `path` (recipe_path.h): its pipeline and saved formats; ep_dedup: the
  // deduplicated EP dispatch's buffers; fused_swiglu / fused_dswiglu (flow pipeline): GEMM1's and
  // GEMM2-dgrad's fused epilogues, which leave out BF16 h and da' (ExpertBuffers::h, a) and write dh
  // into dh_row_fused / dh_col_fused. device_plan: the sync-free expert-parallel plan buffers
  // (EpBuffers, last group).
  void allocate(DeviceArena& arena, const MoeConfig& cfg, const RecipePath& path, bool device_plan);
};

}  // namespace moe
}  // namespace cuda
}  // namespace flowmoe
