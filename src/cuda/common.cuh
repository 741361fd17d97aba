// Shared device helpers and host-side launch checks for the CUDA backend.
#pragma once

#include <cuda_runtime.h>

#include <cstdint>
#include <mutex>
#include <vector>

#include "flowmoe/error.h"

#define FLOWMOE_CUDA_CHECK(expr)                                                           \
  do {                                                                                     \
    cudaError_t flowmoe_err_ = (expr);                                                     \
    if (flowmoe_err_ == cudaErrorMemoryAllocation) {                                       \
      (void)cudaGetLastError(); /* not left for the caller's next launch check */           \
      throw ::flowmoe::OutOfMemoryError(__FILE__, __LINE__,                                \
                                        std::string(#expr) + " failed: CUDA out of memory."); \
    }                                                                                      \
    if (flowmoe_err_ != cudaSuccess)                                                       \
      throw ::flowmoe::Error(__FILE__, __LINE__, std::string(#expr) + " failed: " +        \
                                                     cudaGetErrorString(flowmoe_err_));    \
  } while (0)

// After every launch: configuration errors surface here, with the kernel's name.
#define FLOWMOE_LAUNCH_CHECK(name)                                                         \
  do {                                                                                     \
    cudaError_t flowmoe_err_ = cudaGetLastError();                                         \
    if (flowmoe_err_ != cudaSuccess)                                                       \
      throw ::flowmoe::Error(__FILE__, __LINE__, std::string("launch of ") + (name) +      \
                                                     " failed: " +                         \
                                                     cudaGetErrorString(flowmoe_err_));    \
  } while (0)

namespace flowmoe {
namespace cuda {
namespace detail {

inline bool aligned16(const void* p) { return (reinterpret_cast<uintptr_t>(p) & 15u) == 0; }

// Blocks of a 1-D grid-stride launch over `items` with `per_block` items per block: at least 1,
// at most `cap` (the kernels loop over the rest).
inline unsigned grid_1d(int64_t items, int per_block, int64_t cap = 1 << 20) {
  int64_t g = (items + per_block - 1) / per_block;
  if (g < 1) g = 1;
  return static_cast<unsigned>(g < cap ? g : cap);
}
// Host check of a launcher's device-pointer argument (Error naming the argument and the call).
inline void check_ptr(const void* p, const char* name, const char* what) {
  FLOWMOE_CHECK(p != nullptr, what << ": " << name << " is null; expected a device buffer");
}

// Multiprocessors of the current device (an attribute query: cheap, not cached).
inline int device_sm_count() {
  int dev = 0, n = 0;
  FLOWMOE_CUDA_CHECK(cudaGetDevice(&dev));
  FLOWMOE_CUDA_CHECK(cudaDeviceGetAttribute(&n, cudaDevAttrMultiProcessorCount, dev));
  return n;
}

// The rows a row-wise kernel processes: m, or fewer when `bound` (a count on the device, e.g. an
// offsets[E] the host has not fetched) says so. m stays the row stride of [C/128][m] scale grids.
__device__ __forceinline__ int64_t bounded_rows(int64_t m, const int32_t* bound) {
  return bound ? min(m, static_cast<int64_t>(__ldg(bound))) : m;
}

// The last index i in [0, n) with a[i] <= v, for a non-decreasing a with a[0] <= v: the segment
// (expert) holding row or tile v when a holds the segments' first rows (tiles); empty segments,
// whose start equals the next one's, are never returned.
template <typename T, typename V>
__device__ __forceinline__ int last_at_or_below(const T* a, int n, V v) {
  int lo = 0, hi = n - 1;
  while (lo < hi) {
    const int mid = (lo + hi + 1) / 2;
    if (a[mid] <= v) lo = mid;
    else hi = mid - 1;
  }
  return lo;
}

// The SM count of the current device, after `setup()` has run once for that device (a kernel's
// shared-memory limit raised, say). Each call site's lambda is its own type, so each keeps its own
// per-device record. Thread-safe.
template <typename Setup>
int sm_count_after(Setup&& setup) {
  static std::mutex mu;
  static std::vector<int> sms;  // per device; 0: not yet set up
  int dev = 0;
  FLOWMOE_CUDA_CHECK(cudaGetDevice(&dev));
  std::lock_guard<std::mutex> lock(mu);
  if (int(sms.size()) <= dev) sms.resize(dev + 1, 0);
  if (sms[dev] == 0) {
    setup();
    sms[dev] = device_sm_count();
  }
  return sms[dev];
}

__device__ __forceinline__ float warp_max(float v, int width) {
  for (int o = width / 2; o > 0; o >>= 1) v = fmaxf(v, __shfl_xor_sync(0xffffffffu, v, o));
  return v;
}
__device__ __forceinline__ int warp_max_i(int v, int width) {
  for (int o = width / 2; o > 0; o >>= 1) v = max(v, __shfl_xor_sync(0xffffffffu, v, o));
  return v;
}
__device__ __forceinline__ int warp_sum_i(int v) {
  for (int o = 16; o > 0; o >>= 1) v += __shfl_xor_sync(0xffffffffu, v, o);
  return v;
}

// cp.async (sm_80 and later): 16 bytes from global to shared memory without passing through
// registers, zeros where !valid (the source is then not read); complete once a later
// cp_async_wait<N> leaves at most N of the thread's committed groups pending, visible then to the
// thread that issued it (to others after a barrier).
__device__ __forceinline__ void cp_async16_zfill(void* smem, const void* gmem, bool valid) {
  asm volatile("cp.async.cg.shared.global [%0], [%1], 16, %2;" ::"r"(static_cast<uint32_t>(__cvta_generic_to_shared(smem))),
               "l"(gmem), "r"(valid ? 16 : 0)
               : "memory");
}
__device__ __forceinline__ void cp_async_commit() { asm volatile("cp.async.commit_group;" ::: "memory"); }
template <int kPending>
__device__ __forceinline__ void cp_async_wait() {
  asm volatile("cp.async.wait_group %0;" ::"n"(kPending) : "memory");
}

// One atomic per warp for a counter (lane 0 adds the warp's total). All lanes must call.
__device__ __forceinline__ void warp_count(unsigned long long* counter, int v) {
  if (!__any_sync(0xffffffffu, v != 0)) return;  // the usual case: nothing to count
  v = warp_sum_i(v);
  if (counter && v && (threadIdx.x & 31) == 0) atomicAdd(counter, static_cast<unsigned long long>(v));
}

}  // namespace detail
}  // namespace cuda
}  // namespace flowmoe
