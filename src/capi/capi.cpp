// The C ABI (include/flowmoe/c_api.h): handles around MoeLayer and Communicator, every call guarded
// so that a flowmoe::Error (or any C++ exception) becomes a status code plus a thread-local message.
#include <cstring>
#include <exception>
#include <new>
#include <string>
#include <type_traits>
#include <utility>
#include <vector>

#include "capi/capi_internal.h"
#include "flowmoe/error.h"

#include "flowmoe/expert_layout.h"

#if defined(FLOWMOE_HAVE_CUDA)
#include <cuda_runtime_api.h>
#endif

struct flowmoe_comm {
  std::unique_ptr<flowmoe::Communicator> comm;
};

struct flowmoe_layer {
  std::unique_ptr<flowmoe::MoeLayer> layer;
  int device = -1;  // CUDA device of a CUDA layer (made current for each call), -1 for CPU
  std::string report;
};

namespace flowmoe {
namespace capi {

namespace {

thread_local std::string g_last_error;
thread_local std::string g_callback_error;

int fail(int code, const std::string& msg) {
  g_last_error = msg;
  return code;
}

// Runs fn, mapping every exception to a status code and the message of flowmoe_last_error().
template <typename Fn>
int guarded(const char* what, Fn&& fn) {
  try {
    fn();
    return FLOWMOE_OK;
  } catch (const NonFiniteError& e) {
    return fail(FLOWMOE_ERROR_NONFINITE, e.what());
  } catch (const CommError& e) {
    return fail(FLOWMOE_ERROR_COMM, e.what());
  } catch (const OutOfMemoryError& e) {
    return fail(FLOWMOE_ERROR_OUT_OF_MEMORY, e.what());
  } catch (const Error& e) {
    return fail(FLOWMOE_ERROR, e.what());
  } catch (const std::bad_alloc&) {
    return fail(FLOWMOE_ERROR, std::string(what) + ": out of host memory");
  } catch (const std::exception& e) {
    return fail(FLOWMOE_ERROR, std::string(what) + ": " + e.what());
  } catch (...) {
    return fail(FLOWMOE_ERROR, std::string(what) + ": unknown C++ exception");
  }
}

#define FLOWMOE_CAPI_REQUIRE(cond, msg) FLOWMOE_CHECK(cond, msg)

MoeConfig to_config(const flowmoe_config* c, flowmoe_comm* comm, const char* what) {
  FLOWMOE_CAPI_REQUIRE(c != nullptr, what << ": null configuration");
  MoeConfig cfg;
  cfg.hidden = c->hidden;
  cfg.ffn = c->ffn;
  cfg.num_experts = c->num_experts;
  cfg.topk = c->topk;
  const std::string router = c->router ? c->router : "softmax";
  if (router == "softmax") {
    cfg.router = RouterScore::kSoftmax;
  } else if (router == "sigmoid") {
    cfg.router = RouterScore::kSigmoid;
  } else {
    FLOWMOE_CHECK(false, what << ": router score '" << router
                              << "' is unknown; expected 'softmax' or 'sigmoid'");
  }
  cfg.router_renormalize = c->renormalize != 0;
  cfg.router_scale = c->routed_scaling;
  cfg.aux_loss_alpha = c->aux_loss_coef;
  cfg.align = c->align;
  FLOWMOE_CAPI_REQUIRE(c->recipe != nullptr, what << ": null recipe name; expected one of "
                                                  << flowmoe_recipe_names());
  cfg.recipe = parse_recipe(c->recipe);
  cfg.max_tokens = c->max_tokens;
  cfg.check_columns = c->check_columns != 0;
  const std::string exponent = c->transpose_exponent ? c->transpose_exponent : "row-max";
  if (exponent == "row-max") {
    cfg.transpose_exponent = TransposeExponent::kRowMax;
  } else if (exponent == "column-amax") {
    cfg.transpose_exponent = TransposeExponent::kColumnAmax;
  } else {
    FLOWMOE_CHECK(false, what << ": transpose_exponent '" << exponent
                              << "' is unknown; expected 'row-max' or 'column-amax'");
  }
  FLOWMOE_CHECK(c->external_routing == 0 || c->external_routing == 1,
                what << ": external_routing = " << c->external_routing << "; expected 0 or 1");
  cfg.external_routing = c->external_routing == 1;
  cfg.activation = activation_from_name(c->activation ? c->activation : "swiglu", c->swiglu_alpha, c->swiglu_limit,
                                        what);
  FLOWMOE_CHECK(c->gemm1_bias == 0 || c->gemm1_bias == 1,
                what << ": gemm1_bias = " << c->gemm1_bias << "; expected 0 or 1");
  cfg.gemm1_bias = c->gemm1_bias == 1;
  cfg.comm = comm ? comm->comm.get() : nullptr;
  return cfg;
}

// The CUDA layer's C options as flags (each 0 or 1), shared by the layer's creation and
// flowmoe_config_check. null: the defaults.
struct CudaFlags {
  bool sync_free = false;
  bool caller_memory = false;
  bool bf16_params_in_place = false;
  bool bf16_params_stored = false;
  flowmoe::ExpertStorage bf16_storage;  // (version 12)
};

CudaFlags cuda_flags(const flowmoe_cuda_options* o, const char* what) {
  CudaFlags f;
  if (o == nullptr) return f;
  FLOWMOE_CHECK(o->sync_free == 0 || o->sync_free == 1, what << ": sync_free = " << o->sync_free << "; expected 0 or 1");
  FLOWMOE_CHECK(o->caller_memory == 0 || o->caller_memory == 1,
                what << ": caller_memory = " << o->caller_memory << "; expected 0 or 1");
  f.sync_free = o->sync_free == 1;
  f.caller_memory = o->caller_memory == 1;
  FLOWMOE_CHECK(o->bf16_params_in_place == 0 || o->bf16_params_in_place == 1,
                what << ": bf16_params_in_place = " << o->bf16_params_in_place << "; expected 0 or 1");
  f.bf16_params_in_place = o->bf16_params_in_place == 1;
  FLOWMOE_CHECK(o->bf16_params_stored == 0 || o->bf16_params_stored == 1,
                what << ": bf16_params_stored = " << o->bf16_params_stored << "; expected 0 or 1");
  f.bf16_params_stored = o->bf16_params_stored == 1;
  FLOWMOE_CHECK(o->stored_interleaved == 0 || o->stored_interleaved == 1,
                what << ": stored_interleaved = " << o->stored_interleaved << "; expected 0 or 1");
  f.bf16_storage = flowmoe::ExpertStorage{o->stored_hidden, o->stored_ffn, o->stored_interleaved == 1};
  return f;
}

flowmoe_layer* checked(flowmoe_layer* l, const char* what) {
  FLOWMOE_CAPI_REQUIRE(l != nullptr && l->layer, what << ": null layer handle");
#if defined(FLOWMOE_HAVE_CUDA)
  if (l->device >= 0) {
    const cudaError_t err = cudaSetDevice(l->device);
    FLOWMOE_CHECK(err == cudaSuccess, what << ": cudaSetDevice(" << l->device << ") failed: "
                                           << cudaGetErrorString(err));
  }
#endif
  return l;
}

// W1, W2 as FP32 masters (float) or BF16 parameters (uint16_t bits).
template <typename W>
MoeWeights expert_weights(const W* w1, const W* w2) {
  MoeWeights w;
  if constexpr (std::is_same_v<W, float>) {
    w.w1 = w1;
    w.w2 = w2;
  } else {
    w.w1_bf16 = w1;
    w.w2_bf16 = w2;
  }
  return w;
}

}  // namespace

std::string take_callback_error() {
  std::string s;
  s.swap(g_callback_error);
  return s;
}

}  // namespace capi
}  // namespace flowmoe

using flowmoe::capi::checked;
using flowmoe::capi::guarded;
using flowmoe::capi::expert_weights;

extern "C" {

int flowmoe_capi_version(void) { return FLOWMOE_CAPI_VERSION; }
const char* flowmoe_last_error(void) { return flowmoe::capi::g_last_error.c_str(); }

int flowmoe_has_cuda(void) {
#if defined(FLOWMOE_HAVE_CUDA)
  return 1;
#else
  return 0;
#endif
}

int flowmoe_has_nccl(void) {
#if defined(FLOWMOE_HAVE_NCCL)
  return 1;
#else
  return 0;
#endif
}

const char* flowmoe_recipe_names(void) {
  static const std::string names = [] {
    std::string s;
    for (flowmoe::Recipe r : flowmoe::all_recipes()) s += (s.empty() ? "" : ",") + std::string(flowmoe::recipe_name(r));
    return s;
  }();
  return names.c_str();
}

int flowmoe_config_check(const flowmoe_config* cfg, int ep_world, const flowmoe_cuda_options* options) {
  const char* what = "flowmoe_config_check";
  return guarded(what, [&] {
    FLOWMOE_CHECK(ep_world >= 0, what << ": ep_world = " << ep_world
                                      << "; expected 0 (no communicator) or the communicator's rank count");
    const flowmoe::MoeConfig c = flowmoe::capi::to_config(cfg, nullptr, what);
    // The communicators this interface makes (flowmoe_comm_create_host, flowmoe_comm_create_nccl)
    // size their messages on the host: neither offers device peers (Communicator::device_peers).
    flowmoe::CommShape comm;
    comm.world = ep_world;
    comm.device_peers = false;
    comm.backend = "host callbacks or nccl, the C ABI's communicators";
    c.validate(comm);
    const flowmoe::capi::CudaFlags flags = flowmoe::capi::cuda_flags(options, what);
    flowmoe::check_sync_free_options(what, c, comm, flags.sync_free, flags.caller_memory);
    flowmoe::check_param_options(what, flags.caller_memory, flags.bf16_params_in_place, flags.bf16_params_stored,
                                 flags.bf16_storage);
  });
}

int64_t flowmoe_config_size_multiple(void) { return flowmoe::kMoeSizeMultiple; }

int flowmoe_layer_create_cpu(const flowmoe_config* cfg, flowmoe_comm* comm, flowmoe_layer** out) {
  const char* what = "flowmoe_layer_create_cpu";
  return guarded(what, [&] {
    FLOWMOE_CHECK(out != nullptr, what << ": null output handle");
    *out = nullptr;
    std::unique_ptr<flowmoe_layer> h(new flowmoe_layer);
    h->layer = flowmoe::make_cpu_layer(flowmoe::capi::to_config(cfg, comm, what));
    *out = h.release();
  });
}

int flowmoe_layer_create_cuda(const flowmoe_config* cfg, flowmoe_comm* comm, int device,
                              void* stream, flowmoe_layer** out) {
  return flowmoe_layer_create_cuda_opts(cfg, comm, device, stream, nullptr, out);
}

int flowmoe_layer_create_cuda_opts(const flowmoe_config* cfg, flowmoe_comm* comm, int device,
                                   void* stream, const flowmoe_cuda_options* options,
                                   flowmoe_layer** out) {
  const char* what = "flowmoe_layer_create_cuda";
#if defined(FLOWMOE_HAVE_CUDA)
  return guarded(what, [&] {
    FLOWMOE_CHECK(out != nullptr, what << ": null output handle");
    *out = nullptr;
    FLOWMOE_CHECK(device >= 0, what << ": device " << device << "; expected a CUDA device index >= 0");
    const flowmoe::MoeConfig c = flowmoe::capi::to_config(cfg, comm, what);
    const cudaError_t err = cudaSetDevice(device);
    FLOWMOE_CHECK(err == cudaSuccess,
                  what << ": cudaSetDevice(" << device << ") failed: " << cudaGetErrorString(err));
    std::unique_ptr<flowmoe_layer> h(new flowmoe_layer);
    h->device = device;
    flowmoe::CudaLayerOptions o;
    const flowmoe::capi::CudaFlags flags = flowmoe::capi::cuda_flags(options, what);
    o.sync_free = flags.sync_free;
    o.caller_memory = flags.caller_memory;
    o.bf16_params_in_place = flags.bf16_params_in_place;
    o.bf16_params_stored = flags.bf16_params_stored;
    o.bf16_storage = flags.bf16_storage;
    h->layer = flowmoe::make_cuda_layer(c, static_cast<cudaStream_t>(stream), o);
    *out = h.release();
  });
#else
  (void)cfg, (void)comm, (void)device, (void)stream, (void)options;
  if (out) *out = nullptr;
  return flowmoe::capi::fail(FLOWMOE_ERROR_UNSUPPORTED,
                             std::string(what) + ": this flowmoe library was built without the "
                                                 "CUDA backend (no nvcc at build time); expected "
                                                 "a CUDA build for CUDA tensors");
#endif
}

int flowmoe_expert_relayout(const void* src, void* dst, int elem_bytes, int num_experts, int64_t c, int64_t l,
                            int64_t r, int64_t cp, const int64_t map[5], int to_layer, void* stream) {
  const char* what = "flowmoe_expert_relayout";
#if defined(FLOWMOE_HAVE_CUDA)
  return guarded(what, [&] {
    FLOWMOE_CHECK(src != nullptr && dst != nullptr && map != nullptr, what << ": null pointer");
    flowmoe::ExpertRowMap m;
    m.valid = map[0], m.stride = map[1], m.base0 = map[2], m.base1 = map[3], m.second = map[4];
    cudaStream_t s = static_cast<cudaStream_t>(stream);
    if (to_layer)
      flowmoe::cuda::expert_weights_to_layer(src, dst, elem_bytes, num_experts, c, l, r, cp, m, s);
    else
      flowmoe::cuda::expert_grads_from_layer(src, dst, elem_bytes, num_experts, c, l, r, cp, m, s);
  });
#else
  (void)src, (void)dst, (void)elem_bytes, (void)num_experts, (void)c, (void)l, (void)r, (void)cp, (void)map,
      (void)to_layer, (void)stream;
  return flowmoe::capi::fail(FLOWMOE_ERROR_UNSUPPORTED, std::string(what) + ": built without the CUDA backend");
#endif
}

int flowmoe_layer_destroy(flowmoe_layer* layer) {
  return guarded("flowmoe_layer_destroy", [&] {
    if (layer && layer->device >= 0) checked(layer, "flowmoe_layer_destroy");
    delete layer;
  });
}

const char* flowmoe_layer_backend(const flowmoe_layer* layer) {
  return layer && layer->layer ? layer->layer->backend() : "";
}

int flowmoe_layer_local_experts(const flowmoe_layer* layer) {
  return layer && layer->layer ? layer->layer->config().num_local_experts() : 0;
}

int flowmoe_layer_takes_backward_weights(flowmoe_layer* layer, int* out) {
  return guarded("flowmoe_layer_takes_backward_weights", [&] {
    FLOWMOE_CHECK(out != nullptr, "flowmoe_layer_takes_backward_weights: null output");
    *out = checked(layer, "flowmoe_layer_takes_backward_weights")->layer->takes_backward_weights() ? 1 : 0;
  });
}

int flowmoe_layer_reads_params_in_place(flowmoe_layer* layer, int* out) {
  return guarded("flowmoe_layer_reads_params_in_place", [&] {
    FLOWMOE_CHECK(out != nullptr, "flowmoe_layer_reads_params_in_place: null output");
    *out = checked(layer, "flowmoe_layer_reads_params_in_place")->layer->reads_params_in_place() ? 1 : 0;
  });
}

namespace {
flowmoe::MoeWeights weights_of(const char* what, const flowmoe_weights* c) {
  FLOWMOE_CHECK(c, what << ": the weights struct is null");
  FLOWMOE_CHECK(c->bf16 == 0 || c->bf16 == 1, what << ": bf16 = " << c->bf16 << "; expected 0 or 1");
  FLOWMOE_CHECK(c->interleaved == 0 || c->interleaved == 1,
                what << ": interleaved = " << c->interleaved << "; expected 0 or 1");
  FLOWMOE_CHECK((c->stored_hidden == 0) == (c->stored_ffn == 0),
                what << ": stored_hidden " << c->stored_hidden << ", stored_ffn " << c->stored_ffn
                     << "; expected both 0 (the layer's layout) or both the stored sizes");
  flowmoe::MoeWeights w = c->bf16 ? expert_weights(static_cast<const uint16_t*>(c->w1), static_cast<const uint16_t*>(c->w2))
                         : expert_weights(static_cast<const float*>(c->w1), static_cast<const float*>(c->w2));
  w.wr = c->wr;
  w.router_bias = c->router_bias;
  w.storage = flowmoe::ExpertStorage{c->stored_hidden, c->stored_ffn, c->interleaved == 1};
  return w;
}

flowmoe::MoeGrads grads_of(const char* what, const flowmoe_grads* c) {
  FLOWMOE_CHECK(c, what << ": the gradients struct is null");
  FLOWMOE_CHECK(c->bf16 == 0 || c->bf16 == 1, what << ": bf16 = " << c->bf16 << "; expected 0 or 1");
  FLOWMOE_CHECK(c->accumulate == 0 || c->accumulate == 1,
                what << ": accumulate = " << c->accumulate << "; expected 0 or 1");
  FLOWMOE_CHECK(c->interleaved == 0 || c->interleaved == 1,
                what << ": interleaved = " << c->interleaved << "; expected 0 or 1");
  FLOWMOE_CHECK((c->stored_hidden == 0) == (c->stored_ffn == 0),
                what << ": stored_hidden " << c->stored_hidden << ", stored_ffn " << c->stored_ffn
                     << "; expected both 0 (the layer's layout) or both the stored sizes");
  flowmoe::MoeGrads g;
  if (c->bf16) {
    g.dw1_bf16 = static_cast<uint16_t*>(c->dw1);
    g.dw2_bf16 = static_cast<uint16_t*>(c->dw2);
  } else {
    g.dw1 = static_cast<float*>(c->dw1);
    g.dw2 = static_cast<float*>(c->dw2);
  }
  g.dwr = c->dwr;
  g.dprobs = c->dprobs;
  g.db1 = c->db1;
  g.accumulate = c->accumulate == 1;
  g.storage = flowmoe::ExpertStorage{c->stored_hidden, c->stored_ffn, c->interleaved != 0};
  return g;
}
}  // namespace

int flowmoe_layer_set_weights_ex(flowmoe_layer* layer, const flowmoe_weights* w,
                                 const flowmoe_memory* memory) {
  const char* what = "flowmoe_layer_set_weights_ex";
  return guarded(what, [&] {
    flowmoe::MoeLayer& m = *checked(layer, what)->layer;
    const flowmoe::MoeWeights weights = weights_of(what, w);
    flowmoe::MoeMemory regions;
    if (memory) regions = flowmoe::MoeMemory{memory->weights, memory->saved, memory->transient};
    // A caller-memory layer writes its weight copies into the regions given here: say so in this
    // function's terms rather than the layer's (whose message names MoeLayer::bind_memory).
    const flowmoe::MoeMemoryPlan plan = m.memory_plan();
    const bool no_weights = plan.weights != 0 && regions.weights == nullptr;
    const bool no_transient = plan.transient != 0 && regions.transient == nullptr;
    FLOWMOE_CHECK(!no_weights && !no_transient,
                  what << ": this layer takes its memory from the caller (memory_plan: "
                       << plan.weights << " weights, " << plan.transient << " transient bytes) but "
                       << (memory == nullptr ? "memory is null"
                           : no_weights      ? "memory.weights is null"
                                             : "memory.transient is null")
                       << "; expected the weights and transient regions of those sizes");
    m.bind_memory(regions);  // as every call does (null regions for a layer that owns its memory)
    m.set_weights(weights);
  });
}

int flowmoe_layer_reads_stored_weights(flowmoe_layer* layer, int bf16, int* out) {
  const char* what = "flowmoe_layer_reads_stored_weights";
  return guarded(what, [&] {
    FLOWMOE_CHECK(out, what << ": out is null");
    *out = checked(layer, what)->layer->reads_stored_weights(bf16 != 0) ? 1 : 0;
  });
}

int flowmoe_layer_forward_call(flowmoe_layer* layer, const flowmoe_forward_call* call) {
  const char* what = "flowmoe_layer_forward_call";
  return guarded(what, [&] {
    flowmoe_layer* l = checked(layer, what);
    FLOWMOE_CHECK(call, what << ": the call struct is null");
    flowmoe::MoeLayer& m = *l->layer;
    // (checked before the layer is given anything)
    FLOWMOE_CHECK(call->step_capacity >= 0 && (call->step_out != nullptr || call->step_capacity == 0) &&
                      (call->step_size != nullptr || call->step_out == nullptr),
                  what << ": step_out " << call->step_out << " of " << call->step_capacity << " bytes, step_size "
                       << static_cast<const void*>(call->step_size)
                       << "; expected a buffer, its size and a size pointer (or null, 0 and a size pointer to ask "
                          "the size alone; all null and 0: no step)");
    const flowmoe::MoeMemoryPlan plan = m.memory_plan();
    FLOWMOE_CHECK(!call->step_size || l->device < 0 || plan.weights + plan.saved + plan.transient > 0,
                  what << ": a step asked of a CUDA layer that owns its memory (its next forward overwrites what a "
                          "step would name); expected step_size null, or a layer built with caller_memory");
    m.bind_memory(flowmoe::MoeMemory{call->memory.weights, call->memory.saved, call->memory.transient});
    if (m.config().external_routing || call->ids || call->probs) m.set_routing(call->ids, call->probs);
    if (m.config().gemm1_bias || call->b1) m.set_gemm1_bias(call->b1);
    if (call->params) m.set_forward_weights(weights_of(what, call->params));
    m.forward(call->x, call->tokens, call->y);
    if (call->step_size) {
      const std::vector<uint8_t> bytes = m.step_state();
      *call->step_size = static_cast<int64_t>(bytes.size());
      if (call->step_capacity >= *call->step_size && !bytes.empty())
        std::memcpy(call->step_out, bytes.data(), bytes.size());
    }
  });
}

int flowmoe_layer_backward_call(flowmoe_layer* layer, const flowmoe_backward_call* call) {
  const char* what = "flowmoe_layer_backward_call";
  return guarded(what, [&] {
    flowmoe_layer* l = checked(layer, what);
    FLOWMOE_CHECK(call, what << ": the call struct is null");
    FLOWMOE_CHECK(call->step_bytes >= 0 && (call->step != nullptr || call->step_bytes == 0),
                  what << ": step " << call->step << " of " << call->step_bytes
                       << " bytes; expected step_state's bytes, or null and 0 (the latest forward)");
    flowmoe::MoeLayer& m = *l->layer;
    const flowmoe::MoeGrads g = grads_of(what, &call->grads);
    m.bind_memory(flowmoe::MoeMemory{call->memory.weights, call->memory.saved, call->memory.transient});
    if (call->step) m.load_step(static_cast<const uint8_t*>(call->step), static_cast<size_t>(call->step_bytes));
    if (call->params) {
      const flowmoe::MoeWeights p = weights_of(what, call->params);
      FLOWMOE_CHECK(p.router_bias == nullptr, what << ": params.router_bias given; the backward does not read it");
      m.set_backward_weights(p);
    }
    m.backward(call->dy, call->dx, g);
  });
}

int flowmoe_layer_writes_stored_grads(flowmoe_layer* layer, int64_t stored_hidden, int64_t stored_ffn,
                                      int interleaved, int bf16, int* out) {
  const char* what = "flowmoe_layer_writes_stored_grads";
  return guarded(what, [&] {
    FLOWMOE_CHECK(out, what << ": out is null");
    const flowmoe::ExpertStorage st{stored_hidden, stored_ffn, interleaved != 0};
    *out = checked(layer, what)->layer->writes_stored_grads(st, bf16 != 0) ? 1 : 0;
  });
}

int flowmoe_recipe_reads_stored_weights(const char* recipe, const char* backend, int bf16, int* out) {
  const char* what = "flowmoe_recipe_reads_stored_weights";
  return guarded(what, [&] {
    FLOWMOE_CHECK(out && backend, what << ": out or backend is null");
    const std::string b(backend);
    FLOWMOE_CHECK(b == "cpu" || b == "cuda", what << ": backend '" << b << "'; expected \"cpu\" or \"cuda\"");
    *out = flowmoe::MoeLayer::reads_stored_weights(b, flowmoe::parse_recipe(recipe ? recipe : ""), bf16 != 0) ? 1
                                                                                                            : 0;
  });
}

int flowmoe_layer_memory_plan(flowmoe_layer* layer, int64_t out[3]) {
  return guarded("flowmoe_layer_memory_plan", [&] {
    FLOWMOE_CHECK(out != nullptr, "flowmoe_layer_memory_plan: null output");
    const flowmoe::MoeMemoryPlan p = checked(layer, "flowmoe_layer_memory_plan")->layer->memory_plan();
    out[0] = p.weights;
    out[1] = p.saved;
    out[2] = p.transient;
  });
}

int flowmoe_layer_step_state(flowmoe_layer* layer, void* out, int64_t capacity, int64_t* size) {
  return guarded("flowmoe_layer_step_state", [&] {
    FLOWMOE_CHECK(size != nullptr, "flowmoe_layer_step_state: null size pointer");
    FLOWMOE_CHECK(capacity >= 0 && (out != nullptr || capacity == 0),
                  "flowmoe_layer_step_state: " << capacity << " bytes at " << out
                                               << "; expected a buffer and its size (or null and 0 to ask the size)");
    const std::vector<uint8_t> bytes = checked(layer, "flowmoe_layer_step_state")->layer->step_state();
    *size = static_cast<int64_t>(bytes.size());
    if (capacity >= *size && !bytes.empty()) std::memcpy(out, bytes.data(), bytes.size());
  });
}

int flowmoe_layer_status_get(flowmoe_layer* layer, flowmoe_layer_status* out) {
  return guarded("flowmoe_layer_status_get", [&] {
    FLOWMOE_CHECK(out != nullptr, "flowmoe_layer_status_get: null output");
    const flowmoe::MoeStatus s = checked(layer, "flowmoe_layer_status_get")->layer->status();
    out->nonfinite = s.nonfinite;
    out->underflow = s.underflow;
    out->aux_loss = s.aux_loss;
  });
}

int flowmoe_layer_cast_report(flowmoe_layer* layer, int as_json, const char** out) {
  return guarded("flowmoe_layer_cast_report", [&] {
    FLOWMOE_CHECK(out != nullptr, "flowmoe_layer_cast_report: null output");
    *out = "";
    flowmoe_layer* l = checked(layer, "flowmoe_layer_cast_report");
    const flowmoe::CastReport& r = l->layer->cast_report();
    l->report = as_json ? flowmoe::capi::cast_report_json(r) : r.to_string();
    *out = l->report.c_str();
  });
}

void flowmoe_set_callback_error(const char* message) {
  flowmoe::capi::g_callback_error = message ? message : "";
}

int flowmoe_comm_create_host(int rank, int world_size, const flowmoe_host_comm_ops* ops,
                             double timeout_s, flowmoe_comm** out) {
  const char* what = "flowmoe_comm_create_host";
  return guarded(what, [&] {
    FLOWMOE_CHECK(out != nullptr && ops != nullptr, what << ": null argument");
    *out = nullptr;
    std::unique_ptr<flowmoe_comm> h(new flowmoe_comm);
    h->comm = flowmoe::capi::make_host_callback_comm(rank, world_size, *ops, timeout_s);
    *out = h.release();
  });
}

int flowmoe_nccl_unique_id(uint8_t out[128]) {
#if defined(FLOWMOE_HAVE_NCCL)
  return guarded("flowmoe_nccl_unique_id", [&] {
    FLOWMOE_CHECK(out != nullptr, "flowmoe_nccl_unique_id: null output");
    const std::vector<uint8_t> id = flowmoe::nccl_unique_id();
    FLOWMOE_CHECK(id.size() == 128, "flowmoe_nccl_unique_id: " << id.size()
                                                               << " bytes; expected 128");
    std::memcpy(out, id.data(), 128);
  });
#else
  (void)out;
  return flowmoe::capi::fail(FLOWMOE_ERROR_UNSUPPORTED,
                             "flowmoe_nccl_unique_id: this flowmoe library was built without NCCL; "
                             "expected a CUDA build with NCCL for expert parallelism on GPUs");
#endif
}

int flowmoe_comm_create_nccl(int rank, int world_size, const uint8_t unique_id[128], int device,
                             double timeout_s, flowmoe_comm** out) {
  const char* what = "flowmoe_comm_create_nccl";
#if defined(FLOWMOE_HAVE_NCCL)
  return guarded(what, [&] {
    FLOWMOE_CHECK(out != nullptr && unique_id != nullptr, what << ": null argument");
    *out = nullptr;
    flowmoe::NcclCommOptions opt;
    opt.device = device;
    if (timeout_s > 0) opt.timeout_s = timeout_s;
    std::unique_ptr<flowmoe_comm> h(new flowmoe_comm);
    h->comm = flowmoe::make_nccl_comm(rank, world_size,
                                      std::vector<uint8_t>(unique_id, unique_id + 128), opt);
    *out = h.release();
  });
#else
  (void)rank, (void)world_size, (void)unique_id, (void)device, (void)timeout_s;
  if (out) *out = nullptr;
  return flowmoe::capi::fail(FLOWMOE_ERROR_UNSUPPORTED,
                             std::string(what) + ": this flowmoe library was built without NCCL; "
                                                 "expected a CUDA build with NCCL");
#endif
}

int flowmoe_comm_destroy(flowmoe_comm* comm) {
  return guarded("flowmoe_comm_destroy", [&] { delete comm; });
}

int flowmoe_comm_rank(const flowmoe_comm* comm) {
  return comm && comm->comm ? comm->comm->rank() : -1;
}

int flowmoe_comm_world_size(const flowmoe_comm* comm) {
  return comm && comm->comm ? comm->comm->world_size() : 0;
}

}  // extern "C"
