// Router kernels (flowmoe/token.h): top-k over softmax or sigmoid scores, the load-balancing
// aux loss and the backward to the logits. One warp per token; the arithmetic and every
// reduction order are those of the CPU reference (src/cpu/token_ref.cpp), so results match it
// bit for bit.
#include <climits>

#include "cuda/common.cuh"
#include "cuda/convert/tile.cuh"
#include "flowmoe/token.h"

namespace flowmoe {
namespace cuda {
namespace {

using tok::fma_rn;
using tok::mul_rn;
using tok::canon;

constexpr unsigned kFull = 0xffffffffu;
constexpr int kRouterWarps = 4;  // warps (tokens) per CTA; smem 2 * E floats per warp
constexpr int kAuxThreads = 256;
constexpr int kAuxFinalThreads = 1024;

__device__ __forceinline__ float warp_sum_f(float v) {  // the butterfly of "warp order"
#pragma unroll
  for (int o = 16; o > 0; o >>= 1) v = v + __shfl_xor_sync(kFull, v, o);
  return v;
}
__device__ __forceinline__ float warp_fmax(float v) {
#pragma unroll
  for (int o = 16; o > 0; o >>= 1) v = fmaxf(v, __shfl_xor_sync(kFull, v, o));
  return v;
}

// Scores of one token into sc[E]: softmax p or sigmoid s. Lane l touches e = l, l+32, ...
// only; ends with __syncwarp so any lane may then read any sc[e]. Returns this lane's count of
// non-finite logits.
__device__ int token_scores(const float* __restrict__ z, int E, bool softmax, float* sc, int lane) {
  int nf = 0;
  if (softmax) {
    float m = -INFINITY;
    for (int e = lane; e < E; e += 32) {
      const float v = z[e];
      sc[e] = v;
      nf += !num::f32_is_finite(v);
      m = fmaxf(m, v);
    }
    m = warp_fmax(m);
    float acc = 0.0f;
    for (int e = lane; e < E; e += 32) {
      const float x = tok::exp_f32(sc[e] - m);
      sc[e] = x;
      acc = acc + x;
    }
    acc = warp_sum_f(acc);
    for (int e = lane; e < E; e += 32) sc[e] = sc[e] / acc;
  } else {
    for (int e = lane; e < E; e += 32) {
      const float v = z[e];
      nf += !num::f32_is_finite(v);
      sc[e] = tok::sigmoid_f32(v);
    }
  }
  __syncwarp();
  return nf;
}

__global__ void __launch_bounds__(kRouterWarps * 32)
router_forward_kernel(const float* __restrict__ logits, int64_t T, int E, int k, bool softmax,
                      bool renorm, float scale, const float* __restrict__ bias,
                      int32_t* __restrict__ ids, float* __restrict__ probs,
                      unsigned long long* nonfinite) {
  extern __shared__ float smem[];
  const int warp = threadIdx.x >> 5, lane = threadIdx.x & 31;
  const int64_t t = static_cast<int64_t>(blockIdx.x) * kRouterWarps + warp;
  if (t >= T) return;  // whole warps leave; no CTA-wide barrier below
  float* sc = smem + warp * 2 * E;
  const int nf = token_scores(logits + t * E, E, softmax, sc, lane);
  detail::warp_count(nonfinite, nf);

  uint32_t taken = 0;  // bit i: expert lane + 32 i already chosen
  int my_id = 0;       // lane j < k: the expert of slot j
  for (int j = 0; j < k; ++j) {
    float bv = __uint_as_float(num::kCanonicalNaN);
    int bi = INT_MAX;
    for (int i = 0, e = lane; e < E; ++i, e += 32) {
      if ((taken >> i) & 1u) continue;
      const float v = bias ? sc[e] + bias[e] : sc[e];
      if (tok::better(v, e, bv, bi)) {
        bv = v;
        bi = e;
      }
    }
#pragma unroll
    for (int o = 16; o > 0; o >>= 1) {  // a strict total order: every lane gets the same winner
      const float ov = __shfl_xor_sync(kFull, bv, o);
      const int oi = __shfl_xor_sync(kFull, bi, o);
      if (tok::better(ov, oi, bv, bi)) {
        bv = ov;
        bi = oi;
      }
    }
    if ((bi & 31) == lane) taken |= 1u << (bi >> 5);
    if (lane == j) my_id = bi;
  }
  const float v = lane < k ? sc[my_id] : 0.0f;
  float sum = 0.0f;
  if (renorm)
    for (int j = 0; j < k; ++j) sum = sum + __shfl_sync(kFull, v, j);  // slot order
  if (lane < k) {
    const float q = !renorm ? v : (sum == 0.0f ? 0.0f : v / sum);
    ids[t * k + lane] = my_id;
    probs[t * k + lane] = canon(mul_rn(q, scale));
  }
}

__global__ void __launch_bounds__(kRouterWarps * 32)
router_backward_kernel(const float* __restrict__ logits, int64_t T, int E, int k, bool softmax,
                       bool renorm, float scale, const int32_t* __restrict__ ids,
                       const float* __restrict__ dprobs, const float* __restrict__ aux_coef,
                       float aux_dloss, float* __restrict__ dlogits) {
  extern __shared__ float smem[];
  const int warp = threadIdx.x >> 5, lane = threadIdx.x & 31;
  const int64_t t = static_cast<int64_t>(blockIdx.x) * kRouterWarps + warp;
  if (t >= T) return;
  float* sc = smem + warp * 2 * E;  // p (softmax) or s (sigmoid)
  float* gv = sc + E;               // d(top-k term)/dz
  const float* z = logits + t * E;
  token_scores(z, E, softmax, sc, lane);
  for (int e = lane; e < E; e += 32) gv[e] = 0.0f;

  int id = -1;
  float g = 0.0f, pv = 0.0f, dsv = 0.0f;
  bool valid = false;
  if (lane < k) {
    id = ids[t * k + lane];
    valid = id >= 0 && id < E;
    g = mul_rn(dprobs[t * k + lane], scale);
    if (valid) pv = sc[id];
    if (valid && !softmax) {
      float s;
      tok::sigmoid_and_grad(z[id], &s, &dsv);
    }
  }
  __syncwarp();

  if (softmax && !renorm) {
    float c = 0.0f;
    for (int j = 0; j < k; ++j) {
      const bool vj = __shfl_sync(kFull, valid, j);
      const float gj = __shfl_sync(kFull, g, j), pj = __shfl_sync(kFull, pv, j);
      const int ij = __shfl_sync(kFull, id, j);
      if (vj) c = fma_rn(gj, pj, c);
      if (vj && lane == 0) gv[ij] = gv[ij] + gj;  // slot order, one lane: duplicates add up
      __syncwarp();
    }
    for (int e = lane; e < E; e += 32) gv[e] = mul_rn(sc[e], gv[e] - c);
  } else if (renorm) {
    float sum = 0.0f;
    for (int j = 0; j < k; ++j) {
      const bool vj = __shfl_sync(kFull, valid, j);
      const float pj = __shfl_sync(kFull, pv, j);
      if (vj) sum = sum + pj;
    }
    if (sum != 0.0f) {
      float c = 0.0f;
      for (int j = 0; j < k; ++j) {
        const bool vj = __shfl_sync(kFull, valid, j);
        const float gj = __shfl_sync(kFull, g, j), pj = __shfl_sync(kFull, pv, j);
        if (vj) c = fma_rn(gj, pj / sum, c);
      }
      const float mine = softmax ? mul_rn(pv / sum, g - c) : mul_rn(dsv, g - c) / sum;
      for (int j = 0; j < k; ++j) {
        const bool vj = __shfl_sync(kFull, valid, j);
        const float mj = __shfl_sync(kFull, mine, j);
        const int ij = __shfl_sync(kFull, id, j);
        if (vj && lane == 0) gv[ij] = gv[ij] + mj;
        __syncwarp();
      }
    }
  } else {  // sigmoid, not renormalised
    const float mine = mul_rn(dsv, g);
    for (int j = 0; j < k; ++j) {
      const bool vj = __shfl_sync(kFull, valid, j);
      const float mj = __shfl_sync(kFull, mine, j);
      const int ij = __shfl_sync(kFull, id, j);
      if (vj && lane == 0) gv[ij] = gv[ij] + mj;
      __syncwarp();
    }
  }
  __syncwarp();

  float* dz = dlogits + t * E;
  if (!aux_coef) {
    for (int e = lane; e < E; e += 32) dz[e] = canon(gv[e]);
    return;
  }
  if (softmax) {
    float acc = 0.0f;
    for (int e = lane; e < E; e += 32) acc = fma_rn(mul_rn(aux_coef[e], aux_dloss), sc[e], acc);
    const float c2 = warp_sum_f(acc);
    for (int e = lane; e < E; e += 32) dz[e] = canon(gv[e] + mul_rn(sc[e], mul_rn(aux_coef[e], aux_dloss) - c2));
  } else {
    float sall = 0.0f;
    for (int e = lane; e < E; e += 32) sall = sall + sc[e];
    sall = warp_sum_f(sall);
    float acc = 0.0f;
    for (int e = lane; e < E; e += 32) {
      const float pa = sall == 0.0f ? 0.0f : sc[e] / sall;
      acc = fma_rn(mul_rn(aux_coef[e], aux_dloss), pa, acc);
    }
    const float c2 = warp_sum_f(acc);
    for (int e = lane; e < E; e += 32) {
      float s, ds;
      tok::sigmoid_and_grad(z[e], &s, &ds);
      const float a = mul_rn(aux_coef[e], aux_dloss);
      dz[e] = canon(gv[e] + (sall == 0.0f ? 0.0f : mul_rn(ds, a - c2) / sall));
    }
  }
}

// Aux loss, pass 1: one CTA per kAuxChunk tokens. partial[c][e] = sum over the chunk's tokens (in
// order) of P_{t,e}; hist[c][e] = pairs of the chunk routed to e.
__global__ void __launch_bounds__(kAuxThreads)
aux_partial_kernel(const float* __restrict__ logits, const int32_t* __restrict__ ids, int64_t T,
                   int E, int k, bool softmax, float* __restrict__ partial,
                   int32_t* __restrict__ hist) {
  __shared__ float s_max[kAuxChunk], s_sum[kAuxChunk];
  extern __shared__ int s_hist[];
  const int warp = threadIdx.x >> 5, lane = threadIdx.x & 31;
  const int64_t t0 = static_cast<int64_t>(blockIdx.x) * kAuxChunk;
  const int n = static_cast<int>(min(static_cast<int64_t>(kAuxChunk), T - t0));
  for (int e = threadIdx.x; e < E; e += kAuxThreads) s_hist[e] = 0;
  for (int tt = warp; tt < n; tt += kAuxThreads / 32) {
    const float* z = logits + (t0 + tt) * E;
    float acc = 0.0f;
    if (softmax) {
      float m = -INFINITY;
      for (int e = lane; e < E; e += 32) m = fmaxf(m, z[e]);
      m = warp_fmax(m);
      for (int e = lane; e < E; e += 32) acc = acc + tok::exp_f32(z[e] - m);
      if (lane == 0) s_max[tt] = m;
    } else {
      for (int e = lane; e < E; e += 32) acc = acc + tok::sigmoid_f32(z[e]);
    }
    acc = warp_sum_f(acc);
    if (lane == 0) s_sum[tt] = acc;
  }
  __syncthreads();
  for (int i = threadIdx.x; i < n * k; i += kAuxThreads) {
    const int id = ids[t0 * k + i];
    if (id >= 0 && id < E) atomicAdd(&s_hist[id], 1);
  }
  for (int e = threadIdx.x; e < E; e += kAuxThreads) {
    float acc = 0.0f;
    for (int tt = 0; tt < n; ++tt) {
      const float zv = logits[(t0 + tt) * E + e];
      float p;
      if (softmax) {
        p = tok::exp_f32(zv - s_max[tt]) / s_sum[tt];
      } else {
        p = s_sum[tt] == 0.0f ? 0.0f : tok::sigmoid_f32(zv) / s_sum[tt];
      }
      acc = acc + p;
    }
    partial[static_cast<int64_t>(blockIdx.x) * E + e] = acc;
  }
  __syncthreads();
  for (int e = threadIdx.x; e < E; e += kAuxThreads) hist[static_cast<int64_t>(blockIdx.x) * E + e] = s_hist[e];
}

// Aux loss, pass 2 (one CTA): chunk sums in order, f_e, P_e, aux_coef, and the loss.
__global__ void __launch_bounds__(kAuxFinalThreads)
aux_final_kernel(const float* __restrict__ partial, const int32_t* __restrict__ hist,
                 int64_t nchunks, int64_t T, int E, int k, float alpha, float* __restrict__ loss,
                 float* __restrict__ aux_coef) {
  __shared__ float s_f[kRouterMaxExperts], s_p[kRouterMaxExperts];
  const float ae = mul_rn(alpha, static_cast<float>(E));
  const float tf = static_cast<float>(T), tk = static_cast<float>(T * k);
  for (int e = threadIdx.x; e < E; e += kAuxFinalThreads) {
    float sp = 0.0f;
    int64_t cnt = 0;
#pragma unroll 8
    for (int64_t c = 0; c < nchunks; ++c) {
      sp = sp + partial[c * E + e];
      cnt += hist[c * E + e];
    }
    const float f = static_cast<float>(cnt) / tk;
    s_f[e] = f;
    s_p[e] = sp / tf;
    aux_coef[e] = canon(mul_rn(ae, f) / tf);
  }
  __syncthreads();
  if (threadIdx.x < 32) {
    float acc = 0.0f;
    for (int e = threadIdx.x; e < E; e += 32) acc = fma_rn(s_f[e], s_p[e], acc);
    acc = warp_sum_f(acc);
    if (threadIdx.x == 0) *loss = canon(mul_rn(ae, acc));
  }
}

void check_router_args(const RouterConfig& cfg, int64_t tokens, const char* what) {
  validate_router(cfg, what);
  FLOWMOE_CHECK(tokens >= 0 && tokens <= INT32_MAX,
                what << ": T = " << tokens << " tokens out of range; expected 0 <= T < 2^31");
}
void check_dev(const void* p, const char* name, const char* what) {
  FLOWMOE_CHECK(p != nullptr, what << ": " << name << " is null; expected a device buffer");
}
unsigned router_grid(int64_t tokens) {
  return static_cast<unsigned>((tokens + kRouterWarps - 1) / kRouterWarps);
}
size_t router_smem(int E) { return static_cast<size_t>(kRouterWarps) * 2 * E * sizeof(float); }
int64_t aux_chunks(int64_t tokens) { return (tokens + kAuxChunk - 1) / kAuxChunk; }

}  // namespace

void router_forward(const float* logits, int64_t tokens, const RouterConfig& cfg,
                    const float* bias, int32_t* ids, float* probs, DeviceStatus* status,
                    cudaStream_t stream) {
  const char* what = "router_forward";
  check_router_args(cfg, tokens, what);
  if (tokens == 0) return;
  check_dev(logits, "logits", what);
  check_dev(ids, "ids", what);
  check_dev(probs, "probs", what);
  router_forward_kernel<<<router_grid(tokens), kRouterWarps * 32, router_smem(cfg.num_experts), stream>>>(
      logits, tokens, cfg.num_experts, cfg.topk, cfg.score == RouterScore::kSoftmax, cfg.renormalize,
      cfg.scale, bias, ids, probs, status ? &status->nonfinite : nullptr);
  FLOWMOE_LAUNCH_CHECK("router_forward_kernel");
}

size_t router_aux_workspace_bytes(int64_t tokens, int num_experts) {
  const size_t n = static_cast<size_t>(aux_chunks(tokens)) * static_cast<size_t>(num_experts);
  return ((n * sizeof(float) + 15) / 16) * 16 + n * sizeof(int32_t);
}

void router_aux_loss(const float* logits, const int32_t* ids, int64_t tokens,
                     const RouterConfig& cfg, float alpha, float* loss, float* aux_coef,
                     void* workspace, cudaStream_t stream) {
  const char* what = "router_aux_loss";
  check_router_args(cfg, tokens, what);
  FLOWMOE_CHECK(tokens >= 1, what << ": T = 0 tokens; the aux loss is a mean over tokens, expected T >= 1");
  check_dev(logits, "logits", what);
  check_dev(ids, "ids", what);
  check_dev(loss, "loss", what);
  check_dev(aux_coef, "aux_coef", what);
  detail::host::check_aligned(workspace, "workspace", what);
  const int E = cfg.num_experts;
  const int64_t nchunks = aux_chunks(tokens);
  const size_t n = static_cast<size_t>(nchunks) * E;
  float* partial = static_cast<float*>(workspace);
  int32_t* hist = reinterpret_cast<int32_t*>(static_cast<char*>(workspace) + ((n * sizeof(float) + 15) / 16) * 16);
  aux_partial_kernel<<<static_cast<unsigned>(nchunks), kAuxThreads, E * sizeof(int), stream>>>(
      logits, ids, tokens, E, cfg.topk, cfg.score == RouterScore::kSoftmax, partial, hist);
  FLOWMOE_LAUNCH_CHECK("aux_partial_kernel");
  aux_final_kernel<<<1, kAuxFinalThreads, 0, stream>>>(partial, hist, nchunks, tokens, E, cfg.topk,
                                                       alpha, loss, aux_coef);
  FLOWMOE_LAUNCH_CHECK("aux_final_kernel");
}

void router_backward(const float* logits, int64_t tokens, const RouterConfig& cfg,
                     const int32_t* ids, const float* dprobs, const float* aux_coef,
                     float aux_dloss, float* dlogits, cudaStream_t stream) {
  const char* what = "router_backward";
  check_router_args(cfg, tokens, what);
  if (tokens == 0) return;
  check_dev(logits, "logits", what);
  check_dev(ids, "ids", what);
  check_dev(dprobs, "dprobs", what);
  check_dev(dlogits, "dlogits", what);
  router_backward_kernel<<<router_grid(tokens), kRouterWarps * 32, router_smem(cfg.num_experts), stream>>>(
      logits, tokens, cfg.num_experts, cfg.topk, cfg.score == RouterScore::kSoftmax, cfg.renormalize,
      cfg.scale, ids, dprobs, aux_coef, aux_dloss, dlogits);
  FLOWMOE_LAUNCH_CHECK("router_backward_kernel");
}

}  // namespace cuda
}  // namespace flowmoe
