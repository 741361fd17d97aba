// Expert parallelism without host synchronisation (CudaLayerOptions::sync_free with a
// communicator; docs/EP.md §8). The synchronous layer fetches its per-expert counts to the host,
// exchanges them (the plan) and sizes every message there. Here nothing leaves the device:
//   * every rank's routing counts are read from the peers' memory after a device barrier
//     (Communicator::device_peers) and each rank makes the whole plan on the device;
//   * rows move as pulls: after a barrier each rank's kernels copy the rows it receives straight
//     from the peers' send buffers (or expert output rows) into place, then a second barrier
//     keeps every buffer unchanged until all peers have read it.
// The pieces are the chunks of DispatchPlan (comm.h): the same rows land in the same places as the
// synchronous exchange, so the layer keeps its bits.
#include <cuda_runtime.h>

#include <algorithm>

#include "cuda/common.cuh"
#include "cuda/moe/kernels.cuh"
#include "cuda/moe/step_context.h"
#include "flowmoe/error.h"

namespace flowmoe {
namespace cuda {
namespace moe {
namespace {

__global__ void gather_peer_ints_kernel(const int32_t* const* peers, int world, int n, int32_t* out) {
  const int64_t total = int64_t(world) * n;
  for (int64_t i = blockIdx.x * int64_t(blockDim.x) + threadIdx.x; i < total; i += int64_t(gridDim.x) * blockDim.x) {
    const int q = int(i / n);
    out[i] = __ldcg(peers[q] + (i - int64_t(q) * n));
  }
}

constexpr int kPlanThreads = 256;

// One block. Shared: tot[E] (rows of each global expert over all ranks), padoff[E] (first padded
// row of expert g inside its rank's buffer), mine[E + 1] (this rank's send offsets).
__global__ void device_plan_kernel(const int32_t* __restrict__ C, const int32_t* __restrict__ D, int W, int El,
                                   int me, int A, int32_t* local_offsets, EpPiece* dispatch, EpPiece* combine,
                                   EpPiece* dedup) {
  extern __shared__ int32_t sh[];
  const int E = W * El;
  int32_t* tot = sh;
  int32_t* padoff = sh + E;
  int32_t* mine = sh + 2 * E;
  for (int g = threadIdx.x; g < E; g += blockDim.x) {
    int32_t t = 0;
    for (int q = 0; q < W; ++q) t += C[q * E + g];
    tot[g] = t;
  }
  __syncthreads();
  for (int p = threadIdx.x; p < W; p += blockDim.x) {
    int32_t off = 0;
    for (int l = 0; l < El; ++l) {
      padoff[p * El + l] = off;
      off += (tot[p * El + l] + A - 1) / A * A;
    }
  }
  if (threadIdx.x == 0) {
    int32_t off = 0;
    for (int g = 0; g < E; ++g) {
      mine[g] = off;
      off += C[me * E + g];
    }
    mine[E] = off;
  }
  __syncthreads();
  for (int l = threadIdx.x; l <= El; l += blockDim.x) {
    if (l < El) {
      local_offsets[l] = padoff[me * El + l];
      const int g = me * El + l;
      const int32_t end = padoff[g] + tot[g];
      dispatch[W * El + l] = {-1, 0, end, (tot[g] + A - 1) / A * A - tot[g]};
    } else {
      const int g = me * El + El - 1;
      local_offsets[El] = padoff[g] + (tot[g] + A - 1) / A * A;
    }
  }
  // dispatch (q, l): rank q's send rows of expert g = me*El + l (its send offsets: the prefix of row q)
  for (int q = threadIdx.x; q < W; q += blockDim.x) {
    int32_t src = 0;
    for (int h = 0; h < me * El; ++h) src += C[q * E + h];
    for (int l = 0; l < El; ++l) {
      const int g = me * El + l;
      int32_t before = 0;
      for (int q2 = 0; q2 < q; ++q2) before += C[q2 * E + g];
      dispatch[q * El + l] = {q, src, padoff[g] + before, C[q * E + g]};
      src += C[q * E + g];
    }
  }
  // combine (p, l): this rank's rows of expert g = p*El + l, after ranks q < me's in p's segment
  for (int g = threadIdx.x; g < E; g += blockDim.x) {
    int32_t before = 0;
    for (int q = 0; q < me; ++q) before += C[q * E + g];
    combine[g] = {g / El, padoff[g] + before, mine[g], C[me * E + g]};
  }
  if (dedup != nullptr)
    for (int q = threadIdx.x; q < W; q += blockDim.x) {
      int32_t src = 0, dst = 0;
      for (int p = 0; p < me; ++p) src += D[q * W + p];
      for (int q2 = 0; q2 < q; ++q2) dst += D[q2 * W + me];
      dedup[q] = {q, src, dst, D[q * W + me]};
    }
}

// blockIdx.y: the piece; the x blocks share its bytes.
__global__ void pull_rows_kernel(const EpPiece* __restrict__ pieces, void* const* __restrict__ bases,
                                 int64_t row_bytes, uint8_t* __restrict__ dst) {
  const EpPiece pc = pieces[blockIdx.y];
  if (pc.rows <= 0) return;
  const int64_t bytes = int64_t(pc.rows) * row_bytes;
  uint8_t* d = dst + int64_t(pc.dst_row) * row_bytes;
  const uint8_t* s =
      pc.peer >= 0 ? static_cast<const uint8_t*>(bases[pc.peer]) + int64_t(pc.src_row) * row_bytes : nullptr;
  const int64_t first = blockIdx.x * int64_t(blockDim.x) + threadIdx.x, step = int64_t(gridDim.x) * blockDim.x;
  if (((reinterpret_cast<uintptr_t>(d) | reinterpret_cast<uintptr_t>(s) | uint64_t(bytes)) & 15) == 0) {
    uint4* d16 = reinterpret_cast<uint4*>(d);
    const uint4* s16 = reinterpret_cast<const uint4*>(s);
    for (int64_t i = first; i < bytes / 16; i += step) d16[i] = s ? __ldcg(s16 + i) : make_uint4(0, 0, 0, 0);
  } else if (((reinterpret_cast<uintptr_t>(d) | reinterpret_cast<uintptr_t>(s) | uint64_t(bytes)) & 3) == 0) {
    uint32_t* d4 = reinterpret_cast<uint32_t*>(d);  // e.g. the rows' FP32 probabilities
    const uint32_t* s4 = reinterpret_cast<const uint32_t*>(s);
    for (int64_t i = first; i < bytes / 4; i += step) d4[i] = s ? __ldcg(s4 + i) : 0u;
  } else {
    for (int64_t i = first; i < bytes; i += step) d[i] = s ? __ldcg(s + i) : uint8_t(0);
  }
}

}  // namespace

void ep_gather_peer_ints(const int32_t* const* peer_arrays, int world, int n, int32_t* matrix, cudaStream_t stream) {
  FLOWMOE_CHECK(peer_arrays && matrix && world >= 1 && n >= 1,
                "moe::ep_gather_peer_ints: " << world << " ranks x " << n << " ints; expected >= 1 each, non-null");
  const int64_t total = int64_t(world) * n;
  gather_peer_ints_kernel<<<int(std::min<int64_t>((total + 255) / 256, 64)), 256, 0, stream>>>(peer_arrays, world,
                                                                                                n, matrix);
  FLOWMOE_LAUNCH_CHECK("moe::gather_peer_ints_kernel");
}

void ep_device_plan(const int32_t* counts, const int32_t* tokens, int world, int el, int rank, int align,
                    int32_t* local_offsets, EpPiece* dispatch, EpPiece* combine, EpPiece* dedup,
                    cudaStream_t stream) {
  FLOWMOE_CHECK(world >= 1 && el >= 1 && rank >= 0 && rank < world && align >= 1 &&
                    int64_t(world) * el <= kRouterMaxExperts,
                "moe::ep_device_plan: rank " << rank << " of " << world << ", " << el << " local experts, align "
                                             << align << "; expected a valid rank, world * el <= "
                                             << kRouterMaxExperts);
  FLOWMOE_CHECK(counts && local_offsets && dispatch && combine && (tokens != nullptr) == (dedup != nullptr),
                "moe::ep_device_plan: null buffer (tokens and dedup: both or neither)");
  const size_t smem = sizeof(int32_t) * (3 * size_t(world) * el + 1);
  device_plan_kernel<<<1, kPlanThreads, smem, stream>>>(counts, tokens, world, el, rank, align, local_offsets,
                                                        dispatch, combine, dedup);
  FLOWMOE_LAUNCH_CHECK("moe::device_plan_kernel");
}

void ep_pull_rows(const EpPiece* pieces, int n, void* const* peer_bases, int64_t row_bytes, void* dst,
                  cudaStream_t stream) {
  FLOWMOE_CHECK(pieces && peer_bases && dst && n >= 1 && n <= 65535 && row_bytes >= 1,
                "moe::ep_pull_rows: " << n << " pieces of " << row_bytes
                                      << "-byte rows; expected 1..65535 pieces, rows >= 1 byte, non-null buffers");
  // the row counts live on the device: a fixed grid, the x blocks of a piece striding over its bytes
  const int bx = n <= 16 ? 32 : n <= 128 ? 8 : 2;
  pull_rows_kernel<<<dim3(bx, n), 256, 0, stream>>>(pieces, peer_bases, row_bytes, static_cast<uint8_t*>(dst));
  FLOWMOE_LAUNCH_CHECK("moe::pull_rows_kernel");
}

// ---- the step context's part (step_context.h; the plan: routing.cu; the shared buffers: layer.cu) --

void* const* StepContext::peer_table(const void* mine) const {
  for (const auto& t : *peer_tables_)
    if (t.first == mine) return t.second;
  FLOWMOE_CHECK(false, "MoeLayer: internal error: a buffer the peers read was not shared at construction");
  return nullptr;
}

// One exchange: barrier (every rank's source rows are written), each stream's rows pulled from the
// peers' `send` buffers into `recv` by the pieces, barrier (no rank changes a buffer a peer may
// still read).
void StepContext::pull_exchange(const EpPiece* pieces, int n, const std::vector<RowStream>& streams,
                                cudaStream_t s) {
  peers_->barrier(s);
  for (const RowStream& st : streams) ep_pull_rows(pieces, n, peer_table(st.send), st.row_bytes, st.recv, s);
  peers_->barrier(s);
}

int StepContext::dispatch_piece_count() const { return comm_->world_size() * El_ + El_; }
int StepContext::combine_piece_count() const { return comm_->world_size() * El_; }

}  // namespace moe
}  // namespace cuda
}  // namespace flowmoe
