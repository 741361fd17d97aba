// The sm_90a grouped FP8 GEMM for fprop and dgrad behind cuda::GroupedGemm (1x128 activation
// tiles x 128x128 weight blocks, BF16 output): one persistent launch over all experts that reads
// the expert offsets from device memory (sm90_fp8_grouped_1x128.cu; docs/GEMM.md).
#pragma once
#include <cstdint>

#include "flowmoe/tensor.h"

typedef struct CUstream_st* cudaStream_t;

namespace flowmoe {
namespace cuda {

struct DeviceStatus;

namespace sm90 {

// Experts one launch of the device-offset kernels takes (their offsets live in shared memory).
constexpr int kMaxGroupedExperts = 1024;

// D [M, n_out] (BF16, row-major) = for every expert e, rows offsets[e] .. offsets[e+1] - 1:
//   D_e = A_e [M_e, k_red] . B_e^T,  B_e = rows e * n_out .. of B [E * n_out, k_red]
// with A's 1x128 scales along k_red per row and B's 128x128 block scales applied per 128-wide
// block of k_red (the CPU reference's order: block sums times sa * sb, added in block order).
// fprop: A = X, B = W (n_out = N, k_red = K); dgrad: A = dY, B = Wt (n_out = K, k_red = N).
struct RowwiseGroupedArgs {
  const int32_t* offsets = nullptr;  // [num_experts + 1] on the device: 0 = o[0] <= ... <= o[E] <= m
  int num_experts = 0;               // 1 .. kMaxGroupedExperts
  int64_t m = 0;                     // rows of A and D (a capacity: rows past offsets[E] untouched)
  int64_t n_out = 0, k_red = 0;      // multiples of 128
  const uint8_t* a_codes = nullptr;  // E4M3 [m, k_red], 16-byte aligned
  // A's scales: UE8M0 [k_red/128][a_scale_ld] (token-contiguous, a_scale_ld >= m), or FP32
  // expert-packed (gemm.h: expert e's [k_red/128][M_e] at float k_red/128 * offsets[e]).
  const void* a_scales = nullptr;
  bool a_ue8m0 = true;
  int64_t a_scale_ld = 0;
  const uint8_t* b_codes = nullptr;  // E4M3 [E * n_out, k_red], 16-byte aligned
  // B's scales: [E * n_out/128][b_scale_ld], UE8M0 bytes or FP32 (the GEMM-ready ld
  // round_up(k_red/128, 4), or k_red/128).
  const void* b_scales = nullptr;
  bool b_ue8m0 = false;
  int64_t b_scale_ld = 0;
  bf16_t* d = nullptr;               // [m, n_out], 16-byte aligned
  // Malformed offsets count once in status->bad_segments (may be null) and leave D untouched.
  DeviceStatus* status = nullptr;
};

// Why the kernel cannot take these arguments (shapes, limits, alignment), or null when it can.
const char* rowwise_grouped_unsupported(const RowwiseGroupedArgs& a);
// One kernel launch on `stream` (none when m or every tile count is zero). Throws flowmoe::Error
// naming `what` when rowwise_grouped_unsupported says why, before anything is enqueued. No host
// synchronisation and no allocation: capturable in a CUDA graph.
void fp8_grouped_rowwise(const RowwiseGroupedArgs& a, const char* what, cudaStream_t stream);

}  // namespace sm90
}  // namespace cuda
}  // namespace flowmoe
