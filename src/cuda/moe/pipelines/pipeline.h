// The CUDA layer's pipelines: one per dataflow (recipe.h Dataflow), each a forward and a backward
// over the step context (step_context.h: the workspace's views, the streams, the recipe path and
// options, the shared services). The layer (layer.cu) routes, then hands the step to its
// pipeline, made once at construction from its dataflow's row (dataflow_row); after the backward
// it runs the tail common to every dataflow (backward_tail.cu).
//   bf16.cu       Dataflow::kBf16Gemms (bf16): BF16 GEMMs
//   blockwise.cu  Dataflow::kBlockwise (blockwise): BF16 between the GEMMs, each grouped linear
//                 quantizes its BF16 input (row + col copies, UE8M0 scales)
//   fp8_naive.cu  Dataflow::kFp8Naive (fp8-naive): operator substitution with FP32 scales, column
//                 copies DQ -> T -> Q
//   flow.cu       Dataflow::kFlow (flow, flow-fp4): quantized once at the entry, FP8 / MXFP4
//                 between the GEMMs, fused (d)SwiGLU + quantize, exact column copies
//   shared.cu     the steps more than one of them runs (StepContext members)
// The contract of a pipeline:
//   forward   routing has run (routing.cu): move the token rows to the experts, GEMM1, SwiGLU*prob,
//             GEMM2 in the recipe's precision, save what its backward needs, bring the expert rows
//             back to y (gemm2_then_combine).
//   backward  up to the dX rows: dY to the experts, GEMM2 dgrad + wgrad, dSwiGLU*prob, GEMM1 dgrad
//             + wgrad. Leaves the dX rows [Mp, H] bf16 in ExpertBuffers::rows_bf16 and the partial
//             sums of dp ([F/128][Mp], swiglu.h) in RoutingBuffers::dprob_partials, and calls
//             mark_dx_rows_ready() right after GEMM1 dgrad. A dgrad runs before the wgrad that
//             reads the same gradient, except GEMM1's in the flow pipeline with
//             RecipePath::dx_rows_in_column_copies (the dX rows overwrite the wgrad's operands).
// A new dataflow: a value of recipe.h Dataflow, its recipe table row(s), a file here with its
// pipeline and its plan_<name>_buffers (the buffers only it uses; workspace.h), and its row in
// kDataflows (pipeline.cu): nothing else of the CUDA layer names a dataflow. The CPU reference
// mirrors it (src/cpu/moe/layer.cpp, kCpuDataflows, and its forward / backward there).
#pragma once

#include <memory>

#include "cuda/moe/step_context.h"

namespace flowmoe {
namespace cuda {
namespace moe {

class PipelineSteps {
 public:
  virtual ~PipelineSteps() = default;
  virtual void forward(StepContext& c, bf16_t* y) = 0;
  virtual void backward(StepContext& c, const bf16_t* dy, const MoeGrads& g) = 0;
};

// A dataflow as data: what the CUDA layer knows of one (its recipe path, workspace and pipeline
// read it; none of them switches over the Dataflow values).
struct DataflowRow {
  Dataflow dataflow;
  std::unique_ptr<PipelineSteps> (*make_pipeline)();  // its file's factory
  void (*plan_buffers)(const DataflowBufferPlan&);    // the buffers only its pipeline uses, or null
  // How its pipeline makes the wgrad copy of GEMM1's input x_perm, with x arriving as FP8 / BF16
  // and as MXFP4 (kNone: not run); make_recipe_path checks the recipe row says the same.
  ColumnMethod x_perm_column, x_perm_column_mxfp4;
  // x (and then h, a') quantized row-wise once and moved, saved and fed to the GEMMs so: the fused
  // (d)SwiGLU epilogues, the wgrad column copies as operators of their own (side stream) and the dX
  // rows in the column copies' storage apply to it; else h is saved in BF16 and no MXFP4 is read.
  bool quantized_rows;
};
// The row of `d` (pipeline.cu kDataflows); throws, naming the dataflow, if it has none.
const DataflowRow& dataflow_row(Dataflow d);

// One per file of this folder (the rows' factories).
std::unique_ptr<PipelineSteps> make_bf16_pipeline();
std::unique_ptr<PipelineSteps> make_blockwise_pipeline();
std::unique_ptr<PipelineSteps> make_fp8_naive_pipeline();
std::unique_ptr<PipelineSteps> make_flow_pipeline();

}  // namespace moe
}  // namespace cuda
}  // namespace flowmoe
