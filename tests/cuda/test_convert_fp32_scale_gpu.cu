// The FP32-scale mode of the CUDA convert module (fp8-naive; flowmoe/cuda/convert.h, kernels in
// src/cuda/convert/fp32_scale.cu) against the CPU convert module's same mode
// (flowmoe/cpu/convert.h QTensorF32), bit for bit: row-wise quantize (plain scale grid), its
// dequantize, and 128x128 weights with their exact transposes. Fill cases: normal values, an
// all-zero tile (scale 1), a tile holding a NaN (activations: scale NaN, codes 0x7F, counted),
// large values.
#include <cuda_runtime.h>
#include <gtest/gtest.h>

#include <algorithm>
#include <cmath>
#include <cstring>
#include <random>
#include <stdexcept>
#include <string>
#include <vector>

#include "flowmoe/cpu/convert.h"
#include "flowmoe/cuda/convert.h"
#include "flowmoe/numerics.h"
#include "cuda/gpu_test_util.h"

namespace flowmoe {
namespace {

using namespace testutil;  // DBuf, REQUIRE_DEVICE

// [m, k] bf16: normal values, row 0's first tile all zero, row 1's first tile holding a NaN (when
// `nan`; weights are finite: set_weights rejects others), row 2 with large values.
std::vector<bf16_t> make_input(int64_t m, int64_t k, uint32_t seed, bool nan = true) {
  std::mt19937 rng(seed);
  std::normal_distribution<float> nd(0.0f, 1.0f);
  std::vector<bf16_t> x(size_t(m * k));
  for (auto& v : x) v = num::f32_to_bf16(nd(rng));
  for (int64_t c = 0; c < 128 && c < k; ++c) {
    x[size_t(c)] = num::f32_to_bf16(0.0f);
    if (m > 1) x[size_t(k + c)] = num::f32_to_bf16(c == 5 && nan ? NAN : 1.0f);
    if (m > 2) x[size_t(2 * k + c)] = num::f32_to_bf16(3.0e5f * (c % 7 == 0 ? -1.0f : 0.5f));
  }
  return x;
}

template <typename T>
int64_t differing(const std::vector<T>& a, const std::vector<T>& b) {
  if (a.size() != b.size()) return -1;
  int64_t n = 0;
  for (size_t i = 0; i < a.size(); ++i) n += std::memcmp(&a[i], &b[i], sizeof(T)) != 0;
  return n;
}

TEST(ConvertGpuFp32Scale, RowQuantizeAndDequantizeEqualTheCpu) {
  REQUIRE_DEVICE();
  const int64_t m = 37, k = 384;
  const std::vector<bf16_t> x = make_input(m, k, 11);
  cpu::QTensorF32 q;
  const QuantStats st = cpu::quantize_row_fp32_scale(x.data(), m, k, &q);
  DBuf<bf16_t> dx(x);
  DBuf<uint8_t> codes(size_t(m * k));
  DBuf<float> scales(size_t((k / 128) * m));
  DBuf<cuda::DeviceStatus> status(1);
  cudaMemset(status.p, 0, sizeof(cuda::DeviceStatus));
  cuda::quantize_row_fp32_scale(dx.p, m, k, nullptr, 1, codes.p, scales.p, status.p, 0);
  ASSERT_EQ(cudaDeviceSynchronize(), cudaSuccess);
  EXPECT_EQ(differing(codes.get(), q.codes), 0);
  EXPECT_EQ(differing(scales.get(), q.scales), 0);
  EXPECT_EQ(int64_t(status.get()[0].nonfinite), st.nonfinite);
  EXPECT_GT(st.nonfinite, 0);

  std::vector<bf16_t> want(size_t(m * k));
  cpu::dequantize(q, want.data());
  DBuf<bf16_t> y(size_t(m * k));
  cuda::dequantize_row_fp32_scale(codes.p, scales.p, m, k, nullptr, 1, y.p, 0);
  ASSERT_EQ(cudaDeviceSynchronize(), cudaSuccess);
  EXPECT_EQ(differing(y.get(), want), 0);
}

TEST(ConvertGpuFp32Scale, WeightsAndTheirTransposeEqualTheCpu) {
  REQUIRE_DEVICE();
  const int experts = 2;
  const int64_t n = 256, k = 640;  // K/128 = 5 (scale rows padded to 8), N/128 = 2 (padded to 4)
  const int64_t nb = n / 128, kb = k / 128, ldk = (kb + 3) / 4 * 4, ldn = (nb + 3) / 4 * 4;
  std::vector<bf16_t> w;
  for (int e = 0; e < experts; ++e) {
    const std::vector<bf16_t> we = make_input(n, k, 20 + e, /*nan=*/false);
    w.insert(w.end(), we.begin(), we.end());
  }
  DBuf<bf16_t> dw(w);
  DBuf<uint8_t> codes(size_t(experts * n * k)), t_codes(size_t(experts * n * k));
  DBuf<float> scales(size_t(experts * nb * ldk)), t_scales(size_t(experts * kb * ldn));
  cuda::quantize_weights_fp32_scale(dw.p, experts, n, k, codes.p, scales.p, t_codes.p, t_scales.p, nullptr, 0);
  ASSERT_EQ(cudaDeviceSynchronize(), cudaSuccess);
  const std::vector<uint8_t> gc = codes.get(), gtc = t_codes.get();
  const std::vector<float> gs = scales.get(), gts = t_scales.get();
  for (int e = 0; e < experts; ++e) {
    SCOPED_TRACE("expert " + std::to_string(e));
    cpu::QTensorF32 q, qt;
    cpu::quantize_weight_fp32_scale(w.data() + size_t(e) * n * k, n, k, &q, &qt);
    EXPECT_EQ(differing(std::vector<uint8_t>(gc.begin() + e * n * k, gc.begin() + (e + 1) * n * k), q.codes), 0);
    EXPECT_EQ(differing(std::vector<uint8_t>(gtc.begin() + e * n * k, gtc.begin() + (e + 1) * n * k), qt.codes), 0);
    std::vector<float> s, st;  // the GEMM-ready grids without their padding columns
    for (int64_t i = 0; i < nb; ++i)
      for (int64_t j = 0; j < kb; ++j) s.push_back(gs[size_t(e * nb * ldk + i * ldk + j)]);
    for (int64_t j = 0; j < kb; ++j)
      for (int64_t i = 0; i < nb; ++i) st.push_back(gts[size_t(e * kb * ldn + j * ldn + i)]);
    EXPECT_EQ(differing(s, q.scales), 0);
    EXPECT_EQ(differing(st, qt.scales), 0);
  }
}

TEST(ConvertGpuFp32Scale, HostRuleMatchesTheCpu) {
  for (float amax : {0.0f, 1.0f, 448.0f, 3.0e5f, 1.0e-30f}) {
    const std::vector<bf16_t> x(128, num::f32_to_bf16(amax));
    cpu::QTensorF32 q;
    cpu::quantize_row_fp32_scale(x.data(), 1, 128, &q);
    const float g = cuda::fp32_scale(num::bf16_to_f32(x[0]));
    EXPECT_EQ(std::memcmp(&g, &q.scales[0], sizeof g), 0) << amax;
  }
}

}  // namespace
}  // namespace flowmoe
