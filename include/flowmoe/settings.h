// Named settings: how a program hands the library's tunables to it by name (the FLOWMOE_*
// variables the CLI, the benchmarks and the tests accept). The library never reads the
// environment: options structs are passed in, and the functions that turn named settings into
// options (gemm::GroupedGemmOptions::from_settings, ep_direct_bytes_from_settings) read them only
// through the caller's lookup: env_lookup() in a program, a map in a test.
#pragma once

#include <cstdlib>
#include <functional>

namespace flowmoe {

// The text of setting `name`, or null when it is not set.
using SettingLookup = std::function<const char*(const char* name)>;

// The process environment as a lookup, for programs (inline here: it runs in the program that
// calls it, the library proper has no getenv call).
inline SettingLookup env_lookup() {
  return [](const char* name) -> const char* { return std::getenv(name); };
}

}  // namespace flowmoe
