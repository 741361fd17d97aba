// Expert-parallel dispatch / combine planning and its CPU reference (flowmoe/comm.h, docs/EP.md).
// Backend independent: the plan is host metadata; dispatch_rows / combine_rows issue one grouped
// exchange on any Communicator; the ep_* functions are the host-memory reference.
#include <algorithm>
#include <cstdlib>
#include <cstring>
#include <utility>
#include <sstream>

#include "flowmoe/comm.h"

namespace flowmoe {

namespace {

void check_plan(const DispatchPlan& plan, const Communicator& comm, const char* what) {
  FLOWMOE_CHECK(plan.world == comm.world_size() && plan.rank == comm.rank() &&
                    plan.local_experts >= 1 &&
                    static_cast<int>(plan.send_counts.size()) == plan.world * plan.local_experts &&
                    static_cast<int>(plan.recv_counts.size()) == plan.world * plan.local_experts,
                what << ": the plan (rank " << plan.rank << " of " << plan.world
                     << ") was not made by plan_dispatch on this communicator (rank "
                     << comm.rank() << " of " << comm.world_size() << ")");
}

void check_reference(const DispatchPlan& plan, const Communicator& comm, const char* what) {
  check_plan(plan, comm, what);
  FLOWMOE_CHECK(comm.memory_space() == MemorySpace::kHost,
                what << ": the CPU reference needs a host-memory communicator (e.g. SimWorld); "
                     << comm.backend() << " moves device memory");
  FLOWMOE_CHECK(plan.send_routing.tokens == plan.tokens && !plan.send_routing.row_map.empty() ==
                                                               (plan.tokens > 0),
                what << ": the plan has no send routing; make it with plan_dispatch (ids), not "
                        "plan_dispatch_counts");
}

}  // namespace

// ---- plan ---------------------------------------------------------------------------------------
int64_t DispatchPlan::recv_rows() const {
  int64_t n = 0;
  for (int32_t c : expert_counts) n += c;
  return n;
}
int64_t DispatchPlan::rows_to(int peer) const {
  FLOWMOE_CHECK(peer >= 0 && peer < world, "DispatchPlan::rows_to: peer " << peer);
  return send_offsets[(peer + 1) * local_experts] - send_offsets[peer * local_experts];
}
int64_t DispatchPlan::rows_from(int peer) const {
  FLOWMOE_CHECK(peer >= 0 && peer < world, "DispatchPlan::rows_from: peer " << peer);
  int64_t n = 0;
  for (int l = 0; l < local_experts; ++l) n += recv_counts[peer * local_experts + l];
  return n;
}
Segments DispatchPlan::padded_segments() const {
  Segments s;
  s.offsets = padded_offsets;
  return s;
}
int64_t DispatchPlan::wire_bytes(WireFormat f, bool with_probs) const {
  const int64_t row = wire_row_bytes(f, hidden) + (with_probs ? kWireProbBytes : 0);
  int64_t rows = 0;
  for (int p = 0; p < world; ++p)
    if (p != rank) rows += rows_to(p);
  return rows * row;
}
std::string DispatchPlan::describe() const {
  std::ostringstream os;
  os << "rank " << rank << "/" << world << ": E=" << num_experts << " El=" << local_experts
     << " k=" << topk << " H=" << hidden << " A=" << align << " " << wire_format_name(format)
     << " T=" << tokens << " send rows " << send_rows() << " (to peers:";
  for (int p = 0; p < world; ++p) os << " " << rows_to(p);
  os << ") recv rows " << recv_rows() << " (from peers:";
  for (int p = 0; p < world; ++p) os << " " << rows_from(p);
  os << ") padded " << padded_rows();
  return os.str();
}

namespace {
DispatchPlan make_plan(const EpConfig& cfg, int rank, int world, int64_t tokens, const int32_t* send_counts,
                       const std::vector<int32_t>& recv_counts, const int32_t* send_tokens,
                       const std::vector<int32_t>& recv_tokens);
DispatchPlan exchange_counts(Communicator& comm, const EpConfig& cfg, const int32_t* send_counts,
                             int64_t tokens, const std::string& local_error,
                             const int32_t* send_tokens = nullptr);
}  // namespace

DispatchPlan plan_dispatch_counts(Communicator& comm, const EpConfig& cfg,
                                  const int32_t* send_counts, int64_t tokens, bool config_agreed,
                                  const int32_t* send_tokens) {
  const int world = comm.world_size();
  // The configuration first: with a different E (so a different El) the count exchange itself
  // would not match, and NCCL cannot detect a size mismatch of a send/recv pair.
  if (!config_agreed)
    comm.check_uniform("plan_dispatch",
                       {"num_experts", "topk", "hidden", "align", "wire format", "with_probs"},
                       {cfg.num_experts, cfg.topk, cfg.hidden, cfg.align,
                        static_cast<int64_t>(cfg.format), cfg.with_probs ? 1 : 0});
  std::string local_error;
  try {
    cfg.validate(world);
    FLOWMOE_CHECK(tokens >= 0 && tokens <= 0x7FFFFFFF,
                  "plan_dispatch: T = " << tokens << "; expected 0 <= T < 2^31");
    FLOWMOE_CHECK(send_counts != nullptr, "plan_dispatch: send_counts is null");
    int64_t total = 0;
    for (int g = 0; g < cfg.num_experts; ++g) {
      FLOWMOE_CHECK(send_counts[g] >= 0, "plan_dispatch: send_counts[" << g << "] = "
                                                                       << send_counts[g]
                                                                       << "; expected >= 0");
      total += send_counts[g];
    }
    FLOWMOE_CHECK(total <= tokens * cfg.topk, "plan_dispatch: " << total << " routed rows for T = "
                                                                << tokens << ", k = " << cfg.topk
                                                                << "; expected at most T*k");
    for (int p = 0; send_tokens && p < world; ++p)
      FLOWMOE_CHECK(send_tokens[p] >= 0 && send_tokens[p] <= tokens,
                    "plan_dispatch: send_tokens[" << p << "] = " << send_tokens[p]
                                                  << "; expected 0.." << tokens << " (T)");
  } catch (const Error& e) {
    local_error = e.what();
  }
  return exchange_counts(comm, cfg, send_counts, tokens, local_error, send_tokens);
}

DispatchPlan plan_from_all_counts(const EpConfig& cfg, int rank, int world, const int32_t* counts_all,
                                  int64_t tokens, const int32_t* tokens_all) {
  FLOWMOE_CHECK(world >= 1 && rank >= 0 && rank < world,
                "plan_from_all_counts: rank " << rank << " of " << world << "; expected 0 <= rank < world");
  cfg.validate(world);
  FLOWMOE_CHECK(counts_all != nullptr, "plan_from_all_counts: counts_all is null");
  const int E = cfg.num_experts, El = E / world;
  std::vector<int32_t> recv_counts(static_cast<size_t>(world) * El), recv_tokens(world, 0);
  for (int p = 0; p < world; ++p) {
    for (int l = 0; l < El; ++l)
      recv_counts[static_cast<size_t>(p) * El + l] = counts_all[static_cast<size_t>(p) * E + rank * El + l];
    if (tokens_all) recv_tokens[p] = tokens_all[static_cast<size_t>(p) * world + rank];
  }
  return make_plan(cfg, rank, world, tokens, counts_all + static_cast<size_t>(rank) * E, recv_counts,
                   tokens_all ? tokens_all + static_cast<size_t>(rank) * world : nullptr, recv_tokens);
}

namespace {
// The count all-to-all and both layouts; cfg agreed on every rank (check_uniform). One
// alltoall_i32 also agrees on the ranks' local errors. The message to each peer p is
// [flag, El counts, tokens]: flag 1 (and zeros) from a rank whose own checks failed, that rank
// then throws its own error and every other rank a CommError naming it (as
// agree_on_local_errors, without a second collective); the El rows this rank routes to p's local
// experts (send_counts is laid out [p][l], global expert g = p*El + l); the tokens it sends to p
// in a deduplicated dispatch (0 when not given).
DispatchPlan exchange_counts(Communicator& comm, const EpConfig& cfg, const int32_t* send_counts,
                             int64_t tokens, const std::string& local_error,
                             const int32_t* send_tokens) {
  const int world = comm.world_size();
  // every rank computes the same El from the agreed cfg (even an invalid one, then rejected)
  const int El = std::max(1, cfg.num_experts / std::max(1, world)), m = El + 2;
  std::vector<int32_t> out(static_cast<size_t>(world) * m, 0), in(out.size(), 0);
  for (int p = 0; p < world; ++p) {
    int32_t* msg = out.data() + static_cast<size_t>(p) * m;
    msg[0] = local_error.empty() ? 0 : 1;
    if (!local_error.empty()) continue;
    std::copy(send_counts + static_cast<size_t>(p) * El, send_counts + static_cast<size_t>(p + 1) * El, msg + 1);
    msg[1 + El] = send_tokens ? send_tokens[p] : 0;
  }
  comm.alltoall_i32(out.data(), in.data(), m);
  if (!local_error.empty()) throw Error(__FILE__, __LINE__, local_error);
  for (int p = 0; p < world; ++p)
    if (in[static_cast<size_t>(p) * m] != 0)
      throw CommError(__FILE__, __LINE__,
                      "plan_dispatch: rank " + std::to_string(p) +
                          " rejected its input (its own error message says why); rank " +
                          std::to_string(comm.rank()) + " stops too");

  std::vector<int32_t> recv_counts(static_cast<size_t>(world) * El), recv_tokens(world);
  for (int p = 0; p < world; ++p) {
    const int32_t* msg = in.data() + static_cast<size_t>(p) * m;
    std::copy(msg + 1, msg + 1 + El, recv_counts.begin() + static_cast<size_t>(p) * El);
    recv_tokens[p] = msg[1 + El];
  }
  return make_plan(cfg, comm.rank(), world, tokens, send_counts, recv_counts, send_tokens, recv_tokens);
}

// Both layouts of the plan from this rank's send counts ([world * El]) and token counts ([world]
// or null) and what every rank routes to it (recv_counts [world * El], recv_tokens [world]).
DispatchPlan make_plan(const EpConfig& cfg, int rank, int world, int64_t tokens, const int32_t* send_counts,
                       const std::vector<int32_t>& recv_counts, const int32_t* send_tokens,
                       const std::vector<int32_t>& recv_tokens) {
  const int El = std::max(1, cfg.num_experts / std::max(1, world));
  DispatchPlan plan;
  plan.rank = rank;
  plan.world = world;
  plan.num_experts = cfg.num_experts;
  plan.local_experts = El;
  plan.topk = cfg.topk;
  plan.align = cfg.align;
  plan.hidden = cfg.hidden;
  plan.tokens = tokens;
  plan.format = cfg.format;
  plan.with_probs = cfg.with_probs;
  const int n = world * El;
  plan.send_counts.assign(send_counts, send_counts + n);
  plan.send_offsets.assign(n + 1, 0);
  for (int g = 0; g < n; ++g) plan.send_offsets[g + 1] = plan.send_offsets[g] + plan.send_counts[g];
  // recv_counts[p*El + l] = rows rank p routes to this rank's local expert l
  plan.recv_counts = recv_counts;
  plan.recv_tokens = recv_tokens;
  plan.send_tokens.assign(world, 0);
  for (int p = 0; p < world; ++p) plan.send_tokens[p] = send_tokens ? send_tokens[p] : 0;

  plan.expert_counts.assign(El, 0);
  for (int p = 0; p < world; ++p)
    for (int l = 0; l < El; ++l) plan.expert_counts[l] += plan.recv_counts[p * El + l];
  plan.padded_offsets.assign(El + 1, 0);
  int64_t acc = 0;
  for (int l = 0; l < El; ++l) {
    acc += (static_cast<int64_t>(plan.expert_counts[l]) + cfg.align - 1) / cfg.align * cfg.align;
    if (acc > 0x7FFFFFFF)
      throw CommError(__FILE__, __LINE__,
                      "plan_dispatch: " + std::to_string(acc) + " received padded rows on rank " +
                          std::to_string(rank) + " do not fit int32 row indices");
    plan.padded_offsets[l + 1] = static_cast<int32_t>(acc);
  }
  // Chunk (p, l) lands after the chunks of ranks p' < p inside expert l's segment.
  plan.recv_offsets.assign(n, 0);
  for (int l = 0; l < El; ++l) {
    int32_t off = plan.padded_offsets[l];
    for (int p = 0; p < world; ++p) {
      plan.recv_offsets[p * El + l] = off;
      off += plan.recv_counts[p * El + l];
    }
  }
  return plan;
}
}  // namespace

DispatchPlan plan_dispatch(Communicator& comm, const EpConfig& cfg, const int32_t* ids,
                           int64_t tokens) {
  // Local validation happens inside the collective protocol (agree_on_local_errors), so a rank
  // with bad ids makes every rank fail instead of leaving them waiting.
  cpu::Routing routing;
  std::string local_error;
  std::vector<int32_t> counts;
  try {
    cfg.validate(comm.world_size());
    routing = cpu::build_routing(ids, tokens, cfg.topk, cfg.num_experts, 1);
    counts = routing.counts;
  } catch (const Error& e) {
    local_error = e.what();
  }
  comm.check_uniform("plan_dispatch",
                     {"num_experts", "topk", "hidden", "align", "wire format", "with_probs"},
                     {cfg.num_experts, cfg.topk, cfg.hidden, cfg.align,
                      static_cast<int64_t>(cfg.format), cfg.with_probs ? 1 : 0});
  DispatchPlan plan = exchange_counts(comm, cfg, counts.data(), tokens, local_error);
  plan.send_routing = std::move(routing);
  return plan;
}

// ---- row movement -----------------------------------------------------------------------------------
namespace {

// Messages of one peer and stream, the same on both sides (both know every chunk's size after
// the count exchange): walking the (peer, local expert) chunks in local-expert order, empty chunks
// skipped, a chunk of >= direct bytes is a message of its own, consecutive smaller chunks one
// message. Returns [first, end) chunk ranges.
std::vector<std::pair<int, int>> group_chunks(const std::vector<int64_t>& bytes, int64_t direct) {
  std::vector<std::pair<int, int>> groups;
  int open = -1, last = -1;  // current merged group: its first and last non-empty chunk
  auto flush = [&] {
    if (open >= 0) groups.push_back({open, last + 1});
    open = -1;
  };
  for (int i = 0; i < static_cast<int>(bytes.size()); ++i) {
    if (bytes[i] == 0) continue;
    if (bytes[i] >= direct) {
      flush();
      groups.push_back({i, i + 1});
    } else {
      if (open < 0) open = i;
      last = i;
    }
  }
  flush();
  return groups;
}

// What one dispatch_rows / combine_rows issues: local copies before the exchange (own chunks,
// gathers into staging), the grouped exchange, local copies after it (scatters out of staging).
struct ExchangeOps {
  std::vector<P2pOp> sends, recvs;
  std::vector<CopyPiece> before, after;
};

constexpr int64_t kStageAlign = 256;

// forward (dispatch): send side = send-order rows (contiguous per peer), recv side = padded rows.
// reverse (combine): send side = padded rows, recv side = send-order rows.
// stage == nullptr: only counts the staging bytes (returned).
int64_t build_ops(const DispatchPlan& plan, const std::vector<RowStream>& streams, bool forward,
                  int64_t direct, uint8_t* stage, ExchangeOps* ops, int l_begin, int l_end) {
  const int El = plan.local_experts;
  int64_t staged = 0;
  auto region = [&](int64_t bytes) {
    uint8_t* r = stage ? stage + staged : nullptr;
    staged += (bytes + kStageAlign - 1) / kStageAlign * kStageAlign;
    return r;
  };
  std::vector<int64_t> out_bytes(El), in_bytes(El);
  std::vector<const uint8_t*> out_ptr(El);
  std::vector<uint8_t*> in_ptr(El);
  for (int p = 0; p < plan.world; ++p) {
    for (const RowStream& s : streams) {
      const uint8_t* src = static_cast<const uint8_t*>(s.send);
      uint8_t* dst = static_cast<uint8_t*>(s.recv);
      for (int l = 0; l < El; ++l) {
        // this rank's send-order rows for global expert (p, l), and rank p's rows for local
        // expert l here (padded rows)
        // chunks of local experts outside [l_begin, l_end) are left out (as if empty)
        const bool in_range = l >= l_begin && l < l_end;
        const int64_t so = plan.send_offsets[p * El + l], sn = in_range ? plan.send_counts[p * El + l] : 0;
        const int64_t po = plan.recv_offsets[p * El + l], pn = in_range ? plan.recv_counts[p * El + l] : 0;
        if (forward) {
          out_bytes[l] = sn * s.row_bytes;
          out_ptr[l] = src ? src + so * s.row_bytes : nullptr;
          in_bytes[l] = pn * s.row_bytes;
          in_ptr[l] = dst ? dst + po * s.row_bytes : nullptr;
        } else {
          out_bytes[l] = pn * s.row_bytes;
          out_ptr[l] = src ? src + po * s.row_bytes : nullptr;
          in_bytes[l] = sn * s.row_bytes;
          in_ptr[l] = dst ? dst + so * s.row_bytes : nullptr;
        }
      }
      if (p == plan.rank) {  // own chunks: local copies (out and in describe the same rows)
        for (int l = 0; l < El; ++l)
          if (out_bytes[l] > 0 && ops) ops->before.push_back({out_ptr[l], in_ptr[l], out_bytes[l]});
        continue;
      }
      // the padded side is scattered: a group of several chunks is staged there
      const bool stage_out = !forward, stage_in = forward;
      for (const auto& g : group_chunks(out_bytes, direct)) {
        int64_t bytes = 0;
        for (int l = g.first; l < g.second; ++l) bytes += out_bytes[l];
        const uint8_t* from = out_ptr[g.first];
        if (stage_out && g.second - g.first > 1) {
          uint8_t* r = region(bytes);
          int64_t at = 0;
          for (int l = g.first; l < g.second; ++l) {
            if (out_bytes[l] > 0 && ops) ops->before.push_back({out_ptr[l], r + at, out_bytes[l]});
            at += out_bytes[l];
          }
          from = r;
        }
        if (ops) ops->sends.push_back({p, const_cast<uint8_t*>(from), bytes});
      }
      for (const auto& g : group_chunks(in_bytes, direct)) {
        int64_t bytes = 0;
        for (int l = g.first; l < g.second; ++l) bytes += in_bytes[l];
        uint8_t* to = in_ptr[g.first];
        if (stage_in && g.second - g.first > 1) {
          uint8_t* r = region(bytes);
          int64_t at = 0;
          for (int l = g.first; l < g.second; ++l) {
            if (in_bytes[l] > 0 && ops) ops->after.push_back({r + at, in_ptr[l], in_bytes[l]});
            at += in_bytes[l];
          }
          to = r;
        }
        if (ops) ops->recvs.push_back({p, to, bytes});
      }
    }
  }
  return staged;
}

void check_streams(const std::vector<RowStream>& streams, const DispatchPlan& plan, bool forward,
                   const char* what) {
  for (size_t i = 0; i < streams.size(); ++i) {
    const RowStream& s = streams[i];
    FLOWMOE_CHECK(s.row_bytes >= 1, what << ": stream " << i << " has row_bytes " << s.row_bytes
                                         << "; expected >= 1");
    const int64_t send_rows = forward ? plan.send_rows() : plan.recv_rows();
    const int64_t recv_rows = forward ? plan.recv_rows() : plan.send_rows();
    FLOWMOE_CHECK(s.send || send_rows == 0, what << ": stream " << i << " has a null send buffer");
    FLOWMOE_CHECK(s.recv || recv_rows == 0, what << ": stream " << i << " has a null recv buffer");
  }
}

void move_rows(Communicator& comm, const DispatchPlan& plan, const std::vector<RowStream>& streams,
               bool forward, int64_t direct_bytes, const char* what, int l_begin = 0, int l_end = -1) {
  check_plan(plan, comm, what);
  check_streams(streams, plan, forward, what);
  if (l_end < 0) l_end = plan.local_experts;
  FLOWMOE_CHECK(l_begin >= 0 && l_begin <= l_end && l_end <= plan.local_experts,
                what << ": local experts [" << l_begin << ", " << l_end << ") outside [0, "
                     << plan.local_experts << ")");
  const int64_t direct = direct_bytes < 0 ? kEpDirectBytes : direct_bytes;
  const int64_t staged = build_ops(plan, streams, forward, direct, nullptr, nullptr, l_begin, l_end);
  uint8_t* stage = static_cast<uint8_t*>(comm.scratch(staged));
  FLOWMOE_CHECK(stage || staged == 0, what << ": the communicator gave no scratch for " << staged
                                           << " staging bytes");
  ExchangeOps ops;
  build_ops(plan, streams, forward, direct, stage, &ops, l_begin, l_end);
  if (!ops.before.empty()) comm.copy_local(ops.before);
  comm.exchange(ops.sends, ops.recvs);
  if (!ops.after.empty()) comm.copy_local(ops.after);
}

}  // namespace

int64_t ep_direct_bytes_from_settings(const SettingLookup& lookup) {
  const char* v = lookup("FLOWMOE_EP_DIRECT_BYTES");
  if (v == nullptr || *v == '\0') return kEpDirectBytes;
  char* end = nullptr;
  const long long n = std::strtoll(v, &end, 10);
  FLOWMOE_CHECK(end != v && *end == '\0' && n >= 0,
                "FLOWMOE_EP_DIRECT_BYTES='" << v << "'; expected a byte count >= 0 (0: every "
                                                   "expert chunk its own message)");
  return n;
}

void dispatch_rows(Communicator& comm, const DispatchPlan& plan,
                   const std::vector<RowStream>& streams, int64_t direct_bytes) {
  move_rows(comm, plan, streams, true, direct_bytes, "dispatch_rows");
}

void combine_rows(Communicator& comm, const DispatchPlan& plan,
                  const std::vector<RowStream>& streams, int64_t direct_bytes) {
  move_rows(comm, plan, streams, false, direct_bytes, "combine_rows");
}

void combine_rows_experts(Communicator& comm, const DispatchPlan& plan,
                          const std::vector<RowStream>& streams, int expert_begin, int expert_end,
                          int64_t direct_bytes) {
  move_rows(comm, plan, streams, false, direct_bytes, "combine_rows_experts", expert_begin, expert_end);
}

void zero_padding_rows(const DispatchPlan& plan, void* rows, int64_t row_bytes) {
  uint8_t* b = static_cast<uint8_t*>(rows);
  for (int l = 0; l < plan.local_experts; ++l) {
    const int64_t first = plan.padded_offsets[l] + plan.expert_counts[l];
    const int64_t end = plan.padded_offsets[l + 1];
    if (end > first) std::memset(b + first * row_bytes, 0, (end - first) * row_bytes);
  }
}

// ---- CPU reference of the payloads ------------------------------------------------------------------
namespace {

// send-order gather of fixed-size token rows: out[row_map[t,s]] = in[t]
void gather_rows(const DispatchPlan& plan, const uint8_t* in, int64_t row_bytes, uint8_t* out) {
  const cpu::Routing& r = plan.send_routing;
  for (int64_t t = 0; t < r.tokens; ++t)
    for (int s = 0; s < r.topk; ++s) {
      const int32_t row = r.row_map[t * r.topk + s];
      if (row >= 0) std::memcpy(out + row * row_bytes, in + t * row_bytes, row_bytes);
    }
}
std::vector<float> gather_probs(const DispatchPlan& plan, const float* probs) {
  const cpu::Routing& r = plan.send_routing;
  std::vector<float> out(plan.send_rows(), 0.0f);
  for (int64_t t = 0; t < r.tokens; ++t)
    for (int s = 0; s < r.topk; ++s) {
      const int32_t row = r.row_map[t * r.topk + s];
      if (row >= 0) out[row] = probs[t * r.topk + s];
    }
  return out;
}

// Moves `streams` plus, with plan.with_probs, the probabilities (4 B per row) in one exchange,
// and zeroes the padding rows of every receive buffer.
void dispatch_with_probs(Communicator& comm, const DispatchPlan& plan,
                         std::vector<RowStream> streams, const float* probs, float* recv_probs) {
  std::vector<float> send_probs;
  if (plan.with_probs) {
    FLOWMOE_CHECK(probs || plan.tokens == 0, "dispatch: the plan moves probs but probs is null");
    FLOWMOE_CHECK(recv_probs || plan.padded_rows() == 0,
                  "dispatch: the plan moves probs but recv_probs is null");
    if (plan.tokens > 0) send_probs = gather_probs(plan, probs);
    streams.push_back({send_probs.data(), recv_probs, static_cast<int64_t>(sizeof(float))});
  }
  dispatch_rows(comm, plan, streams);
  for (const RowStream& s : streams)
    if (s.recv) zero_padding_rows(plan, s.recv, s.row_bytes);
}

}  // namespace

void ep_dispatch_bf16(Communicator& comm, const DispatchPlan& plan, const bf16_t* x,
                      const float* probs, bf16_t* out, float* recv_probs) {
  check_reference(plan, comm, "ep_dispatch_bf16");
  FLOWMOE_CHECK(x || plan.tokens == 0, "ep_dispatch_bf16: x is null");
  FLOWMOE_CHECK(out || plan.padded_rows() == 0, "ep_dispatch_bf16: out is null");
  const int64_t rb = 2 * plan.hidden;
  std::vector<uint8_t> send(plan.send_rows() * rb);
  gather_rows(plan, reinterpret_cast<const uint8_t*>(x), rb, send.data());
  dispatch_with_probs(comm, plan, {{send.data(), out, rb}}, probs, recv_probs);
}

void ep_dispatch_fp8(Communicator& comm, const DispatchPlan& plan, const uint8_t* codes,
                     const uint8_t* scales, const float* probs, uint8_t* out_codes,
                     uint8_t* out_scales, int64_t scale_ld, float* recv_probs) {
  check_reference(plan, comm, "ep_dispatch_fp8");
  FLOWMOE_CHECK(plan.format == WireFormat::kFp8,
                "ep_dispatch_fp8: the plan's wire format is " << wire_format_name(plan.format)
                                                              << "; expected fp8");
  FLOWMOE_CHECK(scale_ld >= plan.padded_rows(),
                "ep_dispatch_fp8: scale_ld " << scale_ld << " < Mp = " << plan.padded_rows());
  FLOWMOE_CHECK((codes && scales) || plan.tokens == 0, "ep_dispatch_fp8: null input");
  FLOWMOE_CHECK((out_codes && out_scales) || plan.padded_rows() == 0, "ep_dispatch_fp8: null output");
  const int64_t h = plan.hidden, nc = h / kFp8Block, T = plan.tokens;
  std::vector<uint8_t> send_codes(plan.send_rows() * h), send_scales(plan.send_rows() * nc);
  gather_rows(plan, codes, h, send_codes.data());
  // Scales on the wire: row-major [rows][H/128], next to their codes.
  const cpu::Routing& r = plan.send_routing;
  for (int64_t t = 0; t < T; ++t)
    for (int s = 0; s < r.topk; ++s) {
      const int32_t row = r.row_map[t * r.topk + s];
      if (row < 0) continue;
      for (int64_t c = 0; c < nc; ++c) send_scales[row * nc + c] = scales[c * T + t];
    }
  std::vector<uint8_t> recv_scales(plan.padded_rows() * nc);
  dispatch_with_probs(comm, plan,
                      {{send_codes.data(), out_codes, h}, {send_scales.data(), recv_scales.data(), nc}},
                      probs, recv_probs);
  // The receiver's one relayout: [Mp][H/128] -> [H/128][scale_ld] (the GEMM's layout).
  for (int64_t row = 0; row < plan.padded_rows(); ++row)
    for (int64_t c = 0; c < nc; ++c) out_scales[c * scale_ld + row] = recv_scales[row * nc + c];
}

void ep_dispatch_mxfp4(Communicator& comm, const DispatchPlan& plan, const uint8_t* codes,
                       const uint8_t* scales, const float* probs, uint8_t* out_codes,
                       uint8_t* out_scales, float* recv_probs) {
  check_reference(plan, comm, "ep_dispatch_mxfp4");
  FLOWMOE_CHECK(plan.format == WireFormat::kMxfp4,
                "ep_dispatch_mxfp4: the plan's wire format is " << wire_format_name(plan.format)
                                                                << "; expected mxfp4");
  FLOWMOE_CHECK((codes && scales) || plan.tokens == 0, "ep_dispatch_mxfp4: null input");
  FLOWMOE_CHECK((out_codes && out_scales) || plan.padded_rows() == 0,
                "ep_dispatch_mxfp4: null output");
  const int64_t cb = plan.hidden / 2, sb = plan.hidden / kFp4Block;
  std::vector<uint8_t> send_codes(plan.send_rows() * cb), send_scales(plan.send_rows() * sb);
  gather_rows(plan, codes, cb, send_codes.data());
  gather_rows(plan, scales, sb, send_scales.data());
  dispatch_with_probs(comm, plan,
                      {{send_codes.data(), out_codes, cb}, {send_scales.data(), out_scales, sb}},
                      probs, recv_probs);
}

void ep_combine_bf16(Communicator& comm, const DispatchPlan& plan, const bf16_t* y_rows,
                     const float* probs, bf16_t* y) {
  check_reference(plan, comm, "ep_combine_bf16");
  FLOWMOE_CHECK(y_rows || plan.padded_rows() == 0, "ep_combine_bf16: y_rows is null");
  FLOWMOE_CHECK(y || plan.tokens == 0, "ep_combine_bf16: y is null");
  const int64_t rb = 2 * plan.hidden;
  std::vector<bf16_t> back(plan.send_rows() * plan.hidden);
  combine_rows(comm, plan, {{y_rows, back.data(), rb}});
  // The reduction runs here, on the token's own rank, in slot order (send_routing has align 1, so
  // its row_map addresses the send-order rows that just came back).
  if (plan.tokens > 0) cpu::unpermute_unpad(back.data(), probs, plan.hidden, plan.send_routing, y);
}

void ep_reference_forward(Communicator& comm, const EpConfig& cfg, const bf16_t* x,
                          const int32_t* ids, const float* probs, int64_t tokens,
                          const ExpertFn& expert, bf16_t* y) {
  EpConfig c = cfg;
  c.format = WireFormat::kBf16;
  c.with_probs = false;  // the probabilities weight the combine on the token's own rank here
  const DispatchPlan plan = plan_dispatch(comm, c, ids, tokens);
  const int64_t h = plan.hidden, mp = plan.padded_rows();
  std::vector<bf16_t> rows(mp * h), out(mp * h, 0);
  ep_dispatch_bf16(comm, plan, x, nullptr, rows.data(), nullptr);
  for (int l = 0; l < plan.local_experts; ++l) {
    const int64_t first = plan.padded_offsets[l], n = plan.padded_offsets[l + 1] - first;
    if (n > 0)
      expert(plan.rank * plan.local_experts + l, rows.data() + first * h, n, out.data() + first * h);
  }
  zero_padding_rows(plan, out.data(), 2 * h);
  ep_combine_bf16(comm, plan, out.data(), probs, y);
}

}  // namespace flowmoe
