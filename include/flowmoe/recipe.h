// The MoE layer's recipes as data (SPEC §6; docs/MOE.md): one table, one row per recipe, saying
// in which format x enters and travels, which weight copies the layer keeps, which tensors are
// saved for the backward and in which format, how each wgrad column-wise operand is made, and the
// names every backend writes into the cast report. The CPU layer (src/cpu/moe/), the CUDA layer
// (src/cuda/moe/, its report names) and the CLI read this table; a recipe is a row here plus the
// operators its paths run.
//
// The cast report counts what a backend executes (moe.h CastOp): the table gives the operators'
// names, never their counts. Every report string exists once, below (named constants, or fields
// of the table built from them), and the backends write exactly these bytes.
#pragma once

#include <cstdint>
#include <string>
#include <vector>

#include "flowmoe/comm.h"  // WireFormat

namespace flowmoe {

// ---- recipes (SPEC §6) ----------------------------------------------------------------------
enum class Recipe : uint8_t {
  kBf16,       // "bf16":      BF16 operands, FP32 accumulation. The reference.
  kBlockwise,  // "blockwise": BF16 dataflow; each grouped linear quantizes its BF16 input (row and
               //              column copies from BF16, power-of-two scales), FP8 GEMM, BF16 out.
  kFp8Naive,   // "fp8-naive": DeepSeek-V3-style operator substitution with FP32 scales (amax/448):
               //              quantize before / dequantize after each FP8 op, column copies by
               //              dequantize -> transpose -> quantize (double quantization).
  kFlow,       // "flow":      FP8-Flow-MoE: x and dy quantized once at the entry, FP8 permute,
               //              fused SwiGLU+quant and dSwiGLU+quant, column copies by the
               //              scaling-aware transpose, activations saved in FP8.
  kFlowFp4,    // "flow-fp4":  flow with an MXFP4 entry: FP4 permute, FP4 saved GEMM1 input,
               //              FP4RowToFP8Row for GEMM1, FP4RowToFP8Col for its wgrad; backward FP8.
};
const char* recipe_name(Recipe r);  // "bf16", "blockwise", "fp8-naive", "flow", "flow-fp4"
// Parses a name above (case-sensitive); throws flowmoe::Error listing the valid names otherwise.
Recipe parse_recipe(const std::string& name);
bool try_parse_recipe(const std::string& name, Recipe* out);  // false for an unknown name
const std::vector<Recipe>& all_recipes();                     // in the order of the enum
bool recipe_uses_fp8(Recipe r);                               // every recipe but bf16
// The names of all recipes in table order joined by `separator`, e.g. "bf16,blockwise,..." or
// "bf16|blockwise|..." (defaults, usage texts and error messages list them from the table).
std::string recipe_names(const char* separator);

// ---- what the cast report counts (moe.h CastReport) -------------------------------------------
enum class CastKind : uint8_t {
  kQuantize,    // standalone kernel: BF16/FP32 -> FP8 or MXFP4 (one launch, any number of layouts)
  kDequantize,  // standalone kernel: FP8 or MXFP4 -> BF16/FP32
  kFused,       // a quantization fused into another operator (SwiGLU+quant, dSwiGLU+quant)
  kConvert,     // exact conversion inside the quantized domain, no value rounded except counted
                // underflow (scaling-aware transpose, FP4RowToFP8Row, FP4RowToFP8Col)
};
const char* cast_kind_name(CastKind k);  // "quantize", "dequantize", "fused", "convert"

enum class MoePass : uint8_t { kForward, kBackward, kWeightUpdate };
const char* moe_pass_name(MoePass p);  // "forward", "backward", "weights"

// ---- formats of the layer's tensors ---------------------------------------------------------------
enum class TensorFormat : uint8_t {
  kBf16,             // BF16 values
  kFp8Row,           // FP8 E4M3 row-wise 1x128 tiles, UE8M0 (power-of-two) scales
  kFp8Col,           // FP8 E4M3 column-wise 128x1 blocks over the expert segments, UE8M0 scales
  kFp8RowFp32Scale,  // FP8 E4M3 row-wise 1x128 tiles, FP32 scales amax / 448 (fp8-naive)
  kMxfp4Row,         // MXFP4 E2M1 row-wise 1x32 blocks, UE8M0 scales
};
// "bf16", "fp8 row 1x128", "fp8 col 128x1", "fp8 row 1x128 fp32-scale", "mxfp4 row 1x32"
const char* tensor_format_name(TensorFormat f);
// The format and a shape as the report writes them: "fp8 row 1x128 [Mp, H]".
std::string tensor_format_string(TensorFormat f, const char* shape);
// Bytes per row of `cols` values, codes + scales (a column-wise tensor counted per token row as
// if its segments were whole 128-token blocks): bf16 2c, fp8 c + c/128, fp8 fp32-scale c + 4c/128,
// mxfp4 c/2 + c/32.
double tensor_format_row_bytes(TensorFormat f, int64_t cols);

// The column width of a saved or wgrad tensor, in the layer's sizes.
enum class LayerWidth : uint8_t { kH, k2F, kF };
const char* layer_width_name(LayerWidth w);  // "H", "2F", "F"

// ---- the wgrad column-wise operands ---------------------------------------------------------------
// The four operands the FP8 wgrad GEMMs read column-wise (128x1 over the expert segments).
enum class WgradOperand : uint8_t {
  kGemm1Input,  // x_perm: dW1 = dhᵀ · x_perm
  kGemm2Input,  // a':     dW2 = dYᵀ · a'
  kGemm2Grad,   // dY
  kGemm1Grad,   // dh
};
constexpr int kNumWgradOperands = 4;
// "GEMM1 input x_perm", "GEMM2 input a'", "GEMM2 grad dY", "GEMM1 grad dh" (ColumnCheck::name)
const char* wgrad_operand_name(WgradOperand o);
const char* wgrad_operand_short_name(WgradOperand o);  // "x_perm", "a'", "dY", "dh"

// How a column-wise copy is made from what the recipe holds.
enum class ColumnMethod : uint8_t {
  kNone,                   // no column copy: the BF16 wgrad reads the BF16 rows (bf16)
  kQuantizeFromBf16,       // quantize_col of the BF16 tensor (blockwise; flow's dh, fused)
  kScalingAwareTranspose,  // exact FP8 row -> col re-encoding (SPEC §4; flow)
  kDequantTransposeQuant,  // dequantize to BF16, transpose, quantize with FP32 scales (fp8-naive)
  kFp4RowToFp8Col,         // MXFP4 rows -> FP8 columns in one exact pass (flow-fp4's x_perm)
};
// What a ColumnCheck calls the method: "quantize col from BF16", "scaling-aware transpose",
// "DQ->T->Q (FP32 scales)", "FP4RowToFP8Col vs FP4RowToFP8Row" (none: "").
const char* column_method_name(ColumnMethod m);

// ---- report names (every string the backends write into the cast report) ------------------------
namespace report_names {
// weight update
constexpr char kQuantizeW1[] = "quantize W1 (128x128 + exact transpose)";
constexpr char kQuantizeW2[] = "quantize W2 (128x128 + exact transpose)";
constexpr char kQuantizeW1Fp32Scale[] = "quantize W1 (128x128 FP32 scales + exact transpose)";
constexpr char kQuantizeW2Fp32Scale[] = "quantize W2 (128x128 FP32 scales + exact transpose)";
// entry quantizations (flow, flow-fp4: once at the layer's entry; fp8-naive: before dispatch)
constexpr char kQuantizeXEntryFp8[] = "quantize x (row 1x128, entry)";
constexpr char kQuantizeXEntryMxfp4[] = "quantize x (MXFP4 1x32, entry)";
constexpr char kQuantizeDyEntryFp8[] = "quantize dy (row 1x128, entry)";
constexpr char kQuantizeXBeforeDispatch[] = "quantize x (row, FP32 scales, before dispatch)";
constexpr char kQuantizeDyBeforeDispatch[] = "quantize dy (row, FP32 scales, before dispatch)";
constexpr char kDequantizeXAfterDispatch[] = "dequantize x (after dispatch)";
constexpr char kDequantizeDyAfterDispatch[] = "dequantize dy (after dispatch)";
// blockwise: each grouped linear quantizes its BF16 input, row and column copies
constexpr char kQuantizeXpermBoth[] = "quantize x_perm (row + col, from BF16)";
constexpr char kQuantizeABoth[] = "quantize a' (row + col, from BF16)";
constexpr char kQuantizeDYBoth[] = "quantize dY (row + col, from BF16)";
constexpr char kQuantizeDhBoth[] = "quantize dh (row + col, from BF16)";
// fp8-naive: each FP8 GEMM quantizes its BF16 input row-wise with FP32 scales
constexpr char kQuantizeXpermFp32Scale[] = "quantize x_perm (row, FP32 scales)";
constexpr char kQuantizeAFp32Scale[] = "quantize a' (row, FP32 scales)";
constexpr char kQuantizeDYFp32Scale[] = "quantize dY (row, FP32 scales)";
constexpr char kQuantizeDhFp32Scale[] = "quantize dh (row, FP32 scales)";
// flow, flow-fp4: exact conversions and fused quantizations
constexpr char kFp4RowToFp8RowXperm[] = "FP4RowToFP8Row x_perm (GEMM1 input)";
constexpr char kFp4RowToFp8ColXperm[] = "FP4RowToFP8Col x_perm (wgrad copy)";
constexpr char kTransposeXperm[] = "scaling-aware transpose x_perm (wgrad copy)";
constexpr char kTransposeA[] = "scaling-aware transpose a' (wgrad copy)";
constexpr char kTransposeDY[] = "scaling-aware transpose dY (wgrad copy)";
// the CPU layer counts a''s column copy inside the fused SwiGLU (three outputs); the CUDA layer
// runs it as a separate transpose (kTransposeA) after a two-output SwiGLU
constexpr char kSwigluQuantRowColHRow[] = "SwiGLU*prob + quantize (a' row + col, h row)";
constexpr char kSwigluQuantRowColHMxfp4[] = "SwiGLU*prob + quantize (a' row + col, h MXFP4)";
constexpr char kSwigluQuantRowHRow[] = "SwiGLU*prob + quantize (a' row, h row)";
constexpr char kSwigluQuantRowHMxfp4[] = "SwiGLU*prob + quantize (a' row, h MXFP4)";
// the same two as GEMM1's fused epilogue (CudaLayerOptions::fused_swiglu): one operator, inside GEMM1
constexpr char kGemm1SwigluQuantRowHRow[] = "GEMM1 epilogue: SwiGLU*prob + quantize (a' row, h row)";
constexpr char kGemm1SwigluQuantRowHMxfp4[] = "GEMM1 epilogue: SwiGLU*prob + quantize (a' row, h MXFP4)";
constexpr char kDswigluQuantRowCol[] = "dSwiGLU*prob + quantize (dh row + col)";
// the same as GEMM2-dgrad's fused epilogue (CudaLayerOptions::fused_dswiglu): one operator, inside the GEMM
constexpr char kGemm2DgradDswigluQuantRowCol[] = "GEMM2-dgrad epilogue: dSwiGLU*prob + quantize (dh row + col)";
// saved tensors (SavedTensor::name) other than the recipe's three expert activations
constexpr char kSavedRouterInput[] = "router input x";
constexpr char kSavedRouterLogits[] = "router logits";
constexpr char kSavedRouting[] = "expert ids + probs + row map";
constexpr char kSavedRouterInputFormat[] = "bf16 [T, H]";
constexpr char kSavedRouterLogitsFormat[] = "fp32 [T, E]";
constexpr char kSavedRoutingFormat[] = "int32/fp32/int32 [T, k]";
// wire transfers (WireTransfer::name, and the combine formats)
constexpr char kDispatchX[] = "dispatch x";
constexpr char kDispatchDy[] = "dispatch dy";
constexpr char kCombineOutput[] = "combine expert output rows";
constexpr char kCombineDx[] = "combine dX rows + dprob";
constexpr char kCombineOutputFormat[] = "bf16";
constexpr char kCombineDxFormat[] = "bf16 + fp32 dprob";
}  // namespace report_names

// The two operators of a DQ->T->Q column copy of `o` (fp8-naive), as the report names them:
// "dequantize dY (for its column copy)" and "quantize dY col (transposed, FP32 scales)".
const char* dq_t_q_dequantize_name(WgradOperand o);
const char* dq_t_q_quantize_name(WgradOperand o);

// ---- the table -------------------------------------------------------------------------------------
// The dataflow a recipe's layer step runs: one forward / backward pair each in every backend (the
// CPU layer's forward_* / backward_*, src/cpu/moe/; the CUDA layer's pipelines,
// src/cuda/moe/pipelines/). The backends switch on this, never on the Recipe enum: a recipe that
// reuses a dataflow with other formats is a table row alone; a new dataflow is a value here, its
// row(s), and the pair in each backend.
enum class Dataflow : uint8_t {
  kBf16Gemms,  // BF16 GEMMs (bf16)
  kBlockwise,  // BF16 between the GEMMs, each grouped linear quantizes its BF16 input (row + col
               // copies, UE8M0 scales; blockwise)
  kFp8Naive,   // operator substitution with FP32 scales, column copies DQ -> T -> Q (fp8-naive)
  kFlow,       // quantized once at the entry, FP8 / MXFP4 between the GEMMs, fused (d)SwiGLU +
               // quantize, exact column copies (flow, flow-fp4)
};
const char* dataflow_name(Dataflow d);  // "bf16-gemms", "blockwise", "fp8-naive", "flow"

// The weight copies made by set_weights (from the BF16 copies of the FP32 masters).
enum class WeightCopy : uint8_t {
  kBf16Only,          // BF16 copies only
  kFp8Block,          // + 128x128-block FP8 with UE8M0 scales and their exact transposes
  kFp8BlockFp32Scale, // + 128x128-block FP8 with FP32 scales and their exact transposes
};

// One of the three expert activations saved from forward to backward.
struct SavedSpec {
  const char* name;     // SavedTensor::name, e.g. "GEMM1 input x_perm"
  TensorFormat format;  // as saved
  LayerWidth width;     // columns; the rows are the Mp padded rows
  std::string format_string() const;  // e.g. "fp8 row 1x128 [Mp, H]"
  double row_bytes(int64_t h, int64_t f) const;  // bytes of one saved row for hidden H, ffn F
};

// How one wgrad column operand is made, and the report name of the operator that makes it
// (null when no separate operator does: quantized together with the row copy, fused, or none).
struct ColumnSpec {
  ColumnMethod method;
  const char* op;
};

struct RecipeSpec {
  Recipe recipe;
  const char* name;               // recipe_name
  Dataflow dataflow;              // the forward / backward pair the backends run for it
  TensorFormat entry;             // x as the forward dispatch / permute moves it
  TensorFormat backward_entry;    // dy as the backward dispatch / permute moves it
  WireFormat forward_wire;        // wire format of the forward dispatch (expert parallelism)
  WireFormat backward_wire;       // wire format of the backward dispatch of dy
  const char* quantize_x_entry;   // the entry quantization of x (null: x moves in BF16)
  const char* quantize_dy_entry;  // the entry quantization of dy (null: dy moves in BF16)
  const char* dequantize_x_after_dispatch;   // fp8-naive: back to BF16 after the move, else null
  const char* dequantize_dy_after_dispatch;  // fp8-naive: back to BF16 after the move, else null
  WeightCopy weights;
  const char* quantize_w1;        // the weight-update operators (null: BF16 copies only)
  const char* quantize_w2;
  SavedSpec gemm1_input;          // x_perm (or its wgrad copy)
  SavedSpec gemm1_output;         // h
  SavedSpec gemm2_input;          // a' (or its wgrad copy)
  ColumnSpec columns[kNumWgradOperands];  // indexed by WgradOperand

  const ColumnSpec& column(WgradOperand o) const { return columns[static_cast<int>(o)]; }
  bool uses_fp8() const { return recipe != Recipe::kBf16; }
};

// The row of a recipe; throws flowmoe::Error for a value outside the enum.
const RecipeSpec& recipe_spec(Recipe r);
// Every row, in the order of the enum (all_recipes()).
const std::vector<RecipeSpec>& recipe_table();

}  // namespace flowmoe
