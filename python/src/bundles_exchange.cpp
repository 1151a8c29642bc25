// SPDX-FileCopyrightText: 2026 The epmoe authors
// SPDX-License-Identifier: Apache-2.0
// The menu's exchanges other than flat: per-rank dedup (a token sends one row per rank), the
// hierarchical exchange (one row per node across the network, fanned out inside it), on
// Mixtral's router and DeepSeek's node-limited sigmoid router, and the low-latency exchange
// (fixed slots, one all-to-all per direction: decode) on Mixtral's.
#include "bundle.hpp"

namespace epmoe::py {

namespace {
const std::vector<std::string> glu_tensors{"w1", "w3", "w2"};
using capacity::dropless;
using schedule::pipelined;
using schedule::sequential;
using swiglu = expert::swiglu;
constexpr auto dedup = exchange_kind::dedup;
constexpr auto hierarchical = exchange_kind::hierarchical;
constexpr auto low_latency = exchange_kind::low_latency;

template <class R, class S, exchange_kind X>
void add(std::vector<bundle>& m, const char* router, const char* schedule) {
  m.push_back(
      entry<R, swiglu, dropless, S, X>(router, "swiglu", "dropless", schedule, glu_tensors));
}
}  // namespace

void add_exchange_bundles(std::vector<bundle>& m) {
  add<router::topk_softmax<2, true>, sequential, dedup>(m, "softmax", "sequential");
  add<router::topk_softmax<2, true>, sequential, hierarchical>(m, "softmax", "sequential");
  add<router::topk_softmax<2, true>, pipelined<>, hierarchical>(m, "softmax", "pipelined");
  add<router::sigmoid_bias<4>, sequential, hierarchical>(m, "sigmoid_bias", "sequential");
  add<router::sigmoid_bias<8>, sequential, hierarchical>(m, "sigmoid_bias", "sequential");
  // Decode (issue 38): fixed slots, one all-to-all per direction; inference only.
  add<router::topk_softmax<2, true>, sequential, low_latency>(m, "softmax", "sequential");
}

}  // namespace epmoe::py
