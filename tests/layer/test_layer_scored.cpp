// SPDX-FileCopyrightText: 2026 The epmoe authors
// SPDX-License-Identifier: Apache-2.0
// transformers 5.23's scored routers in the layer (router::biased, router::table): DeepSeek-V4
// (sqrtsoftplus top-k and the hash layers' table, with its clamped expert), ERNIE 4.5 MoE,
// LFM2-MoE, Kolibri, the Llama 4 and LongCat-Flash routers: forward and backward (y, dx, dgate,
// dW; NaN before the call) against the float64 reference on 1, 2 and 4 in-process ranks, with
// dedup and hierarchical; and the table's contract (the layer's own copy, checked entries and
// token ids).
#include <barrier>
#include <catch2/catch.hpp>
#include <cmath>
#include <limits>
#include <mutex>
#include <random>
#include <span>
#include <vector>

#include "harness.hpp"
#include <epmoe/expert/clamped_glu.hpp>
#include <epmoe/reference/backward.hpp>
#include <epmoe/router/biased.hpp>
#include <epmoe/router/table.hpp>

// A namespace per file: tests/cuda compiles several of these files in one unit.
namespace layer_scored_tests {
using namespace epmoe;

namespace {

constexpr float nan_f = std::numeric_limits<float>::quiet_NaN();

template <class Router, class Expert, bool Dedup = false, bool Hierarchical = false>
struct scored_policies : default_policies {
  using space = epmoe::space::host;
  using comm = epmoe::comm::threads;
  using router = Router;
  using expert = Expert;
  static constexpr layer_options options{.dedup = Dedup, .hierarchical = Hierarchical};
};

layer_config scored_layer(int ranks, int top_k) {
  return {.hidden = 12, .ffn = 10, .experts = 8, .top_k = top_k, .ranks = ranks, .max_tokens = 24};
}

struct step_result {
  std::vector<float> y, dx, dgate, dw1, dw3, dw2;
};

[[maybe_unused]] void add_slots(std::vector<float>& into, const std::vector<float>& slots,
                                index_t per, const placement::block& where, int rank) {
  for (index_t j = 0; j < where.slots_per_rank(); ++j) {
    const index_t e = where.expert_at(rank, static_cast<int>(j));
    for (index_t i = 0; i < per; ++i) {
      float& o = into[e * per + i];
      o = (std::isnan(o) ? 0.f : o) + slots[j * per + i];
    }
  }
}

/// Forward and backward on cfg.ranks in-process ranks (token ids: all ranks', or empty).
template <class P>
step_result run_step(layer_config cfg, const reference::full_weights& w,
                     const test::global_tokens& g, const std::vector<float>& dy,
                     const typename P::router& router, const std::vector<std::int64_t>& tokens) {
  using X = typename P::expert;
  cfg.training = true;
  const index_t H = cfg.hidden, E = cfg.experts, F = cfg.ffn;
  step_result out;
  out.y.assign(g.x.size(), nan_f);
  out.dx.assign(g.x.size(), nan_f);
  out.dgate.assign(E * H, 0.f);
  for (auto* v : {&out.dw1, &out.dw3, &out.dw2}) v->assign(E * F * H, nan_f);
  std::mutex m;
  comm::threads_world world(cfg.ranks);
  world.run([&](typename P::comm c) {
    const int r = c.rank();
    const placement::block where(cfg);
    const index_t L = where.slots_per_rank();
    const reference::rank_weights mine = reference::slice(w, where, r);
    typename moe_layer<P>::weights wv{};
    wv.gate = w.gate_view();
    wv.experts = reference::views_of<X>::of(mine);
    moe_layer<P> layer(cfg, c, wv, router, typename P::capacity{}, where);
    const index_t T = g.per_rank[r], t0 = g.offset(r), at = t0 * H;
    std::vector<float> x(g.x.begin() + at, g.x.begin() + at + T * H);
    std::vector<float> d(dy.begin() + at, dy.begin() + at + T * H);
    std::vector<float> y(T * H, nan_f), dx(T * H, nan_f);
    const auto n = [](index_t k) { return std::vector<float>(k, nan_f); };
    std::vector<float> gate = n(E * H), w1 = n(L * F * H), w3 = n(L * F * H), w2 = n(L * H * F);
    typename moe_layer<P>::gradients gv{};
    gv.gate = {gate.data(), E, H};
    gv.experts.w1 = {w1.data(), L, F, H}, gv.experts.w3 = {w3.data(), L, F, H};
    gv.experts.w2 = {w2.data(), L, H, F};
    const std::span<const std::int64_t> ids =
        tokens.empty() ? std::span<const std::int64_t>{}
                       : std::span<const std::int64_t>(tokens).subspan(t0, T);
    layer.forward({x.data(), T, H}, {y.data(), T, H}, ids);
    layer.backward({d.data(), T, H}, {dx.data(), T, H}, gv);
    std::lock_guard lock(m);
    std::copy(y.begin(), y.end(), out.y.begin() + at);
    std::copy(dx.begin(), dx.end(), out.dx.begin() + at);
    for (std::size_t i = 0; i < gate.size(); ++i) out.dgate[i] += gate[i];
    add_slots(out.dw1, w1, F * H, where, r), add_slots(out.dw3, w3, F * H, where, r);
    add_slots(out.dw2, w2, H * F, where, r);
  });
  return out;
}

[[maybe_unused]] std::vector<float> as_float(const std::vector<double>& v) {
  return {v.begin(), v.end()};
}

/// The layer's step against the reference's: y, dx, dgate, dW1, dW3, dW2 (6 checks).
template <class P>
int check_step(const layer_config& cfg, const typename P::router& router,
               const std::vector<std::int64_t>& tokens = {}, std::uint64_t seed = 11) {
  using X = typename P::expert;
  auto w = reference::full_weights::random(cfg, seed);
  for (float& v : w.gate) v *= 3.f;  // logits of a few units: scores spread, softmax peaked
  const auto g = test::make_tokens(std::vector<index_t>(cfg.ranks, 20), cfg.hidden, seed + 1);
  const std::vector<float> dy = reference::random_tokens(g.total() * cfg.hidden, 1, seed + 2);
  const step_result got = run_step<P>(cfg, w, g, dy, router, tokens);
  const index_t n = g.total(), H = cfg.hidden;
  std::vector<float> y(g.x.size(), nan_f);
  const placement::block where(cfg);
  const reference::pass_options opt{.token_ids = tokens};
  reference::forward<X>(w, router, typename P::capacity{}, where, {g.x.data(), n, H}, g.per_rank,
                        {y.data(), n, H}, opt);
  const reference::gradients want =
      reference::backward<X>(w, router, typename P::capacity{}, where, {g.x.data(), n, H},
                             g.per_rank, {dy.data(), n, H}, opt);
  int checked = 0;
  const auto check = [&](const char* name, const std::vector<float>& a, const std::vector<float>& b,
                         double tol) {
    const double e = test::relative_error(a, b);
    INFO(name << " error " << e);
    CHECK(e <= tol);
    ++checked;
  };
  check("y", got.y, y, 1e-5);
  check("dx", got.dx, as_float(want.dx), 2e-5);
  check("dgate", got.dgate, as_float(want.dgate), 2e-5);
  check("dw1", got.dw1, as_float(want.dw1), 2e-5);
  check("dw3", got.dw3, as_float(want.dw3), 2e-5);
  check("dw2", got.dw2, as_float(want.dw2), 2e-5);
  return checked;
}

/// Every exchange the family runs under: 1, 2, 4 ranks flat and dedup, 4 ranks on two nodes.
template <class Router, class Expert>
int check_family(const Router& r, int k, const std::vector<std::int64_t>& tokens = {}) {
  int checked = 0;
  for (int ranks : {1, 2, 4}) {
    INFO("ranks " << ranks);
    checked += check_step<scored_policies<Router, Expert>>(scored_layer(ranks, k), r, tokens);
    checked += check_step<scored_policies<Router, Expert, true>>(scored_layer(ranks, k), r, tokens);
  }
  layer_config two_nodes = scored_layer(4, k);
  two_nodes.ranks_per_node = 2;
  INFO("hierarchical");
  checked += check_step<scored_policies<Router, Expert, false, true>>(two_nodes, r, tokens);
  return checked;
}

std::vector<float> spread(int n, float scale, std::uint64_t seed) {
  std::mt19937_64 rng(seed);
  std::uniform_real_distribution<float> u(-scale, scale);
  std::vector<float> v(static_cast<std::size_t>(n));
  for (float& x : v) x = u(rng);
  return v;
}

/// A [vocab, K] table of distinct experts per row, and token ids for every rank's tokens.
struct token_table {
  std::vector<std::int32_t> ids;
  std::vector<std::int64_t> tokens;
};
token_table make_table(int vocab, int k, int experts, int tokens, std::uint64_t seed) {
  std::mt19937_64 rng(seed);
  token_table t;
  std::vector<std::int32_t> all(static_cast<std::size_t>(experts));
  for (int v = 0; v < vocab; ++v) {
    std::iota(all.begin(), all.end(), 0);
    std::shuffle(all.begin(), all.end(), rng);
    t.ids.insert(t.ids.end(), all.begin(), all.begin() + k);
  }
  std::uniform_int_distribution<std::int64_t> u(0, vocab - 1);
  for (int i = 0; i < tokens; ++i) t.tokens.push_back(u(rng));
  return t;
}

}  // namespace

TEMPLATE_LIST_TEST_CASE("scored routers on every space: the layer's forward against the reference",
                        "[layer][scored]", test::spaces) {
  using Space = TestType;
  const auto bias = spread(8, 0.3f, 12);
  const token_table t = make_table(40, 2, 8, 2 * 20, 13);
  int ran = 0;
  const auto check = [&]<class Router>(Router r, std::vector<std::int64_t> tokens = {}) {
    using P = test::router_policies<Space, Router>;
    layer_config cfg = scored_layer(2, Router::top_k);
    auto w = reference::full_weights::random(cfg, 21);
    for (float& v : w.gate) v *= 3.f;
    const auto g = test::make_tokens({20, 20}, cfg.hidden, 22);
    test::run_options<P> opt{.router = r, .token_ids = std::move(tokens)};
    if constexpr (router_with_bias<Router>)  // the harness loads its bias into the layer's
      if (r.bias) opt.bias.assign(r.bias, r.bias + cfg.experts), opt.router.bias = nullptr;
    const auto want = test::run_reference<P>(cfg, w, g, opt);
    const auto got = test::run_layer<P>(cfg, w, g, opt);
    CHECK(test::relative_error(got.y, want) <= test::tolerance<Space>(1e-5));
    ++ran;
  };
  router::deepseek_v4<2> v4{};
  v4.bias = bias.data(), v4.eps = 1e-20f, v4.scaling = 1.5f;
  check(v4);
  router::deepseek_v4_hash<2> hash{};
  hash.ids = t.ids.data(), hash.vocab = 40, hash.eps = 1e-20f;
  check(hash, t.tokens);
  router::ernie4_5<2> ernie{};
  ernie.bias = bias.data(), ernie.norm_min = 0.5f;
  check(ernie);
  router::kolibri<2> kolibri{};
  kolibri.bias = bias.data();
  check(kolibri);
  router::llama4<1> llama{};
  llama.normalize = false;
  check(llama);
  router::longcat_flash<2> longcat{};
  longcat.bias = bias.data(), longcat.normalize = false, longcat.scaling = 6.f;
  check(longcat);
  CHECK(ran == 6);
}

#ifndef EPMOE_TEST_SPACES_ONLY_GENERIC  // host ranks: forward and backward, every exchange
TEST_CASE("DeepSeek-V4 top-k: sqrtsoftplus scores, selection bias, eps, clamped experts",
          "[layer][backward][scored]") {
  const auto bias = spread(8, 0.3f, 5);
  router::deepseek_v4<2> r{};
  r.bias = bias.data();
  r.eps = 1e-20f;
  r.scaling = 1.5f;
  CHECK(check_family<router::deepseek_v4<2>, expert::deepseek_v4>(r, 2) == 7 * 6);
  router::deepseek_v4<4> r4{};
  r4.bias = bias.data(), r4.eps = 1e-20f, r4.scaling = 1.5f;
  CHECK(check_family<router::deepseek_v4<4>, expert::swiglu>(r4, 4) == 7 * 6);
}

TEST_CASE("DeepSeek-V4 hash layers: the table chooses, the gate's scores weigh",
          "[layer][backward][scored][table]") {
  const token_table t = make_table(50, 2, 8, 4 * 20, 7);
  router::deepseek_v4_hash<2> r{};
  r.ids = t.ids.data(), r.vocab = 50, r.eps = 1e-20f, r.scaling = 1.5f;
  CHECK(check_family<router::deepseek_v4_hash<2>, expert::deepseek_v4>(r, 2, t.tokens) == 7 * 6);
  const token_table t4 = make_table(30, 4, 8, 4 * 20, 8);
  router::deepseek_v4_hash<4> r4{};
  r4.ids = t4.ids.data(), r4.vocab = 30, r4.normalize = false;
  CHECK(check_family<router::deepseek_v4_hash<4>, expert::swiglu>(r4, 4, t4.tokens) == 7 * 6);
}

TEST_CASE("ERNIE 4.5 MoE: softmax, selection bias, the sum clamped at norm_min",
          "[layer][backward][scored]") {
  const auto bias = spread(8, 0.05f, 6);
  router::ernie4_5<2> r{};
  r.bias = bias.data();
  r.norm_min = 1e-12f;
  CHECK(check_family<router::ernie4_5<2>, expert::swiglu>(r, 2) == 7 * 6);
  r.norm_min = 0.9f;  // binds for most tokens: the weights' coupling is cut there
  CHECK(check_step<scored_policies<router::ernie4_5<2>, expert::swiglu>>(scored_layer(2, 2), r) ==
        6);
}

TEST_CASE("LFM2-MoE: sigmoid, expert bias, renormalised with eps 1e-6, scaling",
          "[layer][backward][scored]") {
  const auto bias = spread(8, 0.3f, 7);
  router::lfm2_moe<4> r{};
  r.bias = bias.data(), r.eps = 1e-6f, r.scaling = 2.f;
  CHECK(check_family<router::lfm2_moe<4>, expert::swiglu>(r, 4) == 7 * 6);
}

TEST_CASE("Kolibri: top-k of logits + bias, sigmoid weights", "[layer][backward][scored]") {
  const auto bias = spread(8, 1.f, 8);
  router::kolibri<2> r{};
  r.bias = bias.data(), r.normalize = false;
  CHECK(check_family<router::kolibri<2>, expert::swiglu>(r, 2) == 7 * 6);
  r.normalize = true;  // norm_topk_prob
  CHECK(check_step<scored_policies<router::kolibri<2>, expert::swiglu>>(scored_layer(2, 2), r) ==
        6);
}

TEST_CASE("Llama 4 router: top-k of logits, weights sigmoid, no renormalisation",
          "[layer][backward][scored]") {
  router::llama4<1> r{};
  r.normalize = false;
  CHECK(check_family<router::llama4<1>, expert::swiglu>(r, 1) == 7 * 6);
}

TEST_CASE("LongCat-Flash router: softmax, correction bias, scaled, not renormalised",
          "[layer][backward][scored]") {
  const auto bias = spread(8, 0.05f, 9);
  router::longcat_flash<2> r{};
  r.bias = bias.data(), r.normalize = false, r.scaling = 6.f;
  CHECK(check_family<router::longcat_flash<2>, expert::swiglu>(r, 2) == 7 * 6);
}

TEST_CASE("table router in the layer: its own copy, checked entries and token ids",
          "[layer][scored][table][errors]") {
  using P = scored_policies<router::deepseek_v4_hash<2>, expert::swiglu>;
  const layer_config cfg = scored_layer(2, 2);
  const auto w = reference::full_weights::random(cfg, 3);
  token_table t = make_table(10, 2, 8, 2 * 20, 4);
  const std::vector<std::int32_t> original = t.ids;
  const auto g = test::make_tokens({20, 20}, cfg.hidden, 5);
  std::vector<float> want(g.x.size());
  router::deepseek_v4_hash<2> r{};
  r.ids = t.ids.data(), r.vocab = 10;
  reference::forward(w, r, capacity::dropless{}, {g.x.data(), 40, cfg.hidden}, g.per_rank,
                     {want.data(), 40, cfg.hidden}, {.token_ids = t.tokens});
  std::vector<float> got(g.x.size(), nan_f);
  std::vector<std::int32_t> bad = original;
  bad[7] = bad[6];  // row 3: a repeated expert
  int checked = 0;
  std::mutex m;
  std::barrier sync(2);
  comm::threads_world world(2);
  world.run([&](comm::threads c) {
    const int rank = c.rank();
    const placement::block where(cfg);
    const reference::rank_weights mine = reference::slice(w, where, rank);
    typename moe_layer<P>::weights wv{};
    wv.gate = w.gate_view();
    wv.experts = reference::views_of<expert::swiglu>::of(mine);
    moe_layer<P> layer(cfg, c, wv, r, {}, where);
    sync.arrive_and_wait();                                    // both layers made their copies
    if (rank == 0) std::fill(t.ids.begin(), t.ids.end(), 99);  // the caller's table goes bad
    sync.arrive_and_wait();
    const index_t T = 20, at = rank * T * cfg.hidden;
    std::vector<float> y(T * cfg.hidden, nan_f);
    const std::span<const std::int64_t> ids(t.tokens.data() + rank * T, T);
    layer.forward({g.x.data() + at, T, cfg.hidden}, {y.data(), T, cfg.hidden}, ids);
    // A token id past the table: named on its rank, refused on the peer; y untouched.
    std::vector<std::int64_t> past(ids.begin(), ids.end());
    if (rank == 1) past[5] = 10;
    std::vector<float> y2(T * cfg.hidden, nan_f);
    const auto call = [&] {
      layer.forward({g.x.data() + at, T, cfg.hidden}, {y2.data(), T, cfg.hidden}, past);
    };
    if (rank == 1)
      CHECK_THROWS_WITH(
          call(), Catch::Contains("token_ids[5]") && Catch::Contains("[0, router.vocab = 10)"));
    else
      CHECK_THROWS_AS(call(), input_error);
    // A table pointed at later is checked at the next pass, before anything is written.
    layer.router().ids = bad.data();
    CHECK_THROWS_WITH(
        layer.forward({g.x.data() + at, T, cfg.hidden}, {y2.data(), T, cfg.hidden}, ids),
        Catch::Contains("router.ids[3][1]") && Catch::Contains("distinct"));
    bool untouched = true;
    for (float v : y2) untouched = untouched && std::isnan(v);
    std::lock_guard lock(m);
    CHECK(untouched);
    std::copy(y.begin(), y.end(), got.begin() + at);
    checked += 3;
  });
  CHECK(test::relative_error(got, want) <= 1e-5);
  CHECK(checked == 6);
  // A bad table at construction: named before the layer exists.
  world.run([&](comm::threads c) {
    const placement::block where(cfg);
    const reference::rank_weights mine = reference::slice(w, where, c.rank());
    typename moe_layer<P>::weights wv{};
    wv.gate = w.gate_view();
    wv.experts = reference::views_of<expert::swiglu>::of(mine);
    router::deepseek_v4_hash<2> b = r;
    b.ids = bad.data();
    CHECK_THROWS_WITH((moe_layer<P>(cfg, c, wv, b, {}, where)),
                      Catch::Contains("router.ids[3][1]"));
    b.ids = original.data();
    b.vocab = 0;
    CHECK_THROWS_WITH((moe_layer<P>(cfg, c, wv, b, {}, where)), Catch::Contains("router.vocab"));
  });
}
#endif  // EPMOE_TEST_SPACES_ONLY_GENERIC

}  // namespace layer_scored_tests
