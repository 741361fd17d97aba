// The launchers on device views (flowmoe/cuda/qtensor_view.h) give what the CPU reference and the
// pointer launchers give, bit for bit (so each wrapper passes shape, codes and scales in the right
// places), and reject a view of the wrong layout before anything is launched.
#include <cuda_runtime.h>
#include <gtest/gtest.h>

#include <random>
#include <vector>

#include "flowmoe/cpu/convert.h"
#include "flowmoe/cuda/convert.h"
#include "flowmoe/cuda/qtensor_view.h"
#include "flowmoe/error.h"
#include "flowmoe/numerics.h"
#include "flowmoe/swiglu.h"
#include "cuda/gpu_test_util.h"

namespace flowmoe {
namespace {

using namespace testutil;  // DBuf, REQUIRE_DEVICE, normal_bf16

TEST(QTensorViewGpu, RowAndColumnQuantizeMatchTheReference) {
  REQUIRE_DEVICE();
  const int64_t m = 300, k = 256;
  const Segments seg = Segments::from_counts({100, 0, 200});
  const int E = seg.num_segments();
  const auto x = normal_bf16(m * k, 1.0f, 11u);
  QTensor row_ref, col_ref;
  cpu::quantize_row(x.data(), m, k, &row_ref);
  cpu::quantize_col(x.data(), m, k, seg, &col_ref);

  DBuf<bf16_t> dx(x);
  DBuf<int32_t> doff(seg.offsets);
  const int64_t maxb = cuda::segment_max_blocks(m, E);
  DBuf<int32_t> bstart(maxb), bend(maxb), boff(E + 1);
  DBuf<cuda::DeviceStatus> st(1);
  cudaMemset(st.p, 0, sizeof(cuda::DeviceStatus));
  const cuda::SegmentBlocks sb{doff.p, E, m, maxb, bstart.p, bend.p, boff.p};
  cuda::build_segment_blocks(sb, st.p, 0);

  DBuf<uint8_t> rc(m * k), rs(k / 128 * m), cc(k * m), cs(maxb * k);
  const auto row = cuda::row_1x128(rc.p, rs.p, m, k);
  const auto col = cuda::col_128x1(cc.p, cs.p, m, k, maxb, doff.p, E);
  cuda::quantize_row(dx.p, row, st.p, 0);
  ASSERT_EQ(cudaDeviceSynchronize(), cudaSuccess);
  EXPECT_EQ(rc.get(), row_ref.codes);
  EXPECT_EQ(rs.get(), row_ref.scales);

  DBuf<uint8_t> rc2(m * k), rs2(k / 128 * m);
  const auto row2 = cuda::row_1x128(rc2.p, rs2.p, m, k);
  cuda::quantize_col(dx.p, sb, col, &row2, st.p, 0);
  ASSERT_EQ(cudaDeviceSynchronize(), cudaSuccess);
  const int64_t nb = seg.num_blocks();
  std::vector<uint8_t> cs_h = cs.get();
  cs_h.resize(nb * k);
  EXPECT_EQ(cc.get(), col_ref.codes);
  EXPECT_EQ(cs_h, col_ref.scales);
  EXPECT_EQ(rc2.get(), row_ref.codes);
  EXPECT_EQ(rs2.get(), row_ref.scales);

  // the column copy from the row-wise view (scaling-aware transpose) equals the pointer launcher's
  DBuf<uint8_t> tc(k * m), ts(maxb * k), pc(k * m), ps(maxb * k);
  cuda::scaling_aware_transpose(row, sb, cuda::col_128x1(tc.p, ts.p, m, k, maxb), st.p, 0);
  cuda::scaling_aware_transpose(rc.p, rs.p, k, sb, pc.p, ps.p, st.p, 0);
  ASSERT_EQ(cudaDeviceSynchronize(), cudaSuccess);
  EXPECT_EQ(tc.get(), pc.get());
  EXPECT_EQ(ts.get(), ps.get());

  // wrong layouts and shapes are refused on the host
  EXPECT_THROW(cuda::quantize_row(dx.p, col, st.p, 0), Error);
  EXPECT_THROW(cuda::quantize_col(dx.p, sb, row, nullptr, st.p, 0), Error);
  EXPECT_THROW(cuda::quantize_col(dx.p, sb, cuda::col_128x1(cc.p, cs.p, m - 4, k, maxb), nullptr, st.p, 0), Error);
  EXPECT_THROW(cuda::dequantize_mxfp4(row, nullptr, 0), Error);
}

// The view form of swiglu_quant picks the saved H's launcher from its layout: MXFP4 gives what
// swiglu_quant_h4 gives, row-wise FP8 what swiglu_quant gives.
TEST(QTensorViewGpu, SwigluQuantDispatchesOnTheSavedFormat) {
  REQUIRE_DEVICE();
  const int64_t m = 64, f = 256;
  const auto h = normal_bf16(m * 2 * f, 1.0f, 12u);
  DBuf<bf16_t> dh(h);
  DBuf<uint8_t> ac(m * f), as(f / 128 * m), ac2(m * f), as2(f / 128 * m);
  DBuf<uint8_t> h4c(m * f), h4s(m * 2 * f / 32), h4c2(m * f), h4s2(m * 2 * f / 32);
  DBuf<uint8_t> h8c(m * 2 * f), h8s(2 * f / 128 * m), h8c2(m * 2 * f), h8s2(2 * f / 128 * m);
  const auto h4 = cuda::mxfp4_1x32(h4c.p, h4s.p, m, 2 * f);
  cuda::swiglu_quant(dh.p, cuda::row_1x128(ac.p, as.p, m, f), &h4, nullptr, 0);
  cuda::swiglu_quant_h4(dh.p, m, f, ac2.p, as2.p, h4c2.p, h4s2.p, nullptr, 0);
  ASSERT_EQ(cudaDeviceSynchronize(), cudaSuccess);
  EXPECT_EQ(ac.get(), ac2.get());
  EXPECT_EQ(as.get(), as2.get());
  EXPECT_EQ(h4c.get(), h4c2.get());
  EXPECT_EQ(h4s.get(), h4s2.get());
  const auto h8 = cuda::row_1x128(h8c.p, h8s.p, m, 2 * f);
  cuda::swiglu_quant(dh.p, cuda::row_1x128(ac.p, as.p, m, f), &h8, nullptr, 0);
  cuda::swiglu_quant(dh.p, m, f, ac2.p, as2.p, h8c2.p, h8s2.p, nullptr, 0);
  ASSERT_EQ(cudaDeviceSynchronize(), cudaSuccess);
  EXPECT_EQ(ac.get(), ac2.get());
  EXPECT_EQ(h8c.get(), h8c2.get());
  EXPECT_EQ(h8s.get(), h8s2.get());
  // a saved H of the wrong width is refused
  const auto bad = cuda::row_1x128(h8c.p, h8s.p, m, f);
  EXPECT_THROW(cuda::swiglu_quant(dh.p, cuda::row_1x128(ac.p, as.p, m, f), &bad, nullptr, 0), Error);
}

}  // namespace
}  // namespace flowmoe
