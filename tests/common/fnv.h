// FNV-1a (64-bit) over bytes: the digest of the MoE layer digest tests (tests/cpu/test_moe_digest.cpp,
// tests/cuda/test_moe_digest_gpu.cu), which hash the bits of outputs, gradients and report text.
#pragma once

#include <cstddef>
#include <cstdint>
#include <string>
#include <vector>

namespace flowmoe {
namespace testutil {

struct Fnv {
  uint64_t h = 1469598103934665603ull;
  void add(const void* p, size_t n) {
    const unsigned char* b = static_cast<const unsigned char*>(p);
    for (size_t i = 0; i < n; ++i) h = (h ^ b[i]) * 1099511628211ull;
  }
  template <typename T>
  void add(const std::vector<T>& v) { add(v.data(), v.size() * sizeof(T)); }
  void add(const std::string& s) { add(s.data(), s.size()); }
};

}  // namespace testutil
}  // namespace flowmoe
