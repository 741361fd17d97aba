// The CUDA layer's streams, events and stage clock (streams.h).
#include "cuda/common.cuh"
#include "cuda/moe/streams.h"

namespace flowmoe {
namespace cuda {
namespace moe {

void LayerStreams::create(cudaStream_t main, bool side, bool tail, bool dx_event) {
  main_ = main;
  if (tail) {
    int least = 0, greatest = 0;
    FLOWMOE_CUDA_CHECK(cudaDeviceGetStreamPriorityRange(&least, &greatest));
    FLOWMOE_CUDA_CHECK(cudaStreamCreateWithPriority(&tail_, cudaStreamNonBlocking, greatest));
    FLOWMOE_CUDA_CHECK(cudaEventCreateWithFlags(&ev_tail_, cudaEventDisableTiming));
  }
  if (dx_event) FLOWMOE_CUDA_CHECK(cudaEventCreateWithFlags(&ev_dx_, cudaEventDisableTiming));
  if (side) {
    FLOWMOE_CUDA_CHECK(cudaStreamCreateWithFlags(&side_, cudaStreamNonBlocking));
    for (cudaEvent_t& e : side_events_) FLOWMOE_CUDA_CHECK(cudaEventCreateWithFlags(&e, cudaEventDisableTiming));
  }
}

void LayerStreams::destroy() {
  if (side_) {
    cudaStreamSynchronize(side_);
    cudaStreamDestroy(side_);
    side_ = nullptr;
  }
  for (cudaEvent_t& e : side_events_) {
    if (e) cudaEventDestroy(e);
    e = nullptr;
  }
  if (ev_dx_) cudaEventDestroy(ev_dx_);
  ev_dx_ = nullptr;
  if (tail_) {
    cudaStreamSynchronize(tail_);
    cudaStreamDestroy(tail_);
    tail_ = nullptr;
  }
  if (ev_tail_) cudaEventDestroy(ev_tail_);
  ev_tail_ = nullptr;
}

cudaStream_t LayerStreams::fork() {
  if (!side_) return main_;
  FLOWMOE_CUDA_CHECK(cudaEventRecord(side_events_[kSideFork], main_));
  FLOWMOE_CUDA_CHECK(cudaStreamWaitEvent(side_, side_events_[kSideFork], 0));
  return side_;
}
void LayerStreams::mark(int i) {
  if (side_) FLOWMOE_CUDA_CHECK(cudaEventRecord(side_events_[i], side_));
}
void LayerStreams::join(int i) {
  if (side_) FLOWMOE_CUDA_CHECK(cudaStreamWaitEvent(main_, side_events_[i], 0));
}

void LayerStreams::join_tail() {
  FLOWMOE_CUDA_CHECK(cudaEventRecord(ev_tail_, tail_));
  FLOWMOE_CUDA_CHECK(cudaStreamWaitEvent(main_, ev_tail_, 0));
}

void StageClock::create() {
  events_.resize(kEventPool);
  for (int i = 0; i < kEventPool; ++i) FLOWMOE_CUDA_CHECK(cudaEventCreate(&events_[i]));
}
void StageClock::destroy() {
  for (cudaEvent_t e : events_)
    if (e) cudaEventDestroy(e);
  events_.clear();
}

StageClock::Scope::Scope(StageClock* c, MoePass pass, const char* name, cudaStream_t stream)
    : c_(c), stream_(stream) {
  if (!c_->profiling || c_->used_ + 2 > kEventPool) return;
  ev0_ = c_->used_++;
  ev1_ = c_->used_++;
  pass_ = pass;
  name_ = name;
  cudaEventRecord(c_->events_[ev0_], stream_);
}
StageClock::Scope::Scope(Scope&& o) noexcept
    : c_(o.c_), stream_(o.stream_), ev0_(o.ev0_), ev1_(o.ev1_), pass_(o.pass_), name_(std::move(o.name_)) {
  o.ev0_ = -1;
}
StageClock::Scope::~Scope() {
  if (ev0_ < 0) return;
  cudaEventRecord(c_->events_[ev1_], stream_);
  (pass_ == MoePass::kForward ? c_->forward_ : c_->backward_).push_back({pass_, name_, ev0_, ev1_});
}

}  // namespace moe
}  // namespace cuda
}  // namespace flowmoe
