// SPDX-FileCopyrightText: 2026 The epmoe authors
// SPDX-License-Identifier: Apache-2.0
#include <catch2/catch.hpp>
#include <limits>
#include <type_traits>
#include <vector>

#include "../layer/harness.hpp"
#include "world.hpp"
#include <epmoe/comm/mpi.hpp>
#include <epmoe/placement/round_robin.hpp>
#include <epmoe/placement/table.hpp>
#include <epmoe/schedule/pipelined.hpp>

using namespace epmoe;

namespace {

struct mpi_policies : default_policies {
  using router = epmoe::router::topk_softmax<2>;
  using comm = epmoe::comm::mpi;
};

struct mpi_dedup_policies : mpi_policies {
  static constexpr epmoe::layer_options options{.dedup = true};
};

struct mpi_pipelined_policies : mpi_policies {
  using schedule = epmoe::schedule::pipelined<3>;
};

struct mpi_pipelined_dedup_policies : mpi_pipelined_policies {
  static constexpr epmoe::layer_options options{.dedup = true};
};

struct mpi_round_robin_policies : mpi_policies {
  using placement = epmoe::placement::round_robin;
};

struct mpi_table_policies : mpi_policies {
  using placement = epmoe::placement::table;
};

using test::world_rank;
using test::world_size;

// Every rank's output rows, gathered in global token order on rank 0 (empty elsewhere).
std::vector<float> gather(const std::vector<float>& mine, const test::global_tokens& g, index_t H) {
  const int R = world_size(), me = world_rank();
  std::vector<int> counts(R), displs(R);
  for (int r = 0; r < R; ++r) {
    counts[r] = static_cast<int>(g.per_rank[r] * H);
    displs[r] = static_cast<int>(g.offset(r) * H);
  }
  std::vector<float> all(me == 0 ? g.x.size() : 0);
  MPI_Gatherv(mine.data(), counts[me], MPI_FLOAT, all.data(), counts.data(), displs.data(),
              MPI_FLOAT, 0, MPI_COMM_WORLD);
  return all;
}

// The placement a test runs with: the policy's default, except tables, which replicate the
// first R experts once more (one extra slot per rank).
template <class Placement>
Placement make_placement(const layer_config& cfg) {
  if constexpr (std::is_same_v<Placement, placement::table>) {
    std::vector<int> phy;
    const int L = cfg.experts / cfg.ranks;
    for (int r = 0; r < cfg.ranks; ++r) {
      for (int j = 0; j < L; ++j) phy.push_back(r * L + j);
      phy.push_back((r + 1) % cfg.ranks);  // a copy of a hot expert from the next rank
    }
    return placement::table(cfg.experts, cfg.ranks, phy);
  } else {
    return Placement(cfg);
  }
}

// Runs moe_layer on the MPI ranks, one pass per token set (rank r takes its slice of each),
// and checks on rank 0 that every pass equals comm::threads on the same global tokens and
// the reference. Returns this rank's stats of the last pass.
template <class P = mpi_policies>
pass_stats check_layer(const layer_config& cfg, const reference::full_weights& w,
                       const std::vector<test::global_tokens>& passes) {
  const int me = world_rank();
  const index_t H = cfg.hidden;
  const typename P::placement where = make_placement<typename P::placement>(cfg);
  const auto mine = reference::slice(w, where, me);
  moe_layer<P> layer(cfg, comm::mpi(MPI_COMM_WORLD), {w.gate_view(), mine.experts()}, {}, {},
                     where);
  for (std::size_t p = 0; p < passes.size(); ++p) {
    const test::global_tokens& g = passes[p];
    const index_t T = g.per_rank[me];
    std::vector<float> y(T * H, std::numeric_limits<float>::quiet_NaN());  // unwritten fails
    layer.forward({g.x.data() + g.offset(me) * H, T, H}, {y.data(), T, H});
    const std::vector<float> all = gather(y, g, H);
    if (me != 0) continue;
    INFO("pass " << p << " on " << cfg.ranks << " MPI ranks");
    const auto threads = test::run_layer<test::threads_policies<2>>(cfg, w, g).y;
    const auto want = test::run_reference<P>(cfg, w, g);
    CHECK(test::relative_error(all, threads) <= 1e-6);
    CHECK(test::relative_error(all, want) <= 1e-5);
  }
  return layer.stats();
}

// A gate that makes routing chosen by hand (see tests/layer/test_layer_invariants.cpp):
// gate row e = unit vector e, and a token with 2 at a, 1 at b, 0 elsewhere picks (a, b).
reference::full_weights hand_gate(const layer_config& cfg, std::uint64_t seed) {
  auto w = reference::full_weights::random(cfg, seed);
  std::fill(w.gate.begin(), w.gate.end(), 0.f);
  for (int e = 0; e < cfg.experts; ++e) w.gate[e * cfg.hidden + e] = 1.f;
  return w;
}

}  // namespace

TEST_CASE("mpi layer: equals comm::threads and the reference, uneven and empty ranks",
          "[mpi][layer]") {
  const int R = world_size();
  const layer_config cfg{
      .hidden = 16, .ffn = 24, .experts = 12, .top_k = 2, .ranks = R, .max_tokens = 40};
  const auto w = reference::full_weights::random(cfg, 61);
  // Pass 0: rank 1 has no tokens; pass 1: rank 0 has none (on 1 rank: a pass of 0 tokens).
  std::vector<index_t> first(R), second(R);
  for (int r = 0; r < R; ++r) {
    first[r] = r == 1 ? 0 : 17 + 7 * r;
    second[r] = r == 0 ? 0 : 40 - 5 * r;
  }
  const auto stats = check_layer(
      cfg, w,
      {test::make_tokens(first, cfg.hidden, 62), test::make_tokens(second, cfg.hidden, 63)});
  CHECK(stats.tokens == second[world_rank()]);
}

TEST_CASE("mpi layer: a rank whose experts no token picks receives nothing", "[mpi][layer]") {
  const int R = world_size(), me = world_rank();
  const layer_config cfg{
      .hidden = 16, .ffn = 12, .experts = 12, .top_k = 2, .ranks = R, .max_tokens = 24};
  const auto w = hand_gate(cfg, 71);
  // Tokens pick only among the experts of ranks 0..R-2 (all experts on 1 rank).
  const int picked = R == 1 ? cfg.experts : (R - 1) * cfg.experts_per_rank();
  std::vector<index_t> per_rank(R);
  for (int r = 0; r < R; ++r) per_rank[r] = 10 + 3 * r;
  test::global_tokens g{per_rank, {}};
  g.x.assign(g.total() * cfg.hidden, 0.f);
  for (index_t t = 0; t < g.total(); ++t) {
    const int a = static_cast<int>(t % picked), b = static_cast<int>((t * 5 + 1) % picked);
    g.x[t * cfg.hidden + a] = 2.f;
    g.x[t * cfg.hidden + (b == a ? (a + 1) % picked : b)] = 1.f;
  }
  const pass_stats s = check_layer(cfg, w, {g});
  if (R > 1 && me == R - 1) {
    index_t received = 0, computed = 0;
    for (index_t n : s.rows_received) received += n;
    for (index_t n : s.rows_per_local_expert) computed += n;
    CHECK(received == 0);
    CHECK(computed == 0);
    CHECK(s.dispatch_bytes_received == 0);
  }
}

TEST_CASE("mpi layer: per-rank dedup gives the same outputs with fewer rows", "[mpi][layer]") {
  const int R = world_size(), me = world_rank();
  const layer_config cfg{
      .hidden = 16, .ffn = 12, .experts = 4 * R, .top_k = 2, .ranks = R, .max_tokens = 30};
  const auto w = reference::full_weights::random(cfg, 81);
  std::vector<index_t> per_rank(R, 30);
  per_rank[0] = 11;
  const auto g = test::make_tokens(per_rank, cfg.hidden, 82);
  const pass_stats s = check_layer<mpi_dedup_policies>(cfg, w, {g});
  index_t unique = 0, assignments = 0;
  for (int r = 0; r < R; ++r) {
    unique += s.rows_sent[r];
    assignments += s.assignment_rows_sent[r];
  }
  CHECK(assignments == per_rank[me] * cfg.top_k);
  CHECK(unique <= assignments);
}

TEST_CASE("mpi layer: a rank with a different config makes every rank throw, no hang",
          "[mpi][layer]") {
  const int R = world_size(), me = world_rank();
  layer_config cfg{
      .hidden = 8, .ffn = 6, .experts = 2 * R, .top_k = 2, .ranks = R, .max_tokens = 16};
  const auto w = reference::full_weights::random(cfg, 91);
  if (me == R - 1) cfg.max_tokens = 17;  // one rank differs (on 1 rank nothing differs)
  const auto mine = reference::slice(w, placement::block(cfg), me);
  if (R == 1) {
    CHECK_NOTHROW(
        moe_layer<mpi_policies>(cfg, comm::mpi(MPI_COMM_WORLD), {w.gate_view(), mine.experts()}));
    return;
  }
  try {
    moe_layer<mpi_policies> layer(cfg, comm::mpi(MPI_COMM_WORLD), {w.gate_view(), mine.experts()});
    FAIL("rank " << me << " accepted a config another rank does not share");
  } catch (const config_error& e) {
    CHECK(e.field() == "max_tokens");
  }
}

TEST_CASE("mpi layer: round-robin and replicated placements give the same outputs",
          "[mpi][layer][placement]") {
  const int R = world_size();
  const layer_config cfg{
      .hidden = 16, .ffn = 12, .experts = 2 * R, .top_k = 2, .ranks = R, .max_tokens = 30};
  const auto w = reference::full_weights::random(cfg, 95);
  std::vector<index_t> per_rank(R, 30);
  per_rank[0] = 9;
  const auto g = test::make_tokens(per_rank, cfg.hidden, 96);
  check_layer<mpi_round_robin_policies>(cfg, w, {g});
  check_layer<mpi_table_policies>(cfg, w, {g});
}

TEST_CASE("mpi layer: the pipelined schedule (MPI_Ialltoallv) gives the same outputs",
          "[mpi][layer][pipelined]") {
  const int R = world_size();
  for (int C : {1, 3, 7}) {
    const layer_config cfg{.hidden = 16,
                           .ffn = 12,
                           .experts = 2 * R,
                           .top_k = 2,
                           .ranks = R,
                           .max_tokens = 30,
                           .chunks = C};
    const auto w = reference::full_weights::random(cfg, 97 + C);
    std::vector<index_t> per_rank(R, 30);
    per_rank[R - 1] = 2;  // fewer tokens than chunks: empty chunks
    const auto g = test::make_tokens(per_rank, cfg.hidden, 98);
    const pass_stats s = check_layer<mpi_pipelined_policies>(cfg, w, {g});
    CHECK(s.chunks == C);
    CHECK(s.timeline.size() == static_cast<std::size_t>(3 * C));
    check_layer<mpi_pipelined_dedup_policies>(cfg, w, {g});
  }
}
