// SPDX-FileCopyrightText: 2026 The epmoe authors
// SPDX-License-Identifier: Apache-2.0
#include <catch2/catch.hpp>
#include <functional>
#include <limits>
#include <set>
#include <utility>

#include "harness.hpp"
#include <epmoe/comm/throttled.hpp>
#include <epmoe/placement/table.hpp>
#include <epmoe/schedule/pipelined.hpp>

// Hierarchical dispatch and combine: one row per (token, node) crosses between nodes, the
// rank it reaches fans it out inside its node, and the combine sums there before going home.
using namespace epmoe;

namespace {

template <int K, class Capacity = capacity::dropless, class Schedule = schedule::sequential,
          class Placement = placement::block, bool Hier = true>
struct policies : test::threads_policies<K, Capacity> {
  using schedule = Schedule;
  using placement = Placement;
  static constexpr layer_options options{.dedup = true, .hierarchical = Hier};
};
template <int K, class Capacity = capacity::dropless, class Schedule = schedule::sequential,
          class Placement = placement::block>
using flat = policies<K, Capacity, Schedule, Placement, false>;

template <int K, bool Hier>
struct limited_policies
    : policies<K, capacity::dropless, schedule::sequential, placement::block, Hier> {
  using router = epmoe::router::sigmoid_bias<K>;
};

layer_config shape(int ranks, int per_node, int top_k, double cf = 1.0) {
  return {.hidden = 13,
          .ffn = 9,
          .experts = 4 * ranks,
          .top_k = top_k,
          .ranks = ranks,
          .max_tokens = 40,
          .capacity_factor = cf,
          .ranks_per_node = per_node};
}

// Uneven token counts, one rank without tokens.
test::global_tokens tokens_for(int ranks, index_t hidden, std::uint64_t seed) {
  std::vector<index_t> per_rank;
  for (int r = 0; r < ranks; ++r) per_rank.push_back(r == 1 ? 0 : 40 - 3 * r);
  return test::make_tokens(per_rank, hidden, seed);
}

// Distinct (token, node) pairs of each rank's last pass, counted from its routing, its
// placement and its drop mask: the kept assignments on another node, and on its own.
struct node_pairs {
  std::vector<index_t> other, own;
};
template <class P>
std::function<void(moe_layer<P>&)> count_pairs(node_pairs& out, int per_node) {
  return [&out, per_node](moe_layer<P>& layer) {
    const int me = layer.rank(), node = me / per_node;
    const routing_view r = layer.last_routing();
    const drop_mask dropped = layer.dropped();
    std::set<std::pair<index_t, int>> pairs;
    const auto& where = layer.placement();
    for (index_t t = 0; t < r.tokens(); ++t)
      for (index_t k = 0; k < r.ids.cols; ++k) {
        const int e = r.ids(t, k);
        if (e == no_expert || dropped(t, k)) continue;
        pairs.insert({t, where.rank_of(e) / per_node});
      }
    index_t other = 0, own = 0;
    for (const auto& [t, n] : pairs) (n == node ? own : other) += 1;
    out.other[me] = other;
    out.own[me] = own;
  };
}

}  // namespace

TEST_CASE("hierarchical: equals the flat exchange and the reference on 2x2, 2x4, 4x2 ranks",
          "[layer][hierarchical]") {
  int checked = 0;
  for (const auto& [R, G] :
       {std::pair{4, 2}, std::pair{8, 4}, std::pair{8, 2}, std::pair{4, 1}, std::pair{4, 4}})
    for (int K : {2, 4}) {
      CAPTURE(R, G, K);
      const layer_config cfg = shape(R, G, K);
      const auto w = reference::full_weights::random(cfg, 30 + R + G + K);
      const auto g = tokens_for(R, cfg.hidden, 11 + R * G + K);
      test::with_top_k(K, [&]<int KK>() {
        using D = capacity::dropless;
        node_pairs pairs{std::vector<index_t>(R), std::vector<index_t>(R)};
        const auto hier = test::run_layer<policies<KK, D>>(
            cfg, w, g, {.between = count_pairs<policies<KK, D>>(pairs, G)});
        const auto plain = test::run_layer<flat<KK, D>>(cfg, w, g);
        CHECK(test::relative_error(hier.y, plain.y) <= 1e-6);
        CHECK(test::relative_error(hier.y, test::run_reference<flat<KK, D>>(cfg, w, g)) <= 1e-4);
        for (int r = 0; r < R; ++r) {
          const pass_stats& h = hier.stats[r][0];
          const pass_stats& f = plain.stats[r][0];
          CAPTURE(r);
          CHECK(h.ranks_per_node == G);
          // One row per (token, other node), never more than the flat exchange's.
          CHECK(h.inter_node.rows_sent == pairs.other[r]);
          CHECK(h.inter_node.rows_sent <= f.inter_node.rows_sent);
          CHECK(h.rows_per_local_expert == f.rows_per_local_expert);
          CHECK(h.dropped == 0);
          ++checked;
        }
      });
    }
  CHECK(checked == 2 * (4 + 8 + 8 + 4 + 4));
}

TEST_CASE("hierarchical: composes with capacity drops, replicas and the pipelined schedule",
          "[layer][hierarchical]") {
  using C = capacity::factor<false>;
  const layer_config cfg = shape(4, 2, 2, 0.8);
  const auto w = reference::full_weights::random(cfg, 5);
  const auto g = tokens_for(4, cfg.hidden, 6);
  // Capacity: the same drops, decided at home, as the flat exchange.
  const auto hc = test::run_layer<policies<2, C>>(cfg, w, g);
  const auto fc = test::run_layer<flat<2, C>>(cfg, w, g);
  CHECK(test::relative_error(hc.y, fc.y) <= 1e-6);
  CHECK(test::relative_error(hc.y, test::run_reference<flat<2, C>>(cfg, w, g)) <= 1e-4);
  index_t drops = 0;
  for (int r = 0; r < 4; ++r) {
    CHECK(hc.stats[r][0].dropped == fc.stats[r][0].dropped);
    drops += hc.stats[r][0].dropped;
  }
  CHECK(drops > 0);
  // Pipelined: every chunk's two levels in flight in turn; rounds of passes reuse the buffers.
  using Pipe = policies<2, C, schedule::pipelined<3>>;
  const auto hp = test::run_layer<Pipe>(cfg, w, g, {.passes = 2});
  CHECK(hp.stats[0][1].chunks == 3);
  for (const auto& y : hp.ys) CHECK(test::relative_error(y, fc.y) <= 1e-6);
  // Replicas: 16 experts on 4 ranks of 5 slots, experts 0..3 twice (one copy per node).
  std::vector<int> slots;
  for (int r = 0; r < 4; ++r) {
    for (int j = 0; j < 4; ++j) slots.push_back(4 * r + j);
    slots.push_back(r < 2 ? r : r - 2 + 2);
  }
  const placement::table table(16, 4, slots, 2);
  using Tab = policies<2, capacity::dropless, schedule::sequential, placement::table>;
  using TabFlat = flat<2, capacity::dropless, schedule::sequential, placement::table>;
  const auto ht = test::run_layer<Tab>(cfg, w, g, {.placement = table});
  const auto ft = test::run_layer<TabFlat>(cfg, w, g, {.placement = table});
  CHECK(test::relative_error(ht.y, ft.y) <= 1e-6);
  CHECK(test::relative_error(ht.y, test::run_reference<TabFlat>(cfg, w, g, {.placement = table})) <=
        1e-4);
}

TEST_CASE("hierarchical and dedup: a receive bound (max_recv_rows) moves windows of tokens",
          "[layer][hierarchical][rounds]") {
  // With dedup a token sends at most one row per rank (and one per node), so a round is a
  // window of q tokens of every rank: q = max_recv_rows / (R x units in flight).
  using C = capacity::factor<false>;
  using Seq = schedule::sequential;
  using Pipe = schedule::pipelined<3>;
  int checked = 0;
  for (const auto& [R, G] : {std::pair{4, 2}, std::pair{8, 4}, std::pair{8, 2}})
    for (const double cf : {1.0, 0.8}) {
      CAPTURE(R, G, cf);
      layer_config cfg = shape(R, G, 2, cf);
      const auto w = reference::full_weights::random(cfg, 40 + R + G);
      const auto g = tokens_for(R, cfg.hidden, 41 + R * G);
      const auto free = test::run_layer<flat<2, C>>(cfg, w, g);
      CHECK(test::relative_error(free.y, test::run_reference<flat<2, C>>(cfg, w, g)) <= 1e-4);
      cfg.max_recv_rows = 9 * R;  // sequential: q = 9, 5 rounds; pipelined<3>: q = 3, 14-token
                                  // chunks in 5 rounds
      node_pairs pairs{std::vector<index_t>(R), std::vector<index_t>(R)};
      const auto hs = test::run_layer<policies<2, C, Seq>>(
          cfg, w, g, {.between = count_pairs<policies<2, C, Seq>>(pairs, G)});
      const auto hp = test::run_layer<policies<2, C, Pipe>>(cfg, w, g, {.passes = 2});
      const auto fs = test::run_layer<flat<2, C, Seq>>(cfg, w, g);
      const auto fp = test::run_layer<flat<2, C, Pipe>>(cfg, w, g, {.passes = 2});
      for (const auto* run : {&hs, &hp, &fs, &fp}) {
        const bool pipe = run == &hp || run == &fp;
        const index_t q = pipe ? 3 : 9;
        for (const auto& y : run->ys) CHECK(test::relative_error(y, free.y) <= 1e-6);
        for (int r = 0; r < R; ++r)
          for (const pass_stats& s : run->stats[r]) {
            CAPTURE(r, pipe);
            CHECK(s.rounds == 5);
            CHECK(s.chunks == (pipe ? 3 : 1));
            CHECK(s.recv_buffer_rows <= cfg.max_recv_rows);
            CHECK(s.peak_recv_rows <= R * q);
            CHECK(s.dropped == free.stats[r][0].dropped);
            CHECK(s.rows_per_local_expert == free.stats[r][0].rows_per_local_expert);
            // Every window's exchange ran, one event each way per unit.
            index_t dispatches = 0;
            for (const auto& e : s.timeline) dispatches += e.stage == stage_kind::dispatch;
            CHECK(dispatches == 5 * s.chunks);
            ++checked;
          }
      }
      for (int r = 0; r < R; ++r) CHECK(hs.stats[r][0].inter_node.rows_sent == pairs.other[r]);
    }
  CHECK(checked == 2 * (4 + 8 + 8) * (1 + 2 + 1 + 2));
  // Replicas (a copy of experts 0..3 on each node) under the bound.
  const layer_config base = shape(4, 2, 2);
  const auto w = reference::full_weights::random(base, 5);
  const auto g = tokens_for(4, base.hidden, 6);
  std::vector<int> slots;
  for (int r = 0; r < 4; ++r) {
    for (int j = 0; j < 4; ++j) slots.push_back(4 * r + j);
    slots.push_back(r % 2);
  }
  const placement::table table(16, 4, slots, 2);
  using Tab = policies<2, capacity::dropless, Pipe, placement::table>;
  using TabFlat = flat<2, capacity::dropless, Seq, placement::table>;
  layer_config bounded = base;
  bounded.max_recv_rows = 4 * 3 * 2;
  const auto ht = test::run_layer<Tab>(bounded, w, g, {.placement = table});
  CHECK(ht.stats[0][0].rounds == 7);  // 14-token chunks in windows of 2
  CHECK(test::relative_error(ht.y, test::run_layer<TabFlat>(base, w, g, {.placement = table}).y) <=
        1e-6);
}

TEST_CASE("hierarchical: rows and bytes per level match a hand count", "[layer][hierarchical]") {
  // 4 ranks as 2 nodes x 2, one expert per rank, top-2, the gate the identity. Rank 0 holds:
  //   t0 -> (1, 0): rank 1, rank 0: its own node only
  //   t1 -> (2, 3): both on node 1: one row crosses, rank 2 fans it out to rank 3
  //   t2 -> (0, 2): one row to node 1 (rank 2), one stays
  // The other ranks hold no tokens.
  const layer_config cfg{.hidden = 4,
                         .ffn = 3,
                         .experts = 4,
                         .top_k = 2,
                         .ranks = 4,
                         .max_tokens = 3,
                         .ranks_per_node = 2};
  auto w = reference::full_weights::random(cfg, 9);
  std::fill(w.gate.begin(), w.gate.end(), 0.f);
  for (int e = 0; e < 4; ++e) w.gate[e * cfg.hidden + e] = 1.f;
  test::global_tokens g{{3, 0, 0, 0}, std::vector<float>(3 * cfg.hidden, 0.f)};
  const int pick[3][2] = {{1, 0}, {2, 3}, {0, 2}};
  for (int t = 0; t < 3; ++t) {
    g.x[t * cfg.hidden + pick[t][0]] = 2.f;
    g.x[t * cfg.hidden + pick[t][1]] = 1.f;
  }
  const index_t row = cfg.hidden * sizeof(float), meta = 8;
  const auto hier = test::run_layer<policies<2>>(cfg, w, g);
  const auto plain = test::run_layer<flat<2>>(cfg, w, g);
  CHECK(test::relative_error(hier.y, plain.y) <= 1e-6);
  const pass_stats &h0 = hier.stats[0][0], &h2 = hier.stats[2][0], &h3 = hier.stats[3][0];
  const pass_stats& f0 = plain.stats[0][0];
  // Flat dedup: to rank 1 t0; to rank 2 t1, t2; to rank 3 t1: 1 row inside the node, 3 across.
  CHECK(f0.intra_node.rows_sent == 1);
  CHECK(f0.inter_node.rows_sent == 3);
  CHECK(f0.inter_node.bytes_sent == 3 * row + 3 * meta);
  // Hierarchical: t1 and t2 cross once each, to rank 2 (rank 0's peer on node 1).
  CHECK(h0.inter_node.rows_sent == 2);
  CHECK(h0.intra_node.rows_sent == 1);  // t0 to rank 1
  CHECK(h0.inter_node.bytes_sent == 2 * row + 3 * meta);
  CHECK(h0.intra_node.bytes_sent == 1 * row + 1 * meta);
  CHECK(h2.inter_node.rows_received == 2);
  CHECK(h2.intra_node.rows_sent == 1);  // t1 on to rank 3
  CHECK(h3.intra_node.rows_received == 1);
  CHECK(h3.inter_node.rows_received == 0);
  CHECK(h3.inter_node.bytes_received == 1 * meta);  // t1's metadata goes straight to rank 3
  CHECK(h0.combine_bytes_received == 3 * row);
  CHECK(h2.combine_bytes_sent == 2 * row);  // the sums of t1 (ranks 2 and 3) and t2 home
}

TEST_CASE("hierarchical: node-limited routing crosses at most M nodes per token",
          "[layer][hierarchical]") {
  // DeepSeek-V3's group limit with one group per node: 8 ranks as 4 nodes x 2, 32 experts in
  // 4 groups (block placement: group n = node n's experts), top-4 within the best M = 2.
  constexpr int K = 4, M = 2, R = 8, G = 2;
  layer_config cfg = shape(R, G, K);
  cfg.experts = 32;
  using node_limited = limited_policies<K, true>;
  using flat_limited = limited_policies<K, false>;
  const epmoe::router::sigmoid_bias<K> limited{.groups = R / G, .top_groups = M};
  const auto w = reference::full_weights::random(cfg, 77);
  const auto g = tokens_for(R, cfg.hidden, 78);
  node_pairs pairs{std::vector<index_t>(R), std::vector<index_t>(R)};
  const auto hier = test::run_layer<node_limited>(
      cfg, w, g, {.router = limited, .between = count_pairs<node_limited>(pairs, G)});
  const auto plain = test::run_layer<flat_limited>(cfg, w, g, {.router = limited});
  CHECK(test::relative_error(hier.y, plain.y) <= 1e-6);
  CHECK(test::relative_error(
            hier.y, test::run_reference<flat_limited>(cfg, w, g, {.router = limited})) <= 1e-4);
  int ranks = 0;
  index_t crossed = 0, flat_crossed = 0;
  for (int r = 0; r < R; ++r) {
    const pass_stats& s = hier.stats[r][0];
    CAPTURE(r);
    CHECK(s.inter_node.rows_sent == pairs.other[r]);
    CHECK(s.inter_node.rows_sent + pairs.own[r] <= s.tokens * M);  // every node it reaches
    CHECK(s.inter_node.rows_sent <= s.tokens * M);
    crossed += s.inter_node.rows_sent;
    flat_crossed += plain.stats[r][0].inter_node.rows_sent;
    ++ranks;
  }
  CHECK(ranks == R);
  CHECK(crossed < flat_crossed);  // top-4 over 2 nodes of 2 ranks: some tokens share a node
}

// The two-level bundle over comm::throttled (which knows its nodes from node_links).
struct over_links : policies<2> {
  using comm = epmoe::comm::throttled<epmoe::comm::threads>;
};

// One hierarchical pass of moe_layer<P> on `world`'s ranks, each comm made by make(threads):
// every rank's outputs (global order) and stats.
template <class P, class Make>
std::pair<std::vector<float>, std::vector<pass_stats>> pass_on(comm::threads_world& world,
                                                               const layer_config& cfg,
                                                               const reference::full_weights& w,
                                                               const test::global_tokens& g,
                                                               Make make) {
  std::vector<float> y(g.x.size(), std::numeric_limits<float>::quiet_NaN());
  std::vector<pass_stats> stats(static_cast<std::size_t>(cfg.ranks));
  world.run([&](comm::threads c) {
    const int r = c.rank();
    const placement::block where(cfg);
    test::rank_arrays<P> arrays(w, reference::slice(w, where, r));
    moe_layer<P> layer(cfg, make(c), arrays.views(cfg, where.slots_per_rank()));
    const index_t T = g.per_rank[r], H = cfg.hidden;
    layer.forward({g.x.data() + g.offset(r) * H, T, H}, {y.data() + g.offset(r) * H, T, H});
    stats[r] = layer.stats();
  });
  return {y, stats};
}

// comm::threads that delivers every non-blocking exchange when it starts (MPI may, any time
// before the wait): a receive slot the layer still reads when a later unit's rows arrive
// shows up as a wrong output here, where comm::threads itself delivers at the wait.
struct eager : comm::threads {
  explicit eager(comm::threads c) : comm::threads(c) {}
  struct request {
    void wait() {}
    bool test() { return true; }
  };
  template <class T>
  request ialltoallv(const T* send, const index_t* sn, const index_t* sd, T* recv,
                     const index_t* rn, const index_t* rd) {
    alltoallv(send, sn, sd, recv, rn, rd);
    return {};
  }
};
template <bool Hier>
struct eager_policies
    : policies<2, capacity::dropless, schedule::pipelined<3>, placement::block, Hier> {
  using comm = eager;
};

TEST_CASE("hierarchical and dedup: a receive bound's slots hold while later windows arrive",
          "[layer][hierarchical][rounds]") {
  layer_config cfg = shape(4, 2, 2);
  const auto w = reference::full_weights::random(cfg, 12);
  const auto g = tokens_for(4, cfg.hidden, 13);
  const auto free = test::run_layer<flat<2>>(cfg, w, g);
  cfg.max_recv_rows = 4 * 3 * 2;  // windows of 2 tokens, 3 in flight
  int runs = 0;
  for (const bool hier : {true, false}) {
    CAPTURE(hier);
    comm::threads_world world(4);
    const auto make = [](comm::threads c) { return eager(c); };
    const auto run = hier ? pass_on<eager_policies<true>>(world, cfg, w, g, make)
                          : pass_on<eager_policies<false>>(world, cfg, w, g, make);
    CHECK(test::relative_error(run.first, free.y) <= 1e-6);
    CHECK(run.second[0].rounds == 7);  // 14-token chunks
    ++runs;
  }
  CHECK(runs == 2);
}

TEST_CASE("hierarchical: the nodes come from the comm when the config leaves them at 0",
          "[layer][hierarchical]") {
  layer_config cfg = shape(4, 0, 2);
  const auto w = reference::full_weights::random(cfg, 3);
  const auto g = tokens_for(4, cfg.hidden, 4);
  layer_config two = cfg;
  two.ranks_per_node = 2;
  const auto flat2 = test::run_layer<flat<2>>(two, w, g);
  // comm::threads of a world with emulated nodes; comm::throttled with two link classes
  // (fast links keep it quick).
  comm::threads_world nodes(4, 2);
  const auto by_world = pass_on<policies<2>>(nodes, cfg, w, g, [](comm::threads c) { return c; });
  using Throttled = comm::throttled<comm::threads>;
  const comm::node_links links{.intra = {.bandwidth = 1e12, .latency = 0},
                               .inter = {.bandwidth = 1e12, .latency = 0},
                               .ranks_per_node = 2};
  comm::threads_world plain(4);
  const auto by_links =
      pass_on<over_links>(plain, cfg, w, g, [&](comm::threads c) { return Throttled(c, links); });
  int ranks = 0;
  for (const auto* run : {&by_world, &by_links}) {
    CHECK(test::relative_error(run->first, flat2.y) <= 1e-6);
    for (int r = 0; r < 4; ++r) {
      CHECK(run->second[r].ranks_per_node == 2);
      CHECK(run->second[r].inter_node.rows_sent <= flat2.stats[r][0].inter_node.rows_sent);
      ++ranks;
    }
  }
  CHECK(ranks == 8);
  // Nodes that do not divide the ranks: named, from the config and from the world.
  CHECK_THROWS_WITH(shape(4, 3, 2).validate(),
                    Catch::Contains("ranks_per_node = 3") && Catch::Contains("must divide ranks"));
  CHECK_THROWS_WITH(comm::threads_world(4, 3), Catch::Contains("ranks_per_node = 3"));
}
