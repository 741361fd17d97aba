// The MoE layer on the CPU (flowmoe/moe.h): the bf16 recipe against a float64 reference of the
// whole layer (forward and backward; the reference's gradients against central finite
// differences), every FP8/FP4 recipe against bf16 on the same inputs (relative errors printed and
// bounded), the wgrad column operands of `flow` against the row-wise values of the other GEMM,
// determinism, configuration errors, cast counts and saved bytes per recipe.
#include <gtest/gtest.h>

#include <algorithm>
#include <cmath>
#include <cstdio>
#include <cstdlib>
#include <limits>
#include <map>
#include <string>
#include <vector>

#include "common/moe_config.h"
#include "common/reference.h"
#include "flowmoe/comm.h"
#include "flowmoe/error.h"
#include "flowmoe/moe.h"
#include "flowmoe/numerics.h"

using flowmoe::bf16_t;
using flowmoe::CastKind;
using flowmoe::CastReport;
using flowmoe::MoeConfig;
using flowmoe::MoePass;
using flowmoe::Recipe;
using flowmoe::RouterScore;
namespace num = flowmoe::num;
using flowmoe_test::Rng;

namespace {

// ---- problem setup -------------------------------------------------------------------------------
struct Problem {
  MoeConfig cfg;
  int64_t T = 0;
  std::vector<float> w1, w2, wr;  // masters [E,2F,H], [E,H,F], [E,H]
  std::vector<bf16_t> x, dy;      // [T,H]
};

MoeConfig make_cfg(int64_t H, int64_t F, int E, int k, int64_t T, Recipe r,
                   RouterScore score = RouterScore::kSoftmax, int align = 16) {
  return flowmoe_test::moe_config(H, F, E, k).router(score).align(align).recipe(r).max_tokens(T);
}

Problem make_problem(const MoeConfig& cfg, int64_t T, uint64_t seed) {
  Problem p;
  p.cfg = cfg;
  p.T = T;
  Rng rng(seed);
  const int64_t H = cfg.hidden, F = cfg.ffn, E = cfg.num_experts;
  p.w1.resize(E * 2 * F * H);
  p.w2.resize(E * H * F);
  p.wr.resize(E * H);
  for (float& v : p.w1) v = static_cast<float>(rng.normal() / std::sqrt(double(H)));
  for (float& v : p.w2) v = static_cast<float>(rng.normal() / std::sqrt(double(F)));
  for (float& v : p.wr) v = static_cast<float>(rng.normal() / std::sqrt(double(H)));
  p.x.resize(T * H);
  p.dy.resize(T * H);
  for (bf16_t& v : p.x) v = num::f32_to_bf16(static_cast<float>(rng.normal()));
  for (bf16_t& v : p.dy) v = num::f32_to_bf16(static_cast<float>(rng.normal()));
  return p;
}

struct Result {
  std::vector<double> y, dx, dw1, dw2, dwr;
  CastReport rep;
  flowmoe::MoeStatus st;
};

std::vector<double> widen(const std::vector<bf16_t>& v) {
  std::vector<double> o(v.size());
  for (size_t i = 0; i < v.size(); ++i) o[i] = num::bf16_to_f32(v[i]);
  return o;
}

Result run_layer(const Problem& p, Recipe r, bool check_columns = false, int passes = 1) {
  MoeConfig cfg = p.cfg;
  cfg.recipe = r;
  cfg.check_columns = check_columns;
  auto layer = flowmoe::make_cpu_layer(cfg);
  flowmoe::MoeWeights w;
  w.w1 = p.w1.data();
  w.w2 = p.w2.data();
  w.wr = p.wr.data();
  layer->set_weights(w);
  const int64_t H = cfg.hidden, F = cfg.ffn, E = cfg.num_experts;
  std::vector<bf16_t> y(p.T * H), dx(p.T * H);
  std::vector<float> dw1(E * 2 * F * H, 0.0f), dw2(E * H * F, 0.0f), dwr(E * H, 0.0f);
  flowmoe::MoeGrads g{dw1.data(), dw2.data(), dwr.data()};
  for (int i = 0; i < passes; ++i) {
    std::fill(dw1.begin(), dw1.end(), 0.0f);
    std::fill(dw2.begin(), dw2.end(), 0.0f);
    std::fill(dwr.begin(), dwr.end(), 0.0f);
    layer->forward(p.x.data(), p.T, y.data());
    layer->backward(p.dy.data(), dx.data(), g);
  }
  Result res;
  res.y = widen(y);
  res.dx = widen(dx);
  res.dw1.assign(dw1.begin(), dw1.end());
  res.dw2.assign(dw2.begin(), dw2.end());
  res.dwr.assign(dwr.begin(), dwr.end());
  res.rep = layer->cast_report();
  res.st = layer->status();
  return res;
}

double rel_err(const std::vector<double>& a, const std::vector<double>& ref) {
  double num2 = 0.0, den2 = 0.0;
  for (size_t i = 0; i < a.size(); ++i) {
    num2 += (a[i] - ref[i]) * (a[i] - ref[i]);
    den2 += ref[i] * ref[i];
  }
  return std::sqrt(num2 / den2);
}

// ---- float64 reference of the whole layer ----------------------------------------------------------
// The same function as moe.h's comment, in double: router on double logits, top-k by value (ties to
// the lower index), SwiGLU with the probability on its output, plain-sum unpermute. Backward by
// hand (and checked against finite differences below).
struct RefParams {
  int64_t H, F, T;
  int E, k;
  RouterScore score;
  bool renorm;
  double scale;
};

struct RefOut {
  std::vector<double> y, dx, dw1, dw2, dwr;
};

double sigmoid(double z) { return 1.0 / (1.0 + std::exp(-z)); }

RefOut ref_layer(const RefParams& P, const std::vector<double>& x, const std::vector<double>& w1,
                 const std::vector<double>& w2, const std::vector<double>& wr,
                 const std::vector<double>& dy, bool backward = true) {
  const int64_t H = P.H, F = P.F, T = P.T;
  const int E = P.E, k = P.k;
  RefOut o;
  o.y.assign(T * H, 0.0);
  o.dx.assign(T * H, 0.0);
  o.dw1.assign(int64_t(E) * 2 * F * H, 0.0);
  o.dw2.assign(int64_t(E) * H * F, 0.0);
  o.dwr.assign(int64_t(E) * H, 0.0);
  for (int64_t t = 0; t < T; ++t) {
    const double* xt = &x[t * H];
    std::vector<double> z(E), v(E);
    for (int e = 0; e < E; ++e) {
      double acc = 0.0;
      for (int64_t h = 0; h < H; ++h) acc += xt[h] * wr[e * H + h];
      z[e] = acc;
    }
    if (P.score == RouterScore::kSoftmax) {
      const double m = *std::max_element(z.begin(), z.end());
      double s = 0.0;
      for (int e = 0; e < E; ++e) s += (v[e] = std::exp(z[e] - m));
      for (int e = 0; e < E; ++e) v[e] /= s;
    } else {
      for (int e = 0; e < E; ++e) v[e] = sigmoid(z[e]);
    }
    std::vector<int> ids;
    std::vector<bool> used(E, false);
    for (int j = 0; j < k; ++j) {
      int best = -1;
      for (int e = 0; e < E; ++e)
        if (!used[e] && (best < 0 || v[e] > v[best])) best = e;
      used[best] = true;
      ids.push_back(best);
    }
    double S = 0.0;
    for (int j = 0; j < k; ++j) S += v[ids[j]];
    std::vector<double> q(k), prob(k);
    for (int j = 0; j < k; ++j) {
      q[j] = P.renorm ? v[ids[j]] / S : v[ids[j]];
      prob[j] = q[j] * P.scale;
    }
    std::vector<double> g(k, 0.0);  // d loss / d prob_j
    for (int j = 0; j < k; ++j) {
      const int e = ids[j];
      const double* W1 = &w1[int64_t(e) * 2 * F * H];
      const double* W2 = &w2[int64_t(e) * H * F];
      std::vector<double> hh(2 * F, 0.0), a(F), ap(F);
      for (int64_t i = 0; i < 2 * F; ++i) {
        double acc = 0.0;
        for (int64_t c = 0; c < H; ++c) acc += W1[i * H + c] * xt[c];
        hh[i] = acc;
      }
      for (int64_t i = 0; i < F; ++i) {
        const double gt = hh[i], up = hh[F + i];
        a[i] = gt * sigmoid(gt) * up;
        ap[i] = prob[j] * a[i];
      }
      for (int64_t c = 0; c < H; ++c) {
        double acc = 0.0;
        for (int64_t i = 0; i < F; ++i) acc += W2[c * F + i] * ap[i];
        o.y[t * H + c] += acc;
      }
      if (!backward) continue;
      const double* dyt = &dy[t * H];
      std::vector<double> dap(F, 0.0), dh(2 * F);
      for (int64_t i = 0; i < F; ++i) {
        double acc = 0.0;
        for (int64_t c = 0; c < H; ++c) acc += W2[c * F + i] * dyt[c];
        dap[i] = acc;
      }
      double* dW2 = &o.dw2[int64_t(e) * H * F];
      for (int64_t c = 0; c < H; ++c)
        for (int64_t i = 0; i < F; ++i) dW2[c * F + i] += dyt[c] * ap[i];
      for (int64_t i = 0; i < F; ++i) {
        const double gt = hh[i], up = hh[F + i], s = sigmoid(gt);
        const double da = prob[j] * dap[i];
        dh[i] = da * up * s * (1.0 + gt * (1.0 - s));
        dh[F + i] = da * gt * s;
        g[j] += dap[i] * a[i];
      }
      double* dW1 = &o.dw1[int64_t(e) * 2 * F * H];
      for (int64_t i = 0; i < 2 * F; ++i)
        for (int64_t c = 0; c < H; ++c) {
          dW1[i * H + c] += dh[i] * xt[c];
          o.dx[t * H + c] += W1[i * H + c] * dh[i];
        }
    }
    if (!backward) continue;
    // router backward: dz [E]
    std::vector<double> dz(E, 0.0);
    const double c = P.scale;
    if (P.score == RouterScore::kSoftmax && !P.renorm) {
      for (int j = 0; j < k; ++j)
        for (int m = 0; m < E; ++m)
          dz[m] += g[j] * c * v[ids[j]] * ((m == ids[j] ? 1.0 : 0.0) - v[m]);
    } else if (P.score == RouterScore::kSoftmax) {
      double gq = 0.0;
      for (int j = 0; j < k; ++j) gq += g[j] * q[j];
      for (int j = 0; j < k; ++j) dz[ids[j]] += c * q[j] * (g[j] - gq);
    } else if (!P.renorm) {
      for (int j = 0; j < k; ++j) {
        const double s = v[ids[j]];
        dz[ids[j]] += c * g[j] * s * (1.0 - s);
      }
    } else {
      double gq = 0.0;
      for (int j = 0; j < k; ++j) gq += g[j] * q[j];
      for (int j = 0; j < k; ++j) {
        const double s = v[ids[j]];
        dz[ids[j]] += c * s * (1.0 - s) * (g[j] - gq) / S;
      }
    }
    for (int e = 0; e < E; ++e)
      for (int64_t h = 0; h < H; ++h) {
        o.dwr[e * H + h] += dz[e] * xt[h];
        o.dx[t * H + h] += dz[e] * wr[e * H + h];
      }
  }
  return o;
}

RefParams ref_params(const Problem& p) {
  return RefParams{p.cfg.hidden,  p.cfg.ffn, p.T, p.cfg.num_experts, p.cfg.topk, p.cfg.router,
                   p.cfg.router_renormalize, p.cfg.router_scale};
}

// The reference on the values the bf16 layer computes from: BF16 x and dy, BF16-rounded W1/W2,
// FP32 Wr.
RefOut ref_of(const Problem& p) {
  std::vector<double> w1(p.w1.size()), w2(p.w2.size()), wr(p.wr.begin(), p.wr.end());
  for (size_t i = 0; i < w1.size(); ++i) w1[i] = num::bf16_to_f32(num::f32_to_bf16(p.w1[i]));
  for (size_t i = 0; i < w2.size(); ++i) w2[i] = num::bf16_to_f32(num::f32_to_bf16(p.w2[i]));
  return ref_layer(ref_params(p), widen(p.x), w1, w2, wr, widen(p.dy));
}

double dot(const std::vector<double>& a, const std::vector<double>& b) {
  double s = 0.0;
  for (size_t i = 0; i < a.size(); ++i) s += a[i] * b[i];
  return s;
}

// ---- tests -----------------------------------------------------------------------------------------

// The float64 reference's backward against central differences of L = <y, dy>, every router mode.
TEST(MoeReference, GradientsMatchFiniteDifferences) {
  struct Mode {
    RouterScore s;
    bool renorm;
    double scale;
  } modes[] = {{RouterScore::kSoftmax, false, 1.0},
               {RouterScore::kSoftmax, true, 1.0},
               {RouterScore::kSigmoid, false, 1.0},
               {RouterScore::kSigmoid, true, 2.5}};
  for (const Mode& md : modes) {
    RefParams P{128, 128, 3, 4, 2, md.s, md.renorm, md.scale};
    Rng rng(7);
    auto rnd = [&](size_t n, double sc) {
      std::vector<double> v(n);
      for (double& d : v) d = rng.normal() * sc;
      return v;
    };
    std::vector<double> x = rnd(P.T * P.H, 1.0), dy = rnd(P.T * P.H, 1.0);
    std::vector<double> w1 = rnd(P.E * 2 * P.F * P.H, 1.0 / std::sqrt(128.0));
    std::vector<double> w2 = rnd(P.E * P.H * P.F, 1.0 / std::sqrt(128.0));
    std::vector<double> wr = rnd(P.E * P.H, 1.0 / std::sqrt(128.0));
    const RefOut g = ref_layer(P, x, w1, w2, wr, dy);
    auto loss = [&]() { return dot(ref_layer(P, x, w1, w2, wr, dy, false).y, dy); };
    double worst = 0.0;
    auto check = [&](std::vector<double>& param, const std::vector<double>& grad, const char* nm) {
      for (int s = 0; s < 6; ++s) {
        const size_t i = rng.next() % param.size();
        const double old = param[i], eps = 1e-5;
        param[i] = old + eps;
        const double lp = loss();
        param[i] = old - eps;
        const double lm = loss();
        param[i] = old;
        const double fd = (lp - lm) / (2 * eps);
        const double err = std::fabs(fd - grad[i]) / std::max(1.0, std::fabs(fd));
        worst = std::max(worst, err);
        EXPECT_LT(err, 1e-6) << nm << "[" << i << "]: finite difference " << fd << ", analytic "
                             << grad[i];
      }
    };
    check(x, g.dx, "x");
    check(w1, g.dw1, "W1");
    check(w2, g.dw2, "W2");
    check(wr, g.dwr, "Wr");
    std::printf("[ measure  ] FD vs analytic (%s%s): worst relative difference %.2e\n",
                md.s == RouterScore::kSoftmax ? "softmax" : "sigmoid", md.renorm ? "+renorm" : "",
                worst);
  }
}

// bf16 recipe against the float64 reference: forward and backward.
TEST(MoeLayer, Bf16MatchesFloat64Reference) {
  struct Case {
    RouterScore s;
    bool renorm;
    int align;
  } cases[] = {{RouterScore::kSoftmax, false, 16}, {RouterScore::kSigmoid, true, 128}};
  for (const Case& c : cases) {
    MoeConfig cfg = make_cfg(256, 128, 4, 2, 24, Recipe::kBf16, c.s, c.align);
    cfg.router_renormalize = c.renorm;
    if (c.renorm) cfg.router_scale = 2.5f;
    const Problem p = make_problem(cfg, 24, 11);
    const Result r = run_layer(p, Recipe::kBf16);
    const RefOut ref = ref_of(p);
    const double ey = rel_err(r.y, ref.y), edx = rel_err(r.dx, ref.dx);
    const double e1 = rel_err(r.dw1, ref.dw1), e2 = rel_err(r.dw2, ref.dw2);
    const double er = rel_err(r.dwr, ref.dwr);
    std::printf("[ measure  ] bf16 vs float64 (%s): y %.2e dx %.2e dW1 %.2e dW2 %.2e dWr %.2e\n",
                cfg.describe().c_str(), ey, edx, e1, e2, er);
    // BF16 roundings of h, a', the GEMM2 rows, y, dy rows, da', dh, dx rows: each 2^-9 relative.
    EXPECT_LT(ey, 1e-2);
    EXPECT_LT(edx, 1e-2);
    EXPECT_LT(e1, 1e-2);
    EXPECT_LT(e2, 1e-2);
    EXPECT_LT(er, 2e-2);
  }
}

// Every quantized recipe against bf16 on the same inputs (and against float64).
TEST(MoeLayer, QuantizedRecipesAgainstBf16) {
  const MoeConfig cfg = make_cfg(256, 256, 4, 2, 48, Recipe::kBf16);
  const Problem p = make_problem(cfg, 48, 21);
  const Result b = run_layer(p, Recipe::kBf16);
  const RefOut ref = ref_of(p);
  struct Bound {
    Recipe r;
    double y, dx, dw;
  } bounds[] = {// measured (this data): 6.4-8.2e-2 for the FP8 recipes, 1.5-1.9e-1 for flow-fp4:
                // about four E4M3 roundings (x, W1, a', W2) of ~3% RMS each on the forward
                {Recipe::kBlockwise, 0.10, 0.12, 0.12},
                {Recipe::kFp8Naive, 0.10, 0.12, 0.12},
                {Recipe::kFlow, 0.10, 0.12, 0.12},
                {Recipe::kFlowFp4, 0.25, 0.25, 0.30}};
  std::printf("[ measure  ] relative error (L2) vs bf16 recipe | vs float64, %s T=%lld\n",
              cfg.describe().c_str(), static_cast<long long>(p.T));
  for (const Bound& bd : bounds) {
    const Result q = run_layer(p, bd.r);
    const double ey = rel_err(q.y, b.y), edx = rel_err(q.dx, b.dx);
    const double e1 = rel_err(q.dw1, b.dw1), e2 = rel_err(q.dw2, b.dw2);
    const double er = rel_err(q.dwr, b.dwr);
    std::printf("[ measure  ]   %-9s y %.3e dx %.3e dW1 %.3e dW2 %.3e dWr %.3e | y %.3e dx %.3e "
                "dW1 %.3e dW2 %.3e\n",
                flowmoe::recipe_name(bd.r), ey, edx, e1, e2, er, rel_err(q.y, ref.y),
                rel_err(q.dx, ref.dx), rel_err(q.dw1, ref.dw1), rel_err(q.dw2, ref.dw2));
    EXPECT_LT(ey, bd.y) << flowmoe::recipe_name(bd.r);
    EXPECT_LT(edx, bd.dx) << flowmoe::recipe_name(bd.r);
    EXPECT_LT(e1, bd.dw) << flowmoe::recipe_name(bd.r);
    EXPECT_LT(e2, bd.dw) << flowmoe::recipe_name(bd.r);
    EXPECT_LT(er, bd.dw) << flowmoe::recipe_name(bd.r);
    // FP8 is not exact: it must differ from bf16 at all (catches a recipe silently running BF16)
    EXPECT_GT(ey, 1e-3) << flowmoe::recipe_name(bd.r);
  }
}

const flowmoe::ColumnCheck* find_col(const CastReport& rep, const std::string& name) {
  for (const auto& c : rep.columns)
    if (c.name == name) return &c;
  return nullptr;
}

// flow: the column-wise operands of wgrad decode to the row-wise values of the other GEMM except
// the counted underflow; fp8-naive (FP32 scales, DQ->T->Q) does not.
TEST(MoeLayer, FlowColumnCopiesAreExactNaiveAreNot) {
  const MoeConfig cfg = make_cfg(256, 128, 4, 2, 64, Recipe::kFlow);
  Problem p = make_problem(cfg, 64, 31);
  // heavier tails in x: some outlier tokens, so shared column exponents push values down
  Rng rng(5);
  for (int64_t t = 0; t < p.T; t += 7)
    for (int64_t h = 0; h < cfg.hidden; ++h)
      p.x[t * cfg.hidden + h] = num::f32_to_bf16(num::bf16_to_f32(p.x[t * cfg.hidden + h]) * 300.0f);
  for (Recipe r : {Recipe::kFlow, Recipe::kFlowFp4, Recipe::kFp8Naive, Recipe::kBlockwise}) {
    const Result q = run_layer(p, r, /*check_columns=*/true);
    for (const auto& c : q.rep.columns)
      std::printf("[ measure  ] %-9s %-20s %-34s %6lld of %7lld differ (%.3f%%), underflow %lld\n",
                  flowmoe::recipe_name(r), c.name.c_str(), c.method.c_str(),
                  static_cast<long long>(c.differ), static_cast<long long>(c.elements),
                  100.0 * double(c.differ) / double(c.elements), static_cast<long long>(c.underflow));
    if (r == Recipe::kFlow || r == Recipe::kFlowFp4) {
      for (const char* nm : {"GEMM1 input x_perm", "GEMM2 input a'", "GEMM2 grad dY"}) {
        const flowmoe::ColumnCheck* c = find_col(q.rep, nm);
        ASSERT_NE(c, nullptr) << nm;
        EXPECT_GT(c->elements, 0);
        // exactly the counted underflow, nothing else (with these outlier tokens the underflow
        // of a' is large: see the measure lines and docs/MOE.md)
        EXPECT_EQ(c->differ, c->underflow) << flowmoe::recipe_name(r) << " " << nm;
      }
    }
    if (r == Recipe::kFp8Naive) {
      for (const char* nm : {"GEMM1 input x_perm", "GEMM2 input a'", "GEMM2 grad dY", "GEMM1 grad dh"}) {
        const flowmoe::ColumnCheck* c = find_col(q.rep, nm);
        ASSERT_NE(c, nullptr) << nm;
        // double quantization with FP32 scales re-rounds most values
        EXPECT_GT(double(c->differ), 0.3 * double(c->elements)) << nm;
      }
    }
  }
  // the outliers made the shared exponents matter: flow reported underflow somewhere
  const Result f = run_layer(p, Recipe::kFlow, true);
  EXPECT_GT(f.rep.forward_stats.underflow + f.rep.backward_stats.underflow, 0);
  // what that underflow costs on this outlier-heavy data, against bf16
  const Result b = run_layer(p, Recipe::kBf16);
  for (Recipe r : {Recipe::kBlockwise, Recipe::kFp8Naive, Recipe::kFlow, Recipe::kFlowFp4}) {
    const Result q = run_layer(p, r);
    std::printf("[ measure  ] outlier data, %-9s vs bf16: y %.3e dx %.3e dW1 %.3e dW2 %.3e\n",
                flowmoe::recipe_name(r), rel_err(q.y, b.y), rel_err(q.dx, b.dx),
                rel_err(q.dw1, b.dw1), rel_err(q.dw2, b.dw2));
  }
}

// The column-amax exponent (MoeConfig::transpose_exponent) on the outlier data above: the
// column-wise copies still decode to the row-wise values except counted underflow, with far less
// underflow than the row-max exponent, and the layer's results move closer to bf16 (or stay).
TEST(MoeLayer, ColumnAmaxExponentCutsFlowUnderflow) {
  MoeConfig cfg = make_cfg(256, 128, 4, 2, 64, Recipe::kFlow);
  Problem p = make_problem(cfg, 64, 31);
  for (int64_t t = 0; t < p.T; t += 7)
    for (int64_t h = 0; h < cfg.hidden; ++h)
      p.x[t * cfg.hidden + h] = num::f32_to_bf16(num::bf16_to_f32(p.x[t * cfg.hidden + h]) * 300.0f);
  const Result b = run_layer(p, Recipe::kBf16);
  p.cfg.transpose_exponent = flowmoe::cpu::TransposeExponent::kRowMax;  // whatever the default
  const Result rowmax = run_layer(p, Recipe::kFlow, /*check_columns=*/true);
  p.cfg.transpose_exponent = flowmoe::cpu::TransposeExponent::kColumnAmax;
  const Result tight = run_layer(p, Recipe::kFlow, /*check_columns=*/true);
  for (const char* nm : {"GEMM1 input x_perm", "GEMM2 input a'", "GEMM2 grad dY"}) {
    const flowmoe::ColumnCheck* r = find_col(rowmax.rep, nm);
    const flowmoe::ColumnCheck* c = find_col(tight.rep, nm);
    ASSERT_NE(r, nullptr) << nm;
    ASSERT_NE(c, nullptr) << nm;
    EXPECT_EQ(c->differ, c->underflow) << nm;
    EXPECT_LE(c->underflow, r->underflow) << nm;
    std::printf("[ measure  ] flow %-20s underflow: row-max %lld, column-amax %lld of %lld\n", nm,
                static_cast<long long>(r->underflow), static_cast<long long>(c->underflow),
                static_cast<long long>(c->elements));
  }
  const double e_row = rel_err(rowmax.dw2, b.dw2), e_col = rel_err(tight.dw2, b.dw2);
  std::printf("[ measure  ] flow dW2 vs bf16: row-max %.3e, column-amax %.3e\n", e_row, e_col);
  EXPECT_LE(e_col, e_row * 1.05);
  EXPECT_LT(tight.rep.forward_stats.underflow + tight.rep.backward_stats.underflow,
            rowmax.rep.forward_stats.underflow + rowmax.rep.backward_stats.underflow);
}

TEST(MoeLayer, Deterministic) {
  const MoeConfig cfg = make_cfg(256, 128, 4, 2, 32, Recipe::kBf16);
  const Problem p = make_problem(cfg, 32, 41);
  for (Recipe r : flowmoe::all_recipes()) {
    const Result a = run_layer(p, r);
    const Result b = run_layer(p, r, false, /*passes=*/2);  // another layer, second step
    EXPECT_EQ(a.y, b.y) << flowmoe::recipe_name(r);
    EXPECT_EQ(a.dx, b.dx) << flowmoe::recipe_name(r);
    EXPECT_EQ(a.dw1, b.dw1) << flowmoe::recipe_name(r);
    EXPECT_EQ(a.dw2, b.dw2) << flowmoe::recipe_name(r);
    EXPECT_EQ(a.dwr, b.dwr) << flowmoe::recipe_name(r);
  }
}

TEST(MoeLayer, GradientsAccumulate) {
  const MoeConfig cfg = make_cfg(128, 128, 4, 2, 16, Recipe::kFlow);
  const Problem p = make_problem(cfg, 16, 43);
  auto layer = flowmoe::make_cpu_layer(cfg);
  layer->set_weights({p.w1.data(), p.w2.data(), p.wr.data(), nullptr});
  std::vector<bf16_t> y(p.T * 128), dx(p.T * 128);
  std::vector<float> dw1(4 * 256 * 128, 0.0f), dw2(4 * 128 * 128, 0.0f), dwr(4 * 128, 0.0f);
  layer->forward(p.x.data(), p.T, y.data());
  layer->backward(p.dy.data(), dx.data(), {dw1.data(), dw2.data(), dwr.data()});
  const std::vector<float> once1 = dw1, once2 = dw2, oncer = dwr;
  layer->forward(p.x.data(), p.T, y.data());
  layer->backward(p.dy.data(), dx.data(), {dw1.data(), dw2.data(), dwr.data()});
  for (size_t i = 0; i < dw1.size(); ++i) ASSERT_EQ(dw1[i], once1[i] + once1[i]);
  for (size_t i = 0; i < dw2.size(); ++i) ASSERT_EQ(dw2[i], once2[i] + once2[i]);
  for (size_t i = 0; i < dwr.size(); ++i) ASSERT_EQ(dwr[i], oncer[i] + oncer[i]);
}

// MoeGrads::accumulate = false writes this backward's gradients: NaN-filled buffers come out equal
// to a backward accumulated into zeros, every recipe (a zero-token expert included: E 8, T 3).
TEST(MoeLayer, OverwrittenGradientsIgnoreOldContents) {
  for (Recipe r : flowmoe::all_recipes()) {
    const MoeConfig cfg = make_cfg(128, 128, 8, 2, 16, r);
    const Problem p = make_problem(cfg, 3, 47);
    auto layer = flowmoe::make_cpu_layer(cfg);
    layer->set_weights({p.w1.data(), p.w2.data(), p.wr.data(), nullptr});
    std::vector<bf16_t> y(p.T * 128), dx(p.T * 128);
    std::vector<float> a1(8 * 256 * 128, 0.0f), a2(8 * 128 * 128, 0.0f), ar(8 * 128, 0.0f);
    layer->forward(p.x.data(), p.T, y.data());
    layer->backward(p.dy.data(), dx.data(), {a1.data(), a2.data(), ar.data()});
    const float nan = std::numeric_limits<float>::quiet_NaN();
    std::vector<float> o1(a1.size(), nan), o2(a2.size(), nan), orr(ar.size(), nan);
    flowmoe::MoeGrads g{o1.data(), o2.data(), orr.data()};
    g.accumulate = false;
    layer->forward(p.x.data(), p.T, y.data());
    layer->backward(p.dy.data(), dx.data(), g);
    for (size_t i = 0; i < a1.size(); ++i) ASSERT_EQ(o1[i], a1[i]) << flowmoe::recipe_name(r) << " dW1[" << i << "]";
    for (size_t i = 0; i < a2.size(); ++i) ASSERT_EQ(o2[i], a2[i]) << flowmoe::recipe_name(r) << " dW2[" << i << "]";
    for (size_t i = 0; i < ar.size(); ++i) ASSERT_EQ(orr[i], ar[i]) << flowmoe::recipe_name(r) << " dWr[" << i << "]";
  }
}

void expect_error(const MoeConfig& c, const std::string& needle) {
  try {
    c.validate();
    ADD_FAILURE() << "no error for " << needle;
  } catch (const flowmoe::Error& e) {
    EXPECT_NE(std::string(e.what()).find(needle), std::string::npos) << e.what();
  }
  EXPECT_THROW(flowmoe::make_cpu_layer(c), flowmoe::Error);
}

TEST(MoeConfig, BadConfigsThrowClearErrors) {
  const MoeConfig ok = make_cfg(256, 128, 4, 2, 16, Recipe::kFlow);
  EXPECT_NO_THROW(ok.validate());
  MoeConfig c = ok;
  c.hidden = 200;
  expect_error(c, "hidden H = 200 is not a positive multiple of 128");
  c = ok;
  c.ffn = 0;
  expect_error(c, "ffn F = 0");
  c = ok;
  c.topk = 5;
  expect_error(c, "top_k k = 5 exceeds num_experts E = 4");
  c = ok;
  c.num_experts = 0;
  expect_error(c, "num_experts E = 0");
  c = ok;
  c.align = 8;
  expect_error(c, "align A = 8 not supported");
  c = ok;
  c.max_tokens = 0;
  expect_error(c, "max_tokens = 0");
  c = ok;
  c.router_scale = -1.0f;
  expect_error(c, "router_scale");
  // Expert parallelism (tests/cpu/test_moe_ep.cpp has the collective cases): E must split evenly
  // over the ranks. validate() alone, since make_cpu_layer with a communicator is collective.
  c = ok;
  flowmoe::SimWorld world3(3);
  c.comm = &world3.comm(0);
  try {
    c.validate();
    ADD_FAILURE() << "no error for E = 4 over 3 ranks";
  } catch (const flowmoe::Error& e) {
    EXPECT_NE(std::string(e.what()).find("num_experts E = 4 is not divisible by the 3 ranks"),
              std::string::npos)
        << e.what();
  }
  c.num_experts = 6;
  c.topk = 2;
  EXPECT_NO_THROW(c.validate());
  EXPECT_EQ(c.num_local_experts(), 2);

  EXPECT_EQ(flowmoe::parse_recipe("flow-fp4"), Recipe::kFlowFp4);
  for (Recipe r : flowmoe::all_recipes())
    EXPECT_EQ(flowmoe::parse_recipe(flowmoe::recipe_name(r)), r);
  try {
    flowmoe::parse_recipe("fp8");
    ADD_FAILURE();
  } catch (const flowmoe::Error& e) {
    EXPECT_NE(std::string(e.what()).find("unknown MoE recipe 'fp8'; expected one of: bf16, "
                                         "blockwise, fp8-naive, flow, flow-fp4"),
              std::string::npos)
        << e.what();
  }

  // call-order and argument errors of the layer
  auto layer = flowmoe::make_cpu_layer(ok);
  std::vector<bf16_t> x(16 * 256), y(16 * 256);
  EXPECT_THROW(layer->forward(x.data(), 16, y.data()), flowmoe::Error);  // no weights yet
  std::vector<float> w1(4 * 256 * 256, 0.01f), w2(4 * 256 * 128, 0.01f), wr(4 * 256, 0.01f);
  EXPECT_THROW(layer->set_weights({nullptr, w2.data(), wr.data(), nullptr}), flowmoe::Error);
  layer->set_weights({w1.data(), w2.data(), wr.data(), nullptr});
  EXPECT_THROW(layer->backward(x.data(), y.data(), {}), flowmoe::Error);  // no forward yet
  EXPECT_THROW(layer->forward(x.data(), 17, y.data()), flowmoe::Error);   // T > max_tokens
  EXPECT_THROW(layer->forward(x.data(), 0, y.data()), flowmoe::Error);
  w1[5] = NAN;
  EXPECT_THROW(layer->set_weights({w1.data(), w2.data(), wr.data(), nullptr}),
               flowmoe::NonFiniteError);
}

// Cast counts, from what each recipe executed.
TEST(MoeLayer, CastCounts) {
  const MoeConfig cfg = make_cfg(256, 128, 4, 2, 32, Recipe::kBf16);
  const Problem p = make_problem(cfg, 32, 51);
  std::printf("[ measure  ] casts per pass (standalone quantize + dequantize | fused | exact "
              "convert), weight update\n");
  int64_t total[5] = {};
  for (Recipe r : flowmoe::all_recipes()) {
    const Result q = run_layer(p, r, false, /*passes=*/2);  // counts are per pass, not cumulative
    const CastReport& rep = q.rep;
    const int i = static_cast<int>(r);
    total[i] = rep.standalone_casts(MoePass::kForward) + rep.standalone_casts(MoePass::kBackward);
    std::printf("[ measure  ]   %-9s fwd %lld|%lld|%lld  bwd %lld|%lld|%lld  total standalone %lld"
                "  weights %lld\n",
                flowmoe::recipe_name(r),
                static_cast<long long>(rep.standalone_casts(MoePass::kForward)),
                static_cast<long long>(rep.count(MoePass::kForward, CastKind::kFused)),
                static_cast<long long>(rep.count(MoePass::kForward, CastKind::kConvert)),
                static_cast<long long>(rep.standalone_casts(MoePass::kBackward)),
                static_cast<long long>(rep.count(MoePass::kBackward, CastKind::kFused)),
                static_cast<long long>(rep.count(MoePass::kBackward, CastKind::kConvert)),
                static_cast<long long>(total[i]),
                static_cast<long long>(rep.standalone_casts(MoePass::kWeightUpdate)));
  }
  const auto at = [&](Recipe r) { return total[static_cast<int>(r)]; };
  EXPECT_EQ(at(Recipe::kBf16), 0);
  EXPECT_EQ(at(Recipe::kFlow), 2);     // x and dy, once each, at the entry
  EXPECT_EQ(at(Recipe::kFlowFp4), 2);
  EXPECT_LT(at(Recipe::kFlow), at(Recipe::kBlockwise));
  EXPECT_LT(at(Recipe::kBlockwise), at(Recipe::kFp8Naive));

  const Result flow = run_layer(p, Recipe::kFlow);
  const Result blk = run_layer(p, Recipe::kBlockwise);
  EXPECT_LT(flow.rep.standalone_casts(MoePass::kForward),
            blk.rep.standalone_casts(MoePass::kForward));
  EXPECT_EQ(flow.rep.count(MoePass::kForward, CastKind::kFused), 1);   // SwiGLU+quant
  EXPECT_EQ(flow.rep.count(MoePass::kBackward, CastKind::kFused), 1);  // dSwiGLU+quant
  EXPECT_EQ(flow.rep.count(MoePass::kBackward, CastKind::kConvert), 2);  // two transposes
  EXPECT_EQ(flow.rep.count(MoePass::kForward, CastKind::kDequantize) +
                flow.rep.count(MoePass::kBackward, CastKind::kDequantize),
            0);
  EXPECT_EQ(flow.rep.count(MoePass::kWeightUpdate, CastKind::kQuantize), 2);  // W1, W2
  const Result b16 = run_layer(p, Recipe::kBf16);
  EXPECT_TRUE(b16.rep.ops.empty());
  std::printf("%s", flow.rep.to_string().c_str());
}

// Saved activations per token: flow <= 0.55x bf16 at a DeepSeek-V3-like H/F ratio and top-8.
TEST(MoeLayer, SavedBytesOrdering) {
  // H/F = 3.5 as in DeepSeek-V3 (7168/2048), k = 8; small enough for the CPU.
  const MoeConfig cfg = make_cfg(896, 256, 16, 8, 16, Recipe::kBf16);
  const Problem p = make_problem(cfg, 16, 61);
  double per_tok[5] = {}, per_tok_padded[5] = {};
  for (Recipe r : flowmoe::all_recipes()) {
    MoeConfig c = cfg;
    c.recipe = r;
    auto layer = flowmoe::make_cpu_layer(c);
    layer->set_weights({p.w1.data(), p.w2.data(), p.wr.data(), nullptr});
    std::vector<bf16_t> y(p.T * cfg.hidden);
    layer->forward(p.x.data(), p.T, y.data());
    per_tok[static_cast<int>(r)] = layer->cast_report().saved_bytes_per_token_unpadded();
    per_tok_padded[static_cast<int>(r)] = layer->saved_bytes_per_token();
  }
  const double b = per_tok[0];
  std::printf("[ measure  ] saved bytes/token (%s), unpadded | as allocated:\n",
              cfg.describe().c_str());
  for (Recipe r : flowmoe::all_recipes())
    std::printf("[ measure  ]   %-9s %9.1f (%.3fx bf16) | %9.1f\n", flowmoe::recipe_name(r),
                per_tok[static_cast<int>(r)], per_tok[static_cast<int>(r)] / b,
                per_tok_padded[static_cast<int>(r)]);
  const double flow = per_tok[static_cast<int>(Recipe::kFlow)];
  const double fp4 = per_tok[static_cast<int>(Recipe::kFlowFp4)];
  std::printf("[ measure  ]   flow / bf16 = %.3f (target <= 0.55), flow-fp4 / flow = %.3f (target "
              "<= 0.7)\n",
              flow / b, fp4 / flow);
  EXPECT_LE(flow / b, 0.55);
  EXPECT_LT(fp4, flow);
  EXPECT_LT(flow, per_tok[static_cast<int>(Recipe::kBlockwise)]);
  EXPECT_LT(flow, per_tok[static_cast<int>(Recipe::kFp8Naive)]);
}

TEST(MoeLayer, NonFiniteInputIsReportedNotHidden) {
  const MoeConfig cfg = make_cfg(128, 128, 4, 2, 16, Recipe::kFlow);
  for (Recipe r : flowmoe::all_recipes()) {
    Problem p = make_problem(cfg, 16, 71);
    p.x[3 * 128 + 5] = 0x7FC0;  // NaN in token 3
    const Result q = run_layer(p, r);
    EXPECT_GT(q.st.nonfinite, 0) << flowmoe::recipe_name(r);
    bool any_nan = false;
    for (int64_t h = 0; h < 128; ++h) any_nan |= std::isnan(q.y[3 * 128 + h]);
    EXPECT_TRUE(any_nan) << flowmoe::recipe_name(r) << ": token 3's output became finite";
  }
}

TEST(MoeLayer, AuxLossAndRouterBias) {
  MoeConfig cfg = make_cfg(128, 128, 4, 2, 32, Recipe::kFlow);
  const Problem p = make_problem(cfg, 32, 81);
  cfg.aux_loss_alpha = 0.01f;
  auto layer = flowmoe::make_cpu_layer(cfg);
  std::vector<float> bias(4, 0.0f);
  bias[2] = 10.0f;  // expert 2 always chosen
  layer->set_weights({p.w1.data(), p.w2.data(), p.wr.data(), bias.data()});
  std::vector<bf16_t> y(p.T * 128), dx(p.T * 128);
  std::vector<float> dwr(4 * 128, 0.0f);
  layer->forward(p.x.data(), p.T, y.data());
  EXPECT_GT(layer->status().aux_loss, 0.0f);
  EXPECT_TRUE(std::isfinite(layer->status().aux_loss));
  const CastReport& rep = layer->cast_report();
  EXPECT_EQ(rep.routed_rows, p.T * 2);
  EXPECT_GE(rep.padded_rows, rep.routed_rows);
  layer->backward(p.dy.data(), dx.data(), {nullptr, nullptr, dwr.data()});
  double n = 0.0;
  for (float v : dwr) n += std::fabs(v);
  EXPECT_GT(n, 0.0);
}

// The table of docs/MOE.md §4, printed as markdown from what the code runs, and checked: the cast
// counts of every recipe are those of the table (they do not depend on the shape), the saved bytes
// keep the table's order. CI runs it at a small shape; the documented table is DeepSeek-V3's
// expert sizes (about three minutes on the CPU reference):
//   FLOWMOE_DOC_H=7168 FLOWMOE_DOC_F=2048 FLOWMOE_DOC_E=8 FLOWMOE_DOC_K=8 FLOWMOE_DOC_T=16 \
//   flowmoe_cpu_tests --gtest_filter='*DocTable*'
TEST(MoeLayer, DocTable) {
  auto env = [](const char* n, int64_t d) {
    const char* v = std::getenv(n);
    return v ? std::atoll(v) : d;
  };
  const int64_t H = env("FLOWMOE_DOC_H", 256), F = env("FLOWMOE_DOC_F", 128);
  const int E = static_cast<int>(env("FLOWMOE_DOC_E", 8)), k = static_cast<int>(env("FLOWMOE_DOC_K", 2));
  const int64_t T = env("FLOWMOE_DOC_T", 16);
  const MoeConfig cfg = make_cfg(H, F, E, k, T, Recipe::kBf16);
  const Problem p = make_problem(cfg, T, 91);
  std::printf("%s, T=%lld\n\n", cfg.describe().c_str(), static_cast<long long>(T));
  std::printf("| recipe | fwd quantize | fwd dequantize | fwd fused | fwd exact convert | bwd "
              "quantize | bwd dequantize | bwd fused | bwd exact convert | standalone casts "
              "fwd+bwd (tensors written) | weight update | saved B/token | vs bf16 |\n");
  std::printf("| --- | --- | --- | --- | --- | --- | --- | --- | --- | --- | --- | --- | --- |\n");
  // docs/MOE.md §4, per recipe: fwd Q, DQ, fused, convert; bwd Q, DQ, fused, convert; standalone
  // casts fwd+bwd, tensors they write; weight-update Q.
  struct Row {
    Recipe recipe;
    long long counts[11];
  };
  const Row doc[] = {{Recipe::kBf16, {0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0}},
                     {Recipe::kBlockwise, {2, 0, 0, 0, 2, 0, 0, 0, 4, 8, 2}},
                     {Recipe::kFp8Naive, {3, 1, 0, 0, 7, 5, 0, 0, 16, 16, 2}},
                     {Recipe::kFlow, {1, 0, 1, 0, 1, 0, 1, 2, 2, 2, 2}},
                     {Recipe::kFlowFp4, {1, 0, 1, 1, 1, 0, 1, 2, 2, 2, 2}}};
  std::map<Recipe, double> saved;
  double b16 = 0.0;
  std::string detail;
  for (Recipe r : flowmoe::all_recipes()) {
    const Result q = run_layer(p, r);
    const CastReport& rep = q.rep;
    int64_t outs = 0;
    for (const auto& op : rep.ops)
      if (op.pass != MoePass::kWeightUpdate &&
          (op.kind == CastKind::kQuantize || op.kind == CastKind::kDequantize))
        outs += op.outputs;
    const double sb = rep.saved_bytes_per_token_unpadded();
    if (r == Recipe::kBf16) b16 = sb;
    auto c = [&](MoePass ps, CastKind kd) { return static_cast<long long>(rep.count(ps, kd)); };
    saved[r] = sb;
    const long long got[11] = {c(MoePass::kForward, CastKind::kQuantize), c(MoePass::kForward, CastKind::kDequantize),
                               c(MoePass::kForward, CastKind::kFused), c(MoePass::kForward, CastKind::kConvert),
                               c(MoePass::kBackward, CastKind::kQuantize), c(MoePass::kBackward, CastKind::kDequantize),
                               c(MoePass::kBackward, CastKind::kFused), c(MoePass::kBackward, CastKind::kConvert),
                               static_cast<long long>(rep.standalone_casts(MoePass::kForward) +
                                                      rep.standalone_casts(MoePass::kBackward)),
                               static_cast<long long>(outs), c(MoePass::kWeightUpdate, CastKind::kQuantize)};
    bool found = false;
    for (const Row& row : doc) {
      if (row.recipe != r) continue;
      found = true;
      for (int i = 0; i < 11; ++i)
        EXPECT_EQ(got[i], row.counts[i]) << flowmoe::recipe_name(r) << ": column " << i + 2 << " of docs/MOE.md §4";
    }
    EXPECT_TRUE(found) << flowmoe::recipe_name(r) << " has no row in docs/MOE.md §4";
    std::printf("| `%s` | %lld | %lld | %lld | %lld | %lld | %lld | %lld | %lld | **%lld** (%lld) | "
                "%lld | %.0f | %.3f |\n",
                flowmoe::recipe_name(r), c(MoePass::kForward, CastKind::kQuantize),
                c(MoePass::kForward, CastKind::kDequantize), c(MoePass::kForward, CastKind::kFused),
                c(MoePass::kForward, CastKind::kConvert), c(MoePass::kBackward, CastKind::kQuantize),
                c(MoePass::kBackward, CastKind::kDequantize),
                c(MoePass::kBackward, CastKind::kFused), c(MoePass::kBackward, CastKind::kConvert),
                static_cast<long long>(rep.standalone_casts(MoePass::kForward) +
                                       rep.standalone_casts(MoePass::kBackward)),
                static_cast<long long>(outs), c(MoePass::kWeightUpdate, CastKind::kQuantize), sb,
                sb / b16);
    detail += rep.to_string();
  }
  std::printf("\n%s", detail.c_str());
  // the order of the table's last columns: flow-fp4 < flow < blockwise, fp8-naive < bf16
  EXPECT_LT(saved[Recipe::kFlowFp4], saved[Recipe::kFlow]);
  EXPECT_LT(saved[Recipe::kFlow], saved[Recipe::kBlockwise]);
  EXPECT_LT(saved[Recipe::kBlockwise], saved[Recipe::kBf16]);
  EXPECT_LT(saved[Recipe::kFp8Naive], saved[Recipe::kBf16]);
}

}  // namespace
