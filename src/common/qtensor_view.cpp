// Checks of the device view of a quantized tensor (flowmoe/cuda/qtensor_view.h). Host code only:
// the view is plain data, so its checks build and are tested without CUDA.
#include "flowmoe/cuda/qtensor_view.h"

#include "flowmoe/error.h"

namespace flowmoe {
namespace cuda {

const char* elem_format_name(ElemFormat f) {
  switch (f) {
    case ElemFormat::kE4m3: return "e4m3";
    case ElemFormat::kMxfp4E2m1: return "mxfp4 e2m1";
  }
  return "?";
}

const char* scale_format_name(ScaleFormat f) {
  switch (f) {
    case ScaleFormat::kUe8m0: return "ue8m0";
    case ScaleFormat::kF32: return "fp32";
  }
  return "?";
}

void check_view(const QTensorView& v, Layout layout, ScaleFormat scales, const char* what) {
  FLOWMOE_CHECK(v.layout == layout, what << ": the view is " << layout_name(v.layout)
                                         << ", expected " << layout_name(layout));
  FLOWMOE_CHECK(v.scale_format == scales, what << ": the view's scales are "
                                               << scale_format_name(v.scale_format)
                                               << ", expected " << scale_format_name(scales));
  FLOWMOE_CHECK(scales == ScaleFormat::kUe8m0 || layout != Layout::kMxfp4Row1x32,
                what << ": MXFP4 has UE8M0 scales only; expected ue8m0");
  const ElemFormat elem =
      layout == Layout::kMxfp4Row1x32 ? ElemFormat::kMxfp4E2m1 : ElemFormat::kE4m3;
  FLOWMOE_CHECK(v.elem == elem, what << ": " << layout_name(layout) << " holds "
                                     << elem_format_name(elem) << " codes, the view says "
                                     << elem_format_name(v.elem));
  const int64_t col_tile = layout == Layout::kMxfp4Row1x32 ? kFp4Block : kFp8Block;
  FLOWMOE_CHECK(v.rows > 0 && v.cols > 0 && v.cols % col_tile == 0,
                what << ": shape [" << v.rows << ", " << v.cols
                     << "]; expected positive rows and cols a multiple of " << col_tile);
  FLOWMOE_CHECK(layout != Layout::kWeight128x128 || v.rows % kFp8Block == 0,
                what << ": weight rows = " << v.rows << "; expected a multiple of " << kFp8Block);
  FLOWMOE_CHECK(v.codes != nullptr && v.scales != nullptr,
                what << ": codes = " << static_cast<const void*>(v.codes)
                     << ", scales = " << v.scales << "; expected two device pointers");
  int64_t min_rows = 0, min_ld = 0;  // the least scale grid the layout needs
  switch (layout) {
    case Layout::kRow1x128:
      min_rows = v.cols / kFp8Block;
      min_ld = v.rows;
      break;
    case Layout::kCol128x1:
      min_rows = 1;
      min_ld = v.cols;
      break;
    case Layout::kWeight128x128:
      min_rows = v.rows / kFp8Block;
      min_ld = scales == ScaleFormat::kF32 ? (v.cols / kFp8Block + 3) / 4 * 4 : v.cols / kFp8Block;
      break;
    case Layout::kMxfp4Row1x32:
      min_rows = v.rows;
      min_ld = v.cols / kFp4Block;
      break;
  }
  FLOWMOE_CHECK(v.scale_rows >= min_rows && v.scale_ld >= min_ld,
                what << ": scale grid [" << v.scale_rows << "][" << v.scale_ld
                     << "]; expected at least [" << min_rows << "][" << min_ld << "] for "
                     << layout_name(layout) << " [" << v.rows << ", " << v.cols << "]");
}

}  // namespace cuda
}  // namespace flowmoe
