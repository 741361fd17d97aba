// GPU conversion kernels against the CPU reference, bit for bit: codes, scales and counters.
// Runs on the device machine only (CTest label `gpu`).
#include <cuda_runtime.h>
#include <gtest/gtest.h>

#include <cmath>
#include <cstring>
#include <random>
#include <string>
#include <vector>

#include "flowmoe/cpu/convert.h"
#include "flowmoe/cuda/convert.h"
#include "flowmoe/error.h"
#include "flowmoe/numerics.h"
#include "cuda/gpu_test_util.h"

namespace flowmoe {
namespace {

using namespace testutil;  // DBuf, REQUIRE_DEVICE, ASSERT_CUDA_OK, expect_same_bits

enum class Dist { kNormal, kHeavy, kBinades, kSubnormal, kNearMax, kNonFinite };
const char* dist_name(Dist d) {
  switch (d) {
    case Dist::kNormal: return "normal";
    case Dist::kHeavy: return "heavy";
    case Dist::kBinades: return "binades";
    case Dist::kSubnormal: return "subnormal";
    case Dist::kNearMax: return "nearmax";
    case Dist::kNonFinite: return "nonfinite";
  }
  return "?";
}

std::vector<bf16_t> make_data(int64_t m, int64_t k, Dist d, uint32_t seed) {
  std::mt19937 rng(seed);
  std::normal_distribution<float> nd(0.f, 1.f);
  std::uniform_real_distribution<float> ud(0.f, 1.f);
  std::vector<bf16_t> x(m * k);
  for (auto& v : x) {
    float f = nd(rng);
    switch (d) {
      case Dist::kNormal: break;
      case Dist::kHeavy: if (ud(rng) < 0.002f) f *= 100.f + 900.f * ud(rng); break;
      case Dist::kBinades: f = (ud(rng) < 0.5f ? -1.f : 1.f) * std::ldexp(1.f + ud(rng), static_cast<int>(ud(rng) * 50) - 35); break;
      case Dist::kSubnormal: f = std::ldexp(f, -130); break;  // bf16 subnormals and tiny normals
      case Dist::kNearMax: f = (ud(rng) < 0.5f ? -1.f : 1.f) * (ud(rng) < 0.3f ? 3.0e38f : 448.f * (1.f + ud(rng))); break;
      case Dist::kNonFinite: {
        const float u = ud(rng);
        if (u < 0.0005f) f = NAN;
        else if (u < 0.001f) f = INFINITY;
        else if (u < 0.0015f) f = -INFINITY;
        break;
      }
    }
    v = num::f32_to_bf16(f);
  }
  return x;
}

struct Case {
  std::string name;
  int64_t m, k;
  std::vector<int32_t> counts;  // tokens per segment
  Dist dist;
};

std::vector<int32_t> ragged(int e, int64_t m, uint32_t seed, int align) {
  std::mt19937 rng(seed);
  std::vector<int32_t> c(e, 0);
  int64_t left = m / align;
  for (int i = 0; i < e - 1 && left > 0; ++i) {
    const int64_t take = (i % 5 == 3) ? 0 : static_cast<int64_t>(rng() % (2 * left / (e - i) + 1));
    c[i] = static_cast<int32_t>(std::min(take, left) * align);
    left -= std::min(take, left);
  }
  c[e - 1] = static_cast<int32_t>(m - [&] { int64_t s = 0; for (int i = 0; i < e - 1; ++i) s += c[i]; return s; }());
  return c;
}

class ConvertGpu : public ::testing::TestWithParam<Case> {
 protected:
  void SetUp() override {
    REQUIRE_DEVICE();
    ASSERT_CUDA_OK(cudaMalloc(&status_, sizeof(cuda::DeviceStatus)));
    reset();
  }
  void TearDown() override { cudaFree(status_); }
  void reset() { cudaMemset(status_, 0, sizeof(cuda::DeviceStatus)); }
  cuda::DeviceStatus status() {
    cuda::DeviceStatus s{};
    cudaDeviceSynchronize();
    cudaMemcpy(&s, status_, sizeof(s), cudaMemcpyDeviceToHost);
    return s;
  }
  cuda::DeviceStatus* status_ = nullptr;
};

TEST_P(ConvertGpu, AllConversionsBitExact) {
  const Case& c = GetParam();
  const int64_t m = c.m, k = c.k;
  const auto x = make_data(m, k, c.dist, 1234u + static_cast<uint32_t>(m * 31 + k));
  const Segments seg = Segments::from_counts(c.counts);
  ASSERT_EQ(seg.num_tokens(), m);
  const int E = seg.num_segments();
  const int64_t nb = seg.num_blocks();

  DBuf<bf16_t> dx(x);
  DBuf<int32_t> doff(seg.offsets);
  const int64_t maxb = cuda::segment_max_blocks(m, E);
  DBuf<int32_t> bstart(maxb), bend(maxb), boff(E + 1);
  cuda::SegmentBlocks sb{doff.p, E, m, maxb, bstart.p, bend.p, boff.p};
  cuda::build_segment_blocks(sb, status_, 0);
  {
    const auto bo = boff.get();
    const auto want = seg.block_offsets();
    for (int e = 0; e <= E; ++e) ASSERT_EQ(bo[e], want[e]) << "block offset of segment " << e;
    EXPECT_EQ(status().bad_segments, 0u);
  }

  // ---- row-wise
  QTensor row;
  const QuantStats st_row = cpu::quantize_row(x.data(), m, k, &row);
  DBuf<uint8_t> rc(m * k), rs(m * k / 128);
  reset();
  cuda::quantize_row(dx.p, m, k, rc.p, rs.p, status_, 0);
  expect_same_bits(row.codes, rc.get(), m * k, "quantize_row codes");
  expect_same_bits(row.scales, rs.get(), m * k / 128, "quantize_row scales");
  EXPECT_EQ(status().nonfinite, static_cast<unsigned long long>(st_row.nonfinite));

  // ---- column-wise and both
  QTensor col, row2, col2;
  const QuantStats st_col = cpu::quantize_col(x.data(), m, k, seg, &col);
  DBuf<uint8_t> cc(m * k), cs(maxb * k), rc2(m * k), rs2(m * k / 128);
  reset();
  cuda::quantize_col(dx.p, k, sb, cc.p, cs.p, nullptr, nullptr, status_, 0);
  expect_same_bits(col.codes, cc.get(), m * k, "quantize_col codes");
  expect_same_bits(col.scales, cs.get(), nb * k, "quantize_col scales");
  EXPECT_EQ(status().nonfinite, static_cast<unsigned long long>(st_col.nonfinite));
  reset();
  cuda::quantize_col(dx.p, k, sb, cc.p, cs.p, rc2.p, rs2.p, status_, 0);
  expect_same_bits(col.codes, cc.get(), m * k, "quantize_both col codes");
  expect_same_bits(row.codes, rc2.get(), m * k, "quantize_both row codes");
  expect_same_bits(row.scales, rs2.get(), m * k / 128, "quantize_both row scales");
  EXPECT_EQ(status().nonfinite, static_cast<unsigned long long>(st_row.nonfinite));

  // ---- dequantize row -> bf16
  {
    std::vector<bf16_t> want(m * k);
    cpu::dequantize(row, want.data());
    DBuf<bf16_t> y(m * k);
    cuda::dequantize_row(rc.p, rs.p, m, k, y.p, 0);
    const auto got = y.get();
    size_t bad = 0;
    for (int64_t i = 0; i < m * k; ++i) bad += want[i] != got[i];
    EXPECT_EQ(bad, 0u) << "dequantize_row";
  }

  // ---- scaling-aware transpose and the naive path, from the row-wise tensor
  {
    QTensor want;
    const QuantStats st = cpu::scaling_aware_transpose(row, seg, &want);
    DBuf<uint8_t> oc(m * k), os(maxb * k);
    reset();
    cuda::scaling_aware_transpose(rc.p, rs.p, k, sb, oc.p, os.p, status_, 0);
    expect_same_bits(want.codes, oc.get(), m * k, "scaling_aware_transpose codes");
    expect_same_bits(want.scales, os.get(), nb * k, "scaling_aware_transpose scales");
    const auto s = status();
    EXPECT_EQ(s.underflow, static_cast<unsigned long long>(st.underflow));
    EXPECT_EQ(s.nonfinite, static_cast<unsigned long long>(st.nonfinite));
    if (c.dist == Dist::kBinades && m >= 128) EXPECT_GT(st.underflow, 0) << "binade data should underflow somewhere";

    QTensor naive;
    const QuantStats stn = cpu::naive_col_copy(row, seg, &naive);
    DBuf<bf16_t> work(2 * m * k);
    reset();
    cuda::naive_col_copy(rc.p, rs.p, k, sb, oc.p, os.p, work.p, status_, 0);
    expect_same_bits(naive.codes, oc.get(), m * k, "naive_col_copy codes");
    expect_same_bits(naive.scales, os.get(), nb * k, "naive_col_copy scales");
    EXPECT_EQ(status().nonfinite, static_cast<unsigned long long>(stn.nonfinite));
  }

  // ---- MXFP4 and FP4 -> FP8
  {
    QTensor f4;
    const QuantStats st4 = cpu::quantize_mxfp4(x.data(), m, k, &f4);
    DBuf<uint8_t> fc(m * k / 2), fs(m * k / 32);
    reset();
    cuda::quantize_mxfp4(dx.p, m, k, fc.p, fs.p, status_, 0);
    expect_same_bits(f4.codes, fc.get(), m * k / 2, "quantize_mxfp4 codes");
    expect_same_bits(f4.scales, fs.get(), m * k / 32, "quantize_mxfp4 scales");
    EXPECT_EQ(status().nonfinite, static_cast<unsigned long long>(st4.nonfinite));

    std::vector<bf16_t> want(m * k);
    cpu::dequantize(f4, want.data());
    DBuf<bf16_t> y(m * k);
    cuda::dequantize_mxfp4(fc.p, fs.p, m, k, y.p, 0);
    const auto got = y.get();
    size_t bad = 0;
    for (int64_t i = 0; i < m * k; ++i) bad += want[i] != got[i];
    EXPECT_EQ(bad, 0u) << "dequantize_mxfp4";

    QTensor r8;
    const QuantStats s1 = cpu::fp4_to_fp8_row(f4, &r8);
    DBuf<uint8_t> oc(m * k), os(std::max<int64_t>(maxb * k, m * k / 128));
    reset();
    cuda::fp4_to_fp8_row(fc.p, fs.p, m, k, oc.p, os.p, status_, 0);
    expect_same_bits(r8.codes, oc.get(), m * k, "fp4_to_fp8_row codes");
    expect_same_bits(r8.scales, os.get(), m * k / 128, "fp4_to_fp8_row scales");
    auto s = status();
    EXPECT_EQ(s.underflow, static_cast<unsigned long long>(s1.underflow));
    EXPECT_EQ(s.nonfinite, static_cast<unsigned long long>(s1.nonfinite));

    QTensor c8;
    const QuantStats s2 = cpu::fp4_to_fp8_col(f4, seg, &c8);
    reset();
    cuda::fp4_to_fp8_col(fc.p, fs.p, k, sb, oc.p, os.p, status_, 0);
    expect_same_bits(c8.codes, oc.get(), m * k, "fp4_to_fp8_col codes");
    expect_same_bits(c8.scales, os.get(), nb * k, "fp4_to_fp8_col scales");
    s = status();
    EXPECT_EQ(s.underflow, static_cast<unsigned long long>(s2.underflow));
    EXPECT_EQ(s.nonfinite, static_cast<unsigned long long>(s2.nonfinite));

    QTensor c8s;
    const QuantStats s3 = cpu::fp4_to_fp8_col_stepwise(f4, seg, &c8s);
    DBuf<bf16_t> work(2 * m * k);
    reset();
    cuda::fp4_to_fp8_col_stepwise(fc.p, fs.p, k, sb, oc.p, os.p, work.p, status_, 0);
    expect_same_bits(c8s.codes, oc.get(), m * k, "fp4_to_fp8_col_stepwise codes");
    expect_same_bits(c8s.scales, os.get(), nb * k, "fp4_to_fp8_col_stepwise scales");
    EXPECT_EQ(status().nonfinite, static_cast<unsigned long long>(s3.nonfinite));
  }
  EXPECT_EQ(cudaGetLastError(), cudaSuccess);
}

std::vector<Case> cases() {
  std::vector<Case> v;
  const Dist all[] = {Dist::kNormal, Dist::kHeavy, Dist::kBinades, Dist::kSubnormal, Dist::kNearMax, Dist::kNonFinite};
  for (Dist d : all) {
    v.push_back({std::string("one_token_") + dist_name(d), 1, 128, {1}, d});
    v.push_back({std::string("ragged_") + dist_name(d), 1000, 384, {0, 1, 127, 128, 129, 0, 300, 315}, d});
    v.push_back({std::string("aligned16_") + dist_name(d), 2048, 512, ragged(8, 2048, 7, 16), d});
  }
  v.push_back({"zero_token_experts_only_one_full", 256, 256, {0, 0, 256, 0}, Dist::kNormal});
  v.push_back({"odd_m_single_segment", 777, 256, {777}, Dist::kHeavy});
  v.push_back({"v2lite_like_64_experts", 4096, 2048, ragged(64, 4096, 11, 1), Dist::kHeavy});
  v.push_back({"v3_like_aligned128", 8192, 7168, ragged(32, 8192, 5, 128), Dist::kNormal});
  return v;
}

INSTANTIATE_TEST_SUITE_P(Cases, ConvertGpu, ::testing::ValuesIn(cases()),
                         [](const ::testing::TestParamInfo<Case>& i) { return i.param.name; });

// ---- weights ------------------------------------------------------------------------------
TEST(ConvertGpuWeight, QuantizeWeightAndTransposeBitExact) {
  REQUIRE_DEVICE();
  for (Dist d : {Dist::kNormal, Dist::kHeavy, Dist::kNonFinite}) {
    const int64_t n = 384, k = 1024;
    const auto w = make_data(n, k, d, 99);
    QTensor q, qt;
    const QuantStats st = cpu::quantize_weight(w.data(), n, k, &q, &qt);
    DBuf<bf16_t> dw(w);
    DBuf<uint8_t> c(n * k), s(n * k / 16384), tc(n * k), ts(n * k / 16384);
    DBuf<cuda::DeviceStatus> ds(1);
    cudaMemset(ds.p, 0, sizeof(cuda::DeviceStatus));
    cuda::quantize_weight(dw.p, n, k, c.p, s.p, tc.p, ts.p, ds.p, 0);
    expect_same_bits(q.codes, c.get(), n * k, "weight codes");
    expect_same_bits(q.scales, s.get(), n * k / 16384, "weight scales");
    expect_same_bits(qt.codes, tc.get(), n * k, "weight transposed codes");
    expect_same_bits(qt.scales, ts.get(), n * k / 16384, "weight transposed scales");
    EXPECT_EQ(ds.get()[0].nonfinite, static_cast<unsigned long long>(st.nonfinite)) << dist_name(d);
  }
}

// quantize_weights: E experts in one launch, each expert's bits those of the CPU reference on its
// slice; 50 experts: 300 blocks, more than the staged BF16 kernel's CTAs (two per SM), so that
// CTAs encode a block while the next one's copies are in flight
TEST(ConvertGpuWeight, QuantizeWeightsBatchedBitExactPerExpert) {
  REQUIRE_DEVICE();
  const int experts = 50;
  const int64_t n = 256, k = 384, elems = n * k, blocks = elems / 16384;
  std::vector<bf16_t> w;
  for (int e = 0; e < experts; ++e) {
    const auto we = make_data(n, k, e == 1 ? Dist::kNonFinite : Dist::kHeavy, 200 + e);
    w.insert(w.end(), we.begin(), we.end());
  }
  DBuf<bf16_t> dw(w);
  DBuf<uint8_t> c(experts * elems), s(experts * blocks), tc(experts * elems), ts(experts * blocks);
  DBuf<cuda::DeviceStatus> ds(1);
  cudaMemset(ds.p, 0, sizeof(cuda::DeviceStatus));
  cuda::quantize_weights(dw.p, experts, n, k, c.p, s.p, tc.p, ts.p, ds.p, 0);
  const auto codes = c.get(), scales = s.get(), tcodes = tc.get(), tscales = ts.get();
  int64_t nonfinite = 0;
  for (int e = 0; e < experts; ++e) {
    SCOPED_TRACE("expert " + std::to_string(e));
    QTensor q, qt;
    nonfinite += cpu::quantize_weight(w.data() + e * elems, n, k, &q, &qt).nonfinite;
    expect_same_bits(q.codes, std::vector<uint8_t>(codes.begin() + e * elems, codes.begin() + (e + 1) * elems), elems,
                     "codes");
    expect_same_bits(q.scales, std::vector<uint8_t>(scales.begin() + e * blocks, scales.begin() + (e + 1) * blocks),
                     blocks, "scales");
    expect_same_bits(qt.codes, std::vector<uint8_t>(tcodes.begin() + e * elems, tcodes.begin() + (e + 1) * elems),
                     elems, "transposed codes");
    expect_same_bits(qt.scales,
                     std::vector<uint8_t>(tscales.begin() + e * blocks, tscales.begin() + (e + 1) * blocks), blocks,
                     "transposed scales");
  }
  EXPECT_GT(nonfinite, 0);
  EXPECT_EQ(ds.get()[0].nonfinite, static_cast<unsigned long long>(nonfinite));
  EXPECT_THROW(cuda::quantize_weights(dw.p, 0, n, k, c.p, s.p, tc.p, ts.p, ds.p, 0), Error);
  // the transposed copy alone (the backward's dgrad weights from the parameters): the same bits
  DBuf<uint8_t> tc2(experts * elems), ts2(experts * blocks);
  cuda::quantize_weights(dw.p, experts, n, k, nullptr, nullptr, tc2.p, ts2.p, nullptr, 0);
  expect_same_bits(tcodes, tc2.get(), experts * elems, "transposed codes alone");
  expect_same_bits(tscales, ts2.get(), experts * blocks, "transposed scales alone");
  EXPECT_THROW(cuda::quantize_weights(dw.p, experts, n, k, nullptr, nullptr, nullptr, nullptr, nullptr, 0), Error)
      << "no output";
  EXPECT_THROW(cuda::quantize_weights(dw.p, experts, n, k, c.p, nullptr, tc.p, ts.p, nullptr, 0), Error)
      << "codes without scales";
}

// quantize_weights with gate_up_interleaved (W1 as GroupedGemm::fprop_swiglu reads it): W's codes
// and scales those of the natural copy permuted by whole 128-row blocks (interleave_gate_up), W^T as
// it is; BF16 (the staged kernel) and FP32 masters; N not 2F with F % 128 == 0 is a clear error.
TEST(ConvertGpuWeight, QuantizeWeightsGateUpInterleaved) {
  REQUIRE_DEVICE();
  const int experts = 3;
  const int64_t n = 768, k = 256, elems = n * k, blocks = elems / 16384;
  const std::vector<float> wf = normal_f32(size_t(experts) * elems, 0.05f, 91u);
  std::vector<bf16_t> wb(wf.size());
  for (size_t i = 0; i < wf.size(); ++i) wb[i] = num::f32_to_bf16(wf[i]);
  DBuf<bf16_t> dwb(wb);
  DBuf<float> dwf(wf);
  for (bool fp32 : {false, true}) {
    SCOPED_TRACE(fp32 ? "fp32 masters" : "bf16");
    DBuf<uint8_t> c(experts * elems), s(experts * blocks), tc(experts * elems), ts(experts * blocks);
    DBuf<uint8_t> ci(experts * elems), si(experts * blocks), tci(experts * elems), tsi(experts * blocks);
    if (fp32) {
      cuda::quantize_weights(dwf.p, experts, n, k, c.p, s.p, tc.p, ts.p, nullptr, 0);
      cuda::quantize_weights(dwf.p, experts, n, k, ci.p, si.p, tci.p, tsi.p, nullptr, 0, /*gate_up_interleaved=*/true);
    } else {
      cuda::quantize_weights(dwb.p, experts, n, k, c.p, s.p, tc.p, ts.p, nullptr, 0);
      cuda::quantize_weights(dwb.p, experts, n, k, ci.p, si.p, tci.p, tsi.p, nullptr, 0, /*gate_up_interleaved=*/true);
    }
    const int64_t nb = n / 128;
    expect_same_bits(gate_up_interleaved(c.get(), experts, nb, 128 * k), ci.get(), "interleaved codes");
    expect_same_bits(gate_up_interleaved(s.get(), experts, nb, k / 128), si.get(), "interleaved scales");
    expect_same_bits(tc.get(), tci.get(), "transposed codes");
    expect_same_bits(ts.get(), tsi.get(), "transposed scales");
  }
  DBuf<uint8_t> c(experts * 384 * k), s(experts * 3 * 2);
  expect_error([&] { cuda::quantize_weights(dwb.p, experts, 384, k, c.p, s.p, nullptr, nullptr, nullptr, 0, true); },
               "F a multiple of 128");
}

// quantize_weights on FP32 masters: the bits of quantize_weights on their BF16 (RNE) copy; the
// non-finite count is the FP32 values' (a finite FP32 value that rounds to a BF16 Inf is not counted,
// as f32_to_bf16 does not count it; its block still gets the NaN scale of the BF16 copy's).
TEST(ConvertGpuWeight, QuantizeWeightsFromFp32SameBitsAsFromItsBf16Copy) {
  REQUIRE_DEVICE();
  const int experts = 2;
  const int64_t n = 128, k = 256, elems = n * k, total = experts * elems, blocks = elems / 16384;
  std::vector<float> w(total);
  uint64_t state = 12345;
  for (float& v : w) {  // values that need rounding (all 32 bits random within a range of binades)
    state = state * 6364136223846793005ull + 1442695040888963407ull;
    const uint32_t bits = static_cast<uint32_t>(state >> 32);
    v = std::ldexp(1.0f + float(bits & 0xFFFFFF) / 16777216.0f, int((bits >> 24) % 24) - 16) *
        ((bits >> 31) ? -1.0f : 1.0f);
  }
  w[5] = std::nanf("");                // non-finite in expert 0
  w[elems + 300] = 3.4e38f;            // finite, rounds to BF16 +Inf (expert 1)
  w[elems + 4000] = -INFINITY;         // non-finite in expert 1
  std::vector<bf16_t> wb(total);
  for (int64_t i = 0; i < total; ++i) wb[i] = num::f32_to_bf16(w[i]);
  DBuf<float> df(w);
  DBuf<bf16_t> db(wb);
  DBuf<uint8_t> c1(total), s1(experts * blocks), t1(total), u1(experts * blocks);
  DBuf<uint8_t> c2(total), s2(experts * blocks), t2(total), u2(experts * blocks);
  DBuf<cuda::DeviceStatus> ds(2);
  cudaMemset(ds.p, 0, 2 * sizeof(cuda::DeviceStatus));
  cuda::quantize_weights(df.p, experts, n, k, c1.p, s1.p, t1.p, u1.p, ds.p, 0);
  cuda::quantize_weights(db.p, experts, n, k, c2.p, s2.p, t2.p, u2.p, ds.p + 1, 0);
  expect_same_bits(c2.get(), c1.get(), "codes");
  expect_same_bits(s2.get(), s1.get(), "scales");
  expect_same_bits(t2.get(), t1.get(), "transposed codes");
  expect_same_bits(u2.get(), u1.get(), "transposed scales");
  const auto st = ds.get();
  EXPECT_EQ(st[0].nonfinite, 2u);  // the FP32 NaN and -Inf
  EXPECT_EQ(st[1].nonfinite, 3u);  // and the BF16 +Inf the rounding made
}

// ---- DeepSeek-V3 scale: 32k tokens x 7168 through the headline path --------------------
TEST(ConvertGpuLarge, DeepSeekV3Scale32kTokens) {
  REQUIRE_DEVICE();
  const int64_t m = 32768, k = 7168;
  const auto x = make_data(m, k, Dist::kHeavy, 2024);
  const Segments seg = Segments::from_counts(ragged(32, m, 3, 16));
  QTensor row, col;
  cpu::quantize_row(x.data(), m, k, &row);
  const QuantStats st = cpu::scaling_aware_transpose(row, seg, &col);
  DBuf<bf16_t> dx(x);
  DBuf<int32_t> doff(seg.offsets);
  const int E = seg.num_segments();
  const int64_t maxb = cuda::segment_max_blocks(m, E);
  DBuf<int32_t> bstart(maxb), bend(maxb), boff(E + 1);
  DBuf<cuda::DeviceStatus> ds(1);
  cudaMemset(ds.p, 0, sizeof(cuda::DeviceStatus));
  cuda::SegmentBlocks sb{doff.p, E, m, maxb, bstart.p, bend.p, boff.p};
  cuda::build_segment_blocks(sb, ds.p, 0);
  DBuf<uint8_t> rc(m * k), rs(m * k / 128), cc(m * k), cs(maxb * k);
  cuda::quantize_row(dx.p, m, k, rc.p, rs.p, ds.p, 0);
  cuda::scaling_aware_transpose(rc.p, rs.p, k, sb, cc.p, cs.p, ds.p, 0);
  expect_same_bits(row.codes, rc.get(), m * k, "row codes");
  expect_same_bits(row.scales, rs.get(), m * k / 128, "row scales");
  expect_same_bits(col.codes, cc.get(), m * k, "col codes");
  expect_same_bits(col.scales, cs.get(), seg.num_blocks() * k, "col scales");
  EXPECT_EQ(ds.get()[0].underflow, static_cast<unsigned long long>(st.underflow));
}


// ---- NaN codes under finite scales (e.g. from a file) stay NaN and are counted -----------
TEST(ConvertGpuNaNCodes, ScalingAwareTransposeCountsNaNCodesUnderFiniteScales) {
  REQUIRE_DEVICE();
  const int64_t m = 300, k = 256;
  const auto x = make_data(m, k, Dist::kHeavy, 31);
  QTensor row, want;
  cpu::quantize_row(x.data(), m, k, &row);
  row.codes[5] = 0x7F;
  row.codes[1000] = 0xFF;
  row.codes[200 * k + 3] = 0x7F;
  const Segments seg = Segments::from_counts({100, 0, 200});
  const QuantStats st = cpu::scaling_aware_transpose(row, seg, &want);
  EXPECT_EQ(st.nonfinite, 3);
  DBuf<uint8_t> rc(row.codes), rs(row.scales);
  DBuf<int32_t> doff(seg.offsets);
  const int E = seg.num_segments();
  const int64_t maxb = cuda::segment_max_blocks(m, E);
  DBuf<int32_t> bstart(maxb), bend(maxb), boff(E + 1);
  DBuf<cuda::DeviceStatus> ds(1);
  cudaMemset(ds.p, 0, sizeof(cuda::DeviceStatus));
  cuda::SegmentBlocks sb{doff.p, E, m, maxb, bstart.p, bend.p, boff.p};
  cuda::build_segment_blocks(sb, ds.p, 0);
  DBuf<uint8_t> cc(m * k), cs(maxb * k);
  cuda::scaling_aware_transpose(rc.p, rs.p, k, sb, cc.p, cs.p, ds.p, 0);
  expect_same_bits(want.codes, cc.get(), m * k, "codes with NaN codes");
  expect_same_bits(want.scales, cs.get(), seg.num_blocks() * k, "scales with NaN codes");
  const auto s = ds.get()[0];
  EXPECT_EQ(s.nonfinite, 3u);
  EXPECT_EQ(s.underflow, static_cast<unsigned long long>(st.underflow));
}


// ---- the column-amax transpose (TransposeExponent::kColumnAmax) equals the CPU reference -----
TEST(ConvertGpuColumnAmax, BitExactAgainstCpuOnSeveralDistributions) {
  REQUIRE_DEVICE();
  for (Dist dist : {Dist::kNormal, Dist::kHeavy, Dist::kBinades, Dist::kNonFinite, Dist::kSubnormal}) {
    const int64_t m = 1000, k = 384;
    const auto x = make_data(m, k, dist, 77);
    QTensor row, want;
    cpu::quantize_row(x.data(), m, k, &row);
    row.codes[3 * k + 5] = 0x7F;  // a NaN code under a finite scale
    const Segments seg = Segments::from_counts({0, 1, 127, 128, 129, 0, 300, 315});
    const QuantStats st = cpu::scaling_aware_transpose(row, seg, &want, TransposeExponent::kColumnAmax);
    DBuf<uint8_t> rc(row.codes), rs(row.scales);
    DBuf<int32_t> doff(seg.offsets);
    const int E = seg.num_segments();
    const int64_t maxb = cuda::segment_max_blocks(m, E);
    DBuf<int32_t> bstart(maxb), bend(maxb), boff(E + 1);
    DBuf<cuda::DeviceStatus> ds(1);
    cudaMemset(ds.p, 0, sizeof(cuda::DeviceStatus));
    cuda::SegmentBlocks sb{doff.p, E, m, maxb, bstart.p, bend.p, boff.p};
    cuda::build_segment_blocks(sb, ds.p, 0);
    DBuf<uint8_t> cc(m * k), cs(maxb * k);
    cuda::scaling_aware_transpose(rc.p, rs.p, k, sb, cc.p, cs.p, ds.p, 0, TransposeExponent::kColumnAmax);
    expect_same_bits(want.codes, cc.get(), m * k, (std::string("column-amax codes, ") + dist_name(dist)).c_str());
    expect_same_bits(want.scales, cs.get(), seg.num_blocks() * k, (std::string("column-amax scales, ") + dist_name(dist)).c_str());
    const auto s2 = ds.get()[0];
    EXPECT_EQ(s2.underflow, static_cast<unsigned long long>(st.underflow)) << dist_name(dist);
    EXPECT_EQ(s2.nonfinite, static_cast<unsigned long long>(st.nonfinite)) << dist_name(dist);
  }
}

// ---- segments and argument errors ---------------------------------------------------------
TEST(ConvertGpuSegments, MalformedOffsetsAreReportedNotHung) {
  REQUIRE_DEVICE();
  const std::vector<int32_t> bad = {0, 50, 20, 100};  // decreasing
  DBuf<int32_t> doff(bad);
  const int64_t maxb = cuda::segment_max_blocks(100, 3);
  DBuf<int32_t> bstart(maxb), bend(maxb), boff(4);
  DBuf<cuda::DeviceStatus> ds(1);
  cudaMemset(ds.p, 0, sizeof(cuda::DeviceStatus));
  cuda::SegmentBlocks sb{doff.p, 3, 100, maxb, bstart.p, bend.p, boff.p};
  cuda::build_segment_blocks(sb, ds.p, 0);
  EXPECT_EQ(ds.get()[0].bad_segments, 1u);
  for (int32_t s : bstart.get()) EXPECT_EQ(s, -1);
}

TEST(ConvertGpuArgs, BadArgumentsThrowClearErrors) {
  DBuf<bf16_t> x(256);
  DBuf<uint8_t> c(256), s(4);
  try {
    cuda::quantize_row(x.p, 2, 100, c.p, s.p, nullptr, 0);
    FAIL() << "expected an error for K = 100";
  } catch (const Error& e) {
    EXPECT_NE(std::string(e.what()).find("multiple of 128"), std::string::npos) << e.what();
  }
  try {
    cuda::quantize_row(x.p + 1, 1, 128, c.p, s.p, nullptr, 0);
    FAIL() << "expected an alignment error";
  } catch (const Error& e) {
    EXPECT_NE(std::string(e.what()).find("16-byte aligned"), std::string::npos) << e.what();
  }
  cuda::SegmentBlocks sb{};
  try {
    cuda::scaling_aware_transpose(c.p, s.p, 128, sb, c.p, s.p, nullptr, 0);
    FAIL() << "expected an error for unbuilt segment blocks";
  } catch (const Error& e) {
    EXPECT_NE(std::string(e.what()).find("build_segment_blocks"), std::string::npos) << e.what();
  }
}

}  // namespace
}  // namespace flowmoe
