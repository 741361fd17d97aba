// The CPU MoE layer's API and lifecycle (src/cpu/moe/layer.h): construction, set_weights (the
// weight copies of the recipe), and the forward / backward entry points that run the recipe's
// path (dataflows/<name>.cpp) between the router (router.cpp) and the report.
#include <algorithm>
#include <memory>
#include <string>
#include <vector>

#include "common/moe_ep.h"
#include "common/step_bytes.h"
#include "cpu/moe/layer.h"
#include "flowmoe/error.h"
#include "flowmoe/numerics.h"

namespace flowmoe {
namespace cpu_moe {
namespace {

float value_f32(float v) { return v; }
float value_f32(bf16_t v) { return num::bf16_to_f32(v); }

template <typename T>
void check_finite(const T* v, int64_t n, const char* name) {
  for (int64_t i = 0; i < n; ++i)
    if (!num::f32_is_finite(value_f32(v[i])))
      throw NonFiniteError(__FILE__, __LINE__,
                           std::string("MoeLayer::set_weights: ") + name +
                               " holds a non-finite value at element " + std::to_string(i) +
                               "; expected finite weights");
}

}  // namespace

CpuMoeLayer::CpuMoeLayer(const MoeConfig& cfg)
    : MoeLayer(cfg), spec_(recipe_spec(cfg.recipe)), E_(cfg.num_experts),
      El_(cfg.num_local_experts()), H_(cfg.hidden), F_(cfg.ffn), K_(cfg.topk), comm_(cfg.comm) {
  report_.recipe = cfg.recipe;
  dataflow_paths(spec_.dataflow);  // (a dataflow without a row is refused here, not at the forward)
  // Host workspaces for cfg.max_tokens (the reference operators still allocate their outputs).
  route_.x.reserve(cfg.max_tokens * H_);
  route_.logits.reserve(cfg.max_tokens * E_);
  route_.row_probs.reserve(cfg.max_rows());
}

void CpuMoeLayer::set_weights(const MoeWeights& w) {
  check_weights(w, "host");
  const ExpertStorage& st = w.storage;
  if (!st.is_layer_layout()) {  // relaid into the layer's layout (padding zeros), then as any weights
    const int64_t n1 = int64_t(El_) * 2 * F_ * H_, n2 = int64_t(El_) * H_ * F_;
    MoeWeights lw = w;
    lw.storage = ExpertStorage();
    const auto relay = [&](const auto* w1, const auto* w2, auto& v1, auto& v2) {
      v1.resize(n1), v2.resize(n2);
      cpu::expert_weights_to_layer(w1, v1.data(), El_, st.hidden, 2 * st.ffn, 2 * F_, H_, st.w1_rows(F_));
      cpu::expert_weights_to_layer(w2, v2.data(), El_, st.ffn, st.hidden, H_, F_, st.w2_rows());
    };
    std::vector<bf16_t> b1, b2;
    std::vector<float> f1, f2;
    if (w.bf16_params()) {
      relay(w.w1_bf16, w.w2_bf16, b1, b2);
      lw.w1_bf16 = b1.data(), lw.w2_bf16 = b2.data();
    } else {
      relay(w.w1, w.w2, f1, f2);
      lw.w1 = f1.data(), lw.w2 = f2.data();
    }
    set_weights(lw);
    return;
  }
  const bool router = !cfg_.external_routing;
  // W1, W2: this rank's El local experts (El = E on a single rank); Wr: all E (replicated).
  const int64_t n1 = int64_t(El_) * 2 * F_ * H_, n2 = int64_t(El_) * H_ * F_;
  if (w.bf16_params()) {
    check_finite(w.w1_bf16, n1, "W1");
    check_finite(w.w2_bf16, n2, "W2");
  } else {
    check_finite(w.w1, n1, "W1");
    check_finite(w.w2, n2, "W2");
  }
  if (router) check_finite(w.wr, int64_t(E_) * H_, "Wr");
  std::shared_ptr<WeightCopies> copies = std::make_shared<WeightCopies>();
  WeightCopies& wc = *copies;
  if (router) wc.wr.assign(w.wr, w.wr + int64_t(E_) * H_);
  if (w.router_bias != nullptr)
    wc.router_bias.assign(w.router_bias, w.router_bias + E_);
  else
    wc.router_bias.clear();
  if (w.bf16_params()) {  // the parameters are the BF16 copies (what RNE of their FP32 values gives)
    wc.w1_bf16.assign(w.w1_bf16, w.w1_bf16 + n1);
    wc.w2_bf16.assign(w.w2_bf16, w.w2_bf16 + n2);
  } else {
    wc.w1_bf16.resize(n1);
    wc.w2_bf16.resize(n2);
    for (int64_t i = 0; i < n1; ++i) wc.w1_bf16[i] = num::f32_to_bf16(w.w1[i]);
    for (int64_t i = 0; i < n2; ++i) wc.w2_bf16[i] = num::f32_to_bf16(w.w2[i]);
  }

  report_.drop_ops(MoePass::kWeightUpdate);
  OpLog log(&report_, MoePass::kWeightUpdate);
  switch (spec_.weights) {
    case WeightCopy::kBf16Only: break;
    case WeightCopy::kFp8Block:
      wc.w1_fp8.assign(El_, QTensor());
      wc.w1t_fp8.assign(El_, QTensor());
      wc.w2_fp8.assign(El_, QTensor());
      wc.w2t_fp8.assign(El_, QTensor());
      for (int e = 0; e < El_; ++e) {
        cpu::quantize_weight(&wc.w1_bf16[e * 2 * F_ * H_], 2 * F_, H_, &wc.w1_fp8[e], &wc.w1t_fp8[e]);
        cpu::quantize_weight(&wc.w2_bf16[e * H_ * F_], H_, F_, &wc.w2_fp8[e], &wc.w2t_fp8[e]);
      }
      break;
    case WeightCopy::kFp8BlockFp32Scale:
      wc.w1_fp32s.assign(El_, cpu::QTensorF32());
      wc.w1t_fp32s.assign(El_, cpu::QTensorF32());
      wc.w2_fp32s.assign(El_, cpu::QTensorF32());
      wc.w2t_fp32s.assign(El_, cpu::QTensorF32());
      for (int e = 0; e < El_; ++e) {
        cpu::quantize_weight_fp32_scale(&wc.w1_bf16[e * 2 * F_ * H_], 2 * F_, H_, &wc.w1_fp32s[e],
                                        &wc.w1t_fp32s[e]);
        cpu::quantize_weight_fp32_scale(&wc.w2_bf16[e * H_ * F_], H_, F_, &wc.w2_fp32s[e],
                                        &wc.w2t_fp32s[e]);
      }
      break;
  }
  if (spec_.quantize_w1 != nullptr) {
    log.add(CastKind::kQuantize, spec_.quantize_w1, 2, n1);  // blocks + exact transpose
    log.add(CastKind::kQuantize, spec_.quantize_w2, 2, n2);
  }
  weights_ = std::move(copies);
  have_weights_ = true;
}

void CpuMoeLayer::forward(const bf16_t* x, int64_t tokens, bf16_t* y) {
  const char* what = "MoeLayer::forward";
  // the caller's routing and bias are for this forward only, even one refused by the checks below
  const RoutingInput ext = take_routing(what);
  const float* b1 = take_gemm1_bias(what);
  collective_checks(comm_, what, [&] {
    FLOWMOE_CHECK(have_weights_, what << ": no weights; call set_weights first");
    FLOWMOE_CHECK(tokens >= 1 && tokens <= cfg_.max_tokens,
                  what << ": T = " << tokens << " tokens; expected 1 <= T <= max_tokens = "
                       << cfg_.max_tokens);
    FLOWMOE_CHECK(x && y, what << ": x and y must be non-null host pointers to [T, H] bf16");
  });
  if (b1) gemm1_bias_.assign(b1, b1 + El_ * 2 * F_);
  T_ = tokens;
  have_forward_ = false;
  step_weights_ = weights_;
  report_.drop_ops(MoePass::kForward);
  report_.drop_ops(MoePass::kBackward);
  report_.saved.clear();
  report_.columns.clear();
  report_.wire.clear();
  report_.forward_stats = QuantStats();
  report_.backward_stats = QuantStats();
  status_ = MoeStatus();
  QuantStats& st = report_.forward_stats;

  route(x, ext, &st);
  (this->*dataflow_paths(spec_.dataflow).forward)(y, &st);
  save_routing_state();
  forward_columns_ = report_.columns.size();
  status_.nonfinite = st.nonfinite;
  status_.underflow = st.underflow;
  status_.aux_loss = route_.aux_loss;
  have_forward_ = true;
}

// The dataflows of the CPU reference: one row per recipe.h Dataflow (the CUDA layer's
// pipelines/pipeline.cu kDataflows mirrored), the one place here that lists them.
const CpuMoeLayer::DataflowPaths& CpuMoeLayer::dataflow_paths(Dataflow d) {
  static const DataflowPaths kCpuDataflows[] = {
      {Dataflow::kBf16Gemms, &CpuMoeLayer::forward_bf16, &CpuMoeLayer::backward_bf16},
      {Dataflow::kBlockwise, &CpuMoeLayer::forward_blockwise, &CpuMoeLayer::backward_blockwise},
      {Dataflow::kFp8Naive, &CpuMoeLayer::forward_fp8_naive, &CpuMoeLayer::backward_fp8_naive},
      {Dataflow::kFlow, &CpuMoeLayer::forward_flow, &CpuMoeLayer::backward_flow},
  };
  for (const DataflowPaths& r : kCpuDataflows)
    if (r.dataflow == d) return r;
  FLOWMOE_CHECK(false, "make_cpu_layer: internal error: the dataflow "
                           << dataflow_name(d) << " has no row in the CPU layer's table; expected one in "
                                                  "src/cpu/moe/layer.cpp");
  return kCpuDataflows[0];
}

void CpuMoeLayer::backward(const bf16_t* dy, bf16_t* dx, const MoeGrads& g) {
  const char* what = "MoeLayer::backward";
  collective_checks(comm_, what, [&] {
    FLOWMOE_CHECK(have_forward_, what << ": no saved forward; call forward first (backward "
                                         "consumes the activations of the latest forward)");
    FLOWMOE_CHECK(dy && dx, what << ": dy and dx must be non-null host pointers to [T, H] bf16");
    check_grads(g);
  });
  const int64_t n1 = El_ * 2 * F_ * H_, n2 = El_ * H_ * F_;
  const ExpertStorage& st = g.storage;
  if (!st.is_layer_layout()) {
    // dW1, dW2 computed in the layer's layout (FP32, from zero), then mapped to the stored one:
    // FP32 = or += (accumulate), BF16 rounded once (RNE)
    std::vector<float> l1(g.wants_dw1() ? n1 : 0, 0.0f), l2(g.wants_dw2() ? n2 : 0, 0.0f);
    MoeGrads gl = g;
    gl.storage = ExpertStorage();
    gl.dw1 = g.wants_dw1() ? l1.data() : nullptr, gl.dw2 = g.wants_dw2() ? l2.data() : nullptr;
    gl.dw1_bf16 = gl.dw2_bf16 = nullptr;
    backward_f32_grads(dy, dx, gl);
    const auto back = [&](const std::vector<float>& lay, float* f32, bf16_t* b16, int64_t c, int64_t l, int64_t r,
                          int64_t cp, const ExpertRowMap& map) {
      if (f32 && g.accumulate)
        cpu::expert_grads_from_layer(lay.data(), f32, El_, c, l, r, cp, map, [](float& d, float v) { d += v; });
      else if (f32)
        cpu::expert_grads_from_layer(lay.data(), f32, El_, c, l, r, cp, map, [](float& d, float v) { d = v; });
      else if (b16)
        cpu::expert_grads_from_layer(lay.data(), b16, El_, c, l, r, cp, map,
                                     [](bf16_t& d, float v) { d = num::f32_to_bf16(v); });
    };
    if (g.wants_dw1()) back(l1, g.dw1, g.dw1_bf16, st.hidden, 2 * st.ffn, 2 * F_, H_, st.w1_rows(F_));
    if (g.wants_dw2()) back(l2, g.dw2, g.dw2_bf16, st.ffn, st.hidden, H_, F_, st.w2_rows());
    return;
  }
  // BF16 expert gradients: this backward's FP32 sums (overwritten), then rounded once (RNE)
  std::vector<float> dw1_f32(g.dw1_bf16 ? n1 : 0), dw2_f32(g.dw2_bf16 ? n2 : 0);
  MoeGrads gf = g;
  if (g.dw1_bf16) gf.dw1 = dw1_f32.data(), gf.dw1_bf16 = nullptr;
  if (g.dw2_bf16) gf.dw2 = dw2_f32.data(), gf.dw2_bf16 = nullptr;
  backward_f32_grads(dy, dx, gf);
  for (int64_t i = 0; i < int64_t(dw1_f32.size()); ++i) g.dw1_bf16[i] = num::f32_to_bf16(dw1_f32[i]);
  for (int64_t i = 0; i < int64_t(dw2_f32.size()); ++i) g.dw2_bf16[i] = num::f32_to_bf16(dw2_f32[i]);
}

void CpuMoeLayer::backward_f32_grads(const bf16_t* dy, bf16_t* dx, const MoeGrads& g) {
  report_.drop_ops(MoePass::kBackward);
  report_.wire.erase(
      std::remove_if(report_.wire.begin(), report_.wire.end(),
                     [](const WireTransfer& w) { return w.pass == MoePass::kBackward; }),
      report_.wire.end());
  report_.columns.resize(std::min(report_.columns.size(), forward_columns_));  // drop an earlier backward's checks
  report_.backward_stats = QuantStats();
  QuantStats& st = report_.backward_stats;
  // expert path: dXp [Mp, H] bf16, dp [Mp] fp32
  std::vector<bf16_t> dxp(Mp_ * H_);
  std::vector<float> dp(Mp_, 0.0f);
  (this->*dataflow_paths(spec_.dataflow).backward)(dy, g, dxp.data(), dp.data(), &st);
  backward_router(dxp, dp, g, dx);
  status_.nonfinite += st.nonfinite;
  status_.underflow += st.underflow;
}

namespace {
// The CPU layer's step bytes: every field of its saved state, in declaration order.
namespace sb = step_bytes;

void put(sb::Writer& w, const cpu::QTensorF32& q) {
  w.put(q.layout), w.put(q.rows), w.put(q.cols), w.put(q.codes), w.put(q.scales);
  sb::put(w, q.segments);
}
void get(sb::Reader& r, cpu::QTensorF32* q) {
  r.get(&q->layout), r.get(&q->rows), r.get(&q->cols), r.get(&q->codes), r.get(&q->scales);
  sb::get(r, &q->segments);
}
template <typename Q>
void put(sb::Writer& w, const std::vector<Q>& v) {
  w.put<int64_t>(int64_t(v.size()));
  for (const Q& q : v) put(w, q);
}
template <typename Q>
void get(sb::Reader& r, std::vector<Q>* v) {
  int64_t n = 0;
  r.get(&n);
  FLOWMOE_CHECK(n >= 0 && n <= (int64_t(1) << 24), r.what() << ": a table of " << n
                                                             << " tensors; expected the bytes of step_state()");
  v->assign(size_t(n), Q());
  for (Q& q : *v) get(r, &q);
}

void put(sb::Writer& w, const RoutingState& s) {
  w.put(s.x), w.put(s.logits), w.put(s.expert_ids), w.put(s.probs), w.put(s.aux_coef), w.put(s.aux_loss);
  sb::put(w, s.routing), sb::put(w, s.segments);
  w.put(s.row_probs);
  sb::put(w, s.plan);
}
void get(sb::Reader& r, RoutingState* s) {
  r.get(&s->x), r.get(&s->logits), r.get(&s->expert_ids), r.get(&s->probs), r.get(&s->aux_coef);
  r.get(&s->aux_loss);
  sb::get(r, &s->routing), sb::get(r, &s->segments);
  r.get(&s->row_probs);
  sb::get(r, &s->plan);
}

void put(sb::Writer& w, const SavedActivations& s) {
  w.put(s.xperm_bf16), w.put(s.h_bf16), w.put(s.a_bf16);
  put(w, s.xperm_col), put(w, s.a_col), put(w, s.xperm_fp8), put(w, s.h_quantized), put(w, s.xperm_mxfp4);
  put(w, s.xperm_fp32s), put(w, s.a_fp32s);
}
void get(sb::Reader& r, SavedActivations* s) {
  r.get(&s->xperm_bf16), r.get(&s->h_bf16), r.get(&s->a_bf16);
  get(r, &s->xperm_col), get(r, &s->a_col), get(r, &s->xperm_fp8), get(r, &s->h_quantized), get(r, &s->xperm_mxfp4);
  get(r, &s->xperm_fp32s), get(r, &s->a_fp32s);
}

void put(sb::Writer& w, const WeightCopies& c) {
  w.put(c.wr), w.put(c.router_bias), w.put(c.w1_bf16), w.put(c.w2_bf16);
  put(w, c.w1_fp8), put(w, c.w1t_fp8), put(w, c.w2_fp8), put(w, c.w2t_fp8);
  put(w, c.w1_fp32s), put(w, c.w1t_fp32s), put(w, c.w2_fp32s), put(w, c.w2t_fp32s);
}
void get(sb::Reader& r, WeightCopies* c) {
  r.get(&c->wr), r.get(&c->router_bias), r.get(&c->w1_bf16), r.get(&c->w2_bf16);
  get(r, &c->w1_fp8), get(r, &c->w1t_fp8), get(r, &c->w2_fp8), get(r, &c->w2t_fp8);
  get(r, &c->w1_fp32s), get(r, &c->w1t_fp32s), get(r, &c->w2_fp32s), get(r, &c->w2t_fp32s);
}
}  // namespace

// A forward's whole state: routing, saved activations, the weight copies it used (so that a
// weight update between a forward and its backward does not change that backward).
std::vector<uint8_t> CpuMoeLayer::step_state() const {
  FLOWMOE_CHECK(have_forward_, "MoeLayer::step_state: no forward yet; call it after a forward");
  sb::Writer w;
  sb::put_header(w, sb::step_header(cfg_, El_, false));
  w.put(T_), w.put(Mp_), w.put(uint64_t(forward_columns_));
  put(w, route_);
  put(w, saved_);
  put(w, *step_weights_);
  return w.take();
}

void CpuMoeLayer::load_step(const uint8_t* bytes, size_t size) {
  const char* what = "MoeLayer::load_step";
  FLOWMOE_CHECK(bytes != nullptr || size == 0, what << ": null bytes; expected the bytes of step_state()");
  sb::Reader r(bytes, size, what);
  sb::check_header(r, sb::step_header(cfg_, El_, false));
  // (read into locals first: refused bytes leave the layer as it was)
  int64_t T = 0, Mp = 0;
  uint64_t columns = 0;
  r.get(&T), r.get(&Mp), r.get(&columns);
  RoutingState route;
  SavedActivations saved;
  auto weights = std::make_shared<WeightCopies>();
  get(r, &route);
  get(r, &saved);
  get(r, weights.get());
  r.finish();
  FLOWMOE_CHECK(T >= 1 && T <= cfg_.max_tokens && int64_t(route.x.size()) == T * cfg_.hidden,
                what << ": a step of " << T << " tokens with " << route.x.size() << " input values; expected 1.."
                     << cfg_.max_tokens << " tokens of " << cfg_.hidden << " values (the bytes of step_state())");
  T_ = T, Mp_ = Mp;
  forward_columns_ = size_t(columns);
  route_ = std::move(route);
  saved_ = std::move(saved);
  step_weights_ = std::move(weights);
  have_forward_ = true;
}

}  // namespace cpu_moe

std::unique_ptr<MoeLayer> make_cpu_layer(const MoeConfig& cfg) {
  if (cfg.comm == nullptr) {
    cfg.validate();
    return std::unique_ptr<MoeLayer>(new cpu_moe::CpuMoeLayer(cfg));
  }
  // Expert parallelism: collective. First the configuration across ranks (a mismatch is a
  // CommError on every rank, reported identically), then each rank's own checks, agreed on by
  // every rank, so that nobody is left waiting in a later collective.
  Communicator& comm = *cfg.comm;
  const char* what = "make_cpu_layer";
  ep_detail::check_uniform_config(comm, what, cfg);
  collective_checks(&comm, what, [&] {
    cfg.validate();
    FLOWMOE_CHECK(comm.memory_space() == MemorySpace::kHost,
                  what << ": the CPU layer moves host memory but the communicator ("
                       << comm.backend() << ") moves device memory; expected a host-memory "
                          "communicator such as SimWorld's");
  });
  return std::unique_ptr<MoeLayer>(new cpu_moe::CpuMoeLayer(cfg));
}

}  // namespace flowmoe
