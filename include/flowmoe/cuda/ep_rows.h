// The send-side gathers and receive-side relayouts of an expert-parallel dispatch, as the CUDA
// layer runs them around Communicator exchanges (dispatch_rows / combine_rows, flowmoe/comm.h):
// rows into the plan's send order before the exchange, column-layout scales into the wire layout
// next to their codes, and received row-major scales back into the layer's column layout. Public
// so that programs timing a dispatch (bench/ep/flowmoe_bench_ep.cu) run the layer's own kernels.
// Link flowmoe_cuda; the kernels are in src/cuda/moe/ep.cu. Launchers check their arguments (flowmoe::Error), never allocate, never
// synchronise the host.
#pragma once

#include <cuda_runtime.h>

#include <cstdint>

namespace flowmoe {
namespace cuda {
namespace moe {

// `row_map` is the routing's row_map_unpadded [T, k] (cuda::Routing, flowmoe/token.h): the send
// order of DispatchPlan (rows sorted by global expert, inside one expert by (token, slot); -1 =
// dropped slot).
// out[row_map[t, s]] = in[i] for every routed slot, i = t (token rows; per_slot false) or
// i = t*k + s (per_slot true: e.g. probs [T, k] with row_bytes 4); row_bytes bytes per row.
void ep_gather_rows(const void* in, int64_t row_bytes, bool per_slot, const int32_t* row_map,
                    int64_t t, int topk, void* out, cudaStream_t stream);
// Column-layout scales [nc][T] (elem_bytes 1: UE8M0, 4: FP32) -> send order, row-major [rows][nc]
// (the wire layout, next to the codes): out[row_map[t, s] * nc + c] = in[c * T + t].
void ep_gather_col_scales(const void* in, int64_t nc, int elem_bytes, const int32_t* row_map,
                          int64_t t, int topk, void* out, cudaStream_t stream);
// Received row-major scales [m][nc] -> the layer's column layout [nc][ld]: out[c*ld + r] =
// in[r*nc + c] for r < m (elem_bytes 1 or 4; ld >= m).
void ep_transpose_scales(const void* in, int64_t m, int64_t nc, int elem_bytes, void* out,
                         int64_t ld, cudaStream_t stream);

}  // namespace moe
}  // namespace cuda
}  // namespace flowmoe
