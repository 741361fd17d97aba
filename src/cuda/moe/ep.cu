// Expert-parallel helpers of the CUDA MoE layer (kernels.cuh, "expert parallelism"): the
// send-order gathers before a dispatch, the scale relayout after it, and the per-row dprob sums
// sent back by the backward combine. Pure data movement (no arithmetic except the dprob sum, in
// gather_row_dprobs' order), so the expert-parallel layer moves the single rank's bits.
#include <cuda_runtime.h>

#include "cuda/common.cuh"
#include "cuda/moe/kernels.cuh"
#include "flowmoe/error.h"

namespace flowmoe {
namespace cuda {
namespace moe {
namespace {

constexpr int kThreads = 256;

using ::flowmoe::cuda::detail::grid_1d;
inline bool aligned(const void* p, int64_t a) { return (reinterpret_cast<uintptr_t>(p) % a) == 0; }

// One thread per word of one (token, slot) item; W the word type.
template <typename W>
__global__ void gather_rows_kernel(const W* __restrict__ in, int64_t words, bool per_slot,
                                   const int32_t* __restrict__ row_map, int64_t n, int topk,
                                   W* __restrict__ out) {
  const int64_t total = n * words;
  for (int64_t i = blockIdx.x * int64_t(blockDim.x) + threadIdx.x; i < total;
       i += int64_t(gridDim.x) * blockDim.x) {
    const int64_t item = i / words, w = i - item * words;
    const int32_t row = row_map[item];
    if (row < 0) continue;
    const int64_t src = per_slot ? item : item / topk;
    out[int64_t(row) * words + w] = in[src * words + w];
  }
}

template <typename S>
__global__ void gather_col_scales_kernel(const S* __restrict__ in, int64_t nc, int64_t t,
                                         const int32_t* __restrict__ row_map, int topk,
                                         S* __restrict__ out) {
  const int64_t total = t * topk * nc;
  for (int64_t i = blockIdx.x * int64_t(blockDim.x) + threadIdx.x; i < total;
       i += int64_t(gridDim.x) * blockDim.x) {
    const int64_t item = i / nc, c = i - item * nc;
    const int32_t row = row_map[item];
    if (row < 0) continue;
    out[int64_t(row) * nc + c] = in[c * t + item / topk];
  }
}

template <typename S>
__global__ void transpose_scales_kernel(const S* __restrict__ in, int64_t m, int64_t nc,
                                        S* __restrict__ out, int64_t ld) {
  const int64_t total = m * nc;
  for (int64_t i = blockIdx.x * int64_t(blockDim.x) + threadIdx.x; i < total;
       i += int64_t(gridDim.x) * blockDim.x) {
    const int64_t c = i / m, r = i - c * m;  // consecutive threads write consecutive rows
    out[c * ld + r] = in[r * nc + c];
  }
}

__global__ void sum_row_dprobs_kernel(const float* __restrict__ part, int64_t tiles, int64_t m,
                                      float* __restrict__ dp) {
  for (int64_t r = blockIdx.x * int64_t(blockDim.x) + threadIdx.x; r < m;
       r += int64_t(gridDim.x) * blockDim.x) {
    float acc = part[r];
    for (int64_t b = 1; b < tiles; ++b) acc = __fadd_rn(acc, part[b * m + r]);
    dp[r] = acc;
  }
}

__global__ void peer_ids_kernel(const int32_t* __restrict__ ids, int64_t t, int topk, int el,
                                int32_t* __restrict__ peers) {
  for (int64_t tok = blockIdx.x * int64_t(blockDim.x) + threadIdx.x; tok < t;
       tok += int64_t(gridDim.x) * blockDim.x) {
    const int32_t* in = ids + tok * topk;
    for (int s = 0; s < topk; ++s) {
      const int32_t id = in[s];
      int32_t p = id >= 0 ? id / el : -1;
      for (int s2 = 0; s2 < s && p >= 0; ++s2)
        if (in[s2] >= 0 && in[s2] / el == p) p = -1;
      peers[tok * topk + s] = p;
    }
  }
}

__global__ void local_ids_kernel(const int32_t* __restrict__ ids, int64_t n, int el, int rank,
                                 int32_t* __restrict__ local) {
  for (int64_t i = blockIdx.x * int64_t(blockDim.x) + threadIdx.x; i < n;
       i += int64_t(gridDim.x) * blockDim.x) {
    const int32_t id = ids[i];
    local[i] = (id >= 0 && id / el == rank) ? id - rank * el : -1;
  }
}

}  // namespace

void ep_peer_ids(const int32_t* ids, int64_t t, int topk, int el, int32_t* peers, cudaStream_t stream) {
  FLOWMOE_CHECK(t >= 0 && topk >= 1 && el >= 1, "moe::ep_peer_ids: T " << t << ", k " << topk << ", El " << el);
  if (t == 0) return;
  FLOWMOE_CHECK(ids && peers, "moe::ep_peer_ids: null buffer");
  peer_ids_kernel<<<grid_1d(t, kThreads), kThreads, 0, stream>>>(ids, t, topk, el, peers);
  FLOWMOE_LAUNCH_CHECK("moe::peer_ids_kernel");
}

void ep_local_ids(const int32_t* ids, int64_t n, int topk, int el, int rank, int32_t* local,
                  cudaStream_t stream) {
  FLOWMOE_CHECK(n >= 0 && topk >= 1 && el >= 1 && rank >= 0,
                "moe::ep_local_ids: n " << n << ", k " << topk << ", El " << el << ", rank " << rank);
  if (n == 0) return;
  FLOWMOE_CHECK(ids && local, "moe::ep_local_ids: null buffer");
  local_ids_kernel<<<grid_1d(n * topk, kThreads), kThreads, 0, stream>>>(ids, n * topk, el, rank, local);
  FLOWMOE_LAUNCH_CHECK("moe::local_ids_kernel");
}

void ep_gather_rows(const void* in, int64_t row_bytes, bool per_slot, const int32_t* row_map,
                    int64_t t, int topk, void* out, cudaStream_t stream) {
  const char* what = "moe::ep_gather_rows";
  FLOWMOE_CHECK(row_bytes >= 1 && t >= 0 && topk >= 1,
                what << ": row_bytes " << row_bytes << ", T " << t << ", k " << topk);
  const int64_t n = t * topk;
  if (n == 0) return;
  FLOWMOE_CHECK(in && out && row_map, what << ": null buffer");
  if (row_bytes % 16 == 0 && aligned(in, 16) && aligned(out, 16)) {
    const int64_t words = row_bytes / 16;
    gather_rows_kernel<uint4><<<grid_1d(n * words, kThreads), kThreads, 0, stream>>>(
        static_cast<const uint4*>(in), words, per_slot, row_map, n, topk, static_cast<uint4*>(out));
  } else if (row_bytes % 4 == 0 && aligned(in, 4) && aligned(out, 4)) {
    const int64_t words = row_bytes / 4;
    gather_rows_kernel<uint32_t><<<grid_1d(n * words, kThreads), kThreads, 0, stream>>>(
        static_cast<const uint32_t*>(in), words, per_slot, row_map, n, topk,
        static_cast<uint32_t*>(out));
  } else {
    gather_rows_kernel<uint8_t><<<grid_1d(n * row_bytes, kThreads), kThreads, 0, stream>>>(
        static_cast<const uint8_t*>(in), row_bytes, per_slot, row_map, n, topk,
        static_cast<uint8_t*>(out));
  }
  FLOWMOE_LAUNCH_CHECK("moe::gather_rows_kernel");
}

void ep_gather_col_scales(const void* in, int64_t nc, int elem_bytes, const int32_t* row_map,
                          int64_t t, int topk, void* out, cudaStream_t stream) {
  const char* what = "moe::ep_gather_col_scales";
  FLOWMOE_CHECK(nc >= 1 && (elem_bytes == 1 || elem_bytes == 4) && t >= 0 && topk >= 1,
                what << ": nc " << nc << ", elem_bytes " << elem_bytes << "; expected 1 or 4");
  const int64_t n = t * topk * nc;
  if (n == 0) return;
  FLOWMOE_CHECK(in && out && row_map, what << ": null buffer");
  if (elem_bytes == 1)
    gather_col_scales_kernel<uint8_t><<<grid_1d(n, kThreads), kThreads, 0, stream>>>(
        static_cast<const uint8_t*>(in), nc, t, row_map, topk, static_cast<uint8_t*>(out));
  else
    gather_col_scales_kernel<uint32_t><<<grid_1d(n, kThreads), kThreads, 0, stream>>>(
        static_cast<const uint32_t*>(in), nc, t, row_map, topk, static_cast<uint32_t*>(out));
  FLOWMOE_LAUNCH_CHECK("moe::gather_col_scales_kernel");
}

void ep_transpose_scales(const void* in, int64_t m, int64_t nc, int elem_bytes, void* out,
                         int64_t ld, cudaStream_t stream) {
  const char* what = "moe::ep_transpose_scales";
  FLOWMOE_CHECK(m >= 0 && nc >= 1 && ld >= m && (elem_bytes == 1 || elem_bytes == 4),
                what << ": [" << m << ", " << nc << "] -> ld " << ld << ", elem_bytes "
                     << elem_bytes);
  if (m == 0) return;
  FLOWMOE_CHECK(in && out, what << ": null buffer");
  if (elem_bytes == 1)
    transpose_scales_kernel<uint8_t><<<grid_1d(m * nc, kThreads), kThreads, 0, stream>>>(
        static_cast<const uint8_t*>(in), m, nc, static_cast<uint8_t*>(out), ld);
  else
    transpose_scales_kernel<uint32_t><<<grid_1d(m * nc, kThreads), kThreads, 0, stream>>>(
        static_cast<const uint32_t*>(in), m, nc, static_cast<uint32_t*>(out), ld);
  FLOWMOE_LAUNCH_CHECK("moe::transpose_scales_kernel");
}

void ep_sum_row_dprobs(const float* part, int64_t tiles, int64_t m, float* dp, cudaStream_t stream) {
  FLOWMOE_CHECK(tiles >= 1 && m >= 0, "moe::ep_sum_row_dprobs: " << tiles << " tiles, m " << m);
  if (m == 0) return;
  FLOWMOE_CHECK(part && dp, "moe::ep_sum_row_dprobs: null buffer");
  sum_row_dprobs_kernel<<<grid_1d(m, kThreads), kThreads, 0, stream>>>(part, tiles, m, dp);
  FLOWMOE_LAUNCH_CHECK("moe::sum_row_dprobs_kernel");
}

}  // namespace moe
}  // namespace cuda
}  // namespace flowmoe
