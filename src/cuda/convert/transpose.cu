// Row-wise FP8 -> column-wise FP8: the scaling-aware transpose (exponent shifts only) and the
// naive dequantize -> transpose -> quantize path it replaces.
#include "cuda/convert/tile.cuh"
#include "flowmoe/cuda/convert.h"

namespace flowmoe {
namespace cuda {
namespace {

using namespace flowmoe::num;
using namespace detail::host;
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

// Word masks of the SWAR rescale (4 E4M3 codes per word).
// Non-zero where a byte is a NaN code (0x7F / 0xFF): the exact "has a zero byte" test of
// (magnitude ^ 0x7F).
__device__ __forceinline__ uint32_t nan_bytes4(uint32_t w) {
  const uint32_t x = (w & 0x7F7F7F7Fu) ^ 0x7F7F7F7Fu;
  return (x - 0x01010101u) & ~x & 0x80808080u;
}
// True when every byte keeps an exponent field >= 1 after subtracting d (1 <= d <= 14): then the
// shift only subtracts d from each exponent field. `bias` = (15 - d) per byte.
__device__ __forceinline__ bool shift_stays_normal4(uint32_t w, uint32_t bias) {
  return (((((w >> 3) & 0x0F0F0F0Fu) + bias) & 0x10101010u) == 0x10101010u);
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

  // Row pass: shift each 16-code chunk by (emax - e_row) into the byte tile. The SWAR fast path
  // (every code normal, not NaN, and still normal after the shift: the shift only lowers each
  // exponent field) covers almost every word of real data; the others are marked in `slow` and
  // re-encoded byte by byte after the pass, so that the hot path holds no call.
  int lost = 0, nan_codes = 0;
  uint32_t slow = 0;  // bit 4i + j: word j of chunk i goes byte by byte
#pragma unroll
  for (int i = 0; i < 4; ++i) {
    const int c = i * kThreads + tid, row = c >> 3, ch = c & 7;
    uint32_t x[4] = {v[i].x, v[i].y, v[i].z, v[i].w};
    if (row < n) {
      if (nbad) {
#pragma unroll
        for (int j = 0; j < 4; ++j) x[j] = 0x7F7F7F7Fu;
      } else {
        const int d = emax - s_e[row];
        uint32_t nanw[4];
#pragma unroll
        for (int j = 0; j < 4; ++j) nanw[j] = nan_bytes4(x[j]);
        if (nanw[0] | nanw[1] | nanw[2] | nanw[3])
          nan_codes += nan_codes4(x[0]) + nan_codes4(x[1]) + nan_codes4(x[2]) + nan_codes4(x[3]);
        if (d != 0) {
          const uint32_t bias = 0x01010101u * static_cast<uint32_t>(15 - d);
          const uint32_t sub = 0x01010101u * (static_cast<uint32_t>(d) << 3);
#pragma unroll
          for (int j = 0; j < 4; ++j) {
            if (d < 15 && nanw[j] == 0 && shift_stays_normal4(x[j], bias)) x[j] -= sub;
            else slow |= 1u << (4 * i + j);
          }
        }
      }
    }
    *reinterpret_cast<uint4*>(&s_q[detail::swz_chunk(row, ch)]) = make_uint4(x[0], x[1], x[2], x[3]);
  }
  if (slow) {  // rare: zeros, subnormals, NaN codes, values that leave the normal range
#pragma unroll
    for (int i = 0; i < 4; ++i) {
      const int c = i * kThreads + tid, row = c >> 3, ch = c & 7;
      for (uint32_t bits = (slow >> (4 * i)) & 0xFu; bits; bits &= bits - 1) {
        const int j = __ffs(bits) - 1;  // (the word read again: nothing stays live across the pass)
        const uint32_t w = __ldg(reinterpret_cast<const uint32_t*>(row_codes + (bs + row) * k + kt * kTile) + 4 * ch + j);
        reinterpret_cast<uint32_t*>(&s_q[detail::swz_chunk(row, ch)])[j] = rescale4_slow(w, emax - s_e[row], lost);
      }
    }
  }
  detail::warp_count(status ? &status->underflow : nullptr, lost);
  detail::warp_count(status ? &status->nonfinite : nullptr, nan_codes);
  if (tid < kTile) col_scales[b * k + kt * kTile + tid] = nbad ? kUE8M0NaN : static_cast<uint8_t>(emax);
  if (tid == 0 && nbad && status) atomicAdd(&status->nonfinite, static_cast<unsigned long long>(nbad) * kTile);
  __syncthreads();
  detail::store_col_tile_swz(s_q, n, col_codes + (kt * kTile) * m + bs, m, (m % 16 == 0) && (bs % 16 == 0));
}


// ---- the column-amax variant (TransposeExponent::kColumnAmax) ----------------------------------
// Every byte of w a normal, non-NaN code: exponent field >= 1 and magnitude != 0x7F.
__device__ __forceinline__ bool all_normal4(uint32_t w) {
  const uint32_t mag = w & 0x7F7F7F7Fu;
  const uint32_t ef = (mag >> 3) & 0x0F0F0F0Fu;
  return ((ef + 0x7F7F7F7Fu) & ((mag ^ 0x7F7F7F7Fu) + 0x7F7F7F7Fu) & 0x80808080u) == 0x80808080u;
}

// Column-amax keys (num::e4m3_amax_key) of the 4 codes of w under row scale code e: bytes 0 and 2
// in the lanes of .x, bytes 1 and 3 in those of .y. Zeros, subnormals and NaN codes go byte by
// byte; normal codes have key 8e + 24 + magnitude, added on packed halves.
__device__ __noinline__ uint2 e4m3_keys4_slow(uint32_t w, int e) {
  uint32_t k[4];
  for (int p = 0; p < 4; ++p) k[p] = static_cast<uint32_t>(e4m3_amax_key(static_cast<uint8_t>(w >> (8 * p)), e));
  return make_uint2(k[0] | (k[2] << 16), k[1] | (k[3] << 16));
}
__device__ __forceinline__ void e4m3_keys4(uint32_t w, int e, uint32_t& even, uint32_t& odd) {
  uint2 k;
  if (all_normal4(w)) {
    const uint32_t base = (8u * static_cast<uint32_t>(e) + 24u) * 0x00010001u;
    const uint32_t mag = w & 0x7F7F7F7Fu;
    k = make_uint2((mag & 0x00FF00FFu) + base, ((mag >> 8) & 0x00FF00FFu) + base);
  } else {
    k = e4m3_keys4_slow(w, e);
  }
  even = __vmaxu2(even, k.x);
  odd = __vmaxu2(odd, k.y);
}

// Re-encodes the 4 codes of w from row scale code e to the target codes t4 (one per byte), as
// cpu::scaling_aware_transpose does: NaN codes and zeros unchanged, others RNE(q * 2^(e - t)).
struct Rescaled4 {
  uint32_t w;
  int lost, nan;
};
__device__ __noinline__ Rescaled4 colamax_rescale4_slow(uint32_t w, uint32_t t4, int e) {
  Rescaled4 r{0u, 0, 0};
  for (int p = 0; p < 4; ++p) {
    uint8_t q = static_cast<uint8_t>(w >> (8 * p));
    if (e4m3_is_nan(q)) {
      ++r.nan;
    } else if ((q & 0x7F) != 0) {
      bool l = false;
      q = e4m3_encode_shifted(e4m3_to_f32(q), static_cast<int>((t4 >> (8 * p)) & 0xFF) - e, &l);
      r.lost += l;
    }
    r.w |= static_cast<uint32_t>(q) << (8 * p);
  }
  return r;
}
// Fast path: dd holds 16 - (t - e) per byte (in [1, 31]; 0 when the row's shifts leave
// [-15, 15]). Where every code is normal and not NaN and every new exponent field ef - (t - e)
// lies in [1, 15], the shift only replaces the exponent fields (x = new field + 16, 17..31); a
// column's amax bounds every value, so no field leaves the top.
__device__ __forceinline__ uint32_t colamax_rescale4(uint32_t w, uint32_t dd, uint32_t t4, int e, int& lost,
                                                     int& nan) {
  const uint32_t mag = w & 0x7F7F7F7Fu;
  const uint32_t ef = (mag >> 3) & 0x0F0F0F0Fu;
  const uint32_t x = ef + dd;  // bytes <= 46: no carries below
  const uint32_t ok = (x + 0x6F6F6F6Fu) & ~(x + 0x60606060u) & (ef + 0x7F7F7F7Fu) &
                      ((mag ^ 0x7F7F7F7Fu) + 0x7F7F7F7Fu);  // x >= 17, x <= 31, ef >= 1, not NaN
  if ((ok & 0x80808080u) == 0x80808080u) return (w & 0x87878787u) | ((x - 0x10101010u) << 3);
  const Rescaled4 r = colamax_rescale4_slow(w, t4, e);
  lost += r.lost;
  nan += r.nan;
  return r.w;
}

// One CTA per (128-token block, 128-feature tile), laid out like the row-max kernel: each thread
// holds 16 features of 4 rows. Pass 1 folds the codes into per-feature amax keys (reduced over the
// CTA, detail::column_max_key); pass 2 re-encodes each code under its column's target exponent.
__global__ void __launch_bounds__(kThreads, 5)
aware_transpose_colamax_kernel(const uint8_t* __restrict__ row_codes, const uint8_t* __restrict__ row_scales,
                               int64_t m, int64_t k, const int32_t* __restrict__ bstart,
                               const int32_t* __restrict__ bend, uint8_t* __restrict__ col_codes,
                               uint8_t* __restrict__ col_scales, DeviceStatus* status) {
  __shared__ __align__(16) uint8_t s_q[detail::kSwzBytes];
  __shared__ __align__(16) uint8_t s_target[kTile];
  __shared__ uint8_t s_e[kTile];
  __shared__ uint32_t s_key[(kThreads / 32) * 8 * detail::kKeyWords];
  __shared__ int s_wbad[kTile / 32];
  int64_t b, kt;
  detail::tile_coords(b, kt);
  const int bs = bstart[b];
  if (bs < 0) return;
  const int n = bend[b] - bs;
  const int tid = threadIdx.x, ch = tid & 7;

  uint4 v[4];
#pragma unroll
  for (int i = 0; i < 4; ++i) {
    const int row = i * (kThreads / 8) + (tid >> 3);
    v[i] = row < n ? __ldg(reinterpret_cast<const uint4*>(row_codes + (bs + row) * k + kt * kTile) + ch)
                   : make_uint4(0, 0, 0, 0);
  }
  if (tid < kTile) {
    const uint32_t e = tid < n ? row_scales[kt * m + bs + tid] : 0u;
    s_e[tid] = static_cast<uint8_t>(e);
    const unsigned wbad = __reduce_add_sync(0xffffffffu, e == kUE8M0NaN ? 1u : 0u);
    if ((tid & 31) == 0) s_wbad[tid >> 5] = static_cast<int>(wbad);
  }
  __syncthreads();
  const int nbad = s_wbad[0] + s_wbad[1] + s_wbad[2] + s_wbad[3];

  if (nbad) {  // a NaN-marked row tile: the whole column block is NaN, as in the row-max kernel
#pragma unroll
    for (int i = 0; i < 4; ++i) {
      const int row = i * (kThreads / 8) + (tid >> 3);
      *reinterpret_cast<uint4*>(&s_q[detail::swz_chunk(row, ch)]) =
          make_uint4(0x7F7F7F7Fu, 0x7F7F7F7Fu, 0x7F7F7F7Fu, 0x7F7F7F7Fu);
    }
    if (tid < kTile) col_scales[b * k + kt * kTile + tid] = kUE8M0NaN;
    if (tid == 0 && status) atomicAdd(&status->nonfinite, static_cast<unsigned long long>(nbad) * kTile);
  } else {
    uint32_t key[detail::kKeyWords] = {0, 0, 0, 0, 0, 0, 0, 0};
#pragma unroll
    for (int i = 0; i < 4; ++i) {
      const int row = i * (kThreads / 8) + (tid >> 3);
      if (row >= n) continue;
      const int e = s_e[row];
      e4m3_keys4(v[i].x, e, key[0], key[1]);
      e4m3_keys4(v[i].y, e, key[2], key[3]);
      e4m3_keys4(v[i].z, e, key[4], key[5]);
      e4m3_keys4(v[i].w, e, key[6], key[7]);
    }
    const int best = detail::column_max_key(key, s_key);
    if (tid < kTile) {
      const uint8_t t = static_cast<uint8_t>(scale_code_from_e4m3_amax_key(best));
      s_target[tid] = t;
      col_scales[b * k + kt * kTile + tid] = t;
    }
    __syncthreads();
    const detail::ChunkTargets ct = detail::load_chunk_targets(s_target, ch);
    int lost = 0, nan_codes = 0;
#pragma unroll
    for (int i = 0; i < 4; ++i) {
      const int row = i * (kThreads / 8) + (tid >> 3);
      uint4 w = v[i];
      if (row < n) {
        const int e = s_e[row];
        w.x = colamax_rescale4(w.x, ct.shift_bytes(0, e), ct.t[0], e, lost, nan_codes);
        w.y = colamax_rescale4(w.y, ct.shift_bytes(1, e), ct.t[1], e, lost, nan_codes);
        w.z = colamax_rescale4(w.z, ct.shift_bytes(2, e), ct.t[2], e, lost, nan_codes);
        w.w = colamax_rescale4(w.w, ct.shift_bytes(3, e), ct.t[3], e, lost, nan_codes);
      }
      *reinterpret_cast<uint4*>(&s_q[detail::swz_chunk(row, ch)]) = w;
    }
    detail::warp_count(status ? &status->underflow : nullptr, lost);
    detail::warp_count(status ? &status->nonfinite : nullptr, nan_codes);
  }
  __syncthreads();
  detail::store_col_tile_swz(s_q, n, col_codes + (kt * kTile) * m + bs, m, (m % 16 == 0) && (bs % 16 == 0));
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
