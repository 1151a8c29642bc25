// SPDX-FileCopyrightText: 2026 The epmoe authors
// SPDX-License-Identifier: Apache-2.0
#include <atomic>
#include <catch2/catch.hpp>
#include <chrono>
#include <limits>
#include <string>
#include <vector>

#include "harness.hpp"
#include <epmoe/comm/any.hpp>
#include <epmoe/comm/throttled.hpp>
#include <epmoe/split_layer.hpp>

// Split phase (docs/decode.md): two micro-batches in flight on a split_layer give bit for bit
// the outputs of two plain passes of a moe_layer (each pass runs the same stages on the same
// rows; only the caller's order between them differs; options.deterministic), on every host
// comm and exchange mode.
// Rank threads write no Catch assertions (Catch2 v2 is not thread-safe): they record, the
// test checks after the run.
namespace split_tests {
using namespace epmoe;

namespace {

constexpr float nan = std::numeric_limits<float>::quiet_NaN();

template <class Comm, bool Dedup = false, bool Hier = false, bool LowLatency = false>
struct policies : test::threads_policies<2> {
  using comm = Comm;
  // Bitwise needs fixed summation orders: by default the host's streaming GEMM sums in an
  // order that follows buffer alignment, and each lane has its own buffers (fp32 rounding).
  static constexpr layer_options options{
      .dedup = Dedup, .hierarchical = Hier, .deterministic = true, .low_latency = LowLatency};
};
// The low-latency exchange: comm::threads writes into the peers' slots (start completes the
// round); comm::throttled posts it (start returns with the round on the wire).
template <class Comm>
using ll = policies<Comm, false, false, true>;
using throttled_threads = comm::throttled<comm::threads>;

layer_config config(int ranks, int per_node = 0) {
  return {.hidden = 12,
          .ffn = 10,
          .experts = 8,
          .top_k = 2,
          .ranks = ranks,
          .max_tokens = 16,
          .shared_experts = 1,
          .ranks_per_node = per_node};
}

// Micro-batch m's tokens on rank r (some ranks have none in some batches).
index_t tokens_of(int m, int r) { return (m * 7 + r * 5) % 17 == 3 ? 0 : (m * 7 + r * 5) % 17; }

// One rank's weights and its micro-batches' x and y; y starts NaN.
template <class P>
struct rank_data {
  test::rank_arrays<P> arrays;
  std::vector<std::vector<float>> x, y;
  rank_data(const layer_config& cfg, const reference::full_weights& w, int r, int batches)
      : arrays(w, reference::slice(w, typename P::placement(cfg), r)) {
    for (int m = 0; m < batches; ++m) {
      const index_t T = tokens_of(m, r);
      x.push_back(reference::random_tokens(T, cfg.hidden, 100 + 10 * m + r));
      y.emplace_back(static_cast<std::size_t>(T * cfg.hidden), nan);
    }
  }
  auto views(const layer_config& cfg) {
    return arrays.views(cfg, typename P::placement(cfg).slots_per_rank());
  }
  matrix_view<const float> xv(int m, index_t H) const {
    return {x[m].data(), static_cast<index_t>(x[m].size()) / H, H};
  }
  matrix_view<float> yv(int m, index_t H) {
    return {y[m].data(), static_cast<index_t>(y[m].size()) / H, H};
  }
};

template <class Comm>
Comm lane_comm(const comm::threads& c) {
  if constexpr (std::is_same_v<Comm, throttled_threads>)
    return Comm(c, comm::link{.bandwidth = 20e9, .latency = 20e-6});
  else
    return c;
}

constexpr int batches = 5;

// Every batch's y on every rank: plain passes of a moe_layer, or split passes in the order
// start 0, start 1, experts 1, finish 0, start 2, finish 1, start 3, experts 3, finish 2,
// start 4, finish 3, finish 4 (two in flight from the second start on).
template <class P>
std::vector<std::vector<std::vector<float>>> run(const layer_config& cfg, bool split) {
  const auto w = reference::full_weights::random(cfg, 7);
  std::vector<std::vector<std::vector<float>>> ys(static_cast<std::size_t>(cfg.ranks));
  const auto body = [&](comm::threads c) {
    const int r = c.rank();
    const index_t H = cfg.hidden;
    rank_data<P> d(cfg, w, r, batches);
    if (!split) {
      moe_layer<P> layer(cfg, lane_comm<typename P::comm>(c), d.views(cfg));
      for (int m = 0; m < batches; ++m) layer.forward(d.xv(m, H), d.yv(m, H));
    } else {
      split_layer<P> layer(cfg, {lane_comm<typename P::comm>(c), lane_comm<typename P::comm>(c)},
                           d.views(cfg));
      std::vector<split_handle> h(batches);
      h[0] = layer.start(d.xv(0, H), d.yv(0, H));
      for (int m = 1; m < batches; ++m) {
        h[m] = layer.start(d.xv(m, H), d.yv(m, H));
        if (layer.in_flight() != 2) throw std::logic_error("two passes should be in flight");
        if (m % 2) layer.experts(h[m]);  // the newer's experts before the older's finish
        layer.finish(h[m - 1]);
      }
      layer.finish(h[batches - 1]);
      if (layer.in_flight() != 0) throw std::logic_error("no pass should be in flight");
    }
    ys[r] = d.y;
  };
  comm::threads_world world(cfg.ranks);
  world.run(body);
  return ys;
}

template <class P>
void split_equals_plain(const layer_config& cfg) {
  const auto plain = run<P>(cfg, false);
  const auto split = run<P>(cfg, true);
  int compared = 0;
  for (int r = 0; r < cfg.ranks; ++r)
    for (int m = 0; m < batches; ++m) {
      CAPTURE(r, m);
      for (float v : plain[r][m]) REQUIRE(std::isfinite(v));
      CHECK(split[r][m] == plain[r][m]);  // bitwise (NaN-filled: an unwritten row fails)
      compared += static_cast<int>(plain[r][m].size());
    }
  CHECK(compared > 0);
}

}  // namespace

TEST_CASE("split: two in flight equal two plain passes bitwise, 1, 2, 4 ranks", "[split]") {
  for (int R : {1, 2, 4}) {
    CAPTURE(R);
    split_equals_plain<policies<comm::threads>>(config(R));
    split_equals_plain<policies<comm::threads, true>>(config(R));
    split_equals_plain<policies<throttled_threads>>(config(R));
    split_equals_plain<ll<comm::threads>>(config(R));
    split_equals_plain<ll<throttled_threads>>(config(R));
  }
  split_equals_plain<policies<comm::threads, true, true>>(config(4, 2));
}

TEST_CASE("split: comm::local and comm::any", "[split]") {
  const auto cfg = config(1);
  const auto w = reference::full_weights::random(cfg, 7);
  using P = policies<comm::local>;
  rank_data<P> plain(cfg, w, 0, batches), split(cfg, w, 0, batches);
  const index_t H = cfg.hidden;
  moe_layer<P> one(cfg, comm::local{}, plain.views(cfg));
  split_layer<P> two(cfg, {comm::local{}, comm::local{}}, split.views(cfg));
  for (int m = 0; m < batches; ++m) one.forward(plain.xv(m, H), plain.yv(m, H));
  const auto a = two.start(split.xv(0, H), split.yv(0, H));
  const auto b = two.start(split.xv(1, H), split.yv(1, H));
  REQUIRE(!split.y[1].empty());
  CHECK(std::isnan(split.y[1][0]));  // nothing written before finish
  two.finish(a);
  two.finish(b);
  for (int m = 2; m < batches; ++m) two.forward(split.xv(m, H), split.yv(m, H));
  for (int m = 0; m < batches; ++m) CHECK(split.y[m] == plain.y[m]);

  // comm::any over an endpoint (a framework's group): two lanes share one endpoint.
  using Q = policies<comm::any>;
  const auto cfg2 = config(2);
  const auto w2 = reference::full_weights::random(cfg2, 7);
  const auto ref = run<policies<comm::threads>>(cfg2, false);
  std::vector<std::vector<std::vector<float>>> got(2);
  comm::threads_world world(2);
  world.run([&](comm::threads c) {
    const int r = c.rank();
    comm::endpoint_of<comm::threads> ep(std::move(c));
    rank_data<Q> d(cfg2, w2, r, batches);
    split_layer<Q> layer(cfg2, {comm::any(ep), comm::any(ep)}, d.views(cfg2));
    std::vector<split_handle> h(batches);
    h[0] = layer.start(d.xv(0, H), d.yv(0, H));
    for (int m = 1; m < batches; ++m) {
      h[m] = layer.start(d.xv(m, H), d.yv(m, H));
      layer.finish(h[m - 1]);
    }
    layer.finish(h[batches - 1]);
    got[r] = d.y;
  });
  for (int r = 0; r < 2; ++r)
    for (int m = 0; m < batches; ++m) CHECK(got[r][m] == ref[r][m]);
}

TEST_CASE("split: a rejected input on one rank at start throws on every rank, writes nothing",
          "[split]") {
  const auto cfg = config(2);
  const auto w = reference::full_weights::random(cfg, 7);
  using P = policies<comm::threads>;
  const auto ref = run<P>(cfg, false);
  std::vector<std::string> errors(2);
  std::vector<int> ok(2, 0);
  comm::threads_world world(2);
  world.run([&](comm::threads c) {
    const int r = c.rank();
    const index_t H = cfg.hidden;
    rank_data<P> d(cfg, w, r, batches);
    split_layer<P> layer(cfg, {c, c}, d.views(cfg));
    const auto a = layer.start(d.xv(0, H), d.yv(0, H));  // in flight while B is rejected
    std::vector<float> bad(static_cast<std::size_t>(17 * H), 0.f), by(bad.size(), nan);
    try {  // rank 1: 17 tokens > max_tokens 16
      const index_t T = r == 1 ? 17 : tokens_of(1, r);
      layer.start({r == 1 ? bad.data() : d.x[1].data(), T, H}, {by.data(), T, H});
    } catch (const std::exception& e) {
      errors[r] = e.what();
    }
    ok[r] += layer.in_flight() == 1;
    for (float v : by) ok[r] += v != v ? 0 : -1000;  // nothing written
    layer.finish(a);                                 // the pass in flight completes
    ok[r] += d.y[0] == ref[r][0];
    layer.forward(d.xv(1, H), d.yv(1, H));  // the layer stays usable
    ok[r] += d.y[1] == ref[r][1];
  });
  CHECK_THAT(errors[1], Catch::Contains("x.rows") && Catch::Contains("max_tokens"));
  CHECK_THAT(errors[0], Catch::Contains("rank 1") && Catch::Contains("rejected"));
  CHECK(ok == std::vector<int>{3, 3});
}

TEST_CASE(
    "split, low latency posted: a rejected input throws at finish on every rank, writes "
    "nothing",
    "[split][low_latency]") {
  static_assert(low_latency_exchange<throttled_threads, space::host>::posts);
  const auto cfg = config(2);
  const auto w = reference::full_weights::random(cfg, 7);
  using P = ll<throttled_threads>;
  const auto ref = run<P>(cfg, false);
  std::vector<std::string> at_start(2), at_finish(2);
  std::vector<int> ok(2, 0);
  comm::threads_world world(2);
  world.run([&](comm::threads c) {
    const int r = c.rank();
    const index_t H = cfg.hidden;
    rank_data<P> d(cfg, w, r, batches);
    split_layer<P> layer(cfg, {lane_comm<P::comm>(c), lane_comm<P::comm>(c)}, d.views(cfg));
    const auto a = layer.start(d.xv(0, H), d.yv(0, H));
    std::vector<float> bad(static_cast<std::size_t>(17 * H), 0.f), by(bad.size(), nan);
    split_handle b{};
    try {  // rank 1: 17 tokens > max_tokens 16; the verdict rides with the posted rows
      const index_t T = r == 1 ? 17 : tokens_of(1, r);
      b = layer.start({r == 1 ? bad.data() : d.x[1].data(), T, H}, {by.data(), T, H});
    } catch (const std::exception& e) {
      at_start[r] = e.what();
    }
    ok[r] += layer.in_flight() == 2;
    layer.finish(a);  // the pass before completes
    ok[r] += d.y[0] == ref[r][0];
    try {
      layer.finish(b);
    } catch (const std::exception& e) {
      at_finish[r] = e.what();
    }
    for (float v : by) ok[r] += v != v ? 0 : -1000;  // nothing written
    ok[r] += layer.in_flight() == 0;
    layer.forward(d.xv(1, H), d.yv(1, H));  // the layer stays usable
    ok[r] += d.y[1] == ref[r][1];
  });
  CHECK(at_start == std::vector<std::string>(2));
  CHECK_THAT(at_finish[1], Catch::Contains("x.rows") && Catch::Contains("max_tokens"));
  CHECK_THAT(at_finish[0], Catch::Contains("rank 1") && Catch::Contains("rejected"));
  CHECK(ok == std::vector<int>{4, 4});
}

TEST_CASE("split: handles finish once, in order, and a busy layer refuses another pass", "[split]") {
  const auto cfg = config(1);
  const auto w = reference::full_weights::random(cfg, 7);
  using P = policies<comm::local>;
  rank_data<P> d(cfg, w, 0, batches);
  const index_t H = cfg.hidden;
  split_layer<P> layer(cfg, {comm::local{}, comm::local{}}, d.views(cfg));
  const auto a = layer.start(d.xv(0, H), d.yv(0, H));
  const auto b = layer.start(d.xv(1, H), d.yv(1, H));
  CHECK_THROWS_WITH(layer.start(d.xv(2, H), d.yv(2, H)),
                    Catch::Contains("max_in_flight = 2") && Catch::Contains("finish the oldest"));
  CHECK_THROWS_WITH(layer.finish(b), Catch::Contains("out of order") &&
                                         Catch::Contains("pass 0 first"));
  CHECK_THROWS_WITH(layer.lane(0).forward(d.xv(2, H), d.yv(2, H)),
                    Catch::Contains("split pass 0 is in flight"));
  layer.experts(b);
  CHECK_THROWS_WITH(layer.experts(b), Catch::Contains("ran its experts already"));
  layer.finish(a);
  CHECK_THROWS_WITH(layer.finish(a), Catch::Contains("finished already"));
  CHECK_THROWS_WITH(layer.experts(a), Catch::Contains("must name a pass in flight"));
  layer.finish(b);
  CHECK_THROWS_WITH(layer.finish(split_handle{9, 1}), Catch::Contains("not started"));
  CHECK(layer.in_flight() == 0);
  // A moe_layer holds one split pass: finish checks the handle.
  moe_layer<P> one(cfg, comm::local{}, d.views(cfg));
  CHECK_THROWS_WITH(one.finish(split_handle{}), Catch::Contains("no split pass is in flight"));
  const auto h = one.start(d.xv(2, H), d.yv(2, H));
  CHECK_THROWS_WITH(one.start(d.xv(3, H), d.yv(3, H)), Catch::Contains("finish(handle) first"));
  CHECK_THROWS_WITH(one.finish(split_handle{h.id + 1, 0}), Catch::Contains("not the split pass"));
  one.finish(h);
  for (int m = 0; m < 3; ++m)
    for (float v : d.y[m]) CHECK(std::isfinite(v));
}

TEST_CASE("split: a rank that never finishes: its peer's finish throws comm_timeout in time",
          "[split][faults]") {
  auto cfg = config(2);
  cfg.exchange_timeout = 0.3;
  const auto w = reference::full_weights::random(cfg, 7);
  using P = policies<comm::threads>;
  std::vector<std::string> kind(2);
  std::atomic<double> waited{0};
  comm::threads_world world(2);
  try {
    world.run([&](comm::threads c) {
      const int r = c.rank();
      const index_t H = cfg.hidden;
      rank_data<P> d(cfg, w, r, batches);
      split_layer<P> layer(cfg, {c, c}, d.views(cfg));
      const auto a = layer.start(d.xv(0, H), d.yv(0, H));
      if (r == 1) return;  // rank 1 leaves its pass in flight
      const auto t0 = std::chrono::steady_clock::now();
      try {
        layer.finish(a);
      } catch (const comm_timeout&) {
        kind[r] = "comm_timeout";
        waited = std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
        for (float v : d.y[0]) kind[r] += v != v ? "" : " wrote y";
        throw;
      }
    });
  } catch (const comm_timeout&) {
  }
  CHECK(kind[0] == "comm_timeout");
  CHECK(waited.load() >= 0.25);
  CHECK(waited.load() < 3.0);
}

}  // namespace split_tests
