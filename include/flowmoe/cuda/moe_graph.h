// A whole layer step captured once into a CUDA graph and replayed: forward, then backward, of a CUDA
// MoE layer built with CudaLayerOptions::sync_free (flowmoe/moe.h). A replay is one graph launch:
// no host work per kernel, no host synchronisation, the same bits as the eager step. Host-only
// declarations (the stream typedef only), usable from .cpp files linked with flowmoe_cuda.
//
//   CudaLayerOptions o;  o.sync_free = true;
//   auto layer = make_cuda_layer(cfg, stream, o);
//   layer->set_weights(w);
//   LayerStepGraph step(layer.get(), stream, {x, tokens, y, dy, dx, grads});
//   for (...) { /* refill x, dy in place */ step.replay(); }
//
// The graph holds the step's pointers and token count: every replay reads x and dy and writes y,
// dx and the gradients at the addresses given here (refill the buffers, keep them). Without
// Step::weights, set_weights between replays is fine (it writes the layer's own weight buffers,
// which the graph reads; with Step::weights the next replay overwrites them). With
// Step::weights the graph starts with the weight update itself (set_weights: the BF16 copies and
// the FP8 quantization of the FP32 masters at those addresses), so a training loop that updates
// the masters in place (an optimizer step) replays forward + backward on the new weights with no
// host work at all. The capture runs the step's host code once (it enqueues nothing that runs);
// the layer's cast report and status describe the latest replay once read (a sync_free layer
// counts non-finite weights into status().nonfinite instead of throwing at set_weights).
#pragma once

#include <cstdint>

#include "flowmoe/moe.h"

typedef struct CUstream_st* cudaStream_t;
typedef struct CUgraphExec_st* cudaGraphExec_t;

namespace flowmoe {
namespace cuda {
namespace moe {

class LayerStepGraph {
 public:
  struct Step {
    const bf16_t* x = nullptr;  // [T, H]
    int64_t tokens = 0;         // T
    bf16_t* y = nullptr;        // [T, H]
    const bf16_t* dy = nullptr; // [T, H]
    bf16_t* dx = nullptr;       // [T, H]
    MoeGrads grads;
    const MoeWeights* weights = nullptr;  // non-null: set_weights(*weights) first in every replay
  };
  // Captures forward + backward on `stream`, the stream the layer was made with. Throws
  // flowmoe::Error (nothing captured, the layer usable) unless `layer` is a sync_free CUDA layer
  // with weights, or when the capture fails (with Step::weights: call set_weights again before
  // using the layer, its weight buffers were not written). Expert parallelism (a sync_free layer
  // over a communicator with device peer access, docs/EP.md §8): capturing runs the step's host
  // code, collectives included, so every rank captures at the same time; every rank then replays
  // the same number of times (the device barriers pair the ranks' replays). The graph is uploaded
  // here: with simulated ranks on one GPU, let every rank finish its capture before any replays.
  LayerStepGraph(MoeLayer* layer, cudaStream_t stream, const Step& step);
  ~LayerStepGraph();
  LayerStepGraph(const LayerStepGraph&) = delete;
  LayerStepGraph& operator=(const LayerStepGraph&) = delete;
  // One launch of the whole step on the capture stream (stream-ordered, asynchronous).
  void replay();

 private:
  cudaStream_t stream_ = nullptr;
  cudaGraphExec_t exec_ = nullptr;
};

}  // namespace moe
}  // namespace cuda
}  // namespace flowmoe
