// GPU token-movement kernels against the CPU reference, bit for bit: router ids, probs, logit
// gradients and aux loss; routing tables; permute+pad / unpermute+unpad and their baselines.
// Output buffers start poisoned (0xA5) on both sides, so "rows >= Mp are not written" is checked
// too. Runs on the device machine only (CTest label `gpu`).
#include <cuda_runtime.h>
#include <gtest/gtest.h>

#include <algorithm>
#include <cmath>
#include <cstring>
#include <numeric>
#include <random>
#include <string>
#include <vector>

#include "flowmoe/error.h"
#include "flowmoe/numerics.h"
#include "flowmoe/token.h"
#include "cuda/gpu_test_util.h"

namespace flowmoe {
namespace {

using namespace testutil;  // DBuf, REQUIRE_DEVICE, expect_same_bits

template <typename T>
std::vector<T> poisoned(size_t n) {
  std::vector<T> v(n);
  std::memset(v.data(), 0xA5, n * sizeof(T));
  return v;
}

std::vector<int32_t> random_ids(int64_t t, int k, int e, uint32_t seed, int used, double drop, double bad = 0) {
  std::mt19937 rng(seed);
  std::uniform_real_distribution<double> ud(0, 1);
  std::vector<int32_t> ids(t * k), pool(used);
  for (int64_t i = 0; i < t; ++i) {
    std::iota(pool.begin(), pool.end(), 0);
    for (int j = 0; j < k; ++j) {
      std::swap(pool[j], pool[j + rng() % (used - j)]);
      const double u = ud(rng);
      ids[i * k + j] = u < drop ? -1 : (u < drop + bad ? (rng() & 1 ? e + 3 : -5) : pool[j]);
    }
  }
  return ids;
}

// ---- router ------------------------------------------------------------------------------------
enum class Logits { kNormal, kTies, kNonFinite };
struct RouterCase {
  std::string name;
  int64_t t;
  int e, k;
  RouterScore score;
  bool renorm, bias;
  float scale;
  Logits data;
};

std::vector<float> make_logits(const RouterCase& c, uint32_t seed) {
  std::mt19937 rng(seed);
  std::normal_distribution<float> nd(0.f, 2.f);
  std::uniform_real_distribution<float> ud(0.f, 1.f);
  std::vector<float> z(c.t * c.e);
  for (auto& v : z) {
    v = nd(rng);
    if (c.data == Logits::kTies) v = std::round(v * 2.f) / 2.f;  // many exact ties
    if (c.data == Logits::kNonFinite) {
      const float u = ud(rng);
      if (u < 0.002f) v = NAN;
      else if (u < 0.003f) v = INFINITY;
      else if (u < 0.004f) v = -INFINITY;
    }
  }
  return z;
}

class RouterGpu : public ::testing::TestWithParam<RouterCase> {};

TEST_P(RouterGpu, ForwardBackwardAuxBitExact) {
  REQUIRE_DEVICE();
  const RouterCase& c = GetParam();
  RouterConfig cfg;
  cfg.num_experts = c.e;
  cfg.topk = c.k;
  cfg.score = c.score;
  cfg.renormalize = c.renorm;
  cfg.scale = c.scale;
  const auto z = make_logits(c, 100 + static_cast<uint32_t>(c.e * 7 + c.k));
  std::vector<float> bias(c.e);
  std::mt19937 rng(9);
  for (auto& b : bias) b = std::uniform_real_distribution<float>(-0.05f, 0.05f)(rng);
  const float* hb = c.bias ? bias.data() : nullptr;

  std::vector<int32_t> ids(c.t * c.k);
  std::vector<float> probs(c.t * c.k);
  const int64_t nf = cpu::router_forward(z.data(), c.t, cfg, hb, ids.data(), probs.data());

  DBuf<float> dz(z), dbias(bias), dprobs_out(c.t * c.k);
  DBuf<int32_t> dids(c.t * c.k);
  DBuf<cuda::DeviceStatus> st(1);
  cudaMemset(st.p, 0, sizeof(cuda::DeviceStatus));
  cuda::router_forward(dz.p, c.t, cfg, c.bias ? dbias.p : nullptr, dids.p, dprobs_out.p, st.p, 0);
  expect_same_bits(ids, dids.get(), "router ids");
  expect_same_bits(probs, dprobs_out.get(), "router probs");
  EXPECT_EQ(st.get()[0].nonfinite, static_cast<unsigned long long>(nf));

  // aux loss
  std::vector<float> coef(c.e);
  const float loss = cpu::router_aux_loss(z.data(), ids.data(), c.t, cfg, 0.001f, coef.data());
  DBuf<float> dloss(1), dcoef(c.e);
  DBuf<uint8_t> ws(cuda::router_aux_workspace_bytes(c.t, c.e));
  cuda::router_aux_loss(dz.p, dids.p, c.t, cfg, 0.001f, dloss.p, dcoef.p, ws.p, 0);
  expect_same_bits(std::vector<float>{loss}, dloss.get(), "aux loss");
  expect_same_bits(coef, dcoef.get(), "aux coefficients");

  // backward, with and without the aux term
  std::vector<float> g(c.t * c.k);
  for (auto& v : g) v = std::normal_distribution<float>(0.f, 1.f)(rng);
  DBuf<float> dg(g), ddl(c.t * c.e);
  for (bool aux : {false, true}) {
    std::vector<float> dl(c.t * c.e);
    cpu::router_backward(z.data(), c.t, cfg, ids.data(), g.data(), aux ? coef.data() : nullptr, 1.5f, dl.data());
    cuda::router_backward(dz.p, c.t, cfg, dids.p, dg.p, aux ? dcoef.p : nullptr, 1.5f, ddl.p, 0);
    expect_same_bits(dl, ddl.get(), aux ? "dlogits (with aux)" : "dlogits");
  }
  EXPECT_EQ(cudaGetLastError(), cudaSuccess);
}

std::vector<RouterCase> router_cases() {
  using S = RouterScore;
  std::vector<RouterCase> v = {
      {"one_token_one_expert", 1, 1, 1, S::kSoftmax, false, false, 1.f, Logits::kNormal},
      {"v3_sigmoid_renorm_bias_top8_of_256", 1000, 256, 8, S::kSigmoid, true, true, 2.5f, Logits::kNormal},
      {"softmax_top6_of_64", 333, 64, 6, S::kSoftmax, false, false, 1.f, Logits::kNormal},
      {"softmax_renorm_top2_of_8", 257, 8, 2, S::kSoftmax, true, false, 1.f, Logits::kNormal},
      {"sigmoid_top4_of_33", 129, 33, 4, S::kSigmoid, false, false, 1.f, Logits::kNormal},
      {"softmax_top32_of_1024", 70, 1024, 32, S::kSoftmax, false, true, 1.f, Logits::kNormal},
      {"all_experts_5", 64, 5, 5, S::kSoftmax, true, false, 1.f, Logits::kNormal},
      {"local32_top8_4096_tokens", 4096, 32, 8, S::kSoftmax, false, false, 1.f, Logits::kNormal},
  };
  for (S s : {S::kSoftmax, S::kSigmoid}) {
    const std::string n = s == S::kSoftmax ? "softmax" : "sigmoid";
    v.push_back({n + "_ties", 300, 48, 8, s, true, false, 1.f, Logits::kTies});
    v.push_back({n + "_nonfinite", 300, 96, 6, s, true, false, 1.f, Logits::kNonFinite});
  }
  return v;
}
INSTANTIATE_TEST_SUITE_P(Token, RouterGpu, ::testing::ValuesIn(router_cases()),
                         [](const ::testing::TestParamInfo<RouterCase>& i) { return i.param.name; });

// ---- routing and movers ----------------------------------------------------------------------
struct MoveCase {
  std::string name;
  int64_t t;
  int k, e, align, used;
  int64_t h;
  double drop, bad;
};

// Device routing tables for a case, compared with the CPU's on the way.
struct DevRouting {
  DBuf<int32_t> ids, counts, offsets, poffsets, row_map, row_map_u;
  DBuf<uint8_t> ws;
  cuda::Routing r;
  DevRouting(const std::vector<int32_t>& h_ids, int64_t t, int k, int e, int align)
      : ids(h_ids), counts(e), offsets(e + 1), poffsets(e + 1), row_map(t * k), row_map_u(t * k),
        ws(cuda::routing_workspace_bytes(t, k, e)) {
    r.tokens = t;
    r.topk = k;
    r.num_experts = e;
    r.align = align;
    r.counts = counts.p;
    r.offsets = offsets.p;
    r.padded_offsets = poffsets.p;
    r.row_map = row_map.p;
    r.row_map_unpadded = row_map_u.p;
    r.workspace = ws.p;
  }
};

class MoveGpu : public ::testing::TestWithParam<MoveCase> {};

TEST_P(MoveGpu, RoutingPermuteUnpermuteBitExact) {
  REQUIRE_DEVICE();
  const MoveCase& c = GetParam();
  const int64_t T = c.t, H = c.h;
  const int k = c.k;
  auto ids = random_ids(T, k, c.e, 31 + c.align, c.used, c.drop, c.bad);
  int64_t nbad = 0;
  std::vector<int32_t> clean = ids;
  for (auto& id : clean)
    if (id < -1 || id >= c.e) {
      id = -1;
      ++nbad;
    }
  const cpu::Routing r = cpu::build_routing(clean.data(), T, k, c.e, c.align);
  DevRouting d(ids, T, k, c.e, c.align);
  DBuf<cuda::DeviceStatus> st(1);
  cudaMemset(st.p, 0, sizeof(cuda::DeviceStatus));
  cuda::build_routing(d.ids.p, d.r, st.p, 0);
  expect_same_bits(r.counts, d.counts.get(), "counts");
  expect_same_bits(r.offsets, d.offsets.get(), "offsets");
  expect_same_bits(r.padded_offsets, d.poffsets.get(), "padded_offsets");
  expect_same_bits(r.row_map, d.row_map.get(), "row_map");
  expect_same_bits(r.row_map_unpadded, d.row_map_u.get(), "row_map_unpadded");
  EXPECT_EQ(st.get()[0].bad_segments, static_cast<unsigned long long>(nbad));
  std::vector<int32_t> hc(c.e);
  EXPECT_EQ(cuda::fetch_routing_counts(d.r, hc.data(), 0), r.padded_rows());
  EXPECT_EQ(hc, r.counts);

  const int64_t R = d.r.max_rows(), Mp = r.padded_rows(), TK = T * k;
  ASSERT_GE(R, Mp);
  std::mt19937 rng(7);
  auto bytes = [&](int64_t n) {
    std::vector<uint8_t> v(n);
    for (auto& b : v) b = static_cast<uint8_t>(rng());
    return v;
  };
  auto bf16s = [&](int64_t n) {
    std::vector<bf16_t> v(n);
    for (auto& b : v) b = num::f32_to_bf16(std::normal_distribution<float>(0.f, 1.f)(rng));
    return v;
  };

  // ---- BF16 permute+pad, and the unfused baseline
  {
    const auto x = bf16s(T * H);
    auto want = poisoned<bf16_t>(R * H);
    cpu::permute_pad_bf16(x.data(), H, r, want.data());
    DBuf<bf16_t> dx(x), out(R * H), compact(TK * H), out2(R * H);
    cuda::permute_pad_bf16(dx.p, H, d.r, out.p, 0);
    expect_same_bits(want, out.get(), "permute_pad_bf16");
    cuda::permute_bf16(dx.p, H, d.r, compact.p, 0);
    cuda::pad_bf16(compact.p, H, d.r, out2.p, 0);
    expect_same_bits(want, out2.get(), "permute_bf16 + pad_bf16");
  }
  // ---- FP8 (codes + [H/128][R] scales)
  if (H % 128 == 0) {
    const auto codes = bytes(T * H), scales = bytes(H / 128 * T);
    auto wc = poisoned<uint8_t>(R * H), ws = poisoned<uint8_t>(H / 128 * R);
    cpu::permute_pad_fp8(codes.data(), scales.data(), H, r, wc.data(), ws.data(), R);
    DBuf<uint8_t> dc(codes), dsc(scales), oc(R * H), os(H / 128 * R), cc(TK * H), cs(H / 128 * TK), oc2(R * H),
        os2(H / 128 * R);
    cuda::permute_pad_fp8(dc.p, dsc.p, H, d.r, oc.p, os.p, R, 0);
    expect_same_bits(wc, oc.get(), "permute_pad_fp8 codes");
    expect_same_bits(ws, os.get(), "permute_pad_fp8 scales");
    cuda::permute_fp8(dc.p, dsc.p, H, d.r, cc.p, cs.p, TK, 0);
    cuda::pad_fp8(cc.p, cs.p, TK, H, d.r, oc2.p, os2.p, R, 0);
    expect_same_bits(wc, oc2.get(), "permute_fp8 + pad_fp8 codes");
    expect_same_bits(ws, os2.get(), "permute_fp8 + pad_fp8 scales");

    // with the inverse row map: build_routing fills row_src, permute_pad_fp8 gathers the scales
    std::vector<int32_t> want_src(R, -1);
    for (int64_t i = 0; i < TK; ++i)
      if (r.row_map[i] >= 0) want_src[r.row_map[i]] = static_cast<int32_t>(i / k);
    DBuf<int32_t> rs(std::vector<int32_t>(R, 12345));  // poison: every row must be written
    cuda::Routing r2 = d.r;
    r2.row_src = rs.p;
    cuda::build_routing(d.ids.p, r2, nullptr, 0);
    expect_same_bits(want_src, rs.get(), "row_src (inverse row map)");
    DBuf<uint8_t> oc3(R * H), os3(std::vector<uint8_t>(ws.size(), 0xA5));
    // rows >= Mp of the scale grid stay untouched, like the CPU's poison
    std::vector<uint8_t> ws3 = ws;
    for (int64_t c = 0; c < H / 128; ++c)
      for (int64_t row = Mp; row < R; ++row) ws3[c * R + row] = 0xA5;
    cuda::permute_pad_fp8(dc.p, dsc.p, H, r2, oc3.p, os3.p, R, 0);
    expect_same_bits(wc, oc3.get(), "permute_pad_fp8 (row_src) codes");
    expect_same_bits(ws3, os3.get(), "permute_pad_fp8 (row_src) scales");
  }
  // ---- MXFP4 (codes [.., H/2] + scales [..][H/32])
  if (H % 32 == 0) {
    const auto codes = bytes(T * H / 2), scales = bytes(T * H / 32);
    auto wc = poisoned<uint8_t>(R * H / 2), ws = poisoned<uint8_t>(R * H / 32);
    cpu::permute_pad_mxfp4(codes.data(), scales.data(), H, r, wc.data(), ws.data());
    DBuf<uint8_t> dc(codes), dsc(scales), oc(R * H / 2), os(R * H / 32), cc(TK * H / 2), cs(TK * H / 32),
        oc2(R * H / 2), os2(R * H / 32);
    cuda::permute_pad_mxfp4(dc.p, dsc.p, H, d.r, oc.p, os.p, 0);
    expect_same_bits(wc, oc.get(), "permute_pad_mxfp4 codes");
    expect_same_bits(ws, os.get(), "permute_pad_mxfp4 scales");
    cuda::permute_mxfp4(dc.p, dsc.p, H, d.r, cc.p, cs.p, 0);
    cuda::pad_mxfp4(cc.p, cs.p, H, d.r, oc2.p, os2.p, 0);
    expect_same_bits(wc, oc2.get(), "permute_mxfp4 + pad_mxfp4 codes");
    expect_same_bits(ws, os2.get(), "permute_mxfp4 + pad_mxfp4 scales");
  }
  // ---- unpermute+unpad (with probs and with weight 1), the baseline, and the backward
  {
    std::vector<float> probs(TK);
    for (auto& p : probs) p = std::uniform_real_distribution<float>(0.f, 1.f)(rng);
    auto yr = bf16s(R * H);  // rows >= Mp hold junk the kernels must not read
    DBuf<bf16_t> dyr(yr), y(T * H), y2(T * H), compact(TK * H);
    DBuf<float> dp(probs);
    for (bool weighted : {true, false}) {
      std::vector<bf16_t> want(T * H);
      cpu::unpermute_unpad(yr.data(), weighted ? probs.data() : nullptr, H, r, want.data());
      cuda::unpermute_unpad(dyr.p, weighted ? dp.p : nullptr, H, d.r, y.p, 0);
      expect_same_bits(want, y.get(), weighted ? "unpermute_unpad" : "unpermute_unpad (weight 1)");
      cuda::unpad_bf16(dyr.p, H, d.r, compact.p, 0);
      cuda::unpermute(compact.p, weighted ? dp.p : nullptr, H, d.r, y2.p, 0);
      expect_same_bits(want, y2.get(), "unpad_bf16 + unpermute");
    }
    const auto dy = bf16s(T * H);
    auto want_rows = poisoned<bf16_t>(R * H);
    std::vector<float> want_dp(TK);
    cpu::unpermute_unpad_backward(dy.data(), yr.data(), probs.data(), H, r, want_rows.data(), want_dp.data());
    DBuf<bf16_t> ddy(dy), drows(R * H), crow(TK * H), drows2(R * H);
    DBuf<float> ddp(TK), ddp2(TK);
    cuda::unpermute_unpad_backward(ddy.p, dyr.p, dp.p, H, d.r, drows.p, ddp.p, 0);
    expect_same_bits(want_rows, drows.get(), "unpermute_unpad_backward dy_rows");
    expect_same_bits(want_dp, ddp.get(), "unpermute_unpad_backward dprobs");
    cuda::unpad_bf16(dyr.p, H, d.r, compact.p, 0);
    cuda::unpermute_backward(ddy.p, compact.p, dp.p, H, d.r, crow.p, ddp2.p, 0);
    cuda::pad_bf16(crow.p, H, d.r, drows2.p, 0);
    expect_same_bits(want_rows, drows2.get(), "unpermute_backward + pad_bf16 dy_rows");
    expect_same_bits(want_dp, ddp2.get(), "unpermute_backward dprobs");
  }
  EXPECT_EQ(cudaGetLastError(), cudaSuccess);
}

std::vector<MoveCase> move_cases() {
  std::vector<MoveCase> v = {
      {"one_token_k1", 1, 1, 4, 16, 4, 128, 0, 0},
      {"one_token_k8_of_32", 1, 8, 32, 128, 32, 256, 0, 0},
      {"zero_token_experts", 200, 2, 16, 32, 5, 384, 0, 0},
      {"dropped_and_bad_ids", 300, 6, 20, 16, 20, 160, 0.2, 0.05},
      {"h96_odd_mxfp4_scale_rows", 77, 3, 7, 16, 7, 96, 0, 0},
      {"h8_bf16_only", 45, 2, 3, 32, 3, 8, 0, 0},
      {"no_padding", 129, 4, 9, 1, 9, 256, 0, 0},
      {"v3_local32_top8_align128", 1024, 8, 32, 128, 32, 7168, 0, 0},
      {"v2lite_top6_of_64_align16", 2048, 6, 64, 16, 64, 2048, 0, 0},
      {"many_chunks_align32", 20000, 8, 256, 32, 256, 128, 0, 0},
  };
  return v;
}
INSTANTIATE_TEST_SUITE_P(Token, MoveGpu, ::testing::ValuesIn(move_cases()),
                         [](const ::testing::TestParamInfo<MoveCase>& i) { return i.param.name; });

TEST(TokenGpu, PermuteThenUnpermuteIsIdentityForTop1) {
  REQUIRE_DEVICE();
  const int64_t T = 500, H = 512;
  for (int align : {16, 32, 128}) {
    const auto ids = random_ids(T, 1, 12, 5, 9, 0);
    DevRouting d(ids, T, 1, 12, align);
    cuda::build_routing(d.ids.p, d.r, nullptr, 0);
    std::vector<bf16_t> x(T * H);
    for (int64_t i = 0; i < T * H; ++i) x[i] = num::f32_to_bf16(static_cast<float>(i % 1000) - 500.f);
    DBuf<bf16_t> dx(x), rows(d.r.max_rows() * H), y(T * H);
    cuda::permute_pad_bf16(dx.p, H, d.r, rows.p, 0);
    cuda::unpermute_unpad(rows.p, nullptr, H, d.r, y.p, 0);
    expect_same_bits(x, y.get(), "permute -> unpermute, align " + std::to_string(align));
  }
}

TEST(TokenGpu, PaddingRowsAreZero) {
  REQUIRE_DEVICE();
  const int64_t T = 100, H = 256;
  const int k = 2, E = 6, A = 128;
  const auto ids = random_ids(T, k, E, 3, E, 0);
  const cpu::Routing r = cpu::build_routing(ids.data(), T, k, E, A);
  DevRouting d(ids, T, k, E, A);
  cuda::build_routing(d.ids.p, d.r, nullptr, 0);
  std::vector<uint8_t> codes(T * H, 0x38), scales(H / 128 * T, 0x7F);
  DBuf<uint8_t> dc(codes), ds(scales), oc(d.r.max_rows() * H), os(H / 128 * d.r.max_rows());
  cuda::permute_pad_fp8(dc.p, ds.p, H, d.r, oc.p, os.p, d.r.max_rows(), 0);
  const auto hc = oc.get();
  const auto hs = os.get();
  for (int e = 0; e < E; ++e)
    for (int64_t row = r.padded_offsets[e]; row < r.padded_offsets[e + 1]; ++row) {
      const bool pad = row >= r.padded_offsets[e] + r.counts[e];
      for (int64_t i = 0; i < H; ++i) ASSERT_EQ(hc[row * H + i], pad ? 0 : 0x38) << "row " << row;
      for (int64_t cidx = 0; cidx < H / 128; ++cidx) ASSERT_EQ(hs[cidx * d.r.max_rows() + row], pad ? 0 : 0x7F);
    }
}

TEST(TokenGpu, RoutingIsRepeatable) {
  REQUIRE_DEVICE();
  const int64_t T = 8192;
  const auto ids = random_ids(T, 8, 32, 77, 32, 0);
  DevRouting d(ids, T, 8, 32, 128);
  cuda::build_routing(d.ids.p, d.r, nullptr, 0);
  const auto first = d.row_map.get();
  for (int i = 0; i < 5; ++i) {
    cuda::build_routing(d.ids.p, d.r, nullptr, 0);
    expect_same_bits(first, d.row_map.get(), "row_map run " + std::to_string(i));
  }
}

TEST(TokenGpu, BadArgumentsThrowClearErrors) {
  REQUIRE_DEVICE();
  DBuf<float> f(1024);
  DBuf<int32_t> i32(1024);
  DBuf<uint8_t> u8(1 << 16);
  DBuf<bf16_t> b16(1 << 16);
  auto expect_error = [](auto fn, const std::string& needle) {
    try {
      fn();
      ADD_FAILURE() << "expected an error mentioning \"" << needle << "\"";
    } catch (const Error& e) {
      EXPECT_NE(std::string(e.what()).find(needle), std::string::npos) << e.what();
    }
  };
  RouterConfig cfg;
  cfg.num_experts = 4;
  cfg.topk = 5;
  expect_error([&] { cuda::router_forward(f.p, 2, cfg, nullptr, i32.p, f.p, nullptr, 0); }, "k = 5");
  cfg.topk = 2;
  cfg.num_experts = 4096;
  expect_error([&] { cuda::router_forward(f.p, 2, cfg, nullptr, i32.p, f.p, nullptr, 0); }, "1024");
  cuda::Routing r;
  r.tokens = 4;
  r.topk = 2;
  r.num_experts = 4;
  r.align = 16;
  expect_error([&] { cuda::build_routing(i32.p, r, nullptr, 0); }, "workspace");
  expect_error([&] { cuda::permute_pad_bf16(b16.p, 128, r, b16.p, 0); }, "build_routing");
  r.counts = r.offsets = r.padded_offsets = r.row_map = i32.p;
  expect_error([&] { cuda::permute_pad_fp8(u8.p, u8.p, 192, r, u8.p, u8.p, 100, 0); }, "multiple of 128");
  expect_error([&] { cuda::permute_pad_mxfp4(u8.p, u8.p, 48, r, u8.p, u8.p, 0); }, "multiple of 32");
  expect_error([&] { cuda::permute_bf16(b16.p, 128, r, b16.p, 0); }, "row_map_unpadded");
  expect_error([&] { cuda::permute_pad_bf16(b16.p + 1, 128, r, b16.p, 0); }, "16-byte aligned");
  r.align = 0;
  expect_error([&] { cuda::permute_pad_bf16(b16.p, 128, r, b16.p, 0); }, "alignment A = 0");
}

}  // namespace
}  // namespace flowmoe
