// Options of cuda::GroupedGemm (include/flowmoe/gemm.h): defaults, the named settings a program
// maps to them (read through the caller's lookup, never from the environment) and their checks,
// and the token bucket of the tuning key. Host code, tested without a GPU.
#include <cerrno>
#include <cstdlib>
#include <cstring>

#include "flowmoe/error.h"
#include "flowmoe/gemm.h"

namespace flowmoe {
namespace gemm {

GroupedGemmOptions GroupedGemmOptions::previous() {
  GroupedGemmOptions o;
  o.streams = 1;
  o.tune = false;
  o.wgrad_kernel = WgradKernel::kOff;
  return o;
}

namespace {
// An integer setting, when set: lo..hi, anything else (text, a suffix, out of range, empty)
// throws naming the setting, the value and what is expected.
void setting_int(const SettingLookup& lookup, const char* name, int lo, int hi, const char* meaning, int* out) {
  const char* v = lookup(name);
  if (!v) return;
  char* end = nullptr;
  errno = 0;
  const long x = std::strtol(v, &end, 10);
  FLOWMOE_CHECK(errno == 0 && end != v && *end == '\0' && x >= lo && x <= hi,
                name << "=\"" << v << "\"; expected an integer " << lo << ".." << hi << " (" << meaning << ")");
  *out = static_cast<int>(x);
}
}  // namespace

GroupedGemmOptions GroupedGemmOptions::from_settings(const SettingLookup& lookup) {
  return from_settings(lookup, GroupedGemmOptions());
}

GroupedGemmOptions GroupedGemmOptions::from_settings(const SettingLookup& lookup,
                                                     const GroupedGemmOptions& base) {
  GroupedGemmOptions o = base;
  if (const char* v = lookup("FLOWMOE_GEMM_TUNE")) {
    FLOWMOE_CHECK(std::strcmp(v, "0") == 0 || std::strcmp(v, "1") == 0,
                  "FLOWMOE_GEMM_TUNE=\"" << v << "\"; expected 0 (the heuristic's first algorithm) or "
                                         "1 (time the candidates once per problem key)");
    o.tune = v[0] == '1';
  }
  if (const char* v = lookup("FLOWMOE_GEMM_WGRAD_KERNEL")) {
    FLOWMOE_CHECK(std::strcmp(v, "0") == 0 || std::strcmp(v, "1") == 0 || std::strcmp(v, "2") == 0,
                  "FLOWMOE_GEMM_WGRAD_KERNEL=\"" << v << "\"; expected 0 (cuBLASLt per expert), 1 (auto: "
                                                 "flowmoe's sm_90a wgrad kernel where it fits and measured "
                                                 "faster) or 2 (the kernel wherever it fits)");
    o.wgrad_kernel = static_cast<WgradKernel>(v[0] - '0');
  }
  if (const char* v = lookup("FLOWMOE_GEMM_WGRAD_TILE")) {
    FLOWMOE_CHECK(std::strcmp(v, "0") == 0 || std::strcmp(v, "128") == 0 || std::strcmp(v, "256") == 0,
                  "FLOWMOE_GEMM_WGRAD_TILE=\"" << v << "\"; expected 0 (the wgrad kernel's tile width chosen "
                                               "by shape), 128 or 256");
    o.wgrad_tile_n = std::atoi(v);
  }
  setting_int(lookup, "FLOWMOE_GEMM_STREAMS", 1, kMaxStreams, "streams the per-expert matmuls run on", &o.streams);
  setting_int(lookup, "FLOWMOE_GEMM_PRIORITY", 0, kMaxPoolPriority,
              "priority steps of the matmul streams above the default", &o.pool_priority);
  o.validate();
  return o;
}

void GroupedGemmOptions::validate() const {
  FLOWMOE_CHECK(streams >= 1 && streams <= kMaxStreams,
                "GroupedGemm options: streams = " << streams << "; expected 1.." << kMaxStreams);
  FLOWMOE_CHECK(pool_priority >= 0 && pool_priority <= kMaxPoolPriority,
                "GroupedGemm options: pool_priority = " << pool_priority << "; expected 0.." << kMaxPoolPriority);
  FLOWMOE_CHECK(candidates >= 1 && candidates <= kMaxCandidates,
                "GroupedGemm options: candidates = " << candidates << "; expected 1.." << kMaxCandidates);
  FLOWMOE_CHECK(tune_reps >= 1 && tune_reps <= 100,
                "GroupedGemm options: tune_reps = " << tune_reps << "; expected 1..100");
  FLOWMOE_CHECK(wgrad_tile_n == 0 || wgrad_tile_n == 128 || wgrad_tile_n == 256,
                "GroupedGemm options: wgrad_tile_n = " << wgrad_tile_n << "; expected 0 (by shape), 128 or 256");
  FLOWMOE_CHECK(tune_margin >= 0.0 && tune_margin < 1.0,
                "GroupedGemm options: tune_margin = " << tune_margin << "; expected 0 <= margin < 1");
}

const char* wgrad_kernel_unsupported(const Segments& seg, int64_t n, int64_t k) {
  constexpr int64_t kTile = 128, kMaxExperts = 256;
  if (n <= 0 || k <= 0 || n % kTile != 0 || k % kTile != 0) return "N or K not a multiple of 128";
  if (n * seg.num_segments() >= (int64_t(1) << 31) || k >= (int64_t(1) << 31)) return "output too large";
  if (seg.num_tokens() >= (int64_t(1) << 31)) return "too many tokens";
  if (seg.num_tokens() % kTile != 0) return "the token count is not a multiple of 128";
  int64_t nonempty = 0;
  for (int e = 0; e < seg.num_segments(); ++e) {
    if (seg.offsets[e] % kTile != 0) return "an expert's token offset is not a multiple of 128";
    nonempty += seg.offsets[e + 1] > seg.offsets[e];
  }
  if (nonempty > kMaxExperts) return "more than 256 non-empty experts";
  if (nonempty * (n / kTile) * (k / kTile) >= (int64_t(1) << 31)) return "more than 2^31 output tiles";
  return nullptr;
}

bool choose_wgrad_kernel(GroupedGemmOptions::WgradKernel mode, const Segments& seg, int64_t n, int64_t k,
                         WgradOut::Kind kind) {
  using Mode = GroupedGemmOptions::WgradKernel;
  if (mode == Mode::kOff || wgrad_kernel_unsupported(seg, n, k) != nullptr)
    return false;
  if (mode == Mode::kAlways) return true;
  int64_t nonempty = 0;
  for (int e = 0; e < seg.num_segments(); ++e) nonempty += seg.offsets[e + 1] > seg.offsets[e];
  if (nonempty == 0) return true;  // nothing to compute: one zero-fill pass either way
  if (seg.num_tokens() <= 1024 * nonempty) return true;
  const int64_t limit = (kind == WgradOut::Kind::kF32Accumulate ? 16 : 8) * (int64_t(1) << 20);
  return n * k <= limit;
}

int64_t tune_token_bucket(int64_t tokens) {
  if (tokens <= 128) return 128;
  int64_t p = 256;
  while (p < tokens) p *= 2;       // p / 2 < tokens <= p
  const int64_t mid = p / 4 * 3;   // the half octave between p / 2 and p
  return tokens <= mid ? mid : p;
}

}  // namespace gemm
}  // namespace flowmoe
