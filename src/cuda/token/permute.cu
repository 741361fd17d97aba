// Fused permute+pad and unpermute+unpad (flowmoe/token.h), and the unfused building blocks of
// the baselines. Row movers are byte-exact; the reductions use the CPU reference's order
// (src/cpu/token_ref.cpp), so every result equals it bit for bit.
//
// permute+pad is a scatter: one warp per (source token, 2 KB chunk of a row part) loads the chunk
// once and stores it to the rows of the token's k slots; extra warps zero the padding rows
// (slot p of the E * (A-1) possible padding rows: expert p / (A-1), row
// padded_offsets[e] + counts[e] + p % (A-1), if still inside the padded segment). The FP8 scale
// grid [H/128][ld] is one more "chunk" per token. Every destination row in [0, Mp) is written
// exactly once, so nothing needs to be cleared beforehand.
#include <algorithm>
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
constexpr int kThreads = 256;
constexpr int kWarps = kThreads / 32;
constexpr int64_t kChunkBytes = 2048;  // one warp moves up to 2 KB of a row part
constexpr int kUnroll = 4;             // vectors per lane in flight (16 B x 4 x 32 = 2 KB)
constexpr int kUnpermVec = 2;          // unpermute: 8-element vectors per lane per chunk
constexpr int kSlotBatch = 4;          // unpermute: slots loaded together
constexpr int kBwdBatch = 8;           // unpermute backward: slots per pass over the row

struct Part {  // one row-contiguous payload: row i at src + i * row_bytes
  const uint8_t* src = nullptr;
  uint8_t* dst = nullptr;
  int64_t row_bytes = 0;
  int vec = 16;    // access width: the largest power of two <= 16 that divides row_bytes
  int chunks = 0;  // ceil(row_bytes / kChunkBytes)
};
struct ColScales {  // FP8 scale grid: byte (column c, row i) at base[c * ld + i]
  const uint8_t* src = nullptr;
  int64_t src_ld = 0;
  uint8_t* dst = nullptr;
  int64_t dst_ld = 0;
  int ncols = 0;
};
struct PadRows {  // padding rows of the padded segments
  const int32_t* counts = nullptr;
  const int32_t* padded_offsets = nullptr;
  int per_expert = 0;  // A - 1 (0: no padding work)
};
struct ScatterArgs {
  Part part[2];
  int nparts = 0;
  ColScales col;
  const int32_t* row_map = nullptr;  // [T, k]
  int64_t tokens = 0;
  int k = 0;
  PadRows pad;
  int64_t items = 0;  // T + E * per_expert
};
struct GatherArgs {
  Part part[2];
  int nparts = 0;
  ColScales col;
  bool to_padded = true;  // true: compact -> padded (pad); false: padded -> compact (unpad)
  const int32_t* counts = nullptr;
  const int32_t* offsets = nullptr;
  const int32_t* padded_offsets = nullptr;
  int E = 0;
  int64_t items = 0;  // destination row capacity
};

template <typename V>
__device__ __forceinline__ V ld(const uint8_t* p) {
  return *reinterpret_cast<const V*>(p);
}
template <typename V>
__device__ __forceinline__ void st(uint8_t* p, const V& v) {
  *reinterpret_cast<V*>(p) = v;
}

// Moves bytes [off, off + 2 KB) of row src_row of a part to the destination rows held by lanes
// 0..k-1 (my_row, -1: none); with src_row < 0 it zeroes that range of row zero_row instead.
template <typename V>
__device__ __forceinline__ void move_chunk_v(const Part& p, int64_t off, int64_t src_row,
                                             int32_t my_row, int k, int64_t zero_row, int lane) {
  constexpr int W = sizeof(V);
  const int64_t nv = min(kChunkBytes, p.row_bytes - off) / W;
  for (int64_t b = 0; b < nv; b += 32 * kUnroll) {
    V v[kUnroll];
#pragma unroll
    for (int u = 0; u < kUnroll; ++u) {
      const int64_t j = b + u * 32 + lane;
      v[u] = V{};
      if (src_row >= 0 && j < nv) v[u] = ld<V>(p.src + src_row * p.row_bytes + off + j * W);
    }
    if (src_row < 0) {
#pragma unroll
      for (int u = 0; u < kUnroll; ++u) {
        const int64_t j = b + u * 32 + lane;
        if (j < nv) st<V>(p.dst + zero_row * p.row_bytes + off + j * W, v[u]);
      }
      continue;
    }
    for (int s = 0; s < k; ++s) {
      const int32_t row = __shfl_sync(kFull, my_row, s);
      if (row < 0) continue;
      uint8_t* dst = p.dst + static_cast<int64_t>(row) * p.row_bytes + off;
#pragma unroll
      for (int u = 0; u < kUnroll; ++u) {
        const int64_t j = b + u * 32 + lane;
        if (j < nv) st<V>(dst + j * W, v[u]);
      }
    }
  }
}
__device__ __forceinline__ void move_chunk(const Part& p, int chunk, int64_t src_row, int32_t my_row,
                                           int k, int64_t zero_row, int lane) {
  const int64_t off = chunk * kChunkBytes;
  switch (p.vec) {
    case 16: move_chunk_v<uint4>(p, off, src_row, my_row, k, zero_row, lane); break;
    case 8: move_chunk_v<uint2>(p, off, src_row, my_row, k, zero_row, lane); break;
    case 4: move_chunk_v<uint32_t>(p, off, src_row, my_row, k, zero_row, lane); break;
    case 2: move_chunk_v<uint16_t>(p, off, src_row, my_row, k, zero_row, lane); break;
    default: move_chunk_v<uint8_t>(p, off, src_row, my_row, k, zero_row, lane); break;
  }
}

// Padding row of padding slot p, or -1 when the expert has fewer padding rows.
__device__ __forceinline__ int64_t pad_row_of(const PadRows& pad, int64_t p) {
  const int64_t e = p / pad.per_expert;
  const int64_t row = pad.padded_offsets[e] + pad.counts[e] + (p - e * pad.per_expert);
  return row < pad.padded_offsets[e + 1] ? row : -1;
}

// grid (ceil(items / 8), chunks of part 0 + chunks of part 1 + (FP8 scales ? 1 : 0))
__global__ void __launch_bounds__(kThreads) scatter_rows_kernel(const ScatterArgs a) {
  const int warp = threadIdx.x >> 5, lane = threadIdx.x & 31;
  const int64_t item = static_cast<int64_t>(blockIdx.x) * kWarps + warp;
  if (item >= a.items) return;
  int64_t src_row = -1, zero_row = -1;
  int32_t my_row = -1;
  if (item < a.tokens) {
    src_row = item;
    if (lane < a.k) my_row = a.row_map[item * a.k + lane];
  } else {
    zero_row = pad_row_of(a.pad, item - a.tokens);
    if (zero_row < 0) return;
  }
  int y = blockIdx.y;
  if (y < a.part[0].chunks) {
    move_chunk(a.part[0], y, src_row, my_row, a.k, zero_row, lane);
    return;
  }
  y -= a.part[0].chunks;
  if (a.nparts > 1 && y < a.part[1].chunks) {
    move_chunk(a.part[1], y, src_row, my_row, a.k, zero_row, lane);
    return;
  }
  const ColScales& c = a.col;  // the FP8 scale grid
  if (src_row < 0) {
    for (int cc = lane; cc < c.ncols; cc += 32) c.dst[cc * c.dst_ld + zero_row] = 0;
    return;
  }
  for (int c0 = 0; c0 < c.ncols; c0 += 32) {
    const int cc = c0 + lane;
    const uint8_t v = cc < c.ncols ? c.src[cc * c.src_ld + src_row] : 0;
    for (int s = 0; s < a.k; ++s) {
      const int32_t row = __shfl_sync(kFull, my_row, s);
      if (row >= 0 && cc < c.ncols) c.dst[cc * c.dst_ld + row] = v;
    }
  }
}


// One warp per (destination row, chunk): pad (compact -> padded, zero rows) or unpad.
__global__ void __launch_bounds__(kThreads) gather_rows_kernel(const GatherArgs a) {
  const int warp = threadIdx.x >> 5, lane = threadIdx.x & 31;
  const int64_t r = static_cast<int64_t>(blockIdx.x) * kWarps + warp;
  if (r >= a.items) return;
  const int32_t* dst_off = a.to_padded ? a.padded_offsets : a.offsets;
  if (r >= dst_off[a.E]) return;
  const int e = detail::last_at_or_below(dst_off, a.E, r);  // the segment holding row r
  const int64_t j = r - dst_off[e];
  const int64_t src = a.to_padded ? (j < a.counts[e] ? a.offsets[e] + j : -1) : a.padded_offsets[e] + j;
  int y = blockIdx.y;
  if (y < a.part[0].chunks) {
    move_chunk(a.part[0], y, src, static_cast<int32_t>(r), 1, r, lane);
    return;
  }
  y -= a.part[0].chunks;
  if (a.nparts > 1 && y < a.part[1].chunks) {
    move_chunk(a.part[1], y, src, static_cast<int32_t>(r), 1, r, lane);
    return;
  }
  const ColScales& c = a.col;
  for (int cc = lane; cc < c.ncols; cc += 32)
    c.dst[cc * c.dst_ld + r] = src >= 0 ? c.src[cc * c.src_ld + src] : 0;
}

__device__ __forceinline__ void unpack8(const uint4& v, float f[8]) {
  const uint32_t w[4] = {v.x, v.y, v.z, v.w};
#pragma unroll
  for (int i = 0; i < 4; ++i) {
    f[2 * i] = __uint_as_float(w[i] << 16);
    f[2 * i + 1] = __uint_as_float(w[i] & 0xFFFF0000u);
  }
}
__device__ __forceinline__ uint4 pack8(const float f[8]) {
  uint32_t w[4];
#pragma unroll
  for (int i = 0; i < 4; ++i)
    w[i] = static_cast<uint32_t>(num::f32_to_bf16(canon(f[2 * i]))) |
           (static_cast<uint32_t>(num::f32_to_bf16(canon(f[2 * i + 1]))) << 16);
  return make_uint4(w[0], w[1], w[2], w[3]);
}

// y[t] = bf16(sum_s prob[t,s] * rows[row_map[t,s]]), acc = fma(p, v, acc) in slot order.
// grid (ceil(T / 8), ceil(H / (8 * 32 * kUnpermVec))): one warp per (token, 512-element chunk).
__global__ void __launch_bounds__(kThreads)
unpermute_kernel(const bf16_t* __restrict__ rows, const float* __restrict__ probs,
                 const int32_t* __restrict__ row_map, int64_t T, int k, int64_t h,
                 bf16_t* __restrict__ y) {
  const int warp = threadIdx.x >> 5, lane = threadIdx.x & 31;
  const int64_t t = static_cast<int64_t>(blockIdx.x) * kWarps + warp;
  if (t >= T) return;
  int32_t my_row = -1;
  float my_p = 1.0f;
  if (lane < k) {
    my_row = row_map[t * k + lane];
    if (probs) my_p = probs[t * k + lane];
  }
  const int64_t nvec = h / 8;
  const int64_t v0 = static_cast<int64_t>(blockIdx.y) * 32 * kUnpermVec;
  float acc[kUnpermVec][8];
#pragma unroll
  for (int u = 0; u < kUnpermVec; ++u)
#pragma unroll
    for (int i = 0; i < 8; ++i) acc[u][i] = 0.0f;
  for (int s0 = 0; s0 < k; s0 += kSlotBatch) {
    int32_t row[kSlotBatch];
    float p[kSlotBatch];
    uint4 d[kSlotBatch][kUnpermVec];
#pragma unroll
    for (int b = 0; b < kSlotBatch; ++b) {
      const int s = s0 + b;
      const int32_t rr = __shfl_sync(kFull, my_row, s & 31);
      p[b] = __shfl_sync(kFull, my_p, s & 31);
      row[b] = s < k ? rr : -1;
#pragma unroll
      for (int u = 0; u < kUnpermVec; ++u) {
        const int64_t v = v0 + u * 32 + lane;
        d[b][u] = make_uint4(0, 0, 0, 0);
        if (row[b] >= 0 && v < nvec)
          d[b][u] = *reinterpret_cast<const uint4*>(rows + static_cast<int64_t>(row[b]) * h + v * 8);
      }
    }
#pragma unroll
    for (int b = 0; b < kSlotBatch; ++b) {
      if (row[b] < 0) continue;
#pragma unroll
      for (int u = 0; u < kUnpermVec; ++u) {
        float f[8];
        unpack8(d[b][u], f);
#pragma unroll
        for (int i = 0; i < 8; ++i) acc[u][i] = fma_rn(p[b], f[i], acc[u][i]);
      }
    }
  }
#pragma unroll
  for (int u = 0; u < kUnpermVec; ++u) {
    const int64_t v = v0 + u * 32 + lane;
    if (v < nvec) *reinterpret_cast<uint4*>(y + t * h + v * 8) = pack8(acc[u]);
  }
}

// Backward of unpermute: one warp per token over the whole row (dprob is a full-row dot in the
// fixed lane order), extra warps zero the padding rows of dy_rows.
__global__ void __launch_bounds__(kThreads, 2)
unpermute_backward_kernel(const bf16_t* __restrict__ dy, const bf16_t* __restrict__ rows,
                          const float* __restrict__ probs, const int32_t* __restrict__ row_map,
                          int64_t T, int k, int64_t h, bf16_t* __restrict__ dy_rows,
                          float* __restrict__ dprobs, const PadRows pad, int64_t items) {
  const int warp = threadIdx.x >> 5, lane = threadIdx.x & 31;
  const int64_t item = static_cast<int64_t>(blockIdx.x) * kWarps + warp;
  if (item >= items) return;
  const int64_t nvec = h / 8;
  if (item >= T) {
    const int64_t zr = pad_row_of(pad, item - T);
    if (zr < 0) return;
    for (int64_t v = lane; v < nvec; v += 32)
      *reinterpret_cast<uint4*>(dy_rows + zr * h + v * 8) = make_uint4(0, 0, 0, 0);
    return;
  }
  const int64_t t = item;
  int32_t my_row = -1;
  float my_p = 1.0f;
  if (lane < k) {
    my_row = row_map[t * k + lane];
    if (probs) my_p = probs[t * k + lane];
  }
  for (int s0 = 0; s0 < k; s0 += kBwdBatch) {
    int32_t row[kBwdBatch];
    float p[kBwdBatch], dot[kBwdBatch];
#pragma unroll
    for (int b = 0; b < kBwdBatch; ++b) {
      const int s = s0 + b;
      const int32_t rr = __shfl_sync(kFull, my_row, s & 31);
      p[b] = __shfl_sync(kFull, my_p, s & 31);
      row[b] = s < k ? rr : -1;
      dot[b] = 0.0f;
    }
    for (int64_t v = lane; v < nvec; v += 32) {
      const uint4 gv = *reinterpret_cast<const uint4*>(dy + t * h + v * 8);
      uint4 d[kBwdBatch];
#pragma unroll
      for (int b = 0; b < kBwdBatch; ++b) {
        d[b] = make_uint4(0, 0, 0, 0);
        if (row[b] >= 0) d[b] = *reinterpret_cast<const uint4*>(rows + static_cast<int64_t>(row[b]) * h + v * 8);
      }
      float g[8];
      unpack8(gv, g);
#pragma unroll
      for (int b = 0; b < kBwdBatch; ++b) {
        if (row[b] < 0) continue;
        float f[8], o[8];
        unpack8(d[b], f);
#pragma unroll
        for (int i = 0; i < 8; ++i) {
          dot[b] = fma_rn(g[i], f[i], dot[b]);
          o[i] = mul_rn(p[b], g[i]);
        }
        *reinterpret_cast<uint4*>(dy_rows + static_cast<int64_t>(row[b]) * h + v * 8) = pack8(o);
      }
    }
#pragma unroll
    for (int b = 0; b < kBwdBatch; ++b) {
      float sum = dot[b];
#pragma unroll
      for (int o = 16; o > 0; o >>= 1) sum = sum + __shfl_xor_sync(kFull, sum, o);
      if (lane == b && s0 + b < k) dprobs[t * k + s0 + b] = row[b] >= 0 ? canon(sum) : 0.0f;
    }
  }
}

// ---- host side --------------------------------------------------------------------------------
void check_routing(const Routing& r, bool unpadded, const char* what) {
  FLOWMOE_CHECK(r.tokens >= 0 && r.tokens <= INT32_MAX,
                what << ": T = " << r.tokens << " tokens out of range; expected 0 <= T < 2^31");
  FLOWMOE_CHECK(r.num_experts >= 1 && r.num_experts <= kRouterMaxExperts,
                what << ": E = " << r.num_experts << " experts out of range; expected 1 <= E <= "
                     << kRouterMaxExperts);
  FLOWMOE_CHECK(r.topk >= 1 && r.topk <= kMaxTopk,
                what << ": top-k k = " << r.topk << " out of range; expected 1 <= k <= " << kMaxTopk);
  FLOWMOE_CHECK(r.align >= 1 && r.align <= kMaxAlign,
                what << ": alignment A = " << r.align << " out of range; expected 1 <= A <= " << kMaxAlign);
  FLOWMOE_CHECK(r.counts && r.offsets && r.padded_offsets && r.row_map,
                what << ": routing tables are null; call build_routing first");
  FLOWMOE_CHECK(!unpadded || r.row_map_unpadded,
                what << ": this baseline needs Routing.row_map_unpadded (build_routing fills it when "
                        "the buffer is given)");
}
void check_h(int64_t h, int multiple, const char* fmt, const char* what) {
  FLOWMOE_CHECK(h > 0 && h % multiple == 0,
                what << ": hidden size H = " << h << " must be a positive multiple of " << multiple
                     << " for " << fmt << " rows");
}
void check_buf(const void* p, const char* name, const char* what) {
  detail::host::check_aligned(p, name, what);
}
// The rows a scale grid must hold (Mp, or offsets[E] for compact buffers) live on the device:
// the host checks the range only. R (Routing::max_rows) or T*k is always large enough.
void check_ld(int64_t ld, const char* name, const char* what) {
  FLOWMOE_CHECK(ld >= 1 && ld <= INT32_MAX, what << ": " << name << " = " << ld
                                                 << " out of range; expected the scale grid's row "
                                                    "capacity (>= the rows written, < 2^31)");
}
Part make_part(const void* src, void* dst, int64_t row_bytes) {
  Part p;
  p.src = static_cast<const uint8_t*>(src);
  p.dst = static_cast<uint8_t*>(dst);
  p.row_bytes = row_bytes;
  p.vec = 16;
  while (row_bytes % p.vec) p.vec >>= 1;
  p.chunks = static_cast<int>((row_bytes + kChunkBytes - 1) / kChunkBytes);
  return p;
}
unsigned warps_grid(int64_t items) {
  const int64_t g = (items + kWarps - 1) / kWarps;
  FLOWMOE_CHECK(g < (1ll << 31), "problem too large for one launch: " << g << " blocks");
  return static_cast<unsigned>(g);
}
unsigned chunks_grid(int64_t chunks) {
  FLOWMOE_CHECK(chunks >= 1 && chunks <= 65535, "row too long for one launch: " << chunks << " chunks of a row");
  return static_cast<unsigned>(chunks);
}
PadRows pad_rows(const Routing& r) {
  PadRows p;
  p.counts = r.counts;
  p.padded_offsets = r.padded_offsets;
  p.per_expert = r.align - 1;
  return p;
}

// permute (+ pad when `padded`): scatter by row_map (padded) or row_map_unpadded.
void scatter(ScatterArgs a, const Routing& r, bool padded, cudaStream_t stream, const char* what) {
  a.row_map = padded ? r.row_map : r.row_map_unpadded;
  a.tokens = r.tokens;
  a.k = r.topk;
  if (padded) a.pad = pad_rows(r);
  a.items = r.tokens + (padded ? static_cast<int64_t>(r.num_experts) * a.pad.per_expert : 0);
  if (r.tokens == 0) return;  // no rows, so no padding either
  const int64_t chunks = a.part[0].chunks + (a.nparts > 1 ? a.part[1].chunks : 0) + (a.col.ncols > 0 ? 1 : 0);
  scatter_rows_kernel<<<dim3(warps_grid(a.items), chunks_grid(chunks)), kThreads, 0, stream>>>(a);
  FLOWMOE_LAUNCH_CHECK(what);
}

void gather(GatherArgs a, const Routing& r, bool to_padded, cudaStream_t stream, const char* what) {
  a.to_padded = to_padded;
  a.counts = r.counts;
  a.offsets = r.offsets;
  a.padded_offsets = r.padded_offsets;
  a.E = r.num_experts;
  a.items = to_padded ? r.max_rows() : r.tokens * r.topk;
  if (a.items == 0) return;
  const int64_t chunks = a.part[0].chunks + (a.nparts > 1 ? a.part[1].chunks : 0) + (a.col.ncols > 0 ? 1 : 0);
  gather_rows_kernel<<<dim3(warps_grid(a.items), chunks_grid(chunks)), kThreads, 0, stream>>>(a);
  FLOWMOE_LAUNCH_CHECK(what);
}

void permute_bf16_impl(const bf16_t* x, int64_t h, const Routing& r, bf16_t* out, bool padded,
                       cudaStream_t stream, const char* what) {
  check_routing(r, !padded, what);
  check_h(h, 8, "BF16", what);
  if (r.tokens == 0) return;  // nothing to move; the buffers may be null
  check_buf(x, "x", what);
  check_buf(out, "out", what);
  ScatterArgs a;
  a.part[0] = make_part(x, out, 2 * h);
  a.nparts = 1;
  scatter(a, r, padded, stream, what);
}
// The FP8 scale grid of permute_pad_fp8 through the inverse map: dst[c][row] = src[c][row_src[row]]
// (0 for padding rows), rows [0, Mp): consecutive threads write consecutive bytes of a scale row.
__global__ void __launch_bounds__(kThreads)
gather_fp8_scales_kernel(const uint8_t* __restrict__ src, int64_t src_ld, const int32_t* __restrict__ row_src,
                         const int32_t* __restrict__ padded_offsets, int E, uint8_t* __restrict__ dst,
                         int64_t dst_ld) {
  const int64_t row = static_cast<int64_t>(blockIdx.x) * kThreads + threadIdx.x;
  if (row >= padded_offsets[E]) return;
  const int64_t c = blockIdx.y;
  const int32_t t = row_src[row];
  dst[c * dst_ld + row] = t >= 0 ? src[c * src_ld + t] : 0;
}

void permute_fp8_impl(const uint8_t* codes, const uint8_t* scales, int64_t h, const Routing& r,
                      uint8_t* out_codes, uint8_t* out_scales, int64_t scale_ld, bool padded,
                      cudaStream_t stream, const char* what) {
  check_routing(r, !padded, what);
  check_h(h, kFp8Block, "FP8 row-wise (1x128 tiles)", what);
  if (r.tokens == 0) return;  // nothing to move; the buffers may be null
  check_buf(codes, "codes", what);
  check_buf(out_codes, "out_codes", what);
  FLOWMOE_CHECK(scales && out_scales, what << ": scales and out_scales must be device buffers (one is null)");
  check_ld(scale_ld, "scale_ld", what);
  ScatterArgs a;
  a.part[0] = make_part(codes, out_codes, h);
  a.nparts = 1;
  a.col.src = scales;
  a.col.src_ld = r.tokens;
  a.col.dst = out_scales;
  a.col.dst_ld = scale_ld;
  a.col.ncols = static_cast<int>(h / kFp8Block);
  const bool gather_scales = padded && r.row_src != nullptr;
  if (gather_scales) a.col.ncols = 0;  // the codes only; the scales below
  scatter(a, r, padded, stream, what);
  if (gather_scales) {
    const int64_t rows = r.max_rows();
    const dim3 grid(static_cast<unsigned>((rows + kThreads - 1) / kThreads), static_cast<unsigned>(h / kFp8Block));
    gather_fp8_scales_kernel<<<grid, kThreads, 0, stream>>>(scales, r.tokens, r.row_src, r.padded_offsets,
                                                           r.num_experts, out_scales, scale_ld);
    FLOWMOE_LAUNCH_CHECK(what);
  }
}
void permute_mxfp4_impl(const uint8_t* codes, const uint8_t* scales, int64_t h, const Routing& r,
                        uint8_t* out_codes, uint8_t* out_scales, bool padded, cudaStream_t stream,
                        const char* what) {
  check_routing(r, !padded, what);
  check_h(h, kFp4Block, "MXFP4 (1x32 blocks)", what);
  if (r.tokens == 0) return;  // nothing to move; the buffers may be null
  check_buf(codes, "codes", what);
  check_buf(scales, "scales", what);
  check_buf(out_codes, "out_codes", what);
  check_buf(out_scales, "out_scales", what);
  ScatterArgs a;
  a.part[0] = make_part(codes, out_codes, h / 2);
  a.part[1] = make_part(scales, out_scales, h / kFp4Block);
  a.nparts = 2;
  scatter(a, r, padded, stream, what);
}

void unpermute_impl(const bf16_t* rows, const float* probs, int64_t h, const Routing& r, bf16_t* y,
                    bool padded, cudaStream_t stream, const char* what) {
  check_routing(r, !padded, what);
  check_h(h, 8, "BF16", what);
  if (r.tokens == 0) return;  // nothing to move; the buffers may be null
  check_buf(rows, "y_rows", what);
  check_buf(y, "y", what);
  const int64_t chunks = (h / 8 + 32 * kUnpermVec - 1) / (32 * kUnpermVec);
  unpermute_kernel<<<dim3(warps_grid(r.tokens), chunks_grid(chunks)), kThreads, 0, stream>>>(
      rows, probs, padded ? r.row_map : r.row_map_unpadded, r.tokens, r.topk, h, y);
  FLOWMOE_LAUNCH_CHECK(what);
}

void unpermute_backward_impl(const bf16_t* dy, const bf16_t* rows, const float* probs, int64_t h,
                             const Routing& r, bf16_t* dy_rows, float* dprobs, bool padded,
                             cudaStream_t stream, const char* what) {
  check_routing(r, !padded, what);
  check_h(h, 8, "BF16", what);
  if (r.tokens == 0) return;  // nothing to move; the buffers may be null
  check_buf(dy, "dy", what);
  check_buf(rows, "y_rows", what);
  check_buf(dy_rows, "dy_rows", what);
  FLOWMOE_CHECK(dprobs != nullptr, what << ": dprobs is null; expected a device buffer");
  const PadRows pad = padded ? pad_rows(r) : PadRows{};
  const int64_t items = r.tokens + static_cast<int64_t>(r.num_experts) * pad.per_expert;
  unpermute_backward_kernel<<<warps_grid(items), kThreads, 0, stream>>>(
      dy, rows, probs, padded ? r.row_map : r.row_map_unpadded, r.tokens, r.topk, h, dy_rows, dprobs,
      pad, items);
  FLOWMOE_LAUNCH_CHECK(what);
}

}  // namespace

// ---- fused -------------------------------------------------------------------------------------
void permute_pad_bf16(const bf16_t* x, int64_t h, const Routing& r, bf16_t* out, cudaStream_t stream) {
  permute_bf16_impl(x, h, r, out, true, stream, "permute_pad_bf16");
}
void permute_pad_fp8(const uint8_t* codes, const uint8_t* scales, int64_t h, const Routing& r,
                     uint8_t* out_codes, uint8_t* out_scales, int64_t scale_ld, cudaStream_t stream) {
  permute_fp8_impl(codes, scales, h, r, out_codes, out_scales, scale_ld, true, stream, "permute_pad_fp8");
}
void permute_pad_mxfp4(const uint8_t* codes, const uint8_t* scales, int64_t h, const Routing& r,
                       uint8_t* out_codes, uint8_t* out_scales, cudaStream_t stream) {
  permute_mxfp4_impl(codes, scales, h, r, out_codes, out_scales, true, stream, "permute_pad_mxfp4");
}
void unpermute_unpad(const bf16_t* y_rows, const float* probs, int64_t h, const Routing& r,
                     bf16_t* y, cudaStream_t stream) {
  unpermute_impl(y_rows, probs, h, r, y, true, stream, "unpermute_unpad");
}
void unpermute_unpad_backward(const bf16_t* dy, const bf16_t* y_rows, const float* probs,
                              int64_t h, const Routing& r, bf16_t* dy_rows, float* dprobs,
                              cudaStream_t stream) {
  unpermute_backward_impl(dy, y_rows, probs, h, r, dy_rows, dprobs, true, stream,
                          "unpermute_unpad_backward");
}

// ---- baselines ---------------------------------------------------------------------------------
void permute_bf16(const bf16_t* x, int64_t h, const Routing& r, bf16_t* out, cudaStream_t stream) {
  permute_bf16_impl(x, h, r, out, false, stream, "permute_bf16");
}
void permute_fp8(const uint8_t* codes, const uint8_t* scales, int64_t h, const Routing& r,
                 uint8_t* out_codes, uint8_t* out_scales, int64_t scale_ld, cudaStream_t stream) {
  permute_fp8_impl(codes, scales, h, r, out_codes, out_scales, scale_ld, false, stream, "permute_fp8");
}
void permute_mxfp4(const uint8_t* codes, const uint8_t* scales, int64_t h, const Routing& r,
                   uint8_t* out_codes, uint8_t* out_scales, cudaStream_t stream) {
  permute_mxfp4_impl(codes, scales, h, r, out_codes, out_scales, false, stream, "permute_mxfp4");
}

void pad_bf16(const bf16_t* in, int64_t h, const Routing& r, bf16_t* out, cudaStream_t stream) {
  const char* what = "pad_bf16";
  check_routing(r, false, what);
  check_h(h, 8, "BF16", what);
  if (r.tokens == 0) return;  // nothing to move; the buffers may be null
  check_buf(in, "in", what);
  check_buf(out, "out", what);
  GatherArgs a;
  a.part[0] = make_part(in, out, 2 * h);
  a.nparts = 1;
  gather(a, r, true, stream, what);
}
void pad_fp8(const uint8_t* codes, const uint8_t* scales, int64_t in_scale_ld, int64_t h,
             const Routing& r, uint8_t* out_codes, uint8_t* out_scales, int64_t out_scale_ld,
             cudaStream_t stream) {
  const char* what = "pad_fp8";
  check_routing(r, false, what);
  check_h(h, kFp8Block, "FP8 row-wise (1x128 tiles)", what);
  if (r.tokens == 0) return;  // nothing to move; the buffers may be null
  check_buf(codes, "codes", what);
  check_buf(out_codes, "out_codes", what);
  FLOWMOE_CHECK(scales && out_scales, what << ": scales and out_scales must be device buffers (one is null)");
  check_ld(in_scale_ld, "in_scale_ld", what);
  check_ld(out_scale_ld, "out_scale_ld", what);
  GatherArgs a;
  a.part[0] = make_part(codes, out_codes, h);
  a.nparts = 1;
  a.col.src = scales;
  a.col.src_ld = in_scale_ld;
  a.col.dst = out_scales;
  a.col.dst_ld = out_scale_ld;
  a.col.ncols = static_cast<int>(h / kFp8Block);
  gather(a, r, true, stream, what);
}
void pad_mxfp4(const uint8_t* codes, const uint8_t* scales, int64_t h, const Routing& r,
               uint8_t* out_codes, uint8_t* out_scales, cudaStream_t stream) {
  const char* what = "pad_mxfp4";
  check_routing(r, false, what);
  check_h(h, kFp4Block, "MXFP4 (1x32 blocks)", what);
  if (r.tokens == 0) return;  // nothing to move; the buffers may be null
  check_buf(codes, "codes", what);
  check_buf(scales, "scales", what);
  check_buf(out_codes, "out_codes", what);
  check_buf(out_scales, "out_scales", what);
  GatherArgs a;
  a.part[0] = make_part(codes, out_codes, h / 2);
  a.part[1] = make_part(scales, out_scales, h / kFp4Block);
  a.nparts = 2;
  gather(a, r, true, stream, what);
}
void unpad_bf16(const bf16_t* in, int64_t h, const Routing& r, bf16_t* out, cudaStream_t stream) {
  const char* what = "unpad_bf16";
  check_routing(r, false, what);
  check_h(h, 8, "BF16", what);
  if (r.tokens == 0) return;  // nothing to move; the buffers may be null
  check_buf(in, "in", what);
  check_buf(out, "out", what);
  GatherArgs a;
  a.part[0] = make_part(in, out, 2 * h);
  a.nparts = 1;
  gather(a, r, false, stream, what);
}
void unpermute(const bf16_t* y_compact, const float* probs, int64_t h, const Routing& r,
               bf16_t* y, cudaStream_t stream) {
  unpermute_impl(y_compact, probs, h, r, y, false, stream, "unpermute");
}
void unpermute_backward(const bf16_t* dy, const bf16_t* y_compact, const float* probs, int64_t h,
                        const Routing& r, bf16_t* dy_compact, float* dprobs, cudaStream_t stream) {
  unpermute_backward_impl(dy, y_compact, probs, h, r, dy_compact, dprobs, false, stream,
                          "unpermute_backward");
}

}  // namespace cuda
}  // namespace flowmoe
