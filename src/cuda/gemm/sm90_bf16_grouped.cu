// BF16 grouped GEMMs on sm_90a for the bf16 recipe on device segments: fprop, dgrad and wgrad,
// each one persistent kernel over all experts whose token offsets it reads from device memory, so
// no host needs the per-expert counts (docs/GEMM.md, "The BF16 kernels").
//
//   fprop  D_e [M_e, N] = X_e . W_e^T          A = X  (K-major), B = W  (K-major)
//   dgrad  D_e [M_e, K] = dY_e . W_e           A = dY (K-major), B = W  (MN-major: read as stored)
//   wgrad  dW_e [N, K] (+)= dY_e^T . X_e       A = dY (MN-major), B = X (MN-major), over the tokens
//
// BF16 WGMMA reads either major-ness from shared memory, so every operand is loaded as it lies in
// memory: no transposed copy of the weights for dgrad, no column copies of dY and X for wgrad.
//
// Schedule. Output tiles are 128 x kBN (kBN = 256 when the output width allows, else 128). fprop
// and dgrad tile the rows expert by expert (grouped_row_schedule.cuh: an expert's last token tile
// partial, the epilogue writing rows below M_e only); wgrad tiles every expert's [N, K] gradient and
// reduces over the expert's tokens (multiples of 128: no stage mixes two experts). CTAs take tiles
// blockIdx.x, + gridDim.x, ...
//
// CTA: 3 warpgroups. Warpgroup 0: one thread issues the TMA loads of a ring of stages, 64
// reduction elements deep (128-byte swizzle: a K-major tile is one box of 128-byte rows, an
// MN-major one boxes of 64 k-rows x 64 elements). Warpgroups 1 and 2: output rows 0-63 and 64-127;
// per stage four WGMMAs (m64nKBNk16, one per 16-deep step over all kBN columns) straight into the
// FP32 accumulators, one stage's group left running while the next is issued (its stage released
// when it completes).
// Epilogue, through shared memory by TMA while the warpgroup computes its next tile: fprop and
// dgrad stage BF16 halves (the FP8 kernel's epilogue: rows_tma_epilogue.cuh; an expert's partial
// last tile from the fragments, rows below M_e only), wgrad FP32 halves stored or reduce-added
// into dW (wgrad_tma_epilogue.cuh).
//
// Stored wgrad outputs (gemm.h StoredDw; the caller swaps the operands, so that dW is the stored
// weight's gradient): Mode::kWgradStored writes [E][rows][cols] through a 3-D map that clips each
// expert's padding; kWgradInterleaved (128-wide tiles) also loads a tile's B columns as a gate box
// and an up box (up_offset apart) and writes them alternating, gpt-oss's gate_up_proj columns.
// Each is an instantiation of its own: the plain wgrad's code is unchanged.
//
// Stored weights in fprop / dgrad (gemm.h StoredW; Params::b_stored): B through a 3-D map, each
// expert's W^T [rows][cols] at its own coordinate, so that rows and columns past the stored ones
// (a padded layer's) read as zeros rather than the next expert's; fprop reads it MN-major, dgrad
// K-major (the transposes of the layer's W). Mode::kDgradSplit (fprop of gate_up_proj): the tile's
// columns are gate / up pairs, and its epilogue (rows_half_to_global<kHalves, true>) writes the gates and
// the ups to D's two halves, h in the layer's order.
#include <cuda.h>
#include <cuda_bf16.h>
#include <cuda_runtime.h>

#include <algorithm>
#include <cstdint>

#include "cuda/common.cuh"
#include "cuda/gemm/grouped_row_schedule.cuh"
#include "cuda/gemm/rows_tma_epilogue.cuh"
#include "cuda/gemm/sm90_bf16_grouped.h"
#include "cuda/gemm/sm90_fp8_grouped_1x128.h"
#include "cuda/gemm/wgrad_tma_epilogue.cuh"
#include "cuda/sm90/fence.cuh"
#include "cuda/sm90/mbarrier.cuh"
#include "cuda/sm90/tma.cuh"
#include "cuda/sm90/wgmma.cuh"
#include "flowmoe/cuda/status.h"
#include "flowmoe/error.h"

namespace flowmoe {
namespace cuda {
namespace sm90 {
namespace {

constexpr int kTile = 128;             // output tile rows; columns per accumulator half
constexpr int kDepth = 64;             // reduction elements per stage: one 128-byte swizzled row
constexpr int kThreads = 384;
constexpr int kBox = 64 * kDepth * 2;  // an MN-major box: 64 k-rows of 64 elements, 8 KB
constexpr int kSchedBytes = 2 * (kMaxGroupedExperts + 1) * 4;  // offsets and tile prefix

// kFprop: B K-major (W [n][k]); kDgrad: B MN-major (W [k][n]); kDgradSplit: B MN-major whose n
// columns hold gate / up pairs (2 j, 2 j + 1), D's column j the gate's and n/2 + j the up's.
enum class Mode { kFprop, kDgrad, kDgradSplit, kWgrad, kWgradStored, kWgradInterleaved };
constexpr bool is_wgrad(Mode m) { return m == Mode::kWgrad || m == Mode::kWgradStored || m == Mode::kWgradInterleaved; }

// One output-tile width and pass: the ring of stages takes what shared memory (227 KB per CTA)
// leaves after the schedule and both warpgroups' epilogue buffers (BF16 64 x kBN halves, or wgrad's
// FP32 64 x 128): 3 stages at kBN = 256; at 128, 5 (fprop, dgrad) and 4 (wgrad).
template <int kBN, bool kWgrad>
struct Cfg {
  static constexpr int kHalves = kBN / kTile;
  static constexpr int kABytes = kTile * kDepth * 2;
  static constexpr int kStageBytes = kABytes + kBN * kDepth * 2;
  static constexpr int kEpiBytes = kWgrad ? 2 * kWgradEpiBytes : 2 * (kBN / 64) * kRowsBoxBytes;
  static constexpr int kFixedBytes = kEpiBytes + kSchedBytes + 256 + 1024;  // + barriers, alignment
  static constexpr int kStages = (227 * 1024 - kFixedBytes) / kStageBytes;
  static constexpr int kSmemBytes = kStages * kStageBytes + kFixedBytes;
  static_assert(kStages >= 3 && 2 * kStages * 8 + 16 <= 256, "stages or barriers do not fit");
};

struct Params {
  const int32_t* offsets;
  int num_experts;
  int m;     // token capacity
  int n, k;  // fprop/dgrad: D [m, n] over a reduction of k; wgrad: dW [E][n][k]
  bf16_t* d;
  void* dw;
  int accumulate;
  int store;  // WgradStore
  int up_offset;  // kWgradInterleaved: the up columns of B start here (the gate ones at 0)
  int b_stored;   // fprop / dgrad: B through a 3-D map, expert e's matrix at its own coordinate (its
                  // rows and columns past the stored ones read as zeros), else the 2-D [E * rows, cols]
  unsigned long long* bad_segments;
};

template <int kBN, Mode kMode>
__global__ void __launch_bounds__(kThreads, 1)
    bf16_grouped_kernel(const __grid_constant__ CUtensorMap map_a, const __grid_constant__ CUtensorMap map_b,
                        const __grid_constant__ CUtensorMap map_out, const __grid_constant__ Params p) {
#ifdef FLOWMOE_SM90A
  constexpr bool kWgrad = is_wgrad(kMode);
  constexpr bool kInterleaved = kMode == Mode::kWgradInterleaved;
  static_assert(!kInterleaved || kBN == 128, "interleaved gate / up columns: 128-wide tiles");
  using C = Cfg<kBN, kWgrad>;
  constexpr int kMnA = kWgrad ? 1 : 0, kMnB = kMode == Mode::kFprop ? 0 : 1;
  constexpr int kStages = C::kStages;
  extern __shared__ __align__(1024) uint8_t smem_raw[];
  uint8_t* smem = reinterpret_cast<uint8_t*>((reinterpret_cast<uintptr_t>(smem_raw) + 1023) & ~uintptr_t(1023));
  uint8_t* epi = smem + kStages * C::kStageBytes;  // [2 warpgroups][C::kEpiBytes / 2]
  int* s_off = reinterpret_cast<int*>(smem + kStages * C::kStageBytes + C::kEpiBytes);  // [E + 1]
  int* s_start = s_off + kMaxGroupedExperts + 1;                         // [E + 1] (fprop, dgrad)
  uint64_t* full = reinterpret_cast<uint64_t*>(s_start + kMaxGroupedExperts + 1);
  uint64_t* empty = full + kStages;
  int* s_total = reinterpret_cast<int*>(empty + kStages);
  const int E = p.num_experts;
  const int tiles_k = p.k / kBN, per_expert = (p.n / kTile) * tiles_k;  // wgrad
  for (int i = threadIdx.x; i <= E; i += kThreads) s_off[i] = p.offsets[i];
  if (threadIdx.x == 0) {
    for (int s = 0; s < kStages; ++s) {
      mbar_init(&full[s], 1);   // the TMA thread (with the bytes)
      mbar_init(&empty[s], 8);  // the 8 consumer warps
    }
    fence_mbarrier_init();
  }
  __syncthreads();
  if (threadIdx.x < 32) {
    if constexpr (kWgrad) {  // every offset a multiple of 128, in order, within the capacity
      const int lane = threadIdx.x;
      bool wrong = lane == 0 && (s_off[0] != 0 || s_off[E] > p.m);
      for (int e = lane; e <= E; e += 32) wrong |= s_off[e] % kTile != 0 || (e < E && s_off[e + 1] < s_off[e]);
      const bool any_wrong = __any_sync(0xffffffffu, wrong);
      if (lane == 0) *s_total = any_wrong ? 0 : E * per_expert;
      if (lane == 0 && any_wrong && blockIdx.x == 0 && p.bad_segments) atomicAdd(p.bad_segments, 1ull);
    } else {
      build_row_tile_schedule(s_off, E, p.m, p.n / kBN, s_start, s_total, p.bad_segments, /*allow_base=*/true);
    }
  }
  __syncthreads();
  const int total = *s_total;
  const int wg = threadIdx.x / 128, t = threadIdx.x % 128;
  const int warp = t / 32, lane = t % 32;
  // A tile's reduction: k/64 stages (fprop, dgrad) or the expert's tokens / 64 (wgrad; an empty
  // expert's tiles are skipped when accumulating and written as zeros when overwriting).
  const auto stages_of = [&](int tile) {
    if constexpr (kWgrad) {
      const int e = tile / per_expert;
      return (s_off[e + 1] - s_off[e]) / kDepth;
    } else {
      return p.k / kDepth;
    }
  };
  const auto skipped = [&](int tile) { return kWgrad && p.accumulate && stages_of(tile) == 0; };
  if (wg == 0) {
    warpgroup_reg_dealloc<40>();
    if (t == 0) {
      uint32_t it = 0;
      for (int tile = blockIdx.x; tile < total; tile += gridDim.x) {
        if (skipped(tile)) continue;
        const int nkb = stages_of(tile);
        int a_row = 0, b_row = 0, a_col = 0, b_col = 0, b_mat = 0;  // the first box of the tile's A and B
        if constexpr (kWgrad) {
          const int e = tile / per_expert, r = tile % per_expert;
          a_row = b_row = s_off[e];
          a_col = (r / tiles_k) * kTile;
          b_col = kInterleaved ? (r % tiles_k) * (kBN / 2) : (r % tiles_k) * kBN;  // (the gate box's)
        } else {
          const RowTile rt = row_tile(s_off, s_start, E, tile);
          a_row = rt.off + rt.local0;
          const int e_row = p.b_stored ? 0 : rt.e;  // (stored: the expert is the map's third coordinate)
          b_mat = rt.e;
          b_row = kMode == Mode::kFprop ? e_row * p.n + rt.nt * kBN : e_row * p.k;
          b_col = rt.nt * kBN;
        }
        for (int kb = 0; kb < nkb; ++kb, ++it) {
          const int s = it % kStages;
          mbar_wait(&empty[s], ((it / kStages) & 1) ^ 1);
          uint8_t* sa = smem + s * C::kStageBytes;
          uint8_t* sb = sa + C::kABytes;
          mbar_expect_tx(&full[s], C::kStageBytes);
          const int kd = kb * kDepth;
          if constexpr (kWgrad) {
            tma_load_2d(sa, &map_a, &full[s], a_col, a_row + kd);
            tma_load_2d(sa + kBox, &map_a, &full[s], a_col + 64, a_row + kd);
          } else {
            tma_load_2d(sa, &map_a, &full[s], kd, a_row);  // 128 rows x 64
          }
          if constexpr (kMode == Mode::kFprop) {  // kBN rows x 64
            if (p.b_stored)
              tma_load_3d(sb, &map_b, &full[s], kd, b_row, b_mat);
            else
              tma_load_2d(sb, &map_b, &full[s], kd, b_row);
          } else if constexpr (kInterleaved) {  // gate columns, then their up columns
            tma_load_2d(sb, &map_b, &full[s], b_col, b_row + kd);
            tma_load_2d(sb + kBox, &map_b, &full[s], p.up_offset + b_col, b_row + kd);
          } else {
#pragma unroll
            for (int i = 0; i < kBN / 64; ++i) {
              if (!kWgrad && p.b_stored)
                tma_load_3d(sb + i * kBox, &map_b, &full[s], b_col + 64 * i, b_row + kd, b_mat);
              else
                tma_load_2d(sb + i * kBox, &map_b, &full[s], b_col + 64 * i, b_row + kd);
            }
          }
        }
      }
    }
    return;
  }
  warpgroup_reg_alloc<232>();
  const int ci = wg - 1;                // output rows 64 ci .. 64 ci + 63 of the tile
  const int r0 = 16 * warp + lane / 4;  // fragment rows r0 and r0 + 8 (of the half tile)
  const int c0 = 2 * (lane % 4);        // fragment columns 8 j + c0, + 1 (of a 128-wide half)
  float acc[C::kHalves][64];
  uint32_t it = 0;
  bool pending = false;  // wgrad: a bulk store/reduce of this warpgroup may still read its buffer
  for (int tile = blockIdx.x; tile < total; tile += gridDim.x) {
    if (skipped(tile)) continue;
    const int nkb = stages_of(tile);
#pragma unroll
    for (int h = 0; h < C::kHalves; ++h)
#pragma unroll
      for (int i = 0; i < 64; ++i) acc[h][i] = 0.0f;
    int prev = 0;
    for (int kb = 0; kb < nkb; ++kb, ++it) {
      const int s = it % kStages;
      mbar_wait(&full[s], (it / kStages) & 1);
      const uint32_t a_base = smem_u32(smem + s * C::kStageBytes), b_base = a_base + C::kABytes;
      wgmma_fence();
#pragma unroll
      for (int kk = 0; kk < kDepth / 16; ++kk) {  // one WGMMA over all kBN columns per 16-deep step
        const uint64_t da = kMnA ? smem_desc_mn_major_sw128(a_base + ci * kBox + kk * 2048, kBox)
                                 : smem_desc_k_major_sw128(a_base + ci * 64 * 128 + kk * 32);
        const uint64_t db = kMnB ? smem_desc_mn_major_sw128(b_base + kk * 2048, kBox)
                                 : smem_desc_k_major_sw128(b_base + kk * 32);
        if constexpr (kBN == 256)
          wgmma_m64n256k16_bf16<kMnA, kMnB>(&acc[0][0], da, db);
        else
          wgmma_m64n128k16_bf16<kMnA, kMnB>(&acc[0][0], da, db);
      }
      wgmma_commit();
      wgmma_wait_pending<1>();  // the previous stage's WGMMAs have read their operands
      if (kb > 0) {
        __syncwarp();
        if (lane == 0) mbar_arrive(&empty[prev]);
      }
      prev = s;
    }
    wgmma_wait_all();
    if (nkb > 0) {
      __syncwarp();
      if (lane == 0) mbar_arrive(&empty[prev]);
    }
    if constexpr (kWgrad) {  // per 128-column half through shared memory, by TMA (wgrad_tma_epilogue.cuh)
      const int e = tile / per_expert, r = tile % per_expert;
      float* ebuf = reinterpret_cast<float*>(epi + ci * kWgradEpiBytes);
      if constexpr (kMode == Mode::kWgrad) {
#pragma unroll
        for (int h = 0; h < C::kHalves; ++h)
          wgrad_half_to_global(acc[h], ebuf, pending || h > 0, t, r0, c0, 1 + ci, &map_out, p.store,
                               e * p.n + (r / tiles_k) * kTile + 64 * ci, (r % tiles_k) * kBN + h * kTile);
      } else {  // expert e's matrix of the 3-D map, rows and columns within it
#pragma unroll
        for (int h = 0; h < C::kHalves; ++h)
          wgrad_half_to_global<kInterleaved>(acc[h], ebuf, pending || h > 0, t, r0, c0, 1 + ci, &map_out, p.store,
                                             (r / tiles_k) * kTile + 64 * ci, (r % tiles_k) * kBN + h * kTile, e);
      }
      pending = true;
    } else {  // full halves staged and stored by TMA, partial ones from the fragments (rows_tma_epilogue.cuh)
      const RowTile rt = row_tile(s_off, s_start, E, tile);
      const int local0 = rt.local0 + 64 * ci;  // first row of this half in the expert
      rows_half_to_global<C::kHalves, kMode == Mode::kDgradSplit>(
          acc, epi + ci * (kBN / 64) * kRowsBoxBytes, &map_out, p.d, p.n, int64_t(rt.off) + local0,
          rt.rows - local0, rt.nt * kBN, t, r0, c0, 1 + ci);
    }
  }
  if (t == 0) bulk_wait_all();  // the bulk operations have read the buffers before the CTA exits
#else
  __trap();  // built without sm_90a: never a silent wrong answer (the CMake build always has it)
#endif
}

template <int kBN, Mode kMode>
constexpr int smem_bytes() {
  return Cfg<kBN, is_wgrad(kMode)>::kSmemBytes;
}
template <int kBN, Mode kMode>
void allow_smem() {
  FLOWMOE_CUDA_CHECK(cudaFuncSetAttribute(bf16_grouped_kernel<kBN, kMode>, cudaFuncAttributeMaxDynamicSharedMemorySize,
                                          smem_bytes<kBN, kMode>()));
}

// SMs of the current device; the kernels' shared-memory limit raised once per device.
int sm_count() {
  return detail::sm_count_after([] {
    allow_smem<128, Mode::kFprop>();
    allow_smem<256, Mode::kFprop>();
    allow_smem<128, Mode::kDgrad>();
    allow_smem<256, Mode::kDgrad>();
    allow_smem<128, Mode::kDgradSplit>();
    allow_smem<256, Mode::kDgradSplit>();
    allow_smem<128, Mode::kWgrad>();
    allow_smem<256, Mode::kWgrad>();
    allow_smem<128, Mode::kWgradStored>();
    allow_smem<128, Mode::kWgradInterleaved>();
  });
}

bool aligned16(const void* q) { return (reinterpret_cast<uintptr_t>(q) & 15u) == 0; }

CUtensorMap bf16_map(const bf16_t* base, int64_t rows, int64_t cols, int box_rows, const char* what) {
  return make_tensor_map_2d(base, CU_TENSOR_MAP_DATA_TYPE_BFLOAT16, 2, uint64_t(rows), uint64_t(cols), box_rows, 64,
                            CU_TENSOR_MAP_SWIZZLE_128B, what);
}

// (mout: the output's map, D or dW)
template <int kBN, Mode kMode>
void launch(const CUtensorMap& ma, const CUtensorMap& mb, const CUtensorMap& mout, const Params& p, int64_t max_tiles,
            cudaStream_t stream) {
  const int grid = int(std::min<int64_t>(max_tiles, sm_count()));
  bf16_grouped_kernel<kBN, kMode><<<grid, kThreads, smem_bytes<kBN, kMode>(), stream>>>(ma, mb, mout, p);
  FLOWMOE_CUDA_CHECK(cudaGetLastError());
}

// The kernel parameters both entry points share (n, k: the output's columns and the reduction, or
// dW's rows and columns).
Params make_params(const int32_t* offsets, int experts, int64_t m, int64_t n, int64_t k, DeviceStatus* status) {
  Params p{};
  p.offsets = offsets;
  p.num_experts = experts;
  p.m = int(m);
  p.n = int(n);
  p.k = int(k);
  p.bad_segments = status ? &status->bad_segments : nullptr;
  return p;
}

const char* common_unsupported(const int32_t* offsets, int experts, int64_t m, int64_t n, int64_t k) {
  constexpr int64_t kBig = int64_t(1) << 31;
  if (experts < 1 || experts > kMaxGroupedExperts) return "the expert count is not 1 .. 1024";
  if (m < 0 || m >= kBig) return "the token count is not 0 .. 2^31 - 1";
  if (n <= 0 || k <= 0 || n % kTile != 0 || k % kTile != 0) return "the GEMM dimensions must be positive multiples of 128";
  if (int64_t(experts) * std::max(n, k) >= kBig) return "the weights are too large (2^31 rows)";
  if (offsets == nullptr) return "no device offsets";
  return nullptr;
}

}  // namespace

const char* bf16_rows_unsupported(const Bf16RowsArgs& a) {
  if (const char* why = common_unsupported(a.offsets, a.num_experts, a.m, a.n_out, a.k_red)) return why;
  if ((a.m / kTile + a.num_experts) * (a.n_out / kTile) >= (int64_t(1) << 31)) return "more than 2^31 output tiles";
  if (a.b_rows != 0 || a.b_cols != 0) {
    const int64_t max_rows = a.b_mn_major ? a.k_red : a.n_out, max_cols = a.b_mn_major ? a.n_out : a.k_red;
    if (a.b_rows < 1 || a.b_cols < 1 || a.b_rows > max_rows || a.b_cols > max_cols)
      return "the stored weight's matrix is empty or larger than the GEMM's";
    if (a.b_cols * 2 % 16 != 0) return "the stored weight's rows are not a multiple of 16 bytes";
  }
  if (a.split_gate_up && !a.b_mn_major) return "gate / up pairs are read from an MN-major B only";
  if (a.m == 0) return nullptr;
  if (!a.a || !a.b || !a.d) return "a null operand pointer";
  if (!aligned16(a.a) || !aligned16(a.b) || !aligned16(a.d)) return "operands or output not 16-byte aligned";
  return nullptr;
}

void bf16_grouped_rows(const Bf16RowsArgs& a, const char* what, cudaStream_t stream) {
  const char* why = bf16_rows_unsupported(a);
  FLOWMOE_CHECK(why == nullptr, what << " (grouped sm_90a BF16 kernel): " << why << " (experts " << a.num_experts
                                     << ", m " << a.m << ", output columns " << a.n_out << ", reduction "
                                     << a.k_red << ")");
  if (a.m == 0) return;
  Params p = make_params(a.offsets, a.num_experts, a.m, a.n_out, a.k_red, a.status);
  p.d = a.d;
  const bool wide = a.n_out % 256 == 0;
  const int bn = wide ? 256 : 128;
  const CUtensorMap ma = bf16_map(a.a, a.m, a.k_red, kTile, what);
  const bool stored = a.b_rows > 0;
  p.b_stored = stored ? 1 : 0;
  const CUtensorMap mb =
      stored ? make_tensor_map_3d(a.b, CU_TENSOR_MAP_DATA_TYPE_BFLOAT16, 2, uint64_t(a.num_experts), uint64_t(a.b_rows),
                                  uint64_t(a.b_cols), a.b_mn_major ? 64 : bn, 64, CU_TENSOR_MAP_SWIZZLE_128B, what)
      : a.b_mn_major ? bf16_map(a.b, a.num_experts * a.k_red, a.n_out, 64, what)
                     : bf16_map(a.b, a.num_experts * a.n_out, a.k_red, bn, what);
  const int64_t max_tiles = (a.m / kTile + a.num_experts) * (a.n_out / bn);
  const CUtensorMap md = bf16_map(a.d, a.m, a.n_out, 64, what);
  if (a.split_gate_up)
    wide ? launch<256, Mode::kDgradSplit>(ma, mb, md, p, max_tiles, stream)
         : launch<128, Mode::kDgradSplit>(ma, mb, md, p, max_tiles, stream);
  else if (a.b_mn_major)
    wide ? launch<256, Mode::kDgrad>(ma, mb, md, p, max_tiles, stream)
         : launch<128, Mode::kDgrad>(ma, mb, md, p, max_tiles, stream);
  else
    wide ? launch<256, Mode::kFprop>(ma, mb, md, p, max_tiles, stream)
         : launch<128, Mode::kFprop>(ma, mb, md, p, max_tiles, stream);
}

const char* bf16_wgrad_unsupported(const Bf16WgradArgs& a) {
  if (const char* why = common_unsupported(a.offsets, a.num_experts, a.m, a.n, a.k)) return why;
  if (!a.dw) return "a null gradient pointer";
  if (a.out_bf16 && a.accumulate) return "BF16 output with accumulation (BF16 gradients are overwritten only)";
  if (const char* why = stored_dw_unsupported(a.stored_rows, a.stored_cols, a.stored_interleaved, a.n, a.k, a.out_bf16))
    return why;
  if (a.m == 0) return nullptr;
  if (!a.dy || !a.x) return "a null operand pointer";
  if (!aligned16(a.dy) || !aligned16(a.x) || !aligned16(a.dw)) return "operands or gradient not 16-byte aligned";
  return nullptr;
}

void bf16_grouped_wgrad(const Bf16WgradArgs& a, const char* what, cudaStream_t stream) {
  const char* why = bf16_wgrad_unsupported(a);
  FLOWMOE_CHECK(why == nullptr, what << " (grouped sm_90a BF16 wgrad kernel): " << why << " (experts "
                                     << a.num_experts << ", m " << a.m << ", n " << a.n << ", k " << a.k << ")");
  const WgradStore store = a.out_bf16 ? WgradStore::kBf16 : a.accumulate ? WgradStore::kF32Add : WgradStore::kF32;
  const bool stored = a.stored_rows > 0, interleaved = stored && a.stored_interleaved;
  if (a.m == 0) {  // no tokens: the gradients are zero (overwrite) or unchanged (accumulate)
    const int64_t per_expert = stored ? a.stored_rows * a.stored_cols : a.n * a.k;
    if (!a.accumulate)
      FLOWMOE_CUDA_CHECK(
          cudaMemsetAsync(a.dw, 0, size_t(wgrad_store_bytes(store)) * a.num_experts * per_expert, stream));
    return;
  }
  Params p = make_params(a.offsets, a.num_experts, a.m, a.n, a.k, a.status);
  p.dw = a.dw;
  p.accumulate = a.accumulate;
  p.store = int(store);
  p.up_offset = interleaved ? int(a.k / 2) : 0;
  const CUtensorMap ma = bf16_map(a.dy, a.m, a.n, 64, what);
  const CUtensorMap mb = bf16_map(a.x, a.m, a.k, 64, what);
  const CUtensorMap mdw = stored ? wgrad_dw_map(a.dw, store, a.stored_rows, a.stored_cols, what, a.num_experts)
                                 : wgrad_dw_map(a.dw, store, int64_t(a.num_experts) * a.n, a.k, what);
  const bool wide = !stored && a.k % 256 == 0;  // (the stored outputs' one instantiation each)
  const int64_t max_tiles = int64_t(a.num_experts) * (a.n / kTile) * (a.k / (wide ? 256 : 128));
  if (interleaved)
    launch<128, Mode::kWgradInterleaved>(ma, mb, mdw, p, max_tiles, stream);
  else if (stored)
    launch<128, Mode::kWgradStored>(ma, mb, mdw, p, max_tiles, stream);
  else
    wide ? launch<256, Mode::kWgrad>(ma, mb, mdw, p, max_tiles, stream)
         : launch<128, Mode::kWgrad>(ma, mb, mdw, p, max_tiles, stream);
}

}  // namespace sm90
}  // namespace cuda
}  // namespace flowmoe
