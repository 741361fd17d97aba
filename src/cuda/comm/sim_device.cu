// make_device_sim_world (flowmoe/comm.h): SimWorld over device memory on one GPU, for the
// expert-parallel CUDA layer's tests. The rendezvous, checks and timeouts are SimWorld's
// (src/comm/sim_comm.cpp); this file supplies the copies: cudaMemcpyAsync device to device on a
// non-blocking stream per rank, waited for (cudaStreamSynchronize) before the rank leaves the
// exchange, so the peers' send buffers are never released while being read and the received
// bytes are complete when exchange() returns; copy_local runs the NCCL communicator's batched
// copy kernel (flowmoe/cuda/copy_pieces.h) on the rank's stream and waits for it.
// Its DevicePeers (Communicator::device_peers): every rank's buffers are addressable from every
// kernel (one GPU, one process), so share() is a host exchange of pointers, and the barrier is a
// host rendezvous of the ranks' threads (at enqueue time) plus a one-block kernel on the rank's
// stream that publishes the rank's barrier count and waits on the device until every rank's count
// has reached it (the sync-free expert-parallel layer's exchange).
#include <cuda.h>  // CUmoduleLoadingMode (the entry point is fetched through the runtime: no libcuda link)
#include <cuda_runtime.h>

#include <cstring>
#include <memory>
#include <string>
#include <vector>

#include "cuda/common.cuh"
#include "flowmoe/comm.h"
#include "flowmoe/cuda/copy_pieces.h"

namespace flowmoe {
namespace {

__device__ __forceinline__ unsigned load_acquire(const unsigned* p) {
  unsigned v;
  asm volatile("ld.acquire.gpu.global.u32 %0, [%1];" : "=r"(v) : "l"(p) : "memory");
  return v;
}
__device__ __forceinline__ void store_release(unsigned* p, unsigned v) {
  asm volatile("st.release.gpu.global.u32 [%0], %1;" ::"l"(p), "r"(v) : "memory");
}
__device__ __forceinline__ unsigned long long global_ns() {
  unsigned long long t;
  asm volatile("mov.u64 %0, %%globaltimer;" : "=l"(t));
  return t;
}

// arrived[q]: how many barriers rank q has reached (wraps; compared as a signed difference);
// count: this rank's own, kept on the device so that graph replays and eager calls count alike
// (a plain read-modify-write: a rank's barriers must be ordered, on one stream). failed[0]: the
// first rank that gave up, + 1 (0: none), failed[1]: its barrier number.
__global__ void sim_barrier_kernel(unsigned* arrived, unsigned* count, int rank, int world,
                                   unsigned long long timeout_ns, unsigned* failed) {
  __shared__ unsigned target;
  if (threadIdx.x == 0) {
    target = *count + 1u;
    *count = target;
    __threadfence();  // this rank's earlier writes (earlier kernels: already complete) before the count
    store_release(arrived + rank, target);
  }
  __syncthreads();
  const unsigned long long t0 = global_ns();
  for (int q = threadIdx.x; q < world; q += blockDim.x)
    while (int(load_acquire(arrived + q) - target) < 0) {
      if (load_acquire(failed) != 0u) break;
      if (global_ns() - t0 > timeout_ns) {  // the first to give up says who and where
        if (atomicCAS(failed, 0u, unsigned(rank + 1)) == 0u) atomicExch(failed + 1, target);
        break;
      }
      __nanosleep(200);
    }
  __syncthreads();
  __threadfence();
}

// World-wide barrier state: arrived [W], count [W], failed [2] (device, zeroed). A barrier that
// timed out fails the world for good, as any CommError does: every later barrier returns at once.
class SimDevicePeers final : public DevicePeers {
 public:
  SimDevicePeers(Communicator& comm, int device, unsigned* state, cudaStream_t copy_stream)
      : comm_(comm), device_(device), state_(state), stream_(copy_stream) {}
  ~SimDevicePeers() override {
    cudaSetDevice(device_);
    for (void* p : tables_) cudaFree(p);
  }
  void* const* share(void* mine) override {
    const int W = comm_.world_size();
    // allocate before the rendezvous: a peer that leaves it may start device barriers at once,
    // and cudaMalloc can wait for the device to idle
    FLOWMOE_CUDA_CHECK(cudaSetDevice(device_));
    void* table = nullptr;
    FLOWMOE_CUDA_CHECK(cudaMalloc(&table, sizeof(void*) * W));
    tables_.push_back(table);
    int32_t half[2];
    static_assert(sizeof(void*) == 8, "64-bit pointers");
    std::memcpy(half, &mine, sizeof(void*));
    std::vector<int32_t> send(size_t(W) * 2), recv(size_t(W) * 2);
    for (int p = 0; p < W; ++p) std::memcpy(&send[size_t(p) * 2], half, sizeof(half));
    comm_.alltoall_i32(send.data(), recv.data(), 2);
    std::vector<void*> ptrs(W);
    for (int p = 0; p < W; ++p) std::memcpy(&ptrs[p], &recv[size_t(p) * 2], sizeof(void*));
    FLOWMOE_CUDA_CHECK(cudaMemcpyAsync(table, ptrs.data(), sizeof(void*) * W, cudaMemcpyHostToDevice, stream_));
    FLOWMOE_CUDA_CHECK(cudaStreamSynchronize(stream_));
    return static_cast<void* const*>(table);
  }
  void barrier(void* stream) override {
    // First a host rendezvous of the ranks' threads, so that no rank's barrier kernel waits for a
    // peer that has not yet enqueued its own: a thread blocked in CUDA (a kernel's first launch
    // loads its module lazily, which can wait for the whole GPU to idle) would otherwise never
    // enqueue it while the GPU spins. The rendezvous waits on threads, never on the GPU, and a
    // captured step's replays make no host calls at all.
    comm_.barrier();
    const int W = comm_.world_size();
    const double t = comm_.timeout_s() * 1e9;
    sim_barrier_kernel<<<1, 32, 0, static_cast<cudaStream_t>(stream)>>>(
        state_, state_ + W + comm_.rank(), comm_.rank(), W, static_cast<unsigned long long>(t), state_ + 2 * W);
    FLOWMOE_CUDA_CHECK(cudaGetLastError());
  }
  std::string failed() override {
    unsigned f[2] = {0, 0};
    FLOWMOE_CUDA_CHECK(cudaSetDevice(device_));
    FLOWMOE_CUDA_CHECK(cudaMemcpyAsync(f, state_ + 2 * comm_.world_size(), sizeof(f), cudaMemcpyDeviceToHost, stream_));
    FLOWMOE_CUDA_CHECK(cudaStreamSynchronize(stream_));
    if (f[0] == 0) return "";
    return "device SimWorld: rank " + std::to_string(int(f[0]) - 1) + " waited at its device barrier #" +
           std::to_string(f[1]) + " longer than the timeout (" + std::to_string(comm_.timeout_s()) +
           " s) for a rank that did not arrive; the exchanges after it read incomplete data";
  }

 private:
  Communicator& comm_;
  int device_;
  unsigned* state_;
  cudaStream_t stream_;
  std::vector<void*> tables_;
};

// Whether the CUDA driver loads modules lazily (cuModuleGetLoadingMode; false when unknown).
bool lazy_module_loading() {
  void* fn = nullptr;
  cudaDriverEntryPointQueryResult q = cudaDriverEntryPointSymbolNotFound;
  if (cudaGetDriverEntryPointByVersion("cuModuleGetLoadingMode", &fn, 12000, cudaEnableDefault, &q) != cudaSuccess ||
      q != cudaDriverEntryPointSuccess || fn == nullptr)
    return false;
  CUmoduleLoadingMode mode = CU_MODULE_EAGER_LOADING;
  if (reinterpret_cast<CUresult (*)(CUmoduleLoadingMode*)>(fn)(&mode) != CUDA_SUCCESS) return false;
  return mode == CU_MODULE_LAZY_LOADING;
}

struct DeviceCopyState {
  int device = 0;
  std::vector<cudaStream_t> streams;  // one per rank
  std::vector<void*> scratch;         // Communicator::scratch of each rank
  std::vector<int64_t> scratch_bytes;
  unsigned* barrier_state = nullptr;                  // SimDevicePeers' arrived, count, failed
  std::vector<std::unique_ptr<SimDevicePeers>> peers;  // per rank, made on first use
  ~DeviceCopyState() {
    if (streams.empty()) return;
    int cur = 0;
    const bool have = cudaGetDevice(&cur) == cudaSuccess;
    cudaSetDevice(device);
    peers.clear();
    if (barrier_state) cudaFree(barrier_state);
    for (cudaStream_t s : streams)
      if (s) cudaStreamDestroy(s);
    for (void* p : scratch)
      if (p) cudaFree(p);
    if (have) cudaSetDevice(cur);
  }
};

}  // namespace

std::unique_ptr<SimWorld> make_device_sim_world(int world_size, double timeout_s) {
  FLOWMOE_CHECK(world_size >= 1 && world_size <= 4096,
                "make_device_sim_world: world size " << world_size << "; expected 1..4096");
  auto st = std::make_shared<DeviceCopyState>();
  int ndev = 0;
  const cudaError_t err = cudaGetDeviceCount(&ndev);
  FLOWMOE_CHECK(err == cudaSuccess && ndev > 0,
                "make_device_sim_world: no CUDA device is available ("
                    << (err == cudaSuccess ? "0 devices" : cudaGetErrorString(err)) << ")");
  FLOWMOE_CUDA_CHECK(cudaGetDevice(&st->device));
  st->streams.assign(world_size, nullptr);
  st->scratch.assign(world_size, nullptr);
  st->scratch_bytes.assign(world_size, 0);
  st->peers.resize(world_size);
  FLOWMOE_CUDA_CHECK(cudaMalloc(&st->barrier_state, sizeof(unsigned) * (2 * size_t(world_size) + 2)));
  FLOWMOE_CUDA_CHECK(cudaMemset(st->barrier_state, 0, sizeof(unsigned) * (2 * size_t(world_size) + 2)));
  for (int r = 0; r < world_size; ++r)
    FLOWMOE_CUDA_CHECK(cudaStreamCreateWithFlags(&st->streams[r], cudaStreamNonBlocking));
  SimWorld::Copier c;
  c.copy = [st](int rank, void* dst, const void* src, int64_t bytes) {
    FLOWMOE_CUDA_CHECK(cudaSetDevice(st->device));  // the rank's thread may not have it current
    FLOWMOE_CUDA_CHECK(cudaMemcpyAsync(dst, src, size_t(bytes), cudaMemcpyDeviceToDevice,
                                       st->streams[rank]));
  };
  c.wait = [st](int rank) { FLOWMOE_CUDA_CHECK(cudaStreamSynchronize(st->streams[rank])); };
  // the NCCL communicator's batched copy kernel, so the one-GPU tests exercise it
  c.copy_local = [st](int rank, const std::vector<CopyPiece>& pieces) {
    FLOWMOE_CUDA_CHECK(cudaSetDevice(st->device));
    cuda::comm::copy_pieces(pieces, st->streams[rank]);
    FLOWMOE_CUDA_CHECK(cudaStreamSynchronize(st->streams[rank]));
  };
  c.scratch = [st](int rank, int64_t bytes) -> void* {
    if (bytes > st->scratch_bytes[rank]) {
      FLOWMOE_CUDA_CHECK(cudaSetDevice(st->device));
      FLOWMOE_CUDA_CHECK(cudaStreamSynchronize(st->streams[rank]));
      if (st->scratch[rank]) FLOWMOE_CUDA_CHECK(cudaFree(st->scratch[rank]));
      st->scratch[rank] = nullptr;
      st->scratch_bytes[rank] = 0;
      FLOWMOE_CUDA_CHECK(cudaMalloc(&st->scratch[rank], size_t(bytes)));
      st->scratch_bytes[rank] = bytes;
    }
    return st->scratch[rank];
  };
  // each rank's thread makes (and then only uses) its own slot
  c.device_peers = [st](Communicator& comm) -> DevicePeers* {
    FLOWMOE_CHECK(!lazy_module_loading(),
                  "make_device_sim_world: device barriers between simulated ranks need eager module loading: set "
                  "CUDA_MODULE_LOADING=EAGER before the process's first CUDA call (lazily, a kernel's first launch "
                  "waits for the work in flight, which a peer's waiting barrier then is)");
    std::unique_ptr<SimDevicePeers>& p = st->peers[comm.rank()];
    if (!p) p.reset(new SimDevicePeers(comm, st->device, st->barrier_state, st->streams[comm.rank()]));
    return p.get();
  };
  return std::unique_ptr<SimWorld>(new SimWorld(world_size, timeout_s, MemorySpace::kDevice, c));
}

}  // namespace flowmoe
