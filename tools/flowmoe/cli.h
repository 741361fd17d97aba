// Shared pieces of the `flowmoe` command-line tool: argument parsing, usage errors and the
// table of subcommands.
#pragma once

#include <cstdint>
#include <map>
#include <stdexcept>
#include <string>
#include <vector>

namespace flowmoe {
namespace cli {

// A mistake on the command line: main prints the message and the subcommand's usage to
// stderr and exits 2.
class UsageError : public std::runtime_error {
 public:
  using std::runtime_error::runtime_error;
};

// One option a subcommand accepts: "--name VALUE" (or "--name=VALUE"), or a flag "--name".
struct OptionSpec {
  std::string name;  // without the leading dashes
  bool takes_value;
};

// Parsed arguments of one subcommand.
class Args {
 public:
  // Parses argv[first..argc) against `specs`. "--help"/"-h" sets help(); "--" ends options.
  // Throws UsageError for unknown options, missing values and repeated options.
  Args(int argc, char** argv, int first, const std::vector<OptionSpec>& specs);

  bool help() const { return help_; }
  bool has(const std::string& name) const { return values_.count(name) != 0; }
  bool flag(const std::string& name) const { return has(name); }
  // Value of an option, or `def` when absent.
  std::string get(const std::string& name, const std::string& def = "") const;
  // Value of a required option; UsageError when absent.
  std::string require(const std::string& name) const;
  const std::vector<std::string>& positional() const { return positional_; }
  // Checks the number of positional arguments, naming them in the error.
  void expect_positional(const std::vector<std::string>& names) const;

 private:
  bool help_ = false;
  std::map<std::string, std::string> values_;
  std::vector<std::string> positional_;
};

// Strict parsing helpers: the whole string must parse; errors are UsageError naming `what`.
int64_t parse_int(const std::string& s, const std::string& what, int64_t min_value,
                  int64_t max_value);
// "M,K" -> {M, K}, both >= 0.
std::pair<int64_t, int64_t> parse_shape(const std::string& s, const std::string& what);
// "a,b,c" -> {a, b, c}, each >= 0.
std::vector<int32_t> parse_counts(const std::string& s, const std::string& what);
// One of `choices`, else UsageError listing them.
std::string parse_choice(const std::string& s, const std::string& what,
                         const std::vector<std::string>& choices);

// ---- subcommands ------------------------------------------------------------------------------
// head + the recipe names of the recipe table joined by "," (recipe_names) + tail: a usage text
// that lists the recipes without typing them; kept for the program's lifetime (Command::usage).
const char* usage_with_recipe_names(const char* head, const char* tail);

struct Command {
  const char* name;
  const char* summary;             // one line for `flowmoe --help`
  const char* usage;               // full text for `flowmoe <cmd> --help`
  std::vector<OptionSpec> options;
  int (*run)(const Args& args);    // returns the exit status
};

// Defined in cmd_*.cpp.
Command numerics_command();
Command quantize_command();
Command dequantize_command();
Command transpose_command();
Command fp4_to_fp8_command();
Command cast_command();
Command decode_command();

}  // namespace cli
}  // namespace flowmoe
