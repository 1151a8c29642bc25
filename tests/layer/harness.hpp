// SPDX-FileCopyrightText: 2026 The epmoe authors
// SPDX-License-Identifier: Apache-2.0
#pragma once

// Runs a layer on R in-process ranks and the plain reference on the same tokens.
#include <algorithm>
#include <cmath>
#include <limits>
#include <numeric>
#include <optional>
#include <vector>

#include <epmoe/epmoe.hpp>
#include <epmoe/reference/compare.hpp>
#include <epmoe/reference/forward.hpp>
#include <epmoe/reference/weights.hpp>

namespace epmoe::test {

template <int K, class Capacity = capacity::dropless>
struct threads_policies : default_policies {
  using router = epmoe::router::topk_softmax<K>;
  using capacity = Capacity;
  using comm = epmoe::comm::threads;
};

/// Every rank's tokens, rank after rank, with the counts per rank.
struct global_tokens {
  std::vector<index_t> per_rank;
  std::vector<float> x;  // [sum(per_rank), H]
  index_t total() const { return std::accumulate(per_rank.begin(), per_rank.end(), index_t{0}); }
  index_t offset(int r) const {
    return std::accumulate(per_rank.begin(), per_rank.begin() + r, index_t{0});
  }
};

inline global_tokens make_tokens(std::vector<index_t> per_rank, index_t hidden,
                                 std::uint64_t seed) {
  global_tokens g{std::move(per_rank), {}};
  g.x = reference::random_tokens(g.total(), hidden, seed);
  return g;
}

/// What a multi-rank run returns: outputs in global token order and each rank's stats
/// (one entry per pass).
struct run_result {
  std::vector<float> y;
  std::vector<std::vector<pass_stats>> stats;  // [rank][pass]
};

/// What a run may set beyond the policies: router and capacity objects, token ids (all
/// ranks, global order), a router bias to load, and the number of passes.
template <class P>
struct run_options {
  typename P::router router{};
  typename P::capacity capacity{};
  std::vector<std::int64_t> token_ids{};
  std::vector<float> bias{};
  int passes = 1;
  std::optional<typename P::placement> placement{};  // default: P::placement(cfg)
};

/// The weights a layer with expert type X takes, from a rank's slice and the full weights:
/// SwiGLU's w1, w3, w2; another expert specialises this (tests/policies/test_user_policies).
template <class X>
struct expert_weights {
  static auto routed(const reference::rank_weights& mine) { return mine.experts(); }
  static auto shared(const reference::full_weights& w) { return w.shared(); }
};

/// Runs `passes` forward passes of moe_layer<P> on cfg.ranks threads over the same tokens
/// (y is the last pass; every pass starts from NaN, so a row the layer leaves unwritten fails
/// any comparison).
template <class P>
run_result run_layer(const layer_config& cfg, const reference::full_weights& w,
                     const global_tokens& g, const run_options<P>& opt = {}) {
  constexpr float nan = std::numeric_limits<float>::quiet_NaN();
  run_result out{std::vector<float>(g.x.size(), nan),
                 std::vector<std::vector<pass_stats>>(cfg.ranks)};
  comm::threads_world world(cfg.ranks);
  world.run([&](comm::threads c) {
    const int r = c.rank();
    const typename P::placement where = opt.placement ? *opt.placement : typename P::placement(cfg);
    const auto mine = reference::slice(w, where, r);
    using X = expert_weights<typename P::expert>;
    moe_layer<P> layer(cfg, c, {w.gate_view(), X::routed(mine), X::shared(w), w.noise_gate_view()},
                       opt.router, opt.capacity, where);
    if constexpr (router_with_bias<typename P::router>)
      if (!opt.bias.empty())
        std::copy(opt.bias.begin(), opt.bias.end(), layer.router_bias().begin());
    const index_t T = g.per_rank[r], H = cfg.hidden;
    std::span<const std::int64_t> ids;
    if (!opt.token_ids.empty())
      ids = {opt.token_ids.data() + g.offset(r), static_cast<std::size_t>(T)};
    float* y = out.y.data() + g.offset(r) * H;
    for (int p = 0; p < opt.passes; ++p) {
      std::fill(y, y + T * H, nan);  // this rank's rows: a row only an earlier pass wrote fails
      layer.forward({g.x.data() + g.offset(r) * H, T, H}, {y, T, H}, ids);
      out.stats[r].push_back(layer.stats());
    }
  });
  return out;
}

/// The reference on the same tokens; `pass` is the layer pass to match (training noise).
template <class P>
std::vector<float> run_reference(const layer_config& cfg, const reference::full_weights& w,
                                 const global_tokens& g, const run_options<P>& opt = {},
                                 std::uint64_t pass = 0) {
  std::vector<float> y(g.x.size(), std::numeric_limits<float>::quiet_NaN());  // rows it skips fail
  const index_t n = g.total(), H = cfg.hidden;
  typename P::router router = opt.router;
  if constexpr (router_with_bias<typename P::router>)
    router.bias = opt.bias.empty() ? nullptr : opt.bias.data();
  const typename P::placement where = opt.placement ? *opt.placement : typename P::placement(cfg);
  // The run's config rules, as in the layer (weights made for another one may carry more
  // shared experts than cfg switches on).
  reference::full_weights run_w = w;
  run_w.cfg = cfg;
  reference::forward<typename P::expert>(run_w, router, opt.capacity, where, {g.x.data(), n, H},
                                         g.per_rank, {y.data(), n, H}, {opt.token_ids, pass});
  return y;
}

/// The acceptance tests' error measure, reference::max_relative_error: max |a - b| /
/// max(max |b|, tiny), +inf on any NaN/Inf or a size mismatch.
inline double relative_error(const std::vector<float>& a, const std::vector<float>& b) {
  return reference::max_relative_error(a, b);
}

/// Calls f.template operator()<K>() for the run-time K in {1, 2, 4}.
template <class F>
void with_top_k(int k, F&& f) {
  switch (k) {
    case 1:
      f.template operator()<1>();
      break;
    case 2:
      f.template operator()<2>();
      break;
    case 4:
      f.template operator()<4>();
      break;
    default:
      throw std::logic_error("with_top_k: K must be 1, 2 or 4");
  }
}

}  // namespace epmoe::test
