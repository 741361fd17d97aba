// Token-movement benchmark: fused permute+pad (BF16, FP8 + scales, MXFP4 + scales) and fused
// unpermute+unpad (+ backward) next to the unfused sequences, with the device-to-device copy
// bandwidth measured in the same run; the router and the routing metadata. Medians of CUDA-event
// timings after warm-up, random data; inputs alternate between two copies so that L2 never holds
// them from the previous repetition.
//
//   flowmoe_bench_token [--reps N] [--config NAME] [--tokens T] [--align A]
//
// Bytes counted per kernel ("useful" traffic): permute+pad reads the T input rows once and writes
// Mp padded rows; unpermute+unpad reads the routed rows (T*k minus dropped) and writes T rows; the
// backward reads dy (T rows) and the routed rows and writes Mp rows. Index tables are not counted.
// Columns: %copy = bandwidth / the 2 GiB copy's; %size = bandwidth / the best copy of the same
// bytes in one launch (cudaMemcpyAsync or a plain copy kernel; copy_gbs_at).
#include <cuda_runtime.h>

#include <algorithm>
#include <cmath>
#include <cstdio>
#include <cstring>
#include <functional>
#include <map>
#include <numeric>
#include <random>
#include <string>
#include <vector>

#include "flowmoe/numerics.h"
#include "flowmoe/token.h"

#include "bench_util.cuh"

using namespace flowmoe;


namespace {

int g_reps = 30;
double g_copy_gbs = 0;

using bench::dalloc;

// median time in microseconds of fn(rep), after 3 warm-up calls
float time_us(const std::function<void(int)>& fn) { return bench::median_us(fn, g_reps, 3); }

// A plain copy kernel: 4 x 16 B per thread, one pass (the same-size ceiling's second candidate).
__global__ void copy16_kernel(const uint4* __restrict__ src, uint4* __restrict__ dst, int64_t n) {
  const int64_t i0 = (static_cast<int64_t>(blockIdx.x) * blockDim.x) * 4 + threadIdx.x;
  uint4 v[4];
#pragma unroll
  for (int u = 0; u < 4; ++u)
    if (i0 + u * blockDim.x < n) v[u] = src[i0 + u * blockDim.x];
#pragma unroll
  for (int u = 0; u < 4; ++u)
    if (i0 + u * blockDim.x < n) dst[i0 + u * blockDim.x] = v[u];
}

// Copy ceiling at a kernel's own size: the faster of cudaMemcpyAsync D2D and copy16_kernel moving
// bytes / 2 (read + write = bytes), rotating over source/destination pairs that together exceed
// twice the L2, so that, as for the kernels, no source is still in L2. A 2 GiB copy reaches a
// bandwidth that one launch moving tens of MB cannot (launch, ramp-up and tail are a larger
// share), so small kernels are also compared with a copy of their own size, measured in the same
// run. Cached per size.
double copy_gbs_at(double bytes) {
  static std::map<int64_t, double> cache;
  const int64_t half = static_cast<int64_t>(bytes / 2) / 256 * 256;
  if (half <= 0) return g_copy_gbs;
  auto it = cache.find(half);
  if (it != cache.end()) return it->second;
  int dev = 0, l2 = 0;
  cudaGetDevice(&dev);
  cudaDeviceGetAttribute(&l2, cudaDevAttrL2CacheSize, dev);
  const int pairs = static_cast<int>(std::min<int64_t>(64, std::max<int64_t>(2, 2 * int64_t(l2) / half + 2)));
  std::vector<char*> src(pairs), dst(pairs);
  for (int i = 0; i < pairs; ++i) {
    src[i] = dalloc<char>(half);
    dst[i] = dalloc<char>(half);
    CK(cudaMemset(src[i], 1, half));
  }
  const float us_memcpy =
      time_us([&](int i) { CK(cudaMemcpyAsync(dst[i % pairs], src[i % pairs], half, cudaMemcpyDeviceToDevice)); });
  const int64_t n16 = half / 16;
  const unsigned blocks = static_cast<unsigned>((n16 + 1023) / 1024);
  const float us_kernel = time_us([&](int i) {
    copy16_kernel<<<blocks, 256>>>(reinterpret_cast<const uint4*>(src[i % pairs]), reinterpret_cast<uint4*>(dst[i % pairs]), n16);
  });
  const float us = std::min(us_memcpy, us_kernel);
  for (int i = 0; i < pairs; ++i) {
    cudaFree(src[i]);
    cudaFree(dst[i]);
  }
  return cache[half] = 2.0 * half / (us * 1e3);
}

void row(const char* kernel, double bytes, float us, const char* base = nullptr, float base_us = 0) {
  const double gbs = bench::gb_per_s(bytes, us);
  std::printf("  %-36s %9.1f MB %9.1f us %7.0f GB/s %6.1f%% %6.1f%%", kernel, bytes / 1e6, us, gbs, bench::percent_of(gbs, g_copy_gbs),
              bench::percent_of(gbs, copy_gbs_at(bytes)));
  if (base) std::printf("   %-44s %9.1f us  x%.2f", base, base_us, base_us / us);
  std::printf("\n");
}

// ---- Megatron-style unpermute baseline (bench only): rows x prob, atomic scatter-add in FP32,
// cast. Non-deterministic (atomics); timing reference only.
__global__ void scale_rows_kernel(const bf16_t* __restrict__ in, const float* __restrict__ row_prob, int64_t rows,
                                  int64_t h, bf16_t* __restrict__ out) {
  const int64_t n = rows * h;
  for (int64_t i = (blockIdx.x * static_cast<int64_t>(blockDim.x) + threadIdx.x) * 8; i < n;
       i += static_cast<int64_t>(gridDim.x) * blockDim.x * 8) {
    const float p = row_prob[i / h];
    const uint4 v = *reinterpret_cast<const uint4*>(in + i);
    uint32_t w[4] = {v.x, v.y, v.z, v.w};
    for (int j = 0; j < 4; ++j) {
      const float lo = __uint_as_float(w[j] << 16) * p, hi = __uint_as_float(w[j] & 0xFFFF0000u) * p;
      w[j] = num::f32_to_bf16(lo) | (static_cast<uint32_t>(num::f32_to_bf16(hi)) << 16);
    }
    *reinterpret_cast<uint4*>(out + i) = make_uint4(w[0], w[1], w[2], w[3]);
  }
}
__global__ void scatter_add_kernel(const bf16_t* __restrict__ in, const int32_t* __restrict__ row_token, int64_t rows,
                                   int64_t h, float* __restrict__ acc) {
  const int64_t n = rows * h;
  for (int64_t i = (blockIdx.x * static_cast<int64_t>(blockDim.x) + threadIdx.x) * 2; i < n;
       i += static_cast<int64_t>(gridDim.x) * blockDim.x * 2) {
    const int64_t r = i / h, c = i % h;
    const uint32_t w = *reinterpret_cast<const uint32_t*>(in + i);
    float* dst = acc + static_cast<int64_t>(row_token[r]) * h + c;
    atomicAdd(dst, __uint_as_float(w << 16));
    atomicAdd(dst + 1, __uint_as_float(w & 0xFFFF0000u));
  }
}
__global__ void cast_kernel(const float* __restrict__ in, int64_t n, bf16_t* __restrict__ out) {
  for (int64_t i = blockIdx.x * static_cast<int64_t>(blockDim.x) + threadIdx.x; i < n;
       i += static_cast<int64_t>(gridDim.x) * blockDim.x)
    out[i] = num::f32_to_bf16(in[i]);
}
unsigned elementwise_grid() {
  int sms = 0;
  CK(cudaDeviceGetAttribute(&sms, cudaDevAttrMultiProcessorCount, 0));
  return static_cast<unsigned>(sms * 8);
}

struct Config {
  const char* name;
  int hidden;
  int router_experts;  // E seen by the router (all experts)
  RouterScore score;
  bool renorm;
  float scale;
  int local_experts;   // E of the routing metadata and the movers
  int topk;
};

std::vector<int32_t> random_ids(int64_t t, int k, int e, uint32_t seed) {
  std::mt19937 rng(seed);
  std::vector<int32_t> ids(t * k), pool(e);
  for (int64_t i = 0; i < t; ++i) {
    std::iota(pool.begin(), pool.end(), 0);
    for (int j = 0; j < k; ++j) {
      std::swap(pool[j], pool[j + rng() % (e - j)]);
      ids[i * k + j] = pool[j];
    }
  }
  return ids;
}

void bench_router(const Config& c, int64_t T) {
  RouterConfig cfg;
  cfg.num_experts = c.router_experts;
  cfg.topk = c.topk;
  cfg.score = c.score;
  cfg.renormalize = c.renorm;
  cfg.scale = c.scale;
  const int E = c.router_experts, k = c.topk;
  std::vector<float> hz(T * E), hb(E);
  std::mt19937 rng(1);
  for (auto& v : hz) v = std::normal_distribution<float>(0.f, 1.f)(rng);
  for (auto& v : hb) v = std::normal_distribution<float>(0.f, 0.01f)(rng);
  float* z = dalloc<float>(T * E);
  float* dz = dalloc<float>(T * E);
  float* bias = dalloc<float>(E);
  float* probs = dalloc<float>(T * k);
  float* dprobs = dalloc<float>(T * k);
  float* coef = dalloc<float>(E);
  float* loss = dalloc<float>(1);
  int32_t* ids = dalloc<int32_t>(T * k);
  void* ws = dalloc<uint8_t>(cuda::router_aux_workspace_bytes(T, E));
  cuda::DeviceStatus* st = dalloc<cuda::DeviceStatus>(1);
  CK(cudaMemcpy(z, hz.data(), T * E * 4, cudaMemcpyHostToDevice));
  CK(cudaMemcpy(bias, hb.data(), E * 4, cudaMemcpyHostToDevice));
  CK(cudaMemset(dprobs, 0, T * k * 4));
  CK(cudaMemset(st, 0, sizeof(*st)));
  const bool use_bias = c.score == RouterScore::kSigmoid;
  const float t_fwd = time_us([&](int) { cuda::router_forward(z, T, cfg, use_bias ? bias : nullptr, ids, probs, st, 0); });
  const float t_aux = time_us([&](int) { cuda::router_aux_loss(z, ids, T, cfg, 1e-3f, loss, coef, ws, 0); });
  const float t_bwd = time_us([&](int) { cuda::router_backward(z, T, cfg, ids, dprobs, coef, 1.0f, dz, 0); });
  std::printf("  router %s%s top-%d of %d: forward %.1f us, aux loss %.1f us, backward (+aux) %.1f us  (logits %.1f MB)\n",
              c.score == RouterScore::kSoftmax ? "softmax" : "sigmoid", c.renorm ? "+renorm" : "", k, E, t_fwd, t_aux,
              t_bwd, T * E * 4 / 1e6);
  cudaFree(z); cudaFree(dz); cudaFree(bias); cudaFree(probs); cudaFree(dprobs); cudaFree(coef); cudaFree(loss);
  cudaFree(ids); cudaFree(ws); cudaFree(st);
}

void bench_movers(const Config& c, int64_t T, int align) {
  const int E = c.local_experts, k = c.topk;
  const int64_t H = c.hidden, TK = T * k;
  const auto hids = random_ids(T, k, E, 7);
  cuda::Routing r;
  r.tokens = T;
  r.topk = k;
  r.num_experts = E;
  r.align = align;
  int32_t* ids = dalloc<int32_t>(TK);
  r.counts = dalloc<int32_t>(E);
  r.offsets = dalloc<int32_t>(E + 1);
  r.padded_offsets = dalloc<int32_t>(E + 1);
  r.row_map = dalloc<int32_t>(TK);
  r.row_map_unpadded = dalloc<int32_t>(TK);
  r.workspace = dalloc<uint8_t>(cuda::routing_workspace_bytes(T, k, E));
  CK(cudaMemcpy(ids, hids.data(), TK * 4, cudaMemcpyHostToDevice));
  cuda::build_routing(ids, r, nullptr, 0);
  std::vector<int32_t> counts(E);
  const int64_t Mp = cuda::fetch_routing_counts(r, counts.data(), 0);
  const int64_t R = r.max_rows();
  const int64_t routed = std::accumulate(counts.begin(), counts.end(), int64_t{0});
  std::printf("\n%s, A = %d: T %lld, H %lld, %d local experts, top-%d -> %lld routed rows, Mp = %lld padded (R = %lld)\n",
              c.name, align, (long long)T, (long long)H, E, k, (long long)routed, (long long)Mp, (long long)R);
  const float t_meta = time_us([&](int) { cuda::build_routing(ids, r, nullptr, 0); });

  // inputs (two copies each)
  std::mt19937 rng(3);
  std::vector<bf16_t> hx(T * H);
  for (auto& v : hx) v = num::f32_to_bf16(std::normal_distribution<float>(0.f, 1.f)(rng));
  std::vector<uint8_t> hbytes(T * H);
  for (auto& v : hbytes) v = static_cast<uint8_t>(rng() & 0x77);
  bf16_t* x[2];
  uint8_t *c8[2], *s8[2], *c4[2], *s4[2];
  for (int i = 0; i < 2; ++i) {
    x[i] = dalloc<bf16_t>(T * H);
    c8[i] = dalloc<uint8_t>(T * H);
    s8[i] = dalloc<uint8_t>(T * H / 128);
    c4[i] = dalloc<uint8_t>(T * H / 2);
    s4[i] = dalloc<uint8_t>(T * H / 32);
    CK(cudaMemcpy(x[i], hx.data(), T * H * 2, cudaMemcpyHostToDevice));
    CK(cudaMemcpy(c8[i], hbytes.data(), T * H, cudaMemcpyHostToDevice));
    CK(cudaMemcpy(s8[i], hbytes.data(), T * H / 128, cudaMemcpyHostToDevice));
    CK(cudaMemcpy(c4[i], hbytes.data(), T * H / 2, cudaMemcpyHostToDevice));
    CK(cudaMemcpy(s4[i], hbytes.data(), T * H / 32, cudaMemcpyHostToDevice));
  }
  // outputs and intermediates
  bf16_t* out = dalloc<bf16_t>(R * H);       // padded rows (also the permuted codes of FP8/FP4)
  bf16_t* compact = dalloc<bf16_t>(TK * H);  // unpadded rows
  uint8_t* os = dalloc<uint8_t>(R * H / 32);
  uint8_t* cs = dalloc<uint8_t>(TK * H / 32);
  auto* ob = reinterpret_cast<uint8_t*>(out);
  auto* cb = reinterpret_cast<uint8_t*>(compact);

  const double rd_x = T * H * 2.0, wr_p = Mp * H * 2.0;
  const double fp8_row = H + H / 128.0, fp4_row = H / 2.0 + H / 32.0;
  const float t_pb = time_us([&](int i) { cuda::permute_pad_bf16(x[i & 1], H, r, out, 0); });
  const float t_pb_u = time_us([&](int i) {
    cuda::permute_bf16(x[i & 1], H, r, compact, 0);
    cuda::pad_bf16(compact, H, r, out, 0);
  });
  const float t_p8 = time_us([&](int i) { cuda::permute_pad_fp8(c8[i & 1], s8[i & 1], H, r, ob, os, R, 0); });
  // the same with the inverse row map (what the MoE layer uses): coalesced scale gather
  cuda::Routing r_src = r;
  r_src.row_src = dalloc<int32_t>(R);
  cuda::build_routing(ids, r_src, nullptr, 0);
  const float t_p8g = time_us([&](int i) { cuda::permute_pad_fp8(c8[i & 1], s8[i & 1], H, r_src, ob, os, R, 0); });
  const float t_p8_u = time_us([&](int i) {
    cuda::permute_fp8(c8[i & 1], s8[i & 1], H, r, cb, cs, TK, 0);
    cuda::pad_fp8(cb, cs, TK, H, r, ob, os, R, 0);
  });
  const float t_p4 = time_us([&](int i) { cuda::permute_pad_mxfp4(c4[i & 1], s4[i & 1], H, r, ob, os, 0); });
  const float t_p4_u = time_us([&](int i) {
    cuda::permute_mxfp4(c4[i & 1], s4[i & 1], H, r, cb, cs, 0);
    cuda::pad_mxfp4(cb, cs, H, r, ob, os, 0);
  });

  // unpermute: expert outputs Y (padded, two copies), probs
  bf16_t* yr[2] = {dalloc<bf16_t>(R * H), dalloc<bf16_t>(R * H)};
  for (int i = 0; i < 2; ++i) cuda::permute_pad_bf16(x[i], H, r, yr[i], 0);
  std::vector<float> hp(TK);
  for (auto& p : hp) p = std::uniform_real_distribution<float>(0.f, 1.f)(rng);
  float* probs = dalloc<float>(TK);
  float* dprobs = dalloc<float>(TK);
  CK(cudaMemcpy(probs, hp.data(), TK * 4, cudaMemcpyHostToDevice));
  bf16_t* y = dalloc<bf16_t>(T * H);
  const float t_un = time_us([&](int i) { cuda::unpermute_unpad(yr[i & 1], probs, H, r, y, 0); });
  const float t_un_u = time_us([&](int i) {
    cuda::unpad_bf16(yr[i & 1], H, r, compact, 0);
    cuda::unpermute(compact, probs, H, r, y, 0);
  });
  // Megatron-style: unpad, rows x prob, zero + atomic scatter-add (FP32), cast
  std::vector<int32_t> hmap(TK);
  CK(cudaMemcpy(hmap.data(), r.row_map_unpadded, TK * 4, cudaMemcpyDeviceToHost));
  std::vector<int32_t> row_token(std::max<int64_t>(routed, 1));
  std::vector<float> row_prob(std::max<int64_t>(routed, 1));
  for (int64_t i = 0; i < TK; ++i)
    if (hmap[i] >= 0) {
      row_token[hmap[i]] = static_cast<int32_t>(i / k);
      row_prob[hmap[i]] = hp[i];
    }
  int32_t* d_row_token = dalloc<int32_t>(row_token.size());
  float* d_row_prob = dalloc<float>(row_prob.size());
  float* acc32 = dalloc<float>(T * H);
  bf16_t* scaled = dalloc<bf16_t>(TK * H);
  CK(cudaMemcpy(d_row_token, row_token.data(), row_token.size() * 4, cudaMemcpyHostToDevice));
  CK(cudaMemcpy(d_row_prob, row_prob.data(), row_prob.size() * 4, cudaMemcpyHostToDevice));
  const unsigned eg = elementwise_grid();
  const float t_un_m = time_us([&](int i) {
    cuda::unpad_bf16(yr[i & 1], H, r, compact, 0);
    scale_rows_kernel<<<eg, 256>>>(compact, d_row_prob, routed, H, scaled);
    CK(cudaMemsetAsync(acc32, 0, T * H * 4));
    scatter_add_kernel<<<eg, 256>>>(scaled, d_row_token, routed, H, acc32);
    cast_kernel<<<eg, 256>>>(acc32, T * H, y);
  });
  // backward
  bf16_t* dy[2] = {x[0], x[1]};  // any BF16 [T, H]
  const float t_bw = time_us([&](int i) { cuda::unpermute_unpad_backward(dy[i & 1], yr[i & 1], probs, H, r, out, dprobs, 0); });
  cuda::unpad_bf16(yr[0], H, r, scaled, 0);  // compact Y, as the unfused forward would have kept it
  const float t_bw_u = time_us([&](int i) {
    cuda::unpermute_backward(dy[i & 1], scaled, probs, H, r, compact, dprobs, 0);
    cuda::pad_bf16(compact, H, r, out, 0);
  });

  std::printf("  %-36s %12s %12s %12s %7s %7s   %-44s %12s  %s\n", "kernel", "bytes", "time", "bandwidth", "%copy",
              "%size", "baseline (same run)", "time", "speed-up");
  row("permute+pad BF16", rd_x + wr_p, t_pb, "permute, then pad (2 kernels)", t_pb_u);
  row("permute+pad FP8 + 1x128 scales", T * fp8_row + Mp * fp8_row, t_p8, "permute, then pad (2 kernels)", t_p8_u);
  row("permute+pad FP8, scales via row_src", T * fp8_row + Mp * fp8_row, t_p8g, "permute, then pad (2 kernels)", t_p8_u);
  row("permute+pad MXFP4 + 1x32 scales", T * fp4_row + Mp * fp4_row, t_p4, "permute, then pad (2 kernels)", t_p4_u);
  row("unpermute+unpad (x prob, FP32 sum)", routed * H * 2.0 + T * H * 2.0, t_un, "unpad, then unpermute (2 kernels)", t_un_u);
  row("", routed * H * 2.0 + T * H * 2.0, t_un, "unpad, x prob, atomic scatter-add, cast (5)", t_un_m);
  row("unpermute+unpad backward", T * H * 2.0 + routed * H * 2.0 + wr_p, t_bw, "unpermute bwd (compact), then pad (2)", t_bw_u);
  std::printf("  %-36s %22.1f us (once per layer pass)\n", "build_routing (2 kernels)", t_meta);

  for (int i = 0; i < 2; ++i) {
    cudaFree(x[i]); cudaFree(c8[i]); cudaFree(s8[i]); cudaFree(c4[i]); cudaFree(s4[i]); cudaFree(yr[i]);
  }
  cudaFree(out); cudaFree(compact); cudaFree(os); cudaFree(cs); cudaFree(probs); cudaFree(dprobs); cudaFree(y);
  cudaFree(d_row_token); cudaFree(d_row_prob); cudaFree(acc32); cudaFree(scaled); cudaFree(ids);
  cudaFree(r.counts); cudaFree(r.offsets); cudaFree(r.padded_offsets); cudaFree(r.row_map);
  cudaFree(r.row_map_unpadded); cudaFree(r.workspace);
}

}  // namespace

int main(int argc, char** argv) {
  std::string only;
  int64_t tokens = 4096;
  int only_align = 0;
  for (int i = 1; i < argc; ++i) {
    if (!std::strcmp(argv[i], "--reps") && i + 1 < argc) g_reps = std::max(3, std::atoi(argv[++i]));
    else if (!std::strcmp(argv[i], "--config") && i + 1 < argc) only = argv[++i];
    else if (!std::strcmp(argv[i], "--tokens") && i + 1 < argc) tokens = std::atoll(argv[++i]);
    else if (!std::strcmp(argv[i], "--align") && i + 1 < argc) only_align = std::atoi(argv[++i]);
    else {
      std::fprintf(stderr, "usage: %s [--reps N] [--config NAME] [--tokens T] [--align A]\n", argv[0]);
      return 2;
    }
  }
  cudaDeviceProp prop;
  if (!bench::device_properties("flowmoe_bench_token", &prop)) return 1;
  std::printf("device: %s, %d SMs, L2 %d MB; %d reps (median)\n", prop.name, prop.multiProcessorCount,
              prop.l2CacheSize >> 20, g_reps);
  // ceiling: device-to-device copy of 2 GiB, bytes read + written
  g_copy_gbs = bench::copy_ceiling_gbs(size_t(2) << 30, g_reps, 3);
  const Config configs[] = {
      // DeepSeek-V3: 256 routed experts, sigmoid + renormalise, x2.5; EP8 -> 32 local experts
      {"DeepSeek-V3", 7168, 256, RouterScore::kSigmoid, true, 2.5f, 32, 8},
      // DeepSeek-V2: 160 experts, softmax top-6; EP8 -> 20 local experts
      {"DeepSeek-V2", 5120, 160, RouterScore::kSoftmax, false, 1.0f, 20, 6},
      // DeepSeek-V2-Lite: 64 experts, softmax top-6, all local
      {"DeepSeek-V2-Lite", 2048, 64, RouterScore::kSoftmax, false, 1.0f, 64, 6},
  };
  for (const Config& c : configs) {
    if (!only.empty() && only != c.name) continue;
    std::printf("\n=== %s (T = %lld tokens per GPU)\n", c.name, (long long)tokens);
    bench_router(c, tokens);
    for (int a : {16, 32, 128}) {
      if (only_align && a != only_align) continue;
      bench_movers(c, tokens, a);
    }
  }
  return 0;
}
