// Grouped expert GEMMs on cuBLASLt: one matmul per non-empty expert, over a small pool of streams,
// with the algorithm timed once per problem key (flowmoe/gemm.h).
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
//
// A call has two phases (docs/GEMM.md, "Concurrency and algorithm choice"). Prepare: every
// non-empty expert's plan (layouts, algorithm) is looked up or made; a new tuning key is timed
// here, on the caller's stream, before anything of the call is launched. Launch: zero fills on the
// caller's stream, then the matmuls round-robin over the caller's stream and the pool streams
// (pool_priority > 0: over the pool streams only), with a fork event on the caller's stream and
// one join event per pool stream used, each stream with its own workspace. Experts write disjoint outputs and each matmul is deterministic for a fixed algorithm
// and workspace size, so the result does not depend on the number of streams.
#include <cublasLt.h>
#include <cuda_runtime.h>

#include <algorithm>
#include <cstring>
#include <mutex>
#include <string>
#include <unordered_map>
#include <utility>
#include <vector>

#include "cuda/common.cuh"
#include "cuda/gemm/sm90_fp8_wgrad_1x128.h"
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
  bool tokens_in_k;  // tokens are the GEMM's k (wgrad), else its n (fprop, dgrad)
  const char* name;
};

const OpInfo& op_info(Op op) {
  static const OpInfo kInfo[] = {
      {kDescF8Blk, true, CUBLAS_OP_T, CUBLAS_OP_N, CUDA_R_8F_E4M3, CUDA_R_16BF, false, "FP8 1x128 x 128x128"},
      {kDescF8Vec, true, CUBLAS_OP_T, CUBLAS_OP_N, CUDA_R_8F_E4M3, CUDA_R_16BF, true, "FP8 wgrad -> BF16"},
      {kDescF8Vec, true, CUBLAS_OP_T, CUBLAS_OP_N, CUDA_R_8F_E4M3, CUDA_R_32F, true, "FP8 wgrad -> FP32"},
      {kDescTN, false, CUBLAS_OP_T, CUBLAS_OP_N, CUDA_R_16BF, CUDA_R_16BF, false, "BF16 fprop"},
      {kDescNN, false, CUBLAS_OP_N, CUBLAS_OP_N, CUDA_R_16BF, CUDA_R_16BF, false, "BF16 dgrad"},
      {kDescNT, false, CUBLAS_OP_N, CUBLAS_OP_T, CUDA_R_16BF, CUDA_R_16BF, true, "BF16 wgrad -> BF16"},
      {kDescNT, false, CUBLAS_OP_N, CUBLAS_OP_T, CUDA_R_16BF, CUDA_R_32F, true, "BF16 wgrad -> FP32"},
  };
  return kInfo[static_cast<int>(op)];
}

size_t d_elem_bytes(const OpInfo& info) { return info.d_type == CUDA_R_32F ? 4 : 2; }

uint64_t fnv_mix(uint64_t h, uint64_t v) { return (h ^ v) * 1099511628211ull; }
constexpr uint64_t kFnvBasis = 1469598103934665603ull;

// The exact problem of one expert: the plan cache's key.
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
    uint64_t h = kFnvBasis;
    for (uint64_t v : {uint64_t(p.m), uint64_t(p.n), uint64_t(p.k), uint64_t(p.lda), uint64_t(p.ldb), uint64_t(p.ldd)})
      h = fnv_mix(h, v);
    h = fnv_mix(h, (uint64_t(p.align[0]) << 48) | (uint64_t(p.align[1]) << 32) | (uint64_t(p.align[2]) << 16) | p.align[3]);
    h = fnv_mix(h, (uint64_t(p.op) << 8) | p.beta);
    return static_cast<size_t>(h);
  }
};

struct Plan {
  cublasLtMatrixLayout_t a = nullptr, b = nullptr, c = nullptr, d = nullptr;
  cublasLtMatmulAlgo_t algo{};
  bool fallback = false;  // tuned key's algorithm replaced by the heuristic's first for this shape
};

// The tuning key: the problem with the token dimension replaced by its bucket
// (gemm::tune_token_bucket), without leading dimensions (FP8 wgrad's is the total token count,
// which changes every step) and without pointer alignments: the candidates are asked for 16-byte
// alignment, which every operand has (gemm.h's checks), so the winner runs on every expert of the
// key. Device, workspace size and candidate count take part because they decide the candidates.
struct TuneKey {
  int64_t m, n, k;
  size_t workspace;
  int device, candidates;
  uint8_t op, beta;
  bool operator==(const TuneKey& o) const {
    return m == o.m && n == o.n && k == o.k && workspace == o.workspace && device == o.device &&
           candidates == o.candidates && op == o.op && beta == o.beta;
  }
};
struct TuneKeyHash {
  size_t operator()(const TuneKey& t) const {
    uint64_t h = kFnvBasis;
    for (uint64_t v : {uint64_t(t.m), uint64_t(t.n), uint64_t(t.k), uint64_t(t.workspace)}) h = fnv_mix(h, v);
    h = fnv_mix(h, (uint64_t(uint32_t(t.device)) << 32) | uint32_t(t.candidates));
    h = fnv_mix(h, (uint64_t(t.op) << 8) | t.beta);
    return static_cast<size_t>(h);
  }
};

// The algorithm chosen for one tuning key, and how.
struct Tuned {
  cublasLtMatmulAlgo_t algo{};
  GroupedGemm::TuneRecord rec;
};

// Choices shared by every GroupedGemm of the process (Options::share_tuning). Never destroyed:
// objects may outlive static destruction.
struct SharedChoices {
  std::mutex mu;
  std::unordered_map<TuneKey, Tuned, TuneKeyHash> map;
};
SharedChoices& shared_choices() {
  static SharedChoices* s = new SharedChoices;
  return *s;
}

// The scratch output of accumulating wgrad trials: one buffer per device for the whole process,
// sized by the largest tune_scratch_bytes of the live tuning objects (allocated in their
// constructors) and freed with the last of them. Trials use it only under the lock and synchronise
// before releasing it, so no GPU work touches it outside the lock and it may be replaced then.
struct SharedScratch {
  struct Buffer {
    char* p = nullptr;
    size_t bytes = 0;
    int users = 0;
  };
  std::mutex mu;
  std::unordered_map<int, Buffer> per_device;
};
SharedScratch& shared_scratch() {
  static SharedScratch* s = new SharedScratch;
  return *s;
}

// One expert's matmul of the call being prepared.
struct Launch {
  const PlanKey* key;
  Plan* plan;
  Op op;
  int64_t m, n, k, ldd;
  const void* A;
  const void* B;
  void* D;
  bool acc;
  const float *sa, *sb;
  int expert;
};

// What a failing cuBLASLt call was doing, spelled only when it fails.
struct Ctx {
  const char* what;
  const OpInfo& info;
  int expert;
  const PlanKey& key;
  std::string str() const {
    std::ostringstream os;
    os << what << " (" << info.name << ", expert " << expert << ": m " << key.m << ", n " << key.n << ", k "
       << key.k << ", lda " << key.lda << ", ldb " << key.ldb << ", ldd " << key.ldd << ")";
    return os.str();
  }
};

uint16_t align_of(const void* p) {
  const uintptr_t a = reinterpret_cast<uintptr_t>(p);
  const uintptr_t low = a & (~a + 1);
  return static_cast<uint16_t>(low == 0 || low > 256 ? 256 : low);
}
constexpr uint16_t kAlign16[4] = {16, 16, 16, 16};  // what gemm.h guarantees for every operand

constexpr size_t kMaxPlans = 8192;  // cache bound: cleared when full (token counts change per step)
constexpr int kMaxCand = gemm::GroupedGemmOptions::kMaxCandidates;

// Whether work enqueued on `s` would be captured into a graph (then nothing is timed). An error
// (the legacy stream while another thread captures) counts as capturing.
bool capturing(cudaStream_t s) {
  cudaStreamCaptureStatus st = cudaStreamCaptureStatusNone;
  if (cudaStreamIsCapturing(s, &st) != cudaSuccess) {
    (void)cudaGetLastError();
    return true;
  }
  return st != cudaStreamCaptureStatusNone;
}

}  // namespace

struct GroupedGemm::Impl {
  Options opt;
  int device = 0, cc_major = 0, cc_minor = 0;
  size_t lt_version = 0;
  cublasLtHandle_t handle = nullptr;
  cublasLtMatmulDesc_t desc[kNumDescs] = {};
  cublasLtMatmulPreference_t pref = nullptr;
  // One device buffer: stream slot i's workspace at [i * ws_stride, (i + 1) * ws_stride).
  char* buffer = nullptr;
  size_t buffer_bytes = 0, ws_stride = 0;
  int* tile_counter = nullptr;  // the sm_90a wgrad kernel's tile counter (one int)
  bool scratch_user = false;  // registered with shared_scratch() for this device
  // pool_priority == 0: slots 1 .. streams - 1 (slot 0 is the caller's stream); > 0: every slot
  // (pool[i] is slot i), created above the default priority.
  std::vector<cudaStream_t> pool;
  std::vector<cudaEvent_t> joined;  // one per pool stream
  cudaEvent_t forked = nullptr;
  std::vector<cudaEvent_t> timing;  // start and stop per candidate
  int active = 1;                   // slots in use (set_concurrency)
  std::unordered_map<PlanKey, Plan, PlanKeyHash> plans;
  std::unordered_map<TuneKey, Tuned, TuneKeyHash> tuned;  // this object's copy of its choices
  std::vector<TuneRecord> records;
  Stats stats;
  // the call being prepared (kept to reuse their capacity)
  std::vector<Launch> launches;
  std::vector<std::pair<void*, size_t>> fills;

  explicit Impl(const Options& o) : opt(o) {
    opt.validate();
    FLOWMOE_CUDA_CHECK(cudaGetDevice(&device));
    FLOWMOE_CUDA_CHECK(cudaDeviceGetAttribute(&cc_major, cudaDevAttrComputeCapabilityMajor, device));
    FLOWMOE_CUDA_CHECK(cudaDeviceGetAttribute(&cc_minor, cudaDevAttrComputeCapabilityMinor, device));
    lt_version = cublasLtGetVersion();
    FLOWMOE_CUBLAS_CHECK(cublasLtCreate(&handle), "GroupedGemm");
    try {
      ws_stride = gemm::round_up(static_cast<int64_t>(opt.workspace_bytes), 256);
      buffer_bytes = static_cast<size_t>(opt.streams) * ws_stride;
      if (buffer_bytes) FLOWMOE_CUDA_CHECK(cudaMalloc(&buffer, buffer_bytes));
      if (opt.wgrad_kernel != Options::WgradKernel::kOff)
        FLOWMOE_CUDA_CHECK(cudaMalloc(&tile_counter, sizeof(int)));
      if (opt.tune && opt.tune_scratch_bytes) reserve_scratch();
      FLOWMOE_CUBLAS_CHECK(cublasLtMatmulPreferenceCreate(&pref), "GroupedGemm");
      FLOWMOE_CUBLAS_CHECK(cublasLtMatmulPreferenceSetAttribute(
                               pref, CUBLASLT_MATMUL_PREF_MAX_WORKSPACE_BYTES, &opt.workspace_bytes,
                               sizeof(opt.workspace_bytes)),
                           "GroupedGemm");
      make_desc(kDescF8Blk, CUBLAS_OP_T, CUBLAS_OP_N, CUBLASLT_MATMUL_MATRIX_SCALE_BLK128x128_32F,
                CUBLASLT_MATMUL_MATRIX_SCALE_VEC128_32F);
      make_desc(kDescF8Vec, CUBLAS_OP_T, CUBLAS_OP_N, CUBLASLT_MATMUL_MATRIX_SCALE_VEC128_32F,
                CUBLASLT_MATMUL_MATRIX_SCALE_VEC128_32F);
      make_desc(kDescTN, CUBLAS_OP_T, CUBLAS_OP_N, -1, -1);
      make_desc(kDescNN, CUBLAS_OP_N, CUBLAS_OP_N, -1, -1);
      make_desc(kDescNT, CUBLAS_OP_N, CUBLAS_OP_T, -1, -1);
      pool.reserve(opt.streams);
      joined.reserve(opt.streams);
      int least = 0, greatest = 0;  // numerically: least >= greatest (lower is more urgent)
      FLOWMOE_CUDA_CHECK(cudaDeviceGetStreamPriorityRange(&least, &greatest));
      const int prio = std::max(greatest, least - opt.pool_priority);
      for (int i = opt.pool_priority > 0 ? 0 : 1; i < opt.streams; ++i) {
        cudaStream_t s = nullptr;
        FLOWMOE_CUDA_CHECK(cudaStreamCreateWithPriority(&s, cudaStreamNonBlocking, prio));
        pool.push_back(s);
        cudaEvent_t e = nullptr;
        FLOWMOE_CUDA_CHECK(cudaEventCreateWithFlags(&e, cudaEventDisableTiming));
        joined.push_back(e);
      }
      if (!pool.empty()) FLOWMOE_CUDA_CHECK(cudaEventCreateWithFlags(&forked, cudaEventDisableTiming));
      if (opt.tune) {
        timing.reserve(2 * opt.candidates);
        for (int i = 0; i < 2 * opt.candidates; ++i) {
          cudaEvent_t e = nullptr;
          FLOWMOE_CUDA_CHECK(cudaEventCreate(&e));
          timing.push_back(e);
        }
      }
      active = opt.streams;
    } catch (...) {
      destroy();
      throw;
    }
  }
  ~Impl() { destroy(); }

  void reserve_scratch() {
    SharedScratch& sc = shared_scratch();
    std::lock_guard<std::mutex> lock(sc.mu);
    SharedScratch::Buffer& b = sc.per_device[device];
    if (b.bytes < opt.tune_scratch_bytes) {  // no trial runs now (they hold the lock): replace it
      if (b.p) FLOWMOE_CUDA_CHECK(cudaFree(b.p));
      b.p = nullptr;
      b.bytes = 0;
      FLOWMOE_CUDA_CHECK(cudaMalloc(&b.p, opt.tune_scratch_bytes));
      b.bytes = opt.tune_scratch_bytes;
    }
    ++b.users;
    scratch_user = true;
  }
  void release_scratch() {
    if (!scratch_user) return;
    SharedScratch& sc = shared_scratch();
    std::lock_guard<std::mutex> lock(sc.mu);
    SharedScratch::Buffer& b = sc.per_device[device];
    if (--b.users == 0 && b.p) {
      cudaFree(b.p);
      b.p = nullptr;
      b.bytes = 0;
    }
    scratch_user = false;
  }

  void destroy() {
    release_scratch();
    clear_plans();
    for (cudaEvent_t e : timing) cudaEventDestroy(e);
    for (cudaEvent_t e : joined) cudaEventDestroy(e);
    if (forked) cudaEventDestroy(forked), forked = nullptr;
    for (cudaStream_t s : pool) cudaStreamDestroy(s);
    timing.clear();
    joined.clear();
    pool.clear();
    for (auto& d : desc)
      if (d) cublasLtMatmulDescDestroy(d), d = nullptr;
    if (pref) cublasLtMatmulPreferenceDestroy(pref), pref = nullptr;
    if (buffer) cudaFree(buffer), buffer = nullptr;
    if (tile_counter) cudaFree(tile_counter), tile_counter = nullptr;
    if (handle) cublasLtDestroy(handle), handle = nullptr;
  }

  static void destroy_layouts(Plan& p) {
    if (p.a) cublasLtMatrixLayoutDestroy(p.a);
    if (p.b) cublasLtMatrixLayoutDestroy(p.b);
    if (p.c) cublasLtMatrixLayoutDestroy(p.c);
    if (p.d) cublasLtMatrixLayoutDestroy(p.d);
    p = Plan();
  }
  void clear_plans() {
    for (auto& kv : plans) destroy_layouts(kv.second);
    plans.clear();
  }

  void* workspace(int slot) const { return opt.workspace_bytes ? buffer + slot * ws_stride : nullptr; }

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

  // Read by cublasLtMatmul when it enqueues, so changing them for the next expert is safe. Set
  // before heuristic queries, checks and trials too, which then see the descriptor as the launch will.
  void set_scale_pointers(const Launch& L, const char* what) {
    cublasLtMatmulDesc_t d = desc[op_info(L.op).desc];
    FLOWMOE_CUBLAS_CHECK(cublasLtMatmulDescSetAttribute(d, CUBLASLT_MATMUL_DESC_A_SCALE_POINTER, &L.sa, sizeof(L.sa)), what);
    FLOWMOE_CUBLAS_CHECK(cublasLtMatmulDescSetAttribute(d, CUBLASLT_MATMUL_DESC_B_SCALE_POINTER, &L.sb, sizeof(L.sb)), what);
  }

  // D = op(A) op(B) (+ D when accumulating) with `algo`, writing `D` (the real output or, for
  // tuning trials of an accumulating wgrad, the scratch).
  cublasStatus_t run(const Launch& L, const cublasLtMatmulAlgo_t& algo, void* D, cudaStream_t s, void* ws) const {
    const Plan& p = *L.plan;
    const float alpha = 1.0f, beta = L.acc ? 1.0f : 0.0f;
    return cublasLtMatmul(handle, desc[op_info(L.op).desc], &alpha, L.A, p.a, L.B, p.b, &beta, D, p.c, D, p.d,
                          &algo, ws, opt.workspace_bytes, s);
  }

  // The heuristic's usable results (at most `requested`), best first; throws if there is none.
  int heuristic(const OpInfo& info, const Plan& p, const uint16_t align[4], int requested,
                cublasLtMatmulHeuristicResult_t* out, const Ctx& ctx) {
    const cublasLtMatmulPreferenceAttributes_t attrs[4] = {
        CUBLASLT_MATMUL_PREF_MIN_ALIGNMENT_A_BYTES, CUBLASLT_MATMUL_PREF_MIN_ALIGNMENT_B_BYTES,
        CUBLASLT_MATMUL_PREF_MIN_ALIGNMENT_C_BYTES, CUBLASLT_MATMUL_PREF_MIN_ALIGNMENT_D_BYTES};
    for (int i = 0; i < 4; ++i) {
      const uint32_t a = align[i];
      FLOWMOE_CUBLAS_CHECK(cublasLtMatmulPreferenceSetAttribute(pref, attrs[i], &a, sizeof(a)), ctx.str());
    }
    cublasLtMatmulHeuristicResult_t res[kMaxCand] = {};
    int returned = 0;
    ++stats.heuristic_queries;
    FLOWMOE_CUBLAS_CHECK(cublasLtMatmulAlgoGetHeuristic(handle, desc[info.desc], p.a, p.b, p.c, p.d, pref,
                                                        std::min(requested, kMaxCand), res, &returned),
                         ctx.str());
    int n = 0;
    for (int i = 0; i < returned; ++i)
      if (res[i].state == CUBLAS_STATUS_SUCCESS) out[n++] = res[i];
    FLOWMOE_CHECK(n > 0, ctx.str() << ": cuBLASLt's heuristic returned no algorithm for this problem (device sm_"
                                   << cc_major << cc_minor << ", cuBLASLt " << lt_version
                                   << "); see docs/GEMM.md for the shapes and alignments it supports");
    return n;
  }

  std::pair<const PlanKey, Plan>& plan_for(const PlanKey& key, const OpInfo& info, Launch& L, cudaStream_t stream,
                                            const char* what) {
    auto it = plans.find(key);
    if (it != plans.end()) return *it;
    Plan p;
    const Ctx ctx{what, info, L.expert, key};
    try {
      const bool ta = info.ta == CUBLAS_OP_T, tb = info.tb == CUBLAS_OP_T;
      FLOWMOE_CUBLAS_CHECK(cublasLtMatrixLayoutCreate(&p.a, info.ab_type, ta ? key.k : key.m,
                                                      ta ? key.m : key.k, key.lda),
                           ctx.str());
      FLOWMOE_CUBLAS_CHECK(cublasLtMatrixLayoutCreate(&p.b, info.ab_type, tb ? key.n : key.k,
                                                      tb ? key.k : key.n, key.ldb),
                           ctx.str());
      FLOWMOE_CUBLAS_CHECK(cublasLtMatrixLayoutCreate(&p.c, info.d_type, key.m, key.n, key.ldd), ctx.str());
      FLOWMOE_CUBLAS_CHECK(cublasLtMatrixLayoutCreate(&p.d, info.d_type, key.m, key.n, key.ldd), ctx.str());
      L.plan = &p;  // the layouts, for tuning trials
      if (opt.tune) {
        p.algo = tuned_algo(key, info, L, stream, ctx);
      } else {  // the heuristic's first algorithm for this exact shape and these alignments
        cublasLtMatmulHeuristicResult_t res[1];
        heuristic(info, p, key.align, 1, res, ctx);
        p.algo = res[0].algo;
      }
    } catch (...) {
      destroy_layouts(p);
      L.plan = nullptr;
      throw;
    }
    return *plans.emplace(key, p).first;
  }

  // ---- algorithm choice ------------------------------------------------------------------------
  // The key's algorithm if this shape supports it (cublasLtMatmulAlgoCheck, workspace), else the
  // heuristic's first for this shape (counted in stats.tune_fallbacks). Deterministic either way.
  cublasLtMatmulAlgo_t tuned_algo(const PlanKey& key, const OpInfo& info, const Launch& L,
                                  cudaStream_t stream, const Ctx& ctx) {
    TuneKey tk{};
    tk.m = key.m;
    tk.n = info.tokens_in_k ? key.n : gemm::tune_token_bucket(key.n);
    tk.k = info.tokens_in_k ? gemm::tune_token_bucket(key.k) : key.k;
    tk.workspace = opt.workspace_bytes;
    tk.device = device;
    tk.candidates = opt.candidates;
    tk.op = key.op;
    tk.beta = key.beta;
    auto it = tuned.find(tk);
    if (it == tuned.end()) it = tuned.emplace(tk, resolve(tk, info, L, stream, ctx)).first;
    const Plan& p = *L.plan;
    cublasLtMatmulHeuristicResult_t check{};
    if (cublasLtMatmulAlgoCheck(handle, desc[info.desc], p.a, p.b, p.c, p.d, &it->second.algo, &check) ==
            CUBLAS_STATUS_SUCCESS &&
        check.workspaceSize <= opt.workspace_bytes)
      return it->second.algo;
    return fallback_algo(info, *L.plan, ctx);
  }

  cublasLtMatmulAlgo_t fallback_algo(const OpInfo& info, Plan& p, const Ctx& ctx) {
    ++stats.tune_fallbacks;
    p.fallback = true;
    cublasLtMatmulHeuristicResult_t res[1];
    heuristic(info, p, kAlign16, 1, res, ctx);
    return res[0].algo;
  }

  // A new key for this object: the process's choice when shared and already made, else timed here.
  // The shared lock is held while timing, so a key is timed once per process.
  Tuned resolve(const TuneKey& tk, const OpInfo& info, const Launch& L, cudaStream_t stream, const Ctx& ctx) {
    Tuned t;
    if (opt.share_tuning) {
      SharedChoices& sc = shared_choices();
      std::lock_guard<std::mutex> lock(sc.mu);
      auto it = sc.map.find(tk);
      if (it != sc.map.end()) {
        t = it->second;
        t.rec.shared = true;
      } else {
        t = tune(tk, info, L, stream, ctx);
        sc.map.emplace(tk, t);
      }
    } else {
      t = tune(tk, info, L, stream, ctx);
    }
    records.push_back(t.rec);
    ++stats.tuned_keys;
    return t;
  }

  // Asks for opt.candidates algorithms (16-byte alignment, see TuneKey) for expert L's exact
  // shape and times them on its operands, on the caller's stream, before any launch of the call.
  // Trials of fprop, dgrad and overwriting wgrad write L's own output, which the real launch
  // overwrites later in stream order; trials of an accumulating wgrad write the shared scratch
  // (C = D = scratch, beta = 1: the same traffic) under its lock, never the gradients. Not timed
  // (the heuristic's first) when there is one candidate, when the stream is being captured, or
  // when the output exceeds tune_scratch_bytes.
  Tuned tune(const TuneKey& tk, const OpInfo& info, const Launch& L, cudaStream_t stream, const Ctx& ctx) {
    cublasLtMatmulHeuristicResult_t cand[kMaxCand];
    const int count = heuristic(info, *L.plan, kAlign16, opt.candidates, cand, ctx);
    ++stats.tunings;
    Tuned t;
    TuneRecord& r = t.rec;
    r.what = ctx.what;
    r.accumulate = L.acc;
    r.m = L.m;
    r.n = L.n;
    r.k = L.k;
    r.token_bucket = info.tokens_in_k ? tk.k : tk.n;
    r.candidates = count;
    void* trial_out = L.D;
    std::unique_lock<std::mutex> scratch_lock;  // held while the trials write the shared scratch
    if (L.acc) {
      const size_t bytes = static_cast<size_t>(L.ldd) * L.n * d_elem_bytes(info) + 256;
      trial_out = nullptr;
      if (scratch_user && bytes <= opt.tune_scratch_bytes) {
        SharedScratch& sc = shared_scratch();
        scratch_lock = std::unique_lock<std::mutex>(sc.mu);
        const SharedScratch::Buffer& buf = sc.per_device[device];
        // cudaMalloc'd, so 256-byte aligned: offset it to the output's own alignment
        if (buf.p && bytes <= buf.bytes) trial_out = buf.p + align_of(L.D) % 256;
      }
    }
    if (count == 1) r.how = "one candidate";
    else if (capturing(stream)) r.how = "stream capture";
    else if (!trial_out) r.how = "scratch too small";
    else r.picked = time_candidates(L, cand, count, trial_out, stream, r);
    t.algo = cand[r.picked].algo;
    describe(t.algo, r);
    return t;
  }

  int time_candidates(const Launch& L, const cublasLtMatmulHeuristicResult_t* cand, int count, void* out,
                      cudaStream_t stream, TuneRecord& r) {
    // keep this object's earlier work out of the timings
    for (cudaStream_t s : pool) FLOWMOE_CUDA_CHECK(cudaStreamSynchronize(s));
    void* ws = workspace(0);
    bool ran[kMaxCand] = {};
    for (int c = 0; c < count; ++c) {
      ++stats.tune_trials;
      if (run(L, cand[c].algo, out, stream, ws) != CUBLAS_STATUS_SUCCESS) continue;  // not runnable: skipped
      FLOWMOE_CUDA_CHECK(cudaEventRecord(timing[2 * c], stream));
      bool ok = true;
      for (int i = 0; i < opt.tune_reps && ok; ++i, ++stats.tune_trials)
        ok = run(L, cand[c].algo, out, stream, ws) == CUBLAS_STATUS_SUCCESS;
      FLOWMOE_CUDA_CHECK(cudaEventRecord(timing[2 * c + 1], stream));
      ran[c] = ok;
    }
    FLOWMOE_CUDA_CHECK(cudaStreamSynchronize(stream));
    float us[kMaxCand] = {};
    int best = -1;
    for (int c = 0; c < count; ++c) {
      if (!ran[c]) continue;
      float ms = 0;
      FLOWMOE_CUDA_CHECK(cudaEventElapsedTime(&ms, timing[2 * c], timing[2 * c + 1]));
      us[c] = ms * 1000.0f / opt.tune_reps;
      if (best < 0 || us[c] < us[best]) best = c;
    }
    if (best < 0) {
      r.how = "no candidate ran";  // the real launch reports cuBLASLt's error
      return 0;
    }
    if (ran[0] && us[0] <= us[best] * (1.0 + opt.tune_margin)) best = 0;
    r.how = "timed";
    r.first_us = ran[0] ? us[0] : 0.0f;
    r.picked_us = us[best];
    return best;
  }

  static void describe(const cublasLtMatmulAlgo_t& a, TuneRecord& r) {
    int32_t id = -1, splitk = -1;
    uint32_t tile = 0, stages = 0;
    size_t w = 0;
    if (cublasLtMatmulAlgoConfigGetAttribute(&a, CUBLASLT_ALGO_CONFIG_ID, &id, sizeof(id), &w) == CUBLAS_STATUS_SUCCESS)
      r.algo_id = id;
    if (cublasLtMatmulAlgoConfigGetAttribute(&a, CUBLASLT_ALGO_CONFIG_TILE_ID, &tile, sizeof(tile), &w) == CUBLAS_STATUS_SUCCESS)
      r.tile_id = static_cast<int>(tile);
    if (cublasLtMatmulAlgoConfigGetAttribute(&a, CUBLASLT_ALGO_CONFIG_SPLITK_NUM, &splitk, sizeof(splitk), &w) == CUBLAS_STATUS_SUCCESS)
      r.splitk = splitk;
    if (cublasLtMatmulAlgoConfigGetAttribute(&a, CUBLASLT_ALGO_CONFIG_STAGES_ID, &stages, sizeof(stages), &w) == CUBLAS_STATUS_SUCCESS)
      r.stages = static_cast<int>(stages);
  }

  // ---- one grouped call: prepare every expert (plans, tuning), then launch -----------------------
  void begin(int num_experts) {
    launches.clear();
    fills.clear();
    // bound the cache between calls only: the call's launches point into it
    if (plans.size() + static_cast<size_t>(num_experts) > kMaxPlans) clear_plans();
  }

  // D (m x n) = op(A) op(B) (+ D when accumulate), column-major. sa, sb: FP32 scale pointers (FP8).
  void add(Op op, int64_t m, int64_t n, int64_t k, const void* A, int64_t lda, const void* B, int64_t ldb,
           void* D, int64_t ldd, bool accumulate, const float* sa, const float* sb, cudaStream_t stream,
           const char* what, int expert) {
    const OpInfo& info = op_info(op);
    PlanKey key{};
    key.m = m; key.n = n; key.k = k; key.lda = lda; key.ldb = ldb; key.ldd = ldd;
    key.align[0] = align_of(A);
    key.align[1] = align_of(B);
    key.align[2] = key.align[3] = align_of(D);
    key.op = static_cast<uint8_t>(op);
    key.beta = accumulate ? 1 : 0;
    Launch L{nullptr, nullptr, op, m, n, k, ldd, A, B, D, accumulate, sa, sb, expert};
    if (info.fp8) set_scale_pointers(L, what);
    auto& kv = plan_for(key, info, L, stream, what);
    L.key = &kv.first;
    L.plan = &kv.second;
    launches.push_back(L);
  }

  void add_zero_fill(void* p, size_t bytes) { fills.emplace_back(p, bytes); }

  // Zero fills on the caller's stream, then the matmuls round-robin over min(active, launches)
  // slots, each with its own workspace. pool_priority == 0: slot 0 is the caller's stream, slot
  // i > 0 pool stream i - 1 (forked from the caller's stream, joined back to it). pool_priority
  // > 0: every slot is a pool stream (the caller's stream only forks and joins), so that every
  // matmul runs above the default priority.
  void launch(cudaStream_t stream, const char* what) {
    for (const auto& f : fills) {
      FLOWMOE_CUDA_CHECK(cudaMemsetAsync(f.first, 0, f.second, stream));
      ++stats.zero_fills;
    }
    const int n = static_cast<int>(launches.size());
    if (n == 0) return;
    const int lanes = std::max(1, std::min(active, n));
    const int first = opt.pool_priority > 0 ? 0 : 1;  // first slot on a pool stream
    const auto slot_stream = [&](int slot) { return slot < first ? stream : pool[slot - first]; };
    if (lanes > first) {
      FLOWMOE_CUDA_CHECK(cudaEventRecord(forked, stream));
      for (int i = first; i < lanes; ++i) FLOWMOE_CUDA_CHECK(cudaStreamWaitEvent(slot_stream(i), forked, 0));
      if (lanes > 1) ++stats.concurrent_calls;
    }
    const auto join_all = [&](bool checked) {
      for (int i = first; i < lanes; ++i) {
        cudaEvent_t e = joined[i - first];
        if (checked) {
          FLOWMOE_CUDA_CHECK(cudaEventRecord(e, slot_stream(i)));
          FLOWMOE_CUDA_CHECK(cudaStreamWaitEvent(stream, e, 0));
        } else if (cudaEventRecord(e, slot_stream(i)) == cudaSuccess) {
          cudaStreamWaitEvent(stream, e, 0);
        }
      }
    };
    try {
      for (int i = 0; i < n; ++i) {
        const int slot = i % lanes;
        enqueue(launches[i], slot_stream(slot), workspace(slot), what);
      }
    } catch (...) {
      join_all(false);  // leave the pool joined (a capture stays well-formed)
      throw;
    }
    join_all(true);
  }

  void enqueue(const Launch& L, cudaStream_t s, void* ws, const char* what) {
    const OpInfo& info = op_info(L.op);
    if (info.fp8) set_scale_pointers(L, what);
    cublasStatus_t st = run(L, L.plan->algo, L.D, s, ws);
    if (st != CUBLAS_STATUS_SUCCESS && opt.tune && !L.plan->fallback) {
      // The key's algorithm passed cublasLtMatmulAlgoCheck for this shape but cuBLASLt refuses to
      // launch it (nothing was enqueued): the heuristic's first for this shape, from now on.
      L.plan->algo = fallback_algo(info, *L.plan, Ctx{what, info, L.expert, *L.key});
      st = run(L, L.plan->algo, L.D, s, ws);
    }
    if (st != CUBLAS_STATUS_SUCCESS) {
      std::ostringstream os;
      os << what << " (" << info.name << ", expert " << L.expert << ": m " << L.m << ", n " << L.n << ", k "
         << L.k << "): cublasLtMatmul failed: " << cublasLtGetStatusName(st) << " ("
         << cublasLtGetStatusString(st) << ")";
      throw Error(__FILE__, __LINE__, os.str());
    }
    ++stats.matmuls;
  }
};

GroupedGemm::GroupedGemm() : GroupedGemm(Options()) {}
GroupedGemm::GroupedGemm(const Options& options) : impl_(new Impl(options)) {}
GroupedGemm::~GroupedGemm() = default;

GroupedGemm::Stats GroupedGemm::stats() const {
  Stats s = impl_->stats;
  s.cached_plans = static_cast<int64_t>(impl_->plans.size());
  return s;
}
void GroupedGemm::clear_cache() {
  impl_->clear_plans();
  impl_->tuned.clear();
  impl_->records.clear();
}
std::vector<GroupedGemm::TuneRecord> GroupedGemm::tune_records() const { return impl_->records; }
const GroupedGemm::Options& GroupedGemm::options() const { return impl_->opt; }
void GroupedGemm::set_concurrency(int streams) {
  FLOWMOE_CHECK(streams >= 1 && streams <= impl_->opt.streams,
                "GroupedGemm::set_concurrency(" << streams << "): expected 1.." << impl_->opt.streams
                                                << " (the pool this object was built with)");
  impl_->active = streams;
}
size_t GroupedGemm::device_bytes() const { return impl_->buffer_bytes; }
size_t GroupedGemm::tuning_scratch_bytes() {
  int dev = 0;
  FLOWMOE_CUDA_CHECK(cudaGetDevice(&dev));
  SharedScratch& sc = shared_scratch();
  std::lock_guard<std::mutex> lock(sc.mu);
  auto it = sc.per_device.find(dev);
  return it == sc.per_device.end() ? 0 : it->second.bytes;
}

// ---- FP8 ---------------------------------------------------------------------------------------
void GroupedGemm::fprop(const Segments& seg, int64_t n, int64_t k, const Fp8Operand& x,
                        const Fp8Operand& w, Span<bf16_t> y, cudaStream_t stream) {
  const char* what = "FP8 fprop";
  gemm::check_fp8_fprop(seg, n, k, x, w, {y.data, y.size});
  impl_->require_fp8(what);
  const int64_t L = k / kFp8Block, w_scales = (n / kFp8Block) * gemm::weight_scale_ld(k);
  impl_->begin(seg.num_segments());
  for (int e = 0; e < seg.num_segments(); ++e) {
    const int64_t off = seg.offsets[e], me = seg.offsets[e + 1] - off;
    if (me == 0) continue;
    impl_->add(Op::kF8Rowwise, n, me, k, w.codes.data + e * n * k, k, x.codes.data + off * k, k,
               y.data + off * n, n, false, w.scales.data + e * w_scales, x.scales.data + L * off,
               stream, what, e);
  }
  impl_->launch(stream, what);
}

void GroupedGemm::dgrad(const Segments& seg, int64_t n, int64_t k, const Fp8Operand& dy,
                        const Fp8Operand& wt, Span<bf16_t> dx, cudaStream_t stream) {
  const char* what = "FP8 dgrad";
  gemm::check_fp8_dgrad(seg, n, k, dy, wt, {dx.data, dx.size});
  impl_->require_fp8(what);
  const int64_t L = n / kFp8Block, w_scales = (k / kFp8Block) * gemm::weight_scale_ld(n);
  impl_->begin(seg.num_segments());
  for (int e = 0; e < seg.num_segments(); ++e) {
    const int64_t off = seg.offsets[e], me = seg.offsets[e + 1] - off;
    if (me == 0) continue;
    impl_->add(Op::kF8Rowwise, k, me, n, wt.codes.data + e * n * k, n, dy.codes.data + off * n, n,
               dx.data + off * k, k, false, wt.scales.data + e * w_scales,
               dy.scales.data + L * off, stream, what, e);
  }
  impl_->launch(stream, what);
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
  // flowmoe's sm_90a kernel (compiled for sm_90a only: a 9.0 device), 16-byte aligned operands
  const bool aligned = ((reinterpret_cast<uintptr_t>(dy_col.codes.data) | reinterpret_cast<uintptr_t>(dy_col.scales.data) |
                         reinterpret_cast<uintptr_t>(x_col.codes.data) | reinterpret_cast<uintptr_t>(x_col.scales.data) |
                         reinterpret_cast<uintptr_t>(dw.data)) & 15u) == 0;
  if (aligned && impl_->cc_major == 9 && impl_->cc_minor == 0 &&
      gemm::choose_wgrad_kernel(impl_->opt.wgrad_kernel, seg, n, k, dw.kind)) {
    // one launch over all experts (empty experts zero-filled there when overwriting)
    impl_->stats.wgrad_kernel_calls +=
        sm90::fp8_wgrad_1x128(seg, n, k, dy_col.codes.data, dy_col.scales.data, x_col.codes.data, x_col.scales.data,
                         static_cast<float*>(dw.data), acc, impl_->tile_counter, stream);
    if (!acc)
      for (int e = 0; e < seg.num_segments(); ++e) impl_->stats.zero_fills += seg.offsets[e + 1] == seg.offsets[e];
    return;
  }
  int64_t block = 0;  // first 128-token block of expert e
  impl_->begin(seg.num_segments());
  for (int e = 0; e < seg.num_segments(); ++e) {
    const int64_t off = seg.offsets[e], me = seg.offsets[e + 1] - off;
    char* out = static_cast<char*>(dw.data) + static_cast<int64_t>(e) * n * k * eb;
    if (me == 0) {
      if (!acc) impl_->add_zero_fill(out, n * k * eb);
      continue;
    }
    impl_->add(op, k, n, me, x_col.codes.data + off, m, dy_col.codes.data + off, m, out, k, acc,
               x_col.scales.data + block * k, dy_col.scales.data + block * n, stream, what, e);
    block += (me + kFp8Block - 1) / kFp8Block;
  }
  impl_->launch(stream, what);
}

// ---- BF16 --------------------------------------------------------------------------------------
void GroupedGemm::fprop_bf16(const Segments& seg, int64_t n, int64_t k, Span<const bf16_t> x,
                             Span<const bf16_t> w, Span<bf16_t> y, cudaStream_t stream) {
  const char* what = "BF16 fprop";
  gemm::check_bf16(gemm::Pass::kFprop, seg, n, k, x, w, y.data, y.size);
  impl_->begin(seg.num_segments());
  for (int e = 0; e < seg.num_segments(); ++e) {
    const int64_t off = seg.offsets[e], me = seg.offsets[e + 1] - off;
    if (me == 0) continue;
    impl_->add(Op::kB16Fprop, n, me, k, w.data + e * n * k, k, x.data + off * k, k, y.data + off * n,
               n, false, nullptr, nullptr, stream, what, e);
  }
  impl_->launch(stream, what);
}

void GroupedGemm::dgrad_bf16(const Segments& seg, int64_t n, int64_t k, Span<const bf16_t> dy,
                             Span<const bf16_t> w, Span<bf16_t> dx, cudaStream_t stream) {
  const char* what = "BF16 dgrad";
  gemm::check_bf16(gemm::Pass::kDgrad, seg, n, k, dy, w, dx.data, dx.size);
  impl_->begin(seg.num_segments());
  for (int e = 0; e < seg.num_segments(); ++e) {
    const int64_t off = seg.offsets[e], me = seg.offsets[e + 1] - off;
    if (me == 0) continue;
    impl_->add(Op::kB16Dgrad, k, me, n, w.data + e * n * k, k, dy.data + off * n, n,
               dx.data + off * k, k, false, nullptr, nullptr, stream, what, e);
  }
  impl_->launch(stream, what);
}

void GroupedGemm::wgrad_bf16(const Segments& seg, int64_t n, int64_t k, Span<const bf16_t> dy,
                             Span<const bf16_t> x, const WgradOut& dw, cudaStream_t stream) {
  const char* what = "BF16 wgrad";
  FLOWMOE_CHECK(dw.kind == WgradOut::Kind::kBf16 || dw.kind == WgradOut::Kind::kF32 ||
                    dw.kind == WgradOut::Kind::kF32Accumulate,
                "BF16 wgrad: unknown output kind " << static_cast<int>(dw.kind));
  gemm::check_bf16(gemm::Pass::kWgrad, seg, n, k, dy, x, dw.data, dw.size);
  const bool acc = dw.kind == WgradOut::Kind::kF32Accumulate;
  const Op op = dw.kind == WgradOut::Kind::kBf16 ? Op::kB16WgradBf16 : Op::kB16WgradF32;
  const size_t eb = wgrad_elem_bytes(dw);
  impl_->begin(seg.num_segments());
  for (int e = 0; e < seg.num_segments(); ++e) {
    const int64_t off = seg.offsets[e], me = seg.offsets[e + 1] - off;
    char* out = static_cast<char*>(dw.data) + static_cast<int64_t>(e) * n * k * eb;
    if (me == 0) {
      if (!acc) impl_->add_zero_fill(out, n * k * eb);
      continue;
    }
    impl_->add(op, k, n, me, x.data + off * k, k, dy.data + off * n, n, out, k, acc, nullptr,
               nullptr, stream, what, e);
  }
  impl_->launch(stream, what);
}

}  // namespace cuda
}  // namespace flowmoe
