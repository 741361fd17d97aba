// Errors: every check throws flowmoe::Error with file:line and a message that says what was
// wrong and what was expected.
#pragma once

#include <sstream>
#include <stdexcept>
#include <string>

namespace flowmoe {

class Error : public std::runtime_error {
 public:
  Error(const char* file, int line, const std::string& what)
      : std::runtime_error(std::string(file) + ":" + std::to_string(line) + ": " + what) {}
};

// Non-finite input found by a quantizer (SPEC §2). Derived from Error so one catch suffices.
class NonFiniteError : public Error {
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
