// FP8 quantization of expert weights in 128 x 128 blocks (flowmoe/cuda/convert.h: quantize_weight(s),
// quantize_weights_stored): W and its exact transpose in one pass, from the layer's layout or from
// where a model stores the weights (gpt-oss's transposed, interleaved, unpadded experts).
#include <cuda_runtime.h>

#include <algorithm>
#include <type_traits>

#include "cuda/convert/quant8.cuh"
#include "cuda/convert/tile.cuh"
#include "flowmoe/cuda/convert.h"
#include "flowmoe/numerics.h"

namespace flowmoe {
namespace cuda {
namespace {

using namespace flowmoe::num;
using detail::amax8;
using detail::encode8;
using detail::kThreads;
using detail::kTile;
using namespace detail::host;

// 8 weights as 8 bf16 values packed in a uint4: bf16 loaded as they are; fp32 rounded to BF16 (RNE,
// num::f32_to_bf16), counting the FP32 values that are not finite in in_bad.
__device__ __forceinline__ uint4 load8_bf16(const bf16_t* p, int& /*in_bad*/) {
  return __ldg(reinterpret_cast<const uint4*>(p));
}
__device__ __forceinline__ uint4 load8_bf16(const float* p, int& in_bad) {
  const float4 a = __ldg(reinterpret_cast<const float4*>(p)), b = __ldg(reinterpret_cast<const float4*>(p) + 1);
  const float f[8] = {a.x, a.y, a.z, a.w, b.x, b.y, b.z, b.w};
  uint32_t w[4];
#pragma unroll
  for (int q = 0; q < 4; ++q) {
    in_bad += !num::f32_is_finite(f[2 * q]) + !num::f32_is_finite(f[2 * q + 1]);
    w[q] = num::f32_to_bf16(f[2 * q]) | (static_cast<uint32_t>(num::f32_to_bf16(f[2 * q + 1])) << 16);
  }
  return make_uint4(w[0], w[1], w[2], w[3]);
}

// One bf16 value as 16 bits: bf16 as it is; fp32 rounded (RNE), counting a non-finite value in in_bad.
__device__ __forceinline__ uint32_t bf16_bits(bf16_t v, int& /*in_bad*/) { return v; }
__device__ __forceinline__ uint32_t bf16_bits(float v, int& in_bad) {
  in_bad += !num::f32_is_finite(v);
  return num::f32_to_bf16(v);
}

// Where quantize_weight_kernel reads the matrix X [n][k] it quantizes, 8 values along k at a time
// (as 8 bf16 packed in a uint4). Dense: X itself, one expert after the other.
template <typename In>
struct DenseWeights {
  const In* w;
  int64_t k;
  __device__ void to_expert(int64_t ex, int64_t n) { w += ex * n * k; }
  __device__ uint4 load8(int64_t row, int64_t col, int& in_bad) const {
    return load8_bf16(w + row * k + col, in_bad);
  }
};

// X = W^T of a weight stored transposed (flowmoe/expert_layout.h): X[c][r] = src[c][map(r)], zeros
// for c >= C and unmapped r. 8 layer rows in one part of the map read one aligned run of the stored
// row (stride 2: every other value of 16, the other half being the partner gate/up block's, which
// a neighbouring CTA reads from L2); anything else, value by value.
template <typename In>
struct StoredWeights {
  const In* src;
  int64_t c, l;
  ExpertRowMap map;
  __device__ void to_expert(int64_t ex, int64_t /*n*/) { src += ex * c * l; }
  __device__ uint4 load8(int64_t row, int64_t col, int& in_bad) const {
    if (row >= c) return make_uint4(0u, 0u, 0u, 0u);
    const In* base = src + row * l;
    const bool first = col + 7 < map.valid;
    const bool second = !first && map.second >= 0 && col >= map.second && col + 7 < map.second + map.valid;
    if (std::is_same<In, bf16_t>::value && (first || second)) {
      const int64_t j0 = first ? map.base0 + map.stride * col : map.base1 + map.stride * (col - map.second);
      const int64_t j_first = map.stride == 2 ? (j0 & ~int64_t(1)) : j0;  // (16 values from here at stride 2)
      const In* p = base + j_first;
      if ((reinterpret_cast<uintptr_t>(p) & 15) == 0 && (map.stride == 1 || j_first + 15 < l)) {
        const uint4 a = __ldg(reinterpret_cast<const uint4*>(p));
        if (map.stride == 1) return a;
        const uint4 b = __ldg(reinterpret_cast<const uint4*>(p) + 1);
        const unsigned sel = (j0 & 1) ? 0x7632u : 0x5410u;  // the odd or the even halves
        return make_uint4(__byte_perm(a.x, a.y, sel), __byte_perm(a.z, a.w, sel), __byte_perm(b.x, b.y, sel),
                          __byte_perm(b.z, b.w, sel));
      }
    }
    if (std::is_same<In, float>::value && first && map.stride == 1) {
      const In* p = base + map.base0 + col;
      if ((reinterpret_cast<uintptr_t>(p) & 15) == 0) return load8_bf16(p, in_bad);
    }
    uint32_t h[8];
#pragma unroll
    for (int i = 0; i < 8; ++i) {
      const int64_t j = map.map(col + i);
      h[i] = j >= 0 ? bf16_bits(__ldg(base + j), in_bad) : 0u;
    }
    return make_uint4(h[0] | (h[1] << 16), h[2] | (h[3] << 16), h[4] | (h[5] << 16), h[6] | (h[7] << 16));
  }
};

// Expert ex of a batch: the source and each output advanced by one expert's extent (X [n][k] and
// its transpose, their [n/128][k/128] scales; a null output stays null).
template <typename Source, typename Ptr>  // (Ptr: the kernels' uint8_t* __restrict__)
__device__ __forceinline__ void to_expert(int64_t ex, int64_t n, int64_t k, Source& w, Ptr& codes, Ptr& scales,
                                          Ptr& t_codes, Ptr& t_scales) {
  const int64_t elems = n * k, blocks = (n / kTile) * (k / kTile);
  w.to_expert(ex, n);
  if (codes) {
    codes += ex * elems;
    scales += ex * blocks;
  }
  if (t_codes) {
    t_codes += ex * elems;
    t_scales += ex * blocks;
  }
}

// The order of an output's 128-row blocks within an expert: as they are (half 0), or W1's gate / up
// interleaving (flowmoe/gemm.h interleave_gate_up, what GroupedGemm::fprop_swiglu reads): of
// 2 * half blocks, block b < half (gate) goes to 2 b, block half + b (up) to 2 b + 1.
struct RowBlockOrder {
  int64_t codes_half = 0;  // X's copy (codes, scales): its row blocks bn
  int64_t t_half = 0;      // the transposed copy (t_codes, t_scales): its row blocks, X's column blocks
};
__device__ __forceinline__ int64_t out_block(int64_t b, int64_t half) {
  return half == 0 ? b : (b < half ? 2 * b : 2 * (b - half) + 1);
}

// Column block cb of X's row block bn from the 8 chunks each thread holds, once every warp's amax
// and bad count are in s_amax / s_bad: the block's scale from their maximum, its codes (where
// `codes`), its swizzled tile for the transposed copy (s_q) and its scale in both grids, each copy's
// row blocks in `order`.
__device__ __forceinline__ void encode_block(const uint4 (&v)[8], const float* s_amax, const int* s_bad, int64_t bn,
                                             int64_t cb, int64_t n, int64_t k, uint8_t* codes, uint8_t* scales,
                                             uint8_t* t_scales, uint8_t* s_q, const RowBlockOrder& order) {
  const int tid = threadIdx.x;
  float amax = 0.f;
  int bad = 0;
  for (int i = 0; i < kThreads / 32; ++i) {
    amax = fmaxf(amax, s_amax[i]);
    bad += s_bad[i];
  }
  const int e = e4m3_scale_exp(amax);
  const uint8_t sc = bad ? kUE8M0NaN : ue8m0_from_exp(e);
  const int64_t on = out_block(bn, order.codes_half), ot = out_block(cb, order.t_half);
#pragma unroll
  for (int i = 0; i < 8; ++i) {
    const int row = i * 16 + (tid >> 4), ch = tid & 15;
    const uint2 q = encode8(v[i], e, bad != 0);
    if (codes) reinterpret_cast<uint2*>(codes + (on * kTile + row) * k + cb * kTile)[ch] = q;
    *reinterpret_cast<uint2*>(&s_q[detail::swz_chunk(row, ch >> 1) + (ch & 1) * 8]) = q;
  }
  if (tid == 0) {
    if (scales) scales[on * (k / kTile) + cb] = sc;
    if (t_scales) t_scales[ot * (n / kTile) + bn] = sc;
  }
}

// ---- K11: weights, one 128x128 block per CTA, plus the exact transposed copy; blockIdx.z the expert.
// In = bf16_t, or float (the masters, rounded to BF16 on the way: the bits of the BF16 copy's
// quantization; `nonfinite` then counts the FP32 values, as f32_to_bf16 does). Source: where X is
// read (DenseWeights, StoredWeights).
template <typename In, typename Source>
__global__ void __launch_bounds__(kThreads)
quantize_weight_kernel(Source w, int64_t n, int64_t k, uint8_t* __restrict__ codes,
                       uint8_t* __restrict__ scales, uint8_t* __restrict__ t_codes,
                       uint8_t* __restrict__ t_scales, unsigned long long* nonfinite, RowBlockOrder order) {
  __shared__ __align__(16) uint8_t s_q[detail::kSwzBytes];  // the codes, swizzled (tile.cuh)
  __shared__ float s_amax[kThreads / 32];
  __shared__ int s_bad[kThreads / 32];
  const int64_t bn = blockIdx.y, bk = blockIdx.x;
  to_expert(blockIdx.z, n, k, w, codes, scales, t_codes, t_scales);
  const int tid = threadIdx.x;
  uint4 v[8];
  float amax = 0.f;
  int bad = 0, in_bad = 0;
#pragma unroll
  for (int i = 0; i < 8; ++i) {
    const int row = i * 16 + (tid >> 4), ch = tid & 15;
    v[i] = w.load8(bn * kTile + row, bk * kTile + ch * 8, in_bad);
    amax8(v[i], amax, bad);
  }
  amax = detail::warp_max(amax, 32);
  const int wbad = detail::warp_sum_i(bad);
  detail::warp_count(nonfinite, std::is_same<In, float>::value ? in_bad : bad);
  if ((tid & 31) == 0) {
    s_amax[tid >> 5] = amax;
    s_bad[tid >> 5] = wbad;
  }
  __syncthreads();
  encode_block(v, s_amax, s_bad, bn, bk, n, k, codes, scales, t_scales, s_q, order);
  if (!t_codes) return;
  __syncthreads();
  // (whole 128-byte rows of the transpose per 8 lanes: coalesced stores)
  detail::store_col_tile_swz(s_q, kTile, t_codes + (out_block(bk, order.t_half) * kTile) * n + bn * kTile, n,
                             n % 16 == 0);
}

// ---- K11 staged: BF16 weights read through cp.async stages ------------------------------------
// The same blocks, codes and transposed copies as quantize_weight_kernel, for BF16 sources whose
// 8-value groups are whole, aligned 16-byte runs (dense weights, gpt-oss's down_proj and
// interleaved gate_up_proj): each CTA walks blocks blockIdx.x, + gridDim.x, ..., and while it
// encodes one block the next one's runs are already on their way into shared memory (cp.async,
// zeros for the padding), so the loads of an SM never wait on its encoding and stores. Each
// thread reads back only the runs it copied itself (no barrier between copy and use).
//
// Value (row, col) of X [n][k] of expert ex is at src + ex * expert_stride + row * ld + j(col):
// j = base0 + col for col < cols, base1 + col - second for second <= col < second + cols (a
// second run, e.g. the up half stored after the gate half; second < 0: none), zeros for other
// columns and for row >= rows. kPairs (gpt-oss's interleaved gate_up_proj): X's column blocks bk
// (gate) and bk + k / 256 (up) come from one read of the stored pairs, gate column r at stored
// 2 r, up at 2 r + 1 (base0 = 0), so every stored byte is read once.
struct StagedSource {
  const bf16_t* src;
  int64_t expert_stride, ld;
  int64_t base0, base1, second;
  int64_t rows, cols;  // cols (and base0, base1, second, ld) multiples of 8
};

constexpr int kStages = 2;

// Starts the copies of block t (expert, row block bn, column block bk; kPairs: the gate block)
// into `stage` ([chunk][kThreads] uint4, this thread's chunk i at [i][tid]) and commits them.
template <bool kPairs>
__device__ __forceinline__ void stage_block(const StagedSource& s, int64_t t, int64_t tn, int64_t tk, uint4* stage) {
  const int tid = threadIdx.x;
  const int64_t ex = t / (tn * tk), rem = t % (tn * tk), bn = rem / tk, bk = rem % tk;
  const bf16_t* base = s.src + ex * s.expert_stride;
#pragma unroll
  for (int i = 0; i < 8; ++i) {
    const int row = i * 16 + (tid >> 4), ch = tid & 15;
    const int64_t c = bn * kTile + row, r = bk * kTile + ch * 8;
    if constexpr (kPairs) {
      const bool ok = c < s.rows && r < s.cols;
      const bf16_t* p = ok ? base + c * s.ld + 2 * r : s.src;
      detail::cp_async16_zfill(stage + (2 * i) * kThreads + tid, p, ok);
      detail::cp_async16_zfill(stage + (2 * i + 1) * kThreads + tid, ok ? p + 8 : s.src, ok);
    } else {
      int64_t j = -1;
      if (c < s.rows) {
        if (r < s.cols)
          j = s.base0 + r;
        else if (s.second >= 0 && r >= s.second && r < s.second + s.cols)
          j = s.base1 + (r - s.second);
      }
      detail::cp_async16_zfill(stage + i * kThreads + tid, j >= 0 ? base + c * s.ld + j : s.src, j >= 0);
    }
  }
  detail::cp_async_commit();
}

template <bool kPairs>
__global__ void __launch_bounds__(kThreads, kPairs ? 1 : 2)
quantize_weight_staged_kernel(StagedSource s, int num_experts, int64_t n, int64_t k, uint8_t* __restrict__ codes,
                              uint8_t* __restrict__ scales, uint8_t* __restrict__ t_codes,
                              uint8_t* __restrict__ t_scales, unsigned long long* nonfinite, RowBlockOrder order) {
  constexpr int kHalves = kPairs ? 2 : 1, kChunks = 8 * kHalves;
  extern __shared__ uint4 s_stage[];  // [kStages][kChunks][kThreads]
  __shared__ __align__(16) uint8_t s_q[kHalves][detail::kSwzBytes];
  __shared__ float s_amax[kHalves][kThreads / 32];
  __shared__ int s_bad[kHalves][kThreads / 32];
  const int tid = threadIdx.x;
  const int64_t tn = n / kTile, tk = k / kTile / kHalves, total = int64_t(num_experts) * tn * tk;
  const int64_t elems = n * k, blocks = tn * (k / kTile);
  int64_t t = blockIdx.x;
  if (t < total) stage_block<kPairs>(s, t, tn, tk, s_stage);
  for (int buf = 0; t < total; t += gridDim.x, buf ^= 1) {
    const int64_t next = t + gridDim.x;
    if (next < total)
      stage_block<kPairs>(s, next, tn, tk, s_stage + (buf ^ 1) * kChunks * kThreads);
    else
      detail::cp_async_commit();  // (an empty group: the wait counts groups)
    detail::cp_async_wait<1>();   // block t's copies done
    const uint4* st = s_stage + buf * kChunks * kThreads;
    const int64_t ex = t / (tn * tk), rem = t % (tn * tk), bn = rem / tk, bk = rem % tk;
    uint4 v[kHalves][8];
    float amax[kHalves];
    int bad[kHalves];
#pragma unroll
    for (int h = 0; h < kHalves; ++h) amax[h] = 0.f, bad[h] = 0;
#pragma unroll
    for (int i = 0; i < 8; ++i) {
      if constexpr (kPairs) {
        const uint4 a = st[(2 * i) * kThreads + tid], b = st[(2 * i + 1) * kThreads + tid];
#pragma unroll
        for (int h = 0; h < 2; ++h) {
          const unsigned sel = h ? 0x7632u : 0x5410u;  // gate: the even values, up: the odd ones
          v[h][i] = make_uint4(__byte_perm(a.x, a.y, sel), __byte_perm(a.z, a.w, sel), __byte_perm(b.x, b.y, sel),
                               __byte_perm(b.z, b.w, sel));
        }
      } else {
        v[0][i] = st[i * kThreads + tid];
      }
#pragma unroll
      for (int h = 0; h < kHalves; ++h) amax8(v[h][i], amax[h], bad[h]);
    }
    int bad_all = 0;
#pragma unroll
    for (int h = 0; h < kHalves; ++h) {
      bad_all += bad[h];
      const float m = detail::warp_max(amax[h], 32);
      const int wb = detail::warp_sum_i(bad[h]);
      if ((tid & 31) == 0) {
        s_amax[h][tid >> 5] = m;
        s_bad[h][tid >> 5] = wb;
      }
    }
    detail::warp_count(nonfinite, bad_all);
    __syncthreads();
    uint8_t* const cd = codes ? codes + ex * elems : nullptr;
    uint8_t* const sc = scales ? scales + ex * blocks : nullptr;
    uint8_t* const tc = t_codes ? t_codes + ex * elems : nullptr;
    uint8_t* const ts = t_scales ? t_scales + ex * blocks : nullptr;
#pragma unroll
    for (int h = 0; h < kHalves; ++h)
      encode_block(v[h], s_amax[h], s_bad[h], bn, bk + h * tk, n, k, cd, sc, ts, s_q[h], order);
    if (tc) {
      __syncthreads();
#pragma unroll
      for (int h = 0; h < kHalves; ++h)
        detail::store_col_tile_swz(s_q[h], kTile, tc + (out_block(bk + h * tk, order.t_half) * kTile) * n + bn * kTile,
                                   n, n % 16 == 0);
    }
    __syncthreads();  // (s_amax, s_bad and s_q are the next block's)
  }
}

template <bool kPairs>
void launch_staged(const StagedSource& s, int num_experts, int64_t n, int64_t k, uint8_t* codes, uint8_t* scales,
                   uint8_t* t_codes, uint8_t* t_scales, DeviceStatus* status, cudaStream_t stream, const char* what,
                   const RowBlockOrder& order) {
  constexpr int kHalves = kPairs ? 2 : 1;
  constexpr int smem = int(kStages * 8 * kHalves * kThreads * sizeof(uint4));
  auto* kernel = quantize_weight_staged_kernel<kPairs>;
  const int sms = detail::sm_count_after(
      [&] { FLOWMOE_CUDA_CHECK(cudaFuncSetAttribute(kernel, cudaFuncAttributeMaxDynamicSharedMemorySize, smem)); });
  const int64_t total = int64_t(num_experts) * (n / kTile) * (k / kTile / kHalves);
  const int64_t ctas = std::min<int64_t>(total, int64_t(sms) * (kPairs ? 1 : 2));
  kernel<<<static_cast<unsigned>(ctas), kThreads, smem, stream>>>(s, num_experts, n, k, codes, scales, t_codes,
                                                                  t_scales, nonfinite_ptr(status), order);
  FLOWMOE_LAUNCH_CHECK(what);
}

}  // namespace

void quantize_weight(const bf16_t* w, int64_t n, int64_t k, uint8_t* codes, uint8_t* scales,
                     uint8_t* t_codes, uint8_t* t_scales, DeviceStatus* status,
                     cudaStream_t stream) {
  quantize_weights(w, 1, n, k, codes, scales, t_codes, t_scales, status, stream);
}

namespace {
// W1's gate / up interleaving asked of W [E][N][K] (N = 2F): F a multiple of 128.
int64_t gate_up_half(bool interleaved, int64_t n, const char* what) {
  if (!interleaved) return 0;
  FLOWMOE_CHECK(n % (2 * kTile) == 0, what << ": gate / up interleaving needs W1 [2F, K] with F a multiple of 128 "
                                              "(N = " << n << ")");
  return n / (2 * kTile);
}
}  // namespace

namespace {
template <typename In>
void launch_quantize_weights(const In* w, int num_experts, int64_t n, int64_t k, uint8_t* codes,
                             uint8_t* scales, uint8_t* t_codes, uint8_t* t_scales, DeviceStatus* status,
                             cudaStream_t stream, bool gate_up_interleaved) {
  const char* what = "cuda::quantize_weights";
  FLOWMOE_CHECK(num_experts >= 1 && num_experts < 65536,
                what << ": " << num_experts << " experts; expected 1 to 65535");
  check_k(k, kTile, what);
  FLOWMOE_CHECK(n > 0 && n % kTile == 0, what << ": N = " << n << " must be a positive multiple of 128");
  FLOWMOE_CHECK(n / kTile < 65536, what << ": N = " << n << " too large (at most 65535 tiles of 128)");
  check_aligned(w, "w", what);
  FLOWMOE_CHECK((codes == nullptr) == (scales == nullptr), what << ": give both codes and scales, or neither");
  FLOWMOE_CHECK((t_codes == nullptr) == (t_scales == nullptr),
                what << ": give both t_codes and t_scales, or neither");
  FLOWMOE_CHECK(codes || t_codes, what << ": no output; expected codes and scales, t_codes and t_scales, or both");
  if (codes) check_aligned(codes, "codes", what);
  if (t_codes) check_aligned(t_codes, "t_codes", what);
  RowBlockOrder order;
  order.codes_half = gate_up_half(gate_up_interleaved, n, what);  // (W's copy; W^T as it is)
  if constexpr (std::is_same<In, bf16_t>::value) {  // (BF16: whole aligned runs)
    const StagedSource s{w, n * k, k, 0, 0, -1, n, k};
    launch_staged<false>(s, num_experts, n, k, codes, scales, t_codes, t_scales, status, stream, what, order);
  } else {
    dim3 grid(static_cast<unsigned>(k / kTile), static_cast<unsigned>(n / kTile),
              static_cast<unsigned>(num_experts));
    quantize_weight_kernel<In><<<grid, kThreads, 0, stream>>>(DenseWeights<In>{w, k}, n, k, codes, scales, t_codes,
                                                              t_scales, nonfinite_ptr(status), order);
    FLOWMOE_LAUNCH_CHECK(what);
  }
}

// W [E][N][K] from src [E][C][L]: the kernel quantizes X = W^T [K][N] (read along the stored rows),
// so its row copy is W's transposed one and its transposed copy W's own.
template <typename In>
void launch_quantize_weights_stored(const In* src, int num_experts, int64_t c, int64_t l, const ExpertRowMap& map,
                                    int64_t n, int64_t k, uint8_t* codes, uint8_t* scales, uint8_t* t_codes,
                                    uint8_t* t_scales, DeviceStatus* status, cudaStream_t stream,
                                    bool gate_up_interleaved) {
  const char* what = "cuda::quantize_weights_stored";
  FLOWMOE_CHECK(num_experts >= 1 && num_experts < 65536,
                what << ": " << num_experts << " experts; expected 1 to 65535");
  FLOWMOE_CHECK(n > 0 && n % kTile == 0 && n / kTile < 65536,
                what << ": N = " << n << "; expected a positive multiple of 128 (at most 65535 tiles)");
  FLOWMOE_CHECK(k > 0 && k % kTile == 0 && k / kTile < 65536,
                what << ": K = " << k << "; expected a positive multiple of 128 (at most 65535 tiles)");
  FLOWMOE_CHECK(c >= 1 && c <= k, what << ": C = " << c << " stored columns; expected 1 to K = " << k);
  FLOWMOE_CHECK(src, what << ": src is null");
  FLOWMOE_CHECK((map.stride == 1 || map.stride == 2) && map.valid >= 1 && map.valid <= n && map.base0 >= 0 &&
                    map.base0 + map.stride * (map.valid - 1) < l &&
                    (map.second < 0 || (map.second >= map.valid && map.second + map.valid <= n && map.base1 >= 0 &&
                                        map.base1 + map.stride * (map.valid - 1) < l)),
                what << ": the row map (valid " << map.valid << ", stride " << map.stride << ", bases " << map.base0
                     << " / " << map.base1 << ", second " << map.second << ") leaves W's " << n
                     << " rows or the stored rows of " << l << " values; expected one of flowmoe/expert_layout.h's");
  FLOWMOE_CHECK((codes == nullptr) == (scales == nullptr), what << ": give both codes and scales, or neither");
  FLOWMOE_CHECK((t_codes == nullptr) == (t_scales == nullptr),
                what << ": give both t_codes and t_scales, or neither");
  FLOWMOE_CHECK(codes || t_codes, what << ": no output; expected codes and scales, t_codes and t_scales, or both");
  if (codes) check_aligned(codes, "codes", what);
  if (t_codes) check_aligned(t_codes, "t_codes", what);
  RowBlockOrder order;  // (the kernel's transposed copy is W's)
  order.t_half = gate_up_half(gate_up_interleaved, n, what);
  // BF16 in whole aligned 8-value runs: the staged kernel; gpt-oss's interleaved gate_up_proj as
  // pairs (every stored byte read once)
  const bool bf16_runs = std::is_same<In, bf16_t>::value && reinterpret_cast<uintptr_t>(src) % 16 == 0 &&
                         l % 8 == 0 && map.valid % 8 == 0;
  const bool pairs = bf16_runs && map.stride == 2 && map.base0 == 0 && map.base1 == 1 && map.second == n / 2 &&
                     (n / 2) % kTile == 0;
  const bool runs = bf16_runs && map.stride == 1 && map.base0 % 8 == 0 &&
                    (map.second < 0 || (map.base1 % 8 == 0 && map.second % 8 == 0));
  if (pairs || runs) {
    // (the kernel quantizes X = W^T [k][n]: W's codes are its transposed copy)
    const StagedSource s{reinterpret_cast<const bf16_t*>(src), c * l, l, map.base0, map.base1, map.second, c, map.valid};
    if (pairs)
      launch_staged<true>(s, num_experts, k, n, t_codes, t_scales, codes, scales, status, stream, what, order);
    else
      launch_staged<false>(s, num_experts, k, n, t_codes, t_scales, codes, scales, status, stream, what, order);
    return;
  }
  dim3 grid(static_cast<unsigned>(n / kTile), static_cast<unsigned>(k / kTile), static_cast<unsigned>(num_experts));
  quantize_weight_kernel<In><<<grid, kThreads, 0, stream>>>(StoredWeights<In>{src, c, l, map}, k, n, t_codes,
                                                            t_scales, codes, scales, nonfinite_ptr(status), order);
  FLOWMOE_LAUNCH_CHECK(what);
}
}  // namespace

void quantize_weights_stored(const bf16_t* src, int num_experts, int64_t c, int64_t l, const ExpertRowMap& map,
                             int64_t n, int64_t k, uint8_t* codes, uint8_t* scales, uint8_t* t_codes,
                             uint8_t* t_scales, DeviceStatus* status, cudaStream_t stream, bool gate_up_interleaved) {
  launch_quantize_weights_stored(src, num_experts, c, l, map, n, k, codes, scales, t_codes, t_scales, status, stream,
                                 gate_up_interleaved);
}

void quantize_weights_stored(const float* src, int num_experts, int64_t c, int64_t l, const ExpertRowMap& map,
                             int64_t n, int64_t k, uint8_t* codes, uint8_t* scales, uint8_t* t_codes,
                             uint8_t* t_scales, DeviceStatus* status, cudaStream_t stream, bool gate_up_interleaved) {
  launch_quantize_weights_stored(src, num_experts, c, l, map, n, k, codes, scales, t_codes, t_scales, status, stream,
                                 gate_up_interleaved);
}

void quantize_weights(const bf16_t* w, int num_experts, int64_t n, int64_t k, uint8_t* codes,
                      uint8_t* scales, uint8_t* t_codes, uint8_t* t_scales, DeviceStatus* status,
                      cudaStream_t stream, bool gate_up_interleaved) {
  launch_quantize_weights(w, num_experts, n, k, codes, scales, t_codes, t_scales, status, stream, gate_up_interleaved);
}

void quantize_weights(const float* w, int num_experts, int64_t n, int64_t k, uint8_t* codes,
                      uint8_t* scales, uint8_t* t_codes, uint8_t* t_scales, DeviceStatus* status,
                      cudaStream_t stream, bool gate_up_interleaved) {
  launch_quantize_weights(w, num_experts, n, k, codes, scales, t_codes, t_scales, status, stream, gate_up_interleaved);
}

}  // namespace cuda
}  // namespace flowmoe
