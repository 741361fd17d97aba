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

// Number of NaN codes (0x7F / 0xFF) among the 4 bytes of w: exact per-byte zero test of
// (magnitude ^ 0x7F).
__device__ __forceinline__ int nan_codes4(uint32_t w) {
  const uint32_t x = (w & 0x7F7F7F7Fu) ^ 0x7F7F7F7Fu;
  const uint32_t y = ((x & 0x7F7F7F7Fu) + 0x7F7F7F7Fu) | x;  // bit 7 set in every non-zero byte
  return __popc(~y & 0x80808080u);
}

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

// One CTA per (128-token block, 128-feature tile). The target exponent of every column of the
// tile is the maximum row exponent of the block (all columns of a K tile share the row scales).
// The code loads are issued first so that their latency overlaps the scale reduction.
__global__ void __launch_bounds__(kThreads, 6)
scaling_aware_transpose_kernel(const uint8_t* __restrict__ row_codes, const uint8_t* __restrict__ row_scales,
                               int64_t m, int64_t k, const int32_t* __restrict__ bstart,
                               const int32_t* __restrict__ bend, uint8_t* __restrict__ col_codes,
                               uint8_t* __restrict__ col_scales, DeviceStatus* status) {
  __shared__ __align__(16) uint8_t s_q[detail::kSwzBytes];
  __shared__ uint8_t s_e[kTile];
  __shared__ int s_wmax[kTile / 32], s_wbad[kTile / 32];
  int64_t b, kt;
  detail::tile_coords(b, kt);
  const int bs = bstart[b];
  if (bs < 0) return;
  const int n = bend[b] - bs;
  const int tid = threadIdx.x;

  uint4 v[4];
#pragma unroll
  for (int i = 0; i < 4; ++i) {
    const int c = i * kThreads + tid, row = c >> 3, ch = c & 7;
    v[i] = row < n ? __ldg(reinterpret_cast<const uint4*>(row_codes + (bs + row) * k + kt * kTile) + ch)
                   : make_uint4(0, 0, 0, 0);
  }
  if (tid < kTile) {
    const uint32_t e = tid < n ? row_scales[kt * m + bs + tid] : 0u;
    s_e[tid] = static_cast<uint8_t>(e);
    const unsigned wmax = __reduce_max_sync(0xffffffffu, e == kUE8M0NaN ? 0u : e);
    const unsigned wbad = __reduce_add_sync(0xffffffffu, e == kUE8M0NaN ? 1u : 0u);
    if ((tid & 31) == 0) {
      s_wmax[tid >> 5] = static_cast<int>(wmax);
      s_wbad[tid >> 5] = static_cast<int>(wbad);
    }
  }
  __syncthreads();
  const int emax = max(max(s_wmax[0], s_wmax[1]), max(s_wmax[2], s_wmax[3]));
  const int nbad = s_wbad[0] + s_wbad[1] + s_wbad[2] + s_wbad[3];

  // Row pass: shift each 16-code chunk by (emax - e_row) into the byte tile.
  int lost = 0, nan_codes = 0;
#pragma unroll
  for (int i = 0; i < 4; ++i) {
    const int c = i * kThreads + tid, row = c >> 3, ch = c & 7;
    uint4 w = v[i];
    if (row < n) {
      if (nbad) {
        w = make_uint4(0x7F7F7F7Fu, 0x7F7F7F7Fu, 0x7F7F7F7Fu, 0x7F7F7F7Fu);
      } else {
        const int d = emax - s_e[row];
        nan_codes += nan_codes4(w.x) + nan_codes4(w.y) + nan_codes4(w.z) + nan_codes4(w.w);
        w.x = rescale4(w.x, d, lost);
        w.y = rescale4(w.y, d, lost);
        w.z = rescale4(w.z, d, lost);
        w.w = rescale4(w.w, d, lost);
      }
    }
    *reinterpret_cast<uint4*>(&s_q[detail::swz_chunk(row, ch)]) = w;
  }
  detail::warp_count(status ? &status->underflow : nullptr, lost);
  detail::warp_count(status ? &status->nonfinite : nullptr, nan_codes);
  if (tid < kTile) col_scales[b * k + kt * kTile + tid] = nbad ? kUE8M0NaN : static_cast<uint8_t>(emax);
  if (tid == 0 && nbad && status) atomicAdd(&status->nonfinite, static_cast<unsigned long long>(nbad) * kTile);
  __syncthreads();
  detail::store_col_tile_swz(s_q, n, col_codes + (kt * kTile) * m + bs, m, (m % 16 == 0) && (bs % 16 == 0));
}


// The column-amax variant: each (feature, token block) exponent is the fresh power-of-two scale of
// that column's own amax, computed from the FP8 codes exactly as cpu::scaling_aware_transpose
// (kColumnAmax) does, then every code is re-encoded by an up- or down-shift. One CTA per tile;
// written for clarity (byte-wise re-encode), not tuned.
__global__ void __launch_bounds__(kThreads)
aware_transpose_colamax_kernel(const uint8_t* __restrict__ row_codes, const uint8_t* __restrict__ row_scales,
                               int64_t m, int64_t k, const int32_t* __restrict__ bstart,
                               const int32_t* __restrict__ bend, uint8_t* __restrict__ col_codes,
                               uint8_t* __restrict__ col_scales, DeviceStatus* status) {
  __shared__ __align__(16) uint8_t s_q[kTile * kBytePitch];
  __shared__ uint8_t s_e[kTile], s_target[kTile];
  __shared__ int s_bad;
  int64_t b, kt;
  detail::tile_coords(b, kt);
  const int bs = bstart[b];
  if (bs < 0) return;
  const int n = bend[b] - bs;
  const int tid = threadIdx.x;
  if (tid == 0) s_bad = 0;
  __syncthreads();
  for (int i = 0; i < 4; ++i) {  // raw codes into the byte tile
    const int c = i * kThreads + tid, row = c >> 3, ch = c & 7;
    const uint4 v = row < n ? __ldg(reinterpret_cast<const uint4*>(row_codes + (bs + row) * k + kt * kTile) + ch)
                            : make_uint4(0, 0, 0, 0);
    *reinterpret_cast<uint4*>(&s_q[row * kBytePitch + ch * 16]) = v;
  }
  if (tid < kTile) {
    const uint8_t e = tid < n ? row_scales[kt * m + bs + tid] : 0;
    s_e[tid] = e;
    if (tid < n && e == kUE8M0NaN) atomicAdd(&s_bad, 1);
  }
  __syncthreads();
  const int nbad = s_bad;
  if (nbad) {  // a NaN-marked row tile: the whole column block is NaN, as in the row-max kernel
    for (int i = 0; i < 4; ++i) {
      const int c = i * kThreads + tid, row = c >> 3, ch = c & 7;
      if (row < n)
        *reinterpret_cast<uint4*>(&s_q[row * kBytePitch + ch * 16]) =
            make_uint4(0x7F7F7F7Fu, 0x7F7F7F7Fu, 0x7F7F7F7Fu, 0x7F7F7F7Fu);
    }
    if (tid < kTile) col_scales[b * k + kt * kTile + tid] = kUE8M0NaN;
    if (tid == 0 && status) atomicAdd(&status->nonfinite, static_cast<unsigned long long>(nbad) * kTile);
  } else {
    if (tid < kTile) {  // one thread per feature: the column block's exponent
      const int f = tid;
      int r = -1;
      for (int t = 0; t < n; ++t) {
        const uint8_t q = s_q[t * kBytePitch + f];
        if ((q & 0x7F) != 0 && !e4m3_is_nan(q)) r = max(r, static_cast<int>(s_e[t]));
      }
      int target = 0;
      if (r >= 0) {
        float amax_rel = 0.0f;
        for (int t = 0; t < n; ++t) {
          const uint8_t q = s_q[t * kBytePitch + f];
          const int rel = static_cast<int>(s_e[t]) - r;
          if (e4m3_is_nan(q) || rel < -160) continue;
          amax_rel = fmaxf(amax_rel, f32_abs(e4m3_to_f32(q)) * exp2i(max(rel, -149)));
        }
        target = min(max(r + e4m3_scale_exp(amax_rel), 0), 254);
      }
      s_target[f] = static_cast<uint8_t>(target);
      col_scales[b * k + kt * kTile + f] = static_cast<uint8_t>(target);
    }
    __syncthreads();
    int lost = 0, nan_codes = 0;
    for (int i = 0; i < 4; ++i) {  // re-encode in place: this thread's 16-code chunks
      const int c = i * kThreads + tid, row = c >> 3, ch = c & 7;
      if (row >= n) continue;
      uint8_t* p = &s_q[row * kBytePitch + ch * 16];
      for (int j = 0; j < 16; ++j) {
        const uint8_t q = p[j];
        if (e4m3_is_nan(q)) {
          ++nan_codes;
          continue;
        }
        if ((q & 0x7F) == 0) continue;  // zeros keep their sign
        bool l = false;
        p[j] = e4m3_encode_shifted(e4m3_to_f32(q), static_cast<int>(s_target[ch * 16 + j]) - s_e[row], &l);
        lost += l;
      }
    }
    detail::warp_count(status ? &status->underflow : nullptr, lost);
    detail::warp_count(status ? &status->nonfinite : nullptr, nan_codes);
  }
  __syncthreads();
  detail::store_col_tile(s_q, n, col_codes + (kt * kTile) * m + bs, m, (m % 16 == 0) && (bs % 16 == 0));
}

}  // namespace

void scaling_aware_transpose(const uint8_t* row_codes, const uint8_t* row_scales, int64_t k,
                             const SegmentBlocks& sb, uint8_t* col_codes, uint8_t* col_scales,
                             DeviceStatus* status, cudaStream_t stream, TransposeExponent mode) {
  const char* what = "cuda::scaling_aware_transpose";
  check_k(k, kTile, what);
  check_blocks(sb, what);
  if (sb.m == 0) return;
  check_aligned(row_codes, "row_codes", what);
  check_aligned(col_codes, "col_codes", what);
  FLOWMOE_CHECK(row_scales && col_scales, what << ": row_scales or col_scales is null");
  const dim3 grid = tile_grid(sb.max_blocks, k / kTile);
  if (mode == TransposeExponent::kColumnAmax) {
    aware_transpose_colamax_kernel<<<grid, kThreads, 0, stream>>>(
        row_codes, row_scales, sb.m, k, sb.block_start, sb.block_end, col_codes, col_scales, status);
    FLOWMOE_LAUNCH_CHECK(what);
    return;
  }
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
