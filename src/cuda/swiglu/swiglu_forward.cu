// SwiGLU forward on the GPU: the plain BF16 kernel (the baseline) and the fused SwiGLU + FP8
// quantize kernels, bit-identical to flowmoe::cpu (flowmoe/swiglu.h). Shared helpers and checks:
// swiglu_common.cuh; the backward is in swiglu_backward.cu.
//
// Kernels
//   swiglu_row_kernel<Out>      half-warp per (token, 128-feature tile of A): reads the gate and
//                               up chunks, computes A = act(gate, up) in binary32 (swiglu_math.h;
//                               `act`, the gated activation, is a kernel argument) and either
//                               stores it as BF16 (plain) or quantizes the 1x128 tile straight
//                               from binary32 (fused), optionally quantizing the two H tiles it
//                               read as well.
//   swiglu_quant_col_kernel     one CTA per (128-token block of a segment, 128-feature tile):
//                               the row pass above into a shared byte tile, then the column copy
//                               by exponent shifts (the scaling-aware transpose, fused).
#include "cuda/bias/expert_bias.cuh"
#include "cuda/swiglu/swiglu_common.cuh"

namespace flowmoe {
namespace cuda {
using namespace swiglu_detail;
namespace {

// ---- forward, row-wise: plain BF16 or fused quantize ----------------------------------------------
enum class FwdOut { kBf16, kFp8, kFp8SaveH, kFp8SaveH4 };

// (h not __restrict__: bias.biased_h may be h itself, each value read before the same thread
// stores its biased value)
template <FwdOut kOut>
__global__ void __launch_bounds__(kThreads)
swiglu_row_kernel(const bf16_t* h, const float* __restrict__ prow, int64_t m, int64_t f,
                  bf16_t* __restrict__ a, uint8_t* __restrict__ a_codes, uint8_t* __restrict__ a_scales,
                  uint8_t* __restrict__ h_codes, uint8_t* __restrict__ h_scales,
                  unsigned long long* nonfinite, const int32_t* __restrict__ m_bound,
                  GatedActivation act, GateUpBias bias) {
  const int64_t kb = blockIdx.y;  // feature tile
  const int64_t mb = detail::bounded_rows(m, m_bound);  // rows processed; m is the scale grids' stride
  const int lane = threadIdx.x & 15;
  const int64_t r0 = static_cast<int64_t>(blockIdx.x) * kRowsPerCta + (threadIdx.x >> 4);
  uint4 g[kRowsPerHalfWarp], u[kRowsPerHalfWarp];
  float p[kRowsPerHalfWarp];
#pragma unroll
  for (int i = 0; i < kRowsPerHalfWarp; ++i) {
    const int64_t r = r0 + i * (kThreads / 16);
    g[i] = u[i] = make_uint4(0, 0, 0, 0);
    p[i] = 0.0f;
    if (r < mb) {
      const bf16_t* src = h + r * 2 * f + kb * kTile + lane * 8;
      g[i] = bias.biased_h ? *reinterpret_cast<const uint4*>(src) : ldg16(src);
      u[i] = bias.biased_h ? *reinterpret_cast<const uint4*>(src + f) : ldg16(src + f);
      if (prow) p[i] = __ldg(prow + r);
    }
  }
  if (bias.bias) {  // GEMM1's bias on the way in (GateUpBias)
#pragma unroll
    for (int i = 0; i < kRowsPerHalfWarp; ++i) {
      const int64_t r = r0 + i * (kThreads / 16);
      const int e = r < mb ? bias_detail::segment_of(bias.offsets, bias.num_segments, r) : -1;
      if (e < 0) continue;
      const int64_t col = kb * kTile + lane * 8;
      g[i] = bias_detail::add_bias8(g[i], bias.bias + e * 2 * f + col);
      u[i] = bias_detail::add_bias8(u[i], bias.bias + e * 2 * f + f + col);
      if (bias.biased_h) {
        bf16_t* dst = bias.biased_h + r * 2 * f + col;
        *reinterpret_cast<uint4*>(dst) = g[i];
        *reinterpret_cast<uint4*>(dst + f) = u[i];
      }
    }
  }
#pragma unroll
  for (int i = 0; i < kRowsPerHalfWarp; ++i) {
    const int64_t r = r0 + i * (kThreads / 16);
    float a32[8];
    swiglu8(act, g[i], u[i], a32);
    if (prow) {
#pragma unroll
      for (int q = 0; q < 8; ++q) a32[q] = f_mul(a32[q], p[i]);
    }
    if constexpr (kOut == FwdOut::kBf16) {
      const uint4 av = pack8(a32);
      const uint32_t mx = detail::absmax8_bits(av);
      if (nonfinite) detail::count_nonfinite_warp(nonfinite, av, mx >= detail::kBf16NonFiniteBits);
      if (r < mb) *reinterpret_cast<uint4*>(a + r * f + kb * kTile + lane * 8) = canonical_nan8(av, mx);
    } else {
      const TileCodes q = quantize_tile8(a32, nonfinite);
      if (r < mb) {
        *reinterpret_cast<uint2*>(a_codes + r * f + kb * kTile + lane * 8) = q.codes;
        if (lane == 0) a_scales[kb * m + r] = q.scale;
      }
      if constexpr (kOut == FwdOut::kFp8SaveH4) {  // H as MXFP4: codes [M, 2F/2], scales [M][2F/32]
        const Fp4Codes qg = quantize_fp4x8(saved_h8(act, g[i], false), nonfinite);
        const Fp4Codes qu = quantize_fp4x8(saved_h8(act, u[i], true), nonfinite);
        if (r < mb) {
          const int64_t col = kb * kTile + lane * 8;
          uint8_t* dst = h_codes + (r * 2 * f + col) / 2;
          *reinterpret_cast<uint32_t*>(dst) = qg.codes;
          *reinterpret_cast<uint32_t*>(dst + f / 2) = qu.codes;
          if ((lane & 3) == 0) {
            h_scales[r * (2 * f / 32) + col / 32] = qg.scale;
            h_scales[r * (2 * f / 32) + (f + col) / 32] = qu.scale;
          }
        }
      }
      if constexpr (kOut == FwdOut::kFp8SaveH) {
        const TileCodes qg = quantize_tile8(saved_h8(act, g[i], false), nonfinite);
        const TileCodes qu = quantize_tile8(saved_h8(act, u[i], true), nonfinite);
        if (r < mb) {
          uint8_t* dst = h_codes + r * 2 * f + kb * kTile + lane * 8;
          *reinterpret_cast<uint2*>(dst) = qg.codes;
          *reinterpret_cast<uint2*>(dst + f) = qu.codes;
          if (lane == 0) {
            h_scales[kb * m + r] = qg.scale;
            h_scales[(f / kTile + kb) * m + r] = qu.scale;
          }
        }
      }
    }
  }
}

// ---- forward with the column-wise copy (fused scaling-aware transpose) ------------------------------
// Re-encodes the 4 codes of a word of a finite tile with shift d > 0 (RNE into subnormals where
// the value leaves the normal range; counted in `lost`). Fast path: every byte keeps an exponent
// field >= 1, so only the exponent field drops by d (finite quantized codes are never NaN).
__device__ __forceinline__ uint32_t shift_codes4(uint32_t w, int d, int& lost) {
  if (d < 15) {
    const uint32_t ef = (w >> 3) & 0x0F0F0F0Fu;  // exponent fields
    const uint32_t keep = ((ef | 0x10101010u) - 0x01010101u * static_cast<uint32_t>(d + 1)) & 0x10101010u;
    if (keep == 0x10101010u) return w - 0x01010101u * (static_cast<uint32_t>(d) << 3);
  }
  uint32_t out = 0;
#pragma unroll
  for (int i = 0; i < 4; ++i) {
    bool l = false;
    out |= static_cast<uint32_t>(e4m3_rescale_fast(static_cast<uint8_t>(w >> (8 * i)), d, &l)) << (8 * i);
    lost += l;
  }
  return out;
}


template <bool kSaveH>
__global__ void __launch_bounds__(kThreads)
swiglu_quant_col_kernel(const bf16_t* __restrict__ h, const float* __restrict__ prow, int64_t m, int64_t f,
                        const int32_t* __restrict__ bstart, const int32_t* __restrict__ bend,
                        uint8_t* __restrict__ a_codes, uint8_t* __restrict__ a_scales,
                        uint8_t* __restrict__ a_col_codes, uint8_t* __restrict__ a_col_scales,
                        uint8_t* __restrict__ h_codes, uint8_t* __restrict__ h_scales,
                        DeviceStatus* status, GatedActivation act) {
  __shared__ __align__(16) uint8_t s_q[kTile * kBytePitch];
  __shared__ uint8_t s_e[kTile];
  __shared__ unsigned s_wmax[kTile / 32], s_wbad[kTile / 32];
  int64_t b, kt;
  detail::tile_coords(b, kt);
  const int bs = bstart[b];
  if (bs < 0) return;
  const int n = bend[b] - bs;
  const int tid = threadIdx.x, lane = tid & 15;
  unsigned long long* nonfinite = status ? &status->nonfinite : nullptr;

  // Row pass: A row tiles quantized, codes to global and to the byte tile.
#pragma unroll
  for (int p0 = 0; p0 < kPasses; p0 += kPassGroup) {
    uint4 g[kPassGroup], u[kPassGroup];
#pragma unroll
    for (int i = 0; i < kPassGroup; ++i) {
      const int row = (p0 + i) * (kThreads / 16) + (tid >> 4);
      g[i] = u[i] = make_uint4(0, 0, 0, 0);
      if (row < n) {
        const bf16_t* src = h + static_cast<int64_t>(bs + row) * 2 * f + kt * kTile + lane * 8;
        g[i] = ldg16(src);
        u[i] = ldg16(src + f);
      }
    }
#pragma unroll
    for (int i = 0; i < kPassGroup; ++i) {
      const int row = (p0 + i) * (kThreads / 16) + (tid >> 4);
      const int64_t r = static_cast<int64_t>(bs) + row;
      float a32[8];
      swiglu8(act, g[i], u[i], a32);
      if (prow) {
        const float p = row < n ? __ldg(prow + r) : 0.0f;
#pragma unroll
        for (int q = 0; q < 8; ++q) a32[q] = f_mul(a32[q], p);
      }
      const TileCodes q = quantize_tile8(a32, nonfinite);
      *reinterpret_cast<uint2*>(&s_q[row * kBytePitch + lane * 8]) = row < n ? q.codes : make_uint2(0, 0);
      if (lane == 0) s_e[row] = row < n ? q.scale : 0;
      if (row < n) {
        *reinterpret_cast<uint2*>(a_codes + r * f + kt * kTile + lane * 8) = q.codes;
        if (lane == 0) a_scales[kt * m + r] = q.scale;
      }
      if constexpr (kSaveH) {
        const TileCodes qg = quantize_tile8(saved_h8(act, g[i], false), nonfinite);
        const TileCodes qu = quantize_tile8(saved_h8(act, u[i], true), nonfinite);
        if (row < n) {
          uint8_t* dst = h_codes + r * 2 * f + kt * kTile + lane * 8;
          *reinterpret_cast<uint2*>(dst) = qg.codes;
          *reinterpret_cast<uint2*>(dst + f) = qu.codes;
          if (lane == 0) {
            h_scales[kt * m + r] = qg.scale;
            h_scales[(f / kTile + kt) * m + r] = qu.scale;
          }
        }
      }
    }
  }
  __syncthreads();

  // Shared exponent of the block: the largest row scale; a NaN row tile makes the block NaN.
  if (tid < kTile) {
    const unsigned e = s_e[tid];  // rows past n hold 0, which never wins the maximum
    const unsigned wmax = __reduce_max_sync(0xffffffffu, e == kUE8M0NaN ? 0u : e);
    const unsigned wbad = __reduce_add_sync(0xffffffffu, e == kUE8M0NaN ? 1u : 0u);
    if ((tid & 31) == 0) {
      s_wmax[tid >> 5] = wmax;
      s_wbad[tid >> 5] = wbad;
    }
  }
  __syncthreads();
  unsigned emax = 0, nbad = 0;
#pragma unroll
  for (int w = 0; w < kTile / 32; ++w) {
    emax = max(emax, s_wmax[w]);
    nbad += s_wbad[w];
  }

  // Shift every row's codes down to the shared exponent, in place.
  int lost = 0;
  for (int c = tid; c < kTile * (kTile / 16); c += kThreads) {
    const int row = c / (kTile / 16), ch = c % (kTile / 16);
    if (row >= n) continue;
    uint4* p = reinterpret_cast<uint4*>(&s_q[row * kBytePitch + ch * 16]);
    if (nbad) {
      *p = make_uint4(0x7F7F7F7Fu, 0x7F7F7F7Fu, 0x7F7F7F7Fu, 0x7F7F7F7Fu);
      continue;
    }
    const int d = static_cast<int>(emax) - s_e[row];
    if (d == 0) continue;
    uint4 w = *p;
    w.x = shift_codes4(w.x, d, lost);
    w.y = shift_codes4(w.y, d, lost);
    w.z = shift_codes4(w.z, d, lost);
    w.w = shift_codes4(w.w, d, lost);
    *p = w;
  }
  detail::warp_count(status ? &status->underflow : nullptr, lost);
  if (tid < kTile) a_col_scales[b * f + kt * kTile + tid] = nbad ? kUE8M0NaN : static_cast<uint8_t>(emax);
  __syncthreads();
  detail::store_col_tile(s_q, n, a_col_codes + (kt * kTile) * m + bs, m, (m % 16 == 0) && (bs % 16 == 0));
}

// GateUpBias: given whole (bias, offsets, at least one segment) or not at all; aligned; the
// biased values stored in place only.
void check_bias(const GateUpBias& b, const bf16_t* h, const char* what) {
  if (!b.bias) {
    FLOWMOE_CHECK(!b.biased_h, what << ": GateUpBias::biased_h without a bias; expected none or both");
    return;
  }
  FLOWMOE_CHECK(b.offsets && b.num_segments >= 1, what << ": GateUpBias with " << b.num_segments
                                                       << " segments and offsets " << (b.offsets ? "given" : "null")
                                                       << "; expected the offsets of at least one segment");
  check_aligned(b.bias, "bias", what);
  FLOWMOE_CHECK(!b.biased_h || b.biased_h == h,
                what << ": GateUpBias::biased_h is not h; expected h itself (the biased h stored in place) or null");
}

}  // namespace

// ================================================================================================
// launchers
// ================================================================================================
void swiglu(const bf16_t* h, int64_t m, int64_t f, bf16_t* a, DeviceStatus* status,
            cudaStream_t stream, const float* prow, const int32_t* rows_bound,
            const GatedActivation& act, const GateUpBias& bias) {
  const char* what = "cuda::swiglu";
  check_f(f, what);
  check_act(act, what);
  check_m(m, what);
  check_bias(bias, h, what);
  if (m == 0) return;
  check_aligned(h, "h", what);
  check_aligned(a, "a", what);
  swiglu_row_kernel<FwdOut::kBf16><<<row_grid(m, f), kThreads, 0, stream>>>(
      h, prow, m, f, a, nullptr, nullptr, nullptr, nullptr, nonfinite_ptr(status), rows_bound, act, bias);
  FLOWMOE_LAUNCH_CHECK(what);
}

void swiglu_quant(const bf16_t* h, int64_t m, int64_t f, uint8_t* a_codes, uint8_t* a_scales,
                  uint8_t* h_codes, uint8_t* h_scales, DeviceStatus* status, cudaStream_t stream,
                  const float* prow, const int32_t* rows_bound, const GatedActivation& act,
                  const GateUpBias& bias) {
  const char* what = "cuda::swiglu_quant";
  check_f(f, what);
  check_act(act, what);
  check_m(m, what);
  check_bias(bias, h, what);
  FLOWMOE_CHECK((h_codes == nullptr) == (h_scales == nullptr),
                what << ": give both h_codes and h_scales (H saved as FP8), or neither");
  if (m == 0) return;
  check_aligned(h, "h", what);
  check_pair(a_codes, a_scales, "a_codes", "a_scales", what);
  if (h_codes) {
    check_aligned(h_codes, "h_codes", what);
    swiglu_row_kernel<FwdOut::kFp8SaveH><<<row_grid(m, f), kThreads, 0, stream>>>(
        h, prow, m, f, nullptr, a_codes, a_scales, h_codes, h_scales, nonfinite_ptr(status), rows_bound,
        act, bias);
  } else {
    swiglu_row_kernel<FwdOut::kFp8><<<row_grid(m, f), kThreads, 0, stream>>>(
        h, prow, m, f, nullptr, a_codes, a_scales, nullptr, nullptr, nonfinite_ptr(status), rows_bound,
        act, bias);
  }
  FLOWMOE_LAUNCH_CHECK(what);
}

void swiglu_quant_col(const bf16_t* h, int64_t f, const SegmentBlocks& sb, uint8_t* a_codes,
                      uint8_t* a_scales, uint8_t* a_col_codes, uint8_t* a_col_scales,
                      uint8_t* h_codes, uint8_t* h_scales, DeviceStatus* status,
                      cudaStream_t stream, const float* prow, const GatedActivation& act) {
  const char* what = "cuda::swiglu_quant_col";
  check_f(f, what);
  check_act(act, what);
  check_blocks(sb, what);
  FLOWMOE_CHECK((h_codes == nullptr) == (h_scales == nullptr),
                what << ": give both h_codes and h_scales (H saved as FP8), or neither");
  if (sb.m == 0) return;
  check_aligned(h, "h", what);
  check_pair(a_codes, a_scales, "a_codes", "a_scales", what);
  check_pair(a_col_codes, a_col_scales, "a_col_codes", "a_col_scales", what);
  if (h_codes) check_aligned(h_codes, "h_codes", what);
  const dim3 grid = tile_grid(sb.max_blocks, f / kTile);
  if (h_codes) {
    swiglu_quant_col_kernel<true><<<grid, kThreads, 0, stream>>>(
        h, prow, sb.m, f, sb.block_start, sb.block_end, a_codes, a_scales, a_col_codes,
        a_col_scales, h_codes, h_scales, status, act);
  } else {
    swiglu_quant_col_kernel<false><<<grid, kThreads, 0, stream>>>(
        h, prow, sb.m, f, sb.block_start, sb.block_end, a_codes, a_scales, a_col_codes,
        a_col_scales, nullptr, nullptr, status, act);
  }
  FLOWMOE_LAUNCH_CHECK(what);
}

void swiglu_quant_h4(const bf16_t* h, int64_t m, int64_t f, uint8_t* a_codes, uint8_t* a_scales,
                     uint8_t* h4_codes, uint8_t* h4_scales, DeviceStatus* status,
                     cudaStream_t stream, const float* prow, const int32_t* rows_bound,
                     const GatedActivation& act, const GateUpBias& bias) {
  const char* what = "cuda::swiglu_quant_h4";
  check_f(f, what);
  check_act(act, what);
  check_m(m, what);
  check_bias(bias, h, what);
  if (m == 0) return;
  check_aligned(h, "h", what);
  check_pair(a_codes, a_scales, "a_codes", "a_scales", what);
  check_pair(h4_codes, h4_scales, "h4_codes", "h4_scales", what);
  swiglu_row_kernel<FwdOut::kFp8SaveH4><<<row_grid(m, f), kThreads, 0, stream>>>(
      h, prow, m, f, nullptr, a_codes, a_scales, h4_codes, h4_scales, nonfinite_ptr(status), rows_bound,
      act, bias);
  FLOWMOE_LAUNCH_CHECK(what);
}

}  // namespace cuda
}  // namespace flowmoe
