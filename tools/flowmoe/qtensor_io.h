// Quantized tensors <-> .npy files (the layouts are described in docs/NPY_FILES.md):
//
//   layout  PREFIX.codes.npy (uint8)   PREFIX.scales.npy (uint8 ue8m0)   extra
//   row     [M, K]                     [K/128, M]
//   col     [K, M]                     [NB, K]                          PREFIX.segments.npy int32 [E+1]
//   weight  [N, K]                     [N/128, K/128]
//   mxfp4   [M, K/2] (packed e2m1)     [M, K/32]
#pragma once

#include <cstdint>
#include <string>
#include <vector>

#include "flowmoe/tensor.h"
#include "output_set.h"

namespace flowmoe {
namespace cli {

// "row" | "col" | "weight" | "mxfp4" -> Layout (UsageError otherwise).
Layout parse_layout(const std::string& s);
// The command-line spelling of a layout.
const char* layout_word(Layout l);

// The largest M or K a file may describe: token offsets and segment counts are int32.
constexpr int64_t kMaxDim = 2147483647;

// Checks that [rows, cols] is a valid logical shape for the layout: both in [1, kMaxDim] (an
// empty or absurd shape is rejected before anything loops over it) and block multiples, naming
// `where` (a file or option), the shape and the limit in the error.
void check_layout_shape(Layout l, int64_t rows, int64_t cols, const std::string& where);

// Stored .npy shapes of codes and scales for a logical [rows, cols] tensor.
std::vector<int64_t> code_shape(Layout l, int64_t rows, int64_t cols);
std::vector<int64_t> scale_shape(Layout l, int64_t rows, int64_t cols, const Segments& seg);

// Segments from "--segments a,b,c" token counts (must sum to m), or one segment when empty.
Segments segments_from_option(const std::string& counts, int64_t m);

// Refuses an output prefix that names no file: '' or 'dir/', or a last part '.' or '..' (each would
// write hidden files such as 'dir/.codes.npy'), and one whose last part starts with '.flowmoe-' (the
// names of flowmoe's own temporary files). A prefix such as '.x' is allowed: the user asked for it.
void check_output_prefix(const std::string& prefix);

// Adds PREFIX.codes.npy, PREFIX.scales.npy (and PREFIX.segments.npy for col) to `out`; they
// appear, with the rest of the set, when the caller commits it (output_set.h).
void save_qtensor(const QTensor& q, const std::string& prefix, OutputSet* out);

// Rebuilds a QTensor from PREFIX.*.npy. `shape` is "M,K" or empty (inferred from the codes
// file); `seg_counts` is the --segments value or empty (col only: then PREFIX.segments.npy is
// used when present, else one segment). Every size is validated with a message naming the file.
QTensor load_qtensor(Layout l, const std::string& prefix, const std::string& shape,
                     const std::string& seg_counts);

bool file_exists(const std::string& path);

// Which counters an operation counts (docs/NPY_FILES.md defines them): quantize counts `flushed`, the
// exact conversions `underflow`, the stepwise paths (naive transpose, FP4->FP8 col-stepwise)
// `overflow` and `flushed`. Every operation counts `nonfinite`.
enum class Counted { kQuantize, kExact, kStepwise };
// Prints "layout: ...", "nonfinite: N" and the lines of the counters `c` names to stdout.
void print_stats(const QTensor& q, const QuantStats& st, Counted c);

}  // namespace cli
}  // namespace flowmoe
