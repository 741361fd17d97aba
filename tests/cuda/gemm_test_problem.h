// Shared by the grouped GEMM GPU tests (test_gemm_gpu.cu: cuBLASLt per expert; test_gemm_grouped_gpu.cu:
// the sm_90a kernels on device segments): random problems quantized on the CPU, their device copies,
// the CPU references with the error scale S, and the tolerance check.
//
// Tolerance (documented in docs/GEMM.md). For every output element, with S = sum over the
// contraction of |a| |b| (decoded, scaled operands) and ref the FP32 CPU reference:
//     |gpu - ref| <= r * |ref| + c * S
//   r = 2^-8 for BF16 outputs (one round-to-nearest-even to BF16, 8 significant bits), 2^-23 for
//       FP32 outputs accumulated into (one FP32 addition on the GPU, one in the expected value),
//       0 for plain FP32 outputs;
//   c = 2^-10 for FP8: the order of FP32 additions differs from the reference's, and Hopper's FP8
//       tensor cores add within a 128-wide block with a reduced-precision accumulator (DeepSeek-V3
//       reports ~14 bits) before the result is promoted, scaled and added in FP32. The test
//       prints the largest observed (|gpu - ref| - r |ref|) / S so the bound can be tightened.
//   c = 2^-14 for BF16 inputs (exact products, FP32 accumulation in another order).
// On values whose every partial sum is exact (ExactOnSmallValues) the GPU must match the
// reference bit for bit: that pins the scale layouts with no tolerance at all.
#pragma once

#include <cuda_runtime.h>
#include <gtest/gtest.h>

#include <algorithm>
#include <cmath>
#include <functional>
#include <iostream>
#include <random>
#include <string>
#include <vector>

#include "cuda/gpu_test_util.h"
#include "flowmoe/cpu/convert.h"
#include "flowmoe/cuda/convert.h"
#include "flowmoe/gemm.h"
#include "flowmoe/numerics.h"

namespace flowmoe {
namespace gemmtest {

using namespace testutil;  // DBuf, REQUIRE_DEVICE, REQUIRE_SM90, ASSERT_CUDA_OK, same_bits

// The options of the tests' GroupedGemm objects: the defaults, with the FLOWMOE_GEMM_* variables
// of the test's environment applied (e.g. FLOWMOE_GEMM_TUNE=0; the library reads no environment).
inline gemm::GroupedGemmOptions env_gemm_options() {
  return gemm::GroupedGemmOptions::from_settings(env_lookup());
}

// GEMM buffers start as NaN (0xFF bytes in BF16 and FP32), so an element left unwritten fails.
template <typename T>
struct GBuf : DBuf<T> {
  explicit GBuf(size_t count) : DBuf<T>(count, 0, 0xFF) {}
  explicit GBuf(const std::vector<T>& h) : GBuf(h.size()) { this->put(h); }
  gemm::Span<T> span() { return {this->p, static_cast<int64_t>(this->n)}; }
  gemm::Span<const T> cspan() const { return {this->p, static_cast<int64_t>(this->n)}; }
};

inline std::vector<float> widen(const std::vector<bf16_t>& b) {
  std::vector<float> f(b.size());
  for (size_t i = 0; i < b.size(); ++i) f[i] = num::bf16_to_f32(b[i]);
  return f;
}
inline std::vector<bf16_t> narrow(const std::vector<float>& f) {
  std::vector<bf16_t> b(f.size());
  for (size_t i = 0; i < f.size(); ++i) b[i] = num::f32_to_bf16(f[i]);
  return b;
}
inline std::vector<float> dq(const QTensor& q) {
  std::vector<float> out(q.rows * q.cols);
  cpu::dequantize(q, out.data());
  return out;
}
inline std::vector<float> transpose(const std::vector<float>& x, int64_t r, int64_t c) {
  std::vector<float> t(x.size());
  for (int64_t i = 0; i < r; ++i)
    for (int64_t j = 0; j < c; ++j) t[j * r + i] = x[i * c + j];
  return t;
}

// BF16 data [rows, cols], a random power of two per (row, 128-column tile); rows listed in
// `zero_rows` are zero (padding). small: values {0, +-0.5, +-1, +-2} * 2^[-2, 2] (exact sums).
inline std::vector<bf16_t> make_data(int64_t rows, int64_t cols, uint32_t seed, bool small,
                              const std::vector<int64_t>& zero_rows = {}) {
  std::mt19937 rng(seed);
  std::normal_distribution<float> nd(0.f, 1.f);
  std::uniform_int_distribution<int> ed(small ? -2 : -4, small ? 2 : 4), vd(0, 6);
  const float vals[] = {0.f, 0.5f, -0.5f, 1.f, -1.f, 2.f, -2.f};
  std::vector<float> x(rows * cols);
  for (int64_t r = 0; r < rows; ++r)
    for (int64_t b = 0; b < cols; b += 128) {
      const float f = std::ldexp(1.0f, ed(rng));
      for (int64_t c = b; c < std::min(cols, b + 128); ++c) x[r * cols + c] = (small ? vals[vd(rng)] : nd(rng)) * f;
    }
  for (int64_t r : zero_rows)
    for (int64_t c = 0; c < cols; ++c) x[r * cols + c] = 0.0f;
  return narrow(x);
}

// s[i][j] = sum_c |a[i][c]| |b[j][c]| for rows i in [i0, i1), out row stride ldo.
inline void abs_gemm(const float* a, const float* b, int64_t i0, int64_t i1, int64_t J, int64_t C,
              double* s, int64_t ldo) {
  for (int64_t i = i0; i < i1; ++i)
    for (int64_t j = 0; j < J; ++j) {
      double acc = 0;
      for (int64_t c = 0; c < C; ++c) acc += std::fabs(static_cast<double>(a[i * C + c]) * b[j * C + c]);
      s[i * ldo + j] = acc;
    }
}

struct Tol {
  double r, c;
};
constexpr double kU = 1.0 / (1 << 24);

// Checks |got - ref| <= r |ref| + c S (+ tiny absolute slack for S = 0); reports the worst ratio.
inline ::testing::AssertionResult close(const std::vector<float>& got, const std::vector<float>& ref,
                                 const std::vector<double>& S, Tol tol, const std::string& what) {
  if (got.size() < ref.size()) return ::testing::AssertionFailure() << what << ": size";
  double worst = 0;
  size_t worst_at = 0;
  for (size_t i = 0; i < ref.size(); ++i) {
    const double g = got[i], rf = ref[i];
    if (!std::isfinite(g)) return ::testing::AssertionFailure() << what << ": non-finite output at " << i << " (ref " << rf << ")";
    const double err = std::fabs(g - rf);
    const double bound = tol.r * std::fabs(rf) + tol.c * S[i] + 1e-30;
    if (err > bound)
      return ::testing::AssertionFailure() << what << ": element " << i << " = " << g << ", reference " << rf
                                           << ", |error| " << err << " > bound " << bound << " (S = " << S[i] << ")";
    const double excess = (err - tol.r * std::fabs(rf)) / (S[i] > 0 ? S[i] : 1);
    if (excess > worst) worst = excess, worst_at = i;
  }
  std::cout << "    [" << what << "] max (|err| - r|ref|)/S = " << worst << " (= 2^" << std::log2(worst > 0 ? worst : 1e-300)
            << ") at " << worst_at << "; bound c = 2^" << std::log2(tol.c) << "\n";
  return ::testing::AssertionSuccess();
}

// `step` (the three passes, enqueued on the non-blocking stream `s`) run once eagerly, then captured
// into a CUDA graph and replayed twice, the outputs refilled with NaN before each replay: every
// replay must give the eager run's bits.
inline void expect_graph_replays_equal_eager(cudaStream_t s, const std::function<void()>& step, GBuf<bf16_t>& y,
                                             GBuf<bf16_t>& dx, GBuf<float>& dw, const std::string& what) {
  step();
  const auto y0 = y.get(), dx0 = dx.get();
  const auto dw0 = dw.get();
  cudaGraph_t graph;
  cudaGraphExec_t exec;
  ASSERT_EQ(cudaStreamBeginCapture(s, cudaStreamCaptureModeThreadLocal), cudaSuccess);
  step();
  ASSERT_EQ(cudaStreamEndCapture(s, &graph), cudaSuccess);
  ASSERT_EQ(cudaGraphInstantiate(&exec, graph, 0), cudaSuccess);
  for (int rep = 0; rep < 2; ++rep) {
    ASSERT_EQ(cudaMemset(y.p, 0xFF, y.n * sizeof(bf16_t)), cudaSuccess);
    ASSERT_EQ(cudaMemset(dx.p, 0xFF, dx.n * sizeof(bf16_t)), cudaSuccess);
    ASSERT_EQ(cudaMemset(dw.p, 0xFF, dw.n * sizeof(float)), cudaSuccess);
    ASSERT_EQ(cudaDeviceSynchronize(), cudaSuccess);
    ASSERT_EQ(cudaGraphLaunch(exec, s), cudaSuccess);
    ASSERT_EQ(cudaStreamSynchronize(s), cudaSuccess);
    expect_same_bits(widen(y0), widen(y.get()), what + ": graph fprop");
    expect_same_bits(widen(dx0), widen(dx.get()), what + ": graph dgrad");
    expect_same_bits(dw0, dw.get(), what + ": graph wgrad");
  }
  cudaGraphExecDestroy(exec);
  cudaGraphDestroy(graph);
}

// ---- the problem, quantized on the CPU, uploaded, scales converted on the GPU -------------------
struct Case {
  const char* name;
  std::vector<int32_t> counts;
  int64_t n, k;
  std::vector<int64_t> zero_rows;  // padding rows (zero in X and dY)
};
inline std::ostream& operator<<(std::ostream& os, const Case& c) { return os << c.name; }

struct Problem {
  Segments seg;
  int64_t m = 0, n = 0, k = 0;
  int E = 0;
  std::vector<bf16_t> x, dy, w;  // w [E][N][K]
  QTensor x_row, x_col, dy_row, dy_col;
  std::vector<QTensor> wq, wtq;
};

inline Problem make_problem(const Case& c, bool small, uint32_t seed) {
  Problem p;
  p.seg = Segments::from_counts(c.counts);
  p.m = p.seg.num_tokens();
  p.n = c.n;
  p.k = c.k;
  p.E = p.seg.num_segments();
  p.x = make_data(p.m, p.k, seed, small, c.zero_rows);
  p.dy = make_data(p.m, p.n, seed + 1, small, c.zero_rows);
  p.w = make_data(p.E * p.n, p.k, seed + 2, small);
  cpu::quantize_row(p.x.data(), p.m, p.k, &p.x_row);
  cpu::quantize_col(p.x.data(), p.m, p.k, p.seg, &p.x_col);
  cpu::quantize_row(p.dy.data(), p.m, p.n, &p.dy_row);
  cpu::quantize_col(p.dy.data(), p.m, p.n, p.seg, &p.dy_col);
  p.wq.resize(p.E);
  p.wtq.resize(p.E);
  for (int e = 0; e < p.E; ++e) cpu::quantize_weight(&p.w[e * p.n * p.k], p.n, p.k, &p.wq[e], &p.wtq[e]);
  return p;
}

template <typename T>
std::vector<T> concat(const std::vector<QTensor>& v, bool scales) {
  std::vector<T> out;
  for (const auto& q : v) {
    const auto& src = scales ? q.scales : q.codes;
    out.insert(out.end(), src.begin(), src.end());
  }
  return out;
}

// Device copies: codes as produced, scales converted from UE8M0 by the flowmoe kernels.
struct Device {
  GBuf<uint8_t> xr_c, xc_c, dyr_c, dyc_c, w_c, wt_c;
  GBuf<float> xr_s, xc_s, dyr_s, dyc_s, w_s, wt_s;
  GBuf<int32_t> offsets;
  explicit Device(const Problem& p)
      : xr_c(p.x_row.codes), xc_c(p.x_col.codes), dyr_c(p.dy_row.codes), dyc_c(p.dy_col.codes),
        w_c(concat<uint8_t>(p.wq, false)), wt_c(concat<uint8_t>(p.wtq, false)),
        xr_s(gemm::act_scale_f32_elems(p.m, p.k)), xc_s(gemm::col_scale_f32_elems(p.seg, p.k)),
        dyr_s(gemm::act_scale_f32_elems(p.m, p.n)), dyc_s(gemm::col_scale_f32_elems(p.seg, p.n)),
        w_s(gemm::weight_scale_f32_elems(p.E, p.n, p.k)), wt_s(gemm::weight_scale_f32_elems(p.E, p.k, p.n)),
        offsets(p.seg.offsets) {
    GBuf<uint8_t> a(p.x_row.scales), b(p.x_col.scales), c(p.dy_row.scales), d(p.dy_col.scales),
        e(concat<uint8_t>(p.wq, true)), f(concat<uint8_t>(p.wtq, true));
    cuda::act_scales_to_f32(a.p, p.m, p.k, offsets.p, p.E, xr_s.p, nullptr, 0);
    cuda::col_scales_to_f32(b.p, p.seg.num_blocks(), p.k, xc_s.p, 0);
    cuda::act_scales_to_f32(c.p, p.m, p.n, offsets.p, p.E, dyr_s.p, nullptr, 0);
    cuda::col_scales_to_f32(d.p, p.seg.num_blocks(), p.n, dyc_s.p, 0);
    cuda::weight_scales_to_f32(e.p, p.E, p.n, p.k, w_s.p, 0);
    cuda::weight_scales_to_f32(f.p, p.E, p.k, p.n, wt_s.p, 0);
    cudaDeviceSynchronize();
  }
  gemm::Fp8Operand op(const GBuf<uint8_t>& c, const GBuf<float>& s) const { return {c.cspan(), s.cspan()}; }
};

// References and S for the three passes.
struct Refs {
  std::vector<float> y, dx, dw;
  std::vector<double> sy, sdx, sdw;
};
inline Refs fp8_refs(const Problem& p) {
  Refs r;
  r.y.resize(p.m * p.n);
  r.dx.resize(p.m * p.k);
  r.dw.resize(p.E * p.n * p.k);
  cpu::grouped_fprop_ref(p.x_row, p.wq, p.seg, r.y.data());
  cpu::grouped_dgrad_ref(p.dy_row, p.wtq, p.seg, r.dx.data());
  cpu::grouped_wgrad_ref(p.dy_col, p.x_col, r.dw.data(), false);
  r.sy.assign(r.y.size(), 0);
  r.sdx.assign(r.dx.size(), 0);
  r.sdw.assign(r.dw.size(), 0);
  const auto xd = dq(p.x_row), dyd = dq(p.dy_row);
  const auto dyt = transpose(dq(p.dy_col), p.m, p.n), xt = transpose(dq(p.x_col), p.m, p.k);
  for (int e = 0; e < p.E; ++e) {
    const int64_t t0 = p.seg.offsets[e], t1 = p.seg.offsets[e + 1];
    const auto wd = dq(p.wq[e]), wtd = dq(p.wtq[e]);
    abs_gemm(xd.data(), wd.data(), t0, t1, p.n, p.k, r.sy.data(), p.n);
    abs_gemm(dyd.data(), wtd.data(), t0, t1, p.k, p.n, r.sdx.data(), p.k);
    for (int64_t i = 0; i < p.n; ++i)
      for (int64_t j = 0; j < p.k; ++j) {
        double s = 0;
        for (int64_t t = t0; t < t1; ++t) s += std::fabs(static_cast<double>(dyt[i * p.m + t]) * xt[j * p.m + t]);
        r.sdw[(e * p.n + i) * p.k + j] = s;
      }
  }
  return r;
}

inline int nonempty(const Segments& s) {
  int c = 0;
  for (int e = 0; e < s.num_segments(); ++e) c += s.offsets[e + 1] > s.offsets[e];
  return c;
}

// FP8 bound c (see docs/GEMM.md): Hopper's FP8 tensor cores accumulate each 128-wide block with
// about 14 significant bits before the FP32 promotion; the H200 measured up to 2^-10.1 S on these
// cases (three_one_empty wgrad just over 2^-10), so the bound is 2^-8 S: a wrong scale layout
// gives errors of the order of S itself.
constexpr double kFp8C = 1.0 / 256;

}  // namespace gemmtest
}  // namespace flowmoe
