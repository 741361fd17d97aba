// FP8 (E4M3) grouped GEMM for fprop and dgrad on sm_90a, 1x128 activation scales x 128x128
// weight block scales, BF16 output: one persistent kernel over all experts whose token offsets it
// reads from device memory, so no host needs the per-expert counts (docs/GEMM.md, "The grouped
// fprop/dgrad kernel").
//
//   D_e [M_e, n_out] = sum over the 128-wide blocks b of k_red of (A_e,b . B_e,b^T) * sa[row][b] * sb[e][col/128][b]
//
// Schedule. Output tiles are 128 tokens x kBN features (kBN = 256 when n_out allows, else 128).
// Expert e has ceil(M_e/128) x n_out/kBN tiles (its last token tile partial: the TMA load reads
// the next expert's rows or zero fill past m, and the epilogue writes only rows < M_e). Every CTA
// reads the offsets into shared memory and builds the prefix of tile counts (one warp), then takes
// tiles blockIdx.x, + gridDim.x, ... (static: the producers and the consumers walk the same
// sequence with no hand-off). Within an expert the token tiles run fastest, so a wave of CTAs
// shares an expert's weight rows in L2.
//
// CTA: 3 warpgroups. Warpgroup 0: one thread issues the TMA loads of a ring of stages (A tile
// 128 tokens x 128, B tile kBN features x 128, 128-byte swizzle); three warps decode the stages'
// scales (A's per row, B's per 128-feature block; k-blocks in turn) into shared memory, so the math
// warps never wait on a global load. Warpgroups 1 and 2: token rows 0-63 and 64-127 of the tile; per 128-wide
// block and 128-feature half four m64n128k32 WGMMAs into a block accumulator, then
// acc += block * (sa * sb). While one consumer promotes, the other's WGMMAs keep the tensor cores
// busy. Epilogue: full 64-row halves staged as BF16 in swizzled shared memory and written by TMA
// stores that overlap the next tile's math; a partial half stores BF16 pairs from the fragments,
// rows below M_e only. GEMM1 of the flow recipes can instead end in the fused SwiGLU epilogue
// (Epi::kSwigluH8 / kSwigluH4, kBN = 256 over W1 interleaved in 128-row gate/up blocks:
// sm90_grouped_swiglu_epilogue.cuh), which writes a' and the saved h quantized and no BF16 h;
// GEMM2-dgrad of the flow recipes in the fused dSwiGLU epilogue (Epi::kDswigluH8 / kDswigluH4,
// kBN = 128: sm90_grouped_dswiglu_epilogue.cuh), which reads the saved h (cp.async at each tile's
// start) and writes dh row-wise and column-wise and dp's partial sums, no BF16 da'.
#include <cuda.h>
#include <cuda_bf16.h>
#include <cuda_runtime.h>

#include <algorithm>
#include <cstdint>

#include "cuda/common.cuh"
#include "cuda/gemm/grouped_row_schedule.cuh"
#include "cuda/gemm/sm90_fp8_grouped_1x128.h"
#include "cuda/gemm/sm90_grouped_dswiglu_epilogue.cuh"
#include "cuda/gemm/sm90_grouped_swiglu_epilogue.cuh"
#include "cuda/sm90/fence.cuh"
#include "cuda/sm90/mbarrier.cuh"
#include "cuda/sm90/tma.cuh"
#include "cuda/sm90/wgmma.cuh"
#include "flowmoe/cuda/status.h"
#include "flowmoe/error.h"
#include "flowmoe/numerics.h"

namespace flowmoe {
namespace cuda {
namespace sm90 {
namespace {

constexpr int kTile = 128;    // tokens per output tile; k per block; features per weight scale block
constexpr int kThreads = 384;
constexpr int kScaleWarps = 3;  // producer warps decoding the scales, k-blocks in turn
constexpr int kSchedBytes = 2 * (kMaxGroupedExperts + 1) * 4;  // offsets and tile prefix

// The configuration of one feature-tile width: 128 (any n_out) or 256 (n_out a multiple of 256:
// the same A tile feeds twice the math, a quarter less operand traffic per FLOP). Shared memory
// (227 KB per CTA) holds the ring of stages and the BF16 output tile the epilogue stages for its
// TMA stores (64 KB at kBN = 256, 32 KB at 128), or the dSwiGLU epilogue's buffers (108 KB);
// kStages is what the rest leaves (>= 3: two loads in flight while one stage is read).
template <int kBN, Epi kEpi>
struct Cfg {
  static constexpr int kHalves = kBN / 128;                      // 128-feature halves (B scale blocks)
  static constexpr int kStageBytes = kTile * kTile + kBN * kTile;  // A tile + B tile, FP8
  static constexpr int kStages = kBN == 256 || is_dswiglu(kEpi) ? 3 : 5;
  static constexpr int kScaleFloats = kTile + 4;                 // per stage: 128 A scales, B's per half
  static constexpr int kBoxes = kBN / 64;                        // TMA store boxes per warpgroup
  static constexpr int kEpiBytes =                               // both warpgroups' 64 x kBN BF16 halves
      is_dswiglu(kEpi) ? DswigluSmem::kBytes : 2 * 64 * kBN * 2;
  static constexpr int kSmemBytes = kStages * kStageBytes + kEpiBytes + kStages * kScaleFloats * 4 +
                                    kSchedBytes + 2 * kStages * 8 + 16 + 1024;
  static_assert(kSmemBytes <= 227 * 1024, "shared memory over the sm_90 per-CTA limit: fewer stages");
};
constexpr int kBoxBytes = 64 * 128;  // a 64 x 64 BF16 store box: 64 rows of 128 bytes

struct Params {
  const int32_t* offsets;
  int num_experts;
  int m, n_out, k_red;
  const uint8_t* a_u8;  // exactly one of a_u8 / a_f32 is set
  const float* a_f32;
  int64_t a_ld;
  const uint8_t* b_u8;
  const float* b_f32;
  int64_t b_ld;
  bf16_t* d;  // Epi::kBf16
  unsigned long long* bad_segments;
  SwigluEpiParams swiglu;  // the SwiGLU epilogues
  DswigluEpiParams dswiglu;  // the dSwiGLU epilogues
};


template <int kBN, Epi kEpi>
__global__ void __launch_bounds__(kThreads, 1)
    grouped_rowwise_kernel(const __grid_constant__ CUtensorMap map_a, const __grid_constant__ CUtensorMap map_b,
                           const __grid_constant__ CUtensorMap map_d, const __grid_constant__ Params p) {
#ifdef FLOWMOE_SM90A
  using C = Cfg<kBN, kEpi>;
  constexpr bool kDswiglu = is_dswiglu(kEpi), kH4 = kEpi == Epi::kDswigluH4;
  static_assert(!is_swiglu(kEpi) || kBN == 256, "the SwiGLU epilogue needs gate and up in one 256-wide tile");
  static_assert(!is_swiglu(kEpi) || SwigluStage<kEpi>::kBytes <= C::kBoxes * kBoxBytes,
                "the SwiGLU epilogue's codes must fit the warpgroup's staging buffer");
  static_assert(!kDswiglu || kBN == 128, "the dSwiGLU epilogue takes 128-feature tiles (one row tile of dh)");
  constexpr int kStages = C::kStages, kStageBytes = C::kStageBytes, kScaleFloats = C::kScaleFloats;
  extern __shared__ __align__(1024) uint8_t smem_raw[];
  uint8_t* smem = reinterpret_cast<uint8_t*>((reinterpret_cast<uintptr_t>(smem_raw) + 1023) & ~uintptr_t(1023));
  uint8_t* epi = smem + kStages * kStageBytes;                          // [2][kBoxes][64][128 bytes]
  float* scl = reinterpret_cast<float*>(epi + C::kEpiBytes);             // [stage][kScaleFloats]
  int* s_off = reinterpret_cast<int*>(scl + kStages * kScaleFloats);  // [E + 1]
  int* s_start = s_off + kMaxGroupedExperts + 1;          // [E + 1] first tile of each expert
  uint64_t* full = reinterpret_cast<uint64_t*>(s_start + kMaxGroupedExperts + 1);
  uint64_t* empty = full + kStages;
  int* s_total = reinterpret_cast<int*>(empty + kStages);
  const int E = p.num_experts, n_tiles = p.n_out / kBN, kb_count = p.k_red / kTile;
  for (int i = threadIdx.x; i <= E; i += kThreads) s_off[i] = p.offsets[i];
  if (threadIdx.x == 0) {
    for (int s = 0; s < kStages; ++s) {
      mbar_init(&full[s], 1 + 32);  // the TMA thread (with the bytes) and the scale warp's lanes
      mbar_init(&empty[s], 8);      // the 8 consumer warps
    }
    fence_mbarrier_init();
  }
  __syncthreads();
  if (threadIdx.x < 32)
    build_row_tile_schedule(s_off, E, p.m, n_tiles, s_start, s_total, p.bad_segments, /*allow_base=*/kEpi == Epi::kBf16);
  __syncthreads();
  const int total = *s_total;
  const int wg = threadIdx.x / 128, t = threadIdx.x % 128;
  const int warp = t / 32, lane = t % 32;
  if (wg == 0) {
    warpgroup_reg_dealloc<56>();  // 128 x 56 + 256 x 224 <= 64K registers
    if (warp == 0 && lane == 0) {  // the TMA loads of the code tiles
      uint32_t it = 0;
      for (int tile = blockIdx.x; tile < total; tile += gridDim.x) {
        const RowTile rt = row_tile(s_off, s_start, E, tile, kDswiglu, n_tiles);
        const int row_a = rt.off + rt.local0, row_b = rt.e * p.n_out + rt.nt * kBN;
        for (int kb = 0; kb < kb_count; ++kb, ++it) {
          const int s = it % kStages;
          mbar_wait(&empty[s], ((it / kStages) & 1) ^ 1);
          uint8_t* a = smem + s * kStageBytes;
          mbar_expect_tx(&full[s], kStageBytes);
          tma_load_2d(a, &map_a, &full[s], kb * kTile, row_a);
#pragma unroll
          for (int h = 0; h < C::kHalves; ++h)
            tma_load_2d(a + (1 + h) * kTile * kTile, &map_b, &full[s], kb * kTile, row_b + h * kTile);
        }
      }
    } else if (warp >= 1) {
      // The scales of each stage, decoded to FP32 into shared memory ahead of the consumers (their
      // global-load latency off the math warps' path). A warp waits a global round trip per k-block,
      // so warps 1 .. kScaleWarps take the k-blocks in turn and that many are in flight (kScaleWarps
      // <= kStages: a warp's wait on a stage is never two phases behind). Lane l takes rows
      // 4 l .. 4 l + 3 of the token tile (0 past the expert's rows), lanes 0 .. halves - 1 also B's
      // block scales.
      static_assert(kScaleWarps <= 3 && kScaleWarps <= kStages, "scale warps: warps 1-3, at most one per stage");
      const uint32_t sw = warp - 1;
      uint32_t it = 0;
      for (int tile = blockIdx.x; tile < total; tile += gridDim.x) {
        const RowTile rt = row_tile(s_off, s_start, E, tile, kDswiglu, n_tiles);
        const int off = rt.off, me = rt.rows;
        const int lr = rt.local0 + 4 * lane;  // first of this lane's rows in the expert
        const int64_t b_row = (int64_t(rt.e) * (p.n_out / kTile) + rt.nt * C::kHalves + lane) * p.b_ld;
        const int64_t a_step = p.a_u8 ? p.a_ld : me;
        for (int kb = 0; kb < kb_count; ++kb, ++it) {
          if (it % kScaleWarps != sw) continue;
          const int s = it % kStages;
          float v[4];
          if (p.a_u8) {
            const uint8_t* src = p.a_u8 + kb * a_step + off + lr;
#pragma unroll
            for (int q = 0; q < 4; ++q) v[q] = lr + q < me ? num::ue8m0_to_f32(__ldg(src + q)) : 0.0f;
          } else {
            const float* src = p.a_f32 + int64_t(kb_count) * off + kb * a_step + lr;
#pragma unroll
            for (int q = 0; q < 4; ++q) v[q] = lr + q < me ? __ldg(src + q) : 0.0f;
          }
          float sb = 0.0f;
          if (lane < C::kHalves) sb = p.b_u8 ? num::ue8m0_to_f32(__ldg(p.b_u8 + b_row + kb)) : __ldg(p.b_f32 + b_row + kb);
          mbar_wait(&empty[s], ((it / kStages) & 1) ^ 1);
          float* dst = scl + s * kScaleFloats;
          *reinterpret_cast<float4*>(dst + 4 * lane) = make_float4(v[0], v[1], v[2], v[3]);
          if (lane < C::kHalves) dst[kTile + lane] = sb;
          mbar_arrive(&full[s]);
        }
      }
    }
    return;
  }
  warpgroup_reg_alloc<224>();
  const int ci = wg - 1;                   // token rows 64 ci .. 64 ci + 63 of the tile
  const int r0 = 16 * warp + lane / 4;     // fragment rows r0 and r0 + 8 (of the half tile)
  const int c0 = 2 * (lane % 4);           // fragment columns 8 j + c0, + 1 (of a 128-feature half)
  uint8_t* ebuf = epi + ci * (kDswiglu ? DswigluSmem::kWgBytes : C::kBoxes * kBoxBytes);  // this warpgroup's
  uint32_t* dexch = reinterpret_cast<uint32_t*>(epi + 2 * DswigluSmem::kWgBytes);  // dSwiGLU: both warpgroups'
  uint16_t* dcodes = reinterpret_cast<uint16_t*>(epi + 2 * DswigluSmem::kWgBytes + DswigluSmem::kExchBytes);
  float acc[C::kHalves][64], blk[64];
  uint32_t it = 0;
  for (int tile = blockIdx.x; tile < total; tile += gridDim.x) {
    const RowTile rt = row_tile(s_off, s_start, E, tile, kDswiglu, n_tiles);
    const int off = rt.off, me = rt.rows;
    const int nt = rt.nt, local0 = rt.local0 + 64 * ci;  // first row of this half
#pragma unroll
    for (int h = 0; h < C::kHalves; ++h)
#pragma unroll
      for (int i = 0; i < 64; ++i) acc[h][i] = 0.0f;
    DswigluRowIn din;
    if constexpr (kDswiglu) din = dswiglu_tile_start<kH4>(ebuf, p.dswiglu, int64_t(off) + local0, me - local0, nt, t);
    for (int kb = 0; kb < kb_count; ++kb, ++it) {
      const int s = it % kStages;
      mbar_wait(&full[s], (it / kStages) & 1);
      const float* ss = scl + s * kScaleFloats;
      const float sa0 = ss[64 * ci + r0], sa1 = ss[64 * ci + r0 + 8];
      const uint32_t a_addr = smem_u32(smem + s * kStageBytes) + ci * (64 * kTile);
#pragma unroll
      for (int h = 0; h < C::kHalves; ++h) {
        const float sb = ss[kTile + h], s0 = sa0 * sb, s1 = sa1 * sb;
        wgmma_block_m64n128k128_e4m3(blk, a_addr, smem_u32(smem + s * kStageBytes + (1 + h) * kTile * kTile));
        if (h == C::kHalves - 1) {  // the stage's last WGMMA has read its operands
          __syncwarp();
          if (lane == 0) mbar_arrive(&empty[s]);
        }
#pragma unroll
        for (int j = 0; j < 16; ++j) {
          acc[h][4 * j + 0] = fmaf(blk[4 * j + 0], s0, acc[h][4 * j + 0]);
          acc[h][4 * j + 1] = fmaf(blk[4 * j + 1], s0, acc[h][4 * j + 1]);
          acc[h][4 * j + 2] = fmaf(blk[4 * j + 2], s1, acc[h][4 * j + 2]);
          acc[h][4 * j + 3] = fmaf(blk[4 * j + 3], s1, acc[h][4 * j + 3]);
        }
      }
    }
    // Epilogue. A warpgroup half whose 64 rows all belong to the expert goes through shared memory:
    // BF16 into kBoxes boxes of 64 x 64 (16-byte chunk c of row q at c ^ (q % 8): the TMA's 128-byte
    // swizzle, conflict-free writes), then one thread issues the TMA stores and the warpgroup goes on
    // to the next tile; the buffer is waited for (read) only when the next such epilogue refills it.
    // A partial half (the expert's last token tile) stores BF16 pairs from the fragments, rows below
    // M_e only (the others belong to the next expert or lie past the segments). (The BF16 kernel's
    // rows_tma_epilogue.cuh is this code as a function; here it stays inline: see that file.)
    if constexpr (kDswiglu) {
      const int64_t block = s_start[rt.e] / n_tiles + rt.local0 / kTile;  // the expert's 128-token block
      dswiglu_epilogue<kH4>(acc[0], ebuf, dexch, dcodes, p.dswiglu, din, int64_t(off) + local0, me - local0, nt,
                            block, t, ci, 1 + ci);
    } else if constexpr (kEpi != Epi::kBf16) {
      swiglu_epilogue<kEpi>(acc, ebuf, p.swiglu, int64_t(off) + local0, me - local0, rt.e, nt, t, 1 + ci);
    } else if (local0 + 64 <= me) {
      if (t == 0) bulk_wait_read_all();
      named_sync(1 + ci, 128);
#pragma unroll
      for (int h = 0; h < C::kHalves; ++h)
#pragma unroll
        for (int j = 0; j < 16; ++j) {
          uint8_t* box = ebuf + (2 * h + j / 8) * kBoxBytes;
#pragma unroll
          for (int rh = 0; rh < 2; ++rh) {
            const int q = r0 + 8 * rh;
            *reinterpret_cast<__nv_bfloat162*>(box + q * 128 + (((j % 8) ^ (q % 8)) << 4) + 2 * c0) =
                __floats2bfloat162_rn(acc[h][4 * j + 2 * rh], acc[h][4 * j + 2 * rh + 1]);
          }
        }
      fence_async_smem();  // the writes above before the async proxy reads them
      named_sync(1 + ci, 128);
      if (t == 0) {
#pragma unroll
        for (int b = 0; b < C::kBoxes; ++b) tma_store_2d(&map_d, ebuf + b * kBoxBytes, nt * kBN + 64 * b, off + local0);
        bulk_commit();
      }
    } else {
      bf16_t* dst = p.d + (int64_t(off) + local0) * p.n_out + nt * kBN + c0;
      const bool v0 = local0 + r0 < me, v1 = local0 + r0 + 8 < me;
#pragma unroll
      for (int h = 0; h < C::kHalves; ++h)
#pragma unroll
        for (int j = 0; j < 16; ++j) {
          bf16_t* q = dst + h * kTile + 8 * j;
          if (v0)
            *reinterpret_cast<__nv_bfloat162*>(q + int64_t(r0) * p.n_out) =
                __floats2bfloat162_rn(acc[h][4 * j + 0], acc[h][4 * j + 1]);
          if (v1)
            *reinterpret_cast<__nv_bfloat162*>(q + int64_t(r0 + 8) * p.n_out) =
                __floats2bfloat162_rn(acc[h][4 * j + 2], acc[h][4 * j + 3]);
        }
    }
  }
  if (t == 0) bulk_wait_all();  // the stores have read the staging tile before the CTA exits
#else
  __trap();  // built without sm_90a: never a silent wrong answer (the CMake build always has it)
#endif
}

template <int kBN, Epi kEpi>
void allow_smem() {
  FLOWMOE_CUDA_CHECK(cudaFuncSetAttribute(grouped_rowwise_kernel<kBN, kEpi>,
                                          cudaFuncAttributeMaxDynamicSharedMemorySize, Cfg<kBN, kEpi>::kSmemBytes));
}

// SMs of the current device; the kernels' shared-memory limit raised once per device.
int sm_count() {
  return detail::sm_count_after([] {
    allow_smem<128, Epi::kBf16>();
    allow_smem<256, Epi::kBf16>();
    allow_smem<256, Epi::kSwigluH8>();
    allow_smem<256, Epi::kSwigluH4>();
    allow_smem<128, Epi::kDswigluH8>();
    allow_smem<128, Epi::kDswigluH4>();
  });
}

bool aligned16(const void* p) { return (reinterpret_cast<uintptr_t>(p) & 15u) == 0; }

// The checks of both entry points; `with_d`: the BF16 output is written (not the SwiGLU epilogue).
const char* unsupported(const RowwiseGroupedArgs& a, bool with_d) {
  constexpr int64_t kBig = int64_t(1) << 31;
  if (a.num_experts < 1 || a.num_experts > kMaxGroupedExperts) return "the expert count is not 1 .. 1024";
  if (a.m < 0 || a.m >= kBig) return "the token count is not 0 .. 2^31 - 1";
  if (a.n_out <= 0 || a.k_red <= 0 || a.n_out % kTile != 0 || a.k_red % kTile != 0)
    return "the output features and the contraction length must be positive multiples of 128";
  if (int64_t(a.num_experts) * a.n_out >= kBig || a.k_red >= kBig) return "the weights are too large (2^31 rows)";
  if ((a.m / kTile + a.num_experts) * (a.n_out / kTile) >= kBig) return "more than 2^31 output tiles";
  if (a.offsets == nullptr) return "no device offsets";
  if (a.m == 0) return nullptr;
  if (!a.a_codes || !a.a_scales || !a.b_codes || !a.b_scales || (with_d && !a.d)) return "a null operand pointer";
  if (!aligned16(a.a_codes) || !aligned16(a.b_codes) || (with_d && !aligned16(a.d)))
    return "codes or output not 16-byte aligned";
  if (a.a_ue8m0 && a.a_scale_ld < a.m) return "the activation scale grid's leading dimension is below the token count";
  if (a.b_scale_ld < a.k_red / kTile) return "the weight scale grid's leading dimension is below k/128";
  return nullptr;
}

// The kernel parameters and the tensor maps of the operands (and of D when `with_d`).
Params make_params(const RowwiseGroupedArgs& a, bool with_d, const char* what, CUtensorMap& ma, CUtensorMap& mb,
                   CUtensorMap& md) {
  ma = make_tensor_map_2d(a.a_codes, CU_TENSOR_MAP_DATA_TYPE_UINT8, 1, uint64_t(a.m), uint64_t(a.k_red), kTile, kTile,
                          CU_TENSOR_MAP_SWIZZLE_128B, what);
  mb = make_tensor_map_2d(a.b_codes, CU_TENSOR_MAP_DATA_TYPE_UINT8, 1, uint64_t(a.num_experts) * a.n_out,
                          uint64_t(a.k_red), kTile, kTile, CU_TENSOR_MAP_SWIZZLE_128B, what);
  md = CUtensorMap{};  // the SwiGLU epilogues store without TMA
  if (with_d)
    md = make_tensor_map_2d(a.d, CU_TENSOR_MAP_DATA_TYPE_BFLOAT16, 2, uint64_t(a.m), uint64_t(a.n_out), 64, 64,
                            CU_TENSOR_MAP_SWIZZLE_128B, what);
  Params p{};
  p.offsets = a.offsets;
  p.num_experts = a.num_experts;
  p.m = int(a.m);
  p.n_out = int(a.n_out);
  p.k_red = int(a.k_red);
  (a.a_ue8m0 ? reinterpret_cast<const void*&>(p.a_u8) : reinterpret_cast<const void*&>(p.a_f32)) = a.a_scales;
  p.a_ld = a.a_scale_ld;
  (a.b_ue8m0 ? reinterpret_cast<const void*&>(p.b_u8) : reinterpret_cast<const void*&>(p.b_f32)) = a.b_scales;
  p.b_ld = a.b_scale_ld;
  p.d = a.d;
  p.bad_segments = a.status ? &a.status->bad_segments : nullptr;
  return p;
}

// One CTA per SM, at most one per output tile (at most m/128 + E token tiles in all: each
// expert's last one partial).
int grid_size(const RowwiseGroupedArgs& a, int bn) {
  const int64_t max_tiles = (a.m / kTile + a.num_experts) * (a.n_out / bn);
  return int(std::min<int64_t>(max_tiles, sm_count()));
}

}  // namespace

const char* rowwise_grouped_unsupported(const RowwiseGroupedArgs& a) { return unsupported(a, true); }

void fp8_grouped_rowwise(const RowwiseGroupedArgs& a, const char* what, cudaStream_t stream) {
  const char* why = rowwise_grouped_unsupported(a);
  FLOWMOE_CHECK(why == nullptr, what << " (grouped sm_90a kernel): " << why << " (experts " << a.num_experts << ", m "
                                     << a.m << ", n " << a.n_out << ", k " << a.k_red << ")");
  if (a.m == 0) return;
  CUtensorMap ma, mb, md;
  const Params p = make_params(a, true, what, ma, mb, md);
  if (a.n_out % 256 == 0)
    grouped_rowwise_kernel<256, Epi::kBf16><<<grid_size(a, 256), kThreads, Cfg<256, Epi::kBf16>::kSmemBytes, stream>>>(ma, mb, md, p);
  else
    grouped_rowwise_kernel<128, Epi::kBf16><<<grid_size(a, 128), kThreads, Cfg<128, Epi::kBf16>::kSmemBytes, stream>>>(ma, mb, md, p);
  FLOWMOE_CUDA_CHECK(cudaGetLastError());
}

const char* swiglu_grouped_unsupported(const RowwiseGroupedArgs& a, const SwigluEpilogueArgs& s) {
  if (const char* why = unsupported(a, false)) return why;
  if (const char* why = num::activation_unsupported(s.act)) return why;
  if (a.d != nullptr) return "a BF16 output given: the SwiGLU epilogue writes a' and h only";
  if (s.f <= 0 || a.n_out != 2 * s.f) return "the output features are not 2F (gate and up)";
  if (a.m == 0) return nullptr;
  if (!s.a_codes || !s.a_scales || !s.h_codes || !s.h_scales) return "a null a' or h pointer";
  if (!aligned16(s.a_codes) || !aligned16(s.h_codes)) return "the a' or h codes are not 16-byte aligned";
  if (s.h_mxfp4 && (reinterpret_cast<uintptr_t>(s.h_scales) & 3u) != 0) return "the MXFP4 h scales are not 4-byte aligned";
  if (!aligned16(s.gate_up_bias)) return "GEMM1's bias is not 16-byte aligned";
  if (s.a_scale_ld < a.m || (!s.h_mxfp4 && s.h_scale_ld < a.m))
    return "the a' or h scale grid's leading dimension is below the token count";
  return nullptr;
}

void fp8_grouped_rowwise_swiglu(const RowwiseGroupedArgs& a, const SwigluEpilogueArgs& s, const char* what,
                                cudaStream_t stream) {
  const char* why = swiglu_grouped_unsupported(a, s);
  FLOWMOE_CHECK(why == nullptr, what << " (grouped sm_90a kernel, SwiGLU epilogue): " << why << " (experts "
                                     << a.num_experts << ", m " << a.m << ", n " << a.n_out << ", k " << a.k_red
                                     << ", F " << s.f << ")");
  if (a.m == 0) return;
  CUtensorMap ma, mb, md;
  Params p = make_params(a, false, what, ma, mb, md);
  p.swiglu.prob = s.prob;
  p.swiglu.a_codes = s.a_codes;
  p.swiglu.a_scales = s.a_scales;
  p.swiglu.h_codes = s.h_codes;
  p.swiglu.h_scales = s.h_scales;
  p.swiglu.a_scale_ld = s.a_scale_ld;
  p.swiglu.h_scale_ld = s.h_scale_ld;
  p.swiglu.f = int(s.f);
  p.swiglu.act = s.act;
  p.swiglu.bias = s.gate_up_bias;
  p.swiglu.nonfinite = s.status ? &s.status->nonfinite : nullptr;
  const int grid = grid_size(a, 256);
  if (s.h_mxfp4)
    grouped_rowwise_kernel<256, Epi::kSwigluH4><<<grid, kThreads, Cfg<256, Epi::kSwigluH4>::kSmemBytes, stream>>>(ma, mb, md, p);
  else
    grouped_rowwise_kernel<256, Epi::kSwigluH8><<<grid, kThreads, Cfg<256, Epi::kSwigluH8>::kSmemBytes, stream>>>(ma, mb, md, p);
  FLOWMOE_CUDA_CHECK(cudaGetLastError());
}

const char* dswiglu_grouped_unsupported(const RowwiseGroupedArgs& a, const DswigluEpilogueArgs& s) {
  if (const char* why = unsupported(a, false)) return why;
  if (const char* why = num::activation_unsupported(s.act)) return why;
  if (a.d != nullptr) return "a BF16 output given: the dSwiGLU epilogue writes dh and dp only";
  if (s.f <= 0 || a.n_out != s.f) return "the output features are not F (da' is [m, F])";
  if (a.m == 0) return nullptr;
  if (!s.h_codes || !s.h_scales || !s.row_codes || !s.row_scales || !s.col_codes || !s.col_scales)
    return "a null h or dh pointer";
  if (s.dprob_partials && !s.prob) return "dp's partial sums asked without the routing probabilities";
  if (!aligned16(s.h_codes) || !aligned16(s.row_codes) || !aligned16(s.col_codes))
    return "the h or dh codes are not 16-byte aligned";
  if ((reinterpret_cast<uintptr_t>(s.col_scales) & 1u) != 0) return "the column-wise dh scales are not 2-byte aligned";
  if (s.h_mxfp4 && (reinterpret_cast<uintptr_t>(s.h_scales) & 3u) != 0) return "the MXFP4 h scales are not 4-byte aligned";
  if (!s.h_mxfp4 && s.h_scale_ld < a.m) return "the h scale grid's leading dimension is below the token count";
  return nullptr;
}

void fp8_grouped_rowwise_dswiglu(const RowwiseGroupedArgs& a, const DswigluEpilogueArgs& s, const char* what,
                                 cudaStream_t stream) {
  const char* why = dswiglu_grouped_unsupported(a, s);
  FLOWMOE_CHECK(why == nullptr, what << " (grouped sm_90a kernel, dSwiGLU epilogue): " << why << " (experts "
                                     << a.num_experts << ", m " << a.m << ", n " << a.n_out << ", k " << a.k_red
                                     << ", F " << s.f << ")");
  if (a.m == 0) return;
  CUtensorMap ma, mb, md;
  Params p = make_params(a, false, what, ma, mb, md);
  DswigluEpiParams& q = p.dswiglu;
  q.prob = s.prob;
  q.h_codes = s.h_codes;
  q.h_scales = s.h_scales;
  q.h_scale_ld = s.h_scale_ld;
  q.m = a.m;
  q.row_codes = s.row_codes;
  q.row_scales = s.row_scales;
  q.col_codes = s.col_codes;
  q.col_scales = s.col_scales;
  q.dpart = s.dprob_partials;
  q.f = int(s.f);
  q.act = s.act;
  q.nonfinite = s.status ? &s.status->nonfinite : nullptr;
  const int grid = grid_size(a, 128);
  if (s.h_mxfp4)
    grouped_rowwise_kernel<128, Epi::kDswigluH4><<<grid, kThreads, Cfg<128, Epi::kDswigluH4>::kSmemBytes, stream>>>(
        ma, mb, md, p);
  else
    grouped_rowwise_kernel<128, Epi::kDswigluH8><<<grid, kThreads, Cfg<128, Epi::kDswigluH8>::kSmemBytes, stream>>>(
        ma, mb, md, p);
  FLOWMOE_CUDA_CHECK(cudaGetLastError());
}

}  // namespace sm90
}  // namespace cuda
}  // namespace flowmoe
