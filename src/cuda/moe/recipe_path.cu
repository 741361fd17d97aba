// The CUDA layer's recipe path (recipe_path.h): the one function that turns a recipe's table row
// and the layer options into the decisions of src/cuda/moe.
#include "cuda/moe/recipe_path.h"

#include <algorithm>

#include "cuda/moe/pipelines/pipeline.h"
#include "cuda/moe/workspace.h"
#include "flowmoe/error.h"

namespace flowmoe {
namespace cuda {
namespace moe {

namespace {

bool quantized_row(TensorFormat f) { return f == TensorFormat::kFp8Row || f == TensorFormat::kMxfp4Row; }

}  // namespace

RecipePath make_recipe_path(const MoeConfig& cfg, const CudaLayerOptions& options) {
  const RecipeSpec& s = recipe_spec(cfg.recipe);
  RecipePath p;
  p.row = &s;

  p.dataflow = s.dataflow;  // (recipe.h; tests/cpu/test_recipe.cpp checks it against the formats)
  const DataflowRow& d = dataflow_row(p.dataflow);  // (pipelines/pipeline.cu)
  const bool quantized = d.quantized_rows;

  p.fp8 = s.uses_fp8();
  p.pow2_weights = s.weights == WeightCopy::kFp8Block;
  p.x_mxfp4 = s.entry == TensorFormat::kMxfp4Row;
  p.x_perm_saved = s.gemm1_input.format;
  p.h_saved = s.gemm1_output.format;
  p.a_saved = s.gemm2_input.format;
  // The 128-row segment blocks are read by the column copies (quantize_col, the transposes,
  // DQ->T->Q) and the FP8 wgrads over them; BF16 GEMMs read the rows only.
  p.segment_blocks = false;
  for (const ColumnSpec& c : s.columns) p.segment_blocks = p.segment_blocks || c.method != ColumnMethod::kNone;

  // The recipe row and its dataflow's row agree (quantized rows: the entry and h quantized row-wise,
  // x_perm saved in its entry format; the others: h in BF16, no MXFP4).
  const ColumnMethod x_perm_column = p.x_mxfp4 ? d.x_perm_column_mxfp4 : d.x_perm_column;
  const bool agrees = s.column(WgradOperand::kGemm1Input).method == x_perm_column &&
                      (quantized ? quantized_row(s.entry) && quantized_row(p.h_saved) && p.x_perm_saved == s.entry
                                 : p.h_saved == TensorFormat::kBf16 && !p.x_mxfp4);
  FLOWMOE_CHECK(agrees, "make_cuda_layer: internal error: recipe " << s.name << "'s table row (recipe.h) asks for "
                            "a combination of formats the CUDA layer's pipelines do not run");

  // The layer options. kAuto's rule for the grouped kernels was measured for the FP8 kernels:
  // bf16 keeps cuBLASLt (CudaLayerOptions::fprop_dgrad).
  using FD = CudaLayerOptions::FpropDgrad;
  p.sync_free = options.sync_free;
  p.grouped_gemm = options.sync_free || options.fprop_dgrad == FD::kGrouped ||
                   (options.fprop_dgrad == FD::kAuto && p.fp8 &&
                    workspace_rows(cfg) <= CudaLayerOptions::kGroupedAutoRows * cfg.num_local_experts());
  p.bf16_wgrad_kernel = s.weights == WeightCopy::kBf16Only && p.grouped_gemm && cfg.align == 128;
  p.fp8_wgrad_kernel = p.pow2_weights && cfg.align == 128 &&
                       options.gemm.wgrad_kernel != gemm::GroupedGemmOptions::WgradKernel::kOff;
  // The fused epilogues write a' row-wise FP8 and h in its saved quantized format (flow's SwiGLU +
  // quantize and dSwiGLU + quantize): a quantized-rows pipeline, with the grouped kernel running the GEMM.
  // (either activation, with or without GEMM1's bias: the epilogues add it and clamp as the
  // SwiGLU kernels do)
  p.fused_swiglu = options.fused_swiglu && p.grouped_gemm && quantized;
  p.fused_dswiglu = options.fused_dswiglu && p.grouped_gemm && quantized;
  // Only a quantized-rows pipeline (flow) makes its wgrad column copies as operators of their own
  // (the scaling-aware transposes, FP4RowToFP8Col), which can run next to the GEMMs; the others
  // make them inline.
  p.side_stream = options.side_stream && quantized;
  // Its column copies are its own buffers (dy_col / dh_col, x_perm's), dead once GEMM1's wgrad has
  // read them; with expert parallelism the dX rows travel while the wgrad runs.
  p.dx_rows_in_column_copies = options.dx_rows_in_column_copies && quantized && cfg.comm == nullptr;
  // The deduplicated exchange moves BF16, FP8 (UE8M0 1x128) and MXFP4 token rows; fp8-naive's
  // FP32-scale rows take its own exchange (move_naive: every (token, expert) row, as DeepSeek-V3's).
  p.ep_dedup = cfg.comm != nullptr && options.ep_dedup && s.forward_wire != WireFormat::kFp8Fp32Scale;
  // Caller memory: the weights region lives from a weight refresh to the last backward that reads
  // it (the PyTorch op keeps one per forward in flight), so the FP8 recipes' dgrad weights W^T are
  // derived from W in each backward, in its scratch, instead of being kept there: 1 byte less per
  // expert parameter and forward in flight, for one FP8 transpose of the weights per backward.
  p.transposes_in_backward = options.caller_memory && p.fp8;
  // The same lifetime argument for bf16's BF16 copies: with BF16 parameters in the layer's layout
  // the GEMMs read the parameters themselves, which the caller keeps until the backward
  p.bf16_params_in_place = options.caller_memory && options.bf16_params_in_place && s.weights == WeightCopy::kBf16Only;
  p.bf16_relay_per_pass = p.bf16_params_in_place && options.bf16_params_stored;
  p.bf16_stored_gemms = p.bf16_relay_per_pass && p.grouped_gemm;
  // no room for the relay where every pass is known to read them in place: the kernels read the
  // storage, and the wgrad writes dW1 there (writes_stored_grads), so no backward relays either
  p.bf16_relay_planned = p.bf16_relay_per_pass &&
                         !(p.bf16_stored_gemms && p.bf16_wgrad_kernel && cfg.comm == nullptr &&
                           bf16_kernels_read_stored(options.bf16_storage, cfg.ffn));
  // ... a group of experts at a time, so that W^T of every expert never exists at once: where the
  // grouped kernel runs the dgrad over a range of the experts (UE8M0 row scales: no expert-packed
  // scales to re-base) and not through the fused dSwiGLU (it reads all of W2^T). Even groups.
  const int el = cfg.num_local_experts();
  const auto chunk = [&](int64_t expert_bytes) {
    if (!p.transposes_in_backward || !p.grouped_gemm || !p.pow2_weights || options.dgrad_weight_chunk_bytes <= 0)
      return el;
    const int64_t most = std::clamp<int64_t>(options.dgrad_weight_chunk_bytes / expert_bytes, 1, el);
    const int64_t groups = (el + most - 1) / most;
    return int((el + groups - 1) / groups);
  };
  p.wt_chunk1 = chunk(2 * cfg.ffn * cfg.hidden);
  p.wt_chunk2 = p.fused_dswiglu ? el : chunk(cfg.hidden * cfg.ffn);
  return p;
}

}  // namespace moe
}  // namespace cuda
}  // namespace flowmoe
