// SPDX-FileCopyrightText: 2026 The epmoe authors
// SPDX-License-Identifier: Apache-2.0
#pragma once

// Runs a layer on R in-process ranks and the plain reference on the same tokens.
#include <algorithm>
#include <cmath>
#include <functional>
#include <limits>
#include <numeric>
#include <optional>
#include <span>
#include <tuple>
#include <utility>
#include <vector>

#include <epmoe/epmoe.hpp>
#include <epmoe/reference/compare.hpp>
#include <epmoe/reference/forward.hpp>
#include <epmoe/reference/weights.hpp>

namespace epmoe::test {

/// The spaces a behaviour's tests run on: the host here; a CUDA test TU defines
/// EPMOE_TEST_SPACES (space::cuda<float>, ...) and includes the same test file, so each
/// behaviour is written once and instantiated per space (as Kokkos tests its backends).
#ifndef EPMOE_TEST_SPACES
#define EPMOE_TEST_SPACES epmoe::space::host
#endif
using spaces = std::tuple<EPMOE_TEST_SPACES>;

namespace detail {
template <class A, class B>
struct cross;
template <class... A, class... B>
struct cross<std::tuple<A...>, std::tuple<B...>> {
  template <class X>
  using row = std::tuple<std::pair<X, B>...>;
  using type = decltype(std::tuple_cat(std::declval<row<A>>()...));
};
template <template <class> class L, class S>
struct per_space;
template <template <class> class L, class... S>
struct per_space<L, std::tuple<S...>> {
  using type = decltype(std::tuple_cat(std::declval<L<S>>()...));
};
}  // namespace detail
/// Every (a, space) pair of a type list and the spaces, as std::pair<a, space>.
template <class List>
using with_spaces = typename detail::cross<List, spaces>::type;
/// L<space> (a tuple of bundles) for every space, concatenated.
template <template <class> class L>
using per_space = typename detail::per_space<L, spaces>::type;

/// How tests move data to and from a space: host vectors here; a device space specialises
/// this (tests/cuda/space_io.cuh): uploads convert to its element type, downloads back.
template <class Space>
struct space_io {
  using value_type = float;
  using array = std::vector<float>;
  static array upload(std::span<const float> v) { return {v.begin(), v.end()}; }
  template <class U>
  static std::vector<U> upload_as(std::span<const U> v) {
    return {v.begin(), v.end()};
  }
  template <class A>
  static auto* data(A& a) {
    return a.data();
  }
  static std::vector<float> download(const array& a, const Space&) { return a; }
  /// NaN over every element, before the call under test (ordered before the space's work).
  static void poison(array& a, const Space&) {
    std::fill(a.begin(), a.end(), std::numeric_limits<float>::quiet_NaN());
  }
  /// A value as the space holds it (rounded to its element type).
  static float round(float v) { return v; }
  /// The error bound of a check made in fp32: the element type's rounding may add to it.
  static double tolerance(double fp32) { return fp32; }
};

template <class Space>
double tolerance(double fp32) {
  return space_io<Space>::tolerance(fp32);
}

template <int K, class Capacity = capacity::dropless, class Space = space::host>
struct threads_policies : default_policies {
  using space = Space;
  using router = epmoe::router::topk_softmax<K>;
  using capacity = Capacity;
  using comm = epmoe::comm::threads;
};

/// A router's bundle on in-process ranks (the router and pass tests swap only the router).
template <class Space, class Router, class Capacity = capacity::dropless>
struct router_policies : default_policies {
  using space = Space;
  using router = Router;
  using capacity = Capacity;
  using comm = epmoe::comm::threads;
};

/// The small layer of the router and pass tests (capacity factor 1: drops happen).
inline layer_config small_layer(int ranks, int top_k, int experts = 8) {
  return {.hidden = 13,
          .ffn = 11,
          .experts = experts,
          .top_k = top_k,
          .ranks = ranks,
          .max_tokens = 40,
          .capacity_factor = 1.0};
}

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

/// What a multi-rank run returns: outputs in global token order (the last pass, and every
/// pass) and each rank's stats (one entry per pass).
struct run_result {
  std::vector<float> y;
  std::vector<std::vector<pass_stats>> stats;  // [rank][pass]
  std::vector<std::vector<float>> ys;          // [pass]
};

/// What a run may set beyond the policies: router and capacity objects, token ids (all
/// ranks, global order), a router bias to load, the number of passes, a placement, and a
/// step every rank runs after each pass (a collective such as update_router).
template <class P>
struct run_options {
  typename P::router router{};
  typename P::capacity capacity{};
  std::vector<std::int64_t> token_ids{};
  std::vector<float> bias{};
  int passes = 1;
  std::optional<typename P::placement> placement{};  // default: P::placement(cfg)
  std::function<void(moe_layer<P>&)> between{};
};

/// One expert bundle's stacked arrays (each may be unused by an expert type).
template <class T>
struct expert_arrays {
  const T *w1, *w3, *w2, *b1, *b2;
};
template <class T>
expert_arrays<T> arrays_of(T* w1, T* w3, T* w2, T* b1, T* b2) {
  return {w1, w3, w2, b1, b2};
}

/// The weights a layer with expert type X takes, over stacked arrays of element type T:
/// SwiGLU's w1, w3, w2; another expert specialises this (tests/policies/test_user_policies).
template <class X>
struct expert_weights {
  template <class T>
  static typename X::template weights_of<T> of(expert_arrays<T> a, index_t n, index_t ffn,
                                               index_t hidden) {
    return {{a.w1, n, ffn, hidden}, {a.w3, n, ffn, hidden}, {a.w2, n, hidden, ffn}};
  }
};
template <class Act, bool Biases>
struct expert_weights<expert::mlp<Act, Biases>> {
  template <class T>
  static typename expert::mlp<Act, Biases>::template weights_of<T> of(expert_arrays<T> a, index_t n,
                                                                      index_t ffn, index_t hidden) {
    return {
        {a.w1, n, ffn, hidden}, {a.w2, n, hidden, ffn}, {a.b1, n, 1, ffn}, {a.b2, n, 1, hidden}};
  }
};

/// One rank's weights in a space's memory, and the layer's views of them.
template <class P>
struct rank_arrays {
  using io = space_io<typename P::space>;
  typename io::array gate, w1, w3, w2, b1, b2, s1, s3, s2, sb1, sb2, noise, sgate, obias;
  rank_arrays(const reference::full_weights& w, const reference::rank_weights& mine)
      : gate(io::upload(w.gate)),
        w1(io::upload(mine.w1)),
        w3(io::upload(mine.w3)),
        w2(io::upload(mine.w2)),
        b1(io::upload(mine.b1)),
        b2(io::upload(mine.b2)),
        s1(io::upload(w.shared_w1)),
        s3(io::upload(w.shared_w3)),
        s2(io::upload(w.shared_w2)),
        sb1(io::upload(w.shared_b1)),
        sb2(io::upload(w.shared_b2)),
        noise(io::upload(w.noise_gate)),
        sgate(io::upload(w.shared_gate)),
        obias(io::upload(w.output_bias)) {}
  typename moe_layer<P>::weights views(const layer_config& cfg, index_t L) {
    using X = expert_weights<typename P::expert>;
    const index_t H = cfg.hidden, F = cfg.ffn, N = cfg.shared_experts, Fs = cfg.shared_width();
    return {{io::data(gate), cfg.experts, H},
            X::of(arrays_of(io::data(w1), io::data(w3), io::data(w2), io::data(b1), io::data(b2)),
                  L, F, H),
            X::of(arrays_of(io::data(s1), io::data(s3), io::data(s2), io::data(sb1), io::data(sb2)),
                  N, Fs, H),
            {io::data(noise), cfg.experts, H},
            {io::data(sgate), N, H},
            {io::data(obias), 1, H}};
  }
};

/// Runs `passes` forward passes of moe_layer<P> on cfg.ranks ranks (threads of this process;
/// on a device space, all on one device) over the same tokens. Every pass starts from NaN
/// (a row the layer leaves unwritten fails any comparison); y is the last pass.
template <class P>
run_result run_layer(const layer_config& cfg, const reference::full_weights& w,
                     const global_tokens& g, const run_options<P>& opt = {}) {
  using io = space_io<typename P::space>;
  constexpr float nan = std::numeric_limits<float>::quiet_NaN();
  run_result out{std::vector<float>(g.x.size(), nan),
                 std::vector<std::vector<pass_stats>>(cfg.ranks),
                 std::vector<std::vector<float>>(static_cast<std::size_t>(opt.passes),
                                                 std::vector<float>(g.x.size(), nan))};
  const auto body = [&](typename P::comm c) {
    const int r = c.rank();
    const typename P::placement where = opt.placement ? *opt.placement : typename P::placement(cfg);
    rank_arrays<P> arrays(w, reference::slice(w, where, r));
    const typename P::space space{};
    moe_layer<P> layer(cfg, c, arrays.views(cfg, where.slots_per_rank()), opt.router, opt.capacity,
                       where, space);
    if constexpr (router_with_bias<typename P::router>)
      if (!opt.bias.empty())
        std::copy(opt.bias.begin(), opt.bias.end(), layer.router_bias().begin());
    const index_t T = g.per_rank[r], H = cfg.hidden;
    const auto x = io::upload(std::span(g.x).subspan(g.offset(r) * H, T * H));
    auto y = io::upload(std::vector<float>(T * H));
    auto ids = io::upload_as(
        std::span(opt.token_ids)
            .subspan(opt.token_ids.empty() ? 0 : g.offset(r), opt.token_ids.empty() ? 0 : T));
    const std::span<const std::int64_t> id_span(io::data(ids), opt.token_ids.empty() ? 0 : T);
    for (int p = 0; p < opt.passes; ++p) {
      io::poison(y, space);  // a row only an earlier pass wrote fails too
      layer.forward({io::data(x), T, H}, {io::data(y), T, H}, id_span);
      out.stats[r].push_back(layer.stats());
      const std::vector<float> yh = io::download(y, space);
      std::copy(yh.begin(), yh.end(), out.ys[p].begin() + g.offset(r) * H);
      if (opt.between) opt.between(layer);
    }
    if (opt.passes > 0)
      std::copy_n(out.ys.back().begin() + g.offset(r) * H, T * H, out.y.begin() + g.offset(r) * H);
  };
  if constexpr (std::is_same_v<typename P::comm, comm::local>) {
    body(comm::local{});
  } else {
    comm::threads_world world(cfg.ranks);
    world.run(body);
  }
  return out;
}

/// Weights and tokens as a space holds them (rounded to its element type), for the reference.
template <class Space>
reference::full_weights rounded(reference::full_weights w) {
  for (auto* v :
       {&w.gate, &w.w1, &w.w3, &w.w2, &w.shared_w1, &w.shared_w3, &w.shared_w2, &w.noise_gate,
        &w.b1, &w.b2, &w.shared_b1, &w.shared_b2, &w.shared_gate, &w.output_bias})
    for (float& x : *v) x = space_io<Space>::round(x);
  return w;
}
template <class Space>
std::vector<float> rounded(std::vector<float> v) {
  for (float& x : v) x = space_io<Space>::round(x);
  return v;
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
  // Weights and tokens as the layer's space holds them: what is left is the rounding of
  // intermediates.
  reference::full_weights run_w = rounded<typename P::space>(w);
  run_w.cfg = cfg;
  const std::vector<float> x = rounded<typename P::space>(g.x);
  reference::forward<typename P::expert>(run_w, router, opt.capacity, where, {x.data(), n, H},
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
