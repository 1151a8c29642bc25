// SPDX-FileCopyrightText: 2026 The epmoe authors
// SPDX-License-Identifier: Apache-2.0
#pragma once

#include <cstdint>
#include <cstring>

#include "epmoe/core/macros.hpp"
#include "epmoe/core/numeric.hpp"
#include "epmoe/core/routing.hpp"
#include "epmoe/core/view.hpp"

// Per-row and per-token functors of the forward pass, run by a space's for_each on host or
// device: the math of permute, routing and the weighted combine exists once. Row functors
// take (row, h0, h1) and do columns [h0, h1) of that row: the host hands out whole rows, a
// device pieces of rows. Sums run in float whatever the element type.
namespace epmoe::rows {

/// Copies n elements. On a device, a run of whole 16-byte words at 16-byte-aligned addresses
/// moves as 16-byte loads and stores (a warp's piece is then one coalesced transaction); the
/// host's loop vectorises as it is.
template <class T>
EPMOE_HD void copy_elements(T* dst, const T* src, index_t n) {
#if defined(__CUDA_ARCH__)
  constexpr index_t per = 16 / sizeof(T);
  if constexpr (16 % sizeof(T) == 0)
    if (n % per == 0 &&
        ((reinterpret_cast<std::uintptr_t>(dst) | reinterpret_cast<std::uintptr_t>(src)) & 15) ==
            0) {
      for (index_t i = 0; i < n; i += per)
        *reinterpret_cast<uint4*>(dst + i) = *reinterpret_cast<const uint4*>(src + i);
      return;
    }
#endif
  for (index_t h = 0; h < n; ++h) dst[h] = src[h];
}

/// acc[j] += w * src[j] for j < n, in float (on a device, whole aligned 16-byte words of src
/// load as such, as in copy_elements).
template <class T, index_t N>
EPMOE_HD void add_scaled(float (&acc)[N], const T* src, index_t n, float w) {
#if defined(__CUDA_ARCH__)
  constexpr index_t per = 16 / sizeof(T);
  if constexpr (16 % sizeof(T) == 0 && N % per == 0)
    if (n == N && (reinterpret_cast<std::uintptr_t>(src) & 15) == 0) {
      for (index_t i = 0; i < N; i += per) {
        const uint4 word = *reinterpret_cast<const uint4*>(src + i);
        alignas(16) T v[per];
        memcpy(v, &word, 16);  // a register's bytes: moves, not a memory copy
        for (index_t j = 0; j < per; ++j) acc[i + j] += w * to_float(v[j]);
      }
      return;
    }
#endif
  for (index_t j = 0; j < n; ++j) acc[j] += w * to_float(src[j]);
}

/// out[j] = acc[j] (+ add[j] when add is given) for j < n, converted to T. On a device a
/// whole piece at a 16-byte-aligned address is stored as 16-byte words (the 2-byte stores of
/// a bf16 row ran the weighted reduce at a third of a copy's bandwidth).
template <class T, index_t N>
EPMOE_HD void store_sum(T* out, const float (&acc)[N], const float* add, index_t n) {
#if defined(__CUDA_ARCH__)
  constexpr index_t per = 16 / sizeof(T);
  if constexpr (16 % sizeof(T) == 0 && N % per == 0)
    if (n == N && (reinterpret_cast<std::uintptr_t>(out) & 15) == 0) {
      for (index_t i = 0; i < N; i += per) {
        alignas(16) T v[per];
        for (index_t j = 0; j < per; ++j)
          v[j] = from_float<T>(add ? acc[i + j] + add[i + j] : acc[i + j]);
        *reinterpret_cast<uint4*>(out + i) = *reinterpret_cast<const uint4*>(v);
      }
      return;
    }
#endif
  for (index_t j = 0; j < n; ++j) out[j] = from_float<T>(add ? acc[j] + add[j] : acc[j]);
}

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

/// The router's backward of token t (its choice held fixed): dlogits[t] from the routing
/// weights' gradient g[t] (docs/training.md).
template <class Router>
struct backward_tokens {
  Router router;
  matrix_view<const float> logits;      // [T, E]
  matrix_view<const std::int32_t> ids;  // [T, K]
  matrix_view<const float> g;           // [T, K]
  matrix_view<float> dlogits;           // [T, E]
  // A router with a noise gate (noisy top-k): the forward's noise logits, token identities
  // and pass (the same draws), and dL/d(noise logits) [T, E]; else empty.
  matrix_view<const float> noise{};
  matrix_view<float> dnoise{};
  const std::int64_t* token_ids = nullptr;
  std::int64_t first_token = 0;
  std::uint64_t pass = 0;
  EPMOE_HD void operator()(index_t t) const {
    const token_input in{logits.row(t), noise.data ? noise.row(t) : nullptr,
                         static_cast<int>(logits.cols), token_ids ? token_ids[t] : first_token + t,
                         pass};
    if constexpr (requires(float* d) { router.backward_token(in, ids.row(t), g.row(t), d, d); })
      router.backward_token(in, ids.row(t), g.row(t), dlogits.row(t),
                            dnoise.data ? dnoise.row(t) : nullptr);
    else
      router.backward_token(in, ids.row(t), g.row(t), dlogits.row(t));
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
      copy_elements(o + h0, x.row(t) + h0, h1 - h0);
    }
  }
};

/// out row i = x row i.
template <class T>
struct copy {
  matrix_view<const T> x;
  matrix_view<T> out;
  EPMOE_HD void operator()(index_t i, index_t h0, index_t h1) const {
    copy_elements(out.row(i) + h0, x.row(i) + h0, h1 - h0);
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

/// Zero (identity) experts, token t: into[t] = (or +=) s_t x[t], s_t the sum of t's weights
/// at ids >= E (LongCat-Flash: such an expert returns its input). Backward: x = dy gives dx's
/// term.
template <class T>
struct add_identity {
  matrix_view<const T> x;               // [T, H]
  matrix_view<const std::int32_t> ids;  // [T, K]
  matrix_view<const float> weights;     // [T, K]
  int experts;                          // E: ids at or past it are zero experts
  float* into;                          // [T, H]
  bool first;                           // write instead of add
  EPMOE_HD void operator()(index_t t, index_t h0, index_t h1) const {
    float s = 0.f;
    for (index_t k = 0; k < ids.cols; ++k)
      if (ids(t, k) >= experts) s += weights(t, k);
    float* o = into + t * x.cols;
    const T* src = x.row(t);
    for (index_t h = h0; h < h1; ++h) o[h] = (first ? 0.f : o[h]) + s * to_float(src[h]);
  }
};

/// Zero experts' weight gradient, token t: g[t, k] = dy[t] · x[t] at ids >= E (other slots
/// untouched: the routed experts' gradients come from their rows).
template <class T>
struct identity_weight_grad {
  matrix_view<const T> x, dy;           // [T, H]
  matrix_view<const std::int32_t> ids;  // [T, K]
  int experts;
  matrix_view<float> g;  // [T, K]
  EPMOE_HD void operator()(index_t t) const {
    float d = 0.f;
    bool any = false;
    for (index_t k = 0; k < ids.cols; ++k) any = any || ids(t, k) >= experts;
    if (!any) return;
    for (index_t h = 0; h < x.cols; ++h) d += to_float(dy.row(t)[h]) * to_float(x.row(t)[h]);
    for (index_t k = 0; k < ids.cols; ++k)
      if (ids(t, k) >= experts) g.row(t)[k] = d;
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
/// experts' sum, when given); without weights (null data) the plain sum (dx in backward).
template <class T>
struct weighted_reduce {
  matrix_view<const T> back;          // [send rows, H]: expert outputs, home again
  const std::int32_t* slot;           // [T*K]
  matrix_view<const float> weights;   // [T, K]
  const float* shared;                // [T, H] or nullptr
  matrix_view<T> y;                   // [T, H]
  const index_t* verdicts = nullptr;  // every rank's call header (valid, kind, pass, chunks),
  index_t stride = 0;                 //   `stride` apart: with one rejected input or one other
  int ranks = 0;                      //   call nothing is written (static shapes)
  EPMOE_HD void operator()(index_t t, index_t h0, index_t h1) const {
    const index_t K = weights.cols;
    for (int r = 0; verdicts && r < ranks; ++r) {
      const index_t* v = verdicts + r * stride;
      if (v[0] == 0 || v[1] != verdicts[1] || v[2] != verdicts[2] || v[3] != verdicts[3]) return;
    }
    for (index_t h = h0; h < h1; h += piece) {
      const index_t n = h1 - h < piece ? h1 - h : piece;
      float acc[piece] = {};
      for (index_t k = 0; k < K; ++k) {
        const std::int32_t s = slot[t * K + k];
        if (s < 0) continue;                                 // dropped: contributes nothing
        const float w = weights.data ? weights(t, k) : 1.f;  // none: a plain sum (backward)
        add_scaled(acc, back.row(s) + h, n, w);
      }
      store_sum(y.row(t) + h, acc, shared ? shared + t * y.cols + h : nullptr, n);
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
        add_scaled(acc, back.row(u) + h, n, 1.f);
      }
      store_sum(y.row(t) + h, acc, shared ? shared + t * y.cols + h : nullptr, n);
    }
  }
};

// --- backward (docs/training.md) ---------------------------------------------------------

/// The routing weights' gradient of token t: g[t, k] = dy[t] · back[slot[t, k]] (the expert's
/// output, home again), 0 for a dropped assignment or an empty slot.
template <class T>
struct routing_weight_grad {
  matrix_view<const T> dy;    // [T, H]
  matrix_view<const T> back;  // [send rows, H]
  const std::int32_t* slot;   // [T*K]
  matrix_view<float> g;       // [T, K]
  EPMOE_HD void operator()(index_t t) const {
    for (index_t k = 0; k < g.cols; ++k) {
      const std::int32_t s = slot[t * g.cols + k];
      float d = 0.f;
      if (s >= 0) {
        const T* a = dy.row(t);
        const T* b = back.row(s);
        for (index_t h = 0; h < dy.cols; ++h) d += to_float(a[h]) * to_float(b[h]);
      }
      g.row(t)[k] = d;
    }
  }
};

/// Dedup: g[t, k] = back[slot[t, k]], the routing weight's gradient the expert rank sent
/// home (per assignment row, as plan.meta), 0 when dropped.
struct gather_weight_grad {
  const float* back;
  const std::int32_t* slot;
  matrix_view<float> g;
  EPMOE_HD void operator()(index_t t) const {
    for (index_t k = 0; k < g.cols; ++k) {
      const std::int32_t s = slot[t * g.cols + k];
      g.row(t)[k] = s >= 0 ? back[s] : 0.f;
    }
  }
};

/// The combine's backward at home: send row slot[t, k] = weight[t, k] * dy[t] for every
/// assignment not dropped (the rows the dispatch then carries to the experts).
template <class T>
struct scatter_weighted {
  matrix_view<const T> dy;           // [T, H]
  const std::int32_t* slot;          // [T*K]
  matrix_view<const float> weights;  // [T, K]
  matrix_view<T> out;                // [send rows, H]
  EPMOE_HD void operator()(index_t t, index_t h0, index_t h1) const {
    for (index_t k = 0; k < weights.cols; ++k) {
      const std::int32_t s = slot[t * weights.cols + k];
      if (s < 0) continue;
      const float w = weights(t, k);
      const T* src = dy.row(t);
      T* o = out.row(s);
      for (index_t h = h0; h < h1; ++h) o[h] = from_float<T>(w * to_float(src[h]));
    }
  }
};

/// out row t = s[t] * x row t (s null: 1): a shared expert's output gradient.
template <class T>
struct scaled_copy {
  matrix_view<const T> x;
  const float* scale;
  matrix_view<T> out;
  EPMOE_HD void operator()(index_t t, index_t h0, index_t h1) const {
    const float s = scale ? scale[t] : 1.f;
    for (index_t h = h0; h < h1; ++h) out.row(t)[h] = from_float<T>(s * to_float(x.row(t)[h]));
  }
};

/// A shared expert's gate backward, token t: with s = σ(x · g) (held in `scale`) and o the
/// expert's output, d[t] = (dy[t] · o[t]) s (1 - s), the gradient of the gate's logit.
template <class T>
struct sigmoid_dot_grad {
  matrix_view<const T> dy, out;
  const float* scale;
  float* d;
  EPMOE_HD void operator()(index_t t) const {
    float v = 0.f;
    for (index_t h = 0; h < dy.cols; ++h) v += to_float(dy.row(t)[h]) * to_float(out.row(t)[h]);
    d[t] = v * scale[t] * (1.f - scale[t]);
  }
};

/// Column h of a [rows, H] matrix summed over its rows, each times w[row] (w null: 1), into
/// out[h] (or added to it): an output bias's or a shared gate's gradient, rows in order.
template <class T, class G>
struct column_sum {
  matrix_view<const T> x;
  const float* w;
  G* out;
  bool accumulate;
  EPMOE_HD void operator()(index_t h) const {
    float s = 0.f;
    for (index_t t = 0; t < x.rows; ++t) s += (w ? w[t] : 1.f) * to_float(x.row(t)[h]);
    out[h] = from_float<G>(accumulate ? to_float(out[h]) + s : s);
  }
};

/// into row t (float, [rows, H]) += d[t] * v: a gate logit's gradient into x (v = the gate row).
template <class T>
struct add_outer {
  float* into;
  index_t cols;
  const float* d;
  const T* v;  // [H]
  EPMOE_HD void operator()(index_t t, index_t h0, index_t h1) const {
    for (index_t h = h0; h < h1; ++h) into[t * cols + h] += d[t] * to_float(v[h]);
  }
};

}  // namespace epmoe::rows
