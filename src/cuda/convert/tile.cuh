// Device building blocks shared by the conversion kernels: fast encoders proven equal to the
// numerics core, and the byte-tile transpose that writes column-wise codes.
#pragma once

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

// 1 / 2^e for a scale exponent e in [-127, 126]: always a binary32 normal.
__device__ __forceinline__ float inv_pow2(int e) { return __uint_as_float(static_cast<uint32_t>(127 - e) << 23); }

__device__ __forceinline__ bool bf16_finite(uint16_t h) { return (h & 0x7F80u) != 0x7F80u; }

// Writes the column-wise codes of one tile: s_tile holds [token][feature] bytes (pitch
// kBytePitch) for `n` valid tokens; feature f goes to out[f * ld + token]. 16-byte stores where
// `vec` (out + f*ld 16-byte aligned for all f) and the 16 tokens are all valid, bytes otherwise.
__device__ __forceinline__ void store_col_tile(const uint8_t* s_tile, int n, uint8_t* out,
                                               int64_t ld, bool vec) {
  // task = (token group j of 16, feature f); a warp covers 32 consecutive features of one j, so
  // its shared-memory reads are 32 consecutive bytes of one row (no bank conflict).
  for (int task = threadIdx.x; task < kTile * (kTile / 16); task += blockDim.x) {
    const int f = task % kTile;
    const int j = task / kTile;
    const int t0 = j * 16;
    if (t0 >= n) continue;
    uint8_t* dst = out + f * ld + t0;
    if (vec && t0 + 16 <= n) {
      uint32_t w[4];
#pragma unroll
      for (int q = 0; q < 4; ++q) {
        const uint8_t* src = s_tile + (t0 + 4 * q) * kBytePitch + f;
        w[q] = static_cast<uint32_t>(src[0]) | (static_cast<uint32_t>(src[kBytePitch]) << 8) |
               (static_cast<uint32_t>(src[2 * kBytePitch]) << 16) |
               (static_cast<uint32_t>(src[3 * kBytePitch]) << 24);
      }
      *reinterpret_cast<uint4*>(dst) = make_uint4(w[0], w[1], w[2], w[3]);
    } else {
      for (int t = t0; t < min(t0 + 16, n); ++t) dst[t - t0] = s_tile[t * kBytePitch + f];
    }
  }
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

inline unsigned long long* nonfinite_ptr(DeviceStatus* st) { return st ? &st->nonfinite : nullptr; }

inline unsigned grid_for(int64_t threads) {
  const int64_t g = (threads + kThreads - 1) / kThreads;
  FLOWMOE_CHECK(g < (1ll << 31), "problem too large for one launch: " << g << " blocks");
  return static_cast<unsigned>(g);
}

}  // namespace host

}  // namespace detail
}  // namespace cuda
}  // namespace flowmoe
