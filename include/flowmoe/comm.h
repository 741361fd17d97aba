// Expert parallelism (issue 7; docs/EP.md is the long form): the communicator, the dispatch /
// combine plan and its CPU reference.
//
//   Communicator   rank, world size, count all-to-all, grouped point-to-point exchange (all-to-all-v
//                  of byte payloads), barrier, error query and abort, all bounded by a timeout: a
//                  mismatched or dead rank gives a CommError on the others, never a hang.
//   SimWorld       N simulated ranks in one process (one thread each, host memory): the CPU tests;
//                  make_device_sim_world: the same over device memory on one GPU (CUDA tests).
//   NCCL           make_nccl_comm*: one process per GPU, device memory, ordered on a CUDA stream
//                  (declared when the library is built with NCCL: FLOWMOE_HAVE_NCCL).
//   DispatchPlan   who sends which routed rows where, and where they land: grouped by local expert,
//                  inside each expert by source rank (0, 1, ...), inside each source rank in that
//                  rank's (token, slot) order, each expert's segment padded to the alignment A: the
//                  padded layout the expert GEMMs consume (what permute+pad produces on one rank).
//   ep_dispatch_* / ep_combine   CPU reference of the payload movement for BF16, FP8 (+ 1x128
//                  scales) and MXFP4 (+ 1x32 scales) rows, and of the fixed-order combine.
//
// Experts are split evenly: E_total = world * El, global expert g lives on rank g / El as local
// expert g % El. `MoeConfig::comm` (moe.h) is meant to point at a Communicator.
#pragma once

#include <cstdint>
#include <exception>
#include <functional>
#include <memory>
#include <string>
#include <vector>

#include "flowmoe/error.h"
#include "flowmoe/settings.h"
#include "flowmoe/tensor.h"
#include "flowmoe/token.h"

namespace flowmoe {

// A communication failure: timeout, a peer that aborted or died, a collective called with
// different arguments on different ranks, an NCCL error. Derived from Error (one catch suffices).
// After a CommError from a timeout, an abort, a mismatched collective or an NCCL error the
// communicator is failed: every later call throws again. (check_uniform's mismatch is reported
// identically on every rank and leaves the communicator usable.)
class CommError : public Error {
 public:
  using Error::Error;
};

enum class MemorySpace : uint8_t { kHost, kDevice };

// One point-to-point transfer of an exchange: `bytes` bytes to or from `peer`.
struct P2pOp {
  int peer = 0;
  void* data = nullptr;  // send: read from (treated as const); recv: written to
  int64_t bytes = 0;
};

// One local copy (both pointers in the communicator's memory space), see Communicator::copy_local.
struct CopyPiece {
  const void* src = nullptr;
  void* dst = nullptr;
  int64_t bytes = 0;
};

// Device-side access to the peers' memory (expert parallelism without host synchronisation,
// CudaLayerOptions::sync_free; docs/EP.md §8). A communicator whose kernels can read the other
// ranks' device buffers offers one (Communicator::device_peers): the device SimWorld, every rank
// on one GPU. (NVLink peers under NCCL 2.28's device API would be the multi-GPU one; not yet.)
class DevicePeers {
 public:
  virtual ~DevicePeers() = default;
  // Collective, host, blocking: at set-up only, never inside a captured step. Every rank passes
  // one device buffer of its own; returns a device array [world] of every rank's pointer in rank
  // order, owned by this object (valid, and allocated, as long as the communicator).
  virtual void* const* share(void* mine) = 0;
  // Enqueues on `stream` (a cudaStream_t) a barrier of every rank, run on the device: what this
  // rank enqueues on `stream` after it starts only when every rank has completed what it enqueued
  // before its matching barrier. Every rank calls barrier the same number of times, and a rank's
  // barriers are ordered (one stream, or streams ordered by events). The host never waits for the
  // GPU here (the device SimWorld's threads do meet on the host first), so a CUDA graph can
  // capture it. Bounded by the communicator's timeout: a rank that does not arrive makes the
  // waiting ranks give up, and the communicator is failed for good (every later barrier returns
  // at once; what runs after reads incomplete data; failed() says so).
  virtual void barrier(void* stream) = 0;
  // Host: "" or what went wrong on the device (which rank's barrier timed out). Reads the device
  // flag after its own copy: call it after synchronising the stream the barriers ran on.
  virtual std::string failed() = 0;
};

class Communicator {
 public:
  virtual ~Communicator() = default;
  Communicator(const Communicator&) = delete;
  Communicator& operator=(const Communicator&) = delete;

  virtual int rank() const = 0;
  virtual int world_size() const = 0;
  virtual const char* backend() const = 0;       // "sim" or "nccl"
  // Where payload buffers of exchange()/alltoallv() live: host (sim) or device (nccl).
  virtual MemorySpace memory_space() const = 0;

  // ---- collectives: every rank calls the same sequence with matching arguments -----------------
  // Count all-to-all, host memory, blocking: send[p*n + i] goes to rank p, recv[p*n + i] comes
  // from rank p (i < n). n must be the same on every rank.
  virtual void alltoall_i32(const int32_t* send, int32_t* recv, int n) = 0;

  // Grouped point-to-point exchange (NCCL's grouped ncclSend/ncclRecv): every op of this rank is
  // issued at once. The k-th send from rank p to rank q matches the k-th recv of q from p, and
  // their sizes must be equal. Sends and recvs to this rank itself are allowed (a local copy).
  // Payload pointers are in memory_space(). Sim: blocking. NCCL: ordered on the communicator's
  // stream; the buffers must stay valid until synchronize().
  virtual void exchange(const std::vector<P2pOp>& sends, const std::vector<P2pOp>& recvs) = 0;

  // ---- local helpers of a staged exchange (not collective) ---------------------------------------
  // Copies every piece (buffers in memory_space(), both non-null; pieces must not overlap; the
  // CUDA backend's internal copy_pieces also zero-fills pieces without a source), ordered with
  // exchange(): after everything issued before, before everything issued after. NCCL: one batched
  // copy kernel on the communicator's stream; sim: memcpy (host) or the rank's copy stream
  // (device), complete on return.
  virtual void copy_local(const std::vector<CopyPiece>& pieces) = 0;
  // A buffer of at least `bytes` bytes in memory_space(), owned by the communicator, valid until
  // the next scratch() call (which may grow it: NCCL waits for its stream, bounded by the
  // timeout, before freeing, and grows by at least a quarter). Not counted by the layer's
  // allocated_bytes(); the CUDA layer grows it after each forward's plan to what its combines
  // stage (up to the padded rows x (2H + 4) bytes). bytes 0: may return null.
  virtual void* scratch(int64_t bytes) = 0;

  // Device-side peer access (DevicePeers above), or null when the backend has none (host
  // SimWorld; NCCL).
  virtual DevicePeers* device_peers() { return nullptr; }
  virtual void barrier() = 0;
  // Waits for everything issued so far (NCCL: the stream), at most timeout_s(); throws CommError
  // on an asynchronous error or a timeout (and aborts the communicator). Sim: checks the error.
  virtual void synchronize() = 0;

  // ---- errors ---------------------------------------------------------------------------------
  // "" while healthy; otherwise the first error this rank saw (its own or an abort of a peer).
  virtual std::string error() const = 0;
  // Marks the communicator failed (NCCL: ncclCommAbort) so that pending and later calls on every
  // rank return a CommError naming `reason` instead of waiting. Idempotent.
  virtual void abort(const std::string& reason) = 0;
  double timeout_s() const { return timeout_s_; }
  void set_timeout_s(double s);  // > 0: bound of every wait of a collective

  // ---- helpers built on the primitives ---------------------------------------------------------
  // All-to-all-v of bytes: send_counts[p] bytes from send + send_offsets[p] to rank p, recv_counts[p]
  // bytes from rank p to recv + recv_offsets[p]. Arrays of world_size() entries, host memory.
  void alltoallv(const void* send, const int64_t* send_counts, const int64_t* send_offsets,
                 void* recv, const int64_t* recv_counts, const int64_t* recv_offsets);
  // Checks that every rank passed the same values (the configuration a collective protocol relies
  // on). Throws CommError on every rank otherwise, e.g. "dispatch: mismatched configuration across
  // ranks: num_experts = 8 on rank 0 but 6 on rank 1".
  void check_uniform(const char* what, const std::vector<std::string>& names,
                     const std::vector<int64_t>& values);
  // Collective: each rank passes "" or the message of the error its local checks raised (a bad
  // argument, a failed precondition). Returns when every rank passed ""; otherwise a rank with an
  // error throws Error(its message) and every other rank a CommError "<what>: rank p rejected its
  // input ...": a local error fails every rank at once instead of leaving the others waiting in
  // the next collective until the timeout. One alltoall_i32 of one int per peer.
  void agree_on_local_errors(const char* what, const std::string& local_error);

 protected:
  Communicator() = default;
  double timeout_s_ = 60.0;
};

// Runs a pass's local precondition checks (a callable that throws flowmoe::Error). Without a
// communicator it just runs them; with one the pass is collective, so every rank learns whether
// every rank passed (agree_on_local_errors): this rank rethrows its own error, the others get a
// CommError naming it, instead of waiting in the next exchange until the timeout.
template <typename Checks>
void collective_checks(Communicator* comm, const char* what, Checks&& checks) {
  if (comm == nullptr) {
    checks();
    return;
  }
  std::exception_ptr mine;
  std::string msg;
  try {
    checks();
  } catch (const Error& e) {
    mine = std::current_exception();
    msg = e.what();
  }
  if (mine) {
    try {
      comm->agree_on_local_errors(what, msg);
    } catch (const Error&) {
    }
    std::rethrow_exception(mine);
  }
  comm->agree_on_local_errors(what, msg);
}

// ---- simulated world: N ranks in one process --------------------------------------------------
// Step-synchronous: each collective is a rendezvous of all ranks (arrive, check the arguments
// agree, copy, depart). A rank that does not arrive within the timeout, or arguments that do not
// match, give a CommError on every rank that is waiting. Counts the bytes each rank sends to other
// ranks (its own copies excluded).
//
// Memory space. The default world moves host memory (memcpy). A device-memory world (kDevice; made
// by make_device_sim_world of the CUDA backend, which supplies the Copier) runs every rank on the
// same GPU: exchange() payload pointers are device pointers and each chunk is copied by the
// receiving rank on a private stream. Its exchange() is blocking at both ends: the send buffers
// must hold their data when it is called (the caller synchronises the stream that wrote them) and
// the received bytes are in place, on the device, when it returns. synchronize() only checks the
// error, as for host memory.
class SimWorld {
 public:
  // How a device-memory world copies: copy(rank, dst, src, bytes) runs on the receiving rank's
  // thread for each chunk addressed to it (the peers' send buffers stay valid until that rank's
  // wait(rank) returned), then wait(rank) once per exchange; it returns when those copies are
  // complete. Either may throw (the exchange then fails on every rank with a CommError).
  struct Copier {
    std::function<void(int rank, void* dst, const void* src, int64_t bytes)> copy;
    std::function<void(int rank)> wait;
    // Communicator::copy_local of a device world: the pieces copied, complete on return.
    std::function<void(int rank, const std::vector<CopyPiece>& pieces)> copy_local;
    // Communicator::scratch of a device world: device memory of the rank, grown as asked.
    std::function<void*(int rank, int64_t bytes)> scratch;
    // Communicator::device_peers of a device world (optional): the rank's DevicePeers, made on
    // its first call with that rank's communicator and owned by the copier.
    std::function<DevicePeers*(Communicator& comm)> device_peers;
  };
  explicit SimWorld(int world_size, double timeout_s = 30.0);
  // space kHost: the constructor above (copier unused). kDevice: copier.copy and copier.wait must
  // be set.
  SimWorld(int world_size, double timeout_s, MemorySpace space, Copier copier);
  ~SimWorld();
  SimWorld(const SimWorld&) = delete;
  SimWorld& operator=(const SimWorld&) = delete;

  int world_size() const;
  MemorySpace memory_space() const;
  Communicator& comm(int rank);
  int64_t bytes_sent(int rank) const;  // payload bytes of exchange() to other ranks
  void reset_bytes();

  // Runs fn(comm(r)) on one thread per rank and joins them. Returns one message per rank ("" when
  // fn returned normally). A rank whose fn throws aborts the world, so the others fail fast.
  std::vector<std::string> run(const std::function<void(Communicator&)>& fn);

 private:
  friend class SimComm;  // the rank objects (src/comm/sim_comm.cpp)
  struct Impl;
  std::unique_ptr<Impl> impl_;
};

// ---- bootstrap (backend independent) ------------------------------------------------------------
// torchrun's environment: RANK, WORLD_SIZE, LOCAL_RANK (default RANK), LOCAL_WORLD_SIZE (default
// WORLD_SIZE), MASTER_ADDR (default 127.0.0.1), MASTER_PORT (default 29500).
struct BootstrapEnv {
  int rank = 0;
  int world_size = 1;
  int local_rank = 0;
  int local_world_size = 1;
  std::string master_addr = "127.0.0.1";
  int master_port = 29500;
  std::string launcher = "torchrun";  // whose variables gave rank and size (see below)
};
// Reads the variables above; throws Error naming a missing or malformed one. Without torchrun's
// RANK / WORLD_SIZE, an MPI or Slurm launcher's own variables give rank, size and local rank:
// Open MPI (OMPI_COMM_WORLD_RANK, _SIZE, _LOCAL_RANK, _LOCAL_SIZE), MPICH / Intel MPI (PMI_RANK,
// PMI_SIZE, MPI_LOCALRANKID, MPI_LOCALNRANKS), Slurm srun (SLURM_PROCID, SLURM_NTASKS,
// SLURM_LOCALID). No MPI library is linked: the unique id still goes over TCP to MASTER_ADDR
// (default 127.0.0.1, i.e. single node; pass MASTER_ADDR=<rank 0's host> across nodes).
BootstrapEnv bootstrap_env_from_environment();

// Rank 0 listens on MASTER_PORT, the others connect to MASTER_ADDR:MASTER_PORT (retrying until
// the deadline). Every rank sends (rank, world size, fingerprint); rank 0 checks that the world
// sizes and fingerprints agree and that every rank appears once, then sends `payload` (its own
// argument; e.g. the 128-byte ncclUniqueId) to all, or the error to all. Returns the payload on
// every rank; throws CommError (with the reason) on every rank after at most timeout_s.
std::vector<uint8_t> tcp_broadcast_from_root(const BootstrapEnv& env,
                                             const std::vector<uint8_t>& payload,
                                             const std::string& fingerprint, double timeout_s);

// NVLink multicast (NVLS) must stay off on our machines: sets NCCL_NVLS_ENABLE=0 unless it is
// already "0" (a different value is overridden, with a warning on stderr). Called by the NCCL
// factories and by launch_local_ranks.
void ensure_nvls_disabled();

// Single-node launcher: starts `nprocs` copies of argv (argv[0] looked up in PATH) with RANK =
// LOCAL_RANK = i, WORLD_SIZE = LOCAL_WORLD_SIZE = nprocs, MASTER_ADDR = 127.0.0.1, MASTER_PORT =
// master_port, NCCL_NVLS_ENABLE=0, and waits for them. When one exits non-zero (or is killed),
// the others get SIGTERM after `grace_s` seconds (SIGKILL 5 s later). Returns 0 if all exited 0,
// otherwise the first failure's exit code (128 + signal when killed).
int launch_local_ranks(const std::vector<std::string>& argv, int nprocs, int master_port,
                       double grace_s = 10.0);

// The launcher with a watchdog and per-rank results (launch_local_ranks is this with the default
// options, returning first_failure, or 124 when only the timeout stopped it).
struct LaunchOptions {
  double grace_s = 10.0;        // after the first failure: SIGTERM to the others after grace_s
                                // (SIGKILL 5 s later), when stop_on_failure
  double timeout_s = 0.0;       // > 0: bound of the whole launch; ranks still running then get
                                // SIGTERM, SIGKILL 5 s later (so it returns by timeout_s + 5 s)
  bool stop_on_failure = true;  // false: a failing rank does not stop the others (a test of a
                                // rank that dies needs its peer to run on and report)
  std::vector<std::string> env; // extra "NAME=VALUE" for every rank (NCCL_NVLS_ENABLE stays 0)
};
struct LaunchResult {
  std::vector<int> exit_codes;  // per rank: exit status, 128 + signal when killed
  std::vector<double> seconds;  // per rank: seconds from the start until it exited
  bool timed_out = false;       // the watchdog stopped at least one rank
  int first_failure = 0;        // exit code of the first rank that failed before any timeout
                                // (0: none; ranks the watchdog stopped are not counted)
  int first_failed_rank = -1;
};
LaunchResult launch_local_ranks_ex(const std::vector<std::string>& argv, int nprocs,
                                   int master_port, const LaunchOptions& opt);

// ---- wire formats of the dispatched rows ---------------------------------------------------------
enum class WireFormat : uint8_t {
  kBf16,         // codes [rows, H] bf16                                  2 B/element
  kFp8,          // codes [rows, H] e4m3 + UE8M0 1x128 scales [rows][H/128] 1 + 1/128 = 1.0078
  kFp8Fp32Scale, // codes [rows, H] e4m3 + FP32 1x128 scales (fp8-naive)  1 + 4/128 = 1.03125
  kMxfp4,        // packed e2m1 [rows, H/2] + UE8M0 1x32 scales [rows][H/32] 0.5 + 1/32 = 0.53125
};
const char* wire_format_name(WireFormat f);  // "bf16", "fp8", "fp8-fp32scale", "mxfp4"
int64_t wire_code_bytes(WireFormat f, int64_t h);   // per row
int64_t wire_scale_bytes(WireFormat f, int64_t h);  // per row (0 for bf16)
inline int64_t wire_row_bytes(WireFormat f, int64_t h) {
  return wire_code_bytes(f, h) + wire_scale_bytes(f, h);
}
inline double wire_bytes_per_element(WireFormat f, int64_t h) {
  return static_cast<double>(wire_row_bytes(f, h)) / static_cast<double>(h);
}
// Each dispatched row also carries its routing probability (FP32, 4 B) unless the caller moves
// probs otherwise: see DispatchPlan::wire_bytes.
constexpr int64_t kWireProbBytes = 4;

// ---- dispatch plan --------------------------------------------------------------------------------
struct EpConfig {
  int num_experts = 0;  // E_total, a multiple of the world size, 1..kRouterMaxExperts
  int topk = 0;         // k
  int64_t hidden = 0;   // H (multiple of 128 for fp8, of 32 for mxfp4, of 8 for bf16)
  int align = 1;        // A: padding of each local expert's received segment, 1..kMaxAlign
  WireFormat format = WireFormat::kBf16;
  // The routing probability of each row travels with it (FP32, kWireProbBytes per row, same
  // exchange): the expert side applies it (in the SwiGLU, moe.h). Same on every rank.
  bool with_probs = false;
  void validate(int world_size) const;  // throws Error naming the field
};

struct DispatchPlan {
  int rank = 0, world = 1;
  int num_experts = 0;    // E_total
  int local_experts = 0;  // El = E_total / world
  int topk = 0;
  int align = 1;
  int64_t hidden = 0;
  int64_t tokens = 0;     // T of this rank
  WireFormat format = WireFormat::kBf16;
  bool with_probs = false;

  // Send side. Routed rows of this rank in send order: sorted by global expert (so by destination
  // rank, then its local expert), inside one expert by (token, slot). send_routing is
  // cpu::build_routing(ids, T, k, E_total, align 1): its row_map[t, s] is the send row of (t, s)
  // (-1 for a dropped slot) and counts[g] the rows for global expert g. Filled by plan_dispatch
  // (ids given); plan_dispatch_counts leaves it empty.
  cpu::Routing send_routing;
  std::vector<int32_t> send_counts;   // [world * El]: rows for global expert g = p*El + l
  std::vector<int64_t> send_offsets;  // [world * El + 1]: first send row of global expert g

  // Receive side (this rank's El local experts).
  std::vector<int32_t> recv_counts;      // [world * El]: rows rank p sends to local expert l, [p*El + l]
  std::vector<int32_t> expert_counts;    // [El]: sum over p
  std::vector<int32_t> padded_offsets;   // [El + 1]: Σ round_up(expert_counts, A)
  std::vector<int32_t> recv_offsets;     // [world * El]: first padded row of chunk (p, l)

  // Deduplicated dispatch (the CUDA layer's, CudaLayerOptions::ep_dedup): tokens this rank sends to each
  // rank (a token once per rank however many of its experts live there) and receives from each;
  // [world], all zero when the caller passed no token counts.
  std::vector<int32_t> send_tokens, recv_tokens;

  int64_t send_rows() const { return send_offsets.empty() ? 0 : send_offsets.back(); }
  int64_t recv_rows() const;     // routed rows received (Σ expert_counts)
  int64_t padded_rows() const { return padded_offsets.empty() ? 0 : padded_offsets.back(); }
  int64_t rows_to(int peer) const;    // rows this rank sends to `peer`
  int64_t rows_from(int peer) const;  // rows this rank receives from `peer`
  // Local expert segments of the padded buffer (Segments::from_counts of the padded counts).
  Segments padded_segments() const;
  // Bytes this rank puts on the wire to other ranks (own rows excluded) for the dispatch of its
  // rows in `format` (+ kWireProbBytes per row when with_probs). Combine (BF16) sends back
  // rows_from(p) rows of 2H bytes to each peer.
  int64_t wire_bytes(WireFormat format, bool with_probs) const;
  std::string describe() const;
};

// Collective: every rank calls it with the same cfg. Checks cfg agrees across ranks (CommError
// naming the field otherwise), exchanges the per-expert counts (alltoall_i32, El per peer) and
// computes both layouts. ids [T, k] int32 global expert ids (-1 = dropped), T may be 0.
DispatchPlan plan_dispatch(Communicator& comm, const EpConfig& cfg, const int32_t* ids,
                           int64_t tokens);
// The same from the send counts alone ([E_total] rows per global expert), e.g. fetched from the
// device routing tables. config_agreed: the caller has already checked that cfg agrees across
// ranks (the layer does at construction), so the check_uniform round trip is skipped and the plan
// costs one collective (the counts and the ranks' local errors travel together).
DispatchPlan plan_dispatch_counts(Communicator& comm, const EpConfig& cfg,
                                  const int32_t* send_counts, int64_t tokens,
                                  bool config_agreed = false,
                                  const int32_t* send_tokens = nullptr);  // [world] or null

// The same plan made locally from every rank's counts at once, no collective (the sync-free CUDA
// layer gathers them on the device): counts_all [world * E_total] (row q: the rows rank q routes
// to each global expert), tokens_all [world * world] (row q: the tokens rank q sends to each rank
// in a deduplicated dispatch) or null; `tokens`: this rank's T.
DispatchPlan plan_from_all_counts(const EpConfig& cfg, int rank, int world, const int32_t* counts_all,
                                  int64_t tokens, const int32_t* tokens_all = nullptr);

// One row stream moved by the plan: row i of the send order (row_bytes each, send rows) to its
// padded row on the receiving rank. Forward direction (dispatch) or reverse (combine: padded rows
// back to the send-order rows of their source rank).
struct RowStream {
  const void* send = nullptr;
  void* recv = nullptr;
  int64_t row_bytes = 0;
};
// One grouped exchange moving every stream (so NCCL moves them in one group). The data of a peer
// and stream is a sequence of (peer, local expert) chunks, contiguous on the send-order side and
// scattered over the expert segments on the padded side. Messages, the same on both sides: a
// chunk of at least `direct_bytes` bytes travels alone, straight between the two buffers;
// consecutive smaller chunks travel as one message, staged on the padded side through
// Communicator::scratch (gathered there before the exchange in combine, scattered from it after
// the exchange in dispatch, by copy_local). So many small experts cost one message per peer and
// stream instead of one per expert (NCCL's cost per message is a few microseconds). This rank's
// own chunks never touch the communicator's transport: copy_local moves them. direct_bytes < 0:
// kEpDirectBytes. Padding rows of the receive buffers are not written (see zero_padding_rows).
void dispatch_rows(Communicator& comm, const DispatchPlan& plan,
                   const std::vector<RowStream>& streams, int64_t direct_bytes = -1);
// Reverse: stream.send is the padded buffer [Mp, row_bytes] of this rank's local experts,
// stream.recv the send-order buffer [send_rows, row_bytes]. Padding rows are not sent.
void combine_rows(Communicator& comm, const DispatchPlan& plan,
                  const std::vector<RowStream>& streams, int64_t direct_bytes = -1);
// combine_rows for the rows of local experts [expert_begin, expert_end) only (collective: every
// rank passes the same range; other experts' rows are neither sent nor received). Lets a caller
// send the first experts' rows back while the later experts still compute; a sequence of calls
// covering every expert moves exactly what one combine_rows moves.
void combine_rows_experts(Communicator& comm, const DispatchPlan& plan,
                          const std::vector<RowStream>& streams, int expert_begin, int expert_end,
                          int64_t direct_bytes = -1);
// The default of direct_bytes: every group staged, one message per peer and stream (against one
// message per chunk, fewer and larger messages on NVLink; docs/EP.md "Message grouping").
constexpr int64_t kEpDirectBytes = int64_t(1) << 62;
// direct_bytes from the named setting FLOWMOE_EP_DIRECT_BYTES (flowmoe/settings.h; programs pass
// env_lookup()): a byte count >= 0 (0 = every chunk its own message, nothing staged), or
// kEpDirectBytes when unset or empty. Anything else throws. The library reads no environment.
int64_t ep_direct_bytes_from_settings(const SettingLookup& lookup);
// Host memory: zeroes the padding rows [padded_offsets[l] + expert_counts[l], padded_offsets[l+1]).
void zero_padding_rows(const DispatchPlan& plan, void* rows, int64_t row_bytes);

// ---- CPU reference of the payload movement (host memory, e.g. over SimWorld) -----------------------
// Every ep_dispatch_* is collective, needs a plan made by plan_dispatch (send_routing filled), and
// writes exactly what the single-rank permute+pad of the same payload writes for the rank's local
// experts over the concatenation of all ranks' tokens (rank 0's tokens first): padded segments,
// zero padding rows, zero scale codes. With plan.with_probs the routing probability of each row
// travels in the same exchange: probs [T, k] fp32 -> recv_probs [Mp] fp32 (0 on padding rows);
// otherwise both are ignored (may be null).
// x [T, H] bf16 -> out [Mp, H] bf16.
void ep_dispatch_bf16(Communicator& comm, const DispatchPlan& plan, const bf16_t* x,
                      const float* probs, bf16_t* out, float* recv_probs);
// FP8 row-wise: codes [T, H], scales [H/128][T] (tensor.h kRow1x128) -> out_codes [Mp, H],
// out_scales [H/128][scale_ld] (scale_ld >= Mp), as cpu::permute_pad_fp8. On the wire the scales
// travel row-major ([rows][H/128], next to their codes); the receiver transposes them (1/128 of the
// payload). plan.format must be kFp8.
void ep_dispatch_fp8(Communicator& comm, const DispatchPlan& plan, const uint8_t* codes,
                     const uint8_t* scales, const float* probs, uint8_t* out_codes,
                     uint8_t* out_scales, int64_t scale_ld, float* recv_probs);
// MXFP4: codes [T, H/2], scales [T][H/32] -> out_codes [Mp, H/2], out_scales [Mp][H/32] (the wire
// layout is the final layout). plan.format must be kMxfp4.
void ep_dispatch_mxfp4(Communicator& comm, const DispatchPlan& plan, const uint8_t* codes,
                       const uint8_t* scales, const float* probs, uint8_t* out_codes,
                       uint8_t* out_scales, float* recv_probs);
// Combine (collective): y_rows [Mp, H] bf16 of this rank's local experts go back to their source
// ranks; then y[t] = bf16(Σ_{s=0..k-1} probs[t,s] · row(t,s)) in FP32, acc = fma(p, v, acc) from 0
// in slot order (cpu::unpermute_unpad; probs null = weight 1). The sum runs on the token's own
// rank in slot order whatever the world size, so EP = N gives the bits of EP = 1.
// Also the backward of dispatch (dX rows -> dx, probs null).
void ep_combine_bf16(Communicator& comm, const DispatchPlan& plan, const bf16_t* y_rows,
                     const float* probs, bf16_t* y);

// The whole expert-parallel path on the CPU: plan, BF16 dispatch (with probs), `expert` applied to
// each local expert's padded segment, combine with probs. expert(global_expert, rows [n, H] bf16,
// n, out [n, H] bf16) sees exactly the rows of that expert in the layout above (n = padded count,
// padding rows included: their output must be ignored or zero). The CPU reference the GPU version
// is compared with; with world 1 it is the single-rank layer's token movement.
using ExpertFn = std::function<void(int global_expert, const bf16_t* rows, int64_t n, bf16_t* out)>;
void ep_reference_forward(Communicator& comm, const EpConfig& cfg, const bf16_t* x,
                          const int32_t* ids, const float* probs, int64_t tokens,
                          const ExpertFn& expert, bf16_t* y);

}  // namespace flowmoe

// ---- device-memory simulated world (declared when the CUDA backend is built: FLOWMOE_HAVE_CUDA) --
#if defined(FLOWMOE_HAVE_CUDA)
namespace flowmoe {
// N simulated ranks (threads) sharing the current CUDA device, exchanging device memory: the
// world of the expert-parallel CUDA layer's tests on one GPU (NCCL cannot put two ranks on one
// GPU). Each rank's chunks are copied with cudaMemcpyAsync (device to device) on a stream of its
// own, created here on the current device, and waited for before the rank leaves the exchange
// (see SimWorld: blocking at both ends). Same rendezvous, checks, timeouts and byte counts as the
// host-memory world.
std::unique_ptr<SimWorld> make_device_sim_world(int world_size, double timeout_s = 30.0);
}  // namespace flowmoe
#endif

// ---- NCCL (declared when flowmoe_cuda is built with NCCL: FLOWMOE_HAVE_NCCL) --------------------
#if defined(FLOWMOE_HAVE_NCCL)
typedef struct CUstream_st* cudaStream_t;  // the CUDA runtime's typedef, as in gemm.h
namespace flowmoe {
struct NcclCommOptions {
  double timeout_s = 120.0;        // bound of initialisation and of every synchronize()
  int device = -1;                 // CUDA device; -1: LOCAL_RANK (env) or rank % visible devices
  // stream of exchange(); null: the communicator's own, created at the device's highest priority
  // (the MoE layer overlaps the backward's combine with GEMM1 wgrad: leave this null for it; the
  // layer's stream here would serialise the two)
  cudaStream_t stream = nullptr;
};
// Orders the NCCL communicator's exchanges on `stream` from now on (null: its own stream), after
// waiting for the current one. E.g. a benchmark timing exchanges with events on its stream. Throws
// Error when comm is not an NCCL communicator.
void set_nccl_stream(Communicator& comm, cudaStream_t stream);
// One process per GPU. Sets NCCL_NVLS_ENABLE=0, selects the device, creates the communicator with
// a non-blocking config and polls its state (ncclCommGetAsyncError) against the timeout, so a rank
// that never joins gives a CommError, not a hang. unique_id: the 128 bytes of an ncclUniqueId made
// by rank 0 (nccl_unique_id()).
std::vector<uint8_t> nccl_unique_id();
std::unique_ptr<Communicator> make_nccl_comm(int rank, int world_size,
                                             const std::vector<uint8_t>& unique_id,
                                             const NcclCommOptions& opt = NcclCommOptions());
// torchrun-style bootstrap: bootstrap_env_from_environment(), the unique id from rank 0 over TCP
// (tcp_broadcast_from_root, fingerprint = world size + NCCL version), device = LOCAL_RANK.
std::unique_ptr<Communicator> make_nccl_comm_from_env(const NcclCommOptions& opt = NcclCommOptions());
}  // namespace flowmoe
#endif
