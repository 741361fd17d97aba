// GroupedGemm::Impl's set-up and tear-down (cuBLASLt handle, matmul descriptors, workspaces, the
// stream pool, the shared trial scratch), the plan cache (matrix layouts per expert problem) and
// the algorithm choice: heuristic, tuning by timing candidates once per tuning key, shared choices
// and fallbacks (docs/GEMM.md, "Concurrency and algorithm choice"). The grouped calls themselves:
// grouped_gemm.cu.
#include "cuda/gemm/grouped_gemm_impl.h"

namespace flowmoe {
namespace cuda {

GroupedGemm::Impl::Impl(const Options& o) : opt(o) {
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

void GroupedGemm::Impl::reserve_scratch() {
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

void GroupedGemm::Impl::release_scratch() {
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

void GroupedGemm::Impl::destroy() {
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

void GroupedGemm::Impl::destroy_layouts(Plan& p) {
  if (p.a) cublasLtMatrixLayoutDestroy(p.a);
  if (p.b) cublasLtMatrixLayoutDestroy(p.b);
  if (p.c) cublasLtMatrixLayoutDestroy(p.c);
  if (p.d) cublasLtMatrixLayoutDestroy(p.d);
  p = Plan();
}

void GroupedGemm::Impl::clear_plans() {
  for (auto& kv : plans) destroy_layouts(kv.second);
  plans.clear();
}

void GroupedGemm::Impl::make_desc(Desc id, cublasOperation_t ta, cublasOperation_t tb, int32_t a_mode, int32_t b_mode) {
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

void GroupedGemm::Impl::require_fp8(const char* what) const {
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
void GroupedGemm::Impl::set_scale_pointers(const Launch& L, const char* what) {
  cublasLtMatmulDesc_t d = desc[op_info(L.op).desc];
  FLOWMOE_CUBLAS_CHECK(cublasLtMatmulDescSetAttribute(d, CUBLASLT_MATMUL_DESC_A_SCALE_POINTER, &L.sa, sizeof(L.sa)), what);
  FLOWMOE_CUBLAS_CHECK(cublasLtMatmulDescSetAttribute(d, CUBLASLT_MATMUL_DESC_B_SCALE_POINTER, &L.sb, sizeof(L.sb)), what);
}

// D = op(A) op(B) (+ D when accumulating) with `algo`, writing `D` (the real output or, for
// tuning trials of an accumulating wgrad, the scratch).
cublasStatus_t GroupedGemm::Impl::run(const Launch& L, const cublasLtMatmulAlgo_t& algo, void* D,
                                      cudaStream_t s, void* ws) const {
  const Plan& p = *L.plan;
  const float alpha = 1.0f, beta = L.acc ? 1.0f : 0.0f;
  return cublasLtMatmul(handle, desc[op_info(L.op).desc], &alpha, L.A, p.a, L.B, p.b, &beta, D, p.c, D, p.d,
                        &algo, ws, opt.workspace_bytes, s);
}

// The heuristic's usable results (at most `requested`), best first; throws if there is none.
int GroupedGemm::Impl::heuristic(const OpInfo& info, const Plan& p, const uint16_t align[4], int requested,
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

std::pair<const PlanKey, Plan>& GroupedGemm::Impl::plan_for(const PlanKey& key, const OpInfo& info,
                                                             Launch& L, cudaStream_t stream,
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
cublasLtMatmulAlgo_t GroupedGemm::Impl::tuned_algo(const PlanKey& key, const OpInfo& info, const Launch& L,
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

cublasLtMatmulAlgo_t GroupedGemm::Impl::fallback_algo(const OpInfo& info, Plan& p, const Ctx& ctx) {
  ++stats.tune_fallbacks;
  p.fallback = true;
  cublasLtMatmulHeuristicResult_t res[1];
  heuristic(info, p, kAlign16, 1, res, ctx);
  return res[0].algo;
}

// A new key for this object: the process's choice when shared and already made, else timed here.
// The shared lock is held while timing, so a key is timed once per process.
Tuned GroupedGemm::Impl::resolve(const TuneKey& tk, const OpInfo& info, const Launch& L,
                                 cudaStream_t stream, const Ctx& ctx) {
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
Tuned GroupedGemm::Impl::tune(const TuneKey& tk, const OpInfo& info, const Launch& L,
                              cudaStream_t stream, const Ctx& ctx) {
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

int GroupedGemm::Impl::time_candidates(const Launch& L, const cublasLtMatmulHeuristicResult_t* cand, int count, void* out,
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

void GroupedGemm::Impl::describe(const cublasLtMatmulAlgo_t& a, TuneRecord& r) {
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

}  // namespace cuda
}  // namespace flowmoe
