// SPDX-FileCopyrightText: 2026 The epmoe authors
// SPDX-License-Identifier: Apache-2.0
#pragma once

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <istream>
#include <numeric>
#include <ostream>
#include <random>
#include <sstream>
#include <string>
#include <vector>

#include "epmoe/core/error.hpp"
#include "epmoe/core/random.hpp"
#include "epmoe/core/routing.hpp"
#include "epmoe/core/stats.hpp"

namespace epmoe::detail {
/// Expected assignments per expert of `tokens` tokens of top_k picks each, drawn by `load`
/// (sum `total`): the first pick's share (sampling without replacement flattens it a little).
inline std::vector<double> expected_load(const std::vector<double>& load, double total,
                                         index_t tokens, int top_k) {
  std::vector<double> v(load.size());
  const double scale = static_cast<double>(tokens) * top_k / total;
  for (std::size_t e = 0; e < v.size(); ++e) v[e] = load[e] * scale;
  return v;
}
}  // namespace epmoe::detail

// Token sources: what each simulated rank's router would answer, as expert ids [T, K] and
// weights. A source is deterministic per rank (seeded from (seed, rank)), so ranks can be
// simulated in any order and a layer run can be fed the very same routing.
namespace epmoe::sim {

/// Tokens drawn independently: each picks K distinct experts, expert e with probability
/// proportional to load[e] among those not yet picked (sampling without replacement, as a
/// top-k over noisy logits does). Uniform, Zipf and explicit load vectors are all this.
class weighted_source {
 public:
  weighted_source(std::vector<double> load, int top_k, index_t tokens_per_rank,
                  std::uint64_t seed = 1)
      : load_(std::move(load)), top_k_(top_k), tokens_(tokens_per_rank), seed_(seed) {
    const int E = experts();
    epmoe::detail::require(E >= 1, "source.load", E, "must name at least one expert");
    epmoe::detail::require(top_k >= 1 && top_k <= E, "source.top_k", top_k,
                           "must be in [1, experts]");
    epmoe::detail::require(tokens_per_rank >= 0, "source.tokens", tokens_per_rank, "must be >= 0");
    int positive = 0;
    for (double l : load_) {
      epmoe::detail::require(std::isfinite(l) && l >= 0, "source.load", l,
                             "must be finite and >= 0");
      positive += l > 0;
    }
    epmoe::detail::require(positive >= top_k, "source.load", positive,
                           "needs at least top_k experts with a load > 0");
    cdf_.resize(load_.size());
    std::partial_sum(load_.begin(), load_.end(), cdf_.begin());
    build_alias();
  }

  int experts() const { return static_cast<int>(load_.size()); }
  int top_k() const { return top_k_; }
  index_t tokens(int /*rank*/) const { return tokens_; }
  /// Expected assignments per expert of one rank's tokens (the first pick's share; with
  /// K > 1 sampling without replacement flattens it a little): what a balancer plans from.
  std::vector<double> expected_load() const {
    return epmoe::detail::expected_load(load_, cdf_.back(), tokens_, top_k_);
  }

  /// Fills ids and weights [tokens(rank), K] for `rank`.
  void route(int rank, mutable_routing_view out) const {
    // Counter-based: splitmix64 from (seed, rank); one draw picks a column of the alias table
    // (high bits) and a coin against its integer threshold (low bits): O(1) per pick.
    std::uint64_t state =
        math::hash4(seed_, static_cast<std::uint64_t>(rank), 0x736f75726365ull, 0);
    const auto E = static_cast<std::uint64_t>(experts());
    const int K = top_k_;
    for (index_t t = 0; t < out.tokens(); ++t) {
      std::int32_t* ids = &out.ids(t, 0);
      for (int k = 0; k < K; ++k) {
        int e;
        do {  // rejection of repeats: cheap while K is small next to the experts that carry load
          const std::uint64_t u = splitmix64(state);
          const auto i = static_cast<int>(((u >> 32) * E) >> 32);
          const int keep = -static_cast<int>((u & 0xffffffffu) < threshold_[i]);  // 0 or ~0
          e = alias_[i] ^ ((i ^ alias_[i]) & keep);  // branch-free: the coin is unpredictable
        } while (std::find(ids, ids + k, e) != ids + k);
        ids[k] = e;
        out.weights(t, k) = 1.f / static_cast<float>(K);
      }
    }
  }

 private:
  static std::uint64_t splitmix64(std::uint64_t& x) {
    std::uint64_t z = (x += 0x9e3779b97f4a7c15ull);
    z = (z ^ (z >> 30)) * 0xbf58476d1ce4e5b9ull;
    z = (z ^ (z >> 27)) * 0x94d049bb133111ebull;
    return z ^ (z >> 31);
  }
  // Vose's alias table: column i keeps expert i with probability prob_[i], else alias_[i].
  void build_alias() {
    const int E = experts();
    prob_.assign(static_cast<std::size_t>(E), 0.0);
    alias_.assign(static_cast<std::size_t>(E), 0);
    std::vector<double> scaled(static_cast<std::size_t>(E));
    std::vector<int> small, large;
    for (int e = 0; e < E; ++e) {
      scaled[e] = load_[e] * E / cdf_.back();
      (scaled[e] < 1 ? small : large).push_back(e);
    }
    while (!small.empty() && !large.empty()) {
      const int s = small.back(), l = large.back();
      small.pop_back();
      prob_[s] = scaled[s];
      alias_[s] = l;
      scaled[l] -= 1 - scaled[s];
      if (scaled[l] < 1) {
        large.pop_back();
        small.push_back(l);
      }
    }
    for (int e : large) prob_[e] = 1, alias_[e] = e;
    // Rounding leftovers: keep a positive-load column whole, send a zero-load one elsewhere.
    const int heaviest =
        static_cast<int>(std::max_element(load_.begin(), load_.end()) - load_.begin());
    for (int e : small) {
      prob_[e] = load_[e] > 0 ? 1 : 0;
      alias_[e] = load_[e] > 0 ? e : heaviest;
    }
    // Keep column i when the low 32 bits x satisfy x * 2^-32 < prob, i.e. x < ceil(prob * 2^32).
    threshold_.resize(prob_.size());
    for (std::size_t e = 0; e < prob_.size(); ++e)
      threshold_[e] = static_cast<std::uint64_t>(std::ceil(prob_[e] * 0x1p32));
  }
  std::vector<double> prob_;
  std::vector<std::uint64_t> threshold_;
  std::vector<int> alias_;
  std::vector<double> load_, cdf_;
  int top_k_;
  index_t tokens_;
  std::uint64_t seed_;
};

inline weighted_source uniform(int experts, int top_k, index_t tokens_per_rank,
                               std::uint64_t seed = 1) {
  return {std::vector<double>(static_cast<std::size_t>(experts), 1.0), top_k, tokens_per_rank,
          seed};
}

/// Zipf skew: the i-th most popular expert gets load 1 / (i+1)^exponent. Which expert is
/// i-th is a seeded shuffle (shuffle = false: expert i itself), since a trained router's hot
/// experts do not sit next to each other, and block placement would otherwise put all of
/// them on rank 0.
inline std::vector<double> zipf_load(int experts, double exponent, std::uint64_t seed = 1,
                                     bool shuffle = true) {
  std::vector<int> order(static_cast<std::size_t>(experts));
  std::iota(order.begin(), order.end(), 0);
  if (shuffle) std::shuffle(order.begin(), order.end(), std::mt19937_64(seed ^ 0x7a697066ull));
  std::vector<double> load(order.size());
  for (int i = 0; i < experts; ++i) load[order[i]] = 1.0 / std::pow(double(i + 1), exponent);
  return load;
}

inline weighted_source zipf(int experts, double exponent, int top_k, index_t tokens_per_rank,
                            std::uint64_t seed = 1, bool shuffle = true) {
  return {zipf_load(experts, exponent, seed, shuffle), top_k, tokens_per_rank, seed};
}

/// Group-limited routing, as DeepSeek-V3 sends each token to at most 4 of its 8 nodes: the
/// experts form `groups` contiguous equal groups; a token picks `top_groups` distinct groups
/// (group g with probability proportional to its summed load, among those not yet picked),
/// then K distinct experts of those groups (expert e proportional to load[e]). With groups =
/// nodes and block placement, a token reaches at most top_groups nodes.
class group_limited_source {
 public:
  group_limited_source(std::vector<double> load, int top_k, index_t tokens_per_rank, int groups,
                       int top_groups, std::uint64_t seed = 1)
      : load_(std::move(load)),
        top_k_(top_k),
        groups_(groups),
        top_groups_(top_groups),
        tokens_(tokens_per_rank),
        seed_(seed) {
    using epmoe::detail::require;
    const int E = experts();
    require(groups >= 1 && E % groups == 0, "source.groups", groups,
            "must be >= 1 and divide the experts (groups are contiguous and equal)");
    require(top_groups >= 1 && top_groups <= groups, "source.top_groups", top_groups,
            "must be in [1, groups]");
    require(top_k >= 1 && top_k <= E, "source.top_k", top_k, "must be in [1, experts]");
    require(tokens_per_rank >= 0, "source.tokens", tokens_per_rank, "must be >= 0");
    const int S = E / groups;
    cdf_.resize(load_.size());
    group_cdf_.resize(static_cast<std::size_t>(groups));
    last_.assign(static_cast<std::size_t>(groups), -1);
    std::vector<int> positive;  // experts with a load, per group that has any
    double sum = 0;
    for (int g = 0; g < groups; ++g) {
      int n = 0;
      for (int e = g * S; e < (g + 1) * S; ++e) {
        require(std::isfinite(load_[e]) && load_[e] >= 0, "source.load", load_[e],
                "must be finite and >= 0");
        cdf_[e] = sum += load_[e];
        if (load_[e] > 0) ++n, last_[g] = e;
      }
      group_cdf_[g] = sum;
      if (n > 0) positive.push_back(n);
    }
    // Every choice of groups must hold K experts with a load: the top_groups smallest do.
    std::sort(positive.begin(), positive.end());
    const int fewest = static_cast<int>(positive.size()) < top_groups
                           ? 0
                           : std::accumulate(positive.begin(), positive.begin() + top_groups, 0);
    require(fewest >= top_k, "source.load", fewest,
            "every top_groups groups with a load need top_k experts with a load > 0");
  }

  int experts() const { return static_cast<int>(load_.size()); }
  int top_k() const { return top_k_; }
  int groups() const { return groups_; }
  int top_groups() const { return top_groups_; }
  index_t tokens(int /*rank*/) const { return tokens_; }
  /// Expected assignments per expert of one rank's tokens, as weighted_source's (exact for
  /// groups of equal load; otherwise the group limit moves load towards the heavy groups).
  std::vector<double> expected_load() const {
    return epmoe::detail::expected_load(load_, cdf_.back(), tokens_, top_k_);
  }

  /// Fills ids and weights [tokens(rank), K] for `rank`.
  void route(int rank, mutable_routing_view out) const {
    std::uint64_t state = math::hash4(seed_, static_cast<std::uint64_t>(rank), 0x67726f7570ull, 0);
    const int K = top_k_, S = experts() / groups_;
    std::vector<int> picked(static_cast<std::size_t>(top_groups_));
    std::vector<double> mass(picked.size());  // cumulative load of the picked groups
    for (index_t t = 0; t < out.tokens(); ++t) {
      for (int i = 0; i < top_groups_; ++i) {
        int g;
        do {  // rejection of repeats (a picked group keeps its share)
          g = pick(group_cdf_.data(), 0, groups_, uniform(state) * group_cdf_.back());
          if (g >= groups_ || last_[g] < 0) g = last_group();
        } while (std::find(picked.begin(), picked.begin() + i, g) != picked.begin() + i);
        picked[i] = g;
        mass[i] = (i ? mass[i - 1] : 0.0) + group_load(g);
      }
      std::int32_t* ids = &out.ids(t, 0);
      for (int k = 0; k < K; ++k) {
        int e;
        do {
          const double u = uniform(state) * mass.back();
          int i = 0;
          while (i + 1 < top_groups_ && mass[i] <= u) ++i;
          const int g = picked[i];
          const double base = g ? group_cdf_[g - 1] : 0.0;
          e = pick(cdf_.data(), g * S, (g + 1) * S, base + (u - (i ? mass[i - 1] : 0.0)));
          if (e >= (g + 1) * S) e = last_[g];  // rounding at the group's end
        } while (std::find(ids, ids + k, e) != ids + k);
        ids[k] = e;
        out.weights(t, k) = 1.f / static_cast<float>(K);
      }
    }
  }

 private:
  static double uniform(std::uint64_t& x) {  // [0, 1), 53 bits of splitmix64
    std::uint64_t z = (x += 0x9e3779b97f4a7c15ull);
    z = (z ^ (z >> 30)) * 0xbf58476d1ce4e5b9ull;
    z = (z ^ (z >> 27)) * 0x94d049bb133111ebull;
    return static_cast<double>((z ^ (z >> 31)) >> 11) * 0x1p-53;
  }
  // The first index in [lo, hi) whose cumulative load exceeds `x` (zero loads never win).
  static int pick(const double* cdf, int lo, int hi, double x) {
    return static_cast<int>(std::upper_bound(cdf + lo, cdf + hi, x) - cdf);
  }
  double group_load(int g) const { return group_cdf_[g] - (g ? group_cdf_[g - 1] : 0.0); }
  int last_group() const {
    int g = groups_ - 1;
    while (last_[g] < 0) --g;
    return g;
  }
  std::vector<double> load_, cdf_, group_cdf_;
  std::vector<int> last_;  // [groups]: its last expert with a load, -1 if none
  int top_k_, groups_, top_groups_;
  index_t tokens_;
  std::uint64_t seed_;
};

// --- recorded stats: one JSON object per line, per (pass, rank) ---

/// One rank's routing counts of one pass, as the layer's pass_stats holds them.
struct stats_record {
  int pass = 0;
  int rank = 0;
  index_t tokens = 0;
  int top_k = 0;
  std::vector<index_t> routed_per_expert;  // [E]
};

/// Writes `{"pass":P,"rank":R,"tokens":T,"top_k":K,"routed_per_expert":[...]}` and a newline:
/// every rank appends its line after each forward (layer.stats()), one file per run.
inline void write_stats_line(std::ostream& os, int pass, int rank, int top_k, const pass_stats& s) {
  os << "{\"pass\":" << pass << ",\"rank\":" << rank << ",\"tokens\":" << s.tokens
     << ",\"top_k\":" << top_k << ",\"routed_per_expert\":[";
  for (std::size_t e = 0; e < s.routed_per_expert.size(); ++e)
    os << (e ? "," : "") << s.routed_per_expert[e];
  os << "]}\n";
}

/// Reads the lines write_stats_line wrote (keys in any order; other keys are skipped).
inline std::vector<stats_record> read_stats(std::istream& is) {
  std::vector<stats_record> out;
  std::string line;
  int n = 0;
  while (std::getline(is, line)) {
    ++n;
    if (line.find_first_not_of(" \t\r") == std::string::npos) continue;
    stats_record r;
    auto bad = [&](const char* what) {
      return config_error("stats line " + std::to_string(n), line.substr(0, 60), what);
    };
    auto number_after = [&](const char* key, bool need) -> long long {
      const auto k = line.find(std::string("\"") + key + "\"");
      if (k == std::string::npos) {
        if (need) throw bad("missing key");
        return 0;
      }
      const auto colon = line.find(':', k);
      if (colon == std::string::npos) throw bad("expected key: value");
      return std::stoll(line.substr(colon + 1));
    };
    r.pass = static_cast<int>(number_after("pass", false));
    r.rank = static_cast<int>(number_after("rank", true));
    r.tokens = static_cast<index_t>(number_after("tokens", true));
    r.top_k = static_cast<int>(number_after("top_k", true));
    const auto k = line.find("\"routed_per_expert\"");
    const auto open = line.find('[', k), close = line.find(']', open);
    if (k == std::string::npos || open == std::string::npos || close == std::string::npos)
      throw bad("missing routed_per_expert array");
    std::string list = line.substr(open + 1, close - open - 1);
    std::replace(list.begin(), list.end(), ',', ' ');
    std::istringstream v(list);
    for (long long c; v >> c;) r.routed_per_expert.push_back(static_cast<index_t>(c));
    out.push_back(std::move(r));
  }
  return out;
}

/// Replays one recorded pass: rank r routes exactly routed_per_expert[e] of its tokens to
/// each expert e (with K distinct experts per token; assignments beyond the recorded ones,
/// e.g. expert choice's empty slots, stay empty). Token order is a seeded shuffle so a
/// chunked schedule sees the experts mixed over the pass, as real tokens are.
class recorded_source {
 public:
  recorded_source(std::vector<stats_record> records, int pass = 0, std::uint64_t seed = 1)
      : seed_(seed) {
    for (auto& r : records) {
      if (r.pass != pass) continue;
      epmoe::detail::require(r.rank >= 0 && r.rank < 1 << 20, "stats.rank", r.rank, "out of range");
      if (static_cast<int>(by_rank_.size()) <= r.rank) by_rank_.resize(r.rank + 1);
      top_k_ = std::max(top_k_, r.top_k);
      experts_ = std::max(experts_, static_cast<int>(r.routed_per_expert.size()));
      by_rank_[r.rank] = std::move(r);
    }
    epmoe::detail::require(!by_rank_.empty(), "stats.pass", pass, "no record of this pass");
  }
  int ranks() const { return static_cast<int>(by_rank_.size()); }
  int experts() const { return experts_; }
  int top_k() const { return top_k_; }
  index_t tokens(int rank) const { return by_rank_.at(rank).tokens; }
  std::vector<double> expected_load() const {
    std::vector<double> v(static_cast<std::size_t>(experts_), 0.0);
    for (const auto& r : by_rank_)
      for (std::size_t e = 0; e < r.routed_per_expert.size(); ++e)
        v[e] += static_cast<double>(r.routed_per_expert[e]);
    for (double& x : v) x /= static_cast<double>(by_rank_.size());
    return v;
  }

  void route(int rank, mutable_routing_view out) const {
    const stats_record& r = by_rank_.at(rank);
    const index_t T = out.tokens(), K = out.top_k();
    for (index_t t = 0; t < T; ++t)
      for (index_t k = 0; k < K; ++k) out.ids(t, k) = no_expert, out.weights(t, k) = 0.f;
    // Column-major fill: expert e's c <= T assignments land on c consecutive tokens of one
    // or two columns, so a token never gets the same expert twice.
    index_t i = 0;
    for (std::size_t e = 0; e < r.routed_per_expert.size(); ++e) {
      const index_t c = r.routed_per_expert[e];
      if (c > T)
        throw config_error("stats.routed_per_expert", std::to_string(c),
                           "an expert gets at most one row per token");
      if (i + c > T * K)
        throw config_error("stats.routed_per_expert", std::to_string(i + c),
                           "more assignments than tokens * top_k");
      for (index_t n = 0; n < c; ++n, ++i) {
        out.ids(i % T, i / T) = static_cast<std::int32_t>(e);
        out.weights(i % T, i / T) = 1.f / static_cast<float>(K);
      }
    }
    std::mt19937_64 rng(math::hash4(seed_, static_cast<std::uint64_t>(rank), 0x7265706cull, 0));
    for (index_t t = T - 1; t > 0; --t) {  // shuffle whole tokens (rows of ids and weights)
      const auto u = static_cast<index_t>(rng() % static_cast<std::uint64_t>(t + 1));
      for (index_t k = 0; k < K; ++k) {
        std::swap(out.ids(t, k), out.ids(u, k));
        std::swap(out.weights(t, k), out.weights(u, k));
      }
    }
  }

 private:
  std::vector<stats_record> by_rank_;
  int top_k_ = 0, experts_ = 0;
  std::uint64_t seed_;
};

}  // namespace epmoe::sim
