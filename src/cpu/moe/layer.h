// The MoE layer on the CPU (include/flowmoe/moe.h; docs/MOE.md): the readable reference of the
// five recipes of SPEC §6, built from the CPU reference operators (flowmoe::cpu conversions,
// token.h router/permute/unpermute, the SwiGLU arithmetic of swiglu_math.h, the grouped GEMM
// references of gemm.h). Plain loops, one thread, deterministic. What each recipe moves, saves and
// converts is the recipe table (flowmoe/recipe.h); this class runs it.
//
// The rooms (src/cpu/moe/), one job each:
//   layer.cpp        API and lifecycle: construction, set_weights, forward / backward entry points
//   router.cpp       the router and the routing of a forward; the router's backward and dx tail
//   ep_exchange.cpp  token movement: permute+pad / unpermute on one rank, dispatch / combine over
//                    the ranks of a communicator (expert parallelism, docs/EP.md §5)
//   dataflows/       one file per dataflow (bf16, blockwise, fp8_naive, flow; the CUDA layer's
//                    pipelines/ mirrored): its forward (GEMM1, SwiGLU, GEMM2, what is saved) and its
//                    backward (dgrads, the wgrad column copies, wgrads)
// The entry points take the forward / backward of the table row's dataflow (recipe.h Dataflow)
// from kCpuDataflows (layer.cpp, the CUDA layer's pipelines/pipeline.cu kDataflows mirrored),
// never from the Recipe enum: flow and flow-fp4 share forward_flow / backward_flow, their formats
// read from the row.
//   operators.cpp    the layer's arithmetic: SwiGLU with probabilities, grouped GEMM wrappers,
//                    the FP32-scale (fp8-naive) block-scaled GEMMs
//   report.cpp       the cast report: operators as executed, saved tensors, column checks
//
// Every operator that converts precision is run through OpLog, which appends it to the cast report
// when it runs: the report counts what the layer executes, the table only names it.
//
// Expert parallelism (MoeConfig::comm, a host-memory Communicator such as SimWorld's; docs/EP.md §5):
// the token movement changes and nothing else. Each rank routes its own T tokens over all E experts
// (replicated router), plans the dispatch (DispatchPlan: counts exchanged, each local expert's
// segment holds rank 0's rows, then rank 1's, ..., each in (token, slot) order, padded to A), moves
// its rows in the recipe's wire format where one rank would permute+pad, runs its El local experts
// on the padded rows exactly as one rank does, and combines the expert outputs (BF16) back to the
// token's rank where one rank would unpermute. Every step between dispatch and combine is row-wise
// or per expert segment, and the segments hold the same rows in the same order as one rank holding
// all experts over the concatenated batch, so the results are that layer's bits.
//
// Notation (moe.h): T tokens of this call, H hidden, F expert FFN size, E experts, El local experts,
// k top-k, Mp padded routed rows of the local experts.
#pragma once

#include <cstdint>
#include <memory>
#include <string>
#include <vector>

#include "flowmoe/comm.h"
#include "flowmoe/cpu/convert.h"
#include "flowmoe/moe.h"
#include "flowmoe/recipe.h"
#include "flowmoe/token.h"

namespace flowmoe {
namespace cpu_moe {

// ---- the cast log (report.cpp) ---------------------------------------------------------------------
// Appends the operators of one pass to the report as they run (same pass, kind and name: one row,
// calls counted).
class OpLog {
 public:
  OpLog(CastReport* report, MoePass pass) : report_(report), pass_(pass) {}
  void add(CastKind kind, const std::string& name, int64_t outputs, int64_t elements);

 private:
  CastReport* report_;
  MoePass pass_;
};

// For a wgrad column operand: compares its decoded values with the row-wise tensor of the same
// values (real rows of each expert segment only) -> a ColumnCheck named by the table.
ColumnCheck compare_columns(WgradOperand operand, ColumnMethod method,
                            const std::vector<float>& row, const std::vector<float>& col,
                            const cpu::Routing& routing, int64_t cols, int64_t underflow);
std::vector<float> decode(const QTensor& q);
std::vector<float> decode(const cpu::QTensorF32& q);

// ---- the layer's arithmetic (operators.cpp) --------------------------------------------------------
bf16_t to_bf16(float x);  // RNE, NaN canonical (0x7FC0)
std::vector<bf16_t> round_bf16(const std::vector<float>& v);
std::vector<float> widen(const bf16_t* v, int64_t n);
int64_t qbytes(const QTensor& q);  // codes + scales

// SwiGLU with the routing probability applied to its output (Megatron-Core's activation with
// probs), in binary32 with the shared arithmetic of swiglu_math.h.
//   forward   a'[r, j] = p_r * (silu(g) * u)                      g = h[r, j], u = h[r, F + j]
//   backward  with da'[r, j] given (BF16, GEMM2's dgrad):
//             da          = p_r * da'                             (binary32, not rounded)
//             dgate, dup  = dswiglu_f32(da, g, u)                 (then BF16, RNE)
//             dp_r        = sum_j da'[r, j] * (silu(g) * u)       (FP32, fma in j order)
// Padding rows have p = 0 and h = 0 and give zeros.
// h [M, 2F] binary32 -> a [M, F] binary32; returns the non-finite outputs.
int64_t swiglu_prob(const float* h, const float* row_probs, int64_t m, int64_t f, float* a,
                    const GatedActivation& act);
// da [M, F] bf16, h [M, 2F] binary32 -> dh [M, 2F] bf16, dp [M] fp32; returns non-finite dh.
int64_t dswiglu_prob(const bf16_t* da, const float* h, const float* row_probs, int64_t m,
                     int64_t f, bf16_t* dh, float* dp, const GatedActivation& act);

// Block-scaled GEMMs with FP32 scales (fp8-naive), summed exactly like cpu::grouped_*_ref: per
// output element and 128-wide contraction block, decoded code products summed in FP32 in index
// order, the block sum times (scale_a * scale_b), block results summed in FP32 in block order.
// a row-wise [M, C]; w: one weight per segment [J, C] (fprop: W [N, K]; dgrad: Wt [K, N]);
// out [M, J] fp32.
void fp32_scale_rowwise_gemm(const cpu::QTensorF32& a, const std::vector<cpu::QTensorF32>& w,
                             const Segments& seg, float* out);
// dy_col [N over M], x_col [K over M] (same segments) -> dw [E][N][K] (+= when accumulate).
void fp32_scale_wgrad(const cpu::QTensorF32& dy_col, const cpu::QTensorF32& x_col, float* dw,
                      bool accumulate);

// ---- the layer's state -----------------------------------------------------------------------------
// Copies of the weights made by set_weights (which ones: RecipeSpec::weights).
struct WeightCopies {
  std::vector<float> wr;           // [E, H] fp32 router (replicated over the ranks); empty with
                                   // MoeConfig::external_routing
  std::vector<float> router_bias;  // [E] fp32, empty when none
  std::vector<bf16_t> w1_bf16;     // [El, 2F, H]
  std::vector<bf16_t> w2_bf16;     // [El, H, F]
  // WeightCopy::kFp8Block: per local expert, 128x128 UE8M0 blocks and their exact transposes
  std::vector<QTensor> w1_fp8, w1t_fp8, w2_fp8, w2t_fp8;
  // WeightCopy::kFp8BlockFp32Scale (fp8-naive): the same with FP32 scales
  std::vector<cpu::QTensorF32> w1_fp32s, w1t_fp32s, w2_fp32s, w2t_fp32s;
};

// The routing of the latest forward (every recipe), kept for the backward.
struct RoutingState {
  std::vector<bf16_t> x;           // [T, H] the router's (and the layer's) input
  std::vector<float> logits;       // [T, E]
  std::vector<int32_t> expert_ids; // [T, k]
  std::vector<float> probs;        // [T, k]
  std::vector<float> aux_coef;     // [E], empty without aux loss
  float aux_loss = 0.0f;
  cpu::Routing routing;            // the local experts' segments (one rank: the token map too)
  Segments segments;               // padded expert segments over [0, Mp)
  std::vector<float> row_probs;    // [Mp] prob of each row (0 for padding)
  DispatchPlan plan;               // expert parallelism: the dispatch plan (backward reuses it)
};

// The expert activations the latest forward saved for the backward (RecipeSpec::gemm1_input,
// gemm1_output, gemm2_input say which, in which format). Only the recipe's fields are filled.
struct SavedActivations {
  std::vector<bf16_t> xperm_bf16;    // bf16: GEMM1 input [Mp, H]
  std::vector<bf16_t> h_bf16;        // bf16, blockwise, fp8-naive: GEMM1 output [Mp, 2F]
  std::vector<bf16_t> a_bf16;        // bf16: GEMM2 input a' [Mp, F]
  QTensor xperm_col;                 // blockwise: GEMM1 input's wgrad copy
  QTensor a_col;                     // blockwise, flow, flow-fp4: GEMM2 input's wgrad copy
  QTensor xperm_fp8;                 // flow: GEMM1 input row-wise (flow-fp4: only to check columns)
  QTensor h_quantized;               // flow: h FP8 row-wise; flow-fp4: h MXFP4
  QTensor xperm_mxfp4;               // flow-fp4: GEMM1 input MXFP4
  cpu::QTensorF32 xperm_fp32s;       // fp8-naive: GEMM1 input row-wise, FP32 scales
  cpu::QTensorF32 a_fp32s;           // fp8-naive: GEMM2 input row-wise, FP32 scales
};

// =================================================================================================
class CpuMoeLayer final : public MoeLayer {
 public:
  explicit CpuMoeLayer(const MoeConfig& cfg);

  // layer.cpp
  const char* backend() const override { return "cpu"; }
  void set_weights(const MoeWeights& w) override;
  void forward(const bf16_t* x, int64_t tokens, bf16_t* y) override;
  void backward(const bf16_t* dy, bf16_t* dx, const MoeGrads& g) override;
  bool reads_stored_weights(bool) const override { return true; }
  bool writes_stored_grads(const ExpertStorage& st, bool) const override {
    return st.is_layer_layout() || (st.hidden >= 1 && st.hidden <= H_ && st.ffn >= 1 && st.ffn <= F_);
  }
  const CastReport& cast_report() const override { return report_; }
  MoeStatus status() const override { return status_; }
  std::vector<uint8_t> step_state() const override;
  void load_step(const uint8_t* bytes, size_t size) override;

 private:
  // ---- router.cpp ----
  // Router logits, top-k, aux loss and the local experts' segments (EP: the dispatch plan).
  // MoeConfig::external_routing: ids and probs from `ext` (set_routing) instead of the router.
  void route(const bf16_t* x, const RoutingInput& ext, QuantStats* st);
  void route_logits(const bf16_t* x, QuantStats* st);  // logits, top-k, aux loss
  void route_tables();  // the segments (EP: the plan) and row probabilities from ids and probs
  // Unpermute dX (EP: combine), router backward, dWr, dx = expert path + router path; dprobs to
  // g.dprobs when given. external_routing: dx = expert path, no router backward.
  void backward_router(const std::vector<bf16_t>& dxp, const std::vector<float>& dp,
                       const MoeGrads& g, bf16_t* dx);

  // ---- ep_exchange.cpp: one rank permutes / unpermutes, EP dispatches / combines ----
  DispatchPlan plan_for(MoePass pass, WireFormat f) const;
  void log_dispatch(MoePass pass, const std::string& name, const DispatchPlan& p);
  void log_combine(MoePass pass, const std::string& name, const std::string& format,
                   int64_t row_bytes);
  // token rows [T, H] bf16 -> padded rows [Mp, H] bf16 of the local experts
  void permute_bf16(const bf16_t* tokens, bf16_t* rows, MoePass pass, const char* name);
  // padded expert output rows [Mp, H] bf16 -> y [T, H] bf16 (plain sum in slot order)
  void unpermute_bf16(const std::vector<bf16_t>& rows, bf16_t* tokens);
  // FP8 row-wise [T, C] -> permuted and padded row-wise [Mp, C]
  void permute_fp8(const QTensor& q, QTensor* out, MoePass pass, const char* name);
  // MXFP4 token rows [T, H] -> saved_.xperm_mxfp4 [Mp, H] (forward)
  void permute_mxfp4(const QTensor& q);
  // fp8-naive: FP32-scale token rows [T, H] -> moved, then dequantized to BF16 rows [Mp, H];
  // logs the dequantize under `dequantize_name`.
  void permute_fp32_scale(const cpu::QTensorF32& q, MoePass pass, const char* name,
                          const char* dequantize_name, OpLog* log, bf16_t* rows);
  // dX rows [Mp, H] and dp [Mp] back to the tokens: dX [T, H] bf16 (slot sum), dprobs [T, k]
  void unpermute_dx(const std::vector<bf16_t>& dxp, const std::vector<float>& dp,
                    std::vector<bf16_t>* dx_expert, std::vector<float>* dprobs);

  // One dataflow's paths (layer.cpp kCpuDataflows: a row per recipe.h Dataflow)
  struct DataflowPaths {
    Dataflow dataflow;
    void (CpuMoeLayer::*forward)(bf16_t* y, QuantStats* st);
    void (CpuMoeLayer::*backward)(const bf16_t* dy, const MoeGrads& g, bf16_t* dxp, float* dp, QuantStats* st);
  };
  static const DataflowPaths& dataflow_paths(Dataflow d);

  // ---- dataflows/<name>.cpp: the forward path of each dataflow (recipe.h Dataflow; y [T, H]) ----
  void forward_bf16(bf16_t* y, QuantStats* st);
  void forward_blockwise(bf16_t* y, QuantStats* st);
  void forward_fp8_naive(bf16_t* y, QuantStats* st);
  void forward_flow(bf16_t* y, QuantStats* st);  // flow and flow-fp4

  // ---- dataflows/<name>.cpp, the backward paths: each fills dxp [Mp, H] bf16 (GEMM1 dgrad) and dp [Mp] (d loss / d prob
  // per row) and adds to the weight gradients ----
  // backward with FP32 expert gradients (backward rounds into BF16 ones after it)
  void backward_f32_grads(const bf16_t* dy, bf16_t* dx, const MoeGrads& g);
  void backward_bf16(const bf16_t* dy, const MoeGrads& g, bf16_t* dxp, float* dp, QuantStats* st);
  void backward_blockwise(const bf16_t* dy, const MoeGrads& g, bf16_t* dxp, float* dp,
                          QuantStats* st);
  void backward_fp8_naive(const bf16_t* dy, const MoeGrads& g, bf16_t* dxp, float* dp,
                          QuantStats* st);
  void backward_flow(const bf16_t* dy, const MoeGrads& g, bf16_t* dxp, float* dp,
                     QuantStats* st);  // flow and flow-fp4
  // fp8-naive's column copy of `row`: DQ->T->Q, both operators logged
  cpu::QTensorF32 dq_t_q_column(OpLog* log, const cpu::QTensorF32& row, WgradOperand operand,
                                QuantStats* st);

  // ---- GEMM1's bias (MoeConfig::gemm1_bias; flowmoe/expert_bias.h) ----
  // h [Mp, 2F] = bf16(h + b1[e]) over the segments (no-op without gemm1_bias)
  void add_gemm1_bias(std::vector<bf16_t>* h);
  // db1 from the dH that GEMM1's dgrad reads: BF16 (bf16, blockwise) or row-wise FP8 (flow)
  void gemm1_bias_grad(const std::vector<bf16_t>& dh, const MoeGrads& g);
  void gemm1_bias_grad(const QTensor& dh_row, const MoeGrads& g);

  // ---- operators.cpp: grouped GEMMs over the padded segments, FP32 results rounded to BF16 ----
  void fprop_bf16(const std::vector<bf16_t>& a, const std::vector<bf16_t>& w, int64_t n,
                  int64_t k, std::vector<bf16_t>* out);
  void dgrad_bf16(const std::vector<bf16_t>& dy, const std::vector<bf16_t>& w, int64_t n,
                  int64_t k, bf16_t* out);
  void fprop_fp8(const QTensor& a, const std::vector<QTensor>& w, int64_t n,
                 std::vector<bf16_t>* out);
  void dgrad_fp8(const QTensor& dy, const std::vector<QTensor>& wt, int64_t k, bf16_t* out);
  // fprop and dgrad of fp8-naive: a row-wise with FP32 scales times W (or Wt) per expert
  void gemm_fp32_scale(const cpu::QTensorF32& a, const std::vector<cpu::QTensorF32>& w,
                       int64_t n, bf16_t* out);

  // ---- report.cpp ----
  // A saved [Mp, *] tensor of the recipe's table row, its actual bytes
  void save_activation(const SavedSpec& spec, int64_t bytes);
  void save_routing_state();
  void check_column(WgradOperand operand, ColumnMethod method, const std::vector<float>& row,
                    const std::vector<float>& col, int64_t cols, int64_t underflow);

  // ---- state ----
  const RecipeSpec& spec_;    // the recipe's row of the table
  const int E_, El_;          // all experts; local experts (E / ranks with a communicator)
  const int64_t H_, F_;
  const int K_;
  Communicator* const comm_;  // null: single rank
  bool have_weights_ = false, have_forward_ = false;
  // The copies of the latest set_weights, and those of the forward whose state the layer holds
  // (its backward must use them even after a later set_weights): shared, never modified.
  std::shared_ptr<const WeightCopies> weights_, step_weights_;
  const WeightCopies& sw() const { return *step_weights_; }
  int64_t T_ = 0, Mp_ = 0;    // tokens of the latest forward; padded rows of the local experts
  RoutingState route_;
  std::vector<float> gemm1_bias_;  // b1 [El, 2F] of the latest forward (gemm1_bias layers)
  SavedActivations saved_;
  CastReport report_;
  size_t forward_columns_ = 0;  // column checks made by the forward
  MoeStatus status_;
};

}  // namespace cpu_moe
}  // namespace flowmoe
