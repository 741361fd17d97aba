// Per-expert token segments -> 128-token blocks, resolved on the device (no host sync).
#include "cuda/common.cuh"
#include "flowmoe/cuda/convert.h"

namespace flowmoe {
namespace cuda {
namespace {

constexpr int kScanThreads = 1024;

// One CTA: validate the offsets, scan the per-segment block counts, then give every block slot
// its token range. Blocks past the real count get start = end = -1.
__global__ void __launch_bounds__(kScanThreads)
build_segment_blocks_kernel(const int32_t* __restrict__ offsets, int num_segments, int64_t m,
                            int64_t max_blocks, int32_t* __restrict__ block_start,
                            int32_t* __restrict__ block_end, int32_t* __restrict__ block_offsets,
                            unsigned long long* bad_segments, bool capacity) {
  __shared__ int s_ok;
  __shared__ int s_scan[kScanThreads];
  __shared__ int s_carry;
  const int tid = threadIdx.x;
  if (tid == 0) {
    const int64_t end = offsets[num_segments];
    s_ok = offsets[0] == 0 && (capacity ? end <= m : end == m);
    s_carry = 0;
  }
  __syncthreads();
  for (int e = tid; e < num_segments; e += kScanThreads) {
    if (offsets[e + 1] < offsets[e]) atomicAnd(&s_ok, 0);
  }
  __syncthreads();
  const bool ok = s_ok != 0;
  if (!ok && tid == 0 && bad_segments) atomicAdd(bad_segments, 1ull);

  for (int base = 0; base < num_segments; base += kScanThreads) {
    const int e = base + tid;
    const int v = (ok && e < num_segments) ? (offsets[e + 1] - offsets[e] + 127) / 128 : 0;
    s_scan[tid] = v;
    __syncthreads();
    for (int o = 1; o < kScanThreads; o <<= 1) {  // Hillis-Steele inclusive scan
      const int add = tid >= o ? s_scan[tid - o] : 0;
      __syncthreads();
      s_scan[tid] += add;
      __syncthreads();
    }
    if (e < num_segments) block_offsets[e] = s_carry + s_scan[tid] - v;
    __syncthreads();
    if (tid == kScanThreads - 1) s_carry += s_scan[tid];
    __syncthreads();
  }
  const int total = s_carry;
  if (tid == 0) block_offsets[num_segments] = total;
  __syncthreads();  // block_offsets (global) is now visible to the whole CTA

  for (int64_t b = tid; b < max_blocks; b += kScanThreads) {
    int32_t t0 = -1, t1 = -1;
    if (b < total) {
      const int lo = detail::last_at_or_below(block_offsets, num_segments, b);  // the segment of block b
      t0 = offsets[lo] + 128 * static_cast<int32_t>(b - block_offsets[lo]);
      t1 = min(t0 + 128, offsets[lo + 1]);
    }
    block_start[b] = t0;
    block_end[b] = t1;
  }
}

}  // namespace

int64_t segment_max_blocks(int64_t m, int num_segments) {
  return (m + 127) / 128 + num_segments;
}

void build_segment_blocks(const SegmentBlocks& sb, DeviceStatus* status, cudaStream_t stream) {
  FLOWMOE_CHECK(sb.num_segments >= 1, "build_segment_blocks: need at least one segment, got "
                                          << sb.num_segments);
  FLOWMOE_CHECK(sb.m >= 0 && sb.m <= INT32_MAX, "build_segment_blocks: M = " << sb.m
                                                    << " out of range [0, 2^31)");
  FLOWMOE_CHECK(status != nullptr,
                "build_segment_blocks: status is null; malformed offsets are reported only through "
                "DeviceStatus::bad_segments, so a status buffer is required");
  FLOWMOE_CHECK(sb.offsets && sb.block_start && sb.block_end && sb.block_offsets,
                "build_segment_blocks: offsets, block_start, block_end and block_offsets must "
                "all be device buffers (one is null)");
  FLOWMOE_CHECK(sb.max_blocks >= segment_max_blocks(sb.m, sb.num_segments),
                "build_segment_blocks: max_blocks = " << sb.max_blocks << " is too small; expected "
                    << segment_max_blocks(sb.m, sb.num_segments) << " = ceil(M/128) + E");
  build_segment_blocks_kernel<<<1, kScanThreads, 0, stream>>>(
      sb.offsets, sb.num_segments, sb.m, sb.max_blocks, sb.block_start, sb.block_end,
      sb.block_offsets, &status->bad_segments, sb.capacity);
  FLOWMOE_LAUNCH_CHECK("build_segment_blocks_kernel");
}

}  // namespace cuda
}  // namespace flowmoe
