// `flowmoe bench`: the MoE layer forward + backward on the GPU, every recipe in one run
// (issue 6; docs/MOE_GPU.md §5 defines every number printed).
#include <algorithm>
#include <chrono>
#include <cmath>
#include <cstdlib>
#include <cstdio>
#include <fstream>
#include <iostream>
#include <map>
#include <memory>
#include <sstream>
#include <string>
#include <vector>

#include "cli.h"
#include "flowmoe/error.h"
#include "flowmoe/settings.h"
#include "flowmoe/moe.h"
#include "flowmoe/recipe.h"

#if defined(FLOWMOE_HAVE_CUDA)
#include <cuda_runtime.h>

#include "flowmoe/cuda/moe_debug.h"
#include "flowmoe/cuda/moe_graph.h"
#include "layer_options.h"  // tools/common/: the layer's options from the environment
#include "timing.h"         // tools/common/: the timing harness the benchmarks share
#endif

namespace flowmoe {
namespace cli {
namespace {

// The usage text around the recipe names, which come from the recipe table (recipe.h).
const char kBenchUsageHead[] =
    "usage: flowmoe bench [--config NAME[,NAME...]|all] [--tokens T] [--recipes R[,R...]]\n"
    "                     [--reps N] [--warmup N] [--align A] [--no-breakdown]\n"
    "                     [--grads accumulate|overwrite] [--json FILE] [--baseline FILE]\n"
    "                     [--exponent row-max|column-amax] [--graph]\n"
    "\n"
    "Runs the MoE layer forward + backward on the GPU for every recipe in one run and prints,\n"
    "per recipe: time of forward, backward and both (medians of CUDA-event timings), tokens/s,\n"
    "achieved GEMM TFLOP/s, the layer's device memory, saved-activation bytes per token and its\n"
    "casts per pass; then a time breakdown per operator (CUDA events around each stage).\n"
    "\n"
    "configurations (the per-GPU expert computation of the papers' expert-parallel settings, no\n"
    "all-to-all: T tokens routed top-k over the E local experts; docs/MOE_GPU.md):\n"
    "  v3-ep8    DeepSeek-V3 EP8:  H 7168, F 2048, 32 local experts, top-8, sigmoid+renorm x2.5\n"
    "  v3-ep32   DeepSeek-V3 EP32: H 7168, F 2048,  8 local experts, top-8\n"
    "  v2        DeepSeek-V2 EP8:  H 5120, F 1536, 20 local experts, top-6, softmax\n"
    "  v2-lite   DeepSeek-V2-Lite: H 2048, F 1408, 64 experts, top-6, softmax\n"
    "\n"
    "options:\n"
    "  --config C     comma-separated configurations, or all (default v3-ep8)\n"
    "  --tokens T     tokens per GPU (default 8192)\n"
    "  --recipes R    comma-separated recipes (default ";
const char kBenchUsageTail[] =
    ")\n"
    "  --reps N       timed forward+backward steps per recipe (default 10)\n"
    "  --warmup N     untimed steps first (default 3)\n"
    "  --align A      expert segment alignment: 16, 32, 64 or 128 (default 128)\n"
    "  --no-breakdown skip the per-operator time table\n"
    "  --grads G      accumulate (default: dW += into FP32 main gradients) or overwrite (dW =,\n"
    "                 the old values never read: MoeGrads::accumulate = false; what the PyTorch\n"
    "                 baseline does, which starts every step from grad = None)\n"
    "  --exponent R   flow and flow-fp4: the exponent of the column-wise blocks made by the\n"
    "                 scaling-aware transpose and FP4RowToFP8Col (MoeConfig::transpose_exponent):\n"
    "                 row-max or column-amax (default: MoeConfig's, row-max; docs/NUMERICS.md)\n"
    "  --graph        with align 128: the same step also on a layer built with\n"
    "                 CudaLayerOptions::sync_free (no host synchronisation; bf16's GEMMs then the\n"
    "                 BF16 kernels), eager and replayed from a CUDA graph (LayerStepGraph), in a\n"
    "                 table of their own\n"
    "  --json FILE    also write the results as JSON\n"
    "  --baseline F   JSON written by `python3 bench/torch_moe_layer.py --json F`: adds the\n"
    "                 PyTorch layer's tokens/s and the ratio of each recipe to it\n"
    "\n"
    "FLOPs: 18 * (routed rows) * H * F per step = the six expert GEMMs (fprop 2*M*2F*H + 2*M*H*F,\n"
    "dgrad and wgrad twice that), M = T*k real rows (padding and the router GEMMs not counted).\n"
    "Needs a CUDA build and a Hopper GPU; without one it says so and exits 1.\n";

struct BenchConfig {
  const char* name;
  const char* paper;
  int64_t hidden, ffn;
  int experts, topk;
  RouterScore score;
  bool renorm;
  float scale;
};
const BenchConfig kConfigs[] = {
    {"v3-ep8", "DeepSeek-V3 EP8", 7168, 2048, 32, 8, RouterScore::kSigmoid, true, 2.5f},
    {"v3-ep32", "DeepSeek-V3 EP32", 7168, 2048, 8, 8, RouterScore::kSigmoid, true, 2.5f},
    {"v2", "DeepSeek-V2 EP8", 5120, 1536, 20, 6, RouterScore::kSoftmax, false, 1.0f},
    {"v2-lite", "DeepSeek-V2-Lite", 2048, 1408, 64, 6, RouterScore::kSoftmax, false, 1.0f},
};

[[maybe_unused]] std::vector<std::string> split(const std::string& s) {
  std::vector<std::string> out;
  std::string cur;
  for (char c : s) {
    if (c == ',') {
      if (!cur.empty()) out.push_back(cur);
      cur.clear();
    } else {
      cur += c;
    }
  }
  if (!cur.empty()) out.push_back(cur);
  return out;
}

// PyTorch baseline rows from the JSON of bench/torch_moe_layer.py (a list of flat objects).
struct Baseline {
  std::string config;
  int64_t tokens = 0;
  double tokens_per_s = 0, total_ms = 0, peak_delta_gib = -1, saved_bytes_per_token = -1;
};
double json_number(const std::string& obj, const std::string& key, double def) {
  const size_t k = obj.find("\"" + key + "\"");
  if (k == std::string::npos) return def;
  size_t p = obj.find(':', k);
  if (p == std::string::npos) return def;
  ++p;
  while (p < obj.size() && (obj[p] == ' ' || obj[p] == '\n')) ++p;
  if (obj.compare(p, 4, "null") == 0) return def;
  return std::strtod(obj.c_str() + p, nullptr);
}
std::string json_string(const std::string& obj, const std::string& key) {
  const size_t k = obj.find("\"" + key + "\"");
  if (k == std::string::npos) return "";
  const size_t q0 = obj.find('"', obj.find(':', k) + 1);
  const size_t q1 = obj.find('"', q0 + 1);
  return q0 == std::string::npos || q1 == std::string::npos ? "" : obj.substr(q0 + 1, q1 - q0 - 1);
}
[[maybe_unused]] std::vector<Baseline> load_baseline(const std::string& path) {
  std::ifstream f(path);
  FLOWMOE_CHECK(f.good(), "--baseline: cannot read '" << path << "'; expected the JSON written by "
                              "python3 bench/torch_moe_layer.py --json FILE");
  std::stringstream ss;
  ss << f.rdbuf();
  const std::string s = ss.str();
  std::vector<Baseline> out;
  size_t pos = 0;
  while ((pos = s.find('{', pos)) != std::string::npos) {
    const size_t end = s.find('}', pos);
    if (end == std::string::npos) break;
    const std::string obj = s.substr(pos, end - pos + 1);
    Baseline b;
    b.config = json_string(obj, "config");
    b.tokens = static_cast<int64_t>(json_number(obj, "tokens", 0));
    b.tokens_per_s = json_number(obj, "tokens_per_s", 0);
    b.total_ms = json_number(obj, "total_ms", 0);
    b.peak_delta_gib = json_number(obj, "peak_delta_gib", -1);
    b.saved_bytes_per_token = json_number(obj, "saved_bytes_per_token", -1);
    if (!b.config.empty()) out.push_back(b);
    pos = end + 1;
  }
  FLOWMOE_CHECK(!out.empty(), "--baseline: no results found in '" << path << "'");
  return out;
}

#if defined(FLOWMOE_HAVE_CUDA)

#define BENCH_CUDA(expr)                                                                   \
  do {                                                                                     \
    cudaError_t e_ = (expr);                                                               \
    FLOWMOE_CHECK(e_ == cudaSuccess, #expr << " failed: " << cudaGetErrorString(e_));      \
  } while (0)

template <typename T>
struct DevBuf {
  T* p = nullptr;
  explicit DevBuf(int64_t n) { BENCH_CUDA(cudaMalloc(&p, sizeof(T) * std::max<int64_t>(n, 1))); }
  ~DevBuf() { cudaFree(p); }
  DevBuf(const DevBuf&) = delete;
  DevBuf& operator=(const DevBuf&) = delete;
};

using bench::median;

struct RecipeResult {
  Recipe recipe = Recipe::kBf16;
  double fwd_ms = 0, bwd_ms = 0, total_ms = 0, host_ms = 0;
  // host time spent inside backward() (it never waits for the GPU on one GPU): when it nears
  // bwd_ms, the launches, not the GPU, set the pace
  double host_bwd_ms = 0;
  double tokens_per_s = 0, tflops = 0;
  double layer_gib = 0, layer_alloc_gib = 0;
  // the same layer on caller memory (CudaLayerOptions::caller_memory, as the PyTorch op runs it):
  // what a model holds per layer (weight copies + one forward's saved bytes) and the scratch of one
  // call, which every layer of a model shares
  double weights_gib = 0, saved_gib = 0, scratch_gib = 0;
  double saved_bpt = 0, saved_bpt_unpadded = 0;
  int64_t routed = 0, padded = 0;
  int64_t q_fwd = 0, dq_fwd = 0, fused_fwd = 0, conv_fwd = 0;
  int64_t q_bwd = 0, dq_bwd = 0, fused_bwd = 0, conv_bwd = 0;
  int64_t nonfinite = 0, underflow = 0;
  std::vector<cuda::moe::StageTime> stages;  // medians
  std::string report;
  double sync_free_ms = 0, graph_ms = 0;  // --graph: sync_free layer, eager and replayed (0: not run)
  int64_t sync_free_host_syncs = -1;      // --graph: the sync_free layer's host syncs over its steps
};

// --graph: the step on a sync_free layer (same weights, inputs, gradients), eager and then captured
// once into a LayerStepGraph and replayed; CUDA-event medians of whole steps.
void time_sync_free(const MoeConfig& cfg, int reps, int warmup, cudaStream_t stream, const MoeWeights& w,
                    const MoeGrads& g, const bf16_t* x, const bf16_t* dy, bf16_t* y, bf16_t* dx, RecipeResult* r) {
  CudaLayerOptions o = bench::layer_options_from_env();
  o.sync_free = true;
  std::unique_ptr<MoeLayer> layer = make_cuda_layer(cfg, stream, o);
  layer->set_weights(w);
  const int64_t T = cfg.max_tokens;
  const auto step = [&](int) {
    layer->forward(x, T, y);
    layer->backward(dy, dx, g);
  };
  r->sync_free_ms = bench::time_events(step, reps, warmup, stream).us * 1e-3;
  cuda::moe::LayerStepGraph graph(layer.get(), stream, {x, T, y, dy, dx, g});
  r->graph_ms = bench::time_events([&](int) { graph.replay(); }, reps, warmup, stream).us * 1e-3;
  r->sync_free_host_syncs = cuda::moe::counters(layer.get()).host_syncs;
}

RecipeResult run_recipe(const BenchConfig& bc, Recipe recipe, int64_t T, int align, int reps,
                        int warmup, bool breakdown, cudaStream_t stream, const MoeWeights& w,
                        const MoeGrads& g, const bf16_t* x, const bf16_t* dy, bf16_t* y, bf16_t* dx,
                        TransposeExponent exponent, bool graph) {
  MoeConfig cfg;
  cfg.hidden = bc.hidden;
  cfg.ffn = bc.ffn;
  cfg.num_experts = bc.experts;
  cfg.topk = bc.topk;
  cfg.router = bc.score;
  cfg.router_renormalize = bc.renorm;
  cfg.router_scale = bc.scale;
  cfg.align = align;
  cfg.recipe = recipe;
  cfg.max_tokens = T;
  cfg.transpose_exponent = exponent;

  RecipeResult r;
  r.recipe = recipe;
  BENCH_CUDA(cudaDeviceSynchronize());
  size_t free0 = 0, total = 0;
  BENCH_CUDA(cudaMemGetInfo(&free0, &total));
  std::unique_ptr<MoeLayer> layer = make_cuda_layer(cfg, stream, bench::layer_options_from_env());
  layer->set_weights(w);
  for (int i = 0; i < warmup; ++i) {
    layer->forward(x, T, y);
    layer->backward(dy, dx, g);
  }
  BENCH_CUDA(cudaStreamSynchronize(stream));
  size_t free1 = 0;
  BENCH_CUDA(cudaMemGetInfo(&free1, &total));
  r.layer_gib = double(free0 > free1 ? free0 - free1 : 0) / double(1ull << 30);
  r.layer_alloc_gib = double(cuda::moe::allocated_bytes(layer.get())) / double(1ull << 30);
  {
    CudaLayerOptions o = bench::layer_options_from_env();
    o.caller_memory = true;
    const MoeMemoryPlan p = make_cuda_layer(cfg, stream, o)->memory_plan();
    r.weights_gib = double(p.weights) / double(1ull << 30);
    r.saved_gib = double(p.saved) / double(1ull << 30);
    r.scratch_gib = double(p.transient) / double(1ull << 30);
  }

  const bench::PhaseTimes pt = bench::time_phases(
      {[&] { layer->forward(x, T, y); }, [&] { layer->backward(dy, dx, g); }}, 0, reps, stream);
  r.fwd_ms = median(pt.ms[0]);
  r.bwd_ms = median(pt.ms[1]);
  r.total_ms = median(pt.total_ms);
  r.host_ms = median(pt.step_host_ms);
  r.host_bwd_ms = median(pt.host_ms[1]);

  const CastReport& rep = layer->cast_report();
  const MoeStatus st = layer->status();
  r.routed = rep.routed_rows;
  r.padded = rep.padded_rows;
  r.tokens_per_s = double(T) / (r.total_ms * 1e-3);
  r.tflops = 18.0 * double(rep.routed_rows) * double(bc.hidden) * double(bc.ffn) / (r.total_ms * 1e-3) / 1e12;
  r.saved_bpt = rep.saved_bytes_per_token();
  r.saved_bpt_unpadded = rep.saved_bytes_per_token_unpadded();
  r.q_fwd = rep.count(MoePass::kForward, CastKind::kQuantize);
  r.dq_fwd = rep.count(MoePass::kForward, CastKind::kDequantize);
  r.fused_fwd = rep.count(MoePass::kForward, CastKind::kFused);
  r.conv_fwd = rep.count(MoePass::kForward, CastKind::kConvert);
  r.q_bwd = rep.count(MoePass::kBackward, CastKind::kQuantize);
  r.dq_bwd = rep.count(MoePass::kBackward, CastKind::kDequantize);
  r.fused_bwd = rep.count(MoePass::kBackward, CastKind::kFused);
  r.conv_bwd = rep.count(MoePass::kBackward, CastKind::kConvert);
  r.nonfinite = st.nonfinite;
  r.underflow = st.underflow;
  r.report = rep.to_string();

  if (breakdown) {
    cuda::moe::set_profiling(layer.get(), true);
    std::map<std::string, std::vector<double>> acc;
    std::vector<cuda::moe::StageTime> order;
    const int n = std::max(3, std::min(reps, 5));
    for (int i = 0; i < n; ++i) {
      layer->forward(x, T, y);
      layer->backward(dy, dx, g);
      const std::vector<cuda::moe::StageTime> s = cuda::moe::stage_times(layer.get());
      if (i == 0) order = s;
      for (const auto& st2 : s)
        acc[std::string(moe_pass_name(st2.pass)) + "/" + st2.name].push_back(st2.ms);
    }
    for (auto& s : order) s.ms = float(median(acc[std::string(moe_pass_name(s.pass)) + "/" + s.name]));
    r.stages = order;
    cuda::moe::set_profiling(layer.get(), false);
  }
  layer.reset();
  BENCH_CUDA(cudaDeviceSynchronize());
  if (graph && align == 128) {
    time_sync_free(cfg, reps, warmup, stream, w, g, x, dy, y, dx, &r);
    BENCH_CUDA(cudaDeviceSynchronize());
  }
  return r;
}

std::string casts_str(int64_t q, int64_t dq, int64_t fused, int64_t conv) {
  char buf[64];
  std::snprintf(buf, sizeof buf, "%lld Q + %lld DQ, %lld fused, %lld conv", static_cast<long long>(q),
                static_cast<long long>(dq), static_cast<long long>(fused), static_cast<long long>(conv));
  return buf;
}

int run_bench(const Args& args) {
  // ---- options ----
  std::vector<const BenchConfig*> configs;
  const std::string cs = args.get("config", "v3-ep8");
  for (const std::string& name : split(cs)) {
    if (name == "all") {
      for (const BenchConfig& c : kConfigs) configs.push_back(&c);
      continue;
    }
    const BenchConfig* found = nullptr;
    for (const BenchConfig& c : kConfigs)
      if (name == c.name) found = &c;
    if (!found) throw UsageError("--config: '" + name + "' is not one of v3-ep8|v3-ep32|v2|v2-lite|all");
    configs.push_back(found);
  }
  if (configs.empty()) throw UsageError("--config: no configuration given");
  const int64_t T = parse_int(args.get("tokens", "8192"), "--tokens", 1, 1 << 20);
  const int reps = static_cast<int>(parse_int(args.get("reps", "10"), "--reps", 1, 10000));
  const int warmup = static_cast<int>(parse_int(args.get("warmup", "3"), "--warmup", 0, 1000));
  const int align = static_cast<int>(parse_int(args.get("align", "128"), "--align", 1, 1024));
  if (align != 16 && align != 32 && align != 64 && align != 128)
    throw UsageError("--align: " + std::to_string(align) + " is not one of 16, 32, 64, 128");
  std::vector<Recipe> recipes;
  for (const std::string& name : split(args.get("recipes", recipe_names(",")))) {
    Recipe rc = Recipe::kBf16;
    if (!try_parse_recipe(name, &rc))
      throw UsageError("--recipes: '" + name + "' is not one of " + recipe_names("|"));
    recipes.push_back(rc);
  }
  if (recipes.empty()) throw UsageError("--recipes: no recipe given");
  const bool breakdown = !args.flag("no-breakdown");
  const bool graph = args.flag("graph");
  const std::string grads = args.get("grads", "accumulate");
  if (grads != "accumulate" && grads != "overwrite")
    throw UsageError("--grads: '" + grads + "' is not one of accumulate|overwrite");
  std::vector<Baseline> baseline;
  if (args.has("baseline")) baseline = load_baseline(args.get("baseline"));
  TransposeExponent exponent = MoeConfig().transpose_exponent;
  if (args.has("exponent")) {
    const std::string e = args.get("exponent");
    if (e != "row-max" && e != "column-amax")
      throw UsageError("--exponent: '" + e + "' is not one of row-max|column-amax");
    exponent = e == "column-amax" ? TransposeExponent::kColumnAmax : TransposeExponent::kRowMax;
  }

  // ---- device ----
  int ndev = 0;
  const cudaError_t derr = cudaGetDeviceCount(&ndev);
  if (derr != cudaSuccess || ndev == 0) {
    // Without any NVIDIA driver the runtime reports "CUDA driver version is insufficient", which
    // reads like an upgrade to make: on a machine with no driver at all, say there is no GPU.
    int driver = 0;
    const bool no_driver = cudaDriverGetVersion(&driver) == cudaSuccess && driver == 0;
    std::string why = "no GPU found";
    if (derr == cudaErrorInsufficientDriver && !no_driver)
      why = "the NVIDIA driver (CUDA " + std::to_string(driver / 1000) + "." + std::to_string(driver % 1000 / 10) +
            ") is older than this build's CUDA runtime; update the driver";
    else if (no_driver || derr == cudaErrorNoDevice || derr == cudaErrorInsufficientDriver)
      why = "no GPU here: no NVIDIA driver is loaded or no device is visible";
    else if (derr != cudaSuccess)
      why = std::string("the CUDA runtime reports: ") + cudaGetErrorString(derr);
    std::cerr << "flowmoe bench: " << why << "; the benchmark needs a Hopper GPU (sm_90). "
              << "`flowmoe numerics` runs on the CPU\n";
    return 1;
  }
  cudaDeviceProp prop{};
  BENCH_CUDA(cudaGetDeviceProperties(&prop, 0));
  if (prop.major != 9) {
    std::cerr << "flowmoe bench: device 0 is " << prop.name << " (sm_" << prop.major << prop.minor
              << "); the FP8 recipes need a Hopper GPU (sm_90)\n";
    return 1;
  }
  std::printf("# flowmoe bench: %s, %d SMs, %.0f GiB; T = %lld tokens/GPU, align %d, %d warm-up + %d timed "
              "steps (medians); gradients %s\n",
              prop.name, prop.multiProcessorCount, double(prop.totalGlobalMem) / double(1ull << 30),
              static_cast<long long>(T), align, warmup, reps,
              grads == "accumulate" ? "accumulated (dW +=)" : "overwritten (dW =)");
  std::printf("transpose exponent (flow, flow-fp4): %s\n",
              exponent == TransposeExponent::kColumnAmax ? "column-amax" : "row-max");

  std::ostringstream json;
  json << "[";
  bool first_json = true;
  cudaStream_t stream;
  BENCH_CUDA(cudaStreamCreateWithFlags(&stream, cudaStreamNonBlocking));
  for (const BenchConfig* bc : configs) {
    const int64_t H = bc->hidden, F = bc->ffn, E = bc->experts;
    std::printf("\n## %s (%s): H %lld, F %lld, %lld local experts, top-%d, %s%s; T %lld -> %lld routed rows\n",
                bc->name, bc->paper, static_cast<long long>(H), static_cast<long long>(F),
                static_cast<long long>(E), bc->topk, bc->score == RouterScore::kSigmoid ? "sigmoid" : "softmax",
                bc->renorm ? "+renorm" : "", static_cast<long long>(T), static_cast<long long>(T * bc->topk));
    // inputs, FP32 masters and main gradients (the caller's memory, not the layer's)
    DevBuf<float> w1(E * 2 * F * H), w2(E * H * F), wr(E * H), dw1(E * 2 * F * H), dw2(E * H * F), dwr(E * H);
    DevBuf<bf16_t> x(T * H), dy(T * H), y(T * H), dx(T * H);
    cuda::moe::fill_normal_f32(w1.p, E * 2 * F * H, 11, float(1.0 / std::sqrt(double(H))), stream);
    cuda::moe::fill_normal_f32(w2.p, E * H * F, 12, float(1.0 / std::sqrt(double(F))), stream);
    cuda::moe::fill_normal_f32(wr.p, E * H, 13, float(1.0 / std::sqrt(double(H))), stream);
    cuda::moe::fill_normal_bf16(x.p, T * H, 14, 1.0f, stream);
    cuda::moe::fill_normal_bf16(dy.p, T * H, 15, 1.0f, stream);
    BENCH_CUDA(cudaMemsetAsync(dw1.p, 0, sizeof(float) * E * 2 * F * H, stream));
    BENCH_CUDA(cudaMemsetAsync(dw2.p, 0, sizeof(float) * E * H * F, stream));
    BENCH_CUDA(cudaMemsetAsync(dwr.p, 0, sizeof(float) * E * H, stream));
    BENCH_CUDA(cudaStreamSynchronize(stream));
    const double io_gib = double(sizeof(float) * (2 * (E * 2 * F * H + E * H * F + E * H)) +
                                 sizeof(bf16_t) * 4 * T * H) / double(1ull << 30);
    MoeWeights w;
    w.w1 = w1.p;
    w.w2 = w2.p;
    w.wr = wr.p;
    MoeGrads g;
    g.dw1 = dw1.p;
    g.dw2 = dw2.p;
    g.dwr = dwr.p;
    g.accumulate = grads == "accumulate";

    std::vector<RecipeResult> results;
    for (Recipe rc : recipes) {
      std::fprintf(stderr, "  running %s / %s ...\n", bc->name, recipe_name(rc));
      results.push_back(run_recipe(*bc, rc, T, align, reps, warmup, breakdown, stream, w, g, x.p, dy.p, y.p, dx.p,
                                   exponent, graph));
    }
    // the recipes the comparisons and the targets below refer to (null: not run)
    auto result_of = [&](Recipe recipe) -> const RecipeResult* {
      const RecipeResult* last = nullptr;  // a recipe given twice: its last run
      for (const RecipeResult& r : results)
        if (r.recipe == recipe) last = &r;
      return last;
    };
    const RecipeResult* r_bf16 = result_of(Recipe::kBf16);
    const RecipeResult* r_block = result_of(Recipe::kBlockwise);
    const RecipeResult* r_flow = result_of(Recipe::kFlow);
    const RecipeResult* r_fp4 = result_of(Recipe::kFlowFp4);
    const Baseline* base = nullptr;
    for (const Baseline& bl : baseline)
      if (bl.config == bc->name && bl.tokens == T) base = &bl;

    std::printf("\n| recipe | fwd ms | bwd ms | fwd+bwd ms | tokens/s | GEMM TFLOP/s | vs bf16 | vs blockwise |%s"
                " layer GiB | saved B/token | saved vs bf16 | casts forward | casts backward |\n",
                base ? " vs PyTorch |" : "");
    std::printf("| --- | --- | --- | --- | --- | --- | --- | --- |%s --- | --- | --- | --- | --- |\n",
                base ? " --- |" : "");
    for (const RecipeResult& r : results) {
      char vs_bf16[32] = "-", vs_block[32] = "-", vs_torch[32] = "-", sv[32] = "-";
      if (r_bf16) std::snprintf(vs_bf16, sizeof vs_bf16, "%.2fx", r_bf16->total_ms / r.total_ms);
      if (r_block) std::snprintf(vs_block, sizeof vs_block, "%.2fx", r_block->total_ms / r.total_ms);
      if (base) std::snprintf(vs_torch, sizeof vs_torch, "%.2fx", r.tokens_per_s / base->tokens_per_s);
      if (r_bf16) std::snprintf(sv, sizeof sv, "%.3f", r.saved_bpt / r_bf16->saved_bpt);
      std::printf("| %s | %.2f | %.2f | %.2f | %.0f | %.0f | %s | %s |%s%s%s %.2f | %.0f (%.0f unpadded) | %s | %s | %s |\n",
                  recipe_name(r.recipe), r.fwd_ms, r.bwd_ms, r.total_ms, r.tokens_per_s, r.tflops, vs_bf16,
                  vs_block, base ? " " : "", base ? vs_torch : "", base ? " |" : "", r.layer_gib, r.saved_bpt,
                  r.saved_bpt_unpadded, sv, casts_str(r.q_fwd, r.dq_fwd, r.fused_fwd, r.conv_fwd).c_str(),
                  casts_str(r.q_bwd, r.dq_bwd, r.fused_bwd, r.conv_bwd).c_str());
    }
    std::printf("\nrouted rows %lld, padded rows %lld (align %d); caller's buffers (FP32 masters + main grads + "
                "x/dy/y/dx) %.2f GiB, not in 'layer GiB'\n",
                static_cast<long long>(results.front().routed), static_cast<long long>(results.front().padded),
                align, io_gib);
    std::printf("on caller memory (the PyTorch op), GiB a model holds per layer = weight copies + saved per "
                "forward in flight; scratch of one call, shared by all layers:");
    for (const RecipeResult& r : results)
      std::printf(" %s %.2f = %.2f + %.2f (scratch %.2f);", recipe_name(r.recipe), r.weights_gib + r.saved_gib,
                  r.weights_gib, r.saved_gib, r.scratch_gib);
    std::printf("\n");
    std::printf("host time inside backward() (launches; GPU backward in parentheses):");
    for (const RecipeResult& r : results)
      std::printf(" %s %.2f ms (%.2f)", recipe_name(r.recipe), r.host_bwd_ms, r.bwd_ms);
    std::printf("\n");
    if (base)
      std::printf("PyTorch BF16 layer (bench/torch_moe_layer.py): %.2f ms, %.0f tokens/s, peak above its inputs "
                  "%.2f GiB, saved %.0f B/token\n",
                  base->total_ms, base->tokens_per_s, base->peak_delta_gib, base->saved_bytes_per_token);
    if (graph) {
      std::printf("\nwithout host synchronisation (CudaLayerOptions::sync_free), fwd+bwd ms:\n\n"
                  "| recipe | default layer | sync_free, eager | sync_free, graph replay | replay vs default | "
                  "host syncs (sync_free) |\n| --- | --- | --- | --- | --- | --- |\n");
      for (const RecipeResult& r : results)
        if (r.graph_ms > 0)
          std::printf("| %s | %.2f | %.2f | %.2f | %.2fx | %lld |\n", recipe_name(r.recipe), r.total_ms,
                      r.sync_free_ms, r.graph_ms, r.total_ms / r.graph_ms,
                      static_cast<long long>(r.sync_free_host_syncs));
    }
    for (const RecipeResult& r : results)
      if (r.nonfinite)
        std::printf("WARNING: %s met %lld non-finite values\n", recipe_name(r.recipe),
                    static_cast<long long>(r.nonfinite));

    // targets of issue 6
    std::printf("\ntargets (issue 6):\n");
    if (r_flow && base)
      std::printf("  flow >= 1.8x the PyTorch BF16 layer:   %.2fx  %s\n", r_flow->tokens_per_s / base->tokens_per_s,
                  r_flow->tokens_per_s / base->tokens_per_s >= 1.8 ? "met" : "MISSED");
    if (r_flow && r_block)
      std::printf("  flow >= 1.15x blockwise:               %.2fx  %s\n", r_block->total_ms / r_flow->total_ms,
                  r_block->total_ms / r_flow->total_ms >= 1.15 ? "met" : "MISSED");
    if (r_flow && r_bf16)
      std::printf("  flow saved <= 0.55x bf16:              %.3fx  %s (unpadded %.3fx)\n",
                  r_flow->saved_bpt / r_bf16->saved_bpt, r_flow->saved_bpt / r_bf16->saved_bpt <= 0.55 ? "met" : "MISSED",
                  r_flow->saved_bpt_unpadded / r_bf16->saved_bpt_unpadded);
    if (r_fp4 && r_flow)
      std::printf("  flow-fp4 saved <= 0.7x flow:           %.3fx  %s (unpadded %.3fx)\n",
                  r_fp4->saved_bpt / r_flow->saved_bpt, r_fp4->saved_bpt / r_flow->saved_bpt <= 0.7 ? "met" : "MISSED",
                  r_fp4->saved_bpt_unpadded / r_flow->saved_bpt_unpadded);

    if (breakdown) {
      std::printf("\ntime per operator (ms, medians; CUDA events around each stage, so the sum exceeds the pass "
                  "time by the event overhead):\n\n| pass | stage |");
      for (const RecipeResult& r : results) std::printf(" %s |", recipe_name(r.recipe));
      std::printf("\n| --- | --- |");
      for (size_t i = 0; i < results.size(); ++i) std::printf(" --- |");
      std::printf("\n");
      // union of stage names in order of first appearance
      std::vector<std::pair<MoePass, std::string>> names;
      for (const RecipeResult& r : results)
        for (const auto& s : r.stages) {
          const auto key = std::make_pair(s.pass, s.name);
          if (std::find(names.begin(), names.end(), key) == names.end()) names.push_back(key);
        }
      std::stable_sort(names.begin(), names.end(),
                       [](const auto& a, const auto& b) { return a.first < b.first; });
      for (const auto& key : names) {
        std::printf("| %s | %s |", moe_pass_name(key.first), key.second.c_str());
        for (const RecipeResult& r : results) {
          const cuda::moe::StageTime* hit = nullptr;
          for (const auto& s : r.stages)
            if (s.pass == key.first && s.name == key.second) hit = &s;
          if (hit) std::printf(" %.3f |", hit->ms);
          else std::printf(" |");
        }
        std::printf("\n");
      }
      for (MoePass p : {MoePass::kForward, MoePass::kBackward}) {
        std::printf("| %s | **sum of stages** |", moe_pass_name(p));
        for (const RecipeResult& r : results) {
          double sum = 0;
          for (const auto& s : r.stages)
            if (s.pass == p) sum += s.ms;
          std::printf(" %.3f |", sum);
        }
        std::printf("\n");
      }
    }
    std::printf("\ncast reports (one step, as executed):\n");
    for (const RecipeResult& r : results) std::printf("%s", r.report.c_str());

    for (const RecipeResult& r : results) {
      json << (first_json ? "\n" : ",\n") << " {\"config\": \"" << bc->name << "\", \"recipe\": \""
           << recipe_name(r.recipe) << "\", \"tokens\": " << T << ", \"align\": " << align
           << ", \"fwd_ms\": " << r.fwd_ms << ", \"bwd_ms\": " << r.bwd_ms << ", \"total_ms\": " << r.total_ms
           << ", \"host_ms\": " << r.host_ms << ", \"host_backward_ms\": " << r.host_bwd_ms << ", \"tokens_per_s\": " << r.tokens_per_s
           << ", \"tflops\": " << r.tflops << ", \"layer_gib\": " << r.layer_gib
           << ", \"saved_bytes_per_token\": " << r.saved_bpt
           << ", \"saved_bytes_per_token_unpadded\": " << r.saved_bpt_unpadded
           << ", \"casts_fwd\": [" << r.q_fwd << ", " << r.dq_fwd << ", " << r.fused_fwd << ", " << r.conv_fwd
           << "], \"casts_bwd\": [" << r.q_bwd << ", " << r.dq_bwd << ", " << r.fused_bwd << ", " << r.conv_bwd
           << "], \"stages\": {";
      for (size_t i = 0; i < r.stages.size(); ++i)
        json << (i ? ", " : "") << "\"" << moe_pass_name(r.stages[i].pass) << "/" << r.stages[i].name
             << "\": " << r.stages[i].ms;
      json << "}}";
      first_json = false;
    }
    std::fflush(stdout);
  }
  cudaStreamDestroy(stream);
  json << "\n]\n";
  if (args.has("json")) {
    std::ofstream out(args.get("json"));
    FLOWMOE_CHECK(out.good(), "--json: cannot write '" << args.get("json") << "'");
    out << json.str();
  }
  return 0;
}

#else  // no CUDA backend in this build

int run_bench(const Args& args) {
  (void)args;
  std::cerr << "flowmoe bench: this flowmoe was built without the CUDA backend (no nvcc at build time, or "
               "FLOWMOE_ENABLE_CUDA=OFF); the benchmark needs a CUDA build and a Hopper GPU\n";
  return 1;
}

#endif

}  // namespace

Command bench_command() {
  return {"bench", "MoE layer forward+backward on the GPU, every recipe (tokens/s, TFLOP/s, memory)",
          usage_with_recipe_names(kBenchUsageHead, kBenchUsageTail),
          {{"config", true}, {"tokens", true}, {"recipes", true}, {"reps", true}, {"warmup", true},
           {"align", true}, {"no-breakdown", false}, {"graph", false}, {"grads", true}, {"json", true}, {"baseline", true},
           {"exponent", true}},
          run_bench};
}

}  // namespace cli
}  // namespace flowmoe
