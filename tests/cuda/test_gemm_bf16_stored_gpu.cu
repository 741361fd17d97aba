// The BF16 fprop and dgrad kernels reading W where a model stores it (gemm.h StoredW; issue 52): each
// expert's W^T [rows][cols] through a 3-D map whose rows and columns past the stored ones read as
// zeros, and for gpt-oss's gate_up_proj the gate / up pairs split into the layer's halves by the
// fprop's epilogue (and read in their own order by the dgrad). Against the plain launch on the
// layer's W [E][N][K] relaid on the host (padding zeros): with data whose sums are exact the same
// bits whatever the order of the products; normal data within 2^-16 of the sum of |products|. An
// empty expert and a partial last tile; nothing written past the output. GPU label.
#include <cuda_runtime.h>
#include <gtest/gtest.h>

#include <cmath>
#include <string>
#include <vector>

#include "cuda/gemm_test_problem.h"
#include "flowmoe/error.h"

namespace flowmoe {
namespace {

using namespace gemmtest;

struct StoredCase {
  const char* name;
  int64_t n, k;      // the layer's W [E][N][K] (W1: N = 2F', K = H'; W2: N = H', K = F')
  int64_t rows, cols;  // the stored W^T [E][rows <= K][cols <= N]
  bool gate_up;        // cols = 2 Fs: gate j at 2 j, up j at 2 j + 1 (layer rows j and N/2 + j)
};

// The layer's row of stored column c (or -1: none).
int64_t layer_row(const StoredCase& t, int64_t c) { return !t.gate_up ? c : (c % 2 == 0 ? c / 2 : t.n / 2 + c / 2); }

// The layer's W [E][N][K] of the stored W^T (zeros where nothing is stored).
std::vector<bf16_t> layer_of_stored(const StoredCase& t, int64_t experts, const std::vector<bf16_t>& st) {
  std::vector<bf16_t> w(size_t(experts * t.n * t.k), bf16_t(0));
  for (int64_t e = 0; e < experts; ++e)
    for (int64_t r = 0; r < t.rows; ++r)
      for (int64_t c = 0; c < t.cols; ++c)
        w[(e * t.n + layer_row(t, c)) * t.k + r] = st[(e * t.rows + r) * t.cols + c];
  return w;
}

// dy [m][N] in the stored order (gate_up: pairs) from the layer's order: column c of the stored
// order is the layer's column layer_row(c) for c < N.
std::vector<bf16_t> stored_order(const StoredCase& t, int64_t m, const std::vector<bf16_t>& dy) {
  if (!t.gate_up) return dy;
  std::vector<bf16_t> out(dy.size());
  for (int64_t r = 0; r < m; ++r)
    for (int64_t c = 0; c < t.n; ++c) out[r * t.n + c] = dy[r * t.n + layer_row(t, c)];
  return out;
}

class Bf16StoredGpu : public ::testing::TestWithParam<StoredCase> {};

TEST_P(Bf16StoredGpu, FpropAndDgradAsThePlainKernelOnTheRelaidWeight) {
  REQUIRE_SM90();
  const StoredCase& t = GetParam();
  const std::vector<int32_t> offsets = {0, 300, 300, 517};  // (an empty expert; partial last tiles)
  const int E = 3;
  const int64_t m = 640;  // (a capacity: rows past offsets[E] untouched)
  for (const bool small : {true, false}) {
    SCOPED_TRACE(small ? "exact sums" : "normal data");
    const std::vector<bf16_t> st = make_data(E * t.rows, t.cols, small ? 21u : 22u, small);
    const std::vector<bf16_t> w = layer_of_stored(t, E, st);
    const std::vector<bf16_t> x = make_data(m, t.k, small ? 23u : 24u, small);
    const std::vector<bf16_t> dy = make_data(m, t.n, small ? 25u : 26u, small);
    GBuf<bf16_t> ws(st), wl(w), xb(x), dyl(dy), dys(stored_order(t, m, dy));
    GBuf<int32_t> off(offsets);
    cuda::GroupedGemm gg(env_gemm_options());
    const gemm::DeviceSegments seg{off.p, E, m, nullptr};
    const gemm::StoredW sw{ws.p, t.rows, t.cols, t.gate_up};
    GBuf<bf16_t> y0(m * t.n), y1(m * t.n), dx0(m * t.k), dx1(m * t.k);
    gg.fprop_bf16(seg, t.n, t.k, xb.cspan(), wl.cspan(), y0.span(), 0);
    gg.fprop_bf16(seg, t.n, t.k, xb.cspan(), sw, y1.span(), 0);
    gg.dgrad_bf16(seg, t.n, t.k, dyl.cspan(), wl.cspan(), dx0.span(), 0);
    gg.dgrad_bf16(seg, t.n, t.k, dys.cspan(), sw, dx1.span(), 0);
    ASSERT_CUDA_OK(cudaDeviceSynchronize());
    const int64_t rows = offsets[E];
    const auto check = [&](const std::vector<bf16_t>& want, const std::vector<bf16_t>& got, int64_t cols,
                           const std::vector<float>& a, const std::vector<float>& b, bool dgrad, const char* what) {
      for (int64_t i = rows * cols; i < m * cols; ++i)
        ASSERT_EQ(got[i], bf16_t(0xFFFF)) << what << ": written past the rows at " << i;
      if (small) {
        expect_same_bits(widen(std::vector<bf16_t>(want.begin(), want.begin() + rows * cols)),
                         widen(std::vector<bf16_t>(got.begin(), got.begin() + rows * cols)), what);
        return;
      }
      // |products| summed: fprop a = x [m][K], b = W [E][N][K]; dgrad a = dy [m][N], b = W (over N)
      for (int e = 0; e < E; ++e)
        for (int64_t r = offsets[e]; r < offsets[e + 1]; ++r)
          for (int64_t c = 0; c < cols; ++c) {
            double s = 0.0;
            if (!dgrad)
              for (int64_t q = 0; q < t.k; ++q)
                s += std::fabs(double(a[r * t.k + q]) * double(b[(e * t.n + c) * t.k + q]));
            else
              for (int64_t q = 0; q < t.n; ++q)
                s += std::fabs(double(a[r * t.n + q]) * double(b[(e * t.n + q) * t.k + c]));
            const double u = num::bf16_to_f32(want[r * cols + c]), v = num::bf16_to_f32(got[r * cols + c]);
            ASSERT_LE(std::fabs(u - v), s * std::ldexp(1.0, -16) + std::fabs(u) * std::ldexp(1.0, -7))
                << what << " at row " << r << ", column " << c;
          }
    };
    const std::vector<float> xf = widen(x), dyf = widen(dy), wf = widen(w);
    check(y0.get(), y1.get(), t.n, xf, wf, false, "fprop (the layer's order)");
    check(dx0.get(), dx1.get(), t.k, dyf, wf, true, "dgrad");
  }
}

INSTANTIATE_TEST_SUITE_P(
    Shapes, Bf16StoredGpu,
    ::testing::Values(StoredCase{"w1_gate_up_padded", 256, 384, 300, 200, true},  // F 100 of 128, H 300 of 384
                      StoredCase{"w1_gate_up_wide", 512, 256, 256, 512, true},   // 256-wide tiles, no padding
                      StoredCase{"w1_concatenated", 256, 384, 384, 256, false},  // F = F' (no gap)
                      StoredCase{"w2_padded", 384, 256, 200, 296, false}),       // W2^T [F rows][H cols]
    [](const ::testing::TestParamInfo<StoredCase>& i) { return std::string(i.param.name); });

TEST(Bf16StoredGpuErrors, StoredWeightsTheKernelCannotReadAreClearErrors) {
  REQUIRE_SM90();
  const std::vector<int32_t> offsets = {0, 128};
  GBuf<int32_t> off(offsets);
  GBuf<bf16_t> x(128 * 256), y(128 * 256), w(256 * 256);
  cuda::GroupedGemm gg(env_gemm_options());
  const gemm::DeviceSegments seg{off.p, 1, 128, nullptr};
  const auto fails = [&](const gemm::StoredW& sw, const char* words) {
    try {
      gg.fprop_bf16(seg, 256, 256, x.cspan(), sw, y.span(), 0);
      ADD_FAILURE() << "accepted a stored weight expected to fail with '" << words << "'";
    } catch (const Error& e) {
      EXPECT_NE(std::string(e.what()).find(words), std::string::npos) << e.what();
    }
  };
  fails({w.p, 300, 256, false}, "larger than the GEMM's");  // rows past K
  fails({w.p, 256, 100, false}, "multiple of 16 bytes");     // 200-byte rows
  fails({nullptr, 256, 256, false}, "no stored weight");
  try {  // gate / up pairs in a dgrad's (K-major) weight are read in dy's order, never split
    gg.dgrad_bf16(seg, 256, 256, x.cspan(), gemm::StoredW{w.p, 256, 256, true}, y.span(), 0);
  } catch (const Error& e) {
    ADD_FAILURE() << "dgrad refused gate / up pairs it reads in dy's order: " << e.what();
  }
}

}  // namespace
}  // namespace flowmoe
