// transpose_weight_blocks (flowmoe/gemm.h): the dgrad weights W^T transposed from the FP8 blocks of
// W have the bits quantize_weights writes for the transpose (whose own bits are tested against the
// CPU reference in test_convert_gpu.cu): UE8M0 and FP32 (GEMM-ready, padded) scales, fp8-naive's
// FP32-scale weights, W1 with its gate/up blocks interleaved, a block with a non-finite value (NaN
// scale and codes). The outputs start poisoned, so an unwritten code or scale padding shows.
// Bad shapes and overlapping buffers are clear errors.
#include <cuda_runtime.h>
#include <gtest/gtest.h>

#include <cmath>
#include <vector>

#include "cuda/device_buffer.h"
#include "cuda/gpu_test_util.h"
#include "flowmoe/cuda/convert.h"
#include "flowmoe/cuda/qtensor_view.h"
#include "flowmoe/error.h"
#include "flowmoe/gemm.h"

namespace flowmoe {
namespace {

using namespace testutil;

constexpr int kE = 3;
constexpr int64_t kN = 512, kK = 384;  // per expert; N = 2F with F = 256 (two gate, two up blocks)

// E experts of [N, K] BF16 with one non-finite value in expert 1.
std::vector<bf16_t> weights() {
  std::vector<bf16_t> w = normal_bf16(size_t(kE) * kN * kK, 0.05f, 91);
  w[size_t(1) * kN * kK + 200 * kK + 300] = num::f32_to_bf16(std::nanf(""));
  return w;
}

// W and its transpose as quantize_weights writes them, UE8M0 scales, plus the FP32 copies.
struct Quantized {
  DBuf<uint8_t> codes, ue8m0, t_codes, t_ue8m0;
  DBuf<float> f32, t_f32;
  Quantized(const DBuf<bf16_t>& w)
      : codes(kE * kN * kK), ue8m0(kE * (kN / 128) * (kK / 128)), t_codes(kE * kN * kK),
        t_ue8m0(kE * (kN / 128) * (kK / 128)), f32(gemm::weight_scale_f32_elems(kE, kN, kK)),
        t_f32(gemm::weight_scale_f32_elems(kE, kK, kN)) {
    cuda::quantize_weights(w.p, kE, kN, kK, codes.p, ue8m0.p, t_codes.p, t_ue8m0.p, nullptr, 0);
    cuda::weight_scales_to_f32(ue8m0.p, kE, kN, kK, f32.p, 0);
    cuda::weight_scales_to_f32(t_ue8m0.p, kE, kK, kN, t_f32.p, 0);
  }
};

TEST(WeightTranspose, Ue8m0AndFp32ScalesGiveQuantizeWeightsTranspose) {
  REQUIRE_DEVICE();
  DBuf<bf16_t> w(weights());
  Quantized q(w);
  // UE8M0 views
  DBuf<uint8_t> c(kE * kN * kK), s(kE * (kN / 128) * (kK / 128));
  cuda::transpose_weight_blocks(cuda::weight_128x128(q.codes.p, q.ue8m0.p, kE, kN, kK),
                                cuda::weight_128x128(c.p, s.p, kE, kK, kN), false, 0);
  expect_same_bits(q.t_codes.get(), c.get(), "UE8M0 view: codes");
  expect_same_bits(q.t_ue8m0.get(), s.get(), "UE8M0 view: scales");
  // GEMM-ready FP32 views (the layer's): padding of each scale row written 0
  DBuf<uint8_t> c2(kE * kN * kK);
  DBuf<float> s2(gemm::weight_scale_f32_elems(kE, kK, kN));
  cuda::transpose_weight_blocks(cuda::weight_128x128_f32(q.codes.p, q.f32.p, kE, kN, kK),
                                cuda::weight_128x128_f32(c2.p, s2.p, kE, kK, kN), false, 0);
  expect_same_bits(q.t_codes.get(), c2.get(), "FP32 view: codes");
  expect_same_bits(q.t_f32.get(), s2.get(), "FP32 view: scales");
  // the non-finite block carried over (NaN scale), so the check above compared a NaN somewhere
  const std::vector<uint8_t> ts = q.t_ue8m0.get();
  int nan_scales = 0;
  for (uint8_t b : ts) nan_scales += b == 0xFF;
  EXPECT_EQ(nan_scales, 1);
}

TEST(WeightTranspose, InterleavedW1GivesTheNaturalTranspose) {
  REQUIRE_DEVICE();
  DBuf<bf16_t> w(weights());
  Quantized q(w);
  const cuda::QTensorView nat = cuda::weight_128x128_f32(q.codes.p, q.f32.p, kE, kN, kK);
  DBuf<uint8_t> ic(kE * kN * kK);
  DBuf<float> is(gemm::weight_scale_f32_elems(kE, kN, kK));
  const cuda::QTensorView il = cuda::weight_128x128_f32(ic.p, is.p, kE, kN, kK);
  cuda::interleave_gate_up(nat, il, 0);
  DBuf<uint8_t> c(kE * kN * kK);
  DBuf<float> s(gemm::weight_scale_f32_elems(kE, kK, kN));
  cuda::transpose_weight_blocks(il, cuda::weight_128x128_f32(c.p, s.p, kE, kK, kN), true, 0);
  expect_same_bits(q.t_codes.get(), c.get(), "codes");
  expect_same_bits(q.t_f32.get(), s.get(), "scales");
  // the interleaved order read as natural is a different (wrong) transpose: the flag matters
  DBuf<uint8_t> c_wrong(kE * kN * kK);
  DBuf<float> s_wrong(gemm::weight_scale_f32_elems(kE, kK, kN));
  cuda::transpose_weight_blocks(il, cuda::weight_128x128_f32(c_wrong.p, s_wrong.p, kE, kK, kN), false, 0);
  EXPECT_FALSE(same_bits(q.t_codes.get(), c_wrong.get()));
}

TEST(WeightTranspose, Fp32ScaleWeightsGiveQuantizeWeightsFp32ScaleTranspose) {
  REQUIRE_DEVICE();
  DBuf<bf16_t> w(weights());
  DBuf<uint8_t> codes(kE * kN * kK), t_codes(kE * kN * kK), only(kE * kN * kK);
  DBuf<float> scales(gemm::weight_scale_f32_elems(kE, kN, kK)), t_scales(gemm::weight_scale_f32_elems(kE, kK, kN));
  DBuf<float> only_scales(gemm::weight_scale_f32_elems(kE, kN, kK));
  cuda::quantize_weights_fp32_scale(w.p, kE, kN, kK, codes.p, scales.p, t_codes.p, t_scales.p, nullptr, 0);
  // without the transpose: the same W
  cuda::quantize_weights_fp32_scale(w.p, kE, kN, kK, only.p, only_scales.p, nullptr, nullptr, nullptr, 0);
  expect_same_bits(codes.get(), only.get(), "W without its transpose: codes");
  expect_same_bits(scales.get(), only_scales.get(), "W without its transpose: scales");
  DBuf<uint8_t> c(kE * kN * kK);
  DBuf<float> s(gemm::weight_scale_f32_elems(kE, kK, kN));
  cuda::transpose_weight_blocks(cuda::weight_128x128_f32(codes.p, scales.p, kE, kN, kK),
                                cuda::weight_128x128_f32(c.p, s.p, kE, kK, kN), false, 0);
  expect_same_bits(t_codes.get(), c.get(), "codes");
  expect_same_bits(t_scales.get(), s.get(), "scales");
}

TEST(WeightTranspose, BadShapesAndOverlapAreClearErrors) {
  REQUIRE_DEVICE();
  DBuf<uint8_t> a(kE * kN * kK), b(kE * kN * kK);
  DBuf<float> sa(gemm::weight_scale_f32_elems(kE, kN, kK)), sb(gemm::weight_scale_f32_elems(kE, kK, kN));
  const cuda::QTensorView w = cuda::weight_128x128_f32(a.p, sa.p, kE, kN, kK);
  // not the transpose's shape
  EXPECT_THROW(cuda::transpose_weight_blocks(w, cuda::weight_128x128_f32(b.p, sb.p, kE, kN, kK), false, 0), Error);
  // other expert count
  EXPECT_THROW(cuda::transpose_weight_blocks(w, cuda::weight_128x128_f32(b.p, sb.p, 1, kE * kK, kN), false, 0),
               Error);
  // other scale format
  EXPECT_THROW(cuda::transpose_weight_blocks(w, cuda::weight_128x128(b.p, b.p, kE, kK, kN), false, 0), Error);
  // in place
  EXPECT_THROW(cuda::transpose_weight_blocks(w, cuda::weight_128x128_f32(a.p, sb.p, kE, kK, kN), false, 0), Error);
  // interleaved W1 needs whole gate/up pairs of blocks
  const cuda::QTensorView odd = cuda::weight_128x128_f32(a.p, sa.p, kE, 384, 512);
  EXPECT_THROW(cuda::transpose_weight_blocks(odd, cuda::weight_128x128_f32(b.p, sb.p, kE, 512, 384), true, 0), Error);
  ASSERT_CUDA_OK(cudaDeviceSynchronize());
}

}  // namespace
}  // namespace flowmoe
