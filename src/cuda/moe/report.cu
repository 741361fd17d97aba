// The CUDA layer's report (moe.h CastReport, MoeStatus): the operators a pass ran, the tensors the
// forward saved, the device status counters, and the stage times of moe_debug.h.
#include <cuda_runtime.h>

#include "cuda/common.cuh"
#include "cuda/moe/layer.h"

namespace flowmoe {
namespace cuda {
namespace moe {

void CudaMoeLayer::log(MoePass pass, CastKind kind, const std::string& name, int64_t calls, int64_t outputs,
                       int64_t elements) {
  rep_.add_op(pass, kind, name, calls, outputs, elements);
}

void CudaMoeLayer::save_rows(const std::string& name, const std::string& format, int64_t bytes, double per_row) {
  SavedTensor s;
  s.name = name;
  s.format = format;
  s.bytes = bytes;
  // the rows held here: this rank's routed rows (one GPU) or the rows its El experts received
  s.bytes_per_token_unpadded = per_row * double(held_) / double(T_);
  rep_.saved.push_back(s);
}

// Bytes of a saved [Mp, cols] tensor in format f (column-wise: the scales of the real 128-row blocks).
int64_t CudaMoeLayer::saved_bytes(TensorFormat f, int64_t cols) const {
  switch (f) {
    case TensorFormat::kBf16: return Mp_ * cols * 2;
    case TensorFormat::kFp8Row: return row_bytes(cols);
    case TensorFormat::kFp8Col: return col_bytes(cols);
    case TensorFormat::kFp8RowFp32Scale: return Mp_ * cols + 4 * (cols / 128) * Mp_;
    case TensorFormat::kMxfp4Row: return Mp_ * cols / 2 + Mp_ * cols / 32;
  }
  return 0;
}

void CudaMoeLayer::save_expert_activations() {
  const RecipeSpec& spec = recipe_spec(cfg_.recipe);
  for (const SavedSpec* s : {&spec.gemm1_input, &spec.gemm1_output, &spec.gemm2_input}) {
    const int64_t cols = s->width == LayerWidth::kH ? H_ : s->width == LayerWidth::k2F ? 2 * F_ : F_;
    save_rows(s->name, s->format_string(), saved_bytes(s->format, cols), s->row_bytes(H_, F_));
  }
}

void CudaMoeLayer::save_tokens(const std::string& name, const std::string& format, int64_t bytes) {
  SavedTensor s;
  s.name = name;
  s.format = format;
  s.bytes = bytes;
  s.bytes_per_token_unpadded = double(bytes) / double(T_);
  rep_.saved.push_back(s);
}

void CudaMoeLayer::read_status() const {
  if (stats_valid_ || !have_forward_) return;
  const RoutingBuffers& r = ws_.routing;
  FLOWMOE_CUDA_CHECK(cudaMemcpyAsync(r.host_status, r.pass_status, 4 * sizeof(DeviceStatus), cudaMemcpyDeviceToHost,
                                     stream_));
  FLOWMOE_CUDA_CHECK(cudaMemcpyAsync(r.host_aux_loss, r.aux_loss, sizeof(float), cudaMemcpyDeviceToHost, stream_));
  FLOWMOE_CUDA_CHECK(cudaStreamSynchronize(stream_));
  const DeviceStatus* s = r.host_status;
  rep_.forward_stats.nonfinite = int64_t(s[kStatusFwd].nonfinite);
  rep_.forward_stats.underflow = int64_t(s[kStatusFwd].underflow + s[kStatusFwdAux].underflow);
  rep_.backward_stats = QuantStats();
  if (backward_done_) {
    rep_.backward_stats.nonfinite = int64_t(s[kStatusBwd].nonfinite);
    rep_.backward_stats.underflow = int64_t(s[kStatusBwd].underflow + s[kStatusBwdAux].underflow);
  }
  mstatus_.nonfinite = rep_.forward_stats.nonfinite + rep_.backward_stats.nonfinite;
  mstatus_.underflow = rep_.forward_stats.underflow + rep_.backward_stats.underflow;
  mstatus_.aux_loss = cfg_.aux_loss_alpha > 0.0f ? *r.host_aux_loss : 0.0f;
  stats_valid_ = true;
}

const CastReport& CudaMoeLayer::cast_report() const {
  read_status();
  return rep_;
}

MoeStatus CudaMoeLayer::status() const {
  read_status();
  return mstatus_;
}

std::vector<StageTime> CudaMoeLayer::stage_times() const {
  std::vector<StageTime> out;
  if (clock_.empty()) return out;
  FLOWMOE_CUDA_CHECK(cudaStreamSynchronize(stream_));
  clock_.read([&](const StageEvents& s, cudaEvent_t ev0, cudaEvent_t ev1) {
    StageTime t;
    t.pass = s.pass;
    t.name = s.name;
    FLOWMOE_CUDA_CHECK(cudaEventElapsedTime(&t.ms, ev0, ev1));
    out.push_back(t);
  });
  return out;
}

}  // namespace moe
}  // namespace cuda
}  // namespace flowmoe
