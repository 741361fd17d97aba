// Backend-independent parts of the Communicator (flowmoe/comm.h): all-to-all-v over exchange(),
// the configuration check across ranks, and the wire formats.
#include <cmath>
#include <sstream>

#include "flowmoe/comm.h"

namespace flowmoe {

void Communicator::set_timeout_s(double s) {
  FLOWMOE_CHECK(std::isfinite(s) && s > 0, "Communicator::set_timeout_s: timeout " << s
                                               << " s; expected a finite value > 0");
  timeout_s_ = s;
}

void Communicator::alltoallv(const void* send, const int64_t* send_counts,
                             const int64_t* send_offsets, void* recv, const int64_t* recv_counts,
                             const int64_t* recv_offsets) {
  const int n = world_size();
  FLOWMOE_CHECK(send_counts && send_offsets && recv_counts && recv_offsets,
                "alltoallv: null count or offset array; expected " << n << " entries each");
  std::vector<P2pOp> sends, recvs;
  for (int p = 0; p < n; ++p) {
    FLOWMOE_CHECK(send_counts[p] >= 0 && send_offsets[p] >= 0 && recv_counts[p] >= 0 &&
                      recv_offsets[p] >= 0,
                  "alltoallv: negative count or offset for peer " << p);
    if (send_counts[p] > 0) {
      FLOWMOE_CHECK(send != nullptr, "alltoallv: null send buffer with send_counts[" << p << "] = "
                                                                                  << send_counts[p]);
      sends.push_back({p, const_cast<uint8_t*>(static_cast<const uint8_t*>(send)) + send_offsets[p],
                       send_counts[p]});
    }
    if (recv_counts[p] > 0) {
      FLOWMOE_CHECK(recv != nullptr, "alltoallv: null recv buffer with recv_counts[" << p << "] = "
                                                                                  << recv_counts[p]);
      recvs.push_back({p, static_cast<uint8_t*>(recv) + recv_offsets[p], recv_counts[p]});
    }
  }
  exchange(sends, recvs);
}

void Communicator::check_uniform(const char* what, const std::vector<std::string>& names,
                                 const std::vector<int64_t>& values) {
  FLOWMOE_CHECK(names.size() == values.size(),
                "check_uniform: " << names.size() << " names for " << values.size() << " values");
  const int world = world_size();
  // Per peer: the number of fields, then each value as two int32 halves. The field count is part
  // of the message so that a different count is reported, not misread.
  const int n = 1 + 2 * static_cast<int>(values.size());
  std::vector<int32_t> mine(n), send(static_cast<size_t>(n) * world), recv(send.size());
  mine[0] = static_cast<int32_t>(values.size());
  for (size_t i = 0; i < values.size(); ++i) {
    const uint64_t u = static_cast<uint64_t>(values[i]);
    mine[1 + 2 * i] = static_cast<int32_t>(static_cast<uint32_t>(u & 0xFFFFFFFFu));
    mine[2 + 2 * i] = static_cast<int32_t>(static_cast<uint32_t>(u >> 32));
  }
  for (int p = 0; p < world; ++p)
    for (int i = 0; i < n; ++i) send[static_cast<size_t>(p) * n + i] = mine[i];
  alltoall_i32(send.data(), recv.data(), n);
  auto value_of = [&](int p, size_t i) {
    const uint64_t lo = static_cast<uint32_t>(recv[static_cast<size_t>(p) * n + 1 + 2 * i]);
    const uint64_t hi = static_cast<uint32_t>(recv[static_cast<size_t>(p) * n + 2 + 2 * i]);
    return static_cast<int64_t>(lo | (hi << 32));
  };
  // Compared against rank 0 in a fixed order, so every rank reports the same first difference.
  for (int p = 1; p < world; ++p) {
    if (recv[static_cast<size_t>(p) * n] != recv[0])
      throw CommError(__FILE__, __LINE__,
                      std::string(what) + ": mismatched configuration across ranks: rank 0 checks " +
                          std::to_string(recv[0]) + " fields but rank " + std::to_string(p) +
                          " checks " + std::to_string(recv[static_cast<size_t>(p) * n]));
  }
  for (size_t i = 0; i < values.size(); ++i) {
    for (int p = 1; p < world; ++p) {
      if (value_of(p, i) != value_of(0, i)) {
        std::ostringstream os;
        os << what << ": mismatched configuration across ranks: " << names[i] << " = "
           << value_of(0, i) << " on rank 0 but " << value_of(p, i) << " on rank " << p
           << " (seen by rank " << rank() << "); every rank must pass the same " << names[i];
        throw CommError(__FILE__, __LINE__, os.str());
      }
    }
  }
}

void Communicator::agree_on_local_errors(const char* what, const std::string& local_error) {
  const int world = world_size();
  std::vector<int32_t> send(world, local_error.empty() ? 0 : 1), recv(world, 0);
  alltoall_i32(send.data(), recv.data(), 1);
  if (!local_error.empty()) throw Error(__FILE__, __LINE__, local_error);
  for (int p = 0; p < world; ++p)
    if (recv[p] != 0)
      throw CommError(__FILE__, __LINE__,
                      std::string(what) + ": rank " + std::to_string(p) +
                          " rejected its input (its own error message says why); rank " +
                          std::to_string(rank()) + " stops too");
}

// ---- wire formats -------------------------------------------------------------------------------
const char* wire_format_name(WireFormat f) {
  switch (f) {
    case WireFormat::kBf16: return "bf16";
    case WireFormat::kFp8: return "fp8";
    case WireFormat::kFp8Fp32Scale: return "fp8-fp32scale";
    case WireFormat::kMxfp4: return "mxfp4";
  }
  return "?";
}

int64_t wire_code_bytes(WireFormat f, int64_t h) {
  switch (f) {
    case WireFormat::kBf16: return 2 * h;
    case WireFormat::kFp8:
    case WireFormat::kFp8Fp32Scale: return h;
    case WireFormat::kMxfp4: return h / 2;
  }
  return 0;
}

int64_t wire_scale_bytes(WireFormat f, int64_t h) {
  switch (f) {
    case WireFormat::kBf16: return 0;
    case WireFormat::kFp8: return h / kFp8Block;
    case WireFormat::kFp8Fp32Scale: return 4 * (h / kFp8Block);
    case WireFormat::kMxfp4: return h / kFp4Block;
  }
  return 0;
}

void EpConfig::validate(int world_size) const {
  FLOWMOE_CHECK(world_size >= 1, "EpConfig: world size " << world_size << "; expected >= 1");
  FLOWMOE_CHECK(num_experts >= 1 && num_experts <= kRouterMaxExperts,
                "EpConfig: num_experts E = " << num_experts << "; expected 1.." << kRouterMaxExperts);
  FLOWMOE_CHECK(num_experts % world_size == 0,
                "EpConfig: num_experts E = " << num_experts << " is not a multiple of the world size "
                                             << world_size
                                             << "; expected the experts split evenly over ranks");
  FLOWMOE_CHECK(topk >= 1 && topk <= kMaxTopk && topk <= num_experts,
                "EpConfig: topk k = " << topk << "; expected 1..min(E = " << num_experts << ", "
                                      << kMaxTopk << ")");
  FLOWMOE_CHECK(align >= 1 && align <= kMaxAlign,
                "EpConfig: align A = " << align << "; expected 1.." << kMaxAlign);
  int64_t mult = 8;
  if (format == WireFormat::kFp8 || format == WireFormat::kFp8Fp32Scale) mult = kFp8Block;
  if (format == WireFormat::kMxfp4) mult = kFp4Block;
  FLOWMOE_CHECK(hidden >= 1 && hidden % mult == 0,
                "EpConfig: hidden H = " << hidden << " for wire format " << wire_format_name(format)
                                        << "; expected a positive multiple of " << mult);
}

}  // namespace flowmoe
