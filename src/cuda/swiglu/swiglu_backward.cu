// SwiGLU backward on the GPU: the plain BF16 kernel (the baseline), the fused dSwiGLU + FP8
// row-wise and column-wise quantize kernel (H read as BF16, FP8 or MXFP4), the sum of the
// per-tile routing-probability gradient parts, and the unfused reference path; bit-identical to
// flowmoe::cpu (flowmoe/swiglu.h). Shared helpers and checks: swiglu_common.cuh; the forward is
// in swiglu_forward.cu.
//
// Kernels
//   dswiglu_row_kernel          plain backward, same grid as the forward row kernel.
//   dswiglu_quant_kernel<Fp8H>  one CTA per (token block, feature tile): dA, gate and up tiles in,
//                               dgate and dup (BF16) formed once, row-wise tiles quantized from
//                               registers, the BF16 tile kept in shared memory for the column-wise
//                               quantization along tokens.
//   sum_dprow_parts_kernel      dprow = the per-tile parts summed in tile order, one thread per row.
// The dSwiGLU kernels take the gated activation `act` (swiglu_math.h) by value as an argument.
#include <algorithm>
#include <atomic>

#include "cuda/swiglu/swiglu_common.cuh"

namespace flowmoe {
namespace cuda {
using namespace swiglu_detail;
namespace {

// ---- backward: plain BF16 -------------------------------------------------------------------------
template <bool kProb>
__global__ void __launch_bounds__(kThreads)
dswiglu_row_kernel(const bf16_t* __restrict__ da, const bf16_t* __restrict__ h,
                   const float* __restrict__ prow, int64_t m, int64_t f, bf16_t* __restrict__ dh,
                   float* __restrict__ dpart, unsigned long long* nonfinite, const int32_t* __restrict__ m_bound,
                   GatedActivation act) {
  const int64_t kb = blockIdx.y;
  const int64_t mb = detail::bounded_rows(m, m_bound);  // rows processed; m is dpart's stride
  const int lane = threadIdx.x & 15;
  const int64_t r0 = static_cast<int64_t>(blockIdx.x) * kRowsPerCta + (threadIdx.x >> 4);
  uint4 vd[kRowsPerHalfWarp], vg[kRowsPerHalfWarp], vu[kRowsPerHalfWarp];
  float p[kRowsPerHalfWarp];
#pragma unroll
  for (int i = 0; i < kRowsPerHalfWarp; ++i) {
    const int64_t r = r0 + i * (kThreads / 16);
    vd[i] = vg[i] = vu[i] = make_uint4(0, 0, 0, 0);
    p[i] = 0.0f;
    if (r < mb) {
      const bf16_t* src = h + r * 2 * f + kb * kTile + lane * 8;
      vd[i] = ldg16(da + r * f + kb * kTile + lane * 8);
      vg[i] = ldg16(src);
      vu[i] = ldg16(src + f);
      if constexpr (kProb) p[i] = __ldg(prow + r);
    }
  }
#pragma unroll
  for (int i = 0; i < kRowsPerHalfWarp; ++i) {
    const int64_t r = r0 + i * (kThreads / 16);
    float xd[8], xg[8], xu[8];
    unpack8(vd[i], xd);
    unpack8(vg[i], xg);
    unpack8(vu[i], xu);
    uint4 dg, du;
    if constexpr (kProb) {
      float pair[4];
      dswiglu8_prob(act, xd, p[i], xg, xu, dg, du, pair);
      const float acc = tile_sum16(pair);
      if (dpart && lane == 0 && r < mb) dpart[kb * m + r] = f32_canonical(acc);
    } else {
      dswiglu8(act, xd, xg, xu, dg, du);
    }
    const uint32_t mg = detail::absmax8_bits(dg), mu = detail::absmax8_bits(du);
    if (nonfinite) {
      detail::count_nonfinite_warp(nonfinite, dg, mg >= detail::kBf16NonFiniteBits);
      detail::count_nonfinite_warp(nonfinite, du, mu >= detail::kBf16NonFiniteBits);
    }
    if (r < mb) {
      bf16_t* dst = dh + r * 2 * f + kb * kTile + lane * 8;
      *reinterpret_cast<uint4*>(dst) = canonical_nan8(dg, mg);
      *reinterpret_cast<uint4*>(dst + f) = canonical_nan8(du, mu);
    }
  }
}

// ---- backward: fused dSwiGLU + row-wise and column-wise quantize --------------------------------------
// Shared tile: 128 tokens x 256 bf16 (dgate features [0, 128), dup features [128, 256)), pitch
// 264 elements (528 bytes: 16-byte aligned rows; a warp reading 32 consecutive words of a row
// touches every bank once).
constexpr int kBwdPitch = 2 * kTile + 8;  // bf16 elements
constexpr int kBwdWords = kBwdPitch / 2;  // 32-bit words per row
constexpr size_t kBwdSmem = size_t(kTile) * kBwdPitch * 2 + 2 * kTile * sizeof(uint32_t) + 2 * kTile;
// Swizzled 16-byte chunks of a tile row (32 chunks of 8 bf16): chunk c of row r is stored at chunk
// c ^ ((r / 16) % 8) so that lanes reading the same word of rows 16 apart hit different banks.
__device__ __forceinline__ int bwd_chunk(int row, int chunk) {  // bf16 element offset
  return row * kBwdPitch + ((chunk ^ ((row >> 4) & 7)) << 3);
}
__device__ __forceinline__ int bwd_word(int row, int p) {  // 32-bit word offset of pair p
  return row * kBwdWords + ((((p >> 2) ^ ((row >> 4) & 7)) << 2) | (p & 3));
}
constexpr int kBwdCtasPerSm = FLOWMOE_SWIGLU_BWD_CTAS_PER_SM;

enum class HIn { kBf16, kFp8, kFp4 };  // how the backward reads the saved H

template <HIn kH, bool kProb>
__global__ void __launch_bounds__(kThreads, kBwdCtasPerSm)
dswiglu_quant_kernel(const bf16_t* __restrict__ da, const bf16_t* __restrict__ h,
                     const uint8_t* __restrict__ hc, const uint8_t* __restrict__ hs,
                     const float* __restrict__ prow, int64_t m, int64_t f,
                     const int32_t* __restrict__ bstart, const int32_t* __restrict__ bend,
                     uint8_t* __restrict__ row_codes, uint8_t* __restrict__ row_scales,
                     uint8_t* __restrict__ col_codes, uint8_t* __restrict__ col_scales,
                     float* __restrict__ dpart, unsigned long long* nonfinite, GatedActivation act) {
  extern __shared__ __align__(16) uint8_t smem[];
  uint16_t* s_t = reinterpret_cast<uint16_t*>(smem);
  uint32_t* s_amax = reinterpret_cast<uint32_t*>(smem + size_t(kTile) * kBwdPitch * 2);  // [2][128]
  int64_t b, kt;
  detail::tile_coords(b, kt);
  const int bs = bstart[b];
  if (bs < 0) return;
  const int n = bend[b] - bs;
  const int tid = threadIdx.x, lane = tid & 15;
  const int64_t k2 = 2 * f;

  // Phase 1: rows. dH for 8 features of (row, gate side) and (row, up side) per lane.
#pragma unroll
  for (int p0 = 0; p0 < kPasses; p0 += kPassGroup) {
    uint4 vd[kPassGroup], vg[kPassGroup], vu[kPassGroup];
    uint2 cg[kPassGroup], cu[kPassGroup];
    uint8_t sg[kPassGroup], su[kPassGroup];
    float pr[kPassGroup];
#pragma unroll
    for (int i = 0; i < kPassGroup; ++i) {
      const int row = (p0 + i) * (kThreads / 16) + (tid >> 4);
      const int64_t r = static_cast<int64_t>(bs) + row;
      vd[i] = vg[i] = vu[i] = make_uint4(0, 0, 0, 0);
      cg[i] = cu[i] = make_uint2(0, 0);
      sg[i] = su[i] = 0;
      pr[i] = 0.0f;
      if (row < n) {
        vd[i] = ldg16(da + r * f + kt * kTile + lane * 8);
        if constexpr (kProb) pr[i] = __ldg(prow + r);
        if constexpr (kH == HIn::kFp8) {
          const uint8_t* src = hc + r * k2 + kt * kTile + lane * 8;
          cg[i] = __ldg(reinterpret_cast<const uint2*>(src));
          cu[i] = __ldg(reinterpret_cast<const uint2*>(src + f));
          sg[i] = __ldg(hs + kt * m + r);
          su[i] = __ldg(hs + (f / kTile + kt) * m + r);
        } else if constexpr (kH == HIn::kFp4) {
          const int64_t col = kt * kTile + lane * 8;
          const uint8_t* src = hc + (r * k2 + col) / 2;
          cg[i].x = __ldg(reinterpret_cast<const uint32_t*>(src));
          cu[i].x = __ldg(reinterpret_cast<const uint32_t*>(src + f / 2));
          sg[i] = __ldg(hs + r * (k2 / 32) + col / 32);
          su[i] = __ldg(hs + r * (k2 / 32) + (f + col) / 32);
        } else {
          const bf16_t* src = h + r * k2 + kt * kTile + lane * 8;
          vg[i] = ldg16(src);
          vu[i] = ldg16(src + f);
        }
      }
    }
#pragma unroll
    for (int i = 0; i < kPassGroup; ++i) {
      const int row = (p0 + i) * (kThreads / 16) + (tid >> 4);
      const int64_t r = static_cast<int64_t>(bs) + row;
      float xd[8], xg[8], xu[8];
      unpack8(vd[i], xd);
      if constexpr (kH != HIn::kBf16) {
        if (row < n) {
          if constexpr (kH == HIn::kFp8) {
            decode8(cg[i], sg[i], xg);
            decode8(cu[i], su[i], xu);
          } else {
            decode8_fp4(cg[i].x, sg[i], xg);
            decode8_fp4(cu[i].x, su[i], xu);
          }
        } else {
#pragma unroll
          for (int j = 0; j < 8; ++j) xg[j] = xu[j] = 0.0f;
        }
      } else {
        unpack8(vg[i], xg);
        unpack8(vu[i], xu);
      }
      uint4 dg, du;
      if constexpr (kProb) {
        float pair[4];
        dswiglu8_prob(act, xd, pr[i], xg, xu, dg, du, pair);
        const float acc = tile_sum16(pair);
        if (dpart && lane == 0 && row < n) dpart[kt * m + r] = f32_canonical(acc);
      } else {
        dswiglu8(act, xd, xg, xu, dg, du);
      }
      const TileCodes qg = quantize_tile8(dg, nonfinite);
      const TileCodes qu = quantize_tile8(du, nonfinite);
      if (row < n) {
        uint8_t* dst = row_codes + r * k2 + kt * kTile + lane * 8;
        *reinterpret_cast<uint2*>(dst) = qg.codes;
        *reinterpret_cast<uint2*>(dst + f) = qu.codes;
        if (lane == 0) {
          row_scales[kt * m + r] = qg.scale;
          row_scales[(f / kTile + kt) * m + r] = qu.scale;
        }
      }
      // rows past n are all zero (zero inputs give zero gradients, for either activation)
      *reinterpret_cast<uint4*>(&s_t[bwd_chunk(row, lane)]) = dg;
      *reinterpret_cast<uint4*>(&s_t[bwd_chunk(row, 16 + lane)]) = du;
    }
  }
  __syncthreads();

  // Phase 2: columns. (a) amax per pair of adjacent features p over the block: thread = (p, half
  // of the tokens); (b) encode and store: task = (16-token group j, pair p), the 8 lanes of a
  // group covering one feature row's 128 tokens, so each store instruction writes full 128-byte
  // row segments. The swizzle (bwd_word) keeps both read patterns free of bank conflicts.
  uint8_t* s_code = reinterpret_cast<uint8_t*>(s_amax + 2 * kTile);  // [2][128]: scale code of pair p
  {
    const int p = tid & (kTile - 1), half = tid >> 7;
    uint32_t mx = 0;
#pragma unroll 8
    for (int i = 0; i < kTile / 2; ++i) {
      const int t = half * (kTile / 2) + i;
      mx = __vmaxu2(mx, reinterpret_cast<const uint32_t*>(s_t)[bwd_word(t, p)] & 0x7FFF7FFFu);
    }
    s_amax[half * kTile + p] = mx;
  }
  __syncthreads();
  if (tid < kTile) {
    const int p = tid;
    const uint32_t mx = __vmaxu2(s_amax[p], s_amax[kTile + p]);
    const uint32_t a0 = mx & 0xFFFFu, a1 = mx >> 16;
    const uint8_t s0 = a0 >= detail::kBf16NonFiniteBits ? kUE8M0NaN : ue8m0_from_exp(e4m3_scale_exp(detail::bf16_bits_to_f32(a0)));
    const uint8_t s1 = a1 >= detail::kBf16NonFiniteBits ? kUE8M0NaN : ue8m0_from_exp(e4m3_scale_exp(detail::bf16_bits_to_f32(a1)));
    s_code[p] = s0;
    s_code[kTile + p] = s1;
    const int c = 2 * p;  // tile column in [0, 256): dgate side below 128, dup side above
    const int64_t feat = (c < kTile ? 0 : f - kTile) + kt * kTile + c;  // dH feature of column c
    col_scales[b * k2 + feat] = s0;
    col_scales[b * k2 + feat + 1] = s1;
  }
  __syncthreads();
  const bool vec = (m % 16 == 0) && (bs % 16 == 0);
  for (int task = tid; task < kTile * (kTile / 16); task += kThreads) {
    const int j = task & 7, p = task >> 3;
    const int t0 = j * 16;
    if (t0 >= n) continue;
    const uint8_t s0 = s_code[p], s1 = s_code[kTile + p];
    const bool bad0 = s0 == kUE8M0NaN, bad1 = s1 == kUE8M0NaN;
    const float inv0 = bad0 ? 0.0f : detail::inv_pow2(static_cast<int>(s0) - 127);
    const float inv1 = bad1 ? 0.0f : detail::inv_pow2(static_cast<int>(s1) - 127);
    const int c = 2 * p;
    const int64_t feat = (c < kTile ? 0 : f - kTile) + kt * kTile + c;
    uint8_t* dst0 = col_codes + feat * m + bs;
    uint8_t* dst1 = dst0 + m;
    uint32_t w0[4], w1[4];
#pragma unroll
    for (int q = 0; q < 4; ++q) {
      uint32_t x0 = 0, x1 = 0;
#pragma unroll
      for (int pp = 0; pp < 2; ++pp) {
        const int t = t0 + 4 * q + 2 * pp;
        const uint32_t va = reinterpret_cast<const uint32_t*>(s_t)[bwd_word(t, p)];
        const uint32_t vb = reinterpret_cast<const uint32_t*>(s_t)[bwd_word(t + 1, p)];
        const uint32_t c0 = bad0 ? 0x7F7Fu : detail::e4m3x2(bf16_lo(va) * inv0, bf16_lo(vb) * inv0);
        const uint32_t c1 = bad1 ? 0x7F7Fu : detail::e4m3x2(bf16_hi(va) * inv1, bf16_hi(vb) * inv1);
        x0 |= c0 << (16 * pp);
        x1 |= c1 << (16 * pp);
      }
      w0[q] = bad0 ? x0 : detail::e4m3x4_saturate_for_scale(x0, static_cast<int>(s0) - 127);
      w1[q] = bad1 ? x1 : detail::e4m3x4_saturate_for_scale(x1, static_cast<int>(s1) - 127);
    }
    if (vec && t0 + 16 <= n) {
      *reinterpret_cast<uint4*>(dst0 + t0) = make_uint4(w0[0], w0[1], w0[2], w0[3]);
      *reinterpret_cast<uint4*>(dst1 + t0) = make_uint4(w1[0], w1[1], w1[2], w1[3]);
    } else {
      for (int t = t0; t < min(t0 + 16, n); ++t) {
        dst0[t] = static_cast<uint8_t>(w0[(t - t0) >> 2] >> (8 * ((t - t0) & 3)));
        dst1[t] = static_cast<uint8_t>(w1[(t - t0) >> 2] >> (8 * ((t - t0) & 3)));
      }
    }
  }
}

}  // namespace

// ================================================================================================
// launchers
// ================================================================================================
void dswiglu(const bf16_t* da, const bf16_t* h, int64_t m, int64_t f, bf16_t* dh,
             DeviceStatus* status, cudaStream_t stream, const float* prow, float* dprow_part,
             const int32_t* rows_bound, const GatedActivation& act) {
  const char* what = "cuda::dswiglu";
  check_f(f, what);
  check_act(act, what);
  check_m(m, what);
  check_prob(prow, dprow_part, what);
  if (m == 0) return;
  check_aligned(da, "da", what);
  check_aligned(h, "h", what);
  check_aligned(dh, "dh", what);
  if (prow) {
    dswiglu_row_kernel<true><<<row_grid(m, f), kThreads, 0, stream>>>(
        da, h, prow, m, f, dh, dprow_part, nonfinite_ptr(status), rows_bound, act);
  } else {
    dswiglu_row_kernel<false><<<row_grid(m, f), kThreads, 0, stream>>>(
        da, h, nullptr, m, f, dh, nullptr, nonfinite_ptr(status), rows_bound, act);
  }
  FLOWMOE_LAUNCH_CHECK(what);
}

namespace {
template <HIn kH, bool kProb>
void launch_dswiglu_quant(const bf16_t* da, const bf16_t* h, const uint8_t* hc, const uint8_t* hs,
                          const float* prow, int64_t f, const SegmentBlocks& sb, uint8_t* row_codes,
                          uint8_t* row_scales, uint8_t* col_codes, uint8_t* col_scales,
                          float* dprow_part, DeviceStatus* status, cudaStream_t stream,
                          const GatedActivation& act, const char* what) {
  // More than 48 KB of dynamic shared memory needs an opt-in, per function and device; done once
  // per device (not on every launch, so that launches can be captured in a CUDA graph).
  static std::atomic<uint64_t> opted_in{0};
  int dev = 0;
  FLOWMOE_CUDA_CHECK(cudaGetDevice(&dev));
  const uint64_t bit = dev < 64 ? (uint64_t(1) << dev) : 0;
  if (!bit || !(opted_in.load(std::memory_order_relaxed) & bit)) {
    FLOWMOE_CUDA_CHECK(cudaFuncSetAttribute(dswiglu_quant_kernel<kH, kProb>,
                                            cudaFuncAttributeMaxDynamicSharedMemorySize,
                                            static_cast<int>(kBwdSmem)));
    opted_in.fetch_or(bit, std::memory_order_relaxed);
  }
  const dim3 grid = tile_grid(sb.max_blocks, f / kTile);
  dswiglu_quant_kernel<kH, kProb><<<grid, kThreads, kBwdSmem, stream>>>(
      da, h, hc, hs, prow, sb.m, f, sb.block_start, sb.block_end, row_codes, row_scales, col_codes,
      col_scales, dprow_part, nonfinite_ptr(status), act);
  FLOWMOE_LAUNCH_CHECK(what);
}

void check_bwd_outputs(const uint8_t* row_codes, const uint8_t* row_scales,
                       const uint8_t* col_codes, const uint8_t* col_scales, const char* what) {
  check_pair(row_codes, row_scales, "row_codes", "row_scales", what);
  check_pair(col_codes, col_scales, "col_codes", "col_scales", what);
}
}  // namespace

namespace {
// The three fused backward entry points: checks, then the kernel for the saved H's format and
// whether a routing probability is given.
template <HIn kH>
void dswiglu_quant_entry(const bf16_t* da, const bf16_t* h, const uint8_t* hc, const uint8_t* hs,
                         const char* hc_name, const char* hs_name, int64_t f, const SegmentBlocks& sb,
                         uint8_t* row_codes, uint8_t* row_scales, uint8_t* col_codes,
                         uint8_t* col_scales, DeviceStatus* status, cudaStream_t stream,
                         const float* prow, float* dprow_part, const GatedActivation& act,
                         const char* what) {
  check_f(f, what);
  check_blocks(sb, what);
  check_prob(prow, dprow_part, what);
  check_act(act, what);
  if (sb.m == 0) return;
  check_aligned(da, "da", what);
  if constexpr (kH == HIn::kBf16) check_aligned(h, "h", what);
  else check_pair(hc, hs, hc_name, hs_name, what);
  check_bwd_outputs(row_codes, row_scales, col_codes, col_scales, what);
  if (prow)
    launch_dswiglu_quant<kH, true>(da, h, hc, hs, prow, f, sb, row_codes, row_scales, col_codes,
                                   col_scales, dprow_part, status, stream, act, what);
  else
    launch_dswiglu_quant<kH, false>(da, h, hc, hs, nullptr, f, sb, row_codes, row_scales, col_codes,
                                    col_scales, nullptr, status, stream, act, what);
}
}  // namespace

void dswiglu_quant(const bf16_t* da, const bf16_t* h, int64_t f, const SegmentBlocks& sb,
                   uint8_t* row_codes, uint8_t* row_scales, uint8_t* col_codes,
                   uint8_t* col_scales, DeviceStatus* status, cudaStream_t stream,
                   const float* prow, float* dprow_part, const GatedActivation& act) {
  dswiglu_quant_entry<HIn::kBf16>(da, h, nullptr, nullptr, nullptr, nullptr, f, sb, row_codes, row_scales,
                                  col_codes, col_scales, status, stream, prow, dprow_part, act,
                                  "cuda::dswiglu_quant");
}

void dswiglu_quant_fp8h(const bf16_t* da, const uint8_t* h_codes, const uint8_t* h_scales,
                        int64_t f, const SegmentBlocks& sb, uint8_t* row_codes,
                        uint8_t* row_scales, uint8_t* col_codes, uint8_t* col_scales,
                        DeviceStatus* status, cudaStream_t stream, const float* prow,
                        float* dprow_part, const GatedActivation& act) {
  dswiglu_quant_entry<HIn::kFp8>(da, nullptr, h_codes, h_scales, "h_codes", "h_scales", f, sb, row_codes,
                                 row_scales, col_codes, col_scales, status, stream, prow, dprow_part,
                                 act, "cuda::dswiglu_quant_fp8h");
}

void dswiglu_quant_fp4h(const bf16_t* da, const uint8_t* h4_codes, const uint8_t* h4_scales,
                        int64_t f, const SegmentBlocks& sb, uint8_t* row_codes,
                        uint8_t* row_scales, uint8_t* col_codes, uint8_t* col_scales,
                        DeviceStatus* status, cudaStream_t stream, const float* prow,
                        float* dprow_part, const GatedActivation& act) {
  dswiglu_quant_entry<HIn::kFp4>(da, nullptr, h4_codes, h4_scales, "h4_codes", "h4_scales", f, sb, row_codes,
                                 row_scales, col_codes, col_scales, status, stream, prow, dprow_part,
                                 act, "cuda::dswiglu_quant_fp4h");
}

namespace {
__global__ void sum_dprow_parts_kernel(const float* __restrict__ part, int64_t m, int64_t tiles,
                                       float* __restrict__ dprow) {
  for (int64_t r = blockIdx.x * int64_t(blockDim.x) + threadIdx.x; r < m;
       r += int64_t(gridDim.x) * blockDim.x) {
    float acc = part[r];
    for (int64_t b = 1; b < tiles; ++b) acc = f_add(acc, part[b * m + r]);
    dprow[r] = f32_canonical(acc);
  }
}
}  // namespace

void sum_dprow_parts(const float* dprow_part, int64_t m, int64_t f, float* dprow,
                     cudaStream_t stream) {
  const char* what = "cuda::sum_dprow_parts";
  check_f(f, what);
  check_m(m, what);
  if (m == 0) return;
  FLOWMOE_CHECK(dprow_part != nullptr && dprow != nullptr,
                what << ": dprow_part and dprow must both be given");
  const int64_t blocks = std::min<int64_t>((m + kThreads - 1) / kThreads, 4096);
  sum_dprow_parts_kernel<<<static_cast<unsigned>(blocks), kThreads, 0, stream>>>(
      dprow_part, m, f / kTile, dprow);
  FLOWMOE_LAUNCH_CHECK(what);
}

void dswiglu_quant_unfused(const bf16_t* da, const bf16_t* h, int64_t f, const SegmentBlocks& sb,
                           uint8_t* row_codes, uint8_t* row_scales, uint8_t* col_codes,
                           uint8_t* col_scales, bf16_t* work, DeviceStatus* status,
                           cudaStream_t stream) {
  const char* what = "cuda::dswiglu_quant_unfused";
  check_f(f, what);
  check_blocks(sb, what);
  if (sb.m == 0) return;
  check_aligned(work, "work", what);
  dswiglu(da, h, sb.m, f, work, nullptr, stream);
  quantize_row(work, sb.m, 2 * f, row_codes, row_scales, status, stream);
  quantize_col(work, 2 * f, sb, col_codes, col_scales, nullptr, nullptr, nullptr, stream);
}

}  // namespace cuda
}  // namespace flowmoe
