// SPDX-FileCopyrightText: 2026 The epmoe authors
// SPDX-License-Identifier: Apache-2.0
// Must not compile: the router has top_k and uses_gate but no route_token, so moe_layer's
// router_policy static_assert fires ("router policy must ...").
#include <epmoe/moe_layer.hpp>

struct router_without_route {
  static constexpr int top_k = 2;
  static constexpr bool uses_gate = true;
};

struct bad_policies : epmoe::default_policies {
  using router = router_without_route;
};

int main() { return sizeof(epmoe::moe_layer<bad_policies>) > 0 ? 0 : 1; }
