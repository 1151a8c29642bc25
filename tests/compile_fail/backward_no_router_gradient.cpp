// SPDX-FileCopyrightText: 2026 The epmoe authors
// SPDX-License-Identifier: Apache-2.0
// Must not compile: reference::backward has no gradient for sparsemixer yet, and says so.
#include <epmoe/reference/backward.hpp>

int main() {
  using namespace epmoe;
  const layer_config cfg{.hidden = 4, .ffn = 2, .experts = 4, .top_k = 2, .max_tokens = 1};
  const auto w = reference::full_weights::random(cfg, 1);
  const float x[4] = {}, dy[4] = {};
  const index_t tokens[1] = {1};
  const auto g = reference::backward(w, router::sparsemixer{}, capacity::dropless{}, {x, 1, 4},
                                     tokens, {dy, 1, 4});
  return g.dx.empty() ? 1 : 0;
}
