// The cast report (moe.h CastReport) as a JSON object for the C ABI's callers (Python turns it into
// a dict: flowmoe.torch.MoE.cast_report()).
#include <cmath>
#include <cstdio>
#include <sstream>

#include "capi/capi_internal.h"

namespace flowmoe {
namespace capi {

namespace {

std::string quoted(const std::string& s) {
  std::string out = "\"";
  for (char c : s) {
    switch (c) {
      case '"': out += "\\\""; break;
      case '\\': out += "\\\\"; break;
      case '\n': out += "\\n"; break;
      case '\t': out += "\\t"; break;
      default:
        if (static_cast<unsigned char>(c) < 0x20) {
          char buf[8];
          std::snprintf(buf, sizeof buf, "\\u%04x", c);
          out += buf;
        } else {
          out += c;
        }
    }
  }
  return out + "\"";
}

std::string number(double v) {
  if (!std::isfinite(v)) return "null";
  std::ostringstream os;
  os.precision(17);
  os << v;
  return os.str();
}

std::string stats(const QuantStats& s) {
  return "{\"nonfinite\": " + std::to_string(s.nonfinite) +
         ", \"underflow\": " + std::to_string(s.underflow) + "}";
}

}  // namespace

std::string cast_report_json(const CastReport& r) {
  std::ostringstream os;
  os << "{\"recipe\": " << quoted(recipe_name(r.recipe)) << ", \"tokens\": " << r.tokens
     << ", \"routed_rows\": " << r.routed_rows << ", \"padded_rows\": " << r.padded_rows;
  os << ", \"ops\": [";
  for (size_t i = 0; i < r.ops.size(); ++i) {
    const CastOp& o = r.ops[i];
    os << (i ? ", " : "") << "{\"pass\": " << quoted(moe_pass_name(o.pass))
       << ", \"kind\": " << quoted(cast_kind_name(o.kind)) << ", \"name\": " << quoted(o.name)
       << ", \"calls\": " << o.calls << ", \"outputs\": " << o.outputs
       << ", \"elements\": " << o.elements << "}";
  }
  os << "], \"saved\": [";
  for (size_t i = 0; i < r.saved.size(); ++i) {
    const SavedTensor& s = r.saved[i];
    os << (i ? ", " : "") << "{\"name\": " << quoted(s.name) << ", \"format\": " << quoted(s.format)
       << ", \"bytes\": " << s.bytes
       << ", \"bytes_per_token_unpadded\": " << number(s.bytes_per_token_unpadded) << "}";
  }
  os << "], \"columns\": [";
  for (size_t i = 0; i < r.columns.size(); ++i) {
    const ColumnCheck& c = r.columns[i];
    os << (i ? ", " : "") << "{\"name\": " << quoted(c.name) << ", \"method\": " << quoted(c.method)
       << ", \"elements\": " << c.elements << ", \"differ\": " << c.differ
       << ", \"underflow\": " << c.underflow << "}";
  }
  os << "], \"wire\": [";
  for (size_t i = 0; i < r.wire.size(); ++i) {
    const WireTransfer& w = r.wire[i];
    os << (i ? ", " : "") << "{\"pass\": " << quoted(moe_pass_name(w.pass))
       << ", \"name\": " << quoted(w.name) << ", \"format\": " << quoted(w.format)
       << ", \"rows\": " << w.rows << ", \"bytes\": " << w.bytes << "}";
  }
  os << "], \"forward_stats\": " << stats(r.forward_stats)
     << ", \"backward_stats\": " << stats(r.backward_stats);
  os << ", \"saved_bytes\": " << r.saved_bytes()
     << ", \"saved_bytes_per_token\": " << number(r.tokens ? r.saved_bytes_per_token() : 0.0)
     << ", \"saved_bytes_per_token_unpadded\": " << number(r.saved_bytes_per_token_unpadded());
  os << ", \"standalone_casts\": {";
  const MoePass passes[] = {MoePass::kWeightUpdate, MoePass::kForward, MoePass::kBackward};
  for (int i = 0; i < 3; ++i)
    os << (i ? ", " : "") << quoted(moe_pass_name(passes[i])) << ": "
       << r.standalone_casts(passes[i]);
  os << "}, \"wire_bytes\": {";
  for (int i = 0; i < 2; ++i)
    os << (i ? ", " : "") << quoted(moe_pass_name(passes[i + 1])) << ": "
       << r.wire_bytes(passes[i + 1]);
  os << "}}";
  return os.str();
}

}  // namespace capi
}  // namespace flowmoe
