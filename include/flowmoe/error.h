// Errors: every check throws flowmoe::Error with a message that says what was wrong and what was
// expected, followed by where it was raised: "what was wrong [src/cpu/convert.cpp:123]". The
// location is the source path inside the repository (never the build machine's absolute path),
// so a user reads the message first and a developer still finds the line.
#pragma once

#include <cstring>
#include <initializer_list>
#include <sstream>
#include <stdexcept>
#include <string>

namespace flowmoe {

// The part of a __FILE__ path from the repository's top-level folder on ("src/cpu/convert.cpp"
// from "/home/me/flowmoe/src/cpu/convert.cpp"); the path itself when it has none of them.
inline const char* source_path(const char* file) {
  const char* best = nullptr;
  for (const char* dir : {"/src/", "/include/", "/tools/", "/tests/", "/bench/", "/python/"}) {
    for (const char* p = std::strstr(file, dir); p != nullptr; p = std::strstr(p + 1, dir))
      if (best == nullptr || p > best) best = p;
  }
  return best != nullptr ? best + 1 : file;
}

class Error : public std::runtime_error {
 public:
  Error(const char* file, int line, const std::string& what)
      : std::runtime_error(what + " [" + source_path(file) + ":" + std::to_string(line) + "]"),
        message_(what),
        file_(source_path(file)),
        line_(line) {}
  // The message without the location.
  const std::string& message() const noexcept { return message_; }
  // Where it was raised: the source path inside the repository and the line.
  const char* file() const noexcept { return file_; }
  int line() const noexcept { return line_; }

 private:
  std::string message_;
  const char* file_;  // points into __FILE__ (static storage)
  int line_;
};

// Non-finite input found by a quantizer (SPEC §2). Derived from Error so one catch suffices.
class NonFiniteError : public Error {
 public:
  using Error::Error;
};

// A device allocation failed (cudaErrorMemoryAllocation; the CUDA error state is cleared first, so
// the caller's next launch does not see it). The message says "CUDA out of memory", as PyTorch's.
class OutOfMemoryError : public Error {
 public:
  using Error::Error;
};

}  // namespace flowmoe

// FLOWMOE_CHECK(cond, "message " << value << ...): throws flowmoe::Error when cond is false.
#define FLOWMOE_CHECK(cond, msg)                                             \
  do {                                                                       \
    if (!(cond)) {                                                           \
      std::ostringstream flowmoe_check_os_;                                  \
      flowmoe_check_os_ << msg;                                              \
      throw ::flowmoe::Error(__FILE__, __LINE__, flowmoe_check_os_.str());   \
    }                                                                        \
  } while (0)
