// Expert biases on GEMM1's output (gpt-oss's gate_up_proj_bias; issue 46; docs/MOE.md §bias).
//
// The rows of the permuted expert buffers are grouped in segments, one per local expert
// (offsets [E + 1]; padding rows inside a segment belong to it). For GEMM1's output h [M, N]
// (N = 2F, BF16) and a bias b [E, N] (FP32):
//   add_expert_bias    h[r, c] = bf16_rne(f32(h[r, c]) + b[e(r), c])   every row of a segment,
//                      padding rows included (their probability is 0, so they still give zeros);
//                      NaN results stored as the canonical 0x7FC0. One rounding, as a BF16 linear
//                      layer with bias rounds its output; everything after (the activation, the
//                      saved copy of h) sees the biased h.
//   expert_bias_grad   db[e, c] (=, or += with accumulate) the sum over the rows of segment e of
//                      dH[r, c]: the BF16 dSwiGLU output (bf16; blockwise, before its
//                      quantization) or the row-wise FP8 1x128 copy GEMM1's dgrad reads, with
//                      UE8M0 scales (flow, flow-fp4: no BF16 dH exists there), each
//                      value decoded exactly (num::dequant_e4m3). Summed in binary32 in blocks of
//                      kExpertBiasBlockRows rows from the segment's first row: each block in row
//                      order from +0 (one f_add per row), the blocks' sums in block order from +0,
//                      then added to db's old value when accumulating.
// Both backends give the same bits (the GPU sums the blocks in parallel, each in row order, and adds
// their sums in block order).
#pragma once

#include <cstdint>

#include "flowmoe/tensor.h"

namespace flowmoe {
// expert_bias_grad's summation blocks: rows per block (the GPU's parallel unit)
constexpr int64_t kExpertBiasBlockRows = 128;
namespace cpu {

void add_expert_bias(bf16_t* h, int64_t m, int64_t n, const Segments& seg, const float* bias);
void expert_bias_grad(const bf16_t* dh, int64_t m, int64_t n, const Segments& seg, float* db,
                      bool accumulate);
// dh_row: row-wise 1x128 FP8 [M, N] (kRow1x128, UE8M0 scales).
void expert_bias_grad(const QTensor& dh_row, const Segments& seg, float* db, bool accumulate);

}  // namespace cpu
}  // namespace flowmoe

#if defined(FLOWMOE_HAVE_CUDA)
#include <cuda_runtime.h>

namespace flowmoe {
namespace cuda {

// Device pointers; offsets [num_segments + 1] device int32 (offsets[0] == 0). rows_bound: a device
// int or null; rows at or past min(m, *rows_bound) are neither read nor written (the sync-free
// layer's padded row count). Stream-ordered; nothing allocates or synchronises. N must be a
// multiple of 8 (h rows are read 16 bytes at a time).
void add_expert_bias(bf16_t* h, int64_t m, int64_t n, const int32_t* offsets, int num_segments,
                     const float* bias, const int32_t* rows_bound, cudaStream_t stream);
// dh_gate_up: dh's columns as gate / up pairs (2 j, 2 j + 1; swiglu.h dswiglu's dh_gate_up), db
// still in the layer's order (gate half, then up half): column 2 j's sum into db[e, j], 2 j + 1's
// into db[e, n/2 + j]; the sums themselves as without it.
void expert_bias_grad(const bf16_t* dh, int64_t m, int64_t n, const int32_t* offsets,
                      int num_segments, float* db, bool accumulate, const int32_t* rows_bound,
                      cudaStream_t stream, bool dh_gate_up = false);
// dh as row-wise FP8: codes [M, N], scales [N/128][M] (UE8M0).
void expert_bias_grad_fp8(const uint8_t* codes, const uint8_t* scales, int64_t m, int64_t n,
                          const int32_t* offsets, int num_segments, float* db, bool accumulate,
                          const int32_t* rows_bound, cudaStream_t stream);

}  // namespace cuda
}  // namespace flowmoe
#endif
