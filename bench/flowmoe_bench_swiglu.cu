// SwiGLU benchmark: the fused SwiGLU + FP8 quantize kernels against the plain BF16 kernel and the
// unfused sequences, with the device-to-device copy bandwidth as the ceiling, all measured in the
// same run. Medians of CUDA-event timings after warm-up; random data; two input sets alternated so
// that consecutive repetitions never find their input in L2.
//
//   flowmoe_bench_swiglu [--reps N] [--config NAME] [--rows M] [--gemm-only] [--bias-only]
//
// Targets (issue 4): fused SwiGLU+quantize <= 1.05x the plain BF16 SwiGLU kernel;
// fused dSwiGLU+quantize (row + col) >= 2.5x the unfused sequence (dSwiGLU -> quantize_row ->
// quantize_col).
//
// Last sections (--gemm-only, or its old name --gemm1-only: only they): GEMM1 of the flow recipes by the grouped sm_90a kernel,
// alone (BF16 h) against the same kernel with the SwiGLU*p + quantize epilogue (flow: h saved FP8,
// flow-fp4: MXFP4) and against GEMM1 followed by the separate swiglu_quant / swiglu_quant_h4,
// at the DeepSeek-V3 (EP8) and V2-Lite expert shapes; the fused outputs are checked bit for bit
// against the two-kernel ones. Target (issue 19): fused <= 1.05x GEMM1 alone. Then GEMM2's dgrad the
// same way: alone (BF16 da'), with the dSwiGLU*p + quantize (dh row + col) + dp epilogue (h read as
// FP8 rows / MXFP4), and followed by dswiglu_quant_fp8h / _fp4h; target: fused <= 1.05x dgrad alone.
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
#include "flowmoe/cuda/qtensor_view.h"
#include "flowmoe/cuda/status.h"
#include "flowmoe/error.h"
#include "flowmoe/expert_bias.h"
#include "flowmoe/gemm.h"
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

// ---- GEMM1 with the fused SwiGLU epilogue ---------------------------------------------------------
__global__ void fill_bf16_kernel(bf16_t* p, int64_t n, uint32_t seed, float scale) {
  for (int64_t i = blockIdx.x * int64_t(blockDim.x) + threadIdx.x; i < n; i += int64_t(gridDim.x) * blockDim.x) {
    uint32_t h = uint32_t(i) * 2654435761u ^ (uint32_t(i >> 32) + seed) * 2246822519u;
    h ^= h >> 15, h *= 2246822519u, h ^= h >> 13;
    // sum of two uniforms in [-1, 1): spread values with a few large ones (not a normal; enough here)
    const float u = (float(h & 0xFFFF) - 32768.f + float(h >> 16) - 32768.f) / 32768.f;
    p[i] = num::f32_to_bf16(u * scale);
  }
}
void fill_bf16(bf16_t* p, int64_t n, uint32_t seed, float scale) {
  fill_bf16_kernel<<<1024, 256>>>(p, n, seed, scale);
  CK(cudaGetLastError());
}
bool same_bytes(const uint8_t* a, const uint8_t* b, size_t n) {
  std::vector<uint8_t> ha(n), hb(n);
  CK(cudaMemcpy(ha.data(), a, n, cudaMemcpyDeviceToHost));
  CK(cudaMemcpy(hb.data(), b, n, cudaMemcpyDeviceToHost));
  return std::memcmp(ha.data(), hb.data(), n) == 0;
}

// E experts of `rows_per_expert` rows each, on the device: the offsets, a routing probability per
// row (0.125 .. 0.875), a zeroed status.
struct UniformExperts {
  int32_t* offsets;
  float* prob;
  cuda::DeviceStatus* status;
};
UniformExperts uniform_experts(int E, int64_t rows_per_expert) {
  const int64_t m = E * rows_per_expert;
  std::vector<int32_t> off(E + 1);
  for (int e = 0; e <= E; ++e) off[e] = int32_t(e * rows_per_expert);
  std::vector<float> hp(m);
  for (int64_t r = 0; r < m; ++r) hp[r] = 0.125f + float(r % 7) / 8;
  UniformExperts u{dalloc<int32_t>(E + 1), dalloc<float>(m), dalloc<cuda::DeviceStatus>(1)};
  CK(cudaMemcpy(u.offsets, off.data(), sizeof(int32_t) * (E + 1), cudaMemcpyHostToDevice));
  CK(cudaMemcpy(u.prob, hp.data(), sizeof(float) * m, cudaMemcpyHostToDevice));
  CK(cudaMemset(u.status, 0, sizeof(*u.status)));
  return u;
}

// One expert shape: E experts of `rows_per_expert` rows, W1 [2F, H] each.
void bench_gemm1(const char* name, int E, int64_t rows_per_expert, int64_t h, int64_t f) {
  const int64_t m = E * rows_per_expert, n = 2 * f, wn = int64_t(E) * n * h;
  const UniformExperts ue = uniform_experts(E, rows_per_expert);
  int32_t* doff = ue.offsets;
  float* prob = ue.prob;
  cuda::DeviceStatus* st = ue.status;
  // x [m, H] and W1 quantized as the layer does (row-wise 1x128; 128x128 with GEMM-ready FP32 scales)
  bf16_t* tmp = dalloc<bf16_t>(std::max(m * h, wn));
  uint8_t *xc = dalloc<uint8_t>(m * h), *xs = dalloc<uint8_t>(h / 128 * m);
  fill_bf16(tmp, m * h, 1, 1.0f);
  cuda::quantize_row(tmp, m, h, xc, xs, st, 0);
  const int64_t sblk = (n / 128) * (h / 128);
  uint8_t *wc = dalloc<uint8_t>(wn), *ws8 = dalloc<uint8_t>(E * sblk), *wtc = dalloc<uint8_t>(wn),
          *wts8 = dalloc<uint8_t>(E * sblk), *wic = dalloc<uint8_t>(wn);
  float *wsf = dalloc<float>(gemm::weight_scale_f32_elems(E, n, h)), *wisf = dalloc<float>(gemm::weight_scale_f32_elems(E, n, h));
  fill_bf16(tmp, wn, 2, 1.0f / std::sqrt(float(h)));
  for (int e = 0; e < E; ++e)
    cuda::quantize_weight(tmp + e * n * h, n, h, wc + e * n * h, ws8 + e * sblk, wtc + e * n * h, wts8 + e * sblk, st, 0);
  cuda::weight_scales_to_f32(ws8, E, n, h, wsf, 0);
  cudaFree(tmp);
  cudaFree(wtc);
  cudaFree(wts8);
  const cuda::QTensorView x = cuda::row_1x128(xc, xs, m, h), w = cuda::weight_128x128_f32(wc, wsf, E, n, h),
                          wi = cuda::weight_128x128_f32(wic, wisf, E, n, h);
  cuda::interleave_gate_up(w, wi, 0);
  bf16_t* hb = dalloc<bf16_t>(m * n);
  uint8_t *ac[2], *as[2], *h8c[2], *h8s[2], *h4c[2], *h4s[2];  // [0] fused, [1] two kernels
  for (int i = 0; i < 2; ++i) {
    ac[i] = dalloc<uint8_t>(m * f), as[i] = dalloc<uint8_t>(f / 128 * m);
    h8c[i] = dalloc<uint8_t>(m * n), h8s[i] = dalloc<uint8_t>(n / 128 * m);
    h4c[i] = dalloc<uint8_t>(m * f), h4s[i] = dalloc<uint8_t>(m * (n / 32));
  }
  cuda::GroupedGemm gg;
  const gemm::DeviceSegments seg{doff, E, m, st};
  const auto gemm1 = [&] { gg.fprop(seg, n, h, x, w, {hb, m * n}, 0); };
  const auto fused = [&](bool fp4) {
    gg.fprop_swiglu(seg, f, h, x, wi, prob, cuda::row_1x128(ac[0], as[0], m, f),
                    fp4 ? cuda::mxfp4_1x32(h4c[0], h4s[0], m, n) : cuda::row_1x128(h8c[0], h8s[0], m, n), st, 0);
  };
  const auto swiglu = [&](bool fp4) {
    if (fp4) cuda::swiglu_quant_h4(hb, m, f, ac[1], as[1], h4c[1], h4s[1], st, 0, prob);
    else cuda::swiglu_quant(hb, m, f, ac[1], as[1], h8c[1], h8s[1], st, 0, prob);
  };
  const float t_gemm = median_us([&](int) { gemm1(); });
  const double flops = 2.0 * m * n * h;
  std::printf("\n  %s: %d experts x %lld rows, H %lld, F %lld: GEMM1 alone (BF16 h) %.1f us, %.0f TFLOP/s\n", name, E,
              (long long)rows_per_expert, (long long)h, (long long)f, t_gemm, flops / t_gemm * 1e-6);
  for (bool fp4 : {false, true}) {
    const float t_fused = median_us([&](int) { fused(fp4); });
    const float t_swiglu = median_us([&](int) { swiglu(fp4); });
    const float t_two = median_us([&](int) { gemm1(); swiglu(fp4); });
    fused(fp4);
    gemm1();
    swiglu(fp4);
    CK(cudaDeviceSynchronize());
    const bool bits = same_bytes(ac[0], ac[1], m * f) && same_bytes(as[0], as[1], f / 128 * m) &&
                      (fp4 ? same_bytes(h4c[0], h4c[1], m * f) && same_bytes(h4s[0], h4s[1], m * (n / 32))
                           : same_bytes(h8c[0], h8c[1], m * n) && same_bytes(h8s[0], h8s[1], n / 128 * m));
    const double r = t_fused / t_gemm;
    std::printf("  %-9s fused %.1f us (%.3fx GEMM1 alone: <= 1.05x %s) | GEMM1 + %s %.1f us (swiglu alone %.1f us): "
                "fused saves %.1f us = %.0f%% of the SwiGLU kernel | bits %s\n",
                fp4 ? "flow-fp4" : "flow", t_fused, r, r <= 1.05 ? "PASS" : "FAIL",
                fp4 ? "swiglu_quant_h4" : "swiglu_quant", t_two, t_swiglu, t_two - t_fused,
                100.0 * (t_two - t_fused) / t_swiglu, bits ? "equal" : "DIFFER");
  }
  cuda::DeviceStatus hst{};
  CK(cudaMemcpy(&hst, st, sizeof(hst), cudaMemcpyDeviceToHost));
  if (hst.nonfinite || hst.bad_segments)
    std::printf("  WARNING: status nonfinite %llu, bad_segments %llu\n", hst.nonfinite, hst.bad_segments);
  for (int i = 0; i < 2; ++i)
    for (void* p : std::initializer_list<void*>{ac[i], as[i], h8c[i], h8s[i], h4c[i], h4s[i]}) cudaFree(p);
  for (void* p : std::initializer_list<void*>{doff, prob, st, xc, xs, wc, ws8, wic, wsf, wisf, hb}) cudaFree(p);
}

// GEMM2-dgrad of one expert shape: E experts of `rows_per_expert` rows, W2^T [F, H] each; dY [m, H].
void bench_gemm2_dgrad(const char* name, int E, int64_t rows_per_expert, int64_t h, int64_t f) {
  const int64_t m = E * rows_per_expert, n2 = 2 * f, wn = int64_t(E) * f * h;
  const UniformExperts ue = uniform_experts(E, rows_per_expert);
  int32_t* doff = ue.offsets;
  float* prob = ue.prob;
  cuda::DeviceStatus* st = ue.status;
  // dY [m, H] row-wise; W2^T [E][F, H] with GEMM-ready FP32 scales (the layer's); h saved both ways
  bf16_t* tmp = dalloc<bf16_t>(std::max({m * h, wn, m * n2}));
  uint8_t *dyc = dalloc<uint8_t>(m * h), *dys = dalloc<uint8_t>(h / 128 * m);
  fill_bf16(tmp, m * h, 3, 1.0f);
  cuda::quantize_row(tmp, m, h, dyc, dys, st, 0);
  const int64_t sblk = (f / 128) * (h / 128);
  uint8_t *wc = dalloc<uint8_t>(wn), *ws8 = dalloc<uint8_t>(E * sblk), *wtc = dalloc<uint8_t>(wn),
          *wts8 = dalloc<uint8_t>(E * sblk);
  float* wsf = dalloc<float>(gemm::weight_scale_f32_elems(E, f, h));
  fill_bf16(tmp, wn, 4, 1.0f / std::sqrt(float(h)));
  for (int e = 0; e < E; ++e)
    cuda::quantize_weight(tmp + e * f * h, f, h, wc + e * f * h, ws8 + e * sblk, wtc + e * f * h, wts8 + e * sblk, st, 0);
  cuda::weight_scales_to_f32(ws8, E, f, h, wsf, 0);
  uint8_t *h8c = dalloc<uint8_t>(m * n2), *h8s = dalloc<uint8_t>(n2 / 128 * m), *h4c = dalloc<uint8_t>(m * f),
          *h4s = dalloc<uint8_t>(m * (n2 / 32));
  fill_bf16(tmp, m * n2, 5, 2.0f);
  cuda::quantize_row(tmp, m, n2, h8c, h8s, st, 0);
  cuda::quantize_mxfp4(tmp, m, n2, h4c, h4s, st, 0);
  cudaFree(tmp);
  cudaFree(wtc);
  cudaFree(wts8);
  const cuda::QTensorView dy = cuda::row_1x128(dyc, dys, m, h), wt = cuda::weight_128x128_f32(wc, wsf, E, f, h);
  cuda::SegmentBlocks sb;
  sb.offsets = doff;
  sb.num_segments = E;
  sb.m = m;
  sb.max_blocks = cuda::segment_max_blocks(m, E);
  sb.block_start = dalloc<int32_t>(sb.max_blocks);
  sb.block_end = dalloc<int32_t>(sb.max_blocks);
  sb.block_offsets = dalloc<int32_t>(E + 1);
  cuda::build_segment_blocks(sb, st, 0);
  bf16_t* da = dalloc<bf16_t>(m * f);
  uint8_t *rc[2], *rs[2], *cc[2], *cs[2];  // [0] fused, [1] two kernels
  float* dp[2];
  for (int i = 0; i < 2; ++i) {
    rc[i] = dalloc<uint8_t>(m * n2), rs[i] = dalloc<uint8_t>(n2 / 128 * m);
    cc[i] = dalloc<uint8_t>(m * n2), cs[i] = dalloc<uint8_t>(sb.max_blocks * n2);
    dp[i] = dalloc<float>(f / 128 * m);
  }
  cuda::GroupedGemm gg;
  const gemm::DeviceSegments seg{doff, E, m, st};
  const auto dgrad = [&] { gg.dgrad(seg, h, f, dy, wt, {da, m * f}, 0); };
  const auto fused = [&](bool fp4) {
    gg.dgrad_dswiglu(seg, h, f, dy, wt, prob,
                     fp4 ? cuda::mxfp4_1x32(h4c, h4s, m, n2) : cuda::row_1x128(h8c, h8s, m, n2),
                     cuda::row_1x128(rc[0], rs[0], m, n2), cuda::col_128x1(cc[0], cs[0], m, n2, sb.max_blocks), dp[0],
                     st, 0);
  };
  const auto dswiglu = [&](bool fp4) {
    if (fp4) cuda::dswiglu_quant_fp4h(da, h4c, h4s, f, sb, rc[1], rs[1], cc[1], cs[1], st, 0, prob, dp[1]);
    else cuda::dswiglu_quant_fp8h(da, h8c, h8s, f, sb, rc[1], rs[1], cc[1], cs[1], st, 0, prob, dp[1]);
  };
  const float t_dgrad = median_us([&](int) { dgrad(); });
  const double flops = 2.0 * m * f * h;
  std::printf("\n  %s: %d experts x %lld rows, H %lld, F %lld: GEMM2 dgrad alone (BF16 da') %.1f us, %.0f TFLOP/s\n",
              name, E, (long long)rows_per_expert, (long long)h, (long long)f, t_dgrad, flops / t_dgrad * 1e-6);
  for (bool fp4 : {false, true}) {
    const float t_fused = median_us([&](int) { fused(fp4); });
    const float t_dsw = median_us([&](int) { dswiglu(fp4); });
    const float t_two = median_us([&](int) { dgrad(); dswiglu(fp4); });
    fused(fp4);
    dgrad();
    dswiglu(fp4);
    CK(cudaDeviceSynchronize());
    const bool bits = same_bytes(rc[0], rc[1], m * n2) && same_bytes(rs[0], rs[1], n2 / 128 * m) &&
                      same_bytes(cc[0], cc[1], m * n2) && same_bytes(cs[0], cs[1], (m / 128) * n2) &&
                      same_bytes(reinterpret_cast<uint8_t*>(dp[0]), reinterpret_cast<uint8_t*>(dp[1]),
                                 sizeof(float) * (f / 128) * m);
    const double r = t_fused / t_dgrad;
    std::printf("  %-9s fused %.1f us (%.3fx dgrad alone: <= 1.05x %s) | dgrad + %s %.1f us (dswiglu alone %.1f us): "
                "fused saves %.1f us = %.0f%% of the dSwiGLU kernel | bits %s\n",
                fp4 ? "flow-fp4" : "flow", t_fused, r, r <= 1.05 ? "PASS" : "FAIL",
                fp4 ? "dswiglu_quant_fp4h" : "dswiglu_quant_fp8h", t_two, t_dsw, t_two - t_fused,
                100.0 * (t_two - t_fused) / t_dsw, bits ? "equal" : "DIFFER");
  }
  cuda::DeviceStatus hst{};
  CK(cudaMemcpy(&hst, st, sizeof(hst), cudaMemcpyDeviceToHost));
  if (hst.nonfinite || hst.bad_segments)
    std::printf("  WARNING: status nonfinite %llu, bad_segments %llu\n", hst.nonfinite, hst.bad_segments);
  for (int i = 0; i < 2; ++i)
    for (void* p : std::initializer_list<void*>{rc[i], rs[i], cc[i], cs[i], dp[i]}) cudaFree(p);
  for (void* p : std::initializer_list<void*>{doff, prob, st, dyc, dys, wc, ws8, wsf, h8c, h8s, h4c, h4s, da,
                                              sb.block_start, sb.block_end, sb.block_offsets})
    cudaFree(p);
}

void gemm_section() {
  std::printf("\n## GEMM2 dgrad (grouped sm_90a kernel) with the fused dSwiGLU*p + quantize (row + col) epilogue\n");
  try {
    bench_gemm2_dgrad("DeepSeek-V3 EP8", 32, 2048, 7168, 2048);
    bench_gemm2_dgrad("DeepSeek-V2-Lite", 64, 384, 2048, 1408);
  } catch (const Error& e) {
    std::fprintf(stderr, "error: %s\n", e.what());
    std::exit(1);
  }
}

void gemm1_section() {
  std::printf("\n## GEMM1 (grouped sm_90a kernel) with the fused SwiGLU*p + quantize epilogue\n");
  try {
    bench_gemm1("DeepSeek-V3 EP8", 32, 2048, 7168, 2048);
    bench_gemm1("DeepSeek-V2-Lite", 64, 384, 2048, 1408);
  } catch (const Error& e) {
    std::fprintf(stderr, "error: %s\n", e.what());
    std::exit(1);
  }
}

// gpt-oss-20b's block: T 8192 top-4 rows over 32 experts, 2F = 2 x 2944 (F 2880 padded to 128).
void bias_section() {
  const int64_t m = 32768, n = 5888;
  const int E = 32;
  std::printf("\n## GEMM1 bias gradient: db = each expert's sum of dH rows [%lld, %lld], %d experts (gpt-oss-20b)\n",
              static_cast<long long>(m), static_cast<long long>(n), E);
  header();
  const auto counts = ragged_counts(E, m, 23, 128);
  std::vector<int32_t> offs(E + 1, 0);
  for (int e = 0; e < E; ++e) offs[e + 1] = offs[e] + counts[e];
  int32_t* doff = dalloc<int32_t>(E + 1);
  CK(cudaMemcpy(doff, offs.data(), sizeof(int32_t) * (E + 1), cudaMemcpyHostToDevice));
  bf16_t* dh[2];
  uint8_t *codes[2], *scales[2];
  cuda::DeviceStatus* st = dalloc<cuda::DeviceStatus>(1);
  for (int i = 0; i < 2; ++i) {
    dh[i] = dalloc<bf16_t>(m * n);
    codes[i] = dalloc<uint8_t>(m * n);
    scales[i] = dalloc<uint8_t>(m * n / 128);
    const std::vector<bf16_t> v = random_bf16(m * n, 40 + i);
    CK(cudaMemcpy(dh[i], v.data(), sizeof(bf16_t) * m * n, cudaMemcpyHostToDevice));
    cuda::quantize_row(dh[i], m, n, codes[i], scales[i], st, 0);
  }
  bf16_t* deq = dalloc<bf16_t>(m * n);
  float* db = dalloc<float>(E * n);
  const double bf16_bytes = 2.0 * m * n, fp8_bytes = m * n + m * n / 128.0;
  const float t_bf16 =
      median_us([&](int r) { cuda::expert_bias_grad(dh[r & 1], m, n, doff, E, db, false, nullptr, 0); });
  const float t_unfused = median_us([&](int r) {
    cuda::dequantize_row(codes[r & 1], scales[r & 1], m, n, deq, 0);
    cuda::expert_bias_grad(deq, m, n, doff, E, db, false, nullptr, 0);
  });
  const float t_fp8 = median_us(
      [&](int r) { cuda::expert_bias_grad_fp8(codes[r & 1], scales[r & 1], m, n, doff, E, db, false, nullptr, 0); });
  line("expert_bias_grad (BF16 dH)", bf16_bytes, t_bf16);
  line("expert_bias_grad_fp8 (row-wise FP8 dH)", fp8_bytes, t_fp8, "dequantize_row + BF16 sums", t_unfused);
  CK(cudaDeviceSynchronize());
  for (int i = 0; i < 2; ++i)
    for (void* p : std::initializer_list<void*>{dh[i], codes[i], scales[i]}) cudaFree(p);
  for (void* p : std::initializer_list<void*>{doff, st, deq, db}) cudaFree(p);
}

}  // namespace

int main(int argc, char** argv) {
  std::string only;
  int64_t rows = 32768;
  bool gemm1_only = false, bias_only = false;
  for (int i = 1; i < argc; ++i) {
    if (!std::strcmp(argv[i], "--reps") && i + 1 < argc) g_reps = std::max(3, std::atoi(argv[++i]));
    else if (!std::strcmp(argv[i], "--config") && i + 1 < argc) only = argv[++i];
    else if (!std::strcmp(argv[i], "--rows") && i + 1 < argc) rows = std::atoll(argv[++i]);
    else if (!std::strcmp(argv[i], "--gemm-only") || !std::strcmp(argv[i], "--gemm1-only")) gemm1_only = true;
    else if (!std::strcmp(argv[i], "--bias-only")) bias_only = true;
    else {
      std::fprintf(stderr, "usage: %s [--reps N] [--config NAME] [--rows M] [--gemm-only] [--bias-only]\n", argv[0]);
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
      {"Qwen3-30B-A3B", 768, 128},     // 128 experts, no EP (issue 51: use --rows 262144 for T 32768 top-8)
  };
  if (bias_only) {
    bias_section();
    return 0;
  }
  for (const Config& c : configs) {
    if (gemm1_only || (!only.empty() && only != c.name)) continue;
    bench_config(c, rows);
  }
  gemm1_section();
  gemm_section();
  if (!gemm1_only) bias_section();
  return 0;
}
