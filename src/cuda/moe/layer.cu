// The CUDA MoE layer's API and lifecycle (layer.h): construction (workspace, GEMM object, streams,
// the dataflow's pipeline), set_weights, the forward / backward entry points (routing, the
// pipeline, the common tail), make_cuda_layer and the inspection functions of moe_debug.h.
#include <cuda_runtime.h>

#include <algorithm>
#include <cstdint>
#include <exception>
#include <memory>
#include <string>
#include <utility>
#include <vector>

#include "cuda/common.cuh"
#include "common/step_bytes.h"
#include "cuda/moe/layer.h"
#include "flowmoe/expert_layout.h"
#include "flowmoe/error.h"

namespace flowmoe {
namespace cuda {
namespace moe {
CudaMoeLayer::CudaMoeLayer(const MoeConfig& cfg, cudaStream_t stream, const CudaLayerOptions& options)
    : MoeLayer(cfg), stream_(stream), E_(cfg.num_experts), H_(cfg.hidden), F_(cfg.ffn), K_(cfg.topk),
      El_(cfg.num_local_experts()), comm_(cfg.comm), max_tokens_(cfg.max_tokens), max_rows_(workspace_rows(cfg)),
      path_(make_recipe_path(cfg, options)), arena_(cfg_),
      pipeline_(dataflow_row(path_.dataflow).make_pipeline()) {
  int ndev = 0;
  const cudaError_t err = cudaGetDeviceCount(&ndev);
  FLOWMOE_CHECK(err == cudaSuccess && ndev > 0,
                "make_cuda_layer: no CUDA device is available ("
                    << (err == cudaSuccess ? "0 devices" : cudaGetErrorString(err))
                    << "); expected a Hopper GPU (sm_90). Use make_cpu_layer without one");
  rep_.recipe = cfg.recipe;
  try {
    allocate(options);
  } catch (...) {
    release();
    throw;
  }
}

CudaMoeLayer::~CudaMoeLayer() { release(); }

void CudaMoeLayer::allocate(const CudaLayerOptions& options) {
  // (the recipe's choices, the grouped GEMMs and fused epilogues among them: path_, recipe_path.cu)
  if (comm_)  // agreed across ranks by make_cuda_layer
    direct_bytes_ = options.ep_direct_bytes < 0 ? kEpDirectBytes : options.ep_direct_bytes;
  caller_memory_ = options.caller_memory;
  arena_.set_caller_memory(caller_memory_);
  arena_.begin_pass(nullptr);
  layout_workspace();  // owned: allocates; caller memory: allocates the layer's own, measures the rest
  plan_bytes_ = arena_.plan();

  // the flow pipeline: the column copies for wgrad on the side stream
  const bool side = path_.side_stream;
  // The GEMM object: cuBLASLt handle, descriptors and its workspace (allocated once here). With
  // the side stream the matmuls run one priority step above it, so that the copies fill the
  // GEMMs' gaps instead of taking SMs from them.
  GroupedGemm::Options gopt = options.gemm;
  if (options.gemm_pool_priority >= 0)
    gopt.pool_priority = options.gemm_pool_priority;
  else if (side)
    gopt.pool_priority = 1;
  // sync_free: every GEMM is one launch of a grouped kernel, no per-expert pool to spread over
  // (fewer streams also keep the simulated ranks of one GPU on separate hardware queues)
  if (path_.sync_free) gopt.streams = 1;
  gemm_.reset(new GroupedGemm(gopt));
  gemm_workspace_ = gemm_->device_bytes();
  clock_.create();
  // One GPU: the backward's tail (router backward, dWr, dx) needs only the dX rows of GEMM1
  // dgrad, so it can run on its own stream, above the GEMMs' priority, while GEMM1 wgrad computes.
  // (EP: the combine of the dX rows overlaps the wgrad instead; sync-free EP keeps its device
  // barriers on the layer's stream: in a CUDA graph a parallel branch may run on a hardware queue
  // the simulated ranks of one GPU share, where one rank's waiting barrier would block another's.)
  const bool tail = !comm_ && options.tail_stream;
  streams_.create(stream_, side, tail, /*dx_event=*/comm_ || tail);
}

// Construction (make_cuda_layer, after every rank built its layer; collective): the peers'
// addresses of every buffer a peer reads from, in the same order on every rank.
void CudaMoeLayer::share_ep_buffers() {
  peers_ = comm_->device_peers();
  FLOWMOE_CHECK(peers_ != nullptr, "make_cuda_layer: internal error: no device peer access");
  EpBuffers& ep = ws_.ep;
  std::vector<void*> mine = {ws_.routing.tokens.counts, ep.send_rows, ep.send_scales, ep.send_probs,
                             ws_.expert.rows_bf16, ep.row_dprob};
  if (path_.ep_dedup) {
    mine.push_back(ep.tokens_to_ranks.counts);
    mine.push_back(ep.send_ids);
    mine.push_back(ep.send_token_probs);
  }
  for (void* p : mine) peer_tables_.push_back({p, peers_->share(p)});
}

void CudaMoeLayer::layout_workspace() {
  ws_ = Workspace();
  ws_.allocate(arena_, cfg_, path_, /*device_plan=*/path_.sync_free && comm_ != nullptr);
}

// ---- caller memory and steps in flight -----------------------------------------------------------
void CudaMoeLayer::bind_memory(const MoeMemory& m) {
  if (!caller_memory_) {
    MoeLayer::bind_memory(m);
    return;
  }
  const char* what = "MoeLayer::bind_memory";
  const std::pair<const char*, void*> regions[] = {{"weights", m.weights}, {"saved", m.saved}, {"transient", m.transient}};
  for (const auto& r : regions)
    FLOWMOE_CHECK(reinterpret_cast<uintptr_t>(r.second) % 256 == 0,
                  what << ": the " << r.first << " region at " << r.second << " is not 256-byte aligned; expected "
                       << "an allocation's start (cudaMalloc and PyTorch's allocator align to 512)");
  bound_ = m;
  arena_.begin_pass(&bound_);
  layout_workspace();
}

void CudaMoeLayer::check_bound(const char* what, bool saved, bool weights) const {
  if (!caller_memory_) return;
  FLOWMOE_CHECK((!weights || bound_.weights || plan_bytes_.weights == 0) &&
                    (bound_.transient || plan_bytes_.transient == 0) &&
                    (!saved || bound_.saved || plan_bytes_.saved == 0),
                what << ": the layer takes its memory from the caller (CudaLayerOptions::caller_memory) but the "
                     << (saved ? "weights, saved and transient regions are" : "weights and transient regions are")
                     << " not all bound; call bind_memory with regions of memory_plan()'s sizes ("
                     << plan_bytes_.weights << ", " << plan_bytes_.saved << ", " << plan_bytes_.transient
                     << " bytes) first");
}

// A forward's host state (MoeLayer::step_state): the rows and segments of the routing, the EP
// plan. Its device state is in the caller's saved region.
std::vector<uint8_t> CudaMoeLayer::step_state() const {
  const char* what = "MoeLayer::step_state";
  FLOWMOE_CHECK(caller_memory_, what << ": several forwards in flight need each forward's saved memory apart; "
                                        "build the layer with CudaLayerOptions::caller_memory");
  FLOWMOE_CHECK(have_forward_, what << ": no forward yet; call it after a forward");
  step_bytes::Writer w;
  step_bytes::put_header(w, step_bytes::step_header(cfg_, El_, true));
  const Step& s = step_;
  w.put(s.T), w.put(s.Mp), w.put(s.routed), w.put(s.held), w.put(s.blocks), w.put(s.dedup_recv_tokens);
  w.put(s.routing_tokens), w.put(s.tokens_to_ranks), w.put(s.received_tokens);
  step_bytes::put(w, s.seg);
  step_bytes::put(w, s.plan);
  return w.take();
}

void CudaMoeLayer::load_step(const uint8_t* bytes, size_t size) {
  const char* what = "MoeLayer::load_step";
  FLOWMOE_CHECK(caller_memory_, what << ": several forwards in flight need each forward's saved memory apart; "
                                        "build the layer with CudaLayerOptions::caller_memory");
  FLOWMOE_CHECK(bytes != nullptr || size == 0, what << ": null bytes; expected the bytes of step_state()");
  step_bytes::Reader r(bytes, size, what);
  step_bytes::check_header(r, step_bytes::step_header(cfg_, El_, true));
  // (read into a value first: refused bytes leave the layer as it was)
  Step s;
  r.get(&s.T), r.get(&s.Mp), r.get(&s.routed), r.get(&s.held), r.get(&s.blocks), r.get(&s.dedup_recv_tokens);
  r.get(&s.routing_tokens), r.get(&s.tokens_to_ranks), r.get(&s.received_tokens);
  step_bytes::get(r, &s.seg);
  step_bytes::get(r, &s.plan);
  r.finish();
  FLOWMOE_CHECK(s.T >= 1 && s.T <= max_tokens_ && s.Mp >= 0 && s.Mp <= max_rows_ && s.blocks >= 0,
                what << ": a step of " << s.T << " tokens and " << s.Mp << " rows; expected 1.." << max_tokens_
                     << " tokens and at most " << max_rows_ << " rows (the bytes of step_state() of this layer)");
  step_ = std::move(s);
  have_forward_ = true;
  backward_done_ = false;
}

void CudaMoeLayer::release() {
  gemm_.reset();
  streams_.destroy();
  clock_.destroy();
  arena_.release();
}

// ---- weights -------------------------------------------------------------------------------------
bool CudaMoeLayer::takes_backward_weights() const {
  return (path_.transposes_in_backward && path_.spec().weights == WeightCopy::kFp8Block) ||
         path_.bf16_params_in_place;
}

bool CudaMoeLayer::reads_stored_weights(bool bf16_params) const {
  // (a layer built for BF16 parameters in place takes one layout: stored exactly when relaying them)
  if (path_.bf16_params_in_place) return bf16_params && path_.bf16_relay_per_pass;
  return MoeLayer::reads_stored_weights(backend(), cfg_.recipe, bf16_params);
}

bool CudaMoeLayer::writes_stored_grads(const ExpertStorage& st, bool bf16_grads) const {
  if (st.is_layer_layout()) return true;
  const int64_t elem = bf16_grads ? 2 : 4;
  // (only flowmoe's wgrad kernels write them: RecipePath::fp8_wgrad_kernel, bf16_wgrad_kernel)
  return (path_.fp8_wgrad_kernel || path_.bf16_wgrad_kernel) && cfg_.comm == nullptr && st.hidden >= 1 && st.hidden <= H_ &&
         st.ffn >= 1 && st.ffn <= F_ && (st.interleaved || st.ffn == F_) && st.hidden * elem % 16 == 0 &&
         2 * st.ffn * elem % 16 == 0;
}

void CudaMoeLayer::set_backward_weights(const MoeWeights& w) {
  const char* what = "MoeLayer::set_backward_weights";
  FLOWMOE_CHECK(takes_backward_weights(),
                what << ": this layer reads its backward's weights from the weights region (it derives them from "
                        "the parameters only with caller memory and FP8 block weights: blockwise, flow, flow-fp4, "
                        "or reads them in place: bf16 with CudaLayerOptions::bf16_params_in_place); "
                        "expected the weights region bound for the backward instead");
  check_weights(w, "device");  // (Wr exactly when the layer has a router: its backward reads it there)
  if (path_.bf16_params_in_place) check_params_in_place(w, what);
  backward_weights_ = w;
}

void CudaMoeLayer::set_forward_weights(const MoeWeights& w) {
  const char* what = "MoeLayer::set_forward_weights";
  FLOWMOE_CHECK(path_.bf16_params_in_place,
                what << ": this layer reads its forward's weights from the weights region (only the bf16 recipe "
                        "with CudaLayerOptions::bf16_params_in_place and caller memory reads the parameters in "
                        "place); expected no parameters with the forward");
  MoeWeights experts = w;  // (the forward reads the router's weights where set_weights put them)
  experts.wr = nullptr;
  experts.router_bias = nullptr;
  check_weights(experts, "device", what, /*experts_only=*/true);  // (the stored sizes too)
  check_params_in_place(experts, what);
  forward_weights_ = experts;
}

void CudaMoeLayer::check_params_in_place(const MoeWeights& w, const char* what) const {
  if (path_.bf16_relay_per_pass) {
    FLOWMOE_CHECK(w.bf16_params() && !w.storage.is_layer_layout(),
                  what << ": " << (w.bf16_params() ? "W1, W2 in the layer's layout" : "FP32 W1, W2")
                       << "; this layer relays stored BF16 parameters in each pass "
                          "(CudaLayerOptions::bf16_params_stored): expected BF16 W1, W2 with their storage "
                          "(or a layer built without the option)");
    if (!path_.bf16_relay_planned) {
      // (built for a storage its kernels read in place: no room to relay any other)
      const ExpertStorage& st = w.storage;
      FLOWMOE_CHECK(bf16_kernels_read_stored(st, F_) && detail::aligned16(w.w1_bf16) && detail::aligned16(w.w2_bf16),
                    what << ": BF16 W1, W2 stored as [" << st.hidden << ", 2 x " << st.ffn << "] ("
                         << (st.interleaved ? "gate / up interleaved" : "gate then up") << ") at "
                         << w.w1_bf16 << ", " << w.w2_bf16
                         << "; this layer reads them in place and keeps no room to relay them "
                            "(CudaLayerOptions::bf16_storage): expected H % 8 == 0, F % 4 == 0, gate / up "
                            "interleaved or F = " << F_ << ", and 16-byte-aligned bases (or a layer built "
                            "without bf16_storage, which relays what its kernels cannot read)");
    }
    return;
  }
  FLOWMOE_CHECK(w.bf16_params() && w.storage.is_layer_layout(),
                what << ": " << (w.bf16_params() ? "W1, W2 stored transposed" : "FP32 W1, W2")
                     << "; this layer reads BF16 parameters in place (CudaLayerOptions::bf16_params_in_place): "
                        "expected BF16 W1 [El, 2F, H] and W2 [El, H, F] in the layer's layout (or a layer built "
                        "without the option, which copies them)");
}

void CudaMoeLayer::relay_params(const MoeWeights& p, const char* what) {
  FLOWMOE_CHECK(path_.bf16_relay_planned, what << ": internal error: a relay of the stored parameters on a layer "
                                                  "planned without room for it (CudaLayerOptions::bf16_storage)");
  const ExpertStorage& st = p.storage;
  WeightBuffers& wb = ws_.weights;
  expert_weights_to_layer(p.w1_bf16, wb.w1_bf16, 2, El_, st.hidden, 2 * st.ffn, 2 * F_, H_, st.w1_rows(F_), stream_);
  expert_weights_to_layer(p.w2_bf16, wb.w2_bf16, 2, El_, st.ffn, st.hidden, H_, F_, st.w2_rows(), stream_);
}

void CudaMoeLayer::set_weights(const MoeWeights& w) {
  const char* what = "MoeLayer::set_weights";
  forward_weights_ = MoeWeights();  // (given for a forward that did not run)
  const bool router = !cfg_.external_routing;
  check_weights(w, "device");
  check_bound(what, /*saved=*/false);
  WeightBuffers& wb = ws_.weights;
  DeviceStatus* wstatus = ws_.routing.weight_status;
  const int64_t n1 = int64_t(El_) * 2 * F_ * H_, n2 = int64_t(El_) * H_ * F_;
  const RecipeSpec& spec = path_.spec();
  // The copies made straight from the parameters count their non-finite values into
  // weight_status[0]: FP32 masters as they are converted, BF16 parameters (the BF16 copies' values
  // themselves) as they are copied or quantized.
  const bool bf16_params = w.bf16_params();
  if (path_.bf16_params_in_place) check_params_in_place(w, what);
  // The dgrad weights W^T written here too, unless each backward transposes them from W
  // (RecipePath::transposes_in_backward): then null, and quantize_weights writes W alone.
  const bool keep_t = !path_.transposes_in_backward;
  // GEMM1's fused SwiGLU epilogue reads W1 with its gate / up blocks interleaved (only GEMM1's fprop
  // reads w1; W1^T stays as it is): the quantization writes them so
  const bool ilv = path_.fused_swiglu;
  uint8_t* const w1t_codes = keep_t ? wb.w1t.codes : nullptr;
  uint8_t* const w2t_codes = keep_t ? wb.w2t.codes : nullptr;
  float* const w1t_f32 = keep_t ? wb.w1t.f32() : nullptr;
  float* const w2t_f32 = keep_t ? wb.w2t.f32() : nullptr;
  uint8_t* const w1t_ue8m0 = keep_t ? wb.w1t_ue8m0 : nullptr;
  uint8_t* const w2t_ue8m0 = keep_t ? wb.w2t_ue8m0 : nullptr;
  FLOWMOE_CUDA_CHECK(cudaMemsetAsync(wstatus, 0, sizeof(DeviceStatus), stream_));
  const ExpertStorage& st = w.storage;
  if (path_.bf16_relay_per_pass) {
    // each pass relays them (relay_params): their non-finite values counted here, no copy
    copy_bf16_checked(w.w1_bf16, int64_t(El_) * st.hidden * 2 * st.ffn, nullptr, wstatus, stream_);
    copy_bf16_checked(w.w2_bf16, int64_t(El_) * st.ffn * st.hidden, nullptr, wstatus, stream_);
  } else if (!st.is_layer_layout() && spec.weights == WeightCopy::kBf16Only) {
    // (BF16 parameters: check_weights) the BF16 copies relaid from where the model stores them,
    // their non-finite values counted there
    expert_weights_to_layer(w.w1_bf16, wb.w1_bf16, 2, El_, st.hidden, 2 * st.ffn, 2 * F_, H_, st.w1_rows(F_),
                            stream_);
    expert_weights_to_layer(w.w2_bf16, wb.w2_bf16, 2, El_, st.ffn, st.hidden, H_, F_, st.w2_rows(), stream_);
    copy_bf16_checked(w.w1_bf16, int64_t(El_) * st.hidden * 2 * st.ffn, nullptr, wstatus, stream_);
    copy_bf16_checked(w.w2_bf16, int64_t(El_) * st.ffn * st.hidden, nullptr, wstatus, stream_);
  } else if (!st.is_layer_layout()) {
    // (kFp8Block: check_weights) read where the model stores them: w1 [El, Hs, 2Fs], w2 [El, Fs, Hs]
    // (ilv: W1 written in the fused SwiGLU's block interleaving, below)
    const auto stored = [&](const auto* w1, const auto* w2) {
      quantize_weights_stored(w1, El_, st.hidden, 2 * st.ffn, st.w1_rows(F_), 2 * F_, H_, wb.w1.codes, wb.w1_ue8m0,
                              w1t_codes, w1t_ue8m0, wstatus, stream_, ilv);
      quantize_weights_stored(w2, El_, st.ffn, st.hidden, st.w2_rows(), H_, F_, wb.w2.codes, wb.w2_ue8m0, w2t_codes,
                              w2t_ue8m0, wstatus, stream_);
    };
    if (bf16_params)
      stored(w.w1_bf16, w.w2_bf16);
    else
      stored(w.w1, w.w2);
  } else if (spec.weights == WeightCopy::kFp8Block) {
    // every expert in one launch per weight, FP32 masters rounded to BF16 on the way (no BF16 copy)
    if (bf16_params) {
      quantize_weights(w.w1_bf16, El_, 2 * F_, H_, wb.w1.codes, wb.w1_ue8m0, w1t_codes, w1t_ue8m0, wstatus,
                       stream_, ilv);
      quantize_weights(w.w2_bf16, El_, H_, F_, wb.w2.codes, wb.w2_ue8m0, w2t_codes, w2t_ue8m0, wstatus,
                       stream_);
    } else {
      quantize_weights(w.w1, El_, 2 * F_, H_, wb.w1.codes, wb.w1_ue8m0, w1t_codes, w1t_ue8m0, wstatus,
                       stream_, ilv);
      quantize_weights(w.w2, El_, H_, F_, wb.w2.codes, wb.w2_ue8m0, w2t_codes, w2t_ue8m0, wstatus, stream_);
    }
  } else if (path_.bf16_params_in_place) {
    // the GEMMs read the parameters themselves (set_forward_weights, set_backward_weights): one read
    // to count their non-finite values, no copy
    copy_bf16_checked(w.w1_bf16, n1, nullptr, wstatus, stream_);
    copy_bf16_checked(w.w2_bf16, n2, nullptr, wstatus, stream_);
  } else if (bf16_params && spec.weights == WeightCopy::kBf16Only) {
    copy_bf16_checked(w.w1_bf16, n1, wb.w1_bf16, wstatus, stream_);
    copy_bf16_checked(w.w2_bf16, n2, wb.w2_bf16, wstatus, stream_);
  } else if (bf16_params) {  // FP8 with FP32 scales
    quantize_weights_fp32_scale(w.w1_bf16, El_, 2 * F_, H_, wb.w1.codes, wb.w1.f32(), w1t_codes, w1t_f32, wstatus,
                                stream_);
    quantize_weights_fp32_scale(w.w2_bf16, El_, H_, F_, wb.w2.codes, wb.w2.f32(), w2t_codes, w2t_f32, wstatus,
                                stream_);
  } else {  // the BF16 copies (bf16's GEMMs read them; FP8 with FP32 scales quantizes them below)
    f32_to_bf16(w.w1, n1, wb.w1_bf16, wstatus, stream_);
    f32_to_bf16(w.w2, n2, wb.w2_bf16, wstatus, stream_);
  }
  if (router) {
    f32_to_bf16(w.wr, int64_t(E_) * H_, wb.wr_check, wstatus, stream_);  // finite check of Wr
    FLOWMOE_CUDA_CHECK(cudaMemcpyAsync(wb.wr, w.wr, sizeof(float) * E_ * H_, cudaMemcpyDeviceToDevice, stream_));
  }
  has_bias_ = w.router_bias != nullptr;
  if (has_bias_)
    FLOWMOE_CUDA_CHECK(cudaMemcpyAsync(wb.router_bias, w.router_bias, sizeof(float) * E_,
                                       cudaMemcpyDeviceToDevice, stream_));
  // The non-finite check of the weights (counted above): thrown here, or with sync_free (no host
  // synchronisation, so that the update can be captured in a CUDA graph) kept in weight_status[1]
  // (the quantization below counts into [0] again) and added to status().nonfinite.
  if (path_.sync_free) {
    FLOWMOE_CUDA_CHECK(cudaMemcpyAsync(wstatus + 1, wstatus, sizeof(DeviceStatus), cudaMemcpyDeviceToDevice, stream_));
  } else {
    DeviceStatus st{};
    FLOWMOE_CUDA_CHECK(cudaMemcpyAsync(&st, wstatus, sizeof st, cudaMemcpyDeviceToHost, stream_));
    FLOWMOE_CUDA_CHECK(cudaStreamSynchronize(stream_));
    if (st.nonfinite)
      throw NonFiniteError(__FILE__, __LINE__,
                           std::string(what) + ": the weights hold " + std::to_string(st.nonfinite) +
                               " non-finite value(s); expected finite W1, W2 and Wr");
  }

  rep_.drop_ops(MoePass::kWeightUpdate);
  if (spec.weights == WeightCopy::kFp8Block) {
    weight_scales_to_f32(wb.w1_ue8m0, El_, 2 * F_, H_, wb.w1.f32(), stream_);
    if (keep_t) weight_scales_to_f32(wb.w1t_ue8m0, El_, H_, 2 * F_, wb.w1t.f32(), stream_);
    weight_scales_to_f32(wb.w2_ue8m0, El_, H_, F_, wb.w2.f32(), stream_);
    if (keep_t) weight_scales_to_f32(wb.w2t_ue8m0, El_, F_, H_, wb.w2t.f32(), stream_);
    rep_.add_op(MoePass::kWeightUpdate, CastKind::kQuantize, spec.quantize_w1, 1, 2 * El_, n1);
    rep_.add_op(MoePass::kWeightUpdate, CastKind::kQuantize, spec.quantize_w2, 1, 2 * El_, n2);
  } else if (spec.weights == WeightCopy::kFp8BlockFp32Scale) {
    if (!bf16_params) {  // (BF16 parameters: quantized above, straight from them)
      quantize_weights_fp32_scale(wb.w1_bf16, El_, 2 * F_, H_, wb.w1.codes, wb.w1.f32(), w1t_codes, w1t_f32,
                                  wstatus, stream_);
      quantize_weights_fp32_scale(wb.w2_bf16, El_, H_, F_, wb.w2.codes, wb.w2.f32(), w2t_codes, w2t_f32,
                                  wstatus, stream_);
    }
    rep_.add_op(MoePass::kWeightUpdate, CastKind::kQuantize, spec.quantize_w1, 1, 2, n1);
    rep_.add_op(MoePass::kWeightUpdate, CastKind::kQuantize, spec.quantize_w2, 1, 2, n2);
  }
  have_weights_ = true;
  have_forward_ = false;
}

// ---- forward -------------------------------------------------------------------------------------
void CudaMoeLayer::forward(const bf16_t* x, int64_t tokens, bf16_t* y) {
  const char* what = "MoeLayer::forward";
  backward_weights_ = MoeWeights();  // (set_backward_weights holds for the backward that follows it)
  const MoeWeights params = forward_weights_;  // for this forward only, also when a check below throws
  forward_weights_ = MoeWeights();
  // the caller's routing and bias are for this forward only, even one refused by the checks below
  const RoutingInput ext = take_routing(what);
  const float* const gemm1_bias = take_gemm1_bias(what);
  collective_checks(comm_, what, [&] {
    FLOWMOE_CHECK(have_weights_, what << ": no weights; call set_weights first");
    FLOWMOE_CHECK(tokens >= 1 && tokens <= cfg_.max_tokens,
                  what << ": T = " << tokens << " tokens; expected 1 <= T <= max_tokens = " << cfg_.max_tokens);
    FLOWMOE_CHECK(x && y, what << ": x and y must be non-null device pointers to [T, H] bf16");
    FLOWMOE_CHECK(!path_.bf16_params_in_place || params.w1_bf16,
                  what << ": this layer reads the BF16 parameters in place (CudaLayerOptions::bf16_params_in_place) "
                          "and got none for this forward; expected set_forward_weights (forward_call's params) first");
    check_bound(what, /*saved=*/true);
  });
  have_forward_ = false;
  rep_.drop_ops(MoePass::kForward);
  rep_.drop_ops(MoePass::kBackward);
  pending_ops_.clear();
  pending_wire_.clear();
  rep_.saved.clear();
  rep_.columns.clear();
  rep_.wire.clear();
  stats_valid_ = false;
  backward_done_ = false;
  clock_.start_forward();
  FLOWMOE_CUDA_CHECK(cudaMemsetAsync(ws_.routing.pass_status, 0, 4 * sizeof(DeviceStatus), stream_));

  Step step;
  step.T = tokens;
  StepCall call;
  call.params = params;
  call.gemm1_bias = gemm1_bias;
  call.router_bias = has_bias_ ? ws_.weights.router_bias : nullptr;
  call.routing_ids = ext.ids;
  call.routing_probs = ext.probs;
  StepContext c = context(std::move(step), call);
  c.route(x);
  if (path_.bf16_relay_per_pass && !c.stored_gemms()) relay_params(params, what);
  pipeline_->forward(c, y);  // (pipelines/: the expert path of path_.dataflow, from the token rows to y)
  step_ = c.take_step();
  if (!path_.sync_free) save_activations(row_counts());  // (sync_free: when the report is read)
  have_forward_ = true;
}

// ---- backward ------------------------------------------------------------------------------------
void CudaMoeLayer::backward(const bf16_t* dy, bf16_t* dx, const MoeGrads& g) {
  const char* what = "MoeLayer::backward";
  const MoeWeights params = backward_weights_;  // for this backward only, also when a check below throws
  backward_weights_ = MoeWeights();
  forward_weights_ = MoeWeights();  // (set_forward_weights holds for the next forward only)
  collective_checks(comm_, what, [&] {
    FLOWMOE_CHECK(have_forward_, what << ": no saved forward; call forward first (backward "
                                         "consumes the activations of the latest forward)");
    FLOWMOE_CHECK(dy && dx, what << ": dy and dx must be non-null device pointers to [T, H] bf16");
    check_grads(g);
    FLOWMOE_CHECK(!path_.bf16_params_in_place || params.w1_bf16,
                  what << ": this layer reads the BF16 parameters in place (CudaLayerOptions::bf16_params_in_place) "
                          "and got none for this backward; expected set_backward_weights (backward_call's params) "
                          "first");
    check_bound(what, /*saved=*/true, /*weights=*/!params.w1 && !params.w1_bf16);
  });
  rep_.drop_ops(MoePass::kBackward);
  pending_ops_.erase(std::remove_if(pending_ops_.begin(), pending_ops_.end(),
                                    [](const PendingOp& p) { return p.pass == MoePass::kBackward; }),
                     pending_ops_.end());
  pending_wire_.erase(std::remove_if(pending_wire_.begin(), pending_wire_.end(),
                                     [](const PendingWire& w) { return w.pass == MoePass::kBackward; }),
                      pending_wire_.end());
  rep_.wire.erase(std::remove_if(rep_.wire.begin(), rep_.wire.end(),
                                 [](const WireTransfer& w) { return w.pass == MoePass::kBackward; }),
                  rep_.wire.end());
  stats_valid_ = false;
  clock_.start_backward();
  FLOWMOE_CUDA_CHECK(cudaMemsetAsync(ws_.routing.pass_status + kStatusBwd, 0, 2 * sizeof(DeviceStatus), stream_));
  StepCall call;
  call.params = params;
  call.grads_accumulate = g.accumulate;
  StepContext c = context(step_, call);  // (a copy: the layer's step backs any number of backwards)
  if (path_.bf16_relay_per_pass && !c.stored_gemms(g)) {
    // (the parameters' storage and alignment were checked when given: check_params_in_place)
    FLOWMOE_CHECK(path_.bf16_relay_planned,
                  what << ": dW1 stored as [" << g.storage.hidden << ", 2 x " << g.storage.ffn
                       << "], not as the parameters; this layer reads them in place and keeps no room to relay "
                          "them (CudaLayerOptions::bf16_storage): expected MoeGrads::storage = the parameters' storage");
    relay_params(params, what);
  }
  pipeline_->backward(c, dy, g);  // (pipelines/: from dy to the dX rows and the wgrads)
  if (streams_.tail()) {  // the tail stream joins stream_ even when the tail throws (stream-ordered,
                          // so that a graph capture stays well-formed; errors of the join ignored)
    try {
      c.backward_tail(g, dx);
    } catch (...) {
      try {
        streams_.join_tail();
      } catch (...) {
      }
      throw;
    }
  } else {
    c.backward_tail(g, dx);
  }
  backward_done_ = true;
}

LayerCounters CudaMoeLayer::counters() const {
  LayerCounters c;
  c.host_syncs = host_syncs_;
  c.gemm_matmuls = gemm_ ? gemm_->stats().matmuls : 0;
  c.gemm_grouped_launches = gemm_ ? gemm_->stats().grouped_kernel_calls : 0;
  c.gemm_wgrad_kernel_launches = gemm_ ? gemm_->stats().wgrad_kernel_calls : 0;
  c.gemm_bf16_kernel_launches = gemm_ ? gemm_->stats().bf16_kernel_calls : 0;
  return c;
}

namespace {
CudaMoeLayer* as_cuda(MoeLayer* l) {
  CudaMoeLayer* c = dynamic_cast<CudaMoeLayer*>(l);
  FLOWMOE_CHECK(c != nullptr, "cuda::moe: the layer is not a CUDA layer (backend "
                                  << (l ? l->backend() : "null") << "); expected one made by make_cuda_layer");
  return c;
}
const CudaMoeLayer* as_cuda(const MoeLayer* l) { return as_cuda(const_cast<MoeLayer*>(l)); }
}  // namespace

bool is_cuda_layer(const MoeLayer* layer) { return dynamic_cast<const CudaMoeLayer*>(layer) != nullptr; }
void set_profiling(MoeLayer* layer, bool on) { as_cuda(layer)->set_profiling(on); }
std::vector<StageTime> stage_times(const MoeLayer* layer) { return as_cuda(layer)->stage_times(); }
size_t allocated_bytes(const MoeLayer* layer) { return as_cuda(layer)->allocated_bytes(); }
LayerCounters counters(const MoeLayer* layer) { return as_cuda(layer)->counters(); }
void fill_normal_f32(float* p, int64_t n, uint64_t seed, float stddev, cudaStream_t stream) {
  fill_normal(p, nullptr, n, seed, stddev, stream);
}
void fill_normal_bf16(bf16_t* p, int64_t n, uint64_t seed, float stddev, cudaStream_t stream) {
  fill_normal(nullptr, p, n, seed, stddev, stream);
}

}  // namespace moe
}  // namespace cuda

std::unique_ptr<MoeLayer> make_cuda_layer(const MoeConfig& cfg, cudaStream_t stream,
                                          const CudaLayerOptions& options) {
  const char* what = "make_cuda_layer";
  auto check_options = [&] {
    options.gemm.validate();
    FLOWMOE_CHECK(options.gemm_pool_priority >= -1 &&
                      options.gemm_pool_priority <= gemm::GroupedGemmOptions::kMaxPoolPriority,
                  what << ": CudaLayerOptions::gemm_pool_priority = " << options.gemm_pool_priority
                       << "; expected -1 (the layer's choice) or 0.."
                       << gemm::GroupedGemmOptions::kMaxPoolPriority);
    check_param_options(what, options.caller_memory, options.bf16_params_in_place, options.bf16_params_stored,
                        options.bf16_storage);
    FLOWMOE_CHECK(options.ep_direct_bytes >= -1, what << ": CudaLayerOptions::ep_direct_bytes = "
                                                      << options.ep_direct_bytes
                                                      << "; expected -1 (the default) or a byte count >= 0");
  };
  // the sync-free rules live in host code (src/common/moe_common.cpp), shared with the C ABI's
  // flowmoe_config_check, so that a configuration is refused with the same words before any GPU work
  auto check_sync_free = [&] {
    check_sync_free_options(what, cfg, CommShape::of(cfg.comm), options.sync_free, options.caller_memory);
  };
  if (cfg.comm == nullptr) {
    cfg.validate();
    check_options();
    check_sync_free();
    return std::unique_ptr<MoeLayer>(new cuda::moe::CudaMoeLayer(cfg, stream, options));
  }
  // Expert parallelism (docs/EP.md §6): collective, as make_cpu_layer. First the configuration
  // across ranks (a mismatch is a CommError on every rank), then each rank's own checks and
  // allocation, agreed on by every rank, so that nobody is left waiting in a later collective.
  Communicator& comm = *cfg.comm;
  ep_detail::check_uniform_config(comm, what, cfg,
                                  {{"deduplicated dispatch (CudaLayerOptions::ep_dedup)", options.ep_dedup ? 1 : 0},
                                   {"EP message grouping (CudaLayerOptions::ep_direct_bytes)",
                                    options.ep_direct_bytes < 0 ? kEpDirectBytes : options.ep_direct_bytes},
                                   {"no host synchronisation (CudaLayerOptions::sync_free)", options.sync_free ? 1 : 0}});
  std::unique_ptr<MoeLayer> layer;
  collective_checks(&comm, what, [&] {
    cfg.validate();
    check_options();
    check_sync_free();
    FLOWMOE_CHECK(comm.memory_space() == MemorySpace::kDevice,
                  what << ": the CUDA layer moves device memory but the communicator ("
                       << comm.backend() << ") moves host memory; expected a device-memory "
                          "communicator (NCCL, or make_device_sim_world's ranks)");
    layer.reset(new cuda::moe::CudaMoeLayer(cfg, stream, options));
  });
  // every rank built its layer: the peers' addresses of the buffers the sync-free exchange reads
  // (collective; a rank that fails here leaves the others a CommError after the timeout)
  if (options.sync_free) static_cast<cuda::moe::CudaMoeLayer*>(layer.get())->share_ep_buffers();
  return layer;
}

}  // namespace flowmoe
