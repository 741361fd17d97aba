// MXFP4: BF16ToFP4Row, FP4RowToFP8Row, FP4RowToFP8Col (fused dequantize + transpose +
// requantize; row-max or column-amax exponent) and the stepwise FP4 -> BF16 -> transpose -> quantize baseline.
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

// E2M1 magnitude (3 bits) -> E4M3 code of value * 2^-d, for every shift d in [-6, 19] (d >= 19
// gives zero for every magnitude, so larger shifts use row 19). Built on the host from the
// numerics core, passed by value, copied to shared memory. Each row is 8 bytes (one per
// magnitude) in two words, so that __byte_perm looks up four magnitudes at once.
constexpr int kShiftMin = -6, kShiftMax = 19, kShifts = kShiftMax - kShiftMin + 1;
struct ShiftTable {
  uint32_t lo[kShifts], hi[kShifts];            // codes of magnitudes 0-3 and 4-7
  uint32_t lost_lo[kShifts], lost_hi[kShifts];  // 1 where that magnitude is not exact
};

const ShiftTable& shift_table() {
  static const ShiftTable table = [] {
    ShiftTable t{};
    for (int d = kShiftMin; d <= kShiftMax; ++d) {
      const int row = d - kShiftMin;
      for (uint32_t mag = 0; mag < 8; ++mag) {
        bool lost = false;
        const uint32_t c = e4m3_encode_shifted(e2m1_to_f32(static_cast<uint8_t>(mag)), d, &lost);
        const uint32_t sh = 8 * (mag & 3);
        (mag < 4 ? t.lo[row] : t.hi[row]) |= c << sh;
        (mag < 4 ? t.lost_lo[row] : t.lost_hi[row]) |= static_cast<uint32_t>(lost) << sh;
      }
    }
    return t;
  }();
  return table;
}

__device__ __forceinline__ void load_table(const ShiftTable& src, ShiftTable& dst) {
  if (threadIdx.x < kShifts) {
    dst.lo[threadIdx.x] = src.lo[threadIdx.x];
    dst.hi[threadIdx.x] = src.hi[threadIdx.x];
    dst.lost_lo[threadIdx.x] = src.lost_lo[threadIdx.x];
    dst.lost_hi[threadIdx.x] = src.lost_hi[threadIdx.x];
  }
}

// 16 packed e2m1 values (8 bytes) -> 16 e4m3 codes, all shifted down by d: per four values one
// byte permute for the magnitudes and a few bit operations that move each sign to bit 7.
__device__ __forceinline__ uint4 fp4x16_to_fp8(uint2 in, int d, const ShiftTable& t, int& lost) {
  const int row = min(d, kShiftMax) - kShiftMin;
  const uint32_t lo = t.lo[row], hi = t.hi[row], llo = t.lost_lo[row], lhi = t.lost_hi[row];
  const bool may_lose = (llo | lhi) != 0;
  uint32_t out[4];
#pragma unroll
  for (int q = 0; q < 4; ++q) {
    const uint32_t x = ((q < 2 ? in.x : in.y) >> (16 * (q & 1))) & 0xFFFFu;  // 4 nibbles
    const uint32_t sel = x & 0x7777u;
    uint32_t y = (x & 0xFFu) | ((x & 0xFF00u) << 8);      // nibble pairs in bytes 0 and 2
    y = (y & 0x000F000Fu) | ((y & 0x00F000F0u) << 4);     // one nibble per byte
    out[q] = __byte_perm(lo, hi, sel) | ((y & 0x08080808u) << 4);
    if (may_lose) lost += __popc(__byte_perm(llo, lhi, sel));
  }
  return make_uint4(out[0], out[1], out[2], out[3]);
}

// ---- K7: BF16ToFP4Row. 8 values per chunk, a quad of lanes per 32-value block, two chunks per
// thread (both loads issued first).
constexpr int kFp4ChunksPerThread = 2;
__global__ void __launch_bounds__(kThreads)
quantize_mxfp4_kernel(const bf16_t* __restrict__ x, int64_t nchunks, uint32_t* __restrict__ codes,
                      uint8_t* __restrict__ scales, unsigned long long* nonfinite) {
  const int64_t first = static_cast<int64_t>(blockIdx.x) * blockDim.x + threadIdx.x;
  const int64_t stride = static_cast<int64_t>(gridDim.x) * blockDim.x;
  uint4 v[kFp4ChunksPerThread];
#pragma unroll
  for (int c = 0; c < kFp4ChunksPerThread; ++c) {
    const int64_t chunk = first + c * stride;
    v[c] = chunk < nchunks ? __ldg(reinterpret_cast<const uint4*>(x) + chunk) : make_uint4(0, 0, 0, 0);
  }
#pragma unroll
  for (int c = 0; c < kFp4ChunksPerThread; ++c) {
    const int64_t chunk = first + c * stride;
    const uint32_t w[4] = {v[c].x, v[c].y, v[c].z, v[c].w};
    const uint32_t amax_bits = detail::group_max_u(detail::absmax8_bits(v[c]), 4);
    const bool block_bad = amax_bits >= detail::kBf16NonFiniteBits;
    detail::count_nonfinite_warp(nonfinite, v[c], block_bad);
    const float amax = detail::bf16_bits_to_f32(amax_bits);
    if (chunk >= nchunks) continue;
    const int e = e2m1_scale_exp(amax);
    const float inv = detail::inv_pow2(e);
    uint32_t out = 0;
    if (!block_bad) {
#pragma unroll
      for (int q = 0; q < 4; ++q)
        out |= detail::e2m1x2_bounded(__uint_as_float(w[q] << 16) * inv, __uint_as_float(w[q] & 0xFFFF0000u) * inv)
               << (8 * q);
      out = detail::e2m1x8_saturate_for_scale(out, e);
    }
    codes[chunk] = out;
    if ((threadIdx.x & 3) == 0) scales[chunk >> 2] = block_bad ? kUE8M0NaN : ue8m0_from_exp(e);
  }
}

// ---- K8: FP4RowToFP8Row. 16 values per thread, 8 threads per 128-value tile; blockIdx.y is the
// K tile and x walks the tokens, so neighbouring tiles write neighbouring scale bytes ([K/128][M]).
__global__ void __launch_bounds__(kThreads)
fp4_to_fp8_row_kernel(const uint8_t* __restrict__ fp4_codes, const uint8_t* __restrict__ fp4_scales,
                      int64_t m, int64_t k, uint8_t* __restrict__ codes, uint8_t* __restrict__ scales,
                      DeviceStatus* status, const __grid_constant__ ShiftTable table,
                      const int32_t* __restrict__ m_bound) {
  __shared__ ShiftTable s_t;
  load_table(table, s_t);
  __syncthreads();
  const int64_t gid = static_cast<int64_t>(blockIdx.x) * blockDim.x + threadIdx.x;
  const int64_t r = gid >> 3, b = blockIdx.y;  // token, K tile (no integer division)
  const int part = gid & 7;
  const bool valid = r < detail::bounded_rows(m, m_bound);  // m stays the scale grid's stride
  int lost = 0;
  if (valid) {
    const uint32_t es = *reinterpret_cast<const uint32_t*>(fp4_scales + r * (k / 32) + b * 4);
    const uint2 in = __ldg(reinterpret_cast<const uint2*>(fp4_codes + r * (k / 2) + b * 64) + part);
    int cmax = 0, bad = 0;
#pragma unroll
    for (int j = 0; j < 4; ++j) {
      const int e = (es >> (8 * j)) & 0xFF;
      if (e == kUE8M0NaN) ++bad;
      else cmax = max(cmax, e);
    }
    const int sc = fp8_scale_code_from_fp4_max(cmax);
    uint4 out;
    if (bad) {
      out = make_uint4(0x7F7F7F7Fu, 0x7F7F7F7Fu, 0x7F7F7F7Fu, 0x7F7F7F7Fu);
      if (part == 0 && status) atomicAdd(&status->nonfinite, static_cast<unsigned long long>(bad) * 32);
    } else {
      out = fp4x16_to_fp8(in, sc - static_cast<int>((es >> (8 * (part >> 1))) & 0xFF), s_t, lost);
    }
    reinterpret_cast<uint4*>(codes + r * k + b * kTile)[part] = out;
    if (part == 0) scales[b * m + r] = bad ? kUE8M0NaN : static_cast<uint8_t>(sc);
  }
  detail::warp_count(status ? &status->underflow : nullptr, lost);
}

// ---- K9: FP4RowToFP8Col, one CTA per (128-token block, 128-feature tile): dequantize,
// transpose and requantize in one pass through a shared-memory byte tile.
__global__ void __launch_bounds__(kThreads)
fp4_to_fp8_col_kernel(const uint8_t* __restrict__ fp4_codes, const uint8_t* __restrict__ fp4_scales,
                      int64_t m, int64_t k, const int32_t* __restrict__ bstart,
                      const int32_t* __restrict__ bend, uint8_t* __restrict__ col_codes,
                      uint8_t* __restrict__ col_scales, DeviceStatus* status,
                      const __grid_constant__ ShiftTable table) {
  __shared__ __align__(16) uint8_t s_q[detail::kSwzBytes];
  __shared__ uint32_t s_e[kTile];  // the 4 group exponents of each token
  __shared__ int s_max[4], s_bad[4];
  __shared__ int s_wmax[kTile / 32][4], s_wbad[kTile / 32][4];
  __shared__ ShiftTable s_t;
  int64_t b, kt;
  detail::tile_coords(b, kt);
  const int bs = bstart[b];
  if (bs < 0) return;
  const int n = bend[b] - bs;
  const int tid = threadIdx.x;
  uint2 in[4];
#pragma unroll
  for (int i = 0; i < 4; ++i) {
    const int c = i * kThreads + tid, row = c >> 3, part = c & 7;
    in[i] = row < n ? __ldg(reinterpret_cast<const uint2*>(fp4_codes + (bs + row) * (k / 2) + kt * 64) + part)
                    : make_uint2(0, 0);
  }
  load_table(table, s_t);
  if (tid < kTile) {
    const uint32_t es = tid < n ? *reinterpret_cast<const uint32_t*>(fp4_scales + (bs + tid) * (k / 32) + kt * 4) : 0u;
    s_e[tid] = es;
#pragma unroll
    for (int j = 0; j < 4; ++j) {
      const uint32_t e = (es >> (8 * j)) & 0xFFu;
      const unsigned wmax = __reduce_max_sync(0xffffffffu, e == kUE8M0NaN ? 0u : e);
      const unsigned wbad = __reduce_add_sync(0xffffffffu, e == kUE8M0NaN ? 1u : 0u);
      if ((tid & 31) == 0) {
        s_wmax[tid >> 5][j] = static_cast<int>(wmax);
        s_wbad[tid >> 5][j] = static_cast<int>(wbad);
      }
    }
  }
  __syncthreads();
  if (tid < 4) {
    s_max[tid] = max(max(s_wmax[0][tid], s_wmax[1][tid]), max(s_wmax[2][tid], s_wmax[3][tid]));
    s_bad[tid] = s_wbad[0][tid] + s_wbad[1][tid] + s_wbad[2][tid] + s_wbad[3][tid];
  }
  __syncthreads();
  int lost = 0;
#pragma unroll
  for (int i = 0; i < 4; ++i) {
    const int c = i * kThreads + tid;
    const int row = c >> 3, part = c & 7, j = part >> 1;
    uint4 v = make_uint4(0, 0, 0, 0);
    if (row < n) {
      if (s_bad[j]) {
        v = make_uint4(0x7F7F7F7Fu, 0x7F7F7F7Fu, 0x7F7F7F7Fu, 0x7F7F7F7Fu);
      } else {
        const int d = fp8_scale_code_from_fp4_max(s_max[j]) - static_cast<int>((s_e[row] >> (8 * j)) & 0xFF);
        v = fp4x16_to_fp8(in[i], d, s_t, lost);
      }
    }
    *reinterpret_cast<uint4*>(&s_q[detail::swz_chunk(row, part)]) = v;
  }
  detail::warp_count(status ? &status->underflow : nullptr, lost);
  if (tid < kTile) {
    const int j = tid >> 5;
    col_scales[b * k + kt * kTile + tid] = s_bad[j] ? kUE8M0NaN : static_cast<uint8_t>(fp8_scale_code_from_fp4_max(s_max[j]));
  }
  if (tid == 0 && status) {
    const int bad = s_bad[0] + s_bad[1] + s_bad[2] + s_bad[3];
    if (bad) atomicAdd(&status->nonfinite, static_cast<unsigned long long>(bad) * 32);
  }
  __syncthreads();
  detail::store_col_tile_swz(s_q, n, col_codes + (kt * kTile) * m + bs, m, (m % 16 == 0) && (bs % 16 == 0));
}

// ---- K9 with the column-amax exponent (TransposeExponent::kColumnAmax) --------------------------
// Four packed e2m1 values (16 bits) -> one per byte (bits 0-2 magnitude, bit 3 sign).
__device__ __forceinline__ uint32_t e2m1x4_bytes(uint2 in, int q) {
  const uint32_t x = ((q < 2 ? in.x : in.y) >> (16 * (q & 1))) & 0xFFFFu;
  const uint32_t y = (x & 0xFFu) | ((x & 0xFF00u) << 8);
  return (y & 0x000F000Fu) | ((y & 0x00F000F0u) << 4);
}

// Column-amax keys (num::e2m1_amax_key: e + (mag >> 1) + 1, 0 for a zero) of the 4 values of y
// under group scale code e, folded into the lane maxima (bytes 0 and 2 in even, 1 and 3 in odd).
__device__ __forceinline__ void e2m1_keys4(uint32_t y, int e, uint32_t& even, uint32_t& odd) {
  const uint32_t mag = y & 0x07070707u;
  const uint32_t nz = ((mag + 0x7F7F7F7Fu) >> 7) & 0x01010101u;  // 1 per non-zero magnitude
  const uint32_t key = ((mag >> 1) & 0x03030303u) + nz;
  const uint32_t ue = static_cast<uint32_t>(e);
  even = __vmaxu2(even, (key & 0x00FF00FFu) + ue * (nz & 0x00FF00FFu));
  odd = __vmaxu2(odd, ((key >> 8) & 0x00FF00FFu) + ue * ((nz >> 8) & 0x00FF00FFu));
}

// The 4 values of y under group scale code e -> E4M3 codes under the target codes t4 (one per
// byte), as cpu::fp4_to_fp8_col does: zeros keep their sign, others RNE(P * 2^(e - t)).
__device__ __noinline__ uint2 e2m1x4_colamax_slow(uint32_t y, uint32_t t4, int e) {
  uint32_t out = 0;
  int lost = 0;
  for (int p = 0; p < 4; ++p) {
    const uint8_t nib = static_cast<uint8_t>((y >> (8 * p)) & 0xFu);
    uint32_t c = (nib & 8u) << 4;
    if (nib & 7u) {
      bool l = false;
      c = e4m3_encode_shifted(e2m1_to_f32(nib), static_cast<int>((t4 >> (8 * p)) & 0xFF) - e, &l);
      lost += l;
    }
    out |= c << (8 * p);
  }
  return make_uint2(out, static_cast<uint32_t>(lost));
}
// Fast path: dd holds 16 - (t - e) per byte (in [1, 31]; 0 when the row's shifts leave
// [-15, 15]). A non-zero value P = (1 + h/2) * 2^(E2 - 1) (E2 = mag >> 1; mag 1 is 0.5 = 2^-1)
// encodes to exponent field E2 + 6 - (t - e) = x - 10 with x = E2 + dd, mantissa 4h (0 for mag 1):
// exact where that field is >= 1 (x >= 11). The column's amax keeps it <= 15.
__device__ __forceinline__ uint32_t e2m1x4_to_e4m3_colamax(uint32_t y, uint32_t dd, uint32_t t4, int e, int& lost) {
  const uint32_t mag = y & 0x07070707u;
  const uint32_t e2 = (mag >> 1) & 0x03030303u;
  const uint32_t nz = (mag + 0x7F7F7F7Fu) & 0x80808080u;  // bit 7 set per non-zero magnitude
  const uint32_t x = e2 + dd;                             // bytes <= 34: no carries below
  if ((((x + 0x75757575u) | ~nz) & 0x80808080u) == 0x80808080u) {
    const uint32_t nzb = (nz >> 7) * 0xFFu;
    const uint32_t xe = (x & nzb) | (0x0A0A0A0Au & ~nzb);            // zeros: field 0
    const uint32_t e2nz = ((e2 + 0x7F7F7F7Fu) >> 7) & 0x01010101u;  // 1 where E2 >= 1
    return ((xe - 0x0A0A0A0Au) << 3) | ((mag & e2nz) << 2) | ((y & 0x08080808u) << 4);
  }
  const uint2 r = e2m1x4_colamax_slow(y, t4, e);
  lost += static_cast<int>(r.y);
  return r.x;
}

// One CTA per (128-token block, 128-feature tile), laid out like K9: pass 1 folds the values
// into per-feature amax keys (reduced over the CTA), pass 2 encodes each value under its
// column's target exponent.
__global__ void __launch_bounds__(kThreads, 5)
fp4_to_fp8_col_colamax_kernel(const uint8_t* __restrict__ fp4_codes, const uint8_t* __restrict__ fp4_scales,
                              int64_t m, int64_t k, const int32_t* __restrict__ bstart,
                              const int32_t* __restrict__ bend, uint8_t* __restrict__ col_codes,
                              uint8_t* __restrict__ col_scales, DeviceStatus* status) {
  __shared__ __align__(16) uint8_t s_q[detail::kSwzBytes];
  __shared__ __align__(16) uint8_t s_target[kTile];
  __shared__ uint32_t s_e[kTile];  // the 4 group exponents of each token
  __shared__ uint32_t s_key[(kThreads / 32) * 8 * detail::kKeyWords];
  __shared__ int s_wbad[kTile / 32][4];
  int64_t b, kt;
  detail::tile_coords(b, kt);
  const int bs = bstart[b];
  if (bs < 0) return;
  const int n = bend[b] - bs;
  const int tid = threadIdx.x, part = tid & 7, j = part >> 1;
  uint2 in[4];
#pragma unroll
  for (int i = 0; i < 4; ++i) {
    const int row = i * (kThreads / 8) + (tid >> 3);
    in[i] = row < n ? __ldg(reinterpret_cast<const uint2*>(fp4_codes + (bs + row) * (k / 2) + kt * 64) + part)
                    : make_uint2(0, 0);
  }
  if (tid < kTile) {
    const uint32_t es = tid < n ? *reinterpret_cast<const uint32_t*>(fp4_scales + (bs + tid) * (k / 32) + kt * 4) : 0u;
    s_e[tid] = es;
#pragma unroll
    for (int g = 0; g < 4; ++g) {
      const unsigned wbad = __reduce_add_sync(0xffffffffu, ((es >> (8 * g)) & 0xFFu) == kUE8M0NaN ? 1u : 0u);
      if ((tid & 31) == 0) s_wbad[tid >> 5][g] = static_cast<int>(wbad);
    }
  }
  __syncthreads();
  const auto group_bad = [&](int g) { return s_wbad[0][g] + s_wbad[1][g] + s_wbad[2][g] + s_wbad[3][g]; };
  const bool bad = group_bad(j) != 0;  // a NaN group scale: the group's 32 column blocks are NaN

  uint32_t key[detail::kKeyWords] = {0, 0, 0, 0, 0, 0, 0, 0};
#pragma unroll
  for (int i = 0; i < 4; ++i) {
    const int row = i * (kThreads / 8) + (tid >> 3);
    if (row >= n || bad) continue;
    const int e = static_cast<int>((s_e[row] >> (8 * j)) & 0xFFu);
#pragma unroll
    for (int q = 0; q < 4; ++q) e2m1_keys4(e2m1x4_bytes(in[i], q), e, key[2 * q], key[2 * q + 1]);
  }
  const int best = detail::column_max_key(key, s_key);
  if (tid < kTile) {
    const bool tile_bad = group_bad(tid >> 5) != 0;
    const uint8_t t = static_cast<uint8_t>(scale_code_from_e2m1_amax_key(best));
    s_target[tid] = tile_bad ? 0 : t;
    col_scales[b * k + kt * kTile + tid] = tile_bad ? kUE8M0NaN : t;
  }
  __syncthreads();
  const detail::ChunkTargets ct = detail::load_chunk_targets(s_target, part);
  int lost = 0;
#pragma unroll
  for (int i = 0; i < 4; ++i) {
    const int row = i * (kThreads / 8) + (tid >> 3);
    uint4 v = make_uint4(0, 0, 0, 0);
    if (row < n) {
      if (bad) {
        v = make_uint4(0x7F7F7F7Fu, 0x7F7F7F7Fu, 0x7F7F7F7Fu, 0x7F7F7F7Fu);
      } else {
        const int e = static_cast<int>((s_e[row] >> (8 * j)) & 0xFFu);
        uint32_t out[4];
#pragma unroll
        for (int q = 0; q < 4; ++q)
          out[q] = e2m1x4_to_e4m3_colamax(e2m1x4_bytes(in[i], q), ct.shift_bytes(q, e), ct.t[q], e, lost);
        v = make_uint4(out[0], out[1], out[2], out[3]);
      }
    }
    *reinterpret_cast<uint4*>(&s_q[detail::swz_chunk(row, part)]) = v;
  }
  detail::warp_count(status ? &status->underflow : nullptr, lost);
  if (tid == 0 && status) {
    const int nbad = group_bad(0) + group_bad(1) + group_bad(2) + group_bad(3);
    if (nbad) atomicAdd(&status->nonfinite, static_cast<unsigned long long>(nbad) * 32);
  }
  __syncthreads();
  detail::store_col_tile_swz(s_q, n, col_codes + (kt * kTile) * m + bs, m, (m % 16 == 0) && (bs % 16 == 0));
}

// ---- K10: MXFP4 -> bf16 (exact), 16 values per thread. For scale codes >= 2 every value is a
// bf16 normal whose bits follow from the nibble directly (up to code 252); other codes (bf16
// subnormals) and NaN scales go through the numerics core.
__device__ __forceinline__ uint32_t e2m1_to_bf16_bits(uint32_t nib, int s) {
  const uint32_t mag = nib & 7u;
  // per magnitude 1..7 (0.5, 1, 1.5, 2, 3, 4, 6): exponent offset + 1 and the mantissa bit
  const uint32_t e = static_cast<uint32_t>(s - 1) + ((0x33221100u >> (4 * mag)) & 0xFu);
  const uint32_t bits = mag ? ((e << 7) | (((0xA8u >> mag) & 1u) << 6)) : 0u;
  return bits | ((nib & 8u) << 12);
}

__global__ void __launch_bounds__(kThreads)
dequantize_mxfp4_kernel(const uint8_t* __restrict__ codes, const uint8_t* __restrict__ scales,
                        int64_t nchunks, bf16_t* __restrict__ y) {
  const int64_t chunk = static_cast<int64_t>(blockIdx.x) * blockDim.x + threadIdx.x;
  if (chunk >= nchunks) return;
  const uint8_t s = __ldg(scales + (chunk >> 1));  // 16 values per chunk, 32 per scale
  const uint2 in = __ldg(reinterpret_cast<const uint2*>(codes) + chunk);
  uint32_t out[8];
  const bool fast = s >= 2 && s <= 252;  // larger scales can overflow to Inf: slow path
#pragma unroll
  for (int i = 0; i < 8; ++i) {
    const uint32_t byte = ((i < 4 ? in.x : in.y) >> (8 * (i & 3))) & 0xFFu;
    if (fast) {
      out[i] = e2m1_to_bf16_bits(byte & 0xFu, s) | (e2m1_to_bf16_bits(byte >> 4, s) << 16);
    } else {
      const uint16_t lo = f32_to_bf16(dequant_e2m1(static_cast<uint8_t>(byte & 0xF), s));
      const uint16_t hi = f32_to_bf16(dequant_e2m1(static_cast<uint8_t>(byte >> 4), s));
      out[i] = lo | (static_cast<uint32_t>(hi) << 16);
    }
  }
  uint4* dst = reinterpret_cast<uint4*>(y) + chunk * 2;
  dst[0] = make_uint4(out[0], out[1], out[2], out[3]);
  dst[1] = make_uint4(out[4], out[5], out[6], out[7]);
}

}  // namespace

void quantize_mxfp4(const bf16_t* x, int64_t m, int64_t k, uint8_t* codes, uint8_t* scales,
                    DeviceStatus* status, cudaStream_t stream) {
  const char* what = "cuda::quantize_mxfp4";
  check_k(k, 32, what);
  FLOWMOE_CHECK(m >= 0, what << ": M = " << m << " must be >= 0");
  if (m == 0) return;
  check_aligned(x, "x", what);
  check_aligned(codes, "codes", what);
  FLOWMOE_CHECK(scales, what << ": scales is null");
  const int64_t nchunks = m * k / 8;
  quantize_mxfp4_kernel<<<grid_for((nchunks + kFp4ChunksPerThread - 1) / kFp4ChunksPerThread), kThreads, 0, stream>>>(
      x, nchunks, reinterpret_cast<uint32_t*>(codes), scales, nonfinite_ptr(status));
  FLOWMOE_LAUNCH_CHECK(what);
}

void fp4_to_fp8_row(const uint8_t* fp4_codes, const uint8_t* fp4_scales, int64_t m, int64_t k,
                    uint8_t* codes, uint8_t* scales, DeviceStatus* status, cudaStream_t stream,
                    const int32_t* rows_bound) {
  const char* what = "cuda::fp4_to_fp8_row";
  check_k(k, kTile, what);
  FLOWMOE_CHECK(m >= 0, what << ": M = " << m << " must be >= 0");
  if (m == 0) return;
  check_aligned(fp4_codes, "fp4_codes", what);
  FLOWMOE_CHECK(fp4_scales && (reinterpret_cast<uintptr_t>(fp4_scales) & 3u) == 0,
                what << ": fp4_scales must be a 4-byte aligned device buffer");
  check_aligned(codes, "codes", what);
  FLOWMOE_CHECK(scales, what << ": scales is null");
  FLOWMOE_CHECK(k / kTile < 65536, what << ": K = " << k << " too large (at most 65535 tiles of 128)");
  const dim3 grid(grid_for(m * 8), static_cast<unsigned>(k / kTile));
  fp4_to_fp8_row_kernel<<<grid, kThreads, 0, stream>>>(
      fp4_codes, fp4_scales, m, k, codes, scales, status, shift_table(), rows_bound);
  FLOWMOE_LAUNCH_CHECK(what);
}

void fp4_to_fp8_col(const uint8_t* fp4_codes, const uint8_t* fp4_scales, int64_t k,
                    const SegmentBlocks& sb, uint8_t* col_codes, uint8_t* col_scales,
                    DeviceStatus* status, cudaStream_t stream, TransposeExponent mode) {
  const char* what = "cuda::fp4_to_fp8_col";
  check_k(k, kTile, what);
  check_blocks(sb, what);
  if (sb.m == 0) return;
  check_aligned(fp4_codes, "fp4_codes", what);
  FLOWMOE_CHECK(fp4_scales && (reinterpret_cast<uintptr_t>(fp4_scales) & 3u) == 0,
                what << ": fp4_scales must be a 4-byte aligned device buffer");
  check_aligned(col_codes, "col_codes", what);
  FLOWMOE_CHECK(col_scales, what << ": col_scales is null");
  const dim3 grid = tile_grid(sb.max_blocks, k / kTile);
  if (mode == TransposeExponent::kColumnAmax) {
    fp4_to_fp8_col_colamax_kernel<<<grid, kThreads, 0, stream>>>(
        fp4_codes, fp4_scales, sb.m, k, sb.block_start, sb.block_end, col_codes, col_scales, status);
    FLOWMOE_LAUNCH_CHECK(what);
    return;
  }
  fp4_to_fp8_col_kernel<<<grid, kThreads, 0, stream>>>(fp4_codes, fp4_scales, sb.m, k, sb.block_start,
                                                       sb.block_end, col_codes, col_scales, status,
                                                       shift_table());
  FLOWMOE_LAUNCH_CHECK(what);
}

void dequantize_mxfp4(const uint8_t* codes, const uint8_t* scales, int64_t m, int64_t k,
                      bf16_t* y, cudaStream_t stream) {
  const char* what = "cuda::dequantize_mxfp4";
  check_k(k, 32, what);
  FLOWMOE_CHECK(m >= 0, what << ": M = " << m << " must be >= 0");
  if (m == 0) return;
  check_aligned(codes, "codes", what);
  check_aligned(y, "y", what);
  FLOWMOE_CHECK(scales, what << ": scales is null");
  const int64_t nchunks = m * k / 16;
  dequantize_mxfp4_kernel<<<grid_for(nchunks), kThreads, 0, stream>>>(codes, scales, nchunks, y);
  FLOWMOE_LAUNCH_CHECK(what);
}

void fp4_to_fp8_col_stepwise(const uint8_t* fp4_codes, const uint8_t* fp4_scales, int64_t k,
                             const SegmentBlocks& sb, uint8_t* col_codes, uint8_t* col_scales,
                             bf16_t* work, DeviceStatus* status, cudaStream_t stream) {
  const char* what = "cuda::fp4_to_fp8_col_stepwise";
  check_k(k, kTile, what);
  check_blocks(sb, what);
  if (sb.m == 0) return;
  check_aligned(work, "work", what);
  bf16_t* x = work;
  bf16_t* xt = work + sb.m * k;
  dequantize_mxfp4(fp4_codes, fp4_scales, sb.m, k, x, stream);
  transpose_bf16(x, sb.m, k, xt, stream);
  quantize_transposed(xt, k, sb, col_codes, col_scales, status, stream);
}

}  // namespace cuda
}  // namespace flowmoe
