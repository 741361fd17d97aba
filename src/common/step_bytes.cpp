#include "common/step_bytes.h"

#include "flowmoe/recipe.h"

namespace flowmoe {
namespace step_bytes {

StepHeader step_header(const MoeConfig& cfg, int local_experts, bool cuda) {
  StepHeader h;
  h.backend = cuda ? 1 : 0;
  h.recipe = static_cast<uint8_t>(cfg.recipe);
  h.experts = cfg.num_experts, h.local_experts = local_experts, h.topk = cfg.topk;
  h.hidden = cfg.hidden, h.ffn = cfg.ffn, h.max_tokens = cfg.max_tokens;
  return h;
}

// (field by field: the struct's padding bytes are never written)
void put_header(Writer& w, const StepHeader& h) {
  w.put(h.magic), w.put(h.version), w.put(h.backend), w.put(h.recipe);
  w.put(h.experts), w.put(h.local_experts), w.put(h.topk);
  w.put(h.hidden), w.put(h.ffn), w.put(h.max_tokens);
}

void check_header(Reader& r, const StepHeader& want) {
  StepHeader h;
  r.get(&h.magic), r.get(&h.version);
  FLOWMOE_CHECK(h.magic == want.magic && h.version == want.version,
                r.what() << ": these bytes are not a flowmoe step (or of another version); expected the bytes of "
                            "MoeLayer::step_state()");
  r.get(&h.backend), r.get(&h.recipe);
  r.get(&h.experts), r.get(&h.local_experts), r.get(&h.topk);
  r.get(&h.hidden), r.get(&h.ffn), r.get(&h.max_tokens);
  FLOWMOE_CHECK(h.backend == want.backend, r.what() << ": a step of the " << (h.backend ? "CUDA" : "CPU")
                                                    << " layer; expected one of the " << (want.backend ? "CUDA" : "CPU")
                                                    << " layer it is loaded into");
  FLOWMOE_CHECK(h.recipe == want.recipe && h.experts == want.experts && h.local_experts == want.local_experts &&
                    h.topk == want.topk && h.hidden == want.hidden && h.ffn == want.ffn &&
                    h.max_tokens == want.max_tokens,
                r.what() << ": a step of a layer of another shape (recipe " << recipe_name(Recipe(h.recipe)) << ", E "
                         << h.experts << " (" << h.local_experts << " local), k " << h.topk << ", H " << h.hidden
                         << ", F " << h.ffn << ", max_tokens " << h.max_tokens << "); expected one of this layer (recipe "
                         << recipe_name(Recipe(want.recipe)) << ", E " << want.experts << " (" << want.local_experts
                         << " local), k " << want.topk << ", H " << want.hidden << ", F " << want.ffn
                         << ", max_tokens " << want.max_tokens << ")");
}

void put(Writer& w, const Segments& s) { w.put(s.offsets); }
void get(Reader& r, Segments* s) { r.get(&s->offsets); }

void put(Writer& w, const cpu::Routing& rt) {
  w.put(rt.tokens), w.put(rt.topk), w.put(rt.num_experts), w.put(rt.align);
  w.put(rt.counts), w.put(rt.offsets), w.put(rt.padded_offsets), w.put(rt.row_map), w.put(rt.row_map_unpadded);
}
void get(Reader& r, cpu::Routing* rt) {
  r.get(&rt->tokens), r.get(&rt->topk), r.get(&rt->num_experts), r.get(&rt->align);
  r.get(&rt->counts), r.get(&rt->offsets), r.get(&rt->padded_offsets), r.get(&rt->row_map);
  r.get(&rt->row_map_unpadded);
}

void put(Writer& w, const DispatchPlan& p) {
  w.put(p.rank), w.put(p.world), w.put(p.num_experts), w.put(p.local_experts), w.put(p.topk), w.put(p.align);
  w.put(p.hidden), w.put(p.tokens), w.put(p.format), w.put(p.with_probs);
  put(w, p.send_routing);
  w.put(p.send_counts), w.put(p.send_offsets);
  w.put(p.recv_counts), w.put(p.expert_counts), w.put(p.padded_offsets), w.put(p.recv_offsets);
  w.put(p.send_tokens), w.put(p.recv_tokens);
}
void get(Reader& r, DispatchPlan* p) {
  r.get(&p->rank), r.get(&p->world), r.get(&p->num_experts), r.get(&p->local_experts), r.get(&p->topk);
  r.get(&p->align), r.get(&p->hidden), r.get(&p->tokens), r.get(&p->format), r.get(&p->with_probs);
  get(r, &p->send_routing);
  r.get(&p->send_counts), r.get(&p->send_offsets);
  r.get(&p->recv_counts), r.get(&p->expert_counts), r.get(&p->padded_offsets), r.get(&p->recv_offsets);
  r.get(&p->send_tokens), r.get(&p->recv_tokens);
}

void put(Writer& w, const QTensor& q) {
  w.put(q.layout), w.put(q.rows), w.put(q.cols), w.put(q.codes), w.put(q.scales);
  put(w, q.segments);
}
void get(Reader& r, QTensor* q) {
  r.get(&q->layout), r.get(&q->rows), r.get(&q->cols), r.get(&q->codes), r.get(&q->scales);
  get(r, &q->segments);
}

}  // namespace step_bytes
}  // namespace flowmoe
