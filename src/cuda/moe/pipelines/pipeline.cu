// The factory of the CUDA layer's pipelines (pipeline.h): the one switch over the dataflows.
#include "cuda/moe/pipelines/pipeline.h"
#include "flowmoe/error.h"

namespace flowmoe {
namespace cuda {
namespace moe {

std::unique_ptr<PipelineSteps> make_pipeline(const RecipePath& path) {
  switch (path.dataflow) {
    case Dataflow::kBf16Gemms:
      return make_bf16_pipeline();
    case Dataflow::kBlockwise:
      return make_blockwise_pipeline();
    case Dataflow::kFp8Naive:
      return make_fp8_naive_pipeline();
    case Dataflow::kFlow:
      return make_flow_pipeline();
  }
  FLOWMOE_CHECK(false, "make_cuda_layer: internal error: recipe " << path.spec().name << "'s dataflow ("
                                                                  << dataflow_name(path.dataflow)
                                                                  << ") has no CUDA pipeline; expected one of "
                                                                     "src/cuda/moe/pipelines/");
  return nullptr;
}

}  // namespace moe
}  // namespace cuda
}  // namespace flowmoe
