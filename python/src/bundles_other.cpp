// SPDX-FileCopyrightText: 2026 The epmoe authors
// SPDX-License-Identifier: Apache-2.0
// The menu's other routers: DeepSeek's sigmoid with bias, PhiMoE's SparseMixer (forward
// only), expert choice and Sinkhorn.
#include "bundle.hpp"

namespace epmoe::py {

namespace {
const std::vector<std::string> glu_tensors{"w1", "w3", "w2"};
using capacity::dropless;
using schedule::sequential;
using swiglu = expert::swiglu;

template <class R>
void add(std::vector<bundle>& m, const char* router) {
  m.push_back(entry<R, swiglu, dropless, sequential>(router, "swiglu", "dropless", "sequential",
                                                     glu_tensors));
}
}  // namespace

void add_other_bundles(std::vector<bundle>& m) {
  add<router::sigmoid_bias<2>>(m, "sigmoid_bias");
  add<router::sigmoid_bias<4>>(m, "sigmoid_bias");
  add<router::sigmoid_bias<8>>(m, "sigmoid_bias");
  add<router::sparsemixer>(m, "sparsemixer");
  add<router::sinkhorn<2>>(m, "sinkhorn");
}

}  // namespace epmoe::py
