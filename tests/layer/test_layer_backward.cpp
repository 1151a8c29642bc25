// SPDX-FileCopyrightText: 2026 The epmoe authors
// SPDX-License-Identifier: Apache-2.0
// The layer's backward (fp32, in-process ranks) against reference::backward (float64, written
// apart from the layer): dx and every gradient, on 1, 2 and 4 ranks, with capacity drops,
// padded capacity, the pipelined schedule, receive rounds, replicas, shared experts with their
// gate, an output bias, MLP experts with biases, the routers that train, and the router losses.
// Every output starts as NaN, so a row or a gradient nobody wrote fails.
#include "backward_harness.hpp"

// A namespace per file: tests/cuda compiles several of these files in one unit.
namespace layer_backward_tests {

TEST_CASE("layer backward: dx and every gradient equal the reference on 1, 2 and 4 ranks",
          "[layer][backward]") {
  for (int ranks : {1, 2, 4}) {
    INFO("ranks " << ranks);
    check_step<train_policies<router::topk_softmax<2>>>(train_layer(ranks), {}, {}, 11 + ranks);
  }
  // Uneven tokens, one rank with none.
  check_step<train_policies<router::topk_softmax<2>>>(train_layer(2), {}, {0, 17}, 5);
  // config recompute: the hidden layers recomputed instead of kept, the same gradients.
  layer_config recompute = train_layer(2);
  recompute.recompute = true;
  check_step<train_policies<router::topk_softmax<2>>>(recompute);
  check_step<
      train_policies<router::topk_softmax<2>, capacity::dropless, expert::mlp<act::gelu, true>>>(
      recompute);
}

#ifndef EPMOE_TEST_SPACES_ONLY_GENERIC
namespace {
struct packed_train : train_policies<router::topk_softmax<2>> {
  static constexpr layer_options options{.pack_weights = true};
};
}  // namespace

TEST_CASE("layer backward: over packed expert weights, kept or recomputed hidden layers",
          "[layer][backward]") {
  check_step<packed_train>(train_layer(2), {}, {}, 21);
  layer_config recompute = train_layer(2);
  recompute.recompute = true;  // backward recomputes a and b from the packed copies
  check_step<packed_train>(recompute, {}, {}, 22);
}
#endif

TEST_CASE("layer backward: capacity drops get no gradient, padded capacity the same",
          "[layer][backward]") {
  layer_config cfg = train_layer(2);
  cfg.capacity_factor = 0.5;
  using drop = train_policies<router::topk_softmax<2>, capacity::factor<false>>;
  const auto w = reference::full_weights::random(cfg, 3);
  const auto g = test::make_tokens({24, 24}, cfg.hidden, 4);
  const auto dy = random_dy(g.total() * cfg.hidden, 5);
  const train_result got = train_step<drop>(cfg, w, g, dy);
  index_t dropped = 0;
  for (const pass_stats& s : got.forward_stats) dropped += s.dropped;
  CHECK(dropped > 0);
  check_against<expert::swiglu>(got, reference_step<drop>(cfg, w, g, dy, {}), cfg, true);
  check_step<train_policies<router::topk_softmax<2>, capacity::factor<true>>>(cfg);
  // With biases an expert's output on a padding row is not zero: its dy must be.
  check_step<train_policies<router::topk_softmax<2>, capacity::factor<true>,
                            expert::mlp<act::gelu, true>>>(cfg);
}

TEST_CASE("layer backward: pipelined chunks and receive rounds", "[layer][backward]") {
  layer_config cfg = train_layer(2);
  cfg.chunks = 3;
  check_step<train_policies<router::topk_softmax<2>, capacity::dropless, expert::swiglu,
                            schedule::pipelined<3>>>(cfg);
  layer_config rounds = train_layer(2);
  rounds.max_recv_rows = 12;
  check_step<train_policies<router::topk_softmax<2>>>(rounds);
  rounds.chunks = 2;
  check_step<train_policies<router::topk_softmax<2>, capacity::dropless, expert::swiglu,
                            schedule::pipelined<2>>>(rounds);
}

template <class Capacity = capacity::dropless, class Schedule = schedule::sequential>
struct dedup_policies
    : train_policies<router::topk_softmax<4>, Capacity, expert::swiglu, Schedule> {
  static constexpr layer_options options{.dedup = true};
};

TEST_CASE("layer backward: per-rank dedup, one dy row per (token, rank) and weights home",
          "[layer][backward]") {
  for (int ranks : {1, 2, 4}) {
    INFO("ranks " << ranks);
    check_step<dedup_policies<>>(train_layer(ranks, 4));
  }
  layer_config drops = train_layer(2, 4);
  drops.capacity_factor = 0.6;
  check_step<dedup_policies<capacity::factor<false>>>(drops);
  layer_config chunks = train_layer(2, 4);
  chunks.chunks = 2;
  check_step<dedup_policies<capacity::dropless, schedule::pipelined<2>>>(chunks);
  // A receive bound: windows of 3 tokens (pipelined: 3 units in flight), weights home per
  // window.
  chunks.max_recv_rows = 2 * 3 * 3;
  const auto bounded =
      check_step<dedup_policies<capacity::dropless, schedule::pipelined<2>>>(chunks);
  CHECK(bounded.backward_stats[0].rounds == 6);  // 16-token chunks
  CHECK(bounded.backward_stats[0].recv_buffer_rows <= 18);
}

template <class Capacity = capacity::dropless, class Schedule = schedule::sequential>
struct hierarchical_policies
    : train_policies<router::topk_softmax<4>, Capacity, expert::swiglu, Schedule> {
  static constexpr layer_options options{.hierarchical = true};
};

TEST_CASE("layer backward: hierarchical, dy crosses once per (token, node), dx sums in the node",
          "[layer][backward][hierarchical]") {
  int steps = 0;
  for (const auto& [ranks, per_node] : {std::pair{4, 2}, std::pair{4, 1}, std::pair{2, 2}}) {
    INFO("ranks " << ranks << " per node " << per_node);
    layer_config cfg = train_layer(ranks, 4);
    cfg.ranks_per_node = per_node;
    check_step<hierarchical_policies<>>(cfg);
    ++steps;
  }
  layer_config drops = train_layer(4, 4);
  drops.ranks_per_node = 2;
  drops.capacity_factor = 0.6;
  check_step<hierarchical_policies<capacity::factor<false>>>(drops);
  drops.capacity_factor = 1.0;
  drops.chunks = 2;
  check_step<hierarchical_policies<capacity::dropless, schedule::pipelined<2>>>(drops);
  // A receive bound: windows of 2 tokens per rank, each level's rows in their slots.
  drops.max_recv_rows = 4 * 3 * 2;
  const auto windows =
      check_step<hierarchical_policies<capacity::dropless, schedule::pipelined<2>>>(drops);
  CHECK(windows.forward_stats[1].rounds == 8);  // 16-token chunks in windows of 2
  CHECK(windows.backward_stats[1].rounds == 8);
  drops.capacity_factor = 0.6;
  drops.chunks = 1;
  drops.max_recv_rows = 4 * 5;
  const auto sequential = check_step<hierarchical_policies<capacity::factor<false>>>(drops);
  CHECK(sequential.forward_stats[3].rounds == 7);  // 32 tokens in windows of 5
  CHECK(sequential.forward_stats[3].peak_recv_rows <= 20);
  CHECK(steps == 3);
}

TEST_CASE("layer backward: a replicated expert's gradient is the sum over its copies",
          "[layer][backward]") {
  const layer_config cfg = train_layer(2, 2, 6);
  // 8 slots for 6 experts: expert 0 and expert 3 have a copy on each rank.
  using P = train_policies<router::topk_softmax<2>, capacity::dropless, expert::swiglu,
                           schedule::sequential, placement::table>;
  const placement::table t(6, 2, {0, 1, 2, 3, 0, 3, 4, 5});
  check_step<P>(cfg, {.placement = t});
  // reduce_gradients: every copy then holds its expert's whole gradient, every rank the
  // gate's and the shared experts' sums, bit-identical.
  layer_config shared = cfg;
  shared.shared_experts = 1;
  shared.shared_gate = true;
  shared.output_bias = true;
  check_step<P>(shared, {.placement = t, .reduce = true});
  using Q = train_policies<router::topk_softmax<2>, capacity::dropless, expert::swiglu,
                           schedule::sequential, placement::table>;
  const placement::table four(6, 4, {0, 1, 0, 2, 3, 0, 4, 5});
  check_step<Q>(train_layer(4, 2, 6), {.placement = four, .reduce = true});
}

TEST_CASE("layer backward: shared experts, their gate, the output bias, MLP experts",
          "[layer][backward]") {
  layer_config cfg = train_layer(2);
  cfg.shared_experts = 2;
  cfg.shared_ffn = 6;
  cfg.shared_gate = true;
  cfg.output_bias = true;
  check_step<train_policies<router::topk_softmax<2>>>(cfg);
  layer_config plain = train_layer(2);
  plain.shared_experts = 1;
  check_step<train_policies<router::topk_softmax<2>>>(plain);
  layer_config mlp = train_layer(2);
  mlp.shared_experts = 1;
  check_step<
      train_policies<router::topk_softmax<2>, capacity::dropless, expert::mlp<act::gelu, true>>>(
      mlp);
  check_step<
      train_policies<router::topk_softmax<2>, capacity::dropless, expert::mlp<act::relu, false>>>(
      train_layer(2));
}

TEST_CASE("layer backward: the routers that train", "[layer][backward]") {
  SECTION("softmax top-k without renormalisation, with scaling and groups") {
    router::topk_softmax<2, false> r;
    r.scaling = 2.5f;
    r.groups = 4;
    r.top_groups = 2;
    check_step<train_policies<router::topk_softmax<2, false>>>(train_layer(2), {.router = r});
  }
  SECTION("softmax top-k renormalised by a p-norm") {
    router::topk_softmax<4> r;
    r.norm_p = 2.f;
    check_step<train_policies<router::topk_softmax<4>>>(train_layer(2, 4), {.router = r});
  }
  SECTION("top-1") {
    check_step<train_policies<router::topk_softmax<1, false>>>(train_layer(4, 1));
  }
  SECTION("sigmoid with bias, groups and scaling; unnormalised") {
    std::vector<float> bias = {0.1f, -0.2f, 0.f, 0.3f, -0.1f, 0.05f, 0.f, 0.2f};
    router::sigmoid_bias<2> r;
    r.bias = bias.data();
    r.groups = 4;
    r.top_groups = 2;
    r.scaling = 2.5f;
    check_step<train_policies<router::sigmoid_bias<2>>>(train_layer(2), {.router = r});
    r.normalize = false;
    check_step<train_policies<router::sigmoid_bias<2>>>(train_layer(2), {.router = r});
  }
  SECTION("expert choice") { check_step<train_policies<router::expert_choice>>(train_layer(2)); }
  SECTION("sinkhorn, top-2 and top-1") {
    check_step<train_policies<router::sinkhorn<2>>>(train_layer(2));
    check_step<train_policies<router::sinkhorn<1>>>(train_layer(2, 1));
  }
  SECTION("noisy top-k: while training through both gates, else through the gate alone") {
    router::noisy_topk<2> r;
    r.training = true;
    r.seed = 5;
    check_step<train_policies<router::noisy_topk<2>>>(train_layer(2), {.router = r});
    r.training = false;
    check_step<train_policies<router::noisy_topk<2>>>(train_layer(2), {.router = r});
  }
  SECTION("input jitter: the gate saw x times the forward's noise") {
    router::jitter<router::topk_softmax<2>> r;
    r.training = true;
    r.eps = 0.2f;
    r.seed = 9;
    check_step<train_policies<router::jitter<router::topk_softmax<2>>>>(train_layer(2),
                                                                        {.router = r});
  }
  SECTION("hash: no gate, the experts still train") {
    std::vector<std::int64_t> ids(48);
    for (std::size_t i = 0; i < ids.size(); ++i) ids[i] = static_cast<std::int64_t>(i * 7 % 13);
    check_step<train_policies<router::hash<2>>>(train_layer(2), {.token_ids = ids});
  }
}

TEST_CASE("layer backward: the router losses' gradient flows into the gate and x",
          "[layer][backward]") {
  layer_config cfg = train_layer(2);
  cfg.seq_len = 8;
  cfg.aux_loss_coef = 0.1;
  check_step<train_policies<router::topk_softmax<2>>>(cfg, {.losses = {1.0, 0.5, 0.25}});
  check_step<train_policies<router::sigmoid_bias<2>>>(cfg, {.losses = {0.0, 2.0, 0.5}});
}

}  // namespace layer_backward_tests
