// The CUTLASS baseline of the grouped FP8 expert GEMMs (issue 18): CUTLASS 4.x's grouped
// blockwise-scaled FP8 GEMM for sm_90a (CUTLASS example 68's kernel,
// KernelPtrArrayTmaWarpSpecializedCooperativeFP8Blockwise, alias ...FP8BlockScaledAccum): 1x128
// scales per activation row, 128x128 weight blocks, FP32 accumulation, BF16 output, one launch over
// all experts, problem sizes on the device only (example 68's "without host problem shapes" mode).
// Built from the headers of the PyPI package nvidia-cutlass, only with -DFLOWMOE_BENCH_CUTLASS=ON
// (docs/GEMM.md, "CUTLASS baseline").
//
//   flowmoe_bench_cutlass [--reps N] [--shape NAME] [--ragged] [--kernel coop|pingpong|best]
//                         [--raster m|n|h] [--swizzle 1|2|4|8] [--sweep]
//
// Per shape: random E4M3 codes (every finite code) and power-of-two FP32 scales; a small kernel
// writes the per-expert arguments (shapes, pointers, strides) from the device offsets, as a layer
// would after routing. Per kernel configuration (--kernel: example 68's cooperative one, a
// ping-pong one, or both with the faster reported, the default): one checked launch, then 3
// warm-ups and `reps` launches each between two CUDA events; us = the median per-launch time
// (tools/common/timing.h), TFLOP/s = 2*M*N*K / us. --raster / --swizzle set the tile scheduler (default
// along M, swizzle 1: CUTLASS's defaults); --sweep times raster m/n x swizzle 1/2/4/8 and keeps the
// fastest (sched= names it), so the baseline is CUTLASS at its best launch settings.
// The check: the output is NaN-filled first; afterwards every element must be finite (every row
// written) and 2048 sampled elements must match a reference that decodes E4M3 and applies the
// scales per 128-wide K block exactly (sum_b (sum_k a*b) * sa * sb, in double):
// |y - ref| <= 2^-8 |ref| + 2^-8 S, S = sum_k |a*b*sa*sb| (the bound flowmoe's own GEMM tests use,
// tests/cuda/gemm_test_problem.h: one BF16 rounding plus the FP8 tensor cores' reduced-precision
// in-block accumulation; a wrong scale or layout is off by the order of S). max_rel below is
// |y - ref| / bound, <= 1 when the check passes. A failed check prints check=FAIL; exit status 1.
// --ragged: the same total rows, every 7th expert (3, 10, ...) empty, the others arbitrary counts
// (not multiples of anything) from a fixed seed; CUTLASS skips empty groups.
#include <cuda_runtime.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <random>
#include <string>
#include <type_traits>
#include <vector>

#include "cute/tensor.hpp"
#include "cutlass/cutlass.h"
#include "cutlass/detail/blockwise_scale_layout.hpp"
#include "cutlass/epilogue/collective/collective_builder.hpp"
#include "cutlass/epilogue/dispatch_policy.hpp"
#include "cutlass/gemm/collective/collective_builder.hpp"
#include "cutlass/gemm/device/gemm_universal_adapter.h"
#include "cutlass/gemm/dispatch_policy.hpp"
#include "cutlass/gemm/group_array_problem_shape.hpp"
#include "cutlass/gemm/kernel/gemm_universal.hpp"
#include "cutlass/numeric_types.h"
#include "cutlass/version.h"

#include "bench_util.cuh"

#if !defined(CUTLASS_ARCH_MMA_MODIFIABLE_TMA_SM90_SUPPORTED)
#error "flowmoe_bench_cutlass needs CUDA 12.3 or newer (modifiable TMA descriptors for grouped GEMM)"
#endif

// A named namespace: with `using namespace cute` in an anonymous one, nvcc's host stubs cannot
// name the kernels (cute has an anonymous namespace of its own).
namespace cutlass_bench {

using namespace cute;

// Device buffers of one shape, freed together when it is done.
std::vector<void*> g_buffers;
template <typename T>
T* dalloc(int64_t n) {
  T* p = flowmoe::bench::dalloc<T>(static_cast<size_t>(n));
  g_buffers.push_back(p);
  return p;
}

// ---- the kernel: example 68's configuration, our layouts ---------------------------------------
// CUTLASS computes D [M, N] = A [M, K] . B [K, N] per group. Ours, per expert e:
//   A = X_e  [M_e, K] row-major, K contiguous            -> LayoutA RowMajor
//   B = W_e  [N, K]   row-major, K contiguous            -> LayoutB ColumnMajor (B as K x N)
//   D = Y_e  [M_e, N] row-major, BF16                    -> LayoutD RowMajor; no C (beta = 0)
// (dgrad is the same product with dY as A and the transposed weight copy Wt_e [K, N] as B.)
// Scales (cutlass/detail/blockwise_scale_layout.hpp; the grouped kernel rebuilds both layouts
// from each group's (M_e, N, K), so they are compact, and reads one pointer per group):
//   SFA: granularity 1 x 128, MN-major: [K/128][M_e] floats, rows contiguous = flowmoe's
//        GEMM-ready expert-packed activation scales (gemm.h), expert e at float (K/128) * o_e.
//   SFB: granularity 128 x 128, K-major: [N/128][K/128] floats per expert, experts contiguous =
//        flowmoe's GEMM-ready weight scales when K/128 is a multiple of 4 (flowmoe pads each row
//        of the grid to round_up(K/128, 4) for cuBLASLt; CUTLASS has no such stride).
using ElementA = cutlass::float_e4m3_t;
using ElementB = cutlass::float_e4m3_t;
using ElementD = cutlass::bfloat16_t;
using LayoutA = cutlass::layout::RowMajor;
using LayoutB = cutlass::layout::ColumnMajor;
using LayoutD = cutlass::layout::RowMajor;
constexpr int kAlignA = 16;  // elements per 16-byte TMA access
constexpr int kAlignB = 16;
constexpr int kAlignD = 8;
constexpr int kBlock = 128;  // scale block along K (and N for the weights)

using ScaleConfig = cutlass::detail::Sm90BlockwiseScaleConfig<1, kBlock, kBlock, cute::GMMA::Major::MN,
                                                              cute::GMMA::Major::K>;
using LayoutSFA = decltype(ScaleConfig::deduce_layoutSFA());
using LayoutSFB = decltype(ScaleConfig::deduce_layoutSFB());
using ProblemShape = cutlass::gemm::GroupProblemShape<Shape<int, int, int>>;  // (M_e, N, K) per group
using ProblemMNK = ProblemShape::UnderlyingProblemShape;

// One kernel configuration: schedule, tile and cluster are template parameters, so each is a
// separate (slow) instantiation; two are built.
template <class MainloopSchedule, class EpilogueSchedule, class TileShape, class ClusterShape>
struct Config {
  using CollectiveEpilogue = typename cutlass::epilogue::collective::CollectiveBuilder<
      cutlass::arch::Sm90, cutlass::arch::OpClassTensorOp, TileShape, ClusterShape,
      cutlass::epilogue::collective::EpilogueTileAuto, float, float, void, LayoutD*, kAlignD, ElementD,
      LayoutD*, kAlignD, EpilogueSchedule,
      cutlass::epilogue::fusion::LinearCombination<ElementD, float, void, float>>::CollectiveOp;
  using CollectiveMainloop = typename cutlass::gemm::collective::CollectiveBuilder<
      cutlass::arch::Sm90, cutlass::arch::OpClassTensorOp, ElementA, cute::tuple<LayoutA*, LayoutSFA*>,
      kAlignA, ElementB, cute::tuple<LayoutB*, LayoutSFB*>, kAlignB, float, TileShape, ClusterShape,
      cutlass::gemm::collective::StageCountAutoCarveout<
          static_cast<int>(sizeof(typename CollectiveEpilogue::SharedStorage))>,
      MainloopSchedule>::CollectiveOp;
  using GemmKernel = cutlass::gemm::kernel::GemmUniversal<ProblemShape, CollectiveMainloop, CollectiveEpilogue>;
  using Gemm = cutlass::gemm::device::GemmUniversalAdapter<GemmKernel>;
};
// example 68: cooperative (two consumer warp groups share a tile), 128x128x128, cluster 1x2x1
using Coop = Config<cutlass::gemm::KernelPtrArrayTmaWarpSpecializedCooperativeFP8Blockwise,
                    cutlass::epilogue::PtrArrayTmaWarpSpecializedCooperative, Shape<_128, _128, _128>,
                    Shape<_1, _2, _1>>;
// ping-pong (the two consumer warp groups alternate tiles, one's epilogue under the other's
// MMAs), as example 68 "with sparse groups", but 64x128x128: at its 128x128 tile one warp group
// holds two 128x128 FP32 accumulators (the running sum and the block's partial) and spills.
using Pingpong = Config<cutlass::gemm::KernelPtrArrayTmaWarpSpecializedPingpongFP8Blockwise,
                        cutlass::epilogue::PtrArrayTmaWarpSpecializedPingpong, Shape<_64, _128, _128>,
                        Shape<_1, _1, _1>>;
using StrideA = typename Coop::GemmKernel::InternalStrideA;
using StrideB = typename Coop::GemmKernel::InternalStrideB;
using StrideD = typename Coop::GemmKernel::InternalStrideD;
static_assert(std::is_same_v<StrideA, typename Pingpong::GemmKernel::InternalStrideA> &&
                  std::is_same_v<StrideB, typename Pingpong::GemmKernel::InternalStrideB> &&
                  std::is_same_v<StrideD, typename Pingpong::GemmKernel::InternalStrideD>,
              "both configurations read the same per-expert arguments");

// ---- the shapes (E experts x rows per expert; N output features, K contraction) -----------------
struct GemmShape {
  const char* name;
  int experts, rows;
  int n, k;
};
const GemmShape kShapes[] = {
    {"V3-GEMM1-fprop", 32, 2048, 4096, 7168},    {"V3-GEMM2-fprop", 32, 2048, 7168, 2048},
    {"V3-GEMM1-dgrad", 32, 2048, 7168, 4096},    {"V3-GEMM2-dgrad", 32, 2048, 2048, 7168},
    {"V2Lite-GEMM1-fprop", 64, 384, 2816, 2048}, {"V2Lite-GEMM2-fprop", 64, 384, 2048, 1408},
    {"V2Lite-GEMM1-dgrad", 64, 384, 2048, 2816}, {"V2Lite-GEMM2-dgrad", 64, 384, 1408, 2048},
};

#define CUTLASS_CK(x)                                                                        \
  do {                                                                                       \
    const cutlass::Status s_ = (x);                                                          \
    if (s_ != cutlass::Status::kSuccess) {                                                   \
      std::fprintf(stderr, "%s:%d %s: %s\n", __FILE__, __LINE__, #x, cutlassGetStatusString(s_)); \
      std::exit(1);                                                                          \
    }                                                                                        \
  } while (0)

// ---- random data ------------------------------------------------------------------------------
__device__ __forceinline__ uint64_t splitmix(uint64_t z) {
  z += 0x9E3779B97F4A7C15ull;
  z = (z ^ (z >> 30)) * 0xBF58476D1CE4E5B9ull;
  z = (z ^ (z >> 27)) * 0x94D049BB133111EBull;
  return z ^ (z >> 31);
}

// Random E4M3 codes, four per word: every finite code (the NaN codes 0x7F / 0xFF become 0x7E / 0xFE).
__global__ void fill_codes_kernel(uint32_t* out, int64_t words, uint64_t seed) {
  for (int64_t i = blockIdx.x * int64_t(blockDim.x) + threadIdx.x; i < words; i += int64_t(gridDim.x) * blockDim.x) {
    uint32_t w = static_cast<uint32_t>(splitmix(seed ^ (uint64_t(i) * 0x2545F4914F6CDD1Dull)));
    for (int b = 0; b < 4; ++b)
      if (((w >> (8 * b)) & 0x7Fu) == 0x7Fu) w ^= 1u << (8 * b);
    out[i] = w;
  }
}

// Random power-of-two scales 2^-8 .. 2^-1 (exact products with the codes, as UE8M0 scales are).
__global__ void fill_scales_kernel(float* out, int64_t n, uint64_t seed) {
  for (int64_t i = blockIdx.x * int64_t(blockDim.x) + threadIdx.x; i < n; i += int64_t(gridDim.x) * blockDim.x)
    out[i] = ldexpf(1.0f, -1 - static_cast<int>(splitmix(seed + uint64_t(i)) % 8));
}

// ---- the per-expert arguments, from the device offsets ------------------------------------------
// What a layer would launch after routing: the kernel reads only these device arrays.
struct GroupArgs {
  ProblemMNK* shapes;  // (M_e, N, K)
  const ElementA** a;
  const ElementB** b;
  ElementD** d;
  const float** sfa;
  const float** sfb;
  StrideA* da;
  StrideB* db;
  StrideD* dd;
  LayoutSFA* lsfa;  // passed as the API asks; the grouped kernel rebuilds both from the shapes
  LayoutSFB* lsfb;
};

__global__ void build_groups_kernel(const int32_t* offsets, int experts, int n, int k, const uint8_t* a,
                                    const uint8_t* b, ElementD* d, const float* sfa, const float* sfb,
                                    GroupArgs g) {
  for (int e = threadIdx.x; e < experts; e += blockDim.x) {
    const int64_t o = offsets[e];
    const int m = offsets[e + 1] - offsets[e];
    g.shapes[e] = ProblemMNK{m, n, k};
    g.a[e] = reinterpret_cast<const ElementA*>(a + o * k);
    g.b[e] = reinterpret_cast<const ElementB*>(b + int64_t(e) * n * k);
    g.d[e] = d + o * n;
    g.sfa[e] = sfa + o * (k / kBlock);
    g.sfb[e] = sfb + int64_t(e) * (n / kBlock) * (k / kBlock);
    g.da[e] = StrideA{int64_t(k), _1{}, _0{}};
    g.db[e] = StrideB{int64_t(k), _1{}, _0{}};
    g.dd[e] = StrideD{int64_t(n), _1{}, _0{}};
    g.lsfa[e] = ScaleConfig::tile_atom_to_shape_SFA(make_shape(m, n, k, 1));
    g.lsfb[e] = ScaleConfig::tile_atom_to_shape_SFB(make_shape(m, n, k, 1));
  }
}

// ---- the check ----------------------------------------------------------------------------------
// E4M3: subnormal m * 2^-9, normal (8 + m) * 2^(e - 10); exact in double.
__device__ inline double e4m3_value(uint32_t c) {
  const int e = (c >> 3) & 0xF, m = c & 7;
  const double v = e == 0 ? m / 512.0 : (8 + m) * double(1u << e) / 1024.0;
  return (c & 0x80) ? -v : v;
}

// One thread per sampled (row, column): the exact block-scaled dot product and the sum of the
// terms' magnitudes, and the kernel's output there. Rows are found in the offsets by binary search.
__global__ void reference_kernel(const int2* samples, int count, const int32_t* offsets, int experts, int n,
                                 int k, const uint8_t* a, const uint8_t* b, const float* sfa, const float* sfb,
                                 const uint16_t* y, double* ref, double* mag, uint16_t* got) {
  const int s = blockIdx.x * blockDim.x + threadIdx.x;
  if (s >= count) return;
  const int r = samples[s].x, c = samples[s].y;
  int lo = 0, hi = experts - 1;  // the expert e with offsets[e] <= r < offsets[e + 1]
  while (lo < hi) {
    const int mid = (lo + hi + 1) / 2;
    if (offsets[mid] <= r) lo = mid; else hi = mid - 1;
  }
  const int e = lo;
  const int64_t o = offsets[e], me = offsets[e + 1] - o;
  const int kb_count = k / kBlock;
  const uint8_t* arow = a + int64_t(r) * k;
  const uint8_t* brow = b + (int64_t(e) * n + c) * k;
  double acc = 0, abs_acc = 0;
  for (int kb = 0; kb < kb_count; ++kb) {
    double part = 0, abs_part = 0;
    for (int j = 0; j < kBlock; j += 16) {
      const uint4 av = *reinterpret_cast<const uint4*>(arow + kb * kBlock + j);
      const uint4 bv = *reinterpret_cast<const uint4*>(brow + kb * kBlock + j);
      const uint32_t aw[4] = {av.x, av.y, av.z, av.w}, bw[4] = {bv.x, bv.y, bv.z, bv.w};
      for (int q = 0; q < 16; ++q) {
        const double p = e4m3_value((aw[q / 4] >> (8 * (q % 4))) & 0xFF) * e4m3_value((bw[q / 4] >> (8 * (q % 4))) & 0xFF);
        part += p;
        abs_part += fabs(p);
      }
    }
    const double sa = sfa[o * kb_count + int64_t(kb) * me + (r - o)];           // [K/128][M_e]
    const double sb = sfb[(int64_t(e) * (n / kBlock) + c / kBlock) * kb_count + kb];  // [N/128][K/128]
    acc += part * sa * sb;
    abs_acc += abs_part * sa * sb;
  }
  ref[s] = acc;
  mag[s] = abs_acc;
  got[s] = y[int64_t(r) * n + c];
}

// Non-finite elements of the BF16 output (it is NaN-filled before the checked launch).
__global__ void count_nonfinite_kernel(const uint16_t* y, int64_t n, unsigned long long* count) {
  unsigned long long local = 0;
  for (int64_t i = blockIdx.x * int64_t(blockDim.x) + threadIdx.x; i < n; i += int64_t(gridDim.x) * blockDim.x)
    local += (y[i] & 0x7FFFu) >= 0x7F80u;
  if (local) atomicAdd(count, local);
}

float bf16_value(uint16_t bits) {
  const uint32_t u = uint32_t(bits) << 16;
  float f;
  std::memcpy(&f, &u, sizeof f);
  return f;
}

// ---- rows per expert ------------------------------------------------------------------------------
// Uniform: `rows` each. Ragged: the same total, every 7th expert (3, 10, ...) empty, the others
// random weights in [0.25, 1.75) from a fixed seed, the last non-empty expert taking the rest.
std::vector<int32_t> expert_counts(const GemmShape& s, bool ragged) {
  std::vector<int32_t> c(s.experts, s.rows);
  if (!ragged) return c;
  const int64_t total = int64_t(s.experts) * s.rows;
  std::mt19937 rng(18);
  std::vector<double> w(s.experts, 0);
  double sum = 0;
  for (int e = 0; e < s.experts; ++e) {
    w[e] = e % 7 == 3 ? 0 : 0.25 + std::uniform_real_distribution<double>(0, 1.5)(rng);
    sum += w[e];
  }
  int64_t left = total;
  int last = 0;
  for (int e = 0; e < s.experts; ++e) {
    c[e] = static_cast<int32_t>(total * w[e] / sum);
    left -= c[e];
    if (w[e] > 0) last = e;
  }
  c[last] += static_cast<int32_t>(left);
  return c;
}

// ---- one shape ----------------------------------------------------------------------------------
using RasterOrderOptions = cutlass::gemm::kernel::detail::RasterOrderOptions;

// The tile scheduler's launch settings (no template parameter: one kernel serves them all).
struct Sched {
  char raster;  // 'm' along M, 'n' along N, 'h' CUTLASS's heuristic
  int swizzle;  // 1, 2, 4 or 8
};

RasterOrderOptions raster_option(char r) {
  return r == 'n' ? RasterOrderOptions::AlongN : r == 'h' ? RasterOrderOptions::Heuristic : RasterOrderOptions::AlongM;
}

template <typename T>
T* upload(const std::vector<T>& v) {
  T* p = dalloc<T>(v.size());
  CK(cudaMemcpy(p, v.data(), v.size() * sizeof(T), cudaMemcpyHostToDevice));
  return p;
}

dim3 fill_grid(int64_t n) { return dim3(static_cast<unsigned>(std::min<int64_t>((n + 255) / 256, 8192))); }

// One shape's operands and per-expert arguments (device), and the check's sample positions.
struct Operands {
  int E = 0, N = 0, K = 0;
  int64_t M = 0;
  std::vector<int32_t> counts;  // rows per expert
  int32_t* offsets = nullptr;   // [E + 1]
  uint8_t* a = nullptr;         // [M, K] E4M3
  uint8_t* b = nullptr;         // [E][N][K] E4M3
  ElementD* d = nullptr;        // [M, N]
  float* sfa = nullptr;         // per expert [K/128][M_e]
  float* sfb = nullptr;         // per expert [N/128][K/128]
  GroupArgs g{};
  std::vector<int2> samples;  // (row, column) checked
  int2* d_samples = nullptr;
};

Operands make_operands(const GemmShape& s, bool ragged, cudaStream_t stream) {
  Operands op;
  const int E = op.E = s.experts, N = op.N = s.n, K = op.K = s.k;
  op.counts = expert_counts(s, ragged);
  std::vector<int32_t> offsets(E + 1, 0);
  for (int e = 0; e < E; ++e) offsets[e + 1] = offsets[e] + op.counts[e];
  const int64_t M = op.M = offsets[E];
  op.offsets = upload(offsets);
  op.a = dalloc<uint8_t>(M * K);
  op.b = dalloc<uint8_t>(int64_t(E) * N * K);
  op.d = dalloc<ElementD>(M * N);
  const int64_t sfa_n = M * (K / kBlock), sfb_n = int64_t(E) * (N / kBlock) * (K / kBlock);
  op.sfa = dalloc<float>(sfa_n);
  op.sfb = dalloc<float>(sfb_n);
  fill_codes_kernel<<<fill_grid(M * K / 4), 256, 0, stream>>>(reinterpret_cast<uint32_t*>(op.a), M * K / 4, 1);
  fill_codes_kernel<<<fill_grid(int64_t(E) * N * K / 4), 256, 0, stream>>>(reinterpret_cast<uint32_t*>(op.b),
                                                                             int64_t(E) * N * K / 4, 2);
  fill_scales_kernel<<<fill_grid(sfa_n), 256, 0, stream>>>(op.sfa, sfa_n, 3);
  fill_scales_kernel<<<fill_grid(sfb_n), 256, 0, stream>>>(op.sfb, sfb_n, 4);
  CK(cudaGetLastError());
  // Per-expert arguments, written on the device from the offsets.
  op.g = GroupArgs{dalloc<ProblemMNK>(E), dalloc<const ElementA*>(E), dalloc<const ElementB*>(E),
                   dalloc<ElementD*>(E),  dalloc<const float*>(E),   dalloc<const float*>(E),
                   dalloc<StrideA>(E),    dalloc<StrideB>(E),        dalloc<StrideD>(E),
                   dalloc<LayoutSFA>(E),  dalloc<LayoutSFB>(E)};
  build_groups_kernel<<<1, 128, 0, stream>>>(op.offsets, E, N, K, op.a, op.b, op.d, op.sfa, op.sfb, op.g);
  CK(cudaGetLastError());
  op.samples.resize(2048);
  std::mt19937 rng(2048);
  for (int2& p : op.samples)
    p = make_int2(static_cast<int>(rng() % uint64_t(M)), static_cast<int>(rng() % uint64_t(N)));
  op.d_samples = upload(op.samples);
  return op;
}

struct KernelResult {
  bool ok = false;
  double max_rel = 0;
  unsigned long long nonfinite = 0;
  flowmoe::bench::Timing t;
  Sched sched{'m', 1};
};

// One configuration on one shape: a checked launch into a NaN-filled output, then per scheduler
// setting 3 warm-ups and `reps` launches each between two events (the median); the fastest setting.
template <class Cfg>
KernelResult run_kernel(const Operands& op, int reps, const std::vector<Sched>& scheds, cudaStream_t stream) {
  using Gemm = typename Cfg::Gemm;
  const int64_t M = op.M;
  const int E = op.E, N = op.N, K = op.K;
  const GroupArgs& g = op.g;
  // Host problem shapes nullptr: the kernel sizes every group from g.shapes (device memory).
  const cutlass::KernelHardwareInfo hw =
      cutlass::KernelHardwareInfo::make_kernel_hardware_info<typename Cfg::GemmKernel>(0);
  typename Gemm::Arguments args{cutlass::gemm::GemmUniversalMode::kGrouped,
                                {E, g.shapes, nullptr},
                                {g.a, g.da, g.b, g.db, g.sfa, g.lsfa, g.sfb, g.lsfb},
                                {{}, nullptr, nullptr, g.d, g.dd},
                                hw};
  auto& fusion = args.epilogue.thread;  // D = 1 * accumulator, no C
  fusion.alpha = 1.0f;
  fusion.beta = 0.0f;
  fusion.alpha_ptr = fusion.beta_ptr = nullptr;
  fusion.alpha_ptr_array = fusion.beta_ptr_array = nullptr;
  fusion.dAlpha = {_0{}, _0{}, 0};
  fusion.dBeta = {_0{}, _0{}, 0};
  args.scheduler.raster_order = raster_option(scheds[0].raster);
  args.scheduler.max_swizzle_size = scheds[0].swizzle;

  Gemm gemm;
  uint8_t* workspace = dalloc<uint8_t>(Gemm::get_workspace_size(args));
  CUTLASS_CK(gemm.can_implement(args));
  CUTLASS_CK(gemm.initialize(args, workspace, stream));

  // The check.
  CK(cudaMemsetAsync(op.d, 0xFF, M * N * sizeof(ElementD), stream));
  CUTLASS_CK(gemm.run(stream));
  CK(cudaGetLastError());
  unsigned long long* d_nonfinite = dalloc<unsigned long long>(1);
  CK(cudaMemsetAsync(d_nonfinite, 0, sizeof(unsigned long long), stream));
  count_nonfinite_kernel<<<fill_grid(M * N), 256, 0, stream>>>(reinterpret_cast<const uint16_t*>(op.d), M * N,
                                                                d_nonfinite);
  const int ns = static_cast<int>(op.samples.size());
  double* d_ref = dalloc<double>(ns);
  double* d_mag = dalloc<double>(ns);
  uint16_t* d_got = dalloc<uint16_t>(ns);
  reference_kernel<<<(ns + 127) / 128, 128, 0, stream>>>(op.d_samples, ns, op.offsets, E, N, K, op.a, op.b, op.sfa,
                                                         op.sfb, reinterpret_cast<const uint16_t*>(op.d), d_ref,
                                                         d_mag, d_got);
  CK(cudaGetLastError());
  CK(cudaStreamSynchronize(stream));
  std::vector<double> ref(ns), mag(ns);
  std::vector<uint16_t> got_bits(ns);
  KernelResult r;
  CK(cudaMemcpy(ref.data(), d_ref, ns * sizeof(double), cudaMemcpyDeviceToHost));
  CK(cudaMemcpy(mag.data(), d_mag, ns * sizeof(double), cudaMemcpyDeviceToHost));
  CK(cudaMemcpy(got_bits.data(), d_got, ns * sizeof(uint16_t), cudaMemcpyDeviceToHost));
  CK(cudaMemcpy(&r.nonfinite, d_nonfinite, sizeof r.nonfinite, cudaMemcpyDeviceToHost));
  for (int i = 0; i < ns; ++i) {
    const double got = bf16_value(got_bits[i]);
    const double denom = (std::fabs(ref[i]) + mag[i]) / 256.0 + 1e-30;
    const double rel = std::isfinite(got) ? std::fabs(got - ref[i]) / denom : INFINITY;
    r.max_rel = std::max(r.max_rel, rel);
  }
  r.ok = r.nonfinite == 0 && r.max_rel <= 1.0;

  // The timing, per scheduler setting.
  for (size_t i = 0; i < scheds.size(); ++i) {
    args.scheduler.raster_order = raster_option(scheds[i].raster);
    args.scheduler.max_swizzle_size = scheds[i].swizzle;
    CUTLASS_CK(gemm.initialize(args, workspace, stream));
    const flowmoe::bench::Timing ti = flowmoe::bench::time_events(
        [&](int) { CUTLASS_CK(gemm.run(stream)); }, reps, 3, stream);
    if (i == 0 || ti.us < r.t.us) {
      r.t = ti;
      r.sched = scheds[i];
    }
  }
  return r;
}

// One line per shape: the fastest of the chosen configurations; the check covers all of them.
// Returns false when a check failed.
bool run_shape(const GemmShape& s, int reps, bool ragged, const std::string& kernel,
               const std::vector<Sched>& scheds, cudaStream_t stream) {
  const Operands op = make_operands(s, ragged, stream);
  std::vector<std::pair<const char*, KernelResult>> results;
  if (kernel != "pingpong") results.emplace_back("coop", run_kernel<Coop>(op, reps, scheds, stream));
  if (kernel != "coop") results.emplace_back("pingpong", run_kernel<Pingpong>(op, reps, scheds, stream));
  bool ok = true;
  double max_rel = 0;
  unsigned long long nonfinite = 0;
  size_t best = 0;
  for (size_t i = 0; i < results.size(); ++i) {
    const KernelResult& r = results[i].second;
    ok = ok && r.ok;
    max_rel = std::max(max_rel, r.max_rel);
    nonfinite += r.nonfinite;
    if (r.t.us < results[best].second.t.us) best = i;
  }
  const KernelResult& r = results[best].second;
  const double tflops = 2.0 * double(op.M) * op.N * op.K / (double(r.t.us) * 1e-6) / 1e12;
  char check[96];
  if (ok) std::snprintf(check, sizeof check, "ok(max_rel=%.1e)", max_rel);
  else std::snprintf(check, sizeof check, "FAIL(max_rel=%.1e,nonfinite=%llu)", max_rel, nonfinite);
  std::printf("cutlass  %-18s  E=%d M=%lld N=%d K=%d  us=%.1f  TFLOP/s=%.1f  check=%s  min_us=%.1f  kernel=%s"
              "  sched=%c%d  rows=%s",
              s.name, op.E, static_cast<long long>(op.M), op.N, op.K, r.t.us, tflops, check, r.t.min_us,
              results[best].first, r.sched.raster, r.sched.swizzle, ragged ? "ragged" : "uniform");
  if (ragged)
    std::printf("(empty=%d,max=%d)", static_cast<int>(std::count(op.counts.begin(), op.counts.end(), 0)),
                *std::max_element(op.counts.begin(), op.counts.end()));
  if (results.size() > 1)  // the other configuration's time, for the record
    std::printf("  other=%s:%.1fus", results[1 - best].first, results[1 - best].second.t.us);
  std::printf("\n");
  std::fflush(stdout);
  for (void* p : g_buffers) CK(cudaFree(p));
  g_buffers.clear();
  return ok;
}

void usage(const char* prog) {
  std::printf("usage: %s [--reps N] [--shape NAME] [--ragged] [--kernel coop|pingpong|best] [--raster m|n|h] "
              "[--swizzle 1|2|4|8] [--sweep]\nshapes:", prog);
  for (const GemmShape& s : kShapes) std::printf(" %s", s.name);
  std::printf("\n");
}

}  // namespace cutlass_bench

int main(int argc, char** argv) {
  using namespace cutlass_bench;
  int reps = 20;
  std::string only, kernel = "best";
  bool ragged = false, sweep = false;
  Sched sched{'m', 1};
  for (int i = 1; i < argc; ++i) {
    if (!std::strcmp(argv[i], "--reps") && i + 1 < argc) {
      reps = std::atoi(argv[++i]);
    } else if (!std::strcmp(argv[i], "--shape") && i + 1 < argc) {
      only = argv[++i];
    } else if (!std::strcmp(argv[i], "--ragged")) {
      ragged = true;
    } else if (!std::strcmp(argv[i], "--kernel") && i + 1 < argc) {
      kernel = argv[++i];
    } else if (!std::strcmp(argv[i], "--raster") && i + 1 < argc) {
      sched.raster = argv[++i][0];
    } else if (!std::strcmp(argv[i], "--swizzle") && i + 1 < argc) {
      sched.swizzle = std::atoi(argv[++i]);
    } else if (!std::strcmp(argv[i], "--sweep")) {
      sweep = true;
    } else {
      usage(argv[0]);
      return std::strcmp(argv[i], "--help") && std::strcmp(argv[i], "-h") ? 2 : 0;
    }
  }
  if (reps < 1) {
    std::fprintf(stderr, "--reps %d: expected at least 1\n", reps);
    return 2;
  }
  if (kernel != "coop" && kernel != "pingpong" && kernel != "best") {
    std::fprintf(stderr, "--kernel %s: expected coop, pingpong or best (both, the faster reported)\n", kernel.c_str());
    return 2;
  }
  if (std::strchr("mnh", sched.raster) == nullptr || sched.raster == 0) {
    std::fprintf(stderr, "--raster %c: expected m (along M), n (along N) or h (CUTLASS's heuristic)\n", sched.raster);
    return 2;
  }
  if (sched.swizzle != 1 && sched.swizzle != 2 && sched.swizzle != 4 && sched.swizzle != 8) {
    std::fprintf(stderr, "--swizzle %d: expected 1, 2, 4 or 8\n", sched.swizzle);
    return 2;
  }
  std::vector<Sched> scheds{sched};
  if (sweep) {
    scheds.clear();
    for (char r : {'m', 'n'})
      for (int z : {1, 2, 4, 8}) scheds.push_back({r, z});
  }
  const GemmShape* chosen = nullptr;
  for (const GemmShape& s : kShapes)
    if (only == s.name) chosen = &s;
  if (!only.empty() && !chosen) {
    std::fprintf(stderr, "--shape %s: unknown; expected one of the names below\n", only.c_str());
    usage(argv[0]);
    return 2;
  }

  cudaDeviceProp prop;
  if (!flowmoe::bench::device_properties("flowmoe_bench_cutlass", &prop)) return 1;
  if (prop.major != 9) {
    std::fprintf(stderr, "flowmoe_bench_cutlass: %s is sm_%d%d; this binary runs on sm_90 (Hopper) only\n",
                 prop.name, prop.major, prop.minor);
    return 1;
  }
  std::printf("# %s, %d SMs; CUTLASS %d.%d.%d grouped blockwise FP8, kernel %s (coop: cooperative, tile "
              "128x128x128, cluster 1x2x1; pingpong: tile 64x128x128, cluster 1x1x1), problem shapes on the "
              "device only; us = median of %d launches%s\n",
              prop.name, prop.multiProcessorCount, CUTLASS_MAJOR, CUTLASS_MINOR, CUTLASS_PATCH, kernel.c_str(), reps,
              sweep ? ", the fastest of 8 scheduler settings" : "");
  cudaStream_t stream;  // blocking: ordered after the synchronous uploads on the default stream
  CK(cudaStreamCreate(&stream));
  bool all_ok = true;
  for (const GemmShape& s : kShapes)
    if (!chosen || chosen == &s) all_ok = run_shape(s, reps, ragged, kernel, scheds, stream) && all_ok;
  CK(cudaStreamDestroy(stream));
  return all_ok ? 0 : 1;
}
