// The C ABI of flowmoe (issue 17): the MoE layer of include/flowmoe/moe.h and the communicators of
// include/flowmoe/comm.h behind plain C functions, built as the shared library flowmoe_capi
// (libflowmoe_capi.so). The Python package (python/flowmoe/_native.py) loads it with ctypes, so the
// library has no Python ABI: one build serves every Python version (docs/PYTHON.md).
//
// Conventions:
//  - Every function returns FLOWMOE_OK (0) or an error code (queries such as flowmoe_has_cuda and
//    flowmoe_config_size_multiple return their value); on an error flowmoe_last_error()
//    returns the message (the flowmoe::Error text: file:line, what was wrong, what was expected)
//    of the last failed call of this thread. No C++ exception crosses this interface.
//  - Pointers to tensors are host pointers for a CPU layer and device pointers for a CUDA layer;
//    shapes are those of moe.h (x, y, dy, dx [T, H] bf16 bits; W1 [El, 2F, H], W2 [El, H, F],
//    Wr [E, H], router bias [E], gradients the same, fp32).
//  - Handles are owned by the caller and released with the matching destroy function. A layer
//    made with a communicator does not own it: destroy the layer first.
#pragma once

#include <stddef.h>
#include <stdint.h>

#ifdef __cplusplus
extern "C" {
#endif

// Bumped when a function or field is added, changed or removed (each is marked with the version
// that added it); up to version 9 earlier versions' functions kept their signatures and meaning.
// Version 10 appended fields to flowmoe_cuda_options and flowmoe_forward_call (callers built
// against version 9 are rebuilt), and removed the per-call setters (bind_memory, set_routing,
// set_gemm1_bias(_grad), load_step, set_backward_weights(_bf16)) and the legacy calls that needed
// them (forward, backward, backward_ex, backward_bf16, set_weights, set_weights_bf16): every call
// takes what it needs as arguments (flowmoe_layer_forward_call, flowmoe_layer_backward_call), and
// set_weights_ex takes the memory. Version 11 appended the forward's step output to
// flowmoe_forward_call (callers built against version 10 are rebuilt). Version 12 appended the
// parameters' storage to flowmoe_cuda_options (callers built against version 11 are rebuilt).
#define FLOWMOE_CAPI_VERSION 12

enum flowmoe_status_code {
  FLOWMOE_OK = 0,
  FLOWMOE_ERROR = 1,           // flowmoe::Error: bad argument, failed precondition, CUDA error
  FLOWMOE_ERROR_NONFINITE = 2, // flowmoe::NonFiniteError (e.g. non-finite weights)
  FLOWMOE_ERROR_COMM = 3,      // flowmoe::CommError (timeout, peer failure, mismatch across ranks)
  FLOWMOE_ERROR_UNSUPPORTED = 4, // not built into this library (CUDA, NCCL)
  FLOWMOE_ERROR_OUT_OF_MEMORY = 5, // flowmoe::OutOfMemoryError: a device allocation failed (version 5)
};

typedef struct flowmoe_layer flowmoe_layer;
typedef struct flowmoe_comm flowmoe_comm;

// ---- library ----------------------------------------------------------------------------------
int flowmoe_capi_version(void);  // FLOWMOE_CAPI_VERSION of the built library
// Message of the last failed call on this thread ("" if none). Valid until the next failed call.
const char* flowmoe_last_error(void);
int flowmoe_has_cuda(void);  // 1 when the CUDA backend is built in
int flowmoe_has_nccl(void);  // 1 when the NCCL communicator is built in
// Recipe names, comma-separated ("bf16,blockwise,fp8-naive,flow,flow-fp4").
const char* flowmoe_recipe_names(void);

// ---- configuration (moe.h MoeConfig) -----------------------------------------------------------
typedef struct flowmoe_config {
  int64_t hidden;         // H
  int64_t ffn;            // F
  int32_t num_experts;    // E (all experts of the layer)
  int32_t topk;           // k
  const char* router;     // "softmax" or "sigmoid"
  int32_t renormalize;    // 0 / 1
  float routed_scaling;   // MoeConfig::router_scale
  float aux_loss_coef;    // MoeConfig::aux_loss_alpha
  int32_t align;          // A: 16, 32, 64, 128
  const char* recipe;     // "bf16", "blockwise", "fp8-naive", "flow", "flow-fp4"
  int64_t max_tokens;     // largest T of a forward call
  int32_t check_columns;  // MoeConfig::check_columns
  // MoeConfig::transpose_exponent: "row-max" (SPEC §4; also when null) or "column-amax"
  const char* transpose_exponent;
  // MoeConfig::external_routing (0 / 1; version 3): the caller routes (flowmoe_forward_call's ids,
  // probs); no router weights (wr null), no aux loss, dprobs from the backward.
  int32_t external_routing;
  // MoeConfig::activation (version 6): "swiglu" (also when null) or "clamped-swiglu" (gpt-oss) with
  // swiglu_alpha and swiglu_limit (ignored for "swiglu").
  const char* activation;
  float swiglu_alpha;
  float swiglu_limit;
  // MoeConfig::gemm1_bias (0 / 1; version 6): b1 [El, 2F] fp32 with each forward
  // (flowmoe_forward_call's b1), db1 from the backward (flowmoe_grads' db1).
  int32_t gemm1_bias;
} flowmoe_config;

// ---- layers -----------------------------------------------------------------------------------
// comm may be null (one rank holding all E experts). CPU: a host-memory communicator
// (flowmoe_comm_create_host); CUDA: a device-memory one (flowmoe_comm_create_nccl).
int flowmoe_layer_create_cpu(const flowmoe_config* cfg, flowmoe_comm* comm, flowmoe_layer** out);
// device: CUDA device index (made current for every call on this layer); stream: a cudaStream_t
// (null: the legacy default stream) on which everything of the layer is ordered.
int flowmoe_layer_create_cuda(const flowmoe_config* cfg, flowmoe_comm* comm, int device,
                              void* stream, flowmoe_layer** out);
// The CUDA layer's options (moe.h CudaLayerOptions); all zero = the defaults.
typedef struct flowmoe_cuda_options {
  // CudaLayerOptions::sync_free: no host synchronisation in forward and backward (one GPU, align
  // 128; the same bits as the default, bf16's as its grouped BF16 kernels give them).
  int32_t sync_free;
  // CudaLayerOptions::caller_memory: the weight copies, saved activations and scratch live in
  // regions the caller passes with each call (flowmoe_layer_memory_plan, flowmoe_memory).
  int32_t caller_memory;
  // Version 10, CudaLayerOptions::bf16_params_in_place (caller memory): the expert parameters are
  // BF16 in the layer's layout and the bf16 recipe's GEMMs read them in place, no copy (every
  // forward then takes them: flowmoe_forward_call's params).
  int32_t bf16_params_in_place;
  // Version 10, CudaLayerOptions::bf16_params_stored (with bf16_params_in_place): the BF16
  // parameters are stored as a model keeps them (flowmoe_weights' stored sizes) and each pass
  // relays them into its transient region.
  int32_t bf16_params_stored;
  // Version 12, CudaLayerOptions::bf16_storage (with bf16_params_stored): the stored sizes H, F and
  // gate / up interleaving (0 / 1) the parameters will have, where known (all 0: not known). Where
  // the layer's grouped BF16 kernels read that storage in place, its transient region keeps no room
  // for the relay and every call must give parameters of that kind.
  int64_t stored_hidden;
  int64_t stored_ffn;
  int32_t stored_interleaved;
} flowmoe_cuda_options;
// flowmoe_layer_create_cuda with options (null: the defaults).
int flowmoe_layer_create_cuda_opts(const flowmoe_config* cfg, flowmoe_comm* comm, int device,
                                   void* stream, const flowmoe_cuda_options* options,
                                   flowmoe_layer** out);
int flowmoe_layer_destroy(flowmoe_layer* layer);  // null is allowed

// ---- configuration checks (version 8) ------------------------------------------------------------
// The library's checks of a configuration, without making a layer: nothing is allocated, no GPU is
// touched, and it works in a library built without CUDA. FLOWMOE_OK when the layer's construction
// would accept it; else FLOWMOE_ERROR with the message in flowmoe_last_error(): the text the
// construction gives for that rule (those of the C fields' names start with this function's name
// instead of the factory's), since both run the same code, where each rule is written once:
// MoeConfig::validate and check_sync_free_options (moe.h). The Python package calls it when a
// module is built.
//  ep_world: the rank count of the communicator the layer will be given (0: none, one rank holding
//  all E experts; a communicator of 1 rank is still a communicator: 1).
//  options: the CUDA layer's options (null: none), checked with the configuration whatever the
//  backend the layer is later made on; their rules that need no GPU: sync_free needs align 128 and,
//  with ep_world >= 1, a communicator with device peers, which neither of this interface's
//  communicators (host callbacks, NCCL) offers.
int flowmoe_config_check(const flowmoe_config* cfg, int ep_world, const flowmoe_cuda_options* options);
// H and F are multiples of this (moe.h kMoeSizeMultiple, 128: the FP8 tiles and weight blocks);
// callers with other sizes zero-pad to it (the Python package's flowmoe.torch.experts does).
int64_t flowmoe_config_size_multiple(void);
// Version 6 (flowmoe/expert_layout.h): expert weights stored transposed (and interleaved, unpadded)
// to the layer's layout (to_layer 1: src [E, C, L] -> dst [E, R, Cp]) or their gradients back
// (to_layer 0: dst_grad [E, R, Cp] -> grad [E, C, L]); map = {valid, stride, base0, base1, second};
// elem_bytes 2 (BF16) or 4 (FP32); device pointers, ordered on `stream` (a cudaStream_t).
int flowmoe_expert_relayout(const void* src, void* dst, int elem_bytes, int num_experts, int64_t c, int64_t l,
                            int64_t r, int64_t cp, const int64_t map[5], int to_layer, void* stream);
const char* flowmoe_layer_backend(const flowmoe_layer* layer);  // "cpu" or "cuda"
int flowmoe_layer_local_experts(const flowmoe_layer* layer);    // El

// Caller memory (moe.h MoeMemoryPlan, MoeMemory): out = {weights, saved, transient} bytes (all 0
// for a layer that owns its memory); each call takes the regions it uses (flowmoe_memory below:
// set_weights_ex weights + transient; forward, backward all three, the backward with its forward's
// weights and saved).
int flowmoe_layer_memory_plan(flowmoe_layer* layer, int64_t out[3]);
// Version 5 (moe.h MoeLayer::takes_backward_weights): *out = 1 when a backward takes the parameters
// (flowmoe_backward_call's params): the FP8 block recipes quantize their dgrad weights from them, so
// that the weights region need not be kept from the forward (pass it as null to that backward);
// a layer that reads BF16 parameters in place (flowmoe_layer_reads_params_in_place) requires them.
// Else 0.
int flowmoe_layer_takes_backward_weights(flowmoe_layer* layer, int* out);
// The caller-memory regions of one call (version 9): null where none (all null for a layer that
// owns its memory).
typedef struct flowmoe_memory {
  void* weights;
  void* saved;
  void* transient;
} flowmoe_memory;
// Version 9 (moe.h MoeWeights): the weights as one struct, with the expert weights where a model
// stores them (flowmoe/expert_layout.h ExpertStorage; gpt-oss's gate_up_proj [El, Hs, 2Fs] and
// down_proj [El, Fs, Hs]), read in place by the layers for which reads_stored_weights gives 1
// (set_weights_ex; a backward's parameters: flowmoe_backward_call's params). Version 4's BF16
// parameters (bf16 = 1, moe.h MoeWeights::w1_bf16) give the bits of FP32 masters holding the same
// values, without an FP32 copy.
typedef struct flowmoe_weights {
  const void* w1;           // [El, 2F, H], or stored [El, Hs, 2Fs]: fp32, or bf16 bits when bf16 = 1
  const void* w2;           // [El, H, F], or stored [El, Fs, Hs]
  int bf16;                 // 0: FP32 masters, 1: BF16 parameters
  const float* wr;          // [E, H] fp32 router weights (null for an external_routing layer)
  const float* router_bias; // [E] fp32 or null (set_weights only)
  int64_t stored_hidden;    // 0: the layer's layout; else Hs (<= H), with stored_ffn Fs (<= F)
  int64_t stored_ffn;
  int interleaved;          // stored gate / up alternating along 2Fs (1) or concatenated (0)
} flowmoe_weights;
// The weights of the next forwards (moe.h MoeLayer::set_weights: copies, quantized per the recipe).
// memory: a caller-memory layer's weights and transient regions (saved is not read), where the
// copies go; null or all null for a layer that owns its memory. Version 10 added memory.
int flowmoe_layer_set_weights_ex(flowmoe_layer* layer, const flowmoe_weights* w,
                                 const flowmoe_memory* memory);
// *out = 1 when the layer reads stored_hidden / stored_ffn weights of that kind (bf16: 1 BF16, 0 FP32).
int flowmoe_layer_reads_stored_weights(flowmoe_layer* layer, int bf16, int* out);
// The same for a layer of `recipe` on `backend` ("cpu" or "cuda") before one is made.
int flowmoe_recipe_reads_stored_weights(const char* recipe, const char* backend, int bf16, int* out);
// Version 9 (moe.h MoeGrads): a backward's outputs as one struct, the expert gradients optionally
// where a model stores the weights (flowmoe_backward_call below).
typedef struct flowmoe_grads {
  void* dw1;               // [El, 2F, H], or stored [El, Hs, 2Fs]: fp32, or bf16 bits when bf16 = 1; null: skipped
  void* dw2;               // [El, H, F], or stored [El, Fs, Hs]
  int bf16;                // 1: BF16 expert gradients (overwritten; accumulate must be 0)
  float* dwr;              // [E, H] fp32 or null
  float* dprobs;           // [T, k] fp32 or null (external_routing layers)
  float* db1;              // [El, 2F] fp32 or null (gemm1_bias layers)
  int accumulate;          // 1: += into the FP32 buffers, 0: overwritten
  int64_t stored_hidden;   // 0: the layer's layout; else Hs, Fs as in flowmoe_weights
  int64_t stored_ffn;
  int interleaved;
} flowmoe_grads;
// Version 9: a forward and a backward as one call each, everything a call needs in its arguments
// (memory: the caller-memory regions, all null for a layer that owns its memory).
typedef struct flowmoe_forward_call {
  const uint16_t* x;       // [tokens, H] bf16 bits
  int64_t tokens;
  uint16_t* y;             // [tokens, H]
  const int32_t* ids;      // external_routing layers: [tokens, k] int32, else null
  const float* probs;      // [tokens, k] fp32, else null
  const float* b1;         // gemm1_bias layers: [El, 2F] fp32, else null
  flowmoe_memory memory;
  // Version 10: the parameters this forward's GEMMs read in place (the layer's
  // flowmoe_layer_reads_params_in_place gives 1: then required; BF16 w1, w2 as given to
  // set_weights_ex; wr and router_bias not read), else null.
  const flowmoe_weights* params;
  // Version 11: the forward's step as its output (flowmoe_layer_step_state's bytes, the value a
  // backward takes as flowmoe_backward_call's step). With step_size non-null: *step_size = its size
  // in bytes, written to step_out when step_capacity >= that (else nothing is written: ask
  // flowmoe_layer_step_state with that size). All null / 0: no step is asked for (a CUDA layer
  // without caller memory has none: step_size must be null there).
  void* step_out;
  int64_t step_capacity;
  int64_t* step_size;
} flowmoe_forward_call;
// Version 10: *out = 1 when every forward takes the parameters (flowmoe_forward_call's params).
int flowmoe_layer_reads_params_in_place(flowmoe_layer* layer, int* out);
int flowmoe_layer_forward_call(flowmoe_layer* layer, const flowmoe_forward_call* call);
typedef struct flowmoe_backward_call {
  const uint16_t* dy;      // [tokens, H] of the forward whose state `step` holds
  uint16_t* dx;
  flowmoe_grads grads;
  const flowmoe_weights* params;  // the parameters the dgrad weights are derived from (required where
                                  // the layer reads them in place), or null: the weights region's
                                  // copies (takes_backward_weights)
  flowmoe_memory memory;          // the forward's weights (or null with params) and saved regions
  const void* step;               // step_state's bytes of that forward, or null: the step the layer
                                  // holds (its latest forward's, or the bytes a backward loaded since)
  int64_t step_bytes;
} flowmoe_backward_call;
int flowmoe_layer_backward_call(flowmoe_layer* layer, const flowmoe_backward_call* call);
// *out = 1 when the layer's backward writes expert gradients of that kind (bf16) stored so.
int flowmoe_layer_writes_stored_grads(flowmoe_layer* layer, int64_t stored_hidden, int64_t stored_ffn,
                                      int interleaved, int bf16, int* out);
// A forward's state as a value (version 7; moe.h MoeLayer::step_state): after a forward, *size =
// its host state's bytes, written to out when capacity >= *size (else nothing is written: call
// again with *size bytes; out null and capacity 0 ask the size alone). A backward takes such bytes
// as flowmoe_backward_call's step (not consumed: the same bytes may back any number of backwards;
// the CUDA layer also needs that forward's saved region).
int flowmoe_layer_step_state(flowmoe_layer* layer, void* out, int64_t capacity, int64_t* size);

typedef struct flowmoe_layer_status {
  int64_t nonfinite;  // MoeStatus
  int64_t underflow;
  float aux_loss;
} flowmoe_layer_status;
int flowmoe_layer_status_get(flowmoe_layer* layer, flowmoe_layer_status* out);

// The cast report (moe.h CastReport) as JSON (as_json 1) or as CastReport::to_string (0). *out
// points at a string owned by the layer, valid until the next call of this function on it.
int flowmoe_layer_cast_report(flowmoe_layer* layer, int as_json, const char** out);

// ---- communicators ------------------------------------------------------------------------------
// One point-to-point transfer (comm.h P2pOp).
typedef struct flowmoe_p2p {
  int32_t peer;
  void* data;
  int64_t bytes;
} flowmoe_p2p;

// A host-memory communicator whose transport is supplied by the caller (e.g. Python over
// torch.distributed with gloo): the CPU layer's expert parallelism across processes. Each callback
// returns 0 on success; on failure it calls flowmoe_set_callback_error with the reason first and
// returns non-zero (the communicator then fails with a CommError naming the reason).
typedef struct flowmoe_host_comm_ops {
  void* ctx;
  // Communicator::alltoall_i32: send[p*n + i] to rank p, recv[p*n + i] from rank p.
  int (*alltoall_i32)(void* ctx, const int32_t* send, int32_t* recv, int32_t n);
  // Communicator::exchange: every op at once; the k-th send from p to q matches the k-th recv of
  // q from p (equal sizes); ops to this rank itself are local copies.
  int (*exchange)(void* ctx, const flowmoe_p2p* sends, int32_t nsends, const flowmoe_p2p* recvs,
                  int32_t nrecvs);
  int (*barrier)(void* ctx);
} flowmoe_host_comm_ops;
int flowmoe_comm_create_host(int rank, int world_size, const flowmoe_host_comm_ops* ops,
                             double timeout_s, flowmoe_comm** out);
void flowmoe_set_callback_error(const char* message);

// NCCL (FLOWMOE_ERROR_UNSUPPORTED when not built in): rank 0 makes the 128-byte unique id, every
// rank passes it (broadcast by the caller, e.g. torch.distributed) to flowmoe_comm_create_nccl.
// device: the rank's CUDA device. timeout_s > 0: bound of initialisation and of each wait.
int flowmoe_nccl_unique_id(uint8_t out[128]);
int flowmoe_comm_create_nccl(int rank, int world_size, const uint8_t unique_id[128], int device,
                             double timeout_s, flowmoe_comm** out);
int flowmoe_comm_destroy(flowmoe_comm* comm);  // null is allowed
int flowmoe_comm_rank(const flowmoe_comm* comm);
int flowmoe_comm_world_size(const flowmoe_comm* comm);

#ifdef __cplusplus
}  // extern "C"
#endif
