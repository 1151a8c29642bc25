// SPDX-FileCopyrightText: 2026 The epmoe authors
// SPDX-License-Identifier: Apache-2.0
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

namespace {

template <class Placement, class Capacity = capacity::dropless, bool Dedup = false>
struct policies : test::threads_policies<2, Capacity> {
  using placement = Placement;
  static constexpr epmoe::layer_options options{.dedup = Dedup};
};

template <class Placement, class Capacity = capacity::dropless>
struct hier_policies : test::threads_policies<2, Capacity> {
  using placement = Placement;
  static constexpr epmoe::layer_options options{.dedup = true, .hierarchical = true};
};

template <class Placement, int C>
struct pipelined_policies : policies<Placement> {
  using schedule = epmoe::schedule::pipelined<C>;
};

template <class Placement, int C>
struct dedup_pipelined_policies : policies<Placement, capacity::dropless, true> {
  using schedule = epmoe::schedule::pipelined<C>;
};

// The layer reproduces a simulated routing through a hand-made gate: with H >= E, gate row
// e = unit vector e and a token that is K - k at its k-th expert (0 elsewhere), top-k picks
// exactly the source's experts, in the source's order.
reference::full_weights hand_gate(const layer_config& cfg, std::uint64_t seed) {
  auto w = reference::full_weights::random(cfg, seed);
  std::fill(w.gate.begin(), w.gate.end(), 0.f);
  for (int e = 0; e < cfg.experts; ++e) w.gate[e * cfg.hidden + e] = 1.f;
  return w;
}

template <class Source>
test::global_tokens tokens_of(const layer_config& cfg, const Source& src) {
  test::global_tokens g;
  const int K = cfg.top_k;
  for (int r = 0; r < cfg.ranks; ++r) {
    const index_t T = src.tokens(r);
    std::vector<std::int32_t> ids(static_cast<std::size_t>(T * K));
    std::vector<float> w(ids.size());
    src.route(r, {{ids.data(), T, K}, {w.data(), T, K}});
    g.per_rank.push_back(T);
    for (index_t t = 0; t < T; ++t) {
      std::vector<float> x(static_cast<std::size_t>(cfg.hidden), 0.f);
      for (int k = 0; k < K; ++k) x[ids[t * K + k]] = float(K - k);
      g.x.insert(g.x.end(), x.begin(), x.end());
    }
  }
  return g;
}

// Rank by rank, the simulator's counts equal what the layer's pass_stats report; where the
// layer split its traffic by the topology's nodes, per link class too. Returns the ranks whose
// link classes were compared.
template <class P>
int check_against_layer(const layer_config& cfg, const typename P::placement& where,
                        const typename P::capacity& cap = {}, int chunks = 1) {
  const auto src = sim::zipf(cfg.experts, 1.2, cfg.top_k, cfg.max_tokens, 5);
  const auto topo = sim::cpu_cluster(cfg.ranks / 2);  // fp32 rows, as the host layer sends
  const auto w = hand_gate(cfg, 3);
  const auto g = tokens_of(cfg, src);
  test::run_options<P> opt;
  opt.placement = where;
  opt.capacity = cap;
  const auto run = test::run_layer<P>(cfg, w, g, opt);
  const auto s =
      sim::simulate<P>(cfg, topo, src, {.chunks = chunks, .keep_peer_counts = true}, where, cap);
  if (cfg.max_recv_rows > 0) CHECK(s.quota > 0);
  const int R = cfg.ranks, L = where.slots_per_rank();
  index_t dropped = 0;
  int levels = 0;
  for (int r = 0; r < R; ++r) {
    const pass_stats& st = run.stats[r][0];
    const sim::rank_result& me = s.per_rank[r];
    INFO("rank " << r);
    CHECK(me.assignments == st.assignments);
    CHECK(me.dropped == st.dropped);
    CHECK(me.padding == st.padding_rows);
    dropped += st.dropped;
    for (int q = 0; q < R; ++q) {
      CHECK(s.rows_sent[r * R + q] == st.rows_sent[q]);
      CHECK(s.assignment_rows_sent[r * R + q] == st.assignment_rows_sent[q]);
    }
    for (int j = 0; j < L; ++j) {
      CHECK(s.rows_per_slot[r * L + j] == st.rows_per_local_expert[j]);
      CHECK(s.padded_rows_per_slot[r * L + j] == st.padded_rows_per_local_expert[j]);
    }
    const auto& d = me.dispatch_bytes;
    CHECK(d.out[0] + d.out[1] == double(st.dispatch_bytes_sent));
    CHECK(d.in[0] + d.in[1] == double(st.dispatch_bytes_received));
    CHECK(me.combine_bytes.out[0] + me.combine_bytes.out[1] == double(st.combine_bytes_sent));
    CHECK(me.combine_bytes.in[0] + me.combine_bytes.in[1] == double(st.combine_bytes_received));
    CHECK(me.peak_recv_rows == st.peak_recv_rows);
    CHECK(s.rounds == st.rounds);
    if (st.ranks_per_node == topo.ranks_per_node) {
      const link_traffic* by_class[2] = {&st.intra_node, &st.inter_node};
      for (int l = 0; l < 2; ++l) {
        INFO("link class " << l);
        CHECK(me.rows_out[l] == by_class[l]->rows_sent);
        CHECK(me.rows_in[l] == by_class[l]->rows_received);
        CHECK(d.out[l] == double(by_class[l]->bytes_sent));
        CHECK(d.in[l] == double(by_class[l]->bytes_received));
      }
      ++levels;
    }
    // The rows its slots computed in each exchange unit (chunk, or round of a chunk), in the
    // layer's order.
    std::vector<index_t> layer_rows, sim_rows;
    for (const auto& e : st.timeline)
      if (e.stage == stage_kind::experts) layer_rows.push_back(e.rows);
    for (int u = 0; u < s.units; ++u) sim_rows.push_back(s.unit_rows[r * s.units + u]);
    CHECK(sim_rows == layer_rows);
  }
  CHECK(s.dropped == dropped);
  return levels;
}

}  // namespace

TEST_CASE("sim: counts equal a real layer pass on threads, rank by rank", "[sim]") {
  layer_config cfg{.hidden = 16,
                   .ffn = 8,
                   .experts = 8,
                   .top_k = 2,
                   .ranks = 4,
                   .max_tokens = 40,
                   .capacity_factor = 0.75};
  SECTION("block, dropless") {
    check_against_layer<policies<placement::block>>(cfg, placement::block(cfg));
  }
  SECTION("round-robin, capacity factor (drops)") {
    using P = policies<placement::round_robin, capacity::factor<false>>;
    check_against_layer<P>(cfg, placement::round_robin(cfg));
  }
  SECTION("block, dropless, a receive bound: rounds, rank by rank and round by round") {
    cfg.max_recv_rows = 24;  // 6 rows per pair per round
    check_against_layer<policies<placement::block>>(cfg, placement::block(cfg));
  }
  SECTION("round-robin, a receive bound, pipelined in 2 chunks") {
    cfg.max_recv_rows = 36;  // 3 rounds in flight: 3 rows per pair per round
    using P = pipelined_policies<placement::round_robin, 2>;
    check_against_layer<P>(cfg, placement::round_robin(cfg), {}, 2);
  }
  SECTION("pipelined in 3 chunks, unbounded") {
    check_against_layer<pipelined_policies<placement::block, 3>>(cfg, placement::block(cfg), {}, 3);
  }
  SECTION("block, padded capacity") {
    using P = policies<placement::block, capacity::padded_factor>;
    check_against_layer<P>(cfg, placement::block(cfg));
  }
  SECTION("balanced replicated table, capacity and dedup") {
    using P = policies<placement::table, capacity::factor<false>, true>;
    const auto load = sim::zipf(8, 1.2, 2, 40, 5).expected_load();
    const auto t = placement::balance(load, {.ranks = 4, .nodes = 2, .extra_slots = 4}).refined;
    check_against_layer<P>(cfg, t);
  }
  // Two nodes of two ranks (the topology's): node rows between nodes, relayed rows inside.
  SECTION("hierarchical, block, dropless: both levels rank by rank") {
    cfg.ranks_per_node = 2;
    CHECK(check_against_layer<hier_policies<placement::block>>(cfg, placement::block(cfg)) == 4);
  }
  SECTION("hierarchical, replicated table, capacity drops") {
    cfg.ranks_per_node = 2;
    using P = hier_policies<placement::table, capacity::factor<false>>;
    const auto load = sim::zipf(8, 1.2, 2, 40, 5).expected_load();
    const auto t = placement::balance(load, {.ranks = 4, .nodes = 2, .extra_slots = 4}).refined;
    CHECK(check_against_layer<P>(cfg, t) == 4);
  }
  // Dedup with a receive bound: windows of tokens, unit by unit (the rows every window's
  // experts compute, its peak, the count of windows).
  SECTION("hierarchical, a receive bound: windows of 3 tokens") {
    cfg.ranks_per_node = 2;
    cfg.max_recv_rows = 12;
    CHECK(check_against_layer<hier_policies<placement::block>>(cfg, placement::block(cfg)) == 4);
  }
  SECTION("dedup, a receive bound, pipelined in 2 chunks: windows of 2 tokens") {
    cfg.max_recv_rows = 24;
    using P = dedup_pipelined_policies<placement::block, 2>;
    check_against_layer<P>(cfg, placement::block(cfg), {}, 2);
  }
  SECTION("flat dedup split by the same nodes") {
    cfg.ranks_per_node = 2;
    using P = policies<placement::block, capacity::dropless, true>;
    CHECK(check_against_layer<P>(cfg, placement::block(cfg)) == 4);
  }
}

TEST_CASE("sim: the cost model on a hand-computed two-rank case", "[sim][cost]") {
  // Two nodes of one rank: every transfer is inter-node. No copy, regroup or top-k rate
  // given: copies run at memory / 2 = 5e10 B/s, top-k reads 4-byte logits at 1e11 B/s
  // (2.5e10 logits/s).
  sim::topology topo{"hand", 2, 1, 0, 0, 1e9, 1e-5, 1e12, 1e11, 2, 2};
  layer_config cfg{
      .hidden = 100, .ffn = 50, .experts = 2, .top_k = 1, .ranks = 2, .max_tokens = 40};
  // Rank 0: 10 tokens to expert 0 (its own), 30 to expert 1; rank 1: 20 to expert 1.
  const sim::recorded_source src({{0, 0, 40, 1, {10, 30}}, {0, 1, 20, 1, {0, 20}}});
  const auto s = sim::simulate<sim::policies<>>(cfg, topo, src);
  const double copy = 200 / 5e10;  // one 100 x 2-byte row
  // Rows are 100 * 2 bytes: rank 0 sends 30 rows = 6000 B, rank 1 receives them.
  const double comm = 1e-5 + 6000 / 1e9;
  // Dispatch = the exchange + local copies: rank 0 keeps 10 rows and regroups the 10 it
  // receives (its own); rank 1 keeps 20 and regroups 50. Combine copies the same back.
  CHECK(s.per_rank[0].dispatch == Approx(comm + 20 * copy).epsilon(1e-12));
  CHECK(s.per_rank[1].dispatch == Approx(comm + 70 * copy).epsilon(1e-12));
  CHECK(s.per_rank[1].combine == Approx(comm + 70 * copy).epsilon(1e-12));
  CHECK(s.dispatch_bytes[1] == 6000);
  // Rank 0: 10 rows = 3e5 FLOP / 1e12 = 3e-7 s, weights 3*100*50*2 = 3e4 B / 1e11 = 3e-7 s.
  CHECK(s.per_rank[0].experts == Approx(3e-7).epsilon(1e-12));
  // Rank 1: 50 rows = 1.5e6 FLOP -> 1.5e-6 s (compute bound).
  CHECK(s.per_rank[1].experts == Approx(1.5e-6).epsilon(1e-12));
  // Home stages of rank 0 (40 tokens): the gate GEMM 2*40*100*2 FLOP at 1e12 and top-k over
  // 40*2 logits at 2.5e10/s; permute gathers its 40 rows; reduce reads the 40 back and
  // writes 40 output rows.
  CHECK(s.per_rank[0].route == Approx(16000 / 1e12 + 80 / 2.5e10).epsilon(1e-12));
  CHECK(s.per_rank[0].permute == Approx(40 * copy).epsilon(1e-12));
  CHECK(s.per_rank[0].reduce == Approx(80 * copy).epsilon(1e-12));
  CHECK(s.per_rank[0].shared == 0);
  // Counts: one chunk of (2L + 1) = 3 eight-byte counts to the other node.
  const double counts = 1e-5 + 24 / 1e9;
  CHECK(s.per_rank[0].counts == Approx(counts).epsilon(1e-12));
  // Sequential: the slowest rank's route + permute, counts, then dispatch, experts, combine
  // (each the slowest rank's), reduce.
  const double before = 16000 / 1e12 + 80 / 2.5e10 + 40 * copy;
  CHECK(s.latency ==
        Approx(before + counts + 2 * (comm + 70 * copy) + 1.5e-6 + 80 * copy).epsilon(1e-12));
  CHECK(s.straggler == 1);
  CHECK(s.straggler_reason.find("compute") == 0);

  SECTION("a regroup rate prices the copies around the exchanges only") {
    topo.regroup_bandwidth = 1e10;
    const auto d = sim::simulate<sim::policies<>>(cfg, topo, src);
    CHECK(d.per_rank[1].dispatch == Approx(comm + 70 * 200 / 1e10).epsilon(1e-12));
    CHECK(d.per_rank[1].combine == Approx(comm + 70 * 200 / 1e10).epsilon(1e-12));
    CHECK(d.per_rank[0].permute == s.per_rank[0].permute);
  }
  SECTION("a GEMM rate curve prices each slot at the rate of its row count") {
    // 2e11 FLOP/s at 10 rows, 1e12 at 40, log2-interpolated: 20 rows -> 6e11.
    topo.gemm_curve = {{10, 2e11}, {40, 1e12}};
    CHECK(topo.gemm_rate(5) == 2e11);
    CHECK(topo.gemm_rate(20) == Approx(6e11));
    CHECK(topo.gemm_rate(400) == 1e12);
    const auto d = sim::simulate<sim::policies<>>(cfg, topo, src);
    // Rank 0: 10 rows at 2e11 = 1.5e-6 s (above the 3e-7 s weight read); rank 1: 50 rows at 1e12.
    CHECK(d.per_rank[0].experts == Approx(10 * 3e4 / 2e11).epsilon(1e-12));
    CHECK(d.per_rank[1].experts == Approx(1.5e-6).epsilon(1e-12));
    CHECK(d.per_rank[0].route == s.per_rank[0].route);  // the gate GEMM keeps gemm_flops
  }
  SECTION("a reduce rate prices the weighted reduce only") {
    topo.reduce_bandwidth = 4e10;
    const auto d = sim::simulate<sim::policies<>>(cfg, topo, src);
    CHECK(d.per_rank[0].reduce == Approx(80 * 200 / 4e10).epsilon(1e-12));
    CHECK(d.per_rank[0].permute == s.per_rank[0].permute);
    CHECK(d.per_rank[1].dispatch == s.per_rank[1].dispatch);
  }
  SECTION("a receive bound splits the exchanges in rounds, each paying the latency") {
    cfg.max_recv_rows = 20;  // sequential, 2 ranks: 10 rows per pair per round
    const auto b = sim::simulate<sim::policies<>>(cfg, topo, src);
    CHECK(b.quota == 10);
    CHECK(b.rounds == 3);  // rank 0 sends rank 1 30 rows
    CHECK(b.units == 3);
    // Rank 1 gets 10 rows a round; it regroups the same 70 rows in all.
    CHECK(b.per_rank[1].dispatch == Approx(3 * 1e-5 + 6000 / 1e9 + 70 * copy).epsilon(1e-12));
    CHECK(b.per_rank[1].peak_recv_rows == 20);  // rounds 0 and 1: 10 of its own + 10
    CHECK(b.unit_rows == std::vector<index_t>{10, 0, 0, 20, 20, 10});
    CHECK(b.per_rank[1].experts == Approx(s.per_rank[1].experts).epsilon(1e-12));
    // Sequential rounds: each unit's dispatch, experts and combine before the next.
    CHECK(b.timeline.dispatch_start[1] == Approx(b.timeline.combine_end[0]));
  }
  SECTION("dedup adds 8 bytes of metadata per assignment row") {
    const auto d =
        sim::simulate<sim::policies<placement::block, capacity::dropless, true>>(cfg, topo, src);
    CHECK(d.per_rank[0].dispatch_bytes.out[1] == 30 * 200 + 30 * 8);
    CHECK(d.per_rank[0].combine_bytes.in[1] == 30 * 200);
  }
  SECTION("a shared expert runs every home token and adds them to the reduce") {
    cfg.shared_experts = 1;
    const auto d = sim::simulate<sim::policies<>>(cfg, topo, src);
    // 40 rows through one H x F FFN: 40 * 6 * 100 * 50 = 1.2e6 FLOP (compute bound), plus
    // copying the 40 tokens in; reduce reads 40 more rows.
    CHECK(d.per_rank[0].shared == Approx(1.2e6 / 1e12 + 40 * copy).epsilon(1e-12));
    CHECK(d.per_rank[0].reduce == Approx(120 * copy).epsilon(1e-12));
    CHECK(d.latency == Approx(s.latency + d.per_rank[0].shared + 40 * copy).epsilon(1e-12));
  }
}

TEST_CASE("sim: the pipelined schedule by hand", "[sim][cost]") {
  // D0 [0,1]; X0 [1,3]; D1 [1,2]; M0 [3,4]; X1 [3,5]; M1 [5,6].
  const auto t = sim::schedule({{1, 1}, {2, 2}, {1, 1}});
  CHECK(t.latency == 6);
  CHECK(t.experts_start[1] == 3);
  CHECK(t.combine_start[0] == 3);
  CHECK(sim::schedule({{2}, {4}, {2}}).latency == 8);  // sequential: the sum
  sim::chunk_times rounds{{1, 1}, {2, 2}, {1, 1}};
  rounds.sequential_units = true;  // two receive-bound rounds of schedule::sequential
  const auto r = sim::schedule(rounds);
  CHECK(r.latency == 8);
  CHECK(r.dispatch_start[1] == 4);  // after the first round's combine

  SECTION("home stages: shared overlaps the first dispatch only when pipelined") {
    // before 1, counts 0.5, shared 3, reduce 0.25.
    sim::chunk_times p{{1, 1}, {2, 2}, {1, 1}, 1, 3, 0.5, 0.25};
    const auto q = sim::schedule(p);
    // Counts [1, 1.5]; D0 [1.5, 2.5]; shared [1.5, 4.5]; X0 [4.5, 6.5]; D1 [4.5, 5.5];
    // M0 [6.5, 7.5]; X1 [6.5, 8.5]; M1 [8.5, 9.5]; reduce [9.5, 9.75].
    CHECK(q.counts_start == 1);
    CHECK(q.shared_start == 1.5);
    CHECK(q.experts_start[0] == 4.5);
    CHECK(q.reduce_start == 9.5);
    CHECK(q.latency == 9.75);
    sim::chunk_times s{{2}, {4}, {2}, 1, 3, 0.5, 0.25};
    const auto r = sim::schedule(s);
    CHECK(r.shared_start == 1);
    CHECK(r.counts_start == 4);
    CHECK(r.latency == 1 + 3 + 0.5 + 8 + 0.25);
  }
}

TEST_CASE("sim: the table lookup answers as placement::table::slot_for", "[sim]") {
  // 16 experts on 8 ranks in 4 nodes, 3 slots per rank: hot experts with copies on the
  // token's own rank, its node only, other nodes only, or both.
  const auto load = sim::zipf_load(16, 1.5, 3);
  const auto t = placement::balance(load, {.ranks = 8, .nodes = 4, .extra_slots = 8}).refined;
  REQUIRE(t.max_copies() > 2);
  sim::detail::table_lookup look(t);
  std::uint64_t token = 0;
  for (int home = 0; home < 8; ++home) {
    look.set_home(home);
    for (int n = 0; n < 500; ++n, token += 7919)
      for (int e = 0; e < 16; ++e) {
        INFO("home " << home << " expert " << e << " token " << token);
        REQUIRE(look.slot_for(e, home, token) == t.slot_for(e, home, token));
      }
  }
  for (std::uint64_t n : {1ull, 3ull, 7ull, 1000ull, 65537ull})  // the divide-free h % n
    for (std::uint64_t h : {0ull, 1ull, 12345678901234567ull, ~0ull, ~0ull - 1})
      CHECK(sim::detail::table_lookup::mod(h, n, ~0ull / n) == h % n);
}

TEST_CASE("sim: results do not depend on the planner thread count", "[sim]") {
  const layer_config cfg{.hidden = 256,
                         .ffn = 128,
                         .experts = 64,
                         .top_k = 4,
                         .ranks = 64,
                         .max_tokens = 64,
                         .capacity_factor = 1.0};
  const auto src = sim::zipf(64, 1.2, 4, 64, 11);
  const auto t =
      placement::balance(src.expected_load(), {.ranks = 64, .nodes = 8, .extra_slots = 64}).refined;
  using P = sim::policies<placement::table, capacity::factor<false>, true>;
  const auto topo = sim::h100_nvlink_ib(8);
  const auto one = sim::simulate<P>(cfg, topo, src, {.chunks = 2, .threads = 1}, t);
  const auto three = sim::simulate<P>(cfg, topo, src, {.chunks = 2, .threads = 3}, t);
  CHECK(one.latency == three.latency);
  CHECK(one.rows_per_slot == three.rows_per_slot);
  CHECK(one.rank_dispatch == three.rank_dispatch);
  CHECK(one.dropped == three.dropped);
  CHECK(one.dropped > 0);
  CHECK(one.straggler == three.straggler);
}

TEST_CASE("sim: 128 ranks x 256 experts x 256 tokens completes and its trace is well formed",
          "[sim][scale]") {
  const layer_config cfg{
      .hidden = 1024, .ffn = 512, .experts = 256, .top_k = 8, .ranks = 128, .max_tokens = 256};
  const auto src = sim::zipf(256, 1.2, 8, 256, 7);
  const auto s = sim::simulate<sim::policies<>>(cfg, sim::h100_nvlink_ib(16), src, {.chunks = 2});
  CHECK(s.assignments == index_t{128} * 256 * 8);
  CHECK(s.dropped == 0);
  CHECK(s.latency > 0);
  CHECK(s.balanced_latency <= s.latency);
  CHECK(s.rows_imbalance.max_over_mean > 1);

  std::ostringstream os;
  sim::write_trace(os, s);
  const std::string j = os.str();
  CHECK(j.find("{\"displayTimeUnit\"") == 0);
  CHECK(j.find("\"traceEvents\":[") != std::string::npos);
  std::size_t slices = 0;
  for (auto p = j.find("\"ph\":\"X\""); p != std::string::npos; p = j.find("\"ph\":\"X\"", p + 1))
    ++slices;
  // Per rank: 2 chunks x (dispatch, experts, combine), then route, permute, counts, reduce
  // (no shared experts: no slice).
  CHECK(slices == std::size_t{128} * (2 * 3 + 4));
  for (const char* stage : {"\"route\"", "\"permute\"", "\"counts\"", "\"reduce\""})
    CHECK(j.find(stage) != std::string::npos);
  CHECK(j.find("\"shared\"") == std::string::npos);
  int depth = 0, min_depth = 0;  // brackets balance (no string holds one)
  for (char c : j) {
    depth += (c == '{' || c == '[') - (c == '}' || c == ']');
    min_depth = std::min(min_depth, depth);
  }
  CHECK(depth == 0);
  CHECK(min_depth == 0);
}

TEST_CASE("sim: stats lines round-trip and replay exact per-expert counts", "[sim][stats]") {
  pass_stats a(4, 2, 2), b(4, 2, 2);
  a.tokens = 6, a.routed_per_expert = {6, 3, 2, 1};
  b.tokens = 3, b.routed_per_expert = {0, 3, 0, 3};
  std::stringstream io;
  sim::write_stats_line(io, 0, 0, 2, a);
  sim::write_stats_line(io, 0, 1, 2, b);
  const auto recs = sim::read_stats(io);
  REQUIRE(recs.size() == 2);
  CHECK(recs[1].routed_per_expert == b.routed_per_expert);
  const sim::recorded_source src(recs);
  const layer_config cfg{
      .hidden = 8, .ffn = 8, .experts = 4, .top_k = 2, .ranks = 2, .max_tokens = 6};
  const auto s = sim::simulate<sim::policies<>>(cfg, sim::cpu_cluster(1), src);
  // block: 2 experts per rank; rank 0 holds experts 0, 1 (6+3 + 0+3 rows).
  CHECK(s.rows_per_slot == std::vector<index_t>{6, 6, 2, 4});
}

TEST_CASE("sim: calibration measures positive rates and writes a loadable topology",
          "[sim][calibrate]") {
  sim::calibration_options o;
  o.ranks = 2, o.hidden = 64, o.ffn = 32, o.gemm_rows = 16, o.gemm_calls = 2;
  o.large_bytes = 64 << 10, o.exchanges = 5, o.reps = 2, o.memory_bytes = 1 << 20;
  o.tokens = 16, o.experts = 4, o.top_k = 2, o.cold_bytes = 1 << 20;
  const auto c = sim::calibrate(o);
  CHECK(c.exchange_small > 0);
  CHECK(c.bandwidth > 0);
  CHECK(c.latency >= 0);
  CHECK(c.gemm_flops > 0);
  CHECK(c.memory_bandwidth > 0);
  CHECK(c.copy_bandwidth > 0);
  CHECK(c.regroup_bandwidth > 0);
  CHECK(c.reduce_bandwidth > 0);
  CHECK(c.route_seconds > 0);
  CHECK(c.topk_rate > 0);
  CHECK(c.topo.ranks() == 2);
  CHECK(c.topo.activation_bytes == 4);
  std::stringstream io;
  sim::save(io, c.topo);
  const auto t = sim::load(io);
  CHECK(t.intra_bandwidth == Approx(c.bandwidth));
  CHECK(t.gemm_flops == Approx(c.gemm_flops));
  CHECK(t.copy_bandwidth == Approx(c.copy_bandwidth));
  CHECK(t.regroup_bandwidth == Approx(c.regroup_bandwidth));
  CHECK(t.reduce_bandwidth == Approx(c.reduce_bandwidth));
  // The expert rate at a quarter, half and all of the probe's 16 rows per expert.
  REQUIRE(c.gemm_curve.size() == 3);
  CHECK(c.gemm_curve[0].first == 4);
  CHECK(c.gemm_curve[2].first == 16);
  CHECK(c.gemm_curve[2].second == c.gemm_flops);
  REQUIRE(t.gemm_curve.size() == 3);
  CHECK(t.gemm_curve[1].first == 8);
  CHECK(t.gemm_curve[1].second == Approx(c.gemm_curve[1].second));
  CHECK(t.topk_rate == Approx(c.topk_rate));
  // The calibrated machine prices a two-rank pass.
  const layer_config cfg{
      .hidden = 16, .ffn = 8, .experts = 4, .top_k = 2, .ranks = 2, .max_tokens = 32};
  const auto s = sim::simulate<sim::policies<>>(cfg, t, sim::uniform(4, 2, 32, 1));
  CHECK(s.latency > 0);
}

TEST_CASE("sim: validation runs a real layer on the source's routing and pairs every stage",
          "[sim][calibrate]") {
  const layer_config cfg{
      .hidden = 16, .ffn = 8, .experts = 4, .top_k = 2, .ranks = 2, .max_tokens = 24};
  const auto src = sim::zipf(4, 1.2, 2, 24, 3);
  const auto w = sim::hand_gate_weights(cfg);
  std::vector<std::vector<stage_times>> real(2);
  std::vector<std::vector<stage_times>> gathered;
  comm::threads_world world(2);
  world.run([&](comm::threads c) {
    auto mine = sim::run_layer_passes(c, cfg, w, src, 2);
    auto all = sim::gather_times(c, mine);
    if (c.rank() == 0) gathered = all;
    real[c.rank()] = std::move(mine);
  });
  REQUIRE(gathered.size() == 2);
  for (int r = 0; r < 2; ++r) {
    REQUIRE(gathered[r].size() == 2);
    CHECK(gathered[r][1].experts == real[r][1].experts);
    CHECK(gathered[r][1].total == real[r][1].total);
  }
  const auto s = sim::simulate<sim::policies<>>(cfg, sim::cpu_cluster(1), src);
  const auto rows = sim::compare(s, real);
  REQUIRE(rows.size() == 9);
  CHECK(rows[1].stage == "plan");
  CHECK(rows[1].predicted < 0);  // not priced
  for (const auto& row : rows) {
    INFO(row.stage);
    CHECK(row.measured >= 0);
    if (row.stage != "plan" && row.stage != "shared") CHECK(row.predicted > 0);
  }
}

TEST_CASE("sim: each round's calibration predicts its own passes, and rows carry medians",
          "[sim][calibrate]") {
  // Three rounds on one configuration; the rounds' GEMM rates differ, and so do their passes.
  const layer_config cfg{
      .hidden = 16, .ffn = 8, .experts = 4, .top_k = 2, .ranks = 2, .max_tokens = 24};
  const auto src = sim::uniform(4, 2, 24, 3);
  std::vector<sim::validation_round> rounds;
  std::vector<double> errors;
  for (double rate : {1e9, 2e9, 4e9}) {
    sim::validation_round r;
    r.cal.topo = sim::cpu_cluster(1);
    r.cal.topo.ranks_per_node = 2;
    r.cal.topo.gemm_flops = rate;
    const auto s = sim::simulate<sim::policies<>>(cfg, r.cal.topo, src);
    const double predicted = s.stages.experts[0];
    // Passes measured at 0.8x, 1x and 1.25x of what this round predicts, on both ranks.
    const double measured = predicted * (rate == 1e9 ? 0.8 : rate == 2e9 ? 1.0 : 1.25);
    stage_times t{};
    t.experts = measured;
    r.real = {{t}, {t}};
    errors.push_back((predicted - measured) / measured);
    rounds.push_back(r);
  }
  const auto rows = sim::compare_rounds(cfg, src, rounds);
  const auto experts =
      std::find_if(rows.begin(), rows.end(), [](const auto& r) { return r.stage == "experts"; });
  REQUIRE(experts != rows.end());
  CHECK(experts->error == Approx(0.0).margin(1e-12));  // the middle round's
  CHECK(experts->error_low == Approx(errors[2]));      // predicted 0.8 of measured: -20%
  CHECK(experts->error_high == Approx(errors[0]));     // +25%
  CHECK(rows[1].predicted < 0);                        // plan: not priced
}

TEST_CASE("sim: a bad topology names the field and the rule", "[sim]") {
  auto t = sim::h100_nvlink_ib(2);
  t.topk_rate = -1;
  CHECK_THROWS_WITH(t.validate(), Catch::Contains("topology.topk_rate"));
  t = sim::h100_nvlink_ib(2);
  t.gemm_curve = {{64, 1e12}, {32, 2e12}};
  CHECK_THROWS_WITH(t.validate(),
                    Catch::Contains("topology.gemm_curve") && Catch::Contains("rows must ascend"));
  std::istringstream bad_curve("gemm_curve = 32:1e12 64\n");
  CHECK_THROWS_WITH(sim::load(bad_curve, sim::cpu_cluster(1)),
                    Catch::Contains("topology.gemm_curve") && Catch::Contains("rows:FLOP/s"));
  t.gemm_curve.clear();
  t.regroup_bandwidth = -1;
  CHECK_THROWS_WITH(t.validate(), Catch::Contains("topology.regroup_bandwidth"));
  std::istringstream bad("copy_bandwidth = fast\n");
  CHECK_THROWS_WITH(sim::load(bad, sim::cpu_cluster(1)),
                    Catch::Contains("topology.copy_bandwidth"));
  CHECK_THROWS_AS(
      sim::simulate<sim::policies<>>(
          {.hidden = 8, .ffn = 8, .experts = 4, .top_k = 2, .ranks = 2, .max_tokens = 4},
          sim::cpu_cluster(1), sim::uniform(4, 2, 4), {.threads = -1}),
      config_error);
}

TEST_CASE("sim: the layer's run report lines replay in the simulator", "[sim][stats]") {
  // core/report.hpp writes a superset of write_stats_line; read_stats skips the extra keys.
  pass_record rec;
  rec.pass = 2, rec.rank = 1, rec.top_k = 2;
  rec.stats = pass_stats(4, 2, 2);
  rec.stats.tokens = 5, rec.stats.routed_per_expert = {5, 0, 3, 2};
  std::stringstream io;
  write_stats_json(io, rec);
  const auto recs = sim::read_stats(io);
  REQUIRE(recs.size() == 1);
  CHECK(recs[0].pass == 2);
  CHECK(recs[0].rank == 1);
  CHECK(recs[0].tokens == 5);
  CHECK(recs[0].top_k == 2);
  CHECK(recs[0].routed_per_expert == rec.stats.routed_per_expert);
}
