// Private to the grouped GEMM (grouped_gemm.cu, grouped_gemm_plans.cu): the cuBLASLt error check,
// the pass descriptions (Op, OpInfo), the plan and tuning keys and caches, the process-wide shared
// tuning choices and trial scratch, and GroupedGemm::Impl (the cuBLASLt handle, descriptors,
// workspaces, stream pool and the call being prepared).
#pragma once

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

namespace grouped_gemm_detail {

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

inline const OpInfo& op_info(Op op) {
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

inline size_t d_elem_bytes(const OpInfo& info) { return info.d_type == CUDA_R_32F ? 4 : 2; }

inline uint64_t fnv_mix(uint64_t h, uint64_t v) { return (h ^ v) * 1099511628211ull; }
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
inline SharedChoices& shared_choices() {
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
inline SharedScratch& shared_scratch() {
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

inline uint16_t align_of(const void* p) {
  const uintptr_t a = reinterpret_cast<uintptr_t>(p);
  const uintptr_t low = a & (~a + 1);
  return static_cast<uint16_t>(low == 0 || low > 256 ? 256 : low);
}
constexpr uint16_t kAlign16[4] = {16, 16, 16, 16};  // what gemm.h guarantees for every operand

constexpr size_t kMaxPlans = 8192;  // cache bound: cleared when full (token counts change per step)
constexpr int kMaxCand = gemm::GroupedGemmOptions::kMaxCandidates;

// Whether work enqueued on `s` would be captured into a graph (then nothing is timed). An error
// (the legacy stream while another thread captures) counts as capturing.
inline bool capturing(cudaStream_t s) {
  cudaStreamCaptureStatus st = cudaStreamCaptureStatusNone;
  if (cudaStreamIsCapturing(s, &st) != cudaSuccess) {
    (void)cudaGetLastError();
    return true;
  }
  return st != cudaStreamCaptureStatusNone;
}
}  // namespace grouped_gemm_detail
using namespace grouped_gemm_detail;  // the Impl members and the two source files use these names

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

  // grouped_gemm_plans.cu: set-up and tear-down, descriptors, plans, algorithm choice and tuning
  explicit Impl(const Options& o);
  void reserve_scratch();
  void release_scratch();
  void destroy();
  static void destroy_layouts(Plan& p);
  void clear_plans();
  void make_desc(Desc id, cublasOperation_t ta, cublasOperation_t tb, int32_t a_mode, int32_t b_mode);
  void require_fp8(const char* what) const;
  void set_scale_pointers(const Launch& L, const char* what);
  cublasStatus_t run(const Launch& L, const cublasLtMatmulAlgo_t& algo, void* D, cudaStream_t s, void* ws) const;
  int heuristic(const OpInfo& info, const Plan& p, const uint16_t align[4], int requested,
                cublasLtMatmulHeuristicResult_t* out, const Ctx& ctx);
  std::pair<const PlanKey, Plan>& plan_for(const PlanKey& key, const OpInfo& info, Launch& L, cudaStream_t stream,
                                            const char* what);
  cublasLtMatmulAlgo_t tuned_algo(const PlanKey& key, const OpInfo& info, const Launch& L,
                                  cudaStream_t stream, const Ctx& ctx);
  cublasLtMatmulAlgo_t fallback_algo(const OpInfo& info, Plan& p, const Ctx& ctx);
  Tuned resolve(const TuneKey& tk, const OpInfo& info, const Launch& L, cudaStream_t stream, const Ctx& ctx);
  Tuned tune(const TuneKey& tk, const OpInfo& info, const Launch& L, cudaStream_t stream, const Ctx& ctx);
  int time_candidates(const Launch& L, const cublasLtMatmulHeuristicResult_t* cand, int count, void* out,
                      cudaStream_t stream, TuneRecord& r);
  static void describe(const cublasLtMatmulAlgo_t& a, TuneRecord& r);

  // grouped_gemm.cu: one grouped call (prepare every expert, then launch)
  void begin(int num_experts);
  void add(Op op, int64_t m, int64_t n, int64_t k, const void* A, int64_t lda, const void* B, int64_t ldb,
           void* D, int64_t ldd, bool accumulate, const float* sa, const float* sb, cudaStream_t stream,
           const char* what, int expert);
  void launch(cudaStream_t stream, const char* what);
  void enqueue(const Launch& L, cudaStream_t s, void* ws, const char* what);

  ~Impl() { destroy(); }
  void* workspace(int slot) const { return opt.workspace_bytes ? buffer + slot * ws_stride : nullptr; }
  void add_zero_fill(void* p, size_t bytes) { fills.emplace_back(p, bytes); }
};

}  // namespace cuda
}  // namespace flowmoe
