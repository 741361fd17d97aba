// Decoded saturation on the GPU (docs/NUMERICS.md §2, issue 20): the CUDA quantizers equal the CPU
// reference bit for bit on BF16 data at the top of the binary32 range, and nothing they write
// decodes to Inf. Runs on the device machine only (CTest label `gpu`).
#include <cuda_runtime.h>
#include <gtest/gtest.h>

#include <cmath>
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

using namespace testutil;  // DBuf, REQUIRE_DEVICE, expect_same_bits

// BF16 values at the top of the range: every finite bit pattern from 0x7E00 (2^125) to 0x7F7F
// (the BF16 maximum), both signs, in random order, with some ordinary values and zeros mixed in
// so that tiles of every scale occur; the thresholds 0x7F78 (1.9375 * 2^127, E4M3) and 0x7F60
// (1.75 * 2^127, MXFP4) are all present.
std::vector<bf16_t> top_of_range_bf16(int64_t n, uint32_t seed) {
  std::mt19937 rng(seed);
  std::vector<bf16_t> x(n);
  for (int64_t i = 0; i < n; ++i) {
    uint16_t h;
    if (i % 11 == 5) h = num::f32_to_bf16(std::ldexp(1.0f + (rng() % 128) / 128.0f, static_cast<int>(rng() % 40) - 20));
    else if (i % 13 == 7) h = 0;
    else h = static_cast<uint16_t>(0x7E00u + (i * 7 + rng() % 3) % (0x7F7Fu - 0x7E00u + 1));
    x[i] = static_cast<bf16_t>(h | ((rng() & 1) ? 0x8000u : 0u));
  }
  return x;
}

int64_t count_inf(const QTensor& q) {
  std::vector<float> y(q.rows * q.cols);
  cpu::dequantize(q, y.data());
  int64_t n = 0;
  for (float v : y) n += std::isinf(v);
  return n;
}

TEST(SaturationGpu, QuantizersMatchCpuAtTheTopOfTheRange) {
  REQUIRE_DEVICE();
  const int64_t m = 384, k = 512;
  const std::vector<bf16_t> x = top_of_range_bf16(m * k, 77);
  const Segments seg = Segments::from_counts({100, 0, 27, 257});
  const int E = seg.num_segments();
  const int64_t nb = seg.num_blocks();
  cuda::DeviceStatus* status = nullptr;
  ASSERT_EQ(cudaMalloc(&status, sizeof(cuda::DeviceStatus)), cudaSuccess);
  cudaMemset(status, 0, sizeof(cuda::DeviceStatus));

  DBuf<bf16_t> dx(x);
  DBuf<int32_t> doff(seg.offsets);
  const int64_t maxb = cuda::segment_max_blocks(m, E);
  DBuf<int32_t> bstart(maxb), bend(maxb), boff(E + 1);
  cuda::SegmentBlocks sb{doff.p, E, m, maxb, bstart.p, bend.p, boff.p};
  cuda::build_segment_blocks(sb, status, 0);

  // row-wise, column-wise, both
  QTensor row, col;
  EXPECT_EQ(cpu::quantize_row(x.data(), m, k, &row).nonfinite, 0);
  EXPECT_EQ(cpu::quantize_col(x.data(), m, k, seg, &col).nonfinite, 0);
  EXPECT_EQ(count_inf(row), 0);
  EXPECT_EQ(count_inf(col), 0);
  {
    DBuf<uint8_t> rc(m * k), rs(m * k / 128);
    cuda::quantize_row(dx.p, m, k, rc.p, rs.p, status, 0);
    expect_same_bits(row.codes, rc.get(m * k), m * k, "quantize_row codes");
    expect_same_bits(row.scales, rs.get(m * k / 128), m * k / 128, "quantize_row scales");
    DBuf<uint8_t> cc(m * k), cs(maxb * k), rc2(m * k), rs2(m * k / 128);
    cuda::quantize_col(dx.p, k, sb, cc.p, cs.p, nullptr, nullptr, status, 0);
    expect_same_bits(col.codes, cc.get(m * k), m * k, "quantize_col codes");
    expect_same_bits(col.scales, cs.get(nb * k), nb * k, "quantize_col scales");
    cuda::quantize_col(dx.p, k, sb, cc.p, cs.p, rc2.p, rs2.p, status, 0);
    expect_same_bits(col.codes, cc.get(m * k), m * k, "quantize_both col codes");
    expect_same_bits(row.codes, rc2.get(m * k), m * k, "quantize_both row codes");
    expect_same_bits(row.scales, rs2.get(m * k / 128), m * k / 128, "quantize_both row scales");
    // the transposed-BF16 path (naive col copy's quantizer)
    DBuf<bf16_t> xt(m * k);
    cuda::transpose_bf16(dx.p, m, k, xt.p, 0);
    cuda::quantize_transposed(xt.p, k, sb, cc.p, cs.p, status, 0);
    expect_same_bits(col.codes, cc.get(m * k), m * k, "quantize_transposed codes");
    expect_same_bits(col.scales, cs.get(nb * k), nb * k, "quantize_transposed scales");
  }
  // weights 128x128 and the transposed copy
  {
    QTensor w, wt;
    EXPECT_EQ(cpu::quantize_weight(x.data(), m, k, &w, &wt).nonfinite, 0);
    EXPECT_EQ(count_inf(w), 0);
    DBuf<uint8_t> wc(m * k), ws(m * k / (128 * 128)), tc(m * k), ts(m * k / (128 * 128));
    cuda::quantize_weight(dx.p, m, k, wc.p, ws.p, tc.p, ts.p, status, 0);
    expect_same_bits(w.codes, wc.get(m * k), m * k, "quantize_weight codes");
    expect_same_bits(w.scales, ws.get(w.scales.size()), w.scales.size(), "quantize_weight scales");
    expect_same_bits(wt.codes, tc.get(m * k), m * k, "quantize_weight t codes");
    expect_same_bits(wt.scales, ts.get(wt.scales.size()), wt.scales.size(), "quantize_weight t scales");
  }
  // MXFP4 and its stepwise column conversion
  {
    QTensor f4, c8s;
    EXPECT_EQ(cpu::quantize_mxfp4(x.data(), m, k, &f4).nonfinite, 0);
    EXPECT_EQ(count_inf(f4), 0);
    DBuf<uint8_t> fc(m * k / 2), fs(m * k / 32);
    cuda::quantize_mxfp4(dx.p, m, k, fc.p, fs.p, status, 0);
    expect_same_bits(f4.codes, fc.get(m * k / 2), m * k / 2, "quantize_mxfp4 codes");
    expect_same_bits(f4.scales, fs.get(m * k / 32), m * k / 32, "quantize_mxfp4 scales");
    cpu::fp4_to_fp8_col_stepwise(f4, seg, &c8s);
    DBuf<uint8_t> oc(m * k), os(maxb * k);
    DBuf<bf16_t> work(2 * m * k);
    cuda::fp4_to_fp8_col_stepwise(fc.p, fs.p, k, sb, oc.p, os.p, work.p, status, 0);
    expect_same_bits(c8s.codes, oc.get(m * k), m * k, "fp4_to_fp8_col_stepwise codes");
    expect_same_bits(c8s.scales, os.get(nb * k), nb * k, "fp4_to_fp8_col_stepwise scales");
  }
  // the data did exercise the saturation: some plain RNE codes would have decoded to Inf
  int64_t would_be_inf = 0;
  for (int64_t r = 0; r < m; ++r)
    for (int64_t c = 0; c < k; ++c) {
      const int e = row.scales[(c / 128) * m + r] - 127;
      would_be_inf += std::isinf(num::dequant_e4m3(num::quant_e4m3(num::bf16_to_f32(x[r * k + c]), e),
                                                   row.scales[(c / 128) * m + r]));
    }
  EXPECT_GT(would_be_inf, 0);
  cuda::DeviceStatus s{};
  cudaDeviceSynchronize();
  cudaMemcpy(&s, status, sizeof(s), cudaMemcpyDeviceToHost);
  EXPECT_EQ(s.nonfinite, 0u);
  EXPECT_EQ(s.bad_segments, 0u);
  EXPECT_EQ(cudaGetLastError(), cudaSuccess);
  cudaFree(status);
}

}  // namespace
}  // namespace flowmoe
