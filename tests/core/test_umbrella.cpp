// SPDX-FileCopyrightText: 2026 The epmoe authors
// SPDX-License-Identifier: Apache-2.0
//
// <epmoe/epmoe.hpp> is documented as every host part: this file includes no other epmoe
// header and uses every documented host name (each router, placement and the balancer,
// capacity, comm, expert, schedule, the router entry point, stats and reports), running a
// small layer per policy. A part left out of the umbrella fails to compile here.
#include <catch2/catch.hpp>
#include <cmath>
#include <cstdint>
#include <limits>
#include <random>
#include <sstream>
#include <string>
#include <type_traits>
#include <vector>

#include <epmoe/epmoe.hpp>

using namespace epmoe;

namespace {

constexpr float nan_value = std::numeric_limits<float>::quiet_NaN();

std::vector<float> randoms(std::size_t n, std::uint32_t seed, float scale) {
  std::mt19937 rng(seed);
  std::uniform_real_distribution<float> u(-scale, scale);
  std::vector<float> v(n);
  for (float& x : v) x = u(rng);
  return v;
}

// One rank's weights: the gate (the same on every rank) and `slots` local SwiGLU experts.
struct rank_weights {
  index_t E, H, F, slots;
  std::vector<float> gate, noise_gate, w1, w3, w2;
  rank_weights(const layer_config& cfg, int slots_, int rank)
      : E(cfg.experts),
        H(cfg.hidden),
        F(cfg.ffn),
        slots(slots_),
        gate(randoms(static_cast<std::size_t>(E * H), 11, 1.f)),
        noise_gate(randoms(static_cast<std::size_t>(E * H), 12, 0.5f)),
        w1(randoms(static_cast<std::size_t>(slots * F * H), 100 + rank, 0.3f)),
        w3(randoms(static_cast<std::size_t>(slots * F * H), 200 + rank, 0.3f)),
        w2(randoms(static_cast<std::size_t>(slots * H * F), 300 + rank, 0.3f)) {}
  template <class Layer>
  typename Layer::weights get() const {
    return {{gate.data(), E, H},
            {{w1.data(), slots, F, H}, {w3.data(), slots, F, H}, {w2.data(), slots, H, F}},
            {},
            {noise_gate.data(), E, H}};
  }
};

// What one rank's pass left: its stats and how many outputs came out finite (y starts NaN).
// Checked on the main thread: Catch asserts from one thread only.
struct pass_result {
  pass_stats stats;
  index_t finite = 0, outputs = -1;
};

void check(const pass_result& p) {
  CHECK(p.finite == p.outputs);
  CHECK(p.stats.tokens * 8 == p.outputs);  // H = 8
}

// One pass of a layer with policies P on this rank.
template <class P, class Comm, class Placement>
pass_result one_pass(const layer_config& cfg, Comm comm, const Placement& placement,
                     typename P::router router = {}) {
  using layer_t = moe_layer<P>;
  const int rank = comm.rank();
  const rank_weights w(cfg, placement.slots_per_rank(), rank);
  const index_t T = cfg.max_tokens - rank, H = cfg.hidden;  // ranks differ in T
  const auto x = randoms(static_cast<std::size_t>(T * H), 7 + rank, 1.f);
  std::vector<float> y(x.size(), nan_value);
  std::vector<std::int64_t> ids(static_cast<std::size_t>(T));
  for (index_t t = 0; t < T; ++t) ids[t] = 1000 * rank + 3 * t;
  layer_t layer(cfg, std::move(comm), w.template get<layer_t>(), router, {}, placement);
  layer.forward({x.data(), T, H}, {y.data(), T, H}, ids);
  pass_result out{layer.stats(), 0, T * H};
  for (float v : y) out.finite += std::isfinite(v) ? 1 : 0;
  return out;
}

layer_config small(int ranks, int top_k = 2) {
  return {.hidden = 8,
          .ffn = 16,
          .experts = 8,
          .top_k = top_k,
          .ranks = ranks,
          .max_tokens = 12,
          .capacity_factor = 1.0};
}

template <class Router, class Capacity = capacity::dropless, class Schedule = schedule::sequential,
          class Comm = comm::local, class Placement = placement::block>
struct bundle : default_policies {
  using router = Router;
  using capacity = Capacity;
  using schedule = Schedule;
  using comm = Comm;
  using placement = Placement;
};

// Every router on one rank (comm::local): a pass routes every token somewhere.
template <class Router>
void one_rank(int top_k, Router router = {}) {
  layer_config cfg = small(1, top_k);
  const pass_result p = one_pass<bundle<Router>>(cfg, comm::local{}, placement::block(cfg), router);
  check(p);
  const pass_stats& s = p.stats;
  CHECK(s.assignments > 0);
  CHECK(s.dropped == 0);
  CHECK_FALSE(s.capacity.has_value());  // dropless
}

}  // namespace

TEST_CASE("umbrella: every router runs a layer", "[umbrella]") {
  one_rank<router::topk_softmax<2>>(2);
  one_rank<router::mixtral<2>>(2);
  one_rank<router::qwen<2, false>>(2);
  one_rank<router::switch_top1>(1);
  one_rank<router::gshard_top2>(2);
  one_rank<router::topk_softmax<2>>(2, {.groups = 4, .top_groups = 2});
  one_rank<router::sigmoid_bias<2>>(2, {.groups = 2, .top_groups = 1, .scaling = 2.5f});
  one_rank<router::expert_choice>(2);
  one_rank<router::hash<2>>(2);
  one_rank<router::noisy_topk<2>>(2);
  one_rank<router::jitter<router::switch_top1>>(1);
  one_rank<router::sinkhorn<2>>(2);
  one_rank<router::sparsemixer>(2, {.jitter_eps = 0.3f});
  one_rank<router::dbrx<2>>(2, {.norm_p = 2.f});
}

TEST_CASE("umbrella: placements, capacities, comms, schedules and reports", "[umbrella]") {
  using R2 = router::topk_softmax<2>;
  SECTION("capacity::factor, padded_factor: a limit in the stats") {
    const layer_config cfg = small(1);
    const auto r =
        one_pass<bundle<R2, capacity::factor<>>>(cfg, comm::local{}, placement::block(cfg));
    check(r);
    const pass_stats& s = r.stats;
    REQUIRE(s.capacity.has_value());
    CHECK(*s.capacity == 3);  // ceil(1.0 * 12 * 2 / 8)
    const auto padded =
        one_pass<bundle<R2, capacity::padded_factor>>(cfg, comm::local{}, placement::block(cfg));
    check(padded);
    const pass_stats& p = padded.stats;
    CHECK(p.padding_rows + p.assignments - p.dropped == 8 * 3);  // every slot padded to 3
  }
  SECTION("comm::threads, round_robin, pipelined; throttled links") {
    const layer_config cfg = small(2);
    std::vector<pass_result> results(4);
    comm::threads_world world(cfg.ranks);
    world.run([&](comm::threads c) {
      results[c.rank()] =
          one_pass<bundle<R2, capacity::dropless, schedule::pipelined<2>, comm::threads,
                          placement::round_robin>>(cfg, c, placement::round_robin(cfg));
    });
    world.run([&](comm::threads c) {
      using throttled = comm::throttled<comm::threads>;
      results[2 + c.rank()] =
          one_pass<bundle<R2, capacity::dropless, schedule::sequential, throttled>>(
              cfg, throttled(c, comm::link{.bandwidth = 1e12, .latency = 0}),
              placement::block(cfg));
    });
    for (const pass_result& p : results) check(p);
    CHECK(results[0].stats.chunks == 2);  // pipelined<2>
  }
  SECTION("the balancer's table, applied live; a stats line and a trace") {
    const layer_config cfg = small(2);
    const std::vector<double> load{9, 1, 1, 1, 1, 1, 1, 1};
    const placement::balance_result b =
        placement::balance(load, {.ranks = 2, .nodes = 1, .extra_slots = 2});
    CHECK(b.refined.slots() == 10);
    CHECK(b.refined.copies(0) >= 2);  // the hot expert gets the replicas
    std::vector<pass_record> records(2);
    std::vector<index_t> finite(2, -1);
    comm::threads_world world(cfg.ranks);
    world.run([&](comm::threads c) {
      using P =
          bundle<R2, capacity::dropless, schedule::sequential, comm::threads, placement::table>;
      const int r = c.rank();
      const rank_weights w(cfg, 5, r);
      moe_layer<P> layer(cfg, c, w.get<moe_layer<P>>(), {}, {}, b.greedy);
      layer.apply_placement(b.refined);  // moves weights through placement::relocate
      const index_t T = 6, H = cfg.hidden;
      const auto x = randoms(static_cast<std::size_t>(T * H), 5, 1.f);
      std::vector<float> y(x.size(), nan_value);
      layer.forward({x.data(), T, H}, {y.data(), T, H});
      finite[r] = 0;
      for (float v : y) finite[r] += std::isfinite(v) ? 1 : 0;
      records[static_cast<std::size_t>(r)] = record_pass(layer);
    });
    CHECK(finite == std::vector<index_t>{6 * 8, 6 * 8});
    std::ostringstream stats, trace;
    write_stats_json(stats, records);
    write_trace_json(trace, records);
    CHECK(stats.str().find("\"capacity\":null") != std::string::npos);
    CHECK(trace.str().find("\"rank 1\"") != std::string::npos);
  }
}

TEST_CASE("umbrella: the router entry point, losses and core names", "[umbrella]") {
  const layer_config cfg = small(1);
  const std::vector<float> logits{0, 0, 3, 0, 0, 2, 0, 0};  // one token: experts 2, then 5
  std::vector<std::int32_t> ids(2, -7);
  std::vector<float> w(2, nan_value);
  const router::topk_softmax<2> r;
  router::route(r, cfg, {logits.data(), 1, 8}, {{ids.data(), 1, 2}, {w.data(), 1, 2}},
                router::route_options{});
  CHECK(ids == std::vector<std::int32_t>{2, 5});
  CHECK(router::routing_width<router::expert_choice>(cfg) == 8);
  std::vector<float> probs(8);
  std::vector<double> acc(16);
  router_losses losses;
  compute_losses(r, cfg, {logits.data(), 1, 8}, routing_view{{ids.data(), 1, 2}, {w.data(), 1, 2}},
                 probs, acc, losses);
  CHECK(losses.valid);
  static_assert(router_policy<router::hash<1>> && placement_policy<placement::round_robin> &&
                capacity_policy<capacity::factor<true>> && communicator<comm::threads> &&
                expert_policy<expert::swiglu, space::host> &&
                schedule_policy<schedule::pipelined<3>> && space_policy<space::host>);
  static_assert(std::is_base_of_v<config_error, input_error> &&
                std::is_base_of_v<comm_error, comm_aborted>);
  CHECK(no_expert == -1);
  CHECK(imbalance::of(std::vector<int>{1, 3}).max_over_mean == Approx(1.5));
  CHECK(drop_mask{}.count() == 0);
  CHECK(sizeof(dispatch_plan) > 0);
}
