// Inspection of the CUDA MoE layer (make_cuda_layer, include/flowmoe/moe.h) for the CLI, the
// benchmarks and the tests: per-stage timing, allocated bytes, host counters, and a device fill
// for large inputs. Host-only declarations (no CUDA headers needed beyond the stream typedef),
// usable from .cpp files linked with flowmoe_cuda.
#pragma once

#include <cstddef>
#include <cstdint>
#include <string>
#include <vector>

#include "flowmoe/moe.h"

typedef struct CUstream_st* cudaStream_t;

namespace flowmoe {
namespace cuda {
namespace moe {

// One timed stage of a pass (CUDA events recorded on the layer's stream around the stage).
struct StageTime {
  MoePass pass = MoePass::kForward;
  std::string name;  // e.g. "GEMM1 fprop", "permute+pad", "router"
  float ms = 0.0f;
};

// True when `layer` was made by make_cuda_layer.
bool is_cuda_layer(const MoeLayer* layer);

// Per-stage timing: when on, every stage of forward/backward is bracketed by CUDA events (a few
// microseconds of overhead per stage; leave it off when timing whole passes). Throws unless
// `layer` is a CUDA layer.
void set_profiling(MoeLayer* layer, bool on);
// The stages of the last forward and the last backward, in execution order (synchronises the
// layer's stream). Empty when profiling was off.
std::vector<StageTime> stage_times(const MoeLayer* layer);

// Device bytes the layer allocated at construction (workspaces, saved-tensor buffers, weight
// copies, cuBLASLt workspace). Steady-state forward/backward allocate nothing more.
size_t allocated_bytes(const MoeLayer* layer);

// Host-side counters since construction: synchronisations the layer made in forward/backward
// (the routing-count fetch, one per forward), cuBLASLt matmul launches of its grouped GEMMs and
// launches of the grouped sm_90a kernels (FP8 fprop/dgrad; FP8 wgrad; BF16 fprop/dgrad/wgrad).
struct LayerCounters {
  int64_t host_syncs = 0;
  int64_t gemm_matmuls = 0;
  int64_t gemm_grouped_launches = 0;
  int64_t gemm_wgrad_kernel_launches = 0;
  int64_t gemm_bf16_kernel_launches = 0;
};
LayerCounters counters(const MoeLayer* layer);

// Deterministic pseudo-random normal fill on the device (counter-based hash + Box-Muller), for
// benchmarks and tests that need large inputs without host traffic.
void fill_normal_f32(float* p, int64_t n, uint64_t seed, float stddev, cudaStream_t stream);
void fill_normal_bf16(bf16_t* p, int64_t n, uint64_t seed, float stddev, cudaStream_t stream);

}  // namespace moe
}  // namespace cuda
}  // namespace flowmoe
