// The tile schedule of the grouped row-tiled kernels (FP8 sm90_fp8_grouped_1x128.cu, BF16
// sm90_bf16_grouped.cu): expert e owns ceil(M_e / 128) token tiles times n_tiles feature tiles,
// numbered expert after expert; every CTA of a persistent launch builds the same table in shared
// memory from the device offsets and walks tiles blockIdx.x, + gridDim.x, ...
#pragma once

#include <cstdint>

#include "cuda/common.cuh"
#include "cuda/sm90/arch.cuh"

namespace flowmoe {
namespace cuda {
namespace sm90 {

#ifdef FLOWMOE_SM90A
// Run by one whole warp after s_off[0 .. E] holds the offsets: validates them (0 = o[0], or 0 <= o[0]
// with allow_base, <= ... <=
// o[E] <= m) and writes s_start[e], the first tile of expert e, and *s_total, the tile count (0
// when the offsets are malformed: nothing is computed or written, and block 0 counts it once in
// *bad, which may be null). Lane l takes experts [l c, l c + c).
__device__ __forceinline__ void build_row_tile_schedule(const int* s_off, int E, int m, int n_tiles, int* s_start,
                                                        int* s_total, unsigned long long* bad, bool allow_base) {
  constexpr int kTile = 128;
  const int lane = threadIdx.x % 32, c = (E + 31) / 32, e0 = min(E, lane * c), e1 = min(E, e0 + c);
  // allow_base: o[0] > 0 is a range of a larger launch's experts (a group of the caller-memory
  // layer's dgrads; the rows before o[0] are neither read nor written). Only the plain row kernels
  // take it: the fused epilogues number their column-scale blocks from o[0] = 0.
  bool wrong = lane == 0 && ((allow_base ? s_off[0] < 0 : s_off[0] != 0) || s_off[E] > m);
  int sum = 0;
  for (int e = e0; e < e1; ++e) {
    const int me = s_off[e + 1] - s_off[e];
    wrong |= me < 0;
    sum += (max(me, 0) + kTile - 1) / kTile * n_tiles;
  }
  int incl = sum;
  for (int o = 1; o < 32; o <<= 1) {
    const int v = __shfl_up_sync(0xffffffffu, incl, o);
    if (lane >= o) incl += v;
  }
  int run = incl - sum;
  for (int e = e0; e < e1; ++e) {
    s_start[e] = run;
    run += (max(s_off[e + 1] - s_off[e], 0) + kTile - 1) / kTile * n_tiles;
  }
  const bool any_wrong = __any_sync(0xffffffffu, wrong);
  if (lane == 31) *s_total = any_wrong ? 0 : incl;
  if (lane == 0 && any_wrong && blockIdx.x == 0 && bad) atomicAdd(bad, 1ull);
}

// Tile `tile` of that schedule: its expert, the expert's first row and row count, the token tile's
// first row within the expert and the feature tile. Within an expert the token tiles run fastest (a
// wave of CTAs shares the expert's weight rows in L2), or with `features_fastest` the feature tiles
// (a wave shares the token rows: where the activation rows are long, e.g. GEMM2's dgrad over
// H = 7168, 132 token tiles of them would not fit L2 and each feature tile would read them again
// from memory).
struct RowTile {
  int e, off, rows, local0, nt;
};
__device__ __forceinline__ RowTile row_tile(const int* s_off, const int* s_start, int E, int tile,
                                            bool features_fastest = false, int n_tiles = 1) {
  RowTile r;
  r.e = detail::last_at_or_below(s_start, E, tile);
  r.off = s_off[r.e];
  r.rows = s_off[r.e + 1] - r.off;
  const int mt_count = (r.rows + 127) / 128, i = tile - s_start[r.e];
  r.local0 = (features_fastest ? i / n_tiles : i % mt_count) * 128;
  r.nt = features_fastest ? i % n_tiles : i / mt_count;
  return r;
}
#endif  // FLOWMOE_SM90A

}  // namespace sm90
}  // namespace cuda
}  // namespace flowmoe
