// The recipe table (include/flowmoe/recipe.h): one row per recipe, and the names and sizes of the
// formats, widths and column methods the rows refer to.
#include "flowmoe/recipe.h"

#include "flowmoe/error.h"

namespace flowmoe {

namespace rn = report_names;

// ---- the table ------------------------------------------------------------------------------------
namespace {

using TF = TensorFormat;
using CM = ColumnMethod;
using LW = LayerWidth;

// Columns in WgradOperand order: GEMM1 input x_perm, GEMM2 input a', GEMM2 grad dY, GEMM1 grad dh.
const std::vector<RecipeSpec>& table() {
  static const std::vector<RecipeSpec> rows = {
      {Recipe::kBf16, "bf16", Dataflow::kBf16Gemms,
       TF::kBf16, TF::kBf16, WireFormat::kBf16, WireFormat::kBf16,
       nullptr, nullptr, nullptr, nullptr,
       WeightCopy::kBf16Only, nullptr, nullptr,
       {"GEMM1 input x_perm", TF::kBf16, LW::kH},
       {"GEMM1 output h", TF::kBf16, LW::k2F},
       {"GEMM2 input a'", TF::kBf16, LW::kF},
       {{CM::kNone, nullptr}, {CM::kNone, nullptr}, {CM::kNone, nullptr}, {CM::kNone, nullptr}}},

      {Recipe::kBlockwise, "blockwise", Dataflow::kBlockwise,
       TF::kBf16, TF::kBf16, WireFormat::kBf16, WireFormat::kBf16,
       nullptr, nullptr, nullptr, nullptr,
       WeightCopy::kFp8Block, rn::kQuantizeW1, rn::kQuantizeW2,
       {"GEMM1 input x_perm (wgrad copy)", TF::kFp8Col, LW::kH},
       {"GEMM1 output h", TF::kBf16, LW::k2F},
       {"GEMM2 input a' (wgrad copy)", TF::kFp8Col, LW::kF},
       {{CM::kQuantizeFromBf16, nullptr},  // with the row copy: kQuantizeXpermBoth
        {CM::kQuantizeFromBf16, nullptr},  // kQuantizeABoth
        {CM::kQuantizeFromBf16, nullptr},  // kQuantizeDYBoth
        {CM::kQuantizeFromBf16, nullptr}}},  // kQuantizeDhBoth

      {Recipe::kFp8Naive, "fp8-naive", Dataflow::kFp8Naive,
       TF::kFp8RowFp32Scale, TF::kFp8RowFp32Scale, WireFormat::kFp8Fp32Scale,
       WireFormat::kFp8Fp32Scale,
       rn::kQuantizeXBeforeDispatch, rn::kQuantizeDyBeforeDispatch,
       rn::kDequantizeXAfterDispatch, rn::kDequantizeDyAfterDispatch,
       WeightCopy::kFp8BlockFp32Scale, rn::kQuantizeW1Fp32Scale, rn::kQuantizeW2Fp32Scale,
       {"GEMM1 input x_perm", TF::kFp8RowFp32Scale, LW::kH},
       {"GEMM1 output h", TF::kBf16, LW::k2F},
       {"GEMM2 input a'", TF::kFp8RowFp32Scale, LW::kF},
       // two operators each: dq_t_q_dequantize_name(o), dq_t_q_quantize_name(o)
       {{CM::kDequantTransposeQuant, nullptr},
        {CM::kDequantTransposeQuant, nullptr},
        {CM::kDequantTransposeQuant, nullptr},
        {CM::kDequantTransposeQuant, nullptr}}},

      {Recipe::kFlow, "flow", Dataflow::kFlow,
       TF::kFp8Row, TF::kFp8Row, WireFormat::kFp8, WireFormat::kFp8,
       rn::kQuantizeXEntryFp8, rn::kQuantizeDyEntryFp8, nullptr, nullptr,
       WeightCopy::kFp8Block, rn::kQuantizeW1, rn::kQuantizeW2,
       {"GEMM1 input x_perm", TF::kFp8Row, LW::kH},
       {"GEMM1 output h", TF::kFp8Row, LW::k2F},
       {"GEMM2 input a' (wgrad copy)", TF::kFp8Col, LW::kF},
       {{CM::kScalingAwareTranspose, rn::kTransposeXperm},
        {CM::kScalingAwareTranspose, rn::kTransposeA},  // CPU: inside the fused SwiGLU
        {CM::kScalingAwareTranspose, rn::kTransposeDY},
        {CM::kQuantizeFromBf16, nullptr}}},  // fused: kDswigluQuantRowCol

      {Recipe::kFlowFp4, "flow-fp4", Dataflow::kFlow,
       TF::kMxfp4Row, TF::kFp8Row, WireFormat::kMxfp4, WireFormat::kFp8,
       rn::kQuantizeXEntryMxfp4, rn::kQuantizeDyEntryFp8, nullptr, nullptr,
       WeightCopy::kFp8Block, rn::kQuantizeW1, rn::kQuantizeW2,
       {"GEMM1 input x_perm", TF::kMxfp4Row, LW::kH},
       {"GEMM1 output h", TF::kMxfp4Row, LW::k2F},
       {"GEMM2 input a' (wgrad copy)", TF::kFp8Col, LW::kF},
       {{CM::kFp4RowToFp8Col, rn::kFp4RowToFp8ColXperm},
        {CM::kScalingAwareTranspose, rn::kTransposeA},  // CPU: inside the fused SwiGLU
        {CM::kScalingAwareTranspose, rn::kTransposeDY},
        {CM::kQuantizeFromBf16, nullptr}}},  // fused: kDswigluQuantRowCol
  };
  return rows;
}

}  // namespace

const std::vector<RecipeSpec>& recipe_table() { return table(); }

const RecipeSpec& recipe_spec(Recipe r) {
  const std::vector<RecipeSpec>& t = table();
  const size_t i = static_cast<size_t>(r);
  FLOWMOE_CHECK(i < t.size() && t[i].recipe == r,
                "recipe_spec: recipe " << static_cast<int>(r) << " unknown; expected one of: "
                                       << recipe_names(", "));
  return t[i];
}

// ---- recipes ------------------------------------------------------------------------------------
const char* recipe_name(Recipe r) {
  const std::vector<RecipeSpec>& t = table();
  const size_t i = static_cast<size_t>(r);
  return i < t.size() ? t[i].name : "?";
}

const std::vector<Recipe>& all_recipes() {
  static const std::vector<Recipe> all = [] {
    std::vector<Recipe> v;
    for (const RecipeSpec& s : table()) v.push_back(s.recipe);
    return v;
  }();
  return all;
}

std::string recipe_names(const char* separator) {
  std::string s;
  for (const RecipeSpec& r : table()) s += std::string(s.empty() ? "" : separator) + r.name;
  return s;
}

bool try_parse_recipe(const std::string& name, Recipe* out) {
  for (const RecipeSpec& r : table())
    if (name == r.name) {
      if (out) *out = r.recipe;
      return true;
    }
  return false;
}

Recipe parse_recipe(const std::string& name) {
  Recipe r = Recipe::kBf16;
  FLOWMOE_CHECK(try_parse_recipe(name, &r),
                "unknown MoE recipe '" << name << "'; expected one of: " << recipe_names(", "));
  return r;
}

bool recipe_uses_fp8(Recipe r) { return recipe_spec(r).uses_fp8(); }

// ---- report vocabulary ----------------------------------------------------------------------------
const char* cast_kind_name(CastKind k) {
  switch (k) {
    case CastKind::kQuantize: return "quantize";
    case CastKind::kDequantize: return "dequantize";
    case CastKind::kFused: return "fused";
    case CastKind::kConvert: return "convert";
  }
  return "?";
}

const char* moe_pass_name(MoePass p) {
  switch (p) {
    case MoePass::kForward: return "forward";
    case MoePass::kBackward: return "backward";
    case MoePass::kWeightUpdate: return "weights";
  }
  return "?";
}

const char* dataflow_name(Dataflow d) {
  switch (d) {
    case Dataflow::kBf16Gemms: return "bf16-gemms";
    case Dataflow::kBlockwise: return "blockwise";
    case Dataflow::kFp8Naive: return "fp8-naive";
    case Dataflow::kFlow: return "flow";
  }
  return "?";
}

const char* tensor_format_name(TensorFormat f) {
  switch (f) {
    case TensorFormat::kBf16: return "bf16";
    case TensorFormat::kFp8Row: return "fp8 row 1x128";
    case TensorFormat::kFp8Col: return "fp8 col 128x1";
    case TensorFormat::kFp8RowFp32Scale: return "fp8 row 1x128 fp32-scale";
    case TensorFormat::kMxfp4Row: return "mxfp4 row 1x32";
  }
  return "?";
}

std::string tensor_format_string(TensorFormat f, const char* shape) {
  return std::string(tensor_format_name(f)) + " " + shape;
}

double tensor_format_row_bytes(TensorFormat f, int64_t cols) {
  const double c = static_cast<double>(cols);
  switch (f) {
    case TensorFormat::kBf16: return 2.0 * c;
    case TensorFormat::kFp8Row:
    case TensorFormat::kFp8Col: return c + c / kFp8Block;
    case TensorFormat::kFp8RowFp32Scale: return c + 4.0 * c / kFp8Block;
    case TensorFormat::kMxfp4Row: return c / 2 + c / kFp4Block;
  }
  return 0.0;
}

const char* layer_width_name(LayerWidth w) {
  switch (w) {
    case LayerWidth::kH: return "H";
    case LayerWidth::k2F: return "2F";
    case LayerWidth::kF: return "F";
  }
  return "?";
}

std::string SavedSpec::format_string() const {
  const std::string shape = std::string("[Mp, ") + layer_width_name(width) + "]";
  return tensor_format_string(format, shape.c_str());
}

double SavedSpec::row_bytes(int64_t h, int64_t f) const {
  const int64_t cols = width == LayerWidth::kH ? h : width == LayerWidth::k2F ? 2 * f : f;
  return tensor_format_row_bytes(format, cols);
}

const char* wgrad_operand_name(WgradOperand o) {
  switch (o) {
    case WgradOperand::kGemm1Input: return "GEMM1 input x_perm";
    case WgradOperand::kGemm2Input: return "GEMM2 input a'";
    case WgradOperand::kGemm2Grad: return "GEMM2 grad dY";
    case WgradOperand::kGemm1Grad: return "GEMM1 grad dh";
  }
  return "?";
}

const char* wgrad_operand_short_name(WgradOperand o) {
  switch (o) {
    case WgradOperand::kGemm1Input: return "x_perm";
    case WgradOperand::kGemm2Input: return "a'";
    case WgradOperand::kGemm2Grad: return "dY";
    case WgradOperand::kGemm1Grad: return "dh";
  }
  return "?";
}

const char* column_method_name(ColumnMethod m) {
  switch (m) {
    case ColumnMethod::kNone: return "";
    case ColumnMethod::kQuantizeFromBf16: return "quantize col from BF16";
    case ColumnMethod::kScalingAwareTranspose: return "scaling-aware transpose";
    case ColumnMethod::kDequantTransposeQuant: return "DQ->T->Q (FP32 scales)";
    case ColumnMethod::kFp4RowToFp8Col: return "FP4RowToFP8Col vs FP4RowToFP8Row";
  }
  return "?";
}

const char* dq_t_q_dequantize_name(WgradOperand o) {
  switch (o) {
    case WgradOperand::kGemm1Input: return "dequantize x_perm (for its column copy)";
    case WgradOperand::kGemm2Input: return "dequantize a' (for its column copy)";
    case WgradOperand::kGemm2Grad: return "dequantize dY (for its column copy)";
    case WgradOperand::kGemm1Grad: return "dequantize dh (for its column copy)";
  }
  return "?";
}

const char* dq_t_q_quantize_name(WgradOperand o) {
  switch (o) {
    case WgradOperand::kGemm1Input: return "quantize x_perm col (transposed, FP32 scales)";
    case WgradOperand::kGemm2Input: return "quantize a' col (transposed, FP32 scales)";
    case WgradOperand::kGemm2Grad: return "quantize dY col (transposed, FP32 scales)";
    case WgradOperand::kGemm1Grad: return "quantize dh col (transposed, FP32 scales)";
  }
  return "?";
}

}  // namespace flowmoe
