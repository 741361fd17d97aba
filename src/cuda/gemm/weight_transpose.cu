// The exact transpose of 128x128-block FP8 weights (flowmoe/gemm.h transpose_weight_blocks): the
// dgrad operand W^T derived from the fprop operand W. A 128x128 block shares one scale, so its
// transpose is the same codes transposed under the same scale: the bits quantize_weight writes for
// the transpose of the BF16 weight (SPEC: "exact transpose" of a 128x128 block). The caller-memory
// layer derives W^T this way in the backward instead of keeping it from set_weights (moe.h
// CudaLayerOptions::caller_memory).
#include <algorithm>

#include "cuda/common.cuh"
#include "flowmoe/cuda/qtensor_view.h"
#include "flowmoe/gemm.h"

namespace flowmoe {
namespace cuda {
namespace {

constexpr int kThreads = 256;
constexpr int kTile = kFp8Block;      // one 128x128 block per CTA
constexpr int kPitchWords = kTile / 4 + 1;  // shared-memory row: 33 words (conflict-free, see below)

// The position of an expert's natural 128-row block r (gate blocks, then up blocks) in the order
// interleave_gate_up writes (gate 0, up 0, gate 1, up 1, ...); nb blocks per expert.
__device__ __forceinline__ int64_t interleaved_block(int64_t r, int64_t nb) {
  return r < nb / 2 ? 2 * r : 2 * (r - nb / 2) + 1;
}

// CTA (bk, bn, e): block (bn, bk) of W_e [n, k] becomes block (bk, bn) of Wt_e [k, n]. The tile
// goes through shared memory as 32-bit words; each thread turns a 4x4 byte square around with
// byte permutes: it reads tile rows 4g..4g+3 at word c and writes Wt rows 4c..4c+3 at word g.
// A warp covers 8 row groups x 4 word columns: with 33-word rows the 32 reads of a step fall in 32
// distinct banks, and each Wt row gets 8 consecutive words (one 32-byte sector) per warp.
template <typename Scale>
__global__ void __launch_bounds__(kThreads)
transpose_weight_blocks_kernel(const uint8_t* __restrict__ codes, const Scale* __restrict__ scales, int64_t n,
                               int64_t k, int64_t scale_ld, uint8_t* __restrict__ t_codes, Scale* __restrict__ t_scales,
                               int64_t t_scale_ld, bool interleaved) {
  __shared__ uint32_t tile[kTile * kPitchWords];
  const int64_t bk = blockIdx.x, bn = blockIdx.y, e = blockIdx.z;
  const int64_t nb = n / kTile;
  const int64_t src_bn = interleaved ? interleaved_block(bn, nb) : bn;
  const uint8_t* src = codes + e * n * k + src_bn * kTile * k + bk * kTile;
  uint8_t* dst = t_codes + e * k * n + bk * kTile * n + bn * kTile;

  // load: 128 rows of 8 x 16 bytes
  for (int i = threadIdx.x; i < kTile * 8; i += kThreads) {
    const int r = i / 8, c = i % 8;
    const uint4 v = *reinterpret_cast<const uint4*>(src + int64_t(r) * k + c * 16);
    uint32_t* row = tile + r * kPitchWords + c * 4;
    row[0] = v.x, row[1] = v.y, row[2] = v.z, row[3] = v.w;
  }
  __syncthreads();

  const int warp = threadIdx.x / 32, lane = threadIdx.x % 32;
  const int g = lane % 8 + 8 * (warp % 4);  // tile row group: rows 4g..4g+3 (Wt word g)
#pragma unroll
  for (int it = 0; it < 4; ++it) {
    const int c = lane / 8 + 4 * (warp / 4) + 8 * it;  // tile word c: Wt rows 4c..4c+3
    const uint32_t r0 = tile[(4 * g + 0) * kPitchWords + c], r1 = tile[(4 * g + 1) * kPitchWords + c];
    const uint32_t r2 = tile[(4 * g + 2) * kPitchWords + c], r3 = tile[(4 * g + 3) * kPitchWords + c];
    // byte j of word rq is W[4g+q][4c+j]; Wt row 4c+j, bytes 4g..4g+3 = (r0.j, r1.j, r2.j, r3.j)
    const uint32_t lo01 = __byte_perm(r0, r1, 0x5140), hi01 = __byte_perm(r0, r1, 0x7362);
    const uint32_t lo23 = __byte_perm(r2, r3, 0x5140), hi23 = __byte_perm(r2, r3, 0x7362);
    const uint32_t out[4] = {__byte_perm(lo01, lo23, 0x5410), __byte_perm(lo01, lo23, 0x7632),
                             __byte_perm(hi01, hi23, 0x5410), __byte_perm(hi01, hi23, 0x7632)};
#pragma unroll
    for (int j = 0; j < 4; ++j) *reinterpret_cast<uint32_t*>(dst + int64_t(4 * c + j) * n + 4 * g) = out[j];
  }

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
