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
//
// This file: GroupedGemm's public entry points (FP8 and BF16 fprop, dgrad, wgrad) and the grouped
// call (prepare, launch, enqueue). Plans, tuning and the stream pool's set-up: grouped_gemm_plans.cu;
// shared types and GroupedGemm::Impl: grouped_gemm_impl.h.
#include <algorithm>
#include <vector>

#include "cuda/gemm/grouped_gemm_impl.h"
#include "cuda/gemm/sm90_bf16_grouped.h"

namespace flowmoe {
namespace cuda {

// ---- one grouped call: prepare every expert (plans, tuning), then launch -----------------------
void GroupedGemm::Impl::begin(int num_experts) {
  launches.clear();
  fills.clear();
  // bound the cache between calls only: the call's launches point into it
  if (plans.size() + static_cast<size_t>(num_experts) > kMaxPlans) clear_plans();
}

// D (m x n) = op(A) op(B) (+ D when accumulate), column-major. sa, sb: FP32 scale pointers (FP8).
void GroupedGemm::Impl::add(Op op, int64_t m, int64_t n, int64_t k, const void* A, int64_t lda,
                            const void* B, int64_t ldb, void* D, int64_t ldd, bool accumulate,
                            const float* sa, const float* sb, cudaStream_t stream, const char* what,
                            int expert) {
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

// Zero fills on the caller's stream, then the matmuls round-robin over min(active, launches)
// slots, each with its own workspace. pool_priority == 0: slot 0 is the caller's stream, slot
// i > 0 pool stream i - 1 (forked from the caller's stream, joined back to it). pool_priority
// > 0: every slot is a pool stream (the caller's stream only forks and joins), so that every
// matmul runs above the default priority.
void GroupedGemm::Impl::launch(cudaStream_t stream, const char* what) {
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

void GroupedGemm::Impl::enqueue(const Launch& L, cudaStream_t s, void* ws, const char* what) {
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

bool GroupedGemm::wgrad_runs_kernel(const Segments& seg, int64_t n, int64_t k, WgradOut::Kind kind) const {
  return impl_->cc_major == 9 && impl_->cc_minor == 0 && gemm::choose_wgrad_kernel(impl_->opt.wgrad_kernel, seg, n, k, kind);
}

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
  if (aligned && wgrad_runs_kernel(seg, n, k, dw.kind)) {
    // one launch over all experts (empty experts zero-filled there when overwriting)
    sm90::WgradArgs a;
    a.host_offsets = seg.offsets.data();
    a.num_experts = seg.num_segments();
    a.m = m;
    a.n = n;
    a.k = k;
    a.dy_codes = dy_col.codes.data;
    a.dy_scales = dy_col.scales.data;
    a.x_codes = x_col.codes.data;
    a.x_scales = x_col.scales.data;
    a.dw = dw.data;
    a.accumulate = acc;
    a.out_bf16 = dw.kind == WgradOut::Kind::kBf16;
    a.tile_counter = impl_->tile_counter;
    a.tile_n = impl_->opt.wgrad_tile_n;
    sm90::fp8_wgrad_1x128(a, what, stream);
    ++impl_->stats.wgrad_kernel_calls;
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

// ---- FP8 on device segments: flowmoe's sm_90a kernels, one launch each ----------------------
namespace {
// A span of `have` elements where the call needs `want` (every device-segment entry's size check).
void check_span_holds(int64_t have, int64_t want, const char* what, const char* name) {
  FLOWMOE_CHECK(have >= want, what << ": " << name << " holds " << have << " elements, expected " << want);
}
void check_device_segments(const gemm::DeviceSegments& seg, const char* what) {
  FLOWMOE_CHECK(seg.offsets != nullptr && seg.num_segments >= 1 && seg.capacity >= 0,
                what << ": device segments need offsets, at least one segment and a capacity >= 0 (got "
                     << seg.num_segments << " segments, capacity " << seg.capacity << ")");
}
void check_shape(const QTensorView& v, int64_t rows, int64_t cols, const char* what, const char* name) {
  FLOWMOE_CHECK(v.rows == rows && v.cols == cols, what << ": " << name << " is [" << v.rows << ", " << v.cols
                                                       << "], expected [" << rows << ", " << cols << "]");
}
// The saved h of the flow recipes' epilogues: FP8 1x128 rows or MXFP4 1x32 (dense scales) [capacity,
// 2F]. Returns whether it is MXFP4.
bool check_saved_h(const QTensorView& h, int64_t capacity, int64_t f, const char* what) {
  const bool mxfp4 = h.layout == Layout::kMxfp4Row1x32;
  check_view(h, mxfp4 ? Layout::kMxfp4Row1x32 : Layout::kRow1x128, ScaleFormat::kUe8m0, what);
  check_shape(h, capacity, 2 * f, what, "h (h_saved)");
  FLOWMOE_CHECK(!mxfp4 || h.scale_ld == 2 * f / kFp4Block,
                what << ": the MXFP4 h scales must be dense [capacity][2F/32] (scale_ld " << h.scale_ld << ", expected "
                     << 2 * f / kFp4Block << ")");
  return mxfp4;
}
// d.data null: no BF16 output (the SwiGLU epilogues)
sm90::RowwiseGroupedArgs rowwise_args(const gemm::DeviceSegments& seg, int64_t n_out, int64_t k_red,
                                      const QTensorView& a, const QTensorView& b, gemm::Span<bf16_t> d,
                                      const char* what) {
  FLOWMOE_CHECK(a.scale_format == ScaleFormat::kUe8m0 || a.offsets == nullptr || a.offsets == seg.offsets,
                what << ": the activation's expert-packed FP32 scales follow other offsets than the GEMM's");
  check_view(a, Layout::kRow1x128, a.scale_format, what);
  check_view(b, Layout::kWeight128x128, b.scale_format, what);
  check_shape(a, seg.capacity, k_red, what, "the activation");
  check_shape(b, int64_t(seg.num_segments) * n_out, k_red, what, "the stacked weights");
  if (d.data != nullptr) check_span_holds(d.size, seg.capacity * n_out, what, "the output");
  sm90::RowwiseGroupedArgs r;
  r.offsets = seg.offsets;
  r.num_experts = seg.num_segments;
  r.m = seg.capacity;
  r.n_out = n_out;
  r.k_red = k_red;
  r.a_codes = a.codes;
  r.a_scales = a.scales;
  r.a_ue8m0 = a.scale_format == ScaleFormat::kUe8m0;
  r.a_scale_ld = a.scale_ld;
  r.b_codes = b.codes;
  r.b_scales = b.scales;
  r.b_ue8m0 = b.scale_format == ScaleFormat::kUe8m0;
  r.b_scale_ld = b.scale_ld;
  r.d = d.data;
  r.status = seg.status;
  return r;
}
}  // namespace

// fprop (n_out = N, k_red = K) and dgrad (n_out = K, k_red = N): the grouped kernel.
void GroupedGemm::rowwise_on_device(const DeviceSegments& seg, int64_t n_out, int64_t k_red, const QTensorView& a,
                                    const QTensorView& b, Span<bf16_t> d, const char* what, cudaStream_t stream) {
  impl_->require_fp8(what);
  check_device_segments(seg, what);
  if (seg.capacity == 0) return;  // no rows: nothing to compute or write
  sm90::fp8_grouped_rowwise(rowwise_args(seg, n_out, k_red, a, b, d, what), what, stream);
  ++impl_->stats.grouped_kernel_calls;
}
void GroupedGemm::fprop(const DeviceSegments& seg, int64_t n, int64_t k, const QTensorView& x,
                        const QTensorView& w, Span<bf16_t> y, cudaStream_t stream) {
  rowwise_on_device(seg, n, k, x, w, y, "FP8 fprop (device segments)", stream);
}
void GroupedGemm::dgrad(const DeviceSegments& seg, int64_t n, int64_t k, const QTensorView& dy,
                        const QTensorView& wt, Span<bf16_t> dx, cudaStream_t stream) {
  rowwise_on_device(seg, k, n, dy, wt, dx, "FP8 dgrad (device segments)", stream);
}

void GroupedGemm::fprop_swiglu(const DeviceSegments& seg, int64_t f, int64_t k, const QTensorView& x,
                               const QTensorView& w1_interleaved, const float* row_prob, const QTensorView& a_row,
                               const QTensorView& h_saved, DeviceStatus* status, cudaStream_t stream,
                               const GatedActivation& act, const float* gate_up_bias) {
  const char* what = "FP8 fprop + SwiGLU epilogue (device segments)";
  impl_->require_fp8(what);
  const char* bad_act = num::activation_unsupported(act);  // (also without rows)
  FLOWMOE_CHECK(bad_act == nullptr, what << ": " << bad_act);
  check_device_segments(seg, what);
  FLOWMOE_CHECK(f > 0 && f % kFp8Block == 0,
                what << ": F = " << f << " is not a positive multiple of 128 (W1 is [2F, K] per expert)");
  if (seg.capacity == 0) return;  // no rows: nothing to compute or write
  const bool mxfp4 = check_saved_h(h_saved, seg.capacity, f, what);
  check_view(a_row, Layout::kRow1x128, ScaleFormat::kUe8m0, what);
  check_shape(a_row, seg.capacity, f, what, "a' (a_row)");
  sm90::SwigluEpilogueArgs s;
  s.f = f;
  s.prob = row_prob;
  s.a_codes = a_row.codes;
  s.a_scales = a_row.ue8m0();
  s.a_scale_ld = a_row.scale_ld;
  s.h_mxfp4 = mxfp4;
  s.h_codes = h_saved.codes;
  s.h_scales = h_saved.ue8m0();
  s.h_scale_ld = h_saved.scale_ld;
  s.act = act;
  s.gate_up_bias = gate_up_bias;
  s.status = status;
  sm90::fp8_grouped_rowwise_swiglu(rowwise_args(seg, 2 * f, k, x, w1_interleaved, {nullptr, 0}, what), s, what,
                                   stream);
  ++impl_->stats.grouped_kernel_calls;
}

void GroupedGemm::dgrad_dswiglu(const DeviceSegments& seg, int64_t n, int64_t f, const QTensorView& dy,
                                const QTensorView& wt, const float* row_prob, const QTensorView& h_saved,
                                const QTensorView& dh_row, const QTensorView& dh_col, float* dprob_partials,
                                DeviceStatus* status, cudaStream_t stream, const GatedActivation& act) {
  const char* what = "FP8 dgrad + dSwiGLU epilogue (device segments)";
  impl_->require_fp8(what);
  const char* bad_act = num::activation_unsupported(act);  // (also without rows)
  FLOWMOE_CHECK(bad_act == nullptr, what << ": " << bad_act);
  check_device_segments(seg, what);
  FLOWMOE_CHECK(f > 0 && f % kFp8Block == 0,
                what << ": F = " << f << " is not a positive multiple of 128 (W2^T is [F, H] per expert)");
  if (seg.capacity == 0) return;  // no rows: nothing to compute or write
  const bool mxfp4 = check_saved_h(h_saved, seg.capacity, f, what);
  check_view(dh_row, Layout::kRow1x128, ScaleFormat::kUe8m0, what);
  check_view(dh_col, Layout::kCol128x1, ScaleFormat::kUe8m0, what);
  check_shape(dh_row, seg.capacity, 2 * f, what, "dh (dh_row)");
  check_shape(dh_col, seg.capacity, 2 * f, what, "dh (dh_col)");
  FLOWMOE_CHECK(dh_row.scale_ld == seg.capacity,
                what << ": dh_row's scales must be the tight grid [2F/128][capacity] (scale_ld " << dh_row.scale_ld
                     << ", expected " << seg.capacity << ")");
  const int64_t blocks = (seg.capacity + kFp8Block - 1) / kFp8Block + seg.num_segments;
  FLOWMOE_CHECK(dh_col.scale_rows >= blocks && dh_col.scale_ld == 2 * f,
                what << ": dh_col's scales must be [capacity/128 + E][2F] (have [" << dh_col.scale_rows << "]["
                     << dh_col.scale_ld << "], expected at least [" << blocks << "][" << 2 * f << "])");
  FLOWMOE_CHECK(dh_col.offsets == nullptr || dh_col.offsets == seg.offsets,
                what << ": dh_col's segment offsets are not the GEMM's");
  FLOWMOE_CHECK(row_prob != nullptr || dprob_partials == nullptr,
                what << ": dprob_partials (the gradient of the routing probabilities) needs row_prob");
  sm90::DswigluEpilogueArgs s;
  s.f = f;
  s.prob = row_prob;
  s.h_mxfp4 = mxfp4;
  s.h_codes = h_saved.codes;
  s.h_scales = h_saved.ue8m0();
  s.h_scale_ld = h_saved.scale_ld;
  s.row_codes = dh_row.codes;
  s.row_scales = dh_row.ue8m0();
  s.col_codes = dh_col.codes;
  s.col_scales = dh_col.ue8m0();
  s.dprob_partials = dprob_partials;
  s.act = act;
  s.status = status;
  sm90::fp8_grouped_rowwise_dswiglu(rowwise_args(seg, f, n, dy, wt, {nullptr, 0}, what), s, what, stream);
  ++impl_->stats.grouped_kernel_calls;
}

void GroupedGemm::wgrad(const DeviceSegments& seg, int64_t n, int64_t k, const QTensorView& dy_col,
                        const QTensorView& x_col, const WgradOut& dw, cudaStream_t stream) {
  const char* what = "FP8 wgrad (device segments)";
  impl_->require_fp8(what);
  check_device_segments(seg, what);
  const gemm::StoredDw& st = dw.stored;
  const int64_t per_expert = st.rows > 0 ? st.rows * st.cols : n * k;
  check_span_holds(dw.size, int64_t(seg.num_segments) * per_expert, what, "the output");
  if (seg.capacity == 0) {  // no rows: the gradients are zero (overwrite) or unchanged (accumulate)
    if (dw.kind != WgradOut::Kind::kF32Accumulate)
      FLOWMOE_CUDA_CHECK(cudaMemsetAsync(dw.data, 0, wgrad_elem_bytes(dw) * seg.num_segments * per_expert, stream));
    return;
  }
  check_view(dy_col, Layout::kCol128x1, dy_col.scale_format, what);
  check_view(x_col, Layout::kCol128x1, dy_col.scale_format, what);  // (both UE8M0 or both FP32)
  check_shape(dy_col, seg.capacity, n, what, "dy_col");
  check_shape(x_col, seg.capacity, k, what, "x_col");
  FLOWMOE_CHECK(dy_col.scale_rows * kFp8Block >= seg.capacity && x_col.scale_rows * kFp8Block >= seg.capacity,
                what << ": the column-wise scale grids need capacity/128 = " << seg.capacity / kFp8Block << " rows");
  sm90::WgradArgs a;
  a.offsets = seg.offsets;
  a.num_experts = seg.num_segments;
  a.m = seg.capacity;
  a.n = n;
  a.k = k;
  a.dy_codes = dy_col.codes;
  a.dy_scales = dy_col.scales;
  a.x_codes = x_col.codes;
  a.x_scales = x_col.scales;
  a.scales_ue8m0 = dy_col.scale_format == ScaleFormat::kUe8m0;
  a.dw = dw.data;
  a.accumulate = dw.kind == WgradOut::Kind::kF32Accumulate;
  a.out_bf16 = dw.kind == WgradOut::Kind::kBf16;
  a.tile_counter = impl_->tile_counter;
  a.tile_n = impl_->opt.wgrad_tile_n;
  a.stored_rows = st.rows;
  a.stored_cols = st.cols;
  a.stored_interleaved = st.interleaved;
  a.status = seg.status;
  sm90::fp8_wgrad_1x128(a, what, stream);
  ++impl_->stats.wgrad_kernel_calls;
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
  FLOWMOE_CHECK(dw.stored.rows == 0, what << ": a stored output (WgradOut::stored); only the wgrad kernels on device "
                                            "segments write one");
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

// ---- BF16 on device segments: flowmoe's sm_90a kernels, one launch each -------------------------
namespace {
// fprop (n_out = N, k_red = K, B = W K-major) and dgrad (n_out = K, k_red = N, B = W read MN-major):
// A [capacity, k_red], W E x [N, K], D [capacity, n_out].
// (stored: w holds the stored matrices, sized by the caller, read with the other major-ness)
sm90::Bf16RowsArgs bf16_rows_args(const gemm::DeviceSegments& seg, int64_t n_out, int64_t k_red,
                                  gemm::Span<const bf16_t> a, gemm::Span<const bf16_t> w, gemm::Span<bf16_t> d,
                                  bool dgrad, const char* what, bool stored = false) {
  check_span_holds(a.size, seg.capacity * k_red, what, dgrad ? "dy" : "x");
  if (!stored) check_span_holds(w.size, int64_t(seg.num_segments) * n_out * k_red, what, "w");
  check_span_holds(d.size, seg.capacity * n_out, what, dgrad ? "dx" : "y");
  const bool w_mn_major = dgrad != stored;
  sm90::Bf16RowsArgs r;
  r.offsets = seg.offsets;
  r.num_experts = seg.num_segments;
  r.m = seg.capacity;
  r.n_out = n_out;
  r.k_red = k_red;
  r.a = a.data;
  r.b = w.data;
  r.b_mn_major = w_mn_major;
  r.d = d.data;
  r.status = seg.status;
  return r;
}
}  // namespace

void GroupedGemm::fprop_bf16(const DeviceSegments& seg, int64_t n, int64_t k, Span<const bf16_t> x,
                             Span<const bf16_t> w, Span<bf16_t> y, cudaStream_t stream) {
  const char* what = "BF16 fprop (device segments)";
  check_device_segments(seg, what);
  // (every check runs at capacity 0 too; nothing is launched then)
  sm90::bf16_grouped_rows(bf16_rows_args(seg, n, k, x, w, y, false, what), what, stream);
  impl_->stats.bf16_kernel_calls += seg.capacity > 0;
}

void GroupedGemm::dgrad_bf16(const DeviceSegments& seg, int64_t n, int64_t k, Span<const bf16_t> dy,
                             Span<const bf16_t> w, Span<bf16_t> dx, cudaStream_t stream) {
  const char* what = "BF16 dgrad (device segments)";
  check_device_segments(seg, what);
  sm90::bf16_grouped_rows(bf16_rows_args(seg, k, n, dy, w, dx, true, what), what, stream);  // W_e [N, K] as stored
  impl_->stats.bf16_kernel_calls += seg.capacity > 0;
}

// (stored W: W_e^T [rows <= K][cols <= N], the kernel's B MN-major in fprop and K-major in dgrad)
void GroupedGemm::fprop_bf16(const DeviceSegments& seg, int64_t n, int64_t k, Span<const bf16_t> x, const gemm::StoredW& w,
                             Span<bf16_t> y, cudaStream_t stream) {
  const char* what = "BF16 fprop, stored weight (device segments)";
  check_device_segments(seg, what);
  FLOWMOE_CHECK(w.data != nullptr, what << ": no stored weight");
  sm90::Bf16RowsArgs a = bf16_rows_args(seg, n, k, x, {w.data, int64_t(seg.num_segments) * w.rows * w.cols}, y,
                                        /*dgrad=*/false, what, /*stored=*/true);  // (W^T read MN-major)
  a.b_rows = w.rows, a.b_cols = w.cols, a.split_gate_up = w.gate_up;
  sm90::bf16_grouped_rows(a, what, stream);
  impl_->stats.bf16_kernel_calls += seg.capacity > 0;
}

void GroupedGemm::dgrad_bf16(const DeviceSegments& seg, int64_t n, int64_t k, Span<const bf16_t> dy,
                             const gemm::StoredW& w, Span<bf16_t> dx, cudaStream_t stream) {
  const char* what = "BF16 dgrad, stored weight (device segments)";
  check_device_segments(seg, what);
  FLOWMOE_CHECK(w.data != nullptr, what << ": no stored weight");
  sm90::Bf16RowsArgs a = bf16_rows_args(seg, k, n, dy, {w.data, int64_t(seg.num_segments) * w.rows * w.cols}, dx,
                                        /*dgrad=*/true, what, /*stored=*/true);  // (W^T read K-major)
  a.b_rows = w.rows, a.b_cols = w.cols;  // (gate_up: dy's columns in the stored order already)
  sm90::bf16_grouped_rows(a, what, stream);
  impl_->stats.bf16_kernel_calls += seg.capacity > 0;
}

void GroupedGemm::wgrad_bf16(const DeviceSegments& seg, int64_t n, int64_t k, Span<const bf16_t> dy,
                             Span<const bf16_t> x, const WgradOut& dw, cudaStream_t stream) {
  const char* what = "BF16 wgrad (device segments)";
  check_device_segments(seg, what);
  const gemm::StoredDw& st = dw.stored;
  check_span_holds(dw.size, int64_t(seg.num_segments) * (st.rows > 0 ? st.rows * st.cols : n * k), what, "dw");
  check_span_holds(dy.size, seg.capacity * n, what, "dy");
  check_span_holds(x.size, seg.capacity * k, what, "x");
  sm90::Bf16WgradArgs a;
  a.offsets = seg.offsets;
  a.num_experts = seg.num_segments;
  a.m = seg.capacity;
  a.n = n;
  a.k = k;
  a.dy = dy.data;
  a.x = x.data;
  a.dw = dw.data;
  a.accumulate = dw.kind == WgradOut::Kind::kF32Accumulate;
  a.out_bf16 = dw.kind == WgradOut::Kind::kBf16;
  a.stored_rows = st.rows;
  a.stored_cols = st.cols;
  a.stored_interleaved = st.interleaved;
  a.status = seg.status;
  sm90::bf16_grouped_wgrad(a, what, stream);
  impl_->stats.bf16_kernel_calls += seg.capacity > 0;  // (at capacity 0: a memset when overwriting)
}

}  // namespace cuda
}  // namespace flowmoe
