// Grouped expert GEMM benchmark: FP8 block-scaled (cuBLASLt, one matmul per expert) against the
// BF16 baseline in the same run, for the DeepSeek-V3, V2 and V2-Lite expert shapes with 8..64
// local experts, plus the dense cuBLASLt ceilings at 8192^3 and the 8 experts x 4096 tokens target.
// Medians of CUDA-event timings after warm-up (the warm-up also fills the plan cache), random
// data (normal, not zeros), one stream.
//
//   flowmoe_bench_gemm [--reps N] [--tokens T] [--model V3|V2|V2-Lite] [--experts E] [--no-graph]
//                      [--streams S] [--compare-only] [--wgrad-kernel-only] [--grouped-only]
//
// The first table: flowmoe's grouped sm_90a kernels (one launch per GEMM, expert offsets read on
// the device) against cuBLASLt per expert and the BF16 grouped baseline, per pass, at the
// DeepSeek-V3 and V2-Lite expert shapes, and the BF16 kernels against that BF16 baseline
// (--grouped-only stops after it). The second: FP8 wgrad by flowmoe's sm_90a kernel against
// cuBLASLt per expert (128-aligned experts; --wgrad-kernel-only stops after it).
//
// First section: the grouped GEMMs as the library now runs them (GroupedGemmOptions from the
// defaults and this program's FLOWMOE_GEMM_TUNE / _STREAMS / _PRIORITY / _WGRAD_KERNEL variables
// (GroupedGemmOptions::from_settings(env_lookup())), --streams overriding: a pool of streams and
// the algorithm timed once per problem key) against the previous behaviour (Options::previous():
// one stream, cuBLASLt's first heuristic algorithm), FP8 and BF16, for DeepSeek-V3 GEMM1/GEMM2 at
// 32 experts x ~2048 tokens and V2-Lite at 64 experts x ~384 tokens, all three passes, then the
// algorithm each problem key got. --compare-only stops there. The later tables use the new default.
//
// Columns: FP8 us / BF16 us are the grouped call as the library runs it (per-expert launches
// enqueued by the host); "FP8 graph us" replays the same launches from a CUDA graph (no host
// enqueue gaps: what the launch loop costs); "host us" is the CPU time to enqueue one FP8 call;
// "rel diff" is ||Y_fp8 - Y_bf16|| / ||Y_bf16|| (a sanity check of the FP8 result, ~2^-5 is the
// quantization error of random data).
#include <cuda_runtime.h>

#include <algorithm>
#include <cmath>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <functional>
#include <random>
#include <string>
#include <vector>

#include "flowmoe/cuda/convert.h"
#include "flowmoe/error.h"
#include "flowmoe/gemm.h"
#include "flowmoe/numerics.h"

#include "bench_util.cuh"

using namespace flowmoe;

namespace {

int g_reps = 20;
bool g_graph = true;
cudaStream_t g_stream = nullptr;

using bench::dalloc;
using bench::ragged_counts;

// ---- random data -----------------------------------------------------------------------------
__device__ __forceinline__ uint64_t splitmix(uint64_t z) {
  z += 0x9E3779B97F4A7C15ull;
  z = (z ^ (z >> 30)) * 0xBF58476D1CE4E5B9ull;
  z = (z ^ (z >> 27)) * 0x94D049BB133111EBull;
  return z ^ (z >> 31);
}
__global__ void fill_normal_bf16(bf16_t* p, int64_t n, uint64_t seed, float scale) {
  for (int64_t i = blockIdx.x * static_cast<int64_t>(blockDim.x) + threadIdx.x; i < n;
       i += static_cast<int64_t>(gridDim.x) * blockDim.x) {
    const uint64_t h = splitmix(seed * 0x100000001B3ull + i);
    const float u1 = (static_cast<float>(h >> 40) + 0.5f) * (1.0f / 16777216.0f);
    const float u2 = (static_cast<float>(h & 0xFFFFFF) + 0.5f) * (1.0f / 16777216.0f);
    const float z = sqrtf(-2.0f * logf(u1)) * cospif(2.0f * u2);
    p[i] = num::f32_to_bf16(z * scale);
  }
}
void fill(bf16_t* p, int64_t n, uint64_t seed, float scale) {
  fill_normal_bf16<<<2048, 256, 0, g_stream>>>(p, n, seed, scale);
  CK(cudaGetLastError());
}

// sum (a-b)^2 and b^2
template <typename T>
__device__ __forceinline__ float as_f32(T v);
template <>
__device__ __forceinline__ float as_f32<bf16_t>(bf16_t v) { return num::bf16_to_f32(v); }
template <>
__device__ __forceinline__ float as_f32<float>(float v) { return v; }
template <typename T>
__global__ void diff_kernel(const T* a, const T* b, int64_t n, double* acc) {
  double d = 0, r = 0;
  for (int64_t i = blockIdx.x * static_cast<int64_t>(blockDim.x) + threadIdx.x; i < n;
       i += static_cast<int64_t>(gridDim.x) * blockDim.x) {
    const double x = as_f32(a[i]), y = as_f32(b[i]);
    d += (x - y) * (x - y);
    r += y * y;
  }
  for (int o = 16; o > 0; o >>= 1) {
    d += __shfl_xor_sync(0xffffffffu, d, o);
    r += __shfl_xor_sync(0xffffffffu, r, o);
  }
  if ((threadIdx.x & 31) == 0) {
    atomicAdd(&acc[0], d);
    atomicAdd(&acc[1], r);
  }
}
template <typename T>
double rel_diff(const T* a, const T* b, int64_t n) {
  double* acc = dalloc<double>(2);
  CK(cudaMemsetAsync(acc, 0, 2 * sizeof(double), g_stream));
  diff_kernel<T><<<1024, 256, 0, g_stream>>>(a, b, n, acc);
  CK(cudaGetLastError());
  double h[2];
  CK(cudaMemcpyAsync(h, acc, sizeof(h), cudaMemcpyDeviceToHost, g_stream));
  CK(cudaStreamSynchronize(g_stream));
  cudaFree(acc);
  return h[1] > 0 ? std::sqrt(h[0] / h[1]) : 0.0;
}

// ---- timing ------------------------------------------------------------------------------------
using bench::Timing;  // median event time, host enqueue time
// g_reps calls timed on g_stream after 3 warm-up calls (which also fill the plan cache).
Timing time_call(const std::function<void()>& fn) {
  return bench::time_events([&](int) { fn(); }, g_reps, 3, g_stream, /*host_time=*/true);
}
// The same launches captured once into a CUDA graph and replayed (< 0: capture not possible).
float time_graph(const std::function<void()>& fn) {
  if (!g_graph) return -1;
  cudaGraph_t graph = nullptr;
  cudaGraphExec_t exec = nullptr;
  if (cudaStreamBeginCapture(g_stream, cudaStreamCaptureModeThreadLocal) != cudaSuccess) {
    cudaGetLastError();
    return -1;
  }
  try {
    fn();
  } catch (const std::exception& e) {
    cudaStreamEndCapture(g_stream, &graph);
    if (graph) cudaGraphDestroy(graph);
    cudaGetLastError();
    std::fprintf(stderr, "  (graph capture failed: %s)\n", e.what());
    return -1;
  }
  if (cudaStreamEndCapture(g_stream, &graph) != cudaSuccess ||
      cudaGraphInstantiate(&exec, graph, 0) != cudaSuccess) {
    if (graph) cudaGraphDestroy(graph);
    cudaGetLastError();
    return -1;
  }
  const Timing t = time_call([&] { CK(cudaGraphLaunch(exec, g_stream)); });
  cudaGraphExecDestroy(exec);
  cudaGraphDestroy(graph);
  return t.us;
}

void header() {
  std::printf("| %-44s | %7s | %9s | %7s | %9s | %7s | %8s | %12s | %8s | %8s |\n", "shape", "experts",
              "FP8 us", "TFLOP/s", "BF16 us", "TFLOP/s", "FP8/BF16", "FP8 graph us", "host us",
              "rel diff");
  std::printf("|%s|%s|%s|%s|%s|%s|%s|%s|%s|%s|\n", std::string(46, '-').c_str(), std::string(9, '-').c_str(),
              std::string(11, '-').c_str(), std::string(9, '-').c_str(), std::string(11, '-').c_str(),
              std::string(9, '-').c_str(), std::string(10, '-').c_str(), std::string(14, '-').c_str(),
              std::string(10, '-').c_str(), std::string(10, '-').c_str());
}
void row(const std::string& shape, const std::string& experts, double flops, const Timing& f8,
         const Timing& b16, float graph_us, double rd) {
  char g[32];
  if (graph_us > 0) std::snprintf(g, sizeof(g), "%12.1f", graph_us);
  else std::snprintf(g, sizeof(g), "%12s", "n/a");
  std::printf("| %-44s | %7s | %9.1f | %7.0f | %9.1f | %7.0f | %7.2fx | %s | %8.1f | %8.4f |\n", shape.c_str(),
              experts.c_str(), f8.us, flops / (f8.us * 1e6), b16.us, flops / (b16.us * 1e6), b16.us / f8.us, g,
              f8.host_us, rd);
  std::fflush(stdout);
}

// ---- one linear layer's three passes, FP8 and BF16 ---------------------------------------------
struct LayerBuffers {
  int64_t m, n, k;
  int E;
  Segments seg;
  int64_t nb;
  // BF16
  bf16_t *x = nullptr, *dy = nullptr, *w = nullptr;
  // FP8 codes and UE8M0 scales, and the GEMM-ready FP32 scales
  uint8_t *xr_c = nullptr, *xr_s8 = nullptr, *xc_c = nullptr, *xc_s8 = nullptr, *dyr_c = nullptr,
          *dyr_s8 = nullptr, *dyc_c = nullptr, *dyc_s8 = nullptr, *w_c = nullptr, *w_s8 = nullptr,
          *wt_c = nullptr, *wt_s8 = nullptr;
  float *xr_s = nullptr, *xc_s = nullptr, *dyr_s = nullptr, *dyc_s = nullptr, *w_s = nullptr,
        *wt_s = nullptr;
  // outputs
  bf16_t *y8 = nullptr, *y16 = nullptr, *dx8 = nullptr, *dx16 = nullptr;
  float *g8 = nullptr, *g16 = nullptr;
  int32_t *offsets = nullptr, *bstart = nullptr, *bend = nullptr, *boff = nullptr;
  cuda::DeviceStatus* st = nullptr;
  std::vector<void*> owned;

  template <typename T>
  T* own(size_t n) {
    T* p = dalloc<T>(n);
    owned.push_back(p);
    return p;
  }

  LayerBuffers(const std::vector<int32_t>& counts, int64_t n_, int64_t k_, bool backward)
      : n(n_), k(k_) {
    seg = Segments::from_counts(counts);
    m = seg.num_tokens();
    E = seg.num_segments();
    nb = seg.num_blocks();
    const int64_t maxb = cuda::segment_max_blocks(m, E);
    x = own<bf16_t>(m * k);
    w = own<bf16_t>(E * n * k);
    xr_c = own<uint8_t>(m * k);
    xr_s8 = own<uint8_t>(m * k / 128);
    xr_s = own<float>(gemm::act_scale_f32_elems(m, k));
    w_c = own<uint8_t>(E * n * k);
    w_s8 = own<uint8_t>(E * (n / 128) * (k / 128));
    w_s = own<float>(gemm::weight_scale_f32_elems(E, n, k));
    y8 = own<bf16_t>(m * n);
    y16 = own<bf16_t>(m * n);
    offsets = own<int32_t>(E + 1);
    st = own<cuda::DeviceStatus>(1);
    CK(cudaMemsetAsync(st, 0, sizeof(*st), g_stream));
    CK(cudaMemcpyAsync(offsets, seg.offsets.data(), (E + 1) * 4, cudaMemcpyHostToDevice, g_stream));
    fill(x, m * k, 1, 1.0f);
    fill(w, E * n * k, 2, 0.02f);
    cuda::quantize_row(x, m, k, xr_c, xr_s8, st, g_stream);
    cuda::act_scales_to_f32(xr_s8, m, k, offsets, E, xr_s, st, g_stream);
    if (backward) {
      dy = own<bf16_t>(m * n);
      xc_c = own<uint8_t>(m * k);
      xc_s8 = own<uint8_t>(maxb * k);
      xc_s = own<float>(gemm::col_scale_f32_elems(seg, k));
      dyr_c = own<uint8_t>(m * n);
      dyr_s8 = own<uint8_t>(m * n / 128);
      dyr_s = own<float>(gemm::act_scale_f32_elems(m, n));
      dyc_c = own<uint8_t>(m * n);
      dyc_s8 = own<uint8_t>(maxb * n);
      dyc_s = own<float>(gemm::col_scale_f32_elems(seg, n));
      wt_c = own<uint8_t>(E * n * k);
      wt_s8 = own<uint8_t>(E * (n / 128) * (k / 128));
      wt_s = own<float>(gemm::weight_scale_f32_elems(E, k, n));
      dx8 = own<bf16_t>(m * k);
      dx16 = own<bf16_t>(m * k);
      g8 = own<float>(E * n * k);
      g16 = own<float>(E * n * k);
      bstart = own<int32_t>(maxb);
      bend = own<int32_t>(maxb);
      boff = own<int32_t>(E + 1);
      fill(dy, m * n, 3, 1e-3f);
      cuda::SegmentBlocks sb{offsets, E, m, maxb, bstart, bend, boff};
      cuda::build_segment_blocks(sb, st, g_stream);
      cuda::quantize_col(x, k, sb, xc_c, xc_s8, nullptr, nullptr, st, g_stream);
      cuda::quantize_col(dy, n, sb, dyc_c, dyc_s8, dyr_c, dyr_s8, st, g_stream);
      cuda::col_scales_to_f32(xc_s8, nb, k, xc_s, g_stream);
      cuda::col_scales_to_f32(dyc_s8, nb, n, dyc_s, g_stream);
      cuda::act_scales_to_f32(dyr_s8, m, n, offsets, E, dyr_s, st, g_stream);
    }
    const int64_t sw = (n / 128) * (k / 128);
    for (int e = 0; e < E; ++e)
      cuda::quantize_weight(w + e * n * k, n, k, w_c + e * n * k, w_s8 + e * sw,
                            backward ? wt_c + e * n * k : nullptr, backward ? wt_s8 + e * sw : nullptr,
                            st, g_stream);
    cuda::weight_scales_to_f32(w_s8, E, n, k, w_s, g_stream);
    if (backward) cuda::weight_scales_to_f32(wt_s8, E, k, n, wt_s, g_stream);
    CK(cudaStreamSynchronize(g_stream));
    cuda::DeviceStatus h{};
    CK(cudaMemcpy(&h, st, sizeof(h), cudaMemcpyDeviceToHost));
    if (h.nonfinite || h.bad_segments) {
      std::fprintf(stderr, "bench setup: nonfinite %llu, bad segments %llu\n", h.nonfinite, h.bad_segments);
      std::exit(1);
    }
  }
  ~LayerBuffers() {
    cudaStreamSynchronize(g_stream);
    for (void* p : owned) cudaFree(p);
  }
  gemm::Fp8Operand op(const uint8_t* c, int64_t cn, const float* s, int64_t sn) const { return {{c, cn}, {s, sn}}; }
};

// Runs and prints the three passes (or fprop only) of one grouped linear layer.
void bench_layer(cuda::GroupedGemm& gg, const std::string& name, const std::vector<int32_t>& counts,
                 int64_t n, int64_t k, bool backward) {
  LayerBuffers b(counts, n, k, backward);
  const int64_t m = b.m;
  const int E = b.E;
  const double flops = 2.0 * m * n * k;
  const std::string ex = std::to_string(E);
  const auto x8 = b.op(b.xr_c, m * k, b.xr_s, gemm::act_scale_f32_elems(m, k));
  const auto w8 = b.op(b.w_c, E * n * k, b.w_s, gemm::weight_scale_f32_elems(E, n, k));
  const gemm::Span<const bf16_t> x16{b.x, m * k}, w16{b.w, E * n * k};
  char shape[96];

  auto f8 = [&] { gg.fprop(b.seg, n, k, x8, w8, {b.y8, m * n}, g_stream); };
  auto f16 = [&] { gg.fprop_bf16(b.seg, n, k, x16, w16, {b.y16, m * n}, g_stream); };
  Timing t8 = time_call(f8), t16 = time_call(f16);
  std::snprintf(shape, sizeof(shape), "%s fprop (K %lld -> N %lld)", name.c_str(), (long long)k, (long long)n);
  row(shape, ex, flops, t8, t16, time_graph(f8), rel_diff(b.y8, b.y16, m * n));
  if (!backward) return;

  const auto dy8 = b.op(b.dyr_c, m * n, b.dyr_s, gemm::act_scale_f32_elems(m, n));
  const auto wt8 = b.op(b.wt_c, E * n * k, b.wt_s, gemm::weight_scale_f32_elems(E, k, n));
  const gemm::Span<const bf16_t> dy16{b.dy, m * n};
  auto d8 = [&] { gg.dgrad(b.seg, n, k, dy8, wt8, {b.dx8, m * k}, g_stream); };
  auto d16 = [&] { gg.dgrad_bf16(b.seg, n, k, dy16, w16, {b.dx16, m * k}, g_stream); };
  t8 = time_call(d8);
  t16 = time_call(d16);
  std::snprintf(shape, sizeof(shape), "%s dgrad (N %lld -> K %lld)", name.c_str(), (long long)n, (long long)k);
  row(shape, ex, flops, t8, t16, time_graph(d8), rel_diff(b.dx8, b.dx16, m * k));

  const auto dyc = b.op(b.dyc_c, m * n, b.dyc_s, gemm::col_scale_f32_elems(b.seg, n));
  const auto xc = b.op(b.xc_c, m * k, b.xc_s, gemm::col_scale_f32_elems(b.seg, k));
  // production mode: accumulate into FP32 main gradients, both recipes
  auto g8 = [&] { gg.wgrad(b.seg, n, k, dyc, xc, gemm::WgradOut::accumulate(b.g8, E * n * k), g_stream); };
  auto g16 = [&] { gg.wgrad_bf16(b.seg, n, k, dy16, x16, gemm::WgradOut::accumulate(b.g16, E * n * k), g_stream); };
  t8 = time_call(g8);
  t16 = time_call(g16);
  const float gg8 = time_graph(g8);
  // comparable results: one overwrite call each
  gg.wgrad(b.seg, n, k, dyc, xc, gemm::WgradOut::f32(b.g8, E * n * k), g_stream);
  gg.wgrad_bf16(b.seg, n, k, dy16, x16, gemm::WgradOut::f32(b.g16, E * n * k), g_stream);
  std::snprintf(shape, sizeof(shape), "%s wgrad +=FP32 ([%lld, %lld])", name.c_str(), (long long)n, (long long)k);
  row(shape, ex, flops, t8, t16, gg8, rel_diff(b.g8, b.g16, E * n * k));
}

// ---- FP8 wgrad: flowmoe's sm_90a kernel against cuBLASLt per expert ---------------------------------
// Same operands (128-aligned experts, as permute+pad with alignment 128 lays them out), FP32
// accumulate (the main-gradient mode), FP32 overwrite and BF16 overwrite (BF16 parameters' gradients);
// the FP32 overwrite outputs compared (relative RMS). The kernel twice: on GEMM-ready FP32 scales
// (host offsets), and on device offsets with the UE8M0 scale bytes as the column copies hold them
// (decoded in the kernel: what the layer runs, with no col_scales_to_f32 pass before).
void bench_wgrad_kernel(const std::string& name, const std::vector<int32_t>& counts, int64_t n, int64_t k) {
  LayerBuffers b(counts, n, k, true);
  const int64_t m = b.m;
  const int E = b.E;
  cuda::GroupedGemm::Options ok = cuda::GroupedGemm::Options::from_settings(env_lookup()), ob = ok;
  ok.wgrad_kernel = cuda::GroupedGemm::Options::WgradKernel::kAlways;
  ob.wgrad_kernel = cuda::GroupedGemm::Options::WgradKernel::kOff;
  cuda::GroupedGemm kern(ok), blas(ob);
  const auto dyc = b.op(b.dyc_c, m * n, b.dyc_s, gemm::col_scale_f32_elems(b.seg, n));
  const auto xc = b.op(b.xc_c, m * k, b.xc_s, gemm::col_scale_f32_elems(b.seg, k));
  const gemm::DeviceSegments dseg{b.offsets, E, m, b.st};
  const cuda::QTensorView dyc8 = cuda::col_128x1(b.dyc_c, b.dyc_s8, m, n, b.nb);
  const cuda::QTensorView xc8 = cuda::col_128x1(b.xc_c, b.xc_s8, m, k, b.nb);
  const double flops = 2.0 * m * n * k;
  using Kind = gemm::WgradOut::Kind;
  for (Kind kind : {Kind::kF32Accumulate, Kind::kF32, Kind::kBf16}) {
    const int64_t g = int64_t(E) * n * k;
    auto out = [&](float* p) {
      return kind == Kind::kF32Accumulate ? gemm::WgradOut::accumulate(p, g)
             : kind == Kind::kF32         ? gemm::WgradOut::f32(p, g)
                                          : gemm::WgradOut::bf16(reinterpret_cast<bf16_t*>(p), g);
    };
    const Timing tk = time_call([&] { kern.wgrad(b.seg, n, k, dyc, xc, out(b.g8), g_stream); });
    const Timing tu = time_call([&] { kern.wgrad(dseg, n, k, dyc8, xc8, out(b.g8), g_stream); });
    const Timing tb = time_call([&] { blas.wgrad(b.seg, n, k, dyc, xc, out(b.g16), g_stream); });
    double diff = -1;
    if (kind == Kind::kF32) diff = rel_diff(b.g8, b.g16, g);
    // bytes: both operands once plus the output written (and read when accumulating)
    const double bytes = double(m) * (n + k) + double(g) * (kind == Kind::kF32Accumulate ? 8 : kind == Kind::kF32 ? 4 : 2);
    const char* label = kind == Kind::kF32Accumulate ? "+= FP32" : kind == Kind::kF32 ? "= FP32" : "= BF16";
    std::printf("| %-22s | %3d | %6lld | %-9s | %8.1f | %6.0f | %8.1f | %6.0f | %8.1f | %6.0f | %5.2fx | %7.1f | %s |\n",
                name.c_str(), E, (long long)m, label, tk.us, flops / tk.us * 1e-6, tu.us, flops / tu.us * 1e-6, tb.us,
                flops / tb.us * 1e-6, tb.us / tu.us, bytes / tu.us * 1e-3, diff < 0 ? "-" : std::to_string(diff).c_str());
  }
  if (kern.stats().wgrad_kernel_calls == 0) std::printf("(the kernel did not take this problem: cuBLASLt both times)\n");
}
void wgrad_kernel_section() {
  std::printf("\n## FP8 wgrad: flowmoe's sm_90a kernel (one persistent launch) against cuBLASLt per expert\n\n");
  std::printf("| %-22s | %3s | %6s | %-9s | %8s | %6s | %8s | %6s | %8s | %6s | %6s | %7s | %s |\n", "shape", "E", "tokens",
              "output", "kernel FP32-scale us", "TFLOP/s", "kernel UE8M0 us", "TFLOP/s", "cuBLASLt us", "TFLOP/s",
              "speed-up (UE8M0)", "GB/s", "rel RMS vs cuBLASLt");
  std::printf("|---|---|---|---|---|---|---|---|---|---|---|---|---|\n");
  const auto v3 = ragged_counts(32, 32 * 2048, 101, 128);     // DeepSeek-V3 EP8: 32 experts x ~2048 rows
  bench_wgrad_kernel("V3 GEMM1 [4096, 7168]", v3, 4096, 7168);
  bench_wgrad_kernel("V3 GEMM2 [7168, 2048]", v3, 7168, 2048);
  const auto v3e32 = ragged_counts(8, 8 * 8192, 103, 128);    // EP32: 8 experts x ~8192 rows
  bench_wgrad_kernel("V3-EP32 GEMM1", v3e32, 4096, 7168);
  const auto v2 = ragged_counts(20, 20 * 2432, 104, 128);     // V2 EP8: 20 experts x ~2432 rows
  bench_wgrad_kernel("V2 GEMM1 [3072, 5120]", v2, 3072, 5120);
  bench_wgrad_kernel("V2 GEMM2 [5120, 1536]", v2, 5120, 1536);
  const auto lite = ragged_counts(64, 64 * 768, 102, 128);    // V2-Lite: 64 experts x ~768 rows
  bench_wgrad_kernel("V2-Lite GEMM1 [2816, 2048]", lite, 2816, 2048);
  bench_wgrad_kernel("V2-Lite GEMM2 [2048, 1408]", lite, 2048, 1408);
  const auto qwen = ragged_counts(128, 128 * 512, 105, 128);  // Qwen3-30B-A3B: 128 experts x ~512 rows
  bench_wgrad_kernel("Qwen3-30B GEMM1 [1536, 2048]", qwen, 1536, 2048);
  bench_wgrad_kernel("Qwen3-30B GEMM2 [2048, 768]", qwen, 2048, 768);
  const auto qwen4 = ragged_counts(128, 128 * 2048, 106, 128);  // the same at 2048 rows (T 32768)
  bench_wgrad_kernel("Qwen3 T32k GEMM1", qwen4, 1536, 2048);
  bench_wgrad_kernel("Qwen3 T32k GEMM2", qwen4, 2048, 768);
}

// ---- grouped kernels on device segments against cuBLASLt per expert and BF16 ---------------------
// flowmoe's sm_90a kernels (one launch; offsets read on the device; x and dy with their UE8M0
// scales as quantization wrote them) against cuBLASLt per expert (host counts; FP32 scales
// converted beforehand, not timed) and the BF16 grouped baseline, same operands, per pass.
void bench_grouped(const std::string& name, const std::vector<int32_t>& counts, int64_t n, int64_t k) {
  LayerBuffers b(counts, n, k, true);
  const int64_t m = b.m, g = int64_t(b.E) * n * k;
  const int E = b.E;
  cuda::GroupedGemm::Options ob = cuda::GroupedGemm::Options::from_settings(env_lookup());
  ob.wgrad_kernel = cuda::GroupedGemm::Options::WgradKernel::kOff;
  cuda::GroupedGemm gk(cuda::GroupedGemm::Options::from_settings(env_lookup())), blas(ob);
  const gemm::DeviceSegments seg{b.offsets, E, m, b.st};
  cuda::QTensorView x = cuda::row_1x128(b.xr_c, b.xr_s8, m, k), dy = cuda::row_1x128(b.dyr_c, b.dyr_s8, m, n);
  cuda::QTensorView w = cuda::weight_128x128(b.w_c, nullptr, E, n, k), wt = cuda::weight_128x128(b.wt_c, nullptr, E, k, n);
  w.scales = b.w_s, w.scale_format = cuda::ScaleFormat::kF32, w.scale_ld = gemm::weight_scale_ld(k);
  wt.scales = b.wt_s, wt.scale_format = cuda::ScaleFormat::kF32, wt.scale_ld = gemm::weight_scale_ld(n);
  const int64_t maxb = m / 128;
  cuda::QTensorView dyc = cuda::col_128x1(b.dyc_c, nullptr, m, n, maxb), xc = cuda::col_128x1(b.xc_c, nullptr, m, k, maxb);
  dyc.scales = b.dyc_s, dyc.scale_format = cuda::ScaleFormat::kF32;
  xc.scales = b.xc_s, xc.scale_format = cuda::ScaleFormat::kF32;
  const auto x8 = b.op(b.xr_c, m * k, b.xr_s, gemm::act_scale_f32_elems(m, k));
  const auto w8 = b.op(b.w_c, g, b.w_s, gemm::weight_scale_f32_elems(E, n, k));
  const auto dy8 = b.op(b.dyr_c, m * n, b.dyr_s, gemm::act_scale_f32_elems(m, n));
  const auto wt8 = b.op(b.wt_c, g, b.wt_s, gemm::weight_scale_f32_elems(E, k, n));
  const auto dyc8 = b.op(b.dyc_c, m * n, b.dyc_s, gemm::col_scale_f32_elems(b.seg, n));
  const auto xc8 = b.op(b.xc_c, m * k, b.xc_s, gemm::col_scale_f32_elems(b.seg, k));
  const gemm::Span<const bf16_t> x16{b.x, m * k}, w16{b.w, g}, dy16{b.dy, m * n};
  bf16_t* y2 = b.own<bf16_t>(m * n);
  bf16_t* dx2 = b.own<bf16_t>(m * k);
  float* g2 = b.own<float>(g);
  bf16_t* yk16 = b.own<bf16_t>(m * n);  // the BF16 kernels' outputs
  bf16_t* dxk16 = b.own<bf16_t>(m * k);
  float* gk16 = b.own<float>(g);
  using W = gemm::WgradOut;
  struct Pass {
    const char* label;
    std::function<void()> kern, blas, bf16, bf16_kern;
    std::function<double()> diff, diff16;
  };
  const Pass passes[] = {
      {"fprop", [&] { gk.fprop(seg, n, k, x, w, {b.y8, m * n}, g_stream); },
       [&] { blas.fprop(b.seg, n, k, x8, w8, {y2, m * n}, g_stream); },
       [&] { blas.fprop_bf16(b.seg, n, k, x16, w16, {b.y16, m * n}, g_stream); },
       [&] { gk.fprop_bf16(seg, n, k, x16, w16, {yk16, m * n}, g_stream); }, [&] { return rel_diff(b.y8, y2, m * n); },
       [&] { return rel_diff(yk16, b.y16, m * n); }},
      {"dgrad", [&] { gk.dgrad(seg, n, k, dy, wt, {b.dx8, m * k}, g_stream); },
       [&] { blas.dgrad(b.seg, n, k, dy8, wt8, {dx2, m * k}, g_stream); },
       [&] { blas.dgrad_bf16(b.seg, n, k, dy16, w16, {b.dx16, m * k}, g_stream); },
       [&] { gk.dgrad_bf16(seg, n, k, dy16, w16, {dxk16, m * k}, g_stream); }, [&] { return rel_diff(b.dx8, dx2, m * k); },
       [&] { return rel_diff(dxk16, b.dx16, m * k); }},
      {"wgrad +=", [&] { gk.wgrad(seg, n, k, dyc, xc, W::accumulate(b.g8, g), g_stream); },
       [&] { blas.wgrad(b.seg, n, k, dyc8, xc8, W::accumulate(g2, g), g_stream); },
       [&] { blas.wgrad_bf16(b.seg, n, k, dy16, x16, W::accumulate(b.g16, g), g_stream); },
       [&] { gk.wgrad_bf16(seg, n, k, dy16, x16, W::accumulate(gk16, g), g_stream); }, nullptr, nullptr},
      {"wgrad =", [&] { gk.wgrad(seg, n, k, dyc, xc, W::f32(b.g8, g), g_stream); },
       [&] { blas.wgrad(b.seg, n, k, dyc8, xc8, W::f32(g2, g), g_stream); },
       [&] { blas.wgrad_bf16(b.seg, n, k, dy16, x16, W::f32(b.g16, g), g_stream); },
       [&] { gk.wgrad_bf16(seg, n, k, dy16, x16, W::f32(gk16, g), g_stream); }, [&] { return rel_diff(b.g8, g2, g); },
       [&] { return rel_diff(gk16, b.g16, g); }},
  };
  const double flops = 2.0 * m * n * k;
  for (const Pass& p : passes) {
    const Timing tk = time_call(p.kern), tb = time_call(p.blas), t16 = time_call(p.bf16), tk16 = time_call(p.bf16_kern);
    const double diff = p.diff ? p.diff() : -1, diff16 = p.diff16 ? p.diff16() : -1;
    std::printf("| %-26s | %3d | %6lld | %-8s | %8.1f | %6.0f | %8.1f | %6.0f | %5.2fx | %8.1f | %6.0f | %5.2fx | %s "
                "| %8.1f | %6.0f | %5.2fx | %s |\n",
                name.c_str(), E, (long long)m, p.label, tk.us, flops / tk.us * 1e-6, tb.us, flops / tb.us * 1e-6,
                tb.us / tk.us, t16.us, flops / t16.us * 1e-6, t16.us / tk.us,
                diff < 0 ? "-" : std::to_string(diff).c_str(), tk16.us, flops / tk16.us * 1e-6, t16.us / tk16.us,
                diff16 < 0 ? "-" : std::to_string(diff16).c_str());
    std::fflush(stdout);
  }
}
void grouped_section() {
  std::printf("\n## Grouped FP8 kernels (one launch, device offsets) against cuBLASLt per expert and BF16 grouped;\n"
              "## the BF16 kernels (one launch, device offsets) against BF16 cuBLASLt per expert\n\n");
  std::printf("| %-26s | %3s | %6s | %-8s | %8s | %6s | %8s | %6s | %6s | %8s | %6s | %6s | %s | %8s | %6s | %6s | %s |\n",
              "shape", "E", "tokens", "pass", "kernel us", "TFLOP/s", "cuBLASLt us", "TFLOP/s", "vs LT", "BF16 us",
              "TFLOP/s", "vs BF16", "rel RMS vs cuBLASLt", "BF16 kernel us", "TFLOP/s", "vs BF16 LT",
              "rel RMS vs BF16 LT");
  std::printf("|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|\n");
  const std::vector<int32_t> v3(32, 2048), lite(64, 384);
  bench_grouped("V3 GEMM1 [4096, 7168]", v3, 4096, 7168);
  bench_grouped("V3 GEMM2 [7168, 2048]", v3, 7168, 2048);
  bench_grouped("V2-Lite GEMM1 [2816, 2048]", lite, 2816, 2048);
  bench_grouped("V2-Lite GEMM2 [2048, 1408]", lite, 2048, 1408);
  const auto lite_ragged = ragged_counts(64, 64 * 384, 102, 128);
  bench_grouped("V2-Lite GEMM1 ragged", lite_ragged, 2816, 2048);
  bench_grouped("V2-Lite GEMM2 ragged", lite_ragged, 2048, 1408);
}

// ---- concurrency + tuning against the previous behaviour -----------------------------------------
void compare_header() {
  std::printf("| %-40s | %7s | %9s | %7s | %9s | %7s | %8s | %9s | %7s | %9s | %7s | %8s | %9s | %9s | %10s |\n",
              "shape", "experts", "FP8 new", "TFLOP/s", "FP8 prev", "TFLOP/s", "new/prev", "BF16 new", "TFLOP/s",
              "BF16 prev", "TFLOP/s", "FP8/BF16", "new graph", "1st call", "new-prev");
  std::printf("|%s|%s|%s|%s|%s|%s|%s|%s|%s|%s|%s|%s|%s|%s|%s|\n", std::string(42, '-').c_str(),
              std::string(9, '-').c_str(), std::string(11, '-').c_str(), std::string(9, '-').c_str(),
              std::string(11, '-').c_str(), std::string(9, '-').c_str(), std::string(10, '-').c_str(),
              std::string(11, '-').c_str(), std::string(9, '-').c_str(), std::string(11, '-').c_str(),
              std::string(9, '-').c_str(), std::string(10, '-').c_str(), std::string(11, '-').c_str(),
              std::string(11, '-').c_str(), std::string(12, '-').c_str());
}

// Wall time of one call, synchronised, in ms: the first call of a new problem key includes tuning.
double first_call_ms(const std::function<void()>& fn) {
  CK(cudaStreamSynchronize(g_stream));
  const double t0 = bench::host_now_ms();
  fn();
  CK(cudaStreamSynchronize(g_stream));
  return bench::host_now_ms() - t0;
}

// One layer's three passes: FP8 and BF16, each with `now` (pool + tuning) and `prev`
// (Options::previous()). "new-prev" is ||out_new - out_prev|| / ||out_prev|| of the FP8 outputs
// (0 when both ran the same algorithm; otherwise the FP32 summation-order difference).
void compare_layer(cuda::GroupedGemm& now, cuda::GroupedGemm& prev, const std::string& name,
                   const std::vector<int32_t>& counts, int64_t n, int64_t k) {
  LayerBuffers b(counts, n, k, true);
  const int64_t m = b.m;
  const int E = b.E;
  const double flops = 2.0 * m * n * k;
  bf16_t* y8p = b.own<bf16_t>(m * n);
  bf16_t* dx8p = b.own<bf16_t>(m * k);
  float* g8p = b.own<float>(int64_t(E) * n * k);
  const auto x8 = b.op(b.xr_c, m * k, b.xr_s, gemm::act_scale_f32_elems(m, k));
  const auto w8 = b.op(b.w_c, E * n * k, b.w_s, gemm::weight_scale_f32_elems(E, n, k));
  const auto dy8 = b.op(b.dyr_c, m * n, b.dyr_s, gemm::act_scale_f32_elems(m, n));
  const auto wt8 = b.op(b.wt_c, E * n * k, b.wt_s, gemm::weight_scale_f32_elems(E, k, n));
  const auto dyc = b.op(b.dyc_c, m * n, b.dyc_s, gemm::col_scale_f32_elems(b.seg, n));
  const auto xc = b.op(b.xc_c, m * k, b.xc_s, gemm::col_scale_f32_elems(b.seg, k));
  const gemm::Span<const bf16_t> x16{b.x, m * k}, w16{b.w, E * n * k}, dy16{b.dy, m * n};
  const int64_t g = int64_t(E) * n * k;

  struct Pass {
    const char* label;
    std::function<void(cuda::GroupedGemm&)> f8, b16;
    std::function<double()> diff;  // after one overwrite call of each FP8 variant
  };
  const Pass passes[] = {
      {"fprop",
       [&](cuda::GroupedGemm& gg) { gg.fprop(b.seg, n, k, x8, w8, {&gg == &now ? b.y8 : y8p, m * n}, g_stream); },
       [&](cuda::GroupedGemm& gg) { gg.fprop_bf16(b.seg, n, k, x16, w16, {b.y16, m * n}, g_stream); },
       [&] { return rel_diff(b.y8, y8p, m * n); }},
      {"dgrad",
       [&](cuda::GroupedGemm& gg) { gg.dgrad(b.seg, n, k, dy8, wt8, {&gg == &now ? b.dx8 : dx8p, m * k}, g_stream); },
       [&](cuda::GroupedGemm& gg) { gg.dgrad_bf16(b.seg, n, k, dy16, w16, {b.dx16, m * k}, g_stream); },
       [&] { return rel_diff(b.dx8, dx8p, m * k); }},
      {"wgrad +=FP32",
       [&](cuda::GroupedGemm& gg) {
         gg.wgrad(b.seg, n, k, dyc, xc, gemm::WgradOut::accumulate(&gg == &now ? b.g8 : g8p, g), g_stream);
       },
       [&](cuda::GroupedGemm& gg) { gg.wgrad_bf16(b.seg, n, k, dy16, x16, gemm::WgradOut::accumulate(b.g16, g), g_stream); },
       [&] {
         now.wgrad(b.seg, n, k, dyc, xc, gemm::WgradOut::f32(b.g8, g), g_stream);
         prev.wgrad(b.seg, n, k, dyc, xc, gemm::WgradOut::f32(g8p, g), g_stream);
         return rel_diff(b.g8, g8p, g);
       }},
  };
  for (const Pass& ps : passes) {
    const double first = first_call_ms([&] { ps.f8(now); });
    const Timing f8n = time_call([&] { ps.f8(now); }), f8p = time_call([&] { ps.f8(prev); });
    const Timing b16n = time_call([&] { ps.b16(now); }), b16p = time_call([&] { ps.b16(prev); });
    const float graph = time_graph([&] { ps.f8(now); });
    char shape[96], gr[32];
    std::snprintf(shape, sizeof(shape), "%s %s (N %lld, K %lld)", name.c_str(), ps.label, (long long)n, (long long)k);
    if (graph > 0) std::snprintf(gr, sizeof(gr), "%9.1f", graph);
    else std::snprintf(gr, sizeof(gr), "%9s", "n/a");
    auto tf = [&](const Timing& t) { return flops / (t.us * 1e6); };
    std::printf("| %-40s | %7d | %9.1f | %7.0f | %9.1f | %7.0f | %7.2fx | %9.1f | %7.0f | %9.1f | %7.0f | %7.2fx | %s | %6.1f ms | %10.2e |\n",
                shape, E, f8n.us, tf(f8n), f8p.us, tf(f8p), f8p.us / f8n.us, b16n.us, tf(b16n), b16p.us, tf(b16p),
                b16n.us / f8n.us, gr, first, ps.diff());
    std::fflush(stdout);
  }
}

void print_tuning(const cuda::GroupedGemm& gg) {
  std::printf("\nAlgorithm per problem key (tokens bucketed; \"picked\" indexes cuBLASLt's heuristic list, 0 = its "
              "first choice; times per run, as measured while tuning):\n\n");
  std::printf("| %-10s | %3s | %6s | %6s | %6s | %6s | %-17s | %9s | %7s | %4s | %4s | %6s | %9s | %9s |\n", "pass", "+=",
              "m", "n", "k", "bucket", "how", "candidate", "algo", "tile", "splt", "stages", "first us", "picked us");
  std::printf("|------------|-----|--------|--------|--------|--------|-------------------|-----------|---------|------|"
              "------|--------|-----------|-----------|\n");
  for (const auto& r : gg.tune_records())
    std::printf("| %-10s | %3s | %6lld | %6lld | %6lld | %6lld | %-17s | %4d of %2d | %7d | %4d | %4d | %6d | %9.1f | %9.1f |\n",
                r.what, r.accumulate ? "yes" : "", (long long)r.m, (long long)r.n, (long long)r.k,
                (long long)r.token_bucket, r.shared ? "shared" : r.how, r.picked, r.candidates, r.algo_id, r.tile_id,
                r.splitk, r.stages, r.first_us, r.picked_us);
  const auto s = gg.stats();
  std::printf("\nkeys %lld (timed here %lld, %lld trial matmuls), fallbacks to the heuristic's first %lld, "
              "calls on several streams %lld\n",
              (long long)s.tuned_keys, (long long)s.tunings, (long long)s.tune_trials, (long long)s.tune_fallbacks,
              (long long)s.concurrent_calls);
}

struct Model {
  const char* name;
  int64_t hidden, ffn;
  int topk;
};

void bench_scale_conversion(int64_t m, int64_t k, int E) {
  const auto counts = ragged_counts(E, m, 5, 16);
  const Segments seg = Segments::from_counts(counts);
  uint8_t* s8 = dalloc<uint8_t>(m * k / 128);
  float* s32 = dalloc<float>(m * k / 128);
  int32_t* off = dalloc<int32_t>(E + 1);
  CK(cudaMemcpy(off, seg.offsets.data(), (E + 1) * 4, cudaMemcpyHostToDevice));
  CK(cudaMemset(s8, 127, m * k / 128));
  const Timing ta = time_call([&] { cuda::act_scales_to_f32(s8, m, k, off, E, s32, nullptr, g_stream); });
  const int64_t nb = seg.num_blocks();
  const Timing tc = time_call([&] { cuda::col_scales_to_f32(s8, std::min<int64_t>(nb, m / 128), k, s32, g_stream); });
  const double bytes = 5.0 * m * k / 128;
  std::printf("  act_scales_to_f32  [%lld/128 x %lld tokens, %d experts]: %7.1f us (%5.0f GB/s, %.1f MB written)\n",
              (long long)k, (long long)m, E, ta.us, bytes / (ta.us * 1e3), 4.0 * m * k / 128 / 1e6);
  std::printf("  col_scales_to_f32  [%lld blocks x %lld]:                  %7.1f us\n", (long long)nb, (long long)k, tc.us);
  cudaFree(s8);
  cudaFree(s32);
  cudaFree(off);
}

}  // namespace

int main(int argc, char** argv) {
  int64_t tokens = 4096;
  std::string only_model;
  int only_e = 0, streams = 0;
  bool compare_only = false, wgrad_only = false, grouped_only = false;
  for (int i = 1; i < argc; ++i) {
    if (!std::strcmp(argv[i], "--reps") && i + 1 < argc) g_reps = std::max(3, std::atoi(argv[++i]));
    else if (!std::strcmp(argv[i], "--tokens") && i + 1 < argc) tokens = std::atoll(argv[++i]);
    else if (!std::strcmp(argv[i], "--model") && i + 1 < argc) only_model = argv[++i];
    else if (!std::strcmp(argv[i], "--experts") && i + 1 < argc) only_e = std::atoi(argv[++i]);
    else if (!std::strcmp(argv[i], "--no-graph")) g_graph = false;
    else if (!std::strcmp(argv[i], "--streams") && i + 1 < argc) streams = std::atoi(argv[++i]);
    else if (!std::strcmp(argv[i], "--compare-only")) compare_only = true;
    else if (!std::strcmp(argv[i], "--wgrad-kernel-only")) wgrad_only = true;
    else if (!std::strcmp(argv[i], "--grouped-only")) grouped_only = true;
    else {
      std::printf("usage: %s [--reps N] [--tokens T] [--model V3|V2|V2-Lite] [--experts E] [--no-graph] "
                  "[--streams S] [--compare-only] [--wgrad-kernel-only] [--grouped-only]\n", argv[0]);
      return 2;
    }
  }
  int dev = 0;
  cudaDeviceProp prop{};
  CK(cudaGetDevice(&dev));
  CK(cudaGetDeviceProperties(&prop, dev));
  CK(cudaStreamCreateWithFlags(&g_stream, cudaStreamNonBlocking));
  std::printf("device: %s (sm_%d%d), %d SMs; reps %d (median)\n", prop.name, prop.major, prop.minor,
              prop.multiProcessorCount, g_reps);
  try {
    cuda::GroupedGemm::Options opt = cuda::GroupedGemm::Options::from_settings(env_lookup());
    if (streams) opt.streams = streams;
    cuda::GroupedGemm gg(opt), prev(cuda::GroupedGemm::Options::previous());
    std::printf("new: %d streams, tuning %s (%d candidates, %d timed runs each, margin %.0f%%), workspaces %.0f MiB "
                "+ process tuning scratch %.0f MiB; prev: 1 stream, heuristic's first, %.0f MiB\n",
                opt.streams, opt.tune ? "on" : "off", opt.candidates, opt.tune_reps, 100 * opt.tune_margin,
                gg.device_bytes() / 1048576.0, cuda::GroupedGemm::tuning_scratch_bytes() / 1048576.0,
                prev.device_bytes() / 1048576.0);

    grouped_section();
    if (grouped_only) {
      cudaStreamDestroy(g_stream);
      return 0;
    }
    wgrad_kernel_section();
    if (wgrad_only) {
      cudaStreamDestroy(g_stream);
      return 0;
    }
    std::printf("\n## Concurrency + tuning (new) against one stream + heuristic's first (prev), FP8 and BF16\n\n");
    compare_header();
    {
      const auto v3 = ragged_counts(32, 32 * 2048, 101, 16);  // DeepSeek-V3 EP8: 32 experts x ~2048 rows
      compare_layer(gg, prev, "V3 GEMM1", v3, 4096, 7168);
      compare_layer(gg, prev, "V3 GEMM2", v3, 7168, 2048);
      const auto lite = ragged_counts(64, 64 * 384, 102, 16);  // V2-Lite: 64 experts x ~384 rows
      compare_layer(gg, prev, "V2-Lite GEMM1", lite, 2816, 2048);
      compare_layer(gg, prev, "V2-Lite GEMM2", lite, 2048, 1408);
    }
    print_tuning(gg);
    if (compare_only) {
      cudaStreamDestroy(g_stream);
      return 0;
    }

    std::printf("\n## Ceilings: dense cuBLASLt at 8192^3 (one GEMM, same code path, E = 1)\n\n");
    header();
    bench_layer(gg, "dense 8192^3", {8192}, 8192, 8192, false);

    std::printf("\n## Target: FP8 fprop, 8 experts x 4096 tokens, K 7168 -> N 4096 (>= 1000 TFLOP/s)\n\n");
    header();
    {
      const auto s0 = gg.stats();
      const double t0 = bench::host_now_ms();
      bench_layer(gg, "V3 GEMM1 uniform", std::vector<int32_t>(8, 4096), 4096, 7168, false);
      const double t1 = bench::host_now_ms();
      std::printf("(first call of these shapes: %lld heuristic queries; whole row incl. setup %.0f ms)\n",
                  (long long)(gg.stats().heuristic_queries - s0.heuristic_queries),
                  t1 - t0);
    }

    const Model models[] = {{"V3", 7168, 2048, 8}, {"V2", 5120, 1536, 6}, {"V2-Lite", 2048, 1408, 6}};
    for (const Model& md : models) {
      if (!only_model.empty() && only_model != md.name) continue;
      const int64_t m = tokens * md.topk;
      std::printf("\n## DeepSeek-%s: H %lld, F %lld, top-%d, %lld tokens/GPU -> %lld routed rows (ragged, 16-aligned)\n\n",
                  md.name, (long long)md.hidden, (long long)md.ffn, md.topk, (long long)tokens, (long long)m);
      header();
      for (int E : {8, 16, 32, 64}) {
        if (only_e && E != only_e) continue;
        const auto counts = ragged_counts(E, m, 17 + E, 16);
        bench_layer(gg, std::string(md.name) + " GEMM1", counts, 2 * md.ffn, md.hidden, true);
        bench_layer(gg, std::string(md.name) + " GEMM2", counts, md.hidden, md.ffn, true);
      }
    }

    std::printf("\n## Scale conversion (UE8M0 -> GEMM-ready FP32), once per layer pass\n\n");
    bench_scale_conversion(tokens * 8, 7168, 32);
    bench_scale_conversion(tokens * 8, 2048, 32);
    const auto s = gg.stats();
    std::printf("\nplans cached %lld, heuristic queries %lld, matmuls %lld\n", (long long)s.cached_plans,
                (long long)s.heuristic_queries, (long long)s.matmuls);
  } catch (const Error& e) {
    std::fprintf(stderr, "error: %s\n", e.what());
    return 1;
  }
  cudaStreamDestroy(g_stream);
  return 0;
}
