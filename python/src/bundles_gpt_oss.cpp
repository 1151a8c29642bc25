// SPDX-FileCopyrightText: 2026 The epmoe authors
// SPDX-License-Identifier: Apache-2.0
// The menu's GPT-OSS bundles: router::gpt_oss (a bias on the logits, softmax over the top K)
// and its clamped SwiGLU expert with biases (alpha 1.702, limit 7, the +1 on up).
#include "bundle.hpp"

namespace epmoe::py {

namespace {
const std::vector<std::string> gpt_oss_tensors{"w1", "w3", "w2", "b1", "b3", "b2"};
template <int K>
void add(std::vector<bundle>& m) {
  m.push_back(entry<router::gpt_oss<K>, expert::gpt_oss, capacity::dropless, schedule::sequential>(
      "gpt_oss", "gpt_oss", "dropless", "sequential", gpt_oss_tensors));
}
}  // namespace

void add_gpt_oss_bundles(std::vector<bundle>& m) {
  add<2>(m);
  add<4>(m);  // gpt-oss-20b and -120b
}

}  // namespace epmoe::py
