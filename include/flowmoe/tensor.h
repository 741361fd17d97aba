// Quantized tensor descriptions (SPEC §3). Host-owning containers; the CUDA side uses views
// with the same layouts (flowmoe/cuda/qtensor_view.h).
//
// A quantized activation X [M tokens, K features] is stored in one of these layouts:
//   kRow1x128      codes [M, K] e4m3 (row-major); scales [K/128][M] ue8m0 (token-contiguous,
//                  as the block-scaled GEMM reads them).
//   kCol128x1      codes [K, M] e4m3 (X transposed, tokens contiguous); scales [NB][K] ue8m0,
//                  one per (128-token block, feature), features contiguous. Token blocks follow
//                  the segments (one per expert): a block never straddles two segments, the last
//                  block of a segment may be partial, an empty segment has no block.
//   kWeight128x128 W [N, K]: codes [N, K] e4m3; scales [N/128][K/128] ue8m0 (K-contiguous).
//                  The transposed copy is a kWeight128x128 tensor of shape [K, N].
//   kMxfp4Row1x32  codes [M, K/2] bytes of packed e2m1 (element 2i in the low nibble);
//                  scales [M][K/32] ue8m0 (row-contiguous, as dispatch and permute move rows).
// A tile or block whose input held a non-finite value gets scale 0xFF (NaN): it decodes to NaN,
// never to a finite number.
#pragma once

#include <cstdint>
#include <string>
#include <vector>

namespace flowmoe {

constexpr int kFp8Block = 128;  // FP8 tile edge (1x128, 128x1, 128x128)
constexpr int kFp4Block = 32;   // MXFP4 block (1x32)

using bf16_t = uint16_t;  // bfloat16 bits

enum class Layout : uint8_t { kRow1x128, kCol128x1, kWeight128x128, kMxfp4Row1x32 };
const char* layout_name(Layout l);

// Per-expert token segments: offsets[0] = 0 <= offsets[1] <= ... <= offsets[E] = M.
struct Segments {
  std::vector<int32_t> offsets;

  static Segments whole(int64_t m);                   // one segment [0, M)
  static Segments from_counts(const std::vector<int32_t>& counts);
  int num_segments() const { return offsets.empty() ? 0 : static_cast<int>(offsets.size()) - 1; }
  int64_t num_tokens() const { return offsets.empty() ? 0 : offsets.back(); }
  // number of 128-token blocks: sum over segments of ceil(len / 128)
  int64_t num_blocks() const;
  // first block index of each segment, size E+1 (last entry = num_blocks())
  std::vector<int64_t> block_offsets() const;
  // throws unless the offsets are well formed for M tokens
  void validate(int64_t m) const;
};

struct QTensor {
  Layout layout = Layout::kRow1x128;
  int64_t rows = 0;  // M (tokens) for activations, N for weights: the logical source shape
  int64_t cols = 0;  // K
  std::vector<uint8_t> codes;
  std::vector<uint8_t> scales;
  Segments segments;  // kCol128x1 only

  // scale-grid shape (outer, inner) as stored, see the table above
  int64_t scale_rows() const;
  int64_t scale_cols() const;
  int64_t code_bytes() const;
  std::string describe() const;  // e.g. "row-wise 1x128 e4m3 [4096, 7168]"
};

// What a conversion saw (docs/NPY_FILES.md defines each counter; the CLI prints them as they are).
// `nonfinite`: non-finite elements met (their tiles are marked NaN), including those a stepwise
//   path produced itself (`overflow`).
// `underflow`: elements whose value an exact layout conversion could not keep (rounded into the
//   E4M3 subnormals or to zero); the CUDA DeviceStatus counts the same.
// `flushed` (CPU quantizers): non-zero finite inputs that a quantizer encoded as a zero code.
// `overflow` (CPU stepwise paths naive_col_copy, fp4_to_fp8_col_stepwise): finite codes whose
//   decoded value became +-Inf in the BF16 intermediate (also counted in `nonfinite`).
struct QuantStats {
  int64_t nonfinite = 0;
  int64_t underflow = 0;
  int64_t flushed = 0;
  int64_t overflow = 0;
  QuantStats& operator+=(const QuantStats& o) {
    nonfinite += o.nonfinite;
    underflow += o.underflow;
    flushed += o.flushed;
    overflow += o.overflow;
    return *this;
  }
};

// How the scaling-aware transpose picks each (feature, token block) exponent (cpu/convert.h):
// an option of the conversion, shared by the CPU reference, the CUDA launchers and MoeConfig.
enum class TransposeExponent : uint8_t { kRowMax, kColumnAmax };
namespace cpu {
using flowmoe::TransposeExponent;  // cpu::TransposeExponent, where the CPU reference defines it
}  // namespace cpu

// Throws flowmoe::NonFiniteError naming `what` when stats.nonfinite > 0.
void throw_if_nonfinite(const QuantStats& stats, const char* what);

}  // namespace flowmoe
