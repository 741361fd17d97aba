// Grouped expert GEMMs on cuBLASLt: one matmul per non-empty expert (flowmoe/gemm.h).
//
// Row-major flowmoe tensors are column-major cuBLAS matrices transposed, so each pass is set up
// as D (m x n, column-major) = op(A) (m x k) . op(B) (k x n):
//   pass           m     n     k     A (stored)                 B (stored)              D
//   FP8 fprop      N     M_e   K     W_e  [N,K]  T, ld K       X_e  [M_e,K] N, ld K     Y_e  ld N
//   FP8 dgrad      K     M_e   N     Wt_e [K,N]  T, ld N       dY_e [M_e,N] N, ld N     dX_e ld K
//   FP8 wgrad      K     N     M_e   Xc   [K,M]+off T, ld M    dYc  [N,M]+off N, ld M   dW_e ld K
//   BF16 fprop     N     M_e   K     W_e  T, ld K               X_e  N, ld K             Y_e  ld N
//   BF16 dgrad     K     M_e   N     W_e  N, ld K               dY_e N, ld N             dX_e ld K
//   BF16 wgrad     K     N     M_e   X_e  N, ld K               dY_e T, ld N             dW_e ld K
// FP8 is "TN" throughout (Hopper's requirement). Scales (cuBLAS docs 3.1.4.5.1): VEC128_32F is
// M-major [L][m] for A and N-major [L][n] for B; BLK128x128_32F is K-major with a column stride
// that is a multiple of 4: [ceil(m/128)][round_up(L, 4)]. So fprop/dgrad use A = weight
// (BLK128x128) and B = activation (VEC128, [L][M_e]: the expert-packed layout); wgrad uses
// VEC128 for both, which is the column-wise layout [NB][C] sliced at the expert's first block.
#include <cublasLt.h>
#include <cuda_runtime.h>

#include <cstring>
#include <string>
#include <unordered_map>

#include "cuda/common.cuh"
#include "flowmoe/gemm.h"

namespace flowmoe {
namespace cuda {
namespace {

#define FLOWMOE_CUBLAS_CHECK(expr, context)                                                   \
  do {                                                                                       \
    cublasStatus_t flowmoe_st_ = (expr);                                                     \
    if (flowmoe_st_ != CUBLAS_STATUS_SUCCESS) {                                              \
      std::ostringstream flowmoe_os_;                                                        \
      flowmoe_os_ << context << ": " << #expr << " failed: " << cublasLtGetStatusName(flowmoe_st_) \
                  << " (" << cublasLtGetStatusString(flowmoe_st_) << ")";                    \
      throw ::flowmoe::Error(__FILE__, __LINE__, flowmoe_os_.str());                         \
    }                                                                                        \
  } while (0)

enum Desc : int { kDescF8Blk, kDescF8Vec, kDescTN, kDescNN, kDescNT, kNumDescs };

enum class Op : uint8_t {
  kF8Rowwise,    // FP8 fprop and dgrad: TN, A 128x128 blocks, B 1x128, D BF16
  kF8WgradBf16,  // FP8 wgrad: TN, both 1x128, D BF16
  kF8WgradF32,   // FP8 wgrad: D FP32
  kB16Fprop,     // BF16 TN
  kB16Dgrad,     // BF16 NN
  kB16WgradBf16, // BF16 NT, D BF16
  kB16WgradF32,  // BF16 NT, D FP32
};

struct OpInfo {
  Desc desc;
  bool fp8;
  cublasOperation_t ta, tb;
  cudaDataType_t ab_type, d_type;
  const char* name;
};

const OpInfo& op_info(Op op) {
  static const OpInfo kInfo[] = {
      {kDescF8Blk, true, CUBLAS_OP_T, CUBLAS_OP_N, CUDA_R_8F_E4M3, CUDA_R_16BF, "FP8 1x128 x 128x128"},
      {kDescF8Vec, true, CUBLAS_OP_T, CUBLAS_OP_N, CUDA_R_8F_E4M3, CUDA_R_16BF, "FP8 wgrad -> BF16"},
      {kDescF8Vec, true, CUBLAS_OP_T, CUBLAS_OP_N, CUDA_R_8F_E4M3, CUDA_R_32F, "FP8 wgrad -> FP32"},
      {kDescTN, false, CUBLAS_OP_T, CUBLAS_OP_N, CUDA_R_16BF, CUDA_R_16BF, "BF16 fprop"},
      {kDescNN, false, CUBLAS_OP_N, CUBLAS_OP_N, CUDA_R_16BF, CUDA_R_16BF, "BF16 dgrad"},
      {kDescNT, false, CUBLAS_OP_N, CUBLAS_OP_T, CUDA_R_16BF, CUDA_R_16BF, "BF16 wgrad -> BF16"},
      {kDescNT, false, CUBLAS_OP_N, CUBLAS_OP_T, CUDA_R_16BF, CUDA_R_32F, "BF16 wgrad -> FP32"},
  };
  return kInfo[static_cast<int>(op)];
}

struct PlanKey {
  int64_t m, n, k, lda, ldb, ldd;
  uint16_t align[4];  // A, B, C (= D), D: largest power of two <= 256 dividing the address
  uint8_t op;
  uint8_t beta;
  bool operator==(const PlanKey& o) const {
    return m == o.m && n == o.n && k == o.k && lda == o.lda && ldb == o.ldb && ldd == o.ldd &&
           std::memcmp(align, o.align, sizeof(align)) == 0 && op == o.op && beta == o.beta;
  }
};
struct PlanKeyHash {
  size_t operator()(const PlanKey& p) const {
    uint64_t h = 1469598103934665603ull;
    auto mix = [&h](uint64_t v) { h = (h ^ v) * 1099511628211ull; };
    mix(p.m); mix(p.n); mix(p.k); mix(p.lda); mix(p.ldb); mix(p.ldd);
    mix((uint64_t(p.align[0]) << 48) | (uint64_t(p.align[1]) << 32) | (uint64_t(p.align[2]) << 16) | p.align[3]);
    mix((uint64_t(p.op) << 8) | p.beta);
    return static_cast<size_t>(h);
  }
};

struct Plan {
  cublasLtMatrixLayout_t a = nullptr, b = nullptr, c = nullptr, d = nullptr;
  cublasLtMatmulAlgo_t algo{};
};

uint16_t align_of(const void* p) {
  const uintptr_t a = reinterpret_cast<uintptr_t>(p);
  const uintptr_t low = a & (~a + 1);
  return static_cast<uint16_t>(low == 0 || low > 256 ? 256 : low);
}

constexpr size_t kMaxPlans = 8192;  // cache bound: cleared when full (token counts change per step)

}  // namespace

struct GroupedGemm::Impl {
  cublasLtHandle_t handle = nullptr;
  cublasLtMatmulDesc_t desc[kNumDescs] = {};
  cublasLtMatmulPreference_t pref = nullptr;
  void* workspace = nullptr;
  size_t workspace_bytes = 0;
  int cc_major = 0, cc_minor = 0;
  size_t lt_version = 0;
  std::unordered_map<PlanKey, Plan, PlanKeyHash> plans;
  Stats stats;

  explicit Impl(size_t ws) : workspace_bytes(ws) {
    int dev = 0;
    FLOWMOE_CUDA_CHECK(cudaGetDevice(&dev));
    FLOWMOE_CUDA_CHECK(cudaDeviceGetAttribute(&cc_major, cudaDevAttrComputeCapabilityMajor, dev));
    FLOWMOE_CUDA_CHECK(cudaDeviceGetAttribute(&cc_minor, cudaDevAttrComputeCapabilityMinor, dev));
    lt_version = cublasLtGetVersion();
    FLOWMOE_CUBLAS_CHECK(cublasLtCreate(&handle), "GroupedGemm");
    try {
      if (workspace_bytes) FLOWMOE_CUDA_CHECK(cudaMalloc(&workspace, workspace_bytes));
      FLOWMOE_CUBLAS_CHECK(cublasLtMatmulPreferenceCreate(&pref), "GroupedGemm");
      FLOWMOE_CUBLAS_CHECK(cublasLtMatmulPreferenceSetAttribute(
                               pref, CUBLASLT_MATMUL_PREF_MAX_WORKSPACE_BYTES, &workspace_bytes,
                               sizeof(workspace_bytes)),
                           "GroupedGemm");
      make_desc(kDescF8Blk, CUBLAS_OP_T, CUBLAS_OP_N, CUBLASLT_MATMUL_MATRIX_SCALE_BLK128x128_32F,
                CUBLASLT_MATMUL_MATRIX_SCALE_VEC128_32F);
      make_desc(kDescF8Vec, CUBLAS_OP_T, CUBLAS_OP_N, CUBLASLT_MATMUL_MATRIX_SCALE_VEC128_32F,
                CUBLASLT_MATMUL_MATRIX_SCALE_VEC128_32F);
      make_desc(kDescTN, CUBLAS_OP_T, CUBLAS_OP_N, -1, -1);
      make_desc(kDescNN, CUBLAS_OP_N, CUBLAS_OP_N, -1, -1);
      make_desc(kDescNT, CUBLAS_OP_N, CUBLAS_OP_T, -1, -1);
    } catch (...) {
      destroy();
      throw;
    }
  }
  ~Impl() { destroy(); }

  void destroy() {
    clear_plans();
    for (auto& d : desc)
      if (d) cublasLtMatmulDescDestroy(d), d = nullptr;
    if (pref) cublasLtMatmulPreferenceDestroy(pref), pref = nullptr;
    if (workspace) cudaFree(workspace), workspace = nullptr;
    if (handle) cublasLtDestroy(handle), handle = nullptr;
  }

  void clear_plans() {
    for (auto& kv : plans) {
      Plan& p = kv.second;
      if (p.a) cublasLtMatrixLayoutDestroy(p.a);
      if (p.b) cublasLtMatrixLayoutDestroy(p.b);
      if (p.c) cublasLtMatrixLayoutDestroy(p.c);
      if (p.d) cublasLtMatrixLayoutDestroy(p.d);
    }
    plans.clear();
  }

  void make_desc(Desc id, cublasOperation_t ta, cublasOperation_t tb, int32_t a_mode, int32_t b_mode) {
    cublasLtMatmulDesc_t d = nullptr;
    FLOWMOE_CUBLAS_CHECK(cublasLtMatmulDescCreate(&d, CUBLAS_COMPUTE_32F, CUDA_R_32F), "GroupedGemm");
    desc[id] = d;
    FLOWMOE_CUBLAS_CHECK(cublasLtMatmulDescSetAttribute(d, CUBLASLT_MATMUL_DESC_TRANSA, &ta, sizeof(ta)),
                         "GroupedGemm");
    FLOWMOE_CUBLAS_CHECK(cublasLtMatmulDescSetAttribute(d, CUBLASLT_MATMUL_DESC_TRANSB, &tb, sizeof(tb)),
                         "GroupedGemm");
    if (a_mode >= 0) {
      FLOWMOE_CUBLAS_CHECK(
          cublasLtMatmulDescSetAttribute(d, CUBLASLT_MATMUL_DESC_A_SCALE_MODE, &a_mode, sizeof(a_mode)),
          "GroupedGemm");
      FLOWMOE_CUBLAS_CHECK(
          cublasLtMatmulDescSetAttribute(d, CUBLASLT_MATMUL_DESC_B_SCALE_MODE, &b_mode, sizeof(b_mode)),
          "GroupedGemm");
    }
  }

  void require_fp8(const char* what) const {
    FLOWMOE_CHECK(cc_major == 9,
                  what << ": cuBLASLt's block-scaled FP8 modes (VEC128_32F, BLK128x128_32F) run on "
                          "compute capability 9.0 (Hopper) only; this device is sm_"
                       << cc_major << cc_minor << ". Use the BF16 path.");
    FLOWMOE_CHECK(lt_version >= 120900, what << ": cuBLASLt " << lt_version
                                             << " is too old for block-scaled FP8; expected >= "
                                                "12.9 (120900)");
  }

  Plan& plan_for(const PlanKey& key, const OpInfo& info, const char* what, int expert) {
    auto it = plans.find(key);
    if (it != plans.end()) return it->second;
    if (plans.size() >= kMaxPlans) clear_plans();
    Plan p;
    auto ctx = [&] {
      std::ostringstream os;
      os << what << " (" << info.name << ", expert " << expert << ": m " << key.m << ", n " << key.n
         << ", k " << key.k << ", lda " << key.lda << ", ldb " << key.ldb << ", ldd " << key.ldd
         << ")";
      return os.str();
    };
    try {
      const bool ta = info.ta == CUBLAS_OP_T, tb = info.tb == CUBLAS_OP_T;
      FLOWMOE_CUBLAS_CHECK(cublasLtMatrixLayoutCreate(&p.a, info.ab_type, ta ? key.k : key.m,
                                                      ta ? key.m : key.k, key.lda),
                           ctx());
      FLOWMOE_CUBLAS_CHECK(cublasLtMatrixLayoutCreate(&p.b, info.ab_type, tb ? key.n : key.k,
                                                      tb ? key.k : key.n, key.ldb),
                           ctx());
      FLOWMOE_CUBLAS_CHECK(cublasLtMatrixLayoutCreate(&p.c, info.d_type, key.m, key.n, key.ldd), ctx());
      FLOWMOE_CUBLAS_CHECK(cublasLtMatrixLayoutCreate(&p.d, info.d_type, key.m, key.n, key.ldd), ctx());
      const cublasLtMatmulPreferenceAttributes_t attrs[4] = {
          CUBLASLT_MATMUL_PREF_MIN_ALIGNMENT_A_BYTES, CUBLASLT_MATMUL_PREF_MIN_ALIGNMENT_B_BYTES,
          CUBLASLT_MATMUL_PREF_MIN_ALIGNMENT_C_BYTES, CUBLASLT_MATMUL_PREF_MIN_ALIGNMENT_D_BYTES};
      for (int i = 0; i < 4; ++i) {
        const uint32_t a = key.align[i];
        FLOWMOE_CUBLAS_CHECK(cublasLtMatmulPreferenceSetAttribute(pref, attrs[i], &a, sizeof(a)), ctx());
      }
      cublasLtMatmulHeuristicResult_t res{};
      int returned = 0;
      ++stats.heuristic_queries;
      FLOWMOE_CUBLAS_CHECK(cublasLtMatmulAlgoGetHeuristic(handle, desc[info.desc], p.a, p.b, p.c, p.d,
                                                          pref, 1, &res, &returned),
                           ctx());
      FLOWMOE_CHECK(returned > 0 && res.state == CUBLAS_STATUS_SUCCESS,
                    ctx() << ": cuBLASLt's heuristic returned no algorithm for this problem (device sm_"
                          << cc_major << cc_minor << ", cuBLASLt " << lt_version
                          << "); see docs/GEMM.md for the shapes and alignments it supports");
      p.algo = res.algo;
    } catch (...) {
      if (p.a) cublasLtMatrixLayoutDestroy(p.a);
      if (p.b) cublasLtMatrixLayoutDestroy(p.b);
      if (p.c) cublasLtMatrixLayoutDestroy(p.c);
      if (p.d) cublasLtMatrixLayoutDestroy(p.d);
      throw;
    }
    return plans.emplace(key, p).first->second;
  }

  // D (m x n) = op(A) op(B) (+ D when accumulate), column-major. sa, sb: FP32 scale pointers (FP8).
  void matmul(Op op, int64_t m, int64_t n, int64_t k, const void* A, int64_t lda, const void* B,
              int64_t ldb, void* D, int64_t ldd, bool accumulate, const float* sa, const float* sb,
              cudaStream_t stream, const char* what, int expert) {
    const OpInfo& info = op_info(op);
    cublasLtMatmulDesc_t d = desc[info.desc];
    PlanKey key{};
    key.m = m; key.n = n; key.k = k; key.lda = lda; key.ldb = ldb; key.ldd = ldd;
    key.align[0] = align_of(A);
    key.align[1] = align_of(B);
    key.align[2] = key.align[3] = align_of(D);
    key.op = static_cast<uint8_t>(op);
    key.beta = accumulate ? 1 : 0;
    if (info.fp8) {
      // Read by cublasLtMatmul when it enqueues: changing them for the next expert is safe. Set
      // before a heuristic query too, which sees the descriptor as the matmul will.
      FLOWMOE_CUBLAS_CHECK(cublasLtMatmulDescSetAttribute(d, CUBLASLT_MATMUL_DESC_A_SCALE_POINTER, &sa, sizeof(sa)), what);
      FLOWMOE_CUBLAS_CHECK(cublasLtMatmulDescSetAttribute(d, CUBLASLT_MATMUL_DESC_B_SCALE_POINTER, &sb, sizeof(sb)), what);
    }
    Plan& p = plan_for(key, info, what, expert);
    const float alpha = 1.0f, beta = accumulate ? 1.0f : 0.0f;
    const cublasStatus_t st = cublasLtMatmul(handle, d, &alpha, A, p.a, B, p.b, &beta, D, p.c, D, p.d,
                                             &p.algo, workspace, workspace_bytes, stream);
    if (st != CUBLAS_STATUS_SUCCESS) {
      std::ostringstream os;
      os << what << " (" << info.name << ", expert " << expert << ": m " << m << ", n " << n << ", k "
         << k << "): cublasLtMatmul failed: " << cublasLtGetStatusName(st) << " ("
         << cublasLtGetStatusString(st) << ")";
      throw Error(__FILE__, __LINE__, os.str());
    }
    ++stats.matmuls;
  }

  void zero_fill(void* p, size_t bytes, cudaStream_t stream) {
    FLOWMOE_CUDA_CHECK(cudaMemsetAsync(p, 0, bytes, stream));
    ++stats.zero_fills;
  }
};

GroupedGemm::GroupedGemm(size_t workspace_bytes) : impl_(new Impl(workspace_bytes)) {}
GroupedGemm::~GroupedGemm() = default;

GroupedGemm::Stats GroupedGemm::stats() const {
  Stats s = impl_->stats;
  s.cached_plans = static_cast<int64_t>(impl_->plans.size());
  return s;
}
void GroupedGemm::clear_cache() { impl_->clear_plans(); }

// ---- FP8 ---------------------------------------------------------------------------------------
void GroupedGemm::fprop(const Segments& seg, int64_t n, int64_t k, const Fp8Operand& x,
                        const Fp8Operand& w, Span<bf16_t> y, cudaStream_t stream) {
  const char* what = "FP8 fprop";
  gemm::check_fp8_fprop(seg, n, k, x, w, {y.data, y.size});
  impl_->require_fp8(what);
  const int64_t L = k / kFp8Block, w_scales = (n / kFp8Block) * gemm::weight_scale_ld(k);
  for (int e = 0; e < seg.num_segments(); ++e) {
    const int64_t off = seg.offsets[e], me = seg.offsets[e + 1] - off;
    if (me == 0) continue;
    impl_->matmul(Op::kF8Rowwise, n, me, k, w.codes.data + e * n * k, k, x.codes.data + off * k, k,
                  y.data + off * n, n, false, w.scales.data + e * w_scales, x.scales.data + L * off,
                  stream, what, e);
  }
}

void GroupedGemm::dgrad(const Segments& seg, int64_t n, int64_t k, const Fp8Operand& dy,
                        const Fp8Operand& wt, Span<bf16_t> dx, cudaStream_t stream) {
  const char* what = "FP8 dgrad";
  gemm::check_fp8_dgrad(seg, n, k, dy, wt, {dx.data, dx.size});
  impl_->require_fp8(what);
  const int64_t L = n / kFp8Block, w_scales = (k / kFp8Block) * gemm::weight_scale_ld(n);
  for (int e = 0; e < seg.num_segments(); ++e) {
    const int64_t off = seg.offsets[e], me = seg.offsets[e + 1] - off;
    if (me == 0) continue;
    impl_->matmul(Op::kF8Rowwise, k, me, n, wt.codes.data + e * n * k, n, dy.codes.data + off * n, n,
                  dx.data + off * k, k, false, wt.scales.data + e * w_scales,
                  dy.scales.data + L * off, stream, what, e);
  }
}

namespace {
size_t wgrad_elem_bytes(const gemm::WgradOut& dw) {
  return dw.kind == gemm::WgradOut::Kind::kBf16 ? sizeof(bf16_t) : sizeof(float);
}
}  // namespace

void GroupedGemm::wgrad(const Segments& seg, int64_t n, int64_t k, const Fp8Operand& dy_col,
                        const Fp8Operand& x_col, const WgradOut& dw, cudaStream_t stream) {
  const char* what = "FP8 wgrad";
  gemm::check_fp8_wgrad(seg, n, k, dy_col, x_col, dw);
  impl_->require_fp8(what);
  const int64_t m = seg.num_tokens();
  const bool acc = dw.kind == WgradOut::Kind::kF32Accumulate;
  const Op op = dw.kind == WgradOut::Kind::kBf16 ? Op::kF8WgradBf16 : Op::kF8WgradF32;
  const size_t eb = wgrad_elem_bytes(dw);
  int64_t block = 0;  // first 128-token block of expert e
  for (int e = 0; e < seg.num_segments(); ++e) {
    const int64_t off = seg.offsets[e], me = seg.offsets[e + 1] - off;
    char* out = static_cast<char*>(dw.data) + static_cast<int64_t>(e) * n * k * eb;
    if (me == 0) {
      if (!acc) impl_->zero_fill(out, n * k * eb, stream);
      continue;
    }
    impl_->matmul(op, k, n, me, x_col.codes.data + off, m, dy_col.codes.data + off, m, out, k, acc,
                  x_col.scales.data + block * k, dy_col.scales.data + block * n, stream, what, e);
    block += (me + kFp8Block - 1) / kFp8Block;
  }
}

// ---- BF16 --------------------------------------------------------------------------------------
void GroupedGemm::fprop_bf16(const Segments& seg, int64_t n, int64_t k, Span<const bf16_t> x,
                             Span<const bf16_t> w, Span<bf16_t> y, cudaStream_t stream) {
  gemm::check_bf16(gemm::Pass::kFprop, seg, n, k, x, w, y.data, y.size);
  for (int e = 0; e < seg.num_segments(); ++e) {
    const int64_t off = seg.offsets[e], me = seg.offsets[e + 1] - off;
    if (me == 0) continue;
    impl_->matmul(Op::kB16Fprop, n, me, k, w.data + e * n * k, k, x.data + off * k, k, y.data + off * n,
                  n, false, nullptr, nullptr, stream, "BF16 fprop", e);
  }
}

void GroupedGemm::dgrad_bf16(const Segments& seg, int64_t n, int64_t k, Span<const bf16_t> dy,
                             Span<const bf16_t> w, Span<bf16_t> dx, cudaStream_t stream) {
  gemm::check_bf16(gemm::Pass::kDgrad, seg, n, k, dy, w, dx.data, dx.size);
  for (int e = 0; e < seg.num_segments(); ++e) {
    const int64_t off = seg.offsets[e], me = seg.offsets[e + 1] - off;
    if (me == 0) continue;
    impl_->matmul(Op::kB16Dgrad, k, me, n, w.data + e * n * k, k, dy.data + off * n, n,
                  dx.data + off * k, k, false, nullptr, nullptr, stream, "BF16 dgrad", e);
  }
}

void GroupedGemm::wgrad_bf16(const Segments& seg, int64_t n, int64_t k, Span<const bf16_t> dy,
                             Span<const bf16_t> x, const WgradOut& dw, cudaStream_t stream) {
  FLOWMOE_CHECK(dw.kind == WgradOut::Kind::kBf16 || dw.kind == WgradOut::Kind::kF32 ||
                    dw.kind == WgradOut::Kind::kF32Accumulate,
                "BF16 wgrad: unknown output kind " << static_cast<int>(dw.kind));
  gemm::check_bf16(gemm::Pass::kWgrad, seg, n, k, dy, x, dw.data, dw.size);
  const bool acc = dw.kind == WgradOut::Kind::kF32Accumulate;
  const Op op = dw.kind == WgradOut::Kind::kBf16 ? Op::kB16WgradBf16 : Op::kB16WgradF32;
  const size_t eb = wgrad_elem_bytes(dw);
  for (int e = 0; e < seg.num_segments(); ++e) {
    const int64_t off = seg.offsets[e], me = seg.offsets[e + 1] - off;
    char* out = static_cast<char*>(dw.data) + static_cast<int64_t>(e) * n * k * eb;
    if (me == 0) {
      if (!acc) impl_->zero_fill(out, n * k * eb, stream);
      continue;
    }
    impl_->matmul(op, k, n, me, x.data + off * k, k, dy.data + off * n, n, out, k, acc, nullptr,
                  nullptr, stream, "BF16 wgrad", e);
  }
}

}  // namespace cuda
}  // namespace flowmoe
