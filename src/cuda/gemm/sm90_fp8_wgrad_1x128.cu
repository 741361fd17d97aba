// FP8 (E4M3) block-scaled grouped wgrad for sm_90a, 1x128 scales along the tokens on both
// operands: one persistent kernel over all experts (TMA loads, WGMMA, FP32 promotion per
// 128-token block, TMA reduce-add / store epilogue that overlaps the next tile's math; FP32 dW
// added to or overwritten, or BF16 dW overwritten).
// docs/GEMM.md, "The wgrad kernel".
//
//   dW_e [N, K] (+)= sum over the 128-token blocks b of expert e of
//                    (dY_b^T . X_b) * sa[b][n] * sb[b][k]
// dY and X column-wise: codes [N, M] and [K, M] (tokens contiguous), scales [NB][N], [NB][K]: FP32
// (the GEMM-ready layouts of gemm.h) or the UE8M0 bytes the column copies are written with (the
// same layout, one byte each; decoded in shared memory, so no conversion pass runs before). Every
// expert's token count and offset a multiple of 128, so block b of expert e is global block
// offsets[e] / 128 + b and no block mixes two experts.
//
// Output tiles are 128 rows (N) x kBN columns (K): kBN = 256 when K allows and the experts average
// at least 1024 tokens (the dY tile feeds twice the math: a quarter less operand traffic per FLOP),
// else 128.
//
// CTA: 3 warpgroups. Warpgroup 0: one thread issues the TMA loads of a ring of stages (dY tile
// 128 x 128 tokens, X tile kBN x 128 tokens, 128-byte swizzle, and the block's scales); with UE8M0
// scales the scale bytes go first, on a barrier of their own (`codes_full`), and the second warp
// decodes them into the stage's FP32 scales while the tiles are still in flight; its 32 lanes are
// arrivals of the stage's `full` barrier, so the math warps wait for one barrier either way. Warpgroups 1
// and 2: rows 0-63 and 64-127 of the output tile; per block and 128-column half four m64n128k32
// WGMMAs into a block accumulator, then acc += block * (sa * sb) (exact power-of-two scales: the CPU
// reference's block order and roundings). Epilogue per warpgroup and half: into shared memory
// (128-byte swizzled 64 x 32 boxes), then one thread issues TMA reduce-adds (accumulate) or stores
// into dW; the buffer is waited for (read) only when the next half needs it, so the last half's
// writes overlap the next tile's math.
// The TMA, mbarrier, WGMMA and fence wrappers are the shared ones of src/cuda/sm90/.
#include <cuda.h>
#include <cuda_runtime.h>

#include <algorithm>
#include <cstdint>
#include <sstream>

#include "cuda/common.cuh"
#include "cuda/gemm/sm90_fp8_wgrad_1x128.h"
#include "cuda/gemm/wgrad_tma_epilogue.cuh"
#include "cuda/sm90/fence.cuh"
#include "cuda/sm90/mbarrier.cuh"
#include "cuda/sm90/tma.cuh"
#include "cuda/sm90/wgmma.cuh"
#include "flowmoe/cuda/status.h"
#include "flowmoe/error.h"
#include "flowmoe/gemm.h"
#include "flowmoe/numerics.h"

namespace flowmoe {
namespace cuda {
namespace sm90 {
namespace {

constexpr int kTile = 128;      // output tile rows (N) and column halves (K); tokens per block
constexpr int kThreads = 384;
constexpr int kEpiBytes = kWgradEpiBytes;             // one warpgroup's 64 x 128 half, FP32
constexpr int kTileSlots = 2;                         // tile ids handed from the producer to the consumers

// The configuration of one output tile width kBN (128 or 256); kStages is what shared memory
// (227 KB per CTA) leaves after the epilogue buffers.
template <int kBN>
struct WCfg {
  static constexpr int kHalves = kBN / kTile;
  static constexpr int kStages = kBN == 256 ? 3 : 4;
  static constexpr int kStageBytes = kTile * kTile + kBN * kTile;  // dY tile + X tile, FP8
  static constexpr int kScaleBytes = (kTile + kBN) * 4;            // per stage: the block's dY and X scales
  static constexpr int kScaleCodes = kTile + kBN;                  // per stage: the same as UE8M0 bytes
  // X scale pairs (of 16 per half) read before the wait: all at kBN = 128, where the products are
  // formed while the WGMMAs run; half at 256, where the 128 accumulators leave fewer registers
  static constexpr int kEarlyScales = kBN == 128 ? 16 : 8;
  static constexpr int kSmemBytes = kStages * kStageBytes + 2 * kEpiBytes + kStages * (kScaleBytes + kScaleCodes) +
                                    3 * kStages * 8 + 2 * kTileSlots * 8 + 64 + (kMaxGroupedExperts + 2) * 4 + 1024;
  static_assert(kSmemBytes <= 227 * 1024, "shared memory over the sm_90 per-CTA limit");
};

struct Work {
  int num_experts = 0;
  int m = 0;                         // token capacity: offsets[E] <= m
  int tiles_k = 0, tiles_per_expert = 0;
  int n = 0, k = 0;
  int accumulate = 0;
  int store = 0;                     // WgradStore
  const void* sa = nullptr;          // [NB][N] FP32, or UE8M0 bytes with ue8m0
  const void* sb = nullptr;          // [NB][K]
  int ue8m0 = 0;                     // the scales are UE8M0 bytes (decoded by the second producer warp)
  int up_offset = 0;                 // kStoredInterleaved: x's up rows start here; tile tk's x rows
                                     // are gate [64 tk, + 64) and up up_offset + [64 tk, + 64)
  int* next_tile = nullptr;          // the tile counter (0 at launch)
  unsigned long long* bad_segments = nullptr;
  const int32_t* offsets = nullptr;  // [E + 1] on the device, or null: inline_offsets
  int32_t inline_offsets[kMaxInlineWgradExperts + 1];
};

// How the kernel writes dW: [E][N][K] (kPlain), where a model stores it (kStored: WgradArgs::stored_*,
// a 3-D map clipping each expert), and with interleaved gate / up columns (kStoredInterleaved, kBN 128).
enum WgradMode : int { kPlain = 0, kStored = 1, kStoredInterleaved = 2 };

template <int kBN, int kMode>
__global__ void __launch_bounds__(kThreads, 1)
    wgrad_kernel(const __grid_constant__ CUtensorMap map_dy, const __grid_constant__ CUtensorMap map_x,
                 const __grid_constant__ CUtensorMap map_dw, const __grid_constant__ Work work) {
#ifdef FLOWMOE_SM90A
  static_assert(kMode != kStoredInterleaved || kBN == 128, "interleaved gate / up columns: 128-wide tiles");
  constexpr bool kInterleaved = kMode == kStoredInterleaved;
  using C = WCfg<kBN>;
  constexpr int kStages = C::kStages, kStageBytes = C::kStageBytes, kScaleBytes = C::kScaleBytes;
  extern __shared__ __align__(1024) uint8_t smem_raw[];
  uint8_t* smem = reinterpret_cast<uint8_t*>((reinterpret_cast<uintptr_t>(smem_raw) + 1023) & ~uintptr_t(1023));
  float* epi = reinterpret_cast<float*>(smem + kStages * kStageBytes);
  float* scl = reinterpret_cast<float*>(smem + kStages * kStageBytes + 2 * kEpiBytes);  // [stage][128 + kBN]
  const uint32_t scl_u32 = smem_u32(scl);
  uint8_t* scl_codes = smem + kStages * kStageBytes + 2 * kEpiBytes + kStages * kScaleBytes;  // UE8M0 [stage][128 + kBN]
  uint64_t* full = reinterpret_cast<uint64_t*>(scl_codes + kStages * C::kScaleCodes);
  uint64_t* empty = full + kStages;
  uint64_t* codes_full = empty + kStages;    // [kStages]: the stage's UE8M0 scale bytes landed
  uint64_t* tile_full = codes_full + kStages;  // [kTileSlots]: a tile id is in tile_id[slot]
  uint64_t* tile_empty = tile_full + kTileSlots;
  int* tile_id = reinterpret_cast<int*>(tile_empty + kTileSlots);
  int* s_off = tile_id + 16;  // [E + 1] token offsets; s_off[E + 1]: 1 when they are malformed
  const int wg = threadIdx.x / 128, t = threadIdx.x % 128;
  const int E = work.num_experts;
  const bool ue8m0 = work.ue8m0 != 0;
  const int32_t* offsets = work.offsets ? work.offsets : work.inline_offsets;
  for (int i = threadIdx.x; i <= E; i += kThreads) s_off[i] = offsets[i];
  if (threadIdx.x == 0) s_off[E + 1] = 0;
  __syncthreads();
  for (int e = threadIdx.x; e < E; e += kThreads)
    if (s_off[e + 1] < s_off[e] || s_off[e] % kTile != 0) s_off[E + 1] = 1;
  if (threadIdx.x == 0) {
    if (s_off[0] != 0 || s_off[E] > work.m || s_off[E] % kTile != 0) s_off[E + 1] = 1;
    for (int s = 0; s < kStages; ++s) {
      mbar_init(&full[s], ue8m0 ? 33 : 1);  // the producer (and the decoding warp's lanes)
      mbar_init(&empty[s], 8);     // the 8 consumer warps
      mbar_init(&codes_full[s], 1);
    }
    for (int s = 0; s < kTileSlots; ++s) {
      mbar_init(&tile_full[s], 1);
      mbar_init(&tile_empty[s], ue8m0 ? 9 : 8);  // the consumer warps and the decoding warp
    }
    fence_mbarrier_init();
  }
  __syncthreads();
  const int tiles_k = work.tiles_k, per_expert = work.tiles_per_expert;
  // malformed offsets: no tiles (dW untouched), counted once
  const int total_tiles = s_off[E + 1] ? 0 : E * per_expert;
  if (s_off[E + 1] && blockIdx.x == 0 && threadIdx.x == 0 && work.bad_segments) atomicAdd(work.bad_segments, 1ull);
  if (wg == 0) {
    warpgroup_reg_dealloc<40>();
    if (t == 0) {
      // Tiles are taken from a global counter (not a fixed share per CTA): CTAs that start late
      // (their SM still busy with another stream's kernel) or meet short experts take fewer.
      uint32_t it = 0;
      for (uint32_t j = 0;; ++j) {
        const int slot = j % kTileSlots;
        mbar_wait(&tile_empty[slot], ((j / kTileSlots) & 1) ^ 1);
        // an empty expert's tiles are skipped when accumulating (nothing to add) and handed out
        // when overwriting (the consumers store zeros)
        int tile, w;
        do {
          tile = atomicAdd(work.next_tile, 1);
          w = tile / per_expert;
        } while (tile < total_tiles && work.accumulate && s_off[w + 1] == s_off[w]);
        tile_id[slot] = tile;
        mbar_arrive(&tile_full[slot]);
        if (tile >= total_tiles) break;
        const int r = tile % per_expert;
        const int tn = r / tiles_k, tk = r % tiles_k;
        const int t0 = s_off[w], nb = (s_off[w + 1] - t0) / kTile;
        for (int b = 0; b < nb; ++b, ++it) {
          const int s = it % kStages;
          const uint32_t ph = (it / kStages) & 1;
          mbar_wait(&empty[s], ph ^ 1);
          uint8_t* a = smem + s * kStageBytes;
          const int64_t gb = t0 / kTile + b;  // global 128-token block
          const int64_t ia = gb * work.n + tn * kTile, ib = gb * work.k + tk * kBN;
          // interleaved (kBN = 128): x's tile is gate rows [64 tk, + 64) then up rows from up_offset
          const int up = kInterleaved ? work.up_offset : 0;
          const int64_t ib_gate = gb * work.k + tk * 64, ib_up = ib_gate + up;
          if (ue8m0) {  // the bytes first (decoded while the tiles travel)
            uint8_t* cs = scl_codes + s * C::kScaleCodes;
            const uint8_t* sb = static_cast<const uint8_t*>(work.sb);
            mbar_expect_tx(&codes_full[s], C::kScaleCodes);
            bulk_load(cs, static_cast<const uint8_t*>(work.sa) + ia, kTile, &codes_full[s]);
            if constexpr (kInterleaved) {
              bulk_load(cs + kTile, sb + ib_gate, 64, &codes_full[s]);
              bulk_load(cs + kTile + 64, sb + ib_up, 64, &codes_full[s]);
            } else {
              bulk_load(cs + kTile, sb + ib, kBN, &codes_full[s]);
            }
            mbar_expect_tx(&full[s], kStageBytes);
          } else {
            mbar_expect_tx(&full[s], kStageBytes + kScaleBytes);
            float* ss = scl + s * (kTile + kBN);
            const float* sb = static_cast<const float*>(work.sb);
            bulk_load(ss, static_cast<const float*>(work.sa) + ia, kTile * 4, &full[s]);
            if constexpr (kInterleaved) {
              bulk_load(ss + kTile, sb + ib_gate, 64 * 4, &full[s]);
              bulk_load(ss + kTile + 64, sb + ib_up, 64 * 4, &full[s]);
            } else {
              bulk_load(ss + kTile, sb + ib, kBN * 4, &full[s]);
            }
          }
          tma_load_2d(a, &map_dy, &full[s], t0 + b * kTile, tn * kTile);
          if constexpr (kInterleaved) {  // (map_x's box is 64 rows: two boxes make the swizzled 128-row tile)
            tma_load_2d(a + kTile * kTile, &map_x, &full[s], t0 + b * kTile, tk * 64);
            tma_load_2d(a + kTile * kTile + 64 * kTile, &map_x, &full[s], t0 + b * kTile, up + tk * 64);
          } else {
#pragma unroll
            for (int h = 0; h < C::kHalves; ++h)
              tma_load_2d(a + (1 + h) * kTile * kTile, &map_x, &full[s], t0 + b * kTile, tk * kBN + h * kTile);
          }
        }
      }
    } else if (ue8m0 && t / 32 == 1) {
      // The decoding warp: the same tiles and blocks as the math warps; per stage, the 128 + kBN
      // scale bytes into FP32 (num::ue8m0_to_f32: 2^(c - 127), 255 NaN), one 4-byte group per lane
      // step, then each lane arrives on `full` (which completes once the tiles have landed too).
      // The codes of a stage are reloaded only after the math warps release it, which they do after
      // `full`: the bytes are read before then.
      const int lane = t % 32;
      uint32_t it = 0;
      for (uint32_t j = 0;; ++j) {
        const int slot = j % kTileSlots;
        mbar_wait(&tile_full[slot], (j / kTileSlots) & 1);
        const int tile = tile_id[slot];
        __syncwarp();
        if (lane == 0) mbar_arrive(&tile_empty[slot]);
        if (tile >= total_tiles) break;
        const int w = tile / per_expert;
        const int nb = (s_off[w + 1] - s_off[w]) / kTile;
        for (int b = 0; b < nb; ++b, ++it) {
          const int s = it % kStages;
          mbar_wait(&codes_full[s], (it / kStages) & 1);
          const uchar4* in = reinterpret_cast<const uchar4*>(scl_codes + s * C::kScaleCodes);
          float4* out = reinterpret_cast<float4*>(scl + s * (kTile + kBN));
          for (int i = lane; i < C::kScaleCodes / 4; i += 32) {
            const uchar4 c = in[i];
            out[i] = make_float4(num::ue8m0_to_f32(c.x), num::ue8m0_to_f32(c.y), num::ue8m0_to_f32(c.z),
                                 num::ue8m0_to_f32(c.w));
          }
          mbar_arrive(&full[s]);
        }
      }
    }
    return;
  }
  warpgroup_reg_alloc<232>();
  const int ci = wg - 1;                   // rows 64 ci .. 64 ci + 63 of the tile
  const int warp = t / 32, lane = t % 32;
  const int r0 = 16 * warp + lane / 4;     // fragment rows r0 and r0 + 8 (of the half tile)
  const int c0 = 2 * (lane % 4);           // fragment columns 8 j + c0, + 1
  float* ebuf = epi + ci * (64 * kTile);
  float acc[C::kHalves][64], blk[64];
  uint32_t it = 0;
  bool pending = false;                    // a bulk store/reduce from ebuf may still be reading it
  for (uint32_t j = 0;; ++j) {
    const int slot = j % kTileSlots;
    mbar_wait(&tile_full[slot], (j / kTileSlots) & 1);
    const int tile = tile_id[slot];
    __syncwarp();
    if (lane == 0) mbar_arrive(&tile_empty[slot]);
    if (tile >= total_tiles) break;
    const int w = tile / per_expert, r = tile % per_expert;
    const int tn = r / tiles_k, tk = r % tiles_k;
    const int nb = (s_off[w + 1] - s_off[w]) / kTile;
#pragma unroll
    for (int h = 0; h < C::kHalves; ++h)
#pragma unroll
      for (int i = 0; i < 64; ++i) acc[h][i] = 0.0f;
    for (int b = 0; b < nb; ++b, ++it) {
      const int s = it % kStages;
      const uint32_t ph = (it / kStages) & 1;
      mbar_wait(&full[s], ph);
      // This block's scales (landed with the tiles): dY's for rows r0, r0 + 8, X's for the columns,
      // read into registers before the WGMMAs are issued so that the promotion after the wait is
      // only arithmetic.
      const uint32_t ss = scl_u32 + uint32_t(s * kScaleBytes);
      const float sa0 = lds_f32(ss + 4 * (64 * ci + r0)), sa1 = lds_f32(ss + 4 * (64 * ci + r0 + 8));
      const uint32_t a_addr = smem_u32(smem + s * kStageBytes) + ci * (64 * kTile);
#pragma unroll
      for (int h = 0; h < C::kHalves; ++h) {
        const uint32_t sbh = ss + 4 * (kTile + h * kTile + c0);  // column 8 j + c0 of half h: + 32 j
        float2 sb[16];
#pragma unroll
        for (int j = 0; j < C::kEarlyScales; ++j) sb[j] = lds_f32x2(sbh + 32 * j);
        wgmma_issue_m64n128k128_e4m3(blk, a_addr, smem_u32(smem + s * kStageBytes + (1 + h) * kTile * kTile));
        if constexpr (kBN == 128) {
          // the 64 scale products while the tensor cores run (the same products and roundings as
          // multiplying after the wait: sa * sb, then one fmaf per element)
          float sc[64];
#pragma unroll
          for (int j = 0; j < 16; ++j) {
            sc[4 * j + 0] = sa0 * sb[j].x, sc[4 * j + 1] = sa0 * sb[j].y;
            sc[4 * j + 2] = sa1 * sb[j].x, sc[4 * j + 3] = sa1 * sb[j].y;
          }
          wgmma_fence_regs<64>(sc);
          wgmma_wait_all();
          wgmma_fence_regs<64>(blk);
          __syncwarp();  // every lane's WGMMAs and scale reads of the stage before the warp releases it
          if (lane == 0) mbar_arrive(&empty[s]);
#pragma unroll
          for (int i = 0; i < 64; ++i) acc[h][i] = fmaf(blk[i], sc[i], acc[h][i]);
        } else {
          // 128 accumulators leave no room for the products: half of X's scales are read ahead,
          // the rest while the first half of the fragment is promoted
          wgmma_wait_all();
          wgmma_fence_regs<64>(blk);
#pragma unroll
          for (int j = C::kEarlyScales; j < 16; ++j) sb[j] = lds_f32x2(sbh + 32 * j);
          if (h == C::kHalves - 1) {
            __syncwarp();
            if (lane == 0) mbar_arrive(&empty[s]);
          }
#pragma unroll
          for (int j = 0; j < 16; ++j) {
            const float s00 = sa0 * sb[j].x, s01 = sa0 * sb[j].y, s10 = sa1 * sb[j].x, s11 = sa1 * sb[j].y;
            acc[h][4 * j + 0] = fmaf(blk[4 * j + 0], s00, acc[h][4 * j + 0]);
            acc[h][4 * j + 1] = fmaf(blk[4 * j + 1], s01, acc[h][4 * j + 1]);
            acc[h][4 * j + 2] = fmaf(blk[4 * j + 2], s10, acc[h][4 * j + 2]);
            acc[h][4 * j + 3] = fmaf(blk[4 * j + 3], s11, acc[h][4 * j + 3]);
          }
        }
      }
    }
    // epilogue, per 128-column half, through ebuf by TMA (wgrad_tma_epilogue.cuh)
#pragma unroll
    for (int h = 0; h < C::kHalves; ++h)
      wgrad_half_to_global<kInterleaved>(acc[h], ebuf, pending || h > 0, t, r0, c0, 1 + ci, &map_dw, work.store,
                                         (kMode != kPlain ? 0 : w * work.n) + tn * kTile + 64 * ci,
                                         tk * kBN + h * kTile, kMode != kPlain ? w : -1);
    pending = true;
  }
  if (t == 0) bulk_wait_all();
#else
  __trap();  // built without sm_90a: never a silent wrong answer (the CMake build always has it)
#endif
}

// SMs of the current device; the kernels' shared-memory limits raised once per device.
int sm_count() {
  return detail::sm_count_after([] {
    const auto raise = [](auto kernel, int bytes) {
      FLOWMOE_CUDA_CHECK(cudaFuncSetAttribute(kernel, cudaFuncAttributeMaxDynamicSharedMemorySize, bytes));
    };
    raise(wgrad_kernel<128, kPlain>, WCfg<128>::kSmemBytes);
    raise(wgrad_kernel<256, kPlain>, WCfg<256>::kSmemBytes);
    raise(wgrad_kernel<128, kStored>, WCfg<128>::kSmemBytes);
    raise(wgrad_kernel<128, kStoredInterleaved>, WCfg<128>::kSmemBytes);
  });
}

}  // namespace

const char* wgrad_device_unsupported(const WgradArgs& a) {
  constexpr int64_t kBig = int64_t(1) << 31;
  if (a.num_experts < 1 || a.num_experts > kMaxGroupedExperts) return "the expert count is not 1 .. 1024";
  if (a.n <= 0 || a.k <= 0 || a.n % kTile != 0 || a.k % kTile != 0) return "N or K not a multiple of 128";
  if (a.n * a.num_experts >= kBig || a.k >= kBig) return "output too large";
  if (a.num_experts * (a.n / kTile) * (a.k / kTile) >= kBig) return "more than 2^31 output tiles";
  if (a.m < 0 || a.m >= kBig || a.m % kTile != 0) return "the token capacity is not a multiple of 128 below 2^31";
  if (a.tile_n != 0 && a.tile_n != 128 && a.tile_n != 256) return "tile width not 0 (by shape), 128 or 256";
  if (a.tile_n == 256 && a.k % 256 != 0) return "tile width 256 with K not a multiple of 256";
  if (a.offsets == nullptr && a.host_offsets == nullptr) return "no offsets";
  if (a.offsets == nullptr && a.num_experts > kMaxInlineWgradExperts) return "more than 256 experts with host offsets";
  if (a.tile_counter == nullptr) return "no tile counter";
  if (a.m > 0 && (!a.dy_codes || !a.dy_scales || !a.x_codes || !a.x_scales)) return "a null operand pointer";
  if (!a.dw) return "a null output pointer";
  if (a.out_bf16 && a.accumulate) return "BF16 output with accumulation (BF16 gradients are overwritten only)";
  if (const char* why = stored_dw_unsupported(a.stored_rows, a.stored_cols, a.stored_interleaved, a.n, a.k, a.out_bf16))
    return why;
  const auto misaligned = [](const void* p) { return (reinterpret_cast<uintptr_t>(p) & 15u) != 0; };
  if (misaligned(a.dy_codes) || misaligned(a.dy_scales) || misaligned(a.x_codes) || misaligned(a.x_scales) ||
      misaligned(a.dw))
    return "an operand not 16-byte aligned";
  return nullptr;
}

void fp8_wgrad_1x128(const WgradArgs& a, const char* what, cudaStream_t stream) {
  const char* why = wgrad_device_unsupported(a);
  FLOWMOE_CHECK(why == nullptr, what << " (sm_90a wgrad kernel): " << why << " (experts " << a.num_experts << ", m "
                                     << a.m << ", n " << a.n << ", k " << a.k << ")");
  Work work;
  work.num_experts = a.num_experts;
  work.m = int(a.m);
  work.n = int(a.n);
  work.k = int(a.k);
  work.accumulate = a.accumulate ? 1 : 0;
  const WgradStore store = a.out_bf16 ? WgradStore::kBf16 : a.accumulate ? WgradStore::kF32Add : WgradStore::kF32;
  work.store = int(store);
  work.sa = a.dy_scales;
  work.sb = a.x_scales;
  work.ue8m0 = a.scales_ue8m0 ? 1 : 0;
  work.next_tile = a.tile_counter;
  work.bad_segments = a.status ? &a.status->bad_segments : nullptr;
  work.offsets = a.offsets;
  if (!a.offsets) std::copy(a.host_offsets, a.host_offsets + a.num_experts + 1, work.inline_offsets);
  // 128 x 256 tiles where K allows and the experts are long (a tile's math, 128 tokens per block,
  // then outweighs its 128 KB epilogue); with few tokens per expert the epilogue's wait between its
  // two halves costs more than the wider tile saves (docs/GEMM.md, "The wgrad kernel").
  const bool stored = a.stored_rows > 0, interleaved = stored && a.stored_interleaved;
  work.up_offset = interleaved ? int(a.k / 2) : 0;
  const int bn = stored ? 128  // (the stored outputs' one instantiation each)
                 : a.tile_n != 0 ? a.tile_n
                 : a.k % 256 == 0 && a.m >= int64_t(1024) * a.num_experts ? 256
                                                                          : 128;
  work.tiles_k = int(a.k / bn);
  work.tiles_per_expert = int(a.n / kTile) * work.tiles_k;
  // Everything that can throw (map encoding, the device's shared-memory limit) comes before the
  // first enqueued operation, so a failed call leaves dW untouched. A zero-capacity problem has no
  // tiles: dW is zeroed when overwriting.
  if (a.m == 0) {
    const int64_t per_expert = a.stored_rows > 0 ? a.stored_rows * a.stored_cols : a.n * a.k;
    if (!a.accumulate)
      FLOWMOE_CUDA_CHECK(
          cudaMemsetAsync(a.dw, 0, size_t(wgrad_store_bytes(store)) * a.num_experts * per_expert, stream));
    return;
  }
  const int sms = sm_count();
  const CUtensorMap mdy = make_tensor_map_2d(a.dy_codes, CU_TENSOR_MAP_DATA_TYPE_UINT8, 1, uint64_t(a.n),
                                             uint64_t(a.m), kTile, kTile, CU_TENSOR_MAP_SWIZZLE_128B, what);
  const CUtensorMap mx = make_tensor_map_2d(a.x_codes, CU_TENSOR_MAP_DATA_TYPE_UINT8, 1, uint64_t(a.k),
                                            uint64_t(a.m), interleaved ? 64 : kTile, kTile, CU_TENSOR_MAP_SWIZZLE_128B,
                                            what);
  const CUtensorMap mdw = a.stored_rows > 0
                              ? wgrad_dw_map(a.dw, store, a.stored_rows, a.stored_cols, what, a.num_experts)
                              : wgrad_dw_map(a.dw, store, int64_t(a.num_experts) * a.n, a.k, what);
  const int grid = int(std::min<int64_t>(int64_t(a.num_experts) * work.tiles_per_expert, sms));
  FLOWMOE_CUDA_CHECK(cudaMemsetAsync(a.tile_counter, 0, sizeof(int), stream));
  if (interleaved)
    wgrad_kernel<128, kStoredInterleaved><<<grid, kThreads, WCfg<128>::kSmemBytes, stream>>>(mdy, mx, mdw, work);
  else if (stored)
    wgrad_kernel<128, kStored><<<grid, kThreads, WCfg<128>::kSmemBytes, stream>>>(mdy, mx, mdw, work);
  else if (bn == 256)
    wgrad_kernel<256, kPlain><<<grid, kThreads, WCfg<256>::kSmemBytes, stream>>>(mdy, mx, mdw, work);
  else
    wgrad_kernel<128, kPlain><<<grid, kThreads, WCfg<128>::kSmemBytes, stream>>>(mdy, mx, mdw, work);
  FLOWMOE_CUDA_CHECK(cudaGetLastError());
}

}  // namespace sm90
}  // namespace cuda
}  // namespace flowmoe
