// The column-amax exponent (TransposeExponent::kColumnAmax) on the GPU: the scaling-aware
// transpose and FP4RowToFP8Col against the CPU reference bit for bit (codes, scales, underflow and
// non-finite counters), and against the naive / stepwise paths they must equal.
// Runs on the device machine only (CTest label `gpu`).
#include <cuda_runtime.h>
#include <gtest/gtest.h>

#include <algorithm>
#include <cmath>
#include <cstdio>
#include <random>
#include <string>
#include <vector>

#include "flowmoe/cpu/convert.h"
#include "flowmoe/cuda/convert.h"
#include "flowmoe/numerics.h"
#include "cuda/gpu_test_util.h"

namespace flowmoe {
namespace {

using namespace testutil;  // DBuf, REQUIRE_DEVICE, expect_same_bits

enum class Dist { kNormal, kHeavy, kBinades, kSubnormal, kOutlierToken, kNonFinite };
const char* dist_name(Dist d) {
  switch (d) {
    case Dist::kNormal: return "normal";
    case Dist::kHeavy: return "heavy";
    case Dist::kBinades: return "binades";
    case Dist::kSubnormal: return "subnormal";
    case Dist::kOutlierToken: return "outlier_token";
    case Dist::kNonFinite: return "nonfinite";
  }
  return "?";
}

// kOutlierToken: normal data, and in every 128-token block of every segment one token (the
// sixth, or the last of a shorter block) 2^20 times larger than the rest.
std::vector<bf16_t> make_data(int64_t m, int64_t k, Dist d, const Segments& seg, uint32_t seed) {
  std::mt19937 rng(seed);
  std::normal_distribution<float> nd(0.f, 1.f);
  std::uniform_real_distribution<float> ud(0.f, 1.f);
  std::vector<float> x(m * k);
  for (auto& f : x) {
    f = nd(rng);
    switch (d) {
      case Dist::kHeavy: if (ud(rng) < 0.002f) f *= 100.f + 900.f * ud(rng); break;
      case Dist::kBinades: f = (ud(rng) < 0.5f ? -1.f : 1.f) * std::ldexp(1.f + ud(rng), static_cast<int>(ud(rng) * 50) - 35); break;
      case Dist::kSubnormal: f = std::ldexp(f, -130); break;
      case Dist::kNonFinite: {
        const float u = ud(rng);
        if (u < 0.0005f) f = NAN;
        else if (u < 0.001f) f = INFINITY;
        break;
      }
      default: break;
    }
  }
  if (d == Dist::kOutlierToken) {
    for (int s = 0; s < seg.num_segments(); ++s)
      for (int64_t t0 = seg.offsets[s]; t0 < seg.offsets[s + 1]; t0 += 128) {
        const int64_t t = std::min<int64_t>(t0 + 5, seg.offsets[s + 1] - 1);
        for (int64_t c = 0; c < k; ++c) x[t * k + c] *= 1048576.0f;
      }
  }
  std::vector<bf16_t> h(m * k);
  for (int64_t i = 0; i < m * k; ++i) h[i] = num::f32_to_bf16(x[i]);
  return h;
}

struct Case {
  std::string name;
  int64_t m, k;
  std::vector<int32_t> counts;  // tokens per expert segment
  Dist dist;
};

class ColumnAmaxGpu : public ::testing::TestWithParam<Case> {
 protected:
  void SetUp() override { REQUIRE_DEVICE(); }
};

TEST_P(ColumnAmaxGpu, BitExactAgainstCpuAndEqualsTheNaivePaths) {
  const Case& c = GetParam();
  const int64_t m = c.m, k = c.k;
  const Segments seg = Segments::from_counts(c.counts);
  ASSERT_EQ(seg.num_tokens(), m);
  const auto x = make_data(m, k, c.dist, seg, 4321u + static_cast<uint32_t>(m * 7 + k));
  const bool finite = c.dist != Dist::kNonFinite;
  const int E = seg.num_segments();
  const int64_t nb = seg.num_blocks(), maxb = cuda::segment_max_blocks(m, E);
  DBuf<int32_t> doff(seg.offsets), bstart(maxb), bend(maxb), boff(E + 1);
  DBuf<cuda::DeviceStatus> ds(1);
  const auto reset = [&] { cudaMemset(ds.p, 0, sizeof(cuda::DeviceStatus)); };
  reset();
  cuda::SegmentBlocks sb{doff.p, E, m, maxb, bstart.p, bend.p, boff.p};
  cuda::build_segment_blocks(sb, ds.p, 0);
  DBuf<uint8_t> cc(m * k), cs(maxb * k), nc(m * k), ns(maxb * k);
  DBuf<bf16_t> work(2 * m * k);

  // ---- FP8: row-wise -> column-wise with the column-amax exponent
  QTensor row;
  cpu::quantize_row(x.data(), m, k, &row);
  if (m > 3) row.codes[3 * k + 5] = 0x7F;  // a NaN code under a finite scale
  QTensor want;
  const QuantStats st = cpu::scaling_aware_transpose(row, seg, &want, TransposeExponent::kColumnAmax);
  {
    DBuf<uint8_t> rc(row.codes), rs(row.scales);
    reset();
    cuda::scaling_aware_transpose(rc.p, rs.p, k, sb, cc.p, cs.p, ds.p, 0, TransposeExponent::kColumnAmax);
    const auto got_c = cc.get(m * k), got_s = cs.get(nb * k);
    expect_same_bits(want.codes, got_c, m * k, "FP8 column-amax codes");
    expect_same_bits(want.scales, got_s, nb * k, "FP8 column-amax scales");
    const cuda::DeviceStatus s = ds.get(1)[0];
    EXPECT_EQ(s.underflow, static_cast<unsigned long long>(st.underflow));
    EXPECT_EQ(s.nonfinite, static_cast<unsigned long long>(st.nonfinite));
    if (finite && c.dist != Dist::kSubnormal && m > 3) {
      // Without NaN codes the result is the naive DQ -> T -> Q path's, bit for bit (where the
      // dequantized values are BF16-exact: not for data near 2^-126 and below).
      row.codes[3 * k + 5] = 0x00;
      DBuf<uint8_t> rc2(row.codes);
      cuda::scaling_aware_transpose(rc2.p, rs.p, k, sb, cc.p, cs.p, nullptr, 0, TransposeExponent::kColumnAmax);
      cuda::naive_col_copy(rc2.p, rs.p, k, sb, nc.p, ns.p, work.p, nullptr, 0);
      expect_same_bits(nc.get(m * k), cc.get(m * k), m * k, "FP8 column-amax vs naive codes");
      expect_same_bits(ns.get(nb * k), cs.get(nb * k), nb * k, "FP8 column-amax vs naive scales");
    }
  }

  // ---- MXFP4 row-wise -> FP8 column-wise with the column-amax exponent
  QTensor f4;
  cpu::quantize_mxfp4(x.data(), m, k, &f4);
  QTensor want4, rowmax4;
  const QuantStats st4 = cpu::fp4_to_fp8_col(f4, seg, &want4, TransposeExponent::kColumnAmax);
  const QuantStats st4r = cpu::fp4_to_fp8_col(f4, seg, &rowmax4, TransposeExponent::kRowMax);
  EXPECT_LE(st4.underflow, st4r.underflow);
  {
    DBuf<uint8_t> fc(f4.codes), fs(f4.scales);
    reset();
    cuda::fp4_to_fp8_col(fc.p, fs.p, k, sb, cc.p, cs.p, ds.p, 0, TransposeExponent::kColumnAmax);
    expect_same_bits(want4.codes, cc.get(m * k), m * k, "FP4 column-amax codes");
    expect_same_bits(want4.scales, cs.get(nb * k), nb * k, "FP4 column-amax scales");
    const cuda::DeviceStatus s = ds.get(1)[0];
    EXPECT_EQ(s.underflow, static_cast<unsigned long long>(st4.underflow));
    EXPECT_EQ(s.nonfinite, static_cast<unsigned long long>(st4.nonfinite));
    if (finite) {
      cuda::fp4_to_fp8_col_stepwise(fc.p, fs.p, k, sb, nc.p, ns.p, work.p, nullptr, 0);
      expect_same_bits(nc.get(m * k), cc.get(m * k), m * k, "FP4 column-amax vs stepwise codes");
      expect_same_bits(ns.get(nb * k), cs.get(nb * k), nb * k, "FP4 column-amax vs stepwise scales");
    }
    // The row-max kernel in the same run, for the record of what column-amax saves.
    reset();
    cuda::fp4_to_fp8_col(fc.p, fs.p, k, sb, cc.p, cs.p, ds.p, 0, TransposeExponent::kRowMax);
    expect_same_bits(rowmax4.codes, cc.get(m * k), m * k, "FP4 row-max codes");
    EXPECT_EQ(ds.get(1)[0].underflow, static_cast<unsigned long long>(st4r.underflow));
  }
  std::printf("[ measure  ] %s: underflow FP8 column-amax %lld; FP4->FP8 col column-amax %lld vs row-max %lld of %lld\n",
              c.name.c_str(), static_cast<long long>(st.underflow), static_cast<long long>(st4.underflow),
              static_cast<long long>(st4r.underflow), static_cast<long long>(m * k));
  if (c.dist == Dist::kOutlierToken && m >= 128) EXPECT_LT(st4.underflow, st4r.underflow);
  EXPECT_EQ(cudaGetLastError(), cudaSuccess);
}

std::vector<int32_t> ragged(int e, int64_t m, uint32_t seed, int align) {
  std::mt19937 rng(seed);
  std::vector<int32_t> c(e, 0);
  int64_t left = m / align, used = 0;
  for (int i = 0; i < e - 1 && left > 0; ++i) {
    const int64_t take = (i % 5 == 3) ? 0 : static_cast<int64_t>(rng() % (2 * left / (e - i) + 1));
    c[i] = static_cast<int32_t>(std::min(take, left) * align);
    left -= std::min(take, left);
    used += c[i];
  }
  c[e - 1] = static_cast<int32_t>(m - used);
  return c;
}

std::vector<Case> cases() {
  std::vector<Case> v;
  for (Dist d : {Dist::kNormal, Dist::kHeavy, Dist::kBinades, Dist::kSubnormal, Dist::kOutlierToken, Dist::kNonFinite}) {
    const std::string n = dist_name(d);
    v.push_back({"one_token_" + n, 1, 128, {1}, d});
    v.push_back({"zero_token_experts_and_short_blocks_" + n, 1000, 384, {0, 1, 127, 128, 129, 0, 300, 315}, d});
    v.push_back({"one_token_experts_" + n, 40, 256, std::vector<int32_t>(40, 1), d});
    v.push_back({"aligned16_" + n, 2048, 512, ragged(8, 2048, 7, 16), d});
  }
  v.push_back({"v2lite_like_64_experts_outlier_token", 4096, 2048, ragged(64, 4096, 11, 1), Dist::kOutlierToken});
  v.push_back({"v3_like_k7168_aligned128_heavy", 4096, 7168, ragged(32, 4096, 5, 128), Dist::kHeavy});
  return v;
}

INSTANTIATE_TEST_SUITE_P(Cases, ColumnAmaxGpu, ::testing::ValuesIn(cases()),
                         [](const ::testing::TestParamInfo<Case>& i) { return i.param.name; });

}  // namespace
}  // namespace flowmoe
