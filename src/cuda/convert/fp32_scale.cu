// The FP32-scale mode of the convert module (fp8-naive, SPEC §6; flowmoe/cuda/convert.h): E4M3
// codes with FP32 scales s = amax / 448, row-wise, column-wise from a transposed copy, and 128x128
// weight blocks with their exact transpose. Bit-identical to the CPU casts of the same mode.
#include <cuda_bf16.h>

#include <cstdint>

#include "cuda/common.cuh"
#include "flowmoe/cuda/convert.h"
#include "flowmoe/error.h"
#include "flowmoe/numerics.h"
#include "flowmoe/swiglu_math.h"  // f32_is_nan, bf16_canonical

namespace flowmoe {
namespace cuda {
namespace {

using namespace flowmoe::num;

constexpr int kThreads = 256;
constexpr int kWarps = kThreads / 32;

using ::flowmoe::cuda::detail::grid_1d;
using ::flowmoe::cuda::detail::check_ptr;
unsigned long long* nf(DeviceStatus* st) { return st ? &st->nonfinite : nullptr; }

__device__ __forceinline__ uint32_t max_u32_warp(uint32_t v) {
#pragma unroll
  for (int o = 16; o > 0; o >>= 1) v = max(v, __shfl_xor_sync(0xffffffffu, v, o));
  return v;
}
__device__ __forceinline__ int sum_i_warp(int v) {
#pragma unroll
  for (int o = 16; o > 0; o >>= 1) v += __shfl_xor_sync(0xffffffffu, v, o);
  return v;
}
__device__ __forceinline__ void add_count(unsigned long long* c, int lane, int n) {
  if (c && lane == 0 && n) atomicAdd(c, static_cast<unsigned long long>(n));
}

__device__ __forceinline__ void load_bf16x4(const bf16_t* p, float v[4]) {
  const uint2 w = *reinterpret_cast<const uint2*>(p);
  v[0] = __uint_as_float(w.x << 16);
  v[1] = __uint_as_float(w.x & 0xFFFF0000u);
  v[2] = __uint_as_float(w.y << 16);
  v[3] = __uint_as_float(w.y & 0xFFFF0000u);
}

// ---- the scale rule and one tile ------------------------------------------------------------------
__host__ __device__ __forceinline__ float fp32_scale_rule(float amax) {
#if defined(__CUDA_ARCH__)
  return amax > 0.0f ? __fdiv_rn(amax, kE4M3Max) : 1.0f;
#else
  return amax > 0.0f ? amax / kE4M3Max : 1.0f;
#endif
}
// 4 values per lane, one warp per tile of up to 128 values (`valid` lanes' values are real; the
// others must be passed as 0 and are not written). Returns the scale (NaN for a non-finite tile)
// and writes the codes into c4; bad = the tile's non-finite count.
__device__ __forceinline__ float fp32_scale_tile4(const float v[4], uint32_t* c4, int* bad_out) {
  uint32_t amax = 0;
  int bad = 0;
#pragma unroll
  for (int i = 0; i < 4; ++i) {
    if (f32_is_finite(v[i])) amax = max(amax, f32_bits(v[i]) & 0x7FFFFFFFu);
    else ++bad;
  }
  amax = max_u32_warp(amax);
  bad = sum_i_warp(bad);
  *bad_out = bad;
  if (bad) {
    *c4 = 0x7F7F7F7Fu;
    return f32_from_bits(kCanonicalNaN);
  }
  const float s = fp32_scale_rule(f32_from_bits(amax));
  uint32_t packed = 0;
#pragma unroll
  for (int i = 0; i < 4; ++i) packed |= uint32_t(f32_to_e4m3(__fdiv_rn(v[i], s))) << (8 * i);
  *c4 = packed;
  return s;
}
__device__ __forceinline__ float fp32_scale_dequant(uint8_t c, float s) {
  if (e4m3_is_nan(c) || f32_is_nan(s)) return f32_from_bits(kCanonicalNaN);
  return __fmul_rn(e4m3_to_f32(c), s);
}

// Index of the FP32 scale of (row r, tile l) in the GEMM-ready layout: expert-packed when the
// offsets are given (s_off [E+1] in shared memory), else [L][M].
__device__ __forceinline__ int64_t act_scale_index(const int32_t* s_off, int E, int64_t m, int64_t L,
                                                   int64_t r, int64_t l) {
  if (!s_off) return l * m + r;
  const int lo = detail::last_at_or_below(s_off, E, r);  // the expert of row r
  const int64_t o = s_off[lo], len = s_off[lo + 1] - o;
  return L * o + l * len + (r - o);
}

__global__ void __launch_bounds__(kThreads)
quantize_row_fp32_scale_kernel(const bf16_t* __restrict__ x, int64_t m, int64_t c, const int32_t* __restrict__ offsets,
                          int E, uint8_t* __restrict__ codes, float* __restrict__ scales,
                          unsigned long long* nonfinite) {
  extern __shared__ int32_t s_off[];
  if (offsets)
    for (int i = threadIdx.x; i <= E; i += kThreads) s_off[i] = offsets[i];
  __syncthreads();
  const int lane = threadIdx.x & 31;
  // with offsets, rows past offsets[E] belong to no expert (a capacity the step does not fill)
  const int64_t rows = offsets ? min(m, static_cast<int64_t>(s_off[E])) : m;
  const int64_t L = c / 128, total = rows * L;
  for (int64_t w = blockIdx.x * int64_t(kWarps) + (threadIdx.x >> 5); w < total; w += int64_t(gridDim.x) * kWarps) {
    const int64_t r = w / L, l = w % L;
    const int64_t col = l * 128 + lane * 4;
    float v[4];
    load_bf16x4(x + r * c + col, v);
    uint32_t c4;
    int bad;
    const float s = fp32_scale_tile4(v, &c4, &bad);
    *reinterpret_cast<uint32_t*>(codes + r * c + col) = c4;
    if (lane == 0) scales[act_scale_index(offsets ? s_off : nullptr, E, m, L, r, l)] = s;
    add_count(nonfinite, lane, bad);
  }
}

__global__ void __launch_bounds__(kThreads)
dequantize_row_fp32_scale_kernel(const uint8_t* __restrict__ codes, const float* __restrict__ scales, int64_t m,
                            int64_t c, const int32_t* __restrict__ offsets, int E, bf16_t* __restrict__ y) {
  extern __shared__ int32_t s_off[];
  if (offsets)
    for (int i = threadIdx.x; i <= E; i += kThreads) s_off[i] = offsets[i];
  __syncthreads();
  const int lane = threadIdx.x & 31;
  // with offsets, rows past offsets[E] belong to no expert (a capacity the step does not fill)
  const int64_t rows = offsets ? min(m, static_cast<int64_t>(s_off[E])) : m;
  const int64_t L = c / 128, total = rows * L;
  for (int64_t w = blockIdx.x * int64_t(kWarps) + (threadIdx.x >> 5); w < total; w += int64_t(gridDim.x) * kWarps) {
    const int64_t r = w / L, l = w % L;
    const int64_t col = l * 128 + lane * 4;
    const float s = scales[act_scale_index(offsets ? s_off : nullptr, E, m, L, r, l)];
    const uint32_t c4 = *reinterpret_cast<const uint32_t*>(codes + r * c + col);
    uint16_t o[4];
#pragma unroll
    for (int i = 0; i < 4; ++i) o[i] = bf16_canonical(fp32_scale_dequant(static_cast<uint8_t>(c4 >> (8 * i)), s));
    *reinterpret_cast<uint2*>(y + r * c + col) =
        make_uint2(uint32_t(o[0]) | (uint32_t(o[1]) << 16), uint32_t(o[2]) | (uint32_t(o[3]) << 16));
  }
}

// Column-wise from the transposed BF16 [C, M]: one warp per (feature, token block).
__global__ void __launch_bounds__(kThreads)
quantize_transposed_fp32_scale_kernel(const bf16_t* __restrict__ xt, int64_t c, int64_t m, int64_t max_blocks,
                                 const int32_t* __restrict__ bstart, const int32_t* __restrict__ bend,
                                 uint8_t* __restrict__ codes, float* __restrict__ scales,
                                 unsigned long long* nonfinite) {
  const int lane = threadIdx.x & 31;
  const int64_t total = max_blocks * c;
  for (int64_t w = blockIdx.x * int64_t(kWarps) + (threadIdx.x >> 5); w < total; w += int64_t(gridDim.x) * kWarps) {
    const int64_t b = w / c, feat = w % c;
    const int bs = bstart[b];
    if (bs < 0) continue;  // uniform in the warp
    const int n = bend[b] - bs;
    float v[4];
#pragma unroll
    for (int i = 0; i < 4; ++i) {
      const int t = lane * 4 + i;
      v[i] = t < n ? bf16_to_f32(xt[feat * m + bs + t]) : 0.0f;
    }
    uint32_t c4;
    int bad;
    const float s = fp32_scale_tile4(v, &c4, &bad);
#pragma unroll
    for (int i = 0; i < 4; ++i) {
      const int t = lane * 4 + i;
      if (t < n) codes[feat * m + bs + t] = static_cast<uint8_t>(c4 >> (8 * i));
    }
    if (lane == 0) scales[b * c + feat] = s;
    add_count(nonfinite, lane, bad);
  }
}

// Weights: one CTA per (expert, 128x128 block); thread i handles column i % 128 of rows
// i / 128, i / 128 + 2, ...
__global__ void __launch_bounds__(kThreads)
quantize_weights_fp32_scale_kernel(const bf16_t* __restrict__ w, int64_t n, int64_t k, uint8_t* __restrict__ codes,
                              float* __restrict__ scales, uint8_t* __restrict__ t_codes,
                              float* __restrict__ t_scales, unsigned long long* nonfinite) {
  __shared__ uint32_t s_max[kWarps];
  __shared__ int s_bad[kWarps];
  const int64_t nb = n / 128, kb = k / 128;
  const int64_t e = blockIdx.z;
  const int64_t bi = blockIdx.y, bj = blockIdx.x;
  const bf16_t* we = w + e * n * k;
  const int cx = threadIdx.x & 127, ry = threadIdx.x >> 7;
  uint32_t amax = 0;
  int bad = 0;
  for (int rr = ry; rr < 128; rr += 2) {
    const float v = bf16_to_f32(we[(bi * 128 + rr) * k + bj * 128 + cx]);
    if (f32_is_finite(v)) amax = max(amax, f32_bits(v) & 0x7FFFFFFFu);
    else ++bad;
  }
  amax = max_u32_warp(amax);
  bad = sum_i_warp(bad);
  if ((threadIdx.x & 31) == 0) {
    s_max[threadIdx.x >> 5] = amax;
    s_bad[threadIdx.x >> 5] = bad;
  }
  __syncthreads();
  amax = 0;
  bad = 0;
  for (int i = 0; i < kWarps; ++i) {
    amax = max(amax, s_max[i]);
    bad += s_bad[i];
  }
  const float s = bad ? f32_from_bits(kCanonicalNaN) : fp32_scale_rule(f32_from_bits(amax));
  for (int rr = ry; rr < 128; rr += 2) {
    const int64_t row = bi * 128 + rr, col = bj * 128 + cx;
    const float v = bf16_to_f32(we[row * k + col]);
    const uint8_t q = bad ? kE4M3NaN : f32_to_e4m3(__fdiv_rn(v, s));
    codes[e * n * k + row * k + col] = q;
    if (t_codes) t_codes[e * n * k + col * n + row] = q;
  }
  if (threadIdx.x == 0) {
    const int64_t ldk = (kb + 3) / 4 * 4, ldn = (nb + 3) / 4 * 4;
    scales[e * nb * ldk + bi * ldk + bj] = s;
    if (t_scales) t_scales[e * kb * ldn + bj * ldn + bi] = s;
    if (nonfinite && bad) atomicAdd(nonfinite, static_cast<unsigned long long>(bad));
  }
}

}  // namespace

float fp32_scale(float amax) { return fp32_scale_rule(amax); }

// The shape checks of the row-wise (de)quantizers: [m, c] with c a positive multiple of 128,
// and 1..4096 experts when per-expert offsets are given.
static void check_fp32_scale_rows(const char* what, int64_t m, int64_t c, const int32_t* d_offsets, int num_experts) {
  FLOWMOE_CHECK(m >= 0 && c > 0 && c % 128 == 0,
                what << ": [" << m << ", " << c << "]; expected C a positive multiple of 128");
  FLOWMOE_CHECK(!d_offsets || (num_experts >= 1 && num_experts <= 4096),
                what << ": " << num_experts << " experts with offsets; expected 1..4096");
}

void quantize_row_fp32_scale(const bf16_t* x, int64_t m, int64_t c, const int32_t* d_offsets,
                        int num_experts, uint8_t* codes, float* scales, DeviceStatus* status,
                        cudaStream_t stream) {
  const char* what = "cuda::quantize_row_fp32_scale";
  check_fp32_scale_rows(what, m, c, d_offsets, num_experts);
  if (m == 0) return;
  check_ptr(x, "x", what);
  check_ptr(codes, "codes", what);
  check_ptr(scales, "scales", what);
  const size_t smem = d_offsets ? (num_experts + 1) * sizeof(int32_t) : 0;
  quantize_row_fp32_scale_kernel<<<grid_1d(m * (c / 128), kWarps), kThreads, smem, stream>>>(
      x, m, c, d_offsets, num_experts, codes, scales, nf(status));
  FLOWMOE_LAUNCH_CHECK("cuda::quantize_row_fp32_scale_kernel");
}

void dequantize_row_fp32_scale(const uint8_t* codes, const float* scales, int64_t m, int64_t c,
                          const int32_t* d_offsets, int num_experts, bf16_t* y,
                          cudaStream_t stream) {
  const char* what = "cuda::dequantize_row_fp32_scale";
  check_fp32_scale_rows(what, m, c, d_offsets, num_experts);
  if (m == 0) return;
  check_ptr(codes, "codes", what);
  check_ptr(scales, "scales", what);
  check_ptr(y, "y", what);
  const size_t smem = d_offsets ? (num_experts + 1) * sizeof(int32_t) : 0;
  dequantize_row_fp32_scale_kernel<<<grid_1d(m * (c / 128), kWarps), kThreads, smem, stream>>>(
      codes, scales, m, c, d_offsets, num_experts, y);
  FLOWMOE_LAUNCH_CHECK("cuda::dequantize_row_fp32_scale_kernel");
}

void quantize_transposed_fp32_scale(const bf16_t* xt, int64_t c, const SegmentBlocks& sb,
                               uint8_t* codes, float* scales, DeviceStatus* status,
                               cudaStream_t stream) {
  const char* what = "cuda::quantize_transposed_fp32_scale";
  FLOWMOE_CHECK(c > 0 && c % 128 == 0, what << ": C = " << c << "; expected a positive multiple of 128");
  FLOWMOE_CHECK(sb.m >= 0 && sb.max_blocks >= segment_max_blocks(sb.m, sb.num_segments),
                what << ": segment blocks sized " << sb.max_blocks << " for M = " << sb.m);
  if (sb.m == 0) return;
  check_ptr(xt, "xt", what);
  check_ptr(codes, "codes", what);
  check_ptr(scales, "scales", what);
  check_ptr(sb.block_start, "block_start", what);
  check_ptr(sb.block_end, "block_end", what);
  quantize_transposed_fp32_scale_kernel<<<grid_1d(sb.max_blocks * c, kWarps), kThreads, 0, stream>>>(
      xt, c, sb.m, sb.max_blocks, sb.block_start, sb.block_end, codes, scales, nf(status));
  FLOWMOE_LAUNCH_CHECK("cuda::quantize_transposed_fp32_scale_kernel");
}

void quantize_weights_fp32_scale(const bf16_t* w, int num_experts, int64_t n, int64_t k,
                            uint8_t* codes, float* scales, uint8_t* t_codes, float* t_scales,
                            DeviceStatus* status, cudaStream_t stream) {
  const char* what = "cuda::quantize_weights_fp32_scale";
  FLOWMOE_CHECK(num_experts >= 1 && num_experts <= 65535 && n > 0 && k > 0 && n % 128 == 0 &&
                    k % 128 == 0,
                what << ": E=" << num_experts << " [" << n << ", " << k
                     << "]; expected N, K positive multiples of 128");
  check_ptr(w, "w", what);
  check_ptr(codes, "codes", what);
  check_ptr(scales, "scales", what);
  FLOWMOE_CHECK((t_codes == nullptr) == (t_scales == nullptr),
                what << ": give both t_codes and t_scales, or neither");
  const int64_t nb = n / 128, kb = k / 128;
  const int64_t ldk = (kb + 3) / 4 * 4, ldn = (nb + 3) / 4 * 4;
  FLOWMOE_CUDA_CHECK(cudaMemsetAsync(scales, 0, size_t(num_experts) * nb * ldk * sizeof(float), stream));
  if (t_scales)
    FLOWMOE_CUDA_CHECK(cudaMemsetAsync(t_scales, 0, size_t(num_experts) * kb * ldn * sizeof(float), stream));
  const dim3 grid(static_cast<unsigned>(kb), static_cast<unsigned>(nb), static_cast<unsigned>(num_experts));
  quantize_weights_fp32_scale_kernel<<<grid, kThreads, 0, stream>>>(w, n, k, codes, scales, t_codes, t_scales,
                                                               nf(status));
  FLOWMOE_LAUNCH_CHECK("cuda::quantize_weights_fp32_scale_kernel");
}


}  // namespace cuda
}  // namespace flowmoe
