// SPDX-FileCopyrightText: 2026 The epmoe authors
// SPDX-License-Identifier: Apache-2.0
#include <catch2/catch.hpp>
#include <cstdint>
#include <cstdlib>
#include <functional>
#include <limits>
#include <optional>
#include <set>
#include <string>
#include <type_traits>
#include <utility>
#include <vector>

#include "../layer/harness.hpp"
#include "world.hpp"
#include <epmoe/comm/mpi.hpp>
#include <epmoe/placement/round_robin.hpp>
#include <epmoe/placement/table.hpp>
#include <epmoe/schedule/pipelined.hpp>

// A namespace per file: test_mpi compiles its files as one unit.
namespace mpi_layer_tests {
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

struct mpi_hier_policies : mpi_policies {
  static constexpr epmoe::layer_options options{.hierarchical = true};
};

struct mpi_hier_capacity_policies : mpi_hier_policies {
  using capacity = epmoe::capacity::factor<false>;
};

struct mpi_hier_pipelined_policies : mpi_hier_capacity_policies {
  using schedule = epmoe::schedule::pipelined<3>;
};

struct mpi_hier_table_policies : mpi_hier_capacity_policies {
  using placement = epmoe::placement::table;
};

// The same bundle on in-process ranks, flat: what an MPI run is compared with.
template <class P>
struct threads_twin : P {
  using comm = epmoe::comm::threads;
  static constexpr epmoe::layer_options options{};
};

// Sets (nullptr: unsets) EPMOE_RANKS_PER_NODE, which comm::mpi reads at construction, for a
// scope; restores what was there. Every rank sets the same unless a test says otherwise.
class ranks_per_node_env {
 public:
  explicit ranks_per_node_env(const char* value) {
    if (const char* old = std::getenv(name)) old_ = old;
    set(value);
  }
  ~ranks_per_node_env() { set(old_ ? old_->c_str() : nullptr); }
  ranks_per_node_env(const ranks_per_node_env&) = delete;
  ranks_per_node_env& operator=(const ranks_per_node_env&) = delete;

 private:
  static void set(const char* value) {
    if (value)
      setenv(name, value, 1);
    else
      unsetenv(name);
  }
  static constexpr const char* name = "EPMOE_RANKS_PER_NODE";
  std::optional<std::string> old_;
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

// What a check may set beyond the policies: the placement (default: make_placement) and a
// step every rank runs after each pass.
template <class P>
struct check_options {
  std::optional<typename P::placement> placement{};
  std::function<void(moe_layer<P>&)> after{};
};

// Runs moe_layer on the MPI ranks, one pass per token set (rank r takes its slice of each),
// and checks on rank 0 that every pass equals comm::threads (flat, same placement and
// capacity) on the same global tokens and the reference. Returns this rank's stats of the
// last pass.
template <class P = mpi_policies>
pass_stats check_layer(const layer_config& cfg, const reference::full_weights& w,
                       const std::vector<test::global_tokens>& passes,
                       const check_options<P>& opt = {}) {
  const int me = world_rank();
  const index_t H = cfg.hidden;
  const typename P::placement where =
      opt.placement ? *opt.placement : make_placement<typename P::placement>(cfg);
  const auto mine = reference::slice(w, where, me);
  moe_layer<P> layer(cfg, comm::mpi(MPI_COMM_WORLD), {w.gate_view(), mine.experts()}, {}, {},
                     where);
  for (std::size_t p = 0; p < passes.size(); ++p) {
    const test::global_tokens& g = passes[p];
    const index_t T = g.per_rank[me];
    std::vector<float> y(T * H, std::numeric_limits<float>::quiet_NaN());  // unwritten fails
    layer.forward({g.x.data() + g.offset(me) * H, T, H}, {y.data(), T, H});
    if (opt.after) opt.after(layer);
    const std::vector<float> all = gather(y, g, H);
    if (me != 0) continue;
    INFO("pass " << p << " on " << cfg.ranks << " MPI ranks");
    const auto threads = test::run_layer<threads_twin<P>>(cfg, w, g, {.placement = where}).y;
    const auto want = test::run_reference<P>(cfg, w, g, {.placement = where});
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

// Distinct (token, other node) pairs of this rank's last pass, from its routing, drops and
// placement (as tests/layer/test_layer_hierarchical.cpp count_pairs), with the copy each
// token uses: its id is rank * max_tokens + t when the pass gives none.
template <class P>
index_t other_node_pairs(const moe_layer<P>& layer, const layer_config& cfg, int per_node) {
  const int me = layer.rank();
  const routing_view r = layer.last_routing();
  const drop_mask dropped = layer.dropped();
  const auto& where = layer.placement();
  std::set<std::pair<index_t, int>> pairs;
  for (index_t t = 0; t < r.tokens(); ++t)
    for (index_t k = 0; k < r.ids.cols; ++k) {
      const int e = r.ids(t, k);
      if (e == no_expert || dropped(t, k)) continue;
      const auto id = static_cast<std::uint64_t>(me) * cfg.max_tokens + t;
      const int node = where.slot_for(e, me, id) / where.slots_per_rank() / per_node;
      if (node != me / per_node) pairs.insert({t, node});
    }
  return static_cast<index_t>(pairs.size());
}

// sum over the ranks
index_t world_sum(index_t v) {
  long long s = v;
  MPI_Allreduce(MPI_IN_PLACE, &s, 1, MPI_LONG_LONG, MPI_SUM, MPI_COMM_WORLD);
  return static_cast<index_t>(s);
}

// A hierarchical check on nodes of 2 ranks: outputs as check_layer, one row per (token, other
// node) between nodes, and the nodes from where the route says (config or comm).
template <class P>
pass_stats check_hierarchical(const layer_config& cfg, const reference::full_weights& w,
                              const test::global_tokens& g,
                              std::optional<typename P::placement> where = {}) {
  index_t pairs = -1;
  int comm_nodes = -1;
  long on_node = -1, on_cross = -1;
  const pass_stats s = check_layer<P>(
      cfg, w, {g}, {.placement = std::move(where), .after = [&](moe_layer<P>& layer) {
                      pairs = other_node_pairs(layer, cfg, 2);
                      comm_nodes = layer.comm().ranks_per_node();
                      on_node = layer.comm().posted(exchange_level::node);
                      on_cross = layer.comm().posted(exchange_level::cross);
                    }});
  CHECK(s.ranks_per_node == 2);
  CHECK(s.inter_node.rows_sent == pairs);
  if (cfg.ranks_per_node == 0) CHECK(comm_nodes == 2);  // the comm route: the override's
  // The comm's nodes are the layer's: each level ran on its own communicator (node_comm(),
  // cross_comm()); else every exchange ran over all ranks.
  if (comm_nodes == 2) {
    CHECK(on_node > 0);
    CHECK(on_cross > 0);
  } else {
    CHECK(on_node == 0);
    CHECK(on_cross == 0);
  }
  CHECK(world_sum(pairs) > 0);  // some rows crossed: not 0 == 0
  return s;
}

// G as ranks_per_node() defines it, from the ranks' host names: every host holds G
// consecutive ranks, else 0. `mine`: how many ranks share this rank's host.
int ranks_per_host(int& mine) {
  const int R = world_size(), me = world_rank();
  char name[MPI_MAX_PROCESSOR_NAME] = {};
  int len = 0;
  MPI_Get_processor_name(name, &len);
  std::vector<char> all(static_cast<std::size_t>(R) * MPI_MAX_PROCESSOR_NAME);
  MPI_Allgather(name, MPI_MAX_PROCESSOR_NAME, MPI_CHAR, all.data(), MPI_MAX_PROCESSOR_NAME,
                MPI_CHAR, MPI_COMM_WORLD);
  std::vector<std::string> host;
  for (int r = 0; r < R; ++r) host.emplace_back(all.data() + r * MPI_MAX_PROCESSOR_NAME);
  const auto on = [&](int r) {
    int n = 0;
    for (const auto& h : host) n += h == host[r];
    return n;
  };
  mine = on(me);
  const int G = on(0);
  for (int r = 0; r < R; ++r)
    if (on(r) != G || host[r] != host[r / G * G]) return 0;
  return G;
}

}  // namespace

TEST_CASE("mpi comm: without EPMOE_RANKS_PER_NODE, nodes are the ranks sharing a host",
          "[mpi][comm][nodes]") {
  const ranks_per_node_env env(nullptr);
  int mine = 0;
  const int want = ranks_per_host(mine);
  const comm::mpi c(MPI_COMM_WORLD);
  CHECK(c.ranks_per_node() == want);
  int node = 0, cross = 0;
  MPI_Comm_size(c.node_comm(), &node);
  MPI_Comm_size(c.cross_comm(), &cross);
  CHECK(node == mine);
  if (want > 0) CHECK(cross == world_size() / want);
}

TEST_CASE("mpi comm: EPMOE_RANKS_PER_NODE pretends nodes of consecutive ranks",
          "[mpi][comm][nodes]") {
  const int R = world_size(), me = world_rank();
  int divisors = 0, checked = 0;
  for (int G = 1; G <= R; ++G) {
    if (R % G != 0) continue;
    ++divisors;
    CAPTURE(G);
    const ranks_per_node_env env(std::to_string(G).c_str());
    comm::mpi c(MPI_COMM_WORLD);
    CHECK(c.ranks_per_node() == G);
    int node_rank = -1, node_size = -1, cross_rank = -1, cross_size = -1;
    MPI_Comm_rank(c.node_comm(), &node_rank);
    MPI_Comm_size(c.node_comm(), &node_size);
    MPI_Comm_rank(c.cross_comm(), &cross_rank);
    MPI_Comm_size(c.cross_comm(), &cross_size);
    CHECK(node_size == G);
    CHECK(node_rank == me % G);
    CHECK(cross_size == R / G);
    CHECK(cross_rank == me / G);
    // The node's members are world ranks node * G + i, in order.
    MPI_Group world_group, node_group;
    MPI_Comm_group(MPI_COMM_WORLD, &world_group);
    MPI_Comm_group(c.node_comm(), &node_group);
    std::vector<int> local(G), world(G, -1);
    for (int i = 0; i < G; ++i) local[i] = i;
    MPI_Group_translate_ranks(node_group, G, local.data(), world_group, world.data());
    for (int i = 0; i < G; ++i) CHECK(world[i] == me / G * G + i);
    MPI_Group_free(&node_group);
    MPI_Group_free(&world_group);
    // A move hands the node communicators over; a move-assignment frees the target's own.
    const MPI_Comm node = c.node_comm(), cross = c.cross_comm();
    comm::mpi moved(std::move(c));
    CHECK(c.node_comm() == MPI_COMM_NULL);
    CHECK(c.cross_comm() == MPI_COMM_NULL);
    CHECK(moved.node_comm() == node);
    CHECK(moved.cross_comm() == cross);
    comm::mpi other(MPI_COMM_WORLD);
    other = std::move(moved);
    CHECK(other.node_comm() == node);
    CHECK(other.ranks_per_node() == G);
    ++checked;
  }
  CHECK(checked == divisors);
  CHECK(checked >= 1);
}

TEST_CASE("mpi comm: a bad or differing EPMOE_RANKS_PER_NODE throws on every rank, no hang",
          "[mpi][comm][nodes]") {
  using Catch::Matchers::Contains;
  const int R = world_size(), me = world_rank();
  const std::vector<std::string> bad = {
      "0",  "-2", "two",         "2x",
      " 2", "",   "99999999999", std::to_string(R + 1)};  // R + 1 never divides R
  int thrown = 0;
  for (const std::string& value : bad) {
    CAPTURE(value);
    const ranks_per_node_env env(value.c_str());
    try {
      comm::mpi c(MPI_COMM_WORLD);
      FAIL_CHECK("rank " << me << " accepted EPMOE_RANKS_PER_NODE = '" << value << "'");
    } catch (const config_error& e) {
      CHECK(e.field() == "EPMOE_RANKS_PER_NODE");
      CHECK(e.value() == value);
      CHECK_THAT(e.what(), Contains("positive integer that divides") &&
                               Contains(std::to_string(R) + " ranks"));
      ++thrown;
    }
  }
  CHECK(thrown == static_cast<int>(bad.size()));
  if (R > 1) {  // rank 0 reads 1, the others R: each valid alone, not together
    const ranks_per_node_env env(me == 0 ? "1" : std::to_string(R).c_str());
    try {
      comm::mpi c(MPI_COMM_WORLD);
      FAIL_CHECK("rank " << me << " accepted a value the other ranks do not share");
    } catch (const config_error& e) {
      CHECK(e.field() == "EPMOE_RANKS_PER_NODE");
      CHECK_THAT(e.what(), Contains("same on every rank"));
    }
  }
  // No rank was left in a collective: a fresh comm exchanges.
  comm::mpi c(MPI_COMM_WORLD);
  std::vector<int> send(R), recv(R, -1);
  for (int r = 0; r < R; ++r) send[r] = 100 * me + r;
  c.alltoall(send.data(), recv.data(), 1);
  int wrong = 0;
  for (int r = 0; r < R; ++r) wrong += recv[r] != 100 * r + me;
  CHECK(wrong == 0);
}

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

TEST_CASE("mpi layer: 8-bit dispatch rows equal comm::threads' and cross at H + 4 bytes a row",
          "[mpi][layer][wire]") {
  const int R = world_size(), me = world_rank();
  const layer_config cfg{.hidden = 28,
                         .ffn = 12,
                         .experts = 2 * R,
                         .top_k = 2,
                         .ranks = R,
                         .max_tokens = 30,
                         .chunks = 2,
                         .dispatch_rows = row_format::int8};
  const auto w = reference::full_weights::random(cfg, 131);
  std::vector<index_t> per_rank(R, 30);
  per_rank[0] = 9;
  const auto g = test::make_tokens(per_rank, cfg.hidden, 132);
  const index_t H = cfg.hidden, T = per_rank[me];
  const auto run = [&]<class P>() {
    const auto mine = reference::slice(w, placement::block(cfg), me);
    moe_layer<P> layer(cfg, comm::mpi(MPI_COMM_WORLD), {w.gate_view(), mine.experts()});
    std::vector<float> y(T * H, std::numeric_limits<float>::quiet_NaN());
    layer.forward({g.x.data() + g.offset(me) * H, T, H}, {y.data(), T, H});
    const pass_stats& s = layer.stats();
    index_t rows = 0, assignments = 0;
    for (int q = 0; q < R; ++q)
      if (q != me) rows += s.rows_sent[q], assignments += s.assignment_rows_sent[q];
    CHECK(s.dispatch_bytes_sent == rows * (H + 4) + (P::options.dedup ? 8 * assignments : 0));
    CHECK(s.combine_bytes_received == rows * 4 * H);
    const std::vector<float> all = gather(y, g, H);
    if (me != 0) return;
    const auto threads = test::run_layer<threads_twin<P>>(cfg, w, g).y;
    const double off = test::relative_error(all, test::run_reference<P>(cfg, w, g));
    INFO("8-bit rows against the fp32 reference: " << off);
    CHECK(test::relative_error(all, threads) <= 1e-6);  // the same rows, quantised alike
    CHECK(off > 1e-4);                                  // the rounding shows
    CHECK(off < 0.05);
  };
  run.template operator()<mpi_pipelined_policies>();
  run.template operator()<mpi_pipelined_dedup_policies>();
}

TEST_CASE("mpi layer: hierarchical on 2 nodes x 2, from the config or the comm, equals flat",
          "[mpi][layer][hierarchical]") {
  const int R = world_size();
  if (R != 4) return;                               // 2 nodes x 2 ranks: the 4-rank run only
  std::vector<index_t> per_rank = {30, 0, 23, 17};  // rank 1 without tokens
  int routes = 0;
  for (const bool from_comm : {false, true}) {
    CAPTURE(from_comm);
    // The comm route: the config leaves ranks_per_node 0 and comm::mpi reads the override.
    const ranks_per_node_env env(from_comm ? "2" : nullptr);
    const layer_config cfg{.hidden = 16,
                           .ffn = 12,
                           .experts = 4 * R,
                           .top_k = 2,
                           .ranks = R,
                           .max_tokens = 30,
                           .capacity_factor = 0.8,
                           .ranks_per_node = from_comm ? 0 : 2};
    const auto w = reference::full_weights::random(cfg, 111);
    const auto g = test::make_tokens(per_rank, cfg.hidden, 112);
    check_hierarchical<mpi_hier_policies>(cfg, w, g);
    const pass_stats capped = check_hierarchical<mpi_hier_capacity_policies>(cfg, w, g);
    CHECK(world_sum(capped.dropped) > 0);
    const pass_stats piped = check_hierarchical<mpi_hier_pipelined_policies>(cfg, w, g);
    CHECK(piped.chunks == 3);
    CHECK(piped.dropped == capped.dropped);
    // A receive bound: windows of 2 tokens of every rank, both levels' rows in their slots.
    layer_config bounded = cfg;
    bounded.max_recv_rows = R * 3 * 2;
    const pass_stats windows = check_hierarchical<mpi_hier_pipelined_policies>(bounded, w, g);
    CHECK(windows.rounds == 5);  // 10-token chunks in windows of 2
    CHECK(windows.recv_buffer_rows <= bounded.max_recv_rows);
    CHECK(windows.dropped == capped.dropped);
    // Rank r holds its 4 experts and a copy of the first expert of rank (r + 2) % 4, on the
    // other node: tokens use the copy on their own node, so fewer rows cross.
    std::vector<int> slots;
    for (int r = 0; r < R; ++r) {
      for (int j = 0; j < 4; ++j) slots.push_back(4 * r + j);
      slots.push_back(4 * ((r + 2) % R));
    }
    check_hierarchical<mpi_hier_table_policies>(cfg, w, g, placement::table(16, R, slots, 2));
    ++routes;
  }
  CHECK(routes == 2);
}

}  // namespace mpi_layer_tests
