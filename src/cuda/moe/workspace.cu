// Allocation of the CUDA layer's workspace (workspace.h), once, at construction.
#include <cuda_runtime.h>

#include <algorithm>

#include "cuda/common.cuh"
#include "cuda/moe/workspace.h"
#include "flowmoe/comm.h"
#include "flowmoe/gemm.h"
#include "flowmoe/recipe.h"

namespace flowmoe {
namespace cuda {
namespace moe {

void* DeviceArena::device_bytes(size_t n) {
  void* p = nullptr;
  const size_t bytes = (n + 255) / 256 * 256;
  const cudaError_t err = cudaMalloc(&p, bytes);
  FLOWMOE_CHECK(err == cudaSuccess, "make_cuda_layer: cudaMalloc of " << bytes << " bytes failed ("
                                        << cudaGetErrorString(err) << ") for " << cfg_.describe()
                                        << ", max_tokens = " << cfg_.max_tokens << "; " << allocated_
                                        << " bytes allocated before it");
  device_.push_back(p);
  allocated_ += bytes;
  return p;
}

void* DeviceArena::pinned_bytes(size_t n) {
  void* p = nullptr;
  FLOWMOE_CUDA_CHECK(cudaMallocHost(&p, n));
  pinned_.push_back(p);
  return p;
}

void DeviceArena::release() {
  for (void* p : device_) cudaFree(p);
  for (void* p : pinned_) cudaFreeHost(p);
  device_.clear();
  pinned_.clear();
}

namespace {

// Device tables of a routing of up to `tokens` tokens (k = cfg.topk) over `experts` experts;
// tokens is set per call (0 here). row_src / row_map_unpadded only where asked for.
Routing alloc_routing(DeviceArena& a, int64_t tokens, int topk, int experts, int align, bool row_src,
                      bool unpadded) {
  Routing r;
  r.tokens = 0;
  r.topk = topk;
  r.num_experts = experts;
  r.align = align;
  r.counts = a.device<int32_t>(experts);
  r.offsets = a.device<int32_t>(experts + 1);
  r.padded_offsets = a.device<int32_t>(experts + 1);
  r.row_map = a.device<int32_t>(tokens * topk);
  if (row_src) r.row_src = a.device<int32_t>(routing_max_rows(tokens, topk, experts, align));
  if (unpadded) r.row_map_unpadded = a.device<int32_t>(tokens * topk);
  r.workspace = a.device<uint8_t>(int64_t(routing_workspace_bytes(tokens, topk, experts)));
  return r;
}

}  // namespace

void Workspace::allocate(DeviceArena& a, const MoeConfig& cfg, bool dedup, bool device_plan, bool fused_swiglu,
                         bool fused_dswiglu) {
  // rows: cfg.max_rows() in whole 128-row blocks (the sync-free layer's capacity, which the wgrad
  // kernel reads as 128-token blocks through TMA)
  const int64_t R = workspace_rows(cfg), Tm = cfg.max_tokens, H = cfg.hidden, F = cfg.ffn, E = cfg.num_experts;
  const int64_t El = cfg.num_local_experts(), K = cfg.topk;
  const int64_t MB = segment_max_blocks(R, int(El));
  const int64_t maxC = std::max(H, 2 * F);
  const Recipe rc = cfg.recipe;
  const RecipeSpec& spec = recipe_spec(rc);
  const bool pow2 = spec.weights == WeightCopy::kFp8Block;  // UE8M0 block scales before conversion
  const bool fp8 = spec.uses_fp8();
  Communicator* comm = cfg.comm;

  RoutingBuffers& r = routing;
  r.x = a.device<bf16_t>(Tm * H);
  r.logits = a.device<float>(Tm * E);
  r.dlogits = a.device<float>(Tm * E);
  r.ids = a.device<int32_t>(Tm * K);
  r.probs = a.device<float>(Tm * K);
  r.dprobs = a.device<float>(Tm * K);
  r.tokens = alloc_routing(a, Tm, int(K), int(E), cfg.align, /*row_src=*/!comm, /*unpadded=*/comm != nullptr);
  if (cfg.aux_loss_alpha > 0.0f) {
    r.aux_workspace = a.device<uint8_t>(int64_t(router_aux_workspace_bytes(Tm, int(E))));
    r.aux_coef = a.device<float>(E);
  }
  r.aux_loss = a.device<float>(1);
  r.row_prob = a.device<float>(R);
  r.dprob_partials = a.device<float>(R * (F / 128));
  r.block_start = a.device<int32_t>(MB);
  r.block_end = a.device<int32_t>(MB);
  r.block_offsets = a.device<int32_t>(E + 1);
  r.pass_status = a.device<DeviceStatus>(4);
  r.weight_status = a.device<DeviceStatus>(2);
  r.host_counts = a.pinned<int32_t>(E);
  r.host_status = a.pinned<DeviceStatus>(5);
  r.host_aux_loss = a.pinned<float>(1);

  if (comm) {
    const int64_t nc = H / 128;
    EpBuffers& p = ep;
    p.local_offsets = a.device<int32_t>(El + 1);
    p.host_local_offsets = a.pinned<int32_t>(El + 1);
    p.send_rows = a.device<uint8_t>(Tm * K * 2 * H);
    p.combined_rows = reinterpret_cast<bf16_t*>(p.send_rows);
    p.send_scales = a.device<uint8_t>(Tm * K * 4 * nc);
    p.send_probs = a.device<float>(Tm * K);
    p.combined_dprobs = p.send_probs;
    p.recv_scales = a.device<uint8_t>(R * 4 * nc);
    p.row_dprob = a.device<float>(R);
    if (dedup) {
      // send side: at most min(W, k) * Tm token rows (through send_rows / send_scales); receive
      // side: at most W * Tm tokens
      const int W = comm->world_size();
      const int64_t Wt = int64_t(W) * Tm;
      p.peer_ids = a.device<int32_t>(Tm * K);
      p.tokens_to_ranks = alloc_routing(a, Tm, int(K), W, 1, false, false);
      p.host_tokens_to_rank = a.pinned<int32_t>(W);
      p.send_ids = a.device<int32_t>(Tm * K * K);
      p.send_token_probs = a.device<float>(Tm * K * K);
      p.recv_tokens = a.device<uint8_t>(Wt * 2 * H);
      p.recv_token_scales = a.device<uint8_t>(Wt * (H / 32));  // FP8: H/128 bytes per row; MXFP4: H/32
      p.recv_token_scales_col = a.device<uint8_t>(Wt * nc);
      p.recv_ids = a.device<int32_t>(Wt * K);
      p.recv_probs = a.device<float>(Wt * K);
      p.recv_local_ids = a.device<int32_t>(Wt * K);
      p.received_tokens = alloc_routing(a, Wt, int(K), int(El), cfg.align, true, false);
    }
    if (device_plan) {
      const int64_t W = comm->world_size();
      p.count_matrix = a.device<int32_t>(W * E + W * W);
      p.token_matrix = p.count_matrix + W * E;
      p.host_matrices = a.pinned<int32_t>(W * E + W * W);
      p.dispatch_pieces = a.device<EpPiece>(W * El + El);
      p.combine_pieces = a.device<EpPiece>(W * El);
      p.dedup_pieces = a.device<EpPiece>(W);
    }
  }

  WeightBuffers& w = weights;
  w.wr = a.device<float>(E * H);
  w.router_bias = a.device<float>(E);
  w.wr_check = a.device<bf16_t>(E * H);
  w.w1_bf16 = a.device<bf16_t>(El * 2 * F * H);
  w.w2_bf16 = a.device<bf16_t>(El * H * F);
  if (fp8) {
    w.w1 = weight_128x128_f32(a.device<uint8_t>(El * 2 * F * H), nullptr, int(El), 2 * F, H);
    w.w1t = weight_128x128_f32(a.device<uint8_t>(El * 2 * F * H), nullptr, int(El), H, 2 * F);
    w.w2 = weight_128x128_f32(a.device<uint8_t>(El * H * F), nullptr, int(El), H, F);
    w.w2t = weight_128x128_f32(a.device<uint8_t>(El * H * F), nullptr, int(El), F, H);
    w.w1.scales = a.device<float>(gemm::weight_scale_f32_elems(int(El), 2 * F, H));
    w.w1t.scales = a.device<float>(gemm::weight_scale_f32_elems(int(El), H, 2 * F));
    w.w2.scales = a.device<float>(gemm::weight_scale_f32_elems(int(El), H, F));
    w.w2t.scales = a.device<float>(gemm::weight_scale_f32_elems(int(El), F, H));
    if (pow2) {
      w.w1_ue8m0 = a.device<uint8_t>(El * (2 * F / 128) * (H / 128));
      w.w1t_ue8m0 = a.device<uint8_t>(El * (2 * F / 128) * (H / 128));
      w.w2_ue8m0 = a.device<uint8_t>(El * (H / 128) * (F / 128));
      w.w2t_ue8m0 = a.device<uint8_t>(El * (H / 128) * (F / 128));
    }
  }

  ExpertBuffers& x = expert;
  x.y_rows = a.device<bf16_t>(R * H);
  x.x_perm_staging = x.dy_rows = x.dx_rows = x.y_rows;
  const bool flow = rc == Recipe::kFlow || rc == Recipe::kFlowFp4;
  x.h = flow && fused_swiglu ? nullptr : a.device<bf16_t>(R * 2 * F);
  x.a = flow && fused_dswiglu ? nullptr : a.device<bf16_t>(R * F);
  if (rc == Recipe::kBf16) {
    x.x_perm = a.device<bf16_t>(R * H);
    x.da = a.device<bf16_t>(R * F);
  } else {
    x.da = x.a;
  }
  if (rc == Recipe::kFlow || rc == Recipe::kFlowFp4)
    x.dh = x.h;  // h is saved in FP8 / MXFP4 there
  else
    x.dh = a.device<bf16_t>(R * 2 * F);
  if (fp8) {
    const QTensorView row = row_1x128(a.device<uint8_t>(R * maxC), a.device<uint8_t>((maxC / 128) * R), R, maxC);
    x.x_perm_fp8 = x.a_row = x.dy_row = x.dh_row = row;
    const QTensorView grad_col = col_128x1(a.device<uint8_t>(maxC * R), a.device<uint8_t>(MB * maxC), R, maxC, MB);
    x.dy_col = x.dh_col = grad_col;
    x.x_perm_col_flow = col_128x1(a.device<uint8_t>(maxC * R), a.device<uint8_t>(MB * maxC), R, maxC, MB);
    x.gemm_row_scales = a.device<float>(R * maxC / 128);
    x.grad_col_scales = a.device<float>(MB * maxC);
    x.input_col_scales = a.device<float>(MB * maxC);
    x.dy_row_f32 = x.dh_row_f32 = x.x_recv_f32 =
        row_1x128_f32(row.codes, x.gemm_row_scales, R, maxC);
    x.dy_col_f32 = x.dh_col_f32 = col_128x1_f32(grad_col.codes, x.grad_col_scales, R, maxC, MB);
    x.a_col_f32 = x.x_perm_col_f32 =
        col_128x1_f32(x.x_perm_col_flow.codes, x.input_col_scales, R, maxC, MB);
  }
  switch (rc) {
    case Recipe::kBf16: break;
    case Recipe::kBlockwise:
      x.x_perm_col = col_128x1(a.device<uint8_t>(H * R), a.device<uint8_t>(MB * H), R, H, MB);
      x.a_col = col_128x1(a.device<uint8_t>(F * R), a.device<uint8_t>(MB * F), R, F, MB);
      break;
    case Recipe::kFp8Naive:
      x.entry_f32 = row_1x128_f32(a.device<uint8_t>(Tm * H), a.device<float>(Tm * H / 128), Tm, H);
      x.entry_dequantized = a.device<bf16_t>(Tm * H);
      x.x_perm_f32 = row_1x128_f32(a.device<uint8_t>(R * H), a.device<float>(R * H / 128), R, H);
      x.a_f32 = row_1x128_f32(a.device<uint8_t>(R * F), a.device<float>(R * F / 128), R, F);
      x.naive_dequantized = a.device<bf16_t>(R * maxC);
      x.naive_transposed = a.device<bf16_t>(R * maxC);
      break;
    case Recipe::kFlow:
    case Recipe::kFlowFp4: {
      uint8_t* entry_codes = a.device<uint8_t>(Tm * H);
      x.entry_fp8 = row_1x128(entry_codes, a.device<uint8_t>((H / 128) * Tm), Tm, H);
      if (rc == Recipe::kFlow) {  // h saved row-wise FP8
        uint8_t* codes = a.device<uint8_t>(R * 2 * F);
        x.h_saved = row_1x128(codes, a.device<uint8_t>((2 * F / 128) * R), R, 2 * F);
      } else {  // flow-fp4: h saved as MXFP4 [R, 2F/2] + [R][2F/32]
        uint8_t* codes = a.device<uint8_t>(R * F);
        x.h_saved = mxfp4_1x32(codes, a.device<uint8_t>(R * (2 * F / 32)), R, 2 * F);
      }
      x.a_col = col_128x1(a.device<uint8_t>(F * R), a.device<uint8_t>(MB * F), R, F, MB);
      if (fused_dswiglu) {
        x.dh_row_fused = row_1x128(a.device<uint8_t>(R * 2 * F), a.device<uint8_t>((2 * F / 128) * R), R, 2 * F);
        uint8_t* h_bytes = reinterpret_cast<uint8_t*>(x.h);  // free in the backward: h is saved quantized
        if (h_bytes && 2 * F * R + MB * 2 * F <= int64_t(sizeof(bf16_t)) * R * 2 * F)
          x.dh_col_fused = col_128x1(h_bytes, h_bytes + 2 * F * R, R, 2 * F, MB);
        else
          x.dh_col_fused = col_128x1(a.device<uint8_t>(2 * F * R), a.device<uint8_t>(MB * 2 * F), R, 2 * F, MB);
      }
      if (rc == Recipe::kFlow) {
        uint8_t* codes = a.device<uint8_t>(R * H);
        x.x_perm_row = row_1x128(codes, a.device<uint8_t>((H / 128) * R), R, H);
      } else {
        uint8_t* codes = a.device<uint8_t>(Tm * H / 2);
        x.entry_mxfp4 = mxfp4_1x32(codes, a.device<uint8_t>(Tm * H / 32), Tm, H);
        uint8_t* xcodes = a.device<uint8_t>(R * H / 2);
        x.x_perm_mxfp4 = mxfp4_1x32(xcodes, a.device<uint8_t>(R * H / 32), R, H);
        // [H/128][R] scale bytes fit dy_col's [MB][maxC] (MB >= R/128, maxC >= H)
        x.x_perm_fp8_fused = row_1x128(x.dy_col.codes, x.dy_col.ue8m0(), R, H);
      }
      break;
    }
  }
}

}  // namespace moe
}  // namespace cuda
}  // namespace flowmoe
