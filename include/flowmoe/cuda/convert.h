// CUDA conversion kernels (sm_90a), bit-identical to flowmoe::cpu (flowmoe/cpu/convert.h).
//
// All pointers are device pointers; layouts are those of flowmoe/tensor.h. Every launcher checks
// its arguments on the host (throws flowmoe::Error), takes a stream, never synchronises and never
// allocates. Codes and scale buffers must be 16-byte aligned (cudaMalloc gives 256).
//
// Non-finite input and underflow are reported through a DeviceStatus in device memory (counters
// are added to, so one status can collect a whole layer pass); read it when convenient, e.g. once
// per step to skip a step with non-finite values. A null status means "do not count" (except in
// build_segment_blocks, where it is required).
#pragma once

#include <cuda_runtime.h>

#include <cstdint>

#include "flowmoe/tensor.h"

namespace flowmoe {
namespace cuda {

struct DeviceStatus {
  unsigned long long nonfinite;     // non-finite input elements (their tiles are marked NaN)
  unsigned long long underflow;     // elements rounded into subnormals/zero by an exact conversion
  unsigned long long bad_segments;  // segment tables that failed validation on the device
};

// Per-expert token segments resolved on the device into 128-token blocks, without a host sync.
// Sized for at most `max_blocks` = ceil(M/128) + E blocks; blocks past the real count are empty.
struct SegmentBlocks {
  const int32_t* offsets = nullptr;  // [E+1] token offsets (device)
  int num_segments = 0;              // E
  int64_t m = 0;                     // tokens (offsets[E] must equal m)
  int64_t max_blocks = 0;            // ceil(M/128) + E
  int32_t* block_start = nullptr;    // [max_blocks] first token of each block (-1: no block)
  int32_t* block_end = nullptr;      // [max_blocks] one past its last token
  int32_t* block_offsets = nullptr;  // [E+1] first block of each segment; [E] = number of blocks
};
int64_t segment_max_blocks(int64_t m, int num_segments);
// Fills block_start/block_end/block_offsets of `sb` (buffers provided by the caller) from
// sb.offsets. Malformed offsets (not from 0 to M, decreasing) count in status->bad_segments
// (status is required) and leave every block empty, so the column-wise outputs are not written:
// check bad_segments before using them. Only the first block_offsets[E] rows of a column-wise
// scale grid are written; rows up to max_blocks are left as they were.
void build_segment_blocks(const SegmentBlocks& sb, DeviceStatus* status, cudaStream_t stream);

// ---- FP8 quantize from BF16 ------------------------------------------------------------------
// x [M, K] bf16 -> codes [M, K], scales [K/128][M]. K % 128 == 0.
void quantize_row(const bf16_t* x, int64_t m, int64_t k, uint8_t* codes, uint8_t* scales,
                  DeviceStatus* status, cudaStream_t stream);
// x [M, K] bf16 -> column-wise codes [K, M], scales [max_blocks][K]; optionally (row_codes and
// row_scales not null) the row-wise copy in the same pass. K % 128 == 0.
void quantize_col(const bf16_t* x, int64_t k, const SegmentBlocks& sb, uint8_t* col_codes,
                  uint8_t* col_scales, uint8_t* row_codes, uint8_t* row_scales,
                  DeviceStatus* status, cudaStream_t stream);
// Weights w [N, K] bf16 -> codes [N, K], scales [N/128][K/128], and (if not null) the exact
// transpose codes [K, N], scales [K/128][N/128]. N, K multiples of 128.
void quantize_weight(const bf16_t* w, int64_t n, int64_t k, uint8_t* codes, uint8_t* scales,
                     uint8_t* t_codes, uint8_t* t_scales, DeviceStatus* status,
                     cudaStream_t stream);

// ---- dequantize -------------------------------------------------------------------------------
// Row-wise FP8 [M, K] -> bf16 [M, K].
void dequantize_row(const uint8_t* codes, const uint8_t* scales, int64_t m, int64_t k, bf16_t* y,
                    cudaStream_t stream);
// MXFP4 [M, K] -> bf16 [M, K] (exact).
void dequantize_mxfp4(const uint8_t* codes, const uint8_t* scales, int64_t m, int64_t k,
                      bf16_t* y, cudaStream_t stream);

// ---- building blocks of the baselines --------------------------------------------------------
// Plain transpose x [M, K] -> y [K, M], bf16.
void transpose_bf16(const bf16_t* x, int64_t m, int64_t k, bf16_t* y, cudaStream_t stream);
// xt [K, M] bf16 (already transposed), quantized along M in the segments' 128-token blocks:
// codes [K, M], scales [max_blocks][K] (the column-wise layout).
void quantize_transposed(const bf16_t* xt, int64_t k, const SegmentBlocks& sb, uint8_t* codes,
                         uint8_t* scales, DeviceStatus* status, cudaStream_t stream);

// ---- FP8 row-wise -> column-wise ----------------------------------------------------------------
// Scaling-aware transpose: row-wise [M, K] -> column-wise [K, M] by exponent shifts only.
// `mode` as in cpu::scaling_aware_transpose: kRowMax (SPEC §4, the tuned kernel) or kColumnAmax
// (each column block's own amax; a separate, untuned kernel).
void scaling_aware_transpose(const uint8_t* row_codes, const uint8_t* row_scales, int64_t k,
                             const SegmentBlocks& sb, uint8_t* col_codes, uint8_t* col_scales,
                             DeviceStatus* status, cudaStream_t stream,
                             TransposeExponent mode = TransposeExponent::kRowMax);
// The naive path users run today (three kernels): dequantize -> transpose -> quantize.
// `work` holds 2*M*K bf16 (two intermediates).
void naive_col_copy(const uint8_t* row_codes, const uint8_t* row_scales, int64_t k,
                    const SegmentBlocks& sb, uint8_t* col_codes, uint8_t* col_scales,
                    bf16_t* work, DeviceStatus* status, cudaStream_t stream);

// ---- MXFP4 ------------------------------------------------------------------------------------
// BF16ToFP4Row: x [M, K] -> packed e2m1 [M, K/2], scales [M][K/32]. K % 32 == 0.
void quantize_mxfp4(const bf16_t* x, int64_t m, int64_t k, uint8_t* codes, uint8_t* scales,
                    DeviceStatus* status, cudaStream_t stream);
// FP4RowToFP8Row: MXFP4 [M, K] -> row-wise FP8 codes [M, K], scales [K/128][M]. K % 128 == 0.
void fp4_to_fp8_row(const uint8_t* fp4_codes, const uint8_t* fp4_scales, int64_t m, int64_t k,
                    uint8_t* codes, uint8_t* scales, DeviceStatus* status, cudaStream_t stream);
// FP4RowToFP8Col: MXFP4 [M, K] -> column-wise FP8 [K, M] in one pass. K % 128 == 0.
void fp4_to_fp8_col(const uint8_t* fp4_codes, const uint8_t* fp4_scales, int64_t k,
                    const SegmentBlocks& sb, uint8_t* col_codes, uint8_t* col_scales,
                    DeviceStatus* status, cudaStream_t stream);
// The stepwise baseline: FP4 -> BF16, transpose, quantize. `work` holds 2*M*K bf16.
void fp4_to_fp8_col_stepwise(const uint8_t* fp4_codes, const uint8_t* fp4_scales, int64_t k,
                             const SegmentBlocks& sb, uint8_t* col_codes, uint8_t* col_scales,
                             bf16_t* work, DeviceStatus* status, cudaStream_t stream);

// ---- FP32-scale mode (the fp8-naive recipe, SPEC §6): E4M3 with FP32 scales s = amax / 448 ----
// Scale rule of a tile with largest finite magnitude amax: s = amax / 448 (FP32 division, RNE),
// s = 1 for an all-zero tile; q = RNE_E4M3(x / s); decoded value e4m3(q) * s. A tile holding a
// non-finite value gets s = NaN and codes 0x7F (counted in status->nonfinite). Kernels:
// src/cuda/convert/fp32_scale.cu.
float fp32_scale(float amax);  // host copy of the rule, for tests
// x [M, C] bf16 -> codes [M, C]; FP32 scales, GEMM-ready: with d_offsets [E+1] (device, offsets[E]
// == M) expert-packed (gemm.h), without (null) the plain [C/128][M] grid. C % 128 == 0.
void quantize_row_fp32_scale(const bf16_t* x, int64_t m, int64_t c, const int32_t* d_offsets,
                             int num_experts, uint8_t* codes, float* scales, DeviceStatus* status,
                             cudaStream_t stream);
// The inverse: codes [M, C] + FP32 scales (same two layouts) -> y [M, C] bf16 (RNE).
void dequantize_row_fp32_scale(const uint8_t* codes, const float* scales, int64_t m, int64_t c,
                               const int32_t* d_offsets, int num_experts, bf16_t* y,
                               cudaStream_t stream);
// xt [C, M] bf16 (already transposed) -> column-wise codes [C, M] and FP32 scales [max_blocks][C]
// over the segments' 128-token blocks (GEMM-ready for wgrad).
void quantize_transposed_fp32_scale(const bf16_t* xt, int64_t c, const SegmentBlocks& sb,
                                    uint8_t* codes, float* scales, DeviceStatus* status,
                                    cudaStream_t stream);
// E weights w [E][N][K] bf16 -> codes [E][N][K], GEMM-ready FP32 block scales
// [E][N/128][round_up(K/128, 4)], and the exact transpose: t_codes [E][K][N], t_scales
// [E][K/128][round_up(N/128, 4)] (padding entries 0).
void quantize_weights_fp32_scale(const bf16_t* w, int num_experts, int64_t n, int64_t k,
                                 uint8_t* codes, float* scales, uint8_t* t_codes, float* t_scales,
                                 DeviceStatus* status, cudaStream_t stream);

}  // namespace cuda
}  // namespace flowmoe
