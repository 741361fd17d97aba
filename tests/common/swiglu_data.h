// The SwiGLU tests' input generator, shared by the CPU tests (tests/cpu/test_swiglu.cpp) and the
// GPU tests (tests/cuda/test_swiglu_gpu.cu), so that both check the same data: BF16 values of the
// GEMM1 output H (or of a gradient) in one of a few distributions that stress the SwiGLU
// arithmetic and its quantization (overflow near the top of the range, subnormals, NaN/Inf).
#pragma once

#include <cmath>
#include <cstdint>
#include <vector>

#include "common/reference.h"  // Rng
#include "flowmoe/swiglu_math.h"  // num::bf16_canonical
#include "flowmoe/tensor.h"

namespace flowmoe_test {

enum class HDist {
  kNormal,     // N(0, 1)
  kHeavy,      // N(0, 1), 0.5% of the values multiplied by U(100, 1000)
  kWide,       // sign * 2^U(-24, 7.5): |x| up to 181, many binades per tile
  kTiny,       // N(0, 1) * 2^-128: BF16 subnormals
  kNearMax,    // 30% at 3e38, the rest sign * 2^U(60, 127): SwiGLU overflows
  kNonFinite,  // N(0, 1) with 0.1% NaN, 0.1% +Inf, 0.1% -Inf
};

inline const char* hdist_name(HDist d) {
  switch (d) {
    case HDist::kNormal: return "normal";
    case HDist::kHeavy: return "heavy";
    case HDist::kWide: return "wide";
    case HDist::kTiny: return "tiny";
    case HDist::kNearMax: return "nearmax";
    case HDist::kNonFinite: return "nonfinite";
  }
  return "?";
}

// [rows, cols] BF16 values (canonical NaN). Every row r with zero_row_every > 0 and
// r % zero_row_every == 1 is all zero (like the padding rows of a permuted activation).
inline std::vector<flowmoe::bf16_t> make_bf16(HDist d, int64_t rows, int64_t cols, uint64_t seed,
                                              int64_t zero_row_every = 0) {
  Rng rng(seed);
  std::vector<flowmoe::bf16_t> v(static_cast<size_t>(rows * cols));
  for (int64_t r = 0; r < rows; ++r) {
    for (int64_t c = 0; c < cols; ++c) {
      double x = rng.normal();
      switch (d) {
        case HDist::kNormal: break;
        case HDist::kHeavy:
          if (rng.uniform() < 0.005) x *= rng.uniform(100.0, 1000.0);
          break;
        case HDist::kWide: x = rng.sign() * std::exp2(rng.uniform(-24.0, 7.5)); break;
        case HDist::kTiny: x = std::ldexp(x, -128); break;
        case HDist::kNearMax:
          x = rng.sign() * (rng.uniform() < 0.3 ? 3e38 : std::exp2(rng.uniform(60.0, 127.0)));
          break;
        case HDist::kNonFinite: {
          const double u = rng.uniform();
          if (u < 0.001) x = NAN;
          else if (u < 0.002) x = INFINITY;
          else if (u < 0.003) x = -INFINITY;
          break;
        }
      }
      if (zero_row_every > 0 && r % zero_row_every == 1) x = 0;
      v[static_cast<size_t>(r * cols + c)] = flowmoe::num::bf16_canonical(static_cast<float>(x));
    }
  }
  return v;
}

}  // namespace flowmoe_test
