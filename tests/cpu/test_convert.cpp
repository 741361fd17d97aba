// Properties of the CPU reference conversions (flowmoe/cpu/convert.h) on random data of several
// distributions, odd sizes and ragged expert segments, checked against the independent slow
// reference of tests/common/reference.h. All seeds are fixed.
#include <gtest/gtest.h>

#include <algorithm>
#include <cfloat>
#include <cmath>
#include <cstdint>
#include <iostream>
#include <string>
#include <vector>

#include "common/convert_checks.h"
#include "common/reference.h"
#include "flowmoe/cpu/convert.h"
#include "flowmoe/error.h"
#include "flowmoe/tensor.h"

using flowmoe::Layout;
using flowmoe::QTensor;
using flowmoe::QuantStats;
using flowmoe::Segments;
namespace cpu = flowmoe::cpu;
using namespace flowmoe_test;

namespace {

// Max over the tokens of one column-wise block of the row-wise scale codes of feature c
// (0xFF if any is NaN): the target exponent of the scaling-aware transpose, computed here from
// the row tensor's documented layout (scales [K/128][M]).
int block_max_row_code(const QTensor& row, const TokenBlock& b, int64_t c) {
  int mx = 0;
  for (int64_t t = b.t0; t < b.t1; ++t) {
    const uint8_t s = row.scales[(c / 128) * row.rows + t];
    if (s == 0xFF) return 0xFF;
    mx = std::max<int>(mx, s);
  }
  return mx;
}

double fraction(int64_t part, int64_t whole) { return whole ? static_cast<double>(part) / whole : 0.0; }

}  // namespace

// ================================================================================================
// Activations: distributions x ragged segments
// ================================================================================================
struct ActCase {
  const char* name;
  Dist dist;
  std::vector<int32_t> counts;  // tokens per expert segment
  int64_t k;
  uint64_t seed;
  int64_t zero_row_every;  // padding-like all-zero rows (0: none)

  int64_t m() const {
    int64_t s = 0;
    for (int32_t c : counts) s += c;
    return s;
  }
  Segments seg() const { return Segments::from_counts(counts); }
};
std::ostream& operator<<(std::ostream& os, const ActCase& c) { return os << c.name; }

class Activation : public ::testing::TestWithParam<ActCase> {
 protected:
  void SetUp() override {
    const ActCase& p = GetParam();
    x_ = make_data(p.dist, p.m(), p.k, p.seed, p.zero_row_every);
    xb_ = truncate_to_bf16(x_);
    xbf_ = widen_bf16(xb_);
  }
  std::vector<float> x_;     // float32 input
  std::vector<uint16_t> xb_;  // the same data in BF16
  std::vector<float> xbf_;   // the BF16 data widened (what the bf16 overloads see)
};

TEST_P(Activation, QuantizeRowMatchesReference) {
  const ActCase& p = GetParam();
  QTensor q, qb;
  EXPECT_EQ(cpu::quantize_row(x_.data(), p.m(), p.k, &q).nonfinite, 0);
  expect_well_formed(q, Layout::kRow1x128, p.m(), p.k);
  const int64_t zero_tiles = expect_matches_reference_quantization(x_, q, Fmt::kE4M3);
  if (p.zero_row_every) {
    EXPECT_GT(zero_tiles, 0);
  }

  EXPECT_EQ(cpu::quantize_row(xb_.data(), p.m(), p.k, &qb).nonfinite, 0);
  expect_well_formed(qb, Layout::kRow1x128, p.m(), p.k);
  expect_matches_reference_quantization(xbf_, qb, Fmt::kE4M3);
}

TEST_P(Activation, QuantizeColMatchesReference) {
  const ActCase& p = GetParam();
  QTensor q, qb;
  EXPECT_EQ(cpu::quantize_col(x_.data(), p.m(), p.k, p.seg(), &q).nonfinite, 0);
  expect_well_formed(q, Layout::kCol128x1, p.m(), p.k);
  EXPECT_EQ(q.segments.offsets, p.seg().offsets);
  expect_matches_reference_quantization(x_, q, Fmt::kE4M3);

  EXPECT_EQ(cpu::quantize_col(xb_.data(), p.m(), p.k, p.seg(), &qb).nonfinite, 0);
  expect_well_formed(qb, Layout::kCol128x1, p.m(), p.k);
  expect_matches_reference_quantization(xbf_, qb, Fmt::kE4M3);
}

TEST_P(Activation, QuantizeBothEqualsRowAndColSeparately) {
  const ActCase& p = GetParam();
  QTensor row, col, row2, col2;
  cpu::quantize_both(xb_.data(), p.m(), p.k, p.seg(), &row, &col);
  cpu::quantize_row(xb_.data(), p.m(), p.k, &row2);
  cpu::quantize_col(xb_.data(), p.m(), p.k, p.seg(), &col2);
  EXPECT_EQ(row.codes, row2.codes);
  EXPECT_EQ(row.scales, row2.scales);
  EXPECT_EQ(col.codes, col2.codes);
  EXPECT_EQ(col.scales, col2.scales);
}

TEST_P(Activation, QuantizeMxfp4MatchesReference) {
  const ActCase& p = GetParam();
  QTensor q, qb;
  EXPECT_EQ(cpu::quantize_mxfp4(x_.data(), p.m(), p.k, &q).nonfinite, 0);
  expect_well_formed(q, Layout::kMxfp4Row1x32, p.m(), p.k);
  const int64_t zero_tiles = expect_matches_reference_quantization(x_, q, Fmt::kE2M1);
  if (p.zero_row_every) {
    EXPECT_GT(zero_tiles, 0);
  }

  EXPECT_EQ(cpu::quantize_mxfp4(xb_.data(), p.m(), p.k, &qb).nonfinite, 0);
  expect_matches_reference_quantization(xbf_, qb, Fmt::kE2M1);
}

// Scaling-aware transpose: the column-wise copy decodes to exactly the row-wise values, except
// the counted underflow elements, which are the RNE of the exact shifted value.
TEST_P(Activation, ScalingAwareTransposeIsExactExceptCountedUnderflow) {
  const ActCase& p = GetParam();
  const int64_t m = p.m(), k = p.k;
  QTensor row, col;
  cpu::quantize_row(x_.data(), m, k, &row);
  const QuantStats st = cpu::scaling_aware_transpose(row, p.seg(), &col);
  EXPECT_EQ(st.nonfinite, 0);
  expect_well_formed(col, Layout::kCol128x1, m, k);
  EXPECT_EQ(col.segments.offsets, p.seg().offsets);

  const std::vector<float> vr = decode_and_compare(row);
  const std::vector<float> vc = decode_and_compare(col);
  const auto blocks = token_blocks(p.seg());
  int64_t differ = 0, bad_scale = 0, bad_round = 0;
  for (size_t bi = 0; bi < blocks.size(); ++bi) {
    for (int64_t c = 0; c < k; ++c) {
      // blocks never straddle segments: the scale is the max row exponent over exactly this
      // block's tokens
      const int want = block_max_row_code(row, blocks[bi], c);
      const uint8_t got = col.scales[bi * k + c];
      if (got != want && ++bad_scale <= 5) {
        ADD_FAILURE() << "block " << bi << " tokens [" << blocks[bi].t0 << ", " << blocks[bi].t1 << ") feature "
                      << c << ": scale code " << int(got) << ", want max row code " << want;
      }
      for (int64_t t = blocks[bi].t0; t < blocks[bi].t1; ++t) {
        const int64_t i = t * k + c;
        if (same_value(vr[i], vc[i])) continue;
        ++differ;
        // the exact shifted value, rounded to nearest even in E4M3 under scale 2^(E - 127)
        const double shifted = std::ldexp(static_cast<double>(vr[i]), -(want - 127));
        const float expect = static_cast<float>(e4m3_value(ref_encode_e4m3(shifted)) * std::ldexp(1.0, want - 127));
        if (!same_value(expect, vc[i]) && ++bad_round <= 5) {
          ADD_FAILURE() << "element " << where(i, k) << ": row value " << vr[i] << " became " << vc[i]
                        << ", want RNE " << expect;
        }
      }
    }
  }
  EXPECT_EQ(bad_scale, 0);
  EXPECT_EQ(bad_round, 0);
  EXPECT_EQ(differ, st.underflow) << "every changed element must be counted as underflow, and only those";
  if (p.dist == Dist::kBinades || p.dist == Dist::kRowBinades) {
    if (m > 1) {
      EXPECT_GT(st.underflow, 0) << "data spanning many binades must exercise the subnormal path";
    }
  }
  RecordProperty("sat_underflow", std::to_string(st.underflow));
}

// The naive path (dequantize -> BF16 -> transpose -> fresh scale). With power-of-two scales a
// value only changes where it leaves the E4M3 normal range, and the fresh scale is never larger
// than the scaling-aware transpose's (max row exponent), so every element the naive path changes
// is also an element the scaling-aware transpose rounds. Measures and records both shares, and
// the "double quantization error" share of SPEC §4: Q_col(D(Q_row(X))) != Q_col(X).
TEST_P(Activation, NaiveColCopyChangesOnlyWhatScalingAwareTransposeAlsoRounds) {
  const ActCase& p = GetParam();
  const int64_t m = p.m(), k = p.k;
  QTensor row, naive, sat, direct;
  cpu::quantize_row(x_.data(), m, k, &row);
  const QuantStats st = cpu::naive_col_copy(row, p.seg(), &naive);
  EXPECT_EQ(st.nonfinite, 0);
  expect_well_formed(naive, Layout::kCol128x1, m, k);
  cpu::scaling_aware_transpose(row, p.seg(), &sat);
  cpu::quantize_col(x_.data(), m, k, p.seg(), &direct);
  const std::vector<float> vr = decode_and_compare(row), vn = decode_and_compare(naive),
                           vs = decode_and_compare(sat), vd = decode_and_compare(direct);
  int64_t naive_changed = 0, sat_changed = 0, dq_error = 0, naive_only = 0;
  for (size_t i = 0; i < vr.size(); ++i) {
    const bool n = !same_value(vr[i], vn[i]), s = !same_value(vr[i], vs[i]);
    naive_changed += n;
    sat_changed += s;
    naive_only += n && !s;
    dq_error += !same_value(vn[i], vd[i]);
  }
  const int64_t total = m * k;
  std::cout << "[ measure  ] " << p.name << ": naive_col_copy changes " << naive_changed << " of " << total
            << " values (" << 100 * fraction(naive_changed, total) << "%), scaling-aware transpose "
            << sat_changed << " (" << 100 * fraction(sat_changed, total) << "%), Q_col(D(Q_row(X))) != Q_col(X) at "
            << dq_error << " (" << 100 * fraction(dq_error, total) << "%)\n";
  RecordProperty("naive_changed_fraction", std::to_string(fraction(naive_changed, total)));
  RecordProperty("sat_changed_fraction", std::to_string(fraction(sat_changed, total)));
  RecordProperty("double_quantization_error_fraction", std::to_string(fraction(dq_error, total)));
  EXPECT_EQ(naive_only, 0) << "naive_col_copy changed values the scaling-aware transpose kept";
}

TEST_P(Activation, Fp4ToFp8RowAndColRoundLikeTheDoubleComputation) {
  const ActCase& p = GetParam();
  const int64_t m = p.m(), k = p.k, ng = k / 32;
  QTensor fp4;
  cpu::quantize_mxfp4(x_.data(), m, k, &fp4);
  const std::vector<float> v4 = decode_and_compare(fp4);
  auto es = [&](int64_t t, int64_t c) { return static_cast<int>(fp4.scales[t * ng + c / 32]); };

  // row: four 32-blocks -> one 128-tile, scale code max(max_j e_j - 6, 0)
  QTensor row;
  const QuantStats sr = cpu::fp4_to_fp8_row(fp4, &row);
  expect_well_formed(row, Layout::kRow1x128, m, k);
  const std::vector<float> vr = decode_and_compare(row);
  int64_t differ = 0, bad = 0, max_spread = 0;
  for (int64_t t = 0; t < m; ++t) {
    for (int64_t c0 = 0; c0 < k; c0 += 128) {
      int lo = 255, hi = 0;
      for (int64_t c = c0; c < c0 + 128; c += 32) lo = std::min(lo, es(t, c)), hi = std::max(hi, es(t, c));
      max_spread = std::max<int64_t>(max_spread, hi - lo);
      const int sc = std::max(hi - 6, 0);
      EXPECT_EQ(row.scales[(c0 / 128) * m + t], sc);
      for (int64_t c = c0; c < c0 + 128; ++c) {
        const int64_t i = t * k + c;
        const double exact = std::ldexp(static_cast<double>(v4[i]), -(sc - 127));
        const float want = static_cast<float>(e4m3_value(ref_encode_e4m3(exact)) * std::ldexp(1.0, sc - 127));
        if (!same_value(want, vr[i]) && ++bad <= 5) ADD_FAILURE() << "row " << where(i, k) << ": " << vr[i] << " want " << want;
        differ += !same_value(v4[i], vr[i]);
      }
    }
  }
  EXPECT_EQ(bad, 0);
  EXPECT_EQ(differ, sr.underflow);
  if (max_spread <= 14) {
    EXPECT_EQ(sr.underflow, 0) << "spread <= 14 must be exact";
  }

  // col: per (feature, token block), scale code max(max_t e_t - 6, 0)
  QTensor col;
  const QuantStats sc_ = cpu::fp4_to_fp8_col(fp4, p.seg(), &col);
  expect_well_formed(col, Layout::kCol128x1, m, k);
  const std::vector<float> vc = decode_and_compare(col);
  const auto blocks = token_blocks(p.seg());
  differ = bad = max_spread = 0;
  for (size_t bi = 0; bi < blocks.size(); ++bi) {
    for (int64_t c = 0; c < k; ++c) {
      int lo = 255, hi = 0;
      for (int64_t t = blocks[bi].t0; t < blocks[bi].t1; ++t) lo = std::min(lo, es(t, c)), hi = std::max(hi, es(t, c));
      max_spread = std::max<int64_t>(max_spread, hi - lo);
      const int sc = std::max(hi - 6, 0);
      EXPECT_EQ(col.scales[bi * k + c], sc);
      for (int64_t t = blocks[bi].t0; t < blocks[bi].t1; ++t) {
        const int64_t i = t * k + c;
        const double exact = std::ldexp(static_cast<double>(v4[i]), -(sc - 127));
        const float want = static_cast<float>(e4m3_value(ref_encode_e4m3(exact)) * std::ldexp(1.0, sc - 127));
        if (!same_value(want, vc[i]) && ++bad <= 5) ADD_FAILURE() << "col " << where(i, k) << ": " << vc[i] << " want " << want;
        differ += !same_value(v4[i], vc[i]);
      }
    }
  }
  EXPECT_EQ(bad, 0);
  EXPECT_EQ(differ, sc_.underflow);
  if (max_spread <= 14) {
    EXPECT_EQ(sc_.underflow, 0) << "spread <= 14 must be exact";
  }
}

INSTANTIATE_TEST_SUITE_P(
    Data, Activation,
    ::testing::Values(
        ActCase{"normal_ragged", Dist::kNormal, {0, 1, 128, 129, 50, 0, 77}, 256, 11, 9},
        ActCase{"heavytail_ragged", Dist::kHeavyTail, {129, 0, 128, 1, 31}, 384, 12, 0},
        ActCase{"binades_ragged", Dist::kBinades, {0, 1, 128, 129, 50, 0, 77}, 256, 13, 0},
        ActCase{"rowbinades_ragged", Dist::kRowBinades, {200, 128, 1, 0, 45}, 128, 14, 13},
        ActCase{"normal_one_token", Dist::kNormal, {1}, 128, 15, 0},
        ActCase{"binades_one_exact_block", Dist::kBinades, {128}, 256, 16, 0},
        ActCase{"rowbinades_many_small", Dist::kRowBinades, {3, 5, 0, 7, 11, 13, 1, 2, 100}, 128, 17, 0},
        ActCase{"heavytail_empty_segments", Dist::kHeavyTail, {0, 0, 300, 0}, 128, 18, 7}),
    [](const ::testing::TestParamInfo<ActCase>& i) { return std::string(i.param.name); });

// MXFP4 row-wise only needs K % 32 == 0.
TEST(QuantizeMxfp4, OddKMultipleOf32) {
  for (int64_t k : {32, 96, 160}) {
    for (Dist d : {Dist::kNormal, Dist::kHeavyTail, Dist::kBinades}) {
      SCOPED_TRACE(std::string(dist_name(d)) + " K=" + std::to_string(k));
      const std::vector<float> x = make_data(d, 37, k, 100 + k, 5);
      QTensor q;
      cpu::quantize_mxfp4(x.data(), 37, k, &q);
      expect_well_formed(q, Layout::kMxfp4Row1x32, 37, k);
      EXPECT_GT(expect_matches_reference_quantization(x, q, Fmt::kE2M1), 0);
    }
  }
}

// ================================================================================================
// Weights 128x128
// ================================================================================================
struct WeightCase {
  const char* name;
  Dist dist;
  int64_t n, k;
  uint64_t seed;
  bool zero_block;  // zero the block (1, 0) if it exists
};
std::ostream& operator<<(std::ostream& os, const WeightCase& c) { return os << c.name; }

class Weight : public ::testing::TestWithParam<WeightCase> {};

TEST_P(Weight, QuantizeMatchesReferenceAndTransposeIsExact) {
  const WeightCase& p = GetParam();
  std::vector<float> w = make_data(p.dist, p.n, p.k, p.seed);
  if (p.zero_block)
    for (int64_t r = 128; r < 256; ++r)
      for (int64_t c = 0; c < 128; ++c) w[r * p.k + c] = 0;
  QTensor q, qt;
  EXPECT_EQ(cpu::quantize_weight(w.data(), p.n, p.k, &q, &qt).nonfinite, 0);
  expect_well_formed(q, Layout::kWeight128x128, p.n, p.k);
  expect_well_formed(qt, Layout::kWeight128x128, p.k, p.n);
  const int64_t zero_tiles = expect_matches_reference_quantization(w, q, Fmt::kE4M3);
  EXPECT_EQ(zero_tiles, p.zero_block ? 1 : 0);

  // transpose: codes and the scale grid, exactly
  const int64_t nbn = p.n / 128, nbk = p.k / 128;
  for (int64_t r = 0; r < p.n; ++r)
    for (int64_t c = 0; c < p.k; ++c) ASSERT_EQ(qt.codes[c * p.n + r], q.codes[r * p.k + c]) << r << "," << c;
  for (int64_t bn = 0; bn < nbn; ++bn)
    for (int64_t bk = 0; bk < nbk; ++bk) EXPECT_EQ(qt.scales[bk * nbn + bn], q.scales[bn * nbk + bk]);
  const std::vector<float> v = decode_and_compare(q), vt = decode_and_compare(qt);
  for (int64_t r = 0; r < p.n; ++r)
    for (int64_t c = 0; c < p.k; ++c) ASSERT_TRUE(same_value(vt[c * p.n + r], v[r * p.k + c]));

  // transpose_weight on its own gives the same, and twice is the identity
  QTensor qt2, qtt;
  cpu::transpose_weight(q, &qt2);
  EXPECT_EQ(qt2.codes, qt.codes);
  EXPECT_EQ(qt2.scales, qt.scales);
  cpu::transpose_weight(qt, &qtt);
  EXPECT_EQ(qtt.codes, q.codes);
  EXPECT_EQ(qtt.scales, q.scales);

  // the BF16 overload
  const std::vector<uint16_t> wb = truncate_to_bf16(w);
  QTensor qb;
  cpu::quantize_weight(wb.data(), p.n, p.k, &qb, nullptr);
  expect_matches_reference_quantization(widen_bf16(wb), qb, Fmt::kE4M3);
}

INSTANTIATE_TEST_SUITE_P(Data, Weight,
                         ::testing::Values(WeightCase{"normal_256x384", Dist::kNormal, 256, 384, 21, true},
                                           WeightCase{"heavytail_128x128", Dist::kHeavyTail, 128, 128, 22, false},
                                           WeightCase{"binades_384x256", Dist::kBinades, 384, 256, 23, true},
                                           WeightCase{"rowbinades_256x128", Dist::kRowBinades, 256, 128, 24, false}),
                         [](const ::testing::TestParamInfo<WeightCase>& i) { return std::string(i.param.name); });

// ================================================================================================
// FP4 -> FP8 on constructed MXFP4 tensors with a controlled spread of block exponents
// ================================================================================================
namespace {

// MXFP4 [m, k] with random codes and block scale codes drawn from [base, base + spread] where the
// base is per row (row spread tests) or shared (col tests: the spread is across tokens).
QTensor make_fp4(int64_t m, int64_t k, int lo_code, int hi_code, uint64_t seed) {
  Rng rng(seed);
  QTensor q;
  q.layout = Layout::kMxfp4Row1x32;
  q.rows = m;
  q.cols = k;
  q.codes.resize(m * k / 2);
  for (auto& b : q.codes) b = static_cast<uint8_t>(rng.next32());
  q.scales.resize(m * (k / 32));
  for (auto& s : q.scales) s = static_cast<uint8_t>(rng.uniform_int(lo_code, hi_code));
  return q;
}

struct Fp4Result {
  int64_t differ = 0, bad = 0;
  QuantStats stats;
};

// Converts with `fn`, checks each element against RNE_E4M3(value / 2^(sc - 127)) with sc derived
// from the block codes as documented, and counts elements that differ from the MXFP4 value.
Fp4Result check_fp4_to_fp8(const QTensor& fp4, const Segments& seg, bool column) {
  const int64_t m = fp4.rows, k = fp4.cols, ng = k / 32;
  const std::vector<float> v4 = decode_and_compare(fp4);
  QTensor out;
  Fp4Result res;
  res.stats = column ? cpu::fp4_to_fp8_col(fp4, seg, &out) : cpu::fp4_to_fp8_row(fp4, &out);
  const std::vector<float> v8 = decode_and_compare(out);
  const auto blocks = token_blocks(out.segments);
  for (int64_t t = 0; t < m; ++t) {
    for (int64_t c = 0; c < k; ++c) {
      int hi = 0;
      if (column) {
        const auto it = std::upper_bound(blocks.begin(), blocks.end(), t,
                                         [](int64_t x, const TokenBlock& b) { return x < b.t1; });
        for (int64_t u = it->t0; u < it->t1; ++u) hi = std::max<int>(hi, fp4.scales[u * ng + c / 32]);
      } else {
        for (int64_t g = (c / 128) * 4; g < (c / 128) * 4 + 4; ++g) hi = std::max<int>(hi, fp4.scales[t * ng + g]);
      }
      const int sc = std::max(hi - 6, 0);
      EXPECT_EQ(scale_of(out, blocks, t, c), sc);
      const int64_t i = t * k + c;
      const double exact = std::ldexp(static_cast<double>(v4[i]), -(sc - 127));
      const float want = static_cast<float>(e4m3_value(ref_encode_e4m3(exact)) * std::ldexp(1.0, sc - 127));
      if (!same_value(want, v8[i]) && ++res.bad <= 5)
        ADD_FAILURE() << (column ? "col " : "row ") << where(i, k) << ": " << v8[i] << ", want " << want;
      res.differ += !same_value(v4[i], v8[i]);
    }
  }
  return res;
}

}  // namespace

TEST(Fp4ToFp8, RowExactWhenSpreadAtMost14) {
  const QTensor fp4 = make_fp4(67, 384, 100, 114, 31);
  const Fp4Result r = check_fp4_to_fp8(fp4, Segments::whole(67), false);
  EXPECT_EQ(r.bad, 0);
  EXPECT_EQ(r.differ, 0);
  EXPECT_EQ(r.stats.underflow, 0);
}

TEST(Fp4ToFp8, ColExactWhenSpreadAtMost14) {
  const QTensor fp4 = make_fp4(300, 128, 40, 54, 32);
  const Segments seg = Segments::from_counts({129, 0, 1, 128, 42});
  const Fp4Result r = check_fp4_to_fp8(fp4, seg, true);
  EXPECT_EQ(r.bad, 0);
  EXPECT_EQ(r.differ, 0);
  EXPECT_EQ(r.stats.underflow, 0);
}

TEST(Fp4ToFp8, TinyBlockScalesClampToCodeZeroAndStayExact) {
  // block codes 0..5: max - 6 < 0, so the FP8 scale clamps to code 0 (2^-127); still exact
  const QTensor fp4 = make_fp4(40, 256, 0, 5, 33);
  for (bool column : {false, true}) {
    const Fp4Result r = check_fp4_to_fp8(fp4, Segments::from_counts({13, 27}), column);
    EXPECT_EQ(r.bad, 0);
    EXPECT_EQ(r.differ, 0);
    EXPECT_EQ(r.stats.underflow, 0);
  }
}

TEST(Fp4ToFp8, SpreadAbove14RoundsIntoSubnormalsAndCounts) {
  const QTensor fp4 = make_fp4(150, 256, 90, 115, 34);  // spread up to 25
  for (bool column : {false, true}) {
    SCOPED_TRACE(column ? "fp4_to_fp8_col" : "fp4_to_fp8_row");
    const Fp4Result r = check_fp4_to_fp8(fp4, Segments::from_counts({5, 0, 145}), column);
    EXPECT_EQ(r.bad, 0);
    EXPECT_GT(r.stats.underflow, 0);
    EXPECT_EQ(r.differ, r.stats.underflow);
  }
}

// The exactness limit itself: 0.5 in a block 14 binades below the tile max is 2^-9 after the
// shift, the smallest E4M3 subnormal; 15 binades below it is 2^-10, a tie that rounds to zero.
TEST(Fp4ToFp8, SpreadBoundaryFourteenExactFifteenNot) {
  for (int spread : {14, 15}) {
    SCOPED_TRACE("spread " + std::to_string(spread));
    QTensor fp4;
    fp4.layout = Layout::kMxfp4Row1x32;
    fp4.rows = 1;
    fp4.cols = 128;
    fp4.codes.assign(64, 0x11);  // every element 0.5
    fp4.scales = {100, static_cast<uint8_t>(100 + spread), 100, 100};
    const Fp4Result r = check_fp4_to_fp8(fp4, Segments::whole(1), false);
    EXPECT_EQ(r.bad, 0);
    EXPECT_EQ(r.stats.underflow, spread == 14 ? 0 : 3 * 32);
    // the same through the column conversion: one token per block is a spread of 0, so build
    // 128 tokens with the block codes spread across tokens instead
    QTensor fc;
    fc.layout = Layout::kMxfp4Row1x32;
    fc.rows = 128;
    fc.cols = 32;
    fc.codes.assign(128 * 16, 0x11);
    fc.scales.assign(128, 100);
    fc.scales[77] = static_cast<uint8_t>(100 + spread);
    const Fp4Result rc = check_fp4_to_fp8(fc, Segments::whole(128), true);
    EXPECT_EQ(rc.bad, 0);
    EXPECT_EQ(rc.stats.underflow, spread == 14 ? 0 : 127 * 32);
  }
}

TEST(Fp4ToFp8, StepwiseAndDirectColumnConversionAgreeWhereExact) {
  const Segments seg = Segments::from_counts({1, 128, 0, 129, 17});
  for (int spread : {0, 6, 14, 20}) {
    SCOPED_TRACE("spread " + std::to_string(spread));
    const QTensor fp4 = make_fp4(275, 256, 70, 70 + spread, 35 + spread);
    const std::vector<float> v4 = decode_and_compare(fp4);
    QTensor direct, stepwise;
    const QuantStats sd = cpu::fp4_to_fp8_col(fp4, seg, &direct);
    const QuantStats ss = cpu::fp4_to_fp8_col_stepwise(fp4, seg, &stepwise);
    EXPECT_EQ(ss.nonfinite, 0);
    expect_well_formed(stepwise, Layout::kCol128x1, 275, 256);
    const std::vector<float> vd = decode_and_compare(direct), vs = decode_and_compare(stepwise);
    int64_t direct_lost = 0, stepwise_lost = 0, stepwise_only = 0;
    for (size_t i = 0; i < v4.size(); ++i) {
      const bool d = !same_value(v4[i], vd[i]), s = !same_value(v4[i], vs[i]);
      direct_lost += d;
      stepwise_lost += s;
      stepwise_only += s && !d;  // the fresh scale is never coarser than the direct one
    }
    EXPECT_EQ(direct_lost, sd.underflow);
    EXPECT_EQ(stepwise_only, 0);
    if (spread <= 14) {
      EXPECT_EQ(direct_lost, 0);
      EXPECT_EQ(stepwise_lost, 0);
    } else {
      EXPECT_GT(direct_lost, 0);
    }
  }
}

// Pipeline: quantize_mxfp4 of data with row exponents controlled to a spread <= 14 per tile.
TEST(Fp4ToFp8, FromQuantizedDataWithBoundedSpreadIsExact) {
  Rng rng(36);
  const int64_t m = 140, k = 256;
  std::vector<float> x(m * k);
  for (int64_t t = 0; t < m; ++t)
    for (int64_t c = 0; c < k; ++c) {
      // every 32-block: one element pins the amax to 6 * 2^e_block, e_block in [-5, 5]; the
      // other elements are at most that in magnitude
      const int eb = static_cast<int>((t * 7 + c / 32 * 3) % 11) - 5;
      const double top = std::ldexp(6.0, eb);
      x[t * k + c] = static_cast<float>(c % 32 == 0 ? top : rng.sign() * rng.uniform() * top);
    }
  QTensor fp4, row, col;
  cpu::quantize_mxfp4(x.data(), m, k, &fp4);
  const std::vector<float> v4 = decode_and_compare(fp4);
  EXPECT_EQ(cpu::fp4_to_fp8_row(fp4, &row).underflow, 0);
  EXPECT_EQ(cpu::fp4_to_fp8_col(fp4, Segments::from_counts({100, 40}), &col).underflow, 0);
  const std::vector<float> vr = decode_and_compare(row), vc = decode_and_compare(col);
  for (size_t i = 0; i < v4.size(); ++i) {
    ASSERT_TRUE(same_value(v4[i], vr[i])) << where(i, k);
    ASSERT_TRUE(same_value(v4[i], vc[i])) << where(i, k);
  }
}

// ================================================================================================
// Non-finite input: counted, the tile marked NaN, other tiles unaffected
// ================================================================================================
namespace {

// Data with NaN, +Inf, -Inf at the given positions; the rest normal.
std::vector<float> with_nonfinite(int64_t m, int64_t k, const std::vector<std::pair<int64_t, float>>& bad) {
  std::vector<float> x = make_data(Dist::kNormal, m, k, 41);
  for (const auto& b : bad) x[b.first] = b.second;
  return x;
}

// Every tile holding a non-finite value is scale 0xFF and decodes to NaN throughout; every other
// tile matches the reference (expect_matches_reference_quantization does exactly that).
void expect_nonfinite_handled(const std::vector<float>& x, const QTensor& q, const QuantStats& st, int64_t want_count,
                              Fmt fmt, int64_t want_nan_elements) {
  EXPECT_EQ(st.nonfinite, want_count);
  expect_matches_reference_quantization(x, q, fmt);
  std::vector<float> v(q.rows * q.cols);
  cpu::dequantize(q, v.data());
  EXPECT_EQ(std::count_if(v.begin(), v.end(), [](float f) { return std::isnan(f); }), want_nan_elements);
  EXPECT_EQ(std::count_if(v.begin(), v.end(), [](float f) { return std::isinf(f); }), 0);
  EXPECT_THROW(flowmoe::throw_if_nonfinite(st, "test tensor"), flowmoe::NonFiniteError);
  try {
    flowmoe::throw_if_nonfinite(st, "test tensor");
  } catch (const flowmoe::Error& e) {
    EXPECT_NE(std::string(e.what()).find("test tensor"), std::string::npos) << e.what();
    EXPECT_NE(std::string(e.what()).find("non-finite"), std::string::npos) << e.what();
  }
}

}  // namespace

TEST(NonFinite, QuantizeRow) {
  const int64_t m = 3, k = 256;
  // tiles (0, 0), (1, 1), (2, 1) -- the last holds two bad values
  const auto x = with_nonfinite(m, k, {{0 * k + 5, NAN}, {1 * k + 200, INFINITY}, {2 * k + 130, -INFINITY}, {2 * k + 131, NAN}});
  QTensor q;
  const QuantStats st = cpu::quantize_row(x.data(), m, k, &q);
  expect_nonfinite_handled(x, q, st, 4, Fmt::kE4M3, 3 * 128);
  EXPECT_EQ(q.scales[0 * m + 0], 0xFF);
  EXPECT_EQ(q.scales[1 * m + 1], 0xFF);
  EXPECT_EQ(q.scales[1 * m + 2], 0xFF);
  EXPECT_NE(q.scales[1 * m + 0], 0xFF);

  // and it propagates through the exact conversions and the naive path
  QTensor col, naive;
  const QuantStats s2 = cpu::scaling_aware_transpose(q, Segments::from_counts({1, 2}), &col);
  EXPECT_GT(s2.nonfinite, 0);
  expect_well_formed(col, Layout::kCol128x1, m, k);
  std::vector<float> v(m * k);
  cpu::dequantize(col, v.data());
  // column blocks: token {0} and tokens {1, 2}; NaN where any token of the block had a NaN tile
  for (int64_t t = 0; t < m; ++t)
    for (int64_t c = 0; c < k; ++c) {
      const bool nan_expected = t == 0 ? c < 128 : c >= 128;
      EXPECT_EQ(std::isnan(v[t * k + c]), nan_expected) << t << "," << c;
    }
  EXPECT_GT(cpu::naive_col_copy(q, Segments::whole(m), &naive).nonfinite, 0);
  cpu::dequantize(naive, v.data());
  EXPECT_EQ(std::count_if(v.begin(), v.end(), [](float f) { return std::isnan(f); }), m * k);
}

TEST(NonFinite, QuantizeRowBf16) {
  const int64_t m = 2, k = 128;
  std::vector<uint16_t> xb = truncate_to_bf16(make_data(Dist::kNormal, m, k, 42));
  xb[7] = 0x7FC0;    // NaN
  xb[k + 9] = 0xFF80;  // -Inf
  QTensor q;
  const QuantStats st = cpu::quantize_row(xb.data(), m, k, &q);
  expect_nonfinite_handled(widen_bf16(xb), q, st, 2, Fmt::kE4M3, 2 * 128);
}

TEST(NonFinite, QuantizeCol) {
  const int64_t m = 160, k = 128;
  const Segments seg = Segments::from_counts({100, 60});
  const auto x = with_nonfinite(m, k, {{10 * k + 3, NAN}, {150 * k + 4, INFINITY}});
  QTensor q;
  const QuantStats st = cpu::quantize_col(x.data(), m, k, seg, &q);
  expect_nonfinite_handled(x, q, st, 2, Fmt::kE4M3, 100 + 60);
  EXPECT_EQ(q.scales[0 * k + 3], 0xFF);
  EXPECT_EQ(q.scales[1 * k + 4], 0xFF);
  EXPECT_NE(q.scales[1 * k + 3], 0xFF);
}

TEST(NonFinite, QuantizeWeightAndItsTranspose) {
  const int64_t n = 256, k = 256;
  const auto x = with_nonfinite(n, k, {{130 * k + 5, -INFINITY}});
  QTensor q, qt;
  const QuantStats st = cpu::quantize_weight(x.data(), n, k, &q, &qt);
  expect_nonfinite_handled(x, q, st, 1, Fmt::kE4M3, 128 * 128);
  EXPECT_EQ(q.scales[1 * 2 + 0], 0xFF);
  EXPECT_EQ(qt.scales[0 * 2 + 1], 0xFF);
}

TEST(NonFinite, QuantizeMxfp4AndFp4ToFp8) {
  const int64_t m = 2, k = 256;
  const auto x = with_nonfinite(m, k, {{33, NAN}, {k + 255, INFINITY}});
  QTensor q;
  const QuantStats st = cpu::quantize_mxfp4(x.data(), m, k, &q);
  expect_nonfinite_handled(x, q, st, 2, Fmt::kE2M1, 2 * 32);
  EXPECT_EQ(q.scales[0 * 8 + 1], 0xFF);
  EXPECT_EQ(q.scales[1 * 8 + 7], 0xFF);

  QTensor row, col;
  const QuantStats sr = cpu::fp4_to_fp8_row(q, &row);
  const QuantStats sc = cpu::fp4_to_fp8_col(q, Segments::whole(m), &col);
  EXPECT_GT(sr.nonfinite, 0);
  EXPECT_GT(sc.nonfinite, 0);
  std::vector<float> vr(m * k), vc(m * k);
  cpu::dequantize(row, vr.data());
  cpu::dequantize(col, vc.data());
  for (int64_t t = 0; t < m; ++t)
    for (int64_t c = 0; c < k; ++c) {
      // row: the 128-tile holding a NaN block; col: the 32 features of a NaN block, all tokens
      EXPECT_EQ(std::isnan(vr[t * k + c]), (t == 0 && c < 128) || (t == 1 && c >= 128)) << t << "," << c;
      EXPECT_EQ(std::isnan(vc[t * k + c]), (c >= 32 && c < 64) || c >= 224) << t << "," << c;
    }
}

TEST(NonFinite, FiniteStatsDoNotThrow) {
  EXPECT_NO_THROW(flowmoe::throw_if_nonfinite(QuantStats{}, "x"));
  QuantStats only_underflow;
  only_underflow.underflow = 5;
  EXPECT_NO_THROW(flowmoe::throw_if_nonfinite(only_underflow, "x"));
}

// ================================================================================================
// Extremes
// ================================================================================================
TEST(Extremes, AmaxExactlyFmaxTimesPowerOfTwo) {
  const int64_t k = 128;
  const std::vector<int> ks = {-120, -20, -1, 0, 1, 37, 100, 119};
  std::vector<float> x = make_data(Dist::kNormal, static_cast<int64_t>(ks.size()), k, 51);
  for (size_t r = 0; r < ks.size(); ++r) {
    const double top = std::ldexp(448.0, ks[r]);
    for (int64_t c = 0; c < k; ++c) x[r * k + c] = static_cast<float>(x[r * k + c] * top / 8);  // |x| < 448 * 2^k mostly
    for (int64_t c = 0; c < k; ++c) x[r * k + c] = std::max(std::min(x[r * k + c], static_cast<float>(top)), static_cast<float>(-top));
    x[r * k + 3] = static_cast<float>(top);
    x[r * k + 77] = static_cast<float>(-top);
  }
  const int64_t m = static_cast<int64_t>(ks.size());
  QTensor q;
  cpu::quantize_row(x.data(), m, k, &q);
  expect_matches_reference_quantization(x, q, Fmt::kE4M3);
  for (int64_t r = 0; r < m; ++r) {
    EXPECT_EQ(q.scales[r], ks[r] + 127);
    EXPECT_EQ(q.codes[r * k + 3], 0x7E);
    EXPECT_EQ(q.codes[r * k + 77], 0xFE);
  }
  // MXFP4 at 6 * 2^k
  std::vector<float> y(m * 32, 0.0f);
  for (int64_t r = 0; r < m; ++r) {
    y[r * 32] = static_cast<float>(std::ldexp(6.0, ks[r]));
    y[r * 32 + 1] = static_cast<float>(std::ldexp(-6.0, ks[r]));
    y[r * 32 + 2] = static_cast<float>(std::ldexp(1.0, ks[r]));
  }
  QTensor q4;
  cpu::quantize_mxfp4(y.data(), m, 32, &q4);
  expect_matches_reference_quantization(y, q4, Fmt::kE2M1);
  for (int64_t r = 0; r < m; ++r) {
    EXPECT_EQ(q4.scales[r], ks[r] + 127);
    EXPECT_EQ(q4.codes[r * 16], 0xF7);  // +6 low nibble, -6 high nibble
  }
}

// The largest finite floats: the scale is 2^120 and the top E4M3 values there are 240 * 2^120 and
// 256 * 2^120 = 2^128, which does not exist in binary32. Inputs >= 248 * 2^120 (the midpoint; the
// tie goes to the even 256) would round to 2^128 = Inf; decoded saturation (docs/NUMERICS.md)
// writes 240 * 2^120 instead, so finite input stays finite (issue 20), and the reference agrees.
TEST(Extremes, NearFltMax) {
  const int64_t k = 128;
  std::vector<float> x = make_data(Dist::kNormal, 1, k, 52);
  for (auto& v : x) v *= 1e37f;
  x[0] = FLT_MAX;
  x[1] = -FLT_MAX;
  x[2] = std::ldexp(1.9375f, 127);  // 248 * 2^120: the midpoint, ties to 256 * 2^120
  x[3] = std::nextafter(std::ldexp(1.9375f, 127), 0.0f);  // rounds down to 240 * 2^120
  QTensor q;
  cpu::quantize_row(x.data(), 1, k, &q);
  expect_matches_reference_quantization(x, q, Fmt::kE4M3);
  EXPECT_EQ(q.scales[0], 120 + 127);
  std::vector<float> v(k);
  cpu::dequantize(q, v.data());
  EXPECT_EQ(v[0], std::ldexp(1.875f, 127));
  EXPECT_EQ(v[1], -std::ldexp(1.875f, 127));
  EXPECT_EQ(v[2], std::ldexp(1.875f, 127));
  EXPECT_EQ(v[3], std::ldexp(1.875f, 127));
  // BF16 max (0x7F7F) as well
  std::vector<uint16_t> xb(k, 0x3F80);
  xb[0] = 0x7F7F;
  cpu::quantize_row(xb.data(), 1, k, &q);
  expect_matches_reference_quantization(widen_bf16(xb), q, Fmt::kE4M3);
}

// Padding rows (all zero) and all-zero segments get scale code 0 in every layout.
TEST(Extremes, AllZeroTilesGetScaleCodeZero) {
  const int64_t k = 256;
  const Segments seg = Segments::from_counts({20, 3, 0, 130});  // segment 1: three padding rows
  const int64_t m = seg.num_tokens();
  std::vector<float> x = make_data(Dist::kNormal, m, k, 55);
  for (int64_t t = 20; t < 23; ++t)
    for (int64_t c = 0; c < k; ++c) x[t * k + c] = (c % 2) ? 0.0f : -0.0f;
  QTensor row, col, sat, fp4, c8;
  cpu::quantize_row(x.data(), m, k, &row);
  cpu::quantize_col(x.data(), m, k, seg, &col);
  cpu::scaling_aware_transpose(row, seg, &sat);
  cpu::quantize_mxfp4(x.data(), m, k, &fp4);
  cpu::fp4_to_fp8_col(fp4, seg, &c8);
  EXPECT_EQ(expect_matches_reference_quantization(x, row, Fmt::kE4M3), 3 * 2);
  EXPECT_EQ(expect_matches_reference_quantization(x, col, Fmt::kE4M3), k);
  EXPECT_EQ(expect_matches_reference_quantization(x, fp4, Fmt::kE2M1), 3 * 8);
  for (int64_t t = 20; t < 23; ++t)
    for (int64_t b = 0; b < k / 128; ++b) EXPECT_EQ(row.scales[b * m + t], 0);
  for (int64_t c = 0; c < k; ++c) {
    EXPECT_EQ(col.scales[1 * k + c], 0);  // block 1 = segment 1
    EXPECT_EQ(sat.scales[1 * k + c], 0);
    EXPECT_EQ(c8.scales[1 * k + c], 0);
  }
  // signed zeros survive
  std::vector<float> v(m * k);
  cpu::dequantize(sat, v.data());
  EXPECT_TRUE(std::signbit(v[20 * k + 0]));
  EXPECT_FALSE(std::signbit(v[20 * k + 1]));
}

TEST(Extremes, SubnormalFloatInputs) {
  const int64_t k = 128;
  std::vector<float> x(2 * k);
  Rng rng(53);
  for (int64_t i = 0; i < 2 * k; ++i) x[i] = float_of(rng.next32() & 0x807FFFFFu);  // all subnormal
  for (int64_t i = 0; i < k; ++i) x[i] = float_of(bits_of(x[i]) & 0x8000FFFFu);     // row 0: tiny ones
  x[k + 5] = FLT_TRUE_MIN;
  QTensor q, c, f4;
  cpu::quantize_row(x.data(), 2, k, &q);
  expect_matches_reference_quantization(x, q, Fmt::kE4M3);
  EXPECT_EQ(q.scales[0], 0);  // amax < 448 * 2^-127: the scale clamps to 2^-127
  cpu::quantize_col(x.data(), 2, k, Segments::whole(2), &c);
  expect_matches_reference_quantization(x, c, Fmt::kE4M3);
  cpu::quantize_mxfp4(x.data(), 2, k, &f4);
  expect_matches_reference_quantization(x, f4, Fmt::kE2M1);
  // some of them survive (>= 2^-137 encodes to a non-zero subnormal under 2^-127)
  std::vector<float> v(2 * k);
  cpu::dequantize(q, v.data());
  EXPECT_GT(std::count_if(v.begin(), v.end(), [](float f) { return f != 0.0f; }), 0);
}

TEST(Extremes, OneTokenEverywhere) {
  const int64_t k = 256;
  const std::vector<float> x = make_data(Dist::kRowBinades, 1, k, 54);
  QTensor row, col, sat, fp4, c8;
  cpu::quantize_row(x.data(), 1, k, &row);
  cpu::quantize_col(x.data(), 1, k, Segments::whole(1), &col);
  expect_matches_reference_quantization(x, row, Fmt::kE4M3);
  expect_matches_reference_quantization(x, col, Fmt::kE4M3);
  // one token per block: the scaling-aware transpose is the identity on values
  EXPECT_EQ(cpu::scaling_aware_transpose(row, Segments::whole(1), &sat).underflow, 0);
  const auto vr = decode_and_compare(row), vs = decode_and_compare(sat);
  for (int64_t c = 0; c < k; ++c) EXPECT_TRUE(same_value(vr[c], vs[c]));
  cpu::quantize_mxfp4(x.data(), 1, k, &fp4);
  cpu::fp4_to_fp8_col(fp4, Segments::whole(1), &c8);
  expect_well_formed(c8, Layout::kCol128x1, 1, k);
  EXPECT_EQ(c8.scales.size(), static_cast<size_t>(k));
}

TEST(Extremes, ZeroTokens) {
  QTensor row, col, sat, naive, fp4, r8, c8, step;
  const Segments none = Segments::whole(0);
  EXPECT_EQ(cpu::quantize_row(static_cast<const float*>(nullptr), 0, 256, &row).nonfinite, 0);
  expect_well_formed(row, Layout::kRow1x128, 0, 256);
  EXPECT_EQ(cpu::quantize_col(static_cast<const uint16_t*>(nullptr), 0, 256, none, &col).nonfinite, 0);
  expect_well_formed(col, Layout::kCol128x1, 0, 256);
  cpu::scaling_aware_transpose(row, none, &sat);
  expect_well_formed(sat, Layout::kCol128x1, 0, 256);
  cpu::scaling_aware_transpose(row, Segments::from_counts({0, 0, 0}), &sat);  // empty segments only
  expect_well_formed(sat, Layout::kCol128x1, 0, 256);
  cpu::naive_col_copy(row, none, &naive);
  expect_well_formed(naive, Layout::kCol128x1, 0, 256);
  cpu::quantize_mxfp4(static_cast<const float*>(nullptr), 0, 256, &fp4);
  expect_well_formed(fp4, Layout::kMxfp4Row1x32, 0, 256);
  cpu::fp4_to_fp8_row(fp4, &r8);
  expect_well_formed(r8, Layout::kRow1x128, 0, 256);
  cpu::fp4_to_fp8_col(fp4, none, &c8);
  expect_well_formed(c8, Layout::kCol128x1, 0, 256);
  cpu::fp4_to_fp8_col_stepwise(fp4, none, &step);
  expect_well_formed(step, Layout::kCol128x1, 0, 256);
  EXPECT_NO_THROW(cpu::dequantize(row, static_cast<float*>(nullptr)));
  EXPECT_NO_THROW(cpu::dequantize(col, static_cast<uint16_t*>(nullptr)));
}
