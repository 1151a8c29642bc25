// SPDX-FileCopyrightText: 2026 The epmoe authors
// SPDX-License-Identifier: Apache-2.0
#pragma once

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <limits>
#include <numeric>
#include <span>
#include <vector>

#include "epmoe/core/concepts.hpp"
#include "epmoe/core/config.hpp"
#include "epmoe/core/routing.hpp"
#include "epmoe/core/view.hpp"
#include "epmoe/reference/random.hpp"
#include "epmoe/reference/weights.hpp"
#include "epmoe/router/expert_choice.hpp"
#include "epmoe/router/hash.hpp"
#include "epmoe/router/jitter.hpp"
#include "epmoe/router/logit_bias.hpp"
#include "epmoe/router/noisy_topk.hpp"
#include "epmoe/router/sigmoid_bias.hpp"
#include "epmoe/router/sinkhorn.hpp"
#include "epmoe/router/sparsemixer.hpp"
#include "epmoe/router/topk_softmax.hpp"

namespace epmoe::router {
// Found by argument-dependent lookup for the library's routers (and types derived from
// them) only: the reference must have its own formula for each (never defined or called).
template <class R>
void has_reference_formula(const R&);
}  // namespace epmoe::router

// The routers as float64 formulas written from their definitions (docs/routers.md and the
// papers), independent of router/*.hpp: a router object is read for its parameters only.
// Conventions (docs/routers.md): every selection is by value, best first, ties to the lower
// expert id (the lower token for expert choice, the lower group for group limits); NaN ranks
// below every number. Logits are x · Wᵀ summed in double; with the repository's dyadic gate
// and tokens they are exact, so float32 and float64 select the same experts. Where a
// router's own arithmetic differs (noise, jitter, Sinkhorn's iteration) a selection could
// differ on a near-tie of ~1e-7; test inputs keep clear of ties.
namespace epmoe::reference {

/// Inputs of a pass beyond the tokens themselves.
struct pass_options {
  std::span<const std::int64_t> token_ids;  // one per token (all ranks), or empty
  std::uint64_t pass = 0;                   // the layer's pass counter (training noise)
};

/// One rank's tokens as the reference routers see them.
struct rank_batch {
  const layer_config* cfg = nullptr;
  const full_weights* w = nullptr;
  index_t tokens = 0;
  std::vector<double> x;            // [T, H]: the gate's input (the tokens, or jittered)
  std::vector<std::int64_t> token;  // [T]: the token id given, else rank * max_tokens + t
  std::uint64_t pass = 0;
};

/// One rank's routing: `width` slots per token (K, or E for expert choice), empty slots
/// no_expert with weight 0.
struct rank_routing {
  index_t tokens = 0, width = 0;
  std::vector<std::int32_t> ids;  // [T, width]
  std::vector<double> weights;    // [T, width]

  rank_routing() = default;
  rank_routing(index_t t, index_t k)
      : tokens(t),
        width(k),
        ids(static_cast<std::size_t>(t * k), no_expert),
        weights(static_cast<std::size_t>(t * k), 0.0) {}
  std::int32_t& id(index_t t, index_t k) { return ids[static_cast<std::size_t>(t * width + k)]; }
  double& weight(index_t t, index_t k) { return weights[static_cast<std::size_t>(t * width + k)]; }
};

template <class R>
concept library_router = requires(const R& r) {
  has_reference_formula(r);
};

template <class Router>
rank_routing route_rank(const Router& router, const rank_batch& b);

namespace detail {

inline constexpr double minus_inf = -std::numeric_limits<double>::infinity();

// NaN never wins a comparison (docs/routers.md).
inline double ranked(double v) { return std::isnan(v) ? minus_inf : v; }

// x · Wᵀ for W [E, H] row-major (the gate or the noise gate): [T, E].
inline std::vector<double> project(const rank_batch& b, const std::vector<float>& weight) {
  const index_t T = b.tokens, H = b.cfg->hidden, E = b.cfg->experts;
  std::vector<double> out(static_cast<std::size_t>(T * E));
  for (index_t t = 0; t < T; ++t)
    for (index_t e = 0; e < E; ++e) {
      double s = 0;
      for (index_t h = 0; h < H; ++h) s += b.x[t * H + h] * double{weight[e * H + h]};
      out[t * E + e] = s;
    }
  return out;
}

// softmax(v): e^(v - max) / sum.
inline std::vector<double> softmax(std::span<const double> v) {
  double m = minus_inf;
  for (double x : v) m = std::max(m, x);
  std::vector<double> p(v.size());
  double sum = 0;
  for (std::size_t i = 0; i < v.size(); ++i) sum += (p[i] = std::exp(v[i] - m));
  for (double& x : p) x /= sum;
  return p;
}

// Indices of `key` in descending key order, ties to the lower index, keeping only those
// with allowed[i] (all when empty); the first `k` (all when k < 0).
inline std::vector<int> best(std::span<const double> key, int k, const std::vector<char>& allowed) {
  std::vector<int> order;
  for (int i = 0; i < static_cast<int>(key.size()); ++i)
    if (allowed.empty() || allowed[i]) order.push_back(i);
  std::stable_sort(order.begin(), order.end(),
                   [&](int a, int b) { return ranked(key[a]) > ranked(key[b]); });
  if (k >= 0 && static_cast<int>(order.size()) > k) order.resize(static_cast<std::size_t>(k));
  return order;
}

// Group-limited top-k (DeepSeek-V2 device-limited, DeepSeek-V3 node-limited routing): the
// experts form `groups` equal contiguous groups; a group scores pair(a, b) of its two best
// keys a >= b (a alone when it holds one expert); the top_groups best groups are kept and the
// k best experts inside them chosen. groups = 1 (or top_groups = groups) is plain top-k.
// mask zero (Hugging Face's masked_fill(~mask, 0.0)): the k best of every expert, those of
// dropped groups keyed 0.0.
template <class Pair>
std::vector<int> group_limited_best(
    std::span<const double> key, int k, int groups, int top_groups, Pair pair,
    router::group_mask_mode mask = router::group_mask_mode::minus_inf) {
  const int E = static_cast<int>(key.size()), size = E / groups;
  std::vector<double> score(static_cast<std::size_t>(groups));
  for (int g = 0; g < groups; ++g) {
    const auto top = best(key.subspan(static_cast<std::size_t>(g * size), size), 2, {});
    const double a = ranked(key[g * size + top[0]]);
    score[g] = size > 1 ? pair(a, ranked(key[g * size + top[1]])) : a;
  }
  std::vector<char> allowed(static_cast<std::size_t>(E), 0);
  for (int g : best(score, top_groups, {}))
    for (int e = g * size; e < (g + 1) * size; ++e) allowed[e] = 1;
  if (mask == router::group_mask_mode::zero) {
    std::vector<double> filled(key.begin(), key.end());
    for (int e = 0; e < E; ++e)
      if (!allowed[e]) filled[e] = 0.0;
    return best(filled, k, {});
  }
  return best(key, k, allowed);
}

// Group score of additive scores (sigmoid): s_a + s_b.
inline double sum_of(double a, double b) { return a + b; }

// Group score of logits whose probabilities add (softmax): log(e^a + e^b), in the order of
// p_a + p_b (the common 1 / sum cancels) and exact where p would underflow.
inline double log_sum_exp(double a, double b) {
  return b == minus_inf ? a : a + std::log1p(std::exp(b - a));
}

inline double sigmoid(double x) { return 1.0 / (1.0 + std::exp(-x)); }

// log(1 + e^x) without overflow.
inline double softplus(double x) {
  return x > 0 ? x + std::log1p(std::exp(-x)) : std::log1p(std::exp(x));
}

}  // namespace detail

/// Softmax top-K (Switch, GShard, Mixtral, Qwen, DBRX; DeepSeek group limits):
/// p = softmax(l); the K best p inside the kept groups, group score p_a + p_b of its two best;
/// weights p_k, divided by their norm_p-norm (Σ_j |p_j|^norm_p)^(1/norm_p) over the K chosen
/// when Renormalize (norm_p = 1, their sum: Mixtral, GShard, Qwen norm_topk_prob; DBRX's
/// moe_normalize_expert_weights).
template <int K, bool Renormalize>
rank_routing routing_of(const router::topk_softmax<K, Renormalize>& r, const rank_batch& b) {
  const index_t T = b.tokens, E = b.cfg->experts;
  const auto l = detail::project(b, b.w->gate);
  rank_routing out(T, K);
  for (index_t t = 0; t < T; ++t) {
    const auto row = std::span<const double>(l).subspan(static_cast<std::size_t>(t * E), E);
    const auto p = detail::softmax(row);
    // p's order is the logits' order; choosing on the logits keeps it where p underflows or
    // is NaN (a +inf logit).
    // A group's score: p_a + p_b (as log(e^a + e^b) of the logits), or its best p (V2).
    const auto ids =
        r.group_by == router::group_score::max
            ? detail::group_limited_best(row, K, r.groups, r.top_groups,
                                         [](double a, double) { return a; })
            : detail::group_limited_best(row, K, r.groups, r.top_groups, detail::log_sum_exp);
    const double norm_p = r.norm_p;
    double chosen = 0;
    for (int e : ids) chosen += std::pow(std::abs(p[e]), norm_p);
    chosen = std::pow(chosen, 1.0 / norm_p);
    for (int k = 0; k < K; ++k) {
      out.id(t, k) = ids[k];
      out.weight(t, k) = (Renormalize ? p[ids[k]] / chosen : p[ids[k]]) * double{r.scaling};
    }
  }
  return out;
}

/// GPT-OSS (`GptOssTopKRouter`): l = x Wᵀ + b, the K largest l (ties to the lower index),
/// weights softmax over those K alone: w_k = e^(l_k) / Σ_{j∈S} e^(l_j). Groups, p-norms and
/// scaling are not part of it (left at their defaults).
template <int K>
rank_routing routing_of(const router::logit_bias<router::topk_softmax<K, true>>&,
                        const rank_batch& b) {
  const index_t T = b.tokens, E = b.cfg->experts;
  auto l = detail::project(b, b.w->gate);
  for (index_t t = 0; t < T; ++t)
    for (index_t e = 0; e < E; ++e) l[t * E + e] += double{b.w->gate_bias[e]};
  rank_routing out(T, K);
  for (index_t t = 0; t < T; ++t) {
    const auto row = std::span<const double>(l).subspan(static_cast<std::size_t>(t * E), E);
    const auto ids = detail::best(row, K, {});
    std::vector<double> chosen;
    for (int e : ids) chosen.push_back(row[e]);
    const auto w = detail::softmax(chosen);
    for (int k = 0; k < K; ++k) out.id(t, k) = ids[k], out.weight(t, k) = w[k];
  }
  return out;
}

// The scored routers (router::biased, router::table: sigmoid_bias is one): routing_scored.hpp.

/// SparseMixer top-2 (PhiMoE; Hugging Face `sparsemixer`). Round 1 on the logits l, round 2
/// on l with round 1's expert at -inf: t = max of the round's logits; gate_e = -inf where
/// (t - l_e) / max(|l_e|, t) > 2 jitter_eps (l_e unmasked), else the round's l_e; the expert is
/// argmax gate (inference) or argmax (gate_e - log G_e), G_e = -log uniform(bits(seed, pass,
/// token, round · E + e)) an Exp(1) draw (training); its weight softmax(gate) there, times
/// 0.3333 while training when it is not the argmax and uniform(bits(seed, pass, token,
/// 2E + round)) <= 0.75 (round 0 or 1).
inline rank_routing routing_of(const router::sparsemixer& r, const rank_batch& b) {
  const index_t T = b.tokens, E = b.cfg->experts;
  const auto l = detail::project(b, b.w->gate);
  const double eps = r.jitter_eps;
  rank_routing out(T, 2);
  for (index_t t = 0; t < T; ++t) {
    const auto row = std::span<const double>(l).subspan(static_cast<std::size_t>(t * E), E);
    std::vector<char> open(static_cast<std::size_t>(E), 1);  // round 2: not round 1's expert
    for (int round = 0; round < 2; ++round) {
      const int argmax = detail::best(row, 1, open)[0];
      const double threshold = detail::ranked(row[argmax]);
      std::vector<double> gate(row.begin(), row.end());
      for (index_t e = 0; e < E; ++e)
        if (!open[e] || (threshold - row[e]) / std::max(std::abs(row[e]), threshold) > 2.0 * eps)
          gate[e] = detail::minus_inf;
      int chosen = argmax;
      double heun = 1.0;
      if (r.training) {
        const auto u = [&](index_t c) {
          return draws::uniform(draws::bits(r.seed, b.pass, static_cast<std::uint64_t>(b.token[t]),
                                            static_cast<std::uint64_t>(c)));
        };
        std::vector<double> gumbel(gate.size());
        for (index_t e = 0; e < E; ++e) gumbel[e] = gate[e] - std::log(-std::log(u(round * E + e)));
        chosen = detail::best(gumbel, 1, {})[0];
        if (chosen != argmax && !(u(2 * E + round) > 0.75)) heun = 0.3333;
      }
      out.id(t, round) = chosen;
      out.weight(t, round) = detail::softmax(gate)[chosen] * heun;
      open[chosen] = 0;
    }
  }
  return out;
}

/// Expert choice (Zhou et al. 2022): S = softmax(l) per token; expert e takes the
/// C = min(T, ceil(capacity_factor · T · top_k / E)) tokens with the largest S[t, e] (ties:
/// lower token), weight S[t, e]. Slot e of a token's E slots holds expert e or no_expert.
inline rank_routing routing_of(const router::expert_choice&, const rank_batch& b) {
  const layer_config& cfg = *b.cfg;
  const index_t T = b.tokens, E = cfg.experts;
  const auto l = detail::project(b, b.w->gate);
  std::vector<double> S(l.size());
  for (index_t t = 0; t < T; ++t) {
    const auto p = detail::softmax(std::span(l).subspan(static_cast<std::size_t>(t * E), E));
    std::copy(p.begin(), p.end(), S.begin() + t * E);
  }
  // The definition's expression, evaluated left to right as written.
  const auto C = std::min(
      T, static_cast<index_t>(std::ceil(cfg.capacity_factor * static_cast<double>(T) *
                                        static_cast<double>(cfg.top_k) / static_cast<double>(E))));
  rank_routing out(T, E);
  std::vector<double> column(static_cast<std::size_t>(T));
  for (index_t e = 0; e < E; ++e) {
    for (index_t t = 0; t < T; ++t) column[t] = S[t * E + e];
    for (int t : detail::best(column, static_cast<int>(C), {})) {
      out.id(t, e) = static_cast<std::int32_t>(e);
      out.weight(t, e) = S[t * E + e];
    }
  }
  return out;
}

/// Hash layers (Roller et al. 2021): e_k = bits(seed, token id, k, 0) mod E; an expert
/// already taken moves to the next id (mod E) until a free one; every weight 1/K.
template <int K>
rank_routing routing_of(const router::hash<K>& r, const rank_batch& b) {
  const index_t T = b.tokens;
  const auto E = static_cast<std::uint64_t>(b.cfg->experts);
  rank_routing out(T, K);
  for (index_t t = 0; t < T; ++t)
    for (int k = 0; k < K; ++k) {
      auto e = static_cast<std::int32_t>(
          draws::bits(r.seed, static_cast<std::uint64_t>(b.token[t]), k, 0) % E);
      const auto taken = [&](std::int32_t x) {
        for (int j = 0; j < k; ++j)
          if (out.id(t, j) == x) return true;
        return false;
      };
      while (taken(e)) e = static_cast<std::int32_t>((static_cast<std::uint64_t>(e) + 1) % E);
      out.id(t, k) = e;
      out.weight(t, k) = 1.0 / K;
    }
  return out;
}

/// Noisy top-K (Shazeer et al. 2017): H_e = l_e + z_e · softplus((x W_noiseᵀ)_e) while
/// training, z_e = N(0, 1) drawn from bits(seed, pass, token, e); H = l otherwise; the K best
/// H, weights the softmax over those K.
template <int K>
rank_routing routing_of(const router::noisy_topk<K>& r, const rank_batch& b) {
  const index_t T = b.tokens, E = b.cfg->experts;
  auto h = detail::project(b, b.w->gate);
  if (r.training) {
    const auto n = detail::project(b, b.w->noise_gate);
    for (index_t t = 0; t < T; ++t)
      for (index_t e = 0; e < E; ++e) {
        const double z = draws::normal(draws::bits(
            r.seed, b.pass, static_cast<std::uint64_t>(b.token[t]), static_cast<std::uint64_t>(e)));
        h[t * E + e] += z * detail::softplus(n[t * E + e]);
      }
  }
  rank_routing out(T, K);
  for (index_t t = 0; t < T; ++t) {
    const auto row = std::span<const double>(h).subspan(static_cast<std::size_t>(t * E), E);
    const auto ids = detail::best(row, K, {});
    std::vector<double> chosen(static_cast<std::size_t>(K));
    for (int k = 0; k < K; ++k) chosen[k] = row[ids[k]];
    const auto p = detail::softmax(chosen);
    for (int k = 0; k < K; ++k) {
      out.id(t, k) = ids[k];
      out.weight(t, k) = p[k];
    }
  }
  return out;
}

/// Switch input jitter: while training, the gate sees x_h · (1 - eps + 2 eps u) with
/// u = uniform(bits(seed, pass, token, h)); then the inner router's formula.
template <class Inner>
rank_routing routing_of(const router::jitter<Inner>& j, const rank_batch& b) {
  const Inner& inner = j;
  if (!j.training) return route_rank(inner, b);
  rank_batch jittered = b;
  const index_t H = b.cfg->hidden;
  const double eps = j.eps;
  for (index_t t = 0; t < b.tokens; ++t)
    for (index_t h = 0; h < H; ++h) {
      const double u = draws::uniform(draws::bits(
          j.seed, b.pass, static_cast<std::uint64_t>(b.token[t]), static_cast<std::uint64_t>(h)));
      jittered.x[t * H + h] *= 1.0 - eps + 2.0 * eps * u;
    }
  return route_rank(inner, jittered);
}

/// Sinkhorn-balanced top-K (S-BASE; Megatron-Core's sinkhorn): with c = exp(l - max l) over
/// the batch and d1 = 1, repeat d0_t = 1 / (T (Σ_e d1_e c_te + 1e-8)),
/// d1_e = 1 / (E (Σ_t d0_t c_te + 1e-8)) until mean_e |Δd1_e| <= tolerance or
/// max_iterations; the K best d1_e c_te d0_t choose; weights softmax(l)_k (K > 1) or
/// sigmoid(l_k) (K = 1).
template <int K>
rank_routing routing_of(const router::sinkhorn<K>& r, const rank_batch& b) {
  const index_t T = b.tokens, E = b.cfg->experts;
  rank_routing out(T, K);
  if (T == 0) return out;
  const auto l = detail::project(b, b.w->gate);
  const double m = *std::max_element(
      l.begin(), l.end(), [](double x, double y) { return detail::ranked(x) < detail::ranked(y); });
  std::vector<double> c(l.size()), d0(static_cast<std::size_t>(T)),
      d1(static_cast<std::size_t>(E), 1.0);
  for (std::size_t i = 0; i < l.size(); ++i) c[i] = std::exp(l[i] - m);
  for (int it = 0; it < r.max_iterations; ++it) {
    for (index_t t = 0; t < T; ++t) {
      double s = 0;
      for (index_t e = 0; e < E; ++e) s += d1[e] * c[t * E + e];
      d0[t] = 1.0 / (static_cast<double>(T) * (s + 1e-8));
    }
    double change = 0;
    for (index_t e = 0; e < E; ++e) {
      double s = 0;
      for (index_t t = 0; t < T; ++t) s += d0[t] * c[t * E + e];
      const double next = 1.0 / (static_cast<double>(E) * (s + 1e-8));
      change += std::abs(next - d1[e]);
      d1[e] = next;
    }
    if (change / static_cast<double>(E) <= double{r.tolerance}) break;
  }
  std::vector<double> balanced(static_cast<std::size_t>(E));
  for (index_t t = 0; t < T; ++t) {
    for (index_t e = 0; e < E; ++e) balanced[e] = d1[e] * c[t * E + e] * d0[t];
    const auto ids = detail::best(balanced, K, {});
    const auto row = std::span<const double>(l).subspan(static_cast<std::size_t>(t * E), E);
    const auto p = detail::softmax(row);
    for (int k = 0; k < K; ++k) {
      out.id(t, k) = ids[k];
      out.weight(t, k) = K == 1 ? detail::sigmoid(row[ids[k]]) : p[ids[k]];
    }
  }
  return out;
}

namespace detail {
// A router from outside the library (a test's table of given routings, a user's router):
// the reference has no formula of its own, so the router's own code on float32 logits is
// its definition.
template <class Router>
rank_routing own_routing(const Router& router, const rank_batch& b) {
  const layer_config& cfg = *b.cfg;
  const index_t T = b.tokens, E = cfg.experts;
  const index_t K = Router::top_k > 0 ? Router::top_k : E;
  std::vector<float> logits(static_cast<std::size_t>(T * E)), noise(logits.size());
  if constexpr (Router::uses_gate) {
    const auto l = project(b, b.w->gate);
    std::transform(l.begin(), l.end(), logits.begin(), [](double v) { return float(v); });
  }
  bool noisy = false;
  if constexpr (router_with_noise_gate<Router>) noisy = router.training;
  if (noisy) {
    const auto n = project(b, b.w->noise_gate);
    std::transform(n.begin(), n.end(), noise.begin(), [](double v) { return float(v); });
  }
  std::vector<std::int32_t> ids(static_cast<std::size_t>(T * K), no_expert);
  std::vector<float> weights(ids.size());
  if constexpr (token_router<Router>) {
    for (index_t t = 0; t < T; ++t)
      router.route_token(
          token_input{Router::uses_gate ? &logits[t * E] : nullptr, noisy ? &noise[t * E] : nullptr,
                      static_cast<int>(E), b.token[t], b.pass},
          &ids[t * K], &weights[t * K]);
  } else {
    std::vector<float> fs(Router::scratch_floats(cfg));
    std::vector<std::int32_t> is(Router::scratch_ints(cfg));
    router.route_batch(cfg, {logits.data(), T, E}, {{ids.data(), T, K}, {weights.data(), T, K}}, fs,
                       is);
  }
  rank_routing out(T, K);
  std::copy(ids.begin(), ids.end(), out.ids.begin());
  std::copy(weights.begin(), weights.end(), out.weights.begin());
  return out;
}
}  // namespace detail

/// The reference routing of one rank's batch: the formula above for a library router, the
/// router's own code for any other.
template <class Router>
rank_routing route_rank(const Router& router, const rank_batch& b) {
  if constexpr (requires(const Router& r, const rank_batch& x) { routing_of(r, x); }) {
    return routing_of(router, b);
  } else {
    static_assert(!library_router<Router>,
                  "reference/routing.hpp has no float64 formula for this epmoe router: add a "
                  "routing_of(const router::X&, const rank_batch&) overload written from its "
                  "definition");
    return detail::own_routing(router, b);
  }
}

/// Every rank's routing for one pass: x holds all ranks' tokens, rank after rank.
template <class Router>
std::vector<rank_routing> route_ranks(const full_weights& w, const Router& router,
                                      matrix_view<const float> x,
                                      std::span<const index_t> tokens_per_rank,
                                      const pass_options& opt = {}) {
  const layer_config cfg = w.cfg.router_view();  // the router scores E + Z experts
  const index_t H = cfg.hidden;
  std::vector<rank_routing> out;
  index_t t0 = 0;
  for (std::size_t r = 0; r < tokens_per_rank.size(); ++r) {
    rank_batch b{&cfg, &w, tokens_per_rank[r], {}, {}, opt.pass};
    b.x.resize(static_cast<std::size_t>(b.tokens * H));
    b.token.resize(static_cast<std::size_t>(b.tokens));
    for (index_t t = 0; t < b.tokens; ++t) {
      for (index_t h = 0; h < H; ++h) b.x[t * H + h] = x(t0 + t, h);
      // Without ids, a token's identity (noise, hashes) is its global position.
      b.token[t] = opt.token_ids.empty() ? static_cast<std::int64_t>(r) * cfg.max_tokens + t
                                         : opt.token_ids[t0 + t];
    }
    out.push_back(route_rank(router, b));
    t0 += b.tokens;
  }
  return out;
}

/// Assignments per expert over all ranks, before capacity (the load the bias update reads).
inline std::vector<index_t> expert_load(std::span<const rank_routing> ranks, int experts) {
  std::vector<index_t> load(static_cast<std::size_t>(experts), 0);
  for (const rank_routing& r : ranks)
    for (std::int32_t e : r.ids)
      if (e != no_expert) ++load[e];
  return load;
}

/// DeepSeek-V3's auxiliary-loss-free bias update (Wang et al. 2024) from its definition:
/// b_e += gamma · sign(mean_j load_j - load_e), on the global load of the last pass.
template <int K, class Score, router::select_on Select>
void update_bias(const router::biased<K, Score, Select>& r, std::span<float> bias,
                 std::span<const index_t> load) {
  const double mean =
      std::accumulate(load.begin(), load.end(), 0.0) / static_cast<double>(load.size());
  for (std::size_t e = 0; e < bias.size(); ++e) {
    const double gap = mean - static_cast<double>(load[e]);
    const double sign = gap > 0 ? 1.0 : (gap < 0 ? -1.0 : 0.0);
    bias[e] = static_cast<float>(double{bias[e]} + double{r.gamma} * sign);
  }
}

}  // namespace epmoe::reference

#include "epmoe/reference/routing_scored.hpp"  // needs the above
