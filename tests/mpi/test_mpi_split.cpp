// SPDX-FileCopyrightText: 2026 The epmoe authors
// SPDX-License-Identifier: Apache-2.0
#include <catch2/catch.hpp>
#include <limits>
#include <string>
#include <vector>

#include "../layer/harness.hpp"
#include "world.hpp"
#include <epmoe/comm/mpi.hpp>
#include <epmoe/split_layer.hpp>

// Split phase on MPI processes (docs/decode.md): each lane of a split_layer has its own
// communicator (comm::mpi dups MPI_COMM_WORLD), its dispatch posted by MPI_Ialltoallv in
// start; two micro-batches in flight equal plain passes bit for bit (options.deterministic).
// A namespace per file: test_mpi compiles its files as one unit.
namespace mpi_split_tests {
using namespace epmoe;

namespace {

template <bool Dedup>
struct policies : default_policies {
  using comm = epmoe::comm::mpi;
  static constexpr layer_options options{.dedup = Dedup, .deterministic = true};
};

constexpr float nan = std::numeric_limits<float>::quiet_NaN();

// Rank r's tokens in micro-batch m (rank 1 has none in batch 2).
index_t tokens_of(int m, int r) { return m == 2 && r == 1 ? 0 : 1 + (3 * m + 5 * r) % 16; }

template <bool Dedup>
void split_equals_plain() {
  using P = policies<Dedup>;
  const int R = test::world_size(), me = test::world_rank();
  const layer_config cfg{
      .hidden = 16, .ffn = 12, .experts = 12, .top_k = 2, .ranks = R, .max_tokens = 16};
  const auto w = reference::full_weights::random(cfg, 81);
  const auto mine = reference::slice(w, typename P::placement(cfg), me);
  const index_t H = cfg.hidden;
  constexpr int batches = 4;
  std::vector<std::vector<float>> x, plain, split;
  for (int m = 0; m < batches; ++m) {
    x.push_back(reference::random_tokens(tokens_of(m, me), H, 90 + 10 * m + me));
    plain.emplace_back(x.back().size(), nan);
    split.emplace_back(x.back().size(), nan);
  }
  const auto xv = [&](int m) { return matrix_view<const float>{x[m].data(), tokens_of(m, me), H}; };
  const auto yv = [&](std::vector<float>& y, int m) {
    return matrix_view<float>{y.data(), tokens_of(m, me), H};
  };
  moe_layer<P> one(cfg, comm::mpi(MPI_COMM_WORLD), {w.gate_view(), mine.experts()});
  for (int m = 0; m < batches; ++m) one.forward(xv(m), yv(plain[m], m));
  std::vector<comm::mpi> comms;
  comms.emplace_back(MPI_COMM_WORLD);
  comms.emplace_back(MPI_COMM_WORLD);
  split_layer<P> two(cfg, std::move(comms), {w.gate_view(), mine.experts()});
  auto a = two.start(xv(0), yv(split[0], 0));
  for (int m = 1; m < batches; ++m) {  // two in flight, finished in order
    const auto b = two.start(xv(m), yv(split[m], m));
    CHECK(two.in_flight() == 2);
    two.finish(a);
    a = b;
  }
  two.finish(a);
  int compared = 0;
  for (int m = 0; m < batches; ++m) {
    CAPTURE(R, me, m, Dedup);
    for (float v : plain[m]) REQUIRE(std::isfinite(v));
    CHECK(split[m] == plain[m]);
    compared += static_cast<int>(plain[m].size());
  }
  CHECK(compared > 0);
}

}  // namespace

TEST_CASE("mpi split: two micro-batches in flight equal plain passes bitwise", "[mpi][split]") {
  split_equals_plain<false>();
  split_equals_plain<true>();
}

TEST_CASE("mpi split: a rejected input on the last rank at start throws on every rank",
          "[mpi][split]") {
  using P = policies<false>;
  const int R = test::world_size(), me = test::world_rank();
  const layer_config cfg{
      .hidden = 16, .ffn = 12, .experts = 12, .top_k = 2, .ranks = R, .max_tokens = 16};
  const auto w = reference::full_weights::random(cfg, 81);
  const auto mine = reference::slice(w, P::placement(cfg), me);
  std::vector<comm::mpi> comms;
  comms.emplace_back(MPI_COMM_WORLD);
  comms.emplace_back(MPI_COMM_WORLD);
  split_layer<P> layer(cfg, std::move(comms), {w.gate_view(), mine.experts()});
  const auto x = reference::random_tokens(8, cfg.hidden, 5);
  std::vector<float> y(x.size(), nan);
  const auto a = layer.start({x.data(), 8, cfg.hidden}, {y.data(), 8, cfg.hidden});
  // Meanwhile the last rank passes 17 tokens (> max_tokens): every rank throws at start.
  const index_t T = me == R - 1 ? 17 : 8;
  std::vector<float> x2(static_cast<std::size_t>(17 * cfg.hidden), 0.5f), y2(x2.size(), nan);
  std::string why;
  try {
    layer.start({x2.data(), T, cfg.hidden}, {y2.data(), T, cfg.hidden});
  } catch (const std::exception& e) {
    why = e.what();
  }
  CHECK_THAT(why, Catch::Contains(me == R - 1 ? "max_tokens" : "rank " + std::to_string(R - 1)));
  CHECK(layer.in_flight() == 1);
  int unwritten = 0;
  for (float v : y2) unwritten += std::isnan(v);
  CHECK(unwritten == static_cast<int>(y2.size()));
  layer.finish(a);  // the pass in flight completes
  int finite = 0;
  for (float v : y) finite += std::isfinite(v);
  CHECK(finite == static_cast<int>(y.size()));
}

}  // namespace mpi_split_tests
