// SwiGLU benchmark: the fused SwiGLU + FP8 quantize kernels against the plain BF16 kernel and the
// unfused sequences, with the device-to-device copy bandwidth as the ceiling, all measured in the
// same run. Medians of CUDA-event timings after warm-up; random data; two input sets alternated so
// that consecutive repetitions never find their input in L2.
//
//   flowmoe_bench_swiglu [--reps N] [--config NAME] [--rows M]
//
// Targets (issue 4): fused SwiGLU+quantize <= 1.05x the plain BF16 SwiGLU kernel;
// fused dSwiGLU+quantize (row + col) >= 2.5x the unfused sequence (dSwiGLU -> quantize_row ->
// quantize_col).
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
#include "flowmoe/numerics.h"
#include "flowmoe/swiglu.h"

#include "bench_util.cuh"

using namespace flowmoe;


namespace {

int g_reps = 30;
double g_copy_gbs = 0;

using bench::dalloc;
using bench::ragged_counts;

// Median of g_reps timed calls of fn(rep), in microseconds, after 5 warm-up calls.
float median_us(const std::function<void(int)>& fn) { return bench::median_us(fn, g_reps, 5); }

struct Config {
  const char* name;
  int64_t f;       // expert FFN width: H is [M, 2F]
  int experts;     // local experts (segments)
};

std::vector<bf16_t> random_bf16(size_t n, uint32_t seed) {
  std::mt19937 rng(seed);
  std::normal_distribution<float> nd(0.f, 1.f);
  std::vector<bf16_t> v(n);
  for (auto& x : v) x = num::f32_to_bf16(nd(rng));
  return v;
}

void header() {
  std::printf("  (ratio: speed-up = baseline us / us; on \"time vs\" rows: us / baseline us)\n");
  std::printf("  %-40s %10s %10s %9s %6s   %-34s %10s %8s  %s\n", "kernel", "MB", "us", "GB/s", "%copy",
              "baseline (same run)", "us", "ratio", "target");
}
// ratio = baseline_us / us (speed-up) unless `slowdown`: us / baseline_us (time relative to it).
void line(const char* kernel, double bytes, float us, const char* base = nullptr, float base_us = 0,
          bool slowdown = false, double target = 0) {
  const double gbs = bench::gb_per_s(bytes, us);
  std::printf("  %-40s %10.1f %10.1f %9.0f %5.1f%%", kernel, bytes / 1e6, us, gbs, bench::percent_of(gbs, g_copy_gbs));
  if (base) {
    const double r = slowdown ? us / base_us : base_us / us;
    std::printf("   %-34s %10.1f %7.2fx", base, base_us, r);
    if (target > 0) {
      const bool ok = slowdown ? r <= target : r >= target;
      std::printf("  %s %.2fx %s", slowdown ? "<=" : ">=", target, ok ? "PASS" : "FAIL");
    }
  }
  std::printf("\n");
}

void bench_config(const Config& c, int64_t m) {
  const int64_t f = c.f, k = 2 * f;
  const int E = c.experts;
  const auto counts = ragged_counts(E, m, 17, 16);
  std::vector<int32_t> offs(E + 1, 0);
  for (int e = 0; e < E; ++e) offs[e + 1] = offs[e] + counts[e];
  std::printf("\n%s: M = %lld rows, F = %lld (H [M, %lld] bf16), %d local experts (ragged, 16-aligned)\n", c.name,
              static_cast<long long>(m), static_cast<long long>(f), static_cast<long long>(k), E);

  // inputs: two random sets of H and dA
  bf16_t* h[2];
  bf16_t* da[2];
  for (int i = 0; i < 2; ++i) {
    const auto hh = random_bf16(m * k, 100 + i);
    const auto dd = random_bf16(m * f, 200 + i);
    h[i] = dalloc<bf16_t>(m * k);
    da[i] = dalloc<bf16_t>(m * f);
    CK(cudaMemcpy(h[i], hh.data(), hh.size() * 2, cudaMemcpyHostToDevice));
    CK(cudaMemcpy(da[i], dd.data(), dd.size() * 2, cudaMemcpyHostToDevice));
  }
  int32_t* doff = dalloc<int32_t>(E + 1);
  CK(cudaMemcpy(doff, offs.data(), (E + 1) * 4, cudaMemcpyHostToDevice));
  const int64_t maxb = cuda::segment_max_blocks(m, E);
  cuda::SegmentBlocks sb{doff, E, m, maxb, dalloc<int32_t>(maxb), dalloc<int32_t>(maxb), dalloc<int32_t>(E + 1)};
  cuda::DeviceStatus* st = dalloc<cuda::DeviceStatus>(1);
  CK(cudaMemset(st, 0, sizeof(*st)));
  cuda::build_segment_blocks(sb, st, 0);
  int64_t nb = 0;  // real 128-token blocks
  for (int e = 0; e < E; ++e) nb += (counts[e] + 127) / 128;

  // outputs and workspaces
  bf16_t* a16 = dalloc<bf16_t>(m * f);
  bf16_t* work = dalloc<bf16_t>(m * k);
  uint8_t* arc = dalloc<uint8_t>(m * f);
  uint8_t* ars = dalloc<uint8_t>(m * f / 128);
  uint8_t* acc = dalloc<uint8_t>(m * f);
  uint8_t* acs = dalloc<uint8_t>(maxb * f);
  uint8_t* hc[2] = {dalloc<uint8_t>(m * k), dalloc<uint8_t>(m * k)};
  uint8_t* hs[2] = {dalloc<uint8_t>(m * k / 128), dalloc<uint8_t>(m * k / 128)};
  uint8_t* rc = dalloc<uint8_t>(m * k);
  uint8_t* rs = dalloc<uint8_t>(m * k / 128);
  uint8_t* cc = dalloc<uint8_t>(m * k);
  uint8_t* cs = dalloc<uint8_t>(maxb * k);
  for (int i = 0; i < 2; ++i) cuda::swiglu_quant(h[i], m, f, arc, ars, hc[i], hs[i], st, 0);  // saved FP8 H
  // the MoE layer's form: routing probability per row, dp partial sums, H saved as MXFP4
  std::vector<float> hp(m);
  for (int64_t r = 0; r < m; ++r) hp[r] = 0.05f + 0.9f * static_cast<float>((r * 2654435761u) % 1000) / 1000.0f;
  float* prow = dalloc<float>(m);
  CK(cudaMemcpy(prow, hp.data(), m * 4, cudaMemcpyHostToDevice));
  float* dpart = dalloc<float>(m * (f / 128));
  uint8_t* h4c[2] = {dalloc<uint8_t>(m * k / 2), dalloc<uint8_t>(m * k / 2)};
  uint8_t* h4s[2] = {dalloc<uint8_t>(m * k / 32), dalloc<uint8_t>(m * k / 32)};
  for (int i = 0; i < 2; ++i) cuda::swiglu_quant_h4(h[i], m, f, arc, ars, h4c[i], h4s[i], st, 0, prow);
  CK(cudaDeviceSynchronize());

  const double mf = static_cast<double>(m) * f;
  // bytes moved (read + written) by each path
  const double b_plain = 4 * mf + 2 * mf;
  const double b_fused = 4 * mf + mf + mf / 128;
  const double b_fused_h = b_fused + 2 * mf + 2 * mf / 128;
  const double b_fused_col = b_fused + mf + nb * f;
  const double b_dplain = 2 * mf + 4 * mf + 4 * mf;
  const double b_dfused = 2 * mf + 4 * mf + 2 * mf + 2 * mf / 128 + 2 * mf + nb * k;
  const double b_dfused8 = b_dfused - 4 * mf + 2 * mf + 2 * mf / 128;

  // ---- forward
  const float t_plain = median_us([&](int r) { cuda::swiglu(h[r & 1], m, f, a16, nullptr, 0); });
  const float t_fused = median_us([&](int r) { cuda::swiglu_quant(h[r & 1], m, f, arc, ars, nullptr, nullptr, st, 0); });
  const float t_fused_h = median_us([&](int r) { cuda::swiglu_quant(h[r & 1], m, f, arc, ars, hc[0], hs[0], st, 0); });
  const float t_fused_col = median_us(
      [&](int r) { cuda::swiglu_quant_col(h[r & 1], f, sb, arc, ars, acc, acs, nullptr, nullptr, st, 0); });
  const float t_unfused = median_us([&](int r) {
    cuda::swiglu(h[r & 1], m, f, a16, nullptr, 0);
    cuda::quantize_row(a16, m, f, arc, ars, st, 0);
  });
  const float t_chained = median_us([&](int r) {
    cuda::swiglu_quant(h[r & 1], m, f, arc, ars, nullptr, nullptr, st, 0);
    cuda::scaling_aware_transpose(arc, ars, f, sb, acc, acs, st, 0);
  });
  // ---- backward
  const float t_dplain = median_us([&](int r) { cuda::dswiglu(da[r & 1], h[r & 1], m, f, work, nullptr, 0); });
  const float t_dfused = median_us(
      [&](int r) { cuda::dswiglu_quant(da[r & 1], h[r & 1], f, sb, rc, rs, cc, cs, st, 0); });
  const float t_dfused8 = median_us(
      [&](int r) { cuda::dswiglu_quant_fp8h(da[r & 1], hc[r & 1], hs[r & 1], f, sb, rc, rs, cc, cs, st, 0); });
  const float t_dunfused3 = median_us(
      [&](int r) { cuda::dswiglu_quant_unfused(da[r & 1], h[r & 1], f, sb, rc, rs, cc, cs, work, st, 0); });
  const float t_dunfused2 = median_us([&](int r) {
    cuda::dswiglu(da[r & 1], h[r & 1], m, f, work, nullptr, 0);
    cuda::quantize_col(work, k, sb, cc, cs, rc, rs, st, 0);
  });
  // ---- the MoE layer's form (probability; flow saves H as FP8, flow-fp4 as MXFP4)
  const float t_plain_p = median_us([&](int r) { cuda::swiglu(h[r & 1], m, f, a16, nullptr, 0, prow); });
  const float t_fused_hp = median_us(
      [&](int r) { cuda::swiglu_quant(h[r & 1], m, f, arc, ars, hc[0], hs[0], st, 0, prow); });
  const float t_fused_h4p = median_us(
      [&](int r) { cuda::swiglu_quant_h4(h[r & 1], m, f, arc, ars, h4c[0], h4s[0], st, 0, prow); });
  const float t_dplain_p =
      median_us([&](int r) { cuda::dswiglu(da[r & 1], h[r & 1], m, f, work, nullptr, 0, prow, dpart); });
  const float t_dfused8p = median_us([&](int r) {
    cuda::dswiglu_quant_fp8h(da[r & 1], hc[r & 1], hs[r & 1], f, sb, rc, rs, cc, cs, st, 0, prow, dpart);
  });
  const float t_dfused4p = median_us([&](int r) {
    cuda::dswiglu_quant_fp4h(da[r & 1], h4c[r & 1], h4s[r & 1], f, sb, rc, rs, cc, cs, st, 0, prow, dpart);
  });
  const float t_qrow = median_us([&](int) { cuda::quantize_row(work, m, k, rc, rs, st, 0); });
  const float t_qcol = median_us([&](int) { cuda::quantize_col(work, k, sb, cc, cs, nullptr, nullptr, st, 0); });

  header();
  line("swiglu (plain BF16, baseline)", b_plain, t_plain);
  line("swiglu_quant (fused, row-wise FP8)", b_fused, t_fused, "time vs plain BF16 swiglu", t_plain, true, 1.05);
  line("swiglu_quant (fused, row-wise FP8)", b_fused, t_fused, "swiglu -> quantize_row (2 kern.)", t_unfused);
  line("swiglu_quant + H saved as FP8", b_fused_h, t_fused_h, "time vs plain BF16 swiglu", t_plain, true);
  line("swiglu_quant_col (fused row + col)", b_fused_col, t_fused_col, "swiglu_quant -> aware transpose", t_chained);
  line("dswiglu (plain BF16)", b_dplain, t_dplain);
  line("dswiglu_quant (fused, row + col)", b_dfused, t_dfused, "dswiglu -> q_row -> q_col", t_dunfused3, false, 2.5);
  line("dswiglu_quant (fused, row + col)", b_dfused, t_dfused, "dswiglu -> q_col(+row, 1 pass)", t_dunfused2);
  line("dswiglu_quant_fp8h (H saved as FP8)", b_dfused8, t_dfused8, "dswiglu -> q_row -> q_col", t_dunfused3);
  const double b_h4 = 2 * mf / 2 + 2 * mf / 32;  // H as MXFP4
  line("swiglu*p (plain BF16, MoE form)", b_plain + 4 * m, t_plain_p, "plain BF16 swiglu", t_plain, true);
  line("swiglu_quant*p + H FP8 (flow)", b_fused_h + 4 * m, t_fused_hp, "swiglu*p -> quantize_row a', H", t_plain_p + t_qrow);
  line("swiglu_quant_h4*p + H MXFP4 (flow-fp4)", b_fused + b_h4 + 4 * m, t_fused_h4p, "swiglu_quant*p + H FP8", t_fused_hp, true);
  line("dswiglu*p (plain BF16, + dp parts)", b_dplain + 4 * m + 4 * m * (f / 128), t_dplain_p, "plain BF16 dswiglu", t_dplain, true);
  line("dswiglu_quant_fp8h*p (flow)", b_dfused8 + 4 * m * (1 + f / 128), t_dfused8p, "dswiglu*p -> q_row -> q_col", t_dplain_p + t_qrow + t_qcol);
  line("dswiglu_quant_fp4h*p (flow-fp4)", b_dfused8 - 2 * mf - 2 * mf / 128 + b_h4 + 4 * m * (1 + f / 128), t_dfused4p,
       "dswiglu_quant_fp8h*p", t_dfused8p,
       true);
  line("  step: quantize_row [M, 2F]", 4 * mf + 2 * mf + 2 * mf / 128, t_qrow);
  line("  step: quantize_col [M, 2F]", 4 * mf + 2 * mf + nb * k, t_qcol);
  std::printf("  unfused backward total %.1f us = dswiglu %.1f + quantize_row %.1f + quantize_col %.1f (separately timed)\n",
              t_dunfused3, t_dplain, t_qrow, t_qcol);

  cuda::DeviceStatus hst{};
  CK(cudaMemcpy(&hst, st, sizeof(hst), cudaMemcpyDeviceToHost));
  if (hst.nonfinite || hst.bad_segments)
    std::printf("  WARNING: status nonfinite %llu, bad_segments %llu\n", hst.nonfinite, hst.bad_segments);

  for (int i = 0; i < 2; ++i) {
    cudaFree(h[i]);
    cudaFree(da[i]);
    cudaFree(hc[i]);
    cudaFree(hs[i]);
  }
  for (void* p : std::initializer_list<void*>{a16, work, arc, ars, acc, acs, rc, rs, cc, cs, doff, st, sb.block_start,
                                              sb.block_end, sb.block_offsets})
    cudaFree(p);
}

}  // namespace

int main(int argc, char** argv) {
  std::string only;
  int64_t rows = 32768;
  for (int i = 1; i < argc; ++i) {
    if (!std::strcmp(argv[i], "--reps") && i + 1 < argc) g_reps = std::max(3, std::atoi(argv[++i]));
    else if (!std::strcmp(argv[i], "--config") && i + 1 < argc) only = argv[++i];
    else if (!std::strcmp(argv[i], "--rows") && i + 1 < argc) rows = std::atoll(argv[++i]);
    else {
      std::fprintf(stderr, "usage: %s [--reps N] [--config NAME] [--rows M]\n", argv[0]);
      return 2;
    }
  }
  cudaDeviceProp prop;
  if (!bench::device_properties("flowmoe_bench_swiglu", &prop)) return 1;
  std::printf("device: %s, %d SMs, L2 %d MB; %d reps (median)\n", prop.name, prop.multiProcessorCount,
              prop.l2CacheSize >> 20, g_reps);
  // ceiling: device-to-device copy of 2 GiB, bytes read + written
  g_copy_gbs = bench::copy_ceiling_gbs(size_t(2) << 30, g_reps, 5);
  const Config configs[] = {
      {"DeepSeek-V3", 2048, 32},       // 256 experts / EP8
      {"DeepSeek-V2-Lite", 1408, 8},   // 64 experts / EP8
  };
  for (const Config& c : configs) {
    if (!only.empty() && only != c.name) continue;
    bench_config(c, rows);
  }
  return 0;
}
