// SPDX-FileCopyrightText: 2026 The epmoe authors
// SPDX-License-Identifier: Apache-2.0
// 8-bit rows on the wire (issue 37; layer_config::dispatch_rows = row_format::int8): a token
// is quantised once at home (int8, one fp32 scale per row), its rows cross as bytes and are
// dequantised into the experts' input rows. Checked: the row format against its scalar
// definition (reference::int8_token); the experts compute on exactly the dequantised tokens
// (every exchange: flat, rounds, dedup, windows, hierarchical, pipelined; 1, 2, 4 thread
// ranks; every comm); the layer within the rounding's error bound of the fp32 reference with
// fp32, bf16 and int8 packed experts; the bytes the comm moved and the stats, exactly; NaN
// and Inf tokens; forward only.
#include <catch2/catch.hpp>
#include <cmath>
#include <limits>
#include <optional>
#include <vector>

#include "harness.hpp"
#include <epmoe/comm/any.hpp>
#include <epmoe/comm/throttled.hpp>
#include <epmoe/reference/quantised.hpp>
#include <epmoe/router/biased.hpp>
#include <epmoe/router/hash.hpp>
#include <epmoe/schedule/pipelined.hpp>

using namespace epmoe;

namespace {

constexpr float nan_f = std::numeric_limits<float>::quiet_NaN();

// comm::threads that adds up the bytes of 8-bit rows (std::uint8_t elements) it sends to
// other ranks: what crossed, as the comm saw it.
struct counting {
  comm::threads inner;
  index_t* wire_bytes;
  int rank() const { return inner.rank(); }
  int size() const { return inner.size(); }
  template <class T>
  void alltoall(const T* s, T* r, index_t n) {
    inner.alltoall(s, r, n);
  }
  template <class T>
  void alltoallv(const T* s, const index_t* sn, const index_t* sd, T* r, const index_t* rn,
                 const index_t* rd) {
    if constexpr (std::is_same_v<T, std::uint8_t>)
      for (int q = 0; q < size(); ++q)
        if (q != rank()) *wire_bytes += sn[q];
    inner.alltoallv(s, sn, sd, r, rn, rd);
  }
};

template <class Router, bool Dedup, bool Hier, class Schedule = schedule::sequential,
          class Comm = counting>
struct wire_policies : default_policies {
  using router = Router;
  using comm = Comm;
  using schedule = Schedule;
  static constexpr layer_options options{.dedup = Dedup, .hierarchical = Hier};
};
using hashed = router::hash<2>;
using softmax = router::topk_softmax<2>;

struct run_options {
  std::optional<weights_format> pack{};  // packed experts in this format
  space::cpu_path path = space::best_cpu_path();
  std::vector<std::int64_t> ids{};  // token ids (router::hash), global order
};
struct wire_run {
  std::vector<float> y;           // global token order
  std::vector<pass_stats> stats;  // [rank]
  std::vector<index_t> moved;     // [rank]: bytes of 8-bit rows the comm sent to other ranks
};

// The comm of a rank: the policy's, made from comm::threads (and a byte counter).
struct make_counting {
  template <class Use>
  void operator()(comm::threads c, index_t* bytes, Use&& use) const {
    use(counting{std::move(c), bytes});
  }
};

// One forward of moe_layer<P> on cfg.ranks thread ranks; y starts NaN.
template <class P, class Make = make_counting>
wire_run run_wire(const layer_config& cfg, const reference::full_weights& w,
                  const test::global_tokens& g, const run_options& o = {}, Make make = {}) {
  wire_run out{std::vector<float>(g.x.size(), nan_f),
               std::vector<pass_stats>(std::size_t(cfg.ranks)),
               std::vector<index_t>(std::size_t(cfg.ranks), 0)};
  comm::threads_world world(cfg.ranks);
  world.run([&](comm::threads c) {
    const int r = c.rank();
    make(std::move(c), &out.moved[std::size_t(r)], [&](typename P::comm comm) {
      const typename P::placement where(cfg);
      test::rank_arrays<P> arrays(w, reference::slice(w, where, r));
      space::host space;
      space.set_cpu_path(o.path);
      moe_layer<P> layer(cfg, std::move(comm), arrays.views(cfg, where.slots_per_rank()), {}, {},
                         where, space);
      if (o.pack) layer.pack_weights(*o.pack);
      const index_t T = g.per_rank[std::size_t(r)], H = cfg.hidden, at = g.offset(r);
      std::vector<float> y(std::size_t(T * H), nan_f);
      const std::span<const std::int64_t> ids =
          o.ids.empty() ? std::span<const std::int64_t>() : std::span(o.ids).subspan(at, T);
      layer.forward({g.x.data() + at * H, T, H}, {y.data(), T, H}, ids);
      out.stats[std::size_t(r)] = layer.stats();
      std::copy(y.begin(), y.end(), out.y.begin() + at * H);
    });
  });
  return out;
}

// Every token's row as the wire carries it: reference::int8_token, the format's definition,
// rounded to float (what the receiver's fp32 product scale * q gives).
std::vector<float> dequantised(const std::vector<float>& x, index_t H) {
  std::vector<float> out(x.size());
  for (std::size_t t = 0; t < x.size() / std::size_t(H); ++t) {
    const std::vector<double> row = reference::int8_token(x.data() + t * H, H);
    for (index_t h = 0; h < H; ++h) out[t * H + h] = static_cast<float>(row[std::size_t(h)]);
  }
  return out;
}

// Tokens with rows that test the rounding: a row of ties (max 127: x · 127/max = x, so 2.5
// rounds to 2 and -0.5 to -0 by half-even), a zero row, a tiny one and a larger one.
test::global_tokens crafted_tokens(std::vector<index_t> per_rank, index_t H, std::uint64_t seed) {
  test::global_tokens g = test::make_tokens(std::move(per_rank), H, seed);
  const index_t n = g.total();
  const auto row = [&](index_t t) { return g.x.data() + (t % n) * H; };
  for (index_t h = 0; h < H; ++h) {
    row(0)[h] = h == 0 ? 127.f : static_cast<float>(h % 7) - 2.5f;  // ties: ±0.5, 1.5, 2.5 ...
    row(1)[h] = 0.f;
    row(2)[h] *= 1e-30f;
    row(3)[h] *= 900.f;
  }
  return g;
}

std::vector<std::int64_t> token_ids(index_t n) {
  std::vector<std::int64_t> ids(static_cast<std::size_t>(n));
  for (index_t t = 0; t < n; ++t) ids[std::size_t(t)] = 1000 + 37 * t;
  return ids;
}

// H + 4 a multiple of 16: a wire row is exactly its stride, so the comm's bytes are the stats'.
layer_config wire_layer(int ranks, int per_node = 0) {
  return {.hidden = 60,
          .ffn = 37,
          .experts = 8,
          .top_k = 2,
          .ranks = ranks,
          .max_tokens = 48,
          .ranks_per_node = per_node,
          .dispatch_rows = row_format::int8};
}

std::vector<index_t> uneven(int R) {
  std::vector<index_t> n;
  for (int r = 0; r < R; ++r) n.push_back(r == 1 ? 0 : 48 - 5 * r);
  return n;
}

// The experts' rows are exactly the dequantised tokens: the layer on x equals the reference
// on x' (router::hash routes by token id alone, so x and x' take the same experts), and
// differs from the reference on x by the rounding. Returns the checks run.
template <class P>
int check_dequantised(layer_config cfg, int max_recv_rows = 0) {
  cfg.max_recv_rows = max_recv_rows;
  const auto w = reference::full_weights::random(cfg, 11);
  const auto g = crafted_tokens(uneven(cfg.ranks), cfg.hidden, 3 + cfg.ranks);
  const auto ids = token_ids(g.total());
  const auto got = run_wire<P>(cfg, w, g, {.ids = ids});
  test::global_tokens gq = g;
  gq.x = dequantised(g.x, cfg.hidden);
  const test::run_options<P> ro{.token_ids = ids};
  const auto exact = test::run_reference<P>(cfg, w, gq, ro);
  const auto fp32 = test::run_reference<P>(cfg, w, g, ro);
  const double err = test::relative_error(got.y, exact), off = test::relative_error(got.y, fp32);
  INFO("R=" << cfg.ranks << " max_recv_rows=" << max_recv_rows << " vs dequantised " << err
            << ", vs fp32 " << off);
  CHECK(err <= 2e-6);
  CHECK(off > 100 * 2e-6);  // the rounding shows: 8-bit rows did cross
  // Bytes: what the comm moved of 8-bit rows is the stats' dispatch rows, H + 4 bytes each
  // (dedup: less the assignments' 8 bytes of metadata, int64 elements).
  const bool meta = P::options.dedup || P::options.hierarchical;
  for (int r = 0; r < cfg.ranks; ++r) {
    const pass_stats& s = got.stats[std::size_t(r)];
    index_t rows = 0, assignments = 0;
    for (int q = 0; q < cfg.ranks; ++q)
      if (q != r) {
        rows += s.rows_sent[std::size_t(q)];
        assignments += s.assignment_rows_sent[std::size_t(q)];
      }
    const index_t moved = got.moved[std::size_t(r)];
    if (!P::options.hierarchical) CHECK(moved == rows * (cfg.hidden + 4));
    CHECK(moved == s.dispatch_bytes_sent - (meta ? 8 * assignments : 0));
    if (!P::options.hierarchical)  // the combine: fp32 rows back
      CHECK(s.combine_bytes_received == rows * cfg.hidden * 4);
  }
  return 1;
}

}  // namespace

TEST_CASE("wire rows: quantise_row is the format's definition, ties to even, NaN and Inf",
          "[wire]") {
  constexpr index_t H = 37;
  const index_t stride = wire_row::stride(H);
  CHECK(wire_row::bytes(H) == 41);
  CHECK(stride == 48);
  std::vector<std::vector<float>> rows;
  for (std::uint64_t seed = 1; seed <= 20; ++seed) {
    std::vector<float> x = reference::random_tokens(1, H, seed);
    for (float& v : x) v *= static_cast<float>(std::exp2(double(seed % 9) * 7 - 30) * 1.37);
    rows.push_back(x);
  }
  std::vector<float> ties(H), tiny(H, 1e-35f), neg(H, -0.25f);
  for (index_t h = 0; h < H; ++h) ties[h] = h == 0 ? -127.f : static_cast<float>(h % 9) * 0.5f;
  neg[5] = -3.f;
  rows.insert(rows.end(), {ties, std::vector<float>(std::size_t(H), 0.f), tiny, neg});
  int checked = 0;
  for (const auto& x : rows) {
    std::vector<std::uint8_t> wire(static_cast<std::size_t>(stride), 0xAB);
    wire_ops::quantise_row(x.data(), H, wire.data());
    std::vector<float> back(std::size_t(H), nan_f);
    wire_ops::dequantise_row(wire.data(), back.data(), 0, H);
    const std::vector<double> want = reference::int8_token(x.data(), H);
    for (index_t h = 0; h < H; ++h) {
      CHECK(back[h] == static_cast<float>(want[std::size_t(h)]));
      CHECK(std::abs(int{wire_ops::values_of(wire.data())[h]}) <= 127);
      ++checked;
    }
  }
  // Half to even: 0.5 -> 0, 1.5 -> 2, 2.5 -> 2, 3.5 -> 4 (scale 1).
  std::vector<std::uint8_t> wire(static_cast<std::size_t>(stride));
  wire_ops::quantise_row(ties.data(), H, wire.data());
  CHECK(wire_ops::scale_of(wire.data()) == 1.f);
  const std::int8_t* q = wire_ops::values_of(wire.data());
  CHECK(q[0] == -127);
  CHECK((q[1] == 0 && q[3] == 2 && q[5] == 2 && q[7] == 4));
  CHECK(checked == 24 * H);
  // A row holding NaN or ±Inf: scale NaN, values 0, all NaN on arrival; a zero row: zeros.
  for (float bad :
       {nan_f, std::numeric_limits<float>::infinity(), -std::numeric_limits<float>::infinity()}) {
    std::vector<float> x = rows[0];
    x[3] = bad;
    wire_ops::quantise_row(x.data(), H, wire.data());
    CHECK(std::isnan(wire_ops::scale_of(wire.data())));
    std::vector<float> back(std::size_t(H), 0.f);
    wire_ops::dequantise_row(wire.data(), back.data(), 0, H);
    for (float v : back) CHECK(std::isnan(v));
  }
  // A zero row, and one below 127 / FLT_MAX (127 / max overflows): scale 0, values 0.
  for (float v : {0.f, 1e-37f, -3e-39f}) {
    std::vector<float> x(std::size_t(H), v), back(std::size_t(H), nan_f);
    x[1] = v / 2;
    wire_ops::quantise_row(x.data(), H, wire.data());
    CHECK(wire_ops::scale_of(wire.data()) == 0.f);
    wire_ops::dequantise_row(wire.data(), back.data(), 0, H);
    for (float b : back) CHECK(b == 0.f);
  }
}

TEST_CASE("wire rows: the experts compute on the dequantised tokens, every exchange", "[wire]") {
  int runs = 0;
  for (int R : {1, 2, 4}) {
    runs += check_dequantised<wire_policies<hashed, false, false>>(wire_layer(R));
    runs += check_dequantised<wire_policies<hashed, false, false>>(wire_layer(R), 3 * R);
    runs += check_dequantised<wire_policies<hashed, false, false, schedule::pipelined<3>>>(
        wire_layer(R), 3 * 3 * R);
    runs += check_dequantised<wire_policies<hashed, true, false>>(wire_layer(R));
    runs += check_dequantised<wire_policies<hashed, true, false>>(wire_layer(R), 4 * R);
    const int G = R == 4 ? 2 : 1;
    runs += check_dequantised<wire_policies<hashed, true, true, schedule::pipelined<3>>>(
        wire_layer(R, G));
    runs += check_dequantised<wire_policies<hashed, true, true, schedule::pipelined<3>>>(
        wire_layer(R, G), 3 * 2 * R);
  }
  CHECK(runs == 21);
}

namespace {

double rms_error(const std::vector<float>& got, const std::vector<float>& want) {
  double d = 0, n = 0;
  for (std::size_t i = 0; i < got.size(); ++i) {
    if (!std::isfinite(got[i]) || !std::isfinite(want[i]))
      return std::numeric_limits<double>::infinity();
    d += (double{got[i]} - want[i]) * (double{got[i]} - want[i]);
    n += double{want[i]} * want[i];
  }
  return std::sqrt(d / std::max(n, 1e-300));
}

// The wire's error bound (docs/wire.md). Rounding a token x
// to steps s = max |x| / 127 errs by at most s / 2, about uniformly: rms s / sqrt(12), so the
// row's relative rms error is rho(x) = max |x| sqrt(H) / (127 sqrt(12) |x|_2) <= sqrt(H) /
// (127 sqrt(12)). Through a SwiGLU expert the gate's relative error passes silu with a gain
// <= 2 and the up projection's with 1; both come from the same rounding, so they add: 3 rho
// at the expert's output (the projections keep a relative error, on average). Only the routed
// experts see the rounding (the router and the shared experts read x at home), so the
// layer's relative rms error is at most 3 rho |y_routed| / |y|; x3: a first-order,
// statistical estimate (as the int8 weights' bound), given a margin.
double token_rho(const std::vector<float>& x, index_t H) {
  double worst = 0;
  for (std::size_t t = 0; t < x.size() / std::size_t(H); ++t) {
    double amax = 0, ss = 0;
    for (index_t h = 0; h < H; ++h) {
      const double v = x[t * H + h];
      amax = std::max(amax, std::abs(v));
      ss += v * v;
    }
    if (ss > 0) worst = std::max(worst, amax * std::sqrt(double(H)) / (127 * std::sqrt(12.0 * ss)));
  }
  return worst;
}

double norm(const std::vector<float>& v) {
  double s = 0;
  for (float x : v) s += double{x} * x;
  return std::sqrt(s);
}

// The layer with 8-bit rows against the fp32 reference (fp32 experts), or against the same
// packed format without them (the wire's own share of the error; `Reference` false: the
// layer without them, for a block reference::forward does not compute); returns the runs.
template <class P, bool Reference = true>
int check_bound(int R, index_t T, std::optional<weights_format> pack, space::cpu_path path) {
  layer_config cfg{.hidden = 67,
                   .ffn = 90,
                   .experts = 8,
                   .top_k = 2,
                   .ranks = R,
                   .max_tokens = static_cast<int>(T),
                   .capacity_factor = 8,
                   .shared_experts = 1,
                   .shared_ffn = 45,
                   .dispatch_rows = row_format::int8};
  const auto w = reference::full_weights::random(cfg, 41 + R);
  const auto g = test::make_tokens(std::vector<index_t>(std::size_t(R), T), cfg.hidden, 5 * R + T);
  const run_options o{.pack = pack, .path = path};
  const auto got = run_wire<P>(cfg, w, g, o);
  layer_config plain = cfg, routed = cfg;
  plain.dispatch_rows = routed.dispatch_rows = row_format::activations;
  routed.shared_experts = 0;
  const auto want = Reference ? test::run_reference<P>(cfg, w, g) : run_wire<P>(plain, w, g).y;
  const auto routed_y =
      Reference ? test::run_reference<P>(routed, w, g) : run_wire<P>(routed, w, g).y;
  // Packed: the same format without 8-bit rows.
  const std::vector<float> base = pack ? run_wire<P>(plain, w, g, o).y : want;
  const double rho = token_rho(g.x, cfg.hidden), err = rms_error(got.y, base);
  const double bound = 3 * 3 * rho * norm(routed_y) / norm(want);
  const bool w8a8 = pack == weights_format::int8_channel &&
                    space::int8_kernel_for(path) == space::int8_kernel::avx512_vnni;
  INFO((pack ? pack->name() : "fp32 (unpacked)")
       << " path " << space::name_of(path) << " R=" << R << " T=" << T << " error " << err
       << " bound " << bound << " (rho " << rho << ")");
  if (w8a8) {
    // W8A8 quantises each expert row per token as the wire did: the dequantised row gives the
    // same int8 values (and its scale within an ulp), so the wire adds no error.
    CHECK(err <= 1e-5);
  } else {
    CHECK(err <= bound);
    CHECK(err >= bound / 100);  // the rounding shows: 8-bit rows did cross
  }
  // The check can fail: outputs 3 bounds off in scale (a wrong-scale bug) exceed it.
  std::vector<float> off = got.y;
  for (float& v : off) v *= static_cast<float>(1 + 3 * bound);
  CHECK(rms_error(off, base) > bound);
  return 1;
}

// Llama 4: top-K of the logits, σ(logit) scaling each expert's input (weighting::input):
// the wire row of (token, k) is the token's with its scale times the weight.
template <int K>
struct llama4_like : router::llama4<K> {
  llama4_like() { this->normalize = false; }
};
struct llama4_policies : wire_policies<llama4_like<2>, false, false> {
  using weighting = epmoe::weighting::input;
};

}  // namespace

TEST_CASE("wire rows: within the rounding's bound of fp32, with fp32, bf16, int8 experts",
          "[wire]") {
  using P = wire_policies<softmax, false, false>;
  int runs = 0;
  for (int R : {1, 2, 4})
    for (index_t T : {1, 7, 61}) {
      runs += check_bound<P>(R, T, std::nullopt, space::best_cpu_path());
      runs += check_bound<P>(R, T, weights_format::bf16, space::best_cpu_path());
      for (space::cpu_path path : {space::cpu_path::portable, space::best_cpu_path()})
        runs += check_bound<P>(R, T, weights_format::int8_channel, path);
      runs += check_bound<wire_policies<softmax, true, false>>(R, T, std::nullopt,
                                                               space::best_cpu_path());
      runs += check_bound<llama4_policies, false>(R, T, std::nullopt, space::best_cpu_path());
    }
  CHECK(runs == 54);
}

TEST_CASE("wire rows: the same outputs over every comm (local, throttled, any)", "[wire]") {
  using Threads = wire_policies<softmax, false, false, schedule::pipelined<2>>;
  for (int R : {1, 2}) {
    layer_config cfg = wire_layer(R);
    const auto w = reference::full_weights::random(cfg, 5);
    const auto g = test::make_tokens(uneven(R), cfg.hidden, 6);
    const auto base = run_wire<Threads>(cfg, w, g).y;
    const auto slow = run_wire<wire_policies<softmax, false, false, schedule::pipelined<2>,
                                             comm::throttled<comm::threads>>>(
        cfg, w, g, {}, [](comm::threads c, index_t*, auto&& use) {
          use(comm::throttled<comm::threads>(std::move(c), comm::link{1e9, 1e-6}));
        });
    const auto any =
        run_wire<wire_policies<softmax, false, false, schedule::pipelined<2>, comm::any>>(
            cfg, w, g, {}, [](comm::threads c, index_t*, auto&& use) {
              comm::endpoint_of<comm::threads> ep(std::move(c));
              use(comm::any(ep));
            });
    // The same rows and arithmetic (sums may differ in the last bit with buffer alignment).
    CHECK(test::relative_error(slow.y, base) <= 1e-6);
    CHECK(test::relative_error(any.y, base) <= 1e-6);
    CHECK(slow.stats[0].dispatch_bytes_sent == any.stats[0].dispatch_bytes_sent);
    if (R == 1) {
      const auto local =
          run_wire<wire_policies<softmax, false, false, schedule::sequential, comm::local>>(
              cfg, w, g, {}, [](comm::threads, index_t*, auto&& use) { use(comm::local{}); });
      CHECK(test::relative_error(local.y, base) <= 1e-6);
    }
    for (float v : base) CHECK(std::isfinite(v));
  }
}

TEST_CASE("wire rows: bytes are the routing's rows at H + 4 bytes, the combine's at 4H", "[wire]") {
  // Counted from the routing, as a user would: token t's kept assignments on other ranks
  // (flat: one row each; dedup: one per (token, rank)); the same layer without 8-bit rows
  // sends 4H bytes a row: the ratio is (H + 4) / 4H.
  for (bool dedup : {false, true}) {
    const layer_config cfg = wire_layer(4);
    const auto w = reference::full_weights::random(cfg, 21);
    const auto g = test::make_tokens(uneven(4), cfg.hidden, 22);
    const auto ids = token_ids(g.total());
    layer_config plain_cfg = cfg;
    plain_cfg.dispatch_rows = row_format::activations;
    const auto run = [&](const layer_config& c) {
      return dedup ? run_wire<wire_policies<hashed, true, false>>(c, w, g, {.ids = ids})
                   : run_wire<wire_policies<hashed, false, false>>(c, w, g, {.ids = ids});
    };
    const wire_run wire = run(cfg), plain = run(plain_cfg);
    const placement::block where(cfg);
    const index_t H = cfg.hidden;
    int checked = 0;
    for (int r = 0; r < 4; ++r) {
      index_t rows = 0, assignments = 0;
      for (index_t t = g.offset(r); t < g.offset(r) + g.per_rank[std::size_t(r)]; ++t) {
        bool to[4] = {};
        int e[2];
        float wt[2];
        hashed{}.route_token({.experts = cfg.experts, .token = ids[std::size_t(t)]}, e, wt);
        for (int k = 0; k < 2; ++k) {
          const int q = where.rank_of(e[k]);
          if (q == r) continue;
          ++assignments;
          rows += dedup ? !to[q] : 1;
          to[q] = true;
        }
      }
      const pass_stats &s = wire.stats[std::size_t(r)], &p = plain.stats[std::size_t(r)];
      const index_t meta = dedup ? 8 * assignments : 0;
      CHECK(s.dispatch_bytes_sent == rows * (H + 4) + meta);
      CHECK(p.dispatch_bytes_sent == rows * 4 * H + meta);
      CHECK(s.combine_bytes_sent == p.combine_bytes_sent);  // the combine stays fp32
      CHECK(s.combine_bytes_received == rows * 4 * H);
      CHECK(wire.moved[std::size_t(r)] == rows * (H + 4));  // what the comm moved
      CHECK(plain.moved[std::size_t(r)] == 0);
      index_t events = 0, meta_in = 0;  // the dispatch events' bytes: the rows' alone
      for (const timeline_event& e : s.timeline)
        if (e.stage == stage_kind::dispatch) events += e.bytes;
      for (int q = 0; q < 4; ++q)
        if (q != r) meta_in += s.assignment_rows_received[std::size_t(q)];
      CHECK(events == s.dispatch_bytes_received - (dedup ? 8 * meta_in : 0));
      ++checked;
    }
    CHECK(checked == 4);
  }
}

TEST_CASE("wire rows: a NaN or Inf token arrives all NaN, the others as they were", "[wire]") {
  using P = wire_policies<hashed, true, false>;
  const layer_config cfg = wire_layer(2);
  const auto w = reference::full_weights::random(cfg, 31);
  auto g = test::make_tokens({20, 20}, cfg.hidden, 32);
  const index_t H = cfg.hidden;
  g.x[5] = nan_f;                                            // token 0 (rank 0)
  g.x[21 * H + 7] = std::numeric_limits<float>::infinity();  // token 21 (rank 1)
  const auto ids = token_ids(g.total());
  const auto got = run_wire<P>(cfg, w, g, {.ids = ids});
  test::global_tokens gq = g;
  gq.x = dequantised(g.x, H);
  const auto want = test::run_reference<P>(cfg, w, gq, {.token_ids = ids});
  int bad = 0;
  std::vector<float> a, b;
  for (index_t t = 0; t < g.total(); ++t)
    for (index_t h = 0; h < H; ++h) {
      const float v = got.y[std::size_t(t * H + h)];
      if (t == 0 || t == 21) {
        bad += std::isnan(v);
      } else {
        a.push_back(v);
        b.push_back(want[std::size_t(t * H + h)]);
      }
    }
  CHECK(bad == 2 * H);  // every column of both rows
  CHECK(test::relative_error(a, b) <= 2e-6);
}

TEST_CASE("wire rows: forward only, checked config, agreed by every rank", "[wire]") {
  layer_config cfg{.hidden = 19, .ffn = 23, .experts = 4, .top_k = 2, .max_tokens = 5};
  cfg.training = true;
  cfg.dispatch_rows = row_format::int8;
  const auto w = reference::full_weights::random(cfg, 3);
  auto mine = reference::slice(w, placement::block(cfg), 0);
  moe_layer<default_policies> layer(cfg, comm::local{}, {w.gate_view(), mine.experts()});
  const index_t T = 5, H = cfg.hidden, F = cfg.ffn, E = cfg.experts;
  const auto x = reference::random_tokens(T, H, 4);
  std::vector<float> y(x.size(), nan_f), dy(x.size(), 0.5f), dx(x.size());
  layer.forward({x.data(), T, H}, {y.data(), T, H});
  for (float v : y) CHECK(std::isfinite(v));
  CHECK(layer.stats().dispatch_bytes_sent == 0);  // one rank: nothing crosses
  std::vector<float> g0(std::size_t(E * H)), g1(std::size_t(E * F * H)), g3(g1.size()),
      g2(g1.size());
  moe_layer<default_policies>::gradients grads;
  grads.gate = {g0.data(), E, H};
  grads.experts = {{g1.data(), E, F, H}, {g3.data(), E, F, H}, {g2.data(), E, H, F}};
  CHECK_THROWS_WITH(layer.backward({dy.data(), T, H}, {dx.data(), T, H}, grads),
                    Catch::Contains("dispatch_rows = int8") && Catch::Contains("inference"));
  layer_config odd = cfg;
  odd.dispatch_rows = static_cast<row_format>(7);
  CHECK_THROWS_WITH(odd.validate(), Catch::Contains("dispatch_rows = 7"));
  // Ranks that differ: every rank throws, naming the field.
  comm::threads_world world(2);
  std::vector<std::string> why(2);
  cfg.ranks = 2;
  cfg.training = false;
  const auto w2 = reference::full_weights::random(cfg, 3);
  world.run([&](comm::threads c) {
    const int r = c.rank();
    layer_config mine_cfg = cfg;
    if (r == 1) mine_cfg.dispatch_rows = row_format::activations;
    const auto slice = reference::slice(w2, placement::block(cfg), r);
    try {
      moe_layer<test::threads_policies<2>> l(mine_cfg, c, {w2.gate_view(), slice.experts()});
    } catch (const config_error& e) {
      why[std::size_t(r)] = e.what();
    }
  });
  for (const std::string& s : why) CHECK_THAT(s, Catch::Contains("dispatch_rows"));
}
