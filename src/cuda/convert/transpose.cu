// Row-wise FP8 -> column-wise FP8: the scaling-aware transpose (exponent shifts only) and the
// naive dequantize -> transpose -> quantize path it replaces.
#include "cuda/convert/tile.cuh"
#include "flowmoe/cuda/convert.h"

namespace flowmoe {
namespace cuda {
namespace {

using namespace flowmoe::num;
using namespace detail::host;
using detail::kBytePitch;
using detail::kThreads;
using detail::kTile;

// Rescales the 4 codes of a word by shift_down, counting lost values.
__device__ __forceinline__ uint32_t rescale4(uint32_t w, int d, int& lost) {
  if (d == 0) return w;
  uint32_t out = 0;
#pragma unroll
  for (int i = 0; i < 4; ++i) {
    bool l = false;
    out |= static_cast<uint32_t>(e4m3_rescale_fast(static_cast<uint8_t>(w >> (8 * i)), d, &l)) << (8 * i);
    lost += l;
  }
  return out;
}

// One CTA per (128-token block, 128-feature tile). The target exponent of every column of the
// tile is the maximum row exponent of the block (all columns of a K tile share the row scales).
__global__ void __launch_bounds__(kThreads)
scaling_aware_transpose_kernel(const uint8_t* __restrict__ row_codes, const uint8_t* __restrict__ row_scales,
                               int64_t m, int64_t k, const int32_t* __restrict__ bstart,
                               const int32_t* __restrict__ bend, uint8_t* __restrict__ col_codes,
                               uint8_t* __restrict__ col_scales, DeviceStatus* status) {
  __shared__ __align__(16) uint8_t s_q[kTile * kBytePitch];
  __shared__ uint8_t s_e[kTile];
  __shared__ int s_max, s_bad;
  const int64_t b = blockIdx.x, kt = blockIdx.y;
  const int bs = bstart[b];
  if (bs < 0) return;
  const int n = bend[b] - bs;
  const int tid = threadIdx.x;
  if (tid == 0) {
    s_max = 0;
    s_bad = 0;
  }
  __syncthreads();
  if (tid < kTile) {
    const uint8_t e = tid < n ? row_scales[kt * m + bs + tid] : 0;
    s_e[tid] = e;
    if (e == kUE8M0NaN) atomicAdd(&s_bad, 1);
    else if (e > 0) atomicMax(&s_max, static_cast<int>(e));
  }
  __syncthreads();
  const int emax = s_max, nbad = s_bad;

  // Row pass: 4 chunks of 16 codes per thread, shifted by (emax - e_row) into the byte tile.
  int lost = 0;
#pragma unroll
  for (int i = 0; i < 4; ++i) {
    const int c = i * kThreads + tid;
    const int row = c >> 3, ch = c & 7;
    uint4 v = make_uint4(0, 0, 0, 0);
    if (row < n) {
      v = __ldg(reinterpret_cast<const uint4*>(row_codes + (bs + row) * k + kt * kTile) + ch);
      if (nbad) {
        v = make_uint4(0x7F7F7F7Fu, 0x7F7F7F7Fu, 0x7F7F7F7Fu, 0x7F7F7F7Fu);
      } else {
        const int d = emax - s_e[row];
        v.x = rescale4(v.x, d, lost);
        v.y = rescale4(v.y, d, lost);
        v.z = rescale4(v.z, d, lost);
        v.w = rescale4(v.w, d, lost);
      }
    }
    *reinterpret_cast<uint4*>(&s_q[row * kBytePitch + ch * 16]) = v;
  }
  detail::warp_count(status ? &status->underflow : nullptr, lost);
  if (tid < kTile) col_scales[b * k + kt * kTile + tid] = nbad ? kUE8M0NaN : static_cast<uint8_t>(emax);
  if (tid == 0 && nbad && status) atomicAdd(&status->nonfinite, static_cast<unsigned long long>(nbad) * kTile);
  __syncthreads();
  detail::store_col_tile(s_q, n, col_codes + (kt * kTile) * m + bs, m, (m % 16 == 0) && (bs % 16 == 0));
}

}  // namespace

void scaling_aware_transpose(const uint8_t* row_codes, const uint8_t* row_scales, int64_t k,
                             const SegmentBlocks& sb, uint8_t* col_codes, uint8_t* col_scales,
                             DeviceStatus* status, cudaStream_t stream) {
  const char* what = "cuda::scaling_aware_transpose";
  check_k(k, kTile, what);
  check_blocks(sb, what);
  if (sb.m == 0) return;
  check_aligned(row_codes, "row_codes", what);
  check_aligned(col_codes, "col_codes", what);
  FLOWMOE_CHECK(row_scales && col_scales, what << ": row_scales or col_scales is null");
  dim3 grid(static_cast<unsigned>(sb.max_blocks), static_cast<unsigned>(k / kTile));
  scaling_aware_transpose_kernel<<<grid, kThreads, 0, stream>>>(
      row_codes, row_scales, sb.m, k, sb.block_start, sb.block_end, col_codes, col_scales, status);
  FLOWMOE_LAUNCH_CHECK(what);
}

void naive_col_copy(const uint8_t* row_codes, const uint8_t* row_scales, int64_t k,
                    const SegmentBlocks& sb, uint8_t* col_codes, uint8_t* col_scales,
                    bf16_t* work, DeviceStatus* status, cudaStream_t stream) {
  const char* what = "cuda::naive_col_copy";
  check_k(k, kTile, what);
  check_blocks(sb, what);
  if (sb.m == 0) return;
  check_aligned(work, "work", what);
  bf16_t* x = work;                // [M, K] dequantized
  bf16_t* xt = work + sb.m * k;    // [K, M] transposed
  dequantize_row(row_codes, row_scales, sb.m, k, x, stream);
  transpose_bf16(x, sb.m, k, xt, stream);
  quantize_transposed(xt, k, sb, col_codes, col_scales, status, stream);
}

}  // namespace cuda
}  // namespace flowmoe
