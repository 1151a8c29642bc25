// SPDX-FileCopyrightText: 2026 The epmoe authors
// SPDX-License-Identifier: Apache-2.0
// GPT-OSS's block (router::gpt_oss: a bias on the logits, softmax over the top K; the
// clamped-SwiGLU expert with biases) and DeepSeek-V4's clamped expert: the layer's forward and
// backward (dx and every gradient, NaN before the call) against the float64 reference on 1, 2
// and 4 in-process ranks, per assignment, with dedup and hierarchical; weights large enough
// that both clamps bind on both sides, so the clamps' zero gradient is exercised.
#include <catch2/catch.hpp>
#include <cmath>
#include <limits>
#include <mutex>
#include <span>
#include <vector>

#include "harness.hpp"
#include <epmoe/expert/clamped_glu.hpp>
#include <epmoe/reference/backward.hpp>
#include <epmoe/router/logit_bias.hpp>

using namespace epmoe;

namespace {

constexpr float nan_f = std::numeric_limits<float>::quiet_NaN();

template <class Router, class Expert, bool Dedup = false, bool Hierarchical = false>
struct gpt_policies : default_policies {
  using space = epmoe::space::host;
  using comm = epmoe::comm::threads;
  using router = Router;
  using expert = Expert;
  static constexpr layer_options options{.dedup = Dedup, .hierarchical = Hierarchical};
};

layer_config gpt_layer(int ranks, int top_k) {
  return {.hidden = 12, .ffn = 10, .experts = 8, .top_k = top_k, .ranks = ranks, .max_tokens = 24};
}

/// Weights whose gate and up projections reach past `limit` on both sides for many rows.
reference::full_weights clamp_weights(const layer_config& cfg, float limit, std::uint64_t seed) {
  auto w = reference::full_weights::random(cfg, seed);
  const float s = 2.5f * limit;  // |W x| ~ |x| ~ 0.6 before: a few times the limit after
  for (auto* v : {&w.w1, &w.w3, &w.b1, &w.b3})
    for (float& x : *v) x *= s;
  return w;
}

/// How many (token, expert, f) hidden values fall outside each clamp bound: [a > limit,
/// b < -limit, b > limit, a <= limit].
template <class Form>
std::array<int, 4> clamp_hits(const reference::full_weights& w, const std::vector<float>& x) {
  const index_t H = w.cfg.hidden, F = w.cfg.ffn, E = w.cfg.experts;
  std::array<int, 4> n{};
  for (std::size_t t = 0; t < x.size() / H; ++t)
    for (index_t e = 0; e < E; ++e)
      for (index_t f = 0; f < F; ++f) {
        double a = Form::biases ? w.b1[e * F + f] : 0.0, b = Form::biases ? w.b3[e * F + f] : 0.0;
        for (index_t i = 0; i < H; ++i) {
          a += double{w.w1[(e * F + f) * H + i]} * x[t * H + i];
          b += double{w.w3[(e * F + f) * H + i]} * x[t * H + i];
        }
        n[0] += a > Form::limit, n[1] += b<-Form::limit, n[2] += b> Form::limit;
        n[3] += a <= Form::limit;
      }
  return n;
}

struct step_result {
  std::vector<float> y, dx, dgate, dgate_bias, dw1, dw3, dw2, db1, db3, db2;
};

// Sums a per-slot tensor of one rank into its logical experts' rows (`per` elements each).
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

/// Forward and backward on cfg.ranks in-process ranks; gradients summed over the ranks (the
/// gate's) and slots (each expert's), as a training loop would.
template <class P>
step_result run_step(layer_config cfg, const reference::full_weights& w,
                     const test::global_tokens& g, const std::vector<float>& dy) {
  using X = typename P::expert;
  cfg.training = true;
  const index_t H = cfg.hidden, E = cfg.experts, F = cfg.ffn;
  step_result out;
  out.y.assign(g.x.size(), nan_f);
  out.dx.assign(g.x.size(), nan_f);
  out.dgate.assign(E * H, 0.f);
  out.dgate_bias.assign(E, 0.f);
  for (auto* v : {&out.dw1, &out.dw3, &out.dw2}) v->assign(E * F * H, nan_f);
  for (auto* v : {&out.db1, &out.db3}) v->assign(E * F, nan_f);
  out.db2.assign(E * H, nan_f);
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
    wv.gate_bias = {w.gate_bias.data(), 1, E};
    moe_layer<P> layer(cfg, c, wv, typename P::router{}, typename P::capacity{}, where);
    const index_t T = g.per_rank[r], at = g.offset(r) * H;
    std::vector<float> x(g.x.begin() + at, g.x.begin() + at + T * H);
    std::vector<float> d(dy.begin() + at, dy.begin() + at + T * H);
    std::vector<float> y(T * H, nan_f), dx(T * H, nan_f);
    const auto n = [](index_t k) { return std::vector<float>(k, nan_f); };
    std::vector<float> gate = n(E * H), gb = n(E), w1 = n(L * F * H), w3 = n(L * F * H),
                       w2 = n(L * H * F), b1 = n(L * F), b3 = n(L * F), b2 = n(L * H);
    typename moe_layer<P>::gradients gv{};
    gv.gate = {gate.data(), E, H};
    gv.gate_bias = {gb.data(), 1, E};
    gv.experts.w1 = {w1.data(), L, F, H}, gv.experts.w3 = {w3.data(), L, F, H};
    gv.experts.w2 = {w2.data(), L, H, F};
    if constexpr (X::biases)
      gv.experts.b1 = {b1.data(), L, 1, F}, gv.experts.b3 = {b3.data(), L, 1, F},
      gv.experts.b2 = {b2.data(), L, 1, H};
    layer.forward({x.data(), T, H}, {y.data(), T, H});
    layer.backward({d.data(), T, H}, {dx.data(), T, H}, gv);
    std::lock_guard lock(m);
    std::copy(y.begin(), y.end(), out.y.begin() + at);
    std::copy(dx.begin(), dx.end(), out.dx.begin() + at);
    for (std::size_t i = 0; i < gate.size(); ++i) out.dgate[i] += gate[i];
    for (std::size_t i = 0; i < gb.size(); ++i) out.dgate_bias[i] += gb[i];
    add_slots(out.dw1, w1, F * H, where, r), add_slots(out.dw3, w3, F * H, where, r);
    add_slots(out.dw2, w2, H * F, where, r);
    if constexpr (X::biases)
      add_slots(out.db1, b1, F, where, r), add_slots(out.db3, b3, F, where, r),
          add_slots(out.db2, b2, H, where, r);
  });
  return out;
}

std::vector<float> as_float(const std::vector<double>& v) { return {v.begin(), v.end()}; }

/// The layer's step against the reference's: y, dx and every gradient the bundle has.
template <class P>
int check_step(const layer_config& cfg, float limit, std::uint64_t seed = 11) {
  using X = typename P::expert;
  const auto w = clamp_weights(cfg, limit, seed);
  const auto g = test::make_tokens(std::vector<index_t>(cfg.ranks, 20), cfg.hidden, seed + 1);
  const std::vector<float> dy = reference::random_tokens(g.total() * cfg.hidden, 1, seed + 2);
  const auto hits = clamp_hits<typename X::form>(w, g.x);
  INFO("clamped: a > limit " << hits[0] << ", b < -limit " << hits[1] << ", b > limit " << hits[2]
                             << ", a inside " << hits[3]);
  for (int h : hits) CHECK(h > 20);  // every side of both clamps binds, and some rows pass
  const step_result got = run_step<P>(cfg, w, g, dy);
  const index_t n = g.total(), H = cfg.hidden;
  std::vector<float> y(g.x.size(), nan_f);
  const placement::block where(cfg);
  reference::forward<X>(w, typename P::router{}, typename P::capacity{}, where, {g.x.data(), n, H},
                        g.per_rank, {y.data(), n, H});
  const reference::gradients want =
      reference::backward<X>(w, typename P::router{}, typename P::capacity{}, where,
                             {g.x.data(), n, H}, g.per_rank, {dy.data(), n, H});
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
  if constexpr (router_with_gate_bias<typename P::router>)
    check("dgate_bias", got.dgate_bias, as_float(want.dgate_bias), 2e-5);
  if constexpr (X::biases) {
    check("db1", got.db1, as_float(want.db1), 2e-5);
    check("db3", got.db3, as_float(want.db3), 2e-5);
    check("db2", got.db2, as_float(want.db2), 2e-5);
  }
  return checked;
}

}  // namespace

TEST_CASE("clamped gate: values and gradients at, inside and past the bounds", "[expert]") {
  using G = expert::clamped_gate<expert::gpt_oss_clamp>;
  const auto sig = [](double v) { return 1.0 / (1.0 + std::exp(-v)); };
  int n = 0;
  for (float a : {-9.f, -1.f, 0.5f, 7.f, 7.5f, 20.f})
    for (float b : {-8.f, -7.f, -0.3f, 2.f, 7.f, 9.f}) {
      const double g = std::min(double{a}, 7.0), u = std::clamp(double{b}, -7.0, 7.0);
      CHECK(G::apply(a, b) == Approx(g * sig(1.702 * g) * (u + 1)).epsilon(1e-5));
      float da, db;
      G::grad(a, b, 1.f, da, db);
      const double s = sig(1.702 * g);
      CHECK(da == Approx(a <= 7.f ? (u + 1) * (s + 1.702 * g * s * (1 - s)) : 0.0).margin(1e-6));
      CHECK(db == Approx(std::abs(b) <= 7.f ? g * s : 0.0).margin(1e-6));
      ++n;
    }
  CHECK(n == 36);
}

TEST_CASE("GPT-OSS layer: router logit bias and clamped SwiGLU, forward and backward",
          "[layer][backward][gpt_oss]") {
  int checked = 0;
  for (int ranks : {1, 2, 4}) {
    INFO("ranks " << ranks);
    checked +=
        check_step<gpt_policies<router::gpt_oss<4>, expert::gpt_oss>>(gpt_layer(ranks, 4), 7.f);
    checked += check_step<gpt_policies<router::gpt_oss<2>, expert::gpt_oss, true>>(
        gpt_layer(ranks, 2), 7.f);
  }
  layer_config two_nodes = gpt_layer(4, 4);
  two_nodes.ranks_per_node = 2;
  checked +=
      check_step<gpt_policies<router::gpt_oss<4>, expert::gpt_oss, false, true>>(two_nodes, 7.f);
  CHECK(checked == 7 * 10);
}

TEST_CASE("DeepSeek-V4's clamp: the same expert with alpha 1, no +1, no biases",
          "[layer][backward][gpt_oss]") {
  static_assert(!expert::deepseek_v4::biases && expert::deepseek_v4_clamp::up_shift == 0.f);
  int checked = 0;
  for (int ranks : {1, 2, 4}) {
    INFO("ranks " << ranks);
    checked += check_step<gpt_policies<router::topk_softmax<2>, expert::deepseek_v4>>(
        gpt_layer(ranks, 2), 10.f);
  }
  checked += check_step<gpt_policies<router::topk_softmax<2>, expert::deepseek_v4, true>>(
      gpt_layer(2, 2), 10.f);
  CHECK(checked == 4 * 6);
}

TEST_CASE("GPT-OSS layer: a missing logit bias is named", "[layer][gpt_oss]") {
  using P = gpt_policies<router::gpt_oss<2>, expert::gpt_oss>;
  const layer_config cfg = gpt_layer(1, 2);
  const auto w = reference::full_weights::random(cfg, 3);
  const placement::block where(cfg);
  const reference::rank_weights mine = reference::slice(w, where, 0);
  typename moe_layer<P>::weights wv{};
  wv.gate = w.gate_view();
  wv.experts = reference::views_of<expert::gpt_oss>::of(mine);
  comm::threads_world world(1);
  world.run([&](comm::threads c) {
    CHECK_THROWS_WITH((moe_layer<P>(cfg, c, wv)), Catch::Contains("weights.gate_bias"));
    wv.gate_bias = {w.gate_bias.data(), 1, cfg.experts};
    wv.experts.b3 = {};
    CHECK_THROWS_WITH((moe_layer<P>(cfg, c, wv)), Catch::Contains("weights.experts.b3"));
  });
}
