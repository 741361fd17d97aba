// The CUDA layer's GEMMs and their operands (step context services, step_context.h): the FP8
// tensors of the workspace as gemm.h operands (UE8M0 scales converted to the GEMM-ready FP32
// layouts on the way), the weights and the dgrad weights W^T, the wgrad output mode.
#include <cuda_runtime.h>

#include <algorithm>

#include "cuda/common.cuh"
#include "cuda/moe/step_context.h"

namespace flowmoe {
namespace cuda {
namespace moe {

// Row-wise UE8M0 operand [Mp, C] -> GEMM-ready (expert-packed FP32 scales in gemm_row_scales).
gemm::Fp8Operand StepContext::act_operand(const QTensorView& rows, int64_t c, DeviceStatus* st) {
  float* f32 = ws_.expert.gemm_row_scales;
  act_scales_to_f32(rows.ue8m0(), step_.Mp, c, segment_offsets(), El_, f32, st, stream_);
  return Fp8Op{cs<uint8_t>(rows.codes, step_.Mp * c), cs<float>(f32, step_.Mp * c / 128)};
}
// Column-wise UE8M0 operand [C over Mp] -> GEMM-ready FP32 [blocks][C] in `scales_f32`.
gemm::Fp8Operand StepContext::col_operand(const QTensorView& col, int64_t c, float* scales_f32, cudaStream_t s) {
  col_scales_to_f32(col.ue8m0(), step_.blocks, c, scales_f32, s);
  return Fp8Op{cs<uint8_t>(col.codes, c * step_.Mp), cs<float>(scales_f32, step_.blocks * c)};
}
// fp8-naive operands: FP32 scales already GEMM-ready.
gemm::Fp8Operand StepContext::f32_row_operand(const QTensorView& rows, int64_t c) const {
  return Fp8Op{cs<uint8_t>(rows.codes, step_.Mp * c), cs<float>(rows.f32(), step_.Mp * c / 128)};
}
gemm::Fp8Operand StepContext::f32_col_operand(const QTensorView& col, int64_t c) const {
  return Fp8Op{cs<uint8_t>(col.codes, c * step_.Mp), cs<float>(col.f32(), step_.blocks * c)};
}
// El expert weights [N, K] (or their transposes).
gemm::Fp8Operand StepContext::weight_operand(const QTensorView& w, int64_t n, int64_t k) const {
  return Fp8Op{cs<uint8_t>(w.codes, int64_t(El_) * n * k), cs<float>(w.f32(), gemm::weight_scale_f32_elems(El_, n, k))};
}
// `rows` as the GEMM reads it: [Mp, c], UE8M0 scales [c/128][Mp] as the layer's kernels write
// them, or expert-packed FP32 over this pass's segments.
QTensorView StepContext::gemm_rows(const QTensorView& rows, int64_t c) const {
  QTensorView v = rows;
  v.rows = step_.Mp;
  v.cols = c;
  v.scale_rows = c / 128;
  v.scale_ld = step_.Mp;
  if (v.scale_format == ScaleFormat::kF32) {
    v.offsets = segment_offsets();
    v.num_segments = El_;
  }
  return v;
}
QTensorView StepContext::saved_h() const {
  const QTensorView& h = ws_.expert.h_saved;
  return path_.h_mxfp4() ? mxfp4_1x32(h.codes, h.ue8m0(), step_.Mp, 2 * F_) : row_1x128(h.codes, h.ue8m0(), step_.Mp, 2 * F_);
}
void StepContext::fp8_fprop(const QTensorView& in, int64_t n, int64_t k, const QTensorView& w, bf16_t* out,
                            DeviceStatus* st) {
  if (path_.grouped_gemm) {
    gemm_->fprop(gemm::DeviceSegments{segment_offsets(), El_, step_.Mp, st}, n, k, gemm_rows(in, k), w,
                 ms<bf16_t>(out, step_.Mp * n), stream_);
    return;
  }
  const Fp8Op a = in.scale_format == ScaleFormat::kF32 ? f32_row_operand(in, k) : act_operand(in, k, st);
  gemm_->fprop(step_.seg, n, k, a, weight_operand(w, n, k), ms<bf16_t>(out, step_.Mp * n), stream_);
}
void StepContext::fp8_dgrad(const QTensorView& in, int64_t n, int64_t k, const QTensorView& w, bf16_t* out,
                            DeviceStatus* st, int e0, int ne) {
  if (path_.grouped_gemm) {  // (experts [e0, e0 + ne): their offsets, from row offsets[e0] on)
    gemm_->dgrad(gemm::DeviceSegments{segment_offsets() + e0, ne < 0 ? El_ : ne, step_.Mp, st}, n, k, gemm_rows(in, n), w,
                 ms<bf16_t>(out, step_.Mp * k), stream_);
    return;
  }
  FLOWMOE_CHECK(e0 == 0 && (ne < 0 || ne == El_), "internal error: a dgrad over a range of experts needs the grouped kernel");
  const Fp8Op a = in.scale_format == ScaleFormat::kF32 ? f32_row_operand(in, n) : act_operand(in, n, st);
  gemm_->dgrad(step_.seg, n, k, a, weight_operand(w, k, n), ms<bf16_t>(out, step_.Mp * k), stream_);
}

// W_g^T of experts [e0, e0 + n) (FP8 128 x 128 blocks, the exact transposes of W_g's) in the
// backward's scratch: quantized straight from the parameters of set_backward_weights (one pass per
// weight; the forward's W is not read), or transposed from the forward's W.
QTensorView StepContext::make_dgrad_weights(int g, int e0, int n) {
  const WeightBuffers& wb = ws_.weights;
  const int64_t rows = g == 1 ? 2 * F_ : H_, cols = g == 1 ? H_ : F_;  // W_g [rows, cols] per expert
  const int64_t off = int64_t(e0) * rows * cols;
  QTensorView wt = weight_128x128_f32(wb.wt_codes, wb.wt_scales, n, cols, rows);
  const MoeWeights& p = call_params_;
  if (p.w1 || p.w1_bf16) {
    auto s = bwd(g == 1 ? "quantize W1^T from the parameters (dgrad weights)"
                        : "quantize W2^T from the parameters (dgrad weights)");
    // (their non-finite values were counted when the forward's W was quantized: no status here)
    const ExpertStorage& st = p.storage;
    const auto transposed_only = [&](const auto* w) {  // BF16 parameters or FP32 masters
      if (st.is_layer_layout()) {
        quantize_weights(w + off, n, rows, cols, nullptr, nullptr, wt.codes, wb.wt_ue8m0, nullptr, stream_);
        return;
      }
      // where the model stores them: W1 from [El, Hs, 2Fs], W2 from [El, Fs, Hs]
      const int64_t c = g == 1 ? st.hidden : st.ffn, l = g == 1 ? 2 * st.ffn : st.hidden;
      quantize_weights_stored(w + int64_t(e0) * c * l, n, c, l, g == 1 ? st.w1_rows(F_) : st.w2_rows(), rows, cols,
                              nullptr, nullptr, wt.codes, wb.wt_ue8m0, nullptr, stream_);
    };
    if (p.bf16_params())
      transposed_only(g == 1 ? p.w1_bf16 : p.w2_bf16);
    else
      transposed_only(g == 1 ? p.w1 : p.w2);
    weight_scales_to_f32(wb.wt_ue8m0, n, cols, rows, wt.f32(), stream_);
    return wt;
  }
  auto s = bwd(g == 1 ? "transpose W1^T from W1 (dgrad weights)" : "transpose W2^T from W2 (dgrad weights)");
  const QTensorView& w = g == 1 ? wb.w1 : wb.w2;
  const QTensorView part = weight_128x128_f32(w.codes + off, w.f32() + int64_t(e0) * gemm::weight_scale_f32_elems(1, rows, cols),
                                              n, rows, cols);
  transpose_weight_blocks(part, wt, /*gate_up_interleaved=*/g == 1 && path_.fused_swiglu, stream_);
  return wt;
}

void StepContext::weight_dgrad(int g, const QTensorView& in, bf16_t* out, DeviceStatus* st) {
  const int64_t n = g == 1 ? 2 * F_ : H_, k = g == 1 ? H_ : F_;  // dY [Mp, n] -> dX [Mp, k]
  const char* name = g == 1 ? "GEMM1 dgrad (fp8)" : "GEMM2 dgrad (fp8)";
  if (!path_.transposes_in_backward) {
    auto s = bwd(name);
    fp8_dgrad(in, n, k, g == 1 ? ws_.weights.w1t : ws_.weights.w2t, out, st);
    return;
  }
  const int chunk = g == 1 ? path_.wt_chunk1 : path_.wt_chunk2;
  for (int e0 = 0; e0 < El_; e0 += chunk) {
    const int ne = std::min(chunk, El_ - e0);
    const QTensorView wt = make_dgrad_weights(g, e0, ne);
    auto s = bwd(name);
    fp8_dgrad(in, n, k, wt, out, st, e0, ne);
  }
}

void StepContext::fp8_wgrad(const QTensorView& grad_col, int64_t n, const QTensorView& in_col, int64_t k,
                            float* dw, bf16_t* dw_bf16, const gemm::StoredDw& stored) {
  ExpertBuffers& b = ws_.expert;
  const bool f32 = grad_col.scale_format == ScaleFormat::kF32;  // fp8-naive: GEMM-ready already
  if (stored.rows > 0) {
    // the stored weight is W^T's layout: its gradient dW^T = in^T . grad, the kernel with the two
    // column copies swapped (MoeLayer::writes_stored_grads: FP8 block recipes, align 128)
    gemm::WgradOut o = dw_out(dw, dw_bf16, int64_t(El_) * stored.rows * stored.cols);
    o.stored = stored;
    gemm_->wgrad(gemm::DeviceSegments{segment_offsets(), El_, step_.Mp, st_bwd_aux()}, k, n,
                 col_128x1(in_col.codes, in_col.ue8m0(), step_.Mp, k, step_.blocks),
                 col_128x1(grad_col.codes, grad_col.ue8m0(), step_.Mp, n, step_.blocks), o, stream_);
    return;
  }
  const gemm::WgradOut out = dw_out(dw, dw_bf16, int64_t(El_) * n * k);
  if (!f32 && (path_.sync_free || gemm_->wgrad_runs_kernel(step_.seg, n, k, out.kind))) {
    // the kernel reads the UE8M0 scales as the column copies hold them (the capacity's blocks;
    // those past the segments' are never read): no conversion pass, the same bits
    gemm_->wgrad(gemm::DeviceSegments{segment_offsets(), El_, step_.Mp, st_bwd_aux()}, n, k,
                 col_128x1(grad_col.codes, grad_col.ue8m0(), step_.Mp, n, step_.blocks),
                 col_128x1(in_col.codes, in_col.ue8m0(), step_.Mp, k, step_.blocks), out, stream_);
    return;
  }
  if (!path_.sync_free) {
    const Fp8Op g = f32 ? f32_col_operand(grad_col, n) : col_operand(grad_col, n, b.grad_col_scales, stream_);
    const Fp8Op x = f32 ? f32_col_operand(in_col, k) : col_operand(in_col, k, b.input_col_scales, stream_);
    gemm_->wgrad(step_.seg, n, k, g, x, out, stream_);
    return;
  }
  // fp8-naive's FP32 scales, GEMM-ready
  const auto f32_col = [&](const QTensorView& col, int64_t c) {
    QTensorView v = col_128x1(col.codes, nullptr, step_.Mp, c, step_.blocks);
    v.scales = col.scales;
    v.scale_format = ScaleFormat::kF32;
    return v;
  };
  gemm_->wgrad(gemm::DeviceSegments{segment_offsets(), El_, step_.Mp, st_bwd_aux()}, n, k, f32_col(grad_col, n),
               f32_col(in_col, k), out, stream_);
}

const bf16_t* StepContext::bf16_weight(int g) const {
  if (!path_.bf16_params_in_place || path_.bf16_relay_per_pass)  // (the relaid copies: StepContext::relay_params)
    return g == 1 ? ws_.weights.w1_bf16 : ws_.weights.w2_bf16;
  const bf16_t* w = g == 1 ? call_params_.w1_bf16 : call_params_.w2_bf16;
  FLOWMOE_CHECK(w != nullptr, "internal error: the BF16 parameters read in place are missing (W" << g << ")");
  return w;
}
bool StepContext::stored_gemms() const {
  const ExpertStorage& st = call_params_.storage;
  // (the kernels' TMA maps: 16-byte rows W1^T [Hs][2Fs], W2^T [Fs][Hs] and bases; else the relay)
  return path_.bf16_stored_gemms && call_params_.w1_bf16 && bf16_kernels_read_stored(st, F_) &&
         detail::aligned16(call_params_.w1_bf16) && detail::aligned16(call_params_.w2_bf16);
}
bool StepContext::stored_gemms(const MoeGrads& g) const {
  const ExpertStorage &p = call_params_.storage, &s = g.storage;
  return stored_gemms() &&
         (!g.wants_dw1() || (s.hidden == p.hidden && s.ffn == p.ffn && s.interleaved == p.interleaved));
}
gemm::StoredW StepContext::stored_weight(int g) const {
  const ExpertStorage& st = call_params_.storage;
  gemm::StoredW w;
  if (g == 1)
    w.data = call_params_.w1_bf16, w.rows = st.hidden, w.cols = 2 * st.ffn, w.gate_up = st.interleaved;
  else
    w.data = call_params_.w2_bf16, w.rows = st.ffn, w.cols = st.hidden;
  return w;
}
void StepContext::bf16_fprop(const bf16_t* in, int64_t n, int64_t k, const gemm::StoredW& w, bf16_t* out) {
  gemm_->fprop_bf16(gemm::DeviceSegments{segment_offsets(), El_, step_.Mp, st_fwd_aux()}, n, k,
                    cs<bf16_t>(in, step_.Mp * k), w, ms<bf16_t>(out, step_.Mp * n), stream_);
}
void StepContext::bf16_dgrad(const bf16_t* in, int64_t n, int64_t k, const gemm::StoredW& w, bf16_t* out) {
  gemm_->dgrad_bf16(gemm::DeviceSegments{segment_offsets(), El_, step_.Mp, st_bwd_aux()}, n, k,
                    cs<bf16_t>(in, step_.Mp * n), w, ms<bf16_t>(out, step_.Mp * k), stream_);
}
void StepContext::bf16_fprop(const bf16_t* in, int64_t n, int64_t k, const bf16_t* w, bf16_t* out) {
  const auto x = cs<bf16_t>(in, step_.Mp * k);
  const auto wt = cs<bf16_t>(w, int64_t(El_) * n * k);
  if (path_.grouped_gemm)
    gemm_->fprop_bf16(gemm::DeviceSegments{segment_offsets(), El_, step_.Mp, st_fwd_aux()}, n, k, x, wt,
                      ms<bf16_t>(out, step_.Mp * n), stream_);
  else
    gemm_->fprop_bf16(step_.seg, n, k, x, wt, ms<bf16_t>(out, step_.Mp * n), stream_);
}
void StepContext::bf16_dgrad(const bf16_t* in, int64_t n, int64_t k, const bf16_t* w, bf16_t* out) {
  const auto dy = cs<bf16_t>(in, step_.Mp * n);
  const auto wt = cs<bf16_t>(w, int64_t(El_) * n * k);
  if (path_.grouped_gemm)
    gemm_->dgrad_bf16(gemm::DeviceSegments{segment_offsets(), El_, step_.Mp, st_bwd_aux()}, n, k, dy, wt,
                      ms<bf16_t>(out, step_.Mp * k), stream_);
  else
    gemm_->dgrad_bf16(step_.seg, n, k, dy, wt, ms<bf16_t>(out, step_.Mp * k), stream_);
}
void StepContext::bf16_wgrad(const bf16_t* grad, int64_t n, const bf16_t* in, int64_t k, float* dw,
                             bf16_t* dw_bf16, const gemm::StoredDw& stored) {
  const auto dy = cs<bf16_t>(grad, step_.Mp * n);
  const auto x = cs<bf16_t>(in, step_.Mp * k);
  if (stored.rows > 0) {
    // the stored weight is W^T's layout: its gradient in^T . grad, the kernel with the operands
    // swapped (MoeLayer::writes_stored_grads: RecipePath::bf16_wgrad_kernel)
    gemm::WgradOut o = dw_out(dw, dw_bf16, int64_t(El_) * stored.rows * stored.cols);
    o.stored = stored;
    gemm_->wgrad_bf16(gemm::DeviceSegments{segment_offsets(), El_, step_.Mp, st_bwd_aux()}, k, n, x, dy, o, stream_);
    return;
  }
  const gemm::WgradOut out = dw_out(dw, dw_bf16, int64_t(El_) * n * k);
  if (path_.bf16_wgrad_kernel)
    gemm_->wgrad_bf16(gemm::DeviceSegments{segment_offsets(), El_, step_.Mp, st_bwd_aux()}, n, k, dy, x, out, stream_);
  else
    gemm_->wgrad_bf16(step_.seg, n, k, dy, x, out, stream_);
}

// A BF16 gradient (overwritten, rounded once as the wgrad stores it), or an FP32 one with
// MoeGrads::accumulate: beta = 1 into the gradients, or beta = 0 (the old values never read)
gemm::WgradOut StepContext::dw_out(float* f32, bf16_t* b16, int64_t n) const {
  if (b16) return gemm::WgradOut::bf16(b16, n);
  return grads_accumulate_ ? gemm::WgradOut::accumulate(f32, n) : gemm::WgradOut::f32(f32, n);
}

}  // namespace moe
}  // namespace cuda
}  // namespace flowmoe
