// The wgrad kernels' epilogue (FP8 sm90_fp8_wgrad_1x128.cu, BF16 sm90_bf16_grouped.cu): one
// warpgroup's 64 x 128 FP32 half of an output tile goes through shared memory into dW by TMA
// stores (dW =) or TMA reduce-adds (dW +=), which run on while the warpgroup computes its next tile.
#pragma once

#include <cuda.h>

#include <cstdint>

#include "cuda/sm90/arch.cuh"
#include "cuda/sm90/fence.cuh"
#include "cuda/sm90/tma.cuh"

namespace flowmoe {
namespace cuda {
namespace sm90 {

// One warpgroup's staging buffer: four 64-row x 32-column FP32 boxes (the dW tensor map's box:
// 64 x 32, CU_TENSOR_MAP_SWIZZLE_128B), 32 KB.
constexpr int kWgradEpiBytes = 64 * 128 * 4;

#ifdef FLOWMOE_SM90A
// acc: the warpgroup's m64n128 FP32 fragment (thread t of the warpgroup holds rows r0, r0 + 8 and
// columns 8 j + c0, + 1). `ebuf` may still be read by this warpgroup's previous bulk operations
// when `wait_first`: thread 0 waits for them first. Writes the half into ebuf (16-byte chunk c of
// row q at c ^ (q % 8): the TMA's 128-byte swizzle), then thread 0 issues the four bulk operations
// at dW rows orow .., columns ocol .. and commits them. `bar_id`: the warpgroup's named barrier.
__device__ __forceinline__ void wgrad_half_to_global(const float* acc, float* ebuf, bool wait_first, int t, int r0,
                                                     int c0, int bar_id, const CUtensorMap* map_dw, bool accumulate,
                                                     int orow, int ocol) {
  if (wait_first && t == 0) bulk_wait_read_all();
  named_sync(bar_id, 128);
#pragma unroll
  for (int j = 0; j < 16; ++j) {
    const int cc = 8 * j + c0;  // column in the half
    float* box = ebuf + (cc / 32) * (64 * 32);
    const int byte = (cc % 32) * 4;
#pragma unroll
    for (int rh = 0; rh < 2; ++rh) {
      const int q = r0 + 8 * rh;
      const int off = q * 128 + ((((byte >> 4) ^ (q & 7)) << 4) | (byte & 15));
      *reinterpret_cast<float2*>(reinterpret_cast<uint8_t*>(box) + off) =
          make_float2(acc[4 * j + 2 * rh], acc[4 * j + 2 * rh + 1]);
    }
  }
  fence_async_smem();  // the writes above before the async proxy reads them
  named_sync(bar_id, 128);
  if (t == 0) {
#pragma unroll
    for (int b = 0; b < 4; ++b) {
      if (accumulate)
        tma_reduce_add_2d(map_dw, ebuf + b * (64 * 32), ocol + 32 * b, orow);
      else
        tma_store_2d(map_dw, ebuf + b * (64 * 32), ocol + 32 * b, orow);
    }
    bulk_commit();
  }
}
#endif  // FLOWMOE_SM90A

}  // namespace sm90
}  // namespace cuda
}  // namespace flowmoe
