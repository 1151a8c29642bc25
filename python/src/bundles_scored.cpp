// SPDX-FileCopyrightText: 2026 The epmoe authors
// SPDX-License-Identifier: Apache-2.0
// The menu's scored routers of transformers 5.23's families (router::biased, router::table):
// DeepSeek-V4 (sqrtsoftplus scores with a selection bias, or a token-id table; its clamped
// SwiGLU expert), ERNIE 4.5 and LongCat-Flash (softmax with a selection bias), Kolibri and
// the Llama 4 router (top-k of logits + bias, sigmoid weights). LFM2-MoE is sigmoid_bias.
#include "bundle.hpp"

namespace epmoe::py {

namespace {
const std::vector<std::string> glu_tensors{"w1", "w3", "w2"};
using capacity::dropless;
using schedule::sequential;

template <class R, class X>
void add(std::vector<bundle>& m, const char* router, const char* expert) {
  m.push_back(
      entry<R, X, dropless, sequential>(router, expert, "dropless", "sequential", glu_tensors));
}
}  // namespace

void add_scored_bundles(std::vector<bundle>& m) {
  using router::score::sigmoid;
  using router::score::softmax;
  using router::score::sqrtsoftplus;
  using dsv4 = expert::deepseek_v4;
  add<router::biased<2, sqrtsoftplus>, dsv4>(m, "sqrtsoftplus_bias", "deepseek_v4");
  add<router::biased<6, sqrtsoftplus>, dsv4>(m, "sqrtsoftplus_bias", "deepseek_v4");
  add<router::table<2, sqrtsoftplus>, dsv4>(m, "sqrtsoftplus_table", "deepseek_v4");
  add<router::table<6, sqrtsoftplus>, dsv4>(m, "sqrtsoftplus_table", "deepseek_v4");
  add<router::biased<2, softmax>, expert::swiglu>(m, "softmax_bias", "swiglu");
  add<router::biased<6, softmax>, expert::swiglu>(m, "softmax_bias", "swiglu");
  add<router::biased<2, sigmoid, router::select_on::logits>, expert::swiglu>(m, "logit_sigmoid",
                                                                             "swiglu");
  add<router::biased<6, sigmoid, router::select_on::logits>, expert::swiglu>(m, "logit_sigmoid",
                                                                             "swiglu");
}

}  // namespace epmoe::py
