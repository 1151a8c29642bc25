// SPDX-FileCopyrightText: 2026 The epmoe authors
// SPDX-License-Identifier: Apache-2.0
//
// The simulator's lost ranks, and its two-level (hierarchical) and low-latency exchanges,
// priced and counted by hand (test_simulate.cpp has the flat exchange, calibration and
// validation).
#include <catch2/catch.hpp>
#include <set>
#include <sstream>
#include <utility>

#include "../layer/harness.hpp"
#include <epmoe/core/report.hpp>
#include <epmoe/placement/balancer.hpp>
#include <epmoe/placement/round_robin.hpp>
#include <epmoe/schedule/pipelined.hpp>
#include <epmoe/sim/calibrate.hpp>
#include <epmoe/sim/simulate.hpp>
#include <epmoe/sim/source.hpp>
#include <epmoe/sim/trace.hpp>
#include <epmoe/sim/validate.hpp>

using namespace epmoe;

TEST_CASE("sim: what if ranks die: the survivors on their nodes, every row served", "[sim]") {
  // 16 ranks in 2 nodes, every expert twice (rank r holds its block and the next rank's).
  const int R = 16, L = 4, E = R * L;
  std::vector<int> phy;
  for (int r = 0; r < R; ++r)
    for (int q : {r, (r + 1) % R})
      for (int j = 0; j < L; ++j) phy.push_back(q * L + j);
  const placement::table where(E, R, phy);
  std::vector<char> lost(R, 0);
  lost[3] = lost[12] = 1;
  const placement::table after = placement::surviving(where, lost);
  REQUIRE(after.ranks() == 14);
  const auto topo = sim::h100_nvlink_ib(2);
  const sim::topology t14 = sim::surviving(topo, lost);
  CHECK(t14.ranks() == 14);
  int checked = 0;
  for (int r = 0, k = 0; r < R; ++r)
    if (!lost[r]) {
      CHECK(t14.node_of(k) == topo.node_of(r));               // each survivor on its node
      CHECK(after.expert_at(k, 0) == where.expert_at(r, 0));  // and with its slots
      ++k, ++checked;
    }
  CHECK(checked == 14);
  const layer_config cfg{
      .hidden = 256, .ffn = 128, .experts = E, .top_k = 4, .ranks = 14, .max_tokens = 64};
  const auto src = sim::zipf(E, 1.2, 4, 64, 3);
  const auto s = sim::simulate<sim::policies<placement::table>>(cfg, t14, src, {}, after);
  CHECK(s.assignments == index_t{14} * 64 * 4);
  CHECK(s.dropped == 0);
  index_t served = 0;
  for (index_t n : s.rows_per_slot) served += n;
  CHECK(served == s.assignments);  // the lost copies' rows went to the surviving ones
  CHECK(s.straggler >= 0);
  CHECK(s.straggler < 14);
  // Two neighbours lost: block 12 (experts 48-51) had its copies on ranks 11 and 12 only.
  lost[11] = 1;
  CHECK_THROWS_WITH(placement::surviving(where, lost),
                    Catch::Contains("expert(s) 48, 49, 50, 51 ("));
}

namespace {

// Counted from the routing and block placement alone, per rank: what each level of the
// hierarchical exchange moves and what the flat dedup exchange sends across nodes.
struct level_counts {
  std::vector<index_t> inter_out, inter_in, intra_out, intra_in;  // hierarchical rows
  std::vector<index_t> flat_inter_out;                            // unique (token, rank) rows
  std::vector<index_t> meta_inter_out;                            // assignments to other nodes
  index_t tokens = 0, widest = 0;  // tokens counted; most nodes one token reaches
};

template <class Source>
level_counts count_levels(const layer_config& cfg, int G, const Source& src) {
  const int R = cfg.ranks, K = cfg.top_k;
  const placement::block where(cfg);
  level_counts n;
  for (auto* v :
       {&n.inter_out, &n.inter_in, &n.intra_out, &n.intra_in, &n.flat_inter_out, &n.meta_inter_out})
    v->assign(static_cast<std::size_t>(R), 0);
  for (int h = 0; h < R; ++h) {
    const index_t T = src.tokens(h);
    std::vector<std::int32_t> ids(static_cast<std::size_t>(T * K));
    std::vector<float> w(ids.size());
    src.route(h, {{ids.data(), T, K}, {w.data(), T, K}});
    for (index_t t = 0; t < T; ++t, ++n.tokens) {
      std::set<int> ranks, nodes;
      for (int k = 0; k < K; ++k) {
        const int e = where.rank_of(ids[t * K + k]);
        ranks.insert(e);
        nodes.insert(e / G);
        if (e / G != h / G) ++n.meta_inter_out[h];
      }
      n.widest = std::max(n.widest, static_cast<index_t>(nodes.size()));
      for (int m : nodes)
        if (m != h / G) ++n.inter_out[h], ++n.inter_in[m * G + h % G];
      for (int e : ranks) {
        const int f = e / G * G + h % G;  // the relay: the home's local index on e's node
        if (e != f) ++n.intra_out[f], ++n.intra_in[e];
        if (e / G != h / G) ++n.flat_inter_out[h];
      }
    }
  }
  return n;
}

}  // namespace

TEST_CASE("sim: hierarchical rows per level equal the (token, node) pairs counted by hand",
          "[sim][hierarchical]") {
  // 8 ranks in 2 nodes of 4, 16 experts (2 per rank), top-4, 12 tokens per rank.
  const layer_config cfg{
      .hidden = 64, .ffn = 32, .experts = 16, .top_k = 4, .ranks = 8, .max_tokens = 12};
  auto topo = sim::h100_nvlink_ib(2);
  topo.ranks_per_node = 4;
  const auto src = sim::zipf(16, 1.0, 4, 12, 9);
  const auto n = count_levels(cfg, 4, src);
  const auto h = sim::simulate<sim::hierarchical_policies<>>(cfg, topo, src);
  const auto f =
      sim::simulate<sim::policies<placement::block, capacity::dropless, true>>(cfg, topo, src);
  CHECK(h.hierarchical);
  CHECK_FALSE(f.hierarchical);
  const double row = 64 * 2;  // bf16 rows of H = 64
  int checked = 0;
  index_t pairs = 0;
  for (int r = 0; r < 8; ++r) {
    INFO("rank " << r);
    const sim::rank_result& me = h.per_rank[r];
    CHECK(me.rows_out[1] == n.inter_out[r]);  // one row per (token, other node)
    CHECK(me.rows_in[1] == n.inter_in[r]);    // the node rows it relays
    CHECK(me.rows_out[0] == n.intra_out[r]);  // their copies to the node's other ranks
    CHECK(me.rows_in[0] == n.intra_in[r]);
    CHECK(me.dispatch_bytes.out[1] == n.inter_out[r] * row + n.meta_inter_out[r] * 8.0);
    CHECK(me.combine_bytes.in[1] == n.inter_out[r] * row);
    CHECK(f.per_rank[r].rows_out[1] == n.flat_inter_out[r]);
    pairs += n.inter_out[r];
    ++checked;
  }
  CHECK(checked == 8);
  CHECK(n.tokens == 8 * 12);
  CHECK(h.dispatch_rows[1] == pairs);
  CHECK(pairs > 0);
  CHECK(pairs < f.dispatch_rows[1]);  // some token has two experts' ranks on one other node
  // Both exchanges move the same expert rows: the expert stage and drops do not change.
  CHECK(h.rows_per_slot == f.rows_per_slot);
}

TEST_CASE("sim: two-level dispatch at 64 ranks, DeepSeek-V3-like node-limited routing",
          "[sim][hierarchical]") {
  // 64 GPUs in 8 nodes, 256 experts (a group of 32 per node under block placement), top-8 of
  // the 4 best groups.
  const layer_config cfg{
      .hidden = 7168, .ffn = 2048, .experts = 256, .top_k = 8, .ranks = 64, .max_tokens = 256};
  const sim::group_limited_source src(std::vector<double>(256, 1.0), 8, 256, 8, 4, 3);
  const auto n = count_levels(cfg, 8, src);
  CHECK(n.tokens == 64 * 256);
  CHECK(n.widest == 4);  // node-limited: no token reaches a fifth node, and some reach four
  index_t pairs = 0, unique = 0, meta = 0;
  for (int r = 0; r < 64; ++r)
    pairs += n.inter_out[r], unique += n.flat_inter_out[r], meta += n.meta_inter_out[r];

  const auto topo = sim::h100_nvlink_ib(8);  // NIC 50 GB/s vs NVLink 450 GB/s per GPU
  using Flat = sim::policies<placement::block, capacity::dropless, true>;
  const auto f = sim::simulate<Flat>(cfg, topo, src);
  const auto h = sim::simulate<sim::hierarchical_policies<>>(cfg, topo, src);
  const double row = 7168 * 2;
  CHECK(f.dispatch_rows[1] == unique);
  CHECK(h.dispatch_rows[1] == pairs);
  // Metadata goes straight to the expert ranks either way: the same bytes in both.
  CHECK(f.dispatch_bytes[1] == unique * row + meta * 8.0);
  CHECK(h.dispatch_bytes[1] == pairs * row + meta * 8.0);
  CHECK((h.dispatch_bytes[1] - meta * 8.0) / (f.dispatch_bytes[1] - meta * 8.0) ==
        Approx(double(pairs) / double(unique)).epsilon(1e-12));
  CHECK(h.combine_bytes[1] / f.combine_bytes[1] ==
        Approx(double(pairs) / double(unique)).epsilon(1e-12));
  CHECK(double(pairs) / double(unique) < 0.6);  // ~8 ranks of 4 nodes -> 4 nodes (3 crossing)
  // Flat, every rank's dispatch waits on its NIC; two levels cut those bytes and win.
  int nic_bound = 0;
  for (int r = 0; r < 64; ++r)
    nic_bound += sim::bottleneck(topo, f.per_rank[r].dispatch_bytes) == sim::link::inter;
  CHECK(nic_bound == 64);
  CHECK(h.stages.dispatch[0] < f.stages.dispatch[0]);
  CHECK(h.latency < f.latency);
  CHECK(h.stages.experts == f.stages.experts);
  // With the NIC as fast as NVLink the sequential second level costs more than it saves.
  auto flat_net = topo;
  flat_net.inter_bandwidth = flat_net.intra_bandwidth;
  flat_net.inter_latency = flat_net.intra_latency;
  CHECK(sim::simulate<sim::hierarchical_policies<>>(cfg, flat_net, src).latency >
        sim::simulate<Flat>(cfg, flat_net, src).latency);
}

TEST_CASE("sim: the hierarchical exchange refuses what the layer refuses", "[sim][hierarchical]") {
  layer_config cfg{.hidden = 16, .ffn = 8, .experts = 16, .top_k = 2, .ranks = 8, .max_tokens = 16};
  const auto src = sim::uniform(16, 2, 16, 1);
  auto topo = sim::h100_nvlink_ib(2);
  topo.ranks_per_node = 4;
  using H = sim::hierarchical_policies<>;
  CHECK_NOTHROW(sim::simulate<H>(cfg, topo, src));
  cfg.max_recv_rows = 8;  // a window of one token per rank, as in the layer
  CHECK(sim::simulate<H>(cfg, topo, src).rounds == 16);
  cfg.max_recv_rows = 7;
  CHECK_THROWS_WITH(sim::simulate<H>(cfg, topo, src), Catch::Contains("max_recv_rows"));
  cfg.max_recv_rows = 0;
  cfg.ranks_per_node = 2;
  CHECK_THROWS_WITH(sim::simulate<H>(cfg, topo, src), Catch::Contains("ranks_per_node"));
  cfg.ranks_per_node = 0;
  std::vector<char> lost(8, 0);
  lost[5] = 1;
  cfg.ranks = 7;
  const auto survivors = sim::surviving(topo, lost);  // 4 + 3 ranks: nodes of unequal size
  const placement::table where = placement::surviving(
      placement::table(16, 8,
                       [] {
                         std::vector<int> phy;  // every expert twice: rank r and the next
                         for (int r = 0; r < 8; ++r)
                           for (int q : {r, (r + 1) % 8})
                             for (int j = 0; j < 2; ++j) phy.push_back(q * 2 + j);
                         return phy;
                       }()),
      lost);
  CHECK_THROWS_WITH(
      (sim::simulate<sim::hierarchical_policies<placement::table>>(cfg, survivors, src, {}, where)),
      Catch::Contains("topology.rank_nodes"));
}

TEST_CASE("sim: the group-limited source keeps each token in its top groups", "[sim]") {
  // 24 experts in 6 groups, top-2 groups, top-5; group 5 carries no load.
  std::vector<double> load(24, 1.0);
  for (int e = 20; e < 24; ++e) load[e] = 0;
  load[3] = 6;
  const sim::group_limited_source src(load, 5, 400, 6, 2, 7);
  std::vector<std::int32_t> ids(400 * 5);
  std::vector<float> w(ids.size());
  src.route(2, {{ids.data(), 400, 5}, {w.data(), 400, 5}});
  std::vector<int> per_group(6, 0);
  int checked = 0;
  for (int t = 0; t < 400; ++t) {
    std::set<int> experts, groups;
    for (int k = 0; k < 5; ++k) experts.insert(ids[t * 5 + k]), groups.insert(ids[t * 5 + k] / 4);
    CHECK(experts.size() == 5);  // distinct
    CHECK(groups.size() == 2);   // 5 experts never fit one group of 4
    for (int g : groups) ++per_group[g];
    ++checked;
  }
  CHECK(checked == 400);
  CHECK(per_group[5] == 0);
  CHECK(per_group[0] > per_group[1]);  // expert 3's load makes group 0 the most picked
  for (int g = 1; g < 5; ++g) CHECK(per_group[g] > 0);
  CHECK(w[0] == Approx(0.2));
  // Deterministic per rank.
  std::vector<std::int32_t> again(ids.size());
  src.route(2, {{again.data(), 400, 5}, {w.data(), 400, 5}});
  CHECK(again == ids);
  CHECK_THROWS_WITH(sim::group_limited_source(std::vector<double>(24, 1.0), 9, 4, 6, 2),
                    Catch::Contains("source.load"));  // 2 groups of 4 hold 8 < 9 experts
  CHECK_THROWS_WITH(sim::group_limited_source(std::vector<double>(24, 1.0), 2, 4, 5, 2),
                    Catch::Contains("source.groups"));
}

TEST_CASE("sim: the two-level exchange priced by hand", "[sim][hierarchical][cost]") {
  // 2 nodes of 2 ranks, one expert each; rank 0's 10 tokens go to experts 2 and 3 (node 1),
  // the other ranks have none. Rows of 100 x 2 bytes; NVLink 1e9 B/s (1 us), NIC 1e8 (10 us).
  struct hand_source {
    index_t tokens(int r) const { return r == 0 ? 10 : 0; }
    void route(int, mutable_routing_view out) const {
      for (index_t t = 0; t < out.tokens(); ++t)
        out.ids(t, 0) = 2, out.ids(t, 1) = 3, out.weights(t, 0) = out.weights(t, 1) = 0.5f;
    }
  };
  const sim::topology topo{"hand", 2, 2, 1e9, 1e-6, 1e8, 1e-5, 1e12, 1e11, 2, 2};
  const layer_config cfg{
      .hidden = 100, .ffn = 50, .experts = 4, .top_k = 2, .ranks = 4, .max_tokens = 10};
  const auto h = sim::simulate<sim::hierarchical_policies<>>(cfg, topo, hand_source{});
  const double copy = 200 / 5e10;  // one row at memory / 2
  // Rank 0: one node row per token to rank 2 (its local index on node 1) with the 20
  // assignments' metadata straight to ranks 2 and 3; nothing inside its node.
  CHECK(h.per_rank[0].send_rows == 10);
  CHECK(h.per_rank[0].self_rows == 0);
  CHECK(h.per_rank[0].rows_out[1] == 10);
  CHECK(h.per_rank[0].rows_out[0] == 0);
  CHECK(h.per_rank[0].dispatch == Approx(1e-5 + (2000 + 160) / 1e8).epsilon(1e-12));
  // Rank 2: receives them with its 10 assignments' metadata, then relays a copy to rank 3
  // (the second exchange, after the first) and keeps one; it copies 10 rows to itself, 20
  // into the fan-out and regroups the 10 it computes.
  CHECK(h.per_rank[2].rows_in[1] == 10);
  CHECK(h.per_rank[2].rows_out[0] == 10);
  CHECK(h.per_rank[3].rows_in[0] == 10);
  CHECK(h.per_rank[2].peak_recv_rows == 10);
  CHECK(h.per_rank[3].peak_recv_rows == 10);
  const double level1 = 1e-5 + 2080 / 1e8, level2 = 1e-6 + 2000 / 1e9;
  CHECK(h.per_rank[2].dispatch == Approx(level1 + level2 + 40 * copy).epsilon(1e-12));
  // The combine: the sums back inside the node, then home (no metadata).
  CHECK(h.per_rank[2].combine ==
        Approx(1e-5 + 2000 / 1e8 + 1e-6 + 2000 / 1e9 + 40 * copy).epsilon(1e-12));
  // Rank 3: its metadata over the NIC, then the relayed rows over NVLink.
  CHECK(h.per_rank[3].dispatch ==
        Approx(1e-5 + 80 / 1e8 + 1e-6 + 2000 / 1e9 + 10 * copy).epsilon(1e-12));
  CHECK(h.stages.dispatch[0] == Approx(h.per_rank[2].dispatch).epsilon(1e-12));
  CHECK(h.dispatch_rows[1] == 10);
  CHECK(h.dispatch_rows[0] == 10);
  // Flat dedup sends both rows over the NIC: 20 rows and the same metadata.
  const auto f = sim::simulate<sim::policies<placement::block, capacity::dropless, true>>(
      cfg, topo, hand_source{});
  CHECK(f.per_rank[0].dispatch == Approx(1e-5 + (4000 + 160) / 1e8).epsilon(1e-12));
  CHECK(f.dispatch_rows[1] == 20);
}

struct sim_ll_policies : sim::policies<> {
  static constexpr layer_options options{.low_latency = true};
};

TEST_CASE("sim: the low-latency exchange priced by hand: one round, fixed slots",
          "[sim][low_latency][cost]") {
  // As above: 2 nodes of 2 ranks, one expert each, rank 0's 10 tokens to experts 2 and 3.
  struct hand_source {
    index_t tokens(int r) const { return r == 0 ? 10 : 0; }
    void route(int, mutable_routing_view out) const {
      for (index_t t = 0; t < out.tokens(); ++t)
        out.ids(t, 0) = 2, out.ids(t, 1) = 3, out.weights(t, 0) = out.weights(t, 1) = 0.5f;
    }
  };
  const sim::topology topo{"hand", 2, 2, 1e9, 1e-6, 1e8, 1e-5, 1e12, 1e11, 2, 2};
  const layer_config cfg{
      .hidden = 100, .ffn = 50, .experts = 4, .top_k = 2, .ranks = 4, .max_tokens = 10};
  const auto ll = sim::simulate<sim_ll_policies>(cfg, topo, hand_source{});
  const auto flat = sim::simulate<sim::policies<>>(cfg, topo, hand_source{});
  CHECK(ll.low_latency);
  CHECK_FALSE(flat.low_latency);
  // A slot: S = 10 tokens x min(K, L) = 10 rows of 200 bytes, after a head of one row (the
  // counts message, 8 int64); every rank sends one to each peer whatever its tokens: 1 on its
  // node, 2 on the other.
  CHECK(ll.slot_bytes == 11 * 200);
  const double copy = 200 / 5e10;
  int checked = 0;
  for (int r = 0; r < 4; ++r) {
    INFO("rank " << r);
    const sim::rank_result& me = ll.per_rank[r];
    CHECK(me.counts == 0);  // no counts round
    CHECK(flat.per_rank[r].counts > 0);
    CHECK(me.dispatch_bytes.out[0] == 2200);
    CHECK(me.dispatch_bytes.out[1] == 2 * 2200);
    CHECK(me.combine_bytes.in[1] == 2 * 2200);
    // One exchange per direction: the NIC's alpha once plus the fixed bytes (and the regroup
    // of what the rank computes: ranks 2 and 3 receive 10 rows each).
    const double local = r >= 2 ? 10 * copy : 0;
    CHECK(me.dispatch == Approx(1e-5 + 4400 / 1e8 + local).epsilon(1e-12));
    CHECK(me.combine == Approx(1e-5 + 4400 / 1e8 + local).epsilon(1e-12));
    ++checked;
  }
  CHECK(checked == 4);
  // The same rows reach the same experts.
  CHECK(ll.rows_per_slot == flat.rows_per_slot);
  CHECK(ll.stages.experts == flat.stages.experts);
  // Decode (1 token per rank) on a latency-bound link: one round less wins; a prefill of 256
  // tokens pays for its fixed slots.
  const sim::topology slow{"slow", 1, 4, 1e9, 2e-4, 1e9, 2e-4, 1e12, 1e11, 2, 2};
  layer_config decode = cfg;
  decode.max_tokens = 1;
  const auto one = sim::uniform(4, 2, 1, 3);
  CHECK(sim::simulate<sim_ll_policies>(decode, slow, one).latency <
        sim::simulate<sim::policies<>>(decode, slow, one).latency);
  layer_config prefill = cfg;
  prefill.max_tokens = 256;
  const auto many = sim::uniform(4, 2, 64, 3);  // 64 of 256 tokens: the slots are mostly empty
  CHECK(sim::simulate<sim_ll_policies>(prefill, slow, many).latency >
        sim::simulate<sim::policies<>>(prefill, slow, many).latency);
  layer_config piped = cfg;
  CHECK_THROWS_WITH(sim::simulate<sim_ll_policies>(piped, topo, hand_source{}, {.chunks = 2}),
                    Catch::Contains("chunks"));
}
