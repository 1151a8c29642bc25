// SPDX-FileCopyrightText: 2026 The epmoe authors
// SPDX-License-Identifier: Apache-2.0
// The low-latency exchange on MPI processes (issue 38), both ways it moves the slots: writes
// into the peers' shared-memory windows and one meeting per direction (the processes share a
// node), and one round of MPI_Isend / MPI_Irecv per direction (comm::mpi built with
// windows = false, as across nodes). Outputs equal the default exchange on threads and the
// reference (uneven ranks, a rank with T = 0, every token to one rank's experts); a rejected
// input on one process makes every process throw, with y untouched.
#include <bit>
#include <catch2/catch.hpp>
#include <cstdint>
#include <limits>
#include <string>
#include <vector>

#include "../layer/harness.hpp"
#include "world.hpp"
#include <epmoe/comm/mpi.hpp>
#include <epmoe/split_layer.hpp>

// A namespace per file: test_mpi compiles its files as one unit.
namespace mpi_low_latency_tests {
using namespace epmoe;

namespace {

struct ll_mpi : default_policies {
  using router = epmoe::router::topk_softmax<2>;
  using comm = epmoe::comm::mpi;
  static constexpr layer_options options{.low_latency = true};
};
struct flat_threads : ll_mpi {
  using comm = epmoe::comm::threads;
  static constexpr layer_options options{};
};

// Bit for bit across the two ways of running a pass (plain, split).
struct ll_deterministic : ll_mpi {
  static constexpr layer_options options{.deterministic = true, .low_latency = true};
};

static_assert(low_latency_exchange<comm::mpi, space::host>::at_most);
static_assert(low_latency_exchange<comm::mpi, space::host>::posts);

using test::world_rank;
using test::world_size;

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

// A gate that routes by hand: gate row e = unit vector e, so a token with 2 at a and 1 at b
// picks (a, b).
reference::full_weights hand_gate(const layer_config& cfg, std::uint64_t seed) {
  auto w = reference::full_weights::random(cfg, seed);
  std::fill(w.gate.begin(), w.gate.end(), 0.f);
  for (int e = 0; e < cfg.experts; ++e) w.gate[e * cfg.hidden + e] = 1.f;
  return w;
}

// One pass on the MPI ranks; on rank 0, the outputs against the default exchange on threads
// and the reference. Returns this rank's stats.
pass_stats check(const layer_config& cfg, const reference::full_weights& w,
                 const test::global_tokens& g, bool windows) {
  const int me = world_rank();
  const index_t H = cfg.hidden, T = g.per_rank[me];
  const placement::block where(cfg);
  const auto mine = reference::slice(w, where, me);
  moe_layer<ll_mpi> layer(cfg, comm::mpi(MPI_COMM_WORLD, 8, windows),
                          {w.gate_view(), mine.experts()});
  std::vector<float> y(T * H, std::numeric_limits<float>::quiet_NaN());
  layer.forward({g.x.data() + g.offset(me) * H, T, H}, {y.data(), T, H});
  // Windows: rows move by stores and meetings, no message; else the dispatch's two parts
  // (heads, rows) and the combine.
  CHECK(layer.comm().posted(exchange_level::all) == (windows ? 0 : 3));
  const std::vector<float> all = gather(y, g, H);
  if (me == 0) {
    const auto flat = test::run_layer<flat_threads>(cfg, w, g).y;
    CHECK(test::relative_error(all, flat) <= 1e-6);
    CHECK(test::relative_error(all, test::run_reference<ll_mpi>(cfg, w, g)) <= 1e-5);
  }
  return layer.stats();
}

}  // namespace

TEST_CASE("mpi low latency: equals the default exchange and the reference; fixed bytes",
          "[mpi][layer][low_latency]") {
  const int R = world_size(), me = world_rank();
  const layer_config cfg{
      .hidden = 16, .ffn = 12, .experts = 4 * R, .top_k = 2, .ranks = R, .max_tokens = 10};
  const auto w = reference::full_weights::random(cfg, 91);
  std::vector<index_t> per_rank;
  for (int r = 0; r < R; ++r) per_rank.push_back(r == 1 ? 0 : 10 - r);  // rank 1: T = 0
  const bool windows = GENERATE(true, false);
  const pass_stats s = check(cfg, w, test::make_tokens(per_rank, cfg.hidden, 92), windows);
  // One MPI_Isend / MPI_Irecv round per direction: the used rows (H floats each) and, with
  // the dispatch, a head per peer (the counts message: 4 + 2 * 4 + 2 int64).
  index_t rows = 0;
  for (int q = 0; q < R; ++q)
    if (q != me) rows += s.rows_sent[q];
  CHECK(s.alltoalls == 2);
  CHECK(s.dispatch_bytes_sent == rows * 16 * 4 + (R - 1) * 14 * 8);
  CHECK(s.combine_bytes_received == rows * 16 * 4);
  CHECK(s.tokens == per_rank[me]);
}

TEST_CASE("mpi low latency: every token to the last rank's experts", "[mpi][layer][low_latency]") {
  const int R = world_size(), me = world_rank();
  const layer_config cfg{
      .hidden = 16, .ffn = 12, .experts = 4 * R, .top_k = 2, .ranks = R, .max_tokens = 12};
  const auto w = hand_gate(cfg, 93);
  std::vector<index_t> per_rank(R, 12);
  test::global_tokens g{per_rank, {}};
  g.x.assign(g.total() * cfg.hidden, 0.f);
  const int first = (R - 1) * 4;  // the last rank's experts: first .. first + 3
  for (index_t t = 0; t < g.total(); ++t) {
    g.x[t * cfg.hidden + first + t % 4] = 2.f;
    g.x[t * cfg.hidden + first + (t + 1) % 4] = 1.f;
  }
  const pass_stats s = check(cfg, w, g, GENERATE(true, false));
  index_t received = 0;
  for (index_t n : s.rows_received) received += n;
  CHECK(received == (me == R - 1 ? 2 * g.total() : 0));
}

TEST_CASE("mpi low latency: a rejected input on one process makes every process throw",
          "[mpi][layer][low_latency]") {
  const int R = world_size(), me = world_rank(), bad = R - 1;
  const layer_config cfg{
      .hidden = 8, .ffn = 6, .experts = 2 * R, .top_k = 2, .ranks = R, .max_tokens = 5};
  const auto w = reference::full_weights::random(cfg, 95);
  const placement::block where(cfg);
  const auto mine = reference::slice(w, where, me);
  const bool windows = GENERATE(true, false);
  moe_layer<ll_mpi> layer(cfg, comm::mpi(MPI_COMM_WORLD, 8, windows),
                          {w.gate_view(), mine.experts()});
  const index_t T = 5, H = cfg.hidden;
  const auto g = test::make_tokens(std::vector<index_t>(R, T), H, 96);
  std::vector<std::int32_t> ids(T * 2);
  std::vector<float> wts(T * 2, 0.5f);
  for (index_t i = 0; i < T * 2; ++i) ids[i] = static_cast<std::int32_t>(i % cfg.experts);
  if (me == bad) ids[3] = cfg.experts;  // out of range
  constexpr std::uint32_t bits = 0x7fc01234u;
  std::vector<float> y(T * H, std::bit_cast<float>(bits));
  std::string what;
  try {
    layer.forward({g.x.data() + g.offset(me) * H, T, H},
                  routing_view{{ids.data(), T, 2}, {wts.data(), T, 2}}, {y.data(), T, H});
  } catch (const input_error& e) {
    what = e.what();
  }
  INFO("rank " << me << ": " << what);
  if (me == bad)
    CHECK(what.find("routing.ids[1][1]") != std::string::npos);
  else
    CHECK(what.find("forward inputs of rank " + std::to_string(bad)) != std::string::npos);
  bool untouched = true;
  for (float v : y) untouched = untouched && std::bit_cast<std::uint32_t>(v) == bits;
  CHECK(untouched);
  // The layer stays usable: a valid pass next.
  for (index_t i = 0; i < T * 2; ++i) ids[i] = static_cast<std::int32_t>(i % cfg.experts);
  layer.forward({g.x.data() + g.offset(me) * H, T, H},
                routing_view{{ids.data(), T, 2}, {wts.data(), T, 2}}, {y.data(), T, H});
  CHECK(layer.stats().alltoalls == 2);
}

TEST_CASE(
    "mpi low latency split: start posts the round; two in flight equal plain passes; a "
    "rejected input throws at finish on every process",
    "[mpi][split][low_latency]") {
  using P = ll_deterministic;
  const int R = world_size(), me = world_rank(), bad = R - 1;
  const layer_config cfg{
      .hidden = 16, .ffn = 12, .experts = 4 * R, .top_k = 2, .ranks = R, .max_tokens = 10};
  const auto w = reference::full_weights::random(cfg, 97);
  const auto mine = reference::slice(w, placement::block(cfg), me);
  const moe_layer<P>::weights ws{w.gate_view(), mine.experts()};
  moe_layer<P> plain(cfg, comm::mpi(MPI_COMM_WORLD), ws);
  const bool windows = GENERATE(true, false);
  std::vector<comm::mpi> lanes;  // a communicator per lane: two passes' messages never meet
  lanes.emplace_back(MPI_COMM_WORLD, 8, windows);
  lanes.emplace_back(MPI_COMM_WORLD, 8, windows);
  split_layer<P> split(cfg, std::move(lanes), ws);
  const index_t H = cfg.hidden;
  const float nan = std::numeric_limits<float>::quiet_NaN();
  const std::vector<index_t> T{me == 0 ? 0 : 7, 10, 3};  // three micro-batches
  std::vector<std::vector<float>> x, want, got;
  for (int m = 0; m < 3; ++m) {
    x.push_back(reference::random_tokens(T[m], H, 200 + 10 * m + me));
    want.emplace_back(T[m] * H, nan);
    got.emplace_back(T[m] * H, nan);
    plain.forward({x[m].data(), T[m], H}, {want[m].data(), T[m], H});
  }
  const auto xv = [&](int m) { return matrix_view<const float>{x[m].data(), T[m], H}; };
  const auto yv = [&](int m) { return matrix_view<float>{got[m].data(), T[m], H}; };
  const auto a = split.start(xv(0), yv(0));
  const auto b = split.start(xv(1), yv(1));  // two rounds posted
  split.experts(a);
  split.finish(a);
  const auto c = split.start(xv(2), yv(2));
  split.finish(b);
  split.finish(c);
  int checked = 0;
  for (int m = 0; m < 3; ++m, ++checked) {
    INFO("rank " << me << ", micro-batch " << m);
    CHECK(got[m] == want[m]);  // bitwise; an unwritten row stays NaN and fails
  }
  CHECK(checked == 3);

  // Rank `bad` passes 11 tokens > max_tokens: its verdict rides with the posted round, so
  // start returns everywhere and every process throws at finish, writing nothing.
  std::vector<float> big((cfg.max_tokens + 1) * H, 0.f), y(big.size(), nan);
  const index_t n = me == bad ? cfg.max_tokens + 1 : 4;
  const auto h = split.start({big.data(), n, H}, {y.data(), n, H});
  std::string what;
  try {
    split.finish(h);
  } catch (const std::exception& e) {
    what = e.what();
  }
  INFO("rank " << me << ": " << what);
  if (me == bad)
    CHECK(what.find("max_tokens") != std::string::npos);
  else
    CHECK(what.find("rank " + std::to_string(bad)) != std::string::npos);
  bool untouched = true;
  for (float v : y) untouched = untouched && v != v;
  CHECK(untouched);
  CHECK(split.in_flight() == 0);
  std::fill(got[1].begin(), got[1].end(), nan);
  split.finish(split.start(xv(1), yv(1)));  // usable after
  CHECK(got[1] == want[1]);
}

}  // namespace mpi_low_latency_tests
