// quantize_weights_stored (flowmoe/cuda/convert.h): the FP8 weights quantized where a model stores
// them transposed (gpt-oss: gate_up_proj [E, H, 2F] with gate / up interleaved, down_proj [E, F, H],
// H and F not multiples of 128) have the bits of the CPU reference that first relays them into the
// layer's layout (cpu::expert_weights_to_layer) and then quantizes (cpu::quantize_weight; FP32
// sources through their BF16 copy, as quantize_weights on FP32 masters), for BF16 and FP32 sources, every map of flowmoe/expert_layout.h, stored rows that take the vector loads and
// rows that do not (odd sizes), sizes with more blocks than the staged kernel's CTAs, a non-finite
// value; each output alone; W1 written in the fused SwiGLU's gate / up block interleaving; bad maps
// are clear errors.
#include <cuda_runtime.h>
#include <gtest/gtest.h>

#include <cmath>
#include <string>
#include <type_traits>
#include <vector>

#include "cuda/device_buffer.h"
#include "cuda/gpu_test_util.h"
#include "flowmoe/cpu/convert.h"
#include "flowmoe/cuda/convert.h"
#include "flowmoe/error.h"
#include "flowmoe/expert_layout.h"

namespace flowmoe {
namespace {

using namespace testutil;

int64_t pad128(int64_t n) { return (n + 127) / 128 * 128; }

struct Case {
  const char* name;
  int64_t h, f;      // stored sizes
  bool interleaved;  // (w1 only)
  bool w1;           // w1 [E, H, 2F] -> W1 [E, 2F', H']; else w2 [E, F, H] -> W2 [E, H', F']
};

// The stored weight, the layer's shape and the map of one case.
struct Shapes {
  int64_t c, l, n, k;  // src [E, C, L]; W [E, N, K]
  ExpertRowMap map;
};
Shapes shapes(const Case& t) {
  const int64_t hp = pad128(t.h), fp = pad128(t.f);
  ExpertStorage st{t.h, t.f, t.interleaved};
  if (t.w1) return Shapes{t.h, 2 * t.f, 2 * fp, hp, st.w1_rows(fp)};
  return Shapes{t.f, t.h, hp, fp, st.w2_rows()};
}

template <typename T>
void check_case(const Case& t, const std::vector<T>& src, int experts) {
  SCOPED_TRACE(std::string(t.name) + (sizeof(T) == 4 ? " fp32" : " bf16"));
  const Shapes s = shapes(t);
  const int64_t elems = s.n * s.k, blocks = elems / 16384;
  // the reference: relayout, then quantize each expert
  std::vector<T> w(size_t(experts) * elems);
  cpu::expert_weights_to_layer(src.data(), w.data(), experts, s.c, s.l, s.n, s.k, s.map);
  DBuf<T> dsrc(src);
  DBuf<uint8_t> c(experts * elems), sc(experts * blocks), tc(experts * elems), ts(experts * blocks);
  DBuf<cuda::DeviceStatus> ds(1);
  cudaMemset(ds.p, 0, sizeof(cuda::DeviceStatus));
  cuda::quantize_weights_stored(dsrc.p, experts, s.c, s.l, s.map, s.n, s.k, c.p, sc.p, tc.p, ts.p, ds.p, 0);
  const auto codes = c.get(), scales = sc.get(), tcodes = tc.get(), tscales = ts.get();
  // FP32 sources: the bits of quantizing their BF16 (RNE) copy, the FP32 values' non-finite count
  // (as quantize_weights on FP32 masters)
  std::vector<bf16_t> wb(w.size());
  int64_t nonfinite = 0;
  for (size_t i = 0; i < w.size(); ++i) {
    if constexpr (std::is_same_v<T, float>) {
      wb[i] = num::f32_to_bf16(w[i]);
      nonfinite += !std::isfinite(w[i]);
    } else {
      wb[i] = w[i];
    }
  }
  for (int e = 0; e < experts; ++e) {
    SCOPED_TRACE("expert " + std::to_string(e));
    QTensor q, qt;
    const int64_t counted = cpu::quantize_weight(wb.data() + e * elems, s.n, s.k, &q, &qt).nonfinite;
    if constexpr (!std::is_same_v<T, float>) nonfinite += counted;
    const auto part = [&](const std::vector<uint8_t>& v, int64_t size) {
      return std::vector<uint8_t>(v.begin() + e * size, v.begin() + (e + 1) * size);
    };
    expect_same_bits(q.codes, part(codes, elems), elems, "codes");
    expect_same_bits(q.scales, part(scales, blocks), blocks, "scales");
    expect_same_bits(qt.codes, part(tcodes, elems), elems, "transposed codes");
    expect_same_bits(qt.scales, part(tscales, blocks), blocks, "transposed scales");
  }
  EXPECT_EQ(ds.get()[0].nonfinite, static_cast<unsigned long long>(nonfinite));
  // each output alone (the forward's W, the backward's W^T): the same bits
  DBuf<uint8_t> c2(experts * elems), s2(experts * blocks), tc2(experts * elems), ts2(experts * blocks);
  cuda::quantize_weights_stored(dsrc.p, experts, s.c, s.l, s.map, s.n, s.k, c2.p, s2.p, nullptr, nullptr, nullptr, 0);
  cuda::quantize_weights_stored(dsrc.p, experts, s.c, s.l, s.map, s.n, s.k, nullptr, nullptr, tc2.p, ts2.p, nullptr,
                                0);
  expect_same_bits(codes, c2.get(), experts * elems, "codes alone");
  expect_same_bits(scales, s2.get(), experts * blocks, "scales alone");
  expect_same_bits(tcodes, tc2.get(), experts * elems, "transposed codes alone");
  expect_same_bits(tscales, ts2.get(), experts * blocks, "transposed scales alone");
  if (!t.w1) return;
  // W1 in the fused SwiGLU's gate / up block interleaving: the same codes and scales permuted by
  // whole 128-row blocks, W1^T as it is
  DBuf<uint8_t> c3(experts * elems), s3(experts * blocks), tc3(experts * elems), ts3(experts * blocks);
  cuda::quantize_weights_stored(dsrc.p, experts, s.c, s.l, s.map, s.n, s.k, c3.p, s3.p, tc3.p, ts3.p, nullptr, 0,
                                /*gate_up_interleaved=*/true);
  const int64_t nb = s.n / 128;
  expect_same_bits(gate_up_interleaved(codes, experts, nb, 128 * s.k), c3.get(), experts * elems, "interleaved codes");
  expect_same_bits(gate_up_interleaved(scales, experts, nb, s.k / 128), s3.get(), experts * blocks,
                   "interleaved scales");
  expect_same_bits(tcodes, tc3.get(), experts * elems, "transposed codes (interleaved W1)");
  expect_same_bits(tscales, ts3.get(), experts * blocks, "transposed scales (interleaved W1)");
}

const Case kCases[] = {
    {"w1 interleaved, gpt-oss-like sizes", 200, 136, true, true},  // rows of 544 B: vector loads
    {"w1 interleaved, multiples of 128", 256, 128, true, true},
    {"w1 concatenated", 136, 200, false, true},
    {"w1 interleaved, odd F", 136, 101, true, true},  // rows of 404 B: value by value
    {"w2", 200, 136, false, false},
    {"w2, odd H", 131, 136, false, false},
    // more blocks than the staged kernel's CTAs (one or two per SM): each CTA encodes one block
    // while the next one's copies are in flight
    {"w1 interleaved, many blocks", 1000, 1400, true, true},
    {"w2, many blocks", 1400, 1000, false, false},
};

TEST(ConvertGpuWeightStored, SameBitsAsRelayoutThenQuantizeBf16) {
  REQUIRE_DEVICE();
  const int experts = 3;
  for (const Case& t : kCases) {
    const Shapes s = shapes(t);
    std::vector<bf16_t> src = normal_bf16(size_t(experts) * s.c * s.l, 0.05f, 17);
    src[size_t(1) * s.c * s.l + 5 * s.l + 7] = num::f32_to_bf16(std::nanf(""));  // expert 1: a NaN block
    src[size_t(2) * s.c * s.l + 3] = num::f32_to_bf16(448.f * 64);  // a large value
    check_case(t, src, experts);
  }
}

TEST(ConvertGpuWeightStored, SameBitsAsRelayoutThenQuantizeFp32) {
  REQUIRE_DEVICE();
  const int experts = 2;
  for (const Case& t : kCases) {
    const Shapes s = shapes(t);
    std::vector<float> src = normal_f32(size_t(experts) * s.c * s.l, 0.05f, 23);
    src[size_t(1) * s.c * s.l + 2 * s.l + 9] = INFINITY;
    src[11] = 3.0e-39f;  // a subnormal
    check_case(t, src, experts);
  }
}

TEST(ConvertGpuWeightStored, BadMapsAndShapesAreClearErrors) {
  REQUIRE_DEVICE();
  const Case t{"w1", 200, 136, true, true};
  const Shapes s = shapes(t);
  DBuf<bf16_t> src(s.c * s.l);
  DBuf<uint8_t> c(s.n * s.k), sc(s.n * s.k / 16384);
  ExpertRowMap past_rows = s.map;
  past_rows.valid = t.f + 1;  // the last up row reads past the stored row
  EXPECT_THROW(cuda::quantize_weights_stored(src.p, 1, s.c, s.l, past_rows, s.n, s.k, c.p, sc.p, nullptr, nullptr,
                                             nullptr, 0),
               Error);
  EXPECT_THROW(cuda::quantize_weights_stored(src.p, 1, s.k + 1, s.l, s.map, s.n, s.k, c.p, sc.p, nullptr, nullptr,
                                             nullptr, 0),
               Error)
      << "more stored columns than W has";
  EXPECT_THROW(cuda::quantize_weights_stored(src.p, 1, s.c, s.l, s.map, s.n + 64, s.k, c.p, sc.p, nullptr, nullptr,
                                             nullptr, 0),
               Error)
      << "N not a multiple of 128";
  EXPECT_THROW(cuda::quantize_weights_stored(src.p, 1, s.c, s.l, s.map, s.n, s.k, nullptr, nullptr, nullptr, nullptr,
                                             nullptr, 0),
               Error)
      << "no output";
}

}  // namespace
}  // namespace flowmoe
