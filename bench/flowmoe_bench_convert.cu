// Conversion-kernel benchmark: each kernel next to its baseline path and the device-to-device
// copy bandwidth, measured in the same run. Medians of CUDA-event timings after warm-up, random
// data, two input sets alternated so that L2 (60 MB) never holds the input.
//
//   flowmoe_bench_convert [--reps N] [--config NAME] [--tokens T] [--weights]
//   (--weights: only the weight quantization at gpt-oss-20b's sizes; --config weights: the same)
#include <cuda_runtime.h>

#include <algorithm>
#include <cmath>
#include <cstdio>
#include <cstring>
#include <functional>
#include <random>
#include <string>
#include <vector>

#include "flowmoe/cuda/convert.h"
#include "flowmoe/expert_layout.h"
#include "flowmoe/numerics.h"

#include "bench_util.cuh"

using namespace flowmoe;


namespace {

int g_reps = 30;

using bench::dalloc;
using bench::ragged_counts;

// median time in microseconds of fn(rep), after 3 warm-up calls
float time_us(const std::function<void(int)>& fn) { return bench::median_us(fn, g_reps, 3); }

struct Config {
  const char* name;
  int hidden;
  int experts;
  int topk;
  int ep;
};

double g_copy_gbs = 0;

void row(const char* kernel, double bytes, float us, const char* base = nullptr, float base_us = 0) {
  const double gbs = bench::gb_per_s(bytes, us);
  std::printf("  %-34s %9.1f MB %9.1f us %8.0f GB/s %6.1f%%", kernel, bytes / 1e6, us, gbs, bench::percent_of(gbs, g_copy_gbs));
  if (base) std::printf("   %-30s %9.1f us  x%.2f", base, base_us, base_us / us);
  std::printf("\n");
}

void bench_config(const Config& c, int64_t tokens_per_gpu) {
  const int64_t m = tokens_per_gpu * c.topk;  // rows routed to this GPU's experts, on average
  const int64_t k = c.hidden;
  const int E = c.experts / c.ep;
  const auto counts = ragged_counts(E, m, 17, 16);
  std::vector<int32_t> offs(E + 1, 0);
  for (int e = 0; e < E; ++e) offs[e + 1] = offs[e] + counts[e];
  std::printf("\n%s: H %lld, %d experts / EP%d = %d local, top-%d, %lld tokens/GPU -> M = %lld rows\n", c.name,
              (long long)k, c.experts, c.ep, E, c.topk, (long long)tokens_per_gpu, (long long)m);

  // inputs: two random bf16 sets
  const int64_t n = m * k;
  std::vector<bf16_t> hx(n);
  std::mt19937 rng(42);
  std::normal_distribution<float> nd(0.f, 1.f);
  for (auto& v : hx) v = num::f32_to_bf16(nd(rng));
  bf16_t* x[2] = {dalloc<bf16_t>(n), dalloc<bf16_t>(n)};
  for (auto* p : x) CK(cudaMemcpy(p, hx.data(), n * 2, cudaMemcpyHostToDevice));
  int32_t* doff = dalloc<int32_t>(E + 1);
  CK(cudaMemcpy(doff, offs.data(), (E + 1) * 4, cudaMemcpyHostToDevice));
  const int64_t maxb = cuda::segment_max_blocks(m, E);
  cuda::SegmentBlocks sb{doff, E, m, maxb, dalloc<int32_t>(maxb), dalloc<int32_t>(maxb), dalloc<int32_t>(E + 1)};
  cuda::DeviceStatus* st = dalloc<cuda::DeviceStatus>(1);
  CK(cudaMemset(st, 0, sizeof(*st)));
  cuda::build_segment_blocks(sb, st, 0);

  uint8_t *rc[2], *rs[2], *fc[2], *fs[2];
  for (int i = 0; i < 2; ++i) {
    rc[i] = dalloc<uint8_t>(n);
    rs[i] = dalloc<uint8_t>(n / 128);
    fc[i] = dalloc<uint8_t>(n / 2);
    fs[i] = dalloc<uint8_t>(n / 32);
    cuda::quantize_row(x[i], m, k, rc[i], rs[i], st, 0);
    cuda::quantize_mxfp4(x[i], m, k, fc[i], fs[i], st, 0);
  }
  uint8_t* oc = dalloc<uint8_t>(n);
  uint8_t* os = dalloc<uint8_t>(maxb * k);
  uint8_t* oc2 = dalloc<uint8_t>(n);
  uint8_t* os2 = dalloc<uint8_t>(n / 128);
  bf16_t* work = dalloc<bf16_t>(2 * n);
  CK(cudaDeviceSynchronize());

  const double sc8 = n / 128.0, sc4 = n / 32.0;  // scale bytes
  const double b_qrow = 2.0 * n + n + sc8;
  const double b_qboth = 2.0 * n + 2.0 * n + 2 * sc8;
  const double b_deq = n + sc8 + 2.0 * n;
  const double b_tr = 4.0 * n;
  const double b_qt = 2.0 * n + n + sc8;
  const double b_aware = 2.0 * n + 2 * sc8;
  const double b_q4 = 2.0 * n + 0.5 * n + sc4;
  const double b_f4to8 = 0.5 * n + sc4 + n + sc8;
  const double b_deq4 = 0.5 * n + sc4 + 2.0 * n;

  const float t_qrow = time_us([&](int r) { cuda::quantize_row(x[r & 1], m, k, rc[r & 1], rs[r & 1], st, 0); });
  const float t_qcol = time_us([&](int r) { cuda::quantize_col(x[r & 1], k, sb, oc, os, nullptr, nullptr, st, 0); });
  const float t_qboth = time_us([&](int r) { cuda::quantize_col(x[r & 1], k, sb, oc, os, oc2, os2, st, 0); });
  const float t_deq = time_us([&](int r) { cuda::dequantize_row(rc[r & 1], rs[r & 1], m, k, work, 0); });
  const float t_tr = time_us([&](int r) { cuda::transpose_bf16(x[r & 1], m, k, work, 0); });
  const float t_qt = time_us([&](int r) { cuda::quantize_transposed(r & 1 ? x[1] : x[0], k, sb, oc, os, st, 0); });
  const float t_naive = time_us([&](int r) { cuda::naive_col_copy(rc[r & 1], rs[r & 1], k, sb, oc, os, work, st, 0); });
  const float t_aware = time_us([&](int r) { cuda::scaling_aware_transpose(rc[r & 1], rs[r & 1], k, sb, oc, os, st, 0); });
  const float t_aware_ca = time_us([&](int r) {
    cuda::scaling_aware_transpose(rc[r & 1], rs[r & 1], k, sb, oc, os, st, 0, TransposeExponent::kColumnAmax);
  });
  const float t_q4 = time_us([&](int r) { cuda::quantize_mxfp4(x[r & 1], m, k, fc[r & 1], fs[r & 1], st, 0); });
  const float t_f4r = time_us([&](int r) { cuda::fp4_to_fp8_row(fc[r & 1], fs[r & 1], m, k, oc2, os2, st, 0); });
  const float t_f4c = time_us([&](int r) { cuda::fp4_to_fp8_col(fc[r & 1], fs[r & 1], k, sb, oc, os, st, 0); });
  const float t_f4c_ca = time_us([&](int r) {
    cuda::fp4_to_fp8_col(fc[r & 1], fs[r & 1], k, sb, oc, os, st, 0, TransposeExponent::kColumnAmax);
  });
  const float t_deq4 = time_us([&](int r) { cuda::dequantize_mxfp4(fc[r & 1], fs[r & 1], m, k, work, 0); });
  const float t_step = time_us([&](int r) { cuda::fp4_to_fp8_col_stepwise(fc[r & 1], fs[r & 1], k, sb, oc, os, work, st, 0); });
  const float t_segs = time_us([&](int) { cuda::build_segment_blocks(sb, st, 0); });
  // unfused "both": row quantize, transpose, quantize the transposed copy (three kernels)
  const float t_both_unfused = time_us([&](int r) {
    cuda::quantize_row(x[r & 1], m, k, oc2, os2, st, 0);
    cuda::transpose_bf16(x[r & 1], m, k, work, 0);
    cuda::quantize_transposed(work, k, sb, oc, os, st, 0);
  });

  std::printf("  %-34s %12s %12s %13s %7s   %-30s %12s  %s\n", "kernel", "bytes", "time", "bandwidth", "%copy",
              "baseline (same run)", "time", "speed-up");
  row("quantize_row (BF16->FP8 1x128)", b_qrow, t_qrow);
  row("quantize_both (row+col, 1 pass)", b_qboth, t_qboth, "row Q + transpose + col Q", t_both_unfused);
  row("quantize_col (BF16->FP8 128x1)", b_qrow, t_qcol);
  row("dequantize_row (FP8->BF16)", b_deq, t_deq);
  row("transpose_bf16 (baseline step)", b_tr, t_tr);
  row("quantize_transposed (baseline step)", b_qt, t_qt);
  row("scaling_aware_transpose", b_aware, t_aware, "naive DQ -> T -> Q (3 kernels)", t_naive);
  row("  column-amax exponent", b_aware, t_aware_ca, "naive DQ -> T -> Q (3 kernels)", t_naive);
  row("quantize_mxfp4 (BF16ToFP4Row)", b_q4, t_q4);
  row("fp4_to_fp8_row (FP4RowToFP8Row)", b_f4to8, t_f4r, "FP4 -> BF16 (dequantize)", t_deq4);
  row("fp4_to_fp8_col (FP4RowToFP8Col)", b_f4to8, t_f4c, "FP4 -> BF16 -> T -> Q (3 kern.)", t_step);
  row("  column-amax exponent", b_f4to8, t_f4c_ca, "FP4 -> BF16 -> T -> Q (3 kern.)", t_step);
  row("dequantize_mxfp4 (FP4->BF16)", b_deq4, t_deq4);
  std::printf("  %-34s %22.1f us (once per layer pass; %d segments)\n", "build_segment_blocks", t_segs, E);
  std::printf("  column-amax / row-max time: scaling_aware_transpose x%.3f, fp4_to_fp8_col x%.3f\n",
              t_aware_ca / t_aware, t_f4c_ca / t_f4c);

  for (int i = 0; i < 2; ++i) {
    cudaFree(x[i]); cudaFree(rc[i]); cudaFree(rs[i]); cudaFree(fc[i]); cudaFree(fs[i]);
  }
  cudaFree(oc); cudaFree(os); cudaFree(oc2); cudaFree(os2); cudaFree(work); cudaFree(doff); cudaFree(st);
  cudaFree(sb.block_start); cudaFree(sb.block_end); cudaFree(sb.block_offsets);
}

// The FP8 weight quantization of one step (128 x 128 blocks, convert.h quantize_weights /
// quantize_weights_stored), at gpt-oss-20b's expert sizes (32 experts, H = F = 2880 stored,
// 2944 in the layer): the parameters in the layer's layout, and where gpt-oss stores them
// (gate_up_proj [E, H, 2F] interleaved, down_proj [E, F, H]); W for the forward, W^T for the
// backward, and both from one read. Bytes: BF16 read + codes and scales written.
void bench_weights() {
  const int E = 32;
  const int64_t hs = 2880, fs = 2880, h = 2944, f = 2944;
  std::printf("\nweights, gpt-oss-20b experts: %d x [%lld, %lld] and [%lld, %lld] (stored %lld x %lld)\n", E,
              (long long)(2 * f), (long long)h, (long long)h, (long long)f, (long long)hs, (long long)fs);
  const int64_t n1 = int64_t(E) * 2 * f * h, n2 = int64_t(E) * h * f;  // layer-layout elements
  const int64_t s1 = int64_t(E) * hs * 2 * fs, s2 = int64_t(E) * fs * hs;  // stored elements
  std::vector<bf16_t> hw(std::max(n1, s1));
  std::mt19937 rng(7);
  std::normal_distribution<float> nd(0.f, 0.02f);
  for (auto& v : hw) v = num::f32_to_bf16(nd(rng));
  bf16_t* w1 = dalloc<bf16_t>(std::max(n1, s1));
  bf16_t* w2 = dalloc<bf16_t>(std::max(n2, s2));
  CK(cudaMemcpy(w1, hw.data(), std::max(n1, s1) * 2, cudaMemcpyHostToDevice));
  CK(cudaMemcpy(w2, hw.data(), std::max(n2, s2) * 2, cudaMemcpyHostToDevice));
  uint8_t *c = dalloc<uint8_t>(n1), *sc = dalloc<uint8_t>(n1 / 16384 + 1);
  uint8_t *tc = dalloc<uint8_t>(n1), *ts = dalloc<uint8_t>(n1 / 16384 + 1);
  const ExpertStorage st{hs, fs, true};
  const auto out = [](int64_t elems, int copies) { return double(copies) * (elems + elems / 16384.0); };
  std::printf("  %-34s %12s %12s %13s %7s\n", "kernel", "bytes", "time", "bandwidth", "%copy");
  const float d1 = time_us([&](int) { cuda::quantize_weights(w1, E, 2 * f, h, c, sc, nullptr, nullptr, nullptr, 0); });
  const float d1t = time_us([&](int) { cuda::quantize_weights(w1, E, 2 * f, h, nullptr, nullptr, tc, ts, nullptr, 0); });
  const float d1b = time_us([&](int) { cuda::quantize_weights(w1, E, 2 * f, h, c, sc, tc, ts, nullptr, 0); });
  const float d2 = time_us([&](int) { cuda::quantize_weights(w2, E, h, f, c, sc, nullptr, nullptr, nullptr, 0); });
  row("W1 layer layout, W", 2.0 * n1 + out(n1, 1), d1);
  row("W1 layer layout, W^T", 2.0 * n1 + out(n1, 1), d1t);
  row("W1 layer layout, W and W^T", 2.0 * n1 + out(n1, 2), d1b);
  row("W2 layer layout, W", 2.0 * n2 + out(n2, 1), d2);
  const auto stored1 = [&](uint8_t* cc, uint8_t* ss, uint8_t* tt, uint8_t* tts) {
    cuda::quantize_weights_stored(w1, E, hs, 2 * fs, st.w1_rows(f), 2 * f, h, cc, ss, tt, tts, nullptr, 0);
  };
  const auto stored2 = [&](uint8_t* cc, uint8_t* ss, uint8_t* tt, uint8_t* tts) {
    cuda::quantize_weights_stored(w2, E, fs, hs, st.w2_rows(), h, f, cc, ss, tt, tts, nullptr, 0);
  };
  const float g1 = time_us([&](int) { stored1(c, sc, nullptr, nullptr); });
  const float g1t = time_us([&](int) { stored1(nullptr, nullptr, tc, ts); });
  const float g2 = time_us([&](int) { stored2(c, sc, nullptr, nullptr); });
  const float g2t = time_us([&](int) { stored2(nullptr, nullptr, tc, ts); });
  row("gate_up_proj as stored, W (fwd)", 2.0 * s1 + out(n1, 1), g1);
  row("gate_up_proj as stored, W^T (bwd)", 2.0 * s1 + out(n1, 1), g1t);
  row("down_proj as stored, W (fwd)", 2.0 * s2 + out(n2, 1), g2);
  row("down_proj as stored, W^T (bwd)", 2.0 * s2 + out(n2, 1), g2t);
  std::printf("  one step's weight quantization as stored (fwd W + bwd W^T, both weights): %.1f us\n",
              g1 + g1t + g2 + g2t);
  cudaFree(w1); cudaFree(w2); cudaFree(c); cudaFree(sc); cudaFree(tc); cudaFree(ts);
}

}  // namespace

int main(int argc, char** argv) {
  std::string only;
  int64_t tokens = 4096;
  bool weights_only = false;  // only the weight quantization (bench_weights)
  for (int i = 1; i < argc; ++i) {
    if (!std::strcmp(argv[i], "--reps") && i + 1 < argc) g_reps = std::max(3, std::atoi(argv[++i]));
    else if (!std::strcmp(argv[i], "--config") && i + 1 < argc) only = argv[++i];
    else if (!std::strcmp(argv[i], "--tokens") && i + 1 < argc) tokens = std::atoll(argv[++i]);
    else if (!std::strcmp(argv[i], "--weights")) weights_only = true;
    else {
      std::fprintf(stderr, "usage: %s [--reps N] [--config NAME] [--tokens T] [--weights]\n", argv[0]);
      return 2;
    }
  }
  cudaDeviceProp prop;
  if (!bench::device_properties("flowmoe_bench_convert", &prop)) return 1;
  std::printf("device: %s, %d SMs, L2 %d MB\n", prop.name, prop.multiProcessorCount, prop.l2CacheSize >> 20);

  // ceiling: device-to-device copy of 2 GiB, bytes read + written
  g_copy_gbs = bench::copy_ceiling_gbs(size_t(2) << 30, g_reps, 3);
  const Config configs[] = {
      {"DeepSeek-V3 EP8", 7168, 256, 8, 8},   {"DeepSeek-V3 EP8 K=F", 2048, 256, 8, 8},
      {"DeepSeek-V3 EP16", 7168, 256, 8, 16},
      {"DeepSeek-V3 EP32", 7168, 256, 8, 32}, {"DeepSeek-V2 EP8", 5120, 160, 6, 8},
      {"DeepSeek-V2 EP16", 5120, 160, 6, 16}, {"DeepSeek-V2 EP32", 5120, 160, 6, 32},
      {"DeepSeek-V2-Lite EP8", 2048, 64, 6, 8}, {"DeepSeek-V2-Lite EP16", 2048, 64, 6, 16},
      {"DeepSeek-V2-Lite EP32", 2048, 64, 6, 32},
  };
  if (only.empty() || only == "weights") bench_weights();
  if (weights_only) return 0;
  for (const Config& c : configs) {
    if (!only.empty() && only != c.name) continue;
    bench_config(c, tokens);
  }
  return 0;
}
