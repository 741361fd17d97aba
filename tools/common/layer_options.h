// The CUDA layer's options from the environment, for the programs that time the layer
// (`flowmoe bench`, tools/flowmoe/cmd_bench.cpp; bench/ep/flowmoe_bench_ep.cu); shared from
// tools/common/ (docs/ARCHITECTURE.md §1, layer 7). The library reads
// none (README "Runtime settings"): FLOWMOE_LAYER_OVERLAP=0 (no side stream),
// FLOWMOE_LAYER_TAIL_OVERLAP=0|1 (tail stream), FLOWMOE_LAYER_GROUPED_GEMM=0|1|auto (FP8
// fprop/dgrad by cuBLASLt per expert, the grouped kernel, or the layer's choice),
// FLOWMOE_LAYER_FUSED_SWIGLU=0|1 (flow recipes: SwiGLU in GEMM1's epilogue),
// FLOWMOE_LAYER_FUSED_DSWIGLU=0|1 (flow recipes: dSwiGLU in GEMM2-dgrad's epilogue), FLOWMOE_EP_DEDUP=0 (every (token, expert) row
// travels), FLOWMOE_EP_DIRECT_BYTES=N, FLOWMOE_GEMM_TUNE / _STREAMS / _PRIORITY / _WGRAD_KERNEL
// (the GEMM options; a set priority overrides the layer's choice). Needs the CUDA backend.
#pragma once

#include <cstdlib>
#include <string>

#include "flowmoe/comm.h"
#include "flowmoe/error.h"
#include "flowmoe/gemm.h"
#include "flowmoe/moe.h"
#include "flowmoe/settings.h"

namespace flowmoe {
namespace bench {

inline CudaLayerOptions layer_options_from_env() {
  CudaLayerOptions o;
  auto flag = [](const char* name, bool* out) {
    const char* v = std::getenv(name);
    if (!v) return;
    FLOWMOE_CHECK(std::string(v) == "0" || std::string(v) == "1", name << "=\"" << v << "\"; expected 0 or 1");
    *out = v[0] == '1';
  };
  flag("FLOWMOE_LAYER_OVERLAP", &o.side_stream);
  flag("FLOWMOE_LAYER_TAIL_OVERLAP", &o.tail_stream);
  flag("FLOWMOE_LAYER_DX_ROWS_IN_COLUMNS", &o.dx_rows_in_column_copies);
  flag("FLOWMOE_LAYER_FUSED_SWIGLU", &o.fused_swiglu);
  flag("FLOWMOE_LAYER_FUSED_DSWIGLU", &o.fused_dswiglu);
  flag("FLOWMOE_EP_DEDUP", &o.ep_dedup);
  if (const char* v = std::getenv("FLOWMOE_LAYER_GROUPED_GEMM")) {
    const std::string g = v;
    FLOWMOE_CHECK(g == "0" || g == "1" || g == "auto",
                  "FLOWMOE_LAYER_GROUPED_GEMM=\"" << g << "\"; expected 0, 1 or auto");
    using FD = CudaLayerOptions::FpropDgrad;
    o.fprop_dgrad = g == "0" ? FD::kCublasLt : g == "1" ? FD::kGrouped : FD::kAuto;
  }
  o.gemm = gemm::GroupedGemmOptions::from_settings(env_lookup());
  o.ep_direct_bytes = ep_direct_bytes_from_settings(env_lookup());
  if (std::getenv("FLOWMOE_GEMM_PRIORITY")) o.gemm_pool_priority = o.gemm.pool_priority;
  return o;
}

}  // namespace bench
}  // namespace flowmoe
