// SwiGLU backward on the GPU: the plain BF16 kernel (the baseline), the fused dSwiGLU + FP8
// row-wise and column-wise quantize kernel (H read as BF16, FP8 or MXFP4), the sum of the
// per-tile routing-probability gradient parts, and the unfused reference path; bit-identical to
// flowmoe::cpu (flowmoe/swiglu.h). Shared helpers and checks: swiglu_common.cuh; the forward is
// in swiglu_forward.cu.
//
// Kernels
//   dswiglu_row_kernel          plain backward, same grid as the forward row kernel.
//   dswiglu_quant_kernel<H, prob, act>  one CTA per (token block, feature tile): dA, gate and up
//                               tiles in, dgate and dup (BF16) formed once, row-wise tiles quantized
//                               from registers, each thread's 8 tokens parked in its own shared
//                               memory slots for the column-wise quantization along tokens.
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
                   GatedActivation act, bool gate_up) {
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
      const uint4 g = canonical_nan8(dg, mg), u = canonical_nan8(du, mu);
      if (gate_up) {  // the 8 pairs (d gate j, d up j) side by side: 32 bytes from column 2 j
        uint4* dst = reinterpret_cast<uint4*>(dh + r * 2 * f + 2 * (kb * kTile + lane * 8));
        dst[0] = make_uint4(__byte_perm(g.x, u.x, 0x5410), __byte_perm(g.x, u.x, 0x7632),
                            __byte_perm(g.y, u.y, 0x5410), __byte_perm(g.y, u.y, 0x7632));
        dst[1] = make_uint4(__byte_perm(g.z, u.z, 0x5410), __byte_perm(g.z, u.z, 0x7632),
                            __byte_perm(g.w, u.w, 0x5410), __byte_perm(g.w, u.w, 0x7632));
      } else {
        bf16_t* dst = dh + r * 2 * f + kb * kTile + lane * 8;
        *reinterpret_cast<uint4*>(dst) = g;
        *reinterpret_cast<uint4*>(dst + f) = u;
      }
    }
  }
}

// ---- backward: fused dSwiGLU + row-wise and column-wise quantize --------------------------------------
// One CTA of 256 threads per (128-token block, 128-feature tile): half-warp hw (0..15) owns the 8
// consecutive tokens 8hw .. 8hw+7 of the block, lane l (0..15) of it the features 8l .. 8l+7 of
// the gate side and of the up side. Each row's dgate and dup (BF16) are formed once and quantized
// row-wise at once (the half-warp holds the row's two 1x128 tiles); the thread keeps a running
// amax of its 16 features and parks the row in its own slots of shared memory (no transposed tile,
// no bank conflicts). The column amax of each feature over the block then comes from the other
// half-warp (shuffle) and the 8 warps (4 KB of shared memory), and each thread encodes its 8
// tokens of each of its 16 features into one 8-byte store of the column copy. The row loop is not
// unrolled: the kernel's code stays small enough for the instruction cache (fully unrolled, the
// ~45 instructions of each element's exact SwiGLU arithmetic made ~140 KB of code and the kernel
// ran at a quarter of the copy bandwidth). The saved H's loads are issued kBwdPrefetch rows ahead.
constexpr int kBwdRows = 8;      // consecutive tokens per thread: 16 half-warps x 8 = the 128-token block
constexpr int kBwdPrefetch = 2;  // rows whose loads are in flight while a row is computed
constexpr int kBwdCtasPerSm = 3;  // 80 registers (measured: 2 CTAs at 128 registers, or 3 rows ahead, are slower)
static_assert((kThreads / 16) * kBwdRows == kTile, "the half-warps' rows cover one token block");
// dynamic shared memory: each thread's 8 rows of dgate and dup, [row][side][thread] uint4
constexpr size_t kBwdSmem = size_t(kBwdRows) * 2 * kThreads * sizeof(uint4);

enum class HIn { kBf16, kFp8, kFp4 };  // how the backward reads the saved H

// One row's inputs for one lane: da' (8 BF16), the saved gate and up (8 each, in H's format,
// with their block scales), the routing probability.
struct BwdRowIn {
  uint4 d, g, u;   // da'; gate and up as BF16 (HIn::kBf16)
  uint2 cg, cu;    // gate and up codes (E4M3: 8 bytes; E2M1: the low word)
  uint8_t sg, su;  // their scales
  float p;
};

template <HIn kH, bool kProb>
__device__ __forceinline__ BwdRowIn bwd_load(bool valid, const bf16_t* __restrict__ da,
                                             const bf16_t* __restrict__ h, const uint8_t* __restrict__ hc,
                                             const uint8_t* __restrict__ hs, const float* __restrict__ prow,
                                             int64_t r, int64_t m, int64_t f, int64_t kt, int lane) {
  BwdRowIn in;
  in.d = in.g = in.u = make_uint4(0, 0, 0, 0);
  in.cg = in.cu = make_uint2(0, 0);
  in.sg = in.su = 0;
  in.p = 0.0f;
  if (!valid) return in;
  const int64_t k2 = 2 * f, col = kt * kTile + lane * 8;
  in.d = ldg16(da + r * f + col);
  if constexpr (kProb) in.p = __ldg(prow + r);
  if constexpr (kH == HIn::kFp8) {
    const uint8_t* src = hc + r * k2 + col;
    in.cg = __ldg(reinterpret_cast<const uint2*>(src));
    in.cu = __ldg(reinterpret_cast<const uint2*>(src + f));
    in.sg = __ldg(hs + kt * m + r);
    in.su = __ldg(hs + (f / kTile + kt) * m + r);
  } else if constexpr (kH == HIn::kFp4) {
    const uint8_t* src = hc + (r * k2 + col) / 2;
    in.cg.x = __ldg(reinterpret_cast<const uint32_t*>(src));
    in.cu.x = __ldg(reinterpret_cast<const uint32_t*>(src + f / 2));
    in.sg = __ldg(hs + r * (k2 / 32) + col / 32);
    in.su = __ldg(hs + r * (k2 / 32) + (f + col) / 32);
  } else {
    const bf16_t* src = h + r * k2 + col;
    in.g = ldg16(src);
    in.u = ldg16(src + f);
  }
  return in;
}

// Column codes of one feature for the thread's 8 tokens: w[i] holds token i's BF16 pair of the
// feature's column pair, `hi` picks the feature; scale code s (0xFF: non-finite column).
__device__ __forceinline__ uint2 encode_col8(const uint32_t (&w)[kBwdRows], bool hi, uint8_t s) {
  if (s == kUE8M0NaN) return make_uint2(0x7F7F7F7Fu, 0x7F7F7F7Fu);
  const int e = static_cast<int>(s) - 127;
  const float inv = detail::inv_pow2(e);
  uint32_t out[2];
#pragma unroll
  for (int h = 0; h < 2; ++h) {
    uint32_t x = 0;
#pragma unroll
    for (int pp = 0; pp < 2; ++pp) {
      const uint32_t a = w[4 * h + 2 * pp], b = w[4 * h + 2 * pp + 1];
      const float va = hi ? bf16_hi(a) : bf16_lo(a), vb = hi ? bf16_hi(b) : bf16_lo(b);
      x |= static_cast<uint32_t>(detail::e4m3x2(va * inv, vb * inv)) << (16 * pp);
    }
    out[h] = detail::e4m3x4_saturate_for_scale(x, e);
  }
  return make_uint2(out[0], out[1]);
}

template <HIn kH, bool kProb, ActivationKind kAct>
__global__ void __launch_bounds__(kThreads, kBwdCtasPerSm)
dswiglu_quant_kernel(const bf16_t* __restrict__ da, const bf16_t* __restrict__ h,
                     const uint8_t* __restrict__ hc, const uint8_t* __restrict__ hs,
                     const float* __restrict__ prow, int64_t m, int64_t f,
                     const int32_t* __restrict__ bstart, const int32_t* __restrict__ bend,
                     uint8_t* __restrict__ row_codes, uint8_t* __restrict__ row_scales,
                     uint8_t* __restrict__ col_codes, uint8_t* __restrict__ col_scales,
                     float* __restrict__ dpart, unsigned long long* nonfinite, GatedActivation act_in) {
  extern __shared__ __align__(16) uint4 s_rows[];                  // [kBwdRows][2][kThreads]
  __shared__ __align__(16) uint32_t s_amax[kThreads / 32][16][8];  // [warp][lane][column pair word]
  __shared__ __align__(16) uint16_t s_code[16][8];                 // [lane][word]: the pair's two scale codes
  GatedActivation act = act_in;
  act.kind = kAct;  // known here: no per-element branch on the kind
  int64_t b, kt;
  detail::tile_coords(b, kt);
  const int bs = bstart[b];
  if (bs < 0) return;
  const int n = bend[b] - bs;
  const int tid = threadIdx.x, lane = tid & 15, hw = tid >> 4;
  const int64_t k2 = 2 * f;
  const int row0 = hw * kBwdRows;  // the thread's first token in the block

  // Phase 1: rows. dgate and dup of 8 features per lane, quantized row-wise as they are formed.
  uint32_t cm[8] = {0, 0, 0, 0, 0, 0, 0, 0};  // running |.| max of the 8 BF16 pair words (gate 0-3, up 4-7)
  BwdRowIn in[kBwdPrefetch];
#pragma unroll
  for (int i = 0; i < kBwdPrefetch; ++i)
    in[i] = bwd_load<kH, kProb>(row0 + i < n, da, h, hc, hs, prow, int64_t(bs) + row0 + i, m, f, kt, lane);
#pragma unroll 1
  for (int i = 0; i < kBwdRows; ++i) {
    const BwdRowIn cur = in[0];
#pragma unroll
    for (int j = 0; j + 1 < kBwdPrefetch; ++j) in[j] = in[j + 1];
    {
      const int row = row0 + i + kBwdPrefetch;
      in[kBwdPrefetch - 1] =
          bwd_load<kH, kProb>(i + kBwdPrefetch < kBwdRows && row < n, da, h, hc, hs, prow, int64_t(bs) + row, m, f, kt, lane);
    }
    const int row = row0 + i;
    const int64_t r = static_cast<int64_t>(bs) + row;
    float xd[8], xg[8], xu[8];
    unpack8(cur.d, xd);
    if constexpr (kH == HIn::kFp8) {
      decode8(cur.cg, cur.sg, xg);
      decode8(cur.cu, cur.su, xu);
    } else if constexpr (kH == HIn::kFp4) {
      decode8_fp4(cur.cg.x, cur.sg, xg);
      decode8_fp4(cur.cu.x, cur.su, xu);
    } else {
      unpack8(cur.g, xg);
      unpack8(cur.u, xu);
    }
    if (kH != HIn::kBf16 && row >= n) {
#pragma unroll
      for (int j = 0; j < 8; ++j) xg[j] = xu[j] = 0.0f;
    }
    uint4 dg, du;
    if constexpr (kProb) {
      float pair[4];
      dswiglu8_prob(act, xd, cur.p, xg, xu, dg, du, pair);
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
    const uint32_t wg[4] = {dg.x, dg.y, dg.z, dg.w}, wu[4] = {du.x, du.y, du.z, du.w};
#pragma unroll
    for (int w = 0; w < 4; ++w) {
      cm[w] = __vmaxu2(cm[w], wg[w] & 0x7FFF7FFFu);
      cm[4 + w] = __vmaxu2(cm[4 + w], wu[w] & 0x7FFF7FFFu);
    }
    s_rows[(i * 2 + 0) * kThreads + tid] = dg;
    s_rows[(i * 2 + 1) * kThreads + tid] = du;
  }

  // Phase 2: columns. The block's amax of each adjacent feature pair (one BF16x2 word): the two
  // half-warps, then the 8 warps; 128 threads turn it into the pair's two scale codes; every
  // thread encodes its 8 tokens of its 16 features.
#pragma unroll
  for (int w = 0; w < 8; ++w) cm[w] = __vmaxu2(cm[w], __shfl_xor_sync(0xffffffffu, cm[w], 16));
  if ((tid & 16) == 0) {
    uint4* dst = reinterpret_cast<uint4*>(&s_amax[tid >> 5][lane][0]);
    dst[0] = make_uint4(cm[0], cm[1], cm[2], cm[3]);
    dst[1] = make_uint4(cm[4], cm[5], cm[6], cm[7]);
  }
  __syncthreads();
  if (tid < 16 * 8) {
    const int l = tid >> 3, w = tid & 7;
    uint32_t mx = 0;
#pragma unroll
    for (int wp = 0; wp < kThreads / 32; ++wp) mx = __vmaxu2(mx, s_amax[wp][l][w]);
    const uint32_t a0 = mx & 0xFFFFu, a1 = mx >> 16;
    const uint8_t s0 = a0 >= detail::kBf16NonFiniteBits ? kUE8M0NaN : ue8m0_from_exp(e4m3_scale_exp(detail::bf16_bits_to_f32(a0)));
    const uint8_t s1 = a1 >= detail::kBf16NonFiniteBits ? kUE8M0NaN : ue8m0_from_exp(e4m3_scale_exp(detail::bf16_bits_to_f32(a1)));
    s_code[l][w] = static_cast<uint16_t>(s0 | (s1 << 8));
    const int64_t feat = (w < 4 ? 0 : f) + kt * kTile + l * 8 + 2 * (w & 3);  // dH feature of the pair's first
    col_scales[b * k2 + feat] = s0;
    col_scales[b * k2 + feat + 1] = s1;
  }
  __syncthreads();
  const int t0 = row0;  // the thread's first token
  if (t0 >= n) return;
  const uint4 sc = *reinterpret_cast<const uint4*>(&s_code[lane][0]);
  const uint32_t codes[4] = {sc.x, sc.y, sc.z, sc.w};  // word w's two codes: bytes 2(w%2), 2(w%2)+1 of codes[w/2]
  const bool full = t0 + kBwdRows <= n && (m % 8 == 0) && (bs % 8 == 0);
#pragma unroll 1
  for (int side = 0; side < 2; ++side) {
    uint32_t v[4][kBwdRows];  // [word][token]
#pragma unroll
    for (int i = 0; i < kBwdRows; ++i) {
      const uint4 x = s_rows[(i * 2 + side) * kThreads + tid];
      v[0][i] = x.x, v[1][i] = x.y, v[2][i] = x.z, v[3][i] = x.w;
    }
#pragma unroll
    for (int w = 0; w < 4; ++w) {
      const int ws = 4 * side + w;  // the pair's word among the 8
      const int64_t feat = (side ? f : 0) + kt * kTile + lane * 8 + 2 * w;
#pragma unroll
      for (int hi = 0; hi < 2; ++hi) {
        const uint8_t s = static_cast<uint8_t>(codes[ws >> 1] >> (16 * (ws & 1) + 8 * hi));
        const uint2 c = encode_col8(v[w], hi != 0, s);
        uint8_t* dst = col_codes + (feat + hi) * m + bs + t0;
        if (full) {
          *reinterpret_cast<uint2*>(dst) = c;
        } else {
          for (int t = 0; t < min(kBwdRows, n - t0); ++t)
            dst[t] = static_cast<uint8_t>((t < 4 ? c.x : c.y) >> (8 * (t & 3)));
        }
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
             const int32_t* rows_bound, const GatedActivation& act, bool dh_gate_up) {
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
        da, h, prow, m, f, dh, dprow_part, nonfinite_ptr(status), rows_bound, act, dh_gate_up);
  } else {
    dswiglu_row_kernel<false><<<row_grid(m, f), kThreads, 0, stream>>>(
        da, h, nullptr, m, f, dh, nullptr, nonfinite_ptr(status), rows_bound, act, dh_gate_up);
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
  auto kernel = act.clamped() ? dswiglu_quant_kernel<kH, kProb, ActivationKind::kClampedSwiglu>
                              : dswiglu_quant_kernel<kH, kProb, ActivationKind::kSwiglu>;
  // More than 48 KB of dynamic shared memory needs an opt-in, per function and device; done once
  // per device (not on every launch, so that launches can be captured in a CUDA graph).
  static std::atomic<uint64_t> opted_in[2] = {{0}, {0}};
  std::atomic<uint64_t>& opted = opted_in[act.clamped() ? 1 : 0];
  int dev = 0;
  FLOWMOE_CUDA_CHECK(cudaGetDevice(&dev));
  const uint64_t bit = dev < 64 ? (uint64_t(1) << dev) : 0;
  if (!bit || !(opted.load(std::memory_order_relaxed) & bit)) {
    FLOWMOE_CUDA_CHECK(cudaFuncSetAttribute(kernel, cudaFuncAttributeMaxDynamicSharedMemorySize,
                                            static_cast<int>(kBwdSmem)));
    opted.fetch_or(bit, std::memory_order_relaxed);
  }
  const dim3 grid = tile_grid(sb.max_blocks, f / kTile);
  kernel<<<grid, kThreads, kBwdSmem, stream>>>(da, h, hc, hs, prow, sb.m, f, sb.block_start, sb.block_end,
                                               row_codes, row_scales, col_codes, col_scales, dprow_part,
                                               nonfinite_ptr(status), act);
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
