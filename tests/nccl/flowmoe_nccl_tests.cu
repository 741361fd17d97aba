// flowmoe_nccl_tests: the NCCL communicator and the expert-parallel CUDA layer on TWO GPUs, one
// process per GPU (issue 7; docs/EP.md §4, §7). NOT YET RUN ON GPUs: written and compiled on a
// machine without a GPU.
//
// Run it with no arguments: the parent process counts the visible GPUs (fewer than 2: prints
// SKIPPED and exits 77, CTest's skip code), then runs each scenario as its own launch of two
// ranks (launch_local_ranks_ex: RANK / WORLD_SIZE / LOCAL_RANK / MASTER_ADDR / MASTER_PORT, the
// NCCL unique id broadcast by rank 0 over TCP, NCCL_NVLS_ENABLE=0) under a watchdog, checks each
// rank's exit status and prints one line per scenario. The whole run is bounded (< 90 s by
// default: --budget) even when a rank hangs: the watchdog SIGTERMs, then SIGKILLs, the ranks.
//
// Scenarios (--scenarios a,b,...; default payload,layer,mismatch,dead-rank):
//   payload    dispatch_rows / combine_rows over NCCL with device buffers, every wire format (bf16,
//              fp8 with its 1x128 UE8M0 scales gathered from the column layout and relaid on
//              arrival, fp8-fp32scale, mxfp4), each row's bytes a function of (source rank, token,
//              byte) and its probability (rank, token, slot): every byte lands at the plan's row,
//              padding rows are untouched, combine restores the send rows; the device
//              build_routing's send order equals the plan's; planned wire bytes = the ops' bytes.
//              Shapes: H 256 E 8 k 2 T {37, 64}; T {0, 50} (a rank with no tokens); H 7168 E 16
//              k 8 T {256, 200} (DeepSeek-V3's row size).
//   layer      the EP = 2 CUDA layer over NCCL against one CUDA layer holding all experts on the
//              concatenated batch (each rank computes that reference itself on its own GPU): y,
//              dx, dW1, dW2 bit-identical, dWr and y bit-identical to one GPU on the rank's own
//              tokens; every recipe; three cases (softmax A 16; sigmoid + renorm A 128 with the
//              larger batch on rank 0; a router bias that leaves rank 1's experts without rows).
//   mismatch   a configuration that differs across ranks (layer ffn, dispatch num_experts) is a
//              CommError naming the field on BOTH ranks, at once (no timeout involved); the
//              communicator stays usable; T > max_tokens on rank 1 fails both ranks at once.
//   dead-rank  rank 1 exits abruptly (_exit(42)) after a barrier; rank 0's next exchange must end
//              in a CommError within the communicator's timeout (4 s) + 3 s (ncclCommAbort must
//              return), and the communicator stays failed (sticky error).
//   size-mismatch (opt-in) sizes that differ between a send and its recv (NCCL cannot detect it):
//              both ranks must end in a CommError (timeout + abort) within 3 timeouts.
//
// Options (parent): --scenarios LIST, --budget S (default 85), --port P (first MASTER_PORT),
// --verbose (NCCL_DEBUG=WARN in the ranks unless set).
#include <cuda_runtime.h>
#include <signal.h>
#include <unistd.h>

#include <algorithm>
#include <chrono>
#include <cstdarg>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <functional>
#include <memory>
#include <random>
#include <sstream>
#include <string>
#include <thread>
#include <vector>

#include "cuda/moe/kernels.cuh"
#include "cuda/moe_ep_model.h"
#include "flowmoe/comm.h"
#include "flowmoe/error.h"
#include "flowmoe/moe.h"
#include "flowmoe/token.h"

namespace flowmoe {
namespace {

using Clock = std::chrono::steady_clock;
using namespace eptest;

double since(Clock::time_point t0) { return std::chrono::duration<double>(Clock::now() - t0).count(); }

constexpr int kDeliberateExit = 42;  // the dead rank's exit status

// ---- per-rank reporting ---------------------------------------------------------------------------
int g_rank = -1;
std::string g_scenario;
int g_failures = 0;

void say(const char* fmt, ...) __attribute__((format(printf, 1, 2)));
void say(const char* fmt, ...) {
  char buf[2048];
  va_list ap;
  va_start(ap, fmt);
  std::vsnprintf(buf, sizeof buf, fmt, ap);
  va_end(ap);
  std::printf("[rank %d %s] %s\n", g_rank, g_scenario.c_str(), buf);
  std::fflush(stdout);
}
void check(bool ok, const std::string& what) {
  if (!ok) {
    ++g_failures;
    say("FAIL: %s", what.c_str());
  }
}
#define CUDA_OK(expr)                                                                  \
  do {                                                                                 \
    cudaError_t e_ = (expr);                                                           \
    FLOWMOE_CHECK(e_ == cudaSuccess, #expr << ": " << cudaGetErrorString(e_));         \
  } while (0)

// Every rank's routing ids, the same on every rank (seeded): distinct experts per token, about
// one slot in seven dropped.
std::vector<std::vector<int32_t>> make_ids(const std::vector<int64_t>& tokens, int E, int k,
                                           uint32_t seed) {
  std::mt19937 rng(seed);
  std::vector<std::vector<int32_t>> ids(tokens.size());
  for (size_t r = 0; r < tokens.size(); ++r)
    for (int64_t t = 0; t < tokens[r]; ++t) {
      std::vector<int32_t> e(E);
      for (int i = 0; i < E; ++i) e[i] = i;
      std::shuffle(e.begin(), e.end(), rng);
      for (int s = 0; s < k; ++s) ids[r].push_back(rng() % 7 == 0 ? -1 : e[s]);
    }
  return ids;
}

uint8_t pattern(int stream, int rank, int64_t token, int64_t byte) {
  uint64_t h = 0x9E3779B97F4A7C15ull * (uint64_t(stream) + 1) ^ (uint64_t(rank) << 40) ^
               (uint64_t(token) << 16) ^ uint64_t(byte);
  h ^= h >> 29;
  h *= 0xBF58476D1CE4E5B9ull;
  h ^= h >> 32;
  return uint8_t(h);
}

// ---- (a) payload placement --------------------------------------------------------------------------
void payload_case(Communicator& comm, WireFormat f, int64_t H, int E, int k,
                  const std::vector<int64_t>& tokens, int A, uint32_t seed) {
  const int W = comm.world_size(), me = comm.rank(), El = E / W;
  const int64_t T = tokens[me];
  const auto ids = make_ids(tokens, E, k, seed);
  std::ostringstream nm;
  nm << wire_format_name(f) << " H " << H << " E " << E << " k " << k << " T {" << tokens[0]
     << "," << tokens[1] << "} A " << A;
  const std::string name = nm.str();
  cudaStream_t s = nullptr;
  CUDA_OK(cudaStreamCreateWithFlags(&s, cudaStreamNonBlocking));
  EpConfig ec;
  ec.num_experts = E;
  ec.topk = k;
  ec.hidden = H;
  ec.align = A;
  ec.format = f;
  ec.with_probs = true;
  const DispatchPlan plan = plan_dispatch(comm, ec, ids[me].data(), T);
  const int64_t S = plan.send_rows(), Mp = plan.padded_rows();

  // device routing of this rank's ids: row_map_unpadded must be the plan's send order
  const DeviceRouting dr(ids[me].data(), T, k, E, A, s);
  const Dev<int32_t>& rmu = dr.row_map_unpadded;
  if (T > 0) check(rmu.get(s) == plan.send_routing.row_map, name + ": device row_map_unpadded != plan send order");

  // streams: codes rows, scale rows (fp8 variants: gathered from the column layout [nc][T] as
  // the layer does; mxfp4: row layout), probs (per slot)
  const int64_t cb = wire_code_bytes(f, H), sb = wire_scale_bytes(f, H);
  const bool col_scales = f == WireFormat::kFp8 || f == WireFormat::kFp8Fp32Scale;
  const int64_t nc = H / 128, scale_elem = f == WireFormat::kFp8Fp32Scale ? 4 : 1;
  std::vector<uint8_t> h_codes(T * cb), h_scales(T * sb);
  for (int64_t t = 0; t < T; ++t)
    for (int64_t b = 0; b < cb; ++b) h_codes[t * cb + b] = pattern(0, me, t, b);
  for (int64_t t = 0; t < T; ++t)
    for (int64_t b = 0; b < sb; ++b) {
      const uint8_t v = pattern(1, me, t, b);
      if (col_scales) {  // column layout [nc][T] of elements of scale_elem bytes
        const int64_t c = b / scale_elem, j = b % scale_elem;
        h_scales[(c * T + t) * scale_elem + j] = v;
      } else {
        h_scales[t * sb + b] = v;
      }
    }
  std::vector<int32_t> h_probs(T * k);
  for (int64_t t = 0; t < T; ++t)
    for (int sl = 0; sl < k; ++sl) h_probs[t * k + sl] = (me << 24) | int32_t(t << 4) | sl;
  Dev<uint8_t> d_codes(T * cb, s, h_codes.data()), d_scales(T * sb, s, h_scales.data());
  Dev<int32_t> d_probs(T * k, s, h_probs.data());
  Dev<uint8_t> send_c(S * cb, s), send_s(S * sb, s), recv_c(Mp * cb, s), recv_s(Mp * sb, s);
  Dev<int32_t> send_p(S, s), recv_p(Mp, s);
  Dev<uint8_t> back_c(S * cb, s);
  if (T > 0) {
    cuda::moe::ep_gather_rows(d_codes.p, cb, false, rmu.p, T, k, send_c.p, s);
    if (col_scales)
      cuda::moe::ep_gather_col_scales(d_scales.p, nc, int(scale_elem), rmu.p, T, k, send_s.p, s);
    else if (sb > 0)  // bf16 has no scale stream
      cuda::moe::ep_gather_rows(d_scales.p, sb, false, rmu.p, T, k, send_s.p, s);
    cuda::moe::ep_gather_rows(d_probs.p, 4, true, rmu.p, T, k, send_p.p, s);
  }
  CUDA_OK(cudaMemsetAsync(recv_c.p, 0xA5, std::max<int64_t>(Mp * cb, 1), s));
  CUDA_OK(cudaMemsetAsync(recv_s.p, 0xA5, std::max<int64_t>(Mp * sb, 1), s));
  CUDA_OK(cudaMemsetAsync(recv_p.p, 0xA5, std::max<int64_t>(Mp * 4, 1), s));
  CUDA_OK(cudaStreamSynchronize(s));
  const auto t0 = Clock::now();
  std::vector<RowStream> streams{{send_c.p, recv_c.p, cb}, {send_p.p, recv_p.p, 4}};
  if (sb > 0) streams.push_back({send_s.p, recv_s.p, sb});
  dispatch_rows(comm, plan, streams);
  comm.synchronize();
  const double t_disp = since(t0);
  const std::vector<uint8_t> gc = recv_c.get(s), gs = recv_s.get(s);
  const std::vector<int32_t> gp = recv_p.get(s);
  int64_t bad_rows = 0, bad_pad = 0, rows_checked = 0;
  for (int l = 0; l < El; ++l) {
    int64_t row = plan.padded_offsets[l];
    const int g = me * El + l;
    for (int p = 0; p < W; ++p)
      for (int64_t t = 0; t < tokens[p]; ++t)
        for (int sl = 0; sl < k; ++sl) {
          if (ids[p][t * k + sl] != g) continue;
          bool ok = row < Mp && gp[row] == ((p << 24) | int32_t(t << 4) | sl);
          for (int64_t b = 0; ok && b < cb; ++b) ok = gc[row * cb + b] == pattern(0, p, t, b);
          for (int64_t b = 0; ok && b < sb; ++b) ok = gs[row * sb + b] == pattern(1, p, t, b);
          if (!ok && bad_rows++ == 0)
            say("%s: local expert %d row %lld does not hold (rank %d, token %lld, slot %d)", name.c_str(), l,
                static_cast<long long>(row), p, static_cast<long long>(t), sl);
          ++row;
          ++rows_checked;
        }
    check(row == plan.padded_offsets[l] + plan.expert_counts[l], name + ": row count of a local expert");
    for (; row < plan.padded_offsets[l + 1]; ++row) {
      bool untouched = gp[row] == int32_t(0xA5A5A5A5);
      for (int64_t b = 0; untouched && b < cb; ++b) untouched = gc[row * cb + b] == 0xA5;
      if (!untouched) ++bad_pad;
    }
  }
  check(bad_rows == 0, name + ": " + std::to_string(bad_rows) + " rows misplaced");
  check(bad_pad == 0, name + ": " + std::to_string(bad_pad) + " padding rows written");
  // FP8 scales relaid to the GEMM's [nc][Mp] layout on arrival (the layer's path)
  if (col_scales && Mp > 0) {
    Dev<uint8_t> relaid(nc * Mp * scale_elem, s);
    cuda::moe::ep_transpose_scales(recv_s.p, Mp, nc, int(scale_elem), relaid.p, Mp, s);
    const std::vector<uint8_t> rl = relaid.get(s);
    int64_t bad = 0;
    for (int64_t r = 0; r < Mp; ++r)
      for (int64_t c = 0; c < nc; ++c)
        for (int64_t j = 0; j < scale_elem; ++j)
          if (rl[(c * Mp + r) * scale_elem + j] != gs[r * sb + c * scale_elem + j]) ++bad;
    check(bad == 0, name + ": ep_transpose_scales relayout differs in " + std::to_string(bad) + " bytes");
  }
  // planned wire bytes = the bytes of the ops to other ranks
  int64_t ops_bytes = 0;
  for (int p = 0; p < W; ++p)
    if (p != me) ops_bytes += plan.rows_to(p) * (cb + sb + 4);
  check(plan.wire_bytes(f, true) == ops_bytes, name + ": plan.wire_bytes != bytes of the ops");
  // and back: every padded row returns to its send row
  const auto t1 = Clock::now();
  combine_rows(comm, plan, {{recv_c.p, back_c.p, cb}});
  comm.synchronize();
  const double t_comb = since(t1);
  check(back_c.get(s) == send_c.get(s), name + ": combine did not restore the send rows");
  say("%s: %lld rows checked (%lld sent, %lld padded rows here), %.4f B/element on the wire (+4 B/row prob), "
      "dispatch %.2f ms, combine %.2f ms (host wall, first call)",
      name.c_str(), static_cast<long long>(rows_checked), static_cast<long long>(S),
      static_cast<long long>(Mp), wire_bytes_per_element(f, H), t_disp * 1e3, t_comb * 1e3);
  CUDA_OK(cudaStreamDestroy(s));
}

void scenario_payload(Communicator& comm) {
  for (WireFormat f : {WireFormat::kBf16, WireFormat::kFp8, WireFormat::kFp8Fp32Scale, WireFormat::kMxfp4}) {
    payload_case(comm, f, 256, 8, 2, {37, 64}, 16, 11);
    payload_case(comm, f, 256, 8, 2, {0, 50}, 128, 12);
    payload_case(comm, f, 7168, 16, 8, {256, 200}, 128, 13);
  }
}

// ---- (b) the EP = 2 layer against one GPU holding all experts -------------------------------------
template <typename T>
int64_t count_diff(const std::vector<T>& a, const std::vector<T>& b, size_t off, size_t n) {
  if (a.size() != n || off + n > b.size()) return -1;
  int64_t bad = 0;
  for (size_t i = 0; i < n; ++i) bad += std::memcmp(&a[i], &b[off + i], sizeof(T)) != 0;
  return bad;
}

void layer_case(Communicator& comm, const Model& m, const std::string& label) {
  const int W = comm.world_size(), r = comm.rank(), El = kE / W;
  const std::string name = std::string(recipe_name(m.cfg.recipe)) + " " + label;
  MoeConfig cfg = m.cfg;
  cfg.max_tokens = m.max_tokens();
  cfg.comm = &comm;
  const auto t0 = Clock::now();
  const Out ep = run_gpu_one(cfg, m, r * El, El, m.x[r].data(), m.dy[r].data(), m.tokens[r]);
  const double t_ep = since(t0);
  MoeConfig one_cfg = m.cfg;
  one_cfg.max_tokens = m.total_tokens();
  const std::vector<bf16_t> xa = m.concat(m.x), dya = m.concat(m.dy);
  const Out one = run_gpu_one(one_cfg, m, 0, kE, xa.data(), dya.data(), m.total_tokens());
  MoeConfig own_cfg = m.cfg;
  own_cfg.max_tokens = m.max_tokens();
  const Out own = run_gpu_one(own_cfg, m, 0, kE, m.x[r].data(), m.dy[r].data(), m.tokens[r]);
  size_t tok0 = 0;
  for (int p = 0; p < r; ++p) tok0 += m.tokens[p];
  const size_t nt = m.tokens[r] * kH, n1 = size_t(El) * 2 * kF * kH, n2 = size_t(El) * kH * kF;
  const int64_t dy_ = count_diff(ep.y, one.y, tok0 * kH, nt), ddx = count_diff(ep.dx, one.dx, tok0 * kH, nt),
                dw1 = count_diff(ep.dw1, one.dw1, r * n1, n1), dw2 = count_diff(ep.dw2, one.dw2, r * n2, n2),
                dwr = count_diff(ep.dwr, own.dwr, 0, own.dwr.size()), dyo = count_diff(ep.y, own.y, 0, nt);
  check(dy_ == 0, name + ": y differs from one GPU in " + std::to_string(dy_) + " elements");
  check(ddx == 0, name + ": dx differs from one GPU in " + std::to_string(ddx) + " elements");
  check(dw1 == 0, name + ": dW1 differs from one GPU in " + std::to_string(dw1) + " elements");
  check(dw2 == 0, name + ": dW2 differs from one GPU in " + std::to_string(dw2) + " elements");
  check(dwr == 0, name + ": dWr differs from the own-token run in " + std::to_string(dwr) + " elements");
  check(dyo == 0, name + ": y differs from the own-token run in " + std::to_string(dyo) + " elements");
  check(ep.st.nonfinite == 0, name + ": non-finite values");
  int64_t wire_fwd = 0, wire_bwd = 0;
  for (const WireTransfer& w : ep.rep.wire) (w.pass == MoePass::kForward ? wire_fwd : wire_bwd) += w.bytes;
  say("%s: y, dx, dW1, dW2 %s one GPU's bits; dWr %s; T %lld, %lld routed / %lld padded rows here, "
      "wire %lld B fwd / %lld B bwd (%.0f / %.0f B/token); EP layer %.2f s (first call)",
      name.c_str(), dy_ == 0 && ddx == 0 && dw1 == 0 && dw2 == 0 ? "=" : "!=", dwr == 0 ? "=" : "!=",
      static_cast<long long>(m.tokens[r]), static_cast<long long>(ep.rep.routed_rows),
      static_cast<long long>(ep.rep.padded_rows), static_cast<long long>(wire_fwd),
      static_cast<long long>(wire_bwd), m.tokens[r] ? double(wire_fwd) / m.tokens[r] : 0.0,
      m.tokens[r] ? double(wire_bwd) / m.tokens[r] : 0.0, t_ep);
}

void scenario_layer(Communicator& comm) {
  for (Recipe rc : all_recipes()) {
    layer_case(comm, make_model(rc, {37, 64}, 16, RouterScore::kSoftmax, false, 101), "T={37,64} A16 softmax");
    layer_case(comm, make_model(rc, {64, 37}, 128, RouterScore::kSigmoid, true, 102),
               "T={64,37} A128 sigmoid+renorm");
    Model m = make_model(rc, {37, 64}, 16, RouterScore::kSoftmax, false, 7);
    m.bias.assign(kE, 0.0f);
    m.bias[0] = m.bias[1] = 100.0f;  // every token to experts 0 and 1: rank 1 receives no row
    layer_case(comm, m, "rank 1 without rows");
  }
}

// ---- (c) mismatched configuration ----------------------------------------------------------------
// Runs fn, expects a CommError (or Error when own_error) containing `needle`, within `limit_s`.
void expect_error(const std::string& what, const std::function<void()>& fn, const std::string& needle,
                  double limit_s, bool comm_error = true) {
  const auto t0 = Clock::now();
  std::string got;
  bool is_comm = false, threw = false;
  try {
    fn();
  } catch (const CommError& e) {
    threw = is_comm = true;
    got = e.what();
  } catch (const Error& e) {
    threw = true;
    got = e.what();
  }
  const double dt = since(t0);
  check(threw, what + ": no error");
  check(!threw || is_comm == comm_error, what + ": expected " + (comm_error ? "CommError" : "Error (own)") +
                                             ", got " + (is_comm ? "CommError" : "Error") + ": " + got);
  check(got.find(needle) != std::string::npos, what + ": message lacks '" + needle + "': " + got);
  check(dt <= limit_s, what + ": took " + std::to_string(dt) + " s (limit " + std::to_string(limit_s) + ")");
  say("%s: %s after %.3f s: %s", what.c_str(), threw ? (is_comm ? "CommError" : "Error") : "no error", dt,
      got.c_str());
}

void scenario_mismatch(Communicator& comm) {
  const int r = comm.rank();
  Model m = make_model(Recipe::kFlow, {16, 16}, 16, RouterScore::kSoftmax, false, 3);
  MoeConfig cfg = m.cfg;
  cfg.max_tokens = 16;
  cfg.comm = &comm;
  cudaStream_t s = nullptr;
  CUDA_OK(cudaStreamCreateWithFlags(&s, cudaStreamNonBlocking));
  {
    MoeConfig c = cfg;
    if (r == 1) c.ffn = 256;
    expect_error("make_cuda_layer with ffn 128 / 256", [&] { make_cuda_layer(c, s); }, "ffn", 5.0);
  }
  {
    MoeConfig c = cfg;
    if (r == 1) c.recipe = Recipe::kBf16;
    expect_error("make_cuda_layer with recipe flow / bf16", [&] { make_cuda_layer(c, s); }, "recipe", 5.0);
  }
  {
    EpConfig ec;
    ec.num_experts = r == 1 ? 6 : 8;
    ec.topk = 2;
    ec.hidden = 256;
    std::vector<int32_t> ids(16 * 2, 0);
    expect_error("plan_dispatch with num_experts 8 / 6", [&] { plan_dispatch(comm, ec, ids.data(), 16); },
                 "num_experts", 5.0);
  }
  // still usable: a barrier and a correct layer pass
  comm.barrier();
  {
    const int El = kE / comm.world_size();
    std::unique_ptr<MoeLayer> layer = make_cuda_layer(cfg, s);
    Dev<float> w1(int64_t(El) * 2 * kF * kH, s, m.w1.data() + int64_t(r * El) * 2 * kF * kH);
    Dev<float> w2(int64_t(El) * kH * kF, s, m.w2.data() + int64_t(r * El) * kH * kF);
    Dev<float> wr(m.wr.size(), s, m.wr.data());
    Dev<bf16_t> x(64 * kH, s), y(64 * kH, s);
    layer->set_weights(MoeWeights{w1.p, w2.p, wr.p, nullptr});
    // T > max_tokens on rank 1 only: rank 1 its own Error, rank 0 a CommError at once
    const int64_t T = r == 1 ? 64 : 16;
    if (r == 1)
      expect_error("forward with T 64 > max_tokens 16 on rank 1", [&] { layer->forward(x.p, T, y.p); },
                   "max_tokens", 5.0, false);
    else
      expect_error("forward while rank 1 passes T > max_tokens", [&] { layer->forward(x.p, T, y.p); },
                   "rank 1", 5.0);
    layer->forward(x.p, 16, y.p);  // the next forward works on both
    CUDA_OK(cudaStreamSynchronize(s));
    say("a correct forward after the errors: ok");
  }
  CUDA_OK(cudaStreamDestroy(s));
}

// ---- (d) a rank that dies ---------------------------------------------------------------------------
void scenario_dead_rank(Communicator& comm) {
  comm.set_timeout_s(4.0);
  comm.barrier();
  const int r = comm.rank();
  const int64_t bytes = 1 << 20;
  void* sb = nullptr;
  void* rb = nullptr;
  CUDA_OK(cudaMalloc(&sb, bytes));
  CUDA_OK(cudaMalloc(&rb, bytes));
  // one healthy exchange first (both alive)
  comm.exchange({{1 - r, sb, bytes}}, {{1 - r, rb, bytes}});
  comm.synchronize();
  comm.barrier();
  if (r == 1) {
    say("exiting abruptly with status %d (deliberate)", kDeliberateExit);
    std::fflush(nullptr);
    ::_exit(kDeliberateExit);
  }
  std::this_thread::sleep_for(std::chrono::milliseconds(300));  // let the peer die first
  const auto t0 = Clock::now();
  std::string got;
  bool comm_error = false;
  try {
    comm.exchange({{1, sb, bytes}}, {{1, rb, bytes}});
    comm.synchronize();
  } catch (const CommError& e) {
    comm_error = true;
    got = e.what();
  } catch (const Error& e) {
    got = std::string("(Error, not CommError) ") + e.what();
  }
  const double dt = since(t0);
  check(comm_error, "the exchange with a dead peer did not end in a CommError: " + got);
  check(dt < comm.timeout_s() + 3.0, "CommError after " + std::to_string(dt) + " s (timeout 4 s + 3 s allowed)");
  say("exchange with the dead rank: %s after %.2f s (timeout %.1f s): %s", comm_error ? "CommError" : "no CommError",
      dt, comm.timeout_s(), got.c_str());
  // sticky: later calls fail at once
  const auto t1 = Clock::now();
  bool again = false;
  try {
    comm.barrier();
  } catch (const CommError&) {
    again = true;
  }
  check(again && since(t1) < 1.0, "a call after the failure did not throw a CommError at once");
  check(!comm.error().empty(), "comm.error() empty after the failure");
  say("later call: %s after %.3f s; error(): %s", again ? "CommError" : "no error", since(t1), comm.error().c_str());
  cudaFree(sb);
  cudaFree(rb);
}

// ---- (opt-in) sizes that differ between a send and its recv ----------------------------------------
void scenario_size_mismatch(Communicator& comm) {
  comm.set_timeout_s(4.0);
  comm.barrier();
  const int r = comm.rank();
  void* sb = nullptr;
  void* rb = nullptr;
  CUDA_OK(cudaMalloc(&sb, 1 << 20));
  CUDA_OK(cudaMalloc(&rb, 1 << 20));
  // rank 0 sends 4096 B to rank 1, which expects 8192 B; the other direction matches
  const int64_t send_b = 4096, recv_b = r == 0 ? 4096 : 8192;
  const auto t0 = Clock::now();
  std::string got;
  bool comm_error = false;
  try {
    comm.exchange({{1 - r, sb, send_b}}, {{1 - r, rb, recv_b}});
    comm.synchronize();
    comm.barrier();  // the rank whose transfer completed learns of its peer's failure here
    comm.barrier();
  } catch (const CommError& e) {
    comm_error = true;
    got = e.what();
  }
  const double dt = since(t0);
  check(comm_error, "mismatched send/recv sizes did not end in a CommError");
  check(dt < 3 * comm.timeout_s() + 3.0, "CommError after " + std::to_string(dt) + " s");
  say("send %lld B / recv %lld B: %s after %.2f s: %s", static_cast<long long>(send_b),
      static_cast<long long>(recv_b), comm_error ? "CommError" : "no error", dt, got.c_str());
  cudaFree(sb);
  cudaFree(rb);
}

int rank_main(const std::string& scenario) {
  g_scenario = scenario;
  const BootstrapEnv env = bootstrap_env_from_environment();
  g_rank = env.rank;
  try {
    CUDA_OK(cudaSetDevice(env.local_rank));
    cudaDeviceProp prop{};
    CUDA_OK(cudaGetDeviceProperties(&prop, env.local_rank));
    NcclCommOptions opt;
    opt.timeout_s = 30.0;  // initialisation (first NCCL init on a machine can take seconds)
    const auto t0 = Clock::now();
    std::unique_ptr<Communicator> comm = make_nccl_comm_from_env(opt);
    comm->set_timeout_s(20.0);
    say("device %d (%s, bus %02x:%02x), NCCL communicator of %d ranks ready after %.2f s",
        env.local_rank, prop.name, prop.pciBusID, prop.pciDeviceID, comm->world_size(), since(t0));
    if (scenario == "payload") scenario_payload(*comm);
    else if (scenario == "layer") scenario_layer(*comm);
    else if (scenario == "mismatch") scenario_mismatch(*comm);
    else if (scenario == "dead-rank") scenario_dead_rank(*comm);
    else if (scenario == "size-mismatch") scenario_size_mismatch(*comm);
    else FLOWMOE_CHECK(false, "unknown scenario '" << scenario << "'");
    const auto t1 = Clock::now();
    comm.reset();  // finalize + destroy (or abort after an error), bounded by the timeout
    say("communicator destroyed in %.2f s", since(t1));
  } catch (const std::exception& e) {
    ++g_failures;
    say("FAIL: exception: %s", e.what());
  }
  say("%s (%d failure%s)", g_failures ? "FAILED" : "PASSED", g_failures, g_failures == 1 ? "" : "s");
  std::fflush(nullptr);
  return g_failures ? 1 : 0;
}

// ---- parent -------------------------------------------------------------------------------------------
std::string self_exe() {
  char buf[4096];
  const ssize_t n = ::readlink("/proc/self/exe", buf, sizeof buf - 1);
  FLOWMOE_CHECK(n > 0, "cannot read /proc/self/exe");
  buf[n] = 0;
  return buf;
}

struct Scenario {
  const char* name;
  double limit_s;  // watchdog of this scenario's launch
};
const Scenario kScenarios[] = {
    {"payload", 20.0}, {"layer", 35.0}, {"mismatch", 12.0}, {"dead-rank", 14.0}, {"size-mismatch", 25.0}};

int parent_main(int argc, char** argv) {
  std::string list = "payload,layer,mismatch,dead-rank";
  double budget = 85.0;
  int port = 29600 + int(::getpid() % 400) * 8;
  bool verbose = false;
  for (int i = 1; i < argc; ++i) {
    const std::string a = argv[i];
    auto val = [&]() -> std::string {
      FLOWMOE_CHECK(i + 1 < argc, a << " needs a value");
      return argv[++i];
    };
    if (a == "--scenarios") list = val();
    else if (a == "--budget") budget = std::atof(val().c_str());
    else if (a == "--port") port = std::atoi(val().c_str());
    else if (a == "--verbose") verbose = true;
    else if (a == "--help" || a == "-h") {
      std::printf("usage: flowmoe_nccl_tests [--scenarios payload,layer,mismatch,dead-rank[,size-mismatch]] "
                  "[--budget S] [--port P] [--verbose]\n(see the top of tests/nccl/flowmoe_nccl_tests.cu)\n");
      return 0;
    } else {
      std::fprintf(stderr, "flowmoe_nccl_tests: unknown argument '%s'\n", a.c_str());
      return 2;
    }
  }
  int ndev = 0;
  const cudaError_t e = cudaGetDeviceCount(&ndev);
  if (e != cudaSuccess || ndev < 2) {
    std::printf("SKIPPED: flowmoe_nccl_tests needs 2 GPUs; %d visible%s%s\n", e == cudaSuccess ? ndev : 0,
                e == cudaSuccess ? "" : ": ", e == cudaSuccess ? "" : cudaGetErrorString(e));
    return 77;
  }
  std::vector<std::string> names;
  {
    std::stringstream ss(list);
    std::string n;
    while (std::getline(ss, n, ','))
      if (!n.empty()) names.push_back(n);
  }
  const std::string exe = self_exe();
  std::printf("flowmoe_nccl_tests: %d GPUs visible, using 2; scenarios %s; budget %.0f s; NOT a CI test "
              "(label gpu;multi_gpu)\n", ndev, list.c_str(), budget);
  std::fflush(stdout);
  const auto start = Clock::now();
  int failed = 0, idx = 0;
  std::vector<std::string> summary;
  for (const std::string& n : names) {
    const Scenario* sc = nullptr;
    for (const Scenario& s : kScenarios)
      if (n == s.name) sc = &s;
    if (!sc) {
      std::fprintf(stderr, "flowmoe_nccl_tests: unknown scenario '%s'\n", n.c_str());
      return 2;
    }
    const double left = budget - since(start) - 6.0;  // 5 s SIGTERM->SIGKILL + slack
    if (left < 3.0) {
      summary.push_back(std::string(sc->name) + ": NOT RUN (budget spent)");
      ++failed;
      continue;
    }
    LaunchOptions opt;
    opt.timeout_s = std::min(sc->limit_s, left);
    opt.stop_on_failure = std::string(sc->name) != "dead-rank";  // the survivor must report
    opt.grace_s = 3.0;
    opt.env = {std::string("FLOWMOE_NCCL_TEST_SCENARIO=") + sc->name};
    if (verbose && !std::getenv("NCCL_DEBUG")) opt.env.push_back("NCCL_DEBUG=WARN");
    std::printf("---- %s (watchdog %.0f s, MASTER_PORT %d)\n", sc->name, opt.timeout_s, port + idx);
    std::fflush(stdout);
    const LaunchResult r = launch_local_ranks_ex({exe}, 2, port + idx, opt);
    ++idx;
    const bool dead = std::string(sc->name) == "dead-rank";
    const bool ok = !r.timed_out && r.exit_codes[0] == 0 && r.exit_codes[1] == (dead ? kDeliberateExit : 0);
    char line[256];
    std::snprintf(line, sizeof line, "%-14s %s  rank 0: status %d after %.1f s, rank 1: status %d after %.1f s%s%s",
                  sc->name, ok ? "PASS" : "FAIL", r.exit_codes[0], r.seconds[0], r.exit_codes[1], r.seconds[1],
                  dead ? " (rank 1 expected 42)" : "", r.timed_out ? "  WATCHDOG: a rank hung and was killed" : "");
    summary.push_back(line);
    std::printf("%s\n", line);
    std::fflush(stdout);
    if (!ok) ++failed;
  }
  std::printf("\n==== flowmoe_nccl_tests summary (%.1f s)\n", since(start));
  for (const std::string& s : summary) std::printf("  %s\n", s.c_str());
  std::printf("%s\n", failed ? "FAILED" : "ALL PASSED");
  return failed ? 1 : 0;
}

}  // namespace
}  // namespace flowmoe

int main(int argc, char** argv) {
  ::setenv("NCCL_NVLS_ENABLE", "0", 1);  // NVLink multicast must stay off (docs/EP.md §1)
  const char* sc = std::getenv("FLOWMOE_NCCL_TEST_SCENARIO");
  if (sc && std::getenv("RANK")) return flowmoe::rank_main(sc);
  try {
    return flowmoe::parent_main(argc, argv);
  } catch (const std::exception& e) {
    std::fprintf(stderr, "flowmoe_nccl_tests: %s\n", e.what());
    return 1;
  }
}
