// Device building blocks shared by the conversion kernels: fast encoders proven equal to the
// numerics core, and the byte-tile transpose that writes column-wise codes.
#pragma once

#include <cuda_fp16.h>
#include <cuda_fp8.h>

#include "cuda/common.cuh"
#include "flowmoe/cuda/convert.h"
#include "flowmoe/numerics.h"

namespace flowmoe {
namespace cuda {
namespace detail {

constexpr int kTile = 128;          // tokens x features of one column-wise tile
constexpr int kThreads = 256;       // threads of the tile kernels
constexpr int kBytePitch = kTile + 16;  // smem byte-tile row pitch (keeps 16-byte alignment)

// E4M3 (saturating RNE) of two finite floats, hardware conversion on sm_89+. Bit-identical to
// num::f32_to_e4m3 on finite input (GPU tests compare every kernel with the CPU reference).
__device__ __forceinline__ uint16_t e4m3x2(float a, float b) {
  return static_cast<uint16_t>(__nv_cvt_float2_to_fp8x2(make_float2(a, b), __NV_SATFINITE, __NV_E4M3));
}

// num::e4m3_saturate_for_scale on four packed codes of a finite tile with scale exponent e: the
// decoded saturation at the top of the binary32 range (a no-op below num::kE4M3SaturateScaleExp).
__device__ __forceinline__ uint32_t e4m3x4_saturate_for_scale(uint32_t w, int e) {
  if (e < num::kE4M3SaturateScaleExp) return w;
  const uint32_t lim = num::e4m3_max_code_for_scale(e) * 0x01010101u;
  return __vminu4(w & 0x7F7F7F7Fu, lim) | (w & 0x80808080u);
}
// num::e2m1_saturate_for_scale on the `count` packed E2M1 nibbles of w (low nibble first).
__device__ __forceinline__ uint32_t e2m1x8_saturate_for_scale(uint32_t w, int e, int count = 8) {
  if (e < num::kE2M1SaturateScaleExp) return w;
  uint32_t out = 0;
  for (int i = 0; i < count; ++i)
    out |= static_cast<uint32_t>(num::e2m1_saturate_for_scale(static_cast<uint8_t>((w >> (4 * i)) & 0xFu), e)) << (4 * i);
  return out;
}

// Two E2M1 nibbles (a in bits 0-3, b in bits 4-7) of finite a, b with |a|, |b| <= 6: the
// thresholds of num::e2m1_encode_bounded evaluated on packed halves (one HSET2 per threshold for
// both values). Exact whenever a and b carry at most 11 significant bits (true for a BF16 value
// times a power of two): such a value >= 2^-14 converts to half exactly, and a smaller one stays
// below the first threshold (0.25) after rounding, which is all the thresholds see; the sign is
// taken from the binary32 bits. Tested bit for bit through the MXFP4 kernels' GPU tests.
__device__ __forceinline__ uint32_t e2m1x2_bounded(float a, float b) {
  const __half2 m = __habs2(__floats2half2_rn(a, b));
  const auto th = [](unsigned short bits) { return __halves2half2(__ushort_as_half(bits), __ushort_as_half(bits)); };
  uint32_t cnt = __hgt2_mask(m, th(0x3400)) & 0x00010001u;   // > 0.25
  cnt += __hge2_mask(m, th(0x3A00)) & 0x00010001u;           // >= 0.75
  cnt += __hgt2_mask(m, th(0x3D00)) & 0x00010001u;           // > 1.25
  cnt += __hge2_mask(m, th(0x3F00)) & 0x00010001u;           // >= 1.75
  cnt += __hgt2_mask(m, th(0x4100)) & 0x00010001u;           // > 2.5
  cnt += __hge2_mask(m, th(0x4300)) & 0x00010001u;           // >= 3.5
  cnt += __hgt2_mask(m, th(0x4500)) & 0x00010001u;           // > 5
  return (cnt & 7u) | ((__float_as_uint(a) >> 28) & 8u) | (((cnt >> 16) & 7u) << 4) |
         ((__float_as_uint(b) >> 24) & 0x80u);
}

// 1 / 2^e for a scale exponent e in [-127, 126]: always a binary32 normal.
__device__ __forceinline__ float inv_pow2(int e) { return __uint_as_float(static_cast<uint32_t>(127 - e) << 23); }

__device__ __forceinline__ bool bf16_finite(uint16_t h) { return (h & 0x7F80u) != 0x7F80u; }

// Largest |bf16| bit pattern among 8 values (a uint4), by per-halfword integer max: absolute
// values of finite bf16 order like their bits, and any result >= 0x7F80 means a NaN or Inf.
constexpr uint32_t kBf16NonFiniteBits = 0x7F80u;
__device__ __forceinline__ uint32_t absmax8_bits(const uint4& v) {
  const uint32_t m = __vmaxu2(__vmaxu2(v.x & 0x7FFF7FFFu, v.y & 0x7FFF7FFFu),
                              __vmaxu2(v.z & 0x7FFF7FFFu, v.w & 0x7FFF7FFFu));
  return max(m & 0xFFFFu, m >> 16);
}
// max over groups of `width` lanes (a power of two <= 32)
__device__ __forceinline__ uint32_t group_max_u(uint32_t v, int width) {
  for (int o = width / 2; o > 0; o >>= 1) v = max(v, __shfl_xor_sync(0xffffffffu, v, o));
  return v;
}
__device__ __forceinline__ int count_nonfinite8(const uint4& v) {
  const uint32_t w[4] = {v.x, v.y, v.z, v.w};
  int n = 0;
#pragma unroll
  for (int i = 0; i < 4; ++i) n += ((w[i] & 0x7F80u) == 0x7F80u) + ((w[i] & 0x7F800000u) == 0x7F800000u);
  return n;
}
// Counts the non-finite values of v into *counter; cheap when the warp has none (the usual case).
__device__ __forceinline__ void count_nonfinite_warp(unsigned long long* counter, const uint4& v, bool any) {
  if (__any_sync(0xffffffffu, any)) warp_count(counter, count_nonfinite8(v));
}
__device__ __forceinline__ float bf16_bits_to_f32(uint32_t bits) { return __uint_as_float(bits << 16); }

// Transposes a 4x4 byte block: r[i] holds row i (4 bytes); c[f] receives column f.
__device__ __forceinline__ void transpose4x4(const uint32_t r0, const uint32_t r1, const uint32_t r2,
                                             const uint32_t r3, uint32_t c[4]) {
  const uint32_t a = __byte_perm(r0, r1, 0x5140), b = __byte_perm(r2, r3, 0x5140);
  const uint32_t a2 = __byte_perm(r0, r1, 0x7362), b2 = __byte_perm(r2, r3, 0x7362);
  c[0] = __byte_perm(a, b, 0x5410);
  c[1] = __byte_perm(a, b, 0x7632);
  c[2] = __byte_perm(a2, b2, 0x5410);
  c[3] = __byte_perm(a2, b2, 0x7632);
}

// One store task: features 4g..4g+3 of tokens t0..t0+15 (word_at(r): the tile's 32-bit word
// holding bytes 4g..4g+3 of row r), 4x4 byte transposes in registers, four 16-byte stores (byte
// stores for a partial token group or when `vec` is false).
template <typename WordAt>
__device__ __forceinline__ void store_col_task(WordAt word_at, int g, int t0, int n, uint8_t* out,
                                               int64_t ld, bool vec) {
  uint32_t col[4][4];  // [feature][token quad]
#pragma unroll
  for (int q = 0; q < 4; ++q) {
    const int r = t0 + 4 * q;
    uint32_t c[4];
    transpose4x4(word_at(r), word_at(r + 1), word_at(r + 2), word_at(r + 3), c);
#pragma unroll
    for (int f = 0; f < 4; ++f) col[f][q] = c[f];
  }
#pragma unroll
  for (int f = 0; f < 4; ++f) {
    uint8_t* dst = out + (4 * g + f) * ld + t0;
    if (vec && t0 + 16 <= n) {
      *reinterpret_cast<uint4*>(dst) = make_uint4(col[f][0], col[f][1], col[f][2], col[f][3]);
    } else {
      for (int t = 0; t < min(16, n - t0); ++t) dst[t] = static_cast<uint8_t>(col[f][t >> 2] >> (8 * (t & 3)));
    }
  }
}

// Writes the column-wise codes of one tile: s_tile holds [token][feature] bytes (pitch
// kBytePitch, rows >= n zero) for `n` valid tokens; feature f goes to out[f * ld + token].
// A task is 4 features x 16 tokens: 16 word reads (a warp reads 32 consecutive words of one row,
// no bank conflict), 4x4 byte transposes in registers, four 16-byte stores. `vec`: out + f*ld is
// 16-byte aligned for every f; partial token groups fall back to byte stores.
__device__ __forceinline__ void store_col_tile(const uint8_t* s_tile, int n, uint8_t* out,
                                               int64_t ld, bool vec) {
  for (int task = threadIdx.x; task < (kTile / 4) * (kTile / 16); task += blockDim.x) {
    const int g = task % (kTile / 4);
    const int t0 = (task / (kTile / 4)) * 16;
    if (t0 >= n) continue;
    store_col_task(
        [&](int r) { return *reinterpret_cast<const uint32_t*>(s_tile + r * kBytePitch + 4 * g); }, g, t0, n,
        out, ld, vec);
  }
}

// ---- swizzled byte tile (pitch 128, no padding) -------------------------------------------------
// Row r's 16-byte chunk c lives at chunk c ^ ((r / 16) % 8) of the row. Writing whole chunks of a
// row is conflict-free either way; the swizzle makes the column reads of store_col_tile_swz hit 32
// different banks although its lanes read rows 16 apart.
constexpr int kSwzBytes = kTile * kTile;
__device__ __forceinline__ int swz_chunk(int row, int chunk) { return row * kTile + ((chunk ^ ((row >> 4) & 7)) << 4); }
__device__ __forceinline__ int swz_word(int row, int byte_col) {  // byte_col a multiple of 4
  return swz_chunk(row, byte_col >> 4) + (byte_col & 15);
}

// store_col_tile for the swizzled tile, with coalesced global stores: task = (token group j of 16
// tokens, feature quad g); the 8 lanes of a group cover one feature row's 128 tokens, so each warp
// store instruction writes four full 128-byte row segments (store_col_tile writes 32 rows x 16 B).
__device__ __forceinline__ void store_col_tile_swz(const uint8_t* s_tile, int n, uint8_t* out, int64_t ld,
                                                   bool vec) {
  for (int task = threadIdx.x; task < (kTile / 4) * (kTile / 16); task += blockDim.x) {
    const int j = task & 7, g = task >> 3;
    const int t0 = j * 16;
    if (t0 >= n) continue;
    store_col_task([&](int r) { return *reinterpret_cast<const uint32_t*>(s_tile + swz_word(r, 4 * g)); }, g, t0,
                   n, out, ld, vec);
  }
}

// ---- column-amax keys (TransposeExponent::kColumnAmax) ------------------------------------------
// The tile kernels give thread t the 16 features of chunk t % 8 (16 * (t % 8) .. + 15) of 4 rows.
// Its column-amax keys (numerics.h: e4m3_amax_key, e2m1_amax_key) are 8 words of two 16-bit lanes:
// word 2q + (p & 1), lane p >> 1 holds feature 16 * (t % 8) + 4q + p. Returns, in thread
// f < kTile, the largest key of feature f over the CTA (0 elsewhere). Every thread of the CTA
// must call it (warp shuffles and one __syncthreads); s_key holds (kThreads / 32) * 64 words.
constexpr int kKeyWords = 8;
__device__ __forceinline__ int column_max_key(uint32_t (&key)[kKeyWords], uint32_t* s_key) {
#pragma unroll
  for (int w = 0; w < kKeyWords; ++w) {  // lanes l, l ^ 8, l ^ 16, l ^ 24 hold the same chunk
    key[w] = __vmaxu2(key[w], __shfl_xor_sync(0xffffffffu, key[w], 8));
    key[w] = __vmaxu2(key[w], __shfl_xor_sync(0xffffffffu, key[w], 16));
  }
  const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
  if (lane < 8) {
#pragma unroll
    for (int w = 0; w < kKeyWords; ++w) s_key[(warp * 8 + lane) * kKeyWords + w] = key[w];
  }
  __syncthreads();
  int best = 0;
  if (threadIdx.x < kTile) {
    const int f = threadIdx.x, ch = f >> 4, q = (f >> 2) & 3, p = f & 3;
    const int w = 2 * q + (p & 1), sh = 16 * (p >> 1);
    for (int wp = 0; wp < kThreads / 32; ++wp)
      best = max(best, static_cast<int>((s_key[(wp * 8 + ch) * kKeyWords + w] >> sh) & 0xFFFFu));
  }
  return best;
}

// The 16 target scale codes of a thread's chunk (s_target[16 * chunk ..], 16-byte aligned), as
// four words, with their minimum and maximum.
struct ChunkTargets {
  uint32_t t[4];
  int tmin, tmax;
  // Per byte 16 - (target - e) for a row of scale code e whose shifts all lie in [-15, 15]
  // (then in [1, 31], computed without borrows), else 0 (every byte takes the slow path).
  __device__ __forceinline__ uint32_t shift_bytes(int q, int e) const {
    if (tmax - e > 15 || tmin - e < -15) return 0u;
    const uint32_t tminw = 0x01010101u * static_cast<uint32_t>(tmin);
    return 0x01010101u * static_cast<uint32_t>(16 + e - tmin) - (t[q] - tminw);
  }
};
__device__ __forceinline__ ChunkTargets load_chunk_targets(const uint8_t* s_target, int chunk) {
  ChunkTargets c;
  const uint4 v = *reinterpret_cast<const uint4*>(s_target + 16 * chunk);
  c.t[0] = v.x;
  c.t[1] = v.y;
  c.t[2] = v.z;
  c.t[3] = v.w;
  const uint32_t mn = __vminu4(__vminu4(v.x, v.y), __vminu4(v.z, v.w));
  const uint32_t mx = __vmaxu4(__vmaxu4(v.x, v.y), __vmaxu4(v.z, v.w));
  c.tmin = static_cast<int>(min(min(mn & 0xFF, (mn >> 8) & 0xFF), min((mn >> 16) & 0xFF, mn >> 24)));
  c.tmax = static_cast<int>(max(max(mx & 0xFF, (mx >> 8) & 0xFF), max((mx >> 16) & 0xFF, mx >> 24)));
  return c;
}

// ---- host-side argument checks shared by the launchers -------------------------------------
namespace host {
inline void check_aligned(const void* p, const char* name, const char* what) {
  FLOWMOE_CHECK(p != nullptr, what << ": " << name << " is null; expected a device buffer");
  FLOWMOE_CHECK(detail::aligned16(p), what << ": " << name
                                           << " is not 16-byte aligned; expected a cudaMalloc'd "
                                              "buffer or an offset that is a multiple of 16 bytes");
}

inline void check_k(int64_t k, int block, const char* what) {
  FLOWMOE_CHECK(k > 0 && k % block == 0, what << ": K = " << k << " must be a positive multiple of "
                                              << block << " (the quantization block)");
}

inline void check_blocks(const SegmentBlocks& sb, const char* what) {
  FLOWMOE_CHECK(sb.block_start && sb.block_end,
                what << ": segment blocks not built; call build_segment_blocks first");
  FLOWMOE_CHECK(sb.m >= 0 && sb.max_blocks >= segment_max_blocks(sb.m, sb.num_segments),
                what << ": SegmentBlocks.max_blocks = " << sb.max_blocks << " < ceil(M/128) + E = "
                     << segment_max_blocks(sb.m, sb.num_segments));
}

// Tile kernels run one CTA per (128-token block, 128-feature tile), token blocks fastest along
// blockIdx.x (the faster order for the scaling-aware transpose and quantize_col: with K tiles
// fastest both were slower at the DeepSeek-V3 EP8 shape).
inline dim3 tile_grid(int64_t max_blocks, int64_t k_tiles) {
  FLOWMOE_CHECK(k_tiles < 65536, "K = " << k_tiles * 128 << " too large (at most 65535 tiles of 128)");
  FLOWMOE_CHECK(max_blocks < (1ll << 31), "too many token blocks: " << max_blocks);
  return dim3(static_cast<unsigned>(max_blocks), static_cast<unsigned>(k_tiles));
}

inline unsigned long long* nonfinite_ptr(DeviceStatus* st) { return st ? &st->nonfinite : nullptr; }

inline unsigned grid_for(int64_t threads) {
  const int64_t g = (threads + kThreads - 1) / kThreads;
  FLOWMOE_CHECK(g < (1ll << 31), "problem too large for one launch: " << g << " blocks");
  return static_cast<unsigned>(g);
}

}  // namespace host

// (token block, K tile) of this CTA, matching host::tile_grid.
__device__ __forceinline__ void tile_coords(int64_t& b, int64_t& kt) {
  b = blockIdx.x;
  kt = blockIdx.y;
}

}  // namespace detail
}  // namespace cuda
}  // namespace flowmoe
