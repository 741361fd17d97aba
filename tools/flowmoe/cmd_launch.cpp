// `flowmoe launch` and `flowmoe bench-ep`: start one rank per GPU on this node (issue 7: "flowmoe
// can start its own ranks with one command"). Both use launch_local_ranks_ex (comm.h): torchrun's
// variables (RANK, WORLD_SIZE, LOCAL_RANK, MASTER_ADDR=127.0.0.1, MASTER_PORT), NCCL_NVLS_ENABLE=0,
// a failing rank stops the others, and a watchdog bounds the whole launch. bench-ep runs
// flowmoe_bench_ep (built next to this binary where NCCL is found) on every GPU.
// NOT YET RUN ON GPUs (docs/EP.md §7).
#include <unistd.h>

#include <cstdio>
#include <cstdlib>
#include <string>
#include <vector>

#include "cli.h"
#include "flowmoe/comm.h"
#include "flowmoe/error.h"

#if defined(FLOWMOE_HAVE_CUDA)
#include <cuda_runtime.h>
#endif

namespace flowmoe {
namespace cli {
namespace {

const char kLaunchUsage[] =
    "usage: flowmoe launch [--nprocs N] [--port P] [--timeout S] -- PROGRAM [ARGS...]\n"
    "\n"
    "Starts N copies of PROGRAM on this node, one per GPU, with torchrun's variables: RANK =\n"
    "LOCAL_RANK = i, WORLD_SIZE = LOCAL_WORLD_SIZE = N, MASTER_ADDR = 127.0.0.1, MASTER_PORT = P,\n"
    "and NCCL_NVLS_ENABLE=0 (NVLink multicast stays off). A program using\n"
    "make_nccl_comm_from_env() (flowmoe/comm.h) then builds its communicator. When one rank fails\n"
    "the others get SIGTERM after 10 s (SIGKILL 5 s later); past --timeout every rank still running\n"
    "is stopped the same way. Exit status: 0 when every rank exited 0, else the first failure's\n"
    "status (128 + signal when killed; 124 when only the timeout stopped it).\n"
    "\n"
    "options:\n"
    "  --nprocs N      ranks (default: the number of visible GPUs)\n"
    "  --port P        MASTER_PORT (default 29500)\n"
    "  --timeout S     bound of the whole launch in seconds (default: none)\n";

// The usage text around the recipe names, which come from the recipe table (recipe.h).
const char kBenchEpUsageHead[] =
    "usage: flowmoe bench-ep [--gpus N] [--config C[,C...]|all] [--tokens T] [--recipes R[,R...]]\n"
    "                        [--reps N] [--warmup N] [--align A] [--no-layer] [--no-single]\n"
    "                        [--no-comm] [--stages] [--port P] [--timeout S]\n"
    "\n"
    "Expert-parallel benchmark over NCCL, one rank per GPU (started by this command; EP = N):\n"
    "  * dispatch and combine for the token shape of each configuration, per wire format (bf16;\n"
    "    fp8 = flow's UE8M0 1x128; fp8-fp32scale = fp8-naive's FP32 scales; mxfp4): the NCCL\n"
    "    exchange alone, the whole dispatch (send-order gather + exchange + relayout) and the\n"
    "    dispatch with the entry quantization the format needs; combine with and without the sum\n"
    "    over slots; ms (medians of CUDA events, after a barrier), GB/s (bytes to other ranks per\n"
    "    second), bytes on the wire per element (from the plan; expected 2, 1.0078, 1.03125,\n"
    "    0.53125) and per token;\n"
    "  * the layer forward + backward per recipe at EP = N, next to the same layer on one GPU\n"
    "    doing this GPU's share (El experts, T tokens: the communication-free ideal) and doing\n"
    "    the whole group's problem (N*El experts, N*T tokens): EP efficiency and speed-up.\n"
    "\n"
    "configurations (El = local experts per GPU, E = N*El in all; docs/EP.md §7):\n"
    "  v3-ep8 (H 7168, F 2048, El 32, top-8), v3-ep32 (El 8), v2 (H 5120, F 1536, El 20, top-6),\n"
    "  v2-lite (H 2048, F 1408, El 64, top-6); default v3-ep8,v2,v2-lite\n"
    "\n"
    "options:\n"
    "  --gpus N        ranks, one per GPU (default: every visible GPU; at least 2)\n"
    "  --tokens T      tokens per GPU (default 8192)\n"
    "  --recipes R     default ";
const char kBenchEpUsageTail[] =
    "\n"
    "  --reps N        timed repetitions (default 10); --warmup N untimed first (default 3)\n"
    "  --align A       expert segment alignment (default 128)\n"
    "  --experts-total E  E experts in all, El = E / N per GPU (default: the configuration's El per\n"
    "                  GPU; issue 8's scaling run keeps DeepSeek-V3's 256 at every EP degree)\n"
    "  --no-layer      dispatch/combine only; --no-comm: layer only; --no-single: no 1-GPU layers\n"
    "  --stages        per-stage times of each recipe's EP layer (rank 0) next to the 1 GPU share's\n"
    "  --port P        MASTER_PORT (default 29500); --timeout S: watchdog (default 540)\n"
    "Needs a build with NCCL (flowmoe_bench_ep next to this binary, or FLOWMOE_BENCH_EP=path).\n"
    "Measured on two H200s: docs/PERFORMANCE.md §7 and docs/CHANGELOG.md, \"Expert parallelism on two H200s\".\n";

int visible_gpus() {
#if defined(FLOWMOE_HAVE_CUDA)
  int n = 0;
  if (cudaGetDeviceCount(&n) == cudaSuccess) return n;
#endif
  return 0;
}

std::string sibling(const std::string& name) {
  char buf[4096];
  const ssize_t n = ::readlink("/proc/self/exe", buf, sizeof buf - 1);
  if (n <= 0) return name;
  std::string p(buf, size_t(n));
  const size_t slash = p.rfind('/');
  return slash == std::string::npos ? name : p.substr(0, slash + 1) + name;
}

int report(const LaunchResult& r) {
  for (size_t i = 0; i < r.exit_codes.size(); ++i)
    std::fprintf(stderr, "flowmoe launch: rank %zu exited with status %d after %.1f s\n", i, r.exit_codes[i],
                 r.seconds[i]);
  return r.first_failure != 0 ? r.first_failure : (r.timed_out ? 124 : 0);
}

int run_launch(const Args& args) {
  const std::vector<std::string>& prog = args.positional();
  if (prog.empty()) throw UsageError("launch: no PROGRAM given (flowmoe launch --nprocs 2 -- PROGRAM ARGS...)");
  int n = 0;
  if (args.has("nprocs")) n = int(parse_int(args.get("nprocs"), "--nprocs", 1, 1024));
  if (n == 0) n = visible_gpus();
  if (n == 0) throw UsageError("launch: no GPU visible; give --nprocs N");
  LaunchOptions opt;
  opt.timeout_s = double(parse_int(args.get("timeout", "0"), "--timeout", 0, 86400));
  const int port = int(parse_int(args.get("port", "29500"), "--port", 1, 65535));
  return report(launch_local_ranks_ex(prog, n, port, opt));
}

int run_bench_ep(const Args& args) {
  const char* env = std::getenv("FLOWMOE_BENCH_EP");
  const std::string worker = env && *env ? env : sibling("flowmoe_bench_ep");
#if !defined(FLOWMOE_HAVE_CUDA)
  // A CPU-only install (no nvcc at build time, e.g. `pip install .` without the CUDA toolkit): the
  // missing piece is the CUDA backend, not NCCL, so say that first.
  if (!(env && *env)) {
    std::fprintf(stderr,
                 "flowmoe bench-ep: this flowmoe was built without the CUDA backend (no nvcc at build time), "
                 "and the expert-parallel benchmark runs on GPUs; rebuild where the CUDA toolkit is installed "
                 "(and NCCL, for flowmoe_bench_ep) on a machine with 2 or more Hopper GPUs\n");
    return 1;
  }
#endif
  if (::access(worker.c_str(), X_OK) != 0) {
    std::fprintf(stderr,
                 "flowmoe bench-ep: %s not found or not executable; it is built only where NCCL is found "
                 "(cmake --build build --target flowmoe_bench_ep), or set FLOWMOE_BENCH_EP\n",
                 worker.c_str());
    return 1;
  }
  const int ndev = visible_gpus();
  const int n = args.has("gpus") ? int(parse_int(args.get("gpus"), "--gpus", 1, 1024)) : ndev;
  if (n < 2) {
    std::fprintf(stderr, "flowmoe bench-ep: needs at least 2 GPUs (%d visible%s)\n", ndev,
                 args.has("gpus") ? ", --gpus below 2" : "");
    return 1;
  }
  if (ndev > 0 && n > ndev) {
    std::fprintf(stderr, "flowmoe bench-ep: --gpus %d but only %d visible\n", n, ndev);
    return 1;
  }
  std::vector<std::string> argv = {worker};
  for (const char* o : {"config", "tokens", "recipes", "reps", "warmup", "align", "experts-total"})
    if (args.has(o)) {
      argv.push_back(std::string("--") + o);
      argv.push_back(args.get(o));
    }
  for (const char* f : {"no-layer", "no-single", "no-comm", "stages"})
    if (args.flag(f)) argv.push_back(std::string("--") + f);
  LaunchOptions opt;
  opt.timeout_s = double(parse_int(args.get("timeout", "540"), "--timeout", 1, 86400));
  opt.grace_s = 5.0;
  const int port = int(parse_int(args.get("port", "29500"), "--port", 1, 65535));
  std::fprintf(stderr, "flowmoe bench-ep: %d ranks of %s (MASTER_PORT %d, watchdog %.0f s)\n", n, worker.c_str(),
               port, opt.timeout_s);
  return report(launch_local_ranks_ex(argv, n, port, opt));
}

}  // namespace

Command launch_command() {
  return {"launch", "start one rank per GPU on this node (torchrun's variables, NVLS off, watchdog)",
          kLaunchUsage,
          {{"nprocs", true}, {"port", true}, {"timeout", true}},
          run_launch};
}

Command bench_ep_command() {
  return {"bench-ep", "expert-parallel dispatch/combine and layer benchmark over NCCL, one rank per GPU",
          usage_with_recipe_names(kBenchEpUsageHead, kBenchEpUsageTail),
          {{"gpus", true}, {"config", true}, {"tokens", true}, {"recipes", true}, {"reps", true},
           {"warmup", true}, {"align", true}, {"experts-total", true}, {"no-layer", false}, {"no-single", false},
           {"no-comm", false}, {"stages", false},
           {"port", true}, {"timeout", true}},
          run_bench_ep};
}

}  // namespace cli
}  // namespace flowmoe
