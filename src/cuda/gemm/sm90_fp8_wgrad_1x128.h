// The sm_90a FP8 wgrad kernel with 1x128 token-block scales behind cuda::GroupedGemm::wgrad
// (sm90_fp8_wgrad_1x128.cu; docs/GEMM.md).
#pragma once
#include <cstdint>

#include "cuda/gemm/sm90_fp8_grouped_1x128.h"

typedef struct CUstream_st* cudaStream_t;

namespace flowmoe {
namespace cuda {
namespace sm90 {

// Experts a launch takes with host offsets (they travel in the kernel's parameters).
constexpr int kMaxInlineWgradExperts = 256;

// dW [E][N][K] FP32 (+)= (or BF16 =) per expert dY_col_e . X_col_e^T with 1x128 scales along tokens (gemm.h
// conventions; scales [NB][N], [NB][K], block b of expert e at row offsets[e]/128 + b: GEMM-ready
// FP32, or with scales_ue8m0 the UE8M0 bytes of the column copies, decoded in the kernel to the same
// FP32 values, so the same bits). Every offset a multiple of 128 (permute+pad with alignment 128).
struct WgradArgs {
  const int32_t* offsets = nullptr;       // [E + 1] on the device (read by the kernel), or null:
  const int32_t* host_offsets = nullptr;  // [E + 1] on the host (copied into the launch, E <= 256)
  int num_experts = 0;                    // 1 .. kMaxGroupedExperts
  int64_t m = 0;                          // token capacity of the codes [C, m]: a multiple of 128
  int64_t n = 0, k = 0;                   // multiples of 128
  const uint8_t* dy_codes = nullptr;      // [N, m]
  const void* dy_scales = nullptr;        // [m/128][N] FP32, or UE8M0 bytes with scales_ue8m0
  const uint8_t* x_codes = nullptr;       // [K, m]
  const void* x_scales = nullptr;         // [m/128][K] likewise
  bool scales_ue8m0 = false;              // both operands' scales are UE8M0 bytes
  void* dw = nullptr;                     // [E][N][K] FP32, or BF16 with out_bf16
  bool accumulate = false;                // += into dw (FP32 only), else overwrite (empty experts zeroed)
  bool out_bf16 = false;                  // dw is BF16: each FP32 sum rounded once (RNE) as it is stored
  int tile_n = 0;                         // output tile width along K: 0 by shape, 128, 256 (K % 256 == 0)
  // dw written where a model stores the weight (gemm.h StoredDw): [E][stored_rows][stored_cols],
  // gate / up halves of K alternating with stored_interleaved; stored_rows 0: [E][N][K]
  int64_t stored_rows = 0, stored_cols = 0;
  bool stored_interleaved = false;
  // One device int of the caller's, used by no other launch at the same time (reset here,
  // stream-ordered; two calls overlapping on different streams would skip or repeat tiles).
  int* tile_counter = nullptr;
  // Malformed offsets (not 0 = o[0] <= ... <= o[E] <= m, all multiples of 128) count once in
  // status->bad_segments (may be null) and leave dW untouched.
  DeviceStatus* status = nullptr;
};

// Why the kernel cannot take these arguments, or null when it can (all pointers 16-byte aligned).
const char* wgrad_device_unsupported(const WgradArgs& a);
// A memset of the tile counter and one kernel launch on `stream`; throws flowmoe::Error naming
// `what` (before anything is enqueued) when wgrad_device_unsupported says why. No host
// synchronisation, no allocation: capturable in a CUDA graph.
void fp8_wgrad_1x128(const WgradArgs& a, const char* what, cudaStream_t stream);

}  // namespace sm90
}  // namespace cuda
}  // namespace flowmoe
