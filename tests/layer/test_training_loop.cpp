// SPDX-FileCopyrightText: 2026 The epmoe authors
// SPDX-License-Identifier: Apache-2.0
// Training loops on one layer object (epmoe::testing::run_threads): N steps of forward ->
// backward -> reduce_gradients -> SGD -> repack -> update_router, each step's outputs, dx and
// every gradient against the float64 reference of the same step on the same updated weights,
// on 1, 2 and 4 thread ranks, over every policy that trains. Accumulation over micro-batches,
// the router losses at uneven shapes, packed weights through optimizer steps and consecutive
// passes of every exchange mode. (MPI: tests/mpi/test_mpi_loop.cpp.)
#include <catch2/catch.hpp>
#include <string>
#include <vector>

#include <epmoe/epmoe.hpp>
#include <epmoe/expert/mlp.hpp>
#include <epmoe/placement/table.hpp>
#include <epmoe/router/expert_choice.hpp>
#include <epmoe/router/hash.hpp>
#include <epmoe/router/jitter.hpp>
#include <epmoe/router/noisy_topk.hpp>
#include <epmoe/router/sigmoid_bias.hpp>
#include <epmoe/router/sinkhorn.hpp>
#include <epmoe/schedule/pipelined.hpp>
#include <epmoe/testing/training_loop.hpp>

using namespace epmoe;

namespace {

template <class Router, class Capacity = capacity::dropless, class Expert = expert::swiglu,
          class Schedule = schedule::sequential, class Placement = placement::block,
          layer_options Options = layer_options{}, class Space = space::host>
struct loop_policies : default_policies {
  using space = Space;
  using comm = epmoe::comm::threads;
  using router = Router;
  using capacity = Capacity;
  using expert = Expert;
  using schedule = Schedule;
  using placement = Placement;
  static constexpr layer_options options = Options;
};
using softmax2 = loop_policies<router::topk_softmax<2>>;

layer_config loop_layer(int ranks, int top_k = 2, int experts = 8) {
  return {.hidden = 12,
          .ffn = 10,
          .experts = experts,
          .top_k = top_k,
          .ranks = ranks,
          .max_tokens = 32,
          .capacity_factor = 1.0};
}

// Steps of `tokens` per rank each (the same counts every step unless given).
std::vector<testing::loop_step> steps(int n, std::vector<index_t> tokens = {}) {
  return std::vector<testing::loop_step>(static_cast<std::size_t>(n), {.tokens = tokens});
}

// Runs the loop; every row within its tolerance, and at least `rows` rows (it ran).
template <class P>
testing::loop_report check_loop(const layer_config& cfg, testing::loop_options<P> opt = {}) {
  const testing::loop_report rep = testing::run_threads<P>(cfg, opt);
  INFO(rep.text());
  CHECK(rep.failures().empty());
  // y at least, per step and rank (a trained step adds dx, the copies and the gradients).
  CHECK(rep.rows.size() >= opt.steps.size() * static_cast<std::size_t>(cfg.ranks));
  return rep;
}

int rows_named(const testing::loop_report& rep, const std::string& what) {
  int n = 0;
  for (const auto& r : rep.rows) n += r.what == what;
  return n;
}

}  // namespace

TEST_CASE("training loop: four steps on one layer equal the reference's, on 1, 2 and 4 ranks",
          "[loop]") {
  for (int ranks : {1, 2, 4}) {
    INFO("ranks " << ranks);
    const auto rep = check_loop<softmax2>(loop_layer(ranks), {.steps = steps(4)});
    CHECK(rows_named(rep, "dw1") == 4 * ranks);
  }
  // Uneven tokens that change from step to step, a rank with none.
  check_loop<softmax2>(
      loop_layer(2),
      {.steps = {
           {.tokens = {0, 17}}, {.tokens = {9, 30}}, {.tokens = {32, 0}}, {.tokens = {5, 5}}}});
}

TEST_CASE("training loop: shared experts, their gate, the output bias, MLP experts, recompute",
          "[loop]") {
  layer_config cfg = loop_layer(2);
  cfg.shared_experts = 2;
  cfg.shared_ffn = 6;
  cfg.shared_gate = true;
  cfg.output_bias = true;
  const auto rep = check_loop<softmax2>(cfg, {.steps = steps(4)});
  CHECK(rows_named(rep, "doutput_bias") == 8);
  CHECK(rows_named(rep, "dshared_gate") == 8);
  cfg.recompute = true;
  check_loop<
      loop_policies<router::topk_softmax<2>, capacity::dropless, expert::mlp<act::gelu, true>>>(
      cfg, {.steps = steps(4)});
}

TEST_CASE("training loop: every router that trains", "[loop]") {
  SECTION("softmax without renormalisation, scaling and groups; a p-norm") {
    router::topk_softmax<2, false> r;
    r.scaling = 2.5f;
    r.groups = 4;
    r.top_groups = 2;
    check_loop<loop_policies<router::topk_softmax<2, false>>>(loop_layer(2), {.router = r});
    router::topk_softmax<4> p;
    p.norm_p = 2.f;
    check_loop<loop_policies<router::topk_softmax<4>>>(loop_layer(2, 4), {.router = p});
  }
  SECTION("sigmoid with bias and groups: update_router moves the bias each step") {
    std::vector<float> bias = {0.1f, -0.2f, 0.f, 0.3f, -0.1f, 0.05f, 0.f, 0.2f};
    router::sigmoid_bias<2> r;
    r.bias = bias.data();
    r.groups = 4;
    r.top_groups = 2;
    r.gamma = 0.05f;
    for (int ranks : {1, 2, 4}) {
      const auto rep =
          check_loop<loop_policies<router::sigmoid_bias<2>>>(loop_layer(ranks), {.router = r});
      CHECK(rows_named(rep, "router bias") == 4 * ranks);
    }
  }
  SECTION("noisy top-k while training: each step's own noise, both gates train") {
    router::noisy_topk<2> r;
    r.training = true;
    r.seed = 5;
    const auto rep = check_loop<loop_policies<router::noisy_topk<2>>>(loop_layer(2), {.router = r});
    CHECK(rows_named(rep, "dnoise_gate") == 8);
  }
  SECTION("input jitter") {
    router::jitter<router::topk_softmax<2>> j;
    j.training = true;
    j.eps = 0.2f;
    j.seed = 9;
    check_loop<loop_policies<router::jitter<router::topk_softmax<2>>>>(loop_layer(2),
                                                                       {.router = j});
  }
  SECTION("expert choice, sinkhorn, hash") {
    check_loop<loop_policies<router::expert_choice>>(loop_layer(2));
    check_loop<loop_policies<router::sinkhorn<2>>>(loop_layer(2));
    check_loop<loop_policies<router::hash<2>>>(loop_layer(2));
  }
}

TEST_CASE("training loop: drops, replicas, dedup, hierarchical, receive bounds, pipelined",
          "[loop]") {
  layer_config drops = loop_layer(2);
  drops.capacity_factor = 0.5;
  check_loop<loop_policies<router::topk_softmax<2>, capacity::factor<false>>>(drops);
  check_loop<loop_policies<router::topk_softmax<2>, capacity::factor<true>>>(drops);
  // Replicas: expert 0 and 3 on both ranks; after each step every copy agrees.
  using table = loop_policies<router::topk_softmax<2>, capacity::dropless, expert::swiglu,
                              schedule::sequential, placement::table>;
  check_loop<table>(loop_layer(2, 2, 6),
                    {.placement = placement::table(6, 2, {0, 1, 2, 3, 0, 3, 4, 5})});
  check_loop<table>(loop_layer(4, 2, 6),
                    {.placement = placement::table(6, 4, {0, 1, 0, 2, 3, 0, 4, 5})});
  // Dedup, hierarchical (2 nodes of 2), each with and without a receive bound, pipelined.
  using dedup = loop_policies<router::topk_softmax<4>, capacity::dropless, expert::swiglu,
                              schedule::pipelined<2>, placement::block, {.dedup = true}>;
  using hier = loop_policies<router::topk_softmax<4>, capacity::dropless, expert::swiglu,
                             schedule::pipelined<2>, placement::block, {.hierarchical = true}>;
  layer_config four = loop_layer(4, 4);
  four.ranks_per_node = 2;
  const std::vector<testing::loop_step> uneven = {
      {.tokens = {7, 0, 32, 12}}, {.tokens = {32, 32, 1, 9}}, {.tokens = {3, 20, 11, 0}}};
  check_loop<dedup>(four, {.steps = uneven});
  check_loop<hier>(four, {.steps = uneven});
  four.max_recv_rows = 4 * 3 * 2;
  check_loop<dedup>(four, {.steps = uneven});
  check_loop<hier>(four, {.steps = uneven});
  layer_config rounds = loop_layer(2);
  rounds.max_recv_rows = 12;
  check_loop<loop_policies<router::topk_softmax<2>, capacity::dropless, expert::swiglu,
                           schedule::pipelined<3>>>(rounds, {.steps = steps(3, {5, 29})});
  using det = loop_policies<router::topk_softmax<2>, capacity::dropless, expert::swiglu,
                            schedule::pipelined<2>, placement::block, {.deterministic = true}>;
  check_loop<det>(loop_layer(2));
}

TEST_CASE("training loop: micro-batches accumulate into one backward of their concatenation",
          "[loop][accumulate]") {
  layer_config cfg = loop_layer(1);
  cfg.shared_experts = 1;
  cfg.shared_ffn = 6;
  cfg.shared_gate = true;
  cfg.output_bias = true;
  for (int ranks : {1, 2, 4}) {
    INFO("ranks " << ranks);
    cfg.ranks = ranks;
    // Three micro-batches accumulated (gradients zeroed first); then one that overwrites; then
    // two where the first overwrites and the second accumulates.
    const std::vector<testing::loop_step> s = {
        {.tokens = std::vector<index_t>(ranks, 30), .micro_batches = 3, .accumulate = true},
        {.tokens = std::vector<index_t>(ranks, 11)},
        {.tokens = std::vector<index_t>(ranks, 20), .micro_batches = 2},
        {.tokens = std::vector<index_t>(ranks, 9), .micro_batches = 3, .accumulate = true}};
    check_loop<softmax2>(cfg, {.steps = s, .one_batch_reference = true});
  }
}

TEST_CASE("training loop: router losses at uneven shapes", "[loop][losses]") {
  layer_config cfg = loop_layer(4);
  cfg.seq_len = 8;
  cfg.aux_loss_coef = 0.1;
  // T not a multiple of seq_len, a rank with T = 0, ranks with different T.
  const std::vector<testing::loop_step> s = {
      {.tokens = {13, 0, 21, 8}}, {.tokens = {0, 0, 5, 31}}, {.tokens = {17, 17, 17, 17}}};
  check_loop<softmax2>(cfg, {.losses = {1.0, 0.5, 0.25}, .steps = s});
  check_loop<loop_policies<router::sigmoid_bias<2>>>(cfg, {.losses = {0.0, 2.0, 0.5}, .steps = s});
  // With micro-batches: each pass's losses, summed.
  check_loop<softmax2>(
      cfg, {.losses = {1.0, 0.5, 0.25}, .steps = {{.tokens = {13, 0, 21, 8}, .micro_batches = 2}}});
}

namespace {
// The packed layer on a path that computes in fp32 from bf16 weights (AVX512-BF16 rounds the
// inputs too, which would hide a pass that read the fp32 copies).
using space::cpu_path;
struct no_bf16_dots : space::host {
  no_bf16_dots() {
    set_cpu_path(space::cpu_runs(cpu_path::avx512) ? cpu_path::avx512 : cpu_path::portable);
  }
};
using packed =
    loop_policies<router::topk_softmax<2>, capacity::dropless, expert::swiglu, schedule::sequential,
                  placement::block, {.pack_weights = true}, no_bf16_dots>;
}  // namespace

TEST_CASE("training loop: packed weights repacked after every step, precision switched",
          "[loop][packed]") {
  layer_config cfg = loop_layer(2);
  cfg.shared_experts = 1;
  constexpr auto bf16 = packed_precision::bf16, fp32 = packed_precision::fp32;
  const auto rep =
      check_loop<packed>(cfg, {.steps = {{}, {.pack = bf16}, {}, {.pack = fp32}, {.pack = bf16}}});
  CHECK(rows_named(rep, "dw1") == 10);
  cfg.recompute = true;  // backward recomputes from the packed copies
  check_loop<packed>(cfg, {.steps = {{.pack = bf16}, {}, {.pack = fp32}}});
}

TEST_CASE("training loop: consecutive passes of every exchange mode, forward only and trained",
          "[loop][passes]") {
  using dedup = loop_policies<router::topk_softmax<4>, capacity::factor<false>, expert::swiglu,
                              schedule::sequential, placement::block, {.dedup = true}>;
  using hier = loop_policies<router::topk_softmax<4>, capacity::factor<false>, expert::swiglu,
                             schedule::pipelined<2>, placement::block, {.hierarchical = true}>;
  layer_config cfg = loop_layer(4, 4);
  cfg.ranks_per_node = 2;
  cfg.capacity_factor = 0.8;
  const std::vector<testing::loop_step> forward_only = {
      {.tokens = {32, 1, 0, 17}, .backward = false},
      {.tokens = {2, 32, 9, 0}, .backward = false},
      {.tokens = {11, 11, 32, 5}, .backward = false}};
  const std::vector<testing::loop_step> trained = {
      {.tokens = {32, 1, 0, 17}}, {.tokens = {2, 32, 9, 0}}, {.tokens = {11, 11, 32, 5}}};
  for (int bound : {0, 4 * 3 * 2}) {
    INFO("max_recv_rows " << bound);
    cfg.max_recv_rows = bound;
    check_loop<dedup>(cfg, {.steps = forward_only});
    check_loop<hier>(cfg, {.steps = forward_only});
    check_loop<dedup>(cfg, {.steps = trained});
    check_loop<hier>(cfg, {.steps = trained});
    check_loop<loop_policies<router::topk_softmax<4>, capacity::factor<false>>>(cfg,
                                                                                {.steps = trained});
  }
}
