// Device buffers for the GPU tests, without GoogleTest (tests/nccl uses them too):
//   DBuf<T>      n elements on the default stream, every byte poisoned (0xA5 unless told), so a
//                kernel that leaves an element unwritten shows; optionally `offset` elements into
//                the allocation (offset 1 makes it unaligned for 16-byte accesses).
//   StreamBuf<T> n elements owned by one thread, copied on that thread's stream, zeroed.
// The GoogleTest helpers (device checks, bit comparisons, random data) are in gpu_test_util.h.
#pragma once

#include <cuda_runtime.h>

#include <algorithm>
#include <cstddef>
#include <stdexcept>
#include <vector>

namespace flowmoe {
namespace testutil {

constexpr unsigned char kPoisonByte = 0xA5;

template <typename T>
struct DBuf {
  T* base = nullptr;  // the allocation
  T* p = nullptr;     // the buffer: base + offset
  size_t n = 0;
  explicit DBuf(size_t count, size_t offset = 0, unsigned char poison_byte = kPoisonByte) : n(count) {
    const size_t bytes = (count + offset + 1) * sizeof(T);
    if (cudaMalloc(&base, bytes) != cudaSuccess) throw std::runtime_error("cudaMalloc");
    cudaMemset(base, poison_byte, bytes);
    p = base + offset;
  }
  DBuf(const std::vector<T>& h, size_t offset = 0) : DBuf(h.size(), offset) { put(h); }
  ~DBuf() { cudaFree(base); }
  DBuf(const DBuf&) = delete;
  DBuf& operator=(const DBuf&) = delete;
  void put(const std::vector<T>& h) { cudaMemcpy(p, h.data(), h.size() * sizeof(T), cudaMemcpyHostToDevice); }
  // The first `count` elements, after every stream of the device finished.
  std::vector<T> get(size_t count) const {
    std::vector<T> h(count);
    cudaDeviceSynchronize();
    cudaMemcpy(h.data(), p, count * sizeof(T), cudaMemcpyDeviceToHost);
    return h;
  }
  std::vector<T> get() const { return get(n); }
};

template <typename T>
struct StreamBuf {
  T* p = nullptr;
  size_t n = 0;
  StreamBuf(size_t count, cudaStream_t s, const T* host = nullptr) : n(count) {
    const size_t bytes = std::max<size_t>(count, 1) * sizeof(T);
    if (cudaMalloc(&p, bytes) != cudaSuccess) throw std::runtime_error("cudaMalloc");
    if (host)
      cudaMemcpyAsync(p, host, count * sizeof(T), cudaMemcpyHostToDevice, s);
    else
      cudaMemsetAsync(p, 0, bytes, s);
    cudaStreamSynchronize(s);
  }
  ~StreamBuf() { cudaFree(p); }
  StreamBuf(const StreamBuf&) = delete;
  StreamBuf& operator=(const StreamBuf&) = delete;
  std::vector<T> get(cudaStream_t s) const {
    std::vector<T> h(n);
    cudaStreamSynchronize(s);
    cudaMemcpyAsync(h.data(), p, n * sizeof(T), cudaMemcpyDeviceToHost, s);
    cudaStreamSynchronize(s);
    return h;
  }
};

}  // namespace testutil
}  // namespace flowmoe
