// A host-memory Communicator (flowmoe/comm.h) whose transport is supplied through C callbacks
// (flowmoe/c_api.h flowmoe_host_comm_ops): the CPU layer's expert parallelism across processes,
// e.g. Python moving the bytes over torch.distributed (gloo). Local copies and the scratch buffer
// are plain host memory here; only alltoall_i32, exchange and barrier cross processes.
#include "capi/capi_internal.h"

#include <cstring>
#include <utility>

namespace flowmoe {
namespace capi {

namespace {

class HostCallbackComm final : public Communicator {
 public:
  HostCallbackComm(int rank, int world, const flowmoe_host_comm_ops& ops, double timeout_s)
      : rank_(rank), world_(world), ops_(ops) {
    set_timeout_s(timeout_s);
  }

  int rank() const override { return rank_; }
  int world_size() const override { return world_; }
  const char* backend() const override { return "host-callback"; }
  MemorySpace memory_space() const override { return MemorySpace::kHost; }

  void alltoall_i32(const int32_t* send, int32_t* recv, int n) override {
    check_healthy("alltoall_i32");
    FLOWMOE_CHECK(n >= 0, "alltoall_i32: n = " << n << "; expected >= 0");
    call("alltoall_i32", ops_.alltoall_i32(ops_.ctx, send, recv, n));
  }

  void exchange(const std::vector<P2pOp>& sends, const std::vector<P2pOp>& recvs) override {
    check_healthy("exchange");
    std::vector<flowmoe_p2p> s(sends.size()), r(recvs.size());
    for (size_t i = 0; i < sends.size(); ++i) s[i] = to_c(sends[i], "exchange send");
    for (size_t i = 0; i < recvs.size(); ++i) r[i] = to_c(recvs[i], "exchange recv");
    call("exchange", ops_.exchange(ops_.ctx, s.data(), int32_t(s.size()), r.data(),
                                   int32_t(r.size())));
  }

  void copy_local(const std::vector<CopyPiece>& pieces) override {
    check_healthy("copy_local");
    for (const CopyPiece& p : pieces) {
      FLOWMOE_CHECK(p.bytes >= 0 && p.dst != nullptr && (p.src != nullptr || p.bytes == 0),
                    "copy_local: a piece of " << p.bytes
                                              << " bytes with a null pointer; expected both set");
      if (p.bytes) std::memcpy(p.dst, p.src, size_t(p.bytes));
    }
  }

  void* scratch(int64_t bytes) override {
    FLOWMOE_CHECK(bytes >= 0, "scratch: " << bytes << " bytes; expected >= 0");
    if (bytes == 0 && scratch_.empty()) return nullptr;
    if (int64_t(scratch_.size()) < bytes) scratch_.resize(size_t(bytes + bytes / 4));
    return scratch_.data();
  }

  void barrier() override {
    check_healthy("barrier");
    call("barrier", ops_.barrier(ops_.ctx));
  }
  void synchronize() override { check_healthy("synchronize"); }

  std::string error() const override { return error_; }
  void abort(const std::string& reason) override {
    if (error_.empty()) error_ = reason.empty() ? std::string("aborted") : reason;
  }

 private:
  flowmoe_p2p to_c(const P2pOp& op, const char* what) const {
    FLOWMOE_CHECK(op.peer >= 0 && op.peer < world_,
                  what << ": peer " << op.peer << "; expected 0 <= peer < " << world_);
    FLOWMOE_CHECK(op.bytes >= 0 && (op.data != nullptr || op.bytes == 0),
                  what << ": " << op.bytes << " bytes at a null pointer; expected a host buffer");
    flowmoe_p2p c;
    c.peer = op.peer;
    c.data = op.data;
    c.bytes = op.bytes;
    return c;
  }
  void check_healthy(const char* what) const {
    if (!error_.empty())
      throw CommError(__FILE__, __LINE__,
                      std::string(what) + ": the communicator has failed earlier (" + error_ +
                          "); expected a healthy communicator (make a new one)");
  }
  void call(const char* what, int rc) {
    if (rc == 0) return;
    std::string reason = take_callback_error();
    if (reason.empty()) reason = "callback returned " + std::to_string(rc);
    abort(std::string(what) + ": " + reason);
    throw CommError(__FILE__, __LINE__,
                    std::string("host communicator: ") + what + " failed on rank " +
                        std::to_string(rank_) + ": " + reason);
  }

  const int rank_, world_;
  const flowmoe_host_comm_ops ops_;
  std::vector<uint8_t> scratch_;
  std::string error_;
};

}  // namespace

std::unique_ptr<Communicator> make_host_callback_comm(int rank, int world,
                                                      const flowmoe_host_comm_ops& ops,
                                                      double timeout_s) {
  FLOWMOE_CHECK(world >= 1 && rank >= 0 && rank < world,
                "flowmoe_comm_create_host: rank " << rank << " of world size " << world
                                                  << "; expected 0 <= rank < world_size");
  FLOWMOE_CHECK(ops.alltoall_i32 && ops.exchange && ops.barrier,
                "flowmoe_comm_create_host: a null callback; expected alltoall_i32, exchange and "
                "barrier set");
  FLOWMOE_CHECK(timeout_s > 0, "flowmoe_comm_create_host: timeout " << timeout_s
                                                                    << " s; expected > 0");
  return std::unique_ptr<Communicator>(new HostCallbackComm(rank, world, ops, timeout_s));
}

}  // namespace capi
}  // namespace flowmoe
