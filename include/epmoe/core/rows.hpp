// SPDX-FileCopyrightText: 2026 The epmoe authors
// SPDX-License-Identifier: Apache-2.0
#pragma once

#include <cstdint>

#include "epmoe/core/macros.hpp"
#include "epmoe/core/numeric.hpp"
#include "epmoe/core/routing.hpp"
#include "epmoe/core/view.hpp"

// Per-row and per-token functors of the forward pass, run by a space's for_each on host or
// device: the math of permute, routing and the weighted combine exists once. Row functors
// take (row, h0, h1) and do columns [h0, h1) of that row: the host hands out whole rows, a
// device pieces of rows. Sums run in float whatever the element type.
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
  const std::uint64_t* pass_counter = nullptr;  // the pass read on the device, else `pass`
  EPMOE_HD void operator()(index_t t) const {
    const token_input in{logits.data ? logits.row(t) : nullptr, noise.data ? noise.row(t) : nullptr,
                         experts, token_ids ? token_ids[t] : first_token + t,
                         pass_counter ? *pass_counter : pass};
    router.route_token(in, ids.row(t), weights.row(t));
  }
};

/// ++counter (the pass counter, in the space's memory).
struct advance {
  std::uint64_t* counter;
  EPMOE_HD void operator()(index_t) const { ++*counter; }
};

/// Send row i = token row_token[i] of x, or zeros for a padding row.
template <class T>
struct gather {
  matrix_view<const T> x;         // [T, H]
  const std::int32_t* row_token;  // [rows]
  matrix_view<T> out;             // [rows, H]
  EPMOE_HD void operator()(index_t i, index_t h0, index_t h1) const {
    const std::int32_t t = row_token[i];
    T* o = out.row(i);
    if (t < 0) {
      for (index_t h = h0; h < h1; ++h) o[h] = from_float<T>(0.f);
    } else {
      const T* src = x.row(t);
      for (index_t h = h0; h < h1; ++h) o[h] = src[h];
    }
  }
};

/// out row i = x row i.
template <class T>
struct copy {
  matrix_view<const T> x;
  matrix_view<T> out;
  EPMOE_HD void operator()(index_t i, index_t h0, index_t h1) const {
    const T* src = x.row(i);
    T* o = out.row(i);
    for (index_t h = h0; h < h1; ++h) o[h] = src[h];
  }
};

/// into [rows, H] (float) = base + s_i x (first) or += s_i x: the home rank's terms (shared
/// experts, each scaled by s_i when `scale` is given; an output bias `base` [H]) in float.
template <class T>
struct accumulate {
  matrix_view<const T> x;  // null data: nothing to add (base alone)
  float* into;
  bool first;
  const float* scale = nullptr;  // [rows] or null (1)
  const T* base = nullptr;       // [H] or null (0), with first
  EPMOE_HD void operator()(index_t i, index_t h0, index_t h1) const {
    float* o = into + i * x.cols;
    const float s = scale ? scale[i] : 1.f;
    for (index_t h = h0; h < h1; ++h) {
      const float add = x.data ? s * to_float(x.row(i)[h]) : 0.f;
      o[h] = (first ? (base ? to_float(base[h]) : 0.f) : o[h]) + add;
    }
  }
};

/// scale[t] = sigmoid(x[t] · g): Qwen2-MoE's per-token gate of a shared expert.
template <class T>
struct sigmoid_dot {
  matrix_view<const T> x;
  const T* g;  // [H]
  float* scale;
  EPMOE_HD void operator()(index_t t) const {
    const T* row = x.row(t);
    float d = 0.f;
    for (index_t h = 0; h < x.cols; ++h) d += to_float(row[h]) * to_float(g[h]);
    scale[t] = 1.f / (1.f + expf(-d));
  }
};

/// Columns are summed in pieces of `piece` floats held in registers: the sum over k of one
/// piece vectorises on the host, and a device thread's piece fits.
inline constexpr index_t piece = 8;

/// y[t] = sum_k weight[t,k] * back[slot[t,k]] over the assignments not dropped (+ the shared
/// experts' sum, when given).
template <class T>
struct weighted_reduce {
  matrix_view<const T> back;          // [send rows, H]: expert outputs, home again
  const std::int32_t* slot;           // [T*K]
  matrix_view<const float> weights;   // [T, K]
  const float* shared;                // [T, H] or nullptr
  matrix_view<T> y;                   // [T, H]
  const index_t* verdicts = nullptr;  // every rank's 1/0 (inputs accepted), `stride` apart:
  index_t stride = 0;                 //   with one 0 nothing is written (static shapes)
  int ranks = 0;
  EPMOE_HD void operator()(index_t t, index_t h0, index_t h1) const {
    const index_t K = weights.cols;
    for (int r = 0; verdicts && r < ranks; ++r)
      if (verdicts[r * stride] == 0) return;
    for (index_t h = h0; h < h1; h += piece) {
      const index_t n = h1 - h < piece ? h1 - h : piece;
      float acc[piece] = {};
      for (index_t k = 0; k < K; ++k) {
        const std::int32_t s = slot[t * K + k];
        if (s < 0) continue;  // dropped: contributes nothing
        const float w = weights(t, k);
        const T* src = back.row(s) + h;
        for (index_t j = 0; j < n; ++j) acc[j] += w * to_float(src[j]);
      }
      T* out = y.row(t) + h;
      for (index_t j = 0; j < n; ++j)
        out[j] = from_float<T>(shared ? acc[j] + shared[t * y.cols + h + j] : acc[j]);
    }
  }
};

/// Dedup: y[t] = sum of t's unique rows (one per rank it went to; weights were applied on
/// the expert rank), + the shared experts' sum when given. Assignments sharing a unique row
/// count it once.
template <class T>
struct sum_unique {
  matrix_view<const T> back;        // [unique rows, H]
  const std::int32_t* unique_slot;  // [T*K]
  index_t K;
  const float* shared;  // [T, H] or nullptr
  matrix_view<T> y;     // [T, H]
  EPMOE_HD void operator()(index_t t, index_t h0, index_t h1) const {
    for (index_t h = h0; h < h1; h += piece) {
      const index_t n = h1 - h < piece ? h1 - h : piece;
      float acc[piece] = {};
      for (index_t k = 0; k < K; ++k) {
        const std::int32_t u = unique_slot[t * K + k];
        bool seen = u < 0;
        for (index_t q = 0; q < k && !seen; ++q) seen = unique_slot[t * K + q] == u;
        if (seen) continue;
        const T* src = back.row(u) + h;
        for (index_t j = 0; j < n; ++j) acc[j] += to_float(src[j]);
      }
      T* out = y.row(t) + h;
      for (index_t j = 0; j < n; ++j)
        out[j] = from_float<T>(shared ? acc[j] + shared[t * y.cols + h + j] : acc[j]);
    }
  }
};

}  // namespace epmoe::rows
