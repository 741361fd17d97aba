#include "flowmoe/tensor.h"

#include <sstream>

#include "flowmoe/error.h"

namespace flowmoe {

const char* layout_name(Layout l) {
  switch (l) {
    case Layout::kRow1x128: return "row-wise 1x128 e4m3";
    case Layout::kCol128x1: return "column-wise 128x1 e4m3";
    case Layout::kWeight128x128: return "weight 128x128 e4m3";
    case Layout::kMxfp4Row1x32: return "row-wise 1x32 mxfp4";
  }
  return "unknown layout";
}

Segments Segments::whole(int64_t m) {
  FLOWMOE_CHECK(m >= 0 && m <= INT32_MAX, "token count " << m << " out of range [0, 2^31)");
  return Segments{{0, static_cast<int32_t>(m)}};
}

Segments Segments::from_counts(const std::vector<int32_t>& counts) {
  Segments s;
  s.offsets.reserve(counts.size() + 1);
  int64_t acc = 0;
  s.offsets.push_back(0);
  for (size_t i = 0; i < counts.size(); ++i) {
    FLOWMOE_CHECK(counts[i] >= 0, "segment " << i << " has negative token count " << counts[i]);
    acc += counts[i];
    FLOWMOE_CHECK(acc <= INT32_MAX, "total token count exceeds 2^31-1");
    s.offsets.push_back(static_cast<int32_t>(acc));
  }
  return s;
}

int64_t Segments::num_blocks() const {
  int64_t nb = 0;
  for (int e = 0; e < num_segments(); ++e) {
    nb += (static_cast<int64_t>(offsets[e + 1]) - offsets[e] + kFp8Block - 1) / kFp8Block;
  }
  return nb;
}

std::vector<int64_t> Segments::block_offsets() const {
  std::vector<int64_t> bo(num_segments() + 1, 0);
  for (int e = 0; e < num_segments(); ++e) {
    bo[e + 1] = bo[e] + (static_cast<int64_t>(offsets[e + 1]) - offsets[e] + kFp8Block - 1) / kFp8Block;
  }
  return bo;
}

void Segments::validate(int64_t m) const {
  FLOWMOE_CHECK(offsets.size() >= 2,
                "segments need at least one segment (offsets of size E+1 >= 2), got "
                    << offsets.size() << " offsets");
  FLOWMOE_CHECK(offsets.front() == 0, "segment offsets must start at 0, got " << offsets.front());
  for (size_t i = 1; i < offsets.size(); ++i) {
    FLOWMOE_CHECK(offsets[i] >= offsets[i - 1], "segment offsets must be non-decreasing: offsets["
                                                    << i << "] = " << offsets[i] << " < offsets["
                                                    << i - 1 << "] = " << offsets[i - 1]);
  }
  FLOWMOE_CHECK(offsets.back() == m, "segment offsets must end at the token count M = "
                                         << m << ", got " << offsets.back());
}

int64_t QTensor::scale_rows() const {
  switch (layout) {
    case Layout::kRow1x128: return cols / kFp8Block;
    case Layout::kCol128x1: return segments.num_blocks();
    case Layout::kWeight128x128: return rows / kFp8Block;
    case Layout::kMxfp4Row1x32: return rows;
  }
  return 0;
}

int64_t QTensor::scale_cols() const {
  switch (layout) {
    case Layout::kRow1x128: return rows;
    case Layout::kCol128x1: return cols;
    case Layout::kWeight128x128: return cols / kFp8Block;
    case Layout::kMxfp4Row1x32: return cols / kFp4Block;
  }
  return 0;
}

int64_t QTensor::code_bytes() const {
  return layout == Layout::kMxfp4Row1x32 ? rows * cols / 2 : rows * cols;
}

std::string QTensor::describe() const {
  std::ostringstream os;
  os << layout_name(layout) << " [" << rows << ", " << cols << "]";
  if (layout == Layout::kCol128x1) os << " in " << segments.num_segments() << " segment(s)";
  return os.str();
}

void throw_if_nonfinite(const QuantStats& stats, const char* what) {
  if (stats.nonfinite > 0) {
    std::ostringstream os;
    os << what << ": input holds " << stats.nonfinite
       << " non-finite value(s) (NaN or Inf); expected finite input. Their tiles were marked NaN "
          "(scale 0xFF).";
    throw NonFiniteError(__FILE__, __LINE__, os.str());
  }
}

}  // namespace flowmoe
