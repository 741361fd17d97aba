// The router GEMMs of the CUDA MoE layer (cuda/moe/kernels.cuh: router_logits, router_dwr, and
// combine_dx, which fuses dx's router path into the unpermute) against a plain host loop in the
// documented order, bit for bit:
//   z[t, e]    = fma chain over h = 0..H-1 of bf16(x[t, h]) * wr[e, h], from 0
//   dwr[e, h] += (fma chain over t = 0..T-1 of dz[t, e] * x[t, h], from 0)
// (the CPU layer's arithmetic, src/cpu/moe/router.cpp). Shapes cover every tile configuration the
// launchers pick (E = 1 .. 256), T = 1, odd T, T not a multiple of any chunk, H with a partial
// feature block (dwr), the fallback kernels (H % 64 == 32, H % 8 != 0, unaligned operands), and
// NaN / Inf inputs (a NaN output must be NaN on both sides; its payload is not compared). At the
// DeepSeek-V3 EP8 shape (T 8192, E 32, H 7168) the staged kernels are compared with the previous
// kernels (router_gemm.cuh, tiled_*), which sum in the same order. Data is random and never zero.
// combine_dx: T 1 .. 1000, k 2 .. 13 with dropped slots, E 3 .. 1024, with and without the router
// path, a partial feature block, non-finite values, its fallback (rows/dx not 8-byte aligned), and
// at the V3 size against the previous kernel.
// Runs on the device machine (CTest label `gpu`); the argument checks also run without a device.
#include <cuda_runtime.h>
#include <gtest/gtest.h>

#include <cmath>
#include <cstdint>
#include <cstring>
#include <random>
#include <string>
#include <vector>

#include "cuda/moe/kernels.cuh"
#include "cuda/moe/router_gemm.cuh"
#include "flowmoe/error.h"
#include "flowmoe/numerics.h"
#include "cuda/gpu_test_util.h"

namespace flowmoe {
namespace {

using namespace testutil;  // DBuf (with an offset), REQUIRE_DEVICE, ASSERT_CUDA_OK

// ---- data: normal values, never zero --------------------------------------------------------------
std::vector<float> rand_f32(size_t n, uint32_t seed, float stddev) {
  std::mt19937 rng(seed);
  std::normal_distribution<float> nd(0.0f, stddev);
  std::vector<float> v(n);
  for (auto& f : v) {
    f = nd(rng);
    if (f == 0.0f) f = stddev;
  }
  return v;
}
std::vector<bf16_t> rand_bf16(size_t n, uint32_t seed) {
  std::mt19937 rng(seed);
  std::normal_distribution<float> nd(0.0f, 1.0f);
  std::vector<bf16_t> v(n);
  for (auto& b : v) {
    b = num::f32_to_bf16(nd(rng));
    if ((b & 0x7FFFu) == 0) b = 0x3F80;  // 1.0
  }
  return v;
}

// ---- the documented order, plainly ----------------------------------------------------------------
std::vector<float> host_logits(const std::vector<bf16_t>& x, const std::vector<float>& w, int64_t T, int E,
                               int64_t H) {
  std::vector<float> z(T * E);
  for (int64_t t = 0; t < T; ++t)
    for (int e = 0; e < E; ++e) {
      float acc = 0.0f;
      for (int64_t h = 0; h < H; ++h) acc = std::fma(num::bf16_to_f32(x[t * H + h]), w[e * H + h], acc);
      z[t * E + e] = acc;
    }
  return z;
}
// dwr += sum_t dz[t, e] x[t, h]: the chains run t outermost (cache friendly), each one in t order
void host_dwr(const std::vector<float>& dz, const std::vector<bf16_t>& x, int64_t T, int E, int64_t H,
              std::vector<float>& dwr) {
  std::vector<float> acc(size_t(E) * H, 0.0f);
  std::vector<float> xf(H);
  for (int64_t t = 0; t < T; ++t) {
    for (int64_t h = 0; h < H; ++h) xf[h] = num::bf16_to_f32(x[t * H + h]);
    for (int e = 0; e < E; ++e) {
      const float d = dz[t * E + e];
      float* a = &acc[size_t(e) * H];
      for (int64_t h = 0; h < H; ++h) a[h] = std::fma(d, xf[h], a[h]);
    }
  }
  for (size_t i = 0; i < acc.size(); ++i) dwr[i] = dwr[i] + acc[i];
}

uint32_t bits(float f) {
  uint32_t u;
  std::memcpy(&u, &f, 4);
  return u;
}
// Bit-identical, or NaN on both sides. Reports the first few differences.
void expect_same(const std::vector<float>& got, const std::vector<float>& want, int64_t cols, const std::string& what) {
  ASSERT_EQ(got.size(), want.size()) << what;
  int64_t bad = 0;
  for (size_t i = 0; i < got.size(); ++i) {
    const bool same = bits(got[i]) == bits(want[i]) || (std::isnan(got[i]) && std::isnan(want[i]));
    if (!same && ++bad <= 5)
      ADD_FAILURE() << what << ": [" << int64_t(i) / cols << ", " << int64_t(i) % cols << "] gpu " << got[i] << " (0x"
                    << std::hex << bits(got[i]) << ") host " << want[i] << " (0x" << bits(want[i]) << std::dec << ")";
  }
  EXPECT_EQ(bad, 0) << what << ": " << bad << " of " << got.size() << " values differ";
}

struct Case {
  int64_t t;
  int e;
  int64_t h;
  int unaligned = 0;       // one element into the allocation: 1 = x, 2 = wr / dz, 3 = both
  bool nonfinite = false;  // NaN and +-Inf in x and wr / dz
};
std::string name(const Case& c, const char* k) {
  return std::string(k) + " T=" + std::to_string(c.t) + " E=" + std::to_string(c.e) + " H=" + std::to_string(c.h) +
         (c.unaligned ? " unaligned=" + std::to_string(c.unaligned) : "") + (c.nonfinite ? " nonfinite" : "");
}
void poison_x(std::vector<bf16_t>& x, int64_t T, int64_t H) {
  auto at = [&](int64_t t, int64_t h) -> bf16_t& { return x[(t % T) * H + h % H]; };
  at(5, 17) = 0x7FC0;   // NaN
  at(9, 3) = 0x7F80;    // +Inf
  at(12, 100) = 0xFF80; // -Inf
}

void run_logits(const Case& c, uint32_t seed) {
  const std::string what = name(c, "router_logits");
  SCOPED_TRACE(what);
  auto x = rand_bf16(c.t * c.h, seed);
  auto w = rand_f32(size_t(c.e) * c.h, seed + 1, 0.05f);
  if (c.nonfinite) {
    poison_x(x, c.t, c.h);
    w[(2 % c.e) * c.h + 40 % c.h] = -INFINITY;
    w[1 % (c.e * c.h)] = NAN;
  }
  DBuf<bf16_t> dx(x, c.unaligned & 1);
  DBuf<float> dw(w, (c.unaligned >> 1) & 1);
  DBuf<float> dz(c.t * c.e);
  cuda::moe::router_logits(dx.p, dw.p, c.t, c.e, c.h, dz.p, 0);
  ASSERT_CUDA_OK(cudaDeviceSynchronize());
  expect_same(dz.get(), host_logits(x, w, c.t, c.e, c.h), c.e, what);
}

void run_dwr(const Case& c, uint32_t seed) {
  const std::string what = name(c, "router_dwr");
  SCOPED_TRACE(what);
  auto x = rand_bf16(c.t * c.h, seed);
  auto dz = rand_f32(c.t * c.e, seed + 1, 0.1f);
  auto dwr = rand_f32(size_t(c.e) * c.h, seed + 2, 1.0f);  // accumulated onto
  if (c.nonfinite) {
    poison_x(x, c.t, c.h);
    dz[(3 % c.t) * c.e + 1 % c.e] = NAN;
    dz[(7 % c.t) * c.e] = INFINITY;
  }
  DBuf<bf16_t> dx(x, c.unaligned & 1);
  DBuf<float> ddz(dz, (c.unaligned >> 1) & 1);
  DBuf<float> ddwr(dwr);
  cuda::moe::router_dwr(ddz.p, dx.p, c.t, c.e, c.h, ddwr.p, 0);
  ASSERT_CUDA_OK(cudaDeviceSynchronize());
  host_dwr(dz, x, c.t, c.e, c.h, dwr);
  expect_same(ddwr.get(), dwr, c.h, what);
}

// Every tile configuration (E <= 8, <= 16, <= 32, > 32), partial token / expert blocks.
const Case kCases[] = {
    {1, 1, 64},     {1, 3, 128},   {37, 3, 256},   {37, 8, 128},   {64, 13, 192}, {37, 16, 128},
    {100, 20, 320}, {65, 32, 256}, {37, 33, 128},  {100, 64, 128}, {37, 256, 64}, {129, 7, 512},
    {4099, 33, 1152},
};

TEST(RouterGemmGpu, LogitsMatchHostLoop) {
  REQUIRE_DEVICE();
  uint32_t seed = 10;
  for (const Case& c : kCases) run_logits(c, seed += 7);
}

TEST(RouterGemmGpu, DwrMatchHostLoop) {
  REQUIRE_DEVICE();
  uint32_t seed = 20;
  for (const Case& c : kCases) run_dwr(c, seed += 7);
  // a partial 64-feature block (H % 64 != 0, H % 8 == 0); E % 4 != 0 (4-byte dz copies)
  run_dwr({37, 20, 136}, 1);
  run_dwr({200, 5, 72}, 2);
  // dwr's tile depends on the grid (kernels.cu, dwr_tile): on an H200 (132 SMs) the shapes above
  // use mostly 8 x 64; these take 16 x 64 (E 20) and 32 x 64 (E 64)
  run_dwr({37, 20, 4224}, 3);
  run_dwr({37, 64, 4224}, 5);
}

TEST(RouterGemmGpu, NonFiniteInputs) {
  REQUIRE_DEVICE();
  for (const Case& c : {Case{37, 20, 128, 0, true}, Case{70, 33, 256, 0, true}, Case{16, 8, 64, 0, true},
                        Case{100, 32, 192, 0, true}}) {
    run_logits(c, 3);
    run_dwr(c, 4);
  }
}

// The previous kernels, used for shapes and operands the staged kernels do not take.
TEST(RouterGemmGpu, FallbackPaths) {
  REQUIRE_DEVICE();
  run_logits({37, 20, 96}, 5);         // H % 64 == 32
  run_logits({37, 20, 128, 1}, 6);     // x not 16-byte aligned
  run_logits({37, 40, 128, 2}, 7);     // wr not 16-byte aligned
  run_logits({37, 3, 160, 3, true}, 8);
  run_dwr({37, 20, 100}, 9);           // H % 8 != 0
  run_dwr({37, 20, 128, 1}, 10);       // x not 16-byte aligned
  run_dwr({37, 3, 20, 3, true}, 11);
}

// dz not 16-byte aligned with E % 4 == 0: the staged kernel with 4-byte dz copies.
TEST(RouterGemmGpu, DwrUnalignedDz) {
  REQUIRE_DEVICE();
  run_dwr({37, 20, 128, 2}, 12);
  run_dwr({65, 32, 192, 2, true}, 13);
}

// DeepSeek-V3 EP8 size: the staged kernels against the previous ones (same order, so the same
// bits), data made on the device.
TEST(RouterGemmGpu, V3ShapeMatchesPreviousKernels) {
  REQUIRE_DEVICE();
  const int64_t T = 8192, H = 7168;
  const int E = 32;
  DBuf<bf16_t> x(T * H);
  DBuf<float> w(size_t(E) * H), dz(T * E), z_new(T * E), z_old(T * E), dwr_new(size_t(E) * H), dwr_old(size_t(E) * H);
  cuda::moe::fill_normal(nullptr, x.p, T * H, 1, 1.0f, 0);
  cuda::moe::fill_normal(w.p, nullptr, int64_t(E) * H, 2, 0.02f, 0);
  cuda::moe::fill_normal(dz.p, nullptr, T * E, 3, 0.1f, 0);
  cuda::moe::fill_normal(dwr_new.p, nullptr, int64_t(E) * H, 4, 1.0f, 0);
  ASSERT_CUDA_OK(cudaMemcpy(dwr_old.p, dwr_new.p, size_t(E) * H * 4, cudaMemcpyDeviceToDevice));
  cuda::moe::router_logits(x.p, w.p, T, E, H, z_new.p, 0);
  cuda::moe::router_gemm::launch_tiled_logits(x.p, w.p, T, E, H, z_old.p, 0);
  cuda::moe::router_dwr(dz.p, x.p, T, E, H, dwr_new.p, 0);
  cuda::moe::router_gemm::launch_tiled_dwr(dz.p, x.p, T, E, H, dwr_old.p, 0);
  ASSERT_CUDA_OK(cudaDeviceSynchronize());
  ASSERT_CUDA_OK(cudaGetLastError());
  expect_same(z_new.get(), z_old.get(), E, "router_logits V3 vs previous kernel");
  expect_same(dwr_new.get(), dwr_old.get(), H, "router_dwr V3 vs previous kernel");
}

// ---- combine_dx: dx = bf16(bf16(sum_s rows[row_map[t, s]]) + sum_e dz[t, e] wr[e, :]) ----------------
struct CombineCase {
  int64_t t;
  int k, e;
  int64_t h;
  bool router = true;      // dz given
  bool nonfinite = false;  // +Inf in a row, NaN in dz, -Inf in wr
  size_t offset = 0;       // elements into the allocations of rows, dx (bf16) and wr (floats)
};
void run_combine(const CombineCase& c, uint32_t seed) {
  const std::string what = "combine_dx T=" + std::to_string(c.t) + " k=" + std::to_string(c.k) + " E=" +
                           std::to_string(c.e) + " H=" + std::to_string(c.h) + (c.router ? "" : " no router") +
                           (c.nonfinite ? " nonfinite" : "") + (c.offset ? " offset " + std::to_string(c.offset) : "");
  SCOPED_TRACE(what);
  const int64_t T = c.t, H = c.h, M = c.t * c.k + 5;
  auto rows = rand_bf16(M * H, seed);
  std::mt19937 rng(seed + 9);
  std::vector<int32_t> map(T * c.k);
  for (auto& m : map) m = rng() % 7 == 0 ? -1 : int32_t(rng() % M);  // some dropped slots
  auto dz = rand_f32(T * c.e, seed + 1, 0.1f);
  auto w = rand_f32(size_t(c.e) * H, seed + 2, 0.05f);
  if (c.nonfinite) {
    rows[int64_t(map[0] >= 0 ? map[0] : 1) * H + 3] = 0x7F80;
    dz[1 % (T * c.e)] = NAN;
    w[5 % (c.e * H)] = -INFINITY;
  }
  // the CPU layer: unpermute (fma(1, row, acc) in slot order, BF16), then the router path
  std::vector<bf16_t> want(T * H);
  for (int64_t t = 0; t < T; ++t)
    for (int64_t h = 0; h < H; ++h) {
      float a = 0.0f;
      for (int s = 0; s < c.k; ++s) {
        const int32_t r = map[t * c.k + s];
        if (r >= 0) a = std::fma(1.0f, num::bf16_to_f32(rows[r * H + h]), a);
      }
      float acc = num::bf16_to_f32(num::bf16_canonical(a));
      if (c.router)
        for (int e = 0; e < c.e; ++e) acc = std::fma(dz[t * c.e + e], w[e * H + h], acc);
      want[t * H + h] = num::bf16_canonical(acc);
    }
  DBuf<bf16_t> drows(rows, c.offset), ddx(T * H, c.offset);
  DBuf<int32_t> dmap(map);
  DBuf<float> ddz(dz), dw(w, c.offset);
  cuda::moe::combine_dx(drows.p, dmap.p, T, c.k, c.router ? ddz.p : nullptr, dw.p, c.e, H, ddx.p, 0);
  ASSERT_CUDA_OK(cudaDeviceSynchronize());
  const std::vector<bf16_t> got = ddx.get();
  int64_t bad = 0;
  for (size_t i = 0; i < got.size(); ++i)
    if (got[i] != want[i] && ++bad <= 5)
      ADD_FAILURE() << what << ": [" << int64_t(i) / H << ", " << int64_t(i) % H << "] gpu 0x" << std::hex << got[i]
                    << " host 0x" << want[i] << std::dec;
  EXPECT_EQ(bad, 0) << what;
}

TEST(RouterGemmGpu, CombineDxMatchesHostLoop) {
  REQUIRE_DEVICE();
  run_combine({37, 8, 32, 1032}, 1);           // a partial 1024-feature block
  run_combine({1, 3, 5, 64, true, true}, 2);
  run_combine({100, 13, 20, 2048}, 3);         // k > 8: two groups of slot loads
  run_combine({33, 6, 64, 136, false}, 4);     // no router path
  run_combine({1000, 8, 32, 1024, true, true}, 5);
  run_combine({20, 2, 1024, 64}, 6);           // E 1024: more than 48 KB of shared memory
  run_combine({37, 8, 32, 1032, true, false, 2}, 7);   // rows, dx 4- not 8-byte aligned: previous kernel
  run_combine({40, 6, 20, 256, true, true, 2}, 8);
}

// DeepSeek-V3 EP8 size (T 8192, top-8, E 32, H 7168): the new kernel against the previous one.
TEST(RouterGemmGpu, CombineDxV3ShapeMatchesPreviousKernel) {
  REQUIRE_DEVICE();
  const int64_t T = 8192, H = 7168;
  const int k = 8, E = 32;
  const int64_t M = T * k + 1024;
  std::mt19937 rng(11);
  std::vector<int32_t> map(T * k);
  for (auto& m : map) m = rng() % 50 == 0 ? -1 : int32_t(rng() % M);
  DBuf<bf16_t> rows(M * H), dx_new(T * H), dx_old(T * H);
  DBuf<int32_t> dmap(map);
  DBuf<float> dz(T * E), w(size_t(E) * H);
  cuda::moe::fill_normal(nullptr, rows.p, M * H, 21, 1.0f, 0);
  cuda::moe::fill_normal(dz.p, nullptr, T * E, 22, 0.1f, 0);
  cuda::moe::fill_normal(w.p, nullptr, int64_t(E) * H, 23, 0.02f, 0);
  cuda::moe::combine_dx(rows.p, dmap.p, T, k, dz.p, w.p, E, H, dx_new.p, 0);
  cuda::moe::router_gemm::launch_combine_dx2(rows.p, dmap.p, T, k, dz.p, w.p, E, H, dx_old.p, 0);
  ASSERT_CUDA_OK(cudaDeviceSynchronize());
  ASSERT_CUDA_OK(cudaGetLastError());
  const std::vector<bf16_t> a = dx_new.get(), b = dx_old.get();
  int64_t bad = 0;
  for (size_t i = 0; i < a.size(); ++i) bad += a[i] != b[i];
  EXPECT_EQ(bad, 0) << bad << " of " << a.size() << " dx values differ";
}

// Argument checks come before any device work (these run without a GPU too).
TEST(RouterGemmGpu, ArgumentErrors) {
  const auto* x = reinterpret_cast<const bf16_t*>(uintptr_t(256));
  const auto* w = reinterpret_cast<const float*>(uintptr_t(256));
  auto* out = reinterpret_cast<float*>(uintptr_t(256));
  EXPECT_THROW(cuda::moe::router_logits(x, w, 4, 2, 48, out, 0), Error);   // H % 32 != 0
  EXPECT_THROW(cuda::moe::router_logits(x, w, 4, 0, 64, out, 0), Error);   // E < 1
  EXPECT_THROW(cuda::moe::router_logits(x, w, -1, 2, 64, out, 0), Error);  // T < 0
  EXPECT_THROW(cuda::moe::router_logits(nullptr, w, 4, 2, 64, out, 0), Error);
  EXPECT_THROW(cuda::moe::router_logits(x, w, 4, 2, 64, nullptr, 0), Error);
  EXPECT_NO_THROW(cuda::moe::router_logits(nullptr, nullptr, 0, 2, 64, nullptr, 0));  // T = 0: nothing to do
  EXPECT_THROW(cuda::moe::router_dwr(w, x, 4, 2, 0, out, 0), Error);       // H < 1
  EXPECT_THROW(cuda::moe::router_dwr(w, x, 4, 0, 64, out, 0), Error);      // E < 1
  EXPECT_THROW(cuda::moe::router_dwr(nullptr, x, 4, 2, 64, out, 0), Error);
  EXPECT_THROW(cuda::moe::router_dwr(w, nullptr, 4, 2, 64, out, 0), Error);
  try {
    cuda::moe::router_logits(x, w, 4, 2, 48, out, 0);
  } catch (const Error& e) {
    EXPECT_NE(std::string(e.what()).find("multiple of 32"), std::string::npos) << e.what();
  }
}

}  // namespace
}  // namespace flowmoe
