// The sm_90a grouped BF16 GEMMs behind cuda::GroupedGemm's BF16 entry points on device segments:
// fprop, dgrad and wgrad of the bf16 recipe, each one persistent launch over all experts that reads
// the expert offsets from device memory (sm90_bf16_grouped.cu; docs/GEMM.md, "The BF16 kernels").
// FP32 accumulation, products of BF16 values exact: within tolerance of the CPU references
// cpu::grouped_*_bf16_ref (gemm.h), which sum in another order.
#pragma once
#include <cstdint>

#include "flowmoe/tensor.h"

typedef struct CUstream_st* cudaStream_t;

namespace flowmoe {
namespace cuda {

struct DeviceStatus;

namespace sm90 {

// D [m, n_out] (BF16, row-major) = for every expert e, rows offsets[e] .. offsets[e+1] - 1:
//   D_e = A_e [M_e, k_red] . B_e^T
// fprop (b_mn_major false): B = W [E * n_out, k_red], B_e its rows e * n_out ..;
// dgrad (b_mn_major true):  B = W [E * k_red, n_out] read as stored (D_e = dY_e . W_e, n_out = K,
//                           k_red = N): no transposed copy of the weights.
struct Bf16RowsArgs {
  const int32_t* offsets = nullptr;  // [num_experts + 1] on the device: 0 = o[0] <= ... <= o[E] <= m
  int num_experts = 0;               // 1 .. kMaxGroupedExperts
  int64_t m = 0;                     // rows of A and D (a capacity: rows past offsets[E] untouched)
  int64_t n_out = 0, k_red = 0;      // multiples of 128
  const bf16_t* a = nullptr;         // [m, k_red], 16-byte aligned
  const bf16_t* b = nullptr;         // as above, 16-byte aligned
  bool b_mn_major = false;
  // B where a model stores it: expert e's matrix [b_rows][b_cols] at b + e * b_rows * b_cols
  // (b_rows <= k_red and b_cols <= n_out MN-major, b_rows <= n_out and b_cols <= k_red K-major;
  // rows and columns past them read as zeros), else 0: the layer's [E * rows][cols].
  int64_t b_rows = 0, b_cols = 0;
  // (MN-major B) B's n_out columns are gate / up pairs (2 i, 2 i + 1): D's column i takes pair i's
  // gate and n_out / 2 + i its up (gpt-oss's gate_up_proj read where stored, h in the layer's order)
  bool split_gate_up = false;
  bf16_t* d = nullptr;               // [m, n_out], 16-byte aligned
  // Malformed offsets count once in status->bad_segments (may be null) and leave D untouched.
  DeviceStatus* status = nullptr;
};
// Why the kernel cannot take these arguments (shapes, limits, alignment), or null when it can.
const char* bf16_rows_unsupported(const Bf16RowsArgs& a);
// One kernel launch on `stream` (none when m is zero). Throws flowmoe::Error naming `what` when
// bf16_rows_unsupported says why, before anything is enqueued. No host synchronisation and no
// allocation: capturable in a CUDA graph.
void bf16_grouped_rows(const Bf16RowsArgs& a, const char* what, cudaStream_t stream);

// dW [E][n][k] FP32 (+)= per expert dY_e^T . X_e over its tokens offsets[e] .. offsets[e+1] - 1,
// dY [m, n] and X [m, k] read row-wise as the forward and dgrad wrote them (no transposed copies).
// Every offset a multiple of 128 (permute+pad with alignment 128: the padding rows are zero).
struct Bf16WgradArgs {
  const int32_t* offsets = nullptr;  // [num_experts + 1] on the device
  int num_experts = 0;               // 1 .. kMaxGroupedExperts
  int64_t m = 0;                     // token capacity: offsets[E] <= m
  int64_t n = 0, k = 0;              // multiples of 128
  const bf16_t* dy = nullptr;        // [m, n], 16-byte aligned
  const bf16_t* x = nullptr;         // [m, k], 16-byte aligned
  void* dw = nullptr;                // [E][n][k] FP32 (BF16 with out_bf16), 16-byte aligned
  bool accumulate = false;           // += into dw (empty experts untouched), else overwrite (empty: zeros)
  bool out_bf16 = false;             // dw is BF16, overwritten: each FP32 sum rounded once (RNE)
  // dW where a model stores the weight (gemm.h StoredDw; the caller swaps dy and x): [E][stored_rows]
  // [stored_cols] with stored_rows <= n, stored_cols <= k (rows a multiple of 16 bytes); interleaved:
  // x's columns are gate [0, k/2) and up [k/2, k), written alternating (k a multiple of 256).
  int64_t stored_rows = 0, stored_cols = 0;
  bool stored_interleaved = false;
  // Malformed offsets (not 0 = o[0] <= ... <= o[E] <= m, all multiples of 128) count once in
  // status->bad_segments (may be null) and leave dW untouched.
  DeviceStatus* status = nullptr;
};
const char* bf16_wgrad_unsupported(const Bf16WgradArgs& a);
// One kernel launch on `stream`, as bf16_grouped_rows.
void bf16_grouped_wgrad(const Bf16WgradArgs& a, const char* what, cudaStream_t stream);

}  // namespace sm90
}  // namespace cuda
}  // namespace flowmoe
