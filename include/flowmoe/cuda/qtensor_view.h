// The device view of a quantized tensor: the one form in which a quantized tensor in device memory
// is passed between the CUDA modules (convert, token, swiglu, gemm) and the MoE layer.
//
// A view owns nothing. It names the codes and the scales of one tensor in one of the layouts of
// flowmoe/tensor.h (the host-owning QTensor describes the same layouts), the element format, the
// format of the scales, the logical shape, the scale grid's extent and, for the layouts that follow
// the per-expert token segments, the segment offsets on the device.
//
// Scale formats:
//   kUe8m0  one byte per scale, the SPEC layouts of flowmoe/tensor.h:
//             kRow1x128       [cols/128][scale_ld], scale_ld >= rows (token-contiguous)
//             kCol128x1       [scale_rows][cols], scale_rows = token blocks over the segments
//                             (a capacity, e.g. segment_max_blocks(M, E), is fine)
//             kWeight128x128  [rows/128][cols/128]; E experts' weights stacked: rows = E * N
//             kMxfp4Row1x32   [rows][cols/32]
//   kF32    binary32 scales in the GEMM-ready layouts of flowmoe/gemm.h, which the GEMMs read and
//           the fp8-naive recipe's FP32-scale casts write directly:
//             kRow1x128       expert-packed over the segments (rows * cols/128 floats)
//             kCol128x1       [scale_rows][cols], as the UE8M0 grid
//             kWeight128x128  [rows/128][round_up(cols/128, 4)] (E experts stacked: rows = E * N)
//
// Mutability: the pointers are not const so that one type serves inputs and outputs; a function
// that takes a view as input only reads through it (its documentation says which views it writes).
//
// Plain data: no CUDA header is needed to build one (host code describes device buffers with it).
#pragma once

#include <cstdint>

#include "flowmoe/error.h"
#include "flowmoe/tensor.h"

namespace flowmoe {
namespace cuda {

enum class ElemFormat : uint8_t { kE4m3, kMxfp4E2m1 };
enum class ScaleFormat : uint8_t { kUe8m0, kF32 };
const char* elem_format_name(ElemFormat f);    // "e4m3", "mxfp4 e2m1"
const char* scale_format_name(ScaleFormat f);  // "ue8m0", "fp32"

struct QTensorView {
  uint8_t* codes = nullptr;  // E4M3 bytes [rows, cols] (kCol128x1: [cols, rows]) or packed E2M1
                             // [rows, cols/2] (element 2i in the low nibble)
  void* scales = nullptr;    // uint8_t (kUe8m0) or float (kF32), see scale_format
  Layout layout = Layout::kRow1x128;
  ElemFormat elem = ElemFormat::kE4m3;
  ScaleFormat scale_format = ScaleFormat::kUe8m0;
  int64_t rows = 0;        // as QTensor::rows: tokens M of an activation, rows of a weight
  int64_t cols = 0;        // as QTensor::cols: features K
  int64_t scale_rows = 0;  // outer extent of the scale grid (see the table above)
  int64_t scale_ld = 0;    // elements from one scale row to the next
  const int32_t* offsets = nullptr;  // [num_segments + 1] token offsets (device), or null: the
                                     // segments of kCol128x1 and of expert-packed kF32 scales
  int num_segments = 0;              // E of `offsets`; kWeight128x128: the stacked experts

  uint8_t* ue8m0() const { return static_cast<uint8_t*>(scales); }
  float* f32() const { return static_cast<float*>(scales); }
  // Sizes in elements (bytes for codes).
  int64_t code_bytes() const { return elem == ElemFormat::kMxfp4E2m1 ? rows * (cols / 2) : rows * cols; }
  int64_t scale_elems() const { return scale_rows * scale_ld; }
  int64_t scale_bytes() const {
    return scale_elems() * (scale_format == ScaleFormat::kF32 ? int64_t(4) : int64_t(1));
  }
};

// Throws flowmoe::Error (naming `what`) unless `v` has the given layout and scale format, an
// element format that matches the layout, a positive shape that the layout's tiles divide,
// non-null pointers and a scale grid at least as large as the layout needs.
void check_view(const QTensorView& v, Layout layout, ScaleFormat scales, const char* what);

// ---- builders, one per layout (UE8M0 scales unless the name says f32) ----------------------------
// Row-wise 1x128: codes [m, k], scales [k/128][scale_ld] (scale_ld = m unless given).
inline QTensorView row_1x128(uint8_t* codes, uint8_t* scales, int64_t m, int64_t k,
                             int64_t scale_ld = -1) {
  QTensorView v;
  v.codes = codes;
  v.scales = scales;
  v.layout = Layout::kRow1x128;
  v.rows = m;
  v.cols = k;
  v.scale_rows = k / kFp8Block;
  v.scale_ld = scale_ld < 0 ? m : scale_ld;
  return v;
}
// Column-wise 128x1 over segments: codes [k, m], scales [max_blocks][k]; offsets [E+1] on the
// device (may be null where the consumer takes the segments separately, e.g. a SegmentBlocks).
inline QTensorView col_128x1(uint8_t* codes, uint8_t* scales, int64_t m, int64_t k,
                             int64_t max_blocks, const int32_t* offsets = nullptr,
                             int num_segments = 0) {
  QTensorView v;
  v.codes = codes;
  v.scales = scales;
  v.layout = Layout::kCol128x1;
  v.rows = m;
  v.cols = k;
  v.scale_rows = max_blocks;
  v.scale_ld = k;
  v.offsets = offsets;
  v.num_segments = num_segments;
  return v;
}
// 128x128 weights: `experts` weights [n, k] stacked, codes [experts * n, k],
// scales [experts * n/128][k/128].
inline QTensorView weight_128x128(uint8_t* codes, uint8_t* scales, int experts, int64_t n,
                                  int64_t k) {
  QTensorView v;
  v.codes = codes;
  v.scales = scales;
  v.layout = Layout::kWeight128x128;
  v.rows = int64_t(experts) * n;
  v.cols = k;
  v.scale_rows = v.rows / kFp8Block;
  v.scale_ld = k / kFp8Block;
  v.num_segments = experts;
  return v;
}
// MXFP4 1x32: codes [m, k/2] packed e2m1, scales [m][k/32].
inline QTensorView mxfp4_1x32(uint8_t* codes, uint8_t* scales, int64_t m, int64_t k) {
  QTensorView v;
  v.codes = codes;
  v.scales = scales;
  v.layout = Layout::kMxfp4Row1x32;
  v.elem = ElemFormat::kMxfp4E2m1;
  v.rows = m;
  v.cols = k;
  v.scale_rows = m;
  v.scale_ld = k / kFp4Block;
  return v;
}
// GEMM-ready FP32 scales (flowmoe/gemm.h). Row-wise activation [m, k], expert-packed over the
// segments `offsets` [E+1] (device; may be null where the consumer takes them separately).
inline QTensorView row_1x128_f32(uint8_t* codes, float* scales, int64_t m, int64_t k,
                                 const int32_t* offsets = nullptr, int num_segments = 0) {
  QTensorView v = row_1x128(codes, nullptr, m, k);
  v.scales = scales;
  v.scale_format = ScaleFormat::kF32;
  v.offsets = offsets;
  v.num_segments = num_segments;
  return v;
}
// Column-wise [k over m], FP32 scales [num_blocks][k].
inline QTensorView col_128x1_f32(uint8_t* codes, float* scales, int64_t m, int64_t k,
                                 int64_t num_blocks) {
  QTensorView v = col_128x1(codes, nullptr, m, k, num_blocks);
  v.scales = scales;
  v.scale_format = ScaleFormat::kF32;
  return v;
}
// `experts` weights [n, k], FP32 scales [experts][n/128][round_up(k/128, 4)].
inline QTensorView weight_128x128_f32(uint8_t* codes, float* scales, int experts, int64_t n,
                                      int64_t k) {
  QTensorView v = weight_128x128(codes, nullptr, experts, n, k);
  v.scales = scales;
  v.scale_format = ScaleFormat::kF32;
  v.scale_ld = (k / kFp8Block + 3) / 4 * 4;
  return v;
}


// ---- the expert segments as 128-token blocks (the column-wise views' blocks) -------------------------
// Per-expert token segments resolved on the device into 128-token blocks, without a host sync.
// Sized for at most `max_blocks` = ceil(M/128) + E blocks; blocks past the real count are empty.
struct SegmentBlocks {
  const int32_t* offsets = nullptr;  // [E+1] token offsets (device)
  int num_segments = 0;              // E
  int64_t m = 0;                     // tokens (offsets[E] must equal m, or not exceed it: capacity)
  int64_t max_blocks = 0;            // ceil(M/128) + E
  int32_t* block_start = nullptr;    // [max_blocks] first token of each block (-1: no block)
  int32_t* block_end = nullptr;      // [max_blocks] one past its last token
  int32_t* block_offsets = nullptr;  // [E+1] first block of each segment; [E] = number of blocks
  // m is a capacity (the buffers' rows) and offsets[E] <= m the rows in use, a count the host has
  // not fetched: rows past offsets[E] belong to no block (the column-wise kernels skip them).
  bool capacity = false;
};
int64_t segment_max_blocks(int64_t m, int num_segments);

// ---- the views' host checks, shared by the operators' view wrappers (convert.h, swiglu.h) ----------
namespace view_detail {
inline void check_row(const QTensorView& v, const char* what) {
  check_view(v, Layout::kRow1x128, ScaleFormat::kUe8m0, what);
  FLOWMOE_CHECK(v.scale_ld == v.rows, what << ": row-wise scale_ld = " << v.scale_ld
                                           << "; expected the tight grid, scale_ld = rows = "
                                           << v.rows);
}
inline void check_col(const QTensorView& v, const SegmentBlocks& sb, int64_t k, const char* what) {
  check_view(v, Layout::kCol128x1, ScaleFormat::kUe8m0, what);
  FLOWMOE_CHECK(v.rows == sb.m && v.cols == k && v.scale_rows >= sb.max_blocks,
                what << ": column-wise view [" << v.rows << ", " << v.cols << "] with "
                     << v.scale_rows << " scale rows; expected [" << sb.m << ", " << k
                     << "] (the segments' tokens) with at least " << sb.max_blocks);
  FLOWMOE_CHECK(v.offsets == nullptr || v.offsets == sb.offsets,
                what << ": the view's segment offsets are not those of the SegmentBlocks");
}
inline void check_same_shape(const QTensorView& a, const QTensorView& b, const char* what) {
  FLOWMOE_CHECK(a.rows == b.rows && a.cols == b.cols,
                what << ": views of [" << a.rows << ", " << a.cols << "] and [" << b.rows << ", "
                     << b.cols << "]; expected the same shape");
}
}  // namespace view_detail

}  // namespace cuda
}  // namespace flowmoe
