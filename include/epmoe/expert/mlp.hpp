// SPDX-FileCopyrightText: 2026 The epmoe authors
// SPDX-License-Identifier: Apache-2.0
#pragma once

#include <array>
#include <string>

#include "epmoe/core/config.hpp"
#include "epmoe/core/macros.hpp"
#include "epmoe/core/numeric.hpp"
#include "epmoe/core/view.hpp"
#include "epmoe/expert/activation.hpp"

namespace epmoe::expert {

/// Non-gated expert FFN: y = W2 act(W1 x + b1) + b2 (Switch Transformer and NLLB-MoE: ReLU;
/// GShard, Switch's GELU variant: GELU). Biases = false: no b1, b2 (their views stay empty).
template <class Act, bool Biases = false>
struct mlp {
  static constexpr bool biases = Biases;

  /// This rank's L local experts, stacked; PyTorch [out, in] layout, element type T.
  template <class T>
  struct weights_of {
    stacked_view<const T> w1;    // [L, F, H] up projection
    stacked_view<const T> w2;    // [L, H, F] down projection
    stacked_view<const T> b1{};  // [L, 1, F] (Biases)
    stacked_view<const T> b2{};  // [L, 1, H] (Biases)
  };
  using weights = weights_of<float>;

  template <class T>
  static void validate(const weights_of<T>& w, index_t count, index_t hidden, index_t ffn,
                       const std::string& name) {
    detail::require_shape(w.w1, count, ffn, hidden, (name + ".w1").c_str());
    detail::require_shape(w.w2, count, hidden, ffn, (name + ".w2").c_str());
    if constexpr (Biases) {
      detail::require_shape(w.b1, count, 1, ffn, (name + ".b1").c_str());
      detail::require_shape(w.b2, count, 1, hidden, (name + ".b2").c_str());
    }
  }

  /// Two GEMMs of [rows, H] x [H, F] (and back): 2 FLOPs per multiply-add.
  static double flops_per_row(index_t hidden, index_t ffn) {
    return 4.0 * static_cast<double>(hidden) * static_cast<double>(ffn);
  }
  static index_t scratch_per_row(index_t ffn) { return ffn; }

  template <class T>
  static auto tensors(weights_of<T>& w) {
    if constexpr (Biases)
      return std::array<stacked_view<const T>*, 4>{&w.w1, &w.w2, &w.b1, &w.b2};
    else
      return std::array<stacked_view<const T>*, 2>{&w.w1, &w.w2};
  }
  template <class T>
  static weights_of<T> slice(const weights_of<T>& w, index_t first, index_t n) {
    if constexpr (Biases)
      return {w.w1.slice(first, n), w.w2.slice(first, n), w.b1.slice(first, n),
              w.b2.slice(first, n)};
    else
      return {w.w1.slice(first, n), w.w2.slice(first, n)};
  }

  /// Element i of a grouped [rows, cols] matrix (row stride `stride`): v = act(v + b[g]) or
  /// v + b[g], g the row's group (a binary search of the offsets; groups are few).
  template <class T, bool Activate>
  struct bias_rows {
    T* data;
    const T* bias;  // [groups, cols], group g at g * bias_stride (or null: no bias)
    index_t bias_stride, cols, stride;
    int groups;
    const index_t* offsets;  // [groups + 1] in the space's memory
    EPMOE_HD void operator()(index_t i) const {
      const index_t r = i / stride, c = i - r * stride;
      if (c >= cols) return;  // row padding: never read
      float v = to_float(data[i]);
      if (bias) {
        const index_t row = offsets[0] + r;
        int lo = 0, hi = groups;  // the group g with offsets[g] <= row < offsets[g + 1]
        while (hi - lo > 1) {
          const int mid = (lo + hi) / 2;
          (offsets[mid] <= row ? lo : hi) = mid;
        }
        v += to_float(bias[lo * bias_stride + c]);
      }
      if constexpr (Activate) v = Act::apply(v);
      data[i] = from_float<T>(v);
    }
  };

  /// Runs every local expert g on its rows of x (group g); the output overwrites x. scratch
  /// holds x.rows() * scratch_per_row elements.
  template <class Space, class T>
  static void forward(const Space& space, const weights_of<T>& w, grouped_rows<T> x, T* scratch,
                      T* keep = nullptr) {
    const index_t F = w.w1.rows, n = x.elements(F);
    if (n == 0) return;
    const grouped_rows<T> h = x.over(scratch, F);
    space.grouped_gemm_nt(x, w.w1, h);
    if (keep) {  // training without recompute: a = x W1ᵀ + b1 is kept for backward
      space.for_each(n, bias_rows<T, false>{h.data, Biases ? w.b1.data : nullptr, w.b1.batch_stride,
                                            F, h.stride, h.groups, h.device_offsets});
      space.for_each(n, copy_elements<T>{h.data, keep});
      space.for_each(
          n, bias_rows<T, true>{h.data, nullptr, 0, F, h.stride, h.groups, h.device_offsets});
    } else {
      space.for_each(n, bias_rows<T, true>{h.data, Biases ? w.b1.data : nullptr, w.b1.batch_stride,
                                           F, h.stride, h.groups, h.device_offsets});
    }
    space.grouped_gemm_nt(h, w.w2, x);
    if constexpr (Biases)
      space.for_each(x.elements(x.cols),
                     bias_rows<T, false>{x.data, w.b2.data, w.b2.batch_stride, x.cols, x.stride,
                                         x.groups, x.device_offsets});
  }

  // --- backward (docs/training.md) -------------------------------------------------------

  /// The gradients of the L local experts' weights, shaped like weights_of (b1, b2 empty
  /// without Biases).
  template <class G>
  struct grads_of {
    stacked_view<G> w1;    // [L, F, H]
    stacked_view<G> w2;    // [L, H, F]
    stacked_view<G> b1{};  // [L, 1, F] (Biases)
    stacked_view<G> b2{};  // [L, 1, H] (Biases)
  };
  using grads = grads_of<float>;
  template <class G>
  static grads_of<G> slice(const grads_of<G>& g, index_t first, index_t n) {
    if constexpr (Biases)
      return {g.w1.slice(first, n), g.w2.slice(first, n), g.b1.slice(first, n),
              g.b2.slice(first, n)};
    else
      return {g.w1.slice(first, n), g.w2.slice(first, n)};
  }
  template <class G>
  static auto tensors(grads_of<G>& g) {
    if constexpr (Biases)
      return std::array<stacked_view<G>*, 4>{&g.w1, &g.w2, &g.b1, &g.b2};
    else
      return std::array<stacked_view<G>*, 2>{&g.w1, &g.w2};
  }
  /// Checks a gradient bundle as validate() checks weights ("grads.experts.w1: ...").
  template <class G>
  static void validate(const grads_of<G>& g, index_t count, index_t hidden, index_t ffn,
                       const std::string& name) {
    if constexpr (Biases)
      validate(weights_of<G>{g.w1, g.w2, g.b1, g.b2}, count, hidden, ffn, name);
    else
      validate(weights_of<G>{g.w1, g.w2}, count, hidden, ffn, name);
  }

  /// Scratch elements per row of backward: the recomputed hidden layer and dh.
  static index_t backward_scratch_per_row(index_t ffn) { return 2 * ffn; }
  /// FLOPs per row of backward: dh, two dW and one dX GEMM, and with `recompute` the
  /// up-projection again (5 GEMMs of the forward's 2, else 4).
  static double backward_flops_per_row(index_t hidden, index_t ffn, bool recompute) {
    return (recompute ? 10.0 : 8.0) * static_cast<double>(hidden) * static_cast<double>(ffn);
  }
  /// Elements per row a training forward keeps (without recompute): a = x W1ᵀ + b1.
  static index_t keep_per_row(index_t ffn) { return ffn; }

  /// Element i of the [rows, F] hidden layers: from a = x W1ᵀ + b1 and dh = dy W2, writes
  /// h = act(a) over a and da = dh act'(a) over dh.
  template <class T>
  struct act_grad_rows {
    T *a, *dh;
    EPMOE_HD void operator()(index_t i) const {
      const float av = to_float(a[i]);
      dh[i] = from_float<T>(to_float(dh[i]) * Act::grad(av));
      a[i] = from_float<T>(Act::apply(av));
    }
  };

  /// Element i = g * cols + c of a [groups, cols] result: out[g][c] (+)= the sum of column c
  /// over group g's rows of `data` (the bias gradients; rows in order: deterministic).
  template <class T, class G>
  struct group_column_sum {
    const T* data;
    index_t cols, stride;
    const index_t* offsets;  // [groups + 1] in the space's memory
    G* out;
    index_t out_stride;  // between two groups' results
    bool accumulate;
    EPMOE_HD void operator()(index_t i) const {
      const index_t g = i / cols, c = i - g * cols;
      float s = 0.f;
      for (index_t r = offsets[g] - offsets[0]; r < offsets[g + 1] - offsets[0]; ++r)
        s += to_float(data[r * stride + c]);
      G& o = out[g * out_stride + c];
      o = from_float<G>(accumulate ? to_float(o) + s : s);
    }
  };

  /// The backward of forward() for the rows of every local expert g (group g), recomputing
  /// the hidden layer from the saved inputs x: dx = dL/dx (may be x or dy) and dL/dW of every
  /// tensor into `grads` (overwritten, or added to with `accumulate`). scratch holds
  /// x.rows() * backward_scratch_per_row(F) elements.
  template <class Space, class T, class G>
  static void backward(const Space& space, const weights_of<T>& w, grouped_rows<const T> x,
                       grouped_rows<const T> dy, grouped_rows<T> dx, const grads_of<G>& grads,
                       T* scratch, bool accumulate = false, const T* kept = nullptr) {
    const index_t F = w.w1.rows, n = x.elements(F);
    const grouped_rows<T> a = x.over(scratch, F), dh = x.over(scratch + n, F);
    if (n > 0) {
      if (kept) {  // the forward's a (act_grad_rows overwrites it)
        space.for_each(n, copy_elements<T>{kept, scratch});
      } else {
        space.grouped_gemm_nt(x, w.w1, a);
        space.for_each(
            n, bias_rows<T, false>{a.data, Biases ? w.b1.data : nullptr, w.b1.batch_stride, F,
                                   a.stride, a.groups, a.device_offsets});
      }
      space.grouped_gemm_nn(dy, w.w2, dh);  // dh = dy W2: [rows, H] x [H, F]
      space.for_each(n, act_grad_rows<T>{a.data, dh.data});
    }
    // dW2 = dyᵀ h, dW1 = daᵀ x (zeros for a group without rows); db2, db1: column sums; none
    // for frozen experts (empty gradient views).
    const bool dw = grads.w1.data != nullptr;
    if (dw) {
      space.grouped_gemm_tn_accumulate(dy, grouped_rows<const T>(a), grads.w2, accumulate);
      space.grouped_gemm_tn_accumulate(grouped_rows<const T>(dh), x, grads.w1, accumulate);
    }
    if constexpr (Biases) {
      const index_t H = w.w2.rows;
      if (dw && x.groups > 0) {
        space.for_each(x.groups * H,
                       group_column_sum<T, G>{dy.data, H, dy.stride, dy.device_offsets,
                                              grads.b2.data, grads.b2.batch_stride, accumulate});
        space.for_each(x.groups * F,
                       group_column_sum<T, G>{dh.data, F, dh.stride, dh.device_offsets,
                                              grads.b1.data, grads.b1.batch_stride, accumulate});
      }
    }
    if (n > 0) space.grouped_gemm_nn(grouped_rows<const T>(dh), w.w1, dx);  // dx = da W1
  }

  /// Local expert j alone on rows x [n, H] (tests, calibration).
  template <class Space, class T>
  static void forward(const Space& space, const weights_of<T>& w, index_t j, matrix_view<T> x,
                      T* scratch) {
    const index_t offsets[2] = {0, x.rows};
    forward(space, slice(w, j, 1), grouped_rows<T>{x.data, x.cols, x.stride, 1, offsets, offsets},
            scratch);
  }
};

}  // namespace epmoe::expert
