// SPDX-FileCopyrightText: 2026 The epmoe authors
// SPDX-License-Identifier: Apache-2.0
//
// The command line of the examples and benchmarks, one convention for all: --help (or -h)
// prints the usage to stdout and exits 0; an unknown flag, a missing or malformed value
// prints what was wrong and the usage to stderr and exits 2. Call it before MPI starts.
#pragma once

#include <algorithm>
#include <cerrno>
#include <cstdio>
#include <cstdlib>
#include <string>
#include <vector>

namespace cli {

class command_line {
 public:
  /// usage: the full text, starting "usage: <program> ...".
  command_line(int argc, char** argv, const char* usage)
      : argc_(argc), argv_(argv), usage_(usage) {}

  /// Moves to the next argument; false past the last. Handles --help itself.
  bool next() {
    if (++i_ >= argc_) return false;
    arg_ = argv_[i_];
    if (arg_ == "--help" || arg_ == "-h") {
      std::fputs(usage_, stdout);
      std::exit(0);
    }
    return true;
  }
  const std::string& arg() const { return arg_; }
  bool is(const char* flag) const { return arg_ == flag; }
  /// The current argument does not start with '-' (a positional value).
  bool positional() const { return arg_.empty() || arg_[0] != '-'; }

  /// The value after the current flag.
  std::string value() {
    if (i_ + 1 >= argc_) fail("missing value after " + arg_);
    return argv_[++i_];
  }
  long long integer() { return to_integer(value()); }
  double number() { return to_number(value()); }
  /// The value after the current flag as comma-separated integers ("3,17").
  std::vector<long long> integers() {
    const std::string v = value();
    std::vector<long long> out;
    for (std::size_t b = 0; b <= v.size();) {
      const std::size_t e = std::min(v.find(',', b), v.size());
      out.push_back(to_integer(v.substr(b, e - b)));
      b = e + 1;
    }
    return out;
  }
  /// The current argument itself, as a number (a positional value).
  long long integer_here() const { return to_integer(arg_); }
  double number_here() const { return to_number(arg_); }

  /// "<program>: why", then the usage, on stderr; exits 2.
  [[noreturn]] void fail(const std::string& why) const {
    std::fprintf(stderr, "%s: %s\n%s", argv_[0], why.c_str(), usage_);
    std::exit(2);
  }
  [[noreturn]] void unknown() const { fail("unknown argument " + arg_); }

 private:
  long long to_integer(const std::string& s) const {
    char* end = nullptr;
    errno = 0;
    const long long v = std::strtoll(s.c_str(), &end, 10);
    if (s.empty() || *end != '\0' || errno != 0) fail("not an integer: " + s);
    return v;
  }
  double to_number(const std::string& s) const {
    char* end = nullptr;
    errno = 0;
    const double v = std::strtod(s.c_str(), &end);
    if (s.empty() || *end != '\0' || errno != 0) fail("not a number: " + s);
    return v;
  }

  int argc_;
  char** argv_;
  const char* usage_;
  int i_ = 0;
  std::string arg_;
};

/// For a program that takes no arguments: only --help is accepted.
inline void no_arguments(int argc, char** argv, const char* usage) {
  command_line cl(argc, argv, usage);
  if (cl.next()) cl.unknown();
}

}  // namespace cli
