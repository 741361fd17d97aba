// Kernels of the CUDA MoE layer that the operator libraries (convert.h, token.h, swiglu.h, gemm.h)
// do not provide: the router's FP32 GEMMs, the per-row routing probabilities (scatter, and the
// gather of their gradient), the dx combine with the router path, and the expert-parallel gathers
// and relayouts. (The `fp8-naive` recipe's FP32-scale casts are a mode of convert.h.) Launchers check their arguments (flowmoe::Error), never allocate and never
// synchronise. Arithmetic definitions: docs/MOE_GPU.md §3.
#pragma once

#include <cuda_runtime.h>

#include <cstdint>

#include "flowmoe/cuda/convert.h"
#include "flowmoe/cuda/ep_rows.h"
#include "flowmoe/tensor.h"

namespace flowmoe {
namespace cuda {
namespace moe {

// ---- utilities ---------------------------------------------------------------------------------
// out[i] = bf16(in[i]) (num::f32_to_bf16: round to nearest even); non-finite inputs are counted in
// status->nonfinite (status may be null).
void f32_to_bf16(const float* in, int64_t n, bf16_t* out, DeviceStatus* status, cudaStream_t stream);
// out[i] = in[i] (bf16 bits copied); non-finite values are counted in status->nonfinite (status may
// be null). out null: the count alone.
void copy_bf16_checked(const bf16_t* in, int64_t n, bf16_t* out, DeviceStatus* status, cudaStream_t stream);
// Deterministic normal(0, stddev) values from (seed, index).
void fill_normal(float* f32, bf16_t* bf16, int64_t n, uint64_t seed, float stddev,
                 cudaStream_t stream);

// ---- router GEMMs (FP32, sums in one fixed order) ------------------------------------------------
// Bit-identical to the CPU layer. Kernels: router_gemm.cuh (staged kernels for 16-byte aligned
// operands with H % 64 == 0 (logits) / H % 8 == 0 (dwr), the previous kernels otherwise; the same
// bits either way).
// z [T, E] = x [T, H] (bf16, decoded exactly) . wr [E, H]^T; for each (t, e) the sum runs over
// h = 0, 1, ..., H-1 as acc = fma(x, w, acc) from acc = 0.
void router_logits(const bf16_t* x, const float* wr, int64_t t, int e, int64_t h, float* z,
                   cudaStream_t stream);
// dwr [E, H] += dz [T, E]^T . x [T, H]: for each (e, h) the sum over t = 0..T-1 as
// acc = fma(dz, x, acc) from acc = 0, then dwr = dwr + acc.
void router_dwr(const float* dz, const bf16_t* x, int64_t t, int e, int64_t h, float* dwr,
                cudaStream_t stream);
// dx [T, H] bf16 = bf16( sum_s rows[row_map[t, s]] + sum_e dz[t, e] * wr[e, :] ): the expert rows
// added in slot order from 0 (dropped slots skipped), then the router path as
// acc = fma(dz, w, acc) for e = 0..E-1, one rounding to BF16. dz may be null (no router path).
void combine_dx(const bf16_t* rows, const int32_t* row_map, int64_t t, int topk, const float* dz,
                const float* wr, int e, int64_t h, bf16_t* dx, cudaStream_t stream);

// ---- routing probability per permuted row -------------------------------------------------------
// prow[row_map[t, s]] = probs[t, s] for every routed slot (rows not written stay as they are:
// the caller zeroes [0, Mp) first so padding rows carry 0).
void scatter_row_probs(const float* probs, const int32_t* row_map, int64_t t, int topk,
                       float* prow, cudaStream_t stream);
// dprobs[t, s] = sum_b dprow_part[b][row_map[t, s]] for b = 0..tiles-1 in order (0 for a dropped
// slot): the partial sums of dp per 128-feature tile that swiglu.h's backward writes ([tiles][m]).
void gather_row_dprobs(const float* dprow_part, int64_t tiles, int64_t m, const int32_t* row_map,
                       int64_t t, int topk, float* dprobs, cudaStream_t stream);

// ---- expert parallelism (src/cuda/moe/ep.cu): the send-side gathers and receive-side relayouts
// are public (flowmoe/cuda/ep_rows.h, included above); the layer's own:
// dp[r] = part[0][r] + part[1][r] + ... + part[tiles-1][r] (FP32, in that order: the order of
// gather_row_dprobs) for r < m: each padded row's d loss / d prob, sent back with the dX rows.
void ep_sum_row_dprobs(const float* part, int64_t tiles, int64_t m, float* dp, cudaStream_t stream);
// Deduplicated dispatch (each token once per destination rank): ids [T, k] global expert ids ->
// peers [T, k]: the rank of slot s's expert (id / el) where no earlier slot of the token has that
// rank, else -1 (and -1 for dropped slots). build_routing over these with E = ranks, align 1,
// gives each rank's tokens in token order and the counts per rank.
void ep_peer_ids(const int32_t* ids, int64_t t, int topk, int el, int32_t* peers, cudaStream_t stream);
// ids [n, k] global expert ids of received tokens -> local ids (id - rank * el for this rank's
// experts, -1 otherwise): build_routing over them gives the padded layout of the plan.
void ep_local_ids(const int32_t* ids, int64_t n, int topk, int el, int rank, int32_t* local,
                  cudaStream_t stream);

// ---- expert parallelism without host synchronisation (src/cuda/moe/ep_device.cu) ---------------
// The plan made on the device from every rank's counts, and row movement as pulls: each rank's
// kernels read the rows it receives straight from the peers' buffers (Communicator::device_peers).
// One piece: rows [src_row, src_row + rows) of rank `peer`'s buffer to rows [dst_row, ...) of this
// rank's; peer -1: zero rows (the padding of a segment).
struct EpPiece {
  int32_t peer, src_row, dst_row, rows;
};
// matrix[q * n + i] = peer_arrays[q][i] for every rank q < world (peer_arrays: device [world]).
void ep_gather_peer_ints(const int32_t* const* peer_arrays, int world, int n, int32_t* matrix,
                         cudaStream_t stream);
// From counts [world, world * el] (rows rank q routes to global expert g) and, for the
// deduplicated dispatch, tokens [world, world] (tokens rank q sends to rank p; null otherwise),
// what DispatchPlan computes for rank `rank` (comm.h): local_offsets [el + 1] (the padded
// offsets of the local segments, align A), and the pieces of
//   dispatch [world * el + el]: (q, l) rank q's send rows of local expert l into the segment after
//            ranks q' < q, then one zero piece per segment for its padding;
//   combine  [world * el]: (p, l) this rank's rows that rank p's local expert l computed, back
//            into this rank's send order;
//   dedup    [world] (or null): rank q's tokens for this rank after ranks q' < q's.
void ep_device_plan(const int32_t* counts, const int32_t* tokens, int world, int el, int rank, int align,
                    int32_t* local_offsets, EpPiece* dispatch, EpPiece* combine, EpPiece* dedup,
                    cudaStream_t stream);
// Copies the rows of pieces[0, n) (row_bytes each) from peer_bases[piece.peer] (device [world]) to
// dst; rows are 16-byte copies where aligned. Reads the peers' memory around the L1 cache.
void ep_pull_rows(const EpPiece* pieces, int n, void* const* peer_bases, int64_t row_bytes, void* dst,
                  cudaStream_t stream);

}  // namespace moe
}  // namespace cuda
}  // namespace flowmoe
