// SPDX-FileCopyrightText: 2026 The epmoe authors
// SPDX-License-Identifier: Apache-2.0
#pragma once

// Options of a policy bundle that are neither a policy nor a run-time value: declared in one
// struct, so a misspelt option fails to compile instead of being silently ignored:
//   struct my_policies : epmoe::default_policies {
//     static constexpr epmoe::layer_options options{.dedup = true};
//   };
namespace epmoe {

struct layer_options {
  /// Per-rank dedup: a token sends one row to each rank that holds any of its experts, and
  /// that rank returns one weighted sum (as DeepEP and Tutel do).
  bool dedup = false;
};

namespace detail {
/// The bundle's options (layer_options{} when it declares none).
template <class Policies>
constexpr layer_options options_of() {
  if constexpr (requires { Policies::options; })
    return Policies::options;
  else
    return {};
}
}  // namespace detail

}  // namespace epmoe
