// SPDX-FileCopyrightText: 2026 The epmoe authors
// SPDX-License-Identifier: Apache-2.0
// The menu's LongCat-Flash and Llama 4 bundles, whose blocks need more than a router. Llama 4:
// top-K of the logits, each weight σ(logit) scaling the expert's input (weighting::input; the
// flat exchange). LongCat-Flash: softmax over E + Z with zero experts (config zero_experts),
// selection on p + bias, scaled; flat and dedup.
#include "bundle.hpp"

namespace epmoe::py {

namespace {
const std::vector<std::string> glu_tensors{"w1", "w3", "w2"};
using capacity::dropless;
using schedule::sequential;
template <int K>
void add_llama4(std::vector<bundle>& m) {
  m.push_back(entry<router::llama4<K>, expert::swiglu, dropless, sequential, exchange_kind::flat,
                    weighting::input>("llama4", "swiglu", "dropless", "sequential", glu_tensors));
}
template <int K, exchange_kind X = exchange_kind::flat>
void add_longcat(std::vector<bundle>& m) {
  m.push_back(entry<router::longcat_flash<K>, expert::swiglu, dropless, sequential, X>(
      "longcat_flash", "swiglu", "dropless", "sequential", glu_tensors));
}
}  // namespace

void add_longcat_llama4_bundles(std::vector<bundle>& m) {
  add_llama4<1>(m);  // Llama 4 Scout and Maverick
  add_llama4<2>(m);
  add_longcat<2>(m);
  add_longcat<2, exchange_kind::dedup>(m);
  add_longcat<12>(m);  // LongCat-Flash: 12 of 512 + 256 zero experts
}

}  // namespace epmoe::py
