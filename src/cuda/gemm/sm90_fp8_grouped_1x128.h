// The sm_90a grouped FP8 GEMM for fprop and dgrad behind cuda::GroupedGemm (1x128 activation
// tiles x 128x128 weight blocks, BF16 output): one persistent launch over all experts that reads
// the expert offsets from device memory (sm90_fp8_grouped_1x128.cu; docs/GEMM.md).
#pragma once
#include <cstdint>

#include "flowmoe/swiglu_math.h"
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

// GEMM1 of the flow recipes with the SwiGLU epilogue (sm90_grouped_swiglu_epilogue.cuh): the fprop
// above with B = W1 of every expert with its 128-row blocks interleaved gate 0, up 0, gate 1, up 1,
// ... (n_out = 2F; d must be null: h in BF16 is not written). Per row r < offsets[E] and 128
// features j: a'[r, j] = p[r] * silu(h_gate) * h_up (h rounded to BF16 as the BF16 output would be)
// as FP8 1x128 row tiles, and the saved h in natural order (gate columns [0, F), up [F, 2F)) as
// FP8 1x128 row tiles or MXFP4 1x32 blocks: the bits of fp8_grouped_rowwise on the natural W1
// followed by cuda::swiglu_quant / swiglu_quant_h4.
struct SwigluEpilogueArgs {
  int64_t f = 0;                  // F: features of a'
  const float* prob = nullptr;    // [m] routing probability per row, or null (a' = silu(gate) up)
  uint8_t* a_codes = nullptr;     // E4M3 [m, F], 16-byte aligned
  uint8_t* a_scales = nullptr;    // UE8M0 [F/128][a_scale_ld], a_scale_ld >= m
  int64_t a_scale_ld = 0;
  bool h_mxfp4 = false;           // h saved as MXFP4 (flow-fp4) instead of FP8 rows (flow)
  uint8_t* h_codes = nullptr;     // FP8: E4M3 [m, 2F]; MXFP4: E2M1 [m, F] (two per byte); 16-byte aligned
  uint8_t* h_scales = nullptr;    // FP8: UE8M0 [2F/128][h_scale_ld]; MXFP4: [m][2F/32], 4-byte aligned
  int64_t h_scale_ld = 0;         // FP8 only, >= m
  GatedActivation act;            // SwiGLU or the clamped SwiGLU (swiglu_math.h)
  const float* gate_up_bias = nullptr;  // GEMM1's bias [E, 2F] FP32 (gate then up), 16-byte aligned, or null
  DeviceStatus* status = nullptr; // non-finite a', gate and up values counted in status->nonfinite
};
// Why the SwiGLU epilogue cannot take these arguments, or null when it can.
const char* swiglu_grouped_unsupported(const RowwiseGroupedArgs& a, const SwigluEpilogueArgs& s);
// One kernel launch, as fp8_grouped_rowwise (throws naming `what` before enqueueing anything).
void fp8_grouped_rowwise_swiglu(const RowwiseGroupedArgs& a, const SwigluEpilogueArgs& s, const char* what,
                                cudaStream_t stream);

// GEMM2-dgrad of the flow recipes with the dSwiGLU epilogue (sm90_grouped_dswiglu_epilogue.cuh): the
// dgrad above (A = dY, B = W2^T, n_out = F; d must be null: da' in BF16 is not written), then per
// row r < offsets[E] from da' rounded to BF16 and the saved h: dh = [dgate, dup] (with the routing
// probability when given) as FP8 1x128 row tiles [m, 2F] and FP8 128x1 column tiles [2F, m] over
// the experts' 128-token blocks, and dp's partial sums [F/128][m]: the bits of fp8_grouped_rowwise
// followed by cuda::dswiglu_quant_fp8h / dswiglu_quant_fp4h.
struct DswigluEpilogueArgs {
  int64_t f = 0;                    // F: features of da'
  const float* prob = nullptr;      // [m] routing probability per row, or null (plain dSwiGLU)
  bool h_mxfp4 = false;             // h saved as MXFP4 (flow-fp4) instead of FP8 rows (flow)
  const uint8_t* h_codes = nullptr; // FP8: E4M3 [m, 2F]; MXFP4: E2M1 [m, F] (two per byte); 16-byte aligned
  const uint8_t* h_scales = nullptr;  // FP8: UE8M0 [2F/128][h_scale_ld]; MXFP4: [m][2F/32], 4-byte aligned
  int64_t h_scale_ld = 0;           // FP8 only, >= m
  uint8_t* row_codes = nullptr;     // dh row-wise E4M3 [m, 2F], 16-byte aligned
  uint8_t* row_scales = nullptr;    // UE8M0 [2F/128][m]
  uint8_t* col_codes = nullptr;     // dh column-wise E4M3 [2F, m], 16-byte aligned
  uint8_t* col_scales = nullptr;    // UE8M0 [ceil(m/128) + E][2F] (the segment blocks), 2-byte aligned
  float* dprob_partials = nullptr;  // [F/128][m] (needs prob), or null
  GatedActivation act;              // SwiGLU or the clamped SwiGLU (the forward's)
  DeviceStatus* status = nullptr;   // non-finite dgate and dup values counted in status->nonfinite
};
const char* dswiglu_grouped_unsupported(const RowwiseGroupedArgs& a, const DswigluEpilogueArgs& s);
void fp8_grouped_rowwise_dswiglu(const RowwiseGroupedArgs& a, const DswigluEpilogueArgs& s, const char* what,
                                 cudaStream_t stream);

}  // namespace sm90
}  // namespace cuda
}  // namespace flowmoe
