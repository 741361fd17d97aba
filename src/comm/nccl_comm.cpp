// NCCL communicator (flowmoe/comm.h), compiled into flowmoe_cuda only where NCCL is found
// (CMakeLists.txt defines FLOWMOE_HAVE_NCCL). One process per GPU, device memory, every transfer
// ordered on the communicator's stream.
//
// Never a hang: the communicator is created non-blocking (ncclConfig_t::blocking = 0) and every
// wait (initialisation, group launch, stream completion) is a polling loop over
// ncclCommGetAsyncError / cudaStreamQuery bounded by timeout_s; on an error or a timeout the
// communicator is aborted (ncclCommAbort), which also releases NCCL kernels waiting for a dead peer,
// and a CommError is thrown. Host staging buffers are pinned so that no copy can block the host.
// Tested on two GPUs by tests/nccl/flowmoe_nccl_tests.cu.
#include <cuda_runtime.h>
#include <nccl.h>

#include <algorithm>
#include <chrono>
#include <cstdlib>
#include <cstring>
#include <thread>

#include "flowmoe/comm.h"
#include "flowmoe/cuda/copy_pieces.h"

namespace flowmoe {

namespace {

using Clock = std::chrono::steady_clock;

[[noreturn]] void fail(const std::string& msg) { throw CommError(__FILE__, __LINE__, msg); }

void cuda_check(cudaError_t e, const char* what) {
  if (e != cudaSuccess) fail(std::string("NcclComm: ") + what + ": " + cudaGetErrorString(e));
}

class NcclComm final : public Communicator {
 public:
  NcclComm(int rank, int world, const ncclUniqueId& id, const NcclCommOptions& opt)
      : rank_(rank), world_(world) {
    FLOWMOE_CHECK(world >= 1 && rank >= 0 && rank < world,
                  "make_nccl_comm: rank " << rank << " of " << world);
    set_timeout_s(opt.timeout_s);
    ensure_nvls_disabled();
    int ndev = 0;
    cuda_check(cudaGetDeviceCount(&ndev), "cudaGetDeviceCount");
    FLOWMOE_CHECK(ndev >= 1, "make_nccl_comm: no CUDA device is visible");
    device_ = opt.device;
    if (device_ < 0) {
      const char* lr = std::getenv("LOCAL_RANK");
      device_ = lr ? std::atoi(lr) : rank % ndev;
    }
    FLOWMOE_CHECK(device_ >= 0 && device_ < ndev,
                  "make_nccl_comm: device " << device_ << " but " << ndev
                                            << " visible; expected one process per GPU "
                                               "(LOCAL_RANK < number of GPUs)");
    cuda_check(cudaSetDevice(device_), "cudaSetDevice");
    // Its own stream, at the device's highest priority: while the MoE layer overlaps an exchange
    // with a GEMM, the block scheduler then gives NCCL's and copy_local's CTAs SMs ahead of the
    // GEMM's queued ones instead of after its last wave.
    int lo = 0, hi = 0;
    cuda_check(cudaDeviceGetStreamPriorityRange(&lo, &hi), "cudaDeviceGetStreamPriorityRange");
    cuda_check(cudaStreamCreateWithPriority(&own_, cudaStreamNonBlocking, hi), "cudaStreamCreateWithPriority");
    own_stream_ = true;
    stream_ = opt.stream ? opt.stream : own_;
    ncclConfig_t config = NCCL_CONFIG_INITIALIZER;
    config.blocking = 0;  // every call returns at once; we poll with a deadline
    const ncclResult_t r = ncclCommInitRankConfig(&comm_, world, id, rank, &config);
    if (r != ncclSuccess && r != ncclInProgress) {
      const std::string msg = std::string("ncclCommInitRankConfig: ") + ncclGetErrorString(r);
      if (comm_) ncclCommAbort(comm_);
      comm_ = nullptr;
      fail("NcclComm rank " + std::to_string(rank) + ": " + msg);
    }
    wait_ready("initialisation (every rank must join with the same unique id)");
  }

  ~NcclComm() override {
    if (comm_) {
      if (error_.empty()) {
        // Orderly shutdown: finalize (flushes), bounded by the timeout, then destroy; abort
        // instead when a peer does not follow.
        const ncclResult_t fr = ncclCommFinalize(comm_);
        const auto deadline = deadline_now();
        ncclResult_t st = fr == ncclSuccess || fr == ncclInProgress ? ncclInProgress : fr;
        while (st == ncclInProgress) {
          if (ncclCommGetAsyncError(comm_, &st) != ncclSuccess) break;
          if (st != ncclInProgress || Clock::now() > deadline) break;
          std::this_thread::sleep_for(std::chrono::microseconds(200));
        }
        if (st == ncclSuccess)
          ncclCommDestroy(comm_);
        else
          ncclCommAbort(comm_);
      } else {
        ncclCommAbort(comm_);
      }
      comm_ = nullptr;
    }
    if (h_stage_) cudaFreeHost(h_stage_);
    if (d_stage_) cudaFree(d_stage_);
    if (scratch_) cudaFree(scratch_);
    if (own_stream_) cudaStreamDestroy(own_);
  }

  int rank() const override { return rank_; }
  int world_size() const override { return world_; }
  const char* backend() const override { return "nccl"; }
  MemorySpace memory_space() const override { return MemorySpace::kDevice; }

  void exchange(const std::vector<P2pOp>& sends, const std::vector<P2pOp>& recvs) override {
    check_healthy();
    for (const P2pOp& o : sends)
      FLOWMOE_CHECK(o.peer >= 0 && o.peer < world_ && o.bytes >= 0 && (o.bytes == 0 || o.data),
                    "NcclComm::exchange: bad send op (peer " << o.peer << ", " << o.bytes << " B)");
    for (const P2pOp& o : recvs)
      FLOWMOE_CHECK(o.peer >= 0 && o.peer < world_ && o.bytes >= 0 && (o.bytes == 0 || o.data),
                    "NcclComm::exchange: bad recv op (peer " << o.peer << ", " << o.bytes << " B)");
    cuda_check(cudaSetDevice(device_), "cudaSetDevice");
    nccl_call(ncclGroupStart(), "ncclGroupStart");
    // Within one group NCCL matches the k-th send of p to q with the k-th recv of q from p.
    for (const P2pOp& o : sends)
      if (o.bytes > 0)
        nccl_call(ncclSend(o.data, static_cast<size_t>(o.bytes), ncclUint8, o.peer, comm_, stream_),
                  "ncclSend");
    for (const P2pOp& o : recvs)
      if (o.bytes > 0)
        nccl_call(ncclRecv(o.data, static_cast<size_t>(o.bytes), ncclUint8, o.peer, comm_, stream_),
                  "ncclRecv");
    const ncclResult_t r = ncclGroupEnd();
    if (r == ncclInProgress) {
      wait_ready("exchange launch");
    } else if (r != ncclSuccess) {
      die(std::string("ncclGroupEnd: ") + ncclGetErrorString(r) + detail());
    }
  }

  void copy_local(const std::vector<CopyPiece>& pieces) override {
    check_healthy();
    for (size_t i = 0; i < pieces.size(); ++i)
      FLOWMOE_CHECK(pieces[i].bytes == 0 || (pieces[i].src && pieces[i].dst),
                    "NcclComm::copy_local: piece " << i << " (" << pieces[i].bytes << " bytes) has a null "
                                                   << (pieces[i].src ? "destination" : "source"));
    cuda_check(cudaSetDevice(device_), "cudaSetDevice");
    cuda::comm::copy_pieces(pieces, stream_);
  }

  void* scratch(int64_t bytes) override {
    FLOWMOE_CHECK(bytes >= 0, "NcclComm::scratch: " << bytes << " bytes");
    if (bytes > scratch_bytes_) {
      // the previous buffer may still be read or written by work on the stream (bounded wait);
      // grows by at least 1/4 so that routing drifting upwards does not reallocate every step
      cuda_check(cudaSetDevice(device_), "cudaSetDevice");
      synchronize();
      if (scratch_) cuda_check(cudaFree(scratch_), "cudaFree (exchange staging)");
      scratch_ = nullptr;
      const int64_t want = std::max<int64_t>(bytes, scratch_bytes_ + scratch_bytes_ / 4);
      scratch_bytes_ = 0;
      cuda_check(cudaMalloc(&scratch_, static_cast<size_t>(want)), "cudaMalloc (exchange staging)");
      scratch_bytes_ = want;
    }
    return scratch_;
  }

  void alltoall_i32(const int32_t* send, int32_t* recv, int n) override {
    check_healthy();
    FLOWMOE_CHECK(n >= 0, "NcclComm::alltoall_i32: n = " << n);
    if (n == 0) return;
    const size_t per = static_cast<size_t>(n) * sizeof(int32_t);
    const size_t total = per * world_;
    ensure_stage(2 * total);
    std::memcpy(h_stage_, send, total);
    uint8_t* d_send = static_cast<uint8_t*>(d_stage_);
    uint8_t* d_recv = d_send + total;
    cuda_check(cudaMemcpyAsync(d_send, h_stage_, total, cudaMemcpyHostToDevice, stream_),
               "cudaMemcpyAsync H2D");
    std::vector<P2pOp> sends, recvs;
    for (int p = 0; p < world_; ++p) {
      sends.push_back({p, d_send + p * per, static_cast<int64_t>(per)});
      recvs.push_back({p, d_recv + p * per, static_cast<int64_t>(per)});
    }
    exchange(sends, recvs);
    cuda_check(cudaMemcpyAsync(static_cast<uint8_t*>(h_stage_) + total, d_recv, total,
                               cudaMemcpyDeviceToHost, stream_),
               "cudaMemcpyAsync D2H");
    synchronize();
    std::memcpy(recv, static_cast<uint8_t*>(h_stage_) + total, total);
  }

  void barrier() override {
    std::vector<int32_t> s(world_, rank_), r(world_, 0);
    alltoall_i32(s.data(), r.data(), 1);
  }

  void synchronize() override {
    check_healthy();
    const auto start = Clock::now();
    const auto deadline = deadline_now();
    while (true) {
      const cudaError_t q = cudaStreamQuery(stream_);
      ncclResult_t st = ncclSuccess;
      const ncclResult_t r = ncclCommGetAsyncError(comm_, &st);
      if (r != ncclSuccess) die(std::string("ncclCommGetAsyncError: ") + ncclGetErrorString(r));
      if (st != ncclSuccess && st != ncclInProgress)
        die(std::string("asynchronous NCCL error: ") + ncclGetErrorString(st) + detail());
      if (q == cudaSuccess) return;
      if (q != cudaErrorNotReady) die(std::string("CUDA error on the stream: ") + cudaGetErrorString(q));
      if (Clock::now() > deadline)
        die("timed out after " + std::to_string(timeout_s()) +
            " s waiting for the communication to finish (a peer that died, skipped the collective "
            "or passed different sizes)");
      // spin (yielding) through the first milliseconds: an exchange of a layer step is short and
      // every wait is on its critical path; then poll every 50 us
      if (Clock::now() - start < std::chrono::milliseconds(5))
        std::this_thread::yield();
      else
        std::this_thread::sleep_for(std::chrono::microseconds(50));
    }
  }

  std::string error() const override { return error_; }

  void abort(const std::string& reason) override {
    if (error_.empty()) error_ = "NcclComm rank " + std::to_string(rank_) + " aborted: " + reason;
    if (comm_) {
      ncclCommAbort(comm_);
      comm_ = nullptr;
    }
  }

 private:
  Clock::time_point deadline_now() const {
    return Clock::now() + std::chrono::duration_cast<Clock::duration>(
                              std::chrono::duration<double>(timeout_s()));
  }
  std::string detail() const {
    const char* s = comm_ ? ncclGetLastError(comm_) : nullptr;
    return s && *s ? std::string(" (") + s + ")" : std::string();
  }
  void check_healthy() const {
    if (!error_.empty()) fail(error_);
    if (!comm_) fail("NcclComm rank " + std::to_string(rank_) + ": the communicator was aborted");
  }
  // Aborts, records and throws.
  [[noreturn]] void die(const std::string& what) {
    const std::string msg = "NcclComm rank " + std::to_string(rank_) + " of " +
                            std::to_string(world_) + ": " + what;
    if (error_.empty()) error_ = msg;
    if (comm_) {
      ncclCommAbort(comm_);
      comm_ = nullptr;
    }
    fail(msg);
  }
  void nccl_call(ncclResult_t r, const char* what) {
    if (r != ncclSuccess && r != ncclInProgress)
      die(std::string(what) + ": " + ncclGetErrorString(r) + detail());
  }
  // Polls the communicator state until it leaves ncclInProgress, bounded by the timeout.
  void wait_ready(const char* what) {
    const auto start = Clock::now();
    const auto deadline = deadline_now();
    while (true) {
      ncclResult_t st = ncclInProgress;
      const ncclResult_t r = ncclCommGetAsyncError(comm_, &st);
      if (r != ncclSuccess) die(std::string(what) + ": ncclCommGetAsyncError: " + ncclGetErrorString(r));
      if (st == ncclSuccess) return;
      if (st != ncclInProgress) die(std::string(what) + ": " + ncclGetErrorString(st) + detail());
      if (Clock::now() > deadline)
        die(std::string(what) + ": timed out after " + std::to_string(timeout_s()) + " s");
      if (Clock::now() - start < std::chrono::milliseconds(5))  // launches finish in microseconds
        std::this_thread::yield();
      else
        std::this_thread::sleep_for(std::chrono::microseconds(100));
    }
  }
  void ensure_stage(size_t bytes) {
    if (bytes <= stage_bytes_) return;
    if (h_stage_) cudaFreeHost(h_stage_);
    if (d_stage_) cudaFree(d_stage_);
    h_stage_ = nullptr;
    d_stage_ = nullptr;
    stage_bytes_ = 0;
    cuda_check(cudaMallocHost(&h_stage_, bytes), "cudaMallocHost (count staging)");
    cuda_check(cudaMalloc(&d_stage_, bytes), "cudaMalloc (count staging)");
    stage_bytes_ = bytes;
  }

  int rank_, world_;
  int device_ = 0;
  cudaStream_t stream_ = nullptr;  // where exchanges are ordered: own_ or the caller's
  cudaStream_t own_ = nullptr;
  bool own_stream_ = false;

 public:
  void set_stream(cudaStream_t s) {
    check_healthy();
    cuda_check(cudaSetDevice(device_), "cudaSetDevice");
    synchronize();  // bounded by the timeout, like every wait of the communicator
    stream_ = s ? s : own_;
  }

 private:
  ncclComm_t comm_ = nullptr;
  std::string error_;
  void* h_stage_ = nullptr;
  void* d_stage_ = nullptr;
  size_t stage_bytes_ = 0;
  void* scratch_ = nullptr;  // scratch(): staging of dispatch_rows / combine_rows
  int64_t scratch_bytes_ = 0;
};

}  // namespace

std::vector<uint8_t> nccl_unique_id() {
  ensure_nvls_disabled();
  ncclUniqueId id;
  const ncclResult_t r = ncclGetUniqueId(&id);
  if (r != ncclSuccess) fail(std::string("ncclGetUniqueId: ") + ncclGetErrorString(r));
  return std::vector<uint8_t>(reinterpret_cast<const uint8_t*>(&id),
                              reinterpret_cast<const uint8_t*>(&id) + sizeof(id));
}

std::unique_ptr<Communicator> make_nccl_comm(int rank, int world_size,
                                             const std::vector<uint8_t>& unique_id,
                                             const NcclCommOptions& opt) {
  FLOWMOE_CHECK(unique_id.size() == sizeof(ncclUniqueId),
                "make_nccl_comm: unique id of " << unique_id.size() << " bytes; expected "
                                                << sizeof(ncclUniqueId));
  ncclUniqueId id;
  std::memcpy(&id, unique_id.data(), sizeof(id));
  return std::unique_ptr<Communicator>(new NcclComm(rank, world_size, id, opt));
}

void set_nccl_stream(Communicator& comm, cudaStream_t stream) {
  NcclComm* n = dynamic_cast<NcclComm*>(&comm);
  FLOWMOE_CHECK(n != nullptr, "set_nccl_stream: the communicator is '" << comm.backend()
                                                                       << "', not an NCCL communicator");
  n->set_stream(stream);
}

std::unique_ptr<Communicator> make_nccl_comm_from_env(const NcclCommOptions& opt) {
  ensure_nvls_disabled();
  const BootstrapEnv env = bootstrap_env_from_environment();
  int version = 0;
  ncclGetVersion(&version);
  // Ranks must agree on the world size and the NCCL version before NCCL is initialised.
  const std::string fingerprint = "flowmoe-nccl world=" + std::to_string(env.world_size) +
                                  " nccl=" + std::to_string(version);
  std::vector<uint8_t> id;
  if (env.rank == 0) id = nccl_unique_id();
  id = tcp_broadcast_from_root(env, id, fingerprint, opt.timeout_s);
  NcclCommOptions o = opt;
  if (o.device < 0) o.device = env.local_rank;
  return make_nccl_comm(env.rank, env.world_size, id, o);
}

}  // namespace flowmoe
