// SPDX-FileCopyrightText: 2026 The epmoe authors
// SPDX-License-Identifier: Apache-2.0
// The routing weight scales the expert's input (weighting::input; Llama 4's `Llama4TextMoe`:
// y = Σ_k E_k(s_k x) + shared(x), s_k = σ(the chosen logit)): the layer's forward and backward
// (dx, the gate, the routed and shared experts; NaN before the call) against the float64 block
// written from transformers' code (reference/scaled_input.hpp), on 1, 2 and 4 in-process ranks,
// dropless and padded; and that it is not the output-weighted layer.
#include <catch2/catch.hpp>
#include <cmath>
#include <limits>
#include <mutex>
#include <vector>

#include "harness.hpp"
#include <epmoe/reference/scaled_input.hpp>
#include <epmoe/router/biased.hpp>

using namespace epmoe;

namespace {

constexpr float nan_f = std::numeric_limits<float>::quiet_NaN();

/// Llama 4's router: top-K of the logits, weights σ(logit), not renormalised, no bias.
template <int K>
struct llama4_like : router::llama4<K> {
  llama4_like() { this->normalize = false; }
};

template <int K, class Capacity = capacity::dropless, class Weighting = weighting::input>
struct llama4_policies : default_policies {
  using comm = epmoe::comm::threads;
  using router = llama4_like<K>;
  using capacity = Capacity;
  using weighting = Weighting;
};

layer_config llama4_layer(int ranks, int top_k) {
  return {.hidden = 12,
          .ffn = 10,
          .experts = 8,
          .top_k = top_k,
          .ranks = ranks,
          .max_tokens = 24,
          .capacity_factor = 8.0 / top_k,  // padded: room for every token, nothing dropped
          .shared_experts = 1};
}

struct step_result {
  std::vector<float> y, dx, dgate, dw1, dw3, dw2, dsw1, dsw3, dsw2;
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

template <class P>
step_result run_step(layer_config cfg, const reference::full_weights& w,
                     const test::global_tokens& g, const std::vector<float>& dy) {
  cfg.training = true;
  const index_t H = cfg.hidden, E = cfg.experts, F = cfg.ffn, N = cfg.shared_experts;
  step_result out;
  out.y.assign(g.x.size(), nan_f);
  out.dx.assign(g.x.size(), nan_f);
  out.dgate.assign(E * H, 0.f);
  for (auto* v : {&out.dw1, &out.dw3, &out.dw2}) v->assign(E * F * H, nan_f);
  for (auto* v : {&out.dsw1, &out.dsw3, &out.dsw2}) v->assign(N * F * H, 0.f);
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
    moe_layer<P> layer(cfg, c, wv, typename P::router{}, {}, where);
    const index_t T = g.per_rank[r], at = g.offset(r) * H;
    std::vector<float> x(g.x.begin() + at, g.x.begin() + at + T * H);
    std::vector<float> d(dy.begin() + at, dy.begin() + at + T * H);
    std::vector<float> y(T * H, nan_f), dx(T * H, nan_f);
    const auto n = [](index_t k) { return std::vector<float>(k, nan_f); };
    std::vector<float> gate = n(E * H), w1 = n(L * F * H), w3 = n(L * F * H), w2 = n(L * H * F),
                       s1 = n(N * F * H), s3 = n(N * F * H), s2 = n(N * H * F);
    typename moe_layer<P>::gradients gv{};
    gv.gate = {gate.data(), E, H};
    gv.experts = {{w1.data(), L, F, H}, {w3.data(), L, F, H}, {w2.data(), L, H, F}};
    gv.shared = {{s1.data(), N, F, H}, {s3.data(), N, F, H}, {s2.data(), N, H, F}};
    layer.forward({x.data(), T, H}, {y.data(), T, H});
    layer.backward({d.data(), T, H}, {dx.data(), T, H}, gv);
    std::lock_guard lock(m);
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

/// Weights whose expert inputs sit where SwiGLU is far from homogeneous (|W x| ~ 3): E(s x)
/// and s E(x) differ clearly.
reference::full_weights llama4_weights(const layer_config& cfg, std::uint64_t seed) {
  auto w = reference::full_weights::random(cfg, seed);
  for (auto* v : {&w.w1, &w.w3, &w.shared_w1, &w.shared_w3})
    for (float& x : *v) x *= 4.f;
  return w;
}

template <class P>
int check_step(const layer_config& cfg, std::uint64_t seed) {
  const auto w = llama4_weights(cfg, seed);
  const auto g = test::make_tokens(std::vector<index_t>(cfg.ranks, 20), cfg.hidden, seed + 1);
  const std::vector<float> dy = reference::random_tokens(g.total() * cfg.hidden, 1, seed + 2);
  const step_result got = run_step<P>(cfg, w, g, dy);
  const index_t n = g.total(), H = cfg.hidden;
  const reference::llama4_result want =
      reference::llama4_block(w, cfg.top_k, {g.x.data(), n, H}, {dy.data(), n, H});
  int checked = 0;
  const auto check = [&](const char* name, const std::vector<float>& a, const std::vector<float>& b,
                         double tol) {
    const double e = test::relative_error(a, b);
    INFO(name << " error " << e);
    CHECK(e <= tol);
    ++checked;
  };
  check("y", got.y, as_float(want.y), 1e-5);
  check("dx", got.dx, as_float(want.g.dx), 2e-5);
  check("dgate", got.dgate, as_float(want.g.dgate), 2e-5);
  check("dw1", got.dw1, as_float(want.g.dw1), 2e-5);
  check("dw3", got.dw3, as_float(want.g.dw3), 2e-5);
  check("dw2", got.dw2, as_float(want.g.dw2), 2e-5);
  check("dshared_w1", got.dsw1, as_float(want.g.dshared_w1), 2e-5);
  check("dshared_w3", got.dsw3, as_float(want.g.dshared_w3), 2e-5);
  check("dshared_w2", got.dsw2, as_float(want.g.dshared_w2), 2e-5);
  return checked;
}

}  // namespace

TEST_CASE("Llama 4: the score scales the expert's input, forward and backward",
          "[layer][backward][llama4]") {
  int checked = 0;
  for (int ranks : {1, 2, 4}) {
    INFO("ranks " << ranks);
    checked += check_step<llama4_policies<1>>(llama4_layer(ranks, 1), 31);
    checked += check_step<llama4_policies<2>>(llama4_layer(ranks, 2), 41);
    checked += check_step<llama4_policies<2, capacity::factor<true>>>(llama4_layer(ranks, 2), 51);
  }
  CHECK(checked == 3 * 3 * 9);
}

TEST_CASE("Llama 4: weighting the input is not weighting the output", "[layer][llama4]") {
  const layer_config cfg = llama4_layer(2, 2);
  const auto w = llama4_weights(cfg, 61);
  const auto g = test::make_tokens({20, 20}, cfg.hidden, 62);
  const std::vector<float> dy = reference::random_tokens(g.total() * cfg.hidden, 1, 63);
  const step_result in = run_step<llama4_policies<2>>(cfg, w, g, dy);
  const step_result out =
      run_step<llama4_policies<2, capacity::dropless, weighting::output>>(cfg, w, g, dy);
  CHECK(test::relative_error(in.y, out.y) > 1e-2);
  CHECK(test::relative_error(in.dgate, out.dgate) > 1e-2);
}
