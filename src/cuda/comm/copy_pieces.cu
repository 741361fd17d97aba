// Batched copy (flowmoe/cuda/copy_pieces.h): the pieces of one launch travel as a __grid_constant__ kernel
// parameter (up to 32 KB of parameters on sm_70+ with CUDA >= 12.1). Each piece is cut into units
// of kUnitBytes; blocks take units round-robin, find their piece by binary search over the units'
// prefix, and copy with the widest access the piece's two addresses allow (16, 8, 4 or 1 bytes),
// the sub-width tail byte by byte. A piece without a source is a zero fill.
#include "flowmoe/cuda/copy_pieces.h"

#include <algorithm>

#include "cuda/common.cuh"

namespace flowmoe {
namespace cuda {
namespace comm {
namespace {

constexpr int kMaxPieces = 960;           // 960 * 32 B + 8 B < 32764 B of parameters
constexpr int64_t kUnitBytes = 32 * 1024;
constexpr int kThreads = 256;

struct PieceBatch {
  const uint8_t* src[kMaxPieces];
  uint8_t* dst[kMaxPieces];
  int64_t bytes[kMaxPieces];
  int64_t first_unit[kMaxPieces];  // units before piece i; total units in `units`
  int64_t units;
  int n;
};
static_assert(sizeof(PieceBatch) <= 32764, "kernel parameters are limited to 32764 bytes");

template <typename W>
__device__ __forceinline__ void copy_words(const uint8_t* __restrict__ s, uint8_t* __restrict__ d,
                                           int64_t len) {
  const int64_t words = len / int64_t(sizeof(W));
  const W* sw = reinterpret_cast<const W*>(s);
  W* dw = reinterpret_cast<W*>(d);
  for (int64_t i = threadIdx.x; i < words; i += blockDim.x) dw[i] = sw[i];
  for (int64_t i = words * int64_t(sizeof(W)) + threadIdx.x; i < len; i += blockDim.x) d[i] = s[i];
}

template <typename W>
__device__ __forceinline__ void zero_words(uint8_t* __restrict__ d, int64_t len) {
  const int64_t words = len / int64_t(sizeof(W));
  W z;
  memset(&z, 0, sizeof(W));
  W* dw = reinterpret_cast<W*>(d);
  for (int64_t i = threadIdx.x; i < words; i += blockDim.x) dw[i] = z;
  for (int64_t i = words * int64_t(sizeof(W)) + threadIdx.x; i < len; i += blockDim.x) d[i] = 0;
}

__global__ void __launch_bounds__(kThreads) copy_pieces_kernel(const __grid_constant__ PieceBatch b) {
  for (int64_t u = blockIdx.x; u < b.units; u += gridDim.x) {
    int lo = 0, hi = b.n - 1;  // the last piece whose first unit is <= u (no empty pieces)
    while (lo < hi) {
      const int mid = (lo + hi + 1) >> 1;
      if (b.first_unit[mid] <= u) lo = mid; else hi = mid - 1;
    }
    const int64_t off = (u - b.first_unit[lo]) * kUnitBytes;
    const int64_t len = min(kUnitBytes, b.bytes[lo] - off);
    uint8_t* d = b.dst[lo] + off;
    if (b.src[lo] == nullptr) {  // a zero fill
      const uintptr_t a = reinterpret_cast<uintptr_t>(d);
      if ((a & 15u) == 0) zero_words<uint4>(d, len);
      else if ((a & 3u) == 0) zero_words<uint32_t>(d, len);
      else zero_words<uint8_t>(d, len);
      continue;
    }
    const uint8_t* s = b.src[lo] + off;
    const uintptr_t a = reinterpret_cast<uintptr_t>(s) | reinterpret_cast<uintptr_t>(d);
    if ((a & 15u) == 0) copy_words<uint4>(s, d, len);
    else if ((a & 7u) == 0) copy_words<uint2>(s, d, len);
    else if ((a & 3u) == 0) copy_words<uint32_t>(s, d, len);
    else copy_words<uint8_t>(s, d, len);
  }
}

}  // namespace

void copy_pieces(const std::vector<CopyPiece>& pieces, cudaStream_t stream) {
  if (pieces.empty()) return;
  const int sms = detail::device_sm_count();
  PieceBatch b;
  b.n = 0;
  b.units = 0;
  auto launch = [&] {
    if (b.n == 0) return;
    const int64_t grid = std::min<int64_t>(b.units, int64_t(sms) * 16);
    copy_pieces_kernel<<<static_cast<unsigned>(grid), kThreads, 0, stream>>>(b);
    FLOWMOE_LAUNCH_CHECK("comm::copy_pieces_kernel");
    b.n = 0;
    b.units = 0;
  };
  for (const CopyPiece& p : pieces) {
    FLOWMOE_CHECK(p.bytes >= 0 && (p.bytes == 0 || p.dst),
                  "cuda::comm::copy_pieces: bad piece (" << p.bytes
                                                         << " bytes); expected a destination buffer");
    if (p.bytes == 0) continue;
    if (b.n == kMaxPieces) launch();
    b.src[b.n] = static_cast<const uint8_t*>(p.src);
    b.dst[b.n] = static_cast<uint8_t*>(p.dst);
    b.bytes[b.n] = p.bytes;
    b.first_unit[b.n] = b.units;
    b.units += (p.bytes + kUnitBytes - 1) / kUnitBytes;
    ++b.n;
  }
  launch();
}

}  // namespace comm
}  // namespace cuda
}  // namespace flowmoe
