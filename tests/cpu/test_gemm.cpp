// Grouped GEMM: the CPU reference against a float64 dequantize-then-matmul, the GEMM-ready FP32
// scale layouts, and every argument error of the GEMM entry points (checked without a GPU).
//
// Tolerance of the reference against float64. The reference sums each 128-wide block in FP32
// (at most 128 terms), scales it exactly (powers of two) and sums the L block results in FP32.
// With u = 2^-24 the standard bound for recursive summation gives
//     |ref - exact| <= (127 + L) * u * S  (+ O(u^2)),  S = sum over the contraction of |a| |b|
// (the decoded, scaled operands; products of E4M3 values are exact in FP32). The tests check
// (128 + L + 2) * u * S. The BF16 references sum K exact products: (K + 2) * u * S.
#include <gtest/gtest.h>

#include <algorithm>
#include <cmath>
#include <cstdlib>
#include <cstring>
#include <functional>
#include <map>
#include <random>
#include <string>
#include <utility>
#include <vector>

#include "flowmoe/cpu/convert.h"
#include "flowmoe/error.h"
#include "flowmoe/gemm.h"
#include "flowmoe/numerics.h"

namespace flowmoe {
namespace {

using gemm::Fp8Operand;
using gemm::Span;
using gemm::WgradOut;

// x [rows, cols] with a random power-of-two factor per (row, 128-column tile) so that the tile
// scales differ (a scale applied to the wrong block shows up).
std::vector<float> tiled_random(int64_t rows, int64_t cols, uint32_t seed, int exp_spread) {
  std::mt19937 rng(seed);
  std::normal_distribution<float> nd(0.f, 1.f);
  std::uniform_int_distribution<int> ed(-exp_spread, exp_spread);
  std::vector<float> x(rows * cols);
  for (int64_t r = 0; r < rows; ++r)
    for (int64_t b = 0; b < cols; b += 128) {
      const float f = std::ldexp(1.0f, ed(rng));
      for (int64_t c = b; c < std::min(cols, b + 128); ++c) x[r * cols + c] = nd(rng) * f;
    }
  return x;
}

// Values from {0, +-0.5, +-1, +-2} times a power of two in [-2, 2] per tile: every FP32 operation
// of the block-scaled GEMM is exact on these.
std::vector<float> tiled_small(int64_t rows, int64_t cols, uint32_t seed) {
  std::mt19937 rng(seed);
  const float vals[] = {0.f, 0.5f, -0.5f, 1.f, -1.f, 2.f, -2.f};
  std::uniform_int_distribution<int> vd(0, 6), ed(-2, 2);
  std::vector<float> x(rows * cols);
  for (int64_t r = 0; r < rows; ++r)
    for (int64_t b = 0; b < cols; b += 128) {
      const float f = std::ldexp(1.0f, ed(rng));
      for (int64_t c = b; c < std::min(cols, b + 128); ++c) x[r * cols + c] = vals[vd(rng)] * f;
    }
  return x;
}

std::vector<float> dq(const QTensor& q) {
  std::vector<float> out(q.rows * q.cols);
  cpu::dequantize(q, out.data());
  return out;
}

// out[i][j] = sum_c a[i][c] b[j][c] in float64, with s[i][j] = sum_c |a b|; a rows i0..i1.
struct Exact {
  std::vector<double> v, s;
};
void exact_rows(const float* a, const float* b, int64_t i0, int64_t i1, int64_t J, int64_t C,
                double* v, double* s, int64_t ldo) {
  for (int64_t i = i0; i < i1; ++i)
    for (int64_t j = 0; j < J; ++j) {
      double acc = 0, sa = 0;
      for (int64_t c = 0; c < C; ++c) {
        const double p = static_cast<double>(a[i * C + c]) * b[j * C + c];
        acc += p;
        sa += std::fabs(p);
      }
      v[i * ldo + j] = acc;
      s[i * ldo + j] = sa;
    }
}

// Transpose [R, C] -> [C, R].
std::vector<float> transpose(const std::vector<float>& x, int64_t r, int64_t c) {
  std::vector<float> t(x.size());
  for (int64_t i = 0; i < r; ++i)
    for (int64_t j = 0; j < c; ++j) t[j * r + i] = x[i * c + j];
  return t;
}

::testing::AssertionResult within(const std::vector<float>& got, const Exact& ex, double gamma,
                                  const char* what) {
  double worst = 0;
  size_t at = 0;
  for (size_t i = 0; i < got.size(); ++i) {
    if (!std::isfinite(got[i])) return ::testing::AssertionFailure() << what << ": non-finite at " << i;
    const double err = std::fabs(got[i] - ex.v[i]);
    const double bound = gamma * ex.s[i];
    if (err > bound) {
      return ::testing::AssertionFailure()
             << what << ": element " << i << " = " << got[i] << ", float64 " << ex.v[i] << ", error "
             << err << " > bound " << bound << " (S = " << ex.s[i] << ")";
    }
    if (ex.s[i] > 0 && err / ex.s[i] > worst) worst = err / ex.s[i], at = i;
  }
  return ::testing::AssertionSuccess() << what << ": max error / S = " << worst << " at " << at;
}

struct Problem {
  Segments seg;
  int64_t m, n, k;
  QTensor x_row, x_col, dy_row, dy_col;
  std::vector<QTensor> w, wt;
};

Problem make_problem(const std::vector<int32_t>& counts, int64_t n, int64_t k, bool small,
                     uint32_t seed) {
  Problem p;
  p.seg = Segments::from_counts(counts);
  p.m = p.seg.num_tokens();
  p.n = n;
  p.k = k;
  const auto x = small ? tiled_small(p.m, k, seed) : tiled_random(p.m, k, seed, 8);
  const auto dy = small ? tiled_small(p.m, n, seed + 1) : tiled_random(p.m, n, seed + 1, 8);
  cpu::quantize_row(x.data(), p.m, k, &p.x_row);
  cpu::quantize_col(x.data(), p.m, k, p.seg, &p.x_col);
  cpu::quantize_row(dy.data(), p.m, n, &p.dy_row);
  cpu::quantize_col(dy.data(), p.m, n, p.seg, &p.dy_col);
  const int E = p.seg.num_segments();
  p.w.resize(E);
  p.wt.resize(E);
  for (int e = 0; e < E; ++e) {
    // weights: one random power of two per 128x128 block via tiled_* over rows of 128
    auto w = small ? tiled_small(n, k, seed + 10 + e) : tiled_random(n, k, seed + 10 + e, 6);
    cpu::quantize_weight(w.data(), n, k, &p.w[e], &p.wt[e]);
  }
  return p;
}

Exact exact_fprop(const Problem& p) {
  Exact ex{std::vector<double>(p.m * p.n), std::vector<double>(p.m * p.n)};
  const auto xd = dq(p.x_row);
  for (int e = 0; e < p.seg.num_segments(); ++e) {
    const auto wd = dq(p.w[e]);
    exact_rows(xd.data(), wd.data(), p.seg.offsets[e], p.seg.offsets[e + 1], p.n, p.k, ex.v.data(),
               ex.s.data(), p.n);
  }
  return ex;
}
Exact exact_dgrad(const Problem& p) {
  Exact ex{std::vector<double>(p.m * p.k), std::vector<double>(p.m * p.k)};
  const auto dyd = dq(p.dy_row);
  for (int e = 0; e < p.seg.num_segments(); ++e) {
    const auto wtd = dq(p.wt[e]);  // [K, N]
    exact_rows(dyd.data(), wtd.data(), p.seg.offsets[e], p.seg.offsets[e + 1], p.k, p.n, ex.v.data(),
               ex.s.data(), p.k);
  }
  return ex;
}
Exact exact_wgrad(const Problem& p) {
  const int E = p.seg.num_segments();
  Exact ex{std::vector<double>(E * p.n * p.k, 0.0), std::vector<double>(E * p.n * p.k, 0.0)};
  const auto dyt = transpose(dq(p.dy_col), p.m, p.n);  // [N, M]
  const auto xt = transpose(dq(p.x_col), p.m, p.k);    // [K, M]
  for (int e = 0; e < E; ++e)
    for (int64_t i = 0; i < p.n; ++i)
      for (int64_t j = 0; j < p.k; ++j) {
        double acc = 0, s = 0;
        for (int64_t t = p.seg.offsets[e]; t < p.seg.offsets[e + 1]; ++t) {
          const double v = static_cast<double>(dyt[i * p.m + t]) * xt[j * p.m + t];
          acc += v;
          s += std::fabs(v);
        }
        ex.v[(e * p.n + i) * p.k + j] = acc;
        ex.s[(e * p.n + i) * p.k + j] = s;
      }
  return ex;
}

double gamma_blocks(int64_t contraction) {
  const int64_t L = (contraction + 127) / 128;
  return (128.0 + L + 2.0) * std::ldexp(1.0, -24);
}

struct RefCase {
  const char* name;
  std::vector<int32_t> counts;
  int64_t n, k;
};
std::ostream& operator<<(std::ostream& os, const RefCase& c) { return os << c.name; }

class GemmRef : public ::testing::TestWithParam<RefCase> {};

TEST_P(GemmRef, MatchesFloat64WithinBound) {
  const RefCase& c = GetParam();
  const Problem p = make_problem(c.counts, c.n, c.k, false, 7u + static_cast<uint32_t>(c.n + c.k));
  std::vector<float> y(p.m * p.n), dx(p.m * p.k);
  cpu::grouped_fprop_ref(p.x_row, p.w, p.seg, y.data());
  EXPECT_TRUE(within(y, exact_fprop(p), gamma_blocks(p.k), "fprop"));
  cpu::grouped_dgrad_ref(p.dy_row, p.wt, p.seg, dx.data());
  EXPECT_TRUE(within(dx, exact_dgrad(p), gamma_blocks(p.n), "dgrad"));
  // wgrad: the contraction is one expert's tokens; its blocks follow the segment.
  const int E = p.seg.num_segments();
  std::vector<float> dw(E * p.n * p.k, -123.0f);
  cpu::grouped_wgrad_ref(p.dy_col, p.x_col, dw.data(), false);
  int64_t max_me = 0;
  for (int e = 0; e < E; ++e) max_me = std::max<int64_t>(max_me, p.seg.offsets[e + 1] - p.seg.offsets[e]);
  EXPECT_TRUE(within(dw, exact_wgrad(p), gamma_blocks(max_me), "wgrad"));
  // empty experts get zeros, accumulate adds exactly what the overwrite computed
  std::vector<float> acc(dw.size());
  for (size_t i = 0; i < acc.size(); ++i) acc[i] = static_cast<float>(i % 7) - 3.0f;
  std::vector<float> want = acc;
  for (size_t i = 0; i < acc.size(); ++i) want[i] = acc[i] + dw[i];
  cpu::grouped_wgrad_ref(p.dy_col, p.x_col, acc.data(), true);
  EXPECT_EQ(std::memcmp(acc.data(), want.data(), acc.size() * 4), 0) << "accumulate";
  for (int e = 0; e < E; ++e)
    if (p.seg.offsets[e + 1] == p.seg.offsets[e])
      for (int64_t i = 0; i < p.n * p.k; ++i) ASSERT_EQ(dw[e * p.n * p.k + i], 0.0f) << "expert " << e;
}

TEST_P(GemmRef, ExactOnSmallValues) {
  const RefCase& c = GetParam();
  const Problem p = make_problem(c.counts, c.n, c.k, true, 99u + static_cast<uint32_t>(c.n));
  std::vector<float> y(p.m * p.n), dx(p.m * p.k), dw(p.seg.num_segments() * p.n * p.k);
  cpu::grouped_fprop_ref(p.x_row, p.w, p.seg, y.data());
  cpu::grouped_dgrad_ref(p.dy_row, p.wt, p.seg, dx.data());
  cpu::grouped_wgrad_ref(p.dy_col, p.x_col, dw.data(), false);
  const Exact ey = exact_fprop(p), edx = exact_dgrad(p), edw = exact_wgrad(p);
  for (size_t i = 0; i < y.size(); ++i) ASSERT_EQ(static_cast<double>(y[i]), ey.v[i]) << "fprop " << i;
  for (size_t i = 0; i < dx.size(); ++i) ASSERT_EQ(static_cast<double>(dx[i]), edx.v[i]) << "dgrad " << i;
  for (size_t i = 0; i < dw.size(); ++i) ASSERT_EQ(static_cast<double>(dw[i]), edw.v[i]) << "wgrad " << i;
}

TEST_P(GemmRef, Bf16MatchesFloat64WithinBound) {
  const RefCase& c = GetParam();
  const Segments seg = Segments::from_counts(c.counts);
  const int64_t m = seg.num_tokens(), n = c.n, k = c.k;
  const int E = seg.num_segments();
  auto to_bf16 = [](const std::vector<float>& f) {
    std::vector<bf16_t> b(f.size());
    for (size_t i = 0; i < f.size(); ++i) b[i] = num::f32_to_bf16(f[i]);
    return b;
  };
  auto widen = [](const std::vector<bf16_t>& b) {
    std::vector<float> f(b.size());
    for (size_t i = 0; i < b.size(); ++i) f[i] = num::bf16_to_f32(b[i]);
    return f;
  };
  const auto x = to_bf16(tiled_random(m, k, 3, 4)), dy = to_bf16(tiled_random(m, n, 4, 4));
  const auto w = to_bf16(tiled_random(E * n, k, 5, 4));
  const auto xf = widen(x), dyf = widen(dy), wf = widen(w);
  std::vector<float> y(m * n), dx(m * k), dw(E * n * k);
  cpu::grouped_fprop_bf16_ref(x.data(), w.data(), seg, n, k, y.data());
  cpu::grouped_dgrad_bf16_ref(dy.data(), w.data(), seg, n, k, dx.data());
  cpu::grouped_wgrad_bf16_ref(dy.data(), x.data(), seg, n, k, dw.data(), false);
  Exact ey{std::vector<double>(m * n), std::vector<double>(m * n)};
  Exact edx{std::vector<double>(m * k), std::vector<double>(m * k)};
  Exact edw{std::vector<double>(E * n * k), std::vector<double>(E * n * k)};
  const auto dyt = transpose(dyf, m, n), xt = transpose(xf, m, k);
  for (int e = 0; e < E; ++e) {
    const int64_t t0 = seg.offsets[e], t1 = seg.offsets[e + 1];
    exact_rows(xf.data(), &wf[e * n * k], t0, t1, n, k, ey.v.data(), ey.s.data(), n);
    const auto wte = transpose(std::vector<float>(wf.begin() + e * n * k, wf.begin() + (e + 1) * n * k), n, k);
    exact_rows(dyf.data(), wte.data(), t0, t1, k, n, edx.v.data(), edx.s.data(), k);
    for (int64_t i = 0; i < n; ++i)
      for (int64_t j = 0; j < k; ++j) {
        double a = 0, s = 0;
        for (int64_t t = t0; t < t1; ++t) {
          const double v = static_cast<double>(dyt[i * m + t]) * xt[j * m + t];
          a += v;
          s += std::fabs(v);
        }
        edw.v[(e * n + i) * k + j] = a;
        edw.s[(e * n + i) * k + j] = s;
      }
  }
  const double u = std::ldexp(1.0, -24);
  EXPECT_TRUE(within(y, ey, (k + 2) * u, "bf16 fprop"));
  EXPECT_TRUE(within(dx, edx, (n + 2) * u, "bf16 dgrad"));
  EXPECT_TRUE(within(dw, edw, (m + 2) * u, "bf16 wgrad"));
}

INSTANTIATE_TEST_SUITE_P(
    Shapes, GemmRef,
    ::testing::Values(RefCase{"three_experts_one_empty", {5, 0, 37}, 256, 384},
                      RefCase{"one_token_and_partial_blocks", {130, 1, 200}, 128, 1408},
                      RefCase{"leading_empty", {0, 0, 64}, 384, 256},
                      RefCase{"single_expert", {300}, 128, 128},
                      RefCase{"five_experts", {16, 256, 0, 144, 32}, 256, 256}),
    [](const ::testing::TestParamInfo<RefCase>& i) { return std::string(i.param.name); });

TEST(GemmRefNumerics, NanScaleAndCodePropagate) {
  Problem p = make_problem({8, 8}, 128, 256, false, 11);
  p.x_row.scales[1 * p.m + 3] = num::kUE8M0NaN;  // token 3, K block 1
  p.w[1].codes[5 * 256 + 7] = num::kE4M3NaN;     // expert 1, output row 5
  std::vector<float> y(p.m * p.n);
  cpu::grouped_fprop_ref(p.x_row, p.w, p.seg, y.data());
  for (int64_t t = 0; t < p.m; ++t)
    for (int64_t j = 0; j < p.n; ++j) {
      const bool nan = t == 3 || (t >= 8 && j == 5);
      EXPECT_EQ(std::isnan(y[t * p.n + j]), nan) << "token " << t << ", column " << j;
    }
}

// ---- GEMM-ready FP32 layouts ------------------------------------------------------------------
TEST(GemmLayouts, ActivationScalesArePackedPerExpert) {
  // M = 12 tokens in experts {4, 0, 8}, C = 256 (L = 2); scale codes 100 + b*12 + t.
  QTensor row;
  row.layout = Layout::kRow1x128;
  row.rows = 12;
  row.cols = 256;
  row.codes.assign(12 * 256, 0);
  for (int b = 0; b < 2; ++b)
    for (int t = 0; t < 12; ++t) row.scales.push_back(static_cast<uint8_t>(100 + b * 12 + t));
  const Segments seg = Segments::from_counts({4, 0, 8});
  const auto f = gemm::act_scales_f32(row, seg);
  ASSERT_EQ(f.size(), 24u);
  EXPECT_EQ(gemm::act_scale_f32_elems(12, 256), 24);
  // expert 0 at 0: [2][4]; expert 2 at L*4 = 8: [2][8]
  auto at = [&](int b, int t) { return num::ue8m0_to_f32(static_cast<uint8_t>(100 + b * 12 + t)); };
  for (int b = 0; b < 2; ++b)
    for (int t = 0; t < 4; ++t) EXPECT_EQ(f[b * 4 + t], at(b, t)) << b << " " << t;
  for (int b = 0; b < 2; ++b)
    for (int t = 0; t < 8; ++t) EXPECT_EQ(f[8 + b * 8 + t], at(b, 4 + t)) << b << " " << t;
  EXPECT_EQ(f[0], std::ldexp(1.0f, 100 - 127));
}

TEST(GemmLayouts, WeightScalesPadTheLeadingDimensionToFour) {
  // K = 1408: 11 blocks per row -> leading dimension 12.
  EXPECT_EQ(gemm::weight_scale_ld(1408), 12);
  EXPECT_EQ(gemm::weight_scale_ld(7168), 56);
  EXPECT_EQ(gemm::weight_scale_ld(384), 4);
  EXPECT_EQ(gemm::weight_scale_f32_elems(3, 256, 1408), 3 * 2 * 12);
  std::vector<QTensor> w(2);
  std::vector<float> v(256 * 1408);
  for (int e = 0; e < 2; ++e) {
    for (size_t i = 0; i < v.size(); ++i) v[i] = std::ldexp(1.0f, static_cast<int>((i / 128 + e) % 9) - 4);
    cpu::quantize_weight(v.data(), 256, 1408, &w[e], nullptr);
  }
  const auto f = gemm::weight_scales_f32(w);
  ASSERT_EQ(static_cast<int64_t>(f.size()), gemm::weight_scale_f32_elems(2, 256, 1408));
  for (int e = 0; e < 2; ++e)
    for (int r = 0; r < 2; ++r)
      for (int c = 0; c < 12; ++c) {
        const float got = f[(e * 2 + r) * 12 + c];
        if (c < 11) EXPECT_EQ(got, num::ue8m0_to_f32(w[e].scales[r * 11 + c])) << e << r << c;
        else EXPECT_EQ(got, 0.0f) << "padding";
      }
}

TEST(GemmLayouts, ColumnScalesKeepTheirOrderAndNanStaysNan) {
  QTensor col;
  std::vector<float> x(40 * 128, 1.0f);
  cpu::quantize_col(x.data(), 40, 128, Segments::from_counts({24, 16}), &col);
  col.scales[3] = num::kUE8M0NaN;
  col.scales[4] = 0;
  const auto f = gemm::col_scales_f32(col);
  ASSERT_EQ(f.size(), col.scales.size());
  EXPECT_EQ(gemm::col_scale_f32_elems(col.segments, 128), 2 * 128);
  uint32_t bits;
  std::memcpy(&bits, &f[3], 4);
  EXPECT_EQ(bits, 0x7FC00000u) << "canonical NaN";
  std::memcpy(&bits, &f[4], 4);
  EXPECT_EQ(bits, 0x00400000u) << "2^-127 is an FP32 subnormal";
  EXPECT_EQ(f[0], num::ue8m0_to_f32(col.scales[0]));
}

// ---- argument errors ------------------------------------------------------------------------
::testing::AssertionResult ThrowsMentioning(const std::function<void()>& f,
                                            const std::vector<std::string>& needles) {
  try {
    f();
  } catch (const Error& e) {
    const std::string msg = e.what();
    for (const auto& n : needles)
      if (msg.find(n) == std::string::npos)
        return ::testing::AssertionFailure() << "message does not mention \"" << n << "\": " << msg;
    return ::testing::AssertionSuccess() << msg;
  } catch (const std::exception& e) {
    return ::testing::AssertionFailure() << "threw a non-flowmoe exception: " << e.what();
  }
  return ::testing::AssertionFailure() << "did not throw";
}

// Fake device addresses (never dereferenced by the checks).
template <typename T>
const T* dptr(uintptr_t a) { return reinterpret_cast<const T*>(a); }

struct Fp8Args {
  Segments seg = Segments::from_counts({16, 0, 32});
  int64_t n = 256, k = 384;
  int64_t m() const { return seg.num_tokens(); }
  int E() const { return seg.num_segments(); }
  Fp8Operand act() const {
    return {{dptr<uint8_t>(0x100000), m() * k}, {dptr<float>(0x200000), gemm::act_scale_f32_elems(m(), k)}};
  }
  Fp8Operand wts() const {
    return {{dptr<uint8_t>(0x300000), E() * n * k},
            {dptr<float>(0x400000), gemm::weight_scale_f32_elems(E(), n, k)}};
  }
  Span<const bf16_t> y() const { return {dptr<bf16_t>(0x500000), m() * n}; }
  void fprop() const { gemm::check_fp8_fprop(seg, n, k, act(), wts(), y()); }
};

TEST(GemmErrors, ValidArgumentsPass) {
  Fp8Args a;
  EXPECT_NO_THROW(a.fprop());
  EXPECT_NO_THROW(gemm::check_fp8_dgrad(a.seg, a.n, a.k,
                                        {{dptr<uint8_t>(0x1000), a.m() * a.n}, {dptr<float>(0x2000), a.m() * a.n / 128}},
                                        {{dptr<uint8_t>(0x3000), a.E() * a.n * a.k},
                                         {dptr<float>(0x4000), gemm::weight_scale_f32_elems(a.E(), a.k, a.n)}},
                                        {dptr<bf16_t>(0x5000), a.m() * a.k}));
  EXPECT_NO_THROW(gemm::check_fp8_wgrad(a.seg, a.n, a.k,
                                        {{dptr<uint8_t>(0x1000), a.n * a.m()}, {dptr<float>(0x2000), 2 * a.n}},
                                        {{dptr<uint8_t>(0x3000), a.k * a.m()}, {dptr<float>(0x4000), 2 * a.k}},
                                        WgradOut::accumulate(reinterpret_cast<float*>(0x6000), a.E() * a.n * a.k)));
  // M = 0 with null pointers is fine (nothing to read or write except wgrad's dW)
  Fp8Args z;
  z.seg = Segments::from_counts({0, 0});
  EXPECT_NO_THROW(gemm::check_fp8_fprop(z.seg, z.n, z.k, {}, z.wts(), {}));
  EXPECT_NO_THROW(gemm::check_bf16(gemm::Pass::kFprop, Segments::from_counts({1, 3}), 8, 16,
                                   {dptr<bf16_t>(0x10), 64}, {dptr<bf16_t>(0x20), 256}, dptr<bf16_t>(0x30), 32));
}

TEST(GemmErrors, Fp8ShapeAndTokenCounts) {
  Fp8Args a;
  a.k = 200;
  EXPECT_TRUE(ThrowsMentioning([&] { a.fprop(); }, {"FP8 fprop", "K = 200", "multiple of 128"}));
  a = Fp8Args{};
  a.n = 0;
  EXPECT_TRUE(ThrowsMentioning([&] { a.fprop(); }, {"N = 0", "positive multiple of 128"}));
  a = Fp8Args{};
  a.seg = Segments::from_counts({16, 1, 32});
  EXPECT_TRUE(ThrowsMentioning([&] { a.fprop(); }, {"expert 1 has 1 tokens", "multiple of 4", "pad"}));
  a.seg = Segments::from_counts({16, 8, 32});  // fine for fprop (multiple of 4) ...
  EXPECT_NO_THROW(a.fprop());
  // ... but wgrad contracts over tokens: multiples of 16
  EXPECT_TRUE(ThrowsMentioning(
      [&] {
        gemm::check_fp8_wgrad(a.seg, a.n, a.k, {{dptr<uint8_t>(0x1000), a.n * a.m()}, {dptr<float>(0x2000), 3 * a.n}},
                              {{dptr<uint8_t>(0x3000), a.k * a.m()}, {dptr<float>(0x4000), 3 * a.k}},
                              WgradOut::f32(reinterpret_cast<float*>(0x6000), a.E() * a.n * a.k));
      },
      {"FP8 wgrad", "expert 1 has 8 tokens", "multiple of 16"}));
  a.seg = Segments{{0, 16, 8}};
  EXPECT_TRUE(ThrowsMentioning([&] { a.fprop(); }, {"non-decreasing"}));
  a.seg = Segments{};
  EXPECT_TRUE(ThrowsMentioning([&] { a.fprop(); }, {"no experts"}));
}

TEST(GemmErrors, Fp8PointersAndSizes) {
  Fp8Args a;
  auto x = a.act();
  x.codes.data = dptr<uint8_t>(0x100001);
  EXPECT_TRUE(ThrowsMentioning([&] { gemm::check_fp8_fprop(a.seg, a.n, a.k, x, a.wts(), a.y()); },
                               {"x.codes", "not 16-byte aligned"}));
  x = a.act();
  x.scales.data = nullptr;
  EXPECT_TRUE(ThrowsMentioning([&] { gemm::check_fp8_fprop(a.seg, a.n, a.k, x, a.wts(), a.y()); },
                               {"x.scales", "is null"}));
  x = a.act();
  x.scales.size -= 1;
  EXPECT_TRUE(ThrowsMentioning([&] { gemm::check_fp8_fprop(a.seg, a.n, a.k, x, a.wts(), a.y()); },
                               {"x.scales", "holds 143 elements, expected at least 144"}));
  // unpadded weight scales (K/128 = 11 needs a leading dimension of 12)
  a.k = 1408;
  auto w = a.wts();
  w.scales.size = a.E() * (a.n / 128) * 11;
  EXPECT_TRUE(ThrowsMentioning([&] { gemm::check_fp8_fprop(a.seg, a.n, a.k, a.act(), w, a.y()); },
                               {"w.scales", "expected at least 72"}));
  a = Fp8Args{};
  Span<const bf16_t> y = a.y();
  y.size = 10;
  EXPECT_TRUE(ThrowsMentioning([&] { gemm::check_fp8_fprop(a.seg, a.n, a.k, a.act(), a.wts(), y); },
                               {"y", "expected at least"}));
  // dgrad names its operands
  EXPECT_TRUE(ThrowsMentioning(
      [&] {
        gemm::check_fp8_dgrad(a.seg, a.n, a.k, {{dptr<uint8_t>(0x1000), a.m() * a.n}, {dptr<float>(0x2000), 1}},
                              a.wts(), {dptr<bf16_t>(0x5000), a.m() * a.k});
      },
      {"FP8 dgrad", "dy.scales"}));
  // wgrad output
  EXPECT_TRUE(ThrowsMentioning(
      [&] {
        gemm::check_fp8_wgrad(a.seg, a.n, a.k, {{dptr<uint8_t>(0x1000), a.n * a.m()}, {dptr<float>(0x2000), 2 * a.n}},
                              {{dptr<uint8_t>(0x3000), a.k * a.m()}, {dptr<float>(0x4000), 2 * a.k}},
                              WgradOut::bf16(nullptr, 0));
      },
      {"dw", "is null"}));
}

TEST(GemmErrors, Bf16) {
  const Segments seg = Segments::from_counts({1, 3});
  EXPECT_TRUE(ThrowsMentioning(
      [&] {
        gemm::check_bf16(gemm::Pass::kFprop, seg, 12, 16, {dptr<bf16_t>(0x10), 64},
                         {dptr<bf16_t>(0x20), 384}, dptr<bf16_t>(0x30), 48);
      },
      {"BF16 fprop", "N = 12", "multiple of 8"}));
  EXPECT_TRUE(ThrowsMentioning(
      [&] {
        gemm::check_bf16(gemm::Pass::kWgrad, seg, 8, 16, {dptr<bf16_t>(0x10), 32},
                         {dptr<bf16_t>(0x20), 64}, dptr<float>(0x30), 100);
      },
      {"BF16 wgrad", "dw ([E][N][K])", "expected at least 256"}));
  EXPECT_TRUE(ThrowsMentioning(
      [&] {
        gemm::check_bf16(gemm::Pass::kDgrad, seg, 8, 16, {dptr<bf16_t>(0x18), 32},
                         {dptr<bf16_t>(0x20), 256}, dptr<bf16_t>(0x30), 64);
      },
      {"dy ([M, N])", "not 16-byte aligned"}));
}

TEST(GemmErrors, ReferenceChecksItsInputs) {
  Problem p = make_problem({16, 16}, 128, 256, false, 5);
  std::vector<float> out(32 * 256 * 2 * 128);
  auto w1 = p.w;
  w1.pop_back();
  EXPECT_TRUE(ThrowsMentioning([&] { cpu::grouped_fprop_ref(p.x_row, w1, p.seg, out.data()); },
                               {"grouped_fprop_ref", "1 w tensors for 2 experts"}));
  EXPECT_TRUE(ThrowsMentioning([&] { cpu::grouped_fprop_ref(p.x_col, p.w, p.seg, out.data()); },
                               {"x is column-wise", "expected row-wise"}));
  EXPECT_TRUE(ThrowsMentioning([&] { cpu::grouped_dgrad_ref(p.dy_row, p.w, p.seg, out.data()); },
                               {"grouped_dgrad_ref", "wt is weight 128x128 e4m3 [128, 256]", "expected shape [128, 128]"}));
  QTensor other;
  std::vector<float> x(32 * 128, 1.0f);
  cpu::quantize_col(x.data(), 32, 128, Segments::from_counts({8, 24}), &other);
  EXPECT_TRUE(ThrowsMentioning([&] { cpu::grouped_wgrad_ref(other, p.x_col, out.data(), false); },
                               {"different segments"}));
  EXPECT_TRUE(ThrowsMentioning([&] { cpu::grouped_fprop_ref(p.x_row, p.w, Segments::from_counts({16, 8}), out.data()); },
                               {"end at the token count M = 32"}));
}

// ---- GroupedGemm options (the CUDA object's settings; parsed and checked on the host) -----------
TEST(GemmOptions, DefaultsPreviousAndValidation) {
  const gemm::GroupedGemmOptions d;
  EXPECT_EQ(d.streams, 4);
  EXPECT_TRUE(d.tune);
  EXPECT_EQ(d.candidates, 8);
  EXPECT_TRUE(d.share_tuning);
  EXPECT_NO_THROW(d.validate());
  const auto p = gemm::GroupedGemmOptions::previous();
  EXPECT_EQ(p.streams, 1);
  EXPECT_FALSE(p.tune);
  EXPECT_EQ(p.workspace_bytes, d.workspace_bytes);
  auto bad = [](auto edit, const char* needle) {
    gemm::GroupedGemmOptions o;
    edit(o);
    return ThrowsMentioning([&] { o.validate(); }, {needle});
  };
  EXPECT_TRUE(bad([](gemm::GroupedGemmOptions& o) { o.streams = 0; }, "streams = 0; expected 1..16"));
  EXPECT_TRUE(bad([](gemm::GroupedGemmOptions& o) { o.streams = 17; }, "streams = 17"));
  EXPECT_TRUE(bad([](gemm::GroupedGemmOptions& o) { o.candidates = 0; }, "candidates = 0"));
  EXPECT_TRUE(bad([](gemm::GroupedGemmOptions& o) { o.tune_reps = 0; }, "tune_reps = 0"));
  EXPECT_TRUE(bad([](gemm::GroupedGemmOptions& o) { o.tune_margin = -0.5; }, "tune_margin"));
  EXPECT_EQ(d.pool_priority, 0);
  EXPECT_TRUE(bad([](gemm::GroupedGemmOptions& o) { o.pool_priority = -1; }, "pool_priority = -1; expected 0..8"));
  EXPECT_TRUE(bad([](gemm::GroupedGemmOptions& o) { o.pool_priority = 9; }, "pool_priority = 9"));
}

// Named settings for GroupedGemmOptions::from_settings, as a program's environment would give them
// (flowmoe/settings.h); unset names give null.
class Settings {
 public:
  void set(const char* name, const char* value) { values_[name] = value; }
  void unset(const char* name) { values_.erase(name); }
  SettingLookup lookup() const {
    return [this](const char* name) -> const char* {
      const auto it = values_.find(name);
      return it == values_.end() ? nullptr : it->second.c_str();
    };
  }
  gemm::GroupedGemmOptions options() const { return gemm::GroupedGemmOptions::from_settings(lookup()); }

 private:
  std::map<std::string, std::string> values_;
};

TEST(GemmOptions, PriorityFromTheSettings) {
  Settings env;
  EXPECT_EQ(env.options().pool_priority, 0);
  env.set("FLOWMOE_GEMM_PRIORITY", "2");
  EXPECT_EQ(env.options().pool_priority, 2);
  for (const char* v : {"-1", "9", "high", ""}) {
    env.set("FLOWMOE_GEMM_PRIORITY", v);
    EXPECT_TRUE(ThrowsMentioning([&] { env.options(); },
                                 {"FLOWMOE_GEMM_PRIORITY", "expected an integer 0..8"}))
        << v;
  }
}

TEST(GemmOptions, WgradKernelFromTheSettings) {
  using Mode = gemm::GroupedGemmOptions::WgradKernel;
  Settings env;
  EXPECT_EQ(env.options().wgrad_kernel, Mode::kAuto) << "auto by default";
  EXPECT_EQ(gemm::GroupedGemmOptions::previous().wgrad_kernel, Mode::kOff) << "the previous behaviour: cuBLASLt";
  const std::pair<const char*, Mode> ok[] = {{"0", Mode::kOff}, {"1", Mode::kAuto}, {"2", Mode::kAlways}};
  for (const auto& v : ok) {
    env.set("FLOWMOE_GEMM_WGRAD_KERNEL", v.first);
    EXPECT_EQ(env.options().wgrad_kernel, v.second) << v.first;
  }
  for (const char* v : {"3", "on", "", "1 "}) {
    env.set("FLOWMOE_GEMM_WGRAD_KERNEL", v);
    EXPECT_TRUE(ThrowsMentioning([&] { env.options(); },
                                 {"FLOWMOE_GEMM_WGRAD_KERNEL", "expected 0"}))
        << v;
  }
}

TEST(GemmOptions, WgradTileFromTheSettings) {
  Settings env;
  EXPECT_EQ(env.options().wgrad_tile_n, 0) << "chosen by shape by default";
  for (const char* v : {"0", "128", "256"}) {
    env.set("FLOWMOE_GEMM_WGRAD_TILE", v);
    EXPECT_EQ(env.options().wgrad_tile_n, std::atoi(v)) << v;
  }
  for (const char* v : {"64", "512", "", "128 ", "wide"}) {
    env.set("FLOWMOE_GEMM_WGRAD_TILE", v);
    EXPECT_TRUE(ThrowsMentioning([&] { env.options(); }, {"FLOWMOE_GEMM_WGRAD_TILE", "expected 0"})) << v;
  }
  gemm::GroupedGemmOptions o;
  o.wgrad_tile_n = 192;
  EXPECT_TRUE(ThrowsMentioning([&] { o.validate(); }, {"wgrad_tile_n = 192", "expected 0 (by shape), 128 or 256"}));
}

// Unset settings keep the base options (the defaults, or what the caller passes); set ones replace
// only their own field.
TEST(GemmOptions, SettingsApplyOverTheBase) {
  Settings env;
  gemm::GroupedGemmOptions base = gemm::GroupedGemmOptions::previous();
  base.pool_priority = 3;
  const gemm::GroupedGemmOptions same = gemm::GroupedGemmOptions::from_settings(env.lookup(), base);
  EXPECT_EQ(same.streams, 1);
  EXPECT_FALSE(same.tune);
  EXPECT_EQ(same.pool_priority, 3);
  env.set("FLOWMOE_GEMM_STREAMS", "2");
  const gemm::GroupedGemmOptions two = gemm::GroupedGemmOptions::from_settings(env.lookup(), base);
  EXPECT_EQ(two.streams, 2);
  EXPECT_FALSE(two.tune);
  EXPECT_EQ(two.pool_priority, 3);
}

// What the sm_90a wgrad kernel takes (128-aligned experts, N and K multiples of 128, FP32 or BF16
// out, at most 256 non-empty experts) and where the auto mode chooses it over cuBLASLt.
TEST(GemmOptions, WgradKernelSupportAndChoice) {
  using Mode = gemm::GroupedGemmOptions::WgradKernel;
  using Kind = gemm::WgradOut::Kind;
  const Segments ok = Segments::from_counts({256, 0, 128, 384});
  EXPECT_EQ(gemm::wgrad_kernel_unsupported(ok, 256, 384), nullptr);
  EXPECT_NE(gemm::wgrad_kernel_unsupported(ok, 192, 384), nullptr) << "N % 128";
  EXPECT_NE(gemm::wgrad_kernel_unsupported(ok, 256, 200), nullptr) << "K % 128";
  EXPECT_NE(gemm::wgrad_kernel_unsupported(Segments::from_counts({144, 112}), 256, 256), nullptr)
      << "an offset that is not a multiple of 128";
  EXPECT_NE(gemm::wgrad_kernel_unsupported(Segments::from_counts({128, 16}), 256, 256), nullptr)
      << "a token total that is not a multiple of 128";
  EXPECT_EQ(gemm::wgrad_kernel_unsupported(Segments::from_counts(std::vector<int32_t>(256, 128)), 128, 128),
            nullptr);
  EXPECT_NE(gemm::wgrad_kernel_unsupported(Segments::from_counts(std::vector<int32_t>(257, 128)), 128, 128),
            nullptr) << "257 non-empty experts";
  EXPECT_NE(gemm::wgrad_kernel_unsupported(Segments::from_counts(std::vector<int32_t>(256, 128)), 128 * 4096,
                                           128 * 2048),
            nullptr) << "2^31 output tiles";
  // off / always / unsupported
  EXPECT_FALSE(gemm::choose_wgrad_kernel(Mode::kOff, ok, 256, 384, Kind::kF32Accumulate));
  EXPECT_TRUE(gemm::choose_wgrad_kernel(Mode::kAlways, ok, 256, 384, Kind::kF32));
  EXPECT_TRUE(gemm::choose_wgrad_kernel(Mode::kAlways, ok, 256, 384, Kind::kBf16));
  // auto: DeepSeek-V3 EP8 GEMM1 (32 experts x 2048 tokens, [4096, 7168]): cuBLASLt; GEMM2
  // ([7168, 2048], 14 Mi): the kernel when accumulating only; V2-Lite (768 tokens each): the kernel
  const Segments v3 = Segments::from_counts(std::vector<int32_t>(32, 2048));
  EXPECT_FALSE(gemm::choose_wgrad_kernel(Mode::kAuto, v3, 4096, 7168, Kind::kF32Accumulate));
  EXPECT_TRUE(gemm::choose_wgrad_kernel(Mode::kAuto, v3, 7168, 2048, Kind::kF32Accumulate));
  EXPECT_FALSE(gemm::choose_wgrad_kernel(Mode::kAuto, v3, 7168, 2048, Kind::kF32));
  const Segments lite = Segments::from_counts(std::vector<int32_t>(64, 768));
  EXPECT_TRUE(gemm::choose_wgrad_kernel(Mode::kAuto, lite, 2816, 2048, Kind::kF32));
  EXPECT_TRUE(gemm::choose_wgrad_kernel(Mode::kAuto, lite, 2816, 2048, Kind::kF32Accumulate));
}

TEST(GemmOptions, TuneAndStreamsFromTheSettings) {
  Settings env;
  EXPECT_TRUE(env.options().tune);
  EXPECT_EQ(env.options().streams, 4);
  env.set("FLOWMOE_GEMM_TUNE", "0");
  env.set("FLOWMOE_GEMM_STREAMS", "1");
  EXPECT_FALSE(env.options().tune);
  EXPECT_EQ(env.options().streams, 1);
  env.set("FLOWMOE_GEMM_TUNE", "1");
  env.set("FLOWMOE_GEMM_STREAMS", "16");
  EXPECT_TRUE(env.options().tune);
  EXPECT_EQ(env.options().streams, 16);
  env.set("FLOWMOE_GEMM_TUNE", "off");
  EXPECT_TRUE(ThrowsMentioning([&] { env.options(); }, {"FLOWMOE_GEMM_TUNE=\"off\"", "expected 0"}));
  env.set("FLOWMOE_GEMM_TUNE", "1");
  for (const char* v : {"0", "17", "2x", ""})  {
    env.set("FLOWMOE_GEMM_STREAMS", v);
    EXPECT_TRUE(ThrowsMentioning([&] { env.options(); }, {"FLOWMOE_GEMM_STREAMS", "expected an integer 1..16"}))
        << v;
  }
}

// A program maps its environment through env_lookup(); the library itself never reads it.
TEST(GemmOptions, EnvLookupReadsTheProcessEnvironment) {
  const char* name = "FLOWMOE_TEST_SETTING_LOOKUP";
  unsetenv(name);
  EXPECT_EQ(env_lookup()(name), nullptr);
  setenv(name, "7", 1);
  ASSERT_NE(env_lookup()(name), nullptr);
  EXPECT_STREQ(env_lookup()(name), "7");
  unsetenv(name);
}

TEST(GemmOptions, TokenBuckets) {
  // up to one 128-token tile: one bucket; then half octaves, named by their upper end
  const std::pair<int64_t, int64_t> cases[] = {{1, 128},       {16, 128},      {128, 128},     {129, 192},
                                               {192, 192},     {193, 256},     {256, 256},     {257, 384},
                                               {384, 384},     {385, 512},     {1536, 1536},   {1537, 2048},
                                               {2048, 2048},   {2049, 3072},   {2128, 3072},   {3073, 4096},
                                               {65536, 65536}, {65537, 98304}};
  for (const auto& c : cases) EXPECT_EQ(gemm::tune_token_bucket(c.first), c.second) << c.first;
  for (int64_t t = 1; t < 20000; ++t) {  // monotone, and every bucket holds what it names
    const int64_t b = gemm::tune_token_bucket(t);
    ASSERT_GE(b, t);
    ASSERT_LE(b, std::max<int64_t>(128, t * 3 / 2 + 1));
    ASSERT_LE(gemm::tune_token_bucket(t - 1 > 0 ? t - 1 : 1), b);
  }
}

}  // namespace
}  // namespace flowmoe
