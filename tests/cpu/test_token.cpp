// CPU reference of the token-movement operators (flowmoe/token.h): exp accuracy, router
// properties and gradients (against double-precision finite differences), the aux loss, routing
// tables, permute+pad / unpermute+unpad contents and identities, and bad-input errors.
#include <gtest/gtest.h>

#include <algorithm>
#include <cmath>
#include <cstring>
#include <functional>
#include <limits>
#include <numeric>
#include <random>
#include <set>
#include <string>
#include <vector>

#include "flowmoe/error.h"
#include "flowmoe/numerics.h"
#include "flowmoe/token.h"

namespace flowmoe {
namespace {

using num::bf16_to_f32;
using num::f32_to_bf16;

// ---- helpers -----------------------------------------------------------------------------------
std::vector<float> normal_logits(int64_t t, int e, uint32_t seed, float sd = 2.0f) {
  std::mt19937 rng(seed);
  std::normal_distribution<float> nd(0.f, sd);
  std::vector<float> z(t * e);
  for (auto& v : z) v = nd(rng);
  return z;
}

// k distinct experts per token drawn from the first `used` experts (the rest get no tokens);
// a fraction `drop` of the slots is -1.
std::vector<int32_t> random_ids(int64_t t, int k, int e, uint32_t seed, int used = -1, double drop = 0) {
  if (used < 0) used = e;
  std::mt19937 rng(seed);
  std::uniform_real_distribution<double> ud(0, 1);
  std::vector<int32_t> ids(t * k);
  std::vector<int32_t> pool(used);
  for (int64_t i = 0; i < t; ++i) {
    std::iota(pool.begin(), pool.end(), 0);
    for (int j = 0; j < k; ++j) {
      const int pick = j + static_cast<int>(rng() % (used - j));
      std::swap(pool[j], pool[pick]);
      ids[i * k + j] = ud(rng) < drop ? -1 : pool[j];
    }
  }
  return ids;
}

std::vector<bf16_t> random_bf16(int64_t n, uint32_t seed) {
  std::mt19937 rng(seed);
  std::normal_distribution<float> nd(0.f, 1.f);
  std::vector<bf16_t> x(n);
  for (auto& v : x) v = f32_to_bf16(nd(rng));
  return x;
}
std::vector<uint8_t> random_bytes(int64_t n, uint32_t seed) {
  std::mt19937 rng(seed);
  std::vector<uint8_t> x(n);
  for (auto& v : x) v = static_cast<uint8_t>(rng());
  return x;
}

::testing::AssertionResult ThrowsMentioning(const std::function<void()>& f, const std::string& needle) {
  try {
    f();
  } catch (const Error& e) {
    if (std::string(e.what()).find(needle) == std::string::npos)
      return ::testing::AssertionFailure() << "message does not mention \"" << needle << "\": " << e.what();
    return ::testing::AssertionSuccess();
  } catch (const std::exception& e) {
    return ::testing::AssertionFailure() << "non-flowmoe exception: " << e.what();
  }
  return ::testing::AssertionFailure() << "did not throw";
}

int64_t ulp_diff(float a, float b) {
  auto key = [](float x) {
    int32_t i;
    std::memcpy(&i, &x, 4);
    return i < 0 ? -static_cast<int64_t>(i & 0x7FFFFFFF) : static_cast<int64_t>(i);
  };
  return std::llabs(key(a) - key(b));
}

RouterConfig config(RouterScore s, int e, int k, bool renorm, float scale = 1.0f) {
  RouterConfig c;
  c.num_experts = e;
  c.topk = k;
  c.score = s;
  c.renormalize = renorm;
  c.scale = scale;
  return c;
}

// ---- exp ---------------------------------------------------------------------------------------
TEST(TokenExp, WithinOneUlpOfDoubleExp) {
  std::mt19937 rng(1);
  std::uniform_real_distribution<float> ud(-103.9f, 88.7f);
  int64_t worst = 0;
  float worst_x = 0;
  auto check = [&](float x) {
    const float got = tok::exp_f32(x);
    const float want = static_cast<float>(std::exp(static_cast<double>(x)));
    const int64_t d = ulp_diff(got, want);
    if (d > worst) {
      worst = d;
      worst_x = x;
    }
  };
  for (int i = 0; i < 2000000; ++i) check(ud(rng));
  for (float x = -20.f; x <= 20.f; x += 1.0f / 1024) check(x);  // dense near 0 (softmax range)
  for (float x = -1e-3f; x <= 1e-3f; x += 1e-6f) check(x);
  EXPECT_LE(worst, 1) << "worst at x = " << worst_x;
}

TEST(TokenExp, SpecialValues) {
  const float inf = std::numeric_limits<float>::infinity();
  EXPECT_EQ(tok::exp_f32(0.0f), 1.0f);
  EXPECT_EQ(tok::exp_f32(-0.0f), 1.0f);
  EXPECT_EQ(tok::exp_f32(-inf), 0.0f);
  EXPECT_EQ(tok::exp_f32(inf), inf);
  EXPECT_TRUE(std::isnan(tok::exp_f32(std::nanf(""))));
  EXPECT_EQ(tok::exp_f32(89.0f), inf);
  EXPECT_EQ(tok::exp_f32(-104.0f), 0.0f);
  // subnormal results: one rounding, within one subnormal step of the truth
  for (float x = -103.9f; x < -87.0f; x += 0.01f) {
    const double want = std::exp(static_cast<double>(x));
    EXPECT_LE(std::fabs(tok::exp_f32(x) - want), std::ldexp(1.0, -149)) << x;
  }
  EXPECT_LE(ulp_diff(tok::exp_f32(88.7f), static_cast<float>(std::exp(static_cast<double>(88.7f)))), 1);
  float s, ds;
  tok::sigmoid_and_grad(0.0f, &s, &ds);
  EXPECT_EQ(s, 0.5f);
  EXPECT_EQ(ds, 0.25f);
  tok::sigmoid_and_grad(-inf, &s, &ds);
  EXPECT_EQ(s, 0.0f);
  tok::sigmoid_and_grad(inf, &s, &ds);
  EXPECT_EQ(s, 1.0f);
  EXPECT_EQ(ds, 0.0f);
}

// ---- router forward ------------------------------------------------------------------------------
// Double-precision scores of one token (softmax or sigmoid).
template <typename F>
std::vector<double> ref_scores(const F* z, int e, RouterScore s) {
  std::vector<double> p(e);
  if (s == RouterScore::kSoftmax) {
    double m = -INFINITY, sum = 0;
    for (int i = 0; i < e; ++i) m = std::max(m, static_cast<double>(z[i]));
    for (int i = 0; i < e; ++i) sum += p[i] = std::exp(z[i] - m);
    for (auto& v : p) v /= sum;
  } else {
    for (int i = 0; i < e; ++i) p[i] = 1.0 / (1.0 + std::exp(-static_cast<double>(z[i])));
  }
  return p;
}

struct RouterCase {
  const char* name;
  RouterScore score;
  int e, k;
  bool renorm;
  float scale;
  bool bias;
};

class RouterModes : public ::testing::TestWithParam<RouterCase> {};

TEST_P(RouterModes, ForwardMatchesDoublePrecisionAndSelectsTopK) {
  const RouterCase& c = GetParam();
  const int64_t T = 53;
  const RouterConfig cfg = config(c.score, c.e, c.k, c.renorm, c.scale);
  const auto z = normal_logits(T, c.e, 7 + c.e + c.k);
  std::vector<float> bias(c.e);
  std::mt19937 rng(3);
  for (auto& b : bias) b = std::uniform_real_distribution<float>(-0.1f, 0.1f)(rng);
  std::vector<int32_t> ids(T * c.k);
  std::vector<float> probs(T * c.k);
  EXPECT_EQ(cpu::router_forward(z.data(), T, cfg, c.bias ? bias.data() : nullptr, ids.data(), probs.data()), 0);
  for (int64_t t = 0; t < T; ++t) {
    const auto p = ref_scores(z.data() + t * c.e, c.e, c.score);
    auto sel = [&](int e) { return p[e] + (c.bias ? bias[e] : 0.0); };
    std::set<int> chosen;
    double sum = 0;
    for (int j = 0; j < c.k; ++j) {
      const int id = ids[t * c.k + j];
      ASSERT_GE(id, 0);
      ASSERT_LT(id, c.e);
      EXPECT_TRUE(chosen.insert(id).second) << "expert " << id << " chosen twice";
      sum += p[id];
      if (j > 0) EXPECT_GE(sel(ids[t * c.k + j - 1]), sel(id) - 1e-6) << "slots not in descending order";
    }
    double min_chosen = INFINITY, max_other = -INFINITY;
    for (int e = 0; e < c.e; ++e) {
      if (chosen.count(e)) min_chosen = std::min(min_chosen, sel(e));
      else max_other = std::max(max_other, sel(e));
    }
    EXPECT_GE(min_chosen, max_other - 1e-6) << "token " << t << ": a better expert was left out";
    for (int j = 0; j < c.k; ++j) {
      const double want = (c.renorm ? p[ids[t * c.k + j]] / sum : p[ids[t * c.k + j]]) * c.scale;
      EXPECT_NEAR(probs[t * c.k + j], want, 2e-6 * std::max(1.0, std::fabs(want))) << "token " << t << " slot " << j;
    }
  }
}

// d/dz of sum_{t,j} w[t,j] * probs[t,j] (ids fixed) and of the aux loss, by central differences in
// double precision, against router_backward.
double ref_prob_loss(const std::vector<double>& z, int e, const int32_t* id, const float* w, const RouterConfig& cfg) {
  const std::vector<double> p = ref_scores(z.data(), e, cfg.score);
  double sum = 0, loss = 0;
  for (int j = 0; j < cfg.topk; ++j) sum += p[id[j]];
  for (int j = 0; j < cfg.topk; ++j) loss += w[j] * (cfg.renormalize ? p[id[j]] / sum : p[id[j]]) * cfg.scale;
  return loss;
}

TEST_P(RouterModes, BackwardMatchesFiniteDifferences) {
  const RouterCase& c = GetParam();
  const int64_t T = 5;
  const RouterConfig cfg = config(c.score, c.e, c.k, c.renorm, c.scale);
  const auto z = normal_logits(T, c.e, 99 + c.e, 1.0f);
  std::vector<int32_t> ids(T * c.k);
  std::vector<float> probs(T * c.k), dprobs(T * c.k), dz(T * c.e);
  cpu::router_forward(z.data(), T, cfg, nullptr, ids.data(), probs.data());
  std::mt19937 rng(5);
  for (auto& v : dprobs) v = std::normal_distribution<float>(0, 1)(rng);
  cpu::router_backward(z.data(), T, cfg, ids.data(), dprobs.data(), nullptr, 0.0f, dz.data());
  double worst = 0;
  for (int64_t t = 0; t < T; ++t) {
    std::vector<double> zd(z.begin() + t * c.e, z.begin() + (t + 1) * c.e);
    for (int m = 0; m < c.e; ++m) {
      const double h = 1e-4, z0 = zd[m];
      zd[m] = z0 + h;
      const double lp = ref_prob_loss(zd, c.e, &ids[t * c.k], &dprobs[t * c.k], cfg);
      zd[m] = z0 - h;
      const double lm = ref_prob_loss(zd, c.e, &ids[t * c.k], &dprobs[t * c.k], cfg);
      zd[m] = z0;
      const double num = (lp - lm) / (2 * h);
      worst = std::max(worst, std::fabs(num - dz[t * c.e + m]));
    }
  }
  EXPECT_LT(worst, 2e-5 * std::max(1.0f, c.scale));
}

TEST_P(RouterModes, AuxLossAndGradient) {
  const RouterCase& c = GetParam();
  const int64_t T = 150;  // three chunks of the fixed-order sum, the last one partial
  const RouterConfig cfg = config(c.score, c.e, c.k, c.renorm, c.scale);
  const auto z = normal_logits(T, c.e, 1234 + c.e, 1.0f);
  std::vector<int32_t> ids(T * c.k);
  std::vector<float> probs(T * c.k), coef(c.e), dz(T * c.e), zero(T * c.k, 0.0f);
  cpu::router_forward(z.data(), T, cfg, nullptr, ids.data(), probs.data());
  const float alpha = 0.01f;
  const float loss = cpu::router_aux_loss(z.data(), ids.data(), T, cfg, alpha, coef.data());
  // double-precision value
  std::vector<double> f(c.e, 0), P(c.e, 0);
  for (int32_t id : ids) f[id] += 1.0 / (T * c.k);
  auto probs_all = [&](const double* zt) {
    auto p = ref_scores(zt, c.e, c.score);
    if (c.score == RouterScore::kSigmoid) {
      double s = 0;
      for (double v : p) s += v;
      for (auto& v : p) v /= s;
    }
    return p;
  };
  std::vector<double> zd(z.begin(), z.end());
  for (int64_t t = 0; t < T; ++t) {
    const auto p = probs_all(&zd[t * c.e]);
    for (int e = 0; e < c.e; ++e) P[e] += p[e] / T;
  }
  double want = 0;
  for (int e = 0; e < c.e; ++e) want += f[e] * P[e];
  want *= alpha * c.e;
  EXPECT_NEAR(loss, want, 1e-5 * want);
  for (int e = 0; e < c.e; ++e) EXPECT_NEAR(coef[e], alpha * c.e * f[e] / T, 1e-6 * alpha * c.e / T);
  // gradient of the aux loss alone (dprobs = 0, aux_dloss = 2)
  cpu::router_backward(z.data(), T, cfg, ids.data(), zero.data(), coef.data(), 2.0f, dz.data());
  double worst = 0, scale = 0;
  for (int64_t t : {int64_t{0}, int64_t{77}, T - 1}) {
    for (int m = 0; m < c.e; ++m) {
      const double h = 1e-3, z0 = zd[t * c.e + m];
      auto aux_t = [&]() {
        const auto p = probs_all(&zd[t * c.e]);
        double s = 0;
        for (int e = 0; e < c.e; ++e) s += f[e] * p[e];
        return 2.0 * alpha * c.e * s / T;
      };
      zd[t * c.e + m] = z0 + h;
      const double lp = aux_t();
      zd[t * c.e + m] = z0 - h;
      const double lm = aux_t();
      zd[t * c.e + m] = z0;
      const double num = (lp - lm) / (2 * h);
      worst = std::max(worst, std::fabs(num - dz[t * c.e + m]));
      scale = std::max(scale, std::fabs(num));
    }
  }
  EXPECT_LT(worst, 1e-3 * scale + 1e-9);
}

const RouterCase kRouterCases[] = {
    {"softmax_top8_of_64", RouterScore::kSoftmax, 64, 8, false, 1.0f, false},
    {"softmax_renorm_top2_of_8", RouterScore::kSoftmax, 8, 2, true, 1.0f, false},
    {"softmax_top1_of_5", RouterScore::kSoftmax, 5, 1, false, 1.0f, false},
    {"sigmoid_renorm_scaled_biased_top8_of_256", RouterScore::kSigmoid, 256, 8, true, 2.5f, true},
    {"sigmoid_top6_of_40", RouterScore::kSigmoid, 40, 6, false, 1.0f, false},
    {"softmax_all_experts_32", RouterScore::kSoftmax, 32, 32, false, 1.0f, false},
};
INSTANTIATE_TEST_SUITE_P(Token, RouterModes, ::testing::ValuesIn(kRouterCases),
                         [](const ::testing::TestParamInfo<RouterCase>& i) { return std::string(i.param.name); });

TEST(TokenRouter, TiesGoToTheLowerExpertIndex) {
  const int E = 12, k = 5;
  std::vector<float> z(2 * E, 0.5f);  // token 0: all equal
  for (int e = 0; e < E; ++e) z[E + e] = (e % 3 == 0) ? 1.0f : 0.0f;  // token 1: ties at 1.0
  std::vector<int32_t> ids(2 * k);
  std::vector<float> probs(2 * k);
  cpu::router_forward(z.data(), 2, config(RouterScore::kSoftmax, E, k, false), nullptr, ids.data(), probs.data());
  EXPECT_EQ(std::vector<int32_t>(ids.begin(), ids.begin() + k), (std::vector<int32_t>{0, 1, 2, 3, 4}));
  EXPECT_EQ(std::vector<int32_t>(ids.begin() + k, ids.end()), (std::vector<int32_t>{0, 3, 6, 9, 1}));
  for (int j = 0; j < k; ++j) EXPECT_EQ(probs[j], probs[0]);
  EXPECT_NEAR(probs[0], 1.0 / E, 1e-7);
}

TEST(TokenRouter, BiasSteersSelectionButNotProbs) {
  const int E = 4, k = 2;
  const std::vector<float> z = {2.0f, 1.0f, 0.0f, -1.0f};
  const std::vector<float> bias = {0.0f, 0.0f, 0.0f, 5.0f};
  std::vector<int32_t> ids(k);
  std::vector<float> probs(k);
  const RouterConfig cfg = config(RouterScore::kSigmoid, E, k, true);
  cpu::router_forward(z.data(), 1, cfg, bias.data(), ids.data(), probs.data());
  EXPECT_EQ(ids[0], 3);
  EXPECT_EQ(ids[1], 0);
  const double s3 = 1 / (1 + std::exp(1.0)), s0 = 1 / (1 + std::exp(-2.0));
  EXPECT_NEAR(probs[0], s3 / (s3 + s0), 1e-6);
  EXPECT_NEAR(probs[1], s0 / (s3 + s0), 1e-6);
}

TEST(TokenRouter, NonFiniteLogitsAreCountedAndNeverGiveFiniteProbs) {
  const int E = 8, k = 2;
  auto z = normal_logits(3, E, 4);
  z[E + 3] = std::nanf("");
  z[2 * E + 5] = std::numeric_limits<float>::infinity();
  for (RouterScore s : {RouterScore::kSoftmax, RouterScore::kSigmoid}) {
    std::vector<int32_t> ids(3 * k);
    std::vector<float> probs(3 * k);
    const RouterConfig cfg = config(s, E, k, true);
    EXPECT_EQ(cpu::router_forward(z.data(), 3, cfg, nullptr, ids.data(), probs.data()), 2);
    for (int j = 0; j < k; ++j) EXPECT_TRUE(std::isfinite(probs[j]));  // clean token
    for (int j = 0; j < k; ++j) EXPECT_GE(ids[k + j], 0);
    if (s == RouterScore::kSoftmax) {
      // NaN logit: the sum is NaN, every prob NaN; +Inf: Inf - Inf = NaN
      for (int j = 0; j < 2 * k; ++j) EXPECT_TRUE(std::isnan(probs[k + j])) << j;
    } else {
      // sigmoid: a NaN score ranks after every number, so with k = 2 < 8 it is not chosen;
      // +Inf gives sigmoid 1.0, the top score. The count still reports both.
      for (int j = 0; j < k; ++j) EXPECT_NE(ids[k + j], 3);
      EXPECT_EQ(ids[2 * k], 5);
    }
  }
}

TEST(TokenRouter, SingleTokenSingleExpert) {
  const float z = 0.3f;
  int32_t id = -7;
  float p = 0;
  cpu::router_forward(&z, 1, config(RouterScore::kSoftmax, 1, 1, false), nullptr, &id, &p);
  EXPECT_EQ(id, 0);
  EXPECT_EQ(p, 1.0f);
  cpu::router_forward(&z, 1, config(RouterScore::kSigmoid, 1, 1, true, 2.0f), nullptr, &id, &p);
  EXPECT_EQ(p, 2.0f);
  float dz = 1;
  const float dp = 1;
  cpu::router_backward(&z, 1, config(RouterScore::kSoftmax, 1, 1, false), &id, &dp, nullptr, 0, &dz);
  EXPECT_EQ(dz, 0.0f);  // softmax over one expert is constant
}

TEST(TokenRouter, AuxLossOfPerfectBalanceIsAlpha) {
  const int E = 8, k = 2;
  const int64_t T = 64;
  std::vector<float> z(T * E, 0.0f);  // uniform probabilities
  std::vector<int32_t> ids(T * k);
  for (int64_t i = 0; i < T * k; ++i) ids[i] = static_cast<int32_t>(i % E);
  std::vector<float> coef(E);
  const float loss = cpu::router_aux_loss(z.data(), ids.data(), T, config(RouterScore::kSoftmax, E, k, false), 0.01f, coef.data());
  EXPECT_NEAR(loss, 0.01f, 1e-8);
}

// ---- routing metadata --------------------------------------------------------------------------
void expect_routing_invariants(const cpu::Routing& r, const std::vector<int32_t>& ids) {
  const int E = r.num_experts, k = r.topk, A = r.align;
  std::vector<int32_t> cnt(E, 0);
  for (int32_t id : ids)
    if (id >= 0) ++cnt[id];
  EXPECT_EQ(r.counts, cnt);
  ASSERT_EQ(r.offsets[0], 0);
  ASSERT_EQ(r.padded_offsets[0], 0);
  for (int e = 0; e < E; ++e) {
    EXPECT_EQ(r.offsets[e + 1] - r.offsets[e], cnt[e]);
    const int32_t len = r.padded_offsets[e + 1] - r.padded_offsets[e];
    EXPECT_EQ(len % A, 0);
    EXPECT_GE(len, cnt[e]);
    EXPECT_LT(len - cnt[e], cnt[e] == 0 ? 1 : A) << "expert " << e;
  }
  EXPECT_LE(r.padded_rows(), routing_max_rows(r.tokens, k, E, A));
  std::vector<int64_t> last(E, -1);  // last flat index seen per expert: ranks must increase
  std::vector<char> used(r.padded_rows(), 0);
  for (int64_t i = 0; i < r.tokens * k; ++i) {
    const int32_t e = ids[i], row = r.row_map[i];
    if (e < 0) {
      EXPECT_EQ(row, -1);
      EXPECT_EQ(r.row_map_unpadded[i], -1);
      continue;
    }
    ASSERT_GE(row, r.padded_offsets[e]);
    ASSERT_LT(row, r.padded_offsets[e] + cnt[e]);
    EXPECT_FALSE(used[row]) << "row " << row << " used twice";
    used[row] = 1;
    EXPECT_EQ(r.row_map_unpadded[i], row - r.padded_offsets[e] + r.offsets[e]);
    // ascending (token, slot) within the expert = ascending flat index = ascending row
    if (last[e] >= 0) EXPECT_EQ(row, r.row_map[last[e]] + 1);
    else EXPECT_EQ(row, r.padded_offsets[e]);
    last[e] = i;
  }
}

struct RoutingCase {
  const char* name;
  int64_t t;
  int k, e, align, used;
  double drop;
};
class RoutingTables : public ::testing::TestWithParam<RoutingCase> {};
TEST_P(RoutingTables, Invariants) {
  const RoutingCase& c = GetParam();
  const auto ids = random_ids(c.t, c.k, c.e, 17 + c.align, c.used, c.drop);
  const cpu::Routing r = cpu::build_routing(ids.data(), c.t, c.k, c.e, c.align);
  expect_routing_invariants(r, ids);
}
const RoutingCase kRoutingCases[] = {
    {"one_token_top1", 1, 1, 1, 16, 1, 0},          {"one_token_top8_of_32", 1, 8, 32, 128, 32, 0},
    {"zero_token_experts", 100, 2, 16, 32, 5, 0},   {"dropped_slots", 300, 8, 32, 16, 32, 0.3},
    {"no_padding", 257, 6, 20, 1, 20, 0},           {"top8_of_8_align128", 129, 8, 8, 128, 8, 0},
    {"empty", 0, 4, 7, 16, 7, 0},
};
INSTANTIATE_TEST_SUITE_P(Token, RoutingTables, ::testing::ValuesIn(kRoutingCases),
                         [](const ::testing::TestParamInfo<RoutingCase>& i) { return std::string(i.param.name); });

TEST(TokenRouting, SmallExampleByHand) {
  // T = 3, k = 2, E = 3, A = 4: token 0 -> (2, 0), token 1 -> (0, 2), token 2 -> (2, -1)
  const std::vector<int32_t> ids = {2, 0, 0, 2, 2, -1};
  const cpu::Routing r = cpu::build_routing(ids.data(), 3, 2, 3, 4);
  EXPECT_EQ(r.counts, (std::vector<int32_t>{2, 0, 3}));
  EXPECT_EQ(r.offsets, (std::vector<int32_t>{0, 2, 2, 5}));
  EXPECT_EQ(r.padded_offsets, (std::vector<int32_t>{0, 4, 4, 8}));
  EXPECT_EQ(r.row_map, (std::vector<int32_t>{4, 0, 1, 5, 6, -1}));
  EXPECT_EQ(r.row_map_unpadded, (std::vector<int32_t>{2, 0, 1, 3, 4, -1}));
}

// ---- permute + pad -----------------------------------------------------------------------------
struct MoveCase {
  const char* name;
  int64_t t;
  int k, e, align, used;
  int64_t h;
  double drop;
};
class Movers : public ::testing::TestWithParam<MoveCase> {};

TEST_P(Movers, PermutePadAllFormats) {
  const MoveCase& c = GetParam();
  const auto ids = random_ids(c.t, c.k, c.e, 5 + c.align, c.used, c.drop);
  const cpu::Routing r = cpu::build_routing(ids.data(), c.t, c.k, c.e, c.align);
  const int64_t mp = r.padded_rows(), h = c.h, T = c.t;
  // which (token, slot) fills each row; -1: padding
  std::vector<int64_t> src(mp, -1);
  for (int64_t i = 0; i < T * c.k; ++i)
    if (r.row_map[i] >= 0) src[r.row_map[i]] = i / c.k;

  const auto x = random_bf16(T * h, 1);
  std::vector<bf16_t> out(mp * h, 0xFFFF);
  cpu::permute_pad_bf16(x.data(), h, r, out.data());
  for (int64_t row = 0; row < mp; ++row)
    for (int64_t i = 0; i < h; ++i)
      ASSERT_EQ(out[row * h + i], src[row] < 0 ? 0 : x[src[row] * h + i]) << "bf16 row " << row;

  if (h % 128 == 0) {
    const auto codes = random_bytes(T * h, 2);
    const auto scales = random_bytes(T * h / 128, 3);
    const int64_t ld = mp + 3;  // wider than needed: the extra columns stay untouched
    std::vector<uint8_t> oc(mp * h, 0xEE), os(h / 128 * ld, 0xEE);
    cpu::permute_pad_fp8(codes.data(), scales.data(), h, r, oc.data(), os.data(), ld);
    for (int64_t row = 0; row < mp; ++row) {
      for (int64_t i = 0; i < h; ++i)
        ASSERT_EQ(oc[row * h + i], src[row] < 0 ? 0 : codes[src[row] * h + i]) << "fp8 row " << row;
      for (int64_t cidx = 0; cidx < h / 128; ++cidx)
        ASSERT_EQ(os[cidx * ld + row], src[row] < 0 ? 0 : scales[cidx * T + src[row]]) << "fp8 scale row " << row;
    }
    for (int64_t cidx = 0; cidx < h / 128; ++cidx)
      for (int64_t row = mp; row < ld; ++row) EXPECT_EQ(os[cidx * ld + row], 0xEE);
  }
  if (h % 32 == 0) {
    const auto codes = random_bytes(T * h / 2, 4);
    const auto scales = random_bytes(T * h / 32, 5);
    std::vector<uint8_t> oc(mp * h / 2, 0xEE), os(mp * h / 32, 0xEE);
    cpu::permute_pad_mxfp4(codes.data(), scales.data(), h, r, oc.data(), os.data());
    for (int64_t row = 0; row < mp; ++row) {
      for (int64_t i = 0; i < h / 2; ++i)
        ASSERT_EQ(oc[row * h / 2 + i], src[row] < 0 ? 0 : codes[src[row] * h / 2 + i]) << "mxfp4 row " << row;
      for (int64_t i = 0; i < h / 32; ++i)
        ASSERT_EQ(os[row * h / 32 + i], src[row] < 0 ? 0 : scales[src[row] * h / 32 + i]) << "mxfp4 scale row " << row;
    }
  }
}

TEST_P(Movers, UnpermuteUnpadAndBackward) {
  const MoveCase& c = GetParam();
  const auto ids = random_ids(c.t, c.k, c.e, 9 + c.align, c.used, c.drop);
  const cpu::Routing r = cpu::build_routing(ids.data(), c.t, c.k, c.e, c.align);
  const int64_t mp = r.padded_rows(), h = c.h, T = c.t, k = c.k;
  std::vector<float> probs(T * k);
  std::mt19937 rng(11);
  for (auto& p : probs) p = std::uniform_real_distribution<float>(0.f, 1.f)(rng);
  const auto yr = random_bf16(mp * h, 12);
  std::vector<bf16_t> y(T * h);
  cpu::unpermute_unpad(yr.data(), probs.data(), h, r, y.data());
  for (int64_t t = 0; t < T; ++t) {
    for (int64_t i = 0; i < h; ++i) {
      double want = 0;
      for (int s = 0; s < k; ++s)
        if (r.row_map[t * k + s] >= 0) want += static_cast<double>(probs[t * k + s]) * bf16_to_f32(yr[r.row_map[t * k + s] * h + i]);
      // one BF16 rounding of an FP32 sum: within one BF16 ulp (2^-7 relative) plus FP32 noise
      ASSERT_NEAR(bf16_to_f32(y[t * h + i]), want, std::fabs(want) * (1.0 / 128) + 1e-6) << t << "," << i;
    }
  }
  // backward
  const auto dy = random_bf16(T * h, 13);
  std::vector<bf16_t> dyr(mp * h, 0x7FC0);
  std::vector<float> dp(T * k, -1.f);
  cpu::unpermute_unpad_backward(dy.data(), yr.data(), probs.data(), h, r, dyr.data(), dp.data());
  std::vector<char> routed(mp, 0);
  for (int64_t t = 0; t < T; ++t) {
    for (int s = 0; s < k; ++s) {
      const int32_t row = r.row_map[t * k + s];
      if (row < 0) {
        EXPECT_EQ(dp[t * k + s], 0.0f);
        continue;
      }
      routed[row] = 1;
      double dot = 0, mag = 0;
      for (int64_t i = 0; i < h; ++i) {
        const float g = bf16_to_f32(dy[t * h + i]), v = bf16_to_f32(yr[row * h + i]);
        dot += static_cast<double>(g) * v;
        mag += std::fabs(static_cast<double>(g) * v);
        ASSERT_EQ(dyr[row * h + i], f32_to_bf16(probs[t * k + s] * g));
      }
      EXPECT_NEAR(dp[t * k + s], dot, 1e-6 * mag + 1e-7);
    }
  }
  for (int64_t row = 0; row < mp; ++row)
    if (!routed[row])
      for (int64_t i = 0; i < h; ++i) ASSERT_EQ(dyr[row * h + i], 0) << "padding row " << row;
}

const MoveCase kMoveCases[] = {
    {"one_token_k1", 1, 1, 4, 16, 4, 128, 0},
    {"k8_of_32_align128", 37, 8, 32, 128, 32, 256, 0},
    {"zero_token_experts_align32", 50, 2, 12, 32, 4, 384, 0},
    {"dropped_align16_h160", 64, 4, 8, 16, 8, 160, 0.25},
    {"h8_bf16_only", 9, 3, 5, 16, 5, 8, 0},
    {"no_padding", 33, 2, 6, 1, 6, 96, 0},
};
INSTANTIATE_TEST_SUITE_P(Token, Movers, ::testing::ValuesIn(kMoveCases),
                         [](const ::testing::TestParamInfo<MoveCase>& i) { return std::string(i.param.name); });

TEST(TokenMovers, PermuteThenUnpermuteIsIdentityForTop1) {
  const int64_t T = 77, h = 256;
  for (int align : {1, 16, 32, 128}) {
    const auto ids = random_ids(T, 1, 9, 3, 6);
    const cpu::Routing r = cpu::build_routing(ids.data(), T, 1, 9, align);
    const auto x = random_bf16(T * h, 21);
    std::vector<bf16_t> rows(r.padded_rows() * h), y(T * h);
    std::vector<float> ones(T, 1.0f);
    cpu::permute_pad_bf16(x.data(), h, r, rows.data());
    cpu::unpermute_unpad(rows.data(), ones.data(), h, r, y.data());
    EXPECT_EQ(y, x) << "align " << align;
    cpu::unpermute_unpad(rows.data(), nullptr, h, r, y.data());
    EXPECT_EQ(y, x) << "align " << align << " (probs null)";
  }
}

TEST(TokenMovers, BackwardOfPermuteIsUnweightedSum) {
  // unpermute with probs = null sums a token's k rows: the adjoint of permute.
  const int64_t T = 10, h = 64;
  const int k = 3, E = 4;
  const auto ids = random_ids(T, k, E, 8);
  const cpu::Routing r = cpu::build_routing(ids.data(), T, k, E, 16);
  std::vector<bf16_t> rows(r.padded_rows() * h), y(T * h);
  for (int64_t i = 0; i < r.padded_rows() * h; ++i) rows[i] = f32_to_bf16(static_cast<float>(i % 7));
  cpu::unpermute_unpad(rows.data(), nullptr, h, r, y.data());
  for (int64_t t = 0; t < T; ++t)
    for (int64_t i = 0; i < h; ++i) {
      float want = 0;
      for (int s = 0; s < k; ++s) want += static_cast<float>((r.row_map[t * k + s] * h + i) % 7);
      EXPECT_EQ(bf16_to_f32(y[t * h + i]), want);
    }
}

// ---- errors ------------------------------------------------------------------------------------
TEST(TokenErrors, BadInputIsRejectedWithAClearMessage) {
  const std::vector<float> z(64, 0.0f);
  std::vector<int32_t> ids(64);
  std::vector<float> p(64);
  EXPECT_TRUE(ThrowsMentioning([&] { cpu::router_forward(z.data(), 1, config(RouterScore::kSoftmax, 4, 5, false), nullptr, ids.data(), p.data()); }, "k = 5"));
  EXPECT_TRUE(ThrowsMentioning([&] { cpu::router_forward(z.data(), 1, config(RouterScore::kSoftmax, 4, 0, false), nullptr, ids.data(), p.data()); }, "1 <= k"));
  EXPECT_TRUE(ThrowsMentioning([&] { cpu::router_forward(z.data(), 1, config(RouterScore::kSoftmax, 0, 1, false), nullptr, ids.data(), p.data()); }, "E = 0"));
  EXPECT_TRUE(ThrowsMentioning([&] { cpu::router_forward(z.data(), 1, config(RouterScore::kSoftmax, 2000, 1, false), nullptr, ids.data(), p.data()); }, "1024"));
  EXPECT_TRUE(ThrowsMentioning([&] { cpu::router_forward(z.data(), 1, config(RouterScore::kSoftmax, 64, 33, false), nullptr, ids.data(), p.data()); }, "k = 33"));
  EXPECT_TRUE(ThrowsMentioning([&] { cpu::router_forward(z.data(), -1, config(RouterScore::kSoftmax, 4, 1, false), nullptr, ids.data(), p.data()); }, "T = -1"));
  EXPECT_TRUE(ThrowsMentioning([&] { cpu::router_forward(nullptr, 2, config(RouterScore::kSoftmax, 4, 1, false), nullptr, ids.data(), p.data()); }, "logits is null"));
  EXPECT_TRUE(ThrowsMentioning([&] { cpu::router_forward(z.data(), 1, config(RouterScore::kSoftmax, 4, 1, false, NAN), nullptr, ids.data(), p.data()); }, "scale"));
  std::vector<float> coef(8);
  EXPECT_TRUE(ThrowsMentioning([&] { cpu::router_aux_loss(z.data(), ids.data(), 0, config(RouterScore::kSoftmax, 4, 1, false), 0.1f, coef.data()); }, "T >= 1"));

  const std::vector<int32_t> bad = {0, 4, 1, 2};
  EXPECT_TRUE(ThrowsMentioning([&] { cpu::build_routing(bad.data(), 2, 2, 4, 16); }, "expert id 4 at token 0, slot 1"));
  const std::vector<int32_t> bad2 = {0, -2};
  EXPECT_TRUE(ThrowsMentioning([&] { cpu::build_routing(bad2.data(), 1, 2, 4, 16); }, "expert id -2"));
  const std::vector<int32_t> good = {0, 1, 2, 3};
  EXPECT_TRUE(ThrowsMentioning([&] { cpu::build_routing(good.data(), 2, 2, 4, 0); }, "alignment A = 0"));
  EXPECT_TRUE(ThrowsMentioning([&] { cpu::build_routing(good.data(), 2, 2, 4, 2048); }, "alignment A = 2048"));
  EXPECT_TRUE(ThrowsMentioning([&] { cpu::build_routing(good.data(), 1, 0, 4, 16); }, "k = 0"));

  const cpu::Routing r = cpu::build_routing(good.data(), 2, 2, 4, 16);
  std::vector<uint8_t> buf(1 << 16);
  std::vector<bf16_t> b16(1 << 16);
  EXPECT_TRUE(ThrowsMentioning([&] { cpu::permute_pad_fp8(buf.data(), buf.data(), 192, r, buf.data(), buf.data(), r.padded_rows()); }, "H = 192 must be a positive multiple of 128"));
  EXPECT_TRUE(ThrowsMentioning([&] { cpu::permute_pad_mxfp4(buf.data(), buf.data(), 48, r, buf.data(), buf.data()); }, "multiple of 32"));
  EXPECT_TRUE(ThrowsMentioning([&] { cpu::permute_pad_bf16(b16.data(), 12, r, b16.data()); }, "multiple of 8"));
  EXPECT_TRUE(ThrowsMentioning([&] { cpu::permute_pad_fp8(buf.data(), buf.data(), 128, r, buf.data(), buf.data(), r.padded_rows() - 1); }, "scale_ld"));
  EXPECT_TRUE(ThrowsMentioning([&] { cpu::unpermute_unpad(b16.data(), nullptr, 8, cpu::Routing{}, b16.data()); }, "build_routing"));
}

}  // namespace
}  // namespace flowmoe
