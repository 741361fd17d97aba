// The device view of a quantized tensor (flowmoe/cuda/qtensor_view.h): the builders fill the
// layouts of flowmoe/tensor.h and flowmoe/gemm.h, and check_view rejects what does not match.
#include <gtest/gtest.h>

#include <cstdint>

#include "flowmoe/cuda/qtensor_view.h"
#include "flowmoe/error.h"
#include "flowmoe/gemm.h"

namespace flowmoe {
namespace {

using cuda::QTensorView;
using cuda::ScaleFormat;

// Fake device addresses (never dereferenced).
uint8_t* fake8(uintptr_t a) { return reinterpret_cast<uint8_t*>(a); }
float* fake32(uintptr_t a) { return reinterpret_cast<float*>(a); }

TEST(QTensorView, BuildersMatchTheHostLayouts) {
  const QTensorView r = cuda::row_1x128(fake8(0x1000), fake8(0x2000), 300, 512);
  EXPECT_EQ(r.code_bytes(), 300 * 512);
  EXPECT_EQ(r.scale_rows, 4);
  EXPECT_EQ(r.scale_ld, 300);
  EXPECT_EQ(r.scale_bytes(), 4 * 300);
  EXPECT_NO_THROW(cuda::check_view(r, Layout::kRow1x128, ScaleFormat::kUe8m0, "row"));

  const QTensorView c = cuda::col_128x1(fake8(0x1000), fake8(0x2000), 300, 256, 5);
  EXPECT_EQ(c.code_bytes(), 300 * 256);
  EXPECT_EQ(c.scale_elems(), 5 * 256);

  const QTensorView w = cuda::weight_128x128(fake8(0x1000), fake8(0x2000), 3, 256, 640);
  EXPECT_EQ(w.rows, 3 * 256);
  EXPECT_EQ(w.scale_elems(), 3 * 2 * 5);

  const QTensorView f = cuda::mxfp4_1x32(fake8(0x1000), fake8(0x2000), 7, 64);
  EXPECT_EQ(f.code_bytes(), 7 * 32);
  EXPECT_EQ(f.scale_elems(), 7 * 2);
  EXPECT_EQ(f.elem, cuda::ElemFormat::kMxfp4E2m1);

  // The GEMM-ready FP32 grids have the sizes flowmoe/gemm.h gives them.
  const QTensorView wf = cuda::weight_128x128_f32(fake8(0x1000), fake32(0x2000), 3, 256, 640);
  EXPECT_EQ(wf.scale_elems(), gemm::weight_scale_f32_elems(3, 256, 640));
  EXPECT_EQ(wf.scale_bytes(), 4 * wf.scale_elems());
  const QTensorView af = cuda::row_1x128_f32(fake8(0x1000), fake32(0x2000), 300, 512);
  EXPECT_EQ(af.scale_elems(), gemm::act_scale_f32_elems(300, 512));
}

TEST(QTensorView, CheckRejectsMismatches) {
  const QTensorView r = cuda::row_1x128(fake8(0x1000), fake8(0x2000), 300, 512);
  EXPECT_THROW(cuda::check_view(r, Layout::kCol128x1, ScaleFormat::kUe8m0, "t"), Error);
  EXPECT_THROW(cuda::check_view(r, Layout::kRow1x128, ScaleFormat::kF32, "t"), Error);
  QTensorView bad = r;
  bad.scale_ld = 299;  // narrower than the tokens
  EXPECT_THROW(cuda::check_view(bad, Layout::kRow1x128, ScaleFormat::kUe8m0, "t"), Error);
  bad = r;
  bad.cols = 500;  // not a multiple of 128
  EXPECT_THROW(cuda::check_view(bad, Layout::kRow1x128, ScaleFormat::kUe8m0, "t"), Error);
  bad = r;
  bad.codes = nullptr;
  EXPECT_THROW(cuda::check_view(bad, Layout::kRow1x128, ScaleFormat::kUe8m0, "t"), Error);
  bad = r;
  bad.elem = cuda::ElemFormat::kMxfp4E2m1;
  EXPECT_THROW(cuda::check_view(bad, Layout::kRow1x128, ScaleFormat::kUe8m0, "t"), Error);
  QTensorView w = cuda::weight_128x128_f32(fake8(0x1000), fake32(0x2000), 2, 256, 640);
  EXPECT_NO_THROW(cuda::check_view(w, Layout::kWeight128x128, ScaleFormat::kF32, "w"));
  w.scale_ld = 5;  // the FP32 grid's stride is padded to a multiple of 4
  EXPECT_THROW(cuda::check_view(w, Layout::kWeight128x128, ScaleFormat::kF32, "w"), Error);
  try {
    cuda::check_view(r, Layout::kCol128x1, ScaleFormat::kUe8m0, "quantize_col");
    FAIL() << "no throw";
  } catch (const Error& e) {
    EXPECT_NE(std::string(e.what()).find("quantize_col"), std::string::npos) << e.what();
  }
}

}  // namespace
}  // namespace flowmoe

namespace flowmoe {
namespace {

// A view with GEMM-ready FP32 scales gives the operand the GEMM checks accept; other views throw.
TEST(QTensorView, GemmOperandFromView) {
  const Segments seg = Segments::from_counts({16, 0, 32});
  const int64_t m = seg.num_tokens(), n = 256, k = 384;
  const int E = seg.num_segments();
  const auto x = cuda::row_1x128_f32(fake8(0x100000), fake32(0x200000), m, k);
  const auto w = cuda::weight_128x128_f32(fake8(0x300000), fake32(0x400000), E, n, k);
  const gemm::Fp8Operand xo = gemm::fp8_operand(x, "x"), wo = gemm::fp8_operand(w, "w");
  EXPECT_EQ(xo.codes.size, m * k);
  EXPECT_EQ(xo.scales.size, gemm::act_scale_f32_elems(m, k));
  EXPECT_EQ(wo.codes.size, E * n * k);
  EXPECT_EQ(wo.scales.size, gemm::weight_scale_f32_elems(E, n, k));
  const bf16_t* y = reinterpret_cast<const bf16_t*>(uintptr_t(0x500000));
  EXPECT_NO_THROW(gemm::check_fp8_fprop(seg, n, k, xo, wo, {y, m * n}));
  const auto xc = cuda::col_128x1_f32(fake8(0x100000), fake32(0x200000), m, k, seg.num_blocks());
  EXPECT_EQ(gemm::fp8_operand(xc, "x_col").scales.size, gemm::col_scale_f32_elems(seg, k));
  // UE8M0 scales are not what the GEMM reads; MXFP4 is not an FP8 operand.
  EXPECT_THROW(gemm::fp8_operand(cuda::row_1x128(fake8(0x1000), fake8(0x2000), m, k), "x"), Error);
  EXPECT_THROW(gemm::fp8_operand(cuda::mxfp4_1x32(fake8(0x1000), fake8(0x2000), m, k), "x"), Error);
}

}  // namespace
}  // namespace flowmoe
