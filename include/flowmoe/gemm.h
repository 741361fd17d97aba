// Grouped expert GEMMs (SPEC §5): FP8 block-scaled (1x128 activations x 128x128 weights for
// fprop and dgrad, 1x128 x 1x128 along tokens for wgrad) on cuBLASLt, the BF16 baseline, the
// CPU reference that defines the block-scaled numerics, and the argument checks they share.
//
// Conventions, the same for every pass. One MoE linear layer has E experts with weights
// W_e [N, K] (N output features, K input features). Token rows are grouped by expert into ragged
// segments (flowmoe::Segments: offsets[0] = 0 <= ... <= offsets[E] = M), as permute+pad
// produces them. Row-major everywhere.
//   fprop  Y_e  [M_e, N] = X_e  [M_e, K] . W_e^T          X row-wise 1x128, W 128x128
//   dgrad  dX_e [M_e, K] = dY_e [M_e, N] . W_e            dY row-wise 1x128, the exact transposed
//                                                         weight copy Wt_e [K, N] (128x128)
//   wgrad  dW_e [N, K]   = dY_e^T . X_e (sum over tokens) dY and X column-wise (codes [C, M],
//                                                         1x128 scales along tokens per segment)
// Experts with no tokens are skipped (wgrad writes zeros for them unless it accumulates).
//
// Scales. flowmoe stores UE8M0 bytes (tensor.h); cuBLASLt's block-scaled FP8 modes
// (CUBLASLT_MATMUL_MATRIX_SCALE_VEC128_32F / _BLK128x128_32F, sm_90) read FP32 scales in fixed
// layouts. The "GEMM-ready" FP32 layouts below are what the GEMM reads; the conversion kernels
// (flowmoe::cuda::*_scales_to_f32) write them from the UE8M0 layouts, exactly (powers of two;
// UE8M0 0xFF -> NaN):
//   activation, row-wise (fprop X, dgrad dY), C features: expert-packed. Expert e's block starts
//       at float offset (C/128) * offsets[e] and is [C/128][M_e], tokens contiguous. (cuBLASLt has
//       no leading dimension for scales, so the global [C/128][M] UE8M0 grid cannot be sliced
//       per expert; this is the same grid with each expert's columns gathered.) M*C/128 floats.
//   column-wise (wgrad dY, X), C features: the flowmoe layout as is, [NB][C] (NB = number of
//       128-token blocks over all segments); expert e's blocks are rows block_offsets[e].. .
//   weights (fprop W [N, K]: rows N, cols K; dgrad Wt [K, N]: rows K, cols N): per expert
//       [rows/128][ld] with ld = round_up(cols/128, 4) (cuBLASLt wants the K-contiguous grid's
//       stride a multiple of 4; the padding floats are written 0 and never read); experts
//       contiguous, E * (rows/128) * ld floats.
//
// Host-side counts: the GEMMs launch one cuBLASLt matmul per non-empty expert, so the per-expert
// token counts must be on the host. Fetch the routing counts once per layer pass (one small
// device-to-host copy and a stream sync after routing) and pass the same Segments to all six
// GEMMs of that layer (forward and backward). The scale conversion kernels read device offsets.
#pragma once

#include <cstddef>
#include <cstdint>
#include <memory>
#include <vector>

#include "flowmoe/cuda/qtensor_view.h"
#include "flowmoe/settings.h"
#include "flowmoe/swiglu_math.h"
#include "flowmoe/tensor.h"

// The CUDA runtime's stream handle, declared without including cuda_runtime.h (same typedef).
typedef struct CUstream_st* cudaStream_t;

namespace flowmoe {
namespace cuda {
struct DeviceStatus;  // flowmoe/cuda/status.h
}  // namespace cuda
namespace gemm {

enum class Pass : uint8_t { kFprop, kDgrad, kWgrad };
const char* pass_name(Pass p);  // "fprop", "dgrad", "wgrad"

// Per-expert token counts the FP8 path requires (cuBLASLt limits, see docs/GEMM.md):
//  fprop/dgrad: tokens are the GEMM's N dimension, and block-scaled FP8 needs M and N multiples
//               of 4 (this also keeps every expert's packed FP32 scale block 16-byte aligned);
//  wgrad:       tokens are the contraction dimension, read at column offset offsets[e] of codes
//               [C, M]: FP8 tensor cores need it 16-byte aligned, so counts are multiples of 16.
// Pad segments to these (permute+pad does; padding rows are zero). The BF16 path takes any count.
int fp8_token_multiple(Pass p);

inline int64_t round_up(int64_t x, int64_t m) { return (x + m - 1) / m * m; }

// ---- GEMM-ready FP32 scale buffer sizes (floats) -----------------------------------------------
// Row-wise activation [M, C]: M * C/128.
int64_t act_scale_f32_elems(int64_t m, int64_t c);
// Column-wise [M, C] over `seg`: num_blocks * C.
int64_t col_scale_f32_elems(const Segments& seg, int64_t c);
// Leading dimension (floats) of one weight's FP32 scale grid: round_up(cols/128, 4).
int64_t weight_scale_ld(int64_t cols);
// E weights [rows, cols]: E * rows/128 * weight_scale_ld(cols).
int64_t weight_scale_f32_elems(int num_experts, int64_t rows, int64_t cols);

// ---- host builders of the GEMM-ready layouts (the specification of the conversion kernels) ---
// Row-wise QTensor [M, C] (scales [C/128][M]) over `seg` -> expert-packed FP32.
std::vector<float> act_scales_f32(const QTensor& row, const Segments& seg);
// Column-wise QTensor -> FP32 [NB][C] (same order).
std::vector<float> col_scales_f32(const QTensor& col);
// E weight QTensors, all [rows, cols] -> [E][rows/128][weight_scale_ld(cols)] (padding 0).
std::vector<float> weight_scales_f32(const std::vector<QTensor>& w);

// ---- operand views (device pointers plus their sizes, checked against the shapes) ------------
template <typename T>
struct Span {
  T* data = nullptr;
  int64_t size = 0;  // elements
};
// FP8 operand: E4M3 codes and GEMM-ready FP32 scales, as the checks below read them. Build it
// from the device view of the tensor (fp8_operand), or pass the view to GroupedGemm directly.
struct Fp8Operand {
  Span<const uint8_t> codes;
  Span<const float> scales;
};
// The operand of a device view (flowmoe/cuda/qtensor_view.h) with GEMM-ready FP32 scales
// (ScaleFormat::kF32): row-wise 1x128 (fprop x, dgrad dy), column-wise 128x1 (wgrad dy, x) or
// 128x128 weights (fprop w, dgrad wt). Throws flowmoe::Error naming `what` for any other view.
Fp8Operand fp8_operand(const cuda::QTensorView& v, const char* what);
// A wgrad output written where a model stores the weight instead of as [E][N][K] (GroupedGemm::wgrad
// and wgrad_bf16 on device segments, flowmoe's kernels only): [E][rows][cols] with rows <= N and cols <= K, the
// rows and columns past them not written (a padded layer's zeros); `interleaved`: K's halves
// [0, K/2) (gate) and [K/2, K) (up) alternate, column j of the gate half at 2 j and of the up half at
// 2 j + 1 (K a multiple of 256). rows = 0: not stored ([E][N][K]). The layer computes the stored
// weight's own gradient, the transpose of its layout's, by swapping the operands (dy_col <-> x_col;
// BF16: dy <-> x).
struct StoredDw {
  int64_t rows = 0;
  int64_t cols = 0;
  bool interleaved = false;
};
// A BF16 weight read where a model stores it (GroupedGemm::fprop_bf16 / dgrad_bf16 on device
// segments): expert e's W_e^T, [rows][cols] with rows <= K and cols <= N, at data + e * rows * cols;
// what lies past them reads as zeros (a padded layer's). `gate_up`: its N columns hold the gate and
// up halves alternating (column 2 j: gate j, 2 j + 1: up j; gpt-oss's gate_up_proj): fprop writes y
// in the layer's order (gate half, then up half), dgrad reads dy in the stored order.
struct StoredW {
  const bf16_t* data = nullptr;
  int64_t rows = 0;
  int64_t cols = 0;
  bool gate_up = false;
};
// wgrad output [E][N][K]: BF16, FP32, or FP32 accumulated into (main gradients, beta = 1).
struct WgradOut {
  enum class Kind : uint8_t { kBf16, kF32, kF32Accumulate };
  Kind kind = Kind::kF32;
  void* data = nullptr;
  int64_t size = 0;  // elements
  StoredDw stored;   // (rows > 0: [E][rows][cols] as above; size then counts those)
  static WgradOut bf16(bf16_t* p, int64_t n) { return {Kind::kBf16, p, n, {}}; }
  static WgradOut f32(float* p, int64_t n) { return {Kind::kF32, p, n, {}}; }
  static WgradOut accumulate(float* p, int64_t n) { return {Kind::kF32Accumulate, p, n, {}}; }
};
const char* wgrad_kind_name(WgradOut::Kind k);

// ---- argument checks (throw flowmoe::Error saying what was wrong and what was expected) -------
// Shared by the CUDA GEMMs (before any launch) and testable without a GPU. n, k as in the
// conventions above; pointers must be 16-byte aligned and non-null unless their size is zero.
void check_fp8_fprop(const Segments& seg, int64_t n, int64_t k, const Fp8Operand& x,
                     const Fp8Operand& w, Span<const bf16_t> y);
void check_fp8_dgrad(const Segments& seg, int64_t n, int64_t k, const Fp8Operand& dy,
                     const Fp8Operand& wt, Span<const bf16_t> dx);
void check_fp8_wgrad(const Segments& seg, int64_t n, int64_t k, const Fp8Operand& dy_col,
                     const Fp8Operand& x_col, const WgradOut& dw);
// BF16: x [M, K], w [E][N][K], y [M, N] (and the dgrad/wgrad analogues); n, k multiples of 8.
void check_bf16(Pass p, const Segments& seg, int64_t n, int64_t k, Span<const bf16_t> in_a,
                Span<const bf16_t> in_b, const void* out, int64_t out_size);

// Token segments that stay on the device: the offsets the routing kernels wrote, read by the GEMM
// kernels themselves, so the host never needs the per-expert counts (no synchronisation; a CUDA
// graph can capture the call). The token operands have `capacity` rows (a bound on offsets[E],
// e.g. the routing's worst case); rows past offsets[E] are neither read into the result nor written.
struct DeviceSegments {
  const int32_t* offsets = nullptr;      // [num_segments + 1] on the device, offsets[0] = 0 (plain
                                         // fprop / dgrad: >= 0, the rows before it untouched: a range
                                         // of experts; not the fused SwiGLU / dSwiGLU epilogues, wgrad)
  int num_segments = 0;                  // 1 .. 1024
  int64_t capacity = 0;                  // rows of the token operands
  cuda::DeviceStatus* status = nullptr;  // malformed offsets counted in bad_segments (may be null)
};

// ---- options of cuda::GroupedGemm (docs/GEMM.md, "Concurrency and algorithm choice") ----------
struct GroupedGemmOptions {
  static constexpr int kMaxStreams = 16;
  static constexpr int kMaxCandidates = 16;
  static constexpr int kMaxPoolPriority = 8;

  // Concurrency: the per-expert matmuls of one call go round-robin to `streams` streams, the
  // caller's stream and streams - 1 pool streams forked from it and joined back to it with events
  // (the call stays stream-ordered on the caller's stream). Each stream has its own cuBLASLt
  // workspace. 1: every matmul on the caller's stream (pool_priority > 0: on one pool stream).
  int streams = 4;
  // Priority of the matmuls. 0: the pool streams at the default priority, slot 0 the caller's
  // stream (above). p > 0: `streams` pool streams created p steps above the default priority
  // (clamped to the device's range) carry every matmul; the caller's stream only forks and joins.
  // The MoE layer uses 1 when it runs copies on a side stream at the default priority: the block
  // scheduler then starts pending GEMM blocks first and the copies fill the gaps.
  int pool_priority = 0;
  size_t workspace_bytes = size_t(32) << 20;  // cuBLASLt workspace per stream
  // Algorithm choice. tune: ask cuBLASLt's heuristic for `candidates` algorithms, time them once per
  // problem key (pass, output kind, the two weight dimensions, a bucket of the token count) on the
  // real operands of the first expert with that key, and keep the fastest for every later call.
  // false: the heuristic's first algorithm per exact shape.
  bool tune = true;
  int candidates = 8;
  int tune_reps = 3;           // timed runs per candidate, after one untimed run
  double tune_margin = 0.02;   // another candidate replaces the heuristic's first only when faster
                               // by more than this fraction (stable picks under timing noise)
  // Trials of a wgrad that accumulates (beta = 1) write a scratch output, never the gradients: one
  // buffer per device for the whole process, as large as the largest tune_scratch_bytes of the
  // live tuning objects (allocated by their constructors, used under a lock). A key whose expert
  // output ([N, K] FP32) exceeds this object's value is not timed (the heuristic's first); 0: none.
  size_t tune_scratch_bytes = size_t(128) << 20;
  // FP8 wgrad (FP32 output, overwrite or accumulate; BF16 output, overwrite): flowmoe's own sm_90a kernel, one
  // persistent launch over all experts whose epilogue (TMA reduce-add into the main gradients)
  // overlaps the next tile's math, or cuBLASLt per expert (docs/GEMM.md "The wgrad kernel").
  // kAuto: the kernel where the problem fits it (wgrad_kernel_unsupported) and where it measured
  // at least as fast as cuBLASLt on the H200 (choose_wgrad_kernel); kAlways: wherever it fits;
  // kOff: cuBLASLt. Setting FLOWMOE_GEMM_WGRAD_KERNEL=0 (off), 1 (auto), 2 (always).
  enum class WgradKernel : uint8_t { kOff, kAuto, kAlways };
  WgradKernel wgrad_kernel = WgradKernel::kAuto;
  // Output tile width (along K) of that kernel: 0 chooses by shape (docs/GEMM.md "The wgrad
  // kernel"); 128 or 256 (K a multiple of 256) force one, for benchmarks and tests. The bits do not
  // depend on it. Setting FLOWMOE_GEMM_WGRAD_TILE=0|128|256.
  int wgrad_tile_n = 0;
  // Share the choices with every GroupedGemm of this process on the same device (same workspace
  // size and candidate count): a key is timed once per process and all objects run the same
  // algorithm for it. false: this object times its own keys.
  bool share_tuning = true;

  // The behaviour before concurrency and tuning: one stream, the heuristic's first algorithm.
  static GroupedGemmOptions previous();
  // `base` (the defaults unless given), then the named settings (flowmoe/settings.h; programs pass
  // env_lookup(), the library never reads the environment): FLOWMOE_GEMM_TUNE=0|1 sets `tune`,
  // FLOWMOE_GEMM_STREAMS=N sets `streams` (1..16), FLOWMOE_GEMM_PRIORITY=P sets `pool_priority`
  // (0..8), FLOWMOE_GEMM_WGRAD_KERNEL=0|1|2 sets `wgrad_kernel`, FLOWMOE_GEMM_WGRAD_TILE=0|128|256
  // `wgrad_tile_n`. Anything else in them throws.
  static GroupedGemmOptions from_settings(const SettingLookup& lookup,
                                          const GroupedGemmOptions& base);
  static GroupedGemmOptions from_settings(const SettingLookup& lookup);
  void validate() const;  // throws flowmoe::Error naming the bad field and the accepted range
};

// Why the sm_90a FP8 wgrad kernel cannot take a problem, or null when it can (FP32 output, added
// to or overwritten, or BF16 output, overwritten): it needs N and K multiples of 128, every expert's token offset and the token total multiples of
// 128 (permute+pad with alignment 128), at most 256 non-empty experts, sizes below 2^31; besides,
// GroupedGemm::wgrad runs it only on a compute capability 9.0 device with 16-byte aligned operands.
const char* wgrad_kernel_unsupported(const Segments& seg, int64_t n, int64_t k);
// Whether GroupedGemm::wgrad runs the kernel for this problem under `mode`. kAuto takes it where it
// is at least as fast as cuBLASLt per expert on the H200 (docs/GEMM.md, "The wgrad kernel"): small
// experts (at most 1024 tokens each on average), or expert matrices N x K up to 16 Mi elements
// when accumulating and up to 8 Mi when overwriting; cuBLASLt's mainloop is ahead on larger ones.
bool choose_wgrad_kernel(GroupedGemmOptions::WgradKernel mode, const Segments& seg, int64_t n, int64_t k,
                         WgradOut::Kind kind);

// The token bucket of the tuning key: every count up to 128 is one bucket (128); above, half
// octaves: (128, 192], (192, 256], (256, 384], ... The bucket's upper end is returned.
int64_t tune_token_bucket(int64_t tokens);

}  // namespace gemm

// ---- CPU reference -----------------------------------------------------------------------------
// Block-scaled exactly as the GEMM defines it: for each output element and each 128-wide block of
// the contraction dimension, the decoded E4M3 code products are summed in FP32 (in index order),
// the block sum is multiplied by (scale_a * scale_b), and the block results are summed in FP32 in
// block order. Outputs are FP32 (round to BF16 to compare with a BF16-output GEMM). No alignment
// requirements: any token counts, any segments.
namespace cpu {

// x: row-wise [M, K]; w: E weights [N, K]; y: [M, N].
void grouped_fprop_ref(const QTensor& x, const std::vector<QTensor>& w, const Segments& seg,
                       float* y);
// dy: row-wise [M, N]; wt: E transposed weights [K, N]; dx: [M, K].
void grouped_dgrad_ref(const QTensor& dy, const std::vector<QTensor>& wt, const Segments& seg,
                       float* dx);
// dy_col, x_col: column-wise copies of dY [M, N] and X [M, K] over the same segments (their token
// blocks are the wgrad K blocks); dw: [E][N][K], overwritten, or added to when `accumulate`.
void grouped_wgrad_ref(const QTensor& dy_col, const QTensor& x_col, float* dw, bool accumulate);

// BF16 baseline references: products of BF16 values (exact in FP32) summed in FP32 in index order.
// x [M, K], w [E][N][K], y [M, N]
void grouped_fprop_bf16_ref(const bf16_t* x, const bf16_t* w, const Segments& seg, int64_t n,
                            int64_t k, float* y);
// dy [M, N], w [E][N][K], dx [M, K]
void grouped_dgrad_bf16_ref(const bf16_t* dy, const bf16_t* w, const Segments& seg, int64_t n,
                            int64_t k, float* dx);
// dy [M, N], x [M, K], dw [E][N][K]
void grouped_wgrad_bf16_ref(const bf16_t* dy, const bf16_t* x, const Segments& seg, int64_t n,
                            int64_t k, float* dw, bool accumulate);

}  // namespace cpu

// ---- CUDA (link flowmoe_cuda) ----------------------------------------------------------------------
namespace cuda {

struct DeviceStatus;  // flowmoe/cuda/status.h

// UE8M0 -> GEMM-ready FP32 scales (exact powers of two, 0xFF -> NaN). Stream-ordered, no sync,
// no allocation; one pass per layer over a few MB (see docs/GEMM.md for the cost).
// Row-wise [C/128][M] -> expert-packed. d_offsets: [E+1] token offsets on the device. Malformed
// offsets (not 0 .. M, decreasing) count once in status->bad_segments (status may be null) and
// leave `out` untouched.
void act_scales_to_f32(const uint8_t* scales, int64_t m, int64_t c, const int32_t* d_offsets,
                       int num_experts, float* out, DeviceStatus* status, cudaStream_t stream);
// Column-wise [NB][C] -> FP32 [NB][C] (elementwise; num_blocks * c elements).
void col_scales_to_f32(const uint8_t* scales, int64_t num_blocks, int64_t c, float* out,
                       cudaStream_t stream);
// E weights' scales [E][rows/128][cols/128] -> [E][rows/128][round_up(cols/128, 4)].
void weight_scales_to_f32(const uint8_t* scales, int num_experts, int64_t rows, int64_t cols,
                          float* out, cudaStream_t stream);

// W1 of the experts, 128x128 FP8 [E * 2F, K] (UE8M0 or FP32 scales), with each expert's 128-row
// blocks reordered gate 0, up 0, gate 1, up 1, ... (natural order: gate blocks, then up blocks), the
// scale rows with them: the weight GroupedGemm::fprop_swiglu reads. `out` has w's shape and scale
// format and does not overlap it. Stream-ordered, no sync, no allocation.
void interleave_gate_up(const QTensorView& w, const QTensorView& out, cudaStream_t stream);

// The exact transpose of E weights in 128x128 FP8 blocks: w [E * N, K] -> wt [E * K, N], each
// expert's codes transposed and each block keeping its scale (UE8M0 or FP32, w's format; FP32
// rows' padding entries written 0): the bits quantize_weights writes for the transpose. With
// gate_up_interleaved, w is W1 as interleave_gate_up wrote it and wt the transpose of the natural
// order (GEMM1's dgrad operand). The caller-memory layer derives its dgrad weights this way in the
// backward. N, K multiples of 128; wt does not overlap w. Stream-ordered, no sync, no allocation.
void transpose_weight_blocks(const QTensorView& w, const QTensorView& wt, bool gate_up_interleaved,
                             cudaStream_t stream);

// Grouped GEMMs on cuBLASLt: one matmul per non-empty expert, spread over a small pool of streams
// forked from and joined back to `stream` (GroupedGemmOptions::streams), each with its own
// workspace. The cuBLASLt handle, the matmul descriptors, the heuristic preference, the pool
// streams and events, and one device buffer holding the workspaces are created once (the
// constructor needs the device current; it also reserves the process's tuning scratch, see
// GroupedGemmOptions::tune_scratch_bytes); the matrix layouts and the algorithm
// are cached per shape and alignment. With tuning on, the first call that meets a new problem key
// times the heuristic's candidates on that call's operands (a host synchronisation, the candidates'
// runs, all before any of the call's real matmuls are enqueued) and every later call of that key
// uses the winner: the same call gives the same bits every time, whatever `streams` is (experts are
// independent; the algorithm does not depend on the stream). No device allocation and, once the
// keys are tuned, no synchronisation per call. Not thread-safe; calls of one object must not
// overlap on different streams (the workspaces are reused by its calls).
class GroupedGemm {
 public:
  using Options = gemm::GroupedGemmOptions;
  static constexpr size_t kDefaultWorkspace = size_t(32) << 20;
  GroupedGemm();  // the default Options (the library reads no environment)
  explicit GroupedGemm(const Options& options);
  ~GroupedGemm();
  GroupedGemm(const GroupedGemm&) = delete;
  GroupedGemm& operator=(const GroupedGemm&) = delete;

  using Fp8Operand = gemm::Fp8Operand;
  using WgradOut = gemm::WgradOut;
  template <typename T>
  using Span = gemm::Span<T>;

  // FP8 block-scaled (sm_90). Sizes (elements): x.codes M*K, x.scales M*K/128 (expert-packed),
  // w.codes E*N*K, w.scales weight_scale_f32_elems(E, N, K), y M*N.
  void fprop(const Segments& seg, int64_t n, int64_t k, const Fp8Operand& x, const Fp8Operand& w,
             Span<bf16_t> y, cudaStream_t stream);
  // dy.codes M*N, dy.scales M*N/128 (expert-packed), wt.codes E*K*N (Wt_e [K, N]),
  // wt.scales weight_scale_f32_elems(E, K, N), dx M*K.
  void dgrad(const Segments& seg, int64_t n, int64_t k, const Fp8Operand& dy,
             const Fp8Operand& wt, Span<bf16_t> dx, cudaStream_t stream);
  // dy_col.codes N*M ([N, M]), dy_col.scales NB*N; x_col.codes K*M, x_col.scales NB*K;
  // dw E*N*K.
  void wgrad(const Segments& seg, int64_t n, int64_t k, const Fp8Operand& dy_col,
             const Fp8Operand& x_col, const WgradOut& dw, cudaStream_t stream);
  // Whether wgrad on these host segments runs flowmoe's sm_90a kernel (not cuBLASLt per expert):
  // then the same problem on device segments gives the same bits, and takes UE8M0 scales.
  bool wgrad_runs_kernel(const Segments& seg, int64_t n, int64_t k, WgradOut::Kind kind) const;

  // The same on device views with GEMM-ready FP32 scales (gemm::fp8_operand): x, dy row-wise,
  // w, wt 128x128 (E experts stacked), dy_col, x_col column-wise.
  void fprop(const Segments& seg, int64_t n, int64_t k, const cuda::QTensorView& x,
             const cuda::QTensorView& w, Span<bf16_t> y, cudaStream_t stream) {
    fprop(seg, n, k, gemm::fp8_operand(x, "FP8 fprop x"), gemm::fp8_operand(w, "FP8 fprop w"), y,
          stream);
  }
  void dgrad(const Segments& seg, int64_t n, int64_t k, const cuda::QTensorView& dy,
             const cuda::QTensorView& wt, Span<bf16_t> dx, cudaStream_t stream) {
    dgrad(seg, n, k, gemm::fp8_operand(dy, "FP8 dgrad dy"), gemm::fp8_operand(wt, "FP8 dgrad wt"),
          dx, stream);
  }
  void wgrad(const Segments& seg, int64_t n, int64_t k, const cuda::QTensorView& dy_col,
             const cuda::QTensorView& x_col, const WgradOut& dw, cudaStream_t stream) {
    wgrad(seg, n, k, gemm::fp8_operand(dy_col, "FP8 wgrad dy_col"),
          gemm::fp8_operand(x_col, "FP8 wgrad x_col"), dw, stream);
  }

  // FP8 on device segments: flowmoe's sm_90a kernels, one persistent launch over all experts that
  // reads the offsets on the device (docs/GEMM.md, "The grouped kernels"). No host
  // synchronisation, no allocation, capturable in a CUDA graph; no tuning (cuBLASLt is not used).
  // Any token counts for fprop and dgrad (0, 1, 129, ...); x, dy row-wise [capacity, K] with UE8M0
  // scales ([K/128][scale_ld], read as they are: no conversion pass) or expert-packed FP32 over the
  // same offsets; w [E*N, K], wt [E*K, N] 128x128 with UE8M0 or GEMM-ready FP32 scales; y, dx
  // [capacity, N or K] BF16 (rows past offsets[E] untouched). wgrad: every offset a multiple of 128
  // (permute+pad alignment 128), capacity a multiple of 128, dy_col/x_col column-wise with scales
  // [capacity/128][C], both FP32 or both UE8M0 as the column copies are written (the kernel decodes
  // them: the same bits, and no conversion pass before it), FP32 output (overwrite zeroes empty experts, or accumulate) or BF16
  // output (overwrite; each FP32 sum rounded once, RNE).
  // Malformed offsets are counted in seg.status and leave the output untouched; bad shapes throw.
  using DeviceSegments = gemm::DeviceSegments;
  void fprop(const DeviceSegments& seg, int64_t n, int64_t k, const cuda::QTensorView& x,
             const cuda::QTensorView& w, Span<bf16_t> y, cudaStream_t stream);
  void dgrad(const DeviceSegments& seg, int64_t n, int64_t k, const cuda::QTensorView& dy,
             const cuda::QTensorView& wt, Span<bf16_t> dx, cudaStream_t stream);
  void wgrad(const DeviceSegments& seg, int64_t n, int64_t k, const cuda::QTensorView& dy_col,
             const cuda::QTensorView& x_col, const WgradOut& dw, cudaStream_t stream);

  // GEMM1 of the flow recipes with SwiGLU*prob and the quantizations fused into the grouped
  // kernel's epilogue (docs/EPILOGUES.md §1). For every row r < offsets[E]
  // (expert e) with h = x_r . W1_e^T rounded to BF16 (what fprop writes, gate = h[0, F),
  // up = h[F, 2F)): a'_r = row_prob[r] * act(gate, up) written to a_row (FP8 1x128 row tiles,
  // [capacity, F], UE8M0 scales [F/128][scale_ld]) and h written to h_saved (FP8 1x128 rows
  // [capacity, 2F] with UE8M0 scales [2F/128][scale_ld], or MXFP4 1x32 [capacity, 2F]): exactly
  // the bits of fprop followed by cuda::swiglu_quant (FP8 h) or cuda::swiglu_quant_h4 (MXFP4 h) on
  // the rows < offsets[E]; h in BF16 is never written, other rows are untouched. x as fprop's;
  // w1_interleaved: W1 [E * 2F, K] with each expert's 128-row blocks interleaved gate/up
  // (interleave_gate_up); row_prob: [capacity] on the device, or null (a' = act(gate, up)).
  // Non-finite a', gate and up values are counted in status->nonfinite (may be null) as the SwiGLU
  // kernels count them; malformed offsets in seg.status. F a positive multiple of 128.
  // act: SwiGLU or the clamped SwiGLU (with its saved-h marks, swiglu_math.h); gate_up_bias:
  // GEMM1's bias [E, 2F] FP32 (gate then up, 16-byte aligned) added to h as cuda::swiglu_quant's
  // GateUpBias adds it, or null.
  void fprop_swiglu(const DeviceSegments& seg, int64_t f, int64_t k, const cuda::QTensorView& x,
                    const cuda::QTensorView& w1_interleaved, const float* row_prob,
                    const cuda::QTensorView& a_row, const cuda::QTensorView& h_saved, DeviceStatus* status,
                    cudaStream_t stream, const GatedActivation& act = {}, const float* gate_up_bias = nullptr);

  // GEMM2-dgrad of the flow recipes with dSwiGLU*prob and dh's quantizations fused into the
  // grouped kernel's epilogue (docs/EPILOGUES.md §2). For every row
  // r < offsets[E] with da' = dy_r . W2 rounded to BF16 (what dgrad writes; n = H, wt = W2^T
  // [E * F, H]) and the saved h (h_saved: FP8 1x128 rows [capacity, 2F] with scale_ld >= capacity,
  // or MXFP4 1x32 [capacity, 2F] with dense scales): dh = [dgate, dup] written to dh_row (FP8 1x128
  // rows [capacity, 2F], tight scales) and dh_col (FP8 128x1 columns over the segments' 128-token
  // blocks, UE8M0 scales [capacity/128 + E][2F]), and dp's partial sums [F/128][capacity] to
  // dprob_partials (null: not written; needs row_prob): exactly the bits of dgrad followed by
  // cuda::dswiglu_quant_fp8h / dswiglu_quant_fp4h on the rows < offsets[E]; da' in BF16 is never
  // written, other rows are untouched. row_prob: [capacity], or null (plain dSwiGLU). Non-finite
  // dgate and dup values are counted in status->nonfinite (may be null) as the dSwiGLU kernels
  // count them; malformed offsets in seg.status. F a positive multiple of 128.
  // act: the forward's activation (the clamped SwiGLU's gradient masks read the saved marks).
  void dgrad_dswiglu(const DeviceSegments& seg, int64_t n, int64_t f, const cuda::QTensorView& dy,
                     const cuda::QTensorView& wt, const float* row_prob, const cuda::QTensorView& h_saved,
                     const cuda::QTensorView& dh_row, const cuda::QTensorView& dh_col, float* dprob_partials,
                     DeviceStatus* status, cudaStream_t stream, const GatedActivation& act = {});

  // BF16 baseline (FP32 accumulation): x [M, K], w [E][N][K], y [M, N]; dgrad uses W itself.
  void fprop_bf16(const Segments& seg, int64_t n, int64_t k, Span<const bf16_t> x,
                  Span<const bf16_t> w, Span<bf16_t> y, cudaStream_t stream);
  void dgrad_bf16(const Segments& seg, int64_t n, int64_t k, Span<const bf16_t> dy,
                  Span<const bf16_t> w, Span<bf16_t> dx, cudaStream_t stream);
  void wgrad_bf16(const Segments& seg, int64_t n, int64_t k, Span<const bf16_t> dy,
                  Span<const bf16_t> x, const WgradOut& dw, cudaStream_t stream);

  // BF16 on device segments: flowmoe's sm_90a kernels, one persistent launch each over all experts
  // that reads the offsets on the device (docs/GEMM.md, "The BF16 kernels"), FP32 accumulation, the
  // operands read as they lie (dgrad: W itself, wgrad: dy and x row-wise). No host
  // synchronisation, no allocation, capturable in a CUDA graph. n, k multiples of 128; x, dy
  // [capacity, K or N], y, dx [capacity, N or K] (rows past offsets[E] untouched); fprop and dgrad
  // take any token counts, wgrad needs every offset a multiple of 128 (permute+pad alignment 128,
  // the padding rows zero) and writes FP32 (overwrite zeroes empty experts, or accumulate) or BF16 (overwrite).
  // Malformed offsets are counted in seg.status and leave the output untouched; bad shapes throw.
  void fprop_bf16(const DeviceSegments& seg, int64_t n, int64_t k, Span<const bf16_t> x,
                  Span<const bf16_t> w, Span<bf16_t> y, cudaStream_t stream);
  void dgrad_bf16(const DeviceSegments& seg, int64_t n, int64_t k, Span<const bf16_t> dy,
                  Span<const bf16_t> w, Span<bf16_t> dx, cudaStream_t stream);
  void wgrad_bf16(const DeviceSegments& seg, int64_t n, int64_t k, Span<const bf16_t> dy,
                  Span<const bf16_t> x, const WgradOut& dw, cudaStream_t stream);
  // The same fprop and dgrad with W read where the model stores it (StoredW: no relaid copy).
  void fprop_bf16(const DeviceSegments& seg, int64_t n, int64_t k, Span<const bf16_t> x, const gemm::StoredW& w,
                  Span<bf16_t> y, cudaStream_t stream);
  void dgrad_bf16(const DeviceSegments& seg, int64_t n, int64_t k, Span<const bf16_t> dy, const gemm::StoredW& w,
                  Span<bf16_t> dx, cudaStream_t stream);

  struct Stats {
    int64_t matmuls = 0;            // cublasLtMatmul launches of real work (not tuning trials)
    int64_t heuristic_queries = 0;  // cublasLtMatmulAlgoGetHeuristic calls
    int64_t cached_plans = 0;       // shapes currently cached
    int64_t zero_fills = 0;         // wgrad outputs of empty experts zeroed (overwrite modes)
    int64_t concurrent_calls = 0;   // calls whose matmuls ran on more than one stream
    int64_t wgrad_kernel_calls = 0; // FP8 wgrads run by the sm_90a kernel (one launch each)
    int64_t grouped_kernel_calls = 0;  // FP8 fprops and dgrads run by the sm_90a grouped kernel
    int64_t bf16_kernel_calls = 0;  // BF16 fprops, dgrads and wgrads run by the sm_90a BF16 kernels
    int64_t tuned_keys = 0;         // problem keys this object resolved (timed or shared)
    int64_t tunings = 0;            // keys this object timed itself
    int64_t tune_trials = 0;        // trial matmuls run while timing
    int64_t tune_fallbacks = 0;     // shapes the key's algorithm does not support (heuristic's first)
  };
  Stats stats() const;
  // Drop the cached layouts and this object's copy of the algorithm choices. Shared choices
  // (Options::share_tuning) stay in the process and are picked up again; an object that does not
  // share re-times its keys (and may pick differently).
  void clear_cache();

  // Debug: one record per problem key this object resolved, in the order they were met.
  struct TuneRecord {
    const char* what = "";        // "FP8 fprop", "BF16 wgrad", ...
    const char* how = "";         // "timed", "one candidate", "stream capture",
                                  // "scratch too small", "no candidate ran"
    bool accumulate = false;      // wgrad beta = 1
    bool shared = false;          // chosen by another GroupedGemm of this process
    int64_t m = 0, n = 0, k = 0;  // the cuBLASLt problem it was timed on (D m x n, column-major)
    int64_t token_bucket = 0;     // upper end of its token bucket (tokens: n in fprop/dgrad, k in wgrad)
    int candidates = 0;           // algorithms the heuristic returned
    int picked = 0;               // index among them; 0 = the heuristic's first choice
    float first_us = 0, picked_us = 0;  // per run, as timed (0: not timed)
    int algo_id = -1, tile_id = -1, splitk = -1, stages = -1;  // the picked algorithm's config
  };
  std::vector<TuneRecord> tune_records() const;

  const Options& options() const;
  // Use at most `streams` (1 .. options().streams) of the pool from now on (tests, experiments:
  // the serial path with the same algorithm choices).
  void set_concurrency(int streams);
  size_t device_bytes() const;  // this object's device buffer: streams x workspace_bytes
  // The tuning scratch shared by the process on the current device (0 when no tuning object lives).
  static size_t tuning_scratch_bytes();

 private:
  void rowwise_on_device(const DeviceSegments& seg, int64_t n_out, int64_t k_red, const cuda::QTensorView& a,
                         const cuda::QTensorView& b, Span<bf16_t> d, const char* what, cudaStream_t stream);
  struct Impl;
  std::unique_ptr<Impl> impl_;
};

}  // namespace cuda
}  // namespace flowmoe
