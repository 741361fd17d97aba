// Expert weights stored transposed, with gate / up interleaved and sizes not multiples of 128
// (gpt-oss's gate_up_proj [E, H, 2F], down_proj [E, F, H]), to and from the layer's layout
// (w1 [E, 2F', H'] gate rows [0, F), up rows [F', F' + F); w2 [E, H', F']; issue 46). Pure copies:
// every value moves unchanged, padding is written as zeros.
//
// A transposed source src [E, C, L] (C columns of the layer's weight, L its rows as stored, e.g.
// w1: C = H, L = 2F) and the layer's dst [E, R, C'] (R = rows incl. padding, C' >= C: padding
// columns) are related by a row map: layer row r takes stored index j = map(r), or nothing (zeros):
//   map(r) = base0 + stride * r             for r < valid       (stride 1 or 2)
//          = base1 + stride * (r - second)  for second <= r < second + valid   (second >= 0)
//          = none                           otherwise
//   w1 interleaved:  valid F, stride 2, base0 0, base1 1, second F'
//   w1 concatenated: valid F, stride 1, base0 0, base1 F, second F'
//   w2:              valid H, stride 1, base0 0, second -1
//   to_layer    dst[e][r][c] = (c < C and map(r) exists) ? src[e][c][map(r)] : 0
//   from_layer  grad[e][c][j] = dst_grad[e][r][c] with map(r) = j    (every j < L has one r)
//
// ExpertStorage describes such weights to the layer itself (MoeWeights::storage): the CUDA layer's
// FP8 block recipes then quantize them where they are (cuda::quantize_weights_stored), with no
// relaid BF16 copy; cpu::expert_weights_to_layer is the reference of that read.
#pragma once

#include <cstdint>

#include "flowmoe/numerics.h"  // FLOWMOE_HD

namespace flowmoe {

struct ExpertRowMap {
  int64_t valid = 0;
  int64_t stride = 1;
  int64_t base0 = 0;
  int64_t base1 = 0;
  int64_t second = -1;  // first layer row of the second part, or -1
  // the stored index of layer row r, or -1
  FLOWMOE_HD int64_t map(int64_t r) const {
    if (r < valid) return base0 + stride * r;
    if (second >= 0 && r >= second && r < second + valid) return base1 + stride * (r - second);
    return -1;
  }
};

// Expert weights stored transposed: w1 [El, H, 2F] (gate / up concatenated or, interleaved,
// alternating along 2F), w2 [El, F, H], with the stored sizes H and F at most the layer's H', F'
// (the rest reads as zeros: zero rows and columns leave every real output unchanged). hidden = 0:
// the layer's own layout (w1 [El, 2F', H'], w2 [El, H', F']), nothing to describe.
struct ExpertStorage {
  int64_t hidden = 0;  // stored H (0: the layer's layout)
  int64_t ffn = 0;     // stored F
  bool interleaved = false;
  bool is_layer_layout() const { return hidden == 0; }
  // layer row r of W1 [2F', H'] (gate rows [0, F), up rows [F', F' + F)) -> index along stored 2F
  ExpertRowMap w1_rows(int64_t layer_ffn) const {
    return interleaved ? ExpertRowMap{ffn, 2, 0, 1, layer_ffn} : ExpertRowMap{ffn, 1, 0, ffn, layer_ffn};
  }
  // layer row r of W2 [H', F'] -> index along stored H
  ExpertRowMap w2_rows() const { return ExpertRowMap{hidden, 1, 0, 0, -1}; }
};

namespace cpu {
// The layer's weight dst [E, R, Cp] from a transposed src [E, C, L] (to_layer above): bf16 bits or
// fp32 values, moved unchanged, padding zeros.
template <typename T>
void expert_weights_to_layer(const T* src, T* dst, int num_experts, int64_t c, int64_t l, int64_t r, int64_t cp,
                             const ExpertRowMap& map) {
  for (int64_t e = 0; e < num_experts; ++e)
    for (int64_t i = 0; i < r; ++i) {
      const int64_t j = map.map(i);
      for (int64_t k = 0; k < cp; ++k)
        dst[(e * r + i) * cp + k] = (j >= 0 && k < c) ? src[(e * c + k) * l + j] : T(0);
    }
}
// The gradients' way back (from_layer above): grad [E, C, L] from the layer's dst_grad [E, R, Cp];
// `put(stored_index_value&, layer_value)` writes each (e.g. = or +=, with a conversion).
template <typename D, typename S, typename Put>
void expert_grads_from_layer(const S* dst_grad, D* grad, int num_experts, int64_t c, int64_t l, int64_t r, int64_t cp,
                             const ExpertRowMap& map, Put put) {
  for (int64_t e = 0; e < num_experts; ++e)
    for (int64_t i = 0; i < r; ++i) {
      const int64_t j = map.map(i);
      if (j < 0) continue;  // (padding rows: no stored gradient)
      for (int64_t k = 0; k < c; ++k) put(grad[(e * c + k) * l + j], dst_grad[(e * r + i) * cp + k]);
    }
}
}  // namespace cpu

}  // namespace flowmoe

#if defined(FLOWMOE_HAVE_CUDA)
#include <cuda_runtime.h>

namespace flowmoe {
namespace cuda {

// elem_bytes 2 (BF16) or 4 (FP32). src [E, C, L] -> dst [E, R, Cp] (to_layer), or the gradient
// back: dst_grad [E, R, Cp] -> grad [E, C, L] (from_layer). Device pointers, any alignment (4-byte
// aligned BF16 with even sizes takes the 32-bit pair kernels); the map must be one of the three
// above (checked); stream-ordered, nothing allocates.
void expert_weights_to_layer(const void* src, void* dst, int elem_bytes, int num_experts, int64_t c, int64_t l,
                             int64_t r, int64_t cp, const ExpertRowMap& map, cudaStream_t stream);
void expert_grads_from_layer(const void* dst_grad, void* grad, int elem_bytes, int num_experts, int64_t c,
                             int64_t l, int64_t r, int64_t cp, const ExpertRowMap& map, cudaStream_t stream);

}  // namespace cuda
}  // namespace flowmoe
#endif
