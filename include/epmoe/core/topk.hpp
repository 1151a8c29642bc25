// SPDX-FileCopyrightText: 2026 The epmoe authors
// SPDX-License-Identifier: Apache-2.0
#pragma once

#include <cmath>
#include <cstdint>

#include "epmoe/core/macros.hpp"

// Per-token selection math shared by every router, on host and device.
namespace epmoe::math {

/// Selection key: NaN ranks like -inf (never above a number), so ids stay valid whatever
/// the input; a NaN logit makes its token's weights NaN anyway.
EPMOE_HD float selection_key(float x) { return x != x ? -INFINITY : x; }

/// Inserts (x, i) into the descending list keys/ids of `count` entries (at most K).
/// Ties keep the earlier index first.
template <int K>
EPMOE_HD void insert_top(float x, int i, int& count, int* ids, float* keys) {
  if (count == K && !(x > keys[K - 1])) return;
  int p = count < K ? count++ : K - 1;
  while (p > 0 && x > keys[p - 1]) {
    keys[p] = keys[p - 1];
    ids[p] = ids[p - 1];
    --p;
  }
  keys[p] = x;
  ids[p] = i;
}

/// The K largest of v[0..n) (K <= n), descending; ties keep the lower index first.
/// One pass of insertion into a K-long sorted list: O(n*K), registers only, so one GPU
/// thread can run it per token.
template <int K>
EPMOE_HD void top_k(const float* v, int n, int* ids, float* keys) {
  int count = 0;
  for (int i = 0; i < n; ++i) insert_top<K>(selection_key(v[i]), i, count, ids, keys);
}

/// Most expert groups group-limited selection supports (one bit each in a mask).
inline constexpr int max_groups = 64;

/// Top-K of key(e) over e in [0, n), limited to the best `top_groups` of `groups` equal,
/// contiguous expert groups (DeepSeek-V3 node-limited routing). A group scores
/// pair(a, b) of its two best keys a >= b (a alone if it has one expert); ties go to the lower
/// group. groups == 1 is plain top-K. Requires n % groups == 0, K <= top_groups * n / groups.
/// An expert of a dropped group takes no part when `dropped` is -inf (DeepSeek's masking), else
/// competes with the key `dropped` (Hugging Face's masked_fill(~mask, 0.0): dropped = 0).
template <int K, class KeyFn, class PairFn>
EPMOE_HD void group_top_k(KeyFn key, PairFn pair, int n, int groups, int top_groups, int* ids,
                          float* keys, float dropped = -INFINITY) {
  std::uint64_t kept = ~std::uint64_t{0};
  if (groups > 1 && top_groups < groups) {
    const int size = n / groups;
    kept = 0;
    // Pick the top_groups best groups one at a time (groups <= 64: cheap, no arrays).
    for (int round = 0; round < top_groups; ++round) {
      int best = -1;
      float best_score = 0.f;
      for (int g = 0; g < groups; ++g) {
        if (kept >> g & 1) continue;
        float a = -INFINITY, b = -INFINITY;  // two best keys of group g
        for (int e = g * size; e < (g + 1) * size; ++e) {
          const float x = selection_key(key(e));
          if (x > a) {
            b = a;
            a = x;
          } else if (x > b) {
            b = x;
          }
        }
        const float score = size > 1 ? selection_key(pair(a, b)) : a;
        if (best < 0 || score > best_score) {
          best = g;
          best_score = score;
        }
      }
      kept |= std::uint64_t{1} << best;
    }
  }
  const int size = n / (groups > 0 ? groups : 1);
  int count = 0;
  for (int e = 0; e < n; ++e)
    if (kept >> (e / size) & 1)
      insert_top<K>(selection_key(key(e)), e, count, ids, keys);
    else if (dropped != -INFINITY)
      insert_top<K>(dropped, e, count, ids, keys);
}

/// Group score of its best key alone (DeepSeek-V2: max over the group).
struct pair_first {
  EPMOE_HD float operator()(float a, float) const { return a; }
};

/// Group score for additive scores (sigmoid): a + b.
struct pair_sum {
  EPMOE_HD float operator()(float a, float b) const { return a + b; }
};

/// Group score for logits whose probabilities add (softmax): log(e^a + e^b), which orders
/// groups as p_a + p_b does without underflowing where e^(a - max) would.
struct pair_log_sum_exp {
  EPMOE_HD float operator()(float a, float b) const {
    return b == -INFINITY ? a : a + log1pf(expf(b - a));
  }
};

/// e^(x - max): the stable softmax numerator.
EPMOE_HD float shifted_exp(float x, float max) { return expf(x - max); }

EPMOE_HD float sigmoid(float x) { return 1.f / (1.f + expf(-x)); }

/// p = softmax(l) over n logits, shifted by their max (the routers' P_i for the losses).
EPMOE_HD void softmax(const float* l, int n, float* p) {
  float max = -INFINITY;
  for (int e = 0; e < n; ++e) max = l[e] > max ? l[e] : max;
  float denom = 0.f;
  for (int e = 0; e < n; ++e) denom += (p[e] = shifted_exp(l[e], max));
  for (int e = 0; e < n; ++e) p[e] /= denom;
}

/// The backward of weights w_k = c softmax(l)_{ids[k]} (n slots; ids < 0 are empty): with
/// p = softmax(l) over all E and dp = c g at the chosen experts, dl = p ⊙ (dp - p · dp), so
/// dl_e = c p_e (g_e - Σ_k g_k p_{ids[k]}), g_e = 0 for an expert not chosen. Overwrites dl.
EPMOE_HD void softmax_backward_at(const float* l, int E, const int* ids, const float* g, int n,
                                  float c, float* dl) {
  float max = -INFINITY, denom = 0.f, gp = 0.f;
  for (int e = 0; e < E; ++e) max = l[e] > max ? l[e] : max;
  for (int e = 0; e < E; ++e) denom += shifted_exp(l[e], max);
  for (int k = 0; k < n; ++k)
    if (ids[k] >= 0) gp += g[k] * shifted_exp(l[ids[k]], max) / denom;
  for (int e = 0; e < E; ++e) dl[e] = -c * gp * shifted_exp(l[e], max) / denom;
  for (int k = 0; k < n; ++k)
    if (ids[k] >= 0) dl[ids[k]] += c * g[k] * shifted_exp(l[ids[k]], max) / denom;
}

/// dl[E] += the backward of p = softmax(l) for dL/dp = dp: p ⊙ (dp - p · dp) (the losses'
/// gradient through a softmax router's probabilities).
EPMOE_HD void softmax_probabilities_backward(const float* l, int E, const float* dp, float* dl) {
  float max = -INFINITY, denom = 0.f, pdp = 0.f;
  for (int e = 0; e < E; ++e) max = l[e] > max ? l[e] : max;
  for (int e = 0; e < E; ++e) denom += shifted_exp(l[e], max);
  for (int e = 0; e < E; ++e) pdp += shifted_exp(l[e], max) / denom * dp[e];
  for (int e = 0; e < E; ++e) dl[e] += shifted_exp(l[e], max) / denom * (dp[e] - pdp);
}

/// log(sum_e exp(v[e])), stable.
EPMOE_HD float log_sum_exp(const float* v, int n) {
  float m = -INFINITY;
  for (int e = 0; e < n; ++e) m = v[e] > m ? v[e] : m;
  float s = 0.f;
  for (int e = 0; e < n; ++e) s += expf(v[e] - m);
  return m + logf(s);
}

}  // namespace epmoe::math
