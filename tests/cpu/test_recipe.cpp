// The recipe table (flowmoe/recipe.h): rows in enum order, names parse back, the wire formats
// follow the entry formats, every FP8 recipe names its weight and entry operators, the saved
// formats and row sizes are the report's strings, the column methods agree with what the saved
// tensors can provide, and each row's dataflow with its formats.
#include <gtest/gtest.h>

#include <set>
#include <string>

#include "flowmoe/error.h"
#include "flowmoe/recipe.h"

namespace flowmoe {
namespace {

WireFormat wire_of(TensorFormat f) {
  switch (f) {
    case TensorFormat::kFp8Row: return WireFormat::kFp8;
    case TensorFormat::kFp8RowFp32Scale: return WireFormat::kFp8Fp32Scale;
    case TensorFormat::kMxfp4Row: return WireFormat::kMxfp4;
    default: return WireFormat::kBf16;
  }
}

TEST(RecipeTable, RowsInEnumOrderAndNamesParseBack) {
  const std::vector<RecipeSpec>& t = recipe_table();
  ASSERT_EQ(t.size(), all_recipes().size());
  std::set<std::string> names;
  for (size_t i = 0; i < t.size(); ++i) {
    EXPECT_EQ(static_cast<size_t>(t[i].recipe), i);
    EXPECT_EQ(all_recipes()[i], t[i].recipe);
    EXPECT_EQ(&recipe_spec(t[i].recipe), &t[i]);
    EXPECT_STREQ(recipe_name(t[i].recipe), t[i].name);
    EXPECT_EQ(parse_recipe(t[i].name), t[i].recipe);
    names.insert(t[i].name);
  }
  EXPECT_EQ(names.size(), t.size());
  EXPECT_EQ(recipe_names(","), "bf16,blockwise,fp8-naive,flow,flow-fp4");
  EXPECT_THROW(recipe_spec(static_cast<Recipe>(99)), Error);
  EXPECT_STREQ(recipe_name(static_cast<Recipe>(99)), "?");
}

TEST(RecipeTable, WireFormatsFollowTheEntryFormats) {
  for (const RecipeSpec& r : recipe_table()) {
    EXPECT_EQ(r.forward_wire, wire_of(r.entry)) << r.name;
    EXPECT_EQ(r.backward_wire, wire_of(r.backward_entry)) << r.name;
    // an entry in a quantized format is quantized at the entry, a BF16 one is not
    EXPECT_EQ(r.quantize_x_entry != nullptr, r.entry != TensorFormat::kBf16) << r.name;
    EXPECT_EQ(r.quantize_dy_entry != nullptr, r.backward_entry != TensorFormat::kBf16) << r.name;
    // only FP32-scale moves are dequantized to BF16 after the move
    EXPECT_EQ(r.dequantize_x_after_dispatch != nullptr,
              r.entry == TensorFormat::kFp8RowFp32Scale) << r.name;
    EXPECT_EQ(r.uses_fp8(), recipe_uses_fp8(r.recipe));
    EXPECT_EQ(r.uses_fp8(), r.weights != WeightCopy::kBf16Only) << r.name;
    EXPECT_EQ(r.quantize_w1 != nullptr, r.uses_fp8()) << r.name;
  }
}

TEST(RecipeTable, SavedFormatsAndRowBytes) {
  const RecipeSpec& flow = recipe_spec(Recipe::kFlow);
  EXPECT_EQ(flow.gemm1_input.format_string(), "fp8 row 1x128 [Mp, H]");
  EXPECT_EQ(flow.gemm1_output.format_string(), "fp8 row 1x128 [Mp, 2F]");
  EXPECT_EQ(flow.gemm2_input.format_string(), "fp8 col 128x1 [Mp, F]");
  EXPECT_EQ(recipe_spec(Recipe::kFp8Naive).gemm1_input.format_string(),
            "fp8 row 1x128 fp32-scale [Mp, H]");
  EXPECT_EQ(recipe_spec(Recipe::kFlowFp4).gemm1_output.format_string(), "mxfp4 row 1x32 [Mp, 2F]");
  EXPECT_EQ(recipe_spec(Recipe::kBf16).gemm2_input.format_string(), "bf16 [Mp, F]");
  // bytes per row: H = 256, F = 128
  EXPECT_EQ(recipe_spec(Recipe::kBf16).gemm1_output.row_bytes(256, 128), 512.0);
  EXPECT_EQ(flow.gemm1_input.row_bytes(256, 128), 258.0);
  EXPECT_EQ(flow.gemm2_input.row_bytes(256, 128), 129.0);
  EXPECT_EQ(recipe_spec(Recipe::kFp8Naive).gemm2_input.row_bytes(256, 128), 132.0);
  EXPECT_EQ(recipe_spec(Recipe::kFlowFp4).gemm1_input.row_bytes(256, 128), 136.0);
}

TEST(RecipeTable, ColumnMethodsMatchWhatIsSaved) {
  for (const RecipeSpec& r : recipe_table()) {
    for (int i = 0; i < kNumWgradOperands; ++i) {
      const ColumnSpec& c = r.columns[i];
      EXPECT_EQ(c.method == ColumnMethod::kNone, !r.uses_fp8()) << r.name << " operand " << i;
      // a separate operator is named exactly when the copy is an exact conversion
      const bool exact = c.method == ColumnMethod::kScalingAwareTranspose ||
                         c.method == ColumnMethod::kFp4RowToFp8Col;
      EXPECT_EQ(c.op != nullptr, exact) << r.name << " operand " << i;
    }
    const ColumnMethod x = r.column(WgradOperand::kGemm1Input).method;
    if (x == ColumnMethod::kScalingAwareTranspose)
      EXPECT_EQ(r.gemm1_input.format, TensorFormat::kFp8Row) << r.name;
    if (x == ColumnMethod::kFp4RowToFp8Col)
      EXPECT_EQ(r.gemm1_input.format, TensorFormat::kMxfp4Row) << r.name;
    if (x == ColumnMethod::kQuantizeFromBf16)  // made in the forward, saved as the column copy
      EXPECT_EQ(r.gemm1_input.format, TensorFormat::kFp8Col) << r.name;
  }
  EXPECT_STREQ(column_method_name(ColumnMethod::kDequantTransposeQuant), "DQ->T->Q (FP32 scales)");
  EXPECT_STREQ(dq_t_q_dequantize_name(WgradOperand::kGemm2Input),
               "dequantize a' (for its column copy)");
  EXPECT_STREQ(dq_t_q_quantize_name(WgradOperand::kGemm1Grad),
               "quantize dh col (transposed, FP32 scales)");
  EXPECT_STREQ(wgrad_operand_name(WgradOperand::kGemm2Grad), "GEMM2 grad dY");
}

// The row's dataflow (what the backends switch on) agrees with where the row quantizes: no FP8
// weight copy, BF16 GEMMs; FP32-scale weights, fp8-naive's operator substitution; UE8M0 weights
// with a BF16 entry, a quantization at each grouped linear (blockwise); a quantized entry, flow.
TEST(RecipeTable, DataflowFollowsTheFormats) {
  for (const RecipeSpec& r : recipe_table()) {
    const Dataflow expected = r.weights == WeightCopy::kBf16Only            ? Dataflow::kBf16Gemms
                              : r.weights == WeightCopy::kFp8BlockFp32Scale ? Dataflow::kFp8Naive
                              : r.entry == TensorFormat::kBf16              ? Dataflow::kBlockwise
                                                                            : Dataflow::kFlow;
    EXPECT_EQ(r.dataflow, expected) << r.name << ": " << dataflow_name(r.dataflow);
  }
  EXPECT_STREQ(dataflow_name(Dataflow::kFlow), "flow");
  EXPECT_STREQ(dataflow_name(recipe_spec(Recipe::kFlowFp4).dataflow), "flow");
  EXPECT_STREQ(dataflow_name(recipe_spec(Recipe::kBf16).dataflow), "bf16-gemms");
}

}  // namespace
}  // namespace flowmoe
