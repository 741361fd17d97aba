// The CUDA layer's dataflows as data (pipeline.h DataflowRow): one row per recipe.h Dataflow, the
// one place of the CUDA layer that lists them.
#include "cuda/moe/pipelines/pipeline.h"
#include "flowmoe/error.h"

namespace flowmoe {
namespace cuda {
namespace moe {
namespace {

using CM = ColumnMethod;
constexpr DataflowRow kDataflows[] = {
    // dataflow, pipeline, its own buffers, x_perm's column copy (FP8 / BF16 x, MXFP4 x), quantized rows
    {Dataflow::kBf16Gemms, make_bf16_pipeline, nullptr, CM::kNone, CM::kNone, false},
    {Dataflow::kBlockwise, make_blockwise_pipeline, plan_blockwise_buffers, CM::kQuantizeFromBf16, CM::kNone, false},
    {Dataflow::kFp8Naive, make_fp8_naive_pipeline, plan_fp8_naive_buffers, CM::kDequantTransposeQuant, CM::kNone, false},
    {Dataflow::kFlow, make_flow_pipeline, plan_flow_buffers, CM::kScalingAwareTranspose, CM::kFp4RowToFp8Col, true},
};

}  // namespace

const DataflowRow& dataflow_row(Dataflow d) {
  for (const DataflowRow& r : kDataflows)
    if (r.dataflow == d) return r;
  FLOWMOE_CHECK(false, "make_cuda_layer: internal error: the dataflow " << dataflow_name(d)
                                                                        << " has no row in the CUDA layer's table; "
                                                                           "expected one in "
                                                                           "src/cuda/moe/pipelines/pipeline.cu");
  return kDataflows[0];
}

}  // namespace moe
}  // namespace cuda
}  // namespace flowmoe
