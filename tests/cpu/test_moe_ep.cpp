// The MoE layer with expert parallelism on the CPU (flowmoe/moe.h MoeConfig::comm over SimWorld;
// docs/EP.md §5): every recipe, forward and backward, for 1, 2 and 4 simulated ranks, against one
// rank holding all experts run on the concatenation of every rank's tokens (rank 0's first).
//
// Why bit-exact: each local expert's padded segment holds rank 0's rows, then rank 1's, ..., each
// rank's in (token, slot) order, then zero padding to A (DispatchPlan, docs/EP.md §2); the
// single-rank permute+pad of the concatenated batch sorts each expert's rows by (token, slot) over
// the concatenated token index, i.e. the same rows in the same order, padded to the same A. Every
// operator between dispatch and combine is row-wise (router, row-wise quantization, GEMM rows,
// SwiGLU, dp) or works inside one expert segment starting at its first row (column-wise 128x1
// blocks, scaling-aware transpose, wgrad's token-order sums), so it sees identical inputs; the
// combine sums a token's slots on the token's own rank in slot order, as unpermute does. What is
// not the concatenated run's bits, by design: dWr (each rank sums its own tokens: the layer returns
// this rank's contribution, the data-parallel all-reduce adds them) and the aux loss (per-rank
// statistics); both are compared with one rank run on that rank's own tokens, bit for bit.
#include <gtest/gtest.h>

#include <chrono>
#include <cmath>
#include <cstdio>
#include <cstring>
#include <string>
#include <vector>

#include "common/moe_config.h"
#include "common/reference.h"
#include "flowmoe/comm.h"
#include "flowmoe/error.h"
#include "flowmoe/moe.h"
#include "flowmoe/numerics.h"

using flowmoe::bf16_t;
using flowmoe::CastReport;
using flowmoe::Communicator;
using flowmoe::MoeConfig;
using flowmoe::MoePass;
using flowmoe::Recipe;
using flowmoe::RouterScore;
using flowmoe::SimWorld;
using flowmoe::WireFormat;
namespace num = flowmoe::num;
using flowmoe_test::Rng;

namespace {

constexpr int64_t kH = 256, kF = 128;
constexpr int kE = 8, kK = 2;

// All E experts' masters and every rank's tokens.
struct Model {
  MoeConfig cfg;  // comm null, max_tokens unset
  std::vector<float> w1, w2, wr, bias;
  std::vector<std::vector<bf16_t>> x, dy;  // per rank [T_r, H]
  std::vector<int64_t> tokens;
  int64_t total_tokens() const {
    int64_t n = 0;
    for (int64_t t : tokens) n += t;
    return n;
  }
  int64_t max_tokens() const {
    int64_t n = 0;
    for (int64_t t : tokens) n = std::max(n, t);
    return n;
  }
  std::vector<bf16_t> concat(const std::vector<std::vector<bf16_t>>& v) const {
    std::vector<bf16_t> all;
    for (const auto& r : v) all.insert(all.end(), r.begin(), r.end());
    return all;
  }
};

Model make_model(Recipe recipe, const std::vector<int64_t>& tokens, int align, RouterScore score,
                 bool renorm, uint64_t seed) {
  Model m;
  m.cfg = flowmoe_test::moe_config(kH, kF, kE, kK)
              .router(score, renorm, renorm ? 2.5f : 1.0f)
              .align(align)
              .recipe(recipe);
  m.tokens = tokens;
  Rng rng(seed);
  m.w1.resize(int64_t(kE) * 2 * kF * kH);
  m.w2.resize(int64_t(kE) * kH * kF);
  m.wr.resize(int64_t(kE) * kH);
  for (float& v : m.w1) v = static_cast<float>(rng.normal() / std::sqrt(double(kH)));
  for (float& v : m.w2) v = static_cast<float>(rng.normal() / std::sqrt(double(kF)));
  for (float& v : m.wr) v = static_cast<float>(rng.normal() / std::sqrt(double(kH)));
  for (int64_t t : tokens) {
    std::vector<bf16_t> x(t * kH), dy(t * kH);
    for (bf16_t& v : x) v = num::f32_to_bf16(static_cast<float>(rng.normal()));
    for (bf16_t& v : dy) v = num::f32_to_bf16(static_cast<float>(rng.normal()));
    m.x.push_back(x);
    m.dy.push_back(dy);
  }
  return m;
}

struct Out {
  std::vector<bf16_t> y, dx;
  std::vector<float> dw1, dw2, dwr;  // dw1/dw2 of the layer's (local) experts
  CastReport rep;
  flowmoe::MoeStatus st;
};

// Forward + backward of one layer whose weights are experts [e0, e0 + n) of the model.
Out run_one(const MoeConfig& cfg, const Model& m, int e0, int n, const bf16_t* x, const bf16_t* dy,
            int64_t T) {
  auto layer = flowmoe::make_cpu_layer(cfg);
  flowmoe::MoeWeights w;
  w.w1 = m.w1.data() + int64_t(e0) * 2 * kF * kH;
  w.w2 = m.w2.data() + int64_t(e0) * kH * kF;
  w.wr = m.wr.data();
  w.router_bias = m.bias.empty() ? nullptr : m.bias.data();
  layer->set_weights(w);
  Out o;
  o.y.assign(T * kH, 0);
  o.dx.assign(T * kH, 0);
  o.dw1.assign(int64_t(n) * 2 * kF * kH, 0.0f);
  o.dw2.assign(int64_t(n) * kH * kF, 0.0f);
  o.dwr.assign(int64_t(kE) * kH, 0.0f);
  layer->forward(x, T, o.y.data());
  layer->backward(dy, o.dx.data(), {o.dw1.data(), o.dw2.data(), o.dwr.data()});
  o.rep = layer->cast_report();
  o.st = layer->status();
  return o;
}

// One rank, all E experts, on the concatenation of every rank's tokens.
Out run_concat(const Model& m) {
  MoeConfig cfg = m.cfg;
  cfg.max_tokens = m.total_tokens();
  const std::vector<bf16_t> x = m.concat(m.x), dy = m.concat(m.dy);
  return run_one(cfg, m, 0, kE, x.data(), dy.data(), m.total_tokens());
}

// One rank, all E experts, on rank r's tokens only.
Out run_own(const Model& m, int r) {
  MoeConfig cfg = m.cfg;
  cfg.max_tokens = m.max_tokens();
  return run_one(cfg, m, 0, kE, m.x[r].data(), m.dy[r].data(), m.tokens[r]);
}

// Expert parallelism over `world` simulated ranks: rank r holds experts [r*El, (r+1)*El).
std::vector<Out> run_ep(const Model& m, SimWorld& world) {
  const int W = world.world_size(), El = kE / W;
  std::vector<Out> out(W);
  const std::vector<std::string> errs = world.run([&](Communicator& comm) {
    const int r = comm.rank();
    MoeConfig cfg = m.cfg;
    cfg.max_tokens = m.max_tokens();
    cfg.comm = &comm;
    out[r] = run_one(cfg, m, r * El, El, m.x[r].data(), m.dy[r].data(), m.tokens[r]);
  });
  for (size_t r = 0; r < errs.size(); ++r) EXPECT_EQ(errs[r], "") << "rank " << r;
  return out;
}

// Bit comparison of a slice: a[0, n) against b[off, off + n). Returns the mismatches (and prints
// the first).
template <typename T>
int64_t bit_diff(const std::vector<T>& a, const std::vector<T>& b, size_t off, size_t n,
                 const std::string& what) {
  int64_t bad = 0;
  EXPECT_LE(off + n, b.size()) << what;
  EXPECT_EQ(a.size(), n) << what;
  if (off + n > b.size() || a.size() != n) return 1;
  for (size_t i = 0; i < n; ++i)
    if (std::memcmp(&a[i], &b[off + i], sizeof(T)) != 0) {
      if (bad == 0)
        ADD_FAILURE() << what << ": first differing element " << i << " of " << n;
      ++bad;
    }
  return bad;
}

std::string case_name(const Model& m, int W) {
  std::string s = std::string(flowmoe::recipe_name(m.cfg.recipe)) + " W=" + std::to_string(W) +
                  " T={";
  for (size_t r = 0; r < m.tokens.size(); ++r) s += (r ? "," : "") + std::to_string(m.tokens[r]);
  s += "} " + m.cfg.describe();
  return s;
}

// The EP outputs of every rank against the concatenated single-rank run (y, dx, dW1, dW2) and
// against one rank on its own tokens (dWr, aux loss, y, dx).
void expect_ep_equals_single(const Model& m, int W, bool own_rank_checks = true) {
  // With the aux loss its gradient enters dx through per-rank statistics (AuxLossIsPerRank):
  // then dx is compared with the own-token run only.
  const bool aux = m.cfg.aux_loss_alpha > 0.0f;
  SimWorld world(W, 30.0);
  const std::vector<Out> ep = run_ep(m, world);
  const Out one = run_concat(m);
  const int El = kE / W;
  const std::string name = case_name(m, W);
  size_t tok0 = 0;
  std::vector<double> dwr_sum(int64_t(kE) * kH, 0.0);
  for (int r = 0; r < W; ++r) {
    const Out& o = ep[r];
    const std::string rn = name + " rank " + std::to_string(r);
    const size_t nt = m.tokens[r] * kH;
    EXPECT_EQ(bit_diff(o.y, one.y, tok0 * kH, nt, rn + " y"), 0);
    if (!aux) EXPECT_EQ(bit_diff(o.dx, one.dx, tok0 * kH, nt, rn + " dx"), 0);
    const size_t n1 = size_t(El) * 2 * kF * kH, n2 = size_t(El) * kH * kF;
    EXPECT_EQ(bit_diff(o.dw1, one.dw1, r * n1, n1, rn + " dW1"), 0);
    EXPECT_EQ(bit_diff(o.dw2, one.dw2, r * n2, n2, rn + " dW2"), 0);
    EXPECT_EQ(o.st.nonfinite, 0) << rn;
    for (size_t i = 0; i < dwr_sum.size(); ++i) dwr_sum[i] += o.dwr[i];
    if (own_rank_checks) {
      // dWr is this rank's contribution: the bits of one rank run on these tokens alone (its
      // dlogits are per token; the sum over t is this rank's tokens in order). So are y and dx
      // (every forward/backward quantity of a token is row-wise) and the per-rank aux loss.
      const Out own = run_own(m, r);
      EXPECT_EQ(bit_diff(o.dwr, own.dwr, 0, own.dwr.size(), rn + " dWr vs own-token run"), 0);
      EXPECT_EQ(bit_diff(o.y, own.y, 0, nt, rn + " y vs own-token run"), 0);
      EXPECT_EQ(bit_diff(o.dx, own.dx, 0, nt, rn + " dx vs own-token run"), 0);
      EXPECT_EQ(o.st.aux_loss, own.st.aux_loss) << rn;
    }
    tok0 += m.tokens[r];
  }
  // Summed over ranks (what the data-parallel all-reduce does), dWr equals the concatenated run's
  // up to the order of the FP32 additions.
  double num2 = 0.0, den2 = 0.0;
  for (size_t i = 0; i < dwr_sum.size(); ++i) {
    num2 += (dwr_sum[i] - one.dwr[i]) * (dwr_sum[i] - one.dwr[i]);
    den2 += double(one.dwr[i]) * one.dwr[i];
  }
  const double rel = den2 > 0 ? std::sqrt(num2 / den2) : std::sqrt(num2);
  if (!aux) EXPECT_LT(rel, 1e-5) << name;
  std::printf("[ measure  ] %s: y, %sdW1, dW2 bit-identical; sum of dWr vs one rank %.1e\n",
              name.c_str(), aux ? "" : "dx, ", rel);
}

// ---- bit-exactness, every recipe ----------------------------------------------------------------
struct EpCase {
  int world;
  std::vector<int64_t> tokens;
  int align;
  RouterScore score;
  bool renorm;
};

// W = 2 and 4; T per rank 37 and 64 (and 1, 50: ranks need not agree on T); A = 16 and 128; softmax
// and sigmoid + renormalisation. Each recipe runs every case.
const std::vector<EpCase>& ep_cases() {
  static const std::vector<EpCase> cases = {
      {2, {37, 64}, 16, RouterScore::kSoftmax, false},
      {2, {64, 37}, 128, RouterScore::kSigmoid, true},
      {4, {37, 64, 1, 50}, 128, RouterScore::kSoftmax, false},
      {4, {64, 37, 64, 37}, 16, RouterScore::kSigmoid, true},
  };
  return cases;
}

class MoeEpRecipe : public ::testing::TestWithParam<Recipe> {};

TEST_P(MoeEpRecipe, EqualsOneRankOnConcatenatedBatch) {
  uint64_t seed = 100;
  for (const EpCase& c : ep_cases()) {
    const Model m = make_model(GetParam(), c.tokens, c.align, c.score, c.renorm, ++seed);
    expect_ep_equals_single(m, c.world);
  }
}

// Unused experts and a rank whose experts receive no row at all (Mp = 0 there): a router bias
// sends every token to experts 0 and 1 (rank 0's with W = 2), so rank 1 runs every operator on
// zero rows and still takes part in every exchange.
TEST_P(MoeEpRecipe, RankWithNoRowsAndEmptyExperts) {
  Model m = make_model(GetParam(), {37, 64}, 16, RouterScore::kSoftmax, false, 7);
  m.bias.assign(kE, 0.0f);
  m.bias[0] = m.bias[1] = 100.0f;
  expect_ep_equals_single(m, 2);
  // W = 4, a rank with one token: expert 5 (rank 2) gets every token
  Model m4 = make_model(GetParam(), {37, 1, 64, 16}, 128, RouterScore::kSigmoid, true, 8);
  m4.bias.assign(kE, 0.0f);
  m4.bias[5] = 100.0f;
  expect_ep_equals_single(m4, 4);
}

// One simulated rank is the layer without a communicator: same bits, same cast report.
TEST_P(MoeEpRecipe, OneRankWorldEqualsNoCommunicator) {
  const Model m = make_model(GetParam(), {53}, 16, RouterScore::kSoftmax, false, 9);
  SimWorld world(1);
  const std::vector<Out> ep = run_ep(m, world);
  const Out one = run_concat(m);
  const std::string name = case_name(m, 1);
  EXPECT_EQ(bit_diff(ep[0].y, one.y, 0, one.y.size(), name + " y"), 0);
  EXPECT_EQ(bit_diff(ep[0].dx, one.dx, 0, one.dx.size(), name + " dx"), 0);
  EXPECT_EQ(bit_diff(ep[0].dw1, one.dw1, 0, one.dw1.size(), name + " dW1"), 0);
  EXPECT_EQ(bit_diff(ep[0].dw2, one.dw2, 0, one.dw2.size(), name + " dW2"), 0);
  EXPECT_EQ(bit_diff(ep[0].dwr, one.dwr, 0, one.dwr.size(), name + " dWr"), 0);
  ASSERT_EQ(ep[0].rep.ops.size(), one.rep.ops.size());
  for (size_t i = 0; i < one.rep.ops.size(); ++i) {
    EXPECT_EQ(ep[0].rep.ops[i].name, one.rep.ops[i].name);
    EXPECT_EQ(ep[0].rep.ops[i].calls, one.rep.ops[i].calls);
    // fp8-naive dequantizes after the dispatch: with EP the received rows (T*k routed rows, one
    // per (token, slot)), on one rank the T tokens before permute+pad. Every other operator reads
    // the same elements.
    const bool after_dispatch = one.rep.ops[i].name.find("after dispatch") != std::string::npos;
    EXPECT_EQ(ep[0].rep.ops[i].elements,
              after_dispatch ? one.rep.routed_rows * kH : one.rep.ops[i].elements)
        << one.rep.ops[i].name;
  }
  EXPECT_EQ(ep[0].rep.saved_bytes(), one.rep.saved_bytes());
  EXPECT_EQ(ep[0].rep.wire_bytes(MoePass::kForward), 0);  // nothing leaves the only rank
}

// The casts an EP rank executes are the single rank's (dispatch is not a cast): same operators,
// same launches, same outputs per pass; elements differ only where they count received rows.
TEST_P(MoeEpRecipe, CastsAsExecutedMatchOneRank) {
  const Model m = make_model(GetParam(), {37, 64}, 16, RouterScore::kSoftmax, false, 11);
  SimWorld world(2);
  const std::vector<Out> ep = run_ep(m, world);
  for (int r = 0; r < 2; ++r) {
    const Out own = run_own(m, r);
    const CastReport& a = ep[r].rep;
    const CastReport& b = own.rep;
    ASSERT_EQ(a.ops.size(), b.ops.size()) << "rank " << r << "\n" << a.to_string();
    for (size_t i = 0; i < b.ops.size(); ++i) {
      EXPECT_EQ(a.ops[i].pass, b.ops[i].pass);
      EXPECT_EQ(a.ops[i].kind, b.ops[i].kind);
      EXPECT_EQ(a.ops[i].name, b.ops[i].name);
      EXPECT_EQ(a.ops[i].calls, b.ops[i].calls) << b.ops[i].name;
      EXPECT_EQ(a.ops[i].outputs, b.ops[i].outputs) << b.ops[i].name;
    }
    for (MoePass p : {MoePass::kWeightUpdate, MoePass::kForward, MoePass::kBackward})
      EXPECT_EQ(a.standalone_casts(p), b.standalone_casts(p));
    EXPECT_EQ(a.tokens, m.tokens[r]);
    EXPECT_EQ(a.routed_rows, m.tokens[r] * kK);
  }
  // The saved tensors of rank r hold the rows its experts received: summed over the ranks, the
  // routed-row bytes equal the single rank's over the concatenated batch.
  const Out one = run_concat(m);
  double ep_unpadded = 0.0;
  for (int r = 0; r < 2; ++r)
    ep_unpadded += ep[r].rep.saved_bytes_per_token_unpadded() * double(m.tokens[r]);
  EXPECT_NEAR(ep_unpadded, one.rep.saved_bytes_per_token_unpadded() * double(m.total_tokens()),
              1e-6 * ep_unpadded);
  std::printf("[ measure  ] %s rank 0 report:\n%s", flowmoe::recipe_name(GetParam()),
              ep[0].rep.to_string().c_str());
}

INSTANTIATE_TEST_SUITE_P(AllRecipes, MoeEpRecipe, ::testing::ValuesIn(flowmoe::all_recipes()),
                         [](const ::testing::TestParamInfo<Recipe>& i) {
                           std::string s = flowmoe::recipe_name(i.param);
                           for (char& ch : s)
                             if (ch == '-') ch = '_';
                           return s;
                         });

// ---- aux loss: per rank ---------------------------------------------------------------------------
// The load-balancing statistics are this rank's tokens (not all-reduced): aux loss, y, dx and dWr
// of each rank are the bits of one rank run on its own tokens; y and the expert path (dW1, dW2) do
// not depend on the aux loss and still equal the concatenated run. dx does not (its router part
// carries the aux gradient of different statistics), nor does the sum of dWr.
TEST(MoeEp, AuxLossIsPerRank) {
  for (Recipe r : {Recipe::kBf16, Recipe::kFlow}) {
    Model m = make_model(r, {37, 64}, 16, RouterScore::kSoftmax, false, 21);
    m.cfg.aux_loss_alpha = 0.01f;
    expect_ep_equals_single(m, 2);
    SimWorld world(2);
    const std::vector<Out> ep = run_ep(m, world);
    const Out one = run_concat(m);
    EXPECT_GT(ep[0].st.aux_loss, 0.0f);
    std::printf("[ measure  ] %s aux loss per rank %.6f %.6f, over the concatenated batch %.6f\n",
                flowmoe::recipe_name(r), ep[0].st.aux_loss, ep[1].st.aux_loss, one.st.aux_loss);
  }
}

// ---- payload formats on the wire ------------------------------------------------------------------
// Bytes each rank sent (SimWorld's count) = the layer's wire report, and per routed row the wire
// format's size: BF16 2 B/element, FP8 with FP32 scales (fp8-naive) 1.03125, FP8 with UE8M0 scales
// (flow) 1.0078125, MXFP4 0.53125; + 4 B per row for the probability (forward dispatch) or dprob
// (backward combine).
TEST(MoeEp, WireBytesPerRowAreTheFormatSize) {
  struct Expect {
    Recipe r;
    WireFormat fwd, bwd;
    double fwd_per_element, bwd_per_element;
  } cases[] = {{Recipe::kBf16, WireFormat::kBf16, WireFormat::kBf16, 2.0, 2.0},
               {Recipe::kBlockwise, WireFormat::kBf16, WireFormat::kBf16, 2.0, 2.0},
               {Recipe::kFp8Naive, WireFormat::kFp8Fp32Scale, WireFormat::kFp8Fp32Scale, 1.03125,
                1.03125},
               {Recipe::kFlow, WireFormat::kFp8, WireFormat::kFp8, 1.0078125, 1.0078125},
               {Recipe::kFlowFp4, WireFormat::kMxfp4, WireFormat::kFp8, 0.53125, 1.0078125}};
  for (const Expect& c : cases) {
    for (int W : {2, 4}) {
      const std::vector<int64_t> tokens = W == 2 ? std::vector<int64_t>{37, 64}
                                                 : std::vector<int64_t>{37, 64, 1, 50};
      const Model m = make_model(c.r, tokens, 16, RouterScore::kSoftmax, false, 31);
      SimWorld world(W);
      world.reset_bytes();
      const std::vector<Out> ep = run_ep(m, world);
      for (int r = 0; r < W; ++r) {
        const CastReport& rep = ep[r].rep;
        const std::string rn = std::string(flowmoe::recipe_name(c.r)) + " W=" +
                               std::to_string(W) + " rank " + std::to_string(r);
        EXPECT_EQ(world.bytes_sent(r),
                  rep.wire_bytes(MoePass::kForward) + rep.wire_bytes(MoePass::kBackward))
            << rn;
        ASSERT_EQ(rep.wire.size(), 4u) << rn;  // dispatch x, combine y, dispatch dy, combine dX
        for (const flowmoe::WireTransfer& w : rep.wire) {
          if (w.rows == 0) continue;
          const bool dispatch = w.name.rfind("dispatch", 0) == 0;
          const bool fwd = w.pass == MoePass::kForward;
          const int64_t extra = (dispatch == fwd) ? 4 : 0;  // prob with x, dprob with dX
          EXPECT_EQ(w.bytes % w.rows, 0) << rn << " " << w.name;
          const int64_t row = w.bytes / w.rows;
          const double per_element = double(row - extra) / double(kH);
          const double want = !dispatch ? 2.0 : fwd ? c.fwd_per_element : c.bwd_per_element;
          EXPECT_EQ(per_element, want) << rn << " " << w.name;
          if (dispatch)
            EXPECT_EQ(row - extra, flowmoe::wire_row_bytes(fwd ? c.fwd : c.bwd, kH))
                << rn << " " << w.name;
        }
        if (r == 0)
          std::printf("[ measure  ] %-9s W=%d rank 0 (T=%lld): %.1f B/token forward, %.1f "
                      "backward on the wire (H=%lld, k=%d)\n",
                      flowmoe::recipe_name(c.r), W, static_cast<long long>(m.tokens[0]),
                      rep.wire_bytes_per_token(MoePass::kForward),
                      rep.wire_bytes_per_token(MoePass::kBackward), static_cast<long long>(kH),
                      kK);
      }
    }
  }
}

// ---- errors ---------------------------------------------------------------------------------------
using Clock = std::chrono::steady_clock;
double seconds_since(Clock::time_point t0) {
  return std::chrono::duration<double>(Clock::now() - t0).count();
}

MoeConfig small_cfg(Recipe r) {
  return flowmoe_test::moe_config(kH, kF, kE, kK).align(16).recipe(r).max_tokens(16);
}

// A configuration that differs between ranks is a CommError naming the field on every rank, at
// construction, well within the timeout (not a hang, not a wrong result).
TEST(MoeEp, MismatchedConfigIsCommErrorOnEveryRank) {
  struct Case {
    const char* field;
    void (*change)(MoeConfig*);
  } cases[] = {{"ffn", [](MoeConfig* c) { c->ffn = 256; }},
               {"recipe", [](MoeConfig* c) { c->recipe = Recipe::kFlowFp4; }},
               {"num_experts", [](MoeConfig* c) { c->num_experts = 4; }},
               {"align", [](MoeConfig* c) { c->align = 128; }},
               {"router_scale", [](MoeConfig* c) { c->router_scale = 2.0f; }}};
  for (const Case& cs : cases) {
    const double timeout = 5.0;
    SimWorld world(2, timeout);
    std::vector<std::string> msgs(2);
    std::vector<int> comm_errors(2, 0);
    const auto t0 = Clock::now();
    world.run([&](Communicator& comm) {
      MoeConfig c = small_cfg(Recipe::kFlow);
      c.comm = &comm;
      if (comm.rank() == 1) cs.change(&c);
      try {
        flowmoe::make_cpu_layer(c);
      } catch (const flowmoe::CommError& e) {
        comm_errors[comm.rank()] = 1;
        msgs[comm.rank()] = e.what();
      } catch (const flowmoe::Error& e) {
        msgs[comm.rank()] = e.what();
      }
    });
    EXPECT_LT(seconds_since(t0), timeout / 2) << cs.field;
    for (int r = 0; r < 2; ++r) {
      EXPECT_EQ(comm_errors[r], 1) << cs.field << " rank " << r << ": " << msgs[r];
      EXPECT_NE(msgs[r].find("mismatched configuration across ranks"), std::string::npos)
          << msgs[r];
      EXPECT_NE(msgs[r].find(cs.field), std::string::npos) << msgs[r];
    }
    std::printf("[ measure  ] %s\n", msgs[0].c_str());
  }
}

// E not divisible by the ranks: a clear flowmoe::Error on every rank.
TEST(MoeEp, ExpertsNotDivisibleByRanksIsClearError) {
  SimWorld world(4, 5.0);
  std::vector<std::string> msgs(4);
  const auto t0 = Clock::now();
  world.run([&](Communicator& comm) {
    MoeConfig c = small_cfg(Recipe::kBf16);
    c.num_experts = 6;
    c.comm = &comm;
    try {
      flowmoe::make_cpu_layer(c);
    } catch (const flowmoe::Error& e) {
      msgs[comm.rank()] = e.what();
    }
  });
  EXPECT_LT(seconds_since(t0), 2.5);
  for (int r = 0; r < 4; ++r)
    EXPECT_NE(msgs[r].find("num_experts E = 6 is not divisible by the 4 ranks"), std::string::npos)
        << "rank " << r << ": " << msgs[r];
}

// A bad call on one rank (T > max_tokens) fails that rank with its own message and the others
// with a CommError naming it, at once; afterwards the layers and the communicator still work.
TEST(MoeEp, BadCallOnOneRankFailsEveryRank) {
  const Model m = make_model(Recipe::kFlow, {16, 16}, 16, RouterScore::kSoftmax, false, 41);
  SimWorld world(2, 5.0);
  std::vector<std::string> msgs(2);
  std::vector<int> comm_errors(2, 0), ok(2, 0);
  const auto t0 = Clock::now();
  const std::vector<std::string> errs = world.run([&](Communicator& comm) {
    const int r = comm.rank(), El = kE / 2;
    MoeConfig cfg = m.cfg;
    cfg.max_tokens = 16;
    cfg.comm = &comm;
    auto layer = flowmoe::make_cpu_layer(cfg);
    flowmoe::MoeWeights w;
    w.w1 = m.w1.data() + int64_t(r * El) * 2 * kF * kH;
    w.w2 = m.w2.data() + int64_t(r * El) * kH * kF;
    w.wr = m.wr.data();
    layer->set_weights(w);
    std::vector<bf16_t> x(32 * kH, 0), y(32 * kH);
    try {
      layer->forward(x.data(), r == 1 ? 17 : 16, y.data());
    } catch (const flowmoe::CommError& e) {
      comm_errors[r] = 1;
      msgs[r] = e.what();
    } catch (const flowmoe::Error& e) {
      msgs[r] = e.what();
    }
    layer->forward(m.x[r].data(), 16, y.data());  // a good call afterwards
    ok[r] = 1;
  });
  EXPECT_LT(seconds_since(t0), 2.5);
  for (int r = 0; r < 2; ++r) EXPECT_EQ(errs[r], "") << "rank " << r;
  EXPECT_EQ(comm_errors[0], 1) << msgs[0];
  EXPECT_NE(msgs[0].find("rank 1 rejected its input"), std::string::npos) << msgs[0];
  EXPECT_EQ(comm_errors[1], 0) << msgs[1];
  EXPECT_NE(msgs[1].find("T = 17 tokens; expected 1 <= T <= max_tokens = 16"), std::string::npos)
      << msgs[1];
  EXPECT_EQ(ok[0] + ok[1], 2);
}

}  // namespace
