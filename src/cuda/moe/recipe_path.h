// The CUDA layer's recipe as data: every per-recipe decision of src/cuda/moe, made once at
// construction (make_recipe_path) from the recipe's row of the table (flowmoe/recipe.h RecipeSpec)
// and the layer options that depend on the recipe (CudaLayerOptions). The layer's rooms read these
// fields and never compare the Recipe enum; a new recipe is a table row whose fields select one of
// the dataflows (recipe.h Dataflow; each one pipeline, src/cuda/moe/pipelines/), or a new
// dataflow with its pipeline.
#pragma once

#include <cstdint>

#include "flowmoe/moe.h"
#include "flowmoe/recipe.h"

namespace flowmoe {
namespace cuda {
namespace moe {

struct RecipePath {
  const RecipeSpec* row = nullptr;  // the recipe's table row: report names, saved tensors
  Dataflow dataflow = Dataflow::kBf16Gemms;  // the row's: which pipeline runs (pipelines/pipeline.h)

  // ---- formats (the table row's fields) ------------------------------------------------------------
  bool fp8 = false;           // FP8 weight copies and GEMMs (RecipeSpec::uses_fp8: all but bf16)
  bool pow2_weights = false;  // weights as 128x128 blocks with UE8M0 scales, converted to the GEMM's
                              // FP32 layout (WeightCopy::kFp8Block; not fp8-naive's FP32 scales)
  bool x_mxfp4 = false;       // x quantized at the entry, moved and saved as MXFP4 1x32 (entry ==
                              // kMxfp4Row: the one place that decides an MXFP4 x); GEMM1 reads it
                              // through FP4RowToFP8Row, its wgrad through FP4RowToFP8Col
  TensorFormat x_perm_saved = TensorFormat::kBf16;  // GEMM1's input as saved (gemm1_input)
  TensorFormat h_saved = TensorFormat::kBf16;       // GEMM1's output h as saved (gemm1_output)
  TensorFormat a_saved = TensorFormat::kBf16;       // GEMM2's input a' as saved (gemm2_input)
  bool segment_blocks = false;  // routing builds the segments' 128-row blocks (a column copy reads them)

  // ---- the layer options that apply to this recipe ------------------------------------------------
  bool sync_free = false;      // CudaLayerOptions::sync_free: no host synchronisation; Mp is the row
                               // capacity and the kernels read the rows in use on the device
  bool grouped_gemm = true;    // fprop / dgrad (bf16: and wgrad) by flowmoe's grouped kernels
  bool bf16_wgrad_kernel = false;  // bf16: its wgrads by the grouped BF16 kernel (grouped_gemm, align 128:
                                   // the kernel's 128-token blocks), the one that writes stored dW
  bool fp8_wgrad_kernel = false;   // the UE8M0 recipes: flowmoe's FP8 wgrad kernel may run (align 128, not
                                   // turned off in CudaLayerOptions::gemm), the one that writes stored dW
  bool fused_swiglu = false;   // GEMM1 + SwiGLU*prob + quantize in one kernel (W1 interleaved)
  bool fused_dswiglu = false;  // GEMM2 dgrad + dSwiGLU*prob + quantize in one kernel
  bool side_stream = false;    // the wgrad column copies on the side stream
  bool dx_rows_in_column_copies = false;  // flow, one GPU: GEMM1 wgrad before its dgrad, whose dX rows
                                          // (and GEMM2's output rows) share the column copies' storage
  bool ep_dedup = false;       // the deduplicated EP dispatch
  bool transposes_in_backward = false;  // FP8 dgrad weights W^T made in each backward (transient)
                                        // rather than written by set_weights (caller memory)
  bool bf16_params_in_place = false;  // bf16: the GEMMs read the caller's BF16 parameters, no BF16
                                      // copies (CudaLayerOptions::bf16_params_in_place) ...
  bool bf16_relay_per_pass = false;   // ... or, stored as a model keeps them, each pass's relaid
                                      // copies in its transient region (bf16_params_stored) ...
  bool bf16_stored_gemms = false;     // ... which the grouped kernels read where they are stored instead
                                      // (gemm.h StoredW), where the storage allows (StepContext::
                                      // stored_gemms): no relay
  bool bf16_relay_planned = false;    // the transient region has room for the relay: relay_per_pass
                                      // unless CudaLayerOptions::bf16_storage is known to be read in place
  // With transposes_in_backward: the experts of W1^T / W2^T made at once, each group just before
  // its dgrad (CudaLayerOptions::dgrad_weight_chunk_bytes); all local experts otherwise
  int wt_chunk1 = 0, wt_chunk2 = 0;

  const RecipeSpec& spec() const { return *row; }
  bool h_mxfp4() const { return h_saved == TensorFormat::kMxfp4Row; }  // flow-fp4's h
};

// Whether flowmoe's grouped BF16 kernels read W1, W2 stored as `st` in place (gemm.h StoredW: each
// expert's W1^T [Hs][2Fs], W2^T [Fs][Hs] through TMA maps, rows of 16-byte multiples; gate / up
// interleaved, or concatenated without padding between them: Fs == the layer's F); the bases'
// alignment is the call's (StepContext::stored_gemms).
inline bool bf16_kernels_read_stored(const ExpertStorage& st, int64_t layer_ffn) {
  return !st.is_layer_layout() && (st.interleaved || st.ffn == layer_ffn) && st.hidden % 8 == 0 && st.ffn % 4 == 0;
}

// The path of cfg.recipe on a layer with these options (cfg.comm, cfg's row capacity and local
// experts enter the GEMM and EP choices). Throws flowmoe::Error if the table row asks for a
// combination its dataflow's pipeline does not run (an internal error: the table and this layer
// disagree).
RecipePath make_recipe_path(const MoeConfig& cfg, const CudaLayerOptions& options);

}  // namespace moe
}  // namespace cuda
}  // namespace flowmoe
