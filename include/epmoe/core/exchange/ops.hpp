// SPDX-FileCopyrightText: 2026 The epmoe authors
// SPDX-License-Identifier: Apache-2.0
#pragma once

#include <cstdint>

#include "epmoe/core/macros.hpp"
#include "epmoe/core/numeric.hpp"
#include "epmoe/core/plan.hpp"
#include "epmoe/core/rows.hpp"
#include "epmoe/core/view.hpp"

// The exchange's per-row and per-element math, written once as EPMOE_HD functors that every
// space runs (host loops, device kernels): dedup's expansion and weighted sums, the
// hierarchical fan-out and its sums, and dedup's routing-weight gradient.
namespace epmoe::exchange_ops {

/// The block b in [b0, b0 + n) whose rows [offsets[b], offsets[b+1]) hold `row`.
EPMOE_HD index_t block_of(const index_t* offsets, index_t b0, index_t n, index_t row) {
  index_t lo = b0, hi = b0 + n;  // the first offset past row, minus one
  while (lo < hi) {
    const index_t mid = lo + (hi - lo) / 2;
    if (offsets[mid + 1] <= row)
      lo = mid + 1;
    else
      hi = mid;
  }
  return lo;
}

/// Dedup, received assignment row i of chunk c: its unique row's index within the chunk's
/// unique rows (the key of the weighted sums) and its row among the chunk's expert rows.
struct unique_of_row {
  const index_t* recv_offsets;
  const index_t* regroup_offsets;
  const index_t* recv_unique_offsets;
  const index_t* expert_offsets;
  const std::int64_t* meta;  // the chunk's received metadata
  int c, R, L;
  std::int32_t* key;
  index_t* expert_row;
  EPMOE_HD void operator()(index_t i) const {
    const index_t b0 = static_cast<index_t>(c) * R * L, first = recv_offsets[b0];
    const index_t row = first + i, b = block_of(recv_offsets, b0, static_cast<index_t>(R) * L, row);
    const int s = static_cast<int>((b / L) % R);
    key[i] = static_cast<std::int32_t>(recv_unique_offsets[c * R + s] - recv_unique_offsets[c * R] +
                                       meta_index(meta[i]));
    expert_row[i] = regroup_offsets[b] + (row - recv_offsets[b]) - expert_offsets[c * L];
  }
};

/// Dedup: each received assignment row's expert-major row <- its unique row.
template <class T>
struct expand_unique {
  const std::int32_t* key;
  const index_t* expert_row;
  matrix_view<const T> unique;  // the chunk's unique rows
  matrix_view<T> expert;
  EPMOE_HD void operator()(index_t i, index_t h0, index_t h1) const {
    const T* src = unique.row(key[i]);
    T* dst = expert.row(expert_row[i]);
    for (index_t h = h0; h < h1; ++h) dst[h] = src[h];
  }
};

/// Dedup: unique row u = the weighted sum of its assignments' expert outputs, in the order
/// they were received (the same sum on every space); `unweighted`: the plain sum (backward:
/// the weights were applied to the dy rows).
template <class T>
struct weighted_unique_sum {
  const std::int32_t* order;  // received rows sorted by unique row (stable)
  const index_t* first;       // [U+1]: their first position per unique row
  const index_t* expert_row;
  const std::int64_t* meta;  // the chunk's received metadata
  matrix_view<const T> expert;
  matrix_view<T> unique;
  bool unweighted = false;
  EPMOE_HD void operator()(index_t u, index_t h0, index_t h1) const {
    for (index_t h = h0; h < h1; h += rows::piece) {
      const index_t n = h1 - h < rows::piece ? h1 - h : rows::piece;
      float acc[rows::piece] = {};
      for (index_t p = first[u]; p < first[u + 1]; ++p) {
        const std::int32_t i = order[p];
        const float w = unweighted ? 1.f : meta_weight(meta[i]);
        const T* src = expert.row(expert_row[i]) + h;
        for (index_t j = 0; j < n; ++j) acc[j] += w * to_float(src[j]);
      }
      T* out = unique.row(u) + h;
      for (index_t j = 0; j < n; ++j) out[j] = from_float<T>(acc[j]);
    }
  }
};

/// Hierarchical: relay row i of a chunk reaches the node's ranks in its mask; flag (g, i) of
/// a [G][n] array is whether it reaches local rank g (scanned: its row in the fan buffer).
struct mask_bits {
  const std::int64_t* mask;
  index_t n;
  index_t* flags;
  EPMOE_HD void operator()(index_t j) const {
    const index_t g = j / n, i = j - g * n;
    flags[j] = (mask[i] >> g) & 1;
  }
};

/// Hierarchical: relay row i -> its copy for each rank of the node it reaches (dispatch), or
/// relay row i = the sum of what those ranks sent back, in rank order (combine).
template <class T>
struct fan_rows {
  const std::int64_t* mask;  // [n]
  const index_t* at;         // [G][n]: row of each copy in `fan`
  index_t n;
  int G;
  matrix_view<T> relay;
  matrix_view<T> fan;
  bool reduce = false;
  EPMOE_HD void operator()(index_t i, index_t h0, index_t h1) const {
    const std::int64_t m = mask[i];
    T* r = relay.row(i);
    if (!reduce) {
      for (int g = 0; g < G; ++g)
        if ((m >> g) & 1) {
          T* d = fan.row(at[g * n + i]);
          for (index_t h = h0; h < h1; ++h) d[h] = r[h];
        }
      return;
    }
    for (index_t h = h0; h < h1; h += rows::piece) {
      const index_t w = h1 - h < rows::piece ? h1 - h : rows::piece;
      float acc[rows::piece] = {};
      for (int g = 0; g < G; ++g)
        if ((m >> g) & 1) {
          const T* src = fan.row(at[g * n + i]) + h;
          for (index_t j = 0; j < w; ++j) acc[j] += to_float(src[j]);
        }
      for (index_t j = 0; j < w; ++j) r[h + j] = from_float<T>(acc[j]);
    }
  }
};

/// Dedup backward at the expert rank, received assignment row i of a unit: its routing
/// weight's gradient g[i] = dy · out (out: the forward's expert output, saved), then dy times
/// the weight (the row the expert's backward takes; one expert row per received row).
template <class T>
struct dedup_weight_grad {
  const index_t* expert_row;  // [n]: row of received row i among the unit's expert rows
  const std::int64_t* meta;   // [n]
  matrix_view<T> expert;      // the unit's expert rows
  matrix_view<const T> saved;
  float* g;  // [n]
  EPMOE_HD void operator()(index_t i) const {
    const index_t e = expert_row[i];
    T* dy = expert.row(e);
    const T* out = saved.row(e);
    float d = 0.f;
    for (index_t h = 0; h < expert.cols; ++h) d += to_float(dy[h]) * to_float(out[h]);
    g[i] = d;
    const float w = meta_weight(meta[i]);
    for (index_t h = 0; h < expert.cols; ++h) dy[h] = from_float<T>(w * to_float(dy[h]));
  }
};

}  // namespace epmoe::exchange_ops
