// SPDX-FileCopyrightText: 2026 The epmoe authors
// SPDX-License-Identifier: Apache-2.0
// Training loops on MPI processes (1 to 4): epmoe::testing::run_rank on MPI_COMM_WORLD, every
// process checking its own rows, dx, reduced gradients and copies, step by step (the thread
// ranks' loops: tests/layer/test_training_loop.cpp).
#include <catch2/catch.hpp>
#include <vector>

#include "world.hpp"
#include <epmoe/comm/mpi.hpp>
#include <epmoe/placement/table.hpp>
#include <epmoe/router/sigmoid_bias.hpp>
#include <epmoe/schedule/pipelined.hpp>
#include <epmoe/testing/training_loop.hpp>

// A namespace per file: test_mpi compiles its files as one unit.
namespace mpi_loop_tests {
using namespace epmoe;

namespace {

template <class Router, layer_options Options = layer_options{},
          class Schedule = schedule::sequential, class Placement = placement::block>
struct mpi_loop : default_policies {
  using router = Router;
  using comm = epmoe::comm::mpi;
  using schedule = Schedule;
  using placement = Placement;
  static constexpr layer_options options = Options;
};

template <class P>
void check_loop(layer_config cfg, testing::loop_options<P> opt = {}) {
  const int R = test::world_size(), me = test::world_rank();
  cfg.ranks = R;
  for (auto& s : opt.steps)  // uneven, one rank with none on the second step
    for (int r = 0; r < R; ++r) s.tokens.push_back(s.micro_batches > 1 ? 24 : (5 + 9 * r) % 33);
  opt.steps[1].tokens[0] = 0;
  const testing::loop_report rep =
      testing::run_rank<P>([] { return comm::mpi(MPI_COMM_WORLD); }, cfg, opt);
  INFO("rank " << me << " of " << R << ": " << rep.text());
  CHECK(rep.failures().empty());
  CHECK(rep.rows.size() >= opt.steps.size() * 4);
}

layer_config mpi_layer() {
  layer_config c{.hidden = 12, .ffn = 10, .experts = 12, .top_k = 2, .max_tokens = 32};
  c.shared_experts = 1;
  c.shared_ffn = 6;
  c.shared_gate = true;
  c.output_bias = true;
  return c;
}

}  // namespace

TEST_CASE("mpi loop: steps on one layer equal the reference's, every process", "[mpi][loop]") {
  check_loop<mpi_loop<router::topk_softmax<2>>>(mpi_layer());
  check_loop<mpi_loop<router::topk_softmax<2>, {.dedup = true}, schedule::pipelined<2>>>(
      mpi_layer());
  // Accumulation over micro-batches, then steps that overwrite.
  check_loop<mpi_loop<router::topk_softmax<2>>>(
      mpi_layer(), {.steps = {{.micro_batches = 3, .accumulate = true}, {}, {.micro_batches = 2}},
                    .one_batch_reference = true});
  // A biased router, update_router each step; receive rounds.
  std::vector<float> bias(12, 0.f);
  router::sigmoid_bias<2> r;
  r.bias = bias.data();
  r.gamma = 0.05f;
  layer_config bounded = mpi_layer();
  bounded.max_recv_rows = 12;
  check_loop<mpi_loop<router::sigmoid_bias<2>>>(bounded, {.router = r});
  // Replicas: expert 0 on every rank; every copy agrees after each step.
  const int R = test::world_size();
  std::vector<int> phy;
  for (int q = 0; q < R; ++q) {
    for (int j = 0; j < 12 / R; ++j) phy.push_back(q * (12 / R) + j);
    phy.push_back(0);
  }
  check_loop<
      mpi_loop<router::topk_softmax<2>, layer_options{}, schedule::sequential, placement::table>>(
      mpi_layer(), {.placement = placement::table(12, R, phy)});
}

}  // namespace mpi_loop_tests
