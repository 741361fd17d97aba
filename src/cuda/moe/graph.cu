// LayerStepGraph (flowmoe/cuda/moe_graph.h): a sync_free layer's forward + backward captured once
// into a CUDA graph (thread-local capture on the layer's stream; the layer's side and tail streams
// join it through events, so the graph holds the whole fork/join structure) and replayed.
#include <cuda_runtime.h>

#include "cuda/common.cuh"
#include "cuda/moe/layer.h"
#include "flowmoe/cuda/moe_graph.h"

namespace flowmoe {
namespace cuda {
namespace moe {

LayerStepGraph::LayerStepGraph(MoeLayer* layer, cudaStream_t stream, const Step& step) : stream_(stream) {
  const char* what = "LayerStepGraph";
  CudaMoeLayer* l = dynamic_cast<CudaMoeLayer*>(layer);
  FLOWMOE_CHECK(l != nullptr, what << ": the layer is not a CUDA layer (backend " << (layer ? layer->backend() : "null")
                                   << "); expected one made by make_cuda_layer");
  FLOWMOE_CHECK(l->sync_free(), what << ": the layer synchronises with the host in every forward; build it with "
                                        "CudaLayerOptions::sync_free = true to capture its step");
  FLOWMOE_CHECK(l->has_weights(), what << ": no weights; call set_weights before capturing");
  FLOWMOE_CHECK(!l->caller_memory(), what << ": the layer takes its memory from the caller "
                                             "(CudaLayerOptions::caller_memory); the graph would keep the "
                                             "addresses of one call's regions: capture a layer that owns its memory");
  FLOWMOE_CHECK(stream == l->stream(), what << ": capture on the stream the layer was made with (its work is "
                                               "enqueued there)");
  cudaGraph_t graph = nullptr;
  FLOWMOE_CUDA_CHECK(cudaStreamBeginCapture(stream, cudaStreamCaptureModeThreadLocal));
  try {
    if (step.weights) layer->set_weights(*step.weights);
    layer->forward(step.x, step.tokens, step.y);
    layer->backward(step.dy, step.dx, step.grads);
  } catch (...) {
    cudaStreamEndCapture(stream, &graph);  // leave the stream usable
    if (graph) cudaGraphDestroy(graph);
    cudaGetLastError();
    throw;
  }
  FLOWMOE_CUDA_CHECK(cudaStreamEndCapture(stream, &graph));
  const cudaError_t e = cudaGraphInstantiate(&exec_, graph, 0);
  cudaGraphDestroy(graph);
  FLOWMOE_CHECK(e == cudaSuccess, what << ": cudaGraphInstantiate failed: " << cudaGetErrorString(e));
  // upload now (stream-ordered) rather than at the first replay
  FLOWMOE_CUDA_CHECK(cudaGraphUpload(exec_, stream));
}

LayerStepGraph::~LayerStepGraph() {
  if (exec_) cudaGraphExecDestroy(exec_);
}

void LayerStepGraph::replay() { FLOWMOE_CUDA_CHECK(cudaGraphLaunch(exec_, stream_)); }

}  // namespace moe
}  // namespace cuda
}  // namespace flowmoe
