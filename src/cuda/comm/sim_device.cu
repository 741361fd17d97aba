// make_device_sim_world (flowmoe/comm.h): SimWorld over device memory on one GPU, for the
// expert-parallel CUDA layer's tests. The rendezvous, checks and timeouts are SimWorld's
// (src/comm/sim_comm.cpp); this file supplies the copies: cudaMemcpyAsync device to device on a
// non-blocking stream per rank, waited for (cudaStreamSynchronize) before the rank leaves the
// exchange, so the peers' send buffers are never released while being read and the received
// bytes are complete when exchange() returns; copy_local runs the NCCL communicator's batched
// copy kernel (flowmoe/cuda/copy_pieces.h) on the rank's stream and waits for it.
#include <cuda_runtime.h>

#include <memory>
#include <string>
#include <vector>

#include "cuda/common.cuh"
#include "flowmoe/comm.h"
#include "flowmoe/cuda/copy_pieces.h"

namespace flowmoe {
namespace {

struct DeviceCopyState {
  int device = 0;
  std::vector<cudaStream_t> streams;  // one per rank
  std::vector<void*> scratch;         // Communicator::scratch of each rank
  std::vector<int64_t> scratch_bytes;
  ~DeviceCopyState() {
    if (streams.empty()) return;
    int cur = 0;
    const bool have = cudaGetDevice(&cur) == cudaSuccess;
    cudaSetDevice(device);
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
  return std::unique_ptr<SimWorld>(new SimWorld(world_size, timeout_s, MemorySpace::kDevice, c));
}

}  // namespace flowmoe
