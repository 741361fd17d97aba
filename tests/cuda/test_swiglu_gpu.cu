// SwiGLU kernels (flowmoe/swiglu.h) against the CPU reference, bit for bit: BF16 outputs, codes,
// scales and counters, for every entry point, on several distributions (including overflow and
// non-finite input), odd token counts and ragged segments with empty experts; with the default
// activation (SwiGLU) and the clamped SwiGLU of gpt-oss (the `clamped_` cases).
// Runs on the device machine only (CTest label `gpu`); skips without a device.
#include <cuda_runtime.h>
#include <gtest/gtest.h>

#include <algorithm>
#include <cmath>
#include <cstdio>
#include <functional>
#include <string>
#include <vector>

#include "common/reference.h"
#include "common/swiglu_data.h"
#include "flowmoe/cpu/convert.h"
#include "flowmoe/cuda/convert.h"
#include "flowmoe/error.h"
#include "flowmoe/numerics.h"
#include "flowmoe/swiglu.h"
#include "flowmoe/swiglu_math.h"
#include "cuda/gpu_test_util.h"

namespace flowmoe {
namespace {

using namespace testutil;  // DBuf, REQUIRE_DEVICE, ASSERT_CUDA_OK, expect_same_bits

// ---- num::f_rcp on the device: every binary32 in [1, 2] ------------------------------------------
// The device f_rcp is MUFU.RCP plus one FMA Newton step (swiglu_math.h); it must be the correctly
// rounded reciprocal wherever the SwiGLU code calls it, i.e. equal __frcp_rn and the host's 1.0f / a.
__global__ void rcp_one_to_two_kernel(float* out, unsigned long long* mismatches) {
  const uint32_t n = 0x40000000u - 0x3F800000u + 1;
  unsigned long long bad = 0;
  for (uint32_t i = blockIdx.x * blockDim.x + threadIdx.x; i < n; i += gridDim.x * blockDim.x) {
    const float a = __uint_as_float(0x3F800000u + i);
    const float y = num::f_rcp(a);
    out[i] = y;
    bad += __float_as_uint(y) != __float_as_uint(__frcp_rn(a));
  }
  if (bad) atomicAdd(mismatches, bad);
}

TEST(SwigluMathGpu, ReciprocalIsCorrectlyRoundedOnOneToTwo) {
  REQUIRE_DEVICE();
  const uint32_t n = 0x40000000u - 0x3F800000u + 1;
  DBuf<float> out(n);
  DBuf<unsigned long long> bad(1);
  ASSERT_CUDA_OK(cudaMemset(bad.p, 0, sizeof(unsigned long long)));
  rcp_one_to_two_kernel<<<1024, 256>>>(out.p, bad.p);
  ASSERT_CUDA_OK(cudaGetLastError());
  ASSERT_CUDA_OK(cudaDeviceSynchronize());
  EXPECT_EQ(bad.get()[0], 0u) << "f_rcp differs from __frcp_rn";
  const std::vector<float> got = out.get();
  int64_t host_bad = 0;
  for (uint32_t i = 0; i < n; ++i) {
    const float a = num::f32_from_bits(0x3F800000u + i);
    const float want = 1.0f / a;
    if (num::f32_bits(got[i]) != num::f32_bits(want) && ++host_bad <= 5)
      ADD_FAILURE() << "f_rcp(" << a << ") = " << got[i] << ", host 1/a = " << want;
  }
  EXPECT_EQ(host_bad, 0);
}

// ---- data: the generator shared with tests/cpu/test_swiglu.cpp (tests/common/swiglu_data.h) ----
using flowmoe_test::HDist;
using flowmoe_test::hdist_name;
using flowmoe_test::make_bf16;

std::vector<int32_t> ragged(int e, int64_t m, uint32_t seed, int align) {
  flowmoe_test::Rng rng(seed);
  std::vector<int32_t> c(e, 0);
  int64_t left = m / align;
  for (int i = 0; i < e - 1 && left > 0; ++i) {
    const int64_t take = (i % 5 == 3) ? 0 : static_cast<int64_t>(rng.next() % (2 * left / (e - i) + 1));
    c[i] = static_cast<int32_t>(std::min(take, left) * align);
    left -= std::min(take, left);
  }
  int64_t s = 0;
  for (int i = 0; i < e - 1; ++i) s += c[i];
  c[e - 1] = static_cast<int32_t>(m - s);
  return c;
}

struct Case {
  std::string name;
  std::vector<int32_t> counts;
  int64_t f;
  HDist dist;
  int64_t zero_row_every;
  GatedActivation act = {};  // every launcher gets it
  int64_t m() const {
    int64_t s = 0;
    for (int32_t c : counts) s += c;
    return s;
  }
};

// H of a case: make_bf16's values; for the clamped activation scaled by 6 (N(0, 1) * 6 puts about
// 24% of gate and up beyond the limit 7), with the clamp's boundary values sprinkled in (+-7 pass
// the gradient, +-7.03125, the next BF16, do not) and -1 (up + 1 = 0).
std::vector<bf16_t> make_h(const Case& c, int64_t rows, int64_t cols, uint64_t seed) {
  auto h = make_bf16(c.dist, rows, cols, seed, c.zero_row_every);
  if (!c.act.clamped()) return h;
  const float sp[] = {7.0f, -7.0f, 7.03125f, -7.03125f, -1.0f};
  for (size_t i = 0; i < h.size(); ++i) {
    h[i] = num::bf16_canonical(6.0f * num::bf16_to_f32(h[i]));
    if (i % 23 == 5 && h[i] != 0) h[i] = num::bf16_canonical(sp[(i / 23) % 5]);
  }
  return h;
}

// Device-side segment blocks for a Segments table.
struct DevSegments {
  DBuf<int32_t> offsets, start, end, boff;
  cuda::SegmentBlocks sb;
  DevSegments(const Segments& seg, cuda::DeviceStatus* st)
      : offsets(seg.offsets),
        start(cuda::segment_max_blocks(seg.num_tokens(), seg.num_segments())),
        end(cuda::segment_max_blocks(seg.num_tokens(), seg.num_segments())),
        boff(seg.num_segments() + 1) {
    sb = cuda::SegmentBlocks{offsets.p, seg.num_segments(), seg.num_tokens(),
                             cuda::segment_max_blocks(seg.num_tokens(), seg.num_segments()),
                             start.p, end.p, boff.p};
    cuda::build_segment_blocks(sb, st, 0);
  }
};

class SwigluGpu : public ::testing::TestWithParam<Case> {
 protected:
  void SetUp() override {
    REQUIRE_DEVICE();
    ASSERT_CUDA_OK(cudaMalloc(&status_, sizeof(cuda::DeviceStatus)));
    reset();
  }
  void TearDown() override {
    if (status_) cudaFree(status_);
  }
  void reset() { cudaMemset(status_, 0, sizeof(cuda::DeviceStatus)); }
  cuda::DeviceStatus status() {
    cuda::DeviceStatus s{};
    EXPECT_EQ(cudaDeviceSynchronize(), cudaSuccess);
    cudaMemcpy(&s, status_, sizeof(s), cudaMemcpyDeviceToHost);
    return s;
  }
  cuda::DeviceStatus* status_ = nullptr;
};

using ull = unsigned long long;

TEST_P(SwigluGpu, ForwardBitExact) {
  const Case& c = GetParam();
  const int64_t m = c.m(), f = c.f;
  const Segments seg = Segments::from_counts(c.counts);
  const int64_t nb = seg.num_blocks();
  const auto h = make_h(c, m, 2 * f, 1000 + m + f);
  DBuf<bf16_t> dh(h);
  DevSegments ds(seg, status_);
  const int64_t maxb = ds.sb.max_blocks;
  EXPECT_EQ(status().bad_segments, 0u);

  // ---- plain BF16
  std::vector<bf16_t> a16(m * f);
  const GatedActivation& act = c.act;
  const QuantStats st16 = cpu::swiglu(h.data(), m, f, a16.data(), nullptr, act);
  DBuf<bf16_t> da16(m * f);
  reset();
  cuda::swiglu(dh.p, m, f, da16.p, status_, 0, nullptr, nullptr, act);
  expect_same_bits(a16, da16.get(), m * f, "swiglu bf16");
  EXPECT_EQ(status().nonfinite, static_cast<ull>(st16.nonfinite));
  cuda::swiglu(dh.p, m, f, da16.p, nullptr, 0, nullptr, nullptr, act);  // no status: same output
  expect_same_bits(a16, da16.get(), m * f, "swiglu bf16 (no status)");

  // ---- fused, row-wise only
  QTensor row, col, hq;
  const QuantStats st_row = cpu::swiglu_quant(h.data(), m, f, &row, nullptr, nullptr, nullptr, nullptr, act);
  const QuantStats st_all = cpu::swiglu_quant(h.data(), m, f, &row, &seg, &col, &hq, nullptr, act);
  const int64_t nonfinite_h = st_all.nonfinite - st_row.nonfinite;
  DBuf<uint8_t> rc(m * f), rs(m * f / 128), cc(m * f), cs(maxb * f), hc(2 * m * f), hs(2 * m * f / 128);
  reset();
  cuda::swiglu_quant(dh.p, m, f, rc.p, rs.p, nullptr, nullptr, status_, 0, nullptr, nullptr, act);
  expect_same_bits(row.codes, rc.get(), m * f, "swiglu_quant codes");
  expect_same_bits(row.scales, rs.get(), m * f / 128, "swiglu_quant scales");
  EXPECT_EQ(status().nonfinite, static_cast<ull>(st_row.nonfinite));

  // ---- fused, row-wise + H saved as FP8
  DBuf<uint8_t> rc2(m * f), rs2(m * f / 128);
  reset();
  cuda::swiglu_quant(dh.p, m, f, rc2.p, rs2.p, hc.p, hs.p, status_, 0, nullptr, nullptr, act);
  expect_same_bits(row.codes, rc2.get(), m * f, "swiglu_quant+H codes");
  expect_same_bits(row.scales, rs2.get(), m * f / 128, "swiglu_quant+H scales");
  expect_same_bits(hq.codes, hc.get(), 2 * m * f, "swiglu_quant H codes");
  expect_same_bits(hq.scales, hs.get(), 2 * m * f / 128, "swiglu_quant H scales");
  EXPECT_EQ(status().nonfinite, static_cast<ull>(st_all.nonfinite));

  // ---- fused with the column-wise copy, without and with H
  for (int with_h = 0; with_h < 2; ++with_h) {
    DBuf<uint8_t> rc3(m * f), rs3(m * f / 128), cc3(m * f), cs3(maxb * f), hc3(2 * m * f), hs3(2 * m * f / 128);
    reset();
    cuda::swiglu_quant_col(dh.p, f, ds.sb, rc3.p, rs3.p, cc3.p, cs3.p, with_h ? hc3.p : nullptr,
                           with_h ? hs3.p : nullptr, status_, 0, nullptr, act);
    const std::string w = with_h ? " (+H)" : "";
    expect_same_bits(row.codes, rc3.get(), m * f, "swiglu_quant_col row codes" + w);
    expect_same_bits(row.scales, rs3.get(), m * f / 128, "swiglu_quant_col row scales" + w);
    expect_same_bits(col.codes, cc3.get(), m * f, "swiglu_quant_col col codes" + w);
    expect_same_bits(col.scales, cs3.get(), nb * f, "swiglu_quant_col col scales" + w);
    if (with_h) {
      expect_same_bits(hq.codes, hc3.get(), 2 * m * f, "swiglu_quant_col H codes");
      expect_same_bits(hq.scales, hs3.get(), 2 * m * f / 128, "swiglu_quant_col H scales");
    }
    const auto s = status();
    EXPECT_EQ(s.nonfinite, static_cast<ull>(st_row.nonfinite + (with_h ? nonfinite_h : 0))) << w;
    EXPECT_EQ(s.underflow, static_cast<ull>(st_all.underflow)) << w;
  }

  // ---- the chained route gives the same column copy: row-wise kernel, then the existing
  //      scaling-aware transpose
  reset();
  cuda::scaling_aware_transpose(rc.p, rs.p, f, ds.sb, cc.p, cs.p, status_, 0);
  expect_same_bits(col.codes, cc.get(), m * f, "chained transpose codes");
  expect_same_bits(col.scales, cs.get(), nb * f, "chained transpose scales");
  EXPECT_EQ(status().underflow, static_cast<ull>(st_all.underflow));

  if (c.dist == HDist::kNonFinite && m >= 127) EXPECT_GT(st_row.nonfinite, 0);
  EXPECT_EQ(cudaGetLastError(), cudaSuccess);
}

TEST_P(SwigluGpu, BackwardBitExact) {
  const Case& c = GetParam();
  const int64_t m = c.m(), f = c.f, k = 2 * f;
  const Segments seg = Segments::from_counts(c.counts);
  const int64_t nb = seg.num_blocks();
  const auto h = make_h(c, m, k, 2000 + m + f);
  const auto da = make_bf16(c.dist == HDist::kNonFinite ? HDist::kNonFinite : HDist::kHeavy, m, f, 3000 + m,
                            c.zero_row_every);
  DBuf<bf16_t> dh_in(h), dda(da);
  DevSegments ds(seg, status_);
  const int64_t maxb = ds.sb.max_blocks;

  // ---- plain BF16 dH
  std::vector<bf16_t> dh(m * k);
  const GatedActivation& act = c.act;
  const QuantStats st_dh = cpu::dswiglu(da.data(), h.data(), m, f, dh.data(), nullptr, nullptr, act);
  DBuf<bf16_t> ddh(m * k);
  reset();
  cuda::dswiglu(dda.p, dh_in.p, m, f, ddh.p, status_, 0, nullptr, nullptr, nullptr, act);
  expect_same_bits(dh, ddh.get(), m * k, "dswiglu bf16");
  EXPECT_EQ(status().nonfinite, static_cast<ull>(st_dh.nonfinite));

  // ---- fused
  QTensor row, col;
  const QuantStats st = cpu::dswiglu_quant(da.data(), h.data(), m, f, seg, &row, &col, nullptr, nullptr, act);
  DBuf<uint8_t> rc(m * k), rs(m * k / 128), cc(m * k), cs(maxb * k);
  reset();
  cuda::dswiglu_quant(dda.p, dh_in.p, f, ds.sb, rc.p, rs.p, cc.p, cs.p, status_, 0, nullptr, nullptr, act);
  expect_same_bits(row.codes, rc.get(), m * k, "dswiglu_quant row codes");
  expect_same_bits(row.scales, rs.get(), m * k / 128, "dswiglu_quant row scales");
  expect_same_bits(col.codes, cc.get(), m * k, "dswiglu_quant col codes");
  expect_same_bits(col.scales, cs.get(), nb * k, "dswiglu_quant col scales");
  EXPECT_EQ(status().nonfinite, static_cast<ull>(st.nonfinite));

  // ---- the unfused sequence (SwiGLU only): same bits
  if (!act.clamped()) {
    DBuf<uint8_t> rc2(m * k), rs2(m * k / 128), cc2(m * k), cs2(maxb * k);
    DBuf<bf16_t> work(m * k);
    reset();
    cuda::dswiglu_quant_unfused(dda.p, dh_in.p, f, ds.sb, rc2.p, rs2.p, cc2.p, cs2.p, work.p, status_, 0);
    expect_same_bits(row.codes, rc2.get(), m * k, "unfused row codes");
    expect_same_bits(row.scales, rs2.get(), m * k / 128, "unfused row scales");
    expect_same_bits(col.codes, cc2.get(), m * k, "unfused col codes");
    expect_same_bits(col.scales, cs2.get(), nb * k, "unfused col scales");
    EXPECT_EQ(status().nonfinite, static_cast<ull>(st.nonfinite));
  }

  // ---- H saved as row-wise FP8
  {
    QTensor hq, row8, col8;
    cpu::quantize_row(h.data(), m, k, &hq);
    const QuantStats st8 = cpu::dswiglu_quant(da.data(), hq, seg, &row8, &col8, nullptr, nullptr, act);
    DBuf<uint8_t> hc(hq.codes), hs(hq.scales);
    DBuf<uint8_t> rc2(m * k), rs2(m * k / 128), cc2(m * k), cs2(maxb * k);
    reset();
    cuda::dswiglu_quant_fp8h(dda.p, hc.p, hs.p, f, ds.sb, rc2.p, rs2.p, cc2.p, cs2.p, status_, 0, nullptr, nullptr,
                             act);
    expect_same_bits(row8.codes, rc2.get(), m * k, "dswiglu_quant_fp8h row codes");
    expect_same_bits(row8.scales, rs2.get(), m * k / 128, "dswiglu_quant_fp8h row scales");
    expect_same_bits(col8.codes, cc2.get(), m * k, "dswiglu_quant_fp8h col codes");
    expect_same_bits(col8.scales, cs2.get(), nb * k, "dswiglu_quant_fp8h col scales");
    EXPECT_EQ(status().nonfinite, static_cast<ull>(st8.nonfinite));
  }
  if (c.dist == HDist::kNonFinite && m >= 127) EXPECT_GT(st.nonfinite, 0);
  EXPECT_EQ(cudaGetLastError(), cudaSuccess);
}

// Routing probabilities of the rows: mostly uniform in (0, 1), some exactly 0 (padding rows), 1,
// powers of two, and tiny values whose products underflow.
std::vector<float> make_prow(int64_t m, uint64_t seed) {
  flowmoe_test::Rng rng(seed);
  std::vector<float> p(static_cast<size_t>(m));
  for (int64_t r = 0; r < m; ++r) {
    const double u = rng.uniform();
    if (u < 0.05) p[r] = 0.0f;
    else if (u < 0.10) p[r] = 1.0f;
    else if (u < 0.15) p[r] = std::ldexp(1.0f, -static_cast<int>(rng.next() % 8));
    else if (u < 0.17) p[r] = 1e-30f;
    else p[r] = static_cast<float>(rng.uniform(1e-3, 1.0));
  }
  return p;
}

TEST_P(SwigluGpu, ForwardWithProbBitExact) {
  const Case& c = GetParam();
  const int64_t m = c.m(), f = c.f;
  const Segments seg = Segments::from_counts(c.counts);
  const int64_t nb = seg.num_blocks();
  const auto h = make_h(c, m, 2 * f, 4000 + m + f);
  const auto prow = make_prow(m, 4500 + m);
  DBuf<bf16_t> dh(h);
  DBuf<float> dp(prow);
  DevSegments ds(seg, status_);
  const int64_t maxb = ds.sb.max_blocks;

  std::vector<bf16_t> a16(m * f);
  const GatedActivation& act = c.act;
  const QuantStats st16 = cpu::swiglu(h.data(), m, f, a16.data(), prow.data(), act);
  DBuf<bf16_t> da16(m * f);
  reset();
  cuda::swiglu(dh.p, m, f, da16.p, status_, 0, dp.p, nullptr, act);
  expect_same_bits(a16, da16.get(), m * f, "swiglu*p bf16");
  EXPECT_EQ(status().nonfinite, static_cast<ull>(st16.nonfinite));

  QTensor row, col, hq;
  const QuantStats st_row = cpu::swiglu_quant(h.data(), m, f, &row, nullptr, nullptr, nullptr, prow.data(), act);
  const QuantStats st_all = cpu::swiglu_quant(h.data(), m, f, &row, &seg, &col, &hq, prow.data(), act);
  DBuf<uint8_t> rc(m * f), rs(m * f / 128), hc(2 * m * f), hs(2 * m * f / 128);
  reset();
  cuda::swiglu_quant(dh.p, m, f, rc.p, rs.p, hc.p, hs.p, status_, 0, dp.p, nullptr, act);
  expect_same_bits(row.codes, rc.get(), m * f, "swiglu_quant*p codes");
  expect_same_bits(row.scales, rs.get(), m * f / 128, "swiglu_quant*p scales");
  expect_same_bits(hq.codes, hc.get(), 2 * m * f, "swiglu_quant*p H codes");
  expect_same_bits(hq.scales, hs.get(), 2 * m * f / 128, "swiglu_quant*p H scales");
  EXPECT_EQ(status().nonfinite, static_cast<ull>(st_all.nonfinite));

  DBuf<uint8_t> rc3(m * f), rs3(m * f / 128), cc3(m * f), cs3(maxb * f);
  reset();
  cuda::swiglu_quant_col(dh.p, f, ds.sb, rc3.p, rs3.p, cc3.p, cs3.p, nullptr, nullptr, status_, 0, dp.p, act);
  expect_same_bits(row.codes, rc3.get(), m * f, "swiglu_quant_col*p row codes");
  expect_same_bits(col.codes, cc3.get(), m * f, "swiglu_quant_col*p col codes");
  expect_same_bits(col.scales, cs3.get(), nb * f, "swiglu_quant_col*p col scales");
  const auto s = status();
  EXPECT_EQ(s.nonfinite, static_cast<ull>(st_row.nonfinite));
  EXPECT_EQ(s.underflow, static_cast<ull>(st_all.underflow));
  EXPECT_EQ(cudaGetLastError(), cudaSuccess);
}

TEST_P(SwigluGpu, BackwardWithProbBitExact) {
  const Case& c = GetParam();
  const int64_t m = c.m(), f = c.f, k = 2 * f, tiles = f / 128;
  const Segments seg = Segments::from_counts(c.counts);
  const int64_t nb = seg.num_blocks();
  const auto h = make_h(c, m, k, 5000 + m + f);
  const auto da = make_bf16(c.dist == HDist::kNonFinite ? HDist::kNonFinite : HDist::kHeavy, m, f, 5500 + m,
                            c.zero_row_every);
  const auto prow = make_prow(m, 5800 + m);
  DBuf<bf16_t> dh_in(h), dda(da);
  DBuf<float> dp(prow);
  DevSegments ds(seg, status_);
  const int64_t maxb = ds.sb.max_blocks;
  auto bits = [](const std::vector<float>& v) {
    std::vector<uint32_t> b(v.size());
    for (size_t i = 0; i < v.size(); ++i) b[i] = num::f32_bits(v[i]);
    return b;
  };

  // plain BF16 dH and the dp partial sums, then their sum over the tiles
  std::vector<bf16_t> dh(m * k);
  std::vector<float> part(m * tiles), dprow(m);
  const GatedActivation& act = c.act;
  const QuantStats st_dh = cpu::dswiglu(da.data(), h.data(), m, f, dh.data(), prow.data(), part.data(), act);
  cpu::sum_dprow_parts(part.data(), m, f, dprow.data());
  DBuf<bf16_t> ddh(m * k);
  DBuf<float> dpart(m * tiles), ddprow(m);
  reset();
  cuda::dswiglu(dda.p, dh_in.p, m, f, ddh.p, status_, 0, dp.p, dpart.p, nullptr, act);
  expect_same_bits(dh, ddh.get(), m * k, "dswiglu*p bf16");
  expect_same_bits(bits(part), bits(dpart.get()), m * tiles, "dswiglu*p dp partial sums");
  EXPECT_EQ(status().nonfinite, static_cast<ull>(st_dh.nonfinite));
  cuda::sum_dprow_parts(dpart.p, m, f, ddprow.p, 0);
  expect_same_bits(bits(dprow), bits(ddprow.get()), m, "sum_dprow_parts");
  // dh as gate / up pairs (a gate_up_proj stored so): the same values, d gate j at 2 j, d up j at 2 j + 1
  std::vector<bf16_t> pairs(m * k);
  for (int64_t r = 0; r < m; ++r)
    for (int64_t j = 0; j < f; ++j) pairs[r * k + 2 * j] = dh[r * k + j], pairs[r * k + 2 * j + 1] = dh[r * k + f + j];
  DBuf<bf16_t> ddh2(m * k);
  DBuf<float> dpart_pairs(m * tiles);
  reset();
  cuda::dswiglu(dda.p, dh_in.p, m, f, ddh2.p, status_, 0, dp.p, dpart_pairs.p, nullptr, act, /*dh_gate_up=*/true);
  expect_same_bits(pairs, ddh2.get(), m * k, "dswiglu*p bf16, dh as gate / up pairs");
  expect_same_bits(bits(part), bits(dpart_pairs.get()), m * tiles, "dswiglu*p dp partial sums (pairs)");
  EXPECT_EQ(status().nonfinite, static_cast<ull>(st_dh.nonfinite));

  // fused, BF16 H and FP8 H
  QTensor row, col;
  std::vector<float> part2(m * tiles);
  const QuantStats st =
      cpu::dswiglu_quant(da.data(), h.data(), m, f, seg, &row, &col, prow.data(), part2.data(), act);
  expect_same_bits(bits(part), bits(part2), m * tiles, "cpu dswiglu_quant*p partial sums");
  DBuf<uint8_t> rc(m * k), rs(m * k / 128), cc(m * k), cs(maxb * k);
  DBuf<float> dpart2(m * tiles);
  reset();
  cuda::dswiglu_quant(dda.p, dh_in.p, f, ds.sb, rc.p, rs.p, cc.p, cs.p, status_, 0, dp.p, dpart2.p, act);
  expect_same_bits(row.codes, rc.get(), m * k, "dswiglu_quant*p row codes");
  expect_same_bits(row.scales, rs.get(), m * k / 128, "dswiglu_quant*p row scales");
  expect_same_bits(col.codes, cc.get(), m * k, "dswiglu_quant*p col codes");
  expect_same_bits(col.scales, cs.get(), nb * k, "dswiglu_quant*p col scales");
  expect_same_bits(bits(part), bits(dpart2.get()), m * tiles, "dswiglu_quant*p partial sums");
  EXPECT_EQ(status().nonfinite, static_cast<ull>(st.nonfinite));

  QTensor hq, row8, col8;
  cpu::quantize_row(h.data(), m, k, &hq);
  std::vector<float> part8(m * tiles);
  const QuantStats st8 = cpu::dswiglu_quant(da.data(), hq, seg, &row8, &col8, prow.data(), part8.data(), act);
  DBuf<uint8_t> hc(hq.codes), hs(hq.scales);
  DBuf<uint8_t> rc2(m * k), rs2(m * k / 128), cc2(m * k), cs2(maxb * k);
  DBuf<float> dpart8(m * tiles);
  reset();
  cuda::dswiglu_quant_fp8h(dda.p, hc.p, hs.p, f, ds.sb, rc2.p, rs2.p, cc2.p, cs2.p, status_, 0, dp.p, dpart8.p, act);
  expect_same_bits(row8.codes, rc2.get(), m * k, "dswiglu_quant_fp8h*p row codes");
  expect_same_bits(row8.scales, rs2.get(), m * k / 128, "dswiglu_quant_fp8h*p row scales");
  expect_same_bits(col8.codes, cc2.get(), m * k, "dswiglu_quant_fp8h*p col codes");
  expect_same_bits(col8.scales, cs2.get(), nb * k, "dswiglu_quant_fp8h*p col scales");
  expect_same_bits(bits(part8), bits(dpart8.get()), m * tiles, "dswiglu_quant_fp8h*p partial sums");
  EXPECT_EQ(status().nonfinite, static_cast<ull>(st8.nonfinite));

  // H saved as MXFP4 (flow-fp4): forward writes it, backward decodes it
  {
    QTensor h4;
    std::vector<bf16_t> hsv(h.size());  // the saved copy (clamped activation: beyond-limit values marked)
    cpu::saved_h(h.data(), m, f, hsv.data(), act);
    const QuantStats sh4 = cpu::quantize_mxfp4(hsv.data(), m, k, &h4);
    QTensor arow;
    const QuantStats sa = cpu::swiglu_quant(h.data(), m, f, &arow, nullptr, nullptr, nullptr, prow.data(), act);
    DBuf<uint8_t> ac(m * f), as(m * f / 128), h4c(m * k / 2), h4s(m * k / 32);
    reset();
    cuda::swiglu_quant_h4(dh_in.p, m, f, ac.p, as.p, h4c.p, h4s.p, status_, 0, dp.p, nullptr, act);
    expect_same_bits(arow.codes, ac.get(), m * f, "swiglu_quant_h4 a' codes");
    expect_same_bits(arow.scales, as.get(), m * f / 128, "swiglu_quant_h4 a' scales");
    expect_same_bits(h4.codes, h4c.get(), m * k / 2, "swiglu_quant_h4 H MXFP4 codes");
    expect_same_bits(h4.scales, h4s.get(), m * k / 32, "swiglu_quant_h4 H MXFP4 scales");
    EXPECT_EQ(status().nonfinite, static_cast<ull>(sa.nonfinite + sh4.nonfinite));

    QTensor row4, col4;
    std::vector<float> part4(m * tiles);
    const QuantStats st4 = cpu::dswiglu_quant(da.data(), h4, seg, &row4, &col4, prow.data(), part4.data(), act);
    DBuf<uint8_t> rc4(m * k), rs4(m * k / 128), cc4(m * k), cs4(maxb * k);
    DBuf<float> dpart4(m * tiles);
    reset();
    cuda::dswiglu_quant_fp4h(dda.p, h4c.p, h4s.p, f, ds.sb, rc4.p, rs4.p, cc4.p, cs4.p, status_, 0, dp.p, dpart4.p,
                             act);
    expect_same_bits(row4.codes, rc4.get(), m * k, "dswiglu_quant_fp4h*p row codes");
    expect_same_bits(row4.scales, rs4.get(), m * k / 128, "dswiglu_quant_fp4h*p row scales");
    expect_same_bits(col4.codes, cc4.get(), m * k, "dswiglu_quant_fp4h*p col codes");
    expect_same_bits(col4.scales, cs4.get(), nb * k, "dswiglu_quant_fp4h*p col scales");
    expect_same_bits(bits(part4), bits(dpart4.get()), m * tiles, "dswiglu_quant_fp4h*p partial sums");
    EXPECT_EQ(status().nonfinite, static_cast<ull>(st4.nonfinite));
  }

  // dprow_part without prow is an argument error
  EXPECT_THROW(cuda::dswiglu(dda.p, dh_in.p, m, f, ddh.p, nullptr, 0, nullptr, dpart.p), Error);
  EXPECT_EQ(cudaGetLastError(), cudaSuccess);
}

// The inline view forms of swiglu.h pass `act` (and prow, dprow_part) on to the launcher that the
// saved H's view picks: forward with H saved as MXFP4 and (with the column copy) as FP8, backward
// from either.
TEST_P(SwigluGpu, ViewFormsBitExact) {
  const Case& c = GetParam();
  const int64_t m = c.m(), f = c.f, k = 2 * f, tiles = f / 128;
  if (m == 0) GTEST_SKIP() << "a view needs M > 0";
  const Segments seg = Segments::from_counts(c.counts);
  const int64_t nb = seg.num_blocks();
  const GatedActivation& act = c.act;
  const auto h = make_h(c, m, k, 6000 + m + f);
  const auto da = make_bf16(c.dist == HDist::kNonFinite ? HDist::kNonFinite : HDist::kHeavy, m, f, 6500 + m,
                            c.zero_row_every);
  const auto prow = make_prow(m, 6800 + m);
  DBuf<bf16_t> dh_in(h), dda(da);
  DBuf<float> dp(prow);
  DevSegments ds(seg, status_);
  const int64_t maxb = ds.sb.max_blocks;
  auto fbits = [](const std::vector<float>& v) {
    std::vector<uint32_t> b(v.size());
    for (size_t i = 0; i < v.size(); ++i) b[i] = num::f32_bits(v[i]);
    return b;
  };

  QTensor arow, acol, h8, h4;
  cpu::swiglu_quant(h.data(), m, f, &arow, &seg, &acol, &h8, prow.data(), act);
  std::vector<bf16_t> hsv(h.size());  // the saved copy (clamped activation: beyond-limit values marked)
  cpu::saved_h(h.data(), m, f, hsv.data(), act);
  cpu::quantize_mxfp4(hsv.data(), m, k, &h4);
  DBuf<uint8_t> ac(m * f), as(m * f / 128), cc(m * f), cs(maxb * f);
  DBuf<uint8_t> h8c(m * k), h8s(m * k / 128), h4c(m * k / 2), h4s(m * k / 32);
  const auto a_row = cuda::row_1x128(ac.p, as.p, m, f);
  const auto h8v = cuda::row_1x128(h8c.p, h8s.p, m, k);
  const auto h4v = cuda::mxfp4_1x32(h4c.p, h4s.p, m, k);
  cuda::swiglu_quant(dh_in.p, a_row, &h4v, status_, 0, dp.p, act);
  expect_same_bits(arow.codes, ac.get(), m * f, "view swiglu_quant (MXFP4 H) A codes");
  expect_same_bits(arow.scales, as.get(), m * f / 128, "view swiglu_quant (MXFP4 H) A scales");
  expect_same_bits(h4.codes, h4c.get(), m * k / 2, "view swiglu_quant H MXFP4 codes");
  expect_same_bits(h4.scales, h4s.get(), m * k / 32, "view swiglu_quant H MXFP4 scales");
  cuda::swiglu_quant_col(dh_in.p, ds.sb, a_row, cuda::col_128x1(cc.p, cs.p, m, f, maxb), &h8v, status_, 0, dp.p,
                         act);
  expect_same_bits(arow.codes, ac.get(), m * f, "view swiglu_quant_col A row codes");
  expect_same_bits(arow.scales, as.get(), m * f / 128, "view swiglu_quant_col A row scales");
  expect_same_bits(acol.codes, cc.get(), m * f, "view swiglu_quant_col A col codes");
  expect_same_bits(acol.scales, cs.get(), nb * f, "view swiglu_quant_col A col scales");
  expect_same_bits(h8.codes, h8c.get(), m * k, "view swiglu_quant_col H FP8 codes");
  expect_same_bits(h8.scales, h8s.get(), m * k / 128, "view swiglu_quant_col H FP8 scales");

  for (int fp4 = 0; fp4 < 2; ++fp4) {
    const std::string w = fp4 ? " (MXFP4 H)" : " (FP8 H)";
    QTensor row, col;
    std::vector<float> part(m * tiles);
    cpu::dswiglu_quant(da.data(), fp4 ? h4 : h8, seg, &row, &col, prow.data(), part.data(), act);
    DBuf<uint8_t> rc(m * k), rs(m * k / 128), bc(m * k), bs(maxb * k);
    DBuf<float> dpart(m * tiles);
    cuda::dswiglu_quant(dda.p, fp4 ? h4v : h8v, ds.sb, cuda::row_1x128(rc.p, rs.p, m, k),
                        cuda::col_128x1(bc.p, bs.p, m, k, maxb), status_, 0, dp.p, dpart.p, act);
    expect_same_bits(row.codes, rc.get(), m * k, "view dswiglu_quant row codes" + w);
    expect_same_bits(row.scales, rs.get(), m * k / 128, "view dswiglu_quant row scales" + w);
    expect_same_bits(col.codes, bc.get(), m * k, "view dswiglu_quant col codes" + w);
    expect_same_bits(col.scales, bs.get(), nb * k, "view dswiglu_quant col scales" + w);
    expect_same_bits(fbits(part), fbits(dpart.get()), m * tiles, "view dswiglu_quant partial sums" + w);
  }
  EXPECT_EQ(cudaGetLastError(), cudaSuccess);
}

std::vector<Case> cases() {
  std::vector<Case> v;
  const HDist all[] = {HDist::kNormal, HDist::kHeavy, HDist::kWide, HDist::kTiny, HDist::kNearMax, HDist::kNonFinite};
  for (HDist d : all) {
    const std::string n = hdist_name(d);
    v.push_back({"m1_" + n, {1}, 128, d, 0});
    v.push_back({"m127_" + n, {0, 60, 67}, 256, d, 0});
    v.push_back({"m129_" + n, {128, 0, 1}, 128, d, 0});
    v.push_back({"m1000_" + n, {0, 1, 127, 128, 129, 0, 300, 315}, 384, d, 7});
  }
  v.push_back({"empty_experts_only_one_full", {0, 0, 256, 0}, 256, HDist::kNormal, 0});
  v.push_back({"odd_m_single_segment", {777}, 256, HDist::kHeavy, 0});
  v.push_back({"aligned16_8_experts", ragged(8, 2048, 7, 16), 512, HDist::kWide, 0});
  v.push_back({"v2lite_f1408_64_experts", ragged(64, 4096, 11, 1), 1408, HDist::kHeavy, 0});
  v.push_back({"v3_f2048_32_experts", ragged(32, 8192, 5, 128), 2048, HDist::kNormal, 0});
  // the clamped SwiGLU of gpt-oss (alpha 1.702, limit 7) on H scaled beyond the limit (make_h):
  // odd M, empty experts, padding rows; NaN and +-inf from the nonfinite distribution
  GatedActivation clamped;
  clamped.kind = ActivationKind::kClampedSwiglu;
  for (HDist d : all) {
    const std::string n = std::string("clamped_") + hdist_name(d);
    v.push_back({n + "_m1", {1}, 128, d, 0, clamped});
    v.push_back({n + "_m37", {0, 37}, 256, d, 0, clamped});
    v.push_back({n + "_m300", {129, 0, 1, 170}, 384, d, 7, clamped});
  }
  v.push_back({"clamped_v2lite_f1408_64_experts", ragged(64, 4096, 11, 1), 1408, HDist::kHeavy, 0, clamped});
  return v;
}

INSTANTIATE_TEST_SUITE_P(Cases, SwigluGpu, ::testing::ValuesIn(cases()),
                         [](const ::testing::TestParamInfo<Case>& i) { return i.param.name; });

// Two runs, identical bits (no atomics touch the outputs; counters are exact integers).
TEST(SwigluGpuDeterminism, TwoRunsIdenticalBits) {
  REQUIRE_DEVICE();
  const int64_t m = 3000, f = 1408, k = 2 * f;
  const Segments seg = Segments::from_counts(ragged(16, m, 3, 1));
  const auto h = make_bf16(HDist::kHeavy, m, k, 42);
  const auto da = make_bf16(HDist::kNormal, m, f, 43);
  DBuf<cuda::DeviceStatus> st(1);
  cudaMemset(st.p, 0, sizeof(cuda::DeviceStatus));
  DevSegments ds(seg, st.p);
  DBuf<bf16_t> dh(h), dda(da);
  const int64_t maxb = ds.sb.max_blocks;
  std::vector<uint8_t> first[6];
  for (int run = 0; run < 2; ++run) {
    DBuf<uint8_t> rc(m * f), rs(m * f / 128), cc(m * f), cs(maxb * f), brc(m * k), brs(m * k / 128), bcc(m * k),
        bcs(maxb * k);
    cuda::swiglu_quant_col(dh.p, f, ds.sb, rc.p, rs.p, cc.p, cs.p, nullptr, nullptr, st.p, 0);
    cuda::dswiglu_quant(dda.p, dh.p, f, ds.sb, brc.p, brs.p, bcc.p, bcs.p, st.p, 0);
    const std::vector<uint8_t> now[6] = {rc.get(), cc.get(), cs.get(), brc.get(), bcc.get(), bcs.get()};
    for (int i = 0; i < 6; ++i) {
      if (run == 0) first[i] = now[i];
      else expect_same_bits(first[i], now[i], now[i].size(), "run 2 vs run 1, output " + std::to_string(i));
    }
  }
}

TEST(SwigluGpuArgs, BadArgumentsThrowClearErrors) {
  REQUIRE_DEVICE();
  DBuf<bf16_t> x(4096);
  DBuf<uint8_t> c(4096), s(64);
  expect_error([&] { cuda::swiglu(x.p, 2, 100, x.p, nullptr, 0); }, "not a positive multiple of 128");
  expect_error([&] { cuda::swiglu_quant(x.p, 2, 192, c.p, s.p, nullptr, nullptr, nullptr, 0); }, "F = 192");
  expect_error([&] { cuda::swiglu_quant(x.p + 1, 1, 128, c.p, s.p, nullptr, nullptr, nullptr, 0); }, "16-byte aligned");
  expect_error([&] { cuda::swiglu_quant(x.p, 1, 128, c.p, s.p, c.p, nullptr, nullptr, 0); }, "h_codes and h_scales");
  expect_error([&] { cuda::swiglu_quant(x.p, -1, 128, c.p, s.p, nullptr, nullptr, nullptr, 0); }, "M = -1");
  expect_error([&] { cuda::dswiglu(x.p, x.p, 1, 128, x.p + 3, nullptr, 0); }, "16-byte aligned");
  cuda::SegmentBlocks sb{};
  expect_error([&] { cuda::dswiglu_quant(x.p, x.p, 128, sb, c.p, s.p, c.p, s.p, nullptr, 0); }, "build_segment_blocks");
  expect_error([&] { cuda::swiglu_quant_col(x.p, 128, sb, c.p, s.p, c.p, s.p, nullptr, nullptr, nullptr, 0); },
               "build_segment_blocks");
  expect_error([&] { cuda::dswiglu_quant_fp8h(x.p, c.p, nullptr, 128, sb, c.p, s.p, c.p, s.p, nullptr, 0); },
               "build_segment_blocks");
  // the clamped activation needs a limit > 0 and a finite alpha
  GatedActivation bad_act;
  bad_act.kind = ActivationKind::kClampedSwiglu;
  bad_act.limit = 0.0f;
  expect_error([&] { cuda::swiglu(x.p, 2, 128, x.p, nullptr, 0, nullptr, nullptr, bad_act); }, "limit > 0");
  bad_act.limit = 7.0f;
  bad_act.alpha = NAN;
  expect_error([&] { cuda::dswiglu(x.p, x.p, 1, 128, x.p, nullptr, 0, nullptr, nullptr, nullptr, bad_act); },
               "finite alpha");
  // M = 0 is a no-op
  EXPECT_NO_THROW(cuda::swiglu_quant(nullptr, 0, 128, nullptr, nullptr, nullptr, nullptr, nullptr, 0));
  EXPECT_EQ(cudaDeviceSynchronize(), cudaSuccess);
}

// DeepSeek-V3 shape (M = 16384 rows, F = 2048, 32 ragged experts): the headline path.
TEST(SwigluGpuLarge, DeepSeekV3Shape) {
  REQUIRE_DEVICE();
  const int64_t m = 16384, f = 2048, k = 2 * f;
  const Segments seg = Segments::from_counts(ragged(32, m, 9, 16));
  const auto h = make_bf16(HDist::kHeavy, m, k, 77);
  const auto da = make_bf16(HDist::kNormal, m, f, 78);
  DBuf<cuda::DeviceStatus> st(1);
  cudaMemset(st.p, 0, sizeof(cuda::DeviceStatus));
  DevSegments ds(seg, st.p);
  DBuf<bf16_t> dh(h), dda(da);
  const int64_t maxb = ds.sb.max_blocks, nb = seg.num_blocks();

  QTensor row, col;
  const QuantStats sf = cpu::swiglu_quant(h.data(), m, f, &row, &seg, &col, nullptr);
  DBuf<uint8_t> rc(m * f), rs(m * f / 128), cc(m * f), cs(maxb * f);
  cuda::swiglu_quant_col(dh.p, f, ds.sb, rc.p, rs.p, cc.p, cs.p, nullptr, nullptr, st.p, 0);
  expect_same_bits(row.codes, rc.get(), m * f, "A row codes");
  expect_same_bits(row.scales, rs.get(), m * f / 128, "A row scales");
  expect_same_bits(col.codes, cc.get(), m * f, "A col codes");
  expect_same_bits(col.scales, cs.get(), nb * f, "A col scales");
  EXPECT_EQ(st.get()[0].underflow, static_cast<ull>(sf.underflow));

  QTensor brow, bcol;
  cpu::dswiglu_quant(da.data(), h.data(), m, f, seg, &brow, &bcol);
  DBuf<uint8_t> brc(m * k), brs(m * k / 128), bcc(m * k), bcs(maxb * k);
  cuda::dswiglu_quant(dda.p, dh.p, f, ds.sb, brc.p, brs.p, bcc.p, bcs.p, st.p, 0);
  expect_same_bits(brow.codes, brc.get(), m * k, "dH row codes");
  expect_same_bits(brow.scales, brs.get(), m * k / 128, "dH row scales");
  expect_same_bits(bcol.codes, bcc.get(), m * k, "dH col codes");
  expect_same_bits(bcol.scales, bcs.get(), nb * k, "dH col scales");
  EXPECT_EQ(st.get()[0].nonfinite, 0u);
}

}  // namespace
}  // namespace flowmoe
