// SPDX-FileCopyrightText: 2026 The epmoe authors
// SPDX-License-Identifier: Apache-2.0
#pragma once

#include <sstream>
#include <stdexcept>
#include <string>

namespace epmoe {

/// Invalid configuration or input: names the field, the value and the rule it broke.
class config_error : public std::invalid_argument {
 public:
  config_error(std::string field, std::string value, std::string rule)
      : std::invalid_argument("epmoe: " + field + " = " + value + ": " + rule),
        field_(std::move(field)),
        value_(std::move(value)),
        rule_(std::move(rule)) {}

  const std::string& field() const noexcept { return field_; }
  const std::string& value() const noexcept { return value_; }
  const std::string& rule() const noexcept { return rule_; }

 private:
  std::string field_, value_, rule_;
};

/// Invalid input to a forward pass (e.g. a user-supplied routing): names the element, the
/// value and the rule, e.g. "epmoe: routing.ids[5][1] = 99: must be in [0, 64)". A
/// config_error, so code that catches config_error catches it too.
class input_error : public config_error {
 public:
  using config_error::config_error;
};

/// A communication failure: a peer disagreed on sizes, or another rank failed mid-exchange.
class comm_error : public std::runtime_error {
 public:
  using std::runtime_error::runtime_error;
};

/// Thrown on a rank whose peers aborted (one rank threw), so no rank hangs in a collective:
/// names the rank that failed (origin, -1 when unknown) and its error's text.
class comm_aborted : public comm_error {
 public:
  comm_aborted() : comm_error("epmoe: exchange aborted because another rank failed") {}
  explicit comm_aborted(const std::string& why, int origin = -1)
      : comm_error(why), origin_(origin) {}
  /// The rank whose failure aborted the exchange, or -1.
  int origin() const noexcept { return origin_; }

 private:
  int origin_ = -1;
};

/// An exchange did not complete within its deadline (layer_config::exchange_timeout): a peer
/// stalled, crashed or never called it. Names the stage and, where the comm can know, the
/// ranks that did not arrive.
class comm_timeout : public comm_error {
 public:
  using comm_error::comm_error;
};

namespace detail {
template <class T>
std::string to_text(const T& v) {
  std::ostringstream os;
  os << v;
  return os.str();
}

/// Throws config_error(field, value, rule) unless ok.
template <class T>
void require(bool ok, const char* field, const T& value, const char* rule) {
  if (!ok) throw config_error(field, to_text(value), rule);
}
}  // namespace detail

}  // namespace epmoe
