// Router GEMM benchmark: the MoE layer's FP32 router GEMMs (cuda/moe/kernels.cuh)
//   logits  z [T, E] = x [T, H] (bf16) . Wr [E, H]^T      (router_logits)
//   dWr     dWr [E, H] += dz [T, E]^T . x [T, H] (bf16)   (router_dwr)
//   dx      dx = bf16(unpermute(rows) + dz . Wr)           (combine_dx: the unpermute of dX with
//           the router path fused; new and previous kernel, with and without the router path)
// each as: the launcher (staged kernels, src/cuda/moe/router_gemm.cuh), the previous 4x4-tile
// kernels (the baseline; the launchers' fallback), and cuBLAS SGEMM of the same product (FP32 in
// and out, CUBLAS_DEFAULT_MATH: no TF32; it reads an FP32 copy of x, and sums in its own order, so
// it is a speed reference only). With --variants, the other tile configurations of the staged
// kernels too. Bit-identity of the launcher's output with the previous kernel's is checked once per
// shape (both sum every output in the same fixed order).
//
// Floors printed per kernel: memory = bytes / the device-to-device copy bandwidth measured in the
// same run (x bf16 + Wr + z for logits; x + dz + dWr read and written for dWr); FMA = T*E*H / (SMs
// x 128 FP32 lanes x the SM clock the device reports). Medians of CUDA-event timings after
// warm-up; x alternates between two copies so that L2 does not keep it between repetitions.
//
//   flowmoe_bench_router [--reps N] [--tokens T] [--config NAME] [--variants]
#include <cublas_v2.h>
#include <cuda_runtime.h>

#include <algorithm>
#include <cmath>
#include <cstdio>
#include <cstring>
#include <functional>
#include <string>
#include <vector>

#include "cuda/moe/kernels.cuh"
#include "cuda/moe/router_gemm.cuh"

#include "bench_util.cuh"

using namespace flowmoe;
namespace rg = flowmoe::cuda::moe::router_gemm;

namespace {

int g_reps = 30;
double g_copy_gbs = 0;   // read + write, GB/s
double g_fma_per_s = 0;  // FP32 FMA lanes x clock

#define CB(x)                                                                    \
  do {                                                                           \
    cublasStatus_t s_ = (x);                                                     \
    if (s_ != CUBLAS_STATUS_SUCCESS) {                                           \
      std::fprintf(stderr, "%s:%d %s: cuBLAS status %d\n", __FILE__, __LINE__, #x, int(s_)); \
      std::exit(1);                                                              \
    }                                                                            \
  } while (0)

float time_us(const std::function<void(int)>& fn) { return bench::median_us(fn, g_reps, 3); }

struct Shape {
  const char* name;
  int64_t hidden;
  int experts;
  int topk;
};

void header() {
  std::printf("  %-44s %10s %8s %7s %9s %7s  %s\n", "kernel", "time", "GB/s", "%copy", "TFLOP/s", "%FMA", "vs previous");
}
void row(const char* what, float us, double bytes, double fmas, float prev_us) {
  const double gbs = bench::gb_per_s(bytes, us);
  const double tflops = 2.0 * fmas / (us * 1e6);
  std::printf("  %-44s %7.1f us %8.0f %6.1f%% %9.2f %6.1f%%", what, us, gbs, bench::percent_of(gbs, g_copy_gbs), tflops,
              100.0 * fmas / (us * 1e-6) / g_fma_per_s);
  if (prev_us > 0) std::printf("  x%.2f", prev_us / us);
  std::printf("\n");
}

bool same_bits(const float* a, const float* b, size_t n, size_t* first) {
  std::vector<float> ha(n), hb(n);
  CK(cudaMemcpy(ha.data(), a, n * 4, cudaMemcpyDeviceToHost));
  CK(cudaMemcpy(hb.data(), b, n * 4, cudaMemcpyDeviceToHost));
  for (size_t i = 0; i < n; ++i) {
    uint32_t u, v;
    std::memcpy(&u, &ha[i], 4);
    std::memcpy(&v, &hb[i], 4);
    if (u != v && !(std::isnan(ha[i]) && std::isnan(hb[i]))) {
      *first = i;
      return false;
    }
  }
  return true;
}

void bench_shape(const Shape& s, int64_t T, bool variants, cublasHandle_t cublas) {
  const int64_t H = s.hidden;
  const int E = s.experts;
  const double fmas = double(T) * E * H;
  std::printf("\n=== %s: T %lld, E %d, H %lld (%.2f G FMA per GEMM)\n", s.name, (long long)T, E, (long long)H, fmas / 1e9);

  bf16_t* x[2] = {bench::dalloc<bf16_t>(T * H), bench::dalloc<bf16_t>(T * H)};
  float* xf = bench::dalloc<float>(T * H);  // FP32 copy for cuBLAS
  float* wr = bench::dalloc<float>(size_t(E) * H);
  float* dz = bench::dalloc<float>(T * E);
  float* z = bench::dalloc<float>(T * E);
  float* z_prev = bench::dalloc<float>(T * E);
  float* dwr = bench::dalloc<float>(size_t(E) * H);
  float* dwr_prev = bench::dalloc<float>(size_t(E) * H);
  cuda::moe::fill_normal(xf, x[0], T * H, 1, 1.0f, 0);
  cuda::moe::fill_normal(nullptr, x[1], T * H, 2, 1.0f, 0);
  cuda::moe::fill_normal(wr, nullptr, int64_t(E) * H, 3, 0.02f, 0);
  cuda::moe::fill_normal(dz, nullptr, T * E, 4, 0.1f, 0);
  CK(cudaDeviceSynchronize());

  // ---- bit-identity with the previous kernels (once) ----
  {
    CK(cudaMemset(dwr, 0, size_t(E) * H * 4));
    CK(cudaMemset(dwr_prev, 0, size_t(E) * H * 4));
    cuda::moe::router_logits(x[0], wr, T, E, H, z, 0);
    rg::launch_tiled_logits(x[0], wr, T, E, H, z_prev, 0);
    cuda::moe::router_dwr(dz, x[0], T, E, H, dwr, 0);
    rg::launch_tiled_dwr(dz, x[0], T, E, H, dwr_prev, 0);
    CK(cudaDeviceSynchronize());
    size_t i1 = 0, i2 = 0;
    const bool ok1 = same_bits(z, z_prev, size_t(T) * E, &i1);
    const bool ok2 = same_bits(dwr, dwr_prev, size_t(E) * H, &i2);
    std::printf("  bits vs previous kernels: logits %s, dWr %s\n", ok1 ? "identical" : "DIFFER",
                ok2 ? "identical" : "DIFFER");
    if (!ok1) std::printf("    logits first difference at [%zu, %zu]\n", i1 / E, i1 % E);
    if (!ok2) std::printf("    dWr first difference at [%zu, %zu]\n", i2 / H, i2 % H);
  }

  const double lg_bytes = T * H * 2.0 + double(E) * H * 4 + T * E * 4.0;
  const double dw_bytes = T * H * 2.0 + T * E * 4.0 + 2.0 * E * H * 4;
  const float one = 1.0f, zero = 0.0f;

  header();
  // logits
  const float t_lp = time_us([&](int i) { rg::launch_tiled_logits(x[i & 1], wr, T, E, H, z_prev, 0); });
  const float t_ln = time_us([&](int i) { cuda::moe::router_logits(x[i & 1], wr, T, E, H, z, 0); });
  // cuBLAS, column-major: z^T [E, T] = op_T(Wr as [H, E]) . (x as [H, T])
  const float t_lc = time_us([&](int) {
    CB(cublasSgemm(cublas, CUBLAS_OP_T, CUBLAS_OP_N, E, int(T), int(H), &one, wr, int(H), xf, int(H), &zero, z_prev, E));
  });
  row("logits: staged (router_logits)", t_ln, lg_bytes, fmas, t_lp);
  row("logits: previous 4x4 tiles", t_lp, lg_bytes, fmas, 0);
  row("logits: cuBLAS SGEMM (FP32 x: +2 B/elem)", t_lc, lg_bytes + T * H * 2.0, fmas, t_lp);
  if (variants) {
    char buf[96];
    auto v = [&](const char* cfg, const std::function<void(int)>& fn) {
      const float us = time_us(fn);
      std::snprintf(buf, sizeof buf, "  logits variant %s", cfg);
      row(buf, us, lg_bytes, fmas, t_lp);
    };
    v("BE 8 x BT 64, 4 stages", [&](int i) { rg::launch_staged_logits<8, 1, 4, 4, 4>(x[i & 1], wr, T, E, H, z, 0); });
    v("BE 16 x BT 64, 4 stages", [&](int i) { rg::launch_staged_logits<16, 1, 4, 8, 4>(x[i & 1], wr, T, E, H, z, 0); });
    v("BE 32 x BT 64, 4 stages", [&](int i) { rg::launch_staged_logits<16, 2, 4, 8, 4>(x[i & 1], wr, T, E, H, z, 0); });
    v("BE 32 x BT 64, 3 stages", [&](int i) { rg::launch_staged_logits<16, 2, 4, 8, 3>(x[i & 1], wr, T, E, H, z, 0); });
    v("BE 32 x BT 32, 4 stages", [&](int i) { rg::launch_staged_logits<16, 2, 4, 4, 4>(x[i & 1], wr, T, E, H, z, 0); });
    v("BE 64 x BT 32, 4 stages", [&](int i) { rg::launch_staged_logits<32, 2, 4, 8, 4>(x[i & 1], wr, T, E, H, z, 0); });
    v("BE 32 x BT 64, 4x4/thread, 4 warps", [&](int i) { rg::launch_staged_logits<8, 4, 4, 4, 4>(x[i & 1], wr, T, E, H, z, 0); });
  }

  // dWr (accumulates: the buffer keeps growing over the repetitions, irrelevant for the timing)
  const float t_dp = time_us([&](int i) { rg::launch_tiled_dwr(dz, x[i & 1], T, E, H, dwr_prev, 0); });
  const float t_dn = time_us([&](int i) { cuda::moe::router_dwr(dz, x[i & 1], T, E, H, dwr, 0); });
  // column-major: dWr^T [H, E] += (x as [H, T]) . op_T(dz as [E, T])
  const float t_dc = time_us([&](int) {
    CB(cublasSgemm(cublas, CUBLAS_OP_N, CUBLAS_OP_T, int(H), E, int(T), &one, xf, int(H), dz, E, &one, dwr_prev, int(H)));
  });
  row("dWr: staged (router_dwr)", t_dn, dw_bytes, fmas, t_dp);
  row("dWr: previous 4x4 tiles", t_dp, dw_bytes, fmas, 0);
  row("dWr: cuBLAS SGEMM (FP32 x: +2 B/elem)", t_dc, dw_bytes + T * H * 2.0, fmas, t_dp);
  if (variants) {
    char buf[96];
    auto v = [&](const char* cfg, const std::function<void(int)>& fn) {
      const float us = time_us(fn);
      std::snprintf(buf, sizeof buf, "  dWr variant %s", cfg);
      row(buf, us, dw_bytes, fmas, t_dp);
    };
    v("BE 8 x BH 64, 4 stages", [&](int i) { rg::launch_staged_dwr<1, 4, 1, 4>(dz, x[i & 1], T, E, H, dwr, 0); });
    v("BE 16 x BH 64, 4 stages", [&](int i) { rg::launch_staged_dwr<2, 4, 1, 4>(dz, x[i & 1], T, E, H, dwr, 0); });
    v("BE 32 x BH 64, 4 stages", [&](int i) { rg::launch_staged_dwr<2, 8, 1, 4>(dz, x[i & 1], T, E, H, dwr, 0); });
    v("BE 32 x BH 64, 3 stages", [&](int i) { rg::launch_staged_dwr<2, 8, 1, 3>(dz, x[i & 1], T, E, H, dwr, 0); });
    v("BE 16 x BH 128, 4 stages", [&](int i) { rg::launch_staged_dwr<2, 4, 2, 4>(dz, x[i & 1], T, E, H, dwr, 0); });
    v("BE 32 x BH 64, 4x4/thread, 4 warps", [&](int i) { rg::launch_staged_dwr<4, 4, 1, 4>(dz, x[i & 1], T, E, H, dwr, 0); });
  }
  CK(cudaGetLastError());
  std::printf("  floors: logits memory %.1f us, dWr memory %.1f us (bytes / copy bandwidth); FMA %.1f us\n",
              lg_bytes / (g_copy_gbs * 1e3), dw_bytes / (g_copy_gbs * 1e3), fmas / g_fma_per_s * 1e6);

  // combine_dx: dx = bf16(unpermute(rows) + dz . Wr): the T*k routed rows (a random permutation of
  // [0, T*k), as balanced routing gives), read once; x[0]'s memory is reused for dx.
  {
    const int k = s.topk;
    const int64_t M = T * k;
    std::vector<int32_t> hmap(M);
    for (int64_t i = 0; i < M; ++i) hmap[i] = int32_t(i);
    uint64_t st = 12345;
    for (int64_t i = M - 1; i > 0; --i) {  // Fisher-Yates with a splitmix-style LCG
      st = st * 6364136223846793005ull + 1442695040888963407ull;
      std::swap(hmap[i], hmap[(st >> 33) % uint64_t(i + 1)]);
    }
    int32_t* map = bench::dalloc<int32_t>(M);
    bf16_t* rows = bench::dalloc<bf16_t>(M * H);
    bf16_t* dx = x[0];
    CK(cudaMemcpy(map, hmap.data(), M * 4, cudaMemcpyHostToDevice));
    cuda::moe::fill_normal(nullptr, rows, M * H, 5, 1.0f, 0);
    bf16_t* dx_prev = x[1];
    cuda::moe::combine_dx(rows, map, T, k, dz, wr, E, H, dx, 0);
    rg::launch_combine_dx2(rows, map, T, k, dz, wr, E, H, dx_prev, 0);
    CK(cudaDeviceSynchronize());
    {
      std::vector<bf16_t> a(T * H), b(T * H);
      CK(cudaMemcpy(a.data(), dx, T * H * 2, cudaMemcpyDeviceToHost));
      CK(cudaMemcpy(b.data(), dx_prev, T * H * 2, cudaMemcpyDeviceToHost));
      std::printf("  combine_dx (top-%d): bits vs previous kernel %s\n", k, a == b ? "identical" : "DIFFER");
    }
    const double cb = M * H * 2.0 + T * H * 2.0 + T * E * 4.0 + double(E) * H * 4;
    const float t_cp = time_us([&](int) { rg::launch_combine_dx2(rows, map, T, k, dz, wr, E, H, dx_prev, 0); });
    const float t_cn = time_us([&](int) { cuda::moe::combine_dx(rows, map, T, k, dz, wr, E, H, dx, 0); });
    const float t_up = time_us([&](int) { rg::launch_combine_dx2(rows, map, T, k, nullptr, wr, E, H, dx_prev, 0); });
    const float t_un = time_us([&](int) { cuda::moe::combine_dx(rows, map, T, k, nullptr, wr, E, H, dx, 0); });
    row("combine_dx: new (unpermute + router path)", t_cn, cb, fmas, t_cp);
    row("combine_dx: previous", t_cp, cb, fmas, 0);
    row("combine_dx without router path: new", t_un, M * H * 2.0 + T * H * 2.0, 0, t_up);
    row("combine_dx without router path: previous", t_up, M * H * 2.0 + T * H * 2.0, 0, 0);
    std::printf("  floor: combine_dx memory %.1f us\n", cb / (g_copy_gbs * 1e3));
    CK(cudaGetLastError());
    cudaFree(map);
    cudaFree(rows);
  }

  cudaFree(x[0]); cudaFree(x[1]); cudaFree(xf); cudaFree(wr); cudaFree(dz); cudaFree(z); cudaFree(z_prev);
  cudaFree(dwr); cudaFree(dwr_prev);
}

}  // namespace

int main(int argc, char** argv) {
  std::string only;
  int64_t tokens = 8192;
  bool variants = false;
  for (int i = 1; i < argc; ++i) {
    if (!std::strcmp(argv[i], "--reps") && i + 1 < argc) g_reps = std::max(3, std::atoi(argv[++i]));
    else if (!std::strcmp(argv[i], "--tokens") && i + 1 < argc) tokens = std::max<int64_t>(1, std::atoll(argv[++i]));
    else if (!std::strcmp(argv[i], "--config") && i + 1 < argc) only = argv[++i];
    else if (!std::strcmp(argv[i], "--variants")) variants = true;
    else {
      std::fprintf(stderr, "usage: %s [--reps N] [--tokens T] [--config NAME] [--variants]\n", argv[0]);
      return 2;
    }
  }
  cudaDeviceProp prop;
  if (!bench::device_properties("flowmoe_bench_router", &prop)) return 1;
  int clock_khz = 0;
  CK(cudaDeviceGetAttribute(&clock_khz, cudaDevAttrClockRate, 0));
  g_fma_per_s = double(prop.multiProcessorCount) * 128.0 * clock_khz * 1e3;
  std::printf("device: %s, %d SMs, SM clock %.0f MHz (FP32 FMA peak %.1f TFLOP/s), L2 %d MB; %d reps (median)\n",
              prop.name, prop.multiProcessorCount, clock_khz / 1e3, 2.0 * g_fma_per_s / 1e12, prop.l2CacheSize >> 20,
              g_reps);
  // the memory floor's bandwidth: device-to-device copy of 1 GiB, bytes read + written
  g_copy_gbs = bench::copy_ceiling_gbs(size_t(1) << 30, g_reps, 3);
  cublasHandle_t cublas;
  CB(cublasCreate(&cublas));
  CB(cublasSetMathMode(cublas, CUBLAS_DEFAULT_MATH));  // FP32, no TF32
  CB(cublasSetStream(cublas, 0));
  // The layer configurations of `flowmoe bench` (tools/flowmoe/cmd_bench.cpp): the router covers
  // the layer's E experts. Last: the full DeepSeek-V3 router (256 experts).
  const Shape shapes[] = {
      {"DeepSeek-V3 EP8", 7168, 32, 8},  {"DeepSeek-V3 EP32", 7168, 8, 8}, {"DeepSeek-V2 EP8", 5120, 20, 6},
      {"DeepSeek-V2-Lite", 2048, 64, 6}, {"DeepSeek-V3 256 experts", 7168, 256, 8},
  };
  for (const Shape& s : shapes) {
    if (!only.empty() && only != s.name) continue;
    bench_shape(s, tokens, variants, cublas);
  }
  CB(cublasDestroy(cublas));
  return 0;
}
