// The MoE layer (issue 6; SPEC §6; docs/MOE.md): router, permute+pad, two grouped expert linears
// with SwiGLU between them, unpermute; forward and backward; five recipes selectable at run time.
// The same interface is implemented by the CPU backend (make_cpu_layer: small shapes, the readable
// reference, src/cpu/moe/) and the CUDA backend (make_cuda_layer, src/cuda/moe/).
//
// Notation: T tokens of this call, H hidden size, F expert FFN size, E experts (all experts of the
// layer; with expert parallelism El = E / ranks local experts hold weights on a rank), k = top-k,
// A = segment alignment, Mp = padded routed rows (sum over experts of round_up(count, A); with
// expert parallelism: over this rank's El experts, of the rows every rank routed to them).
// Shapes are row-major, written like `[T, H] bf16`.
//
// The computation (every recipe computes this function; they differ in the precision of each
// tensor, see below and docs/MOE.md):
//   logits  z  [T, E]  fp32  = x · Wrᵀ                         (x decoded from BF16, FP32 sums)
//   ids, p     [T, k]        = top-k router over z (softmax or sigmoid; token.h semantics)
//   for each routed pair (t, s) with expert e = ids[t, s], one row r of e's padded segment:
//     h    [2F]   = W1_e · x_t                                (GEMM1; gate = h[0:F], up = h[F:2F])
//     a'   [F]    = p[t, s] · silu(gate) ⊙ up                 (probability applied in the SwiGLU)
//     o    [H]    = W2_e · a'                                 (GEMM2)
//   y_t  [H]      = Σ_s o_(t,s)                                (unpermute: plain sum, slot order)
// The routing probability multiplies the SwiGLU output (Megatron-Core's activation with probs), not
// the unpermute: then the backward's dY is a pure permutation of the layer's dy, so `flow` can
// quantize dy once at the entry and move it in FP8, and no GEMM2 output has to be kept for dprobs
// (dp_r = <d a'_r, silu(gate) ⊙ up>, recomputed from the saved h).
//
// Weights (set_weights, FP32 masters in the backend's memory): W1 [E, 2F, H], W2 [E, H, F],
// Wr [E, H]. The layer keeps BF16 copies (RNE) of W1 and W2, and for the FP8 recipes 128x128-block
// FP8 copies quantized from the BF16 copies together with their exact transposes (for dgrad), made
// once per set_weights call (once per weight update), never per forward/backward.
//
// Gradients (backward): dx [T, H] bf16 (expert path + router path); dW1 [E, 2F, H], dW2 [E, H, F],
// dWr [E, H], all fp32 and accumulated (+=) into the caller's buffers (main gradients).
//
// Expert parallelism (MoeConfig::comm; docs/EP.md §5 CPU, §6 CUDA): R ranks, E = R*El;
// global expert g lives on rank g / El as local expert g % El. Each rank passes its own T tokens
// (T may differ between ranks) and routes them over all E experts with the same (replicated) Wr;
// the routed rows are dispatched to the experts' ranks in the recipe's wire format, the El local
// experts run on the padded rows they received (rank 0's rows first, each rank's in (token, slot)
// order), and the outputs are combined back (BF16) to the token's rank, which sums the slots in
// slot order. W1, W2 and dW1, dW2 then hold the El local experts ([El, 2F, H], [El, H, F]); Wr and
// dWr stay [E, H]: dWr is this rank's contribution (its own tokens), which a data-parallel
// all-reduce over the ranks sums like any replicated weight's gradient (the layer does not). The
// aux loss is per rank (see aux_loss_alpha). With a communicator make_cpu_layer / make_cuda_layer,
// forward and backward are collective (every rank calls them, in the same order); set_weights is
// local. The CPU backend needs a host-memory communicator (SimWorld), the CUDA backend a
// device-memory one (NCCL, or make_device_sim_world's ranks sharing one GPU).
// Results: y and dx of each rank's tokens and dW1, dW2 of each expert are the bits of one rank
// holding all E experts run on the concatenation of all ranks' tokens in rank order.
#pragma once

#include <cstdint>
#include <memory>
#include <string>
#include <vector>

#include "flowmoe/expert_layout.h"  // ExpertStorage (MoeWeights::storage)
#include "flowmoe/recipe.h"
#include "flowmoe/swiglu_math.h"
#include "flowmoe/tensor.h"
#include "flowmoe/token.h"

namespace flowmoe {

// Recipes (Recipe, recipe_name, parse_recipe, all_recipes, recipe_uses_fp8) and the recipe table
// (what each recipe moves, saves and converts, and the report names): flowmoe/recipe.h.

// Expert parallelism over a communicator (comm.h; see the top of this file). A null communicator
// means a single rank that holds all E experts.
class Communicator;

// ---- configuration ----------------------------------------------------------------------------
// H and F are multiples of this: the 1x128 FP8 tiles and 128x128 weight blocks. Callers with other
// sizes zero-pad to it (the Python package's flowmoe.torch.experts asks the C ABI for it:
// flowmoe_config_size_multiple), which leaves every real output unchanged.
constexpr int64_t kMoeSizeMultiple = 128;

// The communicator a layer is given, as the configuration checks see it (MoeConfig::validate,
// check_sync_free_options): made from a Communicator (CommShape::of), or described before any
// exists, so that a configuration can be checked without making a layer (the C ABI's
// flowmoe_config_check, which Python calls when a module is built).
struct CommShape {
  int world = 0;              // ranks; 0: no communicator (one rank holding all E experts)
  bool device_peers = false;  // its kernels reach the peers' memory (Communicator::device_peers)
  std::string backend;        // its name in messages ("sim", "nccl", ...)
  static CommShape of(Communicator* comm);  // null: world 0
};

struct MoeConfig {
  int64_t hidden = 0;       // H: positive multiple of kMoeSizeMultiple (128)
  int64_t ffn = 0;          // F (per expert): positive multiple of kMoeSizeMultiple (128)
  int num_experts = 0;      // E: 1..kRouterMaxExperts
  int topk = 0;             // k: 1..min(E, kMaxTopk)
  RouterScore router = RouterScore::kSoftmax;
  bool router_renormalize = false;  // divide the k chosen scores by their sum (token.h)
  float router_scale = 1.0f;        // multiplies the probs (DeepSeek-V3's routed_scaling_factor)
  float aux_loss_alpha = 0.0f;      // load-balancing loss coefficient; 0 = no aux loss. With
                                    // expert parallelism the statistics (f_e, P_e) are this
                                    // rank's tokens only (per-rank micro-batch loss, Megatron's
                                    // default), not all-reduced over the ranks.
  int align = 128;          // A: expert segment alignment, one of 16, 32, 64, 128
  Recipe recipe = Recipe::kFlow;
  int64_t max_tokens = 0;   // largest T of a forward call (workspaces are sized for it), >= 1
  // null: single rank, all E experts local. Otherwise expert parallelism over comm's ranks (see
  // the top of this file): CPU backend with a host-memory communicator (SimWorld), CUDA backend
  // with a device-memory one (NCCL; make_device_sim_world). E must be a multiple of the rank
  // count; every rank must pass the same configuration (compared across ranks by make_cpu_layer /
  // make_cuda_layer: CommError on every rank).
  Communicator* comm = nullptr;
  // Also compare every column-wise wgrad operand with the row-wise tensor of the same values
  // (costs a dequantize of both; for tests and the numerics report). See ColumnCheck.
  bool check_columns = false;
  // flow / flow-fp4: the exponent of each column-wise block made by the scaling-aware transpose
  // and by FP4RowToFP8Col. kRowMax is SPEC §4; kColumnAmax takes the block's own amax
  // (bit-identical to the naive power-of-two path, far less underflow on outlier tokens;
  // tensor.h, docs/NUMERICS.md §6). Both backends.
  TransposeExponent transpose_exponent = TransposeExponent::kRowMax;
  // Routing from the caller (the experts-only layer, issue 31): the caller routes (e.g. a Hugging
  // Face model's own router) and passes the chosen experts and their weights before each forward
  // (MoeLayer::set_routing); the layer has no router: no logits, no top-k, no Wr (set_weights
  // accepts wr == nullptr), no aux loss (aux_loss_alpha must be 0; router, router_renormalize,
  // router_scale are ignored). The backward returns d loss / d probs [T, k] (MoeGrads::dprobs)
  // and dx is the expert path only; dWr does not exist (MoeGrads::dwr must be null). One rank only
  // (no communicator). Given the full layer's own ids and probs, the same bits as the full layer
  // (y, dW1, dW2, dprobs).
  bool external_routing = false;
  // The experts' gated activation between GEMM1 and GEMM2 (flowmoe/swiglu_math.h): SwiGLU
  // silu(gate) * up (default) or gpt-oss's clamped SwiGLU (alpha, limit: finite, limit > 0).
  GatedActivation activation;
  // Expert biases on GEMM1's output (gpt-oss's gate_up_proj_bias; flowmoe/expert_bias.h): the
  // caller gives b1 [El, 2F] fp32 before each forward (MoeLayer::set_gemm1_bias), h = bf16(h + b1[e])
  // before the activation, and the backward returns db1 (MoeGrads::db1). GEMM2's bias is the
  // caller's (it is sum_k p_k b2[e_k] on the output: flowmoe.torch adds it). Not with fp8-naive
  // or a communicator.
  bool gemm1_bias = false;

  // Throws flowmoe::Error naming the field, its value and what is expected.
  void validate() const;
  // The same checks with the communicator described by `comm` instead of this->comm (which is
  // ignored): validate() is validate(CommShape::of(this->comm)) once the communicator reports at
  // least one rank. For checking a configuration before its communicator exists.
  void validate(const CommShape& comm) const;
  RouterConfig router_config() const;  // the token.h router configuration
  int num_local_experts() const;       // El = E / ranks (= E without a communicator)
  // Row capacity of the permuted buffers for max_tokens: routing_max_rows(max_tokens, k, E, A);
  // with a communicator of R ranks routing_max_rows(R * max_tokens, k, El, A) (every rank may
  // route all its rows to this rank's experts).
  int64_t max_rows() const;
  std::string describe() const;  // one line, e.g. "H=7168 F=2048 E=32 k=8 softmax A=128 flow"
};

// Weights: FP32 masters in the backend's memory space (host pointers for the CPU backend, device
// pointers for the CUDA backend). With expert parallelism w1 and w2 hold this rank's El local
// experts (global experts rank*El .. rank*El + El - 1), wr and router_bias all E (replicated).
// `router_bias` [E] fp32 or null: added to the scores for selection only (DeepSeek-V3's
// aux-loss-free balancing), not differentiated.
//
// BF16 parameters (e.g. a Hugging Face model loaded in bfloat16): w1_bf16 / w2_bf16 instead of
// w1 / w2 (both of one kind; the others null). The layer's BF16 copies are then the parameters'
// values themselves, so every copy and result has the bits of FP32 masters holding the same values
// (BF16 -> FP32 is exact and RNE back to BF16 returns it), with no FP32 copy and no conversion:
// the CUDA layer quantizes straight from the parameters.
struct MoeWeights {
  const float* w1 = nullptr;  // [El, 2F, H] fp32 (rows [0, F): gate, [F, 2F): up); El = E alone
  const float* w2 = nullptr;  // [El, H, F]  fp32
  const float* wr = nullptr;  // [E, H]     fp32 router
  const float* router_bias = nullptr;  // [E] fp32 or null
  const bf16_t* w1_bf16 = nullptr;  // [El, 2F, H] bf16, instead of w1
  const bf16_t* w2_bf16 = nullptr;  // [El, H, F]  bf16, instead of w2
  // W1 and W2 (either kind) as a model stores them, when not in the layout above: transposed
  // (w1 [El, Hs, 2Fs], w2 [El, Fs, Hs]), gate / up concatenated or interleaved along 2Fs, stored
  // sizes Hs <= H and Fs <= F (the rest of the layer's H, F reads as zeros; flowmoe/expert_layout.h).
  // Read in place by the CUDA layer's FP8 block recipes (blockwise, flow, flow-fp4: the weight
  // quantization reads them, no relaid copy) and, for BF16 parameters, its bf16 recipe (its BF16
  // copies written relaid), and by the CPU layer (relaid into its copies); refused elsewhere
  // (MoeLayer::reads_stored_weights). The gradients follow MoeGrads::storage (the layer's layout
  // unless it says otherwise).
  ExpertStorage storage;

  bool bf16_params() const { return w1_bf16 != nullptr || w2_bf16 != nullptr; }
};

// Gradient outputs, accumulated into (+=), same memory space as the weights. A null pointer skips
// that gradient.
struct MoeGrads {
  float* dw1 = nullptr;  // [El, 2F, H] fp32 += (the local experts; El = E on one rank)
  float* dw2 = nullptr;  // [El, H, F]  fp32 +=
  float* dwr = nullptr;  // [E, H]     fp32 += (with EP: this rank's tokens' contribution)
  // true: the gradients are added to the buffers (accumulation over micro-batches into FP32 main
  // gradients). false: the buffers receive this backward's gradients; their old contents are
  // neither read nor needed (the expert wgrads then skip reading 4 B per weight), e.g. the first
  // micro-batch of a step.
  bool accumulate = true;
  // [T, k] fp32, overwritten (never accumulated): d loss / d probs of the forward's routing, the
  // routing weights' gradient (MoeConfig::external_routing: what the caller's router back-
  // propagates). Also filled by the full layer (the probabilities its router chose; with EP this
  // rank's tokens). Last, so that MoeGrads{dw1, dw2, dwr, accumulate} keeps its meaning.
  float* dprobs = nullptr;
  // BF16 expert weight gradients (BF16 parameters), given instead of dw1 / dw2: overwritten with
  // this backward's FP32 sums rounded once (RNE) as the wgrad stores them, with no FP32 copy and no
  // rounding pass. Needs accumulate = false (a BF16 .grad is accumulated by its owner, e.g. autograd).
  bf16_t* dw1_bf16 = nullptr;  // [El, 2F, H]
  bf16_t* dw2_bf16 = nullptr;  // [El, H, F]
  // MoeConfig::gemm1_bias: d loss / d b1 [El, 2F] fp32 (+= with accumulate, else overwritten);
  // null skips it.
  float* db1 = nullptr;
  // dw1 / dw2 (either kind) where a model stores the weights, in MoeWeights::storage's layout (w1
  // [El, Hs, 2Fs], w2 [El, Fs, Hs]; the padding's gradients not written) instead of the layer's:
  // written so by the wgrad itself where MoeLayer::writes_stored_grads says it can, refused
  // elsewhere. The layer's layout (the default): hidden = 0.
  ExpertStorage storage;
  bool wants_dw1() const { return dw1 != nullptr || dw1_bf16 != nullptr; }
  bool wants_dw2() const { return dw2 != nullptr || dw2_bf16 != nullptr; }
};

// ---- accounting (CastKind, MoePass and the report names: flowmoe/recipe.h) -------------------
// One operator as executed: counted when the code runs it, never from a table.
struct CastOp {
  MoePass pass = MoePass::kForward;
  CastKind kind = CastKind::kQuantize;
  std::string name;      // what it converts, e.g. "quantize x (row 1x128, entry)"
  int64_t calls = 0;     // launches (CPU: calls of the reference operator) in the pass
  int64_t outputs = 0;   // quantized or dequantized tensors written (a row+col quantize writes 2)
  int64_t elements = 0;  // elements read
};

// One tensor held from forward to backward, with its actual size after the last forward.
struct SavedTensor {
  std::string name;    // e.g. "GEMM1 input x_perm"
  std::string format;  // e.g. "bf16 [Mp, H]", "fp8 row 1x128 [Mp, 2F]", "mxfp4 [Mp, H]"
  int64_t bytes = 0;   // codes + scales (+ padding rows, as allocated for this call)
  // The same tensor without the padding rows (routed rows only; column-wise scales counted as
  // if every segment were a whole number of 128-token blocks), divided by T: the per-token cost
  // independent of the alignment and of how the tokens fell on the experts.
  double bytes_per_token_unpadded = 0.0;
};

// For a column-wise copy consumed by wgrad: does it decode to the same numbers as the row-wise
// tensor of the same values used by the other GEMM (fprop for forward tensors, dgrad for backward
// ones)? Filled when MoeConfig::check_columns is set.
struct ColumnCheck {
  std::string name;       // e.g. "GEMM2 input a'"
  std::string method;     // "scaling-aware transpose", "quantize from BF16", "DQ->T->Q", ...
  int64_t elements = 0;   // real (unpadded) elements compared
  int64_t differ = 0;     // elements whose decoded values differ
  int64_t underflow = 0;  // underflow the conversion counted (exact paths only)
};

// One exchange of the expert-parallel layer (MoeConfig::comm set) as executed: what this rank put
// on the wire to other ranks (rows to itself are local copies, not counted). Moving rows is not a
// cast: the quantizations around it are CastOps.
struct WireTransfer {
  MoePass pass = MoePass::kForward;
  std::string name;    // "dispatch x", "combine expert output rows", "dispatch dy", ...
  std::string format;  // wire format (comm.h wire_format_name) + what travels with each row
  int64_t rows = 0;    // rows sent to other ranks
  int64_t bytes = 0;   // payload bytes sent to other ranks (codes + scales + probs)
};

struct CastReport {
  Recipe recipe = Recipe::kBf16;
  int64_t tokens = 0;        // T of the last forward
  int64_t routed_rows = 0;   // T * k routed rows (minus dropped slots) of this rank's tokens
  int64_t padded_rows = 0;   // Mp (with EP: of the rows this rank's local experts received)
  std::vector<CastOp> ops;   // weight update, then forward, then backward, in execution order
  std::vector<SavedTensor> saved;  // after the last forward
  std::vector<ColumnCheck> columns;
  // Expert parallelism: the exchanges of the last forward and backward (empty on one rank). The
  // saved tensors of an EP rank hold the rows its experts received; bytes_per_token_unpadded
  // divides them by this rank's T (averaged over the ranks: the single-rank figure).
  std::vector<WireTransfer> wire;
  QuantStats forward_stats, backward_stats;  // nonfinite and underflow seen by each pass

  // The backends' accounting: add_op counts `calls` launches of operator `name` in pass p (an
  // existing entry of the same pass, kind and name is summed into); drop_ops forgets pass p's
  // operators (a new pass of that kind starts).
  void add_op(MoePass p, CastKind k, const std::string& name, int64_t calls, int64_t outputs,
              int64_t elements);
  void drop_ops(MoePass p);

  // Operator counts per pass (launches; a kind's `calls` summed).
  int64_t count(MoePass p, CastKind k) const;
  // standalone quantize + dequantize launches of a pass: the paper's "casts"
  int64_t standalone_casts(MoePass p) const;
  int64_t saved_bytes() const;             // sum over `saved`
  double saved_bytes_per_token() const;    // saved_bytes() / tokens
  double saved_bytes_per_token_unpadded() const;  // sum of SavedTensor::bytes_per_token_unpadded
  int64_t wire_bytes(MoePass p) const;            // sum of WireTransfer::bytes of a pass
  double wire_bytes_per_token(MoePass p) const;   // wire_bytes(p) / tokens
  std::string to_string() const;           // human-readable table of ops and saved tensors
};

// Status of the current step: forward resets it, backward adds to it. Read after a pass (e.g. to
// skip a training step on non-finite values).
struct MoeStatus {
  int64_t nonfinite = 0;  // non-finite values met by quantizers, router and SwiGLU in the pass
  int64_t underflow = 0;  // values exact conversions rounded (scaling-aware transpose, FP4->FP8)
  float aux_loss = 0.0f;  // load-balancing loss of the last forward (0 when aux_loss_alpha is 0)
};

// ---- caller-owned memory ------------------------------------------------------------------
// The device memory a CUDA layer built with CudaLayerOptions::caller_memory asks its caller for,
// in bytes (MoeLayer::memory_plan; all zero for a layer that owns its memory):
//   weights    the weight copies set_weights writes and forward / backward read (per weight update)
//   saved      what a forward saves for its backward (per forward in flight; its backward may use
//              it as scratch)
//   transient  scratch of one call (set_weights, forward or backward), free once the call's work
//              on the layer's stream is done; its contents never carry over
struct MoeMemoryPlan {
  int64_t weights = 0, saved = 0, transient = 0;
};
// Device addresses of the three regions (each 256-byte aligned, at least the planned size). The
// contents of `weights` and `saved` are position-independent: a region may move between calls
// (e.g. offloaded to the host and brought back) as long as its bytes are unchanged.
struct MoeMemory {
  void* weights = nullptr;
  void* saved = nullptr;
  void* transient = nullptr;
};

// ---- the layer --------------------------------------------------------------------------------
// Call order: set_weights (after construction and after every weight update), then any number of
// (forward, backward) pairs; backward uses what the latest forward saved and takes the same T.
// Several forwards in flight, or several backwards of one forward: step_state() after a forward
// gives its host state as bytes, load_step(bytes) before a backward puts it back (any order, any
// number of times; with the CUDA layer this needs caller memory, each forward with its own saved
// region).
// Not thread-safe. The CUDA backend allocates its workspaces at construction for cfg.max_tokens
// (steady-state calls allocate nothing) or, with CudaLayerOptions::caller_memory, uses the memory
// bound by bind_memory; the CPU reference allocates per call.
class MoeLayer {
 public:
  virtual ~MoeLayer() = default;
  MoeLayer(const MoeLayer&) = delete;
  MoeLayer& operator=(const MoeLayer&) = delete;

  const MoeConfig& config() const { return cfg_; }
  virtual const char* backend() const = 0;  // "cpu" or "cuda"

  // Copies the masters to BF16 (or takes BF16 parameters as they are) and (FP8 recipes) quantizes
  // them: W1, W2 as 128x128 blocks plus exact transposes. Refuses non-finite weights. Counted as MoePass::kWeightUpdate operators in the report.
  virtual void set_weights(const MoeWeights& w) = 0;

  // MoeConfig::external_routing: the routing of the next forward (and only that one), chosen by
  // the caller: ids [T, k] int32 expert ids in [0, E) (-1: slot dropped), probs [T, k] fp32 their
  // weights (multiplying the SwiGLU output, as the router's probabilities do); T that forward's
  // tokens. Host pointers for the CPU layer, device pointers (read in stream order) for the CUDA
  // layer; they must stay valid until that forward returns (it copies them). A layer with its own
  // router refuses it.
  void set_routing(const int32_t* ids, const float* probs);
  // MoeConfig::gemm1_bias: b1 [El, 2F] fp32 of the next forward (and only that one), in the
  // weights' memory space; read by that forward (the CPU layer copies it at the forward, the CUDA
  // layer reads it in stream order: keep it valid until the forward's work is done).
  void set_gemm1_bias(const float* b1);

  // x [T, H] bf16 -> y [T, H] bf16, 1 <= T <= max_tokens. Saves what backward needs in the
  // recipe's precision.
  virtual void forward(const bf16_t* x, int64_t tokens, bf16_t* y) = 0;

  // dy [T, H] bf16 (T of the last forward) -> dx [T, H] bf16 (overwritten); accumulates the
  // weight gradients into `grads`. Includes the router path (dlogits · Wr) and, when enabled, the
  // aux loss gradient (d total / d aux = 1).
  virtual void backward(const bf16_t* dy, bf16_t* dx, const MoeGrads& grads) = 0;

  // Operators executed by the last set_weights / forward / backward and the tensors saved by the
  // last forward. (The CUDA backend may synchronise to fill it.)
  virtual const CastReport& cast_report() const = 0;
  double saved_bytes_per_token() const { return cast_report().saved_bytes_per_token(); }
  virtual MoeStatus status() const = 0;

  // The state of a forward as a value. After a forward: what its backward needs on the host, as
  // bytes (CUDA: the routing's row counts and segments and the EP plan, a few KB, the device state
  // being in the caller's saved region; CPU: the whole saved state, routing, activations and the
  // weight copies the forward used). They start with the backend and the layer's shape. Before a
  // backward: load_step puts such bytes back, so that the backward backs that forward (with the
  // CUDA layer, bind the saved region that forward used). The bytes are not consumed: the same
  // bytes may back any number of backwards (PyTorch's retain_graph), in any order. Refused, with
  // what was expected, for bytes of another backend or layer shape and truncated bytes.
  virtual std::vector<uint8_t> step_state() const = 0;
  virtual void load_step(const uint8_t* bytes, size_t size) = 0;

  // Caller-owned memory (CUDA layer with CudaLayerOptions::caller_memory): the sizes to provide,
  // and the regions the next calls use (set_weights: weights + transient; forward and backward:
  // all three, the backward with its forward's weights and saved bytes). Others: a plan of zeros,
  // and bind_memory accepts only null addresses.
  virtual MoeMemoryPlan memory_plan() const { return MoeMemoryPlan(); }
  virtual void bind_memory(const MoeMemory& memory);

  // Caller memory: whether the next backward takes the parameters (set_backward_weights), so that
  // the weights region need not outlive its forward: the CUDA layer of the recipes with FP8 block
  // weights (blockwise, flow, flow-fp4) derives its dgrad weights W^T from them, and a layer that
  // reads BF16 parameters in place (reads_params_in_place) requires them.
  virtual bool takes_backward_weights() const { return false; }
  // The parameters of the next backward only, as in set_weights (W1, W2 FP32 or BF16; Wr exactly
  // when the layer has a router; router_bias not read): the FP8 block recipes quantize W^T from them
  // into the transient region (the bits of transposing the forward's W, which they must equal: the
  // caller keeps them unchanged in between), bf16 in place reads (or relays) them; Wr is read there,
  // and nothing of the weights region, which may then be unbound (null). Refused where
  // takes_backward_weights() is false.
  virtual void set_backward_weights(const MoeWeights& w);
  // Whether each forward reads the BF16 expert parameters in place (CudaLayerOptions::
  // bf16_params_in_place on the bf16 recipe; with bf16_params_stored relaid per pass): set_weights
  // only checks them (no copy), and every forward takes them (set_forward_weights), as every
  // backward does (set_backward_weights).
  virtual bool reads_params_in_place() const { return false; }
  // The parameters of the next forward only, as given to set_weights (BF16 W1, W2 in the layer's
  // layout, or stored with bf16_params_stored; Wr and router_bias not read): its GEMMs read them
  // where they are (or their relaid copies), so the caller keeps them unchanged until the forward's
  // work is done. Refused where reads_params_in_place() is false.
  virtual void set_forward_weights(const MoeWeights& w);
  // Whether set_weights and set_backward_weights read W1, W2 where a model stores them
  // (MoeWeights::storage not the layer's layout), FP32 masters or (bf16_params) BF16 parameters.
  virtual bool reads_stored_weights(bool /*bf16_params*/) const { return false; }
  // Whether the backward writes dW1 and dW2 (BF16 with bf16_grads, else FP32) in `storage`'s layout
  // (MoeGrads::storage): the CPU layer always (the reference maps them), the CUDA layer of the FP8
  // block recipes and of bf16 on its grouped kernels (CudaLayerOptions::fprop_dgrad kGrouped or
  // sync_free), with align 128 (the wgrad kernels write them; the stored rows a multiple of 16
  // bytes, and gate / up either interleaved or concatenated without padding between them).
  virtual bool writes_stored_grads(const ExpertStorage& storage, bool /*bf16_grads*/) const {
    return storage.is_layer_layout();
  }
  // What reads_stored_weights(bf16_params) gives for the layer of `backend` ("cpu", "cuda") and
  // `recipe`, before one is made: the CPU layer always (it relays them into its own copies), the
  // CUDA layer of the FP8 block recipes (blockwise, flow, flow-fp4) and of bf16 with BF16
  // parameters (its copies relaid from them).
  static bool reads_stored_weights(const std::string& backend, Recipe recipe, bool bf16_params);

 protected:
  explicit MoeLayer(const MoeConfig& cfg) : cfg_(cfg) {}
  // The routing given by set_routing for the next forward: returned and forgotten (throws when
  // external_routing and none was given).
  struct RoutingInput {
    const int32_t* ids = nullptr;
    const float* probs = nullptr;
  };
  RoutingInput take_routing(const char* what);
  // The bias given by set_gemm1_bias, returned and forgotten (null without gemm1_bias; throws when
  // gemm1_bias and none was given).
  const float* take_gemm1_bias(const char* what);
  // set_weights' pointer checks, both backends: W1 and W2 given once each, both FP32 or both BF16,
  // stored only where the layer reads them so; Wr given exactly when the layer has a router,
  // router_bias only then (experts_only: neither, whatever the layer). `space`: "host" or
  // "device", `what`: the caller, for the message.
  void check_weights(const MoeWeights& w, const char* space, const char* what = "MoeLayer::set_weights",
                     bool experts_only = false) const;
  // backward's gradient checks, both backends: each expert gradient FP32 or BF16 (not both), BF16
  // ones only when overwriting, dwr only with a router.
  void check_grads(const MoeGrads& g) const;
  MoeConfig cfg_;
  RoutingInput routing_input_;
  const float* gemm1_bias_input_ = nullptr;
};

// The CPU backend (host pointers everywhere). Validates cfg; throws flowmoe::Error.
std::unique_ptr<MoeLayer> make_cpu_layer(const MoeConfig& cfg);

// The rules of the CUDA layer's options that depend on the configuration and the communicator
// alone (CudaLayerOptions::sync_free: align 128; with expert parallelism a communicator with
// device peers, and the layer's own memory rather than caller_memory). Host code in every build,
// written once: make_cuda_layer runs it, and so does the C ABI's flowmoe_config_check, also in a
// library built without CUDA. Nothing is checked when sync_free is false. Throws flowmoe::Error
// whose message starts with `what`.
void check_sync_free_options(const char* what, const MoeConfig& cfg, const CommShape& comm, bool sync_free,
                             bool caller_memory);
// The rules of CudaLayerOptions::bf16_params_in_place / bf16_params_stored / bf16_storage (host
// code, shared by make_cuda_layer and the C ABI's flowmoe_config_check): in place needs
// caller_memory, stored needs in place, a storage needs stored and positive sizes. Throws
// flowmoe::Error whose message starts with `what`.
void check_param_options(const char* what, bool caller_memory, bool bf16_params_in_place, bool bf16_params_stored,
                         const ExpertStorage& bf16_storage = ExpertStorage());
// The activation of kActivations (swiglu_math.h) named `name` with alpha / limit where it takes
// them; throws flowmoe::Error naming `what` and the known names otherwise.
GatedActivation activation_from_name(const std::string& name, float alpha, float limit, const char* what);
// kActivations' name of `kind`, or null for a kind without a row.
const char* activation_name(ActivationKind kind);

}  // namespace flowmoe

// ---- CUDA backend (src/cuda/moe/): declared when the CUDA backend is built (linking flowmoe_cuda
// defines FLOWMOE_HAVE_CUDA), like the other CUDA declarations of the public headers.
#if defined(FLOWMOE_HAVE_CUDA)
#include "flowmoe/gemm.h"
typedef struct CUstream_st* cudaStream_t;  // the CUDA runtime's typedef, as in gemm.h
namespace flowmoe {
// How the CUDA layer runs: streams and message layout. No option changes an output bit (the GPU
// tests compare each choice with the default). The library reads no environment variable; the
// CLI, the benches and the tests map their flags and variables to these fields.
struct CudaLayerOptions {
  // flow / flow-fp4: the wgrad column copies (scaling-aware transposes, FP4RowToFP8Col) run on a
  // side stream next to the GEMMs that do not need them; false: inline on the layer's stream.
  bool side_stream = true;
  // One GPU: the backward's tail (router backward, dWr, dx = unpermute + router path) runs on its
  // own highest-priority stream next to GEMM1 wgrad; false: after it, on the layer's stream.
  bool tail_stream = true;
  // flow / flow-fp4 on one GPU: GEMM1's wgrad runs before its dgrad, so that the dgrad writes the dX
  // rows (BF16 [Mp, H]) into the storage of the two FP8 column copies the wgrad has just read: the
  // layer's scratch holds no dX-rows buffer of its own (2 bytes per row and hidden feature less; the
  // forward's GEMM2 output rows live there too). The backward's tail then follows GEMM1's dgrad with
  // nothing left to overlap. false: dgrad first, the dX rows in a buffer of their own, and the tail
  // next to the wgrad (tail_stream).
  bool dx_rows_in_column_copies = true;
  // Expert parallelism (MoeConfig::comm): the deduplicated dispatch, each token sent once to each
  // rank holding one of its experts (not used by fp8-naive); false: every (token, expert) row
  // travels, as in the CPU layer's exchange. Every rank must pass the same value (make_cuda_layer
  // checks it collectively).
  bool ep_dedup = true;
  // Expert parallelism: expert chunks of at least this many bytes travel as their own message
  // (comm.h dispatch_rows; -1: kEpDirectBytes, one message per peer and stream). Every rank must
  // pass the same value (checked with ep_dedup).
  int64_t ep_direct_bytes = -1;
  // Who runs the FP8 fprop and dgrad of every FP8 recipe. kGrouped: flowmoe's grouped sm_90a kernel,
  // one launch per GEMM over all local experts, the expert offsets read on the device, the row-wise
  // UE8M0 scales read as quantization wrote them (gemm.h, DeviceSegments); kCublasLt: one cuBLASLt
  // matmul per expert (the options below); kAuto: the kernel where it measured faster on the H200,
  // i.e. at most kGroupedAutoRows rows per local expert on average at the layer's token capacity
  // (docs/GEMM.md, "The grouped kernels"). Both give the same bits on the layer's tests (the kernel
  // promotes every 128-wide block as cuBLASLt does). Recipe bf16: kGrouped runs its fprop, dgrad
  // and (align 128) wgrad on flowmoe's sm_90a BF16 kernels, whose FP32 sums run in another order
  // than cuBLASLt's (within tolerance, not the same bits); kAuto keeps cuBLASLt.
  enum class FpropDgrad : uint8_t { kAuto, kGrouped, kCublasLt };
  static constexpr int64_t kGroupedAutoRows = 1024;
  FpropDgrad fprop_dgrad = FpropDgrad::kAuto;
  // No host synchronisation in forward and backward, so that a CUDA graph can capture a whole step
  // (flowmoe/cuda/moe_graph.h). The per-expert counts stay on the device: every launch covers the
  // workspaces' row capacity max_rows() and reads the rows in use there (the GEMMs are the grouped
  // kernels on device offsets, the row-wise kernels take the device row count), and the cast
  // report's row counts are resolved when it is read (cast_report(), status(): one synchronisation
  // there). Same bits as the default (bf16: as fprop_dgrad = kGrouped, its GEMMs being the BF16
  // kernels). set_weights does not synchronise either (it can be captured
  // too): instead of throwing NonFiniteError, it counts the non-finite weights, which status()
  // adds to its nonfinite count from the next forward on (until the next set_weights). Every
  // recipe, align 128 (the wgrad kernels' token blocks). With expert parallelism the communicator
  // must offer device-side peer access (Communicator::device_peers: make_device_sim_world's ranks
  // today, not NCCL): every rank's counts are read on the device, the plan is made there and the
  // rows are pulled from the peers' buffers between device barriers (docs/EP.md §8); the same bits
  // as the synchronous exchange. make_cuda_layer rejects anything else (check_sync_free_options,
  // above: host code, which the C ABI's flowmoe_config_check runs too).
  bool sync_free = false;
  // flow / flow-fp4 with the grouped kernel running GEMM1 (fprop_dgrad above): SwiGLU*prob and the
  // quantizations of a' and the saved h run in GEMM1's epilogue (GroupedGemm::fprop_swiglu; W1
  // kept with its gate/up blocks interleaved), so h in BF16 is never written or read back; false:
  // GEMM1 writes h in BF16 and a separate SwiGLU kernel quantizes it. Same bits either way. Off by
  // default: the fused epilogue does not overlap the tensor-core work and measured slower than the
  // two kernels as a GEMM (the layer's step within +-2%); on, the layer holds no BF16 h buffer
  // ([Mp, 2F], 0.53 GiB at v3-ep8) (docs/EPILOGUES.md §1).
  bool fused_swiglu = false;
  // flow / flow-fp4 with the grouped kernel running GEMM2's dgrad (fprop_dgrad above): dSwiGLU*prob,
  // dh's row-wise and column-wise quantizations and dp's partial sums run in GEMM2-dgrad's epilogue
  // (GroupedGemm::dgrad_dswiglu), so da' in BF16 is never written or read back; false: the dgrad
  // writes da' in BF16 and a separate dSwiGLU kernel quantizes dh. Same bits either way. Off by
  // default: measured slower (the step 2-6% longer; docs/EPILOGUES.md §2). With
  // both epilogues on, the layer holds neither BF16 h nor da' (0.26 GiB less at v3-ep8).
  bool fused_dswiglu = false;
  // Caller memory (the PyTorch op): the FP8 dgrad weights W^T are made in each backward, a group of
  // experts at a time just before that group's dgrad, in a scratch buffer of at most this many bytes
  // (codes; at least one expert), so that W^T of all experts never exists at once. 0: all experts
  // at once. No effect on the bits (GPU test Routed.CallerMemoryBackwardWeightsFromParams...).
  int64_t dgrad_weight_chunk_bytes = int64_t(128) << 20;
  // The weight copies, saved activations and scratch come from the caller (MoeLayer::memory_plan,
  // bind_memory) instead of the layer's own allocations: the PyTorch op takes them from PyTorch's
  // caching allocator, so the scratch is shared by every layer and the saved bytes live as long as
  // autograd keeps them. The layer keeps only its counters, pinned host words and the GEMM
  // workspace. The FP8 recipes' weights region then holds W alone: each backward makes the dgrad
  // weights W^T in its transient region, transposed from W (exact, gemm.h transpose_weight_blocks)
  // or quantized from the parameters (MoeLayer::set_backward_weights, when the weights region is
  // not kept), so a forward in flight keeps 1 byte per expert parameter, or none, instead of 2. Needed for several
  // forwards in flight (take_step). Not with expert parallelism
  // without host synchronisation (its buffers are shared with the peers once, at construction)
  // nor with LayerStepGraph (which captures the layer's own addresses). Same bits as the default.
  bool caller_memory = false;
  // Caller memory, recipe bf16: the caller's expert parameters are BF16 in the layer's layout
  // (MoeWeights::w1_bf16 / w2_bf16, ExpertStorage of the layer), and the BF16 GEMMs read them in
  // place: the weights region holds no BF16 copy of them (2 bytes per expert parameter less, kept
  // from a forward to its backward) and set_weights, instead of copying them, reads them once to
  // count their non-finite values. Every forward and backward then takes the parameters
  // (set_forward_weights, set_backward_weights); set_weights refuses FP32 masters and stored
  // layouts. Other recipes: no effect (the FP8 recipes quantize straight from the parameters
  // already). Same bits as the copies.
  bool bf16_params_in_place = false;
  // With bf16_params_in_place: the BF16 parameters are stored as a model keeps them instead
  // (MoeWeights::storage not the layer's layout, e.g. gpt-oss's transposed, interleaved experts),
  // which the GEMMs do not read; each forward and each backward relays them into BF16 copies in
  // its transient region (shared by every layer, gone with the call), so the weights region still
  // holds none and a forward in flight keeps nothing of the weights (the copy of set_weights kept 2
  // bytes per expert parameter until the backward). Costs one relay per pass instead of one per
  // weight update. set_weights then refuses the layer's layout. Same bits as the copies.
  bool bf16_params_stored = false;
  // With bf16_params_stored: the storage the parameters will have, where known at construction
  // (default: not known). Where flowmoe's grouped BF16 kernels read it in place (sync_free or
  // fprop_dgrad kGrouped, align 128, one GPU; gate / up interleaved or concatenated without padding,
  // stored rows of 16-byte multiples: H % 8 == 0, F % 4 == 0) no pass relays them, so the
  // transient region keeps no room for the relay (2 bytes per expert parameter), and every call
  // must then give parameters of this storage with 16-byte-aligned bases.
  ExpertStorage bf16_storage;
  // The grouped GEMMs' options (gemm.h): cuBLASLt per expert (BF16, wgrad, grouped_gemm off) and
  // the wgrad kernel's choice.
  gemm::GroupedGemmOptions gemm;
  // Priority steps of the matmul streams above the default (0..gemm::kMaxPoolPriority). -1: the
  // layer's choice, 1 with the side stream (the copies fill the GEMMs' gaps instead of taking SMs
  // from them) and gemm.pool_priority without it.
  int gemm_pool_priority = -1;
};
// Device pointers for x, y, dy, dx, weights and gradients; everything is ordered on `stream`.
// Validates cfg and options; throws flowmoe::Error.
std::unique_ptr<MoeLayer> make_cuda_layer(const MoeConfig& cfg, cudaStream_t stream,
                                          const CudaLayerOptions& options = CudaLayerOptions());
}  // namespace flowmoe
#endif
