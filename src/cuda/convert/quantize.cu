// FP8 quantize (row-wise, column-wise, both), dequantize, and the building blocks of the naive
// baselines (plain transpose, quantize along the token dimension). The weights: quantize_weights.cu.
#include <cuda_bf16.h>
#include <cuda_fp16.h>

#include <type_traits>

#include "cuda/convert/quant8.cuh"
#include "cuda/convert/tile.cuh"
#include "flowmoe/cuda/convert.h"
#include "flowmoe/numerics.h"

namespace flowmoe {
namespace cuda {
namespace {

using namespace flowmoe::num;
using detail::kThreads;
using detail::kTile;
using namespace detail::host;
using detail::amax8;
using detail::encode8;

// ---- K1: row-wise 1x128. A half-warp per tile, 8 values per thread. Grid: blockIdx.y is the K
// tile, x walks the tokens, two tokens per half-warp (both loads issued before either is used);
// neighbouring half-warps write neighbouring scale bytes ([K/128][M]). No integer division.
constexpr int kRowTilesPerHalfWarp = 2;
__global__ void __launch_bounds__(kThreads)
quantize_row_kernel(const bf16_t* __restrict__ x, int64_t m, int64_t k, uint8_t* __restrict__ codes,
                    uint8_t* __restrict__ scales, unsigned long long* nonfinite) {
  const int64_t kb = blockIdx.y;
  const int64_t hw = (static_cast<int64_t>(blockIdx.x) * blockDim.x + threadIdx.x) >> 4;
  const int64_t nhw = (static_cast<int64_t>(gridDim.x) * blockDim.x) >> 4;
  const int lane = threadIdx.x & 15;
  uint4 v[kRowTilesPerHalfWarp];
#pragma unroll
  for (int i = 0; i < kRowTilesPerHalfWarp; ++i) {
    const int64_t r = hw + i * nhw;
    v[i] = r < m ? __ldg(reinterpret_cast<const uint4*>(x + r * k + kb * kTile) + lane) : make_uint4(0, 0, 0, 0);
  }
#pragma unroll
  for (int i = 0; i < kRowTilesPerHalfWarp; ++i) {
    const int64_t r = hw + i * nhw;
    const uint32_t amax_bits = detail::group_max_u(detail::absmax8_bits(v[i]), 16);
    const bool tile_bad = amax_bits >= detail::kBf16NonFiniteBits;
    detail::count_nonfinite_warp(nonfinite, v[i], tile_bad);
    if (r < m) {
      const int e = e4m3_scale_exp(detail::bf16_bits_to_f32(amax_bits));
      reinterpret_cast<uint2*>(codes + r * k + kb * kTile)[lane] = encode8(v[i], e, tile_bad);
      if (lane == 0) scales[kb * m + r] = tile_bad ? kUE8M0NaN : ue8m0_from_exp(e);
    }
  }
}

// ---- K2: column-wise 128x1 (and optionally row-wise) from BF16, one 128x128 tile per CTA.
// The BF16 tile is stored with swizzled 16-byte chunks (chunk c of row t at c ^ ((t / 16) % 8)) so
// that the column pass's two read patterns are free of bank conflicts; the column codes are
// stored by task = (16-token group j, feature f), the 8 lanes of a group covering one feature
// row's 128 tokens (full 128-byte segments per store instruction).
__device__ __forceinline__ int qc_index(int t, int f) {  // bf16 element offset of (token t, feature f)
  constexpr int kPitch = kTile + 8;
  return t * kPitch + (((f >> 3) ^ ((t >> 4) & 7)) << 3) + (f & 7);
}
__global__ void __launch_bounds__(kThreads)
quantize_col_kernel(const bf16_t* __restrict__ x, int64_t m, int64_t k,
                    const int32_t* __restrict__ bstart, const int32_t* __restrict__ bend,
                    uint8_t* __restrict__ col_codes, uint8_t* __restrict__ col_scales,
                    uint8_t* __restrict__ row_codes, uint8_t* __restrict__ row_scales,
                    unsigned long long* nonfinite) {
  constexpr int kPitch = kTile + 8;  // bf16 elements; 272 bytes keeps rows 16-byte aligned
  __shared__ __align__(16) uint16_t s_x[kTile * kPitch];
  __shared__ uint32_t s_amax[2][kTile];
  __shared__ uint8_t s_code[kTile];
  int64_t b, kt;
  detail::tile_coords(b, kt);
  const int bs = bstart[b];
  if (bs < 0) return;
  const int n = bend[b] - bs;
  const int tid = threadIdx.x;
  const bool want_row = row_codes != nullptr;

  // Load the tile: 8 passes of 16 rows x 16 chunks of 8 values (a half-warp reads one row), in
  // two batches of four loads issued before any is used.
#pragma unroll
  for (int batch = 0; batch < 2; ++batch) {
    uint4 v[4];
#pragma unroll
    for (int j = 0; j < 4; ++j) {
      const int row = (batch * 4 + j) * 16 + (tid >> 4), ch = tid & 15;
      v[j] = row < n ? __ldg(reinterpret_cast<const uint4*>(x + (bs + row) * k + kt * kTile) + ch)
                     : make_uint4(0, 0, 0, 0);
    }
#pragma unroll
    for (int j = 0; j < 4; ++j) {
      const int row = (batch * 4 + j) * 16 + (tid >> 4), ch = tid & 15;
      *reinterpret_cast<uint4*>(&s_x[qc_index(row, ch * 8)]) = v[j];
      if (want_row) {
        const uint32_t amax_bits = detail::group_max_u(detail::absmax8_bits(v[j]), 16);
        const bool tile_bad = amax_bits >= detail::kBf16NonFiniteBits;
        detail::count_nonfinite_warp(nonfinite, v[j], tile_bad);
        if (row < n) {
          const int e = e4m3_scale_exp(detail::bf16_bits_to_f32(amax_bits));
          reinterpret_cast<uint2*>(row_codes + (bs + row) * k + kt * kTile)[ch] = encode8(v[j], e, tile_bad);
          if (ch == 0) row_scales[kt * m + bs + row] = tile_bad ? kUE8M0NaN : ue8m0_from_exp(e);
        }
      }
    }
  }
  __syncthreads();

  // Column amax: thread = (feature f, half of the tokens).
  {
    const int f = tid & (kTile - 1), half = tid >> 7;
    uint32_t amax_bits = 0;  // rows >= n are zero in s_x
    for (int i = 0; i < 64; ++i) amax_bits = max(amax_bits, static_cast<uint32_t>(s_x[qc_index(half * 64 + i, f)] & 0x7FFFu));
    s_amax[half][f] = amax_bits;
    if (!want_row && __any_sync(0xffffffffu, amax_bits >= detail::kBf16NonFiniteBits)) {
      int bad = 0;
      for (int i = 0; i < 64; ++i) bad += (s_x[qc_index(half * 64 + i, f)] & 0x7F80u) == 0x7F80u;
      detail::warp_count(nonfinite, bad);
    }
  }
  __syncthreads();
  if (tid < kTile) {
    const uint32_t amax_bits = max(s_amax[0][tid], s_amax[1][tid]);
    const uint8_t code = amax_bits >= detail::kBf16NonFiniteBits
                             ? kUE8M0NaN
                             : ue8m0_from_exp(e4m3_scale_exp(detail::bf16_bits_to_f32(amax_bits)));
    s_code[tid] = code;
    col_scales[b * k + kt * kTile + tid] = code;
  }
  __syncthreads();

  // Column codes: task = (16-token group j, feature f).
  const bool vec = (m % 16 == 0) && (bs % 16 == 0);
  for (int task = tid; task < kTile * (kTile / 16); task += kThreads) {
    const int j = task & 7, f = task >> 3;
    const int t0 = j * 16;
    if (t0 >= n) continue;
    const uint8_t code = s_code[f];
    const bool col_bad = code == kUE8M0NaN;
    const float inv = col_bad ? 0.0f : detail::inv_pow2(static_cast<int>(code) - kUE8M0Bias);
    uint8_t* dst = col_codes + (kt * kTile + f) * m + bs;
    uint32_t w[4];
#pragma unroll
    for (int q = 0; q < 4; ++q) {
      uint32_t word = 0;
#pragma unroll
      for (int p = 0; p < 4; p += 2) {
        const int t = t0 + 4 * q + p;
        const float a = __uint_as_float(static_cast<uint32_t>(s_x[qc_index(t, f)]) << 16) * inv;
        const float c = __uint_as_float(static_cast<uint32_t>(s_x[qc_index(t + 1, f)]) << 16) * inv;
        word |= static_cast<uint32_t>(col_bad ? 0x7F7Fu : detail::e4m3x2(a, c)) << (8 * p);
      }
      w[q] = col_bad ? word : detail::e4m3x4_saturate_for_scale(word, static_cast<int>(code) - kUE8M0Bias);
    }
    if (vec && t0 + 16 <= n) {
      *reinterpret_cast<uint4*>(dst + t0) = make_uint4(w[0], w[1], w[2], w[3]);
    } else {
      for (int t = t0; t < min(t0 + 16, n); ++t) dst[t] = static_cast<uint8_t>(w[(t - t0) >> 2] >> (8 * ((t - t0) & 3)));
    }
  }
}

// ---- K3: dequantize row-wise FP8 -> bf16, 16 codes per thread. Hardware conversions (e4m3x2
// -> f16x2 -> f32, exact; f32 -> bf16 RNE), then NaN codes or a NaN scale become the canonical
// NaN, as num::dequant_e4m3 defines.
__global__ void __launch_bounds__(kThreads)
dequantize_row_kernel(const uint8_t* __restrict__ codes, const uint8_t* __restrict__ scales,
                      int64_t m, int64_t k, bf16_t* __restrict__ y) {
  const int64_t chunk = static_cast<int64_t>(blockIdx.x) * blockDim.x + threadIdx.x;
  if (chunk >= m * k / 16) return;
  const int64_t r = chunk / (k / 16), c0 = (chunk % (k / 16)) * 16;
  const uint8_t s = __ldg(scales + (c0 / kTile) * m + r);
  const uint4 q = __ldg(reinterpret_cast<const uint4*>(codes + r * k + c0));
  const uint32_t w[4] = {q.x, q.y, q.z, q.w};
  const float sf = ue8m0_to_f32(s);
  uint32_t out[8];
#pragma unroll
  for (int i = 0; i < 8; ++i) {
    const uint16_t pair = static_cast<uint16_t>(w[i / 2] >> (16 * (i & 1)));
    const __half2_raw h = __nv_cvt_fp8x2_to_halfraw2(pair, __NV_E4M3);
    const float2 f = __half22float2(*reinterpret_cast<const __half2*>(&h));
    const __nv_bfloat162 bb = __floats2bfloat162_rn(f.x * sf, f.y * sf);
    uint32_t o = *reinterpret_cast<const uint32_t*>(&bb);
    if (s == kUE8M0NaN || (pair & 0x7Fu) == 0x7Fu) o = (o & 0xFFFF0000u) | 0x7FC0u;
    if (s == kUE8M0NaN || (pair & 0x7F00u) == 0x7F00u) o = (o & 0x0000FFFFu) | 0x7FC00000u;
    out[i] = o;
  }
  uint4* dst = reinterpret_cast<uint4*>(y + r * k + c0);
  dst[0] = make_uint4(out[0], out[1], out[2], out[3]);
  dst[1] = make_uint4(out[4], out[5], out[6], out[7]);
}

// ---- K4: plain bf16 transpose [M, K] -> [K, M], 64x64 tiles, pairs of elements per access.
__global__ void __launch_bounds__(kThreads)
transpose_bf16_kernel(const bf16_t* __restrict__ x, int64_t m, int64_t k, bf16_t* __restrict__ y) {
  __shared__ uint16_t s[64][66];
  const int tx = threadIdx.x & 31, ty = threadIdx.x >> 5;
  const int64_t r0 = static_cast<int64_t>(blockIdx.y) * 64, c0 = static_cast<int64_t>(blockIdx.x) * 64;
  const bool pairs_in = (k % 2 == 0);
#pragma unroll
  for (int i = 0; i < 8; ++i) {
    const int rr = ty + 8 * i;
    const int64_t r = r0 + rr, c = c0 + 2 * tx;
    uint16_t a = 0, bb = 0;
    if (r < m) {
      if (pairs_in && c + 1 < k) {
        const uint32_t v = *reinterpret_cast<const uint32_t*>(x + r * k + c);
        a = static_cast<uint16_t>(v);
        bb = static_cast<uint16_t>(v >> 16);
      } else {
        if (c < k) a = x[r * k + c];
        if (c + 1 < k) bb = x[r * k + c + 1];
      }
    }
    s[rr][2 * tx] = a;
    s[rr][2 * tx + 1] = bb;
  }
  __syncthreads();
  const bool pairs_out = (m % 2 == 0);
#pragma unroll
  for (int i = 0; i < 8; ++i) {
    const int cc = ty + 8 * i;
    const int64_t c = c0 + cc, r = r0 + 2 * tx;
    if (c >= k) continue;
    if (pairs_out && r + 1 < m) {
      *reinterpret_cast<uint32_t*>(y + c * m + r) = s[2 * tx][cc] | (static_cast<uint32_t>(s[2 * tx + 1][cc]) << 16);
    } else {
      if (r < m) y[c * m + r] = s[2 * tx][cc];
      if (r + 1 < m) y[c * m + r + 1] = s[2 * tx + 1][cc];
    }
  }
}

// ---- K5: quantize an already-transposed xt [K, M] along M in segment blocks. A warp per
// (feature row, block); 4 consecutive tokens per lane.
__global__ void __launch_bounds__(kThreads)
quantize_transposed_kernel(const bf16_t* __restrict__ xt, int64_t m, int64_t k,
                           const int32_t* __restrict__ bstart, const int32_t* __restrict__ bend,
                           uint8_t* __restrict__ codes, uint8_t* __restrict__ scales,
                           unsigned long long* nonfinite) {
  const int64_t b = blockIdx.x;
  const int64_t kf = static_cast<int64_t>(blockIdx.y) * (kThreads / 32) + (threadIdx.x >> 5);
  const int lane = threadIdx.x & 31;
  const int bs = bstart[b];
  if (bs < 0 || kf >= k) return;
  const int n = bend[b] - bs;
  const bf16_t* src = xt + kf * m + bs;
  const int t0 = lane * 4;
  uint16_t h[4] = {0, 0, 0, 0};
  const bool vec = (m % 4 == 0) && (bs % 4 == 0) && t0 + 4 <= n;
  if (vec) {
    const uint2 v = *reinterpret_cast<const uint2*>(src + t0);
    h[0] = static_cast<uint16_t>(v.x);
    h[1] = static_cast<uint16_t>(v.x >> 16);
    h[2] = static_cast<uint16_t>(v.y);
    h[3] = static_cast<uint16_t>(v.y >> 16);
  } else {
    for (int i = 0; i < 4; ++i)
      if (t0 + i < n) h[i] = src[t0 + i];
  }
  float amax = 0.f;
  int bad = 0;
#pragma unroll
  for (int i = 0; i < 4; ++i) {
    if (!detail::bf16_finite(h[i])) ++bad;
    else amax = fmaxf(amax, __uint_as_float(static_cast<uint32_t>(h[i] & 0x7FFFu) << 16));
  }
  amax = detail::warp_max(amax, 32);
  const int tile_bad = detail::warp_max_i(bad, 32);
  detail::warp_count(nonfinite, bad);
  const int e = e4m3_scale_exp(amax);
  if (lane == 0) scales[b * k + kf] = tile_bad ? kUE8M0NaN : ue8m0_from_exp(e);
  const float inv = detail::inv_pow2(e);
  uint32_t word = 0x7F7F7F7Fu;
  if (!tile_bad) {
    word = detail::e4m3x2(__uint_as_float(static_cast<uint32_t>(h[0]) << 16) * inv,
                          __uint_as_float(static_cast<uint32_t>(h[1]) << 16) * inv) |
           (static_cast<uint32_t>(detail::e4m3x2(__uint_as_float(static_cast<uint32_t>(h[2]) << 16) * inv,
                                                 __uint_as_float(static_cast<uint32_t>(h[3]) << 16) * inv))
            << 16);
    word = detail::e4m3x4_saturate_for_scale(word, e);
  }
  uint8_t* dst = codes + kf * m + bs;
  if (vec) {
    *reinterpret_cast<uint32_t*>(dst + t0) = word;
  } else {
    for (int i = 0; i < 4; ++i)
      if (t0 + i < n) dst[t0 + i] = static_cast<uint8_t>(word >> (8 * i));
  }
}

}  // namespace

void quantize_row(const bf16_t* x, int64_t m, int64_t k, uint8_t* codes, uint8_t* scales,
                  DeviceStatus* status, cudaStream_t stream) {
  const char* what = "cuda::quantize_row";
  check_k(k, kTile, what);
  FLOWMOE_CHECK(m >= 0, what << ": M = " << m << " must be >= 0");
  if (m == 0) return;
  check_aligned(x, "x", what);
  check_aligned(codes, "codes", what);
  FLOWMOE_CHECK(scales, what << ": scales is null");
  FLOWMOE_CHECK(k / kTile < 65536, what << ": K = " << k << " too large (at most 65535 tiles of 128)");
  const dim3 grid(grid_for((m + kRowTilesPerHalfWarp - 1) / kRowTilesPerHalfWarp * 16), static_cast<unsigned>(k / kTile));
  quantize_row_kernel<<<grid, kThreads, 0, stream>>>(
      x, m, k, codes, scales, nonfinite_ptr(status));
  FLOWMOE_LAUNCH_CHECK(what);
}

void quantize_col(const bf16_t* x, int64_t k, const SegmentBlocks& sb, uint8_t* col_codes,
                  uint8_t* col_scales, uint8_t* row_codes, uint8_t* row_scales,
                  DeviceStatus* status, cudaStream_t stream) {
  const char* what = "cuda::quantize_col";
  check_k(k, kTile, what);
  check_blocks(sb, what);
  if (sb.m == 0) return;
  check_aligned(x, "x", what);
  check_aligned(col_codes, "col_codes", what);
  FLOWMOE_CHECK(col_scales, what << ": col_scales is null");
  FLOWMOE_CHECK((row_codes == nullptr) == (row_scales == nullptr),
                what << ": give both row_codes and row_scales, or neither");
  if (row_codes) check_aligned(row_codes, "row_codes", what);
  const dim3 grid = tile_grid(sb.max_blocks, k / kTile);
  quantize_col_kernel<<<grid, kThreads, 0, stream>>>(x, sb.m, k, sb.block_start, sb.block_end,
                                                     col_codes, col_scales, row_codes, row_scales,
                                                     nonfinite_ptr(status));
  FLOWMOE_LAUNCH_CHECK(what);
}

void dequantize_row(const uint8_t* codes, const uint8_t* scales, int64_t m, int64_t k, bf16_t* y,
                    cudaStream_t stream) {
  const char* what = "cuda::dequantize_row";
  check_k(k, kTile, what);
  FLOWMOE_CHECK(m >= 0, what << ": M = " << m << " must be >= 0");
  if (m == 0) return;
  check_aligned(codes, "codes", what);
  check_aligned(y, "y", what);
  FLOWMOE_CHECK(scales, what << ": scales is null");
  dequantize_row_kernel<<<grid_for(m * k / 16), kThreads, 0, stream>>>(codes, scales, m, k, y);
  FLOWMOE_LAUNCH_CHECK(what);
}

void transpose_bf16(const bf16_t* x, int64_t m, int64_t k, bf16_t* y, cudaStream_t stream) {
  const char* what = "cuda::transpose_bf16";
  FLOWMOE_CHECK(m >= 0 && k > 0, what << ": shape [" << m << ", " << k << "] invalid");
  if (m == 0) return;
  check_aligned(x, "x", what);
  check_aligned(y, "y", what);
  FLOWMOE_CHECK((m + 63) / 64 < 65536, what << ": M = " << m << " too large (max 4194240)");
  dim3 grid(static_cast<unsigned>((k + 63) / 64), static_cast<unsigned>((m + 63) / 64));
  transpose_bf16_kernel<<<grid, kThreads, 0, stream>>>(x, m, k, y);
  FLOWMOE_LAUNCH_CHECK(what);
}

void quantize_transposed(const bf16_t* xt, int64_t k, const SegmentBlocks& sb, uint8_t* codes,
                         uint8_t* scales, DeviceStatus* status, cudaStream_t stream) {
  const char* what = "cuda::quantize_transposed";
  FLOWMOE_CHECK(k > 0, what << ": K = " << k << " must be > 0");
  check_blocks(sb, what);
  if (sb.m == 0) return;
  check_aligned(xt, "xt", what);
  check_aligned(codes, "codes", what);
  FLOWMOE_CHECK(scales, what << ": scales is null");
  FLOWMOE_CHECK((k + 7) / 8 < 65536, what << ": K = " << k << " too large (at most 524280)");
  dim3 grid(static_cast<unsigned>(sb.max_blocks), static_cast<unsigned>((k + 7) / 8));
  quantize_transposed_kernel<<<grid, kThreads, 0, stream>>>(xt, sb.m, k, sb.block_start, sb.block_end,
                                                            codes, scales, nonfinite_ptr(status));
  FLOWMOE_LAUNCH_CHECK(what);
}

}  // namespace cuda
}  // namespace flowmoe
