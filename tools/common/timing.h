// The one timing harness of the programs that time flowmoe: the kernel benchmarks (bench/*.cu,
// through bench/bench_util.cuh), the expert-parallel benchmark (bench/ep/) and `flowmoe bench`
// (tools/flowmoe/cmd_bench.cpp) time with it. It lives in tools/common/, the folder of helpers
// that tools/ and bench/ share (docs/ARCHITECTURE.md §1, layer 7); it includes public headers only.
//   time_events   a call timed by CUDA events, `reps` times after `warmup` untimed calls: median,
//                 minimum and (optionally) the host's enqueue time;
//   time_phases   a step of consecutive phases (forward, backward) timed by events between the
//                 phases, each step optionally after a host hook (a barrier across ranks);
//   median        of a sample;
//   copy_ceiling_gbs  the device-to-device copy bandwidth, measured in the same run as the kernels
//                 it is the ceiling of; gb_per_s / percent_of for the ratio columns.
// Host code only (CUDA runtime API): usable from .cpp files. CUDA errors throw flowmoe::Error.
#pragma once

#include <cuda_runtime.h>

#include <algorithm>
#include <chrono>
#include <cstddef>
#include <cstdio>
#include <functional>
#include <vector>

#include "flowmoe/error.h"

#define FLOWMOE_TIMING_CUDA(expr)                                                           \
  do {                                                                                      \
    const cudaError_t e_ = (expr);                                                          \
    FLOWMOE_CHECK(e_ == cudaSuccess, #expr << ": " << cudaGetErrorString(e_));              \
  } while (0)

namespace flowmoe {
namespace bench {

inline double host_now_ms() {
  return std::chrono::duration<double, std::milli>(std::chrono::steady_clock::now().time_since_epoch()).count();
}

// The median of a sample (the mean of the two middle values for an even count; 0 when empty).
inline double median(std::vector<double> v) {
  if (v.empty()) return 0;
  std::sort(v.begin(), v.end());
  const size_t n = v.size();
  return n % 2 ? v[n / 2] : 0.5 * (v[n / 2 - 1] + v[n / 2]);
}

// CUDA events created together and destroyed with the object.
class Events {
 public:
  explicit Events(size_t n) : ev_(n, nullptr) {
    for (cudaEvent_t& e : ev_) FLOWMOE_TIMING_CUDA(cudaEventCreate(&e));
  }
  ~Events() {
    for (cudaEvent_t e : ev_) cudaEventDestroy(e);
  }
  Events(const Events&) = delete;
  Events& operator=(const Events&) = delete;
  void record(size_t i, cudaStream_t s) { FLOWMOE_TIMING_CUDA(cudaEventRecord(ev_[i], s)); }
  void synchronize(size_t i) { FLOWMOE_TIMING_CUDA(cudaEventSynchronize(ev_[i])); }
  float ms(size_t from, size_t to) {
    float t = 0;
    FLOWMOE_TIMING_CUDA(cudaEventElapsedTime(&t, ev_[from], ev_[to]));
    return t;
  }

 private:
  std::vector<cudaEvent_t> ev_;
};

struct Timing {
  float us = 0;       // median event time, microseconds (the upper middle value for an even count)
  float min_us = 0;   // fastest repetition
  float host_us = 0;  // median host time to enqueue one call (with host_time only)
};

// fn(0 .. warmup-1) untimed, then (stream, or the whole device, synchronized) fn(0 .. reps-1),
// each between two events on `stream` and waited for before the next.
inline Timing time_events(const std::function<void(int)>& fn, int reps, int warmup, cudaStream_t stream = nullptr,
                          bool host_time = false) {
  FLOWMOE_CHECK(reps > 0, "time_events: reps is " << reps << "; expected at least 1");
  for (int i = 0; i < warmup; ++i) fn(i);
  if (stream)
    FLOWMOE_TIMING_CUDA(cudaStreamSynchronize(stream));
  else
    FLOWMOE_TIMING_CUDA(cudaDeviceSynchronize());
  std::vector<float> t(reps), h(reps, 0.0f);
  Events ev(2);
  for (int i = 0; i < reps; ++i) {
    ev.record(0, stream);
    if (host_time) {
      const auto h0 = std::chrono::steady_clock::now();
      fn(i);
      const auto h1 = std::chrono::steady_clock::now();
      h[i] = std::chrono::duration<float, std::micro>(h1 - h0).count();
    } else {
      fn(i);
    }
    ev.record(1, stream);
    ev.synchronize(1);
    t[i] = ev.ms(0, 1);
  }
  FLOWMOE_TIMING_CUDA(cudaGetLastError());
  std::sort(t.begin(), t.end());
  std::sort(h.begin(), h.end());
  return {t[reps / 2] * 1000.0f, t[0] * 1000.0f, h[reps / 2]};
}

// Per-repetition samples of time_phases (warm-up steps dropped).
struct PhaseTimes {
  std::vector<std::vector<double>> ms;       // [phase][rep] event time of the phase
  std::vector<double> total_ms;              // [rep] sum of the phases
  std::vector<std::vector<double>> host_ms;  // [phase][rep] host time to enqueue the phase
  std::vector<double> step_host_ms;          // [rep] host time from the first event to the last one's completion
};

// `warmup + reps` steps; each: before() (untimed, e.g. a barrier), an event, then per phase the
// phase and an event, all on `stream`; after() (e.g. the communicator's synchronize); then the
// last event is waited for. The first `warmup` steps are timed the same way and dropped.
inline PhaseTimes time_phases(const std::vector<std::function<void()>>& phases, int warmup, int reps,
                              cudaStream_t stream, const std::function<void()>& before = {},
                              const std::function<void()>& after = {}) {
  const size_t np = phases.size();
  PhaseTimes r;
  r.ms.resize(np);
  r.host_ms.resize(np);
  Events ev(np + 1);
  for (int i = 0; i < warmup + reps; ++i) {
    if (before) before();
    const double h0 = host_now_ms();
    ev.record(0, stream);
    std::vector<double> hp(np);
    for (size_t p = 0; p < np; ++p) {
      const double hp0 = host_now_ms();
      phases[p]();
      hp[p] = host_now_ms() - hp0;
      ev.record(p + 1, stream);
    }
    if (after) after();
    ev.synchronize(np);
    const double h1 = host_now_ms() - h0;
    if (i < warmup) continue;
    double total = 0;
    for (size_t p = 0; p < np; ++p) {
      const float t = ev.ms(p, p + 1);
      r.ms[p].push_back(t);
      r.host_ms[p].push_back(hp[p]);
      total += double(t);
    }
    r.total_ms.push_back(total);
    r.step_host_ms.push_back(h1);
  }
  return r;
}

inline double gb_per_s(double bytes, double us) { return bytes / (us * 1e3); }
inline double percent_of(double value, double ceiling) { return 100.0 * value / ceiling; }

// The copy ceiling: cudaMemcpyAsync device to device of `bytes` on the default stream, timed as
// time_events times a kernel; GB/s counting the bytes read and written. Prints one line.
inline double copy_ceiling_gbs(size_t bytes, int reps, int warmup) {
  char *a = nullptr, *b = nullptr;
  FLOWMOE_TIMING_CUDA(cudaMalloc(&a, bytes));
  FLOWMOE_TIMING_CUDA(cudaMalloc(&b, bytes));
  FLOWMOE_TIMING_CUDA(cudaMemset(a, 1, bytes));
  const float us = time_events(
      [&](int) { FLOWMOE_TIMING_CUDA(cudaMemcpyAsync(b, a, bytes, cudaMemcpyDeviceToDevice)); }, reps, warmup).us;
  const double gbs = gb_per_s(2.0 * bytes, us);
  std::printf("copy ceiling: cudaMemcpy D2D %.0f MB in %.1f us = %.0f GB/s (read + write)\n", bytes / 1e6, us, gbs);
  cudaFree(a);
  cudaFree(b);
  return gbs;
}

}  // namespace bench
}  // namespace flowmoe
