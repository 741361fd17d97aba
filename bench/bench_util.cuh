// What every kernel benchmark (bench/*.cu) shares: checked CUDA calls (CK: print and exit),
// device allocation, the device check, ragged expert segments, and the timing harness of tools/common/timing.h (CUDA events around each call after
// warm-up, many repetitions, median; the copy ceiling measured in the same run).
#pragma once

#include <cuda_runtime.h>

#include <algorithm>
#include <cstdio>
#include <cstdint>
#include <cstdlib>
#include <functional>
#include <random>
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

// Device 0's properties; false (after saying so on stderr) when there is no CUDA device.
inline bool device_properties(const char* program, cudaDeviceProp* prop) {
  int ndev = 0;
  if (cudaGetDeviceCount(&ndev) != cudaSuccess || ndev == 0) {
    std::fprintf(stderr, "%s: no CUDA device\n", program);
    return false;
  }
  CK(cudaGetDeviceProperties(prop, 0));
  return true;
}

// Rows per expert for `e` experts and `m` rows in all: random weights in [0.5, 1.5) from `seed`,
// every count but the last a multiple of `align`, the last taking the rest.
inline std::vector<int32_t> ragged_counts(int e, int64_t m, uint32_t seed, int align) {
  std::mt19937 rng(seed);
  std::vector<double> w(e);
  for (auto& v : w) v = 0.5 + std::uniform_real_distribution<double>(0, 1)(rng);
  double s = 0;
  for (double v : w) s += v;
  std::vector<int32_t> c(e);
  int64_t left = m;
  for (int i = 0; i < e - 1; ++i) {
    c[i] = static_cast<int32_t>(std::min<int64_t>(left, static_cast<int64_t>(m * w[i] / s) / align * align));
    left -= c[i];
  }
  c[e - 1] = static_cast<int32_t>(left);
  return c;
}

// Median time in microseconds of `reps` timed calls fn(rep) on the default stream, after `warmup`
// untimed calls (time_events).
inline float median_us(const std::function<void(int)>& fn, int reps, int warmup) {
  return time_events(fn, reps, warmup).us;
}

}  // namespace bench
}  // namespace flowmoe
