// SPDX-FileCopyrightText: 2026 The epmoe authors
// SPDX-License-Identifier: Apache-2.0
// Must not compile: weighting::input (Llama 4's score-scaled input) with per-rank dedup, whose
// one row per (token, rank) cannot carry two scales (moe_layer's static_assert names it).
#include <epmoe/epmoe.hpp>

struct policies : epmoe::default_policies {
  using weighting = epmoe::weighting::input;
  static constexpr epmoe::layer_options options{.dedup = true};
};

int main() { return sizeof(epmoe::moe_layer<policies>) > 0 ? 0 : 1; }
