// SPDX-FileCopyrightText: 2026 The epmoe authors
// SPDX-License-Identifier: Apache-2.0
// The low-latency exchange (issue 38; layer_options::low_latency, docs/decode.md): fixed
// slots per (source, destination) pair, one all-to-all per direction with the counts in the
// slots' heads. Checked on 1, 2, 4 thread ranks against the float64 reference and, bit for
// bit, against the default exchange: routings that fill every slot exactly, leave the cross
// slots empty, send every token to one rank's experts; a rank with T = 0; the stats (two
// all-to-alls, the slots' fixed bytes); a rejected input on one rank (every rank throws the
// same error, no y written); a stalled rank (no rank waits past its deadline); the config
// rules (training, chunks, max_recv_rows).
#include <bit>
#include <catch2/catch.hpp>
#include <chrono>
#include <cmath>
#include <cstdint>
#include <string>
#include <vector>

#include "faults.hpp"
#include "harness.hpp"
#include <epmoe/comm/any.hpp>
#include <epmoe/comm/throttled.hpp>
#include <epmoe/schedule/pipelined.hpp>

namespace low_latency_tests {
using namespace epmoe;

// comm::threads puts rows straight into the peers' slots; the others run an all-to-all.
static_assert(low_latency_exchange<comm::threads, space::host>::puts);
static_assert(!low_latency_exchange<comm::any, space::host>::puts);
static_assert(!low_latency_exchange<comm::throttled<comm::threads>, space::host>::puts);

namespace {

template <int K, bool LowLatency = true, class Space = space::host>
struct ll_policies : default_policies {
  using space = Space;
  using router = epmoe::router::topk_softmax<K>;
  using comm = epmoe::comm::threads;
  // Deterministic: the two exchanges agree bit for bit whatever their buffers' alignment.
  static constexpr layer_options options{.deterministic = true, .low_latency = LowLatency};
};

// The reference's router for a given routing: the token's global position (rank * max_tokens
// + t) looks it up.
template <int K>
struct table_router {
  static constexpr int top_k = K;
  static constexpr bool uses_gate = false;
  const std::int32_t* ids = nullptr;  // [R * max_tokens, K]
  const float* weights = nullptr;
  void route_token(const token_input& in, int* out_ids, float* out_w) const {
    for (int k = 0; k < K; ++k) {
      out_ids[k] = ids[in.token * K + k];
      out_w[k] = weights[in.token * K + k];
    }
  }
};

struct given_routing {
  std::vector<std::int32_t> ids;  // [R * max_tokens, K]
  std::vector<float> weights;
};

// `pick(token, k)` for every token of every rank; weights (1 + (t + k) % 4) / 8.
template <class Pick>
given_routing routing_of(const layer_config& cfg, Pick pick) {
  const index_t n = cfg.ranks * cfg.max_tokens, K = cfg.top_k;
  given_routing g{std::vector<std::int32_t>(std::size_t(n * K)),
                  std::vector<float>(std::size_t(n * K))};
  for (index_t t = 0; t < n; ++t)
    for (index_t k = 0; k < K; ++k) {
      g.ids[std::size_t(t * K + k)] = pick(t, k);
      g.weights[std::size_t(t * K + k)] = static_cast<float>(1 + (t + k) % 4) / 8.f;
    }
  return g;
}

constexpr std::uint32_t sentinel_bits = 0x7fc01234u;  // a NaN of its own: untouched bits show
const float sentinel = std::bit_cast<float>(sentinel_bits);

struct outcome {
  std::vector<std::string> what;    // [rank]: the input_error each rank threw ("" if none)
  std::vector<float> y;             // global order, sentinel where unwritten
  std::vector<pass_stats> stats;    // [rank]
  std::vector<index_t> slot_bytes;  // [rank]: the exchange's slot_buffer_bytes
};

// One pass of moe_layer<P> on every rank with the given routing (or the router's, when
// `routing` is null); `edit` may break rank r's copy of its routing.
// The rank's comm: comm::threads, or P's made from it by `make`.
struct same_comm {
  template <class Use>
  void operator()(comm::threads c, Use&& use) const {
    use(std::move(c));
  }
};

template <class P, class Edit, class Make = same_comm>
outcome run(const layer_config& cfg, const reference::full_weights& w, const test::global_tokens& g,
            const given_routing* routing, Edit edit, Make make = {}) {
  outcome out{std::vector<std::string>(cfg.ranks), std::vector<float>(g.x.size(), sentinel),
              std::vector<pass_stats>(cfg.ranks), std::vector<index_t>(cfg.ranks)};
  comm::threads_world world(cfg.ranks);
  world.run([&](comm::threads threads) {
    const int r = threads.rank();
    make(std::move(threads), [&](typename P::comm c) {
      const placement::block where(cfg);
      test::rank_arrays<P> arrays(w, reference::slice(w, where, r));
      moe_layer<P> layer(cfg, std::move(c), arrays.views(cfg, where.slots_per_rank()));
      const index_t T = g.per_rank[r], H = cfg.hidden, K = cfg.top_k;
      const matrix_view<const float> x(g.x.data() + g.offset(r) * H, T, H);
      const matrix_view<float> y(out.y.data() + g.offset(r) * H, T, H);
      try {
        if (routing) {
          const std::size_t at = std::size_t(r) * cfg.max_tokens * K;
          std::vector<std::int32_t> ids(routing->ids.begin() + at,
                                        routing->ids.begin() + at + T * K);
          std::vector<float> wts(routing->weights.begin() + at,
                                 routing->weights.begin() + at + T * K);
          edit(r, ids);
          layer.forward(x, routing_view{{ids.data(), T, K}, {wts.data(), T, K}}, y);
        } else {
          layer.forward(x, y);
        }
        out.stats[r] = layer.stats();
      } catch (const input_error& e) {
        out.what[r] = e.what();
      }
    });
  });
  return out;
}
template <class P>
outcome run(const layer_config& cfg, const reference::full_weights& w, const test::global_tokens& g,
            const given_routing* routing = nullptr) {
  return run<P>(cfg, w, g, routing, [](int, std::vector<std::int32_t>&) {});
}

template <int K>
std::vector<float> reference_of(const layer_config& cfg, const reference::full_weights& w,
                                const test::global_tokens& g, const given_routing& routing) {
  std::vector<float> y(g.x.size());
  const index_t n = g.total(), H = cfg.hidden;
  const table_router<K> router{routing.ids.data(), routing.weights.data()};
  reference::forward(w, router, capacity::dropless{}, {g.x.data(), n, H}, g.per_rank,
                     {y.data(), n, H});
  return y;
}

// Bytes of a slot's head (the counts message to one peer: header 4, 2L + 1 counts, 1
// rounds; int64) and of a whole slot (the head in whole rows, then slot_rows rows).
index_t head_bytes(const layer_config& cfg) { return (4 + 2 * (cfg.experts / cfg.ranks) + 2) * 8; }
index_t slot_bytes(const layer_config& cfg, index_t slot_rows) {
  const index_t row = (cfg.hidden + 3) / 4 * 4 * 4;  // floats, rows 16-byte aligned
  return ((head_bytes(cfg) + row - 1) / row + slot_rows) * row;
}

// The pass's stats: two all-to-alls; on comm::threads (puts) the rows of the default exchange
// (`flat`) and a head per peer; returns the checks made.
int check_stats(const layer_config& cfg, const outcome& o, const outcome& flat) {
  const index_t R = cfg.ranks;
  int checks = 0;
  for (int r = 0; r < R; ++r) {
    const pass_stats &s = o.stats[std::size_t(r)], &f = flat.stats[std::size_t(r)];
    CHECK(s.alltoalls == 2);
    CHECK(s.rounds == 1);
    CHECK(s.dispatch_bytes_sent == f.dispatch_bytes_sent + (R - 1) * head_bytes(cfg));
    CHECK(s.dispatch_bytes_received == f.dispatch_bytes_received + (R - 1) * head_bytes(cfg));
    CHECK(s.combine_bytes_received == f.combine_bytes_received);
    CHECK(s.combine_bytes_sent == f.combine_bytes_sent);
    checks += 6;
  }
  return checks;
}

}  // namespace

TEST_CASE("low latency: random routings against the reference and the default exchange",
          "[layer][low_latency]") {
  int checks = 0;
  for (int R : {1, 2, 4}) {
    const layer_config cfg{
        .hidden = 12, .ffn = 10, .experts = 8, .top_k = 2, .ranks = R, .max_tokens = 9};
    const auto w = reference::full_weights::random(cfg, 31 + R);
    std::vector<index_t> per_rank;
    for (int r = 0; r < R; ++r) per_rank.push_back(r == 1 ? 0 : 9 - r);  // rank 1: T = 0
    const auto g = test::make_tokens(per_rank, cfg.hidden, 7 + R);
    const auto ll = run<ll_policies<2>>(cfg, w, g);
    const auto flat = run<ll_policies<2, false>>(cfg, w, g);
    const auto ref = test::run_reference<ll_policies<2>>(cfg, w, g);
    INFO("R=" << R);
    CHECK(test::relative_error(ll.y, ref) <= test::tolerance<space::host>(1e-5));
    CHECK(ll.y == flat.y);                // the same rows through the same experts: bit for bit
    CHECK(flat.stats[0].alltoalls == 3);  // counts, dispatch, combine
    checks += 3 + check_stats(cfg, ll, flat);
  }
  CHECK(checks == 3 * 3 + 6 * (1 + 2 + 4));
}

TEST_CASE("low latency: slots filled exactly, left empty, every token to one rank",
          "[layer][low_latency]") {
  constexpr int K = 4;
  int checks = 0;
  for (int R : {1, 2, 4}) {
    // E = K: a token that picks every expert sends min(K, L) rows to each rank, its slot's
    // share exactly (S = max_tokens * min(K, L)).
    const layer_config cfg{
        .hidden = 20, .ffn = 8, .experts = 4, .top_k = K, .ranks = R, .max_tokens = 5};
    const index_t T = cfg.max_tokens, L = cfg.experts / R;
    const auto w = reference::full_weights::random(cfg, 5 + R);
    const auto g = test::make_tokens(std::vector<index_t>(R, T), cfg.hidden, 3 + R);
    const auto full = routing_of(cfg, [](index_t t, index_t k) { return int((t + k) % 4); });
    // Each token's experts on its own rank (a slot's expert may repeat no expert: K slots
    // with L < K take no_expert).
    const auto own = routing_of(cfg, [&](index_t t, index_t k) {
      const index_t home = t / T;
      return k < L ? int(home * L + k) : no_expert;
    });
    // Every token to rank R - 1's experts.
    const auto one = routing_of(cfg, [&](index_t t, index_t k) {
      return k < L ? int((R - 1) * L + (t + k) % L) : no_expert;
    });
    int which = 0;
    for (const given_routing* rt : {&full, &own, &one}) {
      INFO("R=" << R << " routing " << which++);
      const auto ll = run<ll_policies<K>>(cfg, w, g, rt);
      const auto flat = run<ll_policies<K, false>>(cfg, w, g, rt);
      CHECK(test::relative_error(ll.y, reference_of<K>(cfg, w, g, *rt)) <= 1e-5);
      CHECK(ll.y == flat.y);
      checks += 2 + check_stats(cfg, ll, flat);
      const pass_stats& s = ll.stats[0];
      index_t rows = 0;  // rows rank 0 sent to other ranks
      for (int q = 1; q < R; ++q) rows += s.rows_sent[std::size_t(q)];
      if (rt == &full) CHECK(rows == (R - 1) * T * std::min<index_t>(K, L));
      if (rt == &own) CHECK(rows == 0);
      if (rt == &one) CHECK(rows == (R > 1 ? T * L : 0));
      ++checks;
    }
  }
  CHECK(checks == 3 * 3 * 3 + 3 * 6 * (1 + 2 + 4));
}

namespace {  // (at namespace scope: GCC takes a local class's comm for an unused typedef)
struct slow : ll_policies<2> {
  using comm = epmoe::comm::throttled<epmoe::comm::threads>;
};
struct any : ll_policies<2> {
  using comm = epmoe::comm::any;
};
struct local : ll_policies<2> {
  using comm = epmoe::comm::local;
};
// A comm of blocking all-to-alls only (no windows, no ialltoallv): the slots move in its
// alltoall, one call per direction, from the send slots and back from the receive slots.
struct blocking_comm {
  comm::threads c;
  int rank() const { return c.rank(); }
  int size() const { return c.size(); }
  template <class T>
  void alltoall(const T* send, T* recv, index_t n) {
    c.alltoall(send, recv, n);
  }
  template <class T>
  void alltoallv(const T* send, const index_t* sn, const index_t* sd, T* recv, const index_t* rn,
                 const index_t* rd) {
    c.alltoallv(send, sn, sd, recv, rn, rd);
  }
};
struct blocking : ll_policies<2> {
  using comm = blocking_comm;
};
static_assert(!low_latency_exchange<blocking_comm, space::host>::puts &&
              !low_latency_exchange<blocking_comm, space::host>::posts);
}  // namespace

TEST_CASE(
    "low latency: the same outputs over comm::throttled, comm::any, comm::local and a "
    "blocking comm",
    "[layer][low_latency]") {
  const auto none = [](int, std::vector<std::int32_t>&) {};
  int checks = 0;
  for (int R : {1, 2, 4}) {
    const layer_config cfg{
        .hidden = 12, .ffn = 10, .experts = 8, .top_k = 2, .ranks = R, .max_tokens = 6};
    const auto w = reference::full_weights::random(cfg, 51 + R);
    const auto g = test::make_tokens(std::vector<index_t>(R, 6), cfg.hidden, 52);
    const auto base = run<ll_policies<2>>(cfg, w, g);
    const auto s = run<slow>(cfg, w, g, nullptr, none, [](comm::threads c, auto&& use) {
      use(comm::throttled<comm::threads>(std::move(c), comm::link{1e9, 1e-6}));
    });
    const auto a = run<any>(cfg, w, g, nullptr, none, [](comm::threads c, auto&& use) {
      comm::endpoint_of<comm::threads> ep(std::move(c));
      use(comm::any(ep));
    });
    const auto b = run<blocking>(cfg, w, g, nullptr, none, [](comm::threads c, auto&& use) {
      use(blocking_comm{std::move(c)});
    });
    INFO("R=" << R);
    CHECK(s.y == base.y);
    CHECK(a.y == base.y);
    CHECK(b.y == base.y);
    CHECK(b.stats[0].alltoalls == 2);
    // comm::any and comm::throttled: an all-to-all of whole slots (S = 6 x min(2, L) rows).
    const index_t fixed = (R - 1) * slot_bytes(cfg, 6 * std::min(2, cfg.experts / R));
    CHECK(a.stats[0].dispatch_bytes_sent == fixed);
    CHECK(s.stats[0].combine_bytes_received == fixed);
    CHECK(s.stats[0].alltoalls == 2);
    checks += 7;
    if (R == 1) {
      const auto l = run<local>(cfg, w, g, nullptr, none,
                                [](comm::threads, auto&& use) { use(comm::local{}); });
      CHECK(l.y == base.y);
      ++checks;
    }
  }
  CHECK(checks == 3 * 7 + 1);
}

TEST_CASE("low latency: a rejected input on one rank makes every rank throw, y untouched",
          "[layer][low_latency]") {
  int checks = 0;
  for (int R : {2, 4}) {
    layer_config cfg{.hidden = 8, .ffn = 6, .experts = 8, .top_k = 2, .ranks = R, .max_tokens = 6};
    cfg.exchange_timeout = 20;  // a rank left waiting fails in seconds, not minutes
    const auto w = reference::full_weights::random(cfg, 41);
    const auto g = test::make_tokens(std::vector<index_t>(R, 6), cfg.hidden, 42);
    const auto rt = routing_of(cfg, [](index_t t, index_t k) { return int((3 * t + k) % 8); });
    const int bad = R - 1;
    const auto o = run<ll_policies<2>>(cfg, w, g, &rt, [&](int r, std::vector<std::int32_t>& ids) {
      if (r == bad) ids[3] = 99;
    });
    for (int r = 0; r < R; ++r) {
      INFO("R=" << R << " rank " << r << ": " << o.what[r]);
      if (r == bad)
        CHECK(o.what[r].find("routing.ids[1][1] = 99") != std::string::npos);
      else
        CHECK(o.what[r].find("forward inputs of rank " + std::to_string(bad)) != std::string::npos);
      ++checks;
    }
    bool untouched = true;
    for (float v : o.y) untouched = untouched && std::bit_cast<std::uint32_t>(v) == sentinel_bits;
    CHECK(untouched);
    ++checks;
  }
  CHECK(checks == 2 + 1 + 4 + 1);
}

TEST_CASE("low latency: a rank that stalls past exchange_timeout times the others out",
          "[layer][low_latency]") {
  struct P : ll_policies<2, true, test::faulty_host> {};
  constexpr int R = 3, culprit = 1;
  const double timeout = 0.3, stall = 1.5;
  layer_config cfg{.hidden = 8, .ffn = 6, .experts = 6, .top_k = 2, .ranks = R, .max_tokens = 4};
  cfg.exchange_timeout = timeout;
  const auto w = reference::full_weights::random(cfg, 3);
  const auto g = test::make_tokens(std::vector<index_t>(R, 4), cfg.hidden, 4);
  std::vector<std::string> kind(R);
  std::vector<double> seconds(R);
  std::vector<int> untouched(R);
  comm::threads_world world(R);
  try {
    world.run([&](comm::threads c) {
      const int r = c.rank();
      const placement::block where(cfg);
      test::rank_arrays<P> arrays(w, reference::slice(w, where, r));
      const test::faulty_host space =
          r == culprit ? test::faulty_host(test::faulty_host::fault::stalls, stall)
                       : test::faulty_host();
      moe_layer<P> layer(cfg, c, arrays.views(cfg, where.slots_per_rank()), {}, {}, where, space);
      const index_t H = cfg.hidden;
      std::vector<float> y(std::size_t(4 * H), sentinel);
      const auto t0 = std::chrono::steady_clock::now();
      try {
        layer.forward({g.x.data() + g.offset(r) * H, 4, H}, {y.data(), 4, H});
        kind[r] = "none";
      } catch (const comm_timeout&) {
        kind[r] = "comm_timeout";
      } catch (const std::exception& e) {
        kind[r] = e.what();
      }
      seconds[r] = std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
      untouched[r] = 1;
      for (float v : y) untouched[r] &= std::bit_cast<std::uint32_t>(v) == sentinel_bits;
    });
  } catch (const std::exception&) {
  }
  int checks = 0;
  for (int r = 0; r < R; ++r) {
    INFO("rank " << r << ": " << kind[r] << " after " << seconds[r] << " s");
    CHECK(untouched[r]);
    if (r != culprit) {
      CHECK(kind[r] == "comm_timeout");
      CHECK(seconds[r] < timeout + 1.0);  // not the culprit's stall
      checks += 2;
    }
    ++checks;
  }
  CHECK(checks == 3 + 2 * 2);
}

TEST_CASE("low latency: its config rules are named", "[layer][low_latency]") {
  const auto make = [](layer_config cfg, auto policies) {
    using P = decltype(policies);
    const auto w = reference::full_weights::random(cfg, 1);
    test::rank_arrays<P> arrays(w, reference::slice(w, placement::block(cfg), 0));
    moe_layer<P> layer(cfg, comm::local{}, arrays.views(cfg, cfg.experts));
  };
  struct local_ll : ll_policies<2> {
    using comm = epmoe::comm::local;
  };
  struct local_piped : local_ll {
    using schedule = epmoe::schedule::pipelined<2>;
  };
  const layer_config cfg{
      .hidden = 8, .ffn = 6, .experts = 4, .top_k = 2, .ranks = 1, .max_tokens = 4};
  layer_config train = cfg, bounded = cfg;
  train.training = true;
  bounded.max_recv_rows = 4;
  CHECK_THROWS_WITH(make(train, local_ll{}),
                    Catch::Contains("training") && Catch::Contains("options.low_latency"));
  CHECK_THROWS_WITH(make(bounded, local_ll{}),
                    Catch::Contains("max_recv_rows") && Catch::Contains("options.low_latency"));
  CHECK_THROWS_WITH(make(cfg, local_piped{}),
                    Catch::Contains("chunks") && Catch::Contains("options.low_latency"));
  CHECK_NOTHROW(make(cfg, local_ll{}));
}

}  // namespace low_latency_tests
