// The BF16 grouped kernel's output epilogue (sm90_bf16_grouped.cu): one warpgroup's 64-row half of
// a 128 x kBN output tile into D [m, n_out]. The FP8 grouped kernel (sm90_fp8_grouped_1x128.cu)
// writes its tiles the same way, inline: calling this function there changed ptxas's register
// assignment of its promotion loop and measured 3-6% slower at V3 and V2-Lite in both orders of one
// call (docs/GEMM.md, "The BF16 kernels"), so the two copies are kept on purpose.
#pragma once

#include <cuda.h>
#include <cuda_bf16.h>

#include <cstdint>

#include "cuda/sm90/arch.cuh"
#include "cuda/sm90/fence.cuh"
#include "cuda/sm90/tma.cuh"
#include "flowmoe/tensor.h"

namespace flowmoe {
namespace cuda {
namespace sm90 {

// A 64 x 64 BF16 store box: 64 rows of 128 bytes. A warpgroup's staging buffer holds kBN / 64 of
// them (the D tensor map's box: 64 x 64, CU_TENSOR_MAP_SWIZZLE_128B).
constexpr int kRowsBoxBytes = 64 * 128;

#ifdef FLOWMOE_SM90A
// acc: the warpgroup's kHalves m64n128 FP32 fragments (thread t holds rows r0, r0 + 8 and columns
// 8 j + c0, + 1 of each 128-column half). `row0`: the half's first row of D; `rows`: how many of
// its 64 rows belong to the expert (the others are another expert's or past the segments, never
// written). A full half goes through `ebuf` as BF16 (16-byte chunk c of row q at c ^ (q % 8): the
// TMA's 128-byte swizzle, conflict-free writes) and out by TMA stores one thread issues; the
// warpgroup goes on to its next tile, and the buffer is waited for (read) only when the next full
// half refills it. A partial half (an expert's last token tile) stores BF16 from the fragments.
// `bar_id`: the warpgroup's named barrier.
// kSplit (the bf16 kernel's Mode::kDgradSplit): the tile's columns are gate / up pairs (column 2 i
// the gate's, 2 i + 1 the up's of pair i); D's columns [0, n_out / 2) take the gates and
// [n_out / 2, n_out) the ups, the tile's pairs from pair col0 / 2 on: the gates and the ups staged
// as boxes of their own (same swizzle) and stored apart.
template <int kHalves, bool kSplit = false>
__device__ __forceinline__ void rows_half_to_global(const float (&acc)[kHalves][64], uint8_t* ebuf,
                                                    const CUtensorMap* map_d, bf16_t* d, int n_out, int64_t row0,
                                                    int rows, int col0, int t, int r0, int c0, int bar_id) {
  if (rows >= 64) {
    if (t == 0) bulk_wait_read_all();
    named_sync(bar_id, 128);
#pragma unroll
    for (int h = 0; h < kHalves; ++h)
#pragma unroll
      for (int j = 0; j < 16; ++j) {
        uint8_t* box = ebuf + (2 * h + j / 8) * kRowsBoxBytes;
        const int pair = 4 * j + c0 / 2;  // (split) of the half's 64
#pragma unroll
        for (int rh = 0; rh < 2; ++rh) {
          const int q = r0 + 8 * rh;
          if constexpr (kSplit) {
            const int off = q * 128 + (((pair / 8) ^ (q % 8)) << 4) + 2 * (pair % 8);
            *reinterpret_cast<__nv_bfloat16*>(ebuf + h * kRowsBoxBytes + off) =
                __float2bfloat16_rn(acc[h][4 * j + 2 * rh]);
            *reinterpret_cast<__nv_bfloat16*>(ebuf + (kHalves + h) * kRowsBoxBytes + off) =
                __float2bfloat16_rn(acc[h][4 * j + 2 * rh + 1]);
          } else {
            *reinterpret_cast<__nv_bfloat162*>(box + q * 128 + (((j % 8) ^ (q % 8)) << 4) + 2 * c0) =
                __floats2bfloat162_rn(acc[h][4 * j + 2 * rh], acc[h][4 * j + 2 * rh + 1]);
          }
        }
      }
    fence_async_smem();  // the writes above before the async proxy reads them
    named_sync(bar_id, 128);
    if (t == 0) {
      if constexpr (kSplit) {  // boxes [0, kHalves) the gates, then the ups
#pragma unroll
        for (int h = 0; h < kHalves; ++h) {
          tma_store_2d(map_d, ebuf + h * kRowsBoxBytes, col0 / 2 + 64 * h, int(row0));
          tma_store_2d(map_d, ebuf + (kHalves + h) * kRowsBoxBytes, n_out / 2 + col0 / 2 + 64 * h, int(row0));
        }
      } else {
#pragma unroll
        for (int b = 0; b < 2 * kHalves; ++b) tma_store_2d(map_d, ebuf + b * kRowsBoxBytes, col0 + 64 * b, int(row0));
      }
      bulk_commit();
    }
  } else if constexpr (kSplit) {
      const bool v0 = r0 < rows, v1 = r0 + 8 < rows;
      bf16_t* dst = d + row0 * n_out + col0 / 2 + c0 / 2;
      const int up = n_out / 2;
#pragma unroll
      for (int h = 0; h < kHalves; ++h)
#pragma unroll
        for (int j = 0; j < 16; ++j) {
          bf16_t* q = dst + h * 64 + 4 * j;
          if (v0) {
            reinterpret_cast<__nv_bfloat16*>(q + int64_t(r0) * n_out)[0] = __float2bfloat16_rn(acc[h][4 * j + 0]);
            reinterpret_cast<__nv_bfloat16*>(q + int64_t(r0) * n_out + up)[0] = __float2bfloat16_rn(acc[h][4 * j + 1]);
          }
          if (v1) {
            reinterpret_cast<__nv_bfloat16*>(q + int64_t(r0 + 8) * n_out)[0] = __float2bfloat16_rn(acc[h][4 * j + 2]);
            reinterpret_cast<__nv_bfloat16*>(q + int64_t(r0 + 8) * n_out + up)[0] =
                __float2bfloat16_rn(acc[h][4 * j + 3]);
          }
        }
  } else {
      bf16_t* dst = d + row0 * n_out + col0 + c0;
      const bool v0 = r0 < rows, v1 = r0 + 8 < rows;
#pragma unroll
      for (int h = 0; h < kHalves; ++h)
#pragma unroll
        for (int j = 0; j < 16; ++j) {
          bf16_t* q = dst + h * 128 + 8 * j;
          if (v0)
            *reinterpret_cast<__nv_bfloat162*>(q + int64_t(r0) * n_out) =
                __floats2bfloat162_rn(acc[h][4 * j + 0], acc[h][4 * j + 1]);
          if (v1)
            *reinterpret_cast<__nv_bfloat162*>(q + int64_t(r0 + 8) * n_out) =
                __floats2bfloat162_rn(acc[h][4 * j + 2], acc[h][4 * j + 3]);
        }
  }
}
#endif  // FLOWMOE_SM90A

}  // namespace sm90
}  // namespace cuda
}  // namespace flowmoe
