// What every kernel benchmark (bench/*.cu) shares: checked CUDA calls (CK: print and exit),
// device allocation, and the timing harness of bench/timing.h (CUDA events around each call after
// warm-up, many repetitions, median; the copy ceiling measured in the same run).
#pragma once

#include <cuda_runtime.h>

#include <algorithm>
#include <cstdio>
#include <cstdlib>
#include <functional>
#include <vector>

#include "timing.h"

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

// Median time in microseconds of `reps` timed calls fn(rep) on the default stream, after `warmup`
// untimed calls (time_events).
inline float median_us(const std::function<void(int)>& fn, int reps, int warmup) {
  return time_events(fn, reps, warmup).us;
}

}  // namespace bench
}  // namespace flowmoe
