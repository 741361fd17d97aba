// SimWorld (flowmoe/comm.h): N ranks in one process, one thread each, host memory. Every
// collective is a rendezvous in two phases on one shared board:
//   arrive  : the rank posts what it sends and expects, waits until every rank has posted;
//   check   : the posts must describe the same collective with matching sizes (else CommError);
//   copy    : each rank copies what its peers address to it (peers' send buffers stay valid);
//   depart  : waits until every rank has copied, so no send buffer is released early.
// Every wait is bounded by the timeout; an error (timeout, mismatch, abort) is recorded on the
// world and wakes every waiter, which then throws CommError. Errors are sticky.
#include <chrono>
#include <condition_variable>
#include <cstring>
#include <exception>
#include <mutex>
#include <sstream>
#include <thread>
#include <utility>

#include "flowmoe/comm.h"

namespace flowmoe {

namespace {

enum class SimOp : uint8_t { kAlltoallI32, kExchange, kBarrier };
const char* sim_op_name(SimOp op) {
  switch (op) {
    case SimOp::kAlltoallI32: return "alltoall_i32";
    case SimOp::kExchange: return "exchange";
    case SimOp::kBarrier: return "barrier";
  }
  return "?";
}

struct Post {
  SimOp op = SimOp::kBarrier;
  uint64_t seq = 0;
  const int32_t* a2a_send = nullptr;
  int a2a_n = 0;
  const std::vector<P2pOp>* sends = nullptr;
  const std::vector<P2pOp>* recvs = nullptr;
};

std::string sizes_of(const std::vector<const P2pOp*>& ops) {
  std::ostringstream os;
  os << ops.size() << " chunk(s) [";
  for (size_t i = 0; i < ops.size(); ++i) os << (i ? ", " : "") << ops[i]->bytes;
  os << " bytes]";
  return os.str();
}

}  // namespace

class SimComm;

struct SimWorld::Impl {
  int n = 0;
  double timeout_s = 30.0;
  std::mutex m;
  std::condition_variable cv;
  std::vector<uint64_t> phase;  // phases each rank has reached (2 per collective)
  std::vector<Post> posts;
  std::string error;            // first error of the world ("" while healthy)
  int readers = 0;              // ranks between arrival and departure (reading peers' buffers)
  std::vector<int64_t> bytes_sent;
  std::vector<std::unique_ptr<SimComm>> comms;
  MemorySpace space = MemorySpace::kHost;
  SimWorld::Copier copier;  // kDevice only
};

class SimComm final : public Communicator {
 public:
  SimComm(SimWorld::Impl* w, int rank) : w_(w), rank_(rank) { timeout_s_ = w->timeout_s; }

  int rank() const override { return rank_; }
  int world_size() const override { return w_->n; }
  const char* backend() const override { return "sim"; }
  MemorySpace memory_space() const override { return w_->space; }

  void alltoall_i32(const int32_t* send, int32_t* recv, int n) override {
    FLOWMOE_CHECK(n >= 0, "alltoall_i32: n = " << n << "; expected >= 0");
    Post p;
    p.op = SimOp::kAlltoallI32;
    p.a2a_send = send;
    p.a2a_n = n;
    arrive(p);
    for (int q = 1; q < w_->n; ++q) {  // against rank 0: the same message on every rank
      const Post& o = w_->posts[q];
      if (o.a2a_n != w_->posts[0].a2a_n)
        fail(sim_op_name(p.op), "rank 0 exchanges " + std::to_string(w_->posts[0].a2a_n) +
                                    " ints per peer but rank " + std::to_string(q) +
                                    " exchanges " + std::to_string(o.a2a_n));
    }
    for (int q = 0; q < w_->n; ++q)
      if (n > 0)
        std::memcpy(recv + static_cast<size_t>(q) * n,
                    w_->posts[q].a2a_send + static_cast<size_t>(rank_) * n, sizeof(int32_t) * n);
    depart(p.op);
  }

  void exchange(const std::vector<P2pOp>& sends, const std::vector<P2pOp>& recvs) override {
    for (const P2pOp& o : sends)
      FLOWMOE_CHECK(o.peer >= 0 && o.peer < w_->n && o.bytes >= 0 && (o.bytes == 0 || o.data),
                    "exchange: bad send op (peer " << o.peer << ", " << o.bytes
                                                   << " bytes); expected a peer in [0, "
                                                   << w_->n << ") and a buffer");
    for (const P2pOp& o : recvs)
      FLOWMOE_CHECK(o.peer >= 0 && o.peer < w_->n && o.bytes >= 0 && (o.bytes == 0 || o.data),
                    "exchange: bad recv op (peer " << o.peer << ", " << o.bytes
                                                   << " bytes); expected a peer in [0, "
                                                   << w_->n << ") and a buffer");
    Post p;
    p.op = SimOp::kExchange;
    p.sends = &sends;
    p.recvs = &recvs;
    arrive(p);
    // Match, per peer q, q's sends addressed to this rank with this rank's recvs from q, in order.
    int64_t sent_elsewhere = 0;
    for (const P2pOp& o : sends)
      if (o.peer != rank_) sent_elsewhere += o.bytes;
    for (int q = 0; q < w_->n; ++q) {
      std::vector<const P2pOp*> in, mine;
      for (const P2pOp& o : *w_->posts[q].sends)
        if (o.peer == rank_) in.push_back(&o);
      for (const P2pOp& o : recvs)
        if (o.peer == q) mine.push_back(&o);
      bool ok = in.size() == mine.size();
      for (size_t i = 0; ok && i < in.size(); ++i) ok = in[i]->bytes == mine[i]->bytes;
      if (!ok)
        fail(sim_op_name(p.op), "rank " + std::to_string(rank_) + " expects " + sizes_of(mine) +
                                    " from rank " + std::to_string(q) + " but rank " +
                                    std::to_string(q) + " sends " + sizes_of(in) + " to rank " +
                                    std::to_string(rank_));
      for (size_t i = 0; i < in.size(); ++i) {
        if (in[i]->bytes == 0) continue;
        if (w_->space == MemorySpace::kHost) {
          std::memcpy(mine[i]->data, in[i]->data, in[i]->bytes);
        } else {
          try {
            w_->copier.copy(rank_, mine[i]->data, in[i]->data, in[i]->bytes);
          } catch (const std::exception& e) {
            fail(sim_op_name(p.op), "rank " + std::to_string(rank_) + ": device copy from rank " +
                                        std::to_string(q) + " failed: " + e.what());
          }
        }
      }
    }
    if (w_->space == MemorySpace::kDevice) {
      // the copies read the peers' buffers: complete before this rank departs
      try {
        w_->copier.wait(rank_);
      } catch (const std::exception& e) {
        fail(sim_op_name(p.op),
             "rank " + std::to_string(rank_) + ": waiting for the device copies failed: " + e.what());
      }
    }
    {
      std::lock_guard<std::mutex> lk(w_->m);
      w_->bytes_sent[rank_] += sent_elsewhere;
    }
    depart(p.op);
  }

  void copy_local(const std::vector<CopyPiece>& pieces) override {
    for (size_t i = 0; i < pieces.size(); ++i) {
      const CopyPiece& c = pieces[i];
      FLOWMOE_CHECK(c.bytes >= 0 && (c.bytes == 0 || (c.src && c.dst)),
                    "copy_local: piece " << i << " (" << c.bytes << " bytes) has "
                                         << (c.bytes < 0 ? "a negative size" : c.src ? "a null destination" : "a null source"));
    }
    if (w_->space == MemorySpace::kHost) {
      for (const CopyPiece& c : pieces)
        if (c.bytes > 0) std::memcpy(c.dst, c.src, static_cast<size_t>(c.bytes));
    } else {
      w_->copier.copy_local(rank_, pieces);
    }
  }

  void* scratch(int64_t bytes) override {
    FLOWMOE_CHECK(bytes >= 0, "scratch: " << bytes << " bytes");
    if (w_->space == MemorySpace::kDevice) return w_->copier.scratch(rank_, bytes);
    if (static_cast<int64_t>(scratch_.size()) < bytes) scratch_.resize(static_cast<size_t>(bytes));
    return scratch_.empty() ? nullptr : scratch_.data();
  }

  DevicePeers* device_peers() override {
    if (w_->space != MemorySpace::kDevice || !w_->copier.device_peers) return nullptr;
    return w_->copier.device_peers(*this);
  }

  void barrier() override {
    Post p;
    p.op = SimOp::kBarrier;
    arrive(p);
    depart(p.op);
  }

  void synchronize() override {
    std::lock_guard<std::mutex> lk(w_->m);
    if (!w_->error.empty()) throw CommError(__FILE__, __LINE__, w_->error);
  }

  std::string error() const override {
    std::lock_guard<std::mutex> lk(w_->m);
    return w_->error;
  }

  void abort(const std::string& reason) override {
    std::lock_guard<std::mutex> lk(w_->m);
    if (w_->error.empty())
      w_->error = "SimComm: rank " + std::to_string(rank_) + " aborted the world: " + reason;
    w_->cv.notify_all();
  }

 private:
  // Records the error on the world (first one wins), wakes everyone, throws it on this rank.
  // Called only between arrival and departure: before this rank's buffers go away (the throw
  // unwinds the caller), it waits until no peer is still reading them (bounded by the timeout).
  [[noreturn]] void fail(const char* op, const std::string& what) {
    // device mode: copies this rank already issued read the peers' buffers; let them finish before
    // the peers may unwind (errors of the wait itself are moot here)
    if (w_->space == MemorySpace::kDevice) {
      try {
        w_->copier.wait(rank_);
      } catch (...) {
      }
    }
    std::unique_lock<std::mutex> lk(w_->m);
    if (w_->error.empty())
      w_->error = "SimComm " + std::string(op) + " (collective #" + std::to_string(seq_) +
                  "): " + what;
    leave_readers();
    w_->cv.notify_all();
    w_->cv.wait_until(lk, deadline(), [&] { return w_->readers == 0; });
    throw CommError(__FILE__, __LINE__, w_->error);
  }
  void leave_readers() {  // with the lock held
    if (reading_) {
      reading_ = false;
      --w_->readers;
    }
  }
  std::chrono::steady_clock::time_point deadline() const {
    return std::chrono::steady_clock::now() +
           std::chrono::duration_cast<std::chrono::steady_clock::duration>(
               std::chrono::duration<double>(timeout_s_));
  }

  // Waits until every rank reached phase `target`, the world failed, or the timeout.
  void wait_phase(uint64_t target, const char* op, const char* step) {
    std::unique_lock<std::mutex> lk(w_->m);
    if (!w_->error.empty()) throw CommError(__FILE__, __LINE__, w_->error);
    w_->phase[rank_] = target;
    w_->cv.notify_all();
    auto all_there = [&] {
      for (int q = 0; q < w_->n; ++q)
        if (w_->phase[q] < target) return false;
      return true;
    };
    const auto until = deadline();
    while (!all_there()) {
      if (!w_->error.empty()) throw CommError(__FILE__, __LINE__, w_->error);
      if (w_->cv.wait_until(lk, until) == std::cv_status::timeout && !all_there()) {
        if (w_->error.empty()) {
          std::ostringstream os;
          os << "SimComm " << op << " (collective #" << seq_ << "): rank " << rank_
             << " timed out after " << timeout_s_ << " s at " << step << " waiting for rank(s)";
          for (int q = 0; q < w_->n; ++q)
            if (w_->phase[q] < target) os << " " << q;
          os << " (a rank that failed, exited or runs a different sequence of collectives)";
          w_->error = os.str();
          w_->cv.notify_all();
        }
        throw CommError(__FILE__, __LINE__, w_->error);
      }
    }
  }

  void arrive(Post p) {
    ++seq_;
    p.seq = seq_;
    {
      std::lock_guard<std::mutex> lk(w_->m);
      w_->posts[rank_] = p;
    }
    wait_phase(2 * seq_ - 1, sim_op_name(p.op), "arrival");
    {
      std::lock_guard<std::mutex> lk(w_->m);
      if (!w_->error.empty()) throw CommError(__FILE__, __LINE__, w_->error);  // read nothing
      reading_ = true;
      ++w_->readers;
    }
    // Every rank posted collective #seq_ before reaching this phase and nobody can post the next
    // one before the departure phase: the board is stable until depart().
    const Post& p0 = w_->posts[0];
    for (int q = 1; q < w_->n; ++q) {  // against rank 0: the same message on every rank
      const Post& o = w_->posts[q];
      if (o.op != p0.op || o.seq != p0.seq)
        fail(sim_op_name(p.op), "rank 0 called " + std::string(sim_op_name(p0.op)) + " #" +
                                    std::to_string(p0.seq) + " but rank " + std::to_string(q) +
                                    " called " + sim_op_name(o.op) + " #" +
                                    std::to_string(o.seq));
    }
  }
  void depart(SimOp op) {
    {
      std::lock_guard<std::mutex> lk(w_->m);
      leave_readers();
      w_->cv.notify_all();
    }
    wait_phase(2 * seq_, sim_op_name(op), "departure");
  }

  SimWorld::Impl* w_;
  int rank_;
  std::vector<uint8_t> scratch_;  // host world's scratch()
  uint64_t seq_ = 0;
  bool reading_ = false;  // between arrival and departure (guarded by the world's mutex)
};

SimWorld::SimWorld(int world_size, double timeout_s) : impl_(new Impl) {
  FLOWMOE_CHECK(world_size >= 1 && world_size <= 4096,
                "SimWorld: world size " << world_size << "; expected 1..4096");
  FLOWMOE_CHECK(timeout_s > 0, "SimWorld: timeout " << timeout_s << " s; expected > 0");
  impl_->n = world_size;
  impl_->timeout_s = timeout_s;
  impl_->phase.assign(world_size, 0);
  impl_->posts.resize(world_size);
  impl_->bytes_sent.assign(world_size, 0);
  for (int r = 0; r < world_size; ++r) impl_->comms.emplace_back(new SimComm(impl_.get(), r));
}

SimWorld::SimWorld(int world_size, double timeout_s, MemorySpace space, Copier copier)
    : SimWorld(world_size, timeout_s) {
  if (space == MemorySpace::kDevice) {
    FLOWMOE_CHECK(copier.copy && copier.wait && copier.copy_local && copier.scratch,
                  "SimWorld: a device-memory world needs every Copier function (use "
                  "make_device_sim_world of the CUDA backend)");
    impl_->space = space;
    impl_->copier = std::move(copier);
  }
}

SimWorld::~SimWorld() = default;

int SimWorld::world_size() const { return impl_->n; }
MemorySpace SimWorld::memory_space() const { return impl_->space; }

Communicator& SimWorld::comm(int rank) {
  FLOWMOE_CHECK(rank >= 0 && rank < impl_->n,
                "SimWorld::comm: rank " << rank << "; expected 0.." << impl_->n - 1);
  return *impl_->comms[rank];
}

int64_t SimWorld::bytes_sent(int rank) const {
  FLOWMOE_CHECK(rank >= 0 && rank < impl_->n,
                "SimWorld::bytes_sent: rank " << rank << "; expected 0.." << impl_->n - 1);
  std::lock_guard<std::mutex> lk(impl_->m);
  return impl_->bytes_sent[rank];
}

void SimWorld::reset_bytes() {
  std::lock_guard<std::mutex> lk(impl_->m);
  impl_->bytes_sent.assign(impl_->n, 0);
}

std::vector<std::string> SimWorld::run(const std::function<void(Communicator&)>& fn) {
  std::vector<std::string> result(impl_->n);
  std::vector<std::thread> threads;
  threads.reserve(impl_->n);
  for (int r = 0; r < impl_->n; ++r) {
    threads.emplace_back([this, r, &fn, &result] {
      Communicator& c = *impl_->comms[r];
      try {
        fn(c);
      } catch (const std::exception& e) {
        result[r] = e.what();
        c.abort(std::string("rank ") + std::to_string(r) + " threw: " + e.what());
      } catch (...) {
        result[r] = "unknown exception";
        c.abort("rank " + std::to_string(r) + " threw an unknown exception");
      }
    });
  }
  for (auto& t : threads) t.join();
  return result;
}

}  // namespace flowmoe
