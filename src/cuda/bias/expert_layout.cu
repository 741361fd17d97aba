// Expert weights to and from the layer's layout (include/flowmoe/expert_layout.h): tiled
// transposes through shared memory, so both the strided side and the contiguous side are read and
// written a warp-row at a time: 64 x 64 tiles of 32-bit pairs for 2-byte elements with even sizes
// (BF16 parameters), 32 x 32 tiles of single elements otherwise.
#include <cuda_runtime.h>

#include "cuda/common.cuh"
#include "flowmoe/error.h"
#include "flowmoe/expert_layout.h"

namespace flowmoe {
namespace cuda {
namespace {

constexpr int kTile = 32, kRowsPerPass = 8;

struct DeviceMap {
  int64_t valid, stride, base0, base1, second;
  __device__ __forceinline__ int64_t map(int64_t r) const {
    if (r < valid) return base0 + stride * r;
    if (second >= 0 && r >= second && r < second + valid) return base1 + stride * (r - second);
    return -1;
  }
  // the layer row holding stored index j (every j < L has one); stride is 1 or 2 (checked on the
  // host), so no division
  __device__ __forceinline__ int64_t inverse(int64_t j) const {
    const int64_t d0 = j - base0;
    if (stride == 1) return d0 >= 0 && d0 < valid ? d0 : second + (j - base1);
    if (d0 >= 0 && (d0 & 1) == 0 && (d0 >> 1) < valid) return d0 >> 1;
    return second + ((j - base1) >> 1);
  }
};

// dst[e][r][c] = (c < C && map(r) >= 0) ? src[e][c][map(r)] : 0; tile (r0, c0)
template <typename T>
__global__ void __launch_bounds__(kTile * kRowsPerPass)
to_layer_kernel(const T* __restrict__ src, T* __restrict__ dst, int64_t C, int64_t L, int64_t R, int64_t Cp,
                DeviceMap m) {
  __shared__ T tile[kTile][kTile + 1];
  const int64_t e = blockIdx.z, r0 = int64_t(blockIdx.y) * kTile, c0 = int64_t(blockIdx.x) * kTile;
  const T* s = src + e * C * L;
  // read: thread x walks the layer rows r0 + x (their stored index j: near-contiguous), y the columns
  const int64_t j = r0 + threadIdx.x < R ? m.map(r0 + threadIdx.x) : -1;
  for (int y = threadIdx.y; y < kTile; y += kRowsPerPass) {
    const int64_t c = c0 + y;
    tile[y][threadIdx.x] = (j >= 0 && c < C) ? __ldg(s + c * L + j) : T(0);
  }
  __syncthreads();
  T* d = dst + e * R * Cp;
  for (int y = threadIdx.y; y < kTile; y += kRowsPerPass) {
    const int64_t r = r0 + y, c = c0 + threadIdx.x;
    if (r < R && c < Cp) d[r * Cp + c] = tile[threadIdx.x][y];
  }
}

// grad[e][c][j] = dst_grad[e][inverse(j)][c]; tile (c0, j0)
template <typename T>
__global__ void __launch_bounds__(kTile * kRowsPerPass)
from_layer_kernel(const T* __restrict__ dgrad, T* __restrict__ grad, int64_t C, int64_t L, int64_t R, int64_t Cp,
                  DeviceMap m) {
  __shared__ T tile[kTile][kTile + 1];
  const int64_t e = blockIdx.z, j0 = int64_t(blockIdx.y) * kTile, c0 = int64_t(blockIdx.x) * kTile;
  const T* s = dgrad + e * R * Cp;
  // read: thread x walks the columns c0 + x (contiguous), y the stored indices j0 + y
  for (int y = threadIdx.y; y < kTile; y += kRowsPerPass) {
    const int64_t jj = j0 + y, c = c0 + threadIdx.x;
    tile[y][threadIdx.x] = (jj < L && c < C) ? __ldg(s + m.inverse(jj) * Cp + c) : T(0);
  }
  __syncthreads();
  T* g = grad + e * C * L;
  for (int y = threadIdx.y; y < kTile; y += kRowsPerPass) {
    const int64_t c = c0 + y, jj = j0 + threadIdx.x;
    if (c < C && jj < L) g[c * L + jj] = tile[threadIdx.x][y];
  }
}

// ---- 2-byte elements (BF16 parameters, the usual case): 64 x 64 tiles moved as 32-bit pairs ------
// A block takes the stored indices [j0, j0 + 64) and the columns [c0, c0 + 64): the stored side
// (src[c][j] / grad[c][j]) and the layer side (dst[inverse(j)][c]) are both read or written 128
// bytes per warp access. Needs C and L even (checked); the layer rows no stored index maps to and
// the padding columns are zeroed by pad_rows_kernel.
constexpr int kWide = 64;

__global__ void __launch_bounds__(kTile * kRowsPerPass)
to_layer_pairs_kernel(const uint32_t* __restrict__ src, uint32_t* __restrict__ dst, int64_t C, int64_t L, int64_t R,
                      int64_t Cp, DeviceMap m) {
  __shared__ uint16_t tile[kWide][kWide + 2];  // [c - c0][j - j0]
  const int64_t e = blockIdx.z, j0 = int64_t(blockIdx.y) * kWide, c0 = int64_t(blockIdx.x) * kWide;
  const int tx = threadIdx.x, ty = threadIdx.y;
  const uint32_t* s = src + e * C * (L / 2);
  for (int y = ty; y < kWide; y += kRowsPerPass) {
    const int64_t c = c0 + y, j = j0 + 2 * tx;
    const uint32_t w = (c < C && j < L) ? __ldg(s + c * (L / 2) + j / 2) : 0u;
    tile[y][2 * tx] = uint16_t(w & 0xFFFFu);
    tile[y][2 * tx + 1] = uint16_t(w >> 16);
  }
  __syncthreads();
  uint32_t* d = dst + e * R * (Cp / 2);
  for (int y = ty; y < kWide; y += kRowsPerPass) {
    const int64_t j = j0 + y, c = c0 + 2 * tx;
    if (j < L && c < C)
      d[m.inverse(j) * (Cp / 2) + c / 2] = uint32_t(tile[2 * tx][y]) | (uint32_t(tile[2 * tx + 1][y]) << 16);
  }
}

__global__ void __launch_bounds__(kTile * kRowsPerPass)
from_layer_pairs_kernel(const uint32_t* __restrict__ dgrad, uint32_t* __restrict__ grad, int64_t C, int64_t L,
                        int64_t R, int64_t Cp, DeviceMap m) {
  __shared__ uint16_t tile[kWide][kWide + 2];  // [j - j0][c - c0]
  const int64_t e = blockIdx.z, j0 = int64_t(blockIdx.y) * kWide, c0 = int64_t(blockIdx.x) * kWide;
  const int tx = threadIdx.x, ty = threadIdx.y;
  const uint32_t* s = dgrad + e * R * (Cp / 2);
  for (int y = ty; y < kWide; y += kRowsPerPass) {
    const int64_t j = j0 + y, c = c0 + 2 * tx;
    const uint32_t w = (j < L && c < C) ? __ldg(s + m.inverse(j) * (Cp / 2) + c / 2) : 0u;
    tile[y][2 * tx] = uint16_t(w & 0xFFFFu);
    tile[y][2 * tx + 1] = uint16_t(w >> 16);
  }
  __syncthreads();
  uint32_t* g = grad + e * C * (L / 2);
  for (int y = ty; y < kWide; y += kRowsPerPass) {
    const int64_t c = c0 + y, j = j0 + 2 * tx;
    if (c < C && j < L) g[c * (L / 2) + j / 2] = uint32_t(tile[2 * tx][y]) | (uint32_t(tile[2 * tx + 1][y]) << 16);
  }
}

// Zeros of the layer's layout: whole rows no stored index maps to, and columns [C, Cp) of the others.
__global__ void pad_rows_kernel(uint16_t* __restrict__ dst, int64_t C, int64_t R, int64_t Cp, DeviceMap m) {
  const int64_t e = blockIdx.y, r = blockIdx.x;
  uint16_t* row = dst + (e * R + r) * Cp;
  const int64_t from = m.map(r) < 0 ? 0 : C;
  for (int64_t c = from + threadIdx.x; c < Cp; c += blockDim.x) row[c] = 0;
}

void check(int elem_bytes, int num_experts, int64_t c, int64_t l, int64_t r, int64_t cp, const ExpertRowMap& m,
           const char* what) {
  FLOWMOE_CHECK(elem_bytes == 2 || elem_bytes == 4, what << ": element size " << elem_bytes << "; expected 2 or 4");
  FLOWMOE_CHECK(num_experts >= 1 && num_experts <= 65535 && c >= 1 && l >= 1 && r >= 1 && cp >= c,
                what << ": E " << num_experts << ", C " << c << ", L " << l << ", R " << r << ", C' " << cp
                     << "; expected positive sizes, E <= 65535, C' >= C");
  // the three maps of expert_layout.h: each stored index [0, L) from exactly one layer row < R
  const bool one_part = m.stride == 1 && m.second < 0 && m.valid == l;
  const bool concatenated = m.stride == 1 && m.second >= m.valid && m.base1 == m.valid && 2 * m.valid == l;
  const bool interleaved = m.stride == 2 && m.second >= m.valid && m.base1 == 1 && 2 * m.valid == l;
  FLOWMOE_CHECK(m.base0 == 0 && m.valid >= 1 && (one_part || concatenated || interleaved),
                what << ": row map {valid " << m.valid << ", stride " << m.stride << ", base0 " << m.base0 << ", base1 "
                     << m.base1 << ", second " << m.second << "} for " << l << " stored rows; expected one part "
                     << "{L, 1, 0, -, -1}, concatenated {L/2, 1, 0, L/2, >= L/2} or interleaved {L/2, 2, 0, 1, >= L/2}");
  FLOWMOE_CHECK((m.second < 0 ? m.valid : m.second + m.valid) <= r,
                what << ": the row map reaches layer row " << (m.second < 0 ? m.valid : m.second + m.valid) - 1
                     << " of " << r);
  FLOWMOE_CHECK((r + kTile - 1) / kTile <= 65535 && (l + kTile - 1) / kTile <= 65535, what << ": too many rows");
}

// The 32-bit pair kernels: 2-byte elements, even sizes and 4-byte aligned pointers.
bool pairs(int elem_bytes, int64_t c, int64_t l, int64_t cp, const void* a, const void* b) {
  const uintptr_t addr = reinterpret_cast<uintptr_t>(a) | reinterpret_cast<uintptr_t>(b);
  return elem_bytes == 2 && c % 2 == 0 && l % 2 == 0 && cp % 2 == 0 && addr % 4 == 0;
}

DeviceMap device_map(const ExpertRowMap& m) { return DeviceMap{m.valid, m.stride, m.base0, m.base1, m.second}; }

}  // namespace

void expert_weights_to_layer(const void* src, void* dst, int elem_bytes, int num_experts, int64_t c, int64_t l,
                             int64_t r, int64_t cp, const ExpertRowMap& map, cudaStream_t stream) {
  const char* what = "cuda::expert_weights_to_layer";
  check(elem_bytes, num_experts, c, l, r, cp, map, what);
  const dim3 block(kTile, kRowsPerPass);
  if (pairs(elem_bytes, c, l, cp, src, dst)) {
    const dim3 g2(unsigned((c + kWide - 1) / kWide), unsigned((l + kWide - 1) / kWide), unsigned(num_experts));
    to_layer_pairs_kernel<<<g2, block, 0, stream>>>(static_cast<const uint32_t*>(src), static_cast<uint32_t*>(dst),
                                                    c, l, r, cp, device_map(map));
    FLOWMOE_LAUNCH_CHECK(what);
    pad_rows_kernel<<<dim3(unsigned(r), unsigned(num_experts)), 128, 0, stream>>>(static_cast<uint16_t*>(dst), c, r,
                                                                                  cp, device_map(map));
    FLOWMOE_LAUNCH_CHECK(what);
    return;
  }
  const dim3 grid(unsigned((cp + kTile - 1) / kTile), unsigned((r + kTile - 1) / kTile), unsigned(num_experts));
  if (elem_bytes == 2)
    to_layer_kernel<uint16_t><<<grid, block, 0, stream>>>(static_cast<const uint16_t*>(src),
                                                          static_cast<uint16_t*>(dst), c, l, r, cp, device_map(map));
  else
    to_layer_kernel<uint32_t><<<grid, block, 0, stream>>>(static_cast<const uint32_t*>(src),
                                                          static_cast<uint32_t*>(dst), c, l, r, cp, device_map(map));
  FLOWMOE_LAUNCH_CHECK(what);
}

void expert_grads_from_layer(const void* dst_grad, void* grad, int elem_bytes, int num_experts, int64_t c, int64_t l,
                             int64_t r, int64_t cp, const ExpertRowMap& map, cudaStream_t stream) {
  const char* what = "cuda::expert_grads_from_layer";
  check(elem_bytes, num_experts, c, l, r, cp, map, what);
  const dim3 block(kTile, kRowsPerPass);
  if (pairs(elem_bytes, c, l, cp, dst_grad, grad)) {
    const dim3 g2(unsigned((c + kWide - 1) / kWide), unsigned((l + kWide - 1) / kWide), unsigned(num_experts));
    from_layer_pairs_kernel<<<g2, block, 0, stream>>>(static_cast<const uint32_t*>(dst_grad),
                                                      static_cast<uint32_t*>(grad), c, l, r, cp, device_map(map));
    FLOWMOE_LAUNCH_CHECK(what);
    return;
  }
  const dim3 grid(unsigned((c + kTile - 1) / kTile), unsigned((l + kTile - 1) / kTile), unsigned(num_experts));
  if (elem_bytes == 2)
    from_layer_kernel<uint16_t><<<grid, block, 0, stream>>>(static_cast<const uint16_t*>(dst_grad),
                                                            static_cast<uint16_t*>(grad), c, l, r, cp, device_map(map));
  else
    from_layer_kernel<uint32_t><<<grid, block, 0, stream>>>(static_cast<const uint32_t*>(dst_grad),
                                                            static_cast<uint32_t*>(grad), c, l, r, cp, device_map(map));
  FLOWMOE_LAUNCH_CHECK(what);
}

}  // namespace cuda
}  // namespace flowmoe
