// SPDX-FileCopyrightText: 2026 The epmoe authors
// SPDX-License-Identifier: Apache-2.0
// Must not compile: the layer cannot train through a router without backward_token
// (sparsemixer has none yet), and says so in one message.
#include <epmoe/epmoe.hpp>

struct policies : epmoe::default_policies {
  using router = epmoe::router::sparsemixer;
};

int main() {
  using namespace epmoe;
  const layer_config cfg{
      .hidden = 4, .ffn = 2, .experts = 4, .top_k = 2, .max_tokens = 1, .training = true};
  float gate[16] = {}, w[32] = {}, x[4] = {}, y[4] = {};
  moe_layer<policies> layer(cfg, comm::local{},
                            {{gate, 4, 4}, {{w, 4, 2, 4}, {w, 4, 2, 4}, {w, 4, 4, 2}}});
  layer.forward({x, 1, 4}, {y, 1, 4});
  float g[64] = {};
  layer.backward({x, 1, 4}, {y, 1, 4}, {{g, 4, 4}, {{g, 4, 2, 4}, {g, 4, 2, 4}, {g, 4, 4, 2}}});
  return 0;
}
