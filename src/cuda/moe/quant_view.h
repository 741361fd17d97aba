// One typed view of a quantized tensor in device memory, as the CUDA layer uses it: codes, scales,
// the scale element and layout, and the logical shape the buffer holds (rows x cols, capacity).
// Replaces the layer's former private pairs of pointers. The project-wide device view
// (include/flowmoe/cuda/, branch arch-gemm-sm90) takes its place when it lands: the fields match.
#pragma once

#include <cstdint>

#include "flowmoe/error.h"

namespace flowmoe {
namespace cuda {
namespace moe {

// What a code and a scale are.
enum class QuantFormat : uint8_t {
  kFp8Ue8m0,  // E4M3 codes, power-of-two UE8M0 scales (one byte)
  kFp8Fp32,   // E4M3 codes, FP32 scales s = amax / 448 (fp8-naive)
  kMxfp4,     // E2M1 codes, two per byte, UE8M0 scales per 32 values
};
// Where the scales of a [rows, cols] tensor lie.
enum class QuantLayout : uint8_t {
  kRow,     // row-wise 1x128: scales [cols/128][rows] (FP32 GEMM operands: expert-packed, gemm.h)
  kRow32,   // row-wise 1x32 (MXFP4): codes [rows, cols/2], scales [rows][cols/32]
  kColumn,  // column-wise 128x1 over the segments' 128-row blocks: codes [cols, rows], scales
            // [blocks][cols]
  kWeight,  // E weights of 128x128 blocks, GEMM-ready FP32 scales (gemm.h weight_scale_f32_elems)
};

struct QuantView {
  uint8_t* codes = nullptr;
  void* scales = nullptr;
  QuantFormat format = QuantFormat::kFp8Ue8m0;
  QuantLayout layout = QuantLayout::kRow;
  int64_t rows = 0, cols = 0;  // the largest tensor the buffers hold

  // The scales as their element type (checked against `format`).
  uint8_t* ue8m0() const {
    FLOWMOE_CHECK(format != QuantFormat::kFp8Fp32, "QuantView: FP32 scales read as UE8M0");
    return static_cast<uint8_t*>(scales);
  }
  float* f32() const {
    FLOWMOE_CHECK(format == QuantFormat::kFp8Fp32, "QuantView: UE8M0 scales read as FP32");
    return static_cast<float*>(scales);
  }
};

}  // namespace moe
}  // namespace cuda
}  // namespace flowmoe
