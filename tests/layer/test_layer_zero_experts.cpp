// SPDX-FileCopyrightText: 2026 The epmoe authors
// SPDX-License-Identifier: Apache-2.0
// Zero-computation (identity) experts (config zero_experts, LongCat-Flash): the router scores
// E + Z experts; a pick e >= E adds weight · x at home and sends no row. The layer's forward
// and backward (dx, the gate's E + Z rows, the routed and shared experts' gradients; NaN
// before the call) against the float64 reference on 1, 2 and 4 in-process ranks, flat, dedup
// and hierarchical; the rows sent counted against the routing; tokens that pick zero experts
// only, ranks that receive nothing, and the config's rules.
#include <catch2/catch.hpp>
#include <cmath>
#include <limits>
#include <mutex>
#include <vector>

#include "harness.hpp"
#include <epmoe/reference/backward.hpp>
#include <epmoe/router/biased.hpp>
#include <epmoe/router/sigmoid_bias.hpp>

using namespace epmoe;

namespace {

constexpr float nan_f = std::numeric_limits<float>::quiet_NaN();

/// LongCat-Flash's router: softmax over the E + Z logits, the top K of p + bias (selection
/// only), weights p times routed_scaling_factor, not renormalised.
template <int K>
struct longcat_like : router::longcat_flash<K> {
  longcat_like() {
    this->normalize = false;
    this->scaling = 2.5f;
  }
  explicit longcat_like(const std::vector<float>& bias) : longcat_like() {
    this->bias = bias.data();
  }
};
/// A selection bias [E + Z] of the size of the softmax probabilities' differences.
std::vector<float> selection_bias(const layer_config& cfg, std::uint64_t seed) {
  std::vector<float> b = reference::random_tokens(1, cfg.scored_experts(), seed);
  for (float& v : b) v *= 0.125f;
  return b;
}

template <class Router, bool Dedup = false, bool Hierarchical = false>
struct zero_policies : default_policies {
  using comm = epmoe::comm::threads;
  using router = Router;
  static constexpr layer_options options{.dedup = Dedup, .hierarchical = Hierarchical};
};

layer_config zero_layer(int ranks, int top_k, int zero = 4) {
  return {.hidden = 12,
          .ffn = 10,
          .experts = 8,
          .zero_experts = zero,
          .top_k = top_k,
          .ranks = ranks,
          .max_tokens = 24};
}

struct step_result {
  std::vector<float> y, dx, dgate, dw1, dw3, dw2, dsw1, dsw3, dsw2;
  std::vector<pass_stats> stats;               // per rank
  std::vector<std::vector<std::int32_t>> ids;  // per rank: the routing's ids [T, K]
};

void add_slots(std::vector<float>& into, const std::vector<float>& slots, index_t per,
               const placement::block& where, int rank) {
  for (index_t j = 0; j < where.slots_per_rank(); ++j) {
    const index_t e = where.expert_at(rank, static_cast<int>(j));
    for (index_t i = 0; i < per; ++i) {
      float& o = into[e * per + i];
      o = (std::isnan(o) ? 0.f : o) + slots[j * per + i];
    }
  }
}

/// Forward and backward on cfg.ranks in-process ranks; the gate's and shared experts'
/// gradients summed over the ranks, each expert's over its slots.
template <class P>
step_result run_step(layer_config cfg, const reference::full_weights& w,
                     const test::global_tokens& g, const std::vector<float>& dy,
                     typename P::router router = {}) {
  cfg.training = true;
  const index_t H = cfg.hidden, S = cfg.scored_experts(), F = cfg.ffn, N = cfg.shared_experts;
  step_result out;
  out.y.assign(g.x.size(), nan_f);
  out.dx.assign(g.x.size(), nan_f);
  out.dgate.assign(S * H, 0.f);
  for (auto* v : {&out.dw1, &out.dw3, &out.dw2}) v->assign(cfg.experts * F * H, nan_f);
  for (auto* v : {&out.dsw1, &out.dsw3, &out.dsw2}) v->assign(N * F * H, 0.f);
  out.stats.resize(cfg.ranks);
  out.ids.resize(cfg.ranks);
  std::mutex m;
  comm::threads_world world(cfg.ranks);
  world.run([&](comm::threads c) {
    const int r = c.rank();
    const placement::block where(cfg);
    const index_t L = where.slots_per_rank();
    const reference::rank_weights mine = reference::slice(w, where, r);
    typename moe_layer<P>::weights wv{};
    wv.gate = w.gate_view();
    wv.experts = mine.experts();
    wv.shared = w.shared();
    moe_layer<P> layer(cfg, c, wv, router, {}, where);
    const index_t T = g.per_rank[r], at = g.offset(r) * H;
    std::vector<float> x(g.x.begin() + at, g.x.begin() + at + T * H);
    std::vector<float> d(dy.begin() + at, dy.begin() + at + T * H);
    std::vector<float> y(T * H, nan_f), dx(T * H, nan_f);
    const auto n = [](index_t k) { return std::vector<float>(k, nan_f); };
    std::vector<float> gate = n(S * H), w1 = n(L * F * H), w3 = n(L * F * H), w2 = n(L * H * F),
                       s1 = n(N * F * H), s3 = n(N * F * H), s2 = n(N * H * F);
    typename moe_layer<P>::gradients gv{};
    gv.gate = {gate.data(), S, H};
    gv.experts = {{w1.data(), L, F, H}, {w3.data(), L, F, H}, {w2.data(), L, H, F}};
    if (N > 0) gv.shared = {{s1.data(), N, F, H}, {s3.data(), N, F, H}, {s2.data(), N, H, F}};
    layer.forward({x.data(), T, H}, {y.data(), T, H});
    const pass_stats st = layer.stats();
    const routing_view rv = layer.last_routing();
    std::vector<std::int32_t> ids(rv.ids.data, rv.ids.data + T * cfg.top_k);
    layer.backward({d.data(), T, H}, {dx.data(), T, H}, gv);
    std::lock_guard lock(m);
    out.stats[r] = st;
    out.ids[r] = std::move(ids);
    std::copy(y.begin(), y.end(), out.y.begin() + at);
    std::copy(dx.begin(), dx.end(), out.dx.begin() + at);
    for (std::size_t i = 0; i < gate.size(); ++i) out.dgate[i] += gate[i];
    for (std::size_t i = 0; i < s1.size(); ++i)
      out.dsw1[i] += s1[i], out.dsw3[i] += s3[i], out.dsw2[i] += s2[i];
    add_slots(out.dw1, w1, F * H, where, r), add_slots(out.dw3, w3, F * H, where, r);
    add_slots(out.dw2, w2, H * F, where, r);
  });
  return out;
}

std::vector<float> as_float(const std::vector<double>& v) { return {v.begin(), v.end()}; }

/// What the routing says each rank sends: real-expert picks and zero-expert picks; the stats
/// must count the same, and the rows sent (without dedup: one per real pick; with dedup: one
/// per (token, rank holding a real pick)) must come from real picks only.
int check_rows(const layer_config& cfg, const step_result& got, bool dedup) {
  int checked = 0;
  const placement::block where(cfg);
  for (int r = 0; r < cfg.ranks; ++r) {
    const auto& ids = got.ids[r];
    const pass_stats& st = got.stats[r];
    index_t real = 0, zero = 0, unique = 0;
    std::vector<index_t> per_rank(cfg.ranks, 0);  // real picks per destination
    for (std::size_t t = 0; t < ids.size() / cfg.top_k; ++t) {
      std::vector<char> seen(cfg.ranks, 0);
      for (int k = 0; k < cfg.top_k; ++k) {
        const int e = ids[t * cfg.top_k + k];
        REQUIRE(e >= 0);
        REQUIRE(e < cfg.scored_experts());
        if (e >= cfg.experts) {
          ++zero;
          continue;
        }
        ++real;
        const int dest = e / where.slots_per_rank();
        ++per_rank[dest];
        if (!seen[dest]) seen[dest] = 1, ++unique;
      }
    }
    INFO("rank " << r << ": real picks " << real << ", zero picks " << zero);
    CHECK(st.assignments == real);
    CHECK(st.zero_expert_assignments == zero);
    CHECK(real + zero == st.tokens * cfg.top_k);
    index_t sent = 0, assignment_rows = 0;
    for (int d = 0; d < cfg.ranks; ++d) {
      CHECK(st.assignment_rows_sent[d] == per_rank[d]);
      sent += st.rows_sent[d];
      assignment_rows += st.assignment_rows_sent[d];
    }
    CHECK(assignment_rows == real);  // no row for a zero expert
    if (!dedup) CHECK(sent == real);
    if (dedup && cfg.ranks_per_node == 0) CHECK(sent == unique);
    index_t routed = 0;
    for (index_t v : st.routed_per_expert) routed += v;
    CHECK(st.routed_per_expert.size() == static_cast<std::size_t>(cfg.experts));
    CHECK(routed == real);
    checked += 7;
  }
  return checked;
}

/// The layer's step against the reference: y, dx, the gate's E + Z rows, every expert's
/// gradients, and the rows each rank sent. Returns the number of checks.
template <class P>
int check_step(const layer_config& cfg, const reference::full_weights& w,
               const test::global_tokens& g, typename P::router router = {}, index_t min_zero = 1) {
  const std::vector<float> dy = reference::random_tokens(g.total() * cfg.hidden, 1, 77);
  const step_result got = run_step<P>(cfg, w, g, dy, router);
  const index_t n = g.total(), H = cfg.hidden;
  std::vector<float> y(g.x.size(), nan_f);
  const placement::block where(cfg);
  reference::forward(w, router, capacity::dropless{}, where, {g.x.data(), n, H}, g.per_rank,
                     {y.data(), n, H});
  const reference::gradients want = reference::backward(
      w, router, capacity::dropless{}, where, {g.x.data(), n, H}, g.per_rank, {dy.data(), n, H});
  int checked = 0;
  const auto check = [&](const char* name, const std::vector<float>& a, const std::vector<float>& b,
                         double tol) {
    const double e = test::relative_error(a, b);
    INFO(name << " error " << e);
    CHECK(e <= tol);
    ++checked;
  };
  index_t zero = 0;
  for (const auto& st : got.stats) zero += st.zero_expert_assignments;
  CHECK(zero >= min_zero);  // the zero experts were picked
  check("y", got.y, y, 1e-5);
  check("dx", got.dx, as_float(want.dx), 2e-5);
  check("dgate", got.dgate, as_float(want.dgate), 2e-5);
  check("dw1", got.dw1, as_float(want.dw1), 2e-5);
  check("dw3", got.dw3, as_float(want.dw3), 2e-5);
  check("dw2", got.dw2, as_float(want.dw2), 2e-5);
  if (cfg.shared_experts > 0) {
    check("dshared_w1", got.dsw1, as_float(want.dshared_w1), 2e-5);
    check("dshared_w3", got.dsw3, as_float(want.dshared_w3), 2e-5);
    check("dshared_w2", got.dsw2, as_float(want.dshared_w2), 2e-5);
  }
  constexpr bool dedup = moe_layer<P>::dedup;
  return checked + check_rows(cfg, got, dedup);
}

/// Tokens of one sign and a gate whose rows `negative` point the other way: those experts
/// never win a token (their logits are far below the others').
reference::full_weights steered(const layer_config& cfg, std::vector<int> negative,
                                std::uint64_t seed) {
  auto w = reference::full_weights::random(cfg, seed);
  const index_t H = cfg.hidden;
  for (int e = 0; e < cfg.scored_experts(); ++e)
    for (index_t h = 0; h < H; ++h) w.gate[e * H + h] = std::abs(w.gate[e * H + h]) + 0.25f;
  for (int e : negative)
    for (index_t h = 0; h < H; ++h) w.gate[e * H + h] = -1.f;
  return w;
}
test::global_tokens positive_tokens(std::vector<index_t> per_rank, index_t H, std::uint64_t seed) {
  auto g = test::make_tokens(std::move(per_rank), H, seed);
  for (float& v : g.x) v = std::abs(v) + 0.0625f;
  return g;
}

}  // namespace

TEST_CASE("zero experts: w x at home, no rows sent, forward and backward against the reference",
          "[layer][backward][zero_experts]") {
  int checked = 0, cases = 0;
  for (int ranks : {1, 2, 4}) {
    INFO("ranks " << ranks);
    const layer_config cfg = zero_layer(ranks, 4);
    const auto w = reference::full_weights::random(cfg, 5);
    const auto g = test::make_tokens(std::vector<index_t>(ranks, 20), cfg.hidden, 6);
    const std::vector<float> bias = selection_bias(cfg, 10);
    checked += check_step<zero_policies<longcat_like<4>>>(cfg, w, g, longcat_like<4>(bias)),
        ++cases;
    checked += check_step<zero_policies<longcat_like<4>, true>>(cfg, w, g, longcat_like<4>(bias)),
        ++cases;
    // Any router that scores the E + Z from its gate: softmax top-k, renormalised.
    checked += check_step<zero_policies<router::topk_softmax<4>>>(cfg, w, g), ++cases;
    layer_config shared = zero_layer(ranks, 2, 6);
    shared.shared_experts = 1;
    const auto ws = reference::full_weights::random(shared, 7);
    checked += check_step<zero_policies<router::sigmoid_bias<2>>>(shared, ws, g), ++cases;
  }
  layer_config two_nodes = zero_layer(4, 4);
  two_nodes.ranks_per_node = 2;
  const auto w = reference::full_weights::random(two_nodes, 8);
  const auto g = test::make_tokens({20, 20, 20, 20}, two_nodes.hidden, 9);
  const std::vector<float> bias = selection_bias(two_nodes, 11);
  checked += check_step<zero_policies<longcat_like<4>, false, true>>(two_nodes, w, g,
                                                                     longcat_like<4>(bias)),
      ++cases;
  // 6 checks (+3 with shared experts) and 7 row checks per rank.
  CHECK(cases == 13);
  CHECK(checked == 4 * (6 + 7 * 1) + 4 * (6 + 7 * 2) + 4 * (6 + 7 * 4) + 3 * 3 + (6 + 7 * 4));
}

TEST_CASE("zero experts only: no rank sends or receives a row, y = (sum of weights) x",
          "[layer][backward][zero_experts]") {
  int checked = 0;
  for (int ranks : {1, 2, 4}) {
    INFO("ranks " << ranks);
    const layer_config cfg = zero_layer(ranks, 2, 4);
    // Every real expert's gate row points away from the (positive) tokens: two of the four
    // zero experts win every token (K < Z: with all of them chosen, the gate's gradient would
    // be a difference of nearly equal numbers, below float precision).
    const auto w = steered(cfg, {0, 1, 2, 3, 4, 5, 6, 7}, 12);
    const auto g = positive_tokens(std::vector<index_t>(ranks, 16), cfg.hidden, 13);
    checked += check_step<zero_policies<longcat_like<2>>>(cfg, w, g, {}, 16 * 2 * ranks);
    checked += check_step<zero_policies<longcat_like<2>, true>>(cfg, w, g, {}, 16 * 2 * ranks);
    const std::vector<float> dy = reference::random_tokens(g.total() * cfg.hidden, 1, 14);
    const step_result got = run_step<zero_policies<longcat_like<2>>>(cfg, w, g, dy);
    for (const pass_stats& st : got.stats) {
      CHECK(st.assignments == 0);
      CHECK(st.expert_flops == 0);
      index_t in = 0;
      for (index_t v : st.rows_received) in += v;
      CHECK(in == 0);
      checked += 3;
    }
    for (float v : got.dw1) CHECK(v == 0.f);  // no rows: the experts' gradients are zeros
  }
  CHECK(checked == 2 * (6 + 7) + 3 + 2 * (6 + 7 * 2) + 3 * 2 + 2 * (6 + 7 * 4) + 3 * 4);
}

TEST_CASE("zero experts: ranks that receive nothing (every pick on rank 0 or a zero expert)",
          "[layer][backward][zero_experts]") {
  int checked = 0;
  for (int ranks : {2, 4}) {
    INFO("ranks " << ranks);
    const layer_config cfg = zero_layer(ranks, 4, 4);
    const int L = cfg.experts / ranks;
    std::vector<int> away;
    for (int e = L; e < cfg.experts; ++e) away.push_back(e);  // every expert off rank 0
    const auto w = steered(cfg, away, 15);
    const auto g = positive_tokens(std::vector<index_t>(ranks, 16), cfg.hidden, 16);
    checked += check_step<zero_policies<longcat_like<4>>>(cfg, w, g);
    checked += check_step<zero_policies<longcat_like<4>, true>>(cfg, w, g);
    const std::vector<float> dy = reference::random_tokens(g.total() * cfg.hidden, 1, 17);
    const step_result got = run_step<zero_policies<longcat_like<4>>>(cfg, w, g, dy);
    for (int r = 1; r < ranks; ++r) {
      index_t in = 0;
      for (index_t v : got.stats[r].rows_received) in += v;
      CHECK(in == 0);
      CHECK(got.stats[0].rows_sent[r] == 0);
      checked += 2;
    }
  }
  CHECK(checked == 2 * (6 + 7 * 2) + 2 * 1 + 2 * (6 + 7 * 4) + 2 * 3);
}

TEST_CASE("zero experts: a given routing's weight gradient is dy · x at their slots",
          "[layer][backward][zero_experts]") {
  layer_config cfg = zero_layer(2, 2, 2);
  cfg.training = true;
  const index_t H = cfg.hidden, T = 3, K = 2;
  const auto w = reference::full_weights::random(cfg, 21);
  const auto g = test::make_tokens({T, T}, H, 22);
  const std::vector<float> dy = reference::random_tokens(2 * T * H, 1, 23);
  // Token 0: two zero experts; token 1: a zero expert and expert 5; token 2: experts 1 and 6.
  const std::vector<std::int32_t> ids{8, 9, 9, 5, 1, 6};
  const std::vector<float> wts{0.25f, 0.5f, 0.75f, 1.f, 0.5f, 0.5f};
  int checked = 0;
  std::mutex m;
  comm::threads_world world(2);
  world.run([&](comm::threads c) {
    using P = zero_policies<longcat_like<2>>;
    const int r = c.rank();
    const placement::block where(cfg);
    const index_t L = where.slots_per_rank();
    const reference::rank_weights mine = reference::slice(w, where, r);
    typename moe_layer<P>::weights wv{};
    wv.gate = w.gate_view();
    wv.experts = mine.experts();
    moe_layer<P> layer(cfg, c, wv);
    const float* x = g.x.data() + r * T * H;
    const float* d = dy.data() + r * T * H;
    std::vector<float> y(T * H, nan_f), dx(T * H, nan_f), rg(T * K, nan_f);
    std::vector<float> gate(cfg.scored_experts() * H, nan_f);
    std::vector<float> w1(L * 10 * H, nan_f), w3(w1.size(), nan_f), w2(w1.size(), nan_f);
    typename moe_layer<P>::gradients gv{};
    gv.gate = {gate.data(), cfg.scored_experts(), H};
    gv.experts = {{w1.data(), L, 10, H}, {w3.data(), L, 10, H}, {w2.data(), L, H, 10}};
    layer.forward({x, T, H}, {{ids.data(), T, K}, {wts.data(), T, K}}, {y.data(), T, H});
    layer.backward({d, T, H}, {dx.data(), T, H}, gv, {.routing_grad = {rg.data(), T, K}});
    std::lock_guard lock(m);
    CHECK(layer.stats().zero_expert_assignments == 3);
    CHECK(layer.stats().assignments == 3);
    for (index_t h = 0; h < H; ++h) {  // token 0: only zero experts
      CHECK(y[h] == Approx(0.75f * x[h]).margin(1e-6));
      CHECK(dx[h] == Approx(0.75f * d[h]).margin(1e-6));
      checked += 2;
    }
    for (index_t t : {0, 1}) {
      double dot = 0;
      for (index_t h = 0; h < H; ++h) dot += double{d[t * H + h]} * x[t * H + h];
      CHECK(rg[t * K] == Approx(dot).margin(1e-5));  // slot 0 of tokens 0 and 1: zero experts
      ++checked;
    }
    CHECK(rg[1] == Approx(rg[0]).margin(1e-6));  // token 0's two zero experts
    for (float v : gate) CHECK(v == 0.f);        // a given routing: no router, zero gate grads
    ++checked;
  });
  CHECK(checked == 2 * (2 * 12 + 2 + 1));
}

TEST_CASE("zero experts: the config's rules, named", "[layer][zero_experts]") {
  layer_config cfg = zero_layer(1, 2, -1);
  CHECK_THROWS_WITH(cfg.validate(), Catch::Contains("zero_experts") && Catch::Contains(">= 0"));
  cfg = zero_layer(1, 2, 2);
  cfg.top_k = 11;
  CHECK_THROWS_WITH(cfg.validate(),
                    Catch::Contains("top_k") && Catch::Contains("experts + zero_experts"));
  cfg.top_k = 10;  // E + Z = 10 experts to pick from
  CHECK_NOTHROW(cfg.validate());
  cfg = zero_layer(1, 2, 2);
  const auto w = reference::full_weights::random(cfg, 3);
  const placement::block where(cfg);
  const reference::rank_weights mine = reference::slice(w, where, 0);
  comm::threads_world world(1);
  world.run([&](comm::threads c) {
    using P = zero_policies<longcat_like<2>>;
    typename moe_layer<P>::weights wv{};
    wv.experts = mine.experts();
    wv.gate = {w.gate.data(), cfg.experts, cfg.hidden};  // E rows: the zero experts' missing
    CHECK_THROWS_WITH((moe_layer<P>(cfg, c, wv)), Catch::Contains("weights.gate"));
    wv.gate = w.gate_view();
    CHECK_NOTHROW(moe_layer<P>(cfg, c, wv));
    using H = zero_policies<router::hash<2>>;
    typename moe_layer<H>::weights wh{};
    wh.experts = mine.experts();
    CHECK_THROWS_WITH((moe_layer<H>(cfg, c, wh)),
                      Catch::Contains("zero_experts") && Catch::Contains("scores every expert"));
    using X = zero_policies<router::expert_choice>;
    typename moe_layer<X>::weights wx{};
    wx.gate = w.gate_view();
    wx.experts = mine.experts();
    layer_config ec = cfg;
    ec.top_k = 2;
    CHECK_THROWS_WITH((moe_layer<X>(ec, c, wx)),
                      Catch::Contains("zero_experts") && Catch::Contains("top_k per token"));
  });
}
