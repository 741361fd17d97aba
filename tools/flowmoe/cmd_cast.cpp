// Element-wise codec subcommands: cast (encode without scaling) and decode. They expose the
// flowmoe::num functions one to one, so an external oracle (ml_dtypes) can check every bit.
#include <iostream>
#include <string>
#include <vector>

#include "cli.h"
#include "npy.h"
#include "output_set.h"
#include "set_files.h"
#include "flowmoe/error.h"
#include "flowmoe/numerics.h"
#include "flowmoe/tensor.h"

namespace flowmoe {
namespace cli {
namespace {

const char kCastUsage[] =
    "usage: flowmoe cast --format e4m3|e2m1|bf16 IN.npy OUT.npy\n"
    "\n"
    "Element-wise cast WITHOUT scaling, round to nearest even. IN.npy is float32 ('<f4') or\n"
    "uint16 bfloat16 bits ('<u2'), any shape; OUT.npy has the same shape:\n"
    "  e4m3  uint8, one E4M3 (OCP fn) code per element; saturates to +-448; Inf -> +-448,\n"
    "        NaN -> 0x7F (sign kept)\n"
    "  e2m1  uint8, one E2M1 code per byte in the low nibble (NOT packed), high nibble 0;\n"
    "        saturates to +-6; Inf and NaN -> +-6 (E2M1 has no NaN)\n"
    "  bf16  uint16 bfloat16 bits; overflow rounds to Inf as IEEE does; NaN stays (quiet) NaN\n";

const char kDecodeUsage[] =
    "usage: flowmoe decode --format e4m3|e2m1|ue8m0|bf16 IN.npy OUT.npy\n"
    "\n"
    "Element-wise decode to float32 ('<f4'), same shape. IN.npy holds:\n"
    "  e4m3   uint8 E4M3 (OCP fn) codes; 0x7F/0xFF -> NaN\n"
    "  e2m1   uint8, one E2M1 code per byte (0..15, low nibble; other bytes are an error)\n"
    "  ue8m0  uint8 scale codes: 2^(c-127); 0xFF -> NaN\n"
    "  bf16   uint16 bfloat16 bits\n";

// Loads a float32 or bf16 array as float32 values (bf16 widening is exact).
std::vector<float> load_as_f32(const NpyArray& a, const std::string& path) {
  if (a.dtype == kNpyF32) return npy_values<float>(a, kNpyF32, path);
  FLOWMOE_CHECK(a.dtype == kNpyU16, path << ": input must be float32 ('<f4') or uint16 bfloat16 bits ('<u2'), got "
                                         << npy_dtype_name(a.dtype));
  const std::vector<bf16_t> h = npy_values<bf16_t>(a, kNpyU16, path);
  std::vector<float> f(h.size());
  for (size_t i = 0; i < h.size(); ++i) f[i] = num::bf16_to_f32(h[i]);
  return f;
}

int run_cast(const Args& args) {
  args.expect_positional({"IN.npy", "OUT.npy"});
  const std::string fmt = parse_choice(args.require("format"), "--format", {"e4m3", "e2m1", "bf16"});
  const std::string& in = args.positional()[0];
  const std::string& out = args.positional()[1];
  const NpyArray a = [&] {
    const SetReadGuard guard({in});  // (a flowmoe writer of this file waits; set_files.h)
    return npy_load(in);
  }();
  const std::vector<float> x = load_as_f32(a, in);
  OutputSet set;
  if (fmt == "bf16") {
    std::vector<bf16_t> y(x.size());
    for (size_t i = 0; i < x.size(); ++i) y[i] = num::f32_to_bf16(x[i]);
    set.add(out, kNpyU16, a.shape, y.data());
  } else {
    std::vector<uint8_t> y(x.size());
    for (size_t i = 0; i < x.size(); ++i) y[i] = fmt == "e4m3" ? num::f32_to_e4m3(x[i]) : num::f32_to_e2m1(x[i]);
    set.add(out, kNpyU8, a.shape, y.data());
  }
  set.commit();
  return 0;
}

int run_decode(const Args& args) {
  args.expect_positional({"IN.npy", "OUT.npy"});
  const std::string fmt = parse_choice(args.require("format"), "--format", {"e4m3", "e2m1", "ue8m0", "bf16"});
  const std::string& in = args.positional()[0];
  const std::string& out = args.positional()[1];
  const NpyArray a = [&] {
    const SetReadGuard guard({in});  // (a flowmoe writer of this file waits; set_files.h)
    return npy_load(in);
  }();
  std::vector<float> y(static_cast<size_t>(a.numel()));
  if (fmt == "bf16") {
    const std::vector<bf16_t> h = npy_values<bf16_t>(a, kNpyU16, in);
    for (size_t i = 0; i < h.size(); ++i) y[i] = num::bf16_to_f32(h[i]);
  } else {
    const std::vector<uint8_t> c = npy_values<uint8_t>(a, kNpyU8, in);
    for (size_t i = 0; i < c.size(); ++i) {
      if (fmt == "e4m3") {
        y[i] = num::e4m3_to_f32(c[i]);
      } else if (fmt == "ue8m0") {
        y[i] = num::ue8m0_to_f32(c[i]);
      } else {
        FLOWMOE_CHECK(c[i] <= 0xF, in << ": element " << i << " is " << static_cast<int>(c[i])
                                      << ", not an e2m1 code (expected 0..15, one code per byte in the low nibble)");
        y[i] = num::e2m1_to_f32(c[i]);
      }
    }
  }
  OutputSet set;
  set.add(out, kNpyF32, a.shape, y.data());
  set.commit();
  return 0;
}

}  // namespace

Command cast_command() {
  return {"cast", "element-wise cast to e4m3/e2m1/bf16 codes, no scaling (RNE, saturating)",
          kCastUsage, {{"format", true}}, run_cast};
}

Command decode_command() {
  return {"decode", "element-wise decode of e4m3/e2m1/ue8m0/bf16 codes to float32",
          kDecodeUsage, {{"format", true}}, run_decode};
}

}  // namespace cli
}  // namespace flowmoe
