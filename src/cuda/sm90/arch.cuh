// Shared sm_90a building blocks (Hopper): what every sm90 kernel of flowmoe includes first.
//
// The instructions of src/cuda/sm90/*.cuh exist only on sm_90a (the "a" feature set: WGMMA,
// setmaxnreg, TMA multicast). FLOWMOE_SM90A is defined in the device pass that compiles for it
// (the CMake build always does); a kernel body guards its use of these wrappers with it and traps
// otherwise, so a build without sm_90a never gives a silent wrong answer.
#pragma once

#include <cuda_runtime.h>

#include <cstdint>

#if defined(__CUDA_ARCH__) && (__CUDA_ARCH__ >= 900) && defined(__CUDA_ARCH_FEAT_SM90_ALL)
#define FLOWMOE_SM90A 1
#endif

namespace flowmoe {
namespace cuda {
namespace sm90 {

// The 32-bit shared-state-space address of a generic pointer into shared memory.
__device__ __forceinline__ uint32_t smem_u32(const void* p) {
  return static_cast<uint32_t>(__cvta_generic_to_shared(p));
}

#ifdef FLOWMOE_SM90A
// Shared-memory loads at a shared-state-space address (LDS: a generic pointer into shared memory
// that the compiler cannot prove shared becomes a slower generic load). Volatile: they stay after
// the barrier wait that makes the data valid.
__device__ __forceinline__ float lds_f32(uint32_t addr) {
  float v;
  asm volatile("ld.shared.f32 %0, [%1];" : "=f"(v) : "r"(addr));
  return v;
}
__device__ __forceinline__ float2 lds_f32x2(uint32_t addr) {
  float2 v;
  asm volatile("ld.shared.v2.f32 {%0, %1}, [%2];" : "=f"(v.x), "=f"(v.y) : "r"(addr));
  return v;
}
// Barrier `id` (1..15; 0 is __syncthreads) among `count` threads (a multiple of 32).
__device__ __forceinline__ void named_sync(int id, int count) {
  asm volatile("bar.sync %0, %1;" ::"r"(id), "r"(count) : "memory");
}
// Warp-specialised register budgets: a warpgroup gives registers back (producers) or takes them
// (consumers); every warp of the warpgroup executes it.
template <int kRegs>
__device__ __forceinline__ void warpgroup_reg_dealloc() {
  asm volatile("setmaxnreg.dec.sync.aligned.u32 %0;" ::"n"(kRegs));
}
template <int kRegs>
__device__ __forceinline__ void warpgroup_reg_alloc() {
  asm volatile("setmaxnreg.inc.sync.aligned.u32 %0;" ::"n"(kRegs));
}
#endif  // FLOWMOE_SM90A

}  // namespace sm90
}  // namespace cuda
}  // namespace flowmoe
