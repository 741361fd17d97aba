// The cast report of the CPU MoE layer (src/cpu/moe/layer.h): operators appended as they run,
// saved tensors with their actual bytes (names and formats from the recipe table), and the
// comparison of each wgrad column operand with its row-wise twin (MoeConfig::check_columns).
#include <algorithm>
#include <cmath>
#include <vector>

#include "cpu/moe/layer.h"

namespace flowmoe {
namespace cpu_moe {

namespace rn = report_names;

void OpLog::add(CastKind kind, const std::string& name, int64_t outputs, int64_t elements) {
  report_->add_op(pass_, kind, name, 1, outputs, elements);
}

std::vector<float> decode(const QTensor& q) {
  std::vector<float> out(q.rows * q.cols);
  cpu::dequantize(q, out.data());
  return out;
}

std::vector<float> decode(const cpu::QTensorF32& q) {
  std::vector<float> out(q.rows * q.cols);
  cpu::dequantize(q, out.data());
  return out;
}

ColumnCheck compare_columns(WgradOperand operand, ColumnMethod method,
                            const std::vector<float>& row, const std::vector<float>& col,
                            const cpu::Routing& r, int64_t c, int64_t underflow) {
  ColumnCheck cc;
  cc.name = wgrad_operand_name(operand);
  cc.method = column_method_name(method);
  cc.underflow = underflow;
  for (int e = 0; e < r.num_experts; ++e)
    for (int64_t t = r.padded_offsets[e]; t < r.padded_offsets[e] + r.counts[e]; ++t)
      for (int64_t j = 0; j < c; ++j) {
        const float a = row[t * c + j], b = col[t * c + j];
        ++cc.elements;
        if (!(a == b || (std::isnan(a) && std::isnan(b)))) ++cc.differ;
      }
  return cc;
}

void CpuMoeLayer::check_column(WgradOperand operand, ColumnMethod method,
                               const std::vector<float>& row, const std::vector<float>& col,
                               int64_t cols, int64_t underflow) {
  report_.columns.push_back(
      compare_columns(operand, method, row, col, route_.routing, cols, underflow));
}

// The rows this rank holds: its routed rows (one rank) or the rows its El experts received; the
// unpadded figure counts those rows only, per token of this rank.
void CpuMoeLayer::save_activation(const SavedSpec& spec, int64_t bytes) {
  SavedTensor s;
  s.name = spec.name;
  s.format = spec.format_string();
  s.bytes = bytes;
  s.bytes_per_token_unpadded =
      spec.row_bytes(H_, F_) * double(route_.routing.routed_rows()) / double(T_);
  report_.saved.push_back(s);
}

void CpuMoeLayer::save_routing_state() {
  auto save_tokens = [&](const char* name, const char* format, int64_t bytes) {
    SavedTensor s;
    s.name = name;
    s.format = format;
    s.bytes = bytes;
    s.bytes_per_token_unpadded = double(bytes) / double(T_);
    report_.saved.push_back(s);
  };
  save_tokens(rn::kSavedRouterInput, rn::kSavedRouterInputFormat, T_ * H_ * 2);
  save_tokens(rn::kSavedRouterLogits, rn::kSavedRouterLogitsFormat, T_ * E_ * 4);
  save_tokens(rn::kSavedRouting, rn::kSavedRoutingFormat, T_ * K_ * 12);
}

}  // namespace cpu_moe
}  // namespace flowmoe
