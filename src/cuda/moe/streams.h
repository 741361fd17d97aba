// The CUDA layer's streams and events (CudaLayerOptions::side_stream, tail_stream):
// - the layer's stream `main` (the caller's), which orders every pass;
// - the side stream (flow, flow-fp4): the wgrad column copies next to the GEMMs that do not read
//   them. fork() makes it wait for everything issued on `main` so far, mark(i) records side event
//   i on it, join(i) makes `main` wait for that event. Without it the three are no-ops and fork()
//   returns `main`: the copies run inline, in the same order;
// - the tail stream (one GPU): the backward's tail next to GEMM1 wgrad, at the highest priority;
// - the stage clock: CUDA events around each stage when profiling (moe_debug.h).
#pragma once

#include <cuda_runtime.h>

#include <string>
#include <vector>

#include "flowmoe/moe.h"

namespace flowmoe {
namespace cuda {
namespace moe {

class LayerStreams {
 public:
  enum SideEvent { kSideFork, kSideA, kSideB, kSideEvents };

  // side: create the side stream; tail: the tail stream; dx_event: the "dX rows ready" event
  // (EP or tail stream). Call once; destroy() (or the destructor) releases.
  void create(cudaStream_t main, bool side, bool tail, bool dx_event);
  void destroy();
  ~LayerStreams() { destroy(); }

  cudaStream_t main() const { return main_; }
  bool side_on() const { return side_ != nullptr; }
  cudaStream_t fork();
  void mark(int i);
  void join(int i);
  // Runs a pass; if it throws between fork() and its joins, waits for the side stream before
  // rethrowing, so that no column copy is still reading or writing when the next call reuses the
  // buffers.
  template <typename Pass>
  void with_side_drained(Pass&& pass) {
    try {
      pass();
    } catch (...) {
      if (side_) cudaStreamSynchronize(side_);
      throw;
    }
  }

  cudaStream_t tail() const { return tail_; }
  // `main` waits for the tail stream's work so far (the end of the tail, also when it threw).
  void join_tail();
  cudaEvent_t dx_ready() const { return ev_dx_; }

 private:
  cudaStream_t main_ = nullptr;
  cudaStream_t side_ = nullptr;
  cudaEvent_t side_events_[kSideEvents] = {};
  cudaStream_t tail_ = nullptr;
  cudaEvent_t ev_tail_ = nullptr;
  cudaEvent_t ev_dx_ = nullptr;  // the dX rows (EP: and their dprobs) are ready
};

// One timed stage (moe_debug.h StageTime before the event times are read).
struct StageEvents {
  MoePass pass;
  std::string name;
  int ev0, ev1;
};

// Per-stage timing: a pool of events; Scope brackets a stage with two of them when profiling
// (pool exhausted: the stage goes untimed).
class StageClock {
 public:
  static constexpr int kEventPool = 256;
  void create();
  void destroy();
  ~StageClock() { destroy(); }

  bool profiling = false;
  void start_forward() { used_ = 0; forward_.clear(); backward_.clear(); }
  void start_backward() { backward_.clear(); }
  bool empty() const { return forward_.empty() && backward_.empty(); }
  // Elapsed times of the recorded stages, forward then backward (the events must have completed).
  template <typename Out>
  void read(Out&& out) const {
    for (const auto* list : {&forward_, &backward_})
      for (const StageEvents& s : *list) out(s, events_[s.ev0], events_[s.ev1]);
  }

  class Scope {
   public:
    Scope(StageClock* c, MoePass pass, const char* name, cudaStream_t stream);
    ~Scope();
    Scope(Scope&& o) noexcept;
    Scope(const Scope&) = delete;
    Scope& operator=(const Scope&) = delete;

   private:
    StageClock* c_;
    cudaStream_t stream_;
    int ev0_ = -1, ev1_ = -1;
    MoePass pass_ = MoePass::kForward;
    std::string name_;
  };

 private:
  std::vector<cudaEvent_t> events_;
  int used_ = 0;
  std::vector<StageEvents> forward_, backward_;
};

}  // namespace moe
}  // namespace cuda
}  // namespace flowmoe
