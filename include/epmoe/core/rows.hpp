// SPDX-FileCopyrightText: 2026 The epmoe authors
// SPDX-License-Identifier: Apache-2.0
#pragma once

#include <cstdint>

#include "epmoe/core/macros.hpp"
#include "epmoe/core/routing.hpp"
#include "epmoe/core/view.hpp"

// Per-row and per-token functors of the forward pass, run by a space's for_each on host or
// device: the math of permute, routing and the weighted combine exists once.
namespace epmoe::rows {

/// Routes token t: router.route_token over what the router sees of it.
template <class Router>
struct route_tokens {
  Router router;
  matrix_view<const float> logits;  // [T, E]; empty for gate-less routers
  matrix_view<const float> noise;   // [T, E] noise-gate logits, or empty
  matrix_view<std::int32_t> ids;    // [T, K]
  matrix_view<float> weights;       // [T, K]
  const std::int64_t* token_ids;    // [T] or nullptr: then first_token + t
  std::int64_t first_token;
  std::uint64_t pass;
  int experts;
  EPMOE_HD void operator()(index_t t) const {
    const token_input in{logits.data ? logits.row(t) : nullptr, noise.data ? noise.row(t) : nullptr,
                         experts, token_ids ? token_ids[t] : first_token + t, pass};
    router.route_token(in, ids.row(t), weights.row(t));
  }
};

/// Send row i = token row_token[i] of x, or zeros for a padding row.
struct gather {
  matrix_view<const float> x;     // [T, H]
  const std::int32_t* row_token;  // [rows]
  matrix_view<float> out;         // [rows, H]
  EPMOE_HD void operator()(index_t i) const {
    const std::int32_t t = row_token[i];
    float* o = out.row(i);
    if (t < 0) {
      for (index_t h = 0; h < out.cols; ++h) o[h] = 0.f;
    } else {
      const float* src = x.row(t);
      for (index_t h = 0; h < out.cols; ++h) o[h] = src[h];
    }
  }
};

/// y[t] = sum_k weight[t,k] * back[slot[t,k]] over the assignments not dropped.
struct weighted_reduce {
  matrix_view<const float> back;     // [send rows, H]: expert outputs, home again
  const std::int32_t* slot;          // [T*K]
  matrix_view<const float> weights;  // [T, K]
  matrix_view<float> y;              // [T, H]
  EPMOE_HD void operator()(index_t t) const {
    const index_t K = weights.cols;
    float* out = y.row(t);
    for (index_t h = 0; h < y.cols; ++h) out[h] = 0.f;
    for (index_t k = 0; k < K; ++k) {
      const std::int32_t s = slot[t * K + k];
      if (s < 0) continue;  // dropped: contributes nothing
      const float w = weights(t, k);
      const float* src = back.row(s);
      for (index_t h = 0; h < y.cols; ++h) out[h] += w * src[h];
    }
  }
};

/// Dedup: y[t] = sum of t's unique rows (one per rank it went to; weights were applied on
/// the expert rank). Assignments sharing a unique row count it once.
struct sum_unique {
  matrix_view<const float> back;    // [unique rows, H]
  const std::int32_t* unique_slot;  // [T*K]
  index_t K;
  matrix_view<float> y;  // [T, H]
  EPMOE_HD void operator()(index_t t) const {
    float* out = y.row(t);
    for (index_t h = 0; h < y.cols; ++h) out[h] = 0.f;
    for (index_t k = 0; k < K; ++k) {
      const std::int32_t u = unique_slot[t * K + k];
      bool seen = u < 0;
      for (index_t q = 0; q < k && !seen; ++q) seen = unique_slot[t * K + q] == u;
      if (seen) continue;
      const float* src = back.row(u);
      for (index_t h = 0; h < y.cols; ++h) out[h] += src[h];
    }
  }
};

}  // namespace epmoe::rows
