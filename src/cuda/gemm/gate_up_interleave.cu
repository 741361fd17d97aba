// W1's gate/up block interleaving (flowmoe/gemm.h interleave_gate_up): the weight layout of
// GroupedGemm::fprop_swiglu, where one 256-feature output tile holds the gate and the up
// projections of the same 128 features. A pure permutation of whole 128-row blocks (codes) and of
// their scale rows, so the FP8 values and scales are exactly those of the natural layout.
#include <algorithm>

#include "cuda/common.cuh"
#include "flowmoe/cuda/qtensor_view.h"
#include "flowmoe/gemm.h"

namespace flowmoe {
namespace cuda {
namespace {

constexpr int kThreads = 256;

// Destination block b of an expert with nb = 2n blocks takes source block b / 2 (gate, b even)
// or n + b / 2 (up, b odd). T: the copy unit; a block is `units` of them.
template <typename T>
__global__ void __launch_bounds__(kThreads)
interleave_blocks_kernel(const T* __restrict__ src, T* __restrict__ dst, int64_t nb, int64_t units, int64_t total) {
  for (int64_t i = blockIdx.x * int64_t(kThreads) + threadIdx.x; i < total; i += int64_t(gridDim.x) * kThreads) {
    const int64_t blk = i / units, u = i % units, e = blk / nb, b = blk % nb;
    const int64_t from = e * nb + (b % 2 == 0 ? b / 2 : nb / 2 + b / 2);
    dst[i] = src[from * units + u];
  }
}

template <typename T>
void interleave(const void* src, void* dst, int64_t nb, int64_t block_bytes, int64_t total_blocks, cudaStream_t s) {
  const int64_t units = block_bytes / int64_t(sizeof(T)), total = units * total_blocks;
  const int grid = int(std::min<int64_t>((total + kThreads - 1) / kThreads, 8192));
  interleave_blocks_kernel<T><<<grid, kThreads, 0, s>>>(static_cast<const T*>(src), static_cast<T*>(dst), nb, units,
                                                       total);
  FLOWMOE_LAUNCH_CHECK("interleave_gate_up");
}

}  // namespace

void interleave_gate_up(const QTensorView& w, const QTensorView& out, cudaStream_t stream) {
  const char* what = "interleave_gate_up";
  check_view(w, Layout::kWeight128x128, w.scale_format, what);
  check_view(out, Layout::kWeight128x128, w.scale_format, what);
  const int E = w.num_segments;
  FLOWMOE_CHECK(E >= 1 && out.num_segments == E && out.rows == w.rows && out.cols == w.cols &&
                    out.scale_ld == w.scale_ld,
                what << ": out is [" << out.rows << ", " << out.cols << "] (" << out.num_segments
                     << " experts, scale ld " << out.scale_ld << "), expected w's shape [" << w.rows << ", " << w.cols
                     << "] (" << E << " experts, scale ld " << w.scale_ld << ")");
  const int64_t rows = w.rows / E;  // 2F per expert
  FLOWMOE_CHECK(w.rows % E == 0 && rows % (2 * kFp8Block) == 0,
                what << ": " << rows << " rows per expert; expected 2F with F a multiple of 128 (gate, then up)");
  const size_t code_bytes = size_t(w.rows) * w.cols, scale_bytes = size_t(w.scale_bytes());
  const auto overlap = [](const void* a, size_t na, const void* b, size_t nb) {
    const char *pa = static_cast<const char*>(a), *pb = static_cast<const char*>(b);
    return pa < pb + nb && pb < pa + na;
  };
  FLOWMOE_CHECK(!overlap(w.codes, code_bytes, out.codes, code_bytes) &&
                    !overlap(w.scales, scale_bytes, out.scales, scale_bytes),
                what << ": out overlaps w; expected separate buffers (a permutation of whole blocks)");
  FLOWMOE_CHECK(detail::aligned16(w.codes) && detail::aligned16(out.codes),
                what << ": the codes must be 16-byte aligned");
  const int64_t nb = rows / kFp8Block, blocks = int64_t(E) * nb;
  interleave<uint4>(w.codes, out.codes, nb, kFp8Block * w.cols, blocks, stream);
  // one scale row (scale_ld elements) per 128-row block
  const int64_t row_bytes = w.scale_ld * (w.scale_format == ScaleFormat::kF32 ? 4 : 1);
  interleave<uint8_t>(w.scales, out.scales, nb, row_bytes, blocks, stream);
}

}  // namespace cuda
}  // namespace flowmoe
