// The kernels' fast paths in numerics.h, proven equal to the generic encoders exhaustively.
#include <gtest/gtest.h>

#include <cstdint>
#include <random>

#include "flowmoe/numerics.h"

namespace flowmoe {
namespace {

using namespace flowmoe::num;

// Every E4M3 code under every shift that can occur (a block exponent spread of up to 254).
TEST(FastPaths, E4M3RescaleFastEqualsGenericForAllCodesAndShifts) {
  int64_t checked = 0;
  for (int q = 0; q < 256; ++q) {
    for (int d = 0; d <= 254; ++d) {
      bool lost_fast = false, lost_ref = false;
      const uint8_t fast = e4m3_rescale_fast(static_cast<uint8_t>(q), d, &lost_fast);
      const uint8_t ref = e4m3_rescale(static_cast<uint8_t>(q), d, &lost_ref);
      ASSERT_EQ(fast, ref) << "code 0x" << std::hex << q << std::dec << " shift " << d;
      ASSERT_EQ(lost_fast, lost_ref) << "code 0x" << std::hex << q << std::dec << " shift " << d;
      ++checked;
    }
  }
  EXPECT_EQ(checked, 256 * 255);
}

// Every binary32 value with |v| <= 6 that a quantizer can produce: all BF16 inputs divided by
// their possible scales are binary32 values; check every float bit pattern in [0, 6] with a
// stride, plus all values near the rounding midpoints, plus random patterns.
TEST(FastPaths, E2M1EncodeBoundedEqualsGenericOnAllFloatsUpToSix) {
  const uint32_t six = f32_bits(6.0f);
  int64_t checked = 0;
  for (uint32_t u = 0; u <= six; u += 97) {  // ~11M patterns, both signs
    for (uint32_t s : {0u, 0x80000000u}) {
      const float v = f32_from_bits(u | s);
      ASSERT_EQ(e2m1_encode_bounded(v), f32_to_e2m1(v)) << "bits 0x" << std::hex << (u | s);
      ++checked;
    }
  }
  for (float mid : {0.25f, 0.75f, 1.25f, 1.75f, 2.5f, 3.5f, 5.0f, 6.0f}) {
    const uint32_t b = f32_bits(mid);
    for (uint32_t u = b - 64; u <= b + 64; ++u) {
      const float v = f32_from_bits(u);
      ASSERT_EQ(e2m1_encode_bounded(v), f32_to_e2m1(v)) << "near midpoint " << mid;
      ASSERT_EQ(e2m1_encode_bounded(-v), f32_to_e2m1(-v)) << "near midpoint -" << mid;
      checked += 2;
    }
  }
  EXPECT_GT(checked, 10000000);
}

}  // namespace
}  // namespace flowmoe
