// Checks of quantized tensors against the independent reference (tests/common/reference.h):
// tile enumerations per layout, expected scale codes and expected dequantized values.
#pragma once

#include <gtest/gtest.h>

#include <cmath>
#include <cstdint>
#include <sstream>
#include <string>
#include <vector>

#include "common/reference.h"
#include "flowmoe/cpu/convert.h"
#include "flowmoe/tensor.h"

namespace flowmoe_test {

// A tile: the element indices (into the row-major logical [rows, cols] matrix) sharing one scale.
using Tile = std::vector<int64_t>;

inline std::vector<Tile> tiles_row1x128(int64_t m, int64_t k) {
  std::vector<Tile> t;
  for (int64_t r = 0; r < m; ++r)
    for (int64_t c0 = 0; c0 < k; c0 += 128) {
      Tile tile;
      for (int64_t c = c0; c < c0 + 128; ++c) tile.push_back(r * k + c);
      t.push_back(tile);
    }
  return t;
}
inline std::vector<Tile> tiles_col128x1(const flowmoe::Segments& seg, int64_t k) {
  std::vector<Tile> t;
  for (const TokenBlock& b : token_blocks(seg))
    for (int64_t c = 0; c < k; ++c) {
      Tile tile;
      for (int64_t r = b.t0; r < b.t1; ++r) tile.push_back(r * k + c);
      t.push_back(tile);
    }
  return t;
}
inline std::vector<Tile> tiles_weight128x128(int64_t n, int64_t k) {
  std::vector<Tile> t;
  for (int64_t r0 = 0; r0 < n; r0 += 128)
    for (int64_t c0 = 0; c0 < k; c0 += 128) {
      Tile tile;
      for (int64_t r = r0; r < r0 + 128; ++r)
        for (int64_t c = c0; c < c0 + 128; ++c) tile.push_back(r * k + c);
      t.push_back(tile);
    }
  return t;
}
inline std::vector<Tile> tiles_mxfp4(int64_t m, int64_t k) {
  std::vector<Tile> t;
  for (int64_t r = 0; r < m; ++r)
    for (int64_t c0 = 0; c0 < k; c0 += 32) {
      Tile tile;
      for (int64_t c = c0; c < c0 + 32; ++c) tile.push_back(r * k + c);
      t.push_back(tile);
    }
  return t;
}
inline std::vector<Tile> tiles_of(const flowmoe::QTensor& q) {
  using flowmoe::Layout;
  switch (q.layout) {
    case Layout::kRow1x128: return tiles_row1x128(q.rows, q.cols);
    case Layout::kCol128x1: return tiles_col128x1(q.segments, q.cols);
    case Layout::kWeight128x128: return tiles_weight128x128(q.rows, q.cols);
    case Layout::kMxfp4Row1x32: return tiles_mxfp4(q.rows, q.cols);
  }
  return {};
}

inline std::string where(int64_t idx, int64_t k) {
  std::ostringstream os;
  os << "(" << idx / k << ", " << idx % k << ")";
  return os.str();
}

// Checks the shape bookkeeping of q: sizes of codes and scales per the layout table.
inline void expect_well_formed(const flowmoe::QTensor& q, flowmoe::Layout layout, int64_t rows, int64_t cols) {
  using flowmoe::Layout;
  EXPECT_EQ(q.layout, layout);
  EXPECT_EQ(q.rows, rows);
  EXPECT_EQ(q.cols, cols);
  const int64_t code_bytes = layout == Layout::kMxfp4Row1x32 ? rows * cols / 2 : rows * cols;
  EXPECT_EQ(static_cast<int64_t>(q.codes.size()), code_bytes);
  int64_t scales = 0;
  switch (layout) {
    case Layout::kRow1x128: scales = rows * (cols / 128); break;
    case Layout::kCol128x1: scales = static_cast<int64_t>(token_blocks(q.segments).size()) * cols; break;
    case Layout::kWeight128x128: scales = (rows / 128) * (cols / 128); break;
    case Layout::kMxfp4Row1x32: scales = rows * (cols / 32); break;
  }
  EXPECT_EQ(static_cast<int64_t>(q.scales.size()), scales);
}

// The library's dequantize must agree bit for bit with the reference decoding of the layout.
inline std::vector<float> decode_and_compare(const flowmoe::QTensor& q) {
  const std::vector<float> ref = ref_decode(q);
  std::vector<float> lib(ref.size(), -12345.0f);
  flowmoe::cpu::dequantize(q, lib.data());
  int64_t bad = 0;
  for (size_t i = 0; i < ref.size(); ++i) {
    if (!same_value(ref[i], lib[i]) && ++bad <= 5) {
      ADD_FAILURE() << "dequantize " << q.describe() << " at " << where(static_cast<int64_t>(i), q.cols)
                    << ": library " << lib[i] << ", reference decoding " << ref[i];
    }
  }
  EXPECT_EQ(bad, 0) << "dequantize disagrees with the layout table in " << bad << " elements";
  // BF16 output: the float result rounded to nearest even
  std::vector<uint16_t> lib16(ref.size());
  flowmoe::cpu::dequantize(q, lib16.data());
  int64_t bad16 = 0;
  for (size_t i = 0; i < ref.size(); ++i) {
    const bool ok = std::isnan(ref[i]) ? std::isnan(bf16_bits_to_float(lib16[i])) : lib16[i] == ref_f32_to_bf16(ref[i]);
    if (!ok) ++bad16;
  }
  EXPECT_EQ(bad16, 0) << "bf16 dequantize is not the RNE of the float one";
  return ref;
}

enum class Fmt { kE4M3, kE2M1 };

// Quantizing x (logical row-major [rows, cols]) into q must give, per tile: scale code
// ref_scale_exp(amax) + 127 (0xFF when the tile holds a non-finite value) and per element the
// nearest representable value of x / 2^e, times 2^e (NaN for the whole tile if non-finite).
// Returns the number of all-zero tiles seen (they must carry scale code 0).
inline int64_t expect_matches_reference_quantization(const std::vector<float>& x, const flowmoe::QTensor& q, Fmt fmt) {
  const int64_t k = q.cols;
  const auto blocks = token_blocks(q.segments);
  const std::vector<float> got = decode_and_compare(q);
  int64_t bad_scale = 0, bad_value = 0, zero_tiles = 0;
  for (const Tile& tile : tiles_of(q)) {
    double amax = 0;
    bool nonfinite = false;
    for (int64_t i : tile) {
      if (!std::isfinite(x[i])) nonfinite = true;
      else amax = std::max(amax, std::fabs(static_cast<double>(x[i])));
    }
    const int e = fmt == Fmt::kE4M3 ? ref_e4m3_scale_exp(amax) : ref_e2m1_scale_exp(amax);
    const uint8_t want_scale = nonfinite ? 0xFF : static_cast<uint8_t>(e + 127);
    if (!nonfinite && amax == 0) {
      ++zero_tiles;
      EXPECT_EQ(want_scale, 0);
    }
    for (int64_t i : tile) {  // every element of the tile must see the tile's scale
      const uint8_t s = scale_of(q, blocks, i / k, i % k);
      if (s != want_scale && ++bad_scale <= 5) {
        ADD_FAILURE() << q.describe() << ": scale of element " << where(i, k) << " is " << int(s)
                      << ", want " << int(want_scale) << " (tile amax " << amax << ")";
      }
    }
    for (int64_t i : tile) {
      const float want = nonfinite ? NAN : (fmt == Fmt::kE4M3 ? ref_quant_e4m3(x[i], e) : ref_quant_e2m1(x[i], e));
      if (!same_value(want, got[i]) && ++bad_value <= 5) {
        ADD_FAILURE() << q.describe() << ": element " << where(i, k) << " = " << x[i] << " decodes to "
                      << got[i] << ", want " << want << " (scale 2^" << e << ")";
      }
    }
  }
  EXPECT_EQ(bad_scale, 0);
  EXPECT_EQ(bad_value, 0);
  return zero_tiles;
}

}  // namespace flowmoe_test
