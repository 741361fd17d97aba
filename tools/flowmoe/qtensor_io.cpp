// Quantized tensors <-> .npy files, with validation of every size (see qtensor_io.h).
#include "qtensor_io.h"

#include <sys/stat.h>

#include <fstream>
#include <iostream>
#include <tuple>
#include <utility>

#include "cli.h"
#include "npy.h"
#include "set_files.h"
#include "flowmoe/error.h"

namespace flowmoe {
namespace cli {
namespace {

// Checks a segmentation for m tokens (Segments::validate), naming the file it came from.
void check_offsets(const Segments& seg, int64_t m, const std::string& where) {
  try {
    seg.validate(m);
  } catch (const Error& e) {
    throw Error(__FILE__, __LINE__, where + ": " + e.message());  // the message, without its location
  }
}

// Loads a uint8 2-D array and checks its shape against `want`.
NpyArray load_u8(const std::string& path, const std::vector<int64_t>& want, const std::string& what) {
  FLOWMOE_CHECK(file_exists(path), path << ": missing (expected the " << what << " file, uint8 "
                                        << npy_shape_str(want) << ")");
  NpyArray a = npy_load(path);
  FLOWMOE_CHECK(a.dtype == kNpyU8, path << ": " << what << " must be uint8 ('|u1'), got "
                                        << npy_dtype_name(a.dtype));
  FLOWMOE_CHECK(a.shape == want, path << ": " << what << " have shape " << npy_shape_str(a.shape)
                                      << ", expected " << npy_shape_str(want) << " ("
                                      << a.numel() << " bytes found, " << (want[0] * want[1])
                                      << " expected)");
  return a;
}

}  // namespace

Layout parse_layout(const std::string& s) {
  const std::string w = parse_choice(s, "--layout", {"row", "col", "weight", "mxfp4"});
  if (w == "row") return Layout::kRow1x128;
  if (w == "col") return Layout::kCol128x1;
  if (w == "weight") return Layout::kWeight128x128;
  return Layout::kMxfp4Row1x32;
}

const char* layout_word(Layout l) {
  switch (l) {
    case Layout::kRow1x128: return "row";
    case Layout::kCol128x1: return "col";
    case Layout::kWeight128x128: return "weight";
    case Layout::kMxfp4Row1x32: return "mxfp4";
  }
  return "?";
}

void check_layout_shape(Layout l, int64_t rows, int64_t cols, const std::string& where) {
  FLOWMOE_CHECK(rows >= 1 && cols >= 1 && rows <= kMaxDim && cols <= kMaxDim,
                where << ": shape [M, K] = [" << rows << ", " << cols << "] is "
                      << (rows < 1 || cols < 1 ? "empty" : "too large")
                      << "; expected M and K in [1, " << kMaxDim << "]");
  switch (l) {
    case Layout::kRow1x128:
      FLOWMOE_CHECK(cols % kFp8Block == 0, where << ": K = " << cols << " is not a multiple of 128 "
                                                 "(row-wise FP8 uses 1x128 tiles along K)");
      break;
    case Layout::kCol128x1:
      break;  // token blocks follow the segments; any M and K
    case Layout::kWeight128x128:
      FLOWMOE_CHECK(rows % kFp8Block == 0 && cols % kFp8Block == 0,
                    where << ": weight shape [N, K] = [" << rows << ", " << cols
                          << "]: both N and K must be multiples of 128 (128x128 blocks)");
      break;
    case Layout::kMxfp4Row1x32:
      FLOWMOE_CHECK(cols % kFp4Block == 0, where << ": K = " << cols << " is not a multiple of 32 "
                                                 "(MXFP4 uses 1x32 blocks along K)");
      break;
  }
}

std::vector<int64_t> code_shape(Layout l, int64_t rows, int64_t cols) {
  switch (l) {
    case Layout::kCol128x1: return {cols, rows};
    case Layout::kMxfp4Row1x32: return {rows, cols / 2};
    default: return {rows, cols};
  }
}

std::vector<int64_t> scale_shape(Layout l, int64_t rows, int64_t cols, const Segments& seg) {
  switch (l) {
    case Layout::kRow1x128: return {cols / kFp8Block, rows};
    case Layout::kCol128x1: return {seg.num_blocks(), cols};
    case Layout::kWeight128x128: return {rows / kFp8Block, cols / kFp8Block};
    case Layout::kMxfp4Row1x32: return {rows, cols / kFp4Block};
  }
  return {};
}

Segments segments_from_option(const std::string& counts, int64_t m) {
  if (counts.empty()) return Segments::whole(m);
  const std::vector<int32_t> c = parse_counts(counts, "--segments");
  int64_t sum = 0;
  for (int32_t v : c) sum += v;
  if (sum != m)
    throw UsageError("--segments: token counts sum to " + std::to_string(sum) + ", expected M = " +
                     std::to_string(m));
  return Segments::from_counts(c);
}

// stat(), not open(): opening a FIFO would block (npy_load then refuses anything not a regular file).
bool file_exists(const std::string& path) {
  struct stat st;
  return stat(path.c_str(), &st) == 0;
}

void check_output_prefix(const std::string& prefix) {
  const size_t slash = prefix.rfind('/');
  const std::string last = slash == std::string::npos ? prefix : prefix.substr(slash + 1);
  FLOWMOE_CHECK(!last.empty() && last != "." && last != "..",
                "output prefix '" << prefix << "' names no file: its last part is "
                                  << (last.empty() ? "empty" : "'" + last + "'")
                                  << ", so it would write hidden files such as '" << prefix
                                  << ".codes.npy'; expected a prefix such as out/name");
  FLOWMOE_CHECK(last.compare(0, 9, ".flowmoe-") != 0,
                "output prefix '" << prefix << "' starts with '.flowmoe-', the names flowmoe keeps for its "
                                  << "temporary files (they are removed as leftovers); choose another name");
}

void save_qtensor(const QTensor& q, const std::string& prefix, OutputSet* out) {
  check_output_prefix(prefix);
  const std::vector<int64_t> cs = code_shape(q.layout, q.rows, q.cols);
  const std::vector<int64_t> ss = scale_shape(q.layout, q.rows, q.cols, q.segments);
  // Sanity: the library produced exactly the layout documented in docs/NPY_FILES.md.
  FLOWMOE_CHECK(static_cast<int64_t>(q.codes.size()) == cs[0] * cs[1],
                "internal: " << q.describe() << " has " << q.codes.size() << " code bytes, expected "
                             << npy_shape_str(cs));
  FLOWMOE_CHECK(static_cast<int64_t>(q.scales.size()) == ss[0] * ss[1],
                "internal: " << q.describe() << " has " << q.scales.size() << " scale bytes, expected "
                             << npy_shape_str(ss));
  out->add(prefix + ".codes.npy", kNpyU8, cs, q.codes.data());
  out->add(prefix + ".scales.npy", kNpyU8, ss, q.scales.data());
  if (q.layout == Layout::kCol128x1) {
    const std::vector<int32_t>& off = q.segments.offsets;
    out->add(prefix + ".segments.npy", kNpyI32, {static_cast<int64_t>(off.size())}, off.data());
  }
}

QTensor load_qtensor(Layout l, const std::string& prefix, const std::string& shape,
                     const std::string& seg_counts) {
  const std::string codes_path = prefix + ".codes.npy";
  const std::string scales_path = prefix + ".scales.npy";
  // Every file of the set is read under the directory's shared lock: a flowmoe writer replacing
  // the set waits, so this sees the old set or the new one whole (set_files.h).
  const SetReadGuard guard({codes_path, scales_path, prefix + ".segments.npy"});
  FLOWMOE_CHECK(file_exists(codes_path), codes_path << ": missing (expected the " << layout_word(l)
                                                    << " codes written by 'flowmoe quantize')");

  // Logical shape [rows, cols]: from --shape, else inferred from the stored codes shape.
  int64_t rows = 0, cols = 0;
  NpyArray codes = npy_load(codes_path);
  FLOWMOE_CHECK(codes.dtype == kNpyU8, codes_path << ": codes must be uint8 ('|u1'), got "
                                                  << npy_dtype_name(codes.dtype));
  FLOWMOE_CHECK(codes.shape.size() == 2, codes_path << ": codes must be 2-D, got shape "
                                                    << npy_shape_str(codes.shape));
  // Before anything loops over or allocates for it: a header may claim any shape when one
  // dimension is 0 (no data bytes), e.g. [2^40, 0].
  const bool empty = codes.shape[0] < 1 || codes.shape[1] < 1;
  FLOWMOE_CHECK(!empty && codes.shape[0] <= kMaxDim && codes.shape[1] <= kMaxDim,
                codes_path << ": codes have shape " << npy_shape_str(codes.shape) << ", which is "
                           << (empty ? "empty" : "too large") << "; expected both dimensions in [1, "
                           << kMaxDim << "]");
  if (!shape.empty()) {
    std::tie(rows, cols) = parse_shape(shape, "--shape");
    check_layout_shape(l, rows, cols, "--shape " + shape);
  } else {
    rows = codes.shape[0];
    cols = codes.shape[1];
    if (l == Layout::kCol128x1) std::swap(rows, cols);
    if (l == Layout::kMxfp4Row1x32) cols *= 2;
    check_layout_shape(l, rows, cols, codes_path);
  }
  const std::vector<int64_t> cs = code_shape(l, rows, cols);
  FLOWMOE_CHECK(codes.shape == cs, codes_path << ": codes have shape " << npy_shape_str(codes.shape)
                                              << ", expected " << npy_shape_str(cs) << " for "
                                              << layout_word(l) << " [M, K] = [" << rows << ", " << cols
                                              << "] (" << codes.numel() << " bytes found, "
                                              << cs[0] * cs[1] << " expected)");

  Segments seg;
  if (l == Layout::kCol128x1) {
    const std::string seg_path = prefix + ".segments.npy";
    if (file_exists(seg_path)) {
      const NpyArray a = npy_load(seg_path);
      FLOWMOE_CHECK(a.shape.size() == 1, seg_path << ": segment offsets must be 1-D [E+1], got shape "
                                                  << npy_shape_str(a.shape));
      FLOWMOE_CHECK(a.dtype == kNpyI32, seg_path << ": segment offsets must be int32 ('<i4'), got "
                                                  << npy_dtype_name(a.dtype)
                                                  << " (numpy: np.asarray(offsets, dtype=np.int32))");
      seg.offsets = npy_values<int32_t>(a, kNpyI32, seg_path);
      check_offsets(seg, rows, seg_path);
      if (!seg_counts.empty()) {
        const Segments opt = segments_from_option(seg_counts, rows);
        FLOWMOE_CHECK(opt.offsets == seg.offsets,
                      "--segments " << seg_counts << " disagrees with the offsets in " << seg_path);
      }
    } else {
      seg = segments_from_option(seg_counts, rows);
    }
  } else if (!seg_counts.empty()) {
    throw UsageError("--segments applies to column-wise tensors only");
  }

  const std::vector<int64_t> ss = scale_shape(l, rows, cols, seg);
  NpyArray scales = load_u8(scales_path, ss, "scales");

  QTensor q;
  q.layout = l;
  q.rows = rows;
  q.cols = cols;
  q.codes = std::move(codes.data);
  q.scales = std::move(scales.data);
  q.segments = std::move(seg);
  return q;
}

void print_stats(const QTensor& q, const QuantStats& st, Counted c) {
  std::cout << "layout: " << q.describe() << "\n"
            << "nonfinite: " << st.nonfinite << "\n";
  if (c == Counted::kExact) std::cout << "underflow: " << st.underflow << "\n";
  // exact conversions of a set that decodes beyond float32 (--allow-nonfinite; cmd_files.cpp)
  if (c == Counted::kExact && st.overflow > 0) std::cout << "overflow: " << st.overflow << "\n";
  if (c == Counted::kStepwise) std::cout << "overflow: " << st.overflow << "\n";
  if (c != Counted::kExact) std::cout << "flushed: " << st.flushed << "\n";
}

}  // namespace cli
}  // namespace flowmoe
