// Routing metadata on the device (flowmoe/token.h): per-expert counts, unpadded and padded
// offsets, and the row maps, with no host synchronisation. A stable counting sort over the flat
// (token, slot) order in two kernels:
//   1. histogram: one CTA per chunk of pairs -> hist[chunk][e] (shared-memory integer atomics);
//   2. rank: one CTA per chunk: its prefix over earlier chunks and the totals (integer sums, so
//      any order gives the same result), the offsets (CTA 0 writes them), then the pairs of the
//      chunk in rounds of 256: rank inside a warp from __match_any_sync, across the warps of a
//      round from per-warp counts in shared memory, across rounds from a running count.
// Everything is integer arithmetic: the result is the CPU's bit for bit and the same every run.
#include <algorithm>
#include <climits>

#include "cuda/common.cuh"
#include "flowmoe/token.h"

namespace flowmoe {
namespace cuda {
namespace {

constexpr unsigned kFull = 0xffffffffu;
constexpr int kThreads = 256;
constexpr int kWarps = kThreads / 32;
constexpr int64_t kMaxChunks = 64;

// Pairs per chunk: a multiple of 256, at least 1024, and at most kMaxChunks chunks.
int64_t chunk_pairs(int64_t pairs) {
  const int64_t per = (pairs + kMaxChunks - 1) / kMaxChunks;
  const int64_t rounds = std::max<int64_t>(4, (per + kThreads - 1) / kThreads);
  return rounds * kThreads;
}
int64_t num_chunks(int64_t pairs) {
  const int64_t c = chunk_pairs(pairs);
  return (pairs + c - 1) / c;
}

__global__ void __launch_bounds__(kThreads)
routing_hist_kernel(const int32_t* __restrict__ ids, int64_t pairs, int E, int64_t chunk,
                    int32_t* __restrict__ hist, unsigned long long* bad) {
  extern __shared__ int s_h[];
  for (int e = threadIdx.x; e < E; e += kThreads) s_h[e] = 0;
  __syncthreads();
  const int64_t start = static_cast<int64_t>(blockIdx.x) * chunk;
  const int64_t end = min(start + chunk, pairs);
  int nbad = 0;
  for (int64_t i = start + threadIdx.x; i < end; i += kThreads) {
    const int id = ids[i];
    if (id >= 0 && id < E) atomicAdd(&s_h[id], 1);
    else nbad += id != -1;
  }
  detail::warp_count(bad, nbad);
  __syncthreads();
  for (int e = threadIdx.x; e < E; e += kThreads) hist[static_cast<int64_t>(blockIdx.x) * E + e] = s_h[e];
}

__global__ void __launch_bounds__(kThreads)
routing_rank_kernel(const int32_t* __restrict__ ids, int64_t pairs, int E, int align,
                    int64_t chunk, int64_t nchunks, const int32_t* __restrict__ hist,
                    int32_t* __restrict__ counts, int32_t* __restrict__ offsets,
                    int32_t* __restrict__ padded_offsets, int32_t* __restrict__ row_map,
                    int32_t* __restrict__ row_map_unpadded, int32_t* __restrict__ row_src, int topk) {
  extern __shared__ int smem[];
  int* s_wc = smem;                  // [kWarps][E] pairs per expert in each warp of a round
  int* s_run = s_wc + kWarps * E;    // [E] pairs of e before the current round (all chunks)
  int* s_off = s_run + E;            // [E+1] unpadded offsets (first: totals)
  int* s_poff = s_off + E + 1;       // [E+1] padded offsets
  const int tid = threadIdx.x, warp = tid >> 5, lane = tid & 31;
  const int64_t c0 = blockIdx.x;

  for (int i = tid; i < kWarps * E; i += kThreads) s_wc[i] = 0;
  for (int e = tid; e < E; e += kThreads) {
    int before = 0, total = 0;
#pragma unroll 8
    for (int64_t c = 0; c < nchunks; ++c) {
      const int v = hist[c * E + e];
      total += v;
      before += c < c0 ? v : 0;
    }
    s_run[e] = before;
    s_off[e] = total;
  }
  __syncthreads();
  if (warp == 0) {  // exclusive scans over experts: lane l owns a run of consecutive experts
    const int per = (E + 31) / 32;
    const int e0 = min(E, lane * per), e1 = min(E, e0 + per);
    int sum = 0, psum = 0;
    for (int e = e0; e < e1; ++e) {
      sum += s_off[e];
      psum += (s_off[e] + align - 1) / align * align;
    }
    int inc = sum, pinc = psum;
#pragma unroll
    for (int o = 1; o < 32; o <<= 1) {
      const int a = __shfl_up_sync(kFull, inc, o), pa = __shfl_up_sync(kFull, pinc, o);
      if (lane >= o) {
        inc += a;
        pinc += pa;
      }
    }
    int run = inc - sum, prun = pinc - psum;
    for (int e = e0; e < e1; ++e) {
      const int cnt = s_off[e];
      if (c0 == 0) counts[e] = cnt;
      s_off[e] = run;
      s_poff[e] = prun;
      run += cnt;
      prun += (cnt + align - 1) / align * align;
    }
    if (lane == 31) {
      s_off[E] = inc;
      s_poff[E] = pinc;
    }
  }
  __syncthreads();
  if (c0 == 0) {
    for (int e = tid; e <= E; e += kThreads) {
      offsets[e] = s_off[e];
      padded_offsets[e] = s_poff[e];
    }
  }

  const int64_t start = c0 * chunk;
  const int64_t end = min(start + chunk, pairs);
  const unsigned lt = (1u << lane) - 1u;
  for (int64_t base = start; base < end; base += kThreads) {
    const int64_t i = base + tid;
    const int id = i < end ? ids[i] : -1;
    const bool valid = id >= 0 && id < E;
    const unsigned mask = __match_any_sync(kFull, valid ? id : -1);
    const bool leader = (__ffs(mask) - 1) == lane;
    const int n = __popc(mask);
    if (valid && leader) s_wc[warp * E + id] = n;
    __syncthreads();
    if (i < end) {
      int32_t row = -1, urow = -1;
      if (valid) {
        int rank = s_run[id] + __popc(mask & lt);
        for (int w = 0; w < warp; ++w) rank += s_wc[w * E + id];
        row = s_poff[id] + rank;
        urow = s_off[id] + rank;
      }
      row_map[i] = row;
      if (row_map_unpadded) row_map_unpadded[i] = urow;
      if (row_src && row >= 0) row_src[row] = static_cast<int32_t>(i / topk);
    }
    __syncthreads();
    if (valid && leader) {
      atomicAdd(&s_run[id], n);
      s_wc[warp * E + id] = 0;
    }
    __syncthreads();
  }
}

}  // namespace

size_t routing_workspace_bytes(int64_t tokens, int topk, int num_experts) {
  return static_cast<size_t>(std::max<int64_t>(1, num_chunks(tokens * topk))) * num_experts * sizeof(int32_t);
}

void build_routing(const int32_t* ids, const Routing& r, DeviceStatus* status, cudaStream_t stream) {
  const char* what = "build_routing";
  FLOWMOE_CHECK(r.tokens >= 0 && r.tokens <= INT32_MAX,
                what << ": T = " << r.tokens << " tokens out of range; expected 0 <= T < 2^31");
  FLOWMOE_CHECK(r.num_experts >= 1 && r.num_experts <= kRouterMaxExperts,
                what << ": E = " << r.num_experts << " experts out of range; expected 1 <= E <= "
                     << kRouterMaxExperts);
  FLOWMOE_CHECK(r.topk >= 1 && r.topk <= kMaxTopk,
                what << ": top-k k = " << r.topk << " out of range; expected 1 <= k <= " << kMaxTopk);
  FLOWMOE_CHECK(r.align >= 1 && r.align <= kMaxAlign,
                what << ": alignment A = " << r.align << " out of range; expected 1 <= A <= " << kMaxAlign
                     << " (e.g. 16, 32 or 128)");
  FLOWMOE_CHECK(r.max_rows() <= INT32_MAX,
                what << ": up to " << r.max_rows() << " padded rows do not fit int32 row indices");
  FLOWMOE_CHECK(r.counts && r.offsets && r.padded_offsets && r.row_map && r.workspace,
                what << ": counts, offsets, padded_offsets, row_map and workspace must all be "
                        "device buffers (one is null)");
  const int64_t pairs = r.tokens * r.topk;
  FLOWMOE_CHECK(ids != nullptr || pairs == 0, what << ": ids is null; expected a device buffer");
  const int E = r.num_experts;
  const int64_t chunk = chunk_pairs(pairs);
  const int64_t nchunks = num_chunks(pairs);
  int32_t* hist = static_cast<int32_t*>(r.workspace);
  if (r.row_src)  // every row -1 first: padding rows (and rows past Mp) keep it
    FLOWMOE_CUDA_CHECK(cudaMemsetAsync(r.row_src, 0xFF, static_cast<size_t>(r.max_rows()) * sizeof(int32_t), stream));
  if (nchunks > 0) {
    routing_hist_kernel<<<static_cast<unsigned>(nchunks), kThreads, E * sizeof(int), stream>>>(
        ids, pairs, E, chunk, hist, status ? &status->bad_segments : nullptr);
    FLOWMOE_LAUNCH_CHECK("routing_hist_kernel");
  }
  const size_t smem = (static_cast<size_t>(kWarps) * E + E + 2 * (E + 1)) * sizeof(int);
  // E <= 1024: at most 11266 ints = 45 KB, under the 48 KB default limit.
  routing_rank_kernel<<<static_cast<unsigned>(std::max<int64_t>(1, nchunks)), kThreads, smem, stream>>>(
      ids, pairs, E, r.align, chunk, nchunks, hist, r.counts, r.offsets, r.padded_offsets, r.row_map,
      r.row_map_unpadded, r.row_src, r.topk);
  FLOWMOE_LAUNCH_CHECK("routing_rank_kernel");
}

int64_t fetch_routing_counts(const Routing& r, int32_t* h_counts, cudaStream_t stream) {
  FLOWMOE_CHECK(h_counts != nullptr && r.counts != nullptr,
                "fetch_routing_counts: counts (device) and h_counts (host) must not be null");
  FLOWMOE_CHECK(r.num_experts >= 1, "fetch_routing_counts: E = " << r.num_experts << "; expected E >= 1");
  FLOWMOE_CUDA_CHECK(cudaMemcpyAsync(h_counts, r.counts, r.num_experts * sizeof(int32_t),
                                     cudaMemcpyDeviceToHost, stream));
  FLOWMOE_CUDA_CHECK(cudaStreamSynchronize(stream));
  int64_t rows = 0;
  for (int e = 0; e < r.num_experts; ++e) rows += (h_counts[e] + r.align - 1) / r.align * r.align;
  return rows;
}

}  // namespace cuda
}  // namespace flowmoe
