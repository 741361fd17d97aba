// Options of cuda::GroupedGemm (include/flowmoe/gemm.h): defaults, the environment overrides and
// their checks, and the token bucket of the tuning key. Host code, tested without a GPU.
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
  o.wgrad_kernel = false;
  return o;
}

namespace {
// An integer setting from the environment, when set: lo..hi, anything else (text, a suffix, out of
// range, empty) throws naming the variable, the value and what is expected.
void env_int(const char* name, int lo, int hi, const char* meaning, int* out) {
  const char* v = std::getenv(name);
  if (!v) return;
  char* end = nullptr;
  errno = 0;
  const long x = std::strtol(v, &end, 10);
  FLOWMOE_CHECK(errno == 0 && end != v && *end == '\0' && x >= lo && x <= hi,
                name << "=\"" << v << "\"; expected an integer " << lo << ".." << hi << " (" << meaning << ")");
  *out = static_cast<int>(x);
}
}  // namespace

GroupedGemmOptions GroupedGemmOptions::from_env() {
  GroupedGemmOptions o;
  if (const char* v = std::getenv("FLOWMOE_GEMM_TUNE")) {
    FLOWMOE_CHECK(std::strcmp(v, "0") == 0 || std::strcmp(v, "1") == 0,
                  "FLOWMOE_GEMM_TUNE=\"" << v << "\"; expected 0 (the heuristic's first algorithm) or "
                                         "1 (time the candidates once per problem key)");
    o.tune = v[0] == '1';
  }
  if (const char* v = std::getenv("FLOWMOE_GEMM_WGRAD_KERNEL")) {
    FLOWMOE_CHECK(std::strcmp(v, "0") == 0 || std::strcmp(v, "1") == 0,
                  "FLOWMOE_GEMM_WGRAD_KERNEL=\"" << v << "\"; expected 0 (cuBLASLt per expert) or 1 "
                                                 "(flowmoe's sm_90a wgrad kernel where the problem fits it)");
    o.wgrad_kernel = v[0] == '1';
  }
  env_int("FLOWMOE_GEMM_STREAMS", 1, kMaxStreams, "streams the per-expert matmuls run on", &o.streams);
  env_int("FLOWMOE_GEMM_PRIORITY", 0, kMaxPoolPriority, "priority steps of the matmul streams above the default",
          &o.pool_priority);
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
  FLOWMOE_CHECK(tune_margin >= 0.0 && tune_margin < 1.0,
                "GroupedGemm options: tune_margin = " << tune_margin << "; expected 0 <= margin < 1");
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
