// Shared benchmark harness: checked CUDA calls, device allocation, and the median of CUDA-event
// timings after warm-up (METHOD: events around each call, many repetitions, median).
#pragma once

#include <cuda_runtime.h>

#include <algorithm>
#include <cstdio>
#include <cstdlib>
#include <functional>
#include <vector>

#define CK(x)                                                                                   \
  do {                                                                                          \
    cudaError_t e_ = (x);                                                                       \
    if (e_ != cudaSuccess) {                                                                    \
      std::fprintf(stderr, "%s:%d %s: %s\n", __FILE__, __LINE__, #x, cudaGetErrorString(e_));   \
      std::exit(1);                                                                             \
    }                                                                                           \
  } while (0)

namespace flowmoe {
namespace bench {

template <typename T>
T* dalloc(size_t n) {
  T* p = nullptr;
  CK(cudaMalloc(&p, std::max<size_t>(n, 1) * sizeof(T)));
  return p;
}

// Median time in microseconds of `reps` timed calls fn(rep), after `warmup` untimed calls.
inline float median_us(const std::function<void(int)>& fn, int reps, int warmup) {
  for (int i = 0; i < warmup; ++i) fn(i);
  CK(cudaDeviceSynchronize());
  std::vector<float> ms(reps);
  cudaEvent_t a, b;
  CK(cudaEventCreate(&a));
  CK(cudaEventCreate(&b));
  for (int i = 0; i < reps; ++i) {
    CK(cudaEventRecord(a));
    fn(i);
    CK(cudaEventRecord(b));
    CK(cudaEventSynchronize(b));
    CK(cudaEventElapsedTime(&ms[i], a, b));
  }
  CK(cudaGetLastError());
  CK(cudaEventDestroy(a));
  CK(cudaEventDestroy(b));
  std::sort(ms.begin(), ms.end());
  return ms[reps / 2] * 1000.0f;
}

}  // namespace bench
}  // namespace flowmoe
