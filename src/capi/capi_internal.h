// Internal pieces of the C ABI (include/flowmoe/c_api.h), shared by the files of src/capi/.
#pragma once

#include <memory>
#include <string>

#include "flowmoe/c_api.h"
#include "flowmoe/comm.h"
#include "flowmoe/moe.h"

namespace flowmoe {
namespace capi {

// The reason a caller's callback gave with flowmoe_set_callback_error (this thread), then cleared.
std::string take_callback_error();

// The communicator of flowmoe_comm_create_host (host_comm.cpp).
std::unique_ptr<Communicator> make_host_callback_comm(int rank, int world,
                                                      const flowmoe_host_comm_ops& ops,
                                                      double timeout_s);

// CastReport as JSON (report_json.cpp): every field of moe.h's CastReport plus its derived sums.
std::string cast_report_json(const CastReport& r);

}  // namespace capi
}  // namespace flowmoe
