// CPU reference of every conversion (SPEC §2-§4). Plain loops, written to be read: these
// functions are the specification the CUDA kernels are tested against bit for bit.
//
// Inputs are row-major. `x` is FP32 or BF16 (flowmoe::bf16_t bits). Every function checks its
// arguments and throws flowmoe::Error with a message saying what was wrong and what was expected.
// Non-finite input never throws here: it is counted in the returned QuantStats and its tile is
// marked NaN (scale 0xFF); call throw_if_nonfinite() to turn it into an error.
#pragma once

#include <cstdint>
#include <vector>

#include "flowmoe/tensor.h"

namespace flowmoe {
namespace cpu {

// ---- FP8 quantize ----------------------------------------------------------------------------
// x [M, K] -> row-wise 1x128. K must be a multiple of 128; M >= 0.
QuantStats quantize_row(const float* x, int64_t m, int64_t k, QTensor* out);
QuantStats quantize_row(const bf16_t* x, int64_t m, int64_t k, QTensor* out);
// x [M, K] -> column-wise 128x1 over token segments (Segments::whole(M) for one segment).
QuantStats quantize_col(const float* x, int64_t m, int64_t k, const Segments& seg, QTensor* out);
QuantStats quantize_col(const bf16_t* x, int64_t m, int64_t k, const Segments& seg, QTensor* out);
// Both copies from the same high-precision input (the `blockwise` recipe).
QuantStats quantize_both(const bf16_t* x, int64_t m, int64_t k, const Segments& seg,
                         QTensor* row, QTensor* col);
// Weights w [N, K] -> 128x128 blocks; N and K multiples of 128. `wt` (may be null) receives
// the exact transpose [K, N] (codes and scale grid transposed; no re-rounding).
QuantStats quantize_weight(const float* w, int64_t n, int64_t k, QTensor* out, QTensor* wt);
QuantStats quantize_weight(const bf16_t* w, int64_t n, int64_t k, QTensor* out, QTensor* wt);
// Exact transpose of a 128x128-block weight.
void transpose_weight(const QTensor& w, QTensor* wt);

// ---- dequantize --------------------------------------------------------------------------------
// Any layout -> its logical [rows, cols] matrix (column-wise tensors come back as [M, K] too;
// weights as [N, K]). Exact in FP32. The BF16 variant rounds to nearest even.
void dequantize(const QTensor& q, float* out);
void dequantize(const QTensor& q, bf16_t* out);

// ---- FP8 row-wise -> column-wise ----------------------------------------------------------------
// The naive path users run today: dequantize to BF16, transpose, quantize with fresh scales.
QuantStats naive_col_copy(const QTensor& row, const Segments& seg, QTensor* col);
// Scaling-aware transpose (SPEC §4): per (feature, token block) the target exponent is the
// maximum row exponent of the block; each code is re-encoded as RNE(q * 2^(e_row - E)).
// Exact except elements pushed below the E4M3 normal range, rounded to nearest even into the
// subnormals and counted in QuantStats::underflow.
// How the scaling-aware transpose picks each (feature, token block) exponent E:
//   kRowMax      E = max of the block's row exponents (SPEC §4; never shifts a code up).
//   kColumnAmax  E = the fresh power-of-two scale of the column block's own amax, computed in the
//                FP8 domain: 2^ceil(log2(amax / 448)). Codes shift up or down; the result equals
//                the naive dequantize -> transpose -> quantize path bit for bit (when the
//                dequantized values are BF16-exact, i.e. away from 2^-126), still in one FP8
//                pass, and it underflows fewer values than kRowMax on outlier-heavy data.
using flowmoe::TransposeExponent;  // defined in tensor.h (cpu:: alias there), shared with CUDA
QuantStats scaling_aware_transpose(const QTensor& row, const Segments& seg, QTensor* col,
                                   TransposeExponent mode = TransposeExponent::kRowMax);

// ---- MXFP4 ------------------------------------------------------------------------------------
// x [M, K] -> MXFP4 row-wise 1x32. K must be a multiple of 32.
QuantStats quantize_mxfp4(const float* x, int64_t m, int64_t k, QTensor* out);
QuantStats quantize_mxfp4(const bf16_t* x, int64_t m, int64_t k, QTensor* out);
// FP4RowToFP8Row: four 1x32 blocks -> one 1x128 tile with exponent max_j(e_j) - 6 (>= -127).
// Exact when the blocks' exponent spread is <= 14; beyond, RNE into subnormals, counted.
// K must be a multiple of 128.
QuantStats fp4_to_fp8_row(const QTensor& fp4, QTensor* row);
// FP4RowToFP8Col: MXFP4 row-wise [M, K] -> FP8 column-wise [K, M] in one pass; per (feature,
// token block) exponent by `mode`:
//   kRowMax      max_t(e_t) - 6 over the block's MXFP4 scales (>= code 0). Same exactness as above.
//   kColumnAmax  the fresh power-of-two scale of the column block's own amax, as for the FP8
//                transpose: equals fp4_to_fp8_col_stepwise bit for bit (where the dequantized
//                values are finite), never above the kRowMax exponent, so it underflows only
//                what the stepwise path loses.
QuantStats fp4_to_fp8_col(const QTensor& fp4, const Segments& seg, QTensor* col,
                          TransposeExponent mode = TransposeExponent::kRowMax);
// The stepwise baseline: FP4 -> BF16 (exact), transpose, quantize with fresh scales.
QuantStats fp4_to_fp8_col_stepwise(const QTensor& fp4, const Segments& seg, QTensor* col);


// ---- FP8 with FP32 scales (the scaling mode of the fp8-naive recipe) ----------------------------
// DeepSeek-V3-style FP8: each tile's scale is s = amax / 448 in FP32 (not a power of two) and
// q = RNE_E4M3(x / s) with the FP32 quotient. The layouts and scale grids are QTensor's (row-wise
// 1x128 scales [K/128][M], column-wise 128x1 over segments scales [NB][K], 128x128 weights scales
// [N/128][K/128]) with FP32 scales. Because the scales are not powers of two, a column copy made
// by dequantize -> transpose -> quantize rounds a second time (double quantization), which the
// power-of-two scales of QTensor avoid (docs/NUMERICS.md §8). An all-zero tile gets s = 1; a tile
// holding a non-finite value gets s = NaN and codes 0x7F (counted in QuantStats::nonfinite).
struct QTensorF32 {
  Layout layout = Layout::kRow1x128;  // kRow1x128, kCol128x1 or kWeight128x128
  int64_t rows = 0, cols = 0;         // the logical source shape, as QTensor
  std::vector<uint8_t> codes;         // e4m3, as QTensor
  std::vector<float> scales;          // FP32, on QTensor's scale grid
  Segments segments;                  // kCol128x1 only
  int64_t bytes() const { return static_cast<int64_t>(codes.size() + 4 * scales.size()); }
};
// x [M, K] bf16 -> row-wise 1x128 with FP32 scales. K must be a multiple of 128.
QuantStats quantize_row_fp32_scale(const bf16_t* x, int64_t m, int64_t k, QTensorF32* out);
// x [M, K] bf16 -> column-wise 128x1 over the segments with FP32 scales (codes [K, M]).
QuantStats quantize_col_fp32_scale(const bf16_t* x, int64_t m, int64_t k, const Segments& seg,
                                   QTensorF32* out);
// w [N, K] bf16 -> 128x128 blocks with FP32 scales; `wt` (may be null) receives the exact
// transpose [K, N] (codes and scale grid transposed, no re-rounding).
QuantStats quantize_weight_fp32_scale(const bf16_t* w, int64_t n, int64_t k, QTensorF32* out,
                                      QTensorF32* wt);
// One element: NaN when the code or the scale is NaN, else e4m3(code) * scale in FP32.
float dequantize_fp32_scale(uint8_t code, float scale);
// Row-wise or column-wise -> the logical [rows, cols] matrix (column-wise comes back as [M, K]).
// The BF16 variant rounds to nearest even (NaN as 0x7FC0).
void dequantize(const QTensorF32& q, float* out);
void dequantize(const QTensorF32& q, bf16_t* out);
// The fp8-naive column copy: dequantize to BF16, transpose, quantize with fresh FP32 scales.
QuantStats naive_col_copy(const QTensorF32& row, const Segments& seg, QTensorF32* col);

}  // namespace cpu
}  // namespace flowmoe
