// File subcommands: quantize, dequantize, transpose, fp4-to-fp8 (layouts in docs/NPY_FILES.md).
#include <iostream>
#include <sstream>
#include <string>
#include <vector>

#include "cli.h"
#include "npy.h"
#include "output_set.h"
#include "set_files.h"
#include "flowmoe/cpu/convert.h"
#include "flowmoe/error.h"
#include "flowmoe/numerics.h"
#include "qtensor_io.h"

namespace flowmoe {
namespace cli {
namespace {

// A 2-D high-precision input: float32, or uint16 holding bfloat16 bits.
struct HpInput {
  std::string path;
  bool is_bf16 = false;
  int64_t m = 0, k = 0;
  std::vector<float> f32;
  std::vector<bf16_t> bf16;
  int64_t nonfinite = 0;
};

HpInput load_hp_input(const std::string& path) {
  const NpyArray a = [&] {
    const SetReadGuard guard({path});  // (a flowmoe writer of this file waits; set_files.h)
    return npy_load(path);
  }();
  HpInput in;
  in.path = path;
  FLOWMOE_CHECK(a.dtype == kNpyF32 || a.dtype == kNpyU16,
                path << ": input must be float32 ('<f4') or uint16 bfloat16 bits ('<u2'), got "
                     << npy_dtype_name(a.dtype));
  FLOWMOE_CHECK(a.shape.size() == 2, path << ": input must be 2-D [M, K], got shape " << npy_shape_str(a.shape));
  in.m = a.shape[0];
  in.k = a.shape[1];
  in.is_bf16 = a.dtype == kNpyU16;
  if (in.is_bf16) {
    in.bf16 = npy_values<bf16_t>(a, kNpyU16, path);
    for (bf16_t h : in.bf16) in.nonfinite += (h & 0x7F80u) == 0x7F80u;
  } else {
    in.f32 = npy_values<float>(a, kNpyF32, path);
    for (float v : in.f32) in.nonfinite += !num::f32_is_finite(v);
  }
  return in;
}

// ---- quantize ------------------------------------------------------------------------------

const char kQuantizeUsage[] =
    "usage: flowmoe quantize --layout row|col|both|weight|mxfp4 [--segments a,b,...]\n"
    "                        [--allow-nonfinite] IN.npy OUTPREFIX\n"
    "\n"
    "Quantizes IN.npy, a 2-D [M, K] array of float32 ('<f4') or uint16 bfloat16 bits ('<u2'),\n"
    "with power-of-two UE8M0 scales (SPEC 2) and writes (all uint8):\n"
    "  row     OUTPREFIX.codes.npy     e4m3 [M, K]\n"
    "          OUTPREFIX.scales.npy    ue8m0 [K/128, M]         one per (row, 128 features)\n"
    "          K must be a multiple of 128.\n"
    "  col     OUTPREFIX.codes.npy     e4m3 [K, M]              X transposed\n"
    "          OUTPREFIX.scales.npy    ue8m0 [NB, K]            one per (128-token block, feature)\n"
    "          OUTPREFIX.segments.npy  int32 [E+1]              token offsets of the segments\n"
    "          NB = sum over segments of ceil(len/128): blocks never straddle two segments.\n"
    "  both    OUTPREFIX.row.{codes,scales}.npy and OUTPREFIX.col.{codes,scales,segments}.npy\n"
    "  weight  OUTPREFIX.codes.npy     e4m3 [N, K]  (IN is W [N, K])\n"
    "          OUTPREFIX.scales.npy    ue8m0 [N/128, K/128]     one per 128x128 block\n"
    "          OUTPREFIX.t.codes.npy   e4m3 [K, N]              exact transpose, same values\n"
    "          OUTPREFIX.t.scales.npy  ue8m0 [K/128, N/128]\n"
    "          N and K must be multiples of 128.\n"
    "  mxfp4   OUTPREFIX.codes.npy     packed e2m1 [M, K/2]     element 2i in the low nibble\n"
    "          OUTPREFIX.scales.npy    ue8m0 [M, K/32]          one per (row, 32 features)\n"
    "          K must be a multiple of 32.\n"
    "\n"
    "options:\n"
    "  --layout L         the layout to write (required)\n"
    "  --segments a,b,c   token counts per expert segment (col and both only; must sum to M;\n"
    "                     default: one segment of M tokens)\n"
    "  --allow-nonfinite  quantize an input holding NaN/Inf: the tiles holding them get scale\n"
    "                     0xFF (NaN) and decode to NaN. Without it such input is an error\n"
    "                     (exit 1) and nothing is written.\n"
    "\n"
    "The files of the output appear together or not at all: on any error (exit 1) no file of\n"
    "the set is written and an existing set of that name is left as it was; so too when it is\n"
    "interrupted (Ctrl-C, kill). flowmoe commands reading the set see it whole, old or new.\n"
    "\n"
    "Prints 'input:', then one 'wrote PATH DTYPE [SHAPE]' line per file, then 'layout:',\n"
    "'nonfinite: N' and 'flushed: N' (non-zero inputs encoded as zero) lines per tensor.\n"
    "Inputs at the top of the float32 range saturate so that nothing decodes to Inf.\n"
    "See docs/NPY_FILES.md.\n";

template <typename T>
int quantize_typed(const T* x, const HpInput& in, const std::string& layout, const std::string& seg_counts,
                   const std::string& prefix) {
  const int64_t m = in.m, k = in.k;
  OutputSet out;
  if (layout == "row") {
    check_layout_shape(Layout::kRow1x128, m, k, in.path);
    QTensor q;
    const QuantStats st = cpu::quantize_row(x, m, k, &q);
    save_qtensor(q, prefix, &out);
    out.commit();
    print_stats(q, st, Counted::kQuantize);
  } else if (layout == "col") {
    check_layout_shape(Layout::kCol128x1, m, k, in.path);
    const Segments seg = segments_from_option(seg_counts, m);
    QTensor q;
    const QuantStats st = cpu::quantize_col(x, m, k, seg, &q);
    save_qtensor(q, prefix, &out);
    out.commit();
    print_stats(q, st, Counted::kQuantize);
  } else if (layout == "both") {
    check_layout_shape(Layout::kRow1x128, m, k, in.path);
    const Segments seg = segments_from_option(seg_counts, m);
    QTensor row, col;
    const QuantStats st_row = cpu::quantize_row(x, m, k, &row);
    const QuantStats st_col = cpu::quantize_col(x, m, k, seg, &col);
    save_qtensor(row, prefix + ".row", &out);
    save_qtensor(col, prefix + ".col", &out);
    out.commit();
    print_stats(row, st_row, Counted::kQuantize);
    print_stats(col, st_col, Counted::kQuantize);
  } else if (layout == "weight") {
    check_layout_shape(Layout::kWeight128x128, m, k, in.path);
    QTensor w, wt;
    const QuantStats st = cpu::quantize_weight(x, m, k, &w, &wt);
    save_qtensor(w, prefix, &out);
    save_qtensor(wt, prefix + ".t", &out);
    out.commit();
    print_stats(w, st, Counted::kQuantize);
  } else {  // mxfp4
    check_layout_shape(Layout::kMxfp4Row1x32, m, k, in.path);
    QTensor q;
    const QuantStats st = cpu::quantize_mxfp4(x, m, k, &q);
    save_qtensor(q, prefix, &out);
    out.commit();
    print_stats(q, st, Counted::kQuantize);
  }
  return 0;
}

int run_quantize(const Args& args) {
  args.expect_positional({"IN.npy", "OUTPREFIX"});
  const std::string layout =
      parse_choice(args.require("layout"), "--layout", {"row", "col", "both", "weight", "mxfp4"});
  const std::string seg_counts = args.get("segments");
  if (!seg_counts.empty() && layout != "col" && layout != "both")
    throw UsageError("--segments applies to --layout col and both only");
  const std::string& in_path = args.positional()[0];
  const std::string& prefix = args.positional()[1];

  check_output_prefix(prefix);  // before any work; --layout both appends '.row' / '.col' to it
  const HpInput in = load_hp_input(in_path);
  std::cout << "input: " << in_path << " " << (in.is_bf16 ? "bfloat16" : "float32") << " [" << in.m << ", "
            << in.k << "]\n";
  FLOWMOE_CHECK(in.nonfinite == 0 || args.flag("allow-nonfinite"),
                in_path << ": " << in.nonfinite << " non-finite value(s) (NaN or Inf) in the input; nothing "
                        << "written (pass --allow-nonfinite to write NaN-marked tiles)");
  if (in.is_bf16) return quantize_typed(in.bf16.data(), in, layout, seg_counts, prefix);
  return quantize_typed(in.f32.data(), in, layout, seg_counts, prefix);
}

// ---- quantized sets that decode beyond binary32 ----------------------------------------------

// A finite code under a scale too large for it (e.g. scale code 0xFE = 2^127 under an E4M3 code of
// magnitude 2 or more) decodes to +-Inf. No quantizer writes such an element (SPEC §2, "finite
// stays finite"), so every command that reads a quantized set treats it alike: an error (exit 1,
// nothing written) unless --allow-nonfinite, and then counted as 'overflow' (and 'nonfinite').
// Returns the number of such elements of `q`; `decoded` receives q's logical matrix.
int64_t check_decodes_finite(const QTensor& q, const std::string& prefix, bool allow, std::vector<float>* decoded) {
  decoded->assign(static_cast<size_t>(q.rows * q.cols), 0.0f);
  cpu::dequantize(q, decoded->data());
  int64_t n = 0, first = -1;
  for (size_t i = 0; i < decoded->size(); ++i) {
    const float v = (*decoded)[i];
    if (num::f32_is_finite(v) || v != v) continue;  // finite, or NaN (a NaN-marked tile or code)
    if (n++ == 0) first = static_cast<int64_t>(i);
  }
  if (n == 0 || allow) return n;
  FLOWMOE_CHECK(false, prefix << ": " << n << " finite code(s) overflowed to Inf when decoded (code x scale "
                              << "beyond the float32 range, the first at [" << first / q.cols << ", "
                              << first % q.cols << "] of the " << q.rows << " x " << q.cols
                              << " matrix, e.g. scale code 0xFE (2^127) under a code of magnitude 2 or more); "
                              << "no quantizer writes such a set; nothing was written (pass --allow-nonfinite "
                              << "to convert it anyway, counted as 'overflow')");
  return n;
}

// ---- dequantize ----------------------------------------------------------------------------

const char kDequantizeUsage[] =
    "usage: flowmoe dequantize --layout row|col|weight|mxfp4 [--shape M,K] [--segments a,b,...]\n"
    "                          [--bf16] [--allow-nonfinite] PREFIX OUT.npy\n"
    "\n"
    "Reads PREFIX.codes.npy and PREFIX.scales.npy (and PREFIX.segments.npy for col) as written by\n"
    "'flowmoe quantize' and writes the logical matrix [M, K] ([N, K] for weight; a col tensor\n"
    "comes back un-transposed) as float32, exact, or with --bf16 as uint16 bfloat16 bits\n"
    "(round to nearest even). Tiles with a NaN scale and NaN codes decode to NaN, counted in a\n"
    "'nonfinite: N' line. A set with an element whose\n"
    "code x scale is beyond float32 (which no quantizer writes) is an error unless --allow-nonfinite;\n"
    "then those elements decode to +-Inf and an 'overflow: N' line counts them.\n"
    "\n"
    "options:\n"
    "  --layout L        layout of PREFIX (required)\n"
    "  --shape M,K       logical shape; checked against the files (default: inferred from\n"
    "                    PREFIX.codes.npy)\n"
    "  --segments a,b,c  col only, when PREFIX.segments.npy is absent (default: one segment)\n"
    "  --bf16            write uint16 bfloat16 bits instead of float32\n"
    "  --allow-nonfinite  decode a set whose elements overflow float32 (to +-Inf, counted)\n";

int run_dequantize(const Args& args) {
  args.expect_positional({"PREFIX", "OUT.npy"});
  const Layout l = parse_layout(args.require("layout"));
  const QTensor q = load_qtensor(l, args.positional()[0], args.get("shape"), args.get("segments"));
  const std::string& out = args.positional()[1];
  const std::vector<int64_t> shape = {q.rows, q.cols};
  std::vector<float> y;
  const int64_t overflow = check_decodes_finite(q, args.positional()[0], args.flag("allow-nonfinite"), &y);
  OutputSet set;
  if (args.flag("bf16")) {
    std::vector<bf16_t> yb(static_cast<size_t>(q.rows * q.cols));
    cpu::dequantize(q, yb.data());
    set.add(out, kNpyU16, shape, yb.data());
    set.commit();
  } else {
    set.add(out, kNpyF32, shape, y.data());
    set.commit();
  }
  int64_t nonfinite = 0;  // NaN-marked tiles, NaN codes and (with --allow-nonfinite) the overflows
  for (float v : y) nonfinite += !num::f32_is_finite(v);
  std::cout << "layout: " << q.describe() << "\n";
  std::cout << "nonfinite: " << nonfinite << "\n";
  if (overflow > 0) std::cout << "overflow: " << overflow << "\n";
  return 0;
}

// ---- transpose -----------------------------------------------------------------------------

const char kTransposeUsage[] =
    "usage: flowmoe transpose --method aware|naive [--exponent row-max|column-amax]\n"
    "                         [--shape M,K] [--segments a,b,...] PREFIX OUTPREFIX\n"
    "\n"
    "Converts a row-wise FP8 tensor (PREFIX.codes.npy [M, K], PREFIX.scales.npy [K/128, M]) to\n"
    "column-wise FP8 and writes OUTPREFIX.codes.npy [K, M], OUTPREFIX.scales.npy [NB, K] and\n"
    "OUTPREFIX.segments.npy [E+1] (layout 'col', see 'flowmoe quantize --help').\n"
    "  aware  scaling-aware transpose: exponent arithmetic only; the result decodes to exactly the\n"
    "         row-wise values except the 'underflow' elements (rounded into E4M3 subnormals/zero).\n"
    "  naive  dequantize -> transpose -> quantize with fresh scales (double quantization).\n"
    "\n"
    "options:\n"
    "  --method M        aware or naive (required)\n"
    "  --exponent R      aware only: the exponent of each column block (docs/NUMERICS.md):\n"
    "                    row-max (default, SPEC 4: the largest row exponent of the block) or\n"
    "                    column-amax (the block's own amax: equals naive bit for bit, one pass)\n"
    "  --shape M,K       logical shape; checked against the files (default: inferred)\n"
    "  --segments a,b,c  token counts per expert segment of the output (default: one segment)\n"
    "  --allow-nonfinite  write the result even if the input holds NaN-marked tiles or NaN codes,\n"
    "                    or elements whose code x scale overflows float32 (counted as 'overflow')\n"
    "\n"
    "The input set is read completely before anything is written, and the output set appears\n"
    "whole or not at all, so OUTPREFIX may equal PREFIX (the row set is replaced atomically).\n"
    "Prints the 'wrote' lines, then 'layout:', 'nonfinite: N' and, for aware, 'underflow: N';\n"
    "for naive 'overflow: N' and 'flushed: N' (counters defined in docs/NPY_FILES.md).\n";

// Non-finite input to a conversion (NaN-marked tiles or NaN codes in the source files), and
// values a stepwise path's BF16 intermediate overflowed to Inf, are an error as for 'quantize':
// nothing is written unless --allow-nonfinite is given. The message names what happened.
void check_conversion_nonfinite(const QuantStats& st, const Args& args, const std::string& what) {
  if (st.nonfinite == 0 || args.flag("allow-nonfinite")) return;
  std::ostringstream os;
  const int64_t in_input = st.nonfinite - st.overflow;
  if (in_input > 0) os << "the input holds " << in_input << " non-finite element(s) (NaN scale 0xFF or NaN codes)";
  if (in_input > 0 && st.overflow > 0) os << ", and ";
  if (st.overflow > 0)
    os << st.overflow << " finite element(s) overflowed to Inf in the path's BF16 intermediate (codes x scale "
       << "beyond the BF16 range, e.g. scale codes near 254)";
  FLOWMOE_CHECK(false, what << ": " << os.str()
                            << "; nothing was written (pass --allow-nonfinite to write the NaN-marked result)");
}

// --exponent row-max|column-amax (default row-max); `applies` says whether the chosen conversion
// has such an exponent.
TransposeExponent parse_exponent(const Args& args, bool applies, const char* where) {
  if (!args.has("exponent")) return TransposeExponent::kRowMax;
  if (!applies) throw UsageError(std::string("--exponent applies to ") + where + " only");
  const std::string e = parse_choice(args.get("exponent"), "--exponent", {"row-max", "column-amax"});
  return e == "column-amax" ? TransposeExponent::kColumnAmax : TransposeExponent::kRowMax;
}

int run_transpose(const Args& args) {
  args.expect_positional({"PREFIX", "OUTPREFIX"});
  const std::string method = parse_choice(args.require("method"), "--method", {"aware", "naive"});
  const TransposeExponent exponent = parse_exponent(args, method == "aware", "--method aware");
  check_output_prefix(args.positional()[1]);
  const QTensor row = load_qtensor(Layout::kRow1x128, args.positional()[0], args.get("shape"), "");
  const Segments seg = segments_from_option(args.get("segments"), row.rows);
  std::vector<float> decoded;
  const int64_t overflow = check_decodes_finite(row, args.positional()[0], args.flag("allow-nonfinite"), &decoded);
  QTensor col;
  QuantStats st = method == "aware" ? cpu::scaling_aware_transpose(row, seg, &col, exponent)
                                    : cpu::naive_col_copy(row, seg, &col);
  if (method == "aware") {  // the naive path counts them itself (its BF16 intermediate overflows)
    st.overflow += overflow;
    st.nonfinite += overflow;
  }
  check_conversion_nonfinite(st, args, args.positional()[0]);
  OutputSet out;
  save_qtensor(col, args.positional()[1], &out);
  out.commit();
  print_stats(col, st, method == "aware" ? Counted::kExact : Counted::kStepwise);
  return 0;
}

// ---- fp4-to-fp8 ----------------------------------------------------------------------------

const char kFp4ToFp8Usage[] =
    "usage: flowmoe fp4-to-fp8 --to row|col|col-stepwise [--exponent row-max|column-amax]\n"
    "                          [--shape M,K] [--segments a,b,...] PREFIX OUTPREFIX\n"
    "\n"
    "Converts an MXFP4 tensor (PREFIX.codes.npy [M, K/2], PREFIX.scales.npy [M, K/32]) to FP8:\n"
    "  row           FP4RowToFP8Row: OUTPREFIX.codes.npy [M, K], OUTPREFIX.scales.npy [K/128, M]\n"
    "                (K must be a multiple of 128)\n"
    "  col           FP4RowToFP8Col, direct: OUTPREFIX.codes.npy [K, M], OUTPREFIX.scales.npy\n"
    "                [NB, K], OUTPREFIX.segments.npy [E+1]\n"
    "  col-stepwise  the baseline: FP4 -> BF16, transpose, quantize with fresh scales (same files)\n"
    "The direct conversions are exact while the exponent spread of the combined blocks is <= 14;\n"
    "beyond, values round into the E4M3 subnormals and are counted as 'underflow'.\n"
    "The input set is read completely first and the output set appears whole or not at all.\n"
    "Prints the 'wrote' lines, then 'layout:', 'nonfinite: N' and, for row and col,\n"
    "'underflow: N'; for col-stepwise 'overflow: N' and 'flushed: N' (docs/NPY_FILES.md).\n"
    "\n"
    "options:\n"
    "  --to T            row, col or col-stepwise (required)\n"
    "  --exponent R      col only: the exponent of each column block: row-max (default, the\n"
    "                    largest block exponent - 6) or column-amax (the block's own amax: equals\n"
    "                    col-stepwise bit for bit, one pass)\n"
    "  --shape M,K       logical shape; checked against the files (default: inferred)\n"
    "  --segments a,b,c  col and col-stepwise only: token counts per expert segment\n"
    "  --allow-nonfinite  write the result even if the input holds NaN-marked blocks, or elements\n"
    "                    whose code x scale overflows float32 (counted as 'overflow')\n";

int run_fp4_to_fp8(const Args& args) {
  args.expect_positional({"PREFIX", "OUTPREFIX"});
  const std::string to = parse_choice(args.require("to"), "--to", {"row", "col", "col-stepwise"});
  if (to == "row" && args.has("segments")) throw UsageError("--segments applies to --to col and col-stepwise only");
  const TransposeExponent exponent = parse_exponent(args, to == "col", "--to col");
  check_output_prefix(args.positional()[1]);
  const QTensor fp4 = load_qtensor(Layout::kMxfp4Row1x32, args.positional()[0], args.get("shape"), "");
  std::vector<float> decoded;
  const int64_t overflow = check_decodes_finite(fp4, args.positional()[0], args.flag("allow-nonfinite"), &decoded);
  QTensor out;
  QuantStats st;
  if (to == "row") {
    check_layout_shape(Layout::kRow1x128, fp4.rows, fp4.cols, args.positional()[0] + ".codes.npy");
    st = cpu::fp4_to_fp8_row(fp4, &out);
  } else {
    const Segments seg = segments_from_option(args.get("segments"), fp4.rows);
    st = to == "col" ? cpu::fp4_to_fp8_col(fp4, seg, &out, exponent) : cpu::fp4_to_fp8_col_stepwise(fp4, seg, &out);
  }
  if (to != "col-stepwise") {  // the stepwise path counts them itself (its BF16 intermediate overflows)
    st.overflow += overflow;
    st.nonfinite += overflow;
  }
  check_conversion_nonfinite(st, args, args.positional()[0]);
  OutputSet set;
  save_qtensor(out, args.positional()[1], &set);
  set.commit();
  print_stats(out, st, to == "col-stepwise" ? Counted::kStepwise : Counted::kExact);
  return 0;
}

}  // namespace

Command quantize_command() {
  return {"quantize", "quantize a .npy array to FP8 (row, col, both, weight) or MXFP4",
          kQuantizeUsage,
          {{"layout", true}, {"segments", true}, {"allow-nonfinite", false}},
          run_quantize};
}

Command dequantize_command() {
  return {"dequantize", "decode quantized .npy files back to float32 or bfloat16",
          kDequantizeUsage,
          {{"layout", true}, {"shape", true}, {"segments", true}, {"bf16", false}, {"allow-nonfinite", false}},
          run_dequantize};
}

Command transpose_command() {
  return {"transpose", "row-wise FP8 -> column-wise FP8 (scaling-aware or naive)",
          kTransposeUsage,
          {{"method", true}, {"exponent", true}, {"shape", true}, {"segments", true}, {"allow-nonfinite", false}},
          run_transpose};
}

Command fp4_to_fp8_command() {
  return {"fp4-to-fp8", "MXFP4 -> FP8 row-wise or column-wise (direct or stepwise)",
          kFp4ToFp8Usage,
          {{"to", true}, {"exponent", true}, {"shape", true}, {"segments", true}, {"allow-nonfinite", false}},
          run_fp4_to_fp8};
}

}  // namespace cli
}  // namespace flowmoe
