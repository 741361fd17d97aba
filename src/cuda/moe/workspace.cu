// Allocation of the CUDA layer's workspace (workspace.h), once, at construction.
#include <cuda_runtime.h>

#include <algorithm>
#include <sstream>

#include "cuda/common.cuh"
#include "cuda/moe/pipelines/pipeline.h"
#include "cuda/moe/workspace.h"
#include "flowmoe/comm.h"
#include "flowmoe/gemm.h"
#include "flowmoe/recipe.h"

namespace flowmoe {
namespace cuda {
namespace moe {

void* DeviceArena::device_bytes(size_t n, Region r) {
  const size_t bytes = (n + 255) / 256 * 256;
  if (caller_ && r != Region::kLayer) {
    const int i = int(r);
    const int64_t off = used_[i];
    used_[i] += int64_t(bytes);
    // the measuring pass: an address in the first, never mapped, page range (a use faults)
    return base_[i] ? base_[i] + off : reinterpret_cast<char*>(uintptr_t(0x1000) + uintptr_t(off));
  }
  return fixed(bytes, /*pinned=*/false);
}

void* DeviceArena::fixed(size_t bytes, bool pinned) {
  if (next_fixed_ < fixed_.size()) return fixed_[next_fixed_++];  // a later layout pass
  void* p = nullptr;
  if (pinned) {
    FLOWMOE_CUDA_CHECK(cudaMallocHost(&p, bytes));
    pinned_.push_back(p);
  } else {
    const cudaError_t err = cudaMalloc(&p, bytes);
    if (err == cudaErrorMemoryAllocation) {
      (void)cudaGetLastError();  // (not left for the caller's next launch check)
      std::ostringstream os;
      os << "make_cuda_layer: CUDA out of memory. cudaMalloc of " << bytes << " bytes failed for "
         << cfg_.describe() << ", max_tokens = " << cfg_.max_tokens << "; " << allocated_ << " bytes allocated before it";
      throw OutOfMemoryError(__FILE__, __LINE__, os.str());
    }
    FLOWMOE_CHECK(err == cudaSuccess, "make_cuda_layer: cudaMalloc of " << bytes << " bytes failed ("
                                          << cudaGetErrorString(err) << ") for " << cfg_.describe()
                                          << ", max_tokens = " << cfg_.max_tokens << "; " << allocated_
                                          << " bytes allocated before it");
    device_.push_back(p);
    allocated_ += bytes;
  }
  fixed_.push_back(p);
  ++next_fixed_;
  return p;
}

void DeviceArena::begin_pass(const MoeMemory* bases) {
  next_fixed_ = 0;
  for (int64_t& u : used_) u = 0;
  base_[int(Region::kWeights)] = static_cast<char*>(bases ? bases->weights : nullptr);
  base_[int(Region::kSaved)] = static_cast<char*>(bases ? bases->saved : nullptr);
  base_[int(Region::kTransient)] = static_cast<char*>(bases ? bases->transient : nullptr);
}

void DeviceArena::release() {
  for (void* p : device_) cudaFree(p);
  for (void* p : pinned_) cudaFreeHost(p);
  device_.clear();
  pinned_.clear();
  fixed_.clear();
  next_fixed_ = 0;
}

namespace {

// Device tables of a routing of up to `tokens` tokens (k = cfg.topk) over `experts` experts;
// tokens is set per call (0 here). row_src / row_map_unpadded only where asked for.
Routing alloc_routing(DeviceArena& a, int64_t tokens, int topk, int experts, int align, bool row_src,
                      bool unpadded, Region tables) {
  Routing r;
  r.tokens = 0;
  r.topk = topk;
  r.num_experts = experts;
  r.align = align;
  r.counts = a.device<int32_t>(experts, tables);
  r.offsets = a.device<int32_t>(experts + 1, tables);
  r.padded_offsets = a.device<int32_t>(experts + 1, tables);
  r.row_map = a.device<int32_t>(tokens * topk, tables);
  if (row_src) r.row_src = a.device<int32_t>(routing_max_rows(tokens, topk, experts, align), tables);
  if (unpadded) r.row_map_unpadded = a.device<int32_t>(tokens * topk, tables);
  r.workspace = a.device<uint8_t>(int64_t(routing_workspace_bytes(tokens, topk, experts)), Region::kTransient);
  return r;
}

}  // namespace

void Workspace::allocate(DeviceArena& a, const MoeConfig& cfg, const RecipePath& path, bool device_plan) {
  // rows: cfg.max_rows() in whole 128-row blocks (the sync-free layer's capacity, which the wgrad
  // kernel reads as 128-token blocks through TMA)
  const int64_t R = workspace_rows(cfg), Tm = cfg.max_tokens, H = cfg.hidden, F = cfg.ffn, E = cfg.num_experts;
  const int64_t El = cfg.num_local_experts(), K = cfg.topk;
  const int64_t MB = segment_max_blocks(R, int(El));
  const int64_t maxC = std::max(H, 2 * F);
  const bool pow2 = path.pow2_weights;  // UE8M0 block scales before conversion
  const bool fp8 = path.fp8;
  const bool dedup = path.ep_dedup, fused_swiglu = path.fused_swiglu, fused_dswiglu = path.fused_dswiglu;
  Communicator* comm = cfg.comm;
  constexpr Region kW = Region::kWeights, kS = Region::kSaved, kT = Region::kTransient;

  // The routing of the forward: kept for its backward (kS); the backward's own tables are scratch.
  RoutingBuffers& r = routing;
  r.x = a.device<bf16_t>(Tm * H, kS);
  r.logits = a.device<float>(Tm * E, kS);
  r.dlogits = a.device<float>(Tm * E, kT);
  r.ids = a.device<int32_t>(Tm * K, kS);
  r.probs = a.device<float>(Tm * K, kS);
  r.dprobs = a.device<float>(Tm * K, kT);
  r.tokens = alloc_routing(a, Tm, int(K), int(E), cfg.align, /*row_src=*/!comm, /*unpadded=*/comm != nullptr, kS);
  if (cfg.aux_loss_alpha > 0.0f) {
    r.aux_workspace = a.device<uint8_t>(int64_t(router_aux_workspace_bytes(Tm, int(E))), kS);
    r.aux_coef = a.device<float>(E, kS);
  }
  r.aux_loss = a.device<float>(1);
  r.row_prob = a.device<float>(R, kS);
  r.dprob_partials = a.device<float>(R * (F / 128), kT);
  r.block_start = a.device<int32_t>(MB, kS);
  r.block_end = a.device<int32_t>(MB, kS);
  r.block_offsets = a.device<int32_t>(E + 1, kS);
  r.pass_status = a.device<DeviceStatus>(4);
  r.weight_status = a.device<DeviceStatus>(2);
  r.host_counts = a.pinned<int32_t>(E);
  r.host_status = a.pinned<DeviceStatus>(5);
  r.host_aux_loss = a.pinned<float>(1);

  // Expert parallelism: the plan's device tables and staging stay with the forward (kS).
  if (comm) {
    const int64_t nc = H / 128;
    EpBuffers& p = ep;
    p.local_offsets = a.device<int32_t>(El + 1, kS);
    p.host_local_offsets = a.pinned<int32_t>(El + 1);
    p.send_rows = a.device<uint8_t>(Tm * K * 2 * H, kS);
    p.combined_rows = reinterpret_cast<bf16_t*>(p.send_rows);
    p.send_scales = a.device<uint8_t>(Tm * K * 4 * nc, kS);
    p.send_probs = a.device<float>(Tm * K, kS);
    p.combined_dprobs = p.send_probs;
    p.recv_scales = a.device<uint8_t>(R * 4 * nc, kS);
    p.row_dprob = a.device<float>(R, kS);
    if (dedup) {
      // send side: at most min(W, k) * Tm token rows (through send_rows / send_scales); receive
      // side: at most W * Tm tokens
      const int W = comm->world_size();
      const int64_t Wt = int64_t(W) * Tm;
      p.peer_ids = a.device<int32_t>(Tm * K, kS);
      p.tokens_to_ranks = alloc_routing(a, Tm, int(K), W, 1, false, false, kS);
      p.host_tokens_to_rank = a.pinned<int32_t>(W);
      p.send_ids = a.device<int32_t>(Tm * K * K, kS);
      p.send_token_probs = a.device<float>(Tm * K * K, kS);
      p.recv_tokens = a.device<uint8_t>(Wt * 2 * H, kS);
      p.recv_token_scales = a.device<uint8_t>(Wt * (H / 32), kS);  // FP8: H/128 bytes per row; MXFP4: H/32
      p.recv_token_scales_col = a.device<uint8_t>(Wt * nc, kS);
      p.recv_ids = a.device<int32_t>(Wt * K, kS);
      p.recv_probs = a.device<float>(Wt * K, kS);
      p.recv_local_ids = a.device<int32_t>(Wt * K, kS);
      p.received_tokens = alloc_routing(a, Wt, int(K), int(El), cfg.align, true, false, kS);
    }
    if (device_plan) {
      const int64_t W = comm->world_size();
      p.count_matrix = a.device<int32_t>(W * E + W * W, kS);
      p.token_matrix = p.count_matrix + W * E;
      p.host_matrices = a.pinned<int32_t>(W * E + W * W);
      p.dispatch_pieces = a.device<EpPiece>(W * El + El, kS);
      p.combine_pieces = a.device<EpPiece>(W * El, kS);
      p.dedup_pieces = a.device<EpPiece>(W, kS);
    }
  }

  WeightBuffers& w = weights;
  // The weights the GEMMs read (kW); the BF16 copies only for bf16's GEMMs, otherwise scratch of
  // set_weights like the UE8M0 scales before their conversion and Wr's non-finite check.
  w.wr = a.device<float>(E * H, kW);
  w.router_bias = a.device<float>(E, kW);
  w.wr_check = a.device<bf16_t>(E * H, kT);
  // FP8 blocks are quantized straight from the parameters: no BF16 copy (the fused SwiGLU's W1
  // interleaving too: written so by the quantization).
  const Region bf16_weights = fp8 ? kT : kW;
  if (path.bf16_relay_planned) {
    // a pass may relay the stored parameters into its own scratch copies
    w.w1_bf16 = a.device<bf16_t>(El * 2 * F * H, kT);
    w.w2_bf16 = a.device<bf16_t>(El * H * F, kT);
  } else if (path.bf16_params_in_place) {
    // (the GEMMs read the caller's BF16 parameters: no copies)
  } else if (!pow2) {
    w.w1_bf16 = a.device<bf16_t>(El * 2 * F * H, bf16_weights);
    w.w2_bf16 = a.device<bf16_t>(El * H * F, bf16_weights);
  }
  if (fp8) {
    // the dgrad weights: kept from set_weights, or (caller memory) made per backward (below)
    const bool keep_t = !path.transposes_in_backward;
    w.w1 = weight_128x128_f32(a.device<uint8_t>(El * 2 * F * H, kW), nullptr, int(El), 2 * F, H);
    w.w2 = weight_128x128_f32(a.device<uint8_t>(El * H * F, kW), nullptr, int(El), H, F);
    w.w1.scales = a.device<float>(gemm::weight_scale_f32_elems(int(El), 2 * F, H), kW);
    w.w2.scales = a.device<float>(gemm::weight_scale_f32_elems(int(El), H, F), kW);
    if (keep_t) {
      w.w1t = weight_128x128_f32(a.device<uint8_t>(El * 2 * F * H, kW), nullptr, int(El), H, 2 * F);
      w.w2t = weight_128x128_f32(a.device<uint8_t>(El * H * F, kW), nullptr, int(El), F, H);
      w.w1t.scales = a.device<float>(gemm::weight_scale_f32_elems(int(El), H, 2 * F), kW);
      w.w2t.scales = a.device<float>(gemm::weight_scale_f32_elems(int(El), F, H), kW);
    }
    if (pow2) {
      w.w1_ue8m0 = a.device<uint8_t>(El * (2 * F / 128) * (H / 128), kT);
      w.w2_ue8m0 = a.device<uint8_t>(El * (H / 128) * (F / 128), kT);
      if (keep_t) {
        w.w1t_ue8m0 = a.device<uint8_t>(El * (2 * F / 128) * (H / 128), kT);
        w.w2t_ue8m0 = a.device<uint8_t>(El * (H / 128) * (F / 128), kT);
      }
    }
  }

  // The expert path: what the recipe's table saves (recipe.h SavedSpec) is kS, the rest scratch.
  ExpertBuffers& x = expert;
  // the expert output rows and the dX rows: in the column copies' codes (below) or their own
  if (!path.dx_rows_in_column_copies) x.rows_bf16 = a.device<bf16_t>(R * H, kT);
  const bool h_bf16 = path.h_saved == TensorFormat::kBf16;  // all but the flow pipeline
  const bool a_bf16 = path.a_saved == TensorFormat::kBf16;  // bf16
  // (the fused epilogues, flow pipeline only, leave out BF16 h and da')
  x.h = fused_swiglu ? nullptr : a.device<bf16_t>(R * 2 * F, h_bf16 ? kS : kT);
  // Caller memory: the backward's W^T groups (WeightBuffers::wt_*). The flow pipeline's BF16 h is
  // scratch of its forward alone (its backward reads the saved quantized h; the unfused dSwiGLU
  // writes dh in FP8), so the groups and then da' (its BF16 a buffer serves only as da') live
  // there when they fit.
  uint8_t* h_free = !h_bf16 && !fused_dswiglu && x.h ? reinterpret_cast<uint8_t*>(x.h) : nullptr;
  int64_t h_left = h_free ? int64_t(sizeof(bf16_t)) * R * 2 * F : 0;
  const auto take_h = [&](int64_t bytes) -> uint8_t* {
    bytes = (bytes + 255) / 256 * 256;
    if (!h_free || bytes > h_left) return nullptr;
    uint8_t* p = h_free;
    h_free += bytes, h_left -= bytes;
    return p;
  };
  if (fp8 && path.transposes_in_backward) {
    const int c1 = path.wt_chunk1, c2 = path.wt_chunk2;
    const int64_t codes = std::max(c1 * 2 * F * H, c2 * H * F);
    const int64_t scales = std::max(gemm::weight_scale_f32_elems(c1, H, 2 * F), gemm::weight_scale_f32_elems(c2, F, H));
    const int64_t ue8m0 = pow2 ? std::max(c1 * (2 * F / 128) * (H / 128), c2 * (H / 128) * (F / 128)) : 0;
    const auto scratch = [&](int64_t bytes) {  // in h where it fits, else scratch of its own
      uint8_t* p = take_h(bytes);
      return p ? p : a.device<uint8_t>(bytes, kT);
    };
    w.wt_codes = scratch(codes);
    w.wt_scales = reinterpret_cast<float*>(scratch(4 * scales));
    if (pow2) w.wt_ue8m0 = scratch(ue8m0);
  }
  if (fused_dswiglu) {
    x.a = nullptr;
  } else if (bf16_t* in_h = a_bf16 ? nullptr : reinterpret_cast<bf16_t*>(take_h(int64_t(sizeof(bf16_t)) * R * F))) {
    x.a = in_h;  // (flow: a' is never BF16; this buffer is the backward's da')
  } else {
    x.a = a.device<bf16_t>(R * F, a_bf16 ? kS : kT);
  }
  if (path.x_perm_saved == TensorFormat::kBf16) x.x_perm = a.device<bf16_t>(R * H, kS);  // bf16
  x.da = a_bf16 ? a.device<bf16_t>(R * F, kT) : x.a;  // (a' saved in BF16: read by GEMM2's wgrad after da')
  x.dh = h_bf16 ? a.device<bf16_t>(R * 2 * F, kT) : x.h;  // (h saved quantized: its BF16 buffer is scratch)
  if (fp8) {
    const QTensorView row =
        row_1x128(a.device<uint8_t>(R * maxC, kT), a.device<uint8_t>((maxC / 128) * R, kT), R, maxC);
    x.x_perm_fp8 = x.a_row = x.dy_row = x.dh_row = row;
    // the two column copies' codes in one piece: the gradient's (dY's [H over R], then dh's [2F over
    // R]) and the other wgrad operand's (x_perm's [H over R]; fp8-naive: a''s [F over R] first), so
    // R (maxC + max(H, F)) >= 2 R H bytes, the dX rows' when they share it
    // (RecipePath::dx_rows_in_column_copies: GEMM1's wgrad has read both copies before its dgrad
    // writes the rows; the forward's GEMM2 rows come after every forward use of them)
    const int64_t in_cols = std::max(H, F);
    uint8_t* col_codes = a.device<uint8_t>((maxC + in_cols) * R, kT);
    if (path.dx_rows_in_column_copies) x.rows_bf16 = reinterpret_cast<bf16_t*>(col_codes);
    const QTensorView grad_col = col_128x1(col_codes, a.device<uint8_t>(MB * maxC, kT), R, maxC, MB);
    x.dy_col = x.dh_col = grad_col;
    x.x_perm_col_flow = col_128x1(col_codes + maxC * R, a.device<uint8_t>(MB * in_cols, kT), R, in_cols, MB);
    x.gemm_row_scales = a.device<float>(R * maxC / 128, kT);
    x.grad_col_scales = a.device<float>(MB * maxC, kT);
    x.input_col_scales = a.device<float>(MB * maxC, kT);
    x.dy_row_f32 = x.dh_row_f32 = x.x_recv_f32 =
        row_1x128_f32(row.codes, x.gemm_row_scales, R, maxC);
    x.dy_col_f32 = x.dh_col_f32 = col_128x1_f32(grad_col.codes, x.grad_col_scales, R, maxC, MB);
    x.a_col_f32 = x.x_perm_col_f32 =
        col_128x1_f32(x.x_perm_col_flow.codes, x.input_col_scales, R, in_cols, MB);
  }
  // the buffers only this dataflow uses (its pipeline's file)
  const DataflowBufferPlan own{a, x, path, R, Tm, H, F, MB, maxC};
  if (const auto plan = dataflow_row(path.dataflow).plan_buffers) plan(own);
}

}  // namespace moe
}  // namespace cuda
}  // namespace flowmoe
