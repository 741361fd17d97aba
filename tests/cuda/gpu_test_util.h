// What every GPU test file needs (tests/cuda/*.cu, CTest label `gpu`):
//   device checks   have_device(), is_sm90(); REQUIRE_DEVICE() / REQUIRE_SM90() skip the test
//                   without one; ASSERT_CUDA_OK(call) fails it when a CUDA call fails;
//   device buffers  DBuf, StreamBuf (device_buffer.h);
//   random data     normal_f32 / normal_bf16 (std::mt19937, reproducible from a seed);
//   bit comparisons expect_same_bits / same_bits (element bits, reporting the count and the first
//                   difference), rel_rms (relative RMS difference, for tolerance checks).
#pragma once

#include <cuda_runtime.h>
#include <gtest/gtest.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <functional>
#include <random>
#include <sstream>
#include <stdexcept>
#include <string>
#include <vector>

#include "cuda/device_buffer.h"
#include "flowmoe/cuda/status.h"
#include "flowmoe/error.h"
#include "flowmoe/numerics.h"
#include "flowmoe/recipe.h"
#include "flowmoe/tensor.h"  // bf16_t

namespace flowmoe {
namespace testutil {

// A gtest parameter name of a recipe, optionally with "_sync_free": "flow_fp4", "bf16_sync_free".
inline std::string recipe_param_name(Recipe r, bool sync_free = false) {
  std::string n = recipe_name(r);
  for (char& c : n)
    if (c == '-') c = '_';
  return n + (sync_free ? "_sync_free" : "");
}

// A DeviceStatus in managed memory, zeroed: kernels count into it, the test reads it after a sync.
struct ManagedStatus {
  cuda::DeviceStatus* p = nullptr;
  ManagedStatus() {
    if (cudaMallocManaged(&p, sizeof(*p)) != cudaSuccess) throw std::runtime_error("cudaMallocManaged");
    *p = cuda::DeviceStatus{};
  }
  ~ManagedStatus() { cudaFree(p); }
  ManagedStatus(const ManagedStatus&) = delete;
  ManagedStatus& operator=(const ManagedStatus&) = delete;
};

// ---- device checks ----------------------------------------------------------------------------
inline bool have_device() {
  int n = 0;
  return cudaGetDeviceCount(&n) == cudaSuccess && n > 0;
}
inline bool is_sm90() {
  int dev = 0, major = 0;
  cudaGetDevice(&dev);
  cudaDeviceGetAttribute(&major, cudaDevAttrComputeCapabilityMajor, dev);
  return major == 9;
}

#define REQUIRE_DEVICE()                                                                 \
  do {                                                                                   \
    if (!::flowmoe::testutil::have_device()) GTEST_SKIP() << "no CUDA device";           \
  } while (0)
#define REQUIRE_SM90()                                                                          \
  do {                                                                                          \
    REQUIRE_DEVICE();                                                                           \
    if (!::flowmoe::testutil::is_sm90()) GTEST_SKIP() << "FP8 block-scaled cuBLASLt modes need sm_90 (Hopper)"; \
  } while (0)
#define ASSERT_CUDA_OK(call) ASSERT_EQ((call), cudaSuccess) << #call

// ---- random data ------------------------------------------------------------------------------
inline std::vector<float> normal_f32(size_t n, float sd, std::mt19937& rng) {
  std::normal_distribution<float> d(0.0f, sd);
  std::vector<float> v(n);
  for (float& x : v) x = d(rng);
  return v;
}
inline std::vector<float> normal_f32(size_t n, float sd, uint32_t seed) {
  std::mt19937 rng(seed);
  return normal_f32(n, sd, rng);
}
// FP32 normal values rounded to BF16.
inline std::vector<bf16_t> normal_bf16(size_t n, float sd, std::mt19937& rng) {
  const std::vector<float> f = normal_f32(n, sd, rng);
  std::vector<bf16_t> v(n);
  for (size_t i = 0; i < n; ++i) v[i] = num::f32_to_bf16(f[i]);
  return v;
}
inline std::vector<bf16_t> normal_bf16(size_t n, float sd, uint32_t seed) {
  std::mt19937 rng(seed);
  return normal_bf16(n, sd, rng);
}

// ---- bit comparisons --------------------------------------------------------------------------
struct BitDiff {
  size_t count = 0;  // elements whose bits differ
  size_t first = 0;  // the first of them (when count > 0)
};
template <typename T>
BitDiff bit_diff(const T* a, const T* b, size_t n) {
  BitDiff d;
  for (size_t i = 0; i < n; ++i)
    if (std::memcmp(&a[i], &b[i], sizeof(T)) != 0 && d.count++ == 0) d.first = i;
  return d;
}
// "0x<bits>", and the value for FP32.
template <typename T>
std::string describe_bits(const T& v) {
  uint64_t bits = 0;
  std::memcpy(&bits, &v, sizeof(T) < sizeof(bits) ? sizeof(T) : sizeof(bits));
  std::ostringstream s;
  s << "0x" << std::hex << bits;
  return s.str();
}
template <>
inline std::string describe_bits<float>(const float& v) {
  uint32_t bits = 0;
  std::memcpy(&bits, &v, 4);
  std::ostringstream s;
  s << v << " (0x" << std::hex << bits << ")";
  return s.str();
}
template <typename T>
std::string describe_diff(const BitDiff& d, size_t n, const T& want, const T& got) {
  std::ostringstream s;
  s << d.count << " of " << n << " elements differ; first at " << d.first << " (want " << describe_bits(want)
    << ", got " << describe_bits(got) << ")";
  return s.str();
}

// Every element of `got` has the bits of `want`; the sizes must match.
template <typename T>
void expect_same_bits(const std::vector<T>& want, const std::vector<T>& got, const std::string& what) {
  ASSERT_EQ(want.size(), got.size()) << what;
  const BitDiff d = bit_diff(want.data(), got.data(), want.size());
  EXPECT_EQ(d.count, 0u) << what << ": "
                         << (d.count ? describe_diff(d, want.size(), want[d.first], got[d.first]) : "");
}
// The first `n` elements of `got` have the bits of `want`'s.
template <typename T>
void expect_same_bits(const std::vector<T>& want, const std::vector<T>& got, size_t n, const std::string& what) {
  ASSERT_GE(want.size(), n) << what;
  ASSERT_GE(got.size(), n) << what;
  const BitDiff d = bit_diff(want.data(), got.data(), n);
  EXPECT_EQ(d.count, 0u) << what << ": " << (d.count ? describe_diff(d, n, want[d.first], got[d.first]) : "");
}
// The same as an assertion result, for EXPECT_TRUE(same_bits(a, b)) << ...
template <typename T>
::testing::AssertionResult same_bits(const std::vector<T>& a, const std::vector<T>& b) {
  if (a.size() != b.size()) return ::testing::AssertionFailure() << "sizes " << a.size() << " vs " << b.size();
  const BitDiff d = bit_diff(a.data(), b.data(), a.size());
  if (d.count) return ::testing::AssertionFailure() << describe_diff(d, a.size(), a[d.first], b[d.first]);
  return ::testing::AssertionSuccess();
}

// ---- tolerances -------------------------------------------------------------------------------
inline double to_double(double v) { return v; }
inline double to_double(float v) { return v; }
inline double to_double(bf16_t v) { return num::bf16_to_f32(v); }
// ||got - want|| / ||want|| over the common length (the absolute RMS norm when want is zero).
template <typename T>
double rel_rms(const std::vector<T>& got, const std::vector<T>& want) {
  double num = 0, den = 0;
  for (size_t i = 0; i < got.size() && i < want.size(); ++i) {
    const double g = to_double(got[i]), w = to_double(want[i]);
    num += (g - w) * (g - w);
    den += w * w;
  }
  return den > 0 ? std::sqrt(num / den) : std::sqrt(num);
}

// `fn` throws flowmoe::Error (or a subclass) whose message mentions `needle`.
inline void expect_error(const std::function<void()>& fn, const std::string& needle) {
  try {
    fn();
    ADD_FAILURE() << "expected an error mentioning \"" << needle << "\"";
  } catch (const flowmoe::Error& e) {
    EXPECT_NE(std::string(e.what()).find(needle), std::string::npos) << e.what();
  }
}

// W1's gate / up block interleaving on the host (flowmoe/gemm.h interleave_gate_up): per expert,
// of `blocks` units of `unit` bytes (a 128-row block of codes, or its row of scales), unit b goes
// to 2 b (the gate half, b < blocks / 2) or 2 (b - blocks / 2) + 1 (the up half).
inline std::vector<uint8_t> gate_up_interleaved(const std::vector<uint8_t>& v, int experts, int64_t blocks,
                                                int64_t unit) {
  std::vector<uint8_t> out(v.size());
  for (int e = 0; e < experts; ++e)
    for (int64_t b = 0; b < blocks; ++b) {
      const int64_t to = b < blocks / 2 ? 2 * b : 2 * (b - blocks / 2) + 1;
      std::copy_n(v.begin() + (e * blocks + b) * unit, unit, out.begin() + (e * blocks + to) * unit);
    }
  return out;
}

}  // namespace testutil
}  // namespace flowmoe
