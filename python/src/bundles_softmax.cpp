// SPDX-FileCopyrightText: 2026 The epmoe authors
// SPDX-License-Identifier: Apache-2.0
// The menu's softmax top-k bundles (Mixtral, Qwen-MoE, OLMoE, Jamba, DBRX, Granite, JetMoE,
// Switch, GShard/NLLB): each K the open models use, and the strategy choices (capacity,
// schedule) for the most common one.
#include "bundle.hpp"

namespace epmoe::py {

namespace {
const std::vector<std::string> glu_tensors{"w1", "w3", "w2"};
const std::vector<std::string> mlp_tensors{"w1", "w2"};
const std::vector<std::string> mlp_bias_tensors{"w1", "w2", "b1", "b2"};
using capacity::dropless;
using capacity::factor;
using schedule::pipelined;
using schedule::sequential;
using swiglu = expert::swiglu;
using relu = expert::mlp<act::relu>;
using relu_bias = expert::mlp<act::relu, true>;
template <int K>
using softmax = router::topk_softmax<K, true>;
template <int K>
using softmax_raw = router::topk_softmax<K, false>;
}  // namespace

template <class R, class X, class C, class S>
void add(std::vector<bundle>& m, const char* router, const char* expert, const char* capacity,
         const char* schedule, const std::vector<std::string>& tensors) {
  m.push_back(entry<R, X, C, S>(router, expert, capacity, schedule, tensors));
}

void add_softmax_bundles(std::vector<bundle>& m) {
  add<softmax<2>, swiglu, dropless, sequential>(m, "softmax", "swiglu", "dropless", "sequential",
                                                glu_tensors);
#ifndef EPMOE_PYTHON_MENU_MIXTRAL  // EPMOE_PYTHON_MENU=mixtral: that entry only
  // The models' choices: swiglu, dropless, sequential.
  add<softmax<1>, swiglu, dropless, sequential>(m, "softmax", "swiglu", "dropless", "sequential",
                                                glu_tensors);
  add<softmax<4>, swiglu, dropless, sequential>(m, "softmax", "swiglu", "dropless", "sequential",
                                                glu_tensors);
  add<softmax<6>, swiglu, dropless, sequential>(m, "softmax", "swiglu", "dropless", "sequential",
                                                glu_tensors);  // Aria
  add<softmax<8>, swiglu, dropless, sequential>(m, "softmax", "swiglu", "dropless", "sequential",
                                                glu_tensors);
  add<softmax_raw<2>, swiglu, dropless, sequential>(m, "softmax_raw", "swiglu", "dropless",
                                                    "sequential", glu_tensors);
  add<softmax_raw<4>, swiglu, dropless, sequential>(m, "softmax_raw", "swiglu", "dropless",
                                                    "sequential", glu_tensors);
  add<softmax_raw<6>, swiglu, dropless, sequential>(m, "softmax_raw", "swiglu", "dropless",
                                                    "sequential", glu_tensors);
  add<softmax_raw<8>, swiglu, dropless, sequential>(m, "softmax_raw", "swiglu", "dropless",
                                                    "sequential", glu_tensors);
  // The strategies, on Mixtral's router: capacity and schedule.
  add<softmax<2>, swiglu, dropless, pipelined<>>(m, "softmax", "swiglu", "dropless", "pipelined",
                                                 glu_tensors);
  add<softmax<2>, swiglu, factor<false>, sequential>(m, "softmax", "swiglu", "factor", "sequential",
                                                     glu_tensors);
  add<softmax<2>, swiglu, factor<false>, pipelined<>>(m, "softmax", "swiglu", "factor", "pipelined",
                                                      glu_tensors);
  add<softmax<2>, swiglu, factor<true>, sequential>(m, "softmax", "swiglu", "padded", "sequential",
                                                    glu_tensors);
  add<softmax<2>, swiglu, factor<true>, pipelined<>>(m, "softmax", "swiglu", "padded", "pipelined",
                                                     glu_tensors);
  // Switch (top-1, ReLU MLP, capacity) and GShard / NLLB-MoE (top-2, MLP with biases).
  add<softmax_raw<1>, relu, dropless, sequential>(m, "softmax_raw", "mlp_relu", "dropless",
                                                  "sequential", mlp_tensors);
  add<softmax_raw<1>, relu, factor<false>, sequential>(m, "softmax_raw", "mlp_relu", "factor",
                                                       "sequential", mlp_tensors);
  add<softmax<2>, relu_bias, dropless, sequential>(m, "softmax", "mlp_relu_bias", "dropless",
                                                   "sequential", mlp_bias_tensors);
  add<softmax<2>, relu_bias, factor<false>, sequential>(m, "softmax", "mlp_relu_bias", "factor",
                                                        "sequential", mlp_bias_tensors);
#endif
}

}  // namespace epmoe::py
