// Shared parts of the router's two FP32 GEMM kernel headers (router_gemm_logits.cuh: z = x . Wr^T;
// router_gemm_backward.cuh: dWr and the dx combine): their contract and design, the cp.async and
// BF16 device helpers, and the chunk size of the previous 4x4-tile kernels. router_gemm.cuh
// includes both kernel headers.
//
// Contract (kernels.cuh, bit-identical to the CPU layer, src/cpu/moe/): every output is ONE chain of fmas
// in a fixed order, started from 0 -- z[t,e] over h = 0, 1, ..., H-1; dwr[e,h] over t = 0..T-1,
// then dwr = dwr + acc. No split of a sum, no padding term inside a chain (even fma(0, w, acc) is
// not an identity: it turns -0 into +0), so padding exists only along the output dimensions, whose
// results are never stored.
//
// Design (docs/MOE_GPU.md §3):
// - Operands are staged into shared memory with cp.async (16-byte copies, zero-filled out of
//   range), a ring of STAGES chunks (STAGES-1 chunks in flight while one is computed, one
//   __syncthreads per chunk). x stays BF16 in shared memory (half the shared-memory traffic of
//   FP32); each thread widens a value once (a shift or a mask) and uses it for all its outputs.
// - logits: a thread owns TM tokens x TN experts; the lanes of a warp are LE expert lanes x
//   (32/LE) token lanes (token lane = low bits, so lane pairs read the same w). Per 8 h a thread
//   loads TM x 16 B of x (8 BF16 of one token) and TN x 32 B of w. Staged rows are padded to an
//   odd number of 16-byte units, so the 8 rows a quarter warp reads are on distinct banks.
// - dwr: a thread owns TE experts x 4 consecutive h; lane bit 0 = expert lane, lanes 1..4 = h
//   groups (a warp: 2*TE experts x 64 h); warps WE along experts x WH along h. Per token a thread
//   loads 8 B of x (4 BF16) and TE floats of dz; the chunk's token loop is cut at T (no padding
//   terms).
// - The linear block index runs over the expert blocks fastest, so the CTAs that read the same x
//   rows (logits) or x columns (dwr) run together and share them in L2.
#pragma once

#include <cuda_runtime.h>

#include <cstdint>

#include "cuda/common.cuh"
#include "flowmoe/numerics.h"
#include "flowmoe/swiglu_math.h"
#include "flowmoe/tensor.h"

namespace flowmoe {
namespace cuda {
namespace moe {
namespace router_gemm {
namespace {  // internal linkage: each including translation unit owns its instantiations

// ---- small device helpers ---------------------------------------------------------------------
__device__ __forceinline__ void cp_async16(void* smem, const void* gmem, bool valid) {
  const unsigned s = static_cast<unsigned>(__cvta_generic_to_shared(smem));
  const int n = valid ? 16 : 0;  // 0: nothing is read, the 16 bytes are zero-filled
  asm volatile("cp.async.cg.shared.global [%0], [%1], 16, %2;\n" ::"r"(s), "l"(gmem), "r"(n) : "memory");
}
__device__ __forceinline__ void cp_async4(void* smem, const void* gmem, bool valid) {
  const unsigned s = static_cast<unsigned>(__cvta_generic_to_shared(smem));
  const int n = valid ? 4 : 0;
  asm volatile("cp.async.ca.shared.global [%0], [%1], 4, %2;\n" ::"r"(s), "l"(gmem), "r"(n) : "memory");
}
__device__ __forceinline__ void cp_async_commit() { asm volatile("cp.async.commit_group;\n" ::: "memory"); }
template <int N>
__device__ __forceinline__ void cp_async_wait() {
  asm volatile("cp.async.wait_group %0;\n" ::"n"(N) : "memory");
}
// BF16 -> FP32, exact (num::bf16_to_f32) on one half of a 32-bit word: element 2q (low) or 2q+1.
__device__ __forceinline__ float bf16_lo(uint32_t w) { return __uint_as_float(w << 16); }
__device__ __forceinline__ float bf16_hi(uint32_t w) { return __uint_as_float(w & 0xFFFF0000u); }
__device__ __forceinline__ uint32_t word_of(const uint4& v, int q) {
  return q == 0 ? v.x : q == 1 ? v.y : q == 2 ? v.z : v.w;
}
__device__ __forceinline__ float comp_of(const float4& v, int q) {
  return q == 0 ? v.x : q == 1 ? v.y : q == 2 ? v.z : v.w;
}

// The previous 4x4-tile kernels (tiled_*, the fallback and benchmark baseline) stage chunks of 32
// of the contraction in shared memory with scalar loads.
constexpr int kTiledChunk = 32;

}  // namespace
}  // namespace router_gemm
}  // namespace moe
}  // namespace cuda
}  // namespace flowmoe
