// Row-wise FP8 -> column-wise FP8: the scaling-aware transpose (exponent shifts only) and the
// naive dequantize -> transpose -> quantize path it replaces.
#include <algorithm>

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

// Byte-by-byte rescale through the numerics core; rare (zeros, NaN codes, values that leave the
// normal range). Kept out of line so that the hot loop stays small in the instruction cache.
__device__ __noinline__ uint32_t rescale4_slow(uint32_t w, int d, int& lost) {
  uint32_t out = 0;
  for (int i = 0; i < 4; ++i) {
    bool l = false;
    out |= static_cast<uint32_t>(e4m3_rescale_fast(static_cast<uint8_t>(w >> (8 * i)), d, &l)) << (8 * i);
    lost += l;
  }
  return out;
}

// Rescales the 4 codes of a word by shift_down d, counting lost values. SWAR fast path: when
// every byte keeps an exponent field >= 1 (and none is NaN) the shift only subtracts d from
// each exponent field; otherwise byte by byte through the numerics core.
__device__ __forceinline__ uint32_t rescale4(uint32_t w, int d, int& lost) {
  if (d == 0) return w;
  if (d < 15) {
    const uint32_t ef = (w >> 3) & 0x0F0F0F0Fu;
    const uint32_t ge = (ef + 0x01010101u * static_cast<uint32_t>(15 - d)) & 0x10101010u;  // ef >= d+1
    const uint32_t nan = (w & 0x7F7F7F7Fu) ^ 0x7F7F7F7Fu;                                  // 0 byte: NaN
    const bool has_nan = ((nan - 0x01010101u) & ~nan & 0x80808080u) != 0;
    if (ge == 0x10101010u && !has_nan) return w - 0x01010101u * (static_cast<uint32_t>(d) << 3);
  }
  return rescale4_slow(w, d, lost);
}

// A tile is (128-token block b, 128-feature tile kt), numbered with b fastest. The target
// exponent of every column of a tile is the maximum row exponent of the block (all columns of a
// K tile share the row scales).
struct AwareTile {
  uint4 v[4];      // this thread's 4 chunks of 16 codes
  uint32_t e = 0;  // row exponent of token tid (tid < 128)
  int bs = -1, n = 0;
  int64_t b = 0, kt = 0;
};

__device__ __forceinline__ void load_aware_tile(AwareTile& t, int64_t tile, int64_t num_tiles, int64_t max_blocks,
                                                const uint8_t* __restrict__ row_codes,
                                                const uint8_t* __restrict__ row_scales, int64_t m, int64_t k,
                                                const int32_t* __restrict__ bstart, const int32_t* __restrict__ bend) {
  const int tid = threadIdx.x;
  t.n = 0;
  t.bs = -1;
  if (tile < num_tiles) {
    t.b = tile % max_blocks;
    t.kt = tile / max_blocks;
    t.bs = bstart[t.b];
    t.n = t.bs < 0 ? 0 : bend[t.b] - t.bs;
  }
#pragma unroll
  for (int i = 0; i < 4; ++i) {
    const int c = i * kThreads + tid, row = c >> 3, ch = c & 7;
    t.v[i] = row < t.n ? __ldg(reinterpret_cast<const uint4*>(row_codes + (t.bs + row) * k + t.kt * kTile) + ch)
                       : make_uint4(0, 0, 0, 0);
  }
  t.e = (tid < kTile && tid < t.n) ? row_scales[t.kt * m + t.bs + tid] : 0u;
}

// Persistent CTAs walk the tiles; the loads of the next tile are issued before the current one
// is shifted and written, so that memory latency overlaps the shared-memory transpose.
__global__ void __launch_bounds__(kThreads, 4)
scaling_aware_transpose_kernel(const uint8_t* __restrict__ row_codes, const uint8_t* __restrict__ row_scales,
                               int64_t m, int64_t k, const int32_t* __restrict__ bstart,
                               const int32_t* __restrict__ bend, int64_t max_blocks,
                               uint8_t* __restrict__ col_codes, uint8_t* __restrict__ col_scales,
                               DeviceStatus* status) {
  __shared__ __align__(16) uint8_t s_q[kTile * kBytePitch];
  __shared__ uint8_t s_e[kTile];
  __shared__ int s_wmax[kTile / 32], s_wbad[kTile / 32];
  const int tid = threadIdx.x;
  const int64_t num_tiles = max_blocks * (k / kTile);
  const bool vec_m = m % 16 == 0;
  int lost = 0;
  AwareTile cur;
  load_aware_tile(cur, blockIdx.x, num_tiles, max_blocks, row_codes, row_scales, m, k, bstart, bend);
  for (int64_t tile = blockIdx.x; tile < num_tiles; tile += gridDim.x) {
    if (cur.n > 0 && tid < kTile) {  // cur.n is the same for every thread
      s_e[tid] = static_cast<uint8_t>(cur.e);
      const unsigned wmax = __reduce_max_sync(0xffffffffu, cur.e == kUE8M0NaN ? 0u : cur.e);
      const unsigned wbad = __reduce_add_sync(0xffffffffu, cur.e == kUE8M0NaN ? 1u : 0u);
      if ((tid & 31) == 0) {
        s_wmax[tid >> 5] = static_cast<int>(wmax);
        s_wbad[tid >> 5] = static_cast<int>(wbad);
      }
    }
    __syncthreads();  // s_e/s_wmax ready; the previous tile's s_q reads are done
    AwareTile next;
    load_aware_tile(next, tile + gridDim.x, num_tiles, max_blocks, row_codes, row_scales, m, k, bstart, bend);
    if (cur.n > 0) {
      const int emax = max(max(s_wmax[0], s_wmax[1]), max(s_wmax[2], s_wmax[3]));
      const int nbad = s_wbad[0] + s_wbad[1] + s_wbad[2] + s_wbad[3];
      // Row pass: shift each 16-code chunk by (emax - e_row) into the byte tile.
#pragma unroll
      for (int i = 0; i < 4; ++i) {
        const int c = i * kThreads + tid, row = c >> 3, ch = c & 7;
        uint4 w = cur.v[i];
        if (row < cur.n) {
          if (nbad) {
            w = make_uint4(0x7F7F7F7Fu, 0x7F7F7F7Fu, 0x7F7F7F7Fu, 0x7F7F7F7Fu);
          } else {
            const int d = emax - s_e[row];
            w.x = rescale4(w.x, d, lost);
            w.y = rescale4(w.y, d, lost);
            w.z = rescale4(w.z, d, lost);
            w.w = rescale4(w.w, d, lost);
          }
        }
        *reinterpret_cast<uint4*>(&s_q[row * kBytePitch + ch * 16]) = w;
      }
      if (tid < kTile) col_scales[cur.b * k + cur.kt * kTile + tid] = nbad ? kUE8M0NaN : static_cast<uint8_t>(emax);
      if (tid == 0 && nbad && status) atomicAdd(&status->nonfinite, static_cast<unsigned long long>(nbad) * kTile);
      __syncthreads();
      detail::store_col_tile(s_q, cur.n, col_codes + (cur.kt * kTile) * m + cur.bs, m, vec_m && (cur.bs % 16 == 0));
    }
    cur = next;
  }
  detail::warp_count(status ? &status->underflow : nullptr, lost);
}

// CTAs resident at once for the persistent transpose (multiprocessors x blocks per SM).
int64_t persistent_ctas() {
  static const int64_t n = [] {
    int dev = 0, sms = 0, per_sm = 0;
    FLOWMOE_CUDA_CHECK(cudaGetDevice(&dev));
    FLOWMOE_CUDA_CHECK(cudaDeviceGetAttribute(&sms, cudaDevAttrMultiProcessorCount, dev));
    FLOWMOE_CUDA_CHECK(cudaOccupancyMaxActiveBlocksPerMultiprocessor(&per_sm, scaling_aware_transpose_kernel, kThreads, 0));
    return static_cast<int64_t>(sms) * std::max(per_sm, 1);
  }();
  return n;
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
  const int64_t num_tiles = sb.max_blocks * (k / kTile);
  const unsigned grid = static_cast<unsigned>(std::min<int64_t>(num_tiles, persistent_ctas()));
  scaling_aware_transpose_kernel<<<grid, kThreads, 0, stream>>>(row_codes, row_scales, sb.m, k, sb.block_start,
                                                                sb.block_end, sb.max_blocks, col_codes,
                                                                col_scales, status);
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
