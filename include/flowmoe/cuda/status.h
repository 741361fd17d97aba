// What the CUDA kernels report without a host synchronisation: a few counters in device memory
// that every module (convert, token, swiglu, gemm scales, the layer) adds to. Read it when
// convenient, e.g. once per step to skip a step with non-finite values. Plain data: no CUDA
// header needed.
#pragma once

namespace flowmoe {
namespace cuda {

struct DeviceStatus {
  unsigned long long nonfinite;     // non-finite input elements (their tiles are marked NaN)
  unsigned long long underflow;     // elements rounded into subnormals/zero by an exact conversion
  unsigned long long bad_segments;  // segment tables (or routing ids) that failed validation
};

}  // namespace cuda
}  // namespace flowmoe
