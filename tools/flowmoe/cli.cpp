// Argument parsing for the `flowmoe` tool.
#include "cli.h"

#include <cctype>
#include <cerrno>
#include <cstdlib>
#include <limits>
#include <list>

#include "flowmoe/recipe.h"

namespace flowmoe {
namespace cli {

Args::Args(int argc, char** argv, int first, const std::vector<OptionSpec>& specs) {
  bool options_done = false;
  for (int i = first; i < argc; ++i) {
    const std::string a = argv[i];
    if (options_done || a.size() < 2 || a[0] != '-' || (a[1] != '-' && a != "-h")) {
      positional_.push_back(a);  // includes "-" and negative-looking words
      continue;
    }
    if (a == "--") {
      options_done = true;
      continue;
    }
    if (a == "--help" || a == "-h") {
      help_ = true;
      continue;
    }
    std::string name = a.substr(2), value;
    const size_t eq = name.find('=');
    const bool inline_value = eq != std::string::npos;
    if (inline_value) {
      value = name.substr(eq + 1);
      name = name.substr(0, eq);
    }
    const OptionSpec* spec = nullptr;
    for (const OptionSpec& s : specs)
      if (s.name == name) spec = &s;
    if (!spec) throw UsageError("unknown option '--" + name + "'");
    if (values_.count(name)) throw UsageError("option '--" + name + "' given twice");
    if (spec->takes_value) {
      if (!inline_value) {
        if (i + 1 >= argc) throw UsageError("option '--" + name + "' needs a value");
        value = argv[++i];
      }
    } else if (inline_value) {
      throw UsageError("option '--" + name + "' takes no value");
    }
    values_[name] = value;
  }
}

std::string Args::get(const std::string& name, const std::string& def) const {
  const auto it = values_.find(name);
  return it == values_.end() ? def : it->second;
}

std::string Args::require(const std::string& name) const {
  const auto it = values_.find(name);
  if (it == values_.end()) throw UsageError("missing required option '--" + name + "'");
  return it->second;
}

void Args::expect_positional(const std::vector<std::string>& names) const {
  if (positional_.size() == names.size()) return;
  std::string list;
  for (const std::string& n : names) list += (list.empty() ? "" : " ") + n;
  if (positional_.size() < names.size())
    throw UsageError("expected " + std::to_string(names.size()) + " arguments (" + list + "), got " +
                     std::to_string(positional_.size()));
  throw UsageError("unexpected extra argument '" + positional_[names.size()] + "' (expected " + list + ")");
}

int64_t parse_int(const std::string& s, const std::string& what, int64_t min_value, int64_t max_value) {
  // Digits with an optional leading '-' only: strtoll alone would also accept leading white
  // space and a '+'.
  const size_t first_digit = !s.empty() && s[0] == '-' ? 1 : 0;
  if (s.size() <= first_digit || !std::isdigit(static_cast<unsigned char>(s[first_digit])))
    throw UsageError(what + ": '" + s + "' is not an integer");
  errno = 0;
  char* end = nullptr;
  const long long v = std::strtoll(s.c_str(), &end, 10);
  if (*end != '\0' || errno == ERANGE)
    throw UsageError(what + ": '" + s + "' is not an integer");
  if (v < min_value || v > max_value)
    throw UsageError(what + ": " + s + " is out of range [" + std::to_string(min_value) + ", " +
                     std::to_string(max_value) + "]");
  return v;
}

std::pair<int64_t, int64_t> parse_shape(const std::string& s, const std::string& what) {
  const size_t comma = s.find(',');
  if (comma == std::string::npos || s.find(',', comma + 1) != std::string::npos)
    throw UsageError(what + ": expected two integers 'M,K', got '" + s + "'");
  const int64_t lim = std::numeric_limits<int32_t>::max();
  return {parse_int(s.substr(0, comma), what, 0, lim), parse_int(s.substr(comma + 1), what, 0, lim)};
}

std::vector<int32_t> parse_counts(const std::string& s, const std::string& what) {
  std::vector<int32_t> out;
  size_t start = 0;
  for (;;) {
    const size_t comma = s.find(',', start);
    const std::string item = s.substr(start, comma == std::string::npos ? std::string::npos : comma - start);
    out.push_back(static_cast<int32_t>(parse_int(item, what, 0, std::numeric_limits<int32_t>::max())));
    if (comma == std::string::npos) break;
    start = comma + 1;
  }
  return out;
}

std::string parse_choice(const std::string& s, const std::string& what,
                         const std::vector<std::string>& choices) {
  std::string list;
  for (const std::string& c : choices) {
    if (c == s) return s;
    list += (list.empty() ? "" : "|") + c;
  }
  throw UsageError(what + ": '" + s + "' is not one of " + list);
}

const char* usage_with_recipe_names(const char* head, const char* tail) {
  static std::list<std::string> texts;  // a list: its strings never move
  texts.push_back(std::string(head) + recipe_names(",") + tail);
  return texts.back().c_str();
}

}  // namespace cli
}  // namespace flowmoe
