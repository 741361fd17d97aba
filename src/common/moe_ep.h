// Expert-parallel bookkeeping shared by the CPU and CUDA MoE layers (internal; docs/EP.md §5-6):
// the recipe's wire format, a plan's variant for another format / pass, and the cast report's
// wire-transfer rows, and the configuration check every rank of an EP layer runs. Defined in
// src/common/moe_common.cpp.
#pragma once

#include <cstdint>
#include <string>
#include <utility>
#include <vector>

#include "flowmoe/comm.h"
#include "flowmoe/moe.h"

namespace flowmoe {
namespace ep_detail {

// The wire format of the forward dispatch: the recipe's format of x before GEMM1.
WireFormat forward_wire_format(Recipe r);
// The plan with another wire format: forward dispatches carry the probabilities, backward ones do
// not. Same counts and layouts, no collective.
DispatchPlan plan_for(const DispatchPlan& plan, MoePass pass, WireFormat f);
// The rows and bytes this rank sent to other ranks (its own rows are local copies).
WireTransfer dispatch_transfer(MoePass pass, const std::string& name, const DispatchPlan& p);
// The combine back along `plan` (rows received in the dispatch return), row_bytes each.
WireTransfer combine_transfer(MoePass pass, const std::string& name, const std::string& format,
                              int64_t row_bytes, const DispatchPlan& plan);

// Collective: every rank must hold the same MoeConfig (the fields that shape the layer, floats
// compared by their bits) and the same backend settings `extra` (name, value); a mismatch is a
// CommError on every rank naming the field (Communicator::check_uniform).
void check_uniform_config(Communicator& comm, const char* what, const MoeConfig& cfg,
                          const std::vector<std::pair<std::string, int64_t>>& extra = {});

}  // namespace ep_detail
}  // namespace flowmoe
