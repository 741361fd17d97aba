// The backend-independent part of the MoE layer (include/flowmoe/moe.h): configuration checks (the
// one place of each rule: MoeConfig::validate, and check_sync_free_options for the CUDA layer's
// options, which the C ABI's flowmoe_config_check also runs without making a layer) and the cast /
// saved-bytes report. The recipes and their table: src/common/recipe.cpp.
#include <algorithm>
#include <cmath>
#include <cstdio>
#include <cstring>
#include <sstream>

#include "flowmoe/comm.h"
#include "flowmoe/error.h"
#include "flowmoe/moe.h"
#include "common/moe_ep.h"

namespace flowmoe {

// ---- caller memory (only CudaLayerOptions::caller_memory layers take any) ------------------------
void MoeLayer::bind_memory(const MoeMemory& m) {
  FLOWMOE_CHECK(m.weights == nullptr && m.saved == nullptr && m.transient == nullptr,
                "MoeLayer::bind_memory: this " << backend()
                    << " layer owns its memory (memory_plan() is all zero); expected null regions "
                       "(only a CUDA layer built with CudaLayerOptions::caller_memory takes memory)");
}

void MoeLayer::set_backward_weights(const MoeWeights&) {
  FLOWMOE_CHECK(false, "MoeLayer::set_backward_weights: this " << backend() << " layer does not derive its backward's "
                                                                  "weights from the parameters "
                                                                  "(takes_backward_weights() is false); expected "
                                                                  "the weights region bound for its backward instead");
}

void MoeLayer::set_forward_weights(const MoeWeights&) {
  FLOWMOE_CHECK(false, "MoeLayer::set_forward_weights: this " << backend() << " layer reads its forward's weights "
                                                                 "from the weights region (reads_params_in_place() "
                                                                 "is false); expected no parameters with the forward");
}

// ---- routing from the caller (MoeConfig::external_routing) --------------------------------------
void MoeLayer::set_routing(const int32_t* ids, const float* probs) {
  FLOWMOE_CHECK(cfg_.external_routing,
                "MoeLayer::set_routing: this layer routes with its own router; expected a layer "
                "configured with MoeConfig::external_routing");
  FLOWMOE_CHECK(ids != nullptr && probs != nullptr,
                "MoeLayer::set_routing: null ids or probs; expected ids [T, k] int32 and probs "
                "[T, k] fp32 in the layer's memory space");
  routing_input_.ids = ids;
  routing_input_.probs = probs;
}

MoeLayer::RoutingInput MoeLayer::take_routing(const char* what) {
  RoutingInput r = routing_input_;
  routing_input_ = RoutingInput();
  FLOWMOE_CHECK(!cfg_.external_routing || (r.ids != nullptr && r.probs != nullptr),
                what << ": no routing for this forward; the layer takes its routing from the caller "
                        "(MoeConfig::external_routing): call set_routing(ids, probs) before each forward");
  return r;
}

// ---- GEMM1's bias (MoeConfig::gemm1_bias) ---------------------------------------------------------
void MoeLayer::set_gemm1_bias(const float* b1) {
  FLOWMOE_CHECK(cfg_.gemm1_bias, "MoeLayer::set_gemm1_bias: this layer's experts have no bias; expected a layer "
                                 "configured with MoeConfig::gemm1_bias");
  FLOWMOE_CHECK(b1 != nullptr, "MoeLayer::set_gemm1_bias: null b1; expected b1 [El, 2F] fp32 in the layer's "
                               "memory space");
  gemm1_bias_input_ = b1;
}

const float* MoeLayer::take_gemm1_bias(const char* what) {
  const float* b = gemm1_bias_input_;
  gemm1_bias_input_ = nullptr;
  FLOWMOE_CHECK(!cfg_.gemm1_bias || b != nullptr,
                what << ": no GEMM1 bias for this forward; the layer's experts have one (MoeConfig::gemm1_bias): "
                        "call set_gemm1_bias(b1) before each forward");
  return b;
}

// ---- gradients ----------------------------------------------------------------------------------
void MoeLayer::check_grads(const MoeGrads& g) const {
  const char* what = "MoeLayer::backward";
  FLOWMOE_CHECK(writes_stored_grads(g.storage, g.dw1_bf16 != nullptr || g.dw2_bf16 != nullptr),
                what << ": dW1 / dW2 asked in a model's stored layout (MoeGrads::storage: H " << g.storage.hidden
                     << ", F " << g.storage.ffn << (g.storage.interleaved ? ", interleaved" : "") << "), which this "
                     << backend() << " layer (" << cfg_.describe()
                     << ") does not write (MoeLayer::writes_stored_grads); expected the layer's layout");
  FLOWMOE_CHECK(!(g.dw1 && g.dw1_bf16) && !(g.dw2 && g.dw2_bf16),
                what << ": dW1 or dW2 given both as FP32 and as BF16; expected one buffer per gradient");
  FLOWMOE_CHECK(!(g.accumulate && (g.dw1_bf16 || g.dw2_bf16)),
                what << ": BF16 expert gradients with accumulate = true; BF16 gradients are overwritten "
                        "(accumulate = false), FP32 ones may be accumulated into");
  FLOWMOE_CHECK(!g.db1 || cfg_.gemm1_bias,
                what << ": db1 given to a layer without GEMM1 biases (MoeConfig::gemm1_bias); expected null");
  FLOWMOE_CHECK(!(cfg_.external_routing && g.dwr),
                what << ": dwr given to a layer without a router (MoeConfig::external_routing); "
                        "expected null (the routing weights' gradient goes to dprobs)");
}

// ---- weights ------------------------------------------------------------------------------------
bool MoeLayer::reads_stored_weights(const std::string& backend, Recipe recipe, bool bf16_params) {
  if (backend == "cpu") return true;  // (the reference relays them into its own copies)
  const WeightCopy copy = recipe_spec(recipe).weights;
  return backend == "cuda" && (copy == WeightCopy::kFp8Block || (copy == WeightCopy::kBf16Only && bf16_params));
}

void MoeLayer::check_weights(const MoeWeights& w, const char* space, const char* what, bool experts_only) const {
  const bool router = !cfg_.external_routing && !experts_only;
  const int el = cfg_.num_local_experts();
  FLOWMOE_CHECK(!(w.w1 && w.w1_bf16) && !(w.w2 && w.w2_bf16),
                what << ": W1 or W2 given both as FP32 masters and as BF16 parameters; expected one of "
                        "w1 / w1_bf16 and one of w2 / w2_bf16");
  FLOWMOE_CHECK((w.w1 && w.w2) || (w.w1_bf16 && w.w2_bf16),
                what << ": W1 and W2 must be non-null " << space << " pointers of one kind: w1 [El, 2F, H] "
                     << "and w2 [El, H, F] fp32, or w1_bf16 and w2_bf16 bf16 (El = " << el
                     << " local experts, H = " << cfg_.hidden << ", F = " << cfg_.ffn << ")");
  FLOWMOE_CHECK(w.wr || !router, what << ": wr is null; expected a " << space << " pointer to Wr [E, H] fp32");
  FLOWMOE_CHECK(router || (w.wr == nullptr && w.router_bias == nullptr),
                what << (experts_only ? ": wr or router_bias given; this call reads the expert weights only"
                                      : ": wr or router_bias given to a layer without a router "
                                        "(MoeConfig::external_routing: the caller routes)")
                     << "; expected null");
  const ExpertStorage& st = w.storage;
  if (st.is_layer_layout()) return;
  FLOWMOE_CHECK(reads_stored_weights(w.bf16_params()),
                what << ": W1 and W2 given as a model stores them (MoeWeights::storage: transposed, H "
                     << st.hidden << ", F " << st.ffn << ", " << (w.bf16_params() ? "BF16" : "FP32") << "); this "
                     << backend() << " layer (" << cfg_.describe()
                     << ") reads only its own layout, w1 [El, 2F, H] and w2 [El, H, F]: relay them first "
                        "(flowmoe/expert_layout.h). The CUDA layer of the FP8 block recipes (blockwise, flow, "
                        "flow-fp4), and of bf16 with BF16 parameters, reads them in place");
  FLOWMOE_CHECK(st.hidden >= 1 && st.hidden <= cfg_.hidden && st.ffn >= 1 && st.ffn <= cfg_.ffn,
                what << ": stored sizes H " << st.hidden << ", F " << st.ffn << " (MoeWeights::storage); expected "
                     << "1 <= H <= " << cfg_.hidden << " and 1 <= F <= " << cfg_.ffn
                     << " (the layer's sizes; the rest reads as zeros)");
}

// ---- configuration ------------------------------------------------------------------------------
namespace {

// " such as 128 or 256 (the nearest)" for a positive size that is not a multiple of
// kMoeSizeMultiple ("" otherwise): what to change it to, in the message that refuses it.
std::string nearest_multiples(int64_t v) {
  if (v <= 0 || v % kMoeSizeMultiple == 0) return "";
  const int64_t lower = v / kMoeSizeMultiple * kMoeSizeMultiple, upper = lower + kMoeSizeMultiple;
  std::ostringstream os;
  os << " such as ";
  if (lower > 0) os << lower << " or ";
  os << upper << " (the nearest)";
  return os.str();
}

// The recipes a rule leaves, from the recipe table ("bf16, blockwise, flow, flow-fp4"), so that
// a message naming them follows the table.
std::string recipes_except(Recipe excluded) {
  std::string s;
  for (Recipe r : all_recipes())
    if (r != excluded) s += (s.empty() ? "" : ", ") + std::string(recipe_name(r));
  return s;
}

// MoeConfig::max_rows over a communicator of `world` ranks (0: none).
int64_t max_rows_over(const MoeConfig& c, int world) {
  if (world == 0) return routing_max_rows(c.max_tokens, c.topk, c.num_experts, c.align);
  // Expert parallelism: every rank (same max_tokens, checked across ranks by the layer) may send
  // all its routed rows to this rank's El experts.
  return routing_max_rows(int64_t(world) * c.max_tokens, c.topk, c.num_experts / world, c.align);
}

}  // namespace

CommShape CommShape::of(Communicator* comm) {
  CommShape s;
  if (comm == nullptr) return s;
  s.world = comm->world_size();
  s.device_peers = comm->device_peers() != nullptr;
  s.backend = comm->backend();
  return s;
}

void MoeConfig::validate() const {
  if (comm != nullptr) {
    const int world = comm->world_size();
    FLOWMOE_CHECK(world >= 1, "MoeConfig: the communicator reports " << world << " ranks");
  }
  validate(CommShape::of(comm));
}

void MoeConfig::validate(const CommShape& shape) const {
  const char* what = "MoeConfig";
  const int64_t m = kMoeSizeMultiple;
  FLOWMOE_CHECK(hidden > 0 && hidden % m == 0,
                what << ": hidden H = " << hidden << " is not a positive multiple of " << m
                     << " (1x128 FP8 tiles and 128x128 weight blocks); expected H % " << m << " == 0"
                     << (hidden > 0 ? nearest_multiples(hidden) : std::string(", e.g. 2048, 5120 or 7168")));
  FLOWMOE_CHECK(ffn > 0 && ffn % m == 0,
                what << ": ffn F = " << ffn << " is not a positive multiple of " << m
                     << " (the SwiGLU tiles and 128x128 weight blocks); expected F % " << m << " == 0"
                     << (ffn > 0 ? nearest_multiples(ffn) : std::string(", e.g. 1408 or 2048")));
  FLOWMOE_CHECK(num_experts >= 1 && num_experts <= kRouterMaxExperts,
                what << ": num_experts E = " << num_experts << " out of range; expected 1 <= E <= "
                     << kRouterMaxExperts << " (the router kernels' limit: one warp per token)");
  FLOWMOE_CHECK(topk >= 1 && topk <= kMaxTopk,
                what << ": top_k k = " << topk << " out of range; expected 1 <= k <= " << kMaxTopk
                     << " (one lane per routing slot)");
  FLOWMOE_CHECK(topk <= num_experts, what << ": top_k k = " << topk << " exceeds num_experts E = "
                                          << num_experts
                                          << "; expected k <= E (each token picks k distinct experts)");
  FLOWMOE_CHECK(router == RouterScore::kSoftmax || router == RouterScore::kSigmoid,
                what << ": router score " << static_cast<int>(router)
                     << " unknown; expected softmax or sigmoid");
  FLOWMOE_CHECK(std::isfinite(router_scale) && router_scale > 0.0f,
                what << ": router_scale = " << router_scale << "; expected a finite value > 0");
  FLOWMOE_CHECK(std::isfinite(aux_loss_alpha) && aux_loss_alpha >= 0.0f,
                what << ": aux_loss_alpha = " << aux_loss_alpha
                     << "; expected a finite value >= 0 (0 disables the aux loss)");
  FLOWMOE_CHECK(align == 16 || align == 32 || align == 64 || align == 128,
                what << ": align A = " << align
                     << " not supported; expected 16, 32, 64 or 128 (expert segments are padded to "
                        "A rows; the FP8 wgrad needs multiples of 16)");
  FLOWMOE_CHECK(try_parse_recipe(recipe_name(recipe), nullptr),
                what << ": recipe " << static_cast<int>(recipe)
                     << " unknown; expected one of: " << recipe_names(", "));
  FLOWMOE_CHECK(max_tokens >= 1, what << ": max_tokens = " << max_tokens
                                      << "; expected the largest T of a forward call, >= 1");
  const int world = shape.world;
  FLOWMOE_CHECK(world >= 0, what << ": a communicator of " << world << " ranks; expected 0 (none) or more");
  if (world >= 1) {
    FLOWMOE_CHECK(num_experts % world == 0,
                  what << ": num_experts E = " << num_experts << " is not divisible by the "
                       << world << " ranks of the communicator; expert parallelism splits the "
                          "experts evenly (El = E / ranks local experts per rank), so E must be a "
                          "multiple of "
                       << world);
  }
  if (external_routing) {
    FLOWMOE_CHECK(aux_loss_alpha == 0.0f,
                  what << ": aux_loss_alpha = " << aux_loss_alpha
                       << " with external_routing: the layer has no router (the caller routes), so "
                          "no load-balancing loss; expected 0 (the caller's router adds its own)");
    FLOWMOE_CHECK(world == 0, what << ": external_routing with a communicator (expert "
                                      "parallelism) is not supported; expected one rank");
  }
  if (activation.clamped())
    FLOWMOE_CHECK(std::isfinite(activation.alpha) && std::isfinite(activation.limit) && activation.limit > 0.0f,
                  what << ": clamped SwiGLU with alpha = " << activation.alpha << ", limit = " << activation.limit
                       << "; expected finite values and limit > 0 (gpt-oss: alpha 1.702, limit 7)");
  FLOWMOE_CHECK(activation_name(activation.kind) != nullptr,
                what << ": activation " << static_cast<int>(activation.kind)
                     << " unknown; expected a kind of kActivations (swiglu_math.h)");
  if (gemm1_bias) {
    // fp8-naive's dataflow (quantize before the dispatch, FP32 scales) has no GEMM1 bias step.
    FLOWMOE_CHECK(recipe != Recipe::kFp8Naive,
                  what << ": GEMM1 (expert) biases with the fp8-naive recipe are not supported; expected "
                          "one of "
                       << recipes_except(Recipe::kFp8Naive));
    FLOWMOE_CHECK(world == 0, what << ": GEMM1 biases with a communicator (expert parallelism) are not "
                                      "supported; expected one rank");
  }
  const int64_t rows = max_rows_over(*this, world);
  FLOWMOE_CHECK(rows <= INT32_MAX,
                what << ": max_tokens = " << max_tokens << " gives up to " << rows
                     << " padded rows, which do not fit int32 row indices; expected fewer tokens");
}

GatedActivation activation_from_name(const std::string& name, float alpha, float limit, const char* what) {
  std::string known;
  for (const ActivationRow& r : kActivations) {
    if (name == r.name) {
      GatedActivation a;
      a.kind = r.kind;
      if (r.takes_alpha_limit) a.alpha = alpha, a.limit = limit;
      return a;
    }
    known += std::string(known.empty() ? "'" : ", '") + r.name + "'";
  }
  FLOWMOE_CHECK(false, what << ": activation '" << name << "' is unknown; expected one of " << known);
  return GatedActivation();
}

const char* activation_name(ActivationKind kind) {
  for (const ActivationRow& r : kActivations)
    if (r.kind == kind) return r.name;
  return nullptr;
}

void check_param_options(const char* what, bool caller_memory, bool bf16_params_in_place, bool bf16_params_stored,
                         const ExpertStorage& bf16_storage) {
  FLOWMOE_CHECK(bf16_storage.hidden >= 0 && (bf16_storage.is_layer_layout() ? bf16_storage.ffn == 0 : bf16_storage.ffn >= 1),
                what << ": CudaLayerOptions::bf16_storage of H = " << bf16_storage.hidden << ", F = " << bf16_storage.ffn
                     << "; expected H >= 1 and F >= 1, or both 0 (not known)");
  FLOWMOE_CHECK(bf16_storage.is_layer_layout() || bf16_params_stored,
                what << ": CudaLayerOptions::bf16_storage without bf16_params_stored; expected it only with stored "
                        "BF16 parameters");
  FLOWMOE_CHECK(!bf16_params_stored || bf16_params_in_place,
                what << ": CudaLayerOptions::bf16_params_stored without bf16_params_in_place; expected both "
                        "(the stored parameters are relaid per pass in place of the weights region's copies)");
  FLOWMOE_CHECK(!bf16_params_in_place || caller_memory,
                what << ": CudaLayerOptions::bf16_params_in_place without caller_memory; expected caller_memory "
                        "(the parameters then take the place of the weights region's copies)");
}

void check_sync_free_options(const char* what, const MoeConfig& cfg, const CommShape& comm, bool sync_free,
                             bool caller_memory) {
  if (!sync_free) return;
  FLOWMOE_CHECK(comm.world == 0 || comm.device_peers,
                what << ": CudaLayerOptions::sync_free with expert parallelism needs a communicator whose kernels "
                        "reach the peers' memory (Communicator::device_peers: make_device_sim_world's ranks); "
                        "this one ("
                     << comm.backend
                     << ") sizes its messages on the host; expected sync_free off, or one GPU (no communicator)");
  FLOWMOE_CHECK(cfg.align == 128, what << ": CudaLayerOptions::sync_free needs align = 128 (the wgrad kernels' "
                                          "128-token blocks); align is "
                                       << cfg.align);
  FLOWMOE_CHECK(comm.world == 0 || !caller_memory,
                what << ": CudaLayerOptions::caller_memory with sync_free expert parallelism: the peers read this "
                        "layer's buffers at addresses shared once, at construction; expected the layer's own memory");
}

RouterConfig MoeConfig::router_config() const {
  RouterConfig rc;
  rc.num_experts = num_experts;
  rc.topk = topk;
  rc.score = router;
  rc.renormalize = router_renormalize;
  rc.scale = router_scale;
  return rc;
}

int MoeConfig::num_local_experts() const {
  return comm ? num_experts / comm->world_size() : num_experts;
}

int64_t MoeConfig::max_rows() const { return max_rows_over(*this, comm ? comm->world_size() : 0); }

std::string MoeConfig::describe() const {
  std::ostringstream os;
  os << "H=" << hidden << " F=" << ffn << " E=" << num_experts << " k=" << topk << " "
     << (router == RouterScore::kSoftmax ? "softmax" : "sigmoid")
     << (router_renormalize ? "+renorm" : "") << " A=" << align << " " << recipe_name(recipe);
  if (external_routing) os << " external-routing";
  if (activation.kind != ActivationKind::kSwiglu) {
    const char* name = activation_name(activation.kind);
    os << " " << (name ? name : "unknown-activation") << "(alpha=" << activation.alpha << ",limit=" << activation.limit
       << ")";
  }
  if (gemm1_bias) os << " gemm1-bias";
  return os.str();
}

// ---- report ---------------------------------------------------------------------------------------
void CastReport::add_op(MoePass p, CastKind k, const std::string& name, int64_t calls, int64_t outputs,
                        int64_t elements) {
  for (CastOp& op : ops)
    if (op.pass == p && op.kind == k && op.name == name) {
      op.calls += calls;
      op.outputs += outputs;
      op.elements += elements;
      return;
    }
  CastOp op;
  op.pass = p;
  op.kind = k;
  op.name = name;
  op.calls = calls;
  op.outputs = outputs;
  op.elements = elements;
  ops.push_back(op);
}

void CastReport::drop_ops(MoePass p) {
  ops.erase(std::remove_if(ops.begin(), ops.end(), [p](const CastOp& op) { return op.pass == p; }), ops.end());
}

int64_t CastReport::count(MoePass p, CastKind k) const {
  int64_t n = 0;
  for (const CastOp& op : ops)
    if (op.pass == p && op.kind == k) n += op.calls;
  return n;
}

int64_t CastReport::standalone_casts(MoePass p) const {
  return count(p, CastKind::kQuantize) + count(p, CastKind::kDequantize);
}

int64_t CastReport::saved_bytes() const {
  int64_t n = 0;
  for (const SavedTensor& s : saved) n += s.bytes;
  return n;
}

double CastReport::saved_bytes_per_token() const {
  return tokens > 0 ? static_cast<double>(saved_bytes()) / static_cast<double>(tokens) : 0.0;
}

double CastReport::saved_bytes_per_token_unpadded() const {
  double n = 0.0;
  for (const SavedTensor& s : saved) n += s.bytes_per_token_unpadded;
  return n;
}

int64_t CastReport::wire_bytes(MoePass p) const {
  int64_t n = 0;
  for (const WireTransfer& w : wire)
    if (w.pass == p) n += w.bytes;
  return n;
}

double CastReport::wire_bytes_per_token(MoePass p) const {
  return tokens > 0 ? static_cast<double>(wire_bytes(p)) / static_cast<double>(tokens) : 0.0;
}

std::string CastReport::to_string() const {
  std::ostringstream os;
  char buf[256];
  os << "recipe " << recipe_name(recipe) << ": T=" << tokens << ", routed rows " << routed_rows
     << ", padded rows " << padded_rows << "\n";
  for (MoePass p : {MoePass::kWeightUpdate, MoePass::kForward, MoePass::kBackward}) {
    os << "  " << moe_pass_name(p) << ": " << count(p, CastKind::kQuantize) << " quantize, "
       << count(p, CastKind::kDequantize) << " dequantize, " << count(p, CastKind::kFused)
       << " fused, " << count(p, CastKind::kConvert) << " exact convert\n";
    for (const CastOp& op : ops) {
      if (op.pass != p) continue;
      std::snprintf(buf, sizeof buf, "    %-10s x%-3lld %-58s outputs %lld, elements %lld\n",
                    cast_kind_name(op.kind), static_cast<long long>(op.calls), op.name.c_str(),
                    static_cast<long long>(op.outputs), static_cast<long long>(op.elements));
      os << buf;
    }
  }
  os << "  saved for backward: " << saved_bytes() << " bytes, "
     << saved_bytes_per_token() << " per token (" << saved_bytes_per_token_unpadded()
     << " without padding rows)\n";
  for (const SavedTensor& s : saved) {
    std::snprintf(buf, sizeof buf, "    %-34s %-36s %10lld bytes  %9.1f B/token unpadded\n",
                  s.name.c_str(), s.format.c_str(), static_cast<long long>(s.bytes),
                  s.bytes_per_token_unpadded);
    os << buf;
  }
  if (!columns.empty()) {
    os << "  wgrad column operands vs the row-wise values of the other GEMM:\n";
    for (const ColumnCheck& c : columns) {
      std::snprintf(buf, sizeof buf, "    %-28s %-30s %lld of %lld differ, underflow %lld\n",
                    c.name.c_str(), c.method.c_str(), static_cast<long long>(c.differ),
                    static_cast<long long>(c.elements), static_cast<long long>(c.underflow));
      os << buf;
    }
  }
  if (!wire.empty()) {
    os << "  sent to other ranks (expert parallelism): forward " << wire_bytes(MoePass::kForward)
       << " bytes (" << wire_bytes_per_token(MoePass::kForward) << " per token), backward "
       << wire_bytes(MoePass::kBackward) << " bytes (" << wire_bytes_per_token(MoePass::kBackward)
       << " per token)\n";
    for (const WireTransfer& w : wire) {
      std::snprintf(buf, sizeof buf, "    %-8s %-28s %-24s %8lld rows %12lld bytes\n",
                    moe_pass_name(w.pass), w.name.c_str(), w.format.c_str(),
                    static_cast<long long>(w.rows), static_cast<long long>(w.bytes));
      os << buf;
    }
  }
  os << "  forward: nonfinite " << forward_stats.nonfinite << ", underflow "
     << forward_stats.underflow << "; backward: nonfinite " << backward_stats.nonfinite
     << ", underflow " << backward_stats.underflow << "\n";
  return os.str();
}

// ---- expert-parallel bookkeeping (common/moe_ep.h) ------------------------------------------------
namespace ep_detail {

WireFormat forward_wire_format(Recipe r) { return recipe_spec(r).forward_wire; }

DispatchPlan plan_for(const DispatchPlan& plan, MoePass pass, WireFormat f) {
  DispatchPlan p = plan;
  p.format = f;
  p.with_probs = pass == MoePass::kForward;
  return p;
}

WireTransfer dispatch_transfer(MoePass pass, const std::string& name, const DispatchPlan& p) {
  WireTransfer w;
  w.pass = pass;
  w.name = name;
  w.format = std::string(wire_format_name(p.format)) + (p.with_probs ? " + fp32 prob" : "");
  for (int q = 0; q < p.world; ++q)
    if (q != p.rank) w.rows += p.rows_to(q);
  w.bytes = p.wire_bytes(p.format, p.with_probs);
  return w;
}

WireTransfer combine_transfer(MoePass pass, const std::string& name, const std::string& format,
                              int64_t row_bytes, const DispatchPlan& plan) {
  WireTransfer w;
  w.pass = pass;
  w.name = name;
  w.format = format;
  for (int q = 0; q < plan.world; ++q)
    if (q != plan.rank) w.rows += plan.rows_from(q);
  w.bytes = w.rows * row_bytes;
  return w;
}

void check_uniform_config(Communicator& comm, const char* what, const MoeConfig& cfg,
                          const std::vector<std::pair<std::string, int64_t>>& extra) {
  auto bits = [](float f) {
    uint32_t u;
    std::memcpy(&u, &f, sizeof u);
    return static_cast<int64_t>(u);
  };
  std::vector<std::string> names = {"hidden", "ffn", "num_experts", "topk", "router (0 softmax, 1 sigmoid)",
                                    "router_renormalize", "router_scale (fp32 bits)",
                                    "aux_loss_alpha (fp32 bits)", "align",
                                    "recipe (0 bf16, 1 blockwise, 2 fp8-naive, 3 flow, 4 flow-fp4)",
                                    "max_tokens", "transpose_exponent (0 row max, 1 column amax)"};
  std::vector<int64_t> values = {cfg.hidden, cfg.ffn, cfg.num_experts, cfg.topk,
                                 static_cast<int64_t>(cfg.router), cfg.router_renormalize ? 1 : 0,
                                 bits(cfg.router_scale), bits(cfg.aux_loss_alpha), cfg.align,
                                 static_cast<int64_t>(cfg.recipe), cfg.max_tokens,
                                 static_cast<int64_t>(cfg.transpose_exponent)};
  for (const auto& e : extra) {
    names.push_back(e.first);
    values.push_back(e.second);
  }
  comm.check_uniform(what, names, values);
}

}  // namespace ep_detail
}  // namespace flowmoe
