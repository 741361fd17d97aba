// The wgrad kernels' epilogue (FP8 sm90_fp8_wgrad_1x128.cu, BF16 sm90_bf16_grouped.cu): one
// warpgroup's 64 x 128 FP32 half of an output tile goes through shared memory into dW by TMA
// stores (dW = in FP32 or, rounded once to BF16, in BF16) or TMA reduce-adds (FP32 dW +=), which
// run on while the warpgroup computes its next tile.
#pragma once

#include <cuda.h>

#include <cstdint>

#include "cuda/sm90/arch.cuh"
#include "cuda/sm90/fence.cuh"
#include "cuda/sm90/tma.cuh"
#include "flowmoe/numerics.h"

namespace flowmoe {
namespace cuda {
namespace sm90 {

// One warpgroup's staging buffer: four 64-row x 32-column FP32 boxes (the FP32 dW tensor map's
// box: 64 x 32, CU_TENSOR_MAP_SWIZZLE_128B), 32 KB; BF16 output uses its first 16 KB as two
// 64 x 64 BF16 boxes (also 128-byte rows, swizzled).
constexpr int kWgradEpiBytes = 64 * 128 * 4;

// How a wgrad kernel writes dW [E * N, K]: FP32 overwritten, FP32 added to (TMA reduce-add), or
// BF16 overwritten with each FP32 sum rounded once (RNE, numerics.h f32_to_bf16): the gradient of
// a BF16 parameter with no FP32 copy and no rounding pass.
enum class WgradStore : int { kF32 = 0, kF32Add = 1, kBf16 = 2 };

inline int wgrad_store_bytes(WgradStore s) { return s == WgradStore::kBf16 ? 2 : 4; }

// dW's tensor map for the epilogue below: rows E * N, columns K, 128-byte swizzled boxes; with
// `experts` > 0 a 3-D map [experts][rows][cols] instead (each expert's matrix clipped at its edges:
// a stored dW smaller than the tiles, gemm.h WgradOut::stored).
inline CUtensorMap wgrad_dw_map(void* dw, WgradStore s, int64_t rows, int64_t cols, const char* what,
                                int64_t experts = 0) {
  const bool b16 = s == WgradStore::kBf16;
  const auto type = b16 ? CU_TENSOR_MAP_DATA_TYPE_BFLOAT16 : CU_TENSOR_MAP_DATA_TYPE_FLOAT32;
  const int elem = b16 ? 2 : 4;
  const uint32_t box_cols = b16 ? 64 : 32;
  if (experts > 0)
    return make_tensor_map_3d(dw, type, elem, uint64_t(experts), uint64_t(rows), uint64_t(cols), 64, box_cols,
                              CU_TENSOR_MAP_SWIZZLE_128B, what);
  return make_tensor_map_2d(dw, type, elem, uint64_t(rows), uint64_t(cols), 64, box_cols, CU_TENSOR_MAP_SWIZZLE_128B,
                            what);
}

// Why a wgrad kernel cannot write dW [N, K] stored as [E][rows][cols] (gemm.h StoredDw; rows = 0:
// not stored), or null: both kernels' rule (the 3-D map's 16-byte rows, the interleave's K/2
// boundary on a 128-column tile).
inline const char* stored_dw_unsupported(int64_t rows, int64_t cols, bool interleaved, int64_t n, int64_t k,
                                         bool out_bf16) {
  if (rows <= 0) return nullptr;
  if (rows > n || cols <= 0 || cols > k) return "a stored dW larger than [N, K] (or with no columns)";
  if (cols * (out_bf16 ? 2 : 4) % 16 != 0) return "a stored dW whose rows are not a multiple of 16 bytes";
  if (interleaved && k % 256 != 0) return "interleaved gate / up columns need K a multiple of 256";
  return nullptr;
}

#ifdef FLOWMOE_SM90A
// Two FP32 sums rounded to BF16 (RNE) by one cvt, packed lo | hi << 16; a NaN as numerics.h's
// f32_to_bf16 writes it (quiet, sign and payload kept) instead of the instruction's canonical NaN.
__device__ __forceinline__ uint32_t bf16x2_rne(float lo, float hi) {
  uint32_t r;
  asm("cvt.rn.bf16x2.f32 %0, %1, %2;" : "=r"(r) : "f"(hi), "f"(lo));
  if (lo != lo || hi != hi) r = num::f32_to_bf16(lo) | (uint32_t(num::f32_to_bf16(hi)) << 16);
  return r;
}

// acc: the warpgroup's m64n128 FP32 fragment (thread t of the warpgroup holds rows r0, r0 + 8 and
// columns 8 j + c0, + 1). `ebuf` may still be read by this warpgroup's previous bulk operations
// when `wait_first`: thread 0 waits for them first. Writes the half into ebuf (16-byte chunk c of
// row q at c ^ (q % 8): the TMA's 128-byte swizzle), then thread 0 issues the bulk operations at
// dW rows orow .., columns ocol .. (of matrix `expert` of a 3-D map, when >= 0) and commits them.
// `bar_id`: the warpgroup's named barrier. kInterleaved: the half's columns are a gate half
// [0, 64) and an up half [64, 128), written alternating (gate j at 2 j, up j at 2 j + 1).
template <bool kInterleaved = false>
__device__ __forceinline__ void wgrad_half_to_global(const float* acc, float* ebuf, bool wait_first, int t, int r0,
                                                     int c0, int bar_id, const CUtensorMap* map_dw, int store,
                                                     int orow, int ocol, int expert = -1) {
  if (wait_first && t == 0) bulk_wait_read_all();
  named_sync(bar_id, 128);
  const auto swizzled = [](int q, int byte) { return q * 128 + ((((byte >> 4) ^ (q & 7)) << 4) | (byte & 15)); };
  if constexpr (kInterleaved) {  // a column pair of the fragment lands two columns apart
    const bool b16 = store == int(WgradStore::kBf16);
    uint8_t* eb = reinterpret_cast<uint8_t*>(ebuf);
#pragma unroll
    for (int j = 0; j < 16; ++j) {
      const int cc = 8 * j + c0, oc = cc < 64 ? 2 * cc : 2 * (cc - 64) + 1;  // (cc + 1 goes to oc + 2)
#pragma unroll
      for (int rh = 0; rh < 2; ++rh) {
        const float v0 = acc[4 * j + 2 * rh], v1 = acc[4 * j + 2 * rh + 1];
        const int q = r0 + 8 * rh;
        if (b16) {
          const uint32_t pair = bf16x2_rne(v0, v1);  // (one cvt for both, as the plain path)
          uint8_t* box = eb + (oc / 64) * (64 * 128);
          *reinterpret_cast<uint16_t*>(box + swizzled(q, (oc % 64) * 2)) = uint16_t(pair);
          *reinterpret_cast<uint16_t*>(box + swizzled(q, ((oc + 2) % 64) * 2)) = uint16_t(pair >> 16);
        } else {
          uint8_t* box = eb + (oc / 32) * (64 * 128);
          *reinterpret_cast<float*>(box + swizzled(q, (oc % 32) * 4)) = v0;
          *reinterpret_cast<float*>(box + swizzled(q, ((oc + 2) % 32) * 4)) = v1;
        }
      }
    }
  } else if (store == int(WgradStore::kBf16)) {
    uint8_t* eb = reinterpret_cast<uint8_t*>(ebuf);
#pragma unroll
    for (int j = 0; j < 16; ++j) {
      const int cc = 8 * j + c0;  // column in the half
      uint8_t* box = eb + (cc / 64) * (64 * 128);
#pragma unroll
      for (int rh = 0; rh < 2; ++rh)
        *reinterpret_cast<uint32_t*>(box + swizzled(r0 + 8 * rh, (cc % 64) * 2)) =
            bf16x2_rne(acc[4 * j + 2 * rh], acc[4 * j + 2 * rh + 1]);
    }
  } else {
#pragma unroll
    for (int j = 0; j < 16; ++j) {
      const int cc = 8 * j + c0;
      float* box = ebuf + (cc / 32) * (64 * 32);
#pragma unroll
      for (int rh = 0; rh < 2; ++rh)
        *reinterpret_cast<float2*>(reinterpret_cast<uint8_t*>(box) + swizzled(r0 + 8 * rh, (cc % 32) * 4)) =
            make_float2(acc[4 * j + 2 * rh], acc[4 * j + 2 * rh + 1]);
    }
  }
  fence_async_smem();  // the writes above before the async proxy reads them
  named_sync(bar_id, 128);
  if (t == 0) {
    const bool b16 = store == int(WgradStore::kBf16), add = store == int(WgradStore::kF32Add);
    const int boxes = b16 ? 2 : 4, box_cols = b16 ? 64 : 32;
#pragma unroll
    for (int b = 0; b < 4; ++b) {
      if (b >= boxes) break;
      const void* src = reinterpret_cast<uint8_t*>(ebuf) + b * (64 * 128);
      const int col = ocol + box_cols * b;
      if (expert >= 0) {
        if (add)
          tma_reduce_add_3d(map_dw, src, col, orow, expert);
        else
          tma_store_3d(map_dw, src, col, orow, expert);
      } else if (add) {
        tma_reduce_add_2d(map_dw, src, col, orow);
      } else {
        tma_store_2d(map_dw, src, col, orow);
      }
    }
    bulk_commit();
  }
}
#endif  // FLOWMOE_SM90A

}  // namespace sm90
}  // namespace cuda
}  // namespace flowmoe
