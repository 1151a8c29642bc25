// SPDX-FileCopyrightText: 2026 The epmoe authors
// SPDX-License-Identifier: Apache-2.0
#include <catch2/catch.hpp>
#include <cmath>
#include <cstdint>
#include <limits>
#include <vector>

#include <epmoe/reference/forward.hpp>

// The reference checked on its own: each formula against small cases worked out by hand
// (the expected values are written here, computed from the definitions, not by the library).
using namespace epmoe;

namespace {

constexpr double tol = 1e-12;

// Weights whose gate (and noise gate) is the identity: a token's logits are its own
// values, so a case states its logits directly. H = E.
reference::full_weights identity_gate(int experts, int top_k, double capacity_factor = 1.0) {
  const layer_config cfg{.hidden = experts,
                         .ffn = 2,
                         .experts = experts,
                         .top_k = top_k,
                         .ranks = 1,
                         .max_tokens = 16,
                         .capacity_factor = capacity_factor};
  auto w = reference::full_weights::random(cfg, 1);
  for (int e = 0; e < experts; ++e)
    for (int h = 0; h < experts; ++h)
      w.gate[e * experts + h] = w.noise_gate[e * experts + h] = e == h ? 1.f : 0.f;
  return w;
}

// The reference routing of one rank whose tokens' logits are `logits` [T, E].
template <class Router>
reference::rank_routing route_one(const reference::full_weights& w, const Router& router,
                                  const std::vector<float>& logits,
                                  const reference::pass_options& opt = {}) {
  const index_t E = w.cfg.experts, T = static_cast<index_t>(logits.size()) / E;
  const std::vector<index_t> tokens{T};
  return reference::route_ranks(w, router, {logits.data(), T, E}, tokens, opt).at(0);
}

// Token t's (ids, weights) as written by the reference.
void check_token(reference::rank_routing& r, index_t t, const std::vector<int>& ids,
                 const std::vector<double>& weights) {
  REQUIRE(r.width == static_cast<index_t>(ids.size()));
  for (index_t k = 0; k < r.width; ++k) {
    CAPTURE(t, k);
    CHECK(r.id(t, k) == ids[k]);
    CHECK(r.weight(t, k) == Approx(weights[k]).epsilon(tol));
  }
}

}  // namespace

// The formulas are the reference's own: every library router, capacity and placement
// resolves to an overload in reference/, never to the policy's code.
static_assert(reference::library_router<router::mixtral<2>> &&
              reference::library_router<router::jitter<router::switch_top1>>);
static_assert(reference::library_capacity<capacity::factor<true>> &&
              reference::library_placement<placement::table>);
template <class R>
constexpr bool has_formula = requires(const R& r, const reference::rank_batch& b) {
  reference::routing_of(r, b);
};
static_assert(has_formula<router::topk_softmax<2, false>> && has_formula<router::sigmoid_bias<4>> &&
              has_formula<router::expert_choice> && has_formula<router::hash<2>> &&
              has_formula<router::noisy_topk<2>> && has_formula<router::sinkhorn<1>> &&
              has_formula<router::jitter<router::noisy_topk<2>>>);

TEST_CASE("reference: seeded draws follow SplitMix64", "[reference]") {
  // SplitMix64's first output from state 0 (Vigna's splitmix64.c).
  CHECK(reference::draws::splitmix64(0) == 0xe220a8397b1dcdafull);
  CHECK(reference::draws::bits(1, 2, 3, 4) == 0xd55ccd4aeb3ccafbull);
  CHECK(reference::draws::uniform(0) == 0.5 / 16777216.0);
  CHECK(reference::draws::uniform(~std::uint64_t{0}) == (16777215.5 / 16777216.0));
}

TEST_CASE("reference: softmax top-k, renormalised or not", "[reference][routers]") {
  const auto w = identity_gate(4, 2);
  const std::vector<float> l = {1, 3, 2, 0,   // experts 1 and 2 best
                                2, 2, 1, 2};  // a three-way tie: the lower ids win
  auto mix = route_one(w, router::mixtral<2>{}, l);
  check_token(mix, 0, {1, 2}, {0.7310585786300048, 0.2689414213699951});  // e^3, e^2 / sum
  check_token(mix, 1, {0, 1}, {0.5, 0.5});
  auto qwen = route_one(w, router::qwen<2, false>{}, l);  // p = e^l / sum over all four
  check_token(qwen, 0, {1, 2}, {0.6439142598879724, 0.23688281808991016});
  auto sw = route_one(identity_gate(4, 1), router::switch_top1{}, l);
  check_token(sw, 0, {1}, {0.6439142598879724});
  check_token(sw, 1, {0}, {0.2969227424756547});  // e^2 / (3 e^2 + e)
  // The order of p where p underflows (e^-800 = 0 in double) or is NaN (a +inf logit): it
  // is the logits' order, as the limit of softmax has it. Capacity sees these choices.
  auto far = route_one(w, router::mixtral<2>{}, {-1000, -900, 0, -800});
  check_token(far, 0, {2, 3}, {1, 0});
  const float inf = std::numeric_limits<float>::infinity();
  // Through the identity gate the other logits are 0 * inf = NaN: they rank below every
  // number, ties to the lower id.
  auto top = route_one(w, router::mixtral<2>{}, {0, inf, 1, 2});
  CHECK(top.id(0, 0) == 1);
  CHECK(top.id(0, 1) == 0);
}

TEST_CASE("reference: group-limited softmax keeps the best groups", "[reference][routers]") {
  // Groups {0, 1} and {2, 3}: e^3 + e^-5 = 20.09 < 2 e^2.5 = 24.36, so group 1 is kept and
  // the single best expert 0 is not chosen.
  const auto w = identity_gate(4, 2);
  const std::vector<float> l = {3, -5, 2.5f, 2.5f};
  auto r = route_one(w, router::topk_softmax<2>{.groups = 2, .top_groups = 1}, l);
  check_token(r, 0, {2, 3}, {0.5, 0.5});
  auto raw = route_one(w, router::topk_softmax<2, false>{.groups = 2, .top_groups = 1}, l);
  check_token(raw, 0, {2, 3}, {0.2740270811950894, 0.2740270811950894});
  // Probabilities add, logits do not: e^3 + e^-5 = 20.09 > e^2.9 + 1 = 19.17 keeps group 0,
  // although its logits sum to -2 < 2.9.
  auto p_sum =
      route_one(w, router::topk_softmax<2>{.groups = 2, .top_groups = 1}, {3, -5, 2.9f, 0});
  check_token(p_sum, 0, {0, 1}, {0.9996646498695335, 0.0003353501304664781});
  auto all = route_one(w, router::topk_softmax<2>{.groups = 2, .top_groups = 2}, l);
  CHECK(all.id(0, 0) == 0);
}

TEST_CASE("reference: DeepSeek-V3 sigmoid routing with bias, groups and scaling",
          "[reference][routers]") {
  const auto w = identity_gate(4, 2);
  const std::vector<float> l = {0, 1, -1, 2};  // s = .5, .731, .269, .881
  const std::vector<float> bias = {0.5f, 0, 0, -1};
  // Without bias: the two best s, weights 2.5 s / (s_3 + s_1).
  auto plain = route_one(w, router::sigmoid_bias<2>{.scaling = 2.5f}, l);
  check_token(plain, 0, {3, 1}, {1.3661227579017519, 1.1338772420982481});
  // With bias: s + b = 1, .731, .269, -.119; group {0, 1} scores 1.731, {2, 3} .150.
  router::sigmoid_bias<2> r{.groups = 2, .top_groups = 1, .scaling = 2.5f};
  r.bias = bias.data();
  auto biased = route_one(w, r, l);
  check_token(biased, 0, {0, 1}, {1.0153862876217266, 1.4846137123782737});
  r.normalize = false;  // scaling * s: the bias never enters the weights
  auto raw = route_one(w, r, l);
  check_token(raw, 0, {0, 1}, {1.25, 1.8276464465750122});
}

TEST_CASE("reference: expert choice gives each expert its C best tokens", "[reference][routers]") {
  // E = 2, top_k 1, cf 1, T = 4: C = ceil(4 / 2) = 2. S[t, 0] = sigmoid(l0 - l1).
  const auto w = identity_gate(2, 1);
  auto r = route_one(w, router::expert_choice{}, {1, 0, 0, 1, 2, 0, 0, 0});
  const int none = no_expert;
  check_token(r, 0, {0, none}, {0.7310585786300049, 0});
  check_token(r, 1, {none, 1}, {0, 0.7310585786300049});
  check_token(r, 2, {0, none}, {0.8807970779778823, 0});
  check_token(r, 3, {none, 1}, {0, 0.5});
  // Ties go to the lower token: three equal tokens, C = 2.
  auto tie = route_one(w, router::expert_choice{}, {0, 0, 0, 0, 0, 0});
  check_token(tie, 0, {0, 1}, {0.5, 0.5});
  check_token(tie, 1, {0, 1}, {0.5, 0.5});
  check_token(tie, 2, {none, none}, {0, 0});
}

TEST_CASE("reference: hash routing, collisions move to the next expert", "[reference][routers]") {
  const auto w = identity_gate(8, 2);
  const std::vector<std::int64_t> ids = {5, 42, 31};
  auto r = route_one(w, router::hash<2>{.seed = 7}, std::vector<float>(3 * 8, 0.f), {ids, 0});
  check_token(r, 0, {6, 0}, {0.5, 0.5});
  check_token(r, 1, {1, 6}, {0.5, 0.5});
  check_token(r, 2, {1, 2}, {0.5, 0.5});  // both hashes of token 31 give expert 1
}

TEST_CASE("reference: noisy top-k draws its seeded noise", "[reference][routers]") {
  // Token id 11, pass 2, seed 3: z = 2.588, .949, .428, -1.487; the noise gate is the
  // identity too, so H_e = l_e + z_e softplus(l_e) = 1.794, .658, 1.563, -.953.
  const auto w = identity_gate(4, 2);
  const std::vector<float> l = {0, 0, 1, 1};
  const std::vector<std::int64_t> ids = {11};
  auto noisy = route_one(w, router::noisy_topk<2>{.training = true, .seed = 3}, l, {ids, 2});
  check_token(noisy, 0, {0, 2}, {0.5575263058990885, 0.4424736941009116});
  auto eval = route_one(w, router::noisy_topk<2>{.training = false, .seed = 3}, l, {ids, 2});
  check_token(eval, 0, {2, 3}, {0.5, 0.5});
  auto other = route_one(w, router::noisy_topk<2>{.training = true, .seed = 3}, l, {ids, 3});
  CHECK(other.weight(0, 0) != Approx(0.5575263058990885).epsilon(1e-6));  // another pass
}

TEST_CASE("reference: Switch jitter scales the gate input", "[reference][routers]") {
  // Token id 4, pass 1, seed 5, eps 0.5: factors .5 + u = 1.228, 1.288, .688, 1.246; all
  // four logits 1 become the factors, and expert 1 wins.
  const auto w = identity_gate(4, 1);
  const std::vector<float> l = {1, 1, 1, 1};
  const std::vector<std::int64_t> ids = {4};
  router::jitter<router::switch_top1> j{};
  j.eps = 0.5f;
  j.seed = 5;
  j.training = true;
  auto r = route_one(w, j, l, {ids, 1});
  check_token(r, 0, {1}, {0.29001715942323736});
  j.training = false;
  auto eval = route_one(w, j, l, {ids, 1});
  check_token(eval, 0, {0}, {0.25});
}

TEST_CASE("reference: Sinkhorn balances the experts before choosing", "[reference][routers]") {
  // Both tokens prefer expert 0; balanced, token 1 takes expert 1.
  const std::vector<float> l = {2, 0, 1, 0};
  auto one = route_one(identity_gate(2, 1), router::sinkhorn<1>{}, l);
  check_token(one, 0, {0}, {0.8807970779778823});  // sigmoid(2)
  check_token(one, 1, {1}, {0.5});                 // sigmoid(0)
  auto two = route_one(identity_gate(2, 2), router::sinkhorn<2>{}, l);
  check_token(two, 0, {0, 1}, {0.8807970779778823, 0.11920292202211755});  // softmax
  check_token(two, 1, {1, 0}, {0.2689414213699951, 0.7310585786300049});
}

TEST_CASE("reference: capacity limits from their definitions", "[reference][capacity]") {
  layer_config cfg{.hidden = 4, .ffn = 4, .experts = 8, .top_k = 2, .max_tokens = 64};
  CHECK(reference::limit_of(capacity::dropless{}, cfg, 40) == reference::unlimited);
  cfg.capacity_factor = 1.0;
  CHECK(reference::limit_of(capacity::factor<>{}, cfg, 40) == 10);  // 1 * 40 * 2 / 8
  CHECK(reference::limit_of(capacity::factor<>{}, cfg, 10) == 3);   // ceil(2.5)
  CHECK(reference::limit_of(capacity::factor<true>{}, cfg, 0) == 0);
  cfg.capacity_factor = 1.25;
  CHECK(reference::limit_of(capacity::factor<>{}, cfg, 40) == 13);  // ceil(12.5)
}

TEST_CASE("reference: replica choice from the placement rule", "[reference][placement]") {
  const layer_config cfg{
      .hidden = 4, .ffn = 4, .experts = 8, .top_k = 2, .ranks = 4, .max_tokens = 8};
  CHECK(reference::slot_of(placement::block(cfg), 5, 0, 0) == 5);
  CHECK(reference::slot_of(placement::round_robin(cfg), 5, 0, 0) == 3);  // rank 1, slot 1
  CHECK(reference::slot_of(placement::round_robin(cfg), 6, 3, 0) == 5);  // rank 2, slot 1
  // 4 ranks of 2 slots; expert 1 in slots 1 (rank 0), 4 (rank 2), 7 (rank 3).
  const std::vector<int> map = {0, 1, 2, 3, 1, 4, 5, 1};
  const placement::table pairs(6, 4, map, 2);      // nodes {0, 1}, {2, 3}
  CHECK(reference::slot_of(pairs, 1, 0, 9) == 1);  // its own rank's copy
  CHECK(reference::slot_of(pairs, 1, 1, 9) == 1);  // its node's copy
  CHECK(reference::slot_of(pairs, 1, 3, 9) == 7);
  CHECK(reference::slot_of(pairs, 0, 3, 9) == 0);  // the only copy
  // One rank per node: rank 1 has no copy on its node; bits("plac", token, 1, 0) mod 3
  // is 0 for token 0 and 1 for token 2.
  const placement::table single(6, 4, map, 1);
  CHECK(reference::slot_of(single, 1, 1, 0) == 1);
  CHECK(reference::slot_of(single, 1, 1, 2) == 4);
  // Two copies on the home rank are "several candidates" too (docs/placement.md): the
  // hash, mod 2, is 0 for token 0 and 1 for token 1.
  const placement::table twins(4, 2, {0, 1, 1, 2, 3, 1});
  CHECK(reference::slot_of(twins, 1, 0, 0) == 1);
  CHECK(reference::slot_of(twins, 1, 0, 1) == 2);
  CHECK(reference::slot_of(twins, 1, 1, 1) == 5);
}

TEST_CASE("reference: SwiGLU expert math", "[reference][experts]") {
  layer_config cfg{
      .hidden = 1, .ffn = 1, .experts = 1, .top_k = 1, .max_tokens = 1, .shared_experts = 1};
  auto w = reference::full_weights::random(cfg, 1);
  w.w1 = {1}, w.w3 = {2}, w.w2 = {3};
  w.shared_w1 = {0.5f}, w.shared_w3 = {4}, w.shared_w2 = {-1};
  std::vector<double> out(1, 0.0);
  const float one = 1, two = 2;
  // 3 * silu(1) * 2, silu(1) = 1 / (1 + e^-1).
  reference::expert_math<expert::swiglu>::add(w, {false, 0}, &one, 0.5, out);
  CHECK(out[0] == Approx(2.193175735890015).epsilon(tol));
  out[0] = 0;
  reference::expert_math<expert::swiglu>::add(w, {true, 0}, &two, 1.0, out);  // -silu(1) * 8
  CHECK(out[0] == Approx(-5.848468629040039).epsilon(tol));
}

TEST_CASE("reference: forward drops past capacity per source rank, in token order",
          "[reference][capacity]") {
  // E = 2, K = 1, cf 1, 2 ranks: rank 0 has 4 tokens (limit 2), rank 1 has 2 (limit 1).
  // Every token picks expert 0 with weight sigmoid(1); drops leave a zero row.
  layer_config cfg{.hidden = 2,
                   .ffn = 3,
                   .experts = 2,
                   .top_k = 1,
                   .ranks = 2,
                   .max_tokens = 4,
                   .capacity_factor = 1.0};
  auto w = reference::full_weights::random(cfg, 2);
  w.gate = {1, 0, 0, 1};
  std::vector<float> x(6 * 2);
  for (int t = 0; t < 6; ++t) x[t * 2] = 1.f;
  const std::vector<index_t> per_rank = {4, 2};
  std::vector<float> y(x.size(), std::numeric_limits<float>::quiet_NaN());
  reference::forward(w, router::switch_top1{}, capacity::factor<>{}, {x.data(), 6, 2}, per_rank,
                     {y.data(), 6, 2});
  std::vector<double> kept(2, 0.0);
  reference::expert_math<expert::swiglu>::add(w, {false, 0}, x.data(), 0.7310585786300049, kept);
  REQUIRE(kept[0] != 0.0);
  const std::vector<bool> expect_kept = {true, true, false, false, true, false};
  for (int t = 0; t < 6; ++t)
    for (int h = 0; h < 2; ++h) {
      CAPTURE(t, h);
      CHECK(y[t * 2 + h] == Approx(expect_kept[t] ? kept[h] : 0.0).epsilon(1e-6).margin(1e-30));
    }
  std::fill(y.begin(), y.end(), std::numeric_limits<float>::quiet_NaN());
  reference::forward(w, router::switch_top1{}, capacity::dropless{}, {x.data(), 6, 2}, per_rank,
                     {y.data(), 6, 2});
  for (int t = 0; t < 6; ++t) CHECK(y[t * 2] == Approx(kept[0]).epsilon(1e-6));
}

TEST_CASE("reference: the DeepSeek-V3 bias update", "[reference][routers]") {
  // mean load 2: underloaded expert 1 gains gamma, overloaded 0 loses it, the rest stay.
  router::sigmoid_bias<2> r{.gamma = 0.25f};
  std::vector<float> bias = {0, 0, 0, 0.5f};
  const std::vector<index_t> load = {4, 0, 2, 2};
  reference::update_bias(r, std::span<float>(bias), load);
  CHECK(bias == std::vector<float>{-0.25f, 0.25f, 0, 0.5f});
  // The load counts every assignment of every rank before capacity.
  const auto w = identity_gate(4, 2);
  const std::vector<float> l = {1, 3, 2, 0, 0, 1, 0, 3};
  const std::vector<index_t> two_ranks = {1, 1};
  const auto routed = reference::route_ranks(w, router::mixtral<2>{}, {l.data(), 2, 4}, two_ranks);
  CHECK(reference::expert_load(routed, 4) == std::vector<index_t>{0, 2, 1, 1});
}
