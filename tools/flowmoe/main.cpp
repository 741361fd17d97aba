// `flowmoe` command-line tool: dispatches to the subcommands in cmd_*.cpp.
//
// Exit status: 0 success, 1 flowmoe::Error (bad data, non-finite input, I/O), 2 usage error.
#include <algorithm>
#include <cstdio>
#include <cstring>
#include <exception>
#include <iostream>
#include <new>
#include <string>
#include <vector>

#include "cli.h"
#include "flowmoe/error.h"
namespace flowmoe { namespace cli { Command bench_command(); } }  // cmd_bench.cpp (GPU layer benchmark)
namespace flowmoe { namespace cli { Command launch_command(); Command bench_ep_command(); } }  // cmd_launch.cpp

#ifndef FLOWMOE_VERSION
#define FLOWMOE_VERSION "unknown"  // CMake defines it from project(VERSION)
#endif

namespace {

using flowmoe::cli::Command;

void print_version(std::ostream& os) {
#if defined(FLOWMOE_HAVE_CUDA)
  const char* backends = "CPU reference and CUDA (sm_90a)";
#else
  const char* backends = "CPU reference only (built without nvcc or with FLOWMOE_ENABLE_CUDA=OFF)";
#endif
  os << "flowmoe " << FLOWMOE_VERSION << "\nbackends: " << backends << "\n";
}

std::vector<Command> all_commands() {
  using namespace flowmoe::cli;
  return {numerics_command(), quantize_command(),  dequantize_command(), transpose_command(),
          fp4_to_fp8_command(), cast_command(), decode_command(), bench_command(),
          bench_ep_command(), launch_command()};
}

void print_top_usage(std::ostream& os, const std::vector<Command>& cmds) {
  os << "usage: flowmoe <command> [options] [args]\n"
        "       flowmoe --version\n"
        "\n"
        "FP8 / MXFP4 numerics for MoE training: CPU reference conversions and .npy file tools.\n"
        "\n"
        "commands:\n";
  for (const Command& c : cmds) {
    std::string name = c.name;
    name.resize(12, ' ');
    os << "  " << name << c.summary << "\n";
  }
  os << "\n"
        "Run 'flowmoe <command> --help' for the options of one command, 'flowmoe --version' for\n"
        "the version and the backends built in.\n"
        "File layouts are described in docs/NPY_FILES.md.\n"
        "Exit status: 0 ok, 1 error (bad data, non-finite input, I/O), 2 usage error. Errors are one\n"
        "line (what was wrong, what is expected); --debug after the command adds where it was raised.\n";
}

}  // namespace

int main(int argc, char** argv) {
  const std::vector<Command> cmds = all_commands();
  if (argc < 2) {
    std::cerr << "flowmoe: error: no command given\n\n";
    print_top_usage(std::cerr, cmds);
    return 2;
  }
  const std::string name = argv[1];
  if (name == "--help" || name == "-h" || name == "help") {
    print_top_usage(std::cout, cmds);
    return 0;
  }
  if (name == "--version" || name == "-V" || name == "version") {
    print_version(std::cout);
    return 0;
  }
  const Command* cmd = nullptr;
  for (const Command& c : cmds)
    if (name == c.name) cmd = &c;
  if (!cmd) {
    std::cerr << "flowmoe: error: unknown command '" << name << "'\n\n";
    print_top_usage(std::cerr, cmds);
    return 2;
  }

  // --debug (anywhere after the command): errors with the source location they were raised at
  std::vector<char*> kept(argv, argv + argc);
  const auto dbg =
      std::find_if(kept.begin() + 2, kept.end(), [](const char* a) { return std::strcmp(a, "--debug") == 0; });
  const bool debug = dbg != kept.end();
  if (debug) kept.erase(dbg);
  // A usage error shows the command's usage lines (up to the first blank line), not its whole help.
  const auto short_usage = [&] {
    const std::string& u = cmd->usage;
    const size_t blank = u.find("\n\n");
    return (blank == std::string::npos ? u : u.substr(0, blank + 1)) + "(flowmoe " + cmd->name +
           " --help: the options)\n";
  };
  try {
    const flowmoe::cli::Args args(static_cast<int>(kept.size()), kept.data(), 2, cmd->options);
    if (args.help()) {
      std::cout << cmd->usage;
      return 0;
    }
    const int rc = cmd->run(args);
    std::cout.flush();
    return rc;
  } catch (const flowmoe::cli::UsageError& e) {
    std::cerr << "flowmoe " << cmd->name << ": error: " << e.what() << "\n" << short_usage();
    return 2;
  } catch (const flowmoe::Error& e) {
    std::cout.flush();
    std::cerr << "flowmoe " << cmd->name << ": error: " << (debug ? e.what() : e.message()) << "\n";
    return 1;
  } catch (const std::bad_alloc&) {
    std::cerr << "flowmoe " << cmd->name << ": error: out of memory\n";
    return 1;
  } catch (const std::exception& e) {
    std::cerr << "flowmoe " << cmd->name << ": error: " << e.what() << "\n";
    return 1;
  }
}
