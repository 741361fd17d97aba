// Memory-ordering fences between the generic proxy (ordinary loads and stores) and the async
// proxy (TMA, bulk copies, WGMMA operands) on sm_90.
#pragma once

#include "cuda/sm90/arch.cuh"

namespace flowmoe {
namespace cuda {
namespace sm90 {

#ifdef FLOWMOE_SM90A
// Shared-memory writes of this thread become visible to later async-proxy reads (a TMA store or
// reduce from shared memory, a WGMMA operand).
__device__ __forceinline__ void fence_async_smem() { asm volatile("fence.proxy.async.shared::cta;" ::: "memory"); }
// Barrier initialisations (mbar_init) become visible to the async proxy and the cluster.
__device__ __forceinline__ void fence_mbarrier_init() {
  asm volatile("fence.mbarrier_init.release.cluster;" ::: "memory");
}
#endif  // FLOWMOE_SM90A

}  // namespace sm90
}  // namespace cuda
}  // namespace flowmoe
