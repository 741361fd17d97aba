// The exact transpose of 128x128-block FP8 weights (flowmoe/gemm.h transpose_weight_blocks): the
// dgrad operand W^T derived from the fprop operand W. A 128x128 block shares one scale, so its
// transpose is the same codes transposed under the same scale: the bits quantize_weight writes for
// the transpose of the BF16 weight (SPEC: "exact transpose" of a 128x128 block). The caller-memory
// layer derives W^T this way in the backward instead of keeping it from set_weights (moe.h
// CudaLayerOptions::caller_memory).
#include <algorithm>

#include "cuda/common.cuh"
#include "cuda/convert/tile.cuh"
#include "flowmoe/cuda/qtensor_view.h"
#include "flowmoe/gemm.h"

namespace flowmoe {
namespace cuda {
namespace {

constexpr int kThreads = 256;
constexpr int kTile = detail::kTile;  // one 128x128 block per CTA

// The position of an expert's natural 128-row block r (gate blocks, then up blocks) in the order
// interleave_gate_up writes (gate 0, up 0, gate 1, up 1, ...); nb blocks per expert.
__device__ __forceinline__ int64_t interleaved_block(int64_t r, int64_t nb) {
  return r < nb / 2 ? 2 * r : 2 * (r - nb / 2) + 1;
}

// CTA (bk, bn, e): block (bn, bk) of W_e [n, k] becomes block (bk, bn) of Wt_e [k, n], through
// the conversion kernels' byte-tile transpose (convert/tile.cuh store_col_tile: a W row is a
// "token", a W column a "feature").
template <typename Scale>
__global__ void __launch_bounds__(kThreads)
transpose_weight_blocks_kernel(const uint8_t* __restrict__ codes, const Scale* __restrict__ scales, int64_t n,
                               int64_t k, int64_t scale_ld, uint8_t* __restrict__ t_codes, Scale* __restrict__ t_scales,
                               int64_t t_scale_ld, bool interleaved) {
  __shared__ __align__(16) uint8_t tile[kTile * detail::kBytePitch];
  const int64_t bk = blockIdx.x, bn = blockIdx.y, e = blockIdx.z;
  const int64_t nb = n / kTile;
  const int64_t src_bn = interleaved ? interleaved_block(bn, nb) : bn;
  const uint8_t* src = codes + e * n * k + src_bn * kTile * k + bk * kTile;
  for (int i = threadIdx.x; i < kTile * 8; i += kThreads) {  // 128 rows of 8 x 16 bytes
    const int r = i / 8, c = i % 8;
    *reinterpret_cast<uint4*>(tile + r * detail::kBytePitch + c * 16) =
        *reinterpret_cast<const uint4*>(src + int64_t(r) * k + c * 16);
  }
  __syncthreads();
  detail::store_col_tile(tile, kTile, t_codes + e * k * n + bk * kTile * n + bn * kTile, n, /*vec=*/true);

  // the block's scale, and (first column block of Wt) the padding of Wt's scale row
  if (threadIdx.x == 0) t_scales[(e * (k / kTile) + bk) * t_scale_ld + bn] = scales[(e * nb + src_bn) * scale_ld + bk];
  if (bn == 0)
    for (int64_t p = nb + threadIdx.x; p < t_scale_ld; p += kThreads) t_scales[(e * (k / kTile) + bk) * t_scale_ld + p] = Scale(0);
}

}  // namespace

void transpose_weight_blocks(const QTensorView& w, const QTensorView& wt, bool gate_up_interleaved,
                             cudaStream_t stream) {
  const char* what = "transpose_weight_blocks";
  check_view(w, Layout::kWeight128x128, w.scale_format, what);
  check_view(wt, Layout::kWeight128x128, w.scale_format, what);
  const int E = w.num_segments;
  FLOWMOE_CHECK(E >= 1 && wt.num_segments == E && w.rows % E == 0,
                what << ": w holds " << w.num_segments << " experts in " << w.rows << " rows and wt "
                     << wt.num_segments << "; expected the same number of experts (at least 1) in both");
  const int64_t n = w.rows / E, k = w.cols;
  FLOWMOE_CHECK(wt.rows == int64_t(E) * k && wt.cols == n,
                what << ": wt is [" << wt.rows << ", " << wt.cols << "] for " << E << " experts of w [" << n << ", "
                     << k << "]; expected [" << int64_t(E) * k << ", " << n << "] (each expert's transpose)");
  FLOWMOE_CHECK(n % kFp8Block == 0 && k % kFp8Block == 0 && (!gate_up_interleaved || n % (2 * kFp8Block) == 0),
                what << ": w is [" << n << ", " << k << "] per expert; expected multiples of 128"
                     << (gate_up_interleaved ? " (rows: of 256, gate and up blocks)" : ""));
  FLOWMOE_CHECK(n / kFp8Block <= 65535, what << ": " << n / kFp8Block << " row blocks per expert; at most 65535");
  FLOWMOE_CHECK(wt.scale_ld >= n / kFp8Block && w.scale_ld >= k / kFp8Block,
                what << ": scale rows of " << w.scale_ld << " (w) and " << wt.scale_ld << " (wt) entries; expected at least "
                     << k / kFp8Block << " and " << n / kFp8Block);
  const size_t code_bytes = size_t(w.rows) * size_t(w.cols);
  const uint8_t *a = w.codes, *b = wt.codes;
  FLOWMOE_CHECK(a + code_bytes <= b || b + code_bytes <= a, what << ": wt overlaps w; expected separate buffers");
  FLOWMOE_CHECK(detail::aligned16(w.codes) && detail::aligned16(wt.codes), what << ": the codes must be 16-byte aligned");
  const dim3 grid(unsigned(k / kFp8Block), unsigned(n / kFp8Block), unsigned(E));
  if (w.scale_format == ScaleFormat::kF32)
    transpose_weight_blocks_kernel<float><<<grid, kThreads, 0, stream>>>(
        w.codes, w.f32(), n, k, w.scale_ld, wt.codes, wt.f32(), wt.scale_ld, gate_up_interleaved);
  else
    transpose_weight_blocks_kernel<uint8_t><<<grid, kThreads, 0, stream>>>(
        w.codes, w.ue8m0(), n, k, w.scale_ld, wt.codes, wt.ue8m0(), wt.scale_ld, gate_up_interleaved);
  FLOWMOE_LAUNCH_CHECK(what);
}

}  // namespace cuda
}  // namespace flowmoe
