// CPU reference of the expert-bias operators (include/flowmoe/expert_bias.h).
#include "flowmoe/expert_bias.h"

#include <algorithm>

#include "flowmoe/error.h"
#include "flowmoe/numerics.h"
#include "flowmoe/swiglu_math.h"

namespace flowmoe {
namespace cpu {

namespace {
void check_segments(const Segments& seg, int64_t m, const char* what) {
  seg.validate(m);
  FLOWMOE_CHECK(seg.num_segments() >= 1, what << ": no segments; expected one per expert");
}
}  // namespace

void add_expert_bias(bf16_t* h, int64_t m, int64_t n, const Segments& seg, const float* bias) {
  check_segments(seg, m, "cpu::add_expert_bias");
  for (int e = 0; e < seg.num_segments(); ++e)
    for (int64_t r = seg.offsets[e]; r < seg.offsets[e + 1]; ++r)
      for (int64_t c = 0; c < n; ++c) {
        const float v = num::f32_canonical(num::bf16_to_f32(h[r * n + c]) + bias[e * n + c]);
        h[r * n + c] = num::f32_to_bf16(v);
      }
}

namespace {
// The order of expert_bias.h: each 128-row block of the segment summed in row order from +0, the
// blocks' sums added in block order from +0.
template <class Value>
void segment_sums(int64_t n, const Segments& seg, float* db, bool accumulate, Value value) {
  for (int e = 0; e < seg.num_segments(); ++e)
    for (int64_t c = 0; c < n; ++c) {
      float s = 0.0f;
      for (int64_t b = seg.offsets[e]; b < seg.offsets[e + 1]; b += kExpertBiasBlockRows) {
        const int64_t end = std::min<int64_t>(b + kExpertBiasBlockRows, seg.offsets[e + 1]);
        float p = 0.0f;
        for (int64_t r = b; r < end; ++r) p = p + value(r, c);
        s = s + p;
      }
      db[e * n + c] = num::f32_canonical(accumulate ? db[e * n + c] + s : s);
    }
}
}  // namespace

void expert_bias_grad(const bf16_t* dh, int64_t m, int64_t n, const Segments& seg, float* db,
                      bool accumulate) {
  check_segments(seg, m, "cpu::expert_bias_grad");
  segment_sums(n, seg, db, accumulate,
               [&](int64_t r, int64_t c) { return num::bf16_to_f32(dh[r * n + c]); });
}

void expert_bias_grad(const QTensor& dh_row, const Segments& seg, float* db, bool accumulate) {
  FLOWMOE_CHECK(dh_row.layout == Layout::kRow1x128,
                "cpu::expert_bias_grad: dH " << dh_row.describe() << "; expected row-wise 1x128 FP8");
  const int64_t m = dh_row.rows, n = dh_row.cols;
  check_segments(seg, m, "cpu::expert_bias_grad");
  segment_sums(n, seg, db, accumulate, [&](int64_t r, int64_t c) {
    return num::dequant_e4m3(dh_row.codes[r * n + c], dh_row.scales[(c / kFp8Block) * m + r]);
  });
}

}  // namespace cpu
}  // namespace flowmoe
