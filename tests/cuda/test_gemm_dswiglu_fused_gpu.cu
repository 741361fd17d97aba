// GEMM2-dgrad with the fused dSwiGLU epilogue (GroupedGemm::dgrad_dswiglu) against the unfused path
// on the same inputs: the grouped dgrad writing da' in BF16, then cuda::dswiglu_quant_fp8h (flow: h
// saved as FP8 rows) or dswiglu_quant_fp4h (flow-fp4: h saved as MXFP4). Every output byte equal --
// dh row-wise codes and scales, dh column-wise codes and scales, dp's partial sums -- including the
// bytes neither path may write (rows past offsets[E], the poisoned tail), and the same non-finite
// count, on ragged experts (0, 1, 129, 300, 64 rows: partial token tiles, a warpgroup with no rows,
// unaligned expert starts), rows with widely spread magnitudes, and injected NaN / Inf. With and
// without the routing probabilities. (The layer with CudaLayerOptions::fused_dswiglu on and off:
// test_gemm_swiglu_fused_gpu.cu.) GPU label.
#include <cuda_runtime.h>
#include <gtest/gtest.h>

#include <cmath>
#include <limits>
#include <random>
#include <string>
#include <vector>

#include "cuda/gpu_test_util.h"
#include "flowmoe/cuda/convert.h"
#include "flowmoe/cuda/qtensor_view.h"
#include "flowmoe/cuda/status.h"
#include "flowmoe/error.h"
#include "flowmoe/gemm.h"
#include "flowmoe/swiglu.h"

namespace flowmoe {
namespace {

using namespace testutil;

constexpr int64_t kH = 256, kF = 384;  // dgrad: K = H = 256 -> F = 384 (3 output tiles of 128)
const std::vector<int> kCounts = {0, 1, 129, 300, 0, 128, 7, 64, 200};
constexpr int64_t kTailRows = 40;  // rows past offsets[E]: neither path may write them

struct Case {
  bool mxfp4_h;       // flow-fp4 (h saved MXFP4) or flow (h saved FP8 rows)
  bool f32_w_scales;  // W2^T's scales GEMM-ready FP32 (the layer's) or UE8M0
  bool nonfinite;     // NaN / Inf injected into dY and h
  bool prob;          // with the routing probabilities (and dp), or the plain dSwiGLU
  bool clamped = false;  // gpt-oss's clamped SwiGLU (h spread over the limit, marks saved)
};

void run_case(const Case& c) {
  const int E = int(kCounts.size());
  std::vector<int32_t> off(E + 1, 0);
  for (int e = 0; e < E; ++e) off[e + 1] = off[e] + kCounts[e];
  const int64_t rows = off[E], m = rows + kTailRows, n2 = 2 * kF;
  std::mt19937 rng(777u + 2u * c.mxfp4_h + 4u * c.f32_w_scales + 8u * c.nonfinite + 16u * c.prob + 32u * c.clamped);
  GatedActivation act;
  if (c.clamped) act.kind = ActivationKind::kClampedSwiglu;  // alpha 1.702, limit 7 (gpt-oss's)
  // dY rows with magnitudes 2^-8 .. 2^8, h rows 2^-6 .. 2^6 (scale exponents spread over tiles)
  std::vector<float> dyf = normal_f32(m * kH, 1.0f, rng), hf = normal_f32(m * n2, 1.0f, rng);
  for (int64_t r = 0; r < m; ++r) {
    for (int64_t k = 0; k < kH; ++k) dyf[r * kH + k] = std::ldexp(dyf[r * kH + k], int(r % 17) - 8);
    for (int64_t k = 0; k < n2; ++k) hf[r * n2 + k] = std::ldexp(hf[r * n2 + k], int(r % 13) - 6);
  }
  if (c.nonfinite) {
    const float inf = std::numeric_limits<float>::infinity(), nan = std::numeric_limits<float>::quiet_NaN();
    // offsets 0 0 1 130 430 430 558 565 629 829: expert 2 rows 1 .. 129 (row 129 alone in its tile)
    dyf[129 * kH + 5] = nan;
    dyf[200 * kH + 140] = inf;       // expert 3
    hf[431 * n2 + 7] = -inf;         // expert 5, a gate value
    hf[600 * n2 + kF + 200] = nan;   // expert 7, an up value
    dyf[835 * kH + 3] = inf;         // past offsets[E]: never counted
  }
  const auto to_bf16 = [](const std::vector<float>& v) {
    std::vector<bf16_t> b(v.size());
    for (size_t i = 0; i < v.size(); ++i) b[i] = num::f32_to_bf16(v[i]);
    return b;
  };
  const std::vector<bf16_t> wb = normal_bf16(int64_t(E) * kF * kH, 1.0f / 16, rng);
  std::vector<float> prob(m);
  std::uniform_real_distribution<float> u01(0.0f, 1.0f);
  for (float& p : prob) p = u01(rng);

  DBuf<bf16_t> dy_bf(to_bf16(dyf)), h_bf(to_bf16(hf)), w_bf(wb);
  DBuf<float> d_prob(prob);
  DBuf<int32_t> d_off(off);
  ManagedStatus quant_st, ref_st, fused_st;
  DBuf<uint8_t> dy_c(m * kH), dy_s((kH / 128) * m);
  cuda::quantize_row(dy_bf.p, m, kH, dy_c.p, dy_s.p, quant_st.p, 0);
  const cuda::QTensorView dy = cuda::row_1x128(dy_c.p, dy_s.p, m, kH);
  // W2^T [E][F, H] (what GEMM2's dgrad reads)
  const int64_t nw = int64_t(E) * kF * kH, sblk = (kF / 128) * (kH / 128);
  DBuf<uint8_t> w_c(nw), w_s(E * sblk), wt_c(nw), wt_s(E * sblk);
  for (int e = 0; e < E; ++e)
    cuda::quantize_weight(w_bf.p + e * kF * kH, kF, kH, w_c.p + e * kF * kH, w_s.p + e * sblk,
                          wt_c.p + e * kF * kH, wt_s.p + e * sblk, quant_st.p, 0);
  DBuf<float> w_f32(gemm::weight_scale_f32_elems(E, kF, kH));
  cuda::QTensorView wt = cuda::weight_128x128(w_c.p, w_s.p, E, kF, kH);
  if (c.f32_w_scales) {
    cuda::weight_scales_to_f32(w_s.p, E, kF, kH, w_f32.p, 0);
    wt = cuda::weight_128x128_f32(w_c.p, w_f32.p, E, kF, kH);
  }
  // the saved h
  DBuf<uint8_t> h8_c(m * n2), h8_s((n2 / 128) * m), h4_c(m * kF), h4_s(m * (n2 / 32));
  if (c.clamped)  // h as the forward saves it: values past the limit carry the clamp's marks
    for (int64_t r = 0; r < m; ++r)
      for (int64_t k = 0; k < n2; ++k) {
        float& v = hf[r * n2 + k];
        v = k < kF ? num::saved_gate(act, v) : num::saved_up(act, v);
      }
  DBuf<bf16_t> hs_bf(to_bf16(hf));
  cuda::quantize_row(hs_bf.p, m, n2, h8_c.p, h8_s.p, quant_st.p, 0);
  cuda::quantize_mxfp4(hs_bf.p, m, n2, h4_c.p, h4_s.p, quant_st.p, 0);
  const cuda::QTensorView h_saved =
      c.mxfp4_h ? cuda::mxfp4_1x32(h4_c.p, h4_s.p, m, n2) : cuda::row_1x128(h8_c.p, h8_s.p, m, n2);
  // the segments' blocks (the unfused kernel's column-wise grid)
  cuda::SegmentBlocks sb;
  sb.offsets = d_off.p;
  sb.num_segments = E;
  sb.m = m;
  sb.max_blocks = cuda::segment_max_blocks(m, E);
  sb.capacity = true;
  DBuf<int32_t> bs(sb.max_blocks), be(sb.max_blocks), bo(E + 1);
  sb.block_start = bs.p;
  sb.block_end = be.p;
  sb.block_offsets = bo.p;
  cuda::build_segment_blocks(sb, quant_st.p, 0);

  // outputs, poisoned: [0] unfused, [1] fused
  const int64_t mb = sb.max_blocks;
  DBuf<uint8_t> rc0(m * n2), rs0((n2 / 128) * m), cc0(m * n2), cs0(mb * n2);
  DBuf<uint8_t> rc1(m * n2), rs1((n2 / 128) * m), cc1(m * n2), cs1(mb * n2);
  DBuf<float> dp0((kF / 128) * m), dp1((kF / 128) * m);
  const float* p = c.prob ? d_prob.p : nullptr;
  cuda::GroupedGemm gg;
  const gemm::DeviceSegments seg{d_off.p, E, m, nullptr};
  {  // unfused: BF16 da', then the dSwiGLU kernel over the segments' blocks
    DBuf<bf16_t> da(m * kF);
    gg.dgrad(seg, kH, kF, dy, wt, {da.p, m * kF}, 0);
    if (c.mxfp4_h)
      cuda::dswiglu_quant_fp4h(da.p, h4_c.p, h4_s.p, kF, sb, rc0.p, rs0.p, cc0.p, cs0.p, ref_st.p, 0, p,
                               c.prob ? dp0.p : nullptr, act);
    else
      cuda::dswiglu_quant_fp8h(da.p, h8_c.p, h8_s.p, kF, sb, rc0.p, rs0.p, cc0.p, cs0.p, ref_st.p, 0, p,
                               c.prob ? dp0.p : nullptr, act);
    ASSERT_CUDA_OK(cudaDeviceSynchronize());
  }
  gg.dgrad_dswiglu(seg, kH, kF, dy, wt, p, h_saved, cuda::row_1x128(rc1.p, rs1.p, m, n2),
                   cuda::col_128x1(cc1.p, cs1.p, m, n2, mb), c.prob ? dp1.p : nullptr, fused_st.p, 0, act);
  ASSERT_CUDA_OK(cudaDeviceSynchronize());
  EXPECT_EQ(gg.stats().grouped_kernel_calls, 2);
  EXPECT_EQ(quant_st.p->bad_segments, 0u);

  const std::string what = std::string(c.mxfp4_h ? "h mxfp4" : "h fp8") + (c.f32_w_scales ? ", fp32 w scales" : "") +
                           (c.nonfinite ? ", nan/inf" : "") + (c.prob ? ", prob" : ", no prob") +
                           (c.clamped ? ", clamped" : "");
  expect_same_bits(rc0.get(), rc1.get(), what + ": dh row codes");
  expect_same_bits(rs0.get(), rs1.get(), what + ": dh row scales");
  expect_same_bits(cc0.get(), cc1.get(), what + ": dh column codes");
  expect_same_bits(cs0.get(), cs1.get(), what + ": dh column scales");
  expect_same_bits(dp0.get(), dp1.get(), what + ": dp partial sums");
  EXPECT_EQ(ref_st.p->nonfinite, fused_st.p->nonfinite) << what;
  if (c.nonfinite)
    EXPECT_GT(ref_st.p->nonfinite, 0u) << what << ": the injected values must reach dh";
  else
    EXPECT_EQ(ref_st.p->nonfinite, 0u) << what;
  // the tail rows untouched (poison), and something was written
  const std::vector<uint8_t> r1 = rc1.get();
  for (int64_t i = rows * n2; i < m * n2; ++i)
    if (r1[i] != kPoisonByte) {
      ADD_FAILURE() << what << ": dh byte " << i << " past offsets[E] written";
      break;
    }
  int64_t written = 0;
  for (int64_t i = 0; i < rows * n2; ++i) written += r1[i] != kPoisonByte;
  EXPECT_GT(written, rows * n2 / 2) << what << ": the fused kernel wrote too little of dh";
}

TEST(GemmDswigluFusedGpu, FlowBitsEqualUnfused) {
  REQUIRE_SM90();
  run_case({false, false, false, true});
  run_case({false, true, false, true});
  run_case({false, true, false, false});
}
TEST(GemmDswigluFusedGpu, FlowFp4BitsEqualUnfused) {
  REQUIRE_SM90();
  run_case({true, false, false, true});
  run_case({true, true, false, true});
  run_case({true, true, false, false});
}
TEST(GemmDswigluFusedGpu, NonFiniteCountedAsUnfused) {
  REQUIRE_SM90();
  run_case({false, true, true, true});
  run_case({true, true, true, true});
}

// gpt-oss's clamped SwiGLU: the masks and the clamped values read from the saved marks
TEST(GemmDswigluFusedGpu, ClampedSwigluBitsEqualUnfused) {
  REQUIRE_SM90();
  run_case({false, true, false, true, true});
  run_case({false, false, false, false, true});
  run_case({true, true, false, true, true});
  run_case({false, true, true, true, true});
  run_case({true, true, true, true, true});
}

TEST(GemmDswigluFusedGpu, BadArgumentsRejected) {
  REQUIRE_SM90();
  const int E = 2;
  const int64_t m = 256, n2 = 2 * kF, mb = cuda::segment_max_blocks(m, E);
  DBuf<int32_t> d_off(std::vector<int32_t>{0, 100, 256});
  DBuf<uint8_t> dy_c(m * kH), dy_s(m * kH / 128), w_c(E * kF * kH), w_s(E * kF * kH / 128 / 128);
  DBuf<uint8_t> h_c(m * n2), h_s(m * n2 / 128), r_c(m * n2), r_s(m * n2 / 128), c_c(m * n2), c_s(mb * n2);
  DBuf<float> prob(m), dp(m * kF / 128);
  const cuda::QTensorView dy = cuda::row_1x128(dy_c.p, dy_s.p, m, kH);
  const cuda::QTensorView wt = cuda::weight_128x128(w_c.p, w_s.p, E, kF, kH);
  const cuda::QTensorView h = cuda::row_1x128(h_c.p, h_s.p, m, n2), row = cuda::row_1x128(r_c.p, r_s.p, m, n2);
  const cuda::QTensorView col = cuda::col_128x1(c_c.p, c_s.p, m, n2, mb);
  cuda::GroupedGemm gg;
  const gemm::DeviceSegments seg{d_off.p, E, m, nullptr};
  EXPECT_NO_THROW(gg.dgrad_dswiglu(seg, kH, kF, dy, wt, prob.p, h, row, col, dp.p, nullptr, 0));
  EXPECT_THROW(gg.dgrad_dswiglu(seg, kH, kF - 64, dy, wt, prob.p, h, row, col, dp.p, nullptr, 0), Error);  // F % 128
  EXPECT_THROW(gg.dgrad_dswiglu(seg, kH, kF, dy, wt, nullptr, h, row, col, dp.p, nullptr, 0), Error);  // dp, no prob
  const cuda::QTensorView h_half = cuda::row_1x128(h_c.p, h_s.p, m, kF);
  EXPECT_THROW(gg.dgrad_dswiglu(seg, kH, kF, dy, wt, prob.p, h_half, row, col, dp.p, nullptr, 0), Error);  // h [m, F]
  EXPECT_THROW(gg.dgrad_dswiglu(seg, kH, kF, dy, wt, prob.p, h, h_half, col, dp.p, nullptr, 0), Error);  // dh [m, F]
  EXPECT_THROW(gg.dgrad_dswiglu(seg, kH, kF, dy, wt, prob.p, h, row, row, dp.p, nullptr, 0), Error);  // col layout
  const cuda::QTensorView col_short = cuda::col_128x1(c_c.p, c_s.p, m, n2, mb - 1);
  EXPECT_THROW(gg.dgrad_dswiglu(seg, kH, kF, dy, wt, prob.p, h, row, col_short, dp.p, nullptr, 0), Error);
  const cuda::QTensorView wt_wide = cuda::weight_128x128(w_c.p, w_s.p, E, 2 * kF, kH / 2);
  EXPECT_THROW(gg.dgrad_dswiglu(seg, kH, kF, dy, wt_wide, prob.p, h, row, col, dp.p, nullptr, 0), Error);
  ASSERT_CUDA_OK(cudaDeviceSynchronize());
}

}  // namespace
}  // namespace flowmoe
